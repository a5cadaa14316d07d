//! The log subscriber every bex program installs first: `tracing` events on stderr, filtered
//! by `RUST_LOG` (an `EnvFilter`; default `warn`), as text or, with `BEX_LOG_FORMAT=json`,
//! one JSON object per line (for a log collector). Progress lines and reports are not logs:
//! programs keep printing those to stdout or stderr themselves.

use tracing_subscriber::EnvFilter;

/// The environment paragraph of every program's `--help`.
pub const LOG_HELP: &str = "\
Logs: tracing events on stderr. RUST_LOG filters them (default warn; e.g. info, or
bex_ps_server=debug,warn); BEX_LOG_FORMAT=json writes one JSON object per line.";

/// `RUST_LOG` when it is unset: warnings and errors.
pub const DEFAULT_FILTER: &str = "warn";

/// How events are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `TIME LEVEL target: message key=value …`.
    Text,
    /// One JSON object per event (`timestamp`, `level`, `target`, `fields`).
    Json,
}

impl Format {
    /// From `BEX_LOG_FORMAT` (`text` or `json`; unset: text).
    pub fn from_env() -> Result<Format, String> {
        match std::env::var("BEX_LOG_FORMAT").as_deref() {
            Err(_) | Ok("" | "text") => Ok(Format::Text),
            Ok("json") => Ok(Format::Json),
            Ok(other) => Err(format!("BEX_LOG_FORMAT={other:?}: expected text or json")),
        }
    }
}

/// Installs the subscriber from the environment (`RUST_LOG`, `BEX_LOG_FORMAT`). A bad
/// setting is reported on stderr and the defaults are used: a program never fails to start
/// over its log settings. Calling it twice is harmless (the second does nothing).
pub fn init() {
    let format = Format::from_env().unwrap_or_else(|e| {
        eprintln!("warning: {e}; logging as text");
        Format::Text
    });
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!(
                "warning: RUST_LOG={spec:?} is not a filter ({e}); logging at {DEFAULT_FILTER}"
            );
            EnvFilter::new(DEFAULT_FILTER)
        }),
        Err(_) => EnvFilter::new(DEFAULT_FILTER),
    };
    install(filter, format);
}

fn install(filter: EnvFilter, format: Format) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false);
    // Only the first install takes: a second subscriber would be an error, ignored here.
    let _ = match format {
        Format::Text => builder.try_init(),
        Format::Json => builder.json().flatten_event(false).try_init(),
    };
}
