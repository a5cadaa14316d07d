//! Open-loop Poisson arrivals: exponential inter-arrival gaps at a target rate.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Poisson arrivals at `rate_per_s`: an endless iterator of exponential inter-arrival gaps.
/// Open loop: the schedule never depends on how fast requests complete.
#[derive(Debug, Clone)]
pub struct Arrivals {
    rate_per_s: f64,
    rng: ChaCha8Rng,
}

impl Arrivals {
    /// Arrivals at `rate_per_s` (must be finite and > 0), seeded with `seed`.
    ///
    /// # Panics
    /// If `rate_per_s` is not finite and positive: a programming error, not input.
    pub fn new(rate_per_s: f64, seed: u64) -> Self {
        assert!(
            rate_per_s.is_finite() && rate_per_s > 0.0,
            "arrival rate must be finite and > 0, got {rate_per_s}"
        );
        Self { rate_per_s, rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// The target rate, per second.
    pub fn rate_per_s(&self) -> f64 {
        self.rate_per_s
    }

    /// The next gap: `-ln(1 - U) / rate`, rounded to the nanosecond.
    pub fn next_gap(&mut self) -> Duration {
        let u: f64 = self.rng.random();
        // 1 - U is in (0, 1], so the log is finite and <= 0.
        let secs = -(1.0 - u).ln() / self.rate_per_s;
        Duration::from_secs_f64(secs.min(1e9))
    }

    /// Arrival offsets from time zero (the first one after one gap), strictly before
    /// `duration`.
    pub fn offsets_for(self, duration: Duration) -> impl Iterator<Item = Duration> {
        let mut at = Duration::ZERO;
        self.map(move |gap| {
            at += gap;
            at
        })
        .take_while(move |&t| t < duration)
    }
}

impl Iterator for Arrivals {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_gap())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_have_exponential_mean_and_variance() {
        let rate = 2_000.0;
        let n = 200_000;
        let gaps: Vec<f64> = Arrivals::new(rate, 9).take(n).map(|d| d.as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        // Exponential(rate): mean 1/rate, variance 1/rate². Standard error of the mean is
        // 1/(rate·√n) ≈ 0.22%; of the variance about 2/√n ≈ 0.45%. Allow 5 sigma-ish.
        let want_mean = 1.0 / rate;
        let want_var = 1.0 / (rate * rate);
        assert!((mean / want_mean - 1.0).abs() < 0.012, "mean {mean} vs {want_mean}");
        assert!((var / want_var - 1.0).abs() < 0.025, "var {var} vs {want_var}");
        // Coefficient of variation 1 tells Poisson from, say, a uniform or a constant gap.
        let cv = var.sqrt() / mean;
        assert!((cv - 1.0).abs() < 0.02, "cv {cv}");
    }

    #[test]
    fn counts_per_window_match_the_rate() {
        let d = Duration::from_secs(50);
        let offsets: Vec<Duration> = Arrivals::new(1_000.0, 10).offsets_for(d).collect();
        // 50 000 expected, Poisson sd ≈ 224.
        assert!((48_900..51_100).contains(&offsets.len()), "{} arrivals", offsets.len());
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        assert!(offsets.last().is_some_and(|&t| t < d));
    }

    #[test]
    fn deterministic_for_a_seed() {
        let a: Vec<Duration> = Arrivals::new(100.0, 1).take(100).collect();
        let b: Vec<Duration> = Arrivals::new(100.0, 1).take(100).collect();
        let c: Vec<Duration> = Arrivals::new(100.0, 2).take(100).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    #[should_panic(expected = "arrival rate")]
    fn zero_rate_is_a_bug() {
        let _ = Arrivals::new(0.0, 1);
    }
}
