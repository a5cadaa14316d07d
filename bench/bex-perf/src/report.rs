//! Results and how they are shown: one table per test (medians and P99s, RDMA/TCP ratios),
//! the targets, a JSON document with every raw number and the exact command line, and one
//! SVG figure per test (drawn with `bex-plot`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use bex_bench::pin::Placement;
use bex_bench::report::Envelope;
use bex_bench::stats::{ratio, BandwidthSummary, BwRep, LatencySummary};
use bex_plot::{fmt_bytes, log2_ticks, Chart, Series, COLORS};
use serde::Serialize;

use crate::spec::{Job, Plan, Test};

/// What a job that ran measured.
#[derive(Clone, Debug, PartialEq)]
pub enum Measured {
    /// Round trips.
    Latency {
        /// Percentiles and mean, µs.
        summary: LatencySummary,
        /// `[rtt_ns, count]` per non-empty histogram bucket.
        histogram: Vec<[u64; 2]>,
    },
    /// Repetitions of a windowed transfer.
    Throughput {
        /// Medians over repetitions.
        summary: BandwidthSummary,
        /// Every repetition.
        reps: Vec<BwRep>,
    },
}

/// What one job produced.
pub type Outcome = bex_bench::report::Outcome<Measured>;

/// A job and what came of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// The job.
    pub job: Job,
    /// Its outcome.
    pub outcome: Outcome,
    /// Secondary numbers (large-flow Gb/s of `hol`, virtual time of `hol-sim`, …).
    pub extra: BTreeMap<String, f64>,
    /// The client transport's counters after the job.
    pub client_counters: BTreeMap<String, u64>,
    /// The server transports' counters after the job (summed).
    pub server_counters: BTreeMap<String, u64>,
}

impl Point {
    /// A point with no counters or extras.
    pub fn new(job: Job, outcome: Outcome) -> Point {
        Point {
            job,
            outcome,
            extra: BTreeMap::new(),
            client_counters: BTreeMap::new(),
            server_counters: BTreeMap::new(),
        }
    }

    /// True for failed or skipped jobs.
    pub fn is_failure(&self) -> bool {
        self.outcome.is_failure()
    }
}

/// A number of a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Mean RTT, µs.
    Mean,
    /// Median RTT, µs.
    P50,
    /// 99th percentile RTT, µs.
    P99,
    /// Median throughput, Gb/s.
    Gbps,
    /// Median request rate, millions per second.
    Mreqs,
    /// Large-flow throughput next to a HoL measurement, Gb/s.
    LargeGbps,
    /// CPU time of both processes per message the client received, µs.
    CpuPerMsg,
}

impl Metric {
    fn label(self) -> &'static str {
        match self {
            Metric::Mean => "mean",
            Metric::P50 => "p50",
            Metric::P99 => "p99",
            Metric::Gbps => "Gb/s",
            Metric::Mreqs => "Mreq/s",
            Metric::LargeGbps => "large Gb/s",
            Metric::CpuPerMsg => "CPU µs/req",
        }
    }
}

/// The value of `m` for point `p`, if it has one.
pub fn metric(p: &Point, m: Metric) -> Option<f64> {
    match (&p.outcome, m) {
        (Outcome::Measured(Measured::Latency { summary, .. }), Metric::Mean) => {
            Some(summary.mean_us)
        }
        (Outcome::Measured(Measured::Latency { summary, .. }), Metric::P50) => Some(summary.p50_us),
        (Outcome::Measured(Measured::Latency { summary, .. }), Metric::P99) => Some(summary.p99_us),
        (Outcome::Measured(Measured::Throughput { summary, .. }), Metric::Gbps) => {
            Some(summary.median_gbps)
        }
        (Outcome::Measured(Measured::Throughput { summary, .. }), Metric::Mreqs) => {
            Some(summary.median_mmsgs)
        }
        (Outcome::Measured(Measured::Latency { .. }), Metric::LargeGbps) => {
            p.extra.get("large_gbps").copied()
        }
        (
            Outcome::Measured(Measured::Latency { .. })
            | Outcome::Measured(Measured::Throughput { .. }),
            Metric::CpuPerMsg,
        ) => {
            let msgs = *p.client_counters.get("messages_received")?;
            let cpu = p.client_counters.get("cpu_us")? + p.server_counters.get("cpu_us")?;
            (msgs > 0).then(|| cpu as f64 / msgs as f64)
        }
        _ => None,
    }
}

