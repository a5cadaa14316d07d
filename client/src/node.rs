//! What every bex process needs to talk, from the cluster config: the NIC it names and the
//! transports on it ([`bex_transport::Stack`]), and RPC clients.

use std::net::IpAddr;
use std::time::Duration;

use bex_ps_proto::config::{NicKind, RpcConfig, TransportConfig};
use bex_rpc::ClientConfig;
use bex_transport::{Config, Mtu, NicSpec, SoftNic, VerbsNic};

/// The NIC to open: `BEX_NIC` if set (`soft[:UDP_PORT]` or
/// `verbs[:DEVICE[:PORT[:GID_INDEX]]]`: a container image's deployment picks the NIC without
/// another cluster file), else the one `[transport]` names.
pub fn nic_spec(t: &TransportConfig) -> Result<NicSpec, SetupError> {
    match std::env::var("BEX_NIC") {
        Ok(v) if !v.is_empty() => {
            v.parse().map_err(|e| SetupError::config(format!("BEX_NIC={v:?}: {e}")))
        }
        _ => Ok(nic_of(t)),
    }
}

/// The NIC `[transport]` names.
fn nic_of(t: &TransportConfig) -> NicSpec {
    match t.nic {
        NicKind::Soft => NicSpec::Soft(SoftNic { udp_port: t.udp_port, ..SoftNic::default() }),
        NicKind::Verbs => NicSpec::Verbs(VerbsNic {
            device: (!t.device.is_empty()).then(|| t.device.clone()),
            port: t.port,
            gid_index: u8::try_from(t.gid_index).ok(),
        }),
    }
}

/// Writes `spec` into `[transport]` (the inverse of reading `[transport]` in [`nic_spec`]).
pub fn set_nic(t: &mut TransportConfig, spec: &NicSpec) {
    match spec {
        NicSpec::Soft(s) => {
            t.nic = NicKind::Soft;
            t.udp_port = s.udp_port;
        }
        NicSpec::Verbs(v) => {
            t.nic = NicKind::Verbs;
            t.device = v.device.clone().unwrap_or_default();
            t.port = v.port;
            t.gid_index = v.gid_index.map_or(-1, i16::from);
        }
    }
}

/// Maps the cluster's transport section (and the cluster secret) to the transport's config.
/// A message may be as large as a PS frame and its RPC header, no larger: the transport's
/// own bound (1 GiB) let a peer make this process allocate that much for one message it
/// announced, frame header or RTS, before the PS decoder refused the frame.
pub fn transport_config(cfg: &bex_ps_proto::Config, secret: &[u8]) -> Config {
    let t = &cfg.transport;
    let frame = (cfg.server.max_request_bytes + bex_rpc::HEADER_LEN) as u64;
    Config {
        endpoints: t.endpoints,
        sq_depth: t.sq_depth,
        rq_depth: t.rq_depth,
        cq_depth: t.cq_depth,
        eager_max: t.eager_max,
        fragment_bytes: t.fragment_bytes,
        grant_max_bytes: t.grant_max_bytes,
        cwnd_bytes: (t.cwnd_bytes > 0).then_some(t.cwnd_bytes),
        path_mtu: Mtu::from_bytes(t.path_mtu).unwrap_or(Mtu::Mtu4096),
        keepalive_interval: Duration::from_millis(t.keepalive_interval_ms),
        keepalive_timeout: Duration::from_millis(t.keepalive_timeout_ms),
        tcp_keepalive_interval: Duration::from_millis(t.tcp_keepalive_interval_ms),
        tcp_keepalive_timeout: Duration::from_millis(t.tcp_keepalive_timeout_ms),
        connect_timeout: Duration::from_millis(t.connect_timeout_ms),
        spin: Duration::from_micros(t.spin_us),
        max_queued_sends: t.max_queued_sends,
        qp_port: t.port,
        secret: secret.to_vec(),
        // A grant is never larger than a message.
        max_message_bytes: frame.max(t.grant_max_bytes as u64),
        ..Config::default()
    }
}

/// What a client process does, which decides its request deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientRole {
    /// Serves inference (rankers, readers): `[rpc] request_timeout_ms`, the paper's Tr.
    Serving,
    /// Trains (trainers, canaries): `[rpc] training_request_timeout_ms`.
    Training,
}

