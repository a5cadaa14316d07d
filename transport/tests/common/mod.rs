//! Helpers shared by the transport's integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use bemalloc::{Pool, PoolConfig};
use bex_rnic::soft::{SoftDevice, UdpConfig};
use bex_rnic::Device;
use bex_transport::{Config, RdmaTransport, TcpTransport};

/// A software RNIC on loopback, a pool registered with it, and a transport on both.
pub async fn rdma(cfg: Config) -> (RdmaTransport, SoftDevice) {
    let dev = SoftDevice::open_udp(UdpConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let pool: &'static Pool = Pool::new(vec![Arc::new(dev.registrar(&pd))]).expect("pool").leak();
    let t = RdmaTransport::start(
        Arc::new(dev.clone()),
        Arc::new(pd),
        pool,
        0,
        "127.0.0.1:0".parse().unwrap(),
        cfg,
    )
    .await
    .expect("transport starts");
    (t, dev)
}

/// Bytes a test pool reserves: also its largest allocation.
pub const TEST_POOL_BYTES: usize = 1 << 30;

/// A pool with no device (TCP needs none), reserving [`TEST_POOL_BYTES`].
pub fn plain_pool() -> &'static Pool {
    let cfg = PoolConfig { reserve_bytes: TEST_POOL_BYTES, ..PoolConfig::default() };
    Pool::unregistered(cfg).expect("pool").leak()
}

/// A TCP transport on loopback with a pool of its own.
pub async fn tcp(cfg: Config) -> TcpTransport {
    TcpTransport::start(plain_pool(), "127.0.0.1:0".parse().unwrap(), cfg)
        .await
        .expect("transport starts")
}

#[allow(unused_imports)] // each test binary uses some of them
pub use bex_transport::contract::{check, fill, pattern};
