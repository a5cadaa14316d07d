//! The incast study of the paper's §6.3 (Figure 14, Table 4, Figure 15) in deterministic
//! simulation: one worker pulls a response from each of N parameter servers at once over
//! the real transport engines ([`SimNet`]) on a switched fabric with PFC. A run ("probe")
//! reports whether the switch port towards the worker crossed XOFF (a pause), the pull
//! latencies and, optionally, the bandwidth of a victim flow into the same port.
//!
//! Everything is on the fabric's virtual clock and a function of the seed; only the probe's
//! own runtime is measured on the wall clock.

use std::time::Duration;

use bex_rnic::soft::{Fabric, LinkModel, Pfc, SwitchModel};
use bex_transport::sim::{SendTicket, SimNet, SimSocket};
use bex_transport::{Config, Msg};
use serde::{Deserialize, Serialize};

pub mod clock;

/// The setup of one probe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Parameter servers answering the worker at once.
    pub servers: usize,
    /// The servers' software send window (bytes); `None` = off.
    pub window: Option<u64>,
    /// Bytes of each pull response.
    pub response_bytes: usize,
    /// Bytes of each pull request.
    pub request_bytes: usize,
    /// Fragment size of large messages (the window admits fragments).
    pub fragment_bytes: usize,
    /// Every link and switch port, Gb/s.
    pub link_gbps: f64,
    /// Propagation delay of each hop (host → switch, switch → host), µs.
    pub hop_latency_us: f64,
    /// PFC XOFF threshold of a switch port (bytes queued).
    pub xoff_bytes: u64,
    /// PFC XON threshold.
    pub xon_bytes: u64,
    /// Pull rounds (each waits for every response of the previous one).
    pub rounds: usize,
    /// Run a victim bulk flow into the worker during the rounds.
    pub victim: bool,
    /// Seed of the fabric and devices.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            servers: 16,
            window: None,
            response_bytes: DEFAULT_RESPONSE_BYTES,
            request_bytes: 64,
            fragment_bytes: 4096,
            link_gbps: 25.0,
            hop_latency_us: 1.0,
            xoff_bytes: DEFAULT_XOFF_BYTES,
            xon_bytes: DEFAULT_XOFF_BYTES - (256 << 10),
            rounds: 1,
            victim: false,
            seed: 1,
        }
    }
}

/// Default XOFF threshold (see the README of `results/incast` for the calibration).
pub const DEFAULT_XOFF_BYTES: u64 = 4_500_000;
/// Default response size: with no window, all N responses arrive at once, so about
/// `XOFF / response` servers fit before the first pause (the paper's 63).
pub const DEFAULT_RESPONSE_BYTES: usize = 72 * 1024;

/// What one probe measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The setup.
    pub params: Params,
    /// XOFF episodes at any switch port during the rounds.
    pub pause_events: u64,
    /// Virtual time from the first round's start to the first pause, µs.
    pub first_pause_us: Option<f64>,
    /// Times a sender was stopped by a paused port.
    pub senders_paused: u64,
    /// Largest queue at the worker's port, bytes.
    pub worker_port_max_queue: u64,
    /// Packets dropped by the switch (0 with PFC).
    pub tail_drops: u64,
    /// Pull latency percentiles over every response of every round, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Slowest pull, µs.
    pub max_us: f64,
    /// Virtual time of all rounds, µs.
    pub rounds_us: f64,
    /// The victim's goodput into the worker during the rounds, Gb/s.
    pub victim_gbps: Option<f64>,
    /// Packets the servers' NICs retransmitted (go-back-N after a drop or timeout).
    pub retransmitted_packets: u64,
    /// Wall-clock time of the probe (setup included), ms.
    pub wall_ms: f64,
}

/// The `q`-quantile (0..=1) of sorted values (nearest rank).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1000.0
}

