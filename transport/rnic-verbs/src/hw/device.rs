//! Opening a device (context), protection and thread domains, and the [`Device`] impl.

use std::ffi::CStr;
use std::sync::Arc;

use bex_rnic::verbs::{Access, QpEndpoint};
use bex_rnic::{Device, DeviceCaps, Error, QpInit, Result};

use super::cq::VerbsCq;
use super::mr::VerbsMr;
use super::qp::{VerbsQp, VerbsSrq};
use super::{errno, os_error, sys, verb_error, zeroed};
use crate::VerbsOptions;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in `verbs.h`, so not in the bindings).
const LINK_LAYER_ETHERNET: u8 = 2;
/// The UDP port of RoCEv2, fixed on hardware.
const ROCE_V2_UDP_PORT: u16 = 4791;

/// An open device context and what was learned about it when it was opened.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) ctx: *mut sys::ibv_context,
    pub(crate) caps: DeviceCaps,
    /// The port queried at open; QPs must use it.
    pub(crate) port: u8,
    /// `IBV_LINK_LAYER_*` of that port.
    link_layer: u8,
    /// Largest path MTU the port runs at now (`ibv_mtu` code).
    pub(crate) active_mtu: sys::ibv_mtu::Type,
    /// Source GID index for address vectors.
    pub(crate) gid_index: u8,
    /// The GID at that index (what peers address).
    pub(crate) gid: [u8; 16],
    /// The port's LID (0 on RoCE).
    pub(crate) lid: u16,
}

// SAFETY: an `ibv_context` is not tied to the thread that opened it; every verb that takes
// it is thread-safe (rdma-core serializes inside the library and provider), and `Context`
// only reads its other fields after construction.
unsafe impl Send for Context {}
// SAFETY: as above; shared references only call thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// True on RoCE ports, where address vectors need a GRH with GIDs.
    pub(crate) fn is_ethernet(&self) -> bool {
        self.link_layer == LINK_LAYER_ETHERNET
    }

    /// What a peer needs to reach a QP of this device.
    pub(crate) fn endpoint(&self, qpn: u32, psn: u32) -> QpEndpoint {
        QpEndpoint { gid: self.gid, udp_port: ROCE_V2_UDP_PORT, lid: self.lid, qpn, psn }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from `ibv_open_device` and is closed exactly once, here; every
        // child resource holds an `Arc<Context>`, so none is left when this runs.
        let rc = unsafe { sys::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::warn!(device = %self.caps.name, errno = errno(), "ibv_close_device failed");
        }
    }
}

/// The NULL-terminated array from `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    /// Lists the devices, or says why there are none.
    fn get() -> Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(Error::NoDevice(no_list_reason(errno())));
        }
        let list = DeviceList { list, len: usize::try_from(n).unwrap_or(0) };
        if list.len == 0 {
            return Err(Error::NoDevice(
                "no RDMA devices found (ibv_get_device_list returned 0 devices)".to_owned(),
            ));
        }
        Ok(list)
    }

    /// The devices with their names.
    fn devices(&self) -> Vec<(String, *mut sys::ibv_device)> {
        (0..self.len)
            .map(|i| {
                // SAFETY: the library returned `len` valid entries before the NULL terminator,
                // and `i < len`; the list stays allocated until `self` drops.
                let dev = unsafe { *self.list.add(i) };
                // SAFETY: `dev` is a live device of the list; the name it returns is a
                // NUL-terminated string owned by the device (or NULL, handled below).
                let name = unsafe { sys::ibv_get_device_name(dev) };
                let name = if name.is_null() {
                    format!("device{i}")
                } else {
                    // SAFETY: non-NULL, NUL-terminated, and alive while the list is.
                    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
                };
                (name, dev)
            })
            .collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once; contexts opened
        // from its devices stay valid after the list is freed (documented by rdma-core).
        unsafe { sys::ibv_free_device_list(self.list) };
    }
}

