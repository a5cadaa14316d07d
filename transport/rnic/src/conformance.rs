//! One conformance suite for every NIC backend.
//!
//! A backend supplies a [`Bed`]: two devices (possibly the same one), a way to wait for
//! progress (real time or a virtual clock), and, where it can, packet fault injection. The
//! [`conformance_suite!`](crate::conformance_suite) macro turns every case below into a
//! `#[test]` for that bed. Cases that need faults the bed cannot inject print a visible
//! `SKIPPED:` line and pass.

use std::time::Duration;

use crate::device::{CompletionQueue, Device, MemoryRegion, QpInit, QueuePair};
use crate::soft::{PacketInfo, Verdict};
use crate::verbs::*;
use crate::Error;

/// A rule deciding the fate of packets from one side.
pub type Rule = Box<dyn FnMut(&PacketInfo) -> Option<Verdict> + Send>;

/// Which device of the bed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The requester in most cases.
    A,
    /// The responder in most cases.
    B,
}

/// What a backend provides to run the suite.
pub trait Bed {
    /// The device type.
    type D: Device;
    /// Backend name for messages.
    fn name(&self) -> &'static str;
    /// A device.
    fn device(&self, side: Side) -> &Self::D;
    /// Makes progress until `done()` or `limit` passes (virtual or real time). By default
    /// the device progresses by itself (threads, hardware) and this polls `done` in wall
    /// time, yielding the CPU between checks.
    fn drive_until(&self, done: &mut dyn FnMut() -> bool, limit: Duration) -> bool {
        let start = crate::clock::wall_now();
        loop {
            if done() {
                return true;
            }
            if crate::clock::wall_elapsed(start) > limit {
                return done();
            }
            std::thread::yield_now();
        }
    }
    /// The source address of packets leaving `side` (what fault rules match on).
    fn wire_addr(&self, side: Side) -> std::net::SocketAddr;
    /// Installs a rule on packets leaving `side`; `false` when the backend cannot.
    fn inject(&self, side: Side, rule: Rule) -> bool;
    /// The path MTU the suite uses.
    fn mtu(&self) -> Mtu {
        Mtu::Mtu1024
    }
}

/// How a case ended when it did not fail.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything asserted held.
    Passed,
    /// The case needs something the backend lacks.
    Skipped(&'static str),
}

const LIMIT: Duration = Duration::from_secs(10);
const BUF: usize = 4 << 20;

/// Registered memory for the suite.
struct Buf<D: Device> {
    mem: Vec<u8>,
    mr: Option<D::Mr>,
}

impl<D: Device> Buf<D> {
    fn new(dev: &D, pd: &D::Pd, len: usize, access: Access) -> Buf<D> {
        let mut mem = vec![0u8; len];
        // SAFETY: `mem` is never reallocated and the MR is dropped before it (see Drop).
        let mr = unsafe { dev.reg_mr(pd, mem.as_mut_ptr(), len, access) }.expect("reg_mr");
        Buf { mem, mr: Some(mr) }
    }
    fn keys(&self) -> MrKeys {
        self.mr.as_ref().expect("registered").keys()
    }
    fn sge(&self, off: usize, len: usize) -> Sge {
        let k = self.keys();
        Sge { addr: k.addr + off as u64, length: len as u32, lkey: k.lkey }
    }
    fn addr(&self, off: usize) -> u64 {
        self.keys().addr + off as u64
    }
    /// Reads the bytes the NIC may have written (volatile: the NIC writes behind our back).
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        self.mem[off..off + len].to_vec()
    }
    fn fill(&mut self, off: usize, len: usize, seed: u8) {
        for (i, b) in self.mem[off..off + len].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
    }
}

