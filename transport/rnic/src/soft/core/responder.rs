//! The responder (rxe's `rxe_resp.c`): incoming requests checked against the expected PSN,
//! SENDs into posted receives, WRITEs into registered memory, duplicates re-ACKed and
//! never re-executed, RNR and access NAKs.

use super::*;

#[derive(Debug)]
pub(super) struct RecvInProgress {
    pub(super) wqe: RecvWr,
    pub(super) offset: u64,
}

#[derive(Debug)]
pub(super) struct WriteInProgress {
    pub(super) reth: Reth,
    pub(super) offset: u64,
}

impl Qp {
    /// Completes the receive being filled with a failure `status`.
    pub(super) fn abandon_receive(&mut self, status: WcStatus) {
        if let Some(cur) = self.recv_cur.take() {
            self.recv_cq.push(recv_wc(cur.wqe.wr_id, self.qpn, status, WcOpcode::Recv));
        }
    }

    pub(super) fn take_receive(&mut self, srqs: &mut HashMap<u32, Srq>) -> Option<RecvWr> {
        match self.srq {
            Some(id) => srqs.get_mut(&id).and_then(|s| s.queue.pop_front()),
            None => self.rq.pop_front(),
        }
    }
}

impl NicCore {
    pub(super) fn handle_request(&mut self, now: Instant, h: Header, payload: &[u8]) {
        let c = &mut self.counters;
        let Some(qp) = self.qps.get_mut(&h.dest_qpn) else { return };
        // A delayed ACK must come well before the peer's retransmit timer, which is taken to
        // be this QP's own (both ends of a bex connection set the same): at most a quarter of
        // it. (With a 1 ms timer and the 1 ms delay, a stream's ACKs raced its timeouts.)
        let delay = qp.timeout.map_or(self.cfg.ack_delay, |t| self.cfg.ack_delay.min(t / 4));
        let ack_due = now + delay;
        if !matches!(qp.state, QpState::ReadyToReceive | QpState::ReadyToSend) {
            c.rx_bad_state += 1;
            return;
        }
        let d = psn::diff(h.psn, qp.epsn);
        if d > 0 {
            c.rx_out_of_sequence += 1;
            if !qp.nak_sent {
                qp.nak_sent = true;
                c.seq_naks_sent += 1;
                let ack = PendingAck {
                    syndrome: Syndrome::NakSequence,
                    psn: qp.epsn,
                    due: now,
                    covers: 0,
                };
                qp.queue_ack(ack, &mut self.ctrl_queue);
            }
            return;
        }
        if d < 0 {
            c.rx_duplicates += 1;
            let ack = PendingAck {
                syndrome: Syndrome::Ack,
                psn: psn::sub(qp.epsn, 1),
                due: now,
                covers: 0,
            };
            qp.queue_ack(ack, &mut self.ctrl_queue);
            return;
        }
        let op = h.opcode;
        let outcome = if op.is_send() {
            Self::execute_send(qp, &mut self.srqs, &self.mrs, h, payload)
        } else {
            Self::execute_write(qp, &mut self.srqs, &self.mrs, h, payload)
        };
        match outcome {
            Ok(()) => {
                qp.epsn = psn::add(qp.epsn, 1);
                qp.nak_sent = false;
                if op.is_last() {
                    qp.msn = psn::add(qp.msn, 1);
                }
                // Every executed packet is acknowledged, cumulatively, within the ACK delay
                // (sooner if data leaves for the peer, which takes the ACK along). At once:
                // - for an AckReq nobody here will answer (a signaled plain WRITE, or the
                //   sender's window asking inside a message): the sender waits for it;
                // - for every `ack_coalesce_max`-th delivered message.
                // The end of a message the application receives (a SEND, a WRITE with
                // immediate) waits: the reply that usually follows carries its ACK, which
                // saves the peer a wake-up for a lone ACK. The window is the requester's to
                // watch: it asks (AckReq) while it has more queued than the window holds.
                // (This side used to ACK on its own at a quarter window: a 65-packet reply
                // then woke its sender twice for ACKs nobody waited for.)
                let delivers = op.is_last() && (op.is_send() || op.has_imm());
                let covers = qp.pending_ack.map_or(0, |a| a.covers) + u32::from(delivers);
                let prompt = (h.ack_req && !delivers) || covers >= self.cfg.ack_coalesce_max;
                let due = if prompt { now } else { ack_due };
                let ack = PendingAck { syndrome: Syndrome::Ack, psn: h.psn, due, covers };
                qp.queue_ack(ack, &mut self.ctrl_queue);
            }
            Err(Syndrome::RnrNak(t)) => {
                c.rnr_naks_sent += 1;
                let ack =
                    PendingAck { syndrome: Syndrome::RnrNak(t), psn: h.psn, due: now, covers: 0 };
                qp.queue_ack(ack, &mut self.ctrl_queue);
            }
            Err(syndrome) => {
                c.error_naks_sent += 1;
                qp.queue_ack(
                    PendingAck { syndrome, psn: h.psn, due: now, covers: 0 },
                    &mut self.ctrl_queue,
                );
                qp.enter_error();
            }
        }
    }

