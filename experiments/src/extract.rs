//! Reading one launched run: the launcher's `report.json` with the clients' reports inside.
//! Client reports are found by their `"kind"` (`ranker`, `trainer`) wherever the launcher
//! nests them, so this reader depends only on the clients' own schema.

use serde::Serialize;
use serde_json::Value;

/// A number at a JSON pointer.
pub fn num(v: &Value, pointer: &str) -> Option<f64> {
    v.pointer(pointer).and_then(Value::as_f64)
}

/// Every object in `v` (depth first) whose `"kind"` is `kind` and that has `"transport"`:
/// the client reports.
pub fn clients<'a>(v: &'a Value, kind: &str) -> Vec<&'a Value> {
    let mut out = Vec::new();
    walk(v, &mut |o| {
        if o.get("kind").and_then(Value::as_str) == Some(kind) && o.get("transport").is_some() {
            out.push(o);
            false
        } else {
            true
        }
    });
    out
}

fn walk<'a>(v: &'a Value, visit: &mut impl FnMut(&'a Value) -> bool) {
    match v {
        Value::Object(m) if visit(v) => m.values().for_each(|x| walk(x, visit)),
        Value::Array(a) => a.iter().for_each(|x| walk(x, visit)),
        _ => {}
    }
}

fn sum(vals: impl Iterator<Item = Option<f64>>) -> f64 {
    vals.flatten().sum()
}

fn max(vals: impl Iterator<Item = Option<f64>>) -> f64 {
    vals.flatten().fold(0.0, f64::max)
}

/// One inference run (all rankers of it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct InferenceRun {
    /// Client transport.
    pub transport: String,
    /// Offered load, requests/s (all rankers).
    pub rate: f64,
    /// Requests completed successfully.
    pub ok: f64,
    /// Failed or timed-out requests.
    pub errors: f64,
    /// Achieved throughput, requests/s.
    pub throughput_rps: f64,
    /// Request latency mean, µs (worst ranker).
    pub request_mean_us: f64,
    /// Request latency P99, µs (worst ranker).
    pub request_p99_us: f64,
    /// Per-model fetch (the paper's "PS Pull") mean, µs.
    pub pull_mean_us: f64,
    /// Per-model fetch P99, µs.
    pub pull_p99_us: f64,
    /// Machine-wide CPU over the run, % of all the machine's CPU time (100 = every CPU
    /// busy): user, system, softirq.
    pub machine_user_pct: f64,
    /// System.
    pub machine_sys_pct: f64,
    /// Softirq.
    pub machine_softirq_pct: f64,
    /// Rankers' and servers' own CPU per request, µs: user.
    pub cpu_user_us_per_req: f64,
    /// System.
    pub cpu_sys_us_per_req: f64,
}

/// One training run (all trainers of it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct TrainingRun {
    /// `tcp`, `rdma` (no window) or `rdma+window`.
    pub variant: String,
    /// Trainers at once.
    pub trainers: f64,
    /// Busiest trainer's fetch P99, µs.
    pub fetch_p99_us: f64,
    /// Busiest trainer's push P99, µs.
    pub push_p99_us: f64,
    /// Fetch P50, µs (worst trainer).
    pub fetch_p50_us: f64,
    /// Push P50, µs (worst trainer).
    pub push_p50_us: f64,
    /// All trainers' samples/s.
    pub samples_per_s: f64,
    /// Failed steps.
    pub errors: f64,
    /// Lowest final held-out AUC among the trainers.
    pub auc_final: f64,
    /// RNIC counters summed over trainers and servers.
    pub rnr_naks: f64,
    /// Sequence NAKs.
    pub seq_naks: f64,
    /// Retransmitted packets.
    pub retransmits: f64,
    /// ACK timeouts.
    pub ack_timeouts: f64,
    /// TCP segments retransmitted (kernel counters of the hosts; NaN where not measured).
    pub tcp_retransmits: f64,
    /// TCP segments sent (same scope).
    pub tcp_out_segments: f64,
}

/// The rnic counter `name` summed over every object named `rnic` in `v` (clients' own
/// counters and the launcher's per-server deltas).
fn rnic_sum(v: &Value, name: &str) -> f64 {
    let mut total = 0.0;
    walk(v, &mut |o| {
        if let Some(r) = o.get("rnic") {
            total += r.get(name).and_then(Value::as_f64).unwrap_or(0.0);
        }
        true
    });
    total
}

