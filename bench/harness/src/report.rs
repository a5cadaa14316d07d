//! The envelope every tool's JSON report starts with: which tool and version, the exact
//! command line, and where the processes ran. A tool flattens it into its own typed report
//! (`#[serde(flatten)]`), so readers find the same keys in every report.

use serde::{Deserialize, Serialize};

use crate::pin::Placement;

/// The fields every report has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The tool that wrote it.
    pub tool: String,
    /// Its version.
    pub version: String,
    /// The exact command line of the run.
    pub command_line: Vec<String>,
    /// Where client and server ran.
    pub placement: Placement,
}

impl Envelope {
    /// The envelope of this process's run of `tool` (version `version`, its
    /// `CARGO_PKG_VERSION`).
    pub fn new(tool: &str, version: &str, placement: Placement) -> Envelope {
        Envelope {
            tool: tool.into(),
            version: version.into(),
            command_line: crate::cli::command_line(),
            placement,
        }
    }
}

/// `x` rounded to 3 decimals, or `None` (JSON null) when it is not finite: a report never
/// holds NaN or infinity, which JSON cannot express.
pub fn finite(x: f64) -> Option<f64> {
    x.is_finite().then(|| (x * 1000.0).round() / 1000.0)
}
