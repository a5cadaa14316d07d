//! `bex-perf server`: the responding process. Per job it starts the transports the client
//! asks for and answers every message on every socket accepted through them — the message
//! itself back when it is at most `echo_max` bytes (the received buffer is sent as it is: no
//! copy), else a short response — until the client finishes the job.

use bex_bench::Failure;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use bemalloc::Pool;
use bex_transport::{Msg, NicSpec};
use tokio::task::JoinHandle;

use crate::control::{unexpected, Control, Ctl, PROTOCOL_VERSION};
use crate::error::{io, BenchError, Result};
use crate::net::{
    add_counters, context_switches, counter_map, cpu_us, LazyNode, Socket, Transport,
};
use crate::spec::ServerSetup;

/// The tool's name, in its server's ready line and its reports.
pub const TOOL: &str = "bex-perf";

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Address of the control listener (transports and the RNIC bind to the address the
    /// client reached).
    pub bind: IpAddr,
    /// Control port (0: any, printed).
    pub port: u16,
    /// Serve one session, then return its result.
    pub once: bool,
    /// Exit when stdin closes.
    pub die_with_parent: bool,
    /// Print only errors.
    pub quiet: bool,
    /// Application (tokio) threads; 1 runs everything on one thread.
    pub app_threads: usize,
    /// The NIC the RDMA transports use.
    pub nic: NicSpec,
}

/// Builds the tokio runtime of a process: current-thread for 1 application thread, else a
/// multi-thread runtime with that many workers.
pub fn runtime(app_threads: usize) -> Result<tokio::runtime::Runtime> {
    let mut b = if app_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(app_threads);
        b
    };
    Ok(b.enable_all().build().map_err(io("starting the tokio runtime"))?)
}

/// Runs the server: announces the control address on stdout, then serves sessions one at a
/// time (one, with `once`).
pub fn serve(opts: &ServerOptions) -> Result<()> {
    let listener = bex_bench::server::listen(TOOL, opts.bind, opts.port, opts.die_with_parent)?;
    listener.set_nonblocking(true).map_err(io("control: set non-blocking"))?;
    let rt = runtime(opts.app_threads)?;
    rt.block_on(async {
        let listener =
            tokio::net::TcpListener::from_std(listener).map_err(io("control: listener"))?;
        loop {
            let (stream, peer) = listener.accept().await.map_err(io("control: accept"))?;
            if !opts.quiet {
                eprintln!("bex-perf server: session from {peer}");
            }
            let result = session(Control::new(stream)?, opts.quiet, &opts.nic).await;
            bex_bench::server::session_ended(TOOL, peer, opts.quiet, &result);
            if opts.once {
                return result;
            }
        }
    })
}

/// The transports of the current job and their accept loops.
struct Active {
    transports: Vec<Transport>,
    accepting: Vec<JoinHandle<()>>,
    /// Process CPU time when the job was set up.
    cpu_us_at_start: u64,
    /// Context switches of the process when the job was set up.
    csw_at_start: u64,
}

impl Active {
    /// Stops accepting, reads the counters (and the CPU time the process used since the
    /// setup, `cpu_us`), shuts the transports down (their sockets fail, so the responders
    /// end).
    fn stop(self) -> BTreeMap<String, u64> {
        for a in &self.accepting {
            a.abort();
        }
        let mut sum = BTreeMap::new();
        for t in &self.transports {
            add_counters(&mut sum, &counter_map(&t.counters()));
        }
        sum.insert("cpu_us".into(), cpu_us().saturating_sub(self.cpu_us_at_start));
        sum.insert("context_switches".into(), context_switches().saturating_sub(self.csw_at_start));
        for t in &self.transports {
            t.shutdown();
        }
        sum
    }
}

