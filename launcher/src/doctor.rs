//! `bex-cluster doctor`: checks a host for the NIC its cluster file configures before anything
//! starts — the things RDMA users most often get wrong (the wrong GID on RoCE, the wrong NIC on
//! a multi-NIC host, a memlock limit that fails registration) — and says how to fix each.
//!
//! Every check reads files (sysfs, procfs) under roots the caller passes ([`Host`]), so the
//! hardware checks are tested on fake sysfs trees; the rest (memlock, the secret, addresses,
//! ports, peers) asks the running system. Nothing here changes the host.

use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bex_ps_proto::config::NicKind;
use bex_ps_proto::Config;
use serde::Serialize;

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// As it should be.
    Ok,
    /// Worth knowing; nothing to do.
    Info,
    /// Works, but not well (or not everywhere).
    Warn,
    /// The cluster will not work on this host as configured.
    Error,
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What was checked (`nic.device`, `memlock`, …).
    pub check: String,
    /// How bad.
    pub level: Level,
    /// What was found.
    pub detail: String,
    /// How to fix it (errors and warnings).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    fn new(check: &str, level: Level, detail: impl Into<String>) -> Finding {
        Finding { check: check.into(), level, detail: detail.into(), fix: None }
    }

    fn fix(mut self, fix: impl Into<String>) -> Finding {
        self.fix = Some(fix.into());
        self
    }
}

/// Where the system's files are (`/sys`, `/proc`; a fake tree in tests).
#[derive(Clone, Debug)]
pub struct Host {
    /// sysfs.
    pub sys: PathBuf,
    /// procfs.
    pub proc: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Host { sys: "/sys".into(), proc: "/proc".into() }
    }
}

/// What to check.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    /// The cluster file.
    pub cfg: &'a Config,
    /// The address this host's processes bind (the RDMA NIC's IP, the GID to find).
    pub ip: IpAddr,
    /// `BEX_SECRET` as the processes would see it.
    pub secret: Option<String>,
    /// Also connect to every server's RDMA and TCP ports (a host joining a running cluster).
    pub peers: bool,
}

/// Runs every check.
pub fn examine(input: &Input<'_>, host: &Host) -> Vec<Finding> {
    let mut out = Vec::new();
    let t = &input.cfg.transport;
    match t.nic {
        NicKind::Soft => soft(input, host, &mut out),
        NicKind::Verbs => verbs(input, host, &mut out),
    }
    memlock(input, &mut out);
    hugepages(host, &mut out);
    secret(input, &mut out);
    if input.peers {
        peers(input, &mut out);
    }
    out
}

/// The worst level among `findings` (`Ok` for none).
pub fn worst(findings: &[Finding]) -> Level {
    findings.iter().map(|f| f.level).max().unwrap_or(Level::Ok)
}

