//! The request model: what one ranking request asks the parameter servers for.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::zipf::{Zipf, ZipfError};

/// One feature slot of a model: which embedding table it reads and how many ids it asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotSpec {
    /// Embedding table id.
    pub table: u32,
    /// Rows in the table; ids are drawn Zipf from `[0, vocab)`.
    pub vocab: u64,
    /// Zipf exponent of id popularity (0 = uniform).
    pub zipf_s: f64,
    /// Ids per request regardless of candidates (user/context features).
    #[serde(default)]
    pub ids_fixed: u32,
    /// Ids per candidate (item features): this slot asks for
    /// `ids_fixed + ids_per_candidate * candidates` ids.
    #[serde(default)]
    pub ids_per_candidate: u32,
}

/// One model: a named set of feature slots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Model id.
    pub model: u32,
    /// Its feature slots.
    pub slots: Vec<SlotSpec>,
}

/// How many candidates a request ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CandidateDist {
    /// Always `n`.
    Fixed {
        /// The count.
        n: u32,
    },
    /// Uniform over `[min, max]`.
    Uniform {
        /// Smallest count.
        min: u32,
        /// Largest count.
        max: u32,
    },
    /// Log-uniform over `[min, max]`: as many requests with 10–100 candidates as with
    /// 1000–10000, so sizes span orders of magnitude (KB to MB).
    LogUniform {
        /// Smallest count (at least 1).
        min: u32,
        /// Largest count.
        max: u32,
    },
}

impl CandidateDist {
    fn validate(&self) -> Result<(), SpecError> {
        match *self {
            CandidateDist::Fixed { .. } => Ok(()),
            CandidateDist::Uniform { min, max } if min <= max => Ok(()),
            CandidateDist::LogUniform { min, max } if 1 <= min && min <= max => Ok(()),
            _ => Err(SpecError::BadCandidates(self.clone())),
        }
    }

    fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        match *self {
            CandidateDist::Fixed { n } => n,
            CandidateDist::Uniform { min, max } => rng.random_range(min..=max),
            CandidateDist::LogUniform { min, max } => {
                // Continuous log-uniform on [min, max + 1), floored: every integer reachable.
                let lo = f64::from(min).ln();
                let hi = (f64::from(max) + 1.0).ln();
                let x = (lo + rng.random::<f64>() * (hi - lo)).exp();
                // Saturating cast, then clamp against rounding at either end.
                (x as u32).clamp(min, max)
            }
        }
    }
}

/// The whole workload: the models, how many a request uses, and its candidate count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadSpec {
    /// The models a request can use.
    pub models: Vec<ModelSpec>,
    /// `k`: distinct models per request (at most `models.len()`).
    pub models_per_request: u32,
    /// Candidates per request.
    pub candidates: CandidateDist,
}

/// Why a [`WorkloadSpec`] is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// No models, or `models_per_request` is 0 or above the number of models.
    #[error("workload: models_per_request {k} must be in 1..={models}")]
    BadK {
        /// Requested `k`.
        k: u32,
        /// Models available.
        models: usize,
    },
    /// A slot's vocabulary or exponent is invalid.
    #[error("workload: model {model} table {table}: {source}")]
    BadSlot {
        /// Model id.
        model: u32,
        /// Table id.
        table: u32,
        /// The Zipf error.
        source: ZipfError,
    },
    /// The candidate distribution's bounds are inverted or zero where they must not be.
    #[error("workload: bad candidate distribution {0:?}")]
    BadCandidates(CandidateDist),
}

impl WorkloadSpec {
    /// A ranker-shaped default: 4 models, 2 per request, each with 8 user slots (a few ids
    /// each, from 10^7-row tables) and 8 item slots (one id per candidate, from 10^8-row
    /// tables); 10 to 10 000 candidates log-uniform, so requests run from ~2 KB to ~1.3 MB.
    pub fn ranker_default() -> Self {
        let models = (0..4u32)
            .map(|m| {
                let user = (0..8u32).map(|i| SlotSpec {
                    table: m * 100 + i,
                    vocab: 10_000_000,
                    zipf_s: 1.05,
                    ids_fixed: 1 + i % 4,
                    ids_per_candidate: 0,
                });
                let item = (0..8u32).map(|i| SlotSpec {
                    table: m * 100 + 50 + i,
                    vocab: 100_000_000,
                    zipf_s: 0.9,
                    ids_fixed: 0,
                    ids_per_candidate: 1,
                });
                ModelSpec { model: m, slots: user.chain(item).collect() }
            })
            .collect();
        Self {
            models,
            models_per_request: 2,
            candidates: CandidateDist::LogUniform { min: 10, max: 10_000 },
        }
    }

