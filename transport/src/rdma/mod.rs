//! The RDMA transport: a connection table of engines keyed by the peer's address, endpoints
//! that host them (a CQ and a driver task each, see the `driver` module), a TCP bootstrap that
//! authenticates peers with the cluster's shared secret, and sockets multiplexed onto
//! engines.
//!
//! Bootstrap (both sides, over one TCP connection): each sends a hello — magic, version,
//! nonce, queue depths, its own listen address, eager limit, path MTU — then an HMAC-SHA256
//! of both hellos under the shared secret, and checks the peer's. Only an authenticated peer
//! gets an engine place and a QP: each side sends its QP endpoint with a MAC, connects its QP
//! (receives posted in INIT, before the peer may send) and sends a ready byte. A peer with
//! another secret gets a closed connection and a counter increments; at most
//! [`crate::auth::MAX_HANDSHAKES`] inbound bootstraps run at once, and at most
//! [`crate::auth::MAX_HANDSHAKES_PER_SOURCE`] from one address, as for TCP.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use bemalloc::Pool;
use bex_rnic::verbs::{InitAttrs, QpCaps, QpEndpoint, RtrAttrs, RtsAttrs};
use bex_rnic::{bootstrap, Device, QpInit, QueuePair, SharedReceiveQueue};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OnceCell, Semaphore};

use crate::auth::{proof, verify, HandshakeSlots, Role, PROOF_LEN};
use crate::config::{Config, CounterSnapshot, Counters};
use crate::driver::{Cmd, Control, Driven};
use crate::endpoint::{Accepted, Done, Endpoint, OnEngineGone};
use crate::engine::{Engine, EngineParts, Post, RemoteTarget};
use crate::error::{Result, TransportError};
use crate::log_limit::{accept, LogLimit, WARN_EVERY};
use crate::msg::{Msg, Payload, SharedMsg};
use crate::proto::HEADER_LEN;
use crate::recv::RecvRing;
use crate::undo::Undo;

/// The hello's magic and version, which also versions the engine header (2: standing
/// grants). 3: the hello carries `eager_max` and the path MTU (peers
/// configured differently failed their engine on the first such message, opaquely). 4: the
/// QP endpoint follows the proofs instead of riding in the hello.
const HELLO_MAGIC: [u8; 8] = *b"BEXHELO\x04";
/// Bytes of the bootstrap hello.
pub const HELLO_LEN: usize = 8 + 16 + 4 + 4 + 16 + 2 + 4 + 4;

#[derive(Clone, Copy, Debug)]
struct EngineRef {
    endpoint: usize,
    qpn: u32,
}

type Table = Mutex<HashMap<SocketAddr, Arc<OnceCell<EngineRef>>>>;

/// A bootstrap in progress.
type Establishing<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(SocketAddr, EngineRef)>> + Send + 'a>,
>;

/// Creates engines for one device type; the rest of the transport does not know `D`.
trait Factory: Send + Sync {
    /// The device's protocol counters.
    fn device_stats(&self) -> bex_rnic::DeviceStats;
    /// Runs the bootstrap on `stream` and hands the new engine to an endpoint.
    fn establish<'a>(
        &'a self,
        stream: TcpStream,
        initiator: bool,
        peer_hint: Option<SocketAddr>,
    ) -> Establishing<'a>;
}

struct FactoryImpl<D: Device> {
    device: Arc<D>,
    pd: Arc<D::Pd>,
    cqs: Vec<Arc<D::Cq>>,
    /// Per endpoint: its thread domain, where the device has them (paper §6.2.1). The
    /// endpoint's QPs are only touched under its lock, which is the domain's promise.
    tds: Vec<Option<Arc<D::Td>>>,
    /// Per endpoint in SRQ mode: its SRQ.
    srqs: Vec<Option<Arc<D::Srq>>>,
    endpoints: Vec<Arc<Driven<D>>>,
    next_endpoint: AtomicUsize,
    /// Engines per endpoint (each may have `sq_depth + rq_depth` completions queued).
    engine_counts: Arc<Vec<AtomicUsize>>,
    cfg: Arc<Config>,
    pool: &'static Pool,
    dev_index: usize,
    counters: Arc<Counters>,
    socket_ids: Arc<AtomicU32>,
    listen_addr: SocketAddr,
}

