//! The TCP transport end to end on loopback, hostile peers written with raw `TcpStream`s, and
//! the unified `Transport`/`Socket` over both kinds.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bex_transport::tcp::wire::{self, Role, HELLO_LEN, PROOF_LEN};
use bex_transport::{
    Config, CounterSnapshot, RemoteTarget, Socket, TcpTransport, Transport, TransportError,
    TransportKind,
};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Deadline of anything that should happen promptly.
const WAIT: Duration = Duration::from_secs(20);

/// Waits until `f` holds for the counters of `t`, or fails naming `what`.
async fn eventually(t: &TcpTransport, what: &str, f: impl Fn(&CounterSnapshot) -> bool) {
    let mut waited = Duration::ZERO;
    while !f(&t.counters()) {
        assert!(waited < WAIT, "{what}: {:?}", t.counters());
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += Duration::from_millis(5);
    }
}

/// One round trip on a fresh socket from `a` to `b`: the transport still serves peers.
async fn still_serves(a: &TcpTransport, b: &TcpTransport) {
    let c = a.connect(b.local_addr()).await.expect("connect");
    let s = tokio::time::timeout(WAIT, b.accept()).await.expect("accept in time").unwrap();
    c.send(pattern(a.pool(), 3000, 77)).await.unwrap();
    let m = s.recv().await.unwrap();
    check(&m, 3000, 77);
    s.send(m).await.unwrap();
    check(&c.recv().await.unwrap(), 3000, 77);
}

/// A hand-built hello of a peer listening at 127.0.0.1:9 (pins the layout independently of
/// `wire::Hello::encode`).
fn raw_hello() -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..8].copy_from_slice(b"BEXTCP\x00\x02");
    h[8..40].copy_from_slice(&[7; 32]);
    h[50..56].copy_from_slice(&[0xff, 0xff, 127, 0, 0, 1]);
    h[56..58].copy_from_slice(&9u16.to_le_bytes());
    h
}

/// Connects with a raw stream and completes the handshake with `secret`.
async fn raw_client(addr: SocketAddr, secret: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mine = raw_hello();
    s.write_all(&mine).await.unwrap();
    let mut theirs = [0u8; HELLO_LEN];
    s.read_exact(&mut theirs).await.unwrap();
    assert_eq!(&theirs[..8], b"BEXTCP\x00\x02");
    s.write_all(&wire::proof(secret, Role::Initiator, &mine, &theirs)).await.unwrap();
    let mut proof = [0u8; PROOF_LEN];
    s.read_exact(&mut proof).await.unwrap();
    assert!(wire::verify(secret, Role::Acceptor, &mine, &theirs, &proof));
    s
}

/// A frame header written by hand: len u64 LE, kind u32 LE, reserved u32 LE.
fn header(len: u64, kind: u32, reserved: u32) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&len.to_le_bytes());
    h[8..12].copy_from_slice(&kind.to_le_bytes());
    h[12..].copy_from_slice(&reserved.to_le_bytes());
    h
}

/// Reads until the transport closes `s` (EOF or reset); fails if it stays open.
async fn closed_by_peer(s: &mut TcpStream) {
    let mut sink = Vec::new();
    let r = tokio::time::timeout(WAIT, s.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "the transport kept the connection open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_senders_on_one_socket_keep_their_order_under_backpressure() {
    // Two queued messages at most: most sends wait for the writer.
    let cfg = Config { max_queued_sends: 2, ..Config::default() };
    let a = tcp(cfg.clone()).await;
    let b = tcp(cfg).await;
    let (tasks, per_task) = (8u64, 150u64);
    let lens = [16usize, 100, 5000, 70_000];
    let addr = b.local_addr();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        let mut next = vec![0u64; tasks as usize];
        for _ in 0..tasks * per_task {
            let m = s.recv().await.unwrap();
            // The first 16 bytes name the sender and its sequence number.
            let word = |i: usize| u64::from_le_bytes(m.as_slice()[i..i + 8].try_into().unwrap());
            let (task, k) = (word(0), word(8));
            assert_eq!(k, next[task as usize], "task {task}'s messages out of order");
            next[task as usize] += 1;
            let seed = task << 32 | k;
            let mut want = vec![0u8; m.len() - 16];
            fill(&mut want, seed);
            assert!(m.as_slice()[16..] == want[..], "content of {seed}");
            assert_eq!(m.len(), lens[k as usize % lens.len()]);
        }
        b
    });
    let s = Arc::new(a.connect(addr).await.unwrap());
    let mut senders = Vec::new();
    for task in 0..tasks {
        let (s, pool) = (s.clone(), a.pool());
        senders.push(tokio::spawn(async move {
            for k in 0..per_task {
                let len = lens[k as usize % lens.len()];
                let mut m = pattern(pool, len, 0);
                m.as_mut_slice()[..8].copy_from_slice(&task.to_le_bytes());
                m.as_mut_slice()[8..16].copy_from_slice(&k.to_le_bytes());
                fill(&mut m.as_mut_slice()[16..], task << 32 | k);
                s.send(m).await.unwrap();
            }
        }));
    }
    for t in senders {
        t.await.unwrap();
    }
    let b = tokio::time::timeout(Duration::from_secs(60), server).await.unwrap().unwrap();
    assert_eq!(a.counters().messages_sent, tasks * per_task);
    assert_eq!(b.counters().messages_received, tasks * per_task);
}

