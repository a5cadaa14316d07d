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
}

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
    while let Ok(mut m) = socket.recv().await {
        let Some(h) = Header::decode(m.as_slice()).filter(|h| h.kind == Kind::Request) else {
            stats.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        m.advance(HEADER_LEN);
        let (socket, handler, stats) = (socket.clone(), handler.clone(), stats.clone());
        tokio::spawn(async move {
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
