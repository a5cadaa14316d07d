//! What a bex process exports on `/metrics` besides a server's own series
//! (`bex_ps_server::server::Metrics`): its NIC, transports and registered pool ([`register_stack`]),
//! RPC clients and servers ([`register_rpc_client`], [`register_rpc_server`]) and the process
//! itself ([`register_process`]). Every value is read from the component's own counters when
//! `/metrics` is scraped (`counter_fn`, `gauge_fn`), so nothing is added to a hot path and
//! the numbers are the ones reports and benchmarks read.
//!
//! Names: `bex_transport_*{transport}`, `bex_rnic_*`, `bex_bemalloc_*`,
//! `bex_rpc_client_*{client}`, `bex_rpc_server_*`, `process_*` (the Prometheus client
//! convention, so stock dashboards work) and `bex_process_*`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bex_ps_proto::metrics::{MetricsError, Registry};
use bex_rpc::{Client, ClientCounts, ServerStats};
use bex_transport::{CounterSnapshot, NicStats, Stack};

/// A counter kept in a snapshot struct: (name, help, read).
type Field<S> = (&'static str, &'static str, fn(&S) -> u64);

/// The transport counters exported per transport (`transport="rdma"|"tcp"`).
const TRANSPORT_COUNTERS: &[Field<CounterSnapshot>] = &[
    ("bex_transport_messages_sent_total", "Messages sent whole", |c| c.messages_sent),
    ("bex_transport_messages_received_total", "Messages delivered to sockets", |c| {
        c.messages_received
    }),
    ("bex_transport_bytes_sent_total", "Payload bytes sent", |c| c.bytes_sent),
    ("bex_transport_bytes_received_total", "Payload bytes received", |c| c.bytes_received),
    ("bex_transport_eager_messages_total", "Messages sent eagerly (one SEND)", |c| {
        c.eager_messages
    }),
    ("bex_transport_large_messages_total", "Messages sent by RTS/CTS and RDMA WRITE", |c| {
        c.large_messages
    }),
    (
        "bex_transport_granted_messages_total",
        "Large messages written into a standing grant (no RTS/CTS round trip)",
        |c| c.granted_messages,
    ),
    (
        "bex_transport_rts_deferred_total",
        "RTSs whose CTS waited for earlier announced messages to be written (the engine's \
         budget of max_message_bytes)",
        |c| c.rts_deferred,
    ),
    (
        "bex_transport_credit_stalls_total",
        "Scheduler turns that found no receive credit at the peer",
        |c| c.credit_stalls,
    ),
    (
        "bex_transport_window_stalls_total",
        "Scheduler turns that found the engine's send window full",
        |c| c.window_stalls,
    ),
    ("bex_transport_credit_messages_total", "Credit-return messages sent", |c| c.credit_messages),
    ("bex_transport_doorbells_total", "post_send calls (doorbells)", |c| c.doorbells),
    ("bex_transport_work_requests_total", "Work requests posted", |c| c.work_requests),
    (
        "bex_transport_engines_established_total",
        "Engines (RDMA) or connections (TCP) established",
        |c| c.engines_up,
    ),
    (
        "bex_transport_engines_failed_total",
        "Engines failed (QP error, keepalive) or TCP connections lost",
        |c| c.engines_failed,
    ),
    ("bex_transport_keepalive_failures_total", "Engines failed by keepalive expiry", |c| {
        c.keepalive_failures
    }),
    ("bex_transport_malformed_total", "Malformed engine messages from peers (dropped)", |c| {
        c.malformed
    }),
    (
        "bex_transport_bootstrap_refused_total",
        "Bootstrap attempts refused (bad secret or hello)",
        |c| c.bootstrap_refused,
    ),
    (
        "bex_transport_wakeups_total",
        "Times a transport task resumed after waiting for the network or a timer (at most one \
         thread wake-up each)",
        |c| c.wakeups,
    ),
];

