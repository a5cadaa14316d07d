//! `bex-transport-kind`: which transport carries the data path. One enum for the cluster
//! file (`[transport] kind`, serde), the transports (`bex_transport::TransportKind` is this),
//! the clients' and tools' `--transport` (clap, feature `clap`) and every report, so "rdma or
//! tcp" is spelled once. A crate of its own because the config (`bex-ps-core`) and the
//! transports (`bex-transport`) must not depend on each other.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Which transport a path, a socket, a client or a measurement uses.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum TransportKind {
    /// ByteExpress over RC queue pairs (hardware or the software RNIC), falling back to TCP
    /// per destination: bex's default.
    #[default]
    Rdma,
    /// TCP only (the fallback and the baseline).
    Tcp,
}

impl TransportKind {
    /// Both, RDMA first.
    pub const ALL: [TransportKind; 2] = [TransportKind::Rdma, TransportKind::Tcp];

    /// Its name: `rdma` or `tcp`.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Rdma => "rdma",
            TransportKind::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<TransportKind, String> {
        TransportKind::ALL
            .into_iter()
            .find(|k| k.name() == s.trim())
            .ok_or_else(|| format!("rdma or tcp, not {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spelling_everywhere() {
        for k in TransportKind::ALL {
            assert_eq!(k.to_string().parse::<TransportKind>(), Ok(k));
            assert_eq!(serde_json::to_value(k).unwrap(), k.name());
            assert_eq!(serde_json::from_value::<TransportKind>(k.name().into()).unwrap(), k);
        }
        assert!("udp".parse::<TransportKind>().unwrap_err().contains("rdma or tcp"));
    }
}
