//! Opening the verbs backend: on a host without an RDMA device (or in the default build) it
//! must fail with `Error::NoDevice` naming the cause, never panic; where a device exists, a
//! small loopback between two QPs of that device runs instead (SEND/RECV, WRITE_WITH_IMM and
//! WRITE). The full conformance suite is generic over `Device` and lives elsewhere.

use std::io::Write;

use bex_rnic::Error;
use bex_rnic_verbs::VerbsDevice;

/// Prints past the test harness's output capture, so the skip shows in every `cargo test`
/// (on a line of its own, even when another test's "test … ok" is being printed).
fn visible(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "\n{line}");
}

#[test]
fn open_reports_no_device_or_runs_a_loopback() {
    match VerbsDevice::open(None) {
        Err(Error::NoDevice(reason)) => {
            assert!(!reason.trim().is_empty(), "NoDevice must say why");
            visible(&format!("SKIPPED: verbs conformance — no RDMA device ({reason})"));
        }
        Err(other) => panic!("opening failed with something other than NoDevice: {other}"),
        #[cfg(feature = "verbs")]
        Ok(device) => loopback::run(&device),
        #[cfg(not(feature = "verbs"))]
        Ok(device) => match device {},
    }
}

#[test]
fn an_unknown_device_name_is_no_device() {
    match VerbsDevice::open(Some("bex-no-such-rdma-device")) {
        Err(Error::NoDevice(reason)) => assert!(!reason.trim().is_empty()),
        Err(other) => panic!("expected NoDevice, got {other}"),
        Ok(_) => panic!("opened a device that does not exist"),
    }
}

#[test]
fn the_build_says_whether_it_has_verbs() {
    // `ENABLED` is what tools print; it must agree with what opening a device does: without
    // verbs the reason names the feature, with it a failure is the host's (no device).
    match VerbsDevice::open(None) {
        Err(Error::NoDevice(reason)) => assert_eq!(
            reason.contains("`verbs` feature"),
            !bex_rnic_verbs::ENABLED,
            "ENABLED = {}, reason: {reason}",
            bex_rnic_verbs::ENABLED
        ),
        Err(other) => panic!("expected NoDevice, got {other}"),
        // A device opened: the other test runs a loopback on it.
        #[cfg(feature = "verbs")]
        Ok(_) => {}
        #[cfg(not(feature = "verbs"))]
        Ok(device) => match device {},
    }
}

#[cfg(feature = "verbs")]
mod loopback {
    use std::time::Duration;

    use bex_rnic::verbs::{
        Access, ConnectAttrs, InitAttrs, MrKeys, QpCaps, RecvWr, SendOp, SendWr, SgList, Sge,
        WcOpcode, WcStatus, WorkCompletion,
    };
    use bex_rnic::{CompletionQueue, Device, Error, MemoryRegion, QpInit, QueuePair};
    use bex_rnic_verbs::{VerbsCq, VerbsDevice};

    const LEN: usize = 64;

