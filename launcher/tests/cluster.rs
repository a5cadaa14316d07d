//! `bex-cluster` end to end with real `ps-server` processes and tiny fake clients (shell
//! scripts that honour the ranker/trainer CLI contract: `--json PATH`, `--id N`, exit 0,
//! a report on SIGTERM). The real ranker and trainer are built by other crates; the launcher
//! only needs their contract.
//!
//! `ps-server` comes from `bex_testkit::bins` (built for this test's profile, a no-op when
//! fresh; or from `BEX_BIN_DIR`) and is symlinked next to the fakes into a per-test `bin_dir`.

use std::io::BufRead;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use bex_process::child::Guard;
use bex_testkit::Scratch;
use serde_json::Value;

const FAKE: &str = r#"#!/bin/sh
# A stand-in for ranker/trainer: writes its JSON report, prints a summary.
kind=$(basename "$0"); json=""; id=""; pod=""; mode="ok"
while [ $# -gt 0 ]; do
  case "$1" in
    --json) json="$2"; shift;; --id) id="$2"; shift;; --pod) pod="$2"; shift;;
    --fail) mode=fail;; --hang) mode=hang;;
  esac
  shift
done
report() { echo "{\"kind\":\"$kind\",\"id\":$id,\"pod\":$pod,\"stopped\":$1}" > "$json"; }
trap 'report true; echo "$kind $id stopped"; exit 0' TERM
if [ "$mode" = fail ]; then echo "$kind: failing on purpose" >&2; exit 1; fi
if [ "$mode" = hang ]; then while :; do sleep 0.05; done; fi
report false
echo "$kind $id pod $pod: done"
"#;

