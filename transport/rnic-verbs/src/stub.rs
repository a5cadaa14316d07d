//! The build without the `verbs` feature: the same names as the hardware build, no FFI.
//! Opening a device always fails, so none of the other types can ever hold a value.

use std::os::fd::BorrowedFd;

use bex_rnic::verbs::{
    Access, MrKeys, QpEndpoint, QpState, RecvWr, RtrAttrs, RtsAttrs, SendWr, WorkCompletion,
};
use bex_rnic::{
    CompletionQueue, Device, DeviceCaps, Error, MemoryRegion, QpInit, QueuePair, Registrar, Result,
    SharedReceiveQueue,
};

use crate::VerbsOptions;

/// Why [`VerbsDevice::open`] fails in this build.
const NOT_BUILT: &str = "bex-rnic-verbs was built without the `verbs` feature";

/// A value of no type: what every resource is when no device can be opened.
#[derive(Debug)]
pub enum Unavailable {}

/// Protection domain (uninhabited in this build).
pub type VerbsPd = Unavailable;
/// Thread domain (uninhabited in this build).
pub type VerbsTd = Unavailable;
/// Completion queue (uninhabited in this build).
pub type VerbsCq = Unavailable;
/// Shared receive queue (uninhabited in this build).
pub type VerbsSrq = Unavailable;
/// Queue pair (uninhabited in this build).
pub type VerbsQp = Unavailable;
/// Memory region (uninhabited in this build).
pub type VerbsMr = Unavailable;

/// An RDMA device; this build cannot open one.
#[derive(Debug)]
pub enum VerbsDevice {}

impl VerbsDevice {
    /// Always [`Error::NoDevice`]: the crate was built without the `verbs` feature.
    pub fn open(name: Option<&str>) -> Result<VerbsDevice> {
        VerbsDevice::open_with(name, &VerbsOptions::default())
    }

    /// Always [`Error::NoDevice`]: the crate was built without the `verbs` feature.
    pub fn open_with(_name: Option<&str>, _options: &VerbsOptions) -> Result<VerbsDevice> {
        Err(Error::NoDevice(NOT_BUILT.to_owned()))
    }
}

/// A [`Registrar`] over one device and PD; this build cannot make one.
#[derive(Debug)]
pub enum VerbsRegistrar {}

impl VerbsRegistrar {
    /// Unreachable in this build: there is no device to pass.
    pub fn new(device: &VerbsDevice, _pd: &VerbsPd) -> Result<VerbsRegistrar> {
        match *device {}
    }
}

impl Registrar for VerbsRegistrar {
    unsafe fn register(&self, _addr: *mut u8, _len: usize) -> Result<MrKeys> {
        match *self {}
    }
    fn deregister(&self, _keys: MrKeys) -> Result<()> {
        match *self {}
    }
}

impl Device for VerbsDevice {
    type Pd = Unavailable;
    type Cq = Unavailable;
    type Srq = Unavailable;
    type Qp = Unavailable;
    type Mr = Unavailable;
    type Td = Unavailable;

    fn caps(&self) -> DeviceCaps {
        match *self {}
    }
    fn alloc_pd(&self) -> Result<Unavailable> {
        match *self {}
    }
    fn alloc_td(&self) -> Result<Unavailable> {
        match *self {}
    }
    fn create_cq(&self, _depth: u32) -> Result<Unavailable> {
        match *self {}
    }
    fn create_srq(&self, _pd: &Unavailable, _depth: u32, _max_sge: u32) -> Result<Unavailable> {
        match *self {}
    }
    fn create_qp(&self, _pd: &Unavailable, _init: &QpInit<'_, Self>) -> Result<Unavailable> {
        match *self {}
    }
    unsafe fn reg_mr(
        &self,
        _pd: &Unavailable,
        _addr: *mut u8,
        _len: usize,
        _access: Access,
    ) -> Result<Unavailable> {
        match *self {}
    }
}

impl MemoryRegion for Unavailable {
    fn keys(&self) -> MrKeys {
        match *self {}
    }
}

impl CompletionQueue for Unavailable {
    fn poll(&self, _out: &mut [WorkCompletion]) -> Result<usize> {
        match *self {}
    }
    fn arm(&self) -> Result<()> {
        match *self {}
    }
    fn fd(&self) -> BorrowedFd<'_> {
        match *self {}
    }
    fn ack_events(&self) -> Result<()> {
        match *self {}
    }
}

impl SharedReceiveQueue for Unavailable {
    fn post_recv(&self, _wrs: &[RecvWr]) -> Result<()> {
        match *self {}
    }
}

impl QueuePair for Unavailable {
    fn qpn(&self) -> u32 {
        match *self {}
    }
    fn state(&self) -> QpState {
        match *self {}
    }
    fn endpoint(&self) -> QpEndpoint {
        match *self {}
    }
    fn to_init(&self, _attrs: &bex_rnic::verbs::InitAttrs) -> Result<()> {
        match *self {}
    }
    fn to_rtr(&self, _attrs: &RtrAttrs) -> Result<()> {
        match *self {}
    }
    fn to_rts(&self, _attrs: &RtsAttrs) -> Result<()> {
        match *self {}
    }
    fn to_error(&self) -> Result<()> {
        match *self {}
    }
    fn post_send(&self, _wrs: &[SendWr]) -> Result<()> {
        match *self {}
    }
    fn post_recv(&self, _wrs: &[RecvWr]) -> Result<()> {
        match *self {}
    }
}
