//! Transports as the benchmark uses them: one NIC (software or hardware, `--nic`) and one
//! registered pool per process, opened once and shared by every job (a pool keeps its
//! registered memory while it lives, so one per job would only grow the process), and
//! transports of either kind ([`bex_transport::Transport`]) started per job on them.

use std::net::{IpAddr, SocketAddr};

use bemalloc::Pool;
use bex_transport::{Config, CounterSnapshot, Nic, NicSpec};
pub use bex_transport::{Socket, Transport};

use crate::error::Result;
use crate::spec::TransportKind;

/// This process's NIC and the pool registered with it.
#[derive(Debug)]
pub struct Node {
    nic: Nic,
}

impl Node {
    /// Opens the NIC `spec` names on `ip` and a pool registered with it (it lives as long as
    /// the process).
    pub fn open(spec: &NicSpec, ip: IpAddr) -> Result<Node> {
        Ok(Node { nic: Nic::open(spec, ip)? })
    }

    /// The registered pool (both kinds of transport allocate messages from it).
    pub fn pool(&self) -> &'static Pool {
        self.nic.pool()
    }

    /// Starts a transport of `kind` listening on `ip` (any port).
    pub async fn start(&self, kind: TransportKind, ip: IpAddr, cfg: Config) -> Result<Transport> {
        let listen = SocketAddr::new(ip, 0);
        Ok(match kind {
            TransportKind::Rdma => Transport::Rdma(self.nic.rdma(listen, cfg).await?),
            // TCP receives into the same registered pool: both kinds deliver pool memory.
            TransportKind::Tcp => Transport::Tcp(self.nic.tcp(listen, cfg).await?),
        })
    }
}

/// The process's [`Node`], opened with the first job that needs it (simulated jobs need
/// none), on the address the control connection uses.
#[derive(Debug)]
pub struct LazyNode {
    spec: NicSpec,
    node: Option<Node>,
}

impl LazyNode {
    /// Nothing opened yet; `spec` is what will be.
    pub fn new(spec: NicSpec) -> LazyNode {
        LazyNode { spec, node: None }
    }

    /// The node, opened on `ip` the first time.
    pub fn get(&mut self, ip: IpAddr) -> Result<&Node> {
        if self.node.is_none() {
            self.node = Some(Node::open(&self.spec, ip)?);
        }
        Ok(self.node.as_ref().expect("opened above"))
    }
}

/// The counters worth keeping with a result, by name.
pub fn counter_map(c: &CounterSnapshot) -> std::collections::BTreeMap<String, u64> {
    [
        ("messages_sent", c.messages_sent),
        ("messages_received", c.messages_received),
        ("bytes_sent", c.bytes_sent),
        ("bytes_received", c.bytes_received),
        ("eager_messages", c.eager_messages),
        ("large_messages", c.large_messages),
        ("granted_messages", c.granted_messages),
        ("credit_stalls", c.credit_stalls),
        ("window_stalls", c.window_stalls),
        ("credit_messages", c.credit_messages),
        ("doorbells", c.doorbells),
        ("work_requests", c.work_requests),
        ("engines_up", c.engines_up),
        ("wakeups", c.wakeups),
        ("driver_turns", c.driver_turns),
        ("timer_wakeups", c.timer_wakeups),
        ("engines_failed", c.engines_failed),
        ("malformed", c.malformed),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Adds counter maps.
pub fn add_counters(
    into: &mut std::collections::BTreeMap<String, u64>,
    from: &std::collections::BTreeMap<String, u64>,
) {
    for (k, v) in from {
        *into.entry(k.clone()).or_default() += v;
    }
}

/// CPU time (user + system) this process has used so far, µs; 0 if the OS will not say.
pub fn cpu_us() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    use nix::sys::time::TimeValLike;
    getrusage(UsageWho::RUSAGE_SELF)
        .map(|u| (u.user_time().num_microseconds() + u.system_time().num_microseconds()) as u64)
        .unwrap_or(0)
}

/// Context switches (voluntary + involuntary) of this process so far: each is a thread
/// that stopped running, to wait or because it was preempted; 0 if the OS will not say.
pub fn context_switches() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_SELF)
        .map(|u| (u.voluntary_context_switches() + u.involuntary_context_switches()) as u64)
        .unwrap_or(0)
}

/// CPU time the whole host has spent busy so far (all CPUs: user, nice, system, irq,
/// softirq, steal from `/proc/stat`, at USER_HZ = 100), µs. With the benchmark's own CPU
/// time it gives what other processes took while a job ran.
pub fn host_busy_us() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let f: Vec<u64> = line.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)? + f.get(7)?;
    Some(busy * 10_000)
}
