//! The hardware backend of bex's NIC boundary: the [`bex_rnic::Device`] family of traits over
//! libibverbs. This is the only crate in bex with FFI; every `unsafe` block in it says why it
//! is sound in a `// SAFETY:` comment.
//!
//! # Two builds
//! - **Default** (no features): no system headers, no C code. [`VerbsDevice::open`] always
//!   returns [`Error::NoDevice`], and every other type is uninhabited, so code that names
//!   these types compiles in both builds and falls back to the software RNIC at run time.
//! - **`verbs` feature**: bindings from `rdma-mummy-sys`, which loads `libibverbs.so.1` with
//!   `dlopen` when the process starts. Building needs cmake and libclang
//!   (`scripts/install-verbs-deps.sh`); running needs `libibverbs1` and a provider package
//!   (`ibverbs-providers`) and, for any device to show up, kernel RDMA support. Each missing
//!   piece surfaces as [`Error::NoDevice`] with the cause in its text, never a panic.
//!
//! # Resource lifetimes
//! Every resource holds a reference-counted handle on its parents (device context ← PD ←
//! MR/SRQ/QP, context ← CQ, QP → its CQs, SRQ and thread domain), so drop order never matters
//! to the caller: a parent is destroyed only after its last child.
//!
//! # What hardware adds to the boundary
//! - Path MTU: [`bex_rnic::verbs::Mtu::Soft`] is rejected; an IB size larger than the port's
//!   active MTU is lowered to it (what perftest and most verbs programs do).
//! - RoCE: the source GID index is [`VerbsOptions::gid_index`], by default the port's first
//!   RoCEv2 GID (index 0 on InfiniBand).
//! - Thread domains exist only where the provider implements `ibv_alloc_td` (mlx5 and a few
//!   others); elsewhere [`bex_rnic::Device::alloc_td`] returns [`Error::Unsupported`].

pub use bex_rnic::{Error, Result};

/// How [`VerbsDevice::open_with`] sets up a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Physical port queried for the GID, LID, link layer and active MTU; `None` is port 1.
    /// QPs still take their port from [`bex_rnic::verbs::InitAttrs::port`].
    pub port: Option<u8>,
    /// Source GID index for RoCE address vectors; `None` picks the port's first RoCEv2 GID
    /// (falling back to 0), and 0 on InfiniBand.
    pub gid_index: Option<u8>,
}

/// True when this build talks to hardware (the `verbs` feature is on).
pub const ENABLED: bool = cfg!(feature = "verbs");

#[cfg(feature = "verbs")]
mod hw;
#[cfg(feature = "verbs")]
pub use hw::{VerbsCq, VerbsDevice, VerbsMr, VerbsPd, VerbsQp, VerbsRegistrar, VerbsSrq, VerbsTd};

#[cfg(not(feature = "verbs"))]
mod stub;
#[cfg(not(feature = "verbs"))]
pub use stub::{
    VerbsCq, VerbsDevice, VerbsMr, VerbsPd, VerbsQp, VerbsRegistrar, VerbsSrq, VerbsTd,
};
