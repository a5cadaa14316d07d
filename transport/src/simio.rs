//! [`SimTransport`]: the async transport API over a [`SimNet`], so the RPC layer and the
//! parameter server run unmodified over simulated NICs, on tokio's paused (virtual) clock.
//!
//! A [`SimHub`] owns the network; its driver task ([`SimHub::drive`]) keeps the network's
//! clock and tokio's in step. Within one millisecond of tokio time the network runs ahead on
//! its own (packets take microseconds); to cross a millisecond boundary the driver sleeps,
//! which lets tokio advance when every task is idle and fire the application's timers (tokio
//! timers have millisecond resolution). So the application sees the network's events within
//! the millisecond they happen, and a run on a current-thread runtime is a function of its
//! seeds.
//!
//! Each transport is a node of the network listening at a virtual address; `connect` wires
//! an engine to the node at that address directly (no bootstrap exchange) and opens a
//! socket on it. A transport can stand for either kind: a host's "TCP" path is a second
//! node, so failing one path while the other works is a fabric fault on one node.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::Pool;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::any::TransportKind;
use crate::config::{Config, CounterSnapshot};
use crate::endpoint::Accepted;
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload};
use crate::sim::{SimNet, SimTick};

/// Driver yields at one instant before it lets the clock move, so that chains of tasks woken
/// by one delivery run at the instant of the delivery.
const SETTLE_YIELDS: usize = 4;

struct HubState {
    net: SimNet,
    /// Listen address → node, for the nodes that are up.
    listeners: BTreeMap<SocketAddr, usize>,
    /// Device address → listen address (the peer address of accepted sockets).
    listen_of_device: BTreeMap<SocketAddr, SocketAddr>,
    /// (from, to) → the engine's QP number at `from`.
    engines: BTreeMap<(usize, usize), u32>,
}

/// A [`SimNet`] shared by async transports, and its driver.
pub struct SimHub {
    state: Mutex<HubState>,
    kick: Notify,
    kicked: AtomicBool,
    /// Tokio's and the network's clocks at the start: `sim = sim0 + (tokio − tokio0)`.
    tokio0: tokio::time::Instant,
    sim0: Instant,
}

impl std::fmt::Debug for SimHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHub").field("nodes", &self.state.lock().net.len()).finish()
    }
}

impl SimHub {
    /// A hub over `net`. Call it first thing on a current-thread runtime with a paused clock
    /// (`start_paused`), and spawn [`SimHub::drive`].
    pub fn new(net: SimNet) -> Arc<SimHub> {
        let sim0 = net.now();
        Arc::new(SimHub {
            state: Mutex::new(HubState {
                net,
                listeners: BTreeMap::new(),
                listen_of_device: BTreeMap::new(),
                engines: BTreeMap::new(),
            }),
            kick: Notify::new(),
            kicked: AtomicBool::new(false),
            tokio0: tokio::time::Instant::now(),
            sim0,
        })
    }

    /// The network's virtual time (at most a millisecond ahead of tokio's).
    pub fn now(&self) -> Instant {
        self.state.lock().net.now()
    }

    /// Runs `f` on the network (faults, counters). The network's clock is the simulation's.
    pub fn with_net<T>(&self, f: impl FnOnce(&mut SimNet) -> T) -> T {
        let r = f(&mut self.state.lock().net);
        self.wake();
        r
    }

    /// Adds a node listening at `addr` and returns its transport.
    pub fn add_transport(
        self: &Arc<Self>,
        addr: SocketAddr,
        kind: TransportKind,
        cfg: Config,
    ) -> Result<SimTransport> {
        Ok(self.add_host(vec![(addr, kind, cfg)])?.remove(0))
    }

