//! The pieces of `bex-ps-core` fitted together the way a server and its clients use them,
//! with frames as bytes and no network: fan-out Fetch and Push across shards, idempotent
//! retries, replication to another pod, bootstrap of a replica over Snapshot frames, and bad
//! input answered with error statuses while serving continues.

use bex_ps_core::checkpoint::{apply_snapshot_chunk, snapshot_chunk};
use bex_ps_core::dedupe::{Dedupe, Verdict};
use bex_ps_core::TableSet;
use bex_ps_proto::control::{SnapshotCursor, SnapshotRequest, TablesInfo};
use bex_ps_proto::fanout::FanoutPlan;
use bex_ps_proto::wire::{self, flags, DataHeader, LeF32s, Limits, Op, Status};
use bex_ps_proto::Config;

/// A minimal single-threaded server of one (pod, shard), as ps-server would do it. The
/// statuses it answers for roles and op decoding (NotTraining, UnknownOp, BadControl) are its
/// own: what these tests check is that the core pieces fit. The real handler's NotTraining,
/// UnknownOp and BadValue are checked in `ps-server/src/server.rs`'s tests.
struct Server {
    tables: TableSet,
    dedupe: Dedupe,
    training: bool,
    limits: Limits,
    /// Replicate frames produced by applied pushes (training pod only).
    outbox: Vec<Vec<u8>>,
    replication_seq: u64,
    errors: Vec<Status>,
}

impl Server {
    fn new(config: &Config, training: bool) -> Server {
        Server {
            tables: TableSet::new(config.table_specs()).unwrap(),
            dedupe: Dedupe::new(bex_ps_core::dedupe::DedupeConfig::of(config)),
            training,
            limits: config.limits(),
            outbox: Vec::new(),
            replication_seq: 0,
            errors: Vec::new(),
        }
    }

    fn handle(&mut self, frame: &[u8]) -> Vec<u8> {
        let resp = self.handle_inner(frame);
        let h = wire::decode_response(&resp, &Limits::default()).unwrap().header;
        if !h.status.is_success() {
            self.errors.push(h.status);
        }
        resp
    }

