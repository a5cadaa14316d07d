//! The fan-out client of the parameter server (rankers and trainers use it): a request's keys
//! are deduplicated and split by shard, one sub-request per shard goes out concurrently (to
//! a replica chosen by the RPC client — the caller's mini-pod first), and the rows are
//! merged back in request order. Pushes go to the training pod, each with a fresh sequence
//! number so a retried push is applied once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bex_ps_proto::metrics::{Counter, Histogram, MetricsError, Registry, LATENCY_BUCKETS_S};
use bex_ps_proto::wire::{self, DataHeader, Limits, Op, Status};
use bex_ps_proto::{FanoutPlan, Topology};
use bex_rpc::{alloc_frame, Client, Endpoint, RpcError, HEADER_LEN};
use bex_transport::Transport;

/// Why a PS call failed.
#[derive(Debug, thiserror::Error)]
pub enum PsError {
    /// The RPC failed (every replica, within deadlines and retries).
    #[error("rpc: {0}")]
    Rpc(#[from] RpcError),
    /// The server answered with an error status.
    #[error("server: {status:?}: {message}")]
    Server {
        /// Status.
        status: Status,
        /// Message.
        message: String,
    },
    /// A malformed reply or request.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The client's cluster file names tables the servers do not have under those ids (a
    /// stale or reordered file): its calls would read and update the wrong rows.
    #[error("cluster file does not match the servers: {0}")]
    Layout(String),
}

/// A table as a client's cluster file has it: (id, name, dim).
pub type ExpectedTable = (u32, String, u32);

/// A client of the whole sharded, replicated PS.
pub struct PsClient {
    rpc: Arc<Client>,
    topo: Topology,
    push_id: u64,
    /// The next push sequence number per shard: each training server's dedupe window
    /// (`dedupe_window` numbers) then spans pushes to that shard only. With one counter for
    /// all shards, a skewed workload moved a cold shard's window by the other shards' pushes,
    /// and a retry delayed past 1024 of them came back TooOld, maybe applied, maybe not.
    seqs: Box<[AtomicU64]>,
    limits: Limits,
    /// How long a failed push is retried (its sequence number kept: applied once).
    push_retry: std::time::Duration,
    push_retries: Counter,
    metrics: Option<CallMetrics>,
    /// The tables this client's cluster file names ([`PsClient::with_tables`]), checked
    /// against the servers' before the first data call.
    expected: Option<Vec<ExpectedTable>>,
    layout_checked: tokio::sync::OnceCell<()>,
}

/// Whole fan-out calls, as the application sees them ([`PsClient::with_metrics`]).
struct CallMetrics {
    fetch: Histogram,
    push: Histogram,
    fetch_failures: Counter,
    push_failures: Counter,
}

/// First pause between retries of a failed push; it doubles up to [`PUSH_BACKOFF_MAX`].
const PUSH_BACKOFF: std::time::Duration = std::time::Duration::from_millis(5);
const PUSH_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_millis(500);

impl std::fmt::Debug for PsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsClient").field("push_id", &self.push_id).finish()
    }
}

/// Endpoint index of (pod, shard) in the client's list.
fn index(topo: &Topology, pod: u32, shard: u32) -> usize {
    (pod * topo.shards() + shard) as usize
}

/// What differs between the tables a client expects and those a server has, each as
/// (id, name, dim); `None` when every expected table is there as expected (the servers may
/// have more).
fn layout_mismatch(want: &[ExpectedTable], have: &[ExpectedTable]) -> Option<String> {
    let wrong: Vec<String> = want
        .iter()
        .filter(|w| !have.contains(w))
        .map(|(id, name, dim)| {
            let theirs = have.iter().find(|h| h.0 == *id);
            let theirs = theirs.map_or("no such id".into(), |h| format!("{:?} dim {}", h.1, h.2));
            format!("table {id} is {name:?} dim {dim} here, {theirs} on the servers")
        })
        .collect();
    (!wrong.is_empty()).then(|| wrong.join("; "))
}

/// Every server as an RPC endpoint, in (pod, shard) order.
pub fn endpoints(topo: &Topology) -> Vec<Endpoint> {
    let mut v = Vec::new();
    for pod in 0..topo.pods() {
        for shard in 0..topo.shards() {
            let a = topo.server(pod, shard).expect("topology covers every (pod, shard)");
            v.push(Endpoint { pod, rdma: a.rdma, tcp: a.tcp, host: a.host.clone() });
        }
    }
    v
}

