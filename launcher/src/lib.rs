//! `bex-cluster`: one command starts a bex cluster from its TOML file — every `ps-server`,
//! `ranker` and `trainer`, on loopback or with one network namespace per host and `tc`
//! link rates — waits until all are healthy, runs the workload phases, collects the reports
//! and tears everything down, also on Ctrl-C or failure.
//!
//! [`plan`] turns the configuration into processes, ids, namespaces, addresses and commands
//! without I/O (unit-tested); [`exec`] runs a plan; [`cleanup`] removes what dead launchers
//! left behind; [`overrides`] applies `--set section.key=value`; [`doctor`] checks a host for
//! the configured NIC before anything starts.

#![forbid(unsafe_code)]

/// `println!` that ignores a closed stdout (`bex-cluster run | head`): `println!` panicked
/// there, mid-run, and the report was lost; the run, its teardown and its report go on.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

pub mod cleanup;
pub mod clock;
pub mod doctor;
pub mod exec;
pub mod launch;
pub mod overrides;
pub mod plan;
pub mod probe;

use bex_ps_proto::Config;

use crate::launch::LaunchConfig;

/// Reads the cluster file with `sets` applied (`section.key=value`, in order) and checks
/// both the configuration and `[launch]`. Every error is a usage/config error (exit 2).
pub fn load_config(text: &str, sets: &[String]) -> Result<(Config, LaunchConfig), String> {
    // Parse without validating: an override may be what makes the file valid.
    let raw: Config = toml::from_str(text).map_err(|e| e.to_string())?;
    // The full configuration, defaults included, so overrides are type-checked against it.
    let mut doc = match toml::Value::try_from(&raw) {
        Ok(toml::Value::Table(t)) => t,
        Ok(_) => return Err("configuration is not a table".into()),
        Err(e) => return Err(e.to_string()),
    };
    let mut launch = LaunchConfig::default_table();
    launch.extend(raw.launch.clone());
    doc.insert("launch".into(), toml::Value::Table(launch));
    for s in sets {
        overrides::apply(&mut doc, s)?;
    }
    let text = toml::to_string(&doc).map_err(|e| e.to_string())?;
    let cfg = Config::from_toml_str(&text).map_err(|e| {
        if sets.is_empty() {
            e.to_string()
        } else {
            format!("{e}\n(after the --set overrides)")
        }
    })?;
    let launch = LaunchConfig::from_table(&cfg.launch)
        .map_err(|e| e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))?;
    Ok((cfg, launch))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str =
        "[cluster]\npods = 2\nshards = 2\n[transport]\ncwnd_bytes = 0\n[launch]\nrankers = 2\n";

    #[test]
    fn overrides_apply_to_defaults_and_launch() {
        let sets = [
            "transport.cwnd_bytes=65536",
            "rpc.request_timeout_ms=80",
            "launch.mode=netns",
            "launch.phases=[\"training\"]",
        ]
        .map(String::from);
        let (cfg, l) = load_config(FILE, &sets).unwrap();
        assert_eq!(cfg.transport.cwnd_bytes, 65536);
        assert_eq!(cfg.rpc.request_timeout_ms, 80, "a key absent from the file");
        assert_eq!(l.mode, launch::Mode::Netns);
        assert_eq!(l.rankers, 2, "kept from the file");
        assert_eq!(l.phases, ["training"]);
    }

    #[test]
    fn override_errors_are_clear() {
        let e = load_config(FILE, &["rpc.request_timeout_ms=soon".into()]).unwrap_err();
        assert!(e.contains("rpc.request_timeout_ms expects an integer"), "{e}");
        let e = load_config(FILE, &["transport.cwnd_byte=1".into()]).unwrap_err();
        assert!(e.contains("cwnd_byte") && e.contains("--set"), "{e}");
        let e = load_config(FILE, &["cluster.pods=0".into()]).unwrap_err();
        assert!(e.contains("cluster.pods: must be in 1..=64"), "{e}");
        let e = load_config(FILE, &["launch.mode=satellite".into()]).unwrap_err();
        assert!(e.contains("satellite"), "{e}");
        let e = load_config(FILE, &["launch.phases=[\"warmup\"]".into()]).unwrap_err();
        assert!(e.contains("launch.phases"), "{e}");
    }

    #[test]
    fn shipped_local_config_loads() {
        let text = include_str!("../../configs/local.toml");
        let (cfg, l) = load_config(text, &[]).unwrap();
        assert_eq!((cfg.cluster.pods, cfg.cluster.shards), (2, 2));
        assert_eq!(l, LaunchConfig::default(), "configs/local.toml documents the defaults");
    }
}
