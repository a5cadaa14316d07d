//! [`LocalCluster`]: a cluster of real `ps-server` processes on loopback, one per (pod,
//! shard) of a config, for tests that need the processes (replication, failover, restarts,
//! signals, the binaries' exit codes). Every server is a [`Guard`]: killed and reaped when
//! the cluster drops, pass or fail, with its scratch directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use bex_process::child::Guard;
use bex_ps_proto::Config;

use crate::scratch::Scratch;

/// How long a server may take to print `ready` and then to answer `/health` 200 (a training
/// shard catches up from its replicas first).
pub const READY_WITHIN: Duration = Duration::from_secs(20);

/// `ps-server` processes of one config.
#[derive(Debug)]
pub struct LocalCluster {
    /// The config the servers run (its `data_dir` is inside the scratch directory unless
    /// the caller chose another).
    pub cfg: Config,
    /// Its file.
    pub config: PathBuf,
    bin: PathBuf,
    env: Vec<(String, String)>,
    servers: Vec<Option<Guard>>,
    // Last: removed after the servers are gone.
    scratch: Scratch,
}

impl LocalCluster {
    /// Writes `cfg` (validated; `data_dir` set to `data/` in a fresh scratch directory) as
    /// `cluster.toml`; starts nothing. `bin` is the `ps-server` to run.
    pub fn new(name: &str, mut cfg: Config, bin: PathBuf) -> LocalCluster {
        let scratch = Scratch::new(&format!("cluster-{name}"));
        cfg.cluster.data_dir = scratch.join("data");
        LocalCluster::in_scratch(scratch, cfg, bin)
    }

    /// As [`LocalCluster::new`], in `scratch`, keeping `cfg`'s `data_dir`.
    pub fn in_scratch(scratch: Scratch, cfg: Config, bin: PathBuf) -> LocalCluster {
        cfg.validate().unwrap_or_else(|e| panic!("the test's config is invalid: {e}"));
        let config = scratch.join("cluster.toml");
        std::fs::write(&config, cfg.to_toml_string().expect("the config serializes"))
            .unwrap_or_else(|e| panic!("writing {}: {e}", config.display()));
        let n = (cfg.cluster.pods * cfg.cluster.shards) as usize;
        let servers = (0..n).map(|_| None).collect();
        LocalCluster { cfg, config, bin, env: Vec::new(), servers, scratch }
    }

    /// Sets `key=value` in every server's environment from now on (e.g. `RUST_LOG`).
    pub fn env(mut self, key: &str, value: &str) -> LocalCluster {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The scratch directory.
    pub fn dir(&self) -> &Path {
        self.scratch.path()
    }

    fn index(&self, pod: u32, shard: u32) -> usize {
        assert!(pod < self.cfg.cluster.pods && shard < self.cfg.cluster.shards, "{pod}/{shard}");
        (pod * self.cfg.cluster.shards + shard) as usize
    }

    /// Where server (`pod`, `shard`) writes its stderr.
    pub fn stderr_path(&self, pod: u32, shard: u32) -> PathBuf {
        self.scratch.join(format!("ps-{pod}-{shard}.stderr"))
    }

    /// What server (`pod`, `shard`) wrote on stderr so far (its last life's).
    pub fn stderr(&self, pod: u32, shard: u32) -> String {
        std::fs::read_to_string(self.stderr_path(pod, shard)).unwrap_or_default()
    }

    /// Its `/health` and `/metrics` address.
    pub fn http(&self, pod: u32, shard: u32) -> SocketAddr {
        self.cfg.topology().expect("a valid topology").server(pod, shard).expect("in range").http
    }

    /// Starts every server, then waits until each serves.
    pub fn start(&mut self) {
        for pod in 0..self.cfg.cluster.pods {
            for shard in 0..self.cfg.cluster.shards {
                self.spawn(pod, shard);
            }
        }
        for pod in 0..self.cfg.cluster.pods {
            for shard in 0..self.cfg.cluster.shards {
                self.wait_serving(pod, shard);
            }
        }
    }

    /// Starts server (`pod`, `shard`) and waits for its `ready` line (panicking with its
    /// stderr if it does not come).
    pub fn spawn(&mut self, pod: u32, shard: u32) {
        let i = self.index(pod, shard);
        assert!(self.servers[i].is_none(), "{pod}/{shard} is running");
        let stderr = std::fs::File::create(self.stderr_path(pod, shard)).expect("stderr file");
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--config")
            .arg(&self.config)
            .args(["--pod", &pod.to_string(), "--shard", &shard.to_string()])
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut guard = Guard::spawn(&mut cmd, format!("ps-server {pod}/{shard}"))
            .unwrap_or_else(|e| panic!("{e} ({})", self.bin.display()));
        if let Err(e) = guard.wait_line("ready", READY_WITHIN) {
            drop(guard);
            panic!("{e}\nits stderr:\n{}", self.stderr(pod, shard));
        }
        self.servers[i] = Some(guard);
    }

    /// Waits until server (`pod`, `shard`) answers `/health` with 200 (serving: a training
    /// shard has caught up from its replicas and takes pushes). Blocks the calling thread:
    /// from async code use [`LocalCluster::serving`].
    pub fn wait_serving(&self, pod: u32, shard: u32) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
        rt.expect("a current-thread runtime").block_on(self.serving(pod, shard));
    }

    /// Waits until server (`pod`, `shard`) serves (see [`LocalCluster::wait_serving`]).
    pub async fn serving(&self, pod: u32, shard: u32) {
        let addr = self.http(pod, shard);
        let start = bex_process::clock::now();
        let mut last = String::from("no answer");
        while bex_process::clock::now() - start < READY_WITHIN {
            match bex_process::http::get(addr, "/health").await {
                Ok((200, _)) => return,
                Ok((code, body)) => last = format!("{code} {body}"),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{pod}/{shard} not serving within {READY_WITHIN:?}: {last}");
    }

    /// Starts server (`pod`, `shard`) again (after a kill or a SIGTERM) and waits until it
    /// serves.
    pub async fn restart(&mut self, pod: u32, shard: u32) {
        self.spawn(pod, shard);
        self.serving(pod, shard).await;
    }

    /// The server's process id, if it runs.
    pub fn pid(&self, pod: u32, shard: u32) -> Option<u32> {
        self.servers[self.index(pod, shard)].as_ref().map(Guard::id)
    }

    /// Kills server (`pod`, `shard`) with SIGKILL and reaps it.
    pub fn kill9(&mut self, pod: u32, shard: u32) {
        let i = self.index(pod, shard);
        if let Some(mut g) = self.servers[i].take() {
            g.kill().unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Sends server (`pod`, `shard`) SIGTERM and returns how it exited (killed after 20 s).
    pub fn term(&mut self, pod: u32, shard: u32) -> ExitStatus {
        let i = self.index(pod, shard);
        let g = self.servers[i].take().unwrap_or_else(|| panic!("{pod}/{shard} is not running"));
        g.terminate(READY_WITHIN).unwrap_or_else(|e| panic!("{e}"))
    }
}
