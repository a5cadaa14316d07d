//! The cluster configuration: one TOML file (`configs/*.toml`) read by every process.
//!
//! Sections: `[cluster]` (P mini-pods × n shards, the training pod, addresses — explicit
//! `[[cluster.servers]]` or derived on one host from `base_port`), `[server]` (limits,
//! dedupe, checkpoints, replication), `[[tables]]` (name, dim, seed, initializer and
//! optimizer with hyperparameters), `[transport]` (the ByteExpress settings), `[rpc]`
//! (deadlines, retry, quarantine), and `[ranker]` / `[trainer]` / `[launch]` passed through
//! untouched for those programs. Unknown keys are errors (typos do not silently fall back to
//! defaults).
//!
//! [`Config::validate`] reports every problem, each naming its field the way the file spells
//! it: `cluster.pods: must be ≥ 1`, `tables[2].dim: must be in 1..=4096`,
//! `tables[0].optimizer.lr: must be finite and > 0`, `rpc.retry_probability: must be in
//! [0, 1]`. See `configs/local.toml` for a commented example.

use std::collections::HashSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::spec::{Admission, Capacity, TableSpec};
use crate::topology::{ServerAddrs, Topology};
use crate::wire::{Limits, MAX_DIM};

/// A problem with one field.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    /// The field's path as written in the file, e.g. `tables[2].dim`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl FieldError {
    /// An error at `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError { field: field.into(), message: message.into() }
    }

    /// The same error under `prefix` (`dim` → `tables[2].dim`).
    pub fn prefixed(&self, prefix: &str) -> FieldError {
        FieldError { field: format!("{prefix}.{}", self.field), message: self.message.clone() }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// Not valid TOML, a wrong type, or an unknown key (toml's message names the key and
    /// shows the line).
    #[error("{0}")]
    Parse(String),
    /// Parsed, but values are invalid; one entry per problem.
    #[error("{}", display_all(.0))]
    Invalid(Vec<FieldError>),
}

fn display_all(errors: &[FieldError]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n")
}

impl ConfigError {
    /// The field errors (empty for I/O and parse errors).
    pub fn fields(&self) -> &[FieldError] {
        match self {
            ConfigError::Invalid(v) => v,
            _ => &[],
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// The whole file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Pods, shards, addresses.
    pub cluster: ClusterConfig,
    /// Per-server behaviour.
    #[serde(default)]
    pub server: ServerConfig,
    /// Tables; a table's id is its position here.
    #[serde(default)]
    pub tables: Vec<TableConfig>,
    /// Transport settings.
    #[serde(default)]
    pub transport: TransportConfig,
    /// RPC settings.
    #[serde(default)]
    pub rpc: RpcConfig,
    /// The ranker's section, passed through.
    #[serde(default)]
    pub ranker: toml::Table,
    /// The trainer's section, passed through.
    #[serde(default)]
    pub trainer: toml::Table,
    /// The cluster launcher's (`bex-cluster`) section, passed through.
    #[serde(default)]
    pub launch: toml::Table,
}

/// `[cluster]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Cluster name (logs, metrics).
    #[serde(default = "default_name")]
    pub name: String,
    /// Mini-pods `P`: each holds a full replica of all shards.
    pub pods: u32,
    /// Shards `n` per pod.
    pub shards: u32,
    /// The pod whose servers apply pushes and replicate to the others.
    #[serde(default)]
    pub training_pod: u32,
    /// Host of the derived layout (used when `servers` is empty).
    #[serde(default = "default_host")]
    pub host: IpAddr,
    /// First port of the derived layout: server (pod p, shard s) gets
    /// `base_port + 3·(p·shards + s)` + 0 (RDMA bootstrap), + 1 (TCP), + 2 (HTTP).
    #[serde(default = "default_base_port")]
    pub base_port: u16,
    /// Explicit addresses, one entry per (pod, shard); empty = derived.
    #[serde(default)]
    pub servers: Vec<ServerEntry>,
    /// One host per server, by DNS name: a template with `{pod}` and `{shard}` (e.g.
    /// `"bex-ps-p{pod}-{shard}.bex-ps-p{pod}"`, a Kubernetes StatefulSet per pod behind a
    /// headless Service); every server listens on `base_port` (RDMA), +1 (TCP), +2 (HTTP) of
    /// its own host. Empty: `servers`, or the derived layout on `host`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub server_host: String,
    /// Directory of checkpoints (`<data_dir>/pod<p>/shard<s>.ckpt`).
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Without `BEX_SECRET`, processes bound off loopback refuse to start (the default
    /// secret comes from the cluster name); true accepts that risk.
    #[serde(default)]
    pub allow_insecure: bool,
}

fn default_name() -> String {
    "bex".into()
}
fn default_host() -> IpAddr {
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}
fn default_base_port() -> u16 {
    17000
}
fn default_data_dir() -> PathBuf {
    PathBuf::from("data")
}

/// One `[[cluster.servers]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerEntry {
    /// Pod.
    pub pod: u32,
    /// Shard.
    pub shard: u32,
    /// RDMA bootstrap address (TCP listener exchanging QP endpoints), `ip:port` or
    /// `name:port` (a DNS name, resolved at start and again whenever a client reconnects;
    /// the three addresses of an entry then name the same host).
    pub rdma: String,
    /// TCP transport address, `ip:port` or `name:port`.
    pub tcp: String,
    /// HTTP address for `/metrics` and `/health`, `ip:port` or `name:port`.
    pub http: String,
}

/// `ip:port`, `[v6]:port` or `name:port`: the address (a name's IP unspecified) and the
/// name.
pub fn parse_host_port(v: &str) -> Result<(SocketAddr, Option<String>), String> {
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok((a, None));
    }
    let bad = || format!("{v:?} is not ip:port or name:port");
    let (host, port) = v.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.parse::<IpAddr>().is_ok() || host.starts_with('[') {
        return Err(bad()); // an IPv6 address needs brackets
    }
    check_host_name(host).map_err(|m| format!("{v:?}: {m}"))?;
    Ok((SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port), Some(host.to_string())))
}

