//! Feature admission's counter: a count-min sketch of pushes per key, bounded in memory.
//!
//! Four rows of `width` 16-bit counters, each row indexed by its own seeded hash of the key.
//! An addition raises only the counters at the current minimum ("conservative update"), so
//! the estimate, the minimum over the rows, is never below the true count and exceeds it
//! only when the key collides with others in all four rows. After `width` additions every
//! counter halves (TinyLFU's reset): counts of keys that stopped coming fade, so the long
//! tail of ids seen a few times cannot fill the sketch and admit strangers. A key is
//! therefore admitted when it is pushed often enough within a window, not ever.
//!
//! Hashes are seeded from the table's seed, not per process: the same pushes give the same
//! decisions on every run (tests and simulations replay them).

/// Rows of the sketch (independent hashes).
const DEPTH: usize = 4;

/// A count-min sketch with conservative update and periodic halving.
#[derive(Debug)]
pub struct CountMin {
    /// `DEPTH × width` counters, row-major.
    counters: Box<[u16]>,
    mask: usize,
    seeds: [u64; DEPTH],
    /// Additions since the last halving.
    additions: usize,
}

impl CountMin {
    /// A sketch of `width` counters per row (a power of two) seeded by `seed`.
    pub fn new(width: usize, seed: u64) -> CountMin {
        debug_assert!(width.is_power_of_two(), "sketch width {width} is not a power of two");
        let width = width.next_power_of_two().max(1);
        let mut seeds = [0; DEPTH];
        let mut x = seed;
        for s in &mut seeds {
            x = splitmix64(x);
            *s = x;
        }
        CountMin { counters: vec![0; DEPTH * width].into(), mask: width - 1, seeds, additions: 0 }
    }

    fn slots(&self, key: u64) -> [usize; DEPTH] {
        let width = self.mask + 1;
        std::array::from_fn(|d| d * width + (splitmix64(key ^ self.seeds[d]) as usize & self.mask))
    }

    /// The count of `key` (never below the pushes counted since the counts last halved).
    pub fn estimate(&self, key: u64) -> u32 {
        self.slots(key).iter().map(|&i| u32::from(self.counters[i])).min().unwrap_or(0)
    }

    /// Counts one push of `key`; returns its estimate including it.
    pub fn add(&mut self, key: u64) -> u32 {
        let slots = self.slots(key);
        let min = slots.iter().map(|&i| self.counters[i]).min().unwrap_or(0);
        let next = min.saturating_add(1);
        for i in slots {
            if self.counters[i] < next {
                self.counters[i] = next;
            }
        }
        self.additions += 1;
        if self.additions > self.mask {
            self.halve();
        }
        u32::from(next)
    }

    fn halve(&mut self) {
        for c in self.counters.iter_mut() {
            *c >>= 1;
        }
        self.additions = 0;
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.counters.len() * 2
    }
}

/// SplitMix64's finalizer: a strong 64-bit mix.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_exact_without_collisions_and_never_low() {
        let mut s = CountMin::new(1 << 14, 7);
        for k in 0..500u64 {
            for n in 1..=(k % 5 + 1) {
                assert_eq!(s.add(k), n as u32, "key {k}");
            }
        }
        for k in 0..500u64 {
            assert_eq!(s.estimate(k), (k % 5 + 1) as u32);
        }
        assert_eq!(s.estimate(10_000), 0);
    }

    #[test]
    fn a_crowded_sketch_overestimates_but_never_underestimates() {
        let mut s = CountMin::new(64, 3);
        let mut truth = std::collections::HashMap::new();
        // Fewer additions than the halving period: nothing fades.
        for i in 0..60u64 {
            let k = i * 7919 % 40;
            s.add(k);
            *truth.entry(k).or_insert(0u32) += 1;
        }
        for (k, n) in truth {
            assert!(s.estimate(k) >= n, "key {k}: {} < {n}", s.estimate(k));
        }
    }

    #[test]
    fn counts_halve_after_a_window_of_additions() {
        let mut s = CountMin::new(64, 1);
        for _ in 0..8 {
            s.add(42);
        }
        assert_eq!(s.estimate(42), 8);
        // 56 more additions of other keys complete the 64-addition window.
        for k in 0..56u64 {
            s.add(1000 + k);
        }
        assert_eq!(s.estimate(42), 4, "halved once the window passed");
        assert!(s.bytes() == 4 * 64 * 2);
    }
}
