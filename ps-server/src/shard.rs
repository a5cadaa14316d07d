//! One shard's server assembled from its two transports: the replication client, the
//! [`PsServer`], a replica's bootstrap from the training pod, a training shard's catch-up
//! from its replicas, and RPC service on both transports. `ps-server` runs it over real transports; the simulation (`sim/cluster`) runs
//! the same code over simulated NICs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bex_ps_core::checkpoint;
use bex_ps_core::dedupe::{DedupeConfig, WindowState};
use bex_ps_core::TableSet;
use bex_ps_proto::config::PushAck;
use bex_ps_proto::control::{ServingState, SnapshotCursor, SnapshotRequest};
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

/// Versions of a peer's rows by (table, key), as a snapshot showed them.
pub type RowVersions = HashMap<(u32, u64), u64>;

/// Copies the rows of this shard from the server at endpoint `peer` of `client` into
/// `tables` in chunks of at most `chunk_bytes`, each row only over an older one; with
/// `versions`, records every row's version there. The peer's dedupe windows are asked for
/// first: a window read before the rows names only pushes whose rows are already there
/// (read after, it could name a push whose rows the copy missed, and that push's retry
/// would be answered Duplicate and lost).
pub async fn copy_shard(
    client: &Client,
    peer: usize,
    tables: &TableSet,
    chunk_bytes: u32,
    mut versions: Option<&mut RowVersions>,
) -> Result<Copied, String> {
    let mut cursor = SnapshotCursor { table: u32::MAX, ..SnapshotCursor::START };
    let mut out = Copied::default();
    for seq in 1.. {
        let req = SnapshotRequest { cursor, max_bytes: chunk_bytes };
        let frame =
            wire::control_request_vec(Op::Snapshot, 0, 0, seq, &req).map_err(|e| e.to_string())?;
        let m =
            client.call(&[peer], Op::Snapshot as u16, &frame).await.map_err(|e| e.to_string())?;
        let r =
            wire::decode_response(m.as_slice(), &Limits::default()).map_err(|e| e.to_string())?;
        if !r.header.status.is_success() {
            return Err(r.message().into_owned());
        }
        let mut seen = |t: u32, k: u64, v: u64| {
            if let Some(m) = versions.as_deref_mut() {
                m.insert((t, k), v);
            }
        };
        let info = checkpoint::apply_snapshot_chunk(tables, r.body, &mut seen)
            .map_err(|e| e.to_string())?;
        out.rows += u64::from(info.rows);
        let windows_chunk = info.is_windows();
        out.windows.extend(info.windows);
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

/// [`copy_shard`] retried with backoff until it succeeds or `deadline` passes (each
/// failure logged).
async fn copy_with_retries(
    (client, peer): (&Client, usize),
    tables: &TableSet,
    chunk_bytes: u32,
    mut versions: Option<&mut RowVersions>,
    (deadline, what): (Option<Duration>, &str),
) -> Option<Copied> {
    // The deadline stops new attempts, never one under way (see BOOTSTRAP_DEADLINE).
    let give_up_at = deadline.map(|d| crate::clock::now() + d);
    let mut backoff = Duration::from_millis(100);
    let mut attempt = 1u32;
    loop {
        if let Some(v) = versions.as_deref_mut() {
            v.clear();
        }
        match copy_shard(client, peer, tables, chunk_bytes, versions.as_deref_mut()).await {
            Ok(c) => return Some(c),
            Err(e) => tracing::warn!(attempt, error = %e, "{what} failed; retrying"),
        }
        if give_up_at.is_some_and(|t| crate::clock::now() + backoff >= t) {
            return None;
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
/// returned ones). Progress is logged (info).
pub async fn start_shard(
    cfg: &Config,
    topo: &Topology,
    start: ShardStart,
    (rdma, tcp): (Transport, Transport),
) -> RunningShard {
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
        Some((repl_client, target_pods)),
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
            // Replicated: a replica holds every acknowledged push, so the shard waits for
            // each replica however long; applied: it goes on without one after a while.
            let deadline = (cfg.server.push_ack == PushAck::Applied).then_some(CATCH_UP_DEADLINE);
            tasks.push(tokio::spawn(async move {
                catch_up(&s, &peers, chunk, deadline).await;
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
            match copy_with_retries((&peer, 0), server.tables(), chunk, None, deadline).await {
                Some(c) => {
                    server.merge_dedupe(&c.windows);
                    tracing::info!(rows = c.rows, restored, "bootstrapped from the training pod");
                }
                None => {
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
    RunningShard { server, stats, tasks }
}

/// A training shard's start: copies every replica's rows (each applied over older rows
/// only) and dedupe windows, so it holds at least the freshest replica's state and knows
/// which pushes that state holds; then queues for each replica the rows it lacks, and
/// raises the version floor above every version seen.
async fn catch_up(server: &Arc<PsServer>, peers: &Client, chunk: u32, deadline: Option<Duration>) {
    let mut theirs = Vec::new();
    for target in 0..server.replica_count() {
        let mut versions = RowVersions::new();
        let what = format!("catch-up from replica {target}");
        let t0 = crate::clock::now();
        let got = copy_with_retries(
            (peers, target),
            server.tables(),
            chunk,
            Some(&mut versions),
            (deadline, &what),
        )
        .await;
        match &got {
            Some(c) => {
                server.merge_dedupe(&c.windows);
                let ms = crate::clock::now().duration_since(t0).as_millis() as u64;
                let windows = c.windows.len();
                tracing::info!(rows = c.rows, windows, ms, "{what}: done");
            }
            None => tracing::warn!(?deadline, "{what}: unreachable; going on"),
        }
        theirs.push(got.map(|_| versions));
    }
    for (target, versions) in theirs.iter().enumerate() {
        let queued = server.queue_rows_newer_than(target, versions.as_ref());
        if queued > 0 {
            tracing::info!(queued, replica = target, "queued the rows the replica lacks");
        }
    }
    let tables = server.tables();
    tables.raise_version_floor(tables.max_version().saturating_add(1));
}
