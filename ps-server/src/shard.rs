//! One shard's server assembled from its two transports: the replication client, the
//! [`PsServer`], a replica's bootstrap from the training pod, a training shard's catch-up
//! from its replicas, and RPC service on both transports. `ps-server` runs it over real transports; the simulation (`sim/cluster`) runs
//! the same code over simulated NICs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bex_ps_core::checkpoint;
use bex_ps_core::dedupe::{DedupeConfig, WindowState};
use bex_ps_core::table::STRIPES;
use bex_ps_core::{SeenRow, TableSet};
use bex_ps_proto::config::PushAck;
use bex_ps_proto::control::{ServingState, SnapshotCursor, SnapshotRequest, TablesInfo};
use bex_ps_proto::spec::compare_definitions;
use bex_ps_proto::topology::Topology;
use bex_ps_proto::wire::{self, Limits, Op};
use bex_ps_proto::Config;
use bex_rpc::{serve, Client, ClientConfig, Endpoint, ServerStats};
use bex_transport::Transport;
use tokio::task::JoinHandle;

use crate::server::{Handler, PsServer, ServerParts};
use bex_client::node::{client_config, ClientRole};

/// The least row version a push of this process writes now: microseconds since the Unix
/// epoch (the push clock of a process). A push sets its row's version to the greater of
/// this and one more than before, so a row's version is about when it was last pushed, and
/// a later start writes versions above every earlier start's (a restarted training shard
/// also raises its floor above every version its replicas hold, for a clock that went
/// back).
pub fn version_floor() -> u64 {
    crate::clock::unix_ms().saturating_mul(1000).max(1)
}

/// How long a fresh replica keeps starting attempts to copy its shard from the training pod
/// before it serves without it (its rows would then be initial values until pushes replace
/// them, so it tries hard; `bex_ps_bootstrap_missing` says so). An attempt under way always
/// runs to its end: a large shard copies for longer, and a copy cut short would serve part
/// of the rows as if they were all.
pub const BOOTSTRAP_DEADLINE: Duration = Duration::from_secs(60);
/// The deadline of one snapshot chunk: a 1 MiB chunk from a busy training server takes far
/// longer than a serving request's `Tr` (a 40 ms deadline made restarted replicas start
/// empty under load, found by the chaos run).
const SNAPSHOT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Under `push_ack = applied`, how long a restarted training shard keeps trying to copy each
/// replica's rows before it takes pushes without them (then every pushed row it holds is
/// queued for that replica); under `replicated` it waits as long as it takes.
pub const CATCH_UP_DEADLINE: Duration = Duration::from_secs(30);

/// What [`copy_shard`] copied.
#[derive(Debug, Default)]
pub struct Copied {
    /// Rows received (each applied only over an older row).
    pub rows: u64,
    /// The peer's dedupe windows.
    pub windows: Vec<WindowState>,
}

/// Why [`copy_shard`] stopped.
#[derive(Debug)]
pub enum CopyError {
    /// The call failed (no connection, a timeout), or the peer answered an error status.
    Unanswered(String),
    /// The peer's answer did not decode, or broke the snapshot's rules (a cursor that does
    /// not move on, too many windows): counted as a malformed peer reply.
    Malformed(String),
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyError::Unanswered(why) | CopyError::Malformed(why) => f.write_str(why),
        }
    }
}

