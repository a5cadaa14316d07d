//! `ps-bench`: latency and throughput of one `ps-server` shard (issue 5's targets).
//!
//! ```text
//! ps-bench [--quick] [--json PATH] [--svg PATH] [--keys 100,1000,10000] [--outstanding 1,16]
//!          [--transports rdma,tcp] [--ops pull,push] [--modes warm,insert]
//!          [--seconds S] [--warmup-seconds S] [--max-insert-rows N]
//!          [--server PATH] [--base-port P]
//! ```
//!
//! Spawns a real `ps-server` child (1 pod × 1 shard) on loopback with a generated config,
//! waits for its `ready` line, and drives it through the fan-out `PsClient` over RDMA (the
//! software RNIC) and over TCP. Every cell is a closed loop: `outstanding` tasks, each with
//! one request in flight, issue the next request when the previous one completes; RDMA and
//! TCP are compared at the same outstanding count (the same offered concurrency, not the same
//! request rate). Latency is measured per request around `PsClient::fetch`/`push` (encode,
//! RPC, decode, merge) into hdrhistograms. The child is killed and reaped on exit, error,
//! panic, SIGINT and SIGTERM; on SIGKILL of this process it gets SIGTERM from the kernel
//! (`ps-server` asks for `PR_SET_PDEATHSIG`, and it is spawned from the main thread, which
//! lives as long as this process).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use bex_client::fanout::PsClient;
use bex_client::node::{
    client_config, cluster_secret, nic_spec, set_nic, transport_config, ClientRole,
};
use bex_process::{context_switches, CpuTimes};
use bex_ps_core::config::{InitConfig, OptimizerConfig, PushAck, TableConfig};
use bex_ps_core::Config;
use bex_bench::pin::{allowed_cpus, choose, pin_self, Pin, Placement};
use bex_transport::{NicSpec, Stack};
use hdrhistogram::Histogram;
use serde_json::{json, Value};

const USAGE: &str = "usage: ps-bench [options]

Benchmarks one ps-server shard (a child process on loopback) through PsClient over RDMA
(software RNIC) and TCP: Pull (Fetch) and Push of K keys x 64 f32, closed loop with 1 and 16
outstanding requests, on a warm table and insert-heavy (fresh keys every request).

options:
  --quick                 CI smoke run (< 20 s): keys 100,1000, short cells
  --json PATH             write the results (with the command line) as JSON
  --svg PATH              write charts: p50 and p99 latency against keys per request for
                          each op, mode and outstanding count, and CPU per request (client
                          + server), RDMA against TCP
  --keys LIST             keys per request (default 100,1000,10000)
  --outstanding LIST      requests in flight (default 1,16)
  --transports LIST       rdma,tcp (default both)
  --ops LIST              pull,push (default both)
  --modes LIST            warm,insert (default both)
  --seconds S             measured time per cell (default 2; quick 0.15)
  --warmup-seconds S      unmeasured time before each cell (default 0.3; quick 0.05)
  --max-insert-rows N     fresh rows per insert-heavy cell measured, at least 100 requests'
                          worth (default 400000; quick 50000; the warm-up inserts at most a
                          quarter of that)
  --server PATH           the ps-server executable (default: next to this one)
  --base-port P           ports P..P+2 for the server (default: free ports below 32000)
  --transport-set K=N     override [transport] K (eager_max, fragment_bytes,
                          grant_max_bytes, path_mtu, spin_us, endpoints, sq_depth,
                          rq_depth, cwnd_bytes) for the
                          server and the client; repeatable (default: the config defaults)
  --nic SPEC              the NIC of server and client: soft[:UDP_PORT] (default: the
                          software RNIC) or verbs[:DEVICE[:PORT[:GID_INDEX]]] (hardware;
                          a build with the `verbs` feature)
  --pin PLACEMENT         split (default: client on the first allowed CPU, server(s) on
                          the second, like two hosts), same (both on the first) or none
                          (the scheduler decides). On small VMs placement dominates
                          latency: unpinned, the scheduler sometimes runs client and
                          server on one vCPU (no cross-CPU wake-up) and sometimes not
  --push-ack MODE          two pods: a replica server too, and the shard's [server]
                          push_ack = replicated (a push answered once the replica applied
                          it) or applied (answered after the training server's apply);
                          server CPU counts the training server only (default: one pod)
  --cluster PATH          drive a running cluster (its cluster file; table 0 must have dim
                          64) instead of a ps-server child of its own: other clients, such
                          as the Python binding's benchmark, then measure the same server.
                          The CPU and context switches of the server are counted only with
                          --server-pid; --pin places this process only
  --server-pid PID        with --cluster: the shard's ps-server, for its CPU and switches
  --quiet                 no per-cell progress on stderr
  -h, --help              this text";

/// Row dimension of the benchmark table.
const DIM: u32 = 64;
const TABLE: u32 = 0;
/// RPC deadlines of the generated config. The paper's Tc = 10 ms / Tr = 40 ms time out
/// spuriously when client and server share a loaded 2-core machine (a 10 000-key request
/// with 16 outstanding queues for tens of ms); a benchmark measures, it does not fail over.
const CONNECT_TIMEOUT_MS: u64 = 2_000;
const REQUEST_TIMEOUT_MS: u64 = 10_000;
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The one read of the wall clock in this program (clippy bans `Instant::now` elsewhere).
fn now() -> Instant {
    bex_ps_server::clock::now()
}

#[derive(Clone, Debug)]
struct Args {
    quick: bool,
    json: Option<PathBuf>,
    svg: Option<PathBuf>,
    keys: Vec<usize>,
    outstanding: Vec<usize>,
    transports: Vec<Kind>,
    ops: Vec<OpKind>,
    modes: Vec<Mode>,
    seconds: f64,
    warmup: f64,
    max_insert_rows: u64,
    server: Option<PathBuf>,
    base_port: Option<u16>,
    quiet: bool,
    /// `[transport]` overrides (server and client), `key=value`.
    transport_set: Vec<(String, u64)>,
    /// Two pods with this acknowledgement mode (one pod without).
    push_ack: Option<PushAck>,
    /// Where client and server(s) run.
    pin: Pin,
    /// The NIC of both sides.
    nic: Option<NicSpec>,
    /// A running cluster to drive instead of a child server.
    cluster: Option<PathBuf>,
    /// That cluster's server process, for its CPU and context switches.
    server_pid: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Rdma,
    Tcp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Pull,
    Push,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Warm,
    Insert,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Rdma => "rdma",
            Kind::Tcp => "tcp",
        }
    }
}
impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::Pull => "pull",
            OpKind::Push => "push",
        }
    }
}
impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Warm => "warm",
            Mode::Insert => "insert",
        }
    }
}