/// The name of a test's x axis.
pub fn x_name(t: Test) -> &'static str {
    match t {
        Test::Lat | Test::Eager => "size",
        Test::Tput => "outstanding",
        Test::Frag | Test::FragSim => "fragment",
        Test::Rate => "engines",
        Test::Hol | Test::HolSim => "large flows",
        Test::HolRpc => "large-reply flows",
    }
}

fn x_label(t: Test, x: u64) -> String {
    match t {
        Test::Lat | Test::Eager | Test::Frag | Test::FragSim => fmt_bytes(x),
        _ => x.to_string(),
    }
}

/// A table column: a series' metric.
#[derive(Clone)]
struct Col {
    series: &'static str,
    metric: Metric,
}

/// A ratio column: `num / den` of one metric.
struct RatioCol {
    num: &'static str,
    den: &'static str,
    metric: Metric,
}

struct Layout {
    title: &'static str,
    cols: Vec<Col>,
    ratios: Vec<RatioCol>,
}

/// A column per series and metric, series by series.
fn cols(series: &[&'static str], metrics: &[Metric]) -> Vec<Col> {
    series
        .iter()
        .flat_map(|&series| metrics.iter().map(move |&metric| Col { series, metric }))
        .collect()
}

fn rat(num: &'static str, den: &'static str, metric: Metric) -> RatioCol {
    RatioCol { num, den, metric }
}

fn layout(t: Test) -> Layout {
    use Metric::*;
    match t {
        Test::Lat => Layout {
            title: "Fig. 8  lat: round-trip time (µs) with one message outstanding (\"rdma \
                    spin\": endpoint drivers poll 20 µs before waiting); ratio = RDMA / TCP \
                    (lower is better)",
            cols: cols(&["rdma", "rdma spin", "tcp"], &[Mean, P50, P99]),
            ratios: vec![
                rat("rdma", "tcp", P50),
                rat("rdma", "tcp", Mean),
                rat("rdma spin", "tcp", P50),
            ],
        },
        Test::Tput => Layout {
            title: "Fig. 9  tput: 1 MB messages, 32 B response each, one engine/connection: \
                    Gb/s vs messages outstanding (mtu61440: a soft-only MTU); ratio = RDMA / \
                    TCP (higher is better)",
            cols: cols(&["rdma mtu4096", "rdma mtu1024", "rdma mtu61440", "tcp"], &[Gbps]),
            ratios: ["rdma mtu4096", "rdma mtu1024", "rdma mtu61440"]
                .map(|rdma| rat(rdma, "tcp", Gbps))
                .into(),
        },
        Test::Frag => Layout {
            title: "Fig. 10  frag: 1 MB messages, 16 outstanding, one engine: Gb/s vs \
                    fragment size",
            cols: cols(&["rdma"], &[Gbps]),
            ratios: vec![],
        },
        Test::FragSim => Layout {
            title: "Fig. 10  frag-sim (in-memory fabric, virtual time): 1 MB messages, 16 \
                    outstanding, one engine: Gb/s vs fragment size on 25 and 100 Gb/s links",
            cols: cols(&["25 Gb/s", "100 Gb/s"], &[Gbps]),
            ratios: vec![],
        },
        Test::Rate => Layout {
            title: "Fig. 11  rate: 512 B requests (echoed), 8 outstanding per engine: \
                    M requests/s vs engines, and CPU µs (client + server) per request; \
                    ratio = RDMA / TCP",
            cols: [Mreqs, CpuPerMsg]
                .iter()
                .flat_map(|&m| cols(&["rdma 1 endpoint", "rdma 2 endpoints", "tcp"], &[m]))
                .collect(),
            ratios: vec![
                rat("rdma 1 endpoint", "tcp", Mreqs),
                rat("rdma 2 endpoints", "tcp", Mreqs),
            ],
        },
        Test::Hol | Test::HolSim => Layout {
            title: if t == Test::Hol {
                "Fig. 13  hol (loopback): 64 B ping-pong RTT (µs) under competing 1 MB flows \
                 on one engine; ratio = unfragmented / 4K-fragmented p99"
            } else {
                "Fig. 13  hol-sim (in-memory fabric, 25 Gb/s, virtual time): 64 B ping-pong \
                 RTT (µs) under competing 1 MB flows on one engine; ratio = unfragmented / \
                 4K-fragmented p99"
            },
            cols: cols(&["4K fragments", "no fragmentation"], &[P50, P99, LargeGbps]),
            ratios: vec![rat("no fragmentation", "4K fragments", P99)],
        },
        Test::HolRpc => Layout {
            title: "Fig. 13  hol-rpc (loopback, RPC path): RTT (µs) of a call with a 64 B reply \
                    under flows of calls with 1 MB replies (2 outstanding each) to the same \
                    server; over RDMA replies are written into the caller's buffer; \"one \
                    lane\": one connection per destination; ratios: one lane / two, RDMA / TCP \
                    (p99)",
            cols: [
                cols(&["rdma 4K fragments"], &[P50, P99, LargeGbps]),
                cols(&["rdma no fragmentation", "rdma 4K fragments one lane"], &[P99]),
                cols(&["tcp"], &[P50, P99, LargeGbps]),
                cols(&["tcp one lane"], &[P99]),
            ]
            .concat(),
            ratios: vec![
                rat("rdma no fragmentation", "rdma 4K fragments", P99),
                rat("rdma 4K fragments one lane", "rdma 4K fragments", P99),
                rat("tcp one lane", "tcp", P99),
                rat("rdma 4K fragments", "tcp", P99),
            ],
        },
        Test::Eager => Layout {
            title: "paper/002  eager: zero-copy eager sends vs copy mode (eager_max 64 KB), RTT \
                    (µs) of a ping-pong with blocking and with spinning (20 µs) endpoint drivers, and \
                    of a broadcast to 8 sockets (shared: one registered buffer sent 8 times; \
                    zero-copy: a copy per socket, each sent in place; copy: a copy per socket \
                    and the bounce copy); ratios above 1: the second is faster",
            cols: cols(
                &[
                    "zero-copy",
                    "copy",
                    "zero-copy spin",
                    "copy spin",
                    "broadcast shared",
                    "broadcast zero-copy",
                    "broadcast copy",
                ],
                &[P50],
            ),
            ratios: vec![
                rat("copy", "zero-copy", P50),
                rat("copy spin", "zero-copy spin", P50),
                rat("broadcast copy", "broadcast zero-copy", P50),
                rat("broadcast zero-copy", "broadcast shared", P50),
            ],
        },
    }
}

/// A ratio between two series at one x.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RatioValue {
    /// The test.
    pub test: Test,
    /// x.
    pub x: u64,
    /// `num/den metric`.
    pub label: String,
    /// The ratio; `null` when a side has no number (failed, not run).
    pub value: Option<f64>,
}