/// Copies the rows of this shard from the server at endpoint `peer` of `client` into
/// `tables` in chunks of at most `chunk_bytes`, each row only over an older one, telling
/// `seen` of every row record (table, row). The peer's dedupe windows are asked for first:
/// a window read before the rows names only pushes whose rows are already there (read
/// after, it could name a push whose rows the copy missed, and that push's retry would be
/// answered Duplicate and lost); more than `max_windows` of them is an error. The peer's
/// chunks must move their cursor on (the windows by client, then the rows by table, stripe
/// and row): one that does not would make the copy loop for good.
pub async fn copy_shard(
    client: &Client,
    peer: usize,
    tables: &TableSet,
    (chunk_bytes, max_windows): (u32, usize),
    seen: &mut (dyn FnMut(u32, SeenRow) + Send),
) -> Result<Copied, CopyError> {
    let unanswered = |e: String| CopyError::Unanswered(e);
    let malformed = |e: String| CopyError::Malformed(e);
    let mut cursor = SnapshotCursor { table: u32::MAX, ..SnapshotCursor::START };
    let mut out = Copied::default();
    let place = |c: &SnapshotCursor| (c.table, c.stripe, c.row);
    for seq in 1.. {
        let req = SnapshotRequest { cursor, max_bytes: chunk_bytes };
        let frame = wire::control_request_vec(Op::Snapshot, 0, 0, seq, &req)
            .map_err(|e| unanswered(e.to_string()))?;
        let m = client.call(&[peer], Op::Snapshot as u16, &frame).await;
        let m = m.map_err(|e| unanswered(e.to_string()))?;
        let r = wire::decode_response(m.as_slice(), &Limits::default())
            .map_err(|e| malformed(e.to_string()))?;
        if !r.header.status.is_success() {
            return Err(unanswered(r.message().into_owned()));
        }
        let info = checkpoint::apply_snapshot_chunk(tables, r.body, seen)
            .map_err(|e| malformed(e.to_string()))?;
        out.rows += u64::from(info.rows);
        let windows_chunk = info.is_windows();
        out.windows.extend(info.windows);
        if out.windows.len() > max_windows {
            return Err(malformed(format!(
                "the peer sent more than {max_windows} dedupe windows (its bound should match \
                 this server's dedupe_max_clients)"
            )));
        }
        // (The one step back, from the windows to the first table's rows, follows the last
        // windows chunk, which names no next cursor.)
        if let Some(next) = info.next.filter(|n| place(n) <= place(&cursor)) {
            return Err(malformed(format!(
                "the peer's snapshot did not move on: cursor {:?} after {:?}",
                place(&next),
                place(&cursor)
            )));
        }
        match info.next {
            // The windows come in pages, then the rows from the start.
            Some(c) if windows_chunk => cursor = c,
            None if windows_chunk => cursor = SnapshotCursor::START,
            // The windows again, now after the rows: not wanted.
            Some(c) if (c.table as usize) < tables.len() => cursor = c,
            _ => break,
        }
    }
    Ok(out)
}

/// Why [`copy_with_retries`] copied nothing.
#[derive(Debug)]
enum NotCopied {
    /// No attempt succeeded before the deadline.
    Unreachable,
    /// The peer's tables differ from this server's in a way the copy's [`Refuse`] names
    /// (see [`check_definitions`]): its rows are not copied here.
    Incompatible(String),
}

/// Which differences of table definitions stop a copy ([`check_definitions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refuse {
    /// Rows that cannot be stored here (another layout or shard count): a training shard's
    /// catch-up. Rows of other initial values still copy: its own definitions decide absent
    /// keys, and skipping the copy would lose the pushes the replica acknowledged.
    Layout,
    /// Those and other initial rows: a replica, which would answer absent keys otherwise
    /// than the training pod for good.
    LayoutOrInitialRows,
}

