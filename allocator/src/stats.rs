//! The pool's counters as a plain snapshot (to become metrics).

/// A snapshot of a pool's counters ([`crate::Pool::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Devices every block is registered with.
    pub devices: usize,
    /// Address space reserved (the pool's ceiling).
    pub reserved_bytes: u64,
    /// Bytes in blocks (committed, whether or not registered: equals `registered_bytes` when
    /// the pool has devices).
    pub block_bytes: u64,
    /// Bytes of the reservation used up: `block_bytes` plus alignment gaps between blocks.
    pub carved_bytes: u64,
    /// Bytes currently registered (per device; the paper's Figure 5 footprint). Zero for an
    /// unregistered pool.
    pub registered_bytes: u64,
    /// Blocks obtained (each registered once per device).
    pub blocks: u64,
    /// Successful registrations, all devices together (`blocks × devices` in a healthy pool).
    pub registrations: u64,
    /// Deregistrations (only when a pool is dropped, or to undo a failed multi-device one).
    pub deregistrations: u64,
    /// Registrations a device refused.
    pub registration_failures: u64,
    /// Allocations made.
    pub allocations: u64,
    /// Deallocations made.
    pub deallocations: u64,
    /// Bytes allocated and not yet freed, counted in jemalloc's size classes (usable bytes).
    pub live_bytes: u64,
    /// Explicit thread caches the pool has (one per thread that used it and is alive).
    pub thread_caches: usize,
}