fn find<'a>(points: &'a [Point], t: Test, series: &str, x: u64) -> Option<&'a Point> {
    points.iter().find(|p| p.job.test == t && p.job.series == series && p.job.x == x)
}

/// Every ratio the results allow.
pub fn ratios(points: &[Point]) -> Vec<RatioValue> {
    let mut out = Vec::new();
    for t in Test::ALL {
        let xs = xs_of(points, t);
        for r in layout(t).ratios {
            for &x in &xs {
                let num = find(points, t, r.num, x);
                let den = find(points, t, r.den, x);
                if num.is_none() || den.is_none() {
                    continue;
                }
                out.push(RatioValue {
                    test: t,
                    x,
                    label: format!("{}/{} {}", r.num, r.den, r.metric.label()),
                    value: ratio(
                        num.and_then(|p| metric(p, r.metric)),
                        den.and_then(|p| metric(p, r.metric)),
                    ),
                });
            }
        }
    }
    out
}

/// The x values of a test, ascending.
fn xs_of(points: &[Point], t: Test) -> Vec<u64> {
    let mut xs: Vec<u64> = points.iter().filter(|p| p.job.test == t).map(|p| p.job.x).collect();
    xs.sort_unstable();
    xs.dedup();
    xs
}

fn cell(p: Option<&Point>, m: Metric) -> String {
    match p.map(|p| (&p.outcome, metric(p, m))) {
        None => "-".into(),
        Some((_, Some(v))) if v >= 100.0 => format!("{v:.0}"),
        Some((_, Some(v))) if v >= 1.0 => format!("{v:.2}"),
        Some((_, Some(v))) => format!("{v:.3}"),
        Some((o, None)) => o.missing_cell().unwrap_or("-").into(),
    }
}

