//! Transport behaviour on the in-memory fabric with virtual time: exact and seeded (`BEX_SEED`
//! replays another seed; a failing test prints its replay line).

mod common;

use std::time::Duration;

use bex_rnic::soft::LinkModel;
use bex_testkit::seed::Replay;
use bex_transport::sim::{SendTicket, SimNet, SimSocket};
use bex_transport::{Config, Msg, TransportError};
use common::{check, pattern};

/// The test's seed (`BEX_SEED`, else `default`), printing its replay line on a failure.
fn seed(default: u64, test: &str) -> Replay {
    Replay::seed(default, format!("cargo test -p bex-transport --test sim {test}"))
}

fn net_pair(
    seed: u64,
    link: LinkModel,
    cfg_a: Config,
    cfg_b: Config,
) -> (SimNet, usize, usize, u32) {
    let mut net = SimNet::new(seed, link);
    let a = net.add_node(cfg_a).unwrap();
    let b = net.add_node(cfg_b).unwrap();
    let e = net.connect(a, b).unwrap();
    (net, a, b, e)
}

fn open_pair(net: &mut SimNet, a: usize, b: usize, e: u32) -> (SimSocket, SimSocket) {
    let s = net.open(a, e, Duration::from_millis(10)).unwrap();
    let r = net.accept(b).expect("peer accepted");
    (s, r)
}

fn wait_all(net: &mut SimNet, tickets: &mut Vec<SendTicket>, limit: Duration) {
    let ok = net.run_until(
        |_| {
            tickets.retain_mut(|t| match t.poll() {
                None => true,
                Some(r) => {
                    r.expect("send succeeds");
                    false
                }
            });
            tickets.is_empty()
        },
        limit,
    );
    assert!(ok, "sends did not complete");
}

#[test]
fn credits_prevent_rnr_under_a_flood() {
    let run = seed(1, "credits_prevent_rnr_under_a_flood");
    let cfg = Config { rq_depth: 8, sq_depth: 32, ..Config::default() };
    let (mut net, a, b, e) = net_pair(run.seed, LinkModel::default(), cfg.clone(), cfg);
    let mut pairs: Vec<_> = (0..4).map(|_| open_pair(&mut net, a, b, e)).collect();
    let pool = net.pool(a);
    let n = 500u64;
    let mut tickets = Vec::new();
    for k in 0..n {
        for (i, (s, _)) in pairs.iter().enumerate() {
            let seed = (i as u64) << 32 | k;
            tickets.push(net.send(s, pattern(pool, 100 + (k as usize % 3000), seed)));
        }
    }
    let mut got = vec![0u64; pairs.len()];
    let done = net.run_until(
        |_| {
            for (i, (_, r)) in pairs.iter_mut().enumerate() {
                while let Some(m) = r.try_recv() {
                    let m = m.unwrap();
                    let seed = (i as u64) << 32 | got[i];
                    check(&m, 100 + (got[i] as usize % 3000), seed);
                    got[i] += 1;
                }
            }
            got.iter().all(|g| *g == n)
        },
        Duration::from_secs(10),
    );
    assert!(done, "received {got:?}");
    wait_all(&mut net, &mut tickets, Duration::from_secs(1));
    let (da, db) = (net.device(a).counters(), net.device(b).counters());
    assert_eq!(db.rnr_naks_sent, 0, "credits make RNR impossible: {db:?}");
    assert_eq!(da.rnr_naks_received, 0);
    let c = net.counters(a);
    assert!(c.credit_stalls > 0, "the flood really ran out of credits: {c:?}");
    // b sends no data, so nothing carries its credits back but credit messages.
    let cb = net.counters(b);
    assert!(cb.credit_messages > 0, "the receiver returned credits by message: {cb:?}");
    // Neither side ever returned more credits than the other's depth (refused as malformed).
    assert_eq!((c.malformed, cb.malformed), (0, 0));
}

