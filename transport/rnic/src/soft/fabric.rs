//! An in-memory fabric: many software devices in one process, one virtual clock, seeded
//! faults. Nothing sleeps and nothing reads the wall clock after construction, so a run is a
//! pure function of its seed and the test's actions: a failing run replays exactly.
//!
//! The test thread alternates between acting on devices (post, poll) and pumping the fabric
//! ([`Fabric::step`], [`Fabric::run_until`]). Each step transmits what every device has ready,
//! delivers the packets due now, fires due timers, and otherwise advances the clock to the
//! next event.
//!
//! Two link models: the default joins every pair of devices by a private link (a device's
//! egress rate, latency, jitter). [`Fabric::with_switch`] adds one output-queued switch: each
//! device's uplink (its egress rate) feeds per-destination egress ports, each with a rate and
//! a buffer, either drop-tail or lossless with PFC-like XOFF/XON backpressure that stops the
//! senders feeding a congested port. Per-link faults (drop, extra delay, partition) and QP
//! error injection work with both.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// PFC thresholds of a switch egress port (bytes queued).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pfc {
    /// Above this the port pauses the senders feeding it (one pause event per XOFF episode).
    pub xoff_bytes: u64,
    /// Paused senders resume once the queue has drained below this.
    pub xon_bytes: u64,
}

/// An output-queued switch joining every device: one egress port per device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwitchModel {
    /// Rate of each egress port (towards its device); `None` for infinitely fast ports.
    pub port_bytes_per_sec: Option<u64>,
    /// Buffer of each port: the drop-tail limit when PFC is off.
    pub buffer_bytes: u64,
    /// Lossless backpressure; `None` = drop-tail.
    pub pfc: Option<Pfc>,
}

impl Default for SwitchModel {
    fn default() -> Self {
        // 25 Gb/s ports, as the paper's NICs.
        SwitchModel {
            port_bytes_per_sec: Some(25_000_000_000 / 8),
            buffer_bytes: 4 << 20,
            pfc: Some(Pfc { xoff_bytes: 4 << 20, xon_bytes: (4 << 20) - (64 << 10) }),
        }
    }
}

/// Faults of one directed link (device → device), on top of the fabric's fault plan.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFault {
    /// Probability a packet on this link is lost.
    pub drop: f64,
    /// Added to every packet's delay.
    pub extra_delay: Duration,
    /// Every packet is lost.
    pub partitioned: bool,
}

/// What one round of the fabric at the current time found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricTick {
    /// Packets moved or timers fired: there may be more to do at this instant.
    Worked,
    /// Nothing to do now; `next` is when something is (never, if `None`).
    Idle {
        /// The next packet arrival, timer or free uplink.
        next: Option<Instant>,
    },
}

/// What the switch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SwitchStats {
    /// XOFF episodes (a port crossing XOFF while not already paused).
    pub pause_events: u64,
    /// Times a sender was stopped by a paused port.
    pub senders_paused: u64,
    /// Virtual time from the fabric's start to the first pause.
    pub first_pause: Option<Duration>,
    /// Packets a full drop-tail port discarded.
    pub tail_drops: u64,
    /// Largest queue any port held (bytes).
    pub max_queue_bytes: u64,
}

#[derive(Clone, Debug, Default)]
struct Port {
    /// When the port's queue empties, given what it holds.
    free_at: Option<Instant>,
    paused: bool,
    high_water: u64,
}

impl Port {
    fn backlog(&self, now: Instant, rate: Option<u64>) -> u64 {
        match (self.free_at, rate) {
            (Some(t), Some(r)) if t > now => bytes_in(t - now, r),
            _ => 0,
        }
    }
}

fn wire_time(len: u64, rate: u64) -> Duration {
    Duration::from_nanos(len.saturating_mul(1_000_000_000) / rate.max(1))
}

fn bytes_in(d: Duration, rate: u64) -> u64 {
    (d.as_nanos() * rate as u128 / 1_000_000_000) as u64
}

#[derive(Debug)]
struct Switch {
    model: SwitchModel,
    ports: Vec<Port>,
    paused_until: Vec<Instant>,
    stats: SwitchStats,
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
    /// Packets lost to per-link faults (drop or partition).
    pub link_dropped: u64,
}

