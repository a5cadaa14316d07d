//! The one wall-clock read of this crate: the runtime of each simulation (reported, never
//! fed into the simulation).

use std::time::Instant;

/// The current wall-clock instant.
#[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read
pub fn wall_now() -> Instant {
    Instant::now()
}
