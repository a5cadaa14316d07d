//! The one place this crate reads the wall clock.

use std::time::Instant;

/// The current wall-clock instant.
#[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read
pub fn now() -> Instant {
    Instant::now()
}

/// An arbitrary fixed origin for tests that only need instants to add durations to.
pub fn origin() -> Instant {
    now()
}
