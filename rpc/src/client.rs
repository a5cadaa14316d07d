//! A client of a replicated service (paper §7.2): each call goes to a replica chosen by
//! [`order_replicas`] (the caller's mini-pod first, quarantined ones last), with a connection
//! deadline `Tc` and a request deadline `Tr`; timed-out requests are retried with a
//! probability; on RDMA failure the ladder is: reconnect, then a replica in another mini-pod
//! over RDMA, and only when no replica answers over RDMA, TCP (a destination whose RDMA keeps
//! failing stays on TCP with a periodic RDMA re-probe). Destinations with too many failures
//! (connections, timeouts, and replies the service calls unwell) are quarantined until a
//! probe succeeds; failed re-probes do not count, since the destination serves over TCP.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bemalloc::Pool;
use bex_transport::{Msg, SharedMsg, Transport, TransportKind};
use parking_lot::Mutex;

use crate::channel::{alloc_frame, next_request_id, Channel};
use crate::clock;
use crate::error::RpcError;
use crate::frame::{Header, HEADER_LEN};
use crate::policy::{order_replicas, Fallback, Quarantine, Replica, RetryPolicy};

/// One replica's addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Mini-pod.
    pub pod: u32,
    /// RDMA transport bootstrap address.
    pub rdma: SocketAddr,
    /// TCP transport address.
    pub tcp: SocketAddr,
    /// The DNS name of the replica's host, if it has one: resolved again before every
    /// new connection (the addresses' ports are kept), since a restarted replica may come
    /// back elsewhere under its name. The addresses hold the last resolution.
    pub host: Option<Arc<str>>,
}

impl Endpoint {
    /// A replica at fixed addresses.
    pub fn at(pod: u32, rdma: SocketAddr, tcp: SocketAddr) -> Endpoint {
        Endpoint { pod, rdma, tcp, host: None }
    }
}

/// Resolves a host name to an IP (`None`: it does not resolve now). It may block: the
/// client calls it off the runtime's threads.
pub type Resolver = Arc<dyn Fn(&str) -> Option<IpAddr> + Send + Sync>;

/// The system's resolver (`getaddrinfo`: `/etc/hosts`, then DNS): the first address.
pub fn resolve_host(name: &str) -> Option<IpAddr> {
    use std::net::ToSocketAddrs;
    (name, 0).to_socket_addrs().ok()?.next().map(|a| a.ip())
}

/// Client settings; the paper's numbers are the defaults.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Connection deadline `Tc`.
    pub connect_timeout: Duration,
    /// Request deadline `Tr`.
    pub request_timeout: Duration,
    /// Probability of retrying a timed-out request.
    pub retry_probability: f64,
    /// Most retries of one call.
    pub max_retries: u32,
    /// Quarantine after more than this many connection failures in the window (M).
    pub quarantine_connection_failures: usize,
    /// Quarantine after more than this many request failures in the window (N).
    pub quarantine_request_failures: usize,
    /// The quarantine window.
    pub quarantine_window: Duration,
    /// How often a destination on TCP re-probes RDMA.
    pub reprobe_interval: Duration,
    /// How long a quarantined destination is passed over before a call tries it again (a
    /// probe; a success releases it, a failure starts another period).
    pub quarantine_probe_interval: Duration,
    /// Consecutive RDMA failures (after reconnecting) before a destination falls back to TCP.
    pub rdma_failures_before_fallback: u32,
    /// The caller's mini-pod.
    pub local_pod: u32,
    /// Seed of the retry decisions.
    pub seed: u64,
    /// Calls whose request or expected reply frame is larger than this go on a second
    /// connection to the destination (the bulk lane), so the transport interleaves their
    /// fragments with small calls instead of queueing small replies behind them on one
    /// socket; 0: one connection per destination.
    pub bulk_lane_bytes: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            connect_timeout: Duration::from_millis(10),
            request_timeout: Duration::from_millis(40),
            retry_probability: 0.5,
            max_retries: 2,
            quarantine_connection_failures: 30,
            quarantine_request_failures: 50,
            quarantine_window: Duration::from_secs(300),
            reprobe_interval: Duration::from_secs(1),
            quarantine_probe_interval: Duration::from_secs(300),
            rdma_failures_before_fallback: 2,
            local_pod: 0,
            seed: 1,
            bulk_lane_bytes: 64 << 10,
        }
    }
}

