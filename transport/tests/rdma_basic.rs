//! The RDMA transport end to end over the software RNIC on loopback.

mod common;

use std::time::Duration;

use bex_transport::{Config, TransportError};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_arrive_intact_and_in_order() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let addr = b.local_addr();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        let mut sizes = Vec::new();
        loop {
            match s.recv().await {
                Ok(m) => {
                    let (len, seed) = (m.len(), sizes.len() as u64);
                    check(&m, len, seed);
                    sizes.push(len);
                }
                Err(TransportError::Closed) => break,
                Err(e) => panic!("{e}"),
            }
        }
        (sizes, b)
    });
    let s = a.connect(addr).await.unwrap();
    let sizes = [0usize, 1, 40, 4095, 8192, 8193, 65_536, 1 << 20, 3 << 20, 64 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        s.send(pattern(a.pool(), len, i as u64)).await.unwrap();
    }
    drop(s);
    let (got, _b) = tokio::time::timeout(Duration::from_secs(60), server).await.unwrap().unwrap();
    assert_eq!(got, sizes.to_vec());
    let c = a.counters();
    assert_eq!(c.messages_sent, sizes.len() as u64);
    assert!(c.large_messages >= 5, "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sockets_share_one_engine() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let addr = b.local_addr();
    let n = 16;
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let s = b.accept().await.unwrap();
            tasks.push(tokio::spawn(async move {
                // Echo until closed.
                while let Ok(m) = s.recv().await {
                    s.send(m).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        b
    });
    let mut clients = Vec::new();
    for i in 0..n {
        let s =
            a.connect(addr).await.unwrap_or_else(|e| panic!("connect {i}: {e} {:?}", a.counters()));
        let pool = a.pool();
        clients.push(tokio::spawn(async move {
            for k in 0..20u64 {
                let seed = (i as u64) << 32 | k;
                let len = [10usize, 9000, 100_000][k as usize % 3];
                s.send(pattern(pool, len, seed)).await.unwrap();
                let back = s.recv().await.unwrap();
                check(&back, len, seed);
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(a.engines(), 1, "all sockets to one address share one engine");
    assert_eq!(a.counters().engines_up, 1);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_secret_is_refused() {
    let (a, _da) = rdma(Config { secret: b"one".to_vec(), ..Config::default() }).await;
    let (b, _db) = rdma(Config { secret: b"two".to_vec(), ..Config::default() }).await;
    let err = a.connect(b.local_addr()).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused(_)), "{err}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(b.counters().bootstrap_refused, 1);
    assert_eq!(b.engines(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srq_mode_delivers_every_size_too() {
    let cfg = Config { srq: true, srq_depth: 32, ..Config::default() };
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(cfg).await;
    let addr = b.local_addr();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        for (i, len) in [0usize, 100, 9000, 1 << 20].into_iter().enumerate() {
            check(&s.recv().await.unwrap(), len, i as u64);
        }
        b
    });
    let s = a.connect(addr).await.unwrap();
    for (i, len) in [0usize, 100, 9000, 1 << 20].into_iter().enumerate() {
        s.send(pattern(a.pool(), len, i as u64)).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(20), server).await.unwrap().unwrap();
    assert_eq!(a.counters().credit_stalls, 0);
}
