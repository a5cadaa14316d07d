//! One cell of the benchmark: a closed loop of `outstanding` tasks against one transport's
//! `PsClient`, on a warm table (a random window of a small key universe created first) or
//! insert-heavy (fresh keys on every request), measured after a warm-up for a fixed time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bex_bench::clock::Clock;
use bex_bench::stats::{LatencyRecorder, LatencySummary};
use bex_client::fanout::{PsClient, PsError};
use bex_transport::TransportKind;
use serde::Serialize;

use crate::usage::CellUsage;
use crate::{Result, DIM, TABLE};

/// The request a cell sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Fetch the keys' rows.
    #[value(alias = "fetch")]
    Pull,
    /// Push a gradient for every key.
    Push,
}

/// Which keys a cell's requests name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A random window of 8 requests' worth of keys, created before the cell.
    Warm,
    /// Fresh keys on every request (each request creates its rows).
    Insert,
}

macro_rules! display_as_value {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                use clap::ValueEnum;
                let v = self.to_possible_value().expect("no variant is skipped");
                f.write_str(v.get_name())
            }
        }
    };
}
display_as_value!(Op);
display_as_value!(Mode);

/// What the cells of a run vary and how long each runs.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// The CI smoke run's defaults.
    pub quick: bool,
    /// Keys per request.
    pub keys: Vec<usize>,
    /// Requests in flight.
    pub outstanding: Vec<usize>,
    /// Transports, each measured at every other setting.
    pub transports: Vec<TransportKind>,
    /// Requests.
    pub ops: Vec<Op>,
    /// Key choices.
    pub modes: Vec<Mode>,
    /// Measured time per cell.
    pub seconds: f64,
    /// Unmeasured time before each cell.
    pub warmup_seconds: f64,
    /// Fresh rows an insert-heavy cell may create while measured (at least 100 requests'
    /// worth; the warm-up a quarter of it).
    pub max_insert_rows: u64,
}

impl Settings {
    /// The cells, in the order they run: by mode, op, keys, outstanding, then transport.
    pub fn cells(&self) -> Vec<CellSpec> {
        let mut v = Vec::new();
        for &mode in &self.modes {
            for &op in &self.ops {
                for &keys in &self.keys {
                    for &outstanding in &self.outstanding {
                        for &kind in &self.transports {
                            v.push(CellSpec { op, mode, keys, outstanding, kind });
                        }
                    }
                }
            }
        }
        v
    }
}

/// One cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellSpec {
    /// Its request.
    pub op: Op,
    /// Its keys.
    pub mode: Mode,
    /// Keys per request.
    pub keys: usize,
    /// Requests in flight.
    pub outstanding: usize,
    /// Its transport.
    pub kind: TransportKind,
}

impl CellSpec {
    /// True when `other` is the same cell on another transport.
    pub fn same_load(&self, other: &CellSpec) -> bool {
        (self.op, self.mode, self.keys, self.outstanding)
            == (other.op, other.mode, other.keys, other.outstanding)
    }
}

/// Why a cell stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// Its measured time ran out.
    Time,
    /// An insert-heavy cell created `max_insert_rows` rows.
    InsertCap,
}

/// What one cell measured.
#[derive(Debug)]
pub struct CellResult {
    /// The cell.
    pub spec: CellSpec,
    /// Measured requests that succeeded.
    pub requests: u64,
    /// Their latency (none without any).
    pub latency: Option<LatencySummary>,
    /// Measured requests that failed.
    pub errors: u64,
    /// The first failure.
    pub first_error: Option<String>,
    /// From the end of the warm-up to the last measured completion.
    pub elapsed: Duration,
    /// Why it stopped.
    pub stopped_by: Stop,
    /// What the cell cost both processes, from its start to its end (warm-up included).
    pub usage: CellUsage,
}

/// A latency statistic: which field of the summary.
pub type Stat = fn(&LatencySummary) -> f64;

/// The median.
pub const P50: Stat = |s| s.p50_us;
/// The 99th percentile.
pub const P99: Stat = |s| s.p99_us;
/// The 99.9th percentile.
pub const P999: Stat = |s| s.p999_us;
/// The mean.
pub const MEAN: Stat = |s| s.mean_us;
/// The maximum.
pub const MAX: Stat = |s| s.max_us;

impl CellResult {
    /// A latency statistic in µs, if any request succeeded.
    pub fn us(&self, stat: Stat) -> Option<f64> {
        self.latency.as_ref().map(stat)
    }

