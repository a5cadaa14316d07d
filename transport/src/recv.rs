//! Receive buffers: a ring of registered buffers posted as receives, re-posted in batches of
//! half the depth. In the default mode each engine has its own ring on its QP's receive queue
//! and returns credits for what it re-posts; in SRQ mode the engines of one endpoint share
//! one ring on one shared receive queue (paper §6.2.2) and credits are off (RNR retry
//! absorbs exhaustion instead).

use bemalloc::Pool;
use bex_rnic::verbs::{RecvWr, SgList};

use crate::engine::RECV_TAG;
use crate::error::{Result, TransportError};
use crate::msg::Msg;
use crate::policy::credits::RecvCredits;

/// A ring of receive buffers.
#[derive(Debug)]
pub(crate) struct RecvRing {
    bufs: Vec<Option<Msg>>,
    free: Vec<usize>,
    pub credits: RecvCredits,
    pool: &'static Pool,
    dev: usize,
    buf_len: usize,
}

impl RecvRing {
    /// `depth` buffers of `buf_len` bytes.
    pub fn new(pool: &'static Pool, dev: usize, depth: u32, buf_len: usize) -> Result<RecvRing> {
        let mut bufs = Vec::with_capacity(depth as usize);
        for _ in 0..depth {
            bufs.push(Some(Msg::alloc(pool, buf_len)?));
        }
        Ok(RecvRing {
            bufs,
            free: Vec::new(),
            credits: RecvCredits::new(depth),
            pool,
            dev,
            buf_len,
        })
    }

    /// Work requests for every buffer (the initial post).
    pub fn all(&self) -> Vec<RecvWr> {
        (0..self.bufs.len()).map(|i| self.wr(i)).collect()
    }

    fn wr(&self, i: usize) -> RecvWr {
        let buf = self.bufs[i].as_ref().expect("posted receive has a buffer");
        RecvWr { wr_id: RECV_TAG | i as u64, sg_list: SgList::one(buf.sge(self.dev, 0, buf.len())) }
    }

    /// The buffer of slot `i` (None for a slot id that is not ours).
    pub fn get(&self, i: usize) -> Option<&Msg> {
        self.bufs.get(i).and_then(|b| b.as_ref())
    }

    /// Slots recycled and waiting for their batch to be posted.
    pub fn waiting(&self) -> usize {
        self.free.len()
    }

    /// Takes the buffer of slot `i` (it becomes a delivered message).
    pub fn take(&mut self, i: usize) -> Option<Msg> {
        self.bufs.get_mut(i).and_then(|b| b.take())
    }

    /// Slot `i` was consumed: give it a buffer again; returns the batch to re-post when one
    /// is due.
    pub fn recycle(&mut self, i: usize) -> Result<Vec<RecvWr>> {
        if i >= self.bufs.len() {
            return Err(TransportError::Invalid(format!("receive slot {i} out of range")));
        }
        if self.bufs[i].is_none() {
            self.bufs[i] = Some(Msg::alloc(self.pool, self.buf_len)?);
        }
        self.free.push(i);
        match self.credits.consumed() {
            Some(k) => {
                let take = (k as usize).min(self.free.len());
                let slots: Vec<usize> = self.free.drain(..take).collect();
                Ok(slots.iter().map(|&s| self.wr(s)).collect())
            }
            None => Ok(Vec::new()),
        }
    }
}
