//! I/O threads (paper §6.2): each owns one CQ and the engines assigned to it (round-robin),
//! so no lock is shared between I/O threads. A thread polls its CQ in batches and dispatches
//! completions by QP number, applies commands from the application, lets engines with work
//! post, runs timers, and when idle spins for `Config::spin` then blocks on the CQ's fd and
//! its command eventfd.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bex_rnic::verbs::WorkCompletion;
use bex_rnic::{CompletionQueue, Device};
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::clock;
use crate::engine::{Done, Engine, EngineState, RemoteTarget};
use crate::error::{Result, TransportError};
use crate::msg::Msg;

/// Longest an idle I/O thread blocks without a timer due.
const MAX_BLOCK: Duration = Duration::from_millis(100);

/// Commands from the application to an I/O thread.
pub(crate) enum Cmd {
    Open {
        engine: u32,
        socket: u32,
        inbox: mpsc::UnboundedSender<Result<Msg>>,
        reply: oneshot::Sender<Result<()>>,
    },
    Send {
        socket: u32,
        msg: Msg,
        target: Option<RemoteTarget>,
        done: Done,
    },
    Expose {
        socket: u32,
        buf: Msg,
        reply: oneshot::Sender<Result<RemoteTarget>>,
    },
    Close {
        socket: u32,
    },
    /// Fails the engine carrying `socket` (tests and the RPC layer's "abandon this path").
    FailEngine {
        socket: u32,
        why: String,
    },
    /// Fails every engine of the thread (RDMA taken out of service).
    FailAll {
        why: String,
    },
}

/// The application's side of an I/O thread.
#[derive(Debug)]
pub(crate) struct WorkerHandle {
    pub tx: Mutex<Sender<Cmd>>,
    pub wake: Arc<EventFd>,
    /// Set by the I/O thread while it blocks (see [`Worker::run`]).
    pub asleep: Arc<AtomicBool>,
}

impl WorkerHandle {
    pub fn send(&self, cmd: Cmd) -> Result<()> {
        self.tx.lock().send(cmd).map_err(|_| TransportError::Shutdown)?;
        // Only a blocked thread needs the eventfd (a syscall, and a wake-up for nothing when
        // it is awake). SeqCst pairs with the thread's store-then-check in `run`: either it
        // sees the command before blocking, or this sees it asleep.
        if self.asleep.load(Ordering::SeqCst) {
            // The counter saturates only after 2^64 unread wake-ups.
            let _ = self.wake.write(1);
        }
        Ok(())
    }
}

/// Engines a worker should host, sent by the bootstrap.
pub(crate) type EngineInbox<D> = Receiver<Engine<D>>;

/// Called when an engine dies, so the connection table forgets it.
pub(crate) type OnEngineGone = Arc<dyn Fn(std::net::SocketAddr, usize, u32) + Send + Sync>;

pub(crate) fn new_wake() -> Result<Arc<EventFd>> {
    EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
        .map(Arc::new)
        .map_err(|e| TransportError::Io(format!("eventfd: {e}")))
}

/// One I/O thread's state.
pub(crate) struct Worker<D: Device> {
    pub index: usize,
    pub cq: Arc<D::Cq>,
    pub cmds: Receiver<Cmd>,
    pub new_engines: EngineInbox<D>,
    pub wake: Arc<EventFd>,
    pub shutdown: Arc<AtomicBool>,
    pub spin: Duration,
    pub on_gone: OnEngineGone,
    /// True while blocked (senders then write the eventfd).
    pub asleep: Arc<AtomicBool>,
    /// How long an idle thread watches only its command queue before blocking.
    pub cmd_spin: Duration,
    /// A frozen worker is not driven (simulation of a hung host).
    pub frozen: bool,
    /// Ordered by QP number, so engines take their turns in the same order in every
    /// process (simulations replay exactly).
    engines: BTreeMap<u32, Engine<D>>,
    socket_engine: HashMap<u32, u32>,
    wcs: Vec<WorkCompletion>,
}

impl<D: Device> Worker<D> {
    #[allow(clippy::too_many_arguments)] // each is one of the thread's own resources
    pub fn new(
        index: usize,
        cq: Arc<D::Cq>,
        cmds: Receiver<Cmd>,
        new_engines: EngineInbox<D>,
        wake: Arc<EventFd>,
        shutdown: Arc<AtomicBool>,
        spin: Duration,
        on_gone: OnEngineGone,
    ) -> Worker<D> {
        Worker {
            index,
            cq,
            cmds,
            new_engines,
            wake,
            shutdown,
            spin,
            on_gone,
            asleep: Arc::new(AtomicBool::new(false)),
            cmd_spin: Duration::ZERO,
            frozen: false,
            engines: BTreeMap::new(),
            socket_engine: HashMap::new(),
            wcs: vec![WorkCompletion::default(); 64],
        }
    }

