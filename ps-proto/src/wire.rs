//! The parameter-server wire protocol: fixed little-endian frames encoded straight into and
//! decoded straight out of byte slices (the transport's registered `Msg`, or any buffer),
//! with keys and values as raw little-endian arrays — no per-row serialization.
//!
//! # Request frame (40-byte header, then the body)
//!
//! | offset | size | field | notes |
//! | ---: | ---: | --- | --- |
//! | 0 | 4 | magic | `b"BXPQ"` |
//! | 4 | 1 | version | [`WIRE_VERSION`] (3) |
//! | 5 | 1 | op | [`Op`] |
//! | 6 | 2 | flags | [`flags`] (u16 LE) |
//! | 8 | 4 | table | table id (u32 LE) |
//! | 12 | 4 | dim | row dimension (u32 LE); 0 for control ops |
//! | 16 | 4 | count | number of keys (u32 LE); 0 for control ops |
//! | 20 | 4 | body_len | bytes after the header (u32 LE); must equal the frame's rest |
//! | 24 | 8 | client | client id (u64 LE): dedupe scope of `seq` |
//! | 32 | 8 | seq | sequence number (u64 LE) |
//! | 40 | 8·count | keys | `count` × u64 LE (data ops) |
//! | 40+8·count | 4·count·dim | values | `count·dim` × f32 LE (Push: gradients; Replicate: rows) |
//!
//! Fetch: body = keys. Push / Replicate: body = keys then values. Control ops (Snapshot,
//! Checkpoint, Health, Admin, Tables): body = a postcard-encoded control message from
//! [`control`](crate::control) (possibly empty).
//!
//! # Response frame (32-byte header, then the body)
//!
//! | offset | size | field | notes |
//! | ---: | ---: | --- | --- |
//! | 0 | 4 | magic | `b"BXPR"` |
//! | 4 | 1 | version | 1 |
//! | 5 | 1 | op | echo of the request's op; 0 when the request's op was unreadable |
//! | 6 | 1 | status | [`Status`] |
//! | 7 | 1 | reserved | 0 |
//! | 8 | 4 | count | Fetch: rows; Push/Replicate: keys applied; Snapshot: rows in the chunk |
//! | 12 | 4 | dim | Fetch: row dimension |
//! | 16 | 4 | body_len | bytes after the header |
//! | 20 | 4 | reserved | 0 |
//! | 24 | 8 | seq | echo of the request's `seq` |
//! | 32 | … | body | Fetch + Ok: `count·dim` × f32 LE rows in request key order; control + Ok: postcard; Snapshot + Ok: a snapshot chunk (`bex_ps_core::checkpoint`); any error status: a UTF-8 message (≤ [`MAX_ERROR_MESSAGE`] bytes) |
//!
//! Both headers are multiples of 8 bytes, so in an 8-aligned buffer the key array is 8-aligned
//! and the row arrays 4-aligned; the decoders do not rely on it (they read bytes).
//!
//! Decoding checks, in order: length ≥ header, magic, version, op/status, the frame limit,
//! `body_len` against the frame, then per op the dimension and key-count limits and that
//! `body_len` equals what `count` and `dim` imply (computed without overflow). Every failure is
//! a [`WireError`]; no input makes the decoders panic (property-tested).

use std::borrow::Cow;

use serde::{de::DeserializeOwned, Serialize};

/// Protocol version in both headers. 2: `TableSpec` (in the Tables reply) gained
/// `admission` and `capacity`; 3: the Tables reply gained the shard count. Postcard is not
/// self-describing, so an older peer is refused with a clear error rather than misreading
/// the reply.
pub const WIRE_VERSION: u8 = 3;
/// Request magic, `b"BXPQ"`.
pub const REQUEST_MAGIC: [u8; 4] = *b"BXPQ";
/// Response magic, `b"BXPR"`.
pub const RESPONSE_MAGIC: [u8; 4] = *b"BXPR";
/// Request header length in bytes.
pub const REQUEST_HEADER_LEN: usize = 40;
/// Response header length in bytes.
pub const RESPONSE_HEADER_LEN: usize = 32;
/// Longest error message carried in an error response (longer ones are cut at a char
/// boundary).
pub const MAX_ERROR_MESSAGE: usize = 256;
/// Largest dimension the protocol admits (tables are validated against the same bound).
pub const MAX_DIM: u32 = 4096;

/// Request flags (bit set in the header's `flags`).
pub mod flags {
    /// Fetch: do not create missing rows (return the deterministic initial values instead).
    pub const NO_CREATE: u16 = 1 << 0;
    /// The sender is retrying this (client, seq); informational (dedupe does not depend on it).
    pub const RETRY: u16 = 1 << 1;
    /// Replicate, always (and only): each row of the value array is the table's whole row —
    /// `stride` f32 (values, then optimizer state), then the row's step count and its
    /// version (low, high 32 bits) as the bits of three more elements — so `dim` is the
    /// table's stride + [`STATE_EXTRA_WORDS`](crate::spec::STATE_EXTRA_WORDS) (at most 3 × the
    /// dimension limit + 3), and a copy applies only over an older version of its row.
    /// Values-only copies were dropped: they overwrote rows with no version check.
    pub const STATE: u16 = 1 << 2;
    /// Every defined flag; decoders reject others.
    pub const ALL: u16 = NO_CREATE | RETRY | STATE;
}

/// Operation of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    /// Read rows: keys → rows.
    Fetch = 1,
    /// Apply gradients with the table's optimizer (training pod only); idempotent by
    /// (client, seq).
    Push = 2,
    /// Overwrite rows with the training pod's resulting values (replicas); idempotent by
    /// (client, seq).
    Replicate = 3,
    /// Read one chunk of a streaming snapshot (bootstrap a replica from a peer).
    Snapshot = 4,
    /// Write a checkpoint now.
    Checkpoint = 5,
    /// Health and statistics.
    Health = 6,
    /// Administrative command.
    Admin = 7,
    /// The table definitions (ids, names, dimensions).
    Tables = 8,
}

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 8] = [
        Op::Fetch,
        Op::Push,
        Op::Replicate,
        Op::Snapshot,
        Op::Checkpoint,
        Op::Health,
        Op::Admin,
        Op::Tables,
    ];

    /// The op with wire code `b`.
    pub fn from_u8(b: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|op| *op as u8 == b)
    }

    /// Fetch, Push and Replicate carry keys (and values); the rest carry a control body.
    pub fn is_data(self) -> bool {
        matches!(self, Op::Fetch | Op::Push | Op::Replicate)
    }

    /// Push and Replicate carry a value array after the keys.
    pub fn carries_values(self) -> bool {
        matches!(self, Op::Push | Op::Replicate)
    }

    /// Lower-case name (metrics labels, logs).
    pub fn name(self) -> &'static str {
        match self {
            Op::Fetch => "fetch",
            Op::Push => "push",
            Op::Replicate => "replicate",
            Op::Snapshot => "snapshot",
            Op::Checkpoint => "checkpoint",
            Op::Health => "health",
            Op::Admin => "admin",
            Op::Tables => "tables",
        }
    }
}