impl PsClient {
    /// A client over `rdma` (None: TCP only) and `tcp`; `push_id` scopes push sequence
    /// numbers, which start at 1: it must be unique per client process incarnation (a real
    /// process takes [`bex_process::incarnation_id`]).
    pub fn new(
        rdma: Option<Transport>,
        tcp: Transport,
        topo: Topology,
        cfg: bex_rpc::ClientConfig,
        push_id: u64,
    ) -> PsClient {
        let rpc = Client::new(rdma, tcp, endpoints(&topo), cfg).with_unwell_replies(unwell_reply);
        PsClient {
            rpc: Arc::new(rpc),
            seqs: (0..topo.shards()).map(|_| AtomicU64::new(1)).collect(),
            topo,
            push_id,
            limits: Limits::default(),
            push_retry: std::time::Duration::ZERO,
            push_retries: Counter::default(),
            metrics: None,
            expected: None,
            layout_checked: tokio::sync::OnceCell::new(),
        }
    }

    /// Decodes replies under `limits` (the cluster file's, [`Config::limits`]): under the
    /// defaults, a Fetch reply of more keys than 1 Mi was refused from servers configured for
    /// more.
    ///
    /// [`Config::limits`]: bex_ps_proto::config::Config::limits
    pub fn with_limits(mut self, limits: Limits) -> PsClient {
        self.limits = limits;
        self
    }

    /// Checks, before the first fetch or push, that the servers have these tables under
    /// these ids, names and dims. The servers check only a request's id and dim: a file
    /// whose tables of one dim stand in another order read and pushed the wrong table.
    pub fn with_tables(mut self, tables: Vec<ExpectedTable>) -> PsClient {
        self.expected = Some(tables);
        self
    }

    /// The check of [`with_tables`](Self::with_tables): asked of any server (every server
    /// holds every table) until one answers. A mismatch fails the call (and every later one); a cluster that does not
    /// answer lets the call go on, to fail or be retried as it would, and is asked again.
    async fn check_layout(&self) -> Result<(), PsError> {
        match self.ask_layout().await {
            Err(e @ PsError::Layout(_)) => Err(e),
            _ => Ok(()),
        }
    }

    async fn ask_layout(&self) -> Result<(), PsError> {
        let Some(want) = &self.expected else { return Ok(()) };
        self.layout_checked
            .get_or_try_init(|| async {
                let frame = wire::control_request_vec(Op::Tables, 0, self.push_id, 0, &())
                    .map_err(|e| PsError::Protocol(e.to_string()))?;
                let mut m = self.frame(frame.len())?;
                m.as_mut_slice()[HEADER_LEN..].copy_from_slice(&frame);
                // Any server: with only shard 0's asked, calls while every copy of it was down
                // each waited out the check first.
                let every: Vec<usize> =
                    (0..self.topo.pods() * self.topo.shards()).map(|i| i as usize).collect();
                let reply = self.call_frame(&every, Op::Tables, m, None).await?;
                let info: bex_ps_proto::control::TablesInfo =
                    wire::decode_response(reply.as_slice(), &self.limits)
                        .and_then(|r| r.control())
                        .map_err(|e| PsError::Protocol(e.to_string()))?;
                if info.shards != self.topo.shards() {
                    return Err(PsError::Layout(format!(
                        "this client's cluster file has {} shards per pod, the servers {}",
                        self.topo.shards(),
                        info.shards
                    )));
                }
                let have: Vec<ExpectedTable> =
                    info.tables.iter().map(|t| (t.id, t.spec.name.clone(), t.spec.dim)).collect();
                layout_mismatch(want, &have).map_or(Ok(()), |why| Err(PsError::Layout(why)))
            })
            .await
            .map(|_| ())
    }

    /// Records every fetch and push in `reg`: `bex_client_request_duration_seconds{op}` (a
    /// whole fan-out call, retries included), `bex_client_failures_total{op}`,
    /// `bex_client_push_retries_total`, and the RPC client's series (`client="ps"`).
    pub fn with_metrics(mut self, reg: &Registry) -> Result<PsClient, MetricsError> {
        let duration = |op: Op| {
            reg.histogram(
                "bex_client_request_duration_seconds",
                "Whole PS calls (every shard's sub-request, retries included), by op",
                &[("op", op.name())],
                LATENCY_BUCKETS_S,
            )
        };
        let failures = |op: Op| {
            reg.counter(
                "bex_client_failures_total",
                "PS calls that returned an error, by op",
                &[("op", op.name())],
            )
        };
        self.metrics = Some(CallMetrics {
            fetch: duration(Op::Fetch)?,
            push: duration(Op::Push)?,
            fetch_failures: failures(Op::Fetch)?,
            push_failures: failures(Op::Push)?,
        });
        let retries = self.push_retries.clone();
        reg.counter_fn(
            "bex_client_push_retries_total",
            "Push sub-requests sent again after a failure that may pass",
            &[],
            move || retries.get() as f64,
        )?;
        crate::telemetry::register_rpc_client(reg, "ps", self.rpc.clone())?;
        Ok(self)
    }

