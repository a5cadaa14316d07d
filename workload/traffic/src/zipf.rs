//! Zipf over `[0, n)`: `P(k) ∝ 1 / (k + 1)^s`.
//!
//! Two exact methods: an inverse-CDF table (binary search over the cumulative weights) for
//! vocabularies up to [`Zipf::TABLE_MAX`], and Hörmann & Derflinger's rejection-inversion
//! ("Rejection-inversion to generate variates from monotone discrete distributions", 1996) in
//! O(1) memory above that, so a 10^9-row table costs nothing to sample from.

use rand::Rng;

/// Why a [`Zipf`] could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZipfError {
    /// `n` was zero: there is nothing to sample.
    #[error("zipf: n must be at least 1")]
    Empty,
    /// The exponent was negative, NaN or infinite.
    #[error("zipf: exponent must be finite and >= 0, got {0}")]
    BadExponent(f64),
}

/// A Zipf distribution over `[0, n)` with exponent `s` (`s = 0` is uniform). Holds no RNG:
/// pass one to [`Zipf::sample`], so determinism is the caller's seed.
#[derive(Debug, Clone)]
pub struct Zipf {
    n: u64,
    s: f64,
    method: Method,
}

#[derive(Debug, Clone)]
enum Method {
    Uniform,
    /// `cdf[i]` = sum of weights of ranks `0..=i`; the last entry is the total.
    Table(Vec<f64>),
    Rejection(Rejection),
}

impl Zipf {
    /// Largest `n` for which [`Zipf::new`] builds an inverse-CDF table (8 bytes per rank).
    pub const TABLE_MAX: u64 = 1 << 16;

    /// Zipf over `[0, n)` with exponent `s`: a table up to [`Zipf::TABLE_MAX`], rejection-
    /// inversion above.
    pub fn new(n: u64, s: f64) -> Result<Self, ZipfError> {
        if n <= Self::TABLE_MAX {
            Self::with_table(n, s)
        } else {
            Self::with_rejection(n, s)
        }
    }

    /// Zipf by inverse-CDF table (memory `8 n` bytes).
    pub fn with_table(n: u64, s: f64) -> Result<Self, ZipfError> {
        check(n, s)?;
        if s == 0.0 {
            return Ok(Self { n, s, method: Method::Uniform });
        }
        let mut cdf = Vec::with_capacity(usize::try_from(n).unwrap_or(usize::MAX));
        let mut acc = 0.0f64;
        for k in 0..n {
            acc += pmf_weight(k, s);
            cdf.push(acc);
        }
        Ok(Self { n, s, method: Method::Table(cdf) })
    }

    /// Zipf by rejection-inversion (O(1) memory, any `n`).
    pub fn with_rejection(n: u64, s: f64) -> Result<Self, ZipfError> {
        check(n, s)?;
        if s == 0.0 {
            return Ok(Self { n, s, method: Method::Uniform });
        }
        Ok(Self { n, s, method: Method::Rejection(Rejection::new(n, s)) })
    }

    /// Number of ranks.
    pub fn n(&self) -> u64 {
        self.n
    }

    /// The exponent.
    pub fn exponent(&self) -> f64 {
        self.s
    }

    /// The exact probability of rank `k` (0 outside `[0, n)`). O(n): for tests and tools.
    pub fn pmf(&self, k: u64) -> f64 {
        if k >= self.n {
            return 0.0;
        }
        let total: f64 = (0..self.n).map(|i| pmf_weight(i, self.s)).sum();
        pmf_weight(k, self.s) / total
    }

    /// One rank in `[0, n)`; rank 0 is the most popular.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        match &self.method {
            Method::Uniform => rng.random_range(0..self.n),
            Method::Table(cdf) => {
                let total = cdf[cdf.len() - 1];
                let u = rng.random::<f64>() * total;
                let i = cdf.partition_point(|&c| c <= u);
                // `u < total` so `i < len`; clamp anyway against rounding at the top.
                (i as u64).min(self.n - 1)
            }
            Method::Rejection(r) => r.sample(rng) - 1,
        }
    }
}

fn check(n: u64, s: f64) -> Result<(), ZipfError> {
    if n == 0 {
        return Err(ZipfError::Empty);
    }
    if !s.is_finite() || s < 0.0 {
        return Err(ZipfError::BadExponent(s));
    }
    Ok(())
}

/// Unnormalised weight of rank `k` (0-based).
fn pmf_weight(k: u64, s: f64) -> f64 {
    ((k + 1) as f64).powf(-s)
}

/// Rejection-inversion over `1..=n` with `P(k) ∝ k^-s`, `s > 0`.
#[derive(Debug, Clone)]
struct Rejection {
    n: u64,
    s: f64,
    h_integral_x1: f64,
    h_integral_n: f64,
    shortcut: f64,
}

impl Rejection {
    fn new(n: u64, s: f64) -> Self {
        let h_integral_x1 = h_integral(1.5, s) - 1.0;
        let h_integral_n = h_integral(n as f64 + 0.5, s);
        let shortcut = 2.0 - h_integral_inverse(h_integral(2.5, s) - h(2.0, s), s);
        Self { n, s, h_integral_x1, h_integral_n, shortcut }
    }

    fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        loop {
            let u =
                self.h_integral_n + rng.random::<f64>() * (self.h_integral_x1 - self.h_integral_n);
            let x = h_integral_inverse(u, self.s);
            // Saturating float-to-int cast, then clamp into 1..=n.
            let k = ((x + 0.5) as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.shortcut || u >= h_integral(kf + 0.5, self.s) - h(kf, self.s) {
                return k;
            }
        }
    }
}

/// `h(x) = x^-s`.
fn h(x: f64, s: f64) -> f64 {
    (-s * x.ln()).exp()
}

/// `H(x) = ∫ h`, written to stay accurate as `s → 1`: `(x^(1-s) - 1) / (1 - s)`, or `ln x`.
fn h_integral(x: f64, s: f64) -> f64 {
    let log_x = x.ln();
    helper2((1.0 - s) * log_x) * log_x
}

/// Inverse of [`h_integral`].
fn h_integral_inverse(x: f64, s: f64) -> f64 {
    let t = (x * (1.0 - s)).max(-1.0);
    (helper1(t) * x).exp()
}

/// `ln(1 + x) / x`, accurate near 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, accurate near 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Pearson's chi-square of `draws` samples against the exact pmf.
    fn chi_square(z: &Zipf, draws: u64, seed: u64) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = usize::try_from(z.n()).unwrap();
        let mut counts = vec![0u64; n];
        for _ in 0..draws {
            let k = z.sample(&mut rng);
            assert!(k < z.n(), "sample {k} out of range");
            counts[usize::try_from(k).unwrap()] += 1;
        }
        (0..n)
            .map(|k| {
                let expected = z.pmf(k as u64) * draws as f64;
                let d = counts[k] as f64 - expected;
                d * d / expected
            })
            .sum()
    }

    // 20 ranks → 19 degrees of freedom; the 99.9% quantile of chi²(19) is 43.8. A sampler
    // off by even 1% on the head rank at 400k draws lands far above that.
    const CHI2_19_999: f64 = 43.8;

    #[test]
    fn table_frequencies_match_pmf() {
        for (s, seed) in [(0.8, 1), (1.0, 2), (1.2, 3), (2.0, 4)] {
            let z = Zipf::with_table(20, s).unwrap();
            let chi2 = chi_square(&z, 400_000, seed);
            assert!(chi2 < CHI2_19_999, "table s={s}: chi2 {chi2}");
        }
    }

    #[test]
    fn rejection_frequencies_match_pmf() {
        for (s, seed) in [(0.5, 5), (0.99, 6), (1.0, 7), (1.01, 8), (1.5, 9), (3.0, 10)] {
            let z = Zipf::with_rejection(20, s).unwrap();
            let chi2 = chi_square(&z, 400_000, seed);
            assert!(chi2 < CHI2_19_999, "rejection s={s}: chi2 {chi2}");
        }
    }

    #[test]
    fn uniform_when_exponent_zero() {
        let z = Zipf::new(20, 0.0).unwrap();
        let chi2 = chi_square(&z, 200_000, 11);
        assert!(chi2 < CHI2_19_999, "uniform: chi2 {chi2}");
    }

    #[test]
    fn chi_square_catches_a_wrong_exponent() {
        // The test must be able to fail: samples from s=1.1 against the pmf of s=1.0.
        let z = Zipf::with_table(20, 1.1).unwrap();
        let wrong = Zipf::with_table(20, 1.0).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let mut counts = [0u64; 20];
        for _ in 0..400_000 {
            counts[usize::try_from(z.sample(&mut rng)).unwrap()] += 1;
        }
        let chi2: f64 = (0..20)
            .map(|k| {
                let e = wrong.pmf(k as u64) * 400_000.0;
                (counts[k] as f64 - e).powi(2) / e
            })
            .sum();
        assert!(chi2 > CHI2_19_999, "chi2 {chi2} did not detect the wrong exponent");
    }

    #[test]
    fn large_n_uses_rejection_and_stays_in_range() {
        let n = 1_000_000_000;
        let z = Zipf::new(n, 1.05).unwrap();
        assert!(matches!(z.method, Method::Rejection(_)));
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let mut zeros = 0u64;
        for _ in 0..100_000 {
            let k = z.sample(&mut rng);
            assert!(k < n);
            zeros += u64::from(k == 0);
        }
        // P(0) = 1 / H(1e9, 1.05) ≈ 1 / (ζ(1.05) - 1e9^-0.05 / 0.05) ≈ 1 / 13.48 ≈ 0.074.
        assert!((6_900..7_900).contains(&zeros), "rank 0 drawn {zeros} times");
    }

    #[test]
    fn n_one_and_bad_inputs() {
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        for z in [Zipf::with_table(1, 1.0).unwrap(), Zipf::with_rejection(1, 1.0).unwrap()] {
            for _ in 0..100 {
                assert_eq!(z.sample(&mut rng), 0);
            }
        }
        assert_eq!(Zipf::new(0, 1.0).unwrap_err(), ZipfError::Empty);
        assert!(matches!(Zipf::new(5, -1.0), Err(ZipfError::BadExponent(_))));
        assert!(matches!(Zipf::new(5, f64::NAN), Err(ZipfError::BadExponent(_))));
    }
}
