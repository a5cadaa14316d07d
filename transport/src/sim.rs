//! Deterministic simulation of transports: engines and endpoints running unmodified over
//! software devices on an in-memory [`Fabric`], driven by hand on its virtual clock. No
//! thread, socket or wall-clock read is involved after construction, so a run is a function
//! of its seed (tests print it; replay with the same seed).
//!
//! The application side uses the same channels as [`crate::RdmaSocket`], polled without an
//! async runtime: [`SimNet::send`] returns a [`SendTicket`], [`SimSocket::try_recv`] takes
//! the next message if one has arrived.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::{Pool, PoolConfig};
use bex_rnic::soft::{
    Fabric, FabricTick, LinkModel, NicConfig, SoftCq, SoftDevice, SoftPd, SoftSrq,
};
use bex_rnic::verbs::{InitAttrs, QpCaps, RtrAttrs, RtsAttrs};
use bex_rnic::{Device, QpInit, QueuePair, SharedReceiveQueue};
use tokio::sync::{mpsc, oneshot};

use crate::config::{Config, CounterSnapshot, Counters};
use crate::endpoint::{Accepted, Done, Endpoint, PostWhen};
use crate::engine::{Engine, EngineParts, Post, RemoteTarget};
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload};
use crate::proto::HEADER_LEN;
use crate::recv::RecvRing;

struct Node {
    device: SoftDevice,
    srq: Option<Arc<SoftSrq>>,
    pd: Arc<SoftPd>,
    pool: &'static Pool,
    cq: Arc<SoftCq>,
    ep: Endpoint<SoftDevice>,
    accept_rx: mpsc::UnboundedReceiver<Accepted>,
    counters: Arc<Counters>,
    cfg: Arc<Config>,
    /// Which of its pool's devices this node's is.
    dev: usize,
    /// Needs a turn whatever its CQ and timers say (calls applied, or busy last turn).
    dirty: bool,
    /// Its endpoint's next deadline after its last turn.
    deadline: Option<Instant>,
}

/// A simulated network of transport nodes.
pub struct SimNet {
    fabric: Fabric,
    nodes: Vec<Node>,
    socket_ids: Arc<AtomicU32>,
    pool_config: PoolConfig,
}

impl std::fmt::Debug for SimNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimNet").field("nodes", &self.nodes.len()).finish()
    }
}

/// A socket of a simulated node.
#[derive(Debug)]
pub struct SimSocket {
    node: usize,
    id: u32,
    inbox: mpsc::UnboundedReceiver<Result<Msg>>,
}

impl SimSocket {
    /// The next message, if one has arrived.
    pub fn try_recv(&mut self) -> Option<Result<Msg>> {
        self.inbox.try_recv().ok()
    }
    /// The node it belongs to.
    pub fn node(&self) -> usize {
        self.node
    }
}

/// A socket being opened: its id, its inbox, and the reply that comes when the peer answers.
pub(crate) struct Opening {
    pub id: u32,
    pub inbox: mpsc::UnboundedReceiver<Result<Msg>>,
    pub answered: oneshot::Receiver<Result<()>>,
}

/// The completion of one send.
#[derive(Debug)]
pub struct SendTicket(oneshot::Receiver<Result<()>>);

impl SendTicket {
    /// `Some` once the send finished.
    pub fn poll(&mut self) -> Option<Result<()>> {
        match self.0.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(TransportError::Shutdown)),
        }
    }
}

/// What one round of a [`SimNet`] at the current time found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimTick {
    /// Something moved: there may be more to do at this instant.
    Worked,
    /// Nothing to do now; `next` is when an endpoint timer or the fabric has something.
    Idle {
        /// The next deadline (never, if `None`).
        next: Option<Instant>,
    },
}

impl SimNet {
    /// An empty network; `seed` decides every random choice of the fabric and devices.
    pub fn new(seed: u64, link: LinkModel) -> SimNet {
        SimNet::with_fabric(Fabric::new(seed, link))
    }

    /// A network over a given fabric (a switched one, say); node `i` is device `i` if the
    /// fabric had no devices yet.
    pub fn with_fabric(fabric: Fabric) -> SimNet {
        SimNet {
            fabric,
            nodes: Vec::new(),
            socket_ids: Arc::new(AtomicU32::new(1)),
            pool_config: PoolConfig::default(),
        }
    }

