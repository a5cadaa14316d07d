//! `bex-exp`: the paper's two end-to-end comparisons (000 §8), run on clusters started by
//! `bex-cluster` and summarized against the paper's numbers.
//!
//! - **inference** (Tables 5–6): the same offered load (open-loop Poisson, same seed) over
//!   RDMA and over TCP, at one or more rates, repeated and interleaved; per-model fetch
//!   ("PS Pull") mean and P99, request latency, machine-wide CPU user/system/softirq.
//! - **training** (Table 7): several trainers pushing to the same servers (incast), on TCP,
//!   RDMA without the per-engine send window and RDMA with it; busiest trainer's fetch and push
//!   P99 and the RNICs' RNR/NAK/retransmit counters.
//!
//! - **dashboard**: `deploy/grafana/bex-dashboard.json` checked against a cluster's scrapes.
//!
//! Each experiment writes `runs.json` (every run's extracted numbers), `summary.json`
//! (medians per cell), `summary.md` (tables next to the paper's) and SVG plots.

pub mod check;
pub mod dashboard;
pub mod extract;
pub mod paper;
pub mod stats;
pub mod summary;
