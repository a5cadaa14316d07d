//! An endpoint: one completion queue, the engines (QPs) whose completions it receives, and
//! the application's side of their sockets (inboxes, pending opens, send handles).
//!
//! Like the engine it holds no clock and never blocks: every call takes `now` or needs no
//! time, and the NIC calls it makes (post, poll) return at once. Two owners drive it: the
//! async driver ([`crate::driver`]), which runs [`Endpoint::turn`] when the CQ's fd or a
//! timer fires and applies the application's calls under a lock, and [`crate::sim::SimNet`],
//! which runs it by hand on a virtual clock. Between them they share every line here.
//!
//! Engines are kept in QP order and events delivered in the order engines produce them, so
//! a simulated run wakes its tasks in the same order in every process.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bex_rnic::verbs::{WcStatus, WorkCompletion};
use bex_rnic::{CompletionQueue, Device, QueuePair, SharedReceiveQueue};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use crate::engine::{Engine, Event, Post, RemoteTarget, RECV_TAG};
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload};
use crate::recv::RecvRing;

/// Who learns that the NIC is done with a sent message.
pub(crate) enum Done {
    /// A caller waits for the outcome.
    Notify(oneshot::Sender<Result<()>>),
    /// Nobody waits (nobody is woken): the socket's queue slot is freed on drop.
    Detached(#[allow(dead_code)] OwnedSemaphorePermit),
    /// Nobody waits and nothing is held (simulation).
    Forget,
}

impl Done {
    fn finish(self, r: Result<()>) {
        if let Done::Notify(tx) = self {
            let _ = tx.send(r);
        }
    }
}

/// A socket accepted by a listener, handed to the application.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub id: u32,
    pub endpoint: usize,
    pub inbox: mpsc::UnboundedReceiver<Result<Msg>>,
    pub peer: SocketAddr,
}

/// Called when an engine dies, so the connection table forgets it.
pub(crate) type OnEngineGone = Arc<dyn Fn(SocketAddr, usize, u32) + Send + Sync>;

/// The shared receive ring and its SRQ (SRQ mode).
pub(crate) type SharedRecv<D> = (Arc<Mutex<RecvRing>>, Arc<<D as Device>::Srq>);

struct Hosted<D: Device> {
    engine: Engine<Done>,
    qp: D::Qp,
    peer: SocketAddr,
}

/// The application's side of one socket.
struct SocketEdge {
    qpn: u32,
    inbox: mpsc::UnboundedSender<Result<Msg>>,
    opening: Option<oneshot::Sender<Result<()>>>,
    /// Why it ended; later sends fail with it.
    ended: Option<TransportError>,
}

/// When [`Endpoint::send`] posts what it queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PostWhen {
    /// At once.
    Now,
    /// At once if the engine has nothing in flight (see `Engine::is_idle`), else with the
    /// next flush: alone it goes without waiting, behind a busy engine it batches.
    IfIdle,
}

/// One CQ's engines and sockets.
pub(crate) struct Endpoint<D: Device> {
    pub index: usize,
    cq: Arc<D::Cq>,
    srq: Option<SharedRecv<D>>,
    /// Ordered by QP number, so engines take their turns in the same order in every process.
    engines: BTreeMap<u32, Hosted<D>>,
    sockets: HashMap<u32, SocketEdge>,
    accept: Option<mpsc::UnboundedSender<Accepted>>,
    on_gone: OnEngineGone,
    /// Engines with work queued by the application but not posted yet (deferred flush).
    unposted: BTreeSet<u32>,
    wcs: Vec<WorkCompletion>,
    /// A frozen endpoint is not driven (simulation of a hung host).
    pub frozen: bool,
}

