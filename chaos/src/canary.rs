//! The canary client: `+1` pushes to canary keys, counting acknowledgements and failures.
//! Each canary adds to one component of a row, so several canaries can share keys (race on
//! every row, under their own identities) and still be counted apart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_client::fanout::PsClient;
use bex_report::ProcessKind;
use bex_transport_kind::TransportKind;
use serde::{Deserialize, Serialize};

use crate::{canary_key, shared_canary_key};

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
    /// Always [`ProcessKind::Canary`].
    pub kind: ProcessKind,
    /// Client id.
    pub client: u64,
    /// Transport.
    pub transport: TransportKind,
    /// Table id and dim.
    pub table: u32,
    /// Row width.
    pub dim: u32,
    /// The component of each row this canary adds 1 to.
    pub component: u32,
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
    /// Workers that panicked: their keys are missing from `keys` (so `verify` cannot check
    /// them), and the canary fails.
    #[serde(default)]
    pub workers_lost: u32,
}

/// Where a canary pushes: `keys` keys of `owner`'s (its push identity) or, without an owner,
/// the shared ones, `+1` to `component` of each row.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// Table id and row width.
    pub table: (u32, u32),
    /// Whose canary keys ([`crate::canary_key`]); `None`: [`crate::shared_canary_key`]s.
    pub owner: Option<u64>,
    /// How many.
    pub keys: u32,
    /// The component added to (`< dim`).
    pub component: u32,
}

/// Pushes `+1` to the target's keys, round-robin, `in_flight` at a time, until `seconds`
/// passed or `stop` is set; each key's pushes are sequential (one outstanding per key and
/// canary), so counts are exact.
pub async fn run(
    ps: Arc<PsClient>,
    target: Target,
    in_flight: u32,
    seconds: f64,
    stop: Arc<AtomicBool>,
) -> CanaryReport {
    let Target { table: (table, dim), owner, keys, component } = target;
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let client = ps.push_id();
    let mut grads = vec![0.0f32; dim as usize];
    grads[component as usize] = -1.0;
    let mut tasks = Vec::new();
    // Worker w owns keys w, w + in_flight, ...: no key has two pushes outstanding.
    let workers = in_flight.clamp(1, keys.max(1));
    for w in 0..workers {
        let (ps, grads, stop) = (ps.clone(), grads.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mine: Vec<u32> = (w..keys).step_by(workers as usize).collect();
            let mut counts: Vec<KeyCount> = mine
                .iter()
                .map(|&i| {
                    let key = owner.map_or(shared_canary_key(i), |o| canary_key(o, i));
                    KeyCount { key, ..KeyCount::default() }
                })
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
    let mut report = CanaryReport {
        kind: ProcessKind::Canary,
        client,
        table,
        dim,
        component,
        ..CanaryReport::default()
    };
    for t in tasks {
        match t.await {
            Ok((counts, err)) => {
                if report.first_error.is_none() {
                    report.first_error = err;
                }
                report.keys.extend(counts);
            }
            Err(e) => {
                report.workers_lost += 1;
                report.first_error.get_or_insert_with(|| format!("a worker ended: {e}"));
            }
        }
    }
    report.keys.sort_by_key(|k| k.key);
    report.acked = report.keys.iter().map(|k| k.acked).sum();
    report.failed = report.keys.iter().map(|k| k.failed).sum();
    report.elapsed_s = start.elapsed().as_secs_f64();
    report.interrupted = stop.load(Ordering::Relaxed);
    report
}