/// The table of one test (empty if it has no points).
pub fn test_table(points: &[Point], t: Test) -> String {
    let xs = xs_of(points, t);
    if xs.is_empty() {
        return String::new();
    }
    let l = layout(t);
    let present = |s: &str| points.iter().any(|p| p.job.test == t && p.job.series == s);
    let cols: Vec<&Col> = l.cols.iter().filter(|c| present(c.series)).collect();
    let rats: Vec<&RatioCol> =
        l.ratios.iter().filter(|r| present(r.num) && present(r.den)).collect();
    let mut header = vec![x_name(t).to_string()];
    header.extend(cols.iter().map(|c| format!("{} {}", c.series, c.metric.label())));
    header.extend(rats.iter().map(|r| format!("{}/{} {}", r.num, r.den, r.metric.label())));
    let mut rows = Vec::new();
    for &x in &xs {
        let mut row = vec![x_label(t, x)];
        for c in &cols {
            row.push(cell(find(points, t, c.series, x), c.metric));
        }
        for r in &rats {
            let v = ratio(
                find(points, t, r.num, x).and_then(|p| metric(p, r.metric)),
                find(points, t, r.den, x).and_then(|p| metric(p, r.metric)),
            );
            row.push(v.map_or("-".into(), |v| format!("{v:.2}x")));
        }
        rows.push(row);
    }
    bex_bench::report::render(l.title, &header, &rows)
}

/// How one target came out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Target {
    /// What is checked.
    pub name: &'static str,
    /// `met`, `not met`, `partly met` or `not run`.
    pub verdict: String,
    /// The numbers behind the verdict.
    pub detail: String,
}

/// The brief's three targets, from the points.
pub fn targets(points: &[Point]) -> Vec<Target> {
    let mut out = Vec::new();
    // 1. RDMA RTT <= TCP RTT, 32 B - 16 KB (median), with waiting and spinning drivers.
    for (name, series) in [
        ("RDMA round trip <= TCP round trip, 32 B-16 KB (p50)", "rdma"),
        ("RDMA (drivers spin 20 µs) round trip <= TCP round trip (p50)", "rdma spin"),
    ] {
        let lat: Vec<(u64, Option<f64>, Option<f64>)> = xs_of(points, Test::Lat)
            .into_iter()
            .map(|x| {
                let v = |s| find(points, Test::Lat, s, x).and_then(|p| metric(p, Metric::P50));
                (x, v(series), v("tcp"))
            })
            .collect();
        if series == "rdma spin" && lat.iter().all(|r| r.1.is_none()) {
            continue;
        }
        out.push(compare(
            name,
            &lat,
            |r, t| r <= t,
            |x, r, t| format!("{}: {r:.1} vs {t:.1} µs ({:.2}x)", fmt_bytes(x), r / t),
        ));
    }
    // 2. 1 MB throughput >= TCP (best over outstanding counts, and at the largest).
    let best = |s: &str| {
        points
            .iter()
            .filter(|p| p.job.test == Test::Tput && p.job.series == s)
            .filter_map(|p| metric(p, Metric::Gbps).map(|g| (p.job.x, g)))
            .fold(
                None,
                |a: Option<(u64, f64)>, b| if a.is_some_and(|a| a.1 >= b.1) { a } else { Some(b) },
            )
    };
    let name = "1 MB throughput: RDMA >= TCP (best over messages outstanding)";
    out.push(match (best("rdma mtu4096"), best("tcp")) {
        (Some((wr, r)), Some((wt, t))) => Target {
            name,
            verdict: if r >= t { "met" } else { "not met" }.into(),
            detail: format!(
                "RDMA {r:.2} Gb/s ({wr} outstanding) vs TCP {t:.2} Gb/s ({wt} outstanding): {:.2}x",
                r / t
            ),
        },
        _ => Target { name, verdict: "not run".into(), detail: "no number for one side".into() },
    });
    // 3. Zero-copy eager faster than copy mode (median RTT), blocking and spinning.
    for (name, zc, cp) in [
        ("zero-copy eager faster than copy mode (p50 ping-pong RTT)", "zero-copy", "copy"),
        (
            "zero-copy eager faster than copy mode, drivers spinning (p50 RTT)",
            "zero-copy spin",
            "copy spin",
        ),
    ] {
        let eager: Vec<(u64, Option<f64>, Option<f64>)> = xs_of(points, Test::Eager)
            .into_iter()
            .map(|x| {
                let v = |s| find(points, Test::Eager, s, x).and_then(|p| metric(p, Metric::P50));
                (x, v(zc), v(cp))
            })
            .filter(|(_, a, b)| a.is_some() || b.is_some())
            .collect();
        if zc.ends_with("spin") && eager.is_empty() {
            continue;
        }
        out.push(compare(
            name,
            &eager,
            |z, c| z < c,
            |x, z, c| {
                format!("{}: {z:.1} vs {c:.1} µs (copy/zero-copy {:.2}x)", fmt_bytes(x), c / z)
            },
        ));
    }
    out
}