    fn handle_inner(&mut self, frame: &[u8]) -> Vec<u8> {
        let req = match wire::decode_request(frame, &self.limits) {
            Ok(r) => r,
            Err(e) => {
                // Echo what is readable of the header.
                let (op, seq) =
                    wire::RequestHeader::decode(frame).map_or((None, 0), |h| (Some(h.op), h.seq));
                return wire::error_response_vec(op, e.status(), seq, &e.to_string());
            }
        };
        let h = req.header;
        let err = |s: Status, m: String| wire::error_response_vec(Some(h.op), s, h.seq, &m);
        match h.op {
            Op::Fetch | Op::Push | Op::Replicate => {
                // A Replicate carries whole rows: the table's state width.
                let t = match h.op {
                    Op::Replicate => match self.tables.get(h.table) {
                        Some(t) if t.state_width() == h.dim as usize => t,
                        _ => return err(Status::WrongDim, "not a table's whole rows".into()),
                    },
                    _ => match self.tables.resolve(h.table, h.dim) {
                        Ok(t) => t,
                        Err(e) => return err(e.status(), e.to_string()),
                    },
                };
                match h.op {
                    Op::Fetch => {
                        let n = wire::fetch_response_len(h.count as usize, h.dim as usize).unwrap();
                        let mut out = vec![0u8; n];
                        let (_, rows) =
                            wire::begin_fetch_response(&mut out, h.seq, h.count, h.dim).unwrap();
                        t.fetch_into_le(req.keys, rows, h.flags & flags::NO_CREATE == 0).unwrap();
                        out
                    }
                    Op::Push if !self.training => {
                        err(Status::NotTraining, "not the training pod".into())
                    }
                    Op::Replicate => {
                        // Versioned whole rows apply only over older ones: a retry changes
                        // nothing, whatever dedupe says.
                        t.apply_replica_state_le(req.keys, req.values).unwrap();
                        self.dedupe.admit(h.client, h.seq);
                        let mut out = vec![0u8; wire::RESPONSE_HEADER_LEN];
                        wire::encode_status_into(&mut out, Some(h.op), Status::Ok, h.seq, h.count)
                            .unwrap();
                        out
                    }
                    _ => {
                        // Validate fully, then dedupe, then apply.
                        if let Some(i) = req.values.iter().position(|v| !v.is_finite()) {
                            return err(Status::BadValue, format!("value {i} is not finite"));
                        }
                        match self.dedupe.admit(h.client, h.seq) {
                            Verdict::New => {}
                            Verdict::Duplicate => {
                                let mut out = vec![0u8; wire::RESPONSE_HEADER_LEN];
                                wire::encode_status_into(
                                    &mut out,
                                    Some(h.op),
                                    Status::Duplicate,
                                    h.seq,
                                    h.count,
                                )
                                .unwrap();
                                return out;
                            }
                            Verdict::TooOld => {
                                return err(Status::TooOld, "beyond the dedupe window".into())
                            }
                        }
                        t.push_le(req.keys, req.values, None).unwrap();
                        self.replication_seq += 1;
                        let width = t.state_width();
                        let keys = req.keys.to_vec();
                        let mut rows = vec![0f32; keys.len() * width];
                        t.read_state_into(&keys, &mut rows).unwrap();
                        let hdr = DataHeader {
                            table: h.table,
                            dim: width as u32,
                            client: 0xF00D,
                            seq: self.replication_seq,
                            flags: flags::STATE,
                        };
                        let mut frame = vec![0u8; wire::push_request_len(keys.len(), width)];
                        wire::encode_replicate_into(&mut frame, &hdr, &keys, &rows).unwrap();
                        self.outbox.push(frame);
                        let mut out = vec![0u8; wire::RESPONSE_HEADER_LEN];
                        wire::encode_status_into(&mut out, Some(h.op), Status::Ok, h.seq, h.count)
                            .unwrap();
                        out
                    }
                }
            }
            Op::Tables => wire::control_response_vec(
                Op::Tables,
                h.seq,
                &TablesInfo { tables: self.tables.infos(), shards: 1 },
            )
            .unwrap(),
            Op::Snapshot => {
                let Ok(sr) = req.control::<SnapshotRequest>() else {
                    return err(Status::BadControl, "snapshot request".into());
                };
                let mut chunk = Vec::new();
                match snapshot_chunk(
                    &self.tables,
                    sr.cursor,
                    sr.max_bytes as usize,
                    Vec::new,
                    &mut chunk,
                ) {
                    Ok(rows) => {
                        let mut out = vec![0u8; wire::RESPONSE_HEADER_LEN + chunk.len()];
                        let (_, body) = wire::begin_body_response(
                            &mut out,
                            Op::Snapshot,
                            h.seq,
                            rows,
                            chunk.len(),
                        )
                        .unwrap();
                        body.copy_from_slice(&chunk);
                        out
                    }
                    Err(e) => err(Status::Unavailable, e.to_string()),
                }
            }
            _ => err(Status::UnknownOp, format!("{} not served here", h.op.name())),
        }
    }
}

fn config() -> Config {
    let mut c = Config::local(2, 3, 20000);
    c.tables = Config::from_toml_str(
        r#"
        [cluster]
        pods = 1
        shards = 1
        [[tables]]
        name = "emb"
        dim = 4
        optimizer = { kind = "adagrad", lr = 0.1 }
        [[tables]]
        name = "bias"
        dim = 1
        init = { kind = "zeros" }
        optimizer = { kind = "sgd", lr = 0.5 }
        "#,
    )
    .unwrap()
    .tables;
    c.validate().unwrap();
    c
}

/// pods × shards servers, pod 0 training.
fn cluster(c: &Config) -> Vec<Vec<Server>> {
    (0..c.cluster.pods)
        .map(|p| (0..c.cluster.shards).map(|_| Server::new(c, p == 0)).collect())
        .collect()
}

fn fetch(pod: &mut [Server], table: u32, dim: u32, keys: &[u64], seq: u64) -> Vec<f32> {
    let plan = FanoutPlan::new(keys, pod.len() as u32);
    let responses: Vec<Vec<u8>> = plan
        .parts()
        .iter()
        .map(|part| {
            let mut f = vec![0u8; wire::fetch_request_len(part.keys.len())];
            let h = DataHeader { table, dim, client: 1, seq, flags: 0 };
            wire::encode_fetch_into(&mut f, &h, &part.keys).unwrap();
            pod[part.shard as usize].handle(&f)
        })
        .collect();
    let views: Vec<LeF32s<'_>> = responses
        .iter()
        .map(|r| {
            let v = wire::decode_response(r, &Limits::default()).unwrap();
            assert_eq!(v.header.status, Status::Ok, "{}", v.message());
            v.rows()
        })
        .collect();
    plan.merge_le(dim as usize, &views).unwrap()
}

