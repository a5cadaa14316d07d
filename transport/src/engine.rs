//! An engine: one RC QP and everything that rides on it (paper §5.4, Figure 7) — the
//! work-request chain, receive buffers and credits, the send window, the logical sockets
//! multiplexed onto it and their round-robin scheduler, and keepalive.
//!
//! An engine is owned by exactly one I/O thread and is driven with time passed in:
//! [`Engine::on_completion`] for each work completion of its QP, [`Engine::fill`] to prepare
//! and post work (one doorbell per call), [`Engine::tick`] for timers. It talks to the
//! application only through channels, so it never blocks.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bemalloc::Pool;
use bex_rnic::verbs::{SendOp, SendWr, SgList, WcOpcode, WcStatus, WorkCompletion};
use bex_rnic::{Device, QueuePair};
use tokio::sync::{mpsc, oneshot};

use crate::config::{Config, Counters};
use crate::error::{Result, TransportError};
use crate::msg::Msg;
use crate::policy::chain::WrChain;
use crate::policy::credits::{SendCredits, Use};
use crate::policy::keepalive::Keepalive;
use crate::policy::sched::RoundRobin;
use crate::policy::window::SendWindow;
use crate::proto::{Header, Kind, HEADER_LEN};
use crate::recv::{Receives, RecvRing, SharedRecv};

/// Receive work requests carry this bit in their id (send ids are chain slots).
pub(crate) const RECV_TAG: u64 = 1 << 63;
/// A CTS with this slot refuses the message (the receiver could not allocate it).
const REFUSED: u32 = u32::MAX;

/// Where a large message goes when the receiver's buffer is known in advance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteTarget {
    /// Destination address at the receiver.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// The receiver's slot for it (from [`crate::RdmaSocket::expose`]).
    pub slot: u32,
    /// Capacity in bytes.
    pub len: u64,
}

/// Who learns that the NIC is done with a sent message.
pub(crate) enum Done {
    /// A caller waits for the outcome.
    Notify(oneshot::Sender<Result<()>>),
    /// Nobody waits (nobody is woken): the send-queue slot it holds is freed on drop.
    Detached { _slot: tokio::sync::OwnedSemaphorePermit },
}

impl Done {
    pub fn finish(self, r: Result<()>) {
        if let Done::Notify(tx) = self {
            let _ = tx.send(r);
        }
    }
}

impl From<oneshot::Sender<Result<()>>> for Done {
    fn from(tx: oneshot::Sender<Result<()>>) -> Done {
        Done::Notify(tx)
    }
}

/// A message waiting to be sent.
pub(crate) struct OutMsg {
    pub msg: Msg,
    pub done: Option<Done>,
    pub phase: Phase,
    pub msg_id: u32,
}

impl OutMsg {
    fn finish(mut self, r: Result<()>) {
        if let Some(done) = self.done.take() {
            done.finish(r);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Small: one SEND.
    Eager,
    /// Large: an RTS is to be sent.
    Rts,
    /// Large: waiting for the receiver's CTS.
    AwaitCts,
    /// Large: writing fragments.
    Write { addr: u64, rkey: u32, slot: u32, offset: u64 },
}

/// A socket accepted by a listener, handed to the application.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub id: u32,
    pub worker: usize,
    pub inbox: mpsc::UnboundedReceiver<Result<Msg>>,
    pub peer: SocketAddr,
}

enum SockState {
    Opening(oneshot::Sender<Result<()>>),
    Open,
    PeerClosed,
}

struct SocketState {
    peer: u32,
    state: SockState,
    sendq: VecDeque<OutMsg>,
    inbox: mpsc::UnboundedSender<Result<Msg>>,
    next_msg_id: u32,
}

impl SocketState {
    /// Has something the scheduler can work on now.
    fn sendable(&self) -> bool {
        matches!(self.state, SockState::Open)
            && self.sendq.front().is_some_and(|m| m.phase != Phase::AwaitCts)
    }
}

struct LargeIn {
    buf: Msg,
    socket: u32,
}

enum Release {
    None,
    Message(OutMsg),
}

struct SlotData {
    bytes: u64,
    release: Release,
}

/// Why an engine stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EngineState {
    Ready,
    Failed(String),
}

