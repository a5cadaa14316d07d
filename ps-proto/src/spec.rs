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
    /// Which keys get a row (feature admission).
    #[serde(default)]
    pub admission: Admission,
    /// How many rows a shard keeps, and for how long.
    #[serde(default)]
    pub capacity: Capacity,
}

/// The bound on a table's rows in each shard. A row's version is the time of its last push
/// (µs since the Unix epoch on the training pod, never going back), carried by every copy
/// of the row, so every pod orders rows alike: a shard keeps the most recently pushed rows
/// within `max_rows` / `max_bytes` (per stripe: each of the 64 stripes keeps its share) and
/// drops rows not pushed for `ttl_s`. The same rows leave every pod, with no message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Capacity {
    /// Most rows per shard; 0: no bound. At least 64 (one per stripe) when set.
    pub max_rows: u64,
    /// Most bytes of rows per shard, counted as [`TableSpec::row_bytes`] each; 0: no bound.
    pub max_bytes: u64,
    /// Rows not pushed for this many seconds are dropped; 0: never. Measured from the
    /// table's newest push (capped near the wall clock), so nothing expires while training
    /// is paused; the first push after the pause moves the clock on.
    pub ttl_s: u64,
}

/// Feature admission: a key gets a row only after it has been pushed `after_pushes` times.
/// Until then fetches return its initial row and create nothing, and its pushes are counted
/// (in a count-min sketch per stripe) and not applied. Only the training pod takes pushes,
/// so it alone decides; replicas receive admitted rows by replication.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    /// Pushes a key needs before it gets a row; 0: every key gets a row at its first fetch
    /// on the training pod or first push (no sketch).
    pub after_pushes: u32,
    /// Counters per sketch row and stripe (a power of two, 64..=2^20); the counts halve
    /// after this many pushes of unadmitted keys to the stripe, so a key must reach
    /// `after_pushes` within about `64 × sketch_width` such pushes to the table. Memory:
    /// 64 stripes × 4 rows × 2 bytes × this, per table.
    pub sketch_width: u32,
}

impl Default for Admission {
    fn default() -> Admission {
        Admission { after_pushes: 0, sketch_width: 1 << 14 }
    }
}

