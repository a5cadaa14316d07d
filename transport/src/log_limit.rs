//! Warnings about what a peer or the host does, at most one per period: a connection storm or
//! a process out of descriptors otherwise wrote a warning per connection (hundreds a second
//! from one stranger). Counters still count every event.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Lets the first event through, then at most one per `every`, each telling how many were
/// held back since the last.
#[derive(Debug)]
pub(crate) struct LogLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    pub(crate) fn new(every: Duration) -> LogLimit {
        LogLimit { every, state: Mutex::new((None, 0)) }
    }

    /// `Some(held back)` when an event at `now` may be logged; `None` when it is held back.
    pub(crate) fn allow(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock();
        let (last, held) = &mut *s;
        match last {
            Some(t) if now.saturating_duration_since(*t) < self.every => {
                *held += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(held))
            }
        }
    }
}

/// How often a warning of one kind may repeat.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(5);

/// The next connection on `listener`. A failed accept (out of descriptors and the like) is
/// warned of through `warn` and retried after a pause, so the loop does not spin.
pub(crate) async fn accept(
    listener: &tokio::net::TcpListener,
    warn: &LogLimit,
    what: &str,
) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    const RETRY: Duration = Duration::from_millis(10);
    loop {
        match listener.accept().await {
            Ok(a) => return a,
            Err(e) => {
                if let Some(held) = warn.allow(crate::clock::now()) {
                    tracing::warn!(%e, held_back = held, "{what} accept failed");
                }
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_passes_then_one_per_period_with_the_count_held_back() {
        let t0 = crate::clock::origin();
        let l = LogLimit::new(Duration::from_secs(5));
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..100 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i * 10)), None);
        }
        assert_eq!(l.allow(t0 + Duration::from_secs(5)), Some(99));
        assert_eq!(l.allow(t0 + Duration::from_secs(6)), None);
        assert_eq!(l.allow(t0 + Duration::from_secs(11)), Some(1));
    }
}
