//! Completion queues with a private completion channel, and the `ibv_wc` → [`WorkCompletion`]
//! mapping.

use std::os::fd::BorrowedFd;
use std::ptr;
use std::sync::Arc;

use bex_rnic::verbs::{WcOpcode, WcStatus, WorkCompletion};
use bex_rnic::{CompletionQueue, Error, Result};

use super::device::Context;
use super::{errno, os_error, rc_errno, sys, verb_error};

/// Completions moved per `ibv_poll_cq` call.
const POLL_CHUNK: usize = 16;

/// A completion queue with its own completion channel: [`CompletionQueue::fd`] is the
/// channel's (non-blocking) fd, [`CompletionQueue::arm`] is `ibv_req_notify_cq`, and
/// [`CompletionQueue::ack_events`] drains the channel with `ibv_get_cq_event` and acks what it
/// got with `ibv_ack_cq_events`. Cheap to clone; QPs keep their CQs alive.
#[derive(Clone, Debug)]
pub struct VerbsCq {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    /// NULL only while construction is unfinished.
    pub(crate) cq: *mut sys::ibv_cq,
    channel: *mut sys::ibv_comp_channel,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: CQs and completion channels are usable from any thread; `ibv_poll_cq`,
// `ibv_req_notify_cq`, `ibv_get_cq_event` and `ibv_ack_cq_events` are thread-safe for a CQ
// that is not in a thread domain (ours never is: `create_cq` takes none).
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if !self.cq.is_null() {
            // SAFETY: created by `ibv_create_cq`, destroyed once; QPs using it hold an
            // `Arc<CqInner>`, so none is left, and `ack_events` acked every event it got.
            let rc = unsafe { sys::ibv_destroy_cq(self.cq) };
            if rc != 0 {
                tracing::warn!(errno = rc_errno(rc), "ibv_destroy_cq failed");
            }
        }
        // SAFETY: created by `ibv_create_comp_channel`, destroyed once, after its only CQ.
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.channel) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_destroy_comp_channel failed");
        }
    }
}

impl VerbsCq {
    pub(crate) fn new(ctx: &Arc<Context>, depth: u32) -> Result<VerbsCq> {
        let max = ctx.caps.max_cqe;
        if depth == 0 || depth > max {
            return Err(Error::InvalidArgument(format!("CQ depth {depth} is not in 1..={max}")));
        }
        // SAFETY: the context is open while `ctx` lives.
        let channel = unsafe { sys::ibv_create_comp_channel(ctx.ctx) };
        if channel.is_null() {
            return Err(verb_error("ibv_create_comp_channel", errno()));
        }
        let mut inner = CqInner { cq: ptr::null_mut(), channel, ctx: ctx.clone() };
        // SAFETY: `channel` is live; its fd is owned by the channel for its whole life.
        let fd = unsafe { (*channel).fd };
        set_nonblocking(fd)?;
        let cqe = i32::try_from(depth).unwrap_or(i32::MAX);
        // SAFETY: the context and channel are live; no CQ context pointer, vector 0.
        let cq = unsafe { sys::ibv_create_cq(ctx.ctx, cqe, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            return Err(verb_error("ibv_create_cq", errno()));
        }
        inner.cq = cq;
        Ok(VerbsCq { inner: Arc::new(inner) })
    }
}

/// Puts the channel fd in non-blocking mode so `ack_events` never blocks.
fn set_nonblocking(fd: i32) -> Result<()> {
    // SAFETY: F_GETFL on an fd we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::Os {
            what: "fcntl(F_GETFL) on the CQ channel",
            source: os_error(errno()),
        });
    }
    // SAFETY: F_SETFL on an fd we own, adding O_NONBLOCK to its own flags.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    if rc < 0 {
        return Err(Error::Os {
            what: "fcntl(F_SETFL) on the CQ channel",
            source: os_error(errno()),
        });
    }
    Ok(())
}

impl CompletionQueue for VerbsCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Zero-filled, not uninitialised: providers leave fields of failed completions
        // unwritten, and those must not be read as uninitialised memory.
        let mut wcs = [ZERO_WC; POLL_CHUNK];
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(POLL_CHUNK);
            // SAFETY: the CQ is live; `wcs` has room for `want` entries, the most the
            // provider writes.
            let n = unsafe { sys::ibv_poll_cq(self.inner.cq, want as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                if done > 0 {
                    // Hand over what was already taken; the error shows up on the next call.
                    break;
                }
                return Err(Error::Os { what: "ibv_poll_cq", source: os_error(rc_errno(n)) });
            }
            let n = n as usize;
            for (slot, wc) in out[done..].iter_mut().zip(&wcs[..n]) {
                *slot = completion(wc);
            }
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is live; 0 asks for an event on any next completion.
        let rc = unsafe { sys::ibv_req_notify_cq(self.inner.cq, 0) };
        if rc != 0 {
            return Err(Error::Os { what: "ibv_req_notify_cq", source: os_error(rc_errno(rc)) });
        }
        Ok(())
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel and its fd live as long as `self.inner`, which outlives the
        // returned borrow of `self`.
        unsafe { BorrowedFd::borrow_raw((*self.inner.channel).fd) }
    }

    fn ack_events(&self) -> Result<()> {
        let mut got: u32 = 0;
        let mut failure = None;
        loop {
            let mut ev_cq: *mut sys::ibv_cq = ptr::null_mut();
            let mut ev_ctx: *mut libc::c_void = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; the out-pointers are valid.
            let rc = unsafe { sys::ibv_get_cq_event(self.inner.channel, &mut ev_cq, &mut ev_ctx) };
            if rc == 0 {
                // The channel is private to this CQ, so every event is for `self.inner.cq`.
                got += 1;
                continue;
            }
            match errno() {
                libc::EAGAIN => break,
                libc::EINTR => continue,
                e => {
                    failure = Some(Error::Os { what: "ibv_get_cq_event", source: os_error(e) });
                    break;
                }
            }
        }
        if got > 0 {
            // SAFETY: acks exactly the events this call took from the channel of this CQ.
            unsafe { sys::ibv_ack_cq_events(self.inner.cq, got) };
        }
        failure.map_or(Ok(()), Err)
    }
}