fn window_run(seed: u64, cwnd: Option<u64>) -> u64 {
    let cfg =
        Config { cwnd_bytes: cwnd, fragment_bytes: 4096, eager_max: 4096, ..Config::default() };
    let link = LinkModel { bytes_per_sec: Some(25_000_000_000 / 8), ..LinkModel::default() };
    let (mut net, a, b, e) = net_pair(seed, link, cfg.clone(), cfg);
    let pairs: Vec<_> = (0..4).map(|_| open_pair(&mut net, a, b, e)).collect();
    let pool = net.pool(a);
    let mut tickets = Vec::new();
    for (s, _) in &pairs {
        for k in 0..8 {
            tickets.push(net.send(s, pattern(pool, 256 * 1024, k)));
        }
    }
    wait_all(&mut net, &mut tickets, Duration::from_secs(10));
    net.counters(a).window_high_water
}

#[test]
fn the_send_window_bounds_outstanding_bytes() {
    let run = seed(2, "the_send_window_bounds_outstanding_bytes");
    let bounded = window_run(run.seed, Some(16 * 1024));
    assert!(bounded <= 16 * 1024, "outstanding {bounded} > cwnd");
    assert!(bounded >= 8 * 1024, "the window was used: {bounded}");
    let unbounded = window_run(run.seed, None);
    assert!(unbounded > 64 * 1024, "without a window the chain fills: {unbounded}");
}

#[test]
fn keepalive_fails_the_engine_of_a_hung_peer_on_time() {
    let run = seed(3, "keepalive_fails_the_engine_of_a_hung_peer_on_time");
    let cfg = Config {
        keepalive_interval: Duration::from_millis(10),
        keepalive_timeout: Duration::from_millis(50),
        ..Config::default()
    };
    let (mut net, a, b, e) = net_pair(run.seed, LinkModel::default(), cfg.clone(), cfg);
    let (mut s1, _r1) = open_pair(&mut net, a, b, e);
    let (mut s2, _r2) = open_pair(&mut net, a, b, e);
    // Healthy for a while: keepalives keep it alive far beyond the timeout.
    net.run_until(|_| false, Duration::from_millis(200));
    assert!(s1.try_recv().is_none());
    net.freeze(b);
    let t0 = net.now();
    let mut errs = 0;
    let ok = net.run_until(
        |_| {
            for s in [&mut s1, &mut s2] {
                if let Some(Err(TransportError::ConnectionLost(why))) = s.try_recv() {
                    assert!(why.contains("keepalive"), "{why}");
                    errs += 1;
                }
            }
            errs == 2
        },
        Duration::from_secs(1),
    );
    assert!(ok, "both sockets learn of the failure");
    let took = net.now() - t0;
    assert!(
        took >= Duration::from_millis(40) && took <= Duration::from_millis(70),
        "took {took:?}"
    );
    assert_eq!(net.counters(a).keepalive_failures, 1);
}

#[test]
fn a_qp_error_reaches_every_socket_of_the_engine() {
    let run = seed(4, "a_qp_error_reaches_every_socket_of_the_engine");
    let (mut net, a, b, e) =
        net_pair(run.seed, LinkModel::default(), Config::default(), Config::default());
    let mut socks: Vec<_> = (0..3).map(|_| open_pair(&mut net, a, b, e)).collect();
    let pool = net.pool(a);
    let mut pending = net.send(&socks[1].0, pattern(pool, 1 << 20, 1));
    net.fail_engine(&socks[0].0, "injected QP error");
    let mut lost = 0;
    let mut send_failed = false;
    let ok = net.run_until(
        |_| {
            for (s, _) in socks.iter_mut() {
                if let Some(Err(TransportError::ConnectionLost(_))) = s.try_recv() {
                    lost += 1;
                }
            }
            if let Some(r) = pending.poll() {
                send_failed = r.is_err();
            }
            lost == 3
        },
        Duration::from_millis(100),
    );
    assert!(ok, "every socket got the error ({lost})");
    net.run_until(|_| false, Duration::from_millis(1));
    assert!(send_failed || pending.poll().is_some_and(|r| r.is_err()), "the in-flight send failed");
    // The peer side fails too (its QP is flushed by the error / keepalive).
    let mut peer_lost = 0;
    net.run_until(
        |_| {
            for (_, r) in socks.iter_mut() {
                if let Some(Err(_)) = r.try_recv() {
                    peer_lost += 1;
                }
            }
            peer_lost == 3
        },
        Duration::from_secs(3),
    );
    assert_eq!(peer_lost, 3, "the peer's sockets fail as well");
    let _ = Msg::copy_from;
}

