//! The software RNIC: RC verbs over UDP (or over an in-memory fabric), modelled on Linux rxe.
//!
//! Layers, bottom up:
//! - [`packet`]: RoCEv2 header codec; [`mem`]: the key table and the only memory access;
//! - [`core`]: the sans-IO protocol ([`NicCore`]); time is passed in;
//! - two wires that drive a core: [`udp`] (a UDP socket, a progress thread that spins briefly
//!   then blocks, and inline progress from posting and polling threads) and [`fabric`] (many
//!   devices in one process on a virtual clock with seeded faults);
//! - this module: [`SoftDevice`] and its resources, implementing [`crate::Device`].

pub mod core;
pub mod cq;
pub mod fabric;
pub mod fault;
pub mod mem;
pub mod packet;
pub mod udp;

use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use parking_lot::Mutex;

pub use self::core::{Counters, NicConfig, NicCore};
use self::cq::CqShared;
pub use self::fabric::{Fabric, FabricTick, LinkFault, LinkModel, Pfc, SwitchModel, SwitchStats};
pub use self::fault::{FaultPlan, FaultRates, PacketInfo, Verdict};
pub use self::udp::UdpConfig;
use crate::device::{
    CompletionQueue, Device, DeviceCaps, Error, MemoryRegion, QpInit, QueuePair, Registrar, Result,
    SharedReceiveQueue,
};
use crate::verbs::{
    Access, InitAttrs, MrKeys, QpEndpoint, QpState, RecvWr, RtrAttrs, RtsAttrs, SendWr,
    WorkCompletion,
};

/// What moves a device's packets.
#[derive(Debug)]
pub(crate) enum Wire {
    /// A UDP socket and a progress thread.
    Udp(udp::UdpWire),
    /// A port on an in-memory fabric, pumped by [`Fabric`].
    Sim,
}

#[derive(Debug)]
pub(crate) struct DevInner {
    pub(crate) core: Mutex<NicCore>,
    pub(crate) wire: Wire,
    pub(crate) local: SocketAddr,
    name: String,
}

impl DevInner {
    /// Pushes out whatever the core wants to send (UDP wire; the fabric pumps itself).
    fn kick(&self) {
        if let Wire::Udp(w) = &self.wire {
            w.flush_tx(self, crate::clock::wall_now());
        }
    }

    /// Receives and processes what is waiting, without blocking (UDP wire); an event loop's
    /// poll skips receiving once the socket was found empty until its fd fires.
    fn progress(&self, event_loop: bool) {
        if let Wire::Udp(w) = &self.wire {
            let now = crate::clock::wall_now();
            if event_loop {
                w.progress_event_loop(self, now);
            } else {
                w.progress(self, now);
            }
        }
    }
}

impl Drop for DevInner {
    fn drop(&mut self) {
        if let Wire::Udp(w) = &self.wire {
            // Answer what was received before the socket closes.
            let now = crate::clock::wall_now();
            self.core.lock().expedite_acks(now);
            w.flush_tx(self, now);
            w.shutdown();
        }
    }
}

/// A software RNIC device. Cloning gives another handle to the same device.
#[derive(Clone, Debug)]
pub struct SoftDevice {
    inner: Arc<DevInner>,
}

impl SoftDevice {
    /// Opens a device whose packets travel as UDP datagrams from `cfg.bind`.
    pub fn open_udp(cfg: UdpConfig) -> Result<SoftDevice> {
        let (wire, local) = udp::UdpWire::bind(&cfg)?;
        // A real-time device needs keys and QPNs nobody can predict (only the fabric replays
        // seeds): mix the address, the process and the clock into the configured seed.
        let mut nic = cfg.nic.clone();
        let nanos = crate::clock::wall_nanos();
        nic.seed ^= nanos.rotate_left(17)
            ^ u64::from(std::process::id()).rotate_left(40)
            ^ u64::from(local.port());
        let inner = Arc::new(DevInner {
            core: Mutex::new(NicCore::new(nic, local)),
            wire: Wire::Udp(wire),
            local,
            name: format!("soft-udp:{local}"),
        });
        if let Wire::Udp(w) = &inner.wire {
            w.start_progress_thread(Arc::downgrade(&inner), &cfg)?;
        }
        Ok(SoftDevice { inner })
    }

