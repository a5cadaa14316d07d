//! `bex-echo`: a transport endpoint that echoes every message back on its socket. For manual
//! checks and for the multi-process tests (it prints its bootstrap address, then serves until
//! killed or its stdin closes).
//!
//! ```text
//! bex-echo [--listen 127.0.0.1:0] [--secret S] [--keepalive-ms 100]
//! ```

use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_rnic::soft::{SoftDevice, UdpConfig};
use bex_rnic::Device;
use bex_transport::{Config, RdmaTransport};
use tokio::io::AsyncReadExt;

fn usage() -> ! {
    eprintln!("usage: bex-echo [--listen IP:PORT] [--secret S] [--keepalive-ms MS]");
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let mut listen: std::net::SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let mut cfg = Config::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--listen" => listen = value.parse().unwrap_or_else(|_| usage()),
            "--secret" => cfg.secret = value.into_bytes(),
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
    let dev = SoftDevice::open_udp(UdpConfig::new(std::net::SocketAddr::new(listen.ip(), 0)))
        .unwrap_or_else(|e| fail("open soft RNIC", &e));
    let pd = dev.alloc_pd().unwrap_or_else(|e| fail("alloc pd", &e));
    let pool: &'static Pool =
        Pool::new(vec![Arc::new(dev.registrar(&pd))]).unwrap_or_else(|e| fail("pool", &e)).leak();
    let t = RdmaTransport::start(Arc::new(dev), Arc::new(pd), pool, 0, listen, cfg)
        .await
        .unwrap_or_else(|e| fail("start transport", &e));
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
