//! Talking to the servers: a small blocking HTTP GET (optionally from inside a network
//! namespace), the `bex_rnic_*` counters of `/metrics`, and signals to the launcher.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

/// GET `path` from `addr`: (status, body). With `netns`, the request is made from a thread
/// that has entered that namespace (the launcher itself stays in the root namespace, which
/// has no route to the hosts).
pub fn http_get(
    addr: SocketAddr,
    path: &str,
    netns: Option<&str>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let Some(ns) = netns else {
        return get_here(addr, path, timeout);
    };
    let (ns, path) = (ns.to_string(), path.to_string());
    std::thread::spawn(move || {
        let f = std::fs::File::open(format!("/var/run/netns/{ns}"))?;
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| std::io::Error::other(format!("setns {ns}: {e}")))?;
        get_here(addr, &path, timeout)
    })
    .join()
    .map_err(|_| std::io::Error::other("probe thread panicked"))?
}

fn get_here(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut out = Vec::new();
    // Bounded: a metrics page is a few KiB.
    s.take(16 << 20).read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((code, body))
}

/// The `bex_rnic_<name>_total` counters of a Prometheus text page, by `<name>`.
pub fn rnic_counters(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (metric, value) = l.split_once(char::is_whitespace)?;
            let name = metric.strip_prefix("bex_rnic_")?.strip_suffix("_total")?;
            Some((name.to_string(), value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}

/// `after − before` per counter (saturating: a restarted server does not go negative).
pub fn counter_delta(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v.saturating_sub(before.get(k).copied().unwrap_or(0))))
        .collect()
}

/// The signal (SIGINT/SIGTERM) the launcher received, 0 if none.
#[derive(Clone, Debug, Default)]
pub struct Stop(Arc<AtomicI32>);

impl Stop {
    /// Listens for SIGINT and SIGTERM on a dedicated thread (tokio's handler records them;
    /// the launcher polls [`Stop::signal`] between steps). Not a blocked signal mask with
    /// `sigwait`: children would inherit the mask and ignore our SIGTERM.
    pub fn install() -> std::io::Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
        // Registered here, before returning, so no signal is missed after `install`.
        let (mut int, mut term) = rt.block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
            ))
        })?;
        let stop = Stop::default();
        let flag = stop.0.clone();
        std::thread::Builder::new().name("signals".into()).spawn(move || {
            rt.block_on(async move {
                loop {
                    let sig = tokio::select! {
                        _ = int.recv() => Signal::SIGINT,
                        _ = term.recv() => Signal::SIGTERM,
                    };
                    flag.store(sig as i32, Ordering::SeqCst);
                }
            })
        })?;
        Ok(stop)
    }

    /// The signal received, if any.
    pub fn signal(&self) -> Option<Signal> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            n => Signal::try_from(n).ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnic_counters_parse_and_subtract() {
        let a = rnic_counters(
            "# HELP bex_rnic_rnr_naks_received_total x\n# TYPE bex_rnic_rnr_naks_received_total counter\nbex_rnic_rnr_naks_received_total 3\nbex_rnic_tx_packets_total 100\nbex_rpc_calls_total 9\n",
        );
        assert_eq!(a.len(), 2);
        assert_eq!(a["rnr_naks_received"], 3);
        let b = rnic_counters("bex_rnic_rnr_naks_received_total 5\nbex_rnic_tx_packets_total 90\n");
        let d = counter_delta(&a, &b);
        assert_eq!(d["rnr_naks_received"], 2);
        assert_eq!(d["tx_packets"], 0);
    }
}

/// TCP's segment counters (`Tcp: OutSegs RetransSegs` of `/proc/net/snmp`), the kernel's
/// loss indicator for the TCP baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpSegments {
    /// Segments sent.
    pub out_segs: u64,
    /// Segments retransmitted.
    pub retrans_segs: u64,
}

/// Parses `/proc/net/snmp`: the `Tcp:` header line names the columns of the next `Tcp:` line.
pub fn parse_tcp_snmp(text: &str) -> Option<TcpSegments> {
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let names: Vec<&str> = tcp.next()?.split_whitespace().collect();
    let values: Vec<&str> = tcp.next()?.split_whitespace().collect();
    let get = |name: &str| -> Option<u64> {
        let i = names.iter().position(|n| *n == name)?;
        values.get(i)?.parse().ok()
    };
    Some(TcpSegments { out_segs: get("OutSegs")?, retrans_segs: get("RetransSegs")? })
}

/// The TCP counters of network namespace `netns` (`ip netns exec`), or of this process's
/// namespace for `None`; `None` if they cannot be read.
pub fn tcp_segments(netns: Option<&str>) -> Option<TcpSegments> {
    let text = match netns {
        None => std::fs::read_to_string("/proc/net/snmp").ok()?,
        Some(ns) => {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", ns, "cat", "/proc/net/snmp"])
                .stderr(std::process::Stdio::null())
                .output()
                .ok()?;
            if !out.status.success() {
                return None;
            }
            String::from_utf8(out.stdout).ok()?
        }
    };
    parse_tcp_snmp(&text)
}

#[cfg(test)]
mod tcp_tests {
    use super::*;

    #[test]
    fn reads_tcp_segment_counters() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs InErrs\n\
                    Tcp: 1 200 5000 42 0\nUdp: InDatagrams\nUdp: 7\n";
        assert_eq!(parse_tcp_snmp(snmp), Some(TcpSegments { out_segs: 5000, retrans_segs: 42 }));
        assert_eq!(parse_tcp_snmp("Tcp: OutSegs\n"), None);
        assert_eq!(parse_tcp_snmp("Tcp: OutSegs RetransSegs\nTcp: 1 x\n"), None);
        assert!(tcp_segments(None).is_some());
    }
}
