//! The run report: JSON (`--json`) and a readable summary.

use std::fmt::Write as _;

use bex_report::{counters, CandidateRange, DenseRefreshes, RankerCpu, RankerReport};
use bex_traffic::LatencySummary;
use bex_transport_kind::TransportKind;

use crate::run::RunOutput;
use crate::settings::Settings;

/// What the report says about the run besides its measurements.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// The PS client's transport.
    pub transport: TransportKind,
    /// The cluster config path.
    pub config: String,
    /// The client's mini-pod.
    pub pod: u32,
    /// The PS client id.
    pub client_id: u64,
    /// The replayed trace, if any.
    pub trace: Option<TraceInfo>,
    /// Dense weight refreshes (after the first fetch) and failures.
    pub dense_refreshes: (u64, u64),
}

/// A replayed trace: it, not `--rate`/`--seconds`, decides what was offered.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceInfo {
    /// Its path.
    pub path: String,
    /// Its requests after the warm-up (the measured ones).
    pub measured: usize,
    /// The last request's offset.
    pub span: std::time::Duration,
}

impl TraceInfo {
    /// What a trace holds, with its first `warmup` unmeasured.
    pub fn of(
        path: &std::path::Path,
        trace: &[bex_traffic::TraceRecord],
        warmup: std::time::Duration,
    ) -> TraceInfo {
        let offsets = trace.iter().map(bex_traffic::TraceRecord::offset);
        let span = offsets.clone().max().unwrap_or_default();
        let measured = offsets.filter(|&at| at >= warmup).count();
        TraceInfo { path: path.display().to_string(), measured, span }
    }
}

/// The offered load the report states, (requests per second, measured seconds): the
/// settings', or a replayed trace's (its requests after the warm-up over its span after the
/// warm-up). A trace replay reported the configured rate and seconds, which it ignores.
pub fn offered(s: &Settings, trace: Option<&TraceInfo>) -> (f64, f64) {
    match trace {
        None => (s.raw.rate, s.raw.seconds),
        Some(t) => {
            let seconds = (t.span.as_secs_f64() - s.raw.warmup_seconds).max(0.0);
            let rate = if seconds > 0.0 { t.measured as f64 / seconds } else { 0.0 };
            (rate, seconds)
        }
    }
}

/// The JSON report.
pub fn build(s: &Settings, info: &RunInfo, out: &RunOutput) -> RankerReport {
    let report = out.collected.recorder.report(out.elapsed);
    let rpc = out.end.rpc.since(&out.start.rpc);
    let (rate_rps, seconds) = offered(s, info.trace.as_ref());
    RankerReport {
        transport: info.transport,
        interrupted: out.interrupted,
        config: info.config.clone(),
        pod: info.pod,
        client_id: info.client_id,
        trace: info.trace.as_ref().map(|t| t.path.clone()),
        rate_rps,
        seconds,
        warmup_seconds: s.raw.warmup_seconds,
        seed: s.raw.seed,
        models: s.raw.models,
        models_per_request: s.raw.models_per_request,
        candidates: CandidateRange { min: s.raw.candidates_min, max: s.raw.candidates_max },
        max_outstanding: s.raw.max_outstanding,
        elapsed_s: report.elapsed_s,
        issued: out.issued,
        requests: report.requests,
        ok: report.ok,
        errors: report.errors,
        timeouts: report.timeouts,
        dropped: out.collected.dropped,
        abandoned: out.abandoned,
        retries: rpc.retries,
        fallbacks: rpc.fallbacks,
        quarantines: rpc.quarantines,
        throughput_rps: report.throughput_rps,
        goodput_rps: report.goodput_rps,
        latency: report.latency,
        subrequest_latency: LatencySummary::of(&out.collected.sub),
        launch_lag: LatencySummary::of(&out.collected.launch_lag),
        bytes_sent: report.bytes_sent,
        bytes_received: report.bytes_received,
        cpu: RankerCpu {
            ranker: out.end.cpu.since(&out.start.cpu),
            machine: out.end.system.since(&out.start.system),
        },
        rnic: counters(&out.end.rnic.since(&out.start.rnic)),
        rpc: counters(&rpc),
        dense: DenseRefreshes {
            params_per_model: s.models.first().map(|m| m.dense_len()),
            refreshes: info.dense_refreshes.0,
            refresh_failures: info.dense_refreshes.1,
        },
        first_error: out.collected.first_error.clone(),
        series: report.series,
    }
}

