//! `bex._bex`, the native half of the `bex` Python package: a [`PsClient`] behind a Python
//! class, with numpy arrays in and out.
//!
//! Every call releases the GIL while it waits on the network, so many Python threads can
//! have requests outstanding on one client (the client is `Sync`; its calls run on a small
//! tokio runtime of its own). What is copied: the keys once, into a Rust `Vec`, before the
//! GIL is released (a caller's thread could change the numpy array while the request is in
//! flight); fetched rows are merged from the receive buffers straight into the `Vec` that
//! becomes the returned array (numpy takes ownership of it, no second copy); gradients are
//! copied once, like the keys. The wire encoding of keys and gradients into registered
//! frames is the client's own copy, as in Rust.
#![forbid(unsafe_code)]

mod data;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;

use bex_client::{connect_client, ClientRole, PsClient, PsError};
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::wire::Status;
use bex_ps_proto::Config;
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

pyo3::create_exception!(bex, BexError, PyException, "Any failure of a bex call.");
pyo3::create_exception!(bex, ConfigError, BexError, "The cluster file or an argument is invalid.");
pyo3::create_exception!(
    bex,
    RpcError,
    BexError,
    "No replica answered within the deadlines and retries (the cluster is unreachable, \
     overloaded or restarting)."
);
pyo3::create_exception!(
    bex,
    ServerError,
    BexError,
    "A server answered with an error status; the subclass is named after the status."
);
pyo3::create_exception!(bex, ProtocolError, BexError, "A malformed reply.");
/// One `ServerError` subclass per error status, named after it: the classes, the mapping
/// from a status and the module registration come from this one list.
macro_rules! status_exceptions {
    ($($status:ident),* $(,)?) => {
        $(pyo3::create_exception!(bex, $status, ServerError, concat!("Status ", stringify!($status), "."));)*

        fn status_error(status: Status, text: String) -> PyErr {
            match status {
                $(Status::$status => $status::new_err(text),)*
                // Not errors: the client never reports them as failures.
                Status::Ok | Status::Duplicate => ServerError::new_err(text),
            }
        }

        fn add_status_exceptions(m: &Bound<'_, PyModule>) -> PyResult<()> {
            $(m.add(stringify!($status), m.py().get_type::<$status>())?;)*
            Ok(())
        }
    };
}

status_exceptions!(
    TooOld,
    BadFrame,
    UnknownTable,
    WrongDim,
    TooLarge,
    UnknownOp,
    NotTraining,
    Unavailable,
    Overloaded,
    Internal,
    BadControl,
    BadValue,
);

/// The Python exception for a failed PS call: a [`ServerError`] subclass named after the
/// server's status, [`RpcError`] when no replica answered, [`ProtocolError`] otherwise.
fn to_py(e: PsError) -> PyErr {
    let text = e.to_string();
    match e {
        PsError::Rpc(_) => RpcError::new_err(text),
        PsError::Protocol(_) => ProtocolError::new_err(text),
        PsError::Layout(_) => ConfigError::new_err(text),
        PsError::Server { status, .. } => status_error(status, text),
    }
}

/// A table of the cluster: its id on the wire, name and row width.
#[pyclass(frozen, get_all, module = "bex")]
#[derive(Clone, Debug)]
struct Table {
    /// Id on the wire (its position in the cluster file).
    id: u32,
    /// Name.
    name: String,
    /// Row width (float32 values per row).
    dim: u32,
}

#[pymethods]
impl Table {
    fn __repr__(&self) -> String {
        format!("Table(id={}, name={:?}, dim={})", self.id, self.name, self.dim)
    }
}

/// A client of a running bex cluster.
#[pyclass(frozen, module = "bex")]
struct Client {
    ps: ForkGuarded<Arc<PsClient>>,
    tables: Vec<Table>,
    transport: TransportKind,
    /// The process that built the runtime (a forked child has none of its threads).
    pid: u32,
    // Dropped last: the client's transports run on it.
    runtime: ForkGuarded<tokio::runtime::Runtime>,
}

/// A part of the client that is dropped only in the process that made it. In a forked child
/// the runtime's threads do not exist: dropping the runtime waits for them for ever (a
/// DataLoader worker replacing its inherited client hung), so there it is leaked instead.
struct ForkGuarded<T> {
    value: Option<T>,
    pid: u32,
}

impl<T> ForkGuarded<T> {
    fn new(value: T) -> ForkGuarded<T> {
        ForkGuarded { value: Some(value), pid: std::process::id() }
    }
}

impl<T> std::ops::Deref for ForkGuarded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("present until dropped")
    }
}

impl<T> Drop for ForkGuarded<T> {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            std::mem::forget(self.value.take());
        }
    }
}

