//! The `[trainer]` section of the cluster file: the trainer's task and loop settings. Here,
//! beside the task it describes, so every reader (the trainer, bex-chaos's verifier, which
//! must name the same rows) takes one definition and one set of defaults.

use serde::{Deserialize, Serialize};

/// `[trainer]`: every key optional, defaults below (documented in `configs/local.toml`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerSection {
    /// Embedding table (by name) the sample keys are rows of.
    pub table: String,
    /// Table holding the dense MLP weights as rows.
    pub dense_table: String,
    /// Model id of the dense weights' keys (`bex_model::dense_keys`); apart from the
    /// ranker's models.
    pub model_id: u32,
    /// Categorical slots per sample.
    pub slots: usize,
    /// Ids per slot.
    pub vocab: u64,
    /// Zipf exponent of the ids.
    pub zipf_exponent: f64,
    /// Hidden ReLU units of the MLP.
    pub hidden: usize,
    /// Mean samples per step.
    pub batch_size: usize,
    /// σ of the log-normal batch-size spread (0: every batch is `batch_size`).
    pub batch_sigma: f64,
    /// Steps per run (unless `seconds` or `--seconds`).
    pub steps: u64,
    /// Run for this long instead of `steps` when > 0.
    pub seconds: f64,
    /// Held-out evaluation every this many steps (0: only at start and end).
    pub eval_every: u64,
    /// Held-out samples.
    pub eval_samples: usize,
    /// Seed of the hidden ground truth (the same for every trainer).
    pub data_seed: u64,
    /// Deadline of the first fetch (cluster reachable?), seconds.
    pub connect_deadline_s: f64,
}

impl Default for TrainerSection {
    fn default() -> Self {
        TrainerSection {
            table: "item".into(),
            dense_table: "dense".into(),
            model_id: 100,
            slots: 4,
            vocab: 1000,
            zipf_exponent: 1.1,
            hidden: 32,
            batch_size: 448,
            batch_sigma: 0.7,
            steps: 300,
            seconds: 0.0,
            eval_every: 50,
            eval_samples: 2000,
            data_seed: 1,
            connect_deadline_s: 10.0,
        }
    }
}

impl TrainerSection {
    /// Reads the section (absent keys take their defaults; unknown keys and wrong types are
    /// errors, as the message says).
    pub fn from_toml(table: &toml::Table) -> Result<TrainerSection, String> {
        toml::Value::Table(table.clone())
            .try_into()
            .map_err(|e: toml::de::Error| e.message().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_keys_take_defaults_and_unknown_keys_are_errors() {
        let t: toml::Table = toml::from_str("slots = 8").unwrap();
        let s = TrainerSection::from_toml(&t).unwrap();
        assert_eq!((s.slots, s.vocab, s.table.as_str()), (8, 1000, "item"));
        let t: toml::Table = toml::from_str("slot = 8").unwrap();
        assert!(TrainerSection::from_toml(&t).unwrap_err().contains("slot"));
        let t: toml::Table = toml::from_str("slots = \"8\"").unwrap();
        assert!(TrainerSection::from_toml(&t).is_err());
    }
}
