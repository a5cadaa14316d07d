//! `bex-rows`: the rows of some keys of a running cluster, as the Rust client fetches them,
//! one JSON line per key (`{"key":K,"row":[...]}`; every float printed so that it parses
//! back to the same bits). For operators looking at a row, and for the Python binding's
//! tests, which check that `bex.Client.fetch` sees the same bits.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use bex_client::{connect_client, ClientRole};
use bex_ps_proto::config::TransportKind;
use bex_ps_proto::Config;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "bex-rows", version, about)]
struct Cli {
    /// The cluster file (for a `bex-cluster run`: OUT/cluster.toml); BEX_SECRET as for
    /// any client.
    #[arg(long, env = "BEX_CONFIG")]
    config: PathBuf,
    /// The table, by name.
    #[arg(long)]
    table: String,
    /// Keys to fetch, comma-separated (u64; duplicates allowed).
    #[arg(long, value_delimiter = ',', required = true)]
    keys: Vec<u64>,
    /// The mini-pod read first (default: 1 when there are several, else 0).
    #[arg(long)]
    pod: Option<u32>,
    /// rdma (TCP fallback per destination) or tcp.
    #[arg(long, value_enum, default_value_t = TransportKind::Rdma)]
    transport: TransportKind,
    /// The address this client binds (default: the cluster file's host).
    #[arg(long)]
    bind: Option<IpAddr>,
}

fn main() -> ExitCode {
    bex_process::logging::init();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bex-rows: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> Result<(), String> {
    let cfg = Config::load(&cli.config).map_err(|e| e.to_string())?;
    let (id, table) = cfg
        .tables
        .iter()
        .enumerate()
        .find(|(_, t)| t.name == cli.table)
        .ok_or_else(|| format!("no table {:?} in {}", cli.table, cli.config.display()))?;
    let dim = table.dim;
    let kind = cli.transport;
    let pod = cli.pod.unwrap_or(if cfg.cluster.pods > 1 { 1 } else { 0 });
    let bind = cli.bind.unwrap_or(cfg.cluster.host);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let rows = rt.block_on(async {
        let client_id = bex_process::identity::default_client_id();
        let node = connect_client(&cfg, pod, bind, kind, client_id, ClientRole::Serving)
            .await
            .map_err(|e| e.to_string())?;
        node.ps.fetch(id as u32, dim, &cli.keys).await.map_err(|e| e.to_string())
    })?;
    for (key, row) in cli.keys.iter().zip(rows.chunks(dim as usize)) {
        // serde_json prints the shortest decimal that parses back to the same f32.
        let line = serde_json::json!({ "key": key, "row": row });
        println!("{line}");
    }
    Ok(())
}
