//! `ps-server`: one shard of one mini-pod of bex's parameter server.
//!
//! ```text
//! ps-server --config configs/local.toml --pod 0 --shard 1
//! ```
//!
//! Loads and validates the cluster TOML (errors name the field), restores the shard from its
//! checkpoint (or bootstraps a replica from the training pod), serves RPC over RDMA (the
//! software RNIC) and TCP, `/health` and `/metrics` over HTTP, checkpoints periodically, and
//! on SIGTERM/SIGINT drains, checkpoints and exits 0. Prints `ready` on stdout once serving.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bex_client::node::{cluster_secret, nic_spec, transport_config};
use bex_client::telemetry;
use bex_process::http;
use bex_process::{identity, incarnation_id};
use bex_ps_core::checkpoint;
use bex_ps_core::TableSet;
use bex_ps_proto::control::ServingState;
use bex_ps_proto::Config;
use bex_ps_server::server::PsServer;
use bex_ps_server::shard::{start_shard, ShardStart};
use bex_transport::Transport;

struct Args {
    config: PathBuf,
    pod: u32,
    shard: u32,
}

const USAGE: &str = "usage: ps-server --config FILE --pod P --shard S

Serves shard S of mini-pod P of the cluster described by FILE (TOML; see configs/).
P and S may also come from BEX_POD and BEX_SHARD (FILE from BEX_CONFIG), and either may be
`ordinal`: the number ending the host name, as a Kubernetes StatefulSet names its pods.
A server whose host the cluster file names (server_host, or name:port entries) listens on
BEX_BIND_IP if set (an IP, e.g. the pod's, or `hostname`: what this host's name resolves
to), else on what its name in the cluster file resolves to.
Environment: BEX_SECRET (the cluster's shared secret; without it, a secret derived from the
cluster name, on loopback only unless [cluster] allow_insecure = true: a server bound to
another address refuses to start); RUST_LOG (the log on stderr; default warn, and info
shows bootstrap, catch-up, drain and checkpoints); BEX_LOG_FORMAT=json (JSON lines).
Prints `ready pod=P shard=S rdma=… tcp=… http=…` on stdout once it serves.";

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut config, mut pod, mut shard) = (None, None, None);
    while let Some(a) = it.next() {
        if a == "--help" || a == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = it.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--config" => config = Some(PathBuf::from(v)),
            "--pod" => pod = Some(v),
            "--shard" => shard = Some(v),
            _ => return Err(format!("unknown option {a}")),
        }
    }
    let config = config
        .or_else(|| std::env::var_os("BEX_CONFIG").map(PathBuf::from))
        .ok_or("--config (or BEX_CONFIG) is required")?;
    let number = |flag: Option<String>, name: &str, env: &str| -> Result<u32, String> {
        let n = identity::number(flag.as_deref(), env)
            .map_err(|e| format!("--{name}: {e}"))?
            .ok_or(format!("--{name} (or {env}) is required"))?;
        u32::try_from(n).map_err(|_| format!("--{name}: {n} is too large"))
    };
    Ok(Args {
        config,
        pod: number(pod, "pod", "BEX_POD")?,
        shard: number(shard, "shard", "BEX_SHARD")?,
    })
}

