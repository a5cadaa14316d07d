//! The UDP wire: one socket per device carries every QP's packets.
//!
//! Progress is driven from three places, so that no single thread is a hop on the fast path:
//! the posting thread transmits inline (the doorbell); a polling thread that finds its CQ empty
//! receives inline; and a progress thread guarantees progress when nobody polls (timers,
//! blocked waiters). The progress thread spins for `spin` after its last work and then blocks
//! on the socket and a waker eventfd: pure busy polling ruins tail latency on small machines.
//!
//! Lock order: `tx` then the core, or `rx` then the core; `rx` and `tx` never nest.

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeSpec;
use parking_lot::Mutex;

use super::core::{Counters, NicConfig};
use super::fault::{FaultPlan, Verdict};
use super::DevInner;
use crate::clock::wall_now;
use crate::device::{Error, Result};

/// Datagrams taken from the socket per receive turn.
const RX_BATCH: usize = 32;
/// Packets drained from the core per transmit turn.
const TX_BATCH: usize = 32;
/// Longest the progress thread blocks when no timer is due sooner.
const MAX_BLOCK: Duration = Duration::from_millis(50);

/// Settings of a UDP-wire device.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// Local address; its IP is the device's GID, so it must be a specific address.
    /// Port 0 picks a free port (RoCEv2's is 4791).
    pub bind: SocketAddr,
    /// Protocol tunables.
    pub nic: NicConfig,
    /// Socket send and receive buffer size (set with the FORCE options when root).
    pub socket_buffer_bytes: usize,
    /// How long the progress thread busy-polls after its last work before blocking.
    pub spin: Duration,
}

impl UdpConfig {
    /// Defaults for a device bound to `bind`.
    pub fn new(bind: SocketAddr) -> UdpConfig {
        UdpConfig {
            bind,
            nic: NicConfig::default(),
            socket_buffer_bytes: 32 << 20,
            spin: Duration::from_micros(20),
        }
    }
}

#[derive(Debug, Default)]
struct WireStats {
    send_errors: AtomicU64,
    recv_errors: AtomicU64,
    fault_drops: AtomicU64,
}

#[derive(Debug)]
struct RxState {
    bufs: Vec<Vec<u8>>,
    meta: Vec<(usize, SocketAddr)>,
}

#[derive(Debug, Default)]
struct TxState {
    batch: Vec<(Vec<u8>, SocketAddr)>,
    pool: Vec<Vec<u8>>,
}

#[derive(Debug)]
struct Shared {
    socket: UdpSocket,
    waker: EventFd,
    shutdown: AtomicBool,
    rx: Mutex<RxState>,
    tx: Mutex<TxState>,
    faults: Mutex<Option<FaultPlan>>,
    has_faults: AtomicBool,
    stats: WireStats,
    /// When the progress thread plans to wake, in ns after `epoch` (u64::MAX: not blocked).
    thread_wake_ns: AtomicU64,
    epoch: Instant,
}

/// The UDP wire of one device.
#[derive(Debug)]
pub struct UdpWire {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn os(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Os { what, source }
}

impl UdpWire {
    pub(crate) fn bind(cfg: &UdpConfig) -> Result<(UdpWire, SocketAddr)> {
        if cfg.bind.ip().is_unspecified() {
            return Err(Error::InvalidArgument(format!(
                "bind address {} is unspecified: bind a specific IP, peers use it as the GID",
                cfg.bind
            )));
        }
        let socket = UdpSocket::bind(cfg.bind).map_err(os("bind UDP socket"))?;
        socket.set_nonblocking(true).map_err(os("set UDP socket non-blocking"))?;
        let want = cfg.socket_buffer_bytes;
        // FORCE variants pass rmem_max/wmem_max as root; fall back to the capped ones.
        if setsockopt(&socket, sockopt::RcvBufForce, &want).is_err() {
            let _ = setsockopt(&socket, sockopt::RcvBuf, &want);
        }
        if setsockopt(&socket, sockopt::SndBufForce, &want).is_err() {
            let _ = setsockopt(&socket, sockopt::SndBuf, &want);
        }
        let local = socket.local_addr().map_err(os("UDP local_addr"))?;
        let waker =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Error::Os { what: "eventfd", source: e.into() })?;
        let shared = Arc::new(Shared {
            socket,
            waker,
            shutdown: AtomicBool::new(false),
            rx: Mutex::new(RxState {
                bufs: (0..RX_BATCH).map(|_| vec![0u8; 65536]).collect(),
                meta: Vec::with_capacity(RX_BATCH),
            }),
            tx: Mutex::new(TxState::default()),
            faults: Mutex::new(None),
            has_faults: AtomicBool::new(false),
            stats: WireStats::default(),
            thread_wake_ns: AtomicU64::new(u64::MAX),
            epoch: wall_now(),
        });
        Ok((UdpWire { shared, thread: Mutex::new(None) }, local))
    }

    pub(crate) fn start_progress_thread(&self, dev: Weak<DevInner>, cfg: &UdpConfig) -> Result<()> {
        let shared = self.shared.clone();
        let spin = cfg.spin;
        let handle = std::thread::Builder::new()
            .name("soft-rnic".into())
            .spawn(move || progress_thread(dev, shared, spin))
            .map_err(os("spawn progress thread"))?;
        *self.thread.lock() = Some(handle);
        Ok(())
    }

    pub(crate) fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = self.shared.waker.write(1);
        if let Some(h) = self.thread.lock().take() {
            // The last device handle can be dropped on the progress thread itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    pub(crate) fn set_faults(&self, plan: Option<FaultPlan>) {
        let mut f = self.shared.faults.lock();
        self.shared.has_faults.store(plan.is_some(), Ordering::Release);
        *f = plan;
    }

