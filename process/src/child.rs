//! The one child-process guard: whatever happens to the parent's code (an error, a panic, an
//! early return), a child it started is killed and reaped.
//!
//! A child announces readiness with a line on stdout ([`Guard::wait_line`]); after that line
//! its stdout keeps being drained (echoed to stderr with the child's name) so it never blocks
//! on, or dies of, a full or closed pipe. [`Guard::finish`] closes the child's stdin (a
//! child that exits on EOF, like `--die-with-parent` servers, stops by itself) and reaps it;
//! [`Guard::terminate`] sends SIGTERM, waits a grace period, then kills. Dropping a guard
//! that was not reaped kills the child and waits for it, so no zombie or orphan remains.
//!
//! Readiness and exit are waited for on channels and `waitpid`, never by sleeping in a loop,
//! except [`Guard::wait_within`] (and [`Guard::terminate`]'s grace period through it), which
//! polls `try_wait` (there is no portable way to wait for a child with a timeout).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Output};
use std::sync::mpsc;
use std::time::Duration;

/// Why a child could not be started, did not become ready, or could not be reaped.
#[derive(Debug)]
pub enum ChildError {
    /// Spawning, reading from or waiting for the child failed.
    Io {
        /// Which child.
        name: String,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The child exited before printing its ready line.
    Exited {
        /// Which child.
        name: String,
        /// How it ended.
        status: ExitStatus,
    },
    /// The child's first line is not the ready line it was expected to print.
    UnexpectedLine {
        /// Which child.
        name: String,
        /// What it printed.
        line: String,
    },
    /// The child printed nothing within the timeout.
    Timeout {
        /// Which child.
        name: String,
        /// How long was waited.
        after: Duration,
    },
    /// The child, expected to exit, still ran when the wait ended ([`Guard::wait_exit`]).
    StillRunning {
        /// Which child.
        name: String,
        /// How long was waited.
        after: Duration,
    },
}

impl std::fmt::Display for ChildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChildError::Io { name, what, source } => write!(f, "{name}: {what}: {source}"),
            ChildError::Exited { name, status } => {
                write!(f, "{name} exited before becoming ready ({status})")
            }
            ChildError::UnexpectedLine { name, line } => {
                write!(f, "unexpected first line from {name}: {line:?}")
            }
            ChildError::Timeout { name, after } => {
                write!(f, "{name} did not become ready within {after:?}")
            }
            ChildError::StillRunning { name, after } => {
                write!(f, "{name} still runs after {after:?}")
            }
        }
    }
}

impl std::error::Error for ChildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ChildError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A child process that is killed and reaped unless it was reaped already.
#[derive(Debug)]
pub struct Guard {
    child: Child,
    stdin: Option<ChildStdin>,
    name: String,
    reaped: bool,
}

impl Guard {
    /// Spawns `cmd` (its stdio as the caller set it up) as the child called `name` in errors
    /// and in the echo of its output.
    pub fn spawn(cmd: &mut Command, name: impl Into<String>) -> Result<Guard, ChildError> {
        let name = name.into();
        match cmd.spawn() {
            Ok(child) => Ok(Guard::new(child, name)),
            Err(source) => Err(ChildError::Io { name, what: "spawning", source }),
        }
    }

