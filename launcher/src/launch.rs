//! The `[launch]` section of the cluster file: how `bex-cluster` runs the cluster.

use serde::{Deserialize, Serialize};

use bex_ps_proto::config::{FieldError, TransportKind};

/// Longest run `launch.timeout_s` may ask for (a year): the clock arithmetic stays in range.
const MAX_TIMEOUT_S: u64 = 365 * 86_400;
/// Longest `launch.startup_timeout_s` (a day: a restore longer than that is a fault).
const MAX_STARTUP_TIMEOUT_S: u64 = 86_400;

/// Where the processes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every process on loopback.
    Loopback,
    /// One network namespace per host, joined by a bridge (root only).
    Netns,
}

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
#[serde(deny_unknown_fields)]
pub struct ChaosEvent {
    /// Seconds after the first phase started.
    pub at_s: f64,
    /// `kill` (SIGKILL a server), `term` (SIGTERM a server: it drains, checkpoints and must
    /// exit 0), `restart` (start a stopped server again), `restart-client` (SIGTERM a running
    /// client such as `trainer-2`, which must exit 0, and start it again with the same id;
    /// a restarted trainer must then fail no step), `loss` (drop
    /// `probability` of the packets a host receives, iptables; netns), `partition` (cut every
    /// server of `pod<N>` off the network; netns), `rdma-blackhole` (drop a server's UDP, i.e.
    /// the software RNIC's packets, while TCP still works: clients must fall back; netns),
    /// `heal` (remove every loss, partition and blackhole).
    pub action: String,
    /// A server (`ps-p1-s0`) for kill, term, restart and loss; `pod1` for partition; a client
    /// (`trainer-2`) for restart-client.
    #[serde(default)]
    pub target: String,
    /// Drop probability for loss.
    #[serde(default)]
    pub probability: f64,
}

/// What a chaos event does: its `action`, `target` and `probability`, checked and typed.
#[derive(Clone, Debug, PartialEq)]
pub enum ChaosAction {
    /// SIGKILL a server.
    Kill {
        /// `ps-p<pod>-s<shard>`.
        server: String,
    },
    /// SIGTERM a server, which must drain, checkpoint and exit 0.
    Term {
        /// `ps-p<pod>-s<shard>`.
        server: String,
    },
    /// Start a stopped server again.
    Restart {
        /// `ps-p<pod>-s<shard>`.
        server: String,
    },
    /// SIGTERM a running client (which must exit 0) and start it again with the same id.
    RestartClient {
        /// `ranker-<n>`, `trainer-<n>` or `canary-<n>`.
        client: String,
    },
    /// Drop `probability` of the packets a server's host receives (iptables; netns).
    Loss {
        /// `ps-p<pod>-s<shard>`.
        server: String,
        /// In (0, 1).
        probability: f64,
    },
    /// Cut every server of a pod off the network (netns).
    Partition {
        /// The pod.
        pod: u32,
    },
    /// Drop a server's UDP (the software RNIC's packets) while TCP works (netns).
    RdmaBlackhole {
        /// `ps-p<pod>-s<shard>`.
        server: String,
    },
    /// Remove every loss, partition and blackhole (netns).
    Heal,
}

impl ChaosAction {
    /// Its name in the config and the report.
    pub fn name(&self) -> &'static str {
        match self {
            ChaosAction::Kill { .. } => "kill",
            ChaosAction::Term { .. } => "term",
            ChaosAction::Restart { .. } => "restart",
            ChaosAction::RestartClient { .. } => "restart-client",
            ChaosAction::Loss { .. } => "loss",
            ChaosAction::Partition { .. } => "partition",
            ChaosAction::RdmaBlackhole { .. } => "rdma-blackhole",
            ChaosAction::Heal => "heal",
        }
    }

    /// True for the faults made with iptables in the hosts' network namespaces.
    pub fn is_network_fault(&self) -> bool {
        matches!(
            self,
            ChaosAction::Loss { .. }
                | ChaosAction::Partition { .. }
                | ChaosAction::RdmaBlackhole { .. }
                | ChaosAction::Heal
        )
    }
}

/// `ps-p<pod>-s<shard>`.
fn is_server_name(t: &str) -> bool {
    t.strip_prefix("ps-p")
        .and_then(|r| r.split_once("-s"))
        .is_some_and(|(p, s)| p.parse::<u32>().is_ok() && s.parse::<u32>().is_ok())
}