/// The most pushes admission can count per key (sketch counters are 16-bit).
pub const MAX_ADMIT_AFTER: u32 = u16::MAX as u32;

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
        if self.admission.after_pushes > MAX_ADMIT_AFTER {
            out.push(FieldError::new(
                "admission.after_pushes",
                format!("must be at most {MAX_ADMIT_AFTER}"),
            ));
        }
        if self.max_rows().is_some_and(|n| n < 64) {
            out.push(FieldError::new(
                "capacity",
                format!(
                    "max_rows, or max_bytes / {} bytes a row, must be at least 64 (a row per stripe)",
                    self.row_bytes()
                ),
            ));
        }
        let w = self.admission.sketch_width;
        if !w.is_power_of_two() || !(64..=1 << 20).contains(&w) {
            out.push(FieldError::new(
                "admission.sketch_width",
                "must be a power of two in 64..=1048576",
            ));
        } else if self.admission.after_pushes > w {
            // Counts halve every `w` additions: a key could never get there.
            out.push(FieldError::new(
                "admission.after_pushes",
                format!("must be at most sketch_width ({w}): counts halve every {w} pushes"),
            ));
        }
        out
    }

    /// f32 per stored row: values and optimizer state.
    pub fn stride(&self) -> usize {
        self.dim as usize * (1 + self.optimizer.state_slots())
    }

    /// What one row costs a bounded shard, as `capacity.max_bytes` counts it: values and
    /// state, key, step count and version, and about 40 bytes of index and eviction order.
    pub fn row_bytes(&self) -> u64 {
        4 * self.stride() as u64 + 8 + 4 + 8 + 40
    }

    /// The most rows a shard keeps (`None`: unbounded).
    pub fn max_rows(&self) -> Option<u64> {
        let c = self.capacity;
        let by_bytes = (c.max_bytes > 0).then(|| c.max_bytes / self.row_bytes());
        let by_rows = (c.max_rows > 0).then_some(c.max_rows);
        match (by_rows, by_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// How another pod's table definitions differ from this pod's ([`compare_definitions`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DefinitionDiff {
    /// Rows of one pod cannot be stored as the other's: the tables, their order or names, a
    /// dim, or an optimizer kind (another state layout). No row may be copied between them.
    pub layout: Vec<String>,
    /// Rows copy alike, but an absent key's row is its initial row, and these pods make it
    /// otherwise, for good: an initializer or a seed.
    pub initial_rows: Vec<String>,
    /// Differences a rolling change passes through, gone once every pod runs the new file:
    /// capacity and admission (which rows a pod keeps: the same rows again after every pod
    /// restarted) and optimizer hyperparameters (only the training pod applies pushes).
    pub converging: Vec<String>,
}

impl DefinitionDiff {
    /// No difference.
    pub fn is_empty(&self) -> bool {
        self.layout.is_empty() && self.initial_rows.is_empty() && self.converging.is_empty()
    }
}

/// Compares this pod's table definitions with a peer's, table by table (ids are positions).
pub fn compare_definitions(here: &[TableSpec], peer: &[TableSpec]) -> DefinitionDiff {
    let mut d = DefinitionDiff::default();
    if here.len() != peer.len() {
        d.layout.push(format!("{} tables here, {} at the peer", here.len(), peer.len()));
    }
    #[derive(Clone, Copy)]
    enum Kind {
        Layout,
        InitialRows,
        Converging,
    }
    use Kind::*;
    for (id, (h, p)) in here.iter().zip(peer).enumerate() {
        let mut differ = |kind: Kind, field: &str, here: String, peer: String| {
            if here != peer {
                let why =
                    format!("table {id} ('{}') {field}: {here} here, {peer} at the peer", h.name);
                match kind {
                    Layout => &mut d.layout,
                    InitialRows => &mut d.initial_rows,
                    Converging => &mut d.converging,
                }
                .push(why);
            }
        };
        differ(Layout, "name", h.name.clone(), p.name.clone());
        differ(Layout, "dim", h.dim.to_string(), p.dim.to_string());
        let kind = |s: &TableSpec| format!("{:?}", s.optimizer.kind());
        differ(Layout, "optimizer", kind(h), kind(p));
        differ(InitialRows, "seed", h.seed.to_string(), p.seed.to_string());
        differ(InitialRows, "init", format!("{:?}", h.init), format!("{:?}", p.init));
        if h.optimizer.kind() == p.optimizer.kind() {
            let (ho, po) = (format!("{:?}", h.optimizer), format!("{:?}", p.optimizer));
            differ(Converging, "optimizer", ho, po);
        }
        differ(Converging, "admission", format!("{:?}", h.admission), format!("{:?}", p.admission));
        differ(Converging, "capacity", format!("{:?}", h.capacity), format!("{:?}", p.capacity));
    }
    d
}

/// Words a whole row carries after its `stride` f32 in a Replicate with state: the step
/// count's bits, then the version's low and high 32 bits.
pub const STATE_EXTRA_WORDS: usize = 3;

#[cfg(test)]
mod tests {
    use super::*;

    fn table(name: &str) -> TableSpec {
        TableSpec {
            name: name.into(),
            dim: 8,
            seed: 7,
            init: Initializer::default(),
            optimizer: Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 },
            admission: Admission::default(),
            capacity: Capacity::default(),
        }
    }

    #[test]
    fn definitions_differ_in_layout_initial_rows_or_converging_settings() {
        let here = vec![table("a"), table("b")];
        assert!(compare_definitions(&here, &here.clone()).is_empty());

        let mut peer = here.clone();
        peer[1].seed = 8;
        peer[0].capacity.max_rows = 1000;
        peer[0].optimizer = Optimizer::Adagrad { lr: 0.2, initial_accumulator: 0.1, eps: 1e-8 };
        let d = compare_definitions(&here, &peer);
        assert!(d.layout.is_empty(), "{:?}", d.layout);
        assert_eq!(d.initial_rows, ["table 1 ('b') seed: 7 here, 8 at the peer"]);
        assert_eq!(d.converging.len(), 2, "{:?}", d.converging);
        assert!(d.converging[0].starts_with("table 0 ('a') optimizer: Adagrad { lr: 0.1"));
        assert!(d.converging[1].starts_with("table 0 ('a') capacity:"));

        // Another kind is one incompatible difference, not also a converging one.
        let mut peer = here.clone();
        peer[0].optimizer = Optimizer::Sgd { lr: 0.1 };
        let d = compare_definitions(&here, &peer);
        assert_eq!(d.layout, ["table 0 ('a') optimizer: Adagrad here, Sgd at the peer"]);
        assert!(d.converging.is_empty() && d.initial_rows.is_empty());

        let d = compare_definitions(&here, &[table("b"), table("a"), table("c")]);
        assert_eq!(d.layout.len(), 3, "count and both names: {:?}", d.layout);
        assert_eq!(d.layout[0], "2 tables here, 3 at the peer");
    }

    #[test]
    fn capacity_in_bytes_counts_row_bytes_a_row_and_the_smaller_bound_wins() {
        let mut t = table("a");
        // dim 8, Adagrad: 16 f32 of values and state, then key, steps, version and index.
        assert_eq!(t.row_bytes(), 4 * 16 + 8 + 4 + 8 + 40);
        assert_eq!(t.max_rows(), None);
        t.capacity.max_bytes = 1000 * t.row_bytes() + t.row_bytes() - 1;
        assert_eq!(t.max_rows(), Some(1000), "whole rows only");
        t.capacity.max_rows = 500;
        assert_eq!(t.max_rows(), Some(500));
        t.capacity.max_rows = 5000;
        assert_eq!(t.max_rows(), Some(1000));
        assert!(t.check().is_empty(), "{:?}", t.check());
        // Fewer bytes than a row per stripe is refused, naming the row's cost.
        t.capacity = Capacity { max_bytes: 63 * t.row_bytes(), ..Capacity::default() };
        let e = t.check();
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].to_string().contains("max_bytes / 124 bytes a row"), "{}", e[0]);
    }
}
