//! The RPC frame: a fixed 16-byte little-endian header at the start of every message, the
//! body right after it in the same registered buffer.
//!
//! ```text
//! 0 magic u16 (0xB3C0)  2 version u8 (1)  3 kind u8 (1 request, 2 response, 3 error)
//! 4 method u16          6 status u16 (0 ok; see `Status`)
//! 8 request id u64
//! ```

/// Header length.
pub const HEADER_LEN: usize = 16;
const MAGIC: u16 = 0xb3c0;
const VERSION: u8 = 1;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A call.
    Request = 1,
    /// A successful reply.
    Response = 2,
    /// A failed reply: the body is a UTF-8 message.
    Error = 3,
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
}

impl Header {
    /// Writes the header into `out[..HEADER_LEN]`.
    pub fn encode(&self, out: &mut [u8]) {
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        out[3] = self.kind as u8;
        out[4..6].copy_from_slice(&self.method.to_le_bytes());
        out[6..8].copy_from_slice(&self.status.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
    }

    /// Decodes a header; `None` for anything that is not a version-1 bex RPC frame.
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < HEADER_LEN || u16::from_le_bytes([b[0], b[1]]) != MAGIC || b[2] != VERSION {
            return None;
        }
        let kind = match b[3] {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Error,
            _ => return None,
        };
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Some(Header {
            kind,
            method: u16::from_le_bytes([b[4], b[5]]),
            status: u16::from_le_bytes([b[6], b[7]]),
            id: u64::from_le_bytes(id),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_and_rejects_foreign_bytes() {
        let h = Header { kind: Kind::Error, method: 7, status: 5, id: u64::MAX - 1 };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), Some(h));
        b[2] = 9;
        assert_eq!(Header::decode(&b), None);
        assert_eq!(Header::decode(&b[..3]), None);
    }

    proptest! {
        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = Header::decode(&b);
        }
    }
}
