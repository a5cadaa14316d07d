//! Medians, the JSON file, the text table and the SVG figures (drawn with the workspace's
//! small `bex-plot` crate).

use bex_bench::report::Envelope;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use bex_plot::{chart, svg_doc, Chart, Series, COLORS};
use serde::Serialize;

use crate::cell::{CellResult, Sample};

/// Allocators in figure order.
pub const ALLOCATORS: [&str; 6] =
    ["glibc", "jemalloc", "mimalloc", "rpmalloc", "bemalloc-raw", "bemalloc"];

/// The median of each (allocator, workload, threads) cell over its repetitions.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Median {
    /// Operations per CPU-second.
    pub ops_per_cpu_s: f64,
    /// Operations per wall second.
    pub ops_per_wall_s: f64,
    /// Peak RSS, KiB.
    pub peak_rss_kib: u64,
    /// Repetitions that ran.
    pub reps: usize,
    /// bemalloc: registered bytes at the end (median).
    pub registered_bytes: Option<u64>,
    /// bemalloc: the most registrations any repetition made after its warm-up.
    pub new_registrations_after_warmup: Option<u64>,
    /// bemalloc: registrations at the end (median).
    pub registrations: Option<u64>,
    /// Sum of failed allocations over repetitions.
    pub failures: u64,
    /// Share of frees that were cross-thread (median).
    pub cross_free_share: f64,
}

/// The harness's median; 0 for no values (a cell with no repetitions) or a NaN among them.
fn median_f(v: Vec<f64>) -> f64 {
    bex_bench::stats::median(&v).unwrap_or(0.0)
}

/// Key of a cell.
pub type Key = (String, String, usize);

/// Groups results by cell and takes medians.
pub fn medians(results: &[CellResult]) -> BTreeMap<Key, Median> {
    let mut groups: BTreeMap<Key, Vec<&CellResult>> = BTreeMap::new();
    for r in results {
        groups.entry((r.alloc.clone(), r.workload.clone(), r.threads)).or_default().push(r);
    }
    groups
        .into_iter()
        .map(|(k, rs)| {
            let f = |g: &dyn Fn(&CellResult) -> f64| median_f(rs.iter().map(|r| g(r)).collect());
            let opt = |g: &dyn Fn(&CellResult) -> Option<u64>| {
                let v: Vec<f64> = rs.iter().filter_map(|r| g(r).map(|x| x as f64)).collect();
                (!v.is_empty()).then(|| median_f(v) as u64)
            };
            let m = Median {
                ops_per_cpu_s: f(&|r| r.ops_per_cpu_s()),
                ops_per_wall_s: f(&|r| r.ops_per_wall_s()),
                peak_rss_kib: f(&|r| r.peak_rss_kib as f64) as u64,
                reps: rs.len(),
                registered_bytes: opt(&|r| r.registered_bytes),
                new_registrations_after_warmup: rs
                    .iter()
                    .filter_map(|r| Some(r.registrations_end? - r.registrations_warm?))
                    .max(),
                registrations: opt(&|r| r.registrations_end),
                failures: rs.iter().map(|r| r.failures).sum(),
                cross_free_share: f(&|r| r.cross_frees as f64 / (r.ops as f64 / 2.0).max(1.0)),
            };
            (k, m)
        })
        .collect()
}

/// One run in the JSON: the cell's measurements and its rates.
#[derive(Serialize)]
struct RunJson<'a> {
    #[serde(flatten)]
    cell: &'a CellResult,
    ops_per_cpu_s: f64,
    ops_per_wall_s: f64,
}

/// One median in the JSON, with its cell's key.
#[derive(Serialize)]
struct MedianJson<'a> {
    alloc: &'a str,
    workload: &'a str,
    threads: usize,
    #[serde(flatten)]
    median: &'a Median,
}

#[derive(Serialize)]
struct MissingJson<'a> {
    alloc: &'a str,
    why: &'a str,
}

/// The whole file. serde_json writes a non-finite number (a rate of a cell that did not
/// run) as `null`, so the file is always valid JSON.
#[derive(Serialize)]
struct ReportJson<'a> {
    #[serde(flatten)]
    envelope: &'a Envelope,
    meta: &'a Meta,
    ops_unit: &'static str,
    runs: Vec<RunJson<'a>>,
    medians: Vec<MedianJson<'a>>,
    missing: Vec<MissingJson<'a>>,
    footprint: &'a [Sample],
}

