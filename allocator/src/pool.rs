//! The pool: jemalloc arenas (one per CPU by default) over one registered
//! [`Space`](crate::region), explicit thread caches per (pool, thread), and the allocation API.

use std::cell::RefCell;
use std::ffi::c_uint;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bex_rnic::verbs::MrKeys;
use bex_rnic::Registrar;
use parking_lot::Mutex;

use crate::buf::RegisteredBuf;
use crate::error::{AllocError, PoolError};
use crate::je;
use crate::region::{Block, GrowFailure, Space};
use crate::stats::Stats;

/// Most devices one pool registers its blocks with.
pub const MAX_DEVICES: usize = 8;

/// How a pool is laid out. The defaults suit a server; tests shrink `reserve_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Address space reserved at creation (nothing is committed until used): the most memory
    /// the pool can ever hold, and the largest single allocation. Rounded up to a granule.
    pub reserve_bytes: usize,
    /// Resolution of the block table and alignment of every block: a power of two ≥ 4 KiB.
    /// jemalloc's block sizes (2, 2.5, 3, 3.5, 4, 5 … MiB) are multiples of 512 KiB, so the
    /// default wastes no registered bytes on rounding.
    pub granule_bytes: usize,
    /// Largest block jemalloc asks for when it grows (it grows geometrically from 2 MiB):
    /// bounds the registered memory beyond what is live. Requests larger than this get a
    /// block of their own size.
    pub max_block_bytes: usize,
    /// jemalloc arenas over the pool's memory; threads are spread over them round-robin
    /// (large allocations, above jemalloc's 32 KiB thread-cache limit, take an arena lock,
    /// so one arena for all threads contends). 0 means one per CPU.
    pub arenas: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            reserve_bytes: 64 << 30,
            granule_bytes: 512 << 10,
            max_block_bytes: 64 << 20,
            arenas: 0,
        }
    }
}

/// Allocation counters of one thread for one pool: written only by that thread (plain
/// load + store), read by [`Pool::stats`].
#[derive(Debug, Default)]
struct ThreadCounts {
    allocs: AtomicU64,
    frees: AtomicU64,
    alloc_bytes: AtomicU64,
    free_bytes: AtomicU64,
}

