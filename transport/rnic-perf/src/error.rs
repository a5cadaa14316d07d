//! The one error type of the tool.

use std::time::Duration;

use bex_rnic::bootstrap::BootstrapError;
use bex_rnic::verbs::{WcOpcode, WcStatus};

/// Why a benchmark, a session or the tool failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerfError {
    /// Opening or using an RNIC resource failed.
    #[error("RNIC: {0}")]
    Rnic(#[from] bex_rnic::Error),
    /// The NIC `--nic` names could not be opened.
    #[error("NIC: {0}")]
    Nic(String),
    /// The NIC `--nic` names does not exist here (exit status 2).
    #[error("NIC: {0}")]
    NoNic(String),
    /// The QP endpoint exchange failed.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// A socket, file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer broke the control protocol (unexpected message, bad frame, closed early).
    #[error("control protocol: {0}")]
    Protocol(String),
    /// The other process reported a failure of the current job.
    #[error("peer reported: {0}")]
    Remote(String),
    /// A completion, a datagram, a memory change or a child process did not come in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long was waited.
        after: Duration,
    },
    /// A work request completed with an error status.
    #[error("work request {wr_id} ({opcode:?}) completed with {status:?}")]
    Completion {
        /// The request.
        wr_id: u64,
        /// Its opcode.
        opcode: WcOpcode,
        /// Its status.
        status: WcStatus,
    },
    /// Data arrived but not what was sent (wrong length, lost messages).
    #[error("data check failed: {0}")]
    Check(String),
    /// The arguments are inconsistent (checked after parsing, e.g. `--batch` > `--window`).
    #[error("{0}")]
    Usage(String),
}

/// Result of the tool's operations.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;

/// Adapts an `io::Error` into [`PerfError::Io`] with a description: `.map_err(io("bind"))`.
pub fn io<S: Into<String>>(what: S) -> impl FnOnce(std::io::Error) -> PerfError {
    move |source| PerfError::Io { what: what.into(), source }
}
