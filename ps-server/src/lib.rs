//! The parameter server process. Its client side (the fan-out client, transports from the
//! cluster file, `/metrics` series of transports, RPC and process) is `bex-client`, which
//! rankers and trainers link without the server.
//!
//! - [`server`]: one shard of one mini-pod — Fetch, Push (idempotent by client and
//!   sequence), Replicate (the training pod forwards applied rows to the other pods),
//!   Snapshot, Checkpoint, Health, Tables, Admin;
//! - [`shard`]: one shard's server assembled from its transports (the process and the
//!   simulation run the same code);
#![forbid(unsafe_code)]

pub use bex_process::clock;
pub mod server;
pub mod shard;
