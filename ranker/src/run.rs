//! The load driver: open-loop arrivals (generated or from a trace), one task per request
//! fanning out to its models (each model's tables fetched concurrently; each fetch split by
//! shard by the PS client), scoring with the current dense weights, and a collector that
//! records completions, prints progress and builds the report.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bex_client::fanout::{PsClient, PsError};
use bex_ps_proto::metrics as prom;
use bex_rpc::RpcError;
use bex_traffic::{
    Arrivals, Completion, ModelRequest, Outcome, Recorder, Request, RequestGen, TraceRecord,
};
use hdrhistogram::Histogram;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::mlp::{pool, Mlp};
use crate::settings::{feature_key, ModelShape, Settings};

/// Seed offset of the arrivals stream: the same as `bex_traffic::generate_trace`, so a live
/// run and `--generate-trace` with the same seed send the same traffic.
const ARRIVAL_SEED_XOR: u64 = 0x9e37_79b9_7f4a_7c15;

/// tokio's timer rounds a deadline up to its millisecond tick and the driver's wait rounds up
/// again: measured, launches came ≈ 1.1 ms after the deadline. Aiming this much early centres
/// them on the arrival time (± 1 ms of jitter on the Poisson schedule); latency is measured
/// from the later of arrival and launch, so an early launch never shortens it.
const TIMER_SLACK: Duration = Duration::from_millis(1);

/// The ranker's shared state: the PS client, the models, and their current dense weights.
#[derive(Debug)]
pub struct Ranker {
    ps: Arc<PsClient>,
    settings: Arc<Settings>,
    weights: RwLock<Arc<Vec<Mlp>>>,
    /// Successful refreshes after the first fetch.
    pub dense_refreshes: AtomicU64,
    /// Failed refreshes (the previous weights stay in use).
    pub dense_refresh_failures: AtomicU64,
}

