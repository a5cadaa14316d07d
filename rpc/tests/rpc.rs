//! RPC over real transports on loopback: calls, error replies, timeouts with retry to
//! another replica, RDMA-to-TCP fallback and re-probe, quarantine.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_rnic::soft::{SoftDevice, UdpConfig};
use bex_rnic::Device;
use bex_rpc::{
    alloc_frame, serve, Client, ClientConfig, Endpoint, Handler, RpcError, ServerStats, Status,
    HEADER_LEN,
};
use bex_transport::tcp::TcpTransport;
use bex_transport::{Config, Msg, RdmaTransport, Transport};

async fn rdma_on(addr: SocketAddr) -> RdmaTransport {
    let dev = SoftDevice::open_udp(UdpConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let pool: &'static Pool = Pool::new(vec![Arc::new(dev.registrar(&pd))]).unwrap().leak();
    RdmaTransport::start(Arc::new(dev), Arc::new(pd), pool, 0, addr, Config::default())
        .await
        .unwrap()
}

async fn tcp_on(pool: &'static Pool, addr: SocketAddr) -> TcpTransport {
    TcpTransport::start(pool, addr, Config::default()).await.unwrap()
}

/// Echoes the body back; method 2 answers after `delay`; method 3 fails.
struct Echo {
    pool: &'static Pool,
    delay: Duration,
}

impl Handler for Echo {
    async fn handle(&self, method: u16, body: Msg) -> Result<Msg, RpcError> {
        match method {
            1 => {}
            2 => tokio::time::sleep(self.delay).await,
            3 => return Err(RpcError::remote(Status::NotFound, "no such table")),
            _ => return Err(RpcError::remote(Status::UnknownMethod, "unknown method")),
        }
        let mut r = alloc_frame(self.pool, body.len())?;
        r.as_mut_slice()[HEADER_LEN..].copy_from_slice(body.as_slice());
        Ok(r)
    }
}

/// A replica: RDMA and TCP transports serving `Echo`.
struct Replica {
    // Held so the transports live as long as the test.
    _rdma: Option<RdmaTransport>,
    _tcp: TcpTransport,
    ep: Endpoint,
}

async fn replica(pod: u32, delay: Duration, with_rdma: bool) -> Replica {
    let rdma = if with_rdma { Some(rdma_on("127.0.0.1:0".parse().unwrap()).await) } else { None };
    let pool = match &rdma {
        Some(r) => r.pool(),
        None => Pool::unregistered(Default::default()).unwrap().leak(),
    };
    let tcp = tcp_on(pool, "127.0.0.1:0".parse().unwrap()).await;
    let stats = Arc::new(ServerStats::default());
    let h = Arc::new(Echo { pool, delay });
    if let Some(r) = &rdma {
        tokio::spawn(serve(Transport::Rdma(r.clone()), h.clone(), stats.clone()));
    }
    tokio::spawn(serve(Transport::Tcp(tcp.clone()), h, stats));
    // Without RDMA, point the RDMA address at a port nobody listens on.
    let rdma_addr =
        rdma.as_ref().map_or_else(|| "127.0.0.1:9".parse().unwrap(), |r| r.local_addr());
    let ep = Endpoint { pod, rdma: rdma_addr, tcp: tcp.local_addr() };
    Replica { _rdma: rdma, _tcp: tcp, ep }
}

async fn client(eps: Vec<Endpoint>, cfg: ClientConfig) -> Client {
    let r = rdma_on("127.0.0.1:0".parse().unwrap()).await;
    let t = tcp_on(r.pool(), "127.0.0.1:0".parse().unwrap()).await;
    Client::new(Some(Transport::Rdma(r)), Transport::Tcp(t), eps, cfg)
}

fn local_cfg() -> ClientConfig {
    // Loopback under a test harness: generous deadlines, the paper's policies otherwise.
    ClientConfig {
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_millis(200),
        ..ClientConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_echo_and_errors_come_back_as_errors() {
    let r = replica(0, Duration::ZERO, true).await;
    let c = Arc::new(client(vec![r.ep], local_cfg()).await);
    // 50 calls outstanding at once on one channel.
    let calls: Vec<_> = (0..50u32)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let body = vec![i as u8; (i as usize) * 997];
                let m = c.call(&[0], 1, &body).await.unwrap();
                assert_eq!(m.as_slice(), &body[..]);
            })
        })
        .collect();
    for h in calls {
        h.await.unwrap();
    }
    let e = c.call(&[0], 3, b"x").await.unwrap_err();
    assert!(matches!(e, RpcError::Remote { status: Status::NotFound, .. }), "{e}");
    let s = c.stats();
    assert_eq!(s.tcp_calls.load(std::sync::atomic::Ordering::Relaxed), 0, "all on RDMA");
    assert_eq!(s.connects.load(std::sync::atomic::Ordering::Relaxed), 1, "one channel");
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_request_is_retried_on_another_replica() {
    let slow = replica(0, Duration::from_millis(500), true).await;
    let fast = replica(1, Duration::ZERO, true).await;
    let cfg = ClientConfig { retry_probability: 1.0, local_pod: 0, ..local_cfg() };
    let c = client(vec![slow.ep, fast.ep], cfg).await;
    let m = c.call(&[0, 1], 2, b"hello").await.unwrap();
    assert_eq!(m.as_slice(), b"hello");
    let s = c.stats();
    assert_eq!(s.timeouts.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(s.retries.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(s.remote_pod_calls.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_failure_falls_back_to_tcp_and_returns_after_a_reprobe() {
    // A replica whose RDMA endpoint is dead but whose TCP works.
    let r = replica(0, Duration::ZERO, false).await;
    let cfg = ClientConfig { reprobe_interval: Duration::from_millis(300), ..local_cfg() };
    let c = client(vec![r.ep], cfg).await;
    let m = c.call(&[0], 1, b"over tcp").await;
    // First call: RDMA fails twice (connect + reconnect) → fallback → retried over TCP by
    // the caller's next attempt.
    let m = match m {
        Ok(m) => m,
        Err(_) => c.call(&[0], 1, b"over tcp").await.unwrap(),
    };
    assert_eq!(m.as_slice(), b"over tcp");
    assert!(c.on_tcp(0));
    let s = c.stats().clone();
    assert_eq!(s.fallbacks.load(std::sync::atomic::Ordering::Relaxed), 1);
    // RDMA comes back at the same address; after the re-probe interval the client uses it.
    let back = rdma_on(r.ep.rdma).await;
    let h = Arc::new(Echo { pool: back.pool(), delay: Duration::ZERO });
    tokio::spawn(serve(Transport::Rdma(back.clone()), h, Arc::new(ServerStats::default())));
    tokio::time::sleep(Duration::from_millis(350)).await;
    c.call(&[0], 1, b"probe").await.unwrap();
    assert!(!c.on_tcp(0), "back on RDMA after the probe");
    assert_eq!(s.recoveries.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_tcp_fallback_rdma_failures_fail_the_calls() {
    let r = replica(0, Duration::ZERO, false).await;
    // Port 9 is taken over by the re-probe test's RDMA listener: a dead port of our own.
    let ep = Endpoint { rdma: "127.0.0.1:11".parse().unwrap(), ..r.ep };
    let cfg = ClientConfig { rdma_failures_before_fallback: u32::MAX, ..local_cfg() };
    let c = client(vec![ep], cfg).await;
    for _ in 0..3 {
        let r = c.call(&[0], 1, b"x").await;
        assert!(r.is_err(), "RDMA is dead and TCP is not allowed: {r:?}");
    }
    assert!(!c.on_tcp(0));
    assert_eq!(c.stats().fallbacks.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(c.stats().tcp_calls.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_destination_is_quarantined_after_m_connection_failures() {
    let healthy = replica(1, Duration::ZERO, true).await;
    // Not port 9: the re-probe test brings an RDMA listener up there.
    let dead = Endpoint {
        pod: 0,
        rdma: "127.0.0.1:13".parse().unwrap(),
        tcp: "127.0.0.1:13".parse().unwrap(),
    };
    let cfg = ClientConfig {
        quarantine_connection_failures: 4,
        quarantine_probe_interval: Duration::from_secs(60),
        local_pod: 0,
        ..local_cfg()
    };
    let c = client(vec![dead, healthy.ep], cfg).await;
    let mut calls = 0;
    while !c.is_quarantined(0) {
        c.call(&[0, 1], 1, b"x").await.unwrap();
        calls += 1;
        assert!(calls < 20, "never quarantined");
    }
    // Call 1 through the dead local replica fails RDMA connect + reconnect, falls back and
    // fails TCP (3 failures); calls 2 and 3 fail TCP once each: quarantine engages on the
    // 5th failure, exactly past M = 4.
    let s = c.stats();
    assert_eq!(calls, 3);
    assert_eq!(s.quarantines.load(std::sync::atomic::Ordering::Relaxed), 1);
    let before = s.connect_failures.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(before, 5);
    for _ in 0..5 {
        c.call(&[0, 1], 1, b"x").await.unwrap();
    }
    assert_eq!(
        s.connect_failures.load(std::sync::atomic::Ordering::Relaxed),
        before,
        "a quarantined destination is not tried"
    );
}
