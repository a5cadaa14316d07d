//! `bex-perf client`: runs the plan's jobs in order — simulation jobs in this process,
//! loopback jobs against a `bex-perf server` — and collects one [`Point`] per job.

use bex_bench::Failure;
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bex_bench::clock::Clock;
use bex_bench::report::Progress;
use bex_bench::stats::{summarize_bw, BwRep};
use tokio::net::TcpStream;

use crate::control::{unexpected, Control, Ctl, PROTOCOL_VERSION};
use crate::error::{io, BenchError, Result};
use crate::net::{
    context_switches, counter_map, cpu_us, host_busy_us, LazyNode, Node, Socket, Transport,
};
use crate::report::{Measured, Outcome, Point};
use crate::sim::{frag_sim, hol_sim};
use crate::spec::{Job, Plan, ServerSetup, Work};
use crate::workload::{broadcast, hol, pingpong, windowed};
use bex_transport::NicSpec;

/// How long connecting to the control port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest one loopback job may run before it counts as failed.
pub const JOB_LIMIT: Duration = Duration::from_secs(90);

/// Where and how the client runs.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The server's control address (needed when the plan has loopback jobs).
    pub server: Option<SocketAddr>,
    /// The NIC the RDMA transports use.
    pub nic: NicSpec,
    /// No progress lines.
    pub quiet: bool,
}

/// What a session produced.
#[derive(Debug)]
pub struct Session {
    /// One point per job, in plan order.
    pub points: Vec<Point>,
    /// The server's process id, when there was a server.
    pub server_pid: Option<u32>,
}

/// Runs every job of `plan`. Job failures are points; `Err` is for a session that could not
/// start.
pub async fn run_client(opts: &ClientOptions, plan: &Plan) -> Result<Session> {
    let mut ctrl = None;
    let mut server_pid = None;
    if plan.needs_server() {
        let addr = opts
            .server
            .ok_or_else(|| BenchError::usage("these tests need a server (--server HOST:PORT)"))?;
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                BenchError::timeout(format!("the control connection to {addr}"), CONNECT_TIMEOUT)
            })?
            .map_err(io(format!(
                "cannot reach a bex-perf server at {addr} (is `bex-perf server` running there?)"
            )))?;
        let mut c = Control::new(stream)?;
        c.send(&Ctl::Hello { version: PROTOCOL_VERSION }).await?;
        match c.recv_ok().await? {
            Ctl::Welcome { version, pid } if version == PROTOCOL_VERSION => server_pid = Some(pid),
            Ctl::Welcome { version, .. } => {
                return Err(BenchError::protocol(format!(
                    "server speaks protocol {version}, this client {PROTOCOL_VERSION}"
                )))
            }
            m => return Err(unexpected("welcome", &m)),
        }
        ctrl = Some(c);
    }
    let ip = match &ctrl {
        Some(c) => c.local_addr()?.ip(),
        None => IpAddr::V4(Ipv4Addr::LOCALHOST),
    };
    let mut progress = Progress::new(plan.jobs.len(), opts.quiet);
    let mut node = LazyNode::new(opts.nic.clone());
    let mut dead: Option<String> = None;
    for job in &plan.jobs {
        let (host0, own0, t0) = (host_busy_us(), cpu_us(), Clock.now());
        let point = match (&job.server, job.work) {
            (None, Work::Sim { flows, large, samples, link_gbps, seed }) => {
                sim_point(job, flows, large, samples, link_gbps, seed)
            }
            (None, Work::SimTput { size, window, msgs, link_gbps, seed }) => {
                sim_tput_point(job, size, window, msgs, link_gbps, seed)
            }
            (None, _) => Point::new(
                job.clone(),
                Outcome::Failed("a loopback job without a server setup".into()),
            ),
            (Some(_), _) if dead.is_some() => {
                Point::new(job.clone(), Outcome::Skipped(dead.clone().unwrap_or_default()))
            }
            (Some(setup), _) => {
                let c = ctrl.as_mut().expect("connected when the plan needs a server");
                match remote_point(c, &mut node, ip, job, setup).await {
                    Ok(p) => p,
                    Err(e) => {
                        dead = Some(format!(
                            "the session ended when {} {} failed: {e}",
                            job.test, job.series
                        ));
                        Point::new(job.clone(), Outcome::Failed(e.to_string()))
                    }
                }
            }
        };
        let mut point = point;
        // What other processes took from the host's CPUs while this job ran: the host's busy
        // time minus this process's and the server's.
        let own = cpu_us().saturating_sub(own0) + point.server_counters.get("cpu_us").unwrap_or(&0);
        if let (Some(h0), Some(h1)) = (host0, host_busy_us()) {
            let other = h1.saturating_sub(h0).saturating_sub(own);
            point.extra.insert("other_cpu_ms".into(), other as f64 / 1000.0);
            point.extra.insert("job_ms".into(), (Clock.now() - t0).as_secs_f64() * 1000.0);
        }
        progress.push(point);
    }
    if let Some(mut c) = ctrl {
        if dead.is_none() {
            c.send(&Ctl::Bye).await?;
        }
    }
    Ok(Session { points: progress.done, server_pid })
}

