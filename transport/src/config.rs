//! Transport configuration and counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bex_rnic::verbs::Mtu;

/// Settings of an RDMA transport (TCP uses the relevant subset). Every number the paper names
/// has its default here.
#[derive(Clone, Debug)]
pub struct Config {
    /// Endpoints per transport: each has one completion queue and one driver task on the
    /// application's runtime (the paper's I/O threads, without threads of their own);
    /// engines are assigned to them round-robin. On the software NIC every endpoint's CQ
    /// also watches the device's one UDP socket, so more than one costs wake-ups.
    pub endpoints: usize,
    /// Send-queue depth = length of each engine's work-request chain (paper: e.g. 32).
    pub sq_depth: u32,
    /// Receive-queue depth `d`; receives are re-posted and credits returned `d/2` at a time.
    pub rq_depth: u32,
    /// SRQ mode: the engines of an endpoint share one receive queue of `srq_depth`
    /// buffers, and receive credits are off (the QPs' RNR retry absorbs exhaustion).
    pub srq: bool,
    /// Depth of each endpoint's shared receive queue (SRQ mode).
    pub srq_depth: u32,
    /// Completion-queue depth of each endpoint.
    pub cq_depth: u32,
    /// Largest message sent eagerly by SEND; larger ones go RTS → CTS → WRITE fragments.
    pub eager_max: usize,
    /// Fragment size `S` of large messages (one WRITE per scheduler turn). 64 KiB by
    /// default: on the software RNIC every fragment's first packet carries a RETH, which ends
    /// a GSO run, so smaller fragments cost more sends per byte (bex-perf `frag`, ps-bench).
    pub fragment_bytes: usize,
    /// Large messages behind a socket's front whose RTS may go before their turn to be
    /// written, so their CTS is there when it comes (0: one RTS/CTS round trip per large
    /// message, in turn). Each makes the receiver allocate the message's buffer early.
    pub rts_ahead: usize,
    /// Largest standing grant (bytes): after a large message arrives on a socket, the
    /// receiver offers the sender a buffer of the next power of two above it (at most this
    /// much) on the next Data message it sends there, so the sender's next large message
    /// goes straight to it without RTS/CTS. At most one per socket is outstanding; 0: off.
    pub grant_max_bytes: usize,
    /// Per-engine send window (bytes outstanding); `None` = off, the paper's baseline.
    pub cwnd_bytes: Option<u64>,
    /// Copy eager payloads into a registered bounce buffer instead of posting the caller's
    /// buffer directly (kept to compare with the zero-copy path of `paper/002`).
    pub eager_copy: bool,
    /// Path MTU of the QPs (the software RNIC also takes `Mtu::Soft`).
    pub path_mtu: Mtu,
    /// Keepalive send interval.
    pub keepalive_interval: Duration,
    /// An engine whose peer's keepalive does not advance for this long fails.
    pub keepalive_timeout: Duration,
    /// TCP: a connection's writer idle this long sends a keepalive frame.
    pub tcp_keepalive_interval: Duration,
    /// TCP: a connection whose reader hears nothing for this long while it waits for the
    /// peer fails. Longer than RDMA's: TCP's own retransmission backs off (200 ms, 400 ms,
    /// …), so a few losses in a row of one segment stall a healthy stream for seconds.
    pub tcp_keepalive_timeout: Duration,
    /// Deadline for establishing an engine or opening a socket.
    pub connect_timeout: Duration,
    /// The cluster's shared secret; peers without it are refused at bootstrap.
    pub secret: Vec<u8>,
    /// How long an idle endpoint's driver keeps polling before it waits for an event (0: wait
    /// at once; spinning only pays when the runtime's threads have cores to themselves).
    pub spin: Duration,
    /// Largest message a peer may announce (RTS length, TCP frame), and on RDMA also the
    /// bytes one engine holds at once for announced messages (later RTSs wait for their CTS):
    /// bounds what an authenticated but misbehaving peer can make this side allocate and
    /// register.
    pub max_message_bytes: u64,
    /// Messages a socket may have queued before `send` waits (backpressure); on TCP also the
    /// received messages a socket holds before the connection stops reading.
    pub max_queued_sends: usize,
    /// Physical port of the QPs (1 on the software RNIC; `[transport] port` on hardware).
    pub qp_port: u8,
    /// QP local ACK timeout code (4.096 µs × 2^code).
    pub qp_timeout: u8,
    /// QP retry count for ACK timeouts and sequence NAKs.
    pub qp_retry_cnt: u8,
    /// QP RNR retry count (7 = infinite); with credits RNR never happens.
    pub qp_rnr_retry: u8,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            endpoints: 1,
            sq_depth: 32,
            rq_depth: 64,
            srq: false,
            srq_depth: 1024,
            cq_depth: 8192,
            eager_max: 8 * 1024,
            fragment_bytes: 64 * 1024,
            rts_ahead: 4,
            grant_max_bytes: 1 << 20,
            cwnd_bytes: None,
            eager_copy: false,
            path_mtu: Mtu::Mtu4096,
            keepalive_interval: Duration::from_millis(100),
            keepalive_timeout: Duration::from_secs(1),
            tcp_keepalive_interval: Duration::from_secs(1),
            tcp_keepalive_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            secret: b"bex-default-secret".to_vec(),
            spin: Duration::ZERO,
            max_queued_sends: 1024,
            max_message_bytes: 1 << 30,
            qp_port: 1,
            qp_timeout: 14,
            qp_retry_cnt: 7,
            qp_rnr_retry: 7,
        }
    }
}

