//! The ranker's settings: the `[ranker]` section of the cluster TOML, overridden by the CLI,
//! checked against the cluster's tables and turned into a [`bex_traffic::WorkloadSpec`] plus
//! the shape of every model.

use bex_ps_proto::Config;
use bex_traffic::{CandidateDist, ModelSpec, SlotSpec, WorkloadSpec};
use serde::Deserialize;

/// Ids drawn for a slot must fit below this, so that `feature << ID_BITS | id` (see
/// [`feature_key`]) keeps every (model, slot) feature in its own key range.
pub const ID_BITS: u32 = 40;

/// One feature slot as written in `[ranker] slots = [...]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotToml {
    /// Table name (an embedding table of the cluster, never the dense table).
    pub table: String,
    /// Ids per request, shared by every candidate (user/context features).
    #[serde(default)]
    pub ids_fixed: u32,
    /// Ids per candidate (item features).
    #[serde(default)]
    pub ids_per_candidate: u32,
    /// Ids are drawn Zipf from `[0, vocab)`.
    #[serde(default = "default_vocab")]
    pub vocab: u64,
    /// Zipf exponent (0 = uniform).
    #[serde(default = "default_zipf")]
    pub zipf_s: f64,
}

fn default_vocab() -> u64 {
    1_000_000
}

fn default_zipf() -> f64 {
    1.0
}

/// The `[ranker]` section; every key is optional (defaults: a short demo that keeps two
/// cores far from saturation).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RankerToml {
    /// Models served; model ids are `0..models`.
    pub models: u32,
    /// `k`: distinct models each request fans out to.
    pub models_per_request: u32,
    /// Hidden width of every model's MLP.
    pub hidden: u32,
    /// Candidates per request, log-uniform in `[candidates_min, candidates_max]`.
    pub candidates_min: u32,
    /// See `candidates_min`.
    pub candidates_max: u32,
    /// Open-loop Poisson arrival rate, requests per second.
    pub rate: f64,
    /// Measured run length, seconds.
    pub seconds: f64,
    /// Unmeasured warm-up before the measured run, seconds.
    pub warmup_seconds: f64,
    /// Requests in flight at most; arrivals beyond it are dropped and counted as errors.
    pub max_outstanding: u32,
    /// Seed of the requests and arrivals.
    pub seed: u64,
    /// Seconds between refreshes of the dense weights from the PS.
    pub dense_refresh_s: f64,
    /// The table holding the dense weights.
    pub dense_table: String,
    /// Feature slots of every model.
    pub slots: Vec<SlotToml>,
}

impl Default for RankerToml {
    fn default() -> Self {
        let slot = |table: &str, fixed, per_cand, vocab, zipf_s| SlotToml {
            table: table.into(),
            ids_fixed: fixed,
            ids_per_candidate: per_cand,
            vocab,
            zipf_s,
        };
        Self {
            models: 2,
            models_per_request: 2,
            hidden: 32,
            candidates_min: 10,
            candidates_max: 1000,
            rate: 200.0,
            seconds: 10.0,
            warmup_seconds: 0.0,
            max_outstanding: 256,
            seed: 1,
            dense_refresh_s: 5.0,
            dense_table: "dense".into(),
            slots: vec![
                slot("user", 4, 0, 1_000_000, 1.05),
                slot("context", 2, 0, 10_000, 1.0),
                slot("item", 0, 1, 10_000_000, 0.9),
                slot("item", 0, 1, 1_000_000, 0.9),
            ],
        }
    }
}

/// Why the settings are unusable (exit code 2).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The `[ranker]` section does not parse (unknown key, wrong type).
    #[error("[ranker]: {0}")]
    Parse(String),
    /// A value is out of range.
    #[error("[ranker] {key}: {message}")]
    Invalid {
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A slot or the dense table names a table the cluster does not have.
    #[error("[ranker] {key}: unknown table {name:?} (the cluster's tables: {known})")]
    UnknownTable {
        /// The key naming it.
        key: String,
        /// The name.
        name: String,
        /// The cluster's table names.
        known: String,
    },
    /// The workload spec is invalid.
    #[error("[ranker]: {0}")]
    Spec(#[from] bex_traffic::SpecError),
}

/// The highest `rate` a ranker takes, requests/s.
pub const MAX_RATE: f64 = 1e6;

fn invalid(key: &str, message: impl Into<String>) -> SettingsError {
    SettingsError::Invalid { key: key.into(), message: message.into() }
}

/// CLI overrides of `[ranker]` (None: keep the file's value).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--rate`.
    pub rate: Option<f64>,
    /// `--seconds`.
    pub seconds: Option<f64>,
    /// `--warmup-seconds`.
    pub warmup_seconds: Option<f64>,
    /// `--max-outstanding`.
    pub max_outstanding: Option<u32>,
    /// `--seed`.
    pub seed: Option<u64>,
}

