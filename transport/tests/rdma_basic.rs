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

// (The streams themselves are the contract's: `tests/contract.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sockets_share_one_engine() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let mut sockets = Vec::new();
    for i in 0..16 {
        let c = a.connect(b.local_addr()).await.unwrap_or_else(|e| panic!("connect {i}: {e}"));
        let s = tokio::time::timeout(Duration::from_secs(20), b.accept()).await.unwrap().unwrap();
        c.send(pattern(a.pool(), 9000, i)).await.unwrap();
        check(&s.recv().await.unwrap(), 9000, i);
        sockets.push((c, s));
    }
    assert_eq!(a.engines(), 1, "all sockets to one address share one engine");
    assert_eq!(a.counters().engines_up, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srq_mode_delivers_every_size_too() {
    let cfg = Config { srq: true, srq_depth: 32, ..Config::default() };
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(cfg).await;
    let addr = b.local_addr();
    // Then a flood of 100 more than the SRQ holds, which the receiver only reads once all
    // are queued: a sender counting credits towards an SRQ peer would stall on it.
    let sizes: Vec<usize> = [0, 100, 9000, 1 << 20].into_iter().chain([512; 100]).collect();
    let (queued, all_queued) = tokio::sync::oneshot::channel::<()>();
    let expected = sizes.clone();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        all_queued.await.unwrap();
        for (i, len) in expected.into_iter().enumerate() {
            check(&s.recv().await.unwrap(), len, i as u64);
        }
        b
    });
    let s = a.connect(addr).await.unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        s.send_detached(pattern(a.pool(), len, i as u64)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    queued.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), server).await.unwrap().unwrap();
    assert_eq!(a.counters().credit_stalls, 0, "no credits towards an SRQ peer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_beyond_the_cq_capacity_are_refused_clearly() {
    // 192 CQ entries hold two engines of 32 + 64 entries each.
    let (a, _da) = rdma(Config { cq_depth: 192, ..Config::default() }).await;
    let mut peers = Vec::new();
    for _ in 0..3 {
        let (p, d) = rdma(Config::default()).await;
        let p2 = p.clone();
        tokio::spawn(async move {
            while let Ok(s) = p2.accept().await {
                tokio::spawn(async move {
                    while let Ok(m) = s.recv().await {
                        let _ = s.send(m).await;
                    }
                });
            }
        });
        peers.push((p, d));
    }
    let s0 = a.connect(peers[0].0.local_addr()).await.unwrap();
    let s1 = a.connect(peers[1].0.local_addr()).await.unwrap();
    let err = a.connect(peers[2].0.local_addr()).await.unwrap_err();
    assert!(err.to_string().contains("CQ is full"), "{err}");
    for (i, s) in [s0, s1].iter().enumerate() {
        s.send(pattern(a.pool(), 100, i as u64)).await.unwrap();
        check(&s.recv().await.unwrap(), 100, i as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_exposed_in_advance_is_written_without_rts_cts() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let addr = b.local_addr();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        // The receiver offers a 1 MiB buffer; the target travels out of band (here in-process).
        let buf = bex_transport::Msg::alloc(b.pool(), 1 << 20).unwrap();
        tx.send(s.expose(buf).await.unwrap()).unwrap();
        let got = s.recv().await.unwrap();
        assert_eq!(got.len(), 1 << 20, "the whole exposed buffer is delivered");
        let mut want = vec![0u8; 300_000];
        fill(&mut want, 42);
        assert!(got.as_slice()[..300_000] == want[..], "the message fills its start");
        b
    });
    let s = a.connect(addr).await.unwrap();
    let target = rx.await.unwrap();
    s.send_to(pattern(a.pool(), 300_000, 42), target).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), server).await.unwrap().unwrap();
    let c = a.counters();
    assert_eq!(c.large_messages, 0, "no RTS was sent");
    // Too large for the target: refused locally.
    let too_big = pattern(a.pool(), (1 << 20) + 1, 1);
    assert!(matches!(s.send_to(too_big, target).await, Err(TransportError::Invalid(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_sends_arrive_in_order_and_free_their_queue_slots() {
    // Four slots: 40 detached sends only get through if each slot comes back when the NIC
    // is done with its message.
    let cfg = Config { max_queued_sends: 4, ..Config::default() };
    let (a, _da) = rdma(cfg.clone()).await;
    let (b, _db) = rdma(cfg).await;
    let addr = b.local_addr();
    let sizes: Vec<usize> = (0..40).map(|i| [16, 8192, 8193, 100_000][i % 4]).collect();
    let expect = sizes.clone();
    let server = tokio::spawn(async move {
        let s = b.accept().await.unwrap();
        for (i, &len) in expect.iter().enumerate() {
            let m = s.recv().await.unwrap();
            check(&m, len, i as u64);
        }
        b
    });
    let s = a.connect(addr).await.unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        tokio::time::timeout(
            Duration::from_secs(10),
            s.send_detached(pattern(a.pool(), len, i as u64)),
        )
        .await
        .expect("a queue slot came back")
        .unwrap();
    }
    let _b = tokio::time::timeout(Duration::from_secs(30), server).await.unwrap().unwrap();
}

/// A proxy to `target` for one bootstrap: it forwards the hellos and proofs each way
/// (58 + 32 bytes: a `BEXHELO\x04` hello and an HMAC), then nothing more; it closes both connections then, or with `hold`
/// hands them back open. Returns the address to connect to.
async fn proofs_only_proxy(
    target: std::net::SocketAddr,
    hold: bool,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<Option<[tokio::net::TcpStream; 2]>>) {
    use tokio::io::AsyncReadExt;
    // Fewer, and no peer would prove itself (the refusal test would count two); more, and
    // the endpoints would start to go through.
    const HELLO_AND_PROOF: u64 = 58 + 32;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = proxy.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (a, _) = proxy.accept().await.unwrap();
        let b = tokio::net::TcpStream::connect(target).await.unwrap();
        let ((mut ar, mut aw), (mut br, mut bw)) = (a.into_split(), b.into_split());
        let up = async { tokio::io::copy(&mut (&mut ar).take(HELLO_AND_PROOF), &mut bw).await };
        let down = async { tokio::io::copy(&mut (&mut br).take(HELLO_AND_PROOF), &mut aw).await };
        let (u, d) = tokio::join!(up, down);
        assert_eq!((u.unwrap(), d.unwrap()), (HELLO_AND_PROOF, HELLO_AND_PROOF));
        hold.then(|| [ar.reunite(aw).unwrap(), br.reunite(bw).unwrap()])
    });
    (addr, task)
}

/// A bootstrap cut after the proofs (the ready bytes lost, as when a caller's connect
/// deadline cancels it) ends the engines both sides hosted: left on, they lived unseen by any
/// connection table, and when one died its CQ place was given back a second time, the count
/// wrapped, and the server refused every later peer with "every endpoint's CQ is full".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_cut_before_the_ready_byte_leaves_no_engine_behind() {
    let quick = Config {
        keepalive_interval: Duration::from_millis(20),
        keepalive_timeout: Duration::from_millis(200),
        ..Config::default()
    };
    let (server, _ds) = rdma(quick.clone()).await;
    let (client, _dc) = rdma(quick.clone()).await;
    // The hellos and proofs go through, then both sides are closed.
    let target = server.local_addr();
    let (proxy_addr, cut) = proofs_only_proxy(target, false).await;
    let attempt = tokio::time::timeout(Duration::from_secs(10), client.connect(proxy_addr)).await;
    assert!(attempt.expect("the cut bootstrap ends").is_err(), "no ready byte: no connection");
    cut.await.unwrap();
    // The client goes away, so an engine either side kept would lose its peer's keepalives.
    drop(client);
    #[allow(clippy::disallowed_methods)] // a wait past the keepalive timeout, on purpose
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (fresh, _df) = rdma(quick).await;
    let s = tokio::time::timeout(Duration::from_secs(10), fresh.connect(target))
        .await
        .expect("connect ends")
        .expect("the server still takes engines");
    let accepted = tokio::time::timeout(Duration::from_secs(10), server.accept()).await;
    s.send(pattern(fresh.pool(), 100, 7)).await.unwrap();
    check(&accepted.unwrap().unwrap().recv().await.unwrap(), 100, 7);
    assert_eq!(server.counters().engines_failed, 0, "{:?}", server.counters());
}

