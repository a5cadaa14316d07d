//! `bex-simcluster`: runs the parameter server's fault scenarios in deterministic simulation
//! over many seeds and reports every invariant violation with the seed that replays it.

use std::io::Write;
use std::process::{Command, ExitCode, Stdio};

use bex_bench::cli::Output;
use bex_bench::report::Envelope;
use bex_plot::{Chart, Series, COLORS};
use bex_process::child::Guard;
use bex_simcluster::{run, Report, Scenario};
use clap::Parser;
use serde::Serialize;

/// Runs fault scenarios of a simulated 2 × 2 parameter-server cluster (real shard, RPC and
/// client code over simulated NICs, virtual time) and checks the invariants of every run:
/// no acknowledged push lost, none applied twice, every request answered or failed by its
/// deadline, replicas converge, plus each scenario's own claim. Exits 1 on any violation.
#[derive(Parser, Debug)]
#[command(name = "bex-simcluster", after_help = bex_process::logging::LOG_HELP)]
struct Args {
    /// Scenarios to run (comma-separated): loss, shard-restart, pod-partition, hang,
    /// rdma-fallback, quarantine, client-restart, training-restart, training-kill, or all.
    #[arg(long, default_value = "all")]
    scenarios: String,
    /// Seeds 0..N per scenario.
    #[arg(long, default_value_t = 20)]
    seeds: u64,
    /// Run just this seed (replay), printing its report.
    #[arg(long)]
    seed: Option<u64>,
    /// Worker processes (each runs a chunk of seeds; a process holds at most ~4000 pools).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Seeds per worker process.
    #[arg(long, default_value_t = 200)]
    chunk: u64,
    /// Where the summary goes: --json PATH, --out DIR (tables.txt, bex-simcluster.json,
    /// simcluster-margins.svg), --quiet (no per-chunk progress).
    #[command(flatten)]
    output: Output,
    /// Internal: run seeds A..B of one scenario and print one JSON report per line.
    #[arg(long, hide = true, num_args = 3, value_names = ["SCENARIO", "FROM", "TO"])]
    worker: Option<Vec<String>>,
}

fn scenarios(list: &str) -> Result<Vec<Scenario>, String> {
    if list == "all" {
        return Ok(Scenario::ALL.to_vec());
    }
    list.split(',')
        .map(|n| Scenario::from_name(n.trim()).ok_or_else(|| format!("unknown scenario {n:?}")))
        .collect()
}

