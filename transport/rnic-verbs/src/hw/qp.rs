//! RC queue pairs, shared receive queues, and batches of work requests as linked
//! `ibv_send_wr` / `ibv_recv_wr` chains posted with one call (one doorbell).

use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use bex_rnic::verbs::{
    InitAttrs, Mtu, QpEndpoint, QpState, RecvWr, RtrAttrs, RtsAttrs, SendOp, SendWr, MAX_SGE,
};
use bex_rnic::{Error, QpInit, QueuePair, Result, SharedReceiveQueue};
use parking_lot::Mutex;

use super::cq::CqInner;
use super::device::{Context, PdInner, TdInner, VerbsPd};
use super::{errno, os_error, rc_errno, sys, verb_error, zeroed};
use crate::VerbsDevice;

/// Requests chained on the stack; longer batches use a heap buffer (still one post).
const STACK_WRS: usize = 32;
/// The largest 24-bit value (QPNs and PSNs).
const MASK_24: u32 = 0x00ff_ffff;

/// A shared receive queue. Cheap to clone; QPs attached to it keep it alive.
#[derive(Clone, Debug)]
pub struct VerbsSrq {
    pub(crate) inner: Arc<SrqInner>,
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    srq: *mut sys::ibv_srq,
    max_sge: u32,
    pd: Arc<PdInner>,
}

// SAFETY: an SRQ is usable from any thread; `ibv_post_srq_recv` is thread-safe (SRQs are
// never created in a thread domain here).
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_srq`, destroyed once; attached QPs hold an
        // `Arc<SrqInner>` and are destroyed first.
        let rc = unsafe { sys::ibv_destroy_srq(self.srq) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_destroy_srq failed");
        }
    }
}

impl VerbsSrq {
    pub(crate) fn new(pd: &VerbsPd, depth: u32, max_sge: u32) -> Result<VerbsSrq> {
        if depth == 0 || max_sge == 0 {
            return Err(Error::InvalidArgument(format!(
                "SRQ depth {depth} and max_sge {max_sge} must both be positive"
            )));
        }
        let mut init = sys::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: sys::ibv_srq_attr { max_wr: depth, max_sge, srq_limit: 0 },
        };
        // Not `ibv_create_srq_ex`: its inline wrapper's mask logic is unreliable (notes).
        // SAFETY: the PD is live while `pd.inner` is; `init` is a valid init attribute.
        let srq = unsafe { sys::ibv_create_srq(pd.inner.pd, &mut init) };
        if srq.is_null() {
            return Err(verb_error("ibv_create_srq", errno()));
        }
        let inner = SrqInner { srq, max_sge, pd: pd.inner.clone() };
        Ok(VerbsSrq { inner: Arc::new(inner) })
    }
}

impl SharedReceiveQueue for VerbsSrq {
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        let max_sge = self.inner.max_sge as usize;
        post_checked(
            wrs,
            |wr| check_sges(wr.sg_list.as_slice().len(), max_sge),
            |valid| {
                post_chain(valid, |head, bad| {
                    // SAFETY: the SRQ is live; `head` is a well-formed chain that outlives the
                    // call and `bad` a valid out-pointer.
                    unsafe { sys::ibv_post_srq_recv(self.inner.srq, head, bad) }
                })
            },
        )
    }
}

/// A parent domain (PD + thread domain) that one QP was created in.
#[derive(Debug)]
struct ParentDomain(*mut sys::ibv_pd);

impl Drop for ParentDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_parent_domain` (freed with `ibv_dealloc_pd`) and
        // dropped only after the QP created in it was destroyed.
        let rc = unsafe { sys::ibv_dealloc_pd(self.0) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_dealloc_pd(parent domain) failed");
        }
    }
}

