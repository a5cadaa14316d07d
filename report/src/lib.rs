//! `bex-report`: the typed `report.json` of a `bex-cluster` run. The launcher writes it
//! ([`ClusterReport`]), `bex-chaos verify` writes its part ([`VerifyReport`]), and the
//! experiments and the CI check read it back into the same types, so no reader depends on
//! string keys of the launcher's output.
//!
//! A client's own report stays the JSON value it wrote inside its [`ClientRecord`] (a
//! client of another version may add fields); readers take it as its typed report
//! ([`RankerReport`], [`TrainerReport`]) through [`ClusterReport::reports`], and a report
//! that does not parse is named as an error rather than read as zeros.

#![forbid(unsafe_code)]

mod chaos;
mod ranker;
mod trainer;

pub use chaos::{ChaosAction, ClientName, DropProbability, PodName, ServerName};
pub use ranker::{CandidateRange, DenseRefreshes, RankerCpu, RankerReport};
pub use trainer::{EvalPoint, MessageSizesReport, SizeSummary, TrainerReport};

use std::collections::BTreeMap;

use bex_process::{CpuTimes, SystemCpu};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Counters by name (an RNIC's, an RPC client's), as their owners serialize them.
pub type Counters = BTreeMap<String, u64>;

/// `x`'s unsigned fields by name: for counter structs of crates the report does not link
/// (the RNIC's, the RPC client's); anything else gives an empty map.
pub fn counters(x: &impl Serialize) -> Counters {
    serde_json::to_value(x).ok().and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default()
}

/// `name` in `c`, 0 if absent.
fn count(c: &Counters, name: &str) -> u64 {
    c.get(name).copied().unwrap_or(0)
}

/// What a process of a run is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// A `ps-server`.
    Server,
    /// A `ranker` (the default, for records built field by field: the commonest client).
    #[default]
    Ranker,
    /// A `trainer`.
    Trainer,
    /// `bex-chaos canary`.
    Canary,
    /// `bex-chaos verify`.
    Verify,
}

impl ProcessKind {
    /// Its name in reports and in process names (`ranker-3`).
    pub fn name(self) -> &'static str {
        match self {
            ProcessKind::Server => "server",
            ProcessKind::Ranker => "ranker",
            ProcessKind::Trainer => "trainer",
            ProcessKind::Canary => "canary",
            ProcessKind::Verify => "verify",
        }
    }
}

impl std::fmt::Display for ProcessKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a run's processes run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every process on loopback.
    #[default]
    Loopback,
    /// One network namespace per host, joined by a bridge (root only).
    Netns,
}

/// A client's own report, filed in [`ClientRecord::kind`] under [`ClientReport::KIND`].
pub trait ClientReport: DeserializeOwned {
    /// The client kind that writes it.
    const KIND: ProcessKind;
}

impl ClientReport for RankerReport {
    const KIND: ProcessKind = ProcessKind::Ranker;
}

impl ClientReport for TrainerReport {
    const KIND: ProcessKind = ProcessKind::Trainer;
}

/// How a process ended (both `None` while it ran, or when it could not be waited for).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    /// Its exit code, if it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
}

/// A client process of a phase (ranker, trainer, canary) and what it reported.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientRecord {
    /// `ranker-0`, `trainer-2`, ….
    pub name: String,
    /// What it is.
    pub kind: ProcessKind,
    /// Its mini-pod.
    pub pod: u32,
    /// Its `--id`.
    pub id: u64,
    /// Its process id (its last life's, if restarted).
    pub pid: u32,
    /// Its network namespace, if any.
    pub netns: Option<String>,
    /// Its address.
    pub ip: String,
    /// How it ended.
    pub status: ExitRecord,
    /// What it printed on stdout.
    pub stdout: String,
    /// Its `--json` report (the client's own schema), if it wrote one.
    pub report: Option<Value>,
}

/// Every report of `T`'s kind in `phases`, in order, with the client's name; a report that
/// is not a `T` (a client of another version, a truncated file) as the error saying why.
pub fn reports<T: ClientReport>(
    phases: &[PhaseReport],
) -> impl Iterator<Item = (&str, Result<T, String>)> + '_ {
    phases
        .iter()
        .flat_map(|p| &p.clients)
        .filter(|c| c.kind == T::KIND)
        .map(|c| (c.name.as_str(), c.report_as::<T>()))
}

impl ClientRecord {
    /// Its report read as a `T`, or why it cannot be.
    pub fn report_as<T: ClientReport>(&self) -> Result<T, String> {
        match &self.report {
            Some(v) => T::deserialize(v)
                .map_err(|e| format!("{}: not a {}'s report: {e}", self.name, T::KIND)),
            None => Err(format!("{}: no report", self.name)),
        }
    }
}

/// A server's CPU time and RNIC counter changes over a phase (or the whole run).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerDelta {
    /// `ps-p0-s1`.
    pub name: String,
    /// User and system CPU.
    pub cpu: CpuTimes,
    /// Its soft RNIC's counters, by name.
    pub rnic: BTreeMap<String, u64>,
}

