//! ps-core's frames: requests, responses, control bodies and snapshot chunks.

use std::sync::OnceLock;

use bex_ps_core::checkpoint::{self, CHUNK_HEADER_LEN};
use bex_ps_proto::control::{
    AdminRequest, AdminResponse, CheckpointRequest, CheckpointSummary, HealthInfo, SnapshotRequest,
    TablesInfo,
};
use bex_ps_proto::wire::{
    self, DataHeader, Limits, Op, RequestHeader, ResponseHeader, Status, REQUEST_HEADER_LEN,
    RESPONSE_HEADER_LEN,
};
use bex_ps_proto::{Config, TableSpec};
use serde::{de::DeserializeOwned, Serialize};

/// Tight limits next to the defaults, so the limit checks themselves get exercised.
const SMALL: Limits = Limits { max_frame_bytes: 1 << 12, max_keys: 16, max_dim: 16 };

/// The tables of `configs/local.toml`.
pub(crate) fn local_config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        Config::from_toml_str(include_str!("../../configs/local.toml"))
            .expect("configs/local.toml parses")
    })
}

pub(crate) fn local_specs() -> Vec<TableSpec> {
    local_config().table_specs()
}

/// `data` as a request and as a response under the default and tight limits, as each control
/// body, and as a snapshot chunk (as is, and with its CRC fixed so the row parsing is
/// reached): never panics; decoded frames re-encode to their bytes; control messages
/// round-trip.
pub fn ps_wire(data: &[u8]) {
    for limits in [Limits::default(), SMALL] {
        request(data, &limits);
        response(data, &limits);
    }
    control::<AdminRequest>(data);
    control::<AdminResponse>(data);
    control::<CheckpointRequest>(data);
    control::<CheckpointSummary>(data);
    control::<HealthInfo>(data);
    control::<SnapshotRequest>(data);
    control::<TablesInfo>(data);
    snapshot_chunk(data);
}

fn request(data: &[u8], limits: &Limits) {
    let Ok(v) = wire::decode_request(data, limits) else { return };
    let h = v.header;
    assert!(data.len() <= limits.max_frame_bytes);
    let mut again = vec![0u8; data.len()];
    if h.op.is_data() {
        // Whole rows (Replicate, always with STATE): up to three arrays, a step count and a
        // version.
        let state = h.flags & wire::flags::STATE != 0;
        assert_eq!(state, h.op == Op::Replicate, "STATE on Replicate and only there");
        let max_dim = if state {
            3 * limits.max_dim + bex_ps_proto::spec::STATE_EXTRA_WORDS as u32
        } else {
            limits.max_dim
        };
        assert!(h.dim >= 1 && h.dim <= max_dim && h.count <= limits.max_keys);
        assert_eq!(v.keys.len(), h.count as usize);
        let want_values = if h.op.carries_values() { h.count as usize * h.dim as usize } else { 0 };
        assert_eq!(v.values.len(), want_values);
        let dh =
            DataHeader { table: h.table, dim: h.dim, client: h.client, seq: h.seq, flags: h.flags };
        let keys = v.keys.to_vec();
        let n = match h.op {
            Op::Fetch => wire::encode_fetch_into(&mut again, &dh, &keys),
            Op::Push => wire::encode_push_into(&mut again, &dh, &keys, &v.values.to_vec()),
            _ => wire::encode_replicate_into(&mut again, &dh, &keys, &v.values.to_vec()),
        }
        .expect("a decoded data request re-encodes");
        assert_eq!(n, data.len());
        assert_eq!(again, data, "data request round trip");
    } else {
        assert!(v.keys.is_empty() && v.values.is_empty());
        RequestHeader { ..h }.encode_into(&mut again).expect("room for the header");
        again[REQUEST_HEADER_LEN..].copy_from_slice(v.body);
        assert_eq!(again, data, "control request round trip");
    }
}

fn response(data: &[u8], limits: &Limits) {
    let Ok(r) = wire::decode_response(data, limits) else { return };
    let h = r.header;
    let mut again = vec![0u8; data.len()];
    ResponseHeader { ..h }.encode_into(&mut again).expect("room for the header");
    again[RESPONSE_HEADER_LEN..].copy_from_slice(r.body);
    assert_eq!(again, data, "response round trip");
    let rows = r.rows();
    if h.op == Some(Op::Fetch) && h.status == Status::Ok {
        assert_eq!(rows.len(), h.count as usize * h.dim as usize, "rows match count × dim");
        for i in 0..h.count as usize {
            assert!(rows.row(i, h.dim as usize).is_some());
        }
    } else {
        assert!(rows.is_empty());
    }
    let m = r.message();
    if h.status.is_success() {
        assert!(m.is_empty());
    }
}

/// decode(encode(x)) == x, compared as encodings so NaN fields do not matter; also through
/// a whole control request and response frame.
fn control<T: Serialize + DeserializeOwned>(data: &[u8]) {
    let Ok(x) = wire::decode_control::<T>(data) else { return };
    let frame =
        wire::control_request_vec(Op::Admin, 0, 1, 2, &x).expect("a decoded message encodes");
    let v = wire::decode_request(&frame, &Limits::default()).expect("an encoded request decodes");
    let y: T = v.control().expect("an encoded body decodes");
    let frame2 = wire::control_request_vec(Op::Admin, 0, 1, 2, &y).expect("encodes");
    assert_eq!(frame, frame2, "control message round trip");
    let resp = wire::control_response_vec(Op::Health, 3, &x).expect("encodes");
    let r = wire::decode_response(&resp, &Limits::default()).expect("an encoded response decodes");
    let z: T = r.control().expect("decodes");
    assert_eq!(
        wire::control_response_vec(Op::Health, 3, &z).expect("encodes"),
        resp,
        "control response round trip"
    );
}

/// Offset of a snapshot chunk's CRC (ps-core's chunk header layout).
const CHUNK_CRC_AT: usize = 28;

fn snapshot_chunk(data: &[u8]) {
    let Ok(tables) = bex_ps_core::TableSet::new(local_specs()) else {
        panic!("the local tables are valid")
    };
    let _ = checkpoint::apply_snapshot_chunk(&tables, data, &mut |_, _| {});
    if data.len() >= CHUNK_HEADER_LEN {
        let mut fixed = data.to_vec();
        fixed[CHUNK_CRC_AT..CHUNK_CRC_AT + 4].fill(0);
        let crc = crc32fast::hash(&fixed);
        fixed[CHUNK_CRC_AT..CHUNK_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        // An empty chunk names any table (the snapshot's end); rows need a known one.
        if let Ok(info) = checkpoint::apply_snapshot_chunk(&tables, &fixed, &mut |_, _| {}) {
            if info.rows > 0 {
                let t = tables.get(info.table).expect("rows apply only to a known table");
                assert!(t.rows() >= 1, "{} rows applied, none stored", info.rows);
            }
        }
    }
}
