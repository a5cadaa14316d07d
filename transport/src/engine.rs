//! An engine: one RC QP and everything that rides on it (paper §5.4, Figure 7) — the
//! work-request chain, receive buffers and credits, the send window, the logical sockets
//! multiplexed onto it and their round-robin scheduler, and keepalive.
//!
//! The engine is sans-IO, in quinn's vocabulary: it holds no QP, no channel and no clock.
//! Its owner feeds it with [`Engine::handle_completion`] (each work completion of its QP)
//! and [`Engine::handle_timeout`] (at [`Engine::poll_timeout`]), and with the application's
//! requests ([`Engine::open_socket`], [`Engine::enqueue`], …); it drains
//! [`Engine::poll_post`] (receive and send batches to post, one doorbell each) and
//! [`Engine::poll_event`] (what the application learns). Time is passed in. So the same
//! code runs under the async reactor, in the simulator, and in tests as a pair of engines
//! shuttled by hand.
//!
//! Polling order per input: handle the input, then `poll_post` until `None`, then
//! `poll_event` until `None`. A failed post (the QP refused it) is reported back with
//! [`Engine::fail`].
//!
//! `T` is the owner's completion handle of a send (a channel, a permit, a number in tests):
//! the engine keeps it until the NIC is done with the message and hands it back in
//! [`Event::Sent`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bemalloc::Pool;
use bex_rnic::verbs::{RecvWr, SendOp, SendWr, SgList, WcOpcode, WcStatus, WorkCompletion};
use parking_lot::Mutex;

use crate::config::{Config, Counters};
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload};
use crate::policy::chain::WrChain;
use crate::policy::credits::{SendCredits, Use};
use crate::policy::keepalive::Keepalive;
use crate::policy::sched::RoundRobin;
use crate::policy::window::SendWindow;
pub use crate::proto::RemoteTarget;
use crate::proto::{
    decode_grant_prefix, encode_grant_prefix, Header, Kind, GRANT_PREFIX_LEN, HEADER_LEN,
};
use crate::recv::RecvRing;

/// Receive work requests carry this bit in their id (send ids are chain slots).
pub(crate) const RECV_TAG: u64 = 1 << 63;
/// A CTS with this slot refuses the message (the receiver could not allocate it).
const REFUSED: u32 = u32::MAX;

/// RTSs an engine holds back for its budget (see [`Engine::rts_budget`]) before it refuses
/// more: a well-behaved peer has at most `rts_ahead + 1` per socket waiting, and a header
/// (about 100 bytes) each bounds what a misbehaving one can make this side hold. One refused
/// for it is answered at once, ahead of its socket's earlier RTSs still waiting: its sender
/// fails that message alone, as when an allocation fails (queueing the refusal behind them
/// would itself need unbounded room).
const MAX_WAITING_RTS: usize = 1 << 16;

/// What the application learns from an engine.
#[derive(Debug)]
pub(crate) enum Event<T> {
    /// A socket this side opened was accepted (`Ok`) or refused by the peer.
    Opened { socket: u32, result: Result<()> },
    /// The peer opened a socket; it is `socket` on this side.
    Accepted { socket: u32 },
    /// A message arrived on a socket (the receive buffer itself, or the written buffer).
    Received { socket: u32, msg: Msg },
    /// A socket ended: the peer closed it, or the engine failed. Nothing follows on it.
    Ended { socket: u32, error: TransportError },
    /// The NIC is done with a send (or it failed); `done` is the caller's handle.
    Sent { done: T, result: Result<()> },
}

