//! [`Model`]: the dense part of the recommendation model, over embedding rows looked up
//! elsewhere (the trainer fetches them from the PS).
//!
//! Per sample, the input is the `slots` embedding rows of `dim` f32 each, concatenated
//! (`x ∈ R^{slots·dim}`, slot-major). The network is
//!
//! ```text
//! a = W1·x + b1        (W1: hidden × slots·dim)
//! r = relu(a)
//! z = w2·r + b2        (the logit; p = sigmoid(z))
//! ```
//!
//! with mean logistic loss over the batch. Batches are flat slices: `rows` holds
//! `batch × slots × dim` values (sample-major, then slot, then dimension) and the returned row
//! gradients use the same layout, so the gradient of sample `b`, slot `s` is
//! `row_grads[(b·slots + s)·dim ..][..dim]`. They are gradients of the *mean* batch loss; the
//! caller sums them per key (a key may appear in several samples) before pushing them.
//!
//! The dense parameters live here as one flat vector, `[W1 (row-major) | b1 | w2 | b2]`, and
//! are updated with Adam by [`Model::apply`] (or [`Model::train_step`]).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::metrics::{logistic_loss, sigmoid};

/// The shape and optimizer settings of a [`Model`].
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Embedding rows per sample (S).
    pub slots: usize,
    /// Width of one embedding row.
    pub dim: usize,
    /// Width of the hidden ReLU layer.
    pub hidden: usize,
    /// Adam's step size for the dense weights.
    pub learning_rate: f32,
    /// Adam's β1.
    pub beta1: f32,
    /// Adam's β2.
    pub beta2: f32,
    /// Adam's ε.
    pub epsilon: f32,
    /// Seed of the dense weights' initialization.
    pub seed: u64,
}

impl Default for ModelConfig {
    /// 4 slots of 8, 32 hidden units, Adam(0.005, 0.9, 0.999, 1e−8).
    fn default() -> Self {
        Self {
            slots: 4,
            dim: 8,
            hidden: 32,
            learning_rate: 0.005,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            seed: 1,
        }
    }
}

/// Gradients of the mean batch loss w.r.t. the dense parameters, in the flat layout
/// `[W1 | b1 | w2 | b2]` of [`Model::dense`].
#[derive(Debug, Clone, PartialEq)]
pub struct DenseGrads {
    /// One gradient per dense parameter.
    pub flat: Vec<f32>,
}

/// What one [`Model::forward_backward`] computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Mean logistic loss over the batch (before any update).
    pub loss: f32,
    /// One logit per sample (before any update).
    pub logits: Vec<f32>,
    /// Gradient of the mean loss w.r.t. every input row, laid out like the input rows.
    pub row_grads: Vec<f32>,
    /// Gradient of the mean loss w.r.t. the dense parameters.
    pub dense: DenseGrads,
}