    /// Adds a host: one node per `(address, kind, config)`, all sharing one pool (as a real
    /// host's RDMA and TCP transports do), and returns their transports in order.
    pub fn add_host(
        self: &Arc<Self>,
        listeners: Vec<(SocketAddr, TransportKind, Config)>,
    ) -> Result<Vec<SimTransport>> {
        let mut st = self.state.lock();
        for (addr, ..) in &listeners {
            if st.listeners.contains_key(addr) {
                return Err(TransportError::Invalid(format!("{addr} is already listening")));
            }
        }
        let (meta, cfgs): (Vec<_>, Vec<_>) =
            listeners.into_iter().map(|(a, k, c)| ((a, k), c)).unzip();
        let nodes = st.net.add_nodes(cfgs)?;
        let mut out = Vec::with_capacity(nodes.len());
        for (node, (addr, kind)) in nodes.into_iter().zip(meta) {
            let accepts = st.net.take_accepts(node);
            let device = st.net.device(node).local_addr();
            st.listeners.insert(addr, node);
            st.listen_of_device.insert(device, addr);
            let pool = st.net.pool(node);
            out.push(SimTransport(Arc::new(TransportInner {
                hub: self.clone(),
                node,
                addr,
                kind,
                pool,
                accepts: tokio::sync::Mutex::new(accepts),
            })));
        }
        Ok(out)
    }

    /// Kills a node as a crashed host: it stops answering, its address refuses connections,
    /// and peers find out through their keepalives.
    pub fn kill(&self, t: &SimTransport) {
        let mut st = self.state.lock();
        st.net.freeze(t.0.node);
        if st.listeners.get(&t.0.addr) == Some(&t.0.node) {
            st.listeners.remove(&t.0.addr);
        }
    }

    /// The node behind a transport (for fabric faults on its device).
    pub fn node_of(&self, t: &SimTransport) -> usize {
        t.0.node
    }

    fn wake(&self) {
        self.kicked.store(true, Ordering::Release);
        self.kick.notify_one();
    }

    fn sim_of(&self, t: tokio::time::Instant) -> Instant {
        self.sim0 + t.saturating_duration_since(self.tokio0)
    }

    fn tokio_of(&self, t: Instant) -> tokio::time::Instant {
        self.tokio0 + t.saturating_duration_since(self.sim0)
    }

    /// The first whole millisecond (since the hub started) after `t`.
    fn next_ms(&self, t: tokio::time::Instant) -> tokio::time::Instant {
        let ms = t.saturating_duration_since(self.tokio0).as_millis() as u64 + 1;
        self.tokio0 + Duration::from_millis(ms)
    }

    /// Drives the network for ever; spawn it on the simulation's runtime.
    pub async fn drive(self: Arc<Self>) {
        loop {
            let tick = self.state.lock().net.step_at_now();
            if tick == SimTick::Worked {
                tokio::task::yield_now().await;
                continue;
            }
            for _ in 0..SETTLE_YIELDS {
                tokio::task::yield_now().await;
            }
            if self.kicked.swap(false, Ordering::AcqRel) {
                continue;
            }
            let now = tokio::time::Instant::now();
            let boundary = self.next_ms(now);
            let next = match tick {
                SimTick::Idle { next } => next,
                SimTick::Worked => None,
            };
            let sim_now = self.state.lock().net.now();
            match next {
                // Inside this millisecond the network moves on its own.
                Some(t) if t > sim_now && self.tokio_of(t) < boundary => {
                    self.state.lock().net.advance_to(t);
                }
                _ => {
                    tokio::select! {
                        biased;
                        () = self.kick.notified() => {}
                        () = tokio::time::sleep_until(boundary) => {}
                    }
                    self.kicked.store(false, Ordering::Release);
                    let t = self.sim_of(tokio::time::Instant::now());
                    self.state.lock().net.advance_to(t);
                }
            }
        }
    }
}

struct TransportInner {
    hub: Arc<SimHub>,
    node: usize,
    addr: SocketAddr,
    kind: TransportKind,
    pool: &'static Pool,
    accepts: tokio::sync::Mutex<mpsc::UnboundedReceiver<Accepted>>,
}

/// A transport on a simulated node (see the module docs).
#[derive(Clone)]
pub struct SimTransport(Arc<TransportInner>);

impl std::fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTransport")
            .field("node", &self.0.node)
            .field("addr", &self.0.addr)
            .field("kind", &self.0.kind)
            .finish()
    }
}

impl SimTransport {
    /// The kind it stands for.
    pub fn kind(&self) -> TransportKind {
        self.0.kind
    }

