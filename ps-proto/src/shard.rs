//! Shard placement: which of the `n` shards of a pod holds a key.
//!
//! The function is part of the on-disk and on-wire contract (every ranker, trainer and
//! server, of every version, must agree; checkpoints are per shard), so it is written out
//! here exactly and pinned by golden values in the tests. Changing it is a data migration.
//!
//! ```text
//! mix(x) = SplitMix64 output function applied to x (Steele, Lea, Flood 2014):
//!     z = x + 0x9E37_79B9_7F4A_7C15                (wrapping)
//!     z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9  (wrapping)
//!     z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB  (wrapping)
//!     mix = z ^ (z >> 31)
//! shard_of(key, n) = ((mix(key) as u128 * n as u128) >> 64) as u32
//! ```
//!
//! The second step is Lemire's multiply-shift range reduction: it maps the 64-bit hash onto
//! `0..n` with the high bits (no modulo bias worth measuring, no division). `n = 0` yields 0.
//! `mix(0)` is `0xE220_A839_7B1D_CDAF`, the first output of a SplitMix64 generator seeded
//! with 0, which ties this code to the published algorithm.
//!
//! Not ahash (seeded per process, and its output may change between versions) and not
//! `std`'s `DefaultHasher` (unspecified across releases).

/// The SplitMix64 output function (see the module docs for the exact steps).
#[inline]
pub const fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The shard in `0..n` that holds `key`:
/// `((mix64(key) as u128 * n as u128) >> 64) as u32`. Stable across processes, platforms and
/// versions. Returns 0 when `n == 0`.
#[inline]
pub const fn shard_of(key: u64, n: u32) -> u32 {
    ((mix64(key) as u128 * n as u128) >> 64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: the SplitMix64 generator seeded with 0 outputs these three values first
    /// (state advances by the golden gamma before each output, so output i is mix64(i·γ)).
    #[test]
    fn mix64_matches_published_splitmix64() {
        const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
        assert_eq!(mix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(mix64(GAMMA), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(mix64(GAMMA.wrapping_mul(2)), 0x06C4_5D18_8009_454F);
    }

    /// Golden values: these must never change (they decide where every stored row lives).
    /// Computed independently (Python, arbitrary-precision integers) from the formula.
    #[test]
    fn shard_of_golden_values() {
        let keys = [0u64, 1, 2, 42, 1_000_003, u64::MAX, 0xDEAD_BEEF_CAFE_F00D];
        let got: Vec<[u32; 4]> = keys
            .iter()
            .map(|&k| [shard_of(k, 1), shard_of(k, 2), shard_of(k, 7), shard_of(k, 1024)])
            .collect();
        let want: Vec<[u32; 4]> = GOLDEN.to_vec();
        assert_eq!(got, want, "shard_of changed: that is a data migration, not a refactor");
    }

    const GOLDEN: [[u32; 4]; 7] = [
        [0, 1, 6, 904],
        [0, 1, 3, 580],
        [0, 1, 4, 605],
        [0, 1, 5, 759],
        [0, 0, 2, 360],
        [0, 1, 6, 915],
        [0, 1, 3, 576],
    ];

    #[test]
    fn zero_shards_is_zero_and_in_range_otherwise() {
        assert_eq!(shard_of(123, 0), 0);
        for n in 1..50u32 {
            for k in 0..200u64 {
                assert!(shard_of(k * 7919, n) < n);
            }
        }
    }

    #[test]
    fn spreads_sequential_keys_evenly() {
        let n = 16u32;
        let mut counts = [0u32; 16];
        for k in 0..160_000u64 {
            counts[shard_of(k, n) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..=10_500).contains(&c), "{counts:?}");
        }
    }
}
