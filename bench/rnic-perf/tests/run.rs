//! Runs the real binary: `rnic-perf run` spawns its server child, measures, writes JSON, and
//! leaves no process behind.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn rnic_perf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rnic-perf")).args(args).output().expect("rnic-perf runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A per-test port that shows up in the server child's command line (`--rnic-port P+1`), so
/// a leftover child can be found. Nothing binds it in the baseline tests.
fn marker_port(salt: u16) -> u16 {
    // Below Linux's ephemeral range (32768..), where clients' port-0 sockets land.
    11_000 + (std::process::id() % 20_000) as u16 + salt * 3
}

/// Server children still alive whose command line carries `--rnic-port <port + 1>`.
fn leftover_servers(port: u16) -> Vec<String> {
    let wanted = format!("--rnic-port\0{}\0", port + 1);
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).into_owned();
        if cmdline.contains("server\0") && cmdline.contains(&wanted) {
            found.push(cmdline.replace('\0', " "));
        }
    }
    found
}

fn run_json(test: &str, salt: u16) -> Value {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rnic-perf-{test}-{}.json", std::process::id()));
    let port = marker_port(salt).to_string();
    let args = ["run", "--test", test, "--sizes", "64", "--iters", "200", "--quiet"];
    let out =
        rnic_perf(&[&args[..], &["--rnic-port", &port, "--json", path.to_str().unwrap()]].concat());
    assert!(out.status.success(), "rnic-perf run failed:\n{}", text(&out));
    assert!(leftover_servers(marker_port(salt)).is_empty(), "server child left behind");
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).expect("JSON written")).unwrap();
    let _ = std::fs::remove_file(&path);
    doc
}

fn check_latency(doc: &Value, test: &str) {
    let cmd: Vec<&str> =
        doc["command_line"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(&cmd[1..4], &["run", "--test", test], "{cmd:?}");
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{results:?}");
    let r = &results[0];
    assert!(r["test"].as_str().unwrap().starts_with(test), "{r}");
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["size"], 64);
    let lat = &r["latency"];
    let f = |k: &str| lat[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {lat}"));
    let samples = lat["count"].as_u64().unwrap();
    // UDP rounds that needed a resend are left out; anything else is all 200.
    if test == "udp_lat" {
        assert!(samples > 0 && samples <= 200, "{lat}");
    } else {
        assert_eq!(samples, 200, "{lat}");
    }
    assert!(f("min_us") > 0.0, "{lat}");
    assert!(f("p50_us") >= f("min_us"), "{lat}");
    assert!(f("p99_us") >= f("p50_us"), "{lat}");
    assert!(f("max_us") >= f("p99_us"), "{lat}");
    assert!(f("p50_us") < 100_000.0, "a loopback round trip under 100 ms: {lat}");
    let hist = r["rtt_ns_histogram"].as_array().unwrap();
    let counted: u64 = hist.iter().map(|b| b[1].as_u64().unwrap()).sum();
    assert_eq!(counted, samples);
}

#[test]
fn tcp_lat_run_reports_sane_numbers() {
    check_latency(&run_json("tcp_lat", 0), "tcp_lat");
}

#[test]
fn udp_lat_run_reports_sane_numbers() {
    check_latency(&run_json("udp_lat", 1), "udp_lat");
}

#[test]
fn rnic_runs_on_the_software_rnic_report_sane_numbers() {
    for test in ["send_lat", "write_lat"] {
        check_latency(&run_json_rdma(test, 2), test);
    }
}

fn run_json_rdma(test: &str, salt: u16) -> Value {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rnic-perf-{test}-{}.json", std::process::id()));
    let port = marker_port(salt).to_string();
    let args = ["run", "--test", test, "--no-baselines", "--sizes", "64", "--iters", "200"];
    let out = rnic_perf(
        &[&args[..], &["--quiet", "--rnic-port", &port, "--json", path.to_str().unwrap()]].concat(),
    );
    assert!(out.status.success(), "rnic-perf run failed:\n{}", text(&out));
    assert!(leftover_servers(marker_port(salt)).is_empty(), "server child left behind");
    let doc: Value = serde_json::from_slice(&std::fs::read(&path).expect("JSON written")).unwrap();
    let _ = std::fs::remove_file(&path);
    doc
}

#[test]
fn bad_input_fails_cleanly() {
    let out = rnic_perf(&["run", "--sizes", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("at least 1 byte"), "{}", text(&out));
    let out = rnic_perf(&["run", "--test", "nope"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = rnic_perf(&["client", "--test", "tcp_lat"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--server"), "{}", text(&out));
    // Port 1 on loopback: nobody listens there.
    let out = rnic_perf(&["client", "--server", "127.0.0.1:1", "--test", "tcp_lat"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("cannot reach an rnic-perf server"), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}
