//! The engine alone: two engines on two software NICs of one in-memory fabric, driven by
//! hand on its virtual clock — no thread, no runtime, no endpoint. Each test is exact for
//! its seed.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::Pool;
use bex_rnic::soft::{
    Fabric, FaultRates, LinkModel, NicConfig, SoftCq, SoftDevice, SoftPd, SoftQp,
};
use bex_rnic::verbs::{InitAttrs, QpCaps, RtrAttrs, RtsAttrs, WorkCompletion};
use bex_rnic::{CompletionQueue, Device, QpInit, QueuePair};

use super::{Engine, EngineParts, Event, Post};
use crate::config::{Config, Counters};
use crate::error::TransportError;
use crate::msg::{Msg, SharedMsg};

/// One side: a NIC, its CQ and QP, and the engine over them.
struct Side {
    cq: SoftCq,
    qp: SoftQp,
    engine: Engine<u64>,
    /// Events the engine produced, in order.
    events: Vec<Event<u64>>,
    /// A frozen side is not driven (a hung host: its NIC still ACKs).
    frozen: bool,
}

struct Pair {
    fabric: Fabric,
    pool: &'static Pool,
    a: Side,
    b: Side,
}

impl Side {
    /// Posts what the engine has and takes its events.
    fn settle(&mut self) {
        while let Some(post) = self.engine.poll_post() {
            let r = match post {
                Post::Recv(wrs) => self.qp.post_recv(wrs),
                Post::Send(wrs) => self.qp.post_send(wrs),
            };
            if let Err(e) = r {
                self.engine.fail(format!("post: {e}"));
            }
        }
        while let Some(ev) = self.engine.poll_event() {
            self.events.push(ev);
        }
    }

    /// Completions, timers, posts.
    fn drive(&mut self, now: Instant) {
        if self.frozen {
            return;
        }
        let mut wcs = [WorkCompletion::default(); 32];
        loop {
            let n = self.cq.poll(&mut wcs).expect("poll");
            for wc in &wcs[..n] {
                self.engine.handle_completion(now, wc);
            }
            if n < wcs.len() {
                break;
            }
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        self.settle();
    }

    fn received(&self, socket: u32) -> Vec<&Msg> {
        let got = self.events.iter().filter_map(|e| match e {
            Event::Received { socket: s, msg } if *s == socket => Some(msg),
            _ => None,
        });
        got.collect()
    }

    fn sent(&self, token: u64) -> Option<&Result<(), TransportError>> {
        self.events.iter().find_map(|e| match e {
            Event::Sent { done, result } if *done == token => Some(result),
            _ => None,
        })
    }
}

fn side(
    dev: &SoftDevice,
    pd: &SoftPd,
    pool: &'static Pool,
    dev_index: usize,
    cfg: &Arc<Config>,
    now: Instant,
) -> Side {
    let cq = dev.create_cq(cfg.cq_depth).expect("cq");
    let caps = QpCaps {
        max_send_wr: cfg.sq_depth,
        max_recv_wr: cfg.rq_depth,
        max_send_sge: 2,
        max_recv_sge: 1,
    };
    let qp = dev
        .create_qp(pd, &QpInit { send_cq: &cq, recv_cq: &cq, srq: None, thread_domain: None, caps })
        .expect("qp");
    qp.to_init(&InitAttrs::default()).expect("init");
    let parts = EngineParts {
        cfg: cfg.clone(),
        pool,
        dev: dev_index,
        counters: Arc::new(Counters::default()),
        qpn: qp.qpn(),
        peer_rq_depth: cfg.rq_depth,
        accepting: true,
        socket_ids: Arc::new(AtomicU32::new(100 * (dev_index as u32 + 1))),
        shared_recv: None,
    };
    let mut engine = Engine::new(parts, now).expect("engine");
    // Own receives first, in INIT: the first `poll_post` hands them out.
    match engine.poll_post() {
        Some(Post::Recv(wrs)) => qp.post_recv(wrs).expect("post receives"),
        other => panic!("expected the initial receives, got {other:?}"),
    }
    Side { cq, qp, engine, events: Vec::new(), frozen: false }
}

impl Pair {
    fn new(seed: u64, cfg: Config) -> Pair {
        let fabric = Fabric::new(seed, LinkModel::default());
        let (da, db) =
            (fabric.add_device(NicConfig::default()), fabric.add_device(NicConfig::default()));
        let (pa, pb) = (da.alloc_pd().expect("pd"), db.alloc_pd().expect("pd"));
        let regs =
            vec![Arc::new(da.registrar(&pa)) as Arc<_>, Arc::new(db.registrar(&pb)) as Arc<_>];
        let pool = Pool::new(regs).expect("pool").leak();
        let cfg = Arc::new(cfg);
        let (mut a, mut b) = (
            side(&da, &pa, pool, 0, &cfg, fabric.now()),
            side(&db, &pb, pool, 1, &cfg, fabric.now()),
        );
        let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
        for (s, peer) in [(&mut a, eb), (&mut b, ea)] {
            s.qp.to_rtr(&RtrAttrs { remote: peer, path_mtu: cfg.path_mtu, min_rnr_timer: 12 })
                .expect("rtr");
            s.qp.to_rts(&RtsAttrs {
                sq_psn: s.qp.endpoint().psn,
                timeout: cfg.qp_timeout,
                retry_cnt: cfg.qp_retry_cnt,
                rnr_retry: cfg.qp_rnr_retry,
            })
            .expect("rts");
        }
        Pair { fabric, pool, a, b }
    }