/// `bootstrap_refused` counts strangers: an inbound bootstrap cut off by the listener's
/// timeout counts only if the peer had not proven it holds the secret. Before, a peer that
/// authenticated and then stalled (a slow host) was counted as refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_that_times_out_counts_as_refused_only_before_the_proof() {
    let quick = Config { connect_timeout: Duration::from_millis(300), ..Config::default() };
    let (server, _ds) = rdma(quick.clone()).await;
    let (client, _dc) = rdma(Config::default()).await;
    // A stranger: connects, says nothing.
    let stranger = tokio::net::TcpStream::connect(server.local_addr()).await.unwrap();
    // A peer with the secret whose hellos and proofs go through, then nothing more (both
    // connections held open, silent).
    let (proxy_addr, stall) = proofs_only_proxy(server.local_addr(), true).await;
    let attempt = tokio::time::timeout(Duration::from_secs(10), client.connect(proxy_addr)).await;
    assert!(attempt.expect("the stalled bootstrap ends").is_err(), "no connection");
    let _held = stall.await.unwrap();
    // Past the server's timeout for both inbound bootstraps (they began before the client's
    // 3 s connect timeout ran out).
    #[allow(clippy::disallowed_methods)] // a wait past the server's timeout, on purpose
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(server.counters().bootstrap_refused, 1, "the stranger alone");
    drop(stranger);
}

