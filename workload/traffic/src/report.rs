//! Run reports: latency histograms, throughput, outcome counts, bytes and a per-second series.

use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Answered in time (possibly after retries or from a fallback).
    Ok,
    /// Gave up at the deadline.
    Timeout,
    /// Failed with an error.
    Error,
}

/// One finished request, as the load driver saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// When it finished, from the start of the run (places it in the time series).
    pub at: Duration,
    /// Arrival (scheduled, for open loop) to completion.
    pub latency: Duration,
    /// How it ended.
    pub outcome: Outcome,
    /// Retries it took (0 if answered first time).
    pub retries: u32,
    /// Whether any part was served by a fallback (e.g. default embeddings).
    pub fallback: bool,
    /// Request bytes sent.
    pub bytes_sent: u64,
    /// Response bytes received.
    pub bytes_received: u64,
}

impl Completion {
    /// A first-try success with no bytes accounted.
    pub fn ok(at: Duration, latency: Duration) -> Self {
        Self {
            at,
            latency,
            outcome: Outcome::Ok,
            retries: 0,
            fallback: false,
            bytes_sent: 0,
            bytes_received: 0,
        }
    }
}

/// Latency percentiles and moments in microseconds, of a histogram of nanoseconds: the one
/// latency summary of bex's reports (rankers, trainers and the benchmark tools). A field a
/// report of an earlier version lacks (min, p90 and stdev in trainers' reports, stdev in all)
/// reads as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Minimum.
    pub min_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Maximum.
    pub max_us: f64,
    /// Standard deviation.
    pub stdev_us: f64,
}

impl LatencySummary {
    /// The summary of a histogram of nanoseconds (all zeros when it is empty).
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let us = |ns: u64| ns as f64 / 1e3;
        Self {
            count: h.len(),
            mean_us: h.mean() / 1e3,
            min_us: us(h.min()),
            p50_us: us(h.value_at_quantile(0.5)),
            p90_us: us(h.value_at_quantile(0.9)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
            stdev_us: h.stdev() / 1e3,
        }
    }
}

/// One second of the run: completions whose `at` falls in `[second, second + 1)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecondBucket {
    /// Second index from the start of the run.
    pub second: u64,
    /// Completions of any outcome.
    pub completed: u64,
    /// Successful completions.
    pub ok: u64,
    /// Timeouts.
    pub timeouts: u64,
    /// Errors.
    pub errors: u64,
    /// Request plus response bytes.
    pub bytes: u64,
    /// Median latency of this second's successes (2 significant digits), µs.
    pub p50_us: f64,
    /// 99th percentile latency of this second's successes (2 significant digits), µs.
    pub p99_us: f64,
}

/// The result of a run: serialise with serde (e.g. [`Report::to_json`]) or read
/// [`Report::summary`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Length of the run, seconds.
    pub elapsed_s: f64,
    /// Completions of any outcome.
    pub requests: u64,
    /// Successes.
    pub ok: u64,
    /// Timeouts.
    pub timeouts: u64,
    /// Errors.
    pub errors: u64,
    /// Total retries over all requests.
    pub retries: u64,
    /// Requests that used a fallback.
    pub fallbacks: u64,
    /// Completions per second.
    pub throughput_rps: f64,
    /// Successes per second.
    pub goodput_rps: f64,
    /// Request bytes sent.
    pub bytes_sent: u64,
    /// Response bytes received.
    pub bytes_received: u64,
    /// Latency of successful requests (timeouts and errors are counted, not timed).
    pub latency: LatencySummary,
    /// Per-second series, one bucket for every second from 0 to the last completion.
    pub series: Vec<SecondBucket>,
}

/// Highest latency recorded exactly (one hour, in ns); longer ones saturate there.
const MAX_NS: u64 = 3_600_000_000_000;

/// Accumulates [`Completion`]s into a [`Report`].
#[derive(Debug, Clone)]
pub struct Recorder {
    latency: Histogram<u64>,
    seconds: Vec<SecondAcc>,
    requests: u64,
    ok: u64,
    timeouts: u64,
    errors: u64,
    retries: u64,
    fallbacks: u64,
    bytes_sent: u64,
    bytes_received: u64,
}