    /// Waits (bounded) until `n` completions arrived; all must succeed.
    fn completions(cq: &VerbsCq, n: usize) -> Vec<WorkCompletion> {
        let mut got = Vec::new();
        let mut buf = [WorkCompletion::default(); 8];
        for _ in 0..100 {
            let k = cq.wait(&mut buf, Duration::from_millis(50)).expect("waiting on the CQ");
            got.extend_from_slice(&buf[..k]);
            if got.len() >= n {
                break;
            }
        }
        assert_eq!(got.len(), n, "completions: {got:?}");
        for wc in &got {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        got
    }

    fn sge(mr: &MrKeys, offset: usize, len: usize) -> SgList {
        SgList::one(Sge { addr: mr.addr + offset as u64, length: len as u32, lkey: mr.lkey })
    }

    /// Reads bytes the NIC wrote, after their completion was seen.
    fn read(base: *const u8, offset: usize, len: usize) -> Vec<u8> {
        // SAFETY: `[offset, offset + len)` lies inside the live buffer at `base`; the NIC's
        // writes there finished before the completion that precedes this read.
        (0..len).map(|i| unsafe { base.add(offset + i).read_volatile() }).collect()
    }

    pub fn run(device: &VerbsDevice) {
        let caps = device.caps();
        eprintln!("verbs loopback on {caps:?}");
        match device.alloc_td() {
            Ok(_) => assert!(caps.thread_domains),
            Err(Error::Unsupported(_)) => assert!(!caps.thread_domains),
            Err(other) => panic!("alloc_td: {other}"),
        }

        let pd = device.alloc_pd().expect("alloc_pd");
        let cq = device.create_cq(64).expect("create_cq");
        let init = QpInit {
            send_cq: &cq,
            recv_cq: &cq,
            srq: None,
            thread_domain: None,
            caps: QpCaps::default(),
        };
        let a = device.create_qp(&pd, &init).expect("create_qp a");
        let b = device.create_qp(&pd, &init).expect("create_qp b");
        let attrs = ConnectAttrs {
            init: InitAttrs { port: device.port(), ..InitAttrs::default() },
            ..ConnectAttrs::default()
        };
        a.connect(&b.endpoint(), &attrs).expect("connect a→b");
        b.connect(&a.endpoint(), &attrs).expect("connect b→a");

        let mut memory = vec![0u8; 4 * 4096];
        let base = memory.as_mut_ptr();
        // SAFETY: `memory` outlives `mr` (dropped first, at the end of this function) and is
        // only touched through `base` from here on.
        let mr = unsafe { device.reg_mr(&pd, base, memory.len(), Access::ALL) }.expect("reg_mr");
        let keys = mr.keys();
        let pattern: Vec<u8> = (0..LEN as u8).collect();
        // SAFETY: the first LEN bytes of the live buffer; no transfer is in flight yet.
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), base, LEN) };

        // SEND → RECV.
        b.post_recv(&[RecvWr { wr_id: 10, sg_list: sge(&keys, 4096, LEN) }]).expect("post_recv");
        let send =
            SendWr { wr_id: 1, op: SendOp::Send, sg_list: sge(&keys, 0, LEN), signaled: true };
        a.post_send(&[send]).expect("post_send");
        let wcs = completions(&cq, 2);
        let recv = wcs.iter().find(|wc| wc.wr_id == 10).expect("receive completion");
        assert_eq!(
            (recv.opcode, recv.byte_len, recv.qp_num),
            (WcOpcode::Recv, LEN as u32, b.qpn())
        );
        assert_eq!(read(base, 4096, LEN), pattern);

        // WRITE_WITH_IMM consumes a receive and carries the immediate.
        b.post_recv(&[RecvWr { wr_id: 11, sg_list: SgList::new() }]).expect("post_recv");
        let op =
            SendOp::WriteWithImm { remote_addr: keys.addr + 8192, rkey: keys.rkey, imm: 0xabcd };
        a.post_send(&[SendWr { wr_id: 2, op, sg_list: sge(&keys, 0, LEN), signaled: true }])
            .expect("post_send write_imm");
        let wcs = completions(&cq, 2);
        let arrived = wcs.iter().find(|wc| wc.wr_id == 11).expect("write-imm completion");
        assert_eq!((arrived.opcode, arrived.imm), (WcOpcode::RecvRdmaWithImm, Some(0xabcd)));
        assert_eq!(read(base, 8192, LEN), pattern);

        // Plain WRITE, batched behind an unsignaled one: one completion for both.
        let write = |wr_id, offset: u64, signaled| SendWr {
            wr_id,
            op: SendOp::Write { remote_addr: keys.addr + offset, rkey: keys.rkey },
            sg_list: sge(&keys, 0, LEN),
            signaled,
        };
        a.post_send(&[write(3, 12288, false), write(4, 12288 + 1024, true)])
            .expect("post_send write");
        let wcs = completions(&cq, 1);
        assert_eq!((wcs[0].wr_id, wcs[0].opcode), (4, WcOpcode::RdmaWrite));
        assert_eq!(read(base, 12288, LEN), pattern);
        assert_eq!(read(base, 12288 + 1024, LEN), pattern);

        drop((a, b));
        drop(mr);
        drop(memory);
    }
}