    /// Checks the spec (also done by [`RequestGen::new`]).
    pub fn validate(&self) -> Result<(), SpecError> {
        let k = self.models_per_request;
        if k == 0 || k as usize > self.models.len() {
            return Err(SpecError::BadK { k, models: self.models.len() });
        }
        self.candidates.validate()?;
        for m in &self.models {
            for s in &m.slots {
                Zipf::with_rejection(s.vocab, s.zipf_s).map_err(|source| SpecError::BadSlot {
                    model: m.model,
                    table: s.table,
                    source,
                })?;
            }
        }
        Ok(())
    }
}

/// The ids one slot of one model asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotIds {
    /// Embedding table id.
    pub table: u32,
    /// Row ids, in draw order (duplicates kept: dedup is the client's job).
    pub ids: Vec<u64>,
}

/// One model's part of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// Model id.
    pub model: u32,
    /// Per-slot ids, in the model's slot order.
    pub slots: Vec<SlotIds>,
}

/// One ranking request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Sequence number from the generator (0, 1, 2, ...).
    pub id: u64,
    /// Candidates ranked.
    pub candidates: u32,
    /// The `k` models it uses, in draw order.
    pub models: Vec<ModelRequest>,
}

impl Request {
    /// Bytes per id in [`Request::wire_bytes`].
    pub const ID_BYTES: u64 = 8;
    /// Per-slot overhead (table id, count) in [`Request::wire_bytes`].
    pub const SLOT_BYTES: u64 = 8;
    /// Per-model overhead in [`Request::wire_bytes`].
    pub const MODEL_BYTES: u64 = 8;
    /// Per-request overhead in [`Request::wire_bytes`].
    pub const HEADER_BYTES: u64 = 16;

    /// Total ids over all models and slots.
    pub fn total_ids(&self) -> u64 {
        self.models.iter().flat_map(|m| &m.slots).map(|s| s.ids.len() as u64).sum()
    }

    /// Estimated size of the lookup request on the wire: 8 bytes per id plus small headers.
    pub fn wire_bytes(&self) -> u64 {
        let slots: u64 = self.models.iter().map(|m| m.slots.len() as u64).sum();
        Self::HEADER_BYTES
            + Self::MODEL_BYTES * self.models.len() as u64
            + Self::SLOT_BYTES * slots
            + Self::ID_BYTES * self.total_ids()
    }
}

/// Deterministic request generator: the same spec and seed give the same requests.
#[derive(Debug, Clone)]
pub struct RequestGen {
    spec: WorkloadSpec,
    /// One sampler per slot, `zipfs[model_index][slot_index]`.
    zipfs: Vec<Vec<Zipf>>,
    rng: ChaCha8Rng,
    next_id: u64,
}