/// A DNS name: dot-separated labels of letters, digits and hyphens (not first or last), at
/// most 63 bytes each and 253 in all.
pub fn check_host_name(name: &str) -> Result<(), String> {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!("{name:?} is not a host name"));
    }
    Ok(())
}

/// `[server]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Largest request frame accepted.
    pub max_request_bytes: usize,
    /// Most keys in one request.
    pub max_keys_per_request: u32,
    /// Push dedupe window per client, in sequence numbers (multiple of 64).
    pub dedupe_window: u32,
    /// Clients whose windows are kept (least recently seen evicted beyond).
    pub dedupe_max_clients: usize,
    /// Seconds between periodic checkpoints (0: only on demand and at shutdown).
    pub checkpoint_interval_s: u64,
    /// Write a checkpoint on clean shutdown.
    pub checkpoint_on_shutdown: bool,
    /// Load the checkpoint at start if one exists.
    pub restore_on_start: bool,
    /// A serving replica copies its shard from the training pod at start (over a restored
    /// checkpoint too: only newer rows are taken). The training pod catches up from its
    /// replicas at start whatever this says (off, it would lose the pushes they
    /// acknowledged).
    pub bootstrap_from_peer: bool,
    /// Most keys per round of replication to one replica (training pod).
    pub replication_batch_keys: u32,
    /// Bytes per snapshot chunk when bootstrapping.
    pub snapshot_chunk_bytes: u32,
    /// On SIGTERM, how long the server waits for its replication backlog to reach the other
    /// pods (after refusing new pushes and finishing those in flight) before it checkpoints
    /// and exits anyway.
    pub drain_timeout_ms: u64,
    /// When the training pod acknowledges a push (see [`PushAck`]).
    pub push_ack: PushAck,
    /// `replicated`: how long a push waits for a replica's acknowledgement before it is
    /// answered `Unavailable` (applied, not yet acknowledged: the client retries it, and the
    /// retry is acknowledged once the replication is).
    pub push_ack_timeout_ms: u64,
}

/// When the training pod acknowledges a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushAck {
    /// Once another pod has applied it: the push's rows go to a replica with the push's
    /// identity before the answer, so killing any one server loses no acknowledged push.
    /// With one pod there is no other: it acts as `applied`.
    Replicated,
    /// Once applied on the training pod: faster, but a SIGKILL of a training server loses
    /// what it acknowledged and had not yet replicated (its replication lag), and the retry
    /// of a push whose answer the kill cut off can be applied twice (see ARCHITECTURE.md).
    Applied,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_request_bytes: 64 << 20,
            max_keys_per_request: 1 << 20,
            dedupe_window: 1024,
            dedupe_max_clients: 4096,
            checkpoint_interval_s: 300,
            checkpoint_on_shutdown: true,
            restore_on_start: true,
            bootstrap_from_peer: true,
            replication_batch_keys: 4096,
            snapshot_chunk_bytes: 1 << 20,
            drain_timeout_ms: 5_000,
            push_ack: PushAck::Replicated,
            push_ack_timeout_ms: 500,
        }
    }
}

/// One `[[tables]]` entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Name (1..=64 bytes of `[A-Za-z0-9_.-]`), unique.
    pub name: String,
    /// Row dimension, 1..=4096.
    pub dim: u32,
    /// Initializer seed; default: derived from the name (FNV-1a 64 of its bytes).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Initializer: `{ kind = "zeros" | "constant" | "uniform" | "normal", … }`.
    #[serde(default)]
    pub init: InitConfig,
    /// Optimizer: `{ kind = "sgd" | "adagrad" | "adam" | "ftrl", … }` with hyperparameters
    /// (missing ones take the defaults below).
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Feature admission: `{ after_pushes = N, sketch_width = W }` (default: off).
    #[serde(default)]
    pub admission: Admission,
    /// Rows kept per shard: `{ max_rows = N, max_bytes = B, ttl_s = T }` (default: all).
    #[serde(default)]
    pub capacity: Capacity,
}

/// The `init` table of a `[[tables]]` entry.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum InitConfig {
    /// All zeros.
    Zeros,
    /// `value` everywhere.
    Constant {
        /// The value.
        value: f32,
    },
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half-width (default 0.01).
        #[serde(default = "d_scale")]
        scale: f32,
    },
    /// Approximately normal (bounded at ±3.46 std).
    Normal {
        /// Standard deviation (default 0.01).
        #[serde(default = "d_scale")]
        std: f32,
    },
}

impl Default for InitConfig {
    fn default() -> Self {
        InitConfig::Uniform { scale: d_scale() }
    }
}

fn d_scale() -> f32 {
    0.01
}

/// The `optimizer` table of a `[[tables]]` entry.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerConfig {
    /// SGD.
    Sgd {
        /// Learning rate (default 0.01).
        #[serde(default = "d_lr")]
        lr: f32,
    },
    /// Adagrad.
    Adagrad {
        /// Learning rate (default 0.01).
        #[serde(default = "d_lr")]
        lr: f32,
        /// Starting accumulator (default 0.1).
        #[serde(default = "d_acc")]
        initial_accumulator: f32,
        /// Denominator epsilon (default 1e-8).
        #[serde(default = "d_eps")]
        eps: f32,
    },
    /// Adam.
    Adam {
        /// Learning rate (default 0.001).
        #[serde(default = "d_adam_lr")]
        lr: f32,
        /// β₁ (default 0.9).
        #[serde(default = "d_beta1")]
        beta1: f32,
        /// β₂ (default 0.999).
        #[serde(default = "d_beta2")]
        beta2: f32,
        /// Denominator epsilon (default 1e-8).
        #[serde(default = "d_eps")]
        eps: f32,
    },
    /// FTRL-Proximal.
    Ftrl {
        /// α (default 0.05).
        #[serde(default = "d_alpha")]
        alpha: f32,
        /// β (default 1.0).
        #[serde(default = "d_one")]
        beta: f32,
        /// L1 (default 0).
        #[serde(default)]
        l1: f32,
        /// L2 (default 0).
        #[serde(default)]
        l2: f32,
        /// Starting `n` (default 0).
        #[serde(default)]
        initial_accumulator: f32,
    },
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Sgd { lr: d_lr() }
    }
}