/// Asks the peer at `peer` of `client` (pod `peer_pod`) for its table definitions and shard
/// count and compares them with `server`'s. `Ok(Err(why))`: a difference `refuse` names;
/// the others are logged and pass. A peer whose answer cannot be read (a build of another
/// wire version: postcard carries no field names) is logged and passes, as before pods
/// compared. `Err`: the peer did not answer, or answered an error (the caller tries again).
async fn check_definitions(
    server: &PsServer,
    (client, peer, peer_pod): (&Client, usize, u32),
    refuse: Refuse,
) -> Result<Result<(), String>, String> {
    let frame = wire::control_request_vec(Op::Tables, 0, 0, 0, &()).map_err(|e| e.to_string())?;
    let m = client.call(&[peer], Op::Tables as u16, &frame).await.map_err(|e| e.to_string())?;
    let r = wire::decode_response(m.as_slice(), &Limits::default()).map_err(|e| {
        server.count_malformed_peer_reply();
        e.to_string()
    })?;
    if !r.header.status.is_success() {
        // An answer about the request, not about the tables: asked again.
        return Err(format!("Tables answered {}: {}", r.header.status.name(), r.message()));
    }
    let info = match r.control::<TablesInfo>() {
        Ok(info) => info,
        Err(e) => {
            server.count_malformed_peer_reply();
            tracing::warn!(peer_pod, error = %e, "pod {peer_pod}'s table definitions are unreadable; copying without comparing them");
            return Ok(Ok(()));
        }
    };
    let peer_specs: Vec<_> = info.tables.into_iter().map(|t| t.spec).collect();
    let mut diff = compare_definitions(&server.tables().specs(), &peer_specs);
    if info.shards != server.shards() {
        // Its shard of the same number holds other keys.
        let shards = server.shards();
        diff.layout.push(format!("{shards} shards a pod here, {} at the peer", info.shards));
    }
    server.record_definition_differences(peer_pod, &diff);
    let refused: Vec<String> = match refuse {
        Refuse::Layout => diff.layout.clone(),
        Refuse::LayoutOrInitialRows => [&diff.layout[..], &diff.initial_rows[..]].concat(),
    };
    // Copied all the same (a training shard's catch-up): other initial rows.
    if refused.is_empty() && !diff.initial_rows.is_empty() {
        tracing::error!(
            peer_pod,
            differences = ?diff.initial_rows,
            "pod {peer_pod} makes other initial rows: its rows are copied, but the pods answer \
             absent keys otherwise until every pod runs one cluster file"
        );
    }
    if !diff.converging.is_empty() {
        tracing::warn!(
            peer_pod,
            differences = ?diff.converging,
            "pod {peer_pod} defines its tables otherwise (a rolling change? its rows are \
             copied; the pods keep other rows until every pod runs one file)"
        );
    }
    Ok(if refused.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "pod {peer_pod}'s tables are not this server's: {} (a table's name, dim, \
             initializer, seed or optimizer, and the shard count, cannot change while a \
             cluster runs: start every pod of it with one cluster file)",
            refused.join("; ")
        ))
    })
}

