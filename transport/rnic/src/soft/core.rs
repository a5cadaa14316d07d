//! The sans-IO protocol core of the software RNIC: every QP's requester, completer and
//! responder, the memory-key table and the SRQs of one device.
//!
//! It has no sockets, threads or clock. Drivers feed it (`post_*`, [`NicCore::handle_packet`],
//! [`NicCore::handle_timeout`]) and drain it ([`NicCore::poll_transmit`],
//! [`NicCore::poll_timeout`]) with `now` passed in, in this order per turn: inputs, timeouts,
//! then transmit until it returns `None`.
//!
//! The protocol follows Linux rxe (`rxe_req.c`, `rxe_comp.c`, `rxe_resp.c`): a window of
//! unacknowledged PSNs, AckReq at message end and every `ack_req_every` packets while more is
//! queued than the window has room for, cumulative
//! ACKs, one sequence NAK per gap, duplicates re-ACKed and never re-executed, go-back-N from
//! any PSN (also mid-message), a retransmit timer bounded by `retry_cnt`, RNR NAKs bounded by
//! `rnr_retry` (7 = infinite), and access violations that NAK and move both QPs to ERROR.
//!
//! Split as rxe is: this file holds the device's resources and verbs, the QP state and the
//! packet dispatch; `requester` (send WQEs into packets, go-back-N, the transmit turn),
//! `responder` (requests into receives and memory), `completer` (ACKs and NAKs into
//! completions) and `timeouts` (delayed ACKs, retransmission, RNR waits).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::cq::CqShared;
use super::mem::{MrTable, Region};
use super::packet::{self, psn, Aeth, Header, Opcode, Reth, Syndrome};
use crate::device::{Error, Result};
mod completer;
mod requester;
mod responder;
mod timeouts;

use requester::SendWqe;
use responder::{RecvInProgress, WriteInProgress};

use crate::verbs::{
    timers, Access, InitAttrs, MrKeys, QpCaps, QpState, RecvWr, RtrAttrs, RtsAttrs, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion, MAX_SGE,
};

/// Tunables of one software device.
#[derive(Clone, Debug)]
pub struct NicConfig {
    /// Verify the ICRC of every received packet (catches corruption; costs a CRC pass).
    pub check_icrc: bool,
    /// Most PSNs a QP may have unacknowledged (rxe: 128).
    pub max_unacked_psns: u32,
    /// Set AckReq every this many packets while the queued packets would outrun the PSN
    /// window (a quarter of it by default): the responder ACKs inside a message only when
    /// asked, so a message that fits the window costs the requester no wake-up for an ACK
    /// in its middle.
    pub ack_req_every: u32,
    /// Deepest send/receive queue.
    pub max_qp_wr: u32,
    /// Most QPs.
    pub max_qps: usize,
    /// Largest message.
    pub max_msg_size: u64,
    /// Seed for QP numbers, PSNs and keys.
    pub seed: u64,
    /// How long the positive ACK of the last packet of a message the application receives
    /// (SEND, WRITE with immediate) may wait for data going to the same QP to leave with
    /// it: in request/response traffic the reply carries it, which saves the peer a wake-up
    /// per message for a lone ACK. NAKs, ACKs requested inside a message or at the end of a
    /// plain WRITE (the sender's window needs them) and every `ack_coalesce_max`-th
    /// message's ACK go at once. 0 sends every ACK at once. A QP delays at most a quarter of
    /// its own retransmit timeout (taken to be the peer's too).
    pub ack_delay: Duration,
    /// Most message ends one delayed ACK may cover before it goes at once (bounds how much
    /// of the sender's send queue waits for it).
    pub ack_coalesce_max: u32,
}

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            check_icrc: true,
            max_unacked_psns: 128,
            ack_req_every: 32,
            max_qp_wr: 16 * 1024,
            max_qps: 64 * 1024,
            max_msg_size: 1 << 31,
            seed: 0x5eed_b0a7,
            // An event loop's timers have millisecond resolution; a reply, not the timer,
            // usually takes the ACK.
            ack_delay: Duration::from_millis(1),
            ack_coalesce_max: 8,
        }
    }
}