fn sim_tput_point(
    job: &Job,
    size: u64,
    window: u32,
    msgs: u32,
    link_gbps: u32,
    seed: u64,
) -> Point {
    match frag_sim(&job.knobs, size, window, msgs, link_gbps, seed) {
        Ok(elapsed) => {
            let reps = vec![BwRep::new(size as u32, u64::from(msgs), elapsed)];
            let summary = summarize_bw(&reps).expect("one repetition");
            let mut p =
                Point::new(job.clone(), Outcome::Measured(Measured::Throughput { summary, reps }));
            p.extra.insert("seed".into(), seed as f64);
            p
        }
        Err(e) => Point::new(job.clone(), Outcome::Failed(format!("{e} (seed {seed})"))),
    }
}

fn sim_point(job: &Job, flows: u32, large: u64, samples: u32, link_gbps: u32, seed: u64) -> Point {
    match hol_sim(&job.knobs, flows, large, samples, link_gbps, seed) {
        Ok(r) => match r.small.summary() {
            Some(summary) => {
                let mut p = Point::new(
                    job.clone(),
                    Outcome::Measured(Measured::Latency { summary, histogram: r.small.buckets() }),
                );
                p.extra.insert("large_gbps".into(), r.large_gbps);
                p.extra.insert("virtual_ms".into(), r.virtual_ms);
                p.extra.insert("seed".into(), seed as f64);
                p
            }
            None => Point::new(job.clone(), Outcome::Failed("no samples".into())),
        },
        Err(e) => Point::new(job.clone(), Outcome::Failed(format!("{e} (seed {seed})"))),
    }
}

/// Runs one loopback job. `Err` only when the control channel broke (the session is over);
/// everything else is a point with its outcome.
async fn remote_point(
    ctrl: &mut Control,
    node: &mut LazyNode,
    ip: IpAddr,
    job: &Job,
    setup: &ServerSetup,
) -> Result<Point> {
    ctrl.send(&Ctl::Setup { setup: *setup }).await?;
    let addrs = match ctrl.recv().await? {
        Ctl::Ready { addrs } => addrs,
        Ctl::Failed { message } => {
            return Ok(Point::new(job.clone(), Outcome::Failed(message)));
        }
        m => return Err(unexpected("ready", &m)),
    };
    let mut point = match client_side(node, ip, job, setup, &addrs).await {
        Ok(p) => p,
        Err(e) => Point::new(job.clone(), Outcome::Failed(e.to_string())),
    };
    ctrl.send(&Ctl::Finish).await?;
    match ctrl.recv_ok().await? {
        Ctl::Done { counters } => point.server_counters = counters,
        m => return Err(unexpected("done", &m)),
    }
    Ok(point)
}