impl<D: Device> Drop for Buf<D> {
    fn drop(&mut self) {
        self.mr.take();
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Options of a connected pair.
#[derive(Clone, Copy, Debug)]
struct PairOpts {
    sq_depth: u32,
    rq_depth: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    /// Override both start PSNs (PSN-wrap case).
    psn: Option<u32>,
}

impl Default for PairOpts {
    fn default() -> Self {
        PairOpts {
            sq_depth: 64,
            rq_depth: 64,
            timeout: 12,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            psn: None,
        }
    }
}

/// Two connected QPs, one on each side, each with its own CQ and buffer.
struct Pair<D: Device> {
    buf_a: Buf<D>,
    buf_b: Buf<D>,
    qp_a: D::Qp,
    qp_b: D::Qp,
    cq_a: D::Cq,
    cq_b: D::Cq,
    _pd_a: D::Pd,
    _pd_b: D::Pd,
}

fn pair<B: Bed>(bed: &B, o: PairOpts) -> Pair<B::D> {
    let (da, db) = (bed.device(Side::A), bed.device(Side::B));
    let pd_a = da.alloc_pd().expect("pd a");
    let pd_b = db.alloc_pd().expect("pd b");
    let cq_a = da.create_cq(1024).expect("cq a");
    let cq_b = db.create_cq(1024).expect("cq b");
    let caps = QpCaps {
        max_send_wr: o.sq_depth,
        max_recv_wr: o.rq_depth,
        max_send_sge: 2,
        max_recv_sge: 2,
    };
    let qp_a = da
        .create_qp(
            &pd_a,
            &QpInit { send_cq: &cq_a, recv_cq: &cq_a, srq: None, thread_domain: None, caps },
        )
        .expect("qp a");
    let qp_b = db
        .create_qp(
            &pd_b,
            &QpInit { send_cq: &cq_b, recv_cq: &cq_b, srq: None, thread_domain: None, caps },
        )
        .expect("qp b");
    let mut ep_a = qp_a.endpoint();
    let mut ep_b = qp_b.endpoint();
    if let Some(p) = o.psn {
        ep_a.psn = p;
        ep_b.psn = p;
    }
    for (qp, local, remote) in [(&qp_a, ep_a, ep_b), (&qp_b, ep_b, ep_a)] {
        qp.to_init(&InitAttrs::default()).expect("init");
        qp.to_rtr(&RtrAttrs { remote, path_mtu: bed.mtu(), min_rnr_timer: o.min_rnr_timer })
            .expect("rtr");
        qp.to_rts(&RtsAttrs {
            sq_psn: local.psn,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
        })
        .expect("rts");
    }
    Pair {
        buf_a: Buf::new(da, &pd_a, BUF, Access::ALL),
        buf_b: Buf::new(db, &pd_b, BUF, Access::ALL),
        qp_a,
        qp_b,
        cq_a,
        cq_b,
        _pd_a: pd_a,
        _pd_b: pd_b,
    }
}

/// Waits for `n` completions on `cq`.
fn wait_wcs<B: Bed>(bed: &B, cq: &<B::D as Device>::Cq, n: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    let ok = bed.drive_until(
        &mut || {
            // Take no more than asked for: extras stay queued for the next wait or check.
            let want = (n - got.len()).min(buf.len());
            let k = cq.poll(&mut buf[..want]).expect("poll cq");
            got.extend_from_slice(&buf[..k]);
            got.len() >= n
        },
        LIMIT,
    );
    assert!(ok, "[{}] timed out waiting for {n} completions, got {got:?}", bed.name());
    got
}

fn wait_wc<B: Bed>(bed: &B, cq: &<B::D as Device>::Cq) -> WorkCompletion {
    wait_wcs(bed, cq, 1)[0]
}

/// Lets the bed run for a while and asserts no completion appeared.
fn assert_quiet<B: Bed>(bed: &B, cq: &<B::D as Device>::Cq, d: Duration) {
    let mut buf = [WorkCompletion::default(); 4];
    let mut seen = None;
    bed.drive_until(
        &mut || {
            let k = cq.poll(&mut buf).expect("poll");
            if k > 0 {
                seen = Some(buf[0]);
            }
            k > 0
        },
        d,
    );
    assert!(seen.is_none(), "[{}] unexpected completion {seen:?}", bed.name());
}

fn send_wr(id: u64, op: SendOp, sges: &[Sge]) -> SendWr {
    SendWr { wr_id: id, op, sg_list: SgList::from_slice(sges).expect("sges"), signaled: true }
}

fn recv_wr(id: u64, sges: &[Sge]) -> RecvWr {
    RecvWr { wr_id: id, sg_list: SgList::from_slice(sges).expect("sges") }
}

fn ok(wc: &WorkCompletion, id: u64, opcode: WcOpcode) {
    assert_eq!(wc.status, WcStatus::Success, "completion {wc:?}");
    assert_eq!(wc.wr_id, id, "completion {wc:?}");
    assert_eq!(wc.opcode, opcode, "completion {wc:?}");
}

fn payload_packets(side_addr: std::net::SocketAddr) -> impl FnMut(&PacketInfo) -> bool + Send {
    move |p| {
        p.from == side_addr
            && p.header.is_some_and(|h| h.opcode != crate::soft::packet::Opcode::Acknowledge)
    }
}

/// SEND into a posted receive: data, length, and both completions.
pub fn send_recv<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts::default());
    let len = 3000;
    p.buf_a.fill(0, len, 1);
    p.qp_b.post_recv(&[recv_wr(7, &[p.buf_b.sge(0, 8192)])]).unwrap();
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, len)])]).unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 7, WcOpcode::Recv);
    assert_eq!(r.byte_len as usize, len);
    assert_eq!(r.imm, None);
    assert_eq!(r.qp_num, p.qp_b.qpn());
    assert_eq!(p.buf_b.read(0, len), pattern(len, 1));
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::Send);
    Outcome::Passed
}

