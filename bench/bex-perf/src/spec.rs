//! What to measure: the tests (one per figure), the transport settings of a job, and the
//! plan — every job of a run, in order, with its parameters. Pure data: building a plan
//! touches no network.

use bex_bench::Failure;
use std::fmt;

use bex_rnic::verbs::Mtu;
use bex_transport::Config;
use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};

/// One test: a figure of the paper.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
#[value(rename_all = "kebab-case")]
pub enum Test {
    /// Fig. 8: ping-pong latency (mean, P99) vs message size, RDMA vs TCP.
    Lat,
    /// Fig. 9: 1 MB throughput with a 32 B response per message vs messages outstanding.
    Tput,
    /// Fig. 10: 1 MB throughput vs fragment size.
    Frag,
    /// Fig. 10 on the in-memory fabric: 25 and 100 Gb/s links, virtual time, deterministic.
    FragSim,
    /// Fig. 11: 512 B request rate vs engines (QPs), 1 and 2 endpoints.
    Rate,
    /// Fig. 13 on loopback: small-flow latency under competing large flows on one engine.
    Hol,
    /// Fig. 13 on the RPC path: a 64 B call's RTT under concurrent calls with 1 MB replies.
    HolRpc,
    /// Fig. 13 on the in-memory fabric: 25 Gb/s link, virtual time, deterministic.
    HolSim,
    /// `paper/002`: zero-copy eager sends vs copy mode; one-to-many broadcast.
    Eager,
}

impl Test {
    /// Every test, in run order.
    pub const ALL: [Test; 9] = [
        Test::Lat,
        Test::Tput,
        Test::Frag,
        Test::FragSim,
        Test::Rate,
        Test::Hol,
        Test::HolRpc,
        Test::HolSim,
        Test::Eager,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Test::Lat => "lat",
            Test::Tput => "tput",
            Test::Frag => "frag",
            Test::FragSim => "frag-sim",
            Test::Rate => "rate",
            Test::Hol => "hol",
            Test::HolRpc => "hol-rpc",
            Test::HolSim => "hol-sim",
            Test::Eager => "eager",
        }
    }

    /// True when the test needs the server process (all but the simulations).
    pub fn needs_server(self) -> bool {
        !matches!(self, Test::FragSim | Test::HolSim)
    }
}

impl bex_bench::cli::TestSet for Test {
    const ALL: &'static [Test] = &Test::ALL;
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which transport a job measures (the one transport-kind enum).
pub use bex_transport::TransportKind;

/// The transport settings a job changes (the rest are [`Config`]'s defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Knobs {
    /// Endpoints (CQ + driver task) of the transport.
    pub endpoints: usize,
    /// Largest eager message.
    pub eager_max: usize,
    /// Fragment size of large messages.
    pub fragment_bytes: usize,
    /// Copy eager payloads into a bounce buffer.
    pub eager_copy: bool,
    /// Path MTU: an IB size, or a soft-only size up to 61440 (software RNIC only).
    pub mtu: u32,
    /// I/O-thread busy-poll time before blocking, µs.
    pub spin_us: u64,
    /// Completion-queue depth of each endpoint.
    pub cq_depth: u32,
}

impl Default for Knobs {
    fn default() -> Self {
        let c = Config::default();
        Knobs {
            endpoints: c.endpoints,
            eager_max: c.eager_max,
            fragment_bytes: c.fragment_bytes,
            eager_copy: c.eager_copy,
            mtu: 4096,
            spin_us: c.spin.as_micros() as u64,
            cq_depth: c.cq_depth,
        }
    }
}

impl Knobs {
    /// The transport configuration.
    pub fn config(&self) -> Result<Config> {
        let path_mtu = Mtu::from_bytes(self.mtu)
            .ok_or_else(|| BenchError::usage(format!("MTU {} is not a valid MTU", self.mtu)))?;
        let cfg = Config {
            endpoints: self.endpoints,
            eager_max: self.eager_max,
            fragment_bytes: self.fragment_bytes,
            eager_copy: self.eager_copy,
            path_mtu,
            spin: std::time::Duration::from_micros(self.spin_us),
            cq_depth: self.cq_depth,
            ..Config::default()
        };
        cfg.validate().map_err(BenchError::usage)?;
        Ok(cfg)
    }
}

