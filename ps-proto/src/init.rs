//! Deterministic per-key initializers: the initial row of a key is a pure function of
//! (table seed, key, element index), computed with integer mixing and at most three
//! IEEE-754 f32 operations, so every replica (on any platform, of any build) creates the same
//! bits without coordination.
//!
//! Element `i` of key `k` in a table with seed `s` draws the 64-bit word
//!
//! ```text
//! base = mix64(k ^ mix64(s))
//! h_i  = mix64(base + i·0x9E37_79B9_7F4A_7C15)      (wrapping; = output i+1 of a SplitMix64
//!                                                      generator seeded with `base`)
//! ```
//!
//! with [`mix64`] the SplitMix64 finalizer, and turns it into a value:
//!
//! - `Zeros`: 0; `Constant { value }`: `value`;
//! - `Uniform { scale }`: `u = (h >> 40) as f32 · 2⁻²⁴` (exact, in `[0, 1)`), value
//!   `(2u − 1) · scale`, in `[−scale, scale)`;
//! - `Normal { std }`: an Irwin–Hall approximation of a Gaussian without transcendental
//!   functions (whose results vary between libms): the four 16-bit lanes of `h` as
//!   `u_j = lane_j · 2⁻¹⁶`, `s = (Σ u_j − 2)` (exact), value `s · √3 · std` (mean 0,
//!   standard deviation `std`, bounded by ±2√3·std ≈ ±3.46·std like a truncated normal).

use serde::{Deserialize, Serialize};

use crate::shard::mix64;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// How a missing row is initialized.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Initializer {
    /// All zeros.
    Zeros,
    /// Every element `value`.
    Constant {
        /// The value.
        value: f32,
    },
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half-width.
        scale: f32,
    },
    /// Approximately normal with mean 0 and standard deviation `std` (bounded at ±3.46 std).
    Normal {
        /// Standard deviation.
        std: f32,
    },
}

impl Default for Initializer {
    fn default() -> Self {
        Initializer::Uniform { scale: 0.01 }
    }
}

impl Initializer {
    /// Problems with the parameters, as (field, message) pairs.
    pub fn check(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        match *self {
            Initializer::Zeros => {}
            Initializer::Constant { value } if !value.is_finite() => {
                out.push(("value", "must be finite".to_string()))
            }
            Initializer::Constant { .. } => {}
            Initializer::Uniform { scale: x } | Initializer::Normal { std: x } => {
                if !(x.is_finite() && x >= 0.0) {
                    let f =
                        if matches!(self, Initializer::Uniform { .. }) { "scale" } else { "std" };
                    out.push((f, "must be finite and ≥ 0".to_string()));
                }
            }
        }
        out
    }

    /// Fills `row` with the initial values of `key` in a table seeded with `seed`.
    pub fn fill(&self, seed: u64, key: u64, row: &mut [f32]) {
        match *self {
            Initializer::Zeros => row.fill(0.0),
            Initializer::Constant { value } => row.fill(value),
            Initializer::Uniform { scale } => {
                let base = mix64(key ^ mix64(seed));
                for (i, x) in row.iter_mut().enumerate() {
                    let h = mix64(base.wrapping_add((i as u64).wrapping_mul(GAMMA)));
                    let u = (h >> 40) as f32 * (1.0 / 16_777_216.0);
                    *x = (2.0 * u - 1.0) * scale;
                }
            }
            Initializer::Normal { std } => {
                let base = mix64(key ^ mix64(seed));
                let k = 1.732_050_8_f32 * std; // √3 · std
                for (i, x) in row.iter_mut().enumerate() {
                    let h = mix64(base.wrapping_add((i as u64).wrapping_mul(GAMMA)));
                    let lanes =
                        (h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48);
                    let s = lanes as f32 * (1.0 / 65_536.0) - 2.0;
                    *x = s * k;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_key_dependent() {
        let init = Initializer::Uniform { scale: 0.5 };
        let (mut a, mut b, mut c) = ([0f32; 8], [0f32; 8], [0f32; 8]);
        init.fill(7, 42, &mut a);
        init.fill(7, 42, &mut b);
        init.fill(7, 43, &mut c);
        assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
        assert_ne!(a, c);
        let mut d = [0f32; 8];
        init.fill(8, 42, &mut d);
        assert_ne!(a, d, "seed matters");
        assert!(a.iter().all(|x| (-0.5..0.5).contains(x)));
    }

    /// Golden bits: replicas of every future version must create these exact rows.
    #[test]
    fn golden_values() {
        let mut u = [0f32; 3];
        Initializer::Uniform { scale: 1.0 }.fill(1, 2, &mut u);
        let mut n = [0f32; 3];
        Initializer::Normal { std: 1.0 }.fill(1, 2, &mut n);
        assert_eq!(u.map(f32::to_bits), GOLDEN_UNIFORM, "{u:?}");
        assert_eq!(n.map(f32::to_bits), GOLDEN_NORMAL, "{n:?}");
    }

    // Computed independently (Python, f32 rounding after every operation).
    const GOLDEN_UNIFORM: [u32; 3] = [1062018270, 3202425424, 3212583288];
    const GOLDEN_NORMAL: [u32; 3] = [3177729970, 3185068595, 3215066476];

    #[test]
    fn moments_are_right() {
        let n = 200_000usize;
        for (init, var) in [
            (Initializer::Uniform { scale: 1.0 }, 1.0 / 3.0),
            (Initializer::Normal { std: 2.0 }, 4.0),
        ] {
            let mut row = vec![0f32; n];
            init.fill(3, 9, &mut row);
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
            let v = row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            assert!(mean.abs() < 0.02, "{init:?} mean {mean}");
            assert!((v / var - 1.0).abs() < 0.02, "{init:?} var {v} want {var}");
        }
    }

    #[test]
    fn check_names_fields() {
        assert!(Initializer::Uniform { scale: 0.1 }.check().is_empty());
        assert_eq!(Initializer::Uniform { scale: -1.0 }.check()[0].0, "scale");
        assert_eq!(Initializer::Normal { std: f32::NAN }.check()[0].0, "std");
        assert_eq!(Initializer::Constant { value: f32::INFINITY }.check()[0].0, "value");
    }
}