/// One QP and its state.
pub(crate) struct Engine<D: Device> {
    pub qpn: u32,
    pub worker: usize,
    pub peer_addr: SocketAddr,
    pub state: EngineState,
    qp: D::Qp,
    cfg: Arc<Config>,
    pool: &'static Pool,
    dev: usize,
    counters: Arc<Counters>,
    chain: WrChain,
    slots: Vec<SlotData>,
    /// The work request prepared in each chain slot.
    prepared: Vec<SendWr>,
    wrs: Vec<SendWr>,
    headers: Msg,
    bounce: Option<Msg>,
    credits: SendCredits,
    window: SendWindow,
    recv: Receives<D>,
    large_in: HashMap<u32, LargeIn>,
    next_large_slot: u32,
    ctrl: VecDeque<Header>,
    sockets: HashMap<u32, SocketState>,
    rr: RoundRobin,
    keepalive: Keepalive,
    accept: Option<mpsc::UnboundedSender<Accepted>>,
    socket_ids: Arc<std::sync::atomic::AtomicU32>,
    /// Sockets created by the peer's Open since the worker last looked.
    pub new_sockets: Vec<u32>,
    /// Sockets gone since the worker last looked.
    pub gone_sockets: Vec<u32>,
}

/// What an engine needs besides its QP.
pub(crate) struct EngineParts<D: Device> {
    pub cfg: Arc<Config>,
    pub pool: &'static Pool,
    pub dev: usize,
    pub counters: Arc<Counters>,
    pub worker: usize,
    pub peer_addr: SocketAddr,
    pub peer_rq_depth: u32,
    pub accept: Option<mpsc::UnboundedSender<Accepted>>,
    pub socket_ids: Arc<std::sync::atomic::AtomicU32>,
    /// The I/O thread's shared receive ring and SRQ (SRQ mode); `None`: a ring of its own.
    pub shared_recv: Option<SharedRecv<D>>,
}

impl<D: Device> Engine<D> {
    /// Allocates the engine's registered memory and posts its receives. The QP must be in
    /// INIT (or later) so the receives can be posted before the peer can send.
    pub fn new(qp: D::Qp, parts: EngineParts<D>, now: Instant) -> Result<Engine<D>> {
        let cfg = parts.cfg;
        let sq = cfg.sq_depth as usize;
        let headers = Msg::alloc(parts.pool, sq * HEADER_LEN)?;
        let bounce = if cfg.eager_copy {
            Some(Msg::alloc(parts.pool, sq * (HEADER_LEN + cfg.eager_max))?)
        } else {
            None
        };
        let recv = match parts.shared_recv {
            Some((ring, srq)) => Receives::Shared(ring, srq),
            None => Receives::Own(RecvRing::new(
                parts.pool,
                parts.dev,
                cfg.rq_depth,
                HEADER_LEN + cfg.eager_max,
            )?),
        };
        // A peer on an SRQ announces depth 0: it takes no credits (RNR retry instead).
        let credits = if parts.peer_rq_depth == 0 {
            SendCredits::unlimited()
        } else {
            SendCredits::new(parts.peer_rq_depth)
        };
        let e: Engine<D> = Engine {
            qpn: qp.qpn(),
            worker: parts.worker,
            peer_addr: parts.peer_addr,
            state: EngineState::Ready,
            qp,
            chain: WrChain::new(sq),
            slots: (0..sq).map(|_| SlotData { bytes: 0, release: Release::None }).collect(),
            prepared: vec![
                SendWr {
                    wr_id: 0,
                    op: SendOp::Send,
                    sg_list: SgList::new(),
                    signaled: false
                };
                sq
            ],
            wrs: Vec::with_capacity(sq),
            headers,
            bounce,
            credits,
            window: SendWindow::new(cfg.cwnd_bytes),
            recv,
            large_in: HashMap::new(),
            next_large_slot: 1,
            ctrl: VecDeque::new(),
            sockets: HashMap::new(),
            rr: RoundRobin::default(),
            keepalive: Keepalive::new(now, cfg.keepalive_interval, cfg.keepalive_timeout),
            accept: parts.accept,
            socket_ids: parts.socket_ids,
            new_sockets: Vec::new(),
            gone_sockets: Vec::new(),
            pool: parts.pool,
            dev: parts.dev,
            counters: parts.counters,
            cfg,
        };
        // An SRQ's ring is posted once by its I/O thread, not per engine.
        if let Receives::Own(ring) = &e.recv {
            e.qp.post_recv(&ring.all())?;
        }
        Ok(e)
    }

