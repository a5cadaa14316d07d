//! The socket contract every transport keeps, written once and run against each kind (RDMA on
//! the software RNIC, TCP, the simulated network), the way `bex_rnic::conformance` runs one
//! suite against every NIC backend. A [`Bed`] makes transports of one kind;
//! [`socket_contract_suite!`](crate::socket_contract_suite) turns every case below into a
//! `#[test]` on that bed.
//!
//! The contract: messages of every size arrive intact and in order; sockets to one peer carry
//! independent streams; a dropped socket's peer receives what was sent, then `Closed`, and
//! keeps answering `Closed`; a `recv` that waits sees its peer close; connecting to nothing
//! fails by the connect deadline; a peer without the shared secret is refused (where the
//! kind authenticates); the counters count what was sent and received.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;

use crate::{Config, Msg, Socket, Transport, TransportError};

/// The longest any one step of a case may take before the case fails (not hangs).
pub const WAIT: Duration = Duration::from_secs(60);

/// Transports of one kind, for the cases.
pub trait Bed: Sync {
    /// Its name in failure messages.
    fn name(&self) -> &'static str;

    /// The runtime the cases run on (real sockets: multi-threaded; the simulated network: a
    /// current-thread runtime on tokio's paused clock).
    fn runtime(&self) -> tokio::runtime::Runtime;

    /// A new transport with `cfg` (called on that runtime): its secret decides whom it
    /// trusts.
    fn transport(&self, cfg: Config) -> impl Future<Output = Transport>;

    /// An address nobody listens on.
    fn nowhere(&self) -> SocketAddr;

    /// Whether the kind refuses a peer without the shared secret.
    fn authenticates(&self) -> bool {
        true
    }

    /// The largest message [`every_size_arrives_intact_and_in_order`] sends (the simulated
    /// network's runs copy every byte through a debug-built RNIC, so it sends less).
    fn largest_message(&self) -> usize {
        64 << 20
    }

    /// Sockets and round trips each of [`sockets_to_one_peer_carry_independent_streams`].
    fn streams(&self) -> (u64, u64) {
        (32, 20)
    }
}

/// A message of `len` bytes whose content depends on `seed`.
pub fn pattern(pool: &'static Pool, len: usize, seed: u64) -> Msg {
    let mut m = Msg::alloc(pool, len).expect("the test pool has room");
    fill(m.as_mut_slice(), seed);
    m
}

/// Fills `buf` with the bytes of `seed`'s pattern.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Panics unless `msg` is `len` bytes of `seed`'s pattern.
pub fn check(msg: &Msg, len: usize, seed: u64) {
    assert_eq!(msg.len(), len, "length of message {seed}");
    let mut want = vec![0u8; len];
    fill(&mut want, seed);
    assert!(msg.as_slice() == &want[..], "content of message {seed} ({len} bytes) differs");
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not within {WAIT:?}"),
    }
}

/// Two transports that trust each other, and a socket from the first to the second with its
/// accepted end.
async fn connected(bed: &impl Bed) -> (Transport, Transport, Socket, Socket) {
    let a = bed.transport(Config::default()).await;
    let b = bed.transport(Config::default()).await;
    let c = within("connect", a.connect(b.local_addr())).await.expect("connect");
    let s = within("accept", b.accept()).await.expect("accept");
    (a, b, c, s)
}

/// Messages of 0 B to the bed's largest (64 MiB; around the frame header's and the buffers'
/// boundaries on the way) arrive
/// intact, in order, in the receiver's pool, and are counted, bytes too, on both sides; no
/// engine fails and nothing is malformed.
pub async fn every_size_arrives_intact_and_in_order(bed: &impl Bed) {
    let (a, b, c, s) = connected(bed).await;
    assert_eq!(c.peer(), b.local_addr(), "{}: a socket names the address it reached", bed.name());
    let sizes: Vec<usize> =
        [0usize, 1, 15, 16, 17, 40, 4095, 8192, 8193, 65_535, 65_536, 65_537, 1 << 20, 3 << 20]
            .into_iter()
            .chain([bed.largest_message()])
            .filter(|&n| n <= bed.largest_message())
            .collect();
    for (i, &len) in sizes.iter().enumerate() {
        within("send", c.send(pattern(a.pool(), len, i as u64))).await.expect("send");
    }
    for (i, &len) in sizes.iter().enumerate() {
        let m = within("recv", s.recv()).await.expect("recv");
        check(&m, len, i as u64);
        if len > 0 {
            let ours = b.pool().block_of(m.as_slice().as_ptr()).is_some();
            assert!(ours, "{}: message {i} was received into the transport's pool", bed.name());
        }
    }
    let (n, total) = (sizes.len() as u64, sizes.iter().sum::<usize>() as u64);
    let (ca, cb) = (a.counters(), b.counters());
    assert_eq!((ca.messages_sent, ca.bytes_sent), (n, total), "{}: {ca:?}", bed.name());
    assert_eq!((cb.messages_received, cb.bytes_received), (n, total), "{}: {cb:?}", bed.name());
    let bad = (ca.engines_failed, cb.engines_failed, cb.malformed);
    assert_eq!(bad, (0, 0, 0), "{}", bed.name());
    assert_eq!((ca.engines_up, cb.engines_up), (1, 1), "{}: one socket, one engine", bed.name());
}