    /// Steps until `done` or `limit` of virtual time; the clock stops at engine timers.
    fn run(&mut self, limit: Duration, mut done: impl FnMut(&Pair) -> bool) -> bool {
        let end = self.fabric.now() + limit;
        while !done(self) {
            let now = self.fabric.now();
            if now > end {
                return false;
            }
            self.a.drive(now);
            self.b.drive(now);
            let horizon = [&self.a, &self.b]
                .iter()
                .filter(|s| !s.frozen)
                .filter_map(|s| s.engine.poll_timeout())
                .min();
            if !self.fabric.step_within(horizon) && horizon.is_none() {
                return done(self);
            }
        }
        true
    }

    /// Opens a socket from a; returns (a's id, b's id).
    fn open(&mut self) -> (u32, u32) {
        self.open_as(7)
    }

    /// Opens socket `id` from a; returns (a's id, b's id).
    fn open_as(&mut self, id: u32) -> (u32, u32) {
        let accepted_before = self.b.events.iter().filter(|e| matches!(e, Event::Accepted { .. }));
        let accepted_before = accepted_before.count();
        self.a.engine.open_socket(id);
        self.a.settle();
        let ok = self.run(Duration::from_millis(50), |p| {
            let opened = |e: &Event<u64>| matches!(e, Event::Opened { socket, result: Ok(()) } if *socket == id);
            p.a.events.iter().any(opened)
        });
        assert!(ok, "open answered: {:?}", self.a.events);
        let mut peer = self.b.events.iter().filter_map(|e| match e {
            Event::Accepted { socket } => Some(*socket),
            _ => None,
        });
        (id, peer.nth(accepted_before).expect("b accepted"))
    }

    /// Sends header `h` (its kind byte replaced by `kind`) and `payload` bytes straight from
    /// a's QP, bypassing a's engine (freeze a first); the buffer must live until sent.
    /// `None` once a's QP refuses the post.
    fn send_raw(
        &mut self,
        wr_id: u64,
        h: &crate::proto::Header,
        kind: u8,
        payload: usize,
    ) -> Option<Msg> {
        use bex_rnic::verbs::{SendOp, SendWr, SgList};
        let mut m = self.msg(crate::proto::HEADER_LEN + payload, wr_id as u8);
        h.encode(m.as_mut_slice());
        m.as_mut_slice()[1] = kind;
        let sge = m.sge(0, 0, m.len());
        let wr = SendWr { wr_id, op: SendOp::Send, sg_list: SgList::one(sge), signaled: true };
        // The frozen side's CQ is drained by hand: its engine must not see these.
        let mut wcs = [WorkCompletion::default(); 32];
        while self.a.cq.poll(&mut wcs).expect("poll") > 0 {}
        self.a.qp.post_send(&[wr]).ok().map(|()| m)
    }

    fn msg(&self, len: usize, seed: u8) -> Msg {
        let mut m = Msg::alloc(self.pool, len).expect("alloc");
        for (i, b) in m.as_mut_slice().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        m
    }
}

fn intact(m: &Msg, len: usize, seed: u8) -> bool {
    m.len() == len
        && m.as_slice()
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i as u8).wrapping_mul(31).wrapping_add(seed))
}

