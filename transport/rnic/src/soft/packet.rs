//! RoCEv2 packets as the software RNIC puts them in UDP payloads: BTH, then RETH / ImmDt /
//! AETH as the opcode requires, the payload padded to 4 bytes, and a 4-byte ICRC.
//!
//! All fields are big-endian, as on the wire. The ICRC is RoCEv2's (Annex A17, as Linux rxe
//! computes it): a CRC-32 over 8 bytes of ones standing for the LRH, the IP header with its
//! variant fields set to ones (IPv4: TOS, TTL and checksum; IPv6: traffic class, flow label
//! and hop limit), the UDP header with its checksum set to ones, the BTH with its
//! FECN/BECN/reserved byte set to ones, and everything after it; sent little-endian. The
//! software RNIC never sees the IP header it is sent under, so it rebuilds it from the
//! [`Route`] (addresses and ports), the length, and what Linux puts in the rest for an
//! unconnected UDP socket with don't-fragment set: IPv4 flags DF, protocol 17, and an
//! identification of 0 — or, for the k-th segment of a GSO send, k (the kernel numbers
//! segments on from the first's; runs are at most [`IPV4_IDS`] long). [`encode_into`] seals
//! a packet for identification 0 and [`set_ipv4_id`] moves its ICRC to another without a
//! second pass over the bytes. A receiver cannot read a datagram's identification (and a
//! segmented run may arrive as separate datagrams), so [`icrc_ok`] accepts an IPv4 packet
//! whose ICRC is right for one of the identifications a sender can have given it,
//! `0..IPV4_IDS`: one CRC pass, and the difference to identification 0 looked up among 63.
//! That costs the check 6 of its 32 bits against random corruption, which the UDP checksum
//! (verified by the kernel) covers as well; IPv6 has no identification and is checked whole.
//!
//! Parsing never panics: every malformed input maps to a [`ParseError`] the caller counts.

/// Length of the base transport header.
pub const BTH_LEN: usize = 12;
/// Length of the RDMA extended transport header.
pub const RETH_LEN: usize = 16;
/// Length of the immediate-data header.
pub const IMM_LEN: usize = 4;
/// Length of the ACK extended transport header.
pub const AETH_LEN: usize = 4;
/// Length of the invariant CRC trailer.
pub const ICRC_LEN: usize = 4;
/// The largest header stack a packet carries (BTH + RETH + ImmDt).
pub const MAX_HEADER_LEN: usize = BTH_LEN + RETH_LEN + IMM_LEN;
/// The default partition key.
pub const DEFAULT_PKEY: u16 = 0xffff;
/// PSNs are 24-bit.
pub const PSN_MASK: u32 = 0x00ff_ffff;

/// RC opcodes the software RNIC speaks (IBA table 38, RC class 0x00).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// First packet of a multi-packet SEND.
    SendFirst = 0x00,
    /// Middle packet of a SEND.
    SendMiddle = 0x01,
    /// Last packet of a SEND.
    SendLast = 0x02,
    /// Last packet of a SEND with immediate data.
    SendLastImm = 0x03,
    /// Single-packet SEND.
    SendOnly = 0x04,
    /// Single-packet SEND with immediate data.
    SendOnlyImm = 0x05,
    /// First packet of a WRITE (carries the RETH).
    WriteFirst = 0x06,
    /// Middle packet of a WRITE.
    WriteMiddle = 0x07,
    /// Last packet of a WRITE.
    WriteLast = 0x08,
    /// Last packet of a WRITE with immediate data.
    WriteLastImm = 0x09,
    /// Single-packet WRITE.
    WriteOnly = 0x0a,
    /// Single-packet WRITE with immediate data.
    WriteOnlyImm = 0x0b,
    /// ACK / NAK (carries the AETH).
    Acknowledge = 0x11,
}

impl Opcode {
    /// Every opcode the software RNIC speaks, in code order.
    pub const ALL: [Opcode; 13] = [
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastImm,
        Opcode::SendOnly,
        Opcode::SendOnlyImm,
        Opcode::WriteFirst,
        Opcode::WriteMiddle,
        Opcode::WriteLast,
        Opcode::WriteLastImm,
        Opcode::WriteOnly,
        Opcode::WriteOnlyImm,
        Opcode::Acknowledge,
    ];

