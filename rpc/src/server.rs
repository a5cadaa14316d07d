//! The serving side: accepts sockets on a transport and runs a handler for every request,
//! concurrently, replying on the same socket. Malformed frames are counted and dropped; a
//! handler error becomes an error reply; the server keeps serving.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bemalloc::Pool;
use bex_transport::{Msg, RemoteTarget, Socket, Transport};

use crate::error::RpcError;
use crate::frame::{Header, Kind, Status, HEADER_LEN};

/// What a server does with a request. The body view starts after the RPC header; the reply
/// must be a frame from [`crate::alloc_frame`] (body at `[HEADER_LEN..]`).
pub trait Handler: Send + Sync + 'static {
    /// Handles one request.
    fn handle(&self, method: u16, body: Msg) -> impl Future<Output = Result<Msg, RpcError>> + Send;
}

/// Server counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Requests handled.
    pub requests: AtomicU64,
    /// Error replies sent.
    pub errors: AtomicU64,
    /// Frames that were not RPC requests (dropped).
    pub malformed: AtomicU64,
    /// Sockets accepted.
    pub sockets: AtomicU64,
    /// Times a socket had [`MAX_IN_FLIGHT`] requests being handled or replied to, and was
    /// read no further until one finished.
    pub in_flight_full: AtomicU64,
}

/// Requests of one socket being handled or replied to at once. A caller with more
/// outstanding is read no further until one is answered: backpressure, not an error. Without
/// a bound, a peer that sends requests and never reads its replies had every reply (up to the
/// frame limit each) allocated and queued, and the process ran out of memory.
pub const MAX_IN_FLIGHT: usize = 256;

fn error_frame(
    pool: &'static Pool,
    id: u64,
    method: u16,
    status: Status,
    msg: &str,
) -> Option<Msg> {
    let mut m = Msg::alloc(pool, HEADER_LEN + msg.len()).ok()?;
    Header::reply(Kind::Error, method, status as u16, id, msg.len()).encode(m.as_mut_slice());
    m.as_mut_slice()[HEADER_LEN..].copy_from_slice(msg.as_bytes());
    Some(m)
}

/// Sends a reply frame (header written): into the caller's exposed buffer when it asked
/// for that and the frame fits, else as a message — after a bare `Elsewhere` header into
/// the buffer, so the caller can free it.
async fn send_reply(socket: &Socket, mut reply: Msg, h: &Header, pool: &'static Pool) {
    // A failed send means the socket broke; the reader loop ends by itself.
    let Some(t) = h.target else {
        let _ = socket.send_detached(reply).await;
        return;
    };
    let to = RemoteTarget { addr: t.addr, rkey: t.rkey, slot: t.slot, len: t.capacity };
    if reply.len() as u64 <= t.capacity {
        let mut placed = Header::decode(reply.as_slice()).expect("the server wrote this header");
        let body_len = reply.len() - HEADER_LEN;
        placed = Header::reply(Kind::Placed, placed.method, placed.status, placed.id, body_len);
        placed.encode(reply.as_mut_slice());
        // On a socket that cannot place (TCP: a confused or hostile caller) this fails and
        // the reply is lost: the caller times out and retries.
        let _ = socket.send_to_detached(reply, to).await;
        return;
    }
    if let Ok(mut bare) = Msg::alloc(pool, HEADER_LEN) {
        Header::reply(Kind::Elsewhere, h.method, 0, h.id, 0).encode(bare.as_mut_slice());
        let _ = socket.send_to_detached(bare, to).await;
    }
    let _ = socket.send_detached(reply).await;
}

/// Serves `transport` until it shuts down: every accepted socket gets a task; every request
/// its own task.
pub async fn serve<H: Handler>(transport: Transport, handler: Arc<H>, stats: Arc<ServerStats>) {
    let pool = transport.pool();
    loop {
        let socket = match transport.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(%e, "server stops accepting");
                return;
            }
        };
        stats.sockets.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(serve_socket(Arc::new(socket), handler.clone(), stats.clone(), pool));
    }
}