/// Why `ibv_get_device_list` returned NULL, for [`Error::NoDevice`].
fn no_list_reason(errno: i32) -> String {
    let err = os_error(errno);
    match errno {
        libc::ENOSYS => {
            format!("ibv_get_device_list: {err} (ENOSYS): the kernel has no RDMA support")
        }
        libc::EOPNOTSUPP if !libibverbs_loaded() => "ibv_get_device_list: libibverbs.so.1 could \
             not be loaded (install libibverbs1 and ibverbs-providers)"
            .to_owned(),
        _ => format!("ibv_get_device_list: {err}"),
    }
}

/// True when `libibverbs.so.1` is loaded in this process (`rdma-mummy-sys` loads it when the
/// program starts and reports `EOPNOTSUPP` for every verb when that failed).
fn libibverbs_loaded() -> bool {
    // SAFETY: a constant NUL-terminated name; RTLD_NOLOAD only looks up an already loaded
    // library and never runs its constructors.
    let handle =
        unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: `handle` is the reference RTLD_NOLOAD just took; this gives it back.
    unsafe { libc::dlclose(handle) };
    true
}

/// A context being set up; closed on drop unless handed to [`Context`].
struct OpenedContext(*mut sys::ibv_context);

impl OpenedContext {
    fn into_raw(self) -> *mut sys::ibv_context {
        let ctx = self.0;
        std::mem::forget(self);
        ctx
    }
}

impl Drop for OpenedContext {
    fn drop(&mut self) {
        // SAFETY: the context came from `ibv_open_device`, has no children yet, and this
        // guard is its only owner.
        unsafe { sys::ibv_close_device(self.0) };
    }
}

/// An open RDMA device: the factory of every other verbs resource. Cheap to clone (all
/// clones share one context).
#[derive(Clone, Debug)]
pub struct VerbsDevice {
    ctx: Arc<Context>,
}

impl VerbsDevice {
    /// Opens the device called `name` (e.g. `mlx5_0`), or the first one, on port 1 with the
    /// default GID choice. See [`VerbsDevice::open_with`].
    pub fn open(name: Option<&str>) -> Result<VerbsDevice> {
        VerbsDevice::open_with(name, &VerbsOptions::default())
    }

    /// Opens the device called `name`, or the first one.
    ///
    /// Fails with [`Error::NoDevice`] naming the cause when libibverbs cannot be loaded, the
    /// kernel has no RDMA support (`ENOSYS`), there are no devices, none has that name, or
    /// the device cannot be opened.
    pub fn open_with(name: Option<&str>, options: &VerbsOptions) -> Result<VerbsDevice> {
        let list = DeviceList::get()?;
        let devices = list.devices();
        let (dev_name, dev) = match name {
            None => devices[0].clone(),
            Some(wanted) => match devices.iter().find(|(n, _)| n == wanted) {
                Some(found) => found.clone(),
                None => {
                    let have: Vec<&str> = devices.iter().map(|(n, _)| n.as_str()).collect();
                    return Err(Error::NoDevice(format!(
                        "no RDMA device named `{wanted}` (found: {})",
                        have.join(", ")
                    )));
                }
            },
        };
        // SAFETY: `dev` is an entry of the live device list.
        let raw = unsafe { sys::ibv_open_device(dev) };
        if raw.is_null() {
            let err = os_error(errno());
            return Err(Error::NoDevice(format!("ibv_open_device({dev_name}): {err}")));
        }
        let opened = OpenedContext(raw);
        drop(list);

        let mut attr: sys::ibv_device_attr = zeroed();
        // SAFETY: the context is open and `attr` is a writable `ibv_device_attr`.
        let rc = unsafe { sys::ibv_query_device(opened.0, &mut attr) };
        if rc != 0 {
            return Err(verb_error("ibv_query_device", super::rc_errno(rc)));
        }
        let port = options.port.unwrap_or(1);
        if port == 0 || port > attr.phys_port_cnt {
            return Err(Error::InvalidArgument(format!(
                "{dev_name} has ports 1..={}, not {port}",
                attr.phys_port_cnt
            )));
        }
        let mut port_attr: sys::ibv_port_attr = zeroed();
        // SAFETY: the context is open; `port_attr` is a writable, zeroed `ibv_port_attr`
        // whose size the wrapper passes to the provider.
        let rc = unsafe { sys::ibv_query_port(opened.0, port, &mut port_attr) };
        if rc != 0 {
            return Err(verb_error("ibv_query_port", super::rc_errno(rc)));
        }
        let ethernet = port_attr.link_layer == LINK_LAYER_ETHERNET;
        let gid_index = match options.gid_index {
            Some(i) => i,
            None if ethernet => {
                first_rocev2_gid(opened.0, port, port_attr.gid_tbl_len).unwrap_or(0)
            }
            None => 0,
        };
        let mut gid = sys::ibv_gid { raw: [0; 16] };
        // SAFETY: the context is open and `gid` is a writable `ibv_gid`.
        let rc = unsafe { sys::ibv_query_gid(opened.0, port, i32::from(gid_index), &mut gid) };
        if rc != 0 {
            return Err(Error::InvalidArgument(format!(
                "{dev_name} port {port}: no GID at index {gid_index} ({})",
                os_error(errno())
            )));
        }
        // SAFETY: every variant of `ibv_gid` is plain bytes/integers; `raw` views all 16.
        let gid = unsafe { gid.raw };
        let thread_domains = probe_thread_domain(opened.0);

        let caps = DeviceCaps {
            name: dev_name,
            thread_domains,
            srq: attr.max_srq > 0,
            max_qp_wr: u32::try_from(attr.max_qp_wr).unwrap_or(0),
            max_cqe: u32::try_from(attr.max_cqe).unwrap_or(0),
            max_msg_size: u64::from(port_attr.max_msg_sz),
            max_sge: u32::try_from(attr.max_sge).unwrap_or(0),
            soft_mtu: false,
        };
        tracing::debug!(?caps, port, gid_index, ethernet, "opened RDMA device");
        let ctx = Context {
            ctx: opened.into_raw(),
            caps,
            port,
            link_layer: port_attr.link_layer,
            active_mtu: port_attr.active_mtu,
            gid_index,
            gid,
            lid: port_attr.lid,
        };
        Ok(VerbsDevice { ctx: Arc::new(ctx) })
    }