/// How the run was set up, as the report's `meta` says.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    /// `--quick`.
    pub quick: bool,
    /// Repetitions per cell.
    pub reps: usize,
    /// Steps per thread of a large-allocation cell.
    pub large_steps_per_thread: usize,
    /// Steps per thread of a small-allocation cell.
    pub small_steps_per_thread: usize,
    /// CPUs of this machine.
    pub cpus: usize,
}

/// The whole run as JSON.
pub fn json(
    envelope: &Envelope,
    meta: &Meta,
    results: &[CellResult],
    med: &BTreeMap<Key, Median>,
    missing: &[(String, String)],
    footprint: &[Sample],
) -> String {
    let report = ReportJson {
        envelope,
        meta,
        ops_unit: "allocations+frees per CPU-second (user+system) of the process",
        runs: results
            .iter()
            .map(|cell| RunJson {
                cell,
                ops_per_cpu_s: cell.ops_per_cpu_s(),
                ops_per_wall_s: cell.ops_per_wall_s(),
            })
            .collect(),
        medians: med
            .iter()
            .map(|((alloc, workload, threads), median)| MedianJson {
                alloc,
                workload,
                threads: *threads,
                median,
            })
            .collect(),
        missing: missing.iter().map(|(alloc, why)| MissingJson { alloc, why }).collect(),
        footprint,
    };
    // Serializing these plain structs cannot fail (string keys, no custom serializers).
    serde_json::to_string_pretty(&report).expect("the report serializes") + "\n"
}

/// The Figure 4 table with the target ratios.
pub fn table(med: &BTreeMap<Key, Median>, workloads: &[&str], threads: &[usize]) -> String {
    let mut o = String::new();
    let get = |a: &str, w: &str, t: usize| med.get(&(a.to_string(), w.to_string(), t));
    for w in workloads {
        let _ = writeln!(o, "\nFigure 4, {w} allocations: Mops per CPU-second (median)");
        let _ = write!(o, "{:>7}", "threads");
        for a in ALLOCATORS {
            let _ = write!(o, " {a:>12}");
        }
        let _ = writeln!(o, " {:>14}", "bem/bem-raw");
        for &t in threads {
            let _ = write!(o, "{t:>7}");
            for a in ALLOCATORS {
                match get(a, w, t) {
                    Some(m) => {
                        let _ = write!(o, " {:>12.2}", m.ops_per_cpu_s / 1e6);
                    }
                    None => {
                        let _ = write!(o, " {:>12}", "missing");
                    }
                }
            }
            let r = match (get("bemalloc", w, t), get("bemalloc-raw", w, t)) {
                (Some(b), Some(r)) => format!("{:.3}", b.ops_per_cpu_s / r.ops_per_cpu_s),
                _ => "-".into(),
            };
            let _ = writeln!(o, " {r:>14}");
        }
        let _ = writeln!(o, "\nFigure 4, {w} allocations: peak RSS MiB (median)");
        let _ = write!(o, "{:>7}", "threads");
        for a in ALLOCATORS {
            let _ = write!(o, " {a:>12}");
        }
        let _ =
            writeln!(o, " {:>14} {:>10} {:>9} {:>9}", "bem/glibc", "reg MiB", "regs", "new@warm");
        for &t in threads {
            let _ = write!(o, "{t:>7}");
            for a in ALLOCATORS {
                match get(a, w, t) {
                    Some(m) => {
                        let _ = write!(o, " {:>12.1}", m.peak_rss_kib as f64 / 1024.0);
                    }
                    None => {
                        let _ = write!(o, " {:>12}", "missing");
                    }
                }
            }
            let r = match (get("bemalloc", w, t), get("glibc", w, t)) {
                (Some(b), Some(g)) => {
                    format!("{:.3}", b.peak_rss_kib as f64 / g.peak_rss_kib as f64)
                }
                _ => "-".into(),
            };
            let b = get("bemalloc", w, t);
            let reg = b
                .and_then(|m| m.registered_bytes)
                .map_or("-".into(), |v| format!("{:.1}", v as f64 / (1 << 20) as f64));
            let regs = b.and_then(|m| m.registrations).map_or("-".into(), |v| v.to_string());
            let new = b
                .and_then(|m| m.new_registrations_after_warmup)
                .map_or("-".into(), |v| v.to_string());
            let _ = writeln!(o, " {r:>14} {reg:>10} {regs:>9} {new:>9}");
        }
    }
    o
}

