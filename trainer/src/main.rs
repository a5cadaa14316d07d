//! `trainer`: one asynchronous data-parallel trainer of a synthetic click model whose
//! embedding rows and dense MLP weights live on the bex parameter server.
//!
//! ```text
//! trainer --config configs/local.toml --id 1 --json target/trainer-1.json
//! ```
//!
//! Each step fetches the batch's rows and the dense weights, runs forward/backward, and
//! pushes row and dense gradients; the PS applies the optimizers, so any number of trainers
//! (distinct `--id`s) train one model. Held-out AUC and log-loss are printed as they improve
//! and reported with fetch/push latency, message sizes and RPC/RNIC counters at the end.

use bex_process::exit;
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_client::connect_client;
use bex_client::node::ClientRole;
use bex_process::{exit_with_parent, CpuTimes};
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::metrics::{Counter, Gauge, MetricsError, Registry};
use bex_ps_proto::Config;
use bex_report::{counters, EvalPoint, TrainerReport};
use bex_trainer::clock;
use bex_trainer::settings::{Overrides, Settings};
use bex_trainer::store::PsStore;
use bex_trainer::train::{Stats, Trainer};
use clap::Parser;

/// Trains a synthetic click model (embeddings + MLP) against a bex PS cluster.
///
/// Run-length, batch and model defaults come from the `[trainer]` section of the cluster
/// file (keys documented in configs/local.toml); options given here override them. Exit
/// codes: 0 done (or interrupted by SIGINT/SIGTERM after a final evaluation and report),
/// 1 runtime failure (cluster unreachable, more than half the steps failed), 2 bad usage or
/// configuration (also a --json path that cannot be written).
#[derive(Debug, Parser)]
#[command(name = "trainer", version, after_help = bex_process::logging::LOG_HELP)]
struct Args {
    /// Cluster configuration (TOML; see configs/local.toml).
    #[arg(long, value_name = "FILE", env = "BEX_CONFIG")]
    config: PathBuf,
    /// This trainer's mini-pod (replicas there are read first); default: the training pod.
    #[arg(long, value_name = "P", env = "BEX_POD", value_parser = bex_process::identity::parse_here_u32)]
    pod: Option<u32>,
    /// Local IP the trainer's RDMA (software RNIC) and TCP transports bind to, or `hostname`
    /// (what this host's name resolves to: a container's or pod's own IP).
    #[arg(long, value_name = "IP", default_value = "127.0.0.1", env = "BEX_BIND_IP",
          value_parser = bex_process::identity::parse_ip)]
    bind: IpAddr,
    /// Transport for requests; default: the config's `[transport].kind`.
    #[arg(long, value_enum)]
    transport: Option<TransportKind>,
    /// Trainer id: names it in logs and reports and is the default training-stream seed. A
    /// restart may reuse it: pushes are deduplicated under a fresh random identity per
    /// start (reported as `push_id`), so a restarted trainer's pushes are applied. A
    /// number, or `ordinal` (the number ending the host name, as a StatefulSet names pods).
    #[arg(long, value_name = "N", default_value = "1", env = "BEX_ID",
          value_parser = bex_process::identity::parse_here)]
    id: u64,
    /// Train this many steps (default: `[trainer].steps`).
    #[arg(long, value_name = "N", conflicts_with = "seconds")]
    steps: Option<u64>,
    /// Train for this many seconds instead of a step count.
    #[arg(long, value_name = "S")]
    seconds: Option<f64>,
    /// Mean samples per step (batch sizes vary log-normally around it with
    /// `[trainer].batch_sigma`).
    #[arg(long, value_name = "N")]
    batch_size: Option<usize>,
    /// Evaluate on the held-out set every N steps (0: only at start and end).
    #[arg(long, value_name = "N")]
    eval_every: Option<u64>,
    /// Seed of this trainer's training stream and batch sizes (default: --id). The ground
    /// truth and held-out set are shared by all trainers (`[trainer].data_seed`).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Write the JSON report here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
    /// Serve Prometheus `/metrics` (and `/health`) on ADDR while running (e.g.
    /// 0.0.0.0:9102; port 0 takes a free one, named on stderr): steps, samples, held-out
    /// AUC, PS calls, RPC client, transports, NIC, process.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

/// What a running trainer exports about its progress (`--metrics`).
struct TrainerMetrics {
    steps: Counter,
    failed_steps: Counter,
    samples: Counter,
    auc: Gauge,
    log_loss: Gauge,
}

impl TrainerMetrics {
    fn register(reg: &Registry) -> Result<TrainerMetrics, MetricsError> {
        Ok(TrainerMetrics {
            steps: reg.counter("bex_trainer_steps_total", "Training steps taken", &[])?,
            failed_steps: reg.counter(
                "bex_trainer_failed_steps_total",
                "Steps whose fetch or push failed",
                &[],
            )?,
            samples: reg.counter("bex_trainer_samples_total", "Samples trained on", &[])?,
            auc: reg.gauge(
                "bex_trainer_auc",
                "AUC on the held-out set at the last evaluation",
                &[],
            )?,
            log_loss: reg.gauge(
                "bex_trainer_log_loss",
                "Log loss on the held-out set at the last evaluation",
                &[],
            )?,
        })
    }