    /// Decodes a wire opcode; `None` for anything the software RNIC does not speak.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x00 => SendFirst,
            0x01 => SendMiddle,
            0x02 => SendLast,
            0x03 => SendLastImm,
            0x04 => SendOnly,
            0x05 => SendOnlyImm,
            0x06 => WriteFirst,
            0x07 => WriteMiddle,
            0x08 => WriteLast,
            0x09 => WriteLastImm,
            0x0a => WriteOnly,
            0x0b => WriteOnlyImm,
            0x11 => Acknowledge,
            _ => return None,
        })
    }
    /// Carries a RETH.
    pub fn has_reth(self) -> bool {
        matches!(self, Opcode::WriteFirst | Opcode::WriteOnly | Opcode::WriteOnlyImm)
    }
    /// Carries immediate data.
    pub fn has_imm(self) -> bool {
        matches!(
            self,
            Opcode::SendLastImm | Opcode::SendOnlyImm | Opcode::WriteLastImm | Opcode::WriteOnlyImm
        )
    }
    /// Is a SEND packet.
    pub fn is_send(self) -> bool {
        (self as u8) <= 0x05
    }
    /// Is a WRITE packet.
    pub fn is_write(self) -> bool {
        (0x06..=0x0b).contains(&(self as u8))
    }
    /// Starts a message.
    pub fn is_first(self) -> bool {
        use Opcode::*;
        matches!(self, SendFirst | SendOnly | SendOnlyImm | WriteFirst | WriteOnly | WriteOnlyImm)
    }
    /// Ends a message.
    pub fn is_last(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            SendLast
                | SendLastImm
                | SendOnly
                | SendOnlyImm
                | WriteLast
                | WriteLastImm
                | WriteOnly
                | WriteOnlyImm
        )
    }
    /// Consumes a receive request at the responder (SEND first/only, WRITE with imm last/only).
    pub fn consumes_receive(self) -> bool {
        use Opcode::*;
        matches!(self, SendFirst | SendOnly | SendOnlyImm | WriteLastImm | WriteOnlyImm)
    }
}

/// RDMA extended transport header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length of the whole WRITE.
    pub dma_len: u32,
}

/// ACK syndromes (AETH bits 7..5 and their 5-bit value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syndrome {
    /// Positive ACK.
    Ack,
    /// Receiver not ready; retry after the timer of this code.
    RnrNak(u8),
    /// PSN sequence error: resend from the PSN in the packet.
    NakSequence,
    /// Invalid request.
    NakInvalidRequest,
    /// Remote access error (rkey, bounds, rights).
    NakRemoteAccess,
    /// Remote operational error.
    NakRemoteOperational,
}

impl Syndrome {
    /// The AETH syndrome byte.
    pub fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack => 0x1f, // credit field 0b11111: "no credit information"
            Syndrome::RnrNak(t) => 0x20 | (t & 0x1f),
            Syndrome::NakSequence => 0x60,
            Syndrome::NakInvalidRequest => 0x61,
            Syndrome::NakRemoteAccess => 0x62,
            Syndrome::NakRemoteOperational => 0x63,
        }
    }
    /// Decodes a syndrome byte.
    pub fn from_u8(v: u8) -> Option<Syndrome> {
        Some(match v >> 5 {
            0b000 => Syndrome::Ack,
            0b001 => Syndrome::RnrNak(v & 0x1f),
            0b011 => match v & 0x1f {
                0 => Syndrome::NakSequence,
                1 => Syndrome::NakInvalidRequest,
                2 => Syndrome::NakRemoteAccess,
                3 => Syndrome::NakRemoteOperational,
                _ => return None,
            },
            _ => return None,
        })
    }
}

/// ACK extended transport header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aeth {
    /// What the ACK says.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

/// The decoded headers of one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Partition key.
    pub pkey: u16,
    /// Destination QP (24 bits).
    pub dest_qpn: u32,
    /// Ask the responder for an ACK.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
    /// Present on WRITE first/only.
    pub reth: Option<Reth>,
    /// Present on *_IMM last/only.
    pub imm: Option<u32>,
    /// Present on ACKs.
    pub aeth: Option<Aeth>,
}

impl Header {
    /// A header for `opcode` with the other fields zeroed and no extension headers.
    pub fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> Header {
        Header {
            opcode,
            solicited: false,
            pkey: DEFAULT_PKEY,
            dest_qpn,
            ack_req: false,
            psn,
            reth: None,
            imm: None,
            aeth: None,
        }
    }