fn compare(
    name: &'static str,
    rows: &[(u64, Option<f64>, Option<f64>)],
    ok: impl Fn(f64, f64) -> bool,
    show: impl Fn(u64, f64, f64) -> String,
) -> Target {
    let both: Vec<(u64, f64, f64)> =
        rows.iter().filter_map(|&(x, a, b)| Some((x, a?, b?))).collect();
    if both.is_empty() {
        return Target { name, verdict: "not run".into(), detail: "no numbers".into() };
    }
    let met = both.iter().filter(|&&(_, a, b)| ok(a, b)).count();
    let verdict = if met == both.len() {
        "met"
    } else if met == 0 {
        "not met"
    } else {
        "partly met"
    };
    let detail: Vec<String> = both.iter().map(|&(x, a, b)| show(x, a, b)).collect();
    Target { name, verdict: format!("{verdict} ({met}/{})", both.len()), detail: detail.join("; ") }
}

/// Everything printed after a run: the tables, the targets, notes and failures.
pub fn text(plan: &Plan, placement: &Placement, points: &[Point], notes: &[String]) -> String {
    let mut out = format!("Placement: {placement}\n\n");
    for &t in &plan.tests {
        let table = test_table(points, t);
        if !table.is_empty() {
            out.push_str(&table);
            out.push('\n');
        }
    }
    out.push_str("Targets:\n");
    for t in targets(points) {
        let _ = writeln!(out, "  {}: {}\n      {}", t.name, t.verdict, t.detail);
    }
    if !notes.is_empty() {
        out.push_str("\nNotes:\n");
        for n in notes {
            let _ = writeln!(out, "  - {n}");
        }
    }
    let mut seen: Vec<String> = Vec::new();
    for p in points.iter().filter(|p| p.is_failure()) {
        if let Some(e) = p.outcome.failure() {
            let line = format!("{} {}: {e}", p.job.test, p.job.series);
            if !seen.contains(&line) {
                seen.push(line);
            }
        }
    }
    if !seen.is_empty() {
        out.push_str("\nFailures:\n");
        for l in seen {
            let _ = writeln!(out, "  {l}");
        }
    }
    out
}

/// One point in the JSON document.
#[derive(Debug, Serialize)]
struct JsonPoint<'a> {
    test: Test,
    series: &'a str,
    x: u64,
    /// `ok`, `failed` or `skipped`.
    status: &'static str,
    job: &'a Job,
    latency: Option<&'a LatencySummary>,
    rtt_ns_histogram: Option<&'a [[u64; 2]]>,
    throughput: Option<&'a BandwidthSummary>,
    reps: Option<&'a [BwRep]>,
    extra: &'a BTreeMap<String, f64>,
    client_counters: &'a BTreeMap<String, u64>,
    server_counters: &'a BTreeMap<String, u64>,
    error: Option<&'a str>,
}

/// The JSON document of a run.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    #[serde(flatten)]
    envelope: &'a Envelope,
    server_pid: Option<u32>,
    plan: &'a Plan,
    notes: &'a [String],
    points: Vec<JsonPoint<'a>>,
    ratios: Vec<RatioValue>,
    targets: Vec<Target>,
}

/// Renders the JSON document.
pub fn json(
    envelope: &Envelope,
    server_pid: Option<u32>,
    plan: &Plan,
    notes: &[String],
    points: &[Point],
) -> String {
    let pts = points
        .iter()
        .map(|p| {
            let mut j = JsonPoint {
                test: p.job.test,
                series: &p.job.series,
                x: p.job.x,
                status: p.outcome.status(),
                job: &p.job,
                latency: None,
                rtt_ns_histogram: None,
                throughput: None,
                reps: None,
                extra: &p.extra,
                client_counters: &p.client_counters,
                server_counters: &p.server_counters,
                error: p.outcome.reason(),
            };
            match &p.outcome {
                Outcome::Measured(Measured::Latency { summary, histogram }) => {
                    j.latency = Some(summary);
                    j.rtt_ns_histogram = Some(histogram);
                }
                Outcome::Measured(Measured::Throughput { summary, reps }) => {
                    j.throughput = Some(summary);
                    j.reps = Some(reps);
                }
                _ => {}
            }
            j
        })
        .collect();
    let doc = JsonReport {
        envelope,
        server_pid,
        plan,
        notes,
        points: pts,
        ratios: ratios(points),
        targets: targets(points),
    };
    // Plain data with string keys: serialization cannot fail.
    serde_json::to_string_pretty(&doc).expect("report serializes")
}

