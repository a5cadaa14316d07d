//! The fan-out client of the parameter server (rankers and trainers use it): a request's keys
//! are deduplicated and split by shard, one sub-request per shard goes out concurrently (to
//! a replica chosen by the RPC client — the caller's mini-pod first), and the rows are
//! merged back in request order. Pushes go to the training pod, each with a fresh sequence
//! number so a retried push is applied once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bex_ps_core::wire::{self, DataHeader, Limits, Op, Status};
use bex_ps_core::{FanoutPlan, Topology};
use bex_rpc::{Client, Endpoint, RpcError};
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
}

/// A client of the whole sharded, replicated PS.
pub struct PsClient {
    rpc: Client,
    topo: Topology,
    client_id: u64,
    seq: AtomicU64,
    limits: Limits,
}

impl std::fmt::Debug for PsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsClient").field("client_id", &self.client_id).finish()
    }
}

/// Endpoint index of (pod, shard) in the client's list.
fn index(topo: &Topology, pod: u32, shard: u32) -> usize {
    (pod * topo.shards() + shard) as usize
}

/// Every server as an RPC endpoint, in (pod, shard) order.
pub fn endpoints(topo: &Topology) -> Vec<Endpoint> {
    let mut v = Vec::new();
    for pod in 0..topo.pods() {
        for shard in 0..topo.shards() {
            let a = topo.server(pod, shard).expect("topology covers every (pod, shard)");
            v.push(Endpoint { pod, rdma: a.rdma, tcp: a.tcp });
        }
    }
    v
}

impl PsClient {
    /// A client over `rdma` (None: TCP only) and `tcp`; `client_id` scopes push sequence
    /// numbers (unique per client process).
    pub fn new(
        rdma: Option<Transport>,
        tcp: Transport,
        topo: Topology,
        cfg: bex_rpc::ClientConfig,
        client_id: u64,
    ) -> PsClient {
        let rpc = Client::new(rdma, tcp, endpoints(&topo), cfg);
        PsClient { rpc, topo, client_id, seq: AtomicU64::new(1), limits: Limits::default() }
    }

    /// This client's id (scopes its push sequence numbers).
    pub fn client_id(&self) -> u64 {
        self.client_id
    }

    /// The RPC client (counters, quarantine state).
    pub fn rpc(&self) -> &Client {
        &self.rpc
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    fn replicas(&self, shard: u32) -> Vec<usize> {
        (0..self.topo.pods()).map(|p| index(&self.topo, p, shard)).collect()
    }

    async fn call(
        &self,
        replicas: &[usize],
        op: Op,
        frame: &[u8],
    ) -> Result<bex_transport::Msg, PsError> {
        let m = self.rpc.call(replicas, op as u16, frame).await?;
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

    /// Rows of `keys` (with duplicates, in request order) from table `table` of `dim`.
    pub async fn fetch(
        self: &Arc<Self>,
        table: u32,
        dim: u32,
        keys: &[u64],
    ) -> Result<Vec<f32>, PsError> {
        let plan = FanoutPlan::new(keys, self.topo.shards());
        let mut tasks = Vec::new();
        for part in plan.parts() {
            let me = self.clone();
            let (shard, keys) = (part.shard, part.keys.clone());
            tasks.push(tokio::spawn(async move {
                let h = DataHeader { table, dim, client: me.client_id, seq: 0, flags: 0 };
                let mut frame = vec![0u8; wire::fetch_request_len(keys.len())];
                wire::encode_fetch_into(&mut frame, &h, &keys)
                    .map_err(|e| PsError::Protocol(e.to_string()))?;
                let m = me.call(&me.replicas(shard), Op::Fetch, &frame).await?;
                let r = wire::decode_response(m.as_slice(), &me.limits)
                    .map_err(|e| PsError::Protocol(e.to_string()))?;
                Ok::<Vec<f32>, PsError>(r.rows().to_vec())
            }));
        }
        let mut rows = Vec::with_capacity(tasks.len());
        for t in tasks {
            rows.push(t.await.map_err(|e| PsError::Protocol(e.to_string()))??);
        }
        let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
        plan.merge(dim as usize, &refs).map_err(|e| PsError::Protocol(e.to_string()))
    }

    /// Pushes gradients (`keys.len() × dim`, request order; duplicate keys' gradients are
    /// summed) to the training pod.
    pub async fn push(
        self: &Arc<Self>,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> Result<(), PsError> {
        let plan = FanoutPlan::new(keys, self.topo.shards());
        let per_part =
            plan.split_grads(dim as usize, grads).map_err(|e| PsError::Protocol(e.to_string()))?;
        let mut tasks = Vec::new();
        for (part, g) in plan.parts().iter().zip(per_part) {
            let me = self.clone();
            let (shard, keys) = (part.shard, part.keys.clone());
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            tasks.push(tokio::spawn(async move {
                let h = DataHeader { table, dim, client: me.client_id, seq, flags: 0 };
                let mut frame = vec![0u8; wire::push_request_len(keys.len(), dim as usize)];
                wire::encode_push_into(&mut frame, &h, &keys, &g)
                    .map_err(|e| PsError::Protocol(e.to_string()))?;
                let target = [index(&me.topo, me.topo.training_pod(), shard)];
                match me.call(&target, Op::Push, &frame).await {
                    Ok(_) => Ok(()),
                    // A retry whose first attempt got through.
                    Err(PsError::Server { status: Status::Duplicate, .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| PsError::Protocol(e.to_string()))??;
        }
        Ok(())
    }

    /// A raw request frame to one server (tests, admin tools): the decoded response bytes.
    pub async fn raw(
        &self,
        pod: u32,
        shard: u32,
        op: Op,
        frame: &[u8],
    ) -> Result<bex_transport::Msg, PsError> {
        self.call(&[index(&self.topo, pod, shard)], op, frame).await
    }
}
