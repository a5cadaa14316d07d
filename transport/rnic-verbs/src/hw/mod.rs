//! The `verbs` build: the boundary traits over libibverbs, through `rdma-mummy-sys`.
//!
//! One file per verbs object family: [`device`] (context, PD, thread domain, opening),
//! [`cq`] (completion queue and its channel), [`qp`] (queue pair, SRQ, work-request chains),
//! [`mr`] (memory regions and the allocator's [`crate::VerbsRegistrar`]).

mod cq;
mod device;
mod mr;
mod qp;

pub use cq::VerbsCq;
pub use device::{VerbsDevice, VerbsPd, VerbsTd};
pub use mr::{VerbsMr, VerbsRegistrar};
pub use qp::{VerbsQp, VerbsSrq};

use std::io;

use bex_rnic::Error;
use rdma_mummy_sys as sys;

/// C structs for which all-zero bytes are a valid value (integers, raw pointers, nullable
/// function pointers, and unions and arrays of those): what C code gets from `memset(0)`.
///
/// # Safety
/// Implement it only for types whose every field, recursively, accepts all-zero bytes.
unsafe trait ZeroIsValid: Sized {}

/// A zero-filled C struct, the starting point of every attribute and work-request struct
/// (bindgen derives no `Default` for them).
fn zeroed<T: ZeroIsValid>() -> T {
    // SAFETY: `ZeroIsValid` promises that the all-zero bit pattern is a valid `T`.
    unsafe { std::mem::zeroed() }
}

// SAFETY: integers, raw pointers and unions of those (`ibv_wr_t`, the imm/rkey union,
// `bind_mw`/`tso`), all of which accept zero bytes (null pointers, 0).
unsafe impl ZeroIsValid for sys::ibv_send_wr {}
// SAFETY: integers and an `ibv_gid` union of byte arrays and integers.
unsafe impl ZeroIsValid for sys::ibv_ah_attr {}
// SAFETY: integers, an `ibv_qp_cap` of integers and two `ibv_ah_attr` (see above).
unsafe impl ZeroIsValid for sys::ibv_qp_attr {}
// SAFETY: raw pointers (null is valid), an `ibv_qp_cap` of integers, and integers.
unsafe impl ZeroIsValid for sys::ibv_qp_init_attr {}
// SAFETY: integers and fixed-size integer arrays only.
unsafe impl ZeroIsValid for sys::ibv_device_attr {}
// SAFETY: integers only.
unsafe impl ZeroIsValid for sys::ibv_port_attr {}

/// The calling thread's `errno` right after a verb failed.
fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The error number of a verb that returned `rc != 0`: positive codes are errno values
/// (`ibv_modify_qp`, `ibv_post_*`), negative ones mean "look at errno" (or are `-errno`).
fn rc_errno(rc: i32) -> i32 {
    if rc > 0 {
        return rc;
    }
    match errno() {
        0 => rc.saturating_neg(),
        e => e,
    }
}

/// The OS error for `errno`, or a generic one when the verb set none.
fn os_error(errno: i32) -> io::Error {
    if errno == 0 {
        io::Error::other("failed without setting errno")
    } else {
        io::Error::from_raw_os_error(errno)
    }
}

/// Maps a failed verb to the boundary's error kinds.
fn verb_error(what: &'static str, errno: i32) -> Error {
    match errno {
        libc::ENOMEM => Error::Exhausted(what),
        libc::EOPNOTSUPP | libc::ENOSYS => Error::Unsupported(what),
        libc::EINVAL => Error::InvalidArgument(format!("{what}: {}", os_error(errno))),
        _ => Error::Os { what, source: os_error(errno) },
    }
}
