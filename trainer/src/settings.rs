//! The `[trainer]` section of the cluster TOML, merged with the command line, and checked
//! against the cluster's tables.

use bex_ps_proto::Config;
use serde::Serialize;

/// Longest duration a setting may give, in seconds (a year).
const MAX_SECONDS: f64 = 365.0 * 86_400.0;

pub use bex_model::TrainerSection;

/// Command-line overrides of [`TrainerSection`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    /// `--steps`.
    pub steps: Option<u64>,
    /// `--seconds`.
    pub seconds: Option<f64>,
    /// `--batch-size`.
    pub batch_size: Option<usize>,
    /// `--eval-every`.
    pub eval_every: Option<u64>,
}

/// A table the trainer uses: its id (position in the config) and row width.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TableRef {
    /// Name.
    pub name: String,
    /// Id on the wire.
    pub id: u32,
    /// Row width.
    pub dim: u32,
}

/// Everything a run needs, resolved and checked.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Settings {
    /// The merged section.
    pub section: TrainerSection,
    /// The embedding table.
    pub emb: TableRef,
    /// The dense table.
    pub dense: TableRef,
    /// Shards per pod (for message-size accounting).
    pub shards: u32,
}

/// Why the `[trainer]` section cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum SettingsError {
    /// The section does not parse (unknown key, wrong type).
    #[error("[trainer]: {0}")]
    Parse(String),
    /// A value is out of range; every problem, one per line.
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

fn table_ref(cfg: &Config, name: &str, field: &str, e: &mut Vec<String>) -> Option<TableRef> {
    match cfg.tables.iter().position(|t| t.name == name) {
        Some(i) => Some(TableRef { name: name.into(), id: i as u32, dim: cfg.tables[i].dim }),
        None => {
            let names: Vec<&str> = cfg.tables.iter().map(|t| t.name.as_str()).collect();
            e.push(format!("trainer.{field}: no table {name:?} (tables: {names:?})"));
            None
        }
    }
}

impl Settings {
    /// Parses `cfg.trainer`, applies `o`, and checks the result against `cfg`'s tables.
    pub fn resolve(cfg: &Config, o: &Overrides) -> Result<Settings, SettingsError> {
        let mut s = TrainerSection::from_toml(&cfg.trainer).map_err(SettingsError::Parse)?;
        if let Some(v) = o.steps {
            s.steps = v;
            s.seconds = 0.0; // --steps wins over a configured duration
        }
        if let Some(v) = o.seconds {
            s.seconds = v;
        }
        if let Some(v) = o.batch_size {
            s.batch_size = v;
        }
        if let Some(v) = o.eval_every {
            s.eval_every = v;
        }
        let mut e = Vec::new();
        let emb = table_ref(cfg, &s.table, "table", &mut e);
        let dense = table_ref(cfg, &s.dense_table, "dense_table", &mut e);
        if emb.is_some() && emb == dense {
            e.push("trainer.dense_table: must differ from trainer.table".into());
        }
        let mut check = |ok: bool, msg: &str| {
            if !ok {
                e.push(format!("trainer.{msg}"));
            }
        };
        check((1..=1024).contains(&s.slots), "slots: must be in 1..=1024");
        check(s.vocab >= 1 && s.vocab < 1 << 40, "vocab: must be in 1..2^40");
        check(
            s.zipf_exponent.is_finite() && (0.0..=5.0).contains(&s.zipf_exponent),
            "zipf_exponent: must be in 0..=5",
        );
        check((1..=4096).contains(&s.hidden), "hidden: must be in 1..=4096");
        check((1..=65536).contains(&s.batch_size), "batch_size: must be in 1..=65536");
        check(
            s.batch_sigma.is_finite() && (0.0..=2.0).contains(&s.batch_sigma),
            "batch_sigma: must be in 0..=2",
        );
        // Bounded: `Duration::from_secs_f64` panics past ~1.8e19 s, and an `Instant` that far
        // ahead overflows.
        check(
            s.seconds.is_finite() && (0.0..=MAX_SECONDS).contains(&s.seconds),
            "seconds: must be in 0..=31536000 (a year)",
        );
        check(s.steps > 0 || s.seconds > 0.0, "steps: must be > 0 (or seconds > 0)");
        check((2..=1_000_000).contains(&s.eval_samples), "eval_samples: must be in 2..=1000000");
        check(
            s.connect_deadline_s.is_finite()
                && s.connect_deadline_s > 0.0
                && s.connect_deadline_s <= MAX_SECONDS,
            "connect_deadline_s: must be > 0 and at most 31536000 (a year)",
        );
        check(s.model_id < 1 << 31, "model_id: must be < 2^31");
        match (emb, dense) {
            (Some(emb), Some(dense)) if e.is_empty() => {
                Ok(Settings { section: s, emb, dense, shards: cfg.cluster.shards })
            }
            _ => Err(SettingsError::Invalid(e)),
        }
    }

