//! The parameter server process and the client rankers and trainers use.
//!
//! - [`node`]: transports (software RNIC + RDMA, TCP) from the cluster config;
//! - [`server`]: one shard of one mini-pod — Fetch, Push (idempotent by client and
//!   sequence), Replicate (the training pod forwards applied rows to the other pods),
//!   Snapshot, Checkpoint, Health, Tables, Admin;
//! - [`shard`]: one shard's server assembled from its transports (the process and the
//!   simulation run the same code);
//! - [`client`]: the fan-out client;
//! - [`http`]: `/health` and `/metrics`;
//! - [`telemetry`]: the transport, NIC, pool, RPC and process series of `/metrics`.
#![forbid(unsafe_code)]

pub mod client;
pub mod clock;
pub mod http;
pub mod node;
pub mod process;
pub mod server;
pub mod shard;
pub mod telemetry;