    pub(crate) fn new_sim(local: SocketAddr, nic: NicConfig) -> SoftDevice {
        SoftDevice {
            inner: Arc::new(DevInner {
                core: Mutex::new(NicCore::new(nic, local)),
                wire: Wire::Sim,
                local,
                name: format!("soft-sim:{local}"),
            }),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<DevInner> {
        &self.inner
    }

    /// The address peers send this device's packets to (its GID and UDP port).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local
    }

    /// Protocol counters.
    pub fn counters(&self) -> Counters {
        let mut c = self.inner.core.lock().counters();
        if let Wire::Udp(w) = &self.inner.wire {
            w.add_counters(&mut c);
        }
        c
    }

    /// Installs a fault plan on this device's outbound packets (UDP wire only; the fabric has
    /// its own). Meant for tests and for studying loss; `None` removes it.
    pub fn set_outbound_faults(&self, plan: Option<FaultPlan>) -> Result<()> {
        match &self.inner.wire {
            Wire::Udp(w) => {
                w.set_faults(plan);
                Ok(())
            }
            Wire::Sim => Err(Error::Unsupported("fabric devices take faults from the Fabric")),
        }
    }

    /// A [`Registrar`] that registers blocks in `pd` with full access.
    pub fn registrar(&self, pd: &SoftPd) -> SoftRegistrar {
        SoftRegistrar { dev: self.inner.clone(), pd: pd.id }
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct SoftPd {
    id: u32,
    _dev: Arc<DevInner>,
}

/// A thread domain (the software RNIC has none; the type exists so the trait is complete).
#[derive(Debug)]
pub struct SoftTd(());

/// A memory region; deregistered on drop.
#[derive(Debug)]
pub struct SoftMr {
    keys: MrKeys,
    dev: Arc<DevInner>,
}

impl MemoryRegion for SoftMr {
    fn keys(&self) -> MrKeys {
        self.keys
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.dev.core.lock().dereg_mr(self.keys.lkey);
    }
}

/// A completion queue.
///
/// On the UDP wire its fd is an epoll set of the queue's eventfd *and* the device's socket: a
/// thread blocked on it wakes when a packet arrives and drives the NIC itself on its next
/// `poll`, so a blocking waiter costs one wake-up per message, as with a plain socket, instead
/// of a hand-off through the progress thread.
#[derive(Debug)]
pub struct SoftCq {
    shared: Arc<CqShared>,
    dev: Arc<DevInner>,
    epoll: Option<Arc<nix::sys::epoll::Epoll>>,
    /// An event loop drives the NIC through this queue (see `drive_from_event_loop`).
    event_loop: std::sync::atomic::AtomicBool,
    /// Its id with the wire (0: none yet).
    loop_id: std::sync::atomic::AtomicU64,
}

impl Drop for SoftCq {
    fn drop(&mut self) {
        let id = self.loop_id.load(std::sync::atomic::Ordering::Acquire);
        if id != 0 {
            if let Wire::Udp(w) = &self.dev.wire {
                w.event_loop_gone(id);
            }
        }
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.shared.pop_into(out)?;
        if n > 0 || out.is_empty() {
            return Ok(n);
        }
        // Nothing yet: drive the NIC from this thread, as a busy-polling consumer would.
        self.dev.progress(self.event_loop.load(std::sync::atomic::Ordering::Relaxed));
        self.shared.pop_into(out)
    }
    fn arm(&self) -> Result<()> {
        self.shared.arm();
        Ok(())
    }
    fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match &self.epoll {
            Some(ep) => ep.0.as_fd(),
            None => self.shared.fd(),
        }
    }
    fn ack_events(&self) -> Result<()> {
        // Whoever acknowledges events is awake and about to poll: the completions it now
        // produces itself need no event (an arm left over would cost an eventfd write and a
        // spurious wake-up).
        self.shared.disarm();
        self.shared.ack_events();
        let id = self.loop_id.load(std::sync::atomic::Ordering::Relaxed);
        if id != 0 {
            // An event loop acknowledges after its fd fired: if its set holds the socket,
            // the socket may have data.
            if let Wire::Udp(w) = &self.dev.wire {
                if w.watches_socket(id) {
                    w.rx_fired();
                }
            }
        }
        Ok(())
    }

    fn poll_timeout(&self) -> Option<std::time::Instant> {
        match &self.dev.wire {
            Wire::Udp(_) => self.dev.core.lock().poll_timeout(),
            // The fabric runs its devices' timers itself.
            Wire::Sim => None,
        }
    }

    fn drive_from_event_loop(&self) {
        use std::sync::atomic::Ordering;
        if let (Wire::Udp(w), Some(set)) = (&self.dev.wire, &self.epoll) {
            if !self.event_loop.swap(true, Ordering::AcqRel) {
                match w.event_loop_attached(set.clone()) {
                    Ok(id) => self.loop_id.store(id, Ordering::Release),
                    // The set still holds the socket: a wake-up too many per packet, no more.
                    Err(e) => tracing::warn!(%e, "an event loop could not leave the socket"),
                }
            }
        }
    }

    fn wait(&self, out: &mut [WorkCompletion], timeout: std::time::Duration) -> Result<usize> {
        self.wait_inner(out, None, timeout)
    }

    fn wait_or(
        &self,
        out: &mut [WorkCompletion],
        also: BorrowedFd<'_>,
        timeout: std::time::Duration,
    ) -> Result<usize> {
        self.wait_inner(out, Some(also), timeout)
    }
}

impl SoftCq {
    /// True when a poll would return completions (or report an overrun): lets a simulation
    /// skip idle pollers.
    pub fn pending(&self) -> bool {
        self.shared.pending()
    }

    fn wait_inner(
        &self,
        out: &mut [WorkCompletion],
        also: Option<BorrowedFd<'_>>,
        timeout: std::time::Duration,
    ) -> Result<usize> {
        // Only the queue is checked before blocking: the wait set includes the socket, so a
        // packet already waiting ends the wait at once, and a receive attempt here would
        // usually be an empty `recvmmsg` (callers have just polled).
        let n = self.shared.pop_into(out)?;
        if n > 0 {
            return Ok(n);
        }
        self.arm()?;
        let _guard = match &self.dev.wire {
            Wire::Udp(w) => Some(w.waiting()),
            Wire::Sim => None,
        };
        // Completions another thread queued before the arm.
        let n = self.shared.pop_into(out)?;
        if n > 0 {
            return Ok(n);
        }
        // A waiter runs the NIC's timers too: block no later than the next one.
        let now = crate::clock::wall_now();
        let timer = self.dev.core.lock().poll_timeout().map(|t| t.saturating_duration_since(now));
        let block = timer.map_or(timeout, |t| t.min(timeout));
        crate::device::wait_readable(self.fd(), also, block)?;
        self.ack_events()?;
        self.poll(out)
    }
}

/// A shared receive queue.
#[derive(Debug)]
pub struct SoftSrq {
    id: u32,
    dev: Arc<DevInner>,
}

impl SoftSrq {
    /// Receives currently posted.
    pub fn len(&self) -> usize {
        self.dev.core.lock().srq_len(self.id)
    }
    /// True when no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SharedReceiveQueue for SoftSrq {
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.dev.core.lock().post_srq_recv(self.id, wrs)
    }
}

impl Drop for SoftSrq {
    fn drop(&mut self) {
        self.dev.core.lock().destroy_srq(self.id);
    }
}

/// An RC queue pair; destroyed on drop.
#[derive(Debug)]
pub struct SoftQp {
    qpn: u32,
    initial_psn: u32,
    dev: Arc<DevInner>,
    // Keep the CQs alive as long as the QP references them.
    _cqs: (Arc<CqShared>, Arc<CqShared>),
}

impl SoftQp {
    /// Receives currently posted on the QP's own receive queue.
    pub fn rq_len(&self) -> usize {
        self.dev.core.lock().rq_len(self.qpn)
    }
}

impl QueuePair for SoftQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }
    fn state(&self) -> QpState {
        self.dev.core.lock().qp_state(self.qpn).unwrap_or(QpState::Error)
    }
    fn endpoint(&self) -> QpEndpoint {
        let local = self.dev.local;
        QpEndpoint {
            gid: QpEndpoint::gid_of(local.ip()),
            udp_port: local.port(),
            lid: 0,
            qpn: self.qpn,
            psn: self.initial_psn,
        }
    }
    fn to_init(&self, attrs: &InitAttrs) -> Result<()> {
        self.dev.core.lock().modify_to_init(self.qpn, attrs)
    }
    fn to_rtr(&self, attrs: &RtrAttrs) -> Result<()> {
        self.dev.core.lock().modify_to_rtr(self.qpn, attrs)
    }
    fn to_rts(&self, attrs: &RtsAttrs) -> Result<()> {
        self.dev.core.lock().modify_to_rts(self.qpn, attrs)
    }
    fn to_error(&self) -> Result<()> {
        self.dev.core.lock().modify_to_error(self.qpn)?;
        self.dev.kick();
        Ok(())
    }
    fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        let r = self.dev.core.lock().post_send(self.qpn, wrs);
        // Ring the doorbell even after a partial post: the accepted prefix must go out.
        self.dev.kick();
        r
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        self.dev.core.lock().post_recv(self.qpn, wrs)
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        self.dev.core.lock().destroy_qp(self.qpn);
        self.dev.kick();
    }
}

