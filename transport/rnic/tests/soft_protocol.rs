//! Protocol mechanisms of the software RNIC that the generic conformance suite cannot see:
//! counters proving each recovery path ran, integrity under random faults on both wires, and
//! hostile input on the UDP port.

use std::time::Duration;

use bex_rnic::clock::{wall_elapsed, wall_now};
use bex_rnic::soft::fault::nth_matching;
use bex_rnic::soft::packet::{self, Header, Opcode};
use bex_rnic::soft::{
    Fabric, FaultPlan, FaultRates, LinkModel, NicConfig, SoftDevice, SoftMr, UdpConfig, Verdict,
};
use bex_rnic::verbs::*;
use bex_rnic::{CompletionQueue, Device, MemoryRegion, QpInit, QueuePair};
use rand::{Rng, SeedableRng};

struct End {
    _pd: bex_rnic::soft::SoftPd,
    cq: bex_rnic::soft::SoftCq,
    qp: bex_rnic::soft::SoftQp,
    mem: Vec<u8>,
    mr: Option<SoftMr>,
}

impl End {
    fn keys(&self) -> MrKeys {
        self.mr.as_ref().unwrap().keys()
    }
    fn sge(&self, off: usize, len: usize) -> Sge {
        Sge { addr: self.keys().addr + off as u64, length: len as u32, lkey: self.keys().lkey }
    }
    /// Posts one receive of the buffer's first `len` bytes.
    fn recv(&self, wr_id: u64, len: usize) {
        self.qp.post_recv(&[RecvWr { wr_id, sg_list: SgList::one(self.sge(0, len)) }]).unwrap();
    }
    /// Posts one signaled request of the buffer's first `len` bytes.
    fn send(&self, wr_id: u64, op: SendOp, len: usize) {
        let sg_list = SgList::one(self.sge(0, len));
        self.qp.post_send(&[SendWr { wr_id, op, sg_list, signaled: true }]).unwrap();
    }
}

impl Drop for End {
    fn drop(&mut self) {
        self.mr.take();
    }
}

fn end(dev: &SoftDevice, buf: usize, sq: u32, rq: u32) -> End {
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(4096).unwrap();
    let caps = QpCaps { max_send_wr: sq, max_recv_wr: rq, max_send_sge: 1, max_recv_sge: 1 };
    let qp = dev
        .create_qp(
            &pd,
            &QpInit { send_cq: &cq, recv_cq: &cq, srq: None, thread_domain: None, caps },
        )
        .unwrap();
    let mut mem = vec![0u8; buf];
    // SAFETY: `mem` outlives the MR (End's Drop takes the MR first) and is never reallocated.
    let mr = unsafe { dev.reg_mr(&pd, mem.as_mut_ptr(), buf, Access::ALL) }.unwrap();
    End { _pd: pd, cq, qp, mem, mr: Some(mr) }
}

/// Two ends of `buf` bytes with 8-deep queues, connected.
fn connected(da: &SoftDevice, db: &SoftDevice, buf: usize, mtu: Mtu, timeout: u8) -> (End, End) {
    let (a, b) = (end(da, buf, 8, 8), end(db, buf, 8, 8));
    connect(&a, &b, mtu, timeout);
    (a, b)
}

fn connect(a: &End, b: &End, mtu: Mtu, timeout: u8) {
    let attrs =
        ConnectAttrs { path_mtu: mtu, timeout, min_rnr_timer: 1, ..ConnectAttrs::default() };
    a.qp.connect(&b.qp.endpoint(), &attrs).unwrap();
    b.qp.connect(&a.qp.endpoint(), &attrs).unwrap();
}

fn poll_one(cq: &bex_rnic::soft::SoftCq) -> Option<WorkCompletion> {
    let mut wc = [WorkCompletion::default(); 1];
    (cq.poll(&mut wc).unwrap() == 1).then_some(wc[0])
}

