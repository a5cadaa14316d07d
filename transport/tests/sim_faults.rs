//! The fault matrix in simulation (issue 7 item 3, transport level): each scenario runs over
//! many seeds on the in-memory fabric with virtual time and checks the invariants
//!
//! - every message is delivered exactly once and in order, with its content intact, or its
//!   socket fails with an error;
//! - no send is reported complete (acknowledged) unless its message reached the peer's
//!   socket (the peer's application is alive);
//! - every send resolves (done or failed) by its deadline, and nothing hangs (virtual-time
//!   limit).
//!
//! Seeds 1..51 per scenario by default; `BEX_SEED=a..b` runs those (chunks of 400 in child
//! processes, since every simulated node leaks a registered pool), `BEX_SEED=s` replays one
//! seed exactly. A failure prints its scenario, seed and replay line.

use std::time::Duration;

use bex_rnic::soft::{Fabric, FaultRates, LinkModel, SwitchModel};
use bex_transport::sim::{SendTicket, SimNet, SimSocket};
use bex_transport::{Config, Msg};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// Random packet faults only; everything must arrive.
    Rates(FaultRates),
    /// A partition shorter than the keepalive timeout, then heal: everything must arrive.
    PartitionHeal,
    /// A partition that never heals: sockets fail by the keepalive deadline.
    PartitionForever,
    /// A QP moved to ERROR through the device mid-stream: every socket fails.
    QpError,
    /// The receiving host hangs: the sender's sockets fail by the keepalive deadline.
    Freeze,
    /// Three senders into one drop-tail switch port with a small buffer: losses are
    /// recovered, everything arrives.
    DropTailIncast,
}

const SCENARIOS: &[(&str, Kind)] = &[
    ("loss", Kind::Rates(FaultRates { drop: 0.03, duplicate: 0.0, corrupt: 0.0, reorder: 0.0 })),
    (
        "duplication",
        Kind::Rates(FaultRates { drop: 0.0, duplicate: 0.05, corrupt: 0.0, reorder: 0.0 }),
    ),
    (
        "reordering",
        Kind::Rates(FaultRates { drop: 0.0, duplicate: 0.0, corrupt: 0.0, reorder: 0.05 }),
    ),
    (
        "mixed",
        Kind::Rates(FaultRates { drop: 0.02, duplicate: 0.02, corrupt: 0.01, reorder: 0.02 }),
    ),
    ("partition-heal", Kind::PartitionHeal),
    ("partition-forever", Kind::PartitionForever),
    ("qp-error", Kind::QpError),
    ("keepalive-expiry", Kind::Freeze),
    ("drop-tail-incast", Kind::DropTailIncast),
];

const KEEPALIVE_TIMEOUT: Duration = Duration::from_millis(60);

/// SplitMix64: the test's own seeded choices (sizes, injection times).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn byte_at(stream: usize, seq: u64, i: usize) -> u8 {
    (stream as u64 * 131 + seq * 31 + i as u64 * 7) as u8
}

fn message(pool: &'static bemalloc::Pool, stream: usize, seq: u64, len: usize) -> Msg {
    let mut m = Msg::alloc(pool, len).expect("alloc");
    let b = m.as_mut_slice();
    b[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, x) in b.iter_mut().enumerate().skip(8) {
        *x = byte_at(stream, seq, i);
    }
    m
}

struct Stream {
    tx: SimSocket,
    rx: SimSocket,
    lens: Vec<usize>,
    tickets: Vec<(u64, SendTicket, Option<bool>)>,
    next: u64,
    rx_failed: bool,
    tx_failed: bool,
}

/// What a run's faults did, summed over a scenario's seeds: a fault that never fired would
/// pass every invariant (nothing to recover from).
#[derive(Debug, Default)]
struct Fired {
    dropped: u64,
    duplicated: u64,
    corrupted: u64,
    reordered: u64,
    link_dropped: u64,
    tail_drops: u64,
}