    /// Bytes the headers take on the wire.
    pub fn encoded_len(&self) -> usize {
        BTH_LEN
            + if self.opcode.has_reth() { RETH_LEN } else { 0 }
            + if self.opcode.has_imm() { IMM_LEN } else { 0 }
            + if self.opcode == Opcode::Acknowledge { AETH_LEN } else { 0 }
    }
}

/// Why a packet was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParseError {
    /// Shorter than its headers and trailer.
    Truncated,
    /// Opcode not spoken here.
    UnknownOpcode(u8),
    /// Transport header version other than 0.
    BadVersion,
    /// Pad count larger than the payload.
    BadPad,
    /// An AETH syndrome that means nothing.
    BadSyndrome,
    /// Headers required by the opcode are inconsistent (e.g. payload on an ACK).
    Inconsistent,
}

/// The addresses and UDP ports a packet travels between: with its length, what RoCEv2's ICRC
/// covers of its IP and UDP headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The sender's address and UDP port.
    pub src: std::net::SocketAddr,
    /// The receiver's address and UDP port.
    pub dst: std::net::SocketAddr,
}

/// A parsed packet borrowing its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Headers.
    pub header: Header,
    /// Payload without pad and ICRC.
    pub payload: &'a [u8],
}

/// Bytes of the ICRC's input before a packet: the LRH's 8 ones, then the IP and UDP headers.
const IPV4_PSEUDO_LEN: usize = 8 + 20 + 8;
/// Offset of the IPv4 identification in that input.
const IPV4_ID_AT: usize = 8 + 4;

/// The ICRC of `body` (BTH through the pad, without the trailer) sent on `route` with IPv4
/// identification 0.
fn icrc(body: &[u8], route: &Route) -> u32 {
    use std::net::IpAddr;
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    let udp_len = (8 + body.len() + ICRC_LEN) as u16;
    match (route.src.ip(), route.dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = 20 + udp_len;
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[1] = 0xff; // TOS (DSCP, ECN): masked
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            // [4..6] identification 0 (see `set_ipv4_id`)
            ip[6] = 0x40; // flags: DF; fragment offset 0
            ip[8] = 0xff; // TTL: masked
            ip[9] = 17; // UDP
            ip[10..12].copy_from_slice(&[0xff, 0xff]); // checksum: masked
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            h.update(&ip);
        }
        (s, d) => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V4(a) => a.to_ipv6_mapped(),
                IpAddr::V6(a) => a,
            };
            let mut ip = [0u8; 40];
            // Version 6; traffic class and flow label masked.
            ip[0..4].copy_from_slice(&[0x6f, 0xff, 0xff, 0xff]);
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
            ip[6] = 17; // next header: UDP
            ip[7] = 0xff; // hop limit: masked
            ip[8..24].copy_from_slice(&v6(s).octets());
            ip[24..40].copy_from_slice(&v6(d).octets());
            h.update(&ip);
        }
    }
    let mut udp = [0xffu8; 8]; // checksum [6..8]: masked
    udp[0..2].copy_from_slice(&route.src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&route.dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    h.update(&udp);
    // BTH byte 4 (FECN, BECN, reserved) may be rewritten in flight: masked to ones.
    h.update(&body[..4]);
    h.update(&[0xff]);
    h.update(&body[5..]);
    h.finalize()
}

/// The IPv4 identifications a GSO run gives its segments, `0..IPV4_IDS` (so runs are at most
/// this long); receivers accept any of them.
pub const IPV4_IDS: u16 = 64;
const ID_BITS: usize = IPV4_IDS.trailing_zeros() as usize;

/// What an IPv4 identification of `id` instead of 0 changes in the ICRC of a packet of `len`
/// bytes (trailer included). A CRC is linear: the difference of two inputs that differ only
/// in those 2 bytes is the CRC register those bytes leave, carried through every byte after
/// them, which is a multiplication by x^(8n) modulo the polynomial.
fn ipv4_id_delta(id: u16, len: usize) -> u32 {
    if id == 0 {
        return 0;
    }
    // The register the two bytes leave, from zero: a CRC without its initial and final ones.
    let reg = crc32fast::hash(&id.to_be_bytes()) ^ crc32fast::hash(&[0, 0]);
    let after = IPV4_PSEUDO_LEN - IPV4_ID_AT - 2 + len - ICRC_LEN;
    gf2::multiply(gf2::x_pow_8n(after as u64), reg)
}

