//! Turning samples into numbers: latency percentiles (HdrHistogram), bandwidth medians over
//! repetitions, and the RNIC/baseline ratios. Pure functions of their inputs.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Largest recordable round trip (60 s); longer samples are clamped to it.
const MAX_RTT_NS: u64 = 60_000_000_000;

/// Records round-trip times in nanoseconds with 3 significant digits.
#[derive(Debug)]
pub struct LatencyRecorder {
    hist: Histogram<u64>,
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        LatencyRecorder::new()
    }
}

impl LatencyRecorder {
    /// An empty recorder.
    pub fn new() -> LatencyRecorder {
        // Constant, valid bounds (1 ns ..= 60 s, 3 digits): construction cannot fail.
        let hist = Histogram::new_with_bounds(1, MAX_RTT_NS, 3).expect("valid histogram bounds");
        LatencyRecorder { hist }
    }

    /// Records one round trip.
    pub fn record(&mut self, rtt: Duration) {
        let ns = u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX);
        self.hist.saturating_record(ns.min(MAX_RTT_NS));
    }

    /// Adds every sample of `other` (a recorder per task, merged at the end).
    pub fn merge(&mut self, other: &LatencyRecorder) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.hist.add(&other.hist);
    }

    /// How many round trips were recorded.
    pub fn len(&self) -> u64 {
        self.hist.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    /// Percentiles and moments in microseconds; `None` when nothing was recorded.
    pub fn summary(&self) -> Option<LatencySummary> {
        (!self.hist.is_empty()).then(|| LatencySummary::of(&self.hist))
    }

    /// The raw distribution: `[rtt_ns, count]` for every non-empty bucket, ascending.
    pub fn buckets(&self) -> Vec<[u64; 2]> {
        self.hist.iter_recorded().map(|v| [v.value_iterated_to(), v.count_at_value()]).collect()
    }
}

/// Round-trip statistics of one latency job, in microseconds (`count`: recorded round trips,
/// warm-up excluded): the same summary as the rankers' and trainers' reports.
pub use bex_traffic::LatencySummary;

/// One bandwidth repetition.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BwRep {
    /// Payload bytes moved.
    pub bytes: u64,
    /// Messages moved.
    pub messages: u64,
    /// Elapsed nanoseconds, first post to last completion (or acknowledgement).
    pub elapsed_ns: u64,
    /// Payload gigabits (10^9) per second.
    pub gbps: f64,
}

impl BwRep {
    /// A repetition that moved `messages` messages of `size` bytes in `elapsed`.
    pub fn new(size: u32, messages: u64, elapsed: Duration) -> BwRep {
        let bytes = u64::from(size) * messages;
        let elapsed_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1);
        BwRep { bytes, messages, elapsed_ns, gbps: gbps(bytes, elapsed_ns) }
    }
}

/// Summary of a bandwidth job's repetitions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BandwidthSummary {
    /// Repetitions.
    pub reps: usize,
    /// Median throughput over the repetitions, Gb/s.
    pub median_gbps: f64,
    /// Slowest repetition, Gb/s.
    pub min_gbps: f64,
    /// Fastest repetition, Gb/s.
    pub max_gbps: f64,
    /// Median message rate, millions of messages per second.
    pub median_mmsgs: f64,
}

/// Summarizes repetitions; `None` for none.
pub fn summarize_bw(reps: &[BwRep]) -> Option<BandwidthSummary> {
    let g: Vec<f64> = reps.iter().map(|r| r.gbps).collect();
    let rates: Vec<f64> =
        reps.iter().map(|r| r.messages as f64 * 1000.0 / r.elapsed_ns as f64).collect();
    Some(BandwidthSummary {
        reps: reps.len(),
        median_gbps: median(&g)?,
        min_gbps: g.iter().copied().fold(f64::INFINITY, f64::min),
        max_gbps: g.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        median_mmsgs: median(&rates)?,
    })
}

/// Payload gigabits per second for `bytes` moved in `elapsed_ns` (0 for no time).
pub fn gbps(bytes: u64, elapsed_ns: u64) -> f64 {
    if elapsed_ns == 0 {
        return 0.0;
    }
    bytes as f64 * 8.0 / elapsed_ns as f64
}

/// The median (mean of the two middle values for an even count); `None` for no values or NaN.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// `num / den` when both exist and `den` is a positive finite number; `None` ("n/a") otherwise.
pub fn ratio(num: Option<f64>, den: Option<f64>) -> Option<f64> {
    match (num, den) {
        (Some(n), Some(d)) if d > 0.0 && d.is_finite() && n.is_finite() => Some(n / d),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 0.002 + 1e-9
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.5]), Some(7.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn ratio_is_none_without_a_usable_denominator() {
        assert_eq!(ratio(Some(6.0), Some(3.0)), Some(2.0));
        assert_eq!(ratio(Some(6.0), None), None);
        assert_eq!(ratio(None, Some(3.0)), None);
        assert_eq!(ratio(Some(6.0), Some(0.0)), None);
        assert_eq!(ratio(Some(6.0), Some(-1.0)), None);
        assert_eq!(ratio(Some(f64::INFINITY), Some(1.0)), None);
    }

    #[test]
    fn latency_percentiles_follow_the_samples() {
        let mut r = LatencyRecorder::new();
        assert!(r.summary().is_none());
        // 1..=1000 µs, one sample each.
        for us in 1..=1000u64 {
            r.record(Duration::from_micros(us));
        }
        let s = r.summary().unwrap();
        assert_eq!(s.count, 1000);
        assert!(close(s.min_us, 1.0), "{s:?}");
        assert!(close(s.p50_us, 500.0), "{s:?}");
        assert!(close(s.p99_us, 990.0), "{s:?}");
        assert!(close(s.max_us, 1000.0), "{s:?}");
        assert!(close(s.mean_us, 500.5), "{s:?}");
        assert!(s.min_us <= s.p50_us && s.p50_us <= s.p90_us && s.p90_us <= s.p99_us);
        assert!(s.p99_us <= s.p999_us && s.p999_us <= s.max_us);
        let buckets = r.buckets();
        assert_eq!(buckets.iter().map(|b| b[1]).sum::<u64>(), 1000);
        assert!(buckets.windows(2).all(|w| w[0][0] < w[1][0]));
    }

    #[test]
    fn absurd_latencies_are_clamped_not_lost() {
        let mut r = LatencyRecorder::new();
        r.record(Duration::from_secs(3600));
        r.record(Duration::ZERO);
        assert_eq!(r.len(), 2);
        assert!(close(r.summary().unwrap().max_us, 60e6));
    }

    #[test]
    fn bandwidth_is_bits_over_nanoseconds() {
        // 1 GB in 1 s is 8 Gb/s.
        let rep = BwRep::new(1_000_000, 1000, Duration::from_secs(1));
        assert_eq!(rep.bytes, 1_000_000_000);
        assert!(close(rep.gbps, 8.0));
        assert_eq!(gbps(100, 0), 0.0);
        let reps = [
            BwRep::new(1000, 1000, Duration::from_millis(4)),
            BwRep::new(1000, 1000, Duration::from_millis(1)),
            BwRep::new(1000, 1000, Duration::from_millis(2)),
        ];
        let s = summarize_bw(&reps).unwrap();
        assert!(close(s.median_gbps, 4.0), "{s:?}");
        assert!(close(s.min_gbps, 2.0) && close(s.max_gbps, 8.0), "{s:?}");
        assert!(close(s.median_mmsgs, 0.5), "{s:?}");
        assert!(summarize_bw(&[]).is_none());
    }
}
