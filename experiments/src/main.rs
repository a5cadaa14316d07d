//! `bex-exp`: see `bex-exp --help` and the `bex_experiments` crate docs.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use bex_experiments::extract::{self, InferenceRun, TrainingRun};
use bex_experiments::summary;
use bex_report::ClusterReport;
use clap::{Parser, Subcommand};
use serde_json::Value;

/// Runs the paper's end-to-end experiments on clusters started by `bex-cluster`, and writes
/// runs.json, summary.json, summary.md and an SVG plot into the output directory.
#[derive(Parser, Debug)]
#[command(name = "bex-exp", version, after_help = bex_process::logging::LOG_HELP)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Inference, RDMA vs TCP at matched load (paper Tables 5–6): the same Poisson arrivals
    /// (same seed) over each transport, at each rate, repeated with the transports interleaved.
    Inference {
        /// The cluster file (with `[ranker]` and `[launch]` sections).
        #[arg(long, default_value = "configs/local.toml")]
        config: PathBuf,
        /// Output directory (runs/ holds every launched cluster's reports and logs).
        #[arg(long, default_value = "results/exp-inference")]
        out: PathBuf,
        /// Offered loads, requests/s over all rankers (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "100,200")]
        rates: Vec<f64>,
        /// Measured seconds per run.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Runs per (transport, rate) cell; the summary reports medians.
        #[arg(long, default_value_t = 3)]
        repeats: u32,
        /// Extra `bex-cluster --set section.key=value` overrides for every run (repeatable).
        #[arg(long = "set")]
        sets: Vec<String>,
        /// The bex-cluster executable (default: next to this one).
        #[arg(long)]
        cluster_bin: Option<PathBuf>,
    },
    /// Training under incast (paper Table 7): N trainers at once on TCP, on RDMA without the
    /// per-engine send window, and on RDMA with it, in network namespaces with rate-limited
    /// links (root).
    Training {
        /// The cluster file (with `[trainer]` and `[launch]` sections).
        #[arg(long, default_value = "configs/local.toml")]
        config: PathBuf,
        /// Output directory.
        #[arg(long, default_value = "results/exp-training")]
        out: PathBuf,
        /// Trainers at once (comma-separated: one cell each).
        #[arg(long, value_delimiter = ',', default_value = "4")]
        trainers: Vec<u32>,
        /// Seconds each trainer runs.
        #[arg(long, default_value_t = 15.0)]
        seconds: f64,
        /// Runs per cell.
        #[arg(long, default_value_t = 1)]
        repeats: u32,
        /// The send window of the `rdma+window` variant, bytes per engine.
        #[arg(long, default_value_t = 16384)]
        window: u64,
        /// Where the cluster runs: netns (one network namespace per host, rate-limited links;
        /// root) or loopback.
        #[arg(long, default_value = "netns")]
        mode: String,
        /// Rate of every host link (netns), as `tc` takes it.
        #[arg(long, default_value = "1gbit")]
        link_rate: String,
        /// Bytes a link end may queue (netns; tbf limit): small queues make incast drop.
        #[arg(long, default_value = "128kb")]
        link_queue: String,
        /// Variants to run.
        #[arg(long, value_delimiter = ',', default_value = "tcp,rdma,rdma+window")]
        variants: Vec<extract::Variant>,
        /// Extra `bex-cluster --set` overrides for every run (repeatable).
        #[arg(long = "set")]
        sets: Vec<String>,
        /// The bex-cluster executable (default: next to this one).
        #[arg(long)]
        cluster_bin: Option<PathBuf>,
    },
    /// Checks a demo/CI run's report.json: the launcher said ok, every ranker served requests
    /// with no errors or timeouts, and every trainer's held-out AUC and log-loss improved
    /// (and reached --min-auc). Exits 1 naming every failed check.
    Check {
        /// The run's report.json.
        report: PathBuf,
        /// Lowest acceptable final held-out AUC of every trainer.
        #[arg(long, default_value_t = 0.0)]
        min_auc: f64,
    },
    /// Checks a Grafana dashboard against a running cluster's exports: every panel query
    /// names a bex metric, each one is among the scraped series, and each label="value"
    /// matcher selects one (e.g. `bex-exp dashboard deploy/grafana/bex-dashboard.json
    /// target/e2e/metrics`: bex-cluster keeps every process's last scrape there). Exits 1
    /// naming every problem.
    Dashboard {
        /// The dashboard JSON.
        dashboard: PathBuf,
        /// Scrapes (Prometheus text): files, or directories of `*.prom` files.
        #[arg(required = true)]
        scrapes: Vec<PathBuf>,
    },
}

fn default_cluster_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("bex-cluster")))
        .unwrap_or_else(|| PathBuf::from("bex-cluster"))
}

