//! `bex-echo`: a transport endpoint that echoes every message back on its socket. For manual
//! checks and for the multi-process tests (it prints its bootstrap address, then serves until
//! killed or its stdin closes).
//!
//! ```text
//! bex-echo [--listen 127.0.0.1:0] [--secret S] [--keepalive-ms 100] [--nic soft]
//! ```
//!
//! `--nic` is `soft[:UDP_PORT]` or `verbs[:DEVICE[:PORT[:GID_INDEX]]]`; a NIC that does not
//! exist exits 2.

use std::time::Duration;

use bex_transport::{Config, Nic, NicSpec};
use tokio::io::AsyncReadExt;

fn usage() -> ! {
    eprintln!("usage: bex-echo [--listen IP:PORT] [--secret S] [--keepalive-ms MS] [--nic SPEC]");
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    bex_process::logging::init();
    let mut listen: std::net::SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let mut cfg = Config::default();
    let mut nic = NicSpec::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--listen" => listen = value.parse().unwrap_or_else(|_| usage()),
            "--secret" => cfg.secret = value.into_bytes(),
            "--nic" => {
                nic = value.parse().unwrap_or_else(|e| {
                    eprintln!("bex-echo: {e}");
                    usage()
                })
            }
            "--keepalive-ms" => {
                let ms: u64 = value.parse().unwrap_or_else(|_| usage());
                cfg.keepalive_interval = Duration::from_millis(ms);
                cfg.keepalive_timeout = Duration::from_millis(ms * 5);
            }
            _ => usage(),
        }
    }
    let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
        eprintln!("bex-echo: {what}: {e}");
        std::process::exit(1)
    };
    let nic = Nic::open(&nic, listen.ip()).unwrap_or_else(|e| {
        eprintln!("bex-echo: {e}");
        std::process::exit(e.exit_code().into())
    });
    let t = nic.rdma(listen, cfg).await.unwrap_or_else(|e| fail("start transport", &e));
    println!("{}", t.local_addr());
    let t2 = t.clone();
    tokio::spawn(async move {
        while let Ok(s) = t2.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = s.recv().await {
                    if s.send(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    // Serve until stdin closes (the parent went away) — no orphan when the parent dies.
    let mut sink = [0u8; 64];
    let mut stdin = tokio::io::stdin();
    while matches!(stdin.read(&mut sink).await, Ok(n) if n > 0) {}
    t.shutdown();
}
