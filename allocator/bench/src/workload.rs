//! The Figure 4 workload: threads replacing random live blocks, with cross-thread frees.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::BenchAlloc;

/// Which size distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// 64 KiB–1 MiB, exponential falloff.
    Large,
    /// 16 B–16 KiB, linear falloff.
    Small,
}

impl Workload {
    /// Its name on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Large => "large",
            Workload::Small => "small",
        }
    }

    /// Parses [`Workload::name`].
    pub fn parse(s: &str) -> Option<Workload> {
        match s {
            "large" => Some(Workload::Large),
            "small" => Some(Workload::Small),
            _ => None,
        }
    }

    /// Live slots per thread.
    pub fn slots(self) -> usize {
        match self {
            Workload::Large => 64,
            Workload::Small => 4096,
        }
    }

    /// A size drawn from the distribution.
    pub fn size(self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.random();
        match self {
            Workload::Large => {
                // Truncated exponential on [64 KiB, 1 MiB], density ratio 100 between the ends.
                let (lo, hi) = (64.0 * 1024.0, 1024.0 * 1024.0);
                let lambda = 100f64.ln() / (hi - lo);
                let span = 1.0 - (-lambda * (hi - lo)).exp();
                (lo - (1.0 - u * span).ln() / lambda) as usize
            }
            Workload::Small => {
                // Density falling linearly to zero at 16 KiB: inverse CDF 1 - sqrt(1 - u).
                let (lo, hi) = (16.0, 16.0 * 1024.0);
                (lo + (hi - lo) * (1.0 - (1.0 - u).sqrt())) as usize
            }
        }
    }
}

/// Counts from one run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Allocations plus frees.
    pub ops: u64,
    /// Frees made by a thread other than the allocating one.
    pub cross_frees: u64,
    /// Hand-offs that found the peer's queue full and waited (draining their own queue).
    pub handoff_full: u64,
    /// Allocations that returned null.
    pub failures: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.ops += o.ops;
        self.cross_frees += o.cross_frees;
        self.handoff_full += o.handoff_full;
        self.failures += o.failures;
    }
}

/// The warm-up rendezvous: workers arrive, the coordinator reads the counters, then opens.
#[derive(Debug, Default)]
struct WarmGate {
    arrived: AtomicUsize,
    go: AtomicBool,
}

/// A batch of blocks handed to another thread to free: (address, size).
type Batch = Vec<(usize, usize)>;

const BATCH: usize = 16;
const QUEUE_BATCHES: usize = 4;
const PAGE: usize = 4096;

/// Writes one byte in every page of `[p, p + size)` (and the last byte).
fn touch(p: *mut u8, size: usize, v: u8) {
    let mut off = 0;
    while off < size {
        // SAFETY: `off < size` and `p` points to `size` writable bytes.
        unsafe { p.add(off).write_volatile(v) };
        off += PAGE;
    }
    // SAFETY: `size > 0`; the last byte is inside the allocation.
    unsafe { p.add(size - 1).write_volatile(v) };
}

struct Thread<'a, A: BenchAlloc> {
    alloc: &'a A,
    me: usize,
    threads: usize,
    rng: ChaCha8Rng,
    slots: Vec<(usize, usize)>,
    out: Vec<Batch>,
    peers: Vec<SyncSender<Batch>>,
    inbox: Receiver<Batch>,
    counts: Counts,
    workload: Workload,
}