/// Where this server binds when the cluster file names its host: `BEX_BIND_IP` (in
/// Kubernetes, the pod's IP from the downward API), else what its name resolves to, retried
/// for up to a minute (a StatefulSet pod's DNS record can appear after the pod starts).
async fn own_addresses(topo: &mut bex_ps_proto::Topology, pod: u32, shard: u32) {
    let Some(me) = topo.server(pod, shard) else { return };
    let bind_ip = match std::env::var("BEX_BIND_IP") {
        Ok(v) if !v.is_empty() => {
            Some(identity::parse_ip(&v).unwrap_or_else(|e| die(2, &format!("BEX_BIND_IP: {e}"))))
        }
        _ => None,
    };
    let Some(name) = me.host.clone() else {
        if let Some(ip) = bind_ip {
            topo.set_server_ip(pod, shard, ip);
        }
        return;
    };
    let ip = match bind_ip {
        Some(ip) => ip,
        None => {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                let n = name.clone();
                let found = tokio::task::spawn_blocking(move || bex_rpc::resolve_host(&n))
                    .await
                    .ok()
                    .flatten();
                if let Some(ip) = found {
                    break ip;
                }
                if tokio::time::Instant::now() >= deadline {
                    die(
                        2,
                        &format!(
                            "my own host name {name:?} does not resolve (after 60 s); fix DNS or \
                             set BEX_BIND_IP to the address to listen on"
                        ),
                    );
                }
                tracing::warn!(host = %name, "my own host name does not resolve yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    topo.set_server_ip(pod, shard, ip);
}

/// Prints `ps-server: msg` and exits with `code` (2: usage or configuration, 1: run time).
fn die(code: u8, msg: &str) -> ! {
    bex_process::exit::with("ps-server", code, msg)
}

struct Endpoints(Arc<PsServer>);

impl http::Endpoints for Endpoints {
    fn health(&self) -> (bool, String) {
        let h = self.0.health();
        let ok = h.state == ServingState::Serving;
        (ok, serde_json::to_string(&h).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")))
    }
    fn metrics(&self) -> String {
        self.0.metrics.registry.render()
    }
}

fn main() {
    bex_process::logging::init();
    bex_process::exit_with_parent();
    let args = parse_args().unwrap_or_else(|e| die(2, &format!("{e}\n{USAGE}")));
    let cfg = Config::load(&args.config).unwrap_or_else(|e| die(2, &e.to_string()));
    let rt = bex_process::exit::runtime("ps-server", cfg.transport.app_threads);
    rt.block_on(serve(args, cfg));
}

/// What a started server's shutdown needs.
struct Started {
    server: Arc<PsServer>,
    stack: Arc<bex_transport::Stack>,
    ckpt: PathBuf,
}

async fn serve(args: Args, cfg: Config) {
    // First, so that a signal arriving during start-up or right after `ready` is never the
    // default action (death without a checkpoint).
    let signal = |kind| {
        tokio::signal::unix::signal(kind)
            .unwrap_or_else(|e| die(1, &format!("signal handler: {e}")))
    };
    let mut term = signal(tokio::signal::unix::SignalKind::terminate());
    let mut interrupt = signal(tokio::signal::unix::SignalKind::interrupt());
    // A signal while the shard starts (DNS and a replica's bootstrap can each wait a minute,
    // longer than Kubernetes' grace period) stops it without waiting: it has answered no
    // request yet, and the checkpoint on disk is untouched. (A checkpoint being read is
    // read to its end first.) From the moment its services run, a signal is a drain.
    let booted = tokio::select! {
        b = boot(&args, &cfg) => b,
        _ = term.recv() => stopped_while_starting("SIGTERM"),
        _ = interrupt.recv() => stopped_while_starting("SIGINT"),
    };
    let Started { server, stack, ckpt } = announce(&cfg, &args, booted).await;
    tokio::select! {
        _ = term.recv() => {}
        _ = interrupt.recv() => {}
        _ = server.shutdown.notified() => {}
    }
    drain_and_stop(&cfg, &server, &stack, &ckpt).await
}

fn stopped_while_starting(signal: &str) -> ! {
    tracing::info!(signal, "stopped during start-up, before serving");
    std::process::exit(0);
}

/// A shard whose RPC services have just started.
struct Booted {
    running: bex_ps_server::shard::RunningShard,
    stack: Arc<bex_transport::Stack>,
    http: std::net::SocketAddr,
    ckpt: PathBuf,
}

/// Addresses, the restored or empty tables, the NIC, the shard's bootstrap or catch-up;
/// it returns as its services start (no await after them: a signal cannot slip in between).
async fn boot(args: &Args, cfg: &Config) -> Booted {
    let mut topo = cfg.topology().unwrap_or_else(|e| die(2, &e.to_string()));
    for name in topo.resolve_with(bex_rpc::resolve_host) {
        tracing::info!(host = %name, "a server's name does not resolve yet; resolved on connect");
    }
    own_addresses(&mut topo, args.pod, args.shard).await;
    let Some(addrs) = topo.server(args.pod, args.shard).cloned() else {
        die(
            2,
            &format!(
                "pod {} shard {} is not in the cluster ({} pods × {} shards)",
                args.pod,
                args.shard,
                topo.pods(),
                topo.shards()
            ),
        )
    };
    let secret = cluster_secret(cfg, addrs.rdma.ip()).unwrap_or_else(|e| die(2, &e));
    let tcfg = transport_config(cfg, &secret);
    let ckpt = cfg.checkpoint_path(args.pod, args.shard);
    let specs = cfg.table_specs();
    // `try_exists`, not `exists`: a checkpoint that cannot be looked at (permissions, I/O, a
    // file where its directory should be) must stop the start, not read as "none" and let
    // an empty shard serve and then overwrite it with its next checkpoint.
    // `.tmp` too: a crash between a first checkpoint's two renames leaves the only
    // generation there, which the next checkpoint would overwrite.
    let prev = checkpoint::previous_generation(&ckpt);
    let tmp = checkpoint::temporary(&ckpt);
    let restore = cfg.server.restore_on_start
        && [&ckpt, &prev, &tmp].into_iter().any(|p| {
            p.try_exists().unwrap_or_else(|e| {
                die(1, &format!("checkpoint {}: cannot tell whether it exists: {e}", p.display()))
            })
        });
    let restored = if restore {
        let layout = (args.shard, topo.shards());
        checkpoint::restore_checkpoint(&ckpt, &specs, layout).unwrap_or_else(|e| {
            // Moving a newer build's checkpoint away would serve nothing of it: run that build.
            let advice = match e {
                checkpoint::CheckpointError::NewerVersion(_) => {
                    "run the build that wrote it".to_owned()
                }
                _ => {
                    format!("move it, {} and {} away to start empty", prev.display(), tmp.display())
                }
            };
            die(1, &format!("checkpoint {} is unusable: {e} ({advice})", ckpt.display()))
        })
    } else {
        None
    };
    let (tables, update_seq, dedupe_windows, restored) = match restored {
        Some(r) => {
            if let Some(why) = &r.latest_unusable {
                // Older rows than the latest checkpoint held: the training pod catches up
                // from its replicas, a replica from the training pod.
                tracing::warn!(
                    latest = %ckpt.display(),
                    %why,
                    restored = %r.from.display(),
                    "the latest checkpoint is missing or unusable (an unusable one is kept as \
                     .unusable); restored the previous generation"
                );
            }
            (r.tables, r.meta.update_seq, r.windows, true)
        }
        None => {
            (TableSet::new(specs).unwrap_or_else(|e| die(2, &e.to_string())), 0, Vec::new(), false)
        }
    };
    let incarnation = incarnation_id().unwrap_or_else(|e| die(1, &e));
    let nic = nic_spec(&cfg.transport).unwrap_or_else(|e| die(e.exit_code, &e.to_string()));
    let stack = bex_transport::Stack::open(&nic, addrs.rdma, addrs.tcp, tcfg)
        .await
        .unwrap_or_else(|e| die(e.exit_code(), &e.to_string()));
    let stack = Arc::new(stack);
    let running = start_shard(
        cfg,
        &topo,
        ShardStart {
            pod: args.pod,
            shard: args.shard,
            tables,
            update_seq,
            dedupe_windows,
            restored,
            incarnation,
            push_clock: bex_ps_server::server::PushClock::new(bex_ps_server::shard::version_floor),
        },
        stack.transports(),
    )
    .await
    .unwrap_or_else(|why| die(2, &why));
    Booted { running, stack, http: addrs.http, ckpt }
}

/// Metrics, HTTP, the periodic tasks, then `ready`.
async fn announce(cfg: &Config, args: &Args, booted: Booted) -> Started {
    let Booted { running, stack, http: http_at, ckpt } = booted;
    let server = running.server.clone();
    server.set_rdma(stack.rdma.clone());
    let registry = &server.metrics.registry;
    telemetry::register_stack(registry, &stack)
        .and_then(|()| telemetry::register_process(registry))
        .unwrap_or_else(|e| die(1, &format!("metrics: {e}")));
    let (http_addr, _http) = http::serve(http_at, Arc::new(Endpoints(server.clone())))
        .await
        .unwrap_or_else(|e| die(1, &format!("HTTP on {http_at}: {e}")));
    if server.has_ttl() {
        let s = server.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                // Off the async workers: a long pause can leave millions of rows to drop.
                let s = s.clone();
                let _ = tokio::task::spawn_blocking(move || s.expire_rows()).await;
            }
        });
    }
    if cfg.server.checkpoint_interval_s > 0 {
        let (s, every) = (server.clone(), Duration::from_secs(cfg.server.checkpoint_interval_s));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                match s.checkpoint().await {
                    Ok(c) => tracing::info!(path = %c.path, rows = c.rows, "periodic checkpoint"),
                    Err(e) => tracing::error!(error = %e, "periodic checkpoint failed"),
                }
            }
        });
    }
    println!(
        "ready pod={} shard={} rdma={} tcp={} http={http_addr}",
        args.pod,
        args.shard,
        stack.rdma.local_addr(),
        stack.tcp.local_addr()
    );
    Started { server, stack, ckpt }
}

