//! The registration discipline: every allocation lies inside exactly one registered block per
//! device, `mr_of` agrees for its first and last byte, blocks are registered exactly once and
//! deregistered only when the pool goes.

mod common;

use std::sync::Arc;

use bemalloc::{AllocError, Pool, PoolConfig, PoolError, RegisterError};
use common::Recorder;
use rand::{Rng, SeedableRng};

fn small_config(reserve: usize) -> PoolConfig {
    PoolConfig { reserve_bytes: reserve, ..PoolConfig::default() }
}

/// Asserts `[p, p + len)` lies in exactly one registration of `rec` and that `mr_of` names it
/// for the first and the last byte.
fn check_inside(pool: &Pool, recs: &[Arc<Recorder>], p: *const u8, len: usize) {
    let len = len.max(1);
    for (d, rec) in recs.iter().enumerate() {
        let first = pool.mr_of(p, d).expect("first byte in a region");
        let last = pool.mr_of(p.wrapping_add(len - 1), d).expect("last byte in a region");
        assert_eq!(first, last, "first and last byte in one region");
        assert!(first.covers(p as u64, len as u64), "{first:?} covers {p:?}+{len}");
        let live = rec.live.lock();
        let holders: Vec<_> = live
            .values()
            .filter(|k| k.addr < p as u64 + len as u64 && (p as u64) < k.addr + k.len)
            .collect();
        assert_eq!(holders.len(), 1, "exactly one registration overlaps {p:?}+{len}");
        assert_eq!(*holders[0], first, "mr_of names the registration the device made");
    }
}

#[test]
fn every_allocation_lies_inside_exactly_one_region_on_every_device() {
    let recs = [Arc::new(Recorder::with_salt(0)), Arc::new(Recorder::with_salt(0xabcd_0000))];
    let devs: Vec<Arc<dyn bex_rnic::Registrar>> = recs.iter().map(|r| r.clone() as _).collect();
    let pool = Pool::with_config(devs, small_config(4 << 30)).unwrap();
    assert_eq!(pool.devices(), 2);
    let seed = 0x5eed_0001;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut live = Vec::new();
    for i in 0..4000 {
        let size = match i % 4 {
            0 => rng.random_range(1..=64),
            1 => rng.random_range(1..=16 << 10),
            2 => rng.random_range(16 << 10..=1 << 20),
            _ => rng.random_range(0..=3 << 20),
        };
        let mut b = pool.allocate(size).unwrap();
        if size > 0 {
            b[0] = 1;
            b[size - 1] = 2;
        }
        check_inside(&pool, &recs, b.as_ptr(), size);
        live.push(b);
        if rng.random_bool(0.4) {
            let j = rng.random_range(0..live.len());
            live.swap_remove(j);
        }
    }
    // Larger than the biggest block jemalloc grows by: a block of its own.
    let big = pool.allocate(200 << 20).unwrap();
    check_inside(&pool, &recs, big.as_ptr(), 200 << 20);
    // Keys differ per device and come from that device.
    let (k0, k1) = (big.mr(0), big.mr(1));
    assert_eq!((k0.addr, k0.len), (k1.addr, k1.len));
    assert_ne!(k0.lkey, k1.lkey);
    drop(big);
    drop(live);

    let s = pool.stats();
    assert_eq!(s.registrations, 2 * s.blocks, "each block once per device: {s:?}");
    assert_eq!(s.deregistrations, 0, "nothing deregistered while the pool lives");
    assert_eq!(s.registered_bytes, s.block_bytes);
    assert_eq!(s.live_bytes, 0, "{s:?}");
    for r in &recs {
        assert_eq!(r.registered.load(std::sync::atomic::Ordering::SeqCst) as u64, s.blocks);
    }
    drop(pool);
    for r in &recs {
        assert!(r.live.lock().is_empty(), "dropping the pool deregisters every block");
    }
}

#[test]
fn mr_of_is_none_outside_the_pool_and_for_unknown_devices() {
    let rec = Arc::new(Recorder::default());
    let pool = Pool::with_config(vec![rec.clone()], small_config(256 << 20)).unwrap();
    let b = pool.allocate(100).unwrap();
    assert!(pool.mr_of(b.as_ptr(), 0).is_some());
    assert!(pool.mr_of(b.as_ptr(), 1).is_none());
    let outside = Box::new([0u8; 16]); // on the global heap, not in the pool
    assert!(pool.mr_of(outside.as_ptr(), 0).is_none());
    assert!(pool.mr_of(std::ptr::null(), 0).is_none());
    assert!(pool.block_of(b.as_ptr()).is_some());
    let sge = b.sge(0, 10, 20);
    assert_eq!(sge.addr, b.as_ptr() as u64 + 10);
    assert_eq!(sge.lkey, b.mr(0).lkey);
}

