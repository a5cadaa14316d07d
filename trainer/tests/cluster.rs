//! Two `trainer` processes (one over RDMA, one over TCP) against a real `ps-server` cluster
//! (1 mini-pod × 2 shards) on loopback; then SIGTERM mid-run, an unreachable cluster and a
//! bad config. Every child process is killed when the test ends, pass or fail.
//!
//! Finding `ps-server`: Cargo only gives a test the binaries of its own package
//! (`CARGO_BIN_EXE_*`), so the test runs `cargo build -p bex-ps-server --bin ps-server` with
//! the profile and target directory of the `trainer` binary under test (a no-op when it is
//! up to date; this also rebuilds a stale one) and uses the binary next to `trainer`.
//! `BEX_PS_SERVER=/path/to/ps-server` skips the build.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use bex_ps_core::Config;
use serde_json::Value;

/// Children killed (and reaped) on drop, and a temp dir removed.
struct Procs {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn trainer_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_trainer"))
}

fn ps_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BEX_PS_SERVER") {
        return PathBuf::from(p);
    }
    // target/<profile>/trainer → build ps-server into the same place.
    let profile_dir = trainer_bin().parent().expect("trainer has a directory");
    let target_dir = profile_dir.parent().expect("profile dir has a parent");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "--quiet", "-p", "bex-ps-server", "--bin", "ps-server", "--target-dir"])
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(other) => {
            cmd.args(["--profile", other]);
        }
        None => panic!("cannot tell the build profile of {}", trainer_bin().display()),
    }
    let status = cmd.status().expect("run cargo to build ps-server");
    assert!(status.success(), "building ps-server failed: {status}");
    let bin = profile_dir.join("ps-server");
    assert!(bin.exists(), "no ps-server at {}", bin.display());
    bin
}

/// Test `salt` gets ports `base + 8·salt ..`, in one block per test process that was
/// free below the ephemeral range when first asked for.
fn base_port(salt: u16) -> u16 {
    static BASE: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    let base =
        *BASE.get_or_init(|| bex_process::free_local_ports(16).expect("free loopback ports"));
    assert!(salt < 2, "salt {salt} is outside the block");
    base + salt * 8
}