fn d_lr() -> f32 {
    0.01
}
fn d_adam_lr() -> f32 {
    0.001
}
fn d_acc() -> f32 {
    0.1
}
fn d_eps() -> f32 {
    1e-8
}
fn d_beta1() -> f32 {
    0.9
}
fn d_beta2() -> f32 {
    0.999
}
fn d_alpha() -> f32 {
    0.05
}
fn d_one() -> f32 {
    1.0
}

impl From<InitConfig> for Initializer {
    fn from(c: InitConfig) -> Initializer {
        match c {
            InitConfig::Zeros => Initializer::Zeros,
            InitConfig::Constant { value } => Initializer::Constant { value },
            InitConfig::Uniform { scale } => Initializer::Uniform { scale },
            InitConfig::Normal { std } => Initializer::Normal { std },
        }
    }
}

impl From<OptimizerConfig> for Optimizer {
    fn from(c: OptimizerConfig) -> Optimizer {
        match c {
            OptimizerConfig::Sgd { lr } => Optimizer::Sgd { lr },
            OptimizerConfig::Adagrad { lr, initial_accumulator, eps } => {
                Optimizer::Adagrad { lr, initial_accumulator, eps }
            }
            OptimizerConfig::Adam { lr, beta1, beta2, eps } => {
                Optimizer::Adam { lr, beta1, beta2, eps }
            }
            OptimizerConfig::Ftrl { alpha, beta, l1, l2, initial_accumulator } => {
                Optimizer::Ftrl { alpha, beta, l1, l2, initial_accumulator }
            }
        }
    }
}

/// FNV-1a 64 of `name`: the default table seed (stable, documented).
pub fn seed_from_name(name: &str) -> u64 {
    name.bytes()
        .fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

impl TableConfig {
    /// The table definition this entry describes.
    pub fn spec(&self) -> TableSpec {
        TableSpec {
            name: self.name.clone(),
            dim: self.dim,
            seed: self.seed.unwrap_or_else(|| seed_from_name(&self.name)),
            init: self.init.into(),
            optimizer: self.optimizer.into(),
            admission: self.admission,
            capacity: self.capacity,
        }
    }
}

/// Which transport the data path uses (`[transport] kind`): the one enum of
/// `bex-transport-kind`, shared with the transports and the tools.
pub use bex_transport_kind::TransportKind;

/// Which NIC carries RDMA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NicKind {
    /// The software RNIC: RoCEv2 over a UDP socket (runs anywhere).
    #[default]
    Soft,
    /// A hardware RNIC through libibverbs (a build with the `verbs` feature).
    Verbs,
}

/// `[transport]`: mirrors `bex_transport::Config` (same names, times in ms/µs, `cwnd_bytes =
/// 0` for off, `path_mtu` in bytes), plus the NIC.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// RDMA or TCP.
    pub kind: TransportKind,
    /// The NIC that carries RDMA: "soft" or "verbs".
    pub nic: NicKind,
    /// Verbs: the device name (`ibv_devices`); empty: the first device.
    pub device: String,
    /// Verbs: the physical port, from 1.
    pub port: u8,
    /// Verbs: the source GID index; -1: the port's first RoCEv2 GID (0 on InfiniBand).
    pub gid_index: i16,
    /// Soft: the RNIC's UDP port (RoCEv2's 4791). Where another process on the same address
    /// has it, a free port is taken instead (bex peers learn it at bootstrap). 0: always free.
    pub udp_port: u16,
    /// RDMA endpoints per transport: a completion queue and a driver task each (the paper's
    /// I/O threads, run as tasks on the application threads). On the software RNIC each one
    /// also watches the device's socket, so more than one costs wake-ups.
    pub endpoints: usize,
    /// Application (tokio worker) threads of each process — ps-server, ranker, trainer —
    /// which run the transport's drivers, RPC handlers and clients. A thread woken by the
    /// network that has several tasks to run wakes a sibling too.
    pub app_threads: usize,
    /// Send-queue depth (work-request chain length).
    pub sq_depth: u32,
    /// Receive-queue depth `d` (credits returned `d/2` at a time).
    pub rq_depth: u32,
    /// Completion-queue depth per endpoint.
    pub cq_depth: u32,
    /// Largest eager (SEND) message.
    pub eager_max: usize,
    /// Fragment size `S` of large messages.
    pub fragment_bytes: usize,
    /// Largest standing grant: after a large message arrives on a connection, the receiver
    /// offers a buffer for the next one (the next power of two above it, at most this many
    /// bytes) with its next reply, so repeated large requests skip the RTS/CTS round trip.
    /// Costs at most this much registered memory per connection; 0: off.
    pub grant_max_bytes: usize,
    /// Send window per engine in bytes; 0 = off (the paper's baseline).
    pub cwnd_bytes: u64,
    /// Path MTU in bytes: 256, 512, 1024, 2048, 4096, or a software-RNIC MTU up to 61440.
    pub path_mtu: u32,
    /// Keepalive send interval.
    pub keepalive_interval_ms: u64,
    /// Keepalive failure timeout.
    pub keepalive_timeout_ms: u64,
    /// TCP connections: an idle writer sends a keepalive this often.
    pub tcp_keepalive_interval_ms: u64,
    /// TCP connections: a peer silent this long is lost (longer than RDMA's: TCP's own
    /// retransmissions back off to seconds).
    pub tcp_keepalive_timeout_ms: u64,
    /// Engine/socket establishment deadline.
    pub connect_timeout_ms: u64,
    /// How long an idle endpoint driver keeps polling before it waits for an event.
    pub spin_us: u64,
    /// Messages a socket may queue before `send` waits.
    pub max_queued_sends: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: TransportKind::Rdma,
            nic: NicKind::Soft,
            device: String::new(),
            port: 1,
            gid_index: -1,
            udp_port: 4791,
            endpoints: 1,
            app_threads: 2,
            sq_depth: 32,
            rq_depth: 64,
            cq_depth: 8192,
            eager_max: 8 * 1024,
            fragment_bytes: 64 * 1024,
            grant_max_bytes: 1 << 20,
            cwnd_bytes: 0,
            path_mtu: 4096,
            keepalive_interval_ms: 100,
            keepalive_timeout_ms: 1000,
            tcp_keepalive_interval_ms: 1000,
            tcp_keepalive_timeout_ms: 10_000,
            connect_timeout_ms: 3000,
            spin_us: 0,
            max_queued_sends: 1024,
        }
    }
}