/// The findings as text, one per line, fixes indented below.
pub fn render(findings: &[Finding]) -> String {
    let mut s = String::new();
    for f in findings {
        let tag = match f.level {
            Level::Ok => "ok   ",
            Level::Info => "info ",
            Level::Warn => "WARN ",
            Level::Error => "ERROR",
        };
        s.push_str(&format!("{tag} {}: {}\n", f.check, f.detail));
        if let Some(fix) = &f.fix {
            s.push_str(&format!("      fix: {fix}\n"));
        }
    }
    s
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Bytes a RoCEv2 packet adds to its path MTU on the link: Ethernet payload holds IP + UDP +
/// BTH + RETH + ICRC (+ pad).
fn overhead(ip: IpAddr) -> u32 {
    let ip_header = if ip.is_ipv4() { 20 } else { 40 };
    ip_header + 8 + 12 + 16 + 4 + 3
}

/// The software RNIC: the address must be this host's, the link must carry its packets whole.
fn soft(input: &Input<'_>, host: &Host, out: &mut Vec<Finding>) {
    let ip = input.ip;
    out.push(Finding::new(
        "nic",
        Level::Info,
        "software RNIC (RoCEv2 over UDP): no device, driver or memory pinning needed; PFC and \
         ECN do not apply (its losses are recovered by go-back-N)",
    ));
    match UdpSocket::bind(SocketAddr::new(ip, 0)) {
        Ok(_) => out.push(Finding::new("nic.address", Level::Ok, format!("{ip} is this host's"))),
        Err(e) => {
            out.push(
                Finding::new("nic.address", Level::Error, format!("cannot bind {ip}: {e}")).fix(
                    "bind an address of this host ([cluster] host or the servers' addresses, \
                     or --bind of the clients)",
                ),
            );
            return;
        }
    }
    let port = input.cfg.transport.udp_port;
    if port != 0 {
        match UdpSocket::bind(SocketAddr::new(ip, port)) {
            Ok(_) => out.push(Finding::new(
                "nic.udp_port",
                Level::Ok,
                format!("UDP {port} is free on {ip} (the first process takes it)"),
            )),
            Err(_) => out.push(Finding::new(
                "nic.udp_port",
                Level::Info,
                format!(
                    "UDP {port} is in use on {ip}: the software RNIC will take a free port, which \
                     bex peers learn at bootstrap (a hardware RoCE peer could not reach it)"
                ),
            )),
        }
    }
    let mtu = interface_of(ip).and_then(|ifname| {
        let mtu =
            read(&host.sys.join("class/net").join(&ifname).join("mtu"))?.parse::<u32>().ok()?;
        Some((ifname, mtu))
    });
    let path_mtu = input.cfg.transport.path_mtu;
    match mtu {
        Some((ifname, mtu)) if mtu < path_mtu + overhead(ip) => out.push(
            Finding::new(
                "nic.mtu",
                Level::Error,
                format!(
                    "{ifname} has MTU {mtu}: packets of path MTU {path_mtu} ({} B on the link) \
                     do not fit, and are never fragmented",
                    path_mtu + overhead(ip)
                ),
            )
            .fix(format!(
                "raise the link's MTU (`ip link set {ifname} mtu {}`) or lower \
                 [transport] path_mtu",
                path_mtu + overhead(ip)
            )),
        ),
        Some((ifname, mtu)) => out.push(Finding::new(
            "nic.mtu",
            Level::Ok,
            format!("{ifname} MTU {mtu} carries path MTU {path_mtu}"),
        )),
        None => out.push(Finding::new(
            "nic.mtu",
            Level::Info,
            format!("could not tell which interface holds {ip}: its MTU is not checked"),
        )),
    }
}

/// The interface that holds `ip`.
fn interface_of(ip: IpAddr) -> Option<String> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    for a in addrs {
        let Some(sa) = a.address else { continue };
        let found = match ip {
            IpAddr::V4(v4) => sa.as_sockaddr_in().is_some_and(|s| s.ip() == v4),
            IpAddr::V6(v6) => sa.as_sockaddr_in6().is_some_and(|s| s.ip() == v6),
        };
        if found {
            return Some(a.interface_name);
        }
    }
    None
}

/// The GID a RoCE device holds for `ip`, as sysfs prints it.
fn gid_text(ip: IpAddr) -> String {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let s = v6.segments();
    s.iter().map(|x| format!("{x:04x}")).collect::<Vec<_>>().join(":")
}

