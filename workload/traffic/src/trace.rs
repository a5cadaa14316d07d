//! JSON-lines traces: one `{"offset_ns": .., "request": {..}}` object per line, offsets
//! non-decreasing. A trace generated once replays identically, whatever the generator does
//! later.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::arrivals::Arrivals;
use crate::request::{Request, RequestGen, SpecError, WorkloadSpec};

/// One trace line: when the request arrives (from the start of the run) and what it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    /// Arrival offset from the start of the run, nanoseconds.
    pub offset_ns: u64,
    /// The request.
    pub request: Request,
}

impl TraceRecord {
    /// A record arriving at `offset` (saturating at `u64::MAX` ns, ~584 years).
    pub fn new(offset: Duration, request: Request) -> Self {
        Self { offset_ns: u64::try_from(offset.as_nanos()).unwrap_or(u64::MAX), request }
    }

    /// The arrival offset.
    pub fn offset(&self) -> Duration {
        Duration::from_nanos(self.offset_ns)
    }
}

/// Why a trace could not be read. Lines are numbered from 1.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed (including a line that is not UTF-8).
    #[error("trace line {line}: read failed: {source}")]
    Io {
        /// Line number.
        line: usize,
        /// The I/O error.
        source: io::Error,
    },
    /// The line is not a valid record.
    #[error("trace line {line}: malformed record: {message}")]
    Malformed {
        /// Line number.
        line: usize,
        /// What serde_json said, with its column.
        message: String,
    },
    /// The line arrives before the previous one.
    #[error(
        "trace line {line}: offset_ns {offset_ns} is before the previous line's {previous_ns}"
    )]
    OutOfOrder {
        /// Line number.
        line: usize,
        /// This line's offset.
        offset_ns: u64,
        /// The previous record's offset.
        previous_ns: u64,
    },
    /// The line arrives after [`MAX_TRACE_SPAN_NS`]: one mistyped offset would have the
    /// replay sleep for years.
    #[error("trace line {line}: offset_ns {offset_ns} is past one day, the longest run")]
    TooLate {
        /// Line number.
        line: usize,
        /// This line's offset.
        offset_ns: u64,
    },
    /// Opening the file failed.
    #[error("trace {path}: {source}")]
    Open {
        /// The path.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
}

/// Writes `records` as JSON lines (one record per line, `\n`-terminated). Does not check
/// order; [`read_trace`] does.
pub fn write_trace<'a, W: Write>(
    mut w: W,
    records: impl IntoIterator<Item = &'a TraceRecord>,
) -> io::Result<()> {
    for r in records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// The latest offset a trace may hold: one day, the longest run a ranker makes.
pub const MAX_TRACE_SPAN_NS: u64 = 86_400 * 1_000_000_000;

/// Reads a trace written by [`write_trace`]. Blank (whitespace-only) lines are skipped; any
/// other line must be one record, with offsets non-decreasing and at most
/// [`MAX_TRACE_SPAN_NS`]. Never panics on bad input.
pub fn read_trace<R: BufRead>(r: R) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out: Vec<TraceRecord> = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line_no = i + 1;
        let text = line.map_err(|source| TraceError::Io { line: line_no, source })?;
        if text.trim().is_empty() {
            continue;
        }
        let rec: TraceRecord = serde_json::from_str(&text)
            .map_err(|e| TraceError::Malformed { line: line_no, message: e.to_string() })?;
        if rec.offset_ns > MAX_TRACE_SPAN_NS {
            return Err(TraceError::TooLate { line: line_no, offset_ns: rec.offset_ns });
        }
        if let Some(prev) = out.last() {
            if rec.offset_ns < prev.offset_ns {
                return Err(TraceError::OutOfOrder {
                    line: line_no,
                    offset_ns: rec.offset_ns,
                    previous_ns: prev.offset_ns,
                });
            }
        }
        out.push(rec);
    }
    Ok(out)
}

/// [`write_trace`] to a new file at `path` (truncating an existing one).
pub fn write_trace_file<'a>(
    path: impl AsRef<Path>,
    records: impl IntoIterator<Item = &'a TraceRecord>,
) -> io::Result<()> {
    write_trace(BufWriter::new(File::create(path)?), records)
}

/// [`read_trace`] from the file at `path`.
pub fn read_trace_file(path: impl AsRef<Path>) -> Result<Vec<TraceRecord>, TraceError> {
    let path = path.as_ref();
    let f = File::open(path)
        .map_err(|source| TraceError::Open { path: path.display().to_string(), source })?;
    read_trace(BufReader::new(f))
}