/// [`copy_shard`] from pod `peer_pod` (at `peer` of `client`) into `server`'s tables,
/// retried with backoff until it succeeds or `deadline` passes (each failure logged), after
/// [`check_definitions`] finds the peer's tables compatible.
async fn copy_with_retries(
    server: &PsServer,
    peer: (&Client, usize, u32),
    refuse: Refuse,
    chunk_bytes: u32,
    mut diff: Option<&mut StripeDiff<'_>>,
    (deadline, what): (Option<Duration>, &str),
) -> Result<Copied, NotCopied> {
    // The deadline stops new attempts, never one under way (see BOOTSTRAP_DEADLINE).
    let give_up_at = deadline.map(|d| crate::clock::now() + d);
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 1u32;
    loop {
        if let Some(d) = diff.as_deref_mut() {
            d.restart();
        }
        let mut seen = |table, row| {
            if let Some(d) = diff.as_deref_mut() {
                d.seen(table, row);
            }
        };
        let copied = match check_definitions(server, peer, refuse).await {
            Ok(Err(why)) => return Err(NotCopied::Incompatible(why)),
            Ok(Ok(())) => {
                // The peer keeps at most as many windows as this server (one cluster file);
                // twice that leaves room for a rolling change of the bound.
                let limits = (chunk_bytes, 2 * server.dedupe_max_clients());
                copy_shard(peer.0, peer.1, server.tables(), limits, &mut seen).await
            }
            Err(e) => Err(CopyError::Unanswered(format!("asking its table definitions: {e}"))),
        };
        match copied {
            Ok(c) => return Ok(c),
            Err(e) => {
                if matches!(e, CopyError::Malformed(_)) {
                    server.count_malformed_peer_reply();
                }
                tracing::warn!(attempt, error = %e, "{what} failed; retrying")
            }
        }
        if give_up_at.is_some_and(|t| crate::clock::now() + backoff >= t) {
            return Err(NotCopied::Unreachable);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
        attempt += 1;
    }
}

/// What a shard starts from.
#[derive(Debug)]
pub struct ShardStart {
    /// Mini-pod.
    pub pod: u32,
    /// Shard.
    pub shard: u32,
    /// Its tables: restored from a checkpoint, or fresh.
    pub tables: TableSet,
    /// The update sequence of the checkpoint (0 if fresh).
    pub update_seq: u64,
    /// The checkpoint's dedupe windows (empty if fresh).
    pub dedupe_windows: Vec<bex_ps_core::dedupe::WindowState>,
    /// Whether `tables` came from a checkpoint (a fresh replica bootstraps instead).
    pub restored: bool,
    /// This incarnation's identity as a replication source (a training server's Replicate
    /// requests are deduplicated by it): fresh for every start, see
    /// [`bex_process::incarnation_id`].
    pub incarnation: u64,
    /// The least row version a push writes now (see [`ServerParts::push_clock`]):
    /// [`version_floor`] in a process.
    pub push_clock: crate::server::PushClock,
}

/// A serving shard.
#[derive(Debug)]
pub struct RunningShard {
    /// The server.
    pub server: Arc<PsServer>,
    /// Requests served, errors, malformed frames.
    pub stats: Arc<ServerStats>,
    /// The RPC service tasks (one per transport) and a training shard's catch-up; aborting
    /// them stops serving.
    pub tasks: Vec<JoinHandle<()>>,
}

/// Builds the shard's server on `rdma` and `tcp` (which share one pool) and serves RPC on
/// both: a replica once it has copied the training pod's rows; a training shard at once,
/// taking pushes once it has caught up from its replicas (a background task among the
/// returned ones). Progress is logged (info). Err: a replica found the training pod's
/// tables incompatible with its own (it serves nothing).
pub async fn start_shard(
    cfg: &Config,
    topo: &Topology,
    start: ShardStart,
    (rdma, tcp): (Transport, Transport),
) -> Result<RunningShard, String> {
    let ShardStart {
        pod,
        shard,
        tables,
        update_seq,
        dedupe_windows,
        restored,
        incarnation,
        push_clock,
    } = start;
    let ccfg =
        client_config(&cfg.rpc, pod, u64::from(pod) << 32 | u64::from(shard), ClientRole::Serving);
    // The training pod forwards to the same shard in every other pod.
    let targets: Vec<Endpoint> = (0..topo.pods())
        .filter(|&p| p != pod)
        .filter_map(|p| {
            topo.server(p, shard).map(|a| Endpoint {
                pod: p,
                rdma: a.rdma,
                tcp: a.tcp,
                host: a.host.clone(),
            })
        })
        .collect();
    let n_targets = targets.len();
    let target_pods: Vec<u32> = targets.iter().map(|e| e.pod).collect();
    let repl_client = Arc::new(
        Client::new(Some(rdma.clone()), tcp.clone(), targets.clone(), ccfg.clone())
            .with_unwell_replies(bex_client::fanout::unwell_reply),
    );
    let limits = Limits {
        max_frame_bytes: cfg.server.max_request_bytes,
        max_keys: cfg.server.max_keys_per_request,
        ..Limits::default()
    };
    let server = PsServer::new(
        ServerParts {
            pod,
            shard,
            tables,
            limits,
            dedupe: DedupeConfig::of(cfg),
            pool: rdma.pool(),
            checkpoint_path: cfg.checkpoint_path(pod, shard),
            update_seq,
            dedupe_windows,
            replication_id: incarnation,
            push_clock,
            push_ack: cfg.server.push_ack,
            push_ack_timeout: Duration::from_millis(cfg.server.push_ack_timeout_ms),
        },
        topo,
        Some((repl_client, target_pods.clone())),
        cfg.server.replication_batch_keys as usize,
    );
    let stats = Arc::new(ServerStats::default());
    bex_client::telemetry::register_rpc_server(&server.metrics.registry, stats.clone())
        .expect("static metric");
    let handler = Arc::new(Handler(server.clone()));
    // A service that ends while the server is not stopping (its transport failed) leaves it
    // unable to answer on that transport: the server stops, so it is restarted.
    let serve_both = || -> Vec<JoinHandle<()>> {
        [(rdma.clone(), "RDMA"), (tcp.clone(), "TCP")]
            .map(|(t, kind)| {
                let (h, st, s) = (handler.clone(), stats.clone(), server.clone());
                tokio::spawn(async move {
                    serve(t, h, st).await;
                    s.fail(format!("the {kind} RPC service stopped accepting"));
                })
            })
            .into()
    };
    // Copies take longer than a serving request's `Tr`: a 1 MiB chunk from a busy server.
    let copy_cfg = ClientConfig {
        request_timeout: ccfg.request_timeout.max(SNAPSHOT_REQUEST_TIMEOUT),
        connect_timeout: ccfg.connect_timeout.max(Duration::from_secs(1)),
        retry_probability: 1.0,
        ..ccfg
    };
    let chunk = cfg.server.snapshot_chunk_bytes;
    let tasks = if topo.is_training(pod) {
        // Serving at once (Snapshot and Health; data ops are Unavailable until caught up,
        // in the background), so replicas bootstrapping from this shard meanwhile, and a
        // cluster whose replicas start after it, are not stuck waiting for each other.
        // Whatever `bootstrap_from_peer` says: without the catch-up, a training server
        // restarted from a checkpoint would lose the pushes its replicas acknowledged since,
        // and overwrite their newer rows with its next pushes.
        let catching_up = n_targets > 0;
        // Before serving: a push must not land ahead of the catch-up.
        server.set_state(if catching_up { ServingState::Restoring } else { ServingState::Serving });
        let mut tasks = serve_both();
        if catching_up {
            let peers = Client::new(Some(rdma.clone()), tcp.clone(), targets.clone(), copy_cfg);
            let s = server.clone();
            let pods = target_pods.clone();
            // Replicated: a replica holds every acknowledged push, so the shard waits for
            // each replica however long; applied: it goes on without one after a while.
            let deadline = (cfg.server.push_ack == PushAck::Applied).then_some(CATCH_UP_DEADLINE);
            tasks.push(tokio::spawn(async move {
                catch_up(&s, (&peers, &pods), chunk, deadline).await;
                // Not over a drain begun meanwhile.
                s.finish_restoring();
            }));
        }
        tasks
    } else {
        if let (true, Some(a)) =
            (cfg.server.bootstrap_from_peer, topo.server(topo.training_pod(), shard).cloned())
        {
            // Restored or not: the training pod's rows, applied over older ones only, take
            // a restored replica past what its checkpoint missed.
            server.set_state(ServingState::Bootstrapping);
            let peer = Client::new(
                Some(rdma.clone()),
                tcp.clone(),
                vec![Endpoint {
                    pod: topo.training_pod(),
                    rdma: a.rdma,
                    tcp: a.tcp,
                    host: a.host.clone(),
                }],
                copy_cfg,
            );
            let deadline = (Some(BOOTSTRAP_DEADLINE), "bootstrap");
            let training = (&peer, 0, topo.training_pod());
            let refuse = Refuse::LayoutOrInitialRows;
            match copy_with_retries(&server, training, refuse, chunk, None, deadline).await {
                Ok(c) => {
                    server.merge_dedupe(&c.windows);
                    tracing::info!(rows = c.rows, restored, "bootstrapped from the training pod");
                }
                // Serving initial rows of another seed, or rows of another layout, would
                // answer wrong for good: better not to start.
                Err(NotCopied::Incompatible(why)) => return Err(why),
                Err(NotCopied::Unreachable) => {
                    tracing::warn!(
                        deadline = ?BOOTSTRAP_DEADLINE,
                        restored,
                        "no bootstrap from the training pod in time; serving without it"
                    );
                    server.set_bootstrap_missing();
                }
            }
        }
        server.set_state(ServingState::Serving);
        serve_both()
    };
    Ok(RunningShard { server, stats, tasks })
}

/// A catch-up's comparison of one replica's rows with this shard's, a stripe at a time.
/// The snapshot streams each table's stripes in order, and a stripe holds the same keys on
/// every pod, so once the copy has passed a stripe the replica's versions of it are
/// complete: the rows newer here are queued for the replica and the versions dropped. (A
/// map of every replica row, kept to the end, cost about 40 B a row per replica on top of
/// the tables: 4 GB a replica at 100M rows.) Rows the copy stores here are queued for the
/// replicas compared before this one (those after it compare with them in place; queuing
/// them there too held a whole table's keys per replica on a start from an empty disk),
/// also when the copy fails part way. A row out of order (a
/// replica whose table definition differs) is compared as missing: sent again, which is
/// harmless.
pub(crate) struct StripeDiff<'a> {
    server: &'a PsServer,
    target: usize,
    /// The (table, stripe) being copied: every stripe before it is compared.
    at: (u32, usize),
    /// The replica's versions of `at`'s rows.
    versions: HashMap<u64, u64>,
    /// Rows of table `stored_table` the copy stored here, to queue for the replicas before
    /// this one (none are kept for replica 0: there are none).
    stored: Vec<u64>,
    stored_table: u32,
    /// Rows queued for the replica.
    queued: u64,
}

