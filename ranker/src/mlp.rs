//! Scoring: sum pooling of a request's embedding rows into one input row per candidate, and
//! the MLP `input → hidden (ReLU) → 1` evaluated with ndarray on the dense weights fetched
//! from the PS (same flat layout as `bex_model::Model`: `[W1 | b1 | w2 | b2]`).

use ndarray::{Array1, Array2, ArrayView2, Axis};

use crate::settings::Slot;

/// One model's dense weights as matrices.
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    /// `hidden × input`.
    w1: Array2<f32>,
    b1: Array1<f32>,
    w2: Array1<f32>,
    b2: f32,
}

impl Mlp {
    /// Weights from a flat `[W1 (hidden × input, row-major) | b1 | w2 | b2]` vector; extra
    /// values (the zero padding of the last PS row) are ignored.
    pub fn from_flat(params: &[f32], input: usize, hidden: usize) -> Result<Mlp, String> {
        let need = bex_model::dense_len(1, input, hidden);
        if params.len() < need {
            return Err(format!("dense weights: {} values, need {need}", params.len()));
        }
        let (w1, rest) = params.split_at(hidden * input);
        let (b1, rest) = rest.split_at(hidden);
        let (w2, rest) = rest.split_at(hidden);
        let w1 = Array2::from_shape_vec((hidden, input), w1.to_vec())
            .map_err(|e| format!("dense weights: {e}"))?;
        Ok(Mlp { w1, b1: Array1::from(b1.to_vec()), w2: Array1::from(w2.to_vec()), b2: rest[0] })
    }

    /// Input width.
    pub fn input_len(&self) -> usize {
        self.w1.ncols()
    }

    /// Logits of a batch (`candidates × input`).
    pub fn forward(&self, x: ArrayView2<'_, f32>) -> Array1<f32> {
        let mut a = x.dot(&self.w1.t());
        a += &self.b1.view().insert_axis(Axis(0));
        a.mapv_inplace(|v| v.max(0.0));
        let mut z = a.dot(&self.w2);
        z += self.b2;
        z
    }
}

/// Builds the `candidates × input` matrix: for every slot, candidate `c`'s row is the sum of
/// the slot's fixed rows (its first `ids_fixed` ids, shared by all candidates) and of the
/// candidate's own `ids_per_candidate` rows; slots are concatenated in order. `rows[i]` holds
/// slot `i`'s fetched rows, `ids × dim`, in id order.
pub fn pool(slots: &[Slot], rows: &[&[f32]], candidates: usize) -> Result<Array2<f32>, String> {
    let input: usize = slots.iter().map(|s| s.dim).sum();
    let mut x = Array2::<f32>::zeros((candidates, input));
    let mut col = 0;
    for (i, (s, r)) in slots.iter().zip(rows).enumerate() {
        let (fixed, per) = (s.ids_fixed as usize, s.ids_per_candidate as usize);
        if r.len() != (fixed + per * candidates) * s.dim {
            return Err(format!("slot {i}: {} values for {candidates} candidates", r.len()));
        }
        let mut shared = vec![0.0f32; s.dim];
        for row in r[..fixed * s.dim].chunks_exact(s.dim) {
            shared.iter_mut().zip(row).for_each(|(a, b)| *a += b);
        }
        let own = &r[fixed * s.dim..];
        for (c, mut out) in x.rows_mut().into_iter().enumerate() {
            let out = out
                .as_slice_mut()
                .map(|o| &mut o[col..col + s.dim])
                .ok_or("pooled matrix is not contiguous")?;
            out.copy_from_slice(&shared);
            if per > 0 {
                for row in own[c * per * s.dim..(c + 1) * per * s.dim].chunks_exact(s.dim) {
                    out.iter_mut().zip(row).for_each(|(a, b)| *a += b);
                }
            }
        }
        col += s.dim;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bex_model::{Model, ModelConfig};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn forward_matches_bex_model_predict() {
        let cfg = ModelConfig { slots: 3, dim: 4, hidden: 5, seed: 11, ..ModelConfig::default() };
        let mut model = Model::new(cfg);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        // Non-zero biases too, so their positions in the flat layout are checked.
        for p in model.dense_mut() {
            *p = rng.random_range(-0.5..0.5);
        }
        let batch = 7;
        let rows: Vec<f32> = (0..batch * 12).map(|_| rng.random_range(-1.0..1.0)).collect();
        let want = model.predict(&rows);
        // Padding after the parameters (as the last PS row has) must be ignored.
        let mut flat = model.dense().to_vec();
        flat.extend([9.0; 3]);
        let mlp = Mlp::from_flat(&flat, 12, 5).unwrap();
        let x = ArrayView2::from_shape((batch, 12), &rows).unwrap();
        let got = mlp.forward(x);
        assert_eq!(got.len(), batch);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "ndarray {g} vs bex_model {w}");
        }
        assert!(want.iter().any(|w| w.abs() > 1e-3), "a degenerate test: all logits ~0");
        assert!(Mlp::from_flat(&flat[..60], 12, 5).is_err());
    }

    fn slot(dim: usize, fixed: u32, per: u32) -> Slot {
        Slot { table: 0, dim, ids_fixed: fixed, ids_per_candidate: per, vocab: 10 }
    }

    #[test]
    fn pooling_sums_fixed_and_per_candidate_rows() {
        // Slot 0: 2 fixed rows of dim 2. Slot 1: 2 rows per candidate of dim 1 (plus 1 fixed).
        let slots = [slot(2, 2, 0), slot(1, 1, 2)];
        let s0 = [1.0, 2.0, 10.0, 20.0];
        let s1 = [100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let x = pool(&slots, &[&s0, &s1], 3).unwrap();
        assert_eq!(x.shape(), &[3, 3]);
        assert_eq!(x.row(0).to_vec(), vec![11.0, 22.0, 103.0]);
        assert_eq!(x.row(1).to_vec(), vec![11.0, 22.0, 107.0]);
        assert_eq!(x.row(2).to_vec(), vec![11.0, 22.0, 111.0]);
        assert!(pool(&slots, &[&s0, &s1[..6]], 3).is_err());
    }
}
