//! The stable smoke run of every fuzz target: each seed as is, then seeded random bytes and
//! mutated seeds (byte-level; line- and number-level for the config text). A failure prints
//! the target, the seed, the iteration and the input; rerun one with the `BEX_SEED=<seed>` line it prints.
//! `BEX_FUZZ_ITERS=<n>` scales the number of inputs (default: a few seconds in debug).

use std::panic::{catch_unwind, AssertUnwindSafe};

use bex_fuzz_targets::{seeds, Target, TARGETS};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEFAULT_SEED: u64 = 0x5eed_f022;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v} is not a number"),
    }
}

const INTERESTING_U32: [u32; 9] = [0, 1, 2, 0x7f, 0xff, 0x8000, 0xffff, 0x8000_0000, u32::MAX];

/// One byte-level mutation of `b` (`other` is another seed, for splicing).
fn mutate_bytes(rng: &mut ChaCha8Rng, b: &mut Vec<u8>, other: &[u8]) {
    let pos = |rng: &mut ChaCha8Rng, len: usize| rng.random_range(0..len.max(1));
    match rng.random_range(0..8) {
        0 if !b.is_empty() => {
            let i = pos(rng, b.len());
            b[i] ^= 1 << rng.random_range(0..8);
        }
        1 if !b.is_empty() => {
            let i = pos(rng, b.len());
            b[i] = rng.random();
        }
        2 if b.len() >= 4 => {
            let i = rng.random_range(0..=b.len() - 4);
            let v = INTERESTING_U32[rng.random_range(0..INTERESTING_U32.len())];
            b[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        3 => {
            let i = rng.random_range(0..=b.len());
            let n = rng.random_range(1..16);
            let ins: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            b.splice(i..i, ins);
        }
        4 if !b.is_empty() => {
            let i = pos(rng, b.len());
            let n = rng.random_range(1..=(b.len() - i).min(16));
            b.drain(i..i + n);
        }
        5 => {
            let n = rng.random_range(0..=b.len());
            b.truncate(n);
        }
        6 if !other.is_empty() => {
            let i = rng.random_range(0..=b.len());
            let j = pos(rng, other.len());
            let n = rng.random_range(1..=(other.len() - j).min(64));
            b.splice(i..i, other[j..j + n].iter().copied());
        }
        _ if !b.is_empty() => {
            let i = pos(rng, b.len());
            b[i] = [0u8, 0xff, 0x7f, 0x80][rng.random_range(0..4)];
        }
        _ => b.push(rng.random()),
    }
}

const TOML_VALUES: [&str; 14] = [
    "0",
    "-1",
    "1",
    "65",
    "4097",
    "4294967296",
    "18446744073709551616",
    "1e309",
    "nan",
    "-inf",
    "\"\"",
    "true",
    "[]",
    "{}",
];

/// One line- or value-level mutation of a TOML text.
fn mutate_text(rng: &mut ChaCha8Rng, b: &mut Vec<u8>) {
    let text = String::from_utf8_lossy(b).into_owned();
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    if lines.is_empty() {
        return;
    }
    let i = rng.random_range(0..lines.len());
    match rng.random_range(0..4) {
        0 => {
            lines.remove(i);
        }
        1 => {
            let l = lines[i].clone();
            lines.insert(i, l);
        }
        2 => {
            let j = rng.random_range(0..lines.len());
            lines.swap(i, j);
        }
        _ => {
            if let Some(eq) = lines[i].find('=') {
                let v = TOML_VALUES[rng.random_range(0..TOML_VALUES.len())];
                lines[i] = format!("{}= {v}", &lines[i][..eq]);
            }
        }
    }
    *b = (lines.join("\n") + "\n").into_bytes();
}

fn run(name: &str, default_iters: u64) {
    let target: Target = TARGETS.iter().find(|t| t.0 == name).expect("a target of that name").1;
    let seed = bex_testkit::seed::one_seed(DEFAULT_SEED);
    let iters = env_u64("BEX_FUZZ_ITERS").unwrap_or(default_iters);
    let bases = seeds(name);
    assert!(!bases.is_empty(), "{name} has seeds");
    let check = |i: u64, input: &[u8]| {
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| target(input))) {
            eprintln!(
                "fuzz smoke failure: target={name} seed={seed} iteration={i} input({} B)={:02x?}\n{}",
                input.len(),
                input,
                bex_testkit::seed::replay(seed, "cargo test -p bex-fuzz-targets --test smoke"),
            );
            std::panic::resume_unwind(e);
        }
    };
    for (i, b) in bases.iter().enumerate() {
        check(i as u64, b);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name.len() as u64);
    for i in 0..iters {
        let input = if i % 8 == 0 {
            let n = rng.random_range(0..300);
            (0..n).map(|_| rng.random()).collect()
        } else {
            let mut b = bases[rng.random_range(0..bases.len())].clone();
            let other = &bases[rng.random_range(0..bases.len())];
            for _ in 0..rng.random_range(1..5) {
                if name == "config" && rng.random_bool(0.7) {
                    mutate_text(&mut rng, &mut b);
                } else {
                    mutate_bytes(&mut rng, &mut b, other);
                }
            }
            b
        };
        check(i, &input);
    }
}

#[test]
fn roce_packet() {
    run("roce_packet", 200_000);
}

#[test]
fn transport_frame() {
    run("transport_frame", 100_000);
}

#[test]
fn rpc_frame() {
    run("rpc_frame", 200_000);
}

#[test]
fn rpc_replies() {
    run("rpc_replies", 100_000);
}

#[test]
fn ps_wire() {
    run("ps_wire", 30_000);
}

#[test]
fn ps_server() {
    run("ps_server", 8_000);
}

#[test]
fn config() {
    run("config", 8_000);
}

#[test]
fn every_target_is_smoked_and_has_seeds() {
    let names: Vec<&str> = TARGETS.iter().map(|t| t.0).collect();
    assert_eq!(
        names,
        [
            "roce_packet",
            "transport_frame",
            "rpc_frame",
            "rpc_replies",
            "ps_wire",
            "ps_server",
            "config"
        ]
    );
    for n in names {
        assert!(!seeds(n).is_empty(), "{n}");
    }
}
