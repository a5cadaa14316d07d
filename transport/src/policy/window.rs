//! The per-engine software send window (paper §6.3): an admission bound on bytes outstanding
//! (posted, not yet completed), not congestion control. Off by default, as in the paper's
//! baseline.

/// Bytes outstanding against an optional bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWindow {
    cwnd: Option<u64>,
    outstanding: u64,
    /// Largest `outstanding` ever seen (for the "never exceeded" check).
    pub high_water: u64,
    /// Times a fragment waited for room.
    pub stalls: u64,
}

impl SendWindow {
    /// A window of `cwnd` bytes, or unbounded with `None`.
    pub fn new(cwnd: Option<u64>) -> SendWindow {
        SendWindow { cwnd, outstanding: 0, high_water: 0, stalls: 0 }
    }
    /// The bound.
    pub fn cwnd(&self) -> Option<u64> {
        self.cwnd
    }
    /// Bytes posted and not completed.
    pub fn outstanding(&self) -> u64 {
        self.outstanding
    }
    /// Admits `len` more bytes if they fit. A request larger than the whole window is admitted
    /// alone when nothing is outstanding, so a small window never deadlocks.
    pub fn try_admit(&mut self, len: u64) -> bool {
        let fits = match self.cwnd {
            None => true,
            Some(w) => self.outstanding + len <= w || self.outstanding == 0,
        };
        if fits {
            self.outstanding += len;
            self.high_water = self.high_water.max(self.outstanding);
            debug_assert!(
                self.cwnd.is_none_or(|w| self.outstanding <= w || self.outstanding == len),
                "{} B outstanding past a {:?} B window",
                self.outstanding,
                self.cwnd
            );
        } else {
            self.stalls += 1;
        }
        fits
    }
    /// `len` bytes completed (bytes this window admitted: the engine's own bookkeeping).
    pub fn complete(&mut self, len: u64) {
        debug_assert!(
            len <= self.outstanding,
            "completing {len} B with only {} B outstanding",
            self.outstanding
        );
        self.outstanding = self.outstanding.saturating_sub(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "completing 10 B with only 4 B outstanding")]
    fn completing_more_than_was_admitted_is_a_bug_caught_in_debug_builds() {
        let mut w = SendWindow::new(None);
        assert!(w.try_admit(4));
        w.complete(10);
    }

    #[test]
    fn bounds_outstanding_bytes() {
        let mut w = SendWindow::new(Some(8192));
        assert!(w.try_admit(4096));
        assert!(w.try_admit(4096));
        assert!(!w.try_admit(1));
        assert_eq!(w.stalls, 1);
        w.complete(4096);
        assert!(w.try_admit(4096));
        assert_eq!(w.high_water, 8192);
    }

    #[test]
    fn an_oversized_request_goes_alone() {
        let mut w = SendWindow::new(Some(1000));
        assert!(w.try_admit(5000));
        assert!(!w.try_admit(1));
        w.complete(5000);
        assert!(w.try_admit(1));
    }

    #[test]
    fn unbounded_admits_everything() {
        let mut w = SendWindow::new(None);
        assert!((0..1000).all(|_| w.try_admit(1 << 20)));
    }
}
