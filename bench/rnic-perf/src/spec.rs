//! What to run: the test kinds, message sizes, and the per-job parameters the client sends to
//! the server. Pure data and parsing; no I/O.

use serde::{Deserialize, Serialize};

use crate::error::{PerfError, Result};
use bex_bench::cli::{TestGroup, Tests};
use bex_bench::Failure;

/// The largest message size accepted (the soft RNIC's and rxe's largest message).
pub const MAX_SIZE_BYTES: u32 = 8 << 20;

/// The largest UDP payload over IPv4: 65535 minus the 20-byte IP and 8-byte UDP headers.
/// Larger UDP ping-pong sizes are reported as "n/a".
pub const MAX_UDP_PAYLOAD_BYTES: u32 = 65_535 - 20 - 8;

/// One benchmark.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum TestKind {
    /// Baseline: UDP datagram ping-pong (sizes up to 65507 B; larger sizes are reported as n/a).
    UdpLat,
    /// Baseline: TCP ping-pong with TCP_NODELAY.
    TcpLat,
    /// Baseline: one TCP stream (TCP_NODELAY), acknowledged at the end of each repetition.
    TcpBw,
    /// RNIC SEND ping-pong: each side waits for the receive completion, then sends.
    SendLat,
    /// RNIC WRITE ping-pong: each side polls the last byte of its buffer, then writes.
    WriteLat,
    /// RNIC SEND stream: batches of posts, a window of outstanding WRs, every Nth signaled.
    SendBw,
    /// RNIC WRITE stream: batches of posts, a window of outstanding WRs, every Nth signaled.
    WriteBw,
}

/// Whether a test measures latency or bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Round-trip times of a ping-pong.
    Latency,
    /// Throughput of a stream.
    Bandwidth,
}

impl TestKind {
    /// Every test, in the order a run executes them (baselines first).
    pub const ALL: [TestKind; 7] = [
        TestKind::UdpLat,
        TestKind::TcpLat,
        TestKind::TcpBw,
        TestKind::SendLat,
        TestKind::WriteLat,
        TestKind::SendBw,
        TestKind::WriteBw,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            TestKind::UdpLat => "udp_lat",
            TestKind::TcpLat => "tcp_lat",
            TestKind::TcpBw => "tcp_bw",
            TestKind::SendLat => "send_lat",
            TestKind::WriteLat => "write_lat",
            TestKind::SendBw => "send_bw",
            TestKind::WriteBw => "write_bw",
        }
    }

    /// True for the tests that run over the RNIC.
    pub fn is_rdma(self) -> bool {
        matches!(
            self,
            TestKind::SendLat | TestKind::WriteLat | TestKind::SendBw | TestKind::WriteBw
        )
    }

    /// What the test measures.
    pub fn metric(self) -> Metric {
        match self {
            TestKind::UdpLat | TestKind::TcpLat | TestKind::SendLat | TestKind::WriteLat => {
                Metric::Latency
            }
            TestKind::TcpBw | TestKind::SendBw | TestKind::WriteBw => Metric::Bandwidth,
        }
    }

    /// The baseline an RNIC test is compared with: UDP for latency, TCP for bandwidth.
    pub fn baseline(self) -> Option<TestKind> {
        match self {
            TestKind::SendLat | TestKind::WriteLat => Some(TestKind::UdpLat),
            TestKind::SendBw | TestKind::WriteBw => Some(TestKind::TcpBw),
            _ => None,
        }
    }

    /// Whether the test can carry `size`-byte messages (UDP is bounded by one datagram).
    pub fn supports_size(self, size: u32) -> bool {
        self != TestKind::UdpLat || size <= MAX_UDP_PAYLOAD_BYTES
    }
}

impl std::fmt::Display for TestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl bex_bench::cli::TestSet for TestKind {
    const ALL: &'static [TestKind] = &TestKind::ALL;
    const GROUPS: &'static [TestGroup<TestKind>] = &[
        TestGroup {
            name: "rdma",
            help: "The four RNIC tests (send_lat, write_lat, send_bw, write_bw)",
            member: TestKind::is_rdma,
        },
        TestGroup {
            name: "baselines",
            help: "The three baselines (udp_lat, tcp_lat, tcp_bw)",
            member: |t| !t.is_rdma(),
        },
    ];
}

/// The tests `--test` names, once each and in execution order; with `baselines`, each RNIC
/// test brings the baseline it is compared with.
pub fn resolve_tests(sel: &[Tests<TestKind>], baselines: bool) -> Vec<TestKind> {
    let mut tests = Tests::resolve(sel);
    if baselines {
        let extra: Vec<TestKind> = tests.iter().filter_map(|t| t.baseline()).collect();
        tests.extend(extra);
    }
    tests.sort();
    tests.dedup();
    tests
}