/// One small flow and `large` large flows share one engine over a 25 Gb/s link; returns the
/// small messages' latencies (virtual µs).
fn small_flow_latency(seed: u64, large: usize, fragment: usize) -> Vec<f64> {
    let cfg = Config { fragment_bytes: fragment, eager_max: 4096, ..Config::default() };
    let link = LinkModel { bytes_per_sec: Some(25_000_000_000 / 8), ..LinkModel::default() };
    let (mut net, a, b, e) = net_pair(seed, link, cfg.clone(), cfg);
    let (small, mut small_rx) = open_pair(&mut net, a, b, e);
    let bigs: Vec<_> = (0..large).map(|_| open_pair(&mut net, a, b, e)).collect();
    let pool = net.pool(a);
    // Each large flow keeps 4 messages queued for the whole measurement: a sent one is
    // replaced as soon as the NIC is done with it.
    let mut tickets: Vec<Vec<_>> = bigs
        .iter()
        .map(|(s, _)| (0..4).map(|k| net.send(s, pattern(pool, 1 << 20, k))).collect())
        .collect();
    let mut lat = Vec::new();
    for k in 0..20u64 {
        // Let the large flows get going, then time one small message.
        net.run_until(|_| false, Duration::from_micros(100));
        for ((s, _), flow) in bigs.iter().zip(tickets.iter_mut()) {
            flow.retain_mut(|t| t.poll().is_none());
            while flow.len() < 4 {
                flow.push(net.send(s, pattern(pool, 1 << 20, k)));
            }
        }
        let t0 = net.now();
        let _t = net.send(&small, pattern(pool, 64, k));
        let ok = net.run_until(|_| small_rx.try_recv().is_some(), Duration::from_secs(1));
        assert!(ok);
        lat.push((net.now() - t0).as_secs_f64() * 1e6);
    }
    drop(tickets);
    lat
}

fn p(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * q) as usize]
}

#[test]
fn fragmentation_bounds_small_message_latency_under_large_flows() {
    let run = seed(5, "fragmentation_bounds_small_message_latency_under_large_flows");
    let alone = small_flow_latency(run.seed, 0, 4096);
    let frag = small_flow_latency(run.seed, 4, 4096);
    let whole = small_flow_latency(run.seed, 4, 8 << 20);
    let (a50, f99, w99) = (p(&alone, 0.5), p(&frag, 0.99), p(&whole, 0.99));
    eprintln!("small-flow latency µs: alone p50 {a50:.1}, 4 large flows with 4 KiB fragments p99 {f99:.1}, without fragmentation p99 {w99:.1}");
    // With 4 KiB fragments at most a chain of fragments (32 × 4 KiB ≈ 42 µs at 25 Gb/s)
    // stands in front of the small message; without, whole 1 MiB messages (≈ 335 µs each).
    assert!(f99 < 120.0, "fragmented p99 {f99} µs");
    assert!(w99 > 3.0 * f99, "fragmentation helps: {w99} vs {f99}");
    assert!(a50 < 20.0, "alone {a50}");
}