/// Runs the fabric until `cq` yields a completion (at most 1 s of virtual time), and asserts
/// it succeeded: a request that ended in an error completion does not pass for recovered.
fn completed(f: &Fabric, cq: &bex_rnic::soft::SoftCq) -> WorkCompletion {
    let mut got = None;
    assert!(f.run_until(
        || {
            got = got.or_else(|| poll_one(cq));
            got.is_some()
        },
        Duration::from_secs(1)
    ));
    let wc = got.expect("a completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    wc
}

fn sim_pair(seed: u64) -> (Fabric, SoftDevice, SoftDevice) {
    let f = Fabric::new(seed, LinkModel::default());
    let a = f.add_device(NicConfig::default());
    let b = f.add_device(NicConfig::default());
    (f, a, b)
}

fn data_from(addr: std::net::SocketAddr) -> impl FnMut(&bex_rnic::soft::PacketInfo) -> bool + Send {
    move |p| p.from == addr && p.header.is_some_and(|h| h.opcode != Opcode::Acknowledge)
}

#[test]
fn a_lost_middle_packet_costs_one_sequence_nak_and_no_timeout() {
    let (f, da, db) = sim_pair(1);
    let (a, b) = connected(&da, &db, 1 << 16, Mtu::Mtu1024, 14);
    let from = da.local_addr();
    f.with_faults(|p| p.add_rule(nth_matching(2, Verdict::Drop, data_from(from))));
    b.recv(1, 8000);
    a.send(1, SendOp::Send, 8000);
    let t0 = f.now();
    completed(&f, &a.cq);
    // The receiver got the whole message once, in one completion.
    let r = completed(&f, &b.cq);
    assert_eq!((r.wr_id, r.opcode, r.byte_len), (1, WcOpcode::Recv, 8000), "{r:?}");
    let (ca, cb) = (da.counters(), db.counters());
    assert_eq!(cb.seq_naks_sent, 1, "one NAK per gap: {cb:?}");
    assert_eq!(ca.seq_naks_received, 1);
    assert_eq!(ca.ack_timeouts, 0, "fast retransmit, not a timeout");
    assert!(ca.retransmitted_packets >= 5, "go-back-N resent the tail: {ca:?}");
    // Recovery took round trips, not the 67 ms ACK timeout; the final ACK waits for the
    // responder's delayed-ACK timer (nothing here replies to carry it).
    let ack_delay = bex_rnic::soft::NicConfig::default().ack_delay;
    let took = f.now() - t0;
    assert!(took < ack_delay + Duration::from_millis(1), "took {took:?}");
}

#[test]
fn a_lost_ack_is_recovered_by_exactly_one_timeout_and_the_duplicate_is_not_executed() {
    let (f, da, db) = sim_pair(2);
    let (a, b) = connected(&da, &db, 1 << 16, Mtu::Mtu1024, 10); // 4.19 ms
    let from_b = db.local_addr();
    f.with_faults(|p| {
        p.add_rule(nth_matching(0, Verdict::Drop, move |p| {
            p.from == from_b && p.header.is_some_and(|h| h.opcode == Opcode::Acknowledge)
        }))
    });
    let recvs: Vec<_> =
        (0..2).map(|i| RecvWr { wr_id: i, sg_list: SgList::one(b.sge(0, 100)) }).collect();
    b.qp.post_recv(&recvs).unwrap();
    a.send(9, SendOp::Send, 100);
    let t0 = f.now();
    completed(&f, &a.cq);
    let waited = f.now() - t0;
    let timeout = timers::ack_timeout(10).unwrap();
    assert!(
        waited >= timeout && waited < timeout + Duration::from_micros(100),
        "waited {waited:?}"
    );
    assert_eq!(da.counters().ack_timeouts, 1);
    assert_eq!(db.counters().rx_duplicates, 1);
    assert_eq!(db.qp_rq_len(&b), 1, "the duplicate consumed no receive");
}

trait RqLen {
    fn qp_rq_len(&self, e: &End) -> usize;
}
impl RqLen for SoftDevice {
    fn qp_rq_len(&self, e: &End) -> usize {
        e.qp.rq_len()
    }
}

#[test]
fn rnr_naks_wait_the_advertised_timer() {
    let (f, da, db) = sim_pair(3);
    let (a, b) = (end(&da, 1 << 16, 8, 8), end(&db, 1 << 16, 8, 8));
    let attrs = ConnectAttrs { min_rnr_timer: 14, ..ConnectAttrs::default() }; // 1.28 ms
    a.qp.connect(&b.qp.endpoint(), &attrs).unwrap();
    b.qp.connect(&a.qp.endpoint(), &attrs).unwrap();
    a.send(1, SendOp::Send, 10);
    f.run_for(Duration::from_micros(5000));
    let n = db.counters().rnr_naks_sent;
    // One NAK per 1.28 ms wait plus a round trip: 3 or 4 within 5 ms, never a storm.
    assert!((3..=4).contains(&n), "rnr naks {n}");
    assert_eq!(da.counters().rnr_naks_received, n);
}

/// Streams `n` messages of random sizes (SEND and WRITE_WITH_IMM alternating) and checks each
/// arrives once, intact and in order. `pump` makes progress (fabric step or a yield).
fn stream_integrity(
    a: &End,
    b: &mut End,
    n: usize,
    max_len: usize,
    seed: u64,
    mut pump: impl FnMut(),
    limit: Duration,
) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let sizes: Vec<usize> = (0..n).map(|_| rng.random_range(0..=max_len)).collect();
    let slot = max_len.next_multiple_of(64);
    let a_mem_fill = |i: usize| -> Vec<u8> {
        (0..sizes[i]).map(|k| (k as u8) ^ (i as u8).wrapping_mul(7)).collect()
    };
    let recvs: Vec<_> = (0..n)
        .map(|i| RecvWr { wr_id: i as u64, sg_list: SgList::one(b.sge(i * slot, slot)) })
        .collect();
    for chunk in recvs.chunks(64) {
        b.qp.post_recv(chunk).unwrap();
    }
    let rkey = b.keys().rkey;
    let base = b.keys().addr;
    let start = wall_now();
    let (mut posted, mut sent_done, mut recvd) = (0usize, 0usize, 0usize);
    let mut expect: Vec<Vec<u8>> = Vec::new();
    while recvd < n || sent_done < n {
        assert!(
            wall_elapsed(start) < limit,
            "stalled: posted {posted} sent {sent_done} received {recvd} (seed {seed})"
        );
        while posted < n && posted - sent_done < 16 {
            let i = posted;
            let data = a_mem_fill(i);
            // Each message has its own source slot (filled by `stream_ends`), so retransmissions
            // read stable bytes.
            let src = i * slot;
            expect.push(data);
            let op = if i % 2 == 0 {
                SendOp::Send
            } else {
                SendOp::WriteWithImm { remote_addr: base + (i * slot) as u64, rkey, imm: i as u32 }
            };
            a.qp.post_send(&[SendWr {
                wr_id: i as u64,
                op,
                sg_list: SgList::one(a.sge(src, sizes[i])),
                signaled: true,
            }])
            .unwrap();
            posted += 1;
        }
        pump();
        while let Some(wc) = poll_one(&a.cq) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?} (seed {seed})");
            assert_eq!(wc.wr_id as usize, sent_done, "send completions in order");
            sent_done += 1;
        }
        while let Some(wc) = poll_one(&b.cq) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?} (seed {seed})");
            let i = recvd;
            assert_eq!(wc.wr_id as usize, i, "receives in order (seed {seed})");
            assert_eq!(wc.byte_len as usize, sizes[i]);
            if i % 2 == 1 {
                assert_eq!(wc.imm, Some(i as u32));
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            assert!(
                b.mem[i * slot..i * slot + sizes[i]] == expect[i][..],
                "message {i} corrupted (seed {seed})"
            );
            recvd += 1;
        }
    }
}