    /// The QP (for state transitions during setup).
    pub fn qp(&self) -> &D::Qp {
        &self.qp
    }

    /// Opens a socket to the peer; `reply` resolves when the peer accepts or refuses.
    pub fn open_socket(
        &mut self,
        id: u32,
        inbox: mpsc::UnboundedSender<Result<Msg>>,
        reply: oneshot::Sender<Result<()>>,
    ) {
        if let EngineState::Failed(why) = &self.state {
            let _ = reply.send(Err(TransportError::ConnectionLost(why.clone())));
            return;
        }
        self.sockets.insert(
            id,
            SocketState {
                peer: 0,
                state: SockState::Opening(reply),
                sendq: VecDeque::new(),
                inbox,
                next_msg_id: 1,
            },
        );
        let mut h = Header::new(Kind::Open);
        h.src_socket = id;
        self.ctrl.push_back(h);
    }

    /// Queues a message on a socket; fails its completion at once if the message cannot go
    /// (too big for the target, socket gone or closed by the peer, engine failed).
    pub fn enqueue(&mut self, socket: u32, msg: Msg, target: Option<RemoteTarget>, done: Done) {
        let eager_max = self.cfg.eager_max;
        // A bad argument is the caller's error whatever the connection's state.
        if let Some(t) = target {
            if msg.len() as u64 > t.len {
                done.finish(Err(TransportError::Invalid(format!(
                    "message of {} bytes does not fit the remote buffer of {}",
                    msg.len(),
                    t.len
                ))));
                return;
            }
        }
        let failed = match &self.state {
            EngineState::Failed(why) => Some(TransportError::ConnectionLost(why.clone())),
            EngineState::Ready => None,
        };
        let Some(s) = self.sockets.get_mut(&socket) else {
            done.finish(Err(failed.unwrap_or(TransportError::Closed)));
            return;
        };
        if let Some(e) = failed {
            done.finish(Err(e));
            return;
        }
        if matches!(s.state, SockState::PeerClosed) {
            done.finish(Err(TransportError::Closed));
            return;
        }
        let phase = match target {
            Some(t) => Phase::Write { addr: t.addr, rkey: t.rkey, slot: t.slot, offset: 0 },
            None if msg.len() <= eager_max => Phase::Eager,
            None => Phase::Rts,
        };
        let msg_id = s.next_msg_id;
        s.next_msg_id = s.next_msg_id.wrapping_add(1);
        s.sendq.push_back(OutMsg { msg, done: Some(done), phase, msg_id });
        if s.sendable() {
            self.rr.activate(socket);
        }
    }

    /// Registers `buf` so the peer can write a message into it directly (no RTS/CTS); the
    /// returned target travels to the peer by any means.
    pub fn expose(&mut self, socket: u32, buf: Msg) -> Result<RemoteTarget> {
        if !self.sockets.contains_key(&socket) {
            return Err(TransportError::Closed);
        }
        let slot = self.alloc_large_slot();
        let t = RemoteTarget {
            addr: buf.addr(0),
            rkey: buf.rkey(self.dev),
            slot,
            len: buf.len() as u64,
        };
        self.large_in.insert(slot, LargeIn { buf, socket });
        Ok(t)
    }

