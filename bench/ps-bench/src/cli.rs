//! The command line (clap derive) and the run: the server children (or a running cluster),
//! the client transports and `PsClient`s, the cells, the report.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bex_bench::cli::Output;
use bex_bench::pin::{allowed_cpus, choose, pin_self, Pin, Placement};
use bex_bench::report::{finite, Envelope};
use bex_client::fanout::PsClient;
use bex_client::node::{client_config, cluster_secret, nic_spec, transport_config, ClientRole};
use bex_ps_proto::config::PushAck;
use bex_ps_proto::Config;
use bex_transport::{NicSpec, Stack, TransportKind};
use clap::Parser;

use crate::cell::{run_cell, Mode, Op, Settings};
use crate::cluster::{self, ServerChild, CONNECT_TIMEOUT_MS, REQUEST_TIMEOUT_MS};
use crate::report::{self, CellReport, Report, Setup};
use crate::usage::UsageMark;
use crate::{Error, Result, DIM, TABLE, TOOL};

const LONG_ABOUT: &str = "\
Benchmarks one ps-server shard (a child process on loopback, or a running cluster's) through
PsClient over RDMA (the software RNIC, or a hardware NIC) and TCP: Pull (Fetch) and Push of K
keys x 64 f32, closed loop with 1 and 16 outstanding requests, on a warm table and
insert-heavy (fresh keys every request). Every cell runs on both transports at the same
outstanding count; the tables give RDMA / TCP per cell and issue 5's latency targets.

The ps-server child is killed and reaped on exit, error, panic, SIGINT and SIGTERM; on SIGKILL
of this process it gets SIGTERM from the kernel (ps-server asks for PR_SET_PDEATHSIG, and it
is started from the main thread, which lives as long as this process).
Exit status: 0 when the run completed, 1 when it failed, 2 for bad usage.";

/// ps-bench: one ps-server shard through PsClient, RDMA against TCP.
#[derive(Debug, Parser)]
#[command(name = "ps-bench", version, long_about = LONG_ABOUT)]
pub struct Cli {
    /// CI smoke run (< 20 s): keys 100,1000, short cells.
    #[arg(long)]
    pub quick: bool,
    /// Keys per request, comma-separated (default 100,1000,10000; quick 100,1000).
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',', value_parser = positive)]
    pub keys: Vec<usize>,
    /// Requests in flight, comma-separated.
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',', default_value = "1,16", value_parser = positive)]
    pub outstanding: Vec<usize>,
    /// Transports, comma-separated: rdma, tcp.
    #[arg(long, value_name = "KIND[,KIND...]", value_delimiter = ',', default_value = "rdma,tcp", value_parser = <TransportKind as std::str::FromStr>::from_str)]
    pub transports: Vec<TransportKind>,
    /// Requests, comma-separated: pull (alias fetch), push.
    #[arg(long, value_name = "OP[,OP...]", value_delimiter = ',', default_value = "pull,push")]
    pub ops: Vec<Op>,
    /// Key choices, comma-separated: warm, insert.
    #[arg(
        long,
        value_name = "MODE[,MODE...]",
        value_delimiter = ',',
        default_value = "warm,insert"
    )]
    pub modes: Vec<Mode>,
    /// Measured time per cell, seconds (default 2; quick 0.15).
    #[arg(long, value_name = "S")]
    pub seconds: Option<f64>,
    /// Unmeasured time before each cell, seconds (default 0.3; quick 0.05).
    #[arg(long = "warmup-seconds", value_name = "S")]
    pub warmup_seconds: Option<f64>,
    /// Fresh rows per insert-heavy cell measured, at least 100 requests' worth (default
    /// 400000; quick 50000; the warm-up inserts at most a quarter of that).
    #[arg(long, value_name = "N")]
    pub max_insert_rows: Option<u64>,
    /// The ps-server executable (default: the one next to this one).
    #[arg(long, value_name = "PATH")]
    pub server: Option<PathBuf>,
    /// Ports P..P+2 for the server (default: free ports below 32000).
    #[arg(long, value_name = "P")]
    pub base_port: Option<u16>,
    /// Override `[transport]` KEY (eager_max, fragment_bytes, grant_max_bytes, path_mtu,
    /// spin_us, endpoints, sq_depth, rq_depth, cwnd_bytes) for the server and the client;
    /// repeatable (default: the config defaults).
    #[arg(long = "transport-set", value_name = "KEY=N", value_parser = key_number)]
    pub transport_set: Vec<(String, u64)>,
    /// The NIC of server and client: `soft[:UDP_PORT]` (default: the software RNIC) or
    /// `verbs[:DEVICE[:PORT[:GID_INDEX]]]` (hardware; a build with the `verbs` feature).
    #[arg(long, value_name = "SPEC")]
    pub nic: Option<NicSpec>,
    /// split (client on the first allowed CPU, server(s) on the second, like two hosts), same
    /// (both on the first) or none (the scheduler decides). On small VMs placement dominates
    /// latency: unpinned, the scheduler sometimes runs client and server on one vCPU and
    /// sometimes not.
    #[arg(long, value_name = "PLACEMENT", default_value = "split")]
    pub pin: Pin,
    /// Two pods: a replica server too, and the shard's `[server] push_ack` = replicated (a push
    /// answered once the replica applied it) or applied (answered after the training server's
    /// apply); server CPU counts the training server only (default: one pod).
    #[arg(long, value_name = "MODE", value_parser = push_ack)]
    pub push_ack: Option<PushAck>,
    /// Drive a running cluster (its cluster file; table 0 must have dim 64) instead of a
    /// ps-server child of its own: other clients, such as the Python binding's benchmark,
    /// then measure the same server. The server's CPU and context switches are counted only
    /// with --server-pid; --pin places this process only.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["push_ack", "server", "base_port", "nic"])]
    pub cluster: Option<PathBuf>,
    /// With --cluster: the shard's ps-server, for its CPU and context switches.
    #[arg(long, value_name = "PID", requires = "cluster")]
    pub server_pid: Option<u32>,
    /// Also every panel (latency, then CPU) in one SVG at this path.
    #[arg(long, value_name = "PATH")]
    pub svg: Option<PathBuf>,
    /// Where the report goes: --json, --out (tables.txt, ps-bench.json, ps-bench-latency.svg,
    /// ps-bench-cpu.svg), --quiet.
    #[command(flatten)]
    pub output: Output,
}

