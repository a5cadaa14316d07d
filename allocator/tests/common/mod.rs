//! A registrar that records what it is asked, for checking the registration discipline.

#![allow(dead_code)] // each test binary uses a different part

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use bex_rnic::verbs::MrKeys;
use bex_rnic::{Error, Registrar, Result};
use parking_lot::Mutex;

/// Records registrations; refuses overlapping ones and unknown deregistrations; can be told
/// to fail from the `fail_from`-th registration on.
#[derive(Debug, Default)]
pub struct Recorder {
    pub live: Mutex<BTreeMap<u64, MrKeys>>,
    pub registered: AtomicUsize,
    pub deregistered: AtomicUsize,
    pub fail_from: Option<usize>,
    pub salt: u32,
}

impl Recorder {
    pub fn failing_from(n: usize) -> Self {
        Recorder { fail_from: Some(n), ..Default::default() }
    }
    pub fn with_salt(salt: u32) -> Self {
        Recorder { salt, ..Default::default() }
    }
}

impl Registrar for Recorder {
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MrKeys> {
        let n = self.registered.load(Ordering::SeqCst);
        if self.fail_from.is_some_and(|f| n >= f) {
            return Err(Error::Exhausted("test registrar refuses"));
        }
        let (a, l) = (addr as u64, len as u64);
        let mut live = self.live.lock();
        if let Some((_, prev)) = live.range(..a + l).next_back() {
            assert!(prev.addr + prev.len <= a, "overlapping registration {prev:?} vs {a:#x}+{l}");
        }
        let key = (n as u32 + 1) ^ self.salt;
        let keys = MrKeys { addr: a, len: l, lkey: key, rkey: key.rotate_left(16) };
        live.insert(a, keys);
        self.registered.fetch_add(1, Ordering::SeqCst);
        Ok(keys)
    }
    fn deregister(&self, keys: MrKeys) -> Result<()> {
        let removed = self.live.lock().remove(&keys.addr);
        assert_eq!(removed, Some(keys), "deregistered what was not registered");
        self.deregistered.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}
