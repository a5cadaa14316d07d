//! bex's RPC layer (paper §7): requests and responses with ids over transport sockets, with
//! recovery decisions kept above the transport — deadlines, probabilistic retry, replica
//! selection across mini-pods, quarantine, and RDMA-to-TCP fallback with re-probe.
//!
//! - [`frame`]: the 40-byte frame header;
//! - [`channel`]: many outstanding calls over one socket, its replies matched by
//!   [`reply`] (sans-IO);
//! - [`server`]: accept and dispatch to a [`Handler`];
//! - [`client`]: calls to a replicated service with the recovery ladder;
//! - [`policy`]: the pure decision types.
#![forbid(unsafe_code)]

pub mod channel;
pub mod client;
pub mod clock;
pub mod error;
pub mod frame;
pub mod policy;
pub mod reply;
pub mod server;
#[cfg(test)]
mod test_util;

pub use channel::{alloc_frame, next_request_id, Channel};
pub use client::{
    resolve_host, Client, ClientConfig, ClientCounts, ClientStats, DestinationCounts, Endpoint,
    Resolver,
};
pub use error::RpcError;
pub use frame::{ReplyTarget, Status, HEADER_LEN};
pub use server::{serve, Handler, ServerStats};