/// How long a waiting call keeps the GIL released before checking for signals.
const SIGNAL_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// `table` given as a name or an id.
#[derive(FromPyObject)]
enum TableRef {
    Id(u32),
    Name(String),
}

impl Client {
    /// Runs a PS call as a task on the client's runtime and waits for it on this thread.
    ///
    /// Why not `runtime.block_on(call)`: that polls the call on this (Python) thread while
    /// the runtime's workers own the sockets, so each step of a request crosses between
    /// threads. As a task, the call runs where its I/O completes, as in a Rust client, and
    /// this thread is woken once, with the result. Measured (python/bench/fetch.py, 1000-key
    /// fetches, all threads of the process): 4.6-6.3 context switches per call with
    /// `block_on` or a task on two workers, 3.5 with a task on one worker (the default), and
    /// 1.1 for ps-bench, whose caller is itself a task.
    ///
    /// The GIL is released while waiting, taken back every [`SIGNAL_CHECK`] to let Ctrl-C
    /// through: then the call raises `KeyboardInterrupt` and its task finishes unobserved
    /// (a push may still be applied).
    fn call<T: Send + 'static>(
        &self,
        py: Python<'_>,
        call: impl std::future::Future<Output = Result<T, PsError>> + Send + 'static,
    ) -> PyResult<T> {
        if std::process::id() != self.pid {
            // The runtime's threads did not survive the fork: the task would never run.
            return Err(BexError::new_err(format!(
                "this bex.Client was created in process {}; after a fork (e.g. a DataLoader \
                 worker) create a new bex.Client in the child",
                self.pid
            )));
        }
        let (tx, mut rx) = std::sync::mpsc::sync_channel(1);
        self.runtime.spawn(async move {
            // The receiver is gone only if the caller was interrupted.
            let _ = tx.send(call.await);
        });
        loop {
            // The receiver moves in and out: `detach` needs a `Send` closure, `&Receiver`
            // is not.
            let (back, got) = py.detach(move || {
                let got = rx.recv_timeout(SIGNAL_CHECK);
                (rx, got)
            });
            rx = back;
            match got {
                Ok(r) => return r.map_err(to_py),
                Err(RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(BexError::new_err(
                        "the call's task ended without a result (it panicked: see the log)",
                    ))
                }
            }
        }
    }

    fn table(&self, t: &TableRef) -> PyResult<&Table> {
        let found = match t {
            TableRef::Id(id) => self.tables.iter().find(|x| x.id == *id),
            TableRef::Name(name) => self.tables.iter().find(|x| &x.name == name),
        };
        found.ok_or_else(|| {
            let names: Vec<&str> = self.tables.iter().map(|x| x.name.as_str()).collect();
            let which = match t {
                TableRef::Id(id) => format!("id {id}"),
                TableRef::Name(n) => format!("{n:?}"),
            };
            UnknownTable::new_err(format!("no table {which}; the cluster has {names:?}"))
        })
    }
}