fn list<T>(v: &str, f: impl Fn(&str) -> Option<T>, what: &str) -> Result<Vec<T>, String> {
    let out: Option<Vec<T>> = v.split(',').map(|s| f(s.trim())).collect();
    match out {
        Some(o) if !o.is_empty() => Ok(o),
        _ => Err(format!("{what}: bad list {v:?}")),
    }
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let quick = argv.iter().any(|a| a == "--quick");
    let mut a = Args {
        quick,
        json: None,
        svg: None,
        keys: if quick { vec![100, 1000] } else { vec![100, 1000, 10_000] },
        outstanding: vec![1, 16],
        transports: vec![Kind::Rdma, Kind::Tcp],
        ops: vec![OpKind::Pull, OpKind::Push],
        modes: vec![Mode::Warm, Mode::Insert],
        seconds: if quick { 0.15 } else { 2.0 },
        warmup: if quick { 0.05 } else { 0.3 },
        max_insert_rows: if quick { 50_000 } else { 400_000 },
        server: None,
        base_port: None,
        quiet: false,
        transport_set: Vec::new(),
        push_ack: None,
        pin: Pin::Split,
        nic: None,
        cluster: None,
        server_pid: None,
    };
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        match k.as_str() {
            "--quick" => continue,
            "--quiet" => {
                a.quiet = true;
                continue;
            }
            "-h" | "--help" => return Err(String::new()),
            _ => {}
        }
        const VALUED: [&str; 18] = [
            "--cluster",
            "--server-pid",
            "--nic",
            "--pin",
            "--push-ack",
            "--json",
            "--svg",
            "--keys",
            "--outstanding",
            "--transports",
            "--ops",
            "--modes",
            "--seconds",
            "--warmup-seconds",
            "--max-insert-rows",
            "--server",
            "--base-port",
            "--transport-set",
        ];
        if !VALUED.contains(&k.as_str()) {
            return Err(format!("unknown option {k}"));
        }
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let num = |what: &str| v.parse::<f64>().map_err(|_| format!("{what}: not a number: {v}"));
        match k.as_str() {
            "--json" => a.json = Some(PathBuf::from(v)),
            "--svg" => a.svg = Some(PathBuf::from(v)),
            "--keys" => a.keys = list(v, |s| s.parse().ok().filter(|&n| n > 0), "--keys")?,
            "--outstanding" => {
                a.outstanding = list(v, |s| s.parse().ok().filter(|&n| n > 0), "--outstanding")?
            }
            "--transports" => {
                a.transports = list(
                    v,
                    |s| match s {
                        "rdma" => Some(Kind::Rdma),
                        "tcp" => Some(Kind::Tcp),
                        _ => None,
                    },
                    "--transports",
                )?
            }
            "--ops" => {
                a.ops = list(
                    v,
                    |s| match s {
                        "pull" | "fetch" => Some(OpKind::Pull),
                        "push" => Some(OpKind::Push),
                        _ => None,
                    },
                    "--ops",
                )?
            }
            "--modes" => {
                a.modes = list(
                    v,
                    |s| match s {
                        "warm" => Some(Mode::Warm),
                        "insert" => Some(Mode::Insert),
                        _ => None,
                    },
                    "--modes",
                )?
            }
            "--seconds" => a.seconds = num("--seconds")?,
            "--warmup-seconds" => a.warmup = num("--warmup-seconds")?,
            "--max-insert-rows" => {
                a.max_insert_rows =
                    v.parse().map_err(|_| format!("--max-insert-rows: not a number: {v}"))?
            }
            "--server" => a.server = Some(PathBuf::from(v)),
            "--cluster" => a.cluster = Some(PathBuf::from(v)),
            "--server-pid" => {
                a.server_pid = Some(v.parse().map_err(|_| format!("--server-pid: not a pid: {v}"))?)
            }
            "--transport-set" => {
                let (key, n) = v
                    .split_once('=')
                    .and_then(|(k, n)| Some((k.trim().to_string(), n.trim().parse().ok()?)))
                    .ok_or(format!("--transport-set: expected KEY=NUMBER, got {v:?}"))?;
                a.transport_set.push((key, n));
            }
            "--base-port" => {
                a.base_port = Some(v.parse().map_err(|_| format!("--base-port: not a port: {v}"))?)
            }
            "--nic" => a.nic = Some(v.parse()?),
            "--pin" => {
                a.pin = match v.as_str() {
                    "split" => Pin::Split,
                    "same" => Pin::Same,
                    "none" => Pin::None,
                    _ => return Err(format!("--pin: split, same or none, not {v:?}")),
                }
            }
            "--push-ack" => {
                a.push_ack = Some(match v.as_str() {
                    "replicated" => PushAck::Replicated,
                    "applied" => PushAck::Applied,
                    _ => return Err(format!("--push-ack: replicated or applied, not {v:?}")),
                })
            }
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if !(a.seconds > 0.0 && a.seconds.is_finite() && a.warmup >= 0.0 && a.warmup.is_finite()) {
        return Err("--seconds must be > 0 and --warmup-seconds >= 0".into());
    }
    if a.cluster.is_some()
        && (a.push_ack.is_some() || a.server.is_some() || a.base_port.is_some() || a.nic.is_some())
    {
        return Err("--cluster drives a running cluster: --push-ack, --server, --base-port and \
                    --nic describe a child server"
            .into());
    }
    if a.server_pid.is_some() && a.cluster.is_none() {
        return Err("--server-pid goes with --cluster".into());
    }
    Ok(a)
}

/// The `ps-server` child: killed and reaped on drop, whatever happened.
struct ServerChild {
    child: Child,
    dir: PathBuf,
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        // Errors only mean it is already gone; it is reaped either way.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The generated cluster: 1 pod × 1 shard (2 pods with `push_ack`), one table of dim 64,
/// generous deadlines, no checkpoints.
fn bench_config(dir: &Path, base_port: u16, push_ack: Option<PushAck>) -> Config {
    let mut cfg = Config::local(if push_ack.is_some() { 2 } else { 1 }, 1, base_port);
    cfg.server.push_ack = push_ack.unwrap_or(PushAck::Applied);
    cfg.cluster.name = format!("ps-bench-{}", std::process::id());
    cfg.cluster.data_dir = dir.join("data");
    cfg.server.checkpoint_interval_s = 0;
    cfg.server.checkpoint_on_shutdown = false;
    cfg.server.restore_on_start = false;
    cfg.server.bootstrap_from_peer = false;
    cfg.tables = vec![TableConfig {
        name: "emb".into(),
        dim: DIM,
        seed: None,
        init: InitConfig::Uniform { scale: 0.01 },
        // SGD: no optimizer state, so insert-heavy cells create 256 B per row (plus the index).
        optimizer: OptimizerConfig::Sgd { lr: 0.01 },
    }];
    cfg.rpc.connect_timeout_ms = CONNECT_TIMEOUT_MS;
    cfg.rpc.request_timeout_ms = REQUEST_TIMEOUT_MS;
    // A benchmark measures one attempt per request: no hidden retries.
    cfg.rpc.retry_probability = 0.0;
    cfg.rpc.max_attempts = 1;
    cfg
}

fn apply_transport_set(cfg: &mut Config, set: &[(String, u64)]) -> Result<(), String> {
    let t = &mut cfg.transport;
    for (k, n) in set {
        let n = *n;
        let small = || u32::try_from(n).map_err(|_| format!("{k}={n}: too large"));
        match k.as_str() {
            "eager_max" => t.eager_max = n as usize,
            "fragment_bytes" => t.fragment_bytes = n as usize,
            "grant_max_bytes" => t.grant_max_bytes = n as usize,
            "path_mtu" => t.path_mtu = small()?,
            "spin_us" => t.spin_us = n,
            "endpoints" => t.endpoints = n as usize,
            "sq_depth" => t.sq_depth = small()?,
            "rq_depth" => t.rq_depth = small()?,
            "cwnd_bytes" => t.cwnd_bytes = n,
            _ => return Err(format!("--transport-set: unknown key {k:?}")),
        }
    }
    Ok(())
}

fn server_exe(args: &Args) -> Result<PathBuf, String> {
    if let Some(p) = &args.server {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().map_err(|e| format!("locating ps-bench: {e}"))?;
    let p = me.with_file_name("ps-server");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("no ps-server next to {} (build it, or pass --server)", me.display()))
    }
}

fn spawn_server(
    exe: &Path,
    cfg: &Config,
    dir: PathBuf,
    pod: u32,
) -> Result<(ServerChild, String), String> {
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join("cluster.toml");
    let text = cfg.to_toml_string().map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    let child = Command::new(exe)
        .arg("--config")
        .arg(&path)
        .args(["--pod", &pod.to_string(), "--shard", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", exe.display()))?;
    let mut guard = ServerChild { child, dir };
    let stdout = guard.child.stdout.take().ok_or("ps-server has no stdout pipe")?;
    let (tx, rx) = mpsc::channel();
    // Reads the ready line, then drains stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = tx.send(lines.next());
        for line in lines.map_while(Result::ok) {
            eprintln!("ps-server: {line}");
        }
    });
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(Some(Ok(line))) if line.starts_with("ready") => Ok((guard, line)),
        Ok(Some(Ok(line))) => Err(format!("unexpected first line from ps-server: {line:?}")),
        Ok(Some(Err(e))) => Err(format!("reading ps-server's stdout: {e}")),
        Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
            let status = guard.child.wait().map_err(|e| e.to_string())?;
            Err(format!("ps-server exited before becoming ready ({status})"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            Err(format!("ps-server not ready within {READY_TIMEOUT:?}"))
        }
    }
}

/// A small xorshift generator (per task; no shared state on the hot path).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Key `i` of the warm universe of a cell with `k` keys per request.
fn warm_key(k: usize, i: u64) -> u64 {
    ((k as u64) << 40) | i
}

#[derive(Clone, Copy, Debug)]
struct CellSpec {
    op: OpKind,
    mode: Mode,
    keys: usize,
    outstanding: usize,
    kind: Kind,
}

#[derive(Debug)]
struct CellResult {
    spec: CellSpec,
    hist: Histogram<u64>,
    errors: u64,
    first_error: Option<String>,
    elapsed: Duration,
    stopped_by: &'static str,
    /// What the cell cost both processes, from its start to its end (warm-up included).
    usage: CellUsage,
}

/// Costs of a cell: CPU and context switches of client and server, and the client
/// transport's own counts (wake-ups, doorbells, messages).
#[derive(Debug, Default, Clone, Copy)]
struct CellUsage {
    /// Requests completed in the cell (warm-up included), the denominator.
    requests: u64,
    client_cpu_s: f64,
    server_cpu_s: f64,
    client_context_switches: u64,
    server_context_switches: u64,
    client_wakeups: u64,
    client_timer_wakeups: u64,
    client_doorbells: u64,
    client_messages: u64,
}

/// Snapshot of what [`CellUsage`] subtracts.
struct UsageMark {
    client_cpu: CpuTimes,
    server_cpu: CpuTimes,
    client_csw: u64,
    server_csw: u64,
    transport: bex_transport::CounterSnapshot,
}

impl UsageMark {
    fn take(server_pid: u32, transport: bex_transport::CounterSnapshot) -> UsageMark {
        UsageMark {
            client_cpu: CpuTimes::of_self().unwrap_or_default(),
            server_cpu: CpuTimes::of_pid(server_pid).unwrap_or_default(),
            client_csw: context_switches(std::process::id()).unwrap_or(0),
            server_csw: context_switches(server_pid).unwrap_or(0),
            transport,
        }
    }

    fn since(&self, e: &UsageMark, requests: u64) -> CellUsage {
        let cpu = |a: &CpuTimes, b: &CpuTimes| {
            let d = a.since(b);
            d.user_s + d.sys_s
        };
        CellUsage {
            requests,
            client_cpu_s: cpu(&self.client_cpu, &e.client_cpu),
            server_cpu_s: cpu(&self.server_cpu, &e.server_cpu),
            client_context_switches: self.client_csw.saturating_sub(e.client_csw),
            server_context_switches: self.server_csw.saturating_sub(e.server_csw),
            client_wakeups: self.transport.wakeups.saturating_sub(e.transport.wakeups),
            client_timer_wakeups: self
                .transport
                .timer_wakeups
                .saturating_sub(e.transport.timer_wakeups),
            client_doorbells: self.transport.doorbells.saturating_sub(e.transport.doorbells),
            client_messages: self
                .transport
                .messages_received
                .saturating_sub(e.transport.messages_received),
        }
    }

    fn to_json(u: &CellUsage) -> Value {
        let per = |x: f64| num(x / (u.requests.max(1) as f64));
        json!({
            "requests": u.requests,
            "client_cpu_s": num(u.client_cpu_s), "server_cpu_s": num(u.server_cpu_s),
            "cpu_us_per_request": per((u.client_cpu_s + u.server_cpu_s) * 1e6),
            "client_context_switches": u.client_context_switches,
            "server_context_switches": u.server_context_switches,
            "context_switches_per_request":
                per((u.client_context_switches + u.server_context_switches) as f64),
            "client_wakeups_per_request": per(u.client_wakeups as f64),
            "client_timer_wakeups_per_request": per(u.client_timer_wakeups as f64),
            "client_doorbells_per_request": per(u.client_doorbells as f64),
            "client_messages_received": u.client_messages,
        })
    }
}

impl CellResult {
    fn q_us(&self, q: f64) -> f64 {
        if self.hist.is_empty() {
            f64::NAN
        } else {
            self.hist.value_at_quantile(q) as f64 / 1000.0
        }
    }
    fn mean_us(&self) -> f64 {
        if self.hist.is_empty() {
            f64::NAN
        } else {
            self.hist.mean() / 1000.0
        }
    }
    fn rps(&self) -> f64 {
        self.hist.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    fn to_json(&self) -> Value {
        let s = &self.spec;
        let payload = (s.keys * DIM as usize * 4) as f64;
        json!({
            "op": s.op.name(), "mode": s.mode.name(), "keys": s.keys, "dim": DIM,
            "outstanding": s.outstanding, "transport": s.kind.name(),
            "requests": self.hist.len(), "errors": self.errors, "first_error": self.first_error,
            "seconds": self.elapsed.as_secs_f64(), "stopped_by": self.stopped_by,
            "p50_us": num(self.q_us(0.5)), "p99_us": num(self.q_us(0.99)),
            "p999_us": num(self.q_us(0.999)), "mean_us": num(self.mean_us()),
            "max_us": num(self.q_us(1.0)),
            "requests_per_s": num(self.rps()), "keys_per_s": num(self.rps() * s.keys as f64),
            "payload_mb_per_s": num(self.rps() * payload / 1e6),
            "usage": UsageMark::to_json(&self.usage),
        })
    }
}

/// The results as SVG panels: latency (p50 solid, p99 dashed) against keys per request for
/// every (mode, op, outstanding), then CPU per request for every (mode, op, outstanding).
fn charts(results: &[CellResult]) -> String {
    use bex_plot::{Chart, Series, COLORS};
    let mut groups: Vec<(Mode, OpKind, usize)> = Vec::new();
    for r in results {
        let g = (r.spec.mode, r.spec.op, r.spec.outstanding);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let mut keys: Vec<usize> = results.iter().map(|r| r.spec.keys).collect();
    keys.sort_unstable();
    keys.dedup();
    // Keys on a log10 axis: 100, 1000, 10000 evenly spaced.
    let x = |k: usize| (k as f64).log10();
    let ticks: Vec<(f64, String)> = keys.iter().map(|&k| (x(k), k.to_string())).collect();
    let points = |g: (Mode, OpKind, usize), kind: Kind, f: &dyn Fn(&CellResult) -> f64| {
        let mut p: Vec<(f64, f64)> = results
            .iter()
            .filter(|r| (r.spec.mode, r.spec.op, r.spec.outstanding) == g && r.spec.kind == kind)
            .map(|r| (x(r.spec.keys), f(r)))
            .filter(|(_, y)| y.is_finite())
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        p
    };
    let cpu = |r: &CellResult| {
        let u = &r.usage;
        (u.client_cpu_s + u.server_cpu_s) * 1e6 / u.requests.max(1) as f64
    };
    let title =
        |(m, o, n): (Mode, OpKind, usize)| format!("{} {} ×{DIM}, {n} out", o.name(), m.name());
    let mut panels = Vec::new();
    for &g in &groups {
        let mut series = Vec::new();
        for (i, kind) in [Kind::Rdma, Kind::Tcp].into_iter().enumerate() {
            let c = COLORS[i];
            series.push(Series::new(
                format!("{} p50", kind.name()),
                c,
                points(g, kind, &|r| r.q_us(0.5)),
            ));
            series.push(
                Series::new(format!("{} p99", kind.name()), c, points(g, kind, &|r| r.q_us(0.99)))
                    .dashed(),
            );
        }
        panels.push(
            Chart::new(title(g), "keys per request", "µs", series).with_x_ticks(ticks.clone()),
        );
    }
    for &g in &groups {
        let series = [Kind::Rdma, Kind::Tcp]
            .into_iter()
            .enumerate()
            .map(|(i, kind)| Series::new(kind.name(), COLORS[i], points(g, kind, &cpu)))
            .collect();
        panels.push(
            Chart::new(
                format!("CPU: {}", title(g)),
                "keys per request",
                "µs CPU / request",
                series,
            )
            .with_x_ticks(ticks.clone()),
        );
    }
    bex_plot::grid(&panels, 4, 360.0, 260.0)
}

fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

struct Clients {
    rdma: Arc<PsClient>,
    tcp: Arc<PsClient>,
}

impl Clients {
    fn get(&self, k: Kind) -> &Arc<PsClient> {
        match k {
            Kind::Rdma => &self.rdma,
            Kind::Tcp => &self.tcp,
        }
    }
}

/// Fresh-key counter for insert-heavy cells: never reused across cells.
static FRESH: AtomicU64 = AtomicU64::new(0);

async fn run_cell(
    client: Arc<PsClient>,
    spec: CellSpec,
    args: &Args,
    cell_index: u64,
) -> Result<CellResult, String> {
    let k = spec.keys;
    // Warm universe: 8 requests' worth of keys, created before measuring.
    let universe = (k * 8) as u64;
    if spec.mode == Mode::Warm {
        for chunk in 0..8u64 {
            let ks: Vec<u64> =
                (chunk * k as u64..(chunk + 1) * k as u64).map(|i| warm_key(k, i)).collect();
            client.fetch(TABLE, DIM, &ks).await.map_err(|e| format!("warming the table: {e}"))?;
        }
    }
    let start = now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.seconds);
    // Insert-heavy cells create rows that are never removed: at most `max_insert_rows` in the
    // measured window and a quarter of that in the warm-up.
    let warm_rows = Arc::new(AtomicU64::new(0));
    let measured_rows = Arc::new(AtomicU64::new(0));
    // At least 100 measured requests' worth, so 10 000-key cells have some samples.
    let max_rows = args.max_insert_rows.max(100 * k as u64);
    let max_warm_rows = max_rows / 4;
    let capped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..spec.outstanding {
        let client = client.clone();
        let capped = capped.clone();
        let (warm_rows, measured_rows) = (warm_rows.clone(), measured_rows.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3)
                .expect("valid histogram bounds");
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (cell_index << 20) ^ (t as u64 + 1));
            let grads = vec![1e-3f32; k * DIM as usize];
            let mut ks = vec![0u64; k];
            let (mut errors, mut first_error) = (0u64, None);
            let mut last = now();
            loop {
                match spec.mode {
                    Mode::Warm => {
                        let off = rng.next() % universe;
                        for (j, key) in ks.iter_mut().enumerate() {
                            *key = warm_key(k, (off + j as u64) % universe);
                        }
                    }
                    Mode::Insert => {
                        let measuring = now() >= measure_from;
                        let (budget, limit) = if measuring {
                            (&measured_rows, max_rows)
                        } else {
                            (&warm_rows, max_warm_rows)
                        };
                        if budget.fetch_add(k as u64, Ordering::Relaxed) + k as u64 > limit {
                            if measuring {
                                capped.store(true, Ordering::Relaxed);
                                break;
                            }
                            // Warm-up budget spent: wait out the warm-up without inserting.
                            tokio::time::sleep_until(measure_from.into()).await;
                            continue;
                        }
                        let base = FRESH.fetch_add(k as u64, Ordering::Relaxed);
                        for (j, key) in ks.iter_mut().enumerate() {
                            *key = (1u64 << 60) | (base + j as u64);
                        }
                    }
                }
                let t0 = now();
                if t0 >= end {
                    break;
                }
                let r = match spec.op {
                    OpKind::Pull => client.fetch(TABLE, DIM, &ks).await.and_then(|rows| {
                        if rows.len() == k * DIM as usize {
                            Ok(())
                        } else {
                            Err(bex_client::fanout::PsError::Protocol(format!(
                                "{} floats for {k} keys",
                                rows.len()
                            )))
                        }
                    }),
                    OpKind::Push => client.push(TABLE, DIM, &ks, &grads).await,
                };
                let t1 = now();
                if t0 >= measure_from {
                    last = t1;
                    match r {
                        Ok(()) => hist.saturating_record((t1 - t0).as_nanos() as u64),
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e.to_string());
                        }
                    }
                }
            }
            (hist, errors, first_error, last)
        }));
    }
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 120_000_000_000, 3).expect("valid histogram bounds");
    let (mut errors, mut first_error, mut last) = (0, None, measure_from);
    for t in tasks {
        let (h, e, fe, l) = t.await.map_err(|e| format!("a load task failed: {e}"))?;
        hist.add(&h).map_err(|e| format!("merging histograms: {e}"))?;
        errors += e;
        if first_error.is_none() {
            first_error = fe;
        }
        last = last.max(l);
    }
    let elapsed = last.saturating_duration_since(measure_from);
    let stopped_by = if capped.load(Ordering::Relaxed) { "insert_cap" } else { "time" };
    Ok(CellResult {
        spec,
        hist,
        errors,
        first_error,
        elapsed,
        stopped_by,
        usage: CellUsage::default(),
    })
}

