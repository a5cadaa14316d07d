//! The RPC layer's decisions as small pure types, each tested on injected time: when to retry,
//! whom to quarantine, which replica to ask, and when a destination falls back to TCP or
//! re-probes RDMA (paper §7.2).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Probabilistic retry of timed-out requests.
#[derive(Debug)]
pub struct RetryPolicy {
    probability: f64,
    max_retries: u32,
    rng: ChaCha8Rng,
}

impl RetryPolicy {
    /// Retries a timed-out request with `probability`, at most `max_retries` times.
    pub fn new(probability: f64, max_retries: u32, seed: u64) -> RetryPolicy {
        RetryPolicy {
            probability: probability.clamp(0.0, 1.0),
            max_retries,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
    /// Whether attempt number `retries_so_far + 1` should be made.
    pub fn should_retry(&mut self, retries_so_far: u32) -> bool {
        retries_so_far < self.max_retries && self.rng.random_bool(self.probability)
    }
}

/// Quarantine of a destination with repeated failures: more than `max_conn` connection
/// failures or more than `max_req` request failures within `window` put it on the exclusion
/// list; a successful probe re-admits it.
#[derive(Clone, Debug)]
pub struct Quarantine {
    window: Duration,
    max_conn: usize,
    max_req: usize,
    conn_failures: VecDeque<Instant>,
    req_failures: VecDeque<Instant>,
    since: Option<Instant>,
    /// Times this destination entered quarantine.
    pub entered: u64,
}

impl Quarantine {
    /// The paper's defaults are M = 30, N = 50 within 5 minutes.
    pub fn new(max_conn: usize, max_req: usize, window: Duration) -> Quarantine {
        Quarantine {
            window,
            max_conn,
            max_req,
            conn_failures: VecDeque::new(),
            req_failures: VecDeque::new(),
            since: None,
            entered: 0,
        }
    }

    fn expire(&mut self, now: Instant) {
        let w = self.window;
        for q in [&mut self.conn_failures, &mut self.req_failures] {
            while q.front().is_some_and(|t| now.saturating_duration_since(*t) >= w) {
                q.pop_front();
            }
        }
    }

    fn check(&mut self, now: Instant) {
        if self.since.is_none()
            && (self.conn_failures.len() > self.max_conn || self.req_failures.len() > self.max_req)
        {
            self.since = Some(now);
            self.entered += 1;
        }
    }

    /// A connection attempt failed.
    pub fn connection_failed(&mut self, now: Instant) {
        self.expire(now);
        self.conn_failures.push_back(now);
        self.check(now);
    }

    /// A request failed (timeout or error).
    pub fn request_failed(&mut self, now: Instant) {
        self.expire(now);
        self.req_failures.push_back(now);
        self.check(now);
    }

    /// True while excluded.
    pub fn is_quarantined(&self) -> bool {
        self.since.is_some()
    }

    /// A probe succeeded: re-admit and forget the failures.
    pub fn probe_succeeded(&mut self) {
        self.since = None;
        self.conn_failures.clear();
        self.req_failures.clear();
    }
}

/// A replica of a shard: which mini-pod it is in, and an index the caller understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replica {
    /// Mini-pod.
    pub pod: u32,
    /// Caller's handle (index into its endpoint list).
    pub id: usize,
}

/// Orders replicas: healthy ones in the caller's mini-pod first, then healthy ones in other
/// mini-pods (rotated so load spreads), then quarantined ones as a last resort.
pub fn order_replicas(
    replicas: &[Replica],
    local_pod: u32,
    quarantined: impl Fn(usize) -> bool,
    rotate: usize,
) -> Vec<Replica> {
    let mut local: Vec<Replica> = Vec::new();
    let mut remote: Vec<Replica> = Vec::new();
    let mut sick: Vec<Replica> = Vec::new();
    for r in replicas {
        if quarantined(r.id) {
            sick.push(*r);
        } else if r.pod == local_pod {
            local.push(*r);
        } else {
            remote.push(*r);
        }
    }
    if !remote.is_empty() {
        let k = rotate % remote.len();
        remote.rotate_left(k);
    }
    local.into_iter().chain(remote).chain(sick).collect()
}

/// Which transport a destination uses: RDMA, or TCP after RDMA failed, with a periodic RDMA
/// re-probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathState {
    /// RDMA is in use.
    Rdma,
    /// Fell back to TCP at `since`; RDMA is tried again at `next_probe`.
    Tcp {
        /// When the fallback happened.
        since: Instant,
        /// When to try RDMA again.
        next_probe: Instant,
    },
}

