//! The engine's wire protocol: a fixed 64-byte little-endian header at the start of every
//! SEND, followed (for eager data) by the payload.
//!
//! ```text
//!  0  magic u8 (0xBE)     1  kind u8        2  credits u16   (piggybacked credit return)
//!  4  dst_socket u32      8  src_socket u32 12  msg_id u32
//! 16  len u64             (payload or whole-message length)
//! 24  aux u64             (CTS: destination address; keepalive: sequence number)
//! 32  aux32 u32           (CTS: rkey)
//! 36  slot u32            (CTS: receiver slot the final WRITE_WITH_IMM names in its imm;
//!                          RTS: a standing grant the sender gives back, 0 for none)
//! 40  grant: addr u64, rkey u32, slot u32, len u64   (Data, RTS, CTS; len 0: none)
//! ```
//!
//! A standing grant is a CTS sent before any RTS: the receiver of a large message offers a
//! buffer for the next one on whatever it sends next on that socket (a header here, or the
//! prefix of a message it writes into a grant of its own), so request/response traffic of
//! large messages, in either direction, costs no RTS/CTS round trip after the first. A
//! message written into a grant starts with a [`GRANT_PREFIX_LEN`]-byte prefix: its length
//! (the WRITE_WITH_IMM's completion only knows its own fragment) and the writer's own offer.
//!
//! Headers and prefixes come from the network: decoding validates and never panics.

/// Header length in bytes.
pub const HEADER_LEN: usize = 64;
/// Length of the prefix of a message written into a standing grant.
pub const GRANT_PREFIX_LEN: usize = 32;
const MAGIC: u8 = 0xbe;

/// A buffer at the receiver that a large message may be written into directly: exposed by
/// the application ([`crate::RdmaSocket::expose`]) or offered by the engine (a grant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteTarget {
    /// Destination address at the receiver.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// The receiver's slot for it (named by the final WRITE_WITH_IMM's imm).
    pub slot: u32,
    /// Capacity in bytes.
    pub len: u64,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(v)
}

/// Writes an optional grant into 24 bytes (capacity 0: none).
fn encode_grant(g: Option<RemoteTarget>, out: &mut [u8]) {
    let g = g.unwrap_or(RemoteTarget { addr: 0, rkey: 0, slot: 0, len: 0 });
    out[0..8].copy_from_slice(&g.addr.to_le_bytes());
    out[8..12].copy_from_slice(&g.rkey.to_le_bytes());
    out[12..16].copy_from_slice(&g.slot.to_le_bytes());
    out[16..24].copy_from_slice(&g.len.to_le_bytes());
}

/// Reads an optional grant; `Err` for a capacity of 0 with other fields set (no encoder
/// writes that, and decoding it as "none" would not round-trip).
fn decode_grant(b: &[u8]) -> Result<Option<RemoteTarget>, HeaderError> {
    let g = RemoteTarget {
        addr: u64_at(b, 0),
        rkey: u32_at(b, 8),
        slot: u32_at(b, 12),
        len: u64_at(b, 16),
    };
    match g {
        RemoteTarget { len: 0, addr: 0, rkey: 0, slot: 0 } => Ok(None),
        RemoteTarget { len: 0, .. } => Err(HeaderError::BadGrant),
        g => Ok(Some(g)),
    }
}

/// Writes the prefix of a message of `len` bytes going into a grant, with the writer's own
/// offer, into `out[..GRANT_PREFIX_LEN]`.
pub fn encode_grant_prefix(len: u64, offer: Option<RemoteTarget>, out: &mut [u8]) {
    out[..8].copy_from_slice(&len.to_le_bytes());
    encode_grant(offer, &mut out[8..GRANT_PREFIX_LEN]);
}