fn cells(args: &Args) -> Vec<CellSpec> {
    let mut v = Vec::new();
    for &mode in &args.modes {
        for &op in &args.ops {
            for &keys in &args.keys {
                for &outstanding in &args.outstanding {
                    for &kind in &args.transports {
                        v.push(CellSpec { op, mode, keys, outstanding, kind });
                    }
                }
            }
        }
    }
    v
}

fn fmt_us(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "-".into()
    }
}

fn same(a: &CellSpec, b: &CellSpec) -> bool {
    a.op == b.op && a.mode == b.mode && a.keys == b.keys && a.outstanding == b.outstanding
}

struct Target {
    name: &'static str,
    op: OpKind,
    quantile: f64,
    limit_us: f64,
}

const TARGETS: [Target; 4] = [
    Target { name: "Pull 1000x64 p50 <= 100 us", op: OpKind::Pull, quantile: 0.5, limit_us: 100.0 },
    Target {
        name: "Pull 1000x64 p99 <= 200 us",
        op: OpKind::Pull,
        quantile: 0.99,
        limit_us: 200.0,
    },
    Target { name: "Push 1000x64 p50 <= 150 us", op: OpKind::Push, quantile: 0.5, limit_us: 150.0 },
    Target {
        name: "Push 1000x64 p99 <= 250 us",
        op: OpKind::Push,
        quantile: 0.99,
        limit_us: 250.0,
    },
];

