//! The conformance suite against the software RNIC: on the in-memory fabric (virtual time,
//! seeded) and on the UDP wire over loopback (IB MTU and soft MTU).

use std::net::SocketAddr;
use std::time::Duration;

use bex_rnic::conformance::{Bed, Rule, Side};
use bex_rnic::soft::{Fabric, FaultPlan, LinkModel, NicConfig, SoftDevice, UdpConfig};
use bex_rnic::verbs::Mtu;

/// Two devices on a simulated fabric.
struct SimBed {
    fabric: Fabric,
    a: SoftDevice,
    b: SoftDevice,
}

impl SimBed {
    fn new() -> Option<SimBed> {
        let seed = bex_testkit::seed::one_seed(7);
        let fabric = Fabric::new(seed, LinkModel::default());
        let a = fabric.add_device(NicConfig::default());
        let b = fabric.add_device(NicConfig::default());
        Some(SimBed { fabric, a, b })
    }
}

impl Drop for SimBed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let seed = self.fabric.seed();
            let replay =
                bex_testkit::seed::replay(seed, "cargo test -p bex-rnic --test conformance");
            eprintln!("fabric seed {seed} ({replay})");
        }
    }
}

impl Bed for SimBed {
    type D = SoftDevice;
    fn name(&self) -> &'static str {
        "soft-rnic/fabric"
    }
    fn device(&self, side: Side) -> &SoftDevice {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }
    fn drive_until(&self, done: &mut dyn FnMut() -> bool, limit: Duration) -> bool {
        self.fabric.run_until(done, limit)
    }
    fn wire_addr(&self, side: Side) -> SocketAddr {
        self.device(side).local_addr()
    }
    fn inject(&self, side: Side, mut rule: Rule) -> bool {
        let from = self.wire_addr(side);
        self.fabric
            .with_faults(|f| f.add_rule(move |p| if p.from == from { rule(p) } else { None }));
        true
    }
}

/// Two devices talking UDP over loopback.
struct UdpBed {
    a: SoftDevice,
    b: SoftDevice,
    mtu: Mtu,
}

impl UdpBed {
    fn new(mtu: Mtu) -> Option<UdpBed> {
        let open = || SoftDevice::open_udp(UdpConfig::new("127.0.0.1:0".parse().unwrap())).unwrap();
        Some(UdpBed { a: open(), b: open(), mtu })
    }
}

impl Bed for UdpBed {
    type D = SoftDevice;
    fn name(&self) -> &'static str {
        "soft-rnic/udp"
    }
    fn device(&self, side: Side) -> &SoftDevice {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }
    fn wire_addr(&self, side: Side) -> SocketAddr {
        self.device(side).local_addr()
    }
    fn inject(&self, side: Side, rule: Rule) -> bool {
        let mut plan = FaultPlan::none();
        plan.add_rule(rule);
        self.device(side).set_outbound_faults(Some(plan)).is_ok()
    }
    fn mtu(&self) -> Mtu {
        self.mtu
    }
}

mod fabric {
    use super::*;
    bex_rnic::conformance_suite!(|_case| SimBed::new());
}

mod udp {
    use super::*;
    bex_rnic::conformance_suite!(|_case| UdpBed::new(Mtu::Mtu4096));
}

mod udp_soft_mtu {
    use super::*;
    bex_rnic::conformance_suite!(|_case| UdpBed::new(Mtu::Soft(60 * 1024)));
}
