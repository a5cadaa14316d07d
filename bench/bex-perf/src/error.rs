//! The one error type of the tool: the harness's errors, and the transport's.

pub use bex_bench::error::io;
use bex_transport::TransportError;

/// Why a job, a session or the tool failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// What any benchmark can fail of: I/O, the control protocol, the peer, time, the data,
    /// the arguments, the server child, pinning.
    #[error(transparent)]
    Harness(#[from] bex_bench::Error),
    /// A transport operation failed (connect, send, receive, start).
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// Opening the software RNIC or one of its resources failed.
    #[error("RNIC: {0}")]
    Rnic(#[from] bex_rnic::Error),
    /// Opening the NIC (`--nic`) or starting a transport on it failed.
    #[error(transparent)]
    Stack(#[from] bex_transport::StackError),
}

/// Bad arguments or a NIC that is not here: exit status 2.
impl bex_bench::cli::ToolError for BenchError {
    fn is_usage(&self) -> bool {
        match self {
            BenchError::Harness(e) => e.is_usage(),
            BenchError::Stack(s) => s.exit_code() == 2,
            _ => false,
        }
    }
}

/// Result of the tool's operations.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