impl Fired {
    fn add(&mut self, o: Fired) {
        self.dropped += o.dropped;
        self.duplicated += o.duplicated;
        self.corrupted += o.corrupted;
        self.reordered += o.reordered;
        self.link_dropped += o.link_dropped;
        self.tail_drops += o.tail_drops;
    }

    /// Why `kind`'s faults did not happen, if they did not.
    fn missing(&self, kind: Kind) -> Option<String> {
        let asked = match kind {
            Kind::Rates(r) => vec![
                ("dropped", r.drop, self.dropped),
                ("duplicated", r.duplicate, self.duplicated),
                ("corrupted", r.corrupt, self.corrupted),
                ("reordered", r.reorder, self.reordered),
            ],
            Kind::PartitionHeal | Kind::PartitionForever => {
                vec![("cut by the partition", 1.0, self.link_dropped)]
            }
            Kind::DropTailIncast => vec![("dropped at the full switch port", 1.0, self.tail_drops)],
            // Failures that every seed's finish condition already requires.
            Kind::QpError | Kind::Freeze => Vec::new(),
        };
        let none: Vec<&str> =
            asked.iter().filter(|(_, rate, n)| *rate > 0.0 && *n == 0).map(|a| a.0).collect();
        (!none.is_empty()).then(|| format!("no packet {}: the fault never fired", none.join(", ")))
    }
}

