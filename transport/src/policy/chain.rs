//! The send-side work-request chain of an engine (paper §5.4.1, Figure 7): a circular array
//! as deep as the send queue, split into three contiguous segments — *in flight* (posted,
//! awaiting completion), *pending* (prepared, not yet posted) and *free*. Pending requests are
//! posted together with one doorbell, only the last signaled; a signaled completion retires
//! every slot up to it.

/// Index of a slot in the chain.
pub type Slot = usize;

/// Segment boundaries of the chain.
#[derive(Clone, Debug)]
pub struct WrChain {
    depth: usize,
    /// First in-flight slot.
    head: usize,
    in_flight: usize,
    pending: usize,
}

impl WrChain {
    /// A chain of `depth` slots (the send-queue depth), all free.
    pub fn new(depth: usize) -> WrChain {
        assert!(depth > 0, "a chain needs at least one slot");
        WrChain { depth, head: 0, in_flight: 0, pending: 0 }
    }

    /// Number of slots.
    pub fn depth(&self) -> usize {
        self.depth
    }
    /// Slots posted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }
    /// Slots prepared and not yet posted.
    pub fn pending(&self) -> usize {
        self.pending
    }
    /// Slots available for new requests.
    pub fn free(&self) -> usize {
        self.depth - self.in_flight - self.pending
    }

    /// Takes the next free slot for a new pending request.
    pub fn reserve(&mut self) -> Option<Slot> {
        if self.free() == 0 {
            return None;
        }
        let slot = (self.head + self.in_flight + self.pending) % self.depth;
        self.pending += 1;
        Some(slot)
    }

    /// The pending slots, in posting order.
    pub fn pending_slots(&self) -> impl Iterator<Item = Slot> + '_ {
        let start = self.head + self.in_flight;
        (0..self.pending).map(move |i| (start + i) % self.depth)
    }

    /// The first `n` pending slots were posted: they are in flight now.
    pub fn posted(&mut self, n: usize) {
        assert!(n <= self.pending, "posted more than was pending");
        self.pending -= n;
        self.in_flight += n;
    }

    /// A completion for `slot` arrived: it and every in-flight slot before it retire. Returns
    /// the retired slots in order (empty if `slot` is not in flight).
    pub fn retire_through(&mut self, slot: Slot) -> std::ops::Range<usize> {
        let offset = (slot + self.depth - self.head) % self.depth;
        if offset >= self.in_flight {
            return 0..0;
        }
        let n = offset + 1;
        let start = self.head;
        self.head = (self.head + n) % self.depth;
        self.in_flight -= n;
        start..start + n
    }

    /// Maps an index from [`WrChain::retire_through`]'s range back to a slot.
    pub fn slot_at(&self, i: usize) -> Slot {
        i % self.depth
    }

    /// Forgets everything in flight and pending (the QP failed; its requests are flushed).
    pub fn reset(&mut self) -> std::ops::Range<usize> {
        let start = self.head;
        let n = self.in_flight + self.pending;
        self.head = (self.head + n) % self.depth;
        self.in_flight = 0;
        self.pending = 0;
        start..start + n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_stay_contiguous_around_the_ring() {
        let mut c = WrChain::new(4);
        for round in 0..10 {
            let a = c.reserve().unwrap();
            let b = c.reserve().unwrap();
            assert_eq!(b, (a + 1) % 4, "round {round}");
            assert_eq!(c.pending_slots().collect::<Vec<_>>(), vec![a, b]);
            c.posted(2);
            assert_eq!(c.free(), 2);
            let retired: Vec<_> = c.retire_through(b).map(|i| c.slot_at(i)).collect();
            assert_eq!(retired, vec![a, b]);
            assert_eq!(c.free(), 4);
        }
    }

    #[test]
    fn never_hands_out_more_than_depth() {
        let mut c = WrChain::new(3);
        assert!(c.reserve().is_some() && c.reserve().is_some() && c.reserve().is_some());
        assert_eq!(c.reserve(), None);
        c.posted(3);
        assert_eq!(c.reserve(), None);
        assert_eq!(c.retire_through(0).len(), 1);
        assert!(c.reserve().is_some());
    }

    #[test]
    fn a_signaled_completion_retires_the_unsignaled_before_it() {
        let mut c = WrChain::new(8);
        let slots: Vec<_> = (0..5).map(|_| c.reserve().unwrap()).collect();
        c.posted(5);
        assert_eq!(c.retire_through(slots[2]).len(), 3);
        assert_eq!(c.in_flight(), 2);
        // A stale completion (already retired) retires nothing.
        assert_eq!(c.retire_through(slots[1]).len(), 0);
        assert_eq!(c.retire_through(slots[4]).len(), 2);
    }
}
