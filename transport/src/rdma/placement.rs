//! Which endpoint (CQ and driver) hosts a new engine: round robin among those with room for
//! its completions, the place given back unless the bootstrap completes.

use super::*;

impl<D: Device + 'static> FactoryImpl<D> {
    /// Completion entries one engine may need on its endpoint's CQ.
    pub(super) fn cq_entries_per_engine(&self) -> usize {
        let receives = if self.cfg.srq { 0 } else { self.cfg.rq_depth };
        (self.cfg.sq_depth + receives) as usize
    }

    /// Picks an endpoint (round-robin) whose CQ has room for one more engine.
    pub(super) fn place_engine(&self) -> Result<usize> {
        let n = self.cqs.len();
        let shared = if self.cfg.srq { self.cfg.srq_depth as usize } else { 0 };
        let room =
            (self.cfg.cq_depth as usize).saturating_sub(shared) / self.cq_entries_per_engine();
        let start = self.next_endpoint.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let w = (start + k) % n;
            let c = &self.engine_counts[w];
            let mut cur = c.load(Ordering::Acquire);
            while cur < room {
                match c.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(w),
                    Err(now) => cur = now,
                }
            }
        }
        Err(TransportError::Refused(format!(
            "every endpoint's CQ is full ({room} engines of {} entries each per {} entries): raise cq_depth or endpoints",
            self.cq_entries_per_engine(),
            self.cfg.cq_depth
        )))
    }
}
