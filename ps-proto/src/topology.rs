//! The cluster's shape: `P` mini-pods, each a full replica of `n` shards; one server process
//! per (pod, shard) with three addresses; one pod trains (applies pushes and replicates to
//! the others), every pod serves fetches (paper §2.1, §7.2).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::shard::shard_of;

/// A server: (pod, shard).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerId {
    /// Mini-pod.
    pub pod: u32,
    /// Shard within the pod.
    pub shard: u32,
}

/// The addresses of one server.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServerAddrs {
    /// RDMA bootstrap (the TCP listener that exchanges QP endpoints).
    pub rdma: SocketAddr,
    /// TCP transport (fallback and baseline).
    pub tcp: SocketAddr,
    /// HTTP: `/metrics` and `/health`.
    pub http: SocketAddr,
    /// The DNS name the server was given by, if not an IP: its addresses hold the IP the
    /// name last resolved to (unspecified until [`Topology::resolve_with`] found one), and
    /// clients resolve it again when they reconnect (a restarted Kubernetes pod comes back
    /// under its name on another IP).
    pub host: Option<Arc<str>>,
}

impl ServerAddrs {
    /// True while a named server has no IP yet.
    pub fn unresolved(&self) -> bool {
        self.host.is_some() && self.rdma.ip().is_unspecified()
    }
}

/// Ports a derived layout gives each server (RDMA, TCP, HTTP).
pub const PORTS_PER_SERVER: u32 = 3;

/// Pods, shards, addresses and the training pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pods: u32,
    shards: u32,
    training_pod: u32,
    servers: Vec<ServerAddrs>,
}

impl Topology {
    /// A topology from `servers` indexed `pod · shards + shard`.
    pub fn new(
        pods: u32,
        shards: u32,
        training_pod: u32,
        servers: Vec<ServerAddrs>,
    ) -> Result<Topology, String> {
        if pods == 0 || shards == 0 {
            return Err("pods and shards must be ≥ 1".into());
        }
        if training_pod >= pods {
            return Err(format!("training pod {training_pod} ≥ pods {pods}"));
        }
        if servers.len() as u64 != u64::from(pods) * u64::from(shards) {
            return Err(format!("{} server entries for {pods} × {shards}", servers.len()));
        }
        Ok(Topology { pods, shards, training_pod, servers })
    }

    /// The derived layout on one host: server (p, s) has index `i = p·shards + s` and ports
    /// `base_port + 3i` (RDMA bootstrap), `+ 1` (TCP), `+ 2` (HTTP). Fails if the last port
    /// exceeds 65535.
    pub fn loopback(
        pods: u32,
        shards: u32,
        training_pod: u32,
        host: IpAddr,
        base_port: u16,
    ) -> Result<Topology, String> {
        let n = u64::from(pods) * u64::from(shards);
        let last = u64::from(base_port) + n * u64::from(PORTS_PER_SERVER) - 1;
        if last > u64::from(u16::MAX) {
            return Err(format!(
                "{n} servers need ports {base_port}..={last}, beyond 65535; lower it"
            ));
        }
        let servers = (0..n)
            .map(|i| {
                let p = base_port + (i * u64::from(PORTS_PER_SERVER)) as u16;
                ServerAddrs {
                    rdma: SocketAddr::new(host, p),
                    tcp: SocketAddr::new(host, p + 1),
                    http: SocketAddr::new(host, p + 2),
                    host: None,
                }
            })
            .collect();
        Topology::new(pods, shards, training_pod, servers)
    }

    /// Resolves every named server with `lookup` (a name to an IP, or `None` if it does not
    /// resolve now) and returns the names that did not; those keep their last address. The
    /// caller picks the resolver (the system's in processes; a table in tests), so this
    /// crate does no network I/O.
    pub fn resolve_with(
        &mut self,
        mut lookup: impl FnMut(&str) -> Option<IpAddr>,
    ) -> Vec<Arc<str>> {
        let mut unresolved = Vec::new();
        for a in &mut self.servers {
            let Some(name) = a.host.clone() else { continue };
            match lookup(&name) {
                Some(ip) => {
                    a.rdma.set_ip(ip);
                    a.tcp.set_ip(ip);
                    a.http.set_ip(ip);
                }
                None => unresolved.push(name),
            }
        }
        unresolved
    }

    /// Puts server (pod, shard) at `ip` (its ports kept): where a server with a DNS name
    /// actually listens.
    pub fn set_server_ip(&mut self, pod: u32, shard: u32, ip: IpAddr) {
        if pod < self.pods && shard < self.shards {
            let a = &mut self.servers[(pod * self.shards + shard) as usize];
            a.rdma.set_ip(ip);
            a.tcp.set_ip(ip);
            a.http.set_ip(ip);
        }
    }

    /// Mini-pods `P`.
    pub fn pods(&self) -> u32 {
        self.pods
    }

    /// Shards per pod `n`.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The pod that trains.
    pub fn training_pod(&self) -> u32 {
        self.training_pod
    }

    /// True for the training pod.
    pub fn is_training(&self, pod: u32) -> bool {
        pod == self.training_pod
    }

    /// The addresses of (pod, shard).
    pub fn server(&self, pod: u32, shard: u32) -> Option<&ServerAddrs> {
        if pod >= self.pods || shard >= self.shards {
            return None;
        }
        self.servers.get((pod * self.shards + shard) as usize)
    }

