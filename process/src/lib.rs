//! What every bex process shares, server or client or tool: dying with its parent (so a
//! launcher that is SIGKILLed leaves no orphans), a fresh identity per start, free loopback
//! ports for local runs, CPU and context-switch accounting from `/proc`, its log
//! subscriber ([`logging`]), its identity from the environment ([`identity`]) and the small
//! HTTP server of `/health` and `/metrics` ([`http`]), and the one guard that kills and reaps
//! a child process ([`child::Guard`]).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

pub mod child;
pub mod clock;
pub mod http;
pub mod identity;
pub mod logging;

/// Asks the kernel to send this process SIGTERM when its parent dies (Linux
/// `PR_SET_PDEATHSIG`), and exits at once if the parent is already gone. Every bex binary
/// that a launcher or benchmark starts calls this first, so a killed parent leaves no process
/// behind; `bex-cluster` only with `--die-with-parent` (a cluster started with nohup outlives
/// its shell).
pub fn exit_with_parent() {
    let parent = nix::unistd::getppid();
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        tracing::warn!(%e, "PR_SET_PDEATHSIG failed: this process can outlive its parent");
    }
    // The parent may have died before the call: then we were re-parented already.
    if nix::unistd::getppid() != parent {
        std::process::exit(143);
    }
}

/// Makes the child that `cmd` starts get SIGTERM when this process dies, from before the
/// program runs: with only the program's own [`exit_with_parent`], a parent SIGKILLed
/// between the fork and that call leaves the child re-parented, and the call then takes the
/// new parent for its own (an orphan for good). In the child, before exec, the death signal
/// is set and the parent checked against this process; a child whose parent is already gone
/// fails to start. The death signal survives exec (but not into set-uid programs).
///
/// Like `PR_SET_PDEATHSIG` itself, "this process" is the thread that spawns: spawn from a
/// thread that lives as long as the children should.
pub fn die_with_this_process(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = nix::unistd::getpid();
    let in_child = move || -> std::io::Result<()> {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
        if nix::unistd::getppid() != parent {
            // No allocation between fork and exec: an OS error code, not a message.
            return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // work is allowed: it makes two system calls (prctl, getppid), takes no lock and
    // allocates nothing (its error is a raw OS code).
    unsafe {
        cmd.pre_exec(in_child);
    }
}

/// A fresh 64-bit identity for this process incarnation, from the OS's random source.
///
/// Servers deduplicate pushes and replication batches by (identity, sequence), and a process
/// numbers its requests from 1 when it starts; so every start needs an identity no earlier
/// life used, or its requests are answered `Duplicate` (acknowledged, never applied) or
/// `TooOld`. A stable id such as a trainer's `--id` is not enough (it survives restarts);
/// persisting a sequence would be, but needs a disk write per push batch. Two starts share
/// an identity with probability 2^-64 per pair.
pub fn incarnation_id() -> Result<u64, String> {
    getrandom::u64().map_err(|e| format!("no random identity from the OS: {e}"))
}

/// Lowest port [`free_local_ports`] hands out: above the well-known and common service ports.
const LOCAL_PORTS_FROM: u16 = 11_000;
/// One past the highest: Linux's ephemeral range starts at 32768, where every socket bound to
/// port 0 (any client) may land, so a fixed cluster port must stay below it.
const LOCAL_PORTS_TO: u16 = 32_000;

/// The first of `count` consecutive loopback ports that are free for both TCP and UDP right
/// now, below the ephemeral range. Tests and local benchmarks use it for `cluster.base_port`.
/// The search starts at a point spread by pid and never hands the same block out twice in
/// one process, so concurrent tests and concurrent test binaries do not collide.
pub fn free_local_ports(count: u16) -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static HANDED_OUT: AtomicU32 = AtomicU32::new(0);
    let count = count.max(1);
    let span = u32::from(LOCAL_PORTS_TO - LOCAL_PORTS_FROM);
    let blocks = span / u32::from(count);
    if blocks == 0 {
        return Err(std::io::Error::other(format!("{count} ports do not fit below 32000")));
    }
    let start = std::process::id().wrapping_mul(7919) % blocks;
    for _ in 0..blocks {
        let block = (start + HANDED_OUT.fetch_add(1, Ordering::Relaxed)) % blocks;
        let base = LOCAL_PORTS_FROM + (block * u32::from(count)) as u16;
        if (base..base + count).all(port_is_free) {
            return Ok(base);
        }
    }
    Err(std::io::Error::other(format!("no {count} consecutive free ports below 32000")))
}

fn port_is_free(port: u16) -> bool {
    let at = SocketAddr::from(([127, 0, 0, 1], port));
    std::net::TcpListener::bind(at).is_ok() && std::net::UdpSocket::bind(at).is_ok()
}

/// CPU time a process has used, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuTimes {
    /// User time.
    pub user_s: f64,
    /// System time.
    pub sys_s: f64,
}

impl CpuTimes {
    /// This process.
    pub fn of_self() -> std::io::Result<CpuTimes> {
        Self::parse(&std::fs::read_to_string("/proc/self/stat")?)
    }

