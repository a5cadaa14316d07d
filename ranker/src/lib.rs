//! bex's ranker (issue 6, item 1): synthetic inference traffic against the PS.
//!
//! * [`settings`]: the `[ranker]` section of the cluster TOML (plus CLI overrides), checked
//!   against the cluster's tables, as a `bex_traffic::WorkloadSpec` and per-model shapes.
//! * [`mlp`]: sum pooling of each candidate's rows and the MLP forward pass (ndarray) on
//!   dense weights fetched from the PS.
//! * [`run`]: open-loop arrivals (Poisson or a trace), one task per request fanning out to
//!   its models concurrently, a collector with a per-second progress line.
//! * [`report`]: the JSON report and the readable summary.
#![forbid(unsafe_code)]

pub mod mlp;
pub mod report;
pub mod run;
pub mod settings;
