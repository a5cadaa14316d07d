//! The plan: every process, its id, pod, namespace, address and command line, and the
//! network commands of netns mode, built from the configuration alone (no I/O), so it can be
//! unit-tested. [`crate::exec`] runs it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use bex_ps_proto::config::ServerEntry;
use bex_ps_proto::Config;
use bex_report::ProcessKind;

use crate::launch::{parse_rate, parse_size, LaunchConfig, Mode};

/// What a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `ps-server` of (pod, shard).
    Server {
        /// Pod.
        pod: u32,
        /// Shard.
        shard: u32,
    },
    /// `ranker` on `pod` with client id `id`.
    Ranker {
        /// Served first by this pod.
        pod: u32,
        /// Unique client id.
        id: u64,
    },
    /// `trainer` on `pod` (the training pod) with client id `id`.
    Trainer {
        /// The training pod.
        pod: u32,
        /// Unique client id.
        id: u64,
    },
    /// `bex-chaos canary` (countable pushes to the training pod) with client id `id`.
    Canary {
        /// The training pod.
        pod: u32,
        /// Unique client id.
        id: u64,
    },
    /// `bex-chaos verify`, after the phases, with client id `id`.
    Verify {
        /// Unique client id.
        id: u64,
    },
}

/// One process to start.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcSpec {
    /// Unique name: logs `<out>/logs/<name>.{out,err}`, namespace `bex-<pid>-<name>`.
    pub name: String,
    /// What it is.
    pub role: Role,
    /// Its network namespace (netns mode).
    pub netns: Option<String>,
    /// Its address.
    pub ip: IpAddr,
    /// Servers: the `/health` and `/metrics` address; rankers and trainers: `/metrics`
    /// (`launch.client_metrics_port`).
    pub http: Option<SocketAddr>,
    /// The binary.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Clients: where the JSON report goes.
    pub json: Option<PathBuf>,
}

impl ProcSpec {
    /// The full command line: `ip netns exec <ns> <program> <args>` in a namespace (`ip`
    /// execs in place, so the pid is the program's and its pdeathsig sees the launcher).
    pub fn argv(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(ns) = &self.netns {
            v.extend(["ip", "netns", "exec", ns.as_str()].map(String::from));
        }
        v.push(self.program.display().to_string());
        v.extend(self.args.iter().cloned());
        v
    }
}

/// One phase's clients (started together, awaited together).
#[derive(Clone, Debug, PartialEq)]
pub struct PhasePlan {
    /// As in `launch.phases`.
    pub name: String,
    /// Its rankers and trainers.
    pub clients: Vec<ProcSpec>,
}

/// One host of netns mode: a namespace with one veth to the switch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetHost {
    /// The host's name (the process's: `ps-p0-s1`, `ranker-3`), resolved by every host
    /// through `/etc/netns/<ns>/hosts`.
    pub name: String,
    /// The namespace.
    pub ns: String,
    /// Its address on the /16.
    pub ip: Ipv4Addr,
    /// The veth end in the switch namespace (the host's end is `eth0`).
    pub sw_if: String,
}

/// The network of netns mode.
#[derive(Clone, Debug, PartialEq)]
pub struct NetPlan {
    /// The switch namespace (holds the bridge `br0`).
    pub switch_ns: String,
    /// Every host.
    pub hosts: Vec<NetHost>,
    /// `ip`/`tc` commands that build it, in order.
    pub setup: Vec<Vec<String>>,
}

impl NetPlan {
    /// The `hosts` file of every host namespace (`ip netns exec` mounts
    /// `/etc/netns/<ns>/hosts` over `/etc/hosts`): the servers are named in the cluster file,
    /// so every run resolves names across namespaces.
    pub fn hosts_file(&self) -> String {
        let mut t = String::from(
            "# bex-cluster netns mode: every host of the run\n127.0.0.1 localhost\n::1 localhost\n",
        );
        for h in &self.hosts {
            t.push_str(&format!("{} {}\n", h.ip, h.name));
        }
        t
    }

    /// Every namespace, hosts first (deleting a host namespace deletes its veth pair).
    pub fn namespaces(&self) -> Vec<String> {
        let mut v: Vec<String> = self.hosts.iter().map(|h| h.ns.clone()).collect();
        v.push(self.switch_ns.clone());
        v
    }
}

