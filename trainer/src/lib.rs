//! bex's trainer (issue 6): learns a synthetic click model ([`bex_model::SyntheticClicks`])
//! with embedding rows and dense MLP weights both stored on the parameter server.
//!
//! - [`settings`]: the `[trainer]` section merged with the command line, checked against the
//!   cluster's tables.
//! - [`batch`]: a batch's distinct keys, gradients summed per key, dense padding to rows.
//! - [`sizes`]: per-shard message sizes from the wire format.
//! - [`store`]: the [`store::ParamStore`] boundary: the real PS or in-process tables.
//! - [`train`]: the loop (fetch → forward/backward → push) and held-out evaluation.
//!
//! Its JSON report is [`bex_report::TrainerReport`], the type every reader takes it as.
#![forbid(unsafe_code)]

pub mod batch;
pub mod clock;
pub mod settings;
pub mod sizes;
pub mod store;
pub mod train;
