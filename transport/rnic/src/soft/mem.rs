//! Registered memory: the key table and the only code in the software RNIC that reads or
//! writes application memory.
//!
//! Soundness rests on one discipline: an entry is in the [`MrTable`] only between a successful
//! `reg_mr` (an `unsafe` call whose caller promised the memory stays valid until the region is
//! dropped) and the region's drop, which removes the entry under the same lock that every
//! access below holds. So a key found in the table names live memory. Applications and the
//! NIC may touch the same bytes concurrently exactly as with hardware RDMA; the verbs contract
//! (do not touch a buffer with an outstanding work request) is the application's to keep.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::verbs::{Access, Sge};

/// Keys are random 32-bit values, so hashing them again buys nothing.
#[derive(Default, Debug)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type KeyMap<V> = HashMap<u32, V, BuildHasherDefault<KeyHasher>>;

/// One registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Rights.
    pub access: Access,
    /// Protection domain it belongs to.
    pub pd: u32,
}

impl Region {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// Why a memory access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessError {
    /// No region has this key.
    UnknownKey,
    /// The range leaves the region.
    OutOfBounds,
    /// The region lacks the right.
    NoPermission,
    /// The region belongs to another protection domain.
    WrongPd,
}

/// Registered regions by key (lkey and rkey are the same random value).
#[derive(Debug, Default)]
pub struct MrTable {
    regions: KeyMap<Region>,
}

impl MrTable {
    /// Adds a region under `key`; false if the key is taken.
    pub fn insert(&mut self, key: u32, region: Region) -> bool {
        if self.regions.contains_key(&key) {
            return false;
        }
        self.regions.insert(key, region);
        true
    }
    /// Removes a region.
    pub fn remove(&mut self, key: u32) -> Option<Region> {
        self.regions.remove(&key)
    }
    /// True when `key` is registered.
    pub fn contains(&self, key: u32) -> bool {
        self.regions.contains_key(&key)
    }
    /// Number of live regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }
    /// True when no region is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// Checks that a peer may write `len` bytes at `addr` through `rkey` in `pd`.
    pub fn check_remote_write(
        &self,
        rkey: u32,
        pd: u32,
        addr: u64,
        len: u64,
    ) -> Result<(), AccessError> {
        let r = self.regions.get(&rkey).ok_or(AccessError::UnknownKey)?;
        if r.pd != pd {
            return Err(AccessError::WrongPd);
        }
        if !r.access.contains(Access::REMOTE_WRITE) {
            return Err(AccessError::NoPermission);
        }
        if !r.contains(addr, len) {
            return Err(AccessError::OutOfBounds);
        }
        Ok(())
    }

    /// Writes `data` at `addr` in the region of `rkey` after checking rights and bounds.
    pub fn remote_write(
        &self,
        rkey: u32,
        pd: u32,
        addr: u64,
        data: &[u8],
    ) -> Result<(), AccessError> {
        self.check_remote_write(rkey, pd, addr, data.len() as u64)?;
        copy_in(addr, data);
        Ok(())
    }

    fn local(&self, sge: &Sge, pd: u32, write: bool) -> Result<(), AccessError> {
        let r = self.regions.get(&sge.lkey).ok_or(AccessError::UnknownKey)?;
        if r.pd != pd {
            return Err(AccessError::WrongPd);
        }
        if write && !r.access.contains(Access::LOCAL_WRITE) {
            return Err(AccessError::NoPermission);
        }
        if !r.contains(sge.addr, u64::from(sge.length)) {
            return Err(AccessError::OutOfBounds);
        }
        Ok(())
    }

    /// Checks every sge of a gather (send) list.
    pub fn check_gather(&self, sges: &[Sge], pd: u32) -> Result<(), AccessError> {
        sges.iter().try_for_each(|s| self.local(s, pd, false))
    }

    /// Checks every sge of a scatter (receive) list.
    pub fn check_scatter(&self, sges: &[Sge], pd: u32) -> Result<(), AccessError> {
        sges.iter().try_for_each(|s| self.local(s, pd, true))
    }

    /// Copies bytes `[offset, offset + out.len())` of the message described by `sges` into
    /// `out`. Keys are re-checked: a region deregistered since posting fails here.
    pub fn gather(
        &self,
        sges: &[Sge],
        pd: u32,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), AccessError> {
        self.walk(sges, pd, offset, out.len(), false, |addr, at, n| {
            copy_out(addr, &mut out[at..at + n]);
        })
    }

