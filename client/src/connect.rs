//! Connecting a client process (ranker, trainer, canary) from the cluster file: its NIC and
//! transports, a [`PsClient`] under a fresh push identity, and its `/metrics`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bex_process::incarnation_id;
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::metrics::{MetricsError, Registry};
use bex_ps_proto::Config;
use bex_transport::Stack;

use crate::fanout::PsClient;
use crate::node::{
    client_config, cluster_secret, nic_spec, transport_config, ClientRole, SetupError,
};

/// A client process's transports and its PS client.
#[derive(Debug)]
pub struct ClientNode {
    /// The NIC and both transports (NIC counters: `stack.nic_stats()`).
    pub stack: Arc<Stack>,
    /// The fan-out PS client.
    pub ps: Arc<PsClient>,
    /// What the client sends on.
    pub kind: TransportKind,
    /// Its metrics: PS calls, RPC client, transports, NIC, pool, process
    /// ([`ClientNode::serve_metrics`] serves them).
    pub registry: Arc<Registry>,
}

impl ClientNode {
    /// Serves `/metrics` (and a `/health` that says the process runs) on `addr` until the
    /// returned task is dropped; the bound address first (port 0: any free port).
    pub async fn serve_metrics(
        &self,
        addr: SocketAddr,
    ) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        bex_process::http::serve(addr, Arc::new(ClientEndpoints(self.registry.clone()))).await
    }

    /// A binary's own metrics: registered by `register` on this client's registry and, when
    /// `addr` is given (`--metrics`), served there with the client's for the rest of the
    /// process; `who` says on stderr where. None without an address.
    pub async fn export_metrics<M>(
        &self,
        who: &str,
        addr: Option<SocketAddr>,
        register: impl FnOnce(&Registry) -> Result<M, MetricsError>,
    ) -> Result<Option<M>, String> {
        let Some(addr) = addr else { return Ok(None) };
        let metrics = register(&self.registry).map_err(|e| e.to_string())?;
        let (bound, _serving) =
            self.serve_metrics(addr).await.map_err(|e| format!("--metrics {addr}: {e}"))?;
        eprintln!("{who}: metrics on http://{bound}/metrics");
        Ok(Some(metrics))
    }
}

struct ClientEndpoints(Arc<Registry>);

impl bex_process::http::Endpoints for ClientEndpoints {
    fn health(&self) -> (bool, String) {
        (true, "{\"state\":\"running\"}".into())
    }
    fn metrics(&self) -> String {
        self.0.render()
    }
}

/// Starts a client's transports on `bind` (ephemeral ports) and a [`PsClient`] for the
/// cluster in `cfg`: over RDMA with TCP fallback (`kind = Rdma`), or TCP only. `client_id`
/// names the client (logs, reports) and seeds replica choice; its pushes are deduplicated
/// under a fresh [`incarnation_id`], so a client restarted with the same id has its pushes
/// applied. `pod` is the client's own mini-pod (served first); `role` picks the request
/// deadline, and training clients retry failed pushes (`[rpc] push_retry_ms`).
pub async fn connect_client(
    cfg: &Config,
    pod: u32,
    bind: IpAddr,
    kind: TransportKind,
    client_id: u64,
    role: ClientRole,
) -> Result<ClientNode, SetupError> {
    let mut topo =
        cfg.topology().map_err(|e| SetupError::config(format!("cluster config: {e}")))?;
    // Named servers: resolved now as far as they do, and again on every reconnect.
    for name in topo.resolve_with(bex_rpc::resolve_host) {
        tracing::info!(host = %name, "a server's name does not resolve yet; resolved on connect");
    }
    if pod >= topo.pods() {
        return Err(SetupError::config(format!(
            "--pod {pod}: the cluster has {} pods",
            topo.pods()
        )));
    }
    let secret = cluster_secret(cfg, bind).map_err(SetupError::config)?;
    let tcfg = transport_config(cfg, &secret);
    let any = SocketAddr::new(bind, 0);
    let stack = Stack::open(&nic_spec(&cfg.transport)?, any, any, tcfg).await?;
    let (rdma, tcp) = stack.transports();
    let rdma = (kind == TransportKind::Rdma).then_some(rdma);
    let push_id = incarnation_id().map_err(|e| SetupError::new("push identity", e))?;
    tracing::info!(client_id, push_id = format_args!("{push_id:#018x}"), "push identity");
    let registry = Arc::new(Registry::new());
    let stack = Arc::new(stack);
    let metrics = |e: bex_ps_proto::metrics::MetricsError| SetupError::new("metrics", e);
    let mut ps =
        PsClient::new(rdma, tcp, topo, client_config(&cfg.rpc, pod, client_id, role), push_id)
            .with_metrics(&registry)
            .map_err(metrics)?
            .with_limits(cfg.limits())
            .with_tables(
                cfg.tables.iter().zip(0u32..).map(|(t, id)| (id, t.name.clone(), t.dim)).collect(),
            );
    if role == ClientRole::Training {
        ps = ps.with_push_retry(Duration::from_millis(cfg.rpc.push_retry_ms));
    }
    crate::telemetry::register_stack(&registry, &stack).map_err(metrics)?;
    crate::telemetry::register_process(&registry).map_err(metrics)?;
    Ok(ClientNode { stack, ps: Arc::new(ps), kind, registry })
}
