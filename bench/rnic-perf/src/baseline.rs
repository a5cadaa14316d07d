//! The kernel-socket baselines, with the same two-process shape as the RNIC tests: `udp_lat`
//! (datagram ping-pong), `tcp_lat` (ping-pong with TCP_NODELAY) and `tcp_bw` (one stream).
//! Blocking std sockets; the server learns the job over the control channel, opens a data
//! socket on an ephemeral port and names it in [`Msg::Ready`].

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::time::Duration;

use crate::control::{Control, Msg, Replies};
use crate::error::{io, PerfError, Result};
use crate::report::{Measured, Outcome};
use crate::spec::{JobSpec, Metric, TestKind};
use bex_bench::clock::Clock;
use bex_bench::stats::{summarize_bw, BwRep, LatencyRecorder};
use bex_bench::Failure;

/// A blocking data-socket operation that takes longer than this fails the job.
const DATA_TIMEOUT: Duration = Duration::from_secs(30);
/// The UDP client resends a datagram whose echo has not come back within this.
const UDP_RESEND_AFTER: Duration = Duration::from_millis(200);
/// After this many resends in a row the UDP client gives up.
const UDP_MAX_RESENDS: u32 = 25;
/// How often the UDP echo loop, when idle, checks the control channel for the end of the job.
const UDP_IDLE_CHECK: Duration = Duration::from_millis(20);
/// How long the server waits for the client to connect a TCP data socket.
const ACCEPT_TIMEOUT_MS: u16 = 10_000;

/// Server side of a baseline job: sends `Ready`, serves the data plane, consumes `Finish`.
/// Returns what it received (datagrams echoed, round trips served, or bytes).
pub fn serve(ctrl: &mut Control, spec: &JobSpec, ip: IpAddr) -> Result<u64> {
    match spec.test {
        TestKind::UdpLat => serve_udp_lat(ctrl, spec, ip),
        TestKind::TcpLat => serve_tcp(ctrl, spec, ip),
        TestKind::TcpBw => serve_tcp(ctrl, spec, ip),
        t => Err(PerfError::protocol(format!("{t} is not a baseline"))),
    }
}

/// Client side of a baseline job (after `Job` was sent): runs it and finishes it.
pub fn run(ctrl: &mut Control, spec: &JobSpec, server: IpAddr, clock: Clock) -> Result<Outcome> {
    let port = ctrl
        .expect_ready()?
        .ok_or_else(|| PerfError::protocol("baseline ready without a data port"))?;
    let outcome = match spec.test {
        TestKind::UdpLat => udp_lat(ctrl, spec, server, port, clock)?,
        TestKind::TcpLat | TestKind::TcpBw => {
            let s = TcpStream::connect((server, port)).map_err(io("tcp data: connect"))?;
            tune(&s)?;
            if spec.test.metric() == Metric::Latency {
                tcp_lat(s, spec, clock)?
            } else {
                tcp_bw(s, spec, clock)?
            }
        }
        t => return Err(PerfError::protocol(format!("{t} is not a baseline"))),
    };
    ctrl.send(&Msg::Finish)?;
    ctrl.expect_done()?;
    Ok(outcome)
}