/// An all-zero `ibv_wc`.
const ZERO_WC: sys::ibv_wc = sys::ibv_wc {
    wr_id: 0,
    status: 0,
    opcode: 0,
    vendor_err: 0,
    byte_len: 0,
    imm_data_invalidated_rkey_union: sys::imm_data_invalidated_rkey_union_t { imm_data: 0 },
    qp_num: 0,
    src_qp: 0,
    wc_flags: 0,
    pkey_index: 0,
    slid: 0,
    sl: 0,
    dlid_path_bits: 0,
};

/// Maps one `ibv_wc`. For a failed completion only `wr_id`, `status`, `qp_num` and
/// `vendor_err` are defined (ibv_poll_cq(3)), so its opcode is reported as
/// [`WcOpcode::Send`], its length as 0 and its immediate as absent.
pub(crate) fn completion(wc: &sys::ibv_wc) -> WorkCompletion {
    let status = wc_status(wc.status);
    let mut out = WorkCompletion {
        wr_id: wc.wr_id,
        status,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
    };
    if !status.is_success() {
        return out;
    }
    out.opcode = match wc.opcode {
        sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        sys::ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
        sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        // IBV_WC_SEND, and operations bex never posts.
        _ => WcOpcode::Send,
    };
    out.byte_len = wc.byte_len;
    // A flag test with a mask: providers set other bits too (IBV_WC_GRH on RoCE, …).
    if wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
        // SAFETY: both members of the union are 32-bit integers, so either view is valid.
        let imm = unsafe { wc.imm_data_invalidated_rkey_union.imm_data };
        out.imm = Some(u32::from_be(imm));
    }
    out
}

/// Maps `ibv_wc_status`.
pub(crate) fn wc_status(status: sys::ibv_wc_status::Type) -> WcStatus {
    use sys::ibv_wc_status as s;
    match status {
        s::IBV_WC_SUCCESS => WcStatus::Success,
        s::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        s::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtectionError,
        s::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushError,
        s::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        s::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        s::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        s::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        s::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(status: u32, opcode: u32, flags: u32, imm_be: u32) -> sys::ibv_wc {
        sys::ibv_wc {
            wr_id: 42,
            status,
            opcode,
            vendor_err: 7,
            byte_len: 100,
            imm_data_invalidated_rkey_union: sys::imm_data_invalidated_rkey_union_t {
                imm_data: imm_be,
            },
            qp_num: 0x12,
            wc_flags: flags,
            ..ZERO_WC
        }
    }

    #[test]
    fn immediate_is_found_by_mask_among_other_flags_and_byte_swapped() {
        let grh = sys::ibv_wc_flags::IBV_WC_GRH.0;
        let with_imm = sys::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        let c = completion(&wc(
            0,
            sys::ibv_wc_opcode::IBV_WC_RECV,
            grh | with_imm,
            0xdead_beef_u32.to_be(),
        ));
        assert_eq!(c.imm, Some(0xdead_beef));
        assert_eq!(c.opcode, WcOpcode::Recv);
        assert_eq!(c.byte_len, 100);
        let c = completion(&wc(0, sys::ibv_wc_opcode::IBV_WC_RECV, grh, 5));
        assert_eq!(c.imm, None);
    }

    #[test]
    fn failed_completion_keeps_only_the_defined_fields() {
        let c = completion(&wc(
            sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
            sys::ibv_wc_opcode::IBV_WC_RECV,
            sys::ibv_wc_flags::IBV_WC_WITH_IMM.0,
            1,
        ));
        assert_eq!(c.status, WcStatus::WrFlushError);
        assert_eq!((c.wr_id, c.qp_num, c.vendor_err), (42, 0x12, 7));
        assert_eq!((c.opcode, c.byte_len, c.imm), (WcOpcode::Send, 0, None));
    }

    #[test]
    fn statuses_and_opcodes_map() {
        use sys::ibv_wc_status as s;
        assert_eq!(wc_status(s::IBV_WC_RNR_RETRY_EXC_ERR), WcStatus::RnrRetryExceeded);
        assert_eq!(wc_status(s::IBV_WC_REM_ACCESS_ERR), WcStatus::RemoteAccessError);
        assert_eq!(wc_status(s::IBV_WC_GENERAL_ERR), WcStatus::Other(s::IBV_WC_GENERAL_ERR));
        let c = completion(&wc(0, sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, 0, 0));
        assert_eq!(c.opcode, WcOpcode::RecvRdmaWithImm);
        let c = completion(&wc(0, sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE, 0, 0));
        assert_eq!(c.opcode, WcOpcode::RdmaWrite);
    }
}
