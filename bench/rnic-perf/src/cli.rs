//! The command line (clap derive) and the top-level dispatch.

use std::net::SocketAddr;
use std::process::ExitCode;

use bex_transport::NicSpec;
use clap::{Args, Parser};

use bex_bench::cli::{parse_host_port, Output, ServeArgs, Tests};
use bex_bench::pin::{pin_to, place, Pin, Placement};
use bex_bench::report::Envelope;

use crate::client::{run_client, ClientOptions};
use crate::error::{PerfError, Result};
use crate::launch::{run_local, LocalRun, TOOL};
use crate::report::{self, JobResult};
use crate::server::{serve, ServerOptions};
use crate::spec::{parse_mtu, parse_size_list, resolve_tests, Knobs, Plan, SizeList, TestKind};

/// The default control port (perftest's).
pub const DEFAULT_PORT: u16 = 18515;

const LONG_ABOUT: &str = "\
perftest-style latency and bandwidth benchmarks of the bex RNIC (send_lat, write_lat, send_bw,
write_bw), with kernel UDP and TCP baselines measured by the same tool in the same run.

Two processes, like perftest: `rnic-perf server` on one side, `rnic-perf client --server
HOST:PORT` on the other; a TCP control channel carries each job's parameters and the QP
endpoint exchange. `rnic-perf run` does both on loopback: it spawns the server as a child of
itself and always reaps it.

Latency is the round-trip time (perftest prints half of it); bandwidth is payload Gb/s, the
median over repetitions. Ratios: RNIC p50 / UDP p50 for latency, RNIC / TCP for bandwidth.
Exit status: 0 when every selected test ran (or was n/a), 1 when one failed, 2 for bad usage.";

/// rnic-perf: perftest-style RNIC benchmarks against UDP and TCP baselines.
#[derive(Debug, Parser)]
#[command(name = "rnic-perf", version, long_about = LONG_ABOUT, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands: `server`, `client`, `run`.
pub type Command = bex_bench::cli::Command<ServerArgs, ClientArgs, RunArgs>;

/// `rnic-perf server` options.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// TCP control port; 0 picks a free port. The address is printed on stdout once listening.
    #[arg(long, short = 'p', value_name = "PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// UDP port of this process's soft RNIC (RoCEv2 uses 4791); 0 picks a free port.
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    pub rnic_port: u16,
    /// The RNIC: soft (the software RNIC, its UDP port from --rnic-port) or
    /// `verbs[:DEVICE[:PORT[:GID_INDEX]]]` (a hardware device; a build with the `verbs` feature)
    #[arg(long, value_name = "SPEC", default_value = "soft")]
    pub nic: NicSpec,
    /// What every tool's server takes.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// What to measure and how; shared by `client` and `run`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// The RNIC: soft (the software RNIC, its UDP port from --rnic-port) or
    /// `verbs[:DEVICE[:PORT[:GID_INDEX]]]` (a hardware device; a build with the `verbs` feature)
    #[arg(long, value_name = "SPEC", default_value = "soft")]
    pub nic: NicSpec,
    /// Tests to run, comma-separated. Each RNIC test also brings its baseline (see
    /// --no-baselines).
    #[arg(
        long = "test",
        short = 't',
        alias = "tests",
        value_name = "TEST[,TEST...]",
        value_delimiter = ',',
        default_value = "all",
        value_parser = Tests::<TestKind>::parser()
    )]
    pub tests: Vec<Tests<TestKind>>,
    /// Message sizes in bytes: comma-separated sizes (64, 4K, 1M) and/or power-of-two ranges
    /// (32..1M = 32, 64, ..., 1048576). At least 1 byte, at most 8 MiB.
    #[arg(long, short = 's', value_name = "SIZES", default_value = "32..1M", value_parser = parse_size_list)]
    pub sizes: SizeList,
    /// Path MTUs of the RNIC tests, comma-separated: an IB MTU (256..4096) and/or a soft MTU
    /// (multiple of 4, up to 61440). Each RNIC test runs once per MTU.
    #[arg(long, value_name = "BYTES[,BYTES...]", value_delimiter = ',', default_value = "4096", value_parser = parse_mtu)]
    pub mtu: Vec<u32>,
    /// Measured round trips per size in the latency tests.
    #[arg(long, short = 'n', value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Messages per repetition in the bandwidth tests.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub bw_iters: u32,
    /// Repetitions per size in the bandwidth tests; the table shows their median.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,
    /// How the jobs drive the queues.
    #[command(flatten)]
    pub knobs: Knobs,
    /// Do not add each RNIC test's baseline (udp_lat for *_lat, tcp_bw for *_bw) to the run.
    #[arg(long)]
    pub no_baselines: bool,
    /// Where the report goes.
    #[command(flatten)]
    pub output: Output,
}

/// `rnic-perf client` options.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The server's control address: HOST:PORT, or HOST for the default port 18515.
    #[arg(long, short = 'S', value_name = "HOST[:PORT]", value_parser = parse_server)]
    pub server: SocketAddr,
    /// UDP port of this process's soft RNIC; 0 picks a free port.
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    pub rnic_port: u16,
    /// Pin this process, and the threads it starts (the soft RNIC's too), to CPU N.
    #[arg(long, value_name = "N")]
    pub cpu: Option<usize>,
    /// Benchmark options.
    #[command(flatten)]
    pub bench: BenchArgs,
}