fn positive(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("not a positive integer: {text:?}")),
    }
}

fn push_ack(text: &str) -> Result<PushAck, String> {
    match text {
        "replicated" => Ok(PushAck::Replicated),
        "applied" => Ok(PushAck::Applied),
        _ => Err(format!("replicated or applied, not {text:?}")),
    }
}

fn key_number(text: &str) -> Result<(String, u64), String> {
    text.split_once('=')
        .and_then(|(k, n)| Some((k.trim().to_string(), n.trim().parse().ok()?)))
        .ok_or(format!("expected KEY=NUMBER, got {text:?}"))
}

impl Cli {
    /// The cells' settings, defaults filled in and checked.
    pub fn settings(&self) -> Result<Settings> {
        let q = self.quick;
        let s = Settings {
            quick: q,
            keys: if self.keys.is_empty() {
                if q {
                    vec![100, 1000]
                } else {
                    vec![100, 1000, 10_000]
                }
            } else {
                self.keys.clone()
            },
            outstanding: self.outstanding.clone(),
            transports: self.transports.clone(),
            ops: self.ops.clone(),
            modes: self.modes.clone(),
            seconds: self.seconds.unwrap_or(if q { 0.15 } else { 2.0 }),
            warmup_seconds: self.warmup_seconds.unwrap_or(if q { 0.05 } else { 0.3 }),
            max_insert_rows: self.max_insert_rows.unwrap_or(if q { 50_000 } else { 400_000 }),
        };
        let ok = |x: f64, min_exclusive: bool| {
            x.is_finite() && if min_exclusive { x > 0.0 } else { x >= 0.0 }
        };
        if !ok(s.seconds, true) || !ok(s.warmup_seconds, false) || s.seconds > 3600.0 {
            return Err(bex_bench::Error::Usage(
                "--seconds must be in (0, 3600] and --warmup-seconds >= 0".into(),
            )
            .into());
        }
        let mut cfg = cluster::generated(Path::new("."), 1, None);
        cluster::apply_transport_set(&mut cfg, &self.transport_set)
            .map_err(|e| bex_bench::Error::Usage(e.to_string()))?;
        Ok(s)
    }
}