/// Connected ends for [`stream_integrity`]: a slot per message each side, the sender's
/// slots filled with what the stream sends.
fn stream_ends(
    da: &SoftDevice,
    db: &SoftDevice,
    n: usize,
    max_len: usize,
    mtu: Mtu,
    timeout: u8,
) -> (End, End) {
    let slot = max_len.next_multiple_of(64);
    let (mut a, b) = (end(da, n * slot, 64, 512), end(db, n * slot, 64, 512));
    connect(&a, &b, mtu, timeout);
    for i in 0..n {
        for k in 0..slot {
            a.mem[i * slot + k] = (k as u8) ^ (i as u8).wrapping_mul(7);
        }
    }
    (a, b)
}

fn fabric_stream(
    seed: u64,
    rates: FaultRates,
    mtu: Mtu,
) -> (bex_rnic::soft::Counters, bex_rnic::soft::fabric::FabricStats) {
    let (f, da, db) = sim_pair(seed);
    let (n, max_len) = (300usize, 9000usize);
    let (a, mut b) = stream_ends(&da, &db, n, max_len, mtu, 10);
    f.with_faults(|p| p.set_rates(rates));
    stream_integrity(
        &a,
        &mut b,
        n,
        max_len,
        seed,
        || {
            f.step();
        },
        Duration::from_secs(60),
    );
    (da.counters(), f.stats())
}

