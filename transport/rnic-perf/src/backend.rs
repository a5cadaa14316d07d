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
    let dev = bex_rnic::soft::SoftDevice::open_udp(bex_rnic::soft::UdpConfig::new(bind))?;
    Ok(user.use_device(&dev))
}
