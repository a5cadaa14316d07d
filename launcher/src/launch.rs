//! The `[launch]` section of the cluster file: how `bex-cluster` runs the cluster.

use serde::{Deserialize, Serialize};

use bex_ps_proto::config::{FieldError, TransportKind};
pub use bex_report::{ChaosAction, Mode};

/// Longest run `launch.timeout_s` may ask for (a year): the clock arithmetic stays in range.
const MAX_TIMEOUT_S: u64 = 365 * 86_400;
/// Longest `launch.startup_timeout_s` (a day: a restore longer than that is a fault).
const MAX_STARTUP_TIMEOUT_S: u64 = 86_400;

/// `[launch]`, keys as in `configs/local.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaunchConfig {
    /// loopback | netns.
    pub mode: Mode,
    /// netns: tc rate of every host link (`"10gbit"`); empty = unlimited.
    pub link_rate: String,
    /// tbf burst; empty = 1 ms at `link_rate`, at least 64 KiB.
    pub link_burst: String,
    /// tbf limit; empty = 2 × burst.
    pub link_queue: String,
    /// Ranker processes per phase that runs inference.
    pub rankers: u32,
    /// Trainer processes per phase that trains.
    pub trainers: u32,
    /// Phases in order: `inference`, `training`, or both joined by `+`.
    pub phases: Vec<String>,
    /// Extra ranker arguments.
    pub ranker_args: Vec<String>,
    /// Extra trainer arguments.
    pub trainer_args: Vec<String>,
    /// The clients' transport.
    pub transport: TransportKind,
    /// Deadline of the whole workload (all phases), seconds.
    pub timeout_s: u64,
    /// How long servers get to print `ready` and answer `/health` 200, at the start and
    /// after a chaos `restart`, seconds: a server restores its checkpoint first, which for a
    /// shard of many GB outlasts the default.
    pub startup_timeout_s: u64,
    /// Directory of the binaries; empty = the directory of `bex-cluster`.
    pub bin_dir: String,
    /// Canary processes per phase that names `canary` (`bex-chaos canary`: countable pushes).
    pub canaries: u32,
    /// Extra canary arguments.
    pub canary_args: Vec<String>,
    /// Faults applied on a schedule during the phases (`[[launch.chaos]]`).
    pub chaos: Vec<ChaosEvent>,
    /// After the phases, if canaries ran: `bex-chaos verify` may wait this long for the
    /// replicas to converge.
    pub verify_settle_s: f64,
    /// Every run starts with empty tables: servers keep checkpoints in `<out>/data`, not in
    /// `[cluster].data_dir` (where an earlier run's checkpoints would be restored).
    pub fresh_data: bool,
    /// Rankers and trainers serve `/metrics` (`--metrics`): in netns mode on this port of
    /// their own address, on loopback on this port plus their id minus one. 0: they do
    /// not. The launcher keeps each process's last scrape in `<out>/metrics/NAME.prom`.
    pub client_metrics_port: u16,
    /// After the phases, keep the servers up until SIGTERM or SIGINT, then tear down as
    /// usual and succeed: a cluster for clients started by other means (Python, a shell).
    pub hold: bool,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            mode: Mode::Loopback,
            link_rate: String::new(),
            link_burst: String::new(),
            link_queue: String::new(),
            rankers: 1,
            trainers: 2,
            phases: vec!["inference".into(), "training".into()],
            ranker_args: Vec::new(),
            trainer_args: Vec::new(),
            transport: TransportKind::Rdma,
            timeout_s: 600,
            startup_timeout_s: 30,
            fresh_data: true,
            bin_dir: String::new(),
            canaries: 1,
            canary_args: Vec::new(),
            chaos: Vec::new(),
            verify_settle_s: 15.0,
            client_metrics_port: 19100,
            hold: false,
        }
    }
}

/// One phase: which kinds of client run (at the same time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Phase {
    /// As written (`"inference+training"`).
    pub name: String,
    /// Rankers run.
    pub inference: bool,
    /// Trainers run.
    pub training: bool,
    /// Canaries run.
    pub canary: bool,
}

