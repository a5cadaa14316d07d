//! `bex-micro`: divan micro-benchmarks of the functions every request crosses (`benches/hot.rs`):
//! the PS wire format's encode and decode, `Table::fetch_into` and `push`, `FanoutPlan::new`,
//! the soft RNIC's packet encode (which computes the RoCEv2 ICRC) and ICRC check, and push
//! dedupe's `admit`.
//!
//! `cargo bench -p bex-micro` measures (medians of divan's samples); `cargo test -p bex-micro
//! --benches` runs each benchmark once, as CI does. A package of its own so divan stays out
//! of the libraries' dependency graphs.
