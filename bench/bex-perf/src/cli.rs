//! The command line (clap derive), the top-level dispatch, and `run`: the server as a child
//! process of this executable on loopback, always reaped.

use std::net::SocketAddr;
use std::process::ExitCode;

use bex_bench::cli::{parse_host_port, Output, ServeArgs, Tests};
use bex_bench::pin::{pin_to, place, Pin, Placement};
use bex_bench::report::Envelope;
use bex_transport::NicSpec;
use clap::{Args, Parser};

use crate::client::{run_client, ClientOptions, Session};
use crate::error::Result;
use crate::report;
use crate::server::{runtime, serve, ServerOptions, TOOL};
use crate::spec::{Plan, Settings, Test};

/// The default control port of `bex-perf server`.
pub const DEFAULT_PORT: u16 = 18516;

const LONG_ABOUT: &str = "\
The paper's transport figures for bex's RDMA transport on the software RNIC, against bex's TCP
transport in the same run:

  lat      Fig. 8   ping-pong RTT (mean, p50, p99), 32 B ... 16 KB, one message outstanding
  tput     Fig. 9   1 MB messages with a 32 B response each, 1 ... 32 outstanding, one engine
  frag     Fig. 10  1 MB throughput vs fragment size, 1 KB ... 1 MB, 16 outstanding
  frag-sim Fig. 10  the same on the in-memory fabric: 25 and 100 Gb/s links, virtual time
  rate     Fig. 11  512 B request rate vs engines (1 ... 128) with 1 and 2 endpoints
  hol      Fig. 13  64 B ping-pong RTT under 0 ... 8 competing 1 MB flows on one engine,
                    4 KB fragments vs none (fragment = message size), on loopback
  hol-rpc  Fig. 13  on the RPC path: a 64 B call's RTT under 0 ... 4 flows of calls with 1 MB
                    replies to one server; 4 KB fragments vs none, two connections per
                    destination (large calls on the bulk lane) vs one, RDMA vs TCP
  hol-sim  Fig. 13  the same on the in-memory fabric: 25 Gb/s link, virtual time, exact
  eager    paper/002: zero-copy eager sends vs copy mode (1 ... 16 KB), and a broadcast of one
                    buffer to 8 sockets

Two processes, like perftest: `bex-perf server` answers, `bex-perf client --server HOST:PORT`
measures; `bex-perf run` does both on loopback, spawning the server as a child of itself and
always reaping it. Tables go to stdout, progress to stderr; --json writes every raw number and
the command line, --out DIR writes the tables, the JSON and one SVG per figure.
Exit status: 0 when every job ran, 1 when one failed, 2 for bad usage.";

/// bex-perf: the paper's transport figures, RDMA vs TCP.
#[derive(Debug, Parser)]
#[command(name = "bex-perf", version, long_about = LONG_ABOUT, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands: `server`, `client`, `run`.
pub type Command = bex_bench::cli::Command<ServerArgs, ClientArgs, RunArgs>;

