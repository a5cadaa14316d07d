//! A second prototype of rows inline in the index, measured beside the table and `inline`:
//! a bucket is one 4 KiB page, a line of one-byte tags then records of (key, version, row).
//! `inline-versioned`'s 1 KiB buckets of 7 keys overflow about 8% of keys at load 0.9, and a key beyond
//! its home bucket waits for the next bucket's line before its row (+16 ns a key at 100M
//! rows, `results/table-scale/runs/prefetch-warm-2026-12-07/`). A page of 28 records at the
//! same load overflows about half as many (4.5% in a test of 50K keys). The key sits in its record, so a lookup
//! reads the tag line, then the record's lines in the same page. Each key is hashed once a
//! batch. Not a store to serve from, for `inline`'s reasons: sized once, no removal.

use bex_ps_core::prefetch::prefetch;
use bex_ps_proto::shard::mix64;
use bex_ps_proto::TableSpec;

use crate::Rows;

/// f32 words a page.
const PAGE_WORDS: usize = 1024;
/// The tag line: 60 one-byte tags (0 = empty way), then the overflow mark.
const TAG_WORDS: usize = 16;
const MAX_WAYS: usize = 60;
const OVERFLOWED: usize = 15;
/// A record's words before its row: the key (low, high), the version (low, high).
const HEAD: usize = 4;
/// Keys warmed together, then served, as `inline` and the table's warm pass chunk them.
const CHUNK: usize = 32;
/// Buckets are sized for this load: at dim 16 (Adagrad, records of 144 B, 28 a page),
/// 4096 B / (28 x 0.9) = 162.5 B a row, within the 1.2x of 136 B.
const LOAD: f64 = 0.9;

pub(crate) struct Paged {
    spec: TableSpec,
    /// f32 words per row (values, then state).
    stride: usize,
    /// Words per record: `HEAD` + `stride`.
    record: usize,
    ways: usize,
    bucket_words: usize,
    buckets: usize,
    /// Where bucket 0 starts in `words`: a page boundary, so no bucket straddles two pages.
    base: usize,
    words: Vec<f32>,
    /// Pushes so far: the versions stamped.
    pushes: u64,
}

/// A key's hash: its bucket comes from the high bits (multiply-shift), its tag from the low.
fn hash(key: u64) -> u64 {
    mix64(key ^ 0x9e37_79b9_7f4a_7c15)
}

fn tag(h: u64) -> u8 {
    (h as u8).max(1)
}

/// High bit of each zero byte of `w`, exactly (no borrow crosses bytes).
fn zero_bytes(w: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    !(((w & LOW7).wrapping_add(LOW7)) | w | LOW7)
}

impl Paged {
    pub(crate) fn new(spec: TableSpec, rows: u64) -> Paged {
        let stride = spec.stride();
        let record = HEAD + stride;
        let ways = ((PAGE_WORDS - TAG_WORDS) / record).clamp(1, MAX_WAYS);
        // A record larger than a page: the bucket is its tag line and one record (pages
        // past the record wasted, and at load 0.9 with one way a bucket, long probe chains:
        // the prototype is meant for rows of a few hundred bytes, as measured at dim 16).
        let bucket_words = (TAG_WORDS + ways * record).div_ceil(PAGE_WORDS) * PAGE_WORDS;
        let buckets = ((rows as f64 / (ways as f64 * LOAD)).ceil() as usize).max(1);
        let words = vec![0f32; buckets * bucket_words + PAGE_WORDS];
        let base = (PAGE_WORDS * 4 - words.as_ptr().addr() % (PAGE_WORDS * 4)) % (PAGE_WORDS * 4);
        let base = base / 4;
        Paged { spec, stride, record, ways, bucket_words, buckets, base, words, pushes: 0 }
    }

    fn home(&self, h: u64) -> usize {
        ((u128::from(h) * self.buckets as u128) >> 64) as usize
    }

    fn at(&self, bucket: usize) -> usize {
        self.base + bucket * self.bucket_words
    }

    /// Calls `f` with each way of bucket `b` whose tag is `t`, in order, until it returns
    /// Some.
    fn each_way<T>(&self, b: usize, t: u8, mut f: impl FnMut(usize) -> Option<T>) -> Option<T> {
        let line = &self.words[self.at(b)..self.at(b) + TAG_WORDS];
        let spread = u64::from(t) * 0x0101_0101_0101_0101;
        for (pair, words) in line[..self.ways.div_ceil(4)].chunks(2).enumerate() {
            let lo = u64::from(words[0].to_bits());
            let hi = words.get(1).map_or(0, |w| u64::from(w.to_bits()));
            let mut m = zero_bytes((lo | hi << 32) ^ spread);
            while m != 0 {
                let way = pair * 8 + m.trailing_zeros() as usize / 8;
                m &= m - 1;
                if way >= self.ways {
                    return None;
                }
                if let Some(found) = f(way) {
                    return Some(found);
                }
            }
        }
        None
    }

    fn record_at(&self, b: usize, way: usize) -> usize {
        self.at(b) + TAG_WORDS + way * self.record
    }

    fn key_at(&self, rec: usize) -> u64 {
        u64::from(self.words[rec].to_bits()) | u64::from(self.words[rec + 1].to_bits()) << 32
    }

