//! `bex-simcluster`: the parameter server's fault matrix in deterministic simulation.
//!
//! A 2 mini-pod × 2 shard cluster runs the real `ps-server` shard code
//! ([`bex_ps_server::shard::start_shard`]), the real RPC client with its recovery ladder and
//! the real [`PsClient`] over simulated NICs ([`bex_transport::simio`]) on tokio's paused
//! clock, on one thread. Each host has two simulated NICs standing for its RDMA and TCP
//! paths, so an RDMA failure is a fabric fault on one of them.
//!
//! Every scenario runs two canaries pushing +1 to the same keys of a zero-initialised table
//! trained by SGD with rate 1, each to its own component of the row, so a component counts
//! one canary's pushes applied to it. They push to a key on one schedule, one push in flight
//! per key each, so two identities race on every row. The first is a serving client (one
//! attempt per push); the second a training client, which retries a failed push under its
//! sequence number as trainers do, so its failures are rare and a push applied twice shows.
//! A trainer pushes gradients to an embedding table and readers in both pods fetch, while the
//! scenario's faults happen on schedule. Then the network heals and the run checks:
//! - no acknowledged push lost: every canary component ≥ its acknowledged pushes;
//! - no push applied twice: every canary component ≤ acknowledged + failed pushes (with one
//!   writer per row, a push whose effect reached a replica under another push's identity
//!   was invisible; with two, its retry after a kill of the training shard is applied
//!   again);
//! - every request answered or failed by its deadline (the one the RPC client enforces on a
//!   call, `max_attempts × (Tc + Tr)`);
//! - replicas converge: every pod's rows equal the training pod's, bit for bit;
//! - and the scenario's own claim (fallback within 1 s, a hung host noticed by keepalive
//!   expiry, quarantine engaged and released).
//!
//! A run is a function of (scenario, seed): [`run`] twice gives the same [`Report`], which
//! carries a fingerprint of everything observed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_client::fanout::PsClient;
use bex_client::node::{client_config, transport_config, ClientRole};
use bex_ps_core::TableSet;
use bex_ps_proto::config::{InitConfig, OptimizerConfig, TableConfig};
use bex_ps_proto::topology::Topology;
use bex_ps_proto::Config;
use bex_ps_server::shard::{start_shard, RunningShard, ShardStart};
use bex_rnic::soft::{FaultRates, LinkFault, LinkModel};
use bex_transport::sim::SimNet;
use bex_transport::simio::{SimHub, SimTransport};
use bex_transport::{Transport, TransportKind};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A fault scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// 1 % loss, 1 % duplication and 1 % reordering on every link for the whole run.
    Loss,
    /// A replica shard killed (its host gone) and restarted: it bootstraps from the training
    /// pod.
    ShardRestart,
    /// Every server of mini-pod 1 cut off from everything, then healed.
    PodPartition,
    /// A replica host hangs (nothing answers, connections are not refused): keepalive
    /// expiry and request deadlines move its traffic; then it is restarted.
    Hang,
    /// The training shard 0's RDMA path fails while its TCP path works: clients fall back
    /// to TCP within 1 s, and return to RDMA after the path heals and a re-probe.
    RdmaFallback,
    /// A replica is down long enough that a reader quarantines it; after it restarts, a
    /// probe succeeds and the quarantine is released.
    Quarantine,
    /// The canary client is replaced mid-run by a new one with the same id (a restarted
    /// process): the new one's pushes must be applied, each exactly once (issue 13: under
    /// a stable push identity they were answered Duplicate and dropped).
    ClientRestart,
    /// A training shard stopped gracefully under load, as by SIGTERM (drain: pushes refused
    /// and retried, replication flushed; then a checkpoint), and started again from its
    /// checkpoint with a new replication identity: nothing acknowledged is lost or applied
    /// twice, and the replicas converge.
    TrainingRestart,
    /// A training shard killed under load, as by SIGKILL (no drain, no final checkpoint),
    /// and started again from an older checkpoint: it catches up from the replica (rows by
    /// version, dedupe windows), so no push acknowledged under `push_ack = replicated` is
    /// lost, none applied twice, and the pods converge bit-exactly. Before the kill its
    /// replication links are cut for 1.2 s, so replication requests fail and go again
    /// (rebuilt from the rows of the moment) while the two canaries' pushes to each row race:
    /// a push's effect must never reach the replica under another push's identity.
    TrainingKill,
    /// `TrainingKill` and then a replica killed and bootstrapped again, with the trainer's
    /// table bounded (128 rows a shard), admitting a key at its second push and dropping
    /// rows not pushed for 1 s, while the trainer's keys move on (half of its 400 keys at a
    /// time, a quarter further each second: rows are evicted and expire): evictions and
    /// expiry decided by row versions alone, copies in any order, a training shard's
    /// catch-up over an older checkpoint and a fresh replica's bootstrap must still leave
    /// every pod with the same rows.
    BoundedTrainingKill,
}

