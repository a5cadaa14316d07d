//! Which RNIC the RDMA tests run on.
//!
//! The benchmarks are generic over [`bex_rnic::Device`]; [`Device`] has associated types and
//! so cannot be a trait object. The concrete device is therefore handed to a [`DeviceUser`]
//! (a generic callback) by [`with_device`], the one function that names a backend.

use std::net::SocketAddr;

use bex_rnic::Device;

use crate::error::Result;

/// Code that runs against whichever device [`with_device`] opens.
pub trait DeviceUser {
    /// What it returns.
    type Output;
    /// Runs with the opened device.
    fn use_device<D: Device>(self, dev: &D) -> Self::Output;
}

/// Opens this process's RNIC with its RoCE UDP socket bound to `bind` (port 0: ephemeral) and
/// runs `user` with it.
///
/// This is the software RNIC over UDP (`bind`'s port is `--rnic-port`, 0 for any).
pub fn with_device<U: DeviceUser>(bind: SocketAddr, user: U) -> Result<U::Output> {
    let mut cfg = bex_rnic::soft::UdpConfig::new(bind);
    // This tool's threads poll or block with microsecond timers, and its streams wait for
    // their last message's ACK: a short delay, as before the event-loop default.
    cfg.nic.ack_delay = std::time::Duration::from_micros(20);
    let dev = bex_rnic::soft::SoftDevice::open_udp(cfg)?;
    Ok(user.use_device(&dev))
}