/// SEND_WITH_IMM: the receiver's completion carries the immediate value.
pub fn send_with_imm<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts::default());
    p.buf_a.fill(0, 100, 2);
    p.qp_b.post_recv(&[recv_wr(1, &[p.buf_b.sge(0, 100)])]).unwrap();
    let op = SendOp::SendWithImm { imm: 0xdead_beef };
    p.qp_a.post_send(&[send_wr(2, op, &[p.buf_a.sge(0, 100)])]).unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 1, WcOpcode::Recv);
    assert_eq!(r.imm, Some(0xdead_beef));
    assert_eq!(r.byte_len, 100);
    ok(&wait_wc(bed, &p.cq_a), 2, WcOpcode::Send);
    Outcome::Passed
}

/// WRITE lands in the peer's region at the right offset and nothing else changes.
pub fn write<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts::default());
    let len = 10_000;
    p.buf_a.fill(0, len, 3);
    let op = SendOp::Write { remote_addr: p.buf_b.addr(100), rkey: p.buf_b.keys().rkey };
    p.qp_a.post_send(&[send_wr(3, op, &[p.buf_a.sge(0, len)])]).unwrap();
    ok(&wait_wc(bed, &p.cq_a), 3, WcOpcode::RdmaWrite);
    assert_eq!(p.buf_b.read(100, len), pattern(len, 3));
    assert_eq!(p.buf_b.read(0, 100), vec![0; 100]);
    assert_eq!(p.buf_b.read(100 + len, 100), vec![0; 100]);
    assert_quiet(bed, &p.cq_b, Duration::from_millis(20));
    Outcome::Passed
}

/// WRITE_WITH_IMM consumes a receive; the completion has the imm and the written length.
pub fn write_with_imm<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts::default());
    let len = 5000;
    p.buf_a.fill(0, len, 4);
    p.qp_b.post_recv(&[recv_wr(9, &[])]).unwrap();
    let op =
        SendOp::WriteWithImm { remote_addr: p.buf_b.addr(0), rkey: p.buf_b.keys().rkey, imm: 42 };
    p.qp_a.post_send(&[send_wr(4, op, &[p.buf_a.sge(0, len)])]).unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 9, WcOpcode::RecvRdmaWithImm);
    assert_eq!(r.imm, Some(42));
    assert_eq!(r.byte_len as usize, len);
    assert_eq!(p.buf_b.read(0, len), pattern(len, 4));
    ok(&wait_wc(bed, &p.cq_a), 4, WcOpcode::RdmaWrite);
    Outcome::Passed
}

/// 0-byte SEND and 0-byte WRITE_WITH_IMM.
pub fn zero_byte_messages<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts::default());
    p.qp_b.post_recv(&[recv_wr(1, &[p.buf_b.sge(0, 64)]), recv_wr(2, &[])]).unwrap();
    let rkey = p.buf_b.keys().rkey;
    p.qp_a
        .post_send(&[
            send_wr(10, SendOp::Send, &[]),
            send_wr(11, SendOp::WriteWithImm { remote_addr: p.buf_b.addr(0), rkey, imm: 5 }, &[]),
        ])
        .unwrap();
    let rs = wait_wcs(bed, &p.cq_b, 2);
    ok(&rs[0], 1, WcOpcode::Recv);
    assert_eq!(rs[0].byte_len, 0);
    ok(&rs[1], 2, WcOpcode::RecvRdmaWithImm);
    assert_eq!((rs[1].byte_len, rs[1].imm), (0, Some(5)));
    let ss = wait_wcs(bed, &p.cq_a, 2);
    ok(&ss[0], 10, WcOpcode::Send);
    ok(&ss[1], 11, WcOpcode::RdmaWrite);
    Outcome::Passed
}