impl<'a> StripeDiff<'a> {
    fn new(server: &'a PsServer, target: usize) -> Self {
        let (versions, stored) = (HashMap::new(), Vec::new());
        StripeDiff { server, target, at: (0, 0), versions, stored, stored_table: 0, queued: 0 }
    }

    /// A copy starts (again): from the first stripe. What was queued stays queued; the
    /// count starts again with the comparisons.
    fn restart(&mut self) {
        self.flush_stored();
        self.at = (0, 0);
        self.versions.clear();
        self.queued = 0;
    }

    fn seen(&mut self, table: u32, row: SeenRow) {
        let Some(t) = self.server.tables().get(table) else { return };
        let here = (table, t.stripe_index(row.key));
        self.pass_to(here);
        if here == self.at {
            self.versions.insert(row.key, row.version);
        }
        if row.stored && self.target > 0 {
            if table != self.stored_table {
                self.flush_stored();
                self.stored_table = table;
            }
            self.stored.push(row.key);
        }
    }

    /// Compares every stripe before `to`.
    fn pass_to(&mut self, to: (u32, usize)) {
        while self.at < to {
            self.queued +=
                self.server.queue_stripe_newer_than(self.target, self.at, &self.versions);
            self.versions.clear();
            let (table, stripe) = self.at;
            self.at = if stripe + 1 < STRIPES { (table, stripe + 1) } else { (table + 1, 0) };
        }
    }