/// Parses the process arguments, runs, and returns the exit status.
pub fn main_entry() -> ExitCode {
    bex_bench::cli::main_with("ps-bench", |cli: Cli| {
        let settings = cli.settings()?;
        if let Some(Err(e)) = cli.nic.as_ref().map(NicSpec::probe) {
            eprintln!("ps-bench: {e}");
            return Ok(ExitCode::from(e.exit_code()));
        }
        run(&cli, &settings).map(|()| ExitCode::SUCCESS)
    })
}

/// The server side of a run, and where it is.
struct Servers {
    cfg: Config,
    /// The server's ready line, or the running cluster's file.
    ready: String,
    /// The shard's server process (0: unknown).
    pid: u32,
    placement: Placement,
    /// The training server, then the replica: killed before the client's runtime stops.
    children: Vec<ServerChild>,
}

fn start_servers(cli: &Cli) -> Result<Servers> {
    let placement = choose(cli.pin, &allowed_cpus()?)?;
    if let Some(path) = &cli.cluster {
        let cfg = cluster::running(path, &cli.transport_set)?;
        if let Some(cpu) = placement.client_cpu {
            pin_self(cpu)?;
        }
        let ready = format!("running cluster {}", path.display());
        // Pid 0 is never a process: its CPU and switches read as zero.
        let pid = cli.server_pid.unwrap_or(0);
        return Ok(Servers { cfg, ready, pid, placement, children: Vec::new() });
    }
    let exe = cluster::server_exe(cli.server.as_deref())?;
    let base_port = match cli.base_port {
        Some(p) => p,
        None => bex_process::free_local_ports(6)
            .map_err(|e| format!("choosing ports (give --base-port): {e}"))?,
    };
    let dir = std::env::temp_dir().join(format!("bex-ps-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = cluster::generated_checked(
        &dir,
        base_port,
        cli.push_ack,
        &cli.transport_set,
        cli.nic.as_ref(),
    )?;
    // Children inherit the affinity of the thread that starts them: the servers are started
    // from the server CPU, then this thread moves to the client's before any other exists.
    if let Some(cpu) = placement.server_cpu {
        pin_self(cpu)?;
    }
    let mut children = Vec::new();
    if cli.push_ack.is_some() {
        children.push(cluster::spawn_server(&exe, &cfg, dir.join("replica"), 1)?);
    }
    let server = cluster::spawn_server(&exe, &cfg, dir, 0)?;
    let (ready, pid) = (server.ready.clone(), server.pid());
    children.insert(0, server);
    if let Some(cpu) = placement.client_cpu {
        pin_self(cpu)?;
    }
    Ok(Servers { cfg, ready, pid, placement, children })
}

/// Runs the cells on a client runtime of 2 workers and writes the report; the servers this
/// process started are killed before the runtime stops.
pub fn run(cli: &Cli, settings: &Settings) -> Result<()> {
    let mut servers = start_servers(cli)?;
    let children = std::mem::take(&mut servers.children);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CLIENT_WORKERS)
        .enable_all()
        .build()
        .map_err(bex_bench::error::io("starting the tokio runtime"))?;
    let out = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(bex_bench::error::io("installing the SIGTERM handler"))?;
        tokio::select! {
            r = bench(cli, settings, &servers) => r,
            _ = term.recv() => Err(Error::from("interrupted (SIGTERM)")),
            _ = tokio::signal::ctrl_c() => Err(Error::from("interrupted (SIGINT)")),
        }
    });
    // The servers go first (killed and reaped), then the client's runtime.
    drop(children);
    rt.shutdown_timeout(Duration::from_millis(100));
    let (report, text, results) = out?;
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())? + "\n";
    cli.output.write(TOOL, &text, &json, &report::figures(&results))?;
    if let Some(p) = &cli.svg {
        std::fs::write(p, report::combined_figure(&results))
            .map_err(bex_bench::error::io(format!("writing {}", p.display())))?;
    }
    Ok(())
}

/// Worker threads of the client's runtime.
const CLIENT_WORKERS: usize = 2;

/// Resident set of process `pid` in MiB, if readable.
fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 =
        s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The RDMA and the TCP `PsClient` on one client stack.
struct Clients {
    stack: Stack,
    rdma: Arc<PsClient>,
    tcp: Arc<PsClient>,
}

