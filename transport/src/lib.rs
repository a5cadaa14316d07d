//! The ByteExpress layer of bex (paper §5.3–6.3).
//!
//! - [`policy`]: small pure types — the work-request chain, receive credits, the send window,
//!   keepalive, the round-robin scheduler;
//! - [`proto`]: the engine's wire header;
//! - `engine` (sans-IO: one QP's protocol), `endpoint` (one CQ's engines and the sockets'
//!   application side), `driver` (the async edge: one task per endpoint on the
//!   application's runtime, woken by the CQ's fd);
//! - [`rdma`]: the RDMA transport (connection table, authenticated bootstrap, engine
//!   placement on endpoints, sockets);
//! - [`auth`]: the peer authentication both transports' handshakes use;
//! - [`tcp`]: the same socket API over TCP, one connection per socket (fallback and baseline);
//! - [`any`]: [`Transport`] and [`Socket`], either kind behind one type;
//! - [`stack`]: the one builder that opens a NIC (software or hardware) and the transports
//!   on it;
//! - [`sim`], [`simio`]: the deterministic simulation, by hand and behind the async API;
//! - `contract` (feature `contract`): the socket contract every transport keeps, one suite
//!   for RDMA, TCP and the simulation.
// One unsafe block: registering a CQ's descriptor with the runtime (`driver`).
#![deny(unsafe_code)]

pub mod any;
pub mod auth;
pub mod clock;
pub mod config;
#[cfg(feature = "contract")]
pub mod contract;
pub(crate) mod driver;
pub(crate) mod endpoint;
pub(crate) mod engine;
pub mod error;
pub(crate) mod log_limit;
pub mod msg;
pub mod policy;
pub mod proto;
pub mod rdma;
pub(crate) mod recv;
pub mod sim;
pub mod simio;
pub mod stack;
pub mod tcp;
pub(crate) mod undo;

pub use any::{Socket, Transport, TransportKind};
pub use bex_rnic::verbs::Mtu;
pub use config::{Config, CounterSnapshot, Counters};
pub use error::{Result, TransportError};
pub use msg::{Msg, Payload, SharedMsg};
pub use proto::RemoteTarget;
pub use rdma::{RdmaSocket, RdmaTransport};
pub use stack::{Nic, NicSpec, NicStats, SoftNic, Stack, StackError, VerbsNic};
pub use tcp::{TcpSocket, TcpTransport};