impl Scenario {
    /// Every scenario.
    pub const ALL: [Scenario; 10] = [
        Scenario::Loss,
        Scenario::ShardRestart,
        Scenario::PodPartition,
        Scenario::Hang,
        Scenario::RdmaFallback,
        Scenario::Quarantine,
        Scenario::ClientRestart,
        Scenario::TrainingRestart,
        Scenario::TrainingKill,
        Scenario::BoundedTrainingKill,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Loss => "loss",
            Scenario::ShardRestart => "shard-restart",
            Scenario::PodPartition => "pod-partition",
            Scenario::Hang => "hang",
            Scenario::RdmaFallback => "rdma-fallback",
            Scenario::Quarantine => "quarantine",
            Scenario::ClientRestart => "client-restart",
            Scenario::TrainingRestart => "training-restart",
            Scenario::TrainingKill => "training-kill",
            Scenario::BoundedTrainingKill => "bounded-training-kill",
        }
    }

    /// The scenario called `name`.
    pub fn from_name(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What one run observed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Scenario.
    pub scenario: Scenario,
    /// Seed.
    pub seed: u64,
    /// Virtual time the run took, in ms.
    pub virtual_ms: u64,
    /// Canary pushes acknowledged.
    pub pushes_acked: u64,
    /// Canary pushes that failed (applied or not).
    pub pushes_failed: u64,
    /// Trainer pushes acknowledged / failed.
    pub train_pushes: (u64, u64),
    /// Reader fetches answered / failed.
    pub fetches: (u64, u64),
    /// The slowest request of the serving calls (the first canary's pushes, the trainer's,
    /// the readers' fetches), in ms, and the deadline every one of them had to meet.
    pub slowest_ms: (u64, u64),
    /// The slowest push of the second (training, retrying) canary, in ms, and its bound: its
    /// retry budget plus one training call's deadline.
    pub slowest_retrying_push_ms: (u64, u64),
    /// RDMA → TCP fallbacks, RDMA recoveries, quarantines, calls served over TCP (all
    /// clients).
    pub fallbacks: u64,
    /// See `fallbacks`.
    pub recoveries: u64,
    /// See `fallbacks`.
    pub quarantines: u64,
    /// See `fallbacks`.
    pub tcp_calls: u64,
    /// Engines failed by keepalive expiry, on every node.
    pub keepalive_failures: u64,
    /// Each client's RPC counters: canary, second canary, trainer, reader in pod 0, reader in pod 1.
    pub clients: Vec<bex_rpc::ClientCounts>,
    /// Virtual ms from the RDMA failure to the first push served after it (rdma-fallback).
    pub fallback_ms: Option<u64>,
    /// Virtual ms from the end of the faults until every replica matched the training pod.
    pub converged_ms: Option<u64>,
    /// Invariant violations (empty when the run passed).
    pub violations: Vec<String>,
    /// A hash of everything above and of the final rows: equal runs have equal ones.
    pub fingerprint: u64,
}

impl Report {
    /// No violation.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

const PODS: u32 = 2;
const SHARDS: u32 = 2;
const CANARY: u32 = 0;
const EMB: u32 = 1;
const EMB_DIM: u32 = 8;
const CANARY_KEYS: u64 = 8;
/// Canaries, each pushing to its own component of every canary row.
const CANARY_WRITERS: usize = 2;
/// Pod 1, shard 1 in the client's endpoint order (pod-major).
const POD1_SHARD1: usize = (SHARDS + 1) as usize;
const EMB_KEYS: u64 = 400;
/// When the workload stops; faults are over by then.
const WORKLOAD_END: Duration = Duration::from_millis(3_000);
/// How long replicas get to converge after the heal.
const SETTLE: Duration = Duration::from_secs(5);
/// The RDMA fallback target (issue 7).
const FALLBACK_BOUND: Duration = Duration::from_secs(1);

/// Where the simulated push clock starts, µs (versions far from 0, the never-pushed row's).
const PUSH_EPOCH_US: u64 = 1 << 40;

/// Rows a shard keeps of the trainer's table in [`Scenario::BoundedTrainingKill`] (two a
/// stripe; the trainer pushes about 200 keys a shard).
const BOUNDED_ROWS: u64 = 128;

fn cluster_config(scenario: Scenario) -> Config {
    let mut cfg = Config::local(PODS, SHARDS, 17_000);
    cfg.cluster.name = "sim".into();
    cfg.server.checkpoint_interval_s = 0;
    cfg.server.checkpoint_on_shutdown = false;
    cfg.server.restore_on_start = false;
    cfg.tables = vec![
        TableConfig {
            name: "canary".into(),
            dim: CANARY_WRITERS as u32,
            seed: None,
            init: InitConfig::Zeros,
            optimizer: OptimizerConfig::Sgd { lr: 1.0 },
            admission: Default::default(),
            capacity: Default::default(),
        },
        TableConfig {
            name: "emb".into(),
            dim: EMB_DIM,
            seed: None,
            init: InitConfig::Uniform { scale: 0.01 },
            optimizer: OptimizerConfig::Adagrad { lr: 0.05, initial_accumulator: 0.1, eps: 1e-8 },
            admission: Default::default(),
            capacity: Default::default(),
        },
    ];
    // The shipped transport and RPC settings (keepalive 100 ms / 1 s, Tc 10 ms, Tr 40 ms),
    // but a quarantine after a few connection failures, probed every second, so the
    // quarantine scenario engages and releases it within the run.
    cfg.rpc.quarantine_connect_failures = 1;
    cfg.rpc.quarantine_s = 1;
    cfg.rpc.rdma_reprobe_s = 1;
    if scenario == Scenario::BoundedTrainingKill {
        cfg.tables[EMB as usize].capacity.max_rows = BOUNDED_ROWS;
        cfg.tables[EMB as usize].admission.after_pushes = 2;
        cfg.tables[EMB as usize].capacity.ttl_s = 1;
    }
    cfg
}

/// The longest a `PsClient` call may take: the deadline the RPC client enforces on every
/// call (`RpcConfig::call_deadline_ms`), plus tokio's 1 ms timer resolution on the few
/// timers an attempt nests.
fn call_deadline(cfg: &Config) -> Duration {
    call_deadline_of(cfg, cfg.rpc.request_timeout_ms)
}

/// [`call_deadline`] with request deadline `tr` (ms).
fn call_deadline_of(cfg: &Config, tr: u64) -> Duration {
    Duration::from_millis(cfg.rpc.call_deadline_ms(tr) + 8)
}

struct Shard {
    rdma: SimTransport,
    tcp: SimTransport,
    running: RunningShard,
}

/// What a shard starts from: fresh tables, or a checkpoint's.
struct Restored {
    tables: TableSet,
    update_seq: u64,
    windows: Vec<bex_ps_core::dedupe::WindowState>,
}

/// The simulated cluster.
struct Cluster {
    hub: Arc<SimHub>,
    cfg: Config,
    topo: Topology,
    tcfg: bex_transport::Config,
    shards: BTreeMap<(u32, u32), Shard>,
    next_client: u16,
    /// Shard starts so far (each start's replication identity is drawn from it).
    starts: u64,
    seed: u64,
    /// When the run began (virtual time): push clocks count from it.
    origin: std::time::Instant,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.cfg.cluster.data_dir);
    }
}

