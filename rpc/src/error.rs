//! RPC errors.

use std::time::Duration;

use bex_transport::TransportError;

use crate::frame::Status;

/// Why a call failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RpcError {
    /// No reply within the request deadline.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// No connection could be made (within the connection deadline).
    #[error("connect: {0}")]
    Connect(String),
    /// The transport failed under the call.
    #[error("transport: {0}")]
    Transport(TransportError),
    /// The server answered with an error.
    #[error("remote {status:?}: {message}")]
    Remote {
        /// Status code.
        status: Status,
        /// The server's message.
        message: String,
    },
    /// No replica to ask.
    #[error("no replica available")]
    NoReplica,
    /// Something that is not a bex RPC frame.
    #[error("protocol: {0}")]
    Protocol(String),
}

impl RpcError {
    /// An error reply with `status` and `message`.
    pub fn remote(status: Status, message: impl Into<String>) -> RpcError {
        RpcError::Remote { status, message: message.into() }
    }
}
