//! [`Msg`]: a message in registered memory, owned, `Send`, freed on drop from any thread.
//!
//! Received messages are the receive buffers themselves (eager) or the buffer the sender
//! wrote into (large): no copy on the receive path. Messages to send should be built in a
//! `Msg` too, so the NIC reads them where they are. A [`SharedMsg`] is a message that can be
//! sent many times, to one peer or many, without a copy per send.

use std::sync::Arc;

use bemalloc::{Pool, RegisteredBuf};
use bex_rnic::verbs::Sge;

use crate::error::TransportError;

/// A message: a view `[off, off + len)` of a registered buffer.
pub struct Msg {
    buf: RegisteredBuf<'static>,
    off: usize,
    len: usize,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Msg").field("len", &self.len).finish()
    }
}

impl Msg {
    /// A message of `len` bytes (contents unspecified) from `pool`.
    pub fn alloc(pool: &'static Pool, len: usize) -> Result<Msg, TransportError> {
        // A zero-length allocation still needs an address the NIC can name.
        let buf = pool.allocate(len.max(1)).map_err(|e| TransportError::Alloc(e.to_string()))?;
        Ok(Msg { buf, off: 0, len })
    }

    /// A message holding a copy of `data`.
    pub fn copy_from(pool: &'static Pool, data: &[u8]) -> Result<Msg, TransportError> {
        let mut m = Msg::alloc(pool, data.len())?;
        m.as_mut_slice().copy_from_slice(data);
        Ok(m)
    }

    /// The whole buffer as a message.
    pub fn from_buf(buf: RegisteredBuf<'static>) -> Msg {
        let len = buf.len();
        Msg { buf, off: 0, len }
    }

    /// A view of `len` bytes at `off` of `buf`.
    pub(crate) fn view(buf: RegisteredBuf<'static>, off: usize, len: usize) -> Msg {
        debug_assert!(off + len <= buf.len());
        Msg { buf, off, len }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (off, len) = (self.off, self.len);
        &mut self.buf[off..off + len]
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a 0-byte message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops the first `n` bytes from the view (a header, say) without copying.
    pub fn advance(&mut self, n: usize) {
        let n = n.min(self.len);
        self.off += n;
        self.len -= n;
    }

    /// Shortens the message to `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The underlying buffer (the message may be a view of part of it).
    pub fn into_buf(self) -> RegisteredBuf<'static> {
        self.buf
    }

    /// A scatter/gather element for `len` bytes at `at` within the message, on `device`.
    pub(crate) fn sge(&self, device: usize, at: usize, len: usize) -> Sge {
        self.buf.sge(device, self.off + at, len)
    }

    /// Address of byte `at` of the message.
    pub(crate) fn addr(&self, at: usize) -> u64 {
        self.buf.as_ptr() as u64 + (self.off + at) as u64
    }

    /// The memory region's rkey on `device`.
    pub(crate) fn rkey(&self, device: usize) -> u32 {
        self.buf.mr(device).rkey
    }
}

/// A registered message that can be sent many times, to one socket or to many, without a
/// copy per send (`paper/002`'s reusable registered send buffers): dense weights going to
/// every trainer, one replication batch going to every replica. Clones share the buffer; it
/// is freed when the last clone and the last send that gathers from it are done. Read-only
/// once shared, so a send in flight can never see it change.
#[derive(Clone)]
pub struct SharedMsg(Arc<Msg>);

impl std::fmt::Debug for SharedMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMsg").field("len", &self.0.len).finish()
    }
}

impl SharedMsg {
    /// Shares `msg` (its bytes are final from now on).
    pub fn new(msg: Msg) -> SharedMsg {
        SharedMsg(Arc::new(msg))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for a 0-byte message.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The message for writing, if no clone and no send holds it any more (a retry may then
    /// rewrite its header in place instead of copying it).
    pub fn get_mut(&mut self) -> Option<&mut Msg> {
        Arc::get_mut(&mut self.0)
    }

    /// Holders of the buffer: clones plus sends still gathering from it (tests, metrics).
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

impl From<Msg> for SharedMsg {
    fn from(m: Msg) -> SharedMsg {
        SharedMsg::new(m)
    }
}

/// What a send carries: a message it owns, or one more use of a shared one.
#[derive(Debug)]
pub enum Payload {
    /// Freed (or handed back) when the send is done.
    Owned(Msg),
    /// One reference to a shared buffer, dropped when the send is done.
    Shared(SharedMsg),
}

impl Payload {
    fn msg(&self) -> &Msg {
        match self {
            Payload::Owned(m) => m,
            Payload::Shared(s) => &s.0,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.msg().as_slice()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.msg().len()
    }

    /// True for a 0-byte payload.
    pub fn is_empty(&self) -> bool {
        self.msg().is_empty()
    }

    pub(crate) fn sge(&self, device: usize, at: usize, len: usize) -> Sge {
        self.msg().sge(device, at, len)
    }
}

impl From<Msg> for Payload {
    fn from(m: Msg) -> Payload {
        Payload::Owned(m)
    }
}

impl From<SharedMsg> for Payload {
    fn from(s: SharedMsg) -> Payload {
        Payload::Shared(s)
    }
}

impl From<&SharedMsg> for Payload {
    fn from(s: &SharedMsg) -> Payload {
        Payload::Shared(s.clone())
    }
}
