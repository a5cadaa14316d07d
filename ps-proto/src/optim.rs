//! Server-side optimizers with per-row state, applied element-wise in f32.
//!
//! A row of dimension `d` stores its values followed by `state_slots() · d` state values
//! (and, for Adam, a per-row step count). Update rules for one element, gradient `g`:
//!
//! - **SGD** `{ lr }`: `w ← w − lr·g`.
//! - **Adagrad** `{ lr, initial_accumulator, eps }` (state `a`, starts at
//!   `initial_accumulator`): `a ← a + g²; w ← w − lr·g / (√a + eps)`.
//! - **Adam** `{ lr, beta1, beta2, eps }` (state `m, v` from 0; step `t` per row, "lazy" Adam:
//!   a row's `t` counts only the pushes that touched it): `t ← t + 1;
//!   m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; w ← w − lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + eps)`.
//! - **FTRL-Proximal** `{ alpha, beta, l1, l2, initial_accumulator }` (McMahan et al. 2013;
//!   state `z` from 0, `n` from `initial_accumulator`): `σ = (√(n+g²) − √n)/α;
//!   z ← z + g − σ·w; n ← n + g²; w ← 0 if |z| ≤ l1, else
//!   −(z − sign(z)·l1) / ((β + √n)/α + l2)`. The first update starts from the initializer's
//!   `w`, as in TensorFlow's FTRL.

use serde::{Deserialize, Serialize};

/// A server-side optimizer and its hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    /// Plain SGD.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Adagrad.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Starting value of the accumulator.
        initial_accumulator: f32,
        /// Added to the denominator.
        eps: f32,
    },
    /// Adam with per-row step counts.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the denominator.
        eps: f32,
    },
    /// FTRL-Proximal.
    Ftrl {
        /// Learning-rate scale α.
        alpha: f32,
        /// Learning-rate offset β.
        beta: f32,
        /// L1 regularization.
        l1: f32,
        /// L2 regularization.
        l2: f32,
        /// Starting value of `n`.
        initial_accumulator: f32,
    },
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::Sgd { lr: 0.01 }
    }
}

/// Wire/disk code of an optimizer kind (checkpoints record it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum OptimizerKind {
    /// SGD.
    Sgd = 0,
    /// Adagrad.
    Adagrad = 1,
    /// Adam.
    Adam = 2,
    /// FTRL.
    Ftrl = 3,
}

impl OptimizerKind {
    /// The kind with code `b`.
    pub fn from_u8(b: u8) -> Option<OptimizerKind> {
        [OptimizerKind::Sgd, OptimizerKind::Adagrad, OptimizerKind::Adam, OptimizerKind::Ftrl]
            .into_iter()
            .find(|k| *k as u8 == b)
    }
}