/// Maps the cluster's RPC section to the client's config.
pub fn client_config(r: &RpcConfig, local_pod: u32, seed: u64, role: ClientRole) -> ClientConfig {
    let deadline_ms = match role {
        ClientRole::Serving => r.request_timeout_ms,
        ClientRole::Training => r.training_request_timeout_ms,
    };
    ClientConfig {
        connect_timeout: Duration::from_millis(r.connect_timeout_ms),
        request_timeout: Duration::from_millis(deadline_ms),
        retry_probability: r.retry_probability,
        max_retries: r.max_attempts.saturating_sub(1),
        quarantine_connection_failures: r.quarantine_connect_failures as usize,
        quarantine_request_failures: r.quarantine_request_failures as usize,
        quarantine_window: Duration::from_secs(r.quarantine_window_s),
        reprobe_interval: Duration::from_secs(r.rdma_reprobe_s.max(1)),
        quarantine_probe_interval: Duration::from_secs(r.quarantine_s.max(1)),
        // Without the fallback a destination's RDMA failures only ever fail its calls.
        rdma_failures_before_fallback: if r.tcp_fallback {
            ClientConfig::default().rdma_failures_before_fallback
        } else {
            u32::MAX
        },
        local_pod: if r.prefer_local_pod { local_pod } else { u32::MAX },
        seed,
        bulk_lane_bytes: r.bulk_lane_bytes,
    }
}

/// The shared secret: `BEX_SECRET` from the environment, or one derived from the cluster's
/// name, for loopback only (or with `[cluster] allow_insecure = true`): the name is in the
/// config file, so off loopback anyone who can read the config could join. `bind` is the
/// address this process binds.
pub fn cluster_secret(cfg: &bex_ps_proto::Config, bind: IpAddr) -> Result<Vec<u8>, String> {
    secret_from(
        std::env::var("BEX_SECRET").ok(),
        &cfg.cluster.name,
        bind,
        cfg.cluster.allow_insecure,
    )
}

/// [`cluster_secret`]'s decision, with the environment's value passed in.
fn secret_from(
    env: Option<String>,
    cluster_name: &str,
    bind: IpAddr,
    allow_insecure: bool,
) -> Result<Vec<u8>, String> {
    match env.filter(|s| !s.is_empty()) {
        Some(s) => Ok(s.into_bytes()),
        None if bind.is_loopback() || allow_insecure => {
            Ok(format!("bex-cluster:{cluster_name}").into_bytes())
        }
        None => Err(format!(
            "BEX_SECRET is not set and this process binds {bind}, not loopback: the default \
             secret comes from the cluster name, which anyone who can read the config knows. \
             Give every process of the cluster the same secret, for example \
             `export BEX_SECRET=$(head -c 32 /dev/urandom | base64)`, or set \
             `[cluster] allow_insecure = true` to accept the risk"
        )),
    }
}

/// Why a process could not set up its side of the cluster: what failed, and the exit status
/// to report it with (2 for configuration, such as a NIC that does not exist; 1 otherwise).
#[derive(Debug)]
pub struct SetupError {
    /// What failed and why.
    pub message: String,
    /// The process's exit status for it.
    pub exit_code: u8,
}

impl SetupError {
    /// `what: cause`, a runtime failure (exit 1).
    pub fn new(what: &str, cause: impl std::fmt::Display) -> SetupError {
        SetupError { message: format!("{what}: {cause}"), exit_code: 1 }
    }

    /// A configuration problem (exit 2).
    pub fn config(message: impl Into<String>) -> SetupError {
        SetupError { message: message.into(), exit_code: 2 }
    }
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SetupError {}

impl From<bex_transport::StackError> for SetupError {
    fn from(e: bex_transport::StackError) -> SetupError {
        SetupError { message: e.to_string(), exit_code: e.exit_code() }
    }
}

#[cfg(test)]
mod tests {
    use super::secret_from;

    #[test]
    fn no_default_secret_off_loopback() {
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let lan: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        let set = || Some("s3cret".to_string());
        assert_eq!(secret_from(set(), "c", lan, false).unwrap(), b"s3cret");
        assert_eq!(secret_from(None, "c", lo, false).unwrap(), b"bex-cluster:c");
        assert_eq!(secret_from(Some(String::new()), "c", lo, false).unwrap(), b"bex-cluster:c");
        let e = secret_from(None, "c", lan, false).unwrap_err();
        assert!(e.contains("BEX_SECRET") && e.contains("allow_insecure"), "{e}");
        assert!(secret_from(Some(String::new()), "c", lan, false).is_err(), "empty is unset");
        assert_eq!(secret_from(None, "c", lan, true).unwrap(), b"bex-cluster:c");
    }

    use super::*;

