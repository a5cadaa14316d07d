//! One parameter-server process: one shard of one mini-pod. Requests arrive as ps-core frames
//! inside RPC frames (the RPC method is the ps-core op); bad input gets a ps-core error
//! response with a status and a counter, and the server keeps serving.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::Pool;
use bex_ps_core::checkpoint::{self, CheckpointMeta};
use bex_ps_core::dedupe::{Dedupe, DedupeConfig, Verdict};
use bex_ps_core::table::STRIPES;
use bex_ps_core::{Table, TableSet};
use bex_ps_proto::config::PushAck;
use bex_ps_proto::control::{
    AdminRequest, AdminResponse, CheckpointRequest, CheckpointSummary, HealthInfo,
    ReplicationStatus, Role, ServingState, SnapshotRequest, TablesInfo,
};
use bex_ps_proto::metrics::{Counter, Histogram, Registry, LATENCY_BUCKETS_S, SIZE_BUCKETS_BYTES};
use bex_ps_proto::spec::DefinitionDiff;
use bex_ps_proto::wire::{self, DataHeader, Limits, Op, RequestView, Status};
use bex_ps_proto::Topology;
use bex_rpc::{alloc_frame, Client, RpcError, HEADER_LEN};
use bex_transport::Msg;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// The keys applied on the training pod that one replica has not acknowledged yet. Their
/// latest values are read when they are sent, so however long a replica was away (dead,
/// partitioned, restarting) it catches up from this set. (A bounded queue of applied batches
/// dropped updates when a replica was away for long and left it stale for good: found by
/// the simulated fault matrix, `sim/cluster`.)
///
/// The set is bounded by about twice the table's rows, not by the keys pushed: once it
/// outgrows that, the keys that have no row here (evicted, expired, never admitted) are
/// dropped from it ([`Backlog::prune`]). Nothing is lost by that: a copy of an absent row is
/// version 0 and stores nothing at the replica, and the replica drops an evicted row itself
/// when the newer rows that displaced it here arrive (eviction is by version; see
/// `bex_ps_core::table`). Without it, a replica away during a long-tail stream cost the
/// training pod 8+ bytes per distinct key ever pushed.
#[derive(Debug, Default)]
struct Backlog {
    state: Mutex<BacklogState>,
    ready: Notify,
}

#[derive(Debug, Default)]
struct BacklogState {
    /// Pushes to send on their own, each under its own identity (so the replica's dedupe
    /// window learns it with its rows), oldest first; at most [`MAX_PENDING_PUSHES`].
    pushes: std::collections::VecDeque<PendingPush>,
    /// Keys of the pending pushes.
    push_keys: u64,
    /// table → (dim, changed keys).
    tables: BTreeMap<u32, (u32, BTreeSet<u64>)>,
    keys: u64,
    /// Keys taken by the forwarder and not yet acknowledged by the replica.
    in_flight: u64,
    /// Keys of pushes waiting for a first replica's acknowledgement (`push_ack =
    /// replicated`): not queued here yet, but lacking at this replica too.
    awaiting: u64,
    /// Keys taken out of `tables` by a running [`Backlog::prune`] (still lacking at the
    /// replica until it puts the kept ones back).
    pruning: u64,
    /// A prune is running (one at a time).
    prune_running: bool,
    /// When the oldest change still in the set was applied.
    oldest: Option<Instant>,
    /// Since when the replica has lacked some change (None: it has every change).
    behind_since: Option<Instant>,
}

impl BacklogState {
    /// Forgets since when the replica was behind once it lacks nothing.
    fn caught_up_check(&mut self) {
        if self.lacking() == 0 {
            self.behind_since = None;
        }
    }

    /// Keys the replica lacks: waiting, pending pushes', being pruned, in flight, awaited.
    fn lacking(&self) -> u64 {
        self.keys + self.push_keys + self.pruning + self.in_flight + self.awaiting
    }
}

/// Pending pushes a backlog holds before later ones go into its key set instead: their
/// rows still reach the replica, but without their identity (a retry of one of them after
/// a failover could be applied twice). Bounds the memory of a long outage.
const MAX_PENDING_PUSHES: usize = 4096;

/// Keys the pending pushes hold at most (32 MiB of keys): 4096 pushes of a million keys
/// each would otherwise hold 32 GiB.
const MAX_PENDING_PUSH_KEYS: u64 = 1 << 22;

/// A table's key set is pruned when it holds more than twice the table's rows and this
/// many keys more (a small table is not pruned on every push).
const PRUNE_SLACK_KEYS: u64 = 4096;

/// A push whose rows a replica has not acknowledged: the forwarder sends the rows' current
/// state under the push's (client, seq).
#[derive(Debug, Clone, PartialEq)]
struct PendingPush {
    table: u32,
    keys: Vec<u64>,
    client: u64,
    seq: u64,
}

/// Keys of one table taken from a [`Backlog`] to send.
#[derive(Debug, PartialEq)]
struct Taken {
    table: u32,
    dim: u32,
    keys: Vec<u64>,
}

impl Backlog {
    /// Records that `keys` of `table` changed at `now`.
    fn mark(&self, table: u32, dim: u32, keys: impl Iterator<Item = u64>, now: Instant) {
        let mut st = self.state.lock();
        let st = &mut *st;
        let (_, set) = st.tables.entry(table).or_insert_with(|| (dim, BTreeSet::new()));
        for k in keys {
            if set.insert(k) {
                st.keys += 1;
            }
        }
        st.oldest.get_or_insert(now);
        st.behind_since.get_or_insert(now);
        self.ready.notify_one();
    }

    /// Takes up to `max_keys` keys (table by table, in key order) and the time of the oldest
    /// change among what is left behind or taken.
    fn take(&self, max_keys: usize, now: Instant) -> (Vec<Taken>, Option<Instant>) {
        let mut st = self.state.lock();
        let oldest = st.oldest;
        let mut out = Vec::new();
        let mut budget = max_keys.max(1);
        let mut emptied = Vec::new();
        for (&table, (dim, set)) in st.tables.iter_mut() {
            if budget == 0 {
                break;
            }
            let mut keys = Vec::with_capacity(budget.min(set.len()));
            while budget > 0 {
                let Some(k) = set.pop_first() else { break };
                keys.push(k);
                budget -= 1;
            }
            if set.is_empty() {
                emptied.push(table);
            }
            if !keys.is_empty() {
                out.push(Taken { table, dim: *dim, keys });
            }
        }
        for t in emptied {
            st.tables.remove(&t);
        }
        let taken: usize = out.iter().map(|t| t.keys.len()).sum();
        st.keys -= taken as u64;
        st.in_flight += taken as u64;
        // What stays behind changed no earlier than the oldest; count it from now on.
        st.oldest = (st.keys > 0).then_some(now);
        (out, oldest)
    }

    /// Keys waiting to be taken.
    #[cfg(test)]
    fn pending(&self) -> u64 {
        self.state.lock().keys
    }

    /// Queues `push` to be sent on its own; past [`MAX_PENDING_PUSHES`] its keys join the
    /// key set instead (returns false then).
    fn push_pending(&self, push: PendingPush, dim: u32, now: Instant) -> bool {
        {
            let mut st = self.state.lock();
            let keys = push.keys.len() as u64;
            if st.pushes.len() < MAX_PENDING_PUSHES
                && st.push_keys.saturating_add(keys) <= MAX_PENDING_PUSH_KEYS
            {
                st.behind_since.get_or_insert(now);
                st.push_keys += keys;
                st.pushes.push_back(push);
                drop(st);
                self.ready.notify_one();
                return true;
            }
        }
        self.mark(push.table, dim, push.keys.into_iter(), now);
        false
    }

    /// Whether `table`'s key set has outgrown its `rows` (twice, plus [`PRUNE_SLACK_KEYS`])
    /// and no prune runs; if so, a prune is now running and the caller must call
    /// [`Backlog::prune`].
    fn start_prune(&self, table: u32, rows: u64) -> bool {
        let mut st = self.state.lock();
        let len = st.tables.get(&table).map_or(0, |(_, set)| set.len() as u64);
        let start =
            !st.prune_running && len > rows.saturating_mul(2).saturating_add(PRUNE_SLACK_KEYS);
        st.prune_running |= start;
        start
    }

    /// Ends a started prune that cannot run.
    fn abandon_prune(&self) {
        self.state.lock().prune_running = false;
    }

    /// Drops the keys of `table` for which `live` is false (after [`Backlog::start_prune`]);
    /// returns how many. The lock is held only to take the set out and to put the kept keys
    /// back: `live` looks up every key, which for a large table takes long.
    fn prune(&self, table: u32, live: impl Fn(u64) -> bool) -> u64 {
        let (dim, mut set, oldest) = {
            let mut st = self.state.lock();
            let Some((dim, set)) = st.tables.get_mut(&table) else {
                st.prune_running = false;
                return 0;
            };
            let (dim, set) = (*dim, std::mem::take(set));
            st.keys -= set.len() as u64;
            st.pruning += set.len() as u64;
            (dim, set, st.oldest)
        };
        let before = set.len() as u64;
        set.retain(|&k| live(k));
        let mut guard = self.state.lock();
        let st = &mut *guard;
        st.pruning -= before;
        st.prune_running = false;
        let kept = set.len() as u64;
        if kept > 0 {
            // `take` may have emptied the entry meanwhile and forgotten the oldest change.
            st.oldest = match (st.oldest, oldest) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let (_, cur) = st.tables.entry(table).or_insert_with(|| (dim, BTreeSet::new()));
            let counted = cur.len() as u64;
            if cur.len() < set.len() {
                std::mem::swap(cur, &mut set);
            }
            cur.extend(set);
            st.keys += cur.len() as u64 - counted;
        }
        st.caught_up_check();
        drop(guard);
        if kept > 0 {
            self.ready.notify_one();
        }
        before - kept
    }