/// A batch for the QP: one `post_recv` or one `post_send` (one doorbell).
#[derive(Debug)]
pub(crate) enum Post<'a> {
    /// Receives, for the QP's own receive queue, or the shared one in SRQ mode.
    Recv(&'a [RecvWr]),
    /// Send requests, only the last (and one every quarter chain) signaled.
    Send(&'a [SendWr]),
}

/// A message waiting to be sent.
struct OutMsg<T> {
    payload: Payload,
    done: T,
    phase: Phase,
    msg_id: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Small: one SEND.
    Eager,
    /// Large: an RTS is to be sent.
    Rts,
    /// Large: waiting for the receiver's CTS.
    AwaitCts,
    /// Large: writing fragments; `offset` counts bytes written, the length prefix of a
    /// message going into a standing grant (`prefixed`) included.
    Write { addr: u64, rkey: u32, slot: u32, offset: u64, prefixed: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SockState {
    Opening,
    Open,
    PeerClosed,
}

struct SocketState<T> {
    peer: u32,
    state: SockState,
    sendq: VecDeque<OutMsg<T>>,
    next_msg_id: u32,
    /// Large messages behind the front whose RTS may already go (`Config::rts_ahead`).
    rts_ahead: usize,
    /// A standing grant from the peer, not used yet: the next large message that fits is
    /// written into it without RTS/CTS.
    grant: Option<RemoteTarget>,
    /// The slot of the standing grant this side gave the peer and the peer has not used yet.
    granted: Option<u32>,
    /// Capacity of the grant to offer the peer with the next Data message (0: none).
    grant_want: u64,
    /// Capacity of the last grant offered: offers never shrink, so a socket whose large
    /// messages vary in size keeps a grant that fits the largest (at most
    /// `Config::grant_max_bytes`) instead of falling back to RTS after each small one.
    grant_size: u64,
}

impl<T> SocketState<T> {
    fn new(peer: u32, state: SockState, rts_ahead: usize) -> SocketState<T> {
        SocketState {
            peer,
            state,
            sendq: VecDeque::new(),
            next_msg_id: 1,
            rts_ahead,
            grant: None,
            granted: None,
            grant_want: 0,
            grant_size: 0,
        }
    }

    /// Takes the standing grant if a large message of `len` bytes fits it.
    fn take_grant(&mut self, len: usize) -> Option<RemoteTarget> {
        let fits = self.grant.is_some_and(|g| (len + GRANT_PREFIX_LEN) as u64 <= g.len);
        if fits {
            self.grant.take()
        } else {
            None
        }
    }

    /// The queued message the scheduler can work on now, by index. Writes and eager sends
    /// go in queue order (the socket delivers in order); an RTS further back may go while
    /// the front waits for its CTS or is being written: it only asks for a buffer, and its
    /// CTS is then waiting when the messages before it are done, which saves a round trip
    /// per large message.
    fn next_action(&self) -> Option<usize> {
        if self.state != SockState::Open {
            return None;
        }
        let front = self.sendq.front()?;
        if matches!(front.phase, Phase::AwaitCts | Phase::Write { .. }) {
            let behind = self.sendq.iter().enumerate().skip(1).take(self.rts_ahead);
            if let Some((i, _)) = behind.into_iter().find(|(_, m)| m.phase == Phase::Rts) {
                return Some(i);
            }
        }
        (front.phase != Phase::AwaitCts).then_some(0)
    }

    /// Has something the scheduler can work on now.
    fn sendable(&self) -> bool {
        self.next_action().is_some()
    }
}

struct LargeIn {
    buf: Msg,
    socket: u32,
    landing: Landing,
}

/// How a buffer the peer writes into came about, which decides what is delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Landing {
    /// Allocated for an RTS: exactly the message.
    Rts,
    /// Exposed by the application: delivered whole (its protocol knows what was written).
    Exposed,
    /// A standing grant: the message is behind its length prefix.
    Grant,
}

/// The buffers the peer may write into, by slot, with the bytes of those allocated for RTSs
/// kept as a running count: the RTS budget is checked on every RTS and every freed buffer,
/// and summing the map each time cost O(buffers) per header.
#[derive(Default)]
struct Landings {
    by_slot: HashMap<u32, LargeIn>,
    rts_bytes: u64,
}

impl Landings {
    fn rts_len(l: &LargeIn) -> u64 {
        if l.landing == Landing::Rts {
            l.buf.len() as u64
        } else {
            0
        }
    }

    fn insert(&mut self, slot: u32, l: LargeIn) {
        self.rts_bytes += Self::rts_len(&l);
        if let Some(old) = self.by_slot.insert(slot, l) {
            debug_assert!(false, "slot {slot} taken twice");
            self.rts_bytes -= Self::rts_len(&old);
        }
    }

    fn remove(&mut self, slot: u32) -> Option<LargeIn> {
        let l = self.by_slot.remove(&slot)?;
        self.rts_bytes -= Self::rts_len(&l);
        Some(l)
    }

    /// Frees every buffer of `socket`.
    fn remove_socket(&mut self, socket: u32) {
        let Landings { by_slot, rts_bytes } = self;
        by_slot.retain(|_, l| {
            let keep = l.socket != socket;
            if !keep {
                *rts_bytes -= Self::rts_len(l);
            }
            keep
        });
    }

    fn clear(&mut self) {
        self.by_slot.clear();
        self.rts_bytes = 0;
    }

    fn get(&self, slot: u32) -> Option<&LargeIn> {
        self.by_slot.get(&slot)
    }

    /// Bytes held for messages announced by RTS and not yet written.
    fn rts_bytes(&self) -> u64 {
        debug_assert_eq!(
            self.rts_bytes,
            self.by_slot.values().map(Self::rts_len).sum::<u64>(),
            "the running count of RTS bytes matches the buffers"
        );
        self.rts_bytes
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_slot.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    #[cfg(test)]
    fn buffers(&self) -> impl Iterator<Item = &LargeIn> {
        self.by_slot.values()
    }
}

/// What a chain slot holds until its request completes.
struct SlotData<T> {
    /// Bytes the send window admitted for it.
    bytes: u64,
    /// The message whose last request this is.
    release: Option<OutMsg<T>>,
}

/// Why an engine stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EngineState {
    Ready,
    Failed(String),
}

/// Where an engine's receives come from.
pub(crate) enum Receives {
    /// Its own ring on its QP; credits are returned to the peer.
    Own(RecvRing),
    /// The owner's shared ring on an SRQ (paper §6.2.2); no credits.
    Shared(Arc<Mutex<RecvRing>>),
}

impl Receives {
    fn with<R>(&mut self, f: impl FnOnce(&mut RecvRing) -> R) -> R {
        match self {
            Receives::Own(r) => f(r),
            Receives::Shared(r) => f(&mut r.lock()),
        }
    }
}

/// What an engine needs besides its QP.
pub(crate) struct EngineParts {
    pub cfg: Arc<Config>,
    pub pool: &'static Pool,
    /// The pool's device index of the engine's NIC (for lkeys and rkeys).
    pub dev: usize,
    pub counters: Arc<Counters>,
    pub qpn: u32,
    pub peer_rq_depth: u32,
    /// Whether sockets the peer opens are accepted (a listener exists).
    pub accepting: bool,
    pub socket_ids: Arc<AtomicU32>,
    /// The owner's shared receive ring (SRQ mode); `None`: a ring of its own.
    pub shared_recv: Option<Arc<Mutex<RecvRing>>>,
}

/// One QP's worth of transport state.
pub(crate) struct Engine<T> {
    pub qpn: u32,
    pub state: EngineState,
    cfg: Arc<Config>,
    pool: &'static Pool,
    dev: usize,
    counters: Arc<Counters>,
    chain: WrChain,
    slots: Vec<SlotData<T>>,
    /// The work request prepared in each chain slot.
    prepared: Vec<SendWr>,
    /// The send batch handed out by the last `poll_post`.
    wrs: Vec<SendWr>,
    /// Receives to post; `recv_handed` once `poll_post` gave them out.
    recv_out: Vec<RecvWr>,
    recv_handed: bool,
    headers: Msg,
    bounce: Option<Msg>,
    credits: SendCredits,
    window: SendWindow,
    recv: Receives,
    large_in: Landings,
    /// RTSs whose buffers would exceed the budget of bytes the peer may have this side hold
    /// for announced messages: answered in order as written messages free their buffers.
    rts_waiting: VecDeque<Header>,
    next_large_slot: u32,
    ctrl: VecDeque<Header>,
    sockets: HashMap<u32, SocketState<T>>,
    rr: RoundRobin,
    keepalive: Keepalive,
    accepting: bool,
    socket_ids: Arc<AtomicU32>,
    events: VecDeque<Event<T>>,
}

impl<T> Engine<T> {
    /// Allocates the engine's registered memory. Its own receives come out of the first
    /// [`Engine::poll_post`]: post them while the QP is in INIT, before the peer may send.
    pub fn new(parts: EngineParts, now: Instant) -> Result<Engine<T>> {
        let cfg = parts.cfg;
        let sq = cfg.sq_depth as usize;
        let headers = Msg::alloc(parts.pool, sq * HEADER_LEN)?;
        let bounce = if cfg.eager_copy {
            Some(Msg::alloc(parts.pool, sq * (HEADER_LEN + cfg.eager_max))?)
        } else {
            None
        };
        let (recv, recv_out) = match parts.shared_recv {
            Some(ring) => (Receives::Shared(ring), Vec::new()),
            None => {
                let ring =
                    RecvRing::new(parts.pool, parts.dev, cfg.rq_depth, HEADER_LEN + cfg.eager_max)?;
                let all = ring.all();
                (Receives::Own(ring), all)
            }
        };
        // A peer on an SRQ announces depth 0: it takes no credits (RNR retry instead).
        let credits = if parts.peer_rq_depth == 0 {
            SendCredits::unlimited()
        } else {
            SendCredits::new(parts.peer_rq_depth)
        };
        Ok(Engine {
            qpn: parts.qpn,
            state: EngineState::Ready,
            chain: WrChain::new(sq),
            slots: (0..sq).map(|_| SlotData { bytes: 0, release: None }).collect(),
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
            recv_out,
            recv_handed: false,
            headers,
            bounce,
            credits,
            window: SendWindow::new(cfg.cwnd_bytes),
            recv,
            large_in: Landings::default(),
            rts_waiting: VecDeque::new(),
            next_large_slot: 1,
            ctrl: VecDeque::new(),
            sockets: HashMap::new(),
            rr: RoundRobin::default(),
            keepalive: Keepalive::new(now, cfg.keepalive_interval, cfg.keepalive_timeout),
            accepting: parts.accepting,
            socket_ids: parts.socket_ids,
            events: VecDeque::new(),
            pool: parts.pool,
            dev: parts.dev,
            counters: parts.counters,
            cfg,
        })
    }

    /// True when the engine draws on a shared receive queue (its `Post::Recv` batches go
    /// to the SRQ).
    pub fn uses_srq(&self) -> bool {
        matches!(self.recv, Receives::Shared(_))
    }

    /// A failed engine's receives of the shared ring that it recycled but never handed out:
    /// the endpoint posts them to the SRQ (dropped, they were lost to every engine).
    pub fn take_unposted_shared_receives(&mut self) -> Vec<RecvWr> {
        if self.is_failed() && self.uses_srq() && !self.recv_handed {
            std::mem::take(&mut self.recv_out)
        } else {
            Vec::new()
        }
    }

    /// True when nothing of this engine is posted or prepared: a send now would go out alone
    /// (post it at once); otherwise the engine is busy and sends may as well batch.
    pub fn is_idle(&self) -> bool {
        self.chain.in_flight() == 0 && self.chain.pending() == 0
    }

    /// True once failed: the owner moves the QP to ERROR and drops the engine after
    /// draining its events.
    pub fn is_failed(&self) -> bool {
        self.state != EngineState::Ready
    }

    /// Opens socket `id` to the peer; [`Event::Opened`] says whether the peer accepted.
    pub fn open_socket(&mut self, id: u32) {
        if let EngineState::Failed(why) = &self.state {
            let error = TransportError::ConnectionLost(why.clone());
            self.events.push_back(Event::Opened { socket: id, result: Err(error) });
            return;
        }
        self.sockets.insert(id, SocketState::new(0, SockState::Opening, self.cfg.rts_ahead));
        let mut h = Header::new(Kind::Open);
        h.src_socket = id;
        self.ctrl.push_back(h);
    }

    /// Queues a message on a socket; [`Event::Sent`] returns `done` when the NIC is done with
    /// it, or at once with the error if the message cannot go (too big for the target,
    /// socket gone or closed by the peer, engine failed).
    pub fn enqueue(
        &mut self,
        socket: u32,
        payload: Payload,
        target: Option<RemoteTarget>,
        done: T,
    ) {
        let eager_max = self.cfg.eager_max;
        // A bad argument is the caller's error whatever the connection's state.
        if let Some(t) = target {
            if payload.len() as u64 > t.len {
                let e = TransportError::Invalid(format!(
                    "message of {} bytes does not fit the remote buffer of {}",
                    payload.len(),
                    t.len
                ));
                self.events.push_back(Event::Sent { done, result: Err(e) });
                return;
            }
        }
        let refused = match (&self.state, self.sockets.get(&socket)) {
            (EngineState::Failed(why), _) => Some(TransportError::ConnectionLost(why.clone())),
            (EngineState::Ready, None) => Some(TransportError::Closed),
            (EngineState::Ready, Some(s)) if s.state == SockState::PeerClosed => {
                Some(TransportError::Closed)
            }
            (EngineState::Ready, Some(_)) => None,
        };
        if let Some(e) = refused {
            self.events.push_back(Event::Sent { done, result: Err(e) });
            return;
        }
        let s = self.sockets.get_mut(&socket).expect("checked above");
        let into = |t: RemoteTarget, prefixed| Phase::Write {
            addr: t.addr,
            rkey: t.rkey,
            slot: t.slot,
            offset: 0,
            prefixed,
        };
        let phase = match target {
            Some(t) => into(t, false),
            None if payload.len() <= eager_max => Phase::Eager,
            None => match s.take_grant(payload.len()) {
                Some(g) => {
                    Counters::add(&self.counters.granted_messages, 1);
                    into(g, true)
                }
                None => Phase::Rts,
            },
        };
        let msg_id = s.next_msg_id;
        s.next_msg_id = s.next_msg_id.wrapping_add(1);
        s.sendq.push_back(OutMsg { payload, done, phase, msg_id });
        if s.sendable() {
            self.rr.activate(socket);
        }
    }

    /// Registers `buf` so the peer can write a message into it directly (no RTS/CTS); the
    /// returned target travels to the peer by any means.
    pub fn expose(&mut self, socket: u32, buf: Msg) -> Result<RemoteTarget> {
        if let EngineState::Failed(why) = &self.state {
            return Err(TransportError::ConnectionLost(why.clone()));
        }
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
        self.large_in.insert(slot, LargeIn { buf, socket, landing: Landing::Exposed });
        Ok(t)
    }

    fn alloc_large_slot(&mut self) -> u32 {
        loop {
            let s = self.next_large_slot;
            self.next_large_slot = self.next_large_slot.wrapping_add(1).max(1);
            if s != REFUSED && self.large_in.get(s).is_none() {
                return s;
            }
        }
    }

    /// Closes a socket: queued sends fail with `Closed`, the peer is told. Nothing more is
    /// reported for it.
    pub fn close_socket(&mut self, id: u32) {
        let Some(s) = self.sockets.remove(&id) else { return };
        self.rr.remove(id);
        // Its waiting RTSs will never be answered (their buffers, once the peer's Close
        // comes): they must not hold up the other sockets' behind them.
        self.rts_waiting.retain(|w| w.dst_socket != id);
        self.answer_waiting_rts();
        for m in s.sendq {
            self.events
                .push_back(Event::Sent { done: m.done, result: Err(TransportError::Closed) });
        }
        if s.peer != 0 && self.state == EngineState::Ready {
            let mut h = Header::new(Kind::Close);
            h.dst_socket = s.peer;
            self.ctrl.push_back(h);
        }
    }

    /// Fails the engine: every socket and pending operation gets the reason, in socket and
    /// chain order (so simulated runs wake their tasks in the same order every time).
    pub fn fail(&mut self, why: String) {
        if self.state != EngineState::Ready {
            return;
        }
        tracing::warn!(qpn = self.qpn, %why, "engine failed");
        Counters::add(&self.counters.engines_failed, 1);
        self.end(why);
    }

    /// Ends the engine because its own transport shuts down: as [`Engine::fail`] for its
    /// sockets, but neither a warning nor a failure in the counters (a clean stop of a
    /// process is not a fault an operator should see).
    pub fn shut_down(&mut self) {
        if self.state != EngineState::Ready {
            return;
        }
        tracing::debug!(qpn = self.qpn, "engine closed: transport shut down");
        self.end(TransportError::Shutdown.to_string());
    }

    fn end(&mut self, why: String) {
        self.state = EngineState::Failed(why.clone());
        let err = TransportError::ConnectionLost(why);
        let mut sockets: Vec<_> = self.sockets.drain().collect();
        sockets.sort_unstable_by_key(|(id, _)| *id);
        for (id, s) in sockets {
            for m in s.sendq {
                self.events.push_back(Event::Sent { done: m.done, result: Err(err.clone()) });
            }
            self.events.push_back(match s.state {
                SockState::Opening => Event::Opened { socket: id, result: Err(err.clone()) },
                _ => Event::Ended { socket: id, error: err.clone() },
            });
        }
        let range = self.chain.reset();
        for i in range {
            let slot = self.chain.slot_at(i);
            self.slots[slot].bytes = 0;
            if let Some(m) = self.slots[slot].release.take() {
                self.events.push_back(Event::Sent { done: m.done, result: Err(err.clone()) });
            }
        }
        self.large_in.clear();
        self.rts_waiting.clear();
        self.ctrl.clear();
        // Receives of a shared ring not yet handed out stay for the endpoint to post
        // ([`Engine::take_unposted_shared_receives`]): other engines draw on that ring.
        if self.recv_handed || !self.uses_srq() {
            self.recv_out.clear();
            self.recv_handed = false;
        }
        self.rr = RoundRobin::default();
    }

    /// Handles one completion of this engine's QP.
    pub fn handle_completion(&mut self, now: Instant, wc: &WorkCompletion) {
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
                self.answer_waiting_rts();
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
            if let Some(m) = data.release.take() {
                Counters::add(&self.counters.messages_sent, 1);
                Counters::add(&self.counters.bytes_sent, m.payload.len() as u64);
                self.events.push_back(Event::Sent { done: m.done, result: Ok(()) });
            }
        }
    }

    /// A receive slot was consumed: put a buffer back in it and queue a batch to re-post
    /// when one is due.
    fn recycle_receive(&mut self, i: usize) {
        match self.recv.with(|r| r.recycle(i)) {
            Ok(batch) if !batch.is_empty() => {
                if self.recv_handed {
                    self.recv_out.clear();
                    self.recv_handed = false;
                }
                self.recv_out.extend(batch);
            }
            Ok(_) => {}
            Err(e) => self.fail(format!("re-posting receives: {e}")),
        }
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
        if !self.credits.grant(u32::from(h.credits)) {
            Counters::add(&self.counters.malformed, 1);
        }
        if let (Some(g), Kind::Data | Kind::Rts | Kind::Cts) = (h.grant, h.kind) {
            self.on_grant(h.dst_socket, g);
        }
        match h.kind {
            Kind::Data => {
                let payload = byte_len.saturating_sub(HEADER_LEN);
                if h.len != payload as u64 {
                    Counters::add(&self.counters.malformed, 1);
                } else if self.sockets.contains_key(&h.dst_socket) {
                    let buf = self.recv.with(|r| r.take(i)).expect("checked above");
                    Counters::add(&self.counters.messages_received, 1);
                    Counters::add(&self.counters.bytes_received, payload as u64);
                    let msg = Msg::view(buf.into_buf(), HEADER_LEN, payload);
                    self.events.push_back(Event::Received { socket: h.dst_socket, msg });
                }
            }
            Kind::Rts => self.on_rts(&h),
            Kind::Cts => self.on_cts(&h),
            Kind::Open => self.on_open(&h),
            Kind::OpenAck => match self.sockets.get_mut(&h.dst_socket) {
                Some(s) if s.state == SockState::Opening => {
                    s.peer = h.src_socket;
                    s.state = SockState::Open;
                    let socket = h.dst_socket;
                    self.events.push_back(Event::Opened { socket, result: Ok(()) });
                    if s.sendable() {
                        self.rr.activate(socket);
                    }
                }
                Some(_) => Counters::add(&self.counters.malformed, 1),
                // Closed while opening (its caller gave up, a connect deadline): the end the
                // peer opened for it is told, or it stayed open, served, for good.
                None => {
                    if self.state == EngineState::Ready {
                        let mut c = Header::new(Kind::Close);
                        c.dst_socket = h.src_socket;
                        self.ctrl.push_back(c);
                    }
                }
            },
            Kind::OpenNak => {
                if let Some(s) = self.sockets.remove(&h.dst_socket) {
                    let error = TransportError::Refused("the peer accepts no sockets".into());
                    for m in s.sendq {
                        let result = Err(error.clone());
                        self.events.push_back(Event::Sent { done: m.done, result });
                    }
                    self.events
                        .push_back(Event::Opened { socket: h.dst_socket, result: Err(error) });
                }
            }
            Kind::Close => {
                // The peer writes nothing after its Close (RC keeps order): every buffer it
                // could still write into for this socket is free again — its unused grant,
                // RTS buffers it was sent a CTS for, buffers exposed for it. Also when this
                // side closed first (the socket is gone): otherwise they stayed until the
                // engine ended, a leak of registered memory per timed-out call.
                self.large_in.remove_socket(h.dst_socket);
                self.rts_waiting.retain(|w| w.dst_socket != h.dst_socket);
                self.answer_waiting_rts();
                if let Some(s) = self.sockets.get_mut(&h.dst_socket) {
                    if s.state != SockState::PeerClosed {
                        s.state = SockState::PeerClosed;
                        s.granted = None;
                        s.grant = None;
                        let queued = std::mem::take(&mut s.sendq);
                        for m in queued {
                            let result = Err(TransportError::Closed);
                            self.events.push_back(Event::Sent { done: m.done, result });
                        }
                        self.rr.remove(h.dst_socket);
                        let error = TransportError::Closed;
                        self.events.push_back(Event::Ended { socket: h.dst_socket, error });
                    }
                }
            }
            Kind::Credit => {}
            Kind::Keepalive => self.keepalive.on_peer(h.aux, now),
        }
        self.recycle_receive(i);
    }

    fn on_rts(&mut self, h: &Header) {
        if h.slot != 0 {
            self.on_grant_returned(h.dst_socket, h.slot);
        }
        // A peer announces only what it cannot send eagerly: smaller RTSs would each hold a
        // buffer while adding (next to) nothing to the budget's count.
        if h.len <= self.cfg.eager_max as u64 {
            Counters::add(&self.counters.malformed, 1);
            self.answer_rts(h, false);
            return;
        }
        let fits = h.len <= self.rts_budget() && self.sockets.contains_key(&h.dst_socket);
        if !fits {
            self.answer_rts(h, false);
        } else if self.rts_waiting.is_empty() && self.rts_held() + h.len <= self.rts_budget() {
            self.answer_rts(h, true);
        } else if self.rts_waiting.len() < MAX_WAITING_RTS {
            Counters::add(&self.counters.rts_deferred, 1);
            self.rts_waiting.push_back(*h);
        } else {
            Counters::add(&self.counters.malformed, 1);
            self.answer_rts(h, false);
        }
    }

    /// Bytes the peer may have this side hold at once for messages it announced by RTS and
    /// has not finished writing: `max_message_bytes` (what one message may announce), so a
    /// peer that announces and never writes cannot exhaust the pool, and a well-behaved one
    /// waits for its CTS instead of failing.
    fn rts_budget(&self) -> u64 {
        self.cfg.max_message_bytes.min(self.pool.max_allocation() as u64)
    }

    /// Bytes held now for announced messages.
    fn rts_held(&self) -> u64 {
        self.large_in.rts_bytes()
    }

    /// Answers waiting RTSs, in the order they came, while the budget has room.
    fn answer_waiting_rts(&mut self) {
        while let Some(h) = self.rts_waiting.front().copied() {
            if self.rts_held() + h.len > self.rts_budget() {
                break;
            }
            self.rts_waiting.pop_front();
            // The socket may have closed while it waited (its RTSs went with it).
            let open = self.sockets.contains_key(&h.dst_socket);
            self.answer_rts(&h, open);
        }
        debug_assert!(self.rts_held() <= self.rts_budget(), "RTS buffers within the budget");
    }

    /// A CTS for `h`: a buffer for the message when `accept` and one can be had, else refused.
    fn answer_rts(&mut self, h: &Header, accept: bool) {
        let mut reply = Header::new(Kind::Cts);
        reply.dst_socket = h.src_socket;
        reply.src_socket = h.dst_socket;
        reply.msg_id = h.msg_id;
        reply.len = h.len;
        match accept.then(|| Msg::alloc(self.pool, h.len as usize)) {
            Some(Ok(buf)) => {
                let slot = self.alloc_large_slot();
                reply.aux = buf.addr(0);
                reply.aux32 = buf.rkey(self.dev);
                reply.slot = slot;
                let socket = h.dst_socket;
                self.large_in.insert(slot, LargeIn { buf, socket, landing: Landing::Rts });
            }
            _ => reply.slot = REFUSED,
        }
        self.ctrl.push_back(reply);
    }

    fn on_cts(&mut self, h: &Header) {
        let Some(s) = self.sockets.get_mut(&h.dst_socket) else { return };
        let waiting =
            s.sendq.iter().position(|m| m.msg_id == h.msg_id && m.phase == Phase::AwaitCts);
        let Some(i) = waiting else {
            Counters::add(&self.counters.malformed, 1);
            return;
        };
        if h.slot == REFUSED {
            let m = s.sendq.remove(i).expect("found above");
            let e = TransportError::Alloc("the receiver could not allocate the message".into());
            self.events.push_back(Event::Sent { done: m.done, result: Err(e) });
        } else {
            s.sendq[i].phase = Phase::Write {
                addr: h.aux,
                rkey: h.aux32,
                slot: h.slot,
                offset: 0,
                prefixed: false,
            };
        }
        if s.sendable() {
            self.rr.activate(h.dst_socket);
        }
    }

    fn on_open(&mut self, h: &Header) {
        let mut reply = Header::new(Kind::OpenNak);
        reply.dst_socket = h.src_socket;
        if self.accepting {
            let id = self.socket_ids.fetch_add(1, Ordering::Relaxed);
            let state = SocketState::new(h.src_socket, SockState::Open, self.cfg.rts_ahead);
            self.sockets.insert(id, state);
            self.events.push_back(Event::Accepted { socket: id });
            reply.kind = Kind::OpenAck;
            reply.src_socket = id;
        }
        self.ctrl.push_back(reply);
    }

    /// The final WRITE_WITH_IMM of a large message landed. Its byte count is only that of
    /// the last fragment (as on hardware): an RTS-allocated buffer is exactly the message,
    /// and an exposed buffer is delivered whole (the application's protocol knows how much
    /// of it the peer wrote).
    fn on_large_done(&mut self, slot: u32) {
        let Some(large) = self.large_in.remove(slot) else {
            Counters::add(&self.counters.malformed, 1);
            return;
        };
        let socket = large.socket;
        let Some(s) = self.sockets.get_mut(&socket) else { return };
        let msg = match large.landing {
            Landing::Rts | Landing::Exposed => large.buf,
            Landing::Grant => {
                s.granted = None;
                let room = large.buf.len().saturating_sub(GRANT_PREFIX_LEN) as u64;
                let prefix = decode_grant_prefix(large.buf.as_slice());
                let Some((len, offer)) = prefix.filter(|(len, _)| *len <= room) else {
                    // The peer named more than it could have written: drop the message.
                    Counters::add(&self.counters.malformed, 1);
                    return;
                };
                if let Some(g) = offer {
                    self.on_grant(socket, g);
                }
                Msg::view(large.buf.into_buf(), GRANT_PREFIX_LEN, len as usize)
            }
        };
        // Another large message will likely follow (request/response traffic): offer a
        // buffer for it with whatever goes to the peer on this socket next.
        let grant_max = self.cfg.grant_max_bytes.min(self.pool.max_allocation()) as u64;
        let want = (msg.len() + GRANT_PREFIX_LEN) as u64;
        if let Some(s) = self.sockets.get_mut(&socket) {
            if large.landing != Landing::Exposed && s.granted.is_none() && want <= grant_max {
                s.grant_want = want.next_power_of_two().max(s.grant_size).min(grant_max);
            }
        }
        Counters::add(&self.counters.messages_received, 1);
        Counters::add(&self.counters.bytes_received, msg.len() as u64);
        self.events.push_back(Event::Received { socket, msg });
    }

    /// The peer offered a standing grant for `socket`'s next large message: a queued message
    /// still waiting to send its RTS takes it at once, else the next one.
    fn on_grant(&mut self, socket: u32, grant: RemoteTarget) {
        let Some(s) = self.sockets.get_mut(&socket) else { return };
        if s.state != SockState::Open {
            return;
        }
        s.grant = Some(grant);
        let waiting = s.sendq.iter().position(|m| m.phase == Phase::Rts);
        if let Some(i) = waiting {
            if let Some(g) = s.take_grant(s.sendq[i].payload.len()) {
                Counters::add(&self.counters.granted_messages, 1);
                s.sendq[i].phase = Phase::Write {
                    addr: g.addr,
                    rkey: g.rkey,
                    slot: g.slot,
                    offset: 0,
                    prefixed: true,
                };
                if s.sendable() {
                    self.rr.activate(socket);
                }
            }
        }
    }

    /// The peer gave back the standing grant `slot` of `socket` (its next message did not fit
    /// and went by RTS, which RC orders after anything it wrote): the buffer is free again.
    fn on_grant_returned(&mut self, socket: u32, slot: u32) {
        let ours = self
            .large_in
            .get(slot)
            .is_some_and(|l| l.landing == Landing::Grant && l.socket == socket);
        if !ours {
            Counters::add(&self.counters.malformed, 1);
            return;
        }
        self.large_in.remove(slot);
        if let Some(s) = self.sockets.get_mut(&socket) {
            s.granted = None;
        }
    }

    /// The grant `socket` owes its peer, for whatever goes there next (a header or a grant
    /// prefix), if one is due and its buffer can be had (else the offer is dropped: grants
    /// only save round trips).
    fn grant_offer(&mut self, socket: u32) -> Option<RemoteTarget> {
        let s = self.sockets.get_mut(&socket)?;
        let want = std::mem::take(&mut s.grant_want);
        if want == 0 || s.granted.is_some() {
            return None;
        }
        s.grant_size = want;
        let buf = Msg::alloc(self.pool, want as usize).ok()?;
        let slot = self.alloc_large_slot();
        let (addr, rkey, len) = (buf.addr(0), buf.rkey(self.dev), buf.len() as u64);
        self.large_in.insert(slot, LargeIn { buf, socket, landing: Landing::Grant });
        if let Some(s) = self.sockets.get_mut(&socket) {
            s.granted = Some(slot);
        }
        Counters::add(&self.counters.grants_offered, 1);
        Some(RemoteTarget { addr, rkey, slot, len })
    }

    /// Timers: keepalive sends and expiry.
    pub fn handle_timeout(&mut self, now: Instant) {
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

    /// The next time [`Engine::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.state == EngineState::Ready).then(|| self.keepalive.next_deadline())
    }

    /// The next batch to post: receives to re-post first (they return credits the sends
    /// below may carry), then sends — control messages first, then one fragment per socket
    /// per turn, round-robin, while chain slots, credits and the window allow; one doorbell.
    pub fn poll_post(&mut self) -> Option<Post<'_>> {
        if self.state != EngineState::Ready {
            return None;
        }
        if !self.recv_handed && !self.recv_out.is_empty() {
            self.recv_handed = true;
            return Some(Post::Recv(&self.recv_out));
        }
        if self.recv_handed {
            self.recv_out.clear();
            self.recv_handed = false;
        }
        if self.fill() == 0 {
            return None;
        }
        Some(Post::Send(&self.wrs))
    }

    /// The next thing the application should learn.
    pub fn poll_event(&mut self) -> Option<Event<T>> {
        self.events.pop_front()
    }

    /// Prepares work into the chain's free slots and moves it to `wrs` as one batch.
    fn fill(&mut self) -> usize {
        let mut prepared = 0;
        while self.chain.free() > 0 {
            if let Some(h) = self.ctrl.front().copied() {
                if !self.credits.try_take(Use::Ordinary) {
                    Counters::add(&self.counters.credit_stalls, 1);
                    break;
                }
                self.ctrl.pop_front();
                self.prepare_send(h, None);
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
            self.prepare_send(Header::new(Kind::Credit), None);
            prepared += 1;
        }
        if prepared == 0 {
            return 0;
        }
        self.wrs.clear();
        let n = self.chain.pending();
        // The last request of a doorbell is signaled, and one every quarter chain as well:
        // a batch as long as the whole chain would otherwise leave it empty until every
        // request of the batch completes.
        let every = (self.chain.depth() / 4).max(1);
        for (k, slot) in self.chain.pending_slots().enumerate() {
            let mut wr = self.prepared[slot];
            wr.wr_id = slot as u64;
            wr.signaled = k + 1 == n || (k + 1) % every == 0;
            self.wrs.push(wr);
        }
        // The owner posts the batch now; a refusal fails the engine, which resets the chain.
        self.chain.posted(n);
        Counters::add(&self.counters.doorbells, 1);
        Counters::add(&self.counters.work_requests, n as u64);
        let hw = self.window.high_water;
        self.counters.window_high_water.fetch_max(hw, Ordering::Relaxed);
        n
    }

    /// A whole batch of credits is owed and nothing carried it yet.
    fn credits_due(&self) -> bool {
        match &self.recv {
            Receives::Own(r) => r.credits.owed() >= r.credits.batch(),
            Receives::Shared(..) => false,
        }
    }

    /// Reserves a chain slot for a SEND of `h` (plus `m`'s payload), piggybacking owed
    /// credits; the slot owns `m` until it retires (moving a message does not move its
    /// registered buffer, so the gathered address stays valid).
    fn prepare_send(&mut self, mut h: Header, m: Option<OutMsg<T>>) {
        if matches!(h.kind, Kind::Data | Kind::Rts | Kind::Cts) {
            h.grant = self.grant_offer(h.src_socket);
        }
        let slot = self.chain.reserve().expect("caller checked for a free slot");
        h.credits = match &mut self.recv {
            Receives::Own(r) => r.credits.take_owed(u32::from(u16::MAX)) as u16,
            Receives::Shared(..) => 0,
        };
        let payload = m.as_ref().map(|m| &m.payload);
        let len = payload.map_or(0, |p| p.len());
        let sg_list = match (&mut self.bounce, payload) {
            // Copy mode: header and payload contiguous in this slot's bounce buffer.
            (Some(bounce), Some(p)) => {
                let base = slot * (HEADER_LEN + self.cfg.eager_max);
                let dst = &mut bounce.as_mut_slice()[base..base + HEADER_LEN + len];
                h.encode(&mut dst[..HEADER_LEN]);
                dst[HEADER_LEN..].copy_from_slice(p.as_slice());
                SgList::one(bounce.sge(self.dev, base, HEADER_LEN + len))
            }
            _ => {
                let at = slot * HEADER_LEN;
                h.encode(&mut self.headers.as_mut_slice()[at..at + HEADER_LEN]);
                let mut list = SgList::one(self.headers.sge(self.dev, at, HEADER_LEN));
                if let Some(p) = payload.filter(|p| !p.is_empty()) {
                    // Zero copy: the NIC gathers the payload from the caller's buffer.
                    list.push(p.sge(self.dev, 0, len));
                }
                list
            }
        };
        self.prepared[slot] = SendWr { wr_id: 0, op: SendOp::Send, sg_list, signaled: false };
        self.slots[slot] = SlotData { bytes: len as u64, release: m };
    }

    /// One scheduler turn of socket `id`: at most one fragment.
    fn prepare_socket_turn(&mut self, id: u32) -> Turn {
        let frag_max = self.cfg.fragment_bytes as u64;
        let Some(s) = self.sockets.get_mut(&id) else { return Turn::Idle };
        let Some(at) = s.next_action() else { return Turn::Idle };
        let peer = s.peer;
        let front = &mut s.sendq[at];
        match front.phase {
            Phase::AwaitCts => Turn::Idle,
            Phase::Eager => {
                let len = front.payload.len() as u64;
                if !self.window.try_admit(len) {
                    Counters::add(&self.counters.window_stalls, 1);
                    return Turn::Blocked;
                }
                if !self.credits.try_take(Use::Ordinary) {
                    self.window.complete(len);
                    Counters::add(&self.counters.credit_stalls, 1);
                    return Turn::Blocked;
                }
                debug_assert_eq!(at, 0, "eager sends go in queue order");
                let m = s.sendq.pop_front().expect("front exists");
                let more = s.sendable();
                let mut h = Header::new(Kind::Data);
                h.dst_socket = peer;
                h.src_socket = id;
                h.msg_id = m.msg_id;
                h.len = len;
                Counters::add(&self.counters.eager_messages, 1);
                self.prepare_send(h, Some(m));
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
                h.len = front.payload.len() as u64;
                // A grant this message does not fit goes back, so the receiver can offer one
                // of the larger size after it.
                if let Some(g) = s.grant.take() {
                    h.slot = g.slot;
                }
                // The front may be writing, or more RTSs may go ahead: the socket stays in
                // the round. (It left it here before, and came back only with the next CTS: a
                // front being written sat a round trip behind each RTS sent ahead of it.)
                let more = s.sendable();
                Counters::add(&self.counters.large_messages, 1);
                self.prepare_send(h, None);
                Turn::Prepared { more }
            }
            Phase::Write { addr, rkey, slot, offset, prefixed } => {
                debug_assert_eq!(at, 0, "writes go in queue order");
                let payload_len = front.payload.len() as u64;
                let prefix = if prefixed { GRANT_PREFIX_LEN as u64 } else { 0 };
                let total = payload_len + prefix;
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
                // `addr` is the peer's (its CTS or grant): one past the address space must not
                // panic here. Wrapped, the WRITE fails the NIC's key check and the engine with it.
                let remote_addr = addr.wrapping_add(offset);
                if offset == 0 && addr.checked_add(total).is_none() {
                    Counters::add(&self.counters.malformed, 1);
                }
                let op = if last {
                    SendOp::WriteWithImm { remote_addr, rkey, imm: slot }
                } else {
                    SendOp::Write { remote_addr, rkey }
                };
                let chain_slot = self.chain.reserve().expect("caller checked for a free slot");
                let mut sg_list = SgList::new();
                let mut from = offset;
                if from < prefix {
                    // The prefix (length, and this side's own offer) from this chain slot's
                    // header space (unused by a WRITE), then the payload. Fragments are at
                    // least 256 B, so the prefix is always whole in the first one; the offer
                    // is made only now that the fragment surely goes.
                    debug_assert!(from == 0 && frag >= prefix, "the prefix goes whole, first");
                    let offer = self.grant_offer(id);
                    let at = chain_slot * HEADER_LEN;
                    let dst = &mut self.headers.as_mut_slice()[at..at + GRANT_PREFIX_LEN];
                    encode_grant_prefix(payload_len, offer, dst);
                    sg_list.push(self.headers.sge(self.dev, at, GRANT_PREFIX_LEN));
                    from = prefix;
                }
                let s = self.sockets.get_mut(&id).expect("the socket of this turn");
                let body = offset + frag - from;
                if body > 0 {
                    let p = (from - prefix) as usize;
                    sg_list.push(s.sendq[0].payload.sge(self.dev, p, body as usize));
                }
                let release = if last {
                    Some(s.sendq.pop_front().expect("front exists"))
                } else {
                    let next = offset + frag;
                    s.sendq[0].phase = Phase::Write { addr, rkey, slot, offset: next, prefixed };
                    None
                };
                let more = s.sendable();
                self.prepared[chain_slot] = SendWr { wr_id: 0, op, sg_list, signaled: false };
                self.slots[chain_slot] = SlotData { bytes: frag, release };
                Turn::Prepared { more }
            }
        }
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

#[cfg(test)]
#[path = "engine_pair_tests.rs"]
mod pair_tests;
