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
use nix::sys::socket::{getsockopt, setsockopt, sockopt};
use nix::sys::time::TimeSpec;
use parking_lot::Mutex;

use super::core::{Counters, NicConfig};
use super::fault::{FaultPlan, Verdict};
use super::DevInner;
use crate::clock::wall_now;
use crate::device::{Error, Result};

/// Receive buffers per `recvmmsg` (each may hold a GRO train of datagrams).
const RX_BATCH: usize = 16;
/// A receive buffer: room for the longest GRO train the kernel builds (64 segments) of
/// 4 KiB-MTU packets; larger soft-MTU datagrams arrive alone.
const RX_BUF: usize = 64 * (4096 + 64);
/// Most `recvmmsg` calls per receive turn (bounds how long one turn holds the core).
const RX_CALLS: usize = 4;
/// Packets drained from the core per transmit turn.
const TX_BATCH: usize = 64;
/// Most bytes one GSO send carries.
const GSO_MAX_BYTES: usize = 64_000;
/// Longest the progress thread blocks when no timer is due sooner.
const MAX_BLOCK: Duration = Duration::from_millis(50);
/// While application threads drive the NIC (polling, or blocked on a CQ's wait set), the
/// progress thread stands back and only checks this often that they still do: packets and
/// timers are theirs, and a wake-up of this thread per message would cost more than it saves.
const DRIVER_RECHECK: Duration = Duration::from_millis(1);

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
    /// How long the progress thread busy-polls after its last work before blocking (0: block
    /// at once).
    pub spin: Duration,
}

impl UdpConfig {
    /// Defaults for a device bound to `bind`.
    pub fn new(bind: SocketAddr) -> UdpConfig {
        UdpConfig {
            bind,
            nic: NicConfig::default(),
            socket_buffer_bytes: 32 << 20,
            // Spinning only pays when the thread has a core to itself; on small machines it
            // steals the CPU from the threads it should serve.
            spin: Duration::ZERO,
        }
    }
}

#[derive(Debug, Default)]
struct WireStats {
    send_errors: AtomicU64,
    /// A send larger than the link's MTU was reported (once: it is a configuration error).
    too_big_reported: AtomicBool,
    recv_errors: AtomicU64,
    fault_drops: AtomicU64,
}

#[derive(Debug)]
struct RxState {
    bufs: Vec<Vec<u8>>,
    meta: Vec<quinn_udp::RecvMeta>,
}

#[derive(Debug, Default)]
struct TxState {
    batch: Vec<(Vec<u8>, SocketAddr)>,
    pool: Vec<Vec<u8>>,
    /// What IPv4 identifications change in ICRCs, per packet length (GSO segments).
    ipv4_ids: super::packet::Ipv4Ids,
}