/// A fault `bex-cluster` applies during the phases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChaosEvent {
    /// Seconds after the first phase started.
    pub at_s: f64,
    /// `action` with its `target` (and `probability`), checked as read: `kill` (SIGKILL a
    /// server), `term` (SIGTERM a server: it drains, checkpoints and must exit 0), `restart`
    /// (start a stopped server again), `restart-client` (SIGTERM a running client such as
    /// `trainer-2`, which must exit 0, and start it again with the same id; a restarted
    /// trainer must then fail no step), `loss` (drop `probability` of the packets a host
    /// receives, iptables; netns), `partition` (cut every server of `pod<N>` off the network;
    /// netns), `rdma-blackhole` (drop a server's UDP, i.e. the software RNIC's packets, while
    /// TCP still works: clients must fall back; netns), `heal` (remove every loss, partition
    /// and blackhole; no target). Servers are named `ps-p1-s0`. (Unknown keys are refused by
    /// the action: `deny_unknown_fields` cannot be combined with `flatten` here.)
    #[serde(flatten)]
    pub action: ChaosAction,
}

impl ChaosEvent {
    fn check(&self, i: usize, netns: bool, timeout_s: u64) -> Option<FieldError> {
        let bad = |m: String| Some(FieldError::new(format!("launch.chaos[{i}]"), m));
        // Past the run's timeout it would never happen (and a huge value overflowed the
        // launcher's clock arithmetic, a panic mid-run).
        if !(self.at_s.is_finite() && self.at_s >= 0.0 && self.at_s <= timeout_s as f64) {
            return bad(format!("at_s must be in 0..={timeout_s} (launch.timeout_s)"));
        }
        let a = &self.action;
        (a.is_network_fault() && !netns)
            .then(|| bad(format!("{} needs mode = \"netns\" (iptables per host)", a.name())))
            .flatten()
    }
}

impl LaunchConfig {
    /// Reads `[launch]` (missing keys take the defaults) and checks it.
    pub fn from_table(t: &toml::Table) -> Result<LaunchConfig, Vec<FieldError>> {
        // Chaos events one by one first, so each error names its event (read as part of
        // the whole, an error says only "in `chaos`").
        if let Some(toml::Value::Array(events)) = t.get("chaos") {
            let e: Vec<FieldError> = (events.iter().enumerate())
                .filter_map(|(i, ev)| {
                    let read = ev.clone().try_into::<ChaosEvent>();
                    read.err().map(|e| FieldError::new(format!("launch.chaos[{i}]"), e.to_string()))
                })
                .collect();
            if !e.is_empty() {
                return Err(e);
            }
        }
        let l: LaunchConfig = toml::Value::Table(t.clone())
            .try_into()
            .map_err(|e: toml::de::Error| vec![FieldError::new("launch", e.to_string())])?;
        l.check()?;
        Ok(l)
    }

    /// The defaults as a TOML table (so `--set launch.KEY=V` can be type-checked).
    pub fn default_table() -> toml::Table {
        match toml::Value::try_from(LaunchConfig::default()) {
            Ok(toml::Value::Table(t)) => t,
            // Serializing a struct of strings, integers and arrays cannot fail.
            _ => toml::Table::new(),
        }
    }

    fn check(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Vec::new();
        if let Err(m) = self.parsed_phases() {
            e.push(FieldError::new("launch.phases", m));
        }
        for (k, v) in [
            ("link_rate", &self.link_rate),
            ("link_burst", &self.link_burst),
            ("link_queue", &self.link_queue),
        ] {
            if !v.is_empty() {
                let parsed = if k == "link_rate" { parse_rate(v) } else { parse_size(v) };
                if let Err(m) = parsed {
                    e.push(FieldError::new(format!("launch.{k}"), m));
                }
            }
        }
        if self.mode == Mode::Loopback && !self.link_rate.is_empty() {
            e.push(FieldError::new(
                "launch.link_rate",
                "needs mode = \"netns\" (loopback has no links)",
            ));
        }
        for (i, ev) in self.chaos.iter().enumerate() {
            if let Some(f) = ev.check(i, self.mode == Mode::Netns, self.timeout_s) {
                e.push(f);
            }
        }
        // Faults are applied during the phases: with none, none would ever happen.
        if !self.chaos.is_empty() && self.phases.is_empty() {
            e.push(FieldError::new("launch.chaos", "needs launch.phases: faults happen in them"));
        }
        if !(self.verify_settle_s.is_finite() && (0.0..=3600.0).contains(&self.verify_settle_s)) {
            e.push(FieldError::new("launch.verify_settle_s", "must be in 0..=3600"));
        }
        if !(1..=MAX_TIMEOUT_S).contains(&self.timeout_s) {
            e.push(FieldError::new("launch.timeout_s", "must be in 1..=31536000 (a year)"));
        }
        if !(1..=MAX_STARTUP_TIMEOUT_S).contains(&self.startup_timeout_s) {
            e.push(FieldError::new("launch.startup_timeout_s", "must be in 1..=86400 (a day)"));
        }
        if self.rankers > 1000 || self.trainers > 1000 || self.canaries > 1000 {
            e.push(FieldError::new(
                "launch.rankers",
                "rankers, trainers and canaries must be ≤ 1000 each",
            ));
        }
        if e.is_empty() {
            Ok(())
        } else {
            Err(e)
        }
    }

