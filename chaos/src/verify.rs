//! The verdict after a chaos run: canary counts against the PS's rows, and replica convergence.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bex_client::fanout::PsClient;
use bex_ps_proto::wire::{self, DataHeader, Limits, Op};

use crate::canary::CanaryReport;

/// Rows to compare across pods: one table's keys.
#[derive(Clone, Debug)]
pub struct KeySet {
    /// What they are (for messages).
    pub name: String,
    /// Table id.
    pub table: u32,
    /// Row width.
    pub dim: u32,
    /// The keys.
    pub keys: Vec<u64>,
}

pub use bex_report::{Invariant, VerifyReport};

/// Every row of `set` held by (`pod`, every shard), in key order.
async fn rows_of(ps: &PsClient, pod: u32, set: &KeySet) -> Result<BTreeMap<u64, Vec<f32>>, String> {
    let topo = ps.topology();
    let mut by_shard: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for &k in &set.keys {
        by_shard.entry(topo.shard_of(k)).or_default().push(k);
    }
    let mut out = BTreeMap::new();
    for (shard, keys) in by_shard {
        let h =
            DataHeader { table: set.table, dim: set.dim, client: ps.push_id(), seq: 0, flags: 0 };
        let mut frame = vec![0u8; wire::fetch_request_len(keys.len())];
        wire::encode_fetch_into(&mut frame, &h, &keys).map_err(|e| e.to_string())?;
        let m = ps
            .raw(pod, shard, Op::Fetch, &frame)
            .await
            .map_err(|e| format!("{}: fetch from pod {pod} shard {shard}: {e}", set.name))?;
        let r =
            wire::decode_response(m.as_slice(), &Limits::default()).map_err(|e| e.to_string())?;
        let rows = r.rows().to_vec();
        if rows.len() != keys.len() * set.dim as usize {
            return Err(format!(
                "{}: pod {pod} shard {shard} returned {} values",
                set.name,
                rows.len()
            ));
        }
        for (k, row) in keys.iter().zip(rows.chunks(set.dim as usize)) {
            out.insert(*k, row.to_vec());
        }
    }
    Ok(out)
}

/// The first difference between two pods' rows, bit for bit.
fn first_difference(
    a: &BTreeMap<u64, Vec<f32>>,
    b: &BTreeMap<u64, Vec<f32>>,
) -> Option<(u64, Vec<f32>, Vec<f32>)> {
    a.iter().find_map(|(k, ra)| {
        let rb = b.get(k)?;
        let same =
            ra.len() == rb.len() && ra.iter().zip(rb).all(|(x, y)| x.to_bits() == y.to_bits());
        (!same).then(|| (*k, ra.clone(), rb.clone()))
    })
}

/// The canary invariants on the training pod's rows, per key and component (the counts of
/// every canary adding to it summed): `acked ≤ value ≤ acked + failed` and the value a whole
/// number (every push adds exactly 1).
pub fn check_canaries(
    canaries: &[CanaryReport],
    rows: &BTreeMap<u64, Vec<f32>>,
) -> (Invariant, Invariant) {
    let mut counts: BTreeMap<(u64, u32), (u64, u64)> = BTreeMap::new();
    for c in canaries {
        for k in &c.keys {
            let e = counts.entry((k.key, c.component)).or_default();
            e.0 += k.acked;
            e.1 += k.failed;
        }
    }
    let (mut lost, mut twice, mut keys, mut acked) = (Vec::new(), Vec::new(), 0u64, 0u64);
    // Pushes missing (acknowledged beyond the value) and extra (beyond acked + failed).
    let (mut missing, mut extra) = (0u64, 0u64);
    for (&(key, component), &(k_acked, k_failed)) in &counts {
        keys += 1;
        acked += k_acked;
        let v = rows.get(&key).and_then(|r| r.get(component as usize)).copied();
        let v = v.unwrap_or(f32::NAN);
        let at = format!("key {key:#x}[{component}]");
        if v.is_nan() || v.fract() != 0.0 || (v as u64) < k_acked {
            missing += k_acked.saturating_sub(if v.is_finite() { v as u64 } else { 0 });
            lost.push(format!("{at}: value {v} < {k_acked} acknowledged"));
        } else if v as u64 > k_acked + k_failed {
            extra += v as u64 - (k_acked + k_failed);
            twice.push(format!("{at}: value {v} > {k_acked} acknowledged + {k_failed} failed"));
        }
    }
    let detail = |v: &[String], pushes: u64, what: &str| {
        if v.is_empty() {
            format!("{keys} canary key components, {acked} acknowledged pushes")
        } else {
            format!(
                "{} of {keys} keys violate it, {pushes} of {acked} acknowledged pushes {what}; \
                 first: {}",
                v.len(),
                v[0]
            )
        }
    };
    (
        Invariant {
            name: "no acknowledged push lost".into(),
            ok: lost.is_empty(),
            detail: detail(&lost, missing, "missing"),
        },
        Invariant {
            name: "no push applied twice".into(),
            ok: twice.is_empty(),
            detail: detail(&twice, extra, "applied too often"),
        },
    )
}