/// The largest messages the suite's buffers hold, gathered from two sges, by SEND and WRITE;
/// and a request beyond the device's maximum message size is refused.
pub fn max_size_messages<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts::default());
    let half = BUF / 2;
    p.buf_a.fill(0, BUF, 5);
    let sges = [p.buf_a.sge(0, half), p.buf_a.sge(half, half)];
    p.qp_b.post_recv(&[recv_wr(1, &[p.buf_b.sge(0, BUF)])]).unwrap();
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &sges)]).unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 1, WcOpcode::Recv);
    assert_eq!(r.byte_len as usize, BUF);
    assert!(p.buf_b.read(0, BUF) == pattern(BUF, 5), "SEND data differs");
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::Send);
    p.buf_a.fill(0, BUF, 6);
    let op = SendOp::Write { remote_addr: p.buf_b.addr(0), rkey: p.buf_b.keys().rkey };
    p.qp_a.post_send(&[send_wr(2, op, &sges)]).unwrap();
    ok(&wait_wc(bed, &p.cq_a), 2, WcOpcode::RdmaWrite);
    assert!(p.buf_b.read(0, BUF) == pattern(BUF, 6), "WRITE data differs");
    // Beyond max_msg_size: refused at post (software) or completed in error (hardware).
    let max = bed.device(Side::A).caps().max_msg_size;
    if max < u64::from(u32::MAX) {
        let big = (max / 2 + 1) as u32;
        let huge = [p.buf_a.sge(0, 0), p.buf_a.sge(0, 0)].map(|mut s| {
            s.length = big;
            s
        });
        match p.qp_a.post_send(&[send_wr(3, SendOp::Send, &huge)]) {
            Err(Error::InvalidRequest { index: 0, .. }) => {}
            Ok(()) => assert!(!wait_wc(bed, &p.cq_a).status.is_success()),
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    Outcome::Passed
}

/// No receive posted: the requester is told RNR and retries until one is posted.
pub fn rnr_retry_within_limit<B: Bed>(bed: &B) -> Outcome {
    let mut p = pair(bed, PairOpts { rnr_retry: 7, min_rnr_timer: 1, ..PairOpts::default() });
    p.buf_a.fill(0, 64, 7);
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, 64)])]).unwrap();
    assert_quiet(bed, &p.cq_a, Duration::from_millis(30));
    p.qp_b.post_recv(&[recv_wr(5, &[p.buf_b.sge(0, 64)])]).unwrap();
    ok(&wait_wc(bed, &p.cq_b), 5, WcOpcode::Recv);
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::Send);
    assert_eq!(p.buf_b.read(0, 64), pattern(64, 7));
    Outcome::Passed
}

/// No receive ever posted with a finite `rnr_retry`: RNR retry exceeded, QP in error.
pub fn rnr_retry_exceeded<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts { rnr_retry: 2, min_rnr_timer: 1, ..PairOpts::default() });
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, 64)])]).unwrap();
    let wc = wait_wc(bed, &p.cq_a);
    assert_eq!(wc.status, WcStatus::RnrRetryExceeded, "{wc:?}");
    assert_eq!(p.qp_a.state(), QpState::Error);
    Outcome::Passed
}