/// The series of `t` as (name, points) for `m`, in first-seen order, skipping empty ones.
fn lines(
    points: &[Point],
    t: Test,
    m: Metric,
    x: impl Fn(u64) -> f64,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut names: Vec<&str> = Vec::new();
    for p in points.iter().filter(|p| p.job.test == t) {
        if !names.contains(&p.job.series.as_str()) {
            names.push(&p.job.series);
        }
    }
    names
        .into_iter()
        .map(|n| {
            let pts = points
                .iter()
                .filter(|p| p.job.test == t && p.job.series == n)
                .filter_map(|p| metric(p, m).map(|v| (x(p.job.x), v)))
                .collect::<Vec<_>>();
            (n.to_string(), pts)
        })
        .filter(|(_, pts)| !pts.is_empty())
        .collect()
}

fn log2(v: u64) -> f64 {
    (v.max(1) as f64).log2()
}

/// Solid `primary` and dashed `secondary` lines per series, one colour per series.
fn paired(
    points: &[Point],
    t: Test,
    filter: impl Fn(&str) -> bool,
    primary: Metric,
    secondary: Option<Metric>,
    x: impl Fn(u64) -> f64 + Copy,
) -> Vec<Series> {
    let mut out = Vec::new();
    let main = lines(points, t, primary, x);
    for (i, (name, pts)) in main.into_iter().filter(|(n, _)| filter(n)).enumerate() {
        let color = COLORS[i % COLORS.len()];
        // The metric goes into the legend only where two of them share a colour.
        let label =
            if secondary.is_some() { format!("{name} {}", primary.label()) } else { name.clone() };
        out.push(Series::new(label, color, pts));
        if let Some(m2) = secondary {
            if let Some((_, p2)) = lines(points, t, m2, x).into_iter().find(|(n, _)| *n == name) {
                out.push(Series::new(format!("{name} {}", m2.label()), color, p2).dashed());
            }
        }
    }
    out
}

/// How a panel's x axis is drawn.
#[derive(Clone, Copy)]
enum XAxis {
    /// log2 scale, ticks in bytes.
    Bytes,
    /// log2 scale, ticks as counts.
    Count,
    /// Linear, the plot's own ticks.
    Linear,
}

/// One chart of a figure: `primary` solid and `secondary` dashed per series of `test` whose
/// name `only` accepts.
struct Panel {
    test: Test,
    title: &'static str,
    x_label: &'static str,
    y_label: &'static str,
    only: fn(&str) -> bool,
    primary: Metric,
    secondary: Option<Metric>,
    x: XAxis,
}

impl Panel {
    const fn new(test: Test, title: &'static str, x_label: &'static str) -> Panel {
        Panel {
            test,
            title,
            x_label,
            y_label: "RTT (µs)",
            only: |_| true,
            primary: Metric::P50,
            secondary: None,
            x: XAxis::Bytes,
        }
    }
    const fn y(
        mut self,
        y_label: &'static str,
        primary: Metric,
        secondary: Option<Metric>,
    ) -> Panel {
        self.y_label = y_label;
        self.primary = primary;
        self.secondary = secondary;
        self
    }
    const fn x(mut self, x: XAxis) -> Panel {
        self.x = x;
        self
    }
    const fn only(mut self, only: fn(&str) -> bool) -> Panel {
        self.only = only;
        self
    }

    /// The chart, or none if no series has a number.
    fn chart(&self, points: &[Point]) -> Option<Chart> {
        let x: fn(u64) -> f64 = match self.x {
            XAxis::Linear => |v| v as f64,
            XAxis::Bytes | XAxis::Count => log2,
        };
        let series = paired(points, self.test, self.only, self.primary, self.secondary, x);
        if series.is_empty() {
            return None;
        }
        let chart = Chart::new(self.title, self.x_label, self.y_label, series);
        let xs = xs_of(points, self.test);
        Some(match self.x {
            XAxis::Bytes => chart.with_x_ticks(log2_ticks(&xs, fmt_bytes)),
            XAxis::Count => chart.with_x_ticks(log2_ticks(&xs, |v| v.to_string())),
            XAxis::Linear => chart,
        })
    }
}

