//! `frag-sim` and `hol-sim`: Fig. 10 and Fig. 13 on the in-memory fabric
//! ([`bex_transport::sim::SimNet`]) — two nodes, one engine, a link of a given rate in
//! virtual time, the transport's engines and I/O workers unmodified. Exact and
//! deterministic: the same seed gives the same numbers on any machine, unlike the loopback
//! runs whose "link" is a CPU-bound software RNIC.
//!
//! `frag_sim`: node A keeps `window` messages outstanding on one socket; goodput is what
//! node B receives per unit of virtual time.
//!
//! `hol_sim`: node A runs `flows` large flows that each keep two messages outstanding (a new
//! one is queued as soon as one completes) and a small flow of 64-byte pings; node B drops
//! the large messages and echoes the pings. Between pings the network runs for a seeded
//! random gap, so the pings sample every phase of the large flows.

use bex_bench::Failure;
use std::time::Duration;

use bex_bench::stats::LatencyRecorder;
use bex_rnic::soft::LinkModel;
use bex_transport::sim::{SendTicket, SimNet, SimSocket};
use bex_transport::{Msg, TransportError};

use crate::error::{BenchError, Result};
use crate::spec::{Knobs, HOL_SMALL};
use crate::workload::{check, stamp};

/// Large messages outstanding per flow.
const WINDOW: usize = 2;
/// Unrecorded pings first.
const WARMUP: u32 = 5;
/// Longest virtual time one ping may take.
const PING_LIMIT: Duration = Duration::from_secs(1);

/// What one simulated point measured.
#[derive(Debug)]
pub struct SimResult {
    /// Small-flow round trips, virtual time.
    pub small: LatencyRecorder,
    /// Large-flow goodput at B while the small flow was measured, Gb/s (virtual).
    pub large_gbps: f64,
    /// Virtual time the measurement covered.
    pub virtual_ms: f64,
}

struct Flows {
    /// Per flow: A's socket, B's socket, the outstanding sends.
    flows: Vec<(SimSocket, SimSocket, Vec<SendTicket>)>,
    large: usize,
    received_bytes: u64,
    error: Option<TransportError>,
}

impl Flows {
    /// Keeps every flow's window full and drains B's side; called at every step.
    fn service(&mut self, net: &mut SimNet, a: usize) {
        for (s, r, tickets) in &mut self.flows {
            tickets.retain_mut(|t| match t.poll() {
                None => true,
                Some(Ok(())) => false,
                Some(Err(e)) => {
                    self.error.get_or_insert(e);
                    false
                }
            });
            while tickets.len() < WINDOW && self.error.is_none() {
                match Msg::alloc(net.pool(a), self.large) {
                    Ok(m) => tickets.push(net.send(s, m)),
                    Err(e) => {
                        self.error = Some(e);
                    }
                }
            }
            while let Some(m) = r.try_recv() {
                match m {
                    Ok(m) => self.received_bytes += m.len() as u64,
                    Err(e) => {
                        self.error.get_or_insert(e);
                        break;
                    }
                }
            }
        }
    }
}

/// Nodes `a` and `b` with the knobs' transport over a `link_gbps` link, and their engine.
fn two_nodes(knobs: &Knobs, link_gbps: u32, seed: u64) -> Result<(SimNet, usize, usize, u32)> {
    let cfg = knobs.config()?;
    let link = LinkModel {
        bytes_per_sec: Some(u64::from(link_gbps) * 1_000_000_000 / 8),
        ..LinkModel::default()
    };
    let mut net = SimNet::new(seed, link);
    let a = net.add_node(cfg.clone())?;
    let b = net.add_node(cfg)?;
    let engine = net.connect(a, b)?;
    Ok((net, a, b, engine))
}

/// A socket opened on `a`'s `engine` and its peer accepted on `b`.
fn socket_pair(
    net: &mut SimNet,
    a: usize,
    b: usize,
    engine: u32,
) -> Result<(SimSocket, SimSocket)> {
    let s = net.open(a, engine, Duration::from_millis(10))?;
    let r =
        net.accept(b).ok_or_else(|| BenchError::protocol("simulated peer accepted no socket"))?;
    Ok((s, r))
}

