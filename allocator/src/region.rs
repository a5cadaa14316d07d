//! The registered address space of one pool and jemalloc's extent hooks over it.
//!
//! At pool creation one large range of virtual memory is reserved (`PROT_NONE`, nothing
//! committed). jemalloc's extent `alloc` hook carves blocks from it in whole, aligned
//! granules, makes them read/write and registers each block once with every device. A flat
//! table with one entry per granule names the block a granule belongs to, so `mr_of` is an
//! index computation and three loads, and the `merge` hook is two loads. Blocks are never
//! unmapped, decommitted, purged or deregistered while the pool lives: `dalloc`, `decommit`
//! and both `purge` hooks are absent (jemalloc then keeps the extent mapped and reuses it), and
//! `merge` refuses to join extents of two blocks, so no allocation ever straddles two
//! registrations. Everything is released at once when the pool is dropped.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use bex_rnic::verbs::MrKeys;
use bex_rnic::Registrar;
use parking_lot::Mutex;

use crate::je::extent_hooks_t;

/// Why the last block could not be obtained (read by the allocation that got no memory).
#[derive(Debug)]
pub(crate) enum GrowFailure {
    /// The reservation is used up.
    Exhausted,
    /// `mprotect` refused to make the block writable.
    Commit(std::io::Error),
    /// Device `device` refused the registration.
    Register { device: usize, error: bex_rnic::Error },
}

/// Counters written only on the (rare) block path.
#[derive(Debug, Default)]
pub(crate) struct BlockCounters {
    pub(crate) registered_bytes: AtomicU64,
    pub(crate) block_bytes: AtomicU64,
    pub(crate) blocks: AtomicU64,
    pub(crate) registrations: AtomicU64,
    pub(crate) deregistrations: AtomicU64,
    pub(crate) registration_failures: AtomicU64,
}

/// The bump pointer over the reservation.
#[derive(Debug)]
struct Carver {
    /// Offset of the first unused byte of the reservation.
    next: usize,
}

/// What the extent hooks see. `repr(C)` with `hooks` first: jemalloc hands the hooks pointer
/// back to every hook, and the hook casts it to the `Space` that contains it.
#[repr(C)]
pub(crate) struct Space {
    hooks: extent_hooks_t,
    /// First byte of the reservation (granule-aligned).
    pub(crate) base: usize,
    /// Bytes reserved.
    pub(crate) len: usize,
    /// log2 of the granule size.
    pub(crate) shift: u32,
    /// Per granule: 0 when unused, else 1 + the index of the first granule of its block.
    heads: Box<[AtomicU32]>,
    /// Per first granule of a block: the block's length in granules.
    block_granules: Box<[AtomicU32]>,
    /// Per first granule and device (`head * devices + d`): `lkey | rkey << 32`.
    keys: Box<[AtomicU64]>,
    pub(crate) registrars: Vec<Arc<dyn Registrar>>,
    carver: Mutex<Carver>,
    pub(crate) counters: BlockCounters,
    pub(crate) last_failure: Mutex<Option<GrowFailure>>,
    /// The mapping to unmap on drop, or `None` once leaked.
    mapping: Option<(usize, usize)>,
}

impl std::fmt::Debug for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Space")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("granule", &(1usize << self.shift))
            .field("devices", &self.registrars.len())
            .finish_non_exhaustive()
    }
}

/// The block a pointer lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// First byte of the block.
    pub addr: usize,
    /// Its length in bytes.
    pub len: usize,
}

