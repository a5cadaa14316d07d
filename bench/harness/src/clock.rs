//! The crate's only reader of the wall clock.
//!
//! The workspace's `clippy.toml` bans `Instant::now`, `SystemTime::now` and `thread::sleep`
//! everywhere else: the benchmark code takes instants from a [`Clock`] and never sleeps (it
//! waits on sockets, completion-queue file descriptors or the control channel instead).

use std::time::{Duration, Instant};

/// The monotonic clock every measurement and every deadline in a benchmark tool comes from.
#[derive(Clone, Copy, Debug, Default)]
pub struct Clock;

impl Clock {
    /// The current instant.
    // A benchmark measures real elapsed time, so this is the one sanctioned read of the
    // monotonic clock in this crate; everything else calls it.
    #[allow(clippy::disallowed_methods)]
    #[inline]
    pub fn now(&self) -> Instant {
        Instant::now()
    }

    /// The instant `after` from now.
    pub fn deadline(&self, after: Duration) -> Instant {
        self.now() + after
    }

    /// True once `deadline` has passed.
    pub fn expired(&self, deadline: Instant) -> bool {
        self.now() >= deadline
    }
}