#[test]
fn fabric_streams_survive_one_and_five_percent_loss() {
    for (seed, drop) in [(11, 0.01), (12, 0.05), (13, 0.05)] {
        let (c, s) =
            fabric_stream(seed, FaultRates { drop, ..FaultRates::default() }, Mtu::Mtu1024);
        assert!(s.dropped > 0, "faults were applied");
        assert!(c.retransmitted_packets > 0, "{c:?}");
    }
}

#[test]
fn fabric_streams_survive_duplication_reordering_and_corruption() {
    let rates = FaultRates { drop: 0.01, duplicate: 0.02, corrupt: 0.01, reorder: 0.02 };
    for seed in 20..23 {
        let (_, s) = fabric_stream(seed, rates, Mtu::Mtu1024);
        assert!(s.duplicated > 0 && s.corrupted > 0 && s.reordered > 0, "{s:?}");
    }
}

fn udp_dev() -> SoftDevice {
    SoftDevice::open_udp(UdpConfig::new("127.0.0.1:0".parse().unwrap())).unwrap()
}

#[test]
fn udp_streams_survive_one_and_five_percent_loss() {
    for (seed, drop) in [(31u64, 0.01), (32, 0.05)] {
        let (da, db) = (udp_dev(), udp_dev());
        let (n, max_len) = (300usize, 20_000usize);
        // 4 ms ACK timeout: a debug build takes more than 1 ms to move a window of 16 messages
        // of up to 20 kB, and spurious timeouts then exhaust the retries (RetryExceeded).
        let (a, mut b) = stream_ends(&da, &db, n, max_len, Mtu::Mtu4096, 10);
        let rates = FaultRates { drop, ..FaultRates::default() };
        da.set_outbound_faults(Some(FaultPlan::new(seed, rates))).unwrap();
        db.set_outbound_faults(Some(FaultPlan::new(seed + 100, rates))).unwrap();
        stream_integrity(
            &a,
            &mut b,
            n,
            max_len,
            seed,
            std::thread::yield_now,
            Duration::from_secs(60),
        );
        assert!(da.counters().wire_fault_drops + db.counters().wire_fault_drops > 0);
    }
}

#[test]
fn hostile_datagrams_are_counted_and_never_disturb_a_live_qp() {
    let (da, db) = (udp_dev(), udp_dev());
    let (a, b) = connected(&da, &db, 1 << 16, Mtu::Mtu4096, 14);
    let attacker = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let target = db.local_addr();
    // Well-formed for the attacker's own route, so only the QP checks refuse them.
    let route = packet::Route { src: attacker.local_addr().unwrap(), dst: target };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
    // Random junk and truncations of a valid packet.
    let valid = packet::encode(&Header::new(Opcode::SendOnly, b.qp.qpn(), 0), &[1; 64], &route);
    for i in 0..300 {
        let pkt: Vec<u8> = if i % 2 == 0 {
            (0..rng.random_range(0..200)).map(|_| rng.random()).collect()
        } else {
            valid[..rng.random_range(0..valid.len())].to_vec()
        };
        attacker.send_to(&pkt, target).unwrap();
    }
    // Well-formed packets: to an unknown QP, and to the live QP from a stranger.
    let unknown = packet::encode(
        &Header::new(Opcode::SendOnly, 0x00ab_cdef ^ b.qp.qpn(), 0),
        &[0; 8],
        &route,
    );
    attacker.send_to(&unknown, target).unwrap();
    attacker.send_to(&valid, target).unwrap();
    // The real connection still works.
    b.recv(5, 64);
    a.send(6, SendOp::Send, 64);
    let start = wall_now();
    let mut got = None;
    while got.is_none() && wall_elapsed(start) < Duration::from_secs(5) {
        got = poll_one(&b.cq);
    }
    let wc = got.expect("live QP still delivers");
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    let c = db.counters();
    assert!(c.rx_malformed + c.rx_bad_icrc >= 290, "{c:?}");
    assert!(c.rx_unknown_qp >= 1, "{c:?}");
    assert!(c.rx_wrong_source >= 1, "{c:?}");
}

