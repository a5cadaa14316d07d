//! The one place the server and client crates read clocks (tokio's, so tests on a paused
//! runtime see virtual time).

/// Now (tokio's clock).
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Milliseconds since the Unix epoch (checkpoint timestamps).
#[allow(clippy::disallowed_methods)] // wall-clock time of day, for humans reading checkpoints
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
