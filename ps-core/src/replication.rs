//! Replication bookkeeping on the training pod (pure; `now` is passed in).
//!
//! The training pod's server of a shard numbers its Replicate batches 1, 2, 3, … (the
//! request `seq`; its client id is the source's id, so replicas dedupe retries). Each target
//! (the same shard in another pod) acknowledges batches as it applies them, possibly out of
//! order while several are in flight. [`LagTracker`] turns that into the lag a server
//! exposes: batches produced but not yet acknowledged by the slowest target, and the age of
//! the oldest such batch.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bex_ps_proto::control::ReplicationStatus;

#[derive(Debug, Default, Clone)]
struct Target {
    /// Every batch ≤ this is acknowledged.
    through: u64,
    /// Acknowledged batches above `through + 1` (out of order).
    ahead: BTreeSet<u64>,
}

/// Replication lag of one source over its targets.
#[derive(Debug, Clone)]
pub struct LagTracker {
    targets: Vec<Target>,
    last: u64,
    /// (seq, produced at) of batches some target has not acknowledged, oldest first; at most
    /// `capacity` entries (older ones are forgotten: the lag age then under-reports, and the
    /// caller, whose queue overflowed too, re-bootstraps that target).
    pending: VecDeque<(u64, Instant)>,
    capacity: usize,
}

impl LagTracker {
    /// A tracker for `targets` targets remembering at most `capacity` unacknowledged batch
    /// times.
    pub fn new(targets: usize, capacity: usize) -> LagTracker {
        LagTracker {
            targets: vec![Target::default(); targets],
            last: 0,
            pending: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Allocates the sequence number of a new batch produced at `now`.
    pub fn produce(&mut self, now: Instant) -> u64 {
        self.last += 1;
        if self.targets.is_empty() {
            return self.last;
        }
        if self.pending.len() == self.capacity {
            self.pending.pop_front();
        }
        self.pending.push_back((self.last, now));
        self.last
    }

    /// Target `target` has applied batch `seq` (Ok or Duplicate). Unknown targets and
    /// sequence numbers never produced are ignored.
    pub fn ack(&mut self, target: usize, seq: u64) {
        let last = self.last;
        let Some(t) = self.targets.get_mut(target) else { return };
        if seq <= t.through || seq > last {
            return;
        }
        t.ahead.insert(seq);
        while t.ahead.remove(&(t.through + 1)) {
            t.through += 1;
        }
        self.trim();
    }

    /// Target `target` was re-bootstrapped from a snapshot taken after batch `seq` was
    /// produced: everything ≤ `seq` counts as acknowledged.
    pub fn reset_target(&mut self, target: usize, seq: u64) {
        let last = self.last;
        if let Some(t) = self.targets.get_mut(target) {
            t.through = t.through.max(seq.min(last));
            let through = t.through;
            t.ahead.retain(|&s| s > through);
            while t.ahead.remove(&(t.through + 1)) {
                t.through += 1;
            }
        }
        self.trim();
    }

    fn min_through(&self) -> u64 {
        self.targets.iter().map(|t| t.through).min().unwrap_or(self.last)
    }

    fn trim(&mut self) {
        let m = self.min_through();
        while self.pending.front().is_some_and(|&(s, _)| s <= m) {
            self.pending.pop_front();
        }
    }

    /// Batches acknowledged by every target.
    pub fn acked_by_all(&self) -> u64 {
        self.min_through()
    }

    /// Batches the slowest target still lacks.
    pub fn lag_batches(&self) -> u64 {
        self.last - self.min_through()
    }

    /// Age of the oldest batch some target lacks (zero when all caught up).
    pub fn lag(&self, now: Instant) -> Duration {
        match self.pending.front() {
            Some(&(_, at)) if self.lag_batches() > 0 => now.saturating_duration_since(at),
            _ => Duration::ZERO,
        }
    }

    /// The health view.
    pub fn status(&self, now: Instant) -> ReplicationStatus {
        ReplicationStatus {
            seq: self.last,
            lag_updates: self.lag_batches(),
            lag_ms: self.lag(now).as_millis().min(u128::from(u64::MAX)) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_follows_the_slowest_target() {
        let t0 = crate::test_clock::origin();
        let ms = Duration::from_millis;
        let mut l = LagTracker::new(2, 100);
        assert_eq!(l.status(t0), ReplicationStatus { seq: 0, lag_updates: 0, lag_ms: 0 });
        let s1 = l.produce(t0);
        let s2 = l.produce(t0 + ms(10));
        let s3 = l.produce(t0 + ms(20));
        assert_eq!((s1, s2, s3), (1, 2, 3));
        assert_eq!(l.lag_batches(), 3);
        assert_eq!(l.lag(t0 + ms(50)), ms(50));
        l.ack(0, 1);
        l.ack(0, 3); // out of order
        l.ack(1, 1);
        assert_eq!(l.lag_batches(), 2, "target 1 lacks 2 and 3");
        assert_eq!(l.lag(t0 + ms(50)), ms(40));
        l.ack(0, 2);
        assert_eq!(l.acked_by_all(), 1);
        l.ack(1, 2);
        l.ack(1, 3);
        assert_eq!(l.lag_batches(), 0);
        assert_eq!(l.lag(t0 + ms(99)), Duration::ZERO);
        // Duplicates, unknown targets and the future are ignored.
        l.ack(1, 3);
        l.ack(7, 1);
        l.ack(0, 99);
        assert_eq!(l.status(t0 + ms(100)).seq, 3);
    }

    #[test]
    fn reset_after_bootstrap_and_bounded_memory() {
        let t0 = crate::test_clock::origin();
        let mut l = LagTracker::new(1, 4);
        for i in 0..10 {
            l.produce(t0 + Duration::from_millis(i));
        }
        assert_eq!(l.pending.len(), 4);
        assert_eq!(l.lag_batches(), 10);
        // Oldest remembered is batch 7 (produced at +6 ms).
        assert_eq!(l.lag(t0 + Duration::from_millis(10)), Duration::from_millis(4));
        l.ack(0, 9);
        l.reset_target(0, 8);
        assert_eq!(l.acked_by_all(), 9);
        l.ack(0, 10);
        assert_eq!(l.lag_batches(), 0);
        // No targets: never lags.
        let mut none = LagTracker::new(0, 4);
        none.produce(t0);
        assert_eq!(none.lag_batches(), 0);
    }
}