/// Targets (absolute latency: warm table, 1 outstanding, 1000 keys, per transport) and the
/// RDMA/TCP P99 ratios of every matching cell pair.
fn evaluate(results: &[CellResult]) -> (Vec<Value>, Vec<Value>) {
    let mut targets = Vec::new();
    for t in &TARGETS {
        for r in results
            .iter()
            .filter(|r| r.spec.op == t.op && r.spec.mode == Mode::Warm && r.spec.keys == 1000)
        {
            if r.spec.outstanding != 1 {
                continue;
            }
            let v = r.q_us(t.quantile);
            targets.push(json!({
                "target": t.name, "transport": r.spec.kind.name(), "outstanding": 1,
                "value_us": num(v), "limit_us": t.limit_us,
                "met": v.is_finite() && v <= t.limit_us,
            }));
        }
    }
    let mut ratios = Vec::new();
    for r in results.iter().filter(|r| r.spec.kind == Kind::Rdma) {
        let Some(t) = results.iter().find(|t| t.spec.kind == Kind::Tcp && same(&t.spec, &r.spec))
        else {
            continue;
        };
        let p99 = r.q_us(0.99) / t.q_us(0.99);
        ratios.push(json!({
            "op": r.spec.op.name(), "mode": r.spec.mode.name(), "keys": r.spec.keys,
            "outstanding": r.spec.outstanding,
            "p50_rdma_over_tcp": num(r.q_us(0.5) / t.q_us(0.5)),
            "p99_rdma_over_tcp": num(p99),
            "p999_rdma_over_tcp": num(r.q_us(0.999) / t.q_us(0.999)),
            "mean_rdma_over_tcp": num(r.mean_us() / t.mean_us()),
            "throughput_rdma_over_tcp": num(r.rps() / t.rps()),
            "p99_target_met": p99.is_finite() && p99 <= 0.8,
        }));
    }
    (targets, ratios)
}