/// The Figure 5 table (every `step`-th sample).
pub fn footprint_table(samples: &[Sample], step: usize) -> String {
    let mut o = String::from("\nFigure 5: registered footprint over the run\n");
    let _ = writeln!(
        o,
        "{:>8} {:>14} {:>12} {:>14}",
        "t (ms)", "registered MiB", "live MiB", "registrations"
    );
    let last = samples.len().saturating_sub(1);
    for (i, s) in samples.iter().enumerate() {
        if i % step.max(1) == 0 || i == last {
            let _ = writeln!(
                o,
                "{:>8} {:>14.1} {:>12.1} {:>14}",
                s.t_ms,
                s.registered as f64 / (1 << 20) as f64,
                s.live as f64 / (1 << 20) as f64,
                s.registrations
            );
        }
    }
    o
}

/// Figure 4: four panels (ops and peak memory for large and small) versus threads.
pub fn figure4_svg(med: &BTreeMap<Key, Median>, threads: &[usize]) -> String {
    let mut body = String::new();
    let panels = [
        ("large", true, "(a) large: Mops per CPU-s", "Mops / CPU-s"),
        ("large", false, "(b) large: peak RSS", "MiB"),
        ("small", true, "(c) small: Mops per CPU-s", "Mops / CPU-s"),
        ("small", false, "(d) small: peak RSS", "MiB"),
    ];
    let (w, h) = (440.0, 300.0);
    for (i, (wl, ops, title, yl)) in panels.iter().enumerate() {
        let series = ALLOCATORS
            .iter()
            .zip(COLORS)
            .map(|(a, c)| {
                let pts = threads
                    .iter()
                    .filter_map(|&t| {
                        let m = med.get(&(a.to_string(), wl.to_string(), t))?;
                        let y = if *ops {
                            m.ops_per_cpu_s / 1e6
                        } else {
                            m.peak_rss_kib as f64 / 1024.0
                        };
                        Some((t as f64, y))
                    })
                    .collect();
                Series::new(*a, c, pts)
            })
            .collect();
        let c = Chart::new(*title, "threads", *yl, series);
        chart(&mut body, &c, (i % 2) as f64 * w, (i / 2) as f64 * h, w, h, i == 0);
    }
    svg_doc(2.0 * w, 2.0 * h, &body)
}

/// Figure 5: registered and live bytes over time.
pub fn figure5_svg(samples: &[Sample]) -> String {
    let mut body = String::new();
    let mib = |v: u64| v as f64 / (1 << 20) as f64;
    let series = vec![
        Series::new(
            "registered",
            COLORS[0],
            samples.iter().map(|s| (s.t_ms as f64 / 1000.0, mib(s.registered))).collect(),
        ),
        Series::new(
            "live",
            COLORS[1],
            samples.iter().map(|s| (s.t_ms as f64 / 1000.0, mib(s.live))).collect(),
        ),
    ];
    let c =
        Chart::new("Figure 5: bemalloc registered footprint", "seconds since start", "MiB", series);
    chart(&mut body, &c, 0.0, 0.0, 640.0, 340.0, true);
    svg_doc(640.0, 340.0, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(alloc: &str, cpu_s: f64) -> CellResult {
        CellResult {
            alloc: alloc.into(),
            workload: "small".into(),
            threads: 1,
            ops: 1000,
            cpu_s,
            wall_s: 0.5,
            ..CellResult::default()
        }
    }

    #[test]
    fn the_json_is_valid_with_odd_names_and_non_finite_numbers() {
        let results = vec![cell("quote\"back\\slash\nnewline\u{1}", f64::NAN), cell("glibc", 1.0)];
        let med = medians(&results);
        let envelope = Envelope::new("alloc-bench", "0", Default::default());
        let meta = Meta {
            quick: true,
            reps: 1,
            large_steps_per_thread: 2,
            small_steps_per_thread: 3,
            cpus: 2,
        };
        let missing = [("rpmalloc".to_string(), "no \"child\"".to_string())];
        let text = json(&envelope, &meta, &results, &med, &missing, &[]);
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(v["runs"][0]["alloc"], "quote\"back\\slash\nnewline\u{1}");
        assert!(v["runs"][0]["cpu_s"].is_null(), "NaN is written as null");
        assert_eq!(v["runs"][1]["ops_per_cpu_s"], 1000.0);
        assert_eq!(v["missing"][0]["why"], "no \"child\"");
        assert_eq!(
            (v["tool"].as_str(), v["meta"]["small_steps_per_thread"].as_u64()),
            (Some("alloc-bench"), Some(3))
        );
        assert_eq!(v["medians"].as_array().map(Vec::len), Some(2));
    }
}
