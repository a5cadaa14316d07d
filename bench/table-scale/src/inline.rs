//! A prototype layout, measured beside the table to learn what it would gain: rows inline in
//! the index. Each bucket is one cache line of `WAYS` keys followed by those keys' rows, so
//! a lookup's second load (the row) falls in the page of its first (the keys) and needs no
//! second page walk; the table's index and slab are two arrays, so its lookups walk twice at
//! sizes the TLB does not cover. Not a store to serve from: it is sized once for its rows
//! (rows move if it grows, which snapshot cursors over row numbers cannot follow; a cursor
//! by index position could) and has no removal or stripes.

use bex_ps_core::prefetch::prefetch;
use bex_ps_proto::shard::mix64;
use bex_ps_proto::TableSpec;

use crate::Rows;

/// Keys per bucket: 7 keys of two words fill a 64-byte line with one word to spare.
const WAYS: usize = 7;
/// Words of a bucket's key line: 14 key words, then the overflow mark and one spare.
const KEY_LINE: usize = 16;
/// Where the overflow mark is in the key line.
const OVERFLOWED: usize = 14;
/// Keys warmed together, then served: as the table's warm pass chunks them (64 measured
/// 115 µs against 131 at 100M rows in one round each, 128 and 256 no better than 32:
/// `results/table-scale/runs/prefetch-warm-2026-12-07/`).
const WARM_CHUNK: usize = 32;
/// How a prototype is laid out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// Buckets are sized for this load (keys / slots).
    pub(crate) load: f64,
    /// A second line a bucket after the key line: its rows' versions (u64 each, written by
    /// every push), which a table's rows must carry (eviction order, copies over older rows).
    pub(crate) versions: bool,
}

impl Shape {
    /// Close to the table's memory per row, without versions.
    pub(crate) const BARE: Shape = Shape { load: 0.85, versions: false };
    /// With versions, at a load where memory per row at dim 16 (Adagrad: 128 B of values
    /// and state, 136 B with the key) keeps within the 1.2x (163.2 B): a bucket of
    /// 2 lines and 7 rows is 1024 B, / (7 x 0.9) = 162.5 B a row; at 0.85 it was 172.1 B.
    pub(crate) const VERSIONED: Shape = Shape { load: 0.9, versions: true };
}

pub(crate) struct Inline {
    spec: TableSpec,
    /// f32 words per row (values, then state).
    stride: usize,
    /// Words per bucket, whole cache lines.
    bucket_words: usize,
    /// Words before the first row of a bucket: the key line, and the version line if any.
    head_words: usize,
    buckets: usize,
    /// Where bucket 0 starts in `words`: a page boundary, so a bucket of 1024 bytes (the
    /// versioned shape at dim 16) never straddles two pages.
    base: usize,
    words: Vec<f32>,
    /// Pushes so far: the versions a versioned shape stamps.
    pushes: u64,
}

/// The two words of a key (0 marks an empty way; SplitMix64 keys of 1..2^64 are not 0).
fn halves(key: u64) -> (u32, u32) {
    (key as u32, (key >> 32) as u32)
}

impl Inline {
    pub(crate) fn new(spec: TableSpec, rows: u64, shape: Shape) -> Inline {
        let stride = spec.stride();
        let head_words = if shape.versions { 2 * KEY_LINE } else { KEY_LINE };
        let bucket_words = (head_words + WAYS * stride).div_ceil(16) * 16;
        let buckets = ((rows as f64 / (WAYS as f64 * shape.load)).ceil() as usize).max(1);
        const PAGE: usize = 4096;
        let words = vec![0f32; buckets * bucket_words + PAGE / 4];
        let base = (PAGE - words.as_ptr().addr() % PAGE) % PAGE / 4;
        Inline { spec, stride, bucket_words, head_words, buckets, base, words, pushes: 0 }
    }

    /// Stamps the row starting at `row` with the next version, if versions are kept.
    fn stamp(&mut self, row: usize) {
        if self.head_words == KEY_LINE {
            return;
        }
        self.pushes += 1;
        let rel = row - self.base;
        let (b, way) =
            (rel / self.bucket_words, (rel % self.bucket_words - self.head_words) / self.stride);
        let at = self.at(b) + KEY_LINE + 2 * way;
        self.words[at] = f32::from_bits(self.pushes as u32);
        self.words[at + 1] = f32::from_bits((self.pushes >> 32) as u32);
    }

    fn home(&self, key: u64) -> usize {
        ((u128::from(mix64(key ^ 0x9e37_79b9_7f4a_7c15)) * self.buckets as u128) >> 64) as usize
    }

    fn at(&self, bucket: usize) -> usize {
        self.base + bucket * self.bucket_words
    }