fn tune(s: &TcpStream) -> Result<()> {
    // TCP_NODELAY on both tests: ping-pong needs it, and on a stream it keeps Nagle and
    // delayed ACKs from stalling the last segment of a repetition by tens of milliseconds.
    s.set_nodelay(true).map_err(io("tcp data: set TCP_NODELAY"))?;
    s.set_read_timeout(Some(DATA_TIMEOUT)).map_err(io("tcp data: set read timeout"))?;
    Ok(s.set_write_timeout(Some(DATA_TIMEOUT)).map_err(io("tcp data: set write timeout"))?)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

// ---- UDP ping-pong -------------------------------------------------------------------------

/// Echoes datagrams until the client's zero-length datagram (or, should that be lost, until
/// the client's `Finish` shows up on the control channel while the socket is idle).
fn serve_udp_lat(ctrl: &mut Control, spec: &JobSpec, ip: IpAddr) -> Result<u64> {
    let sock = UdpSocket::bind((ip, 0)).map_err(io("udp data: bind"))?;
    sock.set_read_timeout(Some(UDP_IDLE_CHECK)).map_err(io("udp data: set read timeout"))?;
    let port = sock.local_addr().map_err(io("udp data: local address"))?.port();
    ctrl.send(&Msg::Ready { data_port: Some(port) })?;
    let mut buf = vec![0u8; spec.size as usize + 1];
    let mut connected = false;
    let mut echoed = 0u64;
    loop {
        match sock.recv_from(&mut buf) {
            Ok((0, _)) => break,
            Ok((n, from)) => {
                if !connected {
                    sock.connect(from).map_err(io("udp data: connect to the client"))?;
                    connected = true;
                }
                sock.send(&buf[..n]).map_err(io("udp data: echo"))?;
                echoed += 1;
            }
            Err(e) if is_timeout(&e) => {
                if ctrl.readable()? {
                    break;
                }
            }
            Err(e) => return Err(io("udp data: receive")(e).into()),
        }
    }
    ctrl.expect_finish()?;
    Ok(echoed)
}

fn udp_lat(
    ctrl: &mut Control,
    spec: &JobSpec,
    server: IpAddr,
    port: u16,
    clock: Clock,
) -> Result<Outcome> {
    let local = ctrl.stream().local_addr().map_err(io("control: local address"))?.ip();
    let sock = UdpSocket::bind((local, 0)).map_err(io("udp data: bind"))?;
    sock.connect((server, port)).map_err(io("udp data: connect"))?;
    sock.set_read_timeout(Some(UDP_RESEND_AFTER)).map_err(io("udp data: set read timeout"))?;
    let size = spec.size as usize;
    let mut tx = vec![0xa5u8; size];
    let mut rx = vec![0u8; size + 1];
    // The first (up to) 8 bytes carry the round's sequence number, so a late echo of a
    // resent datagram is never taken for the current one.
    let tag = size.min(8);
    let mut rec = LatencyRecorder::new();
    let mut resends = 0u64;
    let total = u64::from(spec.knobs.warmup) + u64::from(spec.iters);
    for i in 0..total {
        tx[..tag].copy_from_slice(&i.to_le_bytes()[..tag]);
        let mut resent_this_round = 0u32;
        let t0 = clock.now();
        sock.send(&tx).map_err(io("udp data: send"))?;
        loop {
            match sock.recv(&mut rx) {
                Ok(n) if n == size && rx[..tag] == tx[..tag] => break,
                Ok(_) => continue,
                Err(e) if is_timeout(&e) => {
                    resent_this_round += 1;
                    resends += 1;
                    if resent_this_round > UDP_MAX_RESENDS {
                        return Err(PerfError::timeout(
                            "a UDP echo (every resend was lost)",
                            UDP_RESEND_AFTER * UDP_MAX_RESENDS,
                        ));
                    }
                    sock.send(&tx).map_err(io("udp data: resend"))?;
                }
                Err(e) => return Err(io("udp data: receive")(e).into()),
            }
        }
        let rtt = clock.now() - t0;
        // A round that needed a resend measured the resend timer, not the path: left out.
        if i >= u64::from(spec.knobs.warmup) && resent_this_round == 0 {
            rec.record(rtt);
        }
    }
    // Best effort: a lost end marker is covered by the server's idle check.
    let _ = sock.send(&[]);
    latency_outcome(&rec, resends)
}

// ---- TCP ------------------------------------------------------------------------------------

fn serve_tcp(ctrl: &mut Control, spec: &JobSpec, ip: IpAddr) -> Result<u64> {
    let listener = TcpListener::bind((ip, 0)).map_err(io("tcp data: listen"))?;
    let port = listener.local_addr().map_err(io("tcp data: local address"))?.port();
    ctrl.send(&Msg::Ready { data_port: Some(port) })?;
    let s = accept_or_give_up(&listener, ctrl)?;
    tune(&s)?;
    let received = if spec.test == TestKind::TcpLat { echo(s, spec)? } else { drain(s, spec)? };
    ctrl.expect_finish()?;
    Ok(received)
}

/// Accepts the client's data connection, unless the control channel speaks first (the client
/// gave up) or nothing happens for a while.
fn accept_or_give_up(listener: &TcpListener, ctrl: &mut Control) -> Result<TcpStream> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let ready = {
        let ctrl_stream: &TcpStream = ctrl.stream();
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(ctrl_stream.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::from(ACCEPT_TIMEOUT_MS)) {
            Ok(0) => {
                return Err(PerfError::timeout(
                    "the client's data connection",
                    Duration::from_millis(ACCEPT_TIMEOUT_MS.into()),
                ))
            }
            Ok(_) => fds[0].any().unwrap_or(false),
            Err(e) => return Err(io("tcp data: poll")(e.into()).into()),
        }
    };
    if !ready {
        return Err(PerfError::protocol(
            "client spoke on the control channel instead of connecting",
        ));
    }
    Ok(listener.accept().map_err(io("tcp data: accept"))?.0)
}