/// The ICRC changes of the identifications `0..IPV4_IDS`, per packet length, for the few
/// lengths a device sees (full packets of its MTU, the last of a message, ACKs): each is one
/// XOR of up to six remembered values instead of a multiplication chain per packet.
#[derive(Debug, Default)]
pub struct Ipv4Ids {
    /// (length, the change of each identification bit), most recently used first.
    by_len: Vec<(usize, [u32; ID_BITS])>,
}

impl Ipv4Ids {
    const KEEP: usize = 8;

    fn bits(&mut self, len: usize) -> [u32; ID_BITS] {
        if let Some(i) = self.by_len.iter().position(|(l, _)| *l == len) {
            let hit = self.by_len.remove(i);
            self.by_len.insert(0, hit);
            return hit.1;
        }
        let bits = std::array::from_fn(|b| ipv4_id_delta(1 << b, len));
        self.by_len.insert(0, (len, bits));
        self.by_len.truncate(Self::KEEP);
        bits
    }

    /// The change identification `id` (< [`IPV4_IDS`]) makes for packets of `len` bytes.
    fn delta(&mut self, len: usize, id: u16) -> u32 {
        let bits = self.bits(len);
        (0..ID_BITS).filter(|b| id >> b & 1 != 0).fold(0, |d, b| d ^ bits[b])
    }

    /// True if some identification in `1..IPV4_IDS` makes exactly the change `diff`.
    fn explains(&mut self, len: usize, diff: u32) -> bool {
        let bits = self.bits(len);
        // Gray code: each step flips one bit of the identification, so one XOR per candidate.
        let mut d = 0;
        (1..IPV4_IDS).any(|i| {
            d ^= bits[i.trailing_zeros() as usize];
            d == diff
        })
    }
}

/// Moves the ICRC of a packet sealed for IPv4 identification 0 (by [`encode_into`]) to `id`
/// (< [`IPV4_IDS`]).
pub fn set_ipv4_id(packet: &mut [u8], id: u16, ids: &mut Ipv4Ids) {
    debug_assert!(id < IPV4_IDS, "GSO runs are at most {IPV4_IDS} segments");
    let Some(at) = packet.len().checked_sub(ICRC_LEN) else { return };
    let mut trailer = [0u8; ICRC_LEN];
    trailer.copy_from_slice(&packet[at..]);
    let crc = u32::from_le_bytes(trailer) ^ ids.delta(packet.len(), id);
    packet[at..].copy_from_slice(&crc.to_le_bytes());
}

/// True if the packet's ICRC is right for `route` (and, over IPv4, for one of the
/// identifications a sender gives a segment, `0..IPV4_IDS`). A packet too short to hold a BTH
/// and an ICRC is never right.
pub fn icrc_ok(buf: &[u8], route: &Route, ids: &mut Ipv4Ids) -> bool {
    if buf.len() < BTH_LEN + ICRC_LEN {
        return false;
    }
    let body_end = buf.len() - ICRC_LEN;
    let want = u32::from_le_bytes([
        buf[body_end],
        buf[body_end + 1],
        buf[body_end + 2],
        buf[body_end + 3],
    ]);
    let got = icrc(&buf[..body_end], route);
    let v4 = route.src.is_ipv4() && route.dst.is_ipv4();
    got == want || (v4 && ids.explains(buf.len(), got ^ want))
}

/// Arithmetic on CRC-32 registers as polynomials over GF(2), reflected as zlib keeps them.
mod gf2 {
    /// The CRC-32 polynomial, reflected.
    const POLY: u32 = 0xedb8_8320;

    /// a(x)·b(x) modulo the polynomial.
    pub fn multiply(a: u32, mut b: u32) -> u32 {
        let mut product = 0;
        let mut m = 1u32 << 31;
        while m != 0 {
            if a & m != 0 {
                product ^= b;
            }
            b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
            m >>= 1;
        }
        product
    }

    /// x^(8n) modulo the polynomial: square-and-multiply over n's bits.
    pub fn x_pow_8n(n: u64) -> u32 {
        // x^(2^k), from x^8 = x^(2^3).
        let mut square = 1u32 << (31 - 8);
        let mut result = 1u32 << 31; // x^0
        let mut n = n;
        while n != 0 {
            if n & 1 != 0 {
                result = multiply(square, result);
            }
            square = multiply(square, square);
            n >>= 1;
        }
        result
    }
}

