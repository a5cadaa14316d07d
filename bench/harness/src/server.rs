//! The two-process shape every bex benchmark has (perftest's): a server announces its control
//! address on stdout and serves sessions; `run` spawns the server as a child of the same
//! executable on loopback, waits for the announcement, runs the client and reaps the child.
//!
//! No sleeping anywhere: readiness is a line on a pipe (bounded by a timeout). The child is
//! always reaped: on success its stdin is closed and a `--die-with-parent` server exits on
//! that; on any error or panic [`Guard`]'s `Drop` kills and waits for it; and if this process
//! dies, the child's stdin closes and it exits by itself.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

pub use bex_process::child::Guard;

use crate::error::{io, Error, Result};

/// How long a server child may take to announce its control port.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// The first words of the line with which `tool`'s server announces its control address.
pub fn ready_prefix(tool: &str) -> String {
    format!("{tool} server listening on ")
}

/// Prints `tool`'s ready line for `addr` on stdout (and flushes it).
pub fn announce(tool: &str, addr: SocketAddr) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}{addr}", ready_prefix(tool)).map_err(io("writing the ready line"))?;
    out.flush().map_err(io("writing the ready line"))
}

/// Opens `tool`'s control port on `bind:port` and announces it; with `die_with_parent`, this
/// process exits when its stdin closes from then on.
pub fn listen(
    tool: &str,
    bind: std::net::IpAddr,
    port: u16,
    die_with_parent: bool,
) -> Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind((bind, port))
        .map_err(io(format!("cannot listen on {bind}:{port}")))?;
    announce(tool, listener.local_addr().map_err(io("control: local address"))?)?;
    if die_with_parent {
        exit_when_stdin_closes()?;
    }
    Ok(listener)
}

/// Says on stderr (unless `quiet`) that `peer`'s session ended, or logs why it failed.
pub fn session_ended<E: std::fmt::Display>(
    tool: &str,
    peer: SocketAddr,
    quiet: bool,
    result: &std::result::Result<(), E>,
) {
    match result {
        Ok(()) if !quiet => eprintln!("{tool} server: session from {peer} done"),
        Ok(()) => {}
        Err(e) => tracing::error!(%peer, error = %e, "session failed"),
    }
}

/// Exits this process as soon as its standard input closes, so a server spawned by another
/// process never outlives it (`--die-with-parent`).
pub fn exit_when_stdin_closes() -> Result<()> {
    std::thread::Builder::new()
        .name("die-with-parent".into())
        .spawn(|| {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while let Ok(n) = stdin.read(&mut sink) {
                if n == 0 {
                    break;
                }
            }
            // The parent is gone (or done): nothing may outlive it.
            std::process::exit(0);
        })
        .map(drop)
        .map_err(io("spawning the stdin watcher"))
}

/// Spawns this executable as `tool`'s server on 127.0.0.1 (`server --bind 127.0.0.1 --port 0
/// --once --die-with-parent`, then `args`), pinned to `cpu` when given, and waits for its
/// control address.
pub fn spawn_local(tool: &str, args: &[String], cpu: Option<usize>) -> Result<(Guard, SocketAddr)> {
    let exe = std::env::current_exe().map_err(io(format!("locating the {tool} executable")))?;
    let mut cmd = Command::new(exe);
    cmd.args(["server", "--bind", "127.0.0.1", "--port", "0", "--once", "--die-with-parent"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(cpu) = cpu {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    let mut guard = Guard::spawn(&mut cmd, format!("{tool} server"))?;
    let line = guard.wait_line(&ready_prefix(tool), READY_TIMEOUT)?;
    let addr = line.parse().map_err(|_| {
        Error::Protocol(format!("the server child announced {line:?}, not an address"))
    })?;
    Ok((guard, addr))
}

/// Closes the server child's stdin and reaps it; an unclean exit is logged, not an error
/// (the client's results are complete by then).
pub fn finish(guard: Guard) -> Result<()> {
    let name = guard.name().to_string();
    let status = guard.finish()?;
    if !status.success() {
        tracing::warn!(child = %name, %status, "the server child did not exit cleanly");
    }
    Ok(())
}
