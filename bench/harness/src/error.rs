//! The harness's error, which every tool's own error wraps: what can go wrong in any
//! benchmark process (I/O, the control protocol, the peer, time, the data, the arguments, the
//! server child), apart from what only one tool knows (its NIC, its transport).

use std::time::Duration;

use bex_process::child::ChildError;

/// Why a benchmark, a session or a tool failed, in terms every tool shares.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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
    /// The other process reported a failure of the current job.
    #[error("peer reported: {0}")]
    Remote(String),
    /// Something awaited did not come in time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long was waited.
        after: Duration,
    },
    /// Data arrived but not what was sent (wrong length, lost messages, wrong sequence).
    #[error("data check failed: {0}")]
    Check(String),
    /// The arguments are inconsistent (checked after parsing); exit status 2.
    #[error("{0}")]
    Usage(String),
    /// The server child could not be started or did not become ready.
    #[error(transparent)]
    Child(#[from] ChildError),
}

impl Error {
    /// True for bad arguments, which tools answer with exit status 2.
    pub fn is_usage(&self) -> bool {
        matches!(self, Error::Usage(_))
    }
}

/// Result of the harness's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adapts an `io::Error` into [`Error::Io`] with a description: `.map_err(io("bind"))?`.
pub fn io<S: Into<String>>(what: S) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what: what.into(), source }
}

/// Constructors of the harness's errors for a tool's own error type (any type that wraps
/// [`Error`]): `PerfError::protocol("…")` instead of spelling out the wrapping.
pub trait Failure: From<Error> {
    /// [`Error::Protocol`].
    fn protocol(message: impl Into<String>) -> Self {
        Error::Protocol(message.into()).into()
    }
    /// [`Error::Remote`].
    fn remote(message: impl Into<String>) -> Self {
        Error::Remote(message.into()).into()
    }
    /// [`Error::Timeout`].
    fn timeout(what: impl Into<String>, after: Duration) -> Self {
        Error::Timeout { what: what.into(), after }.into()
    }
    /// [`Error::Check`].
    fn check(message: impl Into<String>) -> Self {
        Error::Check(message.into()).into()
    }
    /// [`Error::Usage`].
    fn usage(message: impl Into<String>) -> Self {
        Error::Usage(message.into()).into()
    }
}

impl<T: From<Error>> Failure for T {}
