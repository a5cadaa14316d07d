//! A channel: request/response with ids over one transport socket, many calls outstanding.
//! A reader task matches replies to waiting calls; when the socket fails, every waiting call
//! fails with the transport's error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_transport::{Msg, SharedMsg, Socket, TransportKind};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::client::ClientStats;
use crate::error::RpcError;
use crate::frame::{Header, ReplyTarget, HEADER_LEN};
use crate::reply::{ReplyEvent, Waiting};

type Pending = Mutex<Waiting<oneshot::Sender<Result<Msg, RpcError>>>>;

struct Shared {
    pending: Pending,
    broken: Mutex<Option<RpcError>>,
}

/// A call's entry among the waiting ones, removed however the call ends: by an error, its
/// deadline, or the caller's own deadline dropping it (left behind, the entry would wait for
/// a reply that may never come). Once the reply or the channel's end arrived, the reader
/// took it already: no second look-up on the fast path.
struct ReplySlot<'a> {
    pending: &'a Pending,
    id: u64,
    taken: bool,
}

impl Drop for ReplySlot<'_> {
    fn drop(&mut self) {
        if !self.taken {
            self.pending.lock().remove(self.id);
        }
    }
}

/// One RPC channel over one socket.
pub struct Channel {
    socket: Arc<Socket>,
    shared: Arc<Shared>,
    pool: &'static Pool,
    reader: tokio::task::JoinHandle<()>,
}

/// A request id unique in this process: a call keeps its id across the channels its
/// attempts use, so a retry sends the same frame.
pub fn next_request_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("socket", &self.socket.to_string()).finish()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A message of `body_len` bytes with room for the RPC header in front; write the body at
/// `[HEADER_LEN..]`.
pub fn alloc_frame(pool: &'static Pool, body_len: usize) -> Result<Msg, RpcError> {
    Msg::alloc(pool, HEADER_LEN + body_len).map_err(RpcError::Transport)
}

impl Channel {
    /// Wraps a connected socket; `pool` provides request buffers; malformed replies are
    /// counted in `stats`.
    pub fn new(socket: Socket, pool: &'static Pool, stats: Arc<ClientStats>) -> Channel {
        let socket = Arc::new(socket);
        let shared = Arc::new(Shared { pending: Mutex::default(), broken: Mutex::new(None) });
        let (s2, sh2) = (socket.clone(), shared.clone());
        let reader = tokio::spawn(async move {
            // One warning per channel: a server sending garbage would otherwise log a line
            // per reply; the counter counts each.
            let mut warned = false;
            let mut malformed = |what: &str, id: Option<u64>| {
                stats.malformed_replies.fetch_add(1, Ordering::Relaxed);
                if !std::mem::replace(&mut warned, true) {
                    tracing::warn!(
                        peer = %s2,
                        id,
                        "{what} dropped (further ones on this channel only counted, in \
                         bex_rpc_client_malformed_replies_total)"
                    );
                }
            };
            let err = loop {
                match s2.recv().await {
                    Ok(mut m) => {
                        let event = sh2.pending.lock().handle_reply(m.as_slice());
                        match event {
                            ReplyEvent::Malformed { what, id } => malformed(what, id),
                            // A late reply (its caller has gone), or a placed reply's notice.
                            ReplyEvent::NoCall => {}
                            ReplyEvent::Reply { waiter, body } => {
                                let reply = body.map(|body| {
                                    m.advance(body.start);
                                    m.truncate(body.len());
                                    m
                                });
                                let _ = waiter.send(reply);
                            }
                        }
                    }
                    Err(e) => break RpcError::Transport(e),
                }
            };
            *sh2.broken.lock() = Some(err.clone());
            // In call order, so the waiting tasks wake in the same order every run.
            let waiting = sh2.pending.lock().drain_in_order();
            for (_, tx) in waiting {
                let _ = tx.send(Err(err.clone()));
            }
        });
        Channel { socket, shared, pool, reader }
    }

    /// RDMA or TCP.
    pub fn kind(&self) -> TransportKind {
        self.socket.kind()
    }

    /// Why the channel broke, if it did.
    pub fn broken(&self) -> Option<RpcError> {
        self.shared.broken.lock().clone()
    }