/// A hardware RNIC, from sysfs: the device, its port, the GID for the configured IP, the
/// link's MTU, ECN.
fn verbs(input: &Input<'_>, host: &Host, out: &mut Vec<Finding>) {
    let t = &input.cfg.transport;
    let ib = host.sys.join("class/infiniband");
    let mut devices: Vec<String> = std::fs::read_dir(&ib)
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    devices.sort();
    let Some(dev) = (match t.device.as_str() {
        "" => devices.first().cloned(),
        d => devices.iter().find(|x| *x == d).cloned(),
    }) else {
        let detail = if devices.is_empty() {
            format!("no RDMA device ({} is empty or missing)", ib.display())
        } else {
            format!("no device {:?}; this host has {}", t.device, devices.join(", "))
        };
        out.push(Finding::new("nic.device", Level::Error, detail).fix(
            "load the NIC's RDMA driver (e.g. `modprobe mlx5_ib`) and install rdma-core \
             (`ibv_devices` lists devices), set [transport] device to one listed, or use \
             nic = \"soft\"",
        ));
        return;
    };
    let others = devices.len() - 1;
    out.push(Finding::new(
        "nic.device",
        Level::Ok,
        format!(
            "{dev}{}",
            if others > 0 {
                format!(" (and {others} other device(s): set it explicitly)")
            } else {
                String::new()
            }
        ),
    ));
    let port = ib.join(&dev).join("ports").join(t.port.to_string());
    let Some(state) = read(&port.join("state")) else {
        out.push(
            Finding::new("nic.port", Level::Error, format!("{dev} has no port {}", t.port))
                .fix("set [transport] port to one of the device's ports (from 1)"),
        );
        return;
    };
    if state.contains("ACTIVE") {
        out.push(Finding::new("nic.port", Level::Ok, format!("{dev} port {}: {state}", t.port)));
    } else {
        let phys = read(&port.join("phys_state")).unwrap_or_default();
        out.push(
            Finding::new(
                "nic.port",
                Level::Error,
                format!("{dev} port {}: {state} (physical: {phys})", t.port),
            )
            .fix("check the cable and the switch port; on InfiniBand a subnet manager must run"),
        );
    }
    let link = read(&port.join("link_layer")).unwrap_or_default();
    out.push(Finding::new("nic.link_layer", Level::Info, format!("{dev} port {}: {link}", t.port)));
    if link != "Ethernet" {
        return; // InfiniBand: GID 0, no IP routing, no ECN files.
    }
    // RoCE: the GID whose type is RoCE v2 and whose address is the configured IP.
    let want = gid_text(input.ip);
    let gid_at = |i: u32| {
        let gid = read(&port.join("gids").join(i.to_string()))?;
        let kind = read(&port.join("gid_attrs/types").join(i.to_string())).unwrap_or_default();
        let ndev = read(&port.join("gid_attrs/ndevs").join(i.to_string())).unwrap_or_default();
        Some((gid, kind, ndev))
    };
    let mut matching = None;
    let mut v2 = Vec::new();
    for i in 0..256u32 {
        let Some((gid, kind, ndev)) = gid_at(i) else { break };
        if kind == "RoCE v2" {
            v2.push(format!("{i}: {gid} ({ndev})"));
            if gid == want && matching.is_none() {
                matching = Some((i, ndev));
            }
        }
    }
    let Some((index, ndev)) = matching else {
        out.push(
            Finding::new(
                "nic.gid",
                Level::Error,
                format!(
                    "{dev} port {} has no RoCE v2 GID for {} (RoCE v2 GIDs: {})",
                    t.port,
                    input.ip,
                    if v2.is_empty() { "none".to_string() } else { v2.join("; ") }
                ),
            )
            .fix(format!(
                "bind an IP of {dev}'s network interface (`rdma link` shows it; each of its \
                 addresses has a RoCE v2 GID), or choose the device that carries {}",
                input.ip
            )),
        );
        return;
    };
    match u8::try_from(t.gid_index).ok() {
        Some(g) if u32::from(g) != index => out.push(
            Finding::new(
                "nic.gid",
                Level::Error,
                format!(
                    "[transport] gid_index {g} is not {}'s RoCE v2 GID; index {index} is",
                    input.ip
                ),
            )
            .fix(format!("set gid_index = {index}, or -1 to pick it automatically")),
        ),
        _ => out.push(Finding::new(
            "nic.gid",
            Level::Ok,
            format!("GID index {index} is RoCE v2 for {} on {ndev}", input.ip),
        )),
    }
    let net = host.sys.join("class/net").join(&ndev);
    if let Some(mtu) = read(&net.join("mtu")).and_then(|m| m.parse::<u32>().ok()) {
        // RoCE's active MTU is the largest IB MTU the Ethernet MTU carries with the headers.
        let roce = [4096u32, 2048, 1024, 512, 256]
            .into_iter()
            .find(|m| m + overhead(input.ip) <= mtu)
            .unwrap_or(0);
        let want = t.path_mtu;
        if want > roce {
            out.push(
                Finding::new(
                    "nic.mtu",
                    Level::Warn,
                    format!("{ndev} MTU {mtu} gives RoCE MTU {roce}; path_mtu {want} is lowered"),
                )
                .fix(format!(
                    "raise {ndev}'s MTU to {} (and the switches'), or set path_mtu = {roce}",
                    want + overhead(input.ip)
                )),
            );
        } else {
            out.push(Finding::new(
                "nic.mtu",
                Level::Ok,
                format!("{ndev} MTU {mtu} carries path_mtu {want}"),
            ));
        }
    }
    ecn(&net, &ndev, out);
}