#[test]
fn over_size_requests_fail_cleanly() {
    let pool = Pool::unregistered(small_config(64 << 20)).unwrap();
    match pool.allocate(65 << 20) {
        Err(AllocError::TooLarge { requested, max }) => {
            assert_eq!(requested, 65 << 20);
            assert_eq!(max, 64 << 20);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(matches!(pool.allocate(usize::MAX), Err(AllocError::TooLarge { .. })));
    assert!(matches!(pool.allocate_raw(usize::MAX / 2), Err(AllocError::TooLarge { .. })));
    // The pool still works.
    let b = pool.allocate(1000).unwrap();
    assert_eq!(b.len(), 1000);
}

#[test]
fn out_of_memory_is_an_error_and_freeing_recovers() {
    let rec = Arc::new(Recorder::default());
    let pool = Pool::with_config(vec![rec.clone()], small_config(64 << 20)).unwrap();
    let mut held = Vec::new();
    let err = loop {
        match pool.allocate(1 << 20) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 64, "a 64 MiB pool cannot hold 64 MiB of 1 MiB buffers");
    };
    assert!(
        matches!(err, AllocError::OutOfMemory { requested, .. } if requested == 1 << 20),
        "{err}"
    );
    assert!(held.len() >= 40, "most of the reservation is usable: {}", held.len());
    // Small requests may still fit in what is left; a failure is still just an error.
    held.truncate(held.len() / 2);
    let again = pool.allocate(1 << 20).expect("freed memory is reused");
    drop(again);
    drop(held);
    assert_eq!(pool.stats().live_bytes, 0);
}

#[test]
fn a_refused_registration_is_an_error_not_an_abort() {
    // The device refuses everything: even the arena's first (metadata) block.
    let refuse_all = Arc::new(Recorder::failing_from(0));
    match Pool::with_config(vec![refuse_all], small_config(64 << 20)) {
        Err(PoolError::Register(RegisterError::Device { device: 0, .. })) => {}
        other => panic!("expected a registration error, got {other:?}"),
    }
    // The second device refuses from its 3rd block on: the first is undone on the other.
    let ok = Arc::new(Recorder::default());
    let picky = Arc::new(Recorder::failing_from(2));
    let pool = Pool::with_config(vec![ok.clone(), picky.clone()], small_config(1 << 30)).unwrap();
    let mut held = Vec::new();
    let err = loop {
        match pool.allocate(1 << 20) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, AllocError::Register(RegisterError::Device { device: 1, .. })), "{err}");
    let s = pool.stats();
    // jemalloc retries a failed grow with the exact size, so one refusal may count twice.
    assert!(s.registration_failures >= 1, "{s:?}");
    assert_eq!(ok.live.lock().len(), picky.live.lock().len(), "no half-registered block");
    for b in &held {
        check_inside(&pool, &[ok.clone(), picky.clone()], b.as_ptr(), b.len());
    }
}

#[test]
fn registrations_stop_growing_in_steady_state() {
    let rec = Arc::new(Recorder::default());
    let pool = Pool::with_config(vec![rec.clone()], PoolConfig::default()).unwrap();
    let round = |seed: u64| {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut live: Vec<Option<bemalloc::RegisteredBuf<'_>>> = (0..512).map(|_| None).collect();
        for _ in 0..20_000 {
            let i = rng.random_range(0..live.len());
            let size = if rng.random_bool(0.2) {
                rng.random_range(64 << 10..=1 << 20)
            } else {
                rng.random_range(16..=16 << 10)
            };
            live[i] = Some(pool.allocate(size).unwrap());
        }
    };
    for s in 0..3 {
        round(s); // warm-up
    }
    let warm = pool.stats();
    for s in 3..10 {
        round(s);
    }
    let after = pool.stats();
    assert_eq!(after.registrations, warm.registrations, "no new registration after warm-up");
    assert_eq!(after.registered_bytes, warm.registered_bytes);
    assert!(after.allocations > warm.allocations);
}

#[test]
fn thread_exit_returns_the_thread_cache() {
    let pool = Arc::new(Pool::unregistered(small_config(1 << 30)).unwrap());
    let base = pool.stats().thread_caches;
    for _ in 0..50 {
        let pool = pool.clone();
        // `join` (unlike a scope's end) waits for the thread's TLS destructors.
        std::thread::spawn(move || {
            let b = pool.allocate(100).unwrap();
            drop(b);
        })
        .join()
        .unwrap();
    }
    let st = pool.stats();
    assert_eq!(st.thread_caches, base, "exited threads destroyed their caches");
    assert_eq!(st.allocations, 50);
    assert_eq!(st.deallocations, 50);
}

#[test]
fn raw_allocation_round_trips() {
    let pool = Pool::unregistered(small_config(1 << 30)).unwrap();
    let p = pool.allocate_raw(300).unwrap();
    // SAFETY: `p` is a fresh allocation of 300 bytes from `pool`.
    unsafe {
        p.as_ptr().write_bytes(9, 300);
        pool.deallocate(p);
    }
    let b = pool.allocate(77).unwrap();
    let (p, len) = b.into_raw();
    // SAFETY: `p` came from `into_raw` of a buffer of `pool`, with its length.
    let b = unsafe { bemalloc::RegisteredBuf::from_raw(&pool, p, len) };
    assert_eq!(b.len(), 77);
    let (p, len) = b.into_raw();
    // SAFETY: as above; freed once.
    unsafe { pool.deallocate_sized(p, len) };
    assert_eq!(pool.stats().live_bytes, 0);
}

#[test]
fn many_pools_can_be_made_and_dropped() {
    for _ in 0..20 {
        let rec = Arc::new(Recorder::default());
        let pool = Pool::with_config(vec![rec.clone()], small_config(256 << 20)).unwrap();
        let b = pool.allocate(5000).unwrap();
        drop(b);
        drop(pool);
        assert!(rec.live.lock().is_empty());
        assert_eq!(
            rec.registered.load(std::sync::atomic::Ordering::SeqCst),
            rec.deregistered.load(std::sync::atomic::Ordering::SeqCst)
        );
    }
}