/// Reads a grant prefix: the message's length and the writer's offer (`None` if short or
/// malformed).
pub fn decode_grant_prefix(b: &[u8]) -> Option<(u64, Option<RemoteTarget>)> {
    if b.len() < GRANT_PREFIX_LEN {
        return None;
    }
    Some((u64_at(b, 0), decode_grant(&b[8..GRANT_PREFIX_LEN]).ok()?))
}

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Eager data: the payload follows the header.
    Data = 1,
    /// Request to send a large message of `len` bytes (`msg_id` names it).
    Rts = 2,
    /// Clear to send: write message `msg_id` to `aux` with rkey `aux32`, finish with
    /// WRITE_WITH_IMM whose imm is `slot`.
    Cts = 3,
    /// Open a logical socket (`src_socket` is the opener's id).
    Open = 4,
    /// Opened: `dst_socket` is the opener's id, `src_socket` the acceptor's.
    OpenAck = 5,
    /// No listener accepts sockets: `dst_socket` is the opener's id.
    OpenNak = 6,
    /// The sender closed its end of `dst_socket`.
    Close = 7,
    /// Only returns credits.
    Credit = 8,
    /// Keepalive with sequence number `aux`.
    Keepalive = 9,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Data,
            2 => Kind::Rts,
            3 => Kind::Cts,
            4 => Kind::Open,
            5 => Kind::OpenAck,
            6 => Kind::OpenNak,
            7 => Kind::Close,
            8 => Kind::Credit,
            9 => Kind::Keepalive,
            _ => return None,
        })
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Credits returned to the receiver of this header.
    pub credits: u16,
    /// Socket id at the receiver.
    pub dst_socket: u32,
    /// Socket id at the sender.
    pub src_socket: u32,
    /// Message id (sender's numbering per socket).
    pub msg_id: u32,
    /// Length.
    pub len: u64,
    /// Kind-specific.
    pub aux: u64,
    /// Kind-specific.
    pub aux32: u32,
    /// Kind-specific.
    pub slot: u32,
    /// A standing grant for the receiver's next large message on this socket (Data, RTS
    /// and CTS carry one).
    pub grant: Option<RemoteTarget>,
}

impl Header {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: Kind) -> Header {
        Header {
            kind,
            credits: 0,
            dst_socket: 0,
            src_socket: 0,
            msg_id: 0,
            len: 0,
            aux: 0,
            aux32: 0,
            slot: 0,
            grant: None,
        }
    }

    /// Writes the header into `out[..HEADER_LEN]`.
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_LEN];
        out[0] = MAGIC;
        out[1] = self.kind as u8;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
        out[4..8].copy_from_slice(&self.dst_socket.to_le_bytes());
        out[8..12].copy_from_slice(&self.src_socket.to_le_bytes());
        out[12..16].copy_from_slice(&self.msg_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        out[24..32].copy_from_slice(&self.aux.to_le_bytes());
        out[32..36].copy_from_slice(&self.aux32.to_le_bytes());
        out[36..40].copy_from_slice(&self.slot.to_le_bytes());
        encode_grant(self.grant, &mut out[40..64]);
    }

    /// Decodes and validates a header.
    pub fn decode(buf: &[u8]) -> Result<Header, HeaderError> {
        if buf.len() < HEADER_LEN {
            return Err(HeaderError::Truncated);
        }
        if buf[0] != MAGIC {
            return Err(HeaderError::BadMagic);
        }
        let kind = Kind::from_u8(buf[1]).ok_or(HeaderError::UnknownKind(buf[1]))?;
        Ok(Header {
            kind,
            credits: u16::from_le_bytes([buf[2], buf[3]]),
            dst_socket: u32_at(buf, 4),
            src_socket: u32_at(buf, 8),
            msg_id: u32_at(buf, 12),
            len: u64_at(buf, 16),
            aux: u64_at(buf, 24),
            aux32: u32_at(buf, 32),
            slot: u32_at(buf, 36),
            grant: decode_grant(&buf[40..64])?,
        })
    }
}

/// Why a header was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum HeaderError {
    /// Shorter than a header.
    #[error("message shorter than its header")]
    Truncated,
    /// Not a bex engine message.
    #[error("bad magic byte")]
    BadMagic,
    /// A kind this version does not know.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A grant of capacity 0 with an address, key or slot.
    #[error("malformed grant")]
    BadGrant,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let h = Header {
            kind: Kind::Cts,
            credits: 7,
            dst_socket: 1,
            src_socket: 2,
            msg_id: 3,
            len: 1 << 40,
            aux: 0xdead_beef_cafe,
            aux32: 0x1234_5678,
            slot: 9,
            grant: Some(RemoteTarget { addr: 0xfeed, rkey: 3, slot: 4, len: 1 << 20 }),
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Ok(h));
        b[0] = 0;
        assert_eq!(Header::decode(&b), Err(HeaderError::BadMagic));
        assert_eq!(Header::decode(&b[..10]), Err(HeaderError::Truncated));
    }

    #[test]
    fn grant_prefixes_round_trip() {
        let mut b = [0u8; GRANT_PREFIX_LEN];
        let offer = Some(RemoteTarget { addr: 1 << 40, rkey: 5, slot: 6, len: 4096 });
        encode_grant_prefix(12345, offer, &mut b);
        assert_eq!(decode_grant_prefix(&b), Some((12345, offer)));
        encode_grant_prefix(7, None, &mut b);
        assert_eq!(decode_grant_prefix(&b), Some((7, None)));
        assert_eq!(decode_grant_prefix(&b[..31]), None);
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Header::decode(&bytes);
            let _ = decode_grant_prefix(&bytes);
        }
    }
}