    /// Where `key`'s record starts, if it has one.
    fn find(&self, key: u64, h: u64) -> Option<usize> {
        let (t, mut b) = (tag(h), self.home(h));
        for _ in 0..self.buckets {
            let found = self.each_way(b, t, |way| {
                let rec = self.record_at(b, way);
                (self.key_at(rec) == key).then_some(rec)
            });
            if found.is_some() {
                return found;
            }
            if self.words[self.at(b) + OVERFLOWED].to_bits() == 0 {
                return None;
            }
            b = (b + 1) % self.buckets;
        }
        None
    }

    /// Places `key` in the first bucket from its home with an empty way (marking the full
    /// ones passed) and initializes its row; where its record starts. Panics when full.
    fn insert(&mut self, key: u64, h: u64) -> usize {
        let mut b = self.home(h);
        let mut passed = 0;
        let way = loop {
            if let Some(way) = self.each_way(b, 0, Some) {
                break way;
            }
            assert!(passed < self.buckets, "the paged prototype is full");
            passed += 1;
            let at = self.at(b) + OVERFLOWED;
            self.words[at] = f32::from_bits(1);
            b = (b + 1) % self.buckets;
        };
        let at = self.at(b) + way / 4;
        let shift = 8 * (way % 4);
        let tags = self.words[at].to_bits() | u32::from(tag(h)) << shift;
        self.words[at] = f32::from_bits(tags);
        let rec = self.record_at(b, way);
        self.words[rec] = f32::from_bits(key as u32);
        self.words[rec + 1] = f32::from_bits((key >> 32) as u32);
        let dim = self.spec.dim as usize;
        let row = &mut self.words[rec + HEAD..rec + HEAD + self.stride];
        let (w, s) = row.split_at_mut(dim);
        self.spec.init.fill(self.spec.seed, key, w);
        self.spec.optimizer.init_state(s);
        rec
    }

    /// Hashes a chunk's keys into `hashes`, starts loading their home tag lines, then the
    /// first `words` of the record each line's first matching tag points at (a hint: the
    /// key is confirmed when served).
    fn warm(&self, keys: &[u64], hashes: &mut [u64; CHUNK], words: usize) {
        debug_assert!(keys.len() <= CHUNK, "{} keys", keys.len());
        for (h, &k) in hashes.iter_mut().zip(keys) {
            *h = hash(k);
            prefetch(&self.words[self.at(self.home(*h))]);
        }
        let mut recs = [0usize; CHUNK];
        let found = hashes[..keys.len()].iter().filter_map(|&h| {
            let b = self.home(h);
            self.each_way(b, tag(h), |way| Some(self.record_at(b, way)))
        });
        let m = found.zip(recs.iter_mut()).fold(0, |m, (rec, slot)| {
            *slot = rec;
            m + 1
        });
        for &rec in &recs[..m] {
            for w in (rec..rec + words).step_by(16) {
                prefetch(&self.words[w]);
            }
            prefetch(&self.words[rec + words - 1]);
        }
    }
}

impl Rows for Paged {
    fn push(&mut self, keys: &[u64], grads: &[f32]) {
        let dim = self.spec.dim as usize;
        let mut hashes = [0u64; CHUNK];
        for (keys, grads) in keys.chunks(CHUNK).zip(grads.chunks(CHUNK * dim)) {
            self.warm(keys, &mut hashes, self.record);
            for ((&k, &h), g) in keys.iter().zip(&hashes).zip(grads.chunks_exact(dim)) {
                let rec = match self.find(k, h) {
                    Some(rec) => rec,
                    None => self.insert(k, h),
                };
                let row = &mut self.words[rec + HEAD..rec + HEAD + self.stride];
                let (w, s) = row.split_at_mut(dim);
                self.spec.optimizer.apply(w, s, &mut 0, g);
                self.pushes += 1;
                self.words[rec + 2] = f32::from_bits(self.pushes as u32);
                self.words[rec + 3] = f32::from_bits((self.pushes >> 32) as u32);
            }
        }
    }

    fn fetch(&mut self, keys: &[u64], out: &mut [f32]) {
        let dim = self.spec.dim as usize;
        let mut hashes = [0u64; CHUNK];
        for (keys, out) in keys.chunks(CHUNK).zip(out.chunks_mut(CHUNK * dim)) {
            self.warm(keys, &mut hashes, HEAD + dim);
            for ((&k, &h), o) in keys.iter().zip(&hashes).zip(out.chunks_exact_mut(dim)) {
                match self.find(k, h) {
                    Some(rec) => o.copy_from_slice(&self.words[rec + HEAD..rec + HEAD + dim]),
                    None => self.spec.init.fill(self.spec.seed, k, o),
                }
            }
        }
    }
}

impl Paged {
    /// Keys stored beyond their home bucket, and all keys stored (for the tests and the
    /// experiment's record).
    #[cfg(test)]
    pub(crate) fn overflowed_keys(&self) -> (usize, usize) {
        let (mut beyond, mut all) = (0, 0);
        for b in 0..self.buckets {
            for way in 0..self.ways {
                let at = self.at(b) + way / 4;
                if (self.words[at].to_bits() >> (8 * (way % 4))) & 0xff != 0 {
                    all += 1;
                    let key = self.key_at(self.record_at(b, way));
                    beyond += usize::from(self.home(hash(key)) != b);
                }
            }
        }
        (beyond, all)
    }
}
