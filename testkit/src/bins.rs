//! Another package's binary for a test: Cargo gives a test only its own package's binaries
//! (`CARGO_BIN_EXE_*`; artifact dependencies are unstable), so this builds the one asked for
//! with `cargo build` in the test's own profile and target directory (a no-op when fresh, and
//! it rebuilds a stale one) and returns its path. `BEX_BIN_DIR=DIR` takes it from DIR instead
//! (and `BEX_PS_SERVER=PATH`, ps-server from PATH).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// `bin` of `package`, built for this test's profile (once per process).
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    static BUILT: Mutex<Option<HashMap<String, PathBuf>>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let map = built.get_or_insert_with(HashMap::new);
    if let Some(p) = map.get(bin) {
        return p.clone();
    }
    let path = locate(package, bin);
    map.insert(bin.to_string(), path.clone());
    path
}

/// `ps-server`, built for this test's profile.
pub fn ps_server() -> PathBuf {
    workspace_bin("bex-ps-server", "ps-server")
}

fn locate(package: &str, bin: &str) -> PathBuf {
    // The older tests' name for ps-server's path.
    if let Some(p) = std::env::var_os("BEX_PS_SERVER").filter(|_| bin == "ps-server") {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("BEX_BIN_DIR") {
        let p = PathBuf::from(dir).join(bin);
        assert!(p.is_file(), "BEX_BIN_DIR has no {bin}: {}", p.display());
        return p;
    }
    // target/<profile>/deps/<test>-<hash> → target/<profile>
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let target_dir = profile_dir.parent().expect("a target directory");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "--quiet", "-p", package, "--bin", bin, "--target-dir"])
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
        None => panic!("cannot tell the build profile of {}", exe.display()),
    }
    let status = cmd.status().expect("cargo runs");
    assert!(status.success(), "cargo build -p {package} --bin {bin} failed: {status}");
    let p = profile_dir.join(bin);
    assert!(p.is_file(), "no {bin} at {}", p.display());
    p
}
