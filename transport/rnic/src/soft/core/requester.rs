//! The requester (rxe's `rxe_req.c`): send WQEs into packets within the PSN window, go-back-N
//! rewinds, and the transmit turn that sends ACKs first, then data round-robin across QPs.

use super::*;

#[derive(Debug)]
pub(super) struct SendWqe {
    pub(super) wr: SendWr,
    pub(super) total_len: u64,
    pub(super) npkts: u32,
    /// First PSN, valid once `started`.
    pub(super) first_psn: u32,
    pub(super) started: bool,
}

impl SendWqe {
    pub(super) fn last_psn(&self) -> u32 {
        psn::add(self.first_psn, self.npkts - 1)
    }
}

impl Qp {
    /// Fails the oldest send WQE with `status`, then the QP.
    pub(super) fn fail_front(&mut self, status: WcStatus) {
        if let Some(wqe) = self.sq.pop_front() {
            self.complete_send(&wqe, status);
            self.sq_next = self.sq_next.saturating_sub(1);
        }
        self.enter_error();
    }

    /// Retires every WQE whose last PSN is at or before `through`.
    pub(super) fn retire_through(&mut self, through: u32, now: Instant) {
        let advanced = psn::diff(psn::add(through, 1), self.una_psn) > 0;
        while let Some(front) = self.sq.front() {
            if !front.started || psn::diff(front.last_psn(), through) > 0 {
                break;
            }
            let wqe = self.sq.pop_front().expect("front exists");
            self.complete_send(&wqe, WcStatus::Success);
            self.sq_next = self.sq_next.saturating_sub(1);
        }
        if advanced {
            self.una_psn = psn::add(through, 1);
            self.retry_left = self.retry_cnt;
            self.rnr_left = self.rnr_retry;
            self.retransmit_at =
                if self.una_psn == self.req_psn { None } else { self.timeout.map(|t| now + t) };
        }
        self.debug_check_psns();
    }

    /// The requester's PSN order: oldest unacknowledged (`una_psn`) ≤ next to send
    /// (`req_psn`) ≤ one past the highest ever sent (`max_sent_psn`), within half the 24-bit
    /// space.
    pub(super) fn debug_check_psns(&self) {
        debug_assert!(
            psn::diff(self.req_psn, self.una_psn) >= 0,
            "qp {:#x}: next PSN {:#x} before the oldest unacknowledged {:#x}",
            self.qpn,
            self.req_psn,
            self.una_psn
        );
        debug_assert!(
            psn::diff(self.max_sent_psn, self.req_psn) >= 0,
            "qp {:#x}: next PSN {:#x} beyond one past the highest sent ({:#x})",
            self.qpn,
            self.req_psn,
            self.max_sent_psn
        );
    }

    /// Go-back-N: transmission resumes at `from`, which must be an outstanding PSN.
    pub(super) fn rewind(&mut self, from: u32) {
        let mut idx = None;
        for (i, wqe) in self.sq.iter().enumerate() {
            if !wqe.started {
                break;
            }
            let d = psn::diff(from, wqe.first_psn);
            if d >= 0 && (d as u32) < wqe.npkts {
                idx = Some(i);
                break;
            }
        }
        let Some(k) = idx else { return };
        for wqe in self.sq.iter_mut().skip(k + 1) {
            wqe.started = false;
        }
        self.sq_next = k;
        self.req_psn = from;
        self.pkts_since_ack_req = 0;
        self.debug_check_psns();
    }
}