impl ThreadCounts {
    #[inline]
    fn bump(c: &AtomicU64, by: u64) {
        // Single writer: no read-modify-write needed.
        c.store(c.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
    }
}

/// One thread's explicit jemalloc cache for one pool.
#[derive(Debug)]
struct ThreadSlot {
    tcache: c_uint,
    counts: ThreadCounts,
}

/// Totals folded in from threads that have exited.
#[derive(Debug, Default, Clone, Copy)]
struct Retired {
    allocs: u64,
    frees: u64,
    alloc_bytes: u64,
    free_bytes: u64,
}

#[derive(Debug, Default)]
struct RegistryState {
    /// False once the pool is being dropped: exiting threads then leave their cache to it.
    alive: bool,
    slots: Vec<Arc<ThreadSlot>>,
    retired: Retired,
}

/// The thread caches of one pool; shared between the pool and the threads using it.
#[derive(Debug, Default)]
struct Registry {
    st: Mutex<RegistryState>,
}

impl Registry {
    /// A thread that used the pool exits: destroy its cache, keep its counts.
    fn release(&self, slot: &Arc<ThreadSlot>) {
        let mut st = self.st.lock();
        if !st.alive {
            return; // the pool's drop destroys every cache
        }
        st.slots.retain(|s| !Arc::ptr_eq(s, slot));
        let c = &slot.counts;
        st.retired.allocs += c.allocs.load(Ordering::Relaxed);
        st.retired.frees += c.frees.load(Ordering::Relaxed);
        st.retired.alloc_bytes += c.alloc_bytes.load(Ordering::Relaxed);
        st.retired.free_bytes += c.free_bytes.load(Ordering::Relaxed);
        // The exiting thread was the only user of this cache and is gone from the registry.
        // SAFETY: neither that thread nor the pool's drop uses this cache again.
        if let Err(e) = unsafe { je::destroy_tcache(slot.tcache) } {
            tracing::warn!("bemalloc: {e}");
        }
    }
}

/// A thread's entry for one pool in its thread-local list.
struct ThreadEntry {
    pool_id: u64,
    flags: std::ffi::c_int,
    slot: Arc<ThreadSlot>,
    registry: Arc<Registry>,
}

impl Drop for ThreadEntry {
    fn drop(&mut self) {
        self.registry.release(&self.slot);
    }
}

thread_local! {
    /// This thread's caches, one per pool it has used (usually one).
    static CACHES: RefCell<Vec<ThreadEntry>> = const { RefCell::new(Vec::new()) };
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// A pool of RDMA-registered memory (the paper's `RdmaMemoryPool`).
///
/// Every block the pool obtains is registered once with each of its devices, so every
/// allocation lies inside one memory region per device whose keys [`Pool::mr_of`] returns in
/// O(1). Allocation, thread caches and cross-thread frees are jemalloc's: dedicated arenas
/// (threads spread over them) and one explicit thread cache per (pool, thread), so thread
/// caches never mix registered and ordinary memory.
///
/// A process usually makes one pool at start-up and keeps it (see [`Pool::leak`] for a
/// `&'static` one, like the paper's static pool). Dropping a pool deregisters and unmaps
/// everything; the borrow checker ensures no [`RegisteredBuf`] outlives it.
pub struct Pool {
    id: u64,
    /// The pool's arenas (all over the same `space`, through the same hooks).
    arenas: Vec<c_uint>,
    /// Round-robin assignment of threads to arenas.
    next_arena: AtomicUsize,
    /// Boxed for a stable address: jemalloc holds a pointer to its hooks. Freed by `drop`
    /// only after the arena is destroyed; leaked if jemalloc refuses to destroy it.
    space: ManuallyDrop<Box<Space>>,
    registry: Arc<Registry>,
    max_alloc: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("id", &self.id)
            .field("arenas", &self.arenas)
            .field("space", &self.space)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool whose blocks are registered with each of `devices` (the soft RNIC's
    /// `SoftDevice::registrar`, verbs later), with the default [`PoolConfig`].
    pub fn new(devices: Vec<Arc<dyn Registrar>>) -> Result<Pool, PoolError> {
        Pool::with_config(devices, PoolConfig::default())
    }

    /// A pool with no devices: the same arena and hooks with registration left out (the
    /// benchmark's "raw base allocator", and a pool for tests without a NIC).
    pub fn unregistered(config: PoolConfig) -> Result<Pool, PoolError> {
        Pool::with_config(Vec::new(), config)
    }

    /// A pool registered with each of `devices`, laid out by `config`.
    pub fn with_config(
        devices: Vec<Arc<dyn Registrar>>,
        config: PoolConfig,
    ) -> Result<Pool, PoolError> {
        if devices.len() > MAX_DEVICES {
            return Err(PoolError::TooManyDevices { given: devices.len(), max: MAX_DEVICES });
        }
        let g = config.granule_bytes;
        if !g.is_power_of_two() || !(4096..=(1 << 30)).contains(&g) {
            return Err(PoolError::Config("granule_bytes must be a power of two in 4 KiB..1 GiB"));
        }
        let reserve = config
            .reserve_bytes
            .max(g)
            .checked_next_multiple_of(g)
            .ok_or(PoolError::Config("reserve_bytes too large"))?;
        if reserve / g > u32::MAX as usize - 1 {
            return Err(PoolError::Config("more than 2^32 granules; raise granule_bytes"));
        }
        let narenas = match config.arenas {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(256);
        let mut space = Space::reserve(reserve, g, devices).map_err(PoolError::Reserve)?;
        let mut arenas = Vec::with_capacity(narenas);
        for _ in 0..narenas {
            // The pool's drop destroys every arena before freeing `space` (or leaks it).
            // SAFETY: `space` is boxed and owned by the pool, so it outlives every arena.
            match unsafe { je::create_arena(space.hooks_ptr()) } {
                Ok(a) => arenas.push(a),
                Err(e) => {
                    // The hooks may have run (jemalloc allocates an arena's metadata through
                    // them) and an arena may half exist: keep everything.
                    let failure = space.last_failure.lock().take();
                    space.leak();
                    Box::leak(space);
                    return Err(match failure {
                        Some(f) => PoolError::Register(failure_to_error(f, 0)),
                        None => PoolError::Jemalloc(e.to_string()),
                    });
                }
            }
        }
        let registry = Arc::new(Registry::default());
        registry.st.lock().alive = true;
        let pool = Pool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            arenas,
            next_arena: AtomicUsize::new(0),
            space: ManuallyDrop::new(space),
            registry,
            max_alloc: reserve,
        };
        for &a in &pool.arenas {
            je::configure_arena(a, config.max_block_bytes.max(2 << 20))
                .map_err(|e| PoolError::Jemalloc(e.to_string()))?;
        }
        if let Some(f) = pool.space.last_failure.lock().take() {
            // jemalloc's metadata block could not be registered.
            return Err(PoolError::Register(failure_to_error(f, 0)));
        }
        Ok(pool)
    }

    /// Leaks the pool for a `&'static` handle (a process-wide pool, as in the paper).
    pub fn leak(self) -> &'static Pool {
        Box::leak(Box::new(self))
    }

    /// Number of devices every block is registered with.
    pub fn devices(&self) -> usize {
        self.space.devices()
    }

    /// The largest request [`Pool::allocate`] accepts.
    pub fn max_allocation(&self) -> usize {
        self.max_alloc
    }

    /// Runs `f` with this thread's mallocx flags and counters for this pool, creating its
    /// explicit cache on first use. During thread exit (the thread-local list is gone) `f`
    /// gets flags without a cache and no counters.
    #[inline]
    fn with_thread<R>(&self, f: impl FnOnce(std::ffi::c_int, Option<&ThreadCounts>) -> R) -> R {
        let mut f = Some(f);
        let r = CACHES.try_with(|c| {
            let mut list = c.borrow_mut();
            let i = match list.iter().position(|e| e.pool_id == self.id) {
                Some(i) => i,
                None => match self.new_thread_entry() {
                    Some(e) => {
                        // Drop entries of pools that are gone.
                        list.retain(|e| e.registry.st.lock().alive);
                        list.push(e);
                        list.len() - 1
                    }
                    None => {
                        let f = f.take().expect("called once");
                        return f(je::flags(self.arenas[0], None), None);
                    }
                },
            };
            let e = &list[i];
            let f = f.take().expect("called once");
            f(e.flags, Some(&e.slot.counts))
        });
        match r {
            Ok(r) => r,
            Err(_) => {
                let f = f.take().expect("try_with did not run the closure");
                f(je::flags(self.arenas[0], None), None)
            }
        }
    }

    /// Creates this thread's cache for this pool; `None` (use no cache) if jemalloc has no
    /// more explicit caches.
    fn new_thread_entry(&self) -> Option<ThreadEntry> {
        let tcache = match je::create_tcache() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("bemalloc: {e}; this thread allocates without a cache");
                return None;
            }
        };
        let slot = Arc::new(ThreadSlot { tcache, counts: ThreadCounts::default() });
        self.registry.st.lock().slots.push(slot.clone());
        let arena =
            self.arenas[self.next_arena.fetch_add(1, Ordering::Relaxed) % self.arenas.len()];
        Some(ThreadEntry {
            pool_id: self.id,
            flags: je::flags(arena, Some(tcache)),
            slot,
            registry: self.registry.clone(),
        })
    }