/// The fallback state of one destination.
#[derive(Clone, Debug)]
pub struct Fallback {
    /// Current path.
    pub state: PathState,
    reprobe: Duration,
    /// Times RDMA was abandoned for TCP.
    pub fallbacks: u64,
    /// Times RDMA came back after a probe.
    pub recoveries: u64,
}

impl Fallback {
    /// Starts on RDMA; after a fallback, RDMA is re-probed every `reprobe`.
    pub fn new(reprobe: Duration) -> Fallback {
        Fallback { state: PathState::Rdma, reprobe, fallbacks: 0, recoveries: 0 }
    }
    /// RDMA failed past reconnecting: use TCP.
    pub fn rdma_failed(&mut self, now: Instant) {
        match &mut self.state {
            PathState::Rdma => {
                self.state = PathState::Tcp { since: now, next_probe: now + self.reprobe };
                self.fallbacks += 1;
            }
            PathState::Tcp { next_probe, .. } => *next_probe = now + self.reprobe,
        }
    }
    /// Whether this call should try RDMA (always on RDMA; on TCP when a probe is due).
    pub fn use_rdma(&self, now: Instant) -> bool {
        match self.state {
            PathState::Rdma => true,
            PathState::Tcp { next_probe, .. } => now >= next_probe,
        }
    }
    /// An RDMA call succeeded.
    pub fn rdma_ok(&mut self) {
        if matches!(self.state, PathState::Tcp { .. }) {
            self.recoveries += 1;
        }
        self.state = PathState::Rdma;
    }
    /// True while on TCP.
    pub fn on_tcp(&self) -> bool {
        matches!(self.state, PathState::Tcp { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        crate::clock::std_now()
    }

    #[test]
    fn quarantine_engages_just_past_the_threshold_and_forgets_old_failures() {
        let now = t0();
        let min = Duration::from_secs(60);
        let mut q = Quarantine::new(30, 50, 5 * min);
        for _ in 0..30 {
            q.connection_failed(now);
        }
        assert!(!q.is_quarantined(), "exactly M failures is not more than M");
        q.connection_failed(now);
        assert!(q.is_quarantined());
        assert_eq!(q.entered, 1);
        q.probe_succeeded();
        assert!(!q.is_quarantined());
        // 50 request failures spread over more than 5 minutes never quarantine.
        for i in 0..100u32 {
            q.request_failed(now + min * i / 10);
        }
        assert!(!q.is_quarantined());
        let later = now + 20 * min;
        for _ in 0..51 {
            q.request_failed(later);
        }
        assert!(q.is_quarantined());
    }

    #[test]
    fn replicas_in_the_local_pod_come_first_and_quarantined_last() {
        let r = |pod, id| Replica { pod, id };
        let all = [r(0, 0), r(1, 1), r(2, 2)];
        let order = order_replicas(&all, 1, |_| false, 0);
        assert_eq!(order[0], r(1, 1));
        let order = order_replicas(&all, 1, |id| id == 1, 1);
        assert_eq!(order.last(), Some(&r(1, 1)));
        assert_eq!(order[0], r(2, 2), "rotation spreads remote load");
    }

    #[test]
    fn fallback_reprobes_rdma_on_schedule() {
        let now = t0();
        let s = Duration::from_secs(1);
        let mut f = Fallback::new(s);
        assert!(f.use_rdma(now));
        f.rdma_failed(now);
        assert!(f.on_tcp() && !f.use_rdma(now + s / 2) && f.use_rdma(now + s));
        f.rdma_failed(now + s);
        assert!(!f.use_rdma(now + s + s / 2));
        f.rdma_ok();
        assert!(!f.on_tcp());
        assert_eq!((f.fallbacks, f.recoveries), (1, 1));
    }

    #[test]
    fn retries_follow_the_probability_and_the_cap() {
        let mut never = RetryPolicy::new(0.0, 5, 1);
        assert!(!never.should_retry(0));
        let mut always = RetryPolicy::new(1.0, 2, 1);
        assert!(always.should_retry(0) && always.should_retry(1) && !always.should_retry(2));
        let mut half = RetryPolicy::new(0.5, u32::MAX, 7);
        let yes = (0..10_000).filter(|_| half.should_retry(0)).count();
        assert!((4500..5500).contains(&yes), "{yes}");
    }
}