/// Status of a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// Push/Replicate: this (client, seq) was already applied; nothing was done. A success
    /// for the caller (the retry's first attempt got through).
    Duplicate = 1,
    /// Push/Replicate: `seq` is older than the server's dedupe window for this client; it
    /// may or may not have been applied, and was not applied now.
    TooOld = 2,
    /// The request frame was malformed (truncated, bad magic/version/flags, inconsistent
    /// lengths).
    BadFrame = 3,
    /// No table has this id.
    UnknownTable = 4,
    /// The request's `dim` differs from the table's.
    WrongDim = 5,
    /// The request exceeds a size limit (frame bytes or key count).
    TooLarge = 6,
    /// The op code is not known to this server.
    UnknownOp = 7,
    /// The op is the other role's: a Push reached a pod that does not train (only the
    /// training pod applies gradients), or a Replicate reached the training pod (rows flow
    /// from it, never to it).
    NotTraining = 8,
    /// The server cannot serve this now (starting, restoring, bootstrapping, shutting down).
    Unavailable = 9,
    /// The server shed this request (queue full).
    Overloaded = 10,
    /// A bug or an I/O failure on the server.
    Internal = 11,
    /// The control body did not decode, or asked for something invalid.
    BadControl = 12,
    /// Values were not finite (NaN or infinite gradients or rows).
    BadValue = 13,
}

impl Status {
    /// Every status, in code order.
    pub const ALL: [Status; 14] = [
        Status::Ok,
        Status::Duplicate,
        Status::TooOld,
        Status::BadFrame,
        Status::UnknownTable,
        Status::WrongDim,
        Status::TooLarge,
        Status::UnknownOp,
        Status::NotTraining,
        Status::Unavailable,
        Status::Overloaded,
        Status::Internal,
        Status::BadControl,
        Status::BadValue,
    ];

    /// The status with wire code `b`.
    pub fn from_u8(b: u8) -> Option<Status> {
        Status::ALL.into_iter().find(|s| *s as u8 == b)
    }

    /// Ok and Duplicate: the request's effect is in place.
    pub fn is_success(self) -> bool {
        matches!(self, Status::Ok | Status::Duplicate)
    }

    /// Lower-case name (metrics labels, logs).
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Duplicate => "duplicate",
            Status::TooOld => "too_old",
            Status::BadFrame => "bad_frame",
            Status::UnknownTable => "unknown_table",
            Status::WrongDim => "wrong_dim",
            Status::TooLarge => "too_large",
            Status::UnknownOp => "unknown_op",
            Status::NotTraining => "not_training",
            Status::Unavailable => "unavailable",
            Status::Overloaded => "overloaded",
            Status::Internal => "internal",
            Status::BadControl => "bad_control",
            Status::BadValue => "bad_value",
        }
    }
}

/// Why a frame could not be encoded or decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The buffer is shorter than a header (decode) or than the frame (encode).
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not the expected magic.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// The version byte is not [`WIRE_VERSION`].
    #[error("unsupported version {0}")]
    UnsupportedVersion(u8),
    /// The op byte names no [`Op`].
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// The status byte names no [`Status`].
    #[error("unknown status {0}")]
    UnknownStatus(u8),
    /// Flags outside [`flags::ALL`] are set, [`flags::STATE`] is set on an op other than
    /// Replicate or missing from a Replicate, or a reserved byte is not zero.
    #[error("flags or reserved bits {0:#x} undefined or wrong for the op")]
    BadFlags(u32),
    /// The frame exceeds [`Limits::max_frame_bytes`].
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge {
        /// Frame length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `count` exceeds [`Limits::max_keys`].
    #[error("{count} keys exceed the limit of {max}")]
    TooManyKeys {
        /// Keys in the frame.
        count: u32,
        /// The limit.
        max: u32,
    },
    /// `dim` is 0 or above [`Limits::max_dim`] for a data op.
    #[error("dim {dim} outside 1..={max}")]
    BadDim {
        /// The frame's dim.
        dim: u32,
        /// The limit.
        max: u32,
    },
    /// `body_len` disagrees with the bytes after the header.
    #[error("header says {declared} body bytes, frame has {actual}")]
    LengthMismatch {
        /// `body_len` of the header.
        declared: usize,
        /// Bytes actually after the header.
        actual: usize,
    },
    /// `body_len` disagrees with what `count` and `dim` imply, or a control op has nonzero
    /// `count`/`dim`, or a value array has the wrong length for the keys.
    #[error("inconsistent frame: {0}")]
    Inconsistent(&'static str),
    /// `count × dim` (or the byte length it implies) overflows.
    #[error("count {count} × dim {dim} overflows")]
    Overflow {
        /// Keys.
        count: u64,
        /// Dimension.
        dim: u64,
    },
    /// A control body failed to encode or decode with postcard.
    #[error("control message: {0}")]
    Control(String),
}

impl WireError {
    /// The response status a server answers this decoding error with.
    pub fn status(&self) -> Status {
        match self {
            WireError::UnknownOp(_) => Status::UnknownOp,
            WireError::FrameTooLarge { .. } | WireError::TooManyKeys { .. } => Status::TooLarge,
            WireError::Control(_) => Status::BadControl,
            _ => Status::BadFrame,
        }
    }
}

/// Size limits a decoder enforces (the server's configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest whole frame, header included.
    pub max_frame_bytes: usize,
    /// Most keys in one request.
    pub max_keys: u32,
    /// Largest dimension.
    pub max_dim: u32,
}

impl Default for Limits {
    /// 64 MiB frames, 1 Mi keys, dimension ≤ [`MAX_DIM`].
    fn default() -> Self {
        Limits { max_frame_bytes: 64 << 20, max_keys: 1 << 20, max_dim: MAX_DIM }
    }
}

// ---------------------------------------------------------------------------------------------
// Little-endian arrays over bytes.

/// The little-endian `u16` at `b[at..]` (panics past the end: callers check lengths).
pub fn rd_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

