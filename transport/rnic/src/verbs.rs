//! The verbs vocabulary shared by every backend: nouns and work requests mirror ibverbs so the
//! software RNIC and the hardware backend read the same.

use std::fmt;

/// Memory-region access rights (`IBV_ACCESS_*`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No access beyond local read (always implied).
    pub const NONE: Access = Access(0);
    /// The NIC may write into the region on behalf of local receives.
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may WRITE into the region (requires `LOCAL_WRITE`).
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// Peers may READ the region.
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// Everything bex uses: local write, remote write and remote read.
    pub const ALL: Access = Access(0b111);

    /// True when every right in `other` is present.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// The raw bit set (the same bits as `IBV_ACCESS_*`).
    pub fn bits(self) -> u32 {
        self.0
    }
    /// Builds a set from raw bits, keeping only the known ones.
    pub fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & Access::ALL.0)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.contains(Access::LOCAL_WRITE) {
            names.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            names.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            names.push("REMOTE_READ");
        }
        write!(f, "Access({})", names.join("|"))
    }
}

/// The keys and extent of a registered memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MrKeys {
    /// First registered byte.
    pub addr: u64,
    /// Registered length in bytes.
    pub len: u64,
    /// Key used by local work requests.
    pub lkey: u32,
    /// Key peers use to access the region.
    pub rkey: u32,
}

impl MrKeys {
    /// True when `[addr, addr + len)` lies inside this region.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// One scatter/gather element: `length` bytes at `addr` in the region with `lkey`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region that holds the bytes.
    pub lkey: u32,
}

/// The most scatter/gather entries one work request carries in bex.
pub const MAX_SGE: usize = 4;

/// A small inline list of scatter/gather entries (no allocation per work request).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct SgList {
    entries: [Sge; MAX_SGE],
    len: u8,
}

impl SgList {
    /// An empty list (a 0-byte message).
    pub fn new() -> SgList {
        SgList::default()
    }
    /// A list of one entry.
    pub fn one(sge: Sge) -> SgList {
        let mut list = SgList::new();
        list.entries[0] = sge;
        list.len = 1;
        list
    }
    /// Builds a list from a slice; `None` when it has more than [`MAX_SGE`] entries.
    pub fn from_slice(sges: &[Sge]) -> Option<SgList> {
        if sges.len() > MAX_SGE {
            return None;
        }
        let mut list = SgList::new();
        list.entries[..sges.len()].copy_from_slice(sges);
        list.len = sges.len() as u8;
        Some(list)
    }
    /// Appends an entry; `false` (and no change) when the list is full.
    pub fn push(&mut self, sge: Sge) -> bool {
        if usize::from(self.len) == MAX_SGE {
            return false;
        }
        self.entries[usize::from(self.len)] = sge;
        self.len += 1;
        true
    }
    /// The entries.
    pub fn as_slice(&self) -> &[Sge] {
        &self.entries[..usize::from(self.len)]
    }
    /// Sum of the entries' lengths.
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.length)).sum()
    }
}

impl fmt::Debug for SgList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided SEND: consumes a receive at the peer.
    Send,
    /// SEND carrying 32 bits of immediate data.
    SendWithImm {
        /// Immediate data delivered in the receiver's completion.
        imm: u32,
    },
    /// One-sided WRITE into the peer's registered memory.
    Write {
        /// Destination address at the peer.
        remote_addr: u64,
        /// The peer region's rkey.
        rkey: u32,
    },
    /// WRITE whose last packet consumes a receive and completes at the peer with `imm`.
    WriteWithImm {
        /// Destination address at the peer.
        remote_addr: u64,
        /// The peer region's rkey.
        rkey: u32,
        /// Immediate data delivered in the receiver's completion.
        imm: u32,
    },
}

impl SendOp {
    /// True for operations that consume a receive request at the peer (and so a credit).
    pub fn consumes_receive(&self) -> bool {
        matches!(self, SendOp::Send | SendOp::SendWithImm { .. } | SendOp::WriteWithImm { .. })
    }
}

/// A send-queue work request (`ibv_send_wr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local bytes to send, gathered in order.
    pub sg_list: SgList,
    /// Ask for a completion (`IBV_SEND_SIGNALED`); unsignaled requests are retired silently
    /// when a later request completes.
    pub signaled: bool,
}

/// A receive-queue work request (`ibv_recv_wr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Where incoming bytes are scattered.
    pub sg_list: SgList,
}