#[derive(Debug, Clone)]
struct SecondAcc {
    completed: u64,
    ok: u64,
    timeouts: u64,
    errors: u64,
    bytes: u64,
    latency: Histogram<u64>,
}

impl SecondAcc {
    fn new() -> Self {
        Self {
            completed: 0,
            ok: 0,
            timeouts: 0,
            errors: 0,
            bytes: 0,
            // Small per-second histograms: 2 significant digits up to a minute.
            latency: Histogram::new_with_bounds(1, 60_000_000_000, 2)
                .expect("constant histogram bounds are valid"),
        }
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self {
            latency: Histogram::new_with_bounds(1, MAX_NS, 3)
                .expect("constant histogram bounds are valid"),
            seconds: Vec::new(),
            requests: 0,
            ok: 0,
            timeouts: 0,
            errors: 0,
            retries: 0,
            fallbacks: 0,
            bytes_sent: 0,
            bytes_received: 0,
        }
    }

    /// Records one finished request.
    pub fn record(&mut self, c: Completion) {
        let ns = u64::try_from(c.latency.as_nanos()).unwrap_or(u64::MAX);
        self.requests += 1;
        self.retries += u64::from(c.retries);
        self.fallbacks += u64::from(c.fallback);
        self.bytes_sent = self.bytes_sent.saturating_add(c.bytes_sent);
        self.bytes_received = self.bytes_received.saturating_add(c.bytes_received);
        let sec = usize::try_from(c.at.as_secs()).unwrap_or(usize::MAX);
        // A completion absurdly far out (beyond ~a day) would grow the series without bound;
        // fold it into the last bucket instead.
        let sec = sec.min(86_400);
        if self.seconds.len() <= sec {
            self.seconds.resize_with(sec + 1, SecondAcc::new);
        }
        let b = &mut self.seconds[sec];
        b.completed += 1;
        b.bytes = b.bytes.saturating_add(c.bytes_sent).saturating_add(c.bytes_received);
        match c.outcome {
            Outcome::Ok => {
                self.ok += 1;
                b.ok += 1;
                self.latency.saturating_record(ns.min(MAX_NS));
                b.latency.saturating_record(ns);
            }
            Outcome::Timeout => {
                self.timeouts += 1;
                b.timeouts += 1;
            }
            Outcome::Error => {
                self.errors += 1;
                b.errors += 1;
            }
        }
    }

    /// The report for a run of length `elapsed` (rates are per second of `elapsed`; zero
    /// gives zero rates).
    pub fn report(&self, elapsed: Duration) -> Report {
        let secs = elapsed.as_secs_f64();
        let rate = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let series = self
            .seconds
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let (p50, p99) = if b.latency.is_empty() {
                    (0.0, 0.0)
                } else {
                    (
                        b.latency.value_at_quantile(0.5) as f64 / 1e3,
                        b.latency.value_at_quantile(0.99) as f64 / 1e3,
                    )
                };
                SecondBucket {
                    second: i as u64,
                    completed: b.completed,
                    ok: b.ok,
                    timeouts: b.timeouts,
                    errors: b.errors,
                    bytes: b.bytes,
                    p50_us: p50,
                    p99_us: p99,
                }
            })
            .collect();
        Report {
            elapsed_s: secs,
            requests: self.requests,
            ok: self.ok,
            timeouts: self.timeouts,
            errors: self.errors,
            retries: self.retries,
            fallbacks: self.fallbacks,
            throughput_rps: rate(self.requests),
            goodput_rps: rate(self.ok),
            bytes_sent: self.bytes_sent,
            bytes_received: self.bytes_received,
            latency: LatencySummary::of(&self.latency),
            series,
        }
    }
}