impl RequestGen {
    /// A generator for `spec`, seeded with `seed`.
    pub fn new(spec: WorkloadSpec, seed: u64) -> Result<Self, SpecError> {
        spec.validate()?;
        let zipfs = spec
            .models
            .iter()
            .map(|m| {
                m.slots
                    .iter()
                    .map(|s| {
                        Zipf::new(s.vocab, s.zipf_s).map_err(|source| SpecError::BadSlot {
                            model: m.model,
                            table: s.table,
                            source,
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { spec, zipfs, rng: ChaCha8Rng::seed_from_u64(seed), next_id: 0 })
    }

    /// The spec.
    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    /// The next request.
    #[allow(clippy::should_implement_trait)] // also an Iterator; `next` is the brief's name
    pub fn next(&mut self) -> Request {
        let candidates = self.spec.candidates.sample(&mut self.rng);
        // k distinct models by a partial Fisher-Yates shuffle of the indices.
        let mut order: Vec<usize> = (0..self.spec.models.len()).collect();
        let k = self.spec.models_per_request as usize;
        for i in 0..k {
            let j = self.rng.random_range(i..order.len());
            order.swap(i, j);
        }
        let models = order[..k]
            .iter()
            .map(|&mi| {
                let m = &self.spec.models[mi];
                let slots = m
                    .slots
                    .iter()
                    .zip(&self.zipfs[mi])
                    .map(|(s, z)| {
                        let count = u64::from(s.ids_fixed)
                            + u64::from(s.ids_per_candidate) * u64::from(candidates);
                        let ids = (0..count).map(|_| z.sample(&mut self.rng)).collect();
                        SlotIds { table: s.table, ids }
                    })
                    .collect();
                ModelRequest { model: m.model, slots }
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        Request { id, candidates, models }
    }
}

impl Iterator for RequestGen {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        Some(RequestGen::next(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_spec() -> WorkloadSpec {
        WorkloadSpec {
            models: (0..3)
                .map(|m| ModelSpec {
                    model: m,
                    slots: vec![
                        SlotSpec {
                            table: m * 10,
                            vocab: 1000,
                            zipf_s: 1.0,
                            ids_fixed: 2,
                            ids_per_candidate: 0,
                        },
                        SlotSpec {
                            table: m * 10 + 1,
                            vocab: 5_000_000,
                            zipf_s: 0.8,
                            ids_fixed: 0,
                            ids_per_candidate: 3,
                        },
                    ],
                })
                .collect(),
            models_per_request: 2,
            candidates: CandidateDist::Uniform { min: 1, max: 20 },
        }
    }

    #[test]
    fn deterministic_for_a_seed() {
        let a: Vec<Request> = RequestGen::new(small_spec(), 42).unwrap().take(50).collect();
        let b: Vec<Request> = RequestGen::new(small_spec(), 42).unwrap().take(50).collect();
        let c: Vec<Request> = RequestGen::new(small_spec(), 43).unwrap().take(50).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.iter().map(|r| r.id).collect::<Vec<_>>(), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn shape_follows_the_spec() {
        let mut g = RequestGen::new(small_spec(), 1).unwrap();
        for _ in 0..200 {
            let r = g.next();
            assert!((1..=20).contains(&r.candidates));
            assert_eq!(r.models.len(), 2);
            assert_ne!(r.models[0].model, r.models[1].model, "models must be distinct");
            for m in &r.models {
                assert_eq!(m.slots.len(), 2);
                assert_eq!(m.slots[0].table, m.model * 10);
                assert_eq!(m.slots[0].ids.len(), 2);
                assert_eq!(m.slots[1].ids.len(), 3 * r.candidates as usize);
                assert!(m.slots[0].ids.iter().all(|&i| i < 1000));
                assert!(m.slots[1].ids.iter().all(|&i| i < 5_000_000));
            }
            let ids = 2 * (2 + 3 * u64::from(r.candidates));
            assert_eq!(r.total_ids(), ids);
            assert_eq!(r.wire_bytes(), 16 + 2 * 8 + 4 * 8 + 8 * ids);
        }
    }

    #[test]
    fn default_sizes_span_kb_to_mb() {
        let mut g = RequestGen::new(WorkloadSpec::ranker_default(), 7).unwrap();
        let sizes: Vec<u64> = (0..1000).map(|_| g.next().wire_bytes()).collect();
        let min = *sizes.iter().min().unwrap();
        let max = *sizes.iter().max().unwrap();
        assert!(min < 4 << 10, "smallest request {min} B");
        assert!(max > 1 << 20, "largest request {max} B");
    }

    #[test]
    fn log_uniform_is_log_uniform() {
        let d = CandidateDist::LogUniform { min: 1, max: 9999 };
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        // Decades [1,10), [10,100), [100,1000), [1000,10000) should be equally likely.
        let mut decades = [0u32; 4];
        for _ in 0..40_000 {
            let c = d.sample(&mut rng);
            assert!((1..=9999).contains(&c));
            decades[(f64::from(c).log10().floor()) as usize] += 1;
        }
        for n in decades {
            assert!((9_500..10_500).contains(&n), "decades {decades:?}");
        }
    }

    #[test]
    fn bad_specs_are_rejected() {
        let mut s = small_spec();
        s.models_per_request = 4;
        assert!(matches!(RequestGen::new(s, 0), Err(SpecError::BadK { k: 4, models: 3 })));
        let mut s = small_spec();
        s.models_per_request = 0;
        assert!(matches!(RequestGen::new(s, 0), Err(SpecError::BadK { .. })));
        let mut s = small_spec();
        s.models[1].slots[0].vocab = 0;
        assert!(matches!(RequestGen::new(s, 0), Err(SpecError::BadSlot { model: 1, .. })));
        let mut s = small_spec();
        s.candidates = CandidateDist::LogUniform { min: 0, max: 5 };
        assert!(matches!(RequestGen::new(s, 0), Err(SpecError::BadCandidates(_))));
    }

    #[test]
    fn spec_round_trips_through_json() {
        let s = WorkloadSpec::ranker_default();
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<WorkloadSpec>(&j).unwrap(), s);
    }
}