/// The little-endian `u32` at `b[at..]` (panics past the end: callers check lengths).
pub fn rd_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// The little-endian `u64` at `b[at..]` (panics past the end: callers check lengths).
pub fn rd_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// A read-only array of little-endian `$t` over bytes (any alignment), `$size` bytes an
/// element. Zero-copy: it borrows the frame.
macro_rules! le_array {
    ($(#[$doc:meta])* $name:ident, $t:ty, $size:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name<'a> {
            bytes: &'a [u8],
        }

        impl<'a> $name<'a> {
            /// The array over `bytes`; `None` unless the length is a multiple of the element.
            pub fn new(bytes: &'a [u8]) -> Option<Self> {
                (bytes.len() % $size == 0).then_some($name { bytes })
            }

            /// Number of elements.
            pub fn len(&self) -> usize {
                self.bytes.len() / $size
            }

            /// True when empty.
            pub fn is_empty(&self) -> bool {
                self.bytes.is_empty()
            }

            /// Element `i`, if in range.
            pub fn get(&self, i: usize) -> Option<$t> {
                let at = i.checked_mul($size)?;
                self.bytes.get(at..at.checked_add($size)?).map(Self::element)
            }

            /// The elements in order.
            pub fn iter(&self) -> impl ExactSizeIterator<Item = $t> + 'a {
                self.bytes.chunks_exact($size).map(Self::element)
            }

            /// The elements as a vector.
            pub fn to_vec(&self) -> Vec<$t> {
                self.iter().collect()
            }

            /// The raw bytes.
            pub fn as_bytes(&self) -> &'a [u8] {
                self.bytes
            }

            fn element(c: &[u8]) -> $t {
                let mut a = [0u8; $size];
                a.copy_from_slice(c);
                <$t>::from_le_bytes(a)
            }
        }
    };
}

le_array!(
    /// A read-only array of little-endian `u64` over bytes (any alignment). Zero-copy: it
    /// borrows the frame.
    LeU64s,
    u64,
    8
);
le_array!(
    /// A read-only array of little-endian `f32` over bytes (any alignment). Zero-copy.
    LeF32s,
    f32,
    4
);

impl<'a> LeF32s<'a> {
    /// Elements `[i·dim, (i+1)·dim)`: row `i` of a `dim`-wide matrix, if in range.
    pub fn row(&self, i: usize, dim: usize) -> Option<LeF32s<'a>> {
        let start = i.checked_mul(dim)?.checked_mul(4)?;
        let end = start.checked_add(dim.checked_mul(4)?)?;
        self.bytes.get(start..end).map(|bytes| LeF32s { bytes })
    }

    /// Copies the elements into `out` (which must have exactly [`len`](Self::len) elements;
    /// returns false and copies nothing otherwise).
    pub fn copy_to(&self, out: &mut [f32]) -> bool {
        if out.len() != self.len() {
            return false;
        }
        for (o, v) in out.iter_mut().zip(self.iter()) {
            *o = v;
        }
        true
    }
}

/// Writes `vals` as little-endian u64 into the front of `out`; returns false (and writes
/// nothing) if `out` is too short.
pub fn put_u64s(out: &mut [u8], vals: &[u64]) -> bool {
    put_le(out, vals, u64::to_le_bytes)
}

/// Writes `vals` as little-endian f32 into the front of `out`; returns false (and writes
/// nothing) if `out` is too short.
pub fn put_f32s(out: &mut [u8], vals: &[f32]) -> bool {
    put_le(out, vals, f32::to_le_bytes)
}

fn put_le<T: Copy, const N: usize>(out: &mut [u8], vals: &[T], to_le: fn(T) -> [u8; N]) -> bool {
    let Some(out) = out.get_mut(..vals.len().saturating_mul(N)) else { return false };
    for (d, v) in out.chunks_exact_mut(N).zip(vals) {
        d.copy_from_slice(&to_le(*v));
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Requests.

/// A decoded request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// Operation.
    pub op: Op,
    /// [`flags`].
    pub flags: u16,
    /// Table id (data ops; Snapshot/Checkpoint may ignore it).
    pub table: u32,
    /// Row dimension (data ops).
    pub dim: u32,
    /// Keys (data ops).
    pub count: u32,
    /// Bytes after the header.
    pub body_len: u32,
    /// Client id: the dedupe scope of `seq`.
    pub client: u64,
    /// Sequence number.
    pub seq: u64,
}

impl RequestHeader {
    /// Writes the header into `buf[..REQUEST_HEADER_LEN]`.
    pub fn encode_into(&self, buf: &mut [u8]) -> Result<(), WireError> {
        let have = buf.len();
        let h = buf
            .get_mut(..REQUEST_HEADER_LEN)
            .ok_or(WireError::Truncated { need: REQUEST_HEADER_LEN, have })?;
        h[0..4].copy_from_slice(&REQUEST_MAGIC);
        h[4] = WIRE_VERSION;
        h[5] = self.op as u8;
        h[6..8].copy_from_slice(&self.flags.to_le_bytes());
        h[8..12].copy_from_slice(&self.table.to_le_bytes());
        h[12..16].copy_from_slice(&self.dim.to_le_bytes());
        h[16..20].copy_from_slice(&self.count.to_le_bytes());
        h[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        h[24..32].copy_from_slice(&self.client.to_le_bytes());
        h[32..40].copy_from_slice(&self.seq.to_le_bytes());
        Ok(())
    }

    /// Reads and checks the header at the front of `buf` (magic, version, op, flags); the
    /// body is not checked (see [`decode_request`]).
    pub fn decode(buf: &[u8]) -> Result<RequestHeader, WireError> {
        if buf.len() < REQUEST_HEADER_LEN {
            return Err(WireError::Truncated { need: REQUEST_HEADER_LEN, have: buf.len() });
        }
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if buf[4] != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion(buf[4]));
        }
        let op = Op::from_u8(buf[5]).ok_or(WireError::UnknownOp(buf[5]))?;
        let flags = rd_u16(buf, 6);
        // Whole rows exist only in Replicate (found by the ps_wire fuzz target: a Fetch with
        // STATE got the wider dimension limit), and a Replicate carries nothing else.
        if flags & !flags::ALL != 0 || (flags & flags::STATE != 0) != (op == Op::Replicate) {
            return Err(WireError::BadFlags(flags.into()));
        }
        Ok(RequestHeader {
            op,
            flags,
            table: rd_u32(buf, 8),
            dim: rd_u32(buf, 12),
            count: rd_u32(buf, 16),
            body_len: rd_u32(buf, 20),
            client: rd_u64(buf, 24),
            seq: rd_u64(buf, 32),
        })
    }
}

/// The addressing part of a data request: what [`encode_fetch_into`] and friends need
/// besides the arrays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataHeader {
    /// Table id.
    pub table: u32,
    /// Row dimension.
    pub dim: u32,
    /// Client id.
    pub client: u64,
    /// Sequence number (Push/Replicate: unique per client for dedupe).
    pub seq: u64,
    /// [`flags`].
    pub flags: u16,
}

