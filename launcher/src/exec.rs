//! The executor: runs a [`Plan`] — network, servers, health, phases, teardown — and builds
//! `report.json`. Teardown runs on every path: the normal end, a failure, a signal to the
//! launcher (polled between steps) and, as a last resort, `Drop`.

use bex_report::{
    ChaosRecord, ClientRecord, ClusterReport, ExitRecord, HostRecord, Invariant, NetworkReport,
    PhaseReport, ProcessKind, ServerDelta, ServerRecord, TcpDelta, TrainerReport, VerifyRecord,
    VerifyReport,
};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bex_process::child::Guard;
use bex_process::{CpuTimes, SystemCpu};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Deserialize;
use serde_json::Value;

use crate::cleanup::{delete_namespace, Record};
use crate::clock::{now, wait_then_now};
use crate::launch::{ChaosAction, ChaosEvent, LaunchConfig};
use crate::plan::{log_paths, tbf_params, Plan, ProcSpec, Role};
use crate::probe::{counter_delta, http_get, rnic_counters, Stop};

/// How long servers get to checkpoint and exit after SIGTERM at the end.
pub const SERVER_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long clients (and everything on an abort) get after SIGTERM.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(50);
/// How often running clients' `/metrics` are scraped (servers': before and after a phase).
const SCRAPE_EVERY: Duration = Duration::from_millis(500);
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// An HTTP probe's timeout once a signal asked for the teardown: the before-teardown scrape
/// then costs a hung server a moment instead of seconds per probe.
const STOPPING_HTTP_TIMEOUT: Duration = Duration::from_millis(200);

/// A started process: its guard kills and reaps it should the executor's own teardown
/// not have.
#[derive(Debug)]
struct Running {
    spec: ProcSpec,
    child: Guard,
    status: Option<ExitStatus>,
}

impl Running {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.status = Some(s);
            }
        }
        self.status
    }

    fn signal(&self, sig: Signal) {
        if self.status.is_none() {
            if let Ok(p) = i32::try_from(self.pid()) {
                let _ = kill(Pid::from_raw(p), sig);
            }
        }
    }

    /// SIGTERM, then up to `grace` for the process to exit: its status, or none if it had
    /// to be killed.
    fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.signal(Signal::SIGTERM);
        let t0 = now();
        while self.poll().is_none() && now() < t0 + grace {
            wait_then_now(Duration::from_millis(5));
        }
        if self.status.is_none() {
            self.status = self.child.kill().ok();
            return None;
        }
        self.status
    }
}

/// Renames `p` to `p.<tag>` (a stopped process's logs and report, kept next to its
/// successor's). Rejected: `with_extension`, which gave `x.out` and `x.err` one name.
fn set_aside(p: &Path, tag: &str) {
    let mut name = p.file_name().unwrap_or_default().to_owned();
    name.push(format!(".{tag}"));
    let _ = std::fs::rename(p, p.with_file_name(name));
}

fn fmt_status(s: Option<ExitStatus>) -> String {
    s.map_or_else(|| "still running".into(), |s| s.to_string())
}

fn exit_record(s: Option<ExitStatus>) -> ExitRecord {
    use std::os::unix::process::ExitStatusExt;
    ExitRecord { exit_code: s.and_then(|s| s.code()), signal: s.and_then(|s| s.signal()) }
}

