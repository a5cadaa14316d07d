//! Small pure policy types of the engine, each with its own tests; the engine composes them.

pub mod chain;
pub mod credits;
pub mod keepalive;
pub mod sched;
pub mod window;
