//! The one place this crate reads a clock: tokio's (virtual under paused time), as std
//! instants for the pure policies.

/// Now, from tokio's clock.
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Now, from the std clock (tests of pure policies outside a runtime).
#[allow(clippy::disallowed_methods)] // tests' origin; the policies themselves take `now`
pub fn std_now() -> std::time::Instant {
    std::time::Instant::now()
}
