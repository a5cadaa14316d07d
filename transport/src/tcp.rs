//! The TCP transport: the socket API of [`crate::rdma`] over tokio TCP, one connection per
//! socket, used as the fallback and as the baseline of every comparison.
//!
//! A connection starts with a handshake that authenticates both sides with the cluster's
//! shared secret (an HMAC-SHA256 over both sides' random nonces, see [`wire`]); a peer that
//! fails it is refused and counted (`bootstrap_refused`). Then each message is one frame: a
//! 16-byte header (length, kind) and the payload. A socket owns two tasks:
//!
//! - a **writer** fed by a bounded channel of `max_queued_sends` messages, so sends from
//!   several tasks are serialized in the order they were queued and a full queue makes `send`
//!   wait (backpressure). It writes whatever is queued (up to [`MAX_BATCH`] messages) through
//!   one buffer and flushes once; each `send` resolves when its message is in the kernel.
//!   Large payloads bypass the buffer and go from the message's memory to the kernel.
//! - a **reader** that reads each payload into a [`Msg`] of the announced length allocated
//!   from the pool, so TCP also delivers registered memory, and queues it for `recv` (at most
//!   `max_queued_sends` waiting: beyond that TCP's own flow control holds the peer back). A
//!   header that does not parse — unknown kind, reserved bits, a length beyond
//!   `pool.max_allocation()` — fails the connection and counts `malformed`.
//!
//! Dropping a socket sends a close frame (the peer's `recv` gets [`TransportError::Closed`]
//! after every earlier message); a connection that ends without one gives
//! [`TransportError::ConnectionLost`].
//!
//! A writer idle for `tcp_keepalive_interval` sends a keepalive frame; a reader that waits
//! `tcp_keepalive_timeout` for its peer's bytes in vain fails the connection
//! (`keepalive_failures`), so a blackholed or hung peer's socket ends (`ConnectionLost`)
//! instead of staying open.
//!
//! Counters used: `messages_{sent,received}`, `bytes_{sent,received}`, `engines_up` (TCP
//! connections established), `engines_failed` (connections lost), `keepalive_failures`,
//! `malformed`, `bootstrap_refused`, `wakeups` (reads that waited, and keepalive timers, also
//! in `timer_wakeups`); the RDMA-only ones stay 0.

pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bemalloc::Pool;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::auth::HandshakeSlots;
use crate::config::{Config, CounterSnapshot, Counters};
use crate::error::{Result, TransportError};
use crate::log_limit::{accept, LogLimit, WARN_EVERY};
use crate::msg::{Msg, Payload, SharedMsg};
use wire::{Frame, Hello, Role, HEADER_LEN, HELLO_LEN, PROOF_LEN};

/// Most messages the writer takes from its queue before flushing.
pub const MAX_BATCH: usize = 64;
/// Bytes of each connection's read buffer and write buffer.
const IO_BUF_BYTES: usize = 64 << 10;
/// Authenticated inbound sockets waiting for [`TcpTransport::accept`]; the handshakes behind
/// them wait when it is full.
const ACCEPT_BACKLOG: usize = 1024;

/// What every connection's tasks share with the transport.
struct Shared {
    cfg: Config,
    pool: &'static Pool,
    counters: Counters,
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    /// Refused inbound handshakes: logged at most one per period (a stranger's storm).
    refused_warn: LogLimit,
}

impl Shared {
    fn is_shut(&self) -> bool {
        *self.shutdown.borrow()
    }
}

