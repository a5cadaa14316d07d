//! Fan-out planning for the client side of Fetch and Push (pure; no I/O).
//!
//! A request's keys (with duplicates) become one sub-request per touched shard, each with
//! distinct keys; the responses are merged back into request order. The caller (the RPC
//! layer) sends the parts concurrently — one sub-request per shard — and hands the rows of
//! each back to [`FanoutPlan::merge`] / [`FanoutPlan::merge_le`].
//!
//! ```
//! use bex_ps_proto::fanout::FanoutPlan;
//! let keys = [10u64, 11, 10, 12];
//! let plan = FanoutPlan::new(&keys, 4);
//! // Pretend every shard answers row = [key as f32] (dim 1).
//! let rows: Vec<Vec<f32>> = plan.parts().iter().map(|p| p.keys.iter().map(|&k| k as f32).collect()).collect();
//! let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
//! assert_eq!(plan.merge(1, &refs).unwrap(), [10.0, 11.0, 10.0, 12.0]);
//! ```

use std::collections::HashMap;

use crate::shard::shard_of;
use crate::wire::LeF32s;

/// The keys one shard is asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Shard.
    pub shard: u32,
    /// Distinct keys, in order of first appearance in the request.
    pub keys: Vec<u64>,
}

/// A response part that does not fit the plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FanoutError {
    /// Not one row set per part.
    #[error("{got} response parts for {expected} sub-requests")]
    PartCount {
        /// Parts planned.
        expected: usize,
        /// Parts given.
        got: usize,
    },
    /// A part's rows are not `keys × dim` long.
    #[error("part {part} (shard {shard}): {got} values, expected {expected}")]
    PartLength {
        /// Index of the part.
        part: usize,
        /// Its shard.
        shard: u32,
        /// Values expected.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// The output buffer is not `request keys × dim` long.
    #[error("output of {got} values for {expected}")]
    OutputLength {
        /// Values needed.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// Gradients are not `request keys × dim` long.
    #[error("{got} gradient values for {keys} keys × dim {dim}")]
    GradLength {
        /// Request keys.
        keys: usize,
        /// Dimension.
        dim: usize,
        /// Values given.
        got: usize,
    },
}

/// How a request splits across shards and merges back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FanoutPlan {
    parts: Vec<Part>,
    /// For request position i: (part index, index within the part's keys).
    slots: Vec<(u32, u32)>,
}

impl FanoutPlan {
    /// Plans `keys` over `shards` shards (placement by [`shard_of`]). Parts are in shard
    /// order, only for shards that hold at least one key.
    pub fn new(keys: &[u64], shards: u32) -> FanoutPlan {
        let shards = shards.max(1);
        // part index per shard, assigned lazily; then renumbered in shard order.
        let mut part_of_shard: HashMap<u32, u32, ahash::RandomState> = HashMap::default();
        let mut seen: HashMap<u64, (u32, u32), ahash::RandomState> =
            HashMap::with_capacity_and_hasher(keys.len(), ahash::RandomState::new());
        let mut parts: Vec<Part> = Vec::new();
        let mut slots = Vec::with_capacity(keys.len());
        for &k in keys {
            let slot = *seen.entry(k).or_insert_with(|| {
                let s = shard_of(k, shards);
                let p = *part_of_shard.entry(s).or_insert_with(|| {
                    parts.push(Part { shard: s, keys: Vec::new() });
                    (parts.len() - 1) as u32
                });
                let part = &mut parts[p as usize];
                part.keys.push(k);
                (p, (part.keys.len() - 1) as u32)
            });
            slots.push(slot);
        }
        // Shard order for the parts (stable output, easy to reason about).
        let mut order: Vec<u32> = (0..parts.len() as u32).collect();
        order.sort_by_key(|&p| parts[p as usize].shard);
        let mut renumber = vec![0u32; parts.len()];
        for (new, &old) in order.iter().enumerate() {
            renumber[old as usize] = new as u32;
        }
        for s in &mut slots {
            s.0 = renumber[s.0 as usize];
        }
        let mut sorted: Vec<Option<Part>> = parts.into_iter().map(Some).collect();
        let parts = order.iter().filter_map(|&p| sorted[p as usize].take()).collect();
        FanoutPlan { parts, slots }
    }

    /// One entry per touched shard, in shard order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Keys in the original request (with duplicates).
    pub fn request_len(&self) -> usize {
        self.slots.len()
    }

    /// Distinct keys across all parts.
    pub fn distinct_keys(&self) -> usize {
        self.parts.iter().map(|p| p.keys.len()).sum()
    }

