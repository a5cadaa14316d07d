//! `bex-cluster`: see the crate docs and `--help`.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use bex_launcher::doctor::{self, Level};
use bex_launcher::exec::Executor;
use bex_launcher::launch::Mode;
use bex_launcher::plan::{Plan, PlanInput};
use bex_launcher::probe::Stop;
use bex_launcher::{cleanup, load_config, say};
use clap::{Parser, Subcommand};

/// Starts a bex cluster from its TOML file, runs the workload, collects the reports and
/// tears everything down (also on Ctrl-C or failure).
#[derive(Debug, Parser)]
#[command(name = "bex-cluster", version, after_help = AFTER)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

const AFTER: &str = "\
Exit codes: 0 every process behaved; 1 runtime failure (see report.json \"reasons\");
2 bad usage or configuration; 128+N interrupted by signal N (after a full teardown).
The [launch] section of the cluster file is documented in configs/local.toml.
Logs: tracing events on stderr (RUST_LOG, default warn; BEX_LOG_FORMAT=json for JSON lines).
The processes it starts log at RUST_LOG=info unless RUST_LOG is set, into OUT/logs/NAME.err.";

const RUN_AFTER: &str = "\
[launch] keys (override with --set launch.KEY=VALUE):
  mode = \"loopback\" | \"netns\"      where the processes run
  link_rate = \"10gbit\"              netns: tc tbf rate on both ends of every host link (\"\" = none)
  link_burst, link_queue            tbf burst and limit (default 1 ms at link_rate ≥ 64kb; 2 × burst)
  rankers = 1, trainers = 2         processes per phase (rankers round-robin over serving pods)
  phases = [\"inference\", \"training\"]  in order; \"inference+training\" = both at once; [] = health only
  ranker_args, trainer_args = []    extra CLI args of the clients
  transport = \"rdma\" | \"tcp\"       the clients' transport
  timeout_s = 600                   deadline of the whole workload
  startup_timeout_s = 30            how long servers get to answer /health 200 (start, chaos restart)
  bin_dir = \"\"                      ps-server/ranker/trainer directory (default: next to bex-cluster)
  fresh_data = true                 empty tables each run (checkpoints in OUT/data); false: [cluster].data_dir
  client_metrics_port = 19100       rankers/trainers serve /metrics here (loopback: + id - 1; 0 = off);
                                    every process's last scrape is kept in OUT/metrics/NAME.prom
  hold = false                      after the phases keep the servers up until SIGTERM/Ctrl-C
                                    (then exit 0); clients use OUT/cluster.toml and OUT/secret
Examples:
  bex-cluster run --config configs/local.toml --set 'launch.ranker_args=[\"--seconds\",\"10\"]'
  bex-cluster run --config configs/local.toml --mode netns --set launch.link_rate=1gbit";

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a cluster: start every ps-server (all pods × shards), wait until each prints
    /// `ready` and answers /health 200, run the phases of launch.phases (rankers on the
    /// serving pods, trainers on the training pod), stop the servers with SIGTERM (they
    /// checkpoint) and write OUT/report.json.
    #[command(after_help = RUN_AFTER)]
    Run(RunArgs),
    /// Check this host for the NIC the cluster file configures, before starting anything:
    /// the device, its port, the RoCE v2 GID of the address, link MTU, ECN (from sysfs); the
    /// memlock limit and huge pages; the secret; with --peers, whether the servers answer.
    /// Every finding comes with its fix. Exit status 1 if any is an error. `run` does this
    /// first and stops on errors.
    Doctor(DoctorArgs),
    /// Print the configuration the processes of a run read (the file with the --set
    /// overrides applied, every default spelled out, without `[launch]`), after validating
    /// it: a file to give servers and clients started by other means (containers, Kubernetes).
    Config(ConfigArgs),
    /// Remove leftovers of dead launchers: network namespaces `bex-PID-*` whose launcher
    /// is gone and the processes such launchers recorded (also done at the start of `run`).
    Cleanup,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The cluster file (TOML, e.g. configs/local.toml).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Output directory: cluster.toml (the configuration every process reads),
    /// logs/NAME.{out,err}, CLIENT.json, report.json. Default: target/bex-cluster/run-PID.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Overrides launch.mode: loopback (every process on 127.0.0.1) or netns (one network
    /// namespace per host behind a bridge, tc link rates; needs root and iproute2).
    #[arg(long, value_name = "MODE")]
    mode: Option<String>,
    /// Overrides launch.transport, the clients' transport: rdma or tcp.
    #[arg(long, value_name = "KIND")]
    transport: Option<String>,
    /// Overrides any key of the file, e.g. --set transport.cwnd_bytes=65536,
    /// --set launch.phases='["inference"]', --set tables.0.dim=32. VALUE is TOML (a bare word
    /// is a string); the type must match the key's. Repeatable; applied in order after
    /// --mode/--transport.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Tear the cluster down (as on SIGTERM) when the process that started this one dies,
    /// even by SIGKILL: for programs that run clusters as their children (bex-exp passes
    /// it). Off by default, so that a cluster started with nohup outlives its shell.
    #[arg(long)]
    die_with_parent: bool,
}