/// Every figure: its file and its panels, side by side.
const FIGURES: &[(&str, &[Panel])] = &[
    (
        "fig8-lat.svg",
        &[Panel::new(
            Test::Lat,
            "Fig. 8: ping-pong RTT, one message outstanding",
            "message size (bytes)",
        )
        .y("RTT (µs)", Metric::Mean, Some(Metric::P99))],
    ),
    (
        "fig9-tput.svg",
        &[Panel::new(
            Test::Tput,
            "Fig. 9: 1 MB messages, 32 B response, one engine",
            "messages outstanding",
        )
        .y("Gb/s", Metric::Gbps, None)
        .x(XAxis::Count)],
    ),
    (
        "fig10-frag.svg",
        &[
            Panel::new(
                Test::Frag,
                "Fig. 10 (loopback): 1 MB throughput vs fragment",
                "fragment size (bytes)",
            )
            .y("Gb/s", Metric::Gbps, None),
            Panel::new(
                Test::FragSim,
                "Fig. 10 (fabric, virtual): 1 MB throughput vs fragment",
                "fragment size (bytes)",
            )
            .y("Gb/s", Metric::Gbps, None),
        ],
    ),
    (
        "fig11-rate.svg",
        &[Panel::new(
            Test::Rate,
            "Fig. 11: 512 B request rate vs engines (no thread domains)",
            "engines (QPs)",
        )
        .y("M requests/s", Metric::Mreqs, None)
        .x(XAxis::Count)],
    ),
    (
        "fig13-hol.svg",
        &[
            Panel::new(Test::Hol, "Fig. 13 (loopback): small-flow RTT", "competing 1 MB flows")
                .y("RTT (µs)", Metric::P50, Some(Metric::P99))
                .x(XAxis::Linear),
            Panel::new(
                Test::HolSim,
                "Fig. 13 (fabric, 25 Gb/s, virtual): small-flow RTT",
                "competing 1 MB flows",
            )
            .y("RTT (µs)", Metric::P50, Some(Metric::P99))
            .x(XAxis::Linear),
        ],
    ),
    (
        "eager.svg",
        &[
            Panel::new(Test::Eager, "Eager ping-pong: zero-copy vs copy", "message size (bytes)")
                .only(|n| !n.starts_with("broadcast")),
            Panel::new(
                Test::Eager,
                "Broadcast to 8 sockets: zero-copy vs copy",
                "message size (bytes)",
            )
            .y("time to last answer (µs)", Metric::P50, Some(Metric::P99))
            .only(|n| n.starts_with("broadcast")),
        ],
    ),
];

/// The figures of the tests that have numbers: (file name, SVG).
pub fn figures(points: &[Point]) -> Vec<(&'static str, String)> {
    let (w, h) = (640.0, 380.0);
    FIGURES
        .iter()
        .filter_map(|(file, panels)| {
            let charts: Vec<Chart> = panels.iter().filter_map(|p| p.chart(points)).collect();
            (!charts.is_empty()).then(|| (*file, bex_plot::grid(&charts, charts.len(), w, h)))
        })
        .collect()
}