/// ECN (DCQCN) settings where the driver exposes them (mlx5: `ecn/roce_{np,rp}/enable/<prio>`).
fn ecn(net: &Path, ndev: &str, out: &mut Vec<Finding>) {
    let enabled = |role: &str| -> Option<Vec<String>> {
        let dir = net.join("ecn").join(role).join("enable");
        let mut prios: Vec<String> = std::fs::read_dir(&dir)
            .ok()?
            .filter_map(|e| {
                let e = e.ok()?;
                (read(&e.path())? == "1").then(|| e.file_name().to_string_lossy().into_owned())
            })
            .collect();
        prios.sort();
        Some(prios)
    };
    match (enabled("roce_np"), enabled("roce_rp")) {
        (Some(np), Some(rp)) if !np.is_empty() && !rp.is_empty() => out.push(Finding::new(
            "nic.ecn",
            Level::Ok,
            format!(
                "{ndev}: ECN (DCQCN) on for priorities {} (notification) / {} (reaction)",
                np.join(","),
                rp.join(",")
            ),
        )),
        (Some(_), Some(_)) => out.push(
            Finding::new("nic.ecn", Level::Warn, format!("{ndev}: ECN (DCQCN) is off")).fix(
                format!(
                    "enable it for the RoCE priority: echo 1 > /sys/class/net/{ndev}/ecn/\
                     roce_np/enable/3 (and roce_rp); PFC is set with mlnx_qos or dcb"
                ),
            ),
        ),
        _ => out.push(Finding::new(
            "nic.ecn",
            Level::Info,
            format!(
                "{ndev}: ECN and PFC are not readable here (mlx5 exposes /sys/class/net/\
                 {ndev}/ecn; check PFC with mlnx_qos or `dcb pfc show`)"
            ),
        )),
    }
}

/// Effective uid 0, from `/proc/self/status` (`Uid: real effective saved fs`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|u| u.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Memory the NIC registers is pinned, which counts against RLIMIT_MEMLOCK without
/// CAP_IPC_LOCK: receive rings, messages in flight and standing grants of every connection.
const MEMLOCK_MIN: u64 = 64 << 20;
const MEMLOCK_GOOD: u64 = 1 << 30;