    /// Takes ownership of a spawned `child`.
    pub fn new(mut child: Child, name: impl Into<String>) -> Guard {
        let stdin = child.stdin.take();
        Guard { child, stdin, name: name.into(), reaped: false }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child's name, as errors give it.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn io(&self, what: &'static str) -> impl FnOnce(std::io::Error) -> ChildError + '_ {
        move |source| ChildError::Io { name: self.name.clone(), what, source }
    }

    /// Waits for the child's first stdout line (spawn it with `Stdio::piped()` stdout), which
    /// must start with `prefix`, and returns the rest of it, trimmed. Later lines are echoed
    /// to stderr as `name: line` until the child closes its stdout.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> Result<String, ChildError> {
        let Some(stdout) = self.child.stdout.take() else {
            return Err(ChildError::Io {
                name: self.name.clone(),
                what: "reading the ready line",
                source: std::io::Error::other("the child's stdout is not a pipe"),
            });
        };
        let (tx, rx) = mpsc::channel();
        let name = self.name.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            // Not `eprintln!`, which panics on a closed stderr: the thread must keep
            // draining the pipe whatever becomes of ours, or the child blocks writing.
            let mut err = std::io::stderr();
            for line in lines.map_while(Result::ok) {
                let _ = writeln!(err, "{name}: {line}");
            }
        });
        match rx.recv_timeout(timeout) {
            Ok(Some(Ok(line))) => match line.trim().strip_prefix(prefix) {
                Some(rest) => Ok(rest.trim().to_string()),
                None => Err(ChildError::UnexpectedLine { name: self.name.clone(), line }),
            },
            Ok(Some(Err(e))) => Err(self.io("reading the ready line")(e)),
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map_err(self.io("waiting"))?;
                self.reaped = true;
                Err(ChildError::Exited { name: self.name.clone(), status })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(ChildError::Timeout { name: self.name.clone(), after: timeout })
            }
        }
    }

    /// The child's stdout (spawned `Stdio::piped()`), for a caller that reads it itself; the
    /// guard still kills and reaps the child. `None` once taken, or when it is not a pipe.
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// The child's exit status if it has exited (reaping it), without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, ChildError> {
        let status = self.child.try_wait().map_err(self.io("polling"))?;
        if status.is_some() {
            self.reaped = true;
        }
        Ok(status)
    }

    /// Reads the child's stdout and stderr (those spawned `Stdio::piped()`) to their ends and
    /// reaps it: `Command::output` under the guard, so a parent that fails or unwinds while
    /// waiting still kills the child.
    pub fn output(mut self) -> Result<Output, ChildError> {
        // A child reading its stdin gets EOF, as `Command::output` gives it.
        drop(self.stdin.take());
        // Both at once, or a child filling the one not being read would block for good.
        let stderr = self.child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut b = Vec::new();
                e.read_to_end(&mut b).map(|_| b)
            })
        });
        let mut stdout = Vec::new();
        if let Some(mut o) = self.child.stdout.take() {
            o.read_to_end(&mut stdout).map_err(self.io("reading stdout"))?;
        }
        let stderr = match stderr.map(std::thread::JoinHandle::join) {
            Some(Ok(read)) => read.map_err(self.io("reading stderr"))?,
            Some(Err(_)) => {
                return Err(self.io("reading stderr")(std::io::ErrorKind::Other.into()))
            }
            None => Vec::new(),
        };
        let status = self.finish()?;
        Ok(Output { status, stdout, stderr })
    }

    /// Closes the child's stdin and waits for it to exit.
    pub fn finish(mut self) -> Result<ExitStatus, ChildError> {
        drop(self.stdin.take());
        let status = self.child.wait().map_err(self.io("waiting"));
        self.reaped = true;
        status
    }

    /// Sends SIGTERM, waits up to `grace` for the child to exit, then kills it; reaps it
    /// either way.
    pub fn terminate(mut self, grace: Duration) -> Result<ExitStatus, ChildError> {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        // ESRCH only: it is a zombie already, and `wait` below reaps it.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        match self.wait_within(grace)? {
            Some(status) => Ok(status),
            None => self.kill(),
        }
    }

    /// Waits up to `limit` for the child to exit by itself: its status (reaped), or `None`
    /// if it still runs.
    pub fn wait_within(&mut self, limit: Duration) -> Result<Option<ExitStatus>, ChildError> {
        let deadline = crate::clock::now() + limit;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if crate::clock::now() >= deadline {
                return Ok(None);
            }
            pause(Duration::from_millis(10));
        }
    }

    /// Waits up to `limit` for a child that is expected to exit: its status (reaped), or
    /// `StillRunning` (the guard kills it when dropped).
    pub fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus, ChildError> {
        let status = self.wait_within(limit)?;
        status.ok_or_else(|| ChildError::StillRunning { name: self.name.clone(), after: limit })
    }

    /// Kills the child and reaps it.
    pub fn kill(&mut self) -> Result<ExitStatus, ChildError> {
        // An error only means it has exited already; `wait` reaps it either way.
        let _ = self.child.kill();
        let status = self.child.wait().map_err(self.io("waiting"));
        self.reaped = true;
        status
    }
}