/// After a signal or an Admin Shutdown: drain, checkpoint, exit (1 if the checkpoint failed).
async fn drain_and_stop(
    cfg: &Config,
    server: &Arc<PsServer>,
    stack: &bex_transport::Stack,
    ckpt: &std::path::Path,
) -> ! {
    // Refuse updates (clients retry them elsewhere or later), finish those being applied,
    // flush replication, then checkpoint: nothing acknowledged is lost by a restart.
    let d = server.drain(Duration::from_millis(cfg.server.drain_timeout_ms)).await;
    if d.replication_left_keys == 0 {
        tracing::info!(
            elapsed_ms = d.elapsed_ms,
            in_flight_done_ms = d.in_flight_done_ms,
            "drained: updates in flight done, replication flushed"
        );
    } else {
        tracing::warn!(
            elapsed_ms = d.elapsed_ms,
            unreplicated_keys = d.replication_left_keys,
            "drain timed out: changed keys not acknowledged by every replica (they are in this \
             server's checkpoint; its next start queues them for the replicas that lack them)"
        );
    }
    // A failed shutdown checkpoint exits 1: supervisors (the launcher, Kubernetes) read
    // exit 0 as "stopped with its state on disk", and the next start would restore an
    // older checkpoint.
    let mut failed = None;
    if cfg.server.checkpoint_on_shutdown {
        match server.checkpoint().await {
            Ok(c) => tracing::info!(path = %c.path, rows = c.rows, "shutdown checkpoint"),
            Err(e) => {
                tracing::error!(error = %e, "shutdown checkpoint failed");
                failed = Some(format!(
                    "shutdown checkpoint {} failed: {e} (the next start restores an older one)",
                    ckpt.display()
                ));
            }
        }
    }
    Transport::Rdma(stack.rdma.clone()).shutdown();
    if let Some(why) = server.failed().or(failed) {
        die(1, &why);
    }
    std::process::exit(0);
}