impl Space {
    /// Reserves `len` bytes (a multiple of `granule`, a power of two ≥ the page size) of
    /// address space, committing none of it.
    pub(crate) fn reserve(
        len: usize,
        granule: usize,
        registrars: Vec<Arc<dyn Registrar>>,
    ) -> std::io::Result<Box<Space>> {
        debug_assert!(granule.is_power_of_two() && len % granule == 0 && len > 0);
        // Over-reserve by one granule so the base can be aligned to it.
        let map_len = len + granule;
        // An anonymous PROT_NONE mapping at an address of the kernel's choosing; MAP_NORESERVE
        // commits no swap.
        // SAFETY: such a mapping touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = (raw as usize).next_multiple_of(granule);
        let granules = len / granule;
        let devices = registrars.len();
        let zeros32 = |n: usize| (0..n).map(|_| AtomicU32::new(0)).collect::<Box<[_]>>();
        Ok(Box::new(Space {
            hooks: extent_hooks_t {
                alloc: Some(hook_alloc),
                // Absent: jemalloc keeps the extent mapped (and registered) and reuses it.
                dalloc: None,
                // Called only when the arena is destroyed; the pool then releases everything.
                destroy: None,
                commit: Some(hook_commit),
                // Absent: registered memory is never decommitted or purged (madvised).
                decommit: None,
                purge_lazy: None,
                purge_forced: None,
                split: Some(hook_split),
                merge: Some(hook_merge),
            },
            base,
            len,
            shift: granule.trailing_zeros(),
            heads: zeros32(granules),
            block_granules: zeros32(granules),
            keys: (0..granules * devices).map(|_| AtomicU64::new(0)).collect(),
            registrars,
            carver: Mutex::new(Carver { next: 0 }),
            counters: BlockCounters::default(),
            last_failure: Mutex::new(None),
            mapping: Some((raw as usize, map_len)),
        }))
    }

    /// The pointer jemalloc gets as the arena's hooks.
    pub(crate) fn hooks_ptr(&mut self) -> *mut extent_hooks_t {
        &mut self.hooks
    }

    /// Number of devices every block is registered with.
    pub(crate) fn devices(&self) -> usize {
        self.registrars.len()
    }

    /// Bytes of the reservation handed out so far.
    pub(crate) fn carved(&self) -> usize {
        self.carver.lock().next
    }

    /// Index of the first granule of the block holding `addr`, or `None`.
    #[inline]
    fn head_of(&self, addr: usize) -> Option<usize> {
        let off = addr.wrapping_sub(self.base);
        if off >= self.len {
            return None;
        }
        let h = self.heads[off >> self.shift].load(Ordering::Acquire);
        (h != 0).then(|| h as usize - 1)
    }

    /// The block holding `addr`.
    #[inline]
    pub(crate) fn block_of(&self, addr: usize) -> Option<Block> {
        let head = self.head_of(addr)?;
        let n = self.block_granules[head].load(Ordering::Relaxed) as usize;
        Some(Block { addr: self.base + (head << self.shift), len: n << self.shift })
    }

    /// The keys of the block holding `addr` on device `device`: O(1), three loads.
    #[inline]
    pub(crate) fn mr_of(&self, addr: usize, device: usize) -> Option<MrKeys> {
        if device >= self.registrars.len() {
            return None;
        }
        let head = self.head_of(addr)?;
        let n = self.block_granules[head].load(Ordering::Relaxed) as u64;
        let k = self.keys[head * self.registrars.len() + device].load(Ordering::Relaxed);
        Some(MrKeys {
            addr: (self.base + (head << self.shift)) as u64,
            len: n << self.shift,
            lkey: k as u32,
            rkey: (k >> 32) as u32,
        })
    }