    /// Process `pid`.
    pub fn of_pid(pid: u32) -> std::io::Result<CpuTimes> {
        Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat"))?)
    }

    /// `utime` and `stime` of a `/proc/<pid>/stat` line; the command name (field 2) may
    /// hold spaces and parentheses, so fields are counted after its last `)`.
    pub fn parse(stat: &str) -> std::io::Result<CpuTimes> {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed stat line");
        let rest = &stat[stat.rfind(')').ok_or_else(bad)? + 1..];
        // After the name: state is field 3, utime field 14, stime field 15.
        let f: Vec<&str> = rest.split_whitespace().collect();
        let tick = |i: usize| -> std::io::Result<f64> {
            let v: u64 = f.get(i).ok_or_else(bad)?.parse().map_err(|_| bad())?;
            Ok(v as f64 / clock_ticks_per_s())
        };
        Ok(CpuTimes { user_s: tick(11)?, sys_s: tick(12)? })
    }

    /// `self − earlier`, never negative.
    pub fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user_s: (self.user_s - earlier.user_s).max(0.0),
            sys_s: (self.sys_s - earlier.sys_s).max(0.0),
        }
    }
}

/// What this process has used so far, every thread together, ended ones included (so, unlike
/// [`context_switches`]' walk over live threads, it never goes back): `getrusage(RUSAGE_SELF)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelfUsage {
    /// User plus system CPU time.
    pub cpu_s: f64,
    /// Voluntary plus involuntary context switches.
    pub context_switches: u64,
}

/// This process's [`SelfUsage`].
pub fn self_usage() -> std::io::Result<SelfUsage> {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF).map_err(std::io::Error::from)?;
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    let switches = u.voluntary_context_switches() + u.involuntary_context_switches();
    Ok(SelfUsage {
        cpu_s: secs(u.user_time()) + secs(u.system_time()),
        context_switches: u64::try_from(switches).unwrap_or(0),
    })
}

/// This process's resident set size: `/proc/self/statm`'s second field in pages.
pub fn resident_bytes() -> std::io::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed statm");
    let pages: u64 = statm.split_whitespace().nth(1).ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let page = match nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE) {
        Ok(Some(p)) if p > 0 => p as u64,
        _ => 4096,
    };
    Ok(pages * page)
}

/// Context switches (voluntary + involuntary) of every live thread of process `pid`, from
/// `/proc/<pid>/task/*/status`: each is a thread that stopped running, to wait for
/// something (a wake-up to come) or because it was preempted. The outside check of a
/// transport's wake-up count.
pub fn context_switches(pid: u32) -> std::io::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(status) = std::fs::read_to_string(task?.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        total += parse_context_switches(&status);
    }
    Ok(total)
}

/// The two `*ctxt_switches:` lines of a `/proc/.../status` text, summed.
fn parse_context_switches(status: &str) -> u64 {
    status
        .lines()
        .filter(|l| {
            l.starts_with("voluntary_ctxt_switches:")
                || l.starts_with("nonvoluntary_ctxt_switches:")
        })
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn clock_ticks_per_s() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// Machine-wide CPU time by kind (all CPUs summed), from the first line of `/proc/stat`.
/// Softirq time cannot be charged to a process, so reports give the machine's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemCpu {
    /// User (with nice).
    pub user_s: f64,
    /// System.
    pub sys_s: f64,
    /// Softirq (network receive processing among it).
    pub softirq_s: f64,
    /// Hard irq.
    pub irq_s: f64,
    /// Idle (with iowait).
    pub idle_s: f64,
}

impl SystemCpu {
    /// Reads `/proc/stat`.
    pub fn read() -> std::io::Result<SystemCpu> {
        Self::parse(&std::fs::read_to_string("/proc/stat")?)
    }

