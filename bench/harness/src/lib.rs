//! `bex-bench`: the harness every bex benchmark tool is built on (`rnic-perf`, `bex-perf`,
//! `ps-bench`, `alloc-bench`), so that they measure, place, talk and report alike.
//!
//! - [`clock`]: the only reader of the wall clock in a tool.
//! - [`stats`]: latency histograms, bandwidth medians, ratios.
//! - [`pin`]: where client and server run (it dominates latency on small VMs).
//! - [`control`]: the framed JSON control channel between client and server.
//! - [`server`]: the server's ready line and stdin watch, and `run`'s server child
//!   ([`server::Guard`], `bex-process`'s one child guard).
//! - [`cli`]: the options every tool shares (`server`'s, `--json`/`--out`/`--quiet`).
//! - [`report`]: the envelope every JSON report starts with.
//! - [`error`]: the errors every tool's own error wraps.

#![forbid(unsafe_code)]

pub mod cli;
pub mod clock;
pub mod control;
pub mod error;
pub mod pin;
pub mod report;
pub mod server;
pub mod stats;

pub use error::{Error, Failure, Result};
