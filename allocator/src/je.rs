//! The jemalloc calls bemalloc makes: `mallctl` for arenas and explicit thread caches, and the
//! `mallocx` family for allocation. Every `unsafe` block of the crate that talks to jemalloc is
//! here, each with its argument.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::ptr::{self, NonNull};

use tikv_jemalloc_sys as sys;

pub(crate) use sys::extent_hooks_t;

/// A failed `mallctl`, with its name and errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CtlError {
    pub(crate) name: &'static str,
    pub(crate) errno: c_int,
}

impl std::fmt::Display for CtlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mallctl({}) failed: {}",
            self.name,
            std::io::Error::from_raw_os_error(self.errno)
        )
    }
}

/// `mallctl(name, oldp, oldlenp, newp, newlen)` with typed old and new values.
///
/// # Safety
/// `O` and `N` must be the types jemalloc documents for `name` (or `()` for "none").
unsafe fn ctl<O, N>(
    name: &'static CStr,
    old: Option<&mut O>,
    new: Option<&mut N>,
) -> Result<(), CtlError> {
    let mut old_len = std::mem::size_of::<O>();
    let (oldp, oldlenp) = match old {
        Some(o) => (o as *mut O as *mut c_void, &mut old_len as *mut usize),
        None => (ptr::null_mut(), ptr::null_mut()),
    };
    let (newp, newlen) = match new {
        Some(n) => (n as *mut N as *mut c_void, std::mem::size_of::<N>()),
        None => (ptr::null_mut(), 0),
    };
    // The caller guarantees the value types match `name`.
    // SAFETY: `name` is NUL-terminated; pointers are null or live, with their sizes passed.
    let rc = unsafe { sys::mallctl(name.as_ptr(), oldp, oldlenp, newp, newlen) };
    if rc == 0 {
        Ok(())
    } else {
        Err(CtlError { name: name.to_str().unwrap_or("?"), errno: rc })
    }
}

/// `mallctl` on a name built at run time (`arena.<i>.…`).
fn ctl_dyn_ssize(name: String, value: isize) -> Result<(), CtlError> {
    let owned = std::ffi::CString::new(name).expect("mallctl names have no NUL");
    let leaked: &'static CStr = Box::leak(owned.into_boxed_c_str());
    let mut v = value;
    // SAFETY: the `arena.<i>.*_decay_ms` controls take an `ssize_t` (`isize`) new value.
    unsafe { ctl::<(), isize>(leaked, None, Some(&mut v)) }
}

/// `arena.<i>.retain_grow_limit` (a `size_t`).
fn ctl_dyn_size(name: String, value: usize) -> Result<(), CtlError> {
    let owned = std::ffi::CString::new(name).expect("mallctl names have no NUL");
    let leaked: &'static CStr = Box::leak(owned.into_boxed_c_str());
    let mut v = value;
    // SAFETY: `arena.<i>.retain_grow_limit` takes a `size_t` new value.
    unsafe { ctl::<(), usize>(leaked, None, Some(&mut v)) }
}

/// Creates an arena whose extents come from `hooks`.
///
/// # Safety
/// `hooks` must stay valid (and its functions callable) for as long as the arena exists, which
/// is until [`destroy_arena`] succeeds or forever.
pub(crate) unsafe fn create_arena(hooks: *mut extent_hooks_t) -> Result<c_uint, CtlError> {
    let mut ind: c_uint = 0;
    let mut h = hooks;
    // The caller keeps the hooks alive for the arena's life.
    // SAFETY: `arenas.create` reads an `extent_hooks_t *` and returns an `unsigned`.
    unsafe { ctl(c"arenas.create", Some(&mut ind), Some(&mut h))? };
    Ok(ind)
}

/// Turns off time-based purging of the arena (dirty and muzzy pages are kept for reuse; the
/// purge hooks would refuse anyway) and caps the geometric growth of its extents at
/// `grow_limit` bytes.
pub(crate) fn configure_arena(arena: c_uint, grow_limit: usize) -> Result<(), CtlError> {
    ctl_dyn_ssize(format!("arena.{arena}.dirty_decay_ms"), -1)?;
    ctl_dyn_ssize(format!("arena.{arena}.muzzy_decay_ms"), -1)?;
    ctl_dyn_size(format!("arena.{arena}.retain_grow_limit"), grow_limit)
}