    fn alloc_large_slot(&mut self) -> u32 {
        loop {
            let s = self.next_large_slot;
            self.next_large_slot = self.next_large_slot.wrapping_add(1).max(1);
            if s != REFUSED && !self.large_in.contains_key(&s) {
                return s;
            }
        }
    }

    /// Closes a socket: queued sends fail, the peer is told.
    pub fn close_socket(&mut self, id: u32) {
        let Some(s) = self.sockets.remove(&id) else { return };
        self.rr.remove(id);
        self.gone_sockets.push(id);
        for m in s.sendq {
            m.finish(Err(TransportError::Closed));
        }
        if let SockState::Opening(reply) = s.state {
            let _ = reply.send(Err(TransportError::Closed));
        }
        if s.peer != 0 && self.state == EngineState::Ready {
            let mut h = Header::new(Kind::Close);
            h.dst_socket = s.peer;
            self.ctrl.push_back(h);
        }
    }

    /// Fails the engine: every socket and pending operation gets the reason.
    pub fn fail(&mut self, why: String) {
        if self.state != EngineState::Ready {
            return;
        }
        tracing::warn!(qpn = self.qpn, peer = %self.peer_addr, %why, "engine failed");
        Counters::add(&self.counters.engines_failed, 1);
        self.state = EngineState::Failed(why.clone());
        let _ = self.qp.to_error();
        let err = TransportError::ConnectionLost(why);
        // In socket order, so the failures wake their tasks in the same order every run.
        let mut sockets: Vec<_> = self.sockets.drain().collect();
        sockets.sort_unstable_by_key(|(id, _)| *id);
        for (id, s) in sockets {
            self.gone_sockets.push(id);
            for m in s.sendq {
                m.finish(Err(err.clone()));
            }
            match s.state {
                SockState::Opening(reply) => {
                    let _ = reply.send(Err(err.clone()));
                }
                _ => {
                    let _ = s.inbox.send(Err(err.clone()));
                }
            }
        }
        let range = self.chain.reset();
        for i in range {
            let slot = self.chain.slot_at(i);
            if let Release::Message(m) =
                std::mem::replace(&mut self.slots[slot].release, Release::None)
            {
                m.finish(Err(err.clone()));
            }
        }
        self.large_in.clear();
        self.ctrl.clear();
        self.rr = RoundRobin::default();
    }

    /// Handles one completion of this engine's QP.
    pub fn on_completion(&mut self, wc: &WorkCompletion, now: Instant) {
        if self.state != EngineState::Ready {
            return;
        }
        if wc.status != WcStatus::Success {
            self.fail(format!("work completion {:?} (wr {:#x})", wc.status, wc.wr_id));
            return;
        }
        if wc.wr_id & RECV_TAG == 0 {
            self.on_send_done(wc.wr_id as usize);
            return;
        }
        // Only what the peer sends proves it alive: a hung host's NIC still ACKs our sends.
        self.keepalive.on_traffic(now);
        let i = (wc.wr_id & !RECV_TAG) as usize;
        if self.recv.with(|r| r.get(i).is_none()) {
            Counters::add(&self.counters.malformed, 1);
            return;
        }
        match wc.opcode {
            WcOpcode::Recv => self.on_recv(i, wc.byte_len as usize, now),
            WcOpcode::RecvRdmaWithImm => {
                self.on_large_done(wc.imm.unwrap_or(REFUSED));
                self.recycle_receive(i);
            }
            _ => Counters::add(&self.counters.malformed, 1),
        }
    }

    fn on_send_done(&mut self, slot: usize) {
        let range = self.chain.retire_through(slot);
        for k in range {
            let s = self.chain.slot_at(k);
            let data = &mut self.slots[s];
            self.window.complete(data.bytes);
            data.bytes = 0;
            if let Release::Message(m) = std::mem::replace(&mut data.release, Release::None) {
                Counters::add(&self.counters.messages_sent, 1);
                Counters::add(&self.counters.bytes_sent, m.msg.len() as u64);
                m.finish(Ok(()));
            }
        }
    }