fn push_frames(
    shards: u32,
    table: u32,
    dim: u32,
    keys: &[u64],
    grads: &[f32],
    client: u64,
    seq: u64,
) -> Vec<(u32, Vec<u8>)> {
    let plan = FanoutPlan::new(keys, shards);
    let split = plan.split_grads(dim as usize, grads).unwrap();
    plan.parts()
        .iter()
        .zip(split)
        .map(|(part, g)| {
            let mut f = vec![0u8; wire::push_request_len(part.keys.len(), dim as usize)];
            let h = DataHeader { table, dim, client, seq, flags: 0 };
            wire::encode_push_into(&mut f, &h, &part.keys, &g).unwrap();
            (part.shard, f)
        })
        .collect()
}

fn status(resp: &[u8]) -> Status {
    wire::decode_response(resp, &Limits::default()).unwrap().header.status
}

fn replicate(cluster: &mut [Vec<Server>]) {
    let (training, others) = cluster.split_at_mut(1);
    for (s, server) in training[0].iter_mut().enumerate() {
        for frame in server.outbox.drain(..) {
            for pod in others.iter_mut() {
                assert_eq!(status(&pod[s].handle(&frame)), Status::Ok);
                // A retried Replicate frame applies nothing new (its rows' versions are not
                // newer); the fetch after replication checks the rows are the push's.
                assert_eq!(status(&pod[s].handle(&frame)), Status::Ok);
            }
        }
    }
}

#[test]
fn fetch_push_replicate_across_pods() {
    let c = config();
    let mut cl = cluster(&c);
    let keys: Vec<u64> = vec![1, 2, 3, 1, 99, 1000, 2];
    let before = fetch(&mut cl[0], 0, 4, &keys, 1);
    assert_eq!(before.len(), keys.len() * 4);
    assert_eq!(before[0..4], before[12..16], "duplicate keys get the same row");
    // Both pods start with identical initial rows (deterministic initializer).
    assert_eq!(fetch(&mut cl[1], 0, 4, &keys, 2), before);

    let grads: Vec<f32> = (0..keys.len() * 4).map(|i| (i as f32 - 10.0) * 0.1).collect();
    for (shard, frame) in push_frames(3, 0, 4, &keys, &grads, 42, 7) {
        assert_eq!(status(&cl[0][shard as usize].handle(&frame)), Status::Ok);
        // The retry of the same (client, seq) is not applied again.
        assert_eq!(status(&cl[0][shard as usize].handle(&frame)), Status::Duplicate);
    }
    // A push reaching a replica pod is refused.
    let (shard, frame) = push_frames(3, 0, 4, &keys, &grads, 42, 8).remove(0);
    assert_eq!(status(&cl[1][shard as usize].handle(&frame)), Status::NotTraining);

    let after = fetch(&mut cl[0], 0, 4, &keys, 3);
    assert_ne!(after, before);
    replicate(&mut cl);
    assert_eq!(fetch(&mut cl[1], 0, 4, &keys, 4), after, "the replica pod converges bit for bit");

    // SGD on "bias" with summed duplicate gradients: 0 − 0.5·(1 + 2) = −1.5.
    for (shard, frame) in push_frames(3, 1, 1, &[5, 5], &[1.0, 2.0], 42, 9) {
        assert_eq!(status(&cl[0][shard as usize].handle(&frame)), Status::Ok);
    }
    assert_eq!(fetch(&mut cl[0], 1, 1, &[5], 5), [-1.5]);
}

