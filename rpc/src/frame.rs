//! The RPC frame: a fixed 40-byte little-endian header at the start of every message, the
//! body right after it in the same registered buffer.
//!
//! ```text
//!  0 magic u16 (0xB3C0)  2 version u8 (2)  3 kind u8 (see `Kind`)
//!  4 method u16          6 status u16 (0 ok; see `Status`)
//!  8 request id u64
//! 16 requests: reply target   addr u64 | rkey u32 | slot u32 | capacity u64 (all 0: none)
//!    replies:  body length u64 | 16 bytes 0
//! ```
//!
//! A request may name a buffer the caller exposed for its reply (RDMA: the paper's
//! "remote-buffer metadata in advance", which saves the RTS/CTS round trip of a large
//! reply and lands it where the caller wants it). The server then WRITEs the whole reply
//! frame there ([`Kind::Placed`]) when it fits; when it does not, it WRITEs a bare
//! [`Kind::Elsewhere`] header there and sends the reply as an ordinary message, so every
//! exposed buffer is written exactly once and can be freed.

/// Header length.
pub const HEADER_LEN: usize = 40;
const MAGIC: u16 = 0xb3c0;
const VERSION: u8 = 2;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A call.
    Request = 1,
    /// A successful reply.
    Response = 2,
    /// A failed reply: the body is a UTF-8 message.
    Error = 3,
    /// A reply (successful or not, `status` says) written into the caller's exposed buffer;
    /// the buffer is larger than the frame, `body_len` says how much is reply.
    Placed = 4,
    /// Written into the caller's exposed buffer when the reply did not fit it: the reply
    /// comes as an ordinary message.
    Elsewhere = 5,
}

/// Where the caller wants its reply: a buffer it exposed on the same connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyTarget {
    /// Address at the caller.
    pub addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// The caller's slot for it (its final write names the slot).
    pub slot: u32,
    /// Bytes the buffer holds (a whole reply frame must fit).
    pub capacity: u64,
}

/// Status codes of error replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// The request was malformed.
    BadRequest = 1,
    /// No such method.
    UnknownMethod = 2,
    /// The server failed.
    Internal = 3,
    /// The server is overloaded or shutting down.
    Unavailable = 4,
    /// A named thing (table, key) does not exist.
    NotFound = 5,
}

impl Status {
    /// Decodes a status (unknown values become `Internal`).
    pub fn from_u16(v: u16) -> Status {
        match v {
            0 => Status::Ok,
            1 => Status::BadRequest,
            2 => Status::UnknownMethod,
            4 => Status::Unavailable,
            5 => Status::NotFound,
            _ => Status::Internal,
        }
    }
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Method number.
    pub method: u16,
    /// Status (replies).
    pub status: u16,
    /// Request id, echoed in the reply.
    pub id: u64,
    /// Requests: where the reply should go, if anywhere.
    pub target: Option<ReplyTarget>,
    /// Replies: bytes of body after the header.
    pub body_len: u64,
}

impl Header {
    /// A request header (no reply target).
    pub fn request(method: u16, id: u64) -> Header {
        Header { kind: Kind::Request, method, status: 0, id, target: None, body_len: 0 }
    }

    /// A reply header of `kind` with a body of `body_len` bytes.
    pub fn reply(kind: Kind, method: u16, status: u16, id: u64, body_len: usize) -> Header {
        Header { kind, method, status, id, target: None, body_len: body_len as u64 }
    }

    /// Writes the header into `out[..HEADER_LEN]`.
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        out[3] = self.kind as u8;
        out[4..6].copy_from_slice(&self.method.to_le_bytes());
        out[6..8].copy_from_slice(&self.status.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..40].fill(0);
        match (self.kind, self.target) {
            (Kind::Request, Some(t)) => {
                out[16..24].copy_from_slice(&t.addr.to_le_bytes());
                out[24..28].copy_from_slice(&t.rkey.to_le_bytes());
                out[28..32].copy_from_slice(&t.slot.to_le_bytes());
                out[32..40].copy_from_slice(&t.capacity.to_le_bytes());
            }
            (Kind::Request, None) => {}
            _ => out[16..24].copy_from_slice(&self.body_len.to_le_bytes()),
        }
    }

    /// Decodes a header; `None` for anything that is not a version-2 bex RPC frame (bad
    /// magic, version or kind, a request target of capacity 0, a reply with non-zero
    /// reserved bytes).
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < HEADER_LEN || u16::from_le_bytes([b[0], b[1]]) != MAGIC || b[2] != VERSION {
            return None;
        }
        let kind = match b[3] {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Error,
            4 => Kind::Placed,
            5 => Kind::Elsewhere,
            _ => return None,
        };
        let u64_at = |i: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (target, body_len) = if kind == Kind::Request {
            let t = ReplyTarget {
                addr: u64_at(16),
                rkey: u32_at(24),
                slot: u32_at(28),
                capacity: u64_at(32),
            };
            let none = ReplyTarget { addr: 0, rkey: 0, slot: 0, capacity: 0 };
            match t {
                _ if t == none => (None, 0),
                _ if t.capacity < HEADER_LEN as u64 => return None,
                _ => (Some(t), 0),
            }
        } else {
            if b[24..40].iter().any(|&x| x != 0) {
                return None;
            }
            (None, u64_at(16))
        };
        Some(Header {
            kind,
            method: u16::from_le_bytes([b[4], b[5]]),
            status: u16::from_le_bytes([b[6], b[7]]),
            id: u64_at(8),
            target,
            body_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_and_rejects_foreign_bytes() {
        let h = Header::reply(Kind::Error, 7, 5, u64::MAX - 1, 12);
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Some(h));
        let t = ReplyTarget { addr: 0x1000, rkey: 9, slot: 3, capacity: 4096 };
        let r = Header { target: Some(t), ..Header::request(2, 77) };
        let mut c = [0u8; HEADER_LEN];
        r.encode(&mut c);
        assert_eq!(Header::decode(&c), Some(r));
        // A target too small for any reply frame is refused; so are reserved bytes.
        c[32..40].copy_from_slice(&8u64.to_le_bytes());
        assert_eq!(Header::decode(&c), None);
        b[30] = 1;
        assert_eq!(Header::decode(&b), None);
        b[30] = 0;
        b[2] = 9;
        assert_eq!(Header::decode(&b), None);
        assert_eq!(Header::decode(&b[..3]), None);
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Header::decode(&b);
        }
    }
}
