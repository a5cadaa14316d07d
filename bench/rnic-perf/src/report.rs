//! Results and how they are shown: a per-size table (latency and bandwidth, one column group
//! per transport, plus RNIC/baseline ratios) and a JSON document with every raw number.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::spec::{JobSpec, Metric, Plan, TestKind};
use bex_bench::pin::Placement;
use bex_bench::report::Envelope;
use bex_bench::stats::{ratio, BandwidthSummary, BwRep, LatencySummary};

/// What a job that ran measured.
#[derive(Clone, Debug, PartialEq)]
pub enum Measured {
    /// A latency job's round trips.
    Latency {
        /// Percentiles.
        summary: LatencySummary,
        /// The raw distribution: `[rtt_ns, count]` per non-empty histogram bucket.
        rtt_ns_histogram: Vec<[u64; 2]>,
        /// UDP datagrams resent after a loss (those rounds are not in the histogram).
        retransmits: u64,
    },
    /// A bandwidth job's repetitions.
    Bandwidth {
        /// Median and spread.
        summary: BandwidthSummary,
        /// Every repetition.
        reps: Vec<BwRep>,
    },
}

/// What one job produced (`NotApplicable`: UDP cannot carry the size in one datagram).
pub type Outcome = bex_bench::report::Outcome<Measured>;

/// One job and its outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// The job.
    pub spec: JobSpec,
    /// What came of it.
    pub outcome: Outcome,
}

impl JobResult {
    /// The series (column group) the job belongs to: the test, plus the MTU for RNIC tests.
    pub fn series(&self) -> String {
        series_name(self.spec.test, self.spec.mtu)
    }

    /// Median round trip (µs) or median bandwidth (Gb/s), when measured.
    pub fn headline(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Measured(Measured::Latency { summary, .. }) => Some(summary.p50_us),
            Outcome::Measured(Measured::Bandwidth { summary, .. }) => Some(summary.median_gbps),
            _ => None,
        }
    }

    /// True for failed jobs (n/a and measured jobs are fine).
    pub fn is_failure(&self) -> bool {
        self.outcome.is_failure()
    }
}

/// The column-group name of a test at an MTU.
pub fn series_name(test: TestKind, mtu: Option<u32>) -> String {
    match mtu {
        Some(m) => format!("{test}@{m}"),
        None => test.name().to_string(),
    }
}

/// An RNIC/baseline comparison at one size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ratio {
    /// Message size.
    pub size: u32,
    /// The RNIC series (`send_lat@4096`).
    pub series: String,
    /// The baseline it is compared with.
    pub baseline: TestKind,
    /// What is divided: `p50_rtt` (RNIC / UDP, lower is better) or `median_gbps` (RNIC / TCP,
    /// higher is better).
    pub metric: &'static str,
    /// The ratio; `null` when either side has no number (failed, n/a, not run).
    pub value: Option<f64>,
}

/// Every RNIC/baseline ratio the results allow.
pub fn ratios(results: &[JobResult]) -> Vec<Ratio> {
    let mut out = Vec::new();
    for r in results.iter().filter(|r| r.spec.test.is_rdma()) {
        let Some(base) = r.spec.test.baseline() else { continue };
        let base_value = results
            .iter()
            .find(|b| b.spec.test == base && b.spec.size == r.spec.size)
            .and_then(JobResult::headline);
        out.push(Ratio {
            size: r.spec.size,
            series: r.series(),
            baseline: base,
            metric: match r.spec.test.metric() {
                Metric::Latency => "p50_rtt",
                Metric::Bandwidth => "median_gbps",
            },
            value: ratio(r.headline(), base_value),
        });
    }
    out
}

/// A cell for a job: its numbers, or why there are none.
fn cell(r: Option<&JobResult>, pick: impl Fn(&Outcome) -> Option<f64>) -> String {
    match r.map(|r| &r.outcome) {
        None => "-".into(),
        Some(o) => match o.missing_cell() {
            Some(c) => c.into(),
            None => pick(o).map_or("-".into(), |v| format!("{v:.2}")),
        },
    }
}