#[derive(Debug, clap::Args)]
struct ConfigArgs {
    /// The cluster file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Overrides a key of the file, as for `run`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

fn config_cmd(args: ConfigArgs) -> i32 {
    let (cfg, _) = match load_file(&args.config, &args.sets) {
        Ok(v) => v,
        Err(code) => return code,
    };
    match bex_launcher::exec::process_config_text(&cfg) {
        Ok(t) => {
            say!("{}", t.trim_end_matches('\n'));
            0
        }
        Err(e) => usage(&e),
    }
}

#[derive(Debug, clap::Args)]
struct DoctorArgs {
    /// The cluster file.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// The address this host's processes bind (default: the `[cluster]` host).
    #[arg(long, value_name = "IP")]
    ip: Option<std::net::IpAddr>,
    /// Also connect to every server's RDMA and TCP ports.
    #[arg(long)]
    peers: bool,
    /// Print the findings as JSON.
    #[arg(long)]
    json: bool,
    /// Overrides a key of the file, as for `run`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

/// The address servers of a loopback run bind (the `[cluster]` host), for the doctor.
fn cluster_ip(cfg: &bex_ps_proto::Config) -> std::net::IpAddr {
    cfg.cluster.host
}

fn doctor_cmd(args: DoctorArgs) -> i32 {
    let (cfg, _) = match load_file(&args.config, &args.sets) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let input = doctor::Input {
        cfg: &cfg,
        ip: args.ip.unwrap_or_else(|| cluster_ip(&cfg)),
        secret: std::env::var("BEX_SECRET").ok(),
        peers: args.peers,
    };
    let findings = doctor::examine(&input, &doctor::Host::default());
    if args.json {
        match serde_json::to_string_pretty(&findings) {
            Ok(j) => say!("{j}"),
            Err(e) => return usage(&e.to_string()),
        }
    } else {
        say!("{}", doctor::render(&findings).trim_end_matches('\n'));
    }
    i32::from(doctor::worst(&findings) == Level::Error)
}

fn main() {
    bex_process::logging::init();
    // First: a Ctrl-C from now on leads to a full teardown.
    let stop = match Stop::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bex-cluster: cannot install signal handling: {e}");
            std::process::exit(1);
        }
    };
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Cleanup => {
            let done = cleanup::stale();
            if done.is_empty() {
                say!("bex-cluster: nothing to clean up");
            }
            for d in done {
                say!("bex-cluster: {d}");
            }
            0
        }
        Cmd::Run(args) => run(args, stop),
        Cmd::Doctor(args) => doctor_cmd(args),
        Cmd::Config(args) => config_cmd(args),
    };
    std::process::exit(code);
}

/// The cluster file at `path` with `sets` applied; a usage error (printed, exit code 2)
/// naming the file otherwise.
fn load_file(
    path: &std::path::Path,
    sets: &[String],
) -> Result<(bex_ps_proto::Config, bex_launcher::launch::LaunchConfig), i32> {
    let text =
        std::fs::read_to_string(path).map_err(|e| usage(&format!("{}: {e}", path.display())))?;
    load_config(&text, sets).map_err(|e| usage(&format!("{}:\n{e}", path.display())))
}

fn usage(msg: &str) -> i32 {
    eprintln!("bex-cluster: {msg}");
    2
}

