//! The `ranker` binary against a real 1-pod × 2-shard cluster of `ps-server` processes on
//! loopback, over RDMA (the software RNIC) and over TCP; plus trace generation and replay,
//! and the exit codes of bad config and an unreachable cluster. Every child is killed when
//! the test ends, pass or fail.
//!
//! `ps-server` is another package's binary: `bex_testkit::bins` builds it for this test's
//! profile (a no-op when fresh), or takes it from `BEX_BIN_DIR`.

use std::path::Path;
use std::process::Command;

use bex_ps_proto::Config;
use bex_testkit::LocalCluster;
use serde_json::Value;

/// Test `salt` gets ports `base + 10·salt ..` of this process's block.
fn base_port(salt: u16) -> u16 {
    bex_testkit::ports::base_port(salt, 10, 2)
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

/// The ranker's tables on 1 pod × 2 shards at `port`, `ranker` as `[ranker]`.
fn config(name: &str, port: u16, ranker: &str) -> Config {
    let extra = "
[server]
checkpoint_interval_s = 0
checkpoint_on_shutdown = false
restore_on_start = false

[rpc]
# Loopback under a test harness on 2 shared cores: generous deadlines.
connect_timeout_ms = 500
request_timeout_ms = 1000
";
    let text = bex_testkit::fixtures::ranker_cluster(extra, ranker);
    let mut cfg = Config::from_toml_str(&text).expect("the test's config parses");
    cfg.cluster.name = name.into();
    cfg.cluster.base_port = port;
    cfg
}

/// The test's cluster (`bex_testkit::LocalCluster`; `ps-server` built for this profile).
struct Cluster(LocalCluster);

impl Cluster {
    /// Writes the config; starts the servers if `start`.
    fn new(name: &str, salt: u16, ranker: &str, start: bool) -> Cluster {
        let cfg = config(&format!("rk-{name}"), base_port(salt), ranker);
        let bin = bex_testkit::bins::ps_server();
        let mut c = Cluster(LocalCluster::new(&format!("ranker-{name}"), cfg, bin));
        if start {
            c.0.start();
        }
        c
    }

    fn ranker(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_ranker"))
            .args(["--config", path(&self.0.config), "--quiet"])
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
    let json = c.0.dir().join(format!("{name}.json"));
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
    let trace = c.0.dir().join("trace.jsonl");
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