/// A readable summary of the report.
pub fn summary(r: &RankerReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "ranker over {}: {} requests in {:.1} s ({:.0} req/s), ok {}, errors {} (dropped {}), \
         timeouts {}{}",
        r.transport,
        r.requests,
        r.elapsed_s,
        r.throughput_rps,
        r.ok,
        r.errors,
        r.dropped,
        r.timeouts,
        if r.interrupted { " [interrupted]" } else { "" },
    );
    for (name, l) in [("request", &r.latency), ("per-model fetch", &r.subrequest_latency)] {
        let _ = writeln!(
            s,
            "  {name} latency µs: mean {:.0}  p50 {:.0}  p99 {:.0}  p99.9 {:.0}  max {:.0}",
            l.mean_us, l.p50_us, l.p99_us, l.p999_us, l.max_us,
        );
    }
    let _ = writeln!(
        s,
        "  bytes: {:.1} MB sent, {:.1} MB received; rpc retries {}, timeouts {}, fallbacks {}, \
         quarantines {}",
        r.bytes_sent as f64 / 1e6,
        r.bytes_received as f64 / 1e6,
        r.rpc("retries"),
        r.rpc("timeouts"),
        r.rpc("fallbacks"),
        r.rpc("quarantines"),
    );
    let (own, machine) = (r.cpu.ranker, r.cpu.machine);
    let _ = writeln!(
        s,
        "  cpu: ranker user {:.2} s sys {:.2} s; machine user {:.2} s sys {:.2} s softirq {:.2} s",
        own.user_s, own.sys_s, machine.user_s, machine.sys_s, machine.softirq_s,
    );
    let _ = write!(
        s,
        "  rnic: tx {} rx {} packets, retransmitted {}, rnr naks {}, ack timeouts {}",
        r.rnic("tx_packets"),
        r.rnic("rx_packets"),
        r.rnic("retransmitted_packets"),
        r.rnic("rnr_naks_received"),
        r.rnic("ack_timeouts"),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Overrides;
    use std::time::Duration;

    #[test]
    fn a_trace_states_its_own_rate_and_span_not_the_configured_ones() {
        let text = bex_testkit::fixtures::ranker_cluster(
            "",
            "rate = 200.0\nseconds = 10.0\nwarmup_seconds = 1.0\n",
        );
        let cfg = bex_ps_proto::Config::from_toml_str(&text).unwrap();
        let s = Settings::from_config(&cfg, &Overrides::default()).unwrap();
        assert_eq!(offered(&s, None), (200.0, 10.0));
        // A ramp: 10 requests in the 1 s warm-up, then 40 a second for 2 s.
        let at = |ms: u64| {
            let r = bex_traffic::Request { id: ms, candidates: 1, models: vec![] };
            bex_traffic::TraceRecord::new(Duration::from_millis(ms), r)
        };
        let trace: Vec<_> =
            (0..10).map(|i| at(i * 100)).chain((0..80).map(|i| at(1000 + i * 25))).collect();
        let t = TraceInfo::of(std::path::Path::new("t.jsonl"), &trace, Duration::from_secs(1));
        assert_eq!(t.measured, 80);
        let (rate, seconds) = offered(&s, Some(&t));
        assert!(
            (seconds - 1.975).abs() < 1e-9 && (rate - 80.0 / 1.975).abs() < 1e-9,
            "{rate} {seconds}"
        );
        let empty = TraceInfo { path: "e.jsonl".into(), measured: 0, span: Duration::ZERO };
        assert_eq!(offered(&s, Some(&empty)), (0.0, 0.0));
    }
}
