//! The ByteExpress layer of bex (paper §5.3–6.3).
//!
//! - [`policy`]: small pure types — the work-request chain, receive credits, the send window,
//!   keepalive, the round-robin scheduler;
//! - [`proto`]: the engine's wire header;
//! - [`rdma`]: the RDMA transport (engines, I/O threads, authenticated bootstrap, sockets);
//! - [`tcp`]: the same socket API over TCP, one connection per socket (fallback and baseline);
//! - [`any`]: [`Transport`] and [`Socket`], either kind behind one type;
//! - [`sim`], [`simio`]: the deterministic simulation, by hand and behind the async API.
#![forbid(unsafe_code)]

pub mod any;
pub mod clock;
pub mod config;
pub(crate) mod engine;
pub mod error;
pub mod msg;
pub mod policy;
pub mod proto;
pub mod rdma;
pub(crate) mod recv;
pub mod sim;
pub mod simio;
pub mod tcp;
pub(crate) mod worker;

pub use any::{Socket, Transport, TransportKind};
pub use config::{Config, CounterSnapshot, Counters};
pub use engine::RemoteTarget;
pub use error::{Result, TransportError};
pub use msg::Msg;
pub use rdma::{RdmaSocket, RdmaTransport};
pub use tcp::{TcpSocket, TcpTransport};
