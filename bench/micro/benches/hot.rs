//! The hot functions, each at the size a 1000-key × 64 request gives it.

use std::hint::black_box;

use bex_ps_core::dedupe::{Dedupe, DedupeConfig};
use bex_ps_core::Table;
use bex_ps_proto::init::Initializer;
use bex_ps_proto::optim::Optimizer;
use bex_ps_proto::wire::{self, DataHeader, Limits};
use bex_ps_proto::{FanoutPlan, TableSpec};
use bex_rnic::soft::packet::{self, Header, Ipv4Ids, Opcode, Route};

fn main() {
    divan::main();
}

const KEYS: usize = 1000;
const DIM: u32 = 64;

fn keys() -> Vec<u64> {
    // Spread like hashed feature ids, not consecutive.
    (0..KEYS as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect()
}

fn header() -> DataHeader {
    DataHeader { table: 0, dim: DIM, client: 7, seq: 1, flags: 0 }
}

mod wire_format {
    use super::*;

    #[divan::bench]
    fn encode_fetch(bencher: divan::Bencher) {
        let (keys, h) = (keys(), header());
        let mut buf = vec![0u8; wire::fetch_request_len(KEYS)];
        bencher.bench_local(|| wire::encode_fetch_into(black_box(&mut buf), &h, black_box(&keys)));
    }

    #[divan::bench]
    fn encode_push(bencher: divan::Bencher) {
        let (keys, h) = (keys(), header());
        let grads = vec![1e-3f32; KEYS * DIM as usize];
        let mut buf = vec![0u8; wire::push_request_len(KEYS, DIM as usize)];
        bencher.bench_local(|| {
            wire::encode_push_into(black_box(&mut buf), &h, black_box(&keys), black_box(&grads))
        });
    }

    #[divan::bench]
    fn decode_push(bencher: divan::Bencher) {
        let (keys, h) = (keys(), header());
        let grads = vec![1e-3f32; KEYS * DIM as usize];
        let mut buf = vec![0u8; wire::push_request_len(KEYS, DIM as usize)];
        let n = wire::encode_push_into(&mut buf, &h, &keys, &grads).expect("fits");
        let limits = Limits::default();
        bencher.bench_local(|| {
            wire::decode_request(black_box(&buf[..n]), &limits).map(|v| v.keys.len())
        });
    }
}

mod table {
    use super::*;

    fn table() -> Table {
        let spec = TableSpec {
            name: "emb".into(),
            dim: DIM,
            seed: 1,
            init: Initializer::Uniform { scale: 0.01 },
            optimizer: Optimizer::Sgd { lr: 0.01 },
            admission: Default::default(),
            capacity: Default::default(),
        };
        let t = Table::new(spec).expect("valid spec");
        let mut out = vec![0f32; KEYS * DIM as usize];
        t.fetch_into(&keys(), &mut out).expect("sized");
        t
    }

    #[divan::bench]
    fn fetch_into_warm(bencher: divan::Bencher) {
        let (t, keys) = (table(), keys());
        let mut out = vec![0f32; KEYS * DIM as usize];
        bencher.bench_local(|| t.fetch_into(black_box(&keys), black_box(&mut out)));
    }

    #[divan::bench]
    fn push_sgd(bencher: divan::Bencher) {
        let (t, keys) = (table(), keys());
        let grads = vec![1e-6f32; KEYS * DIM as usize];
        bencher.bench_local(|| t.push(black_box(&keys), black_box(&grads), None));
    }
}

#[divan::bench(args = [1, 4, 16])]
fn fanout_plan(bencher: divan::Bencher, shards: u32) {
    let keys = keys();
    bencher.bench_local(|| FanoutPlan::new(black_box(&keys), shards));
}

mod icrc {
    use super::*;

    fn route() -> Route {
        Route {
            src: "10.0.0.1:4791".parse().expect("addr"),
            dst: "10.0.0.2:4791".parse().expect("addr"),
        }
    }

    /// A full 4 KB-MTU packet: headers, payload, ICRC.
    #[divan::bench]
    fn encode_4k(bencher: divan::Bencher) {
        let (h, r, payload) = (Header::new(Opcode::SendOnly, 17, 5), route(), vec![7u8; 4096]);
        bencher.bench_local(|| packet::encode(black_box(&h), black_box(&payload), &r));
    }

    #[divan::bench]
    fn check_4k(bencher: divan::Bencher) {
        let r = route();
        let pkt = packet::encode(&Header::new(Opcode::SendOnly, 17, 5), &[7u8; 4096], &r);
        let mut ids = Ipv4Ids::default();
        bencher.bench_local(|| packet::icrc_ok(black_box(&pkt), &r, &mut ids));
    }
}

/// Admitting the next sequence number of one of 64 clients, in turn.
#[divan::bench]
fn dedupe_admit(bencher: divan::Bencher) {
    let d = Dedupe::new(DedupeConfig::default());
    let mut seq = 0u64;
    bencher.bench_local(|| {
        seq += 1;
        d.admit(black_box(seq % 64), black_box(seq / 64 + 1))
    });
}
