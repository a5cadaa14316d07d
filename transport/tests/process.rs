//! Across real processes: a peer process killed with SIGKILL is detected (keepalive / QP
//! retries) and every socket to it fails promptly.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use bex_process::child::Guard;
use bex_transport::{Config, TransportError};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_process_fails_every_socket_within_the_keepalive_timeout() {
    let mut child = Guard::spawn(
        Command::new(env!("CARGO_BIN_EXE_bex-echo"))
            .args(["--keepalive-ms", "50"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
        "bex-echo",
    )
    .expect("bex-echo starts");
    let mut line = String::new();
    BufReader::new(child.take_stdout().unwrap()).read_line(&mut line).unwrap();
    let addr: std::net::SocketAddr = line.trim().parse().expect("bex-echo prints its address");
    let cfg = Config {
        keepalive_interval: Duration::from_millis(50),
        keepalive_timeout: Duration::from_millis(250),
        ..Config::default()
    };
    let (t, _dev) = rdma(cfg).await;
    let s1 = t.connect(addr).await.unwrap();
    let s2 = t.connect(addr).await.unwrap();
    s1.send(pattern(t.pool(), 1000, 1)).await.unwrap();
    check(&s1.recv().await.unwrap(), 1000, 1);
    // Healthy beyond several timeouts.
    tokio::time::sleep(Duration::from_millis(600)).await;
    s2.send(pattern(t.pool(), 10, 2)).await.unwrap();
    check(&s2.recv().await.unwrap(), 10, 2);
    child.kill().unwrap();
    let start = bex_transport::clock::now();
    for s in [&s1, &s2] {
        let r =
            tokio::time::timeout(Duration::from_secs(3), s.recv()).await.expect("fails in time");
        assert!(matches!(r, Err(TransportError::ConnectionLost(_))), "{r:?}");
    }
    let took = bex_transport::clock::now() - start;
    assert!(took < Duration::from_millis(1000), "detected after {took:?}");
    assert_eq!(t.counters().engines_failed, 1);
}
