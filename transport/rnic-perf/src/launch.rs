//! `rnic-perf run`: the server as a child process of this executable, on loopback.
//!
//! The child is started with `server --port 0 --once --die-with-parent`; it binds, prints its
//! control address on stdout ([`crate::server::READY_LINE`]), and the client then proves it
//! ready by completing the control handshake on that port. No sleeping anywhere: readiness is a
//! line on a pipe (bounded by a timeout) and a TCP handshake. The child is always reaped: on
//! success its stdin is closed (it exits), on any error or panic [`ChildGuard`]'s `Drop` kills
//! and waits for it, and if this process dies its stdin closes and the child exits by itself.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::client::{run_client, ClientOptions};
use crate::error::{io, PerfError, Result};
use crate::report::JobResult;
use crate::server::READY_LINE;
use crate::spec::Plan;

/// How long the child may take to announce its control port.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A child process that is killed and reaped unless it was waited for.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    stdin: Option<ChildStdin>,
    reaped: bool,
    ready_prefix: &'static str,
    name: &'static str,
}

impl ChildGuard {
    /// Takes ownership of `child` (spawned with piped stdin and stdout), an `rnic-perf server`.
    pub fn new(child: Child) -> ChildGuard {
        ChildGuard::named(child, READY_LINE, "rnic-perf server")
    }

    /// Takes ownership of `child`, a server of another tool that announces itself with
    /// `ready_prefix` followed by its address; its later stdout lines are echoed to stderr
    /// prefixed with `name`.
    pub fn named(mut child: Child, ready_prefix: &'static str, name: &'static str) -> ChildGuard {
        let stdin = child.stdin.take();
        ChildGuard { child, stdin, reaped: false, ready_prefix, name }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the server's ready line and returns the control address in it.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<SocketAddr> {
        let stdout = self
            .child
            .stdout
            .take()
            .ok_or_else(|| PerfError::Protocol("server child has no stdout pipe".into()))?;
        let (tx, rx) = mpsc::channel();
        let name = self.name;
        // Reads the ready line, then keeps draining stdout so the child never blocks on (or
        // dies of) a full or closed pipe; ends with the child.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next();
            let _ = tx.send(first);
            for line in lines.map_while(std::result::Result::ok) {
                eprintln!("{name}: {line}");
            }
        });
        match rx.recv_timeout(timeout) {
            Ok(Some(Ok(line))) => {
                let addr = line.trim().strip_prefix(self.ready_prefix).unwrap_or("");
                addr.parse().map_err(|_| {
                    PerfError::Protocol(format!(
                        "unexpected first line from the server child: {line:?}"
                    ))
                })
            }
            Ok(Some(Err(e))) => Err(io("reading the server child's stdout")(e)),
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map_err(io("waiting for the server child"))?;
                self.reaped = true;
                Err(PerfError::Protocol(format!(
                    "the server child exited before becoming ready ({status})"
                )))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(PerfError::Timeout {
                what: "the server child to announce its control port",
                after: timeout,
            }),
        }
    }

    /// Closes the child's stdin (a `--die-with-parent` server exits on that) and reaps it.
    pub fn finish(mut self) -> Result<ExitStatus> {
        drop(self.stdin.take());
        let status = self.child.wait().map_err(io("waiting for the server child"));
        self.reaped = true;
        status
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if !self.reaped {
            // Errors only mean it is already gone; either way it is reaped below.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How [`run_local`] runs the two sides.
#[derive(Debug)]
pub struct LocalRun<'a> {
    /// With P > 0 the client's soft RNIC uses UDP port P and the server's P + 1.
    pub rnic_port: u16,
    /// The RNIC of both sides.
    pub nic: &'a bex_transport::NicSpec,
    /// Where the server child pins itself.
    pub server_cpu: Option<usize>,
    /// Print only errors.
    pub quiet: bool,
}

/// Spawns `rnic-perf server` as a child on 127.0.0.1, runs the client against it, and reaps
/// the child.
pub fn run_local(plan: &Plan, local: &LocalRun<'_>) -> Result<Vec<JobResult>> {
    let LocalRun { rnic_port, nic, server_cpu, quiet } = *local;
    let exe = std::env::current_exe().map_err(io("locating the rnic-perf executable"))?;
    let server_rnic_port = if rnic_port == 0 { 0 } else { rnic_port.wrapping_add(1) };
    let mut cmd = Command::new(exe);
    cmd.args(["server", "--bind", "127.0.0.1", "--port", "0", "--once", "--die-with-parent"])
        .args(["--rnic-port", &server_rnic_port.to_string()])
        .args(["--nic", &nic.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if quiet {
        cmd.arg("--quiet");
    }
    if let Some(cpu) = server_cpu {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    let child = cmd.spawn().map_err(io("spawning the server child"))?;
    let mut guard = ChildGuard::new(child);
    let server = guard.wait_ready(READY_TIMEOUT)?;
    let results = run_client(&ClientOptions { server, rnic_port, nic: nic.clone(), quiet }, plan)?;
    let status = guard.finish()?;
    if !status.success() {
        tracing::warn!(%status, "the server child did not exit cleanly");
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spawn(program: &str, args: &[&str]) -> ChildGuard {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("coreutils are installed");
        ChildGuard::new(child)
    }

    #[test]
    fn dropping_the_guard_kills_and_reaps_the_child() {
        // `cat` on a stdin the guard holds open would run forever.
        let guard = spawn("cat", &[]);
        let proc_dir = format!("/proc/{}", guard.child.id());
        assert!(std::path::Path::new(&proc_dir).exists());
        drop(guard);
        assert!(!std::path::Path::new(&proc_dir).exists(), "child still exists (or is a zombie)");
    }

    #[test]
    fn finishing_closes_stdin_and_reaps() {
        let status = spawn("cat", &[]).finish().unwrap();
        assert!(status.success());
    }

    #[test]
    fn a_child_that_dies_or_babbles_is_not_ready() {
        let mut g = spawn("true", &[]);
        let e = g.wait_ready(Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("exited before becoming ready"), "{e}");
        let mut g = spawn("echo", &["hello"]);
        let e = g.wait_ready(Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("unexpected first line"), "{e}");
        let mut g = spawn("echo", &["rnic-perf server listening on 127.0.0.1:4242"]);
        assert_eq!(
            g.wait_ready(Duration::from_secs(5)).unwrap(),
            "127.0.0.1:4242".parse().unwrap()
        );
        let child = Command::new("echo")
            .arg("other ready at 127.0.0.1:77")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut g = ChildGuard::named(child, "other ready at ", "other");
        assert_eq!(g.wait_ready(Duration::from_secs(5)).unwrap(), "127.0.0.1:77".parse().unwrap());
    }

    #[test]
    fn a_silent_child_times_out() {
        let mut g = spawn("cat", &[]);
        let e = g.wait_ready(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, PerfError::Timeout { .. }), "{e}");
    }
}
