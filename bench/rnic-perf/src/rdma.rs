//! The RNIC benchmarks, generic over [`bex_rnic::Device`], with perftest's semantics:
//!
//! - `send_lat`: ping-pong of SENDs; each side waits for the receive completion, re-posts the
//!   receive and answers with a SEND.
//! - `write_lat`: ping-pong of WRITEs; each side polls the last byte of the buffer the peer
//!   writes into until it holds the round's tag, then writes the same tag back.
//! - `send_bw` / `write_bw`: the client streams messages with at most `window` outstanding
//!   work requests, posted `batch` per call, every `signal_every`-th signaled; time runs from
//!   the first post to the last completion. The `send_bw` server keeps its receive queue full.
//!
//! A job runs in steps over the control channel: the client opens its resources and sends
//! `Job`; the server opens its own and answers `Ready` (or `Failed`, which fails only this
//! job); both swap QP endpoints ([`bex_rnic::bootstrap::exchange`]) and buffer keys and
//! connect; the server posts its receives and answers `Ready` again; the client runs, then
//! sends `Finish` and gets `Done`. A failure after the first `Ready` ends the session.

use bex_bench::Failure;
use std::time::Duration;

use bex_rnic::bootstrap;
use bex_rnic::verbs::{
    Access, ConnectAttrs, Mtu, QpCaps, RecvWr, SendOp, SendWr, SgList, WcOpcode, WorkCompletion,
};
use bex_rnic::{CompletionQueue, Device, QpInit, QueuePair};

use crate::backend::DeviceUser;
use crate::baseline::{bandwidth_outcome, latency_outcome};
use crate::control::{unexpected, Control, Msg, Replies};
use crate::error::{PerfError, Result};
use crate::mem::Registered;
use crate::report::{JobResult, Outcome};
use crate::spec::{JobSpec, TestKind};
use bex_bench::clock::Clock;
use bex_bench::stats::{BwRep, LatencyRecorder};

/// One wait for a completion or a memory change longer than this fails the job.
pub const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// A blocking wait on a completion queue's fd lasts at most this before the deadline is
/// checked again.
const BLOCK_SLICE: Duration = Duration::from_millis(10);
/// Receive-queue depth of the latency tests (one message is in flight at a time).
const LAT_RQ_DEPTH: u32 = 16;
/// Smallest receive-queue depth of `send_bw`'s receiver.
const BW_MIN_RQ_DEPTH: u32 = 64;

/// How to wait: spin on the queue `spin` times, then block on its fd (the notes' advice for
/// two processes on two cores), failing after `timeout`.
#[derive(Clone, Copy, Debug)]
pub struct Poll {
    clock: Clock,
    spin: u32,
    timeout: Duration,
}

impl Poll {
    /// A waiter that spins `spin` polls before blocking.
    pub fn new(clock: Clock, spin: u32, timeout: Duration) -> Poll {
        Poll { clock, spin, timeout }
    }

    /// Waits until `cq` yields at least one completion; returns how many were written.
    pub fn wait<C: CompletionQueue>(
        &self,
        cq: &C,
        out: &mut [WorkCompletion],
        what: &'static str,
    ) -> Result<usize> {
        for _ in 0..self.spin {
            let n = cq.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            std::hint::spin_loop();
        }
        let deadline = self.clock.deadline(self.timeout);
        loop {
            let n = cq.wait(out, BLOCK_SLICE)?;
            if n > 0 {
                return Ok(n);
            }
            if self.clock.expired(deadline) {
                return Err(PerfError::timeout(what, self.timeout));
            }
        }
    }

    /// Waits until `ready()` holds. Memory has no fd to block on: after `spin` checks, each
    /// further check yields the CPU (the device's threads need it on two cores).
    pub fn until(&self, mut ready: impl FnMut() -> bool, what: &'static str) -> Result<()> {
        let mut checks = 0u64;
        let mut deadline = None;
        loop {
            if ready() {
                return Ok(());
            }
            checks += 1;
            if checks <= u64::from(self.spin) {
                std::hint::spin_loop();
                continue;
            }
            std::thread::yield_now();
            if checks % 256 == 0 {
                let d = *deadline.get_or_insert_with(|| self.clock.deadline(self.timeout));
                if self.clock.expired(d) {
                    return Err(PerfError::timeout(what, self.timeout));
                }
            }
        }
    }
}