/// Runs one scenario for one seed; `Err` names the broken invariant.
fn run(kind: Kind, seed: u64) -> Result<Fired, String> {
    let mut rng = Rng(seed ^ 0x5eed);
    let cfg = Config {
        sq_depth: 16,
        rq_depth: 16,
        cq_depth: 256,
        eager_max: 1024,
        fragment_bytes: 4096,
        keepalive_interval: Duration::from_millis(10),
        keepalive_timeout: KEEPALIVE_TIMEOUT,
        qp_timeout: 10, // 4 ms: retransmission well inside the keepalive timeout
        ..Config::default()
    };
    let link = LinkModel {
        jitter: Duration::from_micros(1),
        bytes_per_sec: Some(3_125_000_000),
        ..LinkModel::default()
    };
    let fabric = if kind == Kind::DropTailIncast {
        let sw = SwitchModel {
            port_bytes_per_sec: Some(3_125_000_000),
            buffer_bytes: 24 << 10,
            pfc: None,
        };
        Fabric::with_switch(seed, link, sw)
    } else {
        Fabric::new(seed, link)
    };
    let mut net = SimNet::with_fabric(fabric);
    net.set_pool_config(SimNet::small_pools(64 << 20));
    let e = |e: bex_transport::TransportError| e.to_string();
    let rx_node = net.add_node(cfg.clone()).map_err(e)?;
    let senders = if kind == Kind::DropTailIncast { 3 } else { 1 };
    let mut streams = Vec::new();
    let mut qpns = Vec::new();
    for _ in 0..senders {
        let s = net.add_node(cfg.clone()).map_err(e)?;
        let q = net.connect(s, rx_node).map_err(e)?;
        qpns.push((s, q));
        for _ in 0..2 {
            let tx = net.open(s, q, Duration::from_millis(50)).map_err(e)?;
            let rx = net.accept(rx_node).ok_or("no accepted socket")?;
            let n = 10 + rng.below(20) as usize;
            let lens = (0..n)
                .map(|_| {
                    let big = rng.below(3) == 0;
                    8 + rng.below(if big { 40_000 } else { 900 }) as usize
                })
                .collect();
            streams.push(Stream {
                tx,
                rx,
                lens,
                tickets: Vec::new(),
                next: 0,
                rx_failed: false,
                tx_failed: false,
            });
        }
    }
    if let Kind::Rates(r) = kind {
        net.fabric().with_faults(|f| f.set_rates(r));
    }
    for (i, s) in streams.iter_mut().enumerate() {
        let pool = net.pool(s.tx.node());
        for (seq, &len) in s.lens.iter().enumerate() {
            let t = net.send(&s.tx, message(pool, i, seq as u64, len));
            s.tickets.push((seq as u64, t, None));
        }
    }
    let fails = matches!(kind, Kind::PartitionForever | Kind::QpError | Kind::Freeze);
    let inject_after = Duration::from_micros(rng.below(300));
    // Shorter than the QP retry budget (8 × 4.2 ms), which would fail the connection instead.
    let heal_after = Duration::from_millis(1 + rng.below(20));
    let start = net.now();
    let (sender, qpn) = qpns[0];
    let mut injected: Option<std::time::Instant> = None;
    let mut healed = false;
    let mut violation: Option<String> = None;
    let limit = Duration::from_secs(3);
    let finished = net.run_until(
        |net| {
            let now = net.now();
            if injected.is_none() && now >= start + inject_after {
                injected = Some(now);
                match kind {
                    Kind::PartitionHeal | Kind::PartitionForever => net.fabric().partition(sender, rx_node, true),
                    Kind::QpError => {
                        if let Err(x) = net.fabric().inject_qp_error(sender, qpn) {
                            violation = Some(format!("injection failed: {x}"));
                        }
                    }
                    Kind::Freeze => net.freeze(rx_node),
                    _ => {}
                }
            }
            if kind == Kind::PartitionHeal && !healed && injected.is_some_and(|t| now >= t + heal_after) {
                healed = true;
                net.fabric().partition(sender, rx_node, false);
            }
            let mut all_done = true;
            for (i, s) in streams.iter_mut().enumerate() {
                while let Some(m) = s.rx.try_recv() {
                    match m {
                        Ok(m) => {
                            if s.rx_failed {
                                violation = Some(format!("stream {i}: a message after the socket failed"));
                            }
                            let b = m.as_slice();
                            let seq = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
                            if seq != s.next {
                                violation = Some(format!("stream {i}: got seq {seq}, expected {} (duplicate, loss or reorder)", s.next));
                            } else if s.next as usize >= s.lens.len() || b.len() != s.lens[seq as usize] {
                                violation = Some(format!("stream {i}: seq {seq} has {} bytes", b.len()));
                            } else if b.iter().enumerate().skip(8).any(|(k, &x)| x != byte_at(i, seq, k)) {
                                violation = Some(format!("stream {i}: seq {seq} corrupted"));
                            }
                            s.next += 1;
                        }
                        Err(_) => s.rx_failed = true,
                    }
                }
                while let Some(m) = s.tx.try_recv() {
                    if m.is_err() {
                        s.tx_failed = true;
                    }
                }
                // An acknowledged send must reach the socket once the receiver drains what
                // it holds: checked after the run.
                for (_, t, res) in s.tickets.iter_mut() {
                    if res.is_none() {
                        if let Some(r) = t.poll() {
                            *res = Some(r.is_ok());
                        }
                    }
                }
                let resolved = s.tickets.iter().all(|t| t.2.is_some());
                let delivered = s.next as usize == s.lens.len();
                let rx_over = delivered || s.rx_failed || kind == Kind::Freeze;
                // A failure scenario ends when the sender's socket has failed (keepalive
                // expiry, retry exhaustion or the QP error).
                all_done &= resolved && rx_over && (!fails || s.tx_failed);
            }
            // Every fault has its whole course: a run whose streams end before the partition
            // (or before its heal) tests nothing about it.
            let course_run = match kind {
                Kind::PartitionHeal => healed,
                _ => !fails || injected.is_some(),
            };
            violation.is_some() || (all_done && course_run)
        },
        limit,
    );
    if let Some(v) = violation {
        return Err(v);
    }
    if !finished {
        let left: usize =
            streams.iter().map(|s| s.tickets.iter().filter(|t| t.2.is_none()).count()).sum();
        return Err(format!("hang: {left} sends unresolved after {limit:?} of virtual time"));
    }
    let end = net.now();
    for (i, s) in streams.iter().enumerate() {
        let acked = s.tickets.iter().filter(|t| t.2 == Some(true)).count() as u64;
        if kind != Kind::Freeze && acked > s.next && !s.rx_failed {
            return Err(format!("stream {i}: {acked} sends acknowledged, {} delivered", s.next));
        }
        // In a failure scenario the run ends only once every sender's socket has failed
        // (the finish condition above), so undelivered messages always have a failed sender.
        if !fails && (s.next as usize != s.lens.len() || s.rx_failed || s.tx_failed) {
            return Err(format!(
                "stream {i}: {} of {} delivered (rx failed {}, tx failed {})",
                s.next,
                s.lens.len(),
                s.rx_failed,
                s.tx_failed
            ));
        }
    }
    if fails {
        // Deadline: the keepalive timeout (plus two intervals of slack) after the fault.
        let deadline = injected.unwrap_or(start) + KEEPALIVE_TIMEOUT + Duration::from_millis(30);
        if end > deadline {
            return Err(format!(
                "failures resolved {:?} after the fault, deadline {:?}",
                end - injected.unwrap_or(start),
                deadline - injected.unwrap_or(start)
            ));
        }
    }
    let f = net.fabric().stats();
    Ok(Fired {
        dropped: f.dropped,
        duplicated: f.duplicated,
        corrupted: f.corrupted,
        reordered: f.reordered,
        link_dropped: f.link_dropped,
        tail_drops: net.fabric().switch_stats().map_or(0, |s| s.tail_drops),
    })
}