/// configs/local.toml reshaped to 1 pod × 2 shards in a temp dir; returns its path.
fn cluster_config(dir: &Path, salt: u16, trainer: &str) -> (PathBuf, Config) {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/local.toml"))
            .expect("configs/local.toml");
    let mut cfg = Config::from_toml_str(&text).expect("local.toml is valid");
    cfg.cluster.pods = 1;
    cfg.cluster.shards = 2;
    cfg.cluster.training_pod = 0;
    cfg.cluster.base_port = base_port(salt);
    cfg.cluster.name = format!("trainer-test-{salt}");
    cfg.cluster.data_dir = dir.join("data");
    cfg.server.checkpoint_interval_s = 0;
    cfg.server.checkpoint_on_shutdown = false;
    // Debug builds under a test harness on 2 cores: generous deadlines.
    cfg.rpc.connect_timeout_ms = 500;
    cfg.rpc.request_timeout_ms = 1000;
    if !trainer.is_empty() {
        for (k, v) in toml::from_str::<toml::Table>(trainer).expect("test TOML") {
            cfg.trainer.insert(k, v);
        }
    }
    cfg.validate().expect("test config is valid");
    let path = dir.join("cluster.toml");
    std::fs::write(&path, cfg.to_toml_string().expect("serializes")).expect("write config");
    (path, cfg)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bex-trainer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn start_servers(procs: &mut Procs, config: &Path, shards: u32) {
    let bin = ps_server_bin();
    for shard in 0..shards {
        let mut child = Command::new(&bin)
            .args(["--config", config.to_str().expect("utf-8 path"), "--pod", "0", "--shard"])
            .arg(shard.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ps-server starts");
        let out = child.stdout.take().expect("piped stdout");
        procs.children.push(child);
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).expect("read ps-server's first line");
        assert!(line.starts_with("ready"), "ps-server did not come up: {line:?}");
    }
}

fn trainer(config: &Path, id: u64, transport: &str, json: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(trainer_bin());
    c.arg("--config")
        .arg(config)
        .args(["--id", &id.to_string(), "--transport", transport, "--json"])
        .arg(json)
        .args(extra);
    c
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("the trainer wrote its report");
    serde_json::from_str(&text).expect("the report is JSON")
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn two_trainers_learn_one_model_then_sigterm_reports_and_exits_zero() {
    let dir = temp_dir("learn");
    let mut procs = Procs { dir: dir.clone(), children: Vec::new() };
    let (config, _) = cluster_config(&dir, 0, "");
    start_servers(&mut procs, &config, 2);

    let run = ["--steps", "80", "--eval-every", "20", "--quiet"];
    let jsons = [dir.join("t1.json"), dir.join("t2.json")];
    let mut a = trainer(&config, 1, "rdma", &jsons[0], &run).spawn().expect("trainer 1");
    let mut b = trainer(&config, 2, "tcp", &jsons[1], &run).spawn().expect("trainer 2");
    let (sa, sb) = (a.wait().expect("wait 1"), b.wait().expect("wait 2"));
    assert!(sa.success() && sb.success(), "trainers exited {sa} and {sb}");

    for (path, transport) in jsons.iter().zip(["rdma", "tcp"]) {
        let r = read_json(path);
        eprintln!(
            "{transport}: AUC {:.4} -> {:.4}, log-loss {:.4} -> {:.4}, {:.0} samples/s",
            f(&r, "auc_initial"),
            f(&r, "auc_final"),
            f(&r, "log_loss_initial"),
            f(&r, "log_loss_final"),
            f(&r, "samples_per_s")
        );
        assert_eq!(r["kind"], "trainer");
        assert_eq!(r["transport"], transport);
        assert_eq!(r["steps"], 80);
        assert_eq!(r["errors"], 0);
        assert!(f(&r, "samples") > 0.0);
        assert!(f(&r, "auc_final") > f(&r, "auc_initial") + 0.05, "AUC did not rise: {r}");
        assert!(f(&r, "log_loss_final") < f(&r, "log_loss_initial"), "log-loss did not fall");
        // Start, every 20 steps, no extra final point (step 80 is one).
        let steps: Vec<u64> = r["eval"]
            .as_array()
            .expect("eval list")
            .iter()
            .filter_map(|p| p["step"].as_u64())
            .collect();
        assert_eq!(steps, vec![0, 20, 40, 60, 80]);
        assert_eq!(r["fetch_latency"]["count"], 80);
        assert!(f(&r["fetch_latency"], "p99_us") >= f(&r["fetch_latency"], "p50_us"));
        assert!(f(&r["message_bytes"]["fetch_response"], "mean") > 1000.0);
        assert_eq!(r["interrupted"], false);
        for key in ["push_latency", "rpc", "rnic", "cpu"] {
            assert!(r[key].is_object(), "{key} missing");
        }
    }
    assert!(read_json(&jsons[0])["rnic"]["tx_packets"].as_u64() > Some(0), "RDMA sent packets");
    assert_eq!(read_json(&jsons[1])["rpc"]["tcp_calls"], read_json(&jsons[1])["rpc"]["calls"]);

    // SIGTERM during a long run: finish the step, evaluate, report, exit 0.
    let json = dir.join("t3.json");
    let mut c = trainer(&config, 3, "rdma", &json, &["--seconds", "120", "--eval-every", "5"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("trainer 3");
    let err = c.stderr.take().expect("piped stderr");
    let pid = c.id();
    procs.children.push(c);
    let mut lines = BufReader::new(err).lines();
    // Wait for a progress line after some training.
    loop {
        let l = lines.next().expect("trainer 3 printed progress").expect("stderr line");
        if l.contains("step=") && !l.contains("step=0 ") {
            break;
        }
    }
    let killed = Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill");
    assert!(killed.success());
    let status = procs.children.last_mut().expect("trainer 3").wait().expect("wait 3");
    assert!(status.success(), "SIGTERM exit: {status}");
    let r = read_json(&json);
    assert_eq!(r["interrupted"], true);
    assert!(f(&r, "steps") >= 5.0 && f(&r, "steps") < 5000.0);
    assert_eq!(r["errors"], 0);
}

#[test]
fn an_unreachable_cluster_exits_1_and_a_bad_config_exits_2() {
    let dir = temp_dir("fail");
    let _procs = Procs { dir: dir.clone(), children: Vec::new() };
    // Nothing listens on these ports.
    let (config, _) = cluster_config(&dir, 1, "connect_deadline_s = 1.5");
    let out = trainer(&config, 1, "tcp", &dir.join("x.json"), &["--quiet"])
        .output()
        .expect("run trainer");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cluster unreachable"), "{out:?}");

    let (config, _) = cluster_config(&dir, 1, "table = \"no_such_table\"");
    let out = trainer(&config, 1, "tcp", &dir.join("x.json"), &[]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("trainer.table"), "{out:?}");
    let out = Command::new(trainer_bin()).arg("--bogus").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
}