    /// Brings the counters to the trainer's totals.
    fn update(&self, st: &Stats) {
        self.steps.add(st.steps.saturating_sub(self.steps.get()));
        self.failed_steps.add(st.errors.saturating_sub(self.failed_steps.get()));
        self.samples.add(st.samples.saturating_sub(self.samples.get()));
    }

    fn evaluated(&self, p: &EvalPoint) {
        self.auc.set(p.auc);
        self.log_loss.set(p.log_loss);
    }
}

/// The binary's name in its messages.
const TOOL: &str = "trainer";

fn main() {
    bex_process::logging::init();
    exit_with_parent();
    let args = Args::parse();
    let cfg = Config::load(&args.config).unwrap_or_else(|e| exit::usage(TOOL, e));
    let overrides = Overrides {
        steps: args.steps,
        seconds: args.seconds,
        batch_size: args.batch_size,
        eval_every: args.eval_every,
    };
    let settings = Settings::resolve(&cfg, &overrides).unwrap_or_else(|e| exit::usage(TOOL, e));
    let pod = args.pod.unwrap_or(cfg.cluster.training_pod);
    if pod >= cfg.cluster.pods {
        exit::usage(TOOL, format!("--pod {pod}: the cluster has {} pods", cfg.cluster.pods));
    }
    if let Some(path) = &args.json {
        exit::writable_output(TOOL, path);
    }
    let rt = exit::runtime(TOOL, cfg.transport.app_threads);
    let code = rt.block_on(run(args, cfg, settings, pod));
    std::process::exit(code);
}

/// How long a step or the final evaluation in flight when SIGINT/SIGTERM arrives may go
/// on: a push can retry for `push_retry_ms` (10 s) against a server that is down, and a
/// launcher waits 5 s for the report before its SIGKILL.
const STOPPING_CAP: Duration = Duration::from_secs(2);

/// SIGINT or SIGTERM asked the run to stop.
struct Stop {
    flag: Arc<AtomicBool>,
    asked: tokio::sync::watch::Receiver<bool>,
}

impl Stop {
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Waits until a stop is asked for.
    async fn asked(&mut self) {
        // An error means the signal task is gone: no stop will come.
        if self.asked.wait_for(|&s| s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// `f` to its end, or, once a stop is asked for, at most [`STOPPING_CAP`] more of it.
    async fn bounded<T>(&mut self, f: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::pin!(f);
        if self.is_set() {
            return tokio::time::timeout(STOPPING_CAP, f).await.ok();
        }
        tokio::select! {
            biased;
            v = &mut f => Some(v),
            () = self.asked() => tokio::time::timeout(STOPPING_CAP, f).await.ok(),
        }
    }
}

/// Watches SIGINT and SIGTERM.
fn stop_on_signals() -> std::io::Result<Stop> {
    use tokio::signal::unix::{signal, SignalKind};
    let flag = Arc::new(AtomicBool::new(false));
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let (tx, asked) = tokio::sync::watch::channel(false);
    let set = flag.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        set.store(true, Ordering::SeqCst);
        let _ = tx.send(true);
        // Kept: a dropped sender would end the receivers' waits.
        std::future::pending::<()>().await;
    });
    Ok(Stop { flag, asked })
}