    /// Sends `request` (a frame from [`alloc_frame`], body at `[HEADER_LEN..]`) and waits for
    /// the reply within `deadline`; the reply's view starts at its body.
    pub async fn call_frame(
        &self,
        method: u16,
        mut request: Msg,
        deadline: Duration,
    ) -> Result<Msg, RpcError> {
        let id = next_request_id();
        Header::request(method, id).encode(request.as_mut_slice());
        self.call_shared(&SharedMsg::new(request), id, deadline).await
    }

    /// Exposes a registered buffer of `capacity` bytes for a reply to be written into
    /// (RDMA; `None` on a transport that cannot place). The buffer arrives on this channel
    /// when the server writes it; it is never freed before (a late write must land in
    /// memory nobody else uses).
    pub async fn expose_reply(&self, capacity: usize) -> Result<Option<ReplyTarget>, RpcError> {
        if !self.socket.can_place() {
            return Ok(None);
        }
        let buf = Msg::alloc(self.pool, capacity).map_err(RpcError::Transport)?;
        let t = self.socket.expose(buf).await.map_err(RpcError::Transport)?;
        Ok(Some(ReplyTarget { addr: t.addr, rkey: t.rkey, slot: t.slot, capacity: t.len }))
    }

    /// Sends a request frame whose header (request `id`, from [`next_request_id`]) is
    /// written, as one more use of its buffer — a retry on another channel sends the same
    /// bytes without a copy — and waits for the reply within `deadline`.
    pub async fn call_shared(
        &self,
        request: &SharedMsg,
        id: u64,
        deadline: Duration,
    ) -> Result<Msg, RpcError> {
        if let Some(e) = self.broken() {
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        self.shared.pending.lock().insert(id, tx);
        let mut slot = ReplySlot { pending: &self.shared.pending, id, taken: false };
        // The reply says the request arrived: waiting for the send's own completion too
        // would cost a wake-up per call.
        let exchange = async {
            self.socket.send_detached(request).await.map_err(RpcError::Transport)?;
            let reply = rx.await;
            // Resolved either way only after the reader removed the entry.
            slot.taken = true;
            reply.map_err(|_| RpcError::Protocol("channel closed".into()))?
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => Err(RpcError::Timeout(deadline)),
        }
    }

    /// Calls waiting for their replies.
    pub fn calls_waiting(&self) -> usize {
        self.shared.pending.lock().ids().count()
    }

    /// Copies `body` into a frame and calls.
    pub async fn call(
        &self,
        method: u16,
        body: &[u8],
        deadline: Duration,
    ) -> Result<Msg, RpcError> {
        let mut req = alloc_frame(self.pool, body.len())?;
        req.as_mut_slice()[HEADER_LEN..].copy_from_slice(body);
        self.call_frame(method, req, deadline).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Kind;
    use bex_transport::Transport;

    /// A channel over TCP on loopback counting into `stats`, the peer's socket, the pool,
    /// and both transports (kept by the test: dropping them closes the sockets).
    async fn pair(stats: Arc<ClientStats>) -> (Channel, Socket, &'static Pool, [Transport; 2]) {
        let (pool, server, client) = crate::test_util::tcp_transports().await;
        let (socket, accepted) = tokio::join!(client.connect(server.local_addr()), server.accept());
        let ch = Channel::new(socket.unwrap(), pool, stats);
        (ch, accepted.unwrap(), pool, [server, client])
    }

    // A call abandoned by its caller's own deadline (an outer timeout drops it mid-wait)
    // leaves nothing waiting on the channel; nor does one that times out by itself.
    #[tokio::test]
    async fn an_abandoned_call_leaves_no_reply_slot_behind() {
        let (ch, _silent_peer, _pool, _transports) = pair(Default::default()).await;
        let call = ch.call(1, b"hello", Duration::from_secs(60));
        assert!(tokio::time::timeout(Duration::from_millis(50), call).await.is_err());
        assert_eq!(ch.calls_waiting(), 0, "the dropped call's slot is gone");
        let r = ch.call(1, b"hello", Duration::from_millis(20)).await;
        assert!(matches!(r, Err(RpcError::Timeout(_))), "{r:?}");
        assert_eq!(ch.calls_waiting(), 0);
    }

    // A peer's garbage and a reply whose header disagrees with its length are dropped and
    // counted (they were only logged, a line each); the channel goes on serving the call.
    #[tokio::test]
    async fn malformed_replies_are_counted_and_the_channel_survives_them() {
        let stats = Arc::new(ClientStats::default());
        let (ch, peer, pool, _transports) = pair(stats.clone()).await;
        let answer = async {
            let req = peer.recv().await.unwrap();
            let id = Header::decode(req.as_slice()).unwrap().id;
            let reply = |claimed: usize, body: &[u8]| {
                let mut b = vec![0u8; HEADER_LEN + body.len()];
                Header::reply(Kind::Response, 1, 0, id, claimed).encode(&mut b);
                b[HEADER_LEN..].copy_from_slice(body);
                Msg::copy_from(pool, &b).unwrap()
            };
            peer.send(Msg::copy_from(pool, b"xyz").unwrap()).await.unwrap();
            peer.send(reply(5, b"abc")).await.unwrap();
            peer.send(reply(3, b"abc")).await.unwrap();
        };
        let (r, ()) = tokio::join!(ch.call(1, b"q", Duration::from_secs(10)), answer);
        assert_eq!(r.unwrap().as_slice(), b"abc");
        assert_eq!(stats.malformed_replies.load(Ordering::Relaxed), 2);
    }

    // Replies matched by id, whatever a peer does with them: out of order, twice, to no call
    // (a call given up on), or a request where a reply belongs. Each call gets its own reply
    // once; nothing stale reaches a later call; nothing is left waiting.
    #[tokio::test]
    async fn replies_out_of_order_twice_or_to_no_call_reach_only_their_own_call() {
        let stats = Arc::new(ClientStats::default());
        let (ch, peer, pool, _transports) = pair(stats.clone()).await;
        let reply = |kind: Kind, id: u64, body: &[u8]| {
            let mut b = vec![0u8; HEADER_LEN + body.len()];
            Header::reply(kind, 1, 0, id, body.len()).encode(&mut b);
            b[HEADER_LEN..].copy_from_slice(body);
            Msg::copy_from(pool, &b).unwrap()
        };
        let request = |m: &Msg| {
            let id = Header::decode(m.as_slice()).unwrap().id;
            (id, m.as_slice()[HEADER_LEN..].to_ascii_uppercase())
        };
        let answer = async {
            let (r1, r2) = (peer.recv().await.unwrap(), peer.recv().await.unwrap());
            let (first, second) = (request(&r1), request(&r2));
            // The second first, then the first twice, a reply to no call, and a request.
            peer.send(reply(Kind::Response, second.0, &second.1)).await.unwrap();
            peer.send(reply(Kind::Response, first.0, &first.1)).await.unwrap();
            peer.send(reply(Kind::Response, first.0, b"STALE")).await.unwrap();
            peer.send(reply(Kind::Response, u64::MAX, b"NOBODY'S")).await.unwrap();
            let mut req = vec![0u8; HEADER_LEN];
            Header::request(1, first.0).encode(&mut req);
            peer.send(Msg::copy_from(pool, &req).unwrap()).await.unwrap();
            // A later call is answered with its own reply after all of that.
            let (id, body) = request(&peer.recv().await.unwrap());
            peer.send(reply(Kind::Response, id, &body)).await.unwrap();
        };
        let calls = async {
            let deadline = Duration::from_secs(10);
            let (a, b) = tokio::join!(ch.call(1, b"a", deadline), ch.call(1, b"b", deadline));
            let c = ch.call(1, b"c", deadline).await;
            (a, b, c)
        };
        let ((a, b, c), ()) = tokio::join!(calls, answer);
        assert_eq!(a.unwrap().as_slice(), b"A");
        assert_eq!(b.unwrap().as_slice(), b"B");
        assert_eq!(c.unwrap().as_slice(), b"C", "nothing stale reaches a later call");
        assert_eq!(ch.calls_waiting(), 0);
        assert!(ch.broken().is_none(), "the channel serves on");
        assert_eq!(stats.malformed_replies.load(Ordering::Relaxed), 0, "well-formed, only late");
    }
}