/// `[rpc]`: the paper's §7 numbers as defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RpcConfig {
    /// Connection deadline Tc.
    pub connect_timeout_ms: u64,
    /// Request deadline Tr of serving clients (rankers: the paper's inference deadline).
    pub request_timeout_ms: u64,
    /// Request deadline of training clients (trainers, canaries). Training traffic is bulk
    /// and incast-prone: a lost packet waits for the RNIC's retransmit timer (~67 ms), so
    /// the inference deadline would make its latencies measure the deadline.
    pub training_request_timeout_ms: u64,
    /// How long a training client keeps retrying a push that failed (same sequence number:
    /// the servers apply it once) before the step counts as failed; 0: no retry.
    pub push_retry_ms: u64,
    /// Probability that a timed-out request is retried.
    pub retry_probability: f64,
    /// Most attempts per request (first try included).
    pub max_attempts: u32,
    /// Prefer replicas in the caller's own pod.
    pub prefer_local_pod: bool,
    /// Quarantine after more than M connection failures within the window.
    pub quarantine_connect_failures: u32,
    /// Quarantine after more than N request failures within the window.
    pub quarantine_request_failures: u32,
    /// The failure-counting window.
    pub quarantine_window_s: u64,
    /// How long a quarantined destination is passed over before a call probes it again.
    pub quarantine_s: u64,
    /// Fall back to TCP when RDMA stays unavailable (false: RDMA failures fail the calls).
    pub tcp_fallback: bool,
    /// How often a TCP-fallback destination re-probes RDMA.
    pub rdma_reprobe_s: u64,
    /// Calls whose request or expected reply is larger than this many bytes use a second
    /// connection per destination, so large replies do not hold small ones back; 0: one.
    pub bulk_lane_bytes: usize,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            connect_timeout_ms: 10,
            request_timeout_ms: 40,
            training_request_timeout_ms: 1000,
            push_retry_ms: 10_000,
            retry_probability: 0.5,
            max_attempts: 3,
            prefer_local_pod: true,
            quarantine_connect_failures: 30,
            quarantine_request_failures: 50,
            quarantine_window_s: 300,
            quarantine_s: 300,
            tcp_fallback: true,
            rdma_reprobe_s: 30,
            bulk_lane_bytes: 64 << 10,
        }
    }
}

impl RpcConfig {
    /// The longest one client call takes with request deadline `request_timeout_ms`
    /// (serving or training): every attempt's connection and request deadlines,
    /// `max_attempts × (Tc + Tr)`; the RPC client fails a call still unanswered then
    /// (`bex_rpc::ClientConfig::call_deadline`, the same formula).
    pub fn call_deadline_ms(&self, request_timeout_ms: u64) -> u64 {
        u64::from(self.max_attempts.max(1)) * (self.connect_timeout_ms + request_timeout_ms)
    }
}

// ---------------------------------------------------------------------------------------------

impl Config {
    /// Parses and validates TOML text.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Io { path: path.to_owned(), message: e.to_string() })?;
        Config::from_toml_str(&text).map_err(|e| match e {
            ConfigError::Parse(m) => ConfigError::Parse(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    /// The configuration as TOML.
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// A local cluster on loopback: `pods × shards` servers with ports from `base_port`,
    /// pod 0 training, no tables.
    pub fn local(pods: u32, shards: u32, base_port: u16) -> Config {
        Config {
            cluster: ClusterConfig {
                name: "local".into(),
                pods,
                shards,
                training_pod: 0,
                host: default_host(),
                base_port,
                servers: Vec::new(),
                server_host: String::new(),
                data_dir: default_data_dir(),
                allow_insecure: false,
            },
            server: ServerConfig::default(),
            tables: Vec::new(),
            transport: TransportConfig::default(),
            rpc: RpcConfig::default(),
            ranker: toml::Table::new(),
            trainer: toml::Table::new(),
            launch: toml::Table::new(),
        }
    }

    /// Every problem, each naming its field; `Ok` if none.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut e = Vec::new();
        self.check_cluster(&mut e);
        self.check_server(&mut e);
        self.check_tables(&mut e);
        self.check_transport(&mut e);
        self.check_rpc(&mut e);
        if e.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(e))
        }
    }

    fn check_cluster(&self, e: &mut Vec<FieldError>) {
        let c = &self.cluster;
        if c.name.is_empty() {
            e.push(FieldError::new("cluster.name", "must not be empty"));
        }
        if c.pods == 0 || c.pods > 64 {
            e.push(FieldError::new("cluster.pods", "must be in 1..=64"));
        }
        if c.shards == 0 || c.shards > 4096 {
            e.push(FieldError::new("cluster.shards", "must be in 1..=4096"));
        }
        if c.pods > 0 && c.training_pod >= c.pods {
            e.push(FieldError::new(
                "cluster.training_pod",
                format!("must be < cluster.pods ({})", c.pods),
            ));
        }
        if c.data_dir.as_os_str().is_empty() {
            e.push(FieldError::new("cluster.data_dir", "must not be empty"));
        }
        if c.pods == 0 || c.shards == 0 || c.pods > 64 || c.shards > 4096 {
            return; // addresses cannot be checked against a bad shape
        }
        if let Err(mut errs) = self.build_topology() {
            e.append(&mut errs);
        }
    }

