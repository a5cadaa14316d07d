//! The device's timers: delayed ACKs, retransmission and RNR waits; the earliest deadline the
//! driver must wake for.

use super::*;

impl NicCore {
    /// Makes every delayed ACK due now (a device about to close answers what it received, as
    /// a hardware NIC would have already).
    pub fn expedite_acks(&mut self, now: Instant) {
        self.timeout_cache.set(None);
        for qp in self.qps.values_mut() {
            if let Some(ack) = qp.pending_ack.as_mut() {
                ack.due = ack.due.min(now);
            }
        }
    }

    /// The earliest time [`NicCore::handle_timeout`] has work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if let Some(t) = self.timeout_cache.get() {
            return t;
        }
        let t = self.compute_timeout();
        self.timeout_cache.set(Some(t));
        t
    }

    pub(super) fn compute_timeout(&self) -> Option<Instant> {
        let mut best: Option<Instant> = None;
        for qp in self.qps.values() {
            let ack_due = qp.pending_ack.map(|a| a.due);
            for t in [qp.retransmit_at, qp.rnr_until, ack_due].into_iter().flatten() {
                best = Some(best.map_or(t, |b| b.min(t)));
            }
        }
        best
    }

    /// Runs every timer due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.timeout_cache.set(None);
        for qp in self.qps.values_mut() {
            if qp.rnr_until.is_some_and(|t| t <= now) {
                qp.rnr_until = None;
                qp.activate(&mut self.data_queue);
            }
            if qp.retransmit_at.is_some_and(|t| t <= now) {
                if qp.una_psn == qp.req_psn {
                    qp.retransmit_at = None;
                    continue;
                }
                if qp.retry_left == 0 {
                    qp.fail_front(WcStatus::RetryExceeded);
                    continue;
                }
                qp.retry_left -= 1;
                self.counters.ack_timeouts += 1;
                let una = qp.una_psn;
                qp.rewind(una);
                qp.retransmit_at = qp.timeout.map(|t| now + t);
                qp.activate(&mut self.data_queue);
            }
        }
    }
}