/// What one engine uses with a peer that announced `peer_eager_max` and `peer_mtu`: the
/// smaller eager limit and path MTU of the two sides, so a receive buffer always holds an
/// eager message and a packet always fits (peers configured differently, as in a rolling
/// change, overflowed each other's receive buffers). Both sides compute the same.
pub(crate) fn agreed(
    cfg: &Arc<Config>,
    peer_eager_max: usize,
    peer_mtu: Mtu,
) -> (Arc<Config>, Mtu) {
    let cfg = if peer_eager_max >= cfg.eager_max {
        cfg.clone()
    } else {
        Arc::new(Config { eager_max: peer_eager_max, ..(**cfg).clone() })
    };
    let mtu = if peer_mtu.bytes() < cfg.path_mtu.bytes() { peer_mtu } else { cfg.path_mtu };
    (cfg, mtu)
}

impl Config {
    /// Checks the settings, naming the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |f: &str, why: &str| Err(format!("transport config: {f}: {why}"));
        if self.endpoints == 0 || self.endpoints > 256 {
            return bad("endpoints", "must be in 1..=256");
        }
        if !(2..=16384).contains(&self.sq_depth) {
            return bad("sq_depth", "must be in 2..=16384");
        }
        if !(4..=16384).contains(&self.rq_depth) {
            return bad("rq_depth", "must be in 4..=16384");
        }
        if self.srq && !(4..=65536).contains(&self.srq_depth) {
            return bad("srq_depth", "must be in 4..=65536");
        }
        if self.srq && self.qp_rnr_retry != 7 {
            return bad("qp_rnr_retry", "must be 7 (infinite) in SRQ mode, which has no credits");
        }
        if self.cq_depth < 2 * (self.sq_depth + self.rq_depth) {
            return bad("cq_depth", "must hold at least 2 × (sq_depth + rq_depth)");
        }
        if self.eager_max < 64 || self.eager_max > 1 << 20 {
            return bad("eager_max", "must be in 64 B..=1 MiB");
        }
        if self.fragment_bytes < 256 || self.fragment_bytes > 1 << 30 {
            return bad("fragment_bytes", "must be in 256 B..=1 GiB");
        }
        if self.rts_ahead > 1024 {
            return bad("rts_ahead", "must be at most 1024");
        }
        if self.grant_max_bytes as u64 > self.max_message_bytes {
            return bad("grant_max_bytes", "must be at most max_message_bytes");
        }
        if self.cwnd_bytes == Some(0) {
            return bad("cwnd_bytes", "must be positive (or off)");
        }
        if self.keepalive_timeout <= self.keepalive_interval {
            return bad("keepalive_timeout", "must exceed keepalive_interval");
        }
        if self.tcp_keepalive_interval.is_zero() {
            return bad("tcp_keepalive_interval", "must be positive");
        }
        if self.tcp_keepalive_timeout <= self.tcp_keepalive_interval {
            return bad("tcp_keepalive_timeout", "must exceed tcp_keepalive_interval");
        }
        if self.max_queued_sends == 0 || self.max_queued_sends > 1 << 24 {
            return bad("max_queued_sends", "must be in 1..=2^24");
        }
        if self.max_message_bytes == 0 {
            return bad("max_message_bytes", "must be positive");
        }
        if self.secret.is_empty() {
            return bad("secret", "must not be empty");
        }
        if self.qp_port == 0 {
            return bad("qp_port", "ports count from 1");
        }
        if self.qp_retry_cnt > 7 || self.qp_rnr_retry > 7 {
            return bad("qp_retry_cnt/qp_rnr_retry", "are 3-bit fields (0..=7)");
        }
        Ok(())
    }
}