    /// Allocates `size` bytes of registered memory as an owned buffer that frees itself on
    /// drop, from any thread. `size` 0 gives an empty buffer (still inside a region).
    pub fn allocate(&self, size: usize) -> Result<RegisteredBuf<'_>, AllocError> {
        let ptr = self.allocate_raw(size)?;
        // SAFETY: `ptr` was just allocated from this pool with a request of `size` bytes.
        Ok(unsafe { RegisteredBuf::from_raw(self, ptr, size) })
    }

    /// Allocates `size` bytes of registered memory and returns its first byte; give it back
    /// with [`Pool::deallocate`] or [`Pool::deallocate_sized`].
    pub fn allocate_raw(&self, size: usize) -> Result<NonNull<u8>, AllocError> {
        if size > self.max_alloc {
            return Err(AllocError::TooLarge { requested: size, max: self.max_alloc });
        }
        let req = size.max(1);
        let got = self.with_thread(|flags, counts| {
            let p = je::mallocx(req, flags)?;
            if let Some(c) = counts {
                ThreadCounts::bump(&c.allocs, 1);
                ThreadCounts::bump(&c.alloc_bytes, je::nallocx(req) as u64);
            }
            Some(p)
        });
        got.ok_or_else(|| self.alloc_failure(size))
    }

    /// Why jemalloc returned no memory.
    #[cold]
    fn alloc_failure(&self, size: usize) -> AllocError {
        match self.space.last_failure.lock().take() {
            Some(f @ (GrowFailure::Register { .. } | GrowFailure::Commit(_))) => {
                AllocError::Register(failure_to_error(f, size))
            }
            _ => AllocError::OutOfMemory {
                requested: size,
                reserved: self.max_alloc,
                carved: self.space.carved(),
            },
        }
    }

    /// Frees an allocation of this pool, from any thread.
    ///
    /// # Safety
    /// `ptr` came from [`Pool::allocate_raw`] of this pool (or [`RegisteredBuf::into_raw`]),
    /// is not freed yet, and is not used afterwards.
    pub unsafe fn deallocate(&self, ptr: NonNull<u8>) {
        self.with_thread(|flags, counts| {
            if let Some(c) = counts {
                ThreadCounts::bump(&c.frees, 1);
                // SAFETY: the caller guarantees `ptr` is a live allocation of this pool.
                ThreadCounts::bump(&c.free_bytes, unsafe { je::sallocx(ptr) } as u64);
            }
            // SAFETY: as above; `flags` names this thread's own cache of this pool's arena.
            unsafe { je::dallocx(ptr, flags) }
        })
    }

    /// Frees an allocation of `size` requested bytes (faster than [`Pool::deallocate`]).
    ///
    /// # Safety
    /// As [`Pool::deallocate`], and `size` is the size it was requested with.
    pub unsafe fn deallocate_sized(&self, ptr: NonNull<u8>, size: usize) {
        let req = size.max(1);
        self.with_thread(|flags, counts| {
            if let Some(c) = counts {
                ThreadCounts::bump(&c.frees, 1);
                ThreadCounts::bump(&c.free_bytes, je::nallocx(req) as u64);
            }
            // `flags` names this thread's own cache of this pool's arena.
            // SAFETY: the caller guarantees `ptr` is a live allocation of this pool of `size`.
            unsafe { je::sdallocx(ptr, req, flags) }
        })
    }

    /// The memory region (keys and extent) holding `ptr` on device `device`, in O(1): a table
    /// index and three loads. `None` when `ptr` is not in this pool's blocks or `device` is out
    /// of range. The region is the whole block, so it covers any allocation containing `ptr`.
    #[inline]
    pub fn mr_of(&self, ptr: *const u8, device: usize) -> Option<MrKeys> {
        self.space.mr_of(ptr as usize, device)
    }

    /// The block holding `ptr` (its extent, without keys: also for unregistered pools).
    #[inline]
    pub fn block_of(&self, ptr: *const u8) -> Option<Block> {
        self.space.block_of(ptr as usize)
    }

    /// A snapshot of the pool's counters (exact for the block counters; the live-byte figures
    /// add per-thread counters read without stopping the threads).
    pub fn stats(&self) -> Stats {
        let c = &self.space.counters;
        let st = self.registry.st.lock();
        let mut t = st.retired;
        for s in &st.slots {
            t.allocs += s.counts.allocs.load(Ordering::Relaxed);
            t.frees += s.counts.frees.load(Ordering::Relaxed);
            t.alloc_bytes += s.counts.alloc_bytes.load(Ordering::Relaxed);
            t.free_bytes += s.counts.free_bytes.load(Ordering::Relaxed);
        }
        Stats {
            devices: self.space.devices(),
            reserved_bytes: self.max_alloc as u64,
            block_bytes: c.block_bytes.load(Ordering::Relaxed),
            carved_bytes: self.space.carved() as u64,
            registered_bytes: c.registered_bytes.load(Ordering::Relaxed),
            blocks: c.blocks.load(Ordering::Relaxed),
            registrations: c.registrations.load(Ordering::Relaxed),
            deregistrations: c.deregistrations.load(Ordering::Relaxed),
            registration_failures: c.registration_failures.load(Ordering::Relaxed),
            allocations: t.allocs,
            deallocations: t.frees,
            live_bytes: t.alloc_bytes.saturating_sub(t.free_bytes),
            thread_caches: st.slots.len(),
        }
    }
}