#[derive(Debug)]
struct Shared {
    socket: UdpSocket,
    /// recvmmsg/GRO and GSO on the socket (quinn-udp keeps the unsafe on its side).
    udp: quinn_udp::UdpSocketState,
    waker: EventFd,
    shutdown: AtomicBool,
    rx: Mutex<RxState>,
    tx: Mutex<TxState>,
    faults: Mutex<Option<FaultPlan>>,
    has_faults: AtomicBool,
    stats: WireStats,
    /// When the progress thread plans to wake, in ns after `epoch` (u64::MAX: not blocked).
    thread_wake_ns: AtomicU64,
    /// Threads blocked in `SoftCq::wait` on a set that includes the socket (they receive and
    /// run timers themselves).
    waiters: AtomicU64,
    /// Completion queues whose owners drive the NIC from an event loop for as long as they
    /// live (`CompletionQueue::drive_from_event_loop`): they run the timers, so the progress
    /// thread sleeps.
    event_loops: AtomicU64,
    /// Their wait sets, oldest first. Only the first holds the socket: a datagram wakes one
    /// loop, whose poll receives for all of them and signals the others' queues, instead of
    /// waking every loop of the device for the same packet.
    loop_sets: Mutex<Vec<(u64, Arc<nix::sys::epoll::Epoll>)>>,
    next_loop_id: AtomicU64,
    /// Event-loop mode: the last receive found the socket empty, so polls skip the
    /// `recvmmsg` until the loop reports that the socket fired again (`rx_fired`). Saves
    /// the empty receives (a syscall each) of every poll between two packets.
    rx_drained: AtomicBool,
    /// When an application thread last drove the NIC by polling, ns after `epoch`.
    last_inline_ns: AtomicU64,
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
        // Also sets IP_PMTUDISC_PROBE: like RoCE, packets never fragment, so the path MTU
        // (soft MTUs included) must fit the link's MTU; loopback's is 64 KiB.
        let udp =
            quinn_udp::UdpSocketState::new((&socket).into()).map_err(os("configure UDP socket"))?;
        let want = cfg.socket_buffer_bytes;
        // FORCE variants pass rmem_max/wmem_max as root; fall back to the capped ones.
        if setsockopt(&socket, sockopt::RcvBufForce, &want).is_err() {
            let _ = setsockopt(&socket, sockopt::RcvBuf, &want);
        }
        if setsockopt(&socket, sockopt::SndBufForce, &want).is_err() {
            let _ = setsockopt(&socket, sockopt::SndBuf, &want);
        }
        // Without CAP_NET_ADMIN (a container's non-root user) the kernel caps both at
        // rmem_max/wmem_max, often a few hundred KiB: bursts then drop and cost ACK timeouts.
        // Said once, with the fix, rather than silently (the kernel reports twice the size).
        let got = (
            getsockopt(&socket, sockopt::RcvBuf).unwrap_or(0) / 2,
            getsockopt(&socket, sockopt::SndBuf).unwrap_or(0) / 2,
        );
        if got.0 < want || got.1 < want {
            tracing::warn!(
                wanted = want,
                receive = got.0,
                send = got.1,
                "UDP socket buffers capped below the wanted size: raise net.core.rmem_max and \
                 net.core.wmem_max, or run with CAP_NET_ADMIN"
            );
        }
        let local = socket.local_addr().map_err(os("UDP local_addr"))?;
        let waker =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Error::Os { what: "eventfd", source: e.into() })?;
        let shared = Arc::new(Shared {
            socket,
            udp,
            waker,
            shutdown: AtomicBool::new(false),
            rx: Mutex::new(RxState {
                bufs: (0..RX_BATCH).map(|_| vec![0u8; RX_BUF]).collect(),
                meta: vec![quinn_udp::RecvMeta::default(); RX_BATCH],
            }),
            tx: Mutex::new(TxState::default()),
            faults: Mutex::new(None),
            has_faults: AtomicBool::new(false),
            stats: WireStats::default(),
            thread_wake_ns: AtomicU64::new(u64::MAX),
            waiters: AtomicU64::new(0),
            event_loops: AtomicU64::new(0),
            loop_sets: Mutex::new(Vec::new()),
            next_loop_id: AtomicU64::new(1),
            rx_drained: AtomicBool::new(false),
            last_inline_ns: AtomicU64::new(0),
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

    /// Marks a thread as blocked on a wait set that includes the socket (until the guard drops).
    pub(crate) fn waiting(&self) -> WaiterGuard<'_> {
        self.shared.waiters.fetch_add(1, Ordering::AcqRel);
        WaiterGuard { wire: self }
    }

    /// An event loop drives the NIC through the CQ whose wait set is `set` (holding the
    /// socket) until [`UdpWire::event_loop_gone`] with the returned id. The first loop keeps
    /// watching the socket; later ones drop it from their sets.
    pub(crate) fn event_loop_attached(&self, set: Arc<nix::sys::epoll::Epoll>) -> Result<u64> {
        let id = self.shared.next_loop_id.fetch_add(1, Ordering::Relaxed);
        let mut sets = self.shared.loop_sets.lock();
        if !sets.is_empty() {
            set.delete(self.shared.socket.as_fd())
                .map_err(|e| Error::Os { what: "epoll_ctl(DEL socket)", source: e.into() })?;
        }
        sets.push((id, set));
        self.shared.event_loops.fetch_add(1, Ordering::AcqRel);
        // The progress thread may be blocked on the socket: let it see the change.
        let _ = self.shared.waker.write(1);
        Ok(id)
    }

    /// Event loop `id` stopped driving the NIC; if it watched the socket, the next oldest
    /// takes over.
    pub(crate) fn event_loop_gone(&self, id: u64) {
        use nix::sys::epoll::{EpollEvent, EpollFlags};
        let mut sets = self.shared.loop_sets.lock();
        let Some(i) = sets.iter().position(|(x, _)| *x == id) else { return };
        sets.remove(i);
        if i == 0 {
            if let Some((_, next)) = sets.first() {
                // Level-triggered: a datagram already waiting makes it readable at once.
                let ev = EpollEvent::new(EpollFlags::EPOLLIN, 1);
                if let Err(e) = next.add(self.shared.socket.as_fd(), ev) {
                    tracing::error!(%e, "handing the socket to the next event loop failed");
                }
                self.shared.rx_drained.store(false, Ordering::Release);
            }
        }
        self.shared.event_loops.fetch_sub(1, Ordering::AcqRel);
        let _ = self.shared.waker.write(1);
    }

    /// True if event loop `id` watches the socket.
    pub(crate) fn watches_socket(&self, id: u64) -> bool {
        self.shared.loop_sets.lock().first().is_some_and(|(x, _)| *x == id)
    }

    /// The socket, for wait sets.
    pub(crate) fn socket_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.socket.as_fd()
    }

    /// Receives what is waiting and processes it, then transmits. Never blocks. Called by
    /// application threads (polling an empty CQ).
    pub(crate) fn progress(&self, dev: &DevInner, now: Instant) -> bool {
        let ns = self.shared.ns(now);
        self.shared.last_inline_ns.fetch_max(ns, Ordering::AcqRel);
        self.shared.progress(dev, now, false)
    }

    /// [`UdpWire::progress`] for an event loop: once a receive found the socket empty, the
    /// next ones are skipped (timers and transmission still run) until
    /// [`UdpWire::rx_fired`]. Sound because the loop clears its readiness before it polls,
    /// so a datagram that lands after the last receive raises a new event.
    pub(crate) fn progress_event_loop(&self, dev: &DevInner, now: Instant) -> bool {
        self.shared.progress(dev, now, true)
    }

    /// The event loop saw the socket (or a CQ) fire: receive again.
    pub(crate) fn rx_fired(&self) {
        self.shared.rx_drained.store(false, Ordering::Release);
    }

    /// Transmits whatever the core has ready.
    pub(crate) fn flush_tx(&self, dev: &DevInner, now: Instant) -> usize {
        self.shared.flush_tx(dev, now)
    }
}

