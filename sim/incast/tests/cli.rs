//! The real binary: `--quick` writes the report, bad usage exits 2.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bex-incast");

#[test]
fn quick_run_writes_json_svg_and_markdown() {
    let dir = std::env::temp_dir().join(format!("bex-incast-test-{}", std::process::id()));
    let out = Command::new(BIN)
        .args(["--quick", "--max-servers", "80", "--out"])
        .arg(&dir)
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("incast.json")).expect("json"))
            .expect("parses");
    for k in ["command", "base", "max_servers", "windows", "series", "wall_s"] {
        assert!(json.get(k).is_some(), "missing {k}");
    }
    let w = json["windows"].as_array().expect("windows");
    assert_eq!(w.len(), 4);
    let n: Vec<u64> = w.iter().map(|x| x["servers_before_pause"].as_u64().unwrap_or(0)).collect();
    // Smaller windows fit more servers before the first pause (4 KB, 8 KB, 16 KB, none).
    assert!(n[0] > n[1] && n[1] > n[2] && n[2] >= n[3] && n[3] > 0, "{n:?}");
    assert!(std::fs::read_to_string(dir.join("incast.svg")).expect("svg").starts_with("<svg"));
    assert!(std::fs::read_to_string(dir.join("incast.md")).expect("md").contains("| 4 KB |"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(BIN).arg("--max-servers").arg("nope").output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).args(["probe", "--params", "{"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(BIN).arg("--help").output().expect("runs");
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("--xoff-bytes"));
}