/// `rnic-perf run` options.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// UDP port of the client's soft RNIC; the server child's is this + 1. 0 picks free ports.
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    pub rnic_port: u16,
    /// Where client and server run. On small VMs placement dominates latency (sharing a vCPU
    /// vs waking another one), so both are pinned by default; the report records where.
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
    /// The validated plan these options describe.
    pub fn plan(&self) -> Result<Plan> {
        let mut mtus = self.mtu.clone();
        mtus.dedup();
        let plan = Plan {
            tests: resolve_tests(&self.tests, !self.no_baselines),
            sizes: self.sizes.0.clone(),
            mtus,
            lat_iters: self.iters,
            bw_iters: self.bw_iters,
            reps: self.reps,
            knobs: self.knobs,
        };
        plan.validate()?;
        Ok(plan)
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
            a.nic.probe().map_err(|e| PerfError::NoNic(e.to_string()))?;
            serve(&ServerOptions {
                bind: a.serve.bind,
                port: a.port,
                rnic_port: a.rnic_port,
                nic: a.nic,
                once: a.serve.once,
                die_with_parent: a.serve.die_with_parent,
                quiet: a.serve.quiet,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Client(a) => {
            let plan = a.bench.plan()?;
            pin_to(a.cpu)?;
            a.bench.nic.probe().map_err(|e| PerfError::NoNic(e.to_string()))?;
            let opts = ClientOptions {
                server: a.server,
                rnic_port: a.rnic_port,
                nic: a.bench.nic.clone(),
                quiet: a.bench.output.quiet,
            };
            let results = run_client(&opts, &plan)?;
            let placement = Placement::client(a.cpu);
            finish(&a.bench, &plan, &placement, &results)
        }
        Command::Run(a) => {
            let plan = a.bench.plan()?;
            let placement = place(a.pin)?;
            a.bench.nic.probe().map_err(|e| PerfError::NoNic(e.to_string()))?;
            let local = LocalRun {
                rnic_port: a.rnic_port,
                nic: &a.bench.nic,
                server_cpu: placement.server_cpu,
                quiet: a.bench.output.quiet,
            };
            let results = run_local(&plan, &local)?;
            finish(&a.bench, &plan, &placement, &results)
        }
    }
}

/// Prints the tables, writes the report, and turns failures into exit status 1.
fn finish(
    bench: &BenchArgs,
    plan: &Plan,
    placement: &Placement,
    results: &[JobResult],
) -> Result<ExitCode> {
    let text = report::table(plan, placement, results);
    print!("{text}");
    let envelope = Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), *placement);
    bench.output.write(
        TOOL,
        &text,
        &report::json(&envelope, plan, results),
        &[] as &[(&str, String)],
    )?;
    Ok(bex_bench::cli::exit_status(results.iter().any(JobResult::is_failure)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TestKind;
    use bex_bench::cli::ToolError;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        bex_bench::cli::try_parse(TOOL, args)
    }

    fn bench(args: &[&str]) -> BenchArgs {
        match parse(&[&["run"], args].concat()).unwrap().command {
            Command::Run(r) => r.bench,
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn defaults_cover_every_test_and_size() {
        let plan = bench(&[]).plan().unwrap();
        assert_eq!(plan.tests, TestKind::ALL.to_vec());
        assert_eq!(plan.sizes.len(), 16);
        assert_eq!(plan.mtus, vec![4096]);
        assert_eq!((plan.lat_iters, plan.knobs.warmup, plan.reps), (1000, 100, 5));
    }

    #[test]
    fn options_reach_the_plan() {
        let b = bench(&[
            "--test",
            "send_lat,tcp_lat",
            "--sizes",
            "64,1K..4K",
            "--iters",
            "200",
            "--mtu",
            "4096,61440",
            "--window",
            "64",
            "--batch",
            "8",
            "--signal-every",
            "32",
            "--json",
            "/tmp/x.json",
        ]);
        let plan = b.plan().unwrap();
        assert_eq!(plan.tests, vec![TestKind::UdpLat, TestKind::TcpLat, TestKind::SendLat]);
        assert_eq!(plan.sizes, vec![64, 1024, 2048, 4096]);
        assert_eq!(plan.mtus, vec![4096, 61440]);
        assert_eq!(plan.lat_iters, 200);
        assert_eq!(b.output.json.as_deref(), Some(std::path::Path::new("/tmp/x.json")));
        // send_lat at two MTUs, udp_lat and tcp_lat once each: 4 sizes x 4 series.
        assert_eq!(plan.jobs().len(), 16);
        let no_base = bench(&["--test", "write_bw", "--no-baselines"]).plan().unwrap();
        assert_eq!(no_base.tests, vec![TestKind::WriteBw]);
    }

    #[test]
    fn bad_input_is_a_clear_error_not_a_panic() {
        let e = parse(&["run", "--test", "bogus_lat"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue);
        assert!(e.to_string().contains("bogus_lat"), "{e}");
        let e = parse(&["run", "--sizes", "0"]).unwrap_err();
        assert!(e.to_string().contains("at least 1 byte"), "{e}");
        let e = parse(&["run", "--iters", "0"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        let e = parse(&["run", "--mtu", "5001"]).unwrap_err();
        assert!(e.to_string().contains("soft MTU"), "{e}");
        let e = parse(&["client", "--test", "udp_lat"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MissingRequiredArgument);
        assert!(e.to_string().contains("--server"), "{e}");
        let e = parse(&["client", "--server", "no such host!"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueValidation);
        assert!(parse(&["frobnicate"]).is_err());
        let err = bench(&["--window", "8", "--batch", "16"]).plan().unwrap_err();
        assert!(err.is_usage() && err.to_string().contains("--batch"), "{err}");
        let err = bench(&["--window", "8", "--signal-every", "9"]).plan().unwrap_err();
        assert!(err.is_usage(), "{err}");
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
