//! Named embedding tables: concurrent row storage with a deterministic initializer and a
//! server-side optimizer.
//!
//! # Storage
//!
//! A table is split into [`STRIPES`] stripes, each behind its own `parking_lot::RwLock`,
//! chosen by a hash of the key seeded by the table (SplitMix64; independent of the shard hash,
//! whose high bits are nearly constant within one shard). A stripe keeps its rows in one
//! slab: `data` holds a slot per row, the key's bits then `stride = dim · (1 + state_slots)`
//! f32 (values, then optimizer state); `steps` and `versions` run parallel to it, and an
//! index of row numbers alone (hashed by the slot's key) takes a key to its row number. A live row never moves, so its number is stable — which streaming
//! snapshots rely on: a bounded table (below) puts an evicted row's slot on a free list for
//! the next new row instead of compacting. Rows cost no allocation of their own. Compared
//! with one `dashmap` entry per row this keeps rows contiguous, allocates per slab growth
//! instead of per row, and a batch takes one lock per stripe its keys fall in (read lock
//! for fetches of existing rows, write lock for creation and updates), so lookups between
//! two lock operations overlap their cache misses.
//!
//! # Capacity
//!
//! With `capacity` set, each stripe keeps at most its share of `max_rows` (the stripe hash
//! is seeded by the table, so a stripe holds the same keys on every pod), ordered by
//! (version, key) (`Recency`: the least pairs, refilled by a scan of the slab). Versions are
//! push times (see below), so a new row displaces the least recently pushed, and a whole-row
//! copy older than everything a full stripe keeps is not stored: pods applying the same
//! copies in any order keep the same rows, with no deletion message. With `ttl_s`,
//! [`TableSet::expire`] drops rows last pushed `ttl_s` before the table's newest push
//! (capped near the wall clock).
//!
//! # Semantics
//!
//! - [`Table::fetch_into`] returns rows in key order; missing keys are created with the
//!   initializer ([`Table::read_into`] does not create them, returning the same values).
//! - Feature admission ([`TableSpec::admission`], [`crate::admission`]): a key gets a row
//!   only at its Nth push; before that fetches create nothing and its pushes are counted in
//!   the stripe's sketch and not applied. A whole-row copy of version 0 (a row never pushed)
//!   stores nothing at a replica either, so replicas hold only what the training pod does.
//! - [`Table::push`] validates everything first (lengths, finite gradients), then applies
//!   the optimizer per key in order (duplicate keys are applied once per occurrence; the
//!   fan-out planner sums them before sending). It can copy the resulting rows out for
//!   replication.
//! - [`Table::apply_replica_state_le`] stores the training pod's whole versioned rows
//!   (values, optimizer state, steps) over older ones, so replicas converge to the same bits
//!   whatever order copies arrive in.
//! - A fetch concurrent with a push of the same key sees the row before or after the whole
//!   update of that key, never half of it.
//!
//! # Row versions
//!
//! Every row carries a version: 0 for a row never pushed (its initial values), and on each
//! push `max(version + 1, floor)`, where the floor ([`TableSet::raise_version_floor`]) is
//! set by each server incarnation above every version an earlier one can have written, and
//! before every push moved to the server's push clock (µs since the Unix epoch), or one
//! past itself while that clock is behind ([`Table::advance_version_floor`]): a row's
//! version is when it was last pushed, and pushes order by recency either way.
//! Whole-row copies (Replicate with state, snapshot chunks, checkpoints) carry the version,
//! and a copy is applied only over an older row ([`Table::apply_replica_state_le`],
//! [`Table::import_records`]): applying copies is idempotent and order-free, so a replica
//! fed by pushes' own replication, the backlog and a snapshot at once ends at the newest
//! row, and a restarted training shard merges its checkpoint with the replicas' rows.
//! Per-row counters, not one per shard: a row's version changes under the row's lock, so a
//! copy's version always names exactly the state copied (a shard counter taken before two
//! concurrent pushes are applied in the other order would not).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use bex_ps_proto::config::FieldError;
use bex_ps_proto::control::{TableInfo, TableStats};
use bex_ps_proto::init::Initializer;
use bex_ps_proto::optim::Optimizer;
use bex_ps_proto::spec::{TableSpec, STATE_EXTRA_WORDS};
use bex_ps_proto::wire::{LeF32s, LeU64s, Status};

use crate::admission::CountMin;
use crate::prefetch::prefetch;
use crate::row_index::{Probe, RowIndex};
use bex_ps_proto::shard::mix64;

/// How far a table's TTL clock (its newest row version) may run ahead of a pod's wall
/// clock ([`TableSet::expire`]): clocks of pods within this of each other expire alike,
/// and a copy from the future moves the clock no further.
pub const TTL_SKEW_ALLOWANCE_US: u64 = 600 * 1_000_000;

/// Stripes per table (lock granularity; snapshot cursors count in stripes).
pub const STRIPES: usize = 64;

/// Misuse of a table (or bad values from the network).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// An array's length disagrees with the keys and the dimension.
    #[error("{what}: expected {expected} values, got {got}")]
    WrongLength {
        /// Which array.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A gradient or row is NaN or infinite.
    #[error("non-finite value at index {index}")]
    NonFinite {
        /// Index in the value array.
        index: usize,
    },
    /// A whole-row copy's version is beyond any push time (corrupt or hostile: accepted,
    /// it would pin the row for good, since no later copy could be newer).
    #[error("row {index}: version {version} is above {MAX_VERSION}")]
    BadVersion {
        /// The row's index in the copy.
        index: usize,
        /// Its version.
        version: u64,
    },
    /// The table definitions are invalid.
    #[error("invalid table definitions: {0:?}")]
    Invalid(Vec<FieldError>),
    /// No table has this id.
    #[error("unknown table {0}")]
    UnknownTable(u32),
    /// A request's dimension differs from the table's.
    #[error("table {table} has dim {dim}, request has {got}")]
    WrongDim {
        /// Table id.
        table: u32,
        /// The table's dimension.
        dim: u32,
        /// The request's dimension.
        got: u32,
    },
}

impl TableError {
    /// The response status a server answers this error with.
    pub fn status(&self) -> Status {
        match self {
            TableError::NonFinite { .. } | TableError::BadVersion { .. } => Status::BadValue,
            TableError::UnknownTable(_) => Status::UnknownTable,
            TableError::WrongDim { .. } => Status::WrongDim,
            TableError::WrongLength { .. } => Status::BadFrame,
            TableError::Invalid(_) => Status::BadControl,
        }
    }
}

#[derive(Debug)]
struct Stripe {
    /// Key → slot: the row numbers alone (the key is the slab's), 12 to a cache line.
    /// Rejected: `HashMap<u64, u32>`, 16 bytes a bucket (the key a second time, and
    /// padding), which made a dim-16 row cost 1.3-1.4x its payload; and hashbrown's
    /// `HashTable<u32>` (see [`RowIndex`]).
    index: RowIndex,
    steps: Vec<u32>,
    /// Per slot: the row's version, or [`FREE`] for a slot an evicted row left.
    versions: Vec<u64>,
    /// Per slot, `slot` words: the key's bits (low, high 32), then the values and
    /// optimizer state. The key sits with its row so a lookup's key check and the row
    /// share cache lines (a separate key array cost one more cache miss per key: a
    /// 1000-key fetch at 100M rows took 3x as long).
    data: Vec<f32>,
    /// f32 words per slot: 2 for the key, then the row's `stride`.
    slot: usize,
    /// Pushes of keys without a row, when admission is on.
    sketch: Option<CountMin>,
    /// Slots of evicted rows, taken before the slab grows (so live rows never move, and
    /// snapshot cursors and checkpoints, which go by slot, see every row once).
    free: Vec<u32>,
    /// Bounded tables: the eviction order of the live rows.
    order: Option<Recency>,
    /// Bounded tables: the most live rows this stripe keeps.
    quota: usize,
}

/// A bounded stripe's least recently pushed rows, by (version, key): the least `keep` pairs
/// of the live rows as of the last scan of the slab, in a min-heap, and every pair noted
/// since that is at most `bound`. So every live row whose pair is at most `bound` has it here, and
/// the least pair here that still names a live row's version is the stripe's least recently
/// pushed row: evictions are those a sorted set of the live rows would give, so every pod
/// evicts alike. Pairs go stale in place (the row pushed again or gone) and are dropped when
/// they reach the top; when the pairs run out, the slab is scanned again (about every
/// `keep` evictions: 64 rows read an eviction). A push's new version is the newest, above
/// `bound`, so it costs one comparison. Costs under a byte a row in a stripe of over 1024
/// rows, against 16 to 32 for the lazy min-heap of every row's pair that came before it
/// (a full table 1.32x its payload against 1.19x now,
/// `results/table-scale/runs/bounded-scan-2026-12-06.txt`), which had itself replaced a
/// `BTreeSet<(u64, u64)>` (two B-tree walks a push: 3.3x the unbounded table's push time).
#[derive(Debug, Default)]
struct Recency {
    /// (version, key) pairs, least first, some stale. A heap, not a sorted deque: a copy
    /// older than `bound` (a replica catching up) would shift half the pairs.
    low: BinaryHeap<Reverse<(u64, u64)>>,
    /// Every live row whose pair is at most this has it in `low` (None: never scanned).
    bound: Option<(u64, u64)>,
    /// Pairs the last scan kept: `low` is cut back to this when it doubles.
    keep: usize,
    /// The newest version a live row holds, unless `newest_stale`.
    newest: u64,
    /// A row holding `newest` left: recomputed from the slab when asked.
    newest_stale: bool,
}

/// A scan of a bounded stripe keeps the least of every this many live rows' pairs (at least
/// [`MIN_KEPT_PAIRS`]).
const KEPT_PAIR_FRACTION: usize = 64;
const MIN_KEPT_PAIRS: usize = 16;

/// The highest version a row copy may carry: versions are push times in µs (about 2^51
/// today), so anything above 2^62 is corrupt or hostile.
pub const MAX_VERSION: u64 = 1 << 62;

/// Slab bytes above which a stripe warms a batch before serving it ([`Stripe::warm`]): a
/// table of 64 such stripes (4 MiB) outgrows a core's L2. Measured at 1000-key fetches,
/// dim 16: at 10K rows (21 KiB a stripe) warming cost 51 -> 72 µs; at 100K rows (210 KiB
/// a stripe, the table in the L3) it saved 185 -> 137 µs.
const WARM_ABOVE_BYTES: usize = 64 << 10;

/// What storing a whole-row copy did ([`Stripe::put_if_newer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CopyOutcome {
    /// Not stored: the stored row is at least as new, or a full stripe keeps only newer.
    Ignored,
    /// Written over the key's older row.
    Replaced,
    /// A new row, in place of `displaced` in a full stripe.
    Created { displaced: Option<u64> },
}

/// The version of a free slot (no row's: versions are push times in µs, saturating below).
const FREE: u64 = u64::MAX;

/// What a row is made of; shared by every stripe of a table.
#[derive(Clone, Copy, Debug)]
struct Layout {
    dim: usize,
    stride: usize,
    seed: u64,
    init: Initializer,
    opt: Optimizer,
    /// Pushes a key needs before it gets a row (0: admission off).
    admit_after: u32,
    /// Rows are kept within a capacity or a TTL.
    bounded: bool,
}

impl Layout {
    fn new_row(&self, key: u64, row: &mut [f32]) {
        let (w, s) = row.split_at_mut(self.dim);
        self.init.fill(self.seed, key, w);
        self.opt.init_state(s);
    }
}

/// The key in slot `r` of `data` (slots of `slot` words).
fn key_at(data: &[f32], slot: usize, r: u32) -> u64 {
    let at = r as usize * slot;
    u64::from(data[at].to_bits()) | u64::from(data[at + 1].to_bits()) << 32
}

impl Stripe {
    fn new(stride: usize, sketch: Option<CountMin>, quota: Option<usize>) -> Stripe {
        Stripe {
            index: RowIndex::default(),
            steps: Vec::new(),
            versions: Vec::new(),
            data: Vec::new(),
            slot: stride + 2,
            sketch,
            free: Vec::new(),
            order: quota.map(|_| Recency::default()),
            quota: quota.unwrap_or(usize::MAX),
        }
    }

    /// The row number of `key`, if it has a row.
    fn find(&self, key: u64) -> Option<u32> {
        let (data, slot) = (&self.data, self.slot);
        self.index.get(key, |r| key_at(data, slot, r))
    }