    /// The oldest pending push (now counted in flight until [`Backlog::settled`]).
    fn take_push(&self) -> Option<PendingPush> {
        let mut st = self.state.lock();
        let p = st.pushes.pop_front()?;
        st.push_keys -= p.keys.len() as u64;
        st.in_flight += p.keys.len() as u64;
        Some(p)
    }

    /// `n` taken keys were acknowledged by the replica (or given up on).
    fn settled(&self, n: usize) {
        let mut st = self.state.lock();
        debug_assert!(st.in_flight >= n as u64, "settling more keys than were taken");
        st.in_flight = st.in_flight.saturating_sub(n as u64);
        st.caught_up_check();
    }

    /// A push's `n` keys wait for a first replica's acknowledgement (from `now`).
    fn await_push(&self, n: usize, now: Instant) {
        let mut st = self.state.lock();
        st.awaiting += n as u64;
        st.behind_since.get_or_insert(now);
    }

    /// A push awaited with [`Backlog::await_push`] was recorded by a replica (or given up);
    /// queue it for the others first, so their lag keeps its age.
    fn push_recorded(&self, n: usize) {
        let mut st = self.state.lock();
        debug_assert!(st.awaiting >= n as u64, "recording more keys than were awaited");
        st.awaiting = st.awaiting.saturating_sub(n as u64);
        st.caught_up_check();
    }

    /// Keys the replica lacks and for how long it has lacked some change (operators'
    /// replication lag; zero when caught up).
    fn lag(&self, now: Instant) -> (u64, Duration) {
        let st = self.state.lock();
        let behind = st.behind_since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        (st.lacking(), behind)
    }

    /// Keys the replica does not have yet: waiting or in flight.
    fn unacked(&self) -> u64 {
        let st = self.state.lock();
        st.keys + st.push_keys + st.pruning + st.in_flight
    }
}

/// One op's series.
#[derive(Debug)]
struct OpMetrics {
    requests: Counter,
    /// From the request's arrival at the handler to its reply (a replicated push includes
    /// the wait for its replica).
    duration: Histogram,
    request_bytes: Histogram,
    response_bytes: Histogram,
}

/// The server's counters (also rendered on `/metrics`).
#[derive(Debug)]
pub struct Metrics {
    /// Prometheus registry.
    pub registry: Registry,
    ops: HashMap<Op, OpMetrics>,
    errors: HashMap<Status, Counter>,
    fetched_keys: Counter,
    pushed_keys: Counter,
    duplicates: Counter,
    replicated_requests: Counter,
    push_not_replicated: Counter,
    /// Replicas' answers to Replicate that did not decode, and peers' Snapshot chunks or
    /// Tables answers that did not.
    malformed_peer_replies: Counter,
    replication_overflow: Counter,
    replication_pruned: Counter,
    checkpoint_failures: Counter,
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let ops = Op::ALL
            .into_iter()
            .map(|op| {
                let labels = [("op", op.name())];
                let m = OpMetrics {
                    requests: registry
                        .counter("bex_ps_requests_total", "Requests by op", &labels)
                        .expect("static metric"),
                    duration: registry
                        .histogram(
                            "bex_ps_request_duration_seconds",
                            "From a request's arrival at the handler to its reply, by op",
                            &labels,
                            LATENCY_BUCKETS_S,
                        )
                        .expect("static metric"),
                    request_bytes: registry
                        .histogram(
                            "bex_ps_request_bytes",
                            "Request frame sizes by op",
                            &labels,
                            SIZE_BUCKETS_BYTES,
                        )
                        .expect("static metric"),
                    response_bytes: registry
                        .histogram(
                            "bex_ps_response_bytes",
                            "Response frame sizes by op",
                            &labels,
                            SIZE_BUCKETS_BYTES,
                        )
                        .expect("static metric"),
                };
                (op, m)
            })
            .collect();
        let errors = Status::ALL
            .into_iter()
            .filter(|s| !s.is_success())
            .map(|s| {
                let c = registry.counter(
                    "bex_ps_errors_total",
                    "Error responses by status",
                    &[("status", s.name())],
                );
                (s, c.expect("metric names are static and valid"))
            })
            .collect();
        Metrics {
            ops,
            errors,
            fetched_keys: registry
                .counter("bex_ps_fetched_keys_total", "Keys fetched", &[])
                .expect("static metric"),
            pushed_keys: registry
                .counter(
                    "bex_ps_pushed_keys_total",
                    "Gradient rows applied (pushes of keys not yet admitted are not)",
                    &[],
                )
                .expect("static metric"),
            duplicates: registry
                .counter(
                    "bex_ps_duplicate_pushes_total",
                    "Pushes and replications recognised as retries",
                    &[],
                )
                .expect("static metric"),
            replicated_requests: registry
                .counter(
                    "bex_ps_replicated_requests_total",
                    "Replicate requests acknowledged by replicas",
                    &[],
                )
                .expect("static metric"),
            push_not_replicated: registry
                .counter(
                    "bex_ps_push_not_replicated_total",
                    "Pushes applied but answered Unavailable: no replica acknowledged them in \
                     push_ack_timeout_ms (push_ack = replicated)",
                    &[],
                )
                .expect("static metric"),
            malformed_peer_replies: registry
                .counter(
                    "bex_ps_malformed_peer_replies_total",
                    "Answers of other pods' servers (to Replicate, Snapshot or Tables) that did \
                     not decode; the request is retried",
                    &[],
                )
                .expect("static metric"),
            checkpoint_failures: registry
                .counter(
                    "bex_ps_checkpoint_failures_total",
                    "Checkpoints that could not be written (periodic, requested or at \
                     shutdown); the previous one stays on disk",
                    &[],
                )
                .expect("static metric"),
            replication_overflow: registry
                .counter(
                    "bex_ps_replication_overflow_total",
                    "Pushes whose rows went to a replica without their identity (the queue \
                     of pending pushes was full)",
                    &[],
                )
                .expect("static metric"),
            replication_pruned: registry
                .counter(
                    "bex_ps_replication_pruned_keys_total",
                    "Keys dropped from a replica's backlog because their rows are gone here \
                     (evicted, expired or never admitted): a copy would store nothing",
                    &[],
                )
                .expect("static metric"),
            registry,
        }
    }
    fn error(&self, s: Status) {
        if let Some(c) = self.errors.get(&s) {
            c.inc();
        }
    }
}

/// The state of one server.
pub struct PsServer {
    /// The push clock ([`ServerParts::push_clock`]).
    push_clock: PushClock,
    /// Mini-pod.
    pub pod: u32,
    /// Shard.
    pub shard: u32,
    shards: u32,
    role: Role,
    tables: Arc<TableSet>,
    dedupe: Dedupe,
    limits: Limits,
    pool: &'static Pool,
    state: AtomicU8,
    started: Instant,
    update_seq: AtomicU64,
    read_only: AtomicBool,
    /// Held shared by every Push and Replicate from its admission to its apply, exclusively
    /// by a checkpoint and by the drain: so a checkpoint holds every admitted update whole
    /// or not at all, and the drain knows none is half done.
    apply_gate: Arc<tokio::sync::RwLock<()>>,
    /// One backlog per replica (training pod).
    repl: Vec<Arc<Backlog>>,
    /// The client whose endpoint `i` is replica `i` (training pod with replicas).
    repl_client: Option<Arc<Client>>,
    push_ack: PushAck,
    push_ack_timeout: Duration,
    /// `push_ack = replicated`: held by each push from before its apply until a replica has
    /// recorded it, and by every read of rows to replicate. So rows read for replication
    /// hold no effect of a push that no replica has recorded (but the push they are sent
    /// for): a restarted training shard that copies them knows every push they hold. (Reads
    /// without it sent a later push's effect under an earlier push's identity; after a kill,
    /// the later push's retry was applied twice — found in review.) Pushes of a shard are
    /// replicated one at a time; batching them under several identities per Replicate would
    /// lift that.
    replication_order: Arc<tokio::sync::Mutex<()>>,
    /// Pushes waiting for a replica's acknowledgement (the drain waits for them too).
    acks_in_flight: AtomicU64,
    repl_lag: Arc<ReplLag>,
    checkpoint_path: PathBuf,
    last_checkpoint: Mutex<Option<CheckpointSummary>>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Notified by an admin Shutdown request, or when the server can no longer serve
    /// ([`PsServer::failed`]).
    pub shutdown: Arc<Notify>,
    /// Why the server cannot go on serving, if it cannot.
    failure: Mutex<Option<String>>,
    /// A replica serving without the copy of its shard from the training pod.
    bootstrap_missing: AtomicBool,
    /// Differences between this server's table definitions and each peer pod's, when
    /// last compared (at a bootstrap or catch-up): layout, initial rows, converging.
    definition_differences: Mutex<HashMap<u32, [usize; 3]>>,
    /// The RDMA transport, for the SetRdma admin drill.
    rdma: Mutex<Option<bex_transport::RdmaTransport>>,
}

impl std::fmt::Debug for PsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsServer").field("pod", &self.pod).field("shard", &self.shard).finish()
    }
}

/// The least version a push writes now (µs; see [`ServerParts::push_clock`]).
#[derive(Clone)]
pub struct PushClock(Arc<dyn Fn() -> u64 + Send + Sync>);

impl PushClock {
    /// A clock reading `f`.
    pub fn new(f: impl Fn() -> u64 + Send + Sync + 'static) -> PushClock {
        PushClock(Arc::new(f))
    }

    /// Its reading now.
    pub fn now(&self) -> u64 {
        (self.0)()
    }
}

impl std::fmt::Debug for PushClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PushClock({})", self.now())
    }
}

