//! The end-to-end check CI runs on a demo cluster's `report.json`.

use bex_report::{ClientReport, ClusterReport, RankerReport, TrainerReport};

/// Every failed check, empty when the run is good: the launcher reported ok, at least one
/// ranker and one trainer ran, every ranker completed requests with no errors or timeouts,
/// and every trainer's held-out AUC rose (to at least `min_auc`) and its log-loss fell.
pub fn demo(report: &ClusterReport, min_auc: f64) -> Vec<String> {
    let mut failed = Vec::new();
    if !report.ok {
        failed.push(format!("launcher: ok is not true ({:?})", report.reasons));
    }
    for (name, r) in parsed::<RankerReport>(report, &mut failed) {
        if r.requests < 1 || r.ok < r.requests {
            failed.push(format!("{name}: {} of {} requests ok", r.ok, r.requests));
        }
        if r.errors != 0 || r.timeouts != 0 {
            failed.push(format!("{name}: errors {}, timeouts {}", r.errors, r.timeouts));
        }
    }
    for (name, t) in parsed::<TrainerReport>(report, &mut failed) {
        if t.steps < 1 || t.errors != 0 {
            failed.push(format!("{name}: {} steps, {} errors", t.steps, t.errors));
        }
        let (a0, a1) = (t.auc_initial, t.auc_final);
        let rose = a1 > a0 && a1 >= min_auc;
        if !rose {
            failed.push(format!("{name}: AUC {a0} → {a1} (must rise to at least {min_auc})"));
        }
        let (l0, l1) = (t.log_loss_initial, t.log_loss_final);
        let fell = l1 < l0;
        if !fell {
            failed.push(format!("{name}: log-loss {l0} → {l1} (must fall)"));
        }
    }
    failed
}

/// The reports of kind `T` that parse, with their clients' names; each that does not, and
/// none at all, added to `failed`.
fn parsed<'a, T: ClientReport>(
    report: &'a ClusterReport,
    failed: &mut Vec<String>,
) -> Vec<(&'a str, T)> {
    let mut found = 0;
    let mut ok = Vec::new();
    for (name, r) in report.reports::<T>() {
        found += 1;
        match r {
            Ok(r) => ok.push((name, r)),
            Err(e) => failed.push(e),
        }
    }
    if found == 0 {
        failed.push(format!("no {} report", T::KIND));
    }
    ok
}

/// One line per client: what it did.
pub fn describe(report: &ClusterReport) -> Vec<String> {
    let mut out = Vec::new();
    for (name, r) in report.reports::<RankerReport>() {
        out.push(match r {
            Ok(r) => format!(
                "ranker ({}): {} requests, {} ok, p50 {:.0} µs, p99 {:.0} µs",
                r.transport, r.requests, r.ok, r.latency.p50_us, r.latency.p99_us,
            ),
            Err(e) => format!("{name}: {e}"),
        });
    }
    for (name, t) in report.reports::<TrainerReport>() {
        out.push(match t {
            Ok(t) => format!(
                "trainer ({}): {} steps, AUC {:.3} → {:.3}, log-loss {:.3} → {:.3}",
                t.transport,
                t.steps,
                t.auc_initial,
                t.auc_final,
                t.log_loss_initial,
                t.log_loss_final,
            ),
            Err(e) => format!("{name}: {e}"),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use bex_report::{ClientRecord, PhaseReport, ProcessKind};
    use serde_json::{json, Value};

    use super::*;

    fn phase(kind: ProcessKind, report: Value) -> PhaseReport {
        let client = ClientRecord {
            name: format!("{kind}-0"),
            kind,
            report: Some(report),
            ..Default::default()
        };
        PhaseReport { clients: vec![client], ..Default::default() }
    }

    fn good() -> ClusterReport {
        let ranker = RankerReport { requests: 10, ok: 10, ..Default::default() };
        let trainer = TrainerReport {
            steps: 50,
            auc_initial: 0.5,
            auc_final: 0.8,
            log_loss_initial: 0.69,
            log_loss_final: 0.5,
            ..Default::default()
        };
        ClusterReport {
            ok: true,
            phases: vec![
                phase(ProcessKind::Ranker, serde_json::to_value(ranker).unwrap()),
                phase(ProcessKind::Trainer, serde_json::to_value(trainer).unwrap()),
            ],
            ..Default::default()
        }
    }

    fn report(r: &mut ClusterReport, phase: usize) -> &mut Value {
        r.phases[phase].clients[0].report.as_mut().expect("a report")
    }

    #[test]
    fn a_good_run_passes_and_each_fault_is_named() {
        assert!(demo(&good(), 0.75).is_empty());
        assert_eq!(demo(&good(), 0.9).len(), 1);
        let mut v = good();
        report(&mut v, 0)["errors"] = json!(2);
        report(&mut v, 1)["log_loss_final"] = json!(0.7);
        v.ok = false;
        let f = demo(&v, 0.0);
        assert_eq!(f.len(), 3, "{f:?}");
        assert_eq!(demo(&ClusterReport { ok: true, ..Default::default() }, 0.0).len(), 2);
        assert_eq!(describe(&good()).len(), 2);
        // A ranker's report that is not one (another version's, a truncated file) is named.
        let mut v = good();
        report(&mut v, 0).as_object_mut().unwrap().remove("latency");
        let f = demo(&v, 0.0);
        assert!(f.len() == 1 && f[0].starts_with("ranker-0: not a ranker's report"), "{f:?}");
        let mut v = good();
        report(&mut v, 1).as_object_mut().unwrap().remove("auc_final");
        let f = demo(&v, 0.0);
        assert!(f.len() == 1 && f[0].starts_with("trainer-0: not a trainer's report"), "{f:?}");
    }
}