impl ClientConfig {
    /// The longest a call takes: every attempt's connection and request deadlines,
    /// `(1 + max_retries) × (Tc + Tr)`. The ladder (reconnects, other replicas, TCP) runs
    /// within it; a call still unanswered then fails with [`RpcError::Timeout`]. Without
    /// this bound a call that met a partition walked the whole ladder, each rung with its
    /// own deadlines, and answered its caller long after the caller had given up (chaos
    /// run: a ranker request took 294 ms against a 150 ms budget).
    /// `bex_ps_proto::RpcConfig::call_deadline_ms` is the same formula for the cluster's
    /// config (a test in `bex-client` keeps them equal).
    pub fn call_deadline(&self) -> Duration {
        (self.connect_timeout + self.request_timeout) * (1 + self.max_retries)
    }
}

/// What happened to calls (cumulative).
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Calls made.
    pub calls: AtomicU64,
    /// Calls that failed after every attempt.
    pub failures: AtomicU64,
    /// Request timeouts.
    pub timeouts: AtomicU64,
    /// Attempts beyond the first.
    pub retries: AtomicU64,
    /// Connections (channels) opened.
    pub connects: AtomicU64,
    /// Connection attempts that failed.
    pub connect_failures: AtomicU64,
    /// Destinations moved from RDMA to TCP.
    pub fallbacks: AtomicU64,
    /// Destinations moved back to RDMA after a probe.
    pub recoveries: AtomicU64,
    /// Destinations put in quarantine.
    pub quarantines: AtomicU64,
    /// Calls answered by a replica outside the caller's mini-pod.
    pub remote_pod_calls: AtomicU64,
    /// Calls answered over TCP.
    pub tcp_calls: AtomicU64,
    /// Replies the service's check called unwell (counted as request failures).
    pub unwell_replies: AtomicU64,
    /// Replies dropped as malformed (no RPC header, or a body length the frame disagrees
    /// with): the call they answered waits out its deadline.
    pub malformed_replies: AtomicU64,
}

/// The [`ClientStats`] counters at one moment, as plain numbers (reports, deltas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)] // the fields are ClientStats's
pub struct ClientCounts {
    pub calls: u64,
    pub failures: u64,
    pub timeouts: u64,
    pub retries: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub fallbacks: u64,
    pub recoveries: u64,
    pub quarantines: u64,
    pub remote_pod_calls: u64,
    pub tcp_calls: u64,
    pub unwell_replies: u64,
    pub malformed_replies: u64,
}

/// The state of a client's destinations at one moment ([`Client::destination_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DestinationCounts {
    /// Destinations.
    pub total: usize,
    /// Of them, in quarantine.
    pub quarantined: usize,
    /// Of them, served over TCP (RDMA failed, or the client is TCP only).
    pub on_tcp: usize,
}

impl ClientStats {
    /// The counters now.
    pub fn snapshot(&self) -> ClientCounts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ClientCounts {
            calls: g(&self.calls),
            failures: g(&self.failures),
            timeouts: g(&self.timeouts),
            retries: g(&self.retries),
            connects: g(&self.connects),
            connect_failures: g(&self.connect_failures),
            fallbacks: g(&self.fallbacks),
            recoveries: g(&self.recoveries),
            quarantines: g(&self.quarantines),
            remote_pod_calls: g(&self.remote_pod_calls),
            tcp_calls: g(&self.tcp_calls),
            unwell_replies: g(&self.unwell_replies),
            malformed_replies: g(&self.malformed_replies),
        }
    }
}