    /// Starts loading the index buckets of a batch's `keys`, then the first `words` f32 of
    /// the rows they point at (one word per cache line; a tag's row may be another key's),
    /// before any key is served. Each pass's prefetches are independent of one another, so
    /// the CPU keeps the batch's misses in flight together instead of waiting out each key's
    /// chain (bucket, then row) in turn: a table larger than the caches misses on nearly
    /// every key. Rejected, each measured slower (`bench/table-scale`): warming a whole
    /// batch across all its stripes before serving any, either re-locking per stripe per
    /// pass or holding every stripe's read lock at once (medians of 3 at 100K-10M rows); and
    /// a two-stage pipeline holding two read locks, the next stripe's buckets loading while
    /// this one's rows do (equal at 1M and 10M rows, fetch p50 1.07-1.36x at 100M;
    /// `results/table-scale/runs/two-stage-warm-2026-12-04.txt`). Loads instead of prefetches
    /// (until 2026-12-07): fetch p50 1.20x at 1M rows and 1.07x at 100M, push 1.29x and
    /// 1.11x (`results/table-scale/runs/prefetch-warm-2026-12-07/`).
    ///
    /// A push or a whole-row copy (`bookkeeping`) also reads and writes the row's version and
    /// step count, which live in arrays of their own: they are prefetched in the second pass
    /// too (left to the serving loop, each was one more miss a key waited out in turn).
    fn warm(&self, keys: impl Iterator<Item = u64>, words: usize, bookkeeping: bool) {
        // A slab this small stays in the caches: warming would only cost its own work.
        if self.data.len() * 4 < WARM_ABOVE_BYTES {
            return;
        }
        // Keys a chunk: the second pass waits for the first's buckets, so a chunk bounds the
        // pages whose translations must stay cached until served; a fixed array keeps each
        // key's hash computed once without an allocation.
        const CHUNK: usize = 32;
        debug_assert!(words > 0, "a row's last line is computed from at least one word");
        let words = words.min(self.slot);
        let lines = words.div_ceil(16);
        let mut keys = keys.peekable();
        let mut probes = [Probe::default(); CHUNK];
        while keys.peek().is_some() {
            let n = keys.by_ref().take(CHUNK).zip(probes.iter_mut()).fold(0, |n, (k, p)| {
                *p = self.index.probe(k);
                n + 1
            });
            for &p in &probes[..n] {
                self.index.prefetch(p);
            }
            // The rows first, then their prefetches in a loop of their own: a key's candidate
            // takes tens of instructions (the tag match, its branches) and waits for its
            // bucket, which would hold back the prefetches of the keys after it.
            let mut rows = [0u32; CHUNK];
            let found = probes[..n].iter().filter_map(|&p| self.index.candidate(p));
            let m = found.zip(rows.iter_mut()).fold(0, |m, (r, slot)| {
                *slot = r;
                m + 1
            });
            for &r in &rows[..m] {
                let (at, r) = (r as usize * self.slot, r as usize);
                let row_lines = (0..lines).filter_map(|line| self.data.get(at + 16 * line));
                row_lines.for_each(prefetch);
                // A slot starts anywhere in a line, so a span of `words` can end one line past
                // the last prefetched (at dims that are not a multiple of 16): fetch p50 at
                // 10M rows of dim 24 was 1.30x without it. Only then: a prefetch of the last
                // word for every row made push p50 there 1.11x (`runs/prefetch-warm-2026-12-07/`).
                let line = |v: &f32| std::ptr::from_ref(v).addr() / 64;
                let ends = (self.data.get(at + 16 * (lines - 1)), self.data.get(at + words - 1));
                if let (Some(prefetched), Some(last)) = ends {
                    if line(last) != line(prefetched) {
                        prefetch(last);
                    }
                }
                if bookkeeping {
                    self.versions.get(r).into_iter().for_each(prefetch);
                    self.steps.get(r).into_iter().for_each(prefetch);
                }
            }
        }
    }

    /// The key of slot `r`.
    fn key(&self, r: usize) -> u64 {
        key_at(&self.data, self.slot, r as u32)
    }

    /// Where slot `r`'s row (values, then state) is in `data`.
    fn span(&self, r: usize) -> std::ops::Range<usize> {
        r * self.slot + 2..(r + 1) * self.slot
    }

    /// Slots, live or free (snapshot cursors and checkpoints count in slots).
    fn slots(&self) -> usize {
        self.versions.len()
    }

    /// Live rows.
    fn live(&self) -> usize {
        self.versions.len() - self.free.len()
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[self.span(r)]
    }

    /// The version of the least recently pushed row of a full bounded stripe (0 otherwise).
    fn oldest_version(&mut self) -> u64 {
        if self.live() < self.quota {
            return 0;
        }
        self.oldest().map_or(0, |(v, _)| v)
    }

    /// (version, key) of the least recently pushed live row of a bounded stripe: the front of
    /// its order once stale pairs are dropped, scanning the slab when they run out.
    fn oldest(&mut self) -> Option<(u64, u64)> {
        loop {
            match self.order.as_ref()?.low.peek() {
                Some(&Reverse((version, key))) => {
                    if self.find(key).is_some_and(|r| self.versions[r as usize] == version) {
                        return Some((version, key));
                    }
                    self.order.as_mut()?.low.pop();
                }
                None if self.live() == 0 => return None,
                None => self.scan_oldest(),
            }
        }
    }

    /// Refills a bounded stripe's order with the least pairs of its live rows (see
    /// [`Recency`]). A row whose version is above the largest pair kept so far is passed
    /// without reading its key, so a scan reads the versions and few keys.
    fn scan_oldest(&mut self) {
        let keep = (self.live() / KEPT_PAIR_FRACTION).max(MIN_KEPT_PAIRS);
        let mut least = BinaryHeap::with_capacity(keep + 1);
        for (r, &version) in self.versions.iter().enumerate() {
            if version == FREE {
                continue;
            }
            if least.len() == keep {
                let Some(&(top, _)) = least.peek() else { continue };
                if version > top {
                    continue;
                }
            }
            least.push((version, key_at(&self.data, self.slot, r as u32)));
            if least.len() > keep {
                least.pop();
            }
        }
        // Fewer live rows than `keep`: every pair is here, and every pair noted will be.
        let bound = match least.peek() {
            Some(&most) if least.len() == keep => most,
            _ => (u64::MAX, u64::MAX),
        };
        if let Some(order) = self.order.as_mut() {
            order.low = least.into_iter().map(Reverse).collect();
            order.bound = Some(bound);
            order.keep = keep;
        }
    }

    /// The newest version a live row of a bounded stripe holds (0 for none, or unbounded).
    fn newest_version(&mut self) -> u64 {
        let versions = &self.versions;
        let Some(order) = self.order.as_mut() else { return 0 };
        if order.newest_stale {
            order.newest = versions.iter().copied().filter(|&v| v != FREE).max().unwrap_or(0);
            order.newest_stale = false;
        }
        order.newest
    }

    /// Row `key` now holds `version` (a bounded stripe's order learns it).
    fn note_version(&mut self, version: u64, key: u64) {
        let Some(order) = self.order.as_mut() else { return };
        if !order.newest_stale {
            order.newest = order.newest.max(version);
        }
        let pair = (version, key);
        if order.bound.is_none_or(|bound| pair > bound) {
            return;
        }
        order.low.push(Reverse(pair));
        // Cut back to the least `keep` pairs: those cut are above the new bound.
        if order.low.len() > 2 * order.keep {
            let mut pairs: Vec<(u64, u64)> =
                std::mem::take(&mut order.low).into_iter().map(|Reverse(p)| p).collect();
            pairs.select_nth_unstable(order.keep - 1);
            pairs.truncate(order.keep);
            order.bound = pairs.iter().copied().max();
            order.low = pairs.into_iter().map(Reverse).collect();
        }
    }

    /// Sets live row `r`'s version, keeping the eviction order.
    fn set_version(&mut self, r: usize, version: u64) {
        self.versions[r] = version;
        self.note_version(version, self.key(r));
    }

    /// Removes live row `r`; its slot is reused by the next new row (its pair in the
    /// eviction order goes stale: see [`Recency`]).
    fn evict(&mut self, r: usize) {
        let key = self.key(r);
        let (data, slot) = (&self.data, self.slot);
        let removed = self.index.remove(key, |r| key_at(data, slot, r));
        debug_assert!(removed, "evicting a row the index does not hold");
        if let Some(order) = self.order.as_mut() {
            order.newest_stale |= self.versions[r] == order.newest;
        }
        self.versions[r] = FREE;
        self.free.push(r as u32);
    }

    /// Row number of `key`, creating it; and whether it was created. Unbounded stripes
    /// only (a bounded one chooses what to keep: [`Stripe::insert`]).
    fn get_or_insert(&mut self, key: u64, l: &Layout) -> (usize, bool) {
        if let Some(r) = self.find(key) {
            return (r as usize, false);
        }
        debug_assert!(self.order.is_none(), "a bounded stripe creates rows through insert");
        (self.insert(key, 0, l).map_or(usize::MAX, |(r, _)| r), true)
    }

    /// Creates the row of absent `key` (initial values, `version`), unless the stripe is full
    /// and the row would be its least recently pushed: then nothing is stored. In a full
    /// stripe the least recently pushed row makes room (returned: its key).
    fn insert(&mut self, key: u64, version: u64, l: &Layout) -> Option<(usize, Option<u64>)> {
        debug_assert!(self.find(key).is_none(), "insert of a present key");
        let mut displaced = None;
        if self.live() >= self.quota {
            let (oldest_version, oldest) = self.oldest()?;
            if (version, key) < (oldest_version, oldest) {
                return None;
            }
            let r = self.find(oldest)? as usize;
            self.evict(r);
            displaced = Some(oldest);
        }
        let r = match self.free.pop() {
            Some(r) => {
                let r = r as usize;
                self.steps[r] = 0;
                self.versions[r] = version;
                r
            }
            None => {
                let r = self.versions.len();
                self.reserve_within_quota();
                self.steps.push(0);
                self.versions.push(version);
                self.data.resize(self.data.len() + self.slot, 0.0);
                r
            }
        };
        let at = r * self.slot;
        self.data[at] = f32::from_bits(key as u32);
        self.data[at + 1] = f32::from_bits((key >> 32) as u32);
        let span = self.span(r);
        l.new_row(key, &mut self.data[span]);
        // A stripe holds far fewer than 2^32 rows (memory would run out first).
        let (data, slot) = (&self.data, self.slot);
        self.index.insert(key, r as u32, |r| key_at(data, slot, r));
        self.note_version(version, key);
        debug_assert!(self.live() <= self.quota, "a stripe over its quota");
        debug_assert_eq!(self.index.len(), self.live(), "the index and the slab disagree");
        Some((r, displaced))
    }

    /// Before a slot is appended to a full slab: a bounded stripe's arrays grow by doubling
    /// but never past its quota (doubling alone left a full stripe up to twice the memory
    /// its bound allows: a quota of 65 rows held 128 slots).
    fn reserve_within_quota(&mut self) {
        if self.order.is_none() || self.versions.len() < self.versions.capacity() {
            return;
        }
        let len = self.versions.len();
        let more = len.max(4).min(self.quota.saturating_sub(len)).max(1);
        self.versions.reserve_exact(more);
        self.steps.reserve_exact(more);
        self.data.reserve_exact(more * self.slot);
    }

    /// Stores a whole row copy (values and state, steps, version) of `key` unless the stored
    /// row is at least as new (a missing row is created).
    fn put_if_newer(
        &mut self,
        key: u64,
        version: u64,
        steps: u32,
        values: LeF32s<'_>,
        l: &Layout,
    ) -> CopyOutcome {
        let found = self.find(key);
        if version == 0 && found.is_none() {
            // A never-pushed row reads as its initial values already: storing the copy
            // would only cost memory (and admit a key the training pod has not).
            return CopyOutcome::Ignored;
        }
        let version = version.min(FREE - 1);
        let (r, outcome) = match found {
            Some(r) if version <= self.versions[r as usize] => return CopyOutcome::Ignored,
            Some(r) => (r as usize, CopyOutcome::Replaced),
            // In a full stripe a copy older than every row kept is not stored: the training
            // pod dropped that row too (or will).
            None => match self.insert(key, version, l) {
                Some((r, displaced)) => (r, CopyOutcome::Created { displaced }),
                None => return CopyOutcome::Ignored,
            },
        };
        let span = self.span(r);
        values.copy_to(&mut self.data[span]);
        self.steps[r] = steps;
        self.set_version(r, version);
        outcome
    }