impl Cluster {
    async fn new(seed: u64, link: LinkModel, scenario: Scenario) -> Cluster {
        let mut net = SimNet::new(seed, link);
        // Many runs share a process: one arena and a small reservation per host.
        net.set_pool_config(SimNet::small_pools(64 << 20));
        let hub = SimHub::new(net);
        tokio::spawn(hub.clone().drive());
        let cfg = cluster_config(scenario);
        let topo = cfg.topology().expect("the simulated cluster's topology");
        let tcfg = transport_config(&cfg, b"sim");
        let mut cfg = cfg;
        // Checkpoints (training-restart) go to a directory of this run's own.
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        cfg.cluster.data_dir = std::env::temp_dir()
            .join(format!("bex-simcluster-{}-{seed}-{run}", std::process::id()));
        let mut c = Cluster {
            hub,
            cfg,
            topo,
            tcfg,
            shards: BTreeMap::new(),
            next_client: 0,
            starts: 0,
            seed,
            origin: bex_ps_server::clock::now(),
        };
        // The training pod first, so replicas bootstrap from it.
        for pod in [c.topo.training_pod(), 1 - c.topo.training_pod()] {
            for shard in 0..SHARDS {
                c.start(pod, shard).await;
            }
        }
        c
    }

    fn host(&self, rdma: SocketAddr, tcp: SocketAddr) -> (SimTransport, SimTransport) {
        let mut t = self
            .hub
            .add_host(vec![
                (rdma, TransportKind::Rdma, self.tcfg.clone()),
                (tcp, TransportKind::Tcp, self.tcfg.clone()),
            ])
            .expect("a simulated host");
        let tcp = t.pop().expect("two transports");
        (t.pop().expect("two transports"), tcp)
    }

    async fn start(&mut self, pod: u32, shard: u32) {
        let tables = TableSet::new(self.cfg.table_specs()).expect("valid tables");
        self.start_from(pod, shard, Restored { tables, update_seq: 0, windows: Vec::new() }, false)
            .await;
    }

    /// Starts the shard from its checkpoint (written by [`Cluster::stop_gracefully`]).
    async fn start_restored(&mut self, pod: u32, shard: u32) -> Result<(), String> {
        let path = self.cfg.checkpoint_path(pod, shard);
        let layout = (shard, self.cfg.cluster.shards);
        let r = bex_ps_core::checkpoint::restore_checkpoint(&path, &self.cfg.table_specs(), layout)
            .map_err(|e| format!("restoring pod {pod} shard {shard}: {e}"))?
            .ok_or_else(|| format!("restoring pod {pod} shard {shard}: no checkpoint"))?;
        let restored =
            Restored { tables: r.tables, update_seq: r.meta.update_seq, windows: r.windows };
        self.start_from(pod, shard, restored, true).await;
        Ok(())
    }

    /// Stops the shard as SIGTERM does: drain, checkpoint, gone. The changed keys the
    /// drain could not get acknowledged, if any.
    async fn stop_gracefully(&mut self, pod: u32, shard: u32) -> Result<u64, String> {
        let server = self.shards[&(pod, shard)].running.server.clone();
        let timeout = Duration::from_millis(self.cfg.server.drain_timeout_ms);
        let drained = server.drain(timeout).await;
        server
            .checkpoint()
            .await
            .map_err(|e| format!("checkpoint of pod {pod} shard {shard}: {e}"))?;
        self.kill(pod, shard);
        Ok(drained.replication_left_keys)
    }

