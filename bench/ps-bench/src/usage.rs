//! What a cell cost: CPU and context switches of client and server (from `/proc`), and the
//! client transport's own counts (wake-ups, doorbells, messages), per completed request.

use bex_bench::report::finite;
use bex_process::{context_switches, CpuTimes};
use bex_transport::CounterSnapshot;
use serde::Serialize;

/// Costs of a cell, from its start to its end (warm-up included).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CellUsage {
    /// Requests completed in the cell (warm-up included): the denominator.
    pub requests: u64,
    /// Client CPU, user + system.
    pub client_cpu_s: f64,
    /// Server CPU, user + system (zero when its pid is unknown).
    pub server_cpu_s: f64,
    /// Client context switches, voluntary + involuntary.
    pub client_context_switches: u64,
    /// Server context switches.
    pub server_context_switches: u64,
    /// The client transport's I/O-thread wake-ups.
    pub client_wakeups: u64,
    /// Of those, timer wake-ups.
    pub client_timer_wakeups: u64,
    /// The client transport's doorbells.
    pub client_doorbells: u64,
    /// Messages the client transport received.
    pub client_messages: u64,
}

impl CellUsage {
    /// Client and server CPU per completed request, µs.
    pub fn cpu_us_per_request(&self) -> f64 {
        (self.client_cpu_s + self.server_cpu_s) * 1e6 / self.requests.max(1) as f64
    }

    /// The report's view: totals and per-request figures.
    pub fn report(&self) -> UsageReport {
        let per = |x: f64| finite(x / self.requests.max(1) as f64);
        UsageReport {
            requests: self.requests,
            client_cpu_s: finite(self.client_cpu_s),
            server_cpu_s: finite(self.server_cpu_s),
            cpu_us_per_request: finite(self.cpu_us_per_request()),
            client_context_switches: self.client_context_switches,
            server_context_switches: self.server_context_switches,
            context_switches_per_request: per((self.client_context_switches
                + self.server_context_switches)
                as f64),
            client_wakeups_per_request: per(self.client_wakeups as f64),
            client_timer_wakeups_per_request: per(self.client_timer_wakeups as f64),
            client_doorbells_per_request: per(self.client_doorbells as f64),
            client_messages_received: self.client_messages,
        }
    }
}

/// A cell's costs as the JSON report has them: totals over the cell (warm-up included) and
/// per completed request; CPU is user + system, context switches of every thread.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UsageReport {
    /// Requests completed in the cell, warm-up included.
    pub requests: u64,
    pub client_cpu_s: Option<f64>,
    pub server_cpu_s: Option<f64>,
    pub cpu_us_per_request: Option<f64>,
    pub client_context_switches: u64,
    pub server_context_switches: u64,
    pub context_switches_per_request: Option<f64>,
    pub client_wakeups_per_request: Option<f64>,
    pub client_timer_wakeups_per_request: Option<f64>,
    pub client_doorbells_per_request: Option<f64>,
    pub client_messages_received: u64,
}

/// A snapshot of what [`CellUsage`] subtracts.
#[derive(Clone, Debug)]
pub struct UsageMark {
    client_cpu: CpuTimes,
    server_cpu: CpuTimes,
    client_csw: u64,
    server_csw: u64,
    transport: CounterSnapshot,
}

impl UsageMark {
    /// Now, for this process, server `server_pid` (0: none) and the client `transport`.
    pub fn take(server_pid: u32, transport: CounterSnapshot) -> UsageMark {
        UsageMark {
            client_cpu: CpuTimes::of_self().unwrap_or_default(),
            server_cpu: CpuTimes::of_pid(server_pid).unwrap_or_default(),
            client_csw: context_switches(std::process::id()).unwrap_or(0),
            server_csw: context_switches(server_pid).unwrap_or(0),
            transport,
        }
    }

    /// The costs from `earlier` to this mark, over `requests` completed requests.
    pub fn since(&self, earlier: &UsageMark, requests: u64) -> CellUsage {
        let cpu = |a: &CpuTimes, b: &CpuTimes| {
            let d = a.since(b);
            d.user_s + d.sys_s
        };
        let (now, then) = (&self.transport, &earlier.transport);
        CellUsage {
            requests,
            client_cpu_s: cpu(&self.client_cpu, &earlier.client_cpu),
            server_cpu_s: cpu(&self.server_cpu, &earlier.server_cpu),
            client_context_switches: self.client_csw.saturating_sub(earlier.client_csw),
            server_context_switches: self.server_csw.saturating_sub(earlier.server_csw),
            client_wakeups: now.wakeups.saturating_sub(then.wakeups),
            client_timer_wakeups: now.timer_wakeups.saturating_sub(then.timer_wakeups),
            client_doorbells: now.doorbells.saturating_sub(then.doorbells),
            client_messages: now.messages_received.saturating_sub(then.messages_received),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_request_figures_divide_by_completed_requests() {
        let u = CellUsage {
            requests: 4,
            client_cpu_s: 0.001,
            server_cpu_s: 0.003,
            client_context_switches: 6,
            server_context_switches: 2,
            client_wakeups: 8,
            client_timer_wakeups: 1,
            client_doorbells: 12,
            client_messages: 4,
        };
        let r = u.report();
        assert_eq!(r.cpu_us_per_request, Some(1000.0));
        assert_eq!(r.context_switches_per_request, Some(2.0));
        assert_eq!(r.client_doorbells_per_request, Some(3.0));
        let none = CellUsage::default().report();
        assert_eq!((none.requests, none.cpu_us_per_request), (0, Some(0.0)));
    }
}
