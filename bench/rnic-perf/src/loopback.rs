//! Test-only: an in-process loopback [`Device`] so the generic RNIC benchmarks and their
//! control-channel choreography run for real before the soft RNIC is linked in.
//!
//! Every device on one [`Fabric`] shares a single lock. Work is executed synchronously inside
//! `post_send`: a SEND lands in the peer's first posted receive (or waits in a queue for one,
//! like an RNR retry would), a WRITE is copied into the registered target with its last byte
//! stored last. No loss, no ordering surprises: this checks the benchmark logic, not a NIC.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use bex_rnic::verbs::{
    Access, InitAttrs, MrKeys, QpEndpoint, QpState, RecvWr, RtrAttrs, RtsAttrs, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};
use bex_rnic::{
    CompletionQueue, Device, DeviceCaps, Error, MemoryRegion, QpInit, QueuePair, Result,
    SharedReceiveQueue,
};

struct Qp {
    state: QpState,
    remote: Option<u32>,
    send_cq: usize,
    recv_cq: usize,
    recvs: VecDeque<RecvWr>,
    /// SENDs that arrived before a receive was posted.
    waiting: VecDeque<Vec<u8>>,
}

#[derive(Default)]
struct State {
    qps: HashMap<u32, Qp>,
    mrs: HashMap<u32, MrKeys>,
    cqs: Vec<VecDeque<WorkCompletion>>,
    next_id: u32,
}

/// The shared "wire" of a set of loopback devices.
#[derive(Default)]
pub struct Fabric {
    state: Mutex<State>,
    changed: Condvar,
}

impl Fabric {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn next(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    fn local_bytes(&self, wr: &SendWr) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        for sge in wr.sg_list.as_slice() {
            let mr = self.mrs.get(&sge.lkey).filter(|k| k.covers(sge.addr, sge.length.into()));
            if mr.is_none() {
                return Err(Error::InvalidArgument(format!("bad lkey/sge {sge:?}")));
            }
            let (ptr, len) = (sge.addr as *const u8, sge.length as usize);
            // The sge lies inside a registered region (checked above), which its owner keeps
            // allocated until deregistration; the sender leaves the bytes alone during its post.
            // SAFETY: so `[ptr, ptr + len)` is live, initialized memory nobody writes meanwhile.
            let src = unsafe { std::slice::from_raw_parts(ptr, len) };
            bytes.extend_from_slice(src);
        }
        Ok(bytes)
    }

    /// Copies `bytes` to registered memory at `addr`, the last byte last and atomically (the
    /// benchmark polls it).
    fn place(&self, addr: u64, bytes: &[u8]) {
        let Some((last, head)) = bytes.split_last() else { return };
        // The caller checked that `[addr, addr + bytes.len())` lies in a registered, live
        // region; nobody reads the head bytes concurrently.
        // SAFETY: so the copy is in bounds and race-free, and the last byte is atomic both sides.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), addr as *mut u8, head.len());
            AtomicU8::from_ptr((addr as *mut u8).add(head.len())).store(*last, Ordering::Release);
        }
    }

    fn deliver(&mut self, qpn: u32, recv: RecvWr, bytes: &[u8]) {
        let room = recv.sg_list.total_len();
        let status = if bytes.len() as u64 > room {
            WcStatus::LocalLengthError
        } else {
            let mut at = 0;
            for sge in recv.sg_list.as_slice() {
                let n = (bytes.len() - at).min(sge.length as usize);
                self.place(sge.addr, &bytes[at..at + n]);
                at += n;
            }
            WcStatus::Success
        };
        let cq = self.qps[&qpn].recv_cq;
        self.cqs[cq].push_back(WorkCompletion {
            wr_id: recv.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: bytes.len() as u32,
            imm: None,
            qp_num: qpn,
            vendor_err: 0,
        });
    }
}

/// A loopback device.
pub struct LoopDevice {
    fabric: Arc<Fabric>,
    port: u16,
}