/// Everything the executor does.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// loopback | netns.
    pub mode: Mode,
    /// The configuration every process reads (netns: with explicit `[[cluster.servers]]`).
    pub config: Config,
    /// Where it is written.
    pub config_path: PathBuf,
    /// Every ps-server.
    pub servers: Vec<ProcSpec>,
    /// The phases in order.
    pub phases: Vec<PhasePlan>,
    /// netns mode's network.
    pub net: Option<NetPlan>,
    /// `bex-chaos verify` over every canary's report, when any phase runs canaries.
    pub verify: Option<ProcSpec>,
}

/// What the plan is built from besides the configuration.
#[derive(Clone, Debug)]
pub struct PlanInput {
    /// The launcher's pid (namespace names).
    pub launcher_pid: u32,
    /// The output directory.
    pub out_dir: PathBuf,
    /// Where `ps-server`, `ranker`, `trainer` are.
    pub bin_dir: PathBuf,
}

/// The namespace prefix of launcher `pid`: `bex-<pid>-`.
pub fn ns_prefix(pid: u32) -> String {
    format!("bex-{pid}-")
}

/// Host `i`'s address: 10.77.0.0/16, host numbers from 1 (the bridge is 10.77.255.254).
pub fn host_ip(i: usize) -> Option<Ipv4Addr> {
    let n = u16::try_from(i + 1).ok().filter(|n| *n < 0xFFFE)?;
    Some(Ipv4Addr::new(10, 77, (n >> 8) as u8, (n & 0xFF) as u8))
}

/// The bridge's address.
pub const BRIDGE_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 255, 254);
/// Jumbo frames: a 4096-byte RNIC packet needs no IP fragmentation.
pub const LINK_MTU: u32 = 9000;

/// The pods rankers run on: every pod but the training pod (or the training pod if it is
/// the only one).
pub fn serving_pods(cfg: &Config) -> Vec<u32> {
    let v: Vec<u32> = (0..cfg.cluster.pods).filter(|p| *p != cfg.cluster.training_pod).collect();
    if v.is_empty() {
        vec![cfg.cluster.training_pod]
    } else {
        v
    }
}

