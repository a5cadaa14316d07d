//! Control messages: the bodies of the non-data ops (Tables, Health, Checkpoint, Admin,
//! Snapshot), serde types encoded with postcard (compact, maintained, stable wire format) by
//! [`wire::encode_control_request_into`](crate::wire::encode_control_request_into) and
//! friends. They are off the hot path; rows never travel here.
//!
//! | op | request body | Ok response body |
//! | --- | --- | --- |
//! | Tables | `()` | [`TablesInfo`] |
//! | Health | `()` | [`HealthInfo`] |
//! | Checkpoint | [`CheckpointRequest`] | [`CheckpointSummary`] |
//! | Admin | [`AdminRequest`] | [`AdminResponse`] |
//! | Snapshot | [`SnapshotRequest`] | a binary snapshot chunk (`bex_ps_core::checkpoint`) |
//!
//! Postcard is not self-describing: adding a field or variant is a protocol change (bump
//! [`WIRE_VERSION`](crate::wire::WIRE_VERSION) or add a new op).

use serde::{Deserialize, Serialize};

use crate::spec::TableSpec;

/// One table as the server knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableInfo {
    /// Id used in request headers.
    pub id: u32,
    /// Definition.
    pub spec: TableSpec,
}

/// Body of a Tables response: what a client's cluster file must agree with before it
/// routes a key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TablesInfo {
    /// Every table, by id.
    pub tables: Vec<TableInfo>,
    /// Shards per pod in the answering server's configuration: a client that counts
    /// otherwise sends keys to servers that do not own them.
    pub shards: u32,
}

/// Whether a server's pod trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Applies pushes and forwards the results to the other pods.
    Training,
    /// Serves fetches; takes replicated rows from the training pod.
    Replica,
}

/// Lifecycle of a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServingState {
    /// Starting up.
    Starting,
    /// Loading its checkpoint.
    Restoring,
    /// Copying state from a peer.
    Bootstrapping,
    /// Serving.
    Serving,
    /// Shutting down: finishing in-flight work, refusing new requests.
    Draining,
}

/// Per-table statistics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableStats {
    /// Table id.
    pub id: u32,
    /// Table name.
    pub name: String,
    /// Rows stored.
    pub rows: u64,
    /// Approximate bytes of memory held.
    pub bytes: u64,
}

/// Replication as seen by one server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicationStatus {
    /// Training pod: the last Replicate request acknowledged; replica: highest applied.
    pub seq: u64,
    /// Training pod: updates (changed rows) not yet acknowledged by every replica;
    /// replica: 0.
    pub lag_updates: u64,
    /// Age in ms of the oldest unacknowledged (training) or last applied (replica) update.
    pub lag_ms: u64,
}

/// The result of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointSummary {
    /// File written.
    pub path: String,
    /// Rows written.
    pub rows: u64,
    /// File size.
    pub bytes: u64,
    /// CRC-32 of the body.
    pub body_crc32: u32,
    /// Replication sequence recorded in the checkpoint.
    pub update_seq: u64,
    /// Creation time (ms since the Unix epoch, from the server's clock).
    pub created_ms: u64,
}

/// Body of a Health response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HealthInfo {
    /// Pod of the server.
    pub pod: u32,
    /// Shard of the server.
    pub shard: u32,
    /// Training or replica.
    pub role: Role,
    /// Lifecycle state.
    pub state: ServingState,
    /// Time since start.
    pub uptime_ms: u64,
    /// Tables.
    pub tables: Vec<TableStats>,
    /// Replication.
    pub replication: ReplicationStatus,
    /// The last checkpoint written or restored.
    pub last_checkpoint: Option<CheckpointSummary>,
}

/// Body of a Checkpoint request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// Answer after the checkpoint is durable (else as soon as it is started).
    pub wait: bool,
}

/// Body of an Admin request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdminRequest {
    /// No effect; answers Ok.
    Ping,
    /// Refuse (true) or accept (false) Push and Replicate.
    SetReadOnly(bool),
    /// Refused (answered BadControl; kept so the later variants keep their wire codes):
    /// forgetting the dedupe windows would apply retried pushes twice.
    ResetDedupe,
    /// Begin a clean shutdown.
    Shutdown,
    /// Takes this server's RDMA transport out of service (`false`) or back in (`true`):
    /// clients see an RDMA failure and fall back to TCP, then re-probe.
    SetRdma(bool),
}

/// Body of an Admin response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminResponse {
    /// What was done.
    pub message: String,
}

/// Where a streaming snapshot continues: rows `row..` of stripe `stripe` of table `table`,
/// in the table layout of the process whose `epoch` it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SnapshotCursor {
    /// The serving process's table-set epoch (0 at [`START`](Self::START)); a cursor from
    /// another epoch (the peer restarted) is refused, and the snapshot restarts.
    pub epoch: u64,
    /// Table id.
    pub table: u32,
    /// Stripe of the table.
    pub stripe: u32,
    /// Row within the stripe.
    pub row: u32,
}

impl SnapshotCursor {
    /// The beginning of a snapshot.
    pub const START: SnapshotCursor = SnapshotCursor { epoch: 0, table: 0, stripe: 0, row: 0 };
}

/// Body of a Snapshot request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// Where to continue ([`SnapshotCursor::START`] first, then each chunk's `next`).
    pub cursor: SnapshotCursor,
    /// Largest chunk to return (at least one row is returned if any remain).
    pub max_bytes: u32,
}