fn worker(args: &[String]) -> ExitCode {
    let (Some(s), Ok(from), Ok(to)) =
        (Scenario::from_name(&args[0]), args[1].parse::<u64>(), args[2].parse::<u64>())
    else {
        eprintln!("bex-simcluster: bad --worker arguments {args:?}");
        return ExitCode::from(2);
    };
    let mut out = std::io::stdout().lock();
    for seed in from..to {
        let r = run(s, seed);
        if writeln!(out, "{}", serde_json::to_string(&r).unwrap_or_default()).is_err() {
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}

/// One scenario over its seeds.
#[derive(Serialize, Default)]
struct Summary {
    scenario: String,
    seeds: u64,
    passed: u64,
    failed_seeds: Vec<u64>,
    first_violations: Vec<String>,
    max_slowest_ms: u64,
    deadline_ms: u64,
    max_converged_ms: u64,
    max_fallback_ms: Option<u64>,
    pushes_acked: u64,
    pushes_failed: u64,
    fetches_ok: u64,
    fetches_failed: u64,
    virtual_s: f64,
    /// Per seed: the slowest serving request over its deadline (the figure's margins).
    #[serde(skip)]
    slowest_over_deadline: Vec<f64>,
    /// Per seed: the second canary's slowest (retrying) push over its bound.
    #[serde(skip)]
    retrying_over_bound: Vec<f64>,
}

/// The JSON summary.
#[derive(Serialize)]
struct SummaryReport<'a> {
    #[serde(flatten)]
    envelope: Envelope,
    seeds_per_scenario: u64,
    scenarios: &'a [Summary],
}

fn main() -> ExitCode {
    bex_process::logging::init();
    bex_process::exit_with_parent();
    let args = Args::parse();
    if let Some(w) = &args.worker {
        return worker(w);
    }
    let list = match scenarios(&args.scenarios) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bex-simcluster: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(seed) = args.seed {
        let mut ok = true;
        for s in list {
            let r = run(s, seed);
            println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            ok &= r.passed();
        }
        return if ok { ExitCode::SUCCESS } else { ExitCode::from(1) };
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("bex-simcluster: cannot find my own executable: {e}");
            return ExitCode::from(1);
        }
    };
    let mut summaries = Vec::new();
    let mut text = String::new();
    let mut all_ok = true;
    for s in list {
        let started = wall_clock();
        let chunks: Vec<(u64, u64)> = (0..args.seeds)
            .step_by(args.chunk.max(1) as usize)
            .map(|a| (a, (a + args.chunk.max(1)).min(args.seeds)))
            .collect();
        let mut sum = Summary { scenario: s.name().into(), ..Summary::default() };
        for batch in chunks.chunks(args.jobs.max(1)) {
            // Guarded: a worker that fails to start or to be read leaves none of the others
            // running, and none outlives this process.
            let children: Vec<_> = batch
                .iter()
                .map(|&(a, b)| {
                    let mut cmd = Command::new(&exe);
                    cmd.args(["--worker", s.name(), &a.to_string(), &b.to_string()])
                        .stdout(Stdio::piped());
                    bex_process::die_with_this_process(&mut cmd);
                    Guard::spawn(&mut cmd, format!("worker for seeds {a}..{b}"))
                })
                .collect();
            for (child, &(a, b)) in children.into_iter().zip(batch) {
                let out = match child.and_then(Guard::output) {
                    Ok(o) => o,
                    Err(e) => {
                        eprintln!("bex-simcluster: {e}");
                        return ExitCode::from(1);
                    }
                };
                let text = String::from_utf8_lossy(&out.stdout);
                let mut seen = 0;
                for line in text.lines() {
                    let Ok(r) = serde_json::from_str::<Report>(line) else { continue };
                    seen += 1;
                    absorb(&mut sum, &r);
                }
                if !out.status.success() || seen != b - a {
                    all_ok = false;
                    sum.first_violations.push(format!(
                        "worker for seeds {a}..{b} ended {} after {seen} of {} runs",
                        out.status,
                        b - a
                    ));
                }
            }
            if args.output.quiet {
                continue;
            }
            eprintln!(
                "{}: {} of {} seeds, {} failed ({:.0} s)",
                s.name(),
                sum.seeds,
                args.seeds,
                sum.failed_seeds.len(),
                (wall_clock() - started).as_secs_f64()
            );
        }
        all_ok &= sum.failed_seeds.is_empty() && sum.seeds == args.seeds;
        let line = table_line(&sum);
        print!("{line}");
        text.push_str(&line);
        summaries.push(sum);
    }
    let report = SummaryReport {
        envelope: Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), Default::default()),
        seeds_per_scenario: args.seeds,
        scenarios: &summaries,
    };
    let json = serde_json::to_string_pretty(&report).unwrap_or_default();
    if let Err(e) =
        args.output.write(TOOL, &text, &json, &[("simcluster-margins.svg", figure(&summaries))])
    {
        eprintln!("bex-simcluster: {e}");
        return ExitCode::from(1);
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The one wall-clock read of this crate: progress lines only (runs use virtual time).
#[allow(clippy::disallowed_methods)]
fn wall_clock() -> std::time::Instant {
    std::time::Instant::now()
}

/// The tool's name, in its report.
const TOOL: &str = "bex-simcluster";

/// A scenario's line of the table (and up to five of its violations).
fn table_line(sum: &Summary) -> String {
    let mut s = format!(
        "{:<21} {:>6} seeds  {:>6} passed  slowest request {:>4} ms (deadline {} ms)  converged ≤ {} ms{}\n",
        sum.scenario,
        sum.seeds,
        sum.passed,
        sum.max_slowest_ms,
        sum.deadline_ms,
        sum.max_converged_ms,
        sum.max_fallback_ms.map(|m| format!("  fallback ≤ {m} ms")).unwrap_or_default()
    );
    for v in sum.first_violations.iter().take(5) {
        s += &format!("  {v}\n");
    }
    s
}

fn absorb(sum: &mut Summary, r: &Report) {
    sum.seeds += 1;
    if r.passed() {
        sum.passed += 1;
    } else {
        sum.failed_seeds.push(r.seed);
        if sum.first_violations.len() < 10 {
            sum.first_violations.push(format!(
                "seed {}: {} (replay: bex-simcluster --scenarios {} --seed {})",
                r.seed, r.violations[0], sum.scenario, r.seed
            ));
        }
    }
    let (slowest, deadline) = r.slowest_ms;
    sum.max_slowest_ms = sum.max_slowest_ms.max(slowest);
    sum.deadline_ms = deadline;
    if deadline > 0 {
        sum.slowest_over_deadline.push(slowest as f64 / deadline as f64);
    }
    let (retrying, bound) = r.slowest_retrying_push_ms;
    if bound > 0 {
        sum.retrying_over_bound.push(retrying as f64 / bound as f64);
    }
    if let Some(c) = r.converged_ms {
        sum.max_converged_ms = sum.max_converged_ms.max(c);
    }
    if let Some(f) = r.fallback_ms {
        sum.max_fallback_ms = Some(sum.max_fallback_ms.unwrap_or(0).max(f));
    }
    sum.pushes_acked += r.pushes_acked;
    sum.pushes_failed += r.pushes_failed;
    sum.fetches_ok += r.fetches.0;
    sum.fetches_failed += r.fetches.1;
    sum.virtual_s += r.virtual_ms as f64 / 1000.0;
}

/// `values` sorted, as (fraction of seeds at or below, value): an empirical CDF.
fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter().enumerate().map(|(i, x)| (x, (i + 1) as f64 / n)).collect()
}