/// Writes the headers of `h` into `out` (which must hold [`Header::encoded_len`] bytes) and
/// returns their length.
pub fn write_header(h: &Header, pad: u8, out: &mut [u8]) -> usize {
    debug_assert!(h.psn <= PSN_MASK, "PSN {:#x} does not fit 24 bits", h.psn);
    debug_assert!(h.dest_qpn <= 0xFF_FFFF, "QPN {:#x} does not fit 24 bits", h.dest_qpn);
    out[0] = h.opcode as u8;
    out[1] = (u8::from(h.solicited) << 7) | ((pad & 3) << 4);
    out[2..4].copy_from_slice(&h.pkey.to_be_bytes());
    out[4] = 0;
    out[5..8].copy_from_slice(&(h.dest_qpn & PSN_MASK).to_be_bytes()[1..]);
    out[8] = u8::from(h.ack_req) << 7;
    out[9..12].copy_from_slice(&(h.psn & PSN_MASK).to_be_bytes()[1..]);
    let mut at = BTH_LEN;
    if h.opcode.has_reth() {
        let r = h.reth.unwrap_or(Reth { va: 0, rkey: 0, dma_len: 0 });
        out[at..at + 8].copy_from_slice(&r.va.to_be_bytes());
        out[at + 8..at + 12].copy_from_slice(&r.rkey.to_be_bytes());
        out[at + 12..at + 16].copy_from_slice(&r.dma_len.to_be_bytes());
        at += RETH_LEN;
    }
    if h.opcode.has_imm() {
        out[at..at + 4].copy_from_slice(&h.imm.unwrap_or(0).to_be_bytes());
        at += IMM_LEN;
    }
    if h.opcode == Opcode::Acknowledge {
        let a = h.aeth.unwrap_or(Aeth { syndrome: Syndrome::Ack, msn: 0 });
        out[at] = a.syndrome.to_u8();
        out[at + 1..at + 4].copy_from_slice(&(a.msn & PSN_MASK).to_be_bytes()[1..]);
        at += AETH_LEN;
    }
    at
}

/// Encodes a whole packet into `out` (its contents replaced): headers, payload, pad, and the
/// ICRC for `route` and IPv4 identification 0. `fill` is called with the slice to fill
/// (exactly `payload_len` bytes).
pub fn encode_into(
    h: &Header,
    payload_len: usize,
    out: &mut Vec<u8>,
    route: &Route,
    fill: impl FnOnce(&mut [u8]),
) {
    let pad = (4 - payload_len % 4) % 4;
    let hlen = h.encoded_len();
    let total = hlen + payload_len + pad + ICRC_LEN;
    // Every byte is written below, so a reused buffer is not zeroed first (a memset of each
    // packet cost as much as a tenth of the transmit path).
    if out.len() < total {
        out.resize(total, 0);
    } else {
        out.truncate(total);
    }
    write_header(h, pad as u8, &mut out[..hlen]);
    fill(&mut out[hlen..hlen + payload_len]);
    out[hlen + payload_len..total - ICRC_LEN].fill(0);
    let crc = icrc(&out[..total - ICRC_LEN], route);
    out[total - ICRC_LEN..].copy_from_slice(&crc.to_le_bytes());
}

/// Encodes a packet whose payload is a slice (see [`encode_into`]).
pub fn encode(h: &Header, payload: &[u8], route: &Route) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(h, payload.len(), &mut out, route, |dst| dst.copy_from_slice(payload));
    out
}

fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