/// Resolves once the transport shuts down (never if it cannot any more).
async fn shut(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The state of one connection, shared by its socket, reader and writer.
#[derive(Default)]
struct Conn {
    st: Mutex<ConnState>,
    /// Tells the writer to stop: the reader ended, or the socket was dropped.
    stop_writer: Notify,
}

#[derive(Default)]
struct ConnState {
    /// Why sends fail from now on.
    send_err: Option<TransportError>,
    /// What `recv` returns once the queued messages are drained.
    recv_end: Option<TransportError>,
    /// The socket was dropped here: the writer ends the stream with a close frame.
    dropped: bool,
}

impl Conn {
    fn send_err(&self) -> Option<TransportError> {
        self.st.lock().send_err.clone()
    }

    /// The error of a send whose message the writer did not take.
    fn send_err_or_lost(&self) -> TransportError {
        self.send_err().unwrap_or_else(|| {
            TransportError::ConnectionLost("the connection's writer ended".into())
        })
    }

    /// Records why sends fail from now on (the first reason wins) and stops the writer.
    /// Counts a lost connection once.
    fn fail_sends(&self, e: &TransportError, counters: &Counters) {
        let first = {
            let mut st = self.st.lock();
            let first = st.send_err.is_none();
            if first {
                st.send_err = Some(e.clone());
            }
            first
        };
        if first && matches!(e, TransportError::ConnectionLost(_)) {
            Counters::add(&counters.engines_failed, 1);
        }
        self.stop_writer.notify_one();
    }
}

/// An authenticated connection with its tasks running: a socket, once wrapped.
struct Core {
    peer: SocketAddr,
    out: mpsc::Sender<Out>,
    inbox: tokio::sync::Mutex<mpsc::Receiver<Msg>>,
    conn: Arc<Conn>,
    reader: tokio::task::AbortHandle,
}

impl Drop for Core {
    fn drop(&mut self) {
        self.reader.abort();
        {
            let mut st = self.conn.st.lock();
            st.dropped = true;
            // Messages of cancelled sends still queued are not written (as on RDMA).
            st.send_err.get_or_insert(TransportError::Closed);
        }
        self.conn.stop_writer.notify_one();
    }
}

/// A message to write and who waits for it.
struct Out {
    msg: Payload,
    done: oneshot::Sender<Result<()>>,
}

/// The read half, counting the reader's wake-ups: each time a read resumes after the
/// socket had nothing (the reader task waited for the network).
struct CountWakes {
    inner: OwnedReadHalf,
    waiting: bool,
    shared: Arc<Shared>,
    /// When bytes last arrived (or the reader last began to wait for a frame).
    heard: Arc<Heard>,
}

/// When a connection's reader last heard from its peer, for the keepalive check: shared by
/// the read half (which sees bytes arrive) and the check racing the read.
struct Heard {
    epoch: Instant,
    micros: AtomicU64,
}

impl Heard {
    fn new() -> Heard {
        Heard { epoch: crate::clock::now(), micros: AtomicU64::new(0) }
    }

    fn now(&self) {
        let since = crate::clock::now().saturating_duration_since(self.epoch);
        let us = u64::try_from(since.as_micros()).unwrap_or(u64::MAX);
        self.micros.store(us, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.epoch + Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }
}

/// Resolves once nothing was heard for `limit`: a peer that is gone, blackholed or hung
/// (its kernel still ACKs, but its writer sends no keepalive). Each timer wake-up is counted.
async fn silence(heard: &Heard, limit: Duration, counters: &Counters) {
    loop {
        let deadline = heard.last() + limit;
        if crate::clock::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
        Counters::add(&counters.wakeups, 1);
        Counters::add(&counters.timer_wakeups, 1);
    }
}

impl tokio::io::AsyncRead for CountWakes {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let me = &mut *self;
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut me.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            me.heard.now();
        }
        match (&r, me.waiting) {
            (std::task::Poll::Pending, _) => me.waiting = true,
            (std::task::Poll::Ready(_), true) => {
                me.waiting = false;
                Counters::add(&me.shared.counters.wakeups, 1);
            }
            _ => {}
        }
        r
    }
}

