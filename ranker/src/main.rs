//! `ranker`: replays synthetic ranking traffic against a bex PS cluster and reports latency,
//! throughput, CPU and transport counters. See `ranker --help`.

use bex_process::exit;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bex_client::connect_client;
use bex_client::node::ClientRole;
use bex_process::{exit_with_parent, CpuTimes, SystemCpu};
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::Config;
use bex_ranker::report::{self, RunInfo, TraceInfo};
use bex_ranker::run::{run, Ranker, RankerMetrics, RunOptions, Schedule, Snapshot};
use bex_ranker::settings::{Overrides, Settings};
use clap::Parser;

/// Replays synthetic inference traffic against a bex PS cluster: open-loop Poisson arrivals
/// (or a trace), each request fanning out to k models whose embedding rows are fetched from
/// every touched shard concurrently, pooled and scored by a small MLP whose dense weights also
/// live on the PS. Prints a progress line per second on stderr and a summary at the end.
///
/// Defaults come from the `[ranker]` section of the cluster config (see configs/local.toml);
/// options given here override them. Exit codes: 0 done (also after SIGINT/SIGTERM, with
/// `"interrupted": true` in the report), 1 runtime failure (cluster unreachable, or no
/// request succeeded), 2 bad usage or config (also a --json path that cannot be written).
#[derive(Debug, Parser)]
#[command(name = "ranker", version, after_help = bex_process::logging::LOG_HELP)]
struct Cli {
    /// Cluster config (TOML): topology, tables, transport, rpc and the `[ranker]` section.
    #[arg(long, value_name = "FILE", env = "BEX_CONFIG")]
    config: PathBuf,
    /// This client's mini-pod: its replicas are asked first (a number, or `ordinal`: the
    /// number ending the host name).
    #[arg(long, default_value = "0", value_name = "P", env = "BEX_POD",
          value_parser = bex_process::identity::parse_here_u32)]
    pod: u32,
    /// Local address the client's transports bind to (ephemeral ports): an IP, or
    /// `hostname` (what this host's name resolves to: a container's or pod's own IP).
    #[arg(long, default_value = "127.0.0.1", value_name = "IP", env = "BEX_BIND_IP",
          value_parser = bex_process::identity::parse_ip)]
    bind: IpAddr,
    /// Data-path transport [default: the config's `[transport] kind`]. rdma falls back to
    /// tcp per destination when RDMA fails.
    #[arg(long, value_enum, value_name = "KIND")]
    transport: Option<TransportKind>,
    /// PS client id, unique among the cluster's clients (a number, or `ordinal`: the number
    /// ending the host name) [default: this process id above a hash of the host name].
    #[arg(long, value_name = "N", env = "BEX_ID", value_parser = bex_process::identity::parse_here)]
    id: Option<u64>,
    /// Arrival rate, requests per second [default: `[ranker] rate`, 200]; a --trace sets its own.
    #[arg(long, value_name = "R")]
    rate: Option<f64>,
    /// Measured run length in seconds [default: `[ranker] seconds`, 10]; a --trace runs to its
    /// last request.
    #[arg(long, value_name = "S")]
    seconds: Option<f64>,
    /// Unmeasured warm-up before the measured run, seconds [default: `[ranker]
    /// warmup_seconds`, 0]. With --trace, the trace's first S seconds are the warm-up.
    #[arg(long, value_name = "S")]
    warmup_seconds: Option<f64>,
    /// Requests in flight at most; arrivals beyond it are dropped and counted as errors
    /// [default: `[ranker] max_outstanding`, 256].
    #[arg(long, value_name = "N")]
    max_outstanding: Option<u32>,
    /// Seed of the requests and arrivals [default: `[ranker] seed`, 1].
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Replay this trace (JSON lines of `bex_traffic::TraceRecord`) instead of generating
    /// arrivals; its requests must fit the configured models.
    #[arg(long, value_name = "FILE", conflicts_with = "generate_trace")]
    trace: Option<PathBuf>,
    /// Write a trace of warm-up + seconds at the rate (same traffic a live run with this
    /// seed sends) to FILE and exit, without contacting the cluster.
    #[arg(long, value_name = "FILE")]
    generate_trace: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// No per-second progress line on stderr.
    #[arg(long)]
    quiet: bool,
    /// Serve Prometheus `/metrics` (and `/health`) on ADDR while running (e.g.
    /// 0.0.0.0:9101; port 0 takes a free one, named on stderr): requests, PS calls, RPC
    /// client, transports, NIC, process.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

/// The binary's name in its messages.
const TOOL: &str = "ranker";