/// Parses and validates a packet; the ICRC trailer is skipped ([`icrc_ok`] checks it).
pub fn parse(buf: &[u8]) -> Result<Packet<'_>, ParseError> {
    if buf.len() < BTH_LEN + ICRC_LEN {
        return Err(ParseError::Truncated);
    }
    let opcode = Opcode::from_u8(buf[0]).ok_or(ParseError::UnknownOpcode(buf[0]))?;
    if buf[1] & 0x0f != 0 {
        return Err(ParseError::BadVersion);
    }
    let pad = usize::from((buf[1] >> 4) & 3);
    let mut h = Header {
        opcode,
        solicited: buf[1] & 0x80 != 0,
        pkey: u16::from_be_bytes([buf[2], buf[3]]),
        dest_qpn: be24(&buf[5..8]),
        ack_req: buf[8] & 0x80 != 0,
        psn: be24(&buf[9..12]),
        reth: None,
        imm: None,
        aeth: None,
    };
    let hlen = h.encoded_len();
    if buf.len() < hlen + ICRC_LEN {
        return Err(ParseError::Truncated);
    }
    let body_end = buf.len() - ICRC_LEN;
    let mut at = BTH_LEN;
    if opcode.has_reth() {
        let r = &buf[at..at + RETH_LEN];
        h.reth = Some(Reth {
            va: u64::from_be_bytes([r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]]),
            rkey: u32::from_be_bytes([r[8], r[9], r[10], r[11]]),
            dma_len: u32::from_be_bytes([r[12], r[13], r[14], r[15]]),
        });
        at += RETH_LEN;
    }
    if opcode.has_imm() {
        h.imm = Some(u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]));
        at += IMM_LEN;
    }
    if opcode == Opcode::Acknowledge {
        let syndrome = Syndrome::from_u8(buf[at]).ok_or(ParseError::BadSyndrome)?;
        h.aeth = Some(Aeth { syndrome, msn: be24(&buf[at + 1..at + 4]) });
        at += AETH_LEN;
    }
    let body = &buf[at..body_end];
    if pad > body.len() {
        return Err(ParseError::BadPad);
    }
    let payload = &body[..body.len() - pad];
    if opcode == Opcode::Acknowledge && !payload.is_empty() {
        return Err(ParseError::Inconsistent);
    }
    // The pad makes the payload a multiple of 4; anything else was not built by a RNIC.
    if !body.len().is_multiple_of(4) {
        return Err(ParseError::BadPad);
    }
    Ok(Packet { header: h, payload })
}

/// PSN arithmetic modulo 2^24.
pub mod psn {
    use super::PSN_MASK;