    /// Checks a merge's inputs: one part per planned part, each `keys × dim` long, and an
    /// output of `request_len() × dim`.
    fn check_merge(
        &self,
        dim: usize,
        lens: impl ExactSizeIterator<Item = usize>,
        out_len: usize,
    ) -> Result<(), FanoutError> {
        if lens.len() != self.parts.len() {
            return Err(FanoutError::PartCount { expected: self.parts.len(), got: lens.len() });
        }
        for (i, (got, p)) in lens.zip(&self.parts).enumerate() {
            let expected = p.keys.len() * dim;
            if got != expected {
                return Err(FanoutError::PartLength { part: i, shard: p.shard, expected, got });
            }
        }
        if out_len != self.slots.len() * dim {
            return Err(FanoutError::OutputLength {
                expected: self.slots.len() * dim,
                got: out_len,
            });
        }
        Ok(())
    }

    /// Merges per-part rows (`rows[i]` answers `parts()[i]`, `keys × dim` row-major) into
    /// request order: `request_len() × dim` values.
    pub fn merge(&self, dim: usize, rows: &[&[f32]]) -> Result<Vec<f32>, FanoutError> {
        let mut out = vec![0f32; self.slots.len() * dim];
        self.merge_into(dim, rows, &mut out)?;
        Ok(out)
    }

    /// [`merge`](Self::merge) into a caller's buffer of `request_len() × dim`.
    pub fn merge_into(
        &self,
        dim: usize,
        rows: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), FanoutError> {
        self.check_merge(dim, rows.iter().map(|r| r.len()), out.len())?;
        for (o, &(p, j)) in out.chunks_exact_mut(dim.max(1)).zip(&self.slots) {
            let j = j as usize;
            o.copy_from_slice(&rows[p as usize][j * dim..(j + 1) * dim]);
        }
        Ok(())
    }