/// The first ACK is lost: the requester times out, resends, the responder re-ACKs the
/// duplicate without executing it twice.
pub fn ack_timeout_retry_within_limit<B: Bed>(bed: &B) -> Outcome {
    let from_b = bed.wire_addr(Side::B);
    let rule = crate::soft::fault::nth_matching(0, Verdict::Drop, move |p| {
        p.from == from_b
            && p.header.is_some_and(|h| h.opcode == crate::soft::packet::Opcode::Acknowledge)
    });
    let mut p = pair(bed, PairOpts { timeout: 10, retry_cnt: 3, ..PairOpts::default() });
    if !bed.inject(Side::B, Box::new(rule)) {
        return Outcome::Skipped("needs packet fault injection");
    }
    p.buf_a.fill(0, 256, 8);
    p.qp_b
        .post_recv(&[recv_wr(1, &[p.buf_b.sge(0, 256)]), recv_wr(2, &[p.buf_b.sge(256, 256)])])
        .unwrap();
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, 256)])]).unwrap();
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::Send);
    ok(&wait_wc(bed, &p.cq_b), 1, WcOpcode::Recv);
    // The duplicate must not have consumed the second receive.
    assert_quiet(bed, &p.cq_b, Duration::from_millis(20));
    Outcome::Passed
}

/// The peer stops answering (its QP is moved to ERROR, which drops every request): each
/// retry times out, then retry exceeded and the QP errors.
pub fn ack_timeout_retry_exceeded<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts { timeout: 8, retry_cnt: 2, ..PairOpts::default() });
    p.qp_b.to_error().unwrap();
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, 64)])]).unwrap();
    let wc = wait_wc(bed, &p.cq_a);
    assert_eq!(wc.status, WcStatus::RetryExceeded, "{wc:?}");
    assert_eq!(p.qp_a.state(), QpState::Error);
    Outcome::Passed
}

/// A middle packet of a SEND is lost: the responder NAKs the sequence error once, the
/// requester resends from the missing PSN, the data arrives intact.
pub fn implied_sequence_nak_retry<B: Bed>(bed: &B) -> Outcome {
    let mtu = bed.mtu().bytes() as usize;
    let from_a = bed.wire_addr(Side::A);
    let rule = crate::soft::fault::nth_matching(1, Verdict::Drop, payload_packets(from_a));
    let mut p = pair(bed, PairOpts { timeout: 14, ..PairOpts::default() });
    if !bed.inject(Side::A, Box::new(rule)) {
        return Outcome::Skipped("needs packet fault injection");
    }
    let len = mtu * 6 + 17;
    p.buf_a.fill(0, len, 9);
    p.qp_b.post_recv(&[recv_wr(1, &[p.buf_b.sge(0, len)])]).unwrap();
    p.qp_a.post_send(&[send_wr(1, SendOp::Send, &[p.buf_a.sge(0, len)])]).unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 1, WcOpcode::Recv);
    assert_eq!(r.byte_len as usize, len);
    assert_eq!(p.buf_b.read(0, len), pattern(len, 9));
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::Send);
    Outcome::Passed
}

/// A WRITE loses a packet in its middle: resumption mid-message (no RETH) completes it.
pub fn partial_write_retry<B: Bed>(bed: &B) -> Outcome {
    let mtu = bed.mtu().bytes() as usize;
    let from_a = bed.wire_addr(Side::A);
    let rule = crate::soft::fault::nth_matching(4, Verdict::Drop, payload_packets(from_a));
    let mut p = pair(bed, PairOpts::default());
    if !bed.inject(Side::A, Box::new(rule)) {
        return Outcome::Skipped("needs packet fault injection");
    }
    let len = mtu * 10;
    p.buf_a.fill(0, len, 10);
    let op = SendOp::Write { remote_addr: p.buf_b.addr(0), rkey: p.buf_b.keys().rkey };
    p.qp_a.post_send(&[send_wr(1, op, &[p.buf_a.sge(0, len)])]).unwrap();
    ok(&wait_wc(bed, &p.cq_a), 1, WcOpcode::RdmaWrite);
    assert_eq!(p.buf_b.read(0, len), pattern(len, 10));
    Outcome::Passed
}