/// Counters of one device (cumulative).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Packets handed to the wire.
    pub tx_packets: u64,
    /// Bytes handed to the wire.
    pub tx_bytes: u64,
    /// Data packets sent again after a timeout, NAK or RNR.
    pub retransmitted_packets: u64,
    /// Packets accepted from the wire.
    pub rx_packets: u64,
    /// Bytes accepted from the wire.
    pub rx_bytes: u64,
    /// Packets that failed to parse (truncated, unknown opcode, bad pad, …).
    pub rx_malformed: u64,
    /// Packets whose ICRC did not match.
    pub rx_bad_icrc: u64,
    /// Packets for a QP number that does not exist.
    pub rx_unknown_qp: u64,
    /// Packets for an existing QP from an address other than its peer.
    pub rx_wrong_source: u64,
    /// Packets for a QP in a state that does not accept them.
    pub rx_bad_state: u64,
    /// Duplicate requests (re-ACKed, not executed).
    pub rx_duplicates: u64,
    /// Requests ahead of the expected PSN (dropped).
    pub rx_out_of_sequence: u64,
    /// ACKs outside the window of outstanding PSNs.
    pub rx_ghost_acks: u64,
    /// Sequence NAKs sent.
    pub seq_naks_sent: u64,
    /// Sequence NAKs received.
    pub seq_naks_received: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Remote-access / invalid-request / operational NAKs sent.
    pub error_naks_sent: u64,
    /// ACK timeouts that led to a retransmission.
    pub ack_timeouts: u64,
    /// ACK packets sent.
    pub acks_sent: u64,
    /// Completions that found their CQ full.
    pub cq_overruns: u64,
    /// Datagrams the wire failed to send (unreachable peer, …).
    pub wire_send_errors: u64,
    /// Receive errors on the wire.
    pub wire_recv_errors: u64,
    /// Packets an installed fault plan dropped.
    pub wire_fault_drops: u64,
}

#[derive(Clone, Copy, Debug)]
struct PendingAck {
    syndrome: Syndrome,
    psn: u32,
    /// When it must leave at the latest.
    due: Instant,
    /// Message ends it acknowledges (delayed ACKs coalesce).
    covers: u32,
}

#[derive(Debug)]
struct Qp {
    qpn: u32,
    pd: u32,
    state: QpState,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    srq: Option<u32>,
    caps: QpCaps,
    access: Access,
    /// This side's first PSN, advertised in its endpoint.
    initial_psn: u32,
    // Connection (valid from RTR).
    remote_addr: Option<SocketAddr>,
    remote_qpn: u32,
    mtu: u64,
    min_rnr_timer: u8,
    // Requester (valid from RTS).
    timeout: Option<Duration>,
    retry_cnt: u8,
    rnr_retry: u8,
    retry_left: u8,
    rnr_left: u8,
    sq: VecDeque<SendWqe>,
    /// Index in `sq` of the WQE being (or next to be) transmitted.
    sq_next: usize,
    /// Next PSN to transmit.
    req_psn: u32,
    /// Oldest unacknowledged PSN.
    una_psn: u32,
    /// Highest PSN ever transmitted + 1 (to count retransmissions).
    max_sent_psn: u32,
    pkts_since_ack_req: u32,
    retransmit_at: Option<Instant>,
    rnr_until: Option<Instant>,
    // Responder.
    epsn: u32,
    msn: u32,
    rq: VecDeque<RecvWr>,
    recv_cur: Option<RecvInProgress>,
    write_cur: Option<WriteInProgress>,
    nak_sent: bool,
    pending_ack: Option<PendingAck>,
    in_ctrl_queue: bool,
    in_data_queue: bool,
}

#[derive(Debug)]
struct Srq {
    pd: u32,
    depth: usize,
    queue: VecDeque<RecvWr>,
}

/// The protocol state of one software device.
#[derive(Debug)]
pub struct NicCore {
    cfg: NicConfig,
    /// This device's address and UDP port: the source of its packets' route, whose IP and
    /// UDP headers their ICRC covers.
    local: SocketAddr,
    /// What IPv4 identifications change in ICRCs, per packet length (received packets).
    ipv4_ids: packet::Ipv4Ids,
    rng: ChaCha8Rng,
    qps: HashMap<u32, Qp>,
    srqs: HashMap<u32, Srq>,
    mrs: MrTable,
    next_pd: u32,
    next_srq: u32,
    /// QPs with an ACK/NAK to send.
    ctrl_queue: VecDeque<u32>,
    /// QPs that may have data to send (round-robin, one packet per turn).
    data_queue: VecDeque<u32>,
    /// ACKs owed by QPs destroyed before their delayed ACK left.
    orphan_acks: Vec<(SocketAddr, Header)>,
    counters: Counters,
    /// `poll_timeout`'s answer, until a call that can move a timer clears it: drivers ask
    /// before every wait and every receive pass, and the answer walks every QP.
    timeout_cache: std::cell::Cell<Option<Option<Instant>>>,
}

