//! The one place this crate reads the wall clock; everything else takes `now` as an argument.

use std::time::Instant;

/// The current wall-clock instant.
#[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read
pub fn wall_now() -> Instant {
    Instant::now()
}

/// Time elapsed since `start` on the wall clock.
#[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read
pub fn wall_elapsed(start: Instant) -> std::time::Duration {
    start.elapsed()
}

/// Nanoseconds of the system clock (entropy for seeds of real-time devices).
#[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read
pub fn wall_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