impl NicCore {
    /// Writes the next packet to send into `out` and returns its destination, or `None` when
    /// nothing can be sent now. ACKs and NAKs go first, then data round-robin across QPs,
    /// one packet per QP per turn.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<u8>) -> Option<SocketAddr> {
        self.timeout_cache.set(None);
        if let Some((dest, h)) = self.orphan_acks.pop() {
            packet::encode_into(&h, 0, out, &packet::Route { src: self.local, dst: dest }, |_| {});
            self.counters.acks_sent += 1;
            self.counters.tx_packets += 1;
            self.counters.tx_bytes += out.len() as u64;
            return Some(dest);
        }
        // ACKs and NAKs that are due go first.
        let mut i = 0;
        while i < self.ctrl_queue.len() {
            let qpn = self.ctrl_queue[i];
            let Some(qp) = self.qps.get_mut(&qpn) else {
                self.ctrl_queue.remove(i);
                continue;
            };
            let Some(ack) = qp.pending_ack else {
                qp.in_ctrl_queue = false;
                self.ctrl_queue.remove(i);
                continue;
            };
            if ack.due > now {
                i += 1;
                continue;
            }
            self.ctrl_queue.remove(i);
            qp.in_ctrl_queue = false;
            qp.pending_ack = None;
            let Some(dest) = qp.remote_addr else { continue };
            let mut h = Header::new(Opcode::Acknowledge, qp.remote_qpn, ack.psn);
            h.aeth = Some(Aeth { syndrome: ack.syndrome, msn: qp.msn });
            packet::encode_into(&h, 0, out, &packet::Route { src: self.local, dst: dest }, |_| {});
            self.counters.acks_sent += 1;
            self.counters.tx_packets += 1;
            self.counters.tx_bytes += out.len() as u64;
            return Some(dest);
        }
        while let Some(qpn) = self.data_queue.pop_front() {
            let Some(qp) = self.qps.get_mut(&qpn) else { continue };
            qp.in_data_queue = false;
            let sent = Self::next_data_packet(
                qp,
                &self.mrs,
                (&self.cfg, self.local),
                &mut self.counters,
                now,
                out,
            );
            if let Some(dest) = sent {
                // A waiting ACK for the same QP leaves right behind this packet.
                if let Some(ack) = qp.pending_ack.as_mut() {
                    ack.due = ack.due.min(now);
                }
                // One packet per turn: go to the back of the line if there is more.
                qp.activate(&mut self.data_queue);
                return Some(dest);
            }
        }
        None
    }

    /// True when, after packet `psn`, the send queue holds more packets than the PSN window
    /// has room for: the requester would stall without an ACK from inside the stream.
    pub(super) fn outruns_window(qp: &Qp, cfg: &NicConfig, psn: u32) -> bool {
        let outstanding = psn::diff(psn, qp.una_psn).max(0) as u64 + 1;
        let room = u64::from(cfg.max_unacked_psns).saturating_sub(outstanding);
        let mut queued = 0u64;
        for (i, wqe) in qp.sq.iter().enumerate().skip(qp.sq_next) {
            queued += if i == qp.sq_next && wqe.started {
                let sent = psn::diff(psn, wqe.first_psn).max(0) as u64 + 1;
                u64::from(wqe.npkts).saturating_sub(sent)
            } else {
                u64::from(wqe.npkts)
            };
            if queued > room {
                return true;
            }
        }
        false
    }

    pub(super) fn next_data_packet(
        qp: &mut Qp,
        mrs: &MrTable,
        (cfg, local): (&NicConfig, SocketAddr),
        counters: &mut Counters,
        now: Instant,
        out: &mut Vec<u8>,
    ) -> Option<SocketAddr> {
        if qp.state != QpState::ReadyToSend || qp.rnr_until.is_some() {
            return None;
        }
        if psn::diff(qp.req_psn, qp.una_psn) >= cfg.max_unacked_psns as i32 {
            return None;
        }
        let dest = qp.remote_addr?;
        let req_psn = qp.req_psn;
        let wqe = qp.sq.get_mut(qp.sq_next)?;
        if !wqe.started {
            wqe.first_psn = req_psn;
            wqe.started = true;
        }
        let window_asks = qp.pkts_since_ack_req + 1 >= cfg.ack_req_every
            && Self::outruns_window(qp, cfg, req_psn);
        let wqe = qp.sq.get_mut(qp.sq_next)?;
        let index = psn::diff(req_psn, wqe.first_psn) as u64;
        let offset = index * qp.mtu;
        let len = qp.mtu.min(wqe.total_len.saturating_sub(offset)) as usize;
        let first = index == 0;
        let last = index + 1 == u64::from(wqe.npkts);
        let imm = match wqe.wr.op {
            SendOp::SendWithImm { imm } | SendOp::WriteWithImm { imm, .. } if last => Some(imm),
            _ => None,
        };
        let (opcode, reth, imm) = match wqe.wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } => {
                (packet_opcode(&SEND_OPCODES, first, last, imm.is_some()), None, imm)
            }
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm { remote_addr, rkey, .. } => {
                let op = packet_opcode(&WRITE_OPCODES, first, last, imm.is_some());
                let reth =
                    first.then_some(Reth { va: remote_addr, rkey, dma_len: wqe.total_len as u32 });
                (op, reth, imm)
            }
        };
        let mut h = Header::new(opcode, qp.remote_qpn, req_psn);
        h.reth = reth;
        h.imm = imm;
        qp.pkts_since_ack_req += 1;
        // AckReq where this side waits for the ACK: the end of a signaled request (the
        // application wants its completion), and every `ack_req_every` packets while what is
        // queued would outrun the window. An unsignaled request is retired by a later
        // signaled one; the responder ACKs it within its ACK delay all the same.
        if (last && wqe.wr.signaled) || window_asks {
            h.ack_req = true;
            qp.pkts_since_ack_req = 0;
        }
        let mut gathered = Ok(());
        packet::encode_into(&h, len, out, &packet::Route { src: local, dst: dest }, |dst| {
            gathered = mrs.gather(wqe.wr.sg_list.as_slice(), qp.pd, offset, dst);
        });
        if gathered.is_err() {
            // A local key that is unknown, out of bounds or deregistered: the request fails
            // locally and the QP errors, as on hardware.
            let wqe = qp.sq.remove(qp.sq_next).expect("wqe exists");
            qp.complete_send(&wqe, WcStatus::LocalProtectionError);
            qp.enter_error();
            return None;
        }
        if psn::diff(req_psn, qp.max_sent_psn) < 0 {
            counters.retransmitted_packets += 1;
        } else {
            qp.max_sent_psn = psn::add(req_psn, 1);
        }
        qp.req_psn = psn::add(req_psn, 1);
        qp.debug_check_psns();
        if last {
            qp.sq_next += 1;
        }
        if qp.retransmit_at.is_none() {
            qp.retransmit_at = qp.timeout.map(|t| now + t);
        }
        counters.tx_packets += 1;
        counters.tx_bytes += out.len() as u64;
        Some(dest)
    }
}

/// A SEND's packet opcodes: only, only with immediate, first, middle, last, last with
/// immediate.
const SEND_OPCODES: [Opcode; 6] = [
    Opcode::SendOnly,
    Opcode::SendOnlyImm,
    Opcode::SendFirst,
    Opcode::SendMiddle,
    Opcode::SendLast,
    Opcode::SendLastImm,
];
/// A WRITE's, in the same order.
const WRITE_OPCODES: [Opcode; 6] = [
    Opcode::WriteOnly,
    Opcode::WriteOnlyImm,
    Opcode::WriteFirst,
    Opcode::WriteMiddle,
    Opcode::WriteLast,
    Opcode::WriteLastImm,
];

/// The opcode of a message's packet from its kind's `ops`: where it stands in the message,
/// and whether it carries the immediate (only the last packet does).
fn packet_opcode(ops: &[Opcode; 6], first: bool, last: bool, imm: bool) -> Opcode {
    ops[match (first, last, imm) {
        (true, true, false) => 0,
        (true, true, true) => 1,
        (true, false, _) => 2,
        (false, false, _) => 3,
        (false, true, false) => 4,
        (false, true, true) => 5,
    }]
}