fn recv_wc(wr_id: u64, qpn: u32, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
    WorkCompletion { wr_id, status, opcode, byte_len: 0, imm: None, qp_num: qpn, vendor_err: 0 }
}

fn send_wc_opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm { .. } => WcOpcode::Send,
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
    }
}

impl Qp {
    fn activate(&mut self, data_queue: &mut VecDeque<u32>) {
        if !self.in_data_queue && self.state == QpState::ReadyToSend {
            self.in_data_queue = true;
            data_queue.push_back(self.qpn);
        }
    }

    fn queue_ack(&mut self, mut ack: PendingAck, ctrl_queue: &mut VecDeque<u32>) {
        // An ACK covers executed packets only: those before the expected PSN.
        debug_assert!(
            ack.syndrome != Syndrome::Ack || psn::diff(ack.psn, self.epsn) < 0,
            "qp {:#x}: ACK of PSN {:#x}, expected PSN {:#x} not executed yet",
            self.qpn,
            ack.psn,
            self.epsn
        );
        if let Some(prev) = self.pending_ack {
            // A NAK is never replaced by an ACK that does not cover its PSN.
            if prev.syndrome != Syndrome::Ack
                && ack.syndrome == Syndrome::Ack
                && psn::diff(ack.psn, prev.psn) < 0
            {
                return;
            }
            // A newer ACK does not postpone the one already waiting.
            ack.due = ack.due.min(prev.due);
        }
        self.pending_ack = Some(ack);
        if !self.in_ctrl_queue {
            self.in_ctrl_queue = true;
            ctrl_queue.push_back(self.qpn);
        }
    }

    /// Completes one send WQE: a completion if signaled or failed.
    fn complete_send(&self, wqe: &SendWqe, status: WcStatus) {
        if wqe.wr.signaled || status != WcStatus::Success {
            self.send_cq.push(WorkCompletion {
                wr_id: wqe.wr.wr_id,
                status,
                opcode: send_wc_opcode(&wqe.wr.op),
                byte_len: wqe.total_len as u32,
                imm: None,
                qp_num: self.qpn,
                vendor_err: 0,
            });
        }
    }

    /// Moves to ERROR and flushes every outstanding request (receives on an SRQ stay there).
    fn enter_error(&mut self) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        self.retransmit_at = None;
        self.rnr_until = None;
        for wqe in std::mem::take(&mut self.sq) {
            self.complete_send(&wqe, WcStatus::WrFlushError);
        }
        self.sq_next = 0;
        if let Some(cur) = self.recv_cur.take() {
            self.recv_cq.push(recv_wc(
                cur.wqe.wr_id,
                self.qpn,
                WcStatus::WrFlushError,
                WcOpcode::Recv,
            ));
        }
        self.write_cur = None;
        for wr in std::mem::take(&mut self.rq) {
            self.recv_cq.push(recv_wc(wr.wr_id, self.qpn, WcStatus::WrFlushError, WcOpcode::Recv));
        }
    }
}