/// Fetches every model's dense weights, all models concurrently.
pub async fn fetch_dense(ps: &Arc<PsClient>, s: &Settings) -> Result<Vec<Mlp>, String> {
    let mut tasks = Vec::new();
    for m in &s.models {
        let (ps, n, dim, table) = (ps.clone(), m.dense_len(), s.dense_dim, s.dense_table);
        let (model, input, hidden) = (m.model, m.input_len(), m.hidden);
        tasks.push(tokio::spawn(async move {
            let keys = bex_model::dense_keys(model, n, dim);
            let flat = ps
                .fetch(table, dim as u32, &keys)
                .await
                .map_err(|e| format!("dense weights of model {model}: {e}"))?;
            Mlp::from_flat(&flat, input, hidden)
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.map_err(|e| format!("dense fetch task: {e}"))??);
    }
    Ok(out)
}

impl Ranker {
    /// Fetches the dense weights, retrying until `deadline` (the cluster may still be coming
    /// up); the last error if it never succeeds.
    pub async fn connect(
        ps: Arc<PsClient>,
        settings: Arc<Settings>,
        deadline: Duration,
    ) -> Result<Arc<Ranker>, String> {
        let until = Instant::now() + deadline;
        let weights = loop {
            match tokio::time::timeout_at(until, fetch_dense(&ps, &settings)).await {
                Ok(Ok(w)) => break w,
                Ok(Err(e)) if Instant::now() + Duration::from_millis(250) < until => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(format!("no answer within {deadline:?}")),
            }
        };
        Ok(Arc::new(Ranker {
            ps,
            settings,
            weights: RwLock::new(Arc::new(weights)),
            dense_refreshes: AtomicU64::new(0),
            dense_refresh_failures: AtomicU64::new(0),
        }))
    }

    fn weights(&self) -> Arc<Vec<Mlp>> {
        // A poisoned lock only means a panicking writer; the Arc inside is still whole.
        self.weights.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Refreshes the dense weights every `dense_refresh_s`, forever (abort the task).
    pub async fn refresh_loop(self: Arc<Self>) {
        let every = Duration::from_secs_f64(self.settings.raw.dense_refresh_s);
        loop {
            tokio::time::sleep(every).await;
            match fetch_dense(&self.ps, &self.settings).await {
                Ok(w) => {
                    *self.weights.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(w);
                    self.dense_refreshes.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    self.dense_refresh_failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Serves one model's part of a request: fetch (one PS fetch per table, concurrently),
    /// pool, score.
    async fn serve_model(self: Arc<Self>, m: ModelRequest, candidates: u32) -> ModelResult {
        let Some(shape) = self.settings.models.get(m.model as usize) else {
            return ModelResult::failed(Outcome::Error, format!("unknown model {}", m.model));
        };
        let started = Instant::now();
        // Slots grouped by table: one fetch per table, keys concatenated in slot order.
        let mut by_table: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, s) in shape.slots.iter().enumerate() {
            by_table.entry(s.table).or_default().push(i);
        }
        let nslots = shape.slots.len() as u32;
        let mut tasks = Vec::new();
        let (mut sent, mut received) = (0u64, 0u64);
        for (&table, slots) in &by_table {
            let dim = shape.slots[slots[0]].dim;
            let mut keys = Vec::new();
            for &i in slots {
                let feature = m.model * nslots + i as u32;
                keys.extend(m.slots[i].ids.iter().map(|&id| feature_key(feature, id)));
            }
            // Payload bytes: the PS client sends each distinct key once and gets a row back.
            let mut uniq = keys.clone();
            uniq.sort_unstable();
            uniq.dedup();
            sent += bex_ps_proto::wire::fetch_request_len(uniq.len()) as u64;
            received += (uniq.len() * dim * 4) as u64;
            let ps = self.ps.clone();
            tasks.push(tokio::spawn(async move { ps.fetch(table, dim as u32, &keys).await }));
        }
        let mut rows: Vec<Option<Vec<f32>>> = Vec::new();
        let mut failure = None;
        for t in tasks {
            match t.await {
                Ok(Ok(r)) => rows.push(Some(r)),
                Ok(Err(e)) => {
                    failure.get_or_insert((classify(&e), e.to_string()));
                    rows.push(None);
                }
                Err(e) => {
                    failure.get_or_insert((Outcome::Error, e.to_string()));
                    rows.push(None);
                }
            }
        }
        let fetch = started.elapsed();
        if let Some((outcome, message)) = failure {
            return ModelResult { fetch, sent, received, outcome, error: Some(message) };
        }
        // Each slot's slice of its table's rows, in slot order.
        let mut per_slot: Vec<&[f32]> = vec![&[]; shape.slots.len()];
        for ((_, slots), r) in by_table.iter().zip(&rows) {
            let r = r.as_deref().unwrap_or(&[]);
            let mut at = 0;
            for &i in slots {
                let n = m.slots[i].ids.len() * shape.slots[i].dim;
                per_slot[i] = r.get(at..at + n).unwrap_or(&[]);
                at += n;
            }
        }
        let outcome = score(shape, &self.weights()[m.model as usize], &per_slot, candidates);
        match outcome {
            Ok(_) => ModelResult { fetch, sent, received, outcome: Outcome::Ok, error: None },
            Err(e) => {
                ModelResult { fetch, sent, received, outcome: Outcome::Error, error: Some(e) }
            }
        }
    }

    /// Serves a whole request: its models concurrently.
    pub async fn serve(self: Arc<Self>, r: Request) -> RequestResult {
        let candidates = r.candidates;
        let tasks: Vec<_> = r
            .models
            .into_iter()
            .map(|m| tokio::spawn(self.clone().serve_model(m, candidates)))
            .collect();
        let mut out = RequestResult {
            outcome: Outcome::Ok,
            sub: Vec::with_capacity(tasks.len()),
            sent: 0,
            received: 0,
            error: None,
        };
        for t in tasks {
            let m = t.await.unwrap_or_else(|e| {
                ModelResult::failed(Outcome::Error, format!("model task: {e}"))
            });
            out.sent += m.sent;
            out.received += m.received;
            if m.outcome == Outcome::Ok {
                out.sub.push(m.fetch);
            } else if out.outcome == Outcome::Ok {
                out.outcome = m.outcome;
                out.error = m.error;
            }
        }
        out
    }
}

/// Scores a model's candidates; the best candidate's index.
fn score(shape: &ModelShape, mlp: &Mlp, rows: &[&[f32]], candidates: u32) -> Result<usize, String> {
    let x = pool(&shape.slots, rows, candidates as usize)?;
    let z = mlp.forward(x.view());
    Ok(z.iter().enumerate().fold(0, |best, (i, v)| if *v > z[best] { i } else { best }))
}

fn classify(e: &PsError) -> Outcome {
    match e {
        PsError::Rpc(RpcError::Timeout(_)) => Outcome::Timeout,
        _ => Outcome::Error,
    }
}

#[derive(Debug)]
struct ModelResult {
    fetch: Duration,
    sent: u64,
    received: u64,
    outcome: Outcome,
    error: Option<String>,
}

impl ModelResult {
    fn failed(outcome: Outcome, error: String) -> Self {
        Self { fetch: Duration::ZERO, sent: 0, received: 0, outcome, error: Some(error) }
    }
}

/// How a request went.
#[derive(Debug)]
pub struct RequestResult {
    /// Ok unless a model failed (the first failure's kind).
    pub outcome: Outcome,
    /// Per successful model: its fetch latency.
    pub sub: Vec<Duration>,
    /// Request payload bytes.
    pub sent: u64,
    /// Response payload bytes.
    pub received: u64,
    /// The first failure.
    pub error: Option<String>,
}

/// Where arrivals come from.
#[derive(Debug)]
pub enum Schedule {
    /// Poisson arrivals with generated requests, until `end`.
    Generated {
        /// Requests.
        gen: Box<RequestGen>,
        /// Arrival gaps.
        arrivals: Box<Arrivals>,
        /// Last arrival strictly before this.
        end: Duration,
        /// The previous arrival.
        at: Duration,
    },
    /// A trace, replayed at its offsets.
    Trace(std::vec::IntoIter<TraceRecord>),
}

impl Schedule {
    /// Generated arrivals for `settings` over warm-up plus run, seeded like
    /// `bex_traffic::generate_trace`.
    pub fn generated(s: &Settings) -> Result<Schedule, bex_traffic::SpecError> {
        let gen = RequestGen::new(s.spec.clone(), s.raw.seed)?;
        Ok(Schedule::Generated {
            gen: Box::new(gen),
            arrivals: Box::new(Arrivals::new(s.raw.rate, s.raw.seed ^ ARRIVAL_SEED_XOR)),
            end: Duration::from_secs_f64(s.raw.seconds + s.raw.warmup_seconds),
            at: Duration::ZERO,
        })
    }

    fn next(&mut self) -> Option<(Duration, Request)> {
        match self {
            Schedule::Generated { gen, arrivals, end, at } => {
                *at += arrivals.next_gap();
                (*at < *end).then(|| (*at, RequestGen::next(gen)))
            }
            Schedule::Trace(it) => it.next().map(|r| (r.offset(), r.request)),
        }
    }
}

/// Run options that are not part of [`Settings`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// No progress lines.
    pub quiet: bool,
    /// Live series for `/metrics` (`--metrics`), warm-up included.
    pub metrics: Option<RankerMetrics>,
    /// How long to wait for in-flight requests after the last arrival.
    pub drain: Duration,
    /// How long to wait for them after SIGINT/SIGTERM.
    pub drain_interrupted: Duration,
}

/// What a running ranker exports about its requests (the PS calls under them are the
/// client's `bex_client_*` series).
#[derive(Clone, Debug)]
pub struct RankerMetrics {
    latency: prom::Histogram,
    ok: prom::Counter,
    failed: prom::Counter,
}

impl RankerMetrics {
    /// Registers `bex_ranker_request_duration_seconds` (scheduled arrival to the ranked
    /// answer, timer lateness included) and `bex_ranker_requests_total{outcome}`.
    pub fn register(reg: &prom::Registry) -> Result<RankerMetrics, prom::MetricsError> {
        let requests = |outcome| {
            reg.counter(
                "bex_ranker_requests_total",
                "Inference requests finished, by outcome (error: failed, timed out or dropped)",
                &[("outcome", outcome)],
            )
        };
        Ok(RankerMetrics {
            latency: reg.histogram(
                "bex_ranker_request_duration_seconds",
                "Inference requests from scheduled arrival to ranked answer (every table's \
                 fetch and the models)",
                &[],
                prom::LATENCY_BUCKETS_S,
            )?,
            ok: requests("ok")?,
            failed: requests("error")?,
        })
    }
}

/// A finished request, for the collector.
#[derive(Debug)]
struct Done {
    arrival: Duration,
    /// When the request was actually launched (the timer's lateness after `arrival`).
    launched: Duration,
    finished: Duration,
    result: RequestResult,
    dropped: bool,
}

/// What the collector gathered.
#[derive(Debug)]
pub struct Collected {
    /// Completions in the measured window.
    pub recorder: Recorder,
    /// Per-model fetch latencies in the measured window.
    pub sub: Histogram<u64>,
    /// Scheduled arrival to launch (timer lateness, included in request latency).
    pub launch_lag: Histogram<u64>,
    /// Arrivals dropped at `max_outstanding` (measured window).
    pub dropped: u64,
    /// The first error message.
    pub first_error: Option<String>,
}

/// Counters at the start and end of the measured window.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// This process's CPU.
    pub cpu: bex_process::CpuTimes,
    /// The machine's CPU.
    pub system: bex_process::SystemCpu,
    /// RPC counters.
    pub rpc: RpcCounters,
    /// Software RNIC counters.
    pub rnic: bex_transport::NicStats,
}

/// The RPC client's counters (`bex_rpc::ClientStats::snapshot`).
pub type RpcCounters = bex_rpc::ClientCounts;

/// What a run produced, for the report.
#[derive(Debug)]
pub struct RunOutput {
    /// Completions and latencies.
    pub collected: Collected,
    /// Measured window length.
    pub elapsed: Duration,
    /// Counters at the window's start.
    pub start: Snapshot,
    /// Counters at its end.
    pub end: Snapshot,
    /// Arrivals issued (including warm-up and dropped ones).
    pub issued: u64,
    /// Requests still in flight when the run gave up waiting (counted as timeouts).
    pub abandoned: u64,
    /// Stopped by SIGINT/SIGTERM.
    pub interrupted: bool,
}

/// Runs the schedule against the cluster. `snapshot` reads the counters (CPU, RPC, RNIC);
/// `stop` turns true on SIGINT/SIGTERM.
pub async fn run(
    ranker: Arc<Ranker>,
    mut schedule: Schedule,
    opts: RunOptions,
    snapshot: impl Fn() -> Snapshot + Send + Sync + 'static,
    mut stop: watch::Receiver<bool>,
) -> RunOutput {
    let s = ranker.settings.clone();
    let warmup = Duration::from_secs_f64(s.raw.warmup_seconds);
    let max_outstanding = s.raw.max_outstanding as usize;
    let start = Instant::now();
    let snapshot = Arc::new(snapshot);
    let at_warmup = {
        let snapshot = snapshot.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(start + warmup).await;
            snapshot()
        })
    };
    let issued = Arc::new(AtomicU64::new(0));
    let outstanding = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::unbounded_channel::<Done>();
    let (stop_collector, collector_stopped) = oneshot::channel();
    let collector = tokio::spawn(collect(
        rx,
        collector_stopped,
        start,
        warmup,
        issued.clone(),
        opts.quiet,
        opts.metrics.clone(),
    ));
    let refresher = tokio::spawn(ranker.clone().refresh_loop());

    let mut interrupted = *stop.borrow();
    while !interrupted {
        let Some((offset, request)) = schedule.next() else { break };
        tokio::select! {
            _ = tokio::time::sleep_until(start + offset.saturating_sub(TIMER_SLACK)) => {}
            _ = stop.changed() => { interrupted = true; break; }
        }
        issued.fetch_add(1, Ordering::Relaxed);
        if outstanding.load(Ordering::Relaxed) >= max_outstanding {
            let result = RequestResult {
                outcome: Outcome::Error,
                sub: Vec::new(),
                sent: 0,
                received: 0,
                error: Some(format!("dropped: {max_outstanding} requests outstanding")),
            };
            let _ = tx.send(Done {
                arrival: offset,
                launched: offset,
                finished: offset,
                result,
                dropped: true,
            });
            continue;
        }
        outstanding.fetch_add(1, Ordering::Relaxed);
        let (ranker, tx, outstanding) = (ranker.clone(), tx.clone(), outstanding.clone());
        let launched = start.elapsed();
        tokio::spawn(async move {
            let result = ranker.serve(request).await;
            let finished = start.elapsed();
            let _ = tx.send(Done { arrival: offset, launched, finished, result, dropped: false });
            outstanding.fetch_sub(1, Ordering::Relaxed);
        });
    }
    drop(tx);
    let mut drain_until =
        Instant::now() + if interrupted { opts.drain_interrupted } else { opts.drain };
    while outstanding.load(Ordering::Relaxed) > 0 && Instant::now() < drain_until {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            _ = stop.changed(), if !interrupted => {
                // A signal while draining: wait at most the short grace from now on.
                interrupted = true;
                drain_until = drain_until.min(Instant::now() + opts.drain_interrupted);
            }
        }
    }
    let end_at = Instant::now();
    let end = snapshot();
    refresher.abort();
    let start_snap = if at_warmup.is_finished() {
        at_warmup.await.unwrap_or_else(|_| end.clone())
    } else {
        at_warmup.abort();
        end.clone()
    };
    let _ = stop_collector.send(());
    let mut collected = match collector.await {
        Ok(c) => c,
        Err(e) => panic!("collector task failed: {e}"),
    };
    let abandoned = outstanding.load(Ordering::Relaxed) as u64;
    let finished = end_at.duration_since(start).saturating_sub(warmup);
    for _ in 0..abandoned {
        collected.recorder.record(Completion {
            outcome: Outcome::Timeout,
            ..Completion::ok(finished, Duration::ZERO)
        });
    }
    RunOutput {
        collected,
        elapsed: end_at.duration_since(start).saturating_sub(warmup),
        start: start_snap,
        end,
        issued: issued.load(Ordering::Relaxed),
        abandoned,
        interrupted,
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
        .expect("constant histogram bounds are valid")
}

/// The progress line's state: the last second's successes, and totals.
#[derive(Debug)]
struct Progress {
    window: Histogram<u64>,
    done: u64,
    errors: u64,
}

/// Records completions (only those that arrived after the warm-up) and prints a progress
/// line per second until told to stop; then drains what is queued.
async fn collect(
    mut rx: mpsc::UnboundedReceiver<Done>,
    mut stop: oneshot::Receiver<()>,
    start: Instant,
    warmup: Duration,
    issued: Arc<AtomicU64>,
    quiet: bool,
    metrics: Option<RankerMetrics>,
) -> Collected {
    let mut c = Collected {
        recorder: Recorder::new(),
        sub: new_histogram(),
        launch_lag: new_histogram(),
        dropped: 0,
        first_error: None,
    };
    let mut p = Progress { window: new_histogram(), done: 0, errors: 0 };
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    let record = |d: Done, c: &mut Collected, p: &mut Progress| {
        p.done += 1;
        let latency = d.finished.saturating_sub(d.arrival.max(d.launched));
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        if let Some(m) = &metrics {
            m.latency.observe(latency.as_secs_f64());
            let ok = d.result.outcome == Outcome::Ok && !d.dropped;
            if ok { &m.ok } else { &m.failed }.inc();
        }
        if d.result.outcome == Outcome::Ok {
            p.window.saturating_record(ns.max(1));
        } else {
            p.errors += 1;
            if c.first_error.is_none() {
                c.first_error = d.result.error.clone();
            }
        }
        if d.arrival < warmup {
            return;
        }
        c.dropped += u64::from(d.dropped);
        let lag = d.launched.saturating_sub(d.arrival);
        c.launch_lag.saturating_record(u64::try_from(lag.as_nanos()).unwrap_or(u64::MAX).max(1));
        for s in &d.result.sub {
            c.sub.saturating_record(u64::try_from(s.as_nanos()).unwrap_or(u64::MAX).max(1));
        }
        c.recorder.record(Completion {
            at: d.finished.saturating_sub(warmup),
            latency,
            outcome: d.result.outcome,
            retries: 0,
            fallback: false,
            bytes_sent: d.result.sent,
            bytes_received: d.result.received,
        });
    };
    loop {
        tokio::select! {
            biased;
            m = rx.recv() => match m {
                Some(d) => record(d, &mut c, &mut p),
                None => {
                    // All senders gone: wait for the stop signal (counts are final).
                    let _ = (&mut stop).await;
                    break;
                }
            },
            _ = &mut stop => {
                while let Ok(d) = rx.try_recv() {
                    record(d, &mut c, &mut p);
                }
                break;
            }
            _ = tick.tick() => {
                if !quiet {
                    let p99 =
                        if p.window.is_empty() { 0 } else { p.window.value_at_quantile(0.99) };
                    eprintln!(
                        "t={}s sent={} done={} p99={}us errors={}",
                        start.elapsed().as_secs(),
                        issued.load(Ordering::Relaxed),
                        p.done,
                        p99 / 1000,
                        p.errors,
                    );
                }
                p.window.reset();
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_schedule_equals_the_generated_trace() {
        let ranker = "rate = 300.0\nseconds = 0.5\nwarmup_seconds = 0.2\ncandidates_max = 50";
        let text = bex_testkit::fixtures::ranker_cluster("", ranker);
        let cfg = bex_ps_proto::Config::from_toml_str(&text).unwrap();
        let s = Settings::from_config(&cfg, &crate::settings::Overrides::default()).unwrap();
        let trace =
            bex_traffic::generate_trace(s.spec.clone(), 300.0, Duration::from_millis(700), 1)
                .unwrap();
        let mut live = Schedule::generated(&s).unwrap();
        let mut n = 0;
        while let Some((at, r)) = live.next() {
            assert_eq!((at, &r), (trace[n].offset(), &trace[n].request), "arrival {n}");
            n += 1;
        }
        assert_eq!(n, trace.len());
        assert!(n > 100, "{n} arrivals");
    }
}