    /// Appends row `r`'s record (see [`Table::record_len`]).
    fn put_record(&self, r: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key(r).to_le_bytes());
        out.extend_from_slice(&self.versions[r].to_le_bytes());
        out.extend_from_slice(&self.steps[r].to_le_bytes());
        for v in self.row(r) {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn bytes(&self) -> u64 {
        (self.steps.capacity() * 4
            + self.versions.capacity() * 8
            + self.data.capacity() * 4
            + self.index.bytes()
            + self.free.capacity() * 4
            + self.order.as_ref().map_or(0, |o| o.low.capacity() * 16)
            + self.sketch.as_ref().map_or(0, CountMin::bytes)) as u64
    }
}

/// One table: definition plus striped storage.
#[derive(Debug)]
pub struct Table {
    spec: TableSpec,
    layout: Layout,
    /// Seeds the stripe hash (see [`Table::stripe_of`]).
    stripe_seed: u64,
    stripes: Box<[RwLock<Stripe>]>,
    rows: AtomicU64,
    /// The least version a push writes (see the module docs).
    version_floor: AtomicU64,
    counts: TableCounts,
}

/// What a table counts besides its rows.
#[derive(Debug, Default)]
struct TableCounts {
    /// Fetched keys that had no row (answered with the initial row).
    fetch_missing: AtomicU64,
    /// Pushes of keys not yet admitted: counted, not applied.
    pushes_not_admitted: AtomicU64,
    /// Rows created by a push that reached the admission threshold.
    admitted: AtomicU64,
    /// Rows displaced by newer ones in a full stripe.
    evicted: AtomicU64,
    /// Rows dropped for not being pushed within the TTL.
    expired: AtomicU64,
}

/// Counts from a fetch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Rows returned.
    pub rows: usize,
    /// Keys (each occurrence) that had no row when the fetch began: answered with their
    /// initial row, created or not.
    pub missing: usize,
    /// Rows created by this fetch.
    pub created: usize,
}

/// Where [`Table::fetch_rows`] puts rows.
trait RowSink {
    fn put(&mut self, i: usize, row: &[f32]);
}

struct F32Sink<'a>(&'a mut [f32], usize);
impl RowSink for F32Sink<'_> {
    fn put(&mut self, i: usize, row: &[f32]) {
        self.0[i * self.1..(i + 1) * self.1].copy_from_slice(row);
    }
}

struct LeSink<'a>(&'a mut [u8], usize);
impl RowSink for LeSink<'_> {
    fn put(&mut self, i: usize, row: &[f32]) {
        let out = &mut self.0[i * self.1 * 4..(i + 1) * self.1 * 4];
        for (d, v) in out.chunks_exact_mut(4).zip(row) {
            d.copy_from_slice(&v.to_le_bytes());
        }
    }
}

struct NoSink;
impl RowSink for NoSink {
    fn put(&mut self, _: usize, _: &[f32]) {}
}

impl Table {
    /// A new empty table; `spec` must pass [`TableSpec::check`].
    pub fn new(spec: TableSpec) -> Result<Table, TableError> {
        let errors = spec.check();
        if !errors.is_empty() {
            return Err(TableError::Invalid(errors));
        }
        let layout = Layout {
            dim: spec.dim as usize,
            stride: spec.stride(),
            seed: spec.seed,
            init: spec.init,
            opt: spec.optimizer,
            admit_after: spec.admission.after_pushes,
            bounded: spec.max_rows().is_some() || spec.capacity.ttl_s > 0,
        };
        let admission = spec.admission;
        let sketch = |i: usize| {
            (admission.after_pushes > 0).then(|| {
                CountMin::new(admission.sketch_width as usize, spec.seed ^ (i as u64) << 56)
            })
        };
        // Each stripe keeps its share of the bound; the first `limit % STRIPES` one more.
        let bounded = spec.max_rows().is_some() || spec.capacity.ttl_s > 0;
        let limit = spec.max_rows().unwrap_or(u64::MAX);
        let quota = |i: usize| {
            let share = limit / STRIPES as u64 + u64::from((i as u64) < limit % STRIPES as u64);
            bounded.then(|| usize::try_from(share).unwrap_or(usize::MAX))
        };
        Ok(Table {
            layout,
            stripe_seed: mix64(spec.seed ^ 0x5851_F42D_4C95_7F2D),
            stripes: (0..STRIPES)
                .map(|i| RwLock::new(Stripe::new(spec.stride(), sketch(i), quota(i))))
                .collect(),
            rows: AtomicU64::new(0),
            version_floor: AtomicU64::new(1),
            counts: TableCounts::default(),
            spec,
        })
    }

    /// The definition.
    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// Row dimension.
    pub fn dim(&self) -> usize {
        self.layout.dim
    }

    /// f32 per stored row (values and optimizer state).
    pub fn stride(&self) -> usize {
        self.layout.stride
    }

    /// Words of one whole row in a Replicate with state: `stride` plus
    /// [`STATE_EXTRA_WORDS`].
    pub fn state_width(&self) -> usize {
        self.layout.stride + STATE_EXTRA_WORDS
    }

    /// Whether `key` has a row (pushed, created by a fetch, or copied).
    pub fn contains(&self, key: u64) -> bool {
        self.stripe(key).read().find(key).is_some()
    }

    /// Rows stored.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Raises the least version a push writes to `floor` (see the module docs; a server
    /// raises every table's through [`TableSet::raise_version_floor`]).
    pub fn raise_version_floor(&self, floor: u64) {
        // Never above what a copy may carry: a floor raised past it (catch-up from a replica
        // holding a corrupt or hostile version) made every later push write rows every
        // replica refuses, and a checkpoint this pod could not restore.
        self.version_floor.fetch_max(floor.min(MAX_VERSION), Ordering::AcqRel);
    }

