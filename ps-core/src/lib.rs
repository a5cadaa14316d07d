//! The network-free core of bex's parameter server (DESIGN §7): what rankers, trainers and
//! servers must agree on, and the server's in-memory state, with no I/O but files.
//!
//! - [`shard`]: the stable shard hash `shard_of(key, n)` (documented formula, golden tests).
//! - [`wire`]: the hot-path protocol — fixed little-endian request/response headers followed
//!   by raw key and value arrays, encoded into and decoded from byte slices (a registered
//!   `Msg`), with typed errors and no panics on any input; [`control`]: the serde control
//!   messages (postcard) of the non-data ops.
//! - [`config`] and [`topology`]: the cluster TOML (pods × shards, addresses, training pod,
//!   tables, transport, RPC) with validation errors that name the field; the derived
//!   loopback layout.
//! - [`table`], [`init`], [`optim`]: named tables with deterministic per-key initializers and
//!   server-side optimizers (SGD, Adagrad, Adam, FTRL) over striped concurrent storage.
//! - [`dedupe`]: push idempotence by (client id, sequence) in bounded per-client windows.
//! - [`checkpoint`]: atomic checksummed checkpoint files and the streaming snapshot chunks
//!   that bootstrap a replica from a peer.
//! - [`fanout`]: client-side planning — dedup keys, split by shard, merge in request order.
//! - [`metrics`]: a small Prometheus text-format registry.
//! - [`replication`]: the training pod's replication lag bookkeeping.
//!
//! Nothing here reads a clock or sleeps; callers pass times in.
#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod config;
pub mod control;
pub mod dedupe;
pub mod fanout;
pub mod init;
pub mod metrics;
pub mod optim;
pub mod replication;
pub mod shard;
pub mod table;
pub mod topology;
pub mod wire;

pub use config::{Config, ConfigError, FieldError};
pub use fanout::FanoutPlan;
pub use shard::shard_of;
pub use table::{Table, TableSet, TableSpec};
pub use topology::Topology;
pub use wire::{Limits, Op, Status, WireError};

/// The tests' one wall-clock read (an origin to add durations to; nothing waits on it).
#[cfg(test)]
pub(crate) mod test_clock {
    /// Some instant.
    #[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read of this crate
    pub fn origin() -> std::time::Instant {
        std::time::Instant::now()
    }
}