impl Plan {
    /// Builds the plan. Errors are configuration errors (exit code 2).
    pub fn build(cfg: &Config, launch: &LaunchConfig, input: &PlanInput) -> Result<Plan, String> {
        let phases = launch.parsed_phases()?;
        let config_path = input.out_dir.join("cluster.toml");
        let cfg_arg = config_path.display().to_string();
        let prefix = ns_prefix(input.launcher_pid);
        let netns = launch.mode == Mode::Netns;
        if !netns && !cfg.cluster.server_host.is_empty() {
            return Err("cluster.server_host names one host per server: run it in netns mode \
                        (--mode netns), or on the hosts themselves"
                .into());
        }
        let mut config = cfg.clone();
        if launch.fresh_data {
            config.cluster.data_dir = input.out_dir.join("data");
        }
        let mut host_count = 0usize;
        let mut next_ip = || -> Result<Ipv4Addr, String> {
            let ip = host_ip(host_count).ok_or("too many hosts for 10.77.0.0/16")?;
            host_count += 1;
            Ok(ip)
        };

        // A client process's namespace and address: its own (netns) or loopback.
        let place = |name: &str,
                     next_ip: &mut dyn FnMut() -> Result<Ipv4Addr, String>|
         -> Result<(Option<String>, IpAddr), String> {
            Ok(if netns {
                (Some(format!("{prefix}{name}")), IpAddr::V4(next_ip()?))
            } else {
                (None, IpAddr::V4(Ipv4Addr::LOCALHOST))
            })
        };
        // What every client process (ranker, trainer, canary, verifier) is told.
        let client_args = |ip: IpAddr, id: u64, json: &std::path::Path| -> [String; 10] {
            [
                "--config".into(),
                cfg_arg.clone(),
                "--bind".into(),
                ip.to_string(),
                "--transport".into(),
                launch.transport.name().into(),
                "--id".into(),
                id.to_string(),
                "--json".into(),
                json.display().to_string(),
            ]
        };

        // Servers.
        let mut servers = Vec::new();
        let mut entries = Vec::new();
        for pod in 0..cfg.cluster.pods {
            for shard in 0..cfg.cluster.shards {
                let name = format!("ps-p{pod}-s{shard}");
                let (ns, ip, http) = if netns {
                    let ip = next_ip()?;
                    let port = cfg.cluster.base_port;
                    // By name: the hosts resolve each other through /etc/netns/<ns>/hosts.
                    let at = |d: u16| -> Result<String, String> {
                        let p = port.checked_add(d).ok_or("cluster.base_port too large")?;
                        Ok(format!("{name}:{p}"))
                    };
                    entries.push(ServerEntry {
                        pod,
                        shard,
                        rdma: at(0)?,
                        tcp: at(1)?,
                        http: at(2)?,
                    });
                    let http = SocketAddr::new(IpAddr::V4(ip), port.saturating_add(2));
                    (Some(format!("{prefix}{name}")), IpAddr::V4(ip), http)
                } else {
                    let topo = cfg.topology().map_err(|e| e.to_string())?;
                    let a = topo
                        .server(pod, shard)
                        .ok_or_else(|| format!("no address for pod {pod} shard {shard}"))?;
                    (None, a.http.ip(), a.http)
                };
                servers.push(ProcSpec {
                    name,
                    role: Role::Server { pod, shard },
                    netns: ns,
                    ip,
                    http: Some(http),
                    program: input.bin_dir.join("ps-server"),
                    args: vec![
                        "--config".into(),
                        cfg_arg.clone(),
                        "--pod".into(),
                        pod.to_string(),
                        "--shard".into(),
                        shard.to_string(),
                    ],
                    json: None,
                });
            }
        }
        if netns {
            config.cluster.servers = entries;
            config.cluster.server_host.clear();
        }

        // Clients: ids unique over the whole run (they name logs, metrics ports and report
        // entries; push identities are drawn fresh by each process).
        let serving = serving_pods(cfg);
        let mut next_id = 1u64;
        let mut plans = Vec::new();
        for ph in &phases {
            let mut clients = Vec::new();
            let kinds = [
                (ph.inference, launch.rankers, ProcessKind::Ranker, &launch.ranker_args),
                (ph.training, launch.trainers, ProcessKind::Trainer, &launch.trainer_args),
                (ph.canary, launch.canaries, ProcessKind::Canary, &launch.canary_args),
            ];
            for (on, count, kind, extra) in kinds {
                if !on {
                    continue;
                }
                for i in 0..count {
                    let id = next_id;
                    next_id += 1;
                    let training = cfg.cluster.training_pod;
                    let (pod, role) = match kind {
                        ProcessKind::Trainer => (training, Role::Trainer { pod: training, id }),
                        ProcessKind::Canary => (training, Role::Canary { pod: training, id }),
                        _ => {
                            let pod = serving[i as usize % serving.len()];
                            (pod, Role::Ranker { pod, id })
                        }
                    };
                    let name = format!("{kind}-{id}");
                    let (ns, ip) = place(&name, &mut next_ip)?;
                    let json = input.out_dir.join(format!("{name}.json"));
                    let mut args: Vec<String> = Vec::new();
                    let canary = kind == ProcessKind::Canary;
                    if canary {
                        args.push("canary".into());
                    }
                    args.extend(["--pod".into(), pod.to_string()]);
                    args.extend(client_args(ip, id, &json));
                    let port = launch.client_metrics_port;
                    let http = if port == 0 || canary {
                        None
                    } else {
                        let offset = if netns { 0 } else { id - 1 };
                        let port = u16::try_from(u64::from(port) + offset)
                            .map_err(|_| "launch.client_metrics_port too large for the clients")?;
                        Some(SocketAddr::new(ip, port))
                    };
                    if let Some(a) = http {
                        args.extend(["--metrics".into(), a.to_string()]);
                    }
                    args.extend(extra.iter().cloned());
                    clients.push(ProcSpec {
                        name,
                        role,
                        netns: ns,
                        ip,
                        http,
                        program: input.bin_dir.join(if canary { "bex-chaos" } else { kind.name() }),
                        args,
                        json: Some(json),
                    });
                }
            }
            plans.push(PhasePlan { name: ph.name.clone(), clients });
        }

        // The verdict over every canary's counts, after the phases.
        let canary_reports: Vec<String> = plans
            .iter()
            .flat_map(|p| p.clients.iter())
            .filter(|c| matches!(c.role, Role::Canary { .. }))
            .filter_map(|c| c.json.as_ref().map(|j| j.display().to_string()))
            .collect();
        let verify = if canary_reports.is_empty() {
            None
        } else {
            let id = next_id;
            let name = "verify".to_string();
            let (ns, ip) = place(&name, &mut next_ip)?;
            let json = input.out_dir.join("verify.json");
            let mut args: Vec<String> = vec!["verify".into()];
            args.extend(client_args(ip, id, &json));
            args.extend(["--settle-s".into(), launch.verify_settle_s.to_string()]);
            for r in canary_reports {
                args.push("--canary".into());
                args.push(r);
            }
            Some(ProcSpec {
                name,
                role: Role::Verify { id },
                netns: ns,
                ip,
                http: None,
                program: input.bin_dir.join("bex-chaos"),
                args,
                json: Some(json),
            })
        };

        let net = if netns {
            let all = servers
                .iter()
                .chain(plans.iter().flat_map(|p| p.clients.iter()))
                .chain(verify.iter());
            let hosts: Vec<NetHost> = all
                .enumerate()
                .filter_map(|(i, p)| match (&p.netns, p.ip) {
                    (Some(ns), IpAddr::V4(ip)) => Some(NetHost {
                        name: p.name.clone(),
                        ns: ns.clone(),
                        ip,
                        sw_if: format!("v{i}"),
                    }),
                    _ => None,
                })
                .collect();
            Some(net_plan(&format!("{prefix}sw"), hosts, launch)?)
        } else {
            None
        };
        Ok(Plan { mode: launch.mode, config, config_path, servers, phases: plans, net, verify })
    }