fn table(results: &[CellResult], targets: &[Value], ratios: &[Value]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<5} {:<6} {:>6} {:>4} {:<5} {:>7} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "op",
        "mode",
        "keys",
        "out",
        "via",
        "n",
        "err",
        "p50 µs",
        "p99 µs",
        "p999 µs",
        "mean µs",
        "req/s",
        "Mkeys/s"
    );
    for r in results {
        let sp = &r.spec;
        let _ = writeln!(
            s,
            "{:<5} {:<6} {:>6} {:>4} {:<5} {:>7} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9.0} {:>9.3}{}",
            sp.op.name(),
            sp.mode.name(),
            sp.keys,
            sp.outstanding,
            sp.kind.name(),
            r.hist.len(),
            r.errors,
            fmt_us(r.q_us(0.5)),
            fmt_us(r.q_us(0.99)),
            fmt_us(r.q_us(0.999)),
            fmt_us(r.mean_us()),
            r.rps(),
            r.rps() * sp.keys as f64 / 1e6,
            if r.stopped_by == "insert_cap" { "  (insert cap)" } else { "" }
        );
    }
    if !ratios.is_empty() {
        let _ = writeln!(s, "\nRDMA / TCP at the same outstanding count (closed loop):");
        let _ = writeln!(
            s,
            "{:<5} {:<6} {:>6} {:>4} {:>7} {:>7} {:>7} {:>7}  p99 <= 0.8x",
            "op", "mode", "keys", "out", "p50", "p99", "p999", "req/s"
        );
        for r in ratios {
            let f = |k: &str| r[k].as_f64().map_or("-".into(), |x| format!("{x:.2}"));
            let _ = writeln!(
                s,
                "{:<5} {:<6} {:>6} {:>4} {:>7} {:>7} {:>7} {:>7}  {}",
                r["op"].as_str().unwrap_or(""),
                r["mode"].as_str().unwrap_or(""),
                r["keys"].as_u64().unwrap_or(0),
                r["outstanding"].as_u64().unwrap_or(0),
                f("p50_rdma_over_tcp"),
                f("p99_rdma_over_tcp"),
                f("p999_rdma_over_tcp"),
                f("throughput_rdma_over_tcp"),
                if r["p99_target_met"] == true { "met" } else { "NOT met" }
            );
        }
    }
    if !targets.is_empty() {
        let _ = writeln!(s, "\nTargets (warm table, 1 outstanding):");
        for t in targets {
            let _ = writeln!(
                s,
                "  {:<28} {:<5} {:>9} µs  {}",
                t["target"].as_str().unwrap_or(""),
                t["transport"].as_str().unwrap_or(""),
                t["value_us"].as_f64().map_or("-".into(), |x| format!("{x:.1}")),
                if t["met"] == true { "met" } else { "NOT met" }
            );
        }
    }
    s
}