    /// The phases, checked.
    pub fn parsed_phases(&self) -> Result<Vec<Phase>, String> {
        self.phases
            .iter()
            .map(|p| {
                let mut ph =
                    Phase { name: p.clone(), inference: false, training: false, canary: false };
                for part in p.split('+') {
                    match part.trim() {
                        "inference" => ph.inference = true,
                        "training" => ph.training = true,
                        "canary" => ph.canary = true,
                        other => {
                            return Err(format!(
                            "unknown phase part {other:?} in {p:?} (inference, training, canary, \
                                 or several joined by +)"
                        ))
                        }
                    }
                }
                Ok(ph)
            })
            .collect()
    }
}

/// A tc rate (`10gbit`, `100mbit`, `500kbit`, `1gbps` = bytes/s, bare = bit/s) in bits/s.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("not a rate: {s:?} (e.g. \"10gbit\")"))?;
    let mult = match unit {
        "" | "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        _ => {
            return Err(format!(
                "unknown rate unit {unit:?} in {s:?} (bit, kbit, mbit, gbit, bps…)"
            ))
        }
    };
    let bits = n * mult;
    if !(bits.is_finite() && bits >= 8.0) {
        return Err(format!("rate {s:?} must be ≥ 8 bit/s"));
    }
    Ok(bits as u64)
}

