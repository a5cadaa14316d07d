//! Who a process is when an orchestrator starts it: a flag, else an environment variable,
//! and either may say `ordinal` — the number at the end of the host name, as a Kubernetes
//! StatefulSet names its pods (`bex-ps-p0-3` is ordinal 3), so one pod template serves
//! every shard.

/// The value of `flag` if given, else of the environment variable `env`, as a number or
/// `ordinal`; `None` if neither is set. Errors name where the value came from.
pub fn number(flag: Option<&str>, env: &str) -> Result<Option<u64>, String> {
    let (from, value) = match flag {
        Some(v) => ("the flag".to_string(), v.to_string()),
        None => match std::env::var(env) {
            Ok(v) if !v.is_empty() => (env.to_string(), v),
            _ => return Ok(None),
        },
    };
    parse(&value, &hostname()).map(Some).map_err(|e| format!("{from}: {e}"))
}

/// `value` as a number, or `ordinal` of `host`.
pub fn parse(value: &str, host: &str) -> Result<u64, String> {
    if value == "ordinal" {
        return ordinal_of(host).ok_or_else(|| {
            format!("\"ordinal\": host name {host:?} does not end in -N (a StatefulSet pod's does)")
        });
    }
    value.parse().map_err(|_| format!("{value:?} is neither a number nor \"ordinal\""))
}

/// `value` as a number or `ordinal` of this host (a command-line parser).
pub fn parse_here(value: &str) -> Result<u64, String> {
    parse(value, &hostname())
}

/// [`parse_here`] for 32-bit fields (mini-pod, shard).
pub fn parse_here_u32(value: &str) -> Result<u32, String> {
    let n = parse_here(value)?;
    u32::try_from(n).map_err(|_| format!("{n} is too large"))
}

/// An address to bind: an IP, or `hostname` — the first address other than loopback that
/// this host's name resolves to (in a container or a Kubernetes pod, its own IP, from
/// `/etc/hosts`).
pub fn parse_ip(value: &str) -> Result<std::net::IpAddr, String> {
    use std::net::ToSocketAddrs;
    if value != "hostname" {
        return value
            .parse()
            .map_err(|_| format!("{value:?} is neither an IP address nor \"hostname\""));
    }
    let host = hostname();
    let addrs = (host.as_str(), 0).to_socket_addrs().map_err(|e| format!("{host:?}: {e}"))?;
    addrs.map(|a| a.ip()).find(|ip| !ip.is_loopback()).ok_or_else(|| {
        format!("this host's name {host:?} resolves to no address other than loopback")
    })
}

/// The number after the last `-` of the first label of `host`.
pub fn ordinal_of(host: &str) -> Option<u64> {
    let first = host.split('.').next()?;
    let (_, n) = first.rsplit_once('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// A client id when none is given: this process id (at most 2²² on Linux) above a 32-bit
/// hash of the host name. The pid alone is not enough: every container starts its program
/// with the same small pid, so rankers of one Deployment would share an id, and with it
/// their replica choices.
pub fn default_client_id() -> u64 {
    client_id_of(&hostname(), std::process::id())
}

fn client_id_of(host: &str, pid: u32) -> u64 {
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let hash =
        host.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    (u64::from(hash) << 22) | u64::from(pid & 0x3f_ffff)
}

/// This host's name (`HOSTNAME`, else the kernel's).
pub fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_ordinals() {
        assert_eq!(parse("7", "x"), Ok(7));
        assert_eq!(parse("ordinal", "bex-ps-p1-12"), Ok(12));
        assert_eq!(parse("ordinal", "bex-ps-p1-3.bex-ps-p1.default.svc"), Ok(3));
        assert!(parse("ordinal", "bex-ps").is_err());
        assert!(parse("ordinal", "web-").is_err());
        assert!(parse("ordinal", "web-1a").is_err());
        assert!(parse("-1", "x").is_err());
        assert!(parse("seven", "x").unwrap_err().contains("neither"));
        assert_eq!(number(Some("4"), "BEX_TEST_IDENTITY_UNSET"), Ok(Some(4)));
        assert_eq!(number(None, "BEX_TEST_IDENTITY_UNSET"), Ok(None));
        assert!(number(Some("x"), "BEX_TEST_IDENTITY_UNSET").unwrap_err().starts_with("the flag"));
        assert_eq!(parse_ip("10.1.2.3"), Ok("10.1.2.3".parse().unwrap()));
        assert!(parse_ip("10.1.2").is_err());
    }

    #[test]
    fn default_client_ids_differ_across_hosts_for_the_same_pid() {
        assert_ne!(
            client_id_of("bex-ranker-7d9f-abcde", 7),
            client_id_of("bex-ranker-7d9f-fghij", 7)
        );
        assert_ne!(client_id_of("h", 7), client_id_of("h", 8));
        assert_eq!(client_id_of("h", 7) & 0x3f_ffff, 7, "the pid is readable in the low bits");
    }
}
