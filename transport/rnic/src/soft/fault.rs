//! Seeded packet faults, shared by the in-memory fabric and the UDP wire: random drop,
//! duplication, corruption and (fabric only) reordering, plus targeted rules that pick packets
//! by their headers ("drop the first ACK", "drop PSN 5 once").

use std::fmt;
use std::net::SocketAddr;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::packet::{self, Header};

/// What happens to one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Delivered unchanged.
    Pass,
    /// Lost.
    Drop,
    /// Delivered twice.
    Duplicate,
    /// Delivered with one bit flipped.
    Corrupt,
    /// Delivered after the packets behind it (fabric only; the UDP wire passes it).
    Reorder,
}

/// The packet a rule looks at.
#[derive(Clone, Copy, Debug)]
pub struct PacketInfo {
    /// Sender.
    pub from: SocketAddr,
    /// Receiver.
    pub to: SocketAddr,
    /// Its headers, when it parses.
    pub header: Option<Header>,
    /// Its length in bytes.
    pub len: usize,
}

type RuleFn = Box<dyn FnMut(&PacketInfo) -> Option<Verdict> + Send>;

/// Random fault rates (each in 0.0..=1.0).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    /// Probability a packet is lost.
    pub drop: f64,
    /// Probability a packet is delivered twice.
    pub duplicate: f64,
    /// Probability a packet has one bit flipped.
    pub corrupt: f64,
    /// Probability a packet is held back behind later ones.
    pub reorder: f64,
}

/// A seeded fault plan.
pub struct FaultPlan {
    rates: FaultRates,
    rng: ChaCha8Rng,
    rules: Vec<RuleFn>,
    seed: u64,
    /// Verdicts other than `Pass` handed out so far.
    pub faults_applied: u64,
}

impl fmt::Debug for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultPlan")
            .field("rates", &self.rates)
            .field("seed", &self.seed)
            .field("rules", &self.rules.len())
            .finish()
    }
}

impl FaultPlan {
    /// A plan with `rates` and a seed for its random choices.
    pub fn new(seed: u64, rates: FaultRates) -> FaultPlan {
        FaultPlan {
            rates,
            rng: ChaCha8Rng::seed_from_u64(seed),
            rules: Vec::new(),
            seed,
            faults_applied: 0,
        }
    }

    /// A plan that never interferes.
    pub fn none() -> FaultPlan {
        FaultPlan::new(0, FaultRates::default())
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Replaces the random rates.
    pub fn set_rates(&mut self, rates: FaultRates) {
        self.rates = rates;
    }

    /// Adds a rule; the first rule that returns a verdict decides, before the random rates.
    pub fn add_rule(&mut self, rule: impl FnMut(&PacketInfo) -> Option<Verdict> + Send + 'static) {
        self.rules.push(Box::new(rule));
    }

    /// Removes every rule.
    pub fn clear_rules(&mut self) {
        self.rules.clear();
    }

    /// Decides the fate of one packet.
    pub fn judge(&mut self, from: SocketAddr, to: SocketAddr, bytes: &[u8]) -> Verdict {
        let v = self.judge_inner(from, to, bytes);
        if v != Verdict::Pass {
            self.faults_applied += 1;
        }
        v
    }

    fn judge_inner(&mut self, from: SocketAddr, to: SocketAddr, bytes: &[u8]) -> Verdict {
        if !self.rules.is_empty() {
            let info = PacketInfo {
                from,
                to,
                header: packet::parse(bytes).ok().map(|p| p.header),
                len: bytes.len(),
            };
            for rule in &mut self.rules {
                if let Some(v) = rule(&info) {
                    return v;
                }
            }
        }
        let r = self.rates;
        if r == FaultRates::default() {
            return Verdict::Pass;
        }
        let x: f64 = self.rng.random();
        let mut edge = r.drop;
        if x < edge {
            return Verdict::Drop;
        }
        edge += r.duplicate;
        if x < edge {
            return Verdict::Duplicate;
        }
        edge += r.corrupt;
        if x < edge {
            return Verdict::Corrupt;
        }
        edge += r.reorder;
        if x < edge {
            return Verdict::Reorder;
        }
        Verdict::Pass
    }

    /// Flips one random bit of `bytes`.
    pub fn corrupt(&mut self, bytes: &mut [u8]) {
        if bytes.is_empty() {
            return;
        }
        let i = self.rng.random_range(0..bytes.len());
        let bit = self.rng.random_range(0..8);
        bytes[i] ^= 1 << bit;
    }

    /// A random value in `0..n` from the plan's generator (for jitter).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.rng.random_range(0..n)
        }
    }
}

/// A rule that applies `verdict` to the `nth` (0-based) packet matching `pred`, once.
pub fn nth_matching(
    nth: usize,
    verdict: Verdict,
    mut pred: impl FnMut(&PacketInfo) -> bool + Send + 'static,
) -> impl FnMut(&PacketInfo) -> Option<Verdict> + Send + 'static {
    let mut seen = 0usize;
    move |p| {
        if pred(p) {
            seen += 1;
            if seen == nth + 1 {
                return Some(verdict);
            }
        }
        None
    }
}
