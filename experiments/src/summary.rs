//! Medians per cell, the markdown summary and the plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use bex_plot::{grid, Chart, Series, COLORS};
use bex_transport_kind::TransportKind::{self, Rdma, Tcp};
use serde::Serialize;

use crate::extract::{InferenceRun, TrainingRun, Variant};
use crate::paper;
use crate::stats::{fmt_ratio, median, ratio};

/// Medians of one (transport, rate) cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct InferenceCell {
    /// Transport.
    pub transport: TransportKind,
    /// Offered rate, req/s.
    pub rate: f64,
    /// Runs in the cell.
    pub runs: usize,
    /// Median of each run's numbers (see [`InferenceRun`]).
    pub median: InferenceRun,
}

fn med(runs: &[&InferenceRun], f: impl Fn(&InferenceRun) -> f64) -> f64 {
    median(&runs.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(f64::NAN)
}

fn key(rate: f64) -> u64 {
    (rate * 1000.0) as u64
}

/// Groups runs by (transport, rate) and takes medians.
pub fn inference_cells(runs: &[InferenceRun]) -> Vec<InferenceCell> {
    let mut groups: BTreeMap<(TransportKind, u64), Vec<&InferenceRun>> = BTreeMap::new();
    for r in runs {
        groups.entry((r.transport, key(r.rate))).or_default().push(r);
    }
    groups
        .into_iter()
        .map(|((transport, _), rs)| InferenceCell {
            transport,
            rate: rs[0].rate,
            runs: rs.len(),
            median: InferenceRun {
                transport,
                rate: rs[0].rate,
                ok: med(&rs, |r| r.ok),
                errors: med(&rs, |r| r.errors),
                throughput_rps: med(&rs, |r| r.throughput_rps),
                request_mean_us: med(&rs, |r| r.request_mean_us),
                request_p99_us: med(&rs, |r| r.request_p99_us),
                pull_mean_us: med(&rs, |r| r.pull_mean_us),
                pull_p99_us: med(&rs, |r| r.pull_p99_us),
                machine_user_pct: med(&rs, |r| r.machine_user_pct),
                machine_sys_pct: med(&rs, |r| r.machine_sys_pct),
                machine_softirq_pct: med(&rs, |r| r.machine_softirq_pct),
                cpu_user_us_per_req: med(&rs, |r| r.cpu_user_us_per_req),
                cpu_sys_us_per_req: med(&rs, |r| r.cpu_sys_us_per_req),
            },
        })
        .collect()
}

fn cell(cells: &[InferenceCell], t: TransportKind, rate: f64) -> Option<&InferenceRun> {
    cells.iter().find(|c| c.transport == t && key(c.rate) == key(rate)).map(|c| &c.median)
}

/// The inference summary: one table per rate, RDMA next to TCP and the paper.
pub fn inference_markdown(cells: &[InferenceCell], command: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Inference: RDMA vs TCP at matched load (paper Tables 5–6)\n");
    let _ = writeln!(o, "Command: `{command}`\n");
    let _ = writeln!(
        o,
        "Medians over repeated, interleaved runs. \"Pull\" is one model's fan-out fetch (one \
         sub-request per touched shard), the analogue of the paper's PS Pull; CPU % is the \
         whole machine (rankers and servers share it) over the ranker's run. The paper ran 300 \
         servers and 124 rankers on 25 Gb/s ConnectX-5 NICs; here everything shares 2 cores \
         and the software RNIC, so compare ratios, not absolute values.\n"
    );
    let mut rates: Vec<f64> = cells.iter().map(|c| c.rate).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup_by(|a, b| key(*a) == key(*b));
    for rate in rates {
        let (Some(r), Some(t)) = (cell(cells, Rdma, rate), cell(cells, Tcp, rate)) else {
            continue;
        };
        let runs = cells.iter().filter(|c| key(c.rate) == key(rate)).map(|c| c.runs).max();
        let _ = writeln!(o, "## {rate} requests/s ({} runs per transport)\n", runs.unwrap_or(0));
        let _ = writeln!(o, "| metric | RDMA | TCP | RDMA/TCP | paper RDMA/TCP |");
        let _ = writeln!(o, "|---|---|---|---|---|");
        let row =
            |o: &mut String, name: &str, a: f64, b: f64, unit: &str, p: Option<(f64, f64)>| {
                let paper = p.map_or("".into(), |(pr, pt)| fmt_ratio(ratio(pr, pt)));
                let _ = writeln!(
                    o,
                    "| {name} | {a:.1} {unit} | {b:.1} {unit} | {} | {paper} |",
                    fmt_ratio(ratio(a, b))
                );
            };
        row(&mut o, "Pull mean", r.pull_mean_us, t.pull_mean_us, "µs", Some(paper::PULL_MEAN_MS));
        row(&mut o, "Pull P99", r.pull_p99_us, t.pull_p99_us, "µs", Some(paper::PULL_P99_MS));
        row(&mut o, "request mean", r.request_mean_us, t.request_mean_us, "µs", None);
        row(&mut o, "request P99", r.request_p99_us, t.request_p99_us, "µs", None);
        let total =
            |x: &InferenceRun| x.machine_user_pct + x.machine_sys_pct + x.machine_softirq_pct;
        row(&mut o, "CPU total", total(r), total(t), "%", Some(paper::CPU_TOTAL));
        row(
            &mut o,
            "CPU softirq",
            r.machine_softirq_pct,
            t.machine_softirq_pct,
            "%",
            Some(paper::CPU_SOFTIRQ),
        );
        row(
            &mut o,
            "CPU system",
            r.machine_sys_pct,
            t.machine_sys_pct,
            "%",
            Some(paper::CPU_SYSTEM),
        );
        row(&mut o, "CPU user", r.machine_user_pct, t.machine_user_pct, "%", Some(paper::CPU_USER));
        row(
            &mut o,
            "ranker+server user CPU per request",
            r.cpu_user_us_per_req,
            t.cpu_user_us_per_req,
            "µs",
            None,
        );
        row(
            &mut o,
            "ranker+server sys CPU per request",
            r.cpu_sys_us_per_req,
            t.cpu_sys_us_per_req,
            "µs",
            None,
        );
        row(&mut o, "throughput", r.throughput_rps, t.throughput_rps, "req/s", None);
        row(&mut o, "errors + timeouts", r.errors, t.errors, "", None);
        let target = ratio(r.pull_p99_us, t.pull_p99_us);
        let _ = writeln!(
            o,
            "\nTarget \"inference P99 on RDMA ≤ 0.8× TCP\": Pull P99 ratio {} → **{}**.\n",
            fmt_ratio(target),
            verdict(target, 0.8)
        );
    }
    o
}

/// Pull latency and CPU against the offered rate, RDMA and TCP.
pub fn inference_svg(cells: &[InferenceCell]) -> String {
    let line = |t: TransportKind, f: &dyn Fn(&InferenceRun) -> f64| {
        let mut pts: Vec<(f64, f64)> =
            cells.iter().filter(|c| c.transport == t).map(|c| (c.rate, f(&c.median))).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    };
    let pair = |title: &str,
                y: &str,
                f: &dyn Fn(&InferenceRun) -> f64,
                g: &dyn Fn(&InferenceRun) -> f64| {
        Chart::new(
            title,
            "offered load (req/s)",
            y,
            vec![
                Series::new("RDMA P99", COLORS[0], line(Rdma, f)),
                Series::new("TCP P99", COLORS[1], line(Tcp, f)),
                Series::new("RDMA mean", COLORS[0], line(Rdma, g)).dashed(),
                Series::new("TCP mean", COLORS[1], line(Tcp, g)).dashed(),
            ],
        )
    };
    let cpu = |t: TransportKind| {
        line(t, &|r: &InferenceRun| r.machine_user_pct + r.machine_sys_pct + r.machine_softirq_pct)
    };
    let charts = [
        pair("Pull (per-model fetch) latency", "µs", &|r| r.pull_p99_us, &|r| r.pull_mean_us),
        pair("request latency", "µs", &|r| r.request_p99_us, &|r| r.request_mean_us),
        Chart::new(
            "machine CPU (user+sys+softirq)",
            "offered load (req/s)",
            "% of all CPUs",
            vec![
                Series::new("RDMA", COLORS[0], cpu(Rdma)),
                Series::new("TCP", COLORS[1], cpu(Tcp)),
                Series::new("RDMA softirq", COLORS[0], line(Rdma, &|r| r.machine_softirq_pct))
                    .dashed(),
                Series::new("TCP softirq", COLORS[1], line(Tcp, &|r| r.machine_softirq_pct))
                    .dashed(),
            ],
        ),
    ];
    grid(&charts, 3, 420.0, 300.0)
}

/// Medians of one (variant, trainers) cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TrainingCell {
    /// Runs in the cell.
    pub runs: usize,
    /// Median of each run's numbers.
    pub median: TrainingRun,
}