    /// Adds the wire's own counts to the core's.
    pub(crate) fn add_counters(&self, c: &mut Counters) {
        let s = &self.shared.stats;
        c.wire_send_errors = s.send_errors.load(Ordering::Relaxed);
        c.wire_recv_errors = s.recv_errors.load(Ordering::Relaxed);
        c.wire_fault_drops = s.fault_drops.load(Ordering::Relaxed);
    }

    /// Receives what is waiting and processes it, then transmits. Never blocks.
    pub(crate) fn progress(&self, dev: &DevInner, now: Instant) -> bool {
        self.shared.progress(dev, now)
    }

    /// Transmits whatever the core has ready.
    pub(crate) fn flush_tx(&self, dev: &DevInner, now: Instant) -> usize {
        self.shared.flush_tx(dev, now)
    }
}

impl Shared {
    fn progress(&self, dev: &DevInner, now: Instant) -> bool {
        let mut received = 0;
        if let Some(mut rx) = self.rx.try_lock() {
            let rx = &mut *rx;
            rx.meta.clear();
            while rx.meta.len() < RX_BATCH {
                let i = rx.meta.len();
                match self.socket.recv_from(&mut rx.bufs[i]) {
                    Ok((len, from)) => rx.meta.push((len, from)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => {
                        // ICMP errors surface here on Linux (peer port closed): count, go on.
                        self.stats.recv_errors.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            received = rx.meta.len();
            let mut core = dev.core.lock();
            for (i, &(len, from)) in rx.meta.iter().enumerate() {
                core.handle_packet(now, from, &rx.bufs[i][..len]);
            }
            if core.poll_timeout().is_some_and(|t| t <= now) {
                core.handle_timeout(now);
            }
        }
        let sent = self.flush_tx(dev, now);
        received + sent > 0
    }

    fn flush_tx(&self, dev: &DevInner, now: Instant) -> usize {
        let mut tx = self.tx.lock();
        let tx = &mut *tx;
        let mut total = 0;
        loop {
            let next_timer;
            {
                let mut core = dev.core.lock();
                while tx.batch.len() < TX_BATCH {
                    let mut buf = tx.pool.pop().unwrap_or_default();
                    match core.poll_transmit(now, &mut buf) {
                        Some(dest) => tx.batch.push((buf, dest)),
                        None => {
                            tx.pool.push(buf);
                            break;
                        }
                    }
                }
                next_timer = core.poll_timeout();
            }
            self.maybe_wake_for(next_timer);
            if tx.batch.is_empty() {
                return total;
            }
            let full = tx.batch.len() == TX_BATCH;
            total += tx.batch.len();
            for (mut buf, dest) in tx.batch.drain(..) {
                self.send_one(dev.local, &mut buf, dest);
                tx.pool.push(buf);
            }
            if !full {
                return total;
            }
        }
    }

    /// Wakes the progress thread if a timer is now due before it planned to wake.
    fn maybe_wake_for(&self, next_timer: Option<Instant>) {
        let Some(t) = next_timer else { return };
        let due = t.saturating_duration_since(self.epoch).as_nanos() as u64;
        if due < self.thread_wake_ns.load(Ordering::Acquire) {
            let _ = self.waker.write(1);
        }
    }

    fn send_one(&self, local: SocketAddr, buf: &mut [u8], dest: SocketAddr) {
        let mut copies = 1;
        if self.has_faults.load(Ordering::Acquire) {
            if let Some(plan) = self.faults.lock().as_mut() {
                match plan.judge(local, dest, buf) {
                    Verdict::Pass | Verdict::Reorder => {}
                    Verdict::Drop => {
                        self.stats.fault_drops.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Verdict::Duplicate => copies = 2,
                    Verdict::Corrupt => plan.corrupt(buf),
                }
            }
        }
        for _ in 0..copies {
            loop {
                match self.socket.send_to(buf, dest) {
                    Ok(_) => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        // Socket buffer full: wait for room rather than drop (a drop costs an
                        // ACK timeout).
                        let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLOUT)];
                        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10u8));
                    }
                    Err(_) => {
                        // Unreachable peer and similar: the packet is lost, the protocol
                        // retransmits or fails the QP by its retry count.
                        self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
        }
    }
}

fn progress_thread(dev: Weak<DevInner>, shared: Arc<Shared>, spin: Duration) {
    let mut idle_since: Option<Instant> = None;
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let Some(inner) = dev.upgrade() else { return };
        let now = wall_now();
        let did = shared.progress(&inner, now);
        let next = inner.core.lock().poll_timeout();
        drop(inner);
        if did {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert(now);
        if now.duration_since(since) < spin {
            std::hint::spin_loop();
            continue;
        }
        let block = next.map_or(MAX_BLOCK, |t| t.saturating_duration_since(now)).min(MAX_BLOCK);
        let wake_at = (now + block).saturating_duration_since(shared.epoch).as_nanos() as u64;
        shared.thread_wake_ns.store(wake_at, Ordering::Release);
        {
            let mut fds = [
                PollFd::new(shared.socket.as_fd(), PollFlags::POLLIN),
                PollFd::new(shared.waker.as_fd(), PollFlags::POLLIN),
            ];
            let _ = nix::poll::ppoll(&mut fds, Some(TimeSpec::from_duration(block)), None);
        }
        shared.thread_wake_ns.store(u64::MAX, Ordering::Release);
        let _ = shared.waker.read();
        idle_since = None;
    }
}