/// A tc size (`64kb`, `1mb`, `1500b`, bare = bytes) in bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?} (e.g. \"256kb\")"))?;
    let mult = match unit {
        "" | "b" => 1,
        "k" | "kb" => 1 << 10,
        "m" | "mb" => 1 << 20,
        "g" | "gb" => 1 << 30,
        _ => return Err(format!("unknown size unit {unit:?} in {s:?} (b, kb, mb, gb)")),
    };
    n.checked_mul(mult).filter(|b| *b > 0).ok_or_else(|| format!("size {s:?} out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[launch]` with `chaos` events, each a TOML inline table.
    fn launch_with(mode: &str, events: &[&str]) -> Result<LaunchConfig, Vec<FieldError>> {
        let text = format!("mode = \"{mode}\"\nchaos = [{}]", events.join(", "));
        LaunchConfig::from_table(&toml::from_str(&text).unwrap())
    }

    #[test]
    fn chaos_events_are_checked_by_field() {
        let ok = [
            r#"{ at_s = 1.0, action = "kill", target = "ps-p1-s0" }"#,
            r#"{ at_s = 1.0, action = "restart", target = "ps-p1-s0" }"#,
            r#"{ at_s = 1.0, action = "loss", target = "ps-p0-s1", probability = 0.05 }"#,
            r#"{ at_s = 1.0, action = "partition", target = "pod1" }"#,
            r#"{ at_s = 1.0, action = "rdma-blackhole", target = "ps-p0-s0" }"#,
            r#"{ at_s = 1.0, action = "heal" }"#,
        ];
        let read = launch_with("netns", &ok).unwrap();
        assert_eq!(read.chaos[3].action.to_string(), "partition pod1");
        assert_eq!(read.chaos[2].action.to_string(), "loss ps-p0-s1 0.05");
        // iptables faults need namespaces; kill/restart do not.
        let e = launch_with("loopback", &ok).unwrap_err();
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e.iter().all(|e| e.to_string().contains("needs mode = \"netns\"")), "{e:?}");
        assert!(launch_with("loopback", &ok[..2]).is_ok());
        // Faults happen during phases: chaos without any is refused at load, not at run time.
        let no_phases = format!("phases = []\nchaos = [{}]", ok[0]);
        let e = LaunchConfig::from_table(&toml::from_str(&no_phases).unwrap()).unwrap_err();
        assert!(e[0].to_string().contains("needs launch.phases"), "{e:?}");
        for (bad, says) in [
            (r#"{ at_s = 1.0, action = "kill", target = "pod1" }"#, "not a server"),
            (r#"{ at_s = 1.0, action = "restart-client", target = "ps-p0-s0" }"#, "not a client"),
            (
                r#"{ at_s = 1.0, action = "loss", target = "ps-p0-s1", probability = 1.5 }"#,
                "(0, 1)",
            ),
            (r#"{ at_s = 1.0, action = "partition", target = "ps-p1-s0" }"#, "not a pod"),
            (r#"{ at_s = 1.0, action = "rdma-blackhole", target = "pod0" }"#, "not a server"),
            (r#"{ at_s = 1.0, action = "explode" }"#, "explode"),
            (
                r#"{ at_s = 1.0, action = "kill", target = "ps-p1-s0", probablity = 0.1 }"#,
                "probablity",
            ),
            (r#"{ at_s = -1.0, action = "heal" }"#, "at_s"),
            // Past the run's timeout; 1e20 panicked in the launcher's clock arithmetic.
            (r#"{ at_s = 1e20, action = "heal" }"#, "at_s"),
        ] {
            let e = launch_with("netns", &[r#"{ at_s = 1.0, action = "heal" }"#, bad]).unwrap_err();
            assert!(e[0].to_string().contains(says), "{bad}: {e:?}");
            assert!(e[0].to_string().contains("launch.chaos[1]"), "{bad}: {e:?}");
        }
    }

    /// `configs/local.toml` names every `[launch]` key with its default.
    #[test]
    fn the_example_file_names_every_launch_key() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/local.toml");
        let file: toml::Table = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let written = file.get("launch").and_then(|l| l.as_table()).cloned().unwrap_or_default();
        let defaults = LaunchConfig::default_table();
        let missing: Vec<&String> = defaults.keys().filter(|k| !written.contains_key(*k)).collect();
        assert!(missing.is_empty(), "configs/local.toml's [launch] does not name {missing:?}");
        // And the values it shows are the defaults.
        assert_eq!(LaunchConfig::from_table(&written).unwrap(), LaunchConfig::default());
    }

    #[test]
    fn defaults_round_trip_and_bad_values_name_their_key() {
        let l = LaunchConfig::from_table(&LaunchConfig::default_table()).unwrap();
        assert_eq!(l, LaunchConfig::default());
        let t: toml::Table =
            toml::from_str("phases = [\"inference+training\", \"train\"]\nlink_rate = \"fast\"")
                .unwrap();
        let e = LaunchConfig::from_table(&t).unwrap_err();
        let text: Vec<String> = e.iter().map(|e| e.to_string()).collect();
        assert!(
            text.iter().any(|m| m.starts_with("launch.phases") && m.contains("\"train\"")),
            "{text:?}"
        );
        assert!(text.iter().any(|m| m.starts_with("launch.link_rate")), "{text:?}");
        let t: toml::Table = toml::from_str("timeout_s = 100000000000").unwrap();
        assert!(LaunchConfig::from_table(&t).unwrap_err()[0].message.contains("a year"));
        let t: toml::Table = toml::from_str("startup_timeout_s = 0").unwrap();
        assert!(LaunchConfig::from_table(&t).unwrap_err()[0].message.contains("a day"));
        let t: toml::Table = toml::from_str("verify_settle_s = 1e20").unwrap();
        assert!(LaunchConfig::from_table(&t).unwrap_err()[0].message.contains("0..=3600"));
        let t: toml::Table = toml::from_str("rankerz = 2").unwrap();
        assert!(LaunchConfig::from_table(&t).unwrap_err()[0].message.contains("rankerz"));
    }

    #[test]
    fn phases_parse() {
        let l = LaunchConfig {
            phases: vec!["inference+training".into(), "training".into()],
            ..Default::default()
        };
        let p = l.parsed_phases().unwrap();
        assert!(p[0].inference && p[0].training);
        assert!(!p[1].inference && p[1].training);
    }

    #[test]
    fn rates_and_sizes() {
        assert_eq!(parse_rate("10gbit").unwrap(), 10_000_000_000);
        assert_eq!(parse_rate("1mbps").unwrap(), 8_000_000);
        assert_eq!(parse_rate("2.5gbit").unwrap(), 2_500_000_000);
        assert!(parse_rate("10 furlongs").is_err());
        assert!(parse_rate("0bit").is_err());
        assert_eq!(parse_size("64kb").unwrap(), 65536);
        assert_eq!(parse_size("1500").unwrap(), 1500);
        assert!(parse_size("1.5mb").is_err());
    }
}
