//! The client's traffic patterns, over sockets of either transport kind.
//!
//! Every request carries a sequence number in its first 8 bytes and every answer must bring
//! it back (an echo is the request itself, a short response its first bytes), so a lost,
//! duplicated or truncated message is a failed job, not a fast one. Messages are built in
//! registered memory ([`Msg`]), as an application of the transport would.

use bex_bench::Failure;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bemalloc::Pool;
use bex_bench::clock::Clock;
use bex_bench::stats::{BwRep, LatencyRecorder};
use bex_transport::{Msg, TransportError};
use tokio::sync::Notify;

use crate::error::{BenchError, Result};
use crate::net::Socket;
use crate::spec::HolShape;

/// The first error of the detached send tasks of a workload.
#[derive(Debug, Default)]
struct FirstError(Mutex<Option<TransportError>>);

impl FirstError {
    /// Records `e` unless an error is already recorded.
    fn set(&self, e: TransportError) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(e);
    }

    /// The recorded error, if any.
    fn get(&self) -> Option<TransportError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Answered request bytes of a group of flows, with a wake-up per answer.
#[derive(Debug, Default)]
struct Answered {
    bytes: AtomicU64,
    notify: Notify,
}

impl Answered {
    fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
        self.notify.notify_waiters();
    }

    fn get(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Waits until at least `want` bytes were answered.
    async fn reach(&self, want: u64) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.get() >= want {
                return;
            }
            notified.await;
        }
    }
}

/// Writes sequence number `seq` into the first bytes of `m` (as many as fit).
pub fn stamp(m: &mut [u8], seq: u64) {
    let b = seq.to_le_bytes();
    let n = m.len().min(8);
    m[..n].copy_from_slice(&b[..n]);
}

/// Checks that `m` has length `len` and starts with sequence number `seq`.
pub fn check(m: &[u8], len: usize, seq: u64) -> Result<()> {
    if m.len() != len {
        return Err(BenchError::check(format!("answer {seq}: {} bytes, expected {len}", m.len())));
    }
    let b = seq.to_le_bytes();
    let n = len.min(8);
    if m[..n] != b[..n] {
        return Err(BenchError::check(format!("answer {seq}: wrong sequence number")));
    }
    Ok(())
}

/// A message of `len` bytes with a deterministic pattern.
pub fn pattern(pool: &'static Pool, len: usize, seed: u64) -> Result<Msg> {
    let mut m = Msg::alloc(pool, len)?;
    fill(m.as_mut_slice(), seed);
    Ok(m)
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// One message outstanding: sends, waits for the echo, sends the echo back out (so the
/// steady state allocates and copies nothing in the application). Records `iters` round
/// trips after `warmup`, each from just before `send` to the echo's arrival.
pub async fn pingpong(
    sock: &Socket,
    pool: &'static Pool,
    size: usize,
    warmup: u32,
    iters: u32,
    clock: Clock,
) -> Result<LatencyRecorder> {
    let mut rec = LatencyRecorder::new();
    let mut m = pattern(pool, size, 7)?;
    for i in 0..u64::from(warmup + iters) {
        stamp(m.as_mut_slice(), i);
        let t0 = clock.now();
        let (sent, got) = tokio::join!(sock.send(m), async {
            let r = sock.recv().await;
            (r, clock.now())
        });
        let (back, t1) = got;
        let back = back?;
        sent?;
        check(back.as_slice(), size, i)?;
        if i >= u64::from(warmup) {
            rec.record(t1 - t0);
        }
        m = back;
    }
    Ok(rec)
}

/// Sends `count` requests of `size` bytes on `sock` with at most `window` unanswered, each
/// send in its own task (a send resolves only when the transport is done with the buffer);
/// returns when every answer is in (or, once `stop` is set, when none is outstanding).
/// Answers must be `size` bytes (an echo) or `ack` bytes. `answered` counts answered request
/// bytes as they come.
#[allow(clippy::too_many_arguments)] // one flow's parameters and its shared tallies
async fn drive(
    sock: Arc<Socket>,
    pool: &'static Pool,
    size: usize,
    ack: usize,
    window: u64,
    count: u64,
    stop: Option<Arc<AtomicBool>>,
    answered: Arc<Answered>,
    first_error: Arc<FirstError>,
) -> Result<()> {
    let (mut sent, mut got) = (0u64, 0u64);
    let stopped = || stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed));
    while got < count {
        while sent < count && sent - got < window && !stopped() {
            let mut m = Msg::alloc(pool, size)?;
            stamp(m.as_mut_slice(), sent);
            let (s, fe) = (sock.clone(), first_error.clone());
            tokio::spawn(async move {
                if let Err(e) = s.send(m).await {
                    fe.set(e);
                }
            });
            sent += 1;
        }
        if sent == got {
            break; // stopped with nothing outstanding
        }
        let r = sock.recv().await;
        if let Some(e) = first_error.get() {
            return Err(e.into());
        }
        let a = r?;
        if a.len() != size && a.len() != ack {
            return Err(BenchError::check(format!(
                "an answer of {} bytes to a {size}-byte request (expected {size} or {ack})",
                a.len()
            )));
        }
        got += 1;
        answered.add(size as u64);
    }
    Ok(())
}