const CHUNK: u64 = 400;

fn matrix(name: &str, kind: Kind, test: &str) {
    let seeds = bex_testkit::seed::seeds(1..51);
    // Every node leaks a pool with a jemalloc arena (≤ 4095 per process): more than CHUNK
    // seeds run in child processes of this test binary.
    if bex_testkit::seed::run_chunked(&seeds, CHUNK, &[test, "--test-threads=1"]) {
        return;
    }
    let cmd = format!("cargo test -p bex-transport --test sim_faults {test}");
    let mut fired = Fired::default();
    for seed in seeds.clone() {
        match run(kind, seed) {
            Ok(f) => fired.add(f),
            Err(e) => {
                panic!(
                    "scenario {name} seed {seed}: {e}\n{}",
                    bex_testkit::seed::replay(seed, &cmd)
                )
            }
        }
    }
    if let Some(why) = fired.missing(kind) {
        panic!("scenario {name}, seeds {seeds:?}: {why} ({fired:?})");
    }
    eprintln!("scenario {name}: {} seeds passed ({fired:?})", seeds.end - seeds.start);
}

macro_rules! scenario {
    ($test:ident, $i:expr) => {
        #[test]
        fn $test() {
            let (name, kind) = SCENARIOS[$i];
            matrix(name, kind, stringify!($test));
        }
    };
}

scenario!(loss, 0);
scenario!(duplication, 1);
scenario!(reordering, 2);
scenario!(mixed_faults, 3);
scenario!(partition_then_heal, 4);
scenario!(partition_forever_fails_by_the_deadline, 5);
scenario!(qp_error_fails_every_socket, 6);
scenario!(keepalive_expiry, 7);
scenario!(drop_tail_incast_recovers_losses, 8);

