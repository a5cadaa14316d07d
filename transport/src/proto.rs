//! The engine's wire protocol: a fixed 40-byte little-endian header at the start of every
//! SEND, followed (for eager data) by the payload.
//!
//! ```text
//!  0  magic u8 (0xBE)     1  kind u8        2  credits u16   (piggybacked credit return)
//!  4  dst_socket u32      8  src_socket u32 12  msg_id u32
//! 16  len u64             (payload or whole-message length)
//! 24  aux u64             (CTS: destination address; keepalive: sequence number)
//! 32  aux32 u32           (CTS: rkey)
//! 36  slot u32            (CTS: receiver slot the final WRITE_WITH_IMM names in its imm)
//! ```
//!
//! Headers come from the network: decoding validates everything and never panics.

/// Header length in bytes.
pub const HEADER_LEN: usize = 40;
const MAGIC: u8 = 0xbe;

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
        let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i..i + 8]);
            u64::from_le_bytes(b)
        };
        Ok(Header {
            kind,
            credits: u16::from_le_bytes([buf[2], buf[3]]),
            dst_socket: u32_at(4),
            src_socket: u32_at(8),
            msg_id: u32_at(12),
            len: u64_at(16),
            aux: u64_at(24),
            aux32: u32_at(32),
            slot: u32_at(36),
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
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Ok(h));
        b[0] = 0;
        assert_eq!(Header::decode(&b), Err(HeaderError::BadMagic));
        assert_eq!(Header::decode(&b[..10]), Err(HeaderError::Truncated));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Header::decode(&bytes);
        }
    }
}