    /// [`merge`](Self::merge) straight from Fetch response bodies (little-endian rows).
    pub fn merge_le(&self, dim: usize, rows: &[LeF32s<'_>]) -> Result<Vec<f32>, FanoutError> {
        let mut out = vec![0f32; self.slots.len() * dim];
        self.merge_le_into(dim, rows, &mut out)?;
        Ok(out)
    }

    /// [`merge_le`](Self::merge_le) into a caller's buffer of `request_len() × dim`: the one
    /// copy between the response bodies (registered receive memory) and the caller's rows.
    pub fn merge_le_into(
        &self,
        dim: usize,
        rows: &[LeF32s<'_>],
        out: &mut [f32],
    ) -> Result<(), FanoutError> {
        self.check_merge(dim, rows.iter().map(|r| r.len()), out.len())?;
        for (o, &(p, j)) in out.chunks_exact_mut(dim.max(1)).zip(&self.slots) {
            if let Some(r) = rows[p as usize].row(j as usize, dim) {
                r.copy_to(o);
            }
        }
        Ok(())
    }

    /// Splits request-order gradients (`request_len() × dim`) into per-part gradients in
    /// part key order, summing the gradients of duplicate keys (the gradient of a loss with
    /// respect to a row used twice is the sum of both uses).
    pub fn split_grads(&self, dim: usize, grads: &[f32]) -> Result<Vec<Vec<f32>>, FanoutError> {
        if grads.len() != self.slots.len() * dim {
            return Err(FanoutError::GradLength { keys: self.slots.len(), dim, got: grads.len() });
        }
        let mut out: Vec<Vec<f32>> =
            self.parts.iter().map(|p| vec![0f32; p.keys.len() * dim]).collect();
        for (g, &(p, j)) in grads.chunks_exact(dim.max(1)).zip(&self.slots) {
            let j = j as usize;
            for (o, g) in out[p as usize][j * dim..(j + 1) * dim].iter_mut().zip(g) {
                *o += g;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Each shard answers row(k) = [k, k + 0.5, …] (dim values).
    fn answer(plan: &FanoutPlan, dim: usize) -> Vec<Vec<f32>> {
        plan.parts()
            .iter()
            .map(|p| {
                p.keys
                    .iter()
                    .flat_map(|&k| (0..dim).map(move |d| k as f32 + d as f32 * 0.5))
                    .collect()
            })
            .collect()
    }

    fn expected(keys: &[u64], dim: usize) -> Vec<f32> {
        keys.iter().flat_map(|&k| (0..dim).map(move |d| k as f32 + d as f32 * 0.5)).collect()
    }

    #[test]
    fn empty_request() {
        let plan = FanoutPlan::new(&[], 8);
        assert!(plan.parts().is_empty());
        assert_eq!(plan.request_len(), 0);
        assert_eq!(plan.merge(4, &[]).unwrap(), Vec::<f32>::new());
        assert_eq!(plan.split_grads(4, &[]).unwrap(), Vec::<Vec<f32>>::new());
    }

    #[test]
    fn all_duplicates() {
        let keys = [77u64; 10];
        let plan = FanoutPlan::new(&keys, 8);
        assert_eq!(plan.parts().len(), 1);
        assert_eq!(plan.parts()[0].keys, [77]);
        assert_eq!(plan.parts()[0].shard, shard_of(77, 8));
        let rows = answer(&plan, 3);
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        assert_eq!(plan.merge(3, &refs).unwrap(), expected(&keys, 3));
        let grads = vec![1.0f32; 30];
        assert_eq!(plan.split_grads(3, &grads).unwrap(), [vec![10.0f32; 3]]);
    }

    #[test]
    fn all_one_shard() {
        let keys: Vec<u64> = (0..1000u64).filter(|&k| shard_of(k, 4) == 2).take(20).collect();
        let plan = FanoutPlan::new(&keys, 4);
        assert_eq!(plan.parts().len(), 1);
        assert_eq!(plan.parts()[0].shard, 2);
        assert_eq!(plan.parts()[0].keys, keys);
        // One shard: n = 1 puts everything in shard 0.
        let one = FanoutPlan::new(&[1, 2, 3], 1);
        assert_eq!(one.parts().len(), 1);
        assert_eq!(one.parts()[0].shard, 0);
    }

    #[test]
    fn bad_parts_are_errors_not_panics() {
        let plan = FanoutPlan::new(&[1, 2, 3, 4, 5, 6], 3);
        let rows = answer(&plan, 2);
        let mut refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        assert!(matches!(plan.merge(2, &refs[1..]), Err(FanoutError::PartCount { .. })));
        let short = &rows[0][..rows[0].len() - 1];
        refs[0] = short;
        assert!(matches!(plan.merge(2, &refs), Err(FanoutError::PartLength { part: 0, .. })));
        assert!(matches!(plan.split_grads(2, &[0.0; 5]), Err(FanoutError::GradLength { .. })));
    }

    #[test]
    fn merge_le_matches_merge() {
        let keys = [5u64, 9, 5, 1, 300, 9];
        let plan = FanoutPlan::new(&keys, 5);
        let rows = answer(&plan, 4);
        let bytes: Vec<Vec<u8>> = rows
            .iter()
            .map(|r| {
                let mut b = vec![0u8; r.len() * 4];
                crate::wire::put_f32s(&mut b, r);
                b
            })
            .collect();
        let views: Vec<LeF32s<'_>> = bytes.iter().map(|b| LeF32s::new(b).unwrap()).collect();
        assert_eq!(plan.merge_le(4, &views).unwrap(), expected(&keys, 4));
    }

    proptest! {
        #[test]
        fn plan_invariants(keys in prop::collection::vec(0u64..50, 0..200), shards in 1u32..9, dim in 1usize..4) {
            let plan = FanoutPlan::new(&keys, shards);
            // Parts: sorted by shard, distinct shards, keys distinct and on their shard.
            let mut all = std::collections::HashSet::new();
            for w in plan.parts().windows(2) {
                prop_assert!(w[0].shard < w[1].shard);
            }
            for p in plan.parts() {
                prop_assert!(!p.keys.is_empty());
                for &k in &p.keys {
                    prop_assert_eq!(shard_of(k, shards), p.shard);
                    prop_assert!(all.insert(k));
                }
            }
            let distinct: std::collections::HashSet<_> = keys.iter().collect();
            prop_assert_eq!(all.len(), distinct.len());
            prop_assert_eq!(plan.distinct_keys(), distinct.len());
            // Merge restores request order.
            let rows = answer(&plan, dim);
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            prop_assert_eq!(plan.merge(dim, &refs).unwrap(), expected(&keys, dim));
            // Gradients sum per distinct key.
            let grads: Vec<f32> = (0..keys.len() * dim).map(|i| (i % 3) as f32).collect();
            let split = plan.split_grads(dim, &grads).unwrap();
            let total_in: f32 = grads.iter().sum();
            let total_out: f32 = split.iter().flatten().sum();
            prop_assert_eq!(total_in, total_out);
        }
    }
}