fn check(wc: &WorkCompletion) -> Result<()> {
    if wc.status.is_success() {
        Ok(())
    } else {
        Err(PerfError::Completion { wr_id: wc.wr_id, opcode: wc.opcode, status: wc.status })
    }
}

fn check_recv(wc: &WorkCompletion, size: u32) -> Result<()> {
    check(wc)?;
    if wc.opcode != WcOpcode::Recv {
        return Err(PerfError::check(format!(
            "expected a receive completion, got {:?}",
            wc.opcode
        )));
    }
    if wc.byte_len != size {
        return Err(PerfError::check(format!("received {} bytes, sent {size}", wc.byte_len)));
    }
    Ok(())
}

/// The peer's buffer, as told over the control channel.
#[derive(Clone, Copy, Debug, Default)]
struct RemoteBuf {
    addr: u64,
    rkey: u32,
    len: u64,
}

/// One side of a job's connection. Fields drop in order: the QP before the memory it uses,
/// the memory before the protection domain.
struct Conn<D: Device> {
    qp: D::Qp,
    /// What this side sends or writes from.
    local: Registered<D>,
    /// What this side receives into, or the peer writes into.
    target: Registered<D>,
    send_cq: D::Cq,
    recv_cq: D::Cq,
    _pd: D::Pd,
    peer: RemoteBuf,
    sq_depth: u32,
    rq_depth: u32,
    recvs_posted: u64,
}

impl<D: Device> Conn<D> {
    /// Opens this side's resources for `spec`, checking it against the device's limits.
    fn open(dev: &D, spec: &JobSpec) -> Result<Conn<D>> {
        let caps = dev.caps();
        if u64::from(spec.size) > caps.max_msg_size {
            return Err(PerfError::usage(format!(
                "{} B exceeds {}'s largest message ({} B)",
                spec.size, caps.name, caps.max_msg_size
            )));
        }
        if let Some(Mtu::Soft(_)) = spec.mtu.and_then(Mtu::from_bytes) {
            if !caps.soft_mtu {
                return Err(PerfError::usage(format!("{} does not accept a soft MTU", caps.name)));
            }
        }
        if spec.knobs.window > caps.max_qp_wr {
            return Err(PerfError::usage(format!(
                "--window {} exceeds {}'s queue depth {}",
                spec.knobs.window, caps.name, caps.max_qp_wr
            )));
        }
        let sq_depth = spec.knobs.window.max(1);
        let rq_depth = match spec.test {
            TestKind::SendBw => spec.knobs.window.saturating_mul(2).max(BW_MIN_RQ_DEPTH),
            _ => LAT_RQ_DEPTH,
        }
        .min(caps.max_qp_wr);
        let pd = dev.alloc_pd()?;
        let send_cq = dev.create_cq(sq_depth.min(caps.max_cqe))?;
        let recv_cq = dev.create_cq(rq_depth.min(caps.max_cqe))?;
        let qp = dev.create_qp(
            &pd,
            &QpInit {
                send_cq: &send_cq,
                recv_cq: &recv_cq,
                srq: None,
                thread_domain: None,
                caps: QpCaps {
                    max_send_wr: sq_depth,
                    max_recv_wr: rq_depth,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                },
            },
        )?;
        let local = Registered::new(dev, &pd, spec.size as usize, Access::ALL)?;
        let target = Registered::new(dev, &pd, spec.size as usize, Access::ALL)?;
        Ok(Conn {
            qp,
            local,
            target,
            send_cq,
            recv_cq,
            _pd: pd,
            peer: RemoteBuf::default(),
            sq_depth,
            rq_depth,
            recvs_posted: 0,
        })
    }

