//! PS-level invariants in simulation (issue 7 item 3), on a model of the push path: a
//! client pushes gradients with (client, seq) to a primary shard, which admits them with the
//! parameter server's own `Dedupe`, applies them to its own `Table` (SGD) and replicates the
//! resulting rows (versioned) to a replica. The client retries a push unanswered for 5 ms and
//! reconnects after a socket failure; the primary resends unacknowledged replication. The
//! model's messages run over the real transport engines on the fabric with packet loss,
//! duplication, reordering and QP errors injected on both links.
//!
//! Invariants: every push is acknowledged by the deadline; no acknowledged push is lost and
//! none is applied twice (the primary's rows equal the exactly-once sum); replicas converge.
//! Not covered: the real `bex-rpc` client and `ps-server` (async over live transports).
//! Seeds 1..31; `BEX_SEED=a..b` or `BEX_SEED=s` as in the transport's fault matrix (more
//! than 400 seeds run in chunks in child processes).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bex_ps_core::dedupe::{Dedupe, DedupeConfig, Verdict};
use bex_ps_core::Table;
use bex_ps_proto::init::Initializer;
use bex_ps_proto::optim::Optimizer;
use bex_ps_proto::TableSpec;
use bex_rnic::soft::{FaultRates, LinkModel};
use bex_transport::sim::{SimNet, SimSocket};
use bex_transport::{Config, Msg};

const CLIENT: u64 = 7;
const KEYS: u64 = 8;
const RETRY: Duration = Duration::from_millis(5);

fn table() -> Table {
    Table::new(TableSpec {
        name: "t".into(),
        dim: 1,
        seed: 1,
        init: Initializer::Zeros,
        optimizer: Optimizer::Sgd { lr: 1.0 },
        admission: Default::default(),
        capacity: Default::default(),
    })
    .expect("table")
}

fn msg(net: &SimNet, node: usize, words: &[u64]) -> Msg {
    let mut m = Msg::alloc(net.pool(node), words.len() * 8).expect("alloc");
    for (c, w) in m.as_mut_slice().chunks_mut(8).zip(words) {
        c.copy_from_slice(&w.to_le_bytes());
    }
    m
}

fn words(m: &Msg) -> Vec<u64> {
    m.as_slice().chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect()
}

/// Every message `socket` has received, as words; `failed` is set if the socket failed.
fn drain(socket: &mut SimSocket, failed: &mut bool) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    while let Some(m) = socket.try_recv() {
        match m {
            Ok(m) => out.push(words(&m)),
            Err(_) => *failed = true,
        }
    }
    out
}

/// One link of the model: a socket pair that is replaced when it fails.
struct Link {
    a: usize,
    qpn: u32,
    tx: SimSocket,
    rx: SimSocket,
}

impl Link {
    fn open(net: &mut SimNet, a: usize, b: usize) -> Result<Link, String> {
        let qpn = net.connect(a, b).map_err(|e| e.to_string())?;
        let tx = net.open(a, qpn, Duration::from_millis(50)).map_err(|e| e.to_string())?;
        let rx = net.accept(b).ok_or("no accepted socket")?;
        Ok(Link { a, qpn, tx, rx })
    }
}

