//! The run's report: JSON (`--json`) and a readable summary.

use bex_process::CpuTimes;
use bex_transport::NicStats as DeviceStats;
use serde::Serialize;

use crate::sizes::MessageSizesReport;
use crate::train::{EvalPoint, LatencySummary};

/// RPC counters of the trainer's client (`bex_rpc::ClientStats::snapshot`).
pub type RpcCounters = bex_rpc::ClientCounts;

/// The JSON report (`"kind": "trainer"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// Always `"trainer"`.
    pub kind: &'static str,
    /// Trainer id (`--id`).
    pub id: u64,
    /// This run's push identity (random per start; servers deduplicate pushes by it).
    pub push_id: u64,
    /// `"rdma"` or `"tcp"`.
    pub transport: String,
    /// Embedding table name and the dense table name.
    pub table: String,
    /// Dense table name.
    pub dense_table: String,
    /// Stream seed.
    pub seed: u64,
    /// Mean batch size.
    pub batch_size: usize,
    /// Steps attempted.
    pub steps: u64,
    /// Samples trained on (successful steps).
    pub samples: u64,
    /// Wall time of the training loop, s.
    pub elapsed_s: f64,
    /// Samples per second of the training loop.
    pub samples_per_s: f64,
    /// Steps per second.
    pub steps_per_s: f64,
    /// Mean training loss over successful steps.
    pub train_loss_mean: f64,
    /// The fetch phase of each step (embedding + dense fetches, concurrent).
    pub fetch_latency: LatencySummary,
    /// The push phase of each step (embedding + dense pushes, concurrent).
    pub push_latency: LatencySummary,
    /// Held-out AUC before training.
    pub auc_initial: f64,
    /// Held-out AUC at the end.
    pub auc_final: f64,
    /// Held-out log-loss before training.
    pub log_loss_initial: f64,
    /// Held-out log-loss at the end.
    pub log_loss_final: f64,
    /// Held-out samples.
    pub eval_samples: usize,
    /// Every evaluation.
    pub eval: Vec<EvalPoint>,
    /// Per-shard sub-request sizes, bytes.
    pub message_bytes: MessageSizesReport,
    /// Failed steps: a fetch failed (the step is skipped), or a push still failed after
    /// being retried for `[rpc] push_retry_ms` with its sequence number (that update is
    /// lost; the servers never apply a push twice).
    pub errors: u64,
    /// Push sub-requests sent again after a failure (each applied at most once).
    pub push_retries: u64,
    /// The last failure's message.
    pub last_error: Option<String>,
    /// Evaluations that failed (not counted in `errors`).
    pub eval_errors: u64,
    /// RPC counters.
    pub rpc: RpcCounters,
    /// Software RNIC counters.
    pub rnic: DeviceStats,
    /// This process's CPU time over the run.
    pub cpu: CpuTimes,
    /// Stopped by SIGINT/SIGTERM.
    pub interrupted: bool,
}

impl Report {
    /// A few readable lines.
    pub fn summary(&self) -> String {
        let m = &self.message_bytes;
        format!(
            "trainer {id} over {t}: {steps} steps, {samples} samples in {el:.1} s \
             ({sps:.0} samples/s), {err} failed steps, {retried} push retries{int}\n\
             held-out AUC {a0:.4} -> {a1:.4}, log-loss {l0:.4} -> {l1:.4}\n\
             fetch p50 {fp50} us p99 {fp99} us mean {fm:.0} us; push p50 {pp50} us p99 {pp99} us mean {pm:.0} us\n\
             per-shard fetch response {fr:.0} B mean / {fr99} B p99; push request {pr:.0} B mean / {pr99} B p99\n\
             rpc: {calls} calls, {retries} retries, {timeouts} timeouts, {fb} fallbacks, {q} quarantines; \
             rnic: {rnr} rnr naks, {seq} seq naks, {rt} retransmits; cpu user {cu:.2} s sys {cs:.2} s",
            id = self.id,
            t = self.transport,
            steps = self.steps,
            samples = self.samples,
            el = self.elapsed_s,
            sps = self.samples_per_s,
            err = self.errors,
            retried = self.push_retries,
            int = if self.interrupted { " (interrupted)" } else { "" },
            a0 = self.auc_initial,
            a1 = self.auc_final,
            l0 = self.log_loss_initial,
            l1 = self.log_loss_final,
            fp50 = self.fetch_latency.p50_us,
            fp99 = self.fetch_latency.p99_us,
            fm = self.fetch_latency.mean_us,
            pp50 = self.push_latency.p50_us,
            pp99 = self.push_latency.p99_us,
            pm = self.push_latency.mean_us,
            fr = m.fetch_response.mean,
            fr99 = m.fetch_response.p99,
            pr = m.push_request.mean,
            pr99 = m.push_request.p99,
            calls = self.rpc.calls,
            retries = self.rpc.retries,
            timeouts = self.rpc.timeouts,
            fb = self.rpc.fallbacks,
            q = self.rpc.quarantines,
            rnr = self.rnic.rnr_naks_received,
            seq = self.rnic.seq_naks_received,
            rt = self.rnic.retransmitted_packets,
            cu = self.cpu.user_s,
            cs = self.cpu.sys_s,
        )
    }
}
