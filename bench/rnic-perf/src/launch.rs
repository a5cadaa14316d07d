//! `rnic-perf run`: the server as a child process of this executable, on loopback, started,
//! awaited and reaped by the harness ([`bex_bench::server::spawn_local`]); the client then
//! proves it ready by completing the control handshake on the port it announced.

use crate::client::{run_client, ClientOptions};
use crate::error::Result;
use crate::report::JobResult;
use crate::spec::Plan;

/// The tool's name, in its server's ready line and its reports.
pub const TOOL: &str = "rnic-perf";

/// How [`run_local`] runs the two sides.
#[derive(Debug)]
pub struct LocalRun<'a> {
    /// With P > 0 the client's soft RNIC uses UDP port P and the server's P + 1.
    pub rnic_port: u16,
    /// The RNIC of both sides.
    pub nic: &'a bex_transport::NicSpec,
    /// Where the server child pins itself.
    pub server_cpu: Option<usize>,
    /// Print only errors.
    pub quiet: bool,
}

/// Spawns `rnic-perf server` as a child on 127.0.0.1, runs the client against it, and reaps
/// the child.
pub fn run_local(plan: &Plan, local: &LocalRun<'_>) -> Result<Vec<JobResult>> {
    let LocalRun { rnic_port, nic, server_cpu, quiet } = *local;
    let server_rnic_port = if rnic_port == 0 { 0 } else { rnic_port.wrapping_add(1) };
    let mut args = vec![
        "--rnic-port".to_string(),
        server_rnic_port.to_string(),
        "--nic".into(),
        nic.to_string(),
    ];
    if quiet {
        args.push("--quiet".into());
    }
    let (guard, server) = bex_bench::server::spawn_local(TOOL, &args, server_cpu)?;
    let results = run_client(&ClientOptions { server, rnic_port, nic: nic.clone(), quiet }, plan)?;
    bex_bench::server::finish(guard)?;
    Ok(results)
}