impl Optimizer {
    /// The kind.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            Optimizer::Sgd { .. } => OptimizerKind::Sgd,
            Optimizer::Adagrad { .. } => OptimizerKind::Adagrad,
            Optimizer::Adam { .. } => OptimizerKind::Adam,
            Optimizer::Ftrl { .. } => OptimizerKind::Ftrl,
        }
    }

    /// State values per element (0 SGD, 1 Adagrad, 2 Adam and FTRL).
    pub fn state_slots(&self) -> usize {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::Adagrad { .. } => 1,
            Optimizer::Adam { .. } | Optimizer::Ftrl { .. } => 2,
        }
    }

    /// Problems with the hyperparameters, as (field, message) pairs.
    pub fn check(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let mut positive = |f: &'static str, x: f32| {
            if !(x.is_finite() && x > 0.0) {
                out.push((f, "must be finite and > 0".to_string()));
            }
        };
        match *self {
            Optimizer::Sgd { lr } => positive("lr", lr),
            Optimizer::Adagrad { lr, eps, .. } => {
                positive("lr", lr);
                positive("eps", eps);
            }
            Optimizer::Adam { lr, eps, .. } => {
                positive("lr", lr);
                positive("eps", eps);
            }
            Optimizer::Ftrl { alpha, .. } => positive("alpha", alpha),
        }
        let mut non_negative = |f: &'static str, x: f32| {
            if !(x.is_finite() && x >= 0.0) {
                out.push((f, "must be finite and ≥ 0".to_string()));
            }
        };
        match *self {
            Optimizer::Adagrad { initial_accumulator, .. } => {
                non_negative("initial_accumulator", initial_accumulator)
            }
            Optimizer::Ftrl { beta, l1, l2, initial_accumulator, .. } => {
                non_negative("beta", beta);
                non_negative("l1", l1);
                non_negative("l2", l2);
                non_negative("initial_accumulator", initial_accumulator);
            }
            _ => {}
        }
        if let Optimizer::Adam { beta1, beta2, .. } = *self {
            for (f, b) in [("beta1", beta1), ("beta2", beta2)] {
                if !(0.0..1.0).contains(&b) {
                    out.push((f, "must be in [0, 1)".to_string()));
                }
            }
        }
        out
    }

    /// Initializes the state of a new row (`state.len() == state_slots() · dim`).
    pub fn init_state(&self, state: &mut [f32]) {
        match *self {
            Optimizer::Adagrad { initial_accumulator, .. } => state.fill(initial_accumulator),
            Optimizer::Ftrl { initial_accumulator, .. } => {
                let (z, n) = state.split_at_mut(state.len() / 2);
                z.fill(0.0);
                n.fill(initial_accumulator);
            }
            _ => state.fill(0.0),
        }
    }

    /// Applies gradient `g` to values `w` with state `state` (`state_slots() · w.len()`
    /// values) and the row's step count `steps`. Lengths are the caller's invariant.
    pub fn apply(&self, w: &mut [f32], state: &mut [f32], steps: &mut u32, g: &[f32]) {
        debug_assert_eq!(w.len(), g.len());
        debug_assert_eq!(state.len(), self.state_slots() * w.len());
        match *self {
            Optimizer::Sgd { lr } => {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            Optimizer::Adagrad { lr, eps, .. } => {
                for ((w, a), g) in w.iter_mut().zip(state.iter_mut()).zip(g) {
                    *a += g * g;
                    *w -= lr * g / (a.sqrt() + eps);
                }
            }
            Optimizer::Adam { lr, beta1, beta2, eps } => {
                *steps = steps.saturating_add(1);
                let t = (*steps).min(i32::MAX as u32) as i32;
                let bc1 = 1.0 - beta1.powi(t);
                let bc2 = 1.0 - beta2.powi(t);
                let (m, v) = state.split_at_mut(w.len());
                for (((w, m), v), g) in w.iter_mut().zip(m).zip(v).zip(g) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *w -= lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
                }
            }
            Optimizer::Ftrl { alpha, beta, l1, l2, .. } => {
                let (z, n) = state.split_at_mut(w.len());
                for (((w, z), n), g) in w.iter_mut().zip(z).zip(n).zip(g) {
                    let n_new = *n + g * g;
                    let sigma = (n_new.sqrt() - n.sqrt()) / alpha;
                    *z += g - sigma * *w;
                    *n = n_new;
                    *w = if z.abs() <= l1 {
                        0.0
                    } else {
                        -(*z - z.signum() * l1) / ((beta + n.sqrt()) / alpha + l2)
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        ((a as f64) - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    fn run(opt: Optimizer, w0: f32, grads: &[f32]) -> (f32, Vec<f32>, u32) {
        let mut w = [w0];
        let mut state = vec![0f32; opt.state_slots()];
        opt.init_state(&mut state);
        let mut steps = 0;
        for &g in grads {
            opt.apply(&mut w, &mut state, &mut steps, &[g]);
        }
        (w[0], state, steps)
    }

    #[test]
    fn sgd_by_hand() {
        // 1.0 − 0.1·0.5 = 0.95; 0.95 − 0.1·(−1) = 1.05
        let (w, _, _) = run(Optimizer::Sgd { lr: 0.1 }, 1.0, &[0.5, -1.0]);
        assert!(close(w, 1.05), "{w}");
    }

    #[test]
    fn adagrad_by_hand() {
        let opt = Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 };
        // a = 0.1 + 4 = 4.1; w = 1 − 0.1·2/√4.1
        let w1 = 1.0 - 0.1 * 2.0 / (4.1f64.sqrt() + 1e-8);
        // a = 4.1 + 1 = 5.1; w = w1 − 0.1·(−1)/√5.1
        let w2 = w1 + 0.1 / (5.1f64.sqrt() + 1e-8);
        let (w, s, _) = run(opt, 1.0, &[2.0, -1.0]);
        assert!(close(w, w2), "{w} vs {w2}");
        assert!(close(s[0], 5.1));
    }

    #[test]
    fn adam_by_hand() {
        let (lr, b1, b2, eps) = (0.01f64, 0.9f64, 0.999f64, 1e-8f64);
        let opt =
            Optimizer::Adam { lr: lr as f32, beta1: b1 as f32, beta2: b2 as f32, eps: eps as f32 };
        // Step 1, g = 0.5: m = 0.05, v = 0.00025, m̂ = 0.5, v̂ = 0.25 → w = 1 − 0.01·0.5/0.5 ≈ 0.99
        let (mut m, mut v, mut w) = (0.0f64, 0.0f64, 1.0f64);
        for (t, g) in [(1, 0.5f64), (2, -0.25)] {
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let mh = m / (1.0 - b1.powi(t));
            let vh = v / (1.0 - b2.powi(t));
            w -= lr * mh / (vh.sqrt() + eps);
            if t == 1 {
                assert!((w - 0.99).abs() < 1e-9);
            }
        }
        let (got, s, steps) = run(opt, 1.0, &[0.5, -0.25]);
        assert_eq!(steps, 2);
        assert!(close(got, w), "{got} vs {w}");
        assert!(close(s[0], m) && close(s[1], v), "{s:?} vs {m} {v}");
    }

    #[test]
    fn ftrl_by_hand() {
        let (alpha, beta, l1, l2) = (0.5f64, 1.0f64, 0.1f64, 0.2f64);
        let opt = Optimizer::Ftrl {
            alpha: alpha as f32,
            beta: beta as f32,
            l1: l1 as f32,
            l2: l2 as f32,
            initial_accumulator: 0.0,
        };
        let (mut z, mut n, mut w) = (0.0f64, 0.0f64, 0.3f64);
        for g in [1.0f64, -0.5, 0.05] {
            let sigma = ((n + g * g).sqrt() - n.sqrt()) / alpha;
            z += g - sigma * w;
            n += g * g;
            w = if z.abs() <= l1 {
                0.0
            } else {
                -(z - z.signum() * l1) / ((beta + n.sqrt()) / alpha + l2)
            };
        }
        // First step by hand: σ = 1/0.5 = 2, z = 1 − 2·0.3 = 0.4, n = 1,
        // w = −(0.4 − 0.1)/((1 + 1)/0.5 + 0.2) = −0.3/4.2.
        let (w1, _, _) = run(opt, 0.3, &[1.0]);
        assert!(close(w1, -0.3 / 4.2), "{w1}");
        let (got, s, _) = run(opt, 0.3, &[1.0, -0.5, 0.05]);
        assert!(close(got, w), "{got} vs {w}");
        assert!(close(s[0], z) && close(s[1], n));
    }

    #[test]
    fn ftrl_l1_zeroes_small_weights() {
        let opt =
            Optimizer::Ftrl { alpha: 0.1, beta: 1.0, l1: 10.0, l2: 0.0, initial_accumulator: 0.0 };
        let (w, _, _) = run(opt, 0.5, &[0.1, 0.1]);
        assert_eq!(w, 0.0);
    }

    #[test]
    fn check_names_fields() {
        assert!(Optimizer::default().check().is_empty());
        let bad = Optimizer::Adam { lr: 0.0, beta1: 1.0, beta2: 0.5, eps: 1e-8 };
        let fields: Vec<_> = bad.check().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["lr", "beta1"]);
        let bad = Optimizer::Ftrl {
            alpha: 1.0,
            beta: -1.0,
            l1: 0.0,
            l2: f32::NAN,
            initial_accumulator: 0.0,
        };
        let fields: Vec<_> = bad.check().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["beta", "l2"]);
    }
}