fn echo(mut s: TcpStream, spec: &JobSpec) -> Result<u64> {
    let mut buf = vec![0u8; spec.size as usize];
    let total = u64::from(spec.knobs.warmup) + u64::from(spec.iters);
    for _ in 0..total {
        s.read_exact(&mut buf).map_err(io("tcp data: read"))?;
        s.write_all(&buf).map_err(io("tcp data: echo"))?;
    }
    Ok(total)
}

/// The stream's phases: the warm-up (if any), then one per repetition.
fn phases(spec: &JobSpec) -> impl Iterator<Item = (bool, u64)> + use<> {
    let warm = (spec.knobs.warmup > 0).then_some((true, u64::from(spec.knobs.warmup)));
    let iters = u64::from(spec.iters);
    warm.into_iter().chain((0..spec.reps).map(move |_| (false, iters)))
}

fn drain(mut s: TcpStream, spec: &JobSpec) -> Result<u64> {
    let mut buf = vec![0u8; 256 << 10];
    let mut total = 0u64;
    for (_, messages) in phases(spec) {
        let mut left = messages * u64::from(spec.size);
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = s.read(&mut buf[..want]).map_err(io("tcp data: read"))?;
            if n == 0 {
                return Err(PerfError::check(format!("stream closed with {left} bytes missing")));
            }
            left -= n as u64;
            total += n as u64;
        }
        s.write_all(&[1]).map_err(io("tcp data: acknowledge"))?;
    }
    Ok(total)
}

fn tcp_lat(mut s: TcpStream, spec: &JobSpec, clock: Clock) -> Result<Outcome> {
    let tx = vec![0xa5u8; spec.size as usize];
    let mut rx = vec![0u8; spec.size as usize];
    let mut rec = LatencyRecorder::new();
    for i in 0..spec.knobs.warmup + spec.iters {
        let t0 = clock.now();
        s.write_all(&tx).map_err(io("tcp data: write"))?;
        s.read_exact(&mut rx).map_err(io("tcp data: read"))?;
        let rtt = clock.now() - t0;
        if i >= spec.knobs.warmup {
            rec.record(rtt);
        }
    }
    latency_outcome(&rec, 0)
}

fn tcp_bw(mut s: TcpStream, spec: &JobSpec, clock: Clock) -> Result<Outcome> {
    let buf = vec![0xa5u8; spec.size as usize];
    let mut ack = [0u8; 1];
    let mut reps = Vec::new();
    for (warm, messages) in phases(spec) {
        let t0 = clock.now();
        for _ in 0..messages {
            s.write_all(&buf).map_err(io("tcp data: write"))?;
        }
        s.read_exact(&mut ack).map_err(io("tcp data: read acknowledgement"))?;
        let elapsed = clock.now() - t0;
        if !warm {
            reps.push(BwRep::new(spec.size, messages, elapsed));
        }
    }
    bandwidth_outcome(reps)
}

/// The outcome of a latency job.
pub fn latency_outcome(rec: &LatencyRecorder, retransmits: u64) -> Result<Outcome> {
    let summary = rec.summary().ok_or_else(|| {
        PerfError::check("no round trip was measured (every one was warm-up or resent)")
    })?;
    Ok(Outcome::Measured(Measured::Latency {
        summary,
        rtt_ns_histogram: rec.buckets(),
        retransmits,
    }))
}

/// The outcome of a bandwidth job.
pub fn bandwidth_outcome(reps: Vec<BwRep>) -> Result<Outcome> {
    let summary =
        summarize_bw(&reps).ok_or_else(|| PerfError::check("no repetition was measured"))?;
    Ok(Outcome::Measured(Measured::Bandwidth { summary, reps }))
}