impl Device for SoftDevice {
    type Pd = SoftPd;
    type Cq = SoftCq;
    type Srq = SoftSrq;
    type Qp = SoftQp;
    type Mr = SoftMr;
    type Td = SoftTd;

    fn caps(&self) -> DeviceCaps {
        let cfg = self.inner.core.lock().config().clone();
        DeviceCaps {
            name: self.inner.name.clone(),
            thread_domains: false,
            srq: true,
            max_qp_wr: cfg.max_qp_wr,
            max_cqe: 1 << 20,
            max_msg_size: cfg.max_msg_size,
            max_sge: crate::verbs::MAX_SGE as u32,
            soft_mtu: true,
        }
    }

    fn stats(&self) -> crate::device::DeviceStats {
        let c = self.counters();
        crate::device::DeviceStats {
            rnr_naks_received: c.rnr_naks_received,
            rnr_naks_sent: c.rnr_naks_sent,
            seq_naks_received: c.seq_naks_received,
            retransmitted_packets: c.retransmitted_packets,
            ack_timeouts: c.ack_timeouts,
            tx_packets: c.tx_packets,
            rx_packets: c.rx_packets,
            send_errors: c.wire_send_errors,
        }
    }

    fn alloc_pd(&self) -> Result<SoftPd> {
        Ok(SoftPd { id: self.inner.core.lock().alloc_pd(), _dev: self.inner.clone() })
    }