/// `bex-perf server` options.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// TCP control port; 0 picks a free port. The address is printed on stdout once listening.
    #[arg(long, short = 'p', value_name = "PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Application (tokio) threads; 1 runs the application side on one thread.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub app_threads: u16,
    /// The NIC of the RDMA transports: `soft[:UDP_PORT]` (the software RNIC; RoCEv2's port
    /// 4791, or a free one where another process has it) or
    /// `verbs[:DEVICE[:PORT[:GID_INDEX]]]` (a hardware device; a build with the `verbs`
    /// feature)
    #[arg(long, value_name = "SPEC", default_value = "soft")]
    pub nic: NicSpec,
    /// What every tool's server takes.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// What to measure and how; shared by `client` and `run`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Tests to run, comma-separated.
    #[arg(
        long = "test",
        short = 't',
        alias = "tests",
        value_name = "TEST[,TEST...]",
        value_delimiter = ',',
        default_value = "all",
        value_parser = Tests::<Test>::parser()
    )]
    pub tests: Vec<Tests<Test>>,
    /// Small run for CI (fewer points and iterations; well under 30 s in release mode).
    #[arg(long)]
    pub quick: bool,
    /// Recorded round trips per latency point (default 2000, quick 100; hol uses a quarter).
    #[arg(long, short = 'n', value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: Option<u32>,
    /// Repetitions per throughput and rate point; tables show their median (default 3, quick 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: Option<u32>,
    /// I/O-thread busy-poll time before blocking, µs, on both sides (spinning pays only when
    /// every busy thread has a core of its own).
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub spin_us: u64,
    /// Seed of the simulated fabric (hol-sim).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Run only the jobs of these series, as the tables name them (e.g. `rdma,tcp`): for
    /// profiling one transport at a time.
    #[arg(long, value_name = "NAME[,NAME...]", value_delimiter = ',')]
    pub series: Vec<String>,
    /// Message sizes of `lat` in bytes instead of its defaults (e.g. `32,16384`).
    #[arg(long, value_name = "BYTES[,BYTES...]", value_delimiter = ',')]
    pub sizes: Vec<u64>,
    /// Application (tokio) threads of the client (and of `run`'s server child).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub app_threads: u16,
    /// The NIC of the RDMA transports (and of `run`'s server child): `soft[:UDP_PORT]` or
    /// `verbs[:DEVICE[:PORT[:GID_INDEX]]]`, as for `bex-perf server --nic`
    #[arg(long, value_name = "SPEC", default_value = "soft")]
    pub nic: NicSpec,
    /// Where the report goes.
    #[command(flatten)]
    pub output: Output,
}

/// `bex-perf client` options.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The server's control address: HOST:PORT, or HOST for the default port 18516. Not
    /// needed when only hol-sim runs.
    #[arg(long, short = 'S', value_name = "HOST[:PORT]", value_parser = parse_server)]
    pub server: Option<SocketAddr>,
    /// Pin this process, and every thread it starts, to CPU N.
    #[arg(long, value_name = "N")]
    pub cpu: Option<usize>,
    /// Benchmark options.
    #[command(flatten)]
    pub bench: BenchArgs,
}

/// `bex-perf run` options.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Where client and server run: split (one CPU each, like two hosts), same (one CPU for
    /// both) or none. Placement dominates latency on small VMs; the report records it.
    #[arg(long, value_name = "PLACEMENT", default_value = "split")]
    pub pin: Pin,
    /// Benchmark options.
    #[command(flatten)]
    pub bench: BenchArgs,
}

/// Parses `--server`: `IP:PORT`, `IP`, `HOST:PORT` or `HOST` (default port).
pub fn parse_server(text: &str) -> Result<SocketAddr, String> {
    parse_host_port(text, DEFAULT_PORT)
}

impl BenchArgs {
    /// The selected tests, once each, in run order.
    pub fn tests(&self) -> Vec<Test> {
        Tests::resolve(&self.tests)
    }

    /// The validated plan these options describe.
    pub fn plan(&self) -> Result<Plan> {
        let mut s = Settings::new(self.quick);
        if let Some(n) = self.iters {
            s.iters = n;
        }
        if let Some(n) = self.reps {
            s.reps = n;
        }
        s.spin_us = self.spin_us;
        s.seed = self.seed;
        s.series = self.series.clone();
        s.sizes = self.sizes.clone();
        Plan::new(&self.tests(), s)
    }
}

/// Parses the process arguments, runs, and returns the exit status.
pub fn main_entry() -> ExitCode {
    bex_bench::cli::main_with(TOOL, execute)
}

