//! Runs the real `ps-bench --quick` (which spawns a real `ps-server`), checks its report is
//! sane, its figures are written, and that no server child is left behind.
//!
//! `ps-server` comes from `bex_testkit::bins` (built for this test's profile, a no-op when
//! fresh; or from `BEX_BIN_DIR`).

use std::path::PathBuf;
use std::process::Command;

use bex_process::child::Guard;
use serde_json::Value;

/// `ps-server` processes whose command line names `ps-bench`'s per-process directory.
fn leftover_servers(bench_pid: u32) -> Vec<String> {
    let wanted = format!("bex-ps-bench-{bench_pid}/");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("ps-server") && cmdline.contains(&wanted) {
            found.push(cmdline);
        }
    }
    found
}

#[test]
fn quick_run_writes_sane_json_and_figures_and_reaps_its_server() {
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ps-bench-quick-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let json = out_dir.join("ps-bench.json");
    let server = bex_testkit::bins::ps_server();
    let child = Guard::spawn(
        Command::new(env!("CARGO_BIN_EXE_ps-bench"))
            .args(["--quick", "--quiet", "--out", out_dir.to_str().unwrap()])
            .arg("--server")
            .arg(&server)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
        "ps-bench",
    )
    .expect("ps-bench starts");
    let pid = child.id();
    let out = child.output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ps-bench --quick failed:\n{text}");
    assert!(leftover_servers(pid).is_empty(), "ps-server left behind: {:?}", leftover_servers(pid));
    assert!(text.contains("RDMA / TCP"), "table printed:\n{text}");

    let doc: Value = serde_json::from_slice(&std::fs::read(&json).expect("JSON written")).unwrap();
    for svg in ["ps-bench-latency.svg", "ps-bench-cpu.svg"] {
        let text = std::fs::read_to_string(out_dir.join(svg)).expect("figure written");
        assert!(
            text.starts_with("<svg")
                && text.contains("rdma p50") == (svg == "ps-bench-latency.svg"),
            "{svg}"
        );
    }
    let tables = std::fs::read_to_string(out_dir.join("tables.txt")).unwrap();
    assert!(tables.contains("RDMA / TCP"), "{tables}");
    let _ = std::fs::remove_dir_all(&out_dir);
    assert_eq!(doc["tool"], "ps-bench");
    assert!(doc["version"].is_string());
    assert!(doc["placement"].is_object(), "{}", doc["placement"]);
    assert_eq!(doc["quick"], true);
    let cmd: Vec<&str> =
        doc["command_line"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(cmd.contains(&"--quick"), "{cmd:?}");
    assert_eq!(doc["settings"]["keys"], serde_json::json!([100, 1000]));
    assert!(doc["server"].as_str().unwrap().starts_with("ready"), "{}", doc["server"]);
    assert!(doc["setup"]["rpc_request_timeout_ms"].as_u64().unwrap() >= 1000);
    // The RDMA cells really ran over RDMA (no TCP calls, no fallback).
    assert_eq!(doc["rdma_client_tcp_calls_and_fallbacks"], 0, "{}", doc["rdma_client_rpc_stats"]);
    assert!(doc["transport"]["eager_max"].as_u64().unwrap() > 0);

    // 2 ops × 2 modes × 2 key counts × 2 outstanding × 2 transports.
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 32, "{results:?}");
    for r in results {
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["dim"], 64);
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {r}"));
        assert!(0.0 < f("p50_us"), "{r}");
        assert!(f("p50_us") <= f("p99_us") && f("p99_us") <= f("p999_us"), "{r}");
        assert!(f("p999_us") <= f("max_us") && f("mean_us") <= f("max_us"), "{r}");
        assert!(f("requests_per_s") > 0.0, "{r}");
        let keys = r["keys"].as_f64().unwrap();
        assert!((f("keys_per_s") / f("requests_per_s") - keys).abs() < 0.01 * keys, "{r}");
        assert!(["rdma", "tcp"].contains(&r["transport"].as_str().unwrap()), "{r}");
    }
    let ratios = doc["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 16);
    for r in ratios {
        assert!(r["p99_rdma_over_tcp"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["p99_target_met"].is_boolean(), "{r}");
    }
    // Four latency targets, each reported for both transports.
    let targets = doc["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 8, "{targets:?}");
    for t in targets {
        assert!(t["met"].is_boolean() && t["value_us"].as_f64().unwrap() > 0.0, "{t}");
    }
}