    /// Parses `/proc/stat` text.
    pub fn parse(text: &str) -> std::io::Result<SystemCpu> {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed /proc/stat");
        let line = text.lines().find(|l| l.starts_with("cpu ")).ok_or_else(bad)?;
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse::<u64>().map(|t| t as f64 / clock_ticks_per_s()))
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        // user nice system idle iowait irq softirq ...
        Ok(SystemCpu {
            user_s: at(0) + at(1),
            sys_s: at(2),
            idle_s: at(3) + at(4),
            irq_s: at(5),
            softirq_s: at(6),
        })
    }

    /// `self − earlier`.
    pub fn since(&self, e: &SystemCpu) -> SystemCpu {
        SystemCpu {
            user_s: (self.user_s - e.user_s).max(0.0),
            sys_s: (self.sys_s - e.sys_s).max(0.0),
            softirq_s: (self.softirq_s - e.softirq_s).max(0.0),
            irq_s: (self.irq_s - e.irq_s).max(0.0),
            idle_s: (self.idle_s - e.idle_s).max(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The death signal is the spawner's, set before exec: `sleep` sets none of its own, yet
    /// ends with SIGTERM when the thread that started it ends (as a dead launcher's children).
    #[test]
    fn a_child_started_to_die_with_this_process_gets_sigterm_when_its_spawner_ends() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::thread::spawn(|| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("30");
            die_with_this_process(&mut cmd);
            cmd.spawn().expect("coreutils' sleep runs")
        })
        .join()
        .unwrap();
        // Without the death signal this would wait out the 30 s sleep and exit 0.
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(15), "{status}");
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // the sleeps are what is counted
    fn self_usage_counts_work_and_waits_of_ended_threads() {
        let before = self_usage().unwrap();
        std::thread::spawn(|| {
            for _ in 0..20 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
        .join()
        .unwrap();
        // Burn CPU until the reading advances (a reader stuck at its first value fails here
        // rather than passing); bounded by work, seconds of it, not by a clock.
        let after = burn_until(|| self_usage().unwrap(), |after| after.cpu_s > before.cpu_s);
        // Each sleep of the ended thread was a voluntary switch, still counted.
        assert!(after.context_switches >= before.context_switches + 20, "{before:?} {after:?}");
        assert!(after.cpu_s > before.cpu_s, "{before:?} {after:?}");
        assert!(resident_bytes().unwrap() > 1 << 20);
    }

    #[test]
    fn parses_stat_with_a_hostile_command_name() {
        let line = "42 (a) b (c)) S 1 42 42 0 -1 4194304 100 0 0 0 250 75 0 0 20 0 1 0 5 0 0";
        let t = CpuTimes::parse(line).unwrap();
        let hz = clock_ticks_per_s();
        assert!((t.user_s - 250.0 / hz).abs() < 1e-9 && (t.sys_s - 75.0 / hz).abs() < 1e-9);
        assert!(CpuTimes::parse("42 (x) S 1").is_err());
        assert!(CpuTimes::parse("no parens").is_err());
    }

    #[test]
    fn counts_both_kinds_of_context_switch() {
        let status = "Name:\tx\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n";
        assert_eq!(parse_context_switches(status), 15);
        assert_eq!(parse_context_switches("garbage"), 0);
        assert!(context_switches(std::process::id()).is_ok());
    }

    #[test]
    fn parses_proc_stat() {
        let s = SystemCpu::parse("cpu  10 5 20 100 3 1 7 0 0 0\ncpu0 1 1 1 1 1 1 1\n").unwrap();
        let hz = clock_ticks_per_s();
        assert!((s.user_s - 15.0 / hz).abs() < 1e-9);
        assert!((s.softirq_s - 7.0 / hz).abs() < 1e-9);
        assert!((s.idle_s - 103.0 / hz).abs() < 1e-9);
        assert!(SystemCpu::parse("intr 1 2 3").is_err());
        assert!(SystemCpu::parse("cpu  1 x 3").is_err());
    }

    /// Reads `read` between rounds of busy work until `advanced` holds, or gives up after
    /// about 10^10 operations (seconds of CPU), returning the last reading.
    fn burn_until<T>(read: impl Fn() -> T, advanced: impl Fn(&T) -> bool) -> T {
        let mut x = 0u64;
        for _ in 0..100_000 {
            let r = read();
            if advanced(&r) {
                return r;
            }
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
        }
        read()
    }

    #[test]
    fn reads_this_process() {
        let a = CpuTimes::of_self().unwrap();
        // It counts clock ticks: burn CPU until it advances.
        let b = burn_until(
            || CpuTimes::of_self().unwrap(),
            |b| b.user_s + b.sys_s > a.user_s + a.sys_s,
        );
        assert!(b.user_s + b.sys_s > a.user_s + a.sys_s, "{a:?} {b:?}");
        SystemCpu::read().unwrap();
    }
}

/// Exit statuses every bex binary uses: 2 for bad usage or configuration, 1 for a failure
/// at run time; the message goes to stderr as `tool: message`.
pub mod exit {
    /// Prints `tool: message` and exits with status 2 (bad usage or configuration).
    pub fn usage(tool: &str, message: impl std::fmt::Display) -> ! {
        eprintln!("{tool}: {message}");
        std::process::exit(2)
    }

    /// Prints `tool: message` and exits with status 1 (a failure at run time).
    pub fn failure(tool: &str, message: impl std::fmt::Display) -> ! {
        with(tool, 1, message)
    }

    /// A binary's multi-threaded tokio runtime with `threads` workers; exits 1 when it
    /// cannot start.
    pub fn runtime(tool: &str, threads: usize) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap_or_else(|e| failure(tool, format!("tokio runtime: {e}")))
    }

    /// Prints `tool: message` and exits with `status`.
    pub fn with(tool: &str, status: u8, message: impl std::fmt::Display) -> ! {
        eprintln!("{tool}: {message}");
        std::process::exit(status.into())
    }

    /// Creates (or empties) the report file `path` before a run, exiting 2 naming it when it
    /// cannot be written: found at the end, a missing directory cost the whole run.
    pub fn writable_output(tool: &str, path: &std::path::Path) {
        if let Err(e) = std::fs::File::create(path) {
            usage(tool, format!("{}: {e}", path.display()));
        }
    }
}
