//! The crate's one wall clock: the launcher polls child processes and deadlines.

use std::time::{Duration, Instant};

/// Sleeps `pause` (may be zero), then returns the current instant. The only place this crate
/// reads the wall clock or sleeps: the launcher is a poll loop over real processes.
#[allow(clippy::disallowed_methods)]
pub fn wait_then_now(pause: Duration) -> Instant {
    if !pause.is_zero() {
        std::thread::sleep(pause);
    }
    Instant::now()
}

/// The current instant.
pub fn now() -> Instant {
    wait_then_now(Duration::ZERO)
}
