//! A real cluster of `ps-server` processes on loopback (2 mini-pods × 2 shards): replication,
//! failover after `kill -9`, push idempotence, checkpoint restore, and the shared secret.
//! Every process is killed when the test ends, pass or fail.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bex_ps_core::wire::{self, DataHeader, Limits, Op, Status};
use bex_ps_core::Config;
use bex_ps_server::client::{PsClient, PsError};
use bex_ps_server::node::{client_config, cluster_secret, transport_config, Node};

struct Cluster {
    dir: PathBuf,
    config: PathBuf,
    cfg: Config,
    procs: Vec<Option<Child>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.procs.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn base_port(salt: u16) -> u16 {
    20_000 + ((std::process::id() % 1500) as u16) * 24 + salt * 12
}

impl Cluster {
    fn new(name: &str, salt: u16) -> Cluster {
        let dir = std::env::temp_dir().join(format!("bex-cluster-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = Config::local(2, 2, base_port(salt));
        cfg.cluster.name = format!("test-{name}");
        cfg.cluster.data_dir = dir.join("data");
        cfg.server.checkpoint_interval_s = 0;
        cfg.tables = vec![bex_ps_core::config::TableConfig {
            name: "emb".into(),
            dim: DIM,
            seed: None,
            init: bex_ps_core::config::InitConfig::Uniform { scale: 0.01 },
            optimizer: bex_ps_core::config::OptimizerConfig::Adagrad {
                lr: 0.05,
                initial_accumulator: 0.1,
                eps: 1e-8,
            },
        }];
        // Loopback under a test harness on 2 cores: generous deadlines.
        cfg.rpc.connect_timeout_ms = 500;
        cfg.rpc.request_timeout_ms = 500;
        // Failover is tested deterministically: a timed-out request is always retried.
        cfg.rpc.retry_probability = 1.0;
        cfg.validate().unwrap();
        let config = dir.join("cluster.toml");
        std::fs::write(&config, cfg.to_toml_string().unwrap()).unwrap();
        let mut c = Cluster { dir, config, cfg, procs: Vec::new() };
        for pod in 0..2 {
            for shard in 0..2 {
                let p = c.spawn(pod, shard);
                c.procs.push(Some(p));
            }
        }
        c
    }

    fn spawn(&self, pod: u32, shard: u32) -> Child {
        spawn_server(&self.config, pod, shard)
    }

    fn index(pod: u32, shard: u32) -> usize {
        (pod * 2 + shard) as usize
    }

    fn kill9(&mut self, pod: u32, shard: u32) {
        if let Some(mut c) = self.procs[Cluster::index(pod, shard)].take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    fn term(&mut self, pod: u32, shard: u32) {
        if let Some(mut c) = self.procs[Cluster::index(pod, shard)].take() {
            let pid = c.id().to_string();
            Command::new("kill").args(["-TERM", &pid]).status().unwrap();
            let status = c.wait().unwrap();
            assert!(status.success(), "clean exit on SIGTERM: {status}");
        }
    }

    async fn client(&self, local_pod: u32, secret: &[u8]) -> Arc<PsClient> {
        let tcfg = transport_config(&self.cfg.transport, secret);
        let node =
            Node::start("127.0.0.1:0".parse().unwrap(), "127.0.0.1:0".parse().unwrap(), tcfg)
                .await
                .unwrap();
        let (rdma, tcp) = node.transports();
        let ccfg = client_config(&self.cfg.rpc, local_pod, 99);
        Arc::new(PsClient::new(
            Some(rdma),
            tcp,
            self.cfg.topology().unwrap(),
            ccfg,
            1000 + u64::from(local_pod),
        ))
    }
}

fn spawn_server(config: &Path, pod: u32, shard: u32) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--pod",
            &pod.to_string(),
            "--shard",
            &shard.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ps-server starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("ready"), "ps-server did not come up: {line:?}");
    child
}

const TABLE: u32 = 0;
const DIM: u32 = 16;

fn keys(n: u64) -> Vec<u64> {
    (0..n).map(|i| i * 7919 + 13).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_reach_every_replica_and_a_killed_server_fails_over() {
    let mut c = Cluster::new("repl", 0);
    let secret = cluster_secret(&c.cfg.cluster.name);
    let trainer = c.client(0, &secret).await;
    let ks = keys(200);
    let before = trainer.fetch(TABLE, DIM, &ks).await.unwrap();
    let grads = vec![0.5f32; ks.len() * DIM as usize];
    trainer.push(TABLE, DIM, &ks, &grads).await.unwrap();
    let trained = trainer.fetch(TABLE, DIM, &ks).await.unwrap();
    assert_ne!(trained, before, "the push changed the rows");
    // Pod 1's replicas converge to the training pod's values, bit for bit, within the lag bound.
    let reader = c.client(1, &secret).await;
    let start = bex_ps_server::clock::now();
    loop {
        let seen = reader.fetch(TABLE, DIM, &ks).await.unwrap();
        if seen == trained {
            break;
        }
        assert!(
            bex_ps_server::clock::now() - start < Duration::from_secs(2),
            "replicas did not converge within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let lag = bex_ps_server::clock::now() - start;
    eprintln!("replication converged after {lag:?}");
    // kill -9 pod 1, shard 1: the reader's requests for that shard go to pod 0, none waits
    // beyond its deadline.
    c.kill9(1, 1);
    let deadline = Duration::from_millis(
        c.cfg.rpc.connect_timeout_ms * 2
            + c.cfg.rpc.request_timeout_ms * u64::from(c.cfg.rpc.max_attempts)
            + 500,
    );
    for _ in 0..5 {
        let t0 = bex_ps_server::clock::now();
        let seen = reader.fetch(TABLE, DIM, &ks).await.unwrap();
        let took = bex_ps_server::clock::now() - t0;
        assert_eq!(seen, trained);
        assert!(took < deadline, "a fetch took {took:?} (bound {deadline:?})");
    }
    let s = reader.rpc().stats();
    assert!(
        s.remote_pod_calls.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "served by the other pod"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicated_push_is_applied_once_and_checkpoints_restore_bit_exactly() {
    let mut c = Cluster::new("dedupe", 1);
    let secret = cluster_secret(&c.cfg.cluster.name);
    let cl = c.client(0, &secret).await;
    // Keys of shard 0 only, pushed twice with the same (client, seq).
    let ks: Vec<u64> =
        keys(500).into_iter().filter(|k| bex_ps_core::shard_of(*k, 2) == 0).take(50).collect();
    let before = cl.fetch(TABLE, DIM, &ks).await.unwrap();
    let h = DataHeader { table: TABLE, dim: DIM, client: 77, seq: 1, flags: 0 };
    let grads = vec![1.0f32; ks.len() * DIM as usize];
    let mut frame = vec![0u8; wire::push_request_len(ks.len(), DIM as usize)];
    wire::encode_push_into(&mut frame, &h, &ks, &grads).unwrap();
    let first = cl.raw(0, 0, Op::Push, &frame).await.unwrap();
    let r = wire::decode_response(first.as_slice(), &Limits::default()).unwrap();
    assert_eq!(r.header.status, Status::Ok);
    // The retry is answered Duplicate (a success for the caller) and not applied.
    let again = cl.raw(0, 0, Op::Push, &frame).await.unwrap();
    let r = wire::decode_response(again.as_slice(), &Limits::default()).unwrap();
    assert_eq!(r.header.status, Status::Duplicate);
    let once = cl.fetch(TABLE, DIM, &ks).await.unwrap();
    // Apply the same gradient once more under a new seq: the rows move again, so the
    // duplicate above really was skipped (not a no-op gradient).
    let h2 = DataHeader { seq: 2, ..h };
    wire::encode_push_into(&mut frame, &h2, &ks, &grads).unwrap();
    cl.raw(0, 0, Op::Push, &frame).await.unwrap();
    let twice = cl.fetch(TABLE, DIM, &ks).await.unwrap();
    assert_ne!(once, before);
    assert_ne!(twice, once);
    // SIGTERM writes a checkpoint; the restarted server restores every row bit-exactly.
    c.term(0, 0);
    let p = c.spawn(0, 0);
    c.procs[Cluster::index(0, 0)] = Some(p);
    let fresh = c.client(0, &secret).await;
    let restored = fresh.fetch(TABLE, DIM, &ks).await.unwrap();
    assert!(
        restored.iter().zip(&twice).all(|(a, b)| a.to_bits() == b.to_bits()),
        "restored rows differ"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_shared_secret_is_refused() {
    let c = Cluster::new("secret", 2);
    let intruder = c.client(0, b"not the cluster secret").await;
    let r = intruder.fetch(TABLE, DIM, &keys(10)).await;
    assert!(matches!(r, Err(PsError::Rpc(_))), "{r:?}");
}