/// A WRITE with a wrong rkey: remote access error, both QPs end in ERROR, later work flushes.
pub fn rkey_violation<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts::default());
    p.qp_b.post_recv(&[recv_wr(77, &[p.buf_b.sge(0, 64)])]).unwrap();
    let bad = p.buf_b.keys().rkey ^ 0x5a5a_0001;
    let op = SendOp::Write { remote_addr: p.buf_b.addr(0), rkey: bad };
    p.qp_a
        .post_send(&[
            send_wr(1, op, &[p.buf_a.sge(0, 64)]),
            send_wr(2, SendOp::Send, &[p.buf_a.sge(0, 8)]),
        ])
        .unwrap();
    let wcs = wait_wcs(bed, &p.cq_a, 2);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RemoteAccessError), "{wcs:?}");
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushError), "{wcs:?}");
    assert_eq!(p.qp_a.state(), QpState::Error);
    // The responder errors too and flushes its receive.
    let r = wait_wc(bed, &p.cq_b);
    assert_eq!((r.wr_id, r.status), (77, WcStatus::WrFlushError), "{r:?}");
    assert_eq!(p.buf_b.read(0, 64), vec![0; 64]);
    Outcome::Passed
}

/// A WRITE one byte past the end of the region: remote access error, no byte written.
pub fn bounds_violation<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts::default());
    let op = SendOp::Write { remote_addr: p.buf_b.addr(BUF - 63), rkey: p.buf_b.keys().rkey };
    p.qp_a.post_send(&[send_wr(1, op, &[p.buf_a.sge(0, 64)])]).unwrap();
    let wc = wait_wc(bed, &p.cq_a);
    assert_eq!(wc.status, WcStatus::RemoteAccessError, "{wc:?}");
    assert_eq!(p.buf_b.read(BUF - 63, 63), vec![0; 63]);
    Outcome::Passed
}

/// Start just below 2^24: multi-packet messages cross the PSN wrap intact and in order.
pub fn psn_wrap<B: Bed>(bed: &B) -> Outcome {
    let mtu = bed.mtu().bytes() as usize;
    let mut p = pair(bed, PairOpts { psn: Some((1 << 24) - 5), ..PairOpts::default() });
    let len = mtu * 3 + 1;
    let n = 8;
    for i in 0..n {
        p.buf_a.fill(i * len, len, i as u8);
    }
    let recvs: Vec<_> = (0..n).map(|i| recv_wr(i as u64, &[p.buf_b.sge(i * len, len)])).collect();
    p.qp_b.post_recv(&recvs).unwrap();
    let sends: Vec<_> =
        (0..n).map(|i| send_wr(i as u64, SendOp::Send, &[p.buf_a.sge(i * len, len)])).collect();
    p.qp_a.post_send(&sends).unwrap();
    let rs = wait_wcs(bed, &p.cq_b, n);
    for (i, r) in rs.iter().enumerate() {
        ok(r, i as u64, WcOpcode::Recv);
        assert_eq!(p.buf_b.read(i * len, len), pattern(len, i as u8), "message {i}");
    }
    let ss = wait_wcs(bed, &p.cq_a, n);
    for (i, s) in ss.iter().enumerate() {
        ok(s, i as u64, WcOpcode::Send);
    }
    Outcome::Passed
}

/// A batch larger than the free send queue: the prefix is posted, the rest refused.
pub fn sq_full<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts { sq_depth: 4, ..PairOpts::default() });
    let rkey = p.buf_b.keys().rkey;
    let wrs: Vec<_> = (0..6)
        .map(|i| {
            let op = SendOp::Write { remote_addr: p.buf_b.addr(i * 8), rkey };
            send_wr(i as u64, op, &[p.buf_a.sge(0, 8)])
        })
        .collect();
    match p.qp_a.post_send(&wrs) {
        Err(Error::QueueFull { posted }) => assert!((4..6).contains(&posted), "posted {posted}"),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    let wcs = wait_wcs(bed, &p.cq_a, 4);
    assert!(wcs.iter().all(|w| w.status.is_success()));
    Outcome::Passed
}

/// Unsignaled requests are retired by a later signaled one: a full queue of 3 unsignaled +
/// 1 signaled, repeated, never overflows and yields one completion per round.
pub fn unsignaled_retired_by_signaled<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts { sq_depth: 4, ..PairOpts::default() });
    let rkey = p.buf_b.keys().rkey;
    for round in 0..10u64 {
        let wrs: Vec<_> = (0..4u64)
            .map(|i| {
                let op = SendOp::Write { remote_addr: p.buf_b.addr(i as usize * 8), rkey };
                let mut wr = send_wr(round * 4 + i, op, &[p.buf_a.sge(0, 8)]);
                wr.signaled = i == 3;
                wr
            })
            .collect();
        p.qp_a.post_send(&wrs).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let wc = wait_wc(bed, &p.cq_a);
        ok(&wc, round * 4 + 3, WcOpcode::RdmaWrite);
    }
    assert_quiet(bed, &p.cq_a, Duration::from_millis(10));
    Outcome::Passed
}