/// The NIC's protocol counters.
const NIC_COUNTERS: &[Field<NicStats>] = &[
    (
        "bex_rnic_rnr_naks_received_total",
        "RNR NAKs received (sends found no receive posted)",
        |s| s.rnr_naks_received,
    ),
    ("bex_rnic_rnr_naks_sent_total", "RNR NAKs sent", |s| s.rnr_naks_sent),
    ("bex_rnic_seq_naks_received_total", "Sequence NAKs received", |s| s.seq_naks_received),
    ("bex_rnic_retransmitted_packets_total", "Data packets sent again", |s| {
        s.retransmitted_packets
    }),
    ("bex_rnic_ack_timeouts_total", "Local ACK timeouts", |s| s.ack_timeouts),
    ("bex_rnic_tx_packets_total", "Packets sent", |s| s.tx_packets),
    ("bex_rnic_rx_packets_total", "Packets received", |s| s.rx_packets),
    (
        "bex_rnic_send_errors_total",
        "Packets that never reached the wire (unreachable peer, larger than the link MTU)",
        |s| s.send_errors,
    ),
];

/// An RPC client's counters (`client` label: what the client is for).
const RPC_CLIENT_COUNTERS: &[Field<ClientCounts>] = &[
    ("bex_rpc_client_calls_total", "Calls made", |c| c.calls),
    ("bex_rpc_client_failures_total", "Calls that failed after every attempt", |c| c.failures),
    ("bex_rpc_client_timeouts_total", "Request timeouts", |c| c.timeouts),
    ("bex_rpc_client_retries_total", "Attempts beyond the first", |c| c.retries),
    ("bex_rpc_client_connects_total", "Connections opened", |c| c.connects),
    ("bex_rpc_client_connect_failures_total", "Connection attempts that failed", |c| {
        c.connect_failures
    }),
    ("bex_rpc_client_fallbacks_total", "Destinations moved from RDMA to TCP", |c| c.fallbacks),
    ("bex_rpc_client_recoveries_total", "Destinations moved back to RDMA after a probe", |c| {
        c.recoveries
    }),
    ("bex_rpc_client_quarantines_total", "Destinations put in quarantine", |c| c.quarantines),
    (
        "bex_rpc_client_remote_pod_calls_total",
        "Calls answered by a replica outside the caller's mini-pod",
        |c| c.remote_pod_calls,
    ),
    ("bex_rpc_client_tcp_calls_total", "Calls answered over TCP", |c| c.tcp_calls),
    ("bex_rpc_client_unwell_replies_total", "Replies that said the server is unwell", |c| {
        c.unwell_replies
    }),
    (
        "bex_rpc_client_malformed_replies_total",
        "Replies dropped as malformed (bad header or body length); their calls time out",
        |c| c.malformed_replies,
    ),
];

/// The NIC's, both transports' and the registered pool's series.
pub fn register_stack(reg: &Registry, stack: &Arc<Stack>) -> Result<(), MetricsError> {
    let (rdma, tcp) = stack.transports();
    let transports = [("rdma", rdma), ("tcp", tcp)];
    for &(name, help, read) in TRANSPORT_COUNTERS {
        for (label, t) in &transports {
            let t = t.clone();
            reg.counter_fn(name, help, &[("transport", label)], move || {
                read(&t.counters()) as f64
            })?;
        }
    }
    for (label, t) in &transports {
        let t = t.clone();
        reg.gauge_fn(
            "bex_transport_window_high_water_bytes",
            "Largest bytes outstanding on any engine so far",
            &[("transport", label)],
            move || t.counters().window_high_water as f64,
        )?;
    }
    let rdma = stack.rdma.clone();
    reg.gauge_fn(
        "bex_transport_engines",
        "RDMA engines (RC queue-pair sets to a peer) open now",
        &[("transport", "rdma")],
        move || rdma.engines() as f64,
    )?;
    for &(name, help, read) in NIC_COUNTERS {
        let s = stack.clone();
        reg.counter_fn(name, help, &[], move || read(&s.nic_stats()) as f64)?;
    }
    register_pool(reg, stack.pool())
}

