//! `alloc-bench`: bemalloc against general-purpose allocators, reproducing the paper's
//! Figure 4 (operations per second and peak memory versus threads, for large and small
//! allocations) and Figure 5 (registered bytes sampled over a run).
//!
//! This is its own package rather than a bench target of `bemalloc` so that the competitors
//! (mimalloc, rpmalloc and tikv-jemallocator, each a C build) never enter `bemalloc`'s
//! dependency graph, not even as dev-dependencies built by `cargo test -p bemalloc`.
//!
//! Method (as rpmalloc-benchmark, which the paper's figure follows):
//! - one process per (allocator, threads, workload) cell and repetition, so allocators never
//!   share a heap and peak RSS (`ru_maxrss`) belongs to one cell;
//! - every thread keeps a fixed number of live slots; each step frees the block in a random
//!   slot and allocates a new one of a random size, writing one byte in every page of it;
//! - about 10 % of frees go to another thread through a bounded hand-off (batches of 16 on a
//!   queue of 4 batches per thread, so at most 64 blocks per thread are in flight; a sender
//!   that finds the queue full frees its own incoming blocks and yields until there is room,
//!   counted as `handoff_full`). With one thread the hand-off goes to the thread itself
//!   (a deferred free);
//! - sizes: large 64 KiB–1 MiB with exponential falloff (density at 1 MiB is 1 % of that at
//!   64 KiB), small 16 B–16 KiB with linear falloff (density falls linearly to 0 at 16 KiB);
//! - operations are allocations plus frees; the rate is per CPU-second of the process (user +
//!   system, the rpmalloc-benchmark measure, robust on a shared 2-core machine); wall-clock
//!   rate is in the JSON too;
//! - each thread first fills its slots; for bemalloc, registrations are read after the fill
//!   plus a third of the steps (the warm-up) and at the end.

pub mod cell;
pub mod report;
pub mod workload;

use std::alloc::{GlobalAlloc, Layout};

/// An allocator under test.
pub trait BenchAlloc: Sync {
    /// Allocates `size` (> 0) bytes; null on failure.
    fn alloc(&self, size: usize) -> *mut u8;
    /// Frees what [`BenchAlloc::alloc`] returned for `size` bytes.
    ///
    /// # Safety
    /// `ptr` came from `alloc(size)` of this allocator and is not used afterwards.
    unsafe fn free(&self, ptr: *mut u8, size: usize);
    /// bemalloc's counters: (registered bytes, registrations, blocks).
    fn registration(&self) -> Option<(u64, u64, u64)> {
        None
    }
}

/// Any `GlobalAlloc` called directly (not installed as the global allocator).
#[derive(Debug)]
pub struct Global<A>(pub A);

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).expect("bench sizes are small")
}

impl<A: GlobalAlloc + Sync> BenchAlloc for Global<A> {
    fn alloc(&self, size: usize) -> *mut u8 {
        // SAFETY: `size` is non-zero (the workload never asks for 0 bytes).
        unsafe { self.0.alloc(layout(size)) }
    }
    unsafe fn free(&self, ptr: *mut u8, size: usize) {
        // SAFETY: forwarded: `ptr` came from `alloc` with the same layout.
        unsafe { self.0.dealloc(ptr, layout(size)) }
    }
}

/// A bemalloc pool (registered with a software RNIC, or unregistered: the raw base).
#[derive(Debug)]
pub struct Bemalloc(pub bemalloc::Pool);

impl BenchAlloc for Bemalloc {
    fn alloc(&self, size: usize) -> *mut u8 {
        self.0.allocate_raw(size).map_or(std::ptr::null_mut(), |p| p.as_ptr())
    }
    unsafe fn free(&self, ptr: *mut u8, size: usize) {
        if let Some(p) = std::ptr::NonNull::new(ptr) {
            // SAFETY: forwarded: `ptr` came from `allocate_raw(size)` of this pool.
            unsafe { self.0.deallocate_sized(p, size) }
        }
    }
    fn registration(&self) -> Option<(u64, u64, u64)> {
        let s = self.0.stats();
        Some((s.registered_bytes, s.registrations, s.blocks))
    }
}