/// Returns (duplicate pushes the dedupe refused, reconnects) for the coverage check.
fn run(seed: u64) -> Result<(u64, u64), String> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    let cfg = Config {
        sq_depth: 16,
        rq_depth: 16,
        cq_depth: 256,
        keepalive_interval: Duration::from_millis(10),
        keepalive_timeout: Duration::from_millis(60),
        qp_timeout: 10,
        ..Config::default()
    };
    let mut net =
        SimNet::new(seed, LinkModel { jitter: Duration::from_micros(2), ..LinkModel::default() });
    net.set_pool_config(SimNet::small_pools(64 << 20));
    let e = |e: bex_transport::TransportError| e.to_string();
    let (c, p, r) = (
        net.add_node(cfg.clone()).map_err(e)?,
        net.add_node(cfg.clone()).map_err(e)?,
        net.add_node(cfg).map_err(e)?,
    );
    let mut push_link = Link::open(&mut net, c, p)?;
    let mut rep_link = Link::open(&mut net, p, r)?;
    net.fabric().with_faults(|f| {
        f.set_rates(FaultRates { drop: 0.01, duplicate: 0.01, corrupt: 0.0, reorder: 0.01 })
    });

    let n_push = 40 + rnd(40);
    let pushes: Vec<(u64, u64)> = (0..n_push).map(|_| (rnd(KEYS), 1 + rnd(5))).collect();
    let mut expected = vec![0f32; KEYS as usize];
    for &(k, g) in &pushes {
        expected[k as usize] -= g as f32;
    }
    let primary = table();
    let replica = table();
    let dedupe = Dedupe::new(DedupeConfig::default());
    let mut applied = 0u64;
    let (mut dups, mut reconnects) = (0u64, 0u64);
    // Client state: seq → last send time; acked set.
    let mut sent: HashMap<u64, Option<Instant>> = HashMap::new();
    let mut acked = vec![false; pushes.len()];
    let mut next_seq = 0u64;
    // Primary's replication log: version → (key, value); the replica's applied versions.
    let mut rep_log: HashMap<u64, (u64, f32, Option<Instant>)> = HashMap::new();
    let mut version = 0u64;
    let mut replica_version: HashMap<u64, u64> = HashMap::new();
    let start = net.now();
    let qp_err_push = start + Duration::from_micros(rnd(3000));
    let qp_err_rep = start + Duration::from_micros(rnd(3000));
    let (mut err_push_done, mut err_rep_done) = (false, false);
    let mut violation: Option<String> = None;
    let deadline = Duration::from_secs(2);
    let done = net.run_until(
        |net| {
            let now = net.now();
            if !err_push_done && now >= qp_err_push {
                err_push_done = true;
                if let Err(x) = net.fabric().inject_qp_error(push_link.a, push_link.qpn) {
                    violation = Some(format!("push QP error not injected: {x}"));
                }
            }
            if !err_rep_done && now >= qp_err_rep {
                err_rep_done = true;
                if let Err(x) = net.fabric().inject_qp_error(rep_link.a, rep_link.qpn) {
                    violation = Some(format!("rep QP error not injected: {x}"));
                }
            }
            // Client: up to 8 pushes outstanding, retry after RETRY.
            while next_seq < pushes.len() as u64 && sent.len() < 8 {
                sent.insert(next_seq, None);
                next_seq += 1;
            }
            let mut push_failed = false;
            for (&seq, t) in sent.iter_mut() {
                if t.is_none_or(|t| now >= t + RETRY) {
                    let (k, g) = pushes[seq as usize];
                    let m = msg(net, c, &[CLIENT, seq, k, g]);
                    drop(net.send(&push_link.tx, m));
                    *t = Some(now);
                }
            }
            while let Some(m) = push_link.tx.try_recv() {
                match m {
                    Ok(m) => {
                        let seq = words(&m)[0];
                        if sent.remove(&seq).is_some() {
                            acked[seq as usize] = true;
                        }
                    }
                    Err(_) => push_failed = true,
                }
            }
            // Primary: dedupe, apply, replicate, answer.
            for w in drain(&mut push_link.rx, &mut push_failed) {
                let (client, seq, k, g) = (w[0], w[1], w[2], w[3]);
                match dedupe.admit(client, seq) {
                    Verdict::New => {
                        let mut row = [0f32];
                        if let Err(x) = primary.push(&[k], &[g as f32], Some(&mut row)) {
                            violation = Some(format!("push: {x}"));
                        }
                        applied += 1;
                        version += 1;
                        rep_log.insert(version, (k, row[0], None));
                    }
                    Verdict::Duplicate => dups += 1,
                    Verdict::TooOld => {
                        violation = Some(format!("seq {seq} too old for the window"))
                    }
                }
                let ack = msg(net, p, &[seq]);
                drop(net.send(&push_link.rx, ack));
            }
            if push_failed {
                // Both ends see the failure; the client reconnects and resends all it has.
                reconnects += 1;
                match Link::open(net, c, p) {
                    Ok(l) => push_link = l,
                    Err(x) => violation = Some(format!("reconnect: {x}")),
                }
                for t in sent.values_mut() {
                    *t = None;
                }
            }
            // Replication: resend unacknowledged versions after RETRY.
            let mut rep_failed = false;
            for (&v, (k, val, t)) in rep_log.iter_mut() {
                if t.is_none_or(|t| now >= t + RETRY) {
                    let m = msg(net, p, &[v, *k, val.to_bits() as u64]);
                    drop(net.send(&rep_link.tx, m));
                    *t = Some(now);
                }
            }
            while let Some(m) = rep_link.tx.try_recv() {
                match m {
                    Ok(m) => {
                        rep_log.remove(&words(&m)[0]);
                    }
                    Err(_) => rep_failed = true,
                }
            }
            for w in drain(&mut rep_link.rx, &mut rep_failed) {
                let (v, k, val) = (w[0], w[1], f32::from_bits(w[2] as u32));
                // Rows carry whole values: apply only what is newer than what the replica has.
                let cur = replica_version.entry(k).or_insert(0);
                if v > *cur {
                    *cur = v;
                    if let Err(x) = replica.apply_replica(&[k], &[val]) {
                        violation = Some(format!("replica: {x}"));
                    }
                }
                let ack = msg(net, r, &[v]);
                drop(net.send(&rep_link.rx, ack));
            }
            if rep_failed {
                reconnects += 1;
                match Link::open(net, p, r) {
                    Ok(l) => rep_link = l,
                    Err(x) => violation = Some(format!("reconnect: {x}")),
                }
                for (_, _, t) in rep_log.values_mut() {
                    *t = None;
                }
            }
            violation.is_some() || (acked.iter().all(|&a| a) && rep_log.is_empty())
        },
        deadline,
    );
    if let Some(v) = violation {
        return Err(v);
    }
    if !done {
        let left = acked.iter().filter(|a| !**a).count();
        return Err(format!(
            "{left} pushes unanswered, {} replications pending after {deadline:?}",
            rep_log.len()
        ));
    }
    if applied != pushes.len() as u64 {
        return Err(format!("{applied} pushes applied for {} sent", pushes.len()));
    }
    let keys: Vec<u64> = (0..KEYS).collect();
    let (mut got, mut rep) = (vec![0f32; KEYS as usize], vec![0f32; KEYS as usize]);
    primary.read_into(&keys, &mut got).map_err(|x| x.to_string())?;
    replica.read_into(&keys, &mut rep).map_err(|x| x.to_string())?;
    if got != expected {
        return Err(format!("primary rows {got:?}, exactly-once sum {expected:?}"));
    }
    if rep != got {
        return Err(format!("replica {rep:?} did not converge to primary {got:?}"));
    }
    Ok((dups, reconnects))
}

