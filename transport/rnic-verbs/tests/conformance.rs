//! The shared conformance suite against hardware verbs: two QPs on one device, looped back.
//! Without a device (or without the `verbs` feature) every case prints a visible `SKIPPED:`
//! line with the reason. Cases that need packet fault injection skip on hardware.

use std::io::Write;
use std::net::SocketAddr;

use bex_rnic::conformance::{Bed, Rule, Side};
use bex_rnic::Error;
use bex_rnic_verbs::VerbsDevice;

struct VerbsBed {
    dev: VerbsDevice,
}

impl VerbsBed {
    fn new(case: &str) -> Option<VerbsBed> {
        match VerbsDevice::open(None) {
            Ok(dev) => Some(VerbsBed { dev }),
            Err(Error::NoDevice(reason)) => {
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "\nSKIPPED: verbs conformance {case} — no RDMA device ({reason})"
                );
                None
            }
            Err(e) => panic!("opening the verbs device failed unexpectedly: {e}"),
        }
    }
}

impl Bed for VerbsBed {
    type D = VerbsDevice;
    fn name(&self) -> &'static str {
        "verbs"
    }
    fn device(&self, _side: Side) -> &VerbsDevice {
        &self.dev
    }
    fn wire_addr(&self, _side: Side) -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 4791))
    }
    fn inject(&self, _side: Side, _rule: Rule) -> bool {
        false
    }
    fn mtu(&self) -> bex_rnic::verbs::Mtu {
        bex_rnic::verbs::Mtu::Mtu1024
    }
}

bex_rnic::conformance_suite!(VerbsBed::new);