    /// Runs `call` after the layout check, timing both into `op`'s histogram and counting a
    /// failure.
    async fn checked_and_observed(
        &self,
        op: Op,
        call: impl std::future::Future<Output = Result<(), PsError>>,
    ) -> Result<(), PsError> {
        let started = crate::clock::now();
        let r = match self.check_layout().await {
            Ok(()) => call.await,
            Err(e) => Err(e),
        };
        self.observe(op, started, r.is_ok());
        r
    }

    fn observe(&self, op: Op, started: std::time::Instant, ok: bool) {
        let Some(m) = &self.metrics else { return };
        let (h, f) = match op {
            Op::Push => (&m.push, &m.push_failures),
            _ => (&m.fetch, &m.fetch_failures),
        };
        h.observe(crate::clock::now().duration_since(started).as_secs_f64());
        if !ok {
            f.inc();
        }
    }

    /// Retries a push sub-request that failed for a reason that may pass (timeouts, lost
    /// connections, a server not serving yet) for up to `budget`, with the same sequence
    /// number, so the server applies it exactly once; other failures are returned at once.
    pub fn with_push_retry(mut self, budget: std::time::Duration) -> PsClient {
        self.push_retry = budget;
        self
    }

    /// Push sub-requests sent again after a failure (see [`PsClient::with_push_retry`]).
    pub fn push_retries(&self) -> u64 {
        self.push_retries.get()
    }

    /// The identity its push sequence numbers are scoped by.
    pub fn push_id(&self) -> u64 {
        self.push_id
    }