/// Sends `window + msgs` messages of `size` bytes with `window` outstanding on one engine
/// over a `link_gbps` link; returns the virtual time the last `msgs` took to arrive (from the
/// arrival of the last unmeasured message to the arrival of the last one).
pub fn frag_sim(
    knobs: &Knobs,
    size: u64,
    window: u32,
    msgs: u32,
    link_gbps: u32,
    seed: u64,
) -> Result<Duration> {
    let (mut net, a, b, engine) = two_nodes(knobs, link_gbps, seed)?;
    let (tx, mut rx) = socket_pair(&mut net, a, b, engine)?;
    let total = u64::from(window + msgs);
    let (mut queued, mut received) = (0u64, 0u64);
    let mut tickets: Vec<SendTicket> = Vec::new();
    let mut error: Option<TransportError> = None;
    let mut t0 = None;
    let limit = Duration::from_secs(60);
    let done = net.run_until(
        |net| {
            tickets.retain_mut(|t| match t.poll() {
                None => true,
                Some(r) => {
                    if let Err(e) = r {
                        error.get_or_insert(e);
                    }
                    false
                }
            });
            while queued < total && tickets.len() < window as usize {
                match Msg::alloc(net.pool(a), size as usize) {
                    Ok(m) => tickets.push(net.send(&tx, m)),
                    Err(e) => {
                        error.get_or_insert(e);
                        return true;
                    }
                }
                queued += 1;
            }
            while let Some(m) = rx.try_recv() {
                match m {
                    Ok(m) if m.len() as u64 == size => received += 1,
                    Ok(m) => {
                        error.get_or_insert(TransportError::Invalid(format!(
                            "received {} bytes, sent {size}",
                            m.len()
                        )));
                    }
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
                if received == u64::from(window) {
                    t0 = Some(net.now());
                }
            }
            received == total || error.is_some()
        },
        limit,
    );
    if let Some(e) = error {
        return Err(e.into());
    }
    if !done {
        return Err(BenchError::timeout(format!("simulated transfer (seed {seed})"), limit));
    }
    let t0 = t0.ok_or_else(|| BenchError::protocol("no measured interval"))?;
    Ok(net.now() - t0)
}

/// A xorshift step (the gaps between pings; seeded, so runs repeat exactly).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs one point: `flows` large flows of `large`-byte messages against a 64-byte ping-pong
/// on one engine over a `link_gbps` link; `samples` recorded pings.
pub fn hol_sim(
    knobs: &Knobs,
    flows: u32,
    large: u64,
    samples: u32,
    link_gbps: u32,
    seed: u64,
) -> Result<SimResult> {
    let (mut net, a, b, engine) = two_nodes(knobs, link_gbps, seed)?;
    let pair = |net: &mut SimNet| socket_pair(net, a, b, engine);
    let (mut ping, mut pong) = pair(&mut net)?;
    let mut fl = Flows { flows: Vec::new(), large: large as usize, received_bytes: 0, error: None };
    for _ in 0..flows {
        let (s, r) = pair(&mut net)?;
        fl.flows.push((s, r, Vec::new()));
    }
    // Let the large flows reach their steady state: one message each through.
    let want = u64::from(flows) * large;
    net.run_until(
        |net| {
            fl.service(net, a);
            fl.received_bytes >= want || fl.error.is_some()
        },
        Duration::from_secs(10),
    );
    if let Some(e) = fl.error.take() {
        return Err(e.into());
    }
    let mut rec = LatencyRecorder::new();
    let mut rng = seed | 1;
    let (mut b0, mut t0) = (0, net.now());
    for i in 0..u64::from(WARMUP + samples) {
        if i == u64::from(WARMUP) {
            (b0, t0) = (fl.received_bytes, net.now());
        }
        let gap = Duration::from_micros(10 + next(&mut rng) % 50);
        net.run_until(
            |net| {
                fl.service(net, a);
                false
            },
            gap,
        );
        let mut m = Msg::alloc(net.pool(a), HOL_SMALL as usize)?;
        stamp(m.as_mut_slice(), i);
        let sent_at = net.now();
        let _ticket = net.send(&ping, m);
        let mut back: Option<Result<Msg, TransportError>> = None;
        let done = net.run_until(
            |net| {
                fl.service(net, a);
                if let Some(r) = pong.try_recv() {
                    match r {
                        // The echo: the received buffer goes back as it is.
                        Ok(m) => drop(net.send(&pong, m)),
                        Err(e) => back = Some(Err(e)),
                    }
                }
                if back.is_none() {
                    back = ping.try_recv();
                }
                back.is_some() || fl.error.is_some()
            },
            PING_LIMIT,
        );
        if let Some(e) = fl.error.take() {
            return Err(e.into());
        }
        let m = match back {
            Some(r) => r?,
            None if !done => {
                return Err(BenchError::timeout(
                    format!("simulated ping {i} (seed {seed})"),
                    PING_LIMIT,
                ))
            }
            None => return Err(BenchError::protocol("simulation stopped")),
        };
        check(m.as_slice(), HOL_SMALL as usize, i)?;
        if i >= u64::from(WARMUP) {
            rec.record(net.now() - sent_at);
        }
    }
    let ns = (net.now() - t0).as_nanos().max(1) as f64;
    Ok(SimResult {
        small: rec,
        large_gbps: (fl.received_bytes - b0) as f64 * 8.0 / ns,
        virtual_ms: ns / 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knobs(fragment: usize) -> Knobs {
        Knobs { fragment_bytes: fragment, eager_max: 4096, ..Knobs::default() }
    }

    #[test]
    fn larger_fragments_fill_more_of_the_link() {
        let gbps = |frag| {
            let t = frag_sim(&knobs(frag), 1 << 20, 8, 8, 25, 1).unwrap();
            (8u64 << 20) as f64 * 8.0 / t.as_nanos() as f64
        };
        let (small, large) = (gbps(1024), gbps(64 << 10));
        assert!(large > small, "{small} vs {large}");
        assert!(large > 20.0 && large < 25.01, "{large}");
        assert_eq!(gbps(1024), small, "repeatable");
    }

    #[test]
    fn alone_the_small_flow_sees_the_link_latency_only() {
        let r = hol_sim(&knobs(4096), 0, 1 << 20, 20, 25, 1).unwrap();
        let s = r.small.summary().unwrap();
        assert_eq!(s.count, 20);
        // Two 2 µs hops plus serialization: a few µs, never more than 20.
        assert!(s.p50_us > 3.9 && s.p99_us < 20.0, "{s:?}");
        assert_eq!(r.large_gbps, 0.0);
    }

    #[test]
    fn fragments_bound_the_small_flow_and_the_run_repeats_exactly() {
        let frag = hol_sim(&knobs(4096), 2, 1 << 20, 30, 25, 3).unwrap();
        let whole = hol_sim(&knobs(1 << 20), 2, 1 << 20, 30, 25, 3).unwrap();
        let (f, w) = (frag.small.summary().unwrap(), whole.small.summary().unwrap());
        assert!(w.p99_us > 2.0 * f.p99_us, "fragments help: {f:?} vs {w:?}");
        // Goodput counts whole 1 MiB messages when they are delivered, so one message begun
        // before the window may land inside it: allow one message of slack over the link.
        let slack = f64::from(1u32 << 20) * 8.0 / (frag.virtual_ms * 1e6);
        assert!(
            frag.large_gbps > 15.0 && frag.large_gbps < 25.0 + slack,
            "{} (slack {slack})",
            frag.large_gbps
        );
        let again = hol_sim(&knobs(4096), 2, 1 << 20, 30, 25, 3).unwrap();
        assert_eq!(again.small.buckets(), frag.small.buckets(), "same seed, same run");
    }
}