#[test]
fn a_closing_device_acks_what_it_received() {
    let (da, db) = (udp_dev(), udp_dev());
    let (a, b) = connected(&da, &db, 1 << 16, Mtu::Mtu4096, 10);
    b.recv(1, 64);
    a.send(2, SendOp::Send, 64);
    let start = wall_now();
    while poll_one(&b.cq).is_none() {
        assert!(wall_elapsed(start) < Duration::from_secs(5), "message never arrived");
    }
    // The receiver goes away at once; its ACK was still waiting for company.
    drop(b);
    drop(db);
    let mut wc = None;
    while wc.is_none() && wall_elapsed(start) < Duration::from_secs(5) {
        wc = poll_one(&a.cq);
    }
    let wc = wc.expect("the sender got an answer");
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
}

/// Runs one signaled request of `len` bytes from a to b (MTU 1 KiB) and returns how many ACKs
/// b sent and how long the request took.
fn one_request(seed: u64, op: SendOp, len: usize) -> (u64, Duration, bex_rnic::soft::Counters) {
    let (f, da, db) = sim_pair(seed);
    let (a, b) = connected(&da, &db, 1 << 20, Mtu::Mtu1024, 14);
    b.recv(1, len);
    let op = match op {
        SendOp::Write { .. } => SendOp::Write { remote_addr: b.keys().addr, rkey: b.keys().rkey },
        other => other,
    };
    a.send(1, op, len);
    let t0 = f.now();
    completed(&f, &a.cq);
    (db.counters().acks_sent, f.now() - t0, da.counters())
}

#[test]
fn a_message_that_fits_the_window_draws_no_ack_from_its_middle() {
    // 100 packets < the 128-PSN window: the responder ACKs once, at the end (a SEND's end
    // waits for the delayed-ACK timer here, since nothing replies to carry it).
    let (acks, took, ca) = one_request(11, SendOp::Send, 100 * 1024);
    assert_eq!(acks, 1, "one ACK for the whole message");
    assert_eq!(ca.ack_timeouts, 0);
    assert!(took >= NicConfig::default().ack_delay, "{took:?}");
    // A plain WRITE is ACKed at once at its end: nobody there answers it.
    let (acks, took, _) = one_request(12, SendOp::Write { remote_addr: 0, rkey: 0 }, 100 * 1024);
    assert_eq!(acks, 1);
    assert!(took < Duration::from_millis(1), "{took:?}");
}

#[test]
fn a_stream_longer_than_the_window_asks_for_acks_and_never_stalls() {
    // 1000 packets, eight windows' worth: the requester asks every `ack_req_every` packets
    // while the rest outruns the window, so it never waits for a timer.
    let (acks, took, ca) = one_request(13, SendOp::Write { remote_addr: 0, rkey: 0 }, 1000 * 1024);
    let every = u64::from(NicConfig::default().ack_req_every);
    assert!(acks >= 1000 / 128 && acks <= 1000 / every + 2, "{acks} ACKs");
    assert_eq!((ca.ack_timeouts, ca.retransmitted_packets), (0, 0), "{ca:?}");
    assert!(took < Duration::from_millis(1), "{took:?}");
}

#[test]
fn a_packet_with_a_bad_icrc_is_dropped_and_counted_and_its_message_arrives_once_intact() {
    let (f, da, db) = sim_pair(21);
    let (mut a, b) = connected(&da, &db, 1 << 16, Mtu::Mtu1024, 10);
    for (i, byte) in a.mem[..8000].iter_mut().enumerate() {
        *byte = (i * 13) as u8;
    }
    // One bit of the 3rd data packet flipped on the wire (its payload: 1 KiB of its 1.05).
    let from = da.local_addr();
    f.with_faults(|p| p.add_rule(nth_matching(2, Verdict::Corrupt, data_from(from))));
    b.recv(1, 8000);
    a.send(1, SendOp::Send, 8000);
    let mut got = None;
    assert!(f.run_until(
        || {
            got = got.or_else(|| poll_one(&b.cq));
            got.is_some() && poll_one(&a.cq).is_some()
        },
        Duration::from_secs(1)
    ));
    let wc = got.unwrap();
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 8000));
    assert!(b.mem[..8000] == a.mem[..8000], "delivered intact, from the retransmission");
    assert!(poll_one(&b.cq).is_none(), "delivered once");
    let cb = db.counters();
    assert_eq!((cb.rx_bad_icrc, cb.rx_malformed), (1, 0), "{cb:?}");
    assert!(da.counters().retransmitted_packets > 0);
}