/// A run is a function of its seed: the same seed twice gives the same fabric history.
#[test]
fn a_seed_replays_exactly() {
    let trace = |seed| {
        let link = LinkModel { jitter: Duration::from_micros(3), ..LinkModel::default() };
        let mut net = SimNet::new(seed, link);
        let a = net.add_node(Config::default()).unwrap();
        let b = net.add_node(Config::default()).unwrap();
        let q = net.connect(a, b).unwrap();
        let s = net.open(a, q, Duration::from_millis(10)).unwrap();
        let mut r = net.accept(b).unwrap();
        net.fabric().with_faults(|f| {
            f.set_rates(FaultRates { drop: 0.05, duplicate: 0.05, corrupt: 0.0, reorder: 0.05 })
        });
        let pool = net.pool(a);
        for k in 0..20 {
            drop(net.send(&s, message(pool, 0, k, 100 + 3000 * k as usize)));
        }
        let mut got = 0;
        net.run_until(
            |_| {
                while let Some(Ok(_)) = r.try_recv() {
                    got += 1;
                }
                got == 20
            },
            Duration::from_secs(1),
        );
        (got, net.fabric().stats(), net.fabric().elapsed())
    };
    assert_eq!(trace(7), trace(7));
    assert_ne!(trace(7).1, trace(8).1, "different seeds differ");
}

/// The switch: a drop-tail port with a small buffer drops under incast, a PFC port of the
/// same size pauses instead and drops nothing; both deliver everything.
#[test]
fn drop_tail_drops_where_pfc_pauses() {
    let run_with = |pfc: Option<bex_rnic::soft::Pfc>| {
        let link = LinkModel { bytes_per_sec: Some(3_125_000_000), ..LinkModel::default() };
        let sw =
            SwitchModel { port_bytes_per_sec: Some(3_125_000_000), buffer_bytes: 16 << 10, pfc };
        let mut net = SimNet::with_fabric(Fabric::with_switch(11, link, sw));
        let r = net.add_node(Config::default()).unwrap();
        let mut socks = Vec::new();
        for _ in 0..4 {
            let s = net.add_node(Config::default()).unwrap();
            let q = net.connect(s, r).unwrap();
            let tx = net.open(s, q, Duration::from_millis(10)).unwrap();
            socks.push((tx, net.accept(r).unwrap()));
        }
        for (i, (tx, _)) in socks.iter().enumerate() {
            let pool = net.pool(tx.node());
            drop(net.send(tx, message(pool, i, 0, 200 << 10)));
        }
        let mut got = 0;
        let ok = net.run_until(
            |_| {
                for (_, rx) in socks.iter_mut() {
                    if let Some(m) = rx.try_recv() {
                        assert_eq!(m.expect("delivered").len(), 200 << 10);
                        got += 1;
                    }
                }
                got == 4
            },
            Duration::from_secs(2),
        );
        assert!(ok, "all four messages arrive (pfc {pfc:?})");
        net.fabric().switch_stats().unwrap()
    };
    let tail = run_with(None);
    assert!(tail.tail_drops > 0 && tail.pause_events == 0, "{tail:?}");
    let pfc = run_with(Some(bex_rnic::soft::Pfc { xoff_bytes: 16 << 10, xon_bytes: 8 << 10 }));
    assert!(pfc.tail_drops == 0 && pfc.pause_events > 0 && pfc.senders_paused > 0, "{pfc:?}");
}

/// Per-link faults: a partitioned link carries nothing until healed.
#[test]
fn a_partition_blocks_and_healing_restores() {
    let mut net = SimNet::new(12, LinkModel::default());
    let a = net.add_node(Config::default()).unwrap();
    let b = net.add_node(Config::default()).unwrap();
    let q = net.connect(a, b).unwrap();
    let s = net.open(a, q, Duration::from_millis(10)).unwrap();
    let mut r = net.accept(b).unwrap();
    net.fabric().partition(a, b, true);
    drop(net.send(&s, message(net.pool(a), 0, 0, 100)));
    assert!(!net.run_until(|_| r.try_recv().is_some(), Duration::from_millis(5)));
    assert!(net.fabric().stats().link_dropped > 0);
    net.fabric().partition(a, b, false);
    assert!(
        net.run_until(|_| r.try_recv().is_some(), Duration::from_millis(100)),
        "delivered after healing"
    );
}
