//! A cache hint: start loading a value's cache line without waiting for it.
//!
//! The one `unsafe` of this crate: calling the intrinsic needs `unsafe` (its
//! `#[target_feature]`, SSE, which every x86_64 CPU has; before Rust 1.87 it was an
//! `unsafe fn`); it reads nothing into the program.
#![allow(unsafe_code)]

/// Starts loading the cache line of `x` into every cache level, and returns at once.
///
/// Why not a load (what the table's warm pass used before): a load retires only when its
/// line arrives, so a batch's misses were in flight together only as far as the CPU's
/// reorder window reached past the oldest one; a prefetch retires at once. Measured in
/// `results/table-scale/runs/prefetch-warm-2026-12-07/`.
#[inline(always)]
pub fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the caches: it never faults, whatever the address (here a
    // live reference's), and reads or writes nothing the program sees. Its target feature,
    // SSE, is part of the x86_64 baseline, so every CPU this code runs on has it.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((x as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