#[allow(clippy::disallowed_methods)] // wait_within: polling a child, no fd to wait on
fn pause(d: Duration) {
    std::thread::sleep(d);
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Stdio;

    use super::*;

    fn spawn(program: &str, args: &[&str]) -> Guard {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        Guard::spawn(&mut cmd, program).expect("coreutils are installed")
    }

    fn exists(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn dropping_the_guard_kills_and_reaps_the_child() {
        // `cat` on a stdin the guard holds open would run forever.
        let guard = spawn("cat", &[]);
        let pid = guard.id();
        assert!(exists(pid));
        drop(guard);
        assert!(!exists(pid), "child still exists (or is a zombie)");
    }

    // More than a pipe holds on both streams: read together, neither blocks the child.
    #[test]
    fn output_reads_both_streams_to_their_ends_and_reaps() {
        let mut cmd = Command::new("sh");
        let script = "head -c 200000 /dev/zero; head -c 100000 /dev/zero >&2; cat; exit 3";
        cmd.args(["-c", script]).stdin(Stdio::piped()).stdout(Stdio::piped());
        cmd.stderr(Stdio::piped());
        let guard = Guard::spawn(&mut cmd, "sh").unwrap();
        let pid = guard.id();
        let out = guard.output().unwrap();
        assert_eq!((out.stdout.len(), out.stderr.len()), (200_000, 100_000));
        assert_eq!(out.status.code(), Some(3));
        assert!(!exists(pid), "reaped");
    }

    #[test]
    fn finishing_closes_stdin_and_reaps() {
        let status = spawn("cat", &[]).finish().unwrap();
        assert!(status.success());
    }

    #[test]
    fn terminate_sends_sigterm_then_kills_a_child_that_ignores_it() {
        let g = spawn("sleep", &["30"]);
        let pid = g.id();
        let status = g.terminate(Duration::from_secs(5)).unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(15));
        assert!(!exists(pid));
        let g = spawn("sh", &["-c", "trap '' TERM; echo up; while :; do sleep 0.01; done"]);
        let mut g = g;
        g.wait_line("up", Duration::from_secs(5)).unwrap();
        let status = g.terminate(Duration::from_millis(100)).unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
    }

    #[test]
    fn a_child_that_dies_or_babbles_is_not_ready() {
        let mut g = spawn("true", &[]);
        let e = g.wait_line("ready ", Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, ChildError::Exited { .. }), "{e}");
        assert!(e.to_string().contains("exited before becoming ready"), "{e}");
        let mut g = spawn("echo", &["hello"]);
        let e = g.wait_line("ready ", Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("unexpected first line"), "{e}");
        let mut g = spawn("echo", &["ready at 127.0.0.1:4242"]);
        assert_eq!(g.wait_line("ready at", Duration::from_secs(5)).unwrap(), "127.0.0.1:4242");
    }

    #[test]
    fn a_silent_child_times_out_and_is_still_reaped() {
        let mut g = spawn("cat", &[]);
        let pid = g.id();
        let e = g.wait_line("ready", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, ChildError::Timeout { .. }), "{e}");
        drop(g);
        assert!(!exists(pid));
    }

    #[test]
    fn waiting_for_an_exit_gives_the_status_or_says_the_child_still_runs() {
        let mut g = spawn("sh", &["-c", "exit 4"]);
        assert_eq!(g.wait_exit(Duration::from_secs(5)).unwrap().code(), Some(4));
        let mut g = spawn("cat", &[]);
        let e = g.wait_exit(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, ChildError::StillRunning { .. }), "{e}");
        assert_eq!(e.to_string(), "cat still runs after 50ms");
    }

    #[test]
    fn a_missing_program_is_a_clear_error() {
        let e = Guard::spawn(&mut Command::new("/nonexistent/bex-nothing"), "nothing").unwrap_err();
        assert!(e.to_string().starts_with("nothing: spawning:"), "{e}");
    }
}