/// A trace of Poisson arrivals at `rate_per_s` over `duration`, each carrying the next
/// request of `spec`. Deterministic for `seed` (requests and arrivals use independent streams
/// derived from it).
///
/// # Panics
/// If `rate_per_s` is not finite and positive (see [`Arrivals::new`]).
pub fn generate_trace(
    spec: WorkloadSpec,
    rate_per_s: f64,
    duration: Duration,
    seed: u64,
) -> Result<Vec<TraceRecord>, SpecError> {
    let mut gen = RequestGen::new(spec, seed)?;
    let arrivals = Arrivals::new(rate_per_s, seed ^ 0x9e37_79b9_7f4a_7c15);
    Ok(arrivals.offsets_for(duration).map(|at| TraceRecord::new(at, gen.next())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{CandidateDist, ModelSpec, SlotSpec};

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            models: vec![ModelSpec {
                model: 7,
                slots: vec![SlotSpec {
                    table: 3,
                    vocab: 100,
                    zipf_s: 1.1,
                    ids_fixed: 1,
                    ids_per_candidate: 2,
                }],
            }],
            models_per_request: 1,
            candidates: CandidateDist::LogUniform { min: 1, max: 50 },
        }
    }

    fn trace() -> Vec<TraceRecord> {
        generate_trace(spec(), 500.0, Duration::from_millis(200), 5).unwrap()
    }

    #[test]
    fn generation_is_deterministic() {
        let a = trace();
        assert!((60..140).contains(&a.len()), "{} records", a.len());
        assert_eq!(a, trace());
        assert_ne!(a, generate_trace(spec(), 500.0, Duration::from_millis(200), 6).unwrap());
    }

    #[test]
    fn round_trip_in_memory_and_on_disk() {
        let recs = trace();
        let mut buf = Vec::new();
        write_trace(&mut buf, &recs).unwrap();
        let text = String::from_utf8(buf.clone()).unwrap();
        assert_eq!(text.lines().count(), recs.len());
        assert_eq!(read_trace(&buf[..]).unwrap(), recs);

        let dir = std::env::temp_dir().join(format!("bex-traffic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.jsonl");
        write_trace_file(&path, &recs).unwrap();
        let back = read_trace_file(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back, recs);
        // Written again, byte for byte the same.
        let mut again = Vec::new();
        write_trace(&mut again, &back).unwrap();
        assert_eq!(again, buf);
    }

    fn line_of(r: &TraceRecord) -> String {
        serde_json::to_string(r).unwrap()
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let recs = trace();
        let good0 = line_of(&recs[0]);
        let good1 = line_of(&recs[1]);
        let cases: Vec<(String, usize)> =
            vec![
            (format!("{good0}\nnot json\n"), 2),
            (format!("{good0}\n{good1}\n{{\"offset_ns\": 5}}\n"), 3),
            (format!("{{\"offset_ns\": -1, \"request\": {}}}\n", line_of(&recs[0])), 1),
            (format!("{good0}\n\n{}\n", &good1[..good1.len() / 2]), 3),
            (format!("{good0}\n[1,2,3]\n"), 2),
            ("{\"offset_ns\":1,\"request\":{\"id\":0,\"candidates\":1,\"models\":[]},\"x\":1}\n"
                .to_string(), 1),
        ];
        for (text, line) in cases {
            match read_trace(text.as_bytes()) {
                Err(TraceError::Malformed { line: l, message }) => {
                    assert_eq!(l, line, "{text:?}: {message}");
                    let shown = TraceError::Malformed { line: l, message }.to_string();
                    assert!(shown.starts_with(&format!("trace line {line}: malformed")), "{shown}");
                }
                other => panic!("{text:?}: expected Malformed at line {line}, got {other:?}"),
            }
        }
    }

    #[test]
    fn out_of_order_non_utf8_and_missing_file() {
        let recs = trace();
        let text = format!("{}\n{}\n", line_of(&recs[1]), line_of(&recs[0]));
        assert!(matches!(read_trace(text.as_bytes()), Err(TraceError::OutOfOrder { line: 2, .. })));
        // An offset past a day (a mistyped one would have the replay sleep for years).
        let mut late = recs[1].clone();
        late.offset_ns = MAX_TRACE_SPAN_NS + 1;
        let text = format!("{}\n{}\n", line_of(&recs[0]), line_of(&late));
        assert!(matches!(read_trace(text.as_bytes()), Err(TraceError::TooLate { line: 2, .. })));
        late.offset_ns = MAX_TRACE_SPAN_NS;
        let text = format!("{}\n{}\n", line_of(&recs[0]), line_of(&late));
        assert!(read_trace(text.as_bytes()).is_ok(), "a day exactly");
        let mut bytes = format!("{}\n", line_of(&recs[0])).into_bytes();
        bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
        assert!(matches!(read_trace(&bytes[..]), Err(TraceError::Io { line: 2, .. })));
        assert!(matches!(
            read_trace_file("/nonexistent/bex-traffic/trace.jsonl"),
            Err(TraceError::Open { .. })
        ));
        // Blank lines and an empty file are fine.
        assert_eq!(read_trace(&b""[..]).unwrap(), vec![]);
        let text = format!("\n{}\n  \n", line_of(&recs[0]));
        assert_eq!(read_trace(text.as_bytes()).unwrap(), vec![recs[0].clone()]);
    }
}