impl LoopDevice {
    /// A device on `fabric`; `port` stands in for its UDP port in endpoints.
    pub fn new(fabric: &Arc<Fabric>, port: u16) -> LoopDevice {
        LoopDevice { fabric: fabric.clone(), port }
    }
}

/// Its completion queue.
pub struct LoopCq {
    fabric: Arc<Fabric>,
    id: usize,
    fd: OwnedFd,
}

impl CompletionQueue for LoopCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut st = self.fabric.lock();
        let q = &mut st.cqs[self.id];
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }
    fn arm(&self) -> Result<()> {
        Ok(())
    }
    fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    fn ack_events(&self) -> Result<()> {
        Ok(())
    }
    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        {
            let st = self.fabric.lock();
            if st.cqs[self.id].is_empty() {
                let _ = self.fabric.changed.wait_timeout(st, timeout);
            }
        }
        self.poll(out)
    }
}

/// Its queue pair.
pub struct LoopQp {
    fabric: Arc<Fabric>,
    qpn: u32,
    port: u16,
}

impl QueuePair for LoopQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }
    fn state(&self) -> QpState {
        self.fabric.lock().qps[&self.qpn].state
    }
    fn endpoint(&self) -> QpEndpoint {
        let gid = QpEndpoint::gid_of([127, 0, 0, 1].into());
        QpEndpoint { gid, udp_port: self.port, lid: 0, qpn: self.qpn, psn: 0 }
    }
    fn to_init(&self, _: &InitAttrs) -> Result<()> {
        self.fabric.lock().qps.get_mut(&self.qpn).expect("live qp").state = QpState::Init;
        Ok(())
    }
    fn to_rtr(&self, attrs: &RtrAttrs) -> Result<()> {
        let mut st = self.fabric.lock();
        let qp = st.qps.get_mut(&self.qpn).expect("live qp");
        qp.state = QpState::ReadyToReceive;
        qp.remote = Some(attrs.remote.qpn);
        Ok(())
    }
    fn to_rts(&self, _: &RtsAttrs) -> Result<()> {
        self.fabric.lock().qps.get_mut(&self.qpn).expect("live qp").state = QpState::ReadyToSend;
        Ok(())
    }
    fn to_error(&self) -> Result<()> {
        self.fabric.lock().qps.get_mut(&self.qpn).expect("live qp").state = QpState::Error;
        Ok(())
    }
    fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        let mut st = self.fabric.lock();
        for (index, wr) in wrs.iter().enumerate() {
            let me = &st.qps[&self.qpn];
            if me.state != QpState::ReadyToSend {
                return Err(Error::InvalidState {
                    qpn: self.qpn,
                    state: me.state,
                    what: "post_send",
                });
            }
            let (peer, send_cq) = (me.remote.expect("connected"), me.send_cq);
            let bytes = st.local_bytes(wr)?;
            let opcode = match wr.op {
                SendOp::Send => {
                    let recv = st.qps.get_mut(&peer).expect("live peer").recvs.pop_front();
                    match recv {
                        Some(r) => st.deliver(peer, r, &bytes),
                        None => st.qps.get_mut(&peer).expect("live peer").waiting.push_back(bytes),
                    }
                    WcOpcode::Send
                }
                SendOp::Write { remote_addr, rkey } => {
                    let ok = st
                        .mrs
                        .get(&rkey)
                        .is_some_and(|k| k.covers(remote_addr, bytes.len() as u64));
                    if !ok {
                        return Err(Error::InvalidRequest { index, reason: "bad rkey".into() });
                    }
                    st.place(remote_addr, &bytes);
                    WcOpcode::RdmaWrite
                }
                _ => return Err(Error::InvalidRequest { index, reason: "unsupported op".into() }),
            };
            if wr.signaled {
                st.cqs[send_cq].push_back(WorkCompletion {
                    wr_id: wr.wr_id,
                    opcode,
                    qp_num: self.qpn,
                    ..WorkCompletion::default()
                });
            }
        }
        self.fabric.changed.notify_all();
        Ok(())
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let mut st = self.fabric.lock();
        for wr in wrs {
            let waiting = st.qps.get_mut(&self.qpn).expect("live qp").waiting.pop_front();
            match waiting {
                Some(bytes) => st.deliver(self.qpn, *wr, &bytes),
                None => st.qps.get_mut(&self.qpn).expect("live qp").recvs.push_back(*wr),
            }
        }
        self.fabric.changed.notify_all();
        Ok(())
    }
}