/// Resident set of process `pid` in MiB (Linux), if readable.
fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 =
        s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

async fn bench(
    args: &Args,
    cfg: &Config,
    ready: &str,
    server_pid: u32,
    placement: Placement,
) -> Result<Value, String> {
    let secret = cluster_secret(cfg, std::net::Ipv4Addr::LOCALHOST.into())?;
    let tcfg = transport_config(&cfg.transport, &secret);
    let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
    let nic = nic_spec(&cfg.transport).map_err(|e| e.to_string())?;
    let stack =
        Stack::open(&nic, any, any, tcfg).await.map_err(|e| format!("client transports: {e}"))?;
    let (rdma, tcp) = stack.transports();
    let topo = cfg.topology().map_err(|e| e.to_string())?;
    let ccfg = client_config(&cfg.rpc, 0, 7, ClientRole::Serving);
    let clients = Clients {
        rdma: Arc::new(PsClient::new(Some(rdma), tcp.clone(), topo.clone(), ccfg.clone(), 1)),
        tcp: Arc::new(PsClient::new(None, tcp, topo, ccfg, 2)),
    };
    // Connect both (and create the warm-up key once) before anything is timed.
    for k in &args.transports {
        clients
            .get(*k)
            .fetch(TABLE, DIM, &[0])
            .await
            .map_err(|e| format!("first {} request: {e}", k.name()))?;
    }
    let specs = cells(args);
    let mut results = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let transport_counters = || match spec.kind {
            Kind::Rdma => stack.rdma.counters(),
            Kind::Tcp => stack.tcp.counters(),
        };
        let done0 = clients.get(spec.kind).rpc().stats().snapshot().calls;
        let mark = UsageMark::take(server_pid, transport_counters());
        let mut r = run_cell(clients.get(spec.kind).clone(), *spec, args, i as u64).await?;
        let done = clients.get(spec.kind).rpc().stats().snapshot().calls - done0;
        r.usage = UsageMark::take(server_pid, transport_counters()).since(&mark, done);
        if !args.quiet {
            eprintln!(
                "[{}/{}] {} {} {}x{} out={} {}: n={} err={} p50 {} µs p99 {} µs p999 {} µs {:.0} req/s",
                i + 1,
                specs.len(),
                spec.op.name(),
                spec.mode.name(),
                spec.keys,
                DIM,
                spec.outstanding,
                spec.kind.name(),
                r.hist.len(),
                r.errors,
                fmt_us(r.q_us(0.5)),
                fmt_us(r.q_us(0.99)),
                fmt_us(r.q_us(0.999)),
                r.rps()
            );
        }
        results.push(r);
    }
    let rpc_stats = format!("{:?}", clients.rdma.rpc().stats());
    // Proof that the RDMA cells ran over RDMA: the RDMA client made no TCP calls.
    let rdma_client_tcp_calls = clients.rdma.rpc().stats().tcp_calls.load(Ordering::Relaxed)
        + clients.rdma.rpc().stats().fallbacks.load(Ordering::Relaxed);
    let (targets, ratios) = evaluate(&results);
    let text = table(&results, &targets, &ratios);
    print!("{text}");
    if let Some(p) = &args.svg {
        std::fs::write(p, charts(&results)).map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    Ok(json!({
        "tool": "ps-bench",
        "command_line": std::env::args().collect::<Vec<_>>(),
        "quick": args.quick,
        "server": ready,
        "setup": {
            "pods": cfg.cluster.pods, "shards": 1, "table_dim": DIM, "optimizer": "sgd",
            "push_ack": args.push_ack.map(|m| format!("{m:?}").to_lowercase()),
            "loop": "closed: `outstanding` tasks, each issuing its next request when the previous completes; RDMA and TCP compared at the same outstanding count",
            "latency": "per request around PsClient::fetch/push (encode, RPC, decode, merge), hdrhistogram, 3 significant digits",
            "warm": "8 requests' worth of keys fetched once before the cell; each request a random window of them",
            "insert": "fresh keys on every request (rows created by the request)",
            "rpc_connect_timeout_ms": CONNECT_TIMEOUT_MS,
            "rpc_request_timeout_ms": REQUEST_TIMEOUT_MS,
            "rpc_max_attempts": 1,
            "seconds_per_cell": args.seconds, "warmup_seconds_per_cell": args.warmup,
            "max_insert_rows_per_cell": args.max_insert_rows,
            "cpus": cpus,
            "pin": format!("{:?}", args.pin).to_lowercase(),
            "placement": placement.to_string(),
            "client_tokio_workers": 2,
        },
        "results": results.iter().map(CellResult::to_json).collect::<Vec<_>>(),
        "ratios": ratios,
        "targets": targets,
        "rdma_client_rpc_stats": rpc_stats,
        "server_rss_mib_at_end": rss_mib(server_pid).map(num),
        "rdma_client_tcp_calls_and_fallbacks": rdma_client_tcp_calls,
        "transport": serde_json::to_value(&cfg.transport).map_err(|e| e.to_string())?,
        "table": text,
    }))
}