/// The human-readable tables and the list of failures.
pub fn table(plan: &Plan, placement: &Placement, results: &[JobResult]) -> String {
    let mut out = format!("Placement: {placement}\n\n");
    for metric in [Metric::Latency, Metric::Bandwidth] {
        let mine: Vec<&JobResult> =
            results.iter().filter(|r| r.spec.test.metric() == metric).collect();
        if mine.is_empty() {
            continue;
        }
        // Column groups in execution order.
        let mut series: Vec<(String, TestKind)> = Vec::new();
        for r in &mine {
            if !series.iter().any(|(s, _)| *s == r.series()) {
                series.push((r.series(), r.spec.test));
            }
        }
        let by_key: BTreeMap<(String, u32), &JobResult> =
            mine.iter().map(|r| ((r.series(), r.spec.size), *r)).collect();
        let mut header = vec!["size".to_string()];
        for (s, _) in &series {
            match metric {
                Metric::Latency => {
                    header.push(format!("{s} p50"));
                    header.push(format!("{s} p99"));
                }
                Metric::Bandwidth => header.push(format!("{s} Gb/s")),
            }
        }
        let rdma: Vec<&(String, TestKind)> = series.iter().filter(|(_, t)| t.is_rdma()).collect();
        for (s, t) in &rdma {
            let base = t.baseline().map_or("?", TestKind::name);
            header.push(format!("{s}/{base}"));
        }
        let all_ratios = ratios(results);
        let mut rows = Vec::new();
        for &size in &plan.sizes {
            let mut row = vec![size.to_string()];
            for (s, _) in &series {
                let r = by_key.get(&(s.clone(), size)).copied();
                match metric {
                    Metric::Latency => {
                        row.push(cell(r, |o| match o {
                            Outcome::Measured(Measured::Latency { summary, .. }) => {
                                Some(summary.p50_us)
                            }
                            _ => None,
                        }));
                        row.push(cell(r, |o| match o {
                            Outcome::Measured(Measured::Latency { summary, .. }) => {
                                Some(summary.p99_us)
                            }
                            _ => None,
                        }));
                    }
                    Metric::Bandwidth => row.push(cell(r, |o| match o {
                        Outcome::Measured(Measured::Bandwidth { summary, .. }) => {
                            Some(summary.median_gbps)
                        }
                        _ => None,
                    })),
                }
            }
            for (s, _) in &rdma {
                let v = all_ratios.iter().find(|x| x.size == size && x.series == *s);
                row.push(match v {
                    Some(Ratio { value: Some(v), .. }) => format!("{v:.2}x"),
                    Some(_) => "n/a".into(),
                    None => "-".into(),
                });
            }
            rows.push(row);
        }
        let title = match metric {
            Metric::Latency => format!(
                "Latency: round-trip time in µs (perftest prints half of it), p50 and p99 of {} \
                 round trips after {} warm-up; ratio = RNIC p50 / UDP p50 (lower is better)",
                plan.lat_iters, plan.knobs.warmup
            ),
            Metric::Bandwidth => format!(
                "Bandwidth: payload Gb/s, median of {} repetitions of {} messages after {} \
                 warm-up; ratio = RNIC / TCP (higher is better)",
                plan.reps, plan.bw_iters, plan.knobs.warmup
            ),
        };
        out.push_str(&bex_bench::report::render(&title, &header, &rows));
        out.push('\n');
    }
    // Failures, one line per series and distinct message.
    let mut seen: Vec<(String, String)> = Vec::new();
    for r in results {
        if let Some(e) = r.outcome.failure() {
            let key = (r.series(), e.to_string());
            if !seen.contains(&key) {
                seen.push(key);
            }
        }
    }
    if !seen.is_empty() {
        out.push_str("Failures:\n");
        for (s, e) in seen {
            let _ = writeln!(out, "  {s}: {e}");
        }
    }
    if results.iter().any(|r| matches!(r.outcome, Outcome::NotApplicable(_))) {
        out.push_str("n/a: UDP cannot carry a message above 65507 bytes in one datagram.\n");
    }
    out
}

