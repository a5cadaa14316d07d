//! The RDMA transport: a connection table of engines keyed by the peer's address, endpoints
//! that host them (a CQ and a driver task each, see the `driver` module), a TCP bootstrap that
//! authenticates peers with the cluster's shared secret, and sockets multiplexed onto
//! engines.
//!
//! Bootstrap (both sides, over one TCP connection): each sends a hello — magic, version,
//! nonce, its QP endpoint, queue depths, its own listen address — then an HMAC-SHA256 of both
//! hellos under the shared secret, checks the peer's, connects its QP (receives posted in
//! INIT, before the peer may send) and sends a ready byte. A peer with another secret gets
//! a closed connection and a counter increments.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use bemalloc::Pool;
use bex_rnic::verbs::{InitAttrs, QpCaps, QpEndpoint, RtrAttrs, RtsAttrs};
use bex_rnic::{bootstrap, Device, QpInit, QueuePair, SharedReceiveQueue};
use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OnceCell, Semaphore};

use crate::config::{Config, CounterSnapshot, Counters};
use crate::driver::{Cmd, Control, Driven};
use crate::endpoint::{Accepted, Done, Endpoint, OnEngineGone};
use crate::engine::{Engine, EngineParts, Post, RemoteTarget};
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload, SharedMsg};
use crate::proto::HEADER_LEN;
use crate::recv::RecvRing;

// Version 2: engine headers of 48 bytes (standing grants).
const HELLO_MAGIC: [u8; 8] = *b"BEXHELO\x02";
const HELLO_LEN: usize = 8 + 16 + bootstrap::ENDPOINT_LEN + 4 + 4 + 16 + 2;
const PROOF_LEN: usize = 32;

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

struct Hello {
    nonce: [u8; 16],
    endpoint: QpEndpoint,
    rq_depth: u32,
    sq_depth: u32,
    listen: SocketAddr,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..24].copy_from_slice(&self.nonce);
        let e = 24 + bootstrap::ENDPOINT_LEN;
        b[24..e].copy_from_slice(&bootstrap::encode(&self.endpoint));
        b[e..e + 4].copy_from_slice(&self.rq_depth.to_le_bytes());
        b[e + 4..e + 8].copy_from_slice(&self.sq_depth.to_le_bytes());
        b[e + 8..e + 24].copy_from_slice(&QpEndpoint::gid_of(self.listen.ip()));
        b[e + 24..e + 26].copy_from_slice(&self.listen.port().to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello> {
        let refuse = |why: &str| TransportError::Refused(format!("bootstrap: {why}"));
        if b[..8] != HELLO_MAGIC {
            return Err(refuse("not a bex transport (bad magic or version)"));
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[8..24]);
        let e = 24 + bootstrap::ENDPOINT_LEN;
        let mut ep = [0u8; bootstrap::ENDPOINT_LEN];
        ep.copy_from_slice(&b[24..e]);
        let endpoint = bootstrap::decode(&ep).map_err(|e| refuse(&e.to_string()))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let rq_depth = u32_at(e);
        let sq_depth = u32_at(e + 4);
        let rq_ok = rq_depth == 0 || (4..=16384).contains(&rq_depth);
        if !rq_ok || !(2..=16384).contains(&sq_depth) {
            return Err(refuse("queue depths out of range"));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[e + 8..e + 24]);
        let port = u16::from_le_bytes([b[e + 24], b[e + 25]]);
        let listen = QpEndpoint { gid, udp_port: port, lid: 0, qpn: 0, psn: 0 }.socket_addr();
        Ok(Hello { nonce, endpoint, rq_depth, sq_depth, listen })
    }
}

fn proof(secret: &[u8], initiator: bool, hello_i: &[u8], hello_a: &[u8]) -> [u8; PROOF_LEN] {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"bex-transport/1");
    mac.update(if initiator { b"initiator" } else { b"acceptor!" });
    mac.update(hello_i);
    mac.update(hello_a);
    mac.finalize().into_bytes().into()
}

fn verify(secret: &[u8], initiator: bool, hello_i: &[u8], hello_a: &[u8], got: &[u8]) -> bool {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"bex-transport/1");
    mac.update(if initiator { b"initiator" } else { b"acceptor!" });
    mac.update(hello_i);
    mac.update(hello_a);
    mac.verify_slice(got).is_ok()
}

