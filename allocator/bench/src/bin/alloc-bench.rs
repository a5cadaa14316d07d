//! `alloc-bench`: the paper's Figure 4 (ops/s and peak memory versus threads, large and small
//! allocations, ~10 % cross-thread frees) and Figure 5 (registered footprint over a run) for
//! glibc, jemalloc, mimalloc, rpmalloc, bemalloc's raw base (same arena and hooks, no
//! registration) and bemalloc (registered with a software RNIC). Method: see the crate docs.
//!
//! `alloc-bench --help` lists the options. Writes `DIR/tables.txt`, `DIR/alloc-bench.json`,
//! `DIR/figure4.svg`, `DIR/figure5.svg` (`--out DIR`, default `target/alloc-bench`) and prints
//! the tables. Each cell is a child process of this binary
//! (`--cell …`, `--footprint …`); rpmalloc cells run `alloc-bench-rpmalloc` from the same
//! directory. Exits 1 if a bemalloc cell fails; a competitor that cannot run here is reported
//! as missing (in the table and the JSON), never given a number.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bemalloc_bench::cell::{self, run_cell, CellResult, Sample};
use bemalloc_bench::report::{self, Meta, ALLOCATORS};
use bemalloc_bench::workload::Workload;
use bemalloc_bench::Global;
use bex_bench::cli::Output;
use bex_bench::pin::Placement;
use bex_bench::report::Envelope;
use clap::Parser;

/// The tool's name, in its report.
const TOOL: &str = "alloc-bench";

/// alloc-bench: bemalloc against glibc, jemalloc, mimalloc and rpmalloc (Figures 4 and 5).
#[derive(Debug, Parser)]
#[command(name = "alloc-bench", version)]
struct Cli {
    /// CI run: threads 1,2, one repetition, short cells and footprint run.
    #[arg(long)]
    quick: bool,
    /// Thread counts, comma-separated (default 1,2,3,4; quick 1,2).
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: Vec<u16>,
    /// Repetitions per cell; tables and figures show medians (default 3; quick 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    reps: Option<u16>,
    /// Allocators, comma-separated (default all: glibc, jemalloc, mimalloc, rpmalloc,
    /// bemalloc-raw, bemalloc).
    #[arg(long, value_name = "A[,A...]", value_delimiter = ',', value_parser = allocator)]
    allocators: Vec<String>,
    /// Steps per thread of a large-allocation cell (default 100000; quick 4000).
    #[arg(long, value_name = "N")]
    large_steps: Option<usize>,
    /// Steps per thread of a small-allocation cell (default 4000000; quick 100000).
    #[arg(long, value_name = "N")]
    small_steps: Option<usize>,
    /// Length of the footprint run (Figure 5), ms (default 8000; quick 1500).
    #[arg(long, value_name = "MS")]
    footprint_ms: Option<u64>,
    /// Internal: run one cell in this process (ALLOC WORKLOAD THREADS STEPS) and print its
    /// result line.
    #[arg(long, num_args = 4, value_names = ["ALLOC", "WORKLOAD", "THREADS", "STEPS"], hide = true)]
    cell: Option<Vec<String>>,
    /// Internal: run the footprint sampler for MS milliseconds and print its samples.
    #[arg(long, value_name = "MS", hide = true)]
    footprint: Option<u64>,
    /// Where the report goes (default --out target/alloc-bench): tables.txt,
    /// alloc-bench.json, figure4.svg, figure5.svg.
    #[command(flatten)]
    output: Output,
}

fn allocator(text: &str) -> Result<String, String> {
    if ALLOCATORS.contains(&text) {
        Ok(text.to_string())
    } else {
        Err(format!("unknown allocator {text:?}; known: {}", ALLOCATORS.join(", ")))
    }
}

fn usage(msg: &str) -> ! {
    eprintln!("alloc-bench: {msg}");
    std::process::exit(2)
}

