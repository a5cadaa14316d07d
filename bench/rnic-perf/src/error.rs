//! The one error type of the tool: the harness's errors, and the RNIC's.

use bex_rnic::bootstrap::BootstrapError;
use bex_rnic::verbs::{WcOpcode, WcStatus};

pub use bex_bench::error::io;

/// Why a benchmark, a session or the tool failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerfError {
    /// What any benchmark can fail of: I/O, the control protocol, the peer, time, the data,
    /// the arguments, the server child.
    #[error(transparent)]
    Harness(#[from] bex_bench::Error),
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
}

/// Bad arguments or a NIC that is not here: exit status 2.
impl bex_bench::cli::ToolError for PerfError {
    fn is_usage(&self) -> bool {
        match self {
            PerfError::Harness(e) => e.is_usage(),
            PerfError::NoNic(_) => true,
            _ => false,
        }
    }
}

/// Result of the tool's operations.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;