impl bex_bench::report::ProgressLine for Point {
    /// One progress line.
    fn progress_line(&self) -> String {
        let j = &self.job;
        let what = format!("{} {} {}={}", j.test, j.series, x_name(j.test), x_label(j.test, j.x));
        match &self.outcome {
            Outcome::Measured(Measured::Latency { summary: s, .. }) => format!(
                "{what}: RTT mean {:.1} µs, p50 {:.1}, p99 {:.1}{}",
                s.mean_us,
                s.p50_us,
                s.p99_us,
                self.extra
                    .get("large_gbps")
                    .map_or(String::new(), |g| format!(" (large flows {g:.2} Gb/s)"))
            ),
            Outcome::Measured(Measured::Throughput { summary: s, .. }) => format!(
                "{what}: {:.2} Gb/s, {:.3} M msg/s (median of {}){}",
                s.median_gbps,
                s.median_mmsgs,
                s.reps,
                metric(self, Metric::CpuPerMsg)
                    .map_or(String::new(), |c| format!(", {c:.1} CPU µs per message"))
            ),
            o => o.missing_line(&what).unwrap_or(what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Knobs, TransportKind, Work};
    use bex_bench::stats::{summarize_bw, LatencyRecorder};
    use std::time::Duration;

    fn job(test: Test, series: &str, x: u64) -> Job {
        Job {
            test,
            series: series.into(),
            x,
            kind: if series == "tcp" { TransportKind::Tcp } else { TransportKind::Rdma },
            knobs: Knobs::default(),
            server: None,
            work: Work::PingPong { size: x, warmup: 0, iters: 1 },
        }
    }

    fn lat(test: Test, series: &str, x: u64, us: u64) -> Point {
        let mut r = LatencyRecorder::new();
        r.record(Duration::from_micros(us));
        Point::new(
            job(test, series, x),
            Outcome::Measured(Measured::Latency {
                summary: r.summary().unwrap(),
                histogram: r.buckets(),
            }),
        )
    }

    fn tput(series: &str, x: u64, gbps_x8: u64) -> Point {
        let reps = vec![BwRep::new(1 << 20, gbps_x8 * 1000, Duration::from_millis(8 * 1049))];
        Point::new(
            job(Test::Tput, series, x),
            Outcome::Measured(Measured::Throughput { summary: summarize_bw(&reps).unwrap(), reps }),
        )
    }

    #[test]
    fn tables_show_values_ratios_and_errors() {
        let points = vec![
            lat(Test::Lat, "rdma", 32, 20),
            lat(Test::Lat, "rdma", 64, 30),
            lat(Test::Lat, "tcp", 32, 40),
            Point::new(job(Test::Lat, "tcp", 64), Outcome::Failed("refused".into())),
        ];
        let t = test_table(&points, Test::Lat);
        assert!(t.contains("rdma p50") && t.contains("tcp p99") && t.contains("rdma/tcp"), "{t}");
        assert!(t.contains("0.50x"), "{t}");
        assert!(t.contains("err"), "{t}");
        let r = ratios(&points);
        assert_eq!(r.len(), 4);
        assert!((r[0].value.unwrap() - 0.5).abs() < 0.01, "{r:?}");
        assert_eq!(r[1].value, None, "64 B has no TCP number");
        let tg = targets(&points);
        assert!(tg[0].verdict.starts_with("met (1/1)"), "{tg:?}");
        assert_eq!(tg.len(), 3, "no spin series, no spin target: {tg:?}");
        assert_eq!(tg[1].verdict, "not run");
        assert_eq!(tg[2].verdict, "not run");
    }

    #[test]
    fn targets_compare_the_right_series() {
        let points = vec![
            tput("rdma mtu4096", 1, 2),
            tput("rdma mtu4096", 8, 10),
            tput("tcp", 1, 4),
            tput("tcp", 8, 12),
            lat(Test::Eager, "zero-copy", 1024, 30),
            lat(Test::Eager, "copy", 1024, 33),
            lat(Test::Eager, "zero-copy", 8192, 50),
            lat(Test::Eager, "copy", 8192, 45),
        ];
        let tg = targets(&points);
        assert_eq!(tg[1].verdict, "not met", "{tg:?}");
        assert!(tg[1].detail.contains("(8 outstanding)"), "{tg:?}");
        assert_eq!(tg[2].verdict, "partly met (1/2)", "{tg:?}");
        let t = test_table(&points, Test::Eager);
        assert!(t.contains("1.10x"), "{t}");
    }

    #[test]
    fn json_has_the_command_line_raw_numbers_and_figures_render() {
        let points = vec![
            lat(Test::Lat, "rdma", 32, 20),
            tput("tcp", 4, 8),
            lat(Test::HolSim, "4K fragments", 0, 5),
            Point::new(job(Test::Frag, "rdma", 4096), Outcome::Failed("boom".into())),
        ];
        let plan = Plan::new(&[Test::Lat], crate::spec::Settings::new(true)).unwrap();
        let envelope = Envelope {
            tool: "bex-perf".into(),
            version: "0".into(),
            command_line: vec!["bex-perf".to_string(), "run".to_string()],
            placement: Placement::default(),
        };
        let notes = vec!["a note".to_string()];
        let doc: serde_json::Value =
            serde_json::from_str(&json(&envelope, Some(42), &plan, &notes, &points)).unwrap();
        assert_eq!(doc["command_line"][1], "run");
        assert_eq!(doc["server_pid"], 42);
        assert_eq!(doc["points"][0]["status"], "ok");
        assert_eq!(doc["points"][0]["rtt_ns_histogram"][0][1], 1);
        assert!(doc["points"][1]["throughput"]["median_gbps"].as_f64().unwrap() > 7.9);
        assert_eq!(doc["points"][3]["status"], "failed");
        assert_eq!(doc["targets"].as_array().unwrap().len(), 3);
        let figs = figures(&points);
        let names: Vec<&str> = figs.iter().map(|f| f.0).collect();
        assert_eq!(names, vec!["fig8-lat.svg", "fig9-tput.svg", "fig13-hol.svg"]);
        assert!(figs[0].1.contains("rdma mean") && figs[0].1.contains("rdma p99"));
        let text = text(&plan, &Placement::default(), &points, &notes);
        assert!(text.contains("Failures:") && text.contains("frag rdma: boom"), "{text}");
    }
}