/// Reads an inference run's `report.json`.
pub fn inference(report: &Value, transport: &str, rate: f64) -> Result<InferenceRun, String> {
    let r = clients(report, "ranker");
    if r.is_empty() {
        return Err("no ranker report in report.json".into());
    }
    let ok = sum(r.iter().map(|c| num(c, "/ok")));
    // Shares of all the machine's CPU time over the run (user + system + irq + softirq +
    // idle covers every CPU), as in the paper's Table 5.
    let pct = |p: &str| {
        let share = |c: &Value| {
            let total: f64 = ["user_s", "sys_s", "irq_s", "softirq_s", "idle_s"]
                .iter()
                .filter_map(|k| num(c, &format!("/cpu/machine/{k}")))
                .sum();
            let x = num(c, p)?;
            (total > 0.0).then(|| 100.0 * x / total)
        };
        max(r.iter().map(|c| share(c)))
    };
    let own = |field: &str| {
        let clients = sum(r.iter().map(|c| num(c, &format!("/cpu/ranker/{field}"))));
        let servers = servers_cpu(report, field);
        if ok > 0.0 {
            1e6 * (clients + servers) / ok
        } else {
            0.0
        }
    };
    Ok(InferenceRun {
        transport: transport.into(),
        rate,
        ok,
        errors: sum(r.iter().map(|c| num(c, "/errors")))
            + sum(r.iter().map(|c| num(c, "/timeouts"))),
        throughput_rps: sum(r.iter().map(|c| num(c, "/throughput_rps"))),
        request_mean_us: max(r.iter().map(|c| num(c, "/latency/mean_us"))),
        request_p99_us: max(r.iter().map(|c| num(c, "/latency/p99_us"))),
        pull_mean_us: max(r.iter().map(|c| num(c, "/subrequest_latency/mean_us"))),
        pull_p99_us: max(r.iter().map(|c| num(c, "/subrequest_latency/p99_us"))),
        machine_user_pct: pct("/cpu/machine/user_s"),
        machine_sys_pct: pct("/cpu/machine/sys_s"),
        machine_softirq_pct: pct("/cpu/machine/softirq_s"),
        cpu_user_us_per_req: own("user_s"),
        cpu_sys_us_per_req: own("sys_s"),
    })
}

/// The servers' CPU seconds (`user_s` or `sys_s`) the launcher measured over the phases.
pub fn servers_cpu(report: &Value, field: &str) -> f64 {
    let mut total = 0.0;
    if let Some(phases) = report.get("phases").and_then(Value::as_array) {
        for p in phases {
            if let Some(servers) = p.get("servers").and_then(Value::as_array) {
                total += sum(servers.iter().map(|s| num(s, &format!("/cpu/{field}"))));
            }
        }
    }
    total
}

/// A TCP counter the launcher measured per phase, summed over the phases (NaN if none did).
fn tcp_sum(report: &Value, field: &str) -> f64 {
    let vals: Vec<f64> = report
        .get("phases")
        .and_then(Value::as_array)
        .map(|p| p.iter().filter_map(|x| num(x, &format!("/tcp/{field}"))).collect())
        .unwrap_or_default();
    if vals.is_empty() {
        f64::NAN
    } else {
        vals.iter().sum()
    }
}

/// Reads a training run's `report.json`.
pub fn training(report: &Value, variant: &str) -> Result<TrainingRun, String> {
    let t = clients(report, "trainer");
    if t.is_empty() {
        return Err("no trainer report in report.json".into());
    }
    Ok(TrainingRun {
        variant: variant.into(),
        trainers: t.len() as f64,
        fetch_p99_us: max(t.iter().map(|c| num(c, "/fetch_latency/p99_us"))),
        push_p99_us: max(t.iter().map(|c| num(c, "/push_latency/p99_us"))),
        fetch_p50_us: max(t.iter().map(|c| num(c, "/fetch_latency/p50_us"))),
        push_p50_us: max(t.iter().map(|c| num(c, "/push_latency/p50_us"))),
        samples_per_s: sum(t.iter().map(|c| num(c, "/samples_per_s"))),
        errors: sum(t.iter().map(|c| num(c, "/errors"))),
        auc_final: t.iter().filter_map(|c| num(c, "/auc_final")).fold(f64::INFINITY, f64::min),
        rnr_naks: rnic_sum(report, "rnr_naks_received"),
        seq_naks: rnic_sum(report, "seq_naks_received"),
        retransmits: rnic_sum(report, "retransmitted_packets"),
        ack_timeouts: rnic_sum(report, "ack_timeouts"),
        tcp_retransmits: tcp_sum(report, "retrans_segs"),
        tcp_out_segments: tcp_sum(report, "out_segs"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finds_nested_client_reports_and_sums_counters() {
        let r = json!({
            "phases": [{
                "clients": [
                    {"name": "t0", "report": {"kind": "trainer", "transport": "rdma",
                        "fetch_latency": {"p99_us": 900.0, "p50_us": 100.0},
                        "push_latency": {"p99_us": 1200.0, "p50_us": 150.0},
                        "samples_per_s": 1000.0, "errors": 0, "auc_final": 0.8,
                        "rnic": {"retransmitted_packets": 5, "seq_naks_received": 1}}},
                    {"name": "t1", "report": {"kind": "trainer", "transport": "rdma",
                        "fetch_latency": {"p99_us": 1900.0, "p50_us": 90.0},
                        "push_latency": {"p99_us": 800.0, "p50_us": 170.0},
                        "samples_per_s": 500.0, "errors": 1, "auc_final": 0.77,
                        "rnic": {"retransmitted_packets": 7}}}
                ],
                "servers": [{"cpu": {"user_s": 1.0, "sys_s": 0.5},
                             "rnic": {"retransmitted_packets": 10}}]
            }]
        });
        let t = training(&r, "rdma").unwrap();
        assert_eq!(t.trainers, 2.0);
        assert_eq!(t.fetch_p99_us, 1900.0);
        assert_eq!(t.push_p99_us, 1200.0);
        assert_eq!(t.samples_per_s, 1500.0);
        assert_eq!(t.errors, 1.0);
        assert_eq!(t.auc_final, 0.77);
        assert_eq!(t.retransmits, 22.0);
        assert_eq!(t.seq_naks, 1.0);
        assert_eq!(servers_cpu(&r, "user_s"), 1.0);
        assert!(inference(&r, "rdma", 100.0).is_err());
    }
}