fn main() {
    bex_process::logging::init();
    exit_with_parent();
    let cli = Cli::parse();
    let cfg = Config::load(&cli.config).unwrap_or_else(|e| exit::usage(TOOL, e));
    let over = Overrides {
        rate: cli.rate,
        seconds: cli.seconds,
        warmup_seconds: cli.warmup_seconds,
        max_outstanding: cli.max_outstanding,
        seed: cli.seed,
    };
    let settings =
        Arc::new(Settings::from_config(&cfg, &over).unwrap_or_else(|e| exit::usage(TOOL, e)));

    if let Some(path) = &cli.generate_trace {
        let dur = Duration::from_secs_f64(settings.raw.seconds + settings.raw.warmup_seconds);
        let trace = bex_traffic::generate_trace(
            settings.spec.clone(),
            settings.raw.rate,
            dur,
            settings.raw.seed,
        )
        .unwrap_or_else(|e| exit::usage(TOOL, e));
        bex_traffic::write_trace_file(path, &trace)
            .unwrap_or_else(|e| exit::failure(TOOL, format!("{}: {e}", path.display())));
        println!(
            "wrote {} requests over {:.1} s to {}",
            trace.len(),
            dur.as_secs_f64(),
            path.display()
        );
        return;
    }
    let (schedule, trace_info) = match &cli.trace {
        Some(path) => {
            let trace = bex_traffic::read_trace_file(path).unwrap_or_else(|e| exit::usage(TOOL, e));
            for (i, r) in trace.iter().enumerate() {
                if let Err(e) = settings.check_request(&r.request) {
                    exit::usage(TOOL, format!("{} line {}: {e}", path.display(), i + 1));
                }
            }
            let warmup = Duration::from_secs_f64(settings.raw.warmup_seconds);
            let info = TraceInfo::of(path, &trace, warmup);
            (Schedule::Trace(trace.into_iter()), Some(info))
        }
        None => (Schedule::generated(&settings).unwrap_or_else(|e| exit::usage(TOOL, e)), None),
    };
    let kind = cli.transport.unwrap_or(cfg.transport.kind);
    let client_id = cli.id.unwrap_or_else(bex_process::identity::default_client_id);

    if let Some(path) = &cli.json {
        exit::writable_output(TOOL, path);
    }
    let rt = exit::runtime(TOOL, cfg.transport.app_threads);
    let code = rt.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let signals = tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) =
                (signal(SignalKind::interrupt()), signal(SignalKind::terminate()))
            else {
                tracing::warn!(
                    "cannot install signal handlers: SIGTERM will not stop the run cleanly"
                );
                return stop_tx;
            };
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            let _ = stop_tx.send(true);
            // Keep the sender alive: a dropped sender would look like a change forever.
            stop_tx
        });

        let client = connect_client(&cfg, cli.pod, cli.bind, kind, client_id, ClientRole::Serving)
            .await
            .unwrap_or_else(|e| exit::with(TOOL, e.exit_code, format!("starting the client: {e}")));
        let metrics = client
            .export_metrics(TOOL, cli.metrics, RankerMetrics::register)
            .await
            .unwrap_or_else(|e| exit::failure(TOOL, e));
        let ranker = Ranker::connect(client.ps.clone(), settings.clone(), Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| {
                exit::failure(
                    TOOL,
                    format!("cluster unreachable (dense weights not fetched in 10 s): {e}"),
                )
            });
        let (ps, client) = (client.ps.clone(), Arc::new(client));
        let snapshot = move || Snapshot {
            cpu: CpuTimes::of_self().unwrap_or_default(),
            system: SystemCpu::read().unwrap_or_default(),
            rpc: ps.rpc().stats().snapshot(),
            rnic: client.stack.nic_stats(),
        };
        let opts = RunOptions {
            quiet: cli.quiet,
            metrics,
            drain: Duration::from_secs(10),
            drain_interrupted: Duration::from_secs(2),
        };
        let out = run(ranker.clone(), schedule, opts, snapshot, stop_rx).await;
        signals.abort();
        let info = RunInfo {
            transport: kind,
            config: cli.config.display().to_string(),
            pod: cli.pod,
            client_id,
            trace: trace_info,
            dense_refreshes: (
                ranker.dense_refreshes.load(Ordering::Relaxed),
                ranker.dense_refresh_failures.load(Ordering::Relaxed),
            ),
        };
        let json = report::build(&settings, &info, &out);
        // The summary first: a report that then cannot be written (a full disk) loses no
        // figure. stdout may be a closed pipe (`| head`).
        let _ = writeln!(std::io::stdout(), "{}", report::summary(&json));
        if let Some(path) = &cli.json {
            let text = serde_json::to_string_pretty(&json)
                .unwrap_or_else(|e| exit::failure(TOOL, format!("report: {e}")));
            std::fs::write(path, text + "\n")
                .unwrap_or_else(|e| exit::failure(TOOL, format!("{}: {e}", path.display())));
        }
        // Answering nothing is a failed run, not a measurement of one (a launcher reading
        // only the status said OK).
        if json.requests > 0 && json.ok == 0 {
            tracing::error!(requests = json.requests, errors = json.errors, "no request succeeded");
            return 1;
        }
        0
    });
    // The transports' threads need no orderly shutdown: the report is written.
    std::process::exit(code);
}