impl Shared {
    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// True while application threads drive the NIC themselves.
    fn drivers_active(&self, now: Instant) -> bool {
        self.event_loops.load(Ordering::Acquire) > 0
            || self.waiters.load(Ordering::Acquire) > 0
            || self.ns(now)
                < self.last_inline_ns.load(Ordering::Acquire) + DRIVER_RECHECK.as_nanos() as u64
    }

    fn progress(&self, dev: &DevInner, now: Instant, event_loop: bool) -> bool {
        let mut received = 0;
        let skip_rx = event_loop && self.rx_drained.load(Ordering::Acquire);
        if let Some(mut rx) = self.rx.try_lock() {
            let rx = &mut *rx;
            let mut core = None;
            for _ in 0..if skip_rx { 0 } else { RX_CALLS } {
                let n = {
                    let mut iovs: Vec<std::io::IoSliceMut<'_>> =
                        rx.bufs.iter_mut().map(|b| std::io::IoSliceMut::new(b)).collect();
                    match self.udp.recv((&self.socket).into(), &mut iovs, &mut rx.meta) {
                        Ok(n) => n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            if event_loop {
                                self.rx_drained.store(true, Ordering::Release);
                            }
                            break;
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(_) => {
                            // ICMP errors surface here on Linux (peer port closed): count.
                            self.stats.recv_errors.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                };
                let core = core.get_or_insert_with(|| dev.core.lock());
                for (buf, meta) in rx.bufs.iter().zip(&rx.meta).take(n) {
                    let data = &buf[..meta.len.min(buf.len())];
                    // A GRO train: datagrams at `stride` offsets, the last maybe shorter.
                    for datagram in data.chunks(meta.stride.max(1)) {
                        core.handle_packet(now, meta.addr, datagram);
                        received += 1;
                    }
                }
                if n < rx.bufs.len() {
                    // A short batch emptied the socket as of this call.
                    if event_loop {
                        self.rx_drained.store(true, Ordering::Release);
                    }
                    break;
                }
            }
            let core = core.get_or_insert_with(|| dev.core.lock());
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
                // Only a progress thread that may sleep through a new timer needs it (the
                // look-up walks every QP; event loops ask for it when they wait).
                next_timer = if self.drivers_active(now) { None } else { core.poll_timeout() };
            }
            self.maybe_wake_for(now, next_timer);
            if tx.batch.is_empty() {
                return total;
            }
            let full = tx.batch.len() == TX_BATCH;
            total += tx.batch.len();
            self.send_batch(dev.local, tx);
            if !full {
                return total;
            }
        }
    }

    /// Sends the batch, joining runs of equal-size packets to one peer into GSO sends (the
    /// last of a run may be shorter), and returns the buffers to the pool.
    fn send_batch(&self, local: SocketAddr, tx: &mut TxState) {
        // A segment's IPv4 identification is its index, which receivers accept below
        // `IPV4_IDS`.
        let max_segments = self.udp.max_gso_segments().min(usize::from(super::packet::IPV4_IDS));
        let mut i = 0;
        while i < tx.batch.len() {
            let (dest, seg) = (tx.batch[i].1, tx.batch[i].0.len());
            let mut j = i + 1;
            let mut bytes = seg;
            while j < tx.batch.len()
                && j - i < max_segments
                && tx.batch[j].1 == dest
                && tx.batch[j - 1].0.len() == seg
                && tx.batch[j].0.len() <= seg
                && bytes + tx.batch[j].0.len() <= GSO_MAX_BYTES
            {
                bytes += tx.batch[j].0.len();
                j += 1;
            }
            if j - i == 1 || self.has_faults.load(Ordering::Acquire) {
                // Faults judge packets one by one.
                for k in i..j {
                    let (buf, dest) = &mut tx.batch[k];
                    self.send_one(local, buf, *dest);
                }
            } else {
                // The kernel gives the k-th segment of a GSO send (IPv4, don't-fragment, an
                // unconnected socket) identification k; the ICRC covers it.
                if dest.is_ipv4() {
                    let ids = &mut tx.ipv4_ids;
                    for (k, (buf, _)) in tx.batch[i..j].iter_mut().enumerate().skip(1) {
                        super::packet::set_ipv4_id(buf, k as u16, ids);
                    }
                }
                self.transmit_run(&tx.batch[i..j], dest, seg);
            }
            i = j;
        }
        for (buf, _) in tx.batch.drain(..) {
            tx.pool.push(buf);
        }
    }

    /// Wakes the progress thread if a timer is now due before it planned to wake and no
    /// application thread is driving the NIC (one that is handles its timers).
    fn maybe_wake_for(&self, now: Instant, next_timer: Option<Instant>) {
        let Some(t) = next_timer else { return };
        if self.drivers_active(now) {
            return;
        }
        let due = self.ns(t);
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
            self.transmit(buf, dest, None);
        }
    }

