//! RPC over real transports on loopback: calls, error replies, timeouts with retry to
//! another replica, the recovery ladder (reconnect, other mini-pod, TCP), RDMA-to-TCP
//! fallback and re-probe, quarantine (connection failures, timeouts, unwell replies).

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

/// Echoes the body back; method 2 answers after `delay`; method 3 fails. A `sick` one
/// answers every call with the body `unwell` (a service's "unavailable").
struct Echo {
    pool: &'static Pool,
    delay: Duration,
    sick: bool,
}

const UNWELL: &[u8] = b"unwell";

impl Handler for Echo {
    async fn handle(&self, method: u16, body: Msg) -> Result<Msg, RpcError> {
        if self.sick {
            let mut r = alloc_frame(self.pool, UNWELL.len())?;
            r.as_mut_slice()[HEADER_LEN..].copy_from_slice(UNWELL);
            return Ok(r);
        }
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
    replica_with(pod, delay, with_rdma, false).await
}

async fn replica_with(pod: u32, delay: Duration, with_rdma: bool, sick: bool) -> Replica {
    let rdma = if with_rdma { Some(rdma_on("127.0.0.1:0".parse().unwrap()).await) } else { None };
    let pool = match &rdma {
        Some(r) => r.pool(),
        None => Pool::unregistered(Default::default()).unwrap().leak(),
    };
    let tcp = tcp_on(pool, "127.0.0.1:0".parse().unwrap()).await;
    let stats = Arc::new(ServerStats::default());
    let h = Arc::new(Echo { pool, delay, sick });
    if let Some(r) = &rdma {
        tokio::spawn(serve(Transport::Rdma(r.clone()), h.clone(), stats.clone()));
    }
    tokio::spawn(serve(Transport::Tcp(tcp.clone()), h, stats));
    // Without RDMA, point the RDMA address at a port nobody listens on.
    let rdma_addr =
        rdma.as_ref().map_or_else(|| "127.0.0.1:9".parse().unwrap(), |r| r.local_addr());
    let ep = Endpoint::at(pod, rdma_addr, tcp.local_addr());
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
    let c = Arc::new(client(vec![r.ep.clone()], local_cfg()).await);
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
    let c = client(vec![slow.ep.clone(), fast.ep.clone()], cfg).await;
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
    let c = client(vec![r.ep.clone()], cfg).await;
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
    let h = Arc::new(Echo { pool: back.pool(), delay: Duration::ZERO, sick: false });
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
    let ep = Endpoint { rdma: "127.0.0.1:11".parse().unwrap(), ..r.ep.clone() };
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

fn relaxed(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_destination_is_quarantined_after_m_connection_failures() {
    let healthy = replica(1, Duration::ZERO, true).await;
    // Not port 9: the re-probe test brings an RDMA listener up there.
    let dead = Endpoint::at(0, "127.0.0.1:13".parse().unwrap(), "127.0.0.1:13".parse().unwrap());
    let cfg = ClientConfig {
        quarantine_connection_failures: 4,
        quarantine_probe_interval: Duration::from_secs(60),
        reprobe_interval: Duration::from_millis(50),
        local_pod: 0,
        ..local_cfg()
    };
    let c = client(vec![dead, healthy.ep], cfg).await;
    let mut calls = 0;
    while !c.is_quarantined(0) {
        c.call(&[0, 1], 1, b"x").await.unwrap();
        calls += 1;
        assert!(calls < 20, "never quarantined");
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    // Call 1: the dead local replica fails RDMA connect + reconnect (2 failures) and the
    // call goes to the other mini-pod over RDMA; the dead one is on TCP fallback, never
    // asked over TCP (another replica serves over RDMA), so its RDMA re-probes count: 2
    // more on call 2 and 2 more on call 3, quarantine on the 6th failure, past M = 4.
    let s = c.stats();
    assert_eq!(calls, 3);
    assert_eq!(relaxed(&s.quarantines), 1);
    let before = relaxed(&s.connect_failures);
    assert_eq!(before, 6);
    assert_eq!(relaxed(&s.tcp_calls), 0, "served over RDMA by the other mini-pod");
    assert_eq!(relaxed(&s.remote_pod_calls), 3);
    for _ in 0..5 {
        c.call(&[0, 1], 1, b"x").await.unwrap();
    }
    assert_eq!(relaxed(&s.connect_failures), before, "a quarantined destination is not tried");
}

// The paper's ladder: reconnect, then the other mini-pod, then TCP. The local replica's RDMA
// is dead but its TCP works: the call goes to the remote mini-pod over RDMA, not to the
// local one over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rdma_path_moves_the_call_to_the_other_mini_pod_before_tcp() {
    let local_replica = replica(0, Duration::ZERO, false).await;
    let local = Endpoint { rdma: "127.0.0.1:15".parse().unwrap(), ..local_replica.ep.clone() };
    let remote = replica(1, Duration::ZERO, true).await;
    let c =
        client(vec![local.clone(), remote.ep], ClientConfig { local_pod: 0, ..local_cfg() }).await;
    for i in 0..3u8 {
        assert_eq!(c.call(&[0, 1], 1, &[i]).await.unwrap().as_slice(), &[i]);
    }
    let s = c.stats();
    assert_eq!(relaxed(&s.tcp_calls), 0, "no call over TCP while an RDMA replica serves");
    assert_eq!(relaxed(&s.remote_pod_calls), 3);
    assert_eq!(relaxed(&s.connect_failures), 2, "connect + reconnect, then skipped");
    // Only when no replica answers over RDMA does the call take TCP.
    let c = client(vec![local], local_cfg()).await;
    assert_eq!(c.call(&[0], 1, b"tcp").await.unwrap().as_slice(), b"tcp");
    assert_eq!(relaxed(&c.stats().tcp_calls), 1);
}

// A destination that serves over TCP while its RDMA is down fails every re-probe; those
// failures are no reason to quarantine it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_reprobes_of_a_destination_serving_over_tcp_do_not_quarantine_it() {
    let r = replica(0, Duration::ZERO, false).await;
    let ep = Endpoint { rdma: "127.0.0.1:17".parse().unwrap(), ..r.ep.clone() };
    let cfg = ClientConfig {
        quarantine_connection_failures: 2,
        reprobe_interval: Duration::from_millis(20),
        ..local_cfg()
    };
    let c = client(vec![ep], cfg).await;
    for _ in 0..8 {
        assert_eq!(c.call(&[0], 1, b"x").await.unwrap().as_slice(), b"x");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let s = c.stats();
    assert!(relaxed(&s.connect_failures) >= 8, "re-probes were made and failed");
    assert_eq!(relaxed(&s.tcp_calls), 8);
    assert!(!c.is_quarantined(0));
    assert_eq!(relaxed(&s.quarantines), 0);
}

// A server that answers everything "unavailable" is as unwell as one that times out: its
// replies count towards quarantine (N) and the call asks another replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwell_replies_count_towards_quarantine_and_go_to_another_replica() {
    let sick = replica_with(0, Duration::ZERO, true, true).await;
    let well = replica(1, Duration::ZERO, true).await;
    let cfg = ClientConfig { quarantine_request_failures: 2, local_pod: 0, ..local_cfg() };
    let c = client(vec![sick.ep.clone(), well.ep.clone()], cfg)
        .await
        .with_unwell_replies(|b| b == UNWELL);
    for i in 0..5u8 {
        assert_eq!(c.call(&[0, 1], 1, &[i]).await.unwrap().as_slice(), &[i], "the well one");
    }
    let s = c.stats();
    assert_eq!(relaxed(&s.unwell_replies), 3, "asked until quarantined past N = 2");
    assert!(c.is_quarantined(0));
    assert_eq!(relaxed(&s.failures), 0);
    // When every replica is unwell, the caller gets the reply (its status), not an error.
    let c = client(vec![sick.ep.clone()], local_cfg()).await.with_unwell_replies(|b| b == UNWELL);
    assert_eq!(c.call(&[0], 1, b"x").await.unwrap().as_slice(), UNWELL);
}

/// A TCP-only replica answering `marker` to everything, on `ip:port`.
async fn marked_replica(addr: SocketAddr, marker: bool) -> TcpTransport {
    let pool = Pool::unregistered(Default::default()).unwrap().leak();
    let tcp = tcp_on(pool, addr).await;
    let h = Arc::new(Echo { pool, delay: Duration::ZERO, sick: marker });
    tokio::spawn(serve(Transport::Tcp(tcp.clone()), h, Arc::new(ServerStats::default())));
    tcp
}

// Issue 15, item 3: a destination named by host is resolved before each new connection, so
// a replica that comes back under its name on another IP (a restarted Kubernetes pod) is
// found; a name that does not resolve is a connection failure that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_destination_is_resolved_again_when_the_client_reconnects() {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let first = marked_replica("127.0.0.1:0".parse().unwrap(), false).await;
    let port = first.local_addr().port();
    let unspecified = |p: u16| SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), p);
    let named = |host: &str| Endpoint {
        pod: 0,
        rdma: unspecified(9),
        tcp: unspecified(port),
        host: Some(host.into()),
    };
    let at = Arc::new(parking_lot::Mutex::new(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    let lookups = Arc::new(AtomicUsize::new(0));
    let (a, n) = (at.clone(), lookups.clone());
    let resolver: bex_rpc::Resolver = Arc::new(move |name: &str| {
        n.fetch_add(1, Ordering::Relaxed);
        (name == "ps-moving").then(|| *a.lock())
    });
    let pool = Pool::unregistered(Default::default()).unwrap().leak();
    let t = tcp_on(pool, "127.0.0.1:0".parse().unwrap()).await;
    let c = Client::new(
        None,
        Transport::Tcp(t),
        vec![named("ps-moving"), named("nowhere")],
        local_cfg(),
    )
    .with_resolver(resolver);
    assert_eq!(c.call(&[0], 1, b"hello").await.unwrap().as_slice(), b"hello");
    assert_eq!(lookups.load(Ordering::Relaxed), 1, "resolved once, for the first connection");

    // The replica dies and comes back on 127.0.0.2, same port, under the same name.
    first.shutdown();
    let _second =
        marked_replica(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)), port), true).await;
    *at.lock() = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let t0 = tokio::time::Instant::now();
    loop {
        match c.call(&[0], 1, b"hello").await {
            Ok(m) if m.as_slice() == UNWELL => break, // the second replica's answer
            _ => assert!(t0.elapsed() < Duration::from_secs(5), "never reached the new address"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lookups.load(Ordering::Relaxed) >= 2, "resolved again on reconnect");

    let e = c.call(&[1], 1, b"x").await.unwrap_err();
    assert!(e.to_string().contains("nowhere: the name does not resolve"), "{e}");
    assert!(c.stats().connect_failures.load(Ordering::Relaxed) >= 1);
}

// A call has one deadline, `(1 + max_retries) × (Tc + Tr)`, however many rungs of the
// ladder it walks: here every replica's RDMA bootstrap hangs (a listener that never
// accepts), which alone costs two connect deadlines per replica before the TCP rung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_fails_by_its_deadline_however_long_the_ladder() {
    let hang = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let slow = [
        replica(0, Duration::from_secs(5), false).await,
        replica(1, Duration::from_secs(5), false).await,
    ];
    let eps: Vec<Endpoint> = slow
        .iter()
        .map(|r| Endpoint { rdma: hang.local_addr().unwrap(), ..r.ep.clone() })
        .collect();
    // Tc and Tr such that the deadline falls inside a rung (the second replica's first
    // connect, 300-450 ms), not on the boundary where a rung's own failure races it.
    let cfg = ClientConfig {
        connect_timeout: Duration::from_millis(150),
        request_timeout: Duration::from_millis(250),
        max_retries: 0,
        retry_probability: 1.0,
        local_pod: 0,
        ..local_cfg()
    };
    let budget = cfg.call_deadline();
    assert_eq!(budget, Duration::from_millis(400));
    let c = client(eps, cfg).await;
    let t0 = tokio::time::Instant::now();
    // Without the deadline: 4 connect deadlines over RDMA, then TCP and a request deadline
    // per replica, over 1.1 s.
    let e = c.call(&[0, 1], 2, b"x").await.unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, RpcError::Timeout(d) if d == budget), "{e}");
    assert!(took >= budget, "{took:?}");
    assert!(took < budget + Duration::from_millis(300), "{took:?} against a {budget:?} deadline");
    assert_eq!(relaxed(&c.stats().failures), 1);
}
