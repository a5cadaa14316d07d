//! The cluster configuration loader.

use bex_ps_core::TableSet;
use bex_ps_proto::Config;

/// `data` as a TOML cluster file: parsing, `validate` and `topology` never panic; a config
/// that validates has a topology, tables that build and a server address for every (pod,
/// shard); a parsed config re-serializes to text that parses back to the same text again.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cfg) = Config::from_toml_str(text) else { return };
    let valid = cfg.validate();
    let topo = cfg.topology();
    let _ = cfg.limits();
    let _ = bex_ps_core::dedupe::DedupeConfig::of(&cfg);
    if valid.is_ok() {
        let topo = topo.expect("a valid config has a topology");
        for pod in 0..topo.pods() {
            for shard in 0..topo.shards() {
                assert!(topo.server(pod, shard).is_some(), "no server ({pod}, {shard})");
                let _ = cfg.checkpoint_path(pod, shard);
            }
        }
        assert!(topo.training_pod() < topo.pods());
        if let Err(e) = TableSet::new(cfg.table_specs()) {
            panic!("validate() accepted tables that do not build: {e}");
        }
    }
    // Serialization may refuse some parsed values; what it writes must read back the same.
    if let Ok(s) = cfg.to_toml_string() {
        let back = Config::from_toml_str(&s)
            .unwrap_or_else(|e| panic!("re-serialized config does not parse: {e}\n{s}"));
        let s2 = back.to_toml_string().expect("a re-parsed config serializes");
        assert_eq!(s, s2, "config text round trip");
        assert_eq!(back.validate().is_ok(), valid.is_ok(), "validity survives a round trip");
    }
}