    async fn start_from(&mut self, pod: u32, shard: u32, from: Restored, restored: bool) {
        let Restored { tables, update_seq, windows: dedupe_windows } = from;
        let a = self.topo.server(pod, shard).expect("the shard is in the topology").clone();
        let (rdma, tcp) = self.host(a.rdma, a.tcp);
        // Replayable, as a process's random identity is not: from the seed, fresh per start.
        self.starts += 1;
        let incarnation = bex_ps_proto::shard::mix64(self.seed ^ self.starts << 20);
        // Rising with (virtual) time, continuous across restarts as a wall clock is;
        // replayable. (Starting 2^40 µs higher at each start, as before, moved a restarted
        // shard's clock weeks on, and its TTL then dropped every row from before the restart.)
        let (base, origin) = (PUSH_EPOCH_US, self.origin);
        let push_clock = bex_ps_server::server::PushClock::new(move || {
            base + (bex_ps_server::clock::now() - origin).as_micros() as u64
        });
        let mut running = start_shard(
            &self.cfg,
            &self.topo,
            ShardStart {
                pod,
                shard,
                tables,
                update_seq,
                restored,
                dedupe_windows,
                incarnation,
                push_clock,
            },
            (Transport::Sim(rdma.clone()), Transport::Sim(tcp.clone())),
        )
        .await
        .expect("every pod of a simulated cluster has one configuration");
        if running.server.has_ttl() {
            // ps-server's once-a-second expiry (there on a blocking thread; here inline, so
            // the run stays a function of its seed).
            let server = running.server.clone();
            running.tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    server.expire_rows();
                }
            }));
        }
        self.shards.insert((pod, shard), Shard { rdma, tcp, running });
    }

    /// The host dies: nothing answers, its addresses refuse connections.
    fn kill(&mut self, pod: u32, shard: u32) {
        if let Some(s) = self.shards.remove(&(pod, shard)) {
            self.hub.kill(&s.rdma);
            self.hub.kill(&s.tcp);
            for t in &s.running.tasks {
                t.abort();
            }
        }
    }

    /// The host of (`pod`, `shard`) dies at `down_ms` and a fresh one (no rows) starts at
    /// `up_ms`.
    async fn replace(&mut self, clock: &Clock, (pod, shard): (u32, u32), down_ms: u64, up_ms: u64) {
        clock.at(down_ms).await;
        self.kill(pod, shard);
        clock.at(up_ms).await;
        self.start(pod, shard).await;
    }

    /// The host hangs: nothing answers, but connections are not refused.
    fn hang(&self, pod: u32, shard: u32) {
        let s = &self.shards[&(pod, shard)];
        self.hub.with_net(|n| {
            n.freeze(self.hub.node_of(&s.rdma));
            n.freeze(self.hub.node_of(&s.tcp));
        });
    }

    /// The links from training shard `shard`'s nodes to the other pods' nodes.
    fn replication_links(&self, shard: u32) -> Vec<(usize, usize)> {
        let from = &self.shards[&(self.topo.training_pod(), shard)];
        let from = [self.hub.node_of(&from.rdma), self.hub.node_of(&from.tcp)];
        let to: Vec<usize> = (0..PODS)
            .filter(|p| *p != self.topo.training_pod())
            .flat_map(|p| self.nodes_of(p))
            .collect();
        from.iter().flat_map(|&f| to.iter().map(move |&t| (f, t))).collect()
    }

    fn set_links(&self, links: &[(usize, usize)], fault: LinkFault) {
        self.hub.with_net(|n| {
            for &(from, to) in links {
                n.fabric().set_link_fault(from, to, fault);
            }
        });
    }

    fn nodes_of(&self, pod: u32) -> Vec<usize> {
        self.shards
            .iter()
            .filter(|((p, _), _)| *p == pod)
            .flat_map(|(_, s)| [self.hub.node_of(&s.rdma), self.hub.node_of(&s.tcp)])
            .collect()
    }

    /// Cuts (or heals) every link between `inside` and every other node.
    fn isolate(&self, inside: &[usize], on: bool) {
        self.hub.with_net(|n| {
            for other in 0..n.len() {
                if inside.contains(&other) {
                    continue;
                }
                for &i in inside {
                    n.fabric().partition(i, other, on);
                }
            }
        });
    }

    fn client(&mut self, pod: u32, id: u64, role: ClientRole) -> Arc<PsClient> {
        self.next_client += 1;
        let ip =
            std::net::Ipv4Addr::new(10, 9, (self.next_client >> 8) as u8, self.next_client as u8);
        let (rdma, tcp) = self.host((ip, 1).into(), (ip, 2).into());
        // The retry decisions depend on the run's seed too.
        let ccfg =
            client_config(&self.cfg.rpc, pod, self.seed ^ id.wrapping_mul(0x9e37_79b9), role);
        // Like a process's random identity, fresh for every client, but from the seed.
        let push_id = bex_ps_proto::shard::mix64(self.seed ^ u64::from(self.next_client) << 48);
        let ps = PsClient::new(
            Some(Transport::Sim(rdma)),
            Transport::Sim(tcp),
            self.topo.clone(),
            ccfg,
            push_id,
        );
        Arc::new(match role {
            ClientRole::Serving => ps,
            ClientRole::Training => {
                ps.with_push_retry(Duration::from_millis(self.cfg.rpc.push_retry_ms))
            }
        })
    }

    /// Keys of `table` whose rows differ between the training pod and a replica (an empty
    /// list: converged), or a reason they cannot be compared.
    fn divergence(&self, table: u32, keys: &[u64]) -> Vec<String> {
        let mut out = Vec::new();
        for shard in 0..SHARDS {
            let mine: Vec<u64> =
                keys.iter().copied().filter(|&k| self.topo.shard_of(k) == shard).collect();
            let read = |pod: u32| self.rows(pod, shard, table, &mine);
            let Some(want) = read(self.topo.training_pod()) else {
                out.push(format!("training shard {shard} is down"));
                continue;
            };
            for pod in (0..PODS).filter(|&p| p != self.topo.training_pod()) {
                match read(pod) {
                    None => out.push(format!("pod {pod} shard {shard} is down")),
                    Some(got) => {
                        let bad = want
                            .iter()
                            .zip(&got)
                            .filter(|(a, b)| a.to_bits() != b.to_bits())
                            .count();
                        if bad > 0 {
                            out.push(format!(
                                "pod {pod} shard {shard}: {bad} words of table {table}'s rows differ"
                            ));
                        }
                    }
                }
            }
        }
        out
    }

    /// Whole rows of `keys` (all of shard `shard`: values, optimizer state, steps, version)
    /// as the server of (`pod`, `shard`) holds them, without creating any; `None` if it is
    /// down.
    fn rows(&self, pod: u32, shard: u32, table: u32, keys: &[u64]) -> Option<Vec<f32>> {
        let s = self.shards.get(&(pod, shard))?;
        let t = s.running.server.tables().get(table)?;
        let mut rows = vec![0f32; keys.len() * t.state_width()];
        t.read_state_into(keys, &mut rows).ok()?;
        Some(rows)
    }

    /// Each canary row's components on the training pod (`None`: its shard is down).
    fn canary_values(&self) -> Vec<Option<[f32; CANARY_WRITERS]>> {
        let pod = self.topo.training_pod();
        (0..CANARY_KEYS)
            .map(|k| {
                let row = self.rows(pod, self.topo.shard_of(k), CANARY, &[k])?;
                Some(std::array::from_fn(|w| row[w]))
            })
            .collect()
    }
}

