//! The one place that opens a NIC: [`NicSpec`] names the software RNIC or a hardware device,
//! [`Nic::open`] opens it with a pool registered on it, and [`Stack::open`] adds the RDMA
//! transport on it and the TCP transport beside it. Every program goes through here, so
//! `[transport] nic = "verbs"` works everywhere at once, and nothing above this crate
//! names a backend (NIC counters come as [`NicStats`]).
//!
//! Tools that drive the NIC without the transport (rnic-perf) run code generic over
//! [`Device`] through [`NicSpec::with_device`], which opens the device the same way.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_rnic::soft::{SoftDevice, SoftPd, UdpConfig};
use bex_rnic::Device;
use bex_rnic_verbs::{VerbsDevice, VerbsOptions, VerbsPd, VerbsRegistrar};

pub use bex_rnic::DeviceStats as NicStats;

use crate::config::Config;
use crate::error::TransportError;
use crate::rdma::RdmaTransport;
use crate::tcp::TcpTransport;

/// RoCEv2's UDP port.
pub const ROCE_PORT: u16 = 4791;

/// Which NIC carries RDMA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NicSpec {
    /// The software RNIC: RoCEv2 packets over a UDP socket on the transport's IP.
    Soft(SoftNic),
    /// A hardware RNIC through libibverbs (needs a build with the `verbs` feature).
    Verbs(VerbsNic),
}

/// Settings of the software RNIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftNic {
    /// UDP port: [`ROCE_PORT`] by default. If another process holds it on the same address
    /// (several bex processes on one IP, as on loopback), the NIC takes a free port instead:
    /// bex peers learn it at bootstrap, but a hardware RoCE peer, which always sends to 4791,
    /// could not reach it. 0: always a free port.
    pub udp_port: u16,
    /// Overrides how long an ACK may wait for data to ride along (tools that drive the NIC
    /// from their own threads want microseconds; the event-loop default is 1 ms).
    pub ack_delay: Option<Duration>,
}

impl Default for SoftNic {
    fn default() -> Self {
        SoftNic { udp_port: ROCE_PORT, ack_delay: None }
    }
}

/// Which hardware device, port and GID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerbsNic {
    /// Device name (`ibv_devices`); `None`: the first.
    pub device: Option<String>,
    /// Physical port, from 1.
    pub port: u8,
    /// Source GID index; `None`: the port's first RoCEv2 GID (0 on InfiniBand).
    pub gid_index: Option<u8>,
}

impl Default for NicSpec {
    fn default() -> Self {
        NicSpec::Soft(SoftNic::default())
    }
}

/// The command-line form, which [`NicSpec`]'s `FromStr` reads back: `soft[:UDP_PORT]`, or
/// `verbs[:DEVICE[:PORT[:GID_INDEX]]]` (an empty device is the first one).
impl std::fmt::Display for NicSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NicSpec::Soft(s) => write!(f, "soft:{}", s.udp_port),
            NicSpec::Verbs(v) => {
                write!(f, "verbs:{}:{}", v.device.as_deref().unwrap_or(""), v.port)?;
                match v.gid_index {
                    Some(g) => write!(f, ":{g}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl std::str::FromStr for NicSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<NicSpec, String> {
        let mut parts = s.split(':');
        let number = |what: &str, v: &str| {
            v.parse::<u16>().map_err(|_| format!("NIC {s:?}: {what} {v:?} is not a number"))
        };
        let spec = match parts.next().unwrap_or_default() {
            "soft" => {
                let udp_port = match parts.next() {
                    Some(p) => number("UDP port", p)?,
                    None => ROCE_PORT,
                };
                NicSpec::Soft(SoftNic { udp_port, ..SoftNic::default() })
            }
            "verbs" => {
                let device = parts.next().filter(|d| !d.is_empty()).map(str::to_owned);
                let port = match parts.next() {
                    Some(p) => u8::try_from(number("port", p)?)
                        .ok()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| format!("NIC {s:?}: ports are 1..=255"))?,
                    None => 1,
                };
                let gid_index = match parts.next() {
                    Some(g) => Some(
                        u8::try_from(number("GID index", g)?)
                            .map_err(|_| format!("NIC {s:?}: GID indexes are 0..=255"))?,
                    ),
                    None => None,
                };
                NicSpec::Verbs(VerbsNic { device, port, gid_index })
            }
            other => {
                return Err(format!(
                    "NIC {other:?}: expected soft[:UDP_PORT] or verbs[:DEVICE[:PORT[:GID_INDEX]]]"
                ))
            }
        };
        match parts.next() {
            Some(extra) => Err(format!("NIC {s:?}: unexpected {extra:?}")),
            None => Ok(spec),
        }
    }
}

