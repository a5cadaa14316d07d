//! `bex-perf`: the paper's transport figures (8–11 and 13, and `paper/002`'s eager-copy
//! comparison) for bex's RDMA transport on the software RNIC, against bex's TCP transport in
//! the same run.
//!
//! - [`cli`]: the command line, the dispatch, and `run` (the server as a reaped child).
//! - [`spec`]: tests, per-job transport settings ([`spec::Knobs`]) and the [`spec::Plan`].
//! - [`client`], [`server`], [`control`]: the two processes and their framed JSON control
//!   channel; the server starts the transports a job asks for and answers every message.
//! - [`net`]: one software RNIC and registered pool per process; transports per job.
//! - [`workload`]: ping-pong, windowed requests, large flows against a ping-pong, broadcast.
//! - [`sim`]: Fig. 13 on the in-memory fabric in virtual time.
//! - [`report`]: tables, targets, JSON, SVG figures (via `bex-plot`).
//!
//! The harness — wall clock, latency histograms, bandwidth medians, CPU pinning, the control
//! framing, common options, the report envelope and the server child — is [`bex_bench`],
//! shared with the other benchmark tools.
#![forbid(unsafe_code)]

pub mod cli;
pub mod client;
pub mod control;
pub mod error;
pub mod net;
pub mod report;
pub mod server;
pub mod sim;
pub mod spec;
pub mod workload;

pub use error::{BenchError, Result};