/// Runs one cluster; `Ok(report)` if it wrote a report (even one that says not ok).
fn launch(bin: &Path, config: &Path, dir: &Path, args: &[String]) -> Result<ClusterReport, String> {
    let _ = std::fs::remove_dir_all(dir);
    let mut cmd = Command::new(bin);
    // The cluster goes with this process, however it ends (even SIGKILL).
    cmd.arg("run").arg("--die-with-parent").arg("--config").arg(config).arg("--out").arg(dir);
    cmd.args(args);
    eprintln!("bex-exp: {cmd:?}");
    let status = cmd.status().map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{} ({status}): no report: {e}", path.display()))?;
    let v = ClusterReport::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if !status.success() {
        eprintln!("bex-exp: warning: bex-cluster exited with {status}; see {}", dir.display());
    }
    Ok(v)
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

/// A run that produced no result.
#[derive(serde::Serialize)]
struct RunFailure {
    /// Its output directory.
    run: PathBuf,
    /// Why.
    error: String,
}

/// Keeps one run's result (announcing it with `line`) or its failure.
fn record<R>(
    dir: &Path,
    result: Result<R, String>,
    runs: &mut Vec<R>,
    failures: &mut Vec<RunFailure>,
    line: impl FnOnce(&R) -> String,
) {
    match result {
        Ok(r) => {
            eprintln!("bex-exp: {}", line(&r));
            runs.push(r);
        }
        Err(error) => {
            eprintln!("bex-exp: {}: {error}", dir.display());
            failures.push(RunFailure { run: dir.to_path_buf(), error });
        }
    }
}

/// `runs.json` (every run and failure) and `summary.json` (the command and the cells).
fn write_runs<R: serde::Serialize, C: serde::Serialize>(
    out: &Path,
    runs: &[R],
    failures: &[RunFailure],
    cells: &C,
) -> Result<(), String> {
    #[derive(serde::Serialize)]
    struct Runs<'a, R> {
        runs: &'a [R],
        failures: &'a [RunFailure],
    }
    #[derive(serde::Serialize)]
    struct Summary<'a, C> {
        command: String,
        cells: &'a C,
    }
    write(&out.join("runs.json"), &pretty(&Runs { runs, failures })?)?;
    write(&out.join("summary.json"), &pretty(&Summary { command: command_line(), cells })?)
}