impl NicCore {
    /// A device with no resources.
    pub fn new(cfg: NicConfig, local: SocketAddr) -> NicCore {
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        NicCore {
            cfg,
            local,
            ipv4_ids: packet::Ipv4Ids::default(),
            rng,
            qps: HashMap::new(),
            srqs: HashMap::new(),
            mrs: MrTable::default(),
            next_pd: 1,
            next_srq: 1,
            ctrl_queue: VecDeque::new(),
            data_queue: VecDeque::new(),
            orphan_acks: Vec::new(),
            timeout_cache: std::cell::Cell::new(None),
            counters: Counters::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &NicConfig {
        &self.cfg
    }

    /// Cumulative counters.
    pub fn counters(&self) -> Counters {
        self.counters.clone()
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&mut self) -> u32 {
        let pd = self.next_pd;
        self.next_pd += 1;
        pd
    }

    /// Registers memory and returns its keys (lkey = rkey, a random value).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay valid for reads and writes until [`NicCore::dereg_mr`]
    /// removes the key.
    pub unsafe fn reg_mr(
        &mut self,
        pd: u32,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MrKeys> {
        if addr.is_null() && len > 0 {
            return Err(Error::InvalidArgument("reg_mr: null address".into()));
        }
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::InvalidArgument("reg_mr: REMOTE_WRITE requires LOCAL_WRITE".into()));
        }
        let region = Region { addr: addr as u64, len: len as u64, access, pd };
        loop {
            let key: u32 = self.rng.random();
            if key != 0 && self.mrs.insert(key, region) {
                return Ok(MrKeys { addr: addr as u64, len: len as u64, lkey: key, rkey: key });
            }
        }
    }

    /// Deregisters a region; its keys stop working at once.
    pub fn dereg_mr(&mut self, key: u32) -> bool {
        self.mrs.remove(key).is_some()
    }

    /// Number of registered regions.
    pub fn mr_count(&self) -> usize {
        self.mrs.len()
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&mut self, pd: u32, depth: u32) -> Result<u32> {
        if depth == 0 || depth > self.cfg.max_qp_wr {
            return Err(Error::InvalidArgument(format!(
                "srq depth {depth} outside 1..={}",
                self.cfg.max_qp_wr
            )));
        }
        let id = self.next_srq;
        self.next_srq += 1;
        self.srqs.insert(id, Srq { pd, depth: depth as usize, queue: VecDeque::new() });
        Ok(id)
    }

    /// Destroys a shared receive queue (its receives are dropped).
    pub fn destroy_srq(&mut self, id: u32) {
        self.srqs.remove(&id);
    }

    /// Posts receives to an SRQ.
    pub fn post_srq_recv(&mut self, id: u32, wrs: &[RecvWr]) -> Result<()> {
        let srq = self.srqs.get_mut(&id).ok_or(Error::InvalidArgument("unknown srq".into()))?;
        for (i, wr) in wrs.iter().enumerate() {
            if srq.queue.len() >= srq.depth {
                return Err(Error::QueueFull { posted: i });
            }
            if let Err(e) = self.mrs.check_scatter(wr.sg_list.as_slice(), srq.pd) {
                return Err(Error::InvalidRequest { index: i, reason: format!("sge: {e:?}") });
            }
            srq.queue.push_back(*wr);
        }
        Ok(())
    }

    /// Receives waiting in an SRQ.
    pub fn srq_len(&self, id: u32) -> usize {
        self.srqs.get(&id).map_or(0, |s| s.queue.len())
    }

    /// Creates an RC QP in RESET.
    pub fn create_qp(
        &mut self,
        pd: u32,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        srq: Option<u32>,
        caps: QpCaps,
    ) -> Result<u32> {
        if self.qps.len() >= self.cfg.max_qps {
            return Err(Error::Exhausted("queue pairs"));
        }
        let max = self.cfg.max_qp_wr;
        if caps.max_send_wr == 0 || caps.max_send_wr > max || caps.max_recv_wr > max {
            return Err(Error::InvalidArgument(format!("queue depths must be in 1..={max}")));
        }
        if caps.max_send_sge as usize > MAX_SGE || caps.max_recv_sge as usize > MAX_SGE {
            return Err(Error::InvalidArgument(format!("at most {MAX_SGE} sges per request")));
        }
        if let Some(id) = srq {
            if !self.srqs.contains_key(&id) {
                return Err(Error::InvalidArgument("unknown srq".into()));
            }
        }
        let qpn = loop {
            let n = self.rng.random_range(2..(1u32 << 24));
            if !self.qps.contains_key(&n) {
                break n;
            }
        };
        let initial_psn = self.rng.random_range(0..(1u32 << 24));
        let qp = Qp {
            qpn,
            pd,
            state: QpState::Reset,
            send_cq,
            recv_cq,
            srq,
            caps,
            access: Access::NONE,
            initial_psn,
            remote_addr: None,
            remote_qpn: 0,
            mtu: 4096,
            min_rnr_timer: 12,
            timeout: None,
            retry_cnt: 7,
            rnr_retry: 7,
            retry_left: 7,
            rnr_left: 7,
            sq: VecDeque::new(),
            sq_next: 0,
            req_psn: initial_psn,
            una_psn: initial_psn,
            max_sent_psn: initial_psn,
            pkts_since_ack_req: 0,
            retransmit_at: None,
            rnr_until: None,
            epsn: 0,
            msn: 0,
            rq: VecDeque::new(),
            recv_cur: None,
            write_cur: None,
            nak_sent: false,
            pending_ack: None,
            in_ctrl_queue: false,
            in_data_queue: false,
        };
        self.qps.insert(qpn, qp);
        Ok(qpn)
    }

    /// Destroys a QP: outstanding requests vanish without completions, as `ibv_destroy_qp`.
    pub fn destroy_qp(&mut self, qpn: u32) {
        self.timeout_cache.set(None);
        let Some(qp) = self.qps.remove(&qpn) else { return };
        // What was received is still answered, as a hardware NIC would have already.
        if let (Some(ack), Some(dest)) = (qp.pending_ack, qp.remote_addr) {
            let mut h = Header::new(Opcode::Acknowledge, qp.remote_qpn, ack.psn);
            h.aeth = Some(Aeth { syndrome: ack.syndrome, msn: qp.msn });
            self.orphan_acks.push((dest, h));
        }
    }

    fn qp_mut(&mut self, qpn: u32) -> Result<&mut Qp> {
        self.qps.get_mut(&qpn).ok_or_else(|| Error::InvalidArgument(format!("unknown qp {qpn}")))
    }

    /// The QP's state.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.qps.get(&qpn).map(|q| q.state)
    }