fn run(args: RunArgs, stop: Stop) -> i32 {
    if args.die_with_parent {
        // SIGTERM on the parent's death: `stop` (installed first) turns it into a teardown.
        bex_process::exit_with_parent();
    }
    let pid = std::process::id();
    let mut sets = Vec::new();
    if let Some(m) = &args.mode {
        sets.push(format!("launch.mode={m}"));
    }
    if let Some(t) = &args.transport {
        sets.push(format!("launch.transport={t}"));
    }
    sets.extend(args.sets.iter().cloned());
    let (cfg, launch) = match load_file(&args.config, &sets) {
        Ok(v) => v,
        Err(code) => return code,
    };
    if launch.mode == Mode::Netns {
        if !doctor::is_root() {
            return usage("mode = \"netns\" needs root (network namespaces, veth, tc)");
        }
        for tool in ["ip", "tc"] {
            let found = std::process::Command::new(tool)
                .arg("-V")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok();
            if !found {
                return usage(&format!(
                    "mode = \"netns\" needs `{tool}` (apt-get install iproute2)"
                ));
            }
        }
    }
    let bin_dir = if launch.bin_dir.is_empty() {
        match std::env::current_exe().ok().and_then(|p| p.parent().map(PathBuf::from)) {
            Some(d) => d,
            None => return usage("cannot find the directory of bex-cluster; set launch.bin_dir"),
        }
    } else {
        PathBuf::from(&launch.bin_dir)
    };
    let out = args.out.unwrap_or_else(|| PathBuf::from(format!("target/bex-cluster/run-{pid}")));
    if let Err(e) = std::fs::create_dir_all(&out) {
        return usage(&format!("{}: {e}", out.display()));
    }
    // Absolute, so children and the report name the same files whatever their cwd.
    let out = std::fs::canonicalize(&out).unwrap_or(out);
    // An earlier run's report must not pass for this one's, however this one ends.
    let report = out.join("report.json");
    match std::fs::remove_file(&report) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return usage(&format!("{}: {e}", report.display()));
        }
        _ => {}
    }
    // The host first: a NIC, GID or limit that cannot work fails here, not in every process.
    let input = doctor::Input {
        cfg: &cfg,
        // netns hosts get their addresses later; the host-wide checks still apply.
        ip: if launch.mode == Mode::Netns {
            std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        } else {
            cluster_ip(&cfg)
        },
        // Without one in the environment, every process of the run gets a random secret.
        secret: Some(std::env::var("BEX_SECRET").unwrap_or_else(|_| "per-run".into())),
        peers: false,
    };
    let findings = doctor::examine(&input, &doctor::Host::default());
    if let Ok(j) = serde_json::to_string_pretty(&findings) {
        let _ = std::fs::write(out.join("doctor.json"), j + "\n");
    }
    let notable: Vec<_> = findings.iter().filter(|f| f.level >= Level::Warn).cloned().collect();
    if !notable.is_empty() {
        eprint!("bex-cluster: doctor:\n{}", doctor::render(&notable));
    }
    if doctor::worst(&findings) == Level::Error {
        return usage(
            "this host cannot run the cluster as configured (see the doctor's fixes above)",
        );
    }
    for d in cleanup::stale() {
        say!("bex-cluster: {d}");
    }
    let input = PlanInput { launcher_pid: pid, out_dir: out.clone(), bin_dir };
    let plan = match Plan::build(&cfg, &launch, &input) {
        Ok(p) => p,
        Err(e) => return usage(&e),
    };
    let exec = match Executor::new(plan, launch, out.clone(), stop, pid) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("bex-cluster: {e}");
            return 1;
        }
    };
    let outcome = exec.run();
    let r = &outcome.report;
    say!("bex-cluster: report {}", out.join("report.json").display());
    for p in &r.phases {
        say!(
            "  phase {}: {}s, server cpu user {:.2}s sys {:.2}s, rnic {:?}",
            p.name,
            p.duration_s,
            p.server_cpu_total.user_s,
            p.server_cpu_total.sys_s,
            p.rnic_total
        );
    }
    if outcome.ok {
        say!("bex-cluster: OK ({}s)", r.duration_s);
    } else {
        eprintln!("bex-cluster: FAILED");
        for reason in &r.reasons {
            eprintln!("  - {reason}");
        }
    }
    outcome.exit_code
}