/// bemalloc's registered pool: what the NIC can reach, and what is in use.
fn register_pool(reg: &Registry, pool: &'static bemalloc::Pool) -> Result<(), MetricsError> {
    type PoolField = (&'static str, &'static str, fn(&bemalloc::Stats) -> u64);
    const GAUGES: &[PoolField] = &[
        ("bex_bemalloc_registered_bytes", "Bytes registered with the NIC (per device)", |s| {
            s.registered_bytes
        }),
        ("bex_bemalloc_live_bytes", "Bytes allocated and not yet freed", |s| s.live_bytes),
        ("bex_bemalloc_reserved_bytes", "Address space reserved (the pool's ceiling)", |s| {
            s.reserved_bytes
        }),
    ];
    for &(name, help, read) in GAUGES {
        reg.gauge_fn(name, help, &[], move || read(&pool.stats()) as f64)?;
    }
    reg.counter_fn(
        "bex_bemalloc_registration_failures_total",
        "Registrations a device refused",
        &[],
        move || pool.stats().registration_failures as f64,
    )
}

/// An RPC client's counters and its destinations' state, labelled `client`.
pub fn register_rpc_client(
    reg: &Registry,
    client_label: &str,
    client: Arc<Client>,
) -> Result<(), MetricsError> {
    let labels = [("client", client_label)];
    for &(name, help, read) in RPC_CLIENT_COUNTERS {
        let stats = client.stats().clone();
        reg.counter_fn(name, help, &labels, move || read(&stats.snapshot()) as f64)?;
    }
    let c = client.clone();
    reg.gauge_fn(
        "bex_rpc_client_quarantined_destinations",
        "Destinations in quarantine now",
        &labels,
        move || c.destination_counts().quarantined as f64,
    )?;
    reg.gauge_fn(
        "bex_rpc_client_tcp_destinations",
        "Destinations served over TCP now (RDMA failed, or the client is TCP only)",
        &labels,
        move || client.destination_counts().on_tcp as f64,
    )
}

/// An RPC server's counters (both transports together).
pub fn register_rpc_server(reg: &Registry, stats: Arc<ServerStats>) -> Result<(), MetricsError> {
    type ServerField = (&'static str, &'static str, fn(&ServerStats) -> &AtomicU64);
    const COUNTERS: &[ServerField] = &[
        ("bex_rpc_server_requests_total", "Requests handled", |s| &s.requests),
        ("bex_rpc_server_errors_total", "Error replies sent", |s| &s.errors),
        ("bex_rpc_server_malformed_total", "Frames that were not requests (dropped)", |s| {
            &s.malformed
        }),
        ("bex_rpc_server_sockets_total", "Sockets accepted", |s| &s.sockets),
        (
            "bex_rpc_server_in_flight_full_total",
            "Times a socket had the most requests in flight and was read no further until one was answered",
            |s| &s.in_flight_full,
        ),
    ];
    for &(name, help, read) in COUNTERS {
        let s = stats.clone();
        reg.counter_fn(name, help, &[], move || read(&s).load(Ordering::Relaxed) as f64)?;
    }
    Ok(())
}

/// CPU time, resident memory, start time and context switches of this process.
pub fn register_process(reg: &Registry) -> Result<(), MetricsError> {
    let start = crate::clock::unix_ms() as f64 / 1000.0;
    reg.gauge_fn(
        "process_start_time_seconds",
        "When the process registered its metrics (Unix seconds; at start)",
        &[],
        move || start,
    )?;
    reg.counter_fn("process_cpu_seconds_total", "User and system CPU time (seconds)", &[], || {
        bex_process::self_usage().map_or(f64::NAN, |u| u.cpu_s)
    })?;
    reg.gauge_fn("process_resident_memory_bytes", "Resident set size", &[], || {
        bex_process::resident_bytes().map_or(f64::NAN, |b| b as f64)
    })?;
    reg.counter_fn(
        "bex_process_context_switches_total",
        "Voluntary and involuntary context switches of every thread (each blocking wait \
         that slept is one)",
        &[],
        || bex_process::self_usage().map_or(f64::NAN, |u| u.context_switches as f64),
    )
}