    /// The PSN the QP will send first.
    pub fn qp_initial_psn(&self, qpn: u32) -> Option<u32> {
        self.qps.get(&qpn).map(|q| q.initial_psn)
    }

    /// RESET→INIT.
    pub fn modify_to_init(&mut self, qpn: u32, attrs: &InitAttrs) -> Result<()> {
        let qp = self.qp_mut(qpn)?;
        if qp.state != QpState::Reset {
            return Err(Error::InvalidState { qpn, state: qp.state, what: "to INIT" });
        }
        qp.access = attrs.access;
        qp.state = QpState::Init;
        Ok(())
    }

    /// INIT→RTR.
    pub fn modify_to_rtr(&mut self, qpn: u32, attrs: &RtrAttrs) -> Result<()> {
        let max_msg = self.cfg.max_msg_size;
        let qp = self.qp_mut(qpn)?;
        if qp.state != QpState::Init {
            return Err(Error::InvalidState { qpn, state: qp.state, what: "to RTR" });
        }
        let mtu = u64::from(attrs.path_mtu.bytes());
        if mtu == 0 || mtu > u64::from(crate::verbs::Mtu::MAX_SOFT) || max_msg == 0 {
            return Err(Error::InvalidArgument("path mtu".into()));
        }
        qp.remote_addr = Some(attrs.remote.socket_addr());
        qp.remote_qpn = attrs.remote.qpn & packet::PSN_MASK;
        qp.epsn = attrs.remote.psn & packet::PSN_MASK;
        qp.mtu = mtu;
        qp.min_rnr_timer = attrs.min_rnr_timer & 31;
        qp.state = QpState::ReadyToReceive;
        Ok(())
    }

    /// RTR→RTS.
    pub fn modify_to_rts(&mut self, qpn: u32, attrs: &RtsAttrs) -> Result<()> {
        self.timeout_cache.set(None);
        let qp = self.qp_mut(qpn)?;
        if qp.state != QpState::ReadyToReceive {
            return Err(Error::InvalidState { qpn, state: qp.state, what: "to RTS" });
        }
        if attrs.retry_cnt > 7 || attrs.rnr_retry > 7 {
            return Err(Error::InvalidArgument("retry_cnt and rnr_retry are 3-bit fields".into()));
        }
        let sq_psn = attrs.sq_psn & packet::PSN_MASK;
        qp.req_psn = sq_psn;
        qp.una_psn = sq_psn;
        qp.max_sent_psn = sq_psn;
        qp.timeout = timers::ack_timeout(attrs.timeout);
        qp.retry_cnt = attrs.retry_cnt;
        qp.retry_left = attrs.retry_cnt;
        qp.rnr_retry = attrs.rnr_retry;
        qp.rnr_left = attrs.rnr_retry;
        qp.state = QpState::ReadyToSend;
        Ok(())
    }

    /// Any state → ERROR, flushing outstanding work.
    pub fn modify_to_error(&mut self, qpn: u32) -> Result<()> {
        self.timeout_cache.set(None);
        self.qp_mut(qpn)?.enter_error();
        Ok(())
    }

