//! [`SyntheticClicks`]: a seeded click dataset generated from a hidden ground-truth model, so
//! that learning on it is real and measurable.
//!
//! Each sample has `slots` categorical features. In slot `s` the id's rank `r` in
//! `0..vocab` is drawn Zipf-like, `P(r) ∝ (r + 1)^−zipf_exponent`, by inverse CDF (a binary
//! search in the precomputed cumulative table), and the feature's key is
//! [`SyntheticClicks::key`]`(s, r)`. Every key has a hidden scalar weight `w(key)` and a
//! hidden embedding `e(key) ∈ R^hidden_dim`, entries uniform with unit variance, derived
//! deterministically from the dataset seed and the key (no table is stored). The hidden score
//! of a sample with keys `k_0 … k_{S−1}` is
//!
//! ```text
//! bias + first_order · Σ_s w(k_s) + interaction · Σ_{s<t} ⟨e(k_s), e(k_t)⟩ / √hidden_dim
//! ```
//!
//! and its label is 1 with probability `sigmoid(score)`. Train and held-out samples come from
//! the same ground truth through different sample streams ([`SyntheticClicks::train`],
//! [`SyntheticClicks::held_out`], or any stream seed via [`SyntheticClicks::stream`]).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::metrics::sigmoid;

/// The parameters of a [`SyntheticClicks`] dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct ClicksConfig {
    /// Categorical feature slots per sample (S).
    pub slots: usize,
    /// Distinct ids per slot; ranks are `0..vocab`.
    pub vocab: u64,
    /// The power law's exponent: `P(rank r) ∝ (r + 1)^−zipf_exponent`.
    pub zipf_exponent: f64,
    /// Width of the hidden per-key embedding.
    pub hidden_dim: usize,
    /// The hidden score's constant term (sets the click rate).
    pub bias: f64,
    /// Weight of the hidden first-order (per-key scalar) terms.
    pub first_order: f64,
    /// Weight of the hidden pairwise embedding interactions.
    pub interaction: f64,
    /// Seed of the ground truth and of the train / held-out streams.
    pub seed: u64,
}

impl Default for ClicksConfig {
    /// 4 slots of 1000 ids, exponent 1.1, a hidden score with standard deviation ≈ 2.8 around
    /// −1 (click rate ≈ 0.38; the ground truth's own AUC ≈ 0.91).
    fn default() -> Self {
        Self {
            slots: 4,
            vocab: 1000,
            zipf_exponent: 1.1,
            hidden_dim: 4,
            bias: -1.0,
            first_order: 1.2,
            interaction: 0.6,
            seed: 1,
        }
    }
}

/// One labelled sample: a key per slot and a label in {0, 1}.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `keys[s]` is slot `s`'s feature key ([`SyntheticClicks::key`]).
    pub keys: Vec<u64>,
    /// 1.0 for a click, 0.0 otherwise.
    pub label: f32,
}

/// A seeded synthetic click dataset with a hidden ground truth (see the module docs).
#[derive(Debug, Clone)]
pub struct SyntheticClicks {
    cfg: ClicksConfig,
    /// `cdf[r] = P(rank ≤ r)`, with `cdf[vocab − 1] = 1`.
    cdf: Vec<f64>,
}