// (The streams themselves are the contract's: `tests/contract.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sockets_each_have_their_own_connection() {
    let a = tcp(Config::default()).await;
    let b = tcp(Config::default()).await;
    let n = 4;
    let mut sockets = Vec::new();
    for _ in 0..n {
        sockets.push(a.connect(b.local_addr()).await.unwrap());
        sockets.push(tokio::time::timeout(WAIT, b.accept()).await.unwrap().unwrap());
    }
    assert_eq!(a.counters().engines_up, n, "one connection per socket");
    assert_eq!(b.counters().engines_up, n);
}

// (Refusal, its count at the acceptor and a trusted peer's round trip are the contract's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_initiator_refuses_an_acceptor_without_the_secret_too() {
    let a = tcp(Config { secret: b"one".to_vec(), ..Config::default() }).await;
    let b = tcp(Config { secret: b"two".to_vec(), ..Config::default() }).await;
    let err = a.connect(b.local_addr()).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused(_)), "{err}");
    eventually(&a, "the initiator counts the refusal", |c| c.bootstrap_refused == 1).await;
    still_serves(&tcp(Config { secret: b"two".to_vec(), ..Config::default() }).await, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_handshake_is_refused_and_counted() {
    let a = tcp(Config::default()).await;
    let b = tcp(Config::default()).await;
    let mut raw = TcpStream::connect(b.local_addr()).await.unwrap();
    raw.write_all(&[0x55; 200]).await.unwrap();
    closed_by_peer(&mut raw).await;
    eventually(&b, "garbage is counted", |c| c.bootstrap_refused == 1).await;
    // A right magic with a wrong proof.
    let mut raw = TcpStream::connect(b.local_addr()).await.unwrap();
    raw.write_all(&raw_hello()).await.unwrap();
    raw.write_all(&[0; PROOF_LEN]).await.unwrap();
    closed_by_peer(&mut raw).await;
    eventually(&b, "a bad proof is counted", |c| c.bootstrap_refused == 2).await;
    assert_eq!(b.counters().engines_up, 0);
    still_serves(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out_and_is_counted() {
    let cfg = Config { connect_timeout: Duration::from_millis(200), ..Config::default() };
    let a = tcp(cfg.clone()).await;
    let b = tcp(cfg).await;
    let mut raw = TcpStream::connect(b.local_addr()).await.unwrap();
    raw.write_all(&raw_hello()[..10]).await.unwrap();
    closed_by_peer(&mut raw).await;
    eventually(&b, "the timeout is counted", |c| c.bootstrap_refused == 1).await;
    still_serves(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_the_connection_and_are_counted() {
    let a = tcp(Config::default()).await;
    let b = tcp(Config::default()).await;
    let secret = Config::default().secret;
    let max = b.pool().max_allocation() as u64;
    assert_eq!(max, TEST_POOL_BYTES as u64);
    let cases: [(&str, [u8; 16]); 5] = [
        ("absurd length", header(u64::MAX, 1, 0)),
        ("one byte over the pool's largest allocation", header(max + 1, 1, 0)),
        ("unknown kind", header(4, 7, 0)),
        ("reserved bits", header(4, 1, 1)),
        ("close with a payload", header(4, 2, 0)),
    ];
    for (i, (what, bad)) in cases.iter().enumerate() {
        let mut raw = raw_client(b.local_addr(), &secret).await;
        // A good message first: it is delivered before the failure.
        raw.write_all(&header(5, 1, 0)).await.unwrap();
        raw.write_all(b"hello").await.unwrap();
        raw.write_all(bad).await.unwrap();
        raw.write_all(&[0xee; 64]).await.unwrap();
        closed_by_peer(&mut raw).await;
        let s = b.accept().await.unwrap();
        assert_eq!(s.peer(), "127.0.0.1:9".parse().unwrap(), "{what}");
        assert_eq!(s.recv().await.unwrap().as_slice(), b"hello", "{what}");
        match s.recv().await {
            Err(TransportError::ConnectionLost(why)) => assert!(why.contains("malformed"), "{why}"),
            r => panic!("{what}: {r:?}"),
        }
        let c = b.counters();
        assert_eq!(c.malformed, i as u64 + 1, "{what}: {c:?}");
        assert_eq!(c.engines_failed, i as u64 + 1, "{what}: {c:?}");
        assert!(matches!(
            s.send(pattern(b.pool(), 1, 0)).await,
            Err(TransportError::ConnectionLost(_))
        ));
    }
    still_serves(&a, &b).await;
    assert_eq!(b.counters().malformed, cases.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_without_a_close_frame_is_connection_lost() {
    let b = tcp(Config::default()).await;
    let secret = Config::default().secret;
    // Between frames.
    let raw = raw_client(b.local_addr(), &secret).await;
    drop(raw);
    let s = b.accept().await.unwrap();
    match s.recv().await {
        Err(TransportError::ConnectionLost(why)) => assert!(why.contains("close frame"), "{why}"),
        r => panic!("{r:?}"),
    }
    // Inside a frame: 100 bytes announced, 10 sent.
    let mut raw = raw_client(b.local_addr(), &secret).await;
    raw.write_all(&header(100, 1, 0)).await.unwrap();
    raw.write_all(&[1; 10]).await.unwrap();
    drop(raw);
    let s = b.accept().await.unwrap();
    assert!(matches!(s.recv().await, Err(TransportError::ConnectionLost(_))));
    let c = b.counters();
    assert_eq!((c.engines_failed, c.malformed, c.messages_received), (2, 0, 0), "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_nothing_is_refused_and_to_a_mute_listener_times_out() {
    let cfg = Config { connect_timeout: Duration::from_millis(200), ..Config::default() };
    let a = tcp(cfg).await;
    // A port nobody listens on (bound, then released).
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let err = a.connect(gone).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused(_)), "{err}");
    // A listener that accepts and never speaks.
    let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mute.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let (s, _) = mute.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(s);
    });
    let err = a.connect(addr).await.unwrap_err();
    assert_eq!(err, TransportError::ConnectTimeout(addr.to_string()));
    hold.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_local_sockets_and_the_peer_loses_the_connection() {
    let a = tcp(Config::default()).await;
    let b = tcp(Config::default()).await;
    let c = a.connect(b.local_addr()).await.unwrap();
    let s = b.accept().await.unwrap();
    c.send(pattern(a.pool(), 100, 1)).await.unwrap();
    check(&s.recv().await.unwrap(), 100, 1);
    a.shutdown();
    assert_eq!(c.recv().await.unwrap_err(), TransportError::Shutdown);
    assert_eq!(c.send(pattern(a.pool(), 1, 0)).await.unwrap_err(), TransportError::Shutdown);
    assert_eq!(a.connect(b.local_addr()).await.unwrap_err(), TransportError::Shutdown);
    assert_eq!(a.accept().await.unwrap_err(), TransportError::Shutdown);
    assert!(matches!(s.recv().await, Err(TransportError::ConnectionLost(_))));
    assert_eq!(b.counters().engines_failed, 1);
    // Nobody listens any more.
    assert!(b.connect(a.local_addr()).await.is_err());
}

/// Echoes over a socket of `client` to `server` through the unified types.
async fn echo_through_the_unified_types(server: Transport, client: Transport) {
    let kind = client.kind();
    assert_eq!(server.kind(), kind);
    assert_eq!(client.to_string(), format!("{kind} transport at {}", client.local_addr()));
    let addr = server.local_addr();
    let echo = tokio::spawn(async move {
        let s = server.accept().await.unwrap();
        while let Ok(m) = s.recv().await {
            s.send(m).await.unwrap();
        }
        server
    });
    let s: Socket = client.connect(addr).await.unwrap();
    assert_eq!((s.kind(), s.peer()), (kind, addr));
    assert_eq!(s.to_string(), format!("{kind} socket to {addr}"));
    let sizes = [0usize, 100, 100_000, 3 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        s.send(pattern(client.pool(), len, i as u64)).await.unwrap();
        check(&s.recv().await.unwrap(), len, i as u64);
    }
    let c = client.counters();
    assert_eq!((c.messages_sent, c.messages_received), (4, 4), "{c:?}");
    if kind == TransportKind::Tcp {
        let target = RemoteTarget { addr: 0, rkey: 0, slot: 0, len: 0 };
        let m = pattern(client.pool(), 1, 0);
        assert!(matches!(s.send_to(m, target).await, Err(TransportError::Invalid(_))));
        let m = pattern(client.pool(), 1, 0);
        assert!(matches!(s.expose(m).await, Err(TransportError::Invalid(_))));
    }
    drop(s);
    tokio::time::timeout(WAIT, echo).await.unwrap().unwrap().shutdown();
    client.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unified_types_work_over_tcp() {
    let server = Transport::from(tcp(Config::default()).await);
    let client = Transport::Tcp(tcp(Config::default()).await);
    echo_through_the_unified_types(server, client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unified_types_work_over_rdma() {
    let (server, _ds) = rdma(Config::default()).await;
    let (client, _dc) = rdma(Config::default()).await;
    echo_through_the_unified_types(Transport::from(server), Transport::Rdma(client)).await;
}

/// Short keepalives, so the tests below take a second, not several.
fn quick_keepalive() -> Config {
    Config {
        tcp_keepalive_interval: Duration::from_millis(50),
        tcp_keepalive_timeout: Duration::from_millis(300),
        ..Config::default()
    }
}

/// A peer that authenticates and then falls silent (blackholed, or hung while its kernel
/// still ACKs) ends the socket with `ConnectionLost` after the keepalive timeout; the socket
/// stayed open for good before, and a server never reaped such half-open connections. The
/// transport's own writer sends keepalives meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_ends_the_socket_after_the_keepalive_timeout() {
    let b = tcp(quick_keepalive()).await;
    let mut raw = raw_client(b.local_addr(), &Config::default().secret).await;
    let s = tokio::time::timeout(WAIT, b.accept()).await.expect("accept in time").unwrap();
    let mut h = [0u8; 16];
    tokio::time::timeout(WAIT, raw.read_exact(&mut h)).await.expect("a keepalive").unwrap();
    assert_eq!(h, header(0, 3, 0), "b's idle writer sends keepalives");
    let r = tokio::time::timeout(WAIT, s.recv()).await.expect("the socket ends");
    match r {
        Err(TransportError::ConnectionLost(why)) => assert!(why.contains("keepalive"), "{why}"),
        other => panic!("expected ConnectionLost, got {other:?}"),
    }
    let c = b.counters();
    assert_eq!((c.keepalive_failures, c.engines_failed), (1, 1), "{c:?}");
    drop(raw);
}

/// Keepalives keep quiet sockets alive: one idle for three timeouts, and one whose receiver
/// does not read for three timeouts while its queue is full (the peer's bytes wait unread in
/// the kernel, which is no silence), both still deliver afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_and_slow_receivers_outlive_the_keepalive_timeout() {
    let a = tcp(quick_keepalive()).await;
    let b = tcp(Config { max_queued_sends: 2, ..quick_keepalive() }).await;
    let c = a.connect(b.local_addr()).await.unwrap();
    let s = tokio::time::timeout(WAIT, b.accept()).await.expect("accept in time").unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    c.send(pattern(a.pool(), 100, 1)).await.unwrap();
    check(&s.recv().await.unwrap(), 100, 1);
    let n = 40u64;
    let sender = {
        let pool = a.pool();
        tokio::spawn(async move {
            for i in 0..n {
                c.send(pattern(pool, 200_000, i)).await.unwrap();
            }
            c
        })
    };
    tokio::time::sleep(Duration::from_millis(900)).await;
    for i in 0..n {
        let m = tokio::time::timeout(WAIT, s.recv()).await.expect("in time").unwrap();
        check(&m, 200_000, i);
    }
    let _c = sender.await.unwrap();
    for t in [&a, &b] {
        assert_eq!(t.counters().keepalive_failures, 0, "{:?}", t.counters());
    }
    assert!(a.counters().timer_wakeups > 0, "a's idle writer woke to send keepalives");
}
