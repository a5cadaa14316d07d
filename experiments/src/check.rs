//! The end-to-end check CI runs on a demo cluster's `report.json`.

use bex_report::ClusterReport;
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
    let rankers: Vec<&Value> = report.client_reports("ranker").collect();
    let trainers: Vec<&Value> = report.client_reports("trainer").collect();
    if rankers.is_empty() {
        failed.push("no ranker report".into());
    }
    if trainers.is_empty() {
        failed.push("no trainer report".into());
    }
    for (i, r) in rankers.iter().enumerate() {
        let requests = num(r, "/requests").unwrap_or(0.0);
        let ok = num(r, "/ok").unwrap_or(0.0);
        let errors = num(r, "/errors").unwrap_or(f64::NAN);
        let timeouts = num(r, "/timeouts").unwrap_or(f64::NAN);
        if requests < 1.0 || ok < requests {
            failed.push(format!("ranker {i}: {ok} of {requests} requests ok"));
        }
        if errors != 0.0 || timeouts != 0.0 {
            failed.push(format!("ranker {i}: errors {errors}, timeouts {timeouts}"));
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
    for r in report.client_reports("ranker") {
        out.push(format!(
            "ranker ({}): {} requests, {} ok, p50 {:.0} µs, p99 {:.0} µs",
            r.get("transport").and_then(Value::as_str).unwrap_or("?"),
            num(r, "/requests").unwrap_or(0.0),
            num(r, "/ok").unwrap_or(0.0),
            num(r, "/latency/p50_us").unwrap_or(f64::NAN),
            num(r, "/latency/p99_us").unwrap_or(f64::NAN),
        ));
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
        let client = ClientRecord { kind: kind.into(), report: Some(report), ..Default::default() };
        PhaseReport { clients: vec![client], ..Default::default() }
    }

    fn good() -> ClusterReport {
        ClusterReport {
            ok: true,
            phases: vec![
                phase(
                    "ranker",
                    json!({"kind": "ranker", "transport": "rdma", "requests": 10, "ok": 10,
                        "errors": 0, "timeouts": 0}),
                ),
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
    }
}