/// An RC queue pair. It keeps its PD, CQs, SRQ and thread domain alive.
///
/// A QP in a thread domain must be used by one thread at a time; the boundary trait is
/// `Sync`, so such a QP serializes its posts with an (uncontended, in the intended use)
/// lock, while the provider skips its own.
#[derive(Debug)]
pub struct VerbsQp {
    qp: *mut sys::ibv_qp,
    qpn: u32,
    psn: u32,
    max_send_sge: usize,
    max_recv_sge: usize,
    /// The state after the last successful transition (see [`QueuePair::state`]).
    state: AtomicU8,
    /// Serializes posts on a QP in a thread domain (`None` otherwise).
    post_lock: Option<Mutex<()>>,
    // Drop order matters below: the parent domain goes before the TD and PD it refers to.
    _parent: Option<ParentDomain>,
    _td: Option<Arc<TdInner>>,
    srq: Option<Arc<SrqInner>>,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    _pd: Arc<PdInner>,
    ctx: Arc<Context>,
}

// SAFETY: a QP is usable from any thread. Verbs on a QP outside a thread domain are
// thread-safe; for one inside, every post goes through `post_lock`, which gives the
// one-thread-at-a-time use thread domains require. Transitions (`ibv_modify_qp`) are
// thread-safe in both cases.
unsafe impl Send for VerbsQp {}
// SAFETY: as above.
unsafe impl Sync for VerbsQp {}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_qp`, destroyed once; its CQs, SRQ, PD and parent
        // domain are still alive (fields, dropped after this).
        let rc = unsafe { sys::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::warn!(qpn = self.qpn, errno = rc_errno(rc), "ibv_destroy_qp failed");
        }
    }
}

impl VerbsQp {
    pub(crate) fn new(
        ctx: &Arc<Context>,
        pd: &VerbsPd,
        init: &QpInit<'_, VerbsDevice>,
    ) -> Result<VerbsQp> {
        let send_cq = init.send_cq.inner.clone();
        let recv_cq = init.recv_cq.inner.clone();
        if !Arc::ptr_eq(&send_cq.ctx, ctx) || !Arc::ptr_eq(&recv_cq.ctx, ctx) {
            return Err(Error::InvalidArgument("a CQ belongs to another device".to_owned()));
        }
        let srq = init.srq.map(|s| s.inner.clone());
        if srq.as_ref().is_some_and(|s| !Arc::ptr_eq(&s.pd.ctx, ctx)) {
            return Err(Error::InvalidArgument("the SRQ belongs to another device".to_owned()));
        }
        let td = init.thread_domain.map(|t| t.inner.clone());
        if td.as_ref().is_some_and(|t| !Arc::ptr_eq(&t.ctx, ctx)) {
            return Err(Error::InvalidArgument(
                "the thread domain belongs to another device".to_owned(),
            ));
        }
        let caps = init.caps;
        let max_sge = MAX_SGE as u32;
        if caps.max_send_sge > max_sge || caps.max_recv_sge > max_sge {
            return Err(Error::InvalidArgument(format!(
                "bex work requests carry at most {MAX_SGE} sges (asked {} send, {} recv)",
                caps.max_send_sge, caps.max_recv_sge
            )));
        }

        // A QP in a thread domain is created in a parent domain of (PD, TD), as
        // ibv_alloc_parent_domain(3) describes; it frees that domain when destroyed.
        let parent = match &td {
            None => None,
            Some(td) => {
                let mut attr = sys::ibv_parent_domain_init_attr {
                    pd: pd.inner.pd,
                    td: td.td,
                    comp_mask: 0,
                    alloc: None,
                    free: None,
                    pd_context: ptr::null_mut(),
                };
                // SAFETY: context, PD and TD are live; `attr` is a valid init attribute with
                // no custom allocators.
                let parent = unsafe { sys::ibv_alloc_parent_domain(ctx.ctx, &mut attr) };
                if parent.is_null() {
                    return Err(match errno() {
                        libc::EOPNOTSUPP | libc::ENOSYS | 0 => {
                            Error::Unsupported("parent domains (ibv_alloc_parent_domain)")
                        }
                        e => verb_error("ibv_alloc_parent_domain", e),
                    });
                }
                Some(ParentDomain(parent))
            }
        };

        let mut attr: sys::ibv_qp_init_attr = zeroed();
        attr.send_cq = send_cq.cq;
        attr.recv_cq = recv_cq.cq;
        attr.srq = srq.as_ref().map_or(ptr::null_mut(), |s| s.srq);
        attr.cap.max_send_wr = caps.max_send_wr;
        attr.cap.max_send_sge = caps.max_send_sge;
        if srq.is_none() {
            attr.cap.max_recv_wr = caps.max_recv_wr;
            attr.cap.max_recv_sge = caps.max_recv_sge;
        }
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        let create_pd = parent.as_ref().map_or(pd.inner.pd, |p| p.0);
        // SAFETY: the (parent) PD, CQs and SRQ are live; `attr` is a valid init attribute
        // that the call also writes the granted capabilities into.
        let qp = unsafe { sys::ibv_create_qp(create_pd, &mut attr) };
        if qp.is_null() {
            return Err(verb_error("ibv_create_qp", errno()));
        }
        // SAFETY: `qp` was just created and is live.
        let qpn = unsafe { (*qp).qp_num };
        Ok(VerbsQp {
            qp,
            qpn,
            psn: initial_psn(qpn),
            // The provider may grant more than asked; bex never builds longer lists.
            max_send_sge: caps.max_send_sge as usize,
            max_recv_sge: caps.max_recv_sge as usize,
            state: AtomicU8::new(state_code(QpState::Reset)),
            post_lock: td.as_ref().map(|_| Mutex::new(())),
            _parent: parent,
            _td: td,
            srq,
            _send_cq: send_cq,
            _recv_cq: recv_cq,
            _pd: pd.inner.clone(),
            ctx: ctx.clone(),
        })
    }

    fn cached_state(&self) -> QpState {
        state_of_code(self.state.load(Ordering::Acquire))
    }

    /// Checks the transition against the cached state and applies it.
    fn transition(
        &self,
        from: &[QpState],
        to: QpState,
        mut attr: sys::ibv_qp_attr,
        mask: sys::ibv_qp_attr_mask,
        what: &'static str,
    ) -> Result<()> {
        let state = self.cached_state();
        if !from.is_empty() && !from.contains(&state) {
            return Err(Error::InvalidState { qpn: self.qpn, state, what });
        }
        // SAFETY: the QP is live; `attr` is a valid attribute struct whose fields named by
        // `mask` are set.
        let rc = unsafe { sys::ibv_modify_qp(self.qp, &mut attr, mask.0 as i32) };
        if rc != 0 {
            return Err(verb_error(what, rc_errno(rc)));
        }
        self.state.store(state_code(to), Ordering::Release);
        Ok(())
    }

    /// The hardware code for `mtu`: soft MTUs are rejected; sizes above the port's active
    /// MTU are lowered to it.
    fn path_mtu(&self, mtu: Mtu) -> Result<sys::ibv_mtu::Type> {
        use sys::ibv_mtu as m;
        let code = match mtu {
            Mtu::Mtu256 => m::IBV_MTU_256,
            Mtu::Mtu512 => m::IBV_MTU_512,
            Mtu::Mtu1024 => m::IBV_MTU_1024,
            Mtu::Mtu2048 => m::IBV_MTU_2048,
            Mtu::Mtu4096 => m::IBV_MTU_4096,
            Mtu::Soft(n) => {
                return Err(Error::InvalidArgument(format!(
                    "soft MTU of {n} bytes: hardware path MTUs are 256, 512, 1024, 2048 or 4096"
                )))
            }
        };
        let active = self.ctx.active_mtu;
        if active != 0 && code > active {
            tracing::debug!(
                qpn = self.qpn,
                requested = code,
                active,
                "path MTU lowered to the port's"
            );
            return Ok(active);
        }
        Ok(code)
    }

    /// The address vector that reaches `remote` from this QP's port.
    fn address_vector(&self, remote: &QpEndpoint) -> Result<sys::ibv_ah_attr> {
        let mut ah: sys::ibv_ah_attr = zeroed();
        ah.port_num = self.ctx.port;
        if self.ctx.is_ethernet() {
            // RoCE: routed by GID, so a GRH is mandatory.
            ah.is_global = 1;
            ah.grh.dgid.raw = remote.gid;
            ah.grh.sgid_index = self.ctx.gid_index;
            ah.grh.hop_limit = 64;
        } else {
            if remote.lid == 0 {
                return Err(Error::InvalidArgument(
                    "the peer endpoint has no LID, needed on an InfiniBand port".to_owned(),
                ));
            }
            ah.dlid = remote.lid;
        }
        Ok(ah)
    }

    fn post_guard(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.post_lock.as_ref().map(Mutex::lock)
    }
}

impl QueuePair for VerbsQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The state the hardware reports (`ibv_query_qp`), so an error raised by the NIC is
    /// seen; the cached state of the last transition if the query fails.
    fn state(&self) -> QpState {
        let mut attr: sys::ibv_qp_attr = zeroed();
        let mut init: sys::ibv_qp_init_attr = zeroed();
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
        // SAFETY: the QP is live; both out-structs are valid and writable.
        let rc = unsafe { sys::ibv_query_qp(self.qp, &mut attr, mask, &mut init) };
        if rc != 0 {
            return self.cached_state();
        }
        use sys::ibv_qp_state as s;
        match attr.qp_state {
            s::IBV_QPS_RESET => QpState::Reset,
            s::IBV_QPS_INIT => QpState::Init,
            s::IBV_QPS_RTR => QpState::ReadyToReceive,
            s::IBV_QPS_RTS | s::IBV_QPS_SQD => QpState::ReadyToSend,
            s::IBV_QPS_ERR | s::IBV_QPS_SQE => QpState::Error,
            _ => self.cached_state(),
        }
    }

    fn endpoint(&self) -> QpEndpoint {
        self.ctx.endpoint(self.qpn, self.psn)
    }

    fn to_init(&self, attrs: &InitAttrs) -> Result<()> {
        if attrs.port != self.ctx.port {
            return Err(Error::InvalidArgument(format!(
                "port {}: this device was opened for port {} (VerbsOptions::port)",
                attrs.port, self.ctx.port
            )));
        }
        let mut a: sys::ibv_qp_attr = zeroed();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = attrs.port;
        a.qp_access_flags = attrs.access.bits();
        use sys::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS;
        self.transition(&[QpState::Reset], QpState::Init, a, mask, "ibv_modify_qp(RESET→INIT)")
    }

    fn to_rtr(&self, attrs: &RtrAttrs) -> Result<()> {
        let remote = &attrs.remote;
        if remote.qpn > MASK_24 || remote.psn > MASK_24 {
            return Err(Error::InvalidArgument(format!(
                "peer QPN {:#x} / PSN {:#x} wider than 24 bits",
                remote.qpn, remote.psn
            )));
        }
        if attrs.min_rnr_timer > 31 {
            return Err(Error::InvalidArgument(format!(
                "min_rnr_timer code {} is not in 0..=31",
                attrs.min_rnr_timer
            )));
        }
        let mut a: sys::ibv_qp_attr = zeroed();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.path_mtu(attrs.path_mtu)?;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = attrs.min_rnr_timer;
        a.ah_attr = self.address_vector(remote)?;
        use sys::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.transition(
            &[QpState::Init],
            QpState::ReadyToReceive,
            a,
            mask,
            "ibv_modify_qp(INIT→RTR)",
        )
    }

    fn to_rts(&self, attrs: &RtsAttrs) -> Result<()> {
        if attrs.sq_psn > MASK_24
            || attrs.timeout > 31
            || attrs.retry_cnt > 7
            || attrs.rnr_retry > 7
        {
            return Err(Error::InvalidArgument(format!(
                "RTS attributes out of range (sq_psn < 2^24, timeout <= 31, retry_cnt and \
                 rnr_retry <= 7): {attrs:?}"
            )));
        }
        let mut a: sys::ibv_qp_attr = zeroed();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = attrs.sq_psn;
        a.timeout = attrs.timeout;
        a.retry_cnt = attrs.retry_cnt;
        a.rnr_retry = attrs.rnr_retry;
        a.max_rd_atomic = 1;
        use sys::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.transition(
            &[QpState::ReadyToReceive],
            QpState::ReadyToSend,
            a,
            mask,
            "ibv_modify_qp(RTR→RTS)",
        )
    }

    fn to_error(&self) -> Result<()> {
        let mut a: sys::ibv_qp_attr = zeroed();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE;
        self.transition(&[], QpState::Error, a, mask, "ibv_modify_qp(→ERROR)")
    }

    fn post_send(&self, wrs: &[SendWr]) -> Result<()> {
        let state = self.cached_state();
        if matches!(state, QpState::Reset | QpState::Init | QpState::ReadyToReceive) {
            return Err(Error::InvalidState { qpn: self.qpn, state, what: "post_send" });
        }
        post_checked(
            wrs,
            |wr| check_sges(wr.sg_list.as_slice().len(), self.max_send_sge),
            |valid| {
                post_chain(valid, |head, bad| {
                    let _guard = self.post_guard();
                    // SAFETY: the QP is live; `head` is a well-formed chain that outlives the
                    // call and `bad` a valid out-pointer; in a thread domain, `_guard` makes
                    // this the only thread posting.
                    unsafe { sys::ibv_post_send(self.qp, head, bad) }
                })
            },
        )
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<()> {
        if self.srq.is_some() && !wrs.is_empty() {
            return Err(Error::InvalidRequest {
                index: 0,
                reason: "this QP takes its receives from an SRQ".to_owned(),
            });
        }
        let state = self.cached_state();
        if state == QpState::Reset {
            return Err(Error::InvalidState { qpn: self.qpn, state, what: "post_recv" });
        }
        post_checked(
            wrs,
            |wr| check_sges(wr.sg_list.as_slice().len(), self.max_recv_sge),
            |valid| {
                post_chain(valid, |head, bad| {
                    let _guard = self.post_guard();
                    // SAFETY: as in `post_send`, for the receive queue.
                    unsafe { sys::ibv_post_recv(self.qp, head, bad) }
                })
            },
        )
    }
}

/// A random 24-bit starting PSN (IBA advises against predictable ones).
fn initial_psn(qpn: u32) -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(qpn);
    (h.finish() as u32) & MASK_24
}

fn state_code(state: QpState) -> u8 {
    match state {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::ReadyToReceive => 2,
        QpState::ReadyToSend => 3,
        QpState::Error => 4,
    }
}

fn state_of_code(code: u8) -> QpState {
    match code {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::ReadyToReceive,
        3 => QpState::ReadyToSend,
        _ => QpState::Error,
    }
}

fn check_sges(n: usize, max: usize) -> Option<String> {
    (n > max).then(|| format!("{n} scatter/gather entries; the queue takes at most {max}"))
}

/// Posts the requests before the first invalid one (as one chain) and then reports the
/// invalid one, so "the requests before it were posted" holds as on hardware.
fn post_checked<W>(
    wrs: &[W],
    check: impl Fn(&W) -> Option<String>,
    post: impl FnOnce(&[W]) -> Result<()>,
) -> Result<()> {
    let invalid = wrs.iter().enumerate().find_map(|(i, wr)| check(wr).map(|why| (i, why)));
    let valid = invalid.as_ref().map_or(wrs.len(), |(i, _)| *i);
    if valid > 0 {
        post(&wrs[..valid])?;
    }
    match invalid {
        Some((index, reason)) => Err(Error::InvalidRequest { index, reason }),
        None => Ok(()),
    }
}

/// The error for a failed post: `ENOMEM` is a full queue, anything else a rejected request;
/// `index` is where `bad_wr` pointed, so the requests before it were posted.
fn post_error(what: &str, errno: i32, index: usize) -> Error {
    if errno == libc::ENOMEM {
        Error::QueueFull { posted: index }
    } else {
        Error::InvalidRequest { index, reason: format!("{what}: {}", os_error(errno)) }
    }
}

/// Position of `bad` in the chain stored contiguously from `head` (0 when it is not in it).
fn chain_index<T>(head: *const T, bad: *const T, len: usize) -> usize {
    let size = std::mem::size_of::<T>();
    let offset = (bad as usize).wrapping_sub(head as usize);
    if bad.is_null() || offset % size != 0 || offset / size >= len {
        return 0;
    }
    offset / size
}

/// A work request that posts as one element of a linked `ibv_*_wr` chain.
pub(crate) trait ChainedWr {
    /// The verbs struct it becomes.
    type Raw;
    /// The verb that posts the chain (for errors).
    const VERB: &'static str;
    fn sges(&self) -> &[bex_rnic::verbs::Sge];
    /// The request as `Raw`, linked to `next` with its gather list at `sg_list`.
    fn to_raw(&self, next: *mut Self::Raw, sg_list: *mut sys::ibv_sge, num_sge: i32) -> Self::Raw;
}

impl ChainedWr for SendWr {
    type Raw = sys::ibv_send_wr;
    const VERB: &'static str = "ibv_post_send";

    fn sges(&self) -> &[bex_rnic::verbs::Sge] {
        self.sg_list.as_slice()
    }

    fn to_raw(&self, next: *mut Self::Raw, sg_list: *mut sys::ibv_sge, num_sge: i32) -> Self::Raw {
        let mut out: sys::ibv_send_wr = zeroed();
        out.wr_id = self.wr_id;
        out.next = next;
        out.sg_list = sg_list;
        out.num_sge = num_sge;
        out.send_flags = if self.signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        let (opcode, imm, remote) = match self.op {
            SendOp::Send => (sys::ibv_wr_opcode::IBV_WR_SEND, None, None),
            SendOp::SendWithImm { imm } => {
                (sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, Some(imm), None)
            }
            SendOp::Write { remote_addr, rkey } => {
                (sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, Some((remote_addr, rkey)))
            }
            SendOp::WriteWithImm { remote_addr, rkey, imm } => (
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                Some(imm),
                Some((remote_addr, rkey)),
            ),
        };
        out.opcode = opcode;
        if let Some(imm) = imm {
            // Immediate data travels in network byte order.
            out.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        if let Some((remote_addr, rkey)) = remote {
            out.wr.rdma = sys::rdma_t { remote_addr, rkey };
        }
        out
    }
}

impl ChainedWr for RecvWr {
    type Raw = sys::ibv_recv_wr;
    const VERB: &'static str = "ibv_post_recv";

    fn sges(&self) -> &[bex_rnic::verbs::Sge] {
        self.sg_list.as_slice()
    }

    fn to_raw(&self, next: *mut Self::Raw, sg_list: *mut sys::ibv_sge, num_sge: i32) -> Self::Raw {
        sys::ibv_recv_wr { wr_id: self.wr_id, next, sg_list, num_sge }
    }
}

/// Builds `wrs` as a linked chain in `wr_buf`/`sge_buf` and returns its head. The chain's
/// pointers stay valid while both buffers are neither moved nor reused.
pub(crate) fn link_chain<W: ChainedWr>(
    wrs: &[W],
    wr_buf: &mut [MaybeUninit<W::Raw>],
    sge_buf: &mut [MaybeUninit<sys::ibv_sge>],
) -> *mut W::Raw {
    assert!(
        wr_buf.len() >= wrs.len() && sge_buf.len() >= wrs.len() * MAX_SGE,
        "chain buffers too small"
    );
    let base: *mut W::Raw = wr_buf.as_mut_ptr().cast();
    let sge_base: *mut sys::ibv_sge = sge_buf.as_mut_ptr().cast();
    for (i, wr) in wrs.iter().enumerate() {
        let sges = sge_base.wrapping_add(i * MAX_SGE);
        let list = wr.sges();
        for (j, s) in list.iter().enumerate() {
            let sge = sys::ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey };
            // SAFETY: `i * MAX_SGE + j < sge_buf.len()` (asserted above, `j < MAX_SGE`),
            // and `sge_base` points into that buffer.
            unsafe { sges.add(j).write(sge) };
        }
        let next = if i + 1 < wrs.len() { base.wrapping_add(i + 1) } else { ptr::null_mut() };
        let sg_list = if list.is_empty() { ptr::null_mut() } else { sges };
        let out = wr.to_raw(next, sg_list, list.len() as i32);
        // SAFETY: `i < wr_buf.len()` (asserted above) and `base` points into that buffer.
        unsafe { base.add(i).write(out) };
    }
    base
}

/// Links `wrs` (on the stack when short) and posts them with one call of `post`, which gets
/// the head and the `bad_wr` out-pointer and returns the verb's code.
fn post_chain<W: ChainedWr>(
    wrs: &[W],
    post: impl FnOnce(*mut W::Raw, *mut *mut W::Raw) -> i32,
) -> Result<()> {
    let run = |wr_buf: &mut [MaybeUninit<W::Raw>], sge_buf: &mut [MaybeUninit<sys::ibv_sge>]| {
        let head = link_chain(wrs, wr_buf, sge_buf);
        let mut bad: *mut W::Raw = ptr::null_mut();
        let rc = post(head, &mut bad);
        if rc == 0 {
            return Ok(());
        }
        let e = rc_errno(rc);
        Err(post_error(W::VERB, e, chain_index(head, bad, wrs.len())))
    };
    if wrs.len() <= STACK_WRS {
        let mut wr_buf = [const { MaybeUninit::uninit() }; STACK_WRS];
        let mut sge_buf = [const { MaybeUninit::uninit() }; STACK_WRS * MAX_SGE];
        run(&mut wr_buf, &mut sge_buf)
    } else {
        let mut wr_buf: Vec<_> =
            std::iter::repeat_with(MaybeUninit::uninit).take(wrs.len()).collect();
        let mut sge_buf: Vec<_> =
            std::iter::repeat_with(MaybeUninit::uninit).take(wrs.len() * MAX_SGE).collect();
        run(&mut wr_buf, &mut sge_buf)
    }
}

#[cfg(test)]
mod tests {
    use bex_rnic::verbs::{SgList, Sge};

    use super::*;

    fn sge(n: u32) -> Sge {
        Sge { addr: 0x1000 * u64::from(n), length: n, lkey: 100 + n }
    }

    fn wr(id: u64, op: SendOp, sges: &[Sge], signaled: bool) -> SendWr {
        SendWr { wr_id: id, op, sg_list: SgList::from_slice(sges).unwrap(), signaled }
    }

    #[test]
    fn send_batch_becomes_one_linked_chain() {
        let wrs = [
            wr(1, SendOp::Send, &[sge(1), sge(2)], false),
            wr(2, SendOp::SendWithImm { imm: 0x0102_0304 }, &[], false),
            wr(3, SendOp::Write { remote_addr: 0xabc, rkey: 9 }, &[sge(3)], false),
            wr(4, SendOp::WriteWithImm { remote_addr: 0xdef, rkey: 8, imm: 5 }, &[sge(4)], true),
        ];
        let mut wr_buf = [const { MaybeUninit::uninit() }; 4];
        let mut sge_buf = [const { MaybeUninit::uninit() }; 4 * MAX_SGE];
        let head = link_chain(&wrs, &mut wr_buf, &mut sge_buf);
        let mut seen = Vec::new();
        let mut cur = head;
        while !cur.is_null() {
            // SAFETY: `cur` walks the chain just written into `wr_buf`, which is alive; every
            // `next` is either NULL or the following initialised element.
            let w = unsafe { &*cur };
            let sges = if w.sg_list.is_null() {
                &[][..]
            } else {
                // SAFETY: a non-NULL `sg_list` points at `num_sge` initialised entries of
                // `sge_buf`, which is alive.
                unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) }
            };
            // SAFETY: both union members are u32; the rdma member was written for writes and
            // zeroed otherwise.
            let (imm, rdma) = unsafe { (w.imm_data_invalidated_rkey_union.imm_data, w.wr.rdma) };
            seen.push((
                w.wr_id,
                w.opcode,
                sges.iter().map(|s| (s.addr, s.length, s.lkey)).collect::<Vec<_>>(),
                w.send_flags,
                u32::from_be(imm),
                (rdma.remote_addr, rdma.rkey),
            ));
            cur = w.next;
        }
        let signaled = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        use sys::ibv_wr_opcode as o;
        assert_eq!(
            seen,
            vec![
                (1, o::IBV_WR_SEND, vec![(0x1000, 1, 101), (0x2000, 2, 102)], 0, 0, (0, 0)),
                (2, o::IBV_WR_SEND_WITH_IMM, vec![], 0, 0x0102_0304, (0, 0)),
                (3, o::IBV_WR_RDMA_WRITE, vec![(0x3000, 3, 103)], 0, 0, (0xabc, 9)),
                (4, o::IBV_WR_RDMA_WRITE_WITH_IMM, vec![(0x4000, 4, 104)], signaled, 5, (0xdef, 8)),
            ]
        );
        assert_eq!(chain_index(head, head.wrapping_add(2), wrs.len()), 2);
        assert_eq!(chain_index(head, ptr::null(), wrs.len()), 0);
        assert_eq!(chain_index(head, head.wrapping_add(9), wrs.len()), 0);
    }

    #[test]
    fn recv_batch_becomes_one_linked_chain() {
        let wrs: Vec<RecvWr> =
            (0..40).map(|i| RecvWr { wr_id: i, sg_list: SgList::one(sge(i as u32)) }).collect();
        // Longer than the stack buffer: one heap chain, still posted with one call.
        let mut calls = 0;
        let result = post_chain(&wrs, |head, _bad| {
            calls += 1;
            let mut n = 0;
            let mut cur = head;
            while !cur.is_null() {
                // SAFETY: walks the chain built for this call, alive until it returns.
                let w = unsafe { &*cur };
                assert_eq!(w.wr_id, n);
                assert_eq!(w.num_sge, 1);
                n += 1;
                cur = w.next;
            }
            assert_eq!(n, 40);
            0
        });
        assert!(result.is_ok());
        assert_eq!(calls, 1);
    }

    #[test]
    fn bad_wr_maps_to_queue_full_or_invalid_request() {
        let wrs: Vec<RecvWr> =
            (0..5).map(|i| RecvWr { wr_id: i, sg_list: SgList::one(sge(1)) }).collect();
        let full = post_chain(&wrs, |head, bad| {
            // SAFETY: `bad` is the out-pointer the helper passed; the 3rd element exists.
            unsafe { *bad = head.wrapping_add(3) };
            libc::ENOMEM
        });
        assert!(matches!(full, Err(Error::QueueFull { posted: 3 })), "{full:?}");
        let invalid = post_chain(&wrs, |head, bad| {
            // SAFETY: as above.
            unsafe { *bad = head.wrapping_add(1) };
            libc::EINVAL
        });
        assert!(matches!(invalid, Err(Error::InvalidRequest { index: 1, .. })), "{invalid:?}");
    }

    #[test]
    fn an_invalid_request_posts_the_ones_before_it() {
        let mut posted = 0;
        let r = post_checked(
            &[1, 2, 9, 3],
            |&n| (n > 4).then(|| "too big".to_owned()),
            |valid| {
                posted = valid.len();
                Ok(())
            },
        );
        assert_eq!(posted, 2);
        assert!(matches!(r, Err(Error::InvalidRequest { index: 2, .. })));
    }

    #[test]
    fn psns_are_24_bits_and_unpredictable() {
        let psns: std::collections::HashSet<u32> = (0..100).map(initial_psn).collect();
        assert!(psns.iter().all(|&p| p <= MASK_24));
        // 100 random 24-bit values all differ but with odds of 3 in 10 000; a PSN that
        // followed the QPN (or a constant) would not.
        assert!(psns.len() >= 99, "{} distinct PSNs of 100", psns.len());
        let again: Vec<u32> = (0..100).map(initial_psn).collect();
        assert!((0..100).any(|q| again[q as usize] != initial_psn(q)), "PSNs repeat per QPN");
    }
}
