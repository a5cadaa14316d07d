//! The trainer's learning logic, with no networking (issue 6, item 2).
//!
//! - [`data`]: [`SyntheticClicks`], a seeded click dataset drawn from a hidden ground-truth
//!   model (Zipf-like ids per categorical slot, a hidden per-id embedding and scorer, labels
//!   ~ Bernoulli(sigmoid(score))), with train and held-out streams split by seed.
//! - [`model`]: [`Model`], a small MLP over embedding rows fetched from elsewhere (the PS):
//!   `concat(S·dim) → hidden (ReLU) → 1` with logistic loss. [`Model::forward_backward`]
//!   returns the gradient for every (sample, slot) embedding row — for the caller to sum per
//!   key and push — and the dense gradients, which [`Model::apply`] applies locally (Adam).
//! - [`metrics`]: exact rank-based [`auc`] (ties averaged) and mean [`log_loss`].
//! - [`section`]: [`TrainerSection`], the cluster file's `[trainer]` section and its defaults.
#![forbid(unsafe_code)]

pub mod data;
pub mod metrics;
pub mod model;
pub mod section;

pub use data::{ClicksConfig, Sample, SyntheticClicks};
pub use metrics::{auc, log_loss, sigmoid};
pub use model::{dense_keys, dense_len, DenseGrads, Model, ModelConfig, Step, DENSE_KEY_TAG};
pub use section::TrainerSection;