impl Clients {
    async fn open(cfg: &Config) -> Result<Clients> {
        let secret = cluster_secret(cfg, std::net::Ipv4Addr::LOCALHOST.into())?;
        let tcfg = transport_config(cfg, &secret);
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let nic = nic_spec(&cfg.transport).map_err(|e| e.to_string())?;
        let stack = Stack::open(&nic, any, any, tcfg)
            .await
            .map_err(|e| format!("client transports: {e}"))?;
        let (rdma, tcp) = stack.transports();
        let topo = cfg.topology().map_err(|e| e.to_string())?;
        let ccfg = client_config(&cfg.rpc, 0, 7, ClientRole::Serving);
        // Push identities fresh per run, as every client process takes them: with fixed ones a
        // second run against a shared `--cluster` had its pushes answered Duplicate (never
        // applied) or TooOld by the windows the first run left.
        let id = || bex_process::incarnation_id().map_err(|e| format!("push identity: {e}"));
        let rdma_client = PsClient::new(Some(rdma), tcp.clone(), topo.clone(), ccfg.clone(), id()?);
        let tcp_client = PsClient::new(None, tcp, topo, ccfg, id()?);
        Ok(Clients { stack, rdma: Arc::new(rdma_client), tcp: Arc::new(tcp_client) })
    }

    fn get(&self, kind: TransportKind) -> &Arc<PsClient> {
        match kind {
            TransportKind::Rdma => &self.rdma,
            TransportKind::Tcp => &self.tcp,
        }
    }

    fn counters(&self, kind: TransportKind) -> bex_transport::CounterSnapshot {
        match kind {
            TransportKind::Rdma => self.stack.rdma.counters(),
            TransportKind::Tcp => self.stack.tcp.counters(),
        }
    }
}