    /// Every process of the plan.
    pub fn all_procs(&self) -> impl Iterator<Item = &ProcSpec> {
        self.servers
            .iter()
            .chain(self.phases.iter().flat_map(|p| p.clients.iter()))
            .chain(self.verify.iter())
    }
}

/// tbf parameters in bytes: (rate bit/s, burst, limit).
pub fn tbf_params(launch: &LaunchConfig) -> Result<Option<(u64, u64, u64)>, String> {
    if launch.link_rate.is_empty() {
        return Ok(None);
    }
    let rate = parse_rate(&launch.link_rate)?;
    let burst = if launch.link_burst.is_empty() {
        (rate / 8 / 1000).max(64 << 10) // 1 ms at line rate, at least 64 KiB (> a jumbo frame)
    } else {
        parse_size(&launch.link_burst)?
    };
    let limit =
        if launch.link_queue.is_empty() { 2 * burst } else { parse_size(&launch.link_queue)? };
    Ok(Some((rate, burst, limit)))
}

fn net_plan(
    switch_ns: &str,
    hosts: Vec<NetHost>,
    launch: &LaunchConfig,
) -> Result<NetPlan, String> {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    let mtu = LINK_MTU.to_string();
    let tbf = tbf_params(launch)?;
    let mut setup = vec![
        s(&["ip", "netns", "add", switch_ns]),
        s(&["ip", "-n", switch_ns, "link", "add", "br0", "type", "bridge"]),
        s(&["ip", "-n", switch_ns, "link", "set", "br0", "mtu", &mtu, "up"]),
        s(&["ip", "-n", switch_ns, "addr", "add", &format!("{BRIDGE_IP}/16"), "dev", "br0"]),
        s(&["ip", "-n", switch_ns, "link", "set", "lo", "up"]),
    ];
    for h in &hosts {
        let ns = h.ns.as_str();
        let sw = h.sw_if.as_str();
        setup.push(s(&["ip", "netns", "add", ns]));
        // Created inside the switch namespace with the peer placed directly in the host's:
        // no interface ever appears in the root namespace.
        setup.push(s(&[
            "ip", "-n", switch_ns, "link", "add", sw, "mtu", &mtu, "type", "veth", "peer", "name",
            "eth0", "mtu", &mtu, "netns", ns,
        ]));
        setup.push(s(&["ip", "-n", switch_ns, "link", "set", sw, "master", "br0", "up"]));
        setup.push(s(&["ip", "-n", ns, "addr", "add", &format!("{}/16", h.ip), "dev", "eth0"]));
        setup.push(s(&["ip", "-n", ns, "link", "set", "eth0", "up"]));
        setup.push(s(&["ip", "-n", ns, "link", "set", "lo", "up"]));
        if let Some((rate, burst, limit)) = tbf {
            for (n, dev) in [(ns, "eth0"), (switch_ns, sw)] {
                setup.push(s(&[
                    "tc",
                    "-n",
                    n,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    &format!("{rate}bit"),
                    "burst",
                    &burst.to_string(),
                    "limit",
                    &limit.to_string(),
                ]));
            }
        }
    }
    Ok(NetPlan { switch_ns: switch_ns.to_string(), hosts, setup })
}