/// Moving a QP to ERROR flushes its posted receives and sends; later posts flush too.
pub fn flush_on_error<B: Bed>(bed: &B) -> Outcome {
    let p = pair(bed, PairOpts::default());
    let recvs: Vec<_> = (0..5).map(|i| recv_wr(i, &[p.buf_b.sge(0, 64)])).collect();
    p.qp_b.post_recv(&recvs).unwrap();
    p.qp_b.to_error().unwrap();
    let wcs = wait_wcs(bed, &p.cq_b, 5);
    for (i, w) in wcs.iter().enumerate() {
        assert_eq!((w.wr_id, w.status), (i as u64, WcStatus::WrFlushError), "{w:?}");
    }
    p.qp_b.post_recv(&[recv_wr(9, &[p.buf_b.sge(0, 64)])]).unwrap();
    let w = wait_wc(bed, &p.cq_b);
    assert_eq!((w.wr_id, w.status), (9, WcStatus::WrFlushError));
    p.qp_a.to_error().unwrap();
    p.qp_a.post_send(&[send_wr(3, SendOp::Send, &[p.buf_a.sge(0, 8)])]).unwrap();
    let w = wait_wc(bed, &p.cq_a);
    assert_eq!((w.wr_id, w.status), (3, WcStatus::WrFlushError));
    Outcome::Passed
}

/// A large WRITE then a WRITE_WITH_IMM: when the imm completion is visible, all the earlier
/// WRITE's bytes are too (with a packet of the first lost, where faults can be injected).
pub fn write_data_before_later_imm<B: Bed>(bed: &B) -> Outcome {
    let mtu = bed.mtu().bytes() as usize;
    let from_a = bed.wire_addr(Side::A);
    let mut p = pair(bed, PairOpts::default());
    let faulted = bed.inject(
        Side::A,
        Box::new(crate::soft::fault::nth_matching(3, Verdict::Drop, payload_packets(from_a))),
    );
    let len = mtu * 40;
    p.buf_a.fill(0, len, 11);
    p.qp_b.post_recv(&[recv_wr(1, &[])]).unwrap();
    let rkey = p.buf_b.keys().rkey;
    p.qp_a
        .post_send(&[
            send_wr(
                1,
                SendOp::Write { remote_addr: p.buf_b.addr(0), rkey },
                &[p.buf_a.sge(0, len)],
            ),
            send_wr(
                2,
                SendOp::WriteWithImm { remote_addr: p.buf_b.addr(len), rkey, imm: 1 },
                &[p.buf_a.sge(0, 4)],
            ),
        ])
        .unwrap();
    let r = wait_wc(bed, &p.cq_b);
    ok(&r, 1, WcOpcode::RecvRdmaWithImm);
    assert_eq!(p.buf_b.read(0, len), pattern(len, 11), "faults injected: {faulted}");
    wait_wcs(bed, &p.cq_a, 2);
    Outcome::Passed
}

/// Generates one `#[test]` per conformance case. `$make` is called with the case's name and
/// returns `Option<bed>`; `None` (no device) makes the case return after the constructor has
/// printed why it is skipped.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@cases $make;
            send_recv, send_with_imm, write, write_with_imm, zero_byte_messages,
            max_size_messages, rnr_retry_within_limit, rnr_retry_exceeded,
            ack_timeout_retry_within_limit, ack_timeout_retry_exceeded,
            implied_sequence_nak_retry, partial_write_retry, rkey_violation, bounds_violation,
            psn_wrap, sq_full, unsignaled_retired_by_signaled, flush_on_error,
            write_data_before_later_imm);
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let make = $make;
                let Some(bed) = make(stringify!($case)) else { return };
                match $crate::conformance::$case(&bed) {
                    $crate::conformance::Outcome::Passed => {}
                    $crate::conformance::Outcome::Skipped(why) => {
                        println!("SKIPPED: {} on {}: {}", stringify!($case),
                            $crate::conformance::Bed::name(&bed), why);
                    }
                }
            }
        )*
    };
}
