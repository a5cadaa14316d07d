//! `rnic-perf`: perftest-style benchmarks of the bex RNIC, with kernel UDP and TCP baselines
//! measured by the same tool in the same run.
//!
//! - [`cli`]: the command line and dispatch (`server`, `client`, `run`).
//! - [`server`], [`client`], [`launch`]: the two processes and the launcher that runs the
//!   server as a child on loopback and always reaps it.
//! - [`control`]: the framed TCP control channel (job parameters, QP endpoint exchange).
//! - [`baseline`]: `udp_lat`, `tcp_lat`, `tcp_bw` over std sockets.
//! - [`rdma`]: `send_lat`, `write_lat`, `send_bw`, `write_bw`, generic over
//!   [`bex_rnic::Device`]; [`backend::with_device`] is the one place that names a device.
//! - [`mem`]: page-aligned registered buffers (the only `unsafe`).
//! - [`stats`], [`report`]: percentiles, medians, ratios; the table and the JSON document.
//! - [`pin`]: CPU placement of the two processes (it dominates latency on small VMs).
//! - [`clock`]: the only reader of the wall clock.

#![deny(unsafe_code)]

pub mod backend;
pub mod baseline;
pub mod cli;
pub mod client;
pub mod clock;
pub mod control;
pub mod error;
pub mod launch;
#[cfg(test)]
#[allow(unsafe_code)]
mod loopback;
#[allow(unsafe_code)]
pub mod mem;
pub mod pin;
pub mod rdma;
pub mod report;
pub mod server;
pub mod spec;
pub mod stats;

pub use error::{PerfError, Result};
