//! The boundary every NIC backend implements: a device opens protection domains, completion
//! queues, shared receive queues, queue pairs and memory regions. Resources keep their parents
//! alive and are destroyed when dropped.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use crate::verbs::{
    Access, ConnectAttrs, InitAttrs, MrKeys, QpCaps, QpEndpoint, QpState, RecvWr, RtrAttrs,
    RtsAttrs, SendWr, WorkCompletion,
};

/// Errors of the NIC boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No RDMA device could be opened; the text names the cause (no devices, ENOSYS, …).
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// The backend does not have this capability (e.g. thread domains on rxe).
    #[error("not supported by this backend: {0}")]
    Unsupported(&'static str),
    /// A post found its queue full; the first `posted` requests of the batch were posted.
    #[error("queue full after posting {posted} work requests")]
    QueueFull {
        /// How many leading requests of the batch were accepted.
        posted: usize,
    },
    /// A request was malformed (too many sges, a soft MTU on hardware, …); the first `posted`
    /// requests of the batch were posted.
    #[error("invalid work request {index}: {reason}")]
    InvalidRequest {
        /// Index of the rejected request in its batch (requests before it were posted).
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// An operation is not allowed in the QP's current state.
    #[error("queue pair {qpn} is in state {state:?}: {what} not allowed")]
    InvalidState {
        /// The QP.
        qpn: u32,
        /// Its state.
        state: QpState,
        /// What was attempted.
        what: &'static str,
    },
    /// A bad argument to a verb (the text says which).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A resource limit was reached (QPs, MRs, CQ entries, …).
    #[error("resource exhausted: {0}")]
    Exhausted(&'static str),
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Os {
        /// The call.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Result of boundary operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a device can do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Human-readable device name (`soft0`, `mlx5_0`, …).
    pub name: String,
    /// Thread domains are available (mlx5 and a few others; not rxe, not the software RNIC).
    pub thread_domains: bool,
    /// Shared receive queues are available.
    pub srq: bool,
    /// Largest send/receive queue depth.
    pub max_qp_wr: u32,
    /// Largest CQ depth.
    pub max_cqe: u32,
    /// Largest message in bytes.
    pub max_msg_size: u64,
    /// Largest sge count per request.
    pub max_sge: u32,
    /// The software RNIC's large soft MTU is accepted.
    pub soft_mtu: bool,
}

/// Protocol counters a device reports (zero where a backend cannot see them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DeviceStats {
    /// RNR NAKs this device received (its sends found no receive posted at the peer).
    pub rnr_naks_received: u64,
    /// RNR NAKs this device sent.
    pub rnr_naks_sent: u64,
    /// Sequence NAKs received.
    pub seq_naks_received: u64,
    /// Data packets sent again (timeouts, NAKs, RNR).
    pub retransmitted_packets: u64,
    /// Local ACK timeouts.
    pub ack_timeouts: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets received.
    pub rx_packets: u64,
    /// Packets that never reached the wire (the software RNIC's socket refused them: an
    /// unreachable peer, or larger than the link's MTU).
    pub send_errors: u64,
}

impl DeviceStats {
    /// What was counted since `earlier` (counters only grow; a reset device reads 0).
    pub fn since(&self, earlier: &DeviceStats) -> DeviceStats {
        let d = |now: u64, then: u64| now.saturating_sub(then);
        DeviceStats {
            rnr_naks_received: d(self.rnr_naks_received, earlier.rnr_naks_received),
            rnr_naks_sent: d(self.rnr_naks_sent, earlier.rnr_naks_sent),
            seq_naks_received: d(self.seq_naks_received, earlier.seq_naks_received),
            retransmitted_packets: d(self.retransmitted_packets, earlier.retransmitted_packets),
            ack_timeouts: d(self.ack_timeouts, earlier.ack_timeouts),
            tx_packets: d(self.tx_packets, earlier.tx_packets),
            rx_packets: d(self.rx_packets, earlier.rx_packets),
            send_errors: d(self.send_errors, earlier.send_errors),
        }
    }
}

/// A registered memory region.
pub trait MemoryRegion: Send + Sync {
    /// Its keys and extent.
    fn keys(&self) -> MrKeys;
}

/// A completion queue. Polling is non-blocking; a blocking wait arms the queue and waits on
/// its file descriptor.
pub trait CompletionQueue: Send + Sync {
    /// Moves up to `out.len()` completions into `out`; returns how many.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize>;
    /// Requests an event on the fd for the next completion (`ibv_req_notify_cq`).
    fn arm(&self) -> Result<()>;
    /// A file descriptor that becomes readable after an armed queue gets a completion; the
    /// same descriptor for the queue's whole life (event loops register it once).
    fn fd(&self) -> BorrowedFd<'_>;
    /// Consumes the pending event(s) on the fd (`ibv_get_cq_event` + `ibv_ack_cq_events`).
    fn ack_events(&self) -> Result<()>;

    /// When the queue must be polled again even if its fd stays quiet. A software NIC runs
    /// its protocol timers (retransmission, delayed ACKs) in the thread that polls it;
    /// hardware runs its own, so the default is never.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }

    /// Declares that, from now on and for as long as this queue lives, its owner drives the
    /// NIC from an event loop: it watches [`CompletionQueue::fd`] (after
    /// [`CompletionQueue::arm`]) and polls on readiness and at
    /// [`CompletionQueue::poll_timeout`]. A software NIC's own progress thread then stands
    /// back instead of waking for the same packets. Hardware needs nothing.
    fn drive_from_event_loop(&self) {}

    /// Polls; if nothing is there, arms, polls again, and blocks on the fd for at most
    /// `timeout`. Returns how many completions were written. One thread waits on a queue at
    /// a time (as with one completion channel per CQ): a waiter may withdraw its arm when it
    /// wakes.
    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        wait_on(self, out, None, timeout)
    }

    /// Like [`CompletionQueue::wait`], but also returns (possibly with no completion) when
    /// `also` becomes readable — an I/O thread's command queue, say.
    fn wait_or(
        &self,
        out: &mut [WorkCompletion],
        also: BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<usize> {
        wait_on(self, out, Some(also), timeout)
    }
}

/// The portable blocking wait: poll, arm, poll, then poll(2) on the CQ's fd (and `also`).
pub fn wait_on<C: CompletionQueue + ?Sized>(
    cq: &C,
    out: &mut [WorkCompletion],
    also: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> Result<usize> {
    let n = cq.poll(out)?;
    if n > 0 {
        return Ok(n);
    }
    cq.arm()?;
    let n = cq.poll(out)?;
    if n > 0 {
        return Ok(n);
    }
    wait_readable(cq.fd(), also, timeout)?;
    cq.ack_events()?;
    cq.poll(out)
}

/// Blocks until the CQ's `fd` (or `also`) is readable, `timeout` passes or a signal comes.
pub(crate) fn wait_readable(
    fd: BorrowedFd<'_>,
    also: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> Result<()> {
    let flags = nix::poll::PollFlags::POLLIN;
    let mut fds = vec![nix::poll::PollFd::new(fd, flags)];
    if let Some(fd) = also {
        fds.push(nix::poll::PollFd::new(fd, flags));
    }
    let ts = nix::sys::time::TimeSpec::from_duration(timeout);
    match nix::poll::ppoll(&mut fds, Some(ts), None) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::Os { what: "ppoll(cq fd)", source: e.into() }),
    }
}

/// A shared receive queue.
pub trait SharedReceiveQueue: Send + Sync {
    /// Posts receives in one call; on a full queue the leading `posted` ones were accepted.
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()>;
}

/// An RC queue pair.
pub trait QueuePair: Send + Sync {
    /// Its number (24 bits).
    fn qpn(&self) -> u32;
    /// Its current state.
    fn state(&self) -> QpState;
    /// What a peer needs to connect to it; `psn` is the PSN this side will start sending at.
    fn endpoint(&self) -> QpEndpoint;
    /// RESET→INIT.
    fn to_init(&self, attrs: &InitAttrs) -> Result<()>;
    /// INIT→RTR.
    fn to_rtr(&self, attrs: &RtrAttrs) -> Result<()>;
    /// RTR→RTS.
    fn to_rts(&self, attrs: &RtsAttrs) -> Result<()>;
    /// Any state → ERROR: outstanding work completes with flush errors.
    fn to_error(&self) -> Result<()>;
    /// Posts send requests in one call (one doorbell). On a full queue or a bad request,
    /// the requests before it were posted and the error says how many.
    fn post_send(&self, wrs: &[SendWr]) -> Result<()>;
    /// Posts receive requests in one call (invalid on a QP attached to an SRQ).
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()>;

    /// RESET→INIT→RTR→RTS against `remote`.
    fn connect(&self, remote: &QpEndpoint, attrs: &ConnectAttrs) -> Result<()> {
        self.to_init(&attrs.init)?;
        self.to_rtr(&RtrAttrs {
            remote: *remote,
            path_mtu: attrs.path_mtu,
            min_rnr_timer: attrs.min_rnr_timer,
        })?;
        self.to_rts(&RtsAttrs {
            sq_psn: self.endpoint().psn,
            timeout: attrs.timeout,
            retry_cnt: attrs.retry_cnt,
            rnr_retry: attrs.rnr_retry,
        })
    }
}

/// How a QP is created.
#[derive(Debug)]
pub struct QpInit<'a, D: Device + ?Sized> {
    /// CQ for send completions.
    pub send_cq: &'a D::Cq,
    /// CQ for receive completions.
    pub recv_cq: &'a D::Cq,
    /// Draw receives from this SRQ instead of a dedicated receive queue.
    pub srq: Option<&'a D::Srq>,
    /// Thread domain the QP belongs to (only on devices that have them).
    pub thread_domain: Option<&'a D::Td>,
    /// Queue depths and sge counts.
    pub caps: QpCaps,
}

/// An RDMA device: the factory of every other resource.
pub trait Device: Send + Sync {
    /// Protection domain.
    type Pd: Send + Sync;
    /// Completion queue.
    type Cq: CompletionQueue;
    /// Shared receive queue.
    type Srq: SharedReceiveQueue;
    /// Queue pair.
    type Qp: QueuePair;
    /// Memory region.
    type Mr: MemoryRegion;
    /// Thread domain.
    type Td: Send + Sync;

    /// What the device can do.
    fn caps(&self) -> DeviceCaps;
    /// Protocol counters, where the backend can read them.
    fn stats(&self) -> DeviceStats {
        DeviceStats::default()
    }
    /// Allocates a protection domain.
    fn alloc_pd(&self) -> Result<Self::Pd>;
    /// Allocates a thread domain, or [`Error::Unsupported`] where the device has none.
    fn alloc_td(&self) -> Result<Self::Td>;
    /// Creates a completion queue of at least `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<Self::Cq>;
    /// Creates a shared receive queue of `depth` entries.
    fn create_srq(&self, pd: &Self::Pd, depth: u32, max_sge: u32) -> Result<Self::Srq>;
    /// Creates an RC queue pair in the RESET state.
    fn create_qp(&self, pd: &Self::Pd, init: &QpInit<'_, Self>) -> Result<Self::Qp>;
    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// The memory must stay valid (mapped, not freed) until the returned region is dropped:
    /// the device, and peers holding the rkey, may read or write it at any time until then.
    unsafe fn reg_mr(
        &self,
        pd: &Self::Pd,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self::Mr>;
}

/// Registers blocks of memory with one device; what an allocator needs from a NIC.
pub trait Registrar: Send + Sync {
    /// Registers `[addr, addr + len)` for local and remote access and returns its keys.
    ///
    /// # Safety
    /// The memory must stay valid until [`Registrar::deregister`] is called with the keys.
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MrKeys>;
    /// Deregisters a region returned by [`Registrar::register`].
    fn deregister(&self, keys: MrKeys) -> Result<()>;
}
