//! What every tool's command line shares: the server's options, the output options, host and
//! port parsing, the exact command line for the report, and the check that every option has
//! help.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::error::{io, Result};

/// The subcommands of a two-process tool (perftest's shape): `server` answers, `client`
/// measures against a running server, `run` does both on loopback.
#[derive(Debug, Subcommand)]
pub enum Command<S: Args, C: Args, R: Args> {
    /// Serve benchmark sessions on a TCP control port (the passive side).
    Server(S),
    /// Run benchmarks against a running server of this tool.
    Client(C),
    /// Spawn a server child on 127.0.0.1, run the client against it, then reap the child.
    Run(R),
}

/// `server` options every tool has (its control port, whose default differs, is its own).
#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on; data sockets and the RNIC bind to the address the client reached.
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// Serve one client session, then exit with its status (default: serve until killed).
    #[arg(long)]
    pub once: bool,
    /// Exit as soon as standard input closes, so a server spawned by another process never
    /// outlives it (`run` uses this).
    #[arg(long)]
    pub die_with_parent: bool,
    /// Pin this process, and every thread it starts (the soft RNIC's too), to CPU N.
    #[arg(long, value_name = "N")]
    pub cpu: Option<usize>,
    /// Print only errors, not the start and end of each session.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Where a run's report goes, besides the tables on stdout.
#[derive(Clone, Debug, Default, Args)]
pub struct Output {
    /// Write every raw number, the plan and the exact command line to this JSON file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write tables.txt, the JSON report and one SVG per figure into this directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

impl Output {
    /// Writes `json` to `--json`, and `text` (as tables.txt), `json` (as `TOOL.json`) and the
    /// `figures` (file name, SVG) into `--out`; says so on stderr unless quiet.
    pub fn write<N: AsRef<str>>(
        &self,
        tool: &str,
        text: &str,
        json: &str,
        figures: &[(N, String)],
    ) -> Result<()> {
        let write = |path: &Path, body: &str| -> Result<()> {
            std::fs::write(path, body).map_err(io(format!("writing {}", path.display())))?;
            if !self.quiet {
                eprintln!("{tool}: wrote {}", path.display());
            }
            Ok(())
        };
        if let Some(path) = &self.json {
            write(path, json)?;
        }
        if let Some(dir) = &self.out {
            std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
            write(&dir.join("tables.txt"), text)?;
            write(&dir.join(format!("{tool}.json")), json)?;
            for (name, svg) in figures {
                write(&dir.join(name.as_ref()), svg)?;
            }
        }
        Ok(())
    }
}

/// Parses a server address: `IP:PORT`, `IP`, `HOST:PORT` or `HOST` (then `default_port`).
pub fn parse_host_port(text: &str, default_port: u16) -> Result<SocketAddr, String> {
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    let with_port =
        if text.contains(':') { text.to_string() } else { format!("{text}:{default_port}") };
    match with_port.to_socket_addrs() {
        Ok(mut addrs) => addrs.next().ok_or_else(|| format!("`{text}` resolves to no address")),
        Err(e) => Err(format!("`{text}` is not HOST[:PORT]: {e}")),
    }
}

/// A tool's exit status: 1 when a job failed, else 0.
pub fn exit_status(any_failed: bool) -> std::process::ExitCode {
    if any_failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

/// A tool's error: its message, and whether the user caused it (exit status 2).
pub trait ToolError: std::fmt::Display {
    /// True for bad arguments or configuration (exit status 2).
    fn is_usage(&self) -> bool;
}

impl ToolError for crate::Error {
    fn is_usage(&self) -> bool {
        crate::Error::is_usage(self)
    }
}

/// A tool's `main`: parses the process arguments, runs `execute`, and turns an error into
/// `tool: error: …` on stderr and exit status 2 (usage) or 1.
pub fn main_with<P: clap::Parser, E: ToolError>(
    tool: &str,
    execute: impl FnOnce(P) -> Result<std::process::ExitCode, E>,
) -> std::process::ExitCode {
    match execute(P::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{tool}: error: {e}");
            std::process::ExitCode::from(if e.is_usage() { 2 } else { 1 })
        }
    }
}

/// Parses `args` as `tool`'s command line (tests).
pub fn try_parse<P: clap::Parser>(tool: &str, args: &[&str]) -> Result<P, clap::Error> {
    P::try_parse_from(std::iter::once(tool).chain(args.iter().copied()))
}

/// This process's command line, as the report records it.
pub fn command_line() -> Vec<String> {
    std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect()
}

/// Panics unless `cmd` is a consistent clap command whose subcommands and options all have
/// help (a tool's unit test calls it on its `Cli::command()`).
pub fn assert_documented(cmd: clap::Command) {
    cmd.clone().debug_assert();
    let mut all = vec![cmd.clone()];
    all.extend(cmd.get_subcommands().cloned());
    for sub in &all {
        if sub.get_name() != cmd.get_name() {
            assert!(sub.get_about().is_some(), "{} has no help", sub.get_name());
        }
        for arg in sub.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(arg.get_help().is_some(), "{} --{id} has no help", sub.get_name());
        }
    }
}