impl ClientCounts {
    /// `self − earlier`, per counter (never negative).
    pub fn since(&self, e: &Self) -> Self {
        Self {
            calls: self.calls.saturating_sub(e.calls),
            failures: self.failures.saturating_sub(e.failures),
            timeouts: self.timeouts.saturating_sub(e.timeouts),
            retries: self.retries.saturating_sub(e.retries),
            connects: self.connects.saturating_sub(e.connects),
            connect_failures: self.connect_failures.saturating_sub(e.connect_failures),
            fallbacks: self.fallbacks.saturating_sub(e.fallbacks),
            recoveries: self.recoveries.saturating_sub(e.recoveries),
            quarantines: self.quarantines.saturating_sub(e.quarantines),
            remote_pod_calls: self.remote_pod_calls.saturating_sub(e.remote_pod_calls),
            tcp_calls: self.tcp_calls.saturating_sub(e.tcp_calls),
            unwell_replies: self.unwell_replies.saturating_sub(e.unwell_replies),
            malformed_replies: self.malformed_replies.saturating_sub(e.malformed_replies),
        }
    }
}

/// What every attempt of one call shares.
struct Call {
    method: u16,
    id: u64,
    reply_capacity: Option<usize>,
    lane: Lane,
}

/// Which connection to a destination a call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    Small = 0,
    Bulk = 1,
}

struct Dest {
    ep: Endpoint,
    /// Per lane.
    rdma: [Option<Arc<Channel>>; 2],
    tcp: [Option<Arc<Channel>>; 2],
    quarantine: Quarantine,
    fallback: Fallback,
    rdma_failures: u32,
    /// The last call over TCP succeeded (so a failed RDMA re-probe is no sign of trouble).
    tcp_serves: bool,
    next_quarantine_probe: Option<std::time::Instant>,
}

/// A client of one replicated service.
pub struct Client {
    rdma: Option<Transport>,
    /// One connection attempt at a time per destination: concurrent first calls share it.
    connecting: Vec<tokio::sync::Mutex<()>>,
    tcp: Transport,
    cfg: ClientConfig,
    dests: Vec<Mutex<Dest>>,
    retry: Mutex<RetryPolicy>,
    rotate: AtomicUsize,
    stats: Arc<ClientStats>,
    pool: &'static Pool,
    unwell: fn(&[u8]) -> bool,
    resolver: Resolver,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("destinations", &self.dests.len()).finish()
    }
}

impl Client {
    /// A client over `rdma` (None: TCP only) and `tcp`, for `endpoints` (indexed by the ids
    /// passed to [`Client::call`]).
    pub fn new(
        rdma: Option<Transport>,
        tcp: Transport,
        endpoints: Vec<Endpoint>,
        cfg: ClientConfig,
    ) -> Client {
        let pool = rdma.as_ref().map_or_else(|| tcp.pool(), |t| t.pool());
        let dests: Vec<Mutex<Dest>> = endpoints
            .into_iter()
            .map(|ep| {
                let mut fallback = Fallback::new(cfg.reprobe_interval);
                if rdma.is_none() {
                    fallback.rdma_failed(clock::now());
                }
                Mutex::new(Dest {
                    ep,
                    rdma: [None, None],
                    tcp: [None, None],
                    quarantine: Quarantine::new(
                        cfg.quarantine_connection_failures,
                        cfg.quarantine_request_failures,
                        cfg.quarantine_window,
                    ),
                    fallback,
                    rdma_failures: 0,
                    tcp_serves: false,
                    next_quarantine_probe: None,
                })
            })
            .collect();
        let connecting = (0..dests.len()).map(|_| tokio::sync::Mutex::new(())).collect();
        Client {
            connecting,
            retry: Mutex::new(RetryPolicy::new(cfg.retry_probability, cfg.max_retries, cfg.seed)),
            rdma,
            tcp,
            cfg,
            dests,
            rotate: AtomicUsize::new(0),
            stats: Arc::new(ClientStats::default()),
            pool,
            unwell: |_| false,
            resolver: Arc::new(resolve_host),
        }
    }

    /// Resolves destinations' host names with `resolver` instead of the system's.
    pub fn with_resolver(mut self, resolver: Resolver) -> Client {
        self.resolver = resolver;
        self
    }