/// `window` requests outstanding per socket; `warmup` unrecorded requests per socket, then
/// `reps` repetitions of `msgs` requests spread evenly over the sockets, each timed from its
/// first send to its last answer (an echo, or `ack` bytes).
#[allow(clippy::too_many_arguments)] // the parameters of Fig. 9-11, each its own knob
pub async fn windowed(
    socks: &[Arc<Socket>],
    pool: &'static Pool,
    size: usize,
    ack: usize,
    window: u32,
    warmup: u64,
    msgs: u64,
    reps: u32,
    clock: Clock,
) -> Result<Vec<BwRep>> {
    let n = socks.len().max(1) as u64;
    let per_sock = msgs.div_ceil(n).max(1);
    let mut out = Vec::new();
    for rep in 0..=reps {
        let count = if rep == 0 { warmup } else { per_sock };
        if count == 0 {
            continue;
        }
        let answered = Arc::new(Answered::default());
        let first_error = Arc::new(FirstError::default());
        let t0 = clock.now();
        let tasks: Vec<_> = socks
            .iter()
            .map(|s| {
                tokio::spawn(drive(
                    s.clone(),
                    pool,
                    size,
                    ack,
                    u64::from(window),
                    count,
                    None,
                    answered.clone(),
                    first_error.clone(),
                ))
            })
            .collect();
        for t in tasks {
            t.await.map_err(|e| BenchError::protocol(format!("driver task: {e}")))??;
        }
        let elapsed = clock.now() - t0;
        if rep > 0 {
            out.push(BwRep::new(size as u32, count * n, elapsed));
        }
    }
    Ok(out)
}

/// What [`hol`] measured.
#[derive(Debug)]
pub struct HolResult {
    /// Small-flow round trips.
    pub small: LatencyRecorder,
    /// Throughput of the large flows (answered bytes) while the small flow was measured.
    pub large_gbps: f64,
}

