//! One measurement in its own process: the child side (run and print one line) and the parent
//! side (spawn, parse).

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use bex_bench::clock::Clock;
use bex_process::child::Guard;
use bex_rnic::soft::{Fabric, LinkModel, NicConfig};
use bex_rnic::{Device, Registrar};
use nix::sys::resource::{getrusage, UsageWho};
use rand::{Rng, SeedableRng};

use crate::workload::{self, Workload};
use crate::{Bemalloc, BenchAlloc};

/// What one cell measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CellResult {
    /// Allocator name.
    pub alloc: String,
    /// Workload name.
    pub workload: String,
    /// Threads.
    pub threads: usize,
    /// Allocations plus frees.
    pub ops: u64,
    /// CPU seconds (user + system) of the run.
    pub cpu_s: f64,
    /// Wall seconds of the run.
    pub wall_s: f64,
    /// Peak resident set of the process (`ru_maxrss`), KiB.
    pub peak_rss_kib: u64,
    /// Resident set high-water mark before the run, KiB.
    pub base_rss_kib: u64,
    /// Frees by a thread other than the allocating one.
    pub cross_frees: u64,
    /// Hand-offs that waited for room in a full queue.
    pub handoff_full: u64,
    /// Failed allocations.
    pub failures: u64,
    /// bemalloc: registered bytes at the end (they never shrink, so also the peak).
    pub registered_bytes: Option<u64>,
    /// bemalloc: registrations after the warm-up third.
    pub registrations_warm: Option<u64>,
    /// bemalloc: registrations at the end.
    pub registrations_end: Option<u64>,
}

impl CellResult {
    /// Operations per CPU-second.
    pub fn ops_per_cpu_s(&self) -> f64 {
        self.ops as f64 / self.cpu_s.max(1e-9)
    }
    /// Operations per wall-clock second.
    pub fn ops_per_wall_s(&self) -> f64 {
        self.ops as f64 / self.wall_s.max(1e-9)
    }

    /// The one line a child prints.
    pub fn to_line(&self) -> String {
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        format!(
            "CELL alloc={} workload={} threads={} ops={} cpu_s={} wall_s={} peak_rss_kib={} \
             base_rss_kib={} cross_frees={} handoff_full={} failures={} registered_bytes={} \
             registrations_warm={} registrations_end={}",
            self.alloc,
            self.workload,
            self.threads,
            self.ops,
            self.cpu_s,
            self.wall_s,
            self.peak_rss_kib,
            self.base_rss_kib,
            self.cross_frees,
            self.handoff_full,
            self.failures,
            opt(self.registered_bytes),
            opt(self.registrations_warm),
            opt(self.registrations_end),
        )
    }

    /// Parses [`CellResult::to_line`].
    pub fn parse(line: &str) -> Option<CellResult> {
        let rest = line.strip_prefix("CELL ")?;
        let kv: BTreeMap<&str, &str> = rest.split(' ').filter_map(|p| p.split_once('=')).collect();
        let num = |k: &str| kv.get(k)?.parse::<u64>().ok();
        let flt = |k: &str| kv.get(k)?.parse::<f64>().ok();
        Some(CellResult {
            alloc: kv.get("alloc")?.to_string(),
            workload: kv.get("workload")?.to_string(),
            threads: num("threads")? as usize,
            ops: num("ops")?,
            cpu_s: flt("cpu_s")?,
            wall_s: flt("wall_s")?,
            peak_rss_kib: num("peak_rss_kib")?,
            base_rss_kib: num("base_rss_kib")?,
            cross_frees: num("cross_frees")?,
            handoff_full: num("handoff_full")?,
            failures: num("failures")?,
            registered_bytes: num("registered_bytes"),
            registrations_warm: num("registrations_warm"),
            registrations_end: num("registrations_end"),
        })
    }
}

fn cpu_s() -> f64 {
    let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage(RUSAGE_SELF)");
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 * 1e-6;
    t(u.user_time()) + t(u.system_time())
}

fn max_rss_kib() -> u64 {
    getrusage(UsageWho::RUSAGE_SELF).map_or(0, |u| u.max_rss().max(0) as u64)
}

/// Runs one cell in this process with `alloc` and returns what it measured.
pub fn run_cell<A: BenchAlloc>(
    name: &str,
    alloc: &A,
    workload: Workload,
    threads: usize,
    steps: usize,
) -> CellResult {
    let base_rss_kib = max_rss_kib();
    let mut warm = None;
    let (c0, t0) = (cpu_s(), Clock.now());
    let counts = workload::run(alloc, workload, threads, steps, 0xa110c, || {
        warm = alloc.registration();
    });
    let (cpu, wall) = (cpu_s() - c0, (Clock.now() - t0).as_secs_f64());
    let end = alloc.registration();
    CellResult {
        alloc: name.to_string(),
        workload: workload.name().to_string(),
        threads,
        ops: counts.ops,
        cpu_s: cpu,
        wall_s: wall,
        peak_rss_kib: max_rss_kib(),
        base_rss_kib,
        cross_frees: counts.cross_frees,
        handoff_full: counts.handoff_full,
        failures: counts.failures,
        registered_bytes: end.map(|r| r.0),
        registrations_warm: warm.map(|r| r.1),
        registrations_end: end.map(|r| r.1),
    }
}