    /// The RPC client (counters, quarantine state).
    pub fn rpc(&self) -> &Arc<Client> {
        &self.rpc
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    fn replicas(&self, shard: u32) -> Vec<usize> {
        (0..self.topo.pods()).map(|p| index(&self.topo, p, shard)).collect()
    }

    /// One call with a request frame encoded in registered memory; the reply (its body a
    /// view of the registered receive buffer) once its status says success.
    async fn call_frame(
        &self,
        replicas: &[usize],
        op: Op,
        frame: bex_transport::Msg,
        reply_capacity: Option<usize>,
    ) -> Result<bex_transport::Msg, PsError> {
        let m = self.rpc.call_frame(replicas, op as u16, frame, reply_capacity).await?;
        let r = wire::decode_response(m.as_slice(), &self.limits)
            .map_err(|e| PsError::Protocol(e.to_string()))?;
        if !r.header.status.is_success() {
            return Err(PsError::Server {
                status: r.header.status,
                message: r.message().into_owned(),
            });
        }
        Ok(m)
    }

    /// A registered request frame of `len` protocol bytes (room for the RPC header first).
    fn frame(&self, len: usize) -> Result<bex_transport::Msg, PsError> {
        Ok(alloc_frame(self.rpc.pool(), len)?)
    }

    /// Rows of `keys` (with duplicates, in request order) from table `table` of `dim`.
    pub async fn fetch(&self, table: u32, dim: u32, keys: &[u64]) -> Result<Vec<f32>, PsError> {
        let mut out = vec![0f32; keys.len() * dim as usize];
        self.fetch_into(table, dim, keys, &mut out).await?;
        Ok(out)
    }

    /// [`PsClient::fetch`] into the caller's `keys.len() × dim` buffer. Each sub-request is
    /// encoded straight into a registered frame; the rows are merged from the response
    /// bodies (the registered receive buffers) straight into `out`: the one copy of a row
    /// on this side.
    pub async fn fetch_into(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        out: &mut [f32],
    ) -> Result<(), PsError> {
        self.checked_and_observed(Op::Fetch, self.fetch_fanout(table, dim, keys, out)).await
    }

    async fn fetch_fanout(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        out: &mut [f32],
    ) -> Result<(), PsError> {
        if out.len() != keys.len() * dim as usize {
            return Err(PsError::Protocol(format!(
                "output of {} values for {} keys of dimension {dim}",
                out.len(),
                keys.len()
            )));
        }
        let plan = FanoutPlan::new(keys, self.topo.shards());
        let h = DataHeader { table, dim, client: self.push_id, seq: 0, flags: 0 };
        // The sub-requests run concurrently within this task: a task per shard would cost
        // a task switch (or a thread wake-up) per sub-request.
        let replies = join_all(plan.parts().iter().map(|part| async move {
            let mut frame = self.frame(wire::fetch_request_len(part.keys.len()))?;
            wire::encode_fetch_into(&mut frame.as_mut_slice()[HEADER_LEN..], &h, &part.keys)
                .map_err(|e| PsError::Protocol(e.to_string()))?;
            // The reply is written straight into a buffer of its exact size (over RDMA).
            let rows = part.keys.len() * dim as usize * 4;
            let reply = HEADER_LEN + wire::RESPONSE_HEADER_LEN + rows;
            self.call_frame(&self.replicas(part.shard), Op::Fetch, frame, Some(reply)).await
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, PsError>>()?;
        let mut rows = Vec::with_capacity(replies.len());
        for m in &replies {
            let r = wire::decode_response(m.as_slice(), &self.limits)
                .map_err(|e| PsError::Protocol(e.to_string()))?;
            rows.push(r.rows());
        }
        plan.merge_le_into(dim as usize, &rows, out).map_err(|e| PsError::Protocol(e.to_string()))
    }

    /// Pushes gradients (`keys.len() × dim`, request order; duplicate keys' gradients are
    /// summed) to the training pod.
    pub async fn push(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> Result<(), PsError> {
        self.checked_and_observed(Op::Push, self.push_fanout(table, dim, keys, grads)).await
    }

    async fn push_fanout(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> Result<(), PsError> {
        let plan = FanoutPlan::new(keys, self.topo.shards());
        let per_part =
            plan.split_grads(dim as usize, grads).map_err(|e| PsError::Protocol(e.to_string()))?;
        let sends = plan.parts().iter().zip(per_part).map(|(part, g)| {
            let seq = self.seqs[part.shard as usize].fetch_add(1, Ordering::Relaxed);
            async move {
                let h = DataHeader { table, dim, client: self.push_id, seq, flags: 0 };
                let target = [index(&self.topo, self.topo.training_pod(), part.shard)];
                let give_up = crate::clock::now() + self.push_retry;
                let mut pause = PUSH_BACKOFF;
                loop {
                    let len = wire::push_request_len(part.keys.len(), dim as usize);
                    let mut frame = self.frame(len)?;
                    let body = &mut frame.as_mut_slice()[HEADER_LEN..];
                    wire::encode_push_into(body, &h, &part.keys, &g)
                        .map_err(|e| PsError::Protocol(e.to_string()))?;
                    let e = match self.call_frame(&target, Op::Push, frame, None).await {
                        Ok(_) => return Ok(()),
                        // A retry whose first attempt got through.
                        Err(PsError::Server { status: Status::Duplicate, .. }) => return Ok(()),
                        Err(e) => e,
                    };
                    let passing = matches!(
                        e,
                        PsError::Rpc(_)
                            | PsError::Server {
                                status: Status::Unavailable | Status::Overloaded,
                                ..
                            }
                    );
                    if !passing || crate::clock::now() + pause > give_up {
                        return Err(e);
                    }
                    self.push_retries.inc();
                    tracing::debug!(shard = part.shard, seq, %e, "push failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(PUSH_BACKOFF_MAX);
                }
            }
        });
        join_all(sends).await.into_iter().collect()
    }

    /// A raw request frame to one server (tests, admin tools): the decoded response bytes.
    pub async fn raw(
        &self,
        pod: u32,
        shard: u32,
        op: Op,
        frame: &[u8],
    ) -> Result<bex_transport::Msg, PsError> {
        let mut m = self.frame(frame.len())?;
        m.as_mut_slice()[HEADER_LEN..].copy_from_slice(frame);
        self.call_frame(&[index(&self.topo, pod, shard)], op, m, None).await
    }
}

/// Whether a reply says its server is unwell (not the request): such replies count towards
/// the server's quarantine and the call asks another replica.
pub fn unwell_reply(body: &[u8]) -> bool {
    wire::decode_response(body, &Limits::default()).is_ok_and(|r| {
        matches!(r.header.status, Status::Unavailable | Status::Overloaded | Status::Internal)
    })
}

/// Runs `futures` concurrently in the calling task and returns their outputs in order.
async fn join_all<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    use std::task::Poll;
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, d) in futures.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *d = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    done.into_iter().map(|d| d.expect("every future finished")).collect()
}
