//! `rnic-perf server`: listens on the TCP control port and serves client sessions.

use std::net::{IpAddr, SocketAddr, TcpStream};

use crate::backend;
use crate::baseline;
use crate::control::{unexpected, Control, Msg, PROTOCOL_VERSION};
use crate::error::{io, PerfError, Result};
use crate::launch::TOOL;
use crate::rdma::ServerSession;
use bex_bench::clock::Clock;
use bex_bench::Failure;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Address of the control listener.
    pub bind: IpAddr,
    /// Control port (0: ephemeral, printed).
    pub port: u16,
    /// UDP port of the server's RNIC (0: ephemeral).
    pub rnic_port: u16,
    /// The RNIC.
    pub nic: bex_transport::NicSpec,
    /// Serve one session, then return its result.
    pub once: bool,
    /// Exit when stdin closes.
    pub die_with_parent: bool,
    /// Print only errors.
    pub quiet: bool,
}

/// Runs the server: announces the control address on stdout, then serves sessions one at a
/// time (one, with `once`).
pub fn serve(opts: &ServerOptions) -> Result<()> {
    let listener = bex_bench::server::listen(TOOL, opts.bind, opts.port, opts.die_with_parent)?;
    loop {
        let (stream, peer) = listener.accept().map_err(io("control: accept"))?;
        if !opts.quiet {
            eprintln!("rnic-perf server: session from {peer}");
        }
        let result = session(stream, opts);
        bex_bench::server::session_ended(TOOL, peer, opts.quiet, &result);
        if opts.once {
            return result;
        }
    }
}

/// Serves one client session until `Bye`.
fn session(stream: TcpStream, opts: &ServerOptions) -> Result<()> {
    let clock = Clock;
    let mut ctrl = Control::new(stream)?;
    match ctrl.recv()? {
        Msg::Hello { version } => {
            ctrl.send(&Msg::Welcome { version: PROTOCOL_VERSION })?;
            if version != PROTOCOL_VERSION {
                return Err(PerfError::protocol(format!(
                    "client speaks protocol {version}, this server {PROTOCOL_VERSION}"
                )));
            }
        }
        m => return Err(unexpected("hello", &m)),
    }
    // Data sockets and the RNIC use the address the client reached.
    let ip = ctrl.stream().local_addr().map_err(io("control: local address"))?.ip();
    loop {
        match ctrl.recv()? {
            Msg::Job { spec } if !spec.test.is_rdma() => {
                match baseline::serve(&mut ctrl, &spec, ip) {
                    Ok(received) => ctrl.send(&Msg::Done { received })?,
                    Err(e) => {
                        let _ = ctrl.send(&Msg::Failed { message: format!("server: {e}") });
                        return Err(e);
                    }
                }
            }
            Msg::RdmaOpen => {
                let bind = SocketAddr::new(ip, opts.rnic_port);
                let user = ServerSession { ctrl: &mut ctrl, clock };
                match backend::with_device(&opts.nic, bind, user) {
                    Ok(session) => session?,
                    Err(e) => ctrl.send(&Msg::Failed { message: e.to_string() })?,
                }
            }
            Msg::Bye => return Ok(()),
            m => return Err(unexpected("a job, rdma_open or bye", &m)),
        }
    }
}
