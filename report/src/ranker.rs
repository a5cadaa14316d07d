//! The ranker's own report (`ranker --json`): written by the ranker, read back by the
//! launcher's deadline check, the CI check and the experiments through this one type.

use bex_process::{CpuTimes, SystemCpu};
use bex_traffic::{LatencySummary, SecondBucket};
use bex_transport_kind::TransportKind;
use serde::{Deserialize, Serialize};

use crate::{count, Counters};

/// The candidates per request, log-uniform in `[min, max]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateRange {
    /// Fewest.
    pub min: u32,
    /// Most.
    pub max: u32,
}

/// CPU over the measured run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankerCpu {
    /// The ranker process.
    pub ranker: CpuTimes,
    /// The whole machine (every CPU).
    pub machine: SystemCpu,
}

/// The dense weights the ranker fetched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseRefreshes {
    /// Parameters of one model's MLP.
    pub params_per_model: Option<usize>,
    /// Refreshes after the first fetch.
    pub refreshes: u64,
    /// Refreshes that failed (the old weights stayed).
    pub refresh_failures: u64,
}

/// `ranker --json`, with `"kind": "ranker"` (what it is, for a reader of the file alone).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename = "ranker")]
pub struct RankerReport {
    /// The transport the PS client used.
    pub transport: TransportKind,
    /// Stopped by SIGINT/SIGTERM before the schedule ended.
    pub interrupted: bool,
    /// The cluster file.
    pub config: String,
    /// The ranker's mini-pod.
    pub pod: u32,
    /// Its PS client id.
    pub client_id: u64,
    /// The replayed trace, if any.
    pub trace: Option<String>,
    /// Requests per second offered.
    pub rate_rps: f64,
    /// Seconds measured.
    pub seconds: f64,
    /// Seconds of warm-up before them.
    pub warmup_seconds: f64,
    /// The schedule's seed.
    pub seed: u64,
    /// Models served.
    pub models: u32,
    /// Models a request fans out to.
    pub models_per_request: u32,
    /// Candidates per request.
    pub candidates: CandidateRange,
    /// Requests in flight at most (later ones are dropped).
    pub max_outstanding: u32,
    /// Seconds the measured run took.
    pub elapsed_s: f64,
    /// Requests launched.
    pub issued: u64,
    /// Requests completed (ok + errors + timeouts).
    pub requests: u64,
    /// Requests answered in full.
    pub ok: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Requests past their deadline.
    pub timeouts: u64,
    /// Requests not launched: `max_outstanding` were in flight.
    pub dropped: u64,
    /// Requests still in flight when the drain ended (never answered).
    pub abandoned: u64,
    /// RPC retries.
    pub retries: u64,
    /// Destinations moved to TCP.
    pub fallbacks: u64,
    /// Destinations quarantined.
    pub quarantines: u64,
    /// Completions per second.
    pub throughput_rps: f64,
    /// Successes per second.
    pub goodput_rps: f64,
    /// Whole requests (fan-out, models, reply).
    pub latency: LatencySummary,
    /// Each model's fetch within a request.
    pub subrequest_latency: LatencySummary,
    /// How late requests were launched against their schedule.
    pub launch_lag: LatencySummary,
    /// Request bytes sent.
    pub bytes_sent: u64,
    /// Response bytes received.
    pub bytes_received: u64,
    /// CPU time.
    pub cpu: RankerCpu,
    /// The software RNIC's counters over the run (empty over TCP).
    pub rnic: Counters,
    /// The RPC client's counters over the run.
    pub rpc: Counters,
    /// Dense weight refreshes.
    pub dense: DenseRefreshes,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Per-second completions and latencies.
    pub series: Vec<SecondBucket>,
}

impl RankerReport {
    /// A counter of the RNIC's, 0 if absent.
    pub fn rnic(&self, name: &str) -> u64 {
        count(&self.rnic, name)
    }

    /// A counter of the RPC client's, 0 if absent.
    pub fn rpc(&self, name: &str) -> u64 {
        count(&self.rpc, name)
    }
}
