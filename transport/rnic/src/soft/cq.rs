//! Completion queues of the software RNIC: a bounded queue the protocol core pushes into and
//! pollers drain, plus an eventfd that an armed queue signals.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::Mutex;

use crate::device::{Error, Result};
use crate::verbs::WorkCompletion;

/// The shared state of one completion queue.
#[derive(Debug)]
pub struct CqShared {
    queue: Mutex<VecDeque<WorkCompletion>>,
    depth: usize,
    armed: AtomicBool,
    /// Set when the eventfd was written and not yet read: waiters skip the read syscall
    /// when nothing signalled them.
    signalled: AtomicBool,
    overruns: AtomicU64,
    event: EventFd,
}

impl CqShared {
    /// A queue of `depth` entries.
    pub fn new(depth: usize) -> Result<CqShared> {
        let event =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Error::Os { what: "eventfd", source: e.into() })?;
        Ok(CqShared {
            queue: Mutex::new(VecDeque::with_capacity(depth)),
            depth,
            armed: AtomicBool::new(false),
            signalled: AtomicBool::new(false),
            overruns: AtomicU64::new(0),
            event,
        })
    }

    /// Appends a completion. The caller has finished every memory write the completion
    /// reports, and the queue's lock publishes them (release) to whoever polls it (acquire):
    /// a visible completion implies visible data.
    pub fn push(&self, wc: WorkCompletion) {
        {
            let mut q = self.queue.lock();
            if q.len() >= self.depth {
                // Hardware raises a CQ overrun; the queue is then unusable. Count and refuse.
                self.overruns.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.push_back(wc);
        }
        if self.armed.swap(false, Ordering::AcqRel) {
            self.signal();
        }
    }

    fn signal(&self) {
        // A full counter (2^64-2 events unread) cannot happen; ignore EAGAIN. The flag goes
        // up after the write (see `ack_events`).
        let _ = self.event.write(1);
        self.signalled.store(true, Ordering::Release);
    }

    /// Moves completions into `out`.
    pub fn pop_into(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if self.overruns.load(Ordering::Relaxed) > 0 {
            return Err(Error::Exhausted("completion queue overrun: completions were lost"));
        }
        let mut q = self.queue.lock();
        let n = q.len().min(out.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    /// True when a poll has something to report: completions or an overrun.
    pub fn pending(&self) -> bool {
        self.overruns.load(Ordering::Relaxed) > 0 || !self.is_empty()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Requests an event for the next completion.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::Release);
        // A completion that raced the arm is already queued: signal so no waiter sleeps on it.
        if !self.queue.lock().is_empty() && self.armed.swap(false, Ordering::AcqRel) {
            self.signal();
        }
    }

    /// Withdraws an arm that no completion consumed (a waiter woke for another reason, e.g.
    /// a packet): completions this thread now produces need no event.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// The event file descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// Consumes pending events.
    pub fn ack_events(&self) {
        // A write whose flag is not up yet stays readable and is read on a later call.
        if self.signalled.swap(false, Ordering::AcqRel) {
            // EAGAIN means the event was consumed already, which is fine.
            let _ = self.event.read();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(cq: &CqShared) -> bool {
        let mut fds = [nix::poll::PollFd::new(cq.fd(), nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).unwrap() == 1
    }

    #[test]
    fn an_armed_queue_signals_once_and_ack_clears_it() {
        let cq = CqShared::new(4).unwrap();
        cq.push(WorkCompletion::default());
        assert!(!readable(&cq), "an unarmed queue stays quiet");
        let mut out = [WorkCompletion::default(); 4];
        assert_eq!(cq.pop_into(&mut out).unwrap(), 1);
        cq.arm();
        cq.push(WorkCompletion::default());
        assert!(readable(&cq));
        cq.push(WorkCompletion::default());
        cq.ack_events();
        assert!(!readable(&cq), "one arm, one event, consumed by the ack");
        cq.ack_events();
        assert!(!readable(&cq));
    }

    #[test]
    fn arming_over_queued_completions_signals_at_once() {
        let cq = CqShared::new(4).unwrap();
        cq.push(WorkCompletion::default());
        cq.arm();
        assert!(readable(&cq));
        cq.ack_events();
        assert!(!readable(&cq));
    }

    #[test]
    fn a_withdrawn_arm_signals_nothing() {
        let cq = CqShared::new(4).unwrap();
        cq.arm();
        cq.disarm();
        cq.push(WorkCompletion::default());
        assert!(!readable(&cq));
        cq.arm();
        assert!(readable(&cq), "re-arming over the queued completion signals");
    }
}
