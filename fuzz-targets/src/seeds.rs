//! Valid encodings per target: the seed corpora of the cargo-fuzz targets and the bases the
//! smoke test mutates.

use bex_ps_core::checkpoint::snapshot_chunk;
use bex_ps_core::TableSet;
use bex_ps_proto::control::{
    AdminRequest, CheckpointRequest, SnapshotCursor, SnapshotRequest, TablesInfo,
};
use bex_ps_proto::wire::{self, flags, DataHeader, Op, Status};
use bex_rnic::soft::packet::{self, Aeth, Header, Opcode, Reth, Syndrome};
use bex_transport::proto::{self, Kind};
use bex_transport::tcp::wire::{Frame, Hello, Role, NONCE_LEN};

use crate::ps_wire::{local_config, local_specs};

/// The seeds of target `name` (one of [`crate::TARGETS`]); empty for an unknown name.
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    match name {
        "roce_packet" => roce(),
        "transport_frame" => transport(),
        "rpc_frame" => rpc(),
        "rpc_replies" => rpc_scripts(),
        "ps_wire" => ps_requests().into_iter().map(|(_, f)| f).chain(ps_other()).collect(),
        "ps_server" => server(),
        "config" => config(),
        _ => Vec::new(),
    }
}

fn roce() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (i, op) in Opcode::ALL.into_iter().enumerate() {
        let mut h = Header::new(op, 0x12_3456, 0xff_fff0 + i as u32);
        h.solicited = i % 2 == 0;
        h.ack_req = i % 3 == 0;
        if op.has_reth() {
            h.reth = Some(Reth { va: 0x7f00_0000_1000, rkey: 0xabcd, dma_len: 9000 });
        }
        if op.has_imm() {
            h.imm = Some(0xcafe_0000 | i as u32);
        }
        let payload: Vec<u8> = if op == Opcode::Acknowledge {
            h.aeth = Some(Aeth { syndrome: Syndrome::RnrNak(7), msn: 42 });
            Vec::new()
        } else {
            (0..(i * 7) % 23).map(|b| b as u8).collect()
        };
        out.push(packet::encode(&h, &payload, &crate::roce::ROUTE));
    }
    for s in [Syndrome::Ack, Syndrome::NakSequence, Syndrome::NakRemoteAccess] {
        let mut h = Header::new(Opcode::Acknowledge, 7, 100);
        h.aeth = Some(Aeth { syndrome: s, msn: 3 });
        out.push(packet::encode(&h, &[], &crate::roce::ROUTE));
    }
    out
}

fn transport() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (i, kind) in
        [Kind::Data, Kind::Rts, Kind::Cts, Kind::Open, Kind::Keepalive].into_iter().enumerate()
    {
        let h = proto::Header {
            kind,
            credits: i as u16,
            dst_socket: 1,
            src_socket: 2,
            msg_id: 3 + i as u32,
            len: 1 << (10 + i),
            aux: 0x7f00_1234,
            aux32: 0xabcd,
            slot: i as u32,
            // Data, RTS and CTS carry standing grants.
            grant: (i < 3).then_some(proto::RemoteTarget {
                addr: 0x7f00_8000,
                rkey: 0x99,
                slot: 40 + i as u32,
                len: 1 << 17,
            }),
        };
        let mut b = vec![0u8; proto::HEADER_LEN + 8];
        h.encode(&mut b);
        out.push(b);
    }
    out.push(bex_transport::rdma::sample_hello().to_vec());
    let mut prefix = [0u8; proto::GRANT_PREFIX_LEN];
    let offer = proto::RemoteTarget { addr: 0x7f00_9000, rkey: 0x42, slot: 3, len: 1 << 16 };
    proto::encode_grant_prefix(1 << 20, Some(offer), &mut prefix);
    out.push(prefix.to_vec());
    out.push(Frame::Data(4096).encode().to_vec());
    let mut f = Frame::Data(100).encode().to_vec();
    f.extend_from_slice(&1000u64.to_le_bytes());
    out.push(f);
    out.push(Frame::Close.encode().to_vec());
    let hi =
        Hello { nonce: [1; NONCE_LEN], listen: "127.0.0.1:17001".parse().expect("addr") }.encode();
    let ha = Hello { nonce: [2; NONCE_LEN], listen: "[::1]:9".parse().expect("addr") }.encode();
    out.push(hi.to_vec());
    let mut both = [hi, ha].concat();
    both.extend_from_slice(&bex_transport::tcp::wire::proof(b"secret", Role::Initiator, &hi, &ha));
    both.extend_from_slice(b"secret");
    out.push(both);
    out
}