    /// Measured requests per second.
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A small xorshift generator, seeded per task (no shared state on the hot path).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Key `i` of the warm universe of a cell with `k` keys per request.
fn warm_key(k: usize, i: u64) -> u64 {
    ((k as u64) << 40) | i
}

/// Fresh-key counter for insert-heavy cells: never reused across cells.
static FRESH: AtomicU64 = AtomicU64::new(0);

/// What one load task hands back.
struct TaskResult {
    latency: LatencyRecorder,
    errors: u64,
    first_error: Option<String>,
    last: Instant,
}

/// Runs cell number `index` (which seeds its tasks' generators) against `client`.
pub async fn run_cell(
    client: Arc<PsClient>,
    spec: CellSpec,
    settings: &Settings,
    index: u64,
) -> Result<CellResult> {
    let clock = Clock;
    let k = spec.keys;
    // Warm universe: 8 requests' worth of keys, created before measuring.
    let universe = (k * 8) as u64;
    if spec.mode == Mode::Warm {
        for chunk in 0..8u64 {
            let ks: Vec<u64> =
                (chunk * k as u64..(chunk + 1) * k as u64).map(|i| warm_key(k, i)).collect();
            client.fetch(TABLE, DIM, &ks).await.map_err(|e| format!("warming the table: {e}"))?;
        }
    }
    let measure_from = clock.deadline(Duration::from_secs_f64(settings.warmup_seconds));
    let end = measure_from + Duration::from_secs_f64(settings.seconds);
    // Insert-heavy cells create rows that are never removed: at most `max_rows` in the
    // measured window and a quarter of that in the warm-up; at least 100 measured requests'
    // worth, so 10 000-key cells have some samples.
    let max_rows = settings.max_insert_rows.max(100 * k as u64);
    let max_warm_rows = max_rows / 4;
    let warm_rows = Arc::new(AtomicU64::new(0));
    let measured_rows = Arc::new(AtomicU64::new(0));
    let capped = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..spec.outstanding {
        let client = client.clone();
        let capped = capped.clone();
        let (warm_rows, measured_rows) = (warm_rows.clone(), measured_rows.clone());
        tasks.push(tokio::spawn(async move {
            let mut latency = LatencyRecorder::new();
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (index << 20) ^ (t as u64 + 1));
            let grads = vec![1e-3f32; k * DIM as usize];
            let mut ks = vec![0u64; k];
            let (mut errors, mut first_error) = (0u64, None);
            let mut last = clock.now();
            loop {
                match spec.mode {
                    Mode::Warm => {
                        let off = rng.next() % universe;
                        for (j, key) in ks.iter_mut().enumerate() {
                            *key = warm_key(k, (off + j as u64) % universe);
                        }
                    }
                    Mode::Insert => {
                        let measuring = clock.now() >= measure_from;
                        let (budget, limit) = if measuring {
                            (&measured_rows, max_rows)
                        } else {
                            (&warm_rows, max_warm_rows)
                        };
                        if budget.fetch_add(k as u64, Ordering::Relaxed) + k as u64 > limit {
                            if measuring {
                                capped.store(true, Ordering::Relaxed);
                                break;
                            }
                            // Warm-up budget spent: wait out the warm-up without inserting.
                            tokio::time::sleep_until(measure_from.into()).await;
                            continue;
                        }
                        let base = FRESH.fetch_add(k as u64, Ordering::Relaxed);
                        for (j, key) in ks.iter_mut().enumerate() {
                            *key = (1u64 << 60) | (base + j as u64);
                        }
                    }
                }
                let t0 = clock.now();
                if t0 >= end {
                    break;
                }
                let r = match spec.op {
                    Op::Pull => client.fetch(TABLE, DIM, &ks).await.and_then(|rows| {
                        if rows.len() == k * DIM as usize {
                            Ok(())
                        } else {
                            Err(PsError::Protocol(format!("{} floats for {k} keys", rows.len())))
                        }
                    }),
                    Op::Push => client.push(TABLE, DIM, &ks, &grads).await,
                };
                let t1 = clock.now();
                if t0 >= measure_from {
                    last = t1;
                    match r {
                        Ok(()) => latency.record(t1 - t0),
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e.to_string());
                        }
                    }
                }
            }
            TaskResult { latency, errors, first_error, last }
        }));
    }
    let mut latency = LatencyRecorder::new();
    let (mut errors, mut first_error, mut last) = (0, None, measure_from);
    for t in tasks {
        let r = t.await.map_err(|e| format!("a load task failed: {e}"))?;
        latency.merge(&r.latency);
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
        last = last.max(r.last);
    }
    Ok(CellResult {
        spec,
        requests: latency.len(),
        latency: latency.summary(),
        errors,
        first_error,
        elapsed: last.saturating_duration_since(measure_from),
        stopped_by: if capped.load(Ordering::Relaxed) { Stop::InsertCap } else { Stop::Time },
        usage: CellUsage::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            quick: true,
            keys: vec![100, 1000],
            outstanding: vec![1, 16],
            transports: vec![TransportKind::Rdma, TransportKind::Tcp],
            ops: vec![Op::Pull],
            modes: vec![Mode::Warm, Mode::Insert],
            seconds: 0.1,
            warmup_seconds: 0.0,
            max_insert_rows: 10,
        }
    }

    #[test]
    fn cells_cover_every_combination_transports_innermost() {
        let cells = settings().cells();
        assert_eq!(cells.len(), 2 * 2 * 2 * 2);
        assert_eq!((cells[0].kind, cells[1].kind), (TransportKind::Rdma, TransportKind::Tcp));
        assert!(cells[0].same_load(&cells[1]));
        assert!(!cells[0].same_load(&cells[2]));
        assert_eq!(cells.last().unwrap().mode, Mode::Insert);
    }

    #[test]
    fn names_are_the_command_line_values() {
        assert_eq!(
            (Op::Pull.to_string(), Mode::Insert.to_string()),
            ("pull".into(), "insert".into())
        );
        assert_eq!(serde_json::to_value(Stop::InsertCap).unwrap(), "insert_cap");
        let s = serde_json::to_value(settings()).unwrap();
        assert_eq!(s["transports"], serde_json::json!(["rdma", "tcp"]));
    }

    #[test]
    fn warm_keys_of_different_cells_never_meet_and_fresh_keys_are_apart() {
        assert_ne!(warm_key(100, 5), warm_key(1000, 5));
        assert!(warm_key(10_000, 80_000) < 1 << 60);
    }

    #[test]
    fn an_empty_cell_has_no_percentiles_and_no_rate() {
        let r = CellResult {
            spec: settings().cells()[0],
            requests: 0,
            latency: LatencyRecorder::new().summary(),
            errors: 0,
            first_error: None,
            elapsed: Duration::ZERO,
            stopped_by: Stop::Time,
            usage: CellUsage::default(),
        };
        assert_eq!((r.us(P50), r.us(MEAN)), (None, None));
        assert_eq!(r.rps(), 0.0);
    }
}