/// TCP segments sent and retransmitted over a phase.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TcpDelta {
    /// Segments sent.
    pub out_segs: u64,
    /// Segments retransmitted.
    pub retrans_segs: u64,
    /// Whose counters: `every host namespace` or `machine`.
    pub scope: String,
}

/// One phase of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseReport {
    /// Its name (`inference`, `training`, …).
    pub name: String,
    /// How long it ran.
    pub duration_s: f64,
    /// Its clients.
    pub clients: Vec<ClientRecord>,
    /// Every server's change over the phase.
    pub servers: Vec<ServerDelta>,
    /// The servers' CPU, summed.
    pub server_cpu_total: CpuTimes,
    /// The servers' RNIC counters, summed.
    pub rnic_total: BTreeMap<String, u64>,
    /// The machine's CPU over the phase.
    pub machine_cpu: SystemCpu,
    /// TCP segments, where readable.
    pub tcp: Option<TcpDelta>,
}

/// A server of the cluster over the whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerRecord {
    /// `ps-p0-s1`.
    pub name: String,
    /// Its mini-pod.
    pub pod: u32,
    /// Its shard.
    pub shard: u32,
    /// Its process id (its last life's).
    pub pid: u32,
    /// Its network namespace, if any.
    pub netns: Option<String>,
    /// Its `/health` and `/metrics` address.
    pub http: Option<String>,
    /// Its CPU over the run.
    pub cpu: CpuTimes,
    /// Its RNIC counters at the end.
    pub rnic: BTreeMap<String, u64>,
    /// How it ended.
    pub status: ExitRecord,
}

/// A chaos event as applied (or not).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChaosRecord {
    /// When it was scheduled, seconds after the first phase started.
    pub at_s: f64,
    /// When it started, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_s: Option<f64>,
    /// When it was done, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_at_s: Option<f64>,
    /// Its action, with its target (`action`, `target`, `probability` in the JSON).
    #[serde(flatten)]
    pub action: ChaosAction,
    /// What happened: a description, `failed: …` or `not applied: …`.
    pub result: String,
}

/// One checked invariant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Invariant {
    /// What it states.
    pub name: String,
    /// Whether it held.
    pub ok: bool,
    /// Counts, or the first violation.
    pub detail: String,
}

/// `bex-chaos verify`'s report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Always [`ProcessKind::Verify`].
    pub kind: ProcessKind,
    /// Every invariant held.
    pub ok: bool,
    /// The invariants.
    pub invariants: Vec<Invariant>,
    /// Seconds until the replicas matched (None: they did not within the settling time).
    pub converged_after_s: Option<f64>,
}

/// The verifier's run inside the cluster's report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifyRecord {
    /// How `bex-chaos verify` ended.
    pub status: ExitRecord,
    /// What it printed.
    pub stdout: String,
    /// Its report, if it wrote one.
    pub report: Option<VerifyReport>,
    /// The launcher's own invariant over the rankers' reports: every request answered or
    /// failed by its deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_invariant: Option<Invariant>,
}

/// A network namespace host of a netns run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostRecord {
    /// Its name.
    pub name: String,
    /// Its namespace.
    pub ns: String,
    /// Its address.
    pub ip: String,
}

/// The network of a netns run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetworkReport {
    /// The switch's namespace.
    pub switch_ns: String,
    /// The hosts.
    pub hosts: Vec<HostRecord>,
    /// Each host link's rate, bit/s (unlimited: none).
    pub link_rate_bit_s: Option<u64>,
    /// The tbf burst, bytes.
    pub tbf_burst_bytes: Option<u64>,
    /// The tbf queue limit, bytes.
    pub tbf_limit_bytes: Option<u64>,
}

/// `report.json` of a `bex-cluster run`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterReport {
    /// Every process behaved and every invariant held.
    pub ok: bool,
    /// Why not, one line each.
    pub reasons: Vec<String>,
    /// Where the processes ran.
    pub mode: Mode,
    /// The launcher's process id.
    pub launcher_pid: u32,
    /// The run's output directory.
    pub out_dir: String,
    /// The cluster file the processes ran with (its own schema: `bex_ps_proto::Config`).
    pub config: Value,
    /// The `[launch]` section in effect.
    pub launch: Value,
    /// The network namespaces (netns runs).
    pub network: Option<NetworkReport>,
    /// Seconds until every server served (none if they did not).
    pub startup_s: Option<f64>,
    /// Every server.
    pub servers: Vec<ServerRecord>,
    /// The phases.
    pub phases: Vec<PhaseReport>,
    /// The chaos schedule as applied.
    pub chaos: Vec<ChaosRecord>,
    /// The verifier (runs with canaries).
    pub verify: Option<VerifyRecord>,
    /// Seconds the teardown took.
    pub teardown_s: f64,
    /// Seconds the whole run took.
    pub duration_s: f64,
}

impl ClusterReport {
    /// Reads `report.json`.
    pub fn from_json(text: &str) -> Result<ClusterReport, String> {
        serde_json::from_str(text).map_err(|e| format!("not a bex-cluster report: {e}"))
    }

    /// Every report of `T`'s kind over all phases ([`reports`]).
    pub fn reports<T: ClientReport>(&self) -> impl Iterator<Item = (&str, Result<T, String>)> + '_ {
        reports(&self.phases)
    }
}