    fn check_server(&self, e: &mut Vec<FieldError>) {
        let s = &self.server;
        if s.max_request_bytes < 4096 || s.max_request_bytes > 1 << 30 {
            e.push(FieldError::new("server.max_request_bytes", "must be in 4096..=1073741824"));
        }
        if s.max_keys_per_request == 0 {
            e.push(FieldError::new("server.max_keys_per_request", "must be ≥ 1"));
        }
        if s.dedupe_window == 0 || s.dedupe_window % 64 != 0 || s.dedupe_window > 1 << 20 {
            e.push(FieldError::new(
                "server.dedupe_window",
                "must be a multiple of 64 in 64..=1048576",
            ));
        }
        if s.dedupe_max_clients == 0 {
            e.push(FieldError::new("server.dedupe_max_clients", "must be ≥ 1"));
        }
        if s.replication_batch_keys == 0 {
            e.push(FieldError::new("server.replication_batch_keys", "must be ≥ 1"));
        }
        if s.push_ack_timeout_ms == 0 || s.push_ack_timeout_ms > 600_000 {
            e.push(FieldError::new("server.push_ack_timeout_ms", "must be in 1..=600000"));
        }
        if s.drain_timeout_ms > 3_600_000 {
            e.push(FieldError::new("server.drain_timeout_ms", "must be at most 3600000 (1 h)"));
        }
        if s.snapshot_chunk_bytes < 64 * 1024 {
            e.push(FieldError::new(
                "server.snapshot_chunk_bytes",
                "must be ≥ 65536 (one row of the widest table)",
            ));
        }
    }

    fn check_tables(&self, e: &mut Vec<FieldError>) {
        let mut names = HashSet::new();
        for (i, t) in self.tables.iter().enumerate() {
            let p = format!("tables[{i}]");
            let spec = t.spec();
            for err in spec.check() {
                // TableSpec calls the initializer `init`; so does the file.
                e.push(err.prefixed(&p));
            }
            if !names.insert(t.name.as_str()) {
                e.push(FieldError::new(
                    format!("{p}.name"),
                    format!("duplicate table name {:?}", t.name),
                ));
            }
        }
    }

    fn check_transport(&self, e: &mut Vec<FieldError>) {
        let t = &self.transport;
        let mut bad = |f: &str, m: &str| e.push(FieldError::new(format!("transport.{f}"), m));
        if t.endpoints == 0 || t.endpoints > 256 {
            bad("endpoints", "must be in 1..=256");
        }
        if t.port == 0 {
            bad("port", "ports count from 1");
        }
        if !(-1..=255).contains(&t.gid_index) {
            bad("gid_index", "must be -1 (automatic) or in 0..=255");
        }
        if t.app_threads == 0 || t.app_threads > 256 {
            bad("app_threads", "must be in 1..=256");
        }
        if !(2..=16384).contains(&t.sq_depth) {
            bad("sq_depth", "must be in 2..=16384");
        }
        if !(4..=16384).contains(&t.rq_depth) {
            bad("rq_depth", "must be in 4..=16384");
        }
        if u64::from(t.cq_depth) < 2 * (u64::from(t.sq_depth) + u64::from(t.rq_depth)) {
            bad("cq_depth", "must hold at least 2 × (sq_depth + rq_depth)");
        }
        if t.eager_max < 64 || t.eager_max > 1 << 20 {
            bad("eager_max", "must be in 64..=1048576");
        }
        if t.fragment_bytes < 256 || t.fragment_bytes > 1 << 30 {
            bad("fragment_bytes", "must be in 256..=1073741824");
        }
        if t.grant_max_bytes > 1 << 30 {
            bad("grant_max_bytes", "must be at most 1073741824");
        }
        // A soft MTU is whole 4-byte words (RoCE pads payloads to them): 9001 passed here
        // once and then silently became 4096 where the transport took it.
        let soft = (4096..=61440).contains(&t.path_mtu) && t.path_mtu % 4 == 0;
        if !([256, 512, 1024, 2048, 4096].contains(&t.path_mtu) || soft) {
            bad(
                "path_mtu",
                "must be 256, 512, 1024, 2048, 4096 or a soft MTU in 4096..=61440, a multiple of 4",
            );
        }
        if t.keepalive_interval_ms == 0 {
            bad("keepalive_interval_ms", "must be ≥ 1");
        }
        if t.keepalive_timeout_ms <= t.keepalive_interval_ms {
            bad("keepalive_timeout_ms", "must exceed keepalive_interval_ms");
        }
        if t.tcp_keepalive_interval_ms == 0 {
            bad("tcp_keepalive_interval_ms", "must be ≥ 1");
        }
        if t.tcp_keepalive_timeout_ms <= t.tcp_keepalive_interval_ms {
            bad("tcp_keepalive_timeout_ms", "must exceed tcp_keepalive_interval_ms");
        }
        if t.connect_timeout_ms == 0 {
            bad("connect_timeout_ms", "must be ≥ 1");
        }
        if t.max_queued_sends == 0 {
            bad("max_queued_sends", "must be ≥ 1");
        }
    }

    fn check_rpc(&self, e: &mut Vec<FieldError>) {
        let r = &self.rpc;
        let mut bad = |f: &str, m: &str| e.push(FieldError::new(format!("rpc.{f}"), m));
        if r.connect_timeout_ms == 0 {
            bad("connect_timeout_ms", "must be ≥ 1");
        }
        if r.request_timeout_ms == 0 {
            bad("request_timeout_ms", "must be ≥ 1");
        }
        if r.training_request_timeout_ms == 0 || r.training_request_timeout_ms > 600_000 {
            bad("training_request_timeout_ms", "must be in 1..=600000");
        }
        if r.push_retry_ms > 3_600_000 {
            bad("push_retry_ms", "must be at most 3600000 (an hour)");
        }
        if !(0.0..=1.0).contains(&r.retry_probability) {
            bad("retry_probability", "must be in [0, 1]");
        }
        if r.max_attempts == 0 {
            bad("max_attempts", "must be ≥ 1");
        }
        if r.quarantine_window_s == 0 {
            bad("quarantine_window_s", "must be ≥ 1");
        }
        if r.rdma_reprobe_s == 0 {
            bad("rdma_reprobe_s", "must be ≥ 1");
        }
    }