    /// Carves, commits and registers a block of at least `size` bytes aligned to `alignment`.
    fn grow(&self, size: usize, alignment: usize) -> Result<*mut c_void, GrowFailure> {
        let granule = 1usize << self.shift;
        let align = alignment.max(granule);
        let len = size.checked_next_multiple_of(granule).ok_or(GrowFailure::Exhausted)?;
        let mut carver = self.carver.lock();
        // Align the absolute address (the base is only granule-aligned).
        let start = (self.base + carver.next)
            .checked_next_multiple_of(align)
            .ok_or(GrowFailure::Exhausted)?
            - self.base;
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(GrowFailure::Exhausted);
        }
        let addr = self.base + start;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // `[addr, addr + len)` lies inside our PROT_NONE reservation and was never handed out
        // (the bump pointer only moves forward).
        // SAFETY: so no one else uses that range.
        let rc = unsafe { libc::mprotect(addr as *mut c_void, len, rw) };
        if rc != 0 {
            return Err(GrowFailure::Commit(std::io::Error::last_os_error()));
        }
        let head = start >> self.shift;
        let devices = self.registrars.len();
        for (d, r) in self.registrars.iter().enumerate() {
            // The block stays mapped until the pool's drop has deregistered it from every
            // device (`Space::release`).
            // SAFETY: so the registered range outlives every registration of it.
            let res = unsafe { r.register(addr as *mut u8, len) };
            let keys = match res {
                Ok(k) if k.addr == addr as u64 && k.len == len as u64 => Ok(k),
                Ok(k) => {
                    let _ = r.deregister(k);
                    Err(bex_rnic::Error::InvalidArgument(format!(
                        "registrar returned extent {:#x}+{} for {addr:#x}+{len}",
                        k.addr, k.len
                    )))
                }
                Err(e) => Err(e),
            };
            match keys {
                Ok(k) => {
                    let packed = u64::from(k.lkey) | (u64::from(k.rkey) << 32);
                    self.keys[head * devices + d].store(packed, Ordering::Relaxed);
                    self.counters.registrations.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => {
                    // Undo: deregister from the devices before this one, recommit nothing.
                    for (d2, r2) in self.registrars.iter().enumerate().take(d) {
                        let k = self.keys[head * devices + d2].load(Ordering::Relaxed);
                        let keys = MrKeys {
                            addr: addr as u64,
                            len: len as u64,
                            lkey: k as u32,
                            rkey: (k >> 32) as u32,
                        };
                        if r2.deregister(keys).is_ok() {
                            self.counters.deregistrations.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    // The block was committed just above and never handed out.
                    // SAFETY: and it is registered with no device any more.
                    unsafe { libc::mprotect(addr as *mut c_void, len, libc::PROT_NONE) };
                    self.counters.registration_failures.fetch_add(1, Ordering::Relaxed);
                    return Err(GrowFailure::Register { device: d, error });
                }
            }
        }
        let n = len >> self.shift;
        self.block_granules[head].store(n as u32, Ordering::Relaxed);
        // Publish: a reader that sees a head also sees the keys and length stored above.
        for g in head..head + n {
            self.heads[g].store(head as u32 + 1, Ordering::Release);
        }
        carver.next = start + len;
        if devices > 0 {
            self.counters.registered_bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
        self.counters.block_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.counters.blocks.fetch_add(1, Ordering::Relaxed);
        Ok(addr as *mut c_void)
    }

    /// Deregisters every block from every device and unmaps the reservation. Call only after
    /// the arena is destroyed: no jemalloc structure refers to the memory any more.
    pub(crate) fn release(&mut self) {
        let devices = self.registrars.len();
        let carved_granules = self.carver.get_mut().next >> self.shift;
        let mut g = 0;
        while g < carved_granules {
            let h = self.heads[g].load(Ordering::Acquire);
            if h == 0 {
                g += 1; // an alignment gap between blocks
                continue;
            }
            let head = h as usize - 1;
            let n = self.block_granules[head].load(Ordering::Relaxed) as usize;
            let addr = self.base + (head << self.shift);
            for (d, r) in self.registrars.iter().enumerate() {
                let k = self.keys[head * devices + d].load(Ordering::Relaxed);
                let keys = MrKeys {
                    addr: addr as u64,
                    len: (n << self.shift) as u64,
                    lkey: k as u32,
                    rkey: (k >> 32) as u32,
                };
                match r.deregister(keys) {
                    Ok(()) => {
                        self.counters.deregistrations.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!(device = d, "bemalloc: deregistration failed: {e}"),
                }
            }
            if devices > 0 {
                self.counters
                    .registered_bytes
                    .fetch_sub((n << self.shift) as u64, Ordering::Relaxed);
            }
            g = head + n.max(1);
        }
        if let Some((raw, len)) = self.mapping.take() {
            // The mapping is ours; the arena that used it is destroyed and every registration
            // of it is gone.
            // SAFETY: so nothing refers to it any more.
            unsafe { libc::munmap(raw as *mut c_void, len) };
        }
    }

    /// Gives up on releasing: the memory stays mapped and registered for the life of the
    /// process (used when jemalloc refuses to destroy the arena).
    pub(crate) fn leak(&mut self) {
        self.mapping = None;
    }
}

/// Recovers the `Space` from the hooks pointer jemalloc passes back.
///
/// # Safety
/// `h` is the `hooks` field of a live `Space` (jemalloc only calls our hooks with the pointer
/// we registered, and the `Space` outlives the arena).
unsafe fn space<'a>(h: *mut extent_hooks_t) -> &'a Space {
    // `Space` is `repr(C)` with `hooks` as its first field, so the pointers coincide.
    // SAFETY: the cast is sound (above), and the caller guarantees the `Space` is live.
    unsafe { &*(h as *const Space) }
}

/// jemalloc asks for a new extent. Requests for a given address (in-place growth) are refused.
unsafe extern "C" fn hook_alloc(
    h: *mut extent_hooks_t,
    new_addr: *mut c_void,
    size: usize,
    alignment: usize,
    zero: *mut bool,
    commit: *mut bool,
    _arena: c_uint,
) -> *mut c_void {
    if !new_addr.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: jemalloc calls this hook only on the arena we created with this pointer.
    let sp = unsafe { space(h) };
    // A registrar is foreign code: never unwind into jemalloc.
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sp.grow(size, alignment)));
    match res {
        Ok(Ok(p)) => {
            // SAFETY: jemalloc passes valid pointers to two bools.
            unsafe {
                // Fresh pages of the reservation: never touched, so zero; and read/write.
                *zero = true;
                *commit = true;
            }
            p
        }
        Ok(Err(f)) => {
            *sp.last_failure.lock() = Some(f);
            std::ptr::null_mut()
        }
        Err(_) => {
            *sp.last_failure.lock() = Some(GrowFailure::Register {
                device: usize::MAX,
                error: bex_rnic::Error::InvalidArgument("a registrar panicked".into()),
            });
            std::ptr::null_mut()
        }
    }
}

/// Blocks are always committed (read/write from carving to pool drop): nothing to do.
unsafe extern "C" fn hook_commit(
    _h: *mut extent_hooks_t,
    _addr: *mut c_void,
    _size: usize,
    _offset: usize,
    _length: usize,
    _arena: c_uint,
) -> bool {
    false
}

/// Splitting an extent keeps both halves inside its block: always allowed.
unsafe extern "C" fn hook_split(
    _h: *mut extent_hooks_t,
    _addr: *mut c_void,
    _size: usize,
    _size_a: usize,
    _size_b: usize,
    _committed: bool,
    _arena: c_uint,
) -> bool {
    false
}

/// Merging is allowed only inside one block (returns true = refuse otherwise).
unsafe extern "C" fn hook_merge(
    h: *mut extent_hooks_t,
    addr_a: *mut c_void,
    _size_a: usize,
    addr_b: *mut c_void,
    _size_b: usize,
    _committed: bool,
    _arena: c_uint,
) -> bool {
    // SAFETY: jemalloc calls this hook only on the arena we created with this pointer.
    let sp = unsafe { space(h) };
    match (sp.head_of(addr_a as usize), sp.head_of(addr_b as usize)) {
        (Some(a), Some(b)) => a != b,
        _ => true,
    }
}
