//! Memory regions, and the [`Registrar`] an allocator registers its blocks through.

use std::collections::HashMap;
use std::ptr;
use std::sync::Arc;

use bex_rnic::verbs::{Access, MrKeys};
use bex_rnic::{Device, Error, MemoryRegion, Registrar, Result};
use parking_lot::Mutex;

use super::device::{PdInner, VerbsDevice, VerbsPd};
use super::{errno, rc_errno, sys, verb_error};

/// A registered memory region; deregistered when dropped. It keeps its PD alive.
#[derive(Debug)]
pub struct VerbsMr {
    /// NULL once deregistered explicitly.
    mr: *mut sys::ibv_mr,
    keys: MrKeys,
    _pd: Arc<PdInner>,
}

// SAFETY: an MR is a handle to a kernel object usable from any thread; the only verb called
// on it (`ibv_dereg_mr`) runs once, from `Drop` or `deregister` with `&mut self`/ownership.
unsafe impl Send for VerbsMr {}
// SAFETY: shared references only read `keys`.
unsafe impl Sync for VerbsMr {}

impl VerbsMr {
    /// Registers `[addr, addr + len)` in `pd`.
    ///
    /// # Safety
    /// The memory must stay valid until the region is dropped.
    pub(crate) unsafe fn new(
        pd: &VerbsPd,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<VerbsMr> {
        if len == 0 || addr.is_null() {
            return Err(Error::InvalidArgument(format!("cannot register {len} bytes at {addr:p}")));
        }
        // `Access` uses the IBV_ACCESS_* bit values.
        let flags = access.bits() as i32;
        // SAFETY: the PD is live; the caller guarantees the memory stays valid while the
        // region exists, which is until `ibv_dereg_mr` in `Drop`.
        let mr = unsafe { sys::ibv_reg_mr(pd.inner.pd, addr.cast(), len, flags) };
        if mr.is_null() {
            return Err(verb_error("ibv_reg_mr", errno()));
        }
        // SAFETY: `mr` was just returned by the library and is live.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        let keys = MrKeys { addr: addr as u64, len: len as u64, lkey, rkey };
        Ok(VerbsMr { mr, keys, _pd: pd.inner.clone() })
    }

    /// Deregisters now, reporting failure (dropping does the same but can only log).
    pub fn deregister(mut self) -> Result<()> {
        let mr = std::mem::replace(&mut self.mr, ptr::null_mut());
        // SAFETY: `mr` is live and owned by `self`, which can no longer use it (now NULL).
        let rc = unsafe { sys::ibv_dereg_mr(mr) };
        if rc != 0 {
            return Err(verb_error("ibv_dereg_mr", rc_errno(rc)));
        }
        Ok(())
    }
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        if self.mr.is_null() {
            return;
        }
        // SAFETY: `mr` came from `ibv_reg_mr` and is deregistered once, here.
        let rc = unsafe { sys::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::warn!(keys = ?self.keys, errno = rc_errno(rc), "ibv_dereg_mr failed");
        }
    }
}

impl MemoryRegion for VerbsMr {
    fn keys(&self) -> MrKeys {
        self.keys
    }
}

/// Registers an allocator's blocks with one device and PD, for local and remote access
/// ([`Access::ALL`]). Regions are held here, by lkey, until deregistered.
#[derive(Debug)]
pub struct VerbsRegistrar {
    device: VerbsDevice,
    pd: VerbsPd,
    regions: Mutex<HashMap<u32, VerbsMr>>,
}

impl VerbsRegistrar {
    /// A registrar for `pd` of `device`.
    pub fn new(device: &VerbsDevice, pd: &VerbsPd) -> Result<VerbsRegistrar> {
        if !Arc::ptr_eq(&pd.inner.ctx, device.context()) {
            return Err(Error::InvalidArgument("the PD belongs to another device".to_owned()));
        }
        Ok(VerbsRegistrar { device: device.clone(), pd: pd.clone(), regions: Mutex::default() })
    }
}

impl Registrar for VerbsRegistrar {
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MrKeys> {
        // SAFETY: forwarded from this function's contract: the memory stays valid until
        // `deregister` drops the region.
        let mr = unsafe { self.device.reg_mr(&self.pd, addr, len, Access::ALL) }?;
        let keys = mr.keys();
        self.regions.lock().insert(keys.lkey, mr);
        Ok(keys)
    }

    fn deregister(&self, keys: MrKeys) -> Result<()> {
        let unknown =
            || Error::InvalidArgument(format!("no region registered here with keys {keys:?}"));
        let mr = {
            let mut regions = self.regions.lock();
            match regions.remove(&keys.lkey) {
                Some(mr) if mr.keys == keys => mr,
                Some(other) => {
                    regions.insert(keys.lkey, other);
                    return Err(unknown());
                }
                None => return Err(unknown()),
            }
        };
        mr.deregister()
    }
}
