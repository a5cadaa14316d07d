//! A channel's reply matching (`bex_rpc::reply::Waiting`) driven by a script of calls that
//! start waiting, calls that give up, and reply frames from a peer that owes nothing.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use bex_rpc::frame::{Header, Kind, Status};
use bex_rpc::reply::{ReplyEvent, Waiting};
use bex_rpc::{RpcError, HEADER_LEN};

/// Request ids the script uses: few, so replies hit waiting calls.
const IDS: u8 = 8;

/// The bytes of the script, read one at a time (0 once they run out).
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> u8 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        b
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (taken, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        taken
    }
}

/// Reads `data` as a script, one step a byte (`% 4`): 0 a call starts waiting (id from
/// the next byte), 1 a call gives up, 2 a reply frame built from the next bytes (kind,
/// status, id, a claimed body length near the true one, the body), 3 raw bytes as a frame.
/// Holds: a reply wakes only the call waiting under its header's id, once, and removes it;
/// a body range is the header's `body_len` bytes right after the header; success only for
/// a response or a placed reply of status 0, an error reply's status is its header's; a
/// frame is malformed exactly when its header does not decode or its length disagrees
/// (a placed reply may be shorter than its buffer); nothing else changes which calls wait.
pub fn rpc_replies(data: &[u8]) {
    let mut s = Script(data);
    let mut waiting = Waiting::default();
    // The model: which calls wait, each with a token only its start gave out.
    let mut model = BTreeMap::new();
    let mut next_token = 0u32;
    while !s.0.is_empty() {
        match s.byte() % 4 {
            0 => {
                let id = u64::from(s.byte() % IDS);
                if let Entry::Vacant(e) = model.entry(id) {
                    next_token += 1;
                    e.insert(next_token);
                    assert_eq!(waiting.insert(id, next_token), None, "call {id} was not waiting");
                }
            }
            1 => {
                let id = u64::from(s.byte() % IDS);
                assert_eq!(waiting.remove(id), model.remove(&id), "call {id} gives up");
            }
            op => {
                let frame = if op == 2 { built_frame(&mut s) } else { raw_frame(&mut s) };
                check_reply(&mut waiting, &mut model, &frame);
            }
        }
        let mut ids: Vec<u64> = waiting.ids().collect();
        ids.sort_unstable();
        assert!(ids.iter().eq(model.keys()), "the calls waiting: {ids:?}, model {model:?}");
    }
    let left: Vec<(u64, u32)> = model.into_iter().collect();
    assert_eq!(waiting.drain_in_order(), left, "the calls left, in call order");
}

fn built_frame(s: &mut Script<'_>) -> Vec<u8> {
    let kind = s.byte() % 6; // 0: no such kind
    let status = u16::from(s.byte() % 8);
    let id = u64::from(s.byte() % IDS);
    let len = usize::from(s.byte() % 32);
    let body = s.bytes(len).to_vec();
    let claimed = (body.len() as i64 + i64::from(s.byte() as i8 / 32)).max(0) as usize;
    let mut f = vec![0u8; HEADER_LEN + body.len()];
    Header::reply(Kind::Response, 1, status, id, claimed).encode(&mut f);
    f[3] = kind;
    f[HEADER_LEN..].copy_from_slice(&body);
    f
}

fn raw_frame(s: &mut Script<'_>) -> Vec<u8> {
    let n = usize::from(s.byte());
    s.bytes(n).to_vec()
}

fn check_reply(waiting: &mut Waiting<u32>, model: &mut BTreeMap<u64, u32>, frame: &[u8]) {
    let header = Header::decode(frame);
    let event = waiting.handle_reply(frame);
    let Some(h) = header else {
        assert!(matches!(event, ReplyEvent::Malformed { id: None, .. }), "{event:?}");
        return;
    };
    let held = (frame.len() - HEADER_LEN) as u64;
    let fits = match h.kind {
        Kind::Elsewhere => true,
        Kind::Placed => h.body_len <= held,
        _ => h.body_len == held,
    };
    match event {
        ReplyEvent::Malformed { id, .. } => {
            assert!(!fits, "a reply of a right length was dropped as malformed");
            assert_eq!(id, Some(h.id));
        }
        ReplyEvent::NoCall => {
            assert!(fits, "a reply of a wrong length was not counted malformed: {h:?}");
            let for_nobody = h.kind == Kind::Elsewhere || !model.contains_key(&h.id);
            assert!(for_nobody, "a reply to call {} went nowhere", h.id);
        }
        ReplyEvent::Reply { waiter, body } => {
            assert!(fits && h.kind != Kind::Elsewhere, "{h:?} woke a call");
            assert_eq!(model.remove(&h.id), Some(waiter), "woke the call waiting under its id");
            let ok = h.kind == Kind::Response || (h.kind == Kind::Placed && h.status == 0);
            match body {
                Ok(r) => {
                    assert!(ok, "{h:?} succeeded");
                    assert_eq!(r, HEADER_LEN..HEADER_LEN + h.body_len as usize);
                    assert!(r.end <= frame.len());
                }
                Err(RpcError::Remote { status, .. }) => {
                    assert!(!ok && h.kind != Kind::Request, "{h:?} failed");
                    assert_eq!(status, Status::from_u16(h.status));
                }
                Err(e) => assert!(h.kind == Kind::Request, "{h:?}: {e}"),
            }
        }
    }
}