#[derive(Debug)]
struct InFlight {
    from: SocketAddr,
    from_idx: usize,
    to: usize,
    bytes: Vec<u8>,
    /// On its way to the switch (switch mode) rather than to the device.
    to_switch: bool,
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
    switch: Option<Switch>,
    /// Switch mode: devices that may have a packet to send (the rest are not polled).
    tx_ready: Vec<bool>,
    link_faults: HashMap<(usize, usize), LinkFault>,
    link_rng: ChaCha8Rng,
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
        Fabric::build(seed, link, None)
    }

    /// Like [`Fabric::new`], with every device behind one switch: `link.bytes_per_sec` is
    /// each device's uplink rate and `link.latency` the delay of each hop (device → switch,
    /// switch → device).
    pub fn with_switch(seed: u64, link: LinkModel, switch: SwitchModel) -> Fabric {
        Fabric::build(seed, link, Some(switch))
    }

    fn build(seed: u64, link: LinkModel, switch: Option<SwitchModel>) -> Fabric {
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
                tx_ready: Vec::new(),
                switch: switch.map(|model| Switch {
                    model,
                    ports: Vec::new(),
                    paused_until: Vec::new(),
                    stats: SwitchStats::default(),
                }),
                link_faults: HashMap::new(),
                link_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x11_4c),
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
        st.tx_ready.push(true);
        if let Some(sw) = &mut st.switch {
            sw.ports.push(Port::default());
            sw.paused_until.push(now);
        }
        dev
    }

    /// The index of the device at `addr` (devices are numbered in the order added).
    pub fn index_of(&self, addr: SocketAddr) -> Option<usize> {
        self.st.lock().by_addr.get(&addr).copied()
    }

    /// Tells a switched fabric that device `dev` may have something new to send (its owner
    /// posted work): only such devices, and those that received a packet or fired a timer,
    /// are polled. Devices beyond the fabric's are ignored; the default fabric polls all.
    pub fn touch(&self, dev: usize) {
        if let Some(r) = self.st.lock().tx_ready.get_mut(dev) {
            *r = true;
        }
    }

    /// Sets the faults of the directed link `from → to` (device indices); the default
    /// `LinkFault` clears them.
    pub fn set_link_fault(&self, from: usize, to: usize, fault: LinkFault) {
        let mut st = self.st.lock();
        if fault == LinkFault::default() {
            st.link_faults.remove(&(from, to));
        } else {
            st.link_faults.insert((from, to), fault);
        }
    }

    /// Cuts (or heals) both directions between devices `a` and `b`.
    pub fn partition(&self, a: usize, b: usize, on: bool) {
        for (x, y) in [(a, b), (b, a)] {
            let mut f = self.st.lock().link_faults.get(&(x, y)).copied().unwrap_or_default();
            f.partitioned = on;
            self.set_link_fault(x, y, f);
        }
    }

    /// Moves QP `qpn` of device `dev` to ERROR, as a hardware fault would (outstanding work
    /// is flushed with errors).
    pub fn inject_qp_error(&self, dev: usize, qpn: u32) -> crate::Result<()> {
        let node = self.st.lock().nodes.get(dev).cloned();
        match node {
            Some(n) => n.core.lock().modify_to_error(qpn),
            None => Err(crate::Error::InvalidArgument(format!("no fabric device {dev}"))),
        }
    }

    /// What the switch did (`None` without one).
    pub fn switch_stats(&self) -> Option<SwitchStats> {
        self.st.lock().switch.as_ref().map(|s| s.stats.clone())
    }

    /// Largest queue port `dev` of the switch ever held (bytes).
    pub fn port_high_water(&self, dev: usize) -> Option<u64> {
        self.st.lock().switch.as_ref().and_then(|s| s.ports.get(dev)).map(|p| p.high_water)
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
        let tick = st.tick();
        st.jump(tick, horizon)
    }

    /// Does the work due at the current time without moving the clock: for drivers that
    /// keep the fabric in step with another clock (see [`Fabric::advance_to`]).
    pub fn step_at_now(&self) -> FabricTick {
        self.st.lock().tick()
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
    /// Per-link faults of `from → to`: `None` when the packet is lost, else the extra delay.
    fn link_verdict(&mut self, from: usize, to: usize) -> Option<Duration> {
        let Some(f) = self.link_faults.get(&(from, to)).copied() else {
            return Some(Duration::ZERO);
        };
        if f.partitioned || (f.drop > 0.0 && self.link_rng.random::<f64>() < f.drop) {
            self.stats.link_dropped += 1;
            return None;
        }
        Some(f.extra_delay)
    }

    /// The fault plan's verdict: `None` when lost, else (copies, extra delay).
    fn plan_verdict(
        &mut self,
        from: SocketAddr,
        to: SocketAddr,
        bytes: &mut [u8],
    ) -> Option<(u32, Duration)> {
        match self.faults.judge(from, to, bytes) {
            Verdict::Pass => Some((1, Duration::ZERO)),
            Verdict::Drop => {
                self.stats.dropped += 1;
                None
            }
            Verdict::Duplicate => {
                self.stats.duplicated += 1;
                Some((2, Duration::ZERO))
            }
            Verdict::Corrupt => {
                self.stats.corrupted += 1;
                self.faults.corrupt(bytes);
                Some((1, Duration::ZERO))
            }
            Verdict::Reorder => {
                self.stats.reordered += 1;
                Some((1, self.link.reorder_delay))
            }
        }
    }

    fn push_event(&mut self, at: Instant, pkt: InFlight) {
        let id = self.seq;
        self.seq += 1;
        self.in_flight.insert(id, pkt);
        self.events.push(Reverse((at, id)));
    }

    /// One round of the plain (switchless) fabric at the current time.
    fn tick_plain(&mut self) -> FabricTick {
        let now = self.now;
        let mut busy = false;
        for i in 0..self.nodes.len() {
            loop {
                let node = self.nodes[i].clone();
                let dest = node.core.lock().poll_transmit(now, &mut self.buf);
                let Some(dest) = dest else { break };
                busy = true;
                let bytes = std::mem::take(&mut self.buf);
                self.schedule(i, dest, bytes);
            }
        }
        while let Some(&Reverse((t, id))) = self.events.peek() {
            if t > now {
                break;
            }
            self.events.pop();
            let Some(pkt) = self.in_flight.remove(&id) else { continue };
            self.stats.delivered += 1;
            let node = self.nodes[pkt.to].clone();
            node.core.lock().handle_packet(now, pkt.from, &pkt.bytes);
            busy = true;
        }
        if busy {
            return FabricTick::Worked;
        }
        let mut next: Option<Instant> = self.events.peek().map(|Reverse((t, _))| *t);
        for node in &self.nodes {
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
            return FabricTick::Worked;
        }
        FabricTick::Idle { next }
    }

    fn tick(&mut self) -> FabricTick {
        if self.switch.is_some() {
            self.tick_switched()
        } else {
            self.tick_plain()
        }
    }

    /// After an idle tick, moves the clock to the next event, but not past `horizon`.
    fn jump(&mut self, tick: FabricTick, horizon: Option<Instant>) -> bool {
        let FabricTick::Idle { next } = tick else { return true };
        match (next, horizon) {
            (Some(t), Some(h)) if h < t => {
                self.now = self.now.max(h);
                true
            }
            (Some(t), _) => {
                self.now = t;
                true
            }
            (None, Some(h)) if h > self.now => {
                self.now = h;
                true
            }
            (None, _) => false,
        }
    }

    /// One round in switch mode: uplinks transmit one packet each when free and not paused,
    /// the switch enqueues arrivals, ports deliver, timers fire.
    fn tick_switched(&mut self) -> FabricTick {
        let now = self.now;
        let mut busy = false;
        let rate = self.link.bytes_per_sec;
        for i in 0..self.nodes.len() {
            if !self.tx_ready[i] {
                continue;
            }
            loop {
                let paused = self.switch.as_ref().is_some_and(|s| s.paused_until[i] > now);
                if paused || self.egress_free_at[i] > now {
                    break;
                }
                let node = self.nodes[i].clone();
                let dest = node.core.lock().poll_transmit(now, &mut self.buf);
                let Some(dest) = dest else {
                    self.tx_ready[i] = false;
                    break;
                };
                busy = true;
                let bytes = std::mem::take(&mut self.buf);
                let ser = rate.map_or(Duration::ZERO, |r| wire_time(bytes.len() as u64, r));
                self.egress_free_at[i] = now + ser;
                self.send_to_switch(i, dest, bytes, now + ser);
            }
        }
        while let Some(&Reverse((t, id))) = self.events.peek() {
            if t > now {
                break;
            }
            self.events.pop();
            let Some(pkt) = self.in_flight.remove(&id) else { continue };
            busy = true;
            if pkt.to_switch {
                self.switch_arrival(pkt);
            } else {
                self.stats.delivered += 1;
                self.tx_ready[pkt.to] = true;
                let node = self.nodes[pkt.to].clone();
                node.core.lock().handle_packet(now, pkt.from, &pkt.bytes);
            }
        }
        if busy {
            return FabricTick::Worked;
        }
        let mut next: Option<Instant> = self.events.peek().map(|Reverse((t, _))| *t);
        let mut earliest = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        let paused_until = self.switch.as_ref().map(|s| &s.paused_until);
        for (i, node) in self.nodes.iter().enumerate() {
            let mut core = node.core.lock();
            if let Some(t) = core.poll_timeout() {
                if t <= now {
                    self.tx_ready[i] = true;
                    core.handle_timeout(now);
                    // A due ACK waits for its busy or paused uplink (woken below), not for
                    // the clock: only a timer that moved counts as work, or a due ACK on an
                    // uplink free to send it now (else the clock would jump past it).
                    let uplink_free =
                        self.egress_free_at[i] <= now && paused_until.is_none_or(|p| p[i] <= now);
                    match core.poll_timeout() {
                        Some(t2) if t2 <= now && !uplink_free => {}
                        _ => busy = true,
                    }
                } else {
                    earliest(t);
                }
            }
        }
        // A busy or paused uplink may hold packets: wake when it frees (at most one idle
        // wake-up per transmission when it holds none).
        for (i, &free) in self.egress_free_at.iter().enumerate() {
            if !self.tx_ready[i] {
                continue;
            }
            let t = paused_until.map_or(free, |p| free.max(p[i]));
            if t > now {
                earliest(t);
            }
        }
        if busy {
            return FabricTick::Worked;
        }
        FabricTick::Idle { next }
    }

    /// A packet leaves device `from_idx` (fully serialized at `sent`) for the switch.
    fn send_to_switch(
        &mut self,
        from_idx: usize,
        to: SocketAddr,
        mut bytes: Vec<u8>,
        sent: Instant,
    ) {
        let from = self.nodes[from_idx].local;
        let Some(&to_idx) = self.by_addr.get(&to) else {
            self.stats.undeliverable += 1;
            return;
        };
        let Some(link_extra) = self.link_verdict(from_idx, to_idx) else { return };
        let Some((copies, extra)) = self.plan_verdict(from, to, &mut bytes) else { return };
        let jitter = Duration::from_nanos(self.faults.below(self.link.jitter.as_nanos() as u64));
        let at = sent + self.link.latency + jitter + extra + link_extra;
        for c in 0..copies {
            let b = if c + 1 == copies { std::mem::take(&mut bytes) } else { bytes.clone() };
            self.push_event(at, InFlight { from, from_idx, to: to_idx, bytes: b, to_switch: true });
        }
    }

    /// The switch takes a packet into the egress port towards `pkt.to`.
    fn switch_arrival(&mut self, mut pkt: InFlight) {
        let now = self.now;
        let latency = self.link.latency;
        let Some(sw) = self.switch.as_mut() else { return };
        let model = sw.model;
        let rate = model.port_bytes_per_sec;
        let len = pkt.bytes.len() as u64;
        let port = &mut sw.ports[pkt.to];
        let backlog = port.backlog(now, rate);
        if model.pfc.is_none() && backlog + len > model.buffer_bytes {
            sw.stats.tail_drops += 1;
            return;
        }
        // With PFC the port always accepts (the headroom absorbs what was on the wire).
        let depart = match rate {
            Some(r) => port.free_at.map_or(now, |t| t.max(now)) + wire_time(len, r),
            None => now,
        };
        port.free_at = Some(depart);
        let queued = backlog + len;
        port.high_water = port.high_water.max(queued);
        sw.stats.max_queue_bytes = sw.stats.max_queue_bytes.max(queued);
        if let (Some(p), Some(r)) = (model.pfc, rate) {
            if port.paused && backlog < p.xon_bytes {
                port.paused = false;
            }
            if !port.paused && queued > p.xoff_bytes {
                port.paused = true;
                sw.stats.pause_events += 1;
                if sw.stats.first_pause.is_none() {
                    sw.stats.first_pause = Some(now - self.start);
                }
            }
            if port.paused {
                // The sender stops until the queue would be below XON; a later arrival
                // that finds it still paused stops its sender again.
                let resume = depart.checked_sub(wire_time(p.xon_bytes, r)).unwrap_or(now).max(now);
                if resume > sw.paused_until[pkt.from_idx] {
                    sw.paused_until[pkt.from_idx] = resume;
                    sw.stats.senders_paused += 1;
                }
            }
        }
        pkt.to_switch = false;
        self.push_event(depart + latency, pkt);
    }

    fn schedule(&mut self, from_idx: usize, to: SocketAddr, mut bytes: Vec<u8>) {
        let from = self.nodes[from_idx].local;
        let Some(&to_idx) = self.by_addr.get(&to) else {
            self.stats.undeliverable += 1;
            return;
        };
        let link_extra = if self.link_faults.is_empty() {
            Duration::ZERO
        } else {
            match self.link_verdict(from_idx, to_idx) {
                Some(d) => d,
                None => return,
            }
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
        let at = start + serialization + self.link.latency + jitter + extra + link_extra;
        for c in 0..copies {
            let id = self.seq;
            self.seq += 1;
            let pkt_bytes =
                if c + 1 == copies { std::mem::take(&mut bytes) } else { bytes.clone() };
            self.in_flight.insert(
                id,
                InFlight { from, from_idx, to: to_idx, bytes: pkt_bytes, to_switch: false },
            );
            self.events.push(Reverse((at, id)));
        }
    }
}
