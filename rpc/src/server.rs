//! The serving side: accepts sockets on a transport and runs a handler for every request,
//! concurrently, replying on the same socket. Malformed frames are counted and dropped; a
//! handler error becomes an error reply; the server keeps serving.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bemalloc::Pool;
use bex_transport::{Msg, Socket, Transport};

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
    Header { kind: Kind::Error, method, status: status as u16, id }.encode(m.as_mut_slice());
    m.as_mut_slice()[HEADER_LEN..].copy_from_slice(msg.as_bytes());
    Some(m)
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
                    Header { kind: Kind::Response, method: h.method, status: 0, id: h.id }
                        .encode(r.as_mut_slice());
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
                // A failed reply means the socket broke; the reader loop ends by itself.
                let _ = socket.send_detached(r).await;
            }
        });
    }
}
