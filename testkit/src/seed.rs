//! The one seed variable of the tests: `BEX_SEED=n` runs seed n, `BEX_SEED=a..b` seeds a to
//! b − 1. A test that fails prints the line that replays it ([`replay`], [`Replay`]).
//!
//! The names older tests read (`BEX_SIM_SEED`, `BEX_SIM_SEEDS`, `BEX_SIM_SEED_RANGE`,
//! `BEX_SIMCLUSTER_SEEDS`, `BEX_FUZZ_SEED`) are refused with the `BEX_SEED` that replaces
//! them, rather than read (two names for one thing) or ignored (a replay that silently ran
//! the default seeds).

use std::ops::Range;

/// The variable.
pub const VAR: &str = "BEX_SEED";

/// Variables no longer read.
const RETIRED: [&str; 5] = [
    "BEX_SIM_SEED",
    "BEX_SIM_SEEDS",
    "BEX_SIM_SEED_RANGE",
    "BEX_SIMCLUSTER_SEEDS",
    "BEX_FUZZ_SEED",
];

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

/// The seeds to run: `BEX_SEED`'s, else `default`. Panics with a clear message on a
/// malformed value or a retired variable (it is a test's input).
pub fn seeds(default: Range<u64>) -> Range<u64> {
    seeds_in(|name| std::env::var(name).ok(), default).unwrap_or_else(|e| panic!("{e}"))
}

/// The one seed of a test that runs one: `BEX_SEED=n`'s, else `default`. Panics on a range
/// of more than one seed, which such a test would not run.
pub fn one_seed(default: u64) -> u64 {
    one_seed_in(|name| std::env::var(name).ok(), default).unwrap_or_else(|e| panic!("{e}"))
}

/// [`one_seed`] with the environment read through `var`.
fn one_seed_in(var: impl Fn(&str) -> Option<String>, default: u64) -> Result<u64, String> {
    let r = seeds_in(var, default..default.saturating_add(1))?;
    if r.end - r.start == 1 {
        Ok(r.start)
    } else {
        Err(format!("this test runs one seed: set {VAR}=n, not {VAR}={}..{}", r.start, r.end))
    }
}

/// [`seeds`] with the environment read through `var`.
fn seeds_in(
    var: impl Fn(&str) -> Option<String>,
    default: Range<u64>,
) -> Result<Range<u64>, String> {
    let var = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(old) = RETIRED.iter().find(|n| var(n).is_some()) {
        return Err(format!("{old} is no longer read: set {VAR}=n or {VAR}=a..b"));
    }
    var(VAR).map_or(Ok(default), |v| parse(&v))
}

/// One seed of a test ([`one_seed`]) that prints its replay line if the test panics
/// while this is held.
#[derive(Debug)]
pub struct Replay {
    /// The seed.
    pub seed: u64,
    command: String,
}

impl Replay {
    /// [`one_seed`]; `command` runs the test (e.g. `cargo test -p bex-transport --test sim
    /// credits`).
    pub fn seed(default: u64, command: impl Into<String>) -> Replay {
        let seed = one_seed(default);
        Replay { seed, command: command.into() }
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", replay(self.seed, &self.command));
        }
    }
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
        // A name that matches no test passes with nothing run.
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(ran_tests(&stdout), "{test_args:?} seeds {a}..{b} ran no test:\n{stdout}");
        a = b;
    }
    eprintln!("{test_args:?}: {} seeds passed", seeds.end - seeds.start);
    true
}

/// Whether libtest's output says at least one test passed.
fn ran_tests(stdout: &str) -> bool {
    stdout.lines().any(|l| {
        l.strip_prefix("test result: ok. ")
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    })
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
    fn the_variable_or_the_default_and_retired_names_are_refused() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        assert_eq!(seeds_in(env(&[]), 1..51), Ok(1..51));
        assert_eq!(seeds_in(env(&[("BEX_SEED", "")]), 1..51), Ok(1..51));
        assert_eq!(seeds_in(env(&[("BEX_SEED", "4..6")]), 1..51), Ok(4..6));
        let old = seeds_in(env(&[("BEX_SIM_SEEDS", "9"), ("BEX_SEED", "3")]), 1..51);
        assert!(old.unwrap_err().contains("BEX_SIM_SEEDS is no longer read"));
        assert!(seeds_in(env(&[("BEX_SEED", "z")]), 1..51).is_err());
        assert_eq!(one_seed_in(env(&[]), 7), Ok(7));
        assert_eq!(one_seed_in(env(&[("BEX_SEED", "9")]), 7), Ok(9));
        assert!(one_seed_in(env(&[("BEX_SEED", "1..4")]), 7).unwrap_err().contains("one seed"));
        assert!(!run_chunked(&(0..10), 10, &["never"]));
    }

    #[test]
    fn a_child_run_counts_only_if_a_test_passed() {
        assert!(ran_tests("running 1 test\ntest result: ok. 1 passed; 0 failed; 0 ignored"));
        assert!(!ran_tests("running 0 tests\ntest result: ok. 0 passed; 0 failed; 0 ignored"));
        assert!(!ran_tests(""));
    }
}
