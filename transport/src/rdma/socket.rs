//! A socket: a logical connection multiplexed onto an engine.

use super::*;

/// A logical connection over an engine.
pub struct RdmaSocket {
    pub(super) id: u32,
    pub(super) peer: SocketAddr,
    pub(super) ctl: Arc<dyn Control>,
    /// Keeps the transport (its endpoints' drivers) alive while the socket is.
    pub(super) _transport: Arc<Inner>,
    pub(super) inbox: tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Msg>>>,
    /// The error that ended the socket, repeated by every later `recv`.
    pub(super) ended: Mutex<Option<TransportError>>,
    pub(super) slots: Arc<Semaphore>,
}

impl std::fmt::Debug for RdmaSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSocket").field("id", &self.id).field("peer", &self.peer).finish()
    }
}

impl RdmaSocket {
    /// The peer transport's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    async fn submit(&self, payload: Payload, target: Option<RemoteTarget>) -> Result<()> {
        let _permit = self.slots.acquire().await.map_err(|_| TransportError::Shutdown)?;
        let (done, rx) = oneshot::channel();
        self.ctl.apply(Cmd::Send { socket: self.id, payload, target, done: Done::Notify(done) })?;
        rx.await.map_err(|_| TransportError::Shutdown)?
    }

    /// Sends a message; resolves when the NIC is done with its buffer. Many sends may be in
    /// flight at once; beyond `max_queued_sends` this waits (backpressure).
    pub async fn send(&self, msg: Msg) -> Result<()> {
        self.submit(msg.into(), None).await
    }

    /// Sends a shared message without copying it (one more use of its buffer); resolves when
    /// the NIC is done with this use.
    pub async fn send_shared(&self, msg: &SharedMsg) -> Result<()> {
        self.submit(msg.into(), None).await
    }

    /// Queues a message without waiting for the NIC to finish with it, so nobody is woken
    /// when it does: for request/response traffic, where the response says the request
    /// arrived. Waits only for room in the socket's queue (`max_queued_sends`). A later
    /// failure fails the engine, and so this socket's `recv`.
    pub async fn send_detached(&self, msg: impl Into<Payload>) -> Result<()> {
        let permit =
            self.slots.clone().acquire_owned().await.map_err(|_| TransportError::Shutdown)?;
        let done = Done::Detached(permit);
        self.ctl.apply(Cmd::Send { socket: self.id, payload: msg.into(), target: None, done })
    }

    /// Writes a message straight into a buffer the peer exposed, skipping RTS/CTS.
    pub async fn send_to(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        self.submit(msg.into(), Some(target)).await
    }

    /// [`RdmaSocket::send_to`] without waiting for the NIC (as [`RdmaSocket::send_detached`]).
    pub async fn send_to_detached(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        let permit =
            self.slots.clone().acquire_owned().await.map_err(|_| TransportError::Shutdown)?;
        let done = Done::Detached(permit);
        self.ctl.apply(Cmd::Send {
            socket: self.id,
            payload: msg.into(),
            target: Some(target),
            done,
        })
    }

    /// Exposes `buf` so the peer can [`RdmaSocket::send_to`] into it; when the peer's write
    /// completes, the whole buffer arrives on this socket's `recv` (the peer's message fills
    /// its start; the length travels in the application's own protocol).
    pub async fn expose(&self, buf: Msg) -> Result<RemoteTarget> {
        let (reply, rx) = oneshot::channel();
        self.ctl.apply(Cmd::Expose { socket: self.id, buf, reply })?;
        rx.await.map_err(|_| TransportError::Shutdown)?
    }

    /// The next message, in order.
    pub async fn recv(&self) -> Result<Msg> {
        if let Some(e) = self.ended.lock().clone() {
            return Err(e);
        }
        let r = self.inbox.lock().await.recv().await.unwrap_or(Err(TransportError::Closed));
        if let Err(e) = &r {
            *self.ended.lock() = Some(e.clone());
        }
        r
    }

    /// Fails the engine under this socket, as a QP error would (every socket on it fails).
    pub fn fail_engine(&self, why: &str) {
        let _ = self.ctl.apply(Cmd::FailEngine { socket: self.id, why: why.to_string() });
    }
}

impl Drop for RdmaSocket {
    fn drop(&mut self) {
        let _ = self.ctl.apply(Cmd::Close { socket: self.id });
    }
}