/// Destroys an arena made by [`create_arena`]: discards its allocations and calls the destroy
/// hook on its retained extents. Fails (EFAULT) while threads are bound to it.
///
/// # Safety
/// No allocation of the arena may be used afterwards, and no explicit thread cache may still
/// hold any of its memory (destroy them first).
pub(crate) unsafe fn destroy_arena(arena: c_uint) -> Result<(), CtlError> {
    let name = std::ffi::CString::new(format!("arena.{arena}.destroy")).expect("no NUL");
    // The caller discharged the use-after-destroy obligations above.
    // SAFETY: `arena.<i>.destroy` takes no values (all pointers null).
    let rc = unsafe {
        sys::mallctl(name.as_ptr(), ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), 0)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(CtlError { name: "arena.<i>.destroy", errno: rc })
    }
}

/// Creates an explicit thread cache (`tcache.create`).
pub(crate) fn create_tcache() -> Result<c_uint, CtlError> {
    let mut ind: c_uint = 0;
    // SAFETY: `tcache.create` returns an `unsigned` and takes no new value.
    unsafe { ctl::<c_uint, ()>(c"tcache.create", Some(&mut ind), None)? };
    Ok(ind)
}

/// Flushes and destroys an explicit thread cache (`tcache.destroy`).
///
/// # Safety
/// No thread may use `tc` concurrently or afterwards.
pub(crate) unsafe fn destroy_tcache(tc: c_uint) -> Result<(), CtlError> {
    let mut v = tc;
    // SAFETY: `tcache.destroy` takes an `unsigned`; the caller owns `tc` exclusively.
    unsafe { ctl::<(), c_uint>(c"tcache.destroy", None, Some(&mut v)) }
}

/// `mallocx` flags for an allocation from `arena` through explicit cache `tcache` (or no
/// cache at all).
pub(crate) fn flags(arena: c_uint, tcache: Option<c_uint>) -> c_int {
    let t = match tcache {
        Some(tc) => sys::MALLOCX_TCACHE(tc as usize),
        None => sys::MALLOCX_TCACHE_NONE,
    };
    sys::MALLOCX_ARENA(arena as usize) | t
}

/// `mallocx(size, flags)`; `None` when jemalloc (i.e. our extent hook) has no memory.
/// `size` must be non-zero.
pub(crate) fn mallocx(size: usize, flags: c_int) -> Option<NonNull<u8>> {
    debug_assert!(size > 0);
    // `flags` names an arena and a tcache this crate created and has not destroyed.
    // SAFETY: `size` is non-zero, mallocx's only precondition; the pool outlives the call.
    NonNull::new(unsafe { sys::mallocx(size, flags) }.cast())
}

/// `sdallocx(ptr, size, flags)`.
///
/// # Safety
/// `ptr` came from [`mallocx`] with a request of `size` bytes and is not used afterwards;
/// `flags`' tcache is owned by the calling thread (or none).
pub(crate) unsafe fn sdallocx(ptr: NonNull<u8>, size: usize, flags: c_int) {
    // SAFETY: forwarded from the caller.
    unsafe { sys::sdallocx(ptr.as_ptr().cast(), size, flags) }
}

/// `dallocx(ptr, flags)`.
///
/// # Safety
/// As [`sdallocx`], without the size.
pub(crate) unsafe fn dallocx(ptr: NonNull<u8>, flags: c_int) {
    // SAFETY: forwarded from the caller.
    unsafe { sys::dallocx(ptr.as_ptr().cast(), flags) }
}

/// The usable size jemalloc gives a request of `size` bytes (its size class).
pub(crate) fn nallocx(size: usize) -> usize {
    // SAFETY: nallocx has no preconditions besides a non-zero size; it touches no memory.
    unsafe { sys::nallocx(size.max(1), 0) }
}

/// The usable size of a live allocation.
///
/// # Safety
/// `ptr` is a live allocation from [`mallocx`].
pub(crate) unsafe fn sallocx(ptr: NonNull<u8>) -> usize {
    // SAFETY: forwarded from the caller.
    unsafe { sys::sallocx(ptr.as_ptr().cast(), 0) }
}
