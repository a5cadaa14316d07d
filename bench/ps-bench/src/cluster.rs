//! The server side of a run: the generated cluster file and the `ps-server` children, or a
//! running cluster's file (`--cluster`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bex_bench::server::Guard;
use bex_client::node::set_nic;
use bex_ps_proto::config::{InitConfig, OptimizerConfig, PushAck, TableConfig};
use bex_ps_proto::Config;
use bex_transport::NicSpec;

use crate::{Result, DIM};

/// RPC deadlines of the generated config. The paper's Tc = 10 ms / Tr = 40 ms time out
/// spuriously when client and server share a loaded 2-core machine (a 10 000-key request
/// with 16 outstanding queues for tens of ms); a benchmark measures, it does not fail over.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// See [`CONNECT_TIMEOUT_MS`].
pub const REQUEST_TIMEOUT_MS: u64 = 10_000;
/// How long a server may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The `[transport]` keys `--transport-set` may override.
pub const TRANSPORT_KEYS: [&str; 9] = [
    "eager_max",
    "fragment_bytes",
    "grant_max_bytes",
    "path_mtu",
    "spin_us",
    "endpoints",
    "sq_depth",
    "rq_depth",
    "cwnd_bytes",
];

/// The generated cluster: 1 pod × 1 shard (2 pods with `push_ack`), one table of dim 64 (SGD),
/// generous deadlines, one attempt per request, no checkpoints.
pub fn generated(dir: &Path, base_port: u16, push_ack: Option<PushAck>) -> Config {
    let mut cfg = Config::local(if push_ack.is_some() { 2 } else { 1 }, 1, base_port);
    cfg.server.push_ack = push_ack.unwrap_or(PushAck::Applied);
    cfg.cluster.name = format!("ps-bench-{}", std::process::id());
    cfg.cluster.data_dir = dir.join("data");
    cfg.server.checkpoint_interval_s = 0;
    cfg.server.checkpoint_on_shutdown = false;
    cfg.server.restore_on_start = false;
    cfg.server.bootstrap_from_peer = false;
    cfg.tables = vec![TableConfig {
        name: "emb".into(),
        dim: DIM,
        seed: None,
        init: InitConfig::Uniform { scale: 0.01 },
        // SGD: no optimizer state, so insert-heavy cells create 256 B per row (plus the index).
        optimizer: OptimizerConfig::Sgd { lr: 0.01 },
        admission: Default::default(),
        capacity: Default::default(),
    }];
    cfg.rpc.connect_timeout_ms = CONNECT_TIMEOUT_MS;
    cfg.rpc.request_timeout_ms = REQUEST_TIMEOUT_MS;
    // A benchmark measures one attempt per request: no hidden retries.
    cfg.rpc.retry_probability = 0.0;
    cfg.rpc.max_attempts = 1;
    cfg
}

/// Applies `--transport-set` overrides (keys from [`TRANSPORT_KEYS`]).
pub fn apply_transport_set(cfg: &mut Config, set: &[(String, u64)]) -> Result<()> {
    let t = &mut cfg.transport;
    for (k, n) in set {
        let n = *n;
        let small = || u32::try_from(n).map_err(|_| format!("{k}={n}: too large"));
        let size = || usize::try_from(n).map_err(|_| format!("{k}={n}: too large"));
        match k.as_str() {
            "eager_max" => t.eager_max = size()?,
            "fragment_bytes" => t.fragment_bytes = size()?,
            "grant_max_bytes" => t.grant_max_bytes = size()?,
            "path_mtu" => t.path_mtu = small()?,
            "spin_us" => t.spin_us = n,
            "endpoints" => t.endpoints = size()?,
            "sq_depth" => t.sq_depth = small()?,
            "rq_depth" => t.rq_depth = small()?,
            "cwnd_bytes" => t.cwnd_bytes = n,
            _ => {
                return Err(format!(
                    "--transport-set: unknown key {k:?} (one of {})",
                    TRANSPORT_KEYS.join(", ")
                )
                .into())
            }
        }
    }
    Ok(())
}

