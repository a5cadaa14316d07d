//! The ByteExpress layer of bex (paper §5.3–6.3).
//!
//! - [`policy`]: small pure types — the work-request chain, receive credits, the send window,
//!   keepalive, the round-robin scheduler;
//! - [`proto`]: the engine's wire header.
#![forbid(unsafe_code)]

pub mod clock;
pub mod policy;
pub mod proto;