/// Waits up to `settle` for every pod to hold the training pod's rows of every key set and
/// of the canaries' keys, then checks the canaries' counts on the training pod.
pub async fn run(
    ps: Arc<PsClient>,
    canaries: &[CanaryReport],
    sets: &[KeySet],
    settle: Duration,
) -> VerifyReport {
    let topo = ps.topology().clone();
    let training = topo.training_pod();
    let start = tokio::time::Instant::now();
    let mut invariants = Vec::new();
    let mut converged_after_s = None;
    let mut last_problem = String::new();
    // Canaries may share keys: each once. Their rows went through every fault, so they are
    // compared across pods too (not only counted on the training pod).
    let canary_set: std::collections::BTreeSet<u64> =
        canaries.iter().flat_map(|c| c.keys.iter().map(|k| k.key)).collect();
    let canary = canaries.first().map(|c| KeySet {
        name: "canary".into(),
        table: c.table,
        dim: c.dim,
        keys: canary_set.into_iter().collect(),
    });
    let every_set: Vec<&KeySet> = sets.iter().chain(&canary).collect();
    loop {
        let mut problem = None;
        'sets: for &set in &every_set {
            let base = match rows_of(&ps, training, set).await {
                Ok(r) => r,
                Err(e) => {
                    problem = Some(e);
                    break;
                }
            };
            for pod in (0..topo.pods()).filter(|p| *p != training) {
                match rows_of(&ps, pod, set).await {
                    Ok(r) => {
                        if let Some((k, a, b)) = first_difference(&base, &r) {
                            problem = Some(format!(
                                "{}: key {k:#x} training pod {a:?} vs pod {pod} {b:?}",
                                set.name
                            ));
                            break 'sets;
                        }
                    }
                    Err(e) => {
                        problem = Some(e);
                        break 'sets;
                    }
                }
            }
        }
        match problem {
            None => {
                converged_after_s = Some(start.elapsed().as_secs_f64());
                break;
            }
            Some(p) if start.elapsed() >= settle => {
                last_problem = p;
                break;
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let total: usize = every_set.iter().map(|s| s.keys.len()).sum();
    invariants.push(Invariant {
        name: "replicas converge".into(),
        ok: converged_after_s.is_some(),
        detail: match converged_after_s {
            Some(s) => {
                format!("{} pods agree bit for bit on {total} rows after {s:.2} s", topo.pods())
            }
            None => format!("not within {:.0} s: {last_problem}", settle.as_secs_f64()),
        },
    });
    if let Some(set) = &canary {
        match rows_of(&ps, training, set).await {
            Ok(rows) => {
                let (a, b) = check_canaries(canaries, &rows);
                invariants.push(a);
                invariants.push(b);
            }
            Err(e) => invariants.push(Invariant {
                name: "canaries readable".into(),
                ok: false,
                detail: e,
            }),
        }
    } else {
        invariants.push(Invariant {
            name: "no acknowledged push lost".into(),
            ok: false,
            detail: "no canary report to check".into(),
        });
    }
    VerifyReport {
        kind: bex_report::ProcessKind::Verify,
        ok: invariants.iter().all(|i| i.ok),
        invariants,
        converged_after_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canary::KeyCount;

    fn report(keys: &[(u64, u64, u64)]) -> CanaryReport {
        CanaryReport {
            keys: keys
                .iter()
                .map(|&(key, acked, failed)| KeyCount { key, acked, failed })
                .collect(),
            ..CanaryReport::default()
        }
    }

    #[test]
    fn canary_values_between_acked_and_attempted_pass() {
        let c = report(&[(1, 10, 0), (2, 5, 2)]);
        let rows = BTreeMap::from([(1, vec![10.0, 10.0]), (2, vec![6.0, 6.0])]);
        let (lost, twice) = check_canaries(&[c], &rows);
        assert!(lost.ok && twice.ok, "{lost:?} {twice:?}");
    }

    #[test]
    fn lost_and_doubled_pushes_are_named() {
        let c = report(&[(1, 10, 0), (2, 5, 1), (3, 1, 0)]);
        let rows = BTreeMap::from([(1, vec![9.0]), (2, vec![7.0])]);
        let (lost, twice) = check_canaries(&[c], &rows);
        assert!(!lost.ok && lost.detail.contains("2 of 3"), "{lost:?}");
        assert!(!twice.ok && twice.detail.contains("value 7"), "{twice:?}");
    }

    #[test]
    fn canaries_sharing_keys_are_counted_per_component() {
        let mut a = report(&[(1, 10, 0)]);
        let mut b = report(&[(1, 7, 1)]);
        b.component = 1;
        // Components: a's 10 pushes, b's 7 acknowledged and 1 failed (applied or not).
        let rows = BTreeMap::from([(1, vec![10.0, 8.0])]);
        let (lost, twice) = check_canaries(&[a.clone(), b.clone()], &rows);
        assert!(lost.ok && twice.ok, "{lost:?} {twice:?}");
        // One of b's pushes applied twice: visible, though a alone is fine.
        let rows = BTreeMap::from([(1, vec![10.0, 9.0])]);
        let (_, twice) = check_canaries(&[a.clone(), b.clone()], &rows);
        assert!(!twice.ok && twice.detail.contains("[1]"), "{twice:?}");
        // Two canaries adding to one component are summed.
        a.component = 1;
        let rows = BTreeMap::from([(1, vec![0.0, 18.0])]);
        let (lost, twice) = check_canaries(&[a, b], &rows);
        assert!(lost.ok && twice.ok, "{lost:?} {twice:?}");
    }

    #[test]
    fn differences_are_bitwise() {
        let a = BTreeMap::from([(1, vec![0.0f32]), (2, vec![1.0])]);
        let mut b = a.clone();
        assert!(first_difference(&a, &b).is_none());
        b.insert(1, vec![-0.0]);
        assert_eq!(first_difference(&a, &b).unwrap().0, 1);
    }
}