    /// For a named destination, its addresses after resolving its name again (bounded by
    /// the connect deadline); the last known ones if that fails.
    async fn resolved(&self, id: usize) -> Result<Endpoint, RpcError> {
        let ep = self.dests[id].lock().ep.clone();
        let Some(name) = ep.host.clone() else { return Ok(ep) };
        let resolver = self.resolver.clone();
        let lookup = tokio::task::spawn_blocking(move || resolver(&name));
        let ip = match tokio::time::timeout(self.cfg.connect_timeout, lookup).await {
            Ok(Ok(ip)) => ip,
            _ => None,
        };
        let mut d = self.dests[id].lock();
        match ip {
            Some(ip) => {
                if ip != d.ep.rdma.ip() {
                    tracing::info!(host = %d.ep.host.as_deref().unwrap_or(""), %ip, "destination resolved");
                }
                d.ep.rdma.set_ip(ip);
                d.ep.tcp.set_ip(ip);
            }
            None if d.ep.rdma.ip().is_unspecified() => {
                return Err(RpcError::Connect(format!(
                    "{}: the name does not resolve",
                    d.ep.host.as_deref().unwrap_or("")
                )));
            }
            None => {}
        }
        Ok(d.ep.clone())
    }

    /// Judges replies with `unwell` (given the reply body): a reply it calls unwell (say, a
    /// server that answers everything "unavailable") counts as a request failure towards
    /// quarantine and the call tries the next replica; if every replica answers so, the
    /// last such reply is returned. The RPC layer cannot read service statuses itself.
    pub fn with_unwell_replies(mut self, unwell: fn(&[u8]) -> bool) -> Client {
        self.unwell = unwell;
        self
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ClientStats> {
        &self.stats
    }

    /// The pool request frames come from.
    pub fn pool(&self) -> &'static Pool {
        self.pool
    }

    /// Destinations now quarantined and now on TCP (a gauge for operators; one lock per
    /// destination).
    pub fn destination_counts(&self) -> DestinationCounts {
        let mut c = DestinationCounts { total: self.dests.len(), ..DestinationCounts::default() };
        for d in &self.dests {
            let d = d.lock();
            c.quarantined += usize::from(d.quarantine.is_quarantined());
            c.on_tcp += usize::from(d.fallback.on_tcp());
        }
        c
    }

    /// True while destination `id` is quarantined.
    pub fn is_quarantined(&self, id: usize) -> bool {
        self.dests[id].lock().quarantine.is_quarantined()
    }

    /// True while destination `id` uses TCP.
    pub fn on_tcp(&self, id: usize) -> bool {
        self.dests[id].lock().fallback.on_tcp()
    }

    /// Calls `method` on one of `replicas` (ids into the endpoint list) with a copy of
    /// `body` (control paths; the data path builds its frame with [`Client::call_frame`]).
    pub async fn call(
        &self,
        replicas: &[usize],
        method: u16,
        body: &[u8],
    ) -> Result<Msg, RpcError> {
        let mut frame = alloc_frame(self.pool, body.len())?;
        frame.as_mut_slice()[HEADER_LEN..].copy_from_slice(body);
        self.call_frame(replicas, method, frame, None).await
    }

