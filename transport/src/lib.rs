//! The ByteExpress layer of bex (paper §5.3–6.3).
//!
//! - [`policy`]: small pure types — the work-request chain, receive credits, the send window,
//!   keepalive, the round-robin scheduler;
//! - [`proto`]: the engine's wire header.
#![forbid(unsafe_code)]

pub mod clock;
pub mod config;
pub(crate) mod engine;
pub mod error;
pub mod msg;
pub mod policy;
pub mod proto;
pub mod rdma;
pub mod sim;
pub(crate) mod worker;

pub use config::{Config, CounterSnapshot, Counters};
pub use engine::RemoteTarget;
pub use error::{Result, TransportError};
pub use msg::Msg;
pub use rdma::{RdmaSocket, RdmaTransport};