impl ChaosEvent {
    /// The typed action, or why the event is wrong.
    pub fn parse(&self) -> Result<ChaosAction, String> {
        let server = || {
            if is_server_name(&self.target) {
                Ok(self.target.clone())
            } else {
                Err(format!("{}: target must be a server like \"ps-p1-s0\"", self.action))
            }
        };
        Ok(match self.action.as_str() {
            "kill" => ChaosAction::Kill { server: server()? },
            "term" => ChaosAction::Term { server: server()? },
            "restart" => ChaosAction::Restart { server: server()? },
            "rdma-blackhole" => ChaosAction::RdmaBlackhole { server: server()? },
            "loss" => {
                let server = server()?;
                if !(self.probability > 0.0 && self.probability < 1.0) {
                    return Err("loss: probability must be in (0, 1)".into());
                }
                ChaosAction::Loss { server, probability: self.probability }
            }
            "partition" => match self.target.strip_prefix("pod").map(str::parse::<u32>) {
                Some(Ok(pod)) => ChaosAction::Partition { pod },
                _ => return Err("partition: target must be a pod like \"pod1\"".into()),
            },
            "restart-client" => {
                let client = ["ranker-", "trainer-", "canary-"]
                    .iter()
                    .any(|k| self.target.strip_prefix(k).is_some_and(|n| n.parse::<u32>().is_ok()));
                if !client {
                    return Err("restart-client: target must be a client like \"trainer-2\"".into());
                }
                ChaosAction::RestartClient { client: self.target.clone() }
            }
            "heal" => ChaosAction::Heal,
            other => {
                return Err(format!(
                    "unknown action {other:?} (kill, term, restart, restart-client, loss, \
                     partition, rdma-blackhole, heal)"
                ))
            }
        })
    }

    fn check(&self, i: usize, netns: bool, timeout_s: u64) -> Option<FieldError> {
        let bad = |m: String| Some(FieldError::new(format!("launch.chaos[{i}]"), m));
        // Past the run's timeout it would never happen (and a huge value overflowed the
        // launcher's clock arithmetic, a panic mid-run).
        if !(self.at_s.is_finite() && self.at_s >= 0.0 && self.at_s <= timeout_s as f64) {
            return bad(format!("at_s must be in 0..={timeout_s} (launch.timeout_s)"));
        }
        match self.parse() {
            Err(e) => bad(e),
            Ok(a) if a.is_network_fault() && !netns => {
                bad(format!("{} needs mode = \"netns\" (iptables per host)", a.name()))
            }
            Ok(_) => None,
        }
    }
}

impl LaunchConfig {
    /// Reads `[launch]` (missing keys take the defaults) and checks it.
    pub fn from_table(t: &toml::Table) -> Result<LaunchConfig, Vec<FieldError>> {
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

    #[test]
    fn chaos_events_are_checked_by_field() {
        let ev = |action: &str, target: &str, p: f64| ChaosEvent {
            at_s: 1.0,
            action: action.into(),
            target: target.into(),
            probability: p,
        };
        let with = |mode: Mode, chaos: Vec<ChaosEvent>| LaunchConfig {
            mode,
            chaos,
            ..LaunchConfig::default()
        };
        let ok = vec![
            ev("kill", "ps-p1-s0", 0.0),
            ev("restart", "ps-p1-s0", 0.0),
            ev("loss", "ps-p0-s1", 0.05),
            ev("partition", "pod1", 0.0),
            ev("rdma-blackhole", "ps-p0-s0", 0.0),
            ev("heal", "", 0.0),
        ];
        assert!(with(Mode::Netns, ok.clone()).check().is_ok());
        // iptables faults need namespaces; kill/restart do not.
        let e = with(Mode::Loopback, ok).check().unwrap_err();
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(with(Mode::Loopback, vec![ev("kill", "ps-p1-s0", 0.0)]).check().is_ok());
        assert_eq!(
            ev("loss", "ps-p0-s1", 0.05).parse().unwrap(),
            ChaosAction::Loss { server: "ps-p0-s1".into(), probability: 0.05 }
        );
        assert_eq!(
            ev("partition", "pod3", 0.0).parse().unwrap(),
            ChaosAction::Partition { pod: 3 }
        );
        for bad in [
            ev("kill", "pod1", 0.0),
            ev("restart-client", "ps-p0-s0", 0.0),
            ev("loss", "ps-p0-s1", 1.5),
            ev("partition", "ps-p1-s0", 0.0),
            ev("rdma-blackhole", "pod0", 0.0),
            ev("explode", "", 0.0),
            ChaosEvent { at_s: -1.0, ..ev("heal", "", 0.0) },
            // Past the run's timeout; 1e20 panicked in the launcher's clock arithmetic.
            ChaosEvent { at_s: 1e20, ..ev("heal", "", 0.0) },
        ] {
            let e = with(Mode::Netns, vec![bad.clone()]).check().unwrap_err();
            assert!(e[0].to_string().contains("launch.chaos[0]"), "{bad:?}: {e:?}");
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