/// Cumulative transport counters (shared by every endpoint).
#[derive(Debug, Default)]
pub struct Counters {
    /// Messages handed to the NIC completely (eager or large).
    pub messages_sent: AtomicU64,
    /// Messages delivered to sockets.
    pub messages_received: AtomicU64,
    /// Payload bytes sent.
    pub bytes_sent: AtomicU64,
    /// Payload bytes received.
    pub bytes_received: AtomicU64,
    /// Messages sent eagerly.
    pub eager_messages: AtomicU64,
    /// Messages sent by RTS/CTS/WRITE.
    pub large_messages: AtomicU64,
    /// Large messages written into a standing grant (no RTS/CTS round trip).
    pub granted_messages: AtomicU64,
    /// Standing grants offered to peers.
    pub grants_offered: AtomicU64,
    /// RTSs whose CTS waited for buffers of earlier announced messages to be written and
    /// freed (the budget of `max_message_bytes` per engine).
    pub rts_deferred: AtomicU64,
    /// Scheduler turns that found no credit (ordinary use).
    pub credit_stalls: AtomicU64,
    /// Scheduler turns that found the send window full.
    pub window_stalls: AtomicU64,
    /// Largest bytes outstanding on any engine.
    pub window_high_water: AtomicU64,
    /// Credit-return messages sent.
    pub credit_messages: AtomicU64,
    /// `post_send` calls (doorbells).
    pub doorbells: AtomicU64,
    /// Work requests posted.
    pub work_requests: AtomicU64,
    /// Engines established.
    pub engines_up: AtomicU64,
    /// Engines failed (QP error, keepalive, …).
    pub engines_failed: AtomicU64,
    /// Engines failed by keepalive expiry.
    pub keepalive_failures: AtomicU64,
    /// Malformed engine messages from peers (counted and dropped).
    pub malformed: AtomicU64,
    /// Bootstrap attempts refused (bad secret, bad hello).
    pub bootstrap_refused: AtomicU64,
    /// Times a transport task resumed after waiting for the network or a timer: an RDMA
    /// endpoint's driver woken by its CQ's fd or a timer, a TCP connection's reader woken by
    /// its socket, and TCP's keepalive timers (an idle writer's, a reader's silence check).
    /// Each is at most one thread wake-up; per message, the number to compare.
    pub wakeups: AtomicU64,
    /// Passes of RDMA endpoint drivers over their engines.
    pub driver_turns: AtomicU64,
    /// Of `wakeups`, those a timer caused: an RDMA driver's (NIC or keepalive timers), or
    /// TCP's keepalive timers.
    pub timer_wakeups: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct CounterSnapshot {
    pub messages_sent: u64,
    pub messages_received: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub eager_messages: u64,
    pub large_messages: u64,
    pub granted_messages: u64,
    pub grants_offered: u64,
    pub rts_deferred: u64,
    pub credit_stalls: u64,
    pub window_stalls: u64,
    pub window_high_water: u64,
    pub credit_messages: u64,
    pub doorbells: u64,
    pub work_requests: u64,
    pub engines_up: u64,
    pub engines_failed: u64,
    pub keepalive_failures: u64,
    pub malformed: u64,
    pub bootstrap_refused: u64,
    pub wakeups: u64,
    pub driver_turns: u64,
    pub timer_wakeups: u64,
}

impl Counters {
    /// Adds `n` to a counter.
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> CounterSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            messages_sent: g(&self.messages_sent),
            messages_received: g(&self.messages_received),
            bytes_sent: g(&self.bytes_sent),
            bytes_received: g(&self.bytes_received),
            eager_messages: g(&self.eager_messages),
            large_messages: g(&self.large_messages),
            granted_messages: g(&self.granted_messages),
            grants_offered: g(&self.grants_offered),
            rts_deferred: g(&self.rts_deferred),
            credit_stalls: g(&self.credit_stalls),
            window_stalls: g(&self.window_stalls),
            window_high_water: g(&self.window_high_water),
            credit_messages: g(&self.credit_messages),
            doorbells: g(&self.doorbells),
            work_requests: g(&self.work_requests),
            engines_up: g(&self.engines_up),
            engines_failed: g(&self.engines_failed),
            keepalive_failures: g(&self.keepalive_failures),
            malformed: g(&self.malformed),
            bootstrap_refused: g(&self.bootstrap_refused),
            wakeups: g(&self.wakeups),
            driver_turns: g(&self.driver_turns),
            timer_wakeups: g(&self.timer_wakeups),
        }
    }
}
