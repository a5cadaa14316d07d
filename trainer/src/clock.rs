//! The one place this crate reads a clock: tokio's.

/// Now, from tokio's clock.
pub fn now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