impl<D: Device> Endpoint<D> {
    pub fn new(
        index: usize,
        cq: Arc<D::Cq>,
        srq: Option<SharedRecv<D>>,
        accept: Option<mpsc::UnboundedSender<Accepted>>,
        on_gone: OnEngineGone,
    ) -> Endpoint<D> {
        Endpoint {
            index,
            cq,
            srq,
            engines: BTreeMap::new(),
            sockets: HashMap::new(),
            accept,
            on_gone,
            unposted: BTreeSet::new(),
            wcs: vec![WorkCompletion::default(); 64],
            frozen: false,
        }
    }

    /// Gives receive slot `slot` of the shared ring back and posts a batch when one is due.
    fn return_shared_receive(&mut self, slot: usize) {
        let Some((ring, srq)) = &self.srq else { return };
        let batch = ring.lock().recycle(slot);
        let posted = batch.and_then(|b| {
            if b.is_empty() {
                Ok(())
            } else {
                srq.post_recv(&b).map_err(TransportError::from)
            }
        });
        if let Err(e) = posted {
            tracing::error!(endpoint = self.index, slot, %e, "returning a shared receive");
        }
    }

    /// The SRQ and the receives of its ring waiting to be posted (SRQ mode; the simulator
    /// reports what the ring keeps).
    pub(crate) fn shared_receives(&self) -> Option<(&D::Srq, usize)> {
        self.srq.as_ref().map(|(ring, srq)| (srq.as_ref(), ring.lock().waiting()))
    }

    /// The shared receive ring, for engines created for this endpoint (SRQ mode).
    pub fn shared_ring(&self) -> Option<Arc<Mutex<RecvRing>>> {
        self.srq.as_ref().map(|(ring, _)| ring.clone())
    }

    /// Hosts an engine whose QP is connected (RTS) and whose own receives are posted.
    pub fn add_engine(&mut self, engine: Engine<Done>, qp: D::Qp, peer: SocketAddr) {
        let qpn = engine.qpn;
        self.engines.insert(qpn, Hosted { engine, qp, peer });
        self.settle(qpn);
    }

    /// Opens socket `socket` on engine `qpn`; `reply` resolves when the peer answers.
    pub fn open(
        &mut self,
        qpn: u32,
        socket: u32,
        inbox: mpsc::UnboundedSender<Result<Msg>>,
        reply: oneshot::Sender<Result<()>>,
    ) {
        let Some(h) = self.engines.get_mut(&qpn) else {
            let _ = reply.send(Err(TransportError::ConnectionLost("the engine is gone".into())));
            return;
        };
        self.sockets.insert(socket, SocketEdge { qpn, inbox, opening: Some(reply), ended: None });
        h.engine.open_socket(socket);
        self.settle(qpn);
    }

    /// Queues a message and posts it as `when` says; one left unposted waits for
    /// [`Endpoint::flush`] (or the next turn), so that sends issued together share one
    /// doorbell.
    pub fn send(
        &mut self,
        socket: u32,
        payload: Payload,
        target: Option<RemoteTarget>,
        done: Done,
        when: PostWhen,
    ) {
        let Some(edge) = self.sockets.get(&socket) else {
            done.finish(Err(TransportError::Closed));
            return;
        };
        let qpn = edge.qpn;
        let Some(h) = self.engines.get_mut(&qpn) else {
            // The engine failed and is gone: its error (the engine judges bad arguments
            // first while it lives; so does this).
            let too_big = target.is_some_and(|t| payload.len() as u64 > t.len);
            let e = match &edge.ended {
                _ if too_big => TransportError::Invalid("message larger than its target".into()),
                Some(e) => e.clone(),
                None => TransportError::Closed,
            };
            done.finish(Err(e));
            return;
        };
        let post_now = match when {
            PostWhen::Now => true,
            PostWhen::IfIdle => h.engine.is_idle(),
        };
        h.engine.enqueue(socket, payload, target, done);
        if post_now {
            self.settle(qpn);
        } else {
            self.unposted.insert(qpn);
        }
    }