/// Starts the reader and writer of an authenticated stream.
fn start_conn(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) -> Core {
    let (r, w) = stream.into_split();
    let conn = Arc::new(Conn::default());
    let queue = shared.cfg.max_queued_sends;
    let (out, out_rx) = mpsc::channel(queue);
    let (inbox_tx, inbox) = mpsc::channel(queue);
    let heard = Arc::new(Heard::new());
    let r = CountWakes { inner: r, waiting: false, shared: shared.clone(), heard: heard.clone() };
    let reader = tokio::spawn(read_loop(
        BufReader::with_capacity(IO_BUF_BYTES, r),
        heard,
        inbox_tx,
        conn.clone(),
        shared.clone(),
    ));
    tokio::spawn(write_loop(
        BufWriter::with_capacity(IO_BUF_BYTES, w),
        out_rx,
        conn.clone(),
        shared.clone(),
    ));
    Counters::add(&shared.counters.engines_up, 1);
    Core { peer, out, inbox: tokio::sync::Mutex::new(inbox), conn, reader: reader.abort_handle() }
}

/// How reading a frame failed.
enum ReadError {
    /// The header does not parse.
    Malformed(String),
    /// No registered memory for the announced message.
    Alloc(u64, TransportError),
    /// The stream ended cleanly between frames, without a close frame.
    Eof,
    /// The stream failed or ended inside a frame.
    Io(std::io::Error),
}

/// Reads one frame: `Some(msg)` for data, `None` for a close.
async fn read_frame(
    r: &mut BufReader<CountWakes>,
    pool: &'static Pool,
    max_message: u64,
) -> std::result::Result<Option<Msg>, ReadError> {
    loop {
        if r.fill_buf().await.map_err(ReadError::Io)?.is_empty() {
            return Err(ReadError::Eof);
        }
        let mut h = [0u8; HEADER_LEN];
        r.read_exact(&mut h).await.map_err(ReadError::Io)?;
        let limit = max_message.min(pool.max_allocation() as u64);
        match Frame::decode(&h, limit).map_err(ReadError::Malformed)? {
            Frame::Close => return Ok(None),
            // Its bytes told the keepalive check all it needs.
            Frame::Keepalive => continue,
            Frame::Data(len) => {
                // `decode` bounded `len` by `max_allocation`, a `usize`, and the configured
                // limit.
                let mut msg =
                    Msg::alloc(pool, len as usize).map_err(|e| ReadError::Alloc(len, e))?;
                r.read_exact(msg.as_mut_slice()).await.map_err(ReadError::Io)?;
                return Ok(Some(msg));
            }
        }
    }
}

async fn read_loop(
    mut r: BufReader<CountWakes>,
    heard: Arc<Heard>,
    inbox: mpsc::Sender<Msg>,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
) {
    let mut shutdown = shared.shutdown.subscribe();
    let c = &shared.counters;
    let limit = shared.cfg.tcp_keepalive_timeout;
    let end = loop {
        // Silence counts only while the reader waits for the peer, not while `recv`'s queue
        // is full (the peer's bytes then wait in the kernel, unread).
        heard.now();
        let frame = tokio::select! {
            biased;
            _ = shut(&mut shutdown) => break TransportError::Shutdown,
            f = read_frame(&mut r, shared.pool, shared.cfg.max_message_bytes) => f,
            _ = silence(&heard, limit, c) => {
                Counters::add(&c.keepalive_failures, 1);
                tracing::warn!(peer = ?r.get_ref().inner.peer_addr().ok(), ?limit, "TCP peer silent past the keepalive timeout; closing the connection");
                break TransportError::ConnectionLost(format!(
                    "nothing from the peer for {limit:?} (no keepalive: gone, cut off or hung)"
                ));
            }
        };
        // `biased` orders the branches within one poll, not across the poll: the thread may
        // pause between them while the shutdown makes the peer close. Shutdown wins.
        if shared.is_shut() {
            break TransportError::Shutdown;
        }
        match frame {
            Ok(Some(msg)) => {
                // Counted before `recv` can see it, so counters never lag behind `recv`.
                Counters::add(&c.messages_received, 1);
                Counters::add(&c.bytes_received, msg.len() as u64);
                tokio::select! {
                    biased;
                    _ = shut(&mut shutdown) => break TransportError::Shutdown,
                    sent = inbox.send(msg) => if sent.is_err() { return },
                }
            }
            Ok(None) => break TransportError::Closed,
            Err(ReadError::Malformed(why)) => {
                Counters::add(&c.malformed, 1);
                tracing::warn!(%why, "malformed frame from a TCP peer; closing the connection");
                break TransportError::ConnectionLost(format!("malformed frame: {why}"));
            }
            Err(ReadError::Alloc(len, e)) => {
                break TransportError::ConnectionLost(format!(
                    "no registered memory for a {len}-byte message: {e}"
                ));
            }
            Err(ReadError::Eof) => {
                break TransportError::ConnectionLost(
                    "the peer's stream ended without a close frame".into(),
                );
            }
            Err(ReadError::Io(e)) => break TransportError::ConnectionLost(e.to_string()),
        }
    };
    conn.fail_sends(&end, c);
    conn.st.lock().recv_end = Some(end);
    // Dropping `inbox` now lets `recv` drain what was queued and then see `recv_end`.
}

