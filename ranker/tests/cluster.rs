//! The `ranker` binary against a real 1-pod × 2-shard cluster of `ps-server` processes on
//! loopback, over RDMA (the software RNIC) and over TCP; plus trace generation and replay,
//! and the exit codes of bad config and an unreachable cluster. Every child is killed when
//! the test ends, pass or fail.
//!
//! `ps-server` is another package's binary, so Cargo does not build it for these tests
//! (`CARGO_BIN_EXE_*` covers only this package's bins, and artifact dependencies are
//! unstable). The test looks for it next to its own `deps/` directory, i.e.
//! `target/<profile>/ps-server`, which `cargo build -p bex-ps-server` (same profile) puts
//! there; `BEX_PS_SERVER=/path/to/ps-server` overrides. Building it from inside the test
//! would need the build-directory lock that the running `cargo test` holds.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

fn ps_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BEX_PS_SERVER") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/cluster-<hash> → target/<profile>/ps-server
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let bin = profile_dir.join("ps-server");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p bex-ps-server` (same profile as this test) first, \
         or set BEX_PS_SERVER",
        bin.display()
    );
    bin
}

/// Children killed on drop, and a scratch directory removed.
struct Cluster {
    dir: PathBuf,
    config: PathBuf,
    procs: Vec<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Test `salt` gets ports `base + 10·salt ..`, in one block per test process that was
/// free below the ephemeral range when first asked for.
fn base_port(salt: u16) -> u16 {
    static BASE: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    let base =
        *BASE.get_or_init(|| bex_process::free_local_ports(20).expect("free loopback ports"));
    assert!(salt < 2, "salt {salt} is outside the block");
    base + salt * 10
}

const RANKER: &str = r#"
models = 2
models_per_request = 2
hidden = 16
candidates_min = 5
candidates_max = 200
rate = 100.0
seconds = 2.0
max_outstanding = 64
seed = 3
dense_refresh_s = 0.5
slots = [
    { table = "user", ids_fixed = 3, vocab = 100000, zipf_s = 1.05 },
    { table = "context", ids_fixed = 1, vocab = 1000 },
    { table = "item", ids_per_candidate = 1, vocab = 1000000, zipf_s = 0.9 },
]
"#;

fn config_text(name: &str, port: u16, data: &Path, ranker: &str) -> String {
    format!(
        r#"
[cluster]
name = "{name}"
pods = 1
shards = 2
host = "127.0.0.1"
base_port = {port}
data_dir = "{data}"

[server]
checkpoint_interval_s = 0
checkpoint_on_shutdown = false
restore_on_start = false

[[tables]]
name = "user"
dim = 16
[[tables]]
name = "item"
dim = 16
[[tables]]
name = "context"
dim = 8
[[tables]]
name = "dense"
dim = 32

[rpc]
# Loopback under a test harness on 2 shared cores: generous deadlines.
connect_timeout_ms = 500
request_timeout_ms = 1000

[ranker]
{ranker}
"#,
        data = data.display()
    )
}

impl Cluster {
    /// Writes the config; starts the servers if `start`.
    fn new(name: &str, salt: u16, ranker: &str, start: bool) -> Cluster {
        let dir = std::env::temp_dir().join(format!("bex-ranker-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let config = dir.join("cluster.toml");
        let text = config_text(&format!("rk-{name}"), base_port(salt), &dir.join("data"), ranker);
        std::fs::write(&config, text).expect("write config");
        let mut c = Cluster { dir, config, procs: Vec::new() };
        if start {
            let bin = ps_server_bin();
            for shard in 0..2 {
                let child = Command::new(&bin)
                    .args(["--config", path(&c.config), "--pod", "0", "--shard"])
                    .arg(shard.to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("ps-server starts");
                c.procs.push(child);
                let out = c.procs.last_mut().and_then(|p| p.stdout.take()).expect("stdout");
                let mut line = String::new();
                BufReader::new(out).read_line(&mut line).expect("ready line");
                assert!(line.starts_with("ready"), "ps-server did not come up: {line:?}");
            }
        }
        c
    }

    fn ranker(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_ranker"))
            .args(["--config", path(&self.config), "--quiet"])
            .args(args)
            .output()
            .expect("ranker runs")
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn check_report(v: &Value, transport: &str) {
    assert_eq!(v["kind"], "ranker");
    assert_eq!(v["transport"], transport);
    assert_eq!(v["interrupted"], false);
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {v}"));
    assert!(n("requests") > 0, "no requests: {v}");
    assert_eq!(n("ok"), n("requests"), "first error: {}", v["first_error"]);
    assert_eq!(n("errors"), 0);
    assert_eq!(n("timeouts"), 0);
    assert_eq!(n("dropped"), 0);
    for key in ["latency", "subrequest_latency"] {
        for f in ["mean_us", "p50_us", "p99_us", "p999_us"] {
            let x = v[key][f].as_f64().unwrap_or_else(|| panic!("{key}.{f} missing"));
            assert!(x > 0.0, "{key}.{f} = {x}");
        }
        assert!(v[key]["p50_us"].as_f64() <= v[key]["p99_us"].as_f64());
    }
    // Two models per request, each one sub-request latency.
    assert_eq!(v["subrequest_latency"]["count"].as_u64(), Some(2 * n("requests")));
    assert!(v["throughput_rps"].as_f64().is_some_and(|x| x > 0.0));
    assert!(n("bytes_sent") > 0 && n("bytes_received") > n("bytes_sent"));
    assert!(v["rpc"]["calls"].as_u64().is_some_and(|c| c > 0));
    assert!(v["cpu"]["ranker"]["user_s"].is_number());
    assert!(v["cpu"]["machine"]["softirq_s"].is_number());
    assert!(v["series"].as_array().is_some_and(|s| !s.is_empty()));
    let rnic_tx = v["rnic"]["tx_packets"].as_u64().unwrap_or(0);
    if transport == "rdma" {
        assert!(rnic_tx > 0, "rdma run sent no RNIC packets");
        assert_eq!(v["rpc"]["tcp_calls"], 0, "rdma run fell back to tcp: {}", v["rpc"]);
    } else {
        assert_eq!(rnic_tx, 0);
    }
    // dense_refresh_s = 0.5 over a 2 s run.
    assert!(v["dense"]["refreshes"].as_u64().is_some_and(|r| r >= 1), "{}", v["dense"]);
}

fn run_json(c: &Cluster, name: &str, args: &[&str]) -> Value {
    let json = c.dir.join(format!("{name}.json"));
    let mut all = args.to_vec();
    all.extend(["--json", path(&json)]);
    let out = c.ranker(&all);
    assert!(
        out.status.success(),
        "ranker {args:?}: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).expect("report written");
    serde_json::from_str(&text).expect("report is JSON")
}

#[test]
fn ranks_against_a_real_cluster_over_rdma_and_tcp() {
    let c = Cluster::new("both", 0, RANKER, true);
    for transport in ["rdma", "tcp"] {
        let v = run_json(&c, transport, &["--transport", transport]);
        check_report(&v, transport);
        eprintln!(
            "{transport}: {} requests, p50 {} µs, p99 {} µs",
            v["requests"], v["latency"]["p50_us"], v["latency"]["p99_us"]
        );
    }

    // A generated trace replays the same requests a live run with that seed sends.
    let trace = c.dir.join("trace.jsonl");
    let out = c.ranker(&["--generate-trace", path(&trace), "--seconds", "1", "--rate", "50"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = std::fs::read_to_string(&trace).expect("trace").lines().count() as u64;
    assert!(lines > 10, "{lines} trace lines");
    let v = run_json(&c, "replay", &["--trace", path(&trace), "--transport", "tcp"]);
    assert_eq!(v["requests"].as_u64(), Some(lines));
    assert_eq!(v["ok"].as_u64(), Some(lines));
}

#[test]
fn bad_config_exits_2_and_an_unreachable_cluster_exits_1() {
    let bad = RANKER.replace("table = \"context\"", "table = \"nope\"");
    let c = Cluster::new("bad", 1, &bad, false);
    let out = c.ranker(&[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown table \"nope\""), "{err}");

    let c = Cluster::new("down", 1, RANKER, false);
    assert_eq!(c.ranker(&["--rate", "0"]).status.code(), Some(2));
    let out = c.ranker(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}