/// The margins of every scenario's deadline invariants over its seeds, as CDFs: the slowest
/// serving request over its deadline, and the slowest retrying (training) push over its
/// retry budget plus one deadline; each must stay ≤ 1. (Convergence after the heal is in the
/// table: it has been 0 ms in every run so far, the replicas already equal at the heal.)
fn figure(summaries: &[Summary]) -> String {
    let series = |f: &dyn Fn(&Summary) -> &[f64]| -> Vec<Series> {
        summaries
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let line = Series::new(s.scenario.clone(), COLORS[i % COLORS.len()], cdf(f(s)));
                if i >= COLORS.len() {
                    line.dashed()
                } else {
                    line
                }
            })
            .collect()
    };
    let charts = [
        Chart::new(
            "Slowest serving request per seed / its deadline",
            "slowest / deadline (≤ 1 holds the invariant)",
            "fraction of seeds",
            series(&|s| &s.slowest_over_deadline),
        ),
        Chart::new(
            "Slowest retrying push per seed / its bound",
            "slowest / (retry budget + deadline) (≤ 1 holds)",
            "fraction of seeds",
            series(&|s| &s.retrying_over_bound),
        ),
    ];
    bex_plot::grid(&charts, 2, 560.0, 360.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cdf_is_sorted_and_ends_at_one() {
        assert_eq!(cdf(&[3.0, f64::NAN, 1.0]), vec![(1.0, 0.5), (3.0, 1.0)]);
        assert!(cdf(&[]).is_empty());
    }

    #[test]
    fn reports_are_read_back_typed() {
        let r = run(Scenario::Hang, 3);
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        let mut sum = Summary::default();
        absorb(&mut sum, &back);
        assert_eq!((sum.seeds, sum.passed, sum.slowest_over_deadline.len()), (1, 1, 1));
        assert!(figure(&[sum]).starts_with("<svg"));
    }
}