/// The generated config, checked: overrides and the NIC applied.
pub fn generated_checked(
    dir: &Path,
    base_port: u16,
    push_ack: Option<PushAck>,
    set: &[(String, u64)],
    nic: Option<&NicSpec>,
) -> Result<Config> {
    let mut cfg = generated(dir, base_port, push_ack);
    apply_transport_set(&mut cfg, set)?;
    if let Some(nic) = nic {
        set_nic(&mut cfg.transport, nic);
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// The cluster file of `--cluster`, checked for what the cells assume (table 0 of dim 64).
pub fn running(path: &Path, set: &[(String, u64)]) -> Result<Config> {
    let mut cfg = Config::load(path).map_err(|e| e.to_string())?;
    match cfg.tables.first() {
        Some(t) if t.dim == DIM => {}
        Some(t) => {
            return Err(format!("{}: table 0 has dim {}, not {DIM}", path.display(), t.dim).into())
        }
        None => return Err(format!("{}: no tables", path.display()).into()),
    }
    apply_transport_set(&mut cfg, set)?;
    Ok(cfg)
}

/// The `ps-server` executable: `explicit`, or the one next to this executable.
pub fn server_exe(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe().map_err(|e| format!("locating ps-bench: {e}"))?;
    let p = me.with_file_name("ps-server");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("no ps-server next to {} (build it, or pass --server)", me.display()).into())
    }
}

/// A `ps-server` child with its scratch directory: killed, reaped and removed on drop.
#[derive(Debug)]
pub struct ServerChild {
    guard: Guard,
    dir: PathBuf,
    /// Its ready line.
    pub ready: String,
}

impl ServerChild {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        // Kill and reap before the directory goes (the guard's own drop would come after).
        let _ = self.guard.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes `cfg` into `dir` and starts pod `pod`'s shard 0 from it; returns once it printed
/// its `ready` line. On failure the child is reaped and `dir` removed.
pub fn spawn_server(exe: &Path, cfg: &Config, dir: PathBuf, pod: u32) -> Result<ServerChild> {
    let started = start(exe, cfg, &dir, pod);
    if started.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (guard, ready) = started?;
    Ok(ServerChild { guard, dir, ready })
}

fn start(exe: &Path, cfg: &Config, dir: &Path, pod: u32) -> Result<(Guard, String)> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join("cluster.toml");
    let text = cfg.to_toml_string().map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("--config")
        .arg(&path)
        .args(["--pod", &pod.to_string(), "--shard", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut guard = Guard::spawn(&mut cmd, format!("ps-server {pod}/0"))
        .map_err(|e| format!("{e} ({})", exe.display()))?;
    let rest = guard.wait_line("ready", READY_TIMEOUT).map_err(|e| e.to_string())?;
    Ok((guard, format!("ready {rest}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_reach_the_config_and_strangers_are_refused() {
        let dir = std::env::temp_dir();
        let set = vec![("eager_max".to_string(), 4096), ("sq_depth".to_string(), 64)];
        let cfg = generated_checked(&dir, 20_000, None, &set, None).unwrap();
        assert_eq!((cfg.transport.eager_max, cfg.transport.sq_depth), (4096, 64));
        assert_eq!((cfg.cluster.pods, cfg.rpc.max_attempts), (1, 1));
        let two = generated(&dir, 20_000, Some(PushAck::Replicated));
        assert_eq!((two.cluster.pods, two.server.push_ack), (2, PushAck::Replicated));
        let mut cfg = generated(&dir, 20_000, None);
        let e = apply_transport_set(&mut cfg, &[("bogus".into(), 1)]).unwrap_err();
        assert!(e.to_string().contains("unknown key \"bogus\""), "{e}");
        let e = apply_transport_set(&mut cfg, &[("sq_depth".into(), u64::MAX)]).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
    }

    #[test]
    fn a_running_cluster_must_have_a_dim_64_table() {
        let dir = std::env::temp_dir().join(format!("ps-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        let mut cfg = generated(&dir, 20_000, None);
        std::fs::write(&path, cfg.to_toml_string().unwrap()).unwrap();
        assert_eq!(running(&path, &[]).unwrap().tables[0].dim, DIM);
        cfg.tables[0].dim = 8;
        std::fs::write(&path, cfg.to_toml_string().unwrap()).unwrap();
        let e = running(&path, &[]).unwrap_err();
        assert!(e.to_string().contains("table 0 has dim 8, not 64"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_server_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("ps-bench-missing-{}", std::process::id()));
        let cfg = generated(&std::env::temp_dir(), 20_000, None);
        let e =
            spawn_server(Path::new("/nonexistent/ps-server"), &cfg, dir.clone(), 0).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ps-server"), "{e}");
        assert!(!dir.exists(), "the scratch directory is removed");
    }
}