/// One slot, resolved against the cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// Table id.
    pub table: u32,
    /// Row width of the table.
    pub dim: usize,
    /// Ids per request.
    pub ids_fixed: u32,
    /// Ids per candidate.
    pub ids_per_candidate: u32,
    /// Vocabulary.
    pub vocab: u64,
}

/// The shape of one model (all models share the slot layout; ids differ per model through
/// [`feature_key`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// Model id (also its dense keys' model id).
    pub model: u32,
    /// Slots, in input order.
    pub slots: Vec<Slot>,
    /// Hidden width.
    pub hidden: usize,
}

impl ModelShape {
    /// MLP input width: the slots' dims summed (= `slots·dim` when all dims are equal).
    pub fn input_len(&self) -> usize {
        self.slots.iter().map(|s| s.dim).sum()
    }

    /// Dense parameter count, `[W1 | b1 | w2 | b2]`; equals
    /// `bex_model::dense_len(slots, dim, hidden)` when all slots have width `dim`.
    pub fn dense_len(&self) -> usize {
        bex_model::dense_len(1, self.input_len(), self.hidden)
    }
}

/// The PS key of id `id` of feature `feature` (= model index · slots + slot): each
/// (model, slot) reads its own rows, as distinct features of a real model would.
pub fn feature_key(feature: u32, id: u64) -> u64 {
    u64::from(feature) << ID_BITS | id
}

/// Everything the run needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The merged `[ranker]` values.
    pub raw: RankerToml,
    /// The workload (table ids are the cluster's).
    pub spec: WorkloadSpec,
    /// Per model, in model-id order.
    pub models: Vec<ModelShape>,
    /// Dense table id and row width.
    pub dense_table: u32,
    /// Row width of the dense table.
    pub dense_dim: usize,
}

impl Settings {
    /// Parses `cfg.ranker`, applies `over`, and validates it all against `cfg.tables`.
    pub fn from_config(cfg: &Config, over: &Overrides) -> Result<Settings, SettingsError> {
        let mut raw: RankerToml = toml::Value::Table(cfg.ranker.clone())
            .try_into()
            .map_err(|e: toml::de::Error| SettingsError::Parse(e.to_string()))?;
        if let Some(v) = over.rate {
            raw.rate = v;
        }
        if let Some(v) = over.seconds {
            raw.seconds = v;
        }
        if let Some(v) = over.warmup_seconds {
            raw.warmup_seconds = v;
        }
        if let Some(v) = over.max_outstanding {
            raw.max_outstanding = v;
        }
        if let Some(v) = over.seed {
            raw.seed = v;
        }
        Settings::build(cfg, raw)
    }

