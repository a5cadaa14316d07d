//! Leftovers of launchers that died without tearing down (SIGKILL, a crash): their network
//! namespaces (`bex-<pid>-*`) and the processes they recorded in
//! `<pid>.pids` in the user's own record directory ([`state_dir`]). Children normally die
//! with the launcher (pdeathsig); this is for the rest (a process stuck in a namespace, a
//! child that started while its parent was dying).

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::sys::signal::{kill, Signal};
use nix::unistd::{geteuid, Pid};

use crate::plan::ns_owner;

/// The directory of this user's launchers' records: `$XDG_RUNTIME_DIR/bex-cluster`, else
/// `<tmp>/bex-cluster-<uid>`. Per user and private ([`private_dir`]): the records name
/// processes a later launcher kills, so one shared `/tmp/bex-cluster` let any local user
/// plant a record (or a symlink) and have root's launcher SIGKILL any process or overwrite
/// any file.
pub fn state_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("bex-cluster"),
        None => std::env::temp_dir().join(format!("bex-cluster-{}", geteuid())),
    }
}

/// Creates `dir` (mode 0700) if missing, and checks it is a real directory owned by this
/// user that nobody else may write to; an error says which check failed.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::symlink_metadata(dir)?;
    let why = if !m.file_type().is_dir() {
        Some("is not a directory (a symlink?)".to_owned())
    } else if m.uid() != geteuid().as_raw() {
        Some(format!("belongs to uid {}, not this user", m.uid()))
    } else if m.mode() & 0o022 != 0 {
        Some(format!("may be written by others (mode {:o})", m.mode() & 0o777))
    } else {
        None
    };
    match why {
        Some(why) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("the launchers' record directory {} {why}: remove it", dir.display()),
        )),
        None => Ok(()),
    }
}

/// Whether `pid` is a running `bex-cluster` (a pid reused by another program is not, nor
/// is a zombie: a SIGKILLed launcher stays one until its parent reaps it).
pub fn launcher_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { return false };
    let state = stat[close + 1..].split_whitespace().next();
    &stat[open + 1..close] == "bex-cluster" && !matches!(state, Some("Z" | "X"))
}

/// A process's start time in clock ticks since boot (`/proc/<pid>/stat` field 22): with the
/// pid it names the process uniquely, so a recorded pid that was reused is left alone.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The launcher's record: one `pid start_time name` line per child.
#[derive(Debug)]
pub struct Record {
    path: PathBuf,
    lines: Vec<String>,
}

impl Record {
    /// The record of this launcher.
    pub fn new(launcher_pid: u32) -> std::io::Result<Record> {
        let dir = state_dir();
        private_dir(&dir)?;
        Ok(Record { path: dir.join(format!("{launcher_pid}.pids")), lines: Vec::new() })
    }

    /// Adds a child and rewrites the file.
    pub fn add(&mut self, pid: u32, name: &str) {
        let st = start_time(pid).unwrap_or(0);
        self.lines.push(format!("{pid} {st} {name}"));
        let _ = std::fs::write(&self.path, self.lines.join("\n") + "\n");
    }

    /// Removes the file (clean teardown).
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Network namespaces whose names start with `prefix`.
pub fn namespaces_with(prefix: &str) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).stderr(Stdio::null()).output();
    let Ok(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(String::from)
        .collect()
}

/// `/etc/netns/<ns>`: files `ip netns exec` mounts over `/etc` in the namespace (the run's
/// `hosts`).
pub fn netns_etc(ns: &str) -> std::path::PathBuf {
    std::path::Path::new("/etc/netns").join(ns)
}

/// Kills every process in namespace `ns` and deletes it with its `/etc/netns/<ns>`; errors
/// are returned as text.
pub fn delete_namespace(ns: &str) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(netns_etc(ns));
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).stderr(Stdio::null()).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(p) = pid.parse::<i32>() {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
        }
    }
    let out = Command::new("ip")
        .args(["netns", "del", ns])
        .output()
        .map_err(|e| format!("ip netns del {ns}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip netns del {ns}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Removes every leftover of dead launchers; returns what was done, one line each.
pub fn stale() -> Vec<String> {
    let mut done = Vec::new();
    let records = state_dir();
    let readable = match private_dir(&records) {
        Ok(()) => std::fs::read_dir(&records).ok(),
        Err(e) => {
            done.push(format!("records not read: {e}"));
            None
        }
    };
    if let Some(dir) = readable {
        for e in dir.flatten() {
            let path = e.path();
            // Only this user's own regular files (the directory admits no one else's).
            let ours = std::fs::symlink_metadata(&path)
                .is_ok_and(|m| m.file_type().is_file() && m.uid() == geteuid().as_raw());
            if !ours {
                continue;
            }
            let Some(owner) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".pids"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if launcher_alive(owner) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for line in text.lines() {
                let mut f = line.split_whitespace();
                let (Some(pid), Some(st), name) = (
                    f.next().and_then(|p| p.parse::<u32>().ok()),
                    f.next().and_then(|s| s.parse::<u64>().ok()),
                    f.next().unwrap_or("?"),
                ) else {
                    continue;
                };
                if start_time(pid) == Some(st) {
                    if let Ok(p) = i32::try_from(pid) {
                        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
                        done.push(format!("killed {name} (pid {pid}) of dead launcher {owner}"));
                    }
                }
            }
            let _ = std::fs::remove_file(&path);
        }
    }
    for ns in namespaces_with("bex-") {
        let Some(owner) = ns_owner(&ns) else { continue };
        if launcher_alive(owner) {
            continue;
        }
        match delete_namespace(&ns) {
            Ok(()) => done.push(format!("deleted namespace {ns} of dead launcher {owner}")),
            Err(e) => done.push(format!("could not delete {ns}: {e}")),
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The record directory is made private, and one that is a symlink, writable by others
    /// or another user's is refused (its records could name any process to kill).
    #[test]
    fn the_record_directory_must_be_this_users_and_private() {
        let base = std::env::temp_dir().join(format!("bex-cleanup-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let dir = base.join("records");
        private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "made private: {mode:o}");
        private_dir(&dir).expect("an existing private directory is fine");

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&dir).unwrap_err();
        assert!(e.to_string().contains("written by others"), "{e}");

        let link = base.join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = private_dir(&link).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");

        // Another user's (as root, where the tests run in CI; elsewhere chown is refused).
        let theirs = base.join("theirs");
        std::fs::DirBuilder::new().mode(0o700).create(&theirs).unwrap();
        if std::os::unix::fs::chown(&theirs, Some(12345), None).is_ok() {
            let e = private_dir(&theirs).unwrap_err();
            assert!(e.to_string().contains("uid 12345"), "{e}");
        }
        std::fs::remove_dir_all(&base).unwrap();
    }
}