    /// One GSO send of a run of packets to one peer, gathered from their own buffers (no
    /// concatenation copy): every packet `segment` bytes but the last, which may be shorter.
    fn transmit_run(&self, run: &[(Vec<u8>, SocketAddr)], destination: SocketAddr, segment: usize) {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, SockaddrStorage};
        use std::os::fd::AsRawFd;
        let iovs: Vec<std::io::IoSlice<'_>> =
            run.iter().map(|(b, _)| std::io::IoSlice::new(b)).collect();
        let addr = SockaddrStorage::from(destination);
        let seg = segment as u16;
        let cmsgs = [ControlMessage::UdpGsoSegments(&seg)];
        loop {
            let r = sendmsg(self.socket.as_raw_fd(), &iovs, &cmsgs, MsgFlags::empty(), Some(&addr));
            match r {
                Ok(_) => return,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => {
                    // Socket buffer full: wait for room (a drop costs an ACK timeout).
                    let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLOUT)];
                    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10u8));
                }
                Err(e) => {
                    // As in `transmit`: lost; the protocol recovers or fails the QP.
                    self.send_failed(&std::io::Error::from(e), segment, destination);
                    return;
                }
            }
        }
    }

    /// One send (GSO when `segment` is set); waits for room rather than drop.
    fn transmit(&self, contents: &[u8], destination: SocketAddr, segment: Option<usize>) {
        let t = quinn_udp::Transmit {
            destination,
            ecn: None,
            contents,
            segment_size: segment,
            src_ip: None,
        };
        loop {
            match self.udp.try_send((&self.socket).into(), &t) {
                Ok(()) => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Socket buffer full: wait for room (a drop costs an ACK timeout).
                    let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLOUT)];
                    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10u8));
                }
                Err(e) => {
                    // Unreachable peer, filtered, too big for the link, …: the packets are
                    // lost; the protocol retransmits or fails the QP by its retry count.
                    self.send_failed(&e, segment.unwrap_or(contents.len()), destination);
                    return;
                }
            }
        }
    }

    /// Counts a failed send. One too big for the link (never fragmented, as RoCE) is a
    /// configuration error that would otherwise look like a dead peer (retries exhausted,
    /// then TCP fallback), so the first is logged with its fix.
    fn send_failed(&self, e: &std::io::Error, packet: usize, destination: SocketAddr) {
        self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
        if e.raw_os_error() == Some(nix::libc::EMSGSIZE)
            && !self.stats.too_big_reported.swap(true, Ordering::Relaxed)
        {
            tracing::error!(
                packet_bytes = packet,
                %destination,
                "the link's MTU is smaller than a RoCE packet: set [transport] path_mtu to at \
                 most the interface MTU minus 63 B (IPv4; 83 B for IPv6), e.g. 1024 on a \
                 1500 B network, or raise the MTU; `bex-cluster doctor` checks it"
            );
        }
    }
}