    /// Calls `method` on one of `replicas` with `frame` (from [`alloc_frame`], the body
    /// encoded at `[HEADER_LEN..]` by the caller). Every attempt sends the same registered
    /// buffer (its header rewritten in place once the previous send let go of it, copied
    /// only if one still holds it). With `reply_capacity` (the largest reply frame
    /// expected, header included), an RDMA attempt exposes a buffer that size and the
    /// server writes the reply into it: no RTS/CTS round trip, no copy.
    pub async fn call_frame(
        &self,
        replicas: &[usize],
        method: u16,
        frame: Msg,
        reply_capacity: Option<usize>,
    ) -> Result<Msg, RpcError> {
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        if frame.len() < HEADER_LEN {
            return Err(RpcError::Protocol("a request frame has room for its header".into()));
        }
        let id = next_request_id();
        let mut frame = SharedMsg::new(frame);
        let big = |n: usize| self.cfg.bulk_lane_bytes > 0 && n > self.cfg.bulk_lane_bytes;
        let lane = if big(frame.len()) || reply_capacity.is_some_and(big) {
            Lane::Bulk
        } else {
            Lane::Small
        };
        let call = Call { method, id, reply_capacity, lane };
        if replicas.is_empty() {
            return Err(RpcError::NoReplica);
        }
        let now = clock::now();
        let list: Vec<Replica> =
            replicas.iter().map(|&id| Replica { pod: self.dests[id].lock().ep.pod, id }).collect();
        let order = order_replicas(
            &list,
            self.cfg.local_pod,
            |id| {
                let d = self.dests[id].lock();
                // A quarantined destination whose probe is due is tried like a healthy one.
                d.quarantine.is_quarantined() && d.next_quarantine_probe.is_none_or(|t| now < t)
            },
            self.rotate.fetch_add(1, Ordering::Relaxed),
        );
        // The ladder (paper §7.2): every replica over RDMA first (each connection retried
        // once inside `channel`), so a broken RDMA path sends the call to the other mini-pod;
        // TCP only once no replica could be reached over RDMA. Rejected: falling back to TCP
        // per destination first, which served from a degraded path while an RDMA replica was
        // healthy.
        let mut over_tcp = self.rdma.is_none();
        let mut rdma_path_failed = false;
        let mut unwell: Option<Msg> = None;
        let mut retries = 0u32;
        let mut i = 0usize;
        let budget = self.cfg.call_deadline();
        let deadline = tokio::time::Instant::now() + budget;
        let last = loop {
            let r = order[i % order.len()];
            let attempt = self.call_dest(r.id, &mut frame, &call, over_tcp);
            let Ok(result) = tokio::time::timeout_at(deadline, attempt).await else {
                // The call's deadline cut this attempt short (a connect or a request):
                // counted as a timeout, not held against the destination, which may only
                // have been slow to be reached by this rung of the ladder.
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                break RpcError::Timeout(budget);
            };
            match result {
                Ok((m, true)) => {
                    i += 1;
                    if i >= order.len() {
                        return Ok(m);
                    }
                    unwell = Some(m);
                }
                Ok((m, false)) => {
                    if r.pod != self.cfg.local_pod {
                        self.stats.remote_pod_calls.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(m);
                }
                Err(e) => {
                    i += 1;
                    if !over_tcp && matches!(e, RpcError::Connect(_) | RpcError::Transport(_)) {
                        rdma_path_failed = true;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break e;
                    }
                    if matches!(e, RpcError::Timeout(_)) {
                        if !self.retry.lock().should_retry(retries) {
                            break e;
                        }
                        retries += 1;
                        self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    } else if i >= order.len() {
                        if rdma_path_failed && !over_tcp {
                            // No replica over RDMA: the last rung, every replica over TCP.
                            over_tcp = true;
                            i = 0;
                            continue;
                        }
                        break e;
                    }
                }
            }
        };
        if let Some(m) = unwell {
            // A replica answered, if unwell: its status says more than a later failure.
            return Ok(m);
        }
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        Err(last)
    }

    async fn connect(&self, id: usize, kind: TransportKind) -> Result<Arc<Channel>, RpcError> {
        let ep = match self.resolved(id).await {
            Ok(ep) => ep,
            Err(e) => {
                self.stats.connects.fetch_add(1, Ordering::Relaxed);
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let (t, addr) = match (kind, &self.rdma) {
            (TransportKind::Rdma, Some(r)) => (r, ep.rdma),
            _ => (&self.tcp, ep.tcp),
        };
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(self.cfg.connect_timeout, t.connect(addr)).await {
            Ok(Ok(s)) => Ok(Arc::new(Channel::new(s, self.pool, self.stats.clone()))),
            Ok(Err(e)) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                Err(RpcError::Connect(e.to_string()))
            }
            Err(_) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                Err(RpcError::Connect(format!(
                    "{addr}: no connection within {:?}",
                    self.cfg.connect_timeout
                )))
            }
        }
    }

    /// The channel to use for `id` and `lane` now, connecting (RDMA: and reconnecting once)
    /// if needed; over TCP only with `over_tcp` (the ladder's last rung), and then for a
    /// destination whose RDMA is failed or fails now.
    async fn channel(
        &self,
        id: usize,
        lane: Lane,
        over_tcp: bool,
    ) -> Result<Arc<Channel>, RpcError> {
        if let Some(c) = self.live_channel(id, lane, over_tcp) {
            return Ok(c);
        }
        // Waiting for another call's connect is bounded like a connect: under a partition
        // hundreds of calls queued here for one connect attempt after another, each holding
        // the lock for up to 3·Tc, and answered seconds past their deadline (chaos run).
        // A call that cannot get its turn moves down the ladder; the destination is not
        // blamed for it.
        let Ok(_one_at_a_time) =
            tokio::time::timeout(self.cfg.connect_timeout, self.connecting[id].lock()).await
        else {
            return Err(RpcError::Connect(format!(
                "another call has been connecting to destination {id} for {:?}",
                self.cfg.connect_timeout
            )));
        };
        self.channel_locked(id, lane, over_tcp).await
    }

    /// The live channel of the path `id` uses now, if there is one.
    fn live_channel(&self, id: usize, lane: Lane, over_tcp: bool) -> Option<Arc<Channel>> {
        let now = clock::now();
        let d = self.dests[id].lock();
        let c = if self.rdma.is_some() && d.fallback.use_rdma(now) {
            &d.rdma
        } else if over_tcp {
            &d.tcp
        } else {
            return None;
        };
        c[lane as usize].clone().filter(|c| c.broken().is_none())
    }

    async fn channel_locked(
        &self,
        id: usize,
        lane: Lane,
        over_tcp: bool,
    ) -> Result<Arc<Channel>, RpcError> {
        let now = clock::now();
        let l = lane as usize;
        let (use_rdma, rdma, tcp) = {
            let d = self.dests[id].lock();
            let live = |c: &Option<Arc<Channel>>| c.clone().filter(|c| c.broken().is_none());
            (self.rdma.is_some() && d.fallback.use_rdma(now), live(&d.rdma[l]), live(&d.tcp[l]))
        };
        if use_rdma {
            if let Some(c) = rdma {
                return Ok(c);
            }
            // Connect, and reconnect once: the first rung of the ladder.
            for _ in 0..2 {
                match self.connect(id, TransportKind::Rdma).await {
                    Ok(c) => {
                        let mut d = self.dests[id].lock();
                        if d.fallback.on_tcp() {
                            self.stats.recoveries.fetch_add(1, Ordering::Relaxed);
                        }
                        d.fallback.rdma_ok();
                        d.rdma_failures = 0;
                        d.rdma[l] = Some(c.clone());
                        return Ok(c);
                    }
                    Err(_) => self.note_rdma_failure(id),
                }
            }
            // TCP only on the ladder's last rung, and only for a destination that fell back
            // (never with `tcp_fallback = false`).
            if !over_tcp || !self.dests[id].lock().fallback.on_tcp() {
                return Err(RpcError::Connect("RDMA connection failed twice".into()));
            }
        } else if !over_tcp {
            return Err(RpcError::Connect("RDMA is failed to this destination (on TCP)".into()));
        }
        if let Some(c) = tcp {
            return Ok(c);
        }
        match self.connect(id, TransportKind::Tcp).await {
            Ok(c) => {
                self.dests[id].lock().tcp[l] = Some(c.clone());
                Ok(c)
            }
            Err(e) => {
                self.dests[id].lock().tcp_serves = false;
                self.note_connection_failure(id);
                Err(e)
            }
        }
    }

    fn note_connection_failure(&self, id: usize) {
        self.note_failure(id, Quarantine::connection_failed);
    }

    fn note_request_failure(&self, id: usize) {
        self.note_failure(id, Quarantine::request_failed);
    }

    /// Counts a failure of destination `id` towards its quarantine; while quarantined, any
    /// failure (a failed probe) starts another period.
    fn note_failure(&self, id: usize, count: fn(&mut Quarantine, std::time::Instant)) {
        let now = clock::now();
        let mut d = self.dests[id].lock();
        let was = d.quarantine.is_quarantined();
        count(&mut d.quarantine, now);
        if !was && d.quarantine.is_quarantined() {
            self.stats.quarantines.fetch_add(1, Ordering::Relaxed);
        }
        if d.quarantine.is_quarantined() {
            d.next_quarantine_probe = Some(now + self.cfg.quarantine_probe_interval);
        }
    }

    fn note_rdma_failure(&self, id: usize) {
        // A failed re-probe of a destination that serves over TCP is not a failure of the
        // destination: counting it would quarantine a healthy server whose RDMA is down.
        // One that is not known to serve over TCP (dead, or never asked over TCP since the
        // ladder found another replica) counts, or it would be re-probed forever.
        let serving_over_tcp = {
            let d = self.dests[id].lock();
            d.fallback.on_tcp() && d.tcp_serves
        };
        if !serving_over_tcp {
            self.note_connection_failure(id);
        }
        let now = clock::now();
        let mut d = self.dests[id].lock();
        // Both lanes ride on the destination's one engine.
        d.rdma = [None, None];
        d.rdma_failures += 1;
        if d.rdma_failures >= self.cfg.rdma_failures_before_fallback {
            if !d.fallback.on_tcp() {
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(dest = %d.ep.rdma, "RDMA keeps failing: falling back to TCP");
            }
            d.fallback.rdma_failed(now);
            d.rdma_failures = 0;
        }
    }

    /// Writes this attempt's header into the frame: in place once no earlier send holds
    /// it, else into a copy (an attempt whose send is still queued).
    fn stamp(&self, frame: &mut SharedMsg, header: &Header) -> Result<(), RpcError> {
        if let Some(m) = frame.get_mut() {
            header.encode(m.as_mut_slice());
            return Ok(());
        }
        let mut copy = Msg::copy_from(self.pool, frame.as_slice()).map_err(RpcError::Transport)?;
        header.encode(copy.as_mut_slice());
        *frame = SharedMsg::new(copy);
        Ok(())
    }

    async fn call_dest(
        &self,
        id: usize,
        frame: &mut SharedMsg,
        call: &Call,
        over_tcp: bool,
    ) -> Result<(Msg, bool), RpcError> {
        let ch = self.channel(id, call.lane, over_tcp).await?;
        let kind = ch.kind();
        let target = match call.reply_capacity {
            Some(c) => ch.expose_reply(c.max(HEADER_LEN)).await?,
            None => None,
        };
        let header = Header { target, ..Header::request(call.method, call.id) };
        self.stamp(frame, &header)?;
        let r = ch.call_shared(frame, call.id, self.cfg.request_timeout).await.map(|m| {
            let unwell = (self.unwell)(m.as_slice());
            (m, unwell)
        });
        match &r {
            Ok((_, true)) => {
                // Not a probe success either: the destination stays where it is.
                self.stats.unwell_replies.fetch_add(1, Ordering::Relaxed);
                self.note_request_failure(id);
            }
            Ok((_, false)) => {
                let mut d = self.dests[id].lock();
                if d.quarantine.is_quarantined() {
                    d.quarantine.probe_succeeded();
                    d.next_quarantine_probe = None;
                }
                if kind == TransportKind::Tcp {
                    self.stats.tcp_calls.fetch_add(1, Ordering::Relaxed);
                    d.tcp_serves = true;
                }
            }
            Err(RpcError::Timeout(_)) => {
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                self.note_request_failure(id);
            }
            Err(RpcError::Transport(_)) => {
                // The connection broke under the call.
                if kind == TransportKind::Rdma {
                    self.note_rdma_failure(id);
                } else {
                    {
                        let mut d = self.dests[id].lock();
                        d.tcp[call.lane as usize] = None;
                        d.tcp_serves = false;
                    }
                    self.note_connection_failure(id);
                }
            }
            Err(_) => {}
        }
        r
    }
}
