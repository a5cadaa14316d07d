//! Configs more than one test builds on.

/// The ranker's model tables (what `[ranker]` slots and the dense weights name): `user` and
/// `item` of dim 16, `context` of dim 8, `dense` of dim 32.
pub const RANKER_TABLES: &str = r#"
[[tables]]
name = "user"
dim = 16
[[tables]]
name = "item"
dim = 16
[[tables]]
name = "context"
dim = 8
[[tables]]
name = "dense"
dim = 32
"#;

/// A 1-pod × 2-shard cluster file with [`RANKER_TABLES`], `extra` sections, and `ranker` as
/// its `[ranker]` section (last, so `extra` must not leave a table open that `ranker` would
/// land in).
pub fn ranker_cluster(extra: &str, ranker: &str) -> String {
    format!("[cluster]\npods = 1\nshards = 2\n{extra}\n{RANKER_TABLES}\n[ranker]\n{ranker}\n")
}

/// The shipped `configs/local.toml`, parsed (the file users start from).
pub fn local_config() -> bex_ps_proto::Config {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/local.toml");
    let text = std::fs::read_to_string(path).expect("configs/local.toml");
    bex_ps_proto::Config::from_toml_str(&text).expect("configs/local.toml is valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_local_config_parses() {
        assert!(!local_config().tables.is_empty());
    }

    #[test]
    fn the_ranker_cluster_parses() {
        let cfg = bex_ps_proto::Config::from_toml_str(&ranker_cluster("", "rate = 5.0")).unwrap();
        assert_eq!(cfg.tables.len(), 4);
        assert_eq!(cfg.ranker.get("rate").and_then(|v| v.as_float()), Some(5.0));
    }
}
