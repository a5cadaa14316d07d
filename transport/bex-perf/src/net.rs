//! Transports as the benchmark uses them: one software RNIC and one registered pool per
//! process, opened once and shared by every job (a pool keeps its registered memory while it
//! lives, so one per job would only grow the process), and transports of either kind
//! ([`bex_transport::Transport`]) started per job on them.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bemalloc::Pool;
use bex_rnic::soft::{SoftDevice, SoftPd, UdpConfig};
use bex_rnic::Device;
use bex_transport::{Config, CounterSnapshot, RdmaTransport, TcpTransport};
pub use bex_transport::{Socket, Transport};

use crate::error::{BenchError, Result};
use crate::spec::Kind;

/// This process's software RNIC and the pool registered with it.
#[derive(Debug)]
pub struct Node {
    device: Arc<SoftDevice>,
    pd: Arc<SoftPd>,
    pool: &'static Pool,
}

impl Node {
    /// Opens a software RNIC on `ip` (any UDP port) and a pool registered with it. The pool
    /// is leaked: it lives as long as the process.
    pub fn open(ip: IpAddr) -> Result<Node> {
        let dev = SoftDevice::open_udp(UdpConfig::new(SocketAddr::new(ip, 0)))?;
        let pd = dev.alloc_pd()?;
        let pool = Pool::new(vec![Arc::new(dev.registrar(&pd))])
            .map_err(|e| {
                BenchError::Transport(bex_transport::TransportError::Alloc(e.to_string()))
            })?
            .leak();
        Ok(Node { device: Arc::new(dev), pd: Arc::new(pd), pool })
    }

    /// The registered pool (both kinds of transport allocate messages from it).
    pub fn pool(&self) -> &'static Pool {
        self.pool
    }

    /// The software RNIC's UDP address.
    pub fn rnic_addr(&self) -> SocketAddr {
        self.device.local_addr()
    }

    /// Starts a transport of `kind` listening on `ip` (any port).
    pub async fn start(&self, kind: Kind, ip: IpAddr, cfg: Config) -> Result<Transport> {
        let listen = SocketAddr::new(ip, 0);
        match kind {
            Kind::Rdma => {
                let t = RdmaTransport::start(
                    self.device.clone(),
                    self.pd.clone(),
                    self.pool,
                    0,
                    listen,
                    cfg,
                )
                .await?;
                Ok(Transport::Rdma(t))
            }
            // TCP receives into the same registered pool: both kinds deliver pool memory.
            Kind::Tcp => Ok(Transport::Tcp(TcpTransport::start(self.pool, listen, cfg).await?)),
        }
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
