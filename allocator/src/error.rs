//! Errors of pool creation and allocation: values, never aborts.

/// Why an allocation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// The request is larger than the pool's whole reservation
    /// ([`crate::Pool::max_allocation`]); no amount of freeing helps.
    #[error("allocation of {requested} bytes exceeds the pool's maximum of {max}")]
    TooLarge {
        /// Bytes requested.
        requested: usize,
        /// The largest request the pool accepts.
        max: usize,
    },
    /// The pool's reservation has no room for another block (and jemalloc had no free memory
    /// of the right size): free something, or make the pool with a larger `reserve_bytes`.
    #[error("out of registered memory: {requested} bytes requested, {carved} of {reserved} reserved bytes are in blocks")]
    OutOfMemory {
        /// Bytes requested.
        requested: usize,
        /// The pool's reservation.
        reserved: usize,
        /// Bytes of the reservation already in blocks.
        carved: usize,
    },
    /// A new block was needed and could not be made usable (a device refused to register it,
    /// or the OS refused to commit it).
    #[error("could not obtain a registered block: {0}")]
    Register(#[from] RegisterError),
}

/// Why a block could not be registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Device number `device` (its index in the pool's device list) refused the registration;
    /// the block was deregistered from the devices before it.
    #[error("device {device} refused the registration: {error}")]
    Device {
        /// Index of the device in the pool.
        device: usize,
        /// What the device said.
        #[source]
        error: bex_rnic::Error,
    },
    /// The OS refused to make the block readable and writable.
    #[error("committing the block failed: {0}")]
    Commit(#[source] std::io::Error),
}

/// Why a pool could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// More devices than [`crate::MAX_DEVICES`].
    #[error("{given} devices given, at most {max} supported")]
    TooManyDevices {
        /// Devices given.
        given: usize,
        /// The limit.
        max: usize,
    },
    /// A [`crate::PoolConfig`] value is out of range (the text says which).
    #[error("invalid pool configuration: {0}")]
    Config(&'static str),
    /// Reserving the address space failed.
    #[error("reserving address space failed: {0}")]
    Reserve(#[source] std::io::Error),
    /// jemalloc refused to create or configure the arena.
    #[error("jemalloc: {0}")]
    Jemalloc(String),
    /// The arena's first block (jemalloc's metadata) could not be registered.
    #[error("registering the first block failed: {0}")]
    Register(#[source] RegisterError),
}