/// What the server sets up for a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSetup {
    /// Transport kind.
    pub kind: TransportKind,
    /// Transports to start, each on its own bootstrap address (a transport keeps one engine
    /// per peer address, so N engines between two processes need N transports on one side).
    pub transports: u32,
    /// Settings of each (its `endpoints` is 1).
    pub knobs: Knobs,
    /// Messages up to this length are echoed back unchanged (the same buffer).
    pub echo_max: u64,
    /// Longer messages are answered with a response of this many bytes.
    pub ack_bytes: u32,
    /// Serve RPC (`hol-rpc`) instead of answering messages.
    pub rpc: bool,
}

/// Fig. 13's head-of-line test: `small`-byte round trips, one at a time, while `flows`
/// competing flows each keep `window` exchanges with `large` bytes outstanding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolShape {
    /// Small message (or reply) size.
    pub small: u64,
    /// Large message (or reply) size.
    pub large: u64,
    /// Competing large flows.
    pub flows: u32,
    /// Large messages (or calls) outstanding per flow.
    pub window: u32,
    /// Unrecorded small round trips.
    pub warmup: u32,
    /// Recorded small round trips.
    pub iters: u32,
}

/// The client's side of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Work {
    /// One message outstanding: send, wait for the echo, repeat (the echo is sent next).
    PingPong {
        /// Message size.
        size: u64,
        /// Unrecorded round trips first.
        warmup: u32,
        /// Recorded round trips.
        iters: u32,
    },
    /// `window` requests outstanding per socket, one socket per engine; each answered.
    Window {
        /// Request size.
        size: u64,
        /// Sockets (RDMA: each on its own engine; TCP: each its own connection).
        engines: u32,
        /// Requests outstanding per socket.
        window: u32,
        /// Unrecorded requests per socket first.
        warmup: u64,
        /// Requests per repetition (over all sockets).
        msgs: u64,
        /// Repetitions.
        reps: u32,
    },
    /// Messages: a ping-pong on one socket while the large flows are sockets on the same
    /// engine.
    Hol {
        /// The small and large flows.
        #[serde(flatten)]
        shape: HolShape,
    },
    /// RPC calls with small replies, one at a time, while each large flow is a task keeping
    /// calls with large replies outstanding to the same server.
    RpcHol {
        /// The small and large flows.
        #[serde(flatten)]
        shape: HolShape,
        /// Two connections per destination (the bulk lane) rather than one.
        lanes: bool,
    },
    /// One buffer sent to `fanout` sockets (one engine), every copy answered; timed until
    /// the last answer.
    Broadcast {
        /// Buffer size.
        size: u64,
        /// One shared buffer for every socket (else a copy each, as `send` consumes it).
        shared: bool,
        /// Destination sockets.
        fanout: u32,
        /// Unrecorded broadcasts.
        warmup: u32,
        /// Recorded broadcasts.
        iters: u32,
    },
    /// `frag` on the in-memory fabric in virtual time (no server): `msgs` messages of
    /// `size` bytes with `window` outstanding, goodput measured at the receiver.
    SimTput {
        /// Message size.
        size: u64,
        /// Messages outstanding.
        window: u32,
        /// Messages measured (after `window` unmeasured ones).
        msgs: u32,
        /// Link rate, Gb/s.
        link_gbps: u32,
        /// Fabric seed.
        seed: u64,
    },
    /// `hol` on the in-memory fabric in virtual time (no server).
    Sim {
        /// Competing large flows.
        flows: u32,
        /// Large message size.
        large: u64,
        /// Recorded small round trips.
        samples: u32,
        /// Link rate, Gb/s.
        link_gbps: u32,
        /// Fabric seed.
        seed: u64,
    },
}

/// One measurement: a point of a series of a figure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// The figure.
    pub test: Test,
    /// The line it belongs to (`rdma`, `tcp`, `rdma 2 endpoints`, `4K fragments`, …).
    pub series: String,
    /// The x value (size, outstanding messages, fragment, engines or large flows).
    pub x: u64,
    /// Transport kind.
    pub kind: TransportKind,
    /// Client transport settings.
    pub knobs: Knobs,
    /// Server setup (`None` for simulation jobs).
    pub server: Option<ServerSetup>,
    /// The client's work.
    pub work: Work,
}