    /// A receive slot was consumed: put a buffer back in it and re-post a batch when due.
    fn recycle_receive(&mut self, i: usize) {
        let batch = self.recv.with(|r| r.recycle(i));
        let r = batch.and_then(|wrs| self.recv.post(&self.qp, &wrs));
        if let Err(e) = r {
            self.fail(format!("re-posting receives: {e}"));
        }
    }

    fn socket_mut(&mut self, id: u32) -> Option<&mut SocketState> {
        self.sockets.get_mut(&id)
    }

    fn on_recv(&mut self, i: usize, byte_len: usize, now: Instant) {
        let decoded = self.recv.with(|r| {
            r.get(i).map(|buf| Header::decode(&buf.as_slice()[..byte_len.min(buf.len())]))
        });
        let h = match decoded.unwrap_or(Err(crate::proto::HeaderError::Truncated)) {
            Ok(h) => h,
            Err(_) => {
                Counters::add(&self.counters.malformed, 1);
                self.recycle_receive(i);
                return;
            }
        };
        // A socket blocked on credits kept its place at the head of the scheduler.
        self.credits.grant(u32::from(h.credits));
        match h.kind {
            Kind::Data => {
                let payload = byte_len.saturating_sub(HEADER_LEN);
                if h.len != payload as u64 {
                    Counters::add(&self.counters.malformed, 1);
                } else if let Some(s) = self.sockets.get(&h.dst_socket) {
                    let buf = self.recv.with(|r| r.take(i)).expect("checked above");
                    Counters::add(&self.counters.messages_received, 1);
                    Counters::add(&self.counters.bytes_received, payload as u64);
                    let _ = s.inbox.send(Ok(Msg::view(buf.into_buf(), HEADER_LEN, payload)));
                }
            }
            Kind::Rts => self.on_rts(&h),
            Kind::Cts => self.on_cts(&h),
            Kind::Open => self.on_open(&h),
            Kind::OpenAck => {
                if let Some(s) = self.socket_mut(h.dst_socket) {
                    s.peer = h.src_socket;
                    if let SockState::Opening(reply) =
                        std::mem::replace(&mut s.state, SockState::Open)
                    {
                        let _ = reply.send(Ok(()));
                    }
                    if s.sendable() {
                        self.rr.activate(h.dst_socket);
                    }
                }
            }
            Kind::OpenNak => {
                if let Some(s) = self.sockets.remove(&h.dst_socket) {
                    self.gone_sockets.push(h.dst_socket);
                    if let SockState::Opening(reply) = s.state {
                        let _ = reply.send(Err(TransportError::Refused(
                            "the peer accepts no sockets".into(),
                        )));
                    }
                }
            }
            Kind::Close => {
                if let Some(s) = self.socket_mut(h.dst_socket) {
                    s.state = SockState::PeerClosed;
                    let _ = s.inbox.send(Err(TransportError::Closed));
                    for m in std::mem::take(&mut s.sendq) {
                        m.finish(Err(TransportError::Closed));
                    }
                }
            }
            Kind::Credit => {}
            Kind::Keepalive => self.keepalive.on_peer(h.aux, now),
        }
        self.recycle_receive(i);
    }

    fn on_rts(&mut self, h: &Header) {
        let mut reply = Header::new(Kind::Cts);
        reply.dst_socket = h.src_socket;
        reply.msg_id = h.msg_id;
        reply.len = h.len;
        let socket = h.dst_socket;
        let fits = h.len <= self.cfg.max_message_bytes.min(self.pool.max_allocation() as u64)
            && self.sockets.contains_key(&socket);
        match fits.then(|| Msg::alloc(self.pool, h.len as usize)) {
            Some(Ok(buf)) => {
                let slot = self.alloc_large_slot();
                reply.aux = buf.addr(0);
                reply.aux32 = buf.rkey(self.dev);
                reply.slot = slot;
                self.large_in.insert(slot, LargeIn { buf, socket });
            }
            _ => reply.slot = REFUSED,
        }
        self.ctrl.push_back(reply);
    }

