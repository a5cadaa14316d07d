//! Fuzz targets for bex's untrusted-input surfaces, one `pub fn <surface>(data: &[u8])` each.
//!
//! Each target runs the decoders of one surface on `data` and panics only when a property is
//! violated: decoders must not panic, and where a format round-trips, `decode(encode(x)) == x`
//! and `encode(decode(b)) == b` up to the bits the format declares don't-care. The same
//! functions run under cargo-fuzz (`fuzz/`, `scripts/fuzz.sh`) for long runs and in the stable
//! smoke test (`tests/smoke.rs`) over seeded random and mutated-valid inputs.
//!
//! | target | surface |
//! | --- | --- |
//! | [`roce_packet`] | the software RNIC's RoCEv2 packet codec (`bex_rnic::soft::packet`) |
//! | [`transport_frame`] | the engine's 64-byte header, the RDMA bootstrap's hello, a grant's message prefix, the TCP transport's hello, proof and frame header |
//! | [`rpc_frame`] | the RPC frame header |
//! | [`rpc_replies`] | a channel's reply matching, under a script of calls and replies |
//! | [`ps_wire`] | ps-core request/response frames, control bodies, snapshot chunks |
//! | [`ps_server`] | a `PsServer`'s RPC handler fed a sequence of arbitrary frames |
//! | [`config`] | `Config::from_toml_str` + `validate` + `topology` (+ round trip) |
//!
//! [`seeds`] gives each target's valid encodings (the cargo-fuzz seed corpora and the smoke
//! test's mutation bases).

#![forbid(unsafe_code)]

mod config;
mod ps_server;
mod ps_wire;
mod roce;
mod rpc_replies;
mod seeds;
mod simple;

pub use config::config;
pub use ps_server::{encode_frames, ps_server, repair, split_frames, REPAIR};
pub use ps_wire::ps_wire;
pub use roce::roce_packet;
pub use rpc_replies::rpc_replies;
pub use seeds::seeds;
pub use simple::{rpc_frame, transport_frame};

/// A target: what one input does.
pub type Target = fn(&[u8]);

/// Every target with its name (the cargo-fuzz target and corpus directory name).
pub const TARGETS: [(&str, Target); 7] = [
    ("roce_packet", roce_packet),
    ("transport_frame", transport_frame),
    ("rpc_frame", rpc_frame),
    ("rpc_replies", rpc_replies),
    ("ps_wire", ps_wire),
    ("ps_server", ps_server),
    ("config", config),
];
