//! `bex-simcluster`: runs the parameter server's fault scenarios in deterministic simulation
//! over many seeds and reports every invariant violation with the seed that replays it.

use std::io::Write;
use std::process::{Command, ExitCode, Stdio};

use bex_simcluster::{run, Scenario};
use clap::Parser;

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
    /// Write a JSON summary here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
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

#[derive(serde::Serialize, Default)]
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
    let mut all_ok = true;
    for s in list {
        let started = wall_clock();
        let chunks: Vec<(u64, u64)> = (0..args.seeds)
            .step_by(args.chunk.max(1) as usize)
            .map(|a| (a, (a + args.chunk.max(1)).min(args.seeds)))
            .collect();
        let mut sum = Summary { scenario: s.name().into(), ..Summary::default() };
        for batch in chunks.chunks(args.jobs.max(1)) {
            let children: Vec<_> = batch
                .iter()
                .map(|&(a, b)| {
                    Command::new(&exe)
                        .args(["--worker", s.name(), &a.to_string(), &b.to_string()])
                        .stdout(Stdio::piped())
                        .spawn()
                })
                .collect();
            for (child, &(a, b)) in children.into_iter().zip(batch) {
                let out = match child.and_then(|c| c.wait_with_output()) {
                    Ok(o) => o,
                    Err(e) => {
                        eprintln!("bex-simcluster: worker for seeds {a}..{b}: {e}");
                        return ExitCode::from(1);
                    }
                };
                let text = String::from_utf8_lossy(&out.stdout);
                let mut seen = 0;
                for line in text.lines() {
                    let Ok(r) = serde_json::from_str::<serde_json::Value>(line) else { continue };
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
            eprintln!(
                "{}: {} of {} seeds, {} failed ({:.0} s)",
                s.name(),
                sum.seeds,
                args.seeds,
                sum.failed_seeds.len(),
                started.elapsed().as_secs_f64()
            );
        }
        all_ok &= sum.failed_seeds.is_empty() && sum.seeds == args.seeds;
        println!(
            "{:<14} {:>6} seeds  {:>6} passed  slowest request {:>4} ms (deadline {} ms)  converged ≤ {} ms{}",
            sum.scenario,
            sum.seeds,
            sum.passed,
            sum.max_slowest_ms,
            sum.deadline_ms,
            sum.max_converged_ms,
            sum.max_fallback_ms.map(|m| format!("  fallback ≤ {m} ms")).unwrap_or_default()
        );
        for v in sum.first_violations.iter().take(5) {
            println!("  {v}");
        }
        summaries.push(sum);
    }
    if let Some(path) = &args.out {
        let text = serde_json::to_string_pretty(&summaries).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("bex-simcluster: writing {}: {e}", path.display());
            return ExitCode::from(1);
        }
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

fn absorb(sum: &mut Summary, r: &serde_json::Value) {
    let u = |k: &str| r[k].as_u64().unwrap_or(0);
    sum.seeds += 1;
    let violations = r["violations"].as_array().cloned().unwrap_or_default();
    if violations.is_empty() {
        sum.passed += 1;
    } else {
        sum.failed_seeds.push(u("seed"));
        if sum.first_violations.len() < 10 {
            let first = violations[0].as_str().unwrap_or_default();
            sum.first_violations.push(format!(
                "seed {}: {first} (replay: bex-simcluster --scenarios {} --seed {})",
                u("seed"),
                sum.scenario,
                u("seed")
            ));
        }
    }
    sum.max_slowest_ms = sum.max_slowest_ms.max(r["slowest_ms"][0].as_u64().unwrap_or(0));
    sum.deadline_ms = r["slowest_ms"][1].as_u64().unwrap_or(0);
    sum.max_converged_ms = sum.max_converged_ms.max(u("converged_ms"));
    if let Some(f) = r["fallback_ms"].as_u64() {
        sum.max_fallback_ms = Some(sum.max_fallback_ms.unwrap_or(0).max(f));
    }
    sum.pushes_acked += u("pushes_acked");
    sum.pushes_failed += u("pushes_failed");
    sum.fetches_ok += r["fetches"][0].as_u64().unwrap_or(0);
    sum.fetches_failed += r["fetches"][1].as_u64().unwrap_or(0);
    sum.virtual_s += u("virtual_ms") as f64 / 1000.0;
}
