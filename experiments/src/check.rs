//! The end-to-end check CI runs on a demo cluster's `report.json`.

use bex_report::{ClusterReport, RankerReport};
use serde_json::Value;

use crate::extract::num;

/// Every failed check, empty when the run is good: the launcher reported ok, at least one
/// ranker and one trainer ran, every ranker completed requests with no errors or timeouts,
/// and every trainer's held-out AUC rose (to at least `min_auc`) and its log-loss fell.
pub fn demo(report: &ClusterReport, min_auc: f64) -> Vec<String> {
    let mut failed = Vec::new();
    if !report.ok {
        failed.push(format!("launcher: ok is not true ({:?})", report.reasons));
    }
    let rankers: Vec<(&str, Result<RankerReport, String>)> = report.rankers().collect();
    let trainers: Vec<&Value> = report.client_reports("trainer").collect();
    if rankers.is_empty() {
        failed.push("no ranker report".into());
    }
    if trainers.is_empty() {
        failed.push("no trainer report".into());
    }
    for (name, r) in rankers {
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                failed.push(e);
                continue;
            }
        };
        if r.requests < 1 || r.ok < r.requests {
            failed.push(format!("{name}: {} of {} requests ok", r.ok, r.requests));
        }
        if r.errors != 0 || r.timeouts != 0 {
            failed.push(format!("{name}: errors {}, timeouts {}", r.errors, r.timeouts));
        }
    }
    for (i, t) in trainers.iter().enumerate() {
        let steps = num(t, "/steps").unwrap_or(0.0);
        let errors = num(t, "/errors").unwrap_or(f64::NAN);
        let (a0, a1) = (num(t, "/auc_initial"), num(t, "/auc_final"));
        let (l0, l1) = (num(t, "/log_loss_initial"), num(t, "/log_loss_final"));
        if steps < 1.0 || errors != 0.0 {
            failed.push(format!("trainer {i}: {steps} steps, {errors} errors"));
        }
        match (a0, a1) {
            (Some(a0), Some(a1)) if a1 > a0 && a1 >= min_auc => {}
            _ => failed.push(format!(
                "trainer {i}: AUC {a0:?} → {a1:?} (must rise to at least {min_auc})"
            )),
        }
        match (l0, l1) {
            (Some(l0), Some(l1)) if l1 < l0 => {}
            _ => failed.push(format!("trainer {i}: log-loss {l0:?} → {l1:?} (must fall)")),
        }
    }
    failed
}

/// One line per client: what it did.
pub fn describe(report: &ClusterReport) -> Vec<String> {
    let mut out = Vec::new();
    for (name, r) in report.rankers() {
        out.push(match r {
            Ok(r) => format!(
                "ranker ({}): {} requests, {} ok, p50 {:.0} µs, p99 {:.0} µs",
                r.transport, r.requests, r.ok, r.latency.p50_us, r.latency.p99_us,
            ),
            Err(e) => format!("{name}: {e}"),
        });
    }
    for t in report.client_reports("trainer") {
        out.push(format!(
            "trainer ({}): {} steps, AUC {:.3} → {:.3}, log-loss {:.3} → {:.3}",
            t.get("transport").and_then(Value::as_str).unwrap_or("?"),
            num(t, "/steps").unwrap_or(0.0),
            num(t, "/auc_initial").unwrap_or(f64::NAN),
            num(t, "/auc_final").unwrap_or(f64::NAN),
            num(t, "/log_loss_initial").unwrap_or(f64::NAN),
            num(t, "/log_loss_final").unwrap_or(f64::NAN),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use bex_report::{ClientRecord, PhaseReport};
    use serde_json::json;

    use super::*;

    fn phase(kind: &str, report: Value) -> PhaseReport {
        let client = ClientRecord {
            name: format!("{kind}-0"),
            kind: kind.into(),
            report: Some(report),
            ..Default::default()
        };
        PhaseReport { clients: vec![client], ..Default::default() }
    }

    fn good() -> ClusterReport {
        let ranker = RankerReport { requests: 10, ok: 10, ..Default::default() };
        ClusterReport {
            ok: true,
            phases: vec![
                phase("ranker", serde_json::to_value(ranker).unwrap()),
                phase(
                    "trainer",
                    json!({"kind": "trainer", "transport": "rdma", "steps": 50, "errors": 0,
                        "auc_initial": 0.5, "auc_final": 0.8, "log_loss_initial": 0.69,
                        "log_loss_final": 0.5}),
                ),
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
    }
}