/// Why a NIC or stack could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// The configured NIC does not exist here (no device, a build without verbs, a missing
    /// library): a configuration problem, which programs report with exit status 2.
    #[error("{spec}: no such RDMA device: {cause}")]
    NoDevice {
        /// What was asked for.
        spec: String,
        /// What the backend said.
        cause: String,
    },
    /// The NIC exists but could not be set up (permissions, memlock, a port in use, …).
    #[error("{what}: {cause}")]
    Setup {
        /// The step that failed.
        what: String,
        /// Why.
        cause: String,
    },
    /// A transport failed to start.
    #[error("{what}: {source}")]
    Transport {
        /// Which transport, on which address.
        what: String,
        /// Why.
        source: TransportError,
    },
}

impl StackError {
    /// The exit status a program reports this with: 2 for configuration (the NIC does not
    /// exist), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            StackError::NoDevice { .. } => 2,
            _ => 1,
        }
    }
}

/// Code that runs against whichever device [`NicSpec::with_device`] opens (a generic
/// callback: [`Device`] has associated types, so it cannot be a trait object).
pub trait DeviceUser {
    /// What it returns.
    type Output;
    /// Runs with the opened device.
    fn use_device<D: Device>(self, dev: &D) -> Self::Output;
}

impl NicSpec {
    /// Checks that the NIC can be opened, before a tool starts work that needs it: a hardware
    /// device is opened and closed again (`Err` with exit status 2 if it does not exist);
    /// the software RNIC needs nothing.
    pub fn probe(&self) -> Result<(), StackError> {
        match self {
            NicSpec::Soft(_) => Ok(()),
            NicSpec::Verbs(v) => open_verbs(self, v).map(drop),
        }
    }

    /// Opens the device on `ip` (the software RNIC binds its UDP socket there; a hardware
    /// device is found by name) and runs `user` with it.
    pub fn with_device<U: DeviceUser>(&self, ip: IpAddr, user: U) -> Result<U::Output, StackError> {
        match self {
            NicSpec::Soft(s) => Ok(user.use_device(&open_soft(s, ip)?)),
            NicSpec::Verbs(v) => Ok(user.use_device(&open_verbs(self, v)?)),
        }
    }
}

fn open_soft(s: &SoftNic, ip: IpAddr) -> Result<SoftDevice, StackError> {
    let open = |port: u16| {
        let mut cfg = UdpConfig::new(SocketAddr::new(ip, port));
        if let Some(d) = s.ack_delay {
            cfg.nic.ack_delay = d;
        }
        SoftDevice::open_udp(cfg)
    };
    let setup = |e: bex_rnic::Error| StackError::Setup {
        what: format!("software RNIC on {ip}"),
        cause: e.to_string(),
    };
    match open(s.udp_port) {
        Ok(d) => Ok(d),
        Err(e) if s.udp_port != 0 && in_use(&e) => {
            let d = open(0).map_err(setup)?;
            tracing::info!(
                %ip,
                wanted = s.udp_port,
                port = d.local_addr().port(),
                "UDP port in use on this address (another RoCE endpoint has it): the software \
                 RNIC takes a free port, which bex peers learn at bootstrap"
            );
            Ok(d)
        }
        Err(e) => Err(setup(e)),
    }
}

