//! `bex-cluster`: one command starts a bex cluster from its TOML file — every `ps-server`,
//! `ranker` and `trainer`, on loopback or with one network namespace per host and `tc`
//! link rates — waits until all are healthy, runs the workload phases, collects the reports
//! and tears everything down, also on Ctrl-C or failure.
//!
//! [`plan`] turns the configuration into processes, ids, namespaces, addresses and commands
//! without I/O (unit-tested); [`exec`] runs a plan; [`cleanup`] removes what dead launchers
//! left behind; [`overrides`] applies `--set section.key=value`.

#![forbid(unsafe_code)]

pub mod cleanup;
pub mod clock;
pub mod exec;
pub mod launch;
pub mod overrides;
pub mod plan;
pub mod probe;

use bex_ps_core::Config;

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