/// Parses one size: a byte count with an optional binary suffix (`64`, `4K`, `4KiB`, `1M`).
pub fn parse_size(text: &str) -> Result<u32, String> {
    let t = text.trim();
    let upper = t.to_ascii_uppercase();
    let (digits, mult): (&str, u64) = if let Some(d) = upper
        .strip_suffix("KIB")
        .or_else(|| upper.strip_suffix("KB"))
        .or_else(|| upper.strip_suffix('K'))
    {
        (d, 1 << 10)
    } else if let Some(d) = upper
        .strip_suffix("MIB")
        .or_else(|| upper.strip_suffix("MB"))
        .or_else(|| upper.strip_suffix('M'))
    {
        (d, 1 << 20)
    } else {
        (upper.strip_suffix('B').unwrap_or(&upper), 1)
    };
    let n: u64 =
        digits.trim().parse().map_err(|_| format!("`{t}` is not a size (examples: 64, 4K, 1M)"))?;
    let bytes = n.checked_mul(mult).ok_or_else(|| format!("size `{t}` is too large"))?;
    if bytes == 0 {
        return Err(format!("size `{t}` is 0; sizes must be at least 1 byte"));
    }
    if bytes > u64::from(MAX_SIZE_BYTES) {
        return Err(format!("size `{t}` exceeds the largest message ({MAX_SIZE_BYTES} bytes)"));
    }
    Ok(bytes as u32)
}

/// A sorted, deduplicated list of message sizes in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SizeList(pub Vec<u32>);

/// Parses `--sizes`: comma-separated sizes or ranges; `LO..HI` is every power of two from
/// `LO` (which must be one) up to `HI`. `32..1M` is 32, 64, …, 1048576.
pub fn parse_size_list(text: &str) -> Result<SizeList, String> {
    let mut sizes = Vec::new();
    for part in text.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(format!("empty entry in size list `{text}`"));
        }
        if let Some((lo, hi)) = part.split_once("..") {
            let (lo, hi) = (parse_size(lo)?, parse_size(hi)?);
            if !lo.is_power_of_two() {
                return Err(format!("range start {lo} in `{part}` is not a power of two"));
            }
            if lo > hi {
                return Err(format!("empty range `{part}` (start is above end)"));
            }
            let mut s = lo;
            while s <= hi {
                sizes.push(s);
                match s.checked_mul(2) {
                    Some(next) => s = next,
                    None => break,
                }
            }
        } else {
            sizes.push(parse_size(part)?);
        }
    }
    sizes.sort_unstable();
    sizes.dedup();
    Ok(SizeList(sizes))
}

/// Parses one `--mtu` value: 256..4096 (IB sizes) or a soft MTU up to 61440 (multiple of 4).
pub fn parse_mtu(text: &str) -> Result<u32, String> {
    let n = parse_size(text)?;
    match bex_rnic::verbs::Mtu::from_bytes(n) {
        Some(m) => Ok(m.bytes()),
        None => Err(format!(
            "MTU {n} is neither an IB MTU (256, 512, 1024, 2048, 4096) nor a soft MTU \
             (a multiple of 4 in 256..={})",
            bex_rnic::verbs::Mtu::MAX_SOFT
        )),
    }
}

/// How a job drives the queues: one set of options (`--warmup`, `--window`, …), carried
/// unchanged by the plan and by every job it sends to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct Knobs {
    /// Round trips (latency) or messages (bandwidth) per size sent before measuring; not
    /// recorded.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub warmup: u32,
    /// Most outstanding work requests in the RNIC bandwidth tests (and the send-queue depth).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub window: u32,
    /// Work requests per post_send call in the RNIC bandwidth tests (at most --window).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// Signal every Nth work request in the RNIC bandwidth tests (at most --window; the last
    /// one is always signaled).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub signal_every: u32,
    /// RNIC tests: completion-queue polls (or memory checks in write_lat) before blocking on
    /// the queue's fd (or yielding the CPU between checks). 0 blocks at once.
    #[arg(long, value_name = "N", default_value_t = 2000)]
    pub spin_polls: u32,
}

/// The parameters of one job (one test at one size and MTU), sent from client to server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The test.
    pub test: TestKind,
    /// Message size in bytes.
    pub size: u32,
    /// Path MTU in bytes (RNIC tests only).
    pub mtu: Option<u32>,
    /// Latency: measured round trips. Bandwidth: messages per repetition.
    pub iters: u32,
    /// Bandwidth repetitions (1 for latency tests).
    pub reps: u32,
    /// How the job drives the queues.
    #[serde(flatten)]
    pub knobs: Knobs,
}

impl JobSpec {
    /// Messages the receiver of a stream gets in total (warm-up included).
    pub fn total_messages(&self) -> u64 {
        u64::from(self.knobs.warmup) + u64::from(self.iters) * u64::from(self.reps)
    }
}

