//! The NIC boundary of bex.
//!
//! - [`verbs`]: the vocabulary (work requests, completions, QP states, MTUs) shared by every
//!   backend, mirroring ibverbs.
//! - [`device`]: the traits a backend implements ([`Device`], [`QueuePair`],
//!   [`CompletionQueue`], …) and the [`Registrar`] an allocator registers blocks through.
//! - [`bootstrap`]: the out-of-band TCP exchange of QP endpoints.
//! - [`soft`]: the software RNIC, an RC implementation modelled on Linux rxe that runs over
//!   UDP or over an in-memory simulated fabric.

pub mod bootstrap;
pub mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod device;
pub mod verbs;

pub use device::{
    CompletionQueue, Device, DeviceCaps, DeviceStats, Error, MemoryRegion, QpInit, QueuePair,
    Registrar, Result, SharedReceiveQueue,
};
pub mod soft;