    /// The thread body.
    pub fn run(mut self) {
        let mut idle_since: Option<Instant> = None;
        while !self.shutdown.load(Ordering::Acquire) {
            let now = clock::now();
            let mut busy = self.turn(now);
            if busy {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.spin {
                std::hint::spin_loop();
                continue;
            }
            // Request/response: what was just delivered is often answered within microseconds.
            // Watching only the command queue (no CQ poll, no syscall) for a moment catches
            // that answer without a sleep and a wake-up.
            if !self.cmd_spin.is_zero() {
                let until = clock::now() + self.cmd_spin;
                let mut got = None;
                while got.is_none() && clock::now() < until {
                    got = self.cmds.try_recv().ok();
                    std::hint::spin_loop();
                }
                if let Some(cmd) = got {
                    self.apply(cmd);
                    idle_since = None;
                    continue;
                }
            }
            // Announce the sleep, then look for a command that raced it (Dekker with `send`).
            self.asleep.store(true, Ordering::SeqCst);
            if let Ok(cmd) = self.cmds.try_recv() {
                self.asleep.store(false, Ordering::SeqCst);
                self.apply(cmd);
                idle_since = None;
                continue;
            }
            let timeout = self
                .next_deadline()
                .map_or(MAX_BLOCK, |t| t.saturating_duration_since(now))
                .min(MAX_BLOCK);
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = match self.cq.wait_or(&mut wcs, self.wake.as_fd(), timeout) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(worker = self.index, %e, "waiting on the CQ failed");
                    0
                }
            };
            self.asleep.store(false, Ordering::SeqCst);
            let _ = self.wake.read();
            let now = clock::now();
            busy |= self.dispatch(&wcs[..n], now);
            self.wcs = wcs;
            if busy {
                idle_since = None;
            }
        }
        for (_, mut e) in std::mem::take(&mut self.engines) {
            e.fail("transport shut down".into());
        }
    }

    /// One pass: commands, new engines, completions, timers, posting. True if anything
    /// happened.
    pub fn turn(&mut self, now: Instant) -> bool {
        let mut busy = false;
        while let Ok(e) = self.new_engines.try_recv() {
            busy = true;
            self.engines.insert(e.qpn, e);
        }
        // Sockets a peer opened during the last dispatch are known before any command about
        // them is applied (the application may already hold them).
        self.housekeeping();
        while let Ok(cmd) = self.cmds.try_recv() {
            busy = true;
            self.apply(cmd);
        }
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = match self.cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    // An overrun CQ has lost completions: nothing on it can be trusted.
                    tracing::error!(worker = self.index, %e, "polling the CQ failed");
                    for eng in self.engines.values_mut() {
                        eng.fail(format!("completion queue failed: {e}"));
                    }
                    self.wcs = wcs;
                    busy = true;
                    break;
                }
            };
            busy |= self.dispatch(&wcs[..n], now);
            let full = n == wcs.len();
            self.wcs = wcs;
            if !full {
                break;
            }
        }
        for e in self.engines.values_mut() {
            if e.next_deadline().is_some_and(|t| t <= now) {
                e.tick(now);
            }
            if e.has_work() && e.fill() > 0 {
                busy = true;
            }
        }
        self.housekeeping();
        busy
    }

    fn dispatch(&mut self, wcs: &[WorkCompletion], now: Instant) -> bool {
        for wc in wcs {
            if !self.engines.contains_key(&wc.qp_num) {
                // An engine handed over since this turn began.
                while let Ok(e) = self.new_engines.try_recv() {
                    self.engines.insert(e.qpn, e);
                }
            }
            match self.engines.get_mut(&wc.qp_num) {
                Some(e) => e.on_completion(wc, now),
                None => tracing::debug!(qpn = wc.qp_num, "completion for a QP with no engine"),
            }
        }
        !wcs.is_empty()
    }

    /// The earliest engine timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.engines.values().filter_map(|e| e.next_deadline()).min()
    }

    fn engine_of(&mut self, socket: u32) -> Option<&mut Engine<D>> {
        let qpn = *self.socket_engine.get(&socket)?;
        self.engines.get_mut(&qpn)
    }

    fn apply(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Open { engine, socket, inbox, reply } => match self.engines.get_mut(&engine) {
                Some(e) => {
                    e.open_socket(socket, inbox, reply);
                    self.socket_engine.insert(socket, engine);
                }
                None => {
                    let _ = reply
                        .send(Err(TransportError::ConnectionLost("the engine is gone".into())));
                }
            },
            Cmd::Send { socket, msg, target, done } => match self.engine_of(socket) {
                Some(e) => e.enqueue(socket, msg, target, done),
                None => done.finish(Err(TransportError::Closed)),
            },
            Cmd::Expose { socket, buf, reply } => {
                let r = match self.engine_of(socket) {
                    Some(e) => e.expose(socket, buf),
                    None => Err(TransportError::Closed),
                };
                let _ = reply.send(r);
            }
            Cmd::Close { socket } => {
                if let Some(e) = self.engine_of(socket) {
                    e.close_socket(socket);
                }
                self.socket_engine.remove(&socket);
            }
            Cmd::FailEngine { socket, why } => {
                if let Some(e) = self.engine_of(socket) {
                    e.fail(why);
                }
            }
            Cmd::FailAll { why } => {
                for e in self.engines.values_mut() {
                    e.fail(why.clone());
                }
            }
        }
    }

    fn housekeeping(&mut self) {
        let mut dead = Vec::new();
        for (&qpn, e) in self.engines.iter_mut() {
            for id in e.new_sockets.drain(..) {
                self.socket_engine.insert(id, qpn);
            }
            for id in e.gone_sockets.drain(..) {
                self.socket_engine.remove(&id);
            }
            if matches!(e.state, EngineState::Failed(_)) {
                dead.push(qpn);
            }
        }
        for qpn in dead {
            if let Some(e) = self.engines.remove(&qpn) {
                (self.on_gone)(e.peer_addr, self.index, qpn);
            }
        }
    }
}