    fn on_cts(&mut self, h: &Header) {
        let Some(s) = self.sockets.get_mut(&h.dst_socket) else { return };
        let Some(front) = s.sendq.front_mut() else { return };
        if front.phase != Phase::AwaitCts || front.msg_id != h.msg_id {
            Counters::add(&self.counters.malformed, 1);
            return;
        }
        if h.slot == REFUSED {
            let m = s.sendq.pop_front().expect("front exists");
            m.finish(Err(TransportError::Alloc(
                "the receiver could not allocate the message".into(),
            )));
        } else {
            front.phase = Phase::Write { addr: h.aux, rkey: h.aux32, slot: h.slot, offset: 0 };
        }
        if s.sendable() {
            self.rr.activate(h.dst_socket);
        }
    }

    fn on_open(&mut self, h: &Header) {
        let mut reply = Header::new(Kind::OpenNak);
        reply.dst_socket = h.src_socket;
        if let Some(accept) = &self.accept {
            let id = self.socket_ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (tx, rx) = mpsc::unbounded_channel();
            let accepted = Accepted { id, worker: self.worker, inbox: rx, peer: self.peer_addr };
            if accept.send(accepted).is_ok() {
                self.sockets.insert(
                    id,
                    SocketState {
                        peer: h.src_socket,
                        state: SockState::Open,
                        sendq: VecDeque::new(),
                        inbox: tx,
                        next_msg_id: 1,
                    },
                );
                self.new_sockets.push(id);
                reply.kind = Kind::OpenAck;
                reply.src_socket = id;
            }
        }
        self.ctrl.push_back(reply);
    }

    /// The final WRITE_WITH_IMM of a large message landed. Its byte count is only that of
    /// the last fragment (as on hardware): an RTS-allocated buffer is exactly the message,
    /// and an exposed buffer is delivered whole (the application's protocol knows how much
    /// of it the peer wrote).
    fn on_large_done(&mut self, slot: u32) {
        let Some(large) = self.large_in.remove(&slot) else {
            Counters::add(&self.counters.malformed, 1);
            return;
        };
        let buf = large.buf;
        if let Some(s) = self.sockets.get(&large.socket) {
            Counters::add(&self.counters.messages_received, 1);
            Counters::add(&self.counters.bytes_received, buf.len() as u64);
            let _ = s.inbox.send(Ok(buf));
        }
    }

    /// Timers: keepalive sends and expiry.
    pub fn tick(&mut self, now: Instant) {
        if self.state != EngineState::Ready {
            return;
        }
        if self.keepalive.expired(now) {
            Counters::add(&self.counters.keepalive_failures, 1);
            self.fail("keepalive timeout: the peer stopped answering".into());
            return;
        }
        if let Some(seq) = self.keepalive.poll_send(now) {
            let mut h = Header::new(Kind::Keepalive);
            h.aux = seq;
            self.ctrl.push_back(h);
        }
    }

