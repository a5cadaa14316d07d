//! The async transport API over the simulated network ([`bex_transport::simio`]), on tokio's
//! paused clock: messages arrive intact in microseconds of virtual time, a killed node
//! refuses connections and its peers' sockets fail by keepalive, and runs repeat exactly.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bex_rnic::soft::LinkModel;
use bex_transport::sim::SimNet;
use bex_transport::simio::SimHub;
use bex_transport::{Config, Msg, Transport, TransportError, TransportKind};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap()
}

fn addr(i: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], 7000 + i))
}

fn cfg() -> Config {
    Config {
        keepalive_interval: Duration::from_millis(10),
        keepalive_timeout: Duration::from_millis(50),
        ..Config::default()
    }
}

fn msg(t: &Transport, bytes: &[u8]) -> Msg {
    let mut m = Msg::alloc(t.pool(), bytes.len()).unwrap();
    m.as_mut_slice().copy_from_slice(bytes);
    m
}

/// Echo server on `b`; `a` sends `n` messages of growing size; returns the virtual time the
/// round trips took.
async fn echo_run(seed: u64, n: usize) -> (Duration, Vec<usize>) {
    let hub = SimHub::new(SimNet::new(seed, LinkModel::default()));
    tokio::spawn(hub.clone().drive());
    let a = Transport::Sim(hub.add_transport(addr(1), TransportKind::Rdma, cfg()).unwrap());
    let b = Transport::Sim(hub.add_transport(addr(2), TransportKind::Rdma, cfg()).unwrap());
    let server = b.clone();
    tokio::spawn(async move {
        while let Ok(s) = server.accept().await {
            let s = Arc::new(s);
            let pool = server.pool();
            tokio::spawn(async move {
                while let Ok(m) = s.recv().await {
                    let mut r = Msg::alloc(pool, m.len()).unwrap();
                    r.as_mut_slice().copy_from_slice(m.as_slice());
                    if s.send(r).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let s = a.connect(addr(2)).await.unwrap();
    assert_eq!(s.peer(), addr(2));
    let start = hub.now();
    let mut sizes = Vec::new();
    for i in 0..n {
        let len = 1 + i * 7919 % 200_000;
        let body: Vec<u8> = (0..len).map(|j| (j * 31 + i) as u8).collect();
        s.send(msg(&a, &body)).await.unwrap();
        let back = s.recv().await.unwrap();
        assert_eq!(back.as_slice(), &body[..], "message {i} came back intact");
        sizes.push(back.len());
    }
    (hub.now() - start, sizes)
}

#[test]
fn echo_round_trips_are_intact_and_take_virtual_microseconds() {
    // Each message's return is checked byte for byte inside `echo_run`.
    let (took, _) = rt().block_on(echo_run(1, 40));
    // 40 round trips of up to 200 KB on the default link, in the network's clock: well under
    // the millisecond each that a clock of tokio's resolution alone would give.
    assert!(took > Duration::ZERO && took < Duration::from_millis(40), "{took:?}");
}

#[test]
fn a_seed_replays_exactly() {
    let a = rt().block_on(echo_run(7, 20));
    let b = rt().block_on(echo_run(7, 20));
    assert_eq!(a, b);
}

#[test]
fn a_killed_node_refuses_connections_and_its_peers_sockets_fail_by_keepalive() {
    rt().block_on(async {
        let hub = SimHub::new(SimNet::new(3, LinkModel::default()));
        tokio::spawn(hub.clone().drive());
        let a = hub.add_transport(addr(1), TransportKind::Rdma, cfg()).unwrap();
        let b = hub.add_transport(addr(2), TransportKind::Tcp, cfg()).unwrap();
        assert_eq!(Transport::Sim(b.clone()).kind(), TransportKind::Tcp);
        let acceptor = b.clone();
        let held = tokio::spawn(async move { acceptor.accept().await.unwrap() });
        let s = a.connect(addr(2)).await.unwrap();
        let _server_side = held.await.unwrap();
        hub.kill(&b);
        let killed_at = tokio::time::Instant::now();
        let r = s.recv().await;
        assert!(matches!(r, Err(TransportError::ConnectionLost(_))), "{r:?}");
        let took = killed_at.elapsed();
        assert!(took <= Duration::from_millis(80), "keepalive expiry took {took:?}");
        let r = a.connect(addr(2)).await;
        assert!(matches!(r, Err(TransportError::Refused(_))), "{r:?}");
    });
}