    /// The way of `key` in bucket `b`, if there.
    fn way(&self, b: usize, key: u64) -> Option<usize> {
        let (lo, hi) = halves(key);
        let line = &self.words[self.at(b)..self.at(b) + KEY_LINE];
        (0..WAYS).find(|&i| line[2 * i].to_bits() == lo && line[2 * i + 1].to_bits() == hi)
    }

    /// Where `key`'s row starts in `words`, if it has one.
    fn find(&self, key: u64) -> Option<usize> {
        let mut b = self.home(key);
        for _ in 0..self.buckets {
            if let Some(i) = self.way(b, key) {
                return Some(self.at(b) + self.head_words + i * self.stride);
            }
            if self.words[self.at(b) + OVERFLOWED].to_bits() == 0 {
                return None;
            }
            b = (b + 1) % self.buckets;
        }
        None
    }

    /// Places `key` in the first bucket from its home with an empty way (marking the full
    /// ones passed) and initializes its row; where the row starts. Panics when every way
    /// is taken: the prototype is sized once, for the rows it is given.
    fn insert(&mut self, key: u64) -> usize {
        let mut b = self.home(key);
        let mut passed = 0;
        let free = loop {
            if let Some(i) = self.way(b, 0) {
                break i;
            }
            assert!(passed < self.buckets, "the inline prototype is full");
            passed += 1;
            let at = self.at(b) + OVERFLOWED;
            self.words[at] = f32::from_bits(1);
            b = (b + 1) % self.buckets;
        };
        let (lo, hi) = halves(key);
        let at = self.at(b);
        self.words[at + 2 * free] = f32::from_bits(lo);
        self.words[at + 2 * free + 1] = f32::from_bits(hi);
        let row = at + self.head_words + free * self.stride;
        let dim = self.spec.dim as usize;
        let (w, s) = self.words[row..row + self.stride].split_at_mut(dim);
        self.spec.init.fill(self.spec.seed, key, w);
        self.spec.optimizer.init_state(s);
        row
    }

    /// Starts loading the home key lines of `keys` (at most `WARM_CHUNK`), then the rows
    /// found there, before any key is served, as the table's `warm` does: the rows found
    /// first, then their prefetches in a loop of their own.
    fn warm(&self, keys: &[u64], row_words: usize) {
        debug_assert!(keys.len() <= WARM_CHUNK, "{} keys", keys.len());
        let mut homes = [0usize; WARM_CHUNK];
        let mut rows = [0usize; WARM_CHUNK];
        for (h, &k) in homes.iter_mut().zip(keys) {
            *h = self.home(k);
            prefetch(&self.words[self.at(*h)]);
        }
        let found = homes.iter().zip(keys).filter_map(|(&h, &k)| {
            self.way(h, k).map(|i| self.at(h) + self.head_words + i * self.stride)
        });
        let m = found.zip(rows.iter_mut()).fold(0, |m, (row, slot)| {
            *slot = row;
            m + 1
        });
        for &row in &rows[..m] {
            for w in (row..row + row_words).step_by(16) {
                prefetch(&self.words[w]);
            }
            prefetch(&self.words[row + row_words - 1]);
        }
    }
}

impl Rows for Inline {
    // Each chunk is warmed, then served, before the next is warmed: a 1000-key batch
    // warmed whole touched more pages than the TLB keeps, so serving walked each page again
    // (run 13). The table serves a stripe's group, about 16 keys, right after warming it.
    fn push(&mut self, keys: &[u64], grads: &[f32]) {
        let dim = self.spec.dim as usize;
        for (keys, grads) in keys.chunks(WARM_CHUNK).zip(grads.chunks(WARM_CHUNK * dim)) {
            self.warm(keys, self.stride);
            for (&k, g) in keys.iter().zip(grads.chunks_exact(dim)) {
                let row = match self.find(k) {
                    Some(row) => row,
                    None => self.insert(k),
                };
                let (w, s) = self.words[row..row + self.stride].split_at_mut(dim);
                self.spec.optimizer.apply(w, s, &mut 0, g);
                self.stamp(row);
            }
        }
    }

    fn fetch(&mut self, keys: &[u64], out: &mut [f32]) {
        let dim = self.spec.dim as usize;
        for (keys, out) in keys.chunks(WARM_CHUNK).zip(out.chunks_mut(WARM_CHUNK * dim)) {
            self.warm(keys, dim);
            for (&k, o) in keys.iter().zip(out.chunks_exact_mut(dim)) {
                match self.find(k) {
                    Some(row) => o.copy_from_slice(&self.words[row..row + dim]),
                    None => self.spec.init.fill(self.spec.seed, k, o),
                }
            }
        }
    }
}