fn execute(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Server(a) => {
            pin_to(a.serve.cpu)?;
            serve(&ServerOptions {
                bind: a.serve.bind,
                port: a.port,
                once: a.serve.once,
                die_with_parent: a.serve.die_with_parent,
                quiet: a.serve.quiet,
                app_threads: usize::from(a.app_threads),
                nic: a.nic,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Client(a) => {
            let plan = a.bench.plan()?;
            pin_to(a.cpu)?;
            let opts = ClientOptions {
                server: a.server,
                quiet: a.bench.output.quiet,
                nic: a.bench.nic.clone(),
            };
            let rt = runtime(usize::from(a.bench.app_threads))?;
            let session = rt.block_on(run_client(&opts, &plan))?;
            let placement = Placement::client(a.cpu);
            finish(&a.bench, &plan, &placement, &session)
        }
        Command::Run(a) => {
            let plan = a.bench.plan()?;
            let placement = place(a.pin)?;
            let session = run_local(&plan, &a.bench, placement.server_cpu)?;
            finish(&a.bench, &plan, &placement, &session)
        }
    }
}

/// Spawns `bex-perf server` as a child on 127.0.0.1 when the plan needs one, runs the client
/// against it, and reaps the child: on success by closing its stdin (it exits), on any error
/// or panic by killing it ([`bex_bench::server::Guard`]); if this process dies, the child's stdin closes
/// and it exits by itself.
pub fn run_local(plan: &Plan, bench: &BenchArgs, server_cpu: Option<usize>) -> Result<Session> {
    let rt = runtime(usize::from(bench.app_threads))?;
    if !plan.needs_server() {
        let opts =
            ClientOptions { server: None, quiet: bench.output.quiet, nic: bench.nic.clone() };
        return rt.block_on(run_client(&opts, plan));
    }
    let mut args = vec![
        "--app-threads".to_string(),
        bench.app_threads.to_string(),
        "--nic".into(),
        bench.nic.to_string(),
    ];
    if bench.output.quiet {
        args.push("--quiet".into());
    }
    let (guard, server) = bex_bench::server::spawn_local(TOOL, &args, server_cpu)?;
    let opts =
        ClientOptions { server: Some(server), quiet: bench.output.quiet, nic: bench.nic.clone() };
    let session = rt.block_on(run_client(&opts, plan))?;
    // The runtime's transports are gone before the child is asked to exit.
    drop(rt);
    bex_bench::server::finish(guard)?;
    Ok(session)
}

/// What the report should say besides the numbers.
pub fn notes(plan: &Plan, session: &Session) -> Vec<String> {
    let mut n = Vec::new();
    let has = |t: Test| plan.tests.contains(&t);
    if plan.needs_server() {
        n.push(
            "Loopback: client and server are two processes on one host; the software RNIC \
             carries RoCEv2 packets over UDP, so its 'link' is CPU-bound and shares the CPUs \
             with the application and the transport's drivers."
                .into(),
        );
    }
    if has(Test::Rate) {
        n.push(
            "Fig. 11: the software RNIC has no thread domains (DeviceCaps::thread_domains = \
             false), so the paper's with/without-TD comparison cannot be made; every curve is \
             the shared-provider case. A transport keeps one engine per peer address, so the \
             server runs one transport (one endpoint) per engine; the client's engines share \
             1 or 2 endpoints."
                .into(),
        );
    }
    if has(Test::HolSim) || has(Test::FragSim) {
        n.push(
            "frag-sim, hol-sim: times are virtual (the in-memory fabric's clock), exact and \
             repeatable for a seed; links are modelled at 25 (and 100) Gb/s with 2 µs \
             propagation, and the transport's code runs unmodified on them."
                .into(),
        );
    }
    if has(Test::Eager) {
        n.push(
            "eager: the seed paper's 14% (MVAPICH2, InfiniBand hardware) removes a copy that \
             costs real time next to a ~µs network; here both modes also pay the software \
             RNIC's own copies. A broadcast sends one SharedMsg to every socket (\"shared\": no \
             copy at all), or a copy per destination (a Msg is consumed by its send), sent in \
             place (\"zero-copy\") or copied again into the bounce buffer (\"copy\")."
                .into(),
        );
    }
    let other: f64 = session.points.iter().filter_map(|p| p.extra.get("other_cpu_ms")).sum();
    let wall: f64 = session.points.iter().filter_map(|p| p.extra.get("job_ms")).sum();
    if wall > 0.0 {
        let worst = session
            .points
            .iter()
            // /proc/stat counts 10 ms ticks: only jobs of half a second or more say much.
            .filter(|p| p.extra.get("job_ms").is_some_and(|&ms| ms >= 500.0))
            .filter_map(|p| Some((p.extra.get("other_cpu_ms")? / p.extra.get("job_ms")?, p)))
            .fold(None, |a: Option<(f64, &report::Point)>, b| match a {
                Some(a) if a.0 >= b.0 => Some(a),
                _ => Some(b),
            });
        let worst = worst.map_or(String::new(), |(share, p)| {
            format!(
                "; at most {:.0}% of a CPU during one job of 0.5 s or more ({} {} x={})",
                share * 100.0,
                p.job.test,
                p.job.series,
                p.job.x
            )
        });
        n.push(format!(
            "Other processes on this host used {:.1} CPU-seconds during the {:.0} s of jobs \
             ({:.0}% of one CPU on average{worst}); each point's extra.other_cpu_ms has its \
             share. Numbers taken while other work ran are noisier.",
            other / 1000.0,
            wall / 1000.0,
            100.0 * other / wall
        ));
    }
    if session.points.iter().any(|p| p.is_failure()) {
        n.push("Some jobs failed; see Failures.".into());
    }
    n
}

/// Prints the report, writes the JSON and the figures, and turns failures into exit status 1.
fn finish(
    bench: &BenchArgs,
    plan: &Plan,
    placement: &Placement,
    session: &Session,
) -> Result<ExitCode> {
    let notes = notes(plan, session);
    let text = report::text(plan, placement, &session.points, &notes);
    print!("{text}");
    let envelope = Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), *placement);
    let json = report::json(&envelope, session.server_pid, plan, &notes, &session.points);
    bench.output.write(TOOL, &text, &json, &report::figures(&session.points))?;
    Ok(bex_bench::cli::exit_status(session.points.iter().any(report::Point::is_failure)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        bex_bench::cli::try_parse(TOOL, args)
    }

    fn run_args(args: &[&str]) -> RunArgs {
        match parse(&[&["run"], args].concat()).unwrap().command {
            Command::Run(r) => r,
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn defaults_select_every_test_split_pinning_and_full_settings() {
        let r = run_args(&[]);
        assert_eq!(r.pin, Pin::Split);
        let plan = r.bench.plan().unwrap();
        assert_eq!(plan.tests, Test::ALL.to_vec());
        assert!(!plan.settings.quick);
        assert_eq!((plan.settings.iters, plan.settings.reps), (2000, 3));
        assert!(r.bench.output.json.is_none() && r.bench.output.out.is_none());
    }

    #[test]
    fn options_reach_the_plan() {
        let r = run_args(&[
            "--quick",
            "--test",
            "lat,hol-sim",
            "--iters",
            "50",
            "--reps",
            "2",
            "--spin-us",
            "20",
            "--seed",
            "9",
            "--json",
            "/tmp/x.json",
            "--out",
            "/tmp/o",
            "--pin",
            "same",
        ]);
        assert_eq!(r.pin, Pin::Same);
        let plan = r.bench.plan().unwrap();
        assert_eq!(plan.tests, vec![Test::Lat, Test::HolSim]);
        assert!(plan.settings.quick);
        assert_eq!((plan.settings.iters, plan.settings.reps, plan.settings.seed), (50, 2, 9));
        assert!(plan.jobs.iter().all(|j| j.knobs.spin_us == 20));
        assert_eq!(r.bench.output.json.as_deref(), Some(Path::new("/tmp/x.json")));
        assert_eq!(r.bench.output.out.as_deref(), Some(Path::new("/tmp/o")));
        let sim_only = run_args(&["-t", "hol-sim"]).bench.plan().unwrap();
        assert!(!sim_only.needs_server());
    }

    #[test]
    fn bad_input_is_a_clear_error_not_a_panic() {
        let e = parse(&["run", "--test", "bogus"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue);
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = parse(&["run", "--iters", "0"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        let e = parse(&["run", "--pin", "sideways"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue);
        let e = parse(&["client", "--server", "no such host!"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        let e = parse(&["server", "--app-threads", "0"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(parse(&["frobnicate"]).is_err());
    }

    #[test]
    fn server_addresses_take_the_default_port() {
        assert_eq!(parse_server("127.0.0.1").unwrap().port(), DEFAULT_PORT);
    }

    #[test]
    fn every_option_is_documented() {
        use clap::CommandFactory;
        bex_bench::cli::assert_documented(Cli::command());
    }
}