    /// The dataset's parameters (the ground truth's shape is the library default's).
    pub fn clicks(&self) -> bex_model::ClicksConfig {
        bex_model::ClicksConfig {
            slots: self.section.slots,
            vocab: self.section.vocab,
            zipf_exponent: self.section.zipf_exponent,
            seed: self.section.data_seed,
            ..bex_model::ClicksConfig::default()
        }
    }

    /// The MLP's shape (its optimizer fields are unused: the PS applies the updates).
    pub fn model(&self) -> bex_model::ModelConfig {
        bex_model::ModelConfig {
            slots: self.section.slots,
            dim: self.emb.dim as usize,
            hidden: self.section.hidden,
            ..bex_model::ModelConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(trainer: &str) -> Config {
        let mut c = bex_testkit::fixtures::local_config();
        c.trainer = toml::from_str(trainer).expect("test TOML");
        c
    }

    #[test]
    fn defaults_resolve_against_local_toml() {
        let s = Settings::resolve(&cfg(""), &Overrides::default()).unwrap();
        assert_eq!(s.emb, TableRef { name: "item".into(), id: 1, dim: 16 });
        assert_eq!(s.dense, TableRef { name: "dense".into(), id: 3, dim: 32 });
        assert_eq!(s.shards, 2);
        assert_eq!(s.model().dim, 16);
    }

    #[test]
    fn shipped_section_resolves() {
        Settings::resolve(&bex_testkit::fixtures::local_config(), &Overrides::default()).unwrap();
    }

    #[test]
    fn overrides_win() {
        let o =
            Overrides { steps: Some(7), batch_size: Some(9), eval_every: Some(3), seconds: None };
        let s = Settings::resolve(&cfg("seconds = 5.0\nbatch_size = 100"), &o).unwrap();
        assert_eq!((s.section.steps, s.section.seconds), (7, 0.0));
        assert_eq!((s.section.batch_size, s.section.eval_every), (9, 3));
        let o = Overrides { seconds: Some(2.5), ..Overrides::default() };
        assert_eq!(Settings::resolve(&cfg(""), &o).unwrap().section.seconds, 2.5);
    }

    #[test]
    fn bad_table_names_are_errors() {
        let e = Settings::resolve(&cfg("table = \"nope\""), &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("trainer.table: no table \"nope\""), "{e}");
        let e =
            Settings::resolve(&cfg("dense_table = \"item\""), &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("must differ"), "{e}");
    }

    #[test]
    fn bad_values_and_unknown_keys_are_errors() {
        let e = Settings::resolve(&cfg("batch_size = 0\nslots = 0"), &Overrides::default())
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("trainer.batch_size") && text.contains("trainer.slots"), "{text}");
        // Durations past a year are refused: 1e20 panicked converting to a `Duration`.
        let e = Settings::resolve(
            &cfg("seconds = 1e20\nconnect_deadline_s = 1e20"),
            &Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("trainer.seconds") && e.contains("trainer.connect_deadline_s"), "{e}");
        let e = Settings::resolve(&cfg("batchsize = 3"), &Overrides::default()).unwrap_err();
        assert!(matches!(e, SettingsError::Parse(ref m) if m.contains("batchsize")), "{e}");
    }
}
