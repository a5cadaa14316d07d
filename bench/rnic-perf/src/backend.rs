//! Which RNIC the RDMA tests run on.
//!
//! The benchmarks are generic over [`bex_rnic::Device`]; [`Device`](bex_rnic::Device) has
//! associated types and so cannot be a trait object. The concrete device is therefore handed
//! to a [`DeviceUser`] (a generic callback) by [`with_device`], which opens it through
//! bex-transport's one NIC builder (`--nic`).

use std::net::SocketAddr;
use std::time::Duration;

pub use bex_transport::stack::DeviceUser;
use bex_transport::{NicSpec, SoftNic};

use crate::error::{PerfError, Result};

/// Opens this process's RNIC — the software one with its RoCE UDP socket on `bind` (port 0:
/// ephemeral), or the hardware device `nic` names — and runs `user` with it.
pub fn with_device<U: DeviceUser>(nic: &NicSpec, bind: SocketAddr, user: U) -> Result<U::Output> {
    let spec = match nic {
        // This tool's threads poll or block with microsecond timers, and its streams wait
        // for their last message's ACK: a short delay, as before the event-loop default.
        NicSpec::Soft(_) => NicSpec::Soft(SoftNic {
            udp_port: bind.port(),
            ack_delay: Some(Duration::from_micros(20)),
        }),
        hw => hw.clone(),
    };
    spec.with_device(bind.ip(), user).map_err(|e| PerfError::Nic(e.to_string()))
}
