//! A chaos action: what a `[[launch.chaos]]` entry asks of `bex-cluster`, and what its report
//! says was done. One tagged enum for both, keyed by `action`, whose targets are checked as
//! they are read: a config naming a pod where a server belongs fails to load, and a report
//! reader matches on variants, not on strings.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a chaos event does (`action = "…"` with its `target`, and `probability` for loss).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ChaosAction {
    /// SIGKILL a server: no checkpoint.
    Kill {
        /// The server.
        #[serde(rename = "target")]
        server: ServerName,
    },
    /// SIGTERM a server, which must drain, checkpoint and exit 0.
    Term {
        /// The server.
        #[serde(rename = "target")]
        server: ServerName,
    },
    /// Start a stopped server again.
    Restart {
        /// The server.
        #[serde(rename = "target")]
        server: ServerName,
    },
    /// SIGTERM a running client (which must exit 0) and start it again with the same id; a
    /// restarted trainer must then fail no step.
    RestartClient {
        /// The client.
        #[serde(rename = "target")]
        client: ClientName,
    },
    /// Drop `probability` of the packets a server's host receives (iptables; netns).
    Loss {
        /// The server.
        #[serde(rename = "target")]
        server: ServerName,
        /// The share of packets dropped.
        probability: DropProbability,
    },
    /// Cut every server of a pod off the network (netns).
    Partition {
        /// The pod.
        #[serde(rename = "target")]
        pod: PodName,
    },
    /// Drop a server's UDP (the software RNIC's packets) while TCP works: clients must fall
    /// back (netns).
    RdmaBlackhole {
        /// The server.
        #[serde(rename = "target")]
        server: ServerName,
    },
    /// Remove every loss, partition and blackhole (netns). (A struct variant: a unit one
    /// would take a `target` silently.)
    Heal {},
}

impl ChaosAction {
    /// Its `action` in the config and the report.
    pub fn name(&self) -> &'static str {
        match self {
            ChaosAction::Kill { .. } => "kill",
            ChaosAction::Term { .. } => "term",
            ChaosAction::Restart { .. } => "restart",
            ChaosAction::RestartClient { .. } => "restart-client",
            ChaosAction::Loss { .. } => "loss",
            ChaosAction::Partition { .. } => "partition",
            ChaosAction::RdmaBlackhole { .. } => "rdma-blackhole",
            ChaosAction::Heal {} => "heal",
        }
    }

    /// True for the faults made with iptables in the hosts' network namespaces.
    pub fn is_network_fault(&self) -> bool {
        matches!(
            self,
            ChaosAction::Loss { .. }
                | ChaosAction::Partition { .. }
                | ChaosAction::RdmaBlackhole { .. }
                | ChaosAction::Heal {}
        )
    }
}

/// `kill ps-p1-s0`, `loss ps-p0-s1 0.05`, `heal`.
impl fmt::Display for ChaosAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match self {
            ChaosAction::Kill { server }
            | ChaosAction::Term { server }
            | ChaosAction::Restart { server }
            | ChaosAction::RdmaBlackhole { server } => write!(f, "{name} {server}"),
            ChaosAction::Loss { server, probability } => {
                write!(f, "{name} {server} {}", probability.0)
            }
            ChaosAction::RestartClient { client } => write!(f, "{name} {client}"),
            ChaosAction::Partition { pod } => write!(f, "{name} {pod}"),
            ChaosAction::Heal {} => f.write_str(name),
        }
    }
}

/// A name checked as read: `$valid` says which strings are one.
macro_rules! checked_name {
    ($(#[$doc:meta])* $name:ident, $what:literal, $valid:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl TryFrom<String> for $name {
            type Error = String;

            fn try_from(s: String) -> Result<Self, String> {
                let valid: fn(&str) -> bool = $valid;
                if valid(&s) {
                    Ok($name(s))
                } else {
                    Err(format!("target {s:?} is not {}", $what))
                }
            }
        }

        impl $name {
            /// The name.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0
            }
        }
    };
}

checked_name!(
    /// A server's name, `ps-p<pod>-s<shard>`.
    ServerName,
    "a server like \"ps-p1-s0\"",
    |s| {
        s.strip_prefix("ps-p")
            .and_then(|r| r.split_once("-s"))
            .is_some_and(|(p, s)| p.parse::<u32>().is_ok() && s.parse::<u32>().is_ok())
    }
);

checked_name!(
    /// A client's name, `ranker-<n>`, `trainer-<n>` or `canary-<n>`.
    ClientName,
    "a client like \"trainer-2\"",
    |s| {
        ["ranker-", "trainer-", "canary-"]
            .iter()
            .any(|k| s.strip_prefix(k).is_some_and(|n| n.parse::<u32>().is_ok()))
    }
);

/// A pod, `pod<n>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PodName(pub u32);

impl TryFrom<String> for PodName {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.strip_prefix("pod").map(str::parse) {
            Some(Ok(pod)) => Ok(PodName(pod)),
            _ => Err(format!("target {s:?} is not a pod like \"pod1\"")),
        }
    }
}

impl fmt::Display for PodName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pod{}", self.0)
    }
}

impl From<PodName> for String {
    fn from(p: PodName) -> String {
        p.to_string()
    }
}

/// A share of packets to drop, in (0, 1).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct DropProbability(pub f64);

impl TryFrom<f64> for DropProbability {
    type Error = String;

    fn try_from(p: f64) -> Result<Self, String> {
        if p > 0.0 && p < 1.0 {
            Ok(DropProbability(p))
        } else {
            Err(format!("probability {p} is not in (0, 1)"))
        }
    }
}

impl From<DropProbability> for f64 {
    fn from(p: DropProbability) -> f64 {
        p.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<ChaosAction, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn actions_read_and_write_by_their_tag_with_checked_targets() {
        let loss = read(r#"{"action":"loss","target":"ps-p0-s1","probability":0.05}"#).unwrap();
        let server = ServerName::try_from("ps-p0-s1".to_string()).unwrap();
        assert_eq!(loss, ChaosAction::Loss { server, probability: DropProbability(0.05) });
        assert_eq!(loss.to_string(), "loss ps-p0-s1 0.05");
        assert_eq!(
            read(r#"{"action":"partition","target":"pod3"}"#).unwrap().to_string(),
            "partition pod3"
        );
        for a in [
            loss,
            read(r#"{"action":"heal"}"#).unwrap(),
            read(r#"{"action":"restart-client","target":"trainer-2"}"#).unwrap(),
        ] {
            assert_eq!(read(&serde_json::to_string(&a).unwrap()).unwrap(), a, "round trip");
        }
        for (bad, says) in [
            (r#"{"action":"kill","target":"pod1"}"#, "not a server"),
            (r#"{"action":"restart-client","target":"ps-p0-s0"}"#, "not a client"),
            (r#"{"action":"loss","target":"ps-p0-s1","probability":1.5}"#, "not in (0, 1)"),
            (r#"{"action":"loss","target":"ps-p0-s1"}"#, "probability"),
            (r#"{"action":"partition","target":"ps-p1-s0"}"#, "not a pod"),
            (r#"{"action":"explode"}"#, "unknown variant"),
            (r#"{"action":"heal","target":"pod1"}"#, "unknown field"),
            (r#"{"action":"kill"}"#, "target"),
        ] {
            let e = read(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
