//! Where the two processes run. On a small VM the placement dominates ping-pong latency: on
//! this project's 2-vCPU KVM machines a loopback UDP round trip takes about 9 µs when client
//! and server share a vCPU and about 35 µs when each has its own (waking a halted vCPU costs
//! an inter-processor interrupt through the hypervisor), and an unpinned run flips between the
//! two from one job to the next. So `run` pins both processes, by default one per CPU, and the
//! report records the placement.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How `run` places client and server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Pin {
    /// Client on the first allowed CPU, server on the second (like two hosts; needs 2 CPUs).
    Split,
    /// Client and server both on the first allowed CPU.
    Same,
    /// No pinning: the scheduler decides, and may change its mind between jobs.
    None,
}

/// The placement a run used, as reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The client's CPU, if pinned.
    pub client_cpu: Option<usize>,
    /// The server's CPU, if pinned (and known: a standalone server reports nothing).
    pub server_cpu: Option<usize>,
}

impl Placement {
    /// A client alone (`client --cpu`): the server's CPU is not known here.
    pub fn client(cpu: Option<usize>) -> Placement {
        Placement { client_cpu: cpu, server_cpu: None }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cpu = |c: Option<usize>| c.map_or("unpinned".to_string(), |c| format!("CPU {c}"));
        write!(f, "client {}, server {}", cpu(self.client_cpu), cpu(self.server_cpu))
    }
}

/// The CPUs this process may run on, ascending.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map_err(|e| Error::Io { what: "sched_getaffinity".into(), source: e.into() })?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
}

/// The client and server CPUs for `pin`, chosen among `allowed`.
pub fn choose(pin: Pin, allowed: &[usize]) -> Result<Placement> {
    let first = || allowed.first().copied().ok_or_else(|| Error::Usage("no CPU is allowed".into()));
    Ok(match pin {
        Pin::None => Placement::default(),
        Pin::Same => Placement { client_cpu: Some(first()?), server_cpu: Some(first()?) },
        Pin::Split => match allowed {
            [a, b, ..] => Placement { client_cpu: Some(*a), server_cpu: Some(*b) },
            _ => {
                return Err(Error::Usage(format!(
                    "--pin split needs two CPUs, this process may use {allowed:?}; \
                     use --pin same or --pin none"
                )))
            }
        },
    })
}

/// `run`'s placement for `pin` among this process's CPUs, with this process pinned to the
/// client's CPU (first thing in `main`, before any thread exists).
pub fn place(pin: Pin) -> Result<Placement> {
    let placement = choose(pin, &allowed_cpus()?)?;
    pin_to(placement.client_cpu)?;
    Ok(placement)
}

/// [`pin_self`] when `cpu` is given (`--cpu N`).
pub fn pin_to(cpu: Option<usize>) -> Result<()> {
    cpu.map_or(Ok(()), pin_self)
}

/// Pins the calling thread, and so every thread it starts afterwards, to `cpu`. Call it
/// first thing in `main`, before any thread exists.
pub fn pin_self(cpu: usize) -> Result<()> {
    use nix::sched::{sched_setaffinity, CpuSet};
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|_| Error::Usage(format!("CPU {cpu} does not exist")))?;
    sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(|e| {
        Error::Usage(format!("cannot pin to CPU {cpu}: {e} (allowed: {:?})", allowed_cpus().ok()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_follow_the_allowed_cpus() {
        assert_eq!(choose(Pin::None, &[0, 1]).unwrap(), Placement::default());
        let p = choose(Pin::Split, &[2, 5, 7]).unwrap();
        assert_eq!((p.client_cpu, p.server_cpu), (Some(2), Some(5)));
        let p = choose(Pin::Same, &[3]).unwrap();
        assert_eq!((p.client_cpu, p.server_cpu), (Some(3), Some(3)));
        assert!(matches!(choose(Pin::Split, &[0]), Err(Error::Usage(_))));
        assert!(choose(Pin::Same, &[]).is_err());
    }

    #[test]
    fn this_process_has_cpus() {
        assert!(!allowed_cpus().unwrap().is_empty());
    }
}
