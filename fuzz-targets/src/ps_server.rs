//! A `PsServer`'s RPC handler, in process, fed a sequence of arbitrary (method, frame) pairs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use bemalloc::Pool;
use bex_ps_core::dedupe::DedupeConfig;
use bex_ps_core::TableSet;
use bex_ps_proto::wire::{self, flags, DataHeader, Limits, Op, Status};
use bex_ps_server::server::{Handler, PsServer, ServerParts};
use bex_rnic::soft::{Fabric, LinkModel, NicConfig};
use bex_rnic::Device;
use bex_rpc::Handler as _;
use bex_transport::Msg;

use crate::ps_wire::{local_config, local_specs};

/// Most frames one input is split into.
const MAX_FRAMES: usize = 8;
/// Rows whose values are pinned before the input and checked during and after it:
/// (table, key). Tables 0 (`user`, dim 16) and 2 (`context`, dim 8) of `configs/local.toml`.
const CANARIES: [(u32, u64); 6] =
    [(0, 1), (0, 2), (0, 1 << 40), (0, u64::MAX), (2, 1), (2, 0xdead_beef)];
/// The client id of the canary setup's replication.
const SETUP_CLIENT: u64 = 0xfeed_f00d;
/// The server's limits: a small frame limit, so replies over it are reachable.
const LIMITS: Limits = Limits { max_frame_bytes: 16 << 10, max_keys: 1 << 20, max_dim: 4096 };

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        // A simulated device: registration without sockets or threads.
        let fabric = Fabric::new(1, LinkModel::default());
        let dev = fabric.add_device(NicConfig::default());
        let pd = dev.alloc_pd().expect("a simulated device allocates a PD");
        Pool::new(vec![Arc::new(dev.registrar(&pd))]).expect("a pool on a simulated device").leak()
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime")
    })
}

/// A method with this bit set asks for its frame's lengths to be repaired (see [`repair`]);
/// the handler gets the method without it.
pub const REPAIR: u16 = 0x8000;

/// Makes a request frame's lengths consistent, so large well-formed requests are reachable
/// by mutation: `count` becomes what the body holds for the op and `dim` (the body is cut to
/// it) and `body_len` the body's length. Other fields stay as they are.
pub fn repair(frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    if f.len() < wire::REQUEST_HEADER_LEN {
        return f;
    }
    let body = f.len() - wire::REQUEST_HEADER_LEN;
    let dim = u32::from_le_bytes([f[12], f[13], f[14], f[15]]) as usize;
    let per_key = match Op::from_u8(f[5]) {
        Some(Op::Fetch) => Some(8),
        Some(Op::Push | Op::Replicate) if (1..=4096).contains(&dim) => Some(8 + 4 * dim),
        _ => None,
    };
    if let Some(per_key) = per_key {
        let count = body / per_key;
        f.truncate(wire::REQUEST_HEADER_LEN + count * per_key);
        f[16..20].copy_from_slice(&(count as u32).to_le_bytes());
    }
    let body_len = (f.len() - wire::REQUEST_HEADER_LEN) as u32;
    f[20..24].copy_from_slice(&body_len.to_le_bytes());
    f
}

/// Splits an input into at most `MAX_FRAMES` (method, frame) pairs: each is `method u16
/// LE | len u16 LE | len bytes` (cut short by the end of the input).
pub fn split_frames(mut data: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while data.len() >= 4 && out.len() < MAX_FRAMES {
        let method = u16::from_le_bytes([data[0], data[1]]);
        let len = usize::from(u16::from_le_bytes([data[2], data[3]])).min(data.len() - 4);
        out.push((method, &data[4..4 + len]));
        data = &data[4 + len..];
    }
    out
}

