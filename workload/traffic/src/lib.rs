//! Network-free inference traffic for bex: what a ranker sends, and when.
//!
//! * [`Zipf`]: an exact, seeded-by-the-caller Zipf sampler over `[0, n)`.
//! * [`WorkloadSpec`] / [`RequestGen`]: requests of `k` models, each a set of feature slots
//!   whose ids are drawn Zipf from the slot's vocabulary; candidates per request drawn from a
//!   configurable distribution so request sizes span KB to MB. Deterministic for a seed.
//! * [`Arrivals`]: open-loop Poisson arrivals (exponential gaps) at a target rate.
//! * [`write_trace`] / [`read_trace`]: JSON-lines traces (arrival offset + request) that
//!   replay identically; malformed lines give a [`TraceError`] naming the line, never a panic.
//! * [`Recorder`] / [`Report`]: latency histograms, throughput, outcome counts, bytes and a
//!   per-second time series, as JSON (serde) and as a readable summary.
//!
//! Nothing here reads a clock: times are offsets passed in by the caller.
#![forbid(unsafe_code)]

mod arrivals;
mod report;
mod request;
mod trace;
mod zipf;

pub use arrivals::Arrivals;
pub use report::{Completion, LatencySummary, Outcome, Recorder, Report, SecondBucket};
pub use request::{
    CandidateDist, ModelRequest, ModelSpec, Request, RequestGen, SlotIds, SlotSpec, SpecError,
    WorkloadSpec,
};
pub use trace::{
    generate_trace, read_trace, read_trace_file, write_trace, write_trace_file, TraceError,
    TraceRecord,
};
pub use zipf::{Zipf, ZipfError};
