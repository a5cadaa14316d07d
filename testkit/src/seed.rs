//! The one seed variable of the tests: `BEX_SEED=n` runs seed n, `BEX_SEED=a..b` seeds a to
//! b − 1. A test that fails prints the line that replays it ([`replay`]).
//!
//! The names older tests read (`BEX_SIM_SEED`, `BEX_SIM_SEEDS`, `BEX_SIM_SEED_RANGE`,
//! `BEX_SIMCLUSTER_SEEDS`) still work, with a warning naming the `BEX_SEED` that replaces
//! them.

use std::ops::Range;

/// The variable.
pub const VAR: &str = "BEX_SEED";

/// Parses `n` or `a..b` (a < b).
pub fn parse(text: &str) -> Result<Range<u64>, String> {
    let num = |s: &str| {
        s.trim().parse::<u64>().map_err(|_| format!("{VAR}: {s:?} is not a number (n or a..b)"))
    };
    match text.split_once("..") {
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            if a < b {
                Ok(a..b)
            } else {
                Err(format!("{VAR}={text}: an empty range"))
            }
        }
        None => {
            let n = num(text)?;
            let end = n.checked_add(1).ok_or_else(|| format!("{VAR}={text}: too large"))?;
            Ok(n..end)
        }
    }
}

/// The seeds to run: `BEX_SEED`'s, else an older variable's (with a warning), else
/// `default`. Panics with a clear message on a malformed value (it is a test's input).
pub fn seeds(default: Range<u64>) -> Range<u64> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(v) = var(VAR) {
        return parse(&v).unwrap_or_else(|e| panic!("{e}"));
    }
    type FromCount = fn(u64) -> Range<u64>;
    let legacy: [(&str, FromCount); 3] = [
        ("BEX_SIM_SEED", |s| s..s.saturating_add(1)),
        ("BEX_SIM_SEEDS", |n| 1..n.saturating_add(1)),
        ("BEX_SIMCLUSTER_SEEDS", |n| 0..n),
    ];
    for (name, range) in legacy {
        if let Some(v) = var(name) {
            let n = v.trim().parse().unwrap_or_else(|_| panic!("{name}={v}: not a number"));
            let r = range(n);
            eprintln!("{name} is deprecated: use {VAR}={}..{}", r.start, r.end);
            return r;
        }
    }
    if let Some(v) = var("BEX_SIM_SEED_RANGE") {
        let r = parse(&v).unwrap_or_else(|e| panic!("BEX_SIM_SEED_RANGE: {e}"));
        eprintln!("BEX_SIM_SEED_RANGE is deprecated: use {VAR}={v}");
        return r;
    }
    default
}

/// The line that replays `seed` of the test `command` (e.g. `cargo test -p bex-incast --test
/// ps_faults`).
pub fn replay(seed: u64, command: &str) -> String {
    format!("replay: {VAR}={seed} {command}")
}

/// Runs `seeds` in child processes of this test binary, `chunk` seeds each (`BEX_SEED=a..b`,
/// the test `test_args` names), when there are more than `chunk`; returns false, and runs
/// nothing, when there are not (the caller then runs them itself). Each simulated node
/// leaks a registered pool with a jemalloc arena (at most 4095 per process), hence chunks.
pub fn run_chunked(seeds: &Range<u64>, chunk: u64, test_args: &[&str]) -> bool {
    if seeds.end - seeds.start <= chunk {
        return false;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let mut a = seeds.start;
    while a < seeds.end {
        let b = a.saturating_add(chunk).min(seeds.end);
        let out = std::process::Command::new(&exe)
            .args(test_args)
            .args(["--exact", "--nocapture"])
            .env(VAR, format!("{a}..{b}"))
            .output()
            .expect("the child test runs");
        assert!(
            out.status.success(),
            "{test_args:?} seeds {a}..{b} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        a = b;
    }
    eprintln!("{test_args:?}: {} seeds passed", seeds.end - seeds.start);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_or_a_range() {
        assert_eq!(parse("7"), Ok(7..8));
        assert_eq!(parse("3..10"), Ok(3..10));
        assert_eq!(parse(" 0 .. 2 "), Ok(0..2));
        assert!(parse("5..5").unwrap_err().contains("empty"));
        assert!(parse("x").unwrap_err().contains("not a number"));
        assert!(parse("1..y").is_err());
        assert!(parse(&u64::MAX.to_string()).unwrap_err().contains("too large"));
    }

    #[test]
    fn the_replay_line_names_the_variable() {
        assert_eq!(replay(9, "cargo test -p x"), "replay: BEX_SEED=9 cargo test -p x");
    }

    #[test]
    fn without_a_variable_the_default_runs() {
        // The test environment does not set BEX_SEED (CI never does).
        if std::env::var_os(VAR).is_none() && std::env::var_os("BEX_SIM_SEEDS").is_none() {
            assert_eq!(seeds(1..51), 1..51);
        }
        assert!(!run_chunked(&(0..10), 10, &["never"]));
    }
}