    fn build_topology(&self) -> Result<Topology, Vec<FieldError>> {
        let c = &self.cluster;
        if !c.server_host.is_empty() {
            return self.named_topology();
        }
        if c.servers.is_empty() {
            return Topology::loopback(c.pods, c.shards, c.training_pod, c.host, c.base_port)
                .map_err(|m| vec![FieldError::new("cluster.base_port", m)]);
        }
        let mut errs = Vec::new();
        let n = (c.pods * c.shards) as usize;
        let mut slots: Vec<Option<(usize, ServerAddrs)>> = vec![None; n];
        let mut seen_addr: std::collections::HashMap<String, String> = Default::default();
        for (i, s) in c.servers.iter().enumerate() {
            let p = format!("cluster.servers[{i}]");
            let mut ok = true;
            if s.pod >= c.pods {
                errs.push(FieldError::new(
                    format!("{p}.pod"),
                    format!("must be < cluster.pods ({})", c.pods),
                ));
                ok = false;
            }
            if s.shard >= c.shards {
                errs.push(FieldError::new(
                    format!("{p}.shard"),
                    format!("must be < cluster.shards ({})", c.shards),
                ));
                ok = false;
            }
            let mut parse = |f: &str, v: &str| match parse_host_port(v) {
                Ok((a, host)) => {
                    let here = format!("{p}.{f}");
                    let key = host
                        .as_ref()
                        .map_or_else(|| a.to_string(), |h| format!("{h}:{}", a.port()));
                    if let Some(prev) = seen_addr.insert(key, here.clone()) {
                        errs.push(FieldError::new(
                            here,
                            format!("address {v} already used by {prev}"),
                        ));
                    }
                    Some((a, host))
                }
                Err(m) => {
                    errs.push(FieldError::new(format!("{p}.{f}"), m));
                    None
                }
            };
            let (rdma, tcp, http) =
                (parse("rdma", &s.rdma), parse("tcp", &s.tcp), parse("http", &s.http));
            let (Some((rdma, h1)), Some((tcp, h2)), Some((http, h3)), true) = (rdma, tcp, http, ok)
            else {
                continue;
            };
            if h1 != h2 || h1 != h3 {
                errs.push(FieldError::new(
                    p,
                    "rdma, tcp and http must name the same host (one server is one host)",
                ));
                continue;
            }
            let host = h1.map(std::sync::Arc::from);
            let slot = &mut slots[(s.pod * c.shards + s.shard) as usize];
            if let Some((j, _)) = slot {
                errs.push(FieldError::new(
                    p,
                    format!("duplicate of cluster.servers[{j}] (pod {} shard {})", s.pod, s.shard),
                ));
            } else {
                *slot = Some((i, ServerAddrs { rdma, tcp, http, host }));
            }
        }
        let mut servers = Vec::with_capacity(n);
        for (idx, slot) in slots.into_iter().enumerate() {
            match slot {
                Some((_, a)) => servers.push(a),
                None if errs.is_empty() => {
                    let (pod, shard) = (idx as u32 / c.shards, idx as u32 % c.shards);
                    errs.push(FieldError::new(
                        "cluster.servers",
                        format!("no entry for pod {pod} shard {shard}"),
                    ));
                }
                None => {}
            }
        }
        if !errs.is_empty() {
            return Err(errs);
        }
        Topology::new(c.pods, c.shards, c.training_pod, servers)
            .map_err(|m| vec![FieldError::new("cluster", m)])
    }

