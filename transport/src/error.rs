//! Errors of the transport.

/// What can go wrong on a socket or a transport.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportError {
    /// The connection (engine, or TCP stream) failed; every socket on it gets this.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The peer closed the socket.
    #[error("socket closed by peer")]
    Closed,
    /// Connecting did not finish within the connection deadline.
    #[error("connect to {0} timed out")]
    ConnectTimeout(String),
    /// The peer refused (no listener, wrong shared secret, version mismatch, …).
    #[error("connection refused: {0}")]
    Refused(String),
    /// Registered memory could not be allocated.
    #[error("registered memory: {0}")]
    Alloc(String),
    /// A NIC operation failed.
    #[error("NIC: {0}")]
    Nic(String),
    /// An I/O operation failed.
    #[error("I/O: {0}")]
    Io(String),
    /// A bad argument or configuration (the text names it).
    #[error("invalid: {0}")]
    Invalid(String),
    /// The transport is shutting down.
    #[error("transport shut down")]
    Shutdown,
}

impl From<bex_rnic::Error> for TransportError {
    fn from(e: bex_rnic::Error) -> Self {
        TransportError::Nic(e.to_string())
    }
}

impl From<std::io::Error> for TransportError {
    fn from(e: std::io::Error) -> Self {
        TransportError::Io(e.to_string())
    }
}

/// Result of transport operations.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