/// Holds a waiter registration.
#[derive(Debug)]
pub(crate) struct WaiterGuard<'a> {
    wire: &'a UdpWire,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.wire.shared.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An epoll set that becomes readable when `a` or `b` does (level-triggered).
pub(crate) fn wait_set(
    a: std::os::fd::BorrowedFd<'_>,
    b: std::os::fd::BorrowedFd<'_>,
) -> Result<Arc<nix::sys::epoll::Epoll>> {
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
    let err = |e: nix::errno::Errno| Error::Os { what: "epoll", source: e.into() };
    let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(err)?;
    ep.add(a, EpollEvent::new(EpollFlags::EPOLLIN, 0)).map_err(err)?;
    ep.add(b, EpollEvent::new(EpollFlags::EPOLLIN, 1)).map_err(err)?;
    Ok(Arc::new(ep))
}

fn progress_thread(dev: Weak<DevInner>, shared: Arc<Shared>, spin: Duration) {
    let mut idle_since: Option<Instant> = None;
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        if shared.event_loops.load(Ordering::Acquire) > 0 {
            // Event loops watch the socket and run the timers for as long as they live; this
            // thread only waits to be told they are gone (or the device is).
            let mut fds = [PollFd::new(shared.waker.as_fd(), PollFlags::POLLIN)];
            let _ = nix::poll::ppoll(&mut fds, Some(TimeSpec::from_duration(MAX_BLOCK)), None);
            let _ = shared.waker.read();
            idle_since = None;
            continue;
        }
        let Some(inner) = dev.upgrade() else { return };
        let now = wall_now();
        let did = shared.progress(&inner, now, false);
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
        let active = shared.drivers_active(now);
        let block = if active {
            DRIVER_RECHECK
        } else {
            next.map_or(MAX_BLOCK, |t| t.saturating_duration_since(now)).min(MAX_BLOCK)
        };
        let wake_at = shared.ns(now + block);
        shared.thread_wake_ns.store(wake_at, Ordering::Release);
        {
            let mut fds = [
                PollFd::new(shared.waker.as_fd(), PollFlags::POLLIN),
                PollFd::new(shared.socket.as_fd(), PollFlags::POLLIN),
            ];
            let watch = if active { &mut fds[..1] } else { &mut fds[..] };
            let _ = nix::poll::ppoll(watch, Some(TimeSpec::from_duration(block)), None);
        }
        shared.thread_wake_ns.store(u64::MAX, Ordering::Release);
        let _ = shared.waker.read();
        idle_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_the_socket_refuses_is_counted_and_too_big_is_reported_once() {
        let cfg = UdpConfig::new("127.0.0.1:0".parse().unwrap());
        let (wire, local) = UdpWire::bind(&cfg).unwrap();
        let s = &wire.shared;
        // Larger than any IPv4 datagram: EMSGSIZE, as a packet over the link MTU gets with
        // don't-fragment set.
        let huge = vec![0u8; 70_000];
        s.transmit(&huge, local, None);
        s.transmit(&huge, local, None);
        assert_eq!(s.stats.send_errors.load(Ordering::Relaxed), 2);
        assert!(s.stats.too_big_reported.load(Ordering::Relaxed), "reported");
        s.transmit(&[0u8; 64], local, None);
        assert_eq!(s.stats.send_errors.load(Ordering::Relaxed), 2, "a small one goes out");
    }
}