    /// Executes one in-order SEND packet; `Err` is the NAK to answer with.
    pub(super) fn execute_send(
        qp: &mut Qp,
        srqs: &mut HashMap<u32, Srq>,
        mrs: &MrTable,
        h: Header,
        payload: &[u8],
    ) -> std::result::Result<(), Syndrome> {
        let op = h.opcode;
        if op.is_first() {
            if qp.recv_cur.is_some() {
                return Err(Syndrome::NakInvalidRequest);
            }
            let Some(wqe) = qp.take_receive(srqs) else {
                return Err(Syndrome::RnrNak(qp.min_rnr_timer));
            };
            qp.recv_cur = Some(RecvInProgress { wqe, offset: 0 });
        }
        let mtu = qp.mtu;
        let pd = qp.pd;
        let qpn = qp.qpn;
        let Some(cur) = qp.recv_cur.as_mut() else {
            return Err(Syndrome::NakInvalidRequest);
        };
        if !op.is_last() && payload.len() as u64 != mtu {
            return Err(Syndrome::NakInvalidRequest);
        }
        let capacity = cur.wqe.sg_list.total_len();
        if cur.offset + payload.len() as u64 > capacity {
            qp.abandon_receive(WcStatus::LocalLengthError);
            return Err(Syndrome::NakInvalidRequest);
        }
        if mrs.scatter(cur.wqe.sg_list.as_slice(), pd, cur.offset, payload).is_err() {
            qp.abandon_receive(WcStatus::LocalProtectionError);
            return Err(Syndrome::NakRemoteOperational);
        }
        cur.offset += payload.len() as u64;
        if op.is_last() {
            let cur = qp.recv_cur.take().expect("checked above");
            let mut wc = recv_wc(cur.wqe.wr_id, qpn, WcStatus::Success, WcOpcode::Recv);
            wc.byte_len = cur.offset as u32;
            wc.imm = h.imm;
            qp.recv_cq.push(wc);
        }
        Ok(())
    }

    /// Executes one in-order WRITE packet; `Err` is the NAK to answer with.
    pub(super) fn execute_write(
        qp: &mut Qp,
        srqs: &mut HashMap<u32, Srq>,
        mrs: &MrTable,
        h: Header,
        payload: &[u8],
    ) -> std::result::Result<(), Syndrome> {
        let op = h.opcode;
        if op.is_first() {
            if qp.write_cur.is_some() {
                return Err(Syndrome::NakInvalidRequest);
            }
            let reth = h.reth.ok_or(Syndrome::NakInvalidRequest)?;
            if !qp.access.contains(Access::REMOTE_WRITE) && reth.dma_len > 0 {
                return Err(Syndrome::NakRemoteAccess);
            }
            // Zero-length writes check no key (IBA 9.4.3.2).
            if reth.dma_len > 0
                && mrs
                    .check_remote_write(reth.rkey, qp.pd, reth.va, u64::from(reth.dma_len))
                    .is_err()
            {
                return Err(Syndrome::NakRemoteAccess);
            }
            qp.write_cur = Some(WriteInProgress { reth, offset: 0 });
        }
        let mtu = qp.mtu;
        let Some(cur) = qp.write_cur.as_ref() else {
            return Err(Syndrome::NakInvalidRequest);
        };
        if !op.is_last() && payload.len() as u64 != mtu {
            qp.write_cur = None;
            return Err(Syndrome::NakInvalidRequest);
        }
        let end = cur.offset + payload.len() as u64;
        if end > u64::from(cur.reth.dma_len) || (op.is_last() && end != u64::from(cur.reth.dma_len))
        {
            qp.write_cur = None;
            return Err(Syndrome::NakInvalidRequest);
        }
        // WRITE_WITH_IMM needs its receive before any byte of the last packet lands.
        let receive = if op.consumes_receive() {
            match qp.take_receive(srqs) {
                Some(wqe) => Some(wqe),
                None => {
                    if op.is_first() {
                        qp.write_cur = None;
                    }
                    return Err(Syndrome::RnrNak(qp.min_rnr_timer));
                }
            }
        } else {
            None
        };
        let cur = qp.write_cur.as_mut().expect("checked above");
        if !payload.is_empty()
            && mrs.remote_write(cur.reth.rkey, qp.pd, cur.reth.va + cur.offset, payload).is_err()
        {
            // The region vanished (deregistered) mid-message.
            qp.write_cur = None;
            if let Some(wqe) = receive {
                qp.rq.push_front(wqe);
            }
            return Err(Syndrome::NakRemoteAccess);
        }
        cur.offset = end;
        if op.is_last() {
            let cur = qp.write_cur.take().expect("checked above");
            if let Some(wqe) = receive {
                let mut wc =
                    recv_wc(wqe.wr_id, qp.qpn, WcStatus::Success, WcOpcode::RecvRdmaWithImm);
                wc.byte_len = cur.reth.dma_len;
                wc.imm = h.imm;
                qp.recv_cq.push(wc);
            }
        }
        Ok(())
    }
}