/// The inverse of [`split_frames`] (frames longer than 65535 bytes are cut).
pub fn encode_frames(frames: &[(u16, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (method, f) in frames {
        let f = &f[..f.len().min(usize::from(u16::MAX))];
        out.extend_from_slice(&method.to_le_bytes());
        out.extend_from_slice(&(f.len() as u16).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

/// Pod 0 of `configs/local.toml` trains, pod 1 is a replica.
fn server(pod: u32) -> Arc<PsServer> {
    let cfg = local_config();
    let topo = cfg.topology().expect("configs/local.toml has a topology");
    let tables = TableSet::new(local_specs()).expect("the local tables are valid");
    PsServer::new(
        ServerParts {
            pod,
            shard: 0,
            tables,
            limits: LIMITS,
            dedupe: DedupeConfig { window: 64, max_clients: 16 },
            pool: pool(),
            // Under a file: checkpoints fail (an Internal reply) instead of writing to disk.
            checkpoint_path: PathBuf::from("/dev/null/bex-fuzz/shard.ckpt"),
            update_seq: 0,
            dedupe_windows: Vec::new(),
            replication_id: 1,
            push_clock: bex_ps_server::server::PushClock::new(|| 1),
            push_ack: bex_ps_proto::config::PushAck::Applied,
            push_ack_timeout: std::time::Duration::from_millis(100),
        },
        &topo,
        None,
        1,
    )
}

async fn call(h: &Handler, method: u16, frame: &[u8]) -> Vec<u8> {
    let msg = Msg::copy_from(pool(), frame).expect("the pool allocates a request");
    let reply = h.handle(method, msg).await.expect("the handler answers every frame");
    let b = reply.as_slice();
    assert!(b.len() >= bex_rpc::HEADER_LEN, "a reply leaves room for the RPC header");
    b[bex_rpc::HEADER_LEN..].to_vec()
}

fn canary_keys(table: u32) -> Vec<u64> {
    CANARIES.iter().filter(|c| c.0 == table).map(|c| c.1).collect()
}

fn dim_of(table: u32) -> u32 {
    local_specs()[table as usize].dim
}

/// f32 words of a whole row of `table` in a Replicate (see `wire::flags::STATE`).
fn state_width(table: u32) -> usize {
    local_specs()[table as usize].stride() + bex_ps_proto::spec::STATE_EXTRA_WORDS
}

/// Fetches the canaries of `table` with a valid request; their rows as bytes.
async fn fetch_canaries(h: &Handler, table: u32) -> Vec<Vec<u8>> {
    let keys = canary_keys(table);
    let dim = dim_of(table);
    let dh = DataHeader { table, dim, client: 1, seq: 1, flags: 0 };
    let mut f = vec![0u8; wire::fetch_request_len(keys.len())];
    wire::encode_fetch_into(&mut f, &dh, &keys).expect("a canary fetch encodes");
    let r = call(h, Op::Fetch as u16, &f).await;
    let v = wire::decode_response(&r, &LIMITS).expect("a fetch reply decodes");
    assert_eq!(v.header.status, Status::Ok, "a valid fetch succeeds: {}", v.message());
    let row = 4 * dim as usize;
    v.rows().as_bytes().chunks(row).map(<[u8]>::to_vec).collect()
}

/// The setup client's `op` on `keys` of `table`: a Push of gradients, or a Replicate of
/// whole rows (`width` values each); it must succeed.
async fn setup_update(h: &Handler, op: Op, table: u32, width: usize, keys: &[u64], values: &[f32]) {
    let whole_rows = op == Op::Replicate;
    let flags = if whole_rows { flags::STATE } else { 0 };
    let dh =
        DataHeader { table, dim: width as u32, client: SETUP_CLIENT, seq: table.into(), flags };
    let mut f = vec![0u8; wire::push_request_len(keys.len(), width)];
    let encoded = if whole_rows {
        wire::encode_replicate_into(&mut f, &dh, keys, values)
    } else {
        wire::encode_push_into(&mut f, &dh, keys, values)
    };
    encoded.expect("the setup's canary updates encode");
    let r = call(h, op as u16, &f).await;
    let v = wire::decode_response(&r, &LIMITS).expect("a setup reply decodes");
    assert_eq!(v.header.status, Status::Ok, "the setup's {op:?} succeeds: {}", v.message());
}

/// What each canary must read: its bytes, or `None` once a successful push changed it.
type Expected = HashMap<(u32, u64), Option<Vec<u8>>>;

/// For a training-pod and a replica server (fresh, tables of `configs/local.toml`): canary
/// rows pushed once (training pod: so they differ from initial rows, which read alike stored
/// or not) or replicated (replica) and read back, then every frame of `data` (see [`split_frames`];
/// [`repair`]ed if its method has [`REPAIR`]) handed to the handler. Every frame must get a ps-core response that decodes; a frame that does not
/// decode, or whose op differs from the method, must get the decoder's error status; a Fetch
/// reply must fit the server's frame limit; the canaries must read the same rows during and
/// after the sequence unless a successful Push or Replicate named them (then a replicated row
/// must read the replicated values).
pub fn ps_server(data: &[u8]) {
    let frames = split_frames(data);
    for pod in [0, 1] {
        runtime().block_on(run(pod, &frames));
    }
}

async fn run(pod: u32, frames: &[(u16, &[u8])]) {
    let h = Handler(server(pod));
    let mut expected = Expected::new();
    for table in [0u32, 2] {
        let keys = canary_keys(table);
        let dim = dim_of(table);
        if pod == 0 {
            // The training pod takes no Replicate: its canaries are pushed once, so they read
            // other than their initial rows (a lost or reset row then shows; initial rows
            // read alike whether stored or not).
            let initial = fetch_canaries(&h, table).await;
            let grads = vec![0.25f32; keys.len() * dim as usize];
            setup_update(&h, Op::Push, table, dim as usize, &keys, &grads).await;
            let pushed = fetch_canaries(&h, table).await;
            for (i, (k, row)) in keys.iter().zip(pushed).enumerate() {
                assert_ne!(row, initial[i], "the push changed canary ({table}, {k})");
                expected.insert((table, *k), Some(row));
            }
            continue;
        }
        // Whole rows: values, zeroed optimizer state, no steps, version 1 (above no row's).
        let (dim, width) = (dim as usize, state_width(table));
        let mut rows = vec![0f32; keys.len() * width];
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            for (j, v) in row[..dim].iter_mut().enumerate() {
                *v = 0.5 - (i * dim + j) as f32 * 0.01;
            }
            row[width - 2] = f32::from_bits(1);
        }
        setup_update(&h, Op::Replicate, table, width, &keys, &rows).await;
        let got = fetch_canaries(&h, table).await;
        for (i, (k, row)) in keys.iter().zip(got).enumerate() {
            let want: Vec<u8> =
                rows[i * width..i * width + dim].iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(row, want, "a replicated row reads back");
            expected.insert((table, *k), Some(row));
        }
    }

    for &(method, frame) in frames {
        let repaired;
        let (method, frame) = if method & REPAIR != 0 {
            repaired = repair(frame);
            (method & !REPAIR, &repaired[..])
        } else {
            (method, frame)
        };
        let r = call(&h, method, frame).await;
        let v = wire::decode_response(&r, &Limits::default())
            .unwrap_or_else(|e| panic!("the reply to method {method} does not decode: {e}"));
        let status = v.header.status;
        let Some(op) = u8::try_from(method).ok().and_then(Op::from_u8) else {
            assert_eq!(status, Status::UnknownOp);
            continue;
        };
        assert_eq!(v.header.op, Some(op), "the reply echoes the op");
        let req = match wire::decode_request(frame, &LIMITS) {
            Ok(req) if req.header.op == op => req,
            Ok(_) => {
                assert_eq!(status, Status::BadFrame, "an op other than the method's");
                continue;
            }
            Err(e) => {
                assert_eq!(status, e.status(), "a frame that does not decode: {e}");
                continue;
            }
        };
        let hd = req.header;
        match (op, status) {
            (Op::Fetch, Status::Ok) => {
                assert!(r.len() <= LIMITS.max_frame_bytes, "a {}-byte fetch reply", r.len());
                assert_eq!((v.header.count, v.header.dim), (hd.count, hd.dim));
                let row = 4 * hd.dim as usize;
                for (i, k) in req.keys.iter().enumerate() {
                    if let Some(Some(want)) = expected.get(&(hd.table, k)) {
                        let got = &v.body[i * row..(i + 1) * row];
                        assert_eq!(got, &want[..], "canary ({}, {k}) changed", hd.table);
                    }
                }
            }
            (Op::Push, Status::Ok) => {
                assert_eq!(pod, 0, "only the training pod applies pushes");
                for k in req.keys.iter() {
                    if let Some(e) = expected.get_mut(&(hd.table, k)) {
                        *e = None;
                    }
                }
            }
            (Op::Replicate, Status::Ok) => {
                assert_eq!(pod, 1, "only replicas take Replicate");
                // A whole row applies only over an older version: the model does not follow
                // versions, so the rows it names become unknown.
                for k in req.keys.iter() {
                    if let Some(e) = expected.get_mut(&(hd.table, k)) {
                        *e = None;
                    }
                }
            }
            _ => {}
        }
    }

    for table in [0u32, 2] {
        for (k, row) in canary_keys(table).iter().zip(fetch_canaries(&h, table).await) {
            if let Some(Some(want)) = expected.get(&(table, *k)) {
                assert_eq!(&row, want, "canary ({table}, {k}) changed by the input");
            }
        }
    }
}
