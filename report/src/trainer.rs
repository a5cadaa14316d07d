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
        let latency = |l: &LatencySummary| {
            format!("p50 {:.0} us p99 {:.0} us mean {:.0} us", l.p50_us, l.p99_us, l.mean_us)
        };
        let size = |s: &SizeSummary| format!("{:.0} B mean / {} B p99", s.mean, s.p99);
        let m = &self.message_bytes;
        let interrupted = if self.interrupted { " (interrupted)" } else { "" };
        [
            format!(
                "trainer {} over {}: {} steps, {} samples in {:.1} s ({:.0} samples/s), \
                 {} failed steps, {} push retries{interrupted}",
                self.id,
                self.transport,
                self.steps,
                self.samples,
                self.elapsed_s,
                self.samples_per_s,
                self.errors,
                self.push_retries,
            ),
            format!(
                "held-out AUC {:.4} -> {:.4}, log-loss {:.4} -> {:.4}",
                self.auc_initial, self.auc_final, self.log_loss_initial, self.log_loss_final,
            ),
            format!("fetch {}; push {}", latency(&self.fetch_latency), latency(&self.push_latency)),
            format!(
                "per-shard fetch response {}; push request {}",
                size(&m.fetch_response),
                size(&m.push_request)
            ),
            format!(
                "rpc: {} calls, {} retries, {} timeouts, {} fallbacks, {} quarantines; \
                 rnic: {} rnr naks, {} seq naks, {} retransmits; cpu user {:.2} s sys {:.2} s",
                self.rpc("calls"),
                self.rpc("retries"),
                self.rpc("timeouts"),
                self.rpc("fallbacks"),
                self.rpc("quarantines"),
                self.rnic("rnr_naks_received"),
                self.rnic("seq_naks_received"),
                self.rnic("retransmitted_packets"),
                self.cpu.user_s,
                self.cpu.sys_s,
            ),
        ]
        .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_has_a_line_for_each_part_of_the_run() {
        let mut r = TrainerReport { steps: 7, interrupted: true, ..Default::default() };
        r.push_latency.p99_us = 250.0;
        r.message_bytes.push_request.p99 = 4096;
        let text = r.summary();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].contains(": 7 steps,") && lines[0].ends_with("(interrupted)"), "{text}");
        assert!(lines[2].ends_with("; push p50 0 us p99 250 us mean 0 us"), "{text}");
        assert!(lines[3].ends_with("push request 0 B mean / 4096 B p99"), "{text}");
    }

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
