//! Two `trainer` processes (one over RDMA, one over TCP) against a real `ps-server` cluster
//! (1 mini-pod × 2 shards) on loopback; then SIGTERM mid-run, an unreachable cluster and a
//! bad config. Every child process is killed when the test ends, pass or fail.
//!
//! `ps-server` is another package's binary: `bex_testkit::bins` builds it for this test's
//! profile (a no-op when fresh), or takes it from `BEX_BIN_DIR`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use bex_process::child::Guard;
use bex_report::TrainerReport;
use bex_testkit::LocalCluster;
use bex_transport_kind::TransportKind;

fn trainer_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_trainer"))
}

/// configs/local.toml reshaped to 1 pod × 2 shards, ports of test `salt`, `trainer` settings
/// merged into its `[trainer]`; as a cluster of this test (nothing started).
fn cluster(name: &str, salt: u16, trainer: &str) -> LocalCluster {
    let mut cfg = bex_testkit::fixtures::local_config();
    cfg.cluster.pods = 1;
    cfg.cluster.shards = 2;
    cfg.cluster.training_pod = 0;
    cfg.cluster.base_port = bex_testkit::ports::base_port(salt, 8, 2);
    cfg.cluster.name = format!("trainer-test-{salt}");
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
    LocalCluster::new(&format!("trainer-{name}"), cfg, bex_testkit::bins::ps_server())
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

/// The trainer's report, read as the type its readers use (and saying what it is).
fn read_report(path: &Path) -> TrainerReport {
    let text = std::fs::read_to_string(path).expect("the trainer wrote its report");
    let v: serde_json::Value = serde_json::from_str(&text).expect("the report is JSON");
    assert_eq!(v["kind"], "trainer");
    serde_json::from_value(v).expect("the report is a trainer's")
}

#[test]
fn two_trainers_learn_one_model_then_sigterm_reports_and_exits_zero() {
    let mut c = cluster("learn", 0, "");
    c.start();
    let (config, dir) = (c.config.clone(), c.dir().to_path_buf());

    let run = ["--steps", "80", "--eval-every", "20", "--quiet"];
    let jsons = [dir.join("t1.json"), dir.join("t2.json")];
    let mut a = Guard::spawn(&mut trainer(&config, 1, "rdma", &jsons[0], &run), "trainer 1")
        .expect("trainer 1");
    let mut b = Guard::spawn(&mut trainer(&config, 2, "tcp", &jsons[1], &run), "trainer 2")
        .expect("trainer 2");
    // Five minutes at most, then the guards kill both.
    let limit = Duration::from_secs(300);
    let (sa, sb) = (a.wait_exit(limit).unwrap(), b.wait_exit(limit).unwrap());
    assert!(sa.success() && sb.success(), "trainers exited {sa} and {sb}");

    for (path, transport) in jsons.iter().zip([TransportKind::Rdma, TransportKind::Tcp]) {
        let r = read_report(path);
        eprintln!(
            "{transport}: AUC {:.4} -> {:.4}, log-loss {:.4} -> {:.4}, {:.0} samples/s",
            r.auc_initial, r.auc_final, r.log_loss_initial, r.log_loss_final, r.samples_per_s
        );
        assert_eq!(r.transport, transport);
        assert_eq!((r.steps, r.errors), (80, 0));
        assert!(r.samples > 0);
        assert!(r.auc_final > r.auc_initial + 0.05, "AUC did not rise: {r:?}");
        assert!(r.log_loss_final < r.log_loss_initial, "log-loss did not fall");
        // Start, every 20 steps, no extra final point (step 80 is one).
        let steps: Vec<u64> = r.eval.iter().map(|p| p.step).collect();
        assert_eq!(steps, vec![0, 20, 40, 60, 80]);
        assert_eq!((r.fetch_latency.count, r.push_latency.count), (80, 80));
        assert!(r.fetch_latency.p99_us >= r.fetch_latency.p50_us && r.fetch_latency.p50_us > 0.0);
        assert!(r.message_bytes.fetch_response.mean > 1000.0);
        assert!(!r.interrupted);
        assert!(r.rpc("calls") > 0, "the RPC counters are in the report: {:?}", r.rpc);
        assert!(r.cpu.user_s + r.cpu.sys_s > 0.0);
    }
    assert!(read_report(&jsons[0]).rnic("tx_packets") > 0, "RDMA sent packets");
    let tcp = read_report(&jsons[1]);
    assert_eq!(tcp.rpc("tcp_calls"), tcp.rpc("calls"));

    // SIGTERM during a long run: finish the step, evaluate, report, exit 0.
    let json = dir.join("t3.json");
    let mut t3 = trainer(&config, 3, "rdma", &json, &["--seconds", "120", "--eval-every", "5"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("trainer 3");
    let err = t3.stderr.take().expect("piped stderr");
    let t3 = Guard::new(t3, "trainer 3");
    let mut lines = BufReader::new(err).lines();
    // Wait for a progress line after some training.
    loop {
        let l = lines.next().expect("trainer 3 printed progress").expect("stderr line");
        if l.contains("step=") && !l.contains("step=0 ") {
            break;
        }
    }
    // Killed after 60 s: a trainer that ignores SIGTERM fails the test, not hangs it.
    let status = t3.terminate(Duration::from_secs(60)).expect("trainer 3 reaped");
    assert!(status.success(), "SIGTERM exit: {status}");
    let r = read_report(&json);
    assert!(r.interrupted);
    assert!(r.steps >= 5 && r.steps < 5000, "{} steps", r.steps);
    assert_eq!(r.errors, 0);
}

#[test]
fn an_unreachable_cluster_exits_1_and_a_bad_config_exits_2() {
    // Nothing listens on these ports.
    let c = cluster("fail", 1, "connect_deadline_s = 1.5");
    let (config, dir) = (c.config.clone(), c.dir().to_path_buf());
    let out = trainer(&config, 1, "tcp", &dir.join("x.json"), &["--quiet"])
        .output()
        .expect("run trainer");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cluster unreachable"), "{out:?}");

    let bad = cluster("bad", 1, "table = \"no_such_table\"");
    let out = trainer(&bad.config, 1, "tcp", &dir.join("x.json"), &[]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("trainer.table"), "{out:?}");
    let out = Command::new(trainer_bin()).arg("--bogus").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    // A report path that cannot be written is found before the run, not after it (the
    // cluster is unreachable: exit 1 would mean it was found only at the end).
    let missing = dir.join("no-such-dir/x.json");
    let out = trainer(&config, 1, "tcp", &missing, &["--quiet"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-dir"), "{out:?}");
}