/// Writes `first` and whatever else is queued (up to [`MAX_BATCH`]), then flushes. Each taken
/// message's completion goes to `done` before its bytes are written.
async fn write_batch(
    w: &mut BufWriter<OwnedWriteHalf>,
    first: Out,
    rx: &mut mpsc::Receiver<Out>,
    conn: &Conn,
    done: &mut Vec<oneshot::Sender<Result<()>>>,
    bytes: &mut u64,
) -> std::io::Result<()> {
    let mut next = Some(first);
    while let Some(Out { msg, done: d }) = next.take() {
        if let Some(e) = conn.send_err() {
            let _ = d.send(Err(e));
        } else {
            done.push(d);
            w.write_all(&Frame::Data(msg.len() as u64).encode()).await?;
            w.write_all(msg.as_slice()).await?;
            *bytes += msg.len() as u64;
        }
        if done.len() < MAX_BATCH {
            next = rx.try_recv().ok();
        }
    }
    w.flush().await
}

async fn write_loop(
    mut w: BufWriter<OwnedWriteHalf>,
    mut rx: mpsc::Receiver<Out>,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
) {
    let mut shutdown = shared.shutdown.subscribe();
    let c = &shared.counters;
    let mut done = Vec::with_capacity(MAX_BATCH);
    // Whether the stream stands between frames, where a close frame may follow.
    let mut at_boundary = true;
    let idle = shared.cfg.tcp_keepalive_interval;
    loop {
        let first = tokio::select! {
            biased;
            _ = shut(&mut shutdown) => {
                conn.fail_sends(&TransportError::Shutdown, c);
                break;
            }
            _ = conn.stop_writer.notified() => break,
            o = tokio::time::timeout(idle, rx.recv()) => o,
        };
        // `None` only once the socket (the only sender) is gone, which also stops us; a
        // timeout means idle for `keepalive_interval`: a keepalive goes instead.
        let first = match first {
            Ok(Some(first)) => Some(first),
            Ok(None) => break,
            Err(_) => {
                Counters::add(&c.wakeups, 1);
                Counters::add(&c.timer_wakeups, 1);
                None
            }
        };
        let mut bytes = 0;
        // A keepalive goes into the empty buffer whole, and a cut flush keeps what it did not
        // write there: the frame boundary survives its cancellation (a batch's large payloads
        // go to the socket directly, so a cut batch leaves the stream mid-frame).
        let cut_leaves_a_boundary = first.is_none();
        let write = async {
            match first {
                Some(first) => {
                    write_batch(&mut w, first, &mut rx, &conn, &mut done, &mut bytes).await
                }
                None => {
                    w.write_all(&Frame::Keepalive.encode()).await?;
                    w.flush().await
                }
            }
        };
        let r = tokio::select! {
            biased;
            _ = shut(&mut shutdown) => Err(TransportError::Shutdown),
            _ = conn.stop_writer.notified() => Err(conn.send_err_or_lost()),
            r = write => r.map_err(|e| TransportError::ConnectionLost(e.to_string())),
        };
        // As in the reader: a write that failed because of our own shutdown is a shutdown.
        let r = match r {
            Err(_) if shared.is_shut() => Err(TransportError::Shutdown),
            r => r,
        };
        match r {
            Ok(()) => {
                Counters::add(&c.messages_sent, done.len() as u64);
                Counters::add(&c.bytes_sent, bytes);
                for d in done.drain(..) {
                    let _ = d.send(Ok(()));
                }
            }
            Err(e) => {
                at_boundary &= cut_leaves_a_boundary;
                conn.fail_sends(&e, c);
                let e = conn.send_err_or_lost();
                for d in done.drain(..) {
                    let _ = d.send(Err(e.clone()));
                }
                break;
            }
        }
    }
    rx.close();
    let e = conn.send_err_or_lost();
    while let Ok(o) = rx.try_recv() {
        let _ = o.done.send(Err(e.clone()));
    }
    if at_boundary && conn.st.lock().dropped && !shared.is_shut() {
        // Tell the peer, within the connection deadline (a peer that does not read must not
        // keep this task alive).
        let bye = async {
            w.write_all(&Frame::Close.encode()).await?;
            w.flush().await?;
            w.shutdown().await
        };
        let _ = tokio::time::timeout(shared.cfg.connect_timeout, bye).await;
    }
}