    /// The pool layout of nodes added from now on. Each node's pool is leaked and holds its
    /// own jemalloc arenas (at most 4095 per process): large simulations want one arena and
    /// a small reservation per node.
    pub fn set_pool_config(&mut self, cfg: PoolConfig) {
        self.pool_config = cfg;
    }

    /// The pool layout for simulations of many nodes in one process: one arena and
    /// `reserve_bytes` per node (2 MiB blocks).
    pub fn small_pools(reserve_bytes: usize) -> PoolConfig {
        PoolConfig { reserve_bytes, max_block_bytes: 2 << 20, arenas: 1, ..PoolConfig::default() }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// No nodes yet.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The fabric (faults, stats, clock).
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        self.fabric.now()
    }

    /// Adds a node with its own device, pool and endpoint.
    pub fn add_node(&mut self, cfg: Config) -> Result<usize> {
        Ok(self.add_nodes(vec![cfg])?[0])
    }

    /// Adds nodes with a device and endpoint each and one pool registered on all their
    /// devices (a host with two NICs, say), so a message from the pool can leave by any.
    pub fn add_nodes(&mut self, cfgs: Vec<Config>) -> Result<Vec<usize>> {
        let mut made = Vec::with_capacity(cfgs.len());
        for cfg in &cfgs {
            cfg.validate().map_err(TransportError::Invalid)?;
            let device = self.fabric.add_device(NicConfig::default());
            let pd = Arc::new(device.alloc_pd()?);
            made.push((device, pd));
        }
        let registrars =
            made.iter().map(|(d, pd)| Arc::new(d.registrar(pd)) as Arc<_>).collect::<Vec<_>>();
        let pool = Pool::with_config(registrars, self.pool_config.clone())
            .map_err(|e| TransportError::Alloc(e.to_string()))?
            .leak();
        let mut ids = Vec::with_capacity(cfgs.len());
        for (dev, ((device, pd), cfg)) in made.into_iter().zip(cfgs).enumerate() {
            ids.push(self.add_node_on(device, pd, pool, dev, cfg)?);
        }
        Ok(ids)
    }

    fn add_node_on(
        &mut self,
        device: SoftDevice,
        pd: Arc<SoftPd>,
        pool: &'static Pool,
        dev: usize,
        cfg: Config,
    ) -> Result<usize> {
        let cq = Arc::new(device.create_cq(cfg.cq_depth)?);
        let shared = if cfg.srq {
            let srq = Arc::new(device.create_srq(&pd, cfg.srq_depth, 1)?);
            let ring = RecvRing::new(pool, dev, cfg.srq_depth, HEADER_LEN + cfg.eager_max)?;
            srq.post_recv(&ring.all())?;
            Some((Arc::new(parking_lot::Mutex::new(ring)), srq))
        } else {
            None
        };
        let srq = shared.as_ref().map(|(_, s)| s.clone());
        let (accept_tx, accept_rx) = mpsc::unbounded_channel();
        let ep = Endpoint::new(
            self.nodes.len(),
            cq.clone(),
            shared,
            Some(accept_tx),
            Arc::new(|_, _, _| {}),
        );
        self.nodes.push(Node {
            device,
            srq,
            pd,
            pool,
            cq,
            ep,
            accept_rx,
            counters: Arc::new(Counters::default()),
            cfg: Arc::new(cfg),
            dev,
            dirty: true,
            deadline: None,
        });
        Ok(self.nodes.len() - 1)
    }