/// Groups training runs by (variant, trainers) and takes medians.
pub fn training_cells(runs: &[TrainingRun]) -> Vec<TrainingCell> {
    let mut groups: BTreeMap<(Variant, u64), Vec<&TrainingRun>> = BTreeMap::new();
    for r in runs {
        groups.entry((r.variant, r.trainers as u64)).or_default().push(r);
    }
    let m = |rs: &[&TrainingRun], f: &dyn Fn(&TrainingRun) -> f64| {
        median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    groups
        .into_values()
        .map(|rs| TrainingCell {
            runs: rs.len(),
            median: TrainingRun {
                variant: rs[0].variant,
                trainers: rs[0].trainers,
                fetch_p99_us: m(&rs, &|r| r.fetch_p99_us),
                push_p99_us: m(&rs, &|r| r.push_p99_us),
                fetch_p50_us: m(&rs, &|r| r.fetch_p50_us),
                push_p50_us: m(&rs, &|r| r.push_p50_us),
                samples_per_s: m(&rs, &|r| r.samples_per_s),
                errors: m(&rs, &|r| r.errors),
                auc_final: m(&rs, &|r| r.auc_final),
                rnr_naks: m(&rs, &|r| r.rnr_naks),
                seq_naks: m(&rs, &|r| r.seq_naks),
                retransmits: m(&rs, &|r| r.retransmits),
                ack_timeouts: m(&rs, &|r| r.ack_timeouts),
                tcp_retransmits: m(&rs, &|r| r.tcp_retransmits),
                tcp_out_segments: m(&rs, &|r| r.tcp_out_segments),
            },
        })
        .collect()
}

/// The training summary: per trainer count, the three variants next to the paper's Table 7.
pub fn training_markdown(cells: &[TrainingCell], command: &str, setup: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# Training under incast: TCP vs RDMA without and with the send window (paper Table 7)\n"
    );
    let _ = writeln!(o, "Command: `{command}`\n\n{setup}\n");
    let mut counts: Vec<u64> = cells.iter().map(|c| c.median.trainers as u64).collect();
    counts.sort_unstable();
    counts.dedup();
    let find = |v: Variant, n: u64| {
        cells.iter().find(|c| c.median.variant == v && c.median.trainers as u64 == n)
    };
    for n in counts {
        let _ = writeln!(o, "## {n} trainers\n");
        let _ = writeln!(o, "| metric | TCP | RDMA (no window) | RDMA + window | paper TCP | paper RDMA HW only | paper RDMA HW+SW |");
        let _ = writeln!(o, "|---|---|---|---|---|---|---|");
        let cols: Vec<Option<&TrainingCell>> = Variant::ALL.iter().map(|&v| find(v, n)).collect();
        let row =
            |o: &mut String, name: &str, f: &dyn Fn(&TrainingRun) -> String, p: [String; 3]| {
                let vals: Vec<String> =
                    cols.iter().map(|c| c.map_or("—".into(), |c| f(&c.median))).collect();
                let _ = writeln!(
                    o,
                    "| {name} | {} | {} | {} | {} | {} | {} |",
                    vals[0], vals[1], vals[2], p[0], p[1], p[2]
                );
            };
        let ms =
            |(a, b, c): (f64, f64, f64)| [format!("{a} ms"), format!("{b} ms"), format!("{c} ms")];
        row(
            &mut o,
            "Fetch P99",
            &|r| format!("{:.0} µs", r.fetch_p99_us),
            ms(paper::TRAIN_FETCH_P99_MS),
        );
        row(
            &mut o,
            "Push P99",
            &|r| format!("{:.0} µs", r.push_p99_us),
            ms(paper::TRAIN_PUSH_P99_MS),
        );
        let none = || [String::new(), String::new(), String::new()];
        row(&mut o, "Fetch P50", &|r| format!("{:.0} µs", r.fetch_p50_us), none());
        row(&mut o, "Push P50", &|r| format!("{:.0} µs", r.push_p50_us), none());
        let (a, b, c) = paper::TRAIN_LOSS;
        row(
            &mut o,
            "loss indicator",
            &|r| {
                if r.variant == Variant::Tcp {
                    if r.tcp_retransmits.is_nan() {
                        "TCP retransmits not measured".into()
                    } else {
                        format!(
                            "{:.0} of {:.0} TCP segments retransmitted ({:.2}%)",
                            r.tcp_retransmits,
                            r.tcp_out_segments,
                            100.0 * r.tcp_retransmits / r.tcp_out_segments.max(1.0)
                        )
                    }
                } else {
                    format!("{:.0} seq NAKs, {:.0} retransmits", r.seq_naks, r.retransmits)
                }
            },
            [a.into(), b.into(), c.into()],
        );
        row(
            &mut o,
            "RNR NAKs / ACK timeouts",
            &|r| format!("{:.0} / {:.0}", r.rnr_naks, r.ack_timeouts),
            none(),
        );
        row(&mut o, "samples/s (all trainers)", &|r| format!("{:.0}", r.samples_per_s), none());
        row(&mut o, "failed steps", &|r| format!("{:.0}", r.errors), none());
        row(&mut o, "lowest final AUC", &|r| format!("{:.3}", r.auc_final), none());
        if let (Some(nw), Some(w)) = (cols[1], cols[2]) {
            let x = ratio(w.median.push_p99_us, nw.median.push_p99_us);
            let _ = writeln!(
                o,
                "\nTarget \"push P99 with the window ≤ 0.5× without it\": {} → **{}** (paper: {}).\n",
                fmt_ratio(x),
                verdict(x, 0.5),
                fmt_ratio(ratio(paper::TRAIN_PUSH_P99_MS.2, paper::TRAIN_PUSH_P99_MS.1)),
            );
        }
    }
    o
}