/// Starts this side's transport, runs the work (bounded by [`JOB_LIMIT`]), and always shuts
/// the transport down, which fails whatever is still in flight.
async fn client_side(
    node: &mut LazyNode,
    ip: IpAddr,
    job: &Job,
    setup: &ServerSetup,
    addrs: &[SocketAddr],
) -> Result<Point> {
    if addrs.is_empty() {
        return Err(BenchError::protocol("the server started no transport"));
    }
    let node = node.get(ip)?;
    let (cpu0, csw0) = (cpu_us(), context_switches());
    let t = node.start(job.kind, ip, job.knobs.config()?).await?;
    let r = tokio::time::timeout(JOB_LIMIT, work(&t, node, job, setup, addrs)).await;
    let mut counters = counter_map(&t.counters());
    counters.insert("cpu_us".into(), cpu_us().saturating_sub(cpu0));
    counters.insert("context_switches".into(), context_switches().saturating_sub(csw0));
    t.shutdown();
    let (outcome, extra) = r.map_err(|_| {
        BenchError::timeout(format!("{} {} x={}", job.test, job.series, job.x), JOB_LIMIT)
    })??;
    let mut p = Point::new(job.clone(), outcome);
    p.extra = extra;
    p.client_counters = counters;
    Ok(p)
}

async fn connect_all(t: &Transport, addrs: &[SocketAddr], n: u32) -> Result<Vec<Arc<Socket>>> {
    let mut socks = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        socks.push(Arc::new(t.connect(addrs[i % addrs.len()]).await?));
    }
    Ok(socks)
}

fn latency(rec: &bex_bench::stats::LatencyRecorder) -> Result<Outcome> {
    let summary = rec.summary().ok_or_else(|| BenchError::check("no round trips recorded"))?;
    Ok(Outcome::Measured(Measured::Latency { summary, histogram: rec.buckets() }))
}

async fn work(
    t: &Transport,
    node: &Node,
    job: &Job,
    setup: &ServerSetup,
    addrs: &[SocketAddr],
) -> Result<(Outcome, BTreeMap<String, f64>)> {
    let clock = Clock;
    let pool = node.pool();
    let ack = setup.ack_bytes as usize;
    let mut extra = BTreeMap::new();
    let outcome = match job.work {
        Work::PingPong { size, warmup, iters } => {
            let s = t.connect(addrs[0]).await?;
            latency(&pingpong(&s, pool, size as usize, warmup, iters, clock).await?)?
        }
        Work::Window { size, engines, window, warmup, msgs, reps } => {
            let socks = connect_all(t, addrs, engines).await?;
            let reps =
                windowed(&socks, pool, size as usize, ack, window, warmup, msgs, reps, clock)
                    .await?;
            let summary = summarize_bw(&reps).ok_or_else(|| BenchError::check("no repetitions"))?;
            Outcome::Measured(Measured::Throughput { summary, reps })
        }
        Work::Hol { shape } => {
            let s = t.connect(addrs[0]).await?;
            let larges = connect_all(t, &addrs[..1], shape.flows).await?;
            let r = hol(&s, &larges, pool, &shape, ack, clock).await?;
            extra.insert("large_gbps".into(), r.large_gbps);
            latency(&r.small)?
        }
        Work::RpcHol { shape, lanes } => {
            let r = crate::workload::rpc_hol(t, addrs[0], pool, &shape, lanes, clock).await?;
            extra.insert("large_gbps".into(), r.large_gbps);
            latency(&r.small)?
        }
        Work::Broadcast { size, shared, fanout, warmup, iters } => {
            let socks = connect_all(t, &addrs[..1], fanout).await?;
            latency(&broadcast(&socks, pool, size as usize, shared, warmup, iters, clock).await?)?
        }
        Work::Sim { .. } | Work::SimTput { .. } => {
            return Err(BenchError::usage("a simulation job has no server side"))
        }
    };
    Ok((outcome, extra))
}
