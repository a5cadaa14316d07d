//! bemalloc: RDMA-registered memory from a real allocator (the paper's §5.2).
//!
//! Applications and the transport share registered buffers so messages move without copies.
//! A [`Pool`] is made with one or more devices (each a [`bex_rnic::Registrar`]: the software
//! RNIC now, verbs later); [`Pool::allocate`] returns a [`RegisteredBuf`] that is `Send`,
//! dereferences to `[u8]` and frees itself on drop from any thread; [`Pool::mr_of`] gives the
//! lkey/rkey/extent of any pointer into the pool in O(1); [`Pool::allocate_raw`] and
//! [`Pool::deallocate`] are the raw form of the paper's Figure 3. Failures are values
//! ([`AllocError`]), never aborts.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use bex_rnic::{Device, soft::{Fabric, LinkModel, NicConfig}};
//! let fabric = Fabric::new(1, LinkModel::default());
//! let dev = fabric.add_device(NicConfig::default());
//! let pd = dev.alloc_pd()?;
//! let pool = bemalloc::Pool::new(vec![Arc::new(dev.registrar(&pd))])?;
//! let mut buf = pool.allocate(4096)?;
//! buf[0] = 7;
//! let mr = pool.mr_of(buf.as_ptr(), 0).expect("in the pool");
//! assert!(mr.covers(buf.as_ptr() as u64, 4096));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design
//!
//! The base allocator is jemalloc 5.3 (`tikv-jemalloc-sys`, maintained), not hand-rolled size
//! classes. Each pool owns:
//!
//! - a **reservation** of address space (default 64 GiB, `PROT_NONE`, nothing committed) and
//!   a flat **block table** with one entry per granule (default 512 KiB) of it
//!   (`region.rs`);
//! - dedicated jemalloc **arenas** (`arenas.create`; one per CPU by default, threads assigned
//!   round-robin, since allocations above jemalloc's 32 KiB thread-cache limit take an arena
//!   lock) whose custom extent hooks (one set, shared) carve blocks from the reservation. The `alloc` hook is the only place a block is made: it commits it
//!   and registers it once with every device, then publishes it in the table. `dalloc`,
//!   `decommit`, `purge_lazy` and `purge_forced` are absent, so jemalloc keeps every extent
//!   mapped, committed and registered and reuses it; time-based decay is off for the arenas.
//!   `split` is allowed; `merge` is refused unless both extents lie in one block, so no
//!   allocation straddles two registrations. Hooks are a table load or two.
//! - one **explicit thread cache** per (pool, thread) (`tcache.create`), used with
//!   `MALLOCX_ARENA | MALLOCX_TCACHE`: jemalloc's implicit cache is keyed by size class, not
//!   arena, and would mix registered and ordinary memory. A thread's cache is destroyed when
//!   the thread exits; the pool destroys the rest when dropped.
//!
//! Blocks grow geometrically as jemalloc asks (2, 2.5, 3 … MiB, capped at
//! [`PoolConfig::max_block_bytes`]), so registrations are few and stop once the pool reaches
//! its working size; nothing is deregistered until the pool is dropped (then all at once,
//! after the arenas are destroyed). Where jemalloc refuses to destroy an arena, the pool's
//! memory is leaked rather than unmapped under it.
//!
//! Deviations from the lead's sketch, with reasons: the granule is 512 KiB rather than 4 MiB
//! because jemalloc's block sizes are multiples of 512 KiB (4 MiB granules would register up
//! to 60 % more than jemalloc uses); buffers borrow the pool (`RegisteredBuf<'p>`) instead of
//! holding an `Arc`, because a shared reference count would be a contended atomic on every
//! allocation and free; a process-wide pool is `Pool::leak`'s `&'static Pool`.
//!
//! # Observability
//!
//! [`Pool::stats`] returns a [`Stats`] snapshot: registered bytes, blocks, registrations and
//! deregistrations, live bytes and allocation counts (per-thread counters, summed).
//!
//! # Limits
//!
//! jemalloc allows at most 4095 arenas and 4095 explicit thread caches per process, so pools
//! × live threads using them is bounded. Memory of a pool is never returned to the OS while
//! the pool lives: its footprint is its high-water mark, by design (registered memory must not
//! be madvised).

mod buf;
mod error;
mod je;
mod pool;
mod region;
mod stats;

pub use buf::RegisteredBuf;
pub use error::{AllocError, PoolError, RegisterError};
pub use pool::{Pool, PoolConfig, MAX_DEVICES};
pub use region::Block;
pub use stats::Stats;
