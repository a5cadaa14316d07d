//! The envelope every tool's JSON report starts with: which tool and version, the exact
//! command line, and where the processes ran. A tool flattens it into its own typed report
//! (`#[serde(flatten)]`), so readers find the same keys in every report.

use std::fmt::Write as _;

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

/// A text table: `title`, then `header` and `rows` in right-aligned columns two spaces apart.
pub fn render(title: &str, header: &[String], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let parts: Vec<String> =
            cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}", w = *w)).collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = format!("{title}\n{}\n", line(header));
    for row in rows {
        let _ = writeln!(out, "{}", line(row));
    }
    out
}

/// A job's result as one progress line says it.
pub trait ProgressLine {
    /// The line (without the `[i/n]` counter).
    fn progress_line(&self) -> String;
}

/// A session's results in job order, each announced on stderr as `[i/n] line` unless quiet.
#[derive(Debug)]
pub struct Progress<T> {
    /// The results so far.
    pub done: Vec<T>,
    total: usize,
    quiet: bool,
}

impl<T: ProgressLine> Progress<T> {
    /// Expects `total` results.
    pub fn new(total: usize, quiet: bool) -> Progress<T> {
        Progress { done: Vec::with_capacity(total), total, quiet }
    }

    /// Records the next result.
    pub fn push(&mut self, result: T) {
        if !self.quiet {
            eprintln!("[{}/{}] {}", self.done.len() + 1, self.total, result.progress_line());
        }
        self.done.push(result);
    }
}