#[test]
fn eager_and_large_messages_arrive_intact_in_order_and_report_their_sends() {
    let mut p = Pair::new(1, Config::default());
    let (sa, sb) = p.open();
    // Around the eager limit, several large ones queued back to back (RTS ahead), a 0-byte.
    let sizes = [0usize, 1, 8192, 8193, 300_000, 64, 1 << 20, 2 << 20, 5];
    for (i, &len) in sizes.iter().enumerate() {
        let m = p.msg(len, i as u8);
        p.a.engine.enqueue(sa, m.into(), None, i as u64);
    }
    p.a.settle();
    let n = sizes.len();
    assert!(p.run(Duration::from_secs(2), |p| p.b.received(sb).len() == n));
    for (i, (m, &len)) in p.b.received(sb).iter().zip(&sizes).enumerate() {
        assert!(intact(m, len, i as u8), "message {i} ({len} B)");
    }
    assert!(p.run(Duration::from_secs(1), |p| (0..n as u64).all(|t| p.a.sent(t).is_some())));
    for t in 0..n as u64 {
        assert!(matches!(p.a.sent(t), Some(Ok(()))), "send {t}: {:?}", p.a.sent(t));
    }
}

#[test]
fn one_shared_buffer_goes_out_many_times_and_is_freed_after_the_last() {
    let mut p = Pair::new(2, Config::default());
    let (sa, sb) = p.open();
    for len in [100usize, 100_000] {
        let shared = SharedMsg::new(p.msg(len, 9));
        let before = p.b.received(sb).len();
        for t in 0..5 {
            p.a.engine.enqueue(sa, (&shared).into(), None, t);
        }
        p.a.settle();
        assert!(shared.holders() > 1, "the sends hold the buffer");
        assert!(p.run(Duration::from_secs(1), |p| p.b.received(sb).len() == before + 5));
        assert!(p.b.received(sb)[before..].iter().all(|m| intact(m, len, 9)));
        assert!(p.run(Duration::from_secs(1), |_| shared.holders() == 1), "released at the end");
        p.a.events.clear();
    }
}

/// Faults on every packet: loss, duplicates, corruption and reordering.
const LOSSY: FaultRates = FaultRates { drop: 0.02, duplicate: 0.02, corrupt: 0.01, reorder: 0.02 };

/// A run under [`LOSSY`] that met none of its faults proved nothing.
fn assert_faults_fired(p: &Pair) {
    let st = p.fabric.stats();
    assert!(st.dropped > 0 && st.duplicated > 0 && st.reordered > 0, "{st:?}");
}

#[test]
fn messages_survive_loss_duplication_and_reordering() {
    let mut p = Pair::new(3, Config::default());
    let (sa, sb) = p.open();
    p.fabric.with_faults(|f| f.set_rates(LOSSY));
    let sizes: Vec<usize> = (0..60).map(|i| [10, 5000, 40_000][i % 3]).collect();
    for (i, &len) in sizes.iter().enumerate() {
        let m = p.msg(len, i as u8);
        p.a.engine.enqueue(sa, m.into(), None, i as u64);
    }
    p.a.settle();
    assert!(p.run(Duration::from_secs(10), |p| p.b.received(sb).len() == sizes.len()));
    for (i, (m, &len)) in p.b.received(sb).iter().zip(&sizes).enumerate() {
        assert!(intact(m, len, i as u8), "message {i}");
    }
    assert_faults_fired(&p);
}

