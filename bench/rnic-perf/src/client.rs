//! `rnic-perf client`: connects to a server and runs the plan's jobs, baselines first.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::backend;
use crate::baseline;
use crate::control::{unexpected, Control, Msg, PROTOCOL_VERSION};
use crate::error::{io, PerfError, Result};
use crate::rdma::ClientSession;
use crate::report::{JobResult, Outcome};
use crate::spec::{JobSpec, Plan, MAX_UDP_PAYLOAD_BYTES};
use bex_bench::clock::Clock;
use bex_bench::report::Progress;
use bex_bench::Failure;

/// How long connecting to the control port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and how the client runs.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The server's control address.
    pub server: SocketAddr,
    /// UDP port of the client's RNIC (0: ephemeral).
    pub rnic_port: u16,
    /// The RNIC.
    pub nic: bex_transport::NicSpec,
    /// No progress lines.
    pub quiet: bool,
}

/// Marks every job of `jobs` that has no result yet as skipped, for `why`.
fn skip_rest(progress: &mut Progress<JobResult>, jobs: &[JobSpec], why: &str) {
    for spec in jobs {
        if !progress.done.iter().any(|r| r.spec == *spec) {
            progress.push(JobResult { spec: *spec, outcome: Outcome::Skipped(why.to_string()) });
        }
    }
}

/// Connects to the server and runs every job of `plan`. Job failures are results; `Err` is for
/// a session that could not start.
pub fn run_client(opts: &ClientOptions, plan: &Plan) -> Result<Vec<JobResult>> {
    let clock = Clock;
    let stream = TcpStream::connect_timeout(&opts.server, CONNECT_TIMEOUT).map_err(io(format!(
        "cannot reach an rnic-perf server at {} (is `rnic-perf server` running there?)",
        opts.server
    )))?;
    let mut ctrl = Control::new(stream)?;
    ctrl.send(&Msg::Hello { version: PROTOCOL_VERSION })?;
    match ctrl.recv_ok()? {
        Msg::Welcome { version } if version == PROTOCOL_VERSION => {}
        Msg::Welcome { version } => {
            return Err(PerfError::protocol(format!(
                "server speaks protocol {version}, this client {PROTOCOL_VERSION}"
            )))
        }
        m => return Err(unexpected("welcome", &m)),
    }
    let local_ip = ctrl.stream().local_addr().map_err(io("control: local address"))?.ip();
    let jobs = plan.jobs();
    let mut progress = Progress::new(jobs.len(), opts.quiet);
    let (rdma_jobs, base_jobs): (Vec<JobSpec>, Vec<JobSpec>) =
        jobs.iter().partition(|j| j.test.is_rdma());

    for spec in &base_jobs {
        if !spec.test.supports_size(spec.size) {
            let why = format!(
                "{} B does not fit one UDP datagram (at most {MAX_UDP_PAYLOAD_BYTES} B)",
                spec.size
            );
            progress.push(JobResult { spec: *spec, outcome: Outcome::NotApplicable(why) });
            continue;
        }
        let run = ctrl
            .send(&Msg::Job { spec: *spec })
            .map_err(PerfError::from)
            .and_then(|()| baseline::run(&mut ctrl, spec, opts.server.ip(), clock));
        match run {
            Ok(outcome) => progress.push(JobResult { spec: *spec, outcome }),
            Err(e) => {
                progress.push(JobResult { spec: *spec, outcome: Outcome::Failed(e.to_string()) });
                let why = format!("the session ended when {} {} B failed", spec.test, spec.size);
                skip_rest(&mut progress, &jobs, &why);
                return Ok(progress.done);
            }
        }
    }

    if !rdma_jobs.is_empty() {
        let bind = SocketAddr::new(local_ip, opts.rnic_port);
        let mut on_result = |r: JobResult| progress.push(r);
        let user =
            ClientSession { ctrl: &mut ctrl, jobs: &rdma_jobs, clock, on_result: &mut on_result };
        match backend::with_device(&opts.nic, bind, user) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                skip_rest(
                    &mut progress,
                    &jobs,
                    &format!("the session ended after an RNIC failure: {e}"),
                );
                return Ok(progress.done);
            }
            // This side has no RNIC: every RNIC job fails with the reason; the session goes on.
            Err(e) => {
                for spec in &rdma_jobs {
                    progress
                        .push(JobResult { spec: *spec, outcome: Outcome::Failed(e.to_string()) });
                }
            }
        }
    }
    ctrl.send(&Msg::Bye)?;
    Ok(progress.done)
}