/// Body bytes of a data request of `op` with `count` keys of dimension `dim`, or `None` on
/// overflow. Fetch: `8·count`; Push/Replicate: `8·count + 4·count·dim`.
pub fn data_body_len(op: Op, count: u64, dim: u64) -> Option<u64> {
    let keys = count.checked_mul(8)?;
    if op.carries_values() {
        keys.checked_add(count.checked_mul(dim)?.checked_mul(4)?)
    } else {
        Some(keys)
    }
}

/// Whole-frame length of a Fetch request with `count` keys.
pub fn fetch_request_len(count: usize) -> usize {
    REQUEST_HEADER_LEN + 8 * count
}

/// Whole-frame length of a Push or Replicate request with `count` keys of dimension `dim`.
pub fn push_request_len(count: usize, dim: usize) -> usize {
    REQUEST_HEADER_LEN + 8 * count + 4 * count * dim
}

/// Writes the header of a data request (`op` ∈ Fetch/Push/Replicate) with `count` keys
/// into `buf` and returns the frame length and the key and value areas to fill in place
/// (little-endian; see [`put_u64s`] / [`put_f32s`]). The value area is empty for Fetch.
/// `buf` may be longer than the frame.
pub fn begin_data_request<'b>(
    buf: &'b mut [u8],
    op: Op,
    h: &DataHeader,
    count: usize,
) -> Result<(usize, &'b mut [u8], &'b mut [u8]), WireError> {
    if !op.is_data() {
        return Err(WireError::Inconsistent("begin_data_request with a control op"));
    }
    let overflow = WireError::Overflow { count: count as u64, dim: h.dim.into() };
    let count32 = u32::try_from(count).map_err(|_| overflow.clone())?;
    let body = data_body_len(op, count as u64, h.dim.into()).ok_or(overflow.clone())?;
    let body32 = u32::try_from(body).map_err(|_| overflow)?;
    let total = REQUEST_HEADER_LEN + body32 as usize;
    if buf.len() < total {
        return Err(WireError::Truncated { need: total, have: buf.len() });
    }
    RequestHeader {
        op,
        flags: h.flags,
        table: h.table,
        dim: h.dim,
        count: count32,
        body_len: body32,
        client: h.client,
        seq: h.seq,
    }
    .encode_into(buf)?;
    let (keys, values) = buf[REQUEST_HEADER_LEN..total].split_at_mut(8 * count);
    Ok((total, keys, values))
}

/// Encodes a Fetch request for `keys` into `buf`; returns the frame length.
pub fn encode_fetch_into(buf: &mut [u8], h: &DataHeader, keys: &[u64]) -> Result<usize, WireError> {
    let (n, k, _) = begin_data_request(buf, Op::Fetch, h, keys.len())?;
    put_u64s(k, keys);
    Ok(n)
}

fn encode_values_into(
    buf: &mut [u8],
    op: Op,
    h: &DataHeader,
    keys: &[u64],
    values: &[f32],
) -> Result<usize, WireError> {
    if Some(values.len()) != keys.len().checked_mul(h.dim as usize) {
        return Err(WireError::Inconsistent("values.len() != keys.len() × dim"));
    }
    let (n, k, v) = begin_data_request(buf, op, h, keys.len())?;
    put_u64s(k, keys);
    put_f32s(v, values);
    Ok(n)
}

/// Encodes a Push request (`grads` = `keys.len() × dim`, row-major) into `buf`; returns the
/// frame length.
pub fn encode_push_into(
    buf: &mut [u8],
    h: &DataHeader,
    keys: &[u64],
    grads: &[f32],
) -> Result<usize, WireError> {
    encode_values_into(buf, Op::Push, h, keys, grads)
}

/// Encodes a Replicate request of whole rows (`rows`: `keys.len() × dim`, `dim` the table's
/// state width; see [`flags::STATE`], which the header gets) into `buf`; returns the frame
/// length.
pub fn encode_replicate_into(
    buf: &mut [u8],
    h: &DataHeader,
    keys: &[u64],
    rows: &[f32],
) -> Result<usize, WireError> {
    let h = DataHeader { flags: h.flags | flags::STATE, ..*h };
    encode_values_into(buf, Op::Replicate, &h, keys, rows)
}

/// Encodes a control request (`op` not a data op) whose body is `msg` in postcard; returns
/// the frame length. `table` is carried for ops that address one (else 0).
pub fn encode_control_request_into<T: Serialize>(
    buf: &mut [u8],
    op: Op,
    table: u32,
    client: u64,
    seq: u64,
    msg: &T,
) -> Result<usize, WireError> {
    if op.is_data() {
        return Err(WireError::Inconsistent("control request with a data op"));
    }
    let have = buf.len();
    let body_area = buf
        .get_mut(REQUEST_HEADER_LEN..)
        .ok_or(WireError::Truncated { need: REQUEST_HEADER_LEN, have })?;
    let body_len =
        postcard::to_slice(msg, body_area).map_err(|e| WireError::Control(e.to_string()))?.len();
    let body_len32 =
        u32::try_from(body_len).map_err(|_| WireError::Inconsistent("body > 4 GiB"))?;
    RequestHeader { op, flags: 0, table, dim: 0, count: 0, body_len: body_len32, client, seq }
        .encode_into(buf)?;
    Ok(REQUEST_HEADER_LEN + body_len)
}

/// A control request as a fresh vector (control messages are small and off the hot path).
pub fn control_request_vec<T: Serialize>(
    op: Op,
    table: u32,
    client: u64,
    seq: u64,
    msg: &T,
) -> Result<Vec<u8>, WireError> {
    let body = postcard::to_stdvec(msg).map_err(|e| WireError::Control(e.to_string()))?;
    let mut v = vec![0u8; REQUEST_HEADER_LEN + body.len()];
    let n = encode_control_request_into(&mut v, op, table, client, seq, msg)?;
    v.truncate(n);
    Ok(v)
}

/// A decoded, fully validated request: views borrow the frame (zero-copy).
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    /// The header.
    pub header: RequestHeader,
    /// Keys (data ops; empty otherwise).
    pub keys: LeU64s<'a>,
    /// Values, `count × dim` (Push: gradients, Replicate: rows; empty otherwise).
    pub values: LeF32s<'a>,
    /// The control body (control ops; empty otherwise).
    pub body: &'a [u8],
}

impl<'a> RequestView<'a> {
    /// Decodes the control body as `T` (postcard).
    pub fn control<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        decode_control(self.body)
    }
}