fn pretty(v: &impl serde::Serialize) -> Result<String, String> {
    serde_json::to_string_pretty(v).map_err(|e| format!("JSON: {e}"))
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn with_sets(base: Vec<String>, sets: &[String]) -> Vec<String> {
    let mut v = base;
    for s in sets {
        v.push("--set".into());
        v.push(s.clone());
    }
    v
}

fn run() -> Result<(), String> {
    match Cli::parse().cmd {
        Cmd::Dashboard { dashboard, scrapes } => {
            let read =
                |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
            let d: Value = serde_json::from_str(&read(&dashboard)?)
                .map_err(|e| format!("{}: {e}", dashboard.display()))?;
            let mut exported = bex_experiments::dashboard::Exported::default();
            let mut files = Vec::new();
            for p in &scrapes {
                if p.is_dir() {
                    let entries =
                        std::fs::read_dir(p).map_err(|e| format!("{}: {e}", p.display()))?;
                    let mut proms: Vec<PathBuf> = entries
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|f| f.extension().is_some_and(|x| x == "prom"))
                        .collect();
                    proms.sort();
                    files.extend(proms);
                } else {
                    files.push(p.clone());
                }
            }
            if files.is_empty() {
                return Err("no scrapes found (*.prom)".into());
            }
            for f in &files {
                exported.add_scrape(&read(f)?);
            }
            let queries = bex_experiments::dashboard::queries(&d).len();
            let problems = bex_experiments::dashboard::check(&d, &exported);
            if !problems.is_empty() {
                return Err(format!("dashboard check failed:\n  {}", problems.join("\n  ")));
            }
            println!(
                "dashboard check passed: {queries} queries of {} against {} metrics from {} scrapes",
                dashboard.display(),
                exported.names(),
                files.len()
            );
        }
        Cmd::Check { report, min_auc } => {
            let text = std::fs::read_to_string(&report)
                .map_err(|e| format!("{}: {e}", report.display()))?;
            let v = ClusterReport::from_json(&text)
                .map_err(|e| format!("{}: {e}", report.display()))?;
            let failed = bex_experiments::check::demo(&v, min_auc);
            for line in bex_experiments::check::describe(&v) {
                println!("{line}");
            }
            if !failed.is_empty() {
                return Err(format!("check failed:\n  {}", failed.join("\n  ")));
            }
            println!("check passed: {}", report.display());
        }
        Cmd::Inference { config, out, rates, seconds, repeats, sets, cluster_bin } => {
            if rates.is_empty() || rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
                return Err("--rates: every rate must be a positive number".into());
            }
            if !(seconds.is_finite() && seconds > 0.0) || repeats == 0 {
                return Err("--seconds must be positive and --repeats at least 1".into());
            }
            let bin = cluster_bin.unwrap_or_else(default_cluster_bin);
            std::fs::create_dir_all(out.join("runs")).map_err(|e| e.to_string())?;
            let mut runs: Vec<InferenceRun> = Vec::new();
            let mut failures: Vec<RunFailure> = Vec::new();
            for rep in 0..repeats {
                for &rate in &rates {
                    for transport in bex_transport_kind::TransportKind::ALL {
                        let dir = out.join("runs").join(format!("{transport}-{rate}-{rep}"));
                        let args = with_sets(
                            vec![
                                "--transport".into(),
                                transport.to_string(),
                                "--set".into(),
                                "launch.phases=[\"inference\"]".into(),
                                "--set".into(),
                                format!("ranker.rate={rate:?}"),
                                "--set".into(),
                                format!("ranker.seconds={seconds:?}"),
                            ],
                            &sets,
                        );
                        let result = launch(&bin, &config, &dir, &args)
                            .and_then(|v| extract::inference(&v, transport, rate));
                        record(&dir, result, &mut runs, &mut failures, |r| {
                            format!(
                                "{transport} {rate} req/s #{rep}: pull p99 {:.0} µs, mean {:.0} µs, errors {}",
                                r.pull_p99_us, r.pull_mean_us, r.errors
                            )
                        });
                    }
                }
            }
            let cells = summary::inference_cells(&runs);
            write_runs(&out, &runs, &failures, &cells)?;
            let md = summary::inference_markdown(&cells, &command_line());
            write(&out.join("summary.md"), &md)?;
            write(&out.join("inference.svg"), &summary::inference_svg(&cells))?;
            println!("{md}");
            if !failures.is_empty() {
                return Err(format!("{} runs failed (see runs.json)", failures.len()));
            }
        }
        Cmd::Training {
            config,
            out,
            trainers,
            seconds,
            repeats,
            window,
            mode,
            link_rate,
            link_queue,
            variants,
            sets,
            cluster_bin,
        } => {
            if trainers.is_empty() || trainers.contains(&0) {
                return Err("--trainers: counts must be at least 1".into());
            }
            if !(seconds.is_finite() && seconds > 0.0) || repeats == 0 || window == 0 {
                return Err("--seconds, --repeats and --window must be positive".into());
            }
            let bin = cluster_bin.unwrap_or_else(default_cluster_bin);
            std::fs::create_dir_all(out.join("runs")).map_err(|e| e.to_string())?;
            let mut runs: Vec<TrainingRun> = Vec::new();
            let mut failures: Vec<RunFailure> = Vec::new();
            for rep in 0..repeats {
                for &n in &trainers {
                    for &variant in &variants {
                        let (transport, cwnd) = (variant.transport(), variant.cwnd_bytes(window));
                        let dir = out
                            .join("runs")
                            .join(format!("{}-{n}-{rep}", variant.name().replace('+', "-")));
                        let args = with_sets(
                            vec![
                                "--transport".into(),
                                transport.to_string(),
                                "--set".into(),
                                "launch.phases=[\"training\"]".into(),
                                "--set".into(),
                                format!("launch.trainers={n}"),
                                "--set".into(),
                                format!("trainer.seconds={seconds:?}"),
                                "--set".into(),
                                format!("transport.cwnd_bytes={cwnd}"),
                                "--mode".into(),
                                mode.clone(),
                                "--set".into(),
                                format!("launch.link_rate={link_rate:?}"),
                                "--set".into(),
                                format!("launch.link_queue={link_queue:?}"),
                            ],
                            &sets,
                        );
                        let result = launch(&bin, &config, &dir, &args)
                            .and_then(|v| extract::training(&v, variant));
                        record(&dir, result, &mut runs, &mut failures, |r| {
                            format!(
                                "{variant} × {n} #{rep}: push p99 {:.0} µs, fetch p99 {:.0} µs, retransmits {}",
                                r.push_p99_us, r.fetch_p99_us, r.retransmits
                            )
                        });
                    }
                }
            }
            let cells = summary::training_cells(&runs);
            let setup = format!(
                "Each run starts a fresh cluster from `{}` in {mode} mode, links {link_rate} with \
                 {link_queue} of queue per link end; {seconds} s per trainer; the window variant sets \
                 `transport.cwnd_bytes = {window}` on every process. Medians of {repeats} run(s) per cell; \
                 the busiest trainer is the one with the highest P99.",
                config.display()
            );
            write_runs(&out, &runs, &failures, &cells)?;
            let md = summary::training_markdown(&cells, &command_line(), &setup);
            write(&out.join("summary.md"), &md)?;
            write(&out.join("training.svg"), &summary::training_svg(&cells))?;
            println!("{md}");
            if !failures.is_empty() {
                return Err(format!("{} runs failed (see runs.json)", failures.len()));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    bex_process::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bex-exp: {e}");
            ExitCode::FAILURE
        }
    }
}
