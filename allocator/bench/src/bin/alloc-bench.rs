//! `alloc-bench`: the paper's Figure 4 (ops/s and peak memory versus threads, large and small
//! allocations, ~10 % cross-thread frees) and Figure 5 (registered footprint over a run) for
//! glibc, jemalloc, mimalloc, rpmalloc, bemalloc's raw base (same arena and hooks, no
//! registration) and bemalloc (registered with a software RNIC). Method: see the crate docs.
//!
//! ```text
//! alloc-bench [--quick] [--threads 1,2,3,4] [--reps 3] [--allocators glibc,bemalloc,…]
//!             [--out DIR] [--large-steps N] [--small-steps N] [--footprint-ms MS]
//! ```
//! Writes `DIR/alloc-bench.json`, `DIR/figure4.svg`, `DIR/figure5.svg` (default DIR:
//! `target/alloc-bench`) and prints the tables. Each cell is a child process of this binary
//! (`--cell …`, `--footprint …`); rpmalloc cells run `alloc-bench-rpmalloc` from the same
//! directory. Exits 1 if a bemalloc cell fails; a competitor that cannot run here is reported
//! as missing (in the table and the JSON), never given a number.

use std::path::PathBuf;
use std::time::Duration;

use bemalloc_bench::cell::{self, run_cell, CellResult, Sample};
use bemalloc_bench::report::{self, ALLOCATORS};
use bemalloc_bench::workload::Workload;
use bemalloc_bench::Global;

struct Opts {
    quick: bool,
    threads: Vec<usize>,
    reps: usize,
    allocators: Vec<String>,
    out: PathBuf,
    large_steps: usize,
    small_steps: usize,
    footprint_ms: u64,
}

fn usage(msg: &str) -> ! {
    eprintln!("alloc-bench: {msg}");
    eprintln!(
        "usage: alloc-bench [--quick] [--threads 1,2,3,4] [--reps N] [--allocators a,b,…] \
         [--out DIR] [--large-steps N] [--small-steps N] [--footprint-ms MS]"
    );
    std::process::exit(2)
}

fn parse_opts(args: &[String]) -> Opts {
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Opts {
        quick,
        threads: vec![1, 2, 3, 4],
        reps: if quick { 1 } else { 3 },
        allocators: ALLOCATORS.iter().map(|s| s.to_string()).collect(),
        out: PathBuf::from("target/alloc-bench"),
        large_steps: if quick { 4_000 } else { 100_000 },
        small_steps: if quick { 100_000 } else { 4_000_000 },
        footprint_ms: if quick { 1_500 } else { 8_000 },
    };
    if quick {
        o.threads = vec![1, 2];
    }
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().unwrap_or_else(|| usage(&format!("{a} needs a value")));
        let num =
            |v: String| v.parse::<usize>().unwrap_or_else(|_| usage(&format!("bad number {v}")));
        match a.as_str() {
            "--quick" => {}
            "--threads" => o.threads = val().split(',').map(|t| num(t.to_string())).collect(),
            "--reps" => o.reps = num(val()).max(1),
            "--allocators" => {
                o.allocators = val().split(',').map(str::to_string).collect();
                if let Some(bad) = o.allocators.iter().find(|a| !ALLOCATORS.contains(&a.as_str())) {
                    usage(&format!("unknown allocator {bad}; known: {ALLOCATORS:?}"));
                }
            }
            "--out" => o.out = PathBuf::from(val()),
            "--large-steps" => o.large_steps = num(val()),
            "--small-steps" => o.small_steps = num(val()),
            "--footprint-ms" => o.footprint_ms = num(val()) as u64,
            other => usage(&format!("unknown argument {other}")),
        }
    }
    o
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

fn main() {
    bex_process::logging::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--cell") => return child_cell(&args[1..]),
        Some("--footprint") => {
            let ms: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(2000);
            cell::run_footprint(2, Duration::from_millis(ms), Duration::from_millis(100));
            return;
        }
        _ => {}
    }
    let o = parse_opts(&args);
    let exe = std::env::current_exe().expect("current_exe");
    let rp_exe = exe.with_file_name("alloc-bench-rpmalloc");
    let workloads = [Workload::Large, Workload::Small];
    let mut results: Vec<CellResult> = Vec::new();
    let mut missing: Vec<(String, String)> = Vec::new();
    let total = o.reps * workloads.len() * o.threads.len() * o.allocators.len();
    let mut n = 0;
    // Repetitions outermost so slow drift of the machine spreads over every allocator.
    for rep in 0..o.reps {
        for w in workloads {
            for &t in &o.threads {
                for a in &o.allocators {
                    n += 1;
                    if missing.iter().any(|(m, _)| m == a) {
                        continue;
                    }
                    let steps = match w {
                        Workload::Large => o.large_steps,
                        Workload::Small => o.small_steps,
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
        match cell::spawn(&exe, &["--footprint".into(), o.footprint_ms.to_string()]) {
            Ok(out) => out.lines().filter_map(cell::parse_sample).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "the footprint run (Figure 5) failed");
                Vec::new()
            }
        };

    let med = report::medians(&results);
    let wnames: Vec<&str> = workloads.iter().map(|w| w.name()).collect();
    let mut text = report::table(&med, &wnames, &o.threads);
    let step = (footprint.len() / 20).max(1);
    text += &report::footprint_table(&footprint, step);
    text += &targets(&med, &wnames, &o.threads, &footprint);
    for (a, why) in &missing {
        text += &format!("MISSING {a}: {why}\n");
    }
    println!("{text}");

    let meta = vec![
        ("command", std::env::args().collect::<Vec<_>>().join(" ")),
        ("quick", o.quick.to_string()),
        ("reps", o.reps.to_string()),
        ("large_steps_per_thread", o.large_steps.to_string()),
        ("small_steps_per_thread", o.small_steps.to_string()),
        ("cpus", std::thread::available_parallelism().map_or(0, |n| n.get()).to_string()),
    ];
    if let Err(e) = std::fs::create_dir_all(&o.out) {
        eprintln!("cannot create {}: {e}", o.out.display());
        std::process::exit(1);
    }
    let files = [
        ("alloc-bench.json", report::json(&meta, &results, &med, &missing, &footprint)),
        ("figure4.svg", report::figure4_svg(&med, &o.threads)),
        ("figure5.svg", report::figure5_svg(&footprint)),
        ("tables.txt", text),
    ];
    for (name, body) in files {
        let p = o.out.join(name);
        if let Err(e) = std::fs::write(&p, body) {
            eprintln!("cannot write {}: {e}", p.display());
            std::process::exit(1);
        }
        eprintln!("wrote {}", p.display());
    }
    // A competitor that cannot run here is reported as missing; bemalloc itself must run.
    let broken = missing.iter().any(|(a, _)| a.starts_with("bemalloc"))
        || results.iter().any(|r| r.alloc.starts_with("bemalloc") && r.failures > 0)
        || footprint.is_empty();
    if broken {
        eprintln!("alloc-bench: a bemalloc cell failed (see above)");
        std::process::exit(1);
    }
}

/// The issue's targets, evaluated on the medians.
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