    /// Copies `data` into the message described by `sges` starting at byte `offset`.
    pub fn scatter(
        &self,
        sges: &[Sge],
        pd: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), AccessError> {
        self.walk(sges, pd, offset, data.len(), true, |addr, at, n| {
            copy_in(addr, &data[at..at + n]);
        })
    }

    /// Calls `span(address, position, n)` for each piece of bytes `[offset, offset + len)`
    /// of the message `sges` describes, in order, after checking that piece's key (`write`:
    /// for local writing); out of bounds unless all `len` bytes are there.
    fn walk(
        &self,
        sges: &[Sge],
        pd: u32,
        mut offset: u64,
        len: usize,
        write: bool,
        mut span: impl FnMut(u64, usize, usize),
    ) -> Result<(), AccessError> {
        let mut done = 0usize;
        for sge in sges {
            if done == len {
                break;
            }
            let sge_len = u64::from(sge.length);
            if offset >= sge_len {
                offset -= sge_len;
                continue;
            }
            self.local(sge, pd, write)?;
            let n = ((sge_len - offset) as usize).min(len - done);
            span(sge.addr + offset, done, n);
            done += n;
            offset = 0;
        }
        if done == len {
            Ok(())
        } else {
            Err(AccessError::OutOfBounds)
        }
    }
}

/// Writes `data` to registered memory at `addr`. Callers have checked that a live region covers
/// the range.
fn copy_in(addr: u64, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    // SAFETY: every caller verified against the MrTable (under the device lock, which region
    // removal also takes) that [addr, addr + len) lies inside a live registration, and
    // `reg_mr`'s contract keeps that memory valid until the registration is removed. The
    // source is a packet buffer that cannot overlap registered memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, data.len()) }
}

/// Reads registered memory at `addr` into `out`. Callers have checked the range.
fn copy_out(addr: u64, out: &mut [u8]) {
    if out.is_empty() {
        return;
    }
    // SAFETY: as for `copy_in`: the range lies inside a live registration, checked under the
    // lock that removal takes; `out` is a packet buffer distinct from registered memory.
    unsafe {
        std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr(), out.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_with(buf: &mut [u8], access: Access) -> MrTable {
        let mut t = MrTable::default();
        assert!(t.insert(
            42,
            Region { addr: buf.as_mut_ptr() as u64, len: buf.len() as u64, access, pd: 1 }
        ));
        t
    }

    #[test]
    fn scatter_and_gather_cross_sge_boundaries() {
        let mut buf = vec![0u8; 16];
        let base = buf.as_mut_ptr() as u64;
        let t = table_with(&mut buf, Access::ALL);
        let sges =
            [Sge { addr: base, length: 3, lkey: 42 }, Sge { addr: base + 8, length: 8, lkey: 42 }];
        t.scatter(&sges, 1, 1, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 5];
        t.gather(&sges, 1, 0, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 4]);
        assert_eq!(t.scatter(&sges, 1, 10, &[0; 2]), Err(AccessError::OutOfBounds));
        drop(t);
        assert_eq!(&buf[..3], &[0, 1, 2]);
        assert_eq!(&buf[8..10], &[3, 4]);
    }

    #[test]
    fn remote_write_checks_key_rights_bounds_and_pd() {
        let mut buf = vec![0u8; 8];
        let base = buf.as_mut_ptr() as u64;
        let t = table_with(&mut buf, Access::LOCAL_WRITE);
        assert_eq!(t.remote_write(42, 1, base, &[1]), Err(AccessError::NoPermission));
        let mut buf2 = vec![0u8; 8];
        let base2 = buf2.as_mut_ptr() as u64;
        let t2 = table_with(&mut buf2, Access::ALL);
        assert_eq!(t2.remote_write(7, 1, base2, &[1]), Err(AccessError::UnknownKey));
        assert_eq!(t2.remote_write(42, 2, base2, &[1]), Err(AccessError::WrongPd));
        assert_eq!(t2.remote_write(42, 1, base2 + 7, &[1, 2]), Err(AccessError::OutOfBounds));
        t2.remote_write(42, 1, base2 + 6, &[1, 2]).unwrap();
        drop((t, t2));
        assert_eq!(buf2[6..], [1, 2]);
        assert_eq!(buf, [0; 8]);
    }
}