    fn alloc_td(&self) -> Result<SoftTd> {
        Err(Error::Unsupported("thread domains (the software RNIC has no provider locks)"))
    }

    fn create_cq(&self, depth: u32) -> Result<SoftCq> {
        if depth == 0 || depth > 1 << 20 {
            return Err(Error::InvalidArgument(format!("cq depth {depth} outside 1..=2^20")));
        }
        let shared = Arc::new(CqShared::new(depth as usize)?);
        let epoll = match &self.inner.wire {
            Wire::Udp(w) => Some(udp::wait_set(shared.fd(), w.socket_fd())?),
            Wire::Sim => None,
        };
        Ok(SoftCq {
            shared,
            dev: self.inner.clone(),
            epoll,
            event_loop: std::sync::atomic::AtomicBool::new(false),
            loop_id: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn create_srq(&self, pd: &SoftPd, depth: u32, _max_sge: u32) -> Result<SoftSrq> {
        let id = self.inner.core.lock().create_srq(pd.id, depth)?;
        Ok(SoftSrq { id, dev: self.inner.clone() })
    }

    fn create_qp(&self, pd: &SoftPd, init: &QpInit<'_, Self>) -> Result<SoftQp> {
        if init.thread_domain.is_some() {
            return Err(Error::Unsupported("thread domains"));
        }
        let send = init.send_cq.shared.clone();
        let recv = init.recv_cq.shared.clone();
        let mut core = self.inner.core.lock();
        let qpn =
            core.create_qp(pd.id, send.clone(), recv.clone(), init.srq.map(|s| s.id), init.caps)?;
        let initial_psn = core.qp_initial_psn(qpn).unwrap_or(0);
        Ok(SoftQp { qpn, initial_psn, dev: self.inner.clone(), _cqs: (send, recv) })
    }

    unsafe fn reg_mr(
        &self,
        pd: &SoftPd,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<SoftMr> {
        // SAFETY: forwarded contract: the caller keeps the memory valid until the SoftMr drops,
        // and SoftMr's drop removes the key before returning.
        let keys = unsafe { self.inner.core.lock().reg_mr(pd.id, addr, len, access)? };
        Ok(SoftMr { keys, dev: self.inner.clone() })
    }
}

/// Registers blocks with a software device for an allocator.
#[derive(Debug, Clone)]
pub struct SoftRegistrar {
    dev: Arc<DevInner>,
    pd: u32,
}

impl Registrar for SoftRegistrar {
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MrKeys> {
        // SAFETY: forwarded contract: the caller keeps the block valid until `deregister`.
        unsafe { self.dev.core.lock().reg_mr(self.pd, addr, len, Access::ALL) }
    }
    fn deregister(&self, keys: MrKeys) -> Result<()> {
        if self.dev.core.lock().dereg_mr(keys.lkey) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!("no region with key {:#x}", keys.lkey)))
        }
    }
}