/// SRQ mode: two peers flood one receiver whose engines share a small SRQ. Without credits
/// the receiver runs out and answers RNR; RNR retry (infinite) delivers everything anyway —
/// the paper's trade of per-peer accounting for shared buffers.
#[test]
fn srq_mode_shares_receives_and_recovers_exhaustion_by_rnr_retry() {
    let run = seed(6, "srq_mode_shares_receives_and_recovers_exhaustion_by_rnr_retry");
    let mut net = SimNet::new(run.seed, LinkModel::default());
    let rx_cfg = Config { srq: true, srq_depth: 16, ..Config::default() };
    let b = net.add_node(rx_cfg).unwrap();
    let senders: Vec<usize> = (0..2).map(|_| net.add_node(Config::default()).unwrap()).collect();
    let mut pairs = Vec::new();
    for &a in &senders {
        let e = net.connect(a, b).unwrap();
        pairs.push(open_pair(&mut net, a, b, e));
    }
    let n = 300u64;
    let mut tickets = Vec::new();
    for k in 0..n {
        for (i, (s, _)) in pairs.iter().enumerate() {
            let pool = net.pool(senders[i]);
            tickets.push(net.send(s, pattern(pool, 512, (i as u64) << 32 | k)));
        }
    }
    let mut got = vec![0u64; pairs.len()];
    let done = net.run_until(
        |_| {
            for (i, (_, r)) in pairs.iter_mut().enumerate() {
                while let Some(m) = r.try_recv() {
                    check(&m.unwrap(), 512, (i as u64) << 32 | got[i]);
                    got[i] += 1;
                }
            }
            got.iter().all(|g| *g == n)
        },
        Duration::from_secs(30),
    );
    assert!(done, "received {got:?}");
    wait_all(&mut net, &mut tickets, Duration::from_secs(1));
    let rnr = net.device(b).counters().rnr_naks_sent;
    assert!(rnr > 0, "a 16-deep SRQ under two floods runs dry");
    assert_eq!(net.counters(senders[0]).credit_stalls, 0, "no credits towards an SRQ peer");
}

/// SRQ mode: engines that fail mid-flood give back every receive of the shared ring they
/// held — those their completions brought after the failure, and a recycled batch they had
/// not handed out yet — so the ring keeps all its receives and a later peer is served. They
/// were lost to every engine of the endpoint before, a few per failure, until the SRQ ran dry.
#[test]
fn failed_engines_give_their_shared_receives_back() {
    let run = seed(7, "failed_engines_give_their_shared_receives_back");
    let depth = 16;
    let mut net = SimNet::new(run.seed, LinkModel::default());
    let b = net.add_node(Config { srq: true, srq_depth: depth, ..Config::default() }).unwrap();
    for round in 0..4u64 {
        let a = net.add_node(Config::default()).unwrap();
        let e = net.connect(a, b).unwrap();
        let (s, mut r) = open_pair(&mut net, a, b, e);
        let pool = net.pool(a);
        let _tickets: Vec<SendTicket> =
            (0..200).map(|k| net.send(&s, pattern(pool, 512, round << 32 | k))).collect();
        let mut got = 0;
        assert!(net.run_until(
            |_| {
                while let Some(m) = r.try_recv() {
                    m.unwrap();
                    got += 1;
                }
                got >= 40
            },
            Duration::from_secs(5)
        ));
        // Mid-flood, b stalls: its NIC goes on filling the SRQ's receives, whose completions
        // wait in the CQ; the engine fails before b takes them.
        net.freeze(b);
        net.run_until(|_| false, Duration::from_millis(5));
        net.fail_engine(&r, "a drill");
        net.thaw(b);
        net.run_until(|_| false, Duration::from_millis(50));
        let (posted, waiting) = net.srq_receives(b).expect("SRQ mode");
        assert_eq!(
            posted + waiting,
            depth as usize,
            "round {round}: {posted} posted, {waiting} waiting"
        );
    }
    // A new peer is served in full.
    let c = net.add_node(Config::default()).unwrap();
    let e = net.connect(c, b).unwrap();
    let (s, mut r) = open_pair(&mut net, c, b, e);
    let pool = net.pool(c);
    let _tickets: Vec<SendTicket> = (0..100).map(|k| net.send(&s, pattern(pool, 512, k))).collect();
    let mut got = 0u64;
    assert!(
        net.run_until(
            |_| {
                while let Some(m) = r.try_recv() {
                    check(&m.unwrap(), 512, got);
                    got += 1;
                }
                got == 100
            },
            Duration::from_secs(10)
        ),
        "received {got} of 100"
    );
}
