//! One parameter-server process: one shard of one mini-pod. Requests arrive as ps-core frames
//! inside RPC frames (the RPC method is the ps-core op); bad input gets a ps-core error
//! response with a status and a counter, and the server keeps serving.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::Pool;
use bex_ps_core::checkpoint::{self, CheckpointMeta};
use bex_ps_core::control::{
    AdminRequest, AdminResponse, CheckpointRequest, CheckpointSummary, HealthInfo,
    ReplicationStatus, Role, ServingState, SnapshotRequest, TablesInfo,
};
use bex_ps_core::dedupe::{Dedupe, DedupeConfig, Verdict};
use bex_ps_core::metrics::{Counter, Registry};
use bex_ps_core::wire::{self, DataHeader, Limits, Op, RequestView, Status};
use bex_ps_core::{TableSet, Topology};
use bex_rpc::{alloc_frame, Client, RpcError, HEADER_LEN};
use bex_transport::Msg;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

/// Rows applied on the training pod, to forward to the other pods.
#[derive(Debug)]
pub struct Batch {
    table: u32,
    dim: u32,
    keys: Vec<u64>,
    rows: Vec<f32>,
    applied_at: Instant,
}

/// The server's counters (also rendered on `/metrics`).
#[derive(Debug)]
pub struct Metrics {
    /// Prometheus registry.
    pub registry: Registry,
    requests: HashMap<Op, Counter>,
    errors: HashMap<Status, Counter>,
    fetched_keys: Counter,
    pushed_keys: Counter,
    duplicates: Counter,
    replicated_batches: Counter,
    replication_dropped: Counter,
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let requests = Op::ALL
            .into_iter()
            .map(|op| {
                let c = registry.counter(
                    "bex_ps_requests_total",
                    "Requests by op",
                    &[("op", op.name())],
                );
                (op, c.expect("metric names are static and valid"))
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
            requests,
            errors,
            fetched_keys: registry
                .counter("bex_ps_fetched_keys_total", "Keys fetched", &[])
                .expect("static metric"),
            pushed_keys: registry
                .counter("bex_ps_pushed_keys_total", "Gradient rows applied", &[])
                .expect("static metric"),
            duplicates: registry
                .counter(
                    "bex_ps_duplicate_pushes_total",
                    "Pushes and replications recognised as retries",
                    &[],
                )
                .expect("static metric"),
            replicated_batches: registry
                .counter(
                    "bex_ps_replicated_batches_total",
                    "Batches forwarded to replicas and acknowledged",
                    &[],
                )
                .expect("static metric"),
            replication_dropped: registry
                .counter(
                    "bex_ps_replication_dropped_total",
                    "Batches dropped because a replica's queue was full",
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
    repl: Vec<mpsc::Sender<Arc<Batch>>>,
    /// Held from applying a push to queueing its rows for the replicas, so concurrent pushes
    /// of one key reach the replicas in the order they were applied (found by the chaos
    /// verifier: without it replicas kept a stale row whenever two pushes raced).
    repl_order: Mutex<()>,
    repl_lag: Arc<ReplLag>,
    checkpoint_path: PathBuf,
    last_checkpoint: Mutex<Option<CheckpointSummary>>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Notified by an admin Shutdown request.
    pub shutdown: Arc<Notify>,
    /// The RDMA transport, for the SetRdma admin drill.
    rdma: Mutex<Option<bex_transport::RdmaTransport>>,
}

impl std::fmt::Debug for PsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsServer").field("pod", &self.pod).field("shard", &self.shard).finish()
    }
}

/// Replication progress towards the other pods.
#[derive(Debug, Default)]
pub struct ReplLag {
    /// Batches queued and not yet acknowledged (all targets).
    pending: AtomicU64,
    /// Sequence of the last acknowledged batch.
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
}

impl PsServer {
    /// A server; on the training pod, `replicas` (a client whose endpoint `i` is target `i`,
    /// and the number of targets) starts one forwarding task per target.
    pub fn new(
        parts: ServerParts,
        topology: &Topology,
        replicas: Option<(Arc<Client>, usize)>,
        (queue_batches, batch_keys): (usize, usize),
    ) -> Arc<PsServer> {
        let role = if topology.is_training(parts.pod) { Role::Training } else { Role::Replica };
        let metrics = Arc::new(Metrics::new());
        let repl_lag = Arc::new(ReplLag::default());
        let mut repl = Vec::new();
        if let (Role::Training, Some((client, n))) = (role, replicas) {
            for target in 0..n {
                let (tx, rx) = mpsc::channel(queue_batches.max(1));
                repl.push(tx);
                let me = u64::from(parts.pod) << 32 | u64::from(parts.shard);
                tokio::spawn(forward(
                    client.clone(),
                    target,
                    rx,
                    me,
                    repl_lag.clone(),
                    metrics.clone(),
                    batch_keys.max(1),
                ));
            }
        }
        Arc::new(PsServer {
            pod: parts.pod,
            shard: parts.shard,
            shards: topology.shards(),
            role,
            tables: Arc::new(parts.tables),
            dedupe: Dedupe::new(parts.dedupe),
            limits: parts.limits,
            pool: parts.pool,
            state: AtomicU8::new(3),
            started: crate::clock::now(),
            update_seq: AtomicU64::new(parts.update_seq),
            read_only: AtomicBool::new(false),
            repl,
            repl_order: Mutex::new(()),
            repl_lag,
            checkpoint_path: parts.checkpoint_path,
            last_checkpoint: Mutex::new(None),
            metrics,
            shutdown: Arc::new(Notify::new()),
            rdma: Mutex::new(None),
        })
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
                lag_batches: lag.pending.load(Ordering::Relaxed),
                lag_ms: lag.last_lag_ms.load(Ordering::Relaxed),
            },
            last_checkpoint: self.last_checkpoint.lock().clone(),
        }
    }

    /// Writes a checkpoint now (atomic: temp file, fsync, rename, checksum).
    pub async fn checkpoint(self: &Arc<Self>) -> Result<CheckpointSummary, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let meta = CheckpointMeta {
                shard: me.shard,
                shards: me.shards,
                update_seq: me.update_seq.load(Ordering::Acquire),
                created_ms: crate::clock::unix_ms(),
            };
            let info = checkpoint::write_checkpoint(&me.checkpoint_path, &me.tables, &meta)
                .map_err(|e| e.to_string())?;
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

    async fn handle_request(self: &Arc<Self>, op: Op, v: RequestView<'_>) -> Result<Msg, RpcError> {
        let h = v.header;
        let seq = h.seq;
        let table = |id: u32| self.tables.get(id);
        match op {
            Op::Fetch => {
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
                let Some(len) =
                    wire::fetch_response_len(h.count as usize, h.dim as usize).filter(|&len| {
                        len <= self.limits.max_frame_bytes
                            && u32::try_from(len - wire::RESPONSE_HEADER_LEN).is_ok()
                    })
                else {
                    return self.error(
                        Some(op),
                        Status::TooLarge,
                        seq,
                        "response would exceed the frame limit",
                    );
                };
                // Rows go straight into the registered reply buffer.
                let mut m = alloc_frame(self.pool, len)?;
                let (_, rows) = wire::begin_fetch_response(
                    &mut m.as_mut_slice()[HEADER_LEN..],
                    seq,
                    h.count,
                    h.dim,
                )
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
            Op::Push | Op::Replicate => {
                if op == Op::Push && self.role != Role::Training {
                    return self.error(
                        Some(op),
                        Status::NotTraining,
                        seq,
                        "only the training pod applies pushes",
                    );
                }
                if self.read_only.load(Ordering::Acquire) {
                    return self.error(Some(op), Status::Unavailable, seq, "read-only");
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
                match self.dedupe.admit(h.client, seq) {
                    Verdict::New => {}
                    Verdict::Duplicate => {
                        self.metrics.duplicates.inc();
                        return self.status(op, Status::Duplicate, seq, h.count);
                    }
                    Verdict::TooOld => {
                        return self.error(
                            Some(op),
                            Status::TooOld,
                            seq,
                            "sequence older than the dedupe window",
                        );
                    }
                }
                if op == Op::Replicate {
                    return match t.apply_replica_le(v.keys, v.values) {
                        Ok(n) => {
                            self.update_seq.fetch_add(1, Ordering::AcqRel);
                            self.status(op, Status::Ok, seq, n as u32)
                        }
                        Err(e) => self.error(Some(op), Status::BadValue, seq, &e.to_string()),
                    };
                }
                let mut updated = vec![0f32; h.count as usize * h.dim as usize];
                let _order = (!self.repl.is_empty()).then(|| self.repl_order.lock());
                match t.push_le(v.keys, v.values, Some(&mut updated)) {
                    Ok(n) => {
                        self.update_seq.fetch_add(1, Ordering::AcqRel);
                        self.metrics.pushed_keys.add(n as u64);
                        if !self.repl.is_empty() {
                            let batch = Arc::new(Batch {
                                table: h.table,
                                dim: h.dim,
                                keys: v.keys.to_vec(),
                                rows: updated,
                                applied_at: crate::clock::now(),
                            });
                            for tx in &self.repl {
                                self.repl_lag.pending.fetch_add(1, Ordering::Relaxed);
                                if tx.try_send(batch.clone()).is_err() {
                                    // The replica is far behind (or gone): count it; it
                                    // catches up by bootstrapping from a peer on restart.
                                    self.repl_lag.pending.fetch_sub(1, Ordering::Relaxed);
                                    self.metrics.replication_dropped.inc();
                                }
                            }
                        }
                        self.status(op, Status::Ok, seq, n as u32)
                    }
                    Err(e) => self.error(Some(op), Status::BadValue, seq, &e.to_string()),
                }
            }
            Op::Tables => self.control(op, seq, &TablesInfo { tables: self.tables.infos() }),
            Op::Health => self.control(op, seq, &self.health()),
            Op::Checkpoint => {
                let _req: CheckpointRequest = v.control().unwrap_or_default();
                match self.checkpoint().await {
                    Ok(s) => self.control(op, seq, &s),
                    Err(e) => self.error(Some(op), Status::Internal, seq, &e),
                }
            }
            Op::Snapshot => {
                let req: SnapshotRequest = match v.control() {
                    Ok(r) => r,
                    Err(e) => return self.error(Some(op), Status::BadControl, seq, &e.to_string()),
                };
                let mut chunk = Vec::new();
                let max = (req.max_bytes as usize).clamp(4096, 16 << 20);
                match checkpoint::snapshot_chunk(&self.tables, req.cursor, max, &mut chunk) {
                    Ok(rows) => {
                        let mut m =
                            alloc_frame(self.pool, wire::RESPONSE_HEADER_LEN + chunk.len())?;
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
            Op::Admin => {
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
                        self.dedupe.clear();
                        "dedupe state cleared".into()
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
        if let Some(c) = s.metrics.requests.get(&op) {
            c.inc();
        }
        match wire::decode_request(body.as_slice(), &s.limits) {
            Ok(v) if v.header.op == op => s.handle_request(op, v).await,
            Ok(v) => s.error(
                Some(op),
                Status::BadFrame,
                v.header.seq,
                "frame op differs from the RPC method",
            ),
            Err(e) => s.error(Some(op), e.status(), 0, &e.to_string()),
        }
    }
}

/// Rows of one table, merged from consecutive batches: the latest row of each key wins (the
/// queue is in apply order), so a burst of pushes costs one Replicate per table.
#[derive(Debug)]
struct Coalesced {
    table: u32,
    dim: u32,
    keys: Vec<u64>,
    rows: Vec<f32>,
    index: std::collections::HashMap<u64, usize>,
}

impl Coalesced {
    fn add(&mut self, b: &Batch) {
        let d = self.dim as usize;
        for (i, &k) in b.keys.iter().enumerate() {
            let row = &b.rows[i * d..(i + 1) * d];
            match self.index.get(&k) {
                Some(&at) => self.rows[at * d..(at + 1) * d].copy_from_slice(row),
                None => {
                    self.index.insert(k, self.keys.len());
                    self.keys.push(k);
                    self.rows.extend_from_slice(row);
                }
            }
        }
    }
}

/// Merges `batches` (in apply order) into one request per (table, dim).
fn coalesce(batches: &[Arc<Batch>]) -> Vec<Coalesced> {
    let mut out: Vec<Coalesced> = Vec::new();
    for b in batches {
        let i = match out.iter().position(|c| c.table == b.table && c.dim == b.dim) {
            Some(i) => i,
            None => {
                out.push(Coalesced {
                    table: b.table,
                    dim: b.dim,
                    keys: Vec::new(),
                    rows: Vec::new(),
                    index: Default::default(),
                });
                out.len() - 1
            }
        };
        out[i].add(b);
    }
    out
}

/// Forwards applied rows to one replica, in order, retrying until acknowledged. Whatever
/// queued up while a request was in flight (up to `batch_keys` keys) goes out as one request
/// per table: one round trip per push could not keep up with the trainers, the queue filled
/// and dropped batches left replicas stale for good (found by the chaos verifier).
async fn forward(
    client: Arc<Client>,
    target: usize,
    mut rx: mpsc::Receiver<Arc<Batch>>,
    me: u64,
    lag: Arc<ReplLag>,
    metrics: Arc<Metrics>,
    batch_keys: usize,
) {
    let mut seq = 0u64;
    while let Some(first) = rx.recv().await {
        let mut keys = first.keys.len();
        let mut taken = vec![first];
        while keys < batch_keys {
            match rx.try_recv() {
                Ok(b) => {
                    keys += b.keys.len();
                    taken.push(b);
                }
                Err(_) => break,
            }
        }
        for c in coalesce(&taken) {
            seq += 1;
            let h = DataHeader { table: c.table, dim: c.dim, client: me, seq, flags: 0 };
            let len = wire::REQUEST_HEADER_LEN + c.keys.len() * (8 + 4 * c.dim as usize);
            let mut buf = vec![0u8; len];
            let n = match wire::encode_replicate_into(&mut buf, &h, &c.keys, &c.rows) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(%e, "cannot encode a replication batch");
                    continue;
                }
            };
            let mut backoff = Duration::from_millis(5);
            loop {
                match client.call(&[target], Op::Replicate as u16, &buf[..n]).await {
                    Ok(m) => match wire::decode_response(m.as_slice(), &Limits::default()) {
                        Ok(r) if r.header.status.is_success() => break,
                        Ok(r) => {
                            tracing::warn!(status = r.header.status.name(), "replication refused")
                        }
                        Err(e) => tracing::warn!(%e, "bad replication reply"),
                    },
                    Err(e) => tracing::debug!(%e, target, "replication failed; retrying"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
        lag.pending.fetch_sub(taken.len() as u64, Ordering::Relaxed);
        lag.acked_seq.store(seq, Ordering::Relaxed);
        let oldest = taken[0].applied_at;
        let ms = crate::clock::now().duration_since(oldest).as_millis() as u64;
        lag.last_lag_ms.store(ms, Ordering::Relaxed);
        metrics.replicated_batches.add(taken.len() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesced_replication_keeps_the_latest_row_of_each_key_per_table() {
        let b = |table: u32, keys: &[u64], v: f32| {
            Arc::new(Batch {
                table,
                dim: 2,
                keys: keys.to_vec(),
                rows: keys.iter().flat_map(|&k| [v, k as f32]).collect(),
                applied_at: crate::clock::now(),
            })
        };
        let merged = coalesce(&[b(0, &[1, 2], 1.0), b(1, &[1], 5.0), b(0, &[2, 3], 2.0)]);
        assert_eq!(merged.len(), 2);
        assert_eq!((merged[0].table, &merged[0].keys[..]), (0, &[1, 2, 3][..]));
        assert_eq!(merged[0].rows, vec![1.0, 1.0, 2.0, 2.0, 2.0, 3.0]);
        assert_eq!((merged[1].table, &merged[1].rows[..]), (1, &[5.0, 1.0][..]));
    }
    use bex_ps_core::Config;
    use bex_rnic::soft::{Fabric, LinkModel, NicConfig};
    use bex_rnic::Device;
    use bex_rpc::Handler as _;

    fn server(max_frame_bytes: usize) -> Arc<PsServer> {
        let cfg = Config::from_toml_str(
            "[cluster]\npods = 1\nshards = 1\n[[tables]]\nname = \"t\"\ndim = 32\n",
        )
        .unwrap();
        let dev = Fabric::new(1, LinkModel::default()).add_device(NicConfig::default());
        let pd = dev.alloc_pd().unwrap();
        let pool = Pool::new(vec![Arc::new(dev.registrar(&pd))]).unwrap().leak();
        PsServer::new(
            ServerParts {
                pod: 0,
                shard: 0,
                tables: TableSet::new(cfg.table_specs()).unwrap(),
                limits: Limits { max_frame_bytes, ..Limits::default() },
                dedupe: DedupeConfig::default(),
                pool,
                checkpoint_path: PathBuf::from("/dev/null/none.ckpt"),
                update_seq: 0,
            },
            &cfg.topology().unwrap(),
            None,
            (1, 1),
        )
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
