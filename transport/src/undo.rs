//! An action owed on every way out of a scope but success: an error, an early return, or a
//! future dropped mid-way (a caller's deadline, the listener's timeout). Four hand-written
//! guards of the RDMA bootstrap had this shape; one type keeps the rule in one place.

/// Runs its action when dropped, unless [`done`](Self::done) was called first.
#[must_use = "dropped at once, it runs its action at once"]
pub(crate) struct Undo<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Undo<F> {
    pub(crate) fn new(action: F) -> Self {
        Undo(Some(action))
    }

    /// Success: the action is not owed.
    pub(crate) fn done(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for Undo<F> {
    fn drop(&mut self) {
        if let Some(action) = self.0.take() {
            action();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn the_action_runs_once_on_drop_and_never_after_done() {
        let ran = Cell::new(0);
        drop(Undo::new(|| ran.set(ran.get() + 1)));
        assert_eq!(ran.get(), 1);
        Undo::new(|| ran.set(ran.get() + 1)).done();
        assert_eq!(ran.get(), 1);
    }
}