    /// The port this device was opened for (QPs must use it).
    pub fn port(&self) -> u8 {
        self.ctx.port
    }

    /// The source GID index used in address vectors.
    pub fn gid_index(&self) -> u8 {
        self.ctx.gid_index
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn check_pd(&self, pd: &VerbsPd) -> Result<()> {
        if Arc::ptr_eq(&pd.inner.ctx, &self.ctx) {
            Ok(())
        } else {
            Err(Error::InvalidArgument("the PD belongs to another device".to_owned()))
        }
    }
}

/// Index of the port's first RoCEv2 GID (`ibv_query_gid_ex`), if any.
fn first_rocev2_gid(ctx: *mut sys::ibv_context, port: u8, table_len: i32) -> Option<u8> {
    let len = u32::try_from(table_len).unwrap_or(0).min(256);
    (0..len).find_map(|index| {
        let mut entry = sys::ibv_gid_entry {
            gid: sys::ibv_gid { raw: [0; 16] },
            gid_index: 0,
            port_num: 0,
            gid_type: 0,
            ndev_ifindex: 0,
        };
        // SAFETY: the context is open and `entry` is a writable `ibv_gid_entry` whose size
        // the wrapper passes along; empty slots fail with ENODATA and are skipped.
        let rc = unsafe { sys::ibv_query_gid_ex(ctx, u32::from(port), index, &mut entry, 0) };
        let is_v2 = rc == 0 && entry.gid_type == sys::IBV_GID_TYPE_ROCE_V2;
        if is_v2 {
            u8::try_from(index).ok()
        } else {
            None
        }
    })
}

/// True when the provider implements thread domains (allocates one and frees it).
fn probe_thread_domain(ctx: *mut sys::ibv_context) -> bool {
    let mut attr = sys::ibv_td_init_attr { comp_mask: 0 };
    // SAFETY: the context is open and `attr` is a valid init attribute.
    let td = unsafe { sys::ibv_alloc_td(ctx, &mut attr) };
    if td.is_null() {
        return false;
    }
    // SAFETY: `td` was just allocated and nothing else refers to it.
    unsafe { sys::ibv_dealloc_td(td) };
    true
}

/// A protection domain. Cheap to clone; the domain is freed when the last clone and every
/// resource created in it are gone.
#[derive(Clone, Debug)]
pub struct VerbsPd {
    pub(crate) inner: Arc<PdInner>,
}

#[derive(Debug)]
pub(crate) struct PdInner {
    pub(crate) pd: *mut sys::ibv_pd,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: a PD is a handle to a kernel object usable from any thread; the verbs that take it
// (`ibv_reg_mr`, `ibv_create_qp`, …) are thread-safe.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_pd`, freed once; MRs, SRQs and QPs hold an
        // `Arc<PdInner>`, so none is left in it.
        let rc = unsafe { sys::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(errno = super::rc_errno(rc), "ibv_dealloc_pd failed");
        }
    }
}

