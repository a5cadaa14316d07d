//! A deliberately small HTTP/1.1 server for `/health`, `/health/live` and `/metrics` (GET
//! only). `/health` is readiness: 503 while catching up or draining. `/health/live` is
//! liveness: 200 whenever this server answers at all, with the same body, so an orchestrator
//! never kills a server for draining or catching up (it would lose the checkpoint). Requests
//! are bounded (8 KiB of headers, a read deadline); anything else gets a 4xx and the server
//! keeps serving.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the endpoints answer.
pub trait Endpoints: Send + Sync + 'static {
    /// `/health`: (healthy, JSON body).
    fn health(&self) -> (bool, String);
    /// `/metrics`: Prometheus text.
    fn metrics(&self) -> String;
}

const MAX_HEAD: usize = 8 * 1024;
const READ_DEADLINE: Duration = Duration::from_secs(2);
/// Connections served at once; more wait in the listen backlog. Unbounded, anyone who can
/// reach the port could hold a descriptor each for the read deadline and starve the
/// transports, which share the process's descriptor limit.
const MAX_CONNECTIONS: usize = 64;

/// Binds `addr` and serves until the task is dropped; returns the bound address.
pub async fn serve<E: Endpoints>(
    addr: SocketAddr,
    endpoints: Arc<E>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else { return };
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let e = endpoints.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(READ_DEADLINE, handle(stream, &*e)).await;
                drop(slot);
            });
        }
    });
    Ok((local, task))
}

async fn handle<E: Endpoints>(mut stream: TcpStream, e: &E) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    // Only the bytes a read added (and the 3 before them) can complete the blank line: a
    // scan of the whole head per read was quadratic in a client's tiny segments.
    let mut scanned = 0;
    while !head[scanned..].windows(4).any(|w| w == b"\r\n\r\n") {
        scanned = head.len().saturating_sub(3);
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return respond(&mut stream, 431, "text/plain", "request header too large\n").await;
        }
    }
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(&mut stream, 405, "text/plain", "only GET\n").await;
    }
    match path {
        "/health" => {
            let (ok, body) = e.health();
            respond(&mut stream, if ok { 200 } else { 503 }, "application/json", &body).await
        }
        "/health/live" => respond(&mut stream, 200, "application/json", &e.health().1).await,
        "/metrics" => respond(&mut stream, 200, "text/plain; version=0.0.4", &e.metrics()).await,
        _ => respond(&mut stream, 404, "text/plain", "not found\n").await,
    }
}

async fn respond(s: &mut TcpStream, code: u16, ty: &str, body: &str) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: {ty}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    s.shutdown().await
}

/// A client-side GET (for launchers and tests): status code and body.
pub async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((code, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(bool);
    impl Endpoints for Fixed {
        fn health(&self) -> (bool, String) {
            (self.0, format!("{{\"ok\":{}}}", self.0))
        }
        fn metrics(&self) -> String {
            "bex_up 1\n".into()
        }
    }

    #[tokio::test]
    async fn serves_health_metrics_and_refuses_the_rest() {
        let (addr, _t) =
            serve("127.0.0.1:0".parse().unwrap(), Arc::new(Fixed(true))).await.unwrap();
        assert_eq!(get(addr, "/health").await.unwrap(), (200, "{\"ok\":true}".into()));
        assert_eq!(get(addr, "/metrics").await.unwrap(), (200, "bex_up 1\n".into()));
        assert_eq!(get(addr, "/nope").await.unwrap().0, 404);
        let mut s = TcpStream::connect(addr).await.unwrap();
        // The server may close before taking all of it.
        let _ = s.write_all(&vec![b'A'; 20_000]).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        assert!(String::from_utf8_lossy(&out).contains("431"), "oversized header refused");
        assert_eq!(get(addr, "/health").await.unwrap().0, 200, "still serving");
    }

    #[tokio::test]
    async fn a_server_that_is_not_ready_is_still_live() {
        let (addr, _t) =
            serve("127.0.0.1:0".parse().unwrap(), Arc::new(Fixed(false))).await.unwrap();
        assert_eq!(get(addr, "/health").await.unwrap(), (503, "{\"ok\":false}".into()));
        assert_eq!(get(addr, "/health/live").await.unwrap(), (200, "{\"ok\":false}".into()));
    }

    // A request in one-byte segments (the blank line split across reads) is served; and
    // connections beyond the bound wait for a slot instead of being refused.
    #[tokio::test]
    async fn a_request_in_tiny_segments_is_served_and_excess_connections_wait() {
        let (addr, _t) =
            serve("127.0.0.1:0".parse().unwrap(), Arc::new(Fixed(true))).await.unwrap();
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        for b in b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" {
            s.write_all(&[*b]).await.unwrap();
            s.flush().await.unwrap();
        }
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"), "{out:?}");
        // Every slot held by a silent client: the next request is served once their read
        // deadline frees slots.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let served = tokio::time::timeout(READ_DEADLINE * 3, get(addr, "/health")).await;
        assert_eq!(served.expect("served after the idle ones time out").unwrap().0, 200);
    }
}
