//! The parameter server's client side, apart from the server: what a ranker, a trainer or a
//! canary links (and the server too, for its own replication client and `/metrics`).
//!
//! - [`fanout`]: [`PsClient`], the fan-out client (keys split by shard, one sub-request per
//!   shard, rows merged back in request order; pushes numbered so a retry applies once);
//! - [`node`]: the NIC, transports and RPC client settings a cluster file names;
//! - [`connect`]: a client process's transports and `PsClient` from the cluster file
//!   ([`connect_client`]), with its `/metrics`;
//! - [`telemetry`]: the transport, NIC, pool, RPC and process series of `/metrics`.
#![forbid(unsafe_code)]

use bex_process::clock;
pub mod connect;
pub mod fanout;
pub mod node;
pub mod telemetry;

pub use connect::{connect_client, ClientNode};
pub use fanout::{PsClient, PsError};
pub use node::{ClientRole, SetupError};