/// Decodes and validates a whole request frame (exactly `buf`, no trailing bytes).
pub fn decode_request<'a>(buf: &'a [u8], limits: &Limits) -> Result<RequestView<'a>, WireError> {
    let header = RequestHeader::decode(buf)?;
    if buf.len() > limits.max_frame_bytes {
        return Err(WireError::FrameTooLarge { len: buf.len(), max: limits.max_frame_bytes });
    }
    let body = &buf[REQUEST_HEADER_LEN..];
    if header.body_len as usize != body.len() {
        return Err(WireError::LengthMismatch {
            declared: header.body_len as usize,
            actual: body.len(),
        });
    }
    if !header.op.is_data() {
        if header.count != 0 || header.dim != 0 {
            return Err(WireError::Inconsistent("control op with nonzero count or dim"));
        }
        return Ok(RequestView {
            header,
            keys: LeU64s::default(),
            values: LeF32s::default(),
            body,
        });
    }
    // A whole row (STATE) holds up to three arrays of the table's dimension, a step count
    // and a version.
    let max_dim = if header.flags & flags::STATE != 0 {
        limits.max_dim.saturating_mul(3).saturating_add(crate::spec::STATE_EXTRA_WORDS as u32)
    } else {
        limits.max_dim
    };
    if header.dim == 0 || header.dim > max_dim {
        return Err(WireError::BadDim { dim: header.dim, max: max_dim });
    }
    if header.count > limits.max_keys {
        return Err(WireError::TooManyKeys { count: header.count, max: limits.max_keys });
    }
    let expected = data_body_len(header.op, header.count.into(), header.dim.into())
        .ok_or(WireError::Overflow { count: header.count.into(), dim: header.dim.into() })?;
    if expected != body.len() as u64 {
        return Err(WireError::Inconsistent("body_len does not match count and dim"));
    }
    let (k, v) = body.split_at(8 * header.count as usize);
    let keys = LeU64s::new(k).ok_or(WireError::Inconsistent("key array"))?;
    let values = LeF32s::new(v).ok_or(WireError::Inconsistent("value array"))?;
    Ok(RequestView { header, keys, values, body: &[] })
}

// ---------------------------------------------------------------------------------------------
// Responses.

/// A decoded response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseHeader {
    /// The request's op (`None` when the request's op was unreadable).
    pub op: Option<Op>,
    /// Outcome.
    pub status: Status,
    /// Rows (Fetch), keys applied (Push/Replicate), rows in the chunk (Snapshot).
    pub count: u32,
    /// Row dimension (Fetch).
    pub dim: u32,
    /// Bytes after the header.
    pub body_len: u32,
    /// Echo of the request's `seq`.
    pub seq: u64,
}

impl ResponseHeader {
    /// Writes the header into `buf[..RESPONSE_HEADER_LEN]`.
    pub fn encode_into(&self, buf: &mut [u8]) -> Result<(), WireError> {
        let have = buf.len();
        let h = buf
            .get_mut(..RESPONSE_HEADER_LEN)
            .ok_or(WireError::Truncated { need: RESPONSE_HEADER_LEN, have })?;
        h[0..4].copy_from_slice(&RESPONSE_MAGIC);
        h[4] = WIRE_VERSION;
        h[5] = self.op.map_or(0, |op| op as u8);
        h[6] = self.status as u8;
        h[7] = 0;
        h[8..12].copy_from_slice(&self.count.to_le_bytes());
        h[12..16].copy_from_slice(&self.dim.to_le_bytes());
        h[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        h[20..24].copy_from_slice(&0u32.to_le_bytes());
        h[24..32].copy_from_slice(&self.seq.to_le_bytes());
        Ok(())
    }

    /// Reads and checks the header at the front of `buf`.
    pub fn decode(buf: &[u8]) -> Result<ResponseHeader, WireError> {
        if buf.len() < RESPONSE_HEADER_LEN {
            return Err(WireError::Truncated { need: RESPONSE_HEADER_LEN, have: buf.len() });
        }
        let magic = [buf[0], buf[1], buf[2], buf[3]];
        if magic != RESPONSE_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if buf[4] != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion(buf[4]));
        }
        let op = match buf[5] {
            0 => None,
            b => Some(Op::from_u8(b).ok_or(WireError::UnknownOp(b))?),
        };
        let status = Status::from_u8(buf[6]).ok_or(WireError::UnknownStatus(buf[6]))?;
        let reserved = u32::from(buf[7]) | rd_u32(buf, 20);
        if reserved != 0 {
            return Err(WireError::BadFlags(reserved));
        }
        Ok(ResponseHeader {
            op,
            status,
            count: rd_u32(buf, 8),
            dim: rd_u32(buf, 12),
            body_len: rd_u32(buf, 16),
            seq: rd_u64(buf, 24),
        })
    }
}

/// Whole-frame length of a successful Fetch response, or `None` on overflow.
pub fn fetch_response_len(count: usize, dim: usize) -> Option<usize> {
    count.checked_mul(dim)?.checked_mul(4)?.checked_add(RESPONSE_HEADER_LEN)
}

/// Writes the header of a successful Fetch response for `count` rows of `dim` into `buf`
/// and returns the frame length and the row area to fill in place (little-endian f32,
/// `count × dim`, e.g. with `Table::fetch_into_le`).
pub fn begin_fetch_response(
    buf: &mut [u8],
    seq: u64,
    count: u32,
    dim: u32,
) -> Result<(usize, &mut [u8]), WireError> {
    let overflow = WireError::Overflow { count: count.into(), dim: dim.into() };
    let total = fetch_response_len(count as usize, dim as usize).ok_or(overflow.clone())?;
    let body_len = u32::try_from(total - RESPONSE_HEADER_LEN).map_err(|_| overflow)?;
    if buf.len() < total {
        return Err(WireError::Truncated { need: total, have: buf.len() });
    }
    ResponseHeader { op: Some(Op::Fetch), status: Status::Ok, count, dim, body_len, seq }
        .encode_into(buf)?;
    Ok((total, &mut buf[RESPONSE_HEADER_LEN..total]))
}

/// Encodes a response with no body (e.g. Push/Replicate Ok or Duplicate with `count` keys);
/// returns the frame length.
pub fn encode_status_into(
    buf: &mut [u8],
    op: Option<Op>,
    status: Status,
    seq: u64,
    count: u32,
) -> Result<usize, WireError> {
    ResponseHeader { op, status, count, dim: 0, body_len: 0, seq }.encode_into(buf)?;
    Ok(RESPONSE_HEADER_LEN)
}