/// The `large` sockets (`shape.flows` of them) each keep `shape.window` messages of
/// `shape.large` bytes outstanding while a ping-pong of `shape.small` bytes runs on `small`
/// (all sockets on one engine). The large flows first get one message each through, so the
/// measurement sees them at full speed.
pub async fn hol(
    small: &Socket,
    large: &[Arc<Socket>],
    pool: &'static Pool,
    shape: &HolShape,
    ack: usize,
    clock: Clock,
) -> Result<HolResult> {
    let (small_size, large_size) = (shape.small as usize, shape.large as usize);
    let (window, warmup, iters) = (shape.window, shape.warmup, shape.iters);
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(Answered::default());
    let first_error = Arc::new(FirstError::default());
    let mut flows = tokio::task::JoinSet::new();
    for s in large {
        flows.spawn(drive(
            s.clone(),
            pool,
            large_size,
            ack,
            u64::from(window),
            u64::MAX,
            Some(stop.clone()),
            answered.clone(),
            first_error.clone(),
        ));
    }
    // A large flow only ends by failing (it has no message limit and is not stopped yet).
    let flow_failed = |r: Option<std::result::Result<Result<()>, tokio::task::JoinError>>| match r {
        Some(Ok(Err(e))) => e,
        Some(Err(e)) => BenchError::protocol(format!("large flow task: {e}")),
        _ => BenchError::protocol("a large flow ended early"),
    };
    let measure = async {
        if warmup > 0 {
            pingpong(small, pool, small_size, 0, warmup, clock).await?;
        }
        let (b0, t0) = (answered.get(), clock.now());
        let rec = pingpong(small, pool, small_size, 0, iters, clock).await?;
        let (b1, t1) = (answered.get(), clock.now());
        let ns = (t1 - t0).as_nanos().max(1) as f64;
        Ok(HolResult { small: rec, large_gbps: (b1 - b0) as f64 * 8.0 / ns })
    };
    let r = async {
        tokio::select! {
            _ = answered.reach(large.len() as u64 * large_size as u64) => {}
            r = flows.join_next(), if !flows.is_empty() => return Err(flow_failed(r)),
        }
        tokio::select! {
            r = measure => r,
            r = flows.join_next(), if !flows.is_empty() => Err(flow_failed(r)),
        }
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    flows.abort_all();
    match (r, first_error.get()) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(e)) => Err(e.into()),
        (Ok(r), None) => Ok(r),
    }
}

/// One `hol-rpc` call: asks for a `size`-byte reply (written into a buffer of exactly that
/// size over RDMA) and checks it names call `seq`.
async fn sized_call(
    client: &bex_rpc::Client,
    pool: &'static Pool,
    size: usize,
    seq: u64,
) -> Result<()> {
    let mut frame = bex_rpc::alloc_frame(pool, 16).map_err(rpc_error)?;
    let body = &mut frame.as_mut_slice()[bex_rpc::HEADER_LEN..];
    body[..8].copy_from_slice(&(size as u64).to_le_bytes());
    body[8..16].copy_from_slice(&seq.to_le_bytes());
    let reply = client
        .call_frame(&[0], 1, frame, Some(bex_rpc::HEADER_LEN + size))
        .await
        .map_err(rpc_error)?;
    check(&reply.as_slice()[..8.min(reply.len())], 8.min(size), seq)?;
    if reply.len() != size {
        return Err(BenchError::check(format!("reply {seq}: {} bytes, asked {size}", reply.len())));
    }
    Ok(())
}

fn rpc_error(e: bex_rpc::RpcError) -> BenchError {
    BenchError::protocol(format!("rpc: {e}"))
}

/// `hol` on the RPC path: `shape.flows` tasks each keep `shape.window` calls with
/// `shape.large`-byte replies outstanding to the server at `addr` while calls with
/// `shape.small`-byte replies run one at a time; with `lanes` the client puts the large
/// calls on their own connection (the bulk lane). Over RDMA every reply is written straight
/// into the caller's buffer.
pub async fn rpc_hol(
    transport: &crate::net::Transport,
    addr: std::net::SocketAddr,
    pool: &'static Pool,
    shape: &HolShape,
    lanes: bool,
    clock: Clock,
) -> Result<HolResult> {
    let (small, large) = (shape.small as usize, shape.large as usize);
    let (flows, window, warmup, iters) = (shape.flows, shape.window, shape.warmup, shape.iters);
    let cfg = bex_rpc::ClientConfig {
        connect_timeout: std::time::Duration::from_secs(3),
        request_timeout: std::time::Duration::from_secs(30),
        max_retries: 0,
        retry_probability: 0.0,
        bulk_lane_bytes: if lanes { 64 << 10 } else { 0 },
        ..bex_rpc::ClientConfig::default()
    };
    // The job's one transport serves as the client's only path (`rdma: None`: no ladder).
    let ep = bex_rpc::Endpoint::at(0, addr, addr);
    let client = Arc::new(bex_rpc::Client::new(None, transport.clone(), vec![ep], cfg));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for f in 0..flows * window {
        let (client, stop, answered) = (client.clone(), stop.clone(), answered.clone());
        tasks.spawn(async move {
            let mut seq = u64::from(f) << 32;
            while !stop.load(Ordering::Relaxed) {
                sized_call(&client, pool, large, seq).await?;
                answered.fetch_add(large as u64, Ordering::Relaxed);
                seq += 1;
            }
            Ok::<(), BenchError>(())
        });
    }
    let measure = async {
        for i in 0..u64::from(warmup) {
            sized_call(&client, pool, small, 1 << 60 | i).await?;
        }
        let mut rec = LatencyRecorder::new();
        let (b0, t0) = (answered.load(Ordering::Relaxed), clock.now());
        for i in 0..u64::from(iters) {
            let t = clock.now();
            sized_call(&client, pool, small, 1 << 61 | i).await?;
            rec.record(clock.now() - t);
        }
        let (b1, t1) = (answered.load(Ordering::Relaxed), clock.now());
        let ns = (t1 - t0).as_nanos().max(1) as f64;
        Ok::<_, BenchError>(HolResult { small: rec, large_gbps: (b1 - b0) as f64 * 8.0 / ns })
    };
    let r = tokio::select! {
        r = measure => r,
        Some(Ok(Err(e))) = tasks.join_next(), if !tasks.is_empty() => Err(e),
    };
    stop.store(true, Ordering::Relaxed);
    tasks.abort_all();
    r
}