/// The launcher pid in a namespace name `bex-<pid>-…`, if it is one.
pub fn ns_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("bex-")?;
    let (pid, tail) = rest.split_once('-')?;
    if tail.is_empty() {
        return None;
    }
    pid.parse().ok()
}

/// `<out>/logs/<name>.out` and `.err`.
pub fn log_paths(out: &Path, name: &str) -> (PathBuf, PathBuf) {
    let d = out.join("logs");
    (d.join(format!("{name}.out")), d.join(format!("{name}.err")))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn input() -> PlanInput {
        PlanInput {
            launcher_pid: 4242,
            out_dir: PathBuf::from("/tmp/out"),
            bin_dir: PathBuf::from("/opt/bex"),
        }
    }

    fn cfg(pods: u32, shards: u32, training_pod: u32) -> Config {
        let mut c = Config::local(pods, shards, 17000);
        c.cluster.training_pod = training_pod;
        c
    }

    fn launch(mode: Mode, rankers: u32, trainers: u32, phases: &[&str]) -> LaunchConfig {
        LaunchConfig {
            mode,
            rankers,
            trainers,
            phases: phases.iter().map(|p| p.to_string()).collect(),
            ranker_args: vec!["--seconds".into(), "3".into()],
            ..LaunchConfig::default()
        }
    }

    fn arg<'a>(p: &'a ProcSpec, flag: &str) -> &'a str {
        let i = p.args.iter().position(|a| a == flag).expect(flag);
        &p.args[i + 1]
    }

    #[test]
    fn loopback_servers_clients_ids_and_pods() {
        let c = cfg(3, 2, 0);
        let l = launch(Mode::Loopback, 3, 2, &["inference", "training", "inference+training"]);
        let p = Plan::build(&c, &l, &input()).unwrap();
        assert_eq!(p.servers.len(), 6);
        assert!(p.net.is_none());
        let https: HashSet<_> = p.servers.iter().map(|s| s.http.unwrap()).collect();
        assert_eq!(https.len(), 6, "http addresses unique");
        assert_eq!(p.servers[3].role, Role::Server { pod: 1, shard: 1 });
        assert_eq!(
            p.servers[3].argv(),
            [
                "/opt/bex/ps-server",
                "--config",
                "/tmp/out/cluster.toml",
                "--pod",
                "1",
                "--shard",
                "1"
            ]
        );
        assert_eq!(p.phases.iter().map(|ph| ph.clients.len()).collect::<Vec<_>>(), [3, 2, 5]);
        let ids: Vec<&str> =
            p.phases.iter().flat_map(|ph| &ph.clients).map(|c| arg(c, "--id")).collect();
        assert_eq!(ids.len(), 10);
        assert_eq!(
            ids.iter().collect::<HashSet<_>>().len(),
            10,
            "ids unique across phases: {ids:?}"
        );
        let names: HashSet<_> = p.all_procs().map(|c| c.name.clone()).collect();
        assert_eq!(names.len(), 16, "names (logs, json files) unique");
        for c in p.phases.iter().flat_map(|ph| &ph.clients) {
            match c.role {
                // Serving pods are 1 and 2, round-robin.
                Role::Ranker { pod, .. } => assert!(pod == 1 || pod == 2),
                Role::Trainer { pod, .. } | Role::Canary { pod, .. } => assert_eq!(pod, 0),
                Role::Server { .. } | Role::Verify { .. } => panic!("not a phase client: {c:?}"),
            }
            assert_eq!(arg(c, "--bind"), "127.0.0.1");
            assert_eq!(arg(c, "--transport"), "rdma");
            assert_eq!(arg(c, "--json"), c.json.as_ref().unwrap().display().to_string());
            assert!(c.netns.is_none());
        }
        let rankers: Vec<u32> = p.phases[0]
            .clients
            .iter()
            .map(|c| if let Role::Ranker { pod, .. } = c.role { pod } else { 99 })
            .collect();
        assert_eq!(rankers, [1, 2, 1]);
        // Extra args go to the rankers only, last.
        assert_eq!(&p.phases[0].clients[0].args[14..], ["--seconds", "3"]);
        // Rankers and trainers serve /metrics on distinct loopback ports (not canaries).
        let metrics: Vec<String> = p
            .phases
            .iter()
            .flat_map(|ph| &ph.clients)
            .filter(|c| !matches!(c.role, Role::Canary { .. }))
            .map(|c| {
                assert_eq!(Some(arg(c, "--metrics").to_string()), c.http.map(|a| a.to_string()));
                arg(c, "--metrics").to_string()
            })
            .collect();
        assert_eq!(metrics.iter().collect::<HashSet<_>>().len(), metrics.len(), "{metrics:?}");
        assert!(metrics.contains(&"127.0.0.1:19100".to_string()), "{metrics:?}");
        assert!(!p.phases[1].clients[0].args.contains(&"--seconds".to_string()));
    }

    #[test]
    fn single_pod_serves_from_the_training_pod() {
        let p = Plan::build(&cfg(1, 2, 0), &launch(Mode::Loopback, 2, 1, &["inference"]), &input())
            .unwrap();
        assert_eq!(p.phases[0].clients.len(), 2);
        assert!(p.phases[0].clients.iter().all(|c| matches!(c.role, Role::Ranker { pod: 0, .. })));
        let p = Plan::build(&cfg(2, 1, 1), &launch(Mode::Loopback, 2, 1, &["training"]), &input())
            .unwrap();
        assert_eq!(p.phases[0].clients.len(), 1);
        assert!(p.phases[0].clients.iter().all(|c| matches!(c.role, Role::Trainer { pod: 1, .. })));
        assert_eq!(serving_pods(&cfg(2, 1, 1)), [0]);
    }

    #[test]
    fn netns_names_addresses_and_commands() {
        let mut l = launch(Mode::Netns, 2, 1, &["inference+training"]);
        l.link_rate = "1gbit".into();
        let p = Plan::build(&cfg(2, 2, 0), &l, &input()).unwrap();
        let net = p.net.as_ref().unwrap();
        assert_eq!(net.hosts.len(), 7, "4 servers + 3 clients");
        assert_eq!(net.switch_ns, "bex-4242-sw");
        let ips: HashSet<_> = net.hosts.iter().map(|h| h.ip).collect();
        assert_eq!(ips.len(), 7, "host addresses unique");
        assert!(!ips.contains(&BRIDGE_IP));
        let nss: HashSet<_> = net.namespaces().into_iter().collect();
        assert_eq!(nss.len(), 8);
        for ns in &nss {
            assert!(ns.starts_with("bex-4242-"), "{ns}");
            assert_eq!(ns_owner(ns), Some(4242));
        }
        for h in &net.hosts {
            assert!(h.sw_if.len() <= 15, "interface names fit IFNAMSIZ");
        }
        for proc in p.all_procs() {
            let ns = proc.netns.as_deref().unwrap();
            assert_eq!(proc.argv()[..4], ["ip", "netns", "exec", ns]);
            assert!(net.hosts.iter().any(|h| h.ns == ns && IpAddr::V4(h.ip) == proc.ip));
            // Clients are told their namespace's address (servers get theirs in the config).
            if !matches!(proc.role, Role::Server { .. }) {
                assert_eq!(arg(proc, "--bind"), proc.ip.to_string());
            }
        }
        // Two tbf qdiscs per host link (both ends), each with the parsed rate.
        let tbf: Vec<_> = net.setup.iter().filter(|c| c.contains(&"tbf".to_string())).collect();
        assert_eq!(tbf.len(), 14);
        assert!(tbf.iter().all(|c| c.contains(&"1000000000bit".to_string())));
        // Every host namespace is created before it is used; lo is brought up in each.
        for h in &net.hosts {
            let add =
                net.setup.iter().position(|c| c[..3] == ["ip", "netns", "add"] && c[3] == h.ns);
            let first_use = net.setup.iter().position(|c| c.contains(&h.ns) && c[1] != "netns");
            assert!(add.unwrap() < first_use.unwrap());
            assert!(net.setup.iter().any(|c| c[..3] == ["ip", "-n", h.ns.as_str()]
                && c.ends_with(&["lo".into(), "up".into()])));
        }
        // The rewritten config lists every server by its host name, and is valid; the hosts
        // file every namespace gets resolves each name to that host's address.
        assert_eq!(p.config.cluster.servers.len(), 4);
        let text = p.config.to_toml_string().unwrap();
        let back = Config::from_toml_str(&text).unwrap();
        assert_eq!(back, p.config);
        let mut topo = back.topology().unwrap();
        let hosts = net.hosts_file();
        let unresolved = topo.resolve_with(|name| {
            hosts.lines().find_map(|l| {
                let (ip, n) = l.split_once(' ')?;
                (n == name).then(|| ip.parse().ok()).flatten()
            })
        });
        assert!(unresolved.is_empty(), "{unresolved:?} not in\n{hosts}");
        for s in &p.servers {
            let Role::Server { pod, shard } = s.role else { panic!() };
            let a = topo.server(pod, shard).unwrap();
            assert_eq!(a.host.as_deref(), Some(s.name.as_str()));
            assert_eq!(a.http, s.http.unwrap());
            assert_eq!(a.rdma.ip(), s.ip);
        }
    }

    #[test]
    fn unlimited_links_have_no_qdisc_and_bursts_default_sensibly() {
        let l = launch(Mode::Netns, 1, 0, &["inference"]);
        let p = Plan::build(&cfg(1, 1, 0), &l, &input()).unwrap();
        assert!(p.net.unwrap().setup.iter().all(|c| c[0] != "tc"));
        let mut l = LaunchConfig { link_rate: "10gbit".into(), ..LaunchConfig::default() };
        assert_eq!(tbf_params(&l).unwrap(), Some((10_000_000_000, 1_250_000, 2_500_000)));
        l.link_rate = "100mbit".into();
        assert_eq!(tbf_params(&l).unwrap(), Some((100_000_000, 65536, 131072)));
        l.link_queue = "1mb".into();
        assert_eq!(tbf_params(&l).unwrap().unwrap().2, 1 << 20);
    }

    #[test]
    fn canaries_run_bex_chaos_and_a_verifier_reads_their_reports() {
        let c = cfg(2, 2, 0);
        let mut l = launch(Mode::Netns, 1, 1, &["inference+training+canary"]);
        l.canaries = 2;
        let p = Plan::build(&c, &l, &input()).unwrap();
        let canaries: Vec<&ProcSpec> = p.phases[0]
            .clients
            .iter()
            .filter(|c| matches!(c.role, Role::Canary { pod: 0, .. }))
            .collect();
        assert_eq!(canaries.len(), 2);
        assert!(canaries.iter().all(|c| c.program.ends_with("bex-chaos") && c.args[0] == "canary"));
        let v = p.verify.as_ref().expect("a verifier when canaries run");
        assert_eq!(v.args[0], "verify");
        let reports: Vec<&String> = v
            .args
            .iter()
            .zip(v.args.iter().skip(1))
            .filter(|(a, _)| *a == "--canary")
            .map(|(_, r)| r)
            .collect();
        assert_eq!(reports.len(), 2);
        // The verifier is a host of its own in netns mode.
        assert!(p.net.as_ref().unwrap().hosts.iter().any(|h| Some(&h.ns) == v.netns.as_ref()));
        let none = Plan::build(&c, &launch(Mode::Loopback, 1, 1, &["training"]), &input()).unwrap();
        assert!(none.verify.is_none());
    }

    #[test]
    fn loopback_config_is_unchanged_but_for_fresh_data_and_round_trips() {
        let c = cfg(2, 2, 0);
        let p = Plan::build(&c, &launch(Mode::Loopback, 1, 1, &[]), &input()).unwrap();
        let mut fresh = c.clone();
        fresh.cluster.data_dir = input().out_dir.join("data");
        assert_eq!(p.config, fresh);
        assert!(p.phases.is_empty());
        let back = Config::from_toml_str(&p.config.to_toml_string().unwrap()).unwrap();
        assert_eq!(back, fresh);
        let keep = LaunchConfig { fresh_data: false, ..launch(Mode::Loopback, 1, 1, &[]) };
        assert_eq!(Plan::build(&c, &keep, &input()).unwrap().config, c);
    }

    #[test]
    fn namespace_owners() {
        assert_eq!(ns_owner("bex-123-ps-p0-s1"), Some(123));
        assert_eq!(ns_owner("bex-123-"), None);
        assert_eq!(ns_owner("bexl77a"), None);
        assert_eq!(ns_owner("bex-abc-sw"), None);
        assert_eq!(host_ip(0), Some(Ipv4Addr::new(10, 77, 0, 1)));
        assert_eq!(host_ip(255), Some(Ipv4Addr::new(10, 77, 1, 0)));
        assert_eq!(host_ip(70_000), None);
    }
}