/// What the workload tasks count.
#[derive(Default)]
struct Tally {
    acked: Vec<AtomicU64>,
    failed: Vec<AtomicU64>,
    train_ok: AtomicU64,
    train_failed: AtomicU64,
    fetch_ok: AtomicU64,
    fetch_failed: AtomicU64,
    slowest_ms: AtomicU64,
    /// The slowest push of the retrying (training) canary.
    slowest_retrying_ms: AtomicU64,
    late: Mutex<Vec<String>>,
    /// Virtual ms (since start) of each acknowledged canary push to shard 0.
    shard0_acks: Mutex<Vec<u64>>,
}

struct Clock(tokio::time::Instant);

impl Clock {
    fn ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
    async fn at(&self, ms: u64) {
        tokio::time::sleep_until(self.0 + Duration::from_millis(ms)).await;
    }
}

/// Records a call's latency in `slowest` and a violation if it passed `bound`.
fn note_latency(
    t: &Tally,
    slowest: &AtomicU64,
    what: &str,
    took: Duration,
    bound: Duration,
    at_ms: u64,
) {
    let ms = took.as_millis() as u64;
    slowest.fetch_max(ms, Ordering::Relaxed);
    if took > bound {
        t.late.lock().push(format!("{what} at {at_ms} ms took {ms} ms (deadline {bound:?})"));
    }
}

/// Runs `scenario` with `seed` on a fresh current-thread runtime with a paused clock.
pub fn run(scenario: Scenario, seed: u64) -> Report {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    rt.block_on(run_async(scenario, seed))
}

