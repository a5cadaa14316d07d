//! The engine's scheduler (paper §6.1): round-robin over sockets with work, at most one
//! fragment per turn, so with `n` active sockets and fragment size `S` at most `(n-1)·S` bytes
//! of other sockets are selected between two turns of one socket.

use std::collections::VecDeque;

/// Round-robin queue of ids with work; each id appears at most once.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    queue: VecDeque<u32>,
}

impl RoundRobin {
    /// Marks `id` as having work (no effect if it is already queued).
    pub fn activate(&mut self, id: u32) {
        if !self.queue.contains(&id) {
            self.queue.push_back(id);
        }
    }
    /// The next id to serve; the caller re-activates it if it still has work.
    pub fn pop(&mut self) -> Option<u32> {
        self.queue.pop_front()
    }
    /// Puts `id` back at the front (it could not be served this turn for lack of resources,
    /// and keeps its place).
    pub fn retry_first(&mut self, id: u32) {
        self.queue.push_front(id);
    }
    /// Ids waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }
    /// No id waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
    /// Removes `id` (its socket closed).
    pub fn remove(&mut self, id: u32) {
        self.queue.retain(|x| *x != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_in_turn_one_at_a_time() {
        let mut rr = RoundRobin::default();
        for id in [1, 2, 3, 2] {
            rr.activate(id);
        }
        let mut order = Vec::new();
        for _ in 0..6 {
            let id = rr.pop().unwrap();
            order.push(id);
            rr.activate(id);
        }
        assert_eq!(order, vec![1, 2, 3, 1, 2, 3]);
    }
}