fn failure_to_error(f: GrowFailure, size: usize) -> crate::error::RegisterError {
    use crate::error::RegisterError;
    match f {
        GrowFailure::Register { device, error } => RegisterError::Device { device, error },
        GrowFailure::Commit(e) => RegisterError::Commit(e),
        GrowFailure::Exhausted => RegisterError::Commit(std::io::Error::other(format!(
            "reservation exhausted for {size} bytes"
        ))),
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // No buffer borrows the pool any more; raw allocations die with it.
        let slots = {
            let mut st = self.registry.st.lock();
            st.alive = false;
            std::mem::take(&mut st.slots)
        };
        for s in slots {
            // `alive = false` makes exiting threads leave their cache alone.
            // SAFETY: no thread can allocate from a pool being dropped: we own every cache.
            if let Err(e) = unsafe { je::destroy_tcache(s.tcache) } {
                tracing::warn!("bemalloc: {e}");
            }
        }
        let mut all_destroyed = true;
        for &a in &self.arenas {
            // No buffer outlives the pool (borrow); raw allocations are documented to die with it.
            // SAFETY: every explicit cache of the pool is destroyed above.
            if let Err(e) = unsafe { je::destroy_arena(a) } {
                tracing::warn!("bemalloc: {e}; the pool's memory stays mapped and registered");
                all_destroyed = false;
            }
        }
        if all_destroyed {
            self.space.release();
            // Every arena that pointed at the hooks inside `space` is destroyed.
            // SAFETY: so nothing uses `space` after this line.
            unsafe { ManuallyDrop::drop(&mut self.space) };
        }
        // Otherwise `space` stays allocated (ManuallyDrop): jemalloc may still call its hooks.
    }
}
