//! The async edge of an [`Endpoint`]: the application's calls go straight into it under a
//! lock, and one task on the application's own runtime drives it when its CQ's fd or a timer
//! fires — quinn's endpoint-driver shape, with no thread of its own.
//!
//! Why: the first design gave each endpoint an I/O thread that owned it, fed by a command
//! channel. A message then crossed up to three thread wake-ups per side (task → I/O thread,
//! NIC → I/O thread, I/O thread → task), 33 µs each on this project's VMs, where kernel TCP
//! needs one. Here a received message costs one: the runtime thread parked on the CQ's fd
//! (for the software NIC an epoll set of the CQ's eventfd and the device's UDP socket) wakes,
//! this task receives, runs the engines and wakes the waiting task, which runs on the same
//! thread without an OS wake-up; its reply is posted inline by the task that makes it.
//!
//! Doorbell batching adapts to load: a send to an engine with nothing in flight posts at once
//! and adds no delay; a send to a busy engine queues and goes out with the others of the
//! same tick in one doorbell per engine, and one sendmsg per run of packets, at the driver's
//! next flush — which on the same thread comes right after the task that sent.
//!
//! With `spin > 0` the task keeps polling (yielding between polls, so woken tasks run) for
//! that long after its last work before it waits: one wake-up less per message for machines
//! with cores to spare, wasted CPU otherwise.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bex_rnic::{CompletionQueue, Device};
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::clock;
use crate::config::Counters;
use crate::endpoint::{Done, Endpoint, PostWhen};
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload};
use crate::proto::RemoteTarget;

/// Longest the driver waits with nothing due (a safety net: events are what wake it).
const MAX_WAIT: Duration = Duration::from_millis(100);
/// A deadline sooner than this makes an idle driver let woken tasks run before it waits.
const YIELD_BEFORE: Duration = Duration::from_millis(2);
/// How far the driver's timer may sit early before it is moved (the runtime's resolution).
const TIMER_SLACK: Duration = Duration::from_millis(1);
/// Consecutive busy turns after which the driver lets other tasks run.
const BUSY_TURNS_BEFORE_YIELD: u32 = 8;

/// The application's calls into an endpoint.
pub(crate) enum Cmd {
    Open {
        engine: u32,
        socket: u32,
        inbox: mpsc::UnboundedSender<Result<Msg>>,
        reply: oneshot::Sender<Result<()>>,
    },
    Send {
        socket: u32,
        payload: Payload,
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
    /// Fails every engine of the endpoint (RDMA taken out of service).
    FailAll {
        why: String,
    },
}

/// What sockets hold of their endpoint (the device type erased).
pub(crate) trait Control: Send + Sync {
    /// Applies a call now, on the caller's thread.
    fn apply(&self, cmd: Cmd) -> Result<()>;
    /// Fails every engine and stops the driver.
    fn shutdown(&self);
}

/// An endpoint shared by the application's tasks and its driver task.
pub(crate) struct Driven<D: Device> {
    pub ep: Mutex<Endpoint<D>>,
    cq: Arc<D::Cq>,
    /// Wakes the driver: a deferred flush is due, or it should stop.
    notify: Notify,
    /// A flush is scheduled: sends queue for it instead of posting.
    flush_due: AtomicBool,
    /// The driver is (about to be) parked in its wait: only then does a send notify it.
    waiting: AtomicBool,
    shutdown: AtomicBool,
    counters: Arc<Counters>,
    spin: Duration,
}

impl<D: Device + 'static> Driven<D> {
    pub fn new(ep: Endpoint<D>, cq: Arc<D::Cq>, counters: Arc<Counters>, spin: Duration) -> Self {
        Driven {
            ep: Mutex::new(ep),
            cq,
            notify: Notify::new(),
            flush_due: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            counters,
            spin,
        }
    }

    /// Starts the driver task on the current runtime.
    pub fn spawn(self: &Arc<Self>) -> Result<tokio::task::JoinHandle<()>> {
        self.cq.drive_from_event_loop();
        #[allow(unsafe_code)]
        // SAFETY: `CqFd` holds the CQ, which owns the descriptor and keeps it open for as long
        // as the registration lives, and `CompletionQueue::fd` names the same descriptor for
        // the queue's whole life, so the fd stays valid and unchanged until the AsyncFd drops.
        let fd = unsafe {
            AsyncFd::register_with_interest(CqFd(self.cq.clone()), tokio::io::Interest::READABLE)
        }
        .map_err(|e| TransportError::Io(format!("register the CQ's fd with the runtime: {e}")))?;
        let me = self.clone();
        Ok(tokio::spawn(async move { me.run(fd).await }))
    }