#[test]
fn a_silent_peer_fails_the_engine_by_keepalive_and_every_socket_and_send_learns_it() {
    let cfg = Config {
        keepalive_interval: Duration::from_millis(10),
        keepalive_timeout: Duration::from_millis(50),
        ..Config::default()
    };
    let mut p = Pair::new(4, cfg);
    let (sa, _) = p.open();
    p.b.frozen = true;
    // Queued behind a large message that can never get its CTS.
    p.a.engine.enqueue(sa, p.msg(100_000, 1).into(), None, 1);
    p.a.engine.enqueue(sa, p.msg(10, 2).into(), None, 2);
    p.a.settle();
    let t0 = p.fabric.now();
    assert!(p.run(Duration::from_secs(1), |p| p.a.engine.is_failed()));
    let took = p.fabric.now() - t0;
    assert!(took >= Duration::from_millis(40) && took <= Duration::from_millis(70), "{took:?}");
    assert!(matches!(p.a.sent(1), Some(Err(TransportError::ConnectionLost(_)))));
    assert!(matches!(p.a.sent(2), Some(Err(TransportError::ConnectionLost(_)))));
    assert!(p.a.events.iter().any(|e| matches!(e, Event::Ended { socket, .. } if *socket == sa)));
    // Nothing goes out of a failed engine, and new sends fail at once.
    assert!(p.a.engine.poll_post().is_none());
    p.a.engine.enqueue(sa, p.msg(10, 3).into(), None, 3);
    p.a.settle();
    assert!(matches!(p.a.sent(3), Some(Err(TransportError::ConnectionLost(_)))));
}

#[test]
fn a_closed_socket_refuses_sends_and_the_peer_learns_it() {
    let mut p = Pair::new(5, Config::default());
    let (sa, sb) = p.open();
    p.b.engine.close_socket(sb);
    p.b.settle();
    assert!(p.run(Duration::from_millis(50), |p| {
        p.a.events.iter().any(|e| matches!(e, Event::Ended { socket, error: TransportError::Closed } if *socket == sa))
    }));
    p.a.engine.enqueue(sa, p.msg(10, 1).into(), None, 1);
    p.a.settle();
    assert!(matches!(p.a.sent(1), Some(Err(TransportError::Closed))));
    // A message larger than a remote target is the caller's error, refused without a post.
    let t = crate::engine::RemoteTarget { addr: 0, rkey: 0, slot: 1, len: 4 };
    p.a.engine.enqueue(sa, p.msg(5, 1).into(), Some(t), 2);
    p.a.settle();
    assert!(matches!(p.a.sent(2), Some(Err(TransportError::Invalid(_)))));
}