/// The whole plan of a client run, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Tests in execution order.
    pub tests: Vec<TestKind>,
    /// Message sizes.
    pub sizes: Vec<u32>,
    /// Path MTUs the RNIC tests run at.
    pub mtus: Vec<u32>,
    /// Latency round trips per size.
    pub lat_iters: u32,
    /// Messages per bandwidth repetition.
    pub bw_iters: u32,
    /// Bandwidth repetitions per size.
    pub reps: u32,
    /// What every job gets.
    #[serde(flatten)]
    pub knobs: Knobs,
}

impl Plan {
    /// Checks the cross-field rules clap cannot express.
    pub fn validate(&self) -> Result<()> {
        let usage = |m: String| Err(PerfError::usage(m));
        if self.tests.is_empty() {
            return usage("no test selected".into());
        }
        if self.sizes.is_empty() {
            return usage("no message size selected".into());
        }
        let k = &self.knobs;
        if k.batch > k.window {
            return usage(format!("--batch {} exceeds --window {}", k.batch, k.window));
        }
        if k.signal_every > k.window {
            return usage(format!(
                "--signal-every {} exceeds --window {}: no completion could ever free the window",
                k.signal_every, k.window
            ));
        }
        Ok(())
    }

    /// Every job, in execution order: baselines (one per size), then RNIC tests per MTU.
    pub fn jobs(&self) -> Vec<JobSpec> {
        let mut jobs = Vec::new();
        for &test in &self.tests {
            let mtus: Vec<Option<u32>> = if test.is_rdma() {
                self.mtus.iter().copied().map(Some).collect()
            } else {
                vec![None]
            };
            for mtu in mtus {
                for &size in &self.sizes {
                    let (iters, reps) = match test.metric() {
                        Metric::Latency => (self.lat_iters, 1),
                        Metric::Bandwidth => (self.bw_iters, self.reps),
                    };
                    jobs.push(JobSpec { test, size, mtu, iters, reps, knobs: self.knobs });
                }
            }
        }
        jobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes_and_ranges() {
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4kib"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("32B"), Ok(32));
        let all = parse_size_list("32..1M").unwrap().0;
        assert_eq!(all.len(), 16);
        assert_eq!((all[0], all[15]), (32, 1 << 20));
        assert_eq!(parse_size_list("4K, 64,64,1..4").unwrap().0, vec![1, 2, 4, 64, 4096]);
    }

    #[test]
    fn bad_sizes_are_rejected_with_a_reason() {
        assert!(parse_size("0").unwrap_err().contains("at least 1 byte"));
        assert!(parse_size("0K").is_err());
        assert!(parse_size("abc").unwrap_err().contains("not a size"));
        assert!(parse_size("16M").unwrap_err().contains("exceeds"));
        assert!(parse_size_list("64,,128").is_err());
        assert!(parse_size_list("48..1K").unwrap_err().contains("power of two"));
        assert!(parse_size_list("1K..64").is_err());
    }

    #[test]
    fn mtu_accepts_ib_and_soft_sizes_only() {
        assert_eq!(parse_mtu("4096"), Ok(4096));
        assert_eq!(parse_mtu("61440"), Ok(61440));
        assert_eq!(parse_mtu("60K"), Ok(61440));
        assert!(parse_mtu("61441").is_err());
        assert!(parse_mtu("64K").is_err());
    }

    #[test]
    fn rdma_tests_bring_their_baselines_unless_told_not_to() {
        let sel = |names: &[&str]| -> Vec<Tests<TestKind>> {
            names.iter().map(|n| Tests::named(n).expect("a test name")).collect()
        };
        let t = resolve_tests(&sel(&["send_lat", "write_bw"]), true);
        assert_eq!(
            t,
            vec![TestKind::UdpLat, TestKind::TcpBw, TestKind::SendLat, TestKind::WriteBw]
        );
        let t = resolve_tests(&sel(&["send_lat", "write_bw"]), false);
        assert_eq!(t, vec![TestKind::SendLat, TestKind::WriteBw]);
        assert_eq!(resolve_tests(&sel(&["all", "tcp_lat"]), true).len(), 7);
        assert_eq!(resolve_tests(&sel(&["rdma"]), false).len(), 4);
        assert_eq!(
            resolve_tests(&sel(&["baselines"]), false),
            vec![TestKind::UdpLat, TestKind::TcpLat, TestKind::TcpBw]
        );
        assert!(Tests::<TestKind>::named("send-lat").is_none(), "names are snake_case");
    }

    #[test]
    fn udp_is_bounded_by_one_datagram() {
        assert!(TestKind::UdpLat.supports_size(32 << 10));
        assert!(TestKind::UdpLat.supports_size(MAX_UDP_PAYLOAD_BYTES));
        assert!(!TestKind::UdpLat.supports_size(64 << 10));
        assert!(TestKind::TcpLat.supports_size(1 << 20));
    }
}