/// Completion status (`ibv_wc_status`), for the cases bex distinguishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// The work request completed.
    #[default]
    Success,
    /// A receive buffer was too small for the incoming message.
    LocalLengthError,
    /// A local sge named an unknown key, lay outside its region, or lacked access.
    LocalProtectionError,
    /// The QP was in (or entered) the error state; the request was never executed.
    WrFlushError,
    /// The peer rejected a malformed request (e.g. a SEND longer than its receive buffer).
    RemoteInvalidRequest,
    /// The peer rejected the rkey, the bounds, or the access rights.
    RemoteAccessError,
    /// The peer reported an operational error.
    RemoteOperationError,
    /// The local ACK timeout fired more than `retry_cnt` times in a row.
    RetryExceeded,
    /// The peer answered RNR more than `rnr_retry` times in a row.
    RnrRetryExceeded,
    /// Any other status a backend reports, with its raw value.
    Other(u32),
}

impl WcStatus {
    /// True for [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

/// What a completion reports (`ibv_wc_opcode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND or SEND_WITH_IMM from this side finished.
    #[default]
    Send,
    /// A WRITE or WRITE_WITH_IMM from this side finished.
    RdmaWrite,
    /// A SEND arrived into a posted receive.
    Recv,
    /// A WRITE_WITH_IMM arrived and consumed a posted receive.
    RecvRdmaWithImm,
}

/// One work completion (`ibv_wc`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id of the work request it completes.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Kind of operation.
    pub opcode: WcOpcode,
    /// For receives: bytes that arrived (for WRITE_WITH_IMM, the whole written message).
    pub byte_len: u32,
    /// Immediate data, when the message carried some.
    pub imm: Option<u32>,
    /// The local QP number, used to dispatch completions from a shared CQ.
    pub qp_num: u32,
    /// Backend-specific detail for failed completions (0 when none).
    pub vendor_err: u32,
}

/// RC queue-pair states (`ibv_qp_state`), in the order they are entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created: nothing can be posted.
    Reset,
    /// Receives may be posted; nothing is processed.
    Init,
    /// Ready to receive: the responder runs.
    ReadyToReceive,
    /// Ready to send: the requester runs too.
    ReadyToSend,
    /// Failed: outstanding and new requests complete with [`WcStatus::WrFlushError`].
    Error,
}

/// Path MTU, the wire's segment size (`ibv_mtu`), plus the software RNIC's large soft MTU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
    /// A software-only segment size (up to [`Mtu::MAX_SOFT`]) that fits one UDP datagram;
    /// hardware backends reject it.
    Soft(u32),
}

impl Mtu {
    /// The largest soft MTU: leaves room for headers inside a 64 KiB UDP datagram.
    pub const MAX_SOFT: u32 = 60 * 1024;

    /// Payload bytes per packet.
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
            Mtu::Soft(n) => n,
        }
    }

    /// Parses a byte count: one of the IB sizes, or a soft MTU in 256..=MAX_SOFT (multiple of 4).
    pub fn from_bytes(n: u32) -> Option<Mtu> {
        Some(match n {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            n if (256..=Mtu::MAX_SOFT).contains(&n) && n % 4 == 0 => Mtu::Soft(n),
            _ => return None,
        })
    }
}

/// The number of queue entries and scatter/gather entries a QP is created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth.
    pub max_send_wr: u32,
    /// Receive-queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps { max_send_wr: 32, max_recv_wr: 64, max_send_sge: 2, max_recv_sge: 1 }
    }
}

/// Everything a peer needs to connect a QP to ours; exchanged out of band (see
/// [`crate::bootstrap`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    /// The port's GID: for RoCEv2 (and the software RNIC), an IPv4-mapped or IPv6 address.
    pub gid: [u8; 16],
    /// UDP port the peer's RoCE packets go to (4791 on hardware; configurable in software).
    pub udp_port: u16,
    /// Local identifier (InfiniBand fabrics only; 0 on RoCE).
    pub lid: u16,
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// The first PSN this side will send (24 bits).
    pub psn: u32,
}

impl QpEndpoint {
    /// The GID as a socket address with the endpoint's UDP port.
    pub fn socket_addr(&self) -> std::net::SocketAddr {
        let ip6 = std::net::Ipv6Addr::from(self.gid);
        let ip = match ip6.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => std::net::IpAddr::V6(ip6),
        };
        std::net::SocketAddr::new(ip, self.udp_port)
    }

    /// The GID for an IP address (IPv4 addresses are IPv4-mapped, as RoCEv2 GIDs are).
    pub fn gid_of(ip: std::net::IpAddr) -> [u8; 16] {
        match ip {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        }
    }
}