    async fn run(self: Arc<Self>, fd: AsyncFd<CqFd<D::Cq>>) {
        // On a current-thread runtime a yield only requeues this task behind the ones it
        // woke; on a multi-thread one it also wakes a parked sibling worker to steal it (a
        // thread wake-up per yield), so there the driver yields only to stay fair.
        let yields_are_cheap = matches!(
            tokio::runtime::Handle::current().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::CurrentThread
        );
        let mut idle_since: Option<Instant> = None;
        let mut busy_turns = 0;
        let mut yielded = false;
        let mut timer = Box::pin(tokio::time::sleep(MAX_WAIT));
        let mut timer_at = tokio::time::Instant::now() + MAX_WAIT;
        let mut timer_fired = false;
        while !self.shutdown.load(Ordering::Acquire) {
            self.flush_due.store(false, Ordering::Release);
            let now = clock::now();
            let worked = self.ep.lock().turn(now);
            Counters::add(&self.counters.driver_turns, 1);
            if worked {
                idle_since = None;
                // The tasks this turn woke run first: a reply made now leaves at once and
                // takes the NIC's delayed ACK along. Then look for more (the NIC receives in
                // bounded batches), yielding again only now and then under sustained load.
                if (yields_are_cheap && !yielded) || busy_turns >= BUSY_TURNS_BEFORE_YIELD {
                    yielded = true;
                    busy_turns = 0;
                    tokio::task::yield_now().await;
                }
                busy_turns += 1;
                continue;
            }
            busy_turns = 0;
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.spin {
                tokio::task::yield_now().await;
                // Spinning is polling the socket without waiting for it to fire.
                if let Err(e) = self.cq.ack_events() {
                    tracing::error!(%e, "acknowledging CQ events failed");
                }
                continue;
            }
            // Arm, then look once more: a completion queued before the arm raises no event.
            let deadline = {
                let mut ep = self.ep.lock();
                if let Err(e) = ep.arm() {
                    tracing::error!(%e, "arming the CQ failed");
                }
                if ep.turn(clock::now()) {
                    continue;
                }
                ep.poll_timeout()
            };
            // A deadline this close is usually the NIC's delayed ACK of what was just
            // delivered, which the reply of a task woken by it takes along. Let those tasks
            // run first: a timer earlier than the runtime's next one costs it a self-wake
            // (an eventfd write and an empty epoll round) for nothing.
            let soon = deadline.is_some_and(|t| t.saturating_duration_since(now) < YIELD_BEFORE);
            if soon && !yielded && yields_are_cheap {
                yielded = true;
                tokio::task::yield_now().await;
                continue;
            }
            // Dekker with `apply`: either a send sees `waiting` and notifies, or this sees
            // the flush it scheduled.
            self.waiting.store(true, Ordering::SeqCst);
            if self.flush_due.load(Ordering::SeqCst) {
                self.waiting.store(false, Ordering::SeqCst);
                continue;
            }
            let wait = deadline
                .map_or(MAX_WAIT, |t| t.saturating_duration_since(clock::now()))
                .min(MAX_WAIT);
            // One timer, moved only when the deadline moves by more than the runtime's
            // resolution: registering a fresh timer per wait would be earlier than the
            // runtime's next wake (none, after the yield's park) and cost it a self-wake.
            let target = tokio::time::Instant::now() + wait;
            if timer_fired || target < timer_at || target > timer_at + TIMER_SLACK {
                timer.as_mut().reset(target);
                timer_at = target;
                timer_fired = false;
            }
            let woke = tokio::select! {
                biased;
                r = fd.readable() => match r {
                    Ok(mut guard) => {
                        // Cleared before the turn that drains it: a packet after the turn's last
                        // receive raises a new edge.
                        guard.clear_ready();
                        true
                    }
                    Err(e) => {
                        tracing::error!(%e, "waiting on the CQ's fd failed");
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        true
                    }
                },
                () = self.notify.notified() => false,
                () = &mut timer => {
                    timer_fired = true;
                    Counters::add(&self.counters.timer_wakeups, 1);
                    true
                }
            };
            self.waiting.store(false, Ordering::SeqCst);
            // A notify only brings sends to flush; the fd or a timer may bring anything.
            if woke {
                Counters::add(&self.counters.wakeups, 1);
                if let Err(e) = self.cq.ack_events() {
                    tracing::error!(%e, "acknowledging CQ events failed");
                }
            }
            idle_since = None;
            yielded = false;
        }
    }
}

impl<D: Device + 'static> Driven<D> {
    /// After work was queued for the driver (a send, a control message): raise the flag,
    /// and wake the driver if it is parked. The flag goes up *after* the work is queued —
    /// raised first, a driver between its turn and its park could clear it, find nothing,
    /// and park while the sender saw it still running: the work then waited for the next
    /// timer (the NIC's 1 ms delayed ACK made that a 1-2 ms stall for 1 % of a ranker's
    /// fetches on a multi-thread runtime).
    fn flush_soon(&self) {
        let first = !self.flush_due.swap(true, Ordering::SeqCst);
        if first && self.waiting.load(Ordering::SeqCst) {
            self.notify.notify_one();
        }
    }
}

impl<D: Device + 'static> Control for Driven<D> {
    fn apply(&self, cmd: Cmd) -> Result<()> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        match cmd {
            Cmd::Send { socket, payload, target, done } => {
                // Idle (the engine has nothing in flight): the send posts at once. Busy:
                // it queues for the driver's next flush, so a tick's worth of sends share
                // one doorbell and one sendmsg (the completions the engine waits for bring
                // the driver round anyway). A parked driver is woken for the flush.
                self.ep.lock().send(socket, payload, target, done, PostWhen::IfIdle);
                self.flush_soon();
            }
            Cmd::Open { engine, socket, inbox, reply } => {
                self.ep.lock().open(engine, socket, inbox, reply);
                self.flush_soon();
            }
            Cmd::Expose { socket, buf, reply } => {
                let _ = reply.send(self.ep.lock().expose(socket, buf));
            }
            Cmd::Close { socket } => {
                self.ep.lock().close(socket);
                self.flush_soon();
            }
            Cmd::FailEngine { socket, why } => {
                self.ep.lock().fail_engine(socket, &why);
                self.flush_soon();
            }
            Cmd::FailAll { why } => {
                self.ep.lock().fail_all(&why);
                self.flush_soon();
            }
        }
        Ok(())
    }

    fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        self.ep.lock().shut_down_all();
        self.notify.notify_one();
    }
}

/// The CQ's fd for the reactor; holding the CQ keeps the fd open while it is registered.
struct CqFd<C>(Arc<C>);

impl<C: CompletionQueue> AsRawFd for CqFd<C> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd().as_raw_fd()
    }
}