    /// The next time [`Engine::tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        (self.state == EngineState::Ready).then(|| self.keepalive.next_deadline())
    }

    /// True when there is work [`Engine::fill`] could post if resources allow.
    pub fn has_work(&self) -> bool {
        self.state == EngineState::Ready
            && (!self.ctrl.is_empty() || !self.rr.is_empty() || self.credits_due())
    }

    /// Prepares work while the chain has free slots — control messages first, then one
    /// fragment per socket per turn, round-robin — and posts it with one doorbell, only the
    /// last request signaled. Returns how many requests were posted.
    pub fn fill(&mut self) -> usize {
        if self.state != EngineState::Ready {
            return 0;
        }
        let mut prepared = 0;
        while self.chain.free() > 0 {
            if let Some(h) = self.ctrl.front().copied() {
                if !self.credits.try_take(Use::Ordinary) {
                    Counters::add(&self.counters.credit_stalls, 1);
                    break;
                }
                self.ctrl.pop_front();
                self.prepare_send(h, None, Release::None);
                prepared += 1;
                continue;
            }
            let Some(id) = self.rr.pop() else { break };
            match self.prepare_socket_turn(id) {
                Turn::Prepared { more } => {
                    prepared += 1;
                    if more {
                        self.rr.activate(id);
                    }
                }
                Turn::Idle => {}
                Turn::Blocked => {
                    self.rr.retry_first(id);
                    break;
                }
            }
        }
        // Owed credits that rode on nothing go back in a credit message.
        if self.credits_due() && self.chain.free() > 0 && self.credits.try_take(Use::CreditReturn) {
            Counters::add(&self.counters.credit_messages, 1);
            self.prepare_send(Header::new(Kind::Credit), None, Release::None);
            prepared += 1;
        }
        if prepared > 0 {
            self.post_pending();
        }
        prepared
    }

    fn post_pending(&mut self) {
        self.wrs.clear();
        let slots: Vec<usize> = self.chain.pending_slots().collect();
        let n = slots.len();
        // The last request of a doorbell is signaled, and one every quarter chain as well:
        // a batch as long as the whole chain would otherwise leave it empty until every
        // request of the batch completes.
        let every = (self.chain.depth() / 4).max(1);
        for (k, slot) in slots.into_iter().enumerate() {
            let mut wr = self.pending_wr(slot);
            wr.signaled = k + 1 == n || (k + 1) % every == 0;
            self.wrs.push(wr);
        }
        let wrs = std::mem::take(&mut self.wrs);
        let r = self.qp.post_send(&wrs);
        Counters::add(&self.counters.doorbells, 1);
        Counters::add(&self.counters.work_requests, wrs.len() as u64);
        self.wrs = wrs;
        match r {
            Ok(()) => self.chain.posted(n),
            Err(e) => self.fail(format!("post_send: {e}")),
        }
        let hw = self.window.high_water;
        self.counters.window_high_water.fetch_max(hw, std::sync::atomic::Ordering::Relaxed);
    }

    /// A whole batch of credits is owed and nothing carried it yet.
    fn credits_due(&self) -> bool {
        match &self.recv {
            Receives::Own(r) => r.credits.owed() >= r.credits.batch(),
            Receives::Shared(..) => false,
        }
    }

    fn pending_wr(&self, slot: usize) -> SendWr {
        let mut wr = self.prepared[slot];
        wr.wr_id = slot as u64;
        wr
    }

    /// Reserves a chain slot for a SEND of `h` (plus `payload`), piggybacking owed credits.
    fn prepare_send(&mut self, mut h: Header, payload: Option<&Msg>, release: Release) {
        let slot = self.chain.reserve().expect("caller checked for a free slot");
        h.credits = match &mut self.recv {
            Receives::Own(r) => r.credits.take_owed(u32::from(u16::MAX)) as u16,
            Receives::Shared(..) => 0,
        };
        let len = payload.map_or(0, |m| m.len());
        let sg_list = match (&mut self.bounce, payload) {
            // Copy mode: header and payload contiguous in this slot's bounce buffer.
            (Some(bounce), Some(m)) => {
                let base = slot * (HEADER_LEN + self.cfg.eager_max);
                let dst = &mut bounce.as_mut_slice()[base..base + HEADER_LEN + len];
                h.encode(&mut dst[..HEADER_LEN]);
                dst[HEADER_LEN..].copy_from_slice(m.as_slice());
                SgList::one(bounce.sge(self.dev, base, HEADER_LEN + len))
            }
            _ => {
                let at = slot * HEADER_LEN;
                h.encode(&mut self.headers.as_mut_slice()[at..at + HEADER_LEN]);
                let mut list = SgList::one(self.headers.sge(self.dev, at, HEADER_LEN));
                if let Some(m) = payload.filter(|m| !m.is_empty()) {
                    // Zero copy: the NIC gathers the payload from the caller's buffer.
                    list.push(m.sge(self.dev, 0, len));
                }
                list
            }
        };
        self.prepared[slot] = SendWr { wr_id: 0, op: SendOp::Send, sg_list, signaled: false };
        self.slots[slot] = SlotData { bytes: len as u64, release };
    }

    /// One scheduler turn of socket `id`: at most one fragment.
    fn prepare_socket_turn(&mut self, id: u32) -> Turn {
        let frag_max = self.cfg.fragment_bytes as u64;
        let Some(s) = self.sockets.get_mut(&id) else { return Turn::Idle };
        if !s.sendable() {
            return Turn::Idle;
        }
        let peer = s.peer;
        let front = s.sendq.front_mut().expect("sendable has a front");
        match front.phase {
            Phase::AwaitCts => Turn::Idle,
            Phase::Eager => {
                let len = front.msg.len() as u64;
                if !self.window.try_admit(len) {
                    Counters::add(&self.counters.window_stalls, 1);
                    return Turn::Blocked;
                }
                if !self.credits.try_take(Use::Ordinary) {
                    self.window.complete(len);
                    Counters::add(&self.counters.credit_stalls, 1);
                    return Turn::Blocked;
                }
                let m = s.sendq.pop_front().expect("front exists");
                let more = s.sendable();
                let mut h = Header::new(Kind::Data);
                h.dst_socket = peer;
                h.src_socket = id;
                h.msg_id = m.msg_id;
                h.len = len;
                Counters::add(&self.counters.eager_messages, 1);
                self.prepare_send_owned(h, m);
                Turn::Prepared { more }
            }
            Phase::Rts => {
                if !self.credits.try_take(Use::Ordinary) {
                    Counters::add(&self.counters.credit_stalls, 1);
                    return Turn::Blocked;
                }
                front.phase = Phase::AwaitCts;
                let mut h = Header::new(Kind::Rts);
                h.dst_socket = peer;
                h.src_socket = id;
                h.msg_id = front.msg_id;
                h.len = front.msg.len() as u64;
                Counters::add(&self.counters.large_messages, 1);
                self.prepare_send(h, None, Release::None);
                Turn::Prepared { more: false }
            }
            Phase::Write { addr, rkey, slot, offset } => {
                let total = front.msg.len() as u64;
                let frag = frag_max.min(total - offset);
                let last = offset + frag == total;
                if !self.window.try_admit(frag) {
                    Counters::add(&self.counters.window_stalls, 1);
                    return Turn::Blocked;
                }
                if last && !self.credits.try_take(Use::Ordinary) {
                    self.window.complete(frag);
                    Counters::add(&self.counters.credit_stalls, 1);
                    return Turn::Blocked;
                }
                let remote_addr = addr + offset;
                let op = if last {
                    SendOp::WriteWithImm { remote_addr, rkey, imm: slot }
                } else {
                    SendOp::Write { remote_addr, rkey }
                };
                let sg_list = if frag == 0 {
                    SgList::new()
                } else {
                    SgList::one(front.msg.sge(self.dev, offset as usize, frag as usize))
                };
                let release = if last {
                    Release::Message(s.sendq.pop_front().expect("front exists"))
                } else {
                    front.phase = Phase::Write { addr, rkey, slot, offset: offset + frag };
                    Release::None
                };
                let more = s.sendable();
                let chain_slot = self.chain.reserve().expect("caller checked for a free slot");
                self.prepared[chain_slot] = SendWr { wr_id: 0, op, sg_list, signaled: false };
                self.slots[chain_slot] = SlotData { bytes: frag, release };
                Turn::Prepared { more }
            }
        }
    }

    /// [`Engine::prepare_send`] with `m`'s payload; the slot then owns `m` until it retires
    /// (moving `m` does not move its registered buffer, so the gathered address stays valid).
    fn prepare_send_owned(&mut self, h: Header, m: OutMsg) {
        self.prepare_send(h, Some(&m.msg), Release::None);
        let slot = self.last_reserved();
        self.slots[slot].release = Release::Message(m);
    }

    /// The slot most recently reserved.
    fn last_reserved(&self) -> usize {
        self.chain.pending_slots().last().expect("a slot was just reserved")
    }
}

/// The outcome of one scheduler turn of a socket.
enum Turn {
    Prepared {
        more: bool,
    },
    /// Nothing to do (the socket has no sendable work).
    Idle,
    /// Out of credits, window or slots: try this socket first next time.
    Blocked,
}