/// One job in the JSON document.
#[derive(Debug, Serialize)]
struct JsonJob<'a> {
    test: TestKind,
    series: String,
    size: u32,
    mtu: Option<u32>,
    /// `ok`, `n/a`, `failed` or `skipped`.
    status: &'static str,
    spec: &'a JobSpec,
    latency: Option<&'a LatencySummary>,
    rtt_ns_histogram: Option<&'a [[u64; 2]]>,
    retransmits: Option<u64>,
    bandwidth: Option<&'a BandwidthSummary>,
    reps: Option<&'a [BwRep]>,
    error: Option<&'a str>,
}

/// The JSON document of a run.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    #[serde(flatten)]
    envelope: &'a Envelope,
    plan: &'a Plan,
    results: Vec<JsonJob<'a>>,
    ratios: Vec<Ratio>,
}

/// Renders the JSON document: the exact command line, the plan, every job with its raw
/// numbers, and the ratios.
pub fn json(envelope: &Envelope, plan: &Plan, results: &[JobResult]) -> String {
    let jobs = results
        .iter()
        .map(|r| {
            let mut j = JsonJob {
                test: r.spec.test,
                series: r.series(),
                size: r.spec.size,
                mtu: r.spec.mtu,
                status: r.outcome.status(),
                spec: &r.spec,
                latency: None,
                rtt_ns_histogram: None,
                retransmits: None,
                bandwidth: None,
                reps: None,
                error: r.outcome.reason(),
            };
            match &r.outcome {
                Outcome::Measured(Measured::Latency { summary, rtt_ns_histogram, retransmits }) => {
                    j.latency = Some(summary);
                    j.rtt_ns_histogram = Some(rtt_ns_histogram);
                    j.retransmits = Some(*retransmits);
                }
                Outcome::Measured(Measured::Bandwidth { summary, reps }) => {
                    j.bandwidth = Some(summary);
                    j.reps = Some(reps);
                }
                _ => {}
            }
            j
        })
        .collect();
    let doc = JsonReport { envelope, plan, results: jobs, ratios: ratios(results) };
    // Plain data with string keys: serialization cannot fail.
    serde_json::to_string_pretty(&doc).expect("report serializes")
}

