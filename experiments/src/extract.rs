//! Reading one launched run: the launcher's typed `report.json` ([`ClusterReport`]) with the
//! clients' own reports inside, read as their types ([`RankerReport`], [`TrainerReport`]).

use bex_process::{CpuTimes, SystemCpu};
use bex_report::{ClusterReport, RankerReport, TrainerReport};
use bex_transport_kind::TransportKind;
use serde::Serialize;

/// One inference run (all rankers of it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct InferenceRun {
    /// Client transport.
    pub transport: TransportKind,
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

/// What a training run compares (paper Table 7's columns, in their order).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum,
)]
pub enum Variant {
    /// TCP only.
    #[default]
    #[serde(rename = "tcp")]
    #[value(name = "tcp")]
    Tcp,
    /// RDMA without a send window.
    #[serde(rename = "rdma")]
    #[value(name = "rdma")]
    Rdma,
    /// RDMA with `--window` bytes of send window per engine.
    #[serde(rename = "rdma+window")]
    #[value(name = "rdma+window")]
    RdmaWindow,
}

impl Variant {
    /// All, in the paper's column order.
    pub const ALL: [Variant; 3] = [Variant::Tcp, Variant::Rdma, Variant::RdmaWindow];

    /// Its name: `tcp`, `rdma`, `rdma+window`.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Tcp => "tcp",
            Variant::Rdma => "rdma",
            Variant::RdmaWindow => "rdma+window",
        }
    }

    /// The transport its processes use.
    pub fn transport(self) -> TransportKind {
        match self {
            Variant::Tcp => TransportKind::Tcp,
            Variant::Rdma | Variant::RdmaWindow => TransportKind::Rdma,
        }
    }

    /// Its `transport.cwnd_bytes` given the window variant's (0: none).
    pub fn cwnd_bytes(self, window: u64) -> u64 {
        if self == Variant::RdmaWindow {
            window
        } else {
            0
        }
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One training run (all trainers of it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct TrainingRun {
    /// Which of the compared set-ups.
    pub variant: Variant,
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

/// The largest `f` over `reports` (0 for none): the busiest client's figure.
fn worst_of<T>(reports: &[T], f: fn(&T) -> f64) -> f64 {
    reports.iter().map(f).fold(0.0, f64::max)
}

/// The RNIC counter `name` summed over the rankers' and trainers' own counters and the
/// launcher's per-phase server deltas (not the whole-run server totals, which repeat those
/// deltas). Canaries report no RNIC counters. A client report that does not read is an
/// error, not a zero.
fn rnic_sum(report: &ClusterReport, name: &str) -> Result<f64, String> {
    let mut sum: u64 = 0;
    for (_, r) in report.reports::<RankerReport>() {
        sum += r?.rnic(name);
    }
    for (_, r) in report.reports::<TrainerReport>() {
        sum += r?.rnic(name);
    }
    sum +=
        report.phases.iter().flat_map(|p| &p.servers).filter_map(|s| s.rnic.get(name)).sum::<u64>();
    Ok(sum as f64)
}

/// Reads an inference run's `report.json`.
pub fn inference(
    report: &ClusterReport,
    transport: TransportKind,
    rate: f64,
) -> Result<InferenceRun, String> {
    let r = report.reports().map(|(_, r)| r).collect::<Result<Vec<RankerReport>, String>>()?;
    if r.is_empty() {
        return Err("no ranker report in report.json".into());
    }
    let total = |f: fn(&RankerReport) -> f64| r.iter().map(f).sum::<f64>();
    let worst = |f: fn(&RankerReport) -> f64| worst_of(&r, f);
    let ok = total(|c| c.ok as f64);
    // Shares of all the machine's CPU time over the run (user + system + irq + softirq +
    // idle covers every CPU), as in the paper's Table 5.
    let pct = |part: fn(&SystemCpu) -> f64| {
        let share = |c: &RankerReport| {
            let m = &c.cpu.machine;
            let all = m.user_s + m.sys_s + m.irq_s + m.softirq_s + m.idle_s;
            if all > 0.0 {
                100.0 * part(m) / all
            } else {
                0.0
            }
        };
        r.iter().map(share).fold(0.0, f64::max)
    };
    let own = |part: CpuPart| {
        let clients: f64 = r.iter().map(|c| part.of(&c.cpu.ranker)).sum();
        if ok > 0.0 {
            1e6 * (clients + servers_cpu(report, part)) / ok
        } else {
            0.0
        }
    };
    Ok(InferenceRun {
        transport,
        rate,
        ok,
        errors: total(|c| (c.errors + c.timeouts) as f64),
        throughput_rps: total(|c| c.throughput_rps),
        request_mean_us: worst(|c| c.latency.mean_us),
        request_p99_us: worst(|c| c.latency.p99_us),
        pull_mean_us: worst(|c| c.subrequest_latency.mean_us),
        pull_p99_us: worst(|c| c.subrequest_latency.p99_us),
        machine_user_pct: pct(|m| m.user_s),
        machine_sys_pct: pct(|m| m.sys_s),
        machine_softirq_pct: pct(|m| m.softirq_s),
        cpu_user_us_per_req: own(CpuPart::User),
        cpu_sys_us_per_req: own(CpuPart::Sys),
    })
}

/// Which of a CPU time's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuPart {
    /// User time.
    User,
    /// System time.
    Sys,
}

impl CpuPart {
    /// This part of `t`.
    pub fn of(self, t: &CpuTimes) -> f64 {
        match self {
            CpuPart::User => t.user_s,
            CpuPart::Sys => t.sys_s,
        }
    }
}

/// The servers' CPU seconds the launcher measured over the phases.
pub fn servers_cpu(report: &ClusterReport, part: CpuPart) -> f64 {
    report.phases.iter().flat_map(|p| &p.servers).map(|s| part.of(&s.cpu)).sum()
}

/// A TCP counter the launcher measured per phase, summed over the phases (NaN if none did).
fn tcp_sum(report: &ClusterReport, field: fn(&bex_report::TcpDelta) -> u64) -> f64 {
    let vals: Vec<u64> = report.phases.iter().filter_map(|p| p.tcp.as_ref()).map(field).collect();
    if vals.is_empty() {
        f64::NAN
    } else {
        vals.iter().sum::<u64>() as f64
    }
}

/// Reads a training run's `report.json`.
pub fn training(report: &ClusterReport, variant: Variant) -> Result<TrainingRun, String> {
    let t = report.reports().map(|(_, t)| t).collect::<Result<Vec<TrainerReport>, String>>()?;
    if t.is_empty() {
        return Err("no trainer report in report.json".into());
    }
    let worst = |f: fn(&TrainerReport) -> f64| worst_of(&t, f);
    Ok(TrainingRun {
        variant,
        trainers: t.len() as f64,
        fetch_p99_us: worst(|c| c.fetch_latency.p99_us),
        push_p99_us: worst(|c| c.push_latency.p99_us),
        fetch_p50_us: worst(|c| c.fetch_latency.p50_us),
        push_p50_us: worst(|c| c.push_latency.p50_us),
        samples_per_s: t.iter().map(|c| c.samples_per_s).sum(),
        errors: t.iter().map(|c| c.errors as f64).sum(),
        auc_final: t.iter().map(|c| c.auc_final).fold(f64::INFINITY, f64::min),
        rnr_naks: rnic_sum(report, "rnr_naks_received")?,
        seq_naks: rnic_sum(report, "seq_naks_received")?,
        retransmits: rnic_sum(report, "retransmitted_packets")?,
        ack_timeouts: rnic_sum(report, "ack_timeouts")?,
        tcp_retransmits: tcp_sum(report, |t| t.retrans_segs),
        tcp_out_segments: tcp_sum(report, |t| t.out_segs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bex_traffic::LatencySummary;

    #[test]
    fn finds_client_reports_and_sums_counters_once() {
        use bex_report::{ClientRecord, PhaseReport, ServerDelta, ServerRecord};
        let trainer = |name: &str, report: TrainerReport| ClientRecord {
            name: name.into(),
            kind: bex_report::ProcessKind::Trainer,
            report: Some(serde_json::to_value(report).unwrap()),
            ..ClientRecord::default()
        };
        let lat = |p50_us, p99_us| LatencySummary { p50_us, p99_us, ..Default::default() };
        let delta = ServerDelta {
            name: "ps-p0-s0".into(),
            cpu: bex_process::CpuTimes { user_s: 1.0, sys_s: 0.5 },
            rnic: [("retransmitted_packets".to_string(), 10)].into(),
        };
        let r = ClusterReport {
            phases: vec![PhaseReport {
                clients: vec![
                    trainer(
                        "t0",
                        TrainerReport {
                            fetch_latency: lat(100.0, 900.0),
                            push_latency: lat(150.0, 1200.0),
                            samples_per_s: 1000.0,
                            auc_final: 0.8,
                            rnic: [("retransmitted_packets", 5), ("seq_naks_received", 1)]
                                .map(|(k, v)| (k.to_string(), v))
                                .into(),
                            ..Default::default()
                        },
                    ),
                    trainer(
                        "t1",
                        TrainerReport {
                            fetch_latency: lat(90.0, 1900.0),
                            push_latency: lat(170.0, 800.0),
                            samples_per_s: 500.0,
                            errors: 1,
                            auc_final: 0.77,
                            rnic: [("retransmitted_packets".to_string(), 7)].into(),
                            ..Default::default()
                        },
                    ),
                ],
                servers: vec![delta.clone()],
                ..PhaseReport::default()
            }],
            // The whole-run totals repeat the phases' deltas: not counted again.
            servers: vec![ServerRecord {
                name: delta.name.clone(),
                pod: 0,
                shard: 0,
                pid: 1,
                netns: None,
                http: None,
                cpu: delta.cpu,
                rnic: delta.rnic.clone(),
                status: Default::default(),
            }],
            ..ClusterReport::default()
        };
        let t = training(&r, Variant::Rdma).unwrap();
        assert_eq!(t.trainers, 2.0);
        assert_eq!(t.fetch_p99_us, 1900.0);
        assert_eq!(t.push_p99_us, 1200.0);
        assert_eq!(t.samples_per_s, 1500.0);
        assert_eq!(t.errors, 1.0);
        assert_eq!(t.auc_final, 0.77);
        assert_eq!(t.retransmits, 22.0);
        assert_eq!(t.seq_naks, 1.0);
        assert!(t.tcp_retransmits.is_nan(), "no phase measured TCP");
        assert_eq!(servers_cpu(&r, CpuPart::User), 1.0);
        assert!(inference(&r, TransportKind::Rdma, 100.0).is_err());
        // Through JSON and back: what bex-cluster writes is what this reads.
        let back = ClusterReport::from_json(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