/// How a handshake failed.
enum HandshakeError {
    /// The peer's hello or proof failed the check.
    Refused(String),
    /// The stream failed or ended.
    Io(std::io::Error),
}

impl From<std::io::Error> for HandshakeError {
    fn from(e: std::io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

/// Authenticates a fresh connection; returns the peer's hello.
async fn handshake(
    stream: &mut TcpStream,
    shared: &Shared,
    role: Role,
) -> std::result::Result<Hello, HandshakeError> {
    stream.set_nodelay(true)?;
    let mine = Hello { nonce: rand::random(), listen: shared.local_addr }.encode();
    stream.write_all(&mine).await?;
    let mut theirs = [0u8; HELLO_LEN];
    stream.read_exact(&mut theirs).await?;
    let hello = Hello::decode(&theirs).map_err(|why| HandshakeError::Refused(why.into()))?;
    let (hi, ha) = match role {
        Role::Initiator => (&mine, &theirs),
        Role::Acceptor => (&theirs, &mine),
    };
    stream.write_all(&wire::proof(&shared.cfg.secret, role, hi, ha)).await?;
    let mut their_proof = [0u8; PROOF_LEN];
    stream.read_exact(&mut their_proof).await?;
    let their_role = match role {
        Role::Initiator => Role::Acceptor,
        Role::Acceptor => Role::Initiator,
    };
    if !wire::verify(&shared.cfg.secret, their_role, hi, ha, &their_proof) {
        return Err(HandshakeError::Refused("the peer does not have the cluster's secret".into()));
    }
    Ok(hello)
}

/// Runs the acceptor's handshake on an inbound connection and queues the socket for
/// `accept`. Every failure counts `bootstrap_refused`.
async fn serve_inbound(
    mut stream: TcpStream,
    from: SocketAddr,
    shared: Arc<Shared>,
    accepted: mpsc::Sender<Core>,
) {
    let mut shutdown = shared.shutdown.subscribe();
    let hs = tokio::time::timeout(shared.cfg.connect_timeout, async {
        handshake(&mut stream, &shared, Role::Acceptor).await
    });
    let r = tokio::select! {
        biased;
        _ = shut(&mut shutdown) => return,
        r = hs => r,
    };
    let why = match r {
        Ok(Ok(hello)) => {
            let core = start_conn(stream, hello.listen, &shared);
            tokio::select! {
                biased;
                _ = shut(&mut shutdown) => {}
                // The transport is gone if this fails; dropping `core` closes the socket.
                _ = accepted.send(core) => {}
            }
            return;
        }
        Ok(Err(HandshakeError::Refused(why))) => why,
        Ok(Err(HandshakeError::Io(e))) => format!("connection failed during the handshake: {e}"),
        Err(_) => "handshake timed out".into(),
    };
    Counters::add(&shared.counters.bootstrap_refused, 1);
    if let Some(held) = shared.refused_warn.allow(crate::clock::now()) {
        tracing::warn!(%from, %why, held_back = held, "inbound TCP handshake refused");
    }
}

async fn listen_loop(listener: TcpListener, shared: Arc<Shared>, accepted: mpsc::Sender<Core>) {
    let slots = HandshakeSlots::new();
    let (accept_warn, busy_warn) = (LogLimit::new(WARN_EVERY), LogLimit::new(WARN_EVERY));
    loop {
        let (stream, from) = accept(&listener, &accept_warn, "TCP").await;
        let slot = match slots.try_take(from.ip()) {
            Ok(slot) => slot,
            Err(no) => {
                Counters::add(&shared.counters.bootstrap_refused, 1);
                if let Some(held) = busy_warn.allow(crate::clock::now()) {
                    tracing::warn!(%from, held_back = held, "TCP handshake refused: {}", no.why());
                }
                continue;
            }
        };
        let (shared, accepted) = (shared.clone(), accepted.clone());
        tokio::spawn(async move {
            serve_inbound(stream, from, shared, accepted).await;
            drop(slot);
        });
    }
}

struct Inner {
    shared: Arc<Shared>,
    accepted: tokio::sync::Mutex<mpsc::Receiver<Core>>,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(l) = self.listener.lock().take() {
            l.abort();
        }
    }
}

/// A TCP transport: a listener and the sockets connected through it.
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport").field("local_addr", &self.inner.shared.local_addr).finish()
    }
}

