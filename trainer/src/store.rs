//! Where parameters live: the trait the training loop talks to, the real sharded PS
//! ([`PsStore`]) and an in-process table set ([`MemStore`], for tests and offline tuning,
//! applying the same optimizers the servers do).

use std::future::Future;
use std::sync::Arc;

use bex_client::fanout::PsClient;
use bex_ps_core::Table;
use bex_ps_proto::Config;

/// A failed fetch or push, as text (the loop only counts and reports it).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

/// Rows by key, and gradients applied by the store's optimizer.
pub trait ParamStore {
    /// Rows of `keys` (`keys.len() × dim`, in order) from table `table`.
    fn fetch(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
    ) -> impl Future<Output = Result<Vec<f32>, StoreError>> + Send;

    /// Applies one gradient row per key (`keys.len() × dim`).
    fn push(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The sharded, replicated PS.
#[derive(Debug, Clone)]
pub struct PsStore(pub Arc<PsClient>);

impl ParamStore for PsStore {
    async fn fetch(&self, table: u32, dim: u32, keys: &[u64]) -> Result<Vec<f32>, StoreError> {
        self.0.fetch(table, dim, keys).await.map_err(|e| StoreError(e.to_string()))
    }

    async fn push(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> Result<(), StoreError> {
        self.0.push(table, dim, keys, grads).await.map_err(|e| StoreError(e.to_string()))
    }
}

/// The cluster's tables in this process (one shard, no network).
#[derive(Debug)]
pub struct MemStore {
    tables: Vec<Table>,
    /// Pushes so far: the push clock of these tables (a row's version is its last push,
    /// as a server's wall clock makes it), so bounded tables keep the recently pushed.
    pushes: std::sync::atomic::AtomicU64,
}

impl MemStore {
    /// The tables of `cfg`, empty.
    pub fn new(cfg: &Config) -> Result<MemStore, StoreError> {
        let tables = cfg
            .table_specs()
            .into_iter()
            .map(Table::new)
            .collect::<Result<_, _>>()
            .map_err(|e| StoreError(e.to_string()))?;
        Ok(MemStore { tables, pushes: std::sync::atomic::AtomicU64::new(0) })
    }

    /// Rows table `name` holds (0 for no such table).
    pub fn rows(&self, name: &str) -> u64 {
        self.tables.iter().find(|t| t.spec().name == name).map_or(0, Table::rows)
    }

    fn table(&self, id: u32, dim: u32) -> Result<&Table, StoreError> {
        match self.tables.get(id as usize) {
            Some(t) if t.dim() == dim as usize => Ok(t),
            Some(t) => Err(StoreError(format!("table {id} has dim {}, not {dim}", t.dim()))),
            None => Err(StoreError(format!("no table {id}"))),
        }
    }
}

impl ParamStore for MemStore {
    async fn fetch(&self, table: u32, dim: u32, keys: &[u64]) -> Result<Vec<f32>, StoreError> {
        let t = self.table(table, dim)?;
        let mut out = vec![0.0; keys.len() * dim as usize];
        t.fetch_into(keys, &mut out).map_err(|e| StoreError(e.to_string()))?;
        Ok(out)
    }

    async fn push(
        &self,
        table: u32,
        dim: u32,
        keys: &[u64],
        grads: &[f32],
    ) -> Result<(), StoreError> {
        let t = self.table(table, dim)?;
        let now = self.pushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        t.raise_version_floor(now);
        t.push(keys, grads, None).map(|_| ()).map_err(|e| StoreError(e.to_string()))
    }
}
