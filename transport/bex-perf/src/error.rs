//! The one error type of the tool.

use std::time::Duration;

use bex_rnic_perf::PerfError;
use bex_transport::TransportError;

/// Why a job, a session or the tool failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A transport operation failed (connect, send, receive, start).
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// Opening the software RNIC or one of its resources failed.
    #[error("RNIC: {0}")]
    Rnic(#[from] bex_rnic::Error),
    /// Opening the NIC (`--nic`) or starting a transport on it failed.
    #[error(transparent)]
    Stack(#[from] bex_transport::StackError),
    /// The shared harness (pinning, the server child) failed.
    #[error(transparent)]
    Harness(#[from] PerfError),
    /// A socket, file, thread or process operation failed.
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
    /// The server reported a failure of the current job.
    #[error("server reported: {0}")]
    Remote(String),
    /// A job or a reply did not finish in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long was waited.
        after: Duration,
    },
    /// A reply was not what was sent (length, sequence number).
    #[error("data check failed: {0}")]
    Check(String),
    /// The arguments are inconsistent.
    #[error("{0}")]
    Usage(String),
}

/// Result of the tool's operations.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Adapts an `io::Error` into [`BenchError::Io`]: `.map_err(io("bind"))`.
pub fn io<S: Into<String>>(what: S) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io { what: what.into(), source }
}