/// splitmix64's finalizer: a bijective 64-bit mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SyntheticClicks {
    /// Bits of a key below the slot number: ranks must fit in them.
    pub const RANK_BITS: u32 = 48;
    /// Stream seed of [`Self::train`] (salts that no small stream seed coincides with).
    pub const TRAIN_STREAM: u64 = 0x7472_6169_6e00_0001;
    /// Stream seed of [`Self::held_out`].
    pub const HELD_OUT_STREAM: u64 = 0x6865_6c64_6f75_7402;

    /// Builds the dataset (the inverse-CDF table costs `vocab` doubles).
    ///
    /// # Panics
    /// If `slots` or `vocab` is zero, `vocab` needs more than [`Self::RANK_BITS`] bits, `slots`
    /// exceeds 2^16, `hidden_dim` is zero, or `zipf_exponent` is negative or not finite.
    pub fn new(cfg: ClicksConfig) -> Self {
        assert!(cfg.slots > 0 && cfg.slots <= 1 << 16, "slots must be in 1..=65536");
        assert!(cfg.vocab > 0 && cfg.vocab < 1 << Self::RANK_BITS, "vocab must be in 1..2^48");
        assert!(cfg.hidden_dim > 0, "hidden_dim must be positive");
        assert!(cfg.zipf_exponent.is_finite() && cfg.zipf_exponent >= 0.0, "bad zipf_exponent");
        let mut cdf = Vec::with_capacity(cfg.vocab as usize);
        let mut acc = 0.0f64;
        for r in 0..cfg.vocab {
            acc += ((r + 1) as f64).powf(-cfg.zipf_exponent);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        if let Some(last) = cdf.last_mut() {
            *last = 1.0;
        }
        Self { cfg, cdf }
    }

    /// The configuration.
    pub fn config(&self) -> &ClicksConfig {
        &self.cfg
    }

    /// The key of rank `rank` in slot `slot`: `slot << 48 | rank` (slots never share a key).
    pub fn key(slot: usize, rank: u64) -> u64 {
        ((slot as u64) << Self::RANK_BITS) | rank
    }

    /// The probability of rank `rank` in any slot.
    pub fn rank_probability(&self, rank: u64) -> f64 {
        let r = rank as usize;
        match r {
            0 => self.cdf[0],
            _ if r < self.cdf.len() => self.cdf[r] - self.cdf[r - 1],
            _ => 0.0,
        }
    }

    /// Draws a rank by inverse CDF: the first `r` with `cdf[r] > u`, `u` uniform in [0, 1).
    pub fn draw_rank<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        let u: f64 = rng.random();
        let r = self.cdf.partition_point(|&c| c <= u);
        r.min(self.cdf.len() - 1) as u64
    }

    /// A hidden uniform value in [−√3, √3) (unit variance) for `(key, j)`.
    fn hidden_value(&self, key: u64, j: u64) -> f64 {
        let h = mix64(mix64(self.cfg.seed ^ 0x5eed_0000_0000_0000) ^ mix64(key) ^ j);
        let unit = (h >> 11) as f64 / (1u64 << 53) as f64;
        (2.0 * unit - 1.0) * 3f64.sqrt()
    }

    /// The hidden first-order weight `w(key)`.
    pub fn hidden_weight(&self, key: u64) -> f64 {
        self.hidden_value(key, 0)
    }

    /// The hidden embedding `e(key)` (`hidden_dim` values).
    pub fn hidden_embedding(&self, key: u64) -> Vec<f64> {
        (0..self.cfg.hidden_dim as u64).map(|j| self.hidden_value(key, j + 1)).collect()
    }

    /// The ground truth's score (a logit) of a sample's keys.
    ///
    /// # Panics
    /// If `keys.len()` is not `slots`.
    pub fn hidden_score(&self, keys: &[u64]) -> f64 {
        assert_eq!(keys.len(), self.cfg.slots, "hidden_score: wrong number of keys");
        let emb: Vec<Vec<f64>> = keys.iter().map(|&k| self.hidden_embedding(k)).collect();
        let first: f64 = keys.iter().map(|&k| self.hidden_weight(k)).sum();
        let mut pairs = 0.0;
        for s in 0..emb.len() {
            for t in s + 1..emb.len() {
                pairs += emb[s].iter().zip(&emb[t]).map(|(a, b)| a * b).sum::<f64>();
            }
        }
        let c = &self.cfg;
        c.bias + c.first_order * first + c.interaction * pairs / (c.hidden_dim as f64).sqrt()
    }

    /// The ground truth's click probability for a sample's keys.
    pub fn click_probability(&self, keys: &[u64]) -> f64 {
        f64::from(sigmoid(self.hidden_score(keys) as f32))
    }

    /// Draws one sample from `rng`.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> Sample {
        let keys: Vec<u64> =
            (0..self.cfg.slots).map(|s| Self::key(s, self.draw_rank(rng))).collect();
        let p = self.click_probability(&keys);
        let label = if rng.random::<f64>() < p { 1.0 } else { 0.0 };
        Sample { keys, label }
    }

    /// The random source of stream `stream_seed`: [`Self::sample`] drawing from it yields
    /// [`Self::stream`]`(stream_seed)`, for callers that keep a stream without borrowing the
    /// dataset (the Python binding).
    pub fn stream_rng(&self, stream_seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(mix64(self.cfg.seed) ^ mix64(stream_seed))
    }

    /// An endless stream of samples seeded by `(dataset seed, stream_seed)`; equal arguments
    /// give equal streams.
    pub fn stream(&self, stream_seed: u64) -> impl Iterator<Item = Sample> + '_ {
        let mut rng = self.stream_rng(stream_seed);
        std::iter::repeat_with(move || self.sample(&mut rng))
    }

    /// The training stream.
    pub fn train(&self) -> impl Iterator<Item = Sample> + '_ {
        self.stream(Self::TRAIN_STREAM)
    }

    /// The held-out stream: the same ground truth, independent samples.
    pub fn held_out(&self) -> impl Iterator<Item = Sample> + '_ {
        self.stream(Self::HELD_OUT_STREAM)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::auc;

    #[test]
    fn deterministic_and_streams_differ() {
        let d = SyntheticClicks::new(ClicksConfig::default());
        let a: Vec<Sample> = d.train().take(100).collect();
        let b: Vec<Sample> = d.train().take(100).collect();
        let h: Vec<Sample> = d.held_out().take(100).collect();
        assert_eq!(a, b);
        assert_ne!(a, h);
        let other = SyntheticClicks::new(ClicksConfig { seed: 2, ..ClicksConfig::default() });
        assert_ne!(a, other.train().take(100).collect::<Vec<_>>());
        for s in &a {
            assert_eq!(s.keys.len(), 4);
            for (slot, &k) in s.keys.iter().enumerate() {
                assert_eq!(k >> SyntheticClicks::RANK_BITS, slot as u64);
                assert!(k & ((1 << SyntheticClicks::RANK_BITS) - 1) < 1000);
            }
        }
    }

    #[test]
    fn ranks_follow_the_power_law() {
        let d = SyntheticClicks::new(ClicksConfig::default());
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let n = 200_000;
        let mut counts = vec![0u32; 1000];
        for _ in 0..n {
            counts[d.draw_rank(&mut rng) as usize] += 1;
        }
        let total: f64 = (0..1000).map(|r| d.rank_probability(r)).sum();
        assert!((total - 1.0).abs() < 1e-9);
        for r in [0u64, 1, 2, 9, 99] {
            let want = d.rank_probability(r) * n as f64;
            let got = f64::from(counts[r as usize]);
            // Within 5 standard deviations of the binomial count.
            assert!((got - want).abs() < 5.0 * want.sqrt() + 1.0, "rank {r}: {got} vs {want}");
        }
        // The head is heavier than the tail: P(0) / P(9) = 10^1.1.
        let ratio = d.rank_probability(0) / d.rank_probability(9);
        assert!((ratio - 10f64.powf(1.1)).abs() < 1e-9);
    }

    #[test]
    fn labels_follow_the_hidden_model() {
        let d = SyntheticClicks::new(ClicksConfig::default());
        let samples: Vec<Sample> = d.held_out().take(20_000).collect();
        let scores: Vec<f32> = samples.iter().map(|s| d.hidden_score(&s.keys) as f32).collect();
        let labels: Vec<f32> = samples.iter().map(|s| s.label).collect();
        let rate = labels.iter().sum::<f32>() / labels.len() as f32;
        assert!((0.2..0.5).contains(&rate), "click rate {rate}");
        // The ground truth ranks well above chance: the data is learnable.
        let a = auc(&scores, &labels).unwrap();
        assert!(a > 0.8, "ground-truth AUC {a}");
        // The mean predicted probability matches the click rate.
        let mean_p: f64 =
            samples.iter().map(|s| d.click_probability(&s.keys)).sum::<f64>() / 20_000.0;
        assert!((mean_p - f64::from(rate)).abs() < 0.02, "{mean_p} vs {rate}");
    }
}