fn cut_message(message: &str) -> &str {
    if message.len() <= MAX_ERROR_MESSAGE {
        return message;
    }
    let mut end = MAX_ERROR_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// Length of the error response [`encode_error_into`] writes for `message`.
pub fn error_response_len(message: &str) -> usize {
    RESPONSE_HEADER_LEN + cut_message(message).len()
}

/// Encodes an error response (status and a UTF-8 message cut to [`MAX_ERROR_MESSAGE`]
/// bytes); returns the frame length.
pub fn encode_error_into(
    buf: &mut [u8],
    op: Option<Op>,
    status: Status,
    seq: u64,
    message: &str,
) -> Result<usize, WireError> {
    let m = cut_message(message);
    let total = RESPONSE_HEADER_LEN + m.len();
    if buf.len() < total {
        return Err(WireError::Truncated { need: total, have: buf.len() });
    }
    ResponseHeader { op, status, count: 0, dim: 0, body_len: m.len() as u32, seq }
        .encode_into(buf)?;
    buf[RESPONSE_HEADER_LEN..total].copy_from_slice(m.as_bytes());
    Ok(total)
}

/// An error response as a fresh vector.
pub fn error_response_vec(op: Option<Op>, status: Status, seq: u64, message: &str) -> Vec<u8> {
    let mut v = vec![0u8; error_response_len(message)];
    // Cannot fail: the buffer has exactly the length the encoder needs.
    let _ = encode_error_into(&mut v, op, status, seq, message);
    v
}

/// Encodes an Ok response whose body is `msg` in postcard (control ops); returns the frame
/// length.
pub fn encode_control_response_into<T: Serialize>(
    buf: &mut [u8],
    op: Op,
    seq: u64,
    msg: &T,
) -> Result<usize, WireError> {
    let have = buf.len();
    let area = buf
        .get_mut(RESPONSE_HEADER_LEN..)
        .ok_or(WireError::Truncated { need: RESPONSE_HEADER_LEN, have })?;
    let n = postcard::to_slice(msg, area).map_err(|e| WireError::Control(e.to_string()))?.len();
    let body_len = u32::try_from(n).map_err(|_| WireError::Inconsistent("body > 4 GiB"))?;
    ResponseHeader { op: Some(op), status: Status::Ok, count: 0, dim: 0, body_len, seq }
        .encode_into(buf)?;
    Ok(RESPONSE_HEADER_LEN + n)
}

/// An Ok control response as a fresh vector.
pub fn control_response_vec<T: Serialize>(op: Op, seq: u64, msg: &T) -> Result<Vec<u8>, WireError> {
    let body = postcard::to_stdvec(msg).map_err(|e| WireError::Control(e.to_string()))?;
    let body_len =
        u32::try_from(body.len()).map_err(|_| WireError::Inconsistent("body > 4 GiB"))?;
    let mut v = vec![0u8; RESPONSE_HEADER_LEN];
    ResponseHeader { op: Some(op), status: Status::Ok, count: 0, dim: 0, body_len, seq }
        .encode_into(&mut v)?;
    v.extend_from_slice(&body);
    Ok(v)
}

/// Writes the header of an Ok response with an opaque body of `body_len` bytes (Snapshot:
/// a chunk of `count` rows) and returns the body area.
pub fn begin_body_response(
    buf: &mut [u8],
    op: Op,
    seq: u64,
    count: u32,
    body_len: usize,
) -> Result<(usize, &mut [u8]), WireError> {
    let body32 = u32::try_from(body_len).map_err(|_| WireError::Inconsistent("body > 4 GiB"))?;
    let total = RESPONSE_HEADER_LEN + body_len;
    if buf.len() < total {
        return Err(WireError::Truncated { need: total, have: buf.len() });
    }
    ResponseHeader { op: Some(op), status: Status::Ok, count, dim: 0, body_len: body32, seq }
        .encode_into(buf)?;
    Ok((total, &mut buf[RESPONSE_HEADER_LEN..total]))
}

/// A decoded, validated response.
#[derive(Clone, Copy, Debug)]
pub struct ResponseView<'a> {
    /// The header.
    pub header: ResponseHeader,
    /// The body: rows (Fetch Ok), postcard (control Ok), chunk (Snapshot Ok) or message (error).
    pub body: &'a [u8],
}

impl<'a> ResponseView<'a> {
    /// The rows of a successful Fetch (`count × dim`, validated by [`decode_response`]);
    /// empty otherwise.
    pub fn rows(&self) -> LeF32s<'a> {
        if self.header.op == Some(Op::Fetch) && self.header.status == Status::Ok {
            LeF32s::new(self.body).unwrap_or_default()
        } else {
            LeF32s::default()
        }
    }

    /// The error message of a failed request (lossy UTF-8); empty for successes.
    pub fn message(&self) -> Cow<'a, str> {
        if self.header.status.is_success() {
            Cow::Borrowed("")
        } else {
            String::from_utf8_lossy(self.body)
        }
    }

    /// Decodes the body of a successful control response as `T`.
    pub fn control<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        decode_control(self.body)
    }
}

/// Decodes and validates a whole response frame (exactly `buf`).
pub fn decode_response<'a>(buf: &'a [u8], limits: &Limits) -> Result<ResponseView<'a>, WireError> {
    let header = ResponseHeader::decode(buf)?;
    if buf.len() > limits.max_frame_bytes {
        return Err(WireError::FrameTooLarge { len: buf.len(), max: limits.max_frame_bytes });
    }
    let body = &buf[RESPONSE_HEADER_LEN..];
    if header.body_len as usize != body.len() {
        return Err(WireError::LengthMismatch {
            declared: header.body_len as usize,
            actual: body.len(),
        });
    }
    if header.op == Some(Op::Fetch) && header.status == Status::Ok {
        if header.dim == 0 || header.dim > limits.max_dim {
            return Err(WireError::BadDim { dim: header.dim, max: limits.max_dim });
        }
        if header.count > limits.max_keys {
            return Err(WireError::TooManyKeys { count: header.count, max: limits.max_keys });
        }
        let expected = u64::from(header.count) * u64::from(header.dim) * 4;
        if expected != body.len() as u64 {
            return Err(WireError::Inconsistent("rows do not match count and dim"));
        }
    } else if !header.status.is_success() && body.len() > MAX_ERROR_MESSAGE {
        return Err(WireError::Inconsistent("error message too long"));
    }
    Ok(ResponseView { header, body })
}