/// Sends one `size`-byte buffer to every socket and waits for every answer; records the
/// time from the first send to the last answer. `shared`: one registered buffer, shared by
/// every send ([`bex_transport::SharedMsg`]); else each destination gets its own copy of
/// the buffer, made here by the application (a `Msg` is consumed by its send).
pub async fn broadcast(
    socks: &[Arc<Socket>],
    pool: &'static Pool,
    size: usize,
    shared: bool,
    warmup: u32,
    iters: u32,
    clock: Clock,
) -> Result<LatencyRecorder> {
    let mut rec = LatencyRecorder::new();
    let mut src = vec![0u8; size];
    fill(&mut src, 11);
    let first_error = Arc::new(FirstError::default());
    for i in 0..u64::from(warmup + iters) {
        stamp(&mut src, i);
        let t0 = clock.now();
        let one = if shared {
            Some(bex_transport::SharedMsg::new(Msg::copy_from(pool, &src)?))
        } else {
            None
        };
        for s in socks {
            let (s, fe, one) = (s.clone(), first_error.clone(), one.clone());
            let m = if one.is_none() { Some(Msg::copy_from(pool, &src)?) } else { None };
            tokio::spawn(async move {
                let r = match (one, m) {
                    (Some(one), _) => s.send_shared(&one).await,
                    (None, Some(m)) => s.send(m).await,
                    (None, None) => Ok(()),
                };
                if let Err(e) = r {
                    fe.set(e);
                }
            });
        }
        for s in socks {
            let a = s.recv().await?;
            check(&a.as_slice()[..8.min(a.len())], 8.min(size), i)?;
        }
        let t1 = clock.now();
        if let Some(e) = first_error.get() {
            return Err(e.into());
        }
        if i >= u64::from(warmup) {
            rec.record(t1 - t0);
        }
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_checks() {
        let mut b = vec![0u8; 32];
        stamp(&mut b, 0x0102_0304_0506_0708);
        assert!(check(&b, 32, 0x0102_0304_0506_0708).is_ok());
        assert!(matches!(
            check(&b, 16, 0x0102_0304_0506_0708),
            Err(BenchError::Harness(bex_bench::Error::Check(_)))
        ));
        assert!(matches!(check(&b, 32, 9), Err(BenchError::Harness(bex_bench::Error::Check(_)))));
        // Short messages carry the low bytes only.
        let mut s = vec![0u8; 3];
        stamp(&mut s, 0x00aa_bbcc);
        assert_eq!(s, [0xcc, 0xbb, 0xaa]);
        assert!(check(&s, 3, 0x00aa_bbcc).is_ok());
        assert!(check(&[], 0, 5).is_ok());
    }
}