/// How a push's replication went.
enum Replicated {
    /// Acknowledged by replica `i`.
    To(usize),
    /// Not yet (the deadline passed).
    NotYet,
    /// Refused for good: the rows cannot be sent or the replica refuses them.
    Refused,
}

/// What [`PsServer::drain`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Until the updates being applied were done.
    pub in_flight_done_ms: u64,
    /// Changed keys some replica had not acknowledged when the drain ended (0: flushed).
    pub replication_left_keys: u64,
    /// The whole drain.
    pub elapsed_ms: u64,
}

/// Replication progress towards the other pods.
#[derive(Debug, Default)]
pub struct ReplLag {
    /// Sequence of the last acknowledged Replicate request.
    acked_seq: AtomicU64,
    /// Milliseconds from apply to the last acknowledgement.
    last_lag_ms: AtomicU64,
}

fn state_of(v: u8) -> ServingState {
    match v {
        0 => ServingState::Starting,
        1 => ServingState::Restoring,
        2 => ServingState::Bootstrapping,
        3 => ServingState::Serving,
        _ => ServingState::Draining,
    }
}

/// What a server is made from.
#[derive(Debug)]
pub struct ServerParts {
    /// Mini-pod and shard.
    pub pod: u32,
    /// Shard.
    pub shard: u32,
    /// The tables (restored or fresh).
    pub tables: TableSet,
    /// Frame limits.
    pub limits: Limits,
    /// Dedupe sizes.
    pub dedupe: DedupeConfig,
    /// The pool replies come from.
    pub pool: &'static Pool,
    /// Where checkpoints go.
    pub checkpoint_path: PathBuf,
    /// Update sequence restored from a checkpoint.
    pub update_seq: u64,
    /// Dedupe windows restored from a checkpoint (with the rows they describe).
    pub dedupe_windows: Vec<bex_ps_core::dedupe::WindowState>,
    /// The client id of this server's Replicate requests: one per process incarnation, so a
    /// restarted training server's batches (numbered from 1 again) are never taken for
    /// duplicates of its previous life's, nor refused as too old.
    pub replication_id: u64,
    /// The least row version a push writes now: above every version an earlier
    /// incarnation of the shard can have written (see `bex_ps_core::table`), and rising
    /// with time, so a row's version is when it was last pushed. In a process:
    /// [`crate::shard::version_floor`], the wall clock in µs.
    pub push_clock: PushClock,
    /// When pushes are acknowledged.
    pub push_ack: PushAck,
    /// `Replicated`: how long a push waits for a replica.
    pub push_ack_timeout: Duration,
}

impl PsServer {
    /// A server; on the training pod, `replicas` (a client whose endpoint `i` is target `i`,
    /// and the number of targets) starts one forwarding task per target.
    pub fn new(
        parts: ServerParts,
        topology: &Topology,
        replicas: Option<(Arc<Client>, Vec<u32>)>,
        batch_keys: usize,
    ) -> Arc<PsServer> {
        let role = if topology.is_training(parts.pod) { Role::Training } else { Role::Replica };
        let metrics = Arc::new(Metrics::new());
        let repl_lag = Arc::new(ReplLag::default());
        let tables = Arc::new(parts.tables);
        tables.raise_version_floor(parts.push_clock.now());
        let order = Arc::new(tokio::sync::Mutex::new(()));
        let replicated = parts.push_ack == PushAck::Replicated;
        let mut repl = Vec::new();
        let repl_client =
            replicas.as_ref().map(|(c, _)| c.clone()).filter(|_| role == Role::Training);
        let mut target_pods = Vec::new();
        if let (Role::Training, Some((client, pods))) = (role, replicas) {
            target_pods = pods;
            for target in 0..target_pods.len() {
                let backlog = Arc::new(Backlog::default());
                repl.push(backlog.clone());
                tokio::spawn(forward(
                    Forwarder {
                        client: client.clone(),
                        target,
                        me: parts.replication_id,
                        tables: tables.clone(),
                        lag: repl_lag.clone(),
                        metrics: metrics.clone(),
                        batch_keys: batch_keys.max(1),
                        order: replicated.then(|| order.clone()),
                    },
                    backlog,
                ));
            }
        }
        let server = Arc::new(PsServer {
            push_clock: parts.push_clock.clone(),
            pod: parts.pod,
            shard: parts.shard,
            shards: topology.shards(),
            role,
            tables,
            dedupe: {
                let d = Dedupe::new(parts.dedupe);
                d.import(&parts.dedupe_windows);
                d
            },
            limits: parts.limits,
            pool: parts.pool,
            state: AtomicU8::new(3),
            started: crate::clock::now(),
            update_seq: AtomicU64::new(parts.update_seq),
            read_only: AtomicBool::new(false),
            apply_gate: Arc::new(tokio::sync::RwLock::new(())),
            repl,
            repl_client,
            push_ack: parts.push_ack,
            push_ack_timeout: parts.push_ack_timeout,
            replication_order: order.clone(),
            acks_in_flight: AtomicU64::new(0),
            repl_lag,
            checkpoint_path: parts.checkpoint_path,
            last_checkpoint: Mutex::new(None),
            failure: Mutex::new(None),
            bootstrap_missing: AtomicBool::new(false),
            definition_differences: Mutex::new(HashMap::new()),
            metrics,
            shutdown: Arc::new(Notify::new()),
            rdma: Mutex::new(None),
        });
        let peer_pods: Vec<u32> = (0..topology.pods()).filter(|&p| p != parts.pod).collect();
        server.register_gauges(&target_pods, &peer_pods);
        server
    }

    /// The series computed at each scrape: rows and bytes per table, replication lag per
    /// target pod, checkpoint age, serving state, the replication client's counters. They
    /// hold the server weakly (the registry is the server's).
    fn register_gauges(self: &Arc<Self>, target_pods: &[u32], peer_pods: &[u32]) {
        let reg = &self.metrics.registry;
        for (id, t) in self.tables.iter() {
            let labels = [("table", t.spec().name.as_str())];
            let tables = Arc::downgrade(&self.tables);
            let read = move |f: fn(&bex_ps_core::Table) -> u64| {
                tables.upgrade().and_then(|ts| ts.get(id).map(f)).map_or(f64::NAN, |v| v as f64)
            };
            let rows = read.clone();
            reg.gauge_fn("bex_ps_table_rows", "Rows stored, by table", &labels, move || {
                rows(bex_ps_core::Table::rows)
            })
            .expect("static metric");
            let bytes = read.clone();
            reg.gauge_fn(
                "bex_ps_table_bytes",
                "Bytes of memory the table holds (row slab, index, eviction order and \
                 admission sketch, as allocated), by table",
                &labels,
                move || bytes(bex_ps_core::Table::bytes),
            )
            .expect("static metric");
            type Count = fn(&bex_ps_core::Table) -> u64;
            let counted: [(&str, &str, Count); 5] = [
                (
                    "bex_ps_table_evicted_total",
                    "Rows displaced by more recently pushed ones in a full shard (capacity)",
                    bex_ps_core::Table::evicted,
                ),
                (
                    "bex_ps_table_expired_total",
                    "Rows dropped for not being pushed within the table's TTL",
                    bex_ps_core::Table::expired,
                ),
                (
                    "bex_ps_table_fetch_missing_total",
                    "Fetched keys without a row, answered with their initial row",
                    bex_ps_core::Table::fetch_missing,
                ),
                (
                    "bex_ps_table_pushes_not_admitted_total",
                    "Pushes of keys below the admission threshold: counted, not applied",
                    bex_ps_core::Table::pushes_not_admitted,
                ),
                (
                    "bex_ps_table_admitted_total",
                    "Rows created by a push that reached the admission threshold",
                    bex_ps_core::Table::admitted,
                ),
            ];
            for (name, help, f) in counted {
                let read = read.clone();
                reg.counter_fn(name, help, &labels, move || read(f)).expect("static metric");
            }
        }
        for (backlog, pod) in self.repl.iter().zip(target_pods) {
            let pod = pod.to_string();
            let labels = [("target_pod", pod.as_str())];
            let b = Arc::downgrade(backlog);
            reg.gauge_fn(
                "bex_ps_replication_lag_rows",
                "Changed rows the target pod has not acknowledged (waiting or in flight)",
                &labels,
                move || b.upgrade().map_or(f64::NAN, |b| b.lag(crate::clock::now()).0 as f64),
            )
            .expect("static metric");
            let b = Arc::downgrade(backlog);
            reg.gauge_fn(
                "bex_ps_replication_lag_seconds",
                "How long the target pod has lacked some change (0: it has every change)",
                &labels,
                move || {
                    b.upgrade().map_or(f64::NAN, |b| b.lag(crate::clock::now()).1.as_secs_f64())
                },
            )
            .expect("static metric");
        }
        let me = Arc::downgrade(self);
        reg.gauge_fn(
            "bex_ps_checkpoint_age_seconds",
            "Seconds since this process last wrote a checkpoint (since its start before the \
             first): the age of the oldest update a restart from disk alone would lose",
            &[],
            move || me.upgrade().map_or(f64::NAN, |s| s.checkpoint_age().as_secs_f64()),
        )
        .expect("static metric");
        let me = Arc::downgrade(self);
        reg.gauge_fn(
            "bex_ps_bootstrap_missing",
            "1 if this replica serves without having copied its shard from the training pod \
             (it could not in time): its rows are its checkpoint's or initial values",
            &[],
            move || {
                me.upgrade().map_or(f64::NAN, |s| {
                    f64::from(u8::from(s.bootstrap_missing.load(Ordering::Acquire)))
                })
            },
        )
        .expect("static metric");
        for pod in peer_pods {
            for (i, kind) in ["layout", "initial_rows", "converging"].into_iter().enumerate() {
                let me = Arc::downgrade(self);
                let pod = *pod;
                reg.gauge_fn(
                    "bex_ps_peer_definition_differences",
                    "Differences between this server's table definitions and the peer pod's \
                     at the last copy from it (a replica's bootstrap, a training shard's \
                     catch-up; NaN: never compared): layout (no row copied; a replica \
                     stops), initial_rows (seed, initializer: a replica stops), converging \
                     (capacity, admission, hyperparameters: a rolling change)",
                    &[("peer_pod", pod.to_string().as_str()), ("kind", kind)],
                    move || {
                        me.upgrade()
                            .and_then(|s| s.definition_differences.lock().get(&pod).map(|d| d[i]))
                            .map_or(f64::NAN, |n| n as f64)
                    },
                )
                .expect("static metric");
            }
        }
        for code in 0..=4u8 {
            let me = Arc::downgrade(self);
            let name = format!("{:?}", state_of(code)).to_lowercase();
            reg.gauge_fn(
                "bex_ps_state",
                "1 for the server's serving state (starting, restoring, bootstrapping, \
                 serving, draining), 0 for the others",
                &[("state", name.as_str())],
                move || {
                    me.upgrade().map_or(f64::NAN, |s| {
                        f64::from(u8::from(s.state.load(Ordering::Acquire) == code))
                    })
                },
            )
            .expect("static metric");
        }
        if let Some(c) = &self.repl_client {
            bex_client::telemetry::register_rpc_client(reg, "replication", c.clone())
                .expect("static metric");
        }
    }

