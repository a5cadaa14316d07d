//! [`RegisteredBuf`]: an owned allocation of registered memory.

use std::ptr::NonNull;

use bex_rnic::verbs::{MrKeys, Sge};

use crate::pool::Pool;

/// An owned buffer of registered memory from a [`Pool`]: dereferences to `[u8]`, can be sent
/// to and dropped on any thread (dropping frees it into the dropping thread's cache), and
/// names its memory region for each device.
pub struct RegisteredBuf<'p> {
    pool: &'p Pool,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like `Box<[u8]>`), and `Pool` is `Sync`
// (its methods take `&self` and synchronise internally), so using and freeing it from another
// thread is sound: jemalloc supports frees from any thread.
unsafe impl Send for RegisteredBuf<'_> {}
// SAFETY: shared access only reads the bytes (`&[u8]`) or the pool's lock-free table.
unsafe impl Sync for RegisteredBuf<'_> {}

impl<'p> RegisteredBuf<'p> {
    /// Takes ownership of a raw allocation.
    ///
    /// # Safety
    /// `ptr` came from [`Pool::allocate_raw`] of `pool` with a request of `len` bytes (or from
    /// [`RegisteredBuf::into_raw`]), is not freed, and is owned by nothing else.
    pub unsafe fn from_raw(pool: &'p Pool, ptr: NonNull<u8>, len: usize) -> Self {
        RegisteredBuf { pool, ptr, len }
    }

    /// Gives up ownership without freeing: returns the first byte and the length. Free it
    /// with [`Pool::deallocate_sized`] (or rebuild a buffer with [`RegisteredBuf::from_raw`]).
    pub fn into_raw(self) -> (NonNull<u8>, usize) {
        let me = std::mem::ManuallyDrop::new(self);
        (me.ptr, me.len)
    }

    /// The pool it came from.
    pub fn pool(&self) -> &'p Pool {
        self.pool
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its memory region on device `device` (the whole block it lies in).
    ///
    /// # Panics
    /// If `device` is not below [`Pool::devices`].
    pub fn mr(&self, device: usize) -> MrKeys {
        self.pool.mr_of(self.as_ptr(), device).expect("device index below Pool::devices()")
    }

    /// A scatter/gather element for `len` bytes at `offset` on device `device`.
    ///
    /// # Panics
    /// If the range is outside the buffer, longer than `u32::MAX`, or `device` is out of range.
    pub fn sge(&self, device: usize, offset: usize, len: usize) -> Sge {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "range outside buffer");
        Sge {
            addr: self.ptr.as_ptr() as u64 + offset as u64,
            length: u32::try_from(len).expect("sge length fits u32"),
            lkey: self.mr(device).lkey,
        }
    }
}

impl std::ops::Deref for RegisteredBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // Fresh blocks are zero pages and jemalloc only hands out memory inside them, whose
        // bytes are always some previously written value.
        // SAFETY: `ptr` is a live allocation of `len` initialised bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for RegisteredBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for RegisteredBuf<'_> {
    fn drop(&mut self) {
        // SAFETY: the buffer owns a live allocation of `len` requested bytes from `pool`.
        unsafe { self.pool.deallocate_sized(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for RegisteredBuf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuf").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}
