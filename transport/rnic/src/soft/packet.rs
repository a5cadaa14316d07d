//! RoCEv2 packets as the software RNIC puts them in UDP payloads: BTH, then RETH / ImmDt /
//! AETH as the opcode requires, the payload padded to 4 bytes, and a 4-byte ICRC.
//!
//! All fields are big-endian, as on the wire. The ICRC is a CRC-32 over the BTH (with the
//! FECN/BECN/reserved byte masked to ones, as RoCE masks variant fields) and everything after
//! it; the IP/UDP pseudo-header that hardware also covers is not part of it, since the software
//! RNIC never sees its own IP header.
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
    /// ICRC mismatch (corruption).
    BadIcrc,
    /// An AETH syndrome that means nothing.
    BadSyndrome,
    /// Headers required by the opcode are inconsistent (e.g. payload on an ACK).
    Inconsistent,
}

/// A parsed packet borrowing its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Headers.
    pub header: Header,
    /// Payload without pad and ICRC.
    pub payload: &'a [u8],
}

fn icrc(bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    // BTH byte 4 (FECN, BECN, reserved) may be rewritten in flight: masked to ones.
    h.update(&bytes[..4]);
    h.update(&[0xff]);
    h.update(&bytes[5..]);
    h.finalize()
}

/// Writes the headers of `h` into `out` (which must hold [`Header::encoded_len`] bytes) and
/// returns their length.
pub fn write_header(h: &Header, pad: u8, out: &mut [u8]) -> usize {
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

/// Encodes a whole packet into `out` (cleared first): headers, payload, pad, ICRC.
/// `payload` is called with the slice to fill (exactly `payload_len` bytes).
pub fn encode_into(
    h: &Header,
    payload_len: usize,
    out: &mut Vec<u8>,
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
    let crc = icrc(&out[..total - ICRC_LEN]);
    out[total - ICRC_LEN..].copy_from_slice(&crc.to_le_bytes());
}

/// Encodes a packet whose payload is a slice.
pub fn encode(h: &Header, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(h, payload.len(), &mut out, |dst| dst.copy_from_slice(payload));
    out
}

fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

/// Parses and validates a packet. With `check_icrc` false the trailer is skipped unchecked.
pub fn parse(buf: &[u8], check_icrc: bool) -> Result<Packet<'_>, ParseError> {
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
    if check_icrc {
        let want = u32::from_le_bytes([
            buf[body_end],
            buf[body_end + 1],
            buf[body_end + 2],
            buf[body_end + 3],
        ]);
        if icrc(&buf[..body_end]) != want {
            return Err(ParseError::BadIcrc);
        }
    }
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

    #[test]
    fn every_opcode_round_trips_with_odd_payloads() {
        for op in ALL {
            for len in [0usize, 1, 3, 4, 5, 4096] {
                let payload: Vec<u8> = if op == Opcode::Acknowledge {
                    vec![]
                } else {
                    (0..len).map(|i| i as u8).collect()
                };
                let bytes = encode(&header(op), &payload);
                assert_eq!(bytes.len() % 4, 0);
                let p = parse(&bytes, true).unwrap();
                assert_eq!(p.header, header(op));
                assert_eq!(p.payload, &payload[..]);
            }
        }
    }

    #[test]
    fn bth_layout_matches_the_spec() {
        let bytes = encode(&header(Opcode::SendOnly), &[1, 2, 3]);
        assert_eq!(bytes[0], 0x04);
        assert_eq!(bytes[1] >> 4 & 3, 1, "pad count for a 3-byte payload");
        assert_eq!(&bytes[2..4], &[0xff, 0xff]);
        assert_eq!(&bytes[5..8], &[0x12, 0x34, 0x56]);
        assert_eq!(bytes[8], 0x80);
        assert_eq!(&bytes[9..12], &[0xff, 0xff, 0xfe]);
    }

    #[test]
    fn a_flipped_bit_fails_the_icrc() {
        let mut bytes = encode(&header(Opcode::WriteOnly), &[7; 64]);
        bytes[40] ^= 0x10;
        assert_eq!(parse(&bytes, true), Err(ParseError::BadIcrc));
        // FECN/BECN byte is masked out of the ICRC.
        let mut marked = encode(&header(Opcode::WriteOnly), &[7; 64]);
        marked[4] = 0x80;
        assert!(parse(&marked, true).is_ok());
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
            let _ = parse(&bytes, true);
            let _ = parse(&bytes, false);
        }

        #[test]
        fn truncations_of_valid_packets_are_errors(op in 0usize..13, len in 0usize..100, cut in 1usize..40) {
            let op = ALL[op];
            let payload = if op == Opcode::Acknowledge { vec![] } else { vec![0xabu8; len] };
            let bytes = encode(&header(op), &payload);
            let cut = cut.min(bytes.len());
            prop_assert!(parse(&bytes[..bytes.len() - cut], true).is_err());
        }

        #[test]
        fn mutated_valid_packets_never_panic(op in 0usize..13, pos in 0usize..64, val in any::<u8>()) {
            let op = ALL[op];
            let payload = if op == Opcode::Acknowledge { vec![] } else { vec![1u8; 20] };
            let mut bytes = encode(&header(op), &payload);
            let pos = pos % bytes.len();
            bytes[pos] = val;
            let _ = parse(&bytes, false);
            let _ = parse(&bytes, true);
        }
    }
}
