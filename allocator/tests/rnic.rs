//! The software RNIC moves bytes into bemalloc buffers by their keys, and rejects wrong keys.

use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_rnic::soft::{Fabric, LinkModel, NicConfig, SoftCq, SoftDevice, SoftQp};
use bex_rnic::verbs::*;
use bex_rnic::{CompletionQueue, Device, QpInit, QueuePair, Registrar};

struct End {
    qp: SoftQp,
    cq: SoftCq,
}

fn end(dev: &SoftDevice, pd: &bex_rnic::soft::SoftPd) -> End {
    let cq = dev.create_cq(64).unwrap();
    let caps = QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1 };
    let qp = dev
        .create_qp(pd, &QpInit { send_cq: &cq, recv_cq: &cq, srq: None, thread_domain: None, caps })
        .unwrap();
    End { qp, cq }
}

fn poll_one(cq: &SoftCq) -> Option<WorkCompletion> {
    let mut wc = [WorkCompletion::default(); 1];
    (cq.poll(&mut wc).unwrap() == 1).then_some(wc[0])
}

/// The next completion of `cq`, within 1 s of fabric time.
fn wait_one(f: &Fabric, cq: &SoftCq) -> Option<WorkCompletion> {
    let mut wc = None;
    assert!(f.run_until(
        || {
            wc = poll_one(cq);
            wc.is_some()
        },
        Duration::from_secs(1)
    ));
    wc
}

/// Two devices on a fabric, one pool registered with both (device 0 = requester A, device 1
/// = responder B), and a connected QP pair.
fn setup(seed: u64) -> (Fabric, SoftDevice, SoftDevice, [bex_rnic::soft::SoftPd; 2]) {
    let f = Fabric::new(seed, LinkModel::default());
    let a = f.add_device(NicConfig::default());
    let b = f.add_device(NicConfig::default());
    let pds = [a.alloc_pd().unwrap(), b.alloc_pd().unwrap()];
    (f, a, b, pds)
}

fn write(src: &bemalloc::RegisteredBuf<'_>, len: usize, remote_addr: u64, rkey: u32) -> SendWr {
    SendWr {
        wr_id: 1,
        op: SendOp::Write { remote_addr, rkey },
        sg_list: SgList::one(src.sge(0, 0, len)),
        signaled: true,
    }
}

#[test]
fn the_rnic_writes_into_a_bemalloc_buffer_by_its_rkey_and_rejects_a_wrong_one() {
    let (f, da, db, pds) = setup(7);
    let regs: Vec<Arc<dyn Registrar>> =
        vec![Arc::new(da.registrar(&pds[0])), Arc::new(db.registrar(&pds[1]))];
    let pool = Pool::new(regs).unwrap();
    let (a, b) = (end(&da, &pds[0]), end(&db, &pds[1]));
    let attrs = ConnectAttrs { path_mtu: Mtu::Mtu1024, ..ConnectAttrs::default() };
    a.qp.connect(&b.qp.endpoint(), &attrs).unwrap();
    b.qp.connect(&a.qp.endpoint(), &attrs).unwrap();

    // A 100 KiB message (many packets) from one bemalloc buffer into another, 3 bytes in.
    let len = 100 << 10;
    let mut src = pool.allocate(len).unwrap();
    for (i, x) in src.iter_mut().enumerate() {
        *x = (i * 7 + 1) as u8;
    }
    let dst = pool.allocate(len + 3).unwrap();
    let mr_b = pool.mr_of(dst.as_ptr(), 1).unwrap();
    assert_ne!(src.mr(0).lkey, mr_b.lkey, "each device has its own keys");
    a.qp.post_send(&[write(&src, len, dst.as_ptr() as u64 + 3, mr_b.rkey)]).unwrap();
    let wc = wait_one(&f, &a.cq);
    assert_eq!(wc.unwrap().status, WcStatus::Success, "{wc:?}");
    assert_eq!(&dst[3..], &src[..], "seed={}: the bytes arrived", f.seed());
    assert_eq!(&dst[..3], &[0, 0, 0], "nothing before the target offset");

    // The same WRITE with a wrong rkey is refused by the responder.
    let bad = mr_b.rkey ^ 0x0101_0101;
    a.qp.post_send(&[write(&src, 64, dst.as_ptr() as u64, bad)]).unwrap();
    let wc = wait_one(&f, &a.cq);
    assert_eq!(wc.unwrap().status, WcStatus::RemoteAccessError, "{wc:?}");
    assert_eq!(&dst[3..67], &src[..64], "the refused write changed nothing");
    let _ = poll_one(&b.cq);
}

#[test]
fn a_device_key_does_not_open_memory_of_another_region() {
    // B's key for one block must not reach a buffer in a different block.
    let (f, da, db, pds) = setup(8);
    let pool = Pool::new(vec![Arc::new(db.registrar(&pds[1])) as Arc<dyn Registrar>]).unwrap();
    let src_mem = Pool::new(vec![Arc::new(da.registrar(&pds[0])) as Arc<dyn Registrar>]).unwrap();
    let (a, b) = (end(&da, &pds[0]), end(&db, &pds[1]));
    let attrs = ConnectAttrs { path_mtu: Mtu::Mtu1024, ..ConnectAttrs::default() };
    a.qp.connect(&b.qp.endpoint(), &attrs).unwrap();
    b.qp.connect(&a.qp.endpoint(), &attrs).unwrap();
    let src = src_mem.allocate(256).unwrap();
    let first = pool.allocate(64).unwrap();
    let mr = pool.mr_of(first.as_ptr(), 0).unwrap();
    // One byte past the end of the first block, with the first block's rkey.
    let past = mr.addr + mr.len;
    a.qp.post_send(&[write(&src, 16, past, mr.rkey)]).unwrap();
    let wc = wait_one(&f, &a.cq);
    assert_eq!(wc.unwrap().status, WcStatus::RemoteAccessError, "{wc:?}");
}
