//! The run report: JSON (`--json`) and a readable summary.

use std::fmt::Write as _;

use serde_json::{json, Value};

use bex_traffic::LatencySummary;

use crate::run::RunOutput;
use crate::settings::Settings;

/// What the report says about the run besides its measurements.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// `rdma` or `tcp`.
    pub transport: String,
    /// The cluster config path.
    pub config: String,
    /// The client's mini-pod.
    pub pod: u32,
    /// The PS client id.
    pub client_id: u64,
    /// The replayed trace, if any.
    pub trace: Option<String>,
    /// Dense weight refreshes (after the first fetch) and failures.
    pub dense_refreshes: (u64, u64),
}

/// The JSON report.
pub fn to_json(s: &Settings, info: &RunInfo, out: &RunOutput) -> Value {
    let report = out.collected.recorder.report(out.elapsed);
    let rpc = out.end.rpc.since(&out.start.rpc);
    let cpu = out.end.cpu.since(&out.start.cpu);
    let sys = out.end.system.since(&out.start.system);
    json!({
        "kind": "ranker",
        "transport": info.transport,
        "interrupted": out.interrupted,
        "config": info.config,
        "pod": info.pod,
        "client_id": info.client_id,
        "trace": info.trace,
        "rate_rps": s.raw.rate,
        "seconds": s.raw.seconds,
        "warmup_seconds": s.raw.warmup_seconds,
        "seed": s.raw.seed,
        "models": s.raw.models,
        "models_per_request": s.raw.models_per_request,
        "candidates": { "min": s.raw.candidates_min, "max": s.raw.candidates_max },
        "max_outstanding": s.raw.max_outstanding,
        "elapsed_s": report.elapsed_s,
        "issued": out.issued,
        "requests": report.requests,
        "ok": report.ok,
        "errors": report.errors,
        "timeouts": report.timeouts,
        "dropped": out.collected.dropped,
        "abandoned": out.abandoned,
        "retries": rpc.retries,
        "fallbacks": rpc.fallbacks,
        "quarantines": rpc.quarantines,
        "throughput_rps": report.throughput_rps,
        "goodput_rps": report.goodput_rps,
        "latency": report.latency,
        "subrequest_latency": LatencySummary::of(&out.collected.sub),
        "launch_lag": LatencySummary::of(&out.collected.launch_lag),
        "bytes_sent": report.bytes_sent,
        "bytes_received": report.bytes_received,
        "cpu": {
            "ranker": { "user_s": cpu.user_s, "sys_s": cpu.sys_s },
            "machine": {
                "user_s": sys.user_s,
                "sys_s": sys.sys_s,
                "softirq_s": sys.softirq_s,
                "irq_s": sys.irq_s,
                "idle_s": sys.idle_s,
            },
        },
        "rnic": out.end.rnic.since(&out.start.rnic),
        "rpc": rpc,
        "dense": {
            "params_per_model": s.models.first().map(|m| m.dense_len()),
            "refreshes": info.dense_refreshes.0,
            "refresh_failures": info.dense_refreshes.1,
        },
        "first_error": out.collected.first_error,
        "series": report.series,
    })
}

/// A readable summary of [`to_json`]'s value.
pub fn summary(v: &Value) -> String {
    let f = |p: &str| v.pointer(p).and_then(Value::as_f64).unwrap_or(0.0);
    let u = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "ranker over {}: {} requests in {:.1} s ({:.0} req/s), ok {}, errors {} (dropped {}), \
         timeouts {}{}",
        v["transport"].as_str().unwrap_or("?"),
        u("/requests"),
        f("/elapsed_s"),
        f("/throughput_rps"),
        u("/ok"),
        u("/errors"),
        u("/dropped"),
        u("/timeouts"),
        if v["interrupted"].as_bool() == Some(true) { " [interrupted]" } else { "" },
    );
    for (name, key) in [("request", "latency"), ("per-model fetch", "subrequest_latency")] {
        let _ = writeln!(
            s,
            "  {name} latency µs: mean {:.0}  p50 {:.0}  p99 {:.0}  p99.9 {:.0}  max {:.0}",
            f(&format!("/{key}/mean_us")),
            f(&format!("/{key}/p50_us")),
            f(&format!("/{key}/p99_us")),
            f(&format!("/{key}/p999_us")),
            f(&format!("/{key}/max_us")),
        );
    }
    let _ = writeln!(
        s,
        "  bytes: {:.1} MB sent, {:.1} MB received; rpc retries {}, timeouts {}, fallbacks {}, \
         quarantines {}",
        f("/bytes_sent") / 1e6,
        f("/bytes_received") / 1e6,
        u("/rpc/retries"),
        u("/rpc/timeouts"),
        u("/rpc/fallbacks"),
        u("/rpc/quarantines"),
    );
    let _ = writeln!(
        s,
        "  cpu: ranker user {:.2} s sys {:.2} s; machine user {:.2} s sys {:.2} s softirq {:.2} s",
        f("/cpu/ranker/user_s"),
        f("/cpu/ranker/sys_s"),
        f("/cpu/machine/user_s"),
        f("/cpu/machine/sys_s"),
        f("/cpu/machine/softirq_s"),
    );
    let _ = write!(
        s,
        "  rnic: tx {} rx {} packets, retransmitted {}, rnr naks {}, ack timeouts {}",
        u("/rnic/tx_packets"),
        u("/rnic/rx_packets"),
        u("/rnic/retransmitted_packets"),
        u("/rnic/rnr_naks_received"),
        u("/rnic/ack_timeouts"),
    );
    s
}