fn rpc() -> Vec<Vec<u8>> {
    use bex_rpc::frame::{Header, Kind, ReplyTarget};
    let target = ReplyTarget { addr: 0x7f00_0000_1000, rkey: 0x1234, slot: 7, capacity: 4096 };
    let placed = Header { target: Some(target), ..Header::request(1, 0x1234_5678) };
    [
        Header::request(1, 0x1234_5678),
        placed,
        Header::reply(Kind::Response, 6, 0, 0x1234_5678, 4),
        Header::reply(Kind::Error, 2, 5, 0x1234_5678, 4),
        Header::reply(Kind::Placed, 6, 0, 0x1234_5678, 4),
        Header::reply(Kind::Elsewhere, 6, 0, 0x1234_5678, 0),
    ]
    .into_iter()
    .map(|h| {
        let mut b = vec![0u8; bex_rpc::HEADER_LEN + 4];
        h.encode(&mut b);
        b
    })
    .collect()
}

/// Scripts for `rpc_replies` (see its doc): calls wait, replies come out of order, twice,
/// late, with a wrong length, as an error, placed, and as a request.
fn rpc_scripts() -> Vec<Vec<u8>> {
    // Step bytes: 0 wait, 1 give up, 2 built reply (kind, status, id, body length, body,
    // length delta as i8 / 32), 3 raw frame (length, bytes).
    let reply = |kind: u8, status: u8, id: u8, body: &[u8], delta: i8| {
        let mut s = vec![2, kind, status, id, body.len() as u8];
        s.extend_from_slice(body);
        s.push(delta as u8);
        s
    };
    let (response, error, placed, elsewhere, request) = (2, 3, 4, 5, 1);
    let mut out = Vec::new();
    let mut a = vec![0, 1, 0, 2];
    a.extend(reply(response, 0, 2, b"two", 0));
    a.extend(reply(response, 0, 1, b"one", 0));
    a.extend(reply(response, 0, 1, b"again", 0));
    out.push(a);
    let mut b = vec![0, 3, 0, 4, 0, 5, 1, 4];
    b.extend(reply(response, 0, 3, b"too long", 64));
    b.extend(reply(error, 5, 3, b"not found", 0));
    b.extend(reply(placed, 0, 4, b"late", 0));
    b.extend(reply(placed, 4, 5, b"busy, placed", -64));
    out.push(b);
    let mut c = vec![0, 6, 0, 7];
    c.extend(reply(elsewhere, 0, 6, b"", 0));
    c.extend(reply(request, 0, 7, b"", 0));
    c.extend([3, 5, b'x', b'y', b'z', 0, 0]);
    out.push(c);
    out
}

/// Valid requests (with the op as the RPC method) against the local tables.
fn ps_requests() -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    let specs = local_specs();
    for (table, spec) in specs.iter().enumerate().take(3) {
        let dim = spec.dim;
        let keys = [1u64, 2, 3 + table as u64];
        let h =
            DataHeader { table: table as u32, dim, client: 9, seq: 10 + table as u64, flags: 0 };
        let mut f = vec![0u8; wire::push_request_len(keys.len(), dim as usize)];
        let n = wire::encode_fetch_into(&mut f, &h, &keys).expect("fetch encodes");
        out.push((Op::Fetch as u16, f[..n].to_vec()));
        let nc = DataHeader { flags: flags::NO_CREATE, ..h };
        let n = wire::encode_fetch_into(&mut f, &nc, &[77]).expect("fetch encodes");
        out.push((Op::Fetch as u16, f[..n].to_vec()));
        let grads: Vec<f32> =
            (0..keys.len() * dim as usize).map(|i| i as f32 * 0.25 - 1.0).collect();
        let n = wire::encode_push_into(&mut f, &h, &keys, &grads).expect("push encodes");
        out.push((Op::Push as u16, f[..n].to_vec()));
        // A Replicate of values only, as the protocol once had: refused.
        let n = wire::encode_push_into(&mut f, &DataHeader { seq: 99, ..h }, &keys, &grads)
            .expect("push encodes");
        f[5] = Op::Replicate as u8;
        out.push((Op::Replicate as u16, f[..n].to_vec()));
        // Whole rows: the table's stride, a step count and a version per row.
        let width = (spec.stride() + bex_ps_proto::spec::STATE_EXTRA_WORDS) as u32;
        let rows: Vec<f32> = (0..keys.len() * width as usize).map(|i| i as f32 * 0.5).collect();
        let st = DataHeader { seq: 100, dim: width, flags: flags::STATE, ..h };
        let mut f = vec![0u8; wire::push_request_len(keys.len(), width as usize)];
        let n = wire::encode_replicate_into(&mut f, &st, &keys, &rows).expect("replicate encodes");
        out.push((Op::Replicate as u16, f[..n].to_vec()));
    }
    let control = |op: Op, f: Result<Vec<u8>, wire::WireError>| (op as u16, f.expect("encodes"));
    out.push(control(Op::Health, wire::control_request_vec(Op::Health, 0, 1, 2, &())));
    out.push(control(Op::Tables, wire::control_request_vec(Op::Tables, 0, 1, 3, &())));
    out.push(control(
        Op::Checkpoint,
        wire::control_request_vec(Op::Checkpoint, 0, 1, 4, &CheckpointRequest { wait: true }),
    ));
    out.push(control(
        Op::Snapshot,
        wire::control_request_vec(
            Op::Snapshot,
            0,
            1,
            5,
            &SnapshotRequest { cursor: SnapshotCursor::START, max_bytes: 8192 },
        ),
    ));
    for a in [
        AdminRequest::Ping,
        AdminRequest::SetReadOnly(true),
        AdminRequest::SetReadOnly(false),
        AdminRequest::ResetDedupe,
        AdminRequest::SetRdma(false),
    ] {
        out.push(control(Op::Admin, wire::control_request_vec(Op::Admin, 0, 1, 6, &a)));
    }
    out
}