    /// Time since the last checkpoint this process wrote, or since its start.
    fn checkpoint_age(&self) -> Duration {
        match self.last_checkpoint.lock().as_ref() {
            Some(c) => Duration::from_millis(crate::clock::unix_ms().saturating_sub(c.created_ms)),
            None => crate::clock::now().duration_since(self.started),
        }
    }

    /// Gives the server its RDMA transport (for the SetRdma admin request).
    pub fn set_rdma(&self, t: bex_transport::RdmaTransport) {
        *self.rdma.lock() = Some(t);
    }

    /// The tables.
    pub fn tables(&self) -> &Arc<TableSet> {
        &self.tables
    }

    /// Sets the serving state.
    pub fn set_state(&self, s: ServingState) {
        let v = match s {
            ServingState::Starting => 0,
            ServingState::Restoring => 1,
            ServingState::Bootstrapping => 2,
            ServingState::Serving => 3,
            ServingState::Draining => 4,
        };
        self.state.store(v, Ordering::Release);
    }

    /// Restoring → Serving (a training shard caught up), unless a drain began meanwhile.
    pub fn finish_restoring(&self) {
        let _ = self.state.compare_exchange(1, 3, Ordering::AcqRel, Ordering::Acquire);
    }

    fn state(&self) -> ServingState {
        state_of(self.state.load(Ordering::Acquire))
    }

    /// The server cannot serve any more (an RPC service stopped accepting): it stops as on
    /// an admin Shutdown (drain, checkpoint), and the process then exits 1 with `why`, so
    /// its supervisor restarts it instead of leaving a live process that answers nothing.
    /// Ignored while draining: the transports shut down at the end of every stop.
    pub fn fail(&self, why: String) {
        if self.state() == ServingState::Draining {
            return;
        }
        tracing::error!(%why, "the server cannot serve any more; stopping");
        self.failure.lock().get_or_insert(why);
        self.shutdown.notify_one();
    }

    /// This replica serves without the training pod's copy of its shard
    /// (`bex_ps_bootstrap_missing`).
    pub fn set_bootstrap_missing(&self) {
        self.bootstrap_missing.store(true, Ordering::Release);
    }

    /// Records how the peer pod's table definitions differ from this server's
    /// (`bex_ps_peer_definition_differences`).
    pub fn record_definition_differences(&self, peer_pod: u32, d: &DefinitionDiff) {
        self.definition_differences
            .lock()
            .insert(peer_pod, [d.layout.len(), d.initial_rows.len(), d.converging.len()]);
    }

    /// Shards per pod.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// Why the server stopped serving, if [`PsServer::fail`] stopped it.
    pub fn failed(&self) -> Option<String> {
        self.failure.lock().clone()
    }