/// Runs one probe. Each node leaks a small registered pool with its own jemalloc arena, and
/// a process holds at most 4095 arenas: run one probe per process for large N.
pub fn run_probe(p: &Params) -> Result<Probe, String> {
    let wall = clock::wall_now();
    if p.servers == 0 || p.servers > 3000 {
        return Err(format!("servers must be in 1..=3000, got {}", p.servers));
    }
    if p.xon_bytes >= p.xoff_bytes {
        return Err("xon_bytes must be below xoff_bytes".into());
    }
    if p.link_gbps.is_nan() || p.link_gbps <= 0.0 || p.hop_latency_us < 0.0 || p.rounds == 0 {
        return Err("link_gbps must be > 0, hop_latency_us ≥ 0, rounds ≥ 1".into());
    }
    let rate = (p.link_gbps * 1e9 / 8.0) as u64;
    let link = LinkModel {
        latency: Duration::from_nanos((p.hop_latency_us * 1000.0) as u64),
        jitter: Duration::ZERO,
        bytes_per_sec: Some(rate),
        ..LinkModel::default()
    };
    let switch = SwitchModel {
        port_bytes_per_sec: Some(rate),
        buffer_bytes: p.xoff_bytes,
        pfc: Some(Pfc { xoff_bytes: p.xoff_bytes, xon_bytes: p.xon_bytes }),
    };
    let mut net = SimNet::with_fabric(Fabric::with_switch(p.seed, link, switch));
    net.set_pool_config(SimNet::small_pools(256 << 20));
    let small = Config {
        sq_depth: 16,
        rq_depth: 8,
        cq_depth: 64,
        eager_max: 1024,
        fragment_bytes: p.fragment_bytes,
        ..Config::default()
    };
    let err = |e: bex_transport::TransportError| e.to_string();
    // The worker's one I/O thread serves every engine: its CQ must hold a completion per
    // outstanding receive and send of all of them.
    let cq = (p.servers as u32 + 2) * 48;
    let worker =
        net.add_node(Config { cq_depth: cq.next_power_of_two(), ..small.clone() }).map_err(err)?;
    let server_cfg = Config { cwnd_bytes: p.window, ..small.clone() };
    let mut engines = Vec::with_capacity(p.servers);
    for _ in 0..p.servers {
        let s = net.add_node(server_cfg.clone()).map_err(err)?;
        engines.push((worker, net.connect(worker, s).map_err(err)?));
    }
    let victim = if p.victim {
        let v = net
            .add_node(Config { fragment_bytes: 64 << 10, cq_depth: 256, ..small.clone() })
            .map_err(err)?;
        Some((v, net.connect(v, worker).map_err(err)?))
    } else {
        None
    };
    let mut wsocks = net.open_all(&engines, Duration::from_secs(1)).map_err(err)?;
    let mut ssocks: Vec<SimSocket> = (1..=p.servers)
        .map(|s| net.accept(s).ok_or(format!("server {s} saw no socket")))
        .collect::<Result<_, _>>()?;
    let mut victim_socks = match victim {
        Some((v, e)) => {
            let tx = net.open(v, e, Duration::from_secs(1)).map_err(err)?;
            let rx = net.accept(worker).ok_or("worker saw no victim socket")?;
            Some((tx, rx))
        }
        None => None,
    };
    const VICTIM_MSG: usize = 32 << 10;
    const VICTIM_OUTSTANDING: usize = 8;
    let mut victim_tickets: Vec<SendTicket> = Vec::new();
    let mut victim_bytes = 0u64;
    let mut failure: Option<String> = None;
    // The victim's flow reaches a steady state before the first round.
    if let Some((tx, rx)) = &mut victim_socks {
        let until = net.now() + Duration::from_micros(300);
        net.run_until(
            |net| {
                pump_victim(
                    net,
                    tx,
                    rx,
                    &mut victim_tickets,
                    &mut 0,
                    VICTIM_MSG,
                    VICTIM_OUTSTANDING,
                    &mut failure,
                );
                net.now() >= until || failure.is_some()
            },
            Duration::from_millis(10),
        );
    }
    let stats0 = net.fabric().switch_stats().unwrap_or_default();
    let retx0: u64 = (1..=p.servers).map(|s| net.device(s).counters().retransmitted_packets).sum();
    let start = net.now();
    let start_since_origin = net.fabric().elapsed();
    let mut lat = Vec::with_capacity(p.servers * p.rounds);
    let worker_pool = net.pool(worker);
    for round in 0..p.rounds {
        let t0 = net.now();
        let mut tickets = Vec::with_capacity(p.servers);
        for s in &wsocks {
            let m = Msg::alloc(worker_pool, p.request_bytes).map_err(err)?;
            tickets.push(net.send(s, m));
        }
        let mut left = p.servers;
        let ok = net.run_until(
            |net| {
                for (j, s) in ssocks.iter_mut().enumerate() {
                    while let Some(m) = s.try_recv() {
                        match m {
                            Ok(_) => match Msg::alloc(net.pool(j + 1), p.response_bytes) {
                                Ok(r) => drop(net.send(s, r)),
                                Err(e) => failure = Some(e.to_string()),
                            },
                            Err(e) => failure = Some(format!("server {}: {e}", j + 1)),
                        }
                    }
                }
                let now = net.now();
                for s in wsocks.iter_mut() {
                    while let Some(m) = s.try_recv() {
                        match m {
                            Ok(m) if m.len() == p.response_bytes => {
                                lat.push(us(now - t0));
                                left -= 1;
                            }
                            Ok(m) => failure = Some(format!("response of {} bytes", m.len())),
                            Err(e) => failure = Some(format!("worker: {e}")),
                        }
                    }
                }
                if let Some((tx, rx)) = &mut victim_socks {
                    pump_victim(
                        net,
                        tx,
                        rx,
                        &mut victim_tickets,
                        &mut victim_bytes,
                        VICTIM_MSG,
                        VICTIM_OUTSTANDING,
                        &mut failure,
                    );
                }
                left == 0 || failure.is_some()
            },
            Duration::from_secs(10),
        );
        if let Some(f) = failure {
            return Err(format!("round {round}: {f} (seed {})", p.seed));
        }
        if !ok {
            return Err(format!(
                "round {round}: {left} responses missing after 10 s virtual (seed {})",
                p.seed
            ));
        }
        for mut t in tickets {
            if let Some(Err(e)) = t.poll() {
                return Err(format!("request failed: {e}"));
            }
        }
    }
    let elapsed = net.now() - start;
    let stats = net.fabric().switch_stats().unwrap_or_default();
    let retx: u64 = (1..=p.servers).map(|s| net.device(s).counters().retransmitted_packets).sum();
    lat.sort_by(f64::total_cmp);
    let first_pause_us = match (stats0.first_pause, stats.first_pause) {
        (None, Some(t)) => Some(us(t.saturating_sub(start_since_origin))),
        _ => None,
    };
    Ok(Probe {
        params: p.clone(),
        pause_events: stats.pause_events - stats0.pause_events,
        first_pause_us,
        senders_paused: stats.senders_paused - stats0.senders_paused,
        worker_port_max_queue: net.fabric().port_high_water(worker).unwrap_or(0),
        tail_drops: stats.tail_drops - stats0.tail_drops,
        p50_us: quantile(&lat, 0.5),
        p99_us: quantile(&lat, 0.99),
        max_us: lat.last().copied().unwrap_or(0.0),
        rounds_us: us(elapsed),
        victim_gbps: victim_socks
            .as_ref()
            .map(|_| victim_bytes as f64 * 8.0 / elapsed.as_secs_f64().max(1e-12) / 1e9),
        retransmitted_packets: retx - retx0,
        wall_ms: clock::wall_now().duration_since(wall).as_secs_f64() * 1000.0,
    })
}

/// Keeps `outstanding` victim messages in flight and counts what the worker received.
#[allow(clippy::too_many_arguments)]
fn pump_victim(
    net: &mut SimNet,
    tx: &SimSocket,
    rx: &mut SimSocket,
    tickets: &mut Vec<SendTicket>,
    received: &mut u64,
    msg: usize,
    outstanding: usize,
    failure: &mut Option<String>,
) {
    tickets.retain_mut(|t| match t.poll() {
        None => true,
        Some(Ok(())) => false,
        Some(Err(e)) => {
            *failure = Some(format!("victim send: {e}"));
            false
        }
    });
    while tickets.len() < outstanding {
        match Msg::alloc(net.pool(tx.node()), msg) {
            Ok(m) => tickets.push(net.send(tx, m)),
            Err(e) => {
                *failure = Some(e.to_string());
                return;
            }
        }
    }
    while let Some(m) = rx.try_recv() {
        match m {
            Ok(m) => *received += m.len() as u64,
            Err(e) => *failure = Some(format!("victim receive: {e}")),
        }
    }
}