    // A message is bounded by the PS frame limit (and its RPC header), not the transport's
    // 1 GiB default, and every valid cluster file gives a valid transport config.
    #[test]
    fn a_message_is_bounded_by_the_ps_frame_limit() {
        for max_request_bytes in [4096, 1 << 20, 64 << 20] {
            let text = format!(
                "[cluster]\npods = 1\nshards = 1\n[server]\nmax_request_bytes = {max_request_bytes}\n\
                 [[tables]]\nname = \"t\"\ndim = 4\n"
            );
            let cfg = bex_ps_proto::Config::from_toml_str(&text).unwrap();
            let t = transport_config(&cfg, b"s");
            let frame = (max_request_bytes + bex_rpc::HEADER_LEN) as u64;
            assert_eq!(t.max_message_bytes, frame.max(cfg.transport.grant_max_bytes as u64));
            t.validate().unwrap_or_else(|e| panic!("{max_request_bytes}: {e}"));
        }
    }

    #[test]
    fn nic_specs_round_trip_through_the_config() {
        for text in ["soft:4791", "soft:0", "verbs::1", "verbs:mlx5_0:2:3"] {
            let spec: NicSpec = text.parse().unwrap();
            let mut t = TransportConfig::default();
            set_nic(&mut t, &spec);
            assert_eq!(nic_of(&t), spec, "{text}");
        }
        assert_eq!(nic_of(&TransportConfig::default()), NicSpec::default());
    }

    #[test]
    fn every_rpc_setting_reaches_the_client() {
        // Every field off its default, so a setting that is dropped shows.
        let d = RpcConfig::default();
        let mut r = RpcConfig {
            connect_timeout_ms: d.connect_timeout_ms + 11,
            request_timeout_ms: d.request_timeout_ms + 13,
            training_request_timeout_ms: d.training_request_timeout_ms + 17,
            retry_probability: d.retry_probability / 2.0 + 0.01,
            max_attempts: d.max_attempts + 2,
            quarantine_connect_failures: d.quarantine_connect_failures + 1,
            quarantine_request_failures: d.quarantine_request_failures + 2,
            quarantine_window_s: d.quarantine_window_s + 5,
            quarantine_s: 7,
            rdma_reprobe_s: 3,
            bulk_lane_bytes: d.bulk_lane_bytes + 4096,
            ..d
        };
        assert_ne!((r.quarantine_s, r.rdma_reprobe_s), (d.quarantine_s, d.rdma_reprobe_s));
        let c = client_config(&r, 1, 9, ClientRole::Serving);
        assert_eq!(c.connect_timeout, Duration::from_millis(r.connect_timeout_ms));
        assert_eq!(c.retry_probability, r.retry_probability);
        assert_eq!(c.max_retries, r.max_attempts - 1);
        assert_eq!(c.quarantine_connection_failures, r.quarantine_connect_failures as usize);
        assert_eq!(c.quarantine_request_failures, r.quarantine_request_failures as usize);
        assert_eq!(c.quarantine_window, Duration::from_secs(r.quarantine_window_s));
        assert_eq!(c.bulk_lane_bytes, r.bulk_lane_bytes);
        assert_eq!(c.request_timeout, Duration::from_millis(r.request_timeout_ms));
        let t = client_config(&r, 1, 9, ClientRole::Training);
        assert_eq!(t.request_timeout, Duration::from_millis(r.training_request_timeout_ms));
        // The launcher's deadline check reads the config's formula; the client enforces its own.
        for (cfg, tr) in [(&c, r.request_timeout_ms), (&t, r.training_request_timeout_ms)] {
            assert_eq!(cfg.call_deadline(), Duration::from_millis(r.call_deadline_ms(tr)));
        }
        assert_eq!(c.quarantine_probe_interval, Duration::from_secs(7));
        assert_eq!(c.reprobe_interval, Duration::from_secs(3));
        // With the fallback on, a destination moves to TCP after the client's default number
        // of RDMA failures.
        let default = ClientConfig::default().rdma_failures_before_fallback;
        assert!(default < u32::MAX);
        assert_eq!(c.rdma_failures_before_fallback, default);
        assert_eq!((c.local_pod, c.seed), (1, 9));
        r.tcp_fallback = false;
        r.prefer_local_pod = false;
        let c = client_config(&r, 1, 9, ClientRole::Serving);
        assert_eq!(c.rdma_failures_before_fallback, u32::MAX, "never falls back");
        assert_eq!(c.local_pod, u32::MAX, "no pod preferred");
    }
}
