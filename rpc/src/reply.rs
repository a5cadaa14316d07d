//! A channel's calls waiting for their replies, and what one reply frame does to them.
//!
//! Sans-IO: the channel's reader task receives frames and acts on the [`ReplyEvent`]
//! [`Waiting::handle_reply`] returns, so the matching is tested and fuzzed without a socket
//! (`bex_fuzz_targets::rpc_replies`). A frame comes from the peer and is trusted for nothing:
//! it reaches at most the one call waiting under its id, once.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::RpcError;
use crate::frame::{Header, Kind, Status, HEADER_LEN};

/// Calls waiting for replies, by request id; `T` is what wakes a call (a oneshot sender in
/// the channel, a token in tests).
#[derive(Debug)]
pub struct Waiting<T> {
    calls: HashMap<u64, T>,
}

impl<T> Default for Waiting<T> {
    fn default() -> Self {
        Waiting { calls: HashMap::new() }
    }
}

/// What a reply frame did.
#[derive(Debug)]
pub enum ReplyEvent<T> {
    /// Dropped and to be counted: no valid header, or a body length the frame does not hold.
    Malformed {
        /// What was wrong.
        what: &'static str,
        /// The request id, where the header decoded.
        id: Option<u64>,
    },
    /// Dropped, as expected: a reply to no waiting call (its caller gave up, or it came
    /// twice), or an exposed buffer's notice that its reply came as a message.
    NoCall,
    /// Call `waiter`'s reply, taken off the waiting calls: the body's bytes of the frame, or
    /// the error the reply carries.
    Reply {
        /// What wakes the call.
        waiter: T,
        /// The body's range in the frame, or the reply's error.
        body: Result<Range<usize>, RpcError>,
    },
}

impl<T> Waiting<T> {
    /// Call `id` waits on `waiter`; a call already waiting under `id` is replaced and
    /// returned (request ids are unique in a process: only a bug reuses one).
    pub fn insert(&mut self, id: u64, waiter: T) -> Option<T> {
        self.calls.insert(id, waiter)
    }

    /// Call `id` stops waiting (its deadline, or its caller gone).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        self.calls.remove(&id)
    }

    /// The ids of the calls waiting, in no order.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.calls.keys().copied()
    }

    /// Every waiting call, taken, in request-id (call) order: the channel ended, and they
    /// wake in the same order every run.
    pub fn drain_in_order(&mut self) -> Vec<(u64, T)> {
        let mut all: Vec<_> = self.calls.drain().collect();
        all.sort_unstable_by_key(|(id, _)| *id);
        all
    }

    /// Matches the reply `frame` (header and body) to the call waiting for it.
    pub fn handle_reply(&mut self, frame: &[u8]) -> ReplyEvent<T> {
        let Some(h) = Header::decode(frame) else {
            return ReplyEvent::Malformed { what: "an RPC reply without a valid header", id: None };
        };
        if h.kind == Kind::Elsewhere {
            return ReplyEvent::NoCall;
        }
        // `decode` holds at least a header.
        let held = (frame.len() - HEADER_LEN) as u64;
        // A placed reply fills the start of a larger buffer.
        let fits = if h.kind == Kind::Placed { h.body_len <= held } else { h.body_len == held };
        if !fits {
            let what = "an RPC reply with a wrong body length";
            return ReplyEvent::Malformed { what, id: Some(h.id) };
        }
        let Some(waiter) = self.calls.remove(&h.id) else {
            return ReplyEvent::NoCall;
        };
        let body = HEADER_LEN..HEADER_LEN + h.body_len as usize;
        let failed = |body: Range<usize>| RpcError::Remote {
            status: Status::from_u16(h.status),
            message: String::from_utf8_lossy(&frame[body]).into_owned(),
        };
        let body = match h.kind {
            Kind::Response => Ok(body),
            Kind::Placed if h.status == 0 => Ok(body),
            Kind::Error | Kind::Placed => Err(failed(body)),
            Kind::Request | Kind::Elsewhere => {
                Err(RpcError::Protocol("request on a client channel".into()))
            }
        };
        ReplyEvent::Reply { waiter, body }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: Kind, status: u16, id: u64, claimed: usize, body: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_LEN + body.len()];
        Header::reply(kind, 1, status, id, claimed).encode(&mut b);
        b[HEADER_LEN..].copy_from_slice(body);
        b
    }

    // One reply per call: the second copy, and a reply to a call that gave up, reach nobody.
    #[test]
    fn a_reply_wakes_its_call_once_and_no_call_after_it_gave_up() {
        let mut w = Waiting::default();
        w.insert(7, "seven");
        w.insert(8, "eight");
        let reply = frame(Kind::Response, 0, 7, 3, b"abc");
        match w.handle_reply(&reply) {
            ReplyEvent::Reply { waiter: "seven", body: Ok(r) } => assert_eq!(&reply[r], b"abc"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(w.handle_reply(&reply), ReplyEvent::NoCall), "a second copy");
        assert_eq!(w.remove(8), Some("eight"));
        assert!(matches!(w.handle_reply(&frame(Kind::Response, 0, 8, 0, b"")), ReplyEvent::NoCall));
        assert_eq!(w.ids().count(), 0);
    }

    // A placed reply may be shorter than its buffer, an ordinary one must fill its message;
    // a wrong length leaves the call waiting for a good reply.
    #[test]
    fn body_lengths_are_checked_before_a_call_is_woken() {
        let mut w = Waiting::default();
        w.insert(1, ());
        let long = frame(Kind::Response, 0, 1, 2, b"abc");
        assert!(matches!(w.handle_reply(&long), ReplyEvent::Malformed { id: Some(1), .. }));
        assert!(matches!(w.handle_reply(b"garbage"), ReplyEvent::Malformed { id: None, .. }));
        assert_eq!(w.ids().collect::<Vec<_>>(), [1]);
        let placed = frame(Kind::Placed, 0, 1, 2, b"abc");
        match w.handle_reply(&placed) {
            ReplyEvent::Reply { body: Ok(r), .. } => assert_eq!(&placed[r], b"ab"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn error_replies_carry_their_status_and_message() {
        let mut w = Waiting::default();
        w.insert(1, ());
        w.insert(2, ());
        w.insert(3, ());
        let not_found = frame(Kind::Error, Status::NotFound as u16, 1, 4, b"gone");
        let placed_failure = frame(Kind::Placed, Status::Unavailable as u16, 2, 4, b"busy");
        for (f, want, message) in
            [(not_found, Status::NotFound, "gone"), (placed_failure, Status::Unavailable, "busy")]
        {
            match w.handle_reply(&f) {
                ReplyEvent::Reply {
                    body: Err(RpcError::Remote { status, message: m }), ..
                } => {
                    assert_eq!((status, m.as_str()), (want, message))
                }
                other => panic!("{other:?}"),
            }
        }
        let mut request = vec![0u8; HEADER_LEN];
        Header::request(1, 3).encode(&mut request);
        let ReplyEvent::Reply { body: Err(RpcError::Protocol(_)), .. } = w.handle_reply(&request)
        else {
            panic!("a request where a reply belongs")
        };
        assert_eq!(w.drain_in_order().len(), 0);
    }
}
