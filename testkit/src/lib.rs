//! `bex-testkit`: what bex's tests share (a dev-dependency only).
//!
//! - [`seed`]: the one seed variable, `BEX_SEED=n` or `BEX_SEED=a..b`, its replay line, and
//!   seed ranges split over child processes.
//! - [`ports`]: a block of free loopback ports per test process, split by salt per test.
//! - [`scratch`]: a temporary directory removed on drop.
//! - [`fixtures`]: configs several tests build on.
//! - [`bins`]: another package's binary of this build profile (`ps-server`, built first).
//! - [`cluster`]: [`cluster::LocalCluster`], real `ps-server` processes from a config: start,
//!   wait for `/health`, kill -9, SIGTERM, restart; every one killed and reaped on drop.

#![forbid(unsafe_code)]

pub mod bins;
pub mod cluster;
pub mod fixtures;
pub mod ports;
pub mod scratch;
pub mod seed;

pub use cluster::LocalCluster;
pub use scratch::Scratch;