/// Sockets to one peer carry independent streams: concurrent echo streams (32 of 20 round
/// trips by default) of mixed sizes.
pub async fn sockets_to_one_peer_carry_independent_streams(bed: &impl Bed) {
    let a = bed.transport(Config::default()).await;
    let b = bed.transport(Config::default()).await;
    let (n, trips) = bed.streams();
    let (server, client_addr) = (b.clone(), a.local_addr());
    let echo = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let s = server.accept().await.expect("accept");
            assert_eq!(s.peer(), client_addr, "an accepted socket names the peer's listen address");
            tasks.push(tokio::spawn(async move {
                while let Ok(m) = s.recv().await {
                    s.send(m).await.expect("echo");
                }
            }));
        }
        for t in tasks {
            t.await.expect("an echo task");
        }
    });
    let mut clients = Vec::new();
    for i in 0..n {
        let s = Arc::new(within("connect", a.connect(b.local_addr())).await.expect("connect"));
        let pool = a.pool();
        clients.push(tokio::spawn(async move {
            for k in 0..trips {
                let seed = i << 32 | k;
                let len = [10usize, 9000, 100_000][k as usize % 3];
                s.send(pattern(pool, len, seed)).await.expect("send");
                check(&s.recv().await.expect("echoed"), len, seed);
            }
        }));
    }
    for c in clients {
        within("a client stream", c).await.expect("a client task");
    }
    within("the echo server", echo).await.expect("the echo task");
    assert_eq!(a.counters().messages_received, trips * n, "{}", bed.name());
}

/// A dropped socket's peer receives everything sent before the drop, then `Closed` (and
/// again `Closed`, and `Closed` for its own sends); nothing counts as a failure.
pub async fn a_dropped_sockets_peer_gets_its_messages_then_closed(bed: &impl Bed) {
    let (a, b, c, s) = connected(bed).await;
    for i in 0..3u64 {
        c.send(pattern(a.pool(), 1000 * i as usize, i)).await.expect("send");
    }
    drop(c);
    for i in 0..3u64 {
        check(&within("recv", s.recv()).await.expect("recv"), 1000 * i as usize, i);
    }
    assert_eq!(within("recv", s.recv()).await.unwrap_err(), TransportError::Closed);
    assert_eq!(within("recv", s.recv()).await.unwrap_err(), TransportError::Closed, "stays");
    let send = within("send", s.send(pattern(b.pool(), 10, 0))).await;
    assert_eq!(send.unwrap_err(), TransportError::Closed);
    let failed = a.counters().engines_failed + b.counters().engines_failed;
    assert_eq!(failed, 0, "{}: a close is not a failure", bed.name());
}

/// A `recv` already waiting when the peer drops its socket returns `Closed`.
pub async fn a_waiting_recv_sees_the_peer_close(bed: &impl Bed) {
    let (a, _b, c, s) = connected(bed).await;
    let c = Arc::new(c);
    let c2 = c.clone();
    let waiting = tokio::spawn(async move { c2.recv().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(s);
    let r = within("the waiting recv", waiting).await.expect("the recv task");
    assert_eq!(r.unwrap_err(), TransportError::Closed, "{}", bed.name());
    let send = within("send", c.send(pattern(a.pool(), 10, 0))).await;
    assert_eq!(send.unwrap_err(), TransportError::Closed);
}

/// Connecting to an address nobody listens on fails, by the connect deadline.
pub async fn connecting_to_nothing_fails(bed: &impl Bed) {
    let cfg = Config { connect_timeout: Duration::from_millis(500), ..Config::default() };
    let a = bed.transport(cfg).await;
    let r = within("connecting to nothing", a.connect(bed.nowhere())).await;
    assert!(r.is_err(), "{}: connected to {}", bed.name(), bed.nowhere());
    assert_eq!(a.counters().engines_up, 0, "{}", bed.name());
}

/// A peer with another secret is refused, counted, and never accepted; peers with the same
/// secret still connect.
pub async fn a_peer_without_the_secret_is_refused(bed: &impl Bed) {
    if !bed.authenticates() {
        println!("SKIPPED: {} does not authenticate peers", bed.name());
        return;
    }
    let with = |s: &[u8]| Config { secret: s.to_vec(), ..Config::default() };
    let a = bed.transport(with(b"one")).await;
    let b = bed.transport(with(b"two")).await;
    let err = within("connect", a.connect(b.local_addr())).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused(_)), "{}: {err}", bed.name());
    let refused = async {
        while b.counters().bootstrap_refused == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    within("the acceptor counts the refusal", refused).await;
    assert!(tokio::time::timeout(Duration::from_millis(100), b.accept()).await.is_err());
    assert_eq!(b.counters().bootstrap_refused, 1, "{}", bed.name());
    assert_eq!((a.counters().engines_up, b.counters().engines_up), (0, 0), "{}", bed.name());
    // The same secret on both sides works: a round trip.
    let c = bed.transport(with(b"two")).await;
    let cs = within("a trusted peer connects", c.connect(b.local_addr())).await.expect("connect");
    let bs = within("accept", b.accept()).await.expect("accept");
    cs.send(pattern(c.pool(), 3000, 77)).await.expect("send");
    let m = within("recv", bs.recv()).await.expect("recv");
    check(&m, 3000, 77);
    bs.send(m).await.expect("send back");
    check(&within("recv", cs.recv()).await.expect("recv"), 3000, 77);
}

/// The cases, by name, for the macro.
#[macro_export]
macro_rules! socket_contract_suite {
    ($bed:expr) => {
        $crate::socket_contract_suite!(@cases $bed;
            every_size_arrives_intact_and_in_order,
            sockets_to_one_peer_carry_independent_streams,
            a_dropped_sockets_peer_gets_its_messages_then_closed,
            a_waiting_recv_sees_the_peer_close,
            connecting_to_nothing_fails,
            a_peer_without_the_secret_is_refused);
    };
    (@cases $bed:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let bed = $bed;
                let rt = $crate::contract::Bed::runtime(&bed);
                rt.block_on($crate::contract::$case(&bed));
            }
        )*
    };
}
