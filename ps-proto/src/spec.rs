//! A table's definition, the same on every server and client of a cluster (it comes from the
//! cluster file): name, dimension, the deterministic initializer of rows never pushed, and
//! the optimizer pushes go through. The storage that holds the rows is the server's
//! (`bex-ps-core`).

use serde::{Deserialize, Serialize};

use crate::config::FieldError;
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::wire::MAX_DIM;

/// Longest table name in bytes.
pub const MAX_TABLE_NAME: usize = 64;

/// The definition of a table. The same value on every server of a cluster (it comes from
/// the cluster configuration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    /// Name: 1..=64 bytes of `[A-Za-z0-9_.-]`.
    pub name: String,
    /// Row dimension, `1..=4096`.
    pub dim: u32,
    /// Initializer seed (with the key, decides initial rows).
    pub seed: u64,
    /// How missing rows start.
    pub init: Initializer,
    /// How pushes update rows.
    pub optimizer: Optimizer,
}

impl TableSpec {
    /// Problems with the definition; fields are relative (`dim`, `optimizer.lr`, …).
    pub fn check(&self) -> Vec<FieldError> {
        let mut out = Vec::new();
        let name_ok = !self.name.is_empty()
            && self.name.len() <= MAX_TABLE_NAME
            && self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !name_ok {
            out.push(FieldError::new("name", "must be 1..=64 bytes of [A-Za-z0-9_.-]"));
        }
        if !(1..=MAX_DIM).contains(&self.dim) {
            out.push(FieldError::new("dim", format!("must be in 1..={MAX_DIM}")));
        }
        for (f, m) in self.init.check() {
            out.push(FieldError::new(format!("init.{f}"), m));
        }
        for (f, m) in self.optimizer.check() {
            out.push(FieldError::new(format!("optimizer.{f}"), m));
        }
        out
    }

    /// f32 per stored row: values and optimizer state.
    pub fn stride(&self) -> usize {
        self.dim as usize * (1 + self.optimizer.state_slots())
    }
}

/// Words a whole row carries after its `stride` f32 in a Replicate with state: the step
/// count's bits, then the version's low and high 32 bits.
pub const STATE_EXTRA_WORDS: usize = 3;