    fn flush_stored(&mut self) {
        self.server.queue_for_replicas_before(self.target, self.stored_table, &self.stored);
        self.stored.clear();
    }

    /// The copy is complete: compares the stripes left; returns the rows queued.
    fn finish(mut self) -> u64 {
        self.pass_to((self.server.tables().len() as u32, 0));
        self.flush_stored();
        self.queued
    }
}

/// A training shard's start: copies every replica's rows (each applied over older rows
/// only) and dedupe windows, so it holds at least the freshest replica's state and knows
/// which pushes that state holds; queues for each replica the rows it lacks (stripe by
/// stripe, [`StripeDiff`]; every pushed row for a replica it could not reach, or whose
/// rows cannot be stored here), and raises the version floor above every version seen.
/// `peers` are the replicas and their pods.
async fn catch_up(
    server: &Arc<PsServer>,
    (peers, pods): (&Client, &[u32]),
    chunk: u32,
    deadline: Option<Duration>,
) {
    for (target, &pod) in pods.iter().enumerate().take(server.replica_count()) {
        let what = format!("catch-up from replica {target}");
        let t0 = crate::clock::now();
        let mut diff = StripeDiff::new(server, target);
        let got = copy_with_retries(
            server,
            (peers, target, pod),
            Refuse::Layout,
            chunk,
            Some(&mut diff),
            (deadline, &what),
        )
        .await;
        let queued = match &got {
            Ok(c) => {
                server.merge_dedupe(&c.windows);
                let ms = crate::clock::now().duration_since(t0).as_millis() as u64;
                let windows = c.windows.len();
                tracing::info!(rows = c.rows, windows, ms, "{what}: done");
                diff.finish()
            }
            Err(not) => {
                match not {
                    NotCopied::Unreachable => {
                        tracing::warn!(?deadline, "{what}: unreachable; going on")
                    }
                    // Its rows cannot be stored here. This pod's rows are queued for it:
                    // it refuses those of another width (`WrongDim`) and stores the others.
                    NotCopied::Incompatible(why) => {
                        tracing::error!(%why, "{what}: not copied; going on")
                    }
                }
                // What its attempts stored here still goes to the replicas before it.
                diff.flush_stored();
                server.queue_every_pushed_row(target)
            }
        };
        if queued > 0 {
            tracing::info!(queued, replica = target, "queued the rows the replica lacks");
        }
    }
    let tables = server.tables();
    tables.raise_version_floor(tables.max_version().saturating_add(1));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use bex_ps_core::ExportRows;

    use super::*;
    use crate::server::test_server::with_absent_replicas;

    // The catch-up from replica 1 of two, fed its rows stripe by stripe as the snapshot
    // streams them: replica 1 gets exactly the rows newer here (the rows it lacks and the
    // rows pushed here since), replica 0 (compared before) the rows the copy stored here
    // (newer at replica 1, or only there); and the comparison holds one stripe's versions
    // at a time, not the replica's every row.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_catch_up_queues_the_rows_each_replica_lacks_a_stripe_at_a_time() {
        let cfg = Config::from_toml_str(
            "[cluster]\npods = 3\nshards = 1\n\
             [[tables]]\nname = \"a\"\ndim = 4\n[[tables]]\nname = \"b\"\ndim = 8\n",
        )
        .unwrap();
        let s = with_absent_replicas(&cfg).await;
        let replica = TableSet::new(cfg.table_specs()).unwrap();
        let push = |tables: &TableSet, floor: u64, keys: std::ops::Range<u64>| {
            tables.raise_version_floor(floor);
            for (_, t) in tables.iter() {
                let keys: Vec<u64> = keys.clone().collect();
                t.push(&keys, &vec![0.5; keys.len() * t.dim()], None).unwrap();
            }
        };
        // Here: 2000..3000 long ago, then 0..2000 lately; replica 1: 1000..3500 in between.
        push(s.tables(), 10, 2000..3000);
        push(&replica, 20, 1000..3500);
        push(s.tables(), 30, 0..2000);
        let mut diff = StripeDiff::new(&s, 1);
        let mut most = 0;
        for (id, t) in replica.iter() {
            for stripe in 0..STRIPES {
                let mut records = Vec::new();
                t.export_records(ExportRows::Pushed, stripe, 0, usize::MAX, &mut records);
                let local = s.tables().get(id).unwrap();
                local
                    .import_records(
                        &records,
                        bex_ps_core::table::RecordFormat::Versioned,
                        &mut |row| diff.seen(id, row),
                    )
                    .unwrap();
                most = most.max(diff.versions.len());
            }
        }
        let queued = diff.finish();
        let largest = replica.iter().flat_map(|(_, t)| (0..STRIPES).map(|i| t.stripe_rows(i)));
        let largest = largest.max().unwrap();
        assert!(most <= largest, "{most} versions held at once, {largest} in a stripe");
        // Each replica's forwarder holds at most one key in flight (batch_keys = 1), retrying.
        for (replica, keys) in [(1, 0..2000), (0, 2000..3500)] {
            let want: BTreeSet<(u32, u64)> =
                (0..2).flat_map(|t| keys.clone().map(move |k| (t, k))).collect();
            let got: BTreeSet<(u32, u64)> = (0..2)
                .flat_map(|t| s.backlog_keys(replica, t).into_iter().map(move |k| (t, k)))
                .collect();
            let extra: Vec<_> = got.difference(&want).collect();
            assert!(extra.is_empty(), "replica {replica} got rows it has: {extra:?}");
            let missing = want.len() - got.len();
            assert!(missing <= 1, "replica {replica} lacks {missing} rows it was not sent");
        }
        assert_eq!(queued, 4000);
    }

    /// A peer that answers every Snapshot with one chunk of dedupe windows, whatever the
    /// cursor asked for.
    struct StuckPeer {
        chunk: Vec<u8>,
        windows: u32,
    }

    impl bex_rpc::Handler for StuckPeer {
        async fn handle(
            &self,
            _method: u16,
            _body: bex_transport::Msg,
        ) -> Result<bex_transport::Msg, bex_rpc::RpcError> {
            let pool = crate::server::test_server::test_pool();
            let len = wire::RESPONSE_HEADER_LEN + self.chunk.len();
            let mut m = bex_rpc::alloc_frame(pool, len)?;
            let buf = &mut m.as_mut_slice()[bex_rpc::HEADER_LEN..];
            let (_, body) =
                wire::begin_body_response(buf, Op::Snapshot, 1, self.windows, self.chunk.len())
                    .map_err(|e| bex_rpc::RpcError::Protocol(e.to_string()))?;
            body.copy_from_slice(&self.chunk);
            Ok(m)
        }
    }

    /// A client of a [`StuckPeer`] answering `chunk` (its transports are kept alive).
    async fn stuck_peer(
        chunk: Vec<u8>,
        windows: u32,
    ) -> (Client, [bex_transport::TcpTransport; 2]) {
        let pool = crate::server::test_server::test_pool();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server =
            bex_transport::TcpTransport::start(pool, any, Default::default()).await.unwrap();
        let handler = Arc::new(StuckPeer { chunk, windows });
        tokio::spawn(serve(server.clone().into(), handler, Arc::new(ServerStats::default())));
        let tcp = bex_transport::TcpTransport::start(pool, any, Default::default()).await.unwrap();
        let at = server.local_addr();
        let client = Client::new(
            None,
            tcp.clone().into(),
            vec![Endpoint::at(1, at, at)],
            Default::default(),
        );
        (client, [server, tcp])
    }

    // A peer whose snapshot never moves its cursor on (or sends windows without end) made the
    // copy loop for good, collecting windows; now the copy fails and says why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_from_a_peer_whose_snapshot_does_not_move_on_fails() {
        let cfg = Config::from_toml_str(
            "[cluster]\npods = 2\nshards = 1\n[[tables]]\nname = \"a\"\ndim = 4\n",
        )
        .unwrap();
        let tables = TableSet::new(cfg.table_specs()).unwrap();
        let windows: Vec<WindowState> =
            (1..=3).map(|client| WindowState { client, high: 5, bits: vec![0; 2] }).collect();
        // One window a chunk: the first names client 2 as the next cursor.
        let mut chunk = Vec::new();
        let first = SnapshotCursor { table: u32::MAX, ..SnapshotCursor::START };
        checkpoint::snapshot_chunk(&tables, first, 1, || windows.clone(), &mut chunk).unwrap();
        let (client, _alive) = stuck_peer(chunk, 1).await;
        // Bounded, so a copy that loops fails the test instead of hanging it.
        let mut ignore = |_, _| {};
        let copy = copy_shard(&client, 0, &tables, (1 << 20, 100), &mut ignore);
        let err = tokio::time::timeout(Duration::from_secs(10), copy).await.expect("the copy ends");
        let err = err.unwrap_err();
        assert!(
            matches!(&err, CopyError::Malformed(why) if why.contains("did not move on")),
            "{err}"
        );
        // The same peer, but the copy's bound on windows is reached first.
        let err = copy_shard(&client, 0, &tables, (1 << 20, 0), &mut |_, _| {}).await;
        assert!(err.unwrap_err().to_string().contains("more than 0 dedupe windows"));
    }
}