/// A software RNIC to register bemalloc pools with (an in-memory fabric: no sockets).
pub fn soft_registrar() -> (Fabric, Arc<dyn Registrar>) {
    let fabric = Fabric::new(1, LinkModel::default());
    let dev = fabric.add_device(NicConfig::default());
    let pd = dev.alloc_pd().expect("soft PD");
    let reg: Arc<dyn Registrar> = Arc::new(dev.registrar(&pd));
    (fabric, reg)
}

/// A bemalloc pool for the bench: registered with a soft RNIC, or not (`raw`).
pub fn bemalloc_pool(raw: bool) -> (Option<Fabric>, Bemalloc) {
    if raw {
        let pool = bemalloc::Pool::unregistered(bemalloc::PoolConfig::default());
        (None, Bemalloc(pool.expect("bemalloc pool")))
    } else {
        let (fabric, reg) = soft_registrar();
        (Some(fabric), Bemalloc(bemalloc::Pool::new(vec![reg]).expect("bemalloc pool")))
    }
}

/// One Figure 5 sample.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Sample {
    /// Milliseconds since the start.
    pub t_ms: u64,
    /// Registered bytes.
    #[serde(rename = "registered_bytes")]
    pub registered: u64,
    /// Live bytes.
    #[serde(rename = "live_bytes")]
    pub live: u64,
    /// Registrations so far.
    pub registrations: u64,
}

/// Figure 5 in this process: `threads` threads grow their live set linearly over the first
/// 40 % of `duration` (sizes mixed: 80 % small, 20 % large), then keep it constant while
/// replacing blocks; registered bytes are sampled every `every`. Prints `SAMPLE` lines.
pub fn run_footprint(threads: usize, duration: Duration, every: Duration) -> Vec<Sample> {
    let (_fabric, pool) = bemalloc_pool(false);
    let pool = &pool.0;
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let (done_tx, done_rx) = channel::<()>();
    let start = Clock.now();
    let ramp = duration.mul_f64(0.4);
    let mut samples = Vec::new();
    std::thread::scope(|s| {
        for me in 0..threads {
            let done_tx = done_tx.clone();
            let (stop, ops) = (&stop, &ops);
            s.spawn(move || {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5 + me as u64);
                let mut slots: Vec<Option<bemalloc::RegisteredBuf<'_>>> =
                    (0..1500).map(|_| None).collect();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let el = Clock.now() - start;
                    if el >= duration {
                        break;
                    }
                    let frac = (el.as_secs_f64() / ramp.as_secs_f64()).min(1.0);
                    let active = ((slots.len() as f64 * frac) as usize).max(1);
                    for _ in 0..256 {
                        let i = rng.random_range(0..active);
                        let w =
                            if rng.random_ratio(1, 5) { Workload::Large } else { Workload::Small };
                        let size = w.size(&mut rng);
                        slots[i] = None;
                        match pool.allocate(size) {
                            Ok(mut b) => {
                                let mut off = 0;
                                while off < size {
                                    b[off] = 1;
                                    off += 4096;
                                }
                                slots[i] = Some(b);
                            }
                            Err(e) => panic!("footprint run: {e}"),
                        }
                        n += 1;
                    }
                }
                ops.fetch_add(n, Ordering::Relaxed);
                drop(done_tx);
            });
        }
        drop(done_tx);
        loop {
            let st = pool.stats();
            let smp = Sample {
                t_ms: (Clock.now() - start).as_millis() as u64,
                registered: st.registered_bytes,
                live: st.live_bytes,
                registrations: st.registrations,
            };
            println!(
                "SAMPLE t_ms={} registered={} live={} registrations={}",
                smp.t_ms, smp.registered, smp.live, smp.registrations
            );
            samples.push(smp);
            // The timer is the wait for the workers to finish: no sleeping.
            match done_rx.recv_timeout(every) {
                Err(RecvTimeoutError::Timeout) => continue,
                Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    samples
}

/// Parses a `SAMPLE` line.
pub fn parse_sample(line: &str) -> Option<Sample> {
    let rest = line.strip_prefix("SAMPLE ")?;
    let kv: BTreeMap<&str, u64> = rest
        .split(' ')
        .filter_map(|p| p.split_once('='))
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect();
    Some(Sample {
        t_ms: *kv.get("t_ms")?,
        registered: *kv.get("registered")?,
        live: *kv.get("live")?,
        registrations: *kv.get("registrations")?,
    })
}

/// Runs `exe args…` (killed if this process dies or fails first) and returns its stdout, or
/// why not.
pub fn spawn(exe: &std::path::Path, args: &[String]) -> Result<String, String> {
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    bex_process::die_with_this_process(&mut cmd);
    let out = Guard::spawn(&mut cmd, exe.display().to_string())
        .and_then(Guard::output)
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {:?} failed ({}): {}",
            exe.display(),
            args,
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