/// Settings a run may override.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Settings {
    /// Small run for CI.
    pub quick: bool,
    /// Recorded round trips of latency jobs (`lat`, `eager`; `hol` uses a third).
    pub iters: u32,
    /// Repetitions of throughput and rate jobs.
    pub reps: u32,
    /// I/O-thread busy-poll time, µs (both processes).
    pub spin_us: u64,
    /// Seed of the simulated fabric.
    pub seed: u64,
    /// Only the jobs of these series (`rdma`, `tcp`, …); empty: every series.
    pub series: Vec<String>,
    /// Message sizes of `lat` instead of its defaults.
    pub sizes: Vec<u64>,
}

impl Settings {
    /// Defaults for a full or a quick run.
    pub fn new(quick: bool) -> Settings {
        Settings {
            quick,
            iters: if quick { 100 } else { 2000 },
            reps: if quick { 1 } else { 3 },
            spin_us: 0,
            seed: 1,
            series: Vec::new(),
            sizes: Vec::new(),
        }
    }
}

/// Every job of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Selected tests, in run order.
    pub tests: Vec<Test>,
    /// The settings.
    pub settings: Settings,
    /// The jobs, in run order.
    pub jobs: Vec<Job>,
}

/// Sizes 2^lo ..= 2^hi.
fn pow2(lo: u32, hi: u32) -> Vec<u64> {
    (lo..=hi).map(|e| 1u64 << e).collect()
}

/// An endpoint's CQ holds completions of all its engines (`sq + rq` each, twice over for
/// slack): sized for `engines` at default depths.
fn cq_for(engines: u32) -> u32 {
    let c = Config::default();
    (2 * (c.sq_depth + c.rq_depth) * engines).max(c.cq_depth)
}

const KB: u64 = 1024;
const MB: u64 = 1024 * 1024;
/// Response size of throughput-style jobs (the paper's 32 B).
pub const ACK_BYTES: u32 = 32;
/// Small message of the HoL tests.
pub const HOL_SMALL: u64 = 64;
/// I/O-thread busy-poll time of `lat`'s "rdma spin" series, µs.
pub const LAT_SPIN_US: u64 = 20;

/// `hol` and `hol-rpc` at `flows` competing 1 MB flows of 2 outstanding each, `iters`
/// recorded 64 B round trips after 10 unrecorded.
fn hol_shape(flows: u32, iters: u32) -> HolShape {
    HolShape { small: HOL_SMALL, large: MB, flows, window: 2, warmup: 10, iters }
}