#[pymethods]
impl Client {
    /// Connects to the cluster that `config` (a cluster TOML file) describes.
    ///
    /// `pod`: the mini-pod served first (default: the training pod for a training client,
    /// else the first other pod; `BEX_BIND_IP` sets `bind`'s default). `transport`: "rdma" (falls back to TCP per destination when RDMA
    /// fails) or "tcp". `client_id`: names this client in logs and seeds its replica choice
    /// (default: this process id above a hash of the host name). `bind`: the address this
    /// client's transports bind (default: the cluster file's host). `training`: a training
    /// client waits longer per request and retries failed pushes. `threads`: the client's
    /// runtime threads, which run the calls and their I/O (one is enough for a few cores: the
    /// callers' threads are the concurrency, and every extra worker adds wake-ups per call).
    ///
    /// A client opens a NIC and a registered memory pool that stay until the process exits
    /// (bemalloc never returns a pool): make one per process and share it between threads.
    /// After `fork`, make a new one in the child.
    #[new]
    #[pyo3(signature = (config, pod=None, transport="rdma", client_id=None, bind=None, training=true, threads=1))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn new(
        py: Python<'_>,
        config: PathBuf,
        pod: Option<u32>,
        transport: &str,
        client_id: Option<u64>,
        bind: Option<&str>,
        training: bool,
        threads: usize,
    ) -> PyResult<Client> {
        if threads == 0 {
            return Err(ConfigError::new_err("threads must be at least 1"));
        }
        let cfg = Config::load(&config).map_err(|e| ConfigError::new_err(e.to_string()))?;
        let transport: TransportKind =
            transport.parse().map_err(|e| ConfigError::new_err(format!("transport: {e}")))?;
        let bind: IpAddr = match bind {
            Some(b) => b
                .parse()
                .map_err(|_| ConfigError::new_err(format!("bind {b:?}: not an IP address")))?,
            // As the Rust clients: the pod's own address in a container, where the file's
            // host is loopback (bound there, RDMA to other hosts fails).
            None => match std::env::var("BEX_BIND_IP") {
                Ok(v) if !v.is_empty() => bex_process::identity::parse_ip(&v)
                    .map_err(|e| ConfigError::new_err(format!("BEX_BIND_IP: {e}")))?,
                _ => cfg.cluster.host,
            },
        };
        // A training client reads the training pod, which applies its pushes first (a
        // serving copy may not have them yet); a serving client the first other pod.
        let training_pod = cfg.cluster.training_pod;
        let first_serving = (0..cfg.cluster.pods).find(|&p| p != training_pod).unwrap_or(0);
        let pod = pod.unwrap_or(if training { training_pod } else { first_serving });
        let client_id = client_id.unwrap_or_else(bex_process::identity::default_client_id);
        let role = if training { ClientRole::Training } else { ClientRole::Serving };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("bex-client")
            .enable_all()
            .build()
            .map_err(|e| BexError::new_err(format!("tokio runtime: {e}")))?;
        let node = py
            .detach(|| {
                runtime.block_on(connect_client(&cfg, pod, bind, transport, client_id, role))
            })
            .map_err(|e| {
                // The exit status a binary would take says which: 2 is the configuration
                // (a pod out of range, a missing secret, a bad NIC), the rest the cluster.
                if e.exit_code == 2 {
                    ConfigError::new_err(e.to_string())
                } else {
                    RpcError::new_err(e.to_string())
                }
            })?;
        let tables = cfg
            .tables
            .iter()
            .enumerate()
            .map(|(i, t)| Table { id: i as u32, name: t.name.clone(), dim: t.dim })
            .collect();
        Ok(Client {
            ps: ForkGuarded::new(node.ps),
            tables,
            transport,
            pid: std::process::id(),
            runtime: ForkGuarded::new(runtime),
        })
    }

    /// The cluster's tables, by name.
    #[getter]
    fn tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for t in &self.tables {
            d.set_item(&t.name, t.clone())?;
        }
        Ok(d)
    }

    /// "rdma" or "tcp".
    #[getter]
    fn transport(&self) -> &'static str {
        self.transport.name()
    }

    /// Rows of `keys` (a 1-D uint64 array; duplicates allowed) from `table` (a name or an
    /// id): a float32 array of shape `(len(keys), dim)`, in the keys' order.
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        table: TableRef,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let t = self.table(&table)?;
        let (id, dim) = (t.id, t.dim);
        let keys = keys.as_array().to_vec();
        let n = keys.len();
        let ps = Arc::clone(&self.ps);
        let rows = self.call(py, async move { ps.fetch(id, dim, &keys).await })?;
        PyArray1::from_vec(py, rows).reshape([n, dim as usize])
    }

    /// Pushes `grads` (float32, shape `(len(keys), dim)`) for `keys` (1-D uint64) of `table`
    /// to the training pod; a key given twice has its gradients summed. Returns when the
    /// training servers acknowledged it (applied once, even if retried).
    fn push(
        &self,
        py: Python<'_>,
        table: TableRef,
        keys: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let t = self.table(&table)?;
        let (id, dim) = (t.id, t.dim);
        let shape = grads.shape();
        if shape[0] != keys.len() || shape[1] != dim as usize {
            return Err(PyValueError::new_err(format!(
                "grads of shape {shape:?} for {} keys of table {:?} (dim {dim}): expected ({}, {dim})",
                keys.len(),
                t.name,
                keys.len()
            )));
        }
        let keys = keys.as_array().to_vec();
        let grads: Vec<f32> = grads.as_array().iter().copied().collect();
        let ps = Arc::clone(&self.ps);
        self.call(py, async move { ps.push(id, dim, &keys, &grads).await })
    }

    fn __repr__(&self) -> String {
        let names: Vec<&str> = self.tables.iter().map(|t| t.name.as_str()).collect();
        format!("bex.Client(transport={:?}, tables={names:?})", self.transport())
    }
}

/// The native module (`bex._bex`); the `bex` package re-exports it.
#[pymodule]
fn _bex(m: &Bound<'_, PyModule>) -> PyResult<()> {
    bex_process::logging::init();
    let py = m.py();
    m.add_class::<Client>()?;
    m.add_class::<Table>()?;
    m.add_class::<data::SyntheticClicks>()?;
    m.add_class::<data::ClickStream>()?;
    m.add_function(wrap_pyfunction!(data::auc, m)?)?;
    m.add_function(wrap_pyfunction!(data::dense_keys, m)?)?;
    m.add("BexError", py.get_type::<BexError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RpcError", py.get_type::<RpcError>())?;
    m.add("ServerError", py.get_type::<ServerError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    add_status_exceptions(m)?;
    Ok(())
}