    /// A node's pool.
    pub fn pool(&self, node: usize) -> &'static Pool {
        self.nodes[node].pool
    }

    /// A node's device (counters of the software RNIC).
    pub fn device(&self, node: usize) -> &SoftDevice {
        &self.nodes[node].device
    }

    /// A node's transport counters.
    pub fn counters(&self, node: usize) -> CounterSnapshot {
        self.nodes[node].counters.snapshot()
    }

    fn engine_parts(
        &self,
        node: usize,
        qpn: u32,
        peer_rq_depth: u32,
        cfg: Arc<Config>,
    ) -> EngineParts {
        let n = &self.nodes[node];
        EngineParts {
            cfg,
            pool: n.pool,
            dev: n.dev,
            counters: n.counters.clone(),
            qpn,
            peer_rq_depth,
            accepting: true,
            socket_ids: self.socket_ids.clone(),
            shared_recv: n.ep.shared_ring(),
        }
    }

    /// Wires an engine between nodes `a` and `b` directly (no bootstrap); returns its QP
    /// number at `a`.
    pub fn connect(&mut self, a: usize, b: usize) -> Result<u32> {
        let now = self.now();
        let make_qp = |n: &Node| -> Result<_> {
            let caps = QpCaps {
                max_send_wr: n.cfg.sq_depth,
                max_recv_wr: n.cfg.rq_depth,
                max_send_sge: 2,
                max_recv_sge: 1,
            };
            let srq = n.srq.as_deref();
            let qp = n.device.create_qp(
                &n.pd,
                &QpInit { send_cq: &n.cq, recv_cq: &n.cq, srq, thread_domain: None, caps },
            )?;
            qp.to_init(&InitAttrs::default())?;
            Ok(qp)
        };
        let qa = make_qp(&self.nodes[a])?;
        let qb = make_qp(&self.nodes[b])?;
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        // A node on an SRQ announces depth 0: no credits towards it.
        let depth = |n: &Node| if n.cfg.srq { 0 } else { n.cfg.rq_depth };
        // What the bootstrap's hellos would agree on.
        let (ca, cb) = (&self.nodes[a].cfg, &self.nodes[b].cfg);
        let (cfg_a, mtu) = crate::config::agreed(ca, cb.eager_max, cb.path_mtu);
        let (cfg_b, _) = crate::config::agreed(cb, ca.eager_max, ca.path_mtu);
        let parts_a = self.engine_parts(a, qa.qpn(), depth(&self.nodes[b]), cfg_a);
        let parts_b = self.engine_parts(b, qb.qpn(), depth(&self.nodes[a]), cfg_b);
        let mut engine_a = Engine::<Done>::new(parts_a, now)?;
        let mut engine_b = Engine::<Done>::new(parts_b, now)?;
        for (e, qp, remote, cfg) in [
            (&mut engine_a, &qa, eb, &self.nodes[a].cfg),
            (&mut engine_b, &qb, ea, &self.nodes[b].cfg),
        ] {
            if let Some(Post::Recv(wrs)) = e.poll_post() {
                qp.post_recv(wrs)?;
            }
            qp.to_rtr(&RtrAttrs { remote, path_mtu: mtu, min_rnr_timer: 12 })?;
            qp.to_rts(&RtsAttrs {
                sq_psn: qp.endpoint().psn,
                timeout: cfg.qp_timeout,
                retry_cnt: cfg.qp_retry_cnt,
                rnr_retry: cfg.qp_rnr_retry,
            })?;
        }
        let qpn = engine_a.qpn;
        let (addr_a, addr_b) =
            (self.nodes[a].device.local_addr(), self.nodes[b].device.local_addr());
        self.nodes[a].ep.add_engine(engine_a, qa, addr_b);
        self.nodes[b].ep.add_engine(engine_b, qb, addr_a);
        self.nodes[a].dirty = true;
        self.nodes[b].dirty = true;
        Counters::add(&self.nodes[a].counters.engines_up, 1);
        Counters::add(&self.nodes[b].counters.engines_up, 1);
        Ok(qpn)
    }

    /// Opens a socket on engine `engine` of node `a`, running the network until the peer
    /// answers (at most `limit` of virtual time).
    pub fn open(&mut self, a: usize, engine: u32, limit: Duration) -> Result<SimSocket> {
        Ok(self.open_all(&[(a, engine)], limit)?.remove(0))
    }

    /// Opens one socket per `(node, engine)` at once and runs the network until every peer
    /// answered (at most `limit` of virtual time): opening many sockets one by one costs a
    /// network round per socket.
    pub fn open_all(&mut self, which: &[(usize, u32)], limit: Duration) -> Result<Vec<SimSocket>> {
        let mut pending = Vec::with_capacity(which.len());
        for &(a, engine) in which {
            let o = self.open_cmd(a, engine)?;
            pending.push((a, o.id, o.inbox, o.answered, None));
        }
        let mut left = pending.len();
        self.run_until(
            |_| {
                for (_, _, _, rx, got) in pending.iter_mut().filter(|p| p.4.is_none()) {
                    if let Ok(r) = rx.try_recv() {
                        *got = Some(r);
                        left -= 1;
                    }
                }
                left == 0
            },
            limit,
        );
        pending
            .into_iter()
            .map(|(a, id, inbox, _, got)| {
                got.unwrap_or(Err(TransportError::ConnectTimeout(format!("node {a}"))))?;
                Ok(SimSocket { node: a, id, inbox })
            })
            .collect()
    }

    /// A socket the peer opened on node `b`, if one is waiting.
    pub fn accept(&mut self, b: usize) -> Option<SimSocket> {
        let acc = self.nodes[b].accept_rx.try_recv().ok()?;
        Some(SimSocket { node: b, id: acc.id, inbox: acc.inbox })
    }

    /// Queues a message on a socket.
    pub fn send(&mut self, s: &SimSocket, msg: Msg) -> SendTicket {
        self.send_cmd(s, msg, None)
    }

    /// Writes a message into a buffer the peer exposed.
    pub fn send_to(&mut self, s: &SimSocket, msg: Msg, target: RemoteTarget) -> SendTicket {
        self.send_cmd(s, msg, Some(target))
    }

    fn send_cmd(&mut self, s: &SimSocket, msg: Msg, target: Option<RemoteTarget>) -> SendTicket {
        let (done, rx) = oneshot::channel();
        self.send_payload(s.node, s.id, msg.into(), target, Done::Notify(done));
        SendTicket(rx)
    }

    fn send_payload(
        &mut self,
        node: usize,
        id: u32,
        payload: Payload,
        target: Option<RemoteTarget>,
        done: Done,
    ) {
        self.nodes[node].ep.send(id, payload, target, done, PostWhen::Now);
        self.applied(node);
    }

    /// A call was applied on node `n`: it may have posted work (the switched fabric polls
    /// only devices it was told about) and needs a turn.
    fn applied(&mut self, n: usize) {
        self.nodes[n].dirty = true;
        self.fabric.touch(n);
    }

    /// Asks node `a` to open a socket on `engine`.
    pub(crate) fn open_cmd(&mut self, a: usize, engine: u32) -> Result<Opening> {
        let id = self.socket_ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, inbox) = mpsc::unbounded_channel();
        let (reply, rx) = oneshot::channel();
        self.nodes[a].ep.open(engine, id, tx, reply);
        self.applied(a);
        Ok(Opening { id, inbox, answered: rx })
    }

    /// Queues a message on socket `id` of node `node` (for [`crate::simio`]); with
    /// `notify` the receiver says when the NIC is done with it.
    pub(crate) fn send_cmd_raw(
        &mut self,
        node: usize,
        id: u32,
        payload: Payload,
        notify: bool,
    ) -> Option<oneshot::Receiver<Result<()>>> {
        if notify {
            let (done, rx) = oneshot::channel();
            self.send_payload(node, id, payload, None, Done::Notify(done));
            Some(rx)
        } else {
            self.send_payload(node, id, payload, None, Done::Forget);
            None
        }
    }

    /// Closes socket `id` of node `node` (for [`crate::simio`]).
    pub(crate) fn close_cmd(&mut self, node: usize, id: u32) {
        self.nodes[node].ep.close(id);
        self.applied(node);
    }

    /// Hands node `n`'s stream of sockets peers opened to an async owner ([`crate::simio`]);
    /// [`SimNet::accept`] on `n` finds nothing afterwards.
    pub(crate) fn take_accepts(&mut self, n: usize) -> mpsc::UnboundedReceiver<Accepted> {
        let (_, empty) = mpsc::unbounded_channel();
        std::mem::replace(&mut self.nodes[n].accept_rx, empty)
    }

    /// Whether node `n` was frozen.
    pub fn is_frozen(&self, n: usize) -> bool {
        self.nodes[n].ep.frozen
    }

    /// Node `n`'s shared receives (SRQ mode): (posted on its SRQ, recycled and waiting for
    /// their batch). Every receive of the ring is in one of the two once nothing is in flight.
    pub fn srq_receives(&self, n: usize) -> Option<(usize, usize)> {
        self.nodes[n].ep.shared_receives().map(|(srq, waiting)| (srq.len(), waiting))
    }

    /// Fails the engine under `s` as a QP error would.
    pub fn fail_engine(&mut self, s: &SimSocket, why: &str) {
        self.nodes[s.node].ep.fail_engine(s.id, why);
        self.applied(s.node);
    }

    /// Stops node `n` answering anything (its endpoint stops; the fabric still carries its
    /// packets to a device nobody drives, like a hung host).
    pub fn freeze(&mut self, n: usize) {
        self.nodes[n].ep.frozen = true;
    }

    /// Lets a frozen node run again (a host that resumes: what arrived meanwhile waits in
    /// its completion queue).
    pub fn thaw(&mut self, n: usize) {
        self.nodes[n].ep.frozen = false;
    }

    /// One round: every endpoint takes a turn at the current time, then the fabric steps (its
    /// clock stops at the earliest endpoint deadline). False when nothing at all is pending.
    pub fn step(&mut self) -> bool {
        self.step_capped(None)
    }

    /// [`SimNet::step`] whose clock jump stops at `cap` as well.
    fn step_capped(&mut self, cap: Option<Instant>) -> bool {
        let now = self.fabric.now();
        let busy = self.turn_endpoints(now);
        // An endpoint that did something may have more to do at this same instant: the clock
        // only moves when every endpoint is idle.
        let horizon = if busy { Some(now) } else { self.next_endpoint_deadline() };
        let horizon = match (horizon, cap) {
            (Some(h), Some(c)) => Some(h.min(c)),
            (h, c) => h.or(c),
        };
        let fab = self.fabric.step_within(horizon);
        busy || fab || horizon.is_some_and(|h| h > now || busy)
    }

    /// Does everything due at the current time without moving the clock: for a driver that
    /// keeps the network in step with another clock ([`crate::simio`]); it moves the clock
    /// with [`SimNet::advance_to`].
    pub fn step_at_now(&mut self) -> SimTick {
        let now = self.fabric.now();
        let busy = self.turn_endpoints(now);
        match self.fabric.step_at_now() {
            FabricTick::Worked => SimTick::Worked,
            _ if busy => SimTick::Worked,
            FabricTick::Idle { next } => {
                let next = [next, self.next_endpoint_deadline()].into_iter().flatten().min();
                SimTick::Idle { next }
            }
        }
    }

    /// Moves the virtual clock forward to `t` (never back).
    pub fn advance_to(&mut self, t: Instant) {
        self.fabric.advance_to(t);
    }

    fn next_endpoint_deadline(&self) -> Option<Instant> {
        self.nodes.iter().filter(|n| !n.ep.frozen).filter_map(|n| n.deadline).min()
    }

    /// Every endpoint with something pending takes a turn at `now`; true if any did work.
    fn turn_endpoints(&mut self, now: Instant) -> bool {
        let mut busy = false;
        for (i, n) in self.nodes.iter_mut().enumerate() {
            if n.ep.frozen {
                continue;
            }
            // An endpoint's inputs are the calls applied to it, its CQ and its timers: one
            // with none of them pending would do nothing (large simulations are mostly such).
            if !(n.dirty || n.cq.pending() || n.deadline.is_some_and(|t| t <= now)) {
                continue;
            }
            let b = n.ep.turn(now);
            n.dirty = b;
            n.deadline = n.ep.poll_timeout();
            if b {
                self.fabric.touch(i);
            }
            busy |= b;
        }
        busy
    }

    /// Steps until `done(self)` or `limit` of virtual time passes; returns `done`'s verdict.
    pub fn run_until(
        &mut self,
        mut done: impl FnMut(&mut SimNet) -> bool,
        limit: Duration,
    ) -> bool {
        let deadline = self.now() + limit;
        loop {
            if done(self) {
                return true;
            }
            // The clock never jumps past the deadline (to a far timer, say): a caller that
            // runs the network "for 100 µs" gets 100 µs.
            if self.now() >= deadline || !self.step_capped(Some(deadline)) {
                return done(self);
            }
        }
    }
}
