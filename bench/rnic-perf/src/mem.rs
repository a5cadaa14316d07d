//! Page-aligned benchmark buffers registered with a device: the crate's only `unsafe`.
//!
//! Buffers are touched by the RNIC (another thread of a software device, or DMA) while the
//! benchmark runs, so no Rust reference to their bytes is ever created: the benchmark reads
//! and writes single bytes through atomic operations on raw pointers, and the device gets the
//! raw address through `reg_mr`.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use bex_rnic::verbs::{Access, MrKeys, Sge};
use bex_rnic::{Device, MemoryRegion};

use crate::error::{PerfError, Result};
use bex_bench::Failure;

/// Alignment of every buffer (a page, like perftest's `memalign`).
pub const PAGE_BYTES: usize = 4096;

/// A zeroed, page-aligned heap buffer.
pub struct PageBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `PageBuf` owns its allocation like a `Box<[u8]>`; the bytes are only accessed
// through raw pointers (atomically, or by the device), never through references, so sharing
// or sending the owner across threads cannot create aliasing references.
unsafe impl Send for PageBuf {}
// SAFETY: see `Send`: `&PageBuf` gives only atomic byte access and the raw address.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// Allocates `len` zeroed bytes (at least one) aligned to [`PAGE_BYTES`].
    pub fn new(len: usize) -> Result<PageBuf> {
        let layout = Layout::from_size_align(len.max(1), PAGE_BYTES)
            .map_err(|_| PerfError::usage(format!("buffer of {len} bytes is too large")))?;
        // SAFETY: `layout` has a non-zero size (`len.max(1)`).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or(PerfError::Rnic(bex_rnic::Error::Exhausted("memory for a benchmark buffer")))?;
        Ok(PageBuf { ptr, layout })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Never true (buffers hold at least one byte); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first byte's address, for `reg_mr` and scatter/gather entries.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn byte(&self, index: usize) -> &AtomicU8 {
        assert!(index < self.len(), "byte {index} outside a {}-byte buffer", self.len());
        // `index` is in bounds of the live allocation (checked above) and `AtomicU8` has the
        // size and alignment of `u8`; every benchmark-side access to the bytes is atomic.
        // SAFETY: so the pointer is valid, and the reference cannot outlive `self` (the owner).
        unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(index)) }
    }

    /// Reads byte `index` (acquire: what the device wrote before it is visible too).
    pub fn load(&self, index: usize) -> u8 {
        self.byte(index).load(Ordering::Acquire)
    }

    /// Writes byte `index` (release: ordered before the work request posted after it).
    pub fn store(&self, index: usize, value: u8) {
        self.byte(index).store(value, Ordering::Release);
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed only here, once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageBuf({:p}, {} bytes)", self.ptr, self.len())
    }
}

/// A [`PageBuf`] registered with a device. The region is declared before the buffer, so it is
/// deregistered before the memory is freed.
pub struct Registered<D: Device> {
    _mr: D::Mr,
    keys: MrKeys,
    buf: PageBuf,
}

impl<D: Device> Registered<D> {
    /// Allocates `len` bytes and registers them with `access`.
    pub fn new(dev: &D, pd: &D::Pd, len: usize, access: Access) -> Result<Registered<D>> {
        let buf = PageBuf::new(len)?;
        // Both end up in the same `Registered`, whose field order drops the region before
        // `buf` (moving `buf` into it does not move the heap allocation).
        // SAFETY: so the memory stays valid until the region is dropped.
        let mr = unsafe { dev.reg_mr(pd, buf.as_mut_ptr(), buf.len(), access)? };
        let keys = mr.keys();
        Ok(Registered { _mr: mr, keys, buf })
    }

    /// The region's keys.
    pub fn keys(&self) -> MrKeys {
        self.keys
    }

    /// The first `len` bytes as a scatter/gather entry.
    pub fn sge(&self, len: u32) -> Sge {
        Sge { addr: self.buf.as_mut_ptr() as u64, length: len, lkey: self.keys.lkey }
    }

    /// The buffer.
    pub fn buf(&self) -> &PageBuf {
        &self.buf
    }
}

impl<D: Device> fmt::Debug for Registered<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered").field("keys", &self.keys).field("buf", &self.buf).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_bounds_checked() {
        let b = PageBuf::new(10_000).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % PAGE_BYTES, 0);
        assert_eq!(b.len(), 10_000);
        assert_eq!(b.load(9_999), 0);
        b.store(9_999, 7);
        assert_eq!(b.load(9_999), 7);
        assert_eq!(PageBuf::new(0).unwrap().len(), 1);
        let r = std::panic::catch_unwind(|| b.load(10_000));
        assert!(r.is_err());
    }
}