/// Fetch/push P99 and retransmits against the number of trainers, per variant.
pub fn training_svg(cells: &[TrainingCell]) -> String {
    let line = |v: Variant, f: &dyn Fn(&TrainingRun) -> f64| {
        let mut pts: Vec<(f64, f64)> = cells
            .iter()
            .filter(|c| c.median.variant == v)
            .map(|c| (c.median.trainers, f(&c.median)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    };
    let chart = |title: &str, y: &str, f: &dyn Fn(&TrainingRun) -> f64| {
        Chart::new(
            title,
            "trainers",
            y,
            Variant::ALL
                .iter()
                .zip(COLORS)
                .map(|(&v, c)| Series::new(v.name(), c, line(v, f)))
                .collect(),
        )
    };
    let charts = [
        chart("busiest trainer's Push P99", "µs", &|r| r.push_p99_us),
        chart("busiest trainer's Fetch P99", "µs", &|r| r.fetch_p99_us),
        chart("retransmitted packets (RNIC) / TCP retransmits", "packets", &|r| {
            if r.variant == Variant::Tcp {
                r.tcp_retransmits
            } else {
                r.retransmits
            }
        }),
    ];
    grid(&charts, 3, 420.0, 300.0)
}

/// Whether a ratio meets an upper `limit`.
fn verdict(ratio: Option<f64>, limit: f64) -> &'static str {
    match ratio {
        Some(x) if x <= limit => "met",
        Some(_) => "not met",
        None => "not measured",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(t: TransportKind, rate: f64, p99: f64) -> InferenceRun {
        InferenceRun { transport: t, rate, pull_p99_us: p99, ..Default::default() }
    }

    #[test]
    fn inference_cells_take_medians_and_the_target_is_judged() {
        let runs = [
            run(Rdma, 100.0, 300.0),
            run(Rdma, 100.0, 100.0),
            run(Rdma, 100.0, 200.0),
            run(Tcp, 100.0, 400.0),
        ];
        let cells = inference_cells(&runs);
        assert_eq!(cells.len(), 2);
        assert_eq!(cell(&cells, Rdma, 100.0).unwrap().pull_p99_us, 200.0);
        let md = inference_markdown(&cells, "x");
        assert!(md.contains("0.50×"), "{md}");
        assert!(md.contains("**met**"), "{md}");
        assert!(inference_svg(&cells).starts_with("<svg"));
    }

    #[test]
    fn training_target_not_met_is_said() {
        let mk = |variant: Variant, push: f64| TrainingRun {
            variant,
            trainers: 4.0,
            push_p99_us: push,
            ..Default::default()
        };
        let cells = training_cells(&[
            mk(Variant::Tcp, 900.0),
            mk(Variant::Rdma, 1000.0),
            mk(Variant::RdmaWindow, 700.0),
        ]);
        let md = training_markdown(&cells, "x", "setup");
        assert!(md.contains("0.70×") && md.contains("**not met**"), "{md}");
        assert!(training_svg(&cells).contains("rdma+window"));
    }
}