    /// Swaps endpoints and buffer keys with the peer and connects the QP.
    fn link(&mut self, ctrl: &mut Control, spec: &JobSpec) -> Result<()> {
        let remote = bootstrap::exchange(ctrl.stream(), &self.qp.endpoint())?;
        let k = self.target.keys();
        ctrl.send(&Msg::Buffer { addr: k.addr, rkey: k.rkey, len: k.len })?;
        self.peer = match ctrl.recv_ok()? {
            Msg::Buffer { addr, rkey, len } => RemoteBuf { addr, rkey, len },
            m => return Err(unexpected("buffer", &m)),
        };
        if self.peer.len < u64::from(spec.size) {
            return Err(PerfError::check(format!(
                "peer buffer of {} B is smaller than the {} B message",
                self.peer.len, spec.size
            )));
        }
        let mtu = spec.mtu.unwrap_or(4096);
        let path_mtu = Mtu::from_bytes(mtu)
            .ok_or_else(|| PerfError::usage(format!("MTU {mtu} is not valid")))?;
        self.qp.connect(&remote, &ConnectAttrs { path_mtu, ..ConnectAttrs::default() })?;
        Ok(())
    }

    /// Posts receives until the queue is full or `total` have been posted in this job.
    fn fill_receives(&mut self, spec: &JobSpec, total: u64, room: u32) -> Result<()> {
        let n = u64::from(room).min(total - self.recvs_posted);
        if n == 0 {
            return Ok(());
        }
        let sg_list = SgList::one(self.target.sge(spec.size));
        let wrs: Vec<RecvWr> =
            (0..n).map(|i| RecvWr { wr_id: self.recvs_posted + i, sg_list }).collect();
        self.qp.post_recv(&wrs)?;
        self.recvs_posted += n;
        Ok(())
    }

    fn send_wr(&self, spec: &JobSpec, wr_id: u64, op: SendOp, signaled: bool) -> SendWr {
        SendWr { wr_id, op, sg_list: SgList::one(self.local.sge(spec.size)), signaled }
    }

    fn write_op(&self) -> SendOp {
        SendOp::Write { remote_addr: self.peer.addr, rkey: self.peer.rkey }
    }
}

/// Send-queue slots of the ping-pong tests, where every send is signaled.
struct SendSlots {
    outstanding: u32,
    depth: u32,
    wcs: [WorkCompletion; 16],
}

impl SendSlots {
    fn new(depth: u32) -> SendSlots {
        SendSlots { outstanding: 0, depth, wcs: [WorkCompletion::default(); 16] }
    }

    fn retire(&mut self, n: usize) -> Result<()> {
        for wc in &self.wcs[..n] {
            check(wc)?;
        }
        self.outstanding = self.outstanding.saturating_sub(n as u32);
        Ok(())
    }

    /// Retires whatever send completions are there, without waiting.
    fn reap<C: CompletionQueue>(&mut self, cq: &C) -> Result<()> {
        loop {
            let n = cq.poll(&mut self.wcs)?;
            self.retire(n)?;
            if n < self.wcs.len() {
                return Ok(());
            }
        }
    }

    /// Makes sure one more send fits in the queue.
    fn make_room<C: CompletionQueue>(&mut self, cq: &C, poll: &Poll) -> Result<()> {
        self.reap(cq)?;
        while self.outstanding >= self.depth {
            let n = poll.wait(cq, &mut self.wcs, "a send completion")?;
            self.retire(n)?;
        }
        Ok(())
    }

    /// Waits for every outstanding send.
    fn drain<C: CompletionQueue>(&mut self, cq: &C, poll: &Poll) -> Result<()> {
        while self.outstanding > 0 {
            let n = poll.wait(cq, &mut self.wcs, "the last send completions")?;
            self.retire(n)?;
        }
        Ok(())
    }
}

/// The tag of ping-pong round `i` in `write_lat`: never 0 (the buffer's initial value) and
/// different from the previous round's.
fn round_tag(i: u64) -> u8 {
    (i % 255) as u8 + 1
}