/// A thread domain: QPs created with it skip the provider's locks and may get their own
/// doorbell. Only some providers have them (see [`DeviceCaps::thread_domains`]).
#[derive(Clone, Debug)]
pub struct VerbsTd {
    pub(crate) inner: Arc<TdInner>,
}

#[derive(Debug)]
pub(crate) struct TdInner {
    pub(crate) td: *mut sys::ibv_td,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: the TD handle itself may move between threads; the QPs in it serialize their own
// use (see `VerbsQp`), which is the single-threaded-use rule thread domains impose.
unsafe impl Send for TdInner {}
// SAFETY: shared access only reads the pointer, to build parent domains.
unsafe impl Sync for TdInner {}

impl Drop for TdInner {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_td`, freed once; parent domains using it belong to
        // QPs that hold an `Arc<TdInner>` and free their parent domain first.
        let rc = unsafe { sys::ibv_dealloc_td(self.td) };
        if rc != 0 {
            tracing::warn!(errno = super::rc_errno(rc), "ibv_dealloc_td failed");
        }
    }
}

impl Device for VerbsDevice {
    type Pd = VerbsPd;
    type Cq = VerbsCq;
    type Srq = VerbsSrq;
    type Qp = VerbsQp;
    type Mr = VerbsMr;
    type Td = VerbsTd;

    fn caps(&self) -> DeviceCaps {
        self.ctx.caps.clone()
    }

    fn alloc_pd(&self) -> Result<VerbsPd> {
        // SAFETY: the context is open for as long as `self.ctx` lives.
        let pd = unsafe { sys::ibv_alloc_pd(self.ctx.ctx) };
        if pd.is_null() {
            return Err(verb_error("ibv_alloc_pd", errno()));
        }
        Ok(VerbsPd { inner: Arc::new(PdInner { pd, ctx: self.ctx.clone() }) })
    }

    fn alloc_td(&self) -> Result<VerbsTd> {
        let mut attr = sys::ibv_td_init_attr { comp_mask: 0 };
        // SAFETY: the context is open and `attr` is a valid init attribute.
        let td = unsafe { sys::ibv_alloc_td(self.ctx.ctx, &mut attr) };
        if td.is_null() {
            return Err(match errno() {
                libc::EOPNOTSUPP | libc::ENOSYS | 0 => {
                    Error::Unsupported("thread domains (this provider has no ibv_alloc_td)")
                }
                e => verb_error("ibv_alloc_td", e),
            });
        }
        Ok(VerbsTd { inner: Arc::new(TdInner { td, ctx: self.ctx.clone() }) })
    }

    fn create_cq(&self, depth: u32) -> Result<VerbsCq> {
        VerbsCq::new(&self.ctx, depth)
    }

    fn create_srq(&self, pd: &VerbsPd, depth: u32, max_sge: u32) -> Result<VerbsSrq> {
        self.check_pd(pd)?;
        VerbsSrq::new(pd, depth, max_sge)
    }

    fn create_qp(&self, pd: &VerbsPd, init: &QpInit<'_, Self>) -> Result<VerbsQp> {
        self.check_pd(pd)?;
        VerbsQp::new(&self.ctx, pd, init)
    }

    unsafe fn reg_mr(
        &self,
        pd: &VerbsPd,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<VerbsMr> {
        self.check_pd(pd)?;
        // SAFETY: forwarded from this function's contract: the memory stays valid until the
        // region is dropped.
        unsafe { VerbsMr::new(pd, addr, len, access) }
    }
}