impl Plan {
    /// The jobs of `tests` with `settings`; tests run in [`Test::ALL`] order, each once.
    pub fn new(tests: &[Test], settings: Settings) -> Result<Plan> {
        let mut sel: Vec<Test> = tests.to_vec();
        sel.sort();
        sel.dedup();
        if sel.is_empty() {
            return Err(BenchError::usage("no test selected"));
        }
        if settings.iters == 0 || settings.reps == 0 {
            return Err(BenchError::usage("--iters and --reps must be at least 1"));
        }
        let s = &settings;
        let q = s.quick;
        let base = Knobs { spin_us: s.spin_us, ..Knobs::default() };
        let warm = (s.iters / 10).clamp(10, 200);
        let mut jobs = Vec::new();
        let server = |kind, knobs: Knobs, transports, echo_max| ServerSetup {
            kind,
            transports,
            knobs: Knobs { endpoints: 1, ..knobs },
            echo_max,
            ack_bytes: ACK_BYTES,
            rpc: false,
        };
        for &t in &sel {
            match t {
                Test::Lat => {
                    let sizes = match () {
                        _ if !s.sizes.is_empty() => s.sizes.clone(),
                        _ if q => vec![32, KB, 16 * KB],
                        _ => pow2(5, 14),
                    };
                    // With waiting drivers (the default) and, unless spinning was asked
                    // for everywhere, with drivers that poll LAT_SPIN_US first.
                    let spin = Knobs { spin_us: LAT_SPIN_US, ..base };
                    let mut series = vec![("rdma", TransportKind::Rdma, base)];
                    if base.spin_us == 0 {
                        series.push(("rdma spin", TransportKind::Rdma, spin));
                    }
                    series.push(("tcp", TransportKind::Tcp, base));
                    for &size in &sizes {
                        for &(name, kind, knobs) in &series {
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: size,
                                kind,
                                knobs,
                                server: Some(server(kind, knobs, 1, u64::MAX)),
                                work: Work::PingPong { size, warmup: warm, iters: s.iters },
                            });
                        }
                    }
                }
                Test::Tput => {
                    let windows: Vec<u64> = if q { vec![1, 8] } else { vec![1, 2, 4, 8, 16, 32] };
                    let msgs = if q { 24 } else { 200 };
                    // The paper's MTUs (1 KB, 4 KB) and the software RNIC's largest (60 KB, a
                    // soft-only size: fewer, larger UDP datagrams).
                    let series = [
                        ("rdma mtu4096", TransportKind::Rdma, 4096),
                        ("rdma mtu1024", TransportKind::Rdma, 1024),
                        ("rdma mtu61440", TransportKind::Rdma, 61440),
                        ("tcp", TransportKind::Tcp, 4096),
                    ];
                    for &w in &windows {
                        for (name, kind, mtu) in series {
                            if q && mtu != 4096 {
                                continue;
                            }
                            let knobs = Knobs { mtu, ..base };
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: w,
                                kind,
                                knobs,
                                server: Some(server(kind, knobs, 1, 0)),
                                work: Work::Window {
                                    size: MB,
                                    engines: 1,
                                    window: w as u32,
                                    warmup: w.max(4),
                                    msgs,
                                    reps: s.reps,
                                },
                            });
                        }
                    }
                }
                Test::Frag => {
                    let frags = if q { vec![4 * KB, 64 * KB, MB] } else { pow2(10, 20) };
                    let msgs = if q { 24 } else { 200 };
                    for &f in &frags {
                        let knobs = Knobs { fragment_bytes: f as usize, ..base };
                        jobs.push(Job {
                            test: t,
                            series: "rdma".into(),
                            x: f,
                            kind: TransportKind::Rdma,
                            knobs,
                            server: Some(server(TransportKind::Rdma, knobs, 1, 0)),
                            work: Work::Window {
                                size: MB,
                                engines: 1,
                                window: 16,
                                warmup: 16,
                                msgs,
                                reps: s.reps,
                            },
                        });
                    }
                }
                Test::FragSim => {
                    let frags = if q { vec![KB, 16 * KB, MB] } else { pow2(10, 20) };
                    let msgs = if q { 8 } else { 64 };
                    for &f in &frags {
                        for link in [25, 100] {
                            let knobs = Knobs { fragment_bytes: f as usize, ..base };
                            jobs.push(Job {
                                test: t,
                                series: format!("{link} Gb/s"),
                                x: f,
                                kind: TransportKind::Rdma,
                                knobs,
                                server: None,
                                work: Work::SimTput {
                                    size: MB,
                                    window: 16,
                                    msgs,
                                    link_gbps: link,
                                    seed: s.seed,
                                },
                            });
                        }
                    }
                }
                Test::Rate => {
                    let engines: Vec<u64> = if q { vec![1, 8] } else { pow2(0, 7) };
                    let msgs = if q { 4000 } else { 20_000 };
                    let series = [
                        ("rdma 1 endpoint", TransportKind::Rdma, 1),
                        ("rdma 2 endpoints", TransportKind::Rdma, 2),
                        ("tcp", TransportKind::Tcp, 1),
                    ];
                    for &n in &engines {
                        for (name, kind, io) in series {
                            let n32 = n as u32;
                            let knobs = Knobs { endpoints: io, cq_depth: cq_for(n32), ..base };
                            // RDMA: one server transport per engine; TCP: N connections to one.
                            let transports = if kind == TransportKind::Rdma { n32 } else { 1 };
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: n,
                                kind,
                                knobs,
                                server: Some(server(
                                    kind,
                                    Knobs { cq_depth: Config::default().cq_depth, ..knobs },
                                    transports,
                                    u64::MAX,
                                )),
                                work: Work::Window {
                                    size: 512,
                                    engines: n32,
                                    window: 8,
                                    warmup: 16,
                                    msgs: msgs.max(n * 64),
                                    reps: s.reps,
                                },
                            });
                        }
                    }
                }
                Test::Hol => {
                    let flows: Vec<u64> = if q { vec![0, 2] } else { vec![0, 1, 2, 4, 8] };
                    let iters = (s.iters / 4).max(20);
                    for &k in &flows {
                        for (name, frag) in [("4K fragments", 4 * KB), ("no fragmentation", MB)] {
                            let knobs = Knobs { fragment_bytes: frag as usize, ..base };
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: k,
                                kind: TransportKind::Rdma,
                                knobs,
                                server: Some(server(TransportKind::Rdma, knobs, 1, HOL_SMALL)),
                                work: Work::Hol { shape: hol_shape(k as u32, iters) },
                            });
                        }
                    }
                }
                Test::HolRpc => {
                    let flows: Vec<u64> = if q { vec![0, 2] } else { vec![0, 1, 2, 4] };
                    let iters = (s.iters / 4).max(20);
                    let series = [
                        ("rdma 4K fragments", TransportKind::Rdma, 4 * KB, true),
                        ("rdma no fragmentation", TransportKind::Rdma, 2 * MB, true),
                        ("rdma 4K fragments one lane", TransportKind::Rdma, 4 * KB, false),
                        ("tcp", TransportKind::Tcp, 4 * KB, true),
                        ("tcp one lane", TransportKind::Tcp, 4 * KB, false),
                    ];
                    for &k in &flows {
                        for (name, kind, frag, lanes) in series {
                            if q && !lanes {
                                continue;
                            }
                            let knobs = Knobs { fragment_bytes: frag as usize, ..base };
                            let mut srv = server(kind, knobs, 1, 0);
                            srv.rpc = true;
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: k,
                                kind,
                                knobs,
                                server: Some(srv),
                                work: Work::RpcHol { shape: hol_shape(k as u32, iters), lanes },
                            });
                        }
                    }
                }
                Test::HolSim => {
                    let flows: Vec<u64> = if q { vec![0, 4] } else { vec![0, 1, 2, 4, 8] };
                    let samples = if q { 40 } else { 300 };
                    for &k in &flows {
                        for (name, frag) in [("4K fragments", 4 * KB), ("no fragmentation", MB)] {
                            // As in the transport's own simulation test: small messages eager.
                            let knobs =
                                Knobs { fragment_bytes: frag as usize, eager_max: 4096, ..base };
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: k,
                                kind: TransportKind::Rdma,
                                knobs,
                                server: None,
                                work: Work::Sim {
                                    flows: k as u32,
                                    large: MB,
                                    samples,
                                    link_gbps: 25,
                                    seed: s.seed,
                                },
                            });
                        }
                    }
                }
                Test::Eager => {
                    // Eager up to 64 KB so the copy is large enough to see; with blocking I/O
                    // threads and (unless spinning everywhere) with spinning ones, whose lower
                    // RTT leaves the copy a larger share.
                    let sizes = if q { vec![KB, 16 * KB] } else { pow2(10, 16) };
                    let eager_max = 64 * KB as usize;
                    let mut modes = vec![("", base.spin_us)];
                    if base.spin_us == 0 {
                        modes.push((" spin", LAT_SPIN_US));
                    }
                    for &size in &sizes {
                        for &(suffix, spin_us) in &modes {
                            for (name, copy) in [("zero-copy", false), ("copy", true)] {
                                let knobs = Knobs { eager_max, eager_copy: copy, spin_us, ..base };
                                jobs.push(Job {
                                    test: t,
                                    series: format!("{name}{suffix}"),
                                    x: size,
                                    kind: TransportKind::Rdma,
                                    knobs,
                                    server: Some(server(TransportKind::Rdma, knobs, 1, u64::MAX)),
                                    work: Work::PingPong { size, warmup: warm, iters: s.iters },
                                });
                            }
                        }
                    }
                    let bsizes = if q { vec![4 * KB] } else { vec![KB, 4 * KB, 16 * KB, 64 * KB] };
                    for &size in &bsizes {
                        // One shared registered buffer sent to every socket (paper/002's
                        // reusable buffers), a copy per socket sent zero-copy, and a copy per
                        // socket copied again into the bounce buffer.
                        for (name, copy, shared) in [
                            ("broadcast shared", false, true),
                            ("broadcast zero-copy", false, false),
                            ("broadcast copy", true, false),
                        ] {
                            let knobs = Knobs { eager_max, eager_copy: copy, ..base };
                            jobs.push(Job {
                                test: t,
                                series: name.into(),
                                x: size,
                                kind: TransportKind::Rdma,
                                knobs,
                                server: Some(server(TransportKind::Rdma, knobs, 1, 0)),
                                work: Work::Broadcast {
                                    size,
                                    shared,
                                    fanout: 8,
                                    warmup: warm / 2,
                                    iters: (s.iters / 4).max(20),
                                },
                            });
                        }
                    }
                }
            }
        }
        if !s.series.is_empty() {
            jobs.retain(|j| s.series.contains(&j.series));
            if jobs.is_empty() {
                return Err(BenchError::usage(format!(
                    "no job of the selected tests is in series {:?}",
                    s.series
                )));
            }
        }
        for j in &jobs {
            j.knobs.config()?;
            if let Some(sv) = &j.server {
                sv.knobs.config()?;
            }
        }
        Ok(Plan { tests: sel, settings, jobs })
    }

    /// True when some job needs the server process.
    pub fn needs_server(&self) -> bool {
        self.jobs.iter().any(|j| j.server.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_test_has_jobs_and_valid_configs() {
        for quick in [true, false] {
            let plan = Plan::new(&Test::ALL, Settings::new(quick)).unwrap();
            for t in Test::ALL {
                assert!(plan.jobs.iter().any(|j| j.test == t), "{t} has no job");
            }
            assert!(plan.needs_server());
            for j in &plan.jobs {
                assert_eq!(j.server.is_none(), !j.test.needs_server(), "{j:?}");
                if let Some(s) = &j.server {
                    assert_eq!(s.knobs.endpoints, 1);
                    assert_eq!(s.knobs.eager_max, j.knobs.eager_max, "receivers size buffers");
                }
            }
        }
    }

    #[test]
    fn the_paper_parameters_are_in_the_plan() {
        let plan = Plan::new(&Test::ALL, Settings::new(false)).unwrap();
        let xs = |t: Test, series: &str| -> Vec<u64> {
            plan.jobs.iter().filter(|j| j.test == t && j.series == series).map(|j| j.x).collect()
        };
        assert_eq!(xs(Test::Lat, "rdma"), pow2(5, 14), "32 B ... 16 KB");
        assert_eq!(xs(Test::Lat, "tcp"), pow2(5, 14));
        assert_eq!(xs(Test::Lat, "rdma spin"), pow2(5, 14));
        let spin = plan.jobs.iter().find(|j| j.series == "rdma spin").unwrap();
        assert_eq!((spin.knobs.spin_us, spin.server.unwrap().knobs.spin_us), (20, 20));
        assert_eq!(xs(Test::Frag, "rdma"), pow2(10, 20), "1 KB ... 1 MB fragments");
        assert_eq!(*xs(Test::Rate, "rdma 2 endpoints").last().unwrap(), 128);
        assert_eq!(xs(Test::Hol, "4K fragments"), vec![0, 1, 2, 4, 8]);
        for j in plan.jobs.iter().filter(|j| j.test == Test::Tput) {
            assert!(matches!(j.work, Work::Window { size: MB, engines: 1, .. }), "{j:?}");
            assert_eq!(j.server.unwrap().ack_bytes, 32);
            assert_eq!(j.server.unwrap().echo_max, 0, "every 1 MB message gets 32 B back");
        }
        let nofrag = plan.jobs.iter().find(|j| j.series == "no fragmentation").unwrap();
        assert_eq!(nofrag.knobs.fragment_bytes as u64, MB, "fragment = message size");
        let copy = plan.jobs.iter().find(|j| j.series == "copy").unwrap();
        assert!(copy.knobs.eager_copy && copy.server.unwrap().knobs.eager_copy);
        assert_eq!(xs(Test::Eager, "copy spin"), pow2(10, 16), "1 KB ... 64 KB, all eager");
        assert!(plan
            .jobs
            .iter()
            .filter(|j| j.test == Test::Eager)
            .all(|j| j.knobs.eager_max == 65536));
        let rate = plan.jobs.iter().find(|j| j.test == Test::Rate && j.x == 128).unwrap();
        assert!(rate.knobs.config().unwrap().cq_depth >= 128 * 2 * 96);
    }

    #[test]
    fn selection_order_and_errors() {
        let plan = Plan::new(&[Test::Eager, Test::Lat, Test::Lat], Settings::new(true)).unwrap();
        assert_eq!(plan.tests, vec![Test::Lat, Test::Eager]);
        assert_eq!(plan.jobs.first().unwrap().test, Test::Lat);
        let sim = Plan::new(&[Test::HolSim], Settings::new(true)).unwrap();
        assert!(!sim.needs_server());
        assert!(Plan::new(&[], Settings::new(true)).is_err());
        let zero = Settings { iters: 0, ..Settings::new(true) };
        assert!(matches!(
            Plan::new(&[Test::Lat], zero),
            Err(BenchError::Harness(bex_bench::Error::Usage(_)))
        ));
    }
}