// ---- ping-pong -----------------------------------------------------------------------------

/// One ping-pong side. The client (`initiator`) sends first and times each round trip.
fn ping_pong<D: Device>(
    c: &mut Conn<D>,
    spec: &JobSpec,
    poll: &Poll,
    clock: Clock,
    initiator: bool,
) -> Result<LatencyRecorder> {
    let total = u64::from(spec.knobs.warmup) + u64::from(spec.iters);
    let last = spec.size as usize - 1;
    let mut slots = SendSlots::new(c.sq_depth);
    let mut rec = LatencyRecorder::new();
    let mut wc = [WorkCompletion::default(); 1];
    let write = spec.test == TestKind::WriteLat;
    let op = if write { c.write_op() } else { SendOp::Send };
    for i in 0..total {
        let tag = round_tag(i);
        // Wait for the peer's message (the initiator waits after sending, below).
        let wait_peer = |c: &mut Conn<D>, wc: &mut [WorkCompletion; 1]| -> Result<()> {
            if write {
                let target = c.target.buf();
                let mut scratch = [WorkCompletion::default(); 1];
                // Polling the (empty) receive CQ as well drives a software RNIC from this
                // thread, as a busy-polling consumer does; on hardware it is a cheap no-op.
                poll.until(
                    || {
                        target.load(last) == tag
                            || (c.recv_cq.poll(&mut scratch).is_ok() && target.load(last) == tag)
                    },
                    "the peer's WRITE to land",
                )
            } else {
                poll.wait(&c.recv_cq, wc, "a receive completion")?;
                check_recv(&wc[0], spec.size)?;
                c.fill_receives(spec, total, 1)
            }
        };
        if !initiator {
            wait_peer(c, &mut wc)?;
        }
        if write {
            c.local.buf().store(last, tag);
        }
        slots.make_room(&c.send_cq, poll)?;
        let t0 = clock.now();
        c.qp.post_send(&[c.send_wr(spec, i, op, true)])?;
        slots.outstanding += 1;
        if initiator {
            wait_peer(c, &mut wc)?;
            let rtt = clock.now() - t0;
            if i >= u64::from(spec.knobs.warmup) {
                rec.record(rtt);
            }
        }
        slots.reap(&c.send_cq)?;
    }
    slots.drain(&c.send_cq, poll)?;
    Ok(rec)
}

// ---- streaming -----------------------------------------------------------------------------