    /// Exposes `buf` for the peer's direct writes.
    pub fn expose(&mut self, socket: u32, buf: Msg) -> Result<RemoteTarget> {
        let edge = self.sockets.get(&socket).ok_or(TransportError::Closed)?;
        if let Some(e) = &edge.ended {
            return Err(e.clone());
        }
        let h = self.engines.get_mut(&edge.qpn).ok_or(TransportError::Closed)?;
        h.engine.expose(socket, buf)
    }

    /// The application dropped its socket.
    pub fn close(&mut self, socket: u32) {
        let Some(edge) = self.sockets.remove(&socket) else { return };
        if let Some(h) = self.engines.get_mut(&edge.qpn) {
            h.engine.close_socket(socket);
            self.settle(edge.qpn);
        }
    }

    /// Fails the engine under `socket`, as a QP error would.
    pub fn fail_engine(&mut self, socket: u32, why: &str) {
        let Some(qpn) = self.sockets.get(&socket).map(|e| e.qpn) else { return };
        if let Some(h) = self.engines.get_mut(&qpn) {
            h.engine.fail(why.to_string());
            self.settle(qpn);
        }
    }

    /// Ends engine `qpn`, hosted by a bootstrap that then failed or was cancelled before
    /// the peer confirmed (no socket can be on it yet): not counted as a failure.
    pub fn abandon_engine(&mut self, qpn: u32) {
        if let Some(h) = self.engines.get_mut(&qpn) {
            tracing::debug!(qpn, "engine abandoned: its bootstrap did not complete");
            h.engine.shut_down();
            self.settle(qpn);
        }
    }

    /// Fails every engine (RDMA taken out of service, shutdown).
    pub fn fail_all(&mut self, why: &str) {
        self.end_all(|e| e.fail(why.to_string()));
    }

    /// Ends every engine because the transport shuts down (not counted as failures).
    pub fn shut_down_all(&mut self) {
        self.end_all(Engine::shut_down);
    }

    fn end_all(&mut self, mut end: impl FnMut(&mut Engine<Done>)) {
        let qpns: Vec<u32> = self.engines.keys().copied().collect();
        for qpn in qpns {
            if let Some(h) = self.engines.get_mut(&qpn) {
                end(&mut h.engine);
            }
            self.settle(qpn);
        }
    }

    /// Posts what sends queued without posting; true if anything was posted or delivered.
    pub fn flush(&mut self) -> bool {
        let mut did = false;
        for qpn in std::mem::take(&mut self.unposted) {
            did |= self.settle(qpn);
        }
        did
    }

    /// Arms the CQ for an event on its fd (before the driver waits).
    pub fn arm(&self) -> Result<()> {
        self.cq.arm()?;
        Ok(())
    }