#[allow(clippy::disallowed_methods)] // the test's one clock: polling real processes
fn pause(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

#[allow(clippy::disallowed_methods)] // the same clock, read
fn now() -> std::time::Instant {
    std::time::Instant::now()
}

struct Run {
    dir: Scratch,
    bin: PathBuf,
    config: PathBuf,
}

fn setup(name: &str, pods: u32, shards: u32) -> Run {
    let dir = Scratch::new(&format!("launcher-test-{name}"));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(bex_testkit::bins::ps_server(), bin.join("ps-server")).unwrap();
    for kind in ["ranker", "trainer"] {
        let p = bin.join(kind);
        std::fs::write(&p, FAKE).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let config = dir.join("in.toml");
    std::fs::write(
        &config,
        format!(
            "[cluster]\nname = \"t-{name}\"\npods = {pods}\nshards = {shards}\n\
             [[tables]]\nname = \"emb\"\ndim = 8\n\
             [server]\ncheckpoint_interval_s = 0\n"
        ),
    )
    .unwrap();
    Run { dir, bin, config }
}

/// Test `salt` gets ports `base + 6·salt ..` of this process's block.
fn base_port(salt: u16) -> u16 {
    bex_testkit::ports::base_port(salt, 6, 13)
}

impl Run {
    fn cmd(&self, salt: u16, sets: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_bex-cluster"));
        c.args(["run", "--config"]).arg(&self.config).arg("--out").arg(self.dir.join("out"));
        let own = [
            format!("launch.bin_dir={}", self.bin.display()),
            format!("cluster.data_dir={}", self.dir.join("data").display()),
            format!("cluster.base_port={}", base_port(salt)),
        ];
        for s in own.iter().map(String::as_str).chain(sets.iter().copied()) {
            c.args(["--set", s]);
        }
        c
    }

    /// A 1×2 cluster whose ranker hangs, started in the background: the launcher, its pid
    /// and the pids it recorded once the two servers and the ranker are up.
    fn start_hanging_ranker(&self, salt: u16) -> (Guard, u32, Vec<u64>) {
        let mut cmd =
            self.cmd(salt, &["launch.phases=[\"inference\"]", "launch.ranker_args=[\"--hang\"]"]);
        let child =
            Guard::spawn(cmd.stdout(Stdio::null()).stderr(Stdio::null()), "bex-cluster").unwrap();
        let launcher = child.id();
        let pids = wait_recorded(launcher, 3);
        assert_eq!(pids.len(), 3, "two servers and a ranker started");
        (child, launcher, pids)
    }

    /// `<out>/report.json`, which must exist.
    fn report(&self) -> Value {
        let text = std::fs::read_to_string(self.dir.join("out/report.json")).unwrap();
        serde_json::from_str(&text).expect("report.json is JSON")
    }

    fn run(&self, salt: u16, sets: &[&str]) -> (Output, Value) {
        let out = self.cmd(salt, sets).output().expect("bex-cluster runs");
        let report = std::fs::read_to_string(self.dir.join("out/report.json"))
            .map(|t| serde_json::from_str(&t).expect("report.json is JSON"))
            .unwrap_or(Value::Null);
        (out, report)
    }
}

/// The pids `launcher` recorded, once there are `n` of them (or after 30 s).
fn wait_recorded(launcher: u32, n: usize) -> Vec<u64> {
    let mut pids = Vec::new();
    for _ in 0..600 {
        pids = recorded(launcher);
        if pids.len() == n {
            break;
        }
        pause(50);
    }
    pids
}

/// The status of a child expected to exit (a minute at most: a hang fails the test, and the
/// guard then kills it).
fn exited(child: &mut Guard) -> std::process::ExitStatus {
    child.wait_exit(Duration::from_secs(60)).unwrap()
}

fn alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn show(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn health_only_2x2_cluster_comes_up_reports_and_leaves_nothing() {
    let r = setup("health", 2, 2);
    let (out, rep) = r.run(0, &["launch.phases=[]"]);
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(rep["ok"], true, "{rep:#}");
    let servers = rep["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 4);
    for s in servers {
        // Stopped by our SIGTERM, cleanly (they checkpoint).
        assert_eq!(s["status"]["exit_code"], 0, "{s:#}");
        // Present and sane; not asserted > 0: the kernel counts CPU in 10 ms ticks, and an
        // idle server of a 0.4 s run can stay under one.
        let cpu = s["cpu"]["user_s"].as_f64().unwrap() + s["cpu"]["sys_s"].as_f64().unwrap();
        assert!(cpu.is_finite() && (0.0..60.0).contains(&cpu), "{s:#}");
        // The software RNIC's counters were scraped from /metrics.
        for k in ["rnr_naks_received", "seq_naks_received", "retransmitted_packets", "tx_packets"] {
            assert!(s["rnic"][k].is_u64(), "{k} missing: {s:#}");
        }
        assert!(!alive(s["pid"].as_u64().unwrap()), "server {} still running", s["name"]);
    }
    assert!(rep["startup_s"].as_f64().unwrap() < 30.0);
    assert_eq!(rep["config"]["cluster"]["pods"], 2);
    // Every server checkpointed on SIGTERM, into the run's own data directory (fresh_data).
    for (p, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        assert!(r.dir.join(format!("out/data/pod{p}/shard{s}.ckpt")).is_file());
    }
    let toml = std::fs::read_to_string(r.dir.join("out/cluster.toml")).unwrap();
    assert!(toml.contains(&format!("base_port = {}", base_port(0))));
}

#[test]
fn phases_run_clients_on_the_right_pods_and_embed_their_reports() {
    let r = setup("phases", 2, 2);
    let (out, rep) = r.run(
        1,
        &[
            "launch.rankers=2",
            "launch.trainers=1",
            "launch.phases=[\"inference\", \"training\", \"inference+training\"]",
        ],
    );
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(rep["ok"], true, "{rep:#}");
    let phases = rep["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 3);
    let mut ids = Vec::new();
    for (ph, want) in phases.iter().zip([(2, 0), (0, 1), (2, 1)]) {
        let clients = ph["clients"].as_array().unwrap();
        let kinds = |k: &str| clients.iter().filter(|c| c["kind"] == k).count();
        assert_eq!((kinds("ranker"), kinds("trainer")), want, "{ph:#}");
        for c in clients {
            assert_eq!(c["status"]["exit_code"], 0);
            // The client's own JSON, embedded.
            assert_eq!(c["report"]["kind"], c["kind"]);
            assert_eq!(c["report"]["id"], c["id"]);
            let pod = if c["kind"] == "ranker" { 1 } else { 0 };
            assert_eq!(c["report"]["pod"], pod, "{c:#}");
            assert!(c["stdout"].as_str().unwrap().contains("done"));
            ids.push(c["id"].as_u64().unwrap());
            assert!(!alive(c["pid"].as_u64().unwrap()));
        }
        assert_eq!(ph["servers"].as_array().unwrap().len(), 4);
        assert!(ph["rnic_total"]["tx_packets"].is_u64());
        assert!(ph["server_cpu_total"]["user_s"].is_f64());
    }
    let n = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n, "client ids unique over the run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ranker 1 pod 1: done"), "client summaries printed: {stdout}");
}

#[test]
fn a_failing_client_fails_the_run_and_still_tears_down() {
    let r = setup("fail", 1, 2);
    let (out, rep) = r.run(
        2,
        &["launch.phases=[\"training\", \"inference\"]", "launch.trainer_args=[\"--fail\"]"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(rep["ok"], false);
    let reasons = rep["reasons"].to_string();
    assert!(reasons.contains("trainer-") && reasons.contains("failing on purpose"), "{reasons}");
    // The run stops at the failed phase.
    assert_eq!(rep["phases"].as_array().unwrap().len(), 1);
    assert_eq!(rep["servers"].as_array().unwrap().len(), 2);
    for s in rep["servers"].as_array().unwrap() {
        assert_eq!(s["status"]["exit_code"], 0);
        assert!(!alive(s["pid"].as_u64().unwrap()));
    }
}

// A fault scheduled after the clients have ended never happens, and a run whose faults did
// not happen proves nothing about them: it fails, naming the fault.
#[test]
fn a_chaos_event_the_phases_never_reach_fails_the_run() {
    let r = setup("unreached", 1, 2);
    let event = r#"launch.chaos=[{ at_s = 30.0, action = "kill", target = "ps-p0-s1" }]"#;
    let (out, rep) = r.run(12, &["launch.phases=[\"training\"]", event]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(rep["ok"], false);
    let reasons = rep["reasons"].to_string();
    assert!(reasons.contains("chaos kill ps-p0-s1 at 30 s was never applied"), "{reasons}");
    let chaos = &rep["chaos"][0];
    assert_eq!((&chaos["action"], &chaos["target"]), (&"kill".into(), &"ps-p0-s1".into()));
    assert!(chaos["result"].as_str().unwrap().starts_with("not applied"), "{chaos:#}");
    for s in rep["servers"].as_array().unwrap() {
        assert_eq!(s["status"]["exit_code"], 0, "never killed: {s:#}");
    }
}

#[test]
fn bad_overrides_are_usage_errors() {
    let r = setup("usage", 1, 1);
    let (out, _) = r.run(3, &["transport.cwnd_bytes=lots"]);
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("transport.cwnd_bytes expects an integer"), "{err}");
    let (out, _) = r.run(3, &["launch.phases=[\"nap\"]"]);
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let (out, _) = r.run(3, &["launch.bin_dir=/nonexistent"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/ps-server not found"));
}

/// The launcher's record of its children.
fn record_of(launcher: u32) -> PathBuf {
    bex_launcher::cleanup::state_dir().join(format!("{launcher}.pids"))
}

/// The pids in the launcher's record.
fn recorded(launcher: u32) -> Vec<u64> {
    let path = record_of(launcher);
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn a_held_cluster_serves_until_sigterm_and_then_succeeds() {
    let r = setup("hold", 1, 2);
    let mut cmd = r.cmd(9, &["launch.phases=[]", "launch.hold=true"]);
    let mut child =
        Guard::spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::null()), "bex-cluster").unwrap();
    let mut lines = std::io::BufReader::new(child.take_stdout().unwrap()).lines();
    let held = lines.by_ref().map_while(Result::ok).find(|l| l.contains("holding the cluster"));
    let held = held.expect("the launcher says it holds the cluster");
    // The file it names is what clients connect with: its servers answer.
    let config = held.split("--config ").nth(1).unwrap().split(" and ").next().unwrap();
    let secret = r.dir.join("out/secret");
    let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the run's secret is readable by its owner only");
    assert_eq!(std::fs::read_to_string(&secret).unwrap().len(), 32);
    let cfg = bex_ps_proto::Config::load(std::path::Path::new(config)).unwrap();
    let topo = cfg.topology().unwrap();
    pause(300);
    for shard in 0..2 {
        let http = topo.server(0, shard).unwrap().http;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (code, _) = rt.block_on(bex_process::http::get(http, "/health")).unwrap();
        assert_eq!(code, 200, "shard {shard} serves while held");
    }
    assert!(child.try_wait().unwrap().is_none(), "still holding");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = exited(&mut child);
    assert_eq!(status.code(), Some(0), "a signal is how a held run ends");
    let rep = r.report();
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(rep["servers"].as_array().unwrap().len(), 2);
    for s in rep["servers"].as_array().unwrap() {
        assert_eq!(s["status"]["exit_code"], 0, "drained and checkpointed: {s:#}");
    }
}

#[test]
fn sigterm_mid_run_tears_everything_down() {
    let r = setup("sigterm", 2, 2);
    let mut cmd = r.cmd(
        4,
        &[
            "launch.phases=[\"inference+training\"]",
            "launch.trainers=1",
            "launch.ranker_args=[\"--hang\"]",
            "launch.trainer_args=[\"--hang\"]",
        ],
    );
    let mut child =
        Guard::spawn(cmd.stdout(Stdio::null()).stderr(Stdio::null()), "bex-cluster").unwrap();
    let launcher = child.id();
    // Wait until the 4 servers and both clients were started.
    let pids = wait_recorded(launcher, 6);
    assert_eq!(pids.len(), 6, "servers and clients started");
    pause(300);
    assert!(pids.iter().all(|p| alive(*p)));
    // Each in a process group of its own: a terminal's Ctrl-C reaches the launcher alone.
    let group = |pid: u64| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(2).unwrap().parse::<u64>().unwrap()
    };
    for p in &pids {
        assert_eq!(group(*p), *p, "pid {p} leads its own process group");
    }
    Command::new("kill").args(["-TERM", &launcher.to_string()]).status().unwrap();
    let status = exited(&mut child);
    assert_eq!(status.code(), Some(143), "128 + SIGTERM");
    for p in &pids {
        assert!(!alive(*p), "pid {p} survived the launcher");
    }
    let rep = r.report();
    assert_eq!(rep["ok"], false);
    assert!(rep["reasons"].to_string().contains("interrupted by SIGTERM"), "{rep:#}");
    // The clients got SIGTERM and wrote their reports (the contract), which are embedded.
    let clients = rep["phases"][0]["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 2, "a ranker and a trainer: {rep:#}");
    for c in clients {
        assert_eq!(c["report"]["stopped"], true, "{c:#}");
    }
    assert!(!record_of(launcher).exists());
}

// A hung server (stopped, so its /health and /metrics never answer) and a SIGTERM: the
// teardown's probes give up at once instead of seconds each, so the launcher is gone about
// when the hung server's stop grace (10 s, then SIGKILL) ends. Before: three probes of
// 2 s each (the phase's last scrape, its health check, the whole-run scrape) came first.
#[test]
fn a_sigterm_teardown_waits_on_a_hung_server_only_for_its_stop_grace() {
    let r = setup("hung", 1, 2);
    let (mut child, launcher, pids) = r.start_hanging_ranker(11);
    // Lines of "PID START_TIME NAME"; servers are named ps-p<pod>-s<shard>.
    let record = std::fs::read_to_string(record_of(launcher)).unwrap();
    let server = record
        .lines()
        .find(|l| l.ends_with(" ps-p0-s0"))
        .and_then(|l| l.split_whitespace().next())
        .expect("ps-p0-s0 is recorded")
        .to_string();
    Command::new("kill").args(["-STOP", &server]).status().unwrap();
    let t0 = now();
    Command::new("kill").args(["-TERM", &launcher.to_string()]).status().unwrap();
    let status = exited(&mut child);
    let took = now() - t0;
    assert_eq!(status.code(), Some(143), "128 + SIGTERM");
    // 10 s of stop grace for the hung server, then its SIGKILL; 3 s for the rest.
    assert!(took < Duration::from_secs(13), "the teardown took {took:?}");
    for p in &pids {
        assert!(!alive(*p), "pid {p} survived the launcher");
    }
    let rep = r.report();
    assert!(rep["reasons"].to_string().contains("did not exit cleanly"), "{rep:#}");
}

// `--die-with-parent` (what bex-exp passes): the launcher's parent killed by SIGKILL, the
// launcher gets SIGTERM and tears the whole cluster down, as on a SIGTERM of its own.
#[test]
fn a_launcher_told_to_die_with_its_parent_tears_down_when_the_parent_is_sigkilled() {
    let r = setup("orphan", 1, 1);
    let launch = r.cmd(10, &["launch.phases=[\"inference\"]", "launch.ranker_args=[\"--hang\"]"]);
    // The parent: a shell that starts the launcher in the background, prints its pid, waits.
    let mut parent = Guard::spawn(
        Command::new("sh")
            .arg("-c")
            .arg("\"$@\" --die-with-parent >/dev/null 2>&1 & echo $!; wait")
            .arg("sh")
            .arg(launch.get_program())
            .args(launch.get_args())
            .stdout(Stdio::piped()),
        "sh",
    )
    .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(parent.take_stdout().unwrap()),
        &mut line,
    )
    .unwrap();
    let launcher: u32 = line.trim().parse().unwrap();
    let pids = wait_recorded(launcher, 2);
    assert_eq!(pids.len(), 2, "the server and the ranker started");
    parent.kill().unwrap();
    for _ in 0..600 {
        if !alive(launcher.into()) {
            break;
        }
        pause(50);
    }
    assert!(!alive(launcher.into()), "the launcher outlived its parent by 30 s");
    for p in &pids {
        assert!(!alive(*p), "pid {p} survived the launcher");
    }
    let rep = r.report();
    assert!(rep["reasons"].to_string().contains("interrupted by SIGTERM"), "{rep:#}");
}

fn netns_available() -> bool {
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|u| u.split_whitespace().nth(1))
            == Some("0")
    });
    let ip = Command::new("ip").arg("-V").stdout(Stdio::null()).status().is_ok();
    root && ip
}

#[test]
fn netns_1x2_cluster_with_link_rates_comes_up_and_leaves_no_namespace() {
    if !netns_available() {
        println!("SKIPPED: netns test needs root and iproute2");
        return;
    }
    let r = setup("netns", 1, 2);
    let (out, rep) =
        r.run(5, &["launch.mode=netns", "launch.link_rate=1gbit", "launch.phases=[\"inference\"]"]);
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(rep["ok"], true, "{rep:#}");
    let net = &rep["network"];
    assert_eq!(net["hosts"].as_array().unwrap().len(), 3, "2 servers + 1 ranker");
    assert_eq!(net["link_rate_bit_s"], 1_000_000_000u64);
    let switch = net["switch_ns"].as_str().unwrap();
    let prefix = switch.strip_suffix("sw").unwrap();
    assert!(prefix.starts_with("bex-"));
    // The cluster file names the servers; every host resolved them through its
    // /etc/netns/<ns>/hosts to their namespace addresses.
    let servers = rep["config"]["cluster"]["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 2);
    assert!(servers[1]["rdma"].as_str().unwrap().starts_with("ps-p0-s1:"), "{:#}", servers[1]);
    let hosts = net["hosts"].as_array().unwrap();
    let named = |n: &str| hosts.iter().find(|h| h["name"] == n).unwrap_or_else(|| panic!("{n}"));
    assert!(named("ps-p0-s1")["ip"].as_str().unwrap().starts_with("10.77."));
    for h in hosts {
        let etc = std::path::Path::new("/etc/netns").join(h["ns"].as_str().unwrap());
        assert!(!etc.exists(), "{} left behind", etc.display());
    }
    let c = &rep["phases"][0]["clients"][0];
    assert!(c["ip"].as_str().unwrap().starts_with("10.77."));
    assert_eq!(c["report"]["kind"], "ranker");
    assert!(
        rep["servers"][0]["rnic"]["tx_packets"].is_u64(),
        "metrics scraped inside the namespace"
    );
    assert!(
        bex_launcher::cleanup::namespaces_with(prefix).is_empty(),
        "namespaces left: {:?}",
        bex_launcher::cleanup::namespaces_with(prefix)
    );
}

#[test]
fn cleanup_removes_leftovers_of_dead_launchers() {
    // A dead "launcher": a process that has exited and been reaped.
    let gone = Guard::spawn(&mut Command::new("true"), "true").unwrap();
    let dead = gone.id();
    gone.finish().unwrap();
    // It recorded a child that is still running (guarded: killed should the test fail).
    let mut orphan = Guard::spawn(Command::new("sleep").arg("600"), "sleep").unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", orphan.id())).unwrap();
    let start =
        stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().to_string();
    let dir = bex_launcher::cleanup::state_dir();
    bex_launcher::cleanup::private_dir(&dir).unwrap();
    let record = dir.join(format!("{dead}.pids"));
    std::fs::write(&record, format!("{} {start} ranker-1\n", orphan.id())).unwrap();
    let ns = format!("bex-{dead}-sw");
    let netns = netns_available();
    if netns {
        assert!(Command::new("ip").args(["netns", "add", &ns]).status().unwrap().success());
    } else {
        println!("SKIPPED: the namespace part needs root and iproute2");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_bex-cluster")).arg("cleanup").output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    // (A launcher of a concurrent test may have cleaned up first: the end state is checked.)
    let status = exited(&mut orphan);
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "SIGKILLed");
    assert!(!record.exists());
    if netns {
        assert!(bex_launcher::cleanup::namespaces_with(&ns).is_empty());
    }
}

/// The real `ranker` and `trainer`, when `BEX_BIN_DIR` names a directory with builds of all
/// three binaries (`scripts/test.sh` sets it to `target/release` after its release build);
/// binaries there that do not run fail the test.
#[test]
fn real_clients_when_available() {
    let Ok(dir) = std::env::var("BEX_BIN_DIR") else {
        println!("SKIPPED: set BEX_BIN_DIR to a directory with ps-server, ranker and trainer");
        return;
    };
    let works = |b: &str| {
        Command::new(Path::new(&dir).join(b))
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    for b in ["ps-server", "ranker", "trainer"] {
        assert!(works(b), "{dir}/{b} --help does not run (BEX_BIN_DIR must hold working builds)");
    }
    let r = setup("real", 2, 2);
    // The clients need the shipped tables (user, item, context, dense).
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/local.toml"), &r.config)
        .unwrap();
    let bin = format!("launch.bin_dir={dir}");
    let (out, rep) = r.run(
        6,
        &[
            &bin,
            "launch.phases=[\"inference\", \"training\"]",
            "launch.ranker_args=[\"--seconds\", \"2\"]",
            "launch.trainer_args=[\"--seconds\", \"2\"]",
            "trainer.batch_size=64",
        ],
    );
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(rep["phases"][0]["clients"][0]["report"]["kind"], "ranker");
    let t = &rep["phases"][1]["clients"][0]["report"];
    assert_eq!(t["kind"], "trainer");
    assert!(t["auc_initial"].is_f64() && t["auc_final"].is_f64(), "{t:#}");
}

#[test]
fn sigkilled_launcher_leaves_nothing_after_cleanup() {
    let r = setup("sigkill", 1, 2);
    let (mut child, launcher, pids) = r.start_hanging_ranker(7);
    child.kill().unwrap();
    // Every child dies with the launcher (pdeathsig → SIGTERM: servers checkpoint and exit),
    // the fake ranker too: a shell script, which sets no death signal of its own (the launcher
    // sets it before exec).
    for _ in 0..300 {
        if !pids.iter().any(|p| alive(*p)) {
            break;
        }
        pause(50);
    }
    for p in &pids {
        assert!(!alive(*p), "child {p} outlived its SIGKILLed launcher");
    }
    // `cleanup` removes the dead launcher's record. (A launcher of a concurrent test may
    // clean it up first: the end state is what counts.)
    let out = Command::new(env!("CARGO_BIN_EXE_bex-cluster")).arg("cleanup").output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(!record_of(launcher).exists());
}

#[test]
fn a_server_that_cannot_start_fails_the_run_with_its_stderr() {
    let r = setup("startfail", 1, 2);
    // Server (0, 1)'s HTTP port is taken: it exits at start-up.
    let taken = std::net::TcpListener::bind(("127.0.0.1", base_port(8) + 5)).unwrap();
    let (out, rep) = r.run(8, &["launch.phases=[\"inference\"]"]);
    drop(taken);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let reasons = rep["reasons"].to_string();
    assert!(reasons.contains("ps-p0-s1"), "{reasons}");
    assert!(reasons.contains("stderr tail"), "{reasons}");
    assert!(rep["phases"].as_array().unwrap().is_empty(), "no phase ran");
    assert_eq!(rep["servers"].as_array().unwrap().len(), 2);
    for s in rep["servers"].as_array().unwrap() {
        assert!(!alive(s["pid"].as_u64().unwrap()));
    }
}
