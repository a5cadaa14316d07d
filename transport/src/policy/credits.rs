//! Receive-credit flow control (paper §5.4.2).
//!
//! Every SEND and WRITE_WITH_IMM consumes a receive posted by the peer, so the sender spends a
//! credit for each. One credit is held in reserve for credit-return messages: a sender whose
//! data is blocked on credits can still return the credits *it* owes, so two sides waiting on
//! each other never deadlock. The receiver re-posts in batches of `k = d/2` with one
//! `post_recv` and owes the peer `k` credits, returned piggybacked on the next outgoing
//! message header or in a credit message.

/// The sender's view: credits for the peer's posted receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendCredits {
    available: u32,
    /// The peer's receive-queue depth: an honest peer never returns more than it posted.
    limit: u32,
    /// Times a request waited because only the reserve was left.
    pub stalls: u64,
}

/// What a receive-consuming request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Data, requests to send, control: must leave the reserve.
    Ordinary,
    /// A credit-return message: may take the last credit.
    CreditReturn,
}

impl SendCredits {
    /// Starts with the peer's receive-queue depth (exchanged at connection setup).
    pub fn new(initial: u32) -> SendCredits {
        SendCredits { available: initial, limit: initial, stalls: 0 }
    }
    /// No accounting: the peer draws on a shared receive queue and relies on RNR retry.
    pub fn unlimited() -> SendCredits {
        SendCredits { available: u32::MAX, limit: u32::MAX, stalls: 0 }
    }
    /// Credits left.
    pub fn available(&self) -> u32 {
        self.available
    }
    /// Takes a credit for one receive-consuming request; false (and a stall counted) if it
    /// would dip into the reserve, or nothing is left.
    pub fn try_take(&mut self, use_: Use) -> bool {
        let floor = match use_ {
            Use::Ordinary => 1,
            Use::CreditReturn => 0,
        };
        debug_assert!(self.available <= self.limit, "more credits than the peer posted");
        if self.available == u32::MAX {
            true
        } else if self.available > floor {
            self.available -= 1;
            true
        } else {
            if use_ == Use::Ordinary {
                self.stalls += 1;
            }
            false
        }
    }
    /// The peer returned `n` credits. False if that would exceed its receive-queue depth
    /// (a peer that lies about its receives): the credits are capped at the depth, and the
    /// caller counts the header as malformed.
    pub fn grant(&mut self, n: u32) -> bool {
        if self.available == u32::MAX {
            return true;
        }
        let sum = self.available.saturating_add(n);
        self.available = sum.min(self.limit);
        sum <= self.limit
    }
}

/// The receiver's view: receives consumed, re-posted, and credits owed to the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvCredits {
    batch: u32,
    consumed: u32,
    owed: u32,
}

impl RecvCredits {
    /// For a receive queue of `depth`: re-post in batches of `depth / 2` (at least 1).
    pub fn new(depth: u32) -> RecvCredits {
        RecvCredits { batch: (depth / 2).max(1), consumed: 0, owed: 0 }
    }
    /// The re-post batch size `k`.
    pub fn batch(&self) -> u32 {
        self.batch
    }
    /// One receive was consumed; returns `Some(k)` when `k` receives should be re-posted
    /// now (and become owed credits).
    pub fn consumed(&mut self) -> Option<u32> {
        self.consumed += 1;
        if self.consumed >= self.batch {
            self.consumed -= self.batch;
            self.owed += self.batch;
            Some(self.batch)
        } else {
            None
        }
    }
    /// Credits owed to the peer, not yet returned.
    pub fn owed(&self) -> u32 {
        self.owed
    }
    /// Takes up to `max` owed credits to put in an outgoing header.
    pub fn take_owed(&mut self, max: u32) -> u32 {
        let n = self.owed.min(max);
        self.owed -= n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_credit_is_kept_for_credit_returns() {
        let mut c = SendCredits::new(2);
        assert!(c.try_take(Use::Ordinary));
        assert!(!c.try_take(Use::Ordinary));
        assert_eq!(c.stalls, 1);
        assert!(c.try_take(Use::CreditReturn));
        assert!(!c.try_take(Use::CreditReturn));
        assert!(c.grant(2));
        assert_eq!(c.available(), 2);
    }

    #[test]
    fn a_grant_beyond_the_peers_depth_is_refused_and_capped() {
        let mut c = SendCredits::new(4);
        assert!(c.try_take(Use::Ordinary));
        assert!(!c.grant(2), "4 posted, 1 in use: 2 returned is one too many");
        assert_eq!(c.available(), 4);
        assert!(!c.grant(u32::MAX));
        assert_eq!(c.available(), 4);
        let mut srq = SendCredits::unlimited();
        assert!(srq.grant(7) && srq.try_take(Use::Ordinary));
    }

    #[test]
    fn receives_are_reposted_and_owed_in_half_depth_batches() {
        let mut r = RecvCredits::new(8);
        assert_eq!(r.batch(), 4);
        let reposts: Vec<_> = (0..9).filter_map(|_| r.consumed()).collect();
        assert_eq!(reposts, vec![4, 4]);
        assert_eq!(r.owed(), 8);
        assert_eq!(r.take_owed(5), 5);
        assert_eq!(r.take_owed(5), 3);
        assert_eq!(r.owed(), 0);
    }

    /// Two sides exchanging only the messages credits allow, with returns when owed: the
    /// sender never has more outstanding receive-consuming requests than the peer posted.
    #[test]
    fn credits_never_let_a_sender_overrun_the_peer() {
        let depth = 6u32;
        let mut send = SendCredits::new(depth);
        let mut recv = RecvCredits::new(depth);
        let mut posted_at_peer = depth;
        let mut in_flight = Vec::new();
        for step in 0..1000u32 {
            if step % 3 != 0 && send.try_take(Use::Ordinary) {
                assert!(posted_at_peer > 0, "would RNR at step {step}");
                posted_at_peer -= 1;
                in_flight.push(());
            } else if in_flight.pop().is_some() {
                if let Some(k) = recv.consumed() {
                    posted_at_peer += k;
                }
                let back = recv.take_owed(u32::MAX);
                assert!(send.grant(back), "an honest peer returns at most what it posted");
            }
        }
    }
}
