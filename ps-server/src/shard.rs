//! One shard's server assembled from its two transports: the replication client, the
//! [`PsServer`], a replica's bootstrap from the training pod, and RPC service on both
//! transports. `ps-server` runs it over real transports; the simulation (`sim/cluster`) runs
//! the same code over simulated NICs.

use std::sync::Arc;
use std::time::Duration;

use bex_ps_core::checkpoint;
use bex_ps_core::control::{ServingState, SnapshotCursor, SnapshotRequest};
use bex_ps_core::dedupe::DedupeConfig;
use bex_ps_core::topology::Topology;
use bex_ps_core::wire::{self, Limits, Op};
use bex_ps_core::{Config, TableSet};
use bex_rpc::{serve, Client, ClientConfig, Endpoint, ServerStats};
use bex_transport::Transport;
use tokio::task::JoinHandle;

use crate::node::{client_config, ClientRole};
use crate::server::{Handler, PsServer, ServerParts};

/// How long a fresh replica keeps trying to copy its shard from the training pod before it
/// serves without it (its rows would then be initial values until pushes replace them, so
/// it tries hard).
pub const BOOTSTRAP_DEADLINE: Duration = Duration::from_secs(60);
/// The deadline of one snapshot chunk: a 1 MiB chunk from a busy training server takes far
/// longer than a serving request's `Tr` (a 40 ms deadline made restarted replicas start
/// empty under load, found by the chaos run).
const SNAPSHOT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Copies the training pod's rows of this shard into `tables` (a fresh replica) in chunks of
/// at most `chunk_bytes`; returns the number of rows.
pub async fn bootstrap(
    client: &Client,
    tables: &TableSet,
    chunk_bytes: u32,
) -> Result<u64, String> {
    let mut cursor = SnapshotCursor::START;
    let mut rows = 0u64;
    for seq in 1.. {
        let req = SnapshotRequest { cursor, max_bytes: chunk_bytes };
        let frame =
            wire::control_request_vec(Op::Snapshot, 0, 0, seq, &req).map_err(|e| e.to_string())?;
        let m = client.call(&[0], Op::Snapshot as u16, &frame).await.map_err(|e| e.to_string())?;
        let r =
            wire::decode_response(m.as_slice(), &Limits::default()).map_err(|e| e.to_string())?;
        if !r.header.status.is_success() {
            return Err(r.message().into_owned());
        }
        let info = checkpoint::apply_snapshot_chunk(tables, r.body).map_err(|e| e.to_string())?;
        rows += u64::from(info.rows);
        match info.next {
            Some(c) => cursor = c,
            None => break,
        }
    }
    Ok(rows)
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
    /// [`crate::process::incarnation_id`].
    pub incarnation: u64,
}

/// A serving shard.
#[derive(Debug)]
pub struct RunningShard {
    /// The server.
    pub server: Arc<PsServer>,
    /// Requests served, errors, malformed frames.
    pub stats: Arc<ServerStats>,
    /// The RPC service tasks (one per transport); aborting them stops serving.
    pub tasks: Vec<JoinHandle<()>>,
}

/// Builds the shard's server on `rdma` and `tcp` (which share one pool), bootstraps a fresh
/// replica from the training pod (reporting through `log`), and serves RPC on both.
pub async fn start_shard(
    cfg: &Config,
    topo: &Topology,
    start: ShardStart,
    (rdma, tcp): (Transport, Transport),
    log: impl Fn(&str),
) -> RunningShard {
    let ShardStart { pod, shard, tables, update_seq, dedupe_windows, restored, incarnation } =
        start;
    let ccfg =
        client_config(&cfg.rpc, pod, u64::from(pod) << 32 | u64::from(shard), ClientRole::Serving);
    // The training pod forwards to the same shard in every other pod.
    let targets: Vec<Endpoint> = (0..topo.pods())
        .filter(|&p| p != pod)
        .filter_map(|p| {
            topo.server(p, shard).map(|a| Endpoint { pod: p, rdma: a.rdma, tcp: a.tcp })
        })
        .collect();
    let n_targets = targets.len();
    let repl_client = Arc::new(
        Client::new(Some(rdma.clone()), tcp.clone(), targets, ccfg.clone())
            .with_unwell_replies(crate::client::unwell_reply),
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
            dedupe: DedupeConfig {
                window: cfg.server.dedupe_window,
                max_clients: cfg.server.dedupe_max_clients,
            },
            pool: rdma.pool(),
            checkpoint_path: cfg.checkpoint_path(pod, shard),
            update_seq,
            dedupe_windows,
            replication_id: incarnation,
        },
        topo,
        Some((repl_client, n_targets)),
        cfg.server.replication_batch_keys as usize,
    );
    let training = topo.server(topo.training_pod(), shard).copied();
    if let (false, true, false, Some(a)) =
        (restored, cfg.server.bootstrap_from_peer, topo.is_training(pod), training)
    {
        server.set_state(ServingState::Bootstrapping);
        let bcfg = ClientConfig {
            request_timeout: ccfg.request_timeout.max(SNAPSHOT_REQUEST_TIMEOUT),
            connect_timeout: ccfg.connect_timeout.max(Duration::from_secs(1)),
            retry_probability: 1.0,
            ..ccfg
        };
        let peer = Client::new(
            Some(rdma.clone()),
            tcp.clone(),
            vec![Endpoint { pod: topo.training_pod(), rdma: a.rdma, tcp: a.tcp }],
            bcfg,
        );
        let chunk = cfg.server.snapshot_chunk_bytes;
        let attempts = async {
            let mut backoff = Duration::from_millis(100);
            let mut attempt = 1u32;
            loop {
                match bootstrap(&peer, server.tables(), chunk).await {
                    Ok(rows) => return rows,
                    Err(e) => log(&format!("bootstrap attempt {attempt} failed ({e}); retrying")),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                attempt += 1;
            }
        };
        match tokio::time::timeout(BOOTSTRAP_DEADLINE, attempts).await {
            Ok(rows) => log(&format!("bootstrapped {rows} rows from the training pod")),
            Err(_) => log(&format!(
                "no bootstrap from the training pod within {BOOTSTRAP_DEADLINE:?}; serving without it"
            )),
        }
    }
    let stats = Arc::new(ServerStats::default());
    let handler = Arc::new(Handler(server.clone()));
    let tasks = vec![
        tokio::spawn(serve(rdma, handler.clone(), stats.clone())),
        tokio::spawn(serve(tcp, handler, stats.clone())),
    ];
    RunningShard { server, stats, tasks }
}