/// A tool's tests, for `--test`: each by its name, `all`, and the tool's named groups.
pub trait TestSet: clap::ValueEnum + Copy + Ord + Send + Sync + 'static {
    /// Every test; a run executes them in `Ord` order.
    const ALL: &'static [Self];
    /// Named groups besides `all`.
    const GROUPS: &'static [TestGroup<Self>] = &[];
}

/// A named group of a tool's tests, selectable by `--test NAME`.
#[derive(Clone, Copy, Debug)]
pub struct TestGroup<T: 'static> {
    /// Its name on the command line.
    pub name: &'static str,
    /// Its line in `--help`.
    pub help: &'static str,
    /// Whether a test belongs.
    pub member: fn(T) -> bool,
}

/// One `--test` value: the tests it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tests<T>(pub Vec<T>);

impl<T: TestSet> Tests<T> {
    /// What `name` selects: a test, a group or `all`.
    pub fn named(name: &str) -> Option<Tests<T>> {
        let members = |keep: fn(T) -> bool| T::ALL.iter().copied().filter(|&t| keep(t)).collect();
        if name == "all" {
            return Some(Tests(T::ALL.to_vec()));
        }
        if let Some(g) = T::GROUPS.iter().find(|g| g.name == name) {
            return Some(Tests(members(g.member)));
        }
        T::from_str(name, false).ok().map(|t| Tests(vec![t]))
    }

    /// The `--test` value parser: `--help` lists `all`, the groups and every test with its
    /// help, and a wrong name gets clap's error naming them.
    pub fn parser() -> impl clap::builder::TypedValueParser<Value = Tests<T>> {
        use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
        let mut values = vec![PossibleValue::new("all").help("Every test")];
        values.extend(T::GROUPS.iter().map(|g| PossibleValue::new(g.name).help(g.help)));
        values.extend(T::value_variants().iter().filter_map(clap::ValueEnum::to_possible_value));
        PossibleValuesParser::new(values).try_map(|name: String| {
            Tests::named(&name).ok_or_else(|| format!("`{name}` is not a test"))
        })
    }

    /// Every test the values name, once each, in run order.
    pub fn resolve(values: &[Tests<T>]) -> Vec<T> {
        let mut tests: Vec<T> = values.iter().flat_map(|v| v.0.iter().copied()).collect();
        tests.sort();
        tests.dedup();
        tests
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses_take_a_default_port() {
        let p = |t| parse_host_port(t, 18515);
        assert_eq!(p("127.0.0.1:9000").unwrap(), "127.0.0.1:9000".parse().unwrap());
        assert_eq!(p("127.0.0.1").unwrap().port(), 18515);
        assert_eq!(p("localhost:9000").unwrap().port(), 9000);
        assert_eq!(p("[::1]:7").unwrap().port(), 7);
        assert!(p("no such host!").is_err());
    }

    #[test]
    fn output_writes_what_was_asked_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("bex-bench-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let out = Output { json: None, out: Some(dir.join("o")), quiet: true };
        let figs = vec![("a.svg".to_string(), "<svg/>".to_string())];
        out.write("tool", "table\n", "{}", &figs).unwrap();
        let read = |n: &str| std::fs::read_to_string(dir.join("o").join(n)).unwrap();
        assert_eq!(
            (read("tables.txt"), read("tool.json"), read("a.svg")),
            ("table\n".into(), "{}".into(), "<svg/>".into())
        );
        let json = Output { json: Some(dir.join("x.json")), out: None, quiet: true };
        json.write::<&str>("tool", "t", "{\"a\":1}", &[]).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("x.json")).unwrap(), "{\"a\":1}");
        let bad = Output { json: Some(dir.join("missing/x.json")), out: None, quiet: true };
        assert!(bad
            .write::<&str>("tool", "", "", &[])
            .unwrap_err()
            .to_string()
            .contains("missing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