fn memlock(input: &Input<'_>, out: &mut Vec<Finding>) {
    use nix::sys::resource::{getrlimit, Resource};
    let hardware = input.cfg.transport.nic == NicKind::Verbs;
    let root = is_root();
    let soft = match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) => soft,
        Err(e) => {
            out.push(Finding::new("memlock", Level::Warn, format!("getrlimit: {e}")));
            return;
        }
    };
    let unlimited = soft == nix::sys::resource::RLIM_INFINITY;
    let shown = if unlimited { "unlimited".to_string() } else { format!("{} MiB", soft >> 20) };
    let finding = if !hardware {
        Finding::new(
            "memlock",
            Level::Info,
            format!("{shown}; the software RNIC pins nothing (hardware would need ≥ 1 GiB)"),
        )
    } else if root || unlimited || soft >= MEMLOCK_GOOD {
        Finding::new(
            "memlock",
            Level::Ok,
            if root {
                format!("{shown}, and root (CAP_IPC_LOCK): registration is not limited")
            } else {
                shown
            },
        )
    } else {
        let level = if soft < MEMLOCK_MIN { Level::Error } else { Level::Warn };
        Finding::new(
            "memlock",
            level,
            format!(
                "{shown}: registering the pool's blocks (up to 64 MiB each) and the \
                     connections' buffers will fail past it"
            ),
        )
        .fix(
            "raise it: `ulimit -l unlimited` (or memlock in /etc/security/limits.conf; \
             LimitMEMLOCK=infinity for systemd; in Kubernetes run with IPC_LOCK)",
        )
    };
    out.push(finding);
}

fn hugepages(host: &Host, out: &mut Vec<Finding>) {
    let meminfo = read(&host.proc.join("meminfo")).unwrap_or_default();
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    let thp = read(&host.sys.join("kernel/mm/transparent_hugepage/enabled")).unwrap_or_default();
    let thp_mode = thp
        .split_whitespace()
        .find(|w| w.starts_with('['))
        .map(|w| w.trim_matches(['[', ']']).to_string())
        .unwrap_or_else(|| "unknown".into());
    // bemalloc maps its pool with plain anonymous memory (no MAP_HUGETLB, no madvise), so
    // huge pages back it only where THP is "always".
    let backs = if thp_mode == "always" { "backs" } else { "does not back" };
    out.push(Finding::new(
        "hugepages",
        Level::Info,
        format!(
            "{} huge pages of {} kB free, unused by bex; transparent huge pages: {thp_mode}, \
             so THP {backs} the registered pool (huge pages mean fewer translations for a \
             hardware NIC)",
            field("HugePages_Free").unwrap_or(0),
            field("Hugepagesize").unwrap_or(0)
        ),
    ));
}

fn secret(input: &Input<'_>, out: &mut Vec<Finding>) {
    let set = input.secret.as_deref().is_some_and(|s| !s.is_empty());
    let cfg = input.cfg;
    let finding = if set {
        Finding::new("secret", Level::Ok, "BEX_SECRET is set")
    } else if input.ip.is_loopback() {
        Finding::new(
            "secret",
            Level::Info,
            "BEX_SECRET is not set: on loopback the secret comes from the cluster name \
             (bex-cluster gives each run a random one)",
        )
    } else if cfg.cluster.allow_insecure {
        Finding::new(
            "secret",
            Level::Warn,
            format!(
                "BEX_SECRET is not set and {} is not loopback: allow_insecure lets anyone who \
                 reads the config join",
                input.ip
            ),
        )
        .fix("export the same BEX_SECRET to every process of the cluster")
    } else {
        Finding::new(
            "secret",
            Level::Error,
            format!(
                "BEX_SECRET is not set and {} is not loopback: processes refuse to start",
                input.ip
            ),
        )
        .fix(
            "export BEX_SECRET=$(head -c 32 /dev/urandom | base64) to every process of the cluster",
        )
    };
    out.push(finding);
}