mod handshake;
mod placement;
mod socket;

pub use handshake::{check_hello, sample_hello};
pub use socket::RdmaSocket;

impl<D: Device + 'static> Factory for FactoryImpl<D> {
    fn device_stats(&self) -> bex_rnic::DeviceStats {
        self.device.stats()
    }

    fn establish<'a>(
        &'a self,
        stream: TcpStream,
        initiator: bool,
        _peer_hint: Option<SocketAddr>,
    ) -> Establishing<'a> {
        Box::pin(self.bootstrap(stream, initiator))
    }
}

struct Inner {
    cfg: Arc<Config>,
    endpoints: Vec<Arc<dyn Control>>,
    factory: Arc<dyn Factory>,
    table: Arc<Table>,
    accept_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Accepted>>,
    local_addr: SocketAddr,
    counters: Arc<Counters>,
    socket_ids: Arc<AtomicU32>,
    /// When false, bootstraps are refused (RDMA taken out of service).
    accepting: Arc<AtomicBool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pool: &'static Pool,
}

/// An RDMA transport over one device.
#[derive(Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport").field("local_addr", &self.inner.local_addr).finish()
    }
}

impl RdmaTransport {
    /// Starts endpoints on `device` (one CQ and one driver task each, on the current tokio
    /// runtime) and a bootstrap listener on `listen` (port 0: any). `pool` must be registered
    /// with `device` in `pd` as its device number `dev_index`.
    pub async fn start<D: Device + 'static>(
        device: Arc<D>,
        pd: Arc<D::Pd>,
        pool: &'static Pool,
        dev_index: usize,
        listen: SocketAddr,
        cfg: Config,
    ) -> Result<RdmaTransport> {
        cfg.validate().map_err(TransportError::Invalid)?;
        if dev_index >= pool.devices() {
            return Err(TransportError::Invalid(format!(
                "dev_index {dev_index}: the pool has {} device(s)",
                pool.devices()
            )));
        }
        let cfg = Arc::new(cfg);
        let listener = TcpListener::bind(listen).await?;
        let mut local_addr = listener.local_addr()?;
        if local_addr.ip().is_unspecified() {
            local_addr.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let counters = Arc::new(Counters::default());
        let table: Arc<Table> = Arc::new(Mutex::new(HashMap::new()));
        let (accept_tx, accept_rx) = mpsc::unbounded_channel();
        let socket_ids = Arc::new(AtomicU32::new(1));
        let mut cqs = Vec::new();
        let mut tds = Vec::new();
        let mut srqs = Vec::new();
        let mut driven = Vec::new();
        let engine_counts: Arc<Vec<AtomicUsize>> =
            Arc::new((0..cfg.endpoints).map(|_| AtomicUsize::new(0)).collect());
        for i in 0..cfg.endpoints {
            let cq = Arc::new(device.create_cq(cfg.cq_depth)?);
            // A thread domain tells the provider that one thread at a time touches these QPs
            // (the endpoint's lock), so it can skip its own locks; devices without them (the
            // software RNIC, rxe) go on.
            tds.push(match device.alloc_td() {
                Ok(td) => Some(Arc::new(td)),
                Err(bex_rnic::Error::Unsupported(_)) => None,
                Err(e) => return Err(e.into()),
            });
            let shared = if cfg.srq {
                let srq = Arc::new(device.create_srq(&pd, cfg.srq_depth, 1)?);
                let ring =
                    RecvRing::new(pool, dev_index, cfg.srq_depth, HEADER_LEN + cfg.eager_max)?;
                srq.post_recv(&ring.all())?;
                srqs.push(Some(srq.clone()));
                Some((Arc::new(Mutex::new(ring)), srq))
            } else {
                srqs.push(None);
                None
            };
            let table2 = table.clone();
            let counts2 = engine_counts.clone();
            let on_gone: OnEngineGone = Arc::new(move |peer, e, qpn| {
                counts2[e].fetch_sub(1, Ordering::AcqRel);
                let mut t = table2.lock();
                if let Some(cell) = t.get(&peer) {
                    if cell.get().is_some_and(|r| r.endpoint == e && r.qpn == qpn) {
                        t.remove(&peer);
                    }
                }
            });
            let ep = Endpoint::<D>::new(i, cq.clone(), shared, Some(accept_tx.clone()), on_gone);
            driven.push(Arc::new(Driven::new(ep, cq.clone(), counters.clone(), cfg.spin)));
            cqs.push(cq);
        }
        let mut tasks = Vec::new();
        for d in &driven {
            tasks.push(d.spawn()?);
        }
        let endpoints: Vec<Arc<dyn Control>> =
            driven.iter().map(|d| d.clone() as Arc<dyn Control>).collect();
        let factory: Arc<dyn Factory> = Arc::new(FactoryImpl {
            device,
            pd,
            cqs,
            tds,
            srqs,
            endpoints: driven,
            next_endpoint: AtomicUsize::new(0),
            engine_counts,
            cfg: cfg.clone(),
            pool,
            dev_index,
            counters: counters.clone(),
            socket_ids: socket_ids.clone(),
            listen_addr: local_addr,
        });
        let f2 = factory.clone();
        let c2 = counters.clone();
        let accepting = Arc::new(AtomicBool::new(true));
        let acc2 = accepting.clone();
        let timeout = cfg.connect_timeout;
        tasks.push(tokio::spawn(async move {
            let (accept_warn, busy_warn) = (LogLimit::new(WARN_EVERY), LogLimit::new(WARN_EVERY));
            let inbound_warn = Arc::new(LogLimit::new(WARN_EVERY));
            let slots = HandshakeSlots::new();
            loop {
                let (stream, from) = accept(&listener, &accept_warn, "bootstrap").await;
                if !acc2.load(Ordering::Acquire) {
                    // Out of service: close at once, as a host without RDMA would refuse.
                    drop(stream);
                    continue;
                }
                let slot = match slots.try_take(from.ip()) {
                    Ok(slot) => slot,
                    Err(no) => {
                        Counters::add(&c2.bootstrap_refused, 1);
                        if let Some(held) = busy_warn.allow(crate::clock::now()) {
                            tracing::warn!(%from, held_back = held, "RDMA bootstrap refused: {}", no.why());
                        }
                        continue;
                    }
                };
                let f = f2.clone();
                let warn = inbound_warn.clone();
                tokio::spawn(async move {
                    let outcome = tokio::time::timeout(timeout, f.establish(stream, false, None));
                    let outcome = outcome.await;
                    drop(slot);
                    let why = match outcome {
                        Ok(Ok(_)) => return,
                        Ok(Err(e)) => e.to_string(),
                        // Counted as refused by the bootstrap if the peer had not proven
                        // itself; after that, a slow peer is no stranger.
                        Err(_) => "timed out".into(),
                    };
                    if let Some(held) = warn.allow(crate::clock::now()) {
                        tracing::warn!(%from, %why, held_back = held, "inbound bootstrap failed");
                    }
                });
            }
        }));
        Ok(RdmaTransport {
            inner: Arc::new(Inner {
                cfg,
                endpoints,
                factory,
                table,
                accept_rx: tokio::sync::Mutex::new(accept_rx),
                local_addr,
                counters,
                socket_ids,
                accepting,
                tasks: Mutex::new(tasks),
                pool,
            }),
        })
    }

    /// The bootstrap address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The registered-memory pool messages come from.
    pub fn pool(&self) -> &'static Pool {
        self.inner.pool
    }

    /// Counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.inner.counters.snapshot()
    }

    /// The NIC's protocol counters (RNR NAKs, retransmissions, …).
    pub fn device_stats(&self) -> bex_rnic::DeviceStats {
        self.inner.factory.device_stats()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// Number of engines in the connection table.
    pub fn engines(&self) -> usize {
        self.inner.table.lock().values().filter(|c| c.get().is_some()).count()
    }

    async fn engine_for(&self, addr: SocketAddr) -> Result<EngineRef> {
        let cell = self.inner.table.lock().entry(addr).or_default().clone();
        let factory = self.inner.factory.clone();
        let timeout = self.inner.cfg.connect_timeout;
        let r = cell
            .get_or_try_init(|| async move {
                let attempt = async {
                    let stream = TcpStream::connect(addr).await.map_err(|e| {
                        TransportError::Refused(format!("bootstrap connect to {addr}: {e}"))
                    })?;
                    factory.establish(stream, true, Some(addr)).await
                };
                match tokio::time::timeout(timeout, attempt).await {
                    Ok(r) => r.map(|(_, e)| e),
                    Err(_) => Err(TransportError::ConnectTimeout(addr.to_string())),
                }
            })
            .await
            .copied();
        if r.is_err() {
            let mut t = self.inner.table.lock();
            if t.get(&addr).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                t.remove(&addr);
            }
        }
        r
    }

    /// Opens a socket to the transport listening at `addr`: attaches to the engine for that
    /// address, creating it (bootstrap) if there is none.
    pub async fn connect(&self, addr: SocketAddr) -> Result<RdmaSocket> {
        let engine = self.engine_for(addr).await?;
        let id = self.inner.socket_ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let (reply, done) = oneshot::channel();
        let ctl = &self.inner.endpoints[engine.endpoint];
        ctl.apply(Cmd::Open { engine: engine.qpn, socket: id, inbox: tx, reply })?;
        // Closed again unless handed out: on a timeout, and when the caller drops this
        // future (its own deadline), which left the socket open on both sides for good.
        let opening = Undo::new(|| {
            let _ = ctl.apply(Cmd::Close { socket: id });
        });
        match tokio::time::timeout(self.inner.cfg.connect_timeout, done).await {
            Ok(Ok(Ok(()))) => {
                opening.done();
                Ok(self.socket(id, engine.endpoint, rx, addr))
            }
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(TransportError::Shutdown),
            Err(_) => Err(TransportError::ConnectTimeout(addr.to_string())),
        }
    }

    /// Waits for a socket opened by a peer.
    pub async fn accept(&self) -> Result<RdmaSocket> {
        let a = self.inner.accept_rx.lock().await.recv().await.ok_or(TransportError::Shutdown)?;
        Ok(self.socket(a.id, a.endpoint, a.inbox, a.peer))
    }

    fn socket(
        &self,
        id: u32,
        endpoint: usize,
        inbox: mpsc::UnboundedReceiver<Result<Msg>>,
        peer: SocketAddr,
    ) -> RdmaSocket {
        RdmaSocket {
            id,
            peer,
            ctl: self.inner.endpoints[endpoint].clone(),
            _transport: self.inner.clone(),
            inbox: tokio::sync::Mutex::new(inbox),
            ended: Mutex::new(None),
            slots: Arc::new(Semaphore::new(self.inner.cfg.max_queued_sends)),
        }
    }

    /// Takes RDMA out of service (`false`: refuse bootstraps and fail every engine, so peers
    /// see an RDMA path failure) or back in (`true`). For failure drills and tests.
    pub fn set_in_service(&self, on: bool) {
        self.inner.accepting.store(on, Ordering::Release);
        if !on {
            self.inner.table.lock().clear();
            for e in &self.inner.endpoints {
                let _ = e.apply(Cmd::FailAll { why: "RDMA taken out of service".into() });
            }
        }
    }

    /// Stops the endpoints and the listener; every socket fails.
    pub fn shutdown(&self) {
        self.inner.stop();
    }
}

impl Inner {
    fn stop(&self) {
        for e in &self.endpoints {
            e.shutdown();
        }
        for t in self.tasks.lock().iter() {
            t.abort();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}
