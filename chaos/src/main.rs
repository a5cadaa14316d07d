//! `bex-chaos`: the invariant checkers of chaos runs. See `bex-chaos --help`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_chaos::canary::{self, CanaryReport};
use bex_chaos::canary_table;
use bex_chaos::verify::{self, KeySet};
use bex_client::connect_client;
use bex_client::node::ClientRole;
use bex_model::{dense_keys, dense_len, SyntheticClicks, TrainerSection};
use bex_process::exit_with_parent;
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::Config;
use clap::{Args, Parser, Subcommand};

/// Invariant checkers for chaos runs on real processes (`bex-cluster` applies the faults):
/// `canary` pushes countable increments while faults happen; `verify` checks afterwards that
/// no acknowledged push was lost or applied twice and that the replicas converged.
/// Exit codes: 0 ok, 1 an invariant failed or the cluster is unreachable, 2 bad usage/config.
#[derive(Debug, Parser)]
#[command(name = "bex-chaos", version, after_help = bex_process::logging::LOG_HELP)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Args)]
struct Common {
    /// Cluster config (TOML).
    #[arg(long, value_name = "FILE", env = "BEX_CONFIG")]
    config: PathBuf,
    /// Local address the transports bind to: an IP, or `hostname` (what this host's name
    /// resolves to: a container's or pod's own IP).
    #[arg(long, default_value = "127.0.0.1", value_name = "IP", env = "BEX_BIND_IP",
          value_parser = bex_process::identity::parse_ip)]
    bind: IpAddr,
    /// Data-path transport [default: the config's `[transport] kind`].
    #[arg(long, value_enum)]
    transport: Option<TransportKind>,
    /// PS client id, unique in the cluster (a number, or `ordinal`) [default: this process
    /// id above a hash of the host name].
    #[arg(long, value_name = "N", env = "BEX_ID", value_parser = bex_process::identity::parse_here)]
    id: Option<u64>,
    /// Where to write the JSON report.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// No progress on stderr.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Pushes +1 to this client's canary keys (round-robin, one push outstanding per key) and
    /// counts, per key, acknowledged and failed pushes. SIGTERM stops it early (report kept).
    Canary {
        #[command(flatten)]
        common: Common,
        /// This client's mini-pod (accepted for the launcher; pushes go to the training pod).
        #[arg(long, default_value_t = 0)]
        pod: u32,
        /// Seconds to push for.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Canary keys.
        #[arg(long, default_value_t = 64)]
        keys: u32,
        /// Pushes in flight (each to a different key).
        #[arg(long, default_value_t = 8)]
        in_flight: u32,
        /// The canary table: init zeros, optimizer sgd with lr = 1.
        #[arg(long, default_value = "canary")]
        table: String,
        /// Push to the keys every canary with this flag shares, not keys of its own: several
        /// canaries then race on every row under their own identities (each adds to its own
        /// component, so each is counted apart).
        #[arg(long)]
        shared_keys: bool,
        /// The row component this canary adds 1 to [default: --id modulo the table's dim].
        #[arg(long)]
        component: Option<u32>,
    },
    /// Reads every canary key and the trainer's rows from every pod: replicas must converge
    /// within --settle-s, and on the training pod acked ≤ value ≤ acked + failed per key.
    Verify {
        #[command(flatten)]
        common: Common,
        /// A canary report (repeatable).
        #[arg(long = "canary", value_name = "PATH", required = true)]
        canaries: Vec<PathBuf>,
        /// How long replicas may take to converge, seconds.
        #[arg(long, default_value_t = 15.0)]
        settle_s: f64,
    },
}