async fn bench<'a>(
    cli: &Cli,
    settings: &'a Settings,
    servers: &'a Servers,
) -> Result<(Report<'a>, String, Vec<crate::cell::CellResult>)> {
    let clients = Clients::open(&servers.cfg).await?;
    // Connect both (and create the warm-up key once) before anything is timed.
    for &k in &settings.transports {
        clients
            .get(k)
            .fetch(TABLE, DIM, &[0])
            .await
            .map_err(|e| format!("first {k} request: {e}"))?;
    }
    let specs = settings.cells();
    let mut results = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let client = clients.get(spec.kind);
        let calls0 = client.rpc().stats().snapshot().calls;
        let mark = UsageMark::take(servers.pid, clients.counters(spec.kind));
        let mut r = run_cell(client.clone(), *spec, settings, i as u64).await?;
        let calls = client.rpc().stats().snapshot().calls - calls0;
        r.usage = UsageMark::take(servers.pid, clients.counters(spec.kind)).since(&mark, calls);
        if !cli.output.quiet {
            eprintln!("{}", report::progress(i + 1, specs.len(), &r));
        }
        results.push(r);
    }
    let rdma_stats = clients.rdma.rpc().stats();
    // Proof that the RDMA cells ran over RDMA: the RDMA client made no TCP calls.
    let tcp_calls =
        rdma_stats.tcp_calls.load(Ordering::Relaxed) + rdma_stats.fallbacks.load(Ordering::Relaxed);
    let (targets, ratios) = report::evaluate(&results);
    let text = report::table(&results, &targets, &ratios);
    print!("{text}");
    let cfg = &servers.cfg;
    let report = Report {
        envelope: Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), servers.placement),
        quick: settings.quick,
        server: servers.ready.clone(),
        setup: Setup {
            pods: cfg.cluster.pods,
            shards: 1,
            table_dim: DIM,
            optimizer: "sgd",
            push_ack: cli.push_ack.map(|m| format!("{m:?}").to_lowercase()),
            closed_loop: "closed: `outstanding` tasks, each issuing its next request when the \
                          previous completes; RDMA and TCP compared at the same outstanding count",
            latency: "per request around PsClient::fetch/push (encode, RPC, decode, merge), \
                      hdrhistogram, 3 significant digits",
            warm: "8 requests' worth of keys fetched once before the cell; each request a \
                   random window of them",
            insert: "fresh keys on every request (rows created by the request)",
            rpc_connect_timeout_ms: CONNECT_TIMEOUT_MS,
            rpc_request_timeout_ms: REQUEST_TIMEOUT_MS,
            rpc_max_attempts: 1,
            seconds_per_cell: settings.seconds,
            warmup_seconds_per_cell: settings.warmup_seconds,
            max_insert_rows_per_cell: settings.max_insert_rows,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            pin: format!("{:?}", cli.pin).to_lowercase(),
            placement: servers.placement.to_string(),
            client_tokio_workers: CLIENT_WORKERS,
        },
        settings,
        results: results.iter().map(CellReport::of).collect(),
        ratios,
        targets,
        rdma_client_rpc_stats: format!("{rdma_stats:?}"),
        server_rss_mib_at_end: rss_mib(servers.pid).and_then(finite),
        rdma_client_tcp_calls_and_fallbacks: tcp_calls,
        transport: &cfg.transport,
        table: text.clone(),
    };
    Ok((report, text, results))
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        bex_bench::cli::try_parse(TOOL, args)
    }

    #[test]
    fn defaults_and_quick_defaults() {
        let s = parse(&[]).unwrap().settings().unwrap();
        assert_eq!(s.keys, vec![100, 1000, 10_000]);
        assert_eq!((s.seconds, s.warmup_seconds, s.max_insert_rows), (2.0, 0.3, 400_000));
        assert_eq!(s.outstanding, vec![1, 16]);
        assert_eq!(s.transports, vec![TransportKind::Rdma, TransportKind::Tcp]);
        assert_eq!((s.ops.len(), s.modes.len()), (2, 2));
        let q = parse(&["--quick"]).unwrap().settings().unwrap();
        assert_eq!((q.keys, q.seconds, q.max_insert_rows), (vec![100, 1000], 0.15, 50_000));
    }

    #[test]
    fn options_reach_the_settings() {
        let cli = parse(&[
            "--keys",
            "1000",
            "--outstanding",
            "1",
            "--ops",
            "fetch",
            "--modes",
            "warm",
            "--transports",
            "tcp",
            "--seconds",
            "0.5",
            "--warmup-seconds",
            "0",
            "--transport-set",
            "eager_max=4096",
            "--pin",
            "none",
            "--push-ack",
            "replicated",
            "--json",
            "/tmp/x.json",
            "--quiet",
        ])
        .unwrap();
        let s = cli.settings().unwrap();
        assert_eq!((s.keys, s.outstanding), (vec![1000], vec![1]));
        assert_eq!(
            (s.ops, s.modes, s.transports),
            (vec![Op::Pull], vec![Mode::Warm], vec![TransportKind::Tcp])
        );
        assert_eq!((s.seconds, s.warmup_seconds), (0.5, 0.0));
        assert_eq!(cli.transport_set, vec![("eager_max".to_string(), 4096)]);
        assert_eq!((cli.pin, cli.push_ack), (Pin::None, Some(PushAck::Replicated)));
        assert!(cli.output.quiet && cli.output.json.is_some());
    }

    #[test]
    fn bad_input_is_a_clear_error_not_a_panic() {
        let e = parse(&["--keys", "0"]).unwrap_err();
        assert!(e.to_string().contains("not a positive integer"), "{e}");
        let e = parse(&["--transports", "udp"]).unwrap_err();
        assert!(e.to_string().contains("rdma or tcp"), "{e}");
        assert_eq!(parse(&["--ops", "delete"]).unwrap_err().kind(), ErrorKind::InvalidValue);
        let e = parse(&["--transport-set", "eager_max"]).unwrap_err();
        assert!(e.to_string().contains("KEY=NUMBER"), "{e}");
        let e = parse(&["--push-ack", "never"]).unwrap_err();
        assert!(e.to_string().contains("replicated or applied"), "{e}");
        let e = parse(&["--cluster", "c.toml", "--nic", "soft"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict);
        let e = parse(&["--server-pid", "7"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MissingRequiredArgument);
        assert!(parse(&["--frobnicate"]).is_err());
        for bad in ["--seconds=0", "--seconds=nan", "--warmup-seconds=-1", "--seconds=1e9"] {
            let e = parse(&[bad]).unwrap().settings().unwrap_err();
            assert!(bex_bench::cli::ToolError::is_usage(&e), "{e}");
        }
        let e = parse(&["--transport-set", "bogus=1"]).unwrap().settings().unwrap_err();
        assert!(e.to_string().contains("unknown key"), "{e}");
    }

    #[test]
    fn every_option_is_documented() {
        use clap::CommandFactory;
        bex_bench::cli::assert_documented(Cli::command());
    }
}