fn in_use(e: &bex_rnic::Error) -> bool {
    matches!(e, bex_rnic::Error::Os { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse)
}

fn open_verbs(spec: &NicSpec, v: &VerbsNic) -> Result<VerbsDevice, StackError> {
    let options = VerbsOptions { port: Some(v.port), gid_index: v.gid_index };
    VerbsDevice::open_with(v.device.as_deref(), &options).map_err(|e| match e {
        bex_rnic::Error::NoDevice(cause) => {
            StackError::NoDevice { spec: spec.to_string(), cause: no_device_hint(cause) }
        }
        e => StackError::Setup { what: format!("open {spec}"), cause: e.to_string() },
    })
}

/// The backend's reason, with what to do about it.
fn no_device_hint(cause: String) -> String {
    let fix = if bex_rnic_verbs::ENABLED {
        "check `ibv_devices` and `bex-cluster doctor --config FILE`, or set [transport] nic = \"soft\""
    } else {
        "this build has no hardware support (build with `--features bex-transport/verbs`), or \
         set [transport] nic = \"soft\""
    };
    format!("{cause}; {fix}")
}

enum Opened {
    Soft(Arc<SoftDevice>, Arc<SoftPd>),
    Verbs(Arc<VerbsDevice>, Arc<VerbsPd>),
}

/// An opened NIC and the pool registered with it: what a process opens once. RDMA
/// transports are started on it ([`Nic::rdma`]); TCP transports use its pool too, so both
/// kinds deliver registered memory.
pub struct Nic {
    opened: Opened,
    pool: &'static Pool,
    spec: NicSpec,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic").field("spec", &self.spec).finish()
    }
}

impl Nic {
    /// Opens the NIC `spec` names on `ip` and a pool registered with it (leaked: it lives as
    /// long as the process).
    pub fn open(spec: &NicSpec, ip: IpAddr) -> Result<Nic, StackError> {
        let pool_err = |e: bemalloc::PoolError| StackError::Setup {
            what: format!("registered memory on {spec}"),
            cause: format!("{e} (registration needs a memlock limit above the pool: `ulimit -l`)"),
        };
        let setup = |what: &str| {
            let what = format!("{what} on {spec}");
            move |e: bex_rnic::Error| StackError::Setup { what, cause: e.to_string() }
        };
        let opened = match spec {
            NicSpec::Soft(s) => {
                let dev = open_soft(s, ip)?;
                let pd = dev.alloc_pd().map_err(setup("protection domain"))?;
                let pool = Pool::new(vec![Arc::new(dev.registrar(&pd))]).map_err(pool_err)?;
                (Opened::Soft(Arc::new(dev), Arc::new(pd)), pool)
            }
            NicSpec::Verbs(v) => {
                let dev = open_verbs(spec, v)?;
                let pd = dev.alloc_pd().map_err(setup("protection domain"))?;
                let reg = VerbsRegistrar::new(&dev, &pd).map_err(setup("registrar"))?;
                let pool = Pool::new(vec![Arc::new(reg)]).map_err(pool_err)?;
                (Opened::Verbs(Arc::new(dev), Arc::new(pd)), pool)
            }
        };
        Ok(Nic { opened: opened.0, pool: opened.1.leak(), spec: spec.clone() })
    }

    /// What was opened.
    pub fn spec(&self) -> &NicSpec {
        &self.spec
    }

    /// The registered pool.
    pub fn pool(&self) -> &'static Pool {
        self.pool
    }

    /// The software RNIC's UDP address (`None` on hardware).
    pub fn udp_addr(&self) -> Option<SocketAddr> {
        match &self.opened {
            Opened::Soft(d, _) => Some(d.local_addr()),
            Opened::Verbs(..) => None,
        }
    }

    /// The NIC's protocol counters.
    pub fn stats(&self) -> NicStats {
        match &self.opened {
            Opened::Soft(d, _) => d.stats(),
            Opened::Verbs(d, _) => d.stats(),
        }
    }

    /// Starts an RDMA transport on this NIC, its bootstrap listener on `listen`.
    pub async fn rdma(&self, listen: SocketAddr, cfg: Config) -> Result<RdmaTransport, StackError> {
        let r = match &self.opened {
            Opened::Soft(d, pd) => {
                RdmaTransport::start(d.clone(), pd.clone(), self.pool, 0, listen, cfg).await
            }
            Opened::Verbs(d, pd) => {
                RdmaTransport::start(d.clone(), pd.clone(), self.pool, 0, listen, cfg).await
            }
        };
        r.map_err(|source| StackError::Transport {
            what: format!("RDMA transport on {listen}"),
            source,
        })
    }

    /// Starts a TCP transport on this NIC's pool, listening on `listen`.
    pub async fn tcp(&self, listen: SocketAddr, cfg: Config) -> Result<TcpTransport, StackError> {
        TcpTransport::start(self.pool, listen, cfg).await.map_err(|source| StackError::Transport {
            what: format!("TCP transport on {listen}"),
            source,
        })
    }
}