#[test]
fn bad_input_gets_error_statuses_and_serving_continues() {
    let c = config();
    let mut s = Server::new(&c, true);
    let good = {
        let mut f = vec![0u8; wire::fetch_request_len(2)];
        wire::encode_fetch_into(
            &mut f,
            &DataHeader { table: 0, dim: 4, client: 1, seq: 1, flags: 0 },
            &[1, 2],
        )
        .unwrap();
        f
    };
    let mut cases: Vec<(Vec<u8>, Status)> = Vec::new();
    cases.push((good[..good.len() - 3].to_vec(), Status::BadFrame)); // truncated
    cases.push((vec![0u8; 7], Status::BadFrame)); // shorter than a header
    let mut b = good.clone();
    b[5] = 200;
    cases.push((b, Status::UnknownOp));
    let mut b = good.clone();
    b[8] = 9; // table 9
    cases.push((b, Status::UnknownTable));
    let mut b = good.clone();
    b[12] = 8; // dim 8 with the same key bytes
    cases.push((b, Status::WrongDim));
    let mut b = good.clone();
    b[16] = 3; // count 3 but two keys
    cases.push((b, Status::BadFrame));
    let mut big = vec![0u8; wire::fetch_request_len(c.server.max_keys_per_request as usize + 1)];
    let keys: Vec<u64> = (0..=u64::from(c.server.max_keys_per_request)).collect();
    wire::encode_fetch_into(
        &mut big,
        &DataHeader { table: 0, dim: 4, client: 1, seq: 1, flags: 0 },
        &keys,
    )
    .unwrap();
    cases.push((big, Status::TooLarge));
    let mut nan = vec![0u8; wire::push_request_len(1, 4)];
    wire::encode_push_into(
        &mut nan,
        &DataHeader { table: 0, dim: 4, client: 1, seq: 1, flags: 0 },
        &[1],
        &[0.0, f32::NAN, 0.0, 0.0],
    )
    .unwrap();
    cases.push((nan, Status::BadValue));
    let mut badctl = wire::control_request_vec(Op::Snapshot, 0, 1, 1, &7u8).unwrap();
    cases.push((badctl.clone(), Status::BadControl));
    badctl[5] = Op::Admin as u8;
    cases.push((badctl, Status::UnknownOp));
    for (i, (frame, want)) in cases.iter().enumerate() {
        assert_eq!(status(&s.handle(frame)), *want, "case {i}");
        // Still serving.
        assert_eq!(status(&s.handle(&good)), Status::Ok, "after case {i}");
    }
    assert_eq!(s.errors.len(), cases.len());
    // A NaN push was rejected before dedupe: the same (client, seq) with good values applies.
    let mut fine = vec![0u8; wire::push_request_len(1, 4)];
    wire::encode_push_into(
        &mut fine,
        &DataHeader { table: 0, dim: 4, client: 1, seq: 1, flags: 0 },
        &[1],
        &[0.5; 4],
    )
    .unwrap();
    assert_eq!(status(&s.handle(&fine)), Status::Ok);
}

#[test]
fn replica_bootstraps_from_a_peer_over_snapshot_frames() {
    let c = config();
    let mut source = Server::new(&c, true);
    let keys: Vec<u64> = (0..2000).collect();
    let grads = vec![0.3f32; keys.len() * 4];
    for (_, frame) in push_frames(1, 0, 4, &keys, &grads, 5, 1) {
        assert_eq!(status(&source.handle(&frame)), Status::Ok);
    }
    // Client side: Tables first, then pull chunks until the last one.
    let resp = source.handle(&wire::control_request_vec(Op::Tables, 0, 9, 1, &()).unwrap());
    let info: TablesInfo =
        wire::decode_response(&resp, &Limits::default()).unwrap().control().unwrap();
    assert_eq!(info.tables.len(), 2);
    let replica = TableSet::new(info.tables.into_iter().map(|t| t.spec).collect()).unwrap();
    let mut cursor = SnapshotCursor::START;
    let mut chunks = 0;
    loop {
        let req = SnapshotRequest { cursor, max_bytes: 16 * 1024 };
        let resp = source.handle(&wire::control_request_vec(Op::Snapshot, 0, 9, 2, &req).unwrap());
        let v = wire::decode_response(&resp, &Limits::default()).unwrap();
        assert_eq!(v.header.status, Status::Ok, "{}", v.message());
        let applied = apply_snapshot_chunk(&replica, v.body, &mut |_, _| {}).unwrap();
        assert_eq!(applied.rows, v.header.count);
        chunks += 1;
        match applied.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    assert!(chunks > 5);
    let t = replica.get(0).unwrap();
    assert_eq!(t.rows(), 2000);
    let (mut a, mut b) = (vec![0f32; 8000], vec![0f32; 8000]);
    t.read_into(&keys, &mut a).unwrap();
    source.tables.get(0).unwrap().read_into(&keys, &mut b).unwrap();
    assert_eq!(a, b);
    // A cursor from before a restart of the peer is refused (status, not a panic).
    let stale =
        SnapshotRequest { cursor: SnapshotCursor { epoch: 12345, ..cursor }, max_bytes: 16 * 1024 };
    let resp = Server::new(&c, true)
        .handle(&wire::control_request_vec(Op::Snapshot, 0, 9, 3, &stale).unwrap());
    assert_eq!(status(&resp), Status::Unavailable);
}