    /// The virtual address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// The node's pool.
    pub fn pool(&self) -> &'static Pool {
        self.0.pool
    }

    /// The node's transport counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.0.hub.state.lock().net.counters(self.0.node)
    }

    /// Opens a socket to the transport listening at `addr`: refused at once if nothing
    /// listens there; otherwise on the engine to that node (a new one if the last failed),
    /// resolving when the peer answers — never, if it cannot (callers bound it, as over RDMA).
    pub async fn connect(&self, addr: SocketAddr) -> Result<SimTransportSocket> {
        let me = self.0.node;
        for fresh in [false, true] {
            let opening = {
                let mut st = self.0.hub.state.lock();
                let Some(&dest) = st.listeners.get(&addr) else {
                    return Err(TransportError::Refused(format!("nothing listens at {addr}")));
                };
                let qpn = match st.engines.get(&(me, dest)) {
                    Some(&q) if !fresh => q,
                    _ => {
                        let q = st.net.connect(me, dest)?;
                        st.engines.insert((me, dest), q);
                        q
                    }
                };
                st.net.open_cmd(me, qpn)?
            };
            self.0.hub.wake();
            match opening.answered.await {
                Ok(Ok(())) => return Ok(self.socket(opening.id, opening.inbox, addr)),
                // The cached engine failed: one new engine, as the RDMA transport does.
                Ok(Err(_)) if !fresh => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(TransportError::Shutdown),
            }
        }
        unreachable!("the loop returns on its second pass")
    }

    /// Waits for a socket a peer opened.
    pub async fn accept(&self) -> Result<SimTransportSocket> {
        let a = self.0.accepts.lock().await.recv().await.ok_or(TransportError::Shutdown)?;
        let peer = self.0.hub.state.lock().listen_of_device.get(&a.peer).copied().unwrap_or(a.peer);
        Ok(self.socket(a.id, a.inbox, peer))
    }

    /// Stops the node, as [`SimHub::kill`].
    pub fn shutdown(&self) {
        self.0.hub.kill(self);
    }

    fn socket(
        &self,
        id: u32,
        inbox: mpsc::UnboundedReceiver<Result<Msg>>,
        peer: SocketAddr,
    ) -> SimTransportSocket {
        SimTransportSocket {
            transport: self.0.clone(),
            id,
            peer,
            inbox: tokio::sync::Mutex::new(inbox),
            ended: Mutex::new(None),
        }
    }
}

/// A socket of a [`SimTransport`].
pub struct SimTransportSocket {
    transport: Arc<TransportInner>,
    id: u32,
    peer: SocketAddr,
    inbox: tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Msg>>>,
    ended: Mutex<Option<TransportError>>,
}

impl std::fmt::Debug for SimTransportSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTransportSocket")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .finish()
    }
}

impl SimTransportSocket {
    /// The kind its transport stands for.
    pub fn kind(&self) -> TransportKind {
        self.transport.kind
    }

    /// The peer transport's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Sends a message; resolves when the simulated NIC is done with it.
    pub async fn send(&self, msg: Msg) -> Result<()> {
        let done = self.queue(msg.into(), true).expect("a notified send has a receiver");
        done.await.map_err(|_| TransportError::Shutdown)?
    }

    /// Queues a message without waiting for the simulated NIC to finish with it.
    pub async fn send_detached(&self, msg: impl Into<Payload>) -> Result<()> {
        self.queue(msg.into(), false);
        Ok(())
    }

    /// Hands a message to the simulated NIC; with `notify` the receiver says when it is done
    /// with it.
    fn queue(
        &self,
        payload: Payload,
        notify: bool,
    ) -> Option<tokio::sync::oneshot::Receiver<Result<()>>> {
        let t = &self.transport;
        let done = t.hub.state.lock().net.send_cmd_raw(t.node, self.id, payload, notify);
        t.hub.wake();
        done
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
}

impl Drop for SimTransportSocket {
    fn drop(&mut self) {
        let t = &self.transport;
        t.hub.state.lock().net.close_cmd(t.node, self.id);
        t.hub.wake();
    }
}
