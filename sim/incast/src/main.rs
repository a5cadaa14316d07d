//! `bex-incast`: the paper's incast study (Table 4, Figure 15) in deterministic simulation.
//! Each probe runs in a child process of its own (every simulated node leaks a registered
//! pool with a jemalloc arena, and a process has at most 4095).

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use bex_incast::{clock, run_probe, Params, Probe, DEFAULT_RESPONSE_BYTES, DEFAULT_XOFF_BYTES};
use bex_plot::{grid, Chart, Series, COLORS};
use clap::{Parser, Subcommand};
use serde::Serialize;

/// The paper's Table 4: servers before the first PFC pause, by window (bytes; None = off).
const PAPER: [(Option<u64>, u64); 4] =
    [(Some(4096), 1218), (Some(8192), 567), (Some(16384), 273), (None, 63)];

#[derive(Parser, Debug)]
#[command(
    name = "bex-incast",
    about = "Incast study in deterministic simulation: N parameter servers answer one worker's \
             pull at once over the real transport engines on a switched fabric with PFC. For \
             each software send window (4, 8, 16 KB, none) it finds the largest N with no pause \
             (binary search), then measures P50/P99 pull latency and a victim flow's bandwidth \
             against N. Times are virtual and exact for a seed; only runtimes are wall-clock.",
    after_help = "Exit codes: 0 done, 1 a simulation failed (the seed is printed), 2 bad usage."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// CI smoke run: a scaled-down switch (XOFF 256 KB), 16 KiB responses, N ≤ 128 (or
    /// --max-servers if smaller), series N = 8, 32, 96.
    #[arg(long)]
    quick: bool,
    /// Directory for incast.json, incast.svg and incast.md (created).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Largest N searched.
    #[arg(long, default_value_t = 1400)]
    max_servers: usize,
    /// Bytes of each pull response.
    #[arg(long, default_value_t = DEFAULT_RESPONSE_BYTES)]
    response_bytes: usize,
    /// Fragment size of large messages (the window admits whole fragments).
    #[arg(long, default_value_t = 4096)]
    fragment_bytes: usize,
    /// PFC XOFF threshold of each switch port, bytes.
    #[arg(long, default_value_t = DEFAULT_XOFF_BYTES)]
    xoff_bytes: u64,
    /// XON threshold = XOFF minus this, bytes.
    #[arg(long, default_value_t = 256 << 10)]
    xon_gap_bytes: u64,
    /// Link and switch-port rate, Gb/s.
    #[arg(long, default_value_t = 25.0)]
    link_gbps: f64,
    /// Propagation delay per hop, µs.
    #[arg(long, default_value_t = 1.0)]
    hop_latency_us: f64,
    /// N values of the latency / victim-bandwidth series (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [32usize, 128, 512, 1218])]
    series: Vec<usize>,
    /// Pull rounds per series point.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Seed of every simulation.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Internal: run one probe (parameters as JSON) and print its result as JSON.
    Probe {
        /// The `Params` as JSON.
        #[arg(long)]
        params: String,
    },
}

#[derive(Serialize)]
struct WindowResult {
    window: Option<u64>,
    servers_before_pause: usize,
    /// No pause even at `max_servers`.
    saturated: bool,
    paper: u64,
    probes: Vec<Probe>,
}

#[derive(Serialize)]
struct Report {
    command: Vec<String>,
    base: Params,
    max_servers: usize,
    windows: Vec<WindowResult>,
    series: Vec<Probe>,
    wall_s: f64,
}

fn probe_child(p: &Params) -> Result<Probe, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
    let json = serde_json::to_string(p).map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["probe", "--params", &json])
        .output()
        .map_err(|e| format!("spawning a probe: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "probe N={} window={:?} seed={} failed: {}",
            p.servers,
            p.window,
            p.seed,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("probe output: {e}"))
}

fn wname(w: Option<u64>) -> String {
    w.map_or("none".into(), |b| format!("{} KB", b / 1024))
}

fn search(base: &Params, window: Option<u64>, max: usize) -> Result<WindowResult, String> {
    let paper = PAPER.iter().find(|(w, _)| *w == window).map_or(0, |p| p.1);
    let mut probes = Vec::new();
    let mut run = |n: usize| -> Result<bool, String> {
        let p = probe_child(&Params { servers: n, window, ..base.clone() })?;
        eprintln!(
            "  window {:>6} N {:>5}: pauses {:>3} max queue {:>8} B  ({:.0} ms)",
            wname(window),
            n,
            p.pause_events,
            p.worker_port_max_queue,
            p.wall_ms
        );
        let paused = p.pause_events > 0;
        probes.push(p);
        Ok(paused)
    };
    if !run(max)? {
        return Ok(WindowResult {
            window,
            servers_before_pause: max,
            saturated: true,
            paper,
            probes,
        });
    }
    // Invariant: lo has no pause (N = 0 trivially), hi has one.
    let (mut lo, mut hi) = (0usize, max);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if run(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(WindowResult { window, servers_before_pause: lo, saturated: false, paper, probes })
}

fn markdown(r: &Report) -> String {
    let mut s = String::from(
        "| window | servers before pause (sim) | paper (Table 4) | sim × window |\n|---|---|---|---|\n",
    );
    for w in &r.windows {
        let n = if w.saturated {
            format!("≥ {}", w.servers_before_pause)
        } else {
            w.servers_before_pause.to_string()
        };
        let bytes =
            w.window.unwrap_or(r.base.response_bytes as u64) * w.servers_before_pause as u64;
        s += &format!(
            "| {} | {} | {} | {:.2} MB |\n",
            wname(w.window),
            n,
            w.paper,
            bytes as f64 / 1e6
        );
    }
    s += "\n| window | N | P50 pull µs | P99 pull µs | victim Gb/s | pauses | max queue KB |\n|---|---|---|---|---|---|---|\n";
    for p in &r.series {
        s += &format!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {} | {} |\n",
            wname(p.params.window),
            p.params.servers,
            p.p50_us,
            p.p99_us,
            p.victim_gbps.unwrap_or(0.0),
            p.pause_events,
            p.worker_port_max_queue / 1024
        );
    }
    s
}