    fn build(cfg: &Config, raw: RankerToml) -> Result<Settings, SettingsError> {
        let finite_pos = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(invalid(key, format!("must be finite and > 0, got {v}")))
            }
        };
        finite_pos("rate", raw.rate)?;
        // One process's offered rate: far above what one ranker sends (each request is a
        // fan-out of fetches), and a bound on the schedule it builds (rate x seconds).
        if raw.rate > MAX_RATE {
            return Err(invalid("rate", format!("must be at most {MAX_RATE} requests/s")));
        }
        finite_pos("seconds", raw.seconds)?;
        finite_pos("dense_refresh_s", raw.dense_refresh_s)?;
        if !(raw.warmup_seconds.is_finite() && raw.warmup_seconds >= 0.0) {
            return Err(invalid("warmup_seconds", "must be finite and >= 0"));
        }
        if raw.seconds + raw.warmup_seconds > 86_400.0 {
            return Err(invalid("seconds", "run is limited to one day"));
        }
        // A refresh period past the run never fires; a huge one panicked in `Duration`.
        if raw.dense_refresh_s > 86_400.0 {
            return Err(invalid("dense_refresh_s", "must be at most 86400 (the longest run)"));
        }
        if raw.models == 0 || raw.models > 1024 {
            return Err(invalid("models", "must be in 1..=1024"));
        }
        if raw.hidden == 0 || raw.hidden > 4096 {
            return Err(invalid("hidden", "must be in 1..=4096"));
        }
        if raw.max_outstanding == 0 {
            return Err(invalid("max_outstanding", "must be >= 1"));
        }
        if raw.candidates_min == 0 || raw.candidates_min > raw.candidates_max {
            return Err(invalid(
                "candidates_min",
                format!(
                    "need 1 <= candidates_min <= candidates_max, got {}..{}",
                    raw.candidates_min, raw.candidates_max
                ),
            ));
        }
        if raw.candidates_max > 1_000_000 {
            return Err(invalid("candidates_max", "at most 1000000"));
        }
        if raw.slots.is_empty() {
            return Err(invalid("slots", "a model needs at least one slot"));
        }
        let known = || cfg.tables.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ");
        let table_id = |key: &str, name: &str| {
            cfg.tables.iter().position(|t| t.name == name).ok_or_else(|| {
                SettingsError::UnknownTable { key: key.into(), name: name.into(), known: known() }
            })
        };
        let dense_table = table_id("dense_table", &raw.dense_table)?;
        let dense_dim = cfg.tables[dense_table].dim as usize;
        let mut slots = Vec::new();
        for (i, s) in raw.slots.iter().enumerate() {
            let key = format!("slots[{i}].table");
            let t = table_id(&key, &s.table)?;
            if t == dense_table {
                return Err(invalid(&key, "the dense table holds MLP weights, not features"));
            }
            if s.ids_fixed == 0 && s.ids_per_candidate == 0 {
                return Err(invalid(
                    &format!("slots[{i}]"),
                    "needs ids_fixed or ids_per_candidate",
                ));
            }
            if s.ids_fixed > 10_000 || s.ids_per_candidate > 100 {
                return Err(invalid(
                    &format!("slots[{i}]"),
                    "ids_fixed <= 10000 and ids_per_candidate <= 100",
                ));
            }
            if s.vocab == 0 || s.vocab > 1 << ID_BITS {
                return Err(invalid(&format!("slots[{i}].vocab"), "must be in 1..=2^40"));
            }
            slots.push(Slot {
                table: t as u32,
                dim: cfg.tables[t].dim as usize,
                ids_fixed: s.ids_fixed,
                ids_per_candidate: s.ids_per_candidate,
                vocab: s.vocab,
            });
        }
        let models: Vec<ModelShape> = (0..raw.models)
            .map(|m| ModelShape { model: m, slots: slots.clone(), hidden: raw.hidden as usize })
            .collect();
        let spec = WorkloadSpec {
            models: models
                .iter()
                .map(|m| ModelSpec {
                    model: m.model,
                    slots: m
                        .slots
                        .iter()
                        .zip(&raw.slots)
                        .map(|(s, t)| SlotSpec {
                            table: s.table,
                            vocab: s.vocab,
                            zipf_s: t.zipf_s,
                            ids_fixed: s.ids_fixed,
                            ids_per_candidate: s.ids_per_candidate,
                        })
                        .collect(),
                })
                .collect(),
            models_per_request: raw.models_per_request,
            candidates: CandidateDist::LogUniform {
                min: raw.candidates_min,
                max: raw.candidates_max,
            },
        };
        spec.validate()?;
        Ok(Settings { raw, spec, models, dense_table: dense_table as u32, dense_dim })
    }

    /// Checks that a request (e.g. from a trace) fits the models: known model ids, the slot
    /// layout, id counts and vocabularies. Scoring relies on it.
    pub fn check_request(&self, r: &bex_traffic::Request) -> Result<(), String> {
        if r.candidates == 0 {
            return Err("no candidates".into());
        }
        for m in &r.models {
            let shape = self.models.get(m.model as usize).ok_or_else(|| {
                format!("model {} not served (models = {})", m.model, self.models.len())
            })?;
            if m.slots.len() != shape.slots.len() {
                return Err(format!(
                    "model {}: {} slots, the config has {}",
                    m.model,
                    m.slots.len(),
                    shape.slots.len()
                ));
            }
            for (i, (ids, s)) in m.slots.iter().zip(&shape.slots).enumerate() {
                let want = u64::from(s.ids_fixed)
                    + u64::from(s.ids_per_candidate) * u64::from(r.candidates);
                if ids.table != s.table {
                    return Err(format!(
                        "model {} slot {i}: table {} (config: {})",
                        m.model, ids.table, s.table
                    ));
                }
                if ids.ids.len() as u64 != want {
                    return Err(format!(
                        "model {} slot {i}: {} ids, the config wants {want}",
                        m.model,
                        ids.ids.len()
                    ));
                }
                if ids.ids.iter().any(|&id| id >= 1 << ID_BITS) {
                    return Err(format!("model {} slot {i}: an id is >= 2^40", m.model));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(ranker: &str) -> Result<Config, String> {
        let text = bex_testkit::fixtures::ranker_cluster("", ranker);
        Config::from_toml_str(&text).map_err(|e| e.to_string())
    }

    fn settings(ranker: &str) -> Result<Settings, SettingsError> {
        Settings::from_config(&cluster(ranker).unwrap(), &Overrides::default())
    }

    #[test]
    fn defaults_map_onto_the_cluster_tables() {
        let s = settings("").unwrap();
        assert_eq!(s.dense_table, 3);
        assert_eq!(s.dense_dim, 32);
        assert_eq!(s.models.len(), 2);
        let tables: Vec<u32> = s.models[0].slots.iter().map(|x| x.table).collect();
        assert_eq!(tables, vec![0, 2, 1, 1]);
        assert_eq!(s.models[1].input_len(), 16 + 8 + 16 + 16);
        assert_eq!(s.spec.models.len(), 2);
        assert_eq!(s.spec.models[1].slots[2].ids_per_candidate, 1);
        assert!(s.spec.models.iter().flat_map(|m| &m.slots).all(|x| x.table != 3));
        assert_eq!(s.spec.candidates, CandidateDist::LogUniform { min: 10, max: 1000 });
    }

    #[test]
    fn file_values_and_cli_overrides() {
        let cfg = cluster(
            r#"models = 3
models_per_request = 1
rate = 50.0
hidden = 8
candidates_min = 2
candidates_max = 20
slots = [{ table = "item", ids_per_candidate = 2, vocab = 100, zipf_s = 0.5 }]"#,
        )
        .unwrap();
        let s = Settings::from_config(&cfg, &Overrides::default()).unwrap();
        assert_eq!((s.raw.rate, s.raw.models, s.spec.models_per_request), (50.0, 3, 1));
        assert_eq!(s.models[2].dense_len(), bex_model::dense_len(1, 16, 8));
        let over = Overrides { rate: Some(7.0), seed: Some(9), ..Overrides::default() };
        let s = Settings::from_config(&cfg, &over).unwrap();
        assert_eq!((s.raw.rate, s.raw.seed, s.raw.hidden), (7.0, 9, 8));
    }

    #[test]
    fn bad_settings_are_rejected_with_the_key() {
        let err = |r: &str| settings(r).unwrap_err().to_string();
        let e = err(r#"slots = [{ table = "nope", ids_fixed = 1 }]"#);
        assert!(e.contains("unknown table \"nope\"") && e.contains("user, item"), "{e}");
        let e = err(r#"slots = [{ table = "dense", ids_fixed = 1 }]"#);
        assert!(e.contains("slots[0].table"), "{e}");
        assert!(err("dense_table = \"x\"").contains("unknown table"));
        assert!(err("rate = 0.0").contains("rate"));
        assert!(err("rate = -3.0").contains("rate"));
        assert!(err("rate = 1e9").contains("at most"));
        assert!(err("candidates_min = 0").contains("candidates_min"));
        assert!(err("candidates_min = 50\ncandidates_max = 5").contains("candidates_min"));
        assert!(err("models_per_request = 3").contains("models_per_request"));
        assert!(err("bogus = 1").contains("bogus"));
        assert!(err("slots = []").contains("slots"));
        assert!(err(r#"slots = [{ table = "user" }]"#).contains("slots[0]"));
        let over = Overrides { seconds: Some(f64::NAN), ..Overrides::default() };
        assert!(Settings::from_config(&cluster("").unwrap(), &over).is_err());
    }

    #[test]
    fn requests_are_checked_against_the_models() {
        let s = settings("").unwrap();
        let mut g = bex_traffic::RequestGen::new(s.spec.clone(), 3).unwrap();
        let r = g.next();
        assert_eq!(s.check_request(&r), Ok(()));
        let mut bad = r.clone();
        bad.models[0].slots[2].ids.pop();
        assert!(s.check_request(&bad).unwrap_err().contains("ids"));
        let mut bad = r.clone();
        bad.models[0].model = 7;
        assert!(s.check_request(&bad).unwrap_err().contains("not served"));
        let mut bad = r;
        bad.models[0].slots[0].table = 1;
        assert!(s.check_request(&bad).unwrap_err().contains("table"));
    }

    #[test]
    fn the_local_config_shows_the_defaults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/local.toml");
        let cfg = Config::load(&path).unwrap();
        let s = Settings::from_config(&cfg, &Overrides::default()).unwrap();
        assert_eq!(s.raw, RankerToml::default(), "configs/local.toml [ranker] vs the defaults");
    }

    #[test]
    fn features_get_disjoint_key_ranges() {
        assert_ne!(feature_key(0, 5), feature_key(1, 5));
        assert_eq!(feature_key(2, 5) >> ID_BITS, 2);
        assert_eq!(feature_key(2, 5) & ((1 << ID_BITS) - 1), 5);
    }
}