impl<A: BenchAlloc> Thread<'_, A> {
    fn free_local(&mut self, p: usize, size: usize) {
        // SAFETY: `p` came from `alloc(size)` of this allocator and left its slot/batch.
        unsafe { self.alloc.free(p as *mut u8, size) };
        self.counts.ops += 1;
    }

    fn drain_inbox(&mut self) {
        while let Ok(batch) = self.inbox.try_recv() {
            for (p, s) in batch {
                self.free_local(p, s);
                self.counts.cross_frees += 1;
            }
        }
    }

    fn hand_off(&mut self, p: usize, size: usize) {
        let to = if self.threads == 1 {
            0
        } else {
            (self.me + 1 + self.rng.random_range(0..self.threads - 1)) % self.threads
        };
        self.out[to].push((p, size));
        if self.out[to].len() >= BATCH {
            self.flush(to);
        }
    }

    /// Sends the batch for `to`. The queue is bounded: while it is full this thread frees
    /// what others sent it (so two threads waiting on each other both progress) and yields.
    fn flush(&mut self, to: usize) {
        let mut batch = std::mem::replace(&mut self.out[to], Vec::with_capacity(BATCH));
        if batch.is_empty() {
            return;
        }
        let mut waited = false;
        loop {
            match self.peers[to].try_send(batch) {
                Ok(()) => return,
                Err(TrySendError::Full(b)) => {
                    batch = b;
                    if !waited {
                        self.counts.handoff_full += 1;
                        waited = true;
                    }
                    self.drain_inbox();
                    std::thread::yield_now();
                }
                Err(TrySendError::Disconnected(b)) => {
                    // The peer has finished: free here.
                    for (p, s) in b {
                        self.free_local(p, s);
                    }
                    return;
                }
            }
        }
    }

    fn step(&mut self) {
        let i = self.rng.random_range(0..self.slots.len());
        let (old, old_size) = self.slots[i];
        if old != 0 {
            if self.rng.random_ratio(1, 10) {
                self.hand_off(old, old_size);
            } else {
                self.free_local(old, old_size);
            }
        }
        let size = self.workload.size(&mut self.rng);
        let p = self.alloc.alloc(size);
        self.counts.ops += 1;
        if p.is_null() {
            self.counts.failures += 1;
            self.slots[i] = (0, 0);
            return;
        }
        touch(p, size, self.me as u8);
        self.slots[i] = (p as usize, size);
    }

    /// Fills every slot (the live set's initial size), so the warm-up that follows reaches
    /// the steady state.
    fn fill(&mut self) {
        for i in 0..self.slots.len() {
            let size = self.workload.size(&mut self.rng);
            let p = self.alloc.alloc(size);
            self.counts.ops += 1;
            if p.is_null() {
                self.counts.failures += 1;
                continue;
            }
            touch(p, size, self.me as u8);
            self.slots[i] = (p as usize, size);
        }
    }

    fn run(&mut self, steps: usize) {
        for n in 0..steps {
            self.step();
            if n % 64 == 0 {
                self.drain_inbox();
            }
        }
    }

    /// Waits at the warm-up point, freeing incoming blocks meanwhile (a blocking barrier
    /// could deadlock with a peer waiting for room in this thread's queue).
    fn wait_warm(&mut self, warm: &WarmGate) {
        warm.arrived.fetch_add(1, Ordering::AcqRel);
        while !warm.go.load(Ordering::Acquire) {
            self.drain_inbox();
            std::thread::yield_now();
        }
    }

    fn finish(mut self) -> Counts {
        for to in 0..self.threads {
            self.flush(to);
        }
        for (p, s) in std::mem::take(&mut self.slots) {
            if p != 0 {
                self.free_local(p, s);
            }
        }
        self.peers.clear();
        // Every other thread drops its senders when it gets here: then the inbox ends.
        while let Ok(batch) = self.inbox.recv() {
            for (p, s) in batch {
                self.free_local(p, s);
                self.counts.cross_frees += 1;
            }
        }
        self.counts
    }
}

/// Runs `steps` replacement steps on each of `threads` threads after filling their slots
/// (the fill and a third of the steps are the warm-up; then `at_warm` runs on the calling
/// thread while the workers wait; then the rest).
pub fn run<A: BenchAlloc>(
    alloc: &A,
    workload: Workload,
    threads: usize,
    steps: usize,
    seed: u64,
    at_warm: impl FnOnce(),
) -> Counts {
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| sync_channel::<Batch>(QUEUE_BATCHES)).unzip();
    let gate = WarmGate::default();
    let warm = steps / 3;
    let mut total = Counts::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = rxs
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| {
                let peers = txs.clone();
                let gate = &gate;
                s.spawn(move || {
                    let mut t = Thread {
                        alloc,
                        me,
                        threads,
                        rng: ChaCha8Rng::seed_from_u64(seed ^ ((me as u64 + 1) * 0x9e37_79b9)),
                        slots: vec![(0, 0); workload.slots()],
                        out: (0..threads).map(|_| Vec::with_capacity(BATCH)).collect(),
                        peers,
                        inbox,
                        counts: Counts::default(),
                        workload,
                    };
                    t.fill();
                    t.run(warm);
                    t.wait_warm(gate);
                    t.run(steps - warm);
                    t.finish()
                })
            })
            .collect();
        drop(txs);
        while gate.arrived.load(Ordering::Acquire) < threads {
            std::thread::yield_now();
        }
        at_warm();
        gate.go.store(true, Ordering::Release);
        for h in handles {
            total += h.join().expect("bench thread panicked");
        }
    });
    total
}
