//! The canary client: `+1` pushes to its own keys, counting acknowledgements and failures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_ps_server::client::PsClient;
use serde::{Deserialize, Serialize};

use crate::canary_key;

/// What happened to one canary key's pushes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyCount {
    /// The key.
    pub key: u64,
    /// Pushes acknowledged (applied exactly once, by the PS's contract).
    pub acked: u64,
    /// Pushes that failed (applied at most once: unknown).
    pub failed: u64,
}

/// The canary's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CanaryReport {
    /// Always "canary".
    pub kind: String,
    /// Client id.
    pub client: u64,
    /// Transport.
    pub transport: String,
    /// Table id and dim.
    pub table: u32,
    /// Row width.
    pub dim: u32,
    /// Per key.
    pub keys: Vec<KeyCount>,
    /// Sum of acked.
    pub acked: u64,
    /// Sum of failed.
    pub failed: u64,
    /// Seconds run.
    pub elapsed_s: f64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Stopped by a signal.
    pub interrupted: bool,
}

/// Pushes `+1` to `keys` canary keys, round-robin, `in_flight` at a time, until `seconds`
/// passed or `stop` is set; each key's pushes are sequential (one outstanding per key), so
/// counts are exact.
pub async fn run(
    ps: Arc<PsClient>,
    (table, dim): (u32, u32),
    keys: u32,
    in_flight: u32,
    seconds: f64,
    stop: Arc<AtomicBool>,
) -> CanaryReport {
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let client = ps.push_id();
    let grads = vec![-1.0f32; dim as usize];
    let mut tasks = Vec::new();
    // Worker w owns keys w, w + in_flight, ...: no key has two pushes outstanding.
    let workers = in_flight.clamp(1, keys.max(1));
    for w in 0..workers {
        let (ps, grads, stop) = (ps.clone(), grads.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mine: Vec<u32> = (w..keys).step_by(workers as usize).collect();
            let mut counts: Vec<KeyCount> = mine
                .iter()
                .map(|&i| KeyCount { key: canary_key(client, i), ..KeyCount::default() })
                .collect();
            let mut first_error = None;
            let mut n = 0usize;
            while tokio::time::Instant::now() < end && !stop.load(Ordering::Relaxed) {
                let c = &mut counts[n % mine.len()];
                match ps.push(table, dim, &[c.key], &grads).await {
                    Ok(()) => c.acked += 1,
                    Err(e) => {
                        c.failed += 1;
                        first_error.get_or_insert_with(|| e.to_string());
                        // Do not spin on a dead path: the RPC layer's deadlines pace retries.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                n += 1;
            }
            (counts, first_error)
        }));
    }
    let mut report =
        CanaryReport { kind: "canary".into(), client, table, dim, ..CanaryReport::default() };
    for t in tasks {
        if let Ok((counts, err)) = t.await {
            if report.first_error.is_none() {
                report.first_error = err;
            }
            report.keys.extend(counts);
        }
    }
    report.keys.sort_by_key(|k| k.key);
    report.acked = report.keys.iter().map(|k| k.acked).sum();
    report.failed = report.keys.iter().map(|k| k.failed).sum();
    report.elapsed_s = start.elapsed().as_secs_f64();
    report.interrupted = stop.load(Ordering::Relaxed);
    report
}