impl<D: Device + 'static> FactoryImpl<D> {
    async fn bootstrap(
        &self,
        mut stream: TcpStream,
        initiator: bool,
    ) -> Result<(SocketAddr, EngineRef)> {
        let _ = stream.set_nodelay(true);
        let endpoint = self.place_engine()?;
        let placed = PlacedEngine { counts: self.engine_counts.clone(), endpoint, keep: false };
        let cq = &self.cqs[endpoint];
        let caps = QpCaps {
            max_send_wr: self.cfg.sq_depth,
            max_recv_wr: self.cfg.rq_depth,
            max_send_sge: 2,
            max_recv_sge: 1,
        };
        let srq = self.srqs[endpoint].as_deref();
        let td = self.tds[endpoint].as_deref();
        let qp = self.device.create_qp(
            &self.pd,
            &QpInit { send_cq: cq, recv_cq: cq, srq, thread_domain: td, caps },
        )?;
        let mine = Hello {
            nonce: rand::random(),
            endpoint: qp.endpoint(),
            // 0 tells the peer this side draws on an SRQ and takes no credits.
            rq_depth: if self.cfg.srq { 0 } else { self.cfg.rq_depth },
            sq_depth: self.cfg.sq_depth,
            listen: self.listen_addr,
        }
        .encode();
        stream.write_all(&mine).await?;
        let mut theirs = [0u8; HELLO_LEN];
        stream.read_exact(&mut theirs).await?;
        let hello = Hello::decode(&theirs).inspect_err(|_| {
            Counters::add(&self.counters.bootstrap_refused, 1);
        })?;
        let (hi, ha) = if initiator { (&mine, &theirs) } else { (&theirs, &mine) };
        stream.write_all(&proof(&self.cfg.secret, initiator, hi, ha)).await?;
        let mut their_proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut their_proof).await.map_err(|_| {
            TransportError::Refused("bootstrap: the peer closed during authentication".into())
        })?;
        if !verify(&self.cfg.secret, !initiator, hi, ha, &their_proof) {
            Counters::add(&self.counters.bootstrap_refused, 1);
            return Err(TransportError::Refused(
                "bootstrap: the peer does not have the cluster's shared secret".into(),
            ));
        }
        qp.to_init(&InitAttrs { port: self.cfg.qp_port, ..InitAttrs::default() })?;
        let peer = if initiator { stream.peer_addr()? } else { hello.listen };
        let driven = &self.endpoints[endpoint];
        let parts = EngineParts {
            cfg: self.cfg.clone(),
            pool: self.pool,
            dev: self.dev_index,
            counters: self.counters.clone(),
            qpn: qp.qpn(),
            peer_rq_depth: hello.rq_depth,
            accepting: true,
            socket_ids: self.socket_ids.clone(),
            shared_recv: driven.ep.lock().shared_ring(),
        };
        let mut engine = Engine::<Done>::new(parts, crate::clock::now())?;
        // Its own receives go up in INIT, before the peer can send.
        if let Some(Post::Recv(wrs)) = engine.poll_post() {
            qp.post_recv(wrs)?;
        }
        let rtr =
            RtrAttrs { remote: hello.endpoint, path_mtu: self.cfg.path_mtu, min_rnr_timer: 12 };
        qp.to_rtr(&rtr)?;
        qp.to_rts(&RtsAttrs {
            sq_psn: qp.endpoint().psn,
            timeout: self.cfg.qp_timeout,
            retry_cnt: self.cfg.qp_retry_cnt,
            rnr_retry: self.cfg.qp_rnr_retry,
        })?;
        // The endpoint hosts the engine before the peer learns it may send (the ready byte),
        // so no completion of this QP can reach an endpoint that does not know it.
        let qpn = engine.qpn;
        driven.ep.lock().add_engine(engine, qp, peer);
        stream.write_all(&[1]).await?;
        let mut ready = [0u8; 1];
        stream.read_exact(&mut ready).await?;
        placed.keep();
        Counters::add(&self.counters.engines_up, 1);
        Ok((peer, EngineRef { endpoint, qpn }))
    }
}

/// An engine's place on an endpoint, given back unless the bootstrap completes.
struct PlacedEngine {
    counts: Arc<Vec<AtomicUsize>>,
    endpoint: usize,
    keep: bool,
}