/// Serves one client session until `Bye`.
async fn session(mut ctrl: Control, quiet: bool, nic: &NicSpec) -> Result<()> {
    match ctrl.recv().await? {
        Ctl::Hello { version } => {
            ctrl.send(&Ctl::Welcome { version: PROTOCOL_VERSION, pid: std::process::id() }).await?;
            if version != PROTOCOL_VERSION {
                return Err(BenchError::protocol(format!(
                    "client speaks protocol {version}, this server {PROTOCOL_VERSION}"
                )));
            }
        }
        m => return Err(unexpected("hello", &m)),
    }
    let ip = ctrl.local_addr()?.ip();
    let mut node = LazyNode::new(nic.clone());
    let mut active: Option<Active> = None;
    loop {
        match ctrl.recv().await? {
            Ctl::Setup { setup } => {
                if let Some(a) = active.take() {
                    a.stop();
                }
                match start(&mut node, ip, &setup).await {
                    Ok(a) => {
                        let addrs = a.transports.iter().map(Transport::local_addr).collect();
                        active = Some(a);
                        ctrl.send(&Ctl::Ready { addrs }).await?;
                    }
                    Err(e) => {
                        if !quiet {
                            tracing::warn!(error = %e, "job setup failed (reported to the client)");
                        }
                        ctrl.send(&Ctl::Failed { message: format!("server: {e}") }).await?;
                    }
                }
            }
            Ctl::Finish => {
                let counters = active.take().map(Active::stop).unwrap_or_default();
                ctrl.send(&Ctl::Done { counters }).await?;
            }
            Ctl::Bye => {
                if let Some(a) = active.take() {
                    a.stop();
                }
                return Ok(());
            }
            m => return Err(unexpected("setup, finish or bye", &m)),
        }
    }
}

/// Starts a job's transports and their accept loops.
async fn start(node: &mut LazyNode, ip: IpAddr, setup: &ServerSetup) -> Result<Active> {
    let node = node.get(ip)?;
    let cfg = setup.knobs.config()?;
    let mut active = Active {
        transports: Vec::new(),
        accepting: Vec::new(),
        cpu_us_at_start: cpu_us(),
        csw_at_start: context_switches(),
    };
    for _ in 0..setup.transports.max(1) {
        let t = match node.start(setup.kind, ip, cfg.clone()).await {
            Ok(t) => t,
            Err(e) => {
                active.stop();
                return Err(e);
            }
        };
        let (pool, echo_max, ack) = (node.pool(), setup.echo_max, setup.ack_bytes);
        let t2 = t.clone();
        if setup.rpc {
            let stats = Arc::new(bex_rpc::ServerStats::default());
            let handler = Arc::new(SizedReplies { pool });
            active.accepting.push(tokio::spawn(bex_rpc::serve(t2, handler, stats)));
        } else {
            active.accepting.push(tokio::spawn(async move {
                while let Ok(s) = t2.accept().await {
                    tokio::spawn(respond(Arc::new(s), pool, echo_max, ack as usize));
                }
            }));
        }
        active.transports.push(t);
    }
    Ok(active)
}

/// `hol-rpc`'s server: a request body is the reply size (u64) and a sequence number (u64);
/// the reply is that many bytes, starting with the sequence number.
struct SizedReplies {
    pool: &'static Pool,
}

impl bex_rpc::Handler for SizedReplies {
    async fn handle(&self, _method: u16, body: Msg) -> std::result::Result<Msg, bex_rpc::RpcError> {
        let b = body.as_slice();
        let bad = || bex_rpc::RpcError::Remote {
            status: bex_rpc::Status::BadRequest,
            message: "want a 16-byte body: reply size, sequence number".into(),
        };
        let (size, seq) = match (b.get(..8), b.get(8..16)) {
            (Some(n), Some(q)) => (
                u64::from_le_bytes(n.try_into().map_err(|_| bad())?),
                u64::from_le_bytes(q.try_into().map_err(|_| bad())?),
            ),
            _ => return Err(bad()),
        };
        if !(8..=64 << 20).contains(&size) {
            return Err(bad());
        }
        let mut r = bex_rpc::alloc_frame(self.pool, size as usize)?;
        r.as_mut_slice()[bex_rpc::HEADER_LEN..bex_rpc::HEADER_LEN + 8]
            .copy_from_slice(&seq.to_le_bytes());
        Ok(r)
    }
}

/// Answers every message of `sock` until it fails or closes. Each answer is sent from its
/// own task, so many can be in flight (a socket's `send` resolves only when the transport is
/// done with the buffer).
async fn respond(sock: Arc<Socket>, pool: &'static Pool, echo_max: u64, ack_bytes: usize) {
    while let Ok(m) = sock.recv().await {
        let reply = if m.len() as u64 <= echo_max {
            m
        } else {
            let Ok(mut a) = Msg::alloc(pool, ack_bytes) else { return };
            // The response names the request: its first bytes (the client's sequence number).
            let n = 8.min(m.len()).min(ack_bytes);
            a.as_mut_slice()[..n].copy_from_slice(&m.as_slice()[..n]);
            a
        };
        let s = sock.clone();
        tokio::spawn(async move {
            let _ = s.send(reply).await;
        });
    }
}