/// The MLP with its Adam state (see the module docs).
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    /// `[W1 (hidden × input, row-major) | b1 (hidden) | w2 (hidden) | b2 (1)]`.
    params: Vec<f32>,
    /// Adam's first and second moments, and the number of updates applied.
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl Model {
    /// A model with Glorot-uniform `W1` and `w2` (seeded) and zero biases.
    ///
    /// # Panics
    /// If `slots`, `dim` or `hidden` is zero.
    pub fn new(cfg: ModelConfig) -> Self {
        assert!(cfg.slots > 0 && cfg.dim > 0 && cfg.hidden > 0, "empty model shape");
        let (input, hidden) = (cfg.slots * cfg.dim, cfg.hidden);
        let n = hidden * input + 2 * hidden + 1;
        let mut params = vec![0.0f32; n];
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let a1 = (6.0 / (input + hidden) as f32).sqrt();
        for w in &mut params[..hidden * input] {
            *w = rng.random_range(-a1..a1);
        }
        let a2 = (6.0 / (hidden + 1) as f32).sqrt();
        let w2 = hidden * input + hidden;
        for w in &mut params[w2..w2 + hidden] {
            *w = rng.random_range(-a2..a2);
        }
        Self { m: vec![0.0; n], v: vec![0.0; n], t: 0, params, cfg }
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Values in one sample's input: `slots × dim`.
    pub fn input_len(&self) -> usize {
        self.cfg.slots * self.cfg.dim
    }

    /// The dense parameters, `[W1 (row-major) | b1 | w2 | b2]`.
    pub fn dense(&self) -> &[f32] {
        &self.params
    }

    /// The dense parameters, mutably (for tests and checkpoint restore).
    pub fn dense_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    fn batch_len(&self, rows: &[f32]) -> usize {
        let input = self.input_len();
        assert!(
            rows.len() % input == 0,
            "rows: {} values is not a multiple of {input}",
            rows.len()
        );
        rows.len() / input
    }

    /// The logits of a batch of rows, without gradients.
    ///
    /// # Panics
    /// If `rows.len()` is not a multiple of `slots × dim`.
    pub fn predict(&self, rows: &[f32]) -> Vec<f32> {
        let batch = self.batch_len(rows);
        let mut act = vec![0.0f32; self.cfg.hidden];
        (0..batch)
            .map(|b| self.forward_one(&rows[b * self.input_len()..][..self.input_len()], &mut act))
            .collect()
    }

    /// One sample's logit; leaves the hidden pre-activations in `act`.
    fn forward_one(&self, x: &[f32], act: &mut [f32]) -> f32 {
        let (input, hidden) = (self.input_len(), self.cfg.hidden);
        let (w1, rest) = self.params.split_at(hidden * input);
        let (b1, rest) = rest.split_at(hidden);
        let (w2, b2) = rest.split_at(hidden);
        let mut z = b2[0];
        for h in 0..hidden {
            let row = &w1[h * input..][..input];
            let a = b1[h] + row.iter().zip(x).map(|(w, xi)| w * xi).sum::<f32>();
            act[h] = a;
            z += w2[h] * a.max(0.0);
        }
        z
    }

    /// Forward and backward pass over a batch, without changing the model: the mean loss, the
    /// logits, and the gradients of the mean loss w.r.t. the input rows and the dense weights.
    ///
    /// # Panics
    /// If `rows.len()` is not `labels.len() × slots × dim`, or the batch is empty.
    pub fn forward_backward(&self, rows: &[f32], labels: &[f32]) -> Step {
        let batch = self.batch_len(rows);
        assert_eq!(
            batch,
            labels.len(),
            "forward_backward: {batch} samples, {} labels",
            labels.len()
        );
        assert!(batch > 0, "forward_backward: empty batch");
        let (input, hidden) = (self.input_len(), self.cfg.hidden);
        let w2_at = hidden * input + hidden;
        let mut grads = vec![0.0f32; self.params.len()];
        let mut row_grads = vec![0.0f32; rows.len()];
        let mut logits = Vec::with_capacity(batch);
        let mut act = vec![0.0f32; hidden];
        let mut loss = 0.0f64;
        let inv_b = 1.0 / batch as f32;
        for b in 0..batch {
            let x = &rows[b * input..][..input];
            let z = self.forward_one(x, &mut act);
            logits.push(z);
            loss += f64::from(logistic_loss(z, labels[b]));
            let g = (sigmoid(z) - labels[b]) * inv_b; // d(mean loss)/dz
            let dx = &mut row_grads[b * input..][..input];
            let (gw1, rest) = grads.split_at_mut(hidden * input);
            let (gb1, rest) = rest.split_at_mut(hidden);
            let (gw2, gb2) = rest.split_at_mut(hidden);
            gb2[0] += g;
            for h in 0..hidden {
                let a = act[h];
                if a <= 0.0 {
                    continue; // relu'(a) = 0: no gradient below, w2[h] saw r = 0
                }
                gw2[h] += g * a;
                let da = g * self.params[w2_at + h];
                gb1[h] += da;
                let w1_row = &self.params[h * input..][..input];
                let gw1_row = &mut gw1[h * input..][..input];
                for i in 0..input {
                    gw1_row[i] += da * x[i];
                    dx[i] += da * w1_row[i];
                }
            }
        }
        Step {
            loss: (loss / batch as f64) as f32,
            logits,
            row_grads,
            dense: DenseGrads { flat: grads },
        }
    }

    /// One Adam update of the dense weights from `grads`.
    ///
    /// # Panics
    /// If `grads` does not match the parameter count.
    pub fn apply(&mut self, grads: &DenseGrads) {
        assert_eq!(grads.flat.len(), self.params.len(), "apply: gradient length mismatch");
        let c = &self.cfg;
        self.t = self.t.saturating_add(1);
        let bc1 = 1.0 - c.beta1.powi(self.t);
        let bc2 = 1.0 - c.beta2.powi(self.t);
        let step = c.learning_rate * bc2.sqrt() / bc1;
        for (((p, m), v), &g) in
            self.params.iter_mut().zip(&mut self.m).zip(&mut self.v).zip(&grads.flat)
        {
            *m = c.beta1 * *m + (1.0 - c.beta1) * g;
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
            *p -= step * *m / (v.sqrt() + c.epsilon);
        }
    }

    /// [`Self::forward_backward`] then [`Self::apply`]; returns the step (computed before the
    /// update), whose `row_grads` the caller pushes.
    pub fn train_step(&mut self, rows: &[f32], labels: &[f32]) -> Step {
        let step = self.forward_backward(rows, labels);
        self.apply(&step.dense);
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> (Model, Vec<f32>, Vec<f32>) {
        let cfg = ModelConfig { slots: 3, dim: 4, hidden: 6, seed: 9, ..ModelConfig::default() };
        let mut model = Model::new(cfg);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // Non-zero biases so that every parameter's gradient is exercised.
        let n = model.dense().len();
        for p in &mut model.dense_mut()[n - 13..] {
            *p = rng.random_range(-0.5..0.5);
        }
        let batch = 5;
        let rows: Vec<f32> = (0..batch * 12).map(|_| rng.random_range(-1.0..1.0)).collect();
        let labels: Vec<f32> = (0..batch).map(|b| (b % 2) as f32).collect();
        (model, rows, labels)
    }

    fn mean_loss(model: &Model, rows: &[f32], labels: &[f32]) -> f64 {
        crate::metrics::log_loss(&model.predict(rows), labels)
    }

    fn close(analytic: f32, numeric: f64) -> bool {
        (f64::from(analytic) - numeric).abs() <= 2e-3 * (1.0 + numeric.abs())
    }

    #[test]
    fn dense_gradients_match_finite_differences() {
        let (model, rows, labels) = small();
        let step = model.forward_backward(&rows, &labels);
        assert!((f64::from(step.loss) - mean_loss(&model, &rows, &labels)).abs() < 1e-5);
        assert_eq!(step.logits, model.predict(&rows));
        let eps = 1e-3f32;
        let mut nonzero = 0;
        for i in 0..model.dense().len() {
            let mut plus = model.clone();
            plus.dense_mut()[i] += eps;
            let mut minus = model.clone();
            minus.dense_mut()[i] -= eps;
            let numeric = (mean_loss(&plus, &rows, &labels) - mean_loss(&minus, &rows, &labels))
                / (2.0 * f64::from(eps));
            let analytic = step.dense.flat[i];
            assert!(close(analytic, numeric), "param {i}: analytic {analytic}, numeric {numeric}");
            nonzero += usize::from(analytic.abs() > 1e-4);
        }
        // Most parameters get a gradient (only units dead on the whole batch don't).
        assert!(nonzero > model.dense().len() / 2, "{nonzero} non-zero gradients");
    }

    #[test]
    fn row_gradients_match_finite_differences() {
        let (model, rows, labels) = small();
        let step = model.forward_backward(&rows, &labels);
        assert_eq!(step.row_grads.len(), rows.len());
        let eps = 1e-3f32;
        for i in 0..rows.len() {
            let mut plus = rows.clone();
            plus[i] += eps;
            let mut minus = rows.clone();
            minus[i] -= eps;
            let numeric = (mean_loss(&model, &plus, &labels) - mean_loss(&model, &minus, &labels))
                / (2.0 * f64::from(eps));
            let analytic = step.row_grads[i];
            assert!(
                close(analytic, numeric),
                "row value {i}: analytic {analytic}, numeric {numeric}"
            );
            assert!(analytic != 0.0 || numeric.abs() < 1e-6);
        }
    }

    #[test]
    fn adam_lowers_the_loss_on_a_fixed_batch() {
        let (mut model, rows, labels) = small();
        let before = model.forward_backward(&rows, &labels).loss;
        for _ in 0..300 {
            model.train_step(&rows, &labels);
        }
        let after = model.forward_backward(&rows, &labels).loss;
        assert!(after < before * 0.5, "loss {before} → {after}");
    }

    #[test]
    #[should_panic(expected = "labels")]
    fn mismatched_labels_panic() {
        let (model, rows, _) = small();
        model.forward_backward(&rows, &[0.0]);
    }
}

/// Dense parameters live on the PS as well, as rows of a table `row_dim` wide: chunk `c` of
/// model `model`'s flat parameter vector (`[W1 | b1 | w2 | b2]`, zero-padded to whole rows)
/// is key `DENSE_KEY_TAG | model << 32 | c`. The tag keeps them apart from
/// [`crate::SyntheticClicks::key`]s (`slot << 48 | rank`, slots < 2^15).
pub const DENSE_KEY_TAG: u64 = 1 << 63;

/// The PS keys holding `params` dense parameters of `model` in rows of `row_dim` (see
/// [`DENSE_KEY_TAG`]).
///
/// # Panics
/// If `row_dim` is zero.
pub fn dense_keys(model: u32, params: usize, row_dim: usize) -> Vec<u64> {
    assert!(row_dim > 0, "dense rows need a width");
    (0..params.div_ceil(row_dim) as u64)
        .map(|c| DENSE_KEY_TAG | u64::from(model) << 32 | c)
        .collect()
}

/// Dense parameters of an MLP `slots·dim → hidden → 1`: `W1`, `b1`, `w2` and `b2`.
pub fn dense_len(slots: usize, dim: usize, hidden: usize) -> usize {
    hidden * slots * dim + 2 * hidden + 1
}

#[cfg(test)]
mod dense_key_tests {
    use super::*;

    #[test]
    fn dense_keys_cover_the_parameters_and_never_collide_with_feature_keys() {
        let n = dense_len(4, 8, 32);
        assert_eq!(n, Model::new(ModelConfig::default()).dense().len());
        let k = dense_keys(3, n, 16);
        assert_eq!(k.len(), n.div_ceil(16));
        assert!(k.iter().all(|&k| k & DENSE_KEY_TAG != 0 && (k >> 32) & 0x7fff_ffff == 3));
        assert_ne!(dense_keys(0, 10, 4), dense_keys(1, 10, 4));
        let feature = crate::SyntheticClicks::key(7, 123);
        assert_eq!(feature & DENSE_KEY_TAG, 0);
    }
}
