//! The trainer's own report (`trainer --json`): written by the trainer, read back by the CI
//! check and the training experiments through this one type.

use bex_process::CpuTimes;
use bex_traffic::LatencySummary;
use bex_transport_kind::TransportKind;
use serde::{Deserialize, Deserializer, Serialize};

use crate::{count, Counters};

/// A number that may be NaN (a diverged model's loss): serde_json writes NaN as `null`, read
/// back here as NaN rather than refused.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One held-out evaluation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Steps done when evaluated.
    pub step: u64,
    /// Training samples done.
    pub samples: u64,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// Held-out AUC (0.5 if undefined).
    #[serde(deserialize_with = "nan_if_null")]
    pub auc: f64,
    /// Held-out mean log-loss.
    #[serde(deserialize_with = "nan_if_null")]
    pub log_loss: f64,
}

/// A size summary, bytes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SizeSummary {
    /// Messages counted.
    pub count: u64,
    /// Mean bytes.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

/// The per-shard sub-request sizes of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MessageSizesReport {
    /// Embedding fetch requests per shard.
    pub fetch_request: SizeSummary,
    /// Embedding fetch responses per shard: the paper's ~20 KB mean / ~50 KB P99 target.
    pub fetch_response: SizeSummary,
    /// Embedding push requests per shard: same target.
    pub push_request: SizeSummary,
    /// Dense-weight fetch responses per shard.
    pub dense_fetch_response: SizeSummary,
    /// Dense-weight push requests per shard.
    pub dense_push_request: SizeSummary,
}

/// `trainer --json`, with `"kind": "trainer"` (what it is, for a reader of the file alone).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename = "trainer")]
pub struct TrainerReport {
    /// Trainer id (`--id`).
    pub id: u64,
    /// This run's push identity (random per start; servers deduplicate pushes by it).
    pub push_id: u64,
    /// The transport the PS client used.
    pub transport: TransportKind,
    /// Embedding table name.
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
    #[serde(deserialize_with = "nan_if_null")]
    pub train_loss_mean: f64,
    /// The fetch phase of each step (embedding + dense fetches, concurrent).
    pub fetch_latency: LatencySummary,
    /// The push phase of each step (embedding + dense pushes, concurrent).
    pub push_latency: LatencySummary,
    /// Held-out AUC before training.
    #[serde(deserialize_with = "nan_if_null")]
    pub auc_initial: f64,
    /// Held-out AUC at the end.
    #[serde(deserialize_with = "nan_if_null")]
    pub auc_final: f64,
    /// Held-out log-loss before training.
    #[serde(deserialize_with = "nan_if_null")]
    pub log_loss_initial: f64,
    /// Held-out log-loss at the end.
    #[serde(deserialize_with = "nan_if_null")]
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
    /// The RPC client's counters over the run.
    pub rpc: Counters,
    /// The software RNIC's counters over the run (zeros over TCP: the NIC is opened anyway).
    pub rnic: Counters,
    /// This process's CPU time over the run.
    pub cpu: CpuTimes,
    /// Stopped by SIGINT/SIGTERM.
    pub interrupted: bool,
}

impl TrainerReport {
    /// A counter of the RNIC's, 0 if absent.
    pub fn rnic(&self, name: &str) -> u64 {
        count(&self.rnic, name)
    }

    /// A counter of the RPC client's, 0 if absent.
    pub fn rpc(&self, name: &str) -> u64 {
        count(&self.rpc, name)
    }

    /// A few readable lines.
    pub fn summary(&self) -> String {
        let m = &self.message_bytes;
        let (f, p) = (&self.fetch_latency, &self.push_latency);
        format!(
            "trainer {id} over {t}: {steps} steps, {samples} samples in {el:.1} s \
             ({sps:.0} samples/s), {err} failed steps, {retried} push retries{int}\n\
             held-out AUC {a0:.4} -> {a1:.4}, log-loss {l0:.4} -> {l1:.4}\n\
             fetch p50 {fp50:.0} us p99 {fp99:.0} us mean {fm:.0} us; \
             push p50 {pp50:.0} us p99 {pp99:.0} us mean {pm:.0} us\n\
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
            fp50 = f.p50_us,
            fp99 = f.p99_us,
            fm = f.mean_us,
            pp50 = p.p50_us,
            pp99 = p.p99_us,
            pm = p.mean_us,
            fr = m.fetch_response.mean,
            fr99 = m.fetch_response.p99,
            pr = m.push_request.mean,
            pr99 = m.push_request.p99,
            calls = self.rpc("calls"),
            retries = self.rpc("retries"),
            timeouts = self.rpc("timeouts"),
            fb = self.rpc("fallbacks"),
            q = self.rpc("quarantines"),
            rnr = self.rnic("rnr_naks_received"),
            seq = self.rnic("seq_naks_received"),
            rt = self.rnic("retransmitted_packets"),
            cu = self.cpu.user_s,
            cs = self.cpu.sys_s,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diverged_run_reads_back_with_its_nans() {
        let r = TrainerReport { log_loss_final: f64::NAN, ..Default::default() };
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"log_loss_final\":null"), "{text}");
        let back: TrainerReport = serde_json::from_str(&text).unwrap();
        assert!(back.log_loss_final.is_nan());
        assert_eq!(back.log_loss_initial, 0.0);
        // A missing field is still an error, not a NaN.
        let v = serde_json::to_value(&r).unwrap();
        let mut o = v.as_object().unwrap().clone();
        o.remove("auc_final");
        assert!(TrainerReport::deserialize(&serde_json::Value::Object(o)).is_err());
    }
}
