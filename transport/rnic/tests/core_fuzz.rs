//! Packets that parse (valid ICRC) but make no sense for the QP's state — WRITE_MIDDLE with
//! no FIRST, absurd DMA lengths, ACKs for PSNs never sent, any PSN — must never panic the
//! protocol core nor corrupt memory outside registered regions.

use std::net::SocketAddr;
use std::sync::Arc;

use bex_rnic::clock::wall_now;
use bex_rnic::soft::core::{NicConfig, NicCore};
use bex_rnic::soft::cq::CqShared;
use bex_rnic::soft::packet::{self, Aeth, Header, Opcode, Reth, Syndrome};
use bex_rnic::verbs::*;
use proptest::prelude::*;

const OPS: [Opcode; 13] = Opcode::ALL;

#[derive(Debug, Clone)]
struct Pkt {
    op: usize,
    psn_off: i32,
    va_off: i64,
    rkey_ok: bool,
    dma_len: u32,
    payload: usize,
    syndrome: u8,
}

fn pkt() -> impl Strategy<Value = Pkt> {
    (
        0usize..13,
        -200i32..200,
        -100i64..5000,
        any::<bool>(),
        0u32..10_000,
        0usize..3000,
        any::<u8>(),
    )
        .prop_map(|(op, psn_off, va_off, rkey_ok, dma_len, payload, syndrome)| Pkt {
            op,
            psn_off,
            va_off,
            rkey_ok,
            dma_len,
            payload,
            syndrome,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]
    #[test]
    fn hostile_but_well_formed_packets_never_panic(pkts in proptest::collection::vec(pkt(), 1..60)) {
        let local: SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let mut core = NicCore::new(NicConfig::default(), local);
        let pd = core.alloc_pd();
        let cq = Arc::new(CqShared::new(1 << 16).unwrap());
        let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1 };
        let qpn = core.create_qp(pd, cq.clone(), cq.clone(), None, caps).unwrap();
        // Guard bytes around the registered region must never change.
        let mut mem = vec![0xeeu8; 3 * 4096];
        let region = mem.as_mut_ptr() as u64 + 4096;
        // SAFETY: `mem` outlives `core` (dropped last) and is not reallocated.
        let keys = unsafe { core.reg_mr(pd, (region) as *mut u8, 4096, Access::ALL) }.unwrap();
        let peer: SocketAddr = "127.0.0.9:4791".parse().unwrap();
        let remote = QpEndpoint { gid: QpEndpoint::gid_of(peer.ip()), udp_port: 4791, lid: 0, qpn: 77, psn: 1000 };
        core.modify_to_init(qpn, &InitAttrs::default()).unwrap();
        let recv = RecvWr { wr_id: 1, sg_list: SgList::one(Sge { addr: keys.addr, length: 4096, lkey: keys.lkey }) };
        core.post_recv(qpn, &[recv, recv, recv]).unwrap();
        core.modify_to_rtr(qpn, &RtrAttrs { remote, path_mtu: Mtu::Mtu1024, min_rnr_timer: 1 }).unwrap();
        core.modify_to_rts(qpn, &RtsAttrs { sq_psn: 500, timeout: 10, retry_cnt: 3, rnr_retry: 3 }).unwrap();
        let send = SendWr { wr_id: 9, op: SendOp::Send, sg_list: SgList::one(Sge { addr: keys.addr, length: 3000, lkey: keys.lkey }), signaled: true };
        core.post_send(qpn, &[send, send]).unwrap();
        let now = wall_now();
        let mut out = Vec::new();
        while core.poll_transmit(now, &mut out).is_some() {}
        for p in pkts {
            let op = OPS[p.op];
            let base = if op == Opcode::Acknowledge { 500 } else { 1000 };
            let psn = packet::psn::add(base, p.psn_off.rem_euclid(1 << 24) as u32);
            let mut h = Header::new(op, qpn, psn);
            if op.has_reth() {
                let rkey = if p.rkey_ok { keys.rkey } else { keys.rkey ^ 1 };
                h.reth = Some(Reth { va: (keys.addr as i64 + p.va_off) as u64, rkey, dma_len: p.dma_len });
            }
            if op.has_imm() {
                h.imm = Some(5);
            }
            if op == Opcode::Acknowledge {
                let syndrome = Syndrome::from_u8(p.syndrome).unwrap_or(Syndrome::Ack);
                h.aeth = Some(Aeth { syndrome, msn: 0 });
            }
            let payload = if op == Opcode::Acknowledge { vec![] } else { vec![0xab; p.payload] };
            let route = packet::Route { src: peer, dst: local };
            core.handle_packet(now, peer, &packet::encode(&h, &payload, &route));
            while core.poll_transmit(now, &mut out).is_some() {}
        }
        let later = now + std::time::Duration::from_secs(5);
        core.handle_timeout(later);
        while core.poll_transmit(later, &mut out).is_some() {}
        drop(core);
        prop_assert!(mem[..4096].iter().all(|b| *b == 0xee), "wrote below the region");
        prop_assert!(mem[8192..].iter().all(|b| *b == 0xee), "wrote above the region");
    }
}