impl Drop for LoopQp {
    fn drop(&mut self) {
        self.fabric.lock().qps.remove(&self.qpn);
    }
}

/// Its memory region.
pub struct LoopMr {
    fabric: Arc<Fabric>,
    keys: MrKeys,
}

impl MemoryRegion for LoopMr {
    fn keys(&self) -> MrKeys {
        self.keys
    }
}

impl Drop for LoopMr {
    fn drop(&mut self) {
        self.fabric.lock().mrs.remove(&self.keys.rkey);
    }
}

/// Shared receive queues are not modelled.
pub struct NoSrq;

impl SharedReceiveQueue for NoSrq {
    fn post_recv(&self, _: &[RecvWr]) -> Result<()> {
        Err(Error::Unsupported("srq"))
    }
}

impl Device for LoopDevice {
    type Pd = ();
    type Cq = LoopCq;
    type Srq = NoSrq;
    type Qp = LoopQp;
    type Mr = LoopMr;
    type Td = ();

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            name: "loop0".into(),
            thread_domains: false,
            srq: false,
            max_qp_wr: 1024,
            max_cqe: 4096,
            max_msg_size: 8 << 20,
            max_sge: 4,
            soft_mtu: true,
        }
    }
    fn alloc_pd(&self) -> Result<()> {
        Ok(())
    }
    fn alloc_td(&self) -> Result<()> {
        Err(Error::Unsupported("thread domains"))
    }
    fn create_cq(&self, _depth: u32) -> Result<LoopCq> {
        let fd = std::fs::File::open("/dev/null")
            .map_err(|source| Error::Os { what: "open /dev/null", source })?
            .into();
        let mut st = self.fabric.lock();
        st.cqs.push(VecDeque::new());
        Ok(LoopCq { fabric: self.fabric.clone(), id: st.cqs.len() - 1, fd })
    }
    fn create_srq(&self, _: &(), _: u32, _: u32) -> Result<NoSrq> {
        Err(Error::Unsupported("srq"))
    }
    fn create_qp(&self, _: &(), init: &QpInit<'_, Self>) -> Result<LoopQp> {
        let mut st = self.fabric.lock();
        let qpn = st.next();
        let qp = Qp {
            state: QpState::Reset,
            remote: None,
            send_cq: init.send_cq.id,
            recv_cq: init.recv_cq.id,
            recvs: VecDeque::new(),
            waiting: VecDeque::new(),
        };
        st.qps.insert(qpn, qp);
        Ok(LoopQp { fabric: self.fabric.clone(), qpn, port: self.port })
    }
    unsafe fn reg_mr(&self, _: &(), addr: *mut u8, len: usize, _: Access) -> Result<LoopMr> {
        let mut st = self.fabric.lock();
        let key = st.next();
        let keys = MrKeys { addr: addr as u64, len: len as u64, lkey: key, rkey: key };
        st.mrs.insert(key, keys);
        Ok(LoopMr { fabric: self.fabric.clone(), keys })
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::control::{Control, Msg};
    use crate::rdma::{client_session, server_session};
    use crate::report::{JobResult, Measured, Outcome};
    use crate::spec::{JobSpec, Knobs, TestKind};
    use bex_bench::clock::Clock;

    fn spec(test: TestKind, size: u32) -> JobSpec {
        JobSpec {
            test,
            size,
            mtu: Some(4096),
            iters: 50,
            reps: 3,
            knobs: Knobs { warmup: 5, window: 16, batch: 4, signal_every: 8, spin_polls: 10 },
        }
    }

    /// Runs `jobs` between a client and a server thread, each with its own loopback device,
    /// over a real TCP control channel.
    fn run_pair(jobs: &[JobSpec]) -> Vec<JobResult> {
        let fabric = Arc::new(Fabric::default());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server_dev = LoopDevice::new(&fabric, 1);
        let server = std::thread::spawn(move || {
            let mut ctrl = Control::new(listener.accept().unwrap().0).unwrap();
            assert_eq!(ctrl.recv().unwrap(), Msg::RdmaOpen);
            server_session(&server_dev, &mut ctrl, Clock)
        });
        let client_dev = LoopDevice::new(&fabric, 2);
        let mut ctrl = Control::new(TcpStream::connect(addr).unwrap()).unwrap();
        let mut results = Vec::new();
        client_session(&client_dev, &mut ctrl, jobs, Clock, &mut |r| results.push(r)).unwrap();
        server.join().unwrap().unwrap();
        results
    }

    #[test]
    fn every_rnic_test_runs_end_to_end() {
        let mut jobs = Vec::new();
        for test in [TestKind::SendLat, TestKind::WriteLat, TestKind::SendBw, TestKind::WriteBw] {
            for size in [1, 64, 5000] {
                jobs.push(spec(test, size));
            }
        }
        let results = run_pair(&jobs);
        assert_eq!(results.len(), jobs.len());
        for r in &results {
            match &r.outcome {
                Outcome::Measured(Measured::Latency { summary, .. }) => {
                    assert!(
                        r.spec.test.is_rdma() && r.spec.test.baseline() == Some(TestKind::UdpLat)
                    );
                    assert_eq!(summary.count, 50, "{r:?}");
                    assert!(summary.p50_us > 0.0 && summary.p99_us >= summary.p50_us, "{r:?}");
                }
                Outcome::Measured(Measured::Bandwidth { summary, reps }) => {
                    assert_eq!(reps.len(), 3, "{r:?}");
                    assert!(reps.iter().all(|x| x.bytes == 50 * u64::from(r.spec.size)), "{r:?}");
                    assert!(summary.median_gbps > 0.0, "{r:?}");
                }
                o => panic!("{} {} B: {o:?}", r.spec.test, r.spec.size),
            }
        }
    }

    #[test]
    fn odd_windows_batches_and_signal_intervals_do_not_stall() {
        let mut jobs = Vec::new();
        for (window, batch, every) in [(5, 3, 4), (1, 1, 1), (7, 7, 7), (16, 1, 16)] {
            for test in [TestKind::SendBw, TestKind::WriteBw] {
                let base = spec(test, 128);
                let knobs = Knobs { window, batch, signal_every: every, ..base.knobs };
                jobs.push(JobSpec { iters: 37, knobs, ..base });
            }
        }
        for r in run_pair(&jobs) {
            assert!(matches!(r.outcome, Outcome::Measured(Measured::Bandwidth { .. })), "{r:?}");
        }
    }

    #[test]
    fn a_job_the_device_refuses_fails_alone() {
        let jobs = [
            {
                let base = spec(TestKind::WriteBw, 64);
                JobSpec { knobs: Knobs { window: 4096, ..base.knobs }, ..base }
            },
            spec(TestKind::SendLat, 64),
        ];
        let results = run_pair(&jobs);
        match &results[0].outcome {
            Outcome::Failed(e) => assert!(e.contains("queue depth"), "{e}"),
            o => panic!("{o:?}"),
        }
        assert!(
            matches!(results[1].outcome, Outcome::Measured(Measured::Latency { .. })),
            "{:?}",
            results[1]
        );
    }
}
