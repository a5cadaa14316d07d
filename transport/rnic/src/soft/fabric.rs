//! An in-memory fabric: many software devices in one process, one virtual clock, seeded
//! faults. Nothing sleeps and nothing reads the wall clock after construction, so a run is a
//! pure function of its seed and the test's actions: a failing run replays exactly.
//!
//! The test thread alternates between acting on devices (post, poll) and pumping the fabric
//! ([`Fabric::step`], [`Fabric::run_until`]). Each step transmits what every device has ready,
//! delivers the packets due now, fires due timers, and otherwise advances the clock to the
//! next event.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::core::NicConfig;
use super::fault::{FaultPlan, FaultRates, Verdict};
use super::{DevInner, SoftDevice};
use crate::clock::wall_now;

/// The links between fabric devices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// One-way propagation delay.
    pub latency: Duration,
    /// Uniform random extra delay in `0..jitter`.
    pub jitter: Duration,
    /// Each device's egress rate; `None` for infinitely fast links.
    pub bytes_per_sec: Option<u64>,
    /// Extra delay given to a packet the fault plan reorders.
    pub reorder_delay: Duration,
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel {
            latency: Duration::from_micros(2),
            jitter: Duration::ZERO,
            bytes_per_sec: None,
            reorder_delay: Duration::from_micros(50),
        }
    }
}

/// What the fabric did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricStats {
    /// Packets handed to a device.
    pub delivered: u64,
    /// Packets the fault plan dropped.
    pub dropped: u64,
    /// Extra copies the fault plan made.
    pub duplicated: u64,
    /// Packets the fault plan corrupted.
    pub corrupted: u64,
    /// Packets the fault plan delayed behind later ones.
    pub reordered: u64,
    /// Packets addressed to no device.
    pub undeliverable: u64,
}

#[derive(Debug)]
struct InFlight {
    from: SocketAddr,
    to: usize,
    bytes: Vec<u8>,
}

#[derive(Debug)]
struct State {
    start: Instant,
    now: Instant,
    nodes: Vec<Arc<DevInner>>,
    by_addr: HashMap<SocketAddr, usize>,
    events: BinaryHeap<Reverse<(Instant, u64)>>,
    in_flight: HashMap<u64, InFlight>,
    seq: u64,
    egress_free_at: Vec<Instant>,
    faults: FaultPlan,
    link: LinkModel,
    stats: FabricStats,
    buf: Vec<u8>,
}

/// A simulated fabric of software devices on a virtual clock.
#[derive(Debug)]
pub struct Fabric {
    st: Mutex<State>,
    seed: u64,
}

impl Fabric {
    /// An empty fabric whose randomness (faults, jitter, device keys) derives from `seed`.
    pub fn new(seed: u64, link: LinkModel) -> Fabric {
        // The wall clock only provides an origin; virtual time advances from it.
        let start = wall_now();
        Fabric {
            st: Mutex::new(State {
                start,
                now: start,
                nodes: Vec::new(),
                by_addr: HashMap::new(),
                events: BinaryHeap::new(),
                in_flight: HashMap::new(),
                seq: 0,
                egress_free_at: Vec::new(),
                faults: FaultPlan::new(seed ^ 0xfa17, FaultRates::default()),
                link,
                stats: FabricStats::default(),
                buf: Vec::new(),
            }),
            seed,
        }
    }

    /// The seed this fabric was made with (print it when a test fails).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Adds a device; its address is 127.77.x.y:4791 (never used on a real network).
    pub fn add_device(&self, mut nic: NicConfig) -> SoftDevice {
        let mut st = self.st.lock();
        let i = st.nodes.len();
        let ip = Ipv4Addr::new(127, 77, (i >> 8) as u8, (i & 0xff) as u8 + 1);
        let addr = SocketAddr::new(IpAddr::V4(ip), 4791);
        nic.seed = nic.seed.wrapping_add(self.seed.wrapping_mul(31)).wrapping_add(i as u64);
        let dev = SoftDevice::new_sim(addr, nic);
        st.nodes.push(dev.inner().clone());
        st.by_addr.insert(addr, i);
        let now = st.now;
        st.egress_free_at.push(now);
        dev
    }