async fn run_async(scenario: Scenario, seed: u64) -> Report {
    // Jitter makes the seed decide the interleavings, not only the workload's schedule.
    let link = LinkModel {
        latency: Duration::from_micros(2),
        jitter: Duration::from_micros(1),
        ..LinkModel::default()
    };
    let mut c = Cluster::new(seed, link, scenario).await;
    if scenario == Scenario::Loss {
        c.hub.with_net(|n| {
            n.fabric().with_faults(|f| {
                f.set_rates(FaultRates { drop: 0.01, duplicate: 0.01, corrupt: 0.0, reorder: 0.01 })
            })
        });
    }
    let clock = Arc::new(Clock(tokio::time::Instant::now()));
    let tally = Arc::new(Tally {
        acked: (0..CANARY_KEYS as usize * CANARY_WRITERS).map(|_| AtomicU64::new(0)).collect(),
        failed: (0..CANARY_KEYS as usize * CANARY_WRITERS).map(|_| AtomicU64::new(0)).collect(),
        ..Tally::default()
    });
    let push_bound = call_deadline(&c.cfg);
    // A training push's attempts go on until the retry budget is spent; the last may take
    // the whole training deadline.
    let fetch_bound = call_deadline(&c.cfg);
    let retrying_push_bound = Duration::from_millis(c.cfg.rpc.push_retry_ms)
        + call_deadline_of(&c.cfg, c.cfg.rpc.training_request_timeout_ms);
    let canary = Arc::new(Mutex::new(c.client(0, 1, ClientRole::Serving)));
    let canary2 = Arc::new(Mutex::new(c.client(0, 5, ClientRole::Training)));
    let trainer = c.client(0, 2, ClientRole::Serving);
    let readers = [c.client(0, 3, ClientRole::Serving), c.client(1, 4, ClientRole::Serving)];
    let mut tasks = Vec::new();
    for (writer, key) in (0..CANARY_WRITERS).flat_map(|w| (0..CANARY_KEYS).map(move |k| (w, k))) {
        let (current, bound) = match writer {
            0 => (canary.clone(), push_bound),
            _ => (canary2.clone(), retrying_push_bound),
        };
        let (t, clock) = (tally.clone(), clock.clone());
        let shard = c.topo.shard_of(key);
        // Both writers of a key on one schedule: their pushes to the row meet.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (key << 40));
        let at = writer * CANARY_KEYS as usize + key as usize;
        tasks.push(tokio::spawn(async move {
            // SGD with rate 1: a gradient of −1 adds 1, to this writer's component.
            let mut grad = [0f32; CANARY_WRITERS];
            grad[writer] = -1.0;
            while clock.ms() < WORKLOAD_END.as_millis() as u64 {
                let start = tokio::time::Instant::now();
                let cl = current.lock().clone();
                let r = cl.push(CANARY, CANARY_WRITERS as u32, &[key], &grad).await;
                let slowest = if writer == 0 { &t.slowest_ms } else { &t.slowest_retrying_ms };
                note_latency(&t, slowest, "canary push", start.elapsed(), bound, clock.ms());
                if r.is_ok() {
                    t.acked[at].fetch_add(1, Ordering::Relaxed);
                    if shard == 0 {
                        t.shard0_acks.lock().push(clock.ms());
                    }
                } else {
                    t.failed[at].fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..25))).await;
            }
        }));
    }
    let pushed = Arc::new(Mutex::new(BTreeSet::new()));
    {
        let (cl, t, clock, pushed) =
            (trainer.clone(), tally.clone(), clock.clone(), pushed.clone());
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7a41);
        let bounded = scenario == Scenario::BoundedTrainingKill;
        tasks.push(tokio::spawn(async move {
            while clock.ms() < WORKLOAD_END.as_millis() as u64 {
                // Bounded: a window of half the keys moving on by a quarter a second, so
                // rows stop being pushed and expire (TTL 1 s) as well as being evicted.
                let keys: Vec<u64> = if bounded {
                    let from = (clock.ms() / 1000).min(2) * EMB_KEYS / 4;
                    (0..24).map(|_| from + rng.random_range(0..EMB_KEYS / 2)).collect()
                } else {
                    (0..24).map(|_| rng.random_range(0..EMB_KEYS)).collect()
                };
                let grads: Vec<f32> = (0..keys.len() * EMB_DIM as usize)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let start = tokio::time::Instant::now();
                let r = cl.push(EMB, EMB_DIM, &keys, &grads).await;
                // The shards' parts go concurrently: one call's deadline.
                note_latency(
                    &t,
                    &t.slowest_ms,
                    "trainer push",
                    start.elapsed(),
                    push_bound,
                    clock.ms(),
                );
                match r {
                    Ok(()) => t.train_ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => t.train_failed.fetch_add(1, Ordering::Relaxed),
                };
                pushed.lock().extend(keys);
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..15))).await;
            }
        }));
    }
    for (i, r) in readers.iter().enumerate() {
        let (cl, t, clock) = (r.clone(), tally.clone(), clock.clone());
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (0x3eade4 + i as u64));
        tasks.push(tokio::spawn(async move {
            while clock.ms() < WORKLOAD_END.as_millis() as u64 {
                let keys: Vec<u64> = (0..32).map(|_| rng.random_range(0..EMB_KEYS)).collect();
                let start = tokio::time::Instant::now();
                let r = cl.fetch(EMB, EMB_DIM, &keys).await;
                note_latency(&t, &t.slowest_ms, "fetch", start.elapsed(), fetch_bound, clock.ms());
                match r {
                    Ok(rows) if rows.len() == keys.len() * EMB_DIM as usize => {
                        t.fetch_ok.fetch_add(1, Ordering::Relaxed)
                    }
                    _ => t.fetch_failed.fetch_add(1, Ordering::Relaxed),
                };
                tokio::time::sleep(Duration::from_millis(rng.random_range(4..12))).await;
            }
        }));
    }

    let mut violations = Vec::new();
    let mut fallback_ms = None;
    let mut quarantined_mid = false;
    // Packets the partition cut (its scenario must show it happened).
    let mut partition_dropped = 0;
    let rdma_down_at = 400;
    match scenario {
        Scenario::Loss => {}
        // It bootstraps from the training pod while pushes go on.
        Scenario::ShardRestart => c.replace(&clock, (1, 0), 400, 2_400).await,
        Scenario::PodPartition => {
            clock.at(400).await;
            let pod1 = c.nodes_of(1);
            let cut = || c.hub.with_net(|n| n.fabric().stats().link_dropped);
            let before = cut();
            c.isolate(&pod1, true);
            // Healed just before the workload ends: the replicas catch up afterwards.
            clock.at(2_900).await;
            partition_dropped = cut() - before;
            c.isolate(&pod1, false);
        }
        Scenario::Hang => {
            clock.at(400).await;
            c.hang(1, 1);
            // Past the keepalive timeout (1 s): peers have given up on it.
            clock.at(1_800).await;
            c.kill(1, 1);
            c.start(1, 1).await;
        }
        Scenario::RdmaFallback => {
            clock.at(rdma_down_at).await;
            let rdma = c.hub.node_of(&c.shards[&(0, 0)].rdma);
            c.isolate(&[rdma], true);
            clock.at(1_800).await;
            c.isolate(&[rdma], false);
        }
        Scenario::TrainingRestart => {
            clock.at(800).await;
            match c.stop_gracefully(0, 0).await {
                Ok(0) => {}
                Ok(left) => violations.push(format!("the drain left {left} keys unreplicated")),
                Err(e) => violations.push(e),
            }
            clock.at(1_000).await;
            if let Err(e) = c.start_restored(0, 0).await {
                violations.push(e);
            }
        }
        Scenario::TrainingKill | Scenario::BoundedTrainingKill => {
            // A periodic checkpoint, then more pushes, then the kill: the restart must not
            // roll back to the checkpoint.
            clock.at(500).await;
            let server = c.shards[&(0, 0)].running.server.clone();
            if let Err(e) = server.checkpoint().await {
                violations.push(format!("checkpoint of pod 0 shard 0: {e}"));
            }
            // Replication of shard 0 cut for 1.2 s, past the keepalive timeout: its requests
            // fail and are sent again, rebuilt from the rows of the moment, while pushes keep
            // coming; 25 ms after the heal, while the backlog drains, the kill. (Without one
            // push replicated at a time, a row's newer push reached the replica under an
            // older push's identity, and its retry was applied twice: 4 of 20 seeds.)
            let links = c.replication_links(0);
            clock.at(700).await;
            c.set_links(&links, LinkFault { partitioned: true, ..LinkFault::default() });
            clock.at(1_900).await;
            c.set_links(&links, LinkFault::default());
            clock.at(1_925).await;
            c.kill(0, 0);
            clock.at(2_125).await;
            if let Err(e) = c.start_restored(0, 0).await {
                violations.push(e);
            }
            if scenario == Scenario::BoundedTrainingKill {
                // A replica gone with its rows, bootstrapping while pushes evict.
                c.replace(&clock, (1, 0), 2_400, 2_600).await;
            }
        }
        Scenario::ClientRestart => {
            clock.at(1_500).await;
            // The same id, a new client: pushes in flight on the old one finish on it.
            let next = c.client(0, 1, ClientRole::Serving);
            *canary.lock() = next;
        }
        Scenario::Quarantine => {
            clock.at(300).await;
            c.kill(1, 1);
            // Reader 1 (pod 1) prefers pod 1's replicas. Its channel to this one fails at
            // the keepalive timeout (1 s), the RDMA connect and reconnect are refused (the
            // call goes to pod 0 over RDMA, the ladder's next rung): 2 failures, past M = 1,
            // quarantine the replica. (Then it is skipped, not asked over TCP: only its RDMA
            // re-probes, every second, would count more.)
            clock.at(2_000).await;
            quarantined_mid = readers[1].rpc().is_quarantined(POD1_SHARD1);
            c.start(1, 1).await;
            // The next probe (at most 1 s after the quarantine) finds it back.
        }
    }
    // A workload task that panicked (a client bug under faults) is a violation, not a
    // silent end of its load.
    let mut panicked = 0;
    for t in tasks {
        if t.await.is_err() {
            panicked += 1;
        }
    }
    let end_ms = clock.ms();
    let keepalive_failures =
        c.hub.with_net(|n| (0..n.len()).map(|i| n.counters(i).keepalive_failures).sum::<u64>());
    // Everything healed and up: replicas must converge.
    let mut keys: Vec<u64> = pushed.lock().iter().copied().collect();
    keys.sort_unstable();
    let canary_keys: Vec<u64> = (0..CANARY_KEYS).collect();
    let mut converged_ms = None;
    let mut left = Vec::new();
    while clock.ms() <= end_ms + SETTLE.as_millis() as u64 {
        left = c.divergence(EMB, &keys);
        left.extend(c.divergence(CANARY, &canary_keys));
        if left.is_empty() {
            converged_ms = Some(clock.ms() - end_ms);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !left.is_empty() {
        violations
            .push(format!("replicas did not converge within {SETTLE:?}: {}", left.join("; ")));
    }
    // Canary: acked ≤ value ≤ acked + failed, per key and writer.
    let values = c.canary_values();
    let mut pushes_acked = 0;
    let mut pushes_failed = 0;
    for (k, row) in values.iter().enumerate() {
        let Some(row) = row else {
            violations.push(format!("canary key {k}: its training shard is down"));
            continue;
        };
        for (w, &v) in row.iter().enumerate() {
            let at = w * CANARY_KEYS as usize + k;
            let acked = tally.acked[at].load(Ordering::Relaxed);
            let failed = tally.failed[at].load(Ordering::Relaxed);
            pushes_acked += acked;
            pushes_failed += failed;
            let what = format!("canary key {k}, writer {w}: value {v}");
            if (v as u64) < acked || v.fract() != 0.0 {
                violations.push(format!("{what} < {acked} acknowledged pushes (lost)"));
            } else if v as u64 > acked + failed {
                violations.push(format!(
                    "{what} > {acked} acknowledged + {failed} failed (applied twice)"
                ));
            }
        }
    }
    violations.extend(tally.late.lock().iter().take(5).cloned());
    let canary = canary.lock().clone();
    let canary2 = canary2.lock().clone();
    let stats: Vec<_> = [&canary, &canary2, &trainer, &readers[0], &readers[1]]
        .iter()
        .map(|c| c.rpc().stats().snapshot())
        .collect();
    let sum = |f: fn(&bex_rpc::ClientCounts) -> u64| stats.iter().map(f).sum::<u64>();
    let (fallbacks, recoveries, quarantines, tcp_calls) =
        (sum(|s| s.fallbacks), sum(|s| s.recoveries), sum(|s| s.quarantines), sum(|s| s.tcp_calls));
    match scenario {
        Scenario::RdmaFallback => {
            let first = tally.shard0_acks.lock().iter().copied().find(|&t| t > rdma_down_at);
            fallback_ms = first.map(|t| t - rdma_down_at);
            match fallback_ms {
                Some(ms) if ms <= FALLBACK_BOUND.as_millis() as u64 => {}
                other => violations.push(format!(
                    "no push served within {FALLBACK_BOUND:?} of the RDMA failure ({other:?} ms)"
                )),
            }
            if fallbacks == 0 || tcp_calls == 0 {
                violations.push(format!(
                    "no fallback to TCP ({fallbacks} fallbacks, {tcp_calls} TCP calls)"
                ));
            }
            if recoveries == 0 {
                violations.push("RDMA never came back after the heal".into());
            }
        }
        Scenario::Hang if keepalive_failures == 0 => {
            violations.push("no peer noticed the hung replica by keepalive expiry".into());
        }
        // Each fault must have happened: a fabric that ignored it would pass every other
        // check (the canaries, convergence and deadlines hold on a quiet network too).
        Scenario::Loss => {
            let f = c.hub.with_net(|n| n.fabric().stats());
            if f.dropped == 0 || f.duplicated == 0 || f.reordered == 0 {
                violations.push(format!(
                    "the loss did not happen: {} dropped, {} duplicated, {} reordered",
                    f.dropped, f.duplicated, f.reordered
                ));
            }
        }
        Scenario::PodPartition => {
            let went_to_pod_0 = readers[1].rpc().stats().snapshot().remote_pod_calls;
            if partition_dropped == 0 || went_to_pod_0 == 0 {
                violations.push(format!(
                    "the partition did not happen: {partition_dropped} packets cut, pod 1's \
                     reader sent {went_to_pod_0} calls to pod 0"
                ));
            }
        }
        Scenario::Quarantine => {
            if !quarantined_mid || quarantines == 0 {
                violations.push(format!(
                    "the dead replica was not quarantined ({quarantines} quarantines)"
                ));
            }
            if readers[1].rpc().is_quarantined(POD1_SHARD1) {
                violations.push("the quarantine was not released after the restart".into());
            }
        }
        _ => {}
    }
    let fetches =
        (tally.fetch_ok.load(Ordering::Relaxed), tally.fetch_failed.load(Ordering::Relaxed));
    let trained = tally.train_ok.load(Ordering::Relaxed);
    // Trainer pushes count too: with only canary pushes checked, a run whose every trainer
    // push failed passed (its rows, never updated, trivially converge).
    if fetches.0 == 0 || pushes_acked == 0 || trained == 0 {
        violations.push(format!(
            "no progress: {} fetches, {pushes_acked} canary pushes, {trained} trainer pushes",
            fetches.0
        ));
    }
    if panicked > 0 {
        violations.push(format!("{panicked} workload tasks panicked"));
    }
    if scenario == Scenario::BoundedTrainingKill {
        // The bound held on every pod, and it bit: every training shard evicted, and the one
        // not killed expired rows (the killed one's counts start again at 2.1 s, and the run
        // may end before its next expiry tick).
        for ((pod, shard), s) in &c.shards {
            let Some(t) = s.running.server.tables().get(EMB) else { continue };
            if t.rows() > BOUNDED_ROWS {
                violations.push(format!(
                    "pod {pod} shard {shard} holds {} rows, over its bound of {BOUNDED_ROWS}",
                    t.rows()
                ));
            }
            let training = *pod == c.topo.training_pod();
            if training && (t.evicted() == 0 || (*shard == 1 && t.expired() == 0)) {
                violations.push(format!(
                    "training shard {shard}: the bounded table evicted {}, expired {}",
                    t.evicted(),
                    t.expired()
                ));
            }
        }
    }
    let mut report = Report {
        scenario,
        seed,
        virtual_ms: clock.ms(),
        pushes_acked,
        pushes_failed,
        train_pushes: (
            tally.train_ok.load(Ordering::Relaxed),
            tally.train_failed.load(Ordering::Relaxed),
        ),
        fetches,
        slowest_ms: (tally.slowest_ms.load(Ordering::Relaxed), fetch_bound.as_millis() as u64),
        slowest_retrying_push_ms: (
            tally.slowest_retrying_ms.load(Ordering::Relaxed),
            retrying_push_bound.as_millis() as u64,
        ),
        fallbacks,
        recoveries,
        quarantines,
        tcp_calls,
        keepalive_failures,
        clients: stats.clone(),
        fallback_ms,
        converged_ms,
        violations,
        fingerprint: 0,
    };
    let mut h = Fnv::default();
    h.write(serde_json::to_string(&report).unwrap_or_default().as_bytes());
    for v in values.iter().flatten().flatten() {
        h.write(&v.to_bits().to_le_bytes());
    }
    for shard in 0..SHARDS {
        let mine: Vec<u64> =
            keys.iter().copied().filter(|&k| c.topo.shard_of(k) == shard).collect();
        if let Some(rows) = c.rows(c.topo.training_pod(), shard, EMB, &mine) {
            for r in rows {
                h.write(&r.to_bits().to_le_bytes());
            }
        }
    }
    report.fingerprint = h.0;
    report
}

/// FNV-1a, for fingerprints that are the same in every process.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}