/// Decodes a postcard control body as `T`; trailing bytes are an error.
pub fn decode_control<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    let (v, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| WireError::Control(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Control(format!("{} trailing bytes", rest.len())));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hdr(dim: u32) -> DataHeader {
        DataHeader { table: 3, dim, client: 0xC1, seq: 77, flags: flags::RETRY }
    }

    #[test]
    fn request_header_layout_is_pinned() {
        let mut buf = vec![0u8; 64];
        let n = encode_fetch_into(&mut buf, &hdr(4), &[0x0102_0304_0506_0708, 9]).unwrap();
        assert_eq!(n, 56);
        #[rustfmt::skip]
        let want: [u8; 56] = [
            b'B', b'X', b'P', b'Q', 3, 1, 2, 0,   // magic, version, op=Fetch, flags=RETRY
            3, 0, 0, 0, 4, 0, 0, 0,               // table, dim
            2, 0, 0, 0, 16, 0, 0, 0,              // count, body_len
            0xC1, 0, 0, 0, 0, 0, 0, 0,            // client
            77, 0, 0, 0, 0, 0, 0, 0,              // seq
            8, 7, 6, 5, 4, 3, 2, 1,               // key 0
            9, 0, 0, 0, 0, 0, 0, 0,               // key 1
        ];
        assert_eq!(&buf[..n], &want[..]);
    }

    #[test]
    fn response_header_layout_is_pinned() {
        let mut buf = vec![0u8; 64];
        let (n, rows) = begin_fetch_response(&mut buf, 77, 1, 2).unwrap();
        put_f32s(rows, &[1.0, -2.0]);
        assert_eq!(n, 40);
        #[rustfmt::skip]
        let want: [u8; 40] = [
            b'B', b'X', b'P', b'R', 3, 1, 0, 0,   // magic, version, op=Fetch, status=Ok, 0
            1, 0, 0, 0, 2, 0, 0, 0,               // count, dim
            8, 0, 0, 0, 0, 0, 0, 0,               // body_len, reserved
            77, 0, 0, 0, 0, 0, 0, 0,              // seq
            0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0,      // 1.0f32, -2.0f32
        ];
        assert_eq!(&buf[..n], &want[..]);
    }

    #[test]
    fn fetch_round_trip() {
        let keys = [1u64, u64::MAX, 42];
        let mut buf = vec![0u8; fetch_request_len(3)];
        encode_fetch_into(&mut buf, &hdr(8), &keys).unwrap();
        let v = decode_request(&buf, &Limits::default()).unwrap();
        assert_eq!(v.header.op, Op::Fetch);
        assert_eq!(v.header.flags, flags::RETRY);
        assert_eq!((v.header.table, v.header.dim, v.header.count), (3, 8, 3));
        assert_eq!((v.header.client, v.header.seq), (0xC1, 77));
        assert_eq!(v.keys.to_vec(), keys);
        assert!(v.values.is_empty());
    }

    #[test]
    fn push_round_trip_and_wrong_value_count() {
        let keys = [5u64, 6];
        let grads = [0.5f32, -1.0, 2.0, f32::MIN_POSITIVE];
        let mut buf = vec![0u8; push_request_len(2, 2)];
        let n = encode_push_into(&mut buf, &hdr(2), &keys, &grads).unwrap();
        assert_eq!(n, buf.len());
        let v = decode_request(&buf, &Limits::default()).unwrap();
        assert_eq!(v.header.op, Op::Push);
        assert_eq!(v.keys.to_vec(), keys);
        assert_eq!(v.values.to_vec(), grads);
        assert_eq!(v.values.row(1, 2).unwrap().to_vec(), grads[2..]);
        assert!(v.values.row(2, 2).is_none());
        assert_eq!(
            encode_push_into(&mut buf, &hdr(3), &keys, &grads),
            Err(WireError::Inconsistent("values.len() != keys.len() × dim"))
        );
    }

    #[test]
    fn control_round_trip() {
        let msg = crate::control::SnapshotRequest {
            cursor: crate::control::SnapshotCursor::START,
            max_bytes: 1 << 20,
        };
        let buf = control_request_vec(Op::Snapshot, 0, 1, 2, &msg).unwrap();
        let v = decode_request(&buf, &Limits::default()).unwrap();
        assert_eq!(v.header.op, Op::Snapshot);
        assert_eq!(v.control::<crate::control::SnapshotRequest>().unwrap(), msg);
        let resp = control_response_vec(Op::Snapshot, 2, &msg).unwrap();
        let r = decode_response(&resp, &Limits::default()).unwrap();
        assert_eq!(r.control::<crate::control::SnapshotRequest>().unwrap(), msg);
        // Trailing garbage after a postcard message is an error.
        assert!(decode_control::<u32>(&[1, 2]).is_err());
    }

    #[test]
    fn typed_errors() {
        let lim = Limits::default();
        let mut buf = vec![0u8; fetch_request_len(2)];
        encode_fetch_into(&mut buf, &hdr(4), &[1, 2]).unwrap();

        assert_eq!(
            decode_request(&buf[..39], &lim).unwrap_err(),
            WireError::Truncated { need: 40, have: 39 }
        );
        assert_eq!(
            decode_request(&buf[..50], &lim).unwrap_err(),
            WireError::LengthMismatch { declared: 16, actual: 10 }
        );
        let mut b = buf.clone();
        b[0] = b'X';
        assert!(matches!(decode_request(&b, &lim), Err(WireError::BadMagic(_))));
        let mut b = buf.clone();
        b[4] = 1;
        assert_eq!(decode_request(&b, &lim).unwrap_err(), WireError::UnsupportedVersion(1));
        let mut b = buf.clone();
        b[5] = 99;
        let e = decode_request(&b, &lim).unwrap_err();
        assert_eq!(e, WireError::UnknownOp(99));
        assert_eq!(e.status(), Status::UnknownOp);
        let mut b = buf.clone();
        b[7] = 0x80;
        assert!(matches!(decode_request(&b, &lim), Err(WireError::BadFlags(_))));
        // dim 0 and dim above the limit.
        let mut b = buf.clone();
        b[12..16].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(decode_request(&b, &lim), Err(WireError::BadDim { dim: 0, .. })));
        b[12..16].copy_from_slice(&5000u32.to_le_bytes());
        assert!(matches!(decode_request(&b, &lim), Err(WireError::BadDim { dim: 5000, .. })));
        // Whole rows (STATE) may be up to three arrays, a step count and a version wide.
        let keys = [1u64, 2];
        let wide = 3 * lim.max_dim + crate::spec::STATE_EXTRA_WORDS as u32;
        let rows = vec![0.5f32; 2 * wide as usize];
        let h = DataHeader { table: 0, dim: wide, client: 1, seq: 1, flags: flags::STATE };
        let mut f = vec![0u8; push_request_len(2, wide as usize)];
        encode_replicate_into(&mut f, &h, &keys, &rows).unwrap();
        let big = Limits { max_frame_bytes: 1 << 20, ..lim };
        assert_eq!(decode_request(&f, &big).unwrap().header.dim, wide);
        f[12..16].copy_from_slice(&(wide + 1).to_le_bytes());
        assert!(matches!(decode_request(&f, &big), Err(WireError::BadDim { .. })));
        f[12..16].copy_from_slice(&wide.to_le_bytes());
        f[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert!(
            matches!(decode_request(&f, &big), Err(WireError::BadFlags(_))),
            "not without STATE"
        );
        // STATE on another op is refused, whatever the dimension.
        let mut p = vec![0u8; push_request_len(2, 3)];
        let h = DataHeader { table: 0, dim: 3, client: 1, seq: 1, flags: 0 };
        encode_push_into(&mut p, &h, &keys, &[1.0; 6]).unwrap();
        assert!(decode_request(&p, &lim).is_ok());
        let mut s = p.clone();
        s[6..8].copy_from_slice(&flags::STATE.to_le_bytes());
        assert!(matches!(decode_request(&s, &lim), Err(WireError::BadFlags(_))));
        // A Replicate of values only (no version to order it by) is refused.
        p[5] = Op::Replicate as u8;
        assert!(matches!(decode_request(&p, &lim), Err(WireError::BadFlags(_))));
        p[6..8].copy_from_slice(&flags::STATE.to_le_bytes());
        assert!(decode_request(&p, &lim).is_ok());
        // count disagreeing with body_len.
        let mut b = buf.clone();
        b[16..20].copy_from_slice(&3u32.to_le_bytes());
        assert!(matches!(decode_request(&b, &lim), Err(WireError::Inconsistent(_))));
        // Too many keys.
        let small = Limits { max_keys: 1, ..lim };
        let e = decode_request(&buf, &small).unwrap_err();
        assert_eq!(e, WireError::TooManyKeys { count: 2, max: 1 });
        assert_eq!(e.status(), Status::TooLarge);
        // Frame too large.
        let tiny = Limits { max_frame_bytes: 50, ..lim };
        assert!(matches!(decode_request(&buf, &tiny), Err(WireError::FrameTooLarge { .. })));
        // Control op with a count.
        let mut b = control_request_vec(Op::Health, 0, 1, 2, &()).unwrap();
        b[16] = 1;
        assert!(matches!(decode_request(&b, &lim), Err(WireError::Inconsistent(_))));
    }

    #[test]
    fn count_times_dim_overflow_is_an_error() {
        // A Push header claiming u32::MAX keys of dim 4096: the implied body overflows u32
        // on 32-bit and never matches; with a generous limit it must be a clean error.
        let mut b = vec![0u8; REQUEST_HEADER_LEN];
        RequestHeader {
            op: Op::Push,
            flags: 0,
            table: 0,
            dim: 4096,
            count: u32::MAX,
            body_len: 0,
            client: 0,
            seq: 0,
        }
        .encode_into(&mut b)
        .unwrap();
        let lim = Limits { max_keys: u32::MAX, max_frame_bytes: usize::MAX, max_dim: 4096 };
        assert!(matches!(decode_request(&b, &lim), Err(WireError::Inconsistent(_))));
        let h = DataHeader { dim: u32::MAX, ..hdr(0) };
        let mut big = vec![0u8; 64];
        assert!(matches!(
            begin_data_request(&mut big, Op::Push, &h, usize::MAX / 2),
            Err(WireError::Overflow { .. })
        ));
        assert!(data_body_len(Op::Push, u64::MAX, 2).is_none());
        assert!(fetch_response_len(usize::MAX, 2).is_none());
    }

    #[test]
    fn error_response_is_cut_at_a_char_boundary() {
        let long = "é".repeat(200); // 400 bytes
        let v = error_response_vec(Some(Op::Push), Status::WrongDim, 9, &long);
        let r = decode_response(&v, &Limits::default()).unwrap();
        assert_eq!(r.header.status, Status::WrongDim);
        assert_eq!(r.header.seq, 9);
        assert_eq!(r.message().len(), 256);
        assert!(r.rows().is_empty());
        let v = error_response_vec(None, Status::BadFrame, 0, "x");
        assert_eq!(decode_response(&v, &Limits::default()).unwrap().header.op, None);
    }

    #[test]
    fn fetch_response_validation() {
        let mut buf = vec![0u8; fetch_response_len(2, 3).unwrap()];
        let (n, rows) = begin_fetch_response(&mut buf, 1, 2, 3).unwrap();
        put_f32s(rows, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let r = decode_response(&buf[..n], &Limits::default()).unwrap();
        assert_eq!(r.rows().to_vec(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // Count lying about the rows.
        buf[8] = 3;
        assert!(matches!(
            decode_response(&buf, &Limits::default()),
            Err(WireError::Inconsistent(_))
        ));
        let mut small = [0u8; 16];
        assert!(matches!(
            begin_fetch_response(&mut small, 1, 2, 3),
            Err(WireError::Truncated { .. })
        ));
        let st = encode_status_into(&mut small[..], Some(Op::Push), Status::Ok, 1, 2);
        assert!(st.is_err());
    }

    fn arb_request() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::sample::select(Op::ALL.to_vec()),
            1u32..6,
            prop::collection::vec(any::<u64>(), 0..8),
            any::<u64>(),
        )
            .prop_map(|(op, dim, keys, seq)| {
                let h = DataHeader { table: 1, dim, client: 2, seq, flags: 0 };
                if op.is_data() {
                    let vals: Vec<f32> = (0..keys.len() * dim as usize).map(|i| i as f32).collect();
                    let mut b = vec![0u8; push_request_len(keys.len(), dim as usize)];
                    let n = match op {
                        Op::Fetch => encode_fetch_into(&mut b, &h, &keys),
                        Op::Push => encode_push_into(&mut b, &h, &keys, &vals),
                        _ => encode_replicate_into(&mut b, &h, &keys, &vals),
                    }
                    .unwrap();
                    b.truncate(n);
                    b
                } else {
                    control_request_vec(op, 0, 2, seq, &keys).unwrap()
                }
            })
    }

    proptest! {
        #[test]
        fn decoders_never_panic_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let lim = Limits::default();
            let _ = decode_request(&bytes, &lim);
            let _ = decode_response(&bytes, &lim);
            let _ = decode_control::<crate::control::HealthInfo>(&bytes);
        }

        #[test]
        fn decoders_never_panic_on_mutated_frames(
            frame in arb_request(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let lim = Limits { max_frame_bytes: 1 << 16, max_keys: 64, max_dim: 16 };
            let mut b = frame.clone();
            for (i, v) in edits {
                let at = i.index(b.len());
                b[at] = v;
            }
            if let Ok(v) = decode_request(&b, &lim) {
                // Whatever decodes is self-consistent.
                prop_assert_eq!(v.keys.len(), if v.header.op.is_data() { v.header.count as usize } else { 0 });
                if v.header.op.carries_values() {
                    prop_assert_eq!(v.values.len(), v.keys.len() * v.header.dim as usize);
                }
            }
            let _ = decode_request(&frame[..cut.index(frame.len() + 1)], &lim);
            let _ = decode_response(&b, &lim);
        }

        #[test]
        fn valid_frames_decode(frame in arb_request()) {
            let v = decode_request(&frame, &Limits::default());
            prop_assert!(v.is_ok(), "{:?}", v);
        }
    }
}
