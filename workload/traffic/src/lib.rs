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
//!
//! ```
//! use std::time::Duration;
//! use bex_traffic::{generate_trace, read_trace, write_trace, Completion, Recorder, WorkloadSpec};
//!
//! // 200 ms of Poisson arrivals at 1000 req/s, written and replayed.
//! let trace =
//!     generate_trace(WorkloadSpec::ranker_default(), 1000.0, Duration::from_millis(200), 1)
//!         .unwrap();
//! let mut file = Vec::new();
//! write_trace(&mut file, &trace).unwrap();
//! assert_eq!(read_trace(&file[..]).unwrap(), trace);
//!
//! // A pretend server that answers everything in 250 µs.
//! let mut rec = Recorder::new();
//! for r in &trace {
//!     let latency = Duration::from_micros(250);
//!     rec.record(Completion {
//!         bytes_sent: r.request.wire_bytes(),
//!         ..Completion::ok(r.offset() + latency, latency)
//!     });
//! }
//! let report = rec.report(Duration::from_millis(200));
//! assert_eq!(report.requests, trace.len() as u64);
//! println!("{}", report.summary());
//! ```
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
    TraceRecord, MAX_TRACE_SPAN_NS,
};
pub use zipf::{Zipf, ZipfError};
