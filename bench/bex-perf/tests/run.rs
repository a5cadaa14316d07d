//! Runs the real binary: `bex-perf run --quick` spawns its server child, measures both
//! transports over the software RNIC and TCP on loopback, writes sane JSON, tables and
//! figures, and leaves no process behind; `hol-sim` runs without a server.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn bex_perf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bex-perf")).args(args).output().expect("bex-perf runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn tmp(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bex-perf-{name}-{}", std::process::id()))
}

/// Runs `bex-perf run --quick --test TEST` with JSON and an output directory.
fn run(test: &str) -> (Value, PathBuf, String) {
    let json = tmp(&format!("{test}.json"));
    let out_dir = tmp(&format!("{test}-out"));
    let args = [
        "run",
        "--quick",
        "--test",
        test,
        "--json",
        json.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let out = bex_perf(&args);
    let all = text(&out);
    assert!(out.status.success(), "bex-perf run failed:\n{all}");
    assert!(!all.contains("panicked"), "{all}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&json).expect("JSON written")).unwrap();
    let _ = std::fs::remove_file(&json);
    (doc, out_dir, String::from_utf8_lossy(&out.stdout).into_owned())
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

fn check_latency_point(p: &Value, iters: u64) {
    assert_eq!(p["status"], "ok", "{p}");
    let lat = &p["latency"];
    assert_eq!(lat["count"].as_u64(), Some(iters), "{lat}");
    assert!(f(lat, "min_us") > 0.0, "{lat}");
    assert!(f(lat, "p50_us") >= f(lat, "min_us"), "{lat}");
    assert!(f(lat, "p99_us") >= f(lat, "p50_us"), "{lat}");
    assert!(f(lat, "max_us") >= f(lat, "p99_us"), "{lat}");
    assert!(f(lat, "mean_us") >= f(lat, "min_us") && f(lat, "mean_us") <= f(lat, "max_us"));
    let counted: u64 =
        p["rtt_ns_histogram"].as_array().unwrap().iter().map(|b| b[1].as_u64().unwrap()).sum();
    assert_eq!(counted, iters);
}

#[test]
fn lat_runs_both_transports_in_two_processes_and_reaps_the_server() {
    let (doc, out_dir, stdout) = run("lat");
    let cmd: Vec<&str> =
        doc["command_line"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(&cmd[1..5], &["run", "--quick", "--test", "lat"], "{cmd:?}");
    assert_eq!(doc["tool"], "bex-perf");
    let pid = doc["server_pid"].as_u64().expect("a server ran") as u32;
    // No server left running after `run` returned (an orphan keeps its command line; a
    // zombie's would be empty, but once bex-perf exits init reaps those, so this test cannot
    // see one: the child guard's reaping is tested in `bex_process::child`).
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&cmdline).contains("bex-perf"), "server {pid} left behind");
    let points = doc["points"].as_array().unwrap();
    let iters = doc["plan"]["settings"]["iters"].as_u64().unwrap();
    let mut series = std::collections::BTreeSet::new();
    for p in points {
        assert_eq!(p["test"], "lat", "{p}");
        check_latency_point(p, iters);
        series.insert(p["series"].as_str().unwrap().to_string());
        let c = &p["client_counters"];
        let sent = c["messages_sent"].as_u64().unwrap();
        assert!(sent >= iters, "every round trip sent a message: {c}");
        assert_eq!(p["server_counters"]["messages_received"].as_u64(), Some(sent), "{p}");
        if p["job"]["kind"] == "rdma" {
            assert_eq!(c["engines_up"].as_u64(), Some(1), "one engine: {c}");
        }
    }
    assert_eq!(
        series.into_iter().collect::<Vec<_>>(),
        vec!["rdma".to_string(), "rdma spin".into(), "tcp".into()]
    );
    // Every size has an RDMA/TCP ratio.
    let ratios = doc["ratios"].as_array().unwrap();
    assert!(ratios
        .iter()
        .filter(|r| r["label"] == "rdma/tcp p50")
        .all(|r| r["value"].as_f64().unwrap() > 0.0));
    assert_eq!(ratios.iter().filter(|r| r["label"] == "rdma/tcp p50").count(), 3);
    assert!(stdout.contains("Fig. 8") && stdout.contains("rdma/tcp p50"), "{stdout}");
    for name in ["tables.txt", "bex-perf.json", "fig8-lat.svg"] {
        let body = std::fs::read_to_string(out_dir.join(name)).expect(name);
        assert!(!body.is_empty(), "{name}");
    }
    let svg = std::fs::read_to_string(out_dir.join("fig8-lat.svg")).unwrap();
    assert!(svg.contains("<polyline") && svg.contains("tcp p99"), "{svg}");
    let _ = std::fs::remove_dir_all(out_dir);
}

#[test]
fn hol_sim_runs_without_a_server_and_shows_fragmentation_helping() {
    let (doc, out_dir, _) = run("hol-sim");
    assert!(doc["server_pid"].is_null(), "no server for a simulation");
    let points = doc["points"].as_array().unwrap();
    assert!(!points.is_empty());
    let p99 = |series: &str, flows: u64| {
        let p = points
            .iter()
            .find(|p| p["series"] == series && p["x"].as_u64() == Some(flows))
            .unwrap_or_else(|| panic!("{series} x={flows} missing"));
        f(&p["latency"], "p99_us")
    };
    for p in points {
        assert_eq!(p["status"], "ok", "{p}");
        assert!(p["extra"]["virtual_ms"].as_f64().unwrap() > 0.0, "{p}");
    }
    let flows = points.iter().map(|p| p["x"].as_u64().unwrap()).max().unwrap();
    assert!(flows > 0);
    // Alone, the small flow sees about two link latencies; behind unfragmented 1 MB
    // messages it waits far longer than behind 4 KB fragments.
    assert!(p99("4K fragments", 0) < 20.0);
    assert!(p99("no fragmentation", flows) > 3.0 * p99("4K fragments", flows));
    assert!(out_dir.join("fig13-hol.svg").exists());
    let _ = std::fs::remove_dir_all(out_dir);
}

#[test]
fn bad_input_fails_cleanly() {
    let out = bex_perf(&["run", "--test", "nope"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = bex_perf(&["run", "--iters", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    // Port 1 on loopback: nobody listens there.
    let out = bex_perf(&["client", "--server", "127.0.0.1:1", "--test", "lat", "--quick"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("cannot reach a bex-perf server"), "{}", text(&out));
    // Loopback tests need a server.
    let out = bex_perf(&["client", "--test", "lat", "--quick"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--server"), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}