/// Attributes of the RESET→INIT transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitAttrs {
    /// What peers may do to local memory through this QP.
    pub access: Access,
    /// Physical port (1 on every device bex uses).
    pub port: u8,
}

impl Default for InitAttrs {
    fn default() -> Self {
        InitAttrs { access: Access::ALL, port: 1 }
    }
}

/// Attributes of the INIT→RTR transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttrs {
    /// The peer QP.
    pub remote: QpEndpoint,
    /// Segment size on the wire.
    pub path_mtu: Mtu,
    /// IB's min_rnr_timer code (0..=31): how long a sender told "not ready" waits.
    pub min_rnr_timer: u8,
}

/// Attributes of the RTR→RTS transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttrs {
    /// First PSN this side sends (must match what the peer was told).
    pub sq_psn: u32,
    /// IB's local ACK timeout code: 4.096 µs × 2^timeout (0 = infinite).
    pub timeout: u8,
    /// Retransmissions after an ACK timeout or sequence NAK before failing (0..=7).
    pub retry_cnt: u8,
    /// Retries after RNR NAKs before failing (0..=7; 7 = infinite).
    pub rnr_retry: u8,
}

impl Default for RtsAttrs {
    fn default() -> Self {
        RtsAttrs { sq_psn: 0, timeout: 14, retry_cnt: 7, rnr_retry: 7 }
    }
}

/// Attributes for a whole connect (RESET→INIT→RTR→RTS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectAttrs {
    /// RESET→INIT.
    pub init: InitAttrs,
    /// Segment size on the wire.
    pub path_mtu: Mtu,
    /// IB's min_rnr_timer code.
    pub min_rnr_timer: u8,
    /// IB's local ACK timeout code.
    pub timeout: u8,
    /// ACK-timeout / sequence-NAK retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
}

impl Default for ConnectAttrs {
    fn default() -> Self {
        ConnectAttrs {
            init: InitAttrs::default(),
            path_mtu: Mtu::Mtu4096,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
        }
    }
}

/// Durations behind IB's encoded timer fields.
pub mod timers {
    use std::time::Duration;

    /// The local ACK timeout for IB's 5-bit code: 4.096 µs × 2^code; `None` for 0 (infinite).
    pub fn ack_timeout(code: u8) -> Option<Duration> {
        if code == 0 {
            return None;
        }
        let ns = 4096u64 << u32::from(code.min(31));
        Some(Duration::from_nanos(ns))
    }

    /// The RNR NAK timer for IB's 5-bit code (IBA table 45; 0 means 655.36 ms).
    pub fn rnr_timer(code: u8) -> Duration {
        const MICROS: [u64; 32] = [
            655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920,
            2_560, 3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920,
            122_880, 163_840, 245_760, 327_680, 491_520,
        ];
        Duration::from_micros(MICROS[usize::from(code & 31)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mr_covers_is_exact_at_both_ends() {
        let mr = MrKeys { addr: 100, len: 10, lkey: 1, rkey: 2 };
        assert!(mr.covers(100, 10));
        assert!(mr.covers(109, 1));
        assert!(!mr.covers(109, 2));
        assert!(!mr.covers(99, 1));
        assert!(!mr.covers(u64::MAX, 2));
    }

    #[test]
    fn sg_list_rejects_overflow() {
        let mut list = SgList::new();
        for _ in 0..MAX_SGE {
            assert!(list.push(Sge::default()));
        }
        assert!(!list.push(Sge::default()));
        assert!(SgList::from_slice(&[Sge::default(); MAX_SGE + 1]).is_none());
    }

    #[test]
    fn timers_follow_the_ib_tables() {
        assert_eq!(timers::ack_timeout(0), None);
        assert_eq!(timers::ack_timeout(1), Some(std::time::Duration::from_nanos(8192)));
        assert_eq!(timers::rnr_timer(1).as_micros(), 10);
        assert_eq!(timers::rnr_timer(0).as_micros(), 655_360);
    }

    #[test]
    fn endpoint_round_trips_ipv4_through_a_gid() {
        let addr: std::net::SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let ep = QpEndpoint {
            gid: QpEndpoint::gid_of(addr.ip()),
            udp_port: 4791,
            lid: 0,
            qpn: 7,
            psn: 9,
        };
        assert_eq!(ep.socket_addr(), addr);
    }

    #[test]
    fn mtu_parses_ib_and_soft_sizes() {
        assert_eq!(Mtu::from_bytes(4096), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::from_bytes(60 * 1024), Some(Mtu::Soft(60 * 1024)));
        assert_eq!(Mtu::from_bytes(100), None);
        assert_eq!(Mtu::from_bytes(61 * 1024), None);
    }
}