impl TcpTransport {
    /// Starts listening on `listen` (port 0: any). Received messages are allocated from
    /// `pool`. Of `cfg` TCP uses `secret`, `connect_timeout` and `max_queued_sends`.
    pub async fn start(pool: &'static Pool, listen: SocketAddr, cfg: Config) -> Result<Self> {
        cfg.validate().map_err(TransportError::Invalid)?;
        let listener = TcpListener::bind(listen).await?;
        let mut local_addr = listener.local_addr()?;
        if local_addr.ip().is_unspecified() {
            local_addr.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let shared = Arc::new(Shared {
            cfg,
            pool,
            counters: Counters::default(),
            local_addr,
            shutdown: watch::Sender::new(false),
            refused_warn: LogLimit::new(WARN_EVERY),
        });
        let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
        let listener = tokio::spawn(listen_loop(listener, shared.clone(), tx));
        Ok(TcpTransport {
            inner: Arc::new(Inner {
                shared,
                accepted: tokio::sync::Mutex::new(rx),
                listener: Mutex::new(Some(listener)),
            }),
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.shared.local_addr
    }

    /// The registered-memory pool received messages come from.
    pub fn pool(&self) -> &'static Pool {
        self.inner.shared.pool
    }

    /// Counters (see the module documentation for which ones TCP uses).
    pub fn counters(&self) -> CounterSnapshot {
        self.inner.shared.counters.snapshot()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.shared.cfg
    }

    /// Opens a socket (a new TCP connection) to the transport listening at `addr`.
    pub async fn connect(&self, addr: SocketAddr) -> Result<TcpSocket> {
        let shared = &self.inner.shared;
        if shared.is_shut() {
            return Err(TransportError::Shutdown);
        }
        let attempt = async {
            let mut stream = TcpStream::connect(addr)
                .await
                .map_err(|e| TransportError::Refused(format!("connect to {addr}: {e}")))?;
            match handshake(&mut stream, shared, Role::Initiator).await {
                Ok(_) => Ok(stream),
                Err(HandshakeError::Refused(why)) => {
                    Counters::add(&shared.counters.bootstrap_refused, 1);
                    Err(TransportError::Refused(format!("handshake with {addr}: {why}")))
                }
                Err(HandshakeError::Io(e)) => {
                    Err(TransportError::Refused(format!("handshake with {addr}: {e}")))
                }
            }
        };
        let mut shutdown = shared.shutdown.subscribe();
        let stream = tokio::select! {
            biased;
            _ = shut(&mut shutdown) => return Err(TransportError::Shutdown),
            r = tokio::time::timeout(shared.cfg.connect_timeout, attempt) => {
                r.map_err(|_| TransportError::ConnectTimeout(addr.to_string()))??
            }
        };
        Ok(self.socket(start_conn(stream, addr, shared)))
    }

    /// Waits for a socket opened by a peer.
    pub async fn accept(&self) -> Result<TcpSocket> {
        let mut shutdown = self.inner.shared.shutdown.subscribe();
        let mut rx = self.inner.accepted.lock().await;
        tokio::select! {
            biased;
            _ = shut(&mut shutdown) => Err(TransportError::Shutdown),
            c = rx.recv() => c.map(|c| self.socket(c)).ok_or(TransportError::Shutdown),
        }
    }

    fn socket(&self, core: Core) -> TcpSocket {
        TcpSocket { core, _transport: self.inner.clone() }
    }

    /// Stops the listener; every socket fails with [`TransportError::Shutdown`] (its peer
    /// sees the connection lost).
    pub fn shutdown(&self) {
        self.inner.shared.shutdown.send_replace(true);
        if let Some(l) = self.inner.listener.lock().take() {
            l.abort();
        }
    }
}

/// A socket: one authenticated TCP connection. Dropping it closes the connection.
pub struct TcpSocket {
    core: Core,
    /// Keeps the listener running while sockets exist, as an RDMA socket keeps its transport.
    _transport: Arc<Inner>,
}

impl std::fmt::Debug for TcpSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSocket").field("peer", &self.core.peer).finish()
    }
}

