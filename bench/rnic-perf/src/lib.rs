//! `rnic-perf`: perftest-style benchmarks of the bex RNIC, with kernel UDP and TCP baselines
//! measured by the same tool in the same run.
//!
//! - [`cli`]: the command line and dispatch (`server`, `client`, `run`).
//! - [`server`], [`client`], [`launch`]: the two processes and `run`, which runs the server as
//!   a child on loopback.
//! - [`control`]: the framed TCP control channel (job parameters, QP endpoint exchange).
//! - [`baseline`]: `udp_lat`, `tcp_lat`, `tcp_bw` over std sockets.
//! - [`rdma`]: `send_lat`, `write_lat`, `send_bw`, `write_bw`, generic over
//!   [`bex_rnic::Device`]; [`backend::with_device`] is the one place that names a device.
//! - [`mem`]: page-aligned registered buffers (the only `unsafe`).
//! - [`report`]: the table and the JSON document.
//!
//! The clock, statistics, CPU placement, control framing, common options, report envelope and
//! server child are the harness's ([`bex_bench`]), shared with the other benchmark tools.

#![deny(unsafe_code)]

pub mod backend;
pub mod baseline;
pub mod cli;
pub mod client;
pub mod control;
pub mod error;
pub mod launch;
#[cfg(test)]
#[allow(unsafe_code)]
mod loopback;
#[allow(unsafe_code)]
pub mod mem;
pub mod rdma;
pub mod report;
pub mod server;
pub mod spec;

pub use error::{PerfError, Result};