impl Report {
    /// Pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // A Report is plain numbers, strings and vectors: serialising cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A short human-readable summary (a few lines, no time series).
    pub fn summary(&self) -> String {
        let l = &self.latency;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} requests in {:.3} s: {:.1} req/s ({:.1} ok/s)",
            self.requests, self.elapsed_s, self.throughput_rps, self.goodput_rps
        );
        let _ = writeln!(
            s,
            "ok {}  timeouts {}  errors {}  retries {}  fallbacks {}",
            self.ok, self.timeouts, self.errors, self.retries, self.fallbacks
        );
        let _ = writeln!(
            s,
            "latency µs: mean {:.1}  p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
            l.mean_us, l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
        );
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let _ = write!(
            s,
            "bytes: sent {:.2} MiB  received {:.2} MiB",
            mib(self.bytes_sent),
            mib(self.bytes_received)
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= want.abs() * rel
    }

    #[test]
    fn percentiles_on_known_data() {
        let mut r = Recorder::new();
        // 1 µs .. 10 000 µs, one each, spread over 10 seconds.
        for i in 1..=10_000u64 {
            r.record(Completion::ok(Duration::from_millis(i - 1), Duration::from_micros(i)));
        }
        let rep = r.report(Duration::from_secs(10));
        let l = &rep.latency;
        assert_eq!(l.count, 10_000);
        // 3 significant digits: values within 0.1% (plus the bucket's upper edge).
        assert!(close(l.mean_us, 5_000.5, 0.002), "mean {}", l.mean_us);
        assert!(close(l.p50_us, 5_000.0, 0.002), "p50 {}", l.p50_us);
        assert!(close(l.p90_us, 9_000.0, 0.002), "p90 {}", l.p90_us);
        assert!(close(l.p99_us, 9_900.0, 0.002), "p99 {}", l.p99_us);
        assert!(close(l.p999_us, 9_990.0, 0.002), "p999 {}", l.p999_us);
        assert!(close(l.min_us, 1.0, 0.002), "min {}", l.min_us);
        assert!(close(l.max_us, 10_000.0, 0.002), "max {}", l.max_us);
        assert!(close(rep.throughput_rps, 1_000.0, 1e-9));
        assert_eq!(rep.series.len(), 10);
        for (s, b) in rep.series.iter().enumerate() {
            assert_eq!(b.second, s as u64);
            assert_eq!(b.completed, 1_000);
            // Second s holds latencies s*1000+1 ..= s*1000+1000 µs.
            let mid = s as f64 * 1_000.0 + 500.0;
            assert!(close(b.p50_us, mid, 0.02), "second {s}: p50 {}", b.p50_us);
        }
    }

    #[test]
    fn counts_bytes_and_series_gaps() {
        let mut r = Recorder::new();
        let base = Completion {
            at: Duration::from_millis(500),
            latency: Duration::from_millis(2),
            outcome: Outcome::Ok,
            retries: 1,
            fallback: true,
            bytes_sent: 100,
            bytes_received: 1_000,
        };
        r.record(base);
        r.record(Completion { outcome: Outcome::Timeout, retries: 2, fallback: false, ..base });
        r.record(Completion {
            at: Duration::from_millis(2_100),
            outcome: Outcome::Error,
            retries: 0,
            ..base
        });
        let rep = r.report(Duration::from_secs(4));
        assert_eq!(
            (rep.requests, rep.ok, rep.timeouts, rep.errors, rep.retries, rep.fallbacks),
            (3, 1, 1, 1, 3, 2)
        );
        assert_eq!((rep.bytes_sent, rep.bytes_received), (300, 3_000));
        assert_eq!(rep.latency.count, 1, "only successes are timed");
        assert!(close(rep.throughput_rps, 0.75, 1e-9));
        assert!(close(rep.goodput_rps, 0.25, 1e-9));
        let per_sec: Vec<(u64, u64, u64, u64)> =
            rep.series.iter().map(|b| (b.completed, b.timeouts, b.errors, b.bytes)).collect();
        assert_eq!(per_sec, vec![(2, 1, 0, 2_200), (0, 0, 0, 0), (1, 0, 1, 1_100)]);

        let back: Report = serde_json::from_str(&rep.to_json()).unwrap();
        assert_eq!(back, rep);
        let s = rep.summary();
        assert!(s.contains("3 requests"), "{s}");
        assert!(s.contains("timeouts 1"), "{s}");
        assert!(s.contains("p99"), "{s}");
    }

    #[test]
    fn empty_and_zero_elapsed() {
        let rep = Recorder::new().report(Duration::ZERO);
        assert_eq!(rep.requests, 0);
        assert_eq!(rep.throughput_rps, 0.0);
        assert_eq!(rep.latency.p99_us, 0.0);
        assert!(rep.series.is_empty());
        assert!(!rep.summary().is_empty());
    }
}