/// Responses, control bodies and a snapshot chunk.
fn ps_other() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut b = vec![0u8; 256];
    let (n, rows) = wire::begin_fetch_response(&mut b, 7, 2, 4).expect("fetch response");
    wire::put_f32s(rows, &[1.0, -2.0, 0.5, 0.0, 3.0, 4.0, 5.0, 6.0]);
    out.push(b[..n].to_vec());
    out.push(wire::error_response_vec(Some(Op::Push), Status::WrongDim, 8, "dimension differs"));
    out.push(wire::error_response_vec(None, Status::UnknownOp, 0, "unknown op"));
    let n =
        wire::encode_status_into(&mut b, Some(Op::Push), Status::Duplicate, 9, 3).expect("status");
    out.push(b[..n].to_vec());
    let tables =
        TablesInfo { tables: TableSet::new(local_specs()).expect("tables").infos(), shards: 2 };
    out.push(wire::control_response_vec(Op::Tables, 1, &tables).expect("tables response"));
    for m in [AdminRequest::SetRdma(true), AdminRequest::Shutdown] {
        out.push(
            wire::control_request_vec(Op::Admin, 0, 1, 2, &m).expect("admin")
                [wire::REQUEST_HEADER_LEN..]
                .to_vec(),
        );
    }
    // A snapshot chunk of a few rows of table 0.
    let t = TableSet::new(local_specs()).expect("tables");
    let mut rows = vec![0u8; 3 * 4 * local_specs()[0].dim as usize];
    let keys: Vec<u8> = [5u64, 6, 7].iter().flat_map(|k| k.to_le_bytes()).collect();
    let keys = wire::LeU64s::new(&keys).expect("keys");
    if let Some(table) = t.get(0) {
        let _ = table.fetch_into_le(keys, &mut rows, true);
    }
    let mut chunk = Vec::new();
    snapshot_chunk(&t, SnapshotCursor::START, 1 << 16, Vec::new, &mut chunk).expect("a chunk");
    out.push(chunk);
    // The windows chunk that ends a snapshot.
    let mut windows = Vec::new();
    let past = SnapshotCursor { table: t.len() as u32, ..SnapshotCursor::START };
    let w = || vec![bex_ps_core::dedupe::WindowState { client: 9, high: 70, bits: vec![3] }];
    snapshot_chunk(&t, past, 1 << 16, w, &mut windows).expect("a windows chunk");
    out.push(windows);
    out
}

fn server() -> Vec<Vec<u8>> {
    let reqs = ps_requests();
    let mut out: Vec<Vec<u8>> =
        reqs.iter().map(|(m, f)| crate::encode_frames(&[(*m, &f[..])])).collect();
    // The same with lengths repaired after mutation.
    out.extend(reqs.iter().map(|(m, f)| crate::encode_frames(&[(*m | crate::REPAIR, &f[..])])));
    // A few sequences: read-only then push; push, replay, fetch; dedupe reset then replay.
    let pick =
        |op: Op| reqs.iter().filter(move |(m, _)| *m == op as u16).map(|(m, f)| (*m, &f[..]));
    let fetches: Vec<_> = pick(Op::Fetch).collect();
    let pushes: Vec<_> = pick(Op::Push).collect();
    let repls: Vec<_> = pick(Op::Replicate).collect();
    let admin: Vec<_> = pick(Op::Admin).collect();
    out.push(crate::encode_frames(&[pushes[0], pushes[0], fetches[0]]));
    out.push(crate::encode_frames(&[admin[1], pushes[1], admin[2], pushes[1], fetches[2]]));
    // repls[1]: whole rows (repls[0] is a values-only frame, refused).
    out.push(crate::encode_frames(&[repls[1], fetches[0], admin[3], repls[1], fetches[0]]));
    out
}

fn config() -> Vec<Vec<u8>> {
    let local = include_str!("../../configs/local.toml");
    let mut out = vec![local.as_bytes().to_vec()];
    if let Ok(s) = local_config().to_toml_string() {
        out.push(s.into_bytes());
    }
    out.push(
        b"[cluster]\npods = 1\nshards = 3\n[[cluster.servers]]\npod = 0\nshard = 0\nrdma = \"127.0.0.1:1\"\ntcp = \"127.0.0.1:2\"\nhttp = \"127.0.0.1:3\"\n[[tables]]\nname = \"t\"\ndim = 4\n"
            .to_vec(),
    );
    out
}