    /// `server_host`: server (p, s) on host `server_host` with `{pod}` = p, `{shard}` = s.
    fn named_topology(&self) -> Result<Topology, Vec<FieldError>> {
        let c = &self.cluster;
        let field = |m: String| vec![FieldError::new("cluster.server_host", m)];
        if !c.servers.is_empty() {
            return Err(field("give either server_host or [[cluster.servers]], not both".into()));
        }
        if !c.server_host.contains("{shard}") || (c.pods > 1 && !c.server_host.contains("{pod}")) {
            return Err(field(format!(
                "{:?} must contain {{shard}} (and {{pod}} with several pods): one host per server",
                c.server_host
            )));
        }
        if c.base_port > u16::MAX - 2 {
            return Err(vec![FieldError::new("cluster.base_port", "must leave room for +2")]);
        }
        let mut servers = Vec::new();
        for pod in 0..c.pods {
            for shard in 0..c.shards {
                let name = c
                    .server_host
                    .replace("{pod}", &pod.to_string())
                    .replace("{shard}", &shard.to_string());
                check_host_name(&name).map_err(field)?;
                let at =
                    |d: u16| SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), c.base_port + d);
                servers.push(ServerAddrs {
                    rdma: at(0),
                    tcp: at(1),
                    http: at(2),
                    host: Some(name.into()),
                });
            }
        }
        Topology::new(c.pods, c.shards, c.training_pod, servers).map_err(field)
    }

    /// The cluster's topology (explicit or derived addresses). Named servers are not
    /// resolved here (see [`Topology::resolve_with`]): their addresses are unspecified.
    pub fn topology(&self) -> Result<Topology, ConfigError> {
        self.build_topology().map_err(ConfigError::Invalid)
    }

    /// The table definitions, by id.
    pub fn table_specs(&self) -> Vec<TableSpec> {
        self.tables.iter().map(TableConfig::spec).collect()
    }

    /// The decoder limits of a server.
    pub fn limits(&self) -> Limits {
        Limits {
            max_frame_bytes: self.server.max_request_bytes,
            max_keys: self.server.max_keys_per_request,
            max_dim: MAX_DIM,
        }
    }

    /// Checkpoint file of (pod, shard): `<data_dir>/pod<pod>/shard<shard>.ckpt`.
    pub fn checkpoint_path(&self, pod: u32, shard: u32) -> PathBuf {
        self.cluster.data_dir.join(format!("pod{pod}")).join(format!("shard{shard}.ckpt"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(r: Result<Config, ConfigError>) -> Vec<String> {
        r.unwrap_err().fields().iter().map(|e| e.field.clone()).collect()
    }

    /// `configs/local.toml` is the commented reference of every setting: each key a section
    /// has is written there (set, or as a commented example), so none is known only from the
    /// code.
    #[test]
    fn the_example_file_names_every_key_of_every_section() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/local.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let file: toml::Table = toml::from_str(&text).unwrap();
        let defaults: toml::Table =
            toml::from_str(&Config::local(2, 2, 17000).to_toml_string().unwrap()).unwrap();
        let mut missing = Vec::new();
        for (section, keys) in &defaults {
            let Some(keys) = keys.as_table() else { continue };
            for key in keys.keys() {
                let written = file.get(section).and_then(|s| s.get(key)).is_some()
                    || text.contains(&format!("\n# {key} ="))
                    || text.contains(&format!("\n# [[{section}.{key}]]"));
                if !written {
                    missing.push(format!("{section}.{key}"));
                }
            }
        }
        // `[[tables]]` is an array (the loop above skips it, and the defaults have none): the
        // keys of an entry with every field set, written in some entry or as an example.
        let mut entry = Config::from_toml_str(&text).unwrap().tables.remove(0);
        entry.seed = Some(1);
        let entry = toml::Value::try_from(&entry).unwrap();
        let entries = file.get("tables").and_then(toml::Value::as_array).unwrap();
        for key in entry.as_table().unwrap().keys() {
            let written = entries.iter().any(|t| t.get(key).is_some())
                || text.contains(&format!("\n# {key} ="));
            if !written {
                missing.push(format!("tables.{key}"));
            }
        }
        assert_eq!(entry.as_table().unwrap().len(), 7, "every field of an entry: {entry}");
        assert!(missing.is_empty(), "configs/local.toml does not name {missing:?}");
    }

    #[test]
    fn example_file_parses_and_validates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/local.toml");
        let c = Config::load(&path).unwrap();
        let topo = c.topology().unwrap();
        assert_eq!((topo.pods(), topo.shards()), (c.cluster.pods, c.cluster.shards));
        assert!(!c.tables.is_empty());
        for spec in c.table_specs() {
            assert!(spec.check().is_empty(), "{spec:?}");
        }
        // Round trip through TOML.
        let again = Config::from_toml_str(&c.to_toml_string().unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn minimal_file_takes_defaults() {
        let c = Config::from_toml_str(
            r#"
            [cluster]
            pods = 2
            shards = 3
            [[tables]]
            name = "user"
            dim = 8
            optimizer = { kind = "adam" }
            "#,
        )
        .unwrap();
        assert_eq!(c.rpc.request_timeout_ms, 40);
        assert_eq!(c.rpc.connect_timeout_ms, 10);
        assert_eq!(
            (c.rpc.quarantine_connect_failures, c.rpc.quarantine_request_failures),
            (30, 50)
        );
        let spec = &c.table_specs()[0];
        assert_eq!(
            spec.optimizer,
            Optimizer::Adam { lr: 0.001, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
        );
        assert_eq!(spec.init, Initializer::Uniform { scale: 0.01 });
        assert_eq!(spec.seed, seed_from_name("user"));
        let topo = c.topology().unwrap();
        assert_eq!(topo.server(1, 2).unwrap().http.port(), 17000 + 3 * 5 + 2);
        assert_eq!(c.checkpoint_path(1, 2), Path::new("data/pod1/shard2.ckpt"));
    }

    #[test]
    fn table_admission_parses_and_is_checked() {
        let file = |admission: &str| {
            format!(
                "[cluster]\npods = 1\nshards = 1\n[[tables]]\nname = \"t\"\ndim = 4\n{admission}\n"
            )
        };
        let c = Config::from_toml_str(&file("admission = { after_pushes = 3 }")).unwrap();
        assert_eq!(
            c.table_specs()[0].admission,
            Admission { after_pushes: 3, sketch_width: 1 << 14 }
        );
        assert_eq!(
            Config::from_toml_str(&file("")).unwrap().table_specs()[0].admission.after_pushes,
            0
        );
        let bad = Config::from_toml_str(&file(
            "admission = { after_pushes = 70000, sketch_width = 1000 }",
        ));
        assert_eq!(
            fields(bad),
            ["tables[0].admission.after_pushes", "tables[0].admission.sketch_width"]
        );
        assert!(Config::from_toml_str(&file("admission = { after = 3 }")).is_err(), "unknown key");
    }

    #[test]
    fn errors_name_their_fields() {
        let text = r#"
            [cluster]
            pods = 0
            shards = 2
            [server]
            dedupe_window = 100
            [[tables]]
            name = "a"
            dim = 4
            [[tables]]
            name = "a"
            dim = 4
            [[tables]]
            name = "c"
            dim = 5000
            optimizer = { kind = "adagrad", lr = -1.0 }
            init = { kind = "normal", std = -2.0 }
            [transport]
            keepalive_timeout_ms = 50
            tcp_keepalive_timeout_ms = 500
            path_mtu = 9001
            [rpc]
            retry_probability = 1.5
        "#;
        let got = fields(Config::from_toml_str(text));
        assert_eq!(
            got,
            [
                "cluster.pods",
                "server.dedupe_window",
                "tables[1].name",
                "tables[2].dim",
                "tables[2].init.std",
                "tables[2].optimizer.lr",
                "transport.path_mtu",
                "transport.keepalive_timeout_ms",
                "transport.tcp_keepalive_timeout_ms",
                "rpc.retry_probability",
            ]
        );
        let msg = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(msg.contains("cluster.pods: must be in 1..=64"), "{msg}");
        assert!(msg.contains("tables[2].dim: must be in 1..=4096"), "{msg}");
    }

    #[test]
    fn unknown_keys_and_bad_kinds_are_parse_errors() {
        let e = Config::from_toml_str("[cluster]\npods = 1\nshards = 1\nshard = 3\n").unwrap_err();
        assert!(matches!(&e, ConfigError::Parse(m) if m.contains("shard")), "{e}");
        let e = Config::from_toml_str(
            "[cluster]\npods = 1\nshards = 1\n[[tables]]\nname='t'\ndim=1\noptimizer={kind='rmsprop'}\n",
        )
        .unwrap_err();
        assert!(matches!(&e, ConfigError::Parse(m) if m.contains("rmsprop")), "{e}");
        let e = Config::from_toml_str(
            "[cluster]\npods = 1\nshards = 1\n[[tables]]\nname='t'\ndim=1\noptimizer={kind='sgd', lrr=1}\n",
        )
        .unwrap_err();
        assert!(matches!(&e, ConfigError::Parse(m) if m.contains("lrr")), "{e}");
    }

    #[test]
    fn explicit_servers_are_checked() {
        let text = r#"
            [cluster]
            pods = 2
            shards = 1
            training_pod = 2
            [[cluster.servers]]
            pod = 0
            shard = 0
            rdma = "127.0.0.1:1"
            tcp = "127.0.0.1:2"
            http = "127.0.0.1:2"
            [[cluster.servers]]
            pod = 0
            shard = 0
            rdma = "127.0.0.1:4"
            tcp = "nowhere"
            http = "127.0.0.1:6"
            [[cluster.servers]]
            pod = 1
            shard = 1
            rdma = "127.0.0.1:7"
            tcp = "127.0.0.1:8"
            http = "127.0.0.1:9"
        "#;
        assert_eq!(
            fields(Config::from_toml_str(text)),
            [
                "cluster.training_pod",
                "cluster.servers[0].http",
                "cluster.servers[1].tcp",
                "cluster.servers[2].shard",
            ]
        );
        let ok = r#"
            [cluster]
            pods = 1
            shards = 2
            [[cluster.servers]]
            pod = 0
            shard = 1
            rdma = "10.0.0.2:1"
            tcp = "10.0.0.2:2"
            http = "10.0.0.2:3"
            [[cluster.servers]]
            pod = 0
            shard = 0
            rdma = "10.0.0.1:1"
            tcp = "10.0.0.1:2"
            http = "10.0.0.1:3"
        "#;
        let t = Config::from_toml_str(ok).unwrap().topology().unwrap();
        assert_eq!(t.server(0, 1).unwrap().rdma, "10.0.0.2:1".parse().unwrap());
        let missing = ok.replace("shard = 1", "shard = 0");
        assert!(fields(Config::from_toml_str(&missing)).contains(&"cluster.servers[1]".to_string()));
    }

    #[test]
    fn servers_may_be_dns_names_or_a_template_of_them() {
        let text = r#"
            [cluster]
            pods = 1
            shards = 2
            [[cluster.servers]]
            pod = 0
            shard = 0
            rdma = "ps-0.bex:7000"
            tcp = "ps-0.bex:7001"
            http = "ps-0.bex:7002"
            [[cluster.servers]]
            pod = 0
            shard = 1
            rdma = "[::1]:7000"
            tcp = "[::1]:7001"
            http = "[::1]:7002"
        "#;
        let t = Config::from_toml_str(text).unwrap().topology().unwrap();
        let a = t.server(0, 0).unwrap();
        assert_eq!(a.host.as_deref(), Some("ps-0.bex"));
        assert!(a.unresolved() && a.tcp.port() == 7001);
        assert_eq!(t.server(0, 1).unwrap().host, None);
        for (bad, field) in [
            ("tcp = \"ps-1.bex:7001\"", "cluster.servers[0]"), // another host
            ("tcp = \"ps_0:7001\"", "cluster.servers[0].tcp"), // not a host name
            ("tcp = \"-ps:7001\"", "cluster.servers[0].tcp"),
            ("tcp = \"ps-0.bex:70001\"", "cluster.servers[0].tcp"),
            ("tcp = \"::1:7001\"", "cluster.servers[0].tcp"), // IPv6 needs brackets
            ("tcp = \"ps-0.bex:7000\"", "cluster.servers[0].tcp"), // same as rdma
        ] {
            let t = text.replace("tcp = \"ps-0.bex:7001\"", bad);
            assert_eq!(fields(Config::from_toml_str(&t)), [field], "{bad}");
        }

        let template = r#"
            [cluster]
            pods = 2
            shards = 2
            base_port = 9000
            server_host = "bex-ps-p{pod}-{shard}.bex-ps-p{pod}"
        "#;
        let t = Config::from_toml_str(template).unwrap().topology().unwrap();
        let a = t.server(1, 0).unwrap();
        assert_eq!(a.host.as_deref(), Some("bex-ps-p1-0.bex-ps-p1"));
        assert_eq!((a.rdma.port(), a.tcp.port(), a.http.port()), (9000, 9001, 9002));
        let no_shard = template.replace("-{shard}", "");
        assert_eq!(fields(Config::from_toml_str(&no_shard)), ["cluster.server_host"]);
        let both = format!("{template}\n[[cluster.servers]]\npod = 0\nshard = 0\nrdma = \"a:1\"\ntcp = \"a:2\"\nhttp = \"a:3\"\n");
        assert!(fields(Config::from_toml_str(&both)).contains(&"cluster.server_host".to_string()));
        // It survives the round trip through the file bex-cluster writes for its processes.
        let c = Config::from_toml_str(template).unwrap();
        assert_eq!(Config::from_toml_str(&c.to_toml_string().unwrap()).unwrap(), c);
    }

    #[test]
    fn derived_ports_must_fit() {
        let mut c = Config::local(2, 4, 65520); // 24 ports: 65520..=65543
        assert_eq!(fields(c.validate().map(|_| c.clone())), ["cluster.base_port"]);
        c.cluster.base_port = 20000;
        c.validate().unwrap();
    }
}