fn svg(r: &Report) -> String {
    let x_of = |w: Option<u64>| w.map_or(32.0, |b| (b / 1024) as f64);
    let ticks =
        vec![(4.0, "4".into()), (8.0, "8".into()), (16.0, "16".into()), (32.0, "none".into())];
    let ours = r.windows.iter().map(|w| (x_of(w.window), w.servers_before_pause as f64)).collect();
    let paper = PAPER.iter().map(|(w, n)| (x_of(*w), *n as f64)).collect();
    let pause = Chart::new(
        "Servers before the first pause",
        "software window (KB)",
        "servers",
        vec![
            Series::new("simulation", COLORS[0], ours),
            Series::new("paper", COLORS[1], paper).dashed(),
        ],
    )
    .with_x_ticks(ticks);
    let mut lat = Vec::new();
    let mut bw = Vec::new();
    for (i, w) in r.windows.iter().enumerate() {
        let pts: Vec<&Probe> = r.series.iter().filter(|p| p.params.window == w.window).collect();
        let c = COLORS[i % COLORS.len()];
        let xs = |f: &dyn Fn(&Probe) -> f64| {
            pts.iter().map(|p| (p.params.servers as f64, f(p))).collect()
        };
        lat.push(Series::new(format!("P99 {}", wname(w.window)), c, xs(&|p| p.p99_us / 1000.0)));
        lat.push(
            Series::new(format!("P50 {}", wname(w.window)), c, xs(&|p| p.p50_us / 1000.0)).dashed(),
        );
        bw.push(Series::new(wname(w.window), c, xs(&|p| p.victim_gbps.unwrap_or(0.0))));
    }
    let charts = [
        pause,
        Chart::new("Pull latency", "servers", "ms", lat),
        Chart::new("Victim bandwidth", "servers", "Gb/s", bw),
    ];
    grid(&charts, 3, 460.0, 320.0)
}

fn main() -> ExitCode {
    bex_process::logging::init();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    if let Some(Cmd::Probe { params }) = &cli.cmd {
        // A probe is this tool's child: it goes when its parent does.
        bex_process::exit_with_parent();
        let p: Params = match serde_json::from_str(params) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("bad --params: {e}");
                return ExitCode::from(2);
            }
        };
        return match run_probe(&p) {
            Ok(r) => match serde_json::to_string(&r) {
                Ok(s) => {
                    println!("{s}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            },
            Err(e) => {
                eprintln!("{e} (replay: bex-incast probe --params '{params}')");
                ExitCode::FAILURE
            }
        };
    }
    let wall = clock::wall_now();
    let mut base = Params {
        response_bytes: cli.response_bytes,
        fragment_bytes: cli.fragment_bytes,
        link_gbps: cli.link_gbps,
        hop_latency_us: cli.hop_latency_us,
        xoff_bytes: cli.xoff_bytes,
        xon_bytes: cli.xoff_bytes.saturating_sub(cli.xon_gap_bytes),
        rounds: 1,
        seed: cli.seed,
        ..Params::default()
    };
    let (mut max, mut series) = (cli.max_servers, cli.series.clone());
    if cli.quick {
        base.xoff_bytes = 256 << 10;
        base.xon_bytes = 192 << 10;
        base.response_bytes = 16 << 10;
        max = max.min(128);
        series = [8, 32, 96].into_iter().filter(|&n| n <= max).collect();
    }
    if base.xon_bytes == 0 || max == 0 || max > 3000 || base.response_bytes == 0 {
        eprintln!("bad usage: need xoff > xon gap, 1 ≤ max-servers ≤ 3000, response-bytes > 0");
        return ExitCode::from(2);
    }
    let mut windows = Vec::new();
    for (w, _) in PAPER {
        eprintln!("window {}", wname(w));
        match search(&base, w, max) {
            Ok(r) => windows.push(r),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut points = Vec::new();
    for (w, _) in PAPER {
        for &n in &series {
            let p =
                Params { servers: n, window: w, victim: true, rounds: cli.rounds, ..base.clone() };
            match probe_child(&p) {
                Ok(r) => {
                    eprintln!(
                        "  series {:>6} N {:>5}: P50 {:.0} µs P99 {:.0} µs victim {:.2} Gb/s ({:.0} ms)",
                        wname(w),
                        n,
                        r.p50_us,
                        r.p99_us,
                        r.victim_gbps.unwrap_or(0.0),
                        r.wall_ms
                    );
                    points.push(r)
                }
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let report = Report {
        command: std::env::args().collect(),
        base,
        max_servers: max,
        windows,
        series: points,
        wall_s: clock::wall_now().duration_since(wall).as_secs_f64(),
    };
    let md = markdown(&report);
    println!("{md}");
    println!("runtime {:.1} s", report.wall_s);
    if let Some(dir) = &cli.out {
        let json = match serde_json::to_string_pretty(&report) {
            Ok(j) => j,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(dir)?;
            std::fs::write(dir.join("incast.json"), json)?;
            std::fs::write(dir.join("incast.svg"), svg(&report))?;
            std::fs::write(dir.join("incast.md"), &md)
        };
        if let Err(e) = write() {
            eprintln!("writing {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