    /// Posts send requests (one doorbell).
    pub fn post_send(&mut self, qpn: u32, wrs: &[SendWr]) -> Result<()> {
        self.timeout_cache.set(None);
        let max_msg = self.cfg.max_msg_size;
        let qp = self.qps.get_mut(&qpn).ok_or(Error::InvalidArgument("unknown qp".into()))?;
        match qp.state {
            QpState::ReadyToSend => {}
            QpState::Error => {
                // As on hardware: requests posted to an errored QP complete flushed.
                for (i, wr) in wrs.iter().enumerate() {
                    if qp.sq.len() >= qp.caps.max_send_wr as usize {
                        return Err(Error::QueueFull { posted: i });
                    }
                    let wqe = SendWqe {
                        wr: *wr,
                        total_len: wr.sg_list.total_len(),
                        npkts: 1,
                        first_psn: 0,
                        started: false,
                    };
                    qp.complete_send(&wqe, WcStatus::WrFlushError);
                }
                return Ok(());
            }
            state => return Err(Error::InvalidState { qpn, state, what: "post_send" }),
        }
        for (i, wr) in wrs.iter().enumerate() {
            if qp.sq.len() >= qp.caps.max_send_wr as usize {
                qp.activate(&mut self.data_queue);
                return Err(Error::QueueFull { posted: i });
            }
            if wr.sg_list.as_slice().len() > qp.caps.max_send_sge.max(1) as usize {
                qp.activate(&mut self.data_queue);
                return Err(Error::InvalidRequest {
                    index: i,
                    reason: format!("{} sges > max_send_sge", wr.sg_list.as_slice().len()),
                });
            }
            let total_len = wr.sg_list.total_len();
            if total_len > max_msg {
                qp.activate(&mut self.data_queue);
                return Err(Error::InvalidRequest {
                    index: i,
                    reason: format!("{total_len} bytes > max message {max_msg}"),
                });
            }
            let npkts = total_len.div_ceil(qp.mtu).max(1) as u32;
            qp.sq.push_back(SendWqe { wr: *wr, total_len, npkts, first_psn: 0, started: false });
        }
        qp.activate(&mut self.data_queue);
        Ok(())
    }

    /// Posts receive requests to a QP's own receive queue.
    pub fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr]) -> Result<()> {
        let qp = self.qps.get_mut(&qpn).ok_or(Error::InvalidArgument("unknown qp".into()))?;
        if qp.srq.is_some() {
            return Err(Error::InvalidArgument("QP uses an SRQ: post receives there".into()));
        }
        match qp.state {
            QpState::Reset => {
                return Err(Error::InvalidState { qpn, state: qp.state, what: "post_recv" })
            }
            QpState::Error => {
                for wr in wrs {
                    qp.recv_cq.push(recv_wc(wr.wr_id, qpn, WcStatus::WrFlushError, WcOpcode::Recv));
                }
                return Ok(());
            }
            _ => {}
        }
        for (i, wr) in wrs.iter().enumerate() {
            if qp.rq.len() >= qp.caps.max_recv_wr as usize {
                return Err(Error::QueueFull { posted: i });
            }
            if wr.sg_list.as_slice().len() > qp.caps.max_recv_sge.max(1) as usize {
                return Err(Error::InvalidRequest { index: i, reason: "too many sges".into() });
            }
            qp.rq.push_back(*wr);
        }
        Ok(())
    }

    /// Receives waiting in a QP's own receive queue.
    pub fn rq_len(&self, qpn: u32) -> usize {
        self.qps.get(&qpn).map_or(0, |q| q.rq.len())
    }

    /// Handles one datagram from `from`. Malformed or unexpected packets are counted and
    /// dropped; nothing here panics on network input.
    pub fn handle_packet(&mut self, now: Instant, from: SocketAddr, bytes: &[u8]) {
        self.timeout_cache.set(None);
        let Ok(pkt) = packet::parse(bytes) else {
            self.counters.rx_malformed += 1;
            return;
        };
        let route = packet::Route { src: from, dst: self.local };
        if self.cfg.check_icrc && !packet::icrc_ok(bytes, &route, &mut self.ipv4_ids) {
            self.counters.rx_bad_icrc += 1;
            return;
        }
        let h = pkt.header;
        let Some(qp) = self.qps.get_mut(&h.dest_qpn) else {
            self.counters.rx_unknown_qp += 1;
            return;
        };
        if qp.remote_addr != Some(from) {
            self.counters.rx_wrong_source += 1;
            return;
        }
        self.counters.rx_packets += 1;
        self.counters.rx_bytes += bytes.len() as u64;
        if h.opcode == Opcode::Acknowledge {
            self.handle_ack(now, h);
        } else {
            self.handle_request(now, h, pkt.payload);
        }
    }
}
