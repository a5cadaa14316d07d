//! `ps-bench`: latency, throughput and CPU of one `ps-server` shard through the fan-out
//! `PsClient`, over RDMA (the software RNIC, or a hardware NIC) against TCP in the same run.
//!
//! It spawns a real `ps-server` child (1 pod × 1 shard; 2 pods with `--push-ack`) on loopback
//! with a generated config, or drives a running cluster (`--cluster`). Every cell is a closed
//! loop: `outstanding` tasks, each with one request in flight, issue the next request when the
//! previous one completes; RDMA and TCP are compared at the same outstanding count (the same
//! offered concurrency, not the same request rate). Latency is measured per request around
//! `PsClient::fetch`/`push` (encode, RPC, decode, merge).
//!
//! - [`cli`]: the command line and the run.
//! - [`cluster`]: the generated cluster file and the server children.
//! - [`cell`]: one cell's load (warm table or fresh keys) and its latency histogram.
//! - [`usage`]: what a cell cost both processes (CPU, context switches, transport counts).
//! - [`report`]: the typed JSON report, the tables, the targets and ratios, the figures.
//!
//! Clock, statistics, pinning, options, report envelope and the child guard are the harness's
//! ([`bex_bench`]).

#![forbid(unsafe_code)]

pub mod cell;
pub mod cli;
pub mod cluster;
pub mod report;
pub mod usage;

/// The tool's name, in its reports.
pub const TOOL: &str = "ps-bench";

/// Row dimension of the benchmark table.
pub const DIM: u32 = 64;

/// The benchmark table.
pub const TABLE: u32 = 0;

/// Why the tool failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The harness (pinning, files, the server child, bad arguments).
    #[error(transparent)]
    Harness(#[from] bex_bench::Error),
    /// Anything else, said in words (the cluster file, the client, the transports).
    #[error("{0}")]
    Other(String),
}

impl From<String> for Error {
    fn from(s: String) -> Error {
        Error::Other(s)
    }
}

impl From<&str> for Error {
    fn from(s: &str) -> Error {
        Error::Other(s.to_string())
    }
}

/// Bad arguments (exit status 2).
impl bex_bench::cli::ToolError for Error {
    fn is_usage(&self) -> bool {
        matches!(self, Error::Harness(h) if h.is_usage())
    }
}

/// Result of the tool's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