    /// One pass at `now`: completions (the software NIC receives inline when its CQ is
    /// empty), timers, deferred posts. True if anything happened.
    pub fn turn(&mut self, now: Instant) -> bool {
        let mut busy = self.flush();
        let mut touched = BTreeSet::new();
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    // An overrun CQ has lost completions: nothing on it can be trusted.
                    tracing::error!(endpoint = self.index, %e, "polling the CQ failed");
                    self.wcs = wcs;
                    self.fail_all(&format!("completion queue failed: {e}"));
                    return true;
                }
            };
            for wc in &wcs[..n] {
                // A receive of the shared ring that no live engine will recycle (its engine
                // failed or is gone, or the completion is an error) goes back to the ring
                // here: left, it was lost to every engine of the endpoint.
                let shared_recv = self.srq.is_some() && wc.wr_id & RECV_TAG != 0;
                let orphan = match self.engines.get_mut(&wc.qp_num) {
                    Some(h) => {
                        let orphan =
                            shared_recv && (h.engine.is_failed() || wc.status != WcStatus::Success);
                        h.engine.handle_completion(now, wc);
                        touched.insert(wc.qp_num);
                        orphan
                    }
                    None => {
                        tracing::debug!(qpn = wc.qp_num, "completion for a QP with no engine");
                        shared_recv
                    }
                };
                if orphan {
                    self.return_shared_receive((wc.wr_id & !RECV_TAG) as usize);
                }
            }
            let full = n == wcs.len();
            self.wcs = wcs;
            busy |= n > 0;
            if !full {
                break;
            }
        }
        for (&qpn, h) in self.engines.iter_mut() {
            if h.engine.poll_timeout().is_some_and(|t| t <= now) {
                h.engine.handle_timeout(now);
                touched.insert(qpn);
            }
        }
        for qpn in touched {
            busy |= self.settle(qpn);
        }
        busy
    }

    /// The earliest time [`Endpoint::turn`] has timer work: an engine's keepalive or the
    /// NIC's own timers (a software NIC runs them in its poller).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let engines = self.engines.values().filter_map(|h| h.engine.poll_timeout()).min();
        [engines, self.cq.poll_timeout()].into_iter().flatten().min()
    }

    /// Posts what engine `qpn` has ready, delivers its events, and retires it if it failed.
    /// True if it posted or delivered anything.
    fn settle(&mut self, qpn: u32) -> bool {
        let mut did = false;
        let Some(h) = self.engines.get_mut(&qpn) else { return did };
        loop {
            loop {
                let on_srq = h.engine.uses_srq();
                let r = match h.engine.poll_post() {
                    None => break,
                    Some(Post::Send(wrs)) => h.qp.post_send(wrs),
                    Some(Post::Recv(wrs)) => match (&self.srq, on_srq) {
                        (Some((_, srq)), true) => srq.post_recv(wrs),
                        _ => h.qp.post_recv(wrs),
                    },
                };
                did = true;
                if let Err(e) = r {
                    h.engine.fail(format!("post: {e}"));
                }
            }
            let mut closed_again = false;
            while let Some(ev) = h.engine.poll_event() {
                did = true;
                match ev {
                    Event::Sent { done, result } => done.finish(result),
                    Event::Received { socket, msg } => {
                        if let Some(edge) = self.sockets.get(&socket) {
                            let _ = edge.inbox.send(Ok(msg));
                        }
                    }
                    Event::Opened { socket, result } => {
                        let failed = result.is_err();
                        if let Some(edge) = self.sockets.get_mut(&socket) {
                            if let Some(reply) = edge.opening.take() {
                                let _ = reply.send(result);
                            }
                        }
                        if failed {
                            self.sockets.remove(&socket);
                        }
                    }
                    Event::Ended { socket, error } => {
                        if let Some(edge) = self.sockets.get_mut(&socket) {
                            let _ = edge.inbox.send(Err(error.clone()));
                            edge.ended = Some(error);
                        }
                    }
                    Event::Accepted { socket } => {
                        let (tx, inbox) = mpsc::unbounded_channel();
                        let accepted =
                            Accepted { id: socket, endpoint: self.index, inbox, peer: h.peer };
                        let taken = self.accept.as_ref().is_some_and(|a| a.send(accepted).is_ok());
                        if taken {
                            let edge = SocketEdge { qpn, inbox: tx, opening: None, ended: None };
                            self.sockets.insert(socket, edge);
                        } else {
                            // Nobody accepts any more: close it again (a Close to post).
                            h.engine.close_socket(socket);
                            closed_again = true;
                        }
                    }
                }
            }
            if !closed_again {
                break;
            }
        }
        if h.engine.is_failed() {
            let unposted = h.engine.take_unposted_shared_receives();
            if let (Some((_, srq)), false) = (&self.srq, unposted.is_empty()) {
                if let Err(e) = srq.post_recv(&unposted) {
                    tracing::error!(endpoint = self.index, %e, "re-posting a failed engine's shared receives");
                }
            }
            // Flushes whatever the NIC still holds; the engine's own state is already reset.
            let _ = h.qp.to_error();
            let peer = h.peer;
            self.engines.remove(&qpn);
            self.unposted.remove(&qpn);
            (self.on_gone)(peer, self.index, qpn);
        }
        did
    }
}
