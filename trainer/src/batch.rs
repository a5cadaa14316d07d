//! A batch's keys deduplicated (each row fetched and pushed once), gradients summed per key,
//! and the dense weights' padding to whole PS rows.

use std::collections::HashMap;

/// The distinct keys of a batch in order of first appearance, and for every (sample, slot)
/// position the index of its key among them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyIndex {
    /// Distinct keys.
    pub unique: Vec<u64>,
    /// `position[i]` is the index in `unique` of the i-th key of the batch (sample-major).
    pub position: Vec<u32>,
}

impl KeyIndex {
    /// Indexes `keys` (sample-major, then slot).
    pub fn new(keys: impl IntoIterator<Item = u64>) -> KeyIndex {
        let mut seen: HashMap<u64, u32> = HashMap::new();
        let mut unique = Vec::new();
        let position = keys
            .into_iter()
            .map(|k| {
                *seen.entry(k).or_insert_with(|| {
                    unique.push(k);
                    (unique.len() - 1) as u32
                })
            })
            .collect();
        KeyIndex { unique, position }
    }

    /// The batch's input rows (one `dim` row per position) from the distinct keys' rows.
    ///
    /// # Panics
    /// If `rows` is not `unique.len() × dim` long.
    pub fn gather(&self, rows: &[f32], dim: usize) -> Vec<f32> {
        assert_eq!(rows.len(), self.unique.len() * dim, "gather: wrong row count");
        let mut out = Vec::with_capacity(self.position.len() * dim);
        for &p in &self.position {
            out.extend_from_slice(&rows[p as usize * dim..][..dim]);
        }
        out
    }

    /// Per-position gradients summed per distinct key (`unique.len() × dim`): a key seen in
    /// several samples gets one row, the sum of theirs.
    ///
    /// # Panics
    /// If `grads` is not `position.len() × dim` long.
    pub fn sum_per_key(&self, grads: &[f32], dim: usize) -> Vec<f32> {
        assert_eq!(grads.len(), self.position.len() * dim, "sum_per_key: wrong length");
        let mut out = vec![0.0f32; self.unique.len() * dim];
        for (i, &p) in self.position.iter().enumerate() {
            let dst = &mut out[p as usize * dim..][..dim];
            for (d, g) in dst.iter_mut().zip(&grads[i * dim..][..dim]) {
                *d += g;
            }
        }
        out
    }
}

/// `flat` zero-padded to whole rows of `row_dim` (the PS stores dense weights as rows).
pub fn pad_to_rows(flat: &[f32], row_dim: usize) -> Vec<f32> {
    let mut v = flat.to_vec();
    v.resize(flat.len().div_ceil(row_dim) * row_dim, 0.0);
    v
}

/// The first `params` values of fetched dense rows; `None` if the rows are too short.
pub fn unpad(rows: &[f32], params: usize) -> Option<&[f32]> {
    rows.get(..params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_fetched_once_and_their_gradients_summed() {
        // Two samples × two slots; key 7 appears three times.
        let idx = KeyIndex::new([7, 9, 7, 7]);
        assert_eq!(idx.unique, vec![7, 9]);
        assert_eq!(idx.position, vec![0, 1, 0, 0]);
        let rows = [1.0, 2.0, 3.0, 4.0]; // key 7: [1, 2], key 9: [3, 4]
        assert_eq!(idx.gather(&rows, 2), vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 1.0, 2.0]);
        let grads = [0.5, 1.0, 10.0, 20.0, 0.25, 0.0, 1.0, -1.0];
        assert_eq!(idx.sum_per_key(&grads, 2), vec![1.75, 0.0, 10.0, 20.0]);
    }

    #[test]
    fn gradient_sum_is_preserved() {
        let keys: Vec<u64> = (0..60).map(|i| (i * 7) % 13).collect();
        let idx = KeyIndex::new(keys.iter().copied());
        let grads: Vec<f32> = (0..60 * 3).map(|i| i as f32 * 0.5).collect();
        let summed = idx.sum_per_key(&grads, 3);
        assert_eq!(summed.len(), idx.unique.len() * 3);
        let total = |v: &[f32]| v.iter().map(|&x| f64::from(x)).sum::<f64>();
        assert!((total(&grads) - total(&summed)).abs() < 1e-6);
        // Key k's row is the sum over the positions holding k.
        for (u, &k) in idx.unique.iter().enumerate() {
            let want: f32 =
                keys.iter().enumerate().filter(|&(_, &x)| x == k).map(|(i, _)| grads[i * 3]).sum();
            assert_eq!(summed[u * 3], want);
        }
    }

    #[test]
    fn padding_round_trips() {
        let flat: Vec<f32> = (1..=10).map(|i| i as f32).collect();
        let padded = pad_to_rows(&flat, 4);
        assert_eq!(padded.len(), 12);
        assert_eq!(&padded[10..], &[0.0, 0.0]);
        assert_eq!(unpad(&padded, 10), Some(&flat[..]));
        assert_eq!(pad_to_rows(&flat[..8], 4).len(), 8);
        assert_eq!(unpad(&padded, 13), None);
        let n = bex_model::dense_len(4, 16, 32);
        assert_eq!(
            pad_to_rows(&vec![1.0; n], 32).len(),
            bex_model::dense_keys(0, n, 32).len() * 32
        );
    }
}