/// Buffers the peer may write into for a socket (here one exposed for a reply, as the RPC
/// client does) are freed once both ends have closed it: before, they stayed allocated until
/// the engine ended — with keepalives, the process — one per call given up on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_socket_gives_back_the_buffers_the_peer_could_write() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let s = a.connect(b.local_addr()).await.unwrap();
    let peer = tokio::time::timeout(Duration::from_secs(10), b.accept()).await.unwrap().unwrap();
    // Settled: the engine's receive ring and headers are allocated.
    s.send(pattern(a.pool(), 10, 1)).await.unwrap();
    check(&peer.recv().await.unwrap(), 10, 1);
    let before = a.pool().stats().live_bytes;
    let reply = bex_transport::Msg::alloc(a.pool(), 4 << 20).unwrap();
    let _target = s.expose(reply).await.unwrap();
    assert!(a.pool().stats().live_bytes >= before + (4 << 20));
    // The caller gives up: its socket closes, then the peer's.
    drop(s);
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(10), peer.recv()).await.unwrap(),
        Err(TransportError::Closed)
    ));
    drop(peer);
    let mut live = 0;
    for _ in 0..100 {
        live = a.pool().stats().live_bytes;
        if live <= before {
            break;
        }
        #[allow(clippy::disallowed_methods)] // polling for the peer's Close to arrive
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(live <= before, "{live} bytes live, {before} before the exposed buffer");
}

/// A connect whose caller gives up (its future dropped, as an RPC client's connect deadline
/// does) after the Open went out leaves no socket open: before, the peer's end stayed open,
/// its serving task with it, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_dropped_midway_closes_the_socket_on_both_sides() {
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    let warm = a.connect(b.local_addr()).await.unwrap(); // the engine exists: Open goes at once
    let _warm_peer = b.accept().await.unwrap();
    // Polled once (the Open goes out), then dropped.
    tokio::select! {
        biased;
        _ = a.connect(b.local_addr()) => panic!("a connect cannot finish on its first poll"),
        _ = std::future::ready(()) => {}
    }
    let peer = tokio::time::timeout(Duration::from_secs(5), b.accept())
        .await
        .expect("the Open reached b")
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), peer.recv()).await;
    assert!(matches!(r, Ok(Err(TransportError::Closed))), "b's end was closed: {r:?}");
    drop(warm);
}