fn load(path: &Path) -> Result<Config, String> {
    let cfg = Config::load(path).map_err(|e| e.to_string())?;
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// The trainer's rows (embedding keys of its task, its dense rows), from `[trainer]` read as
/// the trainer reads it (its type and defaults, `bex_model::TrainerSection`).
fn trainer_sets(cfg: &Config) -> Result<Vec<KeySet>, String> {
    let t = TrainerSection::from_toml(&cfg.trainer).map_err(|e| format!("[trainer]: {e}"))?;
    let find = |name: &str| {
        cfg.tables
            .iter()
            .position(|x| x.name == name)
            .map(|i| (i as u32, cfg.tables[i].dim))
            .ok_or_else(|| format!("[trainer] table {name:?} is not in the config"))
    };
    let (table, dim) = find(&t.table)?;
    let (dense, dense_dim) = find(&t.dense_table)?;
    // The verifier reads every id it names: at most 2^20 a slot (the trainer allows 2^40).
    let vocab = t.vocab.min(1 << 20);
    let keys =
        (0..t.slots).flat_map(|s| (0..vocab).map(move |r| SyntheticClicks::key(s, r))).collect();
    let n = dense_len(t.slots, dim as usize, t.hidden);
    Ok(vec![
        KeySet { name: "trainer embeddings".into(), table, dim, keys },
        KeySet {
            name: "trainer dense".into(),
            table: dense,
            dim: dense_dim,
            keys: dense_keys(t.model_id, n, dense_dim as usize),
        },
    ])
}

fn write_json(path: &Option<PathBuf>, v: &impl serde::Serialize) -> Result<(), String> {
    if let Some(p) = path {
        let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
        std::fs::write(p, text).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

async fn run(cli: Cli) -> Result<bool, (u8, String)> {
    let usage = |e: String| (2u8, e);
    match cli.cmd {
        Cmd::Canary { common, pod: _, seconds, keys, in_flight, table, shared_keys, component } => {
            let cfg = load(&common.config).map_err(usage)?;
            let t = canary_table(&cfg, &table).map_err(usage)?;
            if !(seconds.is_finite() && seconds > 0.0) || keys == 0 || in_flight == 0 {
                return Err(usage("--seconds, --keys and --in-flight must be positive".into()));
            }
            let k = common.transport.unwrap_or(cfg.transport.kind);
            let id = common.id.unwrap_or_else(bex_process::identity::default_client_id);
            let component = component.unwrap_or((id % u64::from(t.1)) as u32);
            if component >= t.1 {
                return Err(usage(format!(
                    "--component {component}: the canary table's rows have {} components",
                    t.1
                )));
            }
            let topo = cfg.topology().map_err(|e| usage(e.to_string()))?;
            let node =
                connect_client(&cfg, topo.training_pod(), common.bind, k, id, ClientRole::Training)
                    .await
                    .map_err(|e| (1, e.to_string()))?;
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            tokio::spawn(async move {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
                tokio::select! {
                    _ = async { if let Some(t) = term.as_mut() { t.recv().await; } else { std::future::pending::<()>().await } } => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                s.store(true, Ordering::Relaxed);
            });
            let owner = (!shared_keys).then(|| node.ps.push_id());
            let target = canary::Target { table: t, owner, keys, component };
            let mut report = canary::run(node.ps.clone(), target, in_flight, seconds, stop).await;
            report.transport = k;
            write_json(&common.json, &report).map_err(|e| (1, e))?;
            println!(
                "canary {id} over {}: {} pushes acknowledged, {} failed, {} keys, {:.1} s{}",
                report.transport,
                report.acked,
                report.failed,
                report.keys.len(),
                report.elapsed_s,
                report
                    .first_error
                    .as_deref()
                    .map(|e| format!("; first error: {e}"))
                    .unwrap_or_default()
            );
            Ok(report.acked > 0 && report.workers_lost == 0)
        }
        Cmd::Verify { common, canaries, settle_s } => {
            let cfg = load(&common.config).map_err(usage)?;
            let mut reports = Vec::new();
            for p in &canaries {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| usage(format!("{}: {e}", p.display())))?;
                let r: CanaryReport = serde_json::from_str(&text)
                    .map_err(|e| usage(format!("{}: {e}", p.display())))?;
                reports.push(r);
            }
            let sets = trainer_sets(&cfg).map_err(usage)?;
            let k = common.transport.unwrap_or(cfg.transport.kind);
            let id = common.id.unwrap_or_else(bex_process::identity::default_client_id);
            let topo = cfg.topology().map_err(|e| usage(e.to_string()))?;
            let node =
                connect_client(&cfg, topo.training_pod(), common.bind, k, id, ClientRole::Serving)
                    .await
                    .map_err(|e| (1, e.to_string()))?;
            let settle = Duration::from_secs_f64(settle_s.clamp(0.0, 3600.0));
            let report = verify::run(node.ps.clone(), &reports, &sets, settle).await;
            write_json(&common.json, &report).map_err(|e| (1, e))?;
            for i in &report.invariants {
                println!("{} {}: {}", if i.ok { "HOLDS " } else { "BROKEN" }, i.name, i.detail);
            }
            if !common.quiet {
                eprintln!(
                    "bex-chaos verify: {}",
                    if report.ok { "every invariant holds" } else { "VIOLATION" }
                );
            }
            Ok(report.ok)
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    bex_process::logging::init();
    exit_with_parent();
    match run(Cli::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err((code, e)) => {
            eprintln!("bex-chaos: {e}");
            ExitCode::from(code)
        }
    }
}