fn main() {
    bex_process::logging::init();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("ps-bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Some(Err(e)) = args.nic.as_ref().map(NicSpec::probe) {
        eprintln!("ps-bench: {e}");
        std::process::exit(e.exit_code().into());
    }
    if let Err(e) = run(&args) {
        eprintln!("ps-bench: {e}");
        std::process::exit(1);
    }
}

/// The cluster file of `--cluster`, checked for what the cells assume.
fn running_cluster(path: &Path, args: &Args) -> Result<Config, String> {
    let mut cfg = Config::load(path).map_err(|e| e.to_string())?;
    match cfg.tables.first() {
        Some(t) if t.dim == DIM => {}
        Some(t) => return Err(format!("{}: table 0 has dim {}, not {DIM}", path.display(), t.dim)),
        None => return Err(format!("{}: no tables", path.display())),
    }
    apply_transport_set(&mut cfg, &args.transport_set)?;
    Ok(cfg)
}

fn run(args: &Args) -> Result<(), String> {
    if let Some(path) = &args.cluster {
        let cfg = running_cluster(path, args)?;
        let placement = choose(args.pin, &allowed_cpus().map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        if let Some(cpu) = placement.client_cpu {
            pin_self(cpu).map_err(|e| e.to_string())?;
        }
        let ready = format!("running cluster {}", path.display());
        // Pid 0 is never a process: its CPU and switches read as zero.
        return bench_and_report(args, &cfg, &ready, args.server_pid.unwrap_or(0), placement, None);
    }
    let exe = server_exe(args)?;
    let base_port = match args.base_port {
        Some(p) => p,
        None => bex_process::free_local_ports(6)
            .map_err(|e| format!("choosing ports (give --base-port): {e}"))?,
    };
    let dir = std::env::temp_dir().join(format!("bex-ps-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = bench_config(&dir, base_port, args.push_ack);
    apply_transport_set(&mut cfg, &args.transport_set)?;
    if let Some(nic) = &args.nic {
        set_nic(&mut cfg.transport, nic);
    }
    cfg.validate().map_err(|e| e.to_string())?;
    // Children inherit the affinity of the thread that starts them: the servers are started
    // from the server CPU, then this thread moves to the client's before any other exists.
    let placement =
        choose(args.pin, &allowed_cpus().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    if let Some(cpu) = placement.server_cpu {
        pin_self(cpu).map_err(|e| e.to_string())?;
    }
    let replica = match args.push_ack {
        Some(_) => Some(spawn_server(&exe, &cfg, dir.join("replica"), 1)?.0),
        None => None,
    };
    let (server, ready) = spawn_server(&exe, &cfg, dir, 0)?;
    let server_pid = server.child.id();
    if let Some(cpu) = placement.client_cpu {
        pin_self(cpu).map_err(|e| e.to_string())?;
    }
    bench_and_report(args, &cfg, &ready, server_pid, placement, Some((server, replica)))
}

/// Runs the cells on a client runtime of 2 workers and writes the JSON; `children` (the
/// servers this process started) are killed before the runtime stops.
fn bench_and_report(
    args: &Args,
    cfg: &Config,
    ready: &str,
    server_pid: u32,
    placement: Placement,
    children: Option<(ServerChild, Option<ServerChild>)>,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let out = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| format!("SIGTERM handler: {e}"))?;
        tokio::select! {
            r = bench(args, cfg, ready, server_pid, placement) => r,
            _ = term.recv() => Err("interrupted (SIGTERM)".to_string()),
            _ = tokio::signal::ctrl_c() => Err("interrupted (SIGINT)".to_string()),
        }
    });
    // The servers go first (killed and reaped), then the client's runtime.
    drop(children);
    rt.shutdown_timeout(Duration::from_millis(100));
    let doc = out?;
    if let Some(p) = &args.json {
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(p, text + "\n").map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(())
}
