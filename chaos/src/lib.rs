//! The invariant checkers of chaos runs (issue 7, item 4): real processes, real faults
//! (`kill -9`, iptables loss and partitions applied by `bex-cluster`'s `[[launch.chaos]]`
//! schedule), and afterwards a verdict.
//!
//! - [`canary`]: a client that pushes `+1` increments to its own canary keys (a table with
//!   zero init and SGD at learning rate 1, so a row's value counts the pushes applied to it)
//!   and records, per key, how many pushes were acknowledged and how many failed.
//! - [`verify`]: after the workload, reads every canary key from every pod and checks the
//!   invariants: no acknowledged push lost (value ≥ acked), no push applied twice (value ≤
//!   acked + failed: a failed push may or may not have been applied, once), and replicas
//!   converged (every pod's rows equal the training pod's, bit for bit, for the canary keys and
//!   the trainer's embedding and dense rows) within a settling time.

pub mod canary;
pub mod verify;

use bex_ps_proto::config::{InitConfig, OptimizerConfig};
use bex_ps_proto::Config;

/// The canary table's id and dim, checked to count pushes exactly: zero init and SGD with
/// lr = 1 (a gradient of −1 adds exactly 1, exact in f32 up to 2^24).
pub fn canary_table(cfg: &Config, name: &str) -> Result<(u32, u32), String> {
    let (i, t) = cfg.tables.iter().enumerate().find(|(_, t)| t.name == name).ok_or_else(|| {
        format!("no table {name:?} in the config (add one: see configs/chaos.toml)")
    })?;
    if !matches!(t.init, InitConfig::Zeros) {
        return Err(format!("table {name:?}: the canary table needs init zeros"));
    }
    match t.optimizer {
        OptimizerConfig::Sgd { lr: 1.0 } => {}
        _ => {
            return Err(format!("table {name:?}: the canary table needs optimizer sgd with lr = 1"))
        }
    }
    Ok((i as u32, t.dim))
}

/// Canary key `i` of client `client` (canary keys live in their own table; the tag in the top
/// byte makes them recognisable in dumps), each client with its own keys.
pub fn canary_key(client: u64, i: u32) -> u64 {
    0xCA << 56 | (client & 0xFF_FFFF) << 32 | u64::from(i)
}

/// Canary key `i` shared by every canary that pushes to shared keys (its own tag, so no
/// client's own keys are among them).
pub fn shared_canary_key(i: u32) -> u64 {
    0xCB << 56 | u64::from(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canary_keys_are_distinct_per_client_and_tagged() {
        assert_ne!(canary_key(1, 0), canary_key(2, 0));
        assert_ne!(canary_key(1, 0), canary_key(1, 1));
        assert_eq!(canary_key(7, 3) >> 56, 0xCA);
        assert_ne!(shared_canary_key(3), canary_key(0, 3));
    }

    #[test]
    fn canary_table_must_count_exactly() {
        let mut cfg = Config::local(1, 1, 30000);
        assert!(canary_table(&cfg, "canary").is_err());
        let text = r#"
            [cluster]
            pods = 1
            shards = 1
            [[tables]]
            name = "canary"
            dim = 2
            init = { kind = "zeros" }
            optimizer = { kind = "sgd", lr = 1.0 }
            [[tables]]
            name = "bad"
            dim = 2
            init = { kind = "zeros" }
            optimizer = { kind = "sgd", lr = 0.5 }
        "#;
        cfg = Config::from_toml_str(text).unwrap();
        assert_eq!(canary_table(&cfg, "canary").unwrap(), (0, 2));
        assert!(canary_table(&cfg, "bad").unwrap_err().contains("lr = 1"));
    }
}