impl TcpSocket {
    /// The peer transport's address (the one connected to, or the one the peer listens on).
    pub fn peer(&self) -> SocketAddr {
        self.core.peer
    }

    /// Sends a message; resolves when it is written to the kernel. Sends from several tasks
    /// are written in the order they were queued; beyond `max_queued_sends` this waits
    /// (backpressure).
    pub async fn send(&self, msg: Msg) -> Result<()> {
        let written = self.queue(msg.into()).await?;
        written.await.map_err(|_| self.core.conn.send_err_or_lost())?
    }

    /// Queues a message for the writer without waiting for the write (see
    /// [`crate::RdmaSocket::send_detached`]); waits only for room in the queue. A failed
    /// write ends the connection, and so this socket's `recv`.
    pub async fn send_detached(&self, msg: impl Into<Payload>) -> Result<()> {
        self.queue(msg.into()).await.map(drop)
    }

    /// Sends a shared message (one more use of its buffer, no copy); resolves when it is in
    /// the kernel.
    pub async fn send_shared(&self, msg: &SharedMsg) -> Result<()> {
        self.queue(msg.into()).await?.await.map_err(|_| self.core.conn.send_err_or_lost())?
    }

    /// Hands a message to the writer (waiting for room); the receiver says when it was written.
    async fn queue(&self, msg: Payload) -> Result<oneshot::Receiver<Result<()>>> {
        let conn = &self.core.conn;
        if let Some(e) = conn.send_err() {
            return Err(e);
        }
        let (done, written) = oneshot::channel();
        self.core.out.send(Out { msg, done }).await.map_err(|_| conn.send_err_or_lost())?;
        Ok(written)
    }

    /// The next message, in order; after the last one, why the stream ended
    /// ([`TransportError::Closed`] if the peer closed its socket).
    pub async fn recv(&self) -> Result<Msg> {
        match self.core.inbox.lock().await.recv().await {
            Some(m) => Ok(m),
            None => {
                Err(self.core.conn.st.lock().recv_end.clone().unwrap_or(TransportError::Closed))
            }
        }
    }
}
