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
            // A full counter (2^64-2 events unread) cannot happen; ignore EAGAIN.
            let _ = self.event.write(1);
        }
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
            let _ = self.event.write(1);
        }
    }

    /// The event file descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// Consumes pending events.
    pub fn ack_events(&self) {
        // EAGAIN means no event was pending, which is fine.
        let _ = self.event.read();
    }
}
