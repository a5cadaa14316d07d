//! `bex-ps-proto`: what every client and server of bex's parameter server agrees on (DESIGN
//! §7), and nothing only a server needs. No I/O, no runtime, no clock.
//!
//! - [`shard`]: the stable shard hash `shard_of(key, n)` (documented formula, golden tests).
//! - [`wire`]: the hot-path protocol — fixed little-endian request/response headers followed
//!   by raw key and value arrays, encoded into and decoded from byte slices (a registered
//!   `Msg`), with typed errors and no panics on any input; [`control`]: the serde control
//!   messages (postcard) of the non-data ops.
//! - [`config`] and [`topology`]: the cluster TOML (pods × shards, addresses, training pod,
//!   tables, transport, RPC) with validation errors that name the field; the derived
//!   loopback layout.
//! - [`spec`], [`init`], [`optim`]: a table's definition — its deterministic per-key
//!   initializer, which every pod and tool must compute alike, and its optimizer (SGD,
//!   Adagrad, Adam, FTRL): pure functions of a row, its state and a gradient.
//! - [`fanout`]: client-side planning — dedup keys, split by shard, merge in request order.
//! - [`metrics`]: a small Prometheus text-format registry.
//!
//! The server's state — tables, push dedupe, checkpoints, replication lag — is `bex-ps-core`.
#![forbid(unsafe_code)]

pub mod config;
pub mod control;
pub mod fanout;
pub mod init;
pub mod metrics;
pub mod optim;
pub mod shard;
pub mod spec;
pub mod topology;
pub mod wire;

pub use config::{Config, ConfigError, FieldError};
pub use fanout::FanoutPlan;
pub use shard::shard_of;
pub use spec::{Admission, Capacity, TableSpec};
pub use topology::Topology;
pub use wire::{Limits, Op, Status, WireError};