async fn run(args: Args, cfg: Config, settings: Settings, pod: u32) -> i32 {
    let mut stop =
        stop_on_signals().unwrap_or_else(|e| exit::failure(TOOL, format!("signals: {e}")));
    let kind = args.transport.unwrap_or(cfg.transport.kind);
    let client = connect_client(&cfg, pod, args.bind, kind, args.id, ClientRole::Training)
        .await
        .unwrap_or_else(|e| exit::with(TOOL, e.exit_code, format!("starting the client: {e}")));
    let metrics = client
        .export_metrics(&format!("{TOOL} {}", args.id), args.metrics, TrainerMetrics::register)
        .await
        .unwrap_or_else(|e| exit::failure(TOOL, e));
    let store = PsStore(client.ps.clone());
    let seed = args.seed.unwrap_or(args.id);
    let s = settings.section.clone();
    let mut trainer = Trainer::new(settings, seed);
    let cpu0 = CpuTimes::of_self().unwrap_or_default();

    // The first fetch doubles as the reachability check: retried until the deadline, since
    // a launcher may start trainers while the servers are still coming up.
    let deadline = clock::now() + Duration::from_secs_f64(s.connect_deadline_s);
    let (auc0, ll0) = loop {
        let left = deadline.saturating_duration_since(clock::now());
        let err = match tokio::time::timeout(left, trainer.evaluate(&store)).await {
            Ok(Ok(v)) => break v,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer".to_string(),
        };
        if stop.is_set() {
            // Nothing trained, nothing to report: say so, not "unreachable".
            exit::failure(TOOL, format!("interrupted before the cluster answered ({err})"));
        }
        if clock::now() >= deadline {
            exit::failure(
                TOOL,
                format!(
                    "cluster unreachable: the first fetch did not succeed within {} s ({err})",
                    s.connect_deadline_s
                ),
            );
        }
        // Slow enough that connection failures do not reach the quarantine threshold.
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let start = clock::now();
    let mut eval =
        vec![EvalPoint { step: 0, samples: 0, elapsed_s: 0.0, auc: auc0, log_loss: ll0 }];
    let mut eval_errors = 0u64;
    let progress = |p: &EvalPoint, t: &Trainer| {
        if let Some(m) = &metrics {
            m.update(&t.stats);
            m.evaluated(p);
        }
        if !args.quiet {
            let f = t.stats.fetch.summary();
            let sps = if p.elapsed_s > 0.0 { p.samples as f64 / p.elapsed_s } else { 0.0 };
            eprintln!(
                "trainer {}: step={} samples/s={:.0} loss={:.4} auc={:.4} fetch_p99={:.0}us errors={}",
                args.id, p.step, sps, p.log_loss, p.auc, f.p99_us, t.stats.errors
            );
        }
    };
    progress(&eval[0], &trainer);
    let time_bound = (s.seconds > 0.0).then(|| start + Duration::from_secs_f64(s.seconds));
    loop {
        let steps = trainer.stats.steps;
        let done = match time_bound {
            Some(end) => clock::now() >= end,
            None => steps >= s.steps,
        };
        if done || stop.is_set() {
            break;
        }
        // A step cut off by the cap counts as begun, not as failed: the run is ending.
        stop.bounded(trainer.step(&store)).await;
        if let Some(m) = &metrics {
            m.update(&trainer.stats);
        }
        if stop.is_set() {
            break;
        }
        let steps = trainer.stats.steps;
        if s.eval_every > 0 && steps % s.eval_every == 0 {
            match trainer.evaluate(&store).await {
                Ok((auc, log_loss)) => {
                    let p = EvalPoint {
                        step: steps,
                        samples: trainer.stats.samples,
                        elapsed_s: start.elapsed().as_secs_f64(),
                        auc,
                        log_loss,
                    };
                    progress(&p, &trainer);
                    eval.push(p);
                }
                Err(_) => eval_errors += 1,
            }
        }
    }
    let elapsed_s = start.elapsed().as_secs_f64();
    let st = &trainer.stats;
    let needs_final = eval.last().is_none_or(|p| p.step != st.steps);
    if needs_final {
        match stop.bounded(trainer.evaluate(&store)).await {
            Some(Ok((auc, log_loss))) => {
                let st = &trainer.stats;
                let p = EvalPoint { step: st.steps, samples: st.samples, elapsed_s, auc, log_loss };
                progress(&p, &trainer);
                eval.push(p);
            }
            _ => eval_errors += 1,
        }
    }
    let last = eval.last().cloned().unwrap_or(eval[0].clone());
    let st = &trainer.stats;
    let ok_steps = st.steps - st.errors;
    let report = TrainerReport {
        id: args.id,
        push_id: client.ps.push_id(),
        transport: client.kind,
        table: trainer.settings().emb.name.clone(),
        dense_table: trainer.settings().dense.name.clone(),
        seed,
        batch_size: s.batch_size,
        steps: st.steps,
        samples: st.samples,
        elapsed_s,
        samples_per_s: if elapsed_s > 0.0 { st.samples as f64 / elapsed_s } else { 0.0 },
        steps_per_s: if elapsed_s > 0.0 { st.steps as f64 / elapsed_s } else { 0.0 },
        train_loss_mean: if ok_steps > 0 { st.train_loss_sum / ok_steps as f64 } else { 0.0 },
        fetch_latency: st.fetch.summary(),
        push_latency: st.push.summary(),
        auc_initial: auc0,
        auc_final: last.auc,
        log_loss_initial: ll0,
        log_loss_final: last.log_loss,
        eval_samples: s.eval_samples,
        eval,
        message_bytes: st.sizes.report(),
        errors: st.errors,
        push_retries: client.ps.push_retries(),
        last_error: st.last_error.clone(),
        eval_errors,
        rpc: counters(&client.ps.rpc().stats().snapshot()),
        rnic: counters(&client.stack.nic_stats()),
        cpu: CpuTimes::of_self().unwrap_or_default().since(&cpu0),
        interrupted: stop.is_set(),
    };
    // The summary first: a report that then cannot be written (a full disk) loses no figure.
    let _ = writeln!(std::io::stdout(), "{}", report.summary());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)
            .unwrap_or_else(|e| exit::failure(TOOL, format!("report: {e}")));
        if let Err(e) = std::fs::write(path, text + "\n") {
            exit::failure(TOOL, format!("writing {}: {e}", path.display()));
        }
    }
    if st.errors * 2 > st.steps {
        tracing::error!(
            failed = st.errors,
            steps = st.steps,
            last_error = ?st.last_error,
            "more than half of the steps failed"
        );
        return 1;
    }
    0
}
