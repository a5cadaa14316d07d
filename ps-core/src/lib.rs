//! `bex-ps-core`: the parameter server's state, with no I/O but files (DESIGN §7). What
//! clients share with servers — wire format, config, table definitions, fan-out — is
//! `bex-ps-proto`.
//!
//! - [`table`]: named tables over striped concurrent storage: rows created by their
//!   deterministic initializer, updated by their optimizer, versioned for replication.
//! - [`admission`]: the count-min sketch that decides which keys get a row.
//! - [`dedupe`]: push idempotence by (client id, sequence) in bounded per-client windows.
//! - [`checkpoint`]: atomic checksummed checkpoint files and the streaming snapshot chunks
//!   that bootstrap a replica from a peer.
//! - [`replication`]: the training pod's replication lag bookkeeping.
//! - [`prefetch`]: the cache hint the table's warm pass issues (this crate's one `unsafe`).
//!
//! Nothing here reads a clock or sleeps; callers pass times in.
#![deny(unsafe_code)]

pub mod admission;
pub mod checkpoint;
pub mod dedupe;
pub mod prefetch;
pub mod replication;
mod row_index;
pub mod table;

pub use table::{ExportRows, SeenRow, Table, TableSet};

/// The tests' one wall-clock read (an origin to add durations to; nothing waits on it).
#[cfg(test)]
pub(crate) mod test_clock {
    /// Some instant.
    #[allow(clippy::disallowed_methods)] // the single sanctioned wall-clock read of this crate
    pub fn origin() -> std::time::Instant {
        std::time::Instant::now()
    }
}