impl bex_bench::report::ProgressLine for JobResult {
    /// One line for progress output.
    fn progress_line(&self) -> String {
        let what = format!("{} {} B", self.series(), self.spec.size);
        match &self.outcome {
            Outcome::Measured(Measured::Latency { summary: s, .. }) => {
                format!("{what}: RTT p50 {:.2} µs, p99 {:.2} µs", s.p50_us, s.p99_us)
            }
            Outcome::Measured(Measured::Bandwidth { summary: s, .. }) => format!(
                "{what}: {:.2} Gb/s median of {} (min {:.2}, max {:.2})",
                s.median_gbps, s.reps, s.min_gbps, s.max_gbps
            ),
            o => o.missing_line(&what).unwrap_or(what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Knobs;
    use bex_bench::stats::LatencyRecorder;
    use std::time::Duration;

    const TEST_KNOBS: Knobs =
        Knobs { warmup: 0, window: 8, batch: 1, signal_every: 1, spin_polls: 0 };

    fn spec(test: TestKind, size: u32, mtu: Option<u32>) -> JobSpec {
        JobSpec { test, size, mtu, iters: 10, reps: 1, knobs: TEST_KNOBS }
    }

    fn lat(test: TestKind, size: u32, mtu: Option<u32>, us: u64) -> JobResult {
        let mut rec = LatencyRecorder::new();
        rec.record(Duration::from_micros(us));
        JobResult {
            spec: spec(test, size, mtu),
            outcome: Outcome::Measured(Measured::Latency {
                summary: rec.summary().unwrap(),
                rtt_ns_histogram: rec.buckets(),
                retransmits: 0,
            }),
        }
    }

    fn bw(test: TestKind, size: u32, mtu: Option<u32>, gbps_x8: u64) -> JobResult {
        // `gbps_x8` gigabytes in 8 s: gbps_x8 Gb/s.
        let reps = vec![BwRep::new(
            size,
            gbps_x8 * 1_000_000_000 / u64::from(size),
            Duration::from_secs(8),
        )];
        JobResult {
            spec: spec(test, size, mtu),
            outcome: Outcome::Measured(Measured::Bandwidth {
                summary: bex_bench::stats::summarize_bw(&reps).unwrap(),
                reps,
            }),
        }
    }

    fn plan(sizes: Vec<u32>) -> Plan {
        Plan {
            tests: vec![],
            sizes,
            mtus: vec![4096],
            lat_iters: 10,
            bw_iters: 10,
            reps: 1,
            knobs: TEST_KNOBS,
        }
    }

    #[test]
    fn ratios_pair_each_rnic_series_with_its_baseline_at_the_same_size() {
        let results = vec![
            lat(TestKind::UdpLat, 64, None, 10),
            lat(TestKind::SendLat, 64, Some(4096), 25),
            lat(TestKind::SendLat, 128, Some(4096), 25),
            bw(TestKind::TcpBw, 64, None, 16),
            bw(TestKind::WriteBw, 64, Some(61440), 8),
            JobResult {
                spec: spec(TestKind::WriteLat, 64, Some(4096)),
                outcome: Outcome::Failed("the peer QP went to error".into()),
            },
        ];
        let r = ratios(&results);
        assert_eq!(r.len(), 4);
        let find =
            |series: &str, size| r.iter().find(|x| x.series == series && x.size == size).unwrap();
        let v = find("send_lat@4096", 64).value.unwrap();
        assert!((v - 2.5).abs() < 0.01, "{v}");
        assert_eq!(find("send_lat@4096", 128).value, None, "no UDP number at 128 B");
        let v = find("write_bw@61440", 64).value.unwrap();
        assert!((v - 0.5).abs() < 0.01, "{v}");
        assert_eq!(find("write_lat@4096", 64).value, None);
    }

    #[test]
    fn table_shows_numbers_na_errors_and_ratios() {
        let results = vec![
            lat(TestKind::UdpLat, 64, None, 10),
            JobResult {
                spec: spec(TestKind::UdpLat, 65536, None),
                outcome: Outcome::NotApplicable("too big".into()),
            },
            lat(TestKind::SendLat, 64, Some(4096), 25),
            JobResult {
                spec: spec(TestKind::SendLat, 65536, Some(4096)),
                outcome: Outcome::Failed("boom".into()),
            },
        ];
        let t = table(&plan(vec![64, 65536]), &Placement::default(), &results);
        assert!(t.contains("udp_lat p50"), "{t}");
        assert!(t.contains("send_lat@4096/udp_lat"), "{t}");
        assert!(t.contains("2.50x"), "{t}");
        assert!(t.contains("n/a"), "{t}");
        assert!(t.contains("err"), "{t}");
        assert!(t.contains("send_lat@4096: boom"), "{t}");
    }

    #[test]
    fn json_carries_the_command_line_and_raw_numbers() {
        let results = vec![lat(TestKind::TcpLat, 64, None, 10), bw(TestKind::TcpBw, 64, None, 16)];
        let envelope = Envelope {
            tool: "rnic-perf".into(),
            version: "0".into(),
            command_line: vec!["rnic-perf".to_string(), "run".to_string()],
            placement: Placement { client_cpu: Some(0), server_cpu: Some(1) },
        };
        let doc: serde_json::Value =
            serde_json::from_str(&json(&envelope, &plan(vec![64]), &results)).unwrap();
        assert_eq!(doc["tool"], "rnic-perf");
        assert_eq!(doc["command_line"][1], "run");
        assert_eq!(doc["placement"]["server_cpu"], 1);
        assert_eq!(doc["results"][0]["status"], "ok");
        assert!(doc["results"][0]["latency"]["p50_us"].as_f64().unwrap() > 9.9);
        assert!(doc["results"][0]["rtt_ns_histogram"][0][1].as_u64() == Some(1));
        assert_eq!(doc["results"][1]["reps"].as_array().unwrap().len(), 1);
    }
}
