//! The completer (rxe's `rxe_comp.c`): ACKs and NAKs retire send WQEs into completions,
//! sequence NAKs rewind, RNR NAKs wait, errors fail the QP.

use super::*;

impl NicCore {
    pub(super) fn handle_ack(&mut self, now: Instant, h: Header) {
        let c = &mut self.counters;
        let Some(qp) = self.qps.get_mut(&h.dest_qpn) else { return };
        let Some(aeth) = h.aeth else { return };
        if qp.state != QpState::ReadyToSend {
            c.rx_bad_state += 1;
            return;
        }
        let p = h.psn;
        let in_window = |lo: i32| psn::diff(p, qp.una_psn) >= lo && psn::diff(p, qp.req_psn) < 0;
        match aeth.syndrome {
            Syndrome::Ack => {
                if !in_window(-1) {
                    c.rx_ghost_acks += 1;
                    return;
                }
                qp.retire_through(p, now);
            }
            syndrome => {
                if !in_window(0) {
                    c.rx_ghost_acks += 1;
                    return;
                }
                qp.retire_through(psn::sub(p, 1), now);
                match syndrome {
                    Syndrome::RnrNak(code) => {
                        c.rnr_naks_received += 1;
                        if qp.rnr_retry != 7 {
                            if qp.rnr_left == 0 {
                                qp.fail_front(WcStatus::RnrRetryExceeded);
                                return;
                            }
                            qp.rnr_left -= 1;
                        }
                        qp.rewind(p);
                        qp.retransmit_at = None;
                        qp.rnr_until = Some(now + timers::rnr_timer(code));
                        return;
                    }
                    Syndrome::NakSequence => {
                        c.seq_naks_received += 1;
                        if qp.retry_left == 0 {
                            qp.fail_front(WcStatus::RetryExceeded);
                            return;
                        }
                        qp.retry_left -= 1;
                        qp.rewind(p);
                        qp.retransmit_at = qp.timeout.map(|t| now + t);
                    }
                    Syndrome::NakInvalidRequest => {
                        qp.fail_front(WcStatus::RemoteInvalidRequest);
                        return;
                    }
                    Syndrome::NakRemoteAccess => {
                        qp.fail_front(WcStatus::RemoteAccessError);
                        return;
                    }
                    Syndrome::NakRemoteOperational | Syndrome::Ack => {
                        qp.fail_front(WcStatus::RemoteOperationError);
                        return;
                    }
                }
            }
        }
        qp.activate(&mut self.data_queue);
    }
}
