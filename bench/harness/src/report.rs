//! The envelope every tool's JSON report starts with: which tool and version, the exact
//! command line, and where the processes ran. A tool flattens it into its own typed report
//! (`#[serde(flatten)]`), so readers find the same keys in every report. Also what every
//! tool's report shares besides: a job's [`Outcome`], text tables and progress lines.

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

/// What came of one job of a tool: what it measured (the tool's own `M`), or why nothing
/// was. The statuses, table cells and progress words of the three "nothing" cases are the
/// same in every tool's report, so they are here once.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome<M> {
    /// The job ran and measured this.
    Measured(M),
    /// The job cannot run on this transport (e.g. UDP above one datagram): not a failure.
    NotApplicable(String),
    /// The job failed.
    Failed(String),
    /// The job did not run: an earlier failure ended the session.
    Skipped(String),
}

impl<M> Outcome<M> {
    /// What was measured, if anything.
    pub fn measured(&self) -> Option<&M> {
        match self {
            Outcome::Measured(m) => Some(m),
            _ => None,
        }
    }

    /// True when the job failed or did not run (exit status 1).
    pub fn is_failure(&self) -> bool {
        matches!(self, Outcome::Failed(_) | Outcome::Skipped(_))
    }

    /// The report's `status`: `ok`, `n/a`, `failed` or `skipped`.
    pub fn status(&self) -> &'static str {
        match self {
            Outcome::Measured(_) => "ok",
            Outcome::NotApplicable(_) => "n/a",
            Outcome::Failed(_) => "failed",
            Outcome::Skipped(_) => "skipped",
        }
    }

    /// Why nothing was measured (the report's `error`).
    pub fn reason(&self) -> Option<&str> {
        match self {
            Outcome::Measured(_) => None,
            Outcome::NotApplicable(why) | Outcome::Failed(why) | Outcome::Skipped(why) => Some(why),
        }
    }

    /// A failure's message (failed or skipped), for a report's list of failures.
    pub fn failure(&self) -> Option<&str> {
        self.reason().filter(|_| self.is_failure())
    }

    /// The table cell of a job that measured nothing: `n/a`, `err` or `skip`.
    pub fn missing_cell(&self) -> Option<&'static str> {
        match self {
            Outcome::Measured(_) => None,
            Outcome::NotApplicable(_) => Some("n/a"),
            Outcome::Failed(_) => Some("err"),
            Outcome::Skipped(_) => Some("skip"),
        }
    }

    /// The progress line of a job that measured nothing, after `what` names the job.
    pub fn missing_line(&self, what: &str) -> Option<String> {
        match self {
            Outcome::Measured(_) => None,
            Outcome::NotApplicable(why) => Some(format!("{what}: n/a ({why})")),
            Outcome::Failed(e) => Some(format!("{what}: FAILED: {e}")),
            Outcome::Skipped(why) => Some(format!("{what}: skipped ({why})")),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_says_the_same_in_every_report() {
        let cases: [(Outcome<u8>, &str, Option<&str>, bool); 4] = [
            (Outcome::Measured(1), "ok", None, false),
            (Outcome::NotApplicable("too big".into()), "n/a", Some("n/a"), false),
            (Outcome::Failed("boom".into()), "failed", Some("err"), true),
            (Outcome::Skipped("after boom".into()), "skipped", Some("skip"), true),
        ];
        for (o, status, cell, failure) in cases {
            assert_eq!((o.status(), o.missing_cell(), o.is_failure()), (status, cell, failure));
            assert_eq!(o.measured().is_some(), status == "ok");
            assert_eq!(o.failure().is_some(), failure);
            assert_eq!(o.missing_line("x").is_some(), status != "ok");
        }
        let failed: Outcome<u8> = Outcome::Failed("boom".into());
        assert_eq!(failed.missing_line("lat 64").unwrap(), "lat 64: FAILED: boom");
        assert_eq!(failed.reason(), Some("boom"));
    }
}