/// Peers configured with other eager limits and path MTUs (a rolling configuration change)
/// each take the smaller of the two: the larger side sent eager messages that overflowed the
/// other's receive buffers, and the engine failed with a work-completion error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_other_eager_limits_and_mtus_take_the_smaller() {
    use bex_rnic::verbs::Mtu;
    let small = Config { eager_max: 1024, path_mtu: Mtu::Mtu1024, ..Config::default() };
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(small).await;
    let sizes = [100usize, 1024, 4000, 8192, 9000];
    let c = a.connect(b.local_addr()).await.unwrap();
    let s = tokio::time::timeout(Duration::from_secs(20), b.accept()).await.unwrap().unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        c.send(pattern(a.pool(), len, i as u64)).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(20), s.recv()).await.unwrap().unwrap();
        check(&m, len, i as u64);
        s.send(pattern(b.pool(), len, 100 + i as u64)).await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(20), c.recv()).await.unwrap().unwrap();
        check(&m, len, 100 + i as u64);
    }
    // Only 100 and 1024 bytes go eager; above 1 KiB both sides write (after RTS/CTS, or
    // into a standing grant): 4000, 8192 and 9000 bytes, each way.
    for t in [&a, &b] {
        let c = t.counters();
        assert_eq!((c.eager_messages, c.large_messages + c.granted_messages), (2, 3), "{c:?}");
        assert_eq!(c.engines_failed, 0);
    }
}

/// An inbound peer that leaves before proving itself (a stranger's probe: connect, maybe
/// half a hello, close) is counted as refused, as a bad hello or a bad proof is; it was not
/// counted at all. The transport goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_peer_leaving_before_its_proof_is_counted_as_refused() {
    use tokio::io::AsyncWriteExt;
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(Config::default()).await;
    for half_hello in [&b""[..], b"BEXHELO"] {
        let mut probe = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
        probe.write_all(half_hello).await.unwrap();
    }
    let mut waited = Duration::ZERO;
    while b.counters().bootstrap_refused < 2 {
        assert!(waited < Duration::from_secs(10), "{:?}", b.counters());
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += Duration::from_millis(5);
    }
    let c = a.connect(b.local_addr()).await.unwrap();
    let s = tokio::time::timeout(Duration::from_secs(20), b.accept()).await.unwrap().unwrap();
    c.send(pattern(a.pool(), 100, 1)).await.unwrap();
    check(&s.recv().await.unwrap(), 100, 1);
    assert_eq!(b.counters().bootstrap_refused, 2);
}

/// Strangers without the secret take no engine place: connections that never prove
/// themselves, as many as the endpoints have places for, do not keep a peer with the secret
/// out. Each place was taken (and its QP created) before the proofs, so a handful of
/// silent connections refused every bootstrap ("CQ full") for `connect_timeout`, renewably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_holding_unproven_bootstraps_take_no_engine_place() {
    use tokio::io::AsyncReadExt;
    let cfg = Config::default();
    // Room for two engines on the one endpoint.
    let two_places = Config { cq_depth: 2 * (cfg.sq_depth + cfg.rq_depth), ..cfg.clone() };
    let (a, _da) = rdma(Config::default()).await;
    let (b, _db) = rdma(two_places).await;
    let mut strangers = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(b.local_addr()).await.unwrap();
        // b's hello arrived: its side of this bootstrap is under way.
        let mut first = [0u8; 8];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut first))
            .await
            .expect("b sends its hello")
            .unwrap();
        assert_eq!(&first[..7], b"BEXHELO");
        strangers.push(s);
    }
    let c = a.connect(b.local_addr()).await.expect("a peer with the secret gets a place");
    let s = tokio::time::timeout(Duration::from_secs(20), b.accept()).await.unwrap().unwrap();
    c.send(pattern(a.pool(), 100, 1)).await.unwrap();
    check(&s.recv().await.unwrap(), 100, 1);
    assert_eq!(b.counters().engines_up, 1);
    drop(strangers);
}