/// Streams `n` messages: batches of posts within the window, every `signal_every`-th and the
/// last one signaled; returns when the last has completed.
fn stream<D: Device>(c: &Conn<D>, spec: &JobSpec, n: u64, poll: &Poll) -> Result<()> {
    let window = u64::from(spec.knobs.window.min(c.sq_depth));
    let batch = u64::from(spec.knobs.batch.max(1));
    let every = u64::from(spec.knobs.signal_every.max(1));
    let op = if spec.test == TestKind::WriteBw { c.write_op() } else { SendOp::Send };
    let mut wrs = Vec::with_capacity(batch as usize);
    let mut wcs = [WorkCompletion::default(); 32];
    let (mut posted, mut done) = (0u64, 0u64);
    while done < n {
        while posted < n && posted - done < window {
            let k = (n - posted).min(window - (posted - done)).min(batch);
            wrs.clear();
            wrs.extend(
                (posted..posted + k)
                    .map(|id| c.send_wr(spec, id, op, (id + 1) % every == 0 || id + 1 == n)),
            );
            match c.qp.post_send(&wrs) {
                Ok(()) => posted += k,
                Err(bex_rnic::Error::QueueFull { posted: p }) => {
                    posted += p as u64;
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let got = poll.wait(&c.send_cq, &mut wcs, "send completions")?;
        for wc in &wcs[..got] {
            check(wc)?;
            // A signaled completion retires every earlier unsignaled request too.
            done = done.max(wc.wr_id + 1);
        }
    }
    Ok(())
}

fn bw_client<D: Device>(c: &Conn<D>, spec: &JobSpec, poll: &Poll, clock: Clock) -> Result<Outcome> {
    if spec.knobs.warmup > 0 {
        stream(c, spec, u64::from(spec.knobs.warmup), poll)?;
    }
    let mut reps = Vec::with_capacity(spec.reps as usize);
    for _ in 0..spec.reps {
        let t0 = clock.now();
        stream(c, spec, u64::from(spec.iters), poll)?;
        reps.push(BwRep::new(spec.size, u64::from(spec.iters), clock.now() - t0));
    }
    bandwidth_outcome(reps)
}

/// `send_bw`'s receiver: counts every message, keeping the receive queue full.
fn send_bw_server<D: Device>(c: &mut Conn<D>, spec: &JobSpec, poll: &Poll) -> Result<u64> {
    let total = spec.total_messages();
    let mut wcs = [WorkCompletion::default(); 32];
    let mut got = 0u64;
    while got < total {
        let n = poll.wait(&c.recv_cq, &mut wcs, "receive completions")?;
        for wc in &wcs[..n] {
            check_recv(wc, spec.size)?;
        }
        got += n as u64;
        c.fill_receives(spec, total, n as u32)?;
    }
    Ok(got)
}

// ---- jobs and sessions ---------------------------------------------------------------------

/// How a client job failed: whether the control session can go on.
struct JobFailure {
    error: PerfError,
    session_intact: bool,
}

fn client_job<D: Device>(
    dev: &D,
    ctrl: &mut Control,
    spec: &JobSpec,
    clock: Clock,
) -> Result<Outcome, JobFailure> {
    let intact = |error| JobFailure { error, session_intact: true };
    let broken = |error| JobFailure { error, session_intact: false };
    let mut c = Conn::open(dev, spec).map_err(intact)?;
    ctrl.send(&Msg::Job { spec: *spec }).map_err(|e| broken(e.into()))?;
    match ctrl.recv().map_err(|e| broken(e.into()))? {
        Msg::Ready { .. } => {}
        Msg::Failed { message } => return Err(intact(PerfError::remote(message))),
        m => return Err(broken(unexpected("ready", &m))),
    }
    let mut run = || -> Result<Outcome> {
        c.link(ctrl, spec)?;
        let poll = Poll::new(clock, spec.knobs.spin_polls, OP_TIMEOUT);
        let total = u64::from(spec.knobs.warmup) + u64::from(spec.iters);
        if spec.test == TestKind::SendLat {
            let rq = c.rq_depth;
            c.fill_receives(spec, total, rq)?;
        }
        ctrl.expect_ready()?;
        let outcome = match spec.test {
            TestKind::SendLat | TestKind::WriteLat => {
                latency_outcome(&ping_pong(&mut c, spec, &poll, clock, true)?, 0)?
            }
            _ => bw_client(&c, spec, &poll, clock)?,
        };
        ctrl.send(&Msg::Finish)?;
        let received = ctrl.expect_done()?;
        if spec.test == TestKind::SendBw && received != spec.total_messages() {
            return Err(PerfError::check(format!(
                "server received {received} of {} messages",
                spec.total_messages()
            )));
        }
        Ok(outcome)
    };
    run().map_err(broken)
}

fn server_job<D: Device>(dev: &D, ctrl: &mut Control, spec: &JobSpec, clock: Clock) -> Result<()> {
    let mut c = match Conn::open(dev, spec) {
        Ok(c) => c,
        // Only this job fails; the client goes on with the next one.
        Err(e) => return Ok(ctrl.send(&Msg::Failed { message: format!("server: {e}") })?),
    };
    ctrl.send(&Msg::Ready { data_port: None })?;
    let mut run = || -> Result<u64> {
        c.link(ctrl, spec)?;
        let poll = Poll::new(clock, spec.knobs.spin_polls, OP_TIMEOUT);
        let (total, rq) = (spec.total_messages(), c.rq_depth);
        if matches!(spec.test, TestKind::SendLat | TestKind::SendBw) {
            c.fill_receives(spec, total, rq)?;
        }
        ctrl.send(&Msg::Ready { data_port: None })?;
        let received = match spec.test {
            TestKind::SendLat | TestKind::WriteLat => {
                ping_pong(&mut c, spec, &poll, clock, false)?;
                total
            }
            TestKind::SendBw => send_bw_server(&mut c, spec, &poll)?,
            // WRITEs need nothing from the target side.
            _ => 0,
        };
        ctrl.expect_finish()?;
        Ok(received)
    };
    match run() {
        Ok(received) => Ok(ctrl.send(&Msg::Done { received })?),
        Err(e) => {
            let _ = ctrl.send(&Msg::Failed { message: format!("server: {e}") });
            Err(e)
        }
    }
}

/// The client's series of RNIC jobs on `dev`. Pushes one result per job; `Err` means the
/// control session broke and the caller must skip what is left.
pub fn client_session<D: Device>(
    dev: &D,
    ctrl: &mut Control,
    jobs: &[JobSpec],
    clock: Clock,
    on_result: &mut dyn FnMut(JobResult),
) -> Result<()> {
    ctrl.send(&Msg::RdmaOpen)?;
    match ctrl.recv()? {
        Msg::Ready { .. } => {}
        Msg::Failed { message } => {
            for spec in jobs {
                let why = format!("server could not open its RNIC: {message}");
                on_result(JobResult { spec: *spec, outcome: Outcome::Failed(why) });
            }
            return Ok(());
        }
        m => return Err(unexpected("ready", &m)),
    }
    for spec in jobs {
        match client_job(dev, ctrl, spec, clock) {
            Ok(outcome) => on_result(JobResult { spec: *spec, outcome }),
            Err(f) => {
                on_result(JobResult { spec: *spec, outcome: Outcome::Failed(f.error.to_string()) });
                if !f.session_intact {
                    return Err(f.error);
                }
            }
        }
    }
    Ok(ctrl.send(&Msg::RdmaClose)?)
}

/// The server's side of a series of RNIC jobs on `dev`, after `RdmaOpen`, until `RdmaClose`.
pub fn server_session<D: Device>(dev: &D, ctrl: &mut Control, clock: Clock) -> Result<()> {
    ctrl.send(&Msg::Ready { data_port: None })?;
    loop {
        match ctrl.recv()? {
            Msg::Job { spec } if spec.test.is_rdma() => server_job(dev, ctrl, &spec, clock)?,
            Msg::RdmaClose => return Ok(()),
            m => return Err(unexpected("an RNIC job or rdma_close", &m)),
        }
    }
}

/// [`client_session`] as a [`DeviceUser`].
pub struct ClientSession<'a> {
    /// The control channel.
    pub ctrl: &'a mut Control,
    /// The RNIC jobs.
    pub jobs: &'a [JobSpec],
    /// The clock.
    pub clock: Clock,
    /// Receives each result.
    pub on_result: &'a mut dyn FnMut(JobResult),
}

impl std::fmt::Debug for ClientSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSession").field("jobs", &self.jobs.len()).finish_non_exhaustive()
    }
}

impl DeviceUser for ClientSession<'_> {
    type Output = Result<()>;
    fn use_device<D: Device>(self, dev: &D) -> Result<()> {
        client_session(dev, self.ctrl, self.jobs, self.clock, self.on_result)
    }
}

/// [`server_session`] as a [`DeviceUser`].
#[derive(Debug)]
pub struct ServerSession<'a> {
    /// The control channel.
    pub ctrl: &'a mut Control,
    /// The clock.
    pub clock: Clock,
}

impl DeviceUser for ServerSession<'_> {
    type Output = Result<()>;
    fn use_device<D: Device>(self, dev: &D) -> Result<()> {
        server_session(dev, self.ctrl, self.clock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_tags_change_every_round_and_are_never_zero() {
        for i in 0..2000u64 {
            assert_ne!(round_tag(i), 0);
            assert_ne!(round_tag(i), round_tag(i + 1));
        }
    }
}