/// SIGTERM to every process still running, up to `grace` for them to exit, then SIGKILL;
/// every child is reaped.
fn stop_all(procs: &mut [Running], grace: Duration) {
    for p in procs.iter_mut() {
        p.poll();
        p.signal(Signal::SIGTERM);
    }
    let deadline = now() + grace;
    while procs.iter_mut().any(|p| p.poll().is_none()) && now() < deadline {
        wait_then_now(POLL);
    }
    for p in procs.iter_mut() {
        if p.poll().is_none() {
            if let Ok(s) = p.child.kill() {
                p.status = Some(s);
            }
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// What one run produced.
#[derive(Debug)]
pub struct Outcome {
    /// `report.json`'s content.
    pub report: ClusterReport,
    /// Whether every process behaved.
    pub ok: bool,
    /// The launcher's exit code: 0 ok, 1 failure, 128+n after signal n.
    pub exit_code: i32,
}

/// Runs `plan`, writing into `out`.
#[derive(Debug)]
pub struct Executor {
    plan: Plan,
    launch: LaunchConfig,
    out: PathBuf,
    stop: Stop,
    record: Record,
    servers: Vec<Running>,
    clients: Vec<Running>,
    namespaces: Vec<String>,
    reasons: Vec<String>,
    torn_down: bool,
    /// When the first phase started: the chaos schedule's zero.
    chaos_t0: Option<Instant>,
    /// The schedule, in time order, and how much of it has run.
    chaos: Vec<ChaosEvent>,
    chaos_next: usize,
    chaos_log: Vec<ChaosRecord>,
    /// An iptables fault was applied: heal before `verify` reads every server.
    network_faults: bool,
    /// Servers the schedule killed and has not restarted.
    down: BTreeSet<String>,
    /// Servers the schedule restarted, and when: a replica may still be copying its shard
    /// from the training pod when the phase ends.
    restarted: BTreeMap<String, Instant>,
    /// Clients the schedule restarted (a restarted trainer must fail no step).
    restarted_clients: BTreeSet<String>,
    /// The cluster secret every process gets when the launcher's environment has no
    /// `BEX_SECRET`: random per run (processes off loopback refuse the name-derived one).
    secret: Option<String>,
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.teardown(STOP_GRACE);
    }
}

/// The configuration the processes read: the plan's, without `[launch]` (it is the
/// launcher's alone and is recorded in report.json), so binaries built before that section
/// existed still accept the file.
pub fn process_config_text(cfg: &bex_ps_proto::Config) -> Result<String, String> {
    let mut doc = match toml::Value::try_from(cfg) {
        Ok(toml::Value::Table(t)) => t,
        Ok(_) => return Err("configuration is not a table".into()),
        Err(e) => return Err(e.to_string()),
    };
    doc.remove("launch");
    toml::to_string(&doc).map_err(|e| e.to_string())
}

/// A fresh random cluster secret (128 bits, hex).
fn run_secret() -> std::io::Result<String> {
    let word = || bex_process::incarnation_id().map_err(std::io::Error::other);
    Ok(format!("{:016x}{:016x}", word()?, word()?))
}

/// `/health` answers 200.
fn healthy_now(s: &ProcSpec) -> bool {
    let Some(http) = s.http else { return false };
    matches!(http_get(http, "/health", s.netns.as_deref(), HTTP_TIMEOUT), Ok((200, _)))
}

/// `launch.startup_timeout_s`.
fn startup_timeout(launch: &LaunchConfig) -> Duration {
    Duration::from_secs(launch.startup_timeout_s)
}

/// `pid`'s CPU time; zero, with a warning, when it cannot be read (the process is gone).
fn cpu_of(pid: u32) -> CpuTimes {
    CpuTimes::of_pid(pid).unwrap_or_else(|e| {
        tracing::warn!(pid, error = %e, "cannot read a process's CPU time; reported as 0");
        CpuTimes::default()
    })
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

impl Executor {
    /// An executor for `plan`; nothing runs yet.
    pub fn new(
        plan: Plan,
        launch: LaunchConfig,
        out: PathBuf,
        stop: Stop,
        launcher_pid: u32,
    ) -> std::io::Result<Executor> {
        let chaos = {
            let mut v = launch.chaos.clone();
            v.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
            v
        };
        Ok(Executor {
            plan,
            launch,
            out,
            stop,
            record: Record::new(launcher_pid)?,
            servers: Vec::new(),
            clients: Vec::new(),
            namespaces: Vec::new(),
            reasons: Vec::new(),
            torn_down: false,
            chaos_t0: None,
            chaos,
            chaos_next: 0,
            chaos_log: Vec::new(),
            network_faults: false,
            down: BTreeSet::new(),
            restarted: BTreeMap::new(),
            restarted_clients: BTreeSet::new(),
            secret: match std::env::var("BEX_SECRET") {
                Ok(s) if !s.is_empty() => None,
                _ => Some(run_secret()?),
            },
        })
    }

    fn spawn(&mut self, spec: &ProcSpec) -> Result<Running, String> {
        let (out, err) = log_paths(&self.out, &spec.name);
        let open = |p: &Path| File::create(p).map_err(|e| format!("{}: {e}", p.display()));
        if let Some(json) = &spec.json {
            // A report left by an earlier run in the same directory must not pass for this one.
            let _ = std::fs::remove_file(json);
        }
        let argv = spec.argv();
        let mut cmd = Command::new(&argv[0]);
        if let Some(secret) = &self.secret {
            cmd.env("BEX_SECRET", secret);
        }
        // The processes' logs go to logs/NAME.err: with state changes (bootstrap, catch-up,
        // drain, checkpoints, fallbacks), unless the caller chose a filter.
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        // A process group of its own: a terminal's Ctrl-C reaches the launcher alone, which
        // stops clients before servers (the whole group signalled at once, servers drained
        // while trainers still pushed). Its death still reaches them (PR_SET_PDEATHSIG).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        // Set before exec, so a launcher SIGKILLed while the child starts takes it along too
        // (and every child, not only bex programs).
        bex_process::die_with_this_process(&mut cmd);
        let child = cmd
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(open(&out)?)
            .stderr(open(&err)?)
            .spawn()
            .map_err(|e| format!("starting {} ({}): {e}", spec.name, argv[0]))?;
        let child = Guard::new(child, spec.name.clone());
        let pid = child.id();
        self.record.add(pid, &spec.name);
        Ok(Running { spec: spec.clone(), child, status: None })
    }

    fn interrupted(&mut self) -> bool {
        if let Some(sig) = self.stop.signal() {
            let r = format!("interrupted by {sig}");
            if !self.reasons.contains(&r) {
                self.reasons.push(r);
            }
            return true;
        }
        false
    }

    fn snapshot(&self) -> Vec<(CpuTimes, BTreeMap<String, u64>)> {
        self.servers
            .iter()
            .map(|s| {
                let metrics = self.scrape(&s.spec).map(|body| rnic_counters(&body));
                (cpu_of(s.pid()), metrics.unwrap_or_default())
            })
            .collect()
    }

    /// `spec`'s `/metrics` now, also kept as `<out>/metrics/NAME.prom` (the last scrape of
    /// each process, as a Prometheus would have it).
    fn scrape(&self, spec: &ProcSpec) -> Option<String> {
        let a = spec.http?;
        let timeout =
            if self.stop.signal().is_some() { STOPPING_HTTP_TIMEOUT } else { HTTP_TIMEOUT };
        let (code, body) = http_get(a, "/metrics", spec.netns.as_deref(), timeout).ok()?;
        if code != 200 {
            return None;
        }
        let dir = self.out.join("metrics");
        let kept = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(dir.join(format!("{}.prom", spec.name)), &body));
        if let Err(e) = kept {
            tracing::warn!(process = %spec.name, error = %e, "cannot keep a metrics scrape");
        }
        Some(body)
    }

    fn setup_network(&mut self) -> Result<(), String> {
        let Some(net) = self.plan.net.clone() else { return Ok(()) };
        say!("bex-cluster: netns: {} hosts behind bridge in {}", net.hosts.len(), net.switch_ns);
        for cmd in &net.setup {
            if self.interrupted() {
                return Err("interrupted during network setup".into());
            }
            // Track namespaces before creating them so a half-built network is removed.
            if cmd.len() == 4 && cmd[1] == "netns" && cmd[2] == "add" {
                self.namespaces.push(cmd[3].clone());
            }
            let out = Command::new(&cmd[0])
                .args(&cmd[1..])
                .output()
                .map_err(|e| format!("{}: {e}", cmd.join(" ")))?;
            if !out.status.success() {
                return Err(format!(
                    "`{}` failed: {}",
                    cmd.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        let hosts = net.hosts_file();
        for h in &net.hosts {
            let dir = crate::cleanup::netns_etc(&h.ns);
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join("hosts"), &hosts))
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(())
    }

    /// Starts every server and waits until each printed `ready` and answers `/health` 200.
    fn start_servers(&mut self) -> Result<Duration, String> {
        let t0 = now();
        for spec in self.plan.servers.clone() {
            let r = self.spawn(&spec)?;
            self.servers.push(r);
        }
        let deadline = t0 + startup_timeout(&self.launch);
        let mut healthy = vec![false; self.servers.len()];
        loop {
            if self.interrupted() {
                return Err("interrupted while waiting for the servers".into());
            }
            for (s, h) in self.servers.iter_mut().zip(healthy.iter_mut()) {
                if *h {
                    continue;
                }
                let (out, err) = log_paths(&self.out, &s.spec.name);
                if let Some(st) = s.poll() {
                    return Err(format!(
                        "{} exited during start-up ({st}); stderr tail:\n{}",
                        s.spec.name,
                        tail(&err, 15)
                    ));
                }
                let ready = std::fs::read_to_string(&out)
                    .is_ok_and(|t| t.lines().any(|l| l.starts_with("ready ")));
                *h = ready && healthy_now(&s.spec);
            }
            if healthy.iter().all(|h| *h) {
                return Ok(now() - t0);
            }
            if now() >= deadline {
                let i = healthy.iter().position(|h| !h).unwrap_or(0);
                let (_, err) = log_paths(&self.out, &self.servers[i].spec.name);
                return Err(format!(
                    "{} not healthy after {}s (launch.startup_timeout_s); stderr tail:\n{}",
                    self.servers[i].spec.name,
                    self.launch.startup_timeout_s,
                    tail(&err, 15)
                ));
            }
            wait_then_now(Duration::from_millis(100));
        }
    }

    fn server_died(&mut self) -> Option<String> {
        for s in &mut self.servers {
            if self.down.contains(&s.spec.name) {
                continue;
            }
            if let Some(st) = s.poll() {
                return Some(format!("{} exited during the workload ({st})", s.spec.name));
            }
        }
        None
    }

    /// `launch.hold`: keeps the servers up until SIGTERM or SIGINT, the expected end of the
    /// run (a server exiting meanwhile fails it).
    fn hold(&mut self) {
        // Clients started by other means need the secret this run made up (0600: it is the
        // cluster's credential).
        let secret = match &self.secret {
            Some(secret) => {
                let path = self.out.join("secret");
                let written = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&path)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, secret.as_bytes()));
                if let Err(e) = written {
                    self.reasons.push(format!("{}: {e}", path.display()));
                    return;
                }
                format!("BEX_SECRET from {}", path.display())
            }
            None => "this BEX_SECRET".to_string(),
        };
        say!(
            "bex-cluster: holding the cluster; clients connect with --config {} and {secret}; \
             SIGTERM or Ctrl-C stops it",
            self.plan.config_path.display()
        );
        let _ = std::io::Write::flush(&mut std::io::stdout());
        while self.stop.signal().is_none() {
            if let Some(r) = self.server_died() {
                self.reasons.push(r);
                return;
            }
            wait_then_now(Duration::from_millis(100));
        }
    }

    /// Applies every scheduled fault that is due.
    fn apply_chaos(&mut self) {
        let Some(t0) = self.chaos_t0 else { return };
        while let Some(ev) = self.chaos.get(self.chaos_next).cloned() {
            if now() < t0 + Duration::from_secs_f64(ev.at_s) {
                break;
            }
            self.chaos_next += 1;
            let started = secs(now() - t0);
            let result = self.chaos_action(&ev);
            let at = secs(now() - t0);
            say!(
                "bex-cluster: chaos t={at:.1}s {}: {}",
                ev.action,
                result.as_deref().unwrap_or_else(|e| e)
            );
            if let Err(e) = &result {
                self.reasons.push(format!("chaos {} at {at}s failed: {e}", ev.action));
            }
            self.chaos_log.push(ChaosRecord {
                at_s: ev.at_s,
                started_at_s: Some(started),
                applied_at_s: Some(at),
                action: ev.action.clone(),
                result: match &result {
                    Ok(m) => m.clone(),
                    Err(e) => format!("failed: {e}"),
                },
            });
        }
    }

    /// The server `name`, if it runs.
    fn running_server(&mut self, name: &str) -> Result<&mut Running, String> {
        let i = self.server_index(name)?;
        let s = &mut self.servers[i];
        if s.poll().is_some() {
            return Err("already not running".into());
        }
        Ok(s)
    }

    fn server_index(&self, name: &str) -> Result<usize, String> {
        self.servers
            .iter()
            .position(|s| s.spec.name == name)
            .ok_or_else(|| format!("no server {name}"))
    }

    /// `ip netns exec <ns> iptables <args>`.
    fn iptables(ns: &str, args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "iptables"])
            .args(args)
            .output()
            .map_err(|e| format!("iptables in {ns}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "iptables {} in {ns}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    fn chaos_action(&mut self, ev: &ChaosEvent) -> Result<String, String> {
        let action = ev.action.clone();
        if action.is_network_fault() {
            self.network_faults = true;
        }
        match action {
            ChaosAction::Kill { server } => {
                let s = self.running_server(server.as_str())?;
                s.status = s.child.kill().ok();
                let pid = s.pid();
                self.down.insert(server.into());
                Ok(format!("SIGKILL pid {pid}"))
            }
            ChaosAction::Term { server } => {
                // A graceful stop: the server drains (refuses pushes, flushes replication),
                // checkpoints and must exit 0 within its grace.
                let s = self.running_server(server.as_str())?;
                let t0 = now();
                let status = s.terminate(SERVER_STOP_GRACE);
                let pid = s.pid();
                self.down.insert(server.into());
                match status {
                    Some(st) if st.success() => {
                        Ok(format!("SIGTERM pid {pid}: exited 0 after {:.2} s", secs(now() - t0)))
                    }
                    Some(st) => Err(format!("SIGTERM pid {pid}: exited with {st}")),
                    None => Err(format!("SIGTERM pid {pid}: not gone after {SERVER_STOP_GRACE:?}")),
                }
            }
            ChaosAction::RestartClient { client } => {
                let i = self
                    .clients
                    .iter_mut()
                    .position(|c| c.spec.name == client.as_str() && c.poll().is_none())
                    .ok_or_else(|| format!("no running client {client}"))?;
                let c = &mut self.clients[i];
                let status = c.terminate(STOP_GRACE);
                let old_pid = c.pid();
                if status.is_none() {
                    return Err(format!("SIGTERM pid {old_pid}: not gone after {STOP_GRACE:?}"));
                }
                if !status.is_some_and(|s| s.success()) {
                    return Err(format!(
                        "SIGTERM pid {old_pid}: exited with {}",
                        fmt_status(status)
                    ));
                }
                // The first life's report and logs stay, renamed; the phase reports the second.
                let spec = c.spec.clone();
                let (out, err) = log_paths(&self.out, &spec.name);
                for p in [Some(out), Some(err), spec.json.clone()].into_iter().flatten() {
                    set_aside(&p, &format!("{old_pid}.stopped"));
                }
                let r = self.spawn(&spec)?;
                let pid = r.pid();
                self.clients[i] = r;
                self.restarted_clients.insert(spec.name.clone());
                Ok(format!("pid {old_pid} exited 0 on SIGTERM; started again as pid {pid}"))
            }
            ChaosAction::Restart { server } => {
                let i = self.server_index(server.as_str())?;
                if self.servers[i].poll().is_none() {
                    return Err("still running (kill it first)".into());
                }
                let spec = self.servers[i].spec.clone();
                // Keep the killed process's logs next to the new one's.
                let (out, err) = log_paths(&self.out, &spec.name);
                for p in [out, err] {
                    set_aside(&p, &format!("{}.killed", self.servers[i].pid()));
                }
                let r = self.spawn(&spec)?;
                let pid = r.pid();
                self.servers[i] = r;
                self.down.remove(server.as_str());
                self.restarted.insert(server.into(), now());
                Ok(format!("started again as pid {pid}"))
            }
            ChaosAction::Loss { server, probability } => {
                let i = self.server_index(server.as_str())?;
                let ns = self.servers[i].spec.netns.clone().ok_or("loss needs netns mode")?;
                let p = format!("{}", probability.0);
                Self::iptables(
                    &ns,
                    &[
                        "-A",
                        "INPUT",
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &p,
                        "-j",
                        "DROP",
                    ],
                )?;
                Ok(format!("{ns} drops {p} of its input"))
            }
            ChaosAction::RdmaBlackhole { server } => {
                let i = self.server_index(server.as_str())?;
                let ns = self.servers[i].spec.netns.clone().ok_or("needs netns mode")?;
                Self::iptables(&ns, &["-A", "INPUT", "-p", "udp", "-j", "DROP"])?;
                Self::iptables(&ns, &["-A", "OUTPUT", "-p", "udp", "-j", "DROP"])?;
                Ok(format!("{ns} drops all UDP (the software RNIC); TCP still works"))
            }
            ChaosAction::Partition { pod } => {
                let mut cut = Vec::new();
                for s in &self.servers {
                    if matches!(s.spec.role, Role::Server { pod: p, .. } if p == pod.0) {
                        let ns = s.spec.netns.clone().ok_or("partition needs netns mode")?;
                        Self::iptables(&ns, &["-A", "INPUT", "!", "-i", "lo", "-j", "DROP"])?;
                        Self::iptables(&ns, &["-A", "OUTPUT", "!", "-o", "lo", "-j", "DROP"])?;
                        cut.push(s.spec.name.clone());
                    }
                }
                if cut.is_empty() {
                    return Err(format!("no server in {pod}"));
                }
                Ok(format!("cut off {}", cut.join(", ")))
            }
            ChaosAction::Heal {} => self.heal(),
        }
    }

    /// Removes every loss and partition rule (flushes iptables in every host namespace).
    fn heal(&mut self) -> Result<String, String> {
        let Some(net) = self.plan.net.clone() else { return Err("heal needs netns mode".into()) };
        for h in &net.hosts {
            Self::iptables(&h.ns, &["-F"])?;
        }
        Ok(format!("flushed iptables on {} hosts", net.hosts.len()))
    }

    /// "Every request answered or failed by its deadline": each ranker accounted for every
    /// request (none abandoned in flight) and none took longer than the deadline the RPC
    /// client enforces on a call, `max_attempts × (Tc + Tr)`, plus 100 ms of scheduling
    /// slack on a shared machine.
    fn deadline_invariant(&self, phases: &[PhaseReport]) -> Invariant {
        let rpc = &self.plan.config.rpc;
        let bound_us = (rpc.call_deadline_ms(rpc.request_timeout_ms) + 100) * 1000;
        let (mut requests, mut worst, mut broken) = (0u64, 0f64, Vec::new());
        for (name, r) in bex_report::reports::<bex_report::RankerReport>(phases) {
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    broken.push(e);
                    continue;
                }
            };
            requests += r.requests;
            worst = worst.max(r.latency.max_us);
            let done = r.ok + r.errors + r.timeouts;
            if r.abandoned > 0 || done < r.requests {
                broken.push(format!("{name}: {} requests, {done} answered or failed", r.requests));
            }
            if r.latency.max_us > bound_us as f64 {
                broken.push(format!(
                    "{name}: a request took {:.0} µs > {bound_us} µs",
                    r.latency.max_us
                ));
            }
        }
        Invariant {
            name: "every request answered or failed by its deadline".into(),
            ok: broken.is_empty(),
            detail: if broken.is_empty() {
                format!(
                    "{requests} requests, slowest {:.1} ms, bound {:.0} ms",
                    worst / 1e3,
                    bound_us as f64 / 1e3
                )
            } else {
                broken.join("; ")
            },
        }
    }

    /// Runs `bex-chaos verify` over the canaries' reports (after healing the network).
    fn run_verify(&mut self, deadline: Instant) -> Option<VerifyRecord> {
        let spec = self.plan.verify.clone()?;
        if self.network_faults {
            if let Err(e) = self.heal() {
                self.reasons.push(format!("healing before verify: {e}"));
            }
        }
        for (name, _) in self.down.clone().into_iter().map(|n| (n, ())) {
            self.reasons
                .push(format!("{name} was killed and never restarted: verify cannot read it"));
        }
        say!("bex-cluster: verifying the invariants (bex-chaos verify)");
        let mut r = match self.spawn(&spec) {
            Ok(r) => r,
            Err(e) => {
                self.reasons.push(e);
                return None;
            }
        };
        let until =
            deadline.max(now() + Duration::from_secs_f64(self.launch.verify_settle_s + 60.0));
        while r.poll().is_none() && now() < until && !self.interrupted() {
            wait_then_now(POLL);
        }
        stop_all(std::slice::from_mut(&mut r), STOP_GRACE);
        let (out, _) = log_paths(&self.out, &spec.name);
        let stdout = std::fs::read_to_string(&out).unwrap_or_default();
        say!("== verify ==\n{}", stdout.trim_end());
        let report = spec
            .json
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| serde_json::from_str::<VerifyReport>(&t).ok());
        if r.status.and_then(|s| s.code()) != Some(0) {
            let broken: Vec<&str> = stdout.lines().filter(|l| l.starts_with("BROKEN")).collect();
            self.reasons.push(format!(
                "verify {}: {}",
                fmt_status(r.status),
                if broken.is_empty() { "no verdict".to_string() } else { broken.join("; ") }
            ));
        }
        Some(VerifyRecord {
            status: exit_record(r.status),
            stdout,
            report,
            deadline_invariant: None,
        })
    }

    fn run_phase(&mut self, idx: usize, deadline: Instant) -> PhaseReport {
        let phase = self.plan.phases[idx].clone();
        say!("bex-cluster: phase {} ({}): {} client(s)", idx + 1, phase.name, phase.clients.len());
        let before = self.snapshot();
        let tcp_before = self.tcp_segments();
        self.chaos_t0.get_or_insert_with(now);
        let sys_before = SystemCpu::read().unwrap_or_default();
        let t0 = now();
        let first = self.clients.len();
        for spec in &phase.clients {
            match self.spawn(spec) {
                Ok(r) => self.clients.push(r),
                Err(e) => {
                    self.reasons.push(e);
                    break;
                }
            }
        }
        let mut next_scrape = now() + SCRAPE_EVERY;
        loop {
            if self.clients[first..].iter_mut().all(|c| c.poll().is_some()) {
                break;
            }
            if now() >= next_scrape {
                next_scrape = now() + SCRAPE_EVERY;
                for c in &self.clients[first..] {
                    if c.status.is_none() {
                        self.scrape(&c.spec);
                    }
                }
            }
            if self.interrupted() {
                break;
            }
            if let Some(r) = self.server_died() {
                self.reasons.push(r);
                break;
            }
            self.apply_chaos();
            if now() >= deadline {
                self.reasons.push(format!(
                    "phase {}: launch.timeout_s ({}s) reached; clients stopped with SIGTERM",
                    phase.name, self.launch.timeout_s
                ));
                break;
            }
            wait_then_now(POLL);
        }
        stop_all(&mut self.clients[first..], STOP_GRACE);
        let duration = now() - t0;
        let sys = SystemCpu::read().unwrap_or_default().since(&sys_before);
        let after = self.snapshot();
        let tcp = match (tcp_before, self.tcp_segments()) {
            (Some(b), Some(a)) => Some(TcpDelta {
                out_segs: a.out_segs.saturating_sub(b.out_segs),
                retrans_segs: a.retrans_segs.saturating_sub(b.retrans_segs),
                scope: if self.plan.net.is_some() { "every host namespace" } else { "machine" }
                    .into(),
            }),
            _ => None,
        };
        // A server restarted by the schedule gets the start-up deadline from its restart.
        // After a signal neither wait nor check: the run has failed already, and a hung
        // server would hold the teardown for the deadline.
        let restarted = std::mem::take(&mut self.restarted);
        if !self.interrupted() {
            for (name, at) in restarted {
                let Some(s) = self.servers.iter().find(|s| s.spec.name == name) else { continue };
                let until = at + startup_timeout(&self.launch);
                while now() < until
                    && s.status.is_none()
                    && self.stop.signal().is_none()
                    && !healthy_now(&s.spec)
                {
                    wait_then_now(POLL);
                }
            }
        }
        if !self.interrupted() {
            for s in &self.servers {
                if s.status.is_none() && !self.down.contains(&s.spec.name) && !healthy_now(&s.spec)
                {
                    self.reasons.push(format!(
                        "{}: /health not 200 after phase {}",
                        s.spec.name, phase.name
                    ));
                }
            }
        }

        let mut clients = Vec::new();
        for c in &self.clients[first..] {
            let (out, _) = log_paths(&self.out, &c.spec.name);
            let stdout = std::fs::read_to_string(&out).unwrap_or_default();
            say!("== {} ==\n{}", c.spec.name, stdout.trim_end());
            let report = c
                .spec
                .json
                .as_ref()
                .and_then(|p| std::fs::read_to_string(p).ok())
                .and_then(|t| serde_json::from_str::<Value>(&t).ok());
            let code = c.status.and_then(|s| s.code());
            if code != Some(0) {
                let (_, err) = log_paths(&self.out, &c.spec.name);
                self.reasons.push(format!(
                    "{} {}; stderr tail:\n{}",
                    c.spec.name,
                    fmt_status(c.status),
                    tail(&err, 10)
                ));
            } else if report.is_none() {
                self.reasons.push(format!("{}: no JSON report", c.spec.name));
            }
            // Issue 13: a trainer restarted under its old id had its pushes answered
            // Duplicate or TooOld; now each start pushes under a fresh identity.
            if matches!(c.spec.role, Role::Trainer { .. })
                && self.restarted_clients.contains(&c.spec.name)
            {
                match report.as_ref().map(TrainerReport::deserialize) {
                    Some(Ok(t)) if t.errors > 0 => self.reasons.push(format!(
                        "{} (restarted with the same id) failed {} steps",
                        c.spec.name, t.errors
                    )),
                    Some(Err(e)) => {
                        self.reasons.push(format!("{}: not a trainer's report: {e}", c.spec.name))
                    }
                    _ => {}
                }
            }
            let (kind, pod, id) = match c.spec.role {
                Role::Ranker { pod, id } => (ProcessKind::Ranker, pod, id),
                Role::Trainer { pod, id } => (ProcessKind::Trainer, pod, id),
                Role::Canary { pod, id } => (ProcessKind::Canary, pod, id),
                Role::Verify { id } => (ProcessKind::Verify, 0, id),
                Role::Server { pod, .. } => (ProcessKind::Server, pod, 0),
            };
            clients.push(ClientRecord {
                name: c.spec.name.clone(),
                kind,
                pod,
                id,
                pid: c.pid(),
                netns: c.spec.netns.clone(),
                ip: c.spec.ip.to_string(),
                status: exit_record(c.status),
                stdout,
                report,
            });
        }
        let (servers, server_cpu_total, rnic_total) = self.server_deltas(&before, &after);
        PhaseReport {
            name: phase.name.clone(),
            duration_s: secs(duration),
            clients,
            servers,
            server_cpu_total,
            rnic_total,
            machine_cpu: sys,
            tcp,
        }
    }

    /// TCP segment counters summed over the hosts (netns) or the machine (loopback).
    fn tcp_segments(&self) -> Option<crate::probe::TcpSegments> {
        let Some(net) = &self.plan.net else { return crate::probe::tcp_segments(None) };
        let mut total = crate::probe::TcpSegments::default();
        for h in &net.hosts {
            let t = crate::probe::tcp_segments(Some(&h.ns))?;
            total.out_segs += t.out_segs;
            total.retrans_segs += t.retrans_segs;
        }
        Some(total)
    }

    fn server_deltas(
        &self,
        before: &[(CpuTimes, BTreeMap<String, u64>)],
        after: &[(CpuTimes, BTreeMap<String, u64>)],
    ) -> (Vec<ServerDelta>, CpuTimes, BTreeMap<String, u64>) {
        let mut total = CpuTimes::default();
        let mut rnic_total: BTreeMap<String, u64> = BTreeMap::new();
        let mut out = Vec::new();
        for ((s, b), a) in self.servers.iter().zip(before).zip(after) {
            let cpu = a.0.since(&b.0);
            let rnic = counter_delta(&b.1, &a.1);
            total.user_s += cpu.user_s;
            total.sys_s += cpu.sys_s;
            for (k, v) in &rnic {
                *rnic_total.entry(k.clone()).or_default() += v;
            }
            out.push(ServerDelta { name: s.spec.name.clone(), cpu, rnic });
        }
        (out, total, rnic_total)
    }

    /// Stops every process, deletes the namespaces and the record. Idempotent.
    fn teardown(&mut self, server_grace: Duration) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        stop_all(&mut self.clients, STOP_GRACE);
        stop_all(&mut self.servers, server_grace);
        for ns in std::mem::take(&mut self.namespaces).iter().rev() {
            if let Err(e) = delete_namespace(ns) {
                tracing::warn!(error = %e, "deleting a network namespace failed");
                self.reasons.push(e);
            }
        }
        self.record.remove();
    }

    /// Runs everything and tears down; the report is also written to `<out>/report.json`.
    pub fn run(mut self) -> Outcome {
        let t0 = now();
        let mut startup_s = None;
        let mut phases = Vec::new();
        let mut verify = None;
        let prepared = self.prepare();
        if let Err(e) = prepared {
            self.reasons.push(e);
        } else {
            match self.start_servers() {
                Ok(d) => {
                    startup_s = Some(secs(d));
                    say!(
                        "bex-cluster: {} servers healthy in {:.2}s",
                        self.servers.len(),
                        d.as_secs_f64()
                    );
                    let deadline = now() + Duration::from_secs(self.launch.timeout_s);
                    for i in 0..self.plan.phases.len() {
                        if !self.reasons.is_empty() || self.interrupted() {
                            break;
                        }
                        let p = self.run_phase(i, deadline);
                        phases.push(p);
                    }
                    // A fault that never happened leaves the run unproven when the clients
                    // ended before its time; a run that failed or was stopped first has its
                    // reason already.
                    let cut_short = self.interrupted() || !self.reasons.is_empty();
                    let why =
                        if cut_short { "the run stopped first" } else { "the phases ended first" };
                    for ev in &self.chaos[self.chaos_next..] {
                        if !cut_short {
                            self.reasons.push(format!(
                                "chaos {} at {} s was never applied: the phases ended first",
                                ev.action, ev.at_s
                            ));
                        }
                        self.chaos_log.push(ChaosRecord {
                            at_s: ev.at_s,
                            started_at_s: None,
                            applied_at_s: None,
                            action: ev.action.clone(),
                            result: format!("not applied: {why}"),
                        });
                    }
                    self.chaos_next = self.chaos.len();
                    if self.plan.verify.is_some() && !self.interrupted() {
                        verify = self.run_verify(deadline);
                        let d = self.deadline_invariant(&phases);
                        let verdict = if d.ok { "HOLDS " } else { "BROKEN" };
                        say!("{verdict} {}: {}", d.name, d.detail);
                        if !d.ok {
                            self.reasons.push(format!("invariant broken: {}", d.detail));
                        }
                        if let Some(v) = verify.as_mut() {
                            v.deadline_invariant = Some(d);
                        }
                    }
                    if self.launch.hold && self.reasons.is_empty() && !self.interrupted() {
                        self.hold();
                    }
                }
                Err(e) => self.reasons.push(e),
            }
        }
        // Whole-run server CPU and RNIC counters, read before the servers go.
        let last = self.snapshot();
        let td0 = now();
        let alive_before: Vec<bool> = self.servers.iter_mut().map(|s| s.poll().is_none()).collect();
        self.teardown(SERVER_STOP_GRACE);
        let teardown_s = secs(now() - td0);
        // A server that exits uncleanly on SIGTERM did not checkpoint.
        for (s, alive) in self.servers.iter().zip(alive_before) {
            if alive && s.status.and_then(|st| st.code()) != Some(0) {
                self.reasons.push(format!(
                    "{} did not exit cleanly on SIGTERM ({})",
                    s.spec.name,
                    fmt_status(s.status)
                ));
            }
        }
        let ok = self.reasons.is_empty();
        // The status agrees with the report: a signal that only ended a held cluster, or
        // arrived during the teardown of a run that had succeeded, is no failure (it gave
        // 130/143 beside `"ok": true`); one that cut the run short is a reason already.
        let exit_code = match self.stop.signal() {
            _ if ok => 0,
            Some(sig) => 128 + sig as i32,
            None => 1,
        };
        let servers = self
            .servers
            .iter()
            .zip(last)
            .map(|(s, (cpu, rnic))| {
                let (pod, shard) = match s.spec.role {
                    Role::Server { pod, shard } => (pod, shard),
                    _ => (0, 0),
                };
                ServerRecord {
                    name: s.spec.name.clone(),
                    pod,
                    shard,
                    pid: s.pid(),
                    netns: s.spec.netns.clone(),
                    http: s.spec.http.map(|a| a.to_string()),
                    cpu,
                    rnic,
                    status: exit_record(s.status),
                }
            })
            .collect();
        let network = self.plan.net.as_ref().map(|n| {
            let tbf = tbf_params(&self.launch).ok().flatten();
            NetworkReport {
                switch_ns: n.switch_ns.clone(),
                hosts: n
                    .hosts
                    .iter()
                    .map(|h| HostRecord {
                        name: h.name.clone(),
                        ns: h.ns.clone(),
                        ip: h.ip.to_string(),
                    })
                    .collect(),
                link_rate_bit_s: tbf.map(|t| t.0),
                tbf_burst_bytes: tbf.map(|t| t.1),
                tbf_limit_bytes: tbf.map(|t| t.2),
            }
        });
        let report = ClusterReport {
            ok,
            reasons: std::mem::take(&mut self.reasons),
            mode: self.plan.mode,
            launcher_pid: std::process::id(),
            out_dir: self.out.display().to_string(),
            config: serde_json::to_value(&self.plan.config).unwrap_or(Value::Null),
            launch: serde_json::to_value(&self.launch).unwrap_or(Value::Null),
            network,
            startup_s,
            servers,
            phases,
            chaos: std::mem::take(&mut self.chaos_log),
            verify,
            teardown_s,
            duration_s: secs(now() - t0),
        };
        // Written aside and renamed: a reader never sees half a report, and a run whose report
        // could not be written (a full disk) fails instead of leaving an older one behind.
        let path = self.out.join("report.json");
        let (mut ok, mut exit_code) = (ok, exit_code);
        if let Err(e) = write_atomically(&path, &report) {
            tracing::error!(path = %path.display(), error = %e, "writing the report failed");
            ok = false;
            if exit_code == 0 {
                exit_code = 1;
            }
        }
        Outcome { report, ok, exit_code }
    }

    fn prepare(&mut self) -> Result<(), String> {
        if self.launch.fresh_data {
            // An earlier run into the same directory must not be restored from.
            let data = &self.plan.config.cluster.data_dir;
            if data.exists() {
                std::fs::remove_dir_all(data).map_err(|e| format!("{}: {e}", data.display()))?;
            }
        }
        let logs = self.out.join("logs");
        std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
        let text = process_config_text(&self.plan.config)?;
        std::fs::write(&self.plan.config_path, text)
            .map_err(|e| format!("{}: {e}", self.plan.config_path.display()))?;
        for p in self.plan.all_procs() {
            if !p.program.is_file() {
                return Err(format!(
                    "{} not found (build it: cargo build --release -p bex-ps-server -p bex-ranker \
                     -p bex-trainer -p bex-chaos; or set launch.bin_dir)",
                    p.program.display()
                ));
            }
        }
        self.setup_network()
    }
}

/// Writes `report` as pretty JSON to `path` through a temporary file, synced, then renamed.
fn write_atomically(path: &std::path::Path, report: &impl serde::Serialize) -> std::io::Result<()> {
    use std::io::Write;
    let text = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    });
    let result = written.and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::write_atomically;

    #[test]
    fn a_report_is_written_whole_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("bex-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("report.json");
        write_atomically(&path, &serde_json::json!({"ok": true})).unwrap();
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back["ok"], true);
        // The name taken by a directory: an error, and no temporary file left behind.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(write_atomically(&path, &serde_json::json!({"ok": false})).is_err());
        assert!(!path.with_extension("json.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