fn peers(input: &Input<'_>, out: &mut Vec<Finding>) {
    use std::net::ToSocketAddrs;
    let Ok(mut topo) = input.cfg.topology() else { return };
    topo.resolve_with(|name| (name, 0).to_socket_addrs().ok()?.next().map(|a| a.ip()));
    for (id, a) in topo.servers() {
        if a.unresolved() {
            let name = a.host.as_deref().unwrap_or("");
            out.push(
                Finding::new(
                    &format!("peer.p{}s{}.name", id.pod, id.shard),
                    Level::Warn,
                    format!("{name} does not resolve from here"),
                )
                .fix("check DNS (or /etc/hosts) on this host; in Kubernetes, the headless Service"),
            );
            continue;
        }
        for (what, addr) in [("rdma", a.rdma), ("tcp", a.tcp)] {
            let check = format!("peer.p{}s{}.{what}", id.pod, id.shard);
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(_) => out.push(Finding::new(&check, Level::Ok, format!("{addr} answers"))),
                Err(e) => {
                    out.push(Finding::new(&check, Level::Warn, format!("{addr}: {e}")).fix(
                        "start that server, or open the port in the firewall between the hosts",
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bex_testkit::scratch::Scratch;

    /// A fake sysfs with one RoCE device `mlx5_0`, port 1, on netdev `eth1` holding
    /// 192.168.7.5: GID 0 link-local (RoCE v1), 1 RoCE v1 and 2 RoCE v2 of the IPv4 address.
    fn roce_tree(state: &str) -> (Scratch, Host) {
        let dir = Scratch::unique("doctor");
        let port = dir.path().join("sys/class/infiniband/mlx5_0/ports/1");
        let w = |p: &Path, s: &str| {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{s}\n")).unwrap();
        };
        w(&port.join("state"), state);
        w(&port.join("phys_state"), "5: LinkUp");
        w(&port.join("link_layer"), "Ethernet");
        let v4 = "0000:0000:0000:0000:0000:ffff:c0a8:0705";
        let ll = "fe80:0000:0000:0000:0a00:27ff:fe4b:19a0";
        for (i, gid, kind) in [(0, ll, "IB/RoCE v1"), (1, v4, "IB/RoCE v1"), (2, v4, "RoCE v2")] {
            w(&port.join(format!("gids/{i}")), gid);
            w(&port.join(format!("gid_attrs/types/{i}")), kind);
            w(&port.join(format!("gid_attrs/ndevs/{i}")), "eth1");
        }
        w(&port.join("gids/3"), "0000:0000:0000:0000:0000:0000:0000:0000");
        let net = dir.path().join("sys/class/net/eth1");
        w(&net.join("mtu"), "9000");
        w(&net.join("ecn/roce_np/enable/3"), "1");
        w(&net.join("ecn/roce_rp/enable/3"), "1");
        w(&net.join("ecn/roce_np/enable/0"), "0");
        w(&dir.path().join("proc/meminfo"), "HugePages_Free:      12\nHugepagesize:       2048 kB");
        let host = Host { sys: dir.path().join("sys"), proc: dir.path().join("proc") };
        (dir, host)
    }

    fn verbs_cfg(device: &str, gid_index: i16) -> Config {
        let mut cfg = Config::local(1, 1, 17000);
        cfg.transport.nic = NicKind::Verbs;
        cfg.transport.device = device.into();
        cfg.transport.gid_index = gid_index;
        cfg
    }

    fn run(cfg: &Config, ip: &str, host: &Host) -> Vec<Finding> {
        let input = Input { cfg, ip: ip.parse().unwrap(), secret: Some("s".into()), peers: false };
        let mut out = Vec::new();
        verbs(&input, host, &mut out);
        out
    }

    fn level_of(findings: &[Finding], check: &str) -> Level {
        findings
            .iter()
            .find(|f| f.check == check)
            .unwrap_or_else(|| panic!("{check}: {findings:?}"))
            .level
    }

    #[test]
    fn a_healthy_roce_port_finds_the_v2_gid_of_the_address() {
        let (_dir, host) = roce_tree("4: ACTIVE");
        let f = run(&verbs_cfg("", -1), "192.168.7.5", &host);
        assert_eq!(worst(&f), Level::Info, "{}", render(&f));
        let gid = f.iter().find(|x| x.check == "nic.gid").unwrap();
        assert!(gid.detail.contains("GID index 2") && gid.detail.contains("eth1"), "{gid:?}");
        assert_eq!(level_of(&f, "nic.ecn"), Level::Ok);
        assert_eq!(level_of(&f, "nic.mtu"), Level::Ok);
    }

    #[test]
    fn the_wrong_address_gid_or_device_is_an_error_with_a_fix() {
        let (_dir, host) = roce_tree("4: ACTIVE");
        // An address the device does not carry (the wrong NIC of a multi-NIC host).
        let f = run(&verbs_cfg("", -1), "10.0.0.9", &host);
        let gid = f.iter().find(|x| x.check == "nic.gid").unwrap();
        assert_eq!(gid.level, Level::Error);
        assert!(gid.detail.contains("2: 0000:0000:0000:0000:0000:ffff:c0a8:0705"), "{gid:?}");
        assert!(gid.fix.as_deref().unwrap().contains("rdma link"));
        // The RoCE v1 GID of the right address (the classic wrong GID index).
        let f = run(&verbs_cfg("", 1), "192.168.7.5", &host);
        assert_eq!(level_of(&f, "nic.gid"), Level::Error);
        assert!(render(&f).contains("gid_index = 2"), "{}", render(&f));
        // A device that is not there.
        let f = run(&verbs_cfg("mlx5_9", -1), "192.168.7.5", &host);
        assert_eq!(level_of(&f, "nic.device"), Level::Error);
        assert!(render(&f).contains("this host has mlx5_0"));
    }

    #[test]
    fn a_port_that_is_down_or_a_host_without_devices_is_an_error() {
        let (_dir, host) = roce_tree("1: DOWN");
        let f = run(&verbs_cfg("", -1), "192.168.7.5", &host);
        assert_eq!(level_of(&f, "nic.port"), Level::Error);
        let empty = Host { sys: "/nonexistent".into(), proc: "/nonexistent".into() };
        let f = run(&verbs_cfg("", -1), "192.168.7.5", &empty);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].level, Level::Error);
        assert!(f[0].fix.as_deref().unwrap().contains("nic = \"soft\""));
    }

    #[test]
    fn a_small_link_mtu_lowers_the_path_mtu_and_ecn_off_is_a_warning() {
        let (dir, host) = roce_tree("4: ACTIVE");
        std::fs::write(dir.path().join("sys/class/net/eth1/mtu"), "1500\n").unwrap();
        std::fs::write(dir.path().join("sys/class/net/eth1/ecn/roce_rp/enable/3"), "0\n").unwrap();
        let f = run(&verbs_cfg("", -1), "192.168.7.5", &host);
        let mtu = f.iter().find(|x| x.check == "nic.mtu").unwrap();
        assert_eq!(mtu.level, Level::Warn);
        assert!(mtu.detail.contains("RoCE MTU 1024"), "{mtu:?}");
        assert_eq!(level_of(&f, "nic.ecn"), Level::Warn);
    }

    #[test]
    fn the_soft_nic_checks_pass_on_loopback() {
        let cfg = Config::local(1, 1, 17000);
        let input =
            Input { cfg: &cfg, ip: "127.0.0.1".parse().unwrap(), secret: None, peers: false };
        let f = examine(&input, &Host::default());
        assert!(worst(&f) <= Level::Warn, "{}", render(&f));
        assert_eq!(level_of(&f, "nic.address"), Level::Ok);
        assert_eq!(level_of(&f, "secret"), Level::Info);
        // An address this host does not have, without a secret.
        let input = Input { ip: "192.0.2.77".parse().unwrap(), ..input };
        let f = examine(&input, &Host::default());
        assert_eq!(level_of(&f, "nic.address"), Level::Error);
        assert_eq!(level_of(&f, "secret"), Level::Error);
        assert!(serde_json::to_string(&f).unwrap().contains("\"level\":\"error\""));
    }
}