/// A process's transports: RDMA on the configured NIC and TCP beside it (the fallback and
/// the baseline), over one registered pool.
#[derive(Debug)]
pub struct Stack {
    /// The NIC.
    pub nic: Nic,
    /// RDMA on it.
    pub rdma: RdmaTransport,
    /// TCP.
    pub tcp: TcpTransport,
}

impl Stack {
    /// Opens the NIC on `rdma`'s IP and starts both transports: RDMA bootstrap on `rdma`,
    /// TCP on `tcp` (port 0: free ports).
    pub async fn open(
        spec: &NicSpec,
        rdma: SocketAddr,
        tcp: SocketAddr,
        cfg: Config,
    ) -> Result<Stack, StackError> {
        let nic = Nic::open(spec, rdma.ip())?;
        let r = nic.rdma(rdma, cfg.clone()).await?;
        let t = nic.tcp(tcp, cfg).await?;
        Ok(Stack { nic, rdma: r, tcp: t })
    }

    /// The registered pool.
    pub fn pool(&self) -> &'static Pool {
        self.nic.pool
    }

    /// Both transports as the RPC layer takes them.
    pub fn transports(&self) -> (crate::Transport, crate::Transport) {
        (crate::Transport::Rdma(self.rdma.clone()), crate::Transport::Tcp(self.tcp.clone()))
    }

    /// The NIC's protocol counters.
    pub fn nic_stats(&self) -> NicStats {
        self.nic.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_read_back_what_they_print() {
        for text in ["soft:4791", "soft:0", "verbs::1", "verbs:mlx5_0:2", "verbs:mlx5_1:1:3"] {
            let spec: NicSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
        }
        assert_eq!("soft".parse::<NicSpec>().unwrap(), NicSpec::default());
        let v: NicSpec = "verbs".parse().unwrap();
        assert_eq!(v, NicSpec::Verbs(VerbsNic { device: None, port: 1, gid_index: None }));
        for bad in ["", "hard", "soft:x", "verbs:m:0", "verbs:m:1:300", "soft:1:2"] {
            assert!(bad.parse::<NicSpec>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_device_is_a_configuration_error_that_names_the_cause() {
        let spec =
            NicSpec::Verbs(VerbsNic { device: Some("mlx5_9".into()), port: 1, gid_index: None });
        let e = Nic::open(&spec, "127.0.0.1".parse().unwrap()).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
        let text = e.to_string();
        assert!(text.contains("mlx5_9") && text.contains("nic = \"soft\""), "{text}");
    }

    #[test]
    fn the_soft_nic_takes_the_roce_port_or_a_free_one() {
        // A loopback address no other test uses, so 4791 is free on it: the first NIC must
        // take it, the second a free port (checking only that they differ passed a NIC that
        // never tried 4791).
        let ip: IpAddr = "127.77.0.9".parse().unwrap();
        let a = Nic::open(&NicSpec::default(), ip).unwrap();
        assert_eq!(
            a.udp_addr().unwrap().port(),
            ROCE_PORT,
            "the first NIC on a free address takes RoCEv2's port"
        );
        // While `a` holds 4791 the second must still open (on a free port).
        drop(Nic::open(&NicSpec::default(), ip).unwrap());
        drop(a);
        // 4791 is free again: `udp_port = 0` asks for any free port, not RoCEv2's first.
        let any = NicSpec::Soft(SoftNic { udp_port: 0, ack_delay: None });
        assert_ne!(Nic::open(&any, ip).unwrap().udp_addr().unwrap().port(), ROCE_PORT);
    }
}