    /// Stops taking updates and waits for what was taken to be safe: sets `Draining` (Push
    /// and Replicate are then answered `Unavailable`, which clients retry), waits for the
    /// updates being applied, then up to `timeout` for every replica to acknowledge the
    /// replication backlog and the pushes waiting for their acknowledgement.
    pub async fn drain(&self, timeout: Duration) -> DrainReport {
        let t0 = crate::clock::now();
        self.set_state(ServingState::Draining);
        drop(self.apply_gate.write().await);
        let applied_ms = crate::clock::now().duration_since(t0).as_millis() as u64;
        let deadline = t0 + timeout;
        loop {
            let left: u64 = self.repl.iter().map(|b| b.unacked()).sum::<u64>()
                + self.acks_in_flight.load(Ordering::Acquire);
            let now = crate::clock::now();
            if left == 0 || now >= deadline {
                return DrainReport {
                    in_flight_done_ms: applied_ms,
                    replication_left_keys: left,
                    elapsed_ms: now.duration_since(t0).as_millis() as u64,
                };
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Health, as `/health` and the Health op report it.
    pub fn health(&self) -> HealthInfo {
        let lag = &self.repl_lag;
        HealthInfo {
            pod: self.pod,
            shard: self.shard,
            role: self.role,
            state: state_of(self.state.load(Ordering::Acquire)),
            uptime_ms: crate::clock::now().duration_since(self.started).as_millis() as u64,
            tables: self.tables.stats(),
            replication: ReplicationStatus {
                seq: lag.acked_seq.load(Ordering::Relaxed),
                lag_updates: self.repl.iter().map(|b| b.unacked()).sum(),
                lag_ms: lag.last_lag_ms.load(Ordering::Relaxed),
            },
            last_checkpoint: self.last_checkpoint.lock().clone(),
        }
    }

    /// Drops rows past their table's TTL, by the table's newest push capped near this pod's
    /// clock ([`TableSet::expire`]: every pod drops the same rows, and none while training
    /// is paused); returns how many.
    pub fn expire_rows(&self) -> usize {
        let n = self.tables.expire(self.push_clock.now());
        if n > 0 {
            tracing::debug!(rows = n, "rows expired");
        }
        n
    }

    /// Whether any table has a TTL (then [`PsServer::expire_rows`] should run every second).
    pub fn has_ttl(&self) -> bool {
        self.tables.iter().any(|(_, t)| t.spec().capacity.ttl_s > 0)
    }

    /// Writes a checkpoint now (atomic: temp file, fsync, rename, checksum).
    /// Pushes and replications wait while it is written (rejected: copying the rows under
    /// the gate and writing outside it, which doubles the memory of a shard).
    pub async fn checkpoint(self: &Arc<Self>) -> Result<CheckpointSummary, String> {
        let me = self.clone();
        let gate = self.apply_gate.clone().write_owned().await;
        tokio::task::spawn_blocking(move || {
            let _no_updates_now = gate;
            let meta = CheckpointMeta {
                shard: me.shard,
                shards: me.shards,
                update_seq: me.update_seq.load(Ordering::Acquire),
                created_ms: crate::clock::unix_ms(),
            };
            // Rows and dedupe windows at one point: the gate keeps updates out.
            let windows = me.dedupe.export();
            let info =
                checkpoint::write_checkpoint(&me.checkpoint_path, &me.tables, &windows, &meta)
                    .map_err(|e| {
                        me.metrics.checkpoint_failures.inc();
                        e.to_string()
                    })?;
            let summary = CheckpointSummary {
                path: me.checkpoint_path.display().to_string(),
                rows: info.rows,
                bytes: info.bytes,
                body_crc32: info.body_crc32,
                update_seq: meta.update_seq,
                created_ms: meta.created_ms,
            };
            *me.last_checkpoint.lock() = Some(summary.clone());
            Ok(summary)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Adds a peer's dedupe windows (from a snapshot) to this server's.
    pub fn merge_dedupe(&self, windows: &[bex_ps_core::dedupe::WindowState]) {
        self.dedupe.merge(windows);
    }

    /// Counts an answer of another pod's server that did not decode.
    pub fn count_malformed_peer_reply(&self) {
        self.metrics.malformed_peer_replies.inc();
    }

    /// The most push identities this server's dedupe remembers.
    pub fn dedupe_max_clients(&self) -> usize {
        self.dedupe.max_clients()
    }

    /// Queues for replica `target` the pushed rows of stripe `stripe` of `table` that are
    /// newer here than in `theirs` (key → version: the replica's rows of that stripe, from
    /// its snapshot); returns how many.
    pub fn queue_stripe_newer_than(
        &self,
        target: usize,
        (table, stripe): (u32, usize),
        theirs: &HashMap<u64, u64>,
    ) -> u64 {
        let (Some(b), Some(t)) = (self.repl.get(target), self.tables.get(table)) else {
            return 0;
        };
        let mut keys = Vec::new();
        t.for_each_version_in(stripe, |k, v| {
            if v > theirs.get(&k).copied().unwrap_or(0) {
                keys.push(k);
            }
        });
        let n = keys.len() as u64;
        if n > 0 {
            b.mark(table, t.state_width() as u32, keys.into_iter(), crate::clock::now());
        }
        n
    }

    /// Queues for replica `target`, whose rows are unknown, every pushed row; returns how
    /// many.
    pub fn queue_every_pushed_row(&self, target: usize) -> u64 {
        let none = HashMap::new();
        let stripes = self.tables.iter().flat_map(|(id, _)| (0..STRIPES).map(move |s| (id, s)));
        stripes.map(|at| self.queue_stripe_newer_than(target, at, &none)).sum()
    }

    /// Queues `keys` of `table` for the replicas before `target`: rows a catch-up copied
    /// from replica `target`, which the replicas compared before it may lack (those after
    /// it are compared with them in place).
    pub fn queue_for_replicas_before(&self, target: usize, table: u32, keys: &[u64]) {
        let Some(t) = self.tables.get(table) else { return };
        let now = crate::clock::now();
        for b in self.repl.iter().take(target) {
            if !keys.is_empty() {
                b.mark(table, t.state_width() as u32, keys.iter().copied(), now);
            }
        }
    }

    /// Replicas this training server forwards to.
    pub fn replica_count(&self) -> usize {
        self.repl.len()
    }

    /// Queues `push` for every replica but `except` (the one that acknowledged it).
    fn queue_for_replicas(&self, push: PendingPush, dim: u32, except: Option<usize>) {
        let now = crate::clock::now();
        for (i, b) in self.repl.iter().enumerate() {
            if Some(i) != except && !b.push_pending(push.clone(), dim, now) {
                self.metrics.replication_overflow.inc();
                self.prune_backlog(b, push.table);
            }
        }
    }

    /// Once `b`'s key set of `table` outgrows the table, drops the keys without a row here
    /// on a blocking thread (see [`Backlog`]).
    fn prune_backlog(&self, b: &Arc<Backlog>, table: u32) {
        let Some(rows) = self.tables.get(table).map(Table::rows) else { return };
        if !b.start_prune(table, rows) {
            return;
        }
        let (b, tables, metrics) = (b.clone(), self.tables.clone(), self.metrics.clone());
        tokio::task::spawn_blocking(move || {
            let Some(t) = tables.get(table) else { return b.abandon_prune() };
            // Again while keys marked during a prune keep the set oversized, so an idle
            // backlog is within its bound.
            loop {
                metrics.replication_pruned.add(b.prune(table, |k| t.contains(k)));
                if !b.start_prune(table, t.rows()) {
                    break;
                }
            }
        });
    }

    /// `push_ack = replicated`: sends the current rows of `push`'s keys, under its identity,
    /// to the replicas in turn until one acknowledges them; the others get it through their
    /// backlogs. True if one did within `push_ack_timeout`. Otherwise a task keeps trying,
    /// holding `order` (the replication order taken before the apply) until one does: no
    /// other push of the shard is applied before this one is recorded somewhere.
    async fn replicate_push(
        self: &Arc<Self>,
        push: PendingPush,
        dim: u32,
        order: tokio::sync::OwnedMutexGuard<()>,
    ) -> bool {
        if self.repl_client.is_none() || self.repl.is_empty() {
            return true; // one pod: nothing to replicate to
        }
        self.acks_in_flight.fetch_add(1, Ordering::AcqRel);
        let n = push.keys.len();
        for b in &self.repl {
            b.await_push(n, crate::clock::now());
        }
        let recorded = move |me: &PsServer| {
            for b in &me.repl {
                b.push_recorded(n);
            }
            me.acks_in_flight.fetch_sub(1, Ordering::AcqRel);
        };
        let deadline = tokio::time::Instant::now() + self.push_ack_timeout;
        match self.replicate_until(&push, Some(deadline)).await {
            Replicated::To(target) => {
                drop(order);
                self.queue_for_replicas(push, dim, Some(target));
                recorded(self);
                true
            }
            Replicated::Refused => {
                drop(order);
                recorded(self);
                false
            }
            Replicated::NotYet => {
                let me = self.clone();
                tokio::spawn(async move {
                    let to = match me.replicate_until(&push, None).await {
                        Replicated::To(t) => Some(t),
                        _ => None,
                    };
                    drop(order);
                    me.queue_for_replicas(push, dim, to);
                    recorded(&me);
                });
                false
            }
        }
    }

    /// Sends `push`'s current rows under its identity to the replicas in turn until one
    /// acknowledges them, or `deadline` passes, or a replica refuses the rows themselves.
    async fn replicate_until(
        &self,
        push: &PendingPush,
        deadline: Option<tokio::time::Instant>,
    ) -> Replicated {
        let Some(client) = self.repl_client.clone() else { return Replicated::Refused };
        let passed = || deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
        let mut backoff = Duration::from_millis(2);
        loop {
            for target in 0..self.repl.len() {
                // Rows read per attempt: a later attempt carries anything applied since.
                let Ok(frame) =
                    state_frame(&self.tables, push.table, &push.keys, push.client, push.seq)
                else {
                    return Replicated::Refused;
                };
                let to = [target];
                let call = client.call(&to, Op::Replicate as u16, &frame);
                let answer = match deadline {
                    Some(d) => tokio::time::timeout_at(d, call).await.ok(),
                    None => Some(call.await),
                };
                if let Some(Ok(m)) = answer {
                    match wire::decode_response(m.as_slice(), &Limits::default()) {
                        Ok(r) if r.header.status.is_success() => {
                            self.metrics.replicated_requests.inc();
                            return Replicated::To(target);
                        }
                        Ok(r) if r.header.status == Status::BadValue => {
                            tracing::error!("replica refuses rows: {}", r.message());
                            return Replicated::Refused;
                        }
                        _ => {}
                    }
                }
                if passed() {
                    return Replicated::NotYet;
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(if deadline.is_some() {
                50
            } else {
                1000
            }));
            if passed() {
                return Replicated::NotYet;
            }
        }
    }

    fn reply(&self, bytes: &[u8]) -> Result<Msg, RpcError> {
        let mut m = alloc_frame(self.pool, bytes.len())?;
        m.as_mut_slice()[HEADER_LEN..].copy_from_slice(bytes);
        Ok(m)
    }

    fn error(
        &self,
        op: Option<Op>,
        status: Status,
        seq: u64,
        message: &str,
    ) -> Result<Msg, RpcError> {
        self.metrics.error(status);
        self.reply(&wire::error_response_vec(op, status, seq, message))
    }

    fn status(&self, op: Op, status: Status, seq: u64, count: u32) -> Result<Msg, RpcError> {
        if !status.is_success() {
            self.metrics.error(status);
        }
        let mut b = [0u8; wire::RESPONSE_HEADER_LEN];
        let n = wire::encode_status_into(&mut b, Some(op), status, seq, count)
            .map_err(|e| RpcError::Protocol(e.to_string()))?;
        self.reply(&b[..n])
    }

    fn control<T: serde::Serialize>(&self, op: Op, seq: u64, msg: &T) -> Result<Msg, RpcError> {
        match wire::control_response_vec(op, seq, msg) {
            Ok(v) => self.reply(&v),
            Err(e) => self.error(Some(op), Status::Internal, seq, &e.to_string()),
        }
    }

    /// Answers one request: one method per op.
    async fn handle_request(self: &Arc<Self>, op: Op, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let seq = v.header.seq;
        match op {
            Op::Fetch => self.fetch(v),
            Op::Push => self.push(v).await,
            Op::Replicate => self.replicate(v).await,
            Op::Tables => self.tables_info(seq),
            Op::Health => self.control(op, seq, &self.health()),
            Op::Checkpoint => self.checkpoint_op(v).await,
            Op::Snapshot => self.snapshot(v),
            Op::Admin => self.admin(v),
        }
    }

    /// Tables: the table definitions and the shard count (clients check their file by it).
    fn tables_info(&self, seq: u64) -> Result<Msg, RpcError> {
        let info = TablesInfo { tables: self.tables.infos(), shards: self.shards };
        self.control(Op::Tables, seq, &info)
    }

    /// Checkpoint: answered once the checkpoint is durable. The body is checked like every
    /// control body; its `wait` changes nothing.
    async fn checkpoint_op(self: &Arc<Self>, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, seq) = (Op::Checkpoint, v.header.seq);
        if let Err(e) = v.control::<CheckpointRequest>() {
            return self.error(Some(op), Status::BadControl, seq, &e.to_string());
        }
        match self.checkpoint().await {
            Ok(s) => self.control(op, seq, &s),
            Err(e) => self.error(Some(op), Status::Internal, seq, &e),
        }
    }

    /// Fetch: rows straight into the registered reply (created on the training pod unless
    /// the request says `NO_CREATE`).
    fn fetch(&self, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, h) = (Op::Fetch, v.header);
        let seq = h.seq;
        let table = |id: u32| self.tables.get(id);
        if self.role == Role::Training && self.state() == ServingState::Restoring {
            return self.error(Some(op), Status::Unavailable, seq, "catching up");
        }
        let Some(t) = table(h.table) else {
            return self.error(Some(op), Status::UnknownTable, seq, "no such table");
        };
        if t.dim() != h.dim as usize {
            return self.error(
                Some(op),
                Status::WrongDim,
                seq,
                "dimension differs from the table's",
            );
        }
        // Checked before allocating: a small request must not make the server
        // allocate a reply its peers' decoders refuse (or whose length overflows).
        let Some(len) = wire::fetch_response_len(h.count as usize, h.dim as usize).filter(|&len| {
            len <= self.limits.max_frame_bytes
                && u32::try_from(len - wire::RESPONSE_HEADER_LEN).is_ok()
        }) else {
            return self.error(
                Some(op),
                Status::TooLarge,
                seq,
                "response would exceed the frame limit",
            );
        };
        // Rows go straight into the registered reply buffer.
        let mut m = alloc_frame(self.pool, len)?;
        let (_, rows) =
            wire::begin_fetch_response(&mut m.as_mut_slice()[HEADER_LEN..], seq, h.count, h.dim)
                .map_err(|e| RpcError::Protocol(e.to_string()))?;
        // Only the training pod stores rows it has never seen; replicas answer
        // unseen keys with the (deterministic) initial values without storing them.
        let create = self.role == Role::Training && h.flags & wire::flags::NO_CREATE == 0;
        if let Err(e) = t.fetch_into_le(v.keys, rows, create) {
            return self.error(Some(op), Status::Internal, seq, &e.to_string());
        }
        self.metrics.fetched_keys.add(u64::from(h.count));
        Ok(m)
    }

    /// Push: the training pod applies a gradient, deduplicated by (client, seq), and
    /// replicates it as `push_ack` says.
    async fn push(self: &Arc<Self>, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, h) = (Op::Push, v.header);
        let seq = h.seq;
        if self.role != Role::Training {
            let why = "only the training pod applies pushes";
            return self.error(Some(op), Status::NotTraining, seq, why);
        }
        if self.read_only.load(Ordering::Acquire) {
            return self.error(Some(op), Status::Unavailable, seq, "read-only");
        }
        // Replicated: the replication order first (see the field), then the gate.
        let order = match self.push_ack {
            PushAck::Replicated if !self.repl.is_empty() => {
                Some(self.replication_order.clone().lock_owned().await)
            }
            _ => None,
        };
        let (applying, t) = match self.open_update(op, h, Table::dim).await {
            Ok(open) => open,
            Err(refused) => return refused,
        };
        // Validated before admission (the dedupe contract): a push admitted and then
        // refused would have its retry answered Duplicate, never applied.
        if let Some(i) = v.values.iter().position(|g| !g.is_finite()) {
            let why = format!("value {i} is not finite");
            return self.error(Some(op), Status::BadValue, seq, &why);
        }
        // Rows the push updated or created (keys below the admission threshold are counted
        // by the table, not applied).
        let mut applied = 0;
        let verdict = self.dedupe.admit(h.client, seq);
        if verdict == Verdict::New {
            // A row's version is the time of its last push (bounded tables keep the most
            // recent rows, and every pod orders them alike by it).
            t.advance_version_floor(self.push_clock.now());
            match t.push_le(v.keys, v.values, None) {
                Ok(n) => applied = n,
                Err(e) => return self.error(Some(op), Status::BadValue, seq, &e.to_string()),
            }
            self.update_seq.fetch_add(1, Ordering::AcqRel);
        }
        let push =
            PendingPush { table: h.table, keys: v.keys.iter().collect(), client: h.client, seq };
        if verdict == Verdict::New && self.push_ack == PushAck::Applied {
            // Queued under the gate: a drain that holds it next sees this push.
            self.queue_for_replicas(push.clone(), h.dim, None);
        }
        drop(applying);
        match verdict {
            Verdict::New => self.metrics.pushed_keys.add(applied as u64),
            Verdict::Duplicate => self.metrics.duplicates.inc(),
            Verdict::TooOld => {
                let why = "sequence older than the dedupe window";
                return self.error(Some(op), Status::TooOld, seq, why);
            }
        }
        let acked = match order {
            // A retry answered Duplicate replicates too: the first attempt's
            // replication may have failed.
            Some(order) => self.replicate_push(push, h.dim, order).await,
            None => true,
        };
        if !acked {
            self.metrics.push_not_replicated.inc();
            let why = "applied, but no replica acknowledged it in time: retry";
            return self.error(Some(op), Status::Unavailable, seq, why);
        }
        let status = if verdict == Verdict::New { Status::Ok } else { Status::Duplicate };
        self.status(op, status, seq, h.count)
    }

    /// Replicate: a replica applies whole versioned rows over older ones whatever the
    /// verdict (a copy is never wrong to apply; the wire refuses one without STATE).
    /// Admitting them once applied records the identity they carry (a push's, when its own
    /// replication), so a restarted training shard that copies these rows knows that push
    /// is in them.
    async fn replicate(&self, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, h) = (Op::Replicate, v.header);
        // Rows flow from the training pod only: a Replicate to it could plant a push
        // identity in its dedupe window, so that push, when it came, would be answered
        // Duplicate and never applied.
        if self.role == Role::Training {
            let why = "the training pod takes no Replicate: rows flow from it to the other pods";
            return self.error(Some(op), Status::NotTraining, h.seq, why);
        }
        if self.read_only.load(Ordering::Acquire) {
            return self.error(Some(op), Status::Unavailable, h.seq, "read-only");
        }
        // The table's stride, steps and version: whole rows.
        let (_applying, t) = match self.open_update(op, h, Table::state_width).await {
            Ok(open) => open,
            Err(refused) => return refused,
        };
        match t.apply_replica_state_le(v.keys, v.values) {
            Ok(_) => {
                if self.dedupe.admit(h.client, h.seq) == Verdict::Duplicate {
                    self.metrics.duplicates.inc();
                }
                self.update_seq.fetch_add(1, Ordering::AcqRel);
                self.status(op, Status::Ok, h.seq, h.count)
            }
            Err(e) => self.error(Some(op), Status::BadValue, h.seq, &e.to_string()),
        }
    }

    /// What a Push or Replicate passes after its own checks: the apply gate held shared (a
    /// checkpoint or the drain holding it sees every update past here whole), not draining,
    /// a training shard caught up (pushes), and the table, of `width` values a row as the
    /// header says. `Err` is the reply refusing it.
    async fn open_update(
        &self,
        op: Op,
        h: wire::RequestHeader,
        width: fn(&Table) -> usize,
    ) -> Result<(tokio::sync::RwLockReadGuard<'_, ()>, &Table), Result<Msg, RpcError>> {
        let applying = self.apply_gate.read().await;
        match self.state() {
            ServingState::Draining => {
                return Err(self.error(Some(op), Status::Unavailable, h.seq, "draining"))
            }
            ServingState::Serving => {}
            _ if op == Op::Push => {
                return Err(self.error(Some(op), Status::Unavailable, h.seq, "catching up"))
            }
            _ => {}
        }
        let Some(t) = self.tables.get(h.table) else {
            return Err(self.error(Some(op), Status::UnknownTable, h.seq, "no such table"));
        };
        if width(t) != h.dim as usize {
            let why = "dimension differs from the table's";
            return Err(self.error(Some(op), Status::WrongDim, h.seq, why));
        }
        Ok((applying, t))
    }

    /// Snapshot: one chunk of the shard's rows and dedupe windows from a cursor.
    fn snapshot(&self, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, seq) = (Op::Snapshot, v.header.seq);
        let req: SnapshotRequest = match v.control() {
            Ok(r) => r,
            Err(e) => return self.error(Some(op), Status::BadControl, seq, &e.to_string()),
        };
        let mut chunk = Vec::new();
        let max = (req.max_bytes as usize).clamp(4096, 16 << 20);
        let windows = || self.dedupe.export();
        match checkpoint::snapshot_chunk(&self.tables, req.cursor, max, windows, &mut chunk) {
            Ok(rows) => {
                let mut m = alloc_frame(self.pool, wire::RESPONSE_HEADER_LEN + chunk.len())?;
                let (_, body) = wire::begin_body_response(
                    &mut m.as_mut_slice()[HEADER_LEN..],
                    op,
                    seq,
                    rows,
                    chunk.len(),
                )
                .map_err(|e| RpcError::Protocol(e.to_string()))?;
                body.copy_from_slice(&chunk);
                Ok(m)
            }
            Err(e) => self.error(Some(op), Status::BadControl, seq, &e.to_string()),
        }
    }

    /// Admin: ping, read-only, dedupe reset, RDMA in or out of service, shutdown.
    fn admin(&self, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let (op, seq) = (Op::Admin, v.header.seq);
        let req: AdminRequest = match v.control() {
            Ok(r) => r,
            Err(e) => return self.error(Some(op), Status::BadControl, seq, &e.to_string()),
        };
        let message = match req {
            AdminRequest::Ping => "pong".to_string(),
            AdminRequest::SetReadOnly(on) => {
                self.read_only.store(on, Ordering::Release);
                format!("read-only {on}")
            }
            AdminRequest::ResetDedupe => {
                // Forgetting the windows answers the retry of an applied push New: applied
                // twice. A client that wants a clean slate takes a fresh identity instead.
                return self.error(
                    Some(op),
                    Status::BadControl,
                    seq,
                    "refused: forgetting the dedupe windows would apply retried pushes twice \
                     (restart the client: it takes a fresh identity)",
                );
            }
            AdminRequest::SetRdma(on) => match self.rdma.lock().as_ref() {
                Some(t) => {
                    t.set_in_service(on);
                    format!("RDMA in service: {on}")
                }
                None => "no RDMA transport".into(),
            },
            AdminRequest::Shutdown => {
                self.shutdown.notify_waiters();
                "shutting down".into()
            }
        };
        self.control(op, seq, &AdminResponse { message })
    }
}

/// The RPC handler of a server (the method is the ps-core op code).
#[derive(Debug, Clone)]
pub struct Handler(pub Arc<PsServer>);

impl bex_rpc::Handler for Handler {
    async fn handle(&self, method: u16, body: Msg) -> Result<Msg, RpcError> {
        let s = &self.0;
        let Some(op) = u8::try_from(method).ok().and_then(Op::from_u8) else {
            return s.error(None, Status::UnknownOp, 0, "unknown op");
        };
        let started = crate::clock::now();
        let m = s.metrics.ops.get(&op);
        if let Some(m) = m {
            m.requests.inc();
            m.request_bytes.observe(body.as_slice().len() as f64);
        }
        let reply = match wire::decode_request(body.as_slice(), &s.limits) {
            Ok(v) if v.header.op == op => s.handle_request(op, v).await,
            Ok(v) => s.error(
                Some(op),
                Status::BadFrame,
                v.header.seq,
                "frame op differs from the RPC method",
            ),
            Err(e) => s.error(Some(op), e.status(), 0, &e.to_string()),
        };
        if let Some(m) = m {
            m.duration.observe(crate::clock::now().duration_since(started).as_secs_f64());
            if let Ok(r) = &reply {
                m.response_bytes.observe(r.as_slice().len() as f64);
            }
        }
        reply
    }
}

/// A Replicate frame with the whole current rows (values, optimizer state, steps, version)
/// of `keys` of table `table`, under (`client`, `seq`).
fn state_frame(
    tables: &TableSet,
    table: u32,
    keys: &[u64],
    client: u64,
    seq: u64,
) -> Result<Vec<u8>, String> {
    let t = tables.get(table).ok_or("no such table")?;
    let width = t.state_width();
    let mut rows = vec![0f32; keys.len() * width];
    t.read_state_into(keys, &mut rows).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; wire::REQUEST_HEADER_LEN + keys.len() * (8 + 4 * width)];
    let h = DataHeader { table, dim: width as u32, client, seq, flags: wire::flags::STATE };
    let n = wire::encode_replicate_into(&mut buf, &h, keys, &rows).map_err(|e| e.to_string())?;
    buf.truncate(n);
    Ok(buf)
}

/// What a forwarding task needs.
struct Forwarder {
    client: Arc<Client>,
    target: usize,
    me: u64,
    tables: Arc<TableSet>,
    lag: Arc<ReplLag>,
    metrics: Arc<Metrics>,
    batch_keys: usize,
    /// `push_ack = replicated`: rows are read under the server's replication order.
    order: Option<Arc<tokio::sync::Mutex<()>>>,
}

/// Forwards to one replica, one request at a time, retrying each until acknowledged: first
/// the pending pushes, each as the current rows of its keys under its own identity; then
/// rounds of up to `batch_keys` changed keys, read when sent, one Replicate per table under
/// the forwarder's identity. Whatever changes meanwhile goes in a later round.
async fn forward(f: Forwarder, backlog: Arc<Backlog>) {
    let mut seq = 0u64;
    loop {
        if let Some(p) = backlog.take_push() {
            let n = p.keys.len();
            let frame = || state_frame(&f.tables, p.table, &p.keys, p.client, p.seq);
            if send_until_acked(&f, frame).await {
                f.metrics.replicated_requests.inc();
            }
            backlog.settled(n);
            continue;
        }
        let (taken, oldest) = backlog.take(f.batch_keys, crate::clock::now());
        if taken.is_empty() {
            backlog.ready.notified().await;
            continue;
        }
        for t in taken {
            let n = t.keys.len();
            seq += 1;
            // Whole rows, optimizer state included: a replica is an exact copy, so a pod
            // that takes over training continues where the training pod was.
            let frame = || state_frame(&f.tables, t.table, &t.keys, f.me, seq);
            if send_until_acked(&f, frame).await {
                f.metrics.replicated_requests.inc();
                f.lag.acked_seq.store(seq, Ordering::Relaxed);
            }
            backlog.settled(n);
        }
        if let Some(oldest) = oldest {
            let ms = crate::clock::now().duration_since(oldest).as_millis() as u64;
            f.lag.last_lag_ms.store(ms, Ordering::Relaxed);
        }
    }
}

/// Sends the Replicate `frame()` builds (rebuilt for each attempt, so it carries the newest
/// rows) to the forwarder's replica until it is acknowledged; false if it cannot be built.
/// Versioned rows apply over older ones only, so a replica that applied an attempt whose
/// answer was lost just answers the next one too.
async fn send_until_acked(f: &Forwarder, frame: impl Fn() -> Result<Vec<u8>, String>) -> bool {
    let mut backoff = Duration::from_millis(5);
    loop {
        let order = match &f.order {
            Some(m) => Some(m.lock().await),
            None => None,
        };
        let built = frame();
        drop(order);
        let buf = match built {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(%e, "cannot build a replication request");
                return false;
            }
        };
        match f.client.call(&[f.target], Op::Replicate as u16, &buf).await {
            Ok(m) => match wire::decode_response(m.as_slice(), &Limits::default()) {
                Ok(r) if r.header.status.is_success() => return true,
                // Rows the replica refuses (not finite: the optimizer overflowed) are refused
                // again however often they are sent.
                Ok(r) if r.header.status == Status::BadValue => {
                    tracing::error!(target = f.target, "replica refuses rows: {}", r.message());
                    return false;
                }
                Ok(r) => tracing::warn!(
                    status = r.header.status.name(),
                    target = f.target,
                    "replication refused; retrying"
                ),
                Err(e) => {
                    f.metrics.malformed_peer_replies.inc();
                    tracing::warn!(%e, target = f.target, "bad replication reply; retrying")
                }
            },
            Err(e) => tracing::debug!(%e, target = f.target, "replication failed; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Servers for the tests of this crate.
#[cfg(test)]
pub(crate) mod test_server {
    use super::*;
    use bex_ps_proto::Config;
    use bex_rnic::soft::{Fabric, LinkModel, NicConfig};
    use bex_rnic::Device;

    /// A registered pool on a software NIC of its own.
    pub(crate) fn test_pool() -> &'static Pool {
        let dev = Fabric::new(1, LinkModel::default()).add_device(NicConfig::default());
        let pd = dev.alloc_pd().unwrap();
        Pool::new(vec![Arc::new(dev.registrar(&pd))]).unwrap().leak()
    }

    /// Shard 0 of mini-pod `pod` of `cfg`'s cluster, forwarding to `replicas` if it trains.
    pub(crate) fn server_of(
        cfg: &Config,
        pod: u32,
        max_frame_bytes: usize,
        replicas: Option<(Arc<Client>, Vec<u32>)>,
    ) -> Arc<PsServer> {
        let pool = test_pool();
        PsServer::new(
            ServerParts {
                pod,
                shard: 0,
                tables: TableSet::new(cfg.table_specs()).unwrap(),
                limits: Limits { max_frame_bytes, ..Limits::default() },
                dedupe: DedupeConfig::default(),
                pool,
                checkpoint_path: PathBuf::from("/dev/null/none.ckpt"),
                update_seq: 0,
                dedupe_windows: Vec::new(),
                replication_id: 1,
                push_clock: PushClock::new(|| 1),
                push_ack: PushAck::Applied,
                push_ack_timeout: Duration::from_millis(100),
            },
            &cfg.topology().unwrap(),
            replicas,
            1,
        )
    }

    /// The training shard of `cfg`'s cluster, whose replicas (every other pod) are ports
    /// nobody listens on: every Replicate fails, and the backlogs keep what is queued.
    pub(crate) async fn with_absent_replicas(cfg: &Config) -> Arc<PsServer> {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let any = "127.0.0.1:0".parse().unwrap();
        let tcp = bex_transport::TcpTransport::start(test_pool(), any, Default::default());
        let tcp = tcp.await.unwrap();
        let pods: Vec<u32> = (1..cfg.cluster.pods).collect();
        let eps = pods.iter().map(|&p| bex_rpc::Endpoint::at(p, closed, closed)).collect();
        let client = Client::new(None, tcp.into(), eps, Default::default());
        server_of(cfg, 0, 1 << 20, Some((Arc::new(client), pods)))
    }

    impl PsServer {
        /// The keys of `table` waiting in replica `target`'s backlog key set.
        pub(crate) fn backlog_keys(&self, target: usize, table: u32) -> BTreeSet<u64> {
            let st = self.repl[target].state.lock();
            st.tables.get(&table).map(|(_, set)| set.clone()).unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_server::*;
    use super::*;

    #[test]
    fn a_backlog_holds_each_changed_key_once_and_hands_them_out_in_bounded_rounds() {
        let b = Backlog::default();
        let t0 = crate::clock::now();
        b.mark(1, 2, [5, 3, 5].into_iter(), t0);
        b.mark(0, 4, [9].into_iter(), t0 + Duration::from_millis(1));
        b.mark(1, 2, [3, 7].into_iter(), t0 + Duration::from_millis(2));
        assert_eq!(b.pending(), 4, "keys 3, 5, 7 of table 1 and 9 of table 0");
        let later = t0 + Duration::from_millis(10);
        let (first, oldest) = b.take(3, later);
        assert_eq!(oldest, Some(t0));
        assert_eq!(
            first,
            vec![
                Taken { table: 0, dim: 4, keys: vec![9] },
                Taken { table: 1, dim: 2, keys: vec![3, 5] }
            ]
        );
        assert_eq!(b.pending(), 1);
        b.mark(1, 2, [3].into_iter(), later);
        let (second, oldest) = b.take(10, later + Duration::from_millis(1));
        assert_eq!(oldest, Some(later), "what stayed behind is counted from the last take");
        assert_eq!(second, vec![Taken { table: 1, dim: 2, keys: vec![3, 7] }]);
        assert_eq!(b.pending(), 0);
        assert_eq!(b.take(10, later), (Vec::new(), None));
    }
    #[test]
    fn pending_pushes_hold_a_bounded_number_of_keys() {
        let b = Backlog::default();
        let now = crate::clock::now();
        let push = |keys: std::ops::Range<u64>, seq| PendingPush {
            table: 0,
            keys: keys.collect(),
            client: 5,
            seq,
        };
        assert!(b.push_pending(push(0..MAX_PENDING_PUSH_KEYS - 1, 1), 4, now));
        assert!(!b.push_pending(push(0..2, 2), 4, now), "past the bound: into the key set");
        assert_eq!(b.pending(), 2);
        assert!(b.push_pending(push(2..3, 3), 4, now), "one more key fits");
    }

    use bex_ps_proto::Config;
    use bex_rpc::Handler as _;

    fn server(max_frame_bytes: usize) -> Arc<PsServer> {
        server_of_pod(0, 1, max_frame_bytes)
    }

    /// Shard 0 of mini-pod `pod` of `pods` (pod 0 trains).
    fn server_of_pod(pod: u32, pods: u32, max_frame_bytes: usize) -> Arc<PsServer> {
        let cfg = Config::from_toml_str(&format!(
            "[cluster]\npods = {pods}\nshards = 1\n[[tables]]\nname = \"t\"\ndim = 32\n"
        ))
        .unwrap();
        server_of(&cfg, pod, max_frame_bytes, None)
    }

    async fn fetch_status(s: &Arc<PsServer>, keys: usize) -> (Status, usize) {
        let keys: Vec<u64> = (0..keys as u64).collect();
        let mut f = vec![0u8; wire::fetch_request_len(keys.len())];
        let h = DataHeader { table: 0, dim: 32, client: 1, seq: 1, flags: 0 };
        wire::encode_fetch_into(&mut f, &h, &keys).unwrap();
        let m = Msg::copy_from(s.pool, &f).unwrap();
        let r = Handler(s.clone()).handle(Op::Fetch as u16, m).await.unwrap();
        let body = &r.as_slice()[HEADER_LEN..];
        (wire::decode_response(body, &Limits::default()).unwrap().header.status, body.len())
    }

    async fn push_status(s: &Arc<PsServer>, seq: u64, grad: f32) -> Status {
        let keys = [7u64, 9];
        let grads = vec![grad; keys.len() * 32];
        let mut f = vec![0u8; wire::push_request_len(keys.len(), 32)];
        let h = DataHeader { table: 0, dim: 32, client: 5, seq, flags: 0 };
        wire::encode_push_into(&mut f, &h, &keys, &grads).unwrap();
        let m = Msg::copy_from(s.pool, &f).unwrap();
        let r = Handler(s.clone()).handle(Op::Push as u16, m).await.unwrap();
        let body = &r.as_slice()[HEADER_LEN..];
        wire::decode_response(body, &Limits::default()).unwrap().header.status
    }

    // A replica away through a long-tail stream: once the pending pushes are full, the
    // training pod's backlog for it keeps the keys whose rows are here and drops the rest,
    // so it is bounded by the table's capacity, not by the distinct keys pushed; no key
    // with a row is dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backlog_for_an_absent_replica_keeps_only_the_keys_with_rows() {
        const ROWS: u64 = 512;
        let cfg = Config::from_toml_str(&format!(
            "[cluster]\npods = 2\nshards = 1\n[[tables]]\nname = \"t\"\ndim = 4\n\
             capacity = {{ max_rows = {ROWS} }}\n"
        ))
        .unwrap();
        let s = with_absent_replicas(&cfg).await;
        let (batch, pushes) = (16u64, MAX_PENDING_PUSHES as u64 + 2000);
        for seq in 0..pushes {
            let keys: Vec<u64> = (seq * batch..(seq + 1) * batch).collect();
            let mut f = vec![0u8; wire::push_request_len(keys.len(), 4)];
            let h = DataHeader { table: 0, dim: 4, client: 5, seq: seq + 1, flags: 0 };
            wire::encode_push_into(&mut f, &h, &keys, &vec![0.5; keys.len() * 4]).unwrap();
            let m = Msg::copy_from(s.pool, &f).unwrap();
            let r = Handler(s.clone()).handle(Op::Push as u16, m).await.unwrap();
            let body = &r.as_slice()[HEADER_LEN..];
            let status = wire::decode_response(body, &Limits::default()).unwrap().header.status;
            assert_eq!(status, Status::Ok);
        }
        let b = &s.repl[0];
        let idle = tokio::time::Instant::now() + Duration::from_secs(20);
        while b.state.lock().prune_running {
            assert!(tokio::time::Instant::now() < idle, "the prune never ended");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t = s.tables.get(0).unwrap();
        let st = b.state.lock();
        let set = st.tables.get(&0).map(|(_, set)| set.clone()).unwrap_or_default();
        assert!(
            set.len() as u64 <= 2 * t.rows() + PRUNE_SLACK_KEYS,
            "{} keys held for {} rows",
            set.len(),
            t.rows()
        );
        // Keys past the pending pushes went into the set: those with a row are all there.
        let first = (MAX_PENDING_PUSHES as u64 + 1) * batch;
        let live: Vec<u64> = (first..pushes * batch).filter(|&k| t.contains(k)).collect();
        assert!(live.len() > 100, "{} of the set's keys have rows", live.len());
        assert!(live.iter().all(|k| set.contains(k)), "a key with a row was dropped");
        assert!(s.metrics.replication_pruned.get() > 10_000);
    }

    // The dedupe contract: a push refused for its values is not admitted, so its corrected
    // retry under the same number is applied (it was answered Duplicate, never applied).
    #[tokio::test]
    async fn a_push_refused_for_its_values_is_not_admitted() {
        let s = server(1 << 20);
        assert_eq!(push_status(&s, 1, f32::NAN).await, Status::BadValue);
        assert_eq!(push_status(&s, 1, 0.5).await, Status::Ok);
        assert_eq!(push_status(&s, 1, 0.5).await, Status::Duplicate);
    }

    // The checks of the real handler (ps-core's protocol tests use a stand-in server): a
    // serving pod's replica refuses a client's push, and an op nobody knows is named.
    #[tokio::test]
    async fn a_serving_replica_refuses_pushes_and_an_unknown_op_is_named() {
        let s = server_of_pod(1, 2, 1 << 20);
        assert_eq!(push_status(&s, 1, 0.5).await, Status::NotTraining);
        assert_eq!(fetch_status(&s, 3).await.0, Status::Ok, "it still serves fetches");
        let m = Msg::copy_from(s.pool, &[0u8; 32]).unwrap();
        let r = Handler(s.clone()).handle(0xfff0, m).await.unwrap();
        let body = &r.as_slice()[HEADER_LEN..];
        let status = wire::decode_response(body, &Limits::default()).unwrap().header.status;
        assert_eq!(status, Status::UnknownOp);
        // The training pod's server takes the same push, and refuses what only replicas take.
        let training = server_of_pod(0, 2, 1 << 20);
        assert_eq!(push_status(&training, 1, 0.5).await, Status::Ok);
        let mut f = vec![0u8; wire::push_request_len(1, 32)];
        let h = DataHeader { table: 0, dim: 32, client: 5, seq: 2, flags: 0 };
        wire::encode_replicate_into(&mut f, &h, &[7], &[0.25; 32]).unwrap();
        let m = Msg::copy_from(training.pool, &f).unwrap();
        let r = Handler(training.clone()).handle(Op::Replicate as u16, m).await.unwrap();
        let body = &r.as_slice()[HEADER_LEN..];
        let status = wire::decode_response(body, &Limits::default()).unwrap().header.status;
        assert_eq!(status, Status::NotTraining, "a Replicate to the training pod");
        assert_eq!(push_status(&training, 2, 0.5).await, Status::Ok, "seq 2 was not planted");
    }

    async fn control_status<T: serde::Serialize>(s: &Arc<PsServer>, op: Op, body: &T) -> Status {
        let f = wire::control_request_vec(op, 0, 5, 9, body).unwrap();
        let m = Msg::copy_from(s.pool, &f).unwrap();
        let r = Handler(s.clone()).handle(op as u16, m).await.unwrap();
        let body = &r.as_slice()[HEADER_LEN..];
        wire::decode_response(body, &Limits::default()).unwrap().header.status
    }

    // Control bodies are checked for every op, and an Admin request that would break
    // exactly-once pushes is refused: after it, an applied push's retry is still Duplicate.
    #[tokio::test]
    async fn a_bad_checkpoint_body_and_a_dedupe_reset_are_refused() {
        let s = server(1 << 20);
        let garbage = [0xffu8; 3];
        assert_eq!(control_status(&s, Op::Checkpoint, &garbage).await, Status::BadControl);
        assert_eq!(push_status(&s, 1, 0.5).await, Status::Ok);
        let reset = bex_ps_proto::control::AdminRequest::ResetDedupe;
        assert_eq!(control_status(&s, Op::Admin, &reset).await, Status::BadControl);
        assert_eq!(push_status(&s, 1, 0.5).await, Status::Duplicate);
        let ping = bex_ps_proto::control::AdminRequest::Ping;
        assert_eq!(control_status(&s, Op::Admin, &ping).await, Status::Ok);
    }

    // A server that can no longer serve asks its process to stop (and says why); the end of
    // its services during a drain is the normal stop, not a failure.
    #[tokio::test]
    async fn a_failed_service_stops_the_server_unless_it_is_draining() {
        let s = server(1 << 20);
        s.set_state(ServingState::Serving);
        s.fail("the RDMA RPC service stopped accepting".into());
        let woke = tokio::time::timeout(Duration::from_secs(5), s.shutdown.notified()).await;
        assert!(woke.is_ok(), "the process is told to stop");
        assert_eq!(s.failed().as_deref(), Some("the RDMA RPC service stopped accepting"));
        let d = server(1 << 20);
        d.set_state(ServingState::Draining);
        d.fail("the TCP RPC service stopped accepting".into());
        assert_eq!(d.failed(), None);
    }

    // Found writing the ps_server fuzz target: a 360-byte Fetch made the server allocate and
    // send a 5 KiB reply over its 4 KiB frame limit, which clients refuse (at the defaults,
    // 8 MiB of keys made a 128 MiB reply; a dim-4096 table, one of 16 GiB).
    #[tokio::test]
    async fn fetch_reply_over_the_frame_limit_is_too_large() {
        let s = server(4096);
        let (ok, len) = fetch_status(&s, 20).await;
        assert_eq!(ok, Status::Ok);
        assert!(len <= 4096);
        assert_eq!(fetch_status(&s, 40).await.0, Status::TooLarge);
    }
}