    /// `a + n` modulo 2^24.
    pub fn add(a: u32, n: u32) -> u32 {
        a.wrapping_add(n) & PSN_MASK
    }
    /// `a - n` modulo 2^24.
    pub fn sub(a: u32, n: u32) -> u32 {
        a.wrapping_sub(n) & PSN_MASK
    }
    /// The signed distance from `b` to `a` in serial-number arithmetic: positive when `a` is
    /// after `b`, within ±2^23.
    pub fn diff(a: u32, b: u32) -> i32 {
        let d = a.wrapping_sub(b) & PSN_MASK;
        if d >= 1 << 23 {
            d as i32 - (1 << 24)
        } else {
            d as i32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    fn header(opcode: Opcode) -> Header {
        let mut h = Header::new(opcode, 0x12_3456, 0xff_fffe);
        h.ack_req = true;
        if opcode.has_reth() {
            h.reth = Some(Reth { va: 0xdead_beef_0000, rkey: 0x9abc_def0, dma_len: 4096 });
        }
        if opcode.has_imm() {
            h.imm = Some(0xcafe_f00d);
        }
        if opcode == Opcode::Acknowledge {
            h.aeth = Some(Aeth { syndrome: Syndrome::RnrNak(14), msn: 77 });
        }
        h
    }

    const ALL: [Opcode; 13] = Opcode::ALL;

    const ROUTE: Route = Route {
        src: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 49152),
        dst: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), 4791),
    };

    /// Parses with the ICRC checked for `ROUTE`, as the core does.
    fn checked(bytes: &[u8]) -> Result<Packet<'_>, &'static str> {
        let p = parse(bytes).map_err(|_| "malformed")?;
        if icrc_ok(bytes, &ROUTE, &mut Ipv4Ids::default()) {
            Ok(p)
        } else {
            Err("bad ICRC")
        }
    }

    /// RoCEv2's ICRC as the spec and Linux rxe define it, written out plainly and apart from
    /// `icrc`: a bitwise CRC-32 over the masked pseudo-header and the packet.
    fn reference_icrc(ip_header: &[u8], udp_header: &[u8], body: &[u8]) -> u32 {
        let mut input = vec![0xffu8; 8];
        let mut ip = ip_header.to_vec();
        if ip[0] >> 4 == 4 {
            ip[1] = 0xff; // TOS
            ip[8] = 0xff; // TTL
            ip[10] = 0xff; // checksum
            ip[11] = 0xff;
        } else {
            ip[0] |= 0x0f; // traffic class (high half)
            ip[1] = 0xff; // traffic class (low half), flow label
            ip[2] = 0xff;
            ip[3] = 0xff;
            ip[7] = 0xff; // hop limit
        }
        input.extend_from_slice(&ip);
        let mut udp = udp_header.to_vec();
        udp[6] = 0xff;
        udp[7] = 0xff;
        input.extend_from_slice(&udp);
        let mut bth = body.to_vec();
        bth[4] = 0xff;
        input.extend_from_slice(&bth);
        let mut crc = 0xffff_ffffu32;
        for byte in input {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn the_icrc_matches_published_packets_of_a_connectx_4_and_scapy() {
        // A CNP captured on a ConnectX-4 Lx (scapy's test/contrib/roce.uts): IPv4 with ECN
        // marks and identification 0x718c, UDP source port 0, BECN set; ICRC 82 fd 00 2a.
        let zeros = "00".repeat(20); // the BTH's last 4 bytes and the CNP's 16 of padding
        let frame = hex(&format!(
            "e41d2dab2bc27cfe90643b32 0800 45c2003c718c400040119161 0a001101 0a001201
             000012b700280000 8100ffff40000118 {zeros} 82fd002a"
        ));
        let (ip, udp, body, trailer) = (
            &frame[14..34],
            &frame[34..42],
            &frame[42..frame.len() - 4],
            &frame[frame.len() - 4..],
        );
        let wire = u32::from_le_bytes(trailer.try_into().unwrap());
        assert_eq!(reference_icrc(ip, udp, body), wire, "the reference agrees with the NIC");
        let route = Route {
            src: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 17, 1)), 0),
            dst: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 18, 1)), 4791),
        };
        assert_eq!(icrc(body, &route) ^ ipv4_id_delta(0x718c, body.len() + 4), wire);
        // scapy's UC SEND_ONLY example: TOS 1, identification 1144, TTL 64; 78 f3 53 f3.
        let mut body = hex("2460ffff000000d300cf1710");
        body.extend_from_slice(b"F0\x81\x8b\xe2\x895\xd9\x0e\x9a\x95PT\x01\xbe\x88^P\x00\x00");
        let route = Route {
            src: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 0, 7)), 49152),
            dst: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(192, 168, 0, 7)), 4791),
        };
        let got = icrc(&body, &route) ^ ipv4_id_delta(1144, body.len() + 4);
        assert_eq!(got.to_le_bytes(), [0x78, 0xf3, 0x53, 0xf3]);
    }

    #[test]
    fn identifications_a_sender_cannot_give_are_refused() {
        let mut packet = encode(&header(Opcode::SendOnly), &[9; 100], &ROUTE);
        let mut ids = Ipv4Ids::default();
        // Sealed as if the kernel had numbered it 64, 1000 or 0x718c: not a bex GSO segment.
        for id in [64u16, 1000, 0x718c] {
            let delta = ipv4_id_delta(id, packet.len());
            let at = packet.len() - ICRC_LEN;
            let crc = u32::from_le_bytes(packet[at..].try_into().unwrap()) ^ delta;
            let mut moved = packet.clone();
            moved[at..].copy_from_slice(&crc.to_le_bytes());
            assert!(!icrc_ok(&moved, &ROUTE, &mut ids), "identification {id}");
        }
        // One flipped bit is caught whatever identification it could stand for.
        packet[20] ^= 4;
        assert!(!icrc_ok(&packet, &ROUTE, &mut ids));
    }

    #[test]
    fn the_icrc_agrees_with_the_reference_over_ipv4_and_ipv6_and_any_identification() {
        let v6 = Route {
            src: "[fd00::1]:4791".parse().unwrap(),
            dst: "[fd00::2]:50000".parse().unwrap(),
        };
        for route in [ROUTE, v6] {
            for len in [0usize, 1, 61, 4096] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
                let mut packet = encode(&header(Opcode::SendOnly), &payload, &route);
                let (body_len, total) = (packet.len() - ICRC_LEN, packet.len());
                let udp_len = (8 + total) as u16;
                let mut udp = Vec::new();
                udp.extend_from_slice(&route.src.port().to_be_bytes());
                udp.extend_from_slice(&route.dst.port().to_be_bytes());
                udp.extend_from_slice(&udp_len.to_be_bytes());
                udp.extend_from_slice(&[0x12, 0x34]); // any checksum
                let ids: &[u16] = if route.src.is_ipv4() { &[0, 1, 2, 37, 63] } else { &[0] };
                for &id in ids {
                    let ip = match (route.src.ip(), route.dst.ip()) {
                        (IpAddr::V4(s), IpAddr::V4(d)) => {
                            let mut ip = vec![0x45, 0x02];
                            ip.extend_from_slice(&(20 + udp_len).to_be_bytes());
                            ip.extend_from_slice(&id.to_be_bytes());
                            ip.extend_from_slice(&[0x40, 0x00, 64, 17, 0xab, 0xcd]);
                            ip.extend_from_slice(&s.octets());
                            ip.extend_from_slice(&d.octets());
                            ip
                        }
                        (IpAddr::V6(s), IpAddr::V6(d)) => {
                            let mut ip = vec![0x60, 0x12, 0x34, 0x56];
                            ip.extend_from_slice(&udp_len.to_be_bytes());
                            ip.extend_from_slice(&[17, 64]);
                            ip.extend_from_slice(&s.octets());
                            ip.extend_from_slice(&d.octets());
                            ip
                        }
                        _ => unreachable!(),
                    };
                    let mut ids = Ipv4Ids::default();
                    set_ipv4_id(&mut packet, id, &mut ids);
                    let wire = u32::from_le_bytes(packet[body_len..].try_into().unwrap());
                    let want = reference_icrc(&ip, &udp, &packet[..body_len]);
                    assert_eq!(wire, want, "{route:?} len {len} id {id}");
                    assert!(
                        icrc_ok(&packet, &route, &mut ids),
                        "accepted with identification {id}"
                    );
                    set_ipv4_id(&mut packet, id, &mut ids); // back to identification 0
                }
                // Another route does not verify.
                let other = Route { dst: SocketAddr::new(route.dst.ip(), 1), ..route };
                assert!(!icrc_ok(&packet, &other, &mut Ipv4Ids::default()));
            }
        }
    }

    #[test]
    fn every_opcode_round_trips_with_odd_payloads() {
        for op in ALL {
            for len in [0usize, 1, 3, 4, 5, 4096] {
                let payload: Vec<u8> = if op == Opcode::Acknowledge {
                    vec![]
                } else {
                    (0..len).map(|i| i as u8).collect()
                };
                let bytes = encode(&header(op), &payload, &ROUTE);
                assert_eq!(bytes.len() % 4, 0);
                let p = checked(&bytes).unwrap();
                assert_eq!(p.header, header(op));
                assert_eq!(p.payload, &payload[..]);
            }
        }
    }

    #[test]
    fn bth_layout_matches_the_spec() {
        let bytes = encode(&header(Opcode::SendOnly), &[1, 2, 3], &ROUTE);
        assert_eq!(bytes[0], 0x04);
        assert_eq!(bytes[1] >> 4 & 3, 1, "pad count for a 3-byte payload");
        assert_eq!(&bytes[2..4], &[0xff, 0xff]);
        assert_eq!(&bytes[5..8], &[0x12, 0x34, 0x56]);
        assert_eq!(bytes[8], 0x80);
        assert_eq!(&bytes[9..12], &[0xff, 0xff, 0xfe]);
    }

    #[test]
    fn a_flipped_bit_fails_the_icrc() {
        let mut bytes = encode(&header(Opcode::WriteOnly), &[7; 64], &ROUTE);
        bytes[40] ^= 0x10;
        assert_eq!(checked(&bytes), Err("bad ICRC"));
        // FECN/BECN byte is masked out of the ICRC.
        let mut marked = encode(&header(Opcode::WriteOnly), &[7; 64], &ROUTE);
        marked[4] = 0x80;
        assert!(checked(&marked).is_ok());
    }

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn::add(PSN_MASK, 1), 0);
        assert_eq!(psn::sub(0, 1), PSN_MASK);
        assert_eq!(psn::diff(0, PSN_MASK), 1);
        assert_eq!(psn::diff(PSN_MASK, 0), -1);
        assert_eq!(psn::diff(5, 5), 0);
    }

    proptest! {
        #[test]
        fn parse_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = checked(&bytes);
            let _ = parse(&bytes);
        }

        #[test]
        fn truncations_of_valid_packets_are_errors(op in 0usize..13, len in 0usize..100, cut in 1usize..40) {
            let op = ALL[op];
            let payload = if op == Opcode::Acknowledge { vec![] } else { vec![0xabu8; len] };
            let bytes = encode(&header(op), &payload, &ROUTE);
            let cut = cut.min(bytes.len());
            prop_assert!(checked(&bytes[..bytes.len() - cut]).is_err());
        }

        #[test]
        fn mutated_valid_packets_never_panic(op in 0usize..13, pos in 0usize..64, val in any::<u8>()) {
            let op = ALL[op];
            let payload = if op == Opcode::Acknowledge { vec![] } else { vec![1u8; 20] };
            let mut bytes = encode(&header(op), &payload, &ROUTE);
            let pos = pos % bytes.len();
            bytes[pos] = val;
            let _ = parse(&bytes);
            let _ = checked(&bytes);
        }
    }
}
