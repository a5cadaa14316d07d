//! Transports as the benchmark uses them: one software RNIC and one registered pool per
//! process, opened once and shared by every job (a pool keeps its registered memory while it
//! lives, so one per job would only grow the process), and transports of either kind started
//! per job on them.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bemalloc::Pool;
use bex_rnic::soft::{SoftDevice, SoftPd, UdpConfig};
use bex_rnic::Device;
use bex_transport::{Config, CounterSnapshot, Msg, RdmaSocket, RdmaTransport, Result as TResult};

use crate::error::{BenchError, Result};
use crate::spec::Kind;

/// True once bex's TCP transport exists in this build; until then TCP points are reported as
/// "pending TCP transport", never measured by something else.
pub const TCP_AVAILABLE: bool = false;

/// The text TCP points carry while [`TCP_AVAILABLE`] is false.
pub const TCP_PENDING: &str = "pending TCP transport";

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
            Kind::Tcp => Err(BenchError::Usage(TCP_PENDING.into())),
        }
    }
}

/// A transport of either kind (until the TCP transport lands: RDMA only).
#[derive(Clone, Debug)]
pub enum Transport {
    /// RDMA.
    Rdma(RdmaTransport),
}

impl Transport {
    /// The bootstrap address.
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            Transport::Rdma(t) => t.local_addr(),
        }
    }

    /// Counters.
    pub fn counters(&self) -> CounterSnapshot {
        match self {
            Transport::Rdma(t) => t.counters(),
        }
    }

    /// Opens a socket to `addr`.
    pub async fn connect(&self, addr: SocketAddr) -> TResult<Socket> {
        match self {
            Transport::Rdma(t) => Ok(Socket::Rdma(t.connect(addr).await?)),
        }
    }

    /// Waits for a socket a peer opened.
    pub async fn accept(&self) -> TResult<Socket> {
        match self {
            Transport::Rdma(t) => Ok(Socket::Rdma(t.accept().await?)),
        }
    }

    /// Stops it; every socket fails.
    pub fn shutdown(&self) {
        match self {
            Transport::Rdma(t) => t.shutdown(),
        }
    }
}

/// A socket of either kind.
#[derive(Debug)]
pub enum Socket {
    /// RDMA.
    Rdma(RdmaSocket),
}

impl Socket {
    /// Sends a message.
    pub async fn send(&self, msg: Msg) -> TResult<()> {
        match self {
            Socket::Rdma(s) => s.send(msg).await,
        }
    }

    /// The next message.
    pub async fn recv(&self) -> TResult<Msg> {
        match self {
            Socket::Rdma(s) => s.recv().await,
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
        ("credit_stalls", c.credit_stalls),
        ("window_stalls", c.window_stalls),
        ("credit_messages", c.credit_messages),
        ("doorbells", c.doorbells),
        ("work_requests", c.work_requests),
        ("engines_up", c.engines_up),
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
