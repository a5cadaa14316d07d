//! The socket contract (`bex_transport::contract`) on every transport: RDMA over the
//! software RNIC on loopback, TCP on loopback, and the simulated network on a paused clock.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use bex_rnic::soft::{LinkModel, SoftDevice};
use bex_transport::contract::Bed;
use bex_transport::sim::SimNet;
use bex_transport::simio::SimHub;
use bex_transport::{Config, Transport, TransportKind};

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A port nobody listens on: bound, then released.
fn released_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// RDMA transports, each on a software RNIC of its own (kept open as long as the bed).
#[derive(Default)]
struct RdmaBed(Mutex<Vec<SoftDevice>>);

impl Bed for RdmaBed {
    fn name(&self) -> &'static str {
        "rdma/soft-rnic"
    }
    fn runtime(&self) -> tokio::runtime::Runtime {
        multi_thread()
    }
    async fn transport(&self, cfg: Config) -> Transport {
        let (t, dev) = common::rdma(cfg).await;
        self.0.lock().unwrap().push(dev);
        Transport::Rdma(t)
    }
    fn nowhere(&self) -> SocketAddr {
        released_port()
    }
}

struct TcpBed;

impl Bed for TcpBed {
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn runtime(&self) -> tokio::runtime::Runtime {
        multi_thread()
    }
    async fn transport(&self, cfg: Config) -> Transport {
        Transport::Tcp(common::tcp(cfg).await)
    }
    fn nowhere(&self) -> SocketAddr {
        released_port()
    }
}

/// Nodes of one simulated network, its driver started with the first.
#[derive(Default)]
struct SimBed {
    hub: OnceLock<Arc<SimHub>>,
    nodes: Mutex<u16>,
}

impl Bed for SimBed {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn runtime(&self) -> tokio::runtime::Runtime {
        let b =
            tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build();
        b.unwrap()
    }
    async fn transport(&self, cfg: Config) -> Transport {
        let hub = self.hub.get_or_init(|| {
            let hub =
                SimHub::new(SimNet::new(bex_testkit::seed::one_seed(1), LinkModel::default()));
            tokio::spawn(hub.clone().drive());
            hub
        });
        let port = {
            let mut n = self.nodes.lock().unwrap();
            *n += 1;
            7000 + *n
        };
        let addr = SocketAddr::from(([10, 0, 0, 1], port));
        Transport::Sim(hub.add_transport(addr, TransportKind::Rdma, cfg).unwrap())
    }
    fn nowhere(&self) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 9], 9))
    }
    fn authenticates(&self) -> bool {
        false
    }
    fn largest_message(&self) -> usize {
        3 << 20
    }
    fn streams(&self) -> (u64, u64) {
        (8, 10)
    }
}

mod rdma {
    bex_transport::socket_contract_suite!(super::RdmaBed::default());
}

mod tcp {
    bex_transport::socket_contract_suite!(super::TcpBed);
}

mod sim {
    bex_transport::socket_contract_suite!(super::SimBed::default());
}