/// Child: one cell in this process.
fn child_cell(args: &[String]) {
    let [name, w, t, s] = args else { usage("--cell ALLOC WORKLOAD THREADS STEPS") };
    let workload = Workload::parse(w).unwrap_or_else(|| usage("workload is large or small"));
    let threads: usize = t.parse().unwrap_or_else(|_| usage("threads"));
    let steps: usize = s.parse().unwrap_or_else(|_| usage("steps"));
    let r = match name.as_str() {
        "glibc" => run_cell(name, &Global(std::alloc::System), workload, threads, steps),
        "jemalloc" => {
            run_cell(name, &Global(tikv_jemallocator::Jemalloc), workload, threads, steps)
        }
        "mimalloc" => run_cell(name, &Global(mimalloc::MiMalloc), workload, threads, steps),
        "bemalloc" | "bemalloc-raw" => {
            let (_fabric, pool) = cell::bemalloc_pool(name == "bemalloc-raw");
            run_cell(name, &pool, workload, threads, steps)
        }
        other => usage(&format!("{other} does not run in this binary")),
    };
    println!("{}", r.to_line());
}

fn main() -> ExitCode {
    bex_process::logging::init();
    let cli = Cli::parse();
    if cli.cell.is_some() || cli.footprint.is_some() {
        // A cell or footprint run is this tool's child: it goes when its parent does.
        bex_process::exit_with_parent();
    }
    if let Some(args) = &cli.cell {
        child_cell(args);
        return ExitCode::SUCCESS;
    }
    if let Some(ms) = cli.footprint {
        cell::run_footprint(2, Duration::from_millis(ms), Duration::from_millis(100));
        return ExitCode::SUCCESS;
    }
    let q = cli.quick;
    let threads: Vec<usize> = if cli.threads.is_empty() {
        if q {
            vec![1, 2]
        } else {
            vec![1, 2, 3, 4]
        }
    } else {
        cli.threads.iter().map(|&t| usize::from(t)).collect()
    };
    let allocators: Vec<String> = if cli.allocators.is_empty() {
        ALLOCATORS.iter().map(|s| s.to_string()).collect()
    } else {
        cli.allocators.clone()
    };
    let meta = Meta {
        quick: q,
        reps: usize::from(cli.reps.unwrap_or(if q { 1 } else { 3 })),
        large_steps_per_thread: cli.large_steps.unwrap_or(if q { 4_000 } else { 100_000 }),
        small_steps_per_thread: cli.small_steps.unwrap_or(if q { 100_000 } else { 4_000_000 }),
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
    };
    let footprint_ms = cli.footprint_ms.unwrap_or(if q { 1_500 } else { 8_000 });
    let mut output = cli.output.clone();
    if output.out.is_none() && output.json.is_none() {
        output.out = Some(PathBuf::from("target/alloc-bench"));
    }
    let Ok(exe) = std::env::current_exe() else { usage("cannot locate this executable") };
    let rp_exe = exe.with_file_name("alloc-bench-rpmalloc");
    let workloads = [Workload::Large, Workload::Small];
    let mut results: Vec<CellResult> = Vec::new();
    let mut missing: Vec<(String, String)> = Vec::new();
    let total = meta.reps * workloads.len() * threads.len() * allocators.len();
    let mut n = 0;
    // Repetitions outermost so slow drift of the machine spreads over every allocator.
    for rep in 0..meta.reps {
        for w in workloads {
            for &t in &threads {
                for a in &allocators {
                    n += 1;
                    if missing.iter().any(|(m, _)| m == a) {
                        continue;
                    }
                    let steps = match w {
                        Workload::Large => meta.large_steps_per_thread,
                        Workload::Small => meta.small_steps_per_thread,
                    };
                    let cell_args = vec![
                        "--cell".into(),
                        a.clone(),
                        w.name().into(),
                        t.to_string(),
                        steps.to_string(),
                    ];
                    let bin = if a == "rpmalloc" { &rp_exe } else { &exe };
                    match cell::spawn(bin, &cell_args) {
                        Ok(out) => match out.lines().find_map(CellResult::parse) {
                            Some(r) => {
                                eprintln!(
                                    "[{n}/{total}] rep {rep} {a:>12} {:>5} t={t}: {:.2} Mops/CPU-s, peak {:.1} MiB",
                                    w.name(),
                                    r.ops_per_cpu_s() / 1e6,
                                    r.peak_rss_kib as f64 / 1024.0
                                );
                                results.push(r);
                            }
                            None => missing.push((
                                a.clone(),
                                format!("no result line from {}", bin.display()),
                            )),
                        },
                        Err(e) => {
                            tracing::warn!(allocator = %a, error = %e, "competitor missing: its cells are left out");
                            missing.push((a.clone(), e));
                        }
                    }
                }
            }
        }
    }
    // Figure 5 in its own process.
    let footprint: Vec<Sample> =
        match cell::spawn(&exe, &["--footprint".into(), footprint_ms.to_string()]) {
            Ok(out) => out.lines().filter_map(cell::parse_sample).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "the footprint run (Figure 5) failed");
                Vec::new()
            }
        };

    let med = report::medians(&results);
    let wnames: Vec<&str> = workloads.iter().map(|w| w.name()).collect();
    let mut text = report::table(&med, &wnames, &threads);
    let step = (footprint.len() / 20).max(1);
    text += &report::footprint_table(&footprint, step);
    text += &targets(&med, &wnames, &threads, &footprint);
    for (a, why) in &missing {
        text += &format!("MISSING {a}: {why}\n");
    }
    println!("{text}");

    let envelope = Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), Placement::default());
    let json = report::json(&envelope, &meta, &results, &med, &missing, &footprint);
    let figures = [
        ("figure4.svg", report::figure4_svg(&med, &threads)),
        ("figure5.svg", report::figure5_svg(&footprint)),
    ];
    if let Err(e) = output.write(TOOL, &text, &json, &figures) {
        eprintln!("alloc-bench: {e}");
        return ExitCode::FAILURE;
    }
    // A competitor that cannot run here is reported as missing; bemalloc itself must run.
    let broken = missing.iter().any(|(a, _)| a.starts_with("bemalloc"))
        || results.iter().any(|r| r.alloc.starts_with("bemalloc") && r.failures > 0)
        || footprint.is_empty();
    if broken {
        eprintln!("alloc-bench: a bemalloc cell failed (see above)");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// The targets, evaluated on the medians.
fn targets(
    med: &std::collections::BTreeMap<report::Key, report::Median>,
    workloads: &[&str],
    threads: &[usize],
    footprint: &[Sample],
) -> String {
    let mut o = String::from("\nTargets\n");
    let get = |a: &str, w: &str, t: usize| med.get(&(a.to_string(), w.to_string(), t));
    for w in workloads {
        for &t in threads {
            if let (Some(b), Some(r)) = (get("bemalloc", w, t), get("bemalloc-raw", w, t)) {
                let x = b.ops_per_cpu_s / r.ops_per_cpu_s;
                let v = if x >= 0.9 { "met" } else { "NOT MET" };
                o += &format!("  ops   {w:>5} t={t}: bemalloc/raw base = {x:.3} (>= 0.9: {v})\n");
            }
            if let (Some(b), Some(g)) = (get("bemalloc", w, t), get("glibc", w, t)) {
                let x = b.peak_rss_kib as f64 / g.peak_rss_kib as f64;
                let v = if x <= 1.5 { "met" } else { "NOT MET" };
                o += &format!("  peak  {w:>5} t={t}: bemalloc/glibc = {x:.3} (<= 1.5: {v})\n");
            }
            if let Some(n) = get("bemalloc", w, t).and_then(|b| b.new_registrations_after_warmup) {
                let v = if n == 0 { "met" } else { "NOT MET" };
                o += &format!(
                    "  regs  {w:>5} t={t}: new registrations after warm-up = {n} (0: {v})\n"
                );
            }
        }
    }
    if let (Some(first), Some(last)) = (
        footprint.iter().find(|s| s.t_ms * 10 >= footprint.last().map_or(0, |l| l.t_ms) * 6),
        footprint.last(),
    ) {
        o += &format!(
            "  footprint: registrations at 60% of the run {} -> end {} (plateau adds {})\n",
            first.registrations,
            last.registrations,
            last.registrations - first.registrations
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        bex_bench::cli::try_parse(TOOL, args)
    }

    #[test]
    fn options_parse_and_bad_ones_are_refused() {
        let c = parse(&["--quick", "--threads", "1,3", "--allocators", "glibc,bemalloc"]).unwrap();
        assert_eq!((c.threads, c.allocators.len()), (vec![1, 3], 2));
        let c = parse(&["--cell", "glibc", "small", "2", "100"]).unwrap();
        assert_eq!(c.cell.unwrap().len(), 4);
        assert!(parse(&["--allocators", "tcmalloc"])
            .unwrap_err()
            .to_string()
            .contains("unknown allocator"));
        assert!(parse(&["--threads", "0"]).is_err());
        assert!(parse(&["--reps", "0"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
    }

    #[test]
    fn every_option_is_documented() {
        use clap::CommandFactory;
        bex_bench::cli::assert_documented(Cli::command());
    }
}