/// A socket closed by its opener before the peer's OpenAck arrived (a caller's deadline):
/// the end the peer opened for it ends too, instead of staying open and served for good.
#[test]
fn a_socket_closed_while_opening_ends_the_peers_end_too() {
    let mut p = Pair::new(6, Config::default());
    p.a.engine.open_socket(9);
    p.a.engine.close_socket(9);
    p.a.settle();
    let ended = p.run(Duration::from_millis(100), |p| {
        let accepted = p.b.events.iter().find_map(|e| match e {
            Event::Accepted { socket } => Some(*socket),
            _ => None,
        });
        accepted.is_some_and(|sb| {
            p.b.events.iter().any(|e| matches!(e, Event::Ended { socket, .. } if *socket == sb))
        })
    });
    assert!(ended, "b's end of the abandoned socket ended: {:?}", p.b.events);
    assert_eq!(p.a.engine.counters.malformed.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// a sends each size to b and b answers each with a 10-byte reply; returns the messages b
/// received, in order.
fn exchange(p: &mut Pair, sa: u32, sb: u32, sizes: &[usize]) {
    for (i, &len) in sizes.iter().enumerate() {
        let before = p.b.received(sb).len();
        p.a.engine.enqueue(sa, p.msg(len, i as u8).into(), None, 1000 + i as u64);
        p.a.settle();
        assert!(p.run(Duration::from_secs(2), |p| p.b.received(sb).len() == before + 1));
        assert!(intact(p.b.received(sb)[before], len, i as u8), "request {i} ({len} B)");
        let replies = p.a.received(sa).len();
        p.b.engine.enqueue(sb, p.msg(10, 0).into(), None, 2000 + i as u64);
        p.b.settle();
        assert!(p.run(Duration::from_secs(2), |p| p.a.received(sa).len() == replies + 1));
    }
}

#[test]
fn large_requests_answered_by_small_replies_take_standing_grants_instead_of_rts() {
    let mut p = Pair::new(6, Config::default());
    let (sa, sb) = p.open();
    // 100 kB then smaller and equal ones fit the 128 KiB grant the first one earned; 200 kB
    // does not: it goes by RTS, gives the grant back and earns a 256 KiB one, which the last
    // two use.
    exchange(&mut p, sa, sb, &[100_000, 90_000, 100_000, 200_000, 150_000, 200_000]);
    let c = p.a.engine.counters.snapshot();
    assert_eq!(c.large_messages, 2, "RTS only for the first and the one that grew: {c:?}");
    assert_eq!(c.granted_messages, 4, "{c:?}");
    let cb = p.b.engine.counters.snapshot();
    assert_eq!(cb.grants_offered, 6, "one per large request: {cb:?}");
    assert_eq!(cb.malformed, 0);
    // b holds exactly the one grant a has not used yet, of the size the last request earned.
    assert_eq!(p.b.engine.large_in.len(), 1);
    assert!(p.b.engine.large_in.buffers().all(|l| l.buf.len() >= 256 * 1024));
    // a's close frees it: a writes nothing after its Close.
    p.a.engine.close_socket(sa);
    p.a.settle();
    assert!(p.run(Duration::from_millis(50), |p| p.b.engine.large_in.is_empty()));
}

#[test]
fn standing_grants_survive_loss_duplication_and_reordering() {
    let mut p = Pair::new(7, Config::default());
    let (sa, sb) = p.open();
    p.fabric.with_faults(|f| f.set_rates(LOSSY));
    let sizes: Vec<usize> = (0..30).map(|i| [20_000, 70_000, 9_000][i % 3]).collect();
    exchange(&mut p, sa, sb, &sizes);
    // Offers never shrink: after the second message (70 kB) the 128 KiB grant fits all.
    let c = p.a.engine.counters.snapshot();
    assert_eq!((c.large_messages, c.granted_messages), (2, 28), "{c:?}");
    assert_faults_fired(&p);
}

#[test]
fn without_grants_every_large_message_pays_rts() {
    let mut p = Pair::new(8, Config { grant_max_bytes: 0, ..Config::default() });
    let (sa, sb) = p.open();
    exchange(&mut p, sa, sb, &[100_000, 100_000, 100_000]);
    let c = p.a.engine.counters.snapshot();
    assert_eq!((c.large_messages, c.granted_messages), (3, 0), "{c:?}");
    assert_eq!(p.b.engine.counters.snapshot().grants_offered, 0);
}

#[test]
fn a_grant_written_with_a_false_length_is_dropped_and_counted() {
    let mut p = Pair::new(9, Config::default());
    let (sa, sb) = p.open();
    exchange(&mut p, sa, sb, &[50_000]);
    let grant = p.a.engine.sockets.get_mut(&sa).and_then(|s| s.grant.take()).expect("a grant");
    // A peer that writes the grant itself, naming more bytes than it holds.
    let mut m = p.msg(1000, 1);
    m.as_mut_slice()[..8].copy_from_slice(&(grant.len * 2).to_le_bytes());
    let before = p.b.received(sb).len();
    p.a.engine.enqueue(sa, m.into(), Some(grant), 77);
    p.a.settle();
    assert!(p.run(Duration::from_secs(1), |p| p.b.engine.counters.snapshot().malformed == 1));
    assert_eq!(p.b.received(sb).len(), before, "nothing delivered");
    assert!(p.b.engine.large_in.is_empty(), "the grant is used up");
    // The socket still works, and the next large message earns a grant again.
    exchange(&mut p, sa, sb, &[50_000, 50_000]);
}

#[test]
fn large_messages_both_ways_renew_grants_in_their_prefixes_and_skip_rts() {
    // A ping-pong of 50 kB messages (a large reply to each large request): each side's
    // offer rides in the prefix of the message it writes into the other's grant.
    let mut p = Pair::new(10, Config::default());
    let (sa, sb) = p.open();
    for i in 0..10u8 {
        let before = (p.a.received(sa).len(), p.b.received(sb).len());
        p.a.engine.enqueue(sa, p.msg(50_000, i).into(), None, u64::from(i));
        p.a.settle();
        assert!(p.run(Duration::from_secs(1), |p| p.b.received(sb).len() == before.1 + 1));
        p.b.engine.enqueue(sb, p.msg(50_000, i + 100).into(), None, u64::from(i));
        p.b.settle();
        assert!(p.run(Duration::from_secs(1), |p| p.a.received(sa).len() == before.0 + 1));
        assert!(intact(p.b.received(sb)[before.1], 50_000, i));
        assert!(intact(p.a.received(sa)[before.0], 50_000, i + 100));
    }
    let (ca, cb) = (p.a.engine.counters.snapshot(), p.b.engine.counters.snapshot());
    // a's first request and b's first reply pay RTS; everything after rides on grants.
    assert_eq!((ca.large_messages, ca.granted_messages), (1, 9), "{ca:?}");
    assert_eq!((cb.large_messages, cb.granted_messages), (1, 9), "{cb:?}");
    assert_eq!(ca.malformed + cb.malformed, 0);
}

/// Announced messages (RTS) beyond the engine's budget of `max_message_bytes` wait for their
/// CTS until earlier ones are written, in order, and every one arrives: a well-behaved peer is
/// slowed, not failed.
/// The budget of announced bytes of [`budgeted`] pairs.
const BUDGET: u64 = 1 << 20;

/// A pair whose engines hold at most [`BUDGET`] bytes for announced messages, without
/// standing grants (so every large message announces itself by RTS).
fn budgeted(seed: u64) -> Pair {
    Pair::new(seed, Config { max_message_bytes: BUDGET, grant_max_bytes: 0, ..Config::default() })
}

#[test]
fn rts_beyond_the_budget_wait_for_their_cts_and_every_message_arrives() {
    let budget = BUDGET;
    let mut p = budgeted(12);
    let (sa, sb) = p.open();
    let sizes = [1usize << 20, 700_000, 700_000, 1 << 20, 300_000, 200_000];
    for (i, &len) in sizes.iter().enumerate() {
        let m = p.msg(len, i as u8);
        p.a.engine.enqueue(sa, m.into(), None, i as u64);
    }
    p.a.settle();
    let mut most_held = 0;
    let n = sizes.len();
    assert!(
        p.run(Duration::from_secs(5), |p| {
            most_held = most_held.max(p.b.engine.rts_held());
            p.b.received(sb).len() == n
        }),
        "received {}, waiting {:?}",
        p.b.received(sb).len(),
        p.b.engine.rts_waiting
    );
    for (i, (m, &len)) in p.b.received(sb).iter().zip(&sizes).enumerate() {
        assert!(intact(m, len, i as u8), "message {i} ({len} B)");
    }
    assert!(p.run(Duration::from_secs(1), |p| (0..n as u64).all(|t| p.a.sent(t).is_some())));
    assert!((0..n as u64).all(|t| matches!(p.a.sent(t), Some(Ok(())))), "{:?}", p.a.events);
    assert!(most_held <= budget, "held {most_held} B for announced messages");
    assert!(p.b.engine.counters.snapshot().rts_deferred > 0);
    assert_eq!(p.b.engine.rts_held(), 0);
}

/// A peer that announces messages and never writes them makes this side hold at most the
/// budget; each of its RTSs allocated its whole message before, so a few 1 GiB RTSs drained
/// the pool for every engine.
#[test]
fn a_peer_that_announces_and_never_writes_holds_at_most_the_budget() {
    let budget = BUDGET;
    let mut p = budgeted(13);
    let (sa, _) = p.open();
    let (sa2, _) = {
        // A second socket: RTSs of several sockets share the engine's budget.
        p.a.engine.open_socket(8);
        p.a.settle();
        assert!(p.run(Duration::from_millis(50), |p| p
            .a
            .events
            .iter()
            .any(|e| matches!(e, Event::Opened { socket: 8, result: Ok(()) }))));
        (8, ())
    };
    for (t, s) in [(0, sa), (1, sa), (2, sa), (3, sa2), (4, sa2)] {
        let m = p.msg(1 << 20, t as u8);
        p.a.engine.enqueue(s, m.into(), None, t);
    }
    p.a.settle();
    // a's RTSs are out; from now on its engine does nothing (its NIC still ACKs).
    p.a.frozen = true;
    p.run(Duration::from_millis(200), |_| false);
    assert_eq!(p.b.engine.rts_held(), budget, "one announced message's buffer");
    assert_eq!(p.b.engine.rts_waiting.len(), 4);
    // Once a writes, every message arrives.
    p.a.frozen = false;
    assert!(
        p.run(Duration::from_secs(5), |p| p.b.engine.counters.snapshot().messages_received == 5)
    );
    assert!(p.b.engine.rts_waiting.is_empty());
}

/// One frame a hostile peer sends: a header of any kind byte (valid or not) with chosen
/// fields, and a payload whose length may or may not match what the header says.
#[derive(Clone, Debug)]
struct HostileFrame {
    kind: u8,
    credits: u16,
    dst_socket: u32,
    src_socket: u32,
    msg_id: u32,
    len: u64,
    aux: u64,
    aux32: u32,
    slot: u32,
    payload: usize,
    honest_len: bool,
}

fn hostile_frame() -> impl proptest::strategy::Strategy<Value = HostileFrame> {
    use proptest::prelude::*;
    // b's socket ids start at 200: aim at them, and at ids it never gave out.
    let socket = prop_oneof![Just(200u32), 198u32..204, any::<u32>()];
    let len = prop_oneof![0u64..20_000, any::<u64>()];
    let slot = prop_oneof![0u32..4, Just(u32::MAX), any::<u32>()];
    (
        (1u8..12, any::<u16>(), socket.clone(), socket, 0u32..8, len),
        (any::<u64>(), any::<u32>(), slot, 0usize..300, any::<bool>()),
    )
        .prop_map(|((kind, credits, dst_socket, src_socket, msg_id, len), rest)| {
            let (aux, aux32, slot, payload, honest_len) = rest;
            HostileFrame {
                kind,
                credits,
                dst_socket,
                src_socket,
                msg_id,
                len,
                aux,
                aux32,
                slot,
                payload,
                honest_len,
            }
        })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// A peer that sends arbitrary engine headers straight from its QP (the engine over it is
    /// bypassed): the receiving engine never panics, its debug assertions hold, it delivers
    /// only to sockets it accepted, and it stays within its budget of announced bytes.
    #[test]
    fn hostile_header_sequences_never_panic_and_deliver_only_to_accepted_sockets(
        frames in proptest::collection::vec(hostile_frame(), 1..40),
        seed in 0u64..1000,
    ) {
        use crate::proto::{Header, Kind};
        let mut p = Pair::new(seed, Config { max_message_bytes: 1 << 20, ..Config::default() });
        let _ = p.open();
        p.a.frozen = true;
        let mut keep = Vec::new();
        for (k, f) in frames.iter().enumerate() {
            let mut h = Header::new(Kind::Data);
            h.credits = f.credits;
            h.dst_socket = f.dst_socket;
            h.src_socket = f.src_socket;
            h.msg_id = f.msg_id;
            h.len = if f.honest_len { f.payload as u64 } else { f.len };
            h.aux = f.aux;
            h.aux32 = f.aux32;
            h.slot = f.slot;
            let Some(m) = p.send_raw(k as u64, &h, f.kind, f.payload) else {
                break; // its QP failed (b's NIC refused something): the rest cannot go
            };
            keep.push(m);
            p.run(Duration::from_millis(2), |_| false);
        }
        p.run(Duration::from_millis(100), |_| false);
        let accepted: Vec<u32> = p.b.events.iter().filter_map(|e| match e {
            Event::Accepted { socket } => Some(*socket),
            _ => None,
        }).collect();
        for e in &p.b.events {
            if let Event::Received { socket, .. } = e {
                proptest::prop_assert!(accepted.contains(socket), "delivered to {socket}, accepted {accepted:?}");
            }
        }
        proptest::prop_assert!(p.b.engine.rts_held() <= 1 << 20);
    }
}

/// RTSs announcing no more than `eager_max` (a peer sends those eagerly) are refused and
/// counted: each held a buffer while adding (next to) nothing to the budget's count, so a
/// stream of 1-byte RTSs never written could drain the pool past any byte budget.
#[test]
fn rts_small_enough_to_go_eagerly_are_refused_and_hold_nothing() {
    use crate::proto::{Header, Kind};
    let mut p = budgeted(14);
    let (_, sb) = p.open();
    p.a.frozen = true;
    let mut keep = Vec::new();
    for (k, len) in [0u64, 1, 8192, 8193].into_iter().enumerate() {
        let mut h = Header::new(Kind::Rts);
        h.dst_socket = sb;
        h.src_socket = 7;
        h.msg_id = k as u32 + 1;
        h.len = len;
        keep.push(p.send_raw(k as u64, &h, Kind::Rts as u8, 0).expect("posted"));
        p.run(Duration::from_millis(2), |_| false);
    }
    p.run(Duration::from_millis(20), |_| false);
    assert_eq!(p.b.engine.counters.snapshot().malformed, 3, "0, 1 and 8192 bytes");
    assert_eq!(p.b.engine.rts_held(), 8193, "only the one too large to go eagerly");
}