    /// Moves the least version the next push writes to `clock`, or one past the last
    /// push's floor while `clock` is behind it (a hybrid logical clock), and returns it.
    /// With [`raise_version_floor`](Self::raise_version_floor) alone, a clock behind the
    /// floor (a catch-up raised it above versions a replica wrote from a clock ahead of
    /// this pod's) gave every push the same version, and a full stripe evicted by key, not
    /// by recency, until the clock caught up.
    pub fn advance_version_floor(&self, clock: u64) -> u64 {
        let next = |f: u64| clock.max(f.saturating_add(1)).min(MAX_VERSION);
        let old =
            self.version_floor.fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| Some(next(f)));
        next(old.unwrap_or_else(|f| f))
    }

    /// Fetched keys that had no row, since the table was made.
    pub fn fetch_missing(&self) -> u64 {
        self.counts.fetch_missing.load(Ordering::Relaxed)
    }

    /// Pushes of keys not yet admitted (counted, not applied), since the table was made.
    pub fn pushes_not_admitted(&self) -> u64 {
        self.counts.pushes_not_admitted.load(Ordering::Relaxed)
    }

    /// Rows displaced by newer ones in a full stripe, since the table was made.
    pub fn evicted(&self) -> u64 {
        self.counts.evicted.load(Ordering::Relaxed)
    }

    /// Rows dropped for their TTL, since the table was made.
    pub fn expired(&self) -> u64 {
        self.counts.expired.load(Ordering::Relaxed)
    }

    /// Rows created by admission, since the table was made.
    pub fn admitted(&self) -> u64 {
        self.counts.admitted.load(Ordering::Relaxed)
    }

    /// Approximate bytes of memory held (slab and index capacities).
    pub fn bytes(&self) -> u64 {
        self.stripes.iter().map(|s| s.read().bytes()).sum()
    }

    fn stripe(&self, key: u64) -> &RwLock<Stripe> {
        &self.stripes[self.stripe_of(key)]
    }

    /// (stripe, index) of every key, ordered by stripe and, within one, by index: a batch's
    /// keys in the groups it locks stripes for.
    fn by_stripe(&self, keys: &[u64]) -> Vec<(u16, u32)> {
        // A counting sort: stripes are few, and a comparison sort of a 1000-key batch took
        // a tenth of a fetch.
        let stripes: Vec<u16> = keys.iter().map(|&k| self.stripe_of(k) as u16).collect();
        let mut start = [0u32; STRIPES + 1];
        for &s in &stripes {
            start[usize::from(s) + 1] += 1;
        }
        for s in 0..STRIPES {
            start[s + 1] += start[s];
        }
        let mut out = vec![(0u16, 0u32); keys.len()];
        for (i, &s) in stripes.iter().enumerate() {
            let at = &mut start[usize::from(s)];
            out[*at as usize] = (s, i as u32);
            *at += 1;
        }
        out
    }

    /// The stripe of `key`: SplitMix64 twice, seeded by the table. Stable across processes,
    /// builds and platforms (a bounded stripe must hold the same keys on every pod; ahash's
    /// output depends on its version and the CPU features it was built for), and
    /// independent of the shard hash (`mix64(key)`, nearly constant high bits in a shard).
    fn stripe_of(&self, key: u64) -> usize {
        let h = mix64(mix64(key) ^ self.stripe_seed);
        ((h as u128 * STRIPES as u128) >> 64) as usize
    }

    fn fetch_rows(
        &self,
        keys: impl Iterator<Item = u64>,
        create: bool,
        sink: &mut impl RowSink,
    ) -> FetchStats {
        let l = &self.layout;
        // With admission or a bound, only a push gives a key its row (a bounded stripe
        // would drop a never-pushed row first anyway).
        let create = create && l.admit_after == 0 && !l.bounded;
        let mut stats = FetchStats::default();
        // Keys grouped by stripe, each stripe read-locked once for its group: the lock's
        // atomic operations would otherwise separate every lookup from the next, and the
        // CPU could not overlap their cache misses (a large table misses on every key).
        let keys: Vec<u64> = keys.collect();
        stats.rows = keys.len();
        let by_stripe = self.by_stripe(&keys);
        let mut missing = Vec::new();
        for group in by_stripe.chunk_by(|a, b| a.0 == b.0) {
            let g = self.stripes[usize::from(group[0].0)].read();
            g.warm(group.iter().map(|&(_, i)| keys[i as usize]), 2 + l.dim, false);
            for &(_, i) in group {
                let i = i as usize;
                match g.find(keys[i]) {
                    Some(r) => sink.put(i, &g.row(r as usize)[..l.dim]),
                    None => missing.push(i),
                }
            }
        }
        stats.missing = missing.len();
        let mut scratch = Vec::new();
        for i in missing {
            let key = keys[i];
            if create {
                let mut g = self.stripe(key).write();
                let (r, created) = g.get_or_insert(key, l);
                if created {
                    stats.created += 1;
                    self.count_insert(None);
                }
                sink.put(i, &g.row(r)[..l.dim]);
            } else {
                scratch.resize(l.dim, 0.0);
                l.init.fill(l.seed, key, &mut scratch);
                sink.put(i, &scratch);
            }
        }
        self.counts.fetch_missing.fetch_add(stats.missing as u64, Ordering::Relaxed);
        stats
    }

    fn check_len(
        what: &'static str,
        expected: Option<usize>,
        got: usize,
    ) -> Result<(), TableError> {
        match expected {
            Some(e) if e == got => Ok(()),
            e => Err(TableError::WrongLength { what, expected: e.unwrap_or(usize::MAX), got }),
        }
    }

    /// Writes the rows of `keys` into `out` (`keys.len() × dim`, row-major), creating
    /// missing rows with the initializer.
    pub fn fetch_into(&self, keys: &[u64], out: &mut [f32]) -> Result<FetchStats, TableError> {
        Self::check_len("out", keys.len().checked_mul(self.dim()), out.len())?;
        let dim = self.dim();
        Ok(self.fetch_rows(keys.iter().copied(), true, &mut F32Sink(out, dim)))
    }

    /// Like [`fetch_into`](Self::fetch_into) without creating rows: missing keys get their
    /// initial values (identical to what creation would store).
    pub fn read_into(&self, keys: &[u64], out: &mut [f32]) -> Result<FetchStats, TableError> {
        Self::check_len("out", keys.len().checked_mul(self.dim()), out.len())?;
        let dim = self.dim();
        Ok(self.fetch_rows(keys.iter().copied(), false, &mut F32Sink(out, dim)))
    }

    /// The server's Fetch: keys straight from the request frame, rows straight into the
    /// response frame as little-endian f32 (`out.len() == 4 · keys.len() · dim`).
    pub fn fetch_into_le(
        &self,
        keys: LeU64s<'_>,
        out: &mut [u8],
        create: bool,
    ) -> Result<FetchStats, TableError> {
        let expected = keys.len().checked_mul(self.dim()).and_then(|n| n.checked_mul(4));
        Self::check_len("out bytes", expected, out.len())?;
        let dim = self.dim();
        Ok(self.fetch_rows(keys.iter(), create, &mut LeSink(out, dim)))
    }

    /// Creates the rows of `keys` that are missing (warm-up); returns how many were created.
    pub fn ensure(&self, keys: &[u64]) -> usize {
        self.fetch_rows(keys.iter().copied(), true, &mut NoSink).created
    }

    /// Applies one gradient row per key. Generic over where gradients come from.
    fn push_rows(
        &self,
        keys: impl Iterator<Item = u64>,
        grad_row: impl Fn(usize, &mut [f32]),
        mut updated: Option<&mut [f32]>,
    ) -> usize {
        let l = &self.layout;
        let mut g = vec![0f32; l.dim];
        let mut n = 0;
        let floor = self.version_floor.load(Ordering::Acquire);
        // Grouped by stripe, each write-locked once (see `fetch_rows`); within a stripe the
        // keys keep their order, so a key pushed twice is applied twice in order, and a
        // bounded or admitting stripe decides as it would key by key.
        let keys: Vec<u64> = keys.collect();
        let by_stripe = self.by_stripe(&keys);
        for group in by_stripe.chunk_by(|a, b| a.0 == b.0) {
            let mut s = self.stripes[usize::from(group[0].0)].write();
            // The optimizer reads and writes the whole row.
            s.warm(group.iter().map(|&(_, i)| keys[i as usize]), s.slot, true);
            for &(_, i) in group {
                let (i, key) = (i as usize, keys[i as usize]);
                grad_row(i, &mut g);
                let found = s.find(key);
                if found.is_none() {
                    if let Some(sketch) = s.sketch.as_mut() {
                        if sketch.add(key) < l.admit_after {
                            self.counts.pushes_not_admitted.fetch_add(1, Ordering::Relaxed);
                            if let Some(out) = updated.as_deref_mut() {
                                l.init.fill(l.seed, key, &mut out[i * l.dim..(i + 1) * l.dim]);
                            }
                            continue;
                        }
                        self.counts.admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // One more than the row's version (0 for a new row), and at least the floor.
                // Capped where copies are (see `raise_version_floor`).
                let next = |v: u64| v.saturating_add(1).max(floor).min(MAX_VERSION);
                let r = match found {
                    Some(r) => {
                        let r = r as usize;
                        let version = next(s.versions[r]);
                        s.set_version(r, version);
                        r
                    }
                    // A pushed row is the stripe's newest: above the floor and, in a full
                    // stripe, above the row it displaces (rows pushed twice within a clock
                    // tick can be ahead of the floor), so it always has a place.
                    None => {
                        let version = next(0).max(s.oldest_version().saturating_add(1));
                        match s.insert(key, version.min(MAX_VERSION), l) {
                            Some((r, displaced)) => {
                                self.count_insert(displaced);
                                r
                            }
                            None => continue,
                        }
                    }
                };
                let span = s.span(r);
                let Stripe { data, steps, .. } = &mut *s;
                let row = &mut data[span];
                let (w, state) = row.split_at_mut(l.dim);
                l.opt.apply(w, state, &mut steps[r], &g);
                if let Some(out) = updated.as_deref_mut() {
                    out[i * l.dim..(i + 1) * l.dim].copy_from_slice(w);
                }
                n += 1;
            }
        }
        n
    }

    /// Applies the optimizer to each key with its gradient (`grads`: `keys.len() × dim`,
    /// row-major); nothing is applied unless all lengths are right and every gradient is
    /// finite. With `updated`, the resulting rows are copied there (for replication).
    /// Returns the number of keys applied.
    pub fn push(
        &self,
        keys: &[u64],
        grads: &[f32],
        updated: Option<&mut [f32]>,
    ) -> Result<usize, TableError> {
        let dim = self.dim();
        self.check_push(keys.len(), grads.len(), grads.iter().copied(), updated.as_deref())?;
        let row = |i: usize, out: &mut [f32]| out.copy_from_slice(&grads[i * dim..(i + 1) * dim]);
        Ok(self.push_rows(keys.iter().copied(), row, updated))
    }

    /// A push's lengths (`keys × dim` gradients, and as many updated values) and finite
    /// gradients.
    fn check_push(
        &self,
        keys: usize,
        grads_len: usize,
        mut grads: impl Iterator<Item = f32>,
        updated: Option<&[f32]>,
    ) -> Result<(), TableError> {
        let want = keys.checked_mul(self.dim());
        Self::check_len("grads", want, grads_len)?;
        if let Some(u) = updated {
            Self::check_len("updated", want, u.len())?;
        }
        match grads.position(|g| !g.is_finite()) {
            Some(index) => Err(TableError::NonFinite { index }),
            None => Ok(()),
        }
    }

    /// [`push`](Self::push) with keys and gradients straight from a request frame.
    pub fn push_le(
        &self,
        keys: LeU64s<'_>,
        grads: LeF32s<'_>,
        updated: Option<&mut [f32]>,
    ) -> Result<usize, TableError> {
        let dim = self.dim();
        self.check_push(keys.len(), grads.len(), grads.iter(), updated.as_deref())?;
        let row = |i: usize, out: &mut [f32]| {
            if let Some(r) = grads.row(i, dim) {
                r.copy_to(out);
            }
        };
        Ok(self.push_rows(keys.iter(), row, updated))
    }

    fn replica_rows(
        &self,
        keys: impl Iterator<Item = u64>,
        row: impl Fn(usize, &mut [f32]),
    ) -> usize {
        let l = &self.layout;
        let mut n = 0;
        for (i, key) in keys.enumerate() {
            let mut s = self.stripe(key).write();
            let r = match s.find(key) {
                Some(r) => r as usize,
                None => match s.insert(key, 0, l) {
                    Some((r, displaced)) => {
                        self.count_insert(displaced);
                        r
                    }
                    None => continue,
                },
            };
            let span = s.span(r);
            row(i, &mut s.data[span.start..span.start + l.dim]);
            n += 1;
        }
        n
    }

    /// Overwrites the values of `keys` with `rows` (`keys.len() × dim`), creating rows as
    /// needed; optimizer state and versions are left alone. Returns the number of keys
    /// applied. Models and tests only: servers copy whole versioned rows
    /// ([`apply_replica_state_le`](Self::apply_replica_state_le)), which apply only over
    /// older ones.
    pub fn apply_replica(&self, keys: &[u64], rows: &[f32]) -> Result<usize, TableError> {
        let dim = self.dim();
        Self::check_len("rows", keys.len().checked_mul(dim), rows.len())?;
        let row = |i: usize, out: &mut [f32]| out.copy_from_slice(&rows[i * dim..(i + 1) * dim]);
        Ok(self.replica_rows(keys.iter().copied(), row))
    }

    /// Whole rows of `keys` as Replicate with [`flags::STATE`](bex_ps_proto::wire::flags::STATE)
    /// carries them: per key the `stride` f32 of the row (values, then optimizer state),
    /// then the bits of its step count and of its version (low, high 32 bits),
    /// `keys.len() × state_width()` into `out`. A missing row reads as a new one (initial
    /// values and state, no steps, version 0); nothing is created.
    pub fn read_state_into(&self, keys: &[u64], out: &mut [f32]) -> Result<(), TableError> {
        let l = &self.layout;
        let w = self.state_width();
        Self::check_len("out", keys.len().checked_mul(w), out.len())?;
        for (key, o) in keys.iter().zip(out.chunks_exact_mut(w)) {
            let s = self.stripe(*key).read();
            let (row, extra) = o.split_at_mut(l.stride);
            let (steps, version) = match s.find(*key) {
                Some(r) => {
                    row.copy_from_slice(s.row(r as usize));
                    (s.steps[r as usize], s.versions[r as usize])
                }
                None => {
                    l.new_row(*key, row);
                    (0, 0)
                }
            };
            extra[0] = f32::from_bits(steps);
            extra[1] = f32::from_bits(version as u32);
            extra[2] = f32::from_bits((version >> 32) as u32);
        }
        Ok(())
    }

    /// The version of each stored row, stripe by stripe (`f(key, version)`); for a
    /// restarted training shard to find the rows a replica lacks.
    pub fn for_each_version(&self, mut f: impl FnMut(u64, u64)) {
        for stripe in 0..STRIPES {
            self.for_each_version_in(stripe, &mut f);
        }
    }

    /// [`for_each_version`](Self::for_each_version) of one stripe (none out of range).
    pub fn for_each_version_in(&self, stripe: usize, mut f: impl FnMut(u64, u64)) {
        let Some(s) = self.stripes.get(stripe) else { return };
        let s = s.read();
        for (r, &v) in s.versions.iter().enumerate() {
            if v != FREE {
                f(s.key(r), v);
            }
        }
    }

    /// The stripe `key` belongs to: the same on every pod for the same table definition
    /// (snapshots stream a table's stripes in order).
    pub fn stripe_index(&self, key: u64) -> usize {
        self.stripe_of(key)
    }

    /// The highest version of any row (0 if none was pushed).
    pub fn max_version(&self) -> u64 {
        let mut m = 0;
        self.for_each_version(|_, v| m = m.max(v));
        m
    }

    /// Replicas: overwrite whole rows — values, optimizer state, step count and version —
    /// of `keys` from a Replicate frame with [`flags::STATE`](bex_ps_proto::wire::flags::STATE)
    /// (`rows` is `keys.len() × state_width()`, see
    /// [`read_state_into`](Self::read_state_into)) where the copy's version is newer than
    /// the stored row's (a missing row is created), so a replica holds exactly the training
    /// pod's newest rows whatever order copies arrive in. Every value and state element must
    /// be finite (checked before anything is written). Returns the number of rows written.
    pub fn apply_replica_state_le(
        &self,
        keys: LeU64s<'_>,
        rows: LeF32s<'_>,
    ) -> Result<usize, TableError> {
        let l = &self.layout;
        let w = self.state_width();
        Self::check_len("rows", keys.len().checked_mul(w), rows.len())?;
        for i in 0..keys.len() {
            let row = rows.row(i, w).unwrap_or_default();
            if let Some(j) = row.iter().take(l.stride).position(|v| !v.is_finite()) {
                return Err(TableError::NonFinite { index: i * w + j });
            }
            let word = |j: usize| row.get(l.stride + j).map_or(0, f32::to_bits);
            let version = u64::from(word(1)) | u64::from(word(2)) << 32;
            if version > MAX_VERSION {
                return Err(TableError::BadVersion { index: i, version });
            }
        }
        let keys: Vec<u64> = keys.iter().collect();
        let copy = |i: usize| {
            let row = rows.row(i, w).unwrap_or_default();
            let word = |j: usize| row.get(l.stride + j).map_or(0, f32::to_bits);
            let version = u64::from(word(1)) | u64::from(word(2)) << 32;
            (version, word(0), row.row(0, l.stride).unwrap_or_default())
        };
        let mut n = 0;
        self.put_copies_if_newer(&keys, copy, |_, stored| n += usize::from(stored));
        Ok(n)
    }

    /// Stores whole row copies, copy `i` (`copy(i)`: version, steps, values and state) for
    /// `keys[i]`, each unless the stored row is at least as new (see
    /// [`put_if_newer`](Stripe::put_if_newer)); `stored(i, written)` is told each outcome,
    /// in stripe order, after that stripe's lock is released (a caller may lock stripes).
    /// Grouped by stripe, each write-locked once and warmed as a push is, rather than a lock
    /// and a lookup per copy, whose loads (bucket, row, version, steps) nothing started early.
    fn put_copies_if_newer<'a>(
        &self,
        keys: &[u64],
        copy: impl Fn(usize) -> (u64, u32, LeF32s<'a>),
        mut stored: impl FnMut(usize, bool),
    ) {
        let by_stripe = self.by_stripe(keys);
        let mut written = Vec::new();
        for group in by_stripe.chunk_by(|a, b| a.0 == b.0) {
            written.clear();
            let mut s = self.stripes[usize::from(group[0].0)].write();
            s.warm(group.iter().map(|&(_, i)| keys[i as usize]), s.slot, true);
            for &(_, i) in group {
                let i = i as usize;
                let (version, steps, values) = copy(i);
                let outcome = s.put_if_newer(keys[i], version, steps, values, &self.layout);
                if let CopyOutcome::Created { displaced } = outcome {
                    self.count_insert(displaced);
                }
                written.push(outcome != CopyOutcome::Ignored);
            }
            drop(s);
            for (&(_, i), &w) in group.iter().zip(&written) {
                stored(i as usize, w);
            }
        }
    }

    /// Slots of stripe `stripe` now, live or free (0 for a stripe out of range): what
    /// snapshot cursors step through.
    pub fn stripe_len(&self, stripe: usize) -> usize {
        self.stripes.get(stripe).map_or(0, |s| s.read().slots())
    }

    /// Live rows of stripe `stripe` now.
    pub fn stripe_rows(&self, stripe: usize) -> usize {
        self.stripes.get(stripe).map_or(0, |s| s.read().live())
    }

    /// A row was created (and `displaced` left for it, if any).
    fn count_insert(&self, displaced: Option<u64>) {
        let counter = if displaced.is_some() { &self.counts.evicted } else { &self.rows };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The newest version a row of this table holds: when it was last pushed (0 if none
    /// was, or the table keeps no order: neither bounded nor with a TTL).
    pub fn newest_version(&self) -> u64 {
        let newest = |stripe: &RwLock<Stripe>| {
            let s = stripe.read();
            match &s.order {
                Some(o) if !o.newest_stale => o.newest,
                // Its newest row left (rare): recounted under the write lock.
                Some(_) => {
                    drop(s);
                    stripe.write().newest_version()
                }
                None => 0,
            }
        };
        self.stripes.iter().map(newest).max().unwrap_or(0)
    }

    /// Drops every row last pushed before `before` (a version: µs since the Unix epoch),
    /// when the table has a TTL; returns how many. See [`TableSet::expire`] for the cutoff
    /// the server passes.
    pub fn expire(&self, before: u64) -> usize {
        if self.spec.capacity.ttl_s == 0 {
            return 0;
        }
        let mut n = 0;
        for stripe in self.stripes.iter() {
            let mut s = stripe.write();
            while let Some((version, key)) = s.oldest() {
                if version >= before {
                    break;
                }
                let Some(r) = s.find(key) else { break };
                s.evict(r as usize);
                n += 1;
            }
        }
        self.rows.fetch_sub(n as u64, Ordering::Relaxed);
        self.counts.expired.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Bytes of one exported row record: key (u64), version (u64), steps (u32), `stride`
    /// f32, all LE.
    pub fn record_len(&self) -> usize {
        self.record_len_of(RecordFormat::Versioned)
    }

    /// Bytes of one row record in `format`.
    pub fn record_len_of(&self, format: RecordFormat) -> usize {
        match format {
            RecordFormat::Versioned => 20 + 4 * self.layout.stride,
            RecordFormat::Unversioned => 12 + 4 * self.layout.stride,
        }
    }

    /// Appends the records of `which` rows in slots `from..` of `stripe` to `out` until
    /// `max_rows` are written or the stripe ends; returns (slots scanned, records written):
    /// fewer written than `max_rows` means the stripe's end was reached. The stripe is
    /// read-locked while copying (not while the caller does I/O).
    pub fn export_records(
        &self,
        which: ExportRows,
        stripe: usize,
        from: usize,
        max_rows: usize,
        out: &mut Vec<u8>,
    ) -> (usize, usize) {
        let Some(s) = self.stripes.get(stripe) else { return (0, 0) };
        let s = s.read();
        let (mut r, mut written) = (from, 0);
        while r < s.slots() && written < max_rows {
            if which.takes(s.versions[r]) {
                s.put_record(r, out);
                written += 1;
            }
            r += 1;
        }
        (r.saturating_sub(from), written)
    }

    /// Inserts whole rows (values, state, steps, version) from records as written by
    /// [`export_records`](Self::export_records) (or, `Unversioned`, by checkpoint versions
    /// 1 and 2: version 1), each only over an older stored row (see the module docs).
    /// `records.len()` must be a multiple of the record length. `seen` gets every record's
    /// key, version and whether it was stored (in stripe order: records are applied grouped
    /// by stripe, in their order within each). Returns the number of records.
    pub fn import_records(
        &self,
        records: &[u8],
        format: RecordFormat,
        seen: &mut dyn FnMut(SeenRow),
    ) -> Result<usize, TableError> {
        let rl = self.record_len_of(format);
        if records.len() % rl != 0 {
            return Err(TableError::WrongLength {
                what: "records",
                expected: records.len() / rl * rl,
                got: records.len(),
            });
        }
        let u64_at = |rec: &[u8], at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&rec[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let version_at = |rec: &[u8]| match format {
            RecordFormat::Versioned => u64_at(rec, 8),
            RecordFormat::Unversioned => 1,
        };
        // Every record checked before any is stored: a version no push has, and values and
        // state (after the key, version and steps) that are finite, as a Replicate's must be
        // (a snapshot chunk comes from a peer, and a CRC is no authentication).
        let head = rl - 4 * self.layout.stride;
        for (i, rec) in records.chunks_exact(rl).enumerate() {
            if version_at(rec) > MAX_VERSION {
                return Err(TableError::BadVersion { index: i, version: version_at(rec) });
            }
            let vals = LeF32s::new(&rec[head..]).unwrap_or_default();
            if let Some(j) = vals.iter().position(|v| !v.is_finite()) {
                return Err(TableError::NonFinite { index: i * self.layout.stride + j });
            }
        }
        let recs: Vec<&[u8]> = records.chunks_exact(rl).collect();
        let keys: Vec<u64> = recs.iter().map(|rec| u64_at(rec, 0)).collect();
        let copy = |i: usize| {
            let rec = recs[i];
            let (version, rest) = match format {
                RecordFormat::Versioned => (u64_at(rec, 8), &rec[16..]),
                // Before versions: every stored row counts as pushed once, so it travels in
                // snapshots and to replicas (version 0 would leave it behind).
                RecordFormat::Unversioned => (1, &rec[8..]),
            };
            let mut st = [0u8; 4];
            st.copy_from_slice(&rest[..4]);
            (version, u32::from_le_bytes(st), LeF32s::new(&rest[4..]).unwrap_or_default())
        };
        self.put_copies_if_newer(&keys, copy, |i, stored| {
            seen(SeenRow { key: keys[i], version: version_at(recs[i]), stored });
        });
        Ok(records.len() / rl)
    }
}

/// One record [`Table::import_records`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeenRow {
    /// Its key.
    pub key: u64,
    /// Its version.
    pub version: u64,
    /// It replaced (or created) this table's row: it was newer.
    pub stored: bool,
}

/// Which rows [`Table::export_records`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportRows {
    /// Every row the table holds (checkpoints, tests).
    Live,
    /// Only rows ever pushed (version above 0): the others hold their initial values, which
    /// the initializer recreates anywhere (snapshot chunks for a bootstrapping replica).
    Pushed,
}

impl ExportRows {
    /// Whether a row of `version` is exported.
    fn takes(self, version: u64) -> bool {
        match self {
            ExportRows::Live => version != FREE,
            ExportRows::Pushed => version > 0 && version != FREE,
        }
    }
}

/// How row records are laid out (see [`Table::record_len_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordFormat {
    /// key, version, steps, values and state (snapshot chunks, checkpoint version 3).
    Versioned,
    /// key, steps, values and state (checkpoint versions 1 and 2).
    Unversioned,
}

/// The tables of one server, by id (position in the configuration).
#[derive(Debug)]
pub struct TableSet {
    tables: Vec<Table>,
    by_name: HashMap<String, u32>,
    epoch: u64,
    /// Held while a checkpoint is written, which counts each stripe's rows first: expiry,
    /// the one way a stripe's row count falls, waits meanwhile.
    no_shrink: parking_lot::Mutex<()>,
}

impl TableSet {
    /// Tables from their definitions (ids are positions). Errors name the field
    /// (`tables[1].dim`, duplicate names at `tables[i].name`).
    pub fn new(specs: Vec<TableSpec>) -> Result<TableSet, TableError> {
        let mut errors = Vec::new();
        let mut by_name = HashMap::new();
        for (i, s) in specs.iter().enumerate() {
            for e in s.check() {
                errors.push(e.prefixed(&format!("tables[{i}]")));
            }
            if by_name.insert(s.name.clone(), i as u32).is_some() {
                errors.push(FieldError::new(format!("tables[{i}].name"), "duplicate table name"));
            }
        }
        if !errors.is_empty() {
            return Err(TableError::Invalid(errors));
        }
        let tables = specs.into_iter().map(Table::new).collect::<Result<Vec<_>, _>>()?;
        // A random epoch identifies this in-memory layout for snapshot cursors.
        let epoch = ahash::RandomState::new().hash_one(tables.len()) | 1;
        Ok(TableSet { tables, by_name, epoch, no_shrink: parking_lot::Mutex::new(()) })
    }

    /// Drops the rows of every table with a TTL that were last pushed `ttl_s` or more
    /// before the table's clock; returns how many. Skipped (0) while a checkpoint is being
    /// written.
    ///
    /// The clock is the table's newest row version (its last push, by the training pod's
    /// push clock), capped at `now_us` (µs since the Unix epoch, this pod's wall clock) plus
    /// [`TTL_SKEW_ALLOWANCE_US`], so
    /// - while training is paused nothing expires, and every pod keeps serving the model
    ///   (by the wall clock alone the whole model went after `ttl_s` without pushes); the
    ///   first push after a pause longer than `ttl_s` moves the clock on, and the rows not
    ///   pushed since then go;
    /// - pods need no synchronised clocks: a replica's newest version is at most the
    ///   training pod's, so it never drops a row the training pod keeps, except one whose
    ///   newer copy is on its way (with each pod's wall clock, a replica whose clock ran
    ///   ahead dropped rows the training pod kept, and they were not sent again);
    /// - a copy carrying a version from the future moves a clock at most the allowance past
    ///   its wall clock.
    pub fn expire(&self, now_us: u64) -> usize {
        let Some(_gate) = self.no_shrink.try_lock() else { return 0 };
        self.tables
            .iter()
            .map(|t| match t.spec.capacity.ttl_s {
                0 => 0,
                ttl => {
                    let clock =
                        t.newest_version().min(now_us.saturating_add(TTL_SKEW_ALLOWANCE_US));
                    t.expire(clock.saturating_sub(ttl.saturating_mul(1_000_000)))
                }
            })
            .sum()
    }

    /// Holds expiry off until the guard drops (see `no_shrink`).
    pub(crate) fn hold_rows(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.no_shrink.lock()
    }

    /// The table with id `id`.
    pub fn get(&self, id: u32) -> Option<&Table> {
        self.tables.get(id as usize)
    }

    /// Pushes from now on write versions of at least `floor` (never lowered): a server
    /// incarnation raises it above every version an earlier one can have written (see the
    /// module docs).
    pub fn raise_version_floor(&self, floor: u64) {
        for t in &self.tables {
            t.raise_version_floor(floor);
        }
    }

    /// The least version pushes write now.
    pub fn version_floor(&self) -> u64 {
        self.tables.first().map_or(1, |t| t.version_floor.load(Ordering::Acquire))
    }

    /// The highest row version in any table.
    pub fn max_version(&self) -> u64 {
        self.tables.iter().map(Table::max_version).max().unwrap_or(0)
    }

    /// The table a data request addresses, checking its dimension: the server's first step
    /// for Fetch, Push and Replicate (answer [`TableError::status`] on error).
    pub fn resolve(&self, id: u32, dim: u32) -> Result<&Table, TableError> {
        let t = self.get(id).ok_or(TableError::UnknownTable(id))?;
        if t.spec.dim != dim {
            return Err(TableError::WrongDim { table: id, dim: t.spec.dim, got: dim });
        }
        Ok(t)
    }

    /// The id of the table named `name`.
    pub fn id_of(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// Number of tables.
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    /// True with no tables.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// (id, table) pairs in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Table)> {
        self.tables.iter().enumerate().map(|(i, t)| (i as u32, t))
    }

    /// The definitions, by id.
    pub fn specs(&self) -> Vec<TableSpec> {
        self.tables.iter().map(|t| t.spec.clone()).collect()
    }

    /// Definitions with ids (the Tables response).
    pub fn infos(&self) -> Vec<TableInfo> {
        self.iter().map(|(id, t)| TableInfo { id, spec: t.spec.clone() }).collect()
    }

    /// Statistics per table.
    pub fn stats(&self) -> Vec<TableStats> {
        self.iter()
            .map(|(id, t)| TableStats {
                id,
                name: t.spec.name.clone(),
                rows: t.rows(),
                bytes: t.bytes(),
            })
            .collect()
    }

    /// Identifies this set's in-memory layout (random per instance, never 0).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    pub(crate) fn spec(name: &str, dim: u32, optimizer: Optimizer) -> TableSpec {
        TableSpec {
            name: name.into(),
            dim,
            seed: 11,
            init: Initializer::Uniform { scale: 0.1 },
            optimizer,
            admission: Default::default(),
            capacity: Default::default(),
        }
    }

    /// Whole-row copies of `keys` of `t`, as a Replicate with state carries them.
    fn state_copy(t: &Table, keys: &[u64]) -> (Vec<u8>, Vec<u8>) {
        let mut rows = vec![0f32; keys.len() * t.state_width()];
        t.read_state_into(keys, &mut rows).unwrap();
        let (mut kb, mut vb) = (vec![0u8; 8 * keys.len()], vec![0u8; 4 * rows.len()]);
        bex_ps_proto::wire::put_u64s(&mut kb, keys);
        bex_ps_proto::wire::put_f32s(&mut vb, &rows);
        (kb, vb)
    }

    #[test]
    fn copies_apply_only_over_older_rows_in_any_order() {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let src = Table::new(spec("t", 2, opt)).unwrap();
        src.push(&[1, 2], &[0.5; 4], None).unwrap();
        let first = state_copy(&src, &[1, 2]);
        src.push(&[1], &[0.25; 2], None).unwrap();
        let second = state_copy(&src, &[1, 2]);
        let dst = Table::new(spec("t", 2, opt)).unwrap();
        let apply = |(k, v): &(Vec<u8>, Vec<u8>)| {
            dst.apply_replica_state_le(LeU64s::new(k).unwrap(), LeF32s::new(v).unwrap()).unwrap()
        };
        assert_eq!(apply(&second), 2);
        assert_eq!(apply(&first), 0, "the late older copy changes nothing");
        assert_eq!(apply(&second), 0, "applying a copy twice changes nothing");
        assert_eq!(state_copy(&dst, &[1, 2]), second);
        // In the other order the newer copy of key 1 goes over the older: still two rows.
        let dst = Table::new(spec("t", 2, opt)).unwrap();
        let apply = |(k, v): &(Vec<u8>, Vec<u8>)| {
            dst.apply_replica_state_le(LeU64s::new(k).unwrap(), LeF32s::new(v).unwrap()).unwrap()
        };
        assert_eq!((apply(&first), apply(&second)), (2, 1));
        assert_eq!((dst.rows(), state_copy(&dst, &[1, 2])), (2, second.clone()));
        // Key 1 twice in one batch: applied in batch order, so older-then-newer writes both
        // and newer-then-older only the first; the newer copy stays either way.
        let row_bytes = 4 * src.state_width();
        let (old1, new1) = (&first.1[..row_bytes], &second.1[..row_bytes]);
        for (rows, written) in [([old1, new1], 2), ([new1, old1], 1)] {
            let dst = Table::new(spec("t", 2, opt)).unwrap();
            let keys = [first.0[..8].to_vec(), first.0[..8].to_vec()].concat();
            let rows = rows.concat();
            let n = dst
                .apply_replica_state_le(LeU64s::new(&keys).unwrap(), LeF32s::new(&rows).unwrap());
            assert_eq!(n.unwrap(), written);
            assert_eq!((dst.rows(), state_copy(&dst, &[1]).1), (1, new1.to_vec()));
        }
        // Versions: one per push of the row, never below the floor.
        let version = |t: &Table, key: u64| {
            let mut v = None;
            t.for_each_version(|k, ver| {
                if k == key {
                    v = Some(ver);
                }
            });
            v
        };
        assert_eq!((version(&src, 1), version(&src, 2)), (Some(2), Some(1)));
        src.version_floor.fetch_max(1000, Ordering::AcqRel);
        src.push(&[2], &[0.5; 2], None).unwrap();
        assert_eq!(version(&src, 2), Some(1000));
        assert_eq!(src.max_version(), 1000);
    }

    fn admitting(after_pushes: u32) -> Table {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let mut s = spec("t", 4, opt);
        s.admission.after_pushes = after_pushes;
        Table::new(s).unwrap()
    }

    #[test]
    fn a_key_gets_a_row_exactly_at_its_nth_push_and_fetches_create_nothing_before() {
        let keys: Vec<u64> = (0..1000).map(|i| i * 7919 + 3).collect();
        let t = admitting(3);
        let plain = admitting(0);
        let init = {
            let mut v = vec![0f32; 4 * keys.len()];
            plain.read_into(&keys, &mut v).unwrap();
            v
        };
        let grads = vec![0.5f32; 4 * keys.len()];
        let mut out = vec![0f32; 4 * keys.len()];
        for push in 1..=2 {
            assert_eq!(t.push(&keys, &grads, None).unwrap(), 0, "push {push}: nothing applied");
            let stats = t.fetch_into(&keys, &mut out).unwrap();
            assert_eq!((stats.created, stats.missing), (0, keys.len()), "fetches create nothing");
            assert_eq!(out, init, "an unadmitted key reads as its initial row");
            assert_eq!(t.rows(), 0);
        }
        assert_eq!(t.pushes_not_admitted(), 2000);
        // The third push admits every key and is applied, as a first push is without
        // admission.
        assert_eq!(t.push(&keys, &grads, None).unwrap(), keys.len());
        plain.push(&keys, &grads, None).unwrap();
        assert_eq!((t.rows(), t.admitted()), (1000, 1000));
        let mut want = vec![0f32; out.len()];
        plain.read_into(&keys, &mut want).unwrap();
        t.fetch_into(&keys, &mut out).unwrap();
        assert_eq!(out, want);
        assert_eq!(t.fetch_missing(), 2000, "the two fetches before admission");
        // Admitted keys take every later push.
        assert_eq!(t.push(&keys[..1], &grads[..4], None).unwrap(), 1);
    }

    #[test]
    fn replicas_store_no_row_for_a_never_pushed_key() {
        let src = admitting(2);
        src.push(&[1, 2], &[0.5; 8], None).unwrap(); // 1st push: counted only
        src.push(&[1], &[0.5; 4], None).unwrap(); // key 1 admitted
        let (k, v) = state_copy(&src, &[1, 2]);
        let dst = admitting(0);
        let n = dst.apply_replica_state_le(LeU64s::new(&k).unwrap(), LeF32s::new(&v).unwrap());
        assert_eq!(n.unwrap(), 1, "key 2's copy is its initial row: not stored");
        assert_eq!(dst.rows(), 1);
    }

    fn bounded(max_rows: u64, ttl_s: u64) -> Table {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let mut s = spec("t", 4, opt);
        s.capacity.max_rows = max_rows;
        s.capacity.ttl_s = ttl_s;
        Table::new(s).unwrap()
    }

    // The eviction order against a scan of the slab: under pushes (stale pairs), new rows
    // that displace, copies with older or equal versions, re-inserted keys and expiry, its
    // oldest is always the least (version, key) of the live rows, the newest their greatest,
    // and it holds at most twice the pairs a scan keeps.
    #[test]
    fn the_recency_order_names_the_rows_a_scan_of_the_slab_would() {
        // Fewer rows a stripe than a scan keeps pairs, and many more (a scan keeps 1 in 64).
        // Expiry as often as the stripe still fills.
        check_recency_order(24, 200, 20_000, 100);
        check_recency_order(3000, 8000, 12_000, 1);
    }

    /// Random pushes, copies and expiries (`expiries_per_mille` of the steps) on one stripe
    /// of `quota` rows.
    fn check_recency_order(quota: usize, keys: u64, steps: u64, expiries_per_mille: u32) {
        use rand::{Rng, SeedableRng};
        let t = bounded(64 * quota as u64, 0);
        let most_pairs = 2 * (quota / KEPT_PAIR_FRACTION).max(MIN_KEPT_PAIRS);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x4ea9 ^ quota as u64);
        let (mut displaced, mut expired, mut most_kept) = (0, 0, 0);
        let mut s = t.stripes[0].write();
        let live = |s: &Stripe| -> Vec<(u64, u64)> {
            (0..s.versions.len())
                .filter(|&r| s.versions[r] != FREE)
                .map(|r| (s.versions[r], s.key(r)))
                .collect()
        };
        for step in 0..steps {
            let mut rows = live(&s);
            let op = rng.random_range(0..1000);
            if op < 450 && !rows.is_empty() {
                // A push of a live row: its version moves up (often to the newest).
                let (v, key) = rows[rng.random_range(0..rows.len())];
                let r = s.find(key).unwrap() as usize;
                let up = if rng.random_bool(0.8) { step * 10 } else { v + 1 };
                s.set_version(r, up.max(v + 1));
            } else if op < 450 + expiries_per_mille {
                // Expiry of everything older than a cutoff: up to a quarter of the rows.
                rows.sort_unstable();
                let cutoff = rows.get(rng.random_range(0..=rows.len() / 4)).map_or(0, |r| r.0);
                while let Some((v, key)) = s.oldest() {
                    if v >= cutoff {
                        break;
                    }
                    let r = s.find(key).unwrap() as usize;
                    s.evict(r);
                    expired += 1;
                }
            } else {
                // A new row or a copy, of a key seen before or not, any version.
                let key = rng.random_range(0..keys);
                if s.find(key).is_none() {
                    let version = rng.random_range(0..=step * 10);
                    if let Some((_, Some(_))) = s.insert(key, version, &t.layout) {
                        displaced += 1;
                    }
                }
            }
            let rows = live(&s);
            assert_eq!(s.oldest(), rows.iter().min().copied(), "step {step}: the oldest");
            let newest = rows.iter().map(|r| r.0).max().unwrap_or(0);
            assert_eq!(s.newest_version(), newest, "step {step}: the newest");
            let low = s.order.as_ref().unwrap().low.len();
            assert!(low <= most_pairs, "step {step}: {low} pairs");
            assert!(rows.len() <= quota);
            most_kept = most_kept.max(s.order.as_ref().unwrap().keep);
        }
        // The stripe filled and expired, and scanned with as many pairs as its size gives.
        assert!(displaced > 100 && expired > 100, "{displaced} displaced, {expired} expired");
        assert_eq!(most_kept, (quota / KEPT_PAIR_FRACTION).max(MIN_KEPT_PAIRS));
    }

    /// Every row of `t` as sorted records (key, version, steps, values and state).
    fn all_records(t: &Table) -> Vec<Vec<u8>> {
        let mut all = Vec::new();
        for s in 0..STRIPES {
            t.export_records(ExportRows::Live, s, 0, usize::MAX, &mut all);
        }
        let mut recs: Vec<Vec<u8>> = all.chunks(t.record_len()).map(<[u8]>::to_vec).collect();
        recs.sort();
        recs
    }

    /// A Zipf-hot head of `head` keys (exponent 1.1) and a tail of keys pushed once.
    fn zipf_stream(seed: u64, n: usize, head: u64) -> Vec<u64> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let weights: Vec<f64> = (1..=head).map(|k| (k as f64).powf(-1.1)).collect();
        let total: f64 = weights.iter().sum();
        let mut cdf = Vec::with_capacity(weights.len());
        let mut acc = 0.0;
        for w in &weights {
            acc += w / total;
            cdf.push(acc);
        }
        let mut tail = 1u64 << 40;
        (0..n)
            .map(|_| {
                if rng.random_bool(0.3) {
                    tail += 1;
                    tail
                } else {
                    let u: f64 = rng.random();
                    cdf.partition_point(|&c| c < u) as u64
                }
            })
            .collect()
    }

    #[test]
    fn a_zipf_stream_with_a_long_tail_never_exceeds_capacity() {
        let t = bounded(1024, 0);
        let quota_max = 1024 / STRIPES;
        let stream = zipf_stream(1, 60_000, 5000);
        for (i, chunk) in stream.chunks(64).enumerate() {
            t.version_floor.fetch_max(1 + i as u64, Ordering::AcqRel);
            t.push(chunk, &vec![0.1; 4 * chunk.len()], None).unwrap();
            assert!(t.rows() <= 1024, "{} rows after batch {i}", t.rows());
            for s in 0..STRIPES {
                assert!(t.stripe_rows(s) <= quota_max, "stripe {s} over its share");
            }
        }
        assert_eq!(t.rows(), 1024, "full");
        assert!(t.evicted() > 10_000, "{} evicted", t.evicted());
        // The hottest keys were pushed in the last batches: still there.
        let mut out = vec![0f32; 4];
        assert_eq!(t.read_into(&[0], &mut out).unwrap().missing, 0, "the hottest key is kept");
        // Fetches do not create rows in a bounded table.
        let before = t.rows();
        t.fetch_into(&[u64::MAX - 1], &mut out).unwrap();
        assert_eq!(t.rows(), before);
        assert_eq!(all_records(&t).len(), 1024);
    }

    // `capacity.max_bytes` bounds rows at `row_bytes` each, as `max_rows` would, and the
    // table's own count of its memory stays within it.
    #[test]
    fn a_table_bounded_in_bytes_keeps_max_bytes_over_row_bytes_rows() {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let mut s = spec("t", 4, opt);
        let rows = 64 * 32;
        s.capacity.max_bytes = rows * s.row_bytes() + s.row_bytes() / 2;
        let max_bytes = s.capacity.max_bytes;
        let t = Table::new(s).unwrap();
        for (i, chunk) in zipf_stream(3, 40_000, 3000).chunks(64).enumerate() {
            t.version_floor.fetch_max(1 + i as u64, Ordering::AcqRel);
            t.push(chunk, &vec![0.1; 4 * chunk.len()], None).unwrap();
            assert!(t.rows() <= rows, "{} rows after batch {i}", t.rows());
            assert!(t.bytes() <= max_bytes, "{} bytes held after batch {i}", t.bytes());
        }
        assert_eq!(t.rows(), rows, "full");
        assert!(t.evicted() > 0);
    }

    // A training pod's fetch of a key whose row was evicted or expired: its initial row,
    // counted as missing, and no row made again (a bounded table creates rows on push).
    #[test]
    fn fetching_an_evicted_or_expired_key_reads_its_initial_row_and_counts_it() {
        let t = bounded(64, 10);
        let keys: Vec<u64> = (0..1000).map(mix64).collect();
        for (i, chunk) in keys.chunks(100).enumerate() {
            t.version_floor.fetch_max(1_000_000 + i as u64, Ordering::AcqRel);
            t.push(chunk, &vec![0.3; 4 * chunk.len()], None).unwrap();
        }
        assert_eq!(t.rows(), 64);
        let mut out = vec![0f32; 4];
        let (kept, evicted): (Vec<u64>, Vec<u64>) =
            keys.iter().partition(|&&k| t.read_into(&[k], &mut out).unwrap().missing == 0);
        assert_eq!((kept.len(), evicted.len() as u64), (64, t.evicted()));
        let initial = |keys: &[u64]| {
            let mut v = vec![0f32; 4 * keys.len()];
            bounded(64, 10).read_into(keys, &mut v).unwrap();
            v
        };
        let missing_before = t.fetch_missing();
        let mut got = vec![0f32; 4 * evicted.len()];
        let st = t.fetch_into(&evicted, &mut got).unwrap();
        assert_eq!((st.missing, st.created), (evicted.len(), 0));
        assert_eq!(got, initial(&evicted), "an evicted key reads as its initial row");
        assert_eq!(t.fetch_missing() - missing_before, evicted.len() as u64);
        assert_eq!(t.rows(), 64, "fetches made no row again");
        // The kept rows were pushed: not their initial rows, and not missing.
        let mut got = vec![0f32; 4 * kept.len()];
        assert_eq!(t.fetch_into(&kept, &mut got).unwrap().missing, 0);
        assert_ne!(got, initial(&kept));
        // Expired: a cut-off past every push takes the kept rows too.
        assert_eq!(t.expire(u64::MAX), 64);
        let st = t.fetch_into(&kept, &mut got).unwrap();
        assert_eq!((st.missing, st.created), (kept.len(), 0));
        assert_eq!(got, initial(&kept), "an expired key reads as its initial row");
        assert_eq!(t.fetch_missing() - missing_before, (evicted.len() + kept.len()) as u64);
    }

    #[test]
    fn replicas_fed_the_same_copies_in_any_order_keep_the_same_rows() {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let primary = bounded(256, 0);
        let mut copies = Vec::new();
        for (i, chunk) in zipf_stream(2, 20_000, 2000).chunks(32).enumerate() {
            primary.version_floor.fetch_max(1000 + i as u64, Ordering::AcqRel);
            primary.push(chunk, &vec![0.2; 4 * chunk.len()], None).unwrap();
            // What replication sends: the pushed keys' rows, read after the push.
            copies.push(state_copy(&primary, chunk));
        }
        let want = all_records(&primary);
        assert_eq!(want.len(), 256);
        for seed in 0..3 {
            let replica = bounded(256, 0);
            let mut order = copies.clone();
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
            for (k, v) in &order {
                replica
                    .apply_replica_state_le(LeU64s::new(k).unwrap(), LeF32s::new(v).unwrap())
                    .unwrap();
            }
            assert_eq!(all_records(&replica), want, "order {seed}: the same rows, bit for bit");
        }
    }

    #[test]
    fn rows_not_pushed_within_the_ttl_expire_on_every_pod_alike() {
        let t = bounded(0, 10);
        t.version_floor.fetch_max(1_000_000, Ordering::AcqRel);
        t.push(&[1, 2, 3], &[0.1; 12], None).unwrap();
        t.version_floor.fetch_max(5_000_000, Ordering::AcqRel);
        t.push(&[3, 4], &[0.1; 8], None).unwrap();
        // Rows last pushed before 1.000001 s go: 1 and 2; 3 (pushed again) and 4 stay.
        assert_eq!(t.expire(1_000_001), 2);
        assert_eq!((t.rows(), t.expired()), (2, 2));
        let mut out = vec![0f32; 8];
        let st = t.read_into(&[1, 4], &mut out).unwrap();
        assert_eq!(st.missing, 1, "an expired key reads as its initial row");
        // A new row reuses a freed slot; live rows never move.
        t.push(&[9], &[0.1; 4], None).unwrap();
        assert_eq!(all_records(&t).len(), 3);
        assert_eq!(t.expire(u64::MAX), 3);
        assert_eq!(t.rows(), 0);
    }

    // The push clock behind the floor: pushes still order by recency. Two keys of one
    // stripe (2 rows each), the larger pushed first; a third push must evict the larger.
    #[test]
    fn pushes_order_by_recency_while_the_clock_is_behind_the_floor() {
        let t = bounded(2 * STRIPES as u64, 0);
        t.raise_version_floor(1_000_000);
        let stripe = |k: u64| t.stripe_index(k);
        let mut same: Vec<u64> = (1..10_000u64).filter(|&k| stripe(k) == stripe(1)).collect();
        same.truncate(3);
        let (small, large, third) = (same[0], same[1], same[2]);
        for (clock, key) in [(10, large), (11, small), (12, third)] {
            t.advance_version_floor(clock);
            t.push(&[key], &[0.1; 4], None).unwrap();
        }
        // With the floor alone, `large` and `small` shared a version and `small` went.
        assert!(!t.contains(large) && t.contains(small) && t.contains(third));
        // A clock ahead of the floor sets it.
        assert_eq!(t.advance_version_floor(5_000_000), 5_000_000);
        assert_eq!(t.advance_version_floor(4_000_000), 5_000_001);
    }

    /// A full bounded stripe holds at most its quota's slots (65 rows per stripe here: by
    /// doubling alone, 128).
    #[test]
    fn a_bounded_stripe_allocates_no_more_than_its_quota() {
        let t = bounded(65 * STRIPES as u64, 0);
        let keys: Vec<u64> = (0..20_000).map(mix64).collect();
        for chunk in keys.chunks(500) {
            t.push(chunk, &vec![0.1; chunk.len() * 4], None).unwrap();
        }
        for (i, s) in t.stripes.iter().enumerate() {
            let s = s.read();
            assert_eq!(s.live(), 65, "stripe {i} is full");
            assert!(s.versions.capacity() <= 65, "stripe {i}: {} slots", s.versions.capacity());
            assert!(s.data.capacity() <= 65 * s.slot, "stripe {i}: {} words", s.data.capacity());
        }
    }

    /// Expiry follows the table's newest push, capped by the wall clock plus an allowance:
    /// a pause expires nothing while it lasts, pods with other clocks (also a training pod
    /// behind its own versions) drop the same rows, a future version moves the clock only
    /// as far as the allowance.
    #[test]
    fn expiry_follows_the_newest_push_not_the_wall_clock() {
        // Push times from B on (µs), so a wall clock minus the allowance is still positive.
        const S: u64 = 1_000_000;
        const B: u64 = 1000 * S;
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let mut s = spec("t", 4, opt);
        s.capacity.ttl_s = 10;
        let pod = || {
            let set = TableSet::new(vec![s.clone()]).unwrap();
            set.raise_version_floor(B + S);
            set.get(0).unwrap().push(&[1, 2, 3], &[0.1; 12], None).unwrap();
            set.raise_version_floor(B + 5 * S);
            set.get(0).unwrap().push(&[3], &[0.1; 4], None).unwrap();
            set
        };
        let (training, ahead) = (pod(), pod());
        // Training paused: an hour of wall clock later, nothing has expired.
        assert_eq!(training.expire(B + 3600 * S), 0, "a pause expires nothing");
        assert_eq!(ahead.expire(u64::MAX), 0, "nor does a clock far ahead");
        // 12 s of pushes: rows last pushed before 2 s go (1 and 2), on both pods alike.
        for p in [&training, &ahead] {
            p.raise_version_floor(B + 12 * S);
            p.get(0).unwrap().push(&[4], &[0.1; 4], None).unwrap();
        }
        // The training pod's wall clock a second behind its newest version (a floor raised
        // above a replica's after a restart): it expires by that version all the same.
        assert_eq!(training.expire(B + 11 * S), 2, "a training pod whose clock is behind");
        assert_eq!(ahead.expire(B + 3600 * S), 2);
        assert_eq!(all_records(training.get(0).unwrap()), all_records(ahead.get(0).unwrap()));
        // A copy from the future moves the clock only as far as the wall clock allows.
        let t = training.get(0).unwrap();
        let mut row = vec![0f32; t.state_width()];
        t.read_state_into(&[9], &mut row).unwrap();
        let v = MAX_VERSION - 1;
        let w = t.stride();
        (row[w + 1], row[w + 2]) = (f32::from_bits(v as u32), f32::from_bits((v >> 32) as u32));
        let le: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
        t.apply_replica_state_le(
            LeU64s::new(&9u64.to_le_bytes()).unwrap(),
            LeF32s::new(&le).unwrap(),
        )
        .unwrap();
        let allowance = TTL_SKEW_ALLOWANCE_US;
        assert_eq!(training.expire(B + 13 * S - allowance), 0, "rows 3 (5 s), 4 (12 s) stay");
        assert_eq!(training.expire(B + 16 * S - allowance), 1, "at 16 s, row 3 goes");
    }

    /// A table large enough that its stripes warm batches (`WARM_ABOVE_BYTES`) serves the
    /// same rows as tables too small to warm, fetched and pushed in shuffled batches.
    #[test]
    fn warmed_batches_serve_the_same_rows_as_unwarmed_ones() {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        let big = Table::new(spec("t", 16, opt)).unwrap();
        let n = 120_000u64;
        let keys: Vec<u64> = (0..n).map(mix64).collect();
        for chunk in keys.chunks(1000) {
            big.push(chunk, &vec![0.25; chunk.len() * 16], None).unwrap();
        }
        let slab = big.stripe_len(0) * (2 + big.stride()) * 4;
        assert!(slab > WARM_ABOVE_BYTES, "stripe 0 holds {slab} B: the test would not warm");
        let mut batch: Vec<u64> = keys.iter().step_by(97).copied().collect();
        batch.extend([1, 2, 3]); // absent: the initial rows
        batch.reverse();
        big.push(&batch, &vec![0.5; batch.len() * 16], None).unwrap();
        let mut got = vec![0f32; batch.len() * 16];
        big.read_into(&batch, &mut got).unwrap();
        for (i, &k) in batch.iter().enumerate() {
            // The same pushes of this key alone, in a table too small to warm.
            let small = Table::new(spec("t", 16, opt)).unwrap();
            if k > 3 {
                small.push(&[k], &[0.25; 16], None).unwrap();
            }
            small.push(&[k], &[0.5; 16], None).unwrap();
            let mut want = vec![0f32; 16];
            small.read_into(&[k], &mut want).unwrap();
            assert_eq!(&got[i * 16..(i + 1) * 16], &want[..], "key {k}");
        }
    }

    #[test]
    fn a_pushed_key_always_gets_its_row_even_behind_a_row_pushed_twice() {
        let t = bounded(64, 0); // one row per stripe
        let a = 1u64;
        let b = (2..).find(|&k| t.stripe_of(k) == t.stripe_of(a)).unwrap();
        // A pushed twice in the batch runs one version ahead of the floor; B still displaces it.
        assert_eq!(t.push(&[a, a, b], &[0.1; 12], None).unwrap(), 3);
        let mut out = vec![0f32; 8];
        assert_eq!(t.read_into(&[a, b], &mut out).unwrap().missing, 1, "A displaced, B kept");
        assert_eq!(t.evicted(), 1);
    }

    /// A floor raised past what copies may carry (a catch-up from a replica holding a corrupt
    /// version) stops at [`MAX_VERSION`]: later pushes still replicate.
    #[test]
    fn pushes_after_a_floor_raised_past_the_copy_bound_still_replicate() {
        let src = Table::new(spec("t", 2, Optimizer::Sgd { lr: 0.1 })).unwrap();
        src.raise_version_floor(MAX_VERSION + 1);
        src.raise_version_floor(u64::MAX);
        src.push(&[5], &[0.5; 2], None).unwrap();
        src.push(&[5], &[0.5; 2], None).unwrap();
        let (k, v) = state_copy(&src, &[5]);
        let dst = Table::new(spec("t", 2, Optimizer::Sgd { lr: 0.1 })).unwrap();
        let got = dst.apply_replica_state_le(LeU64s::new(&k).unwrap(), LeF32s::new(&v).unwrap());
        assert_eq!(got.unwrap(), 1, "the replica takes the row");
        let mut out = [0f32; 2];
        dst.read_into(&[5], &mut out).unwrap();
        let mut want = [0f32; 2];
        src.read_into(&[5], &mut want).unwrap();
        assert_eq!(out, want);
    }

    #[test]
    fn a_copy_with_a_version_beyond_any_push_time_is_refused() {
        let src = Table::new(spec("t", 2, Optimizer::Sgd { lr: 0.1 })).unwrap();
        src.push(&[5], &[0.5; 2], None).unwrap();
        let (k, mut v) = state_copy(&src, &[5]);
        // The version's high word (the last word of the row) set to all ones.
        let n = v.len();
        v[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        let dst = Table::new(spec("t", 2, Optimizer::Sgd { lr: 0.1 })).unwrap();
        let got = dst.apply_replica_state_le(LeU64s::new(&k).unwrap(), LeF32s::new(&v).unwrap());
        assert!(matches!(got, Err(TableError::BadVersion { index: 0, .. })), "{got:?}");
        assert_eq!(dst.rows(), 0);
    }

    // A snapshot chunk's records come from a peer (its CRC is no authentication): a NaN in
    // a row's values or state stores nothing, as a Replicate's would not.
    #[test]
    fn imported_records_with_a_non_finite_value_are_refused_whole() {
        let src = bounded(0, 0); // dim 4, Adagrad, unbounded
        src.push(&[5, 6], &[0.5; 8], None).unwrap();
        let mut records = Vec::new();
        for s in 0..STRIPES {
            src.export_records(ExportRows::Live, s, 0, usize::MAX, &mut records);
        }
        let rl = src.record_len();
        assert_eq!(records.len(), 2 * rl);
        // The last word of the first record (a state slot), the first value of the second
        // (after its key, version and steps).
        for at in [rl - 4, rl + 20] {
            let mut bad = records.clone();
            bad[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            let dst = Table::new(src.spec().clone()).unwrap();
            let got = dst.import_records(&bad, RecordFormat::Versioned, &mut |_| {});
            assert!(matches!(got, Err(TableError::NonFinite { .. })), "{got:?}");
            assert_eq!(dst.rows(), 0, "nothing stored");
        }
        let dst = Table::new(src.spec().clone()).unwrap();
        assert_eq!(dst.import_records(&records, RecordFormat::Versioned, &mut |_| {}).unwrap(), 2);
    }

    #[test]
    fn whole_rows_replicate_optimizer_state_and_steps_bit_exactly() {
        let opt = Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let src = Table::new(spec("t", 3, opt)).unwrap();
        let keys = [4u64, 9, 4, 17];
        for step in 0..5 {
            let g: Vec<f32> = (0..12).map(|i| (i + step) as f32 * 0.37 - 2.0).collect();
            src.push(&keys, &g, None).unwrap();
        }
        let w = src.state_width();
        let ks = [4u64, 9, 17, 99]; // 99 was never pushed: a new row, nothing created
        let mut rows = vec![0f32; ks.len() * w];
        src.read_state_into(&ks, &mut rows).unwrap();
        assert_eq!(src.rows(), 3);
        let mut kb = vec![0u8; 8 * ks.len()];
        let mut vb = vec![0u8; 4 * rows.len()];
        bex_ps_proto::wire::put_u64s(&mut kb, &ks);
        bex_ps_proto::wire::put_f32s(&mut vb, &rows);
        let dst = Table::new(spec("t", 3, opt)).unwrap();
        let (k, v) = (LeU64s::new(&kb).unwrap(), LeF32s::new(&vb).unwrap());
        // 99's copy is its initial row (version 0): not stored.
        assert_eq!(dst.apply_replica_state_le(k, v).unwrap(), 3);
        let (a, b) = (all_records(&src), all_records(&dst));
        assert_eq!(a, b, "values, state, steps and versions equal bit for bit");
        // A non-finite element is refused before anything is written.
        // Row 0's second element: exponent bits all ones (infinite or NaN).
        vb[7] = 0x7f;
        vb[6] |= 0x80;
        let bad = Table::new(spec("t", 3, opt)).unwrap();
        let (k, v) = (LeU64s::new(&kb).unwrap(), LeF32s::new(&vb).unwrap());
        assert!(bad.apply_replica_state_le(k, v).is_err());
        assert_eq!(bad.rows(), 0);
    }

    #[test]
    fn fetch_creates_deterministic_rows_and_read_does_not() {
        let t = Table::new(spec("t", 4, Optimizer::Sgd { lr: 0.1 })).unwrap();
        let u = Table::new(spec("t", 4, Optimizer::Sgd { lr: 0.1 })).unwrap();
        let keys = [1u64, 2, 1, 99];
        let mut a = vec![0f32; 16];
        let st = t.fetch_into(&keys, &mut a).unwrap();
        // Key 1 twice: both occurrences found no row when the fetch began; one created it.
        assert_eq!(st, FetchStats { rows: 4, missing: 4, created: 3 });
        assert_eq!(t.rows(), 3);
        assert_eq!(a[0..4], a[8..12], "same key, same row");
        let mut b = vec![0f32; 16];
        assert_eq!(u.read_into(&keys, &mut b).unwrap().created, 0);
        assert_eq!(u.rows(), 0);
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(matches!(t.fetch_into(&keys, &mut a[..15]), Err(TableError::WrongLength { .. })));
    }

    #[test]
    fn le_paths_match_slice_paths() {
        let t = Table::new(spec(
            "t",
            3,
            Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 },
        ))
        .unwrap();
        let keys = [5u64, 6];
        let mut kb = vec![0u8; 16];
        bex_ps_proto::wire::put_u64s(&mut kb, &keys);
        let mut out = vec![0u8; 24];
        t.fetch_into_le(LeU64s::new(&kb).unwrap(), &mut out, true).unwrap();
        let mut want = vec![0f32; 6];
        t.fetch_into(&keys, &mut want).unwrap();
        assert_eq!(LeF32s::new(&out).unwrap().to_vec(), want);

        let grads = [0.1f32, 0.2, 0.3, -0.1, -0.2, -0.3];
        let mut gb = vec![0u8; 24];
        bex_ps_proto::wire::put_f32s(&mut gb, &grads);
        let u = Table::new(t.spec().clone()).unwrap();
        let mut r1 = vec![0f32; 6];
        let mut r2 = vec![0f32; 6];
        t.push(&keys, &grads, Some(&mut r1)).unwrap();
        u.push_le(LeU64s::new(&kb).unwrap(), LeF32s::new(&gb).unwrap(), Some(&mut r2)).unwrap();
        assert_eq!(r1, r2);
        let mut now = vec![0f32; 6];
        t.fetch_into(&keys, &mut now).unwrap();
        assert_eq!(now, r1, "updated rows are the stored rows");
    }

    #[test]
    fn push_rejects_before_applying() {
        let t = Table::new(spec("t", 2, Optimizer::Sgd { lr: 1.0 })).unwrap();
        let mut before = vec![0f32; 4];
        t.fetch_into(&[1, 2], &mut before).unwrap();
        assert_eq!(
            t.push(&[1, 2], &[1.0, 1.0, f32::NAN, 0.0], None),
            Err(TableError::NonFinite { index: 2 })
        );
        assert!(matches!(t.push(&[1, 2], &[1.0; 3], None), Err(TableError::WrongLength { .. })));
        let mut after = vec![0f32; 4];
        t.fetch_into(&[1, 2], &mut after).unwrap();
        assert_eq!(before, after);
    }

    #[test]
    fn replica_converges_to_trainer_bits() {
        let opt = Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
        let trainer = Table::new(spec("t", 4, opt)).unwrap();
        let replica = Table::new(spec("t", 4, opt)).unwrap();
        for step in 0..20u32 {
            let keys: Vec<u64> = (0..10).map(|k| (k * 7 + step as u64) % 13).collect();
            let grads: Vec<f32> =
                (0..40).map(|i| ((i as f32) * 0.37 + step as f32).sin()).collect();
            let mut out = vec![0f32; 40];
            trainer.push(&keys, &grads, Some(&mut out)).unwrap();
            replica.apply_replica(&keys, &out).unwrap();
        }
        let keys: Vec<u64> = (0..13).collect();
        let (mut a, mut b) = (vec![0f32; 52], vec![0f32; 52]);
        trainer.fetch_into(&keys, &mut a).unwrap();
        replica.fetch_into(&keys, &mut b).unwrap();
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn push_applies_optimizer_from_initial_value() {
        let mut s = spec("t", 2, Optimizer::Sgd { lr: 0.5 });
        s.init = Initializer::Constant { value: 1.0 };
        let t = Table::new(s).unwrap();
        t.push(&[3, 3], &[1.0, 2.0, 1.0, 2.0], None).unwrap();
        let mut out = [0f32; 2];
        t.fetch_into(&[3], &mut out).unwrap();
        assert_eq!(out, [0.0, -1.0]); // 1 − 0.5·1 − 0.5·1, 1 − 0.5·2 − 0.5·2
    }

    #[test]
    fn export_import_round_trip_with_state() {
        let opt =
            Optimizer::Ftrl { alpha: 0.1, beta: 1.0, l1: 0.0, l2: 0.0, initial_accumulator: 0.1 };
        let t = Table::new(spec("t", 3, opt)).unwrap();
        let keys: Vec<u64> = (0..500).collect();
        let grads: Vec<f32> = (0..1500).map(|i| (i % 7) as f32 * 0.1).collect();
        t.push(&keys, &grads, None).unwrap();
        let u = Table::new(t.spec().clone()).unwrap();
        let mut buf = Vec::new();
        let mut n = 0;
        for s in 0..STRIPES {
            n += t.export_records(ExportRows::Live, s, 0, usize::MAX, &mut buf).1;
        }
        assert_eq!(n, 500);
        assert_eq!(buf.len(), 500 * t.record_len());
        assert_eq!(u.import_records(&buf, RecordFormat::Versioned, &mut |_| {}).unwrap(), 500);
        assert!(u.import_records(&buf[1..], RecordFormat::Versioned, &mut |_| {}).is_err());
        // Same state: one more identical push gives identical rows.
        let (mut a, mut b) = (vec![0f32; 1500], vec![0f32; 1500]);
        t.push(&keys, &grads, Some(&mut a)).unwrap();
        u.push(&keys, &grads, Some(&mut b)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn table_set_names_bad_fields() {
        let mut bad = spec("a", 0, Optimizer::Sgd { lr: -1.0 });
        bad.name = "a b".into();
        let dup = spec("x", 4, Optimizer::default());
        let err = TableSet::new(vec![dup.clone(), bad, dup]).unwrap_err();
        let TableError::Invalid(errs) = err else { panic!() };
        let fields: Vec<_> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            ["tables[1].name", "tables[1].dim", "tables[1].optimizer.lr", "tables[2].name"]
        );
        let ok = TableSet::new(vec![
            spec("a", 2, Optimizer::default()),
            spec("b", 3, Optimizer::default()),
        ])
        .unwrap();
        assert_eq!(ok.id_of("b"), Some(1));
        assert_eq!(ok.get(1).unwrap().dim(), 3);
        assert!(ok.get(2).is_none());
        assert_eq!(ok.resolve(1, 3).unwrap().spec().name, "b");
        let e = ok.resolve(1, 4).unwrap_err();
        assert_eq!(e, TableError::WrongDim { table: 1, dim: 3, got: 4 });
        assert_eq!(e.status(), Status::WrongDim);
        assert_eq!(ok.resolve(9, 3).unwrap_err().status(), Status::UnknownTable);
        assert_ne!(ok.epoch(), 0);
    }

    /// 4 threads fetch and push overlapping keys; every push is accounted for exactly:
    /// with SGD lr = 1, constant init 0 and gradient −1 per push, a row's value is the
    /// number of pushes that touched it.
    #[test]
    fn concurrent_fetch_and_push_stress() {
        let mut s = spec("t", 8, Optimizer::Sgd { lr: 1.0 });
        s.init = Initializer::Zeros;
        let t = Arc::new(Table::new(s).unwrap());
        let threads = 4;
        let rounds = 300;
        let keys_per = 64u64;
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    let mut out = vec![0f32; keys_per as usize * 8];
                    for r in 0..rounds {
                        let keys: Vec<u64> =
                            (0..keys_per).map(|k| (k * 31 + r as u64 + th) % 200).collect();
                        let grads = vec![-1f32; keys.len() * 8];
                        t.push(&keys, &grads, None).unwrap();
                        t.fetch_into(&keys, &mut out).unwrap();
                        // A row is never torn: all 8 elements agree.
                        for row in out.chunks_exact(8) {
                            assert!(row.iter().all(|&x| x == row[0]), "{row:?}");
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut expected = vec![0f32; 200];
        for th in 0..threads {
            for r in 0..rounds {
                for k in 0..keys_per {
                    expected[((k * 31 + r as u64 + th) % 200) as usize] += 1.0;
                }
            }
        }
        let keys: Vec<u64> = (0..200).collect();
        let mut out = vec![0f32; 1600];
        t.read_into(&keys, &mut out).unwrap();
        for (k, row) in out.chunks_exact(8).enumerate() {
            assert_eq!(row[0], expected[k], "key {k}");
        }
        assert_eq!(t.rows(), 200);
        assert!(t.bytes() >= 200 * 8 * 4);
    }
}