    /// Every server with its id, pod-major.
    pub fn servers(&self) -> impl Iterator<Item = (ServerId, &ServerAddrs)> {
        let shards = self.shards;
        self.servers
            .iter()
            .enumerate()
            .map(move |(i, a)| (ServerId { pod: i as u32 / shards, shard: i as u32 % shards }, a))
    }

    /// The shard holding `key` ([`shard_of`] with this topology's `n`).
    pub fn shard_of(&self, key: u64) -> u32 {
        shard_of(key, self.shards)
    }

    /// The pods to try for `shard`, best first, for a caller in `local_pod`: the local pod,
    /// then the others in ring order `local+1, local+2, …` (so callers in different pods
    /// spread their fallbacks). `local_pod` outside the cluster (a client on its own host)
    /// starts the ring at `shard mod P`.
    pub fn replica_order(&self, shard: u32, local_pod: Option<u32>) -> Vec<u32> {
        let start = match local_pod {
            Some(p) if p < self.pods => p,
            _ => shard % self.pods,
        };
        (0..self.pods).map(|i| (start + i) % self.pods).collect()
    }

    /// Where the training pod's server of `shard` forwards applied updates: the same shard in
    /// every other pod.
    pub fn replication_targets(&self, shard: u32) -> Vec<ServerId> {
        (0..self.pods)
            .filter(|&p| p != self.training_pod)
            .map(|pod| ServerId { pod, shard })
            .collect()
    }

    /// Peers that can bootstrap (pod, shard): the same shard in the other pods, training pod
    /// first (its copy is the freshest).
    pub fn bootstrap_peers(&self, pod: u32, shard: u32) -> Vec<ServerId> {
        let mut pods: Vec<u32> = (0..self.pods).filter(|&p| p != pod).collect();
        pods.sort_by_key(|&p| (p != self.training_pod, p));
        pods.into_iter().map(|pod| ServerId { pod, shard }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn lo() -> IpAddr {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    }

    #[test]
    fn loopback_ports() {
        let t = Topology::loopback(2, 3, 1, lo(), 20000).unwrap();
        let a = t.server(1, 2).unwrap();
        assert_eq!((a.rdma.port(), a.tcp.port(), a.http.port()), (20015, 20016, 20017));
        assert_eq!(t.server(0, 0).unwrap().rdma.port(), 20000);
        assert!(t.server(2, 0).is_none() && t.server(0, 3).is_none());
        let mut ports: Vec<u16> =
            t.servers().flat_map(|(_, a)| [a.rdma.port(), a.tcp.port(), a.http.port()]).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 18);
        assert!(Topology::loopback(1, 1, 0, lo(), 65533).is_ok());
        assert!(Topology::loopback(1, 1, 0, lo(), 65534).is_err());
        assert!(Topology::loopback(2, 2, 2, lo(), 1000).is_err());
    }

    #[test]
    fn named_servers_resolve_and_keep_their_last_address_when_a_name_does_not() {
        let named = |name: &str, port: u16| ServerAddrs {
            rdma: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            tcp: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port + 1),
            http: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port + 2),
            host: Some(name.into()),
        };
        let mut t = Topology::new(1, 2, 0, vec![named("ps-0", 7000), named("ps-1", 7000)]).unwrap();
        assert!(t.server(0, 0).unwrap().unresolved());
        let ip = |a: u8| IpAddr::V4(Ipv4Addr::new(10, 0, 0, a));
        let missing = t.resolve_with(|n| (n == "ps-0").then(|| ip(5)));
        assert_eq!(missing, vec![Arc::<str>::from("ps-1")]);
        let a = t.server(0, 0).unwrap();
        assert_eq!(
            (a.rdma, a.tcp.port(), a.http.ip()),
            ("10.0.0.5:7000".parse().unwrap(), 7001, ip(5))
        );
        assert!(t.server(0, 1).unwrap().unresolved());
        // A later resolution moves it; one that fails keeps the last address.
        assert!(t.resolve_with(|_| Some(ip(9))).is_empty());
        assert!(!t.resolve_with(|_| None).is_empty());
        assert_eq!(t.server(0, 1).unwrap().tcp, "10.0.0.9:7001".parse().unwrap());
    }

    #[test]
    fn roles_and_orders() {
        let t = Topology::loopback(3, 4, 1, lo(), 20000).unwrap();
        assert!(t.is_training(1) && !t.is_training(0));
        assert_eq!(t.replica_order(2, Some(2)), [2, 0, 1]);
        assert_eq!(t.replica_order(2, None), [2, 0, 1]);
        assert_eq!(t.replica_order(4, Some(9)), [1, 2, 0]);
        assert_eq!(
            t.replication_targets(3),
            [ServerId { pod: 0, shard: 3 }, ServerId { pod: 2, shard: 3 }]
        );
        assert_eq!(
            t.bootstrap_peers(2, 0),
            [ServerId { pod: 1, shard: 0 }, ServerId { pod: 0, shard: 0 }]
        );
        let ids: Vec<ServerId> = t.servers().map(|(id, _)| id).collect();
        assert_eq!(ids[5], ServerId { pod: 1, shard: 1 });
        assert_eq!(t.shard_of(42), shard_of(42, 4));
    }
}