    /// Runs `f` on the fault plan (rates and rules).
    pub fn with_faults<R>(&self, f: impl FnOnce(&mut FaultPlan) -> R) -> R {
        f(&mut self.st.lock().faults)
    }

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        self.st.lock().now
    }

    /// Virtual time since the fabric was made.
    pub fn elapsed(&self) -> Duration {
        let st = self.st.lock();
        st.now - st.start
    }

    /// What the fabric did so far.
    pub fn stats(&self) -> FabricStats {
        self.st.lock().stats.clone()
    }

    /// One round of work; `false` when nothing is pending anywhere (idle forever).
    pub fn step(&self) -> bool {
        self.step_within(None)
    }

    /// Moves the clock forward to `t` (never backward): for drivers whose own timers (an
    /// application's, say) fall between fabric events.
    pub fn advance_to(&self, t: Instant) {
        let mut st = self.st.lock();
        st.now = st.now.max(t);
    }

    /// Like [`Fabric::step`], but an idle jump of the clock stops at `horizon` (the next
    /// deadline of something outside the fabric).
    pub fn step_within(&self, horizon: Option<Instant>) -> bool {
        let mut st = self.st.lock();
        let st = &mut *st;
        let now = st.now;
        let mut busy = false;
        for i in 0..st.nodes.len() {
            loop {
                let node = st.nodes[i].clone();
                let dest = node.core.lock().poll_transmit(now, &mut st.buf);
                let Some(dest) = dest else { break };
                busy = true;
                let bytes = std::mem::take(&mut st.buf);
                st.schedule(i, dest, bytes);
            }
        }
        while let Some(&Reverse((t, id))) = st.events.peek() {
            if t > now {
                break;
            }
            st.events.pop();
            let Some(pkt) = st.in_flight.remove(&id) else { continue };
            st.stats.delivered += 1;
            let node = st.nodes[pkt.to].clone();
            node.core.lock().handle_packet(now, pkt.from, &pkt.bytes);
            busy = true;
        }
        if busy {
            return true;
        }
        let mut next: Option<Instant> = st.events.peek().map(|Reverse((t, _))| *t);
        for node in &st.nodes {
            let mut core = node.core.lock();
            if let Some(t) = core.poll_timeout() {
                if t <= now {
                    core.handle_timeout(now);
                    busy = true;
                } else {
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
        }
        if busy {
            return true;
        }
        match (next, horizon) {
            (Some(t), Some(h)) if h < t => {
                st.now = st.now.max(h);
                true
            }
            (Some(t), _) => {
                st.now = t;
                true
            }
            (None, Some(h)) if h > st.now => {
                st.now = h;
                true
            }
            (None, _) => false,
        }
    }

    /// Steps until `done()` holds (true) or `limit` of virtual time passes or the fabric goes
    /// idle with `done()` still false (false).
    pub fn run_until(&self, mut done: impl FnMut() -> bool, limit: Duration) -> bool {
        let deadline = self.now() + limit;
        loop {
            if done() {
                return true;
            }
            if self.now() > deadline || !self.step() {
                return done();
            }
        }
    }

    /// Steps for `d` of virtual time (the clock jumps over idle stretches).
    pub fn run_for(&self, d: Duration) {
        let deadline = self.now() + d;
        loop {
            let more = self.step();
            let mut st = self.st.lock();
            if st.now >= deadline {
                return;
            }
            if !more {
                st.now = deadline;
                return;
            }
            // Do not run past the deadline just because the next event is later.
            if let Some(Reverse((t, _))) = st.events.peek() {
                if *t > deadline
                    && st
                        .nodes
                        .iter()
                        .all(|n| n.core.lock().poll_timeout().is_none_or(|x| x > deadline))
                {
                    st.now = deadline;
                    return;
                }
            }
        }
    }
}

impl State {
    fn schedule(&mut self, from_idx: usize, to: SocketAddr, mut bytes: Vec<u8>) {
        let from = self.nodes[from_idx].local;
        let Some(&to_idx) = self.by_addr.get(&to) else {
            self.stats.undeliverable += 1;
            return;
        };
        let verdict = self.faults.judge(from, to, &bytes);
        let mut extra = Duration::ZERO;
        let mut copies = 1;
        match verdict {
            Verdict::Pass => {}
            Verdict::Drop => {
                self.stats.dropped += 1;
                return;
            }
            Verdict::Duplicate => {
                self.stats.duplicated += 1;
                copies = 2;
            }
            Verdict::Corrupt => {
                self.stats.corrupted += 1;
                self.faults.corrupt(&mut bytes);
            }
            Verdict::Reorder => {
                self.stats.reordered += 1;
                extra = self.link.reorder_delay;
            }
        }
        let serialization = self.link.bytes_per_sec.map_or(Duration::ZERO, |r| {
            Duration::from_nanos(bytes.len() as u64 * 1_000_000_000 / r.max(1))
        });
        let start = self.egress_free_at[from_idx].max(self.now);
        self.egress_free_at[from_idx] = start + serialization;
        let jitter = Duration::from_nanos(self.faults.below(self.link.jitter.as_nanos() as u64));
        let at = start + serialization + self.link.latency + jitter + extra;
        for c in 0..copies {
            let id = self.seq;
            self.seq += 1;
            let pkt_bytes =
                if c + 1 == copies { std::mem::take(&mut bytes) } else { bytes.clone() };
            self.in_flight.insert(id, InFlight { from, to: to_idx, bytes: pkt_bytes });
            self.events.push(Reverse((at, id)));
        }
    }
}