impl PlacedEngine {
    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for PlacedEngine {
    fn drop(&mut self) {
        if !self.keep {
            self.counts[self.endpoint].fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl<D: Device + 'static> FactoryImpl<D> {
    /// Completion entries one engine may need on its endpoint's CQ.
    fn cq_entries_per_engine(&self) -> usize {
        let receives = if self.cfg.srq { 0 } else { self.cfg.rq_depth };
        (self.cfg.sq_depth + receives) as usize
    }

    /// Picks an endpoint (round-robin) whose CQ has room for one more engine.
    fn place_engine(&self) -> Result<usize> {
        let n = self.cqs.len();
        let shared = if self.cfg.srq { self.cfg.srq_depth as usize } else { 0 };
        let room =
            (self.cfg.cq_depth as usize).saturating_sub(shared) / self.cq_entries_per_engine();
        let start = self.next_endpoint.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let w = (start + k) % n;
            let c = &self.engine_counts[w];
            let mut cur = c.load(Ordering::Acquire);
            while cur < room {
                match c.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(w),
                    Err(now) => cur = now,
                }
            }
        }
        Err(TransportError::Refused(format!(
            "every endpoint's CQ is full ({room} engines of {} entries each per {} entries): raise cq_depth or endpoints",
            self.cq_entries_per_engine(),
            self.cfg.cq_depth
        )))
    }
}

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
            loop {
                let (stream, from) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of descriptors and the like: do not spin.
                        tracing::warn!(%e, "bootstrap accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if !acc2.load(Ordering::Acquire) {
                    // Out of service: close at once, as a host without RDMA would refuse.
                    drop(stream);
                    continue;
                }
                let f = f2.clone();
                let c = c2.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(timeout, f.establish(stream, false, None)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => tracing::warn!(%from, %e, "inbound bootstrap failed"),
                        Err(_) => {
                            Counters::add(&c.bootstrap_refused, 1);
                            tracing::warn!(%from, "inbound bootstrap timed out");
                        }
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
        match tokio::time::timeout(self.inner.cfg.connect_timeout, done).await {
            Ok(Ok(Ok(()))) => Ok(self.socket(id, engine.endpoint, rx, addr)),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(TransportError::Shutdown),
            Err(_) => {
                let _ = ctl.apply(Cmd::Close { socket: id });
                Err(TransportError::ConnectTimeout(addr.to_string()))
            }
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

/// A logical connection over an engine.
pub struct RdmaSocket {
    id: u32,
    peer: SocketAddr,
    ctl: Arc<dyn Control>,
    /// Keeps the transport (its endpoints' drivers) alive while the socket is.
    _transport: Arc<Inner>,
    inbox: tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Msg>>>,
    /// The error that ended the socket, repeated by every later `recv`.
    ended: Mutex<Option<TransportError>>,
    slots: Arc<Semaphore>,
}

impl std::fmt::Debug for RdmaSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSocket").field("id", &self.id).field("peer", &self.peer).finish()
    }
}

impl RdmaSocket {
    /// The peer transport's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    async fn submit(&self, payload: Payload, target: Option<RemoteTarget>) -> Result<()> {
        let _permit = self.slots.acquire().await.map_err(|_| TransportError::Shutdown)?;
        let (done, rx) = oneshot::channel();
        self.ctl.apply(Cmd::Send { socket: self.id, payload, target, done: Done::Notify(done) })?;
        rx.await.map_err(|_| TransportError::Shutdown)?
    }

    /// Sends a message; resolves when the NIC is done with its buffer. Many sends may be in
    /// flight at once; beyond `max_queued_sends` this waits (backpressure).
    pub async fn send(&self, msg: Msg) -> Result<()> {
        self.submit(msg.into(), None).await
    }

    /// Sends a shared message without copying it (one more use of its buffer); resolves when
    /// the NIC is done with this use.
    pub async fn send_shared(&self, msg: &SharedMsg) -> Result<()> {
        self.submit(msg.into(), None).await
    }

    /// Queues a message without waiting for the NIC to finish with it, so nobody is woken
    /// when it does: for request/response traffic, where the response says the request
    /// arrived. Waits only for room in the socket's queue (`max_queued_sends`). A later
    /// failure fails the engine, and so this socket's `recv`.
    pub async fn send_detached(&self, msg: impl Into<Payload>) -> Result<()> {
        let permit =
            self.slots.clone().acquire_owned().await.map_err(|_| TransportError::Shutdown)?;
        let done = Done::Detached(permit);
        self.ctl.apply(Cmd::Send { socket: self.id, payload: msg.into(), target: None, done })
    }

    /// Writes a message straight into a buffer the peer exposed, skipping RTS/CTS.
    pub async fn send_to(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        self.submit(msg.into(), Some(target)).await
    }

    /// [`RdmaSocket::send_to`] without waiting for the NIC (as [`RdmaSocket::send_detached`]).
    pub async fn send_to_detached(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        let permit =
            self.slots.clone().acquire_owned().await.map_err(|_| TransportError::Shutdown)?;
        let done = Done::Detached(permit);
        self.ctl.apply(Cmd::Send {
            socket: self.id,
            payload: msg.into(),
            target: Some(target),
            done,
        })
    }

    /// Exposes `buf` so the peer can [`RdmaSocket::send_to`] into it; when the peer's write
    /// completes, the whole buffer arrives on this socket's `recv` (the peer's message fills
    /// its start; the length travels in the application's own protocol).
    pub async fn expose(&self, buf: Msg) -> Result<RemoteTarget> {
        let (reply, rx) = oneshot::channel();
        self.ctl.apply(Cmd::Expose { socket: self.id, buf, reply })?;
        rx.await.map_err(|_| TransportError::Shutdown)?
    }

    /// The next message, in order.
    pub async fn recv(&self) -> Result<Msg> {
        if let Some(e) = self.ended.lock().clone() {
            return Err(e);
        }
        let r = self.inbox.lock().await.recv().await.unwrap_or(Err(TransportError::Closed));
        if let Err(e) = &r {
            *self.ended.lock() = Some(e.clone());
        }
        r
    }

    /// Fails the engine under this socket, as a QP error would (every socket on it fails).
    pub fn fail_engine(&self, why: &str) {
        let _ = self.ctl.apply(Cmd::FailEngine { socket: self.id, why: why.to_string() });
    }
}

impl Drop for RdmaSocket {
    fn drop(&mut self) {
        let _ = self.ctl.apply(Cmd::Close { socket: self.id });
    }
}