/// Seeds per child process: every simulated node leaks a pool with its own jemalloc arena
/// (at most 4095 per process), so larger runs go to child processes of this test binary.
const CHUNK: u64 = 400;

#[test]
fn pushes_apply_exactly_once_and_replicas_converge_under_faults() {
    let seeds = bex_testkit::seed::seeds(1..31);
    let test = "pushes_apply_exactly_once_and_replicas_converge_under_faults";
    if bex_testkit::seed::run_chunked(&seeds, CHUNK, &[test]) {
        return;
    }
    let (mut dups, mut reconnects) = (0, 0);
    for seed in seeds.clone() {
        match run(seed) {
            Ok((d, r)) => {
                dups += d;
                reconnects += r;
            }
            Err(e) => panic!(
                "ps scenario seed {seed}: {e}\n{}",
                bex_testkit::seed::replay(seed, "cargo test -p bex-incast --test ps_faults")
            ),
        }
    }
    eprintln!(
        "ps scenario: {} seeds passed ({dups} duplicate pushes refused, {reconnects} reconnects)",
        seeds.end - seeds.start
    );
    if seeds.end - seeds.start >= 10 {
        assert!(
            dups > 0 && reconnects > 0,
            "the faults exercised retries ({dups}) and reconnects ({reconnects})"
        );
    }
}
