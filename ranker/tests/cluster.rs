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
use bex_report::RankerReport;
use bex_testkit::LocalCluster;
use bex_transport_kind::TransportKind;
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

fn check_report(r: &RankerReport, transport: TransportKind) {
    assert_eq!(r.transport, transport);
    assert!(!r.interrupted);
    assert!(r.requests > 0, "no requests: {r:?}");
    assert_eq!(r.ok, r.requests, "first error: {:?}", r.first_error);
    assert_eq!((r.errors, r.timeouts, r.dropped), (0, 0, 0));
    for (key, l) in [("latency", &r.latency), ("subrequest_latency", &r.subrequest_latency)] {
        for (f, x) in
            [("mean", l.mean_us), ("p50", l.p50_us), ("p99", l.p99_us), ("p999", l.p999_us)]
        {
            assert!(x > 0.0, "{key}.{f}_us = {x}");
        }
        assert!(l.p50_us <= l.p99_us);
    }
    // Two models per request, each one sub-request latency.
    assert_eq!(r.subrequest_latency.count, 2 * r.requests);
    assert!(r.throughput_rps > 0.0);
    assert!(r.bytes_sent > 0 && r.bytes_received > r.bytes_sent);
    assert!(r.rpc("calls") > 0, "{:?}", r.rpc);
    // The ranker worked, and the machine's counters advanced over the run.
    assert!(r.cpu.ranker.user_s + r.cpu.ranker.sys_s > 0.0, "{:?}", r.cpu);
    let m = &r.cpu.machine;
    assert!(m.user_s + m.sys_s + m.idle_s > 0.0, "{:?}", r.cpu);
    assert!(!r.series.is_empty());
    if transport == TransportKind::Rdma {
        assert!(r.rnic("tx_packets") > 0, "rdma run sent no RNIC packets");
        // `rpc()` reads an absent counter as 0: the key must be there.
        assert_eq!(r.rpc.get("tcp_calls"), Some(&0), "rdma run fell back to tcp: {:?}", r.rpc);
    } else {
        assert_eq!(r.rnic("tx_packets"), 0);
    }
    // dense_refresh_s = 0.5 over a 2 s run.
    assert!(r.dense.refreshes >= 1, "{:?}", r.dense);
}

/// Runs the ranker with `--json` and reads the report back, as the launcher does: typed,
/// with its `"kind"` and the transport spelled as the config spells it.
fn run_json(c: &Cluster, name: &str, args: &[&str]) -> RankerReport {
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
    let v: Value = serde_json::from_str(&text).expect("report is JSON");
    assert_eq!(v["kind"], "ranker");
    assert!(matches!(v["transport"].as_str(), Some("rdma" | "tcp")), "{}", v["transport"]);
    serde_json::from_value(v).expect("a ranker report")
}

#[test]
fn ranks_against_a_real_cluster_over_rdma_and_tcp() {
    let c = Cluster::new("both", 0, RANKER, true);
    for transport in TransportKind::ALL {
        let r = run_json(&c, transport.name(), &["--transport", transport.name()]);
        check_report(&r, transport);
        eprintln!(
            "{transport}: {} requests, p50 {} µs, p99 {} µs",
            r.requests, r.latency.p50_us, r.latency.p99_us
        );
    }

    // A generated trace replays the same requests a live run with that seed sends.
    let trace = c.0.dir().join("trace.jsonl");
    let out = c.ranker(&["--generate-trace", path(&trace), "--seconds", "1", "--rate", "50"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = std::fs::read_to_string(&trace).expect("trace").lines().count() as u64;
    assert!(lines > 10, "{lines} trace lines");
    let r = run_json(&c, "replay", &["--trace", path(&trace), "--transport", "tcp"]);
    assert_eq!((r.requests, r.ok), (lines, lines));
    // As many requests of the same sizes: a live run with the trace's seed and schedule sends
    // as many bytes to the PS. (Fetch frames carry as many keys whatever their values, so
    // this does not tell the keys apart; `run::tests::live_schedule_equals_the_generated_trace`
    // compares the requests themselves.)
    let live = run_json(&c, "live", &["--seconds", "1", "--rate", "50", "--transport", "tcp"]);
    assert_eq!(
        (live.issued, live.ok, live.bytes_sent),
        (r.issued, r.ok, r.bytes_sent),
        "live {live:?}\nreplay {r:?}"
    );
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