async fn serve_socket<H: Handler>(
    socket: Arc<Socket>,
    handler: Arc<H>,
    stats: Arc<ServerStats>,
    pool: &'static Pool,
) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    loop {
        // A permit before the next read: a socket at its bound is not read.
        let permit = match in_flight.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                stats.in_flight_full.fetch_add(1, Ordering::Relaxed);
                match in_flight.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return, // never closed
                }
            }
        };
        let Ok(mut m) = socket.recv().await else { return };
        let Some(h) = Header::decode(m.as_slice()).filter(|h| h.kind == Kind::Request) else {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        m.advance(HEADER_LEN);
        let (socket, handler, stats) = (socket.clone(), handler.clone(), stats.clone());
        tokio::spawn(async move {
            // Held until the reply is queued on the socket.
            let _permit = permit;
            stats.requests.fetch_add(1, Ordering::Relaxed);
            let reply = match handler.handle(h.method, m).await {
                Ok(mut r) if r.len() >= HEADER_LEN => {
                    let body = r.len() - HEADER_LEN;
                    Header::reply(Kind::Response, h.method, 0, h.id, body).encode(r.as_mut_slice());
                    Some(r)
                }
                Ok(_) => {
                    error_frame(pool, h.id, h.method, Status::Internal, "reply without header room")
                }
                Err(e) => {
                    stats.errors.fetch_add(1, Ordering::Relaxed);
                    let (status, text) = match &e {
                        RpcError::Remote { status, message } => (*status, message.clone()),
                        other => (Status::Internal, other.to_string()),
                    };
                    error_frame(pool, h.id, h.method, status, &text)
                }
            };
            if let Some(r) = reply {
                send_reply(&socket, r, &h, pool).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Takes every request and answers none until `open` is raised.
    struct Gate {
        pool: &'static Pool,
        taken: AtomicU64,
        open: tokio::sync::Semaphore,
    }

    impl Handler for Gate {
        async fn handle(&self, _method: u16, _body: Msg) -> Result<Msg, RpcError> {
            self.taken.fetch_add(1, Ordering::Relaxed);
            let _ = self.open.acquire().await.map_err(|_| RpcError::Protocol("closed".into()))?;
            crate::alloc_frame(self.pool, 0)
        }
    }

    // A peer that sends far more requests than it lets be answered: the server reads only
    // MAX_IN_FLIGHT of them (and counts the stall) until replies go out, then serves the rest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_is_read_no_further_than_its_requests_in_flight() {
        let (pool, server, client) = crate::test_util::tcp_transports().await;
        let gate =
            Arc::new(Gate { pool, taken: AtomicU64::new(0), open: tokio::sync::Semaphore::new(0) });
        let stats = Arc::new(ServerStats::default());
        tokio::spawn(serve(server.clone(), gate.clone(), stats.clone()));
        let socket = client.connect(server.local_addr()).await.unwrap();
        let sent = MAX_IN_FLIGHT + 50;
        for id in 1..=sent as u64 {
            let mut m = Msg::alloc(pool, HEADER_LEN).unwrap();
            Header::request(1, id).encode(m.as_mut_slice());
            socket.send(m).await.unwrap();
        }
        let taken = || gate.taken.load(Ordering::Relaxed);
        for _ in 0..200 {
            if taken() >= MAX_IN_FLIGHT as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(taken(), MAX_IN_FLIGHT as u64, "requests taken while none was answered");
        assert!(stats.in_flight_full.load(Ordering::Relaxed) >= 1);
        gate.open.add_permits(sent);
        for _ in 0..sent {
            let r = tokio::time::timeout(Duration::from_secs(10), socket.recv()).await;
            let r = r.expect("every request answered").unwrap();
            assert_eq!(Header::decode(r.as_slice()).map(|h| h.kind), Some(Kind::Response));
        }
        assert_eq!(taken(), sent as u64);
    }
}
