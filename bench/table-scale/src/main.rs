//! `table-scale`: how one shard's table behaves as it grows (issue 18, item 4). For each row
//! count and dimension it fills a table through `Table::push` (Adagrad, so rows carry one
//! state slot) and measures resident memory per row, the insert rate, and the latency of
//! 1000-key fetches and pushes of random existing keys, and of applying 1000 newer
//! whole-row copies as a replica does. Beside it, in the same run: the same rows in a plain
//! `HashMap<u64, Box<[f32]>>` with the same initializer and optimizer; `floor`, random loads
//! over an array of the rows' size (what memory alone costs; with two loads a key, in two
//! pages or in one, it tells cache misses from page walks); and `inline`, a prototype of
//! rows inline in the index. Every point runs in a child process of its own, so its
//! resident memory is its rows' alone and is returned to the system before the next point;
//! a point that would not fit in the memory available now is reported as skipped, not
//! attempted.

use std::collections::HashMap;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use bex_bench::cli::Output;
use bex_bench::clock::Clock;
use bex_bench::report::{render, Envelope};
use bex_bench::stats::{median, LatencyRecorder, LatencySummary};
use bex_plot::{Chart, Series, COLORS};
use bex_process::child::Guard;
use bex_ps_core::table::{ExportRows, STRIPES};
use bex_ps_core::Table;
use bex_ps_proto::init::Initializer;
use bex_ps_proto::optim::Optimizer;
use bex_ps_proto::shard::mix64;
use bex_ps_proto::wire::{LeF32s, LeU64s};
use bex_ps_proto::{Admission, Capacity, TableSpec};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

mod inline;
mod paged;

const TOOL: &str = "table-scale";

/// table-scale: memory per row, insert rate and fetch/push latency of a PS table at growing
/// sizes, against a plain HashMap in the same run.
#[derive(Debug, Parser)]
#[command(name = "table-scale", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every point (each in a child process), then the tables, targets, JSON and figure.
    Run(RunArgs),
    /// One point in this process; its report as one JSON line on stdout (what `run` spawns).
    Point(PointArgs),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Rows per shard, comma-separated; K and M suffixes (1M = 1 000 000).
    #[arg(long, value_delimiter = ',', default_value = "1M,10M,100M", value_parser = parse_count)]
    rows: Vec<u64>,
    /// Row dimensions, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    dims: Vec<u32>,
    /// Stores to measure: bex (the PS table), bex-bounded (the same table bounded at the
    /// rows and full: evicting as it goes), hashmap (the baseline), floor (random loads
    /// over an array of the rows' size: how memory alone slows as it grows); not in the
    /// default set: floor-two-pages and floor-one-page (two loads a key, in two pages or in
    /// one), floor-one-page-dependent (two in one page, the second's address waiting for the
    /// first's value), inline, inline-versioned and inline-paged (prototypes of rows inline
    /// in the index).
    #[arg(long, value_delimiter = ',', default_value = "bex,bex-bounded,hashmap,floor")]
    stores: Vec<Store>,
    /// Keys per fetch and push.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// Seconds of fetches, and of pushes, measured per point.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Rounds of every point, interleaved (round 1 of each point, then round 2, ...): this
    /// machine's speed drifts between minutes and a table's speed depends on where its
    /// memory lands, so a ratio of single points is not to be read closely. Targets are
    /// judged on medians over the rounds (of the ratios within each round, for growth).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=99))]
    rounds: u32,
    /// A small run for CI: 100K and 1M rows of dim 16, 0.3 s of each operation.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    output: Output,
}

#[derive(Debug, Args)]
struct PointArgs {
    /// Rows to insert.
    #[arg(long, value_parser = parse_count)]
    rows: u64,
    /// Row dimension.
    #[arg(long)]
    dim: u32,
    /// The store.
    #[arg(long)]
    store: Store,
    /// Keys per fetch and push.
    #[arg(long, default_value_t = 1000)]
    batch: u32,
    /// Seconds of fetches, and of pushes.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

/// Where rows live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
enum Store {
    /// `bex_ps_core::Table`: 64 striped slabs and indexes.
    Bex,
    /// The same table bounded at the rows (`capacity.max_rows`) and full: a quarter more
    /// keys are pushed than it keeps, so every stripe is full and each new key displaces its
    /// least recently pushed row. Fetches and pushes take keys among the last rows-many
    /// pushed (a few were displaced: fetched as initial rows, pushed back in).
    BexBounded,
    /// `HashMap<u64, Box<[f32]>>`: one allocation per row.
    Hashmap,
    /// A prototype, not a table: rows inline in the index's buckets (`inline.rs`), to
    /// measure what one page walk per lookup instead of two would gain.
    Inline,
    /// The prototype with what a table's rows must carry, a version each (a line of them a
    /// bucket), at load 0.9, where its memory per row keeps within 1.2x at dim 16.
    InlineVersioned,
    /// A second prototype (`paged.rs`): a bucket is a 4 KiB page of one-byte tags then 28
    /// records (at dim 16) of key, version and row, at load 0.9, so about half as many keys
    /// overflow their home bucket as in `inline-versioned`'s 1 KiB buckets.
    InlinePaged,
    /// No table: an array of the rows' payload bytes, and per "fetch" one random 8-byte
    /// load per key — what the memory system alone costs at this size, the floor under
    /// any table's growth (no push).
    Floor,
    /// The floor with two random loads a key, in two pages (as a table's index bucket and
    /// its row are): what a lookup of two independent misses costs.
    FloorTwoPages,
    /// The floor with two loads a key in one page, 2 KiB apart (as a row inline in its
    /// bucket is): with `floor-two-pages`, it tells misses of the data from page walks.
    FloorOnePage,
    /// `floor-one-page` with the second load's address computed from the first load's
    /// value (as a row inline in its bucket is found from the bucket's keys): what a lookup
    /// of one page a key costs when its two misses cannot be issued together.
    FloorOnePageDependent,
}

impl Store {
    /// Its name on the command line and in the tables (`bex-bounded`).
    fn name(self) -> String {
        self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
    }

    /// What a floor store loads for each key; `None` for the stores that hold rows.
    fn floor_loads(self) -> Option<FloorLoads> {
        match self {
            Store::Floor => Some(FloorLoads::One),
            Store::FloorTwoPages => Some(FloorLoads::TwoPages),
            Store::FloorOnePage => Some(FloorLoads::OnePage),
            Store::FloorOnePageDependent => Some(FloorLoads::OnePageDependent),
            Store::Bex
            | Store::BexBounded
            | Store::Hashmap
            | Store::Inline
            | Store::InlineVersioned
            | Store::InlinePaged => None,
        }
    }

    /// The floor stores: loads of an array, no table.
    fn is_floor(self) -> bool {
        self.floor_loads().is_some()
    }
}

/// One point's numbers.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PointReport {
    store: Store,
    dim: u32,
    rows: u64,
    /// f32 per row: values and optimizer state.
    stride: usize,
    /// What a row is made of: key (8) + values and state (4 · stride).
    payload_bytes_per_row: f64,
    /// Resident memory the rows added, per row.
    rss_bytes_per_row: f64,
    /// The table's own count (`Table::bytes`), per row (bex only).
    counted_bytes_per_row: Option<f64>,
    insert_s: f64,
    insert_rows_per_s: f64,
    /// Latency of one fetch of `batch` random existing keys.
    fetch: Option<LatencySummary>,
    /// Latency of one push of `batch` random existing keys.
    push: Option<LatencySummary>,
    /// Latency of applying whole-row copies of `batch` random existing keys, newer than the
    /// stored rows, as a replica applies a Replicate (bex stores only).
    #[serde(default)]
    copy: Option<LatencySummary>,
    /// Time per row to page every row out in 4 MiB chunks, as snapshot chunks do (the
    /// unbounded table only), ns: the lesser of two passes.
    #[serde(default)]
    export_ns: Option<f64>,
    batch: u32,
}

/// A point of the run: measured, or why not.
#[derive(Clone, Debug, Serialize)]
struct RunPoint {
    store: Store,
    dim: u32,
    rows: u64,
    /// Which round of `--rounds` (from 1).
    round: u32,
    #[serde(flatten)]
    report: Option<PointReport>,
    /// Not attempted: why (it would not fit in memory).
    skipped: Option<String>,
    /// Attempted and failed: how.
    failed: Option<String>,
}

#[derive(Serialize)]
struct JsonReport<'a> {
    #[serde(flatten)]
    envelope: Envelope,
    points: &'a [RunPoint],
    targets: &'a [Target],
}

/// One of the targets, judged.
#[derive(Clone, Debug, Serialize)]
struct Target {
    what: String,
    value: Option<f64>,
    limit: f64,
    met: Option<bool>,
}

fn main() -> ExitCode {
    bex_process::logging::init();
    bex_bench::cli::main_with(TOOL, |cli: Cli| match cli.command {
        Cmd::Run(a) => run(a),
        Cmd::Point(p) => {
            bex_process::exit_with_parent();
            let report = point(&p);
            let json = serde_json::to_string(&report)
                .map_err(|e| bex_bench::Error::Check(format!("JSON: {e}")))?;
            println!("{json}");
            Ok(ExitCode::SUCCESS)
        }
    })
}

/// `1M` → 1 000 000, `100K` → 100 000, `5000` → 5000.
fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1_000),
        Some('M' | 'm') => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    let n: u64 = digits.parse().map_err(|_| format!("`{t}` is not a count (1000, 100K, 1M)"))?;
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("`{t}`: counts run from 1 to 2^64")),
        Some(v) => Ok(v),
    }
}

fn spec(dim: u32) -> TableSpec {
    bounded_spec(dim, None)
}

/// [`spec`], with `max_rows` if given.
fn bounded_spec(dim: u32, max_rows: Option<u64>) -> TableSpec {
    TableSpec {
        name: "scale".into(),
        dim,
        seed: 7,
        init: Initializer::Uniform { scale: 0.01 },
        optimizer: Optimizer::Adagrad { lr: 0.05, initial_accumulator: 0.1, eps: 1e-8 },
        admission: Admission::default(),
        capacity: Capacity { max_rows: max_rows.unwrap_or(0), ..Capacity::default() },
    }
}

/// What a row is made of: its key, then values and optimizer state.
fn payload_bytes(spec: &TableSpec) -> usize {
    8 + 4 * spec.stride()
}

/// The `i`th key inserted (spread like real feature ids).
fn key(i: u64) -> u64 {
    mix64(i)
}

/// The rows a store holds, behind the two operations measured.
trait Rows {
    fn push(&mut self, keys: &[u64], grads: &[f32]);
    fn fetch(&mut self, keys: &[u64], out: &mut [f32]);
    /// Applies whole-row copies of `keys` newer than the stored rows, as a replica applies a
    /// Replicate; how long the apply alone took (building the copies is not timed). None
    /// where the store has no such operation.
    fn copy(&mut self, _keys: &[u64], _clock: &Clock) -> Option<Duration> {
        None
    }
}

impl Rows for Table {
    fn push(&mut self, keys: &[u64], grads: &[f32]) {
        // As a server does before each push (its clock here: the pushes counted), so a row's
        // version says when it was last pushed.
        self.advance_version_floor(0);
        Table::push(self, keys, grads, None).expect("lengths are right");
    }
    fn fetch(&mut self, keys: &[u64], out: &mut [f32]) {
        self.read_into(keys, out).expect("lengths are right");
    }
    fn copy(&mut self, keys: &[u64], clock: &Clock) -> Option<Duration> {
        // Copies built without reading the table (reading the rows first would leave them
        // in the caches for the timed apply), each with a version above every stored one:
        // pushes here move the floor by one and write at most a few past it.
        let (width, dim, stride) = (self.state_width(), self.dim(), self.stride());
        let version = self.advance_version_floor(0) + (1 << 32);
        let mut row = vec![0.1f32; width];
        row[..dim].fill(0.01);
        row[stride] = f32::from_bits(1);
        row[stride + 1] = f32::from_bits(version as u32);
        row[stride + 2] = f32::from_bits((version >> 32) as u32);
        let rows = row.repeat(keys.len());
        let (mut kb, mut vb) = (vec![0u8; 8 * keys.len()], vec![0u8; 4 * rows.len()]);
        bex_ps_proto::wire::put_u64s(&mut kb, keys);
        bex_ps_proto::wire::put_f32s(&mut vb, &rows);
        let keys = LeU64s::new(&kb).expect("whole words");
        let rows = LeF32s::new(&vb).expect("whole words");
        let t = clock.now();
        let n = self.apply_replica_state_le(keys, rows).expect("finite rows, right lengths");
        let took = clock.now() - t;
        assert!(n > 0, "no copy was newer than its row");
        Some(took)
    }
}

/// The baseline: one boxed row (values, then state) per key.
struct Baseline {
    spec: TableSpec,
    rows: HashMap<u64, Box<[f32]>>,
}

impl Rows for Baseline {
    fn push(&mut self, keys: &[u64], grads: &[f32]) {
        let (dim, spec) = (self.spec.dim as usize, &self.spec);
        for (k, g) in keys.iter().zip(grads.chunks_exact(dim)) {
            let row = self.rows.entry(*k).or_insert_with(|| {
                let mut row = vec![0f32; spec.stride()];
                let (w, s) = row.split_at_mut(dim);
                spec.init.fill(spec.seed, *k, w);
                spec.optimizer.init_state(s);
                row.into_boxed_slice()
            });
            let (w, s) = row.split_at_mut(dim);
            spec.optimizer.apply(w, s, &mut 0, g);
        }
    }
    fn fetch(&mut self, keys: &[u64], out: &mut [f32]) {
        let dim = self.spec.dim as usize;
        for (k, o) in keys.iter().zip(out.chunks_exact_mut(dim)) {
            match self.rows.get(k) {
                Some(row) => o.copy_from_slice(&row[..dim]),
                None => self.spec.init.fill(self.spec.seed, *k, o),
            }
        }
    }
}

/// The memory floor: words to load at random, `loads` of them a key.
struct Floor {
    words: Vec<u64>,
    loads: FloorLoads,
    /// The index of the first word that starts a page (the allocation need not).
    first_page: u64,
    /// 0, but not known to the compiler: `OnePageDependent` adds the first load's value
    /// masked by it to the second load's address, so the second waits for the first.
    dependence: u64,
}

/// What a floor's "fetch" loads for each key.
#[derive(Clone, Copy, Debug)]
enum FloorLoads {
    /// One word anywhere.
    One,
    /// Two words anywhere: almost always in two pages.
    TwoPages,
    /// Two words of one 4 KiB page, 2 KiB apart (further than the adjacent-line
    /// prefetcher reaches, so both are misses of their own).
    OnePage,
    /// The words of `OnePage`, the second's address depending on the first's value.
    OnePageDependent,
}

/// 8-byte words in a 4 KiB page.
const PAGE_WORDS: u64 = 512;

impl Floor {
    /// An array of `bytes` and a page, every page written (resident, as rows would be).
    fn new(bytes: usize, loads: FloorLoads) -> Floor {
        let mut words = vec![0u64; bytes.div_ceil(8) + PAGE_WORDS as usize];
        for (i, w) in words.iter_mut().enumerate().step_by(PAGE_WORDS as usize) {
            *w = i as u64;
        }
        let page_bytes = PAGE_WORDS as usize * 8;
        let first_page =
            ((page_bytes - words.as_ptr().addr() % page_bytes) % page_bytes / 8) as u64;
        Floor { words, loads, first_page, dependence: std::hint::black_box(0) }
    }

    /// The words key `k` loads. Keys are SplitMix64 outputs, so each part of one is uniform.
    fn at(&self, k: u64) -> [usize; 2] {
        let n = self.words.len() as u64;
        match self.loads {
            FloorLoads::One => [(k % n) as usize; 2],
            FloorLoads::TwoPages => [(k % n) as usize, (k.rotate_left(32) % n) as usize],
            FloorLoads::OnePage | FloorLoads::OnePageDependent => {
                let page = self.first_page + k % ((n - self.first_page) / PAGE_WORDS) * PAGE_WORDS;
                let line = (k >> 40) % 32 * 8;
                [(page + line) as usize, (page + line + PAGE_WORDS / 2) as usize]
            }
        }
    }
}

impl Rows for Floor {
    fn push(&mut self, _: &[u64], _: &[f32]) {}
    fn fetch(&mut self, keys: &[u64], out: &mut [f32]) {
        // Keys are independent, as a warmed batch's are; within a key, so are the two loads
        // but for `OnePageDependent`'s.
        let sum = keys.iter().fold(0u64, |s, &k| {
            let [a, b] = self.at(k);
            let first = self.words[a];
            let s = s.wrapping_add(first);
            match self.loads {
                FloorLoads::One => s,
                FloorLoads::TwoPages | FloorLoads::OnePage => s.wrapping_add(self.words[b]),
                FloorLoads::OnePageDependent => {
                    s.wrapping_add(self.words[b + (first & self.dependence) as usize])
                }
            }
        });
        if let Some(o) = out.first_mut() {
            *o = sum as f32;
        }
    }
}

/// What exercising a store measured.
struct Measured {
    insert_s: f64,
    /// Keys inserted (`rows`, or more for a bounded table).
    pushed: u64,
    rss_bytes_per_row: f64,
    fetch: Option<LatencySummary>,
    push: Option<LatencySummary>,
    copy: Option<LatencySummary>,
    export_ns: Option<f64>,
}

/// Measures one point in this process.
fn point(p: &PointArgs) -> PointReport {
    let spec = spec(p.dim);
    let rss0 = bex_process::resident_bytes().unwrap_or(0);
    let (m, counted) = match p.store {
        Store::Bex => {
            let mut table = Table::new(spec.clone()).expect("a valid spec");
            let m = exercise(&mut table, &spec, p, p.rows, rss0);
            let export_ns = Some(export_ns(&table));
            (Measured { export_ns, ..m }, Some(table.bytes() as f64 / p.rows as f64))
        }
        Store::BexBounded => {
            let mut table = Table::new(bounded_spec(p.dim, Some(p.rows))).expect("a valid spec");
            let pushed = p.rows + p.rows / 4;
            let m = exercise(&mut table, &spec, p, pushed, rss0);
            // A stripe is sent about pushed/64 keys, give or take σ = √(pushed/64): at 100K
            // rows and more, a quarter more than its share is over six σ, so every stripe
            // filled (the point fails if one did not).
            assert_eq!(table.rows(), p.rows, "a bounded stripe did not fill");
            assert!(table.evicted() >= pushed - p.rows, "{} rows displaced", table.evicted());
            (m, Some(table.bytes() as f64 / p.rows as f64))
        }
        Store::Hashmap => {
            let mut baseline = Baseline { spec: spec.clone(), rows: HashMap::new() };
            (exercise(&mut baseline, &spec, p, p.rows, rss0), None)
        }
        Store::Inline | Store::InlineVersioned => {
            let shape = match p.store {
                Store::Inline => inline::Shape::BARE,
                _ => inline::Shape::VERSIONED,
            };
            let mut inline = inline::Inline::new(spec.clone(), p.rows, shape);
            (exercise(&mut inline, &spec, p, p.rows, rss0), None)
        }
        Store::InlinePaged => {
            let mut paged = paged::Paged::new(spec.clone(), p.rows);
            (exercise(&mut paged, &spec, p, p.rows, rss0), None)
        }
        Store::Floor
        | Store::FloorTwoPages
        | Store::FloorOnePage
        | Store::FloorOnePageDependent => {
            let loads = p.store.floor_loads().expect("the stores of this arm are floors");
            let started = Clock.now();
            let mut floor = Floor::new(p.rows as usize * payload_bytes(&spec), loads);
            let filled = (Clock.now() - started).as_secs_f64();
            let m = exercise(&mut floor, &spec, p, p.rows, rss0);
            (Measured { insert_s: filled, push: None, ..m }, None)
        }
    };
    PointReport {
        store: p.store,
        dim: p.dim,
        rows: p.rows,
        stride: spec.stride(),
        payload_bytes_per_row: payload_bytes(&spec) as f64,
        rss_bytes_per_row: m.rss_bytes_per_row,
        counted_bytes_per_row: counted,
        insert_s: m.insert_s,
        insert_rows_per_s: m.pushed as f64 / m.insert_s,
        fetch: m.fetch,
        push: m.push,
        copy: m.copy,
        export_ns: m.export_ns,
        batch: p.batch,
    }
}

/// Pages every row of `table` out in 4 MiB chunks, as snapshots do, twice; the lesser time,
/// per row, in ns.
fn export_ns(table: &Table) -> f64 {
    let room = (4 << 20) / table.record_len();
    let mut out = Vec::with_capacity(4 << 20);
    let clock = Clock;
    let mut least = f64::MAX;
    for _ in 0..2 {
        let started = clock.now();
        let mut rows = 0;
        for stripe in 0..STRIPES {
            let mut slot = 0;
            loop {
                out.clear();
                let (scanned, n) =
                    table.export_records(ExportRows::Pushed, stripe, slot, room, &mut out);
                (rows, slot) = (rows + n, slot + scanned);
                if n < room {
                    break;
                }
            }
        }
        least = least.min((clock.now() - started).as_secs_f64());
        assert_eq!(rows as u64, table.rows(), "every row once");
    }
    least * 1e9 / table.rows().max(1) as f64
}

/// Inserts `pushed` keys by pushes, then times fetches, pushes and (where the store has
/// them) whole-row copies of random keys among the last `p.rows` of them; memory is per
/// `p.rows`.
fn exercise(
    rows: &mut impl Rows,
    spec: &TableSpec,
    p: &PointArgs,
    pushed: u64,
    rss0: u64,
) -> Measured {
    let (dim, batch) = (spec.dim as usize, p.batch as usize);
    let grads = vec![0.01f32; batch * dim];
    let mut keys = Vec::with_capacity(batch);
    let clock = Clock;
    let started = clock.now();
    let mut i = 0;
    while i < pushed {
        keys.clear();
        keys.extend((i..pushed.min(i + batch as u64)).map(key));
        rows.push(&keys, &grads[..keys.len() * dim]);
        i += keys.len() as u64;
    }
    let insert_s = (clock.now() - started).as_secs_f64();
    let rss = bex_process::resident_bytes().unwrap_or(0);
    let rss_bytes_per_row = rss.saturating_sub(rss0) as f64 / p.rows as f64;
    let mut rng = p.rows ^ 0x5eed;
    let mut out = vec![0f32; batch * dim];
    // `op` says how long it took, or None: the store has no such operation.
    let mut measure = |op: &mut dyn FnMut(&[u64]) -> Option<Duration>| {
        let mut rec = LatencyRecorder::new();
        let until = clock.deadline(Duration::from_secs_f64(p.seconds));
        while !clock.expired(until) {
            keys.clear();
            for _ in 0..batch {
                rng = mix64(rng);
                keys.push(key(pushed - p.rows + rng % p.rows));
            }
            rec.record(op(&keys)?);
        }
        rec.summary()
    };
    let timed = |op: &mut dyn FnMut()| {
        let t = clock.now();
        op();
        Some(clock.now() - t)
    };
    let fetch = measure(&mut |k| timed(&mut || rows.fetch(k, &mut out)));
    let push = measure(&mut |k| timed(&mut || rows.push(k, &grads)));
    let copy = measure(&mut |k| rows.copy(k, &clock));
    Measured { insert_s, pushed, rss_bytes_per_row, fetch, push, copy, export_ns: None }
}

/// Bytes the system can give now (`MemAvailable`).
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

fn run(a: RunArgs) -> Result<ExitCode, bex_bench::Error> {
    let (rows, dims, seconds) = if a.quick {
        (vec![100_000, 1_000_000], vec![16], 0.3)
    } else {
        // Each once, fewest first (a count given twice would weigh twice in the medians).
        (distinct(a.rows.iter().copied()), distinct(a.dims.iter().copied()), a.seconds)
    };
    let exe = std::env::current_exe().map_err(bex_bench::error::io("locating table-scale"))?;
    let mut points = Vec::new();
    for round in 1..=a.rounds {
        for &dim in &dims {
            for &n in &rows {
                for &store in &a.stores {
                    // Payload plus an allowance for indexes and allocator slack (measured: about
                    // 50 bytes a row for every store; a bounded table's order about 1).
                    let need = n.saturating_mul(payload_bytes(&spec(dim)) as u64 + 80);
                    let skipped = match available_bytes() {
                        Some(avail) if need > avail => Some(format!(
                            "needs about {:.1} GiB, {:.1} GiB available",
                            need as f64 / (1u64 << 30) as f64,
                            avail as f64 / (1u64 << 30) as f64
                        )),
                        _ => None,
                    };
                    if !a.output.quiet {
                        eprintln!(
                            "{TOOL}: round {round} of {}: {store:?} dim {dim}, {n} rows{}",
                            a.rounds,
                            match &skipped {
                                Some(why) => format!(": skipped ({why})"),
                                None => String::new(),
                            }
                        );
                    }
                    let (report, failed) = match skipped {
                        Some(_) => (None, None),
                        // A point that fails (the OOM killer, say) is reported, the run goes on,
                        // and its exit status is 1.
                        None => match spawn_point(&exe, store, dim, n, a.batch, seconds) {
                            Ok(r) => (Some(r), None),
                            Err(e) => (None, Some(e.to_string())),
                        },
                    };
                    points.push(RunPoint { store, dim, rows: n, round, report, skipped, failed });
                }
            }
        }
    }
    let targets = targets(&points);
    let text = text(&points, &targets);
    print!("{text}");
    let envelope = Envelope::new(TOOL, env!("CARGO_PKG_VERSION"), Default::default());
    let json =
        serde_json::to_string_pretty(&JsonReport { envelope, points: &points, targets: &targets })
            .map_err(|e| bex_bench::Error::Check(format!("JSON: {e}")))?;
    a.output.write(TOOL, &text, &json, &[("table-scale.svg", figure(&points))])?;
    Ok(bex_bench::cli::exit_status(points.iter().any(|p| p.failed.is_some())))
}

fn spawn_point(
    exe: &std::path::Path,
    store: Store,
    dim: u32,
    rows: u64,
    batch: u32,
    seconds: f64,
) -> Result<PointReport, bex_bench::Error> {
    let store_arg = store.name();
    let mut cmd = Command::new(exe);
    cmd.args(["point", "--store", &store_arg])
        .args(["--dim", &dim.to_string(), "--rows", &rows.to_string()])
        .args(["--batch", &batch.to_string(), "--seconds", &seconds.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // A point holds up to 16 GB: it must not outlive a run that is stopped.
    bex_process::die_with_this_process(&mut cmd);
    let out = Guard::spawn(&mut cmd, format!("the point {store:?} dim {dim} rows {rows}"))
        .and_then(Guard::output)
        .map_err(|e| bex_bench::Error::Check(e.to_string()))?;
    if !out.status.success() {
        return Err(bex_bench::Error::Check(format!(
            "the point {store:?} dim {dim} rows {rows} failed: {}",
            out.status
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| bex_bench::Error::Protocol(format!("a point's report: {e}")))
}

/// The reports of `store` at `dim` in `round`, fewest rows first.
fn measured(points: &[RunPoint], store: Store, dim: u32, round: u32) -> Vec<&PointReport> {
    let mut out: Vec<&PointReport> = points
        .iter()
        .filter(|p| p.store == store && p.dim == dim && p.round == round)
        .filter_map(|p| p.report.as_ref())
        .collect();
    out.sort_by_key(|r| r.rows);
    out
}

/// The values, each once, ascending.
fn distinct<T: Ord>(values: impl Iterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = values.collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The rounds of the run, ascending.
fn rounds(points: &[RunPoint]) -> Vec<u32> {
    distinct(points.iter().map(|p| p.round))
}

/// The row counts `store` was measured at in `dim`, ascending.
fn row_counts(points: &[RunPoint], store: Store, dim: u32) -> Vec<u64> {
    distinct(
        points
            .iter()
            .filter(|p| p.store == store && p.dim == dim && p.report.is_some())
            .map(|p| p.rows),
    )
}

/// `metric` at (`store`, `dim`, `rows`) in each round that measured it, in round order.
fn over_rounds(
    points: &[RunPoint],
    (store, dim, rows): (Store, u32, u64),
    metric: &dyn Fn(&PointReport) -> Option<f64>,
) -> Vec<f64> {
    let mut at: Vec<(u32, f64)> = points
        .iter()
        .filter(|p| p.store == store && p.dim == dim && p.rows == rows)
        .filter_map(|p| Some((p.round, p.report.as_ref().and_then(metric)?)))
        .collect();
    at.sort_by_key(|&(round, _)| round);
    at.into_iter().map(|(_, v)| v).collect()
}

/// What a median of `values` over a run of `rounds` rounds rests on, for the text: nothing
/// for a single round; else how many rounds measured it, and each round's value.
fn rests_on(values: &[f64], rounds: usize) -> String {
    match values.len() {
        _ if rounds <= 1 => String::new(),
        k if k == rounds => format!(" (median of {rounds} rounds: {})", listed(values)),
        k => {
            format!(" (median of the {k} of {rounds} rounds that measured it: {})", listed(values))
        }
    }
}

/// Per round, `metric` at `store`'s most rows over its fewest (rounds that measured both).
fn growth_by_round(
    points: &[RunPoint],
    store: Store,
    dim: u32,
    metric: &dyn Fn(&PointReport) -> Option<f64>,
) -> Vec<f64> {
    let rows = row_counts(points, store, dim);
    let (Some(&fewest), Some(&most)) = (rows.first(), rows.last()) else { return Vec::new() };
    if most == fewest {
        return Vec::new();
    }
    rounds(points)
        .into_iter()
        .filter_map(|round| {
            let at = measured(points, store, dim, round);
            let of = |n: u64| at.iter().find(|r| r.rows == n).and_then(|r| metric(r));
            Some(of(most)? / of(fewest)?)
        })
        .collect()
}

fn fetch_p50(p: &PointReport) -> Option<f64> {
    p.fetch.as_ref().map(|s| s.p50_us)
}

/// `values` as `a, b, c` (two places), for the text.
fn listed(values: &[f64]) -> String {
    values.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(", ")
}

/// The targets over the bex points: medians over the rounds.
fn targets(points: &[RunPoint]) -> Vec<Target> {
    let mut out = Vec::new();
    let judge = |what: String, value: Option<f64>, limit: f64| Target {
        met: value.map(|v| v <= limit),
        what,
        value,
        limit,
    };
    let n = rounds(points).len();
    for dim in dims(points) {
        for store in [Store::Bex, Store::BexBounded] {
            for rows in row_counts(points, store, dim) {
                let table = if store == Store::Bex { "" } else { ", bounded table" };
                let ratios = over_rounds(points, (store, dim, rows), &|p| {
                    Some(p.rss_bytes_per_row / p.payload_bytes_per_row)
                });
                out.push(judge(
                    format!(
                        "dim {dim}, {} rows{table}: memory per row / (key + values + state){}",
                        count(rows),
                        rests_on(&ratios, n)
                    ),
                    median(&ratios),
                    1.2,
                ));
            }
        }
        // Judged wherever two sizes were measured, "not measured" when no round has both.
        let rows = row_counts(points, Store::Bex, dim);
        if let (Some(first), Some(last)) = (rows.first(), rows.last().filter(|&&l| l > rows[0])) {
            let growth = growth_by_round(points, Store::Bex, dim, &fetch_p50);
            out.push(judge(
                format!(
                    "dim {dim}: fetch p50 at {} rows / at {} rows{}",
                    count(*last),
                    count(*first),
                    rests_on(&growth, n)
                ),
                median(&growth),
                1.5,
            ));
        }
    }
    out
}

/// The dimensions measured, ascending.
fn dims(points: &[RunPoint]) -> Vec<u32> {
    distinct(points.iter().map(|p| p.dim))
}

/// How much the memory floor itself slows between the smallest and largest row count of
/// each dimension: the growth no table can avoid on this machine (text, not a target).
fn floor_growth(points: &[RunPoint]) -> Vec<String> {
    let mut out = Vec::new();
    let n = rounds(points).len();
    let batch = points.iter().find_map(|p| p.report.as_ref()).map_or(0, |r| r.batch);
    for dim in dims(points) {
        for (store, loads) in [
            (Store::Floor, "random loads alone"),
            (Store::FloorTwoPages, "two random loads a key, two pages"),
            (Store::FloorOnePage, "two random loads a key, one page"),
            (Store::FloorOnePageDependent, "two loads a key, one page, the second waiting"),
        ] {
            let rows = row_counts(points, store, dim);
            let growth = growth_by_round(points, store, dim, &fetch_p50);
            let (Some(&first), Some(&last), Some(g)) = (rows.first(), rows.last(), median(&growth))
            else {
                continue;
            };
            // Of one round, the two p50s; of several, each round's ratio (medians of the two
            // p50s would not divide to the median ratio).
            let p50 = |rows| median(&over_rounds(points, (store, dim, rows), &fetch_p50));
            let detail = match n {
                1 => format!(
                    " ({:.1} / {:.1} µs per {batch} keys)",
                    p50(last).unwrap_or(f64::NAN),
                    p50(first).unwrap_or(f64::NAN)
                ),
                _ => rests_on(&growth, n),
            };
            out.push(format!(
                "dim {dim}: {loads}, p50 at {} rows / at {} rows: {g:.2}{detail}",
                count(last),
                count(first),
            ));
        }
        for rows in row_counts(points, Store::Bex, dim) {
            let ratios: Vec<f64> = rounds(points)
                .into_iter()
                .filter_map(|round| {
                    let at = |store| {
                        measured(points, store, dim, round)
                            .into_iter()
                            .find(|r| r.rows == rows)
                            .and_then(fetch_p50)
                    };
                    Some(at(Store::Bex)? / at(Store::Floor)?)
                })
                .collect();
            if let Some(r) = median(&ratios) {
                out.push(format!(
                    "dim {dim}, {} rows: bex fetch p50 / floor p50: {r:.2}{}",
                    count(rows),
                    rests_on(&ratios, n)
                ));
            }
        }
        out.extend(growth_at_floor_cost(points, dim));
    }
    out
}

/// The fetch growth bex would have if the memory it adds between its fewest and most rows
/// were a floor store's: per round, (bex p50 at the fewest rows + that floor's p50 at the
/// most − at the fewest) / bex p50 at the fewest. With `floor`, what one independent miss a
/// key adds (not a bound on every layout: a one-page lookup's second line costs a miss at the
/// fewest rows and hides behind the page walk at the most, so it can add less); with
/// `floor-one-page`, what a layout that reads one page a key (rows inline in the index) could
/// reach at best; with `floor-two-pages`, what today's (index bucket, then row) costs.
fn growth_at_floor_cost(points: &[RunPoint], dim: u32) -> Vec<String> {
    let rows = row_counts(points, Store::Bex, dim);
    let (Some(&fewest), Some(&most)) = (rows.first(), rows.last()) else { return Vec::new() };
    let n = rounds(points).len();
    let mut out = Vec::new();
    for (floor, pages) in [
        (Store::Floor, "one line a key"),
        (Store::FloorOnePage, "one page a key"),
        (Store::FloorOnePageDependent, "one page a key, its two loads in turn"),
        (Store::FloorTwoPages, "two pages a key"),
    ] {
        let bounds: Vec<f64> = rounds(points)
            .into_iter()
            .filter_map(|round| {
                let at = |store, rows| {
                    measured(points, store, dim, round)
                        .into_iter()
                        .find(|r| r.rows == rows)
                        .and_then(fetch_p50)
                };
                let base = at(Store::Bex, fewest)?;
                Some((base + at(floor, most)? - at(floor, fewest)?) / base)
            })
            .collect();
        if let (Some(b), true) = (median(&bounds), most > fewest) {
            out.push(format!(
                "dim {dim}: bex fetch growth if its memory cost {pages} ({}), {} / {} \
                 rows: {b:.2}{}",
                floor.name(),
                count(most),
                count(fewest),
                rests_on(&bounds, n)
            ));
        }
    }
    out
}

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}K", n / 1_000),
        n => n.to_string(),
    }
}

fn text(points: &[RunPoint], targets: &[Target]) -> String {
    let header: Vec<String> = [
        "round",
        "store",
        "dim",
        "rows",
        "B/row (RSS)",
        "x payload",
        "B/row (counted)",
        "insert Mrows/s",
        "fetch p50 µs",
        "fetch p99 µs",
        "push p50 µs",
        "push p99 µs",
        "copy p50 µs",
        "copy p99 µs",
        "export ns/row",
    ]
    .map(String::from)
    .to_vec();
    let f = |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            let r = p.report.as_ref();
            let mut row =
                vec![p.round.to_string(), p.store.name(), p.dim.to_string(), count(p.rows)];
            match (r, &p.skipped, &p.failed) {
                (_, Some(_), _) => row.push("skipped (below)".into()),
                (_, _, Some(_)) => row.push("FAILED (below)".into()),
                (None, None, None) => row.push("-".into()),
                (Some(r), None, None) => row.extend([
                    f(Some(r.rss_bytes_per_row), 1),
                    f(Some(r.rss_bytes_per_row / r.payload_bytes_per_row), 2),
                    f(r.counted_bytes_per_row, 1),
                    f(Some(r.insert_rows_per_s / 1e6), 2),
                    f(r.fetch.as_ref().map(|s| s.p50_us), 1),
                    f(r.fetch.as_ref().map(|s| s.p99_us), 1),
                    f(r.push.as_ref().map(|s| s.p50_us), 1),
                    f(r.push.as_ref().map(|s| s.p99_us), 1),
                    f(r.copy.as_ref().map(|s| s.p50_us), 1),
                    f(r.copy.as_ref().map(|s| s.p99_us), 1),
                    f(r.export_ns, 0),
                ]),
            }
            row
        })
        .collect();
    let batch = points.iter().find_map(|p| p.report.as_ref()).map_or(0, |r| r.batch);
    let mut out = render(
        &format!(
            "Table scale: Adagrad rows (values + one state slot), {batch}-key fetches, pushes and whole-row copies (a replica's apply) of random existing keys; export: every row paged out in 4 MiB chunks as snapshots do; payload = 8 + 4 x stride bytes"
        ),
        &header,
        &rows,
    );
    for p in points {
        let what =
            format!("round {}: {} dim {} {} rows", p.round, p.store.name(), p.dim, count(p.rows));
        if let Some(why) = &p.skipped {
            out.push_str(&format!("  {what}: skipped: {why}\n"));
        }
        if let Some(how) = &p.failed {
            out.push_str(&format!("  {what}: FAILED: {how}\n"));
        }
    }
    let floor = floor_growth(points);
    if !floor.is_empty() {
        out.push_str("\nMemory floor (the `floor` store)\n");
        for line in floor {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out.push_str("\nTargets\n");
    for t in targets {
        let verdict = match t.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "not measured",
        };
        out.push_str(&format!(
            "  {}: {} (limit {}) -> {verdict}\n",
            t.what,
            // Three places: at two, 1.2029 would print as "1.20" beside "NOT met".
            t.value.map_or("-".into(), |v| format!("{v:.3}")),
            t.limit
        ));
    }
    out
}

fn figure(points: &[RunPoint]) -> String {
    let series_of = |metric: &dyn Fn(&PointReport) -> Option<f64>| {
        let mut out = Vec::new();
        let keys = distinct(points.iter().map(|p| (p.dim, p.store)));
        for (i, (dim, store)) in keys.into_iter().enumerate() {
            let pts: Vec<(f64, f64)> = row_counts(points, store, dim)
                .into_iter()
                .filter_map(|rows| {
                    Some((
                        (rows as f64).log10(),
                        median(&over_rounds(points, (store, dim, rows), metric))?,
                    ))
                })
                .collect();
            let name = format!("{} dim {dim}", store.name());
            let s = Series::new(name, COLORS[i % COLORS.len()], pts);
            out.push(if store == Store::Bex { s } else { s.dashed() });
        }
        out
    };
    let rows = distinct(points.iter().map(|p| p.rows));
    let ticks: Vec<(f64, String)> = rows.iter().map(|&r| ((r as f64).log10(), count(r))).collect();
    let chart = |title: &str, y: &str, s: Vec<Series>| {
        Chart::new(title, "rows per shard", y, s).with_x_ticks(ticks.clone())
    };
    let charts = [
        chart("Memory per row (RSS)", "bytes", series_of(&|r| Some(r.rss_bytes_per_row))),
        chart("Fetch of 1000 keys, p50", "µs", series_of(&|r| r.fetch.as_ref().map(|s| s.p50_us))),
        chart("Fetch of 1000 keys, p99", "µs", series_of(&|r| r.fetch.as_ref().map(|s| s.p99_us))),
        chart("Push of 1000 keys, p50", "µs", series_of(&|r| r.push.as_ref().map(|s| s.p50_us))),
        chart("Push of 1000 keys, p99", "µs", series_of(&|r| r.push.as_ref().map(|s| s.p99_us))),
        chart(
            "Copy of 1000 rows (a replica's apply), p50",
            "µs",
            series_of(&|r| r.copy.as_ref().map(|s| s.p50_us)),
        ),
        // The floor's "insert" is writing an array, off this chart's scale.
        chart(
            "Insert rate",
            "M rows/s",
            series_of(&|r| (!r.store.is_floor()).then_some(r.insert_rows_per_s / 1e6)),
        ),
    ];
    bex_plot::grid(&charts, 2, 560.0, 340.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_count("1M"), Ok(1_000_000));
        assert_eq!(parse_count("100K"), Ok(100_000));
        assert_eq!(parse_count("5000"), Ok(5000));
        assert!(parse_count("0").is_err());
        assert!(parse_count("x").is_err());
        assert!(parse_count("99999999999999M").is_err());
    }

    #[test]
    fn a_small_point_measures_every_table_store_alike() {
        for store in [
            Store::Bex,
            Store::BexBounded,
            Store::Hashmap,
            Store::Inline,
            Store::InlineVersioned,
            Store::InlinePaged,
        ] {
            let r = point(&PointArgs { rows: 20_000, dim: 8, store, batch: 100, seconds: 0.05 });
            assert_eq!((r.rows, r.stride), (20_000, 16));
            assert!(r.insert_rows_per_s > 0.0 && r.fetch.is_some() && r.push.is_some());
            let replicates = matches!(store, Store::Bex | Store::BexBounded);
            assert_eq!(r.copy.is_some(), replicates, "{store:?}: copies measured");
            // The unbounded table only (its export paths are the bounded one's).
            let exported = r.export_ns.is_some_and(|ns| ns > 0.0);
            assert_eq!(exported, store == Store::Bex, "{store:?}: exports measured");
        }
        for &store in Store::value_variants().iter().filter(|s| s.is_floor()) {
            let r = point(&PointArgs { rows: 20_000, dim: 8, store, batch: 100, seconds: 0.05 });
            assert!(r.fetch.is_some() && r.push.is_none(), "{store:?} measures loads alone");
        }
    }

    #[test]
    fn floor_loads_fall_in_one_page_or_in_two() {
        let bytes = 64 << 20;
        let one = Floor::new(bytes, FloorLoads::OnePage);
        let two = Floor::new(bytes, FloorLoads::TwoPages);
        // Pages of memory, wherever the array starts.
        let page = |w: usize| one.words[w..].as_ptr().addr() / 4096;
        let (mut pages, mut shared) = (std::collections::HashSet::new(), 0);
        for k in (0..10_000).map(key) {
            let [a, b] = one.at(k);
            assert_eq!((page(a), b - a), (page(b), PAGE_WORDS as usize / 2), "key {k}");
            assert!(b < one.words.len());
            pages.insert(page(a));
            let [a, b] = two.at(k);
            let page = |w: usize| two.words[w..].as_ptr().addr() / 4096;
            shared += usize::from(page(a) == page(b));
        }
        // Spread over the array, not a corner of it; two pages alike about 1 key in 16384.
        assert!(pages.len() > 7_000, "{} pages", pages.len());
        assert!(shared < 5, "{shared} keys loaded one page twice");
        // The dependent loads are the one-page loads: the same words, so the same sum (of
        // small distinct values, exact in the f32 it is returned as).
        let keys: Vec<u64> = (0..10_000).map(key).collect();
        let mut one = one;
        for (i, w) in one.words.iter_mut().enumerate() {
            *w = i as u64 % 251;
        }
        let (mut independent, mut dependent) = ([0f32], [0f32]);
        one.fetch(&keys, &mut independent);
        one.loads = FloorLoads::OnePageDependent;
        one.fetch(&keys, &mut dependent);
        assert_eq!(independent, dependent);
    }

    #[test]
    fn the_inline_prototypes_hold_the_rows_the_table_does() {
        // Enough keys that buckets overflow into their neighbours; pushed twice, some in
        // batches that repeat a key, then fetched with keys never pushed mixed in; in every
        // shape (the versioned ones at load 0.9 overflow more).
        type Make = fn(TableSpec) -> Box<dyn Rows>;
        let prototypes: [(&str, Make); 3] = [
            ("inline", |spec| Box::new(inline::Inline::new(spec, 30_000, inline::Shape::BARE))),
            ("inline-versioned", |spec| {
                Box::new(inline::Inline::new(spec, 30_000, inline::Shape::VERSIONED))
            }),
            ("inline-paged", |spec| Box::new(paged::Paged::new(spec, 30_000))),
        ];
        // Dim 8 and the measured dim 16 (the paged prototype has 50 and 28 ways a page).
        for ((name, make), dim) in prototypes.into_iter().flat_map(|p| [(p, 8), (p, 16)]) {
            let spec = spec(dim);
            let mut table = Table::new(spec.clone()).expect("a valid spec");
            let mut inline = make(spec.clone());
            let keys: Vec<u64> = (0..30_000).map(key).collect();
            for round in 0..2u64 {
                for (c, chunk) in keys.chunks(700).enumerate() {
                    let mut batch = chunk.to_vec();
                    batch.push(chunk[0]);
                    let grads: Vec<f32> = (0..batch.len() * dim as usize)
                        .map(|i| ((i as u64 * 31 + c as u64 + round) % 17) as f32 / 50.0 - 0.16)
                        .collect();
                    Rows::push(&mut table, &batch, &grads);
                    inline.push(&batch, &grads);
                }
            }
            let asked: Vec<u64> =
                keys.iter().step_by(3).copied().chain((40_000..41_000).map(key)).collect();
            let n = asked.len() * dim as usize;
            let (mut a, mut b) = (vec![0f32; n], vec![1f32; n]);
            Rows::fetch(&mut table, &asked, &mut a);
            inline.fetch(&asked, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} dim {dim}");
        }
    }

    #[test]
    fn the_paged_prototype_overflows_and_still_finds_every_key() {
        let spec = spec(16);
        let mut table = Table::new(spec.clone()).expect("a valid spec");
        let mut paged = paged::Paged::new(spec.clone(), 50_000);
        let keys: Vec<u64> = (0..50_000).map(key).collect();
        for (c, chunk) in keys.chunks(1000).enumerate() {
            let grads: Vec<f32> =
                (0..chunk.len() * 16).map(|i| ((i + c) % 13) as f32 / 40.0 - 0.15).collect();
            Rows::push(&mut table, chunk, &grads);
            paged.push(chunk, &grads);
        }
        let (beyond, all) = paged.overflowed_keys();
        assert_eq!(all, 50_000);
        // At load 0.9 some pages fill (4.5% of keys leave home here), about half of
        // `inline-versioned`'s 8%.
        assert!(beyond > 0 && beyond < all / 16, "{beyond} of {all} beyond their home");
        // Every row, those beyond their home included, is the one the table holds.
        let (mut a, mut b) = (vec![0f32; keys.len() * 16], vec![1f32; keys.len() * 16]);
        Rows::fetch(&mut table, &keys, &mut a);
        paged.fetch(&keys, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    /// A bex or floor point of round `round` at `rows` whose fetch p50 is `p50`.
    fn synthetic(store: Store, rows: u64, round: u32, p50: f64, rss: f64) -> RunPoint {
        let fetch = LatencySummary { count: 1, p50_us: p50, ..Default::default() };
        let report = PointReport {
            store,
            dim: 16,
            rows,
            stride: 32,
            payload_bytes_per_row: 136.0,
            rss_bytes_per_row: rss,
            counted_bytes_per_row: None,
            insert_s: 1.0,
            insert_rows_per_s: rows as f64,
            fetch: Some(fetch),
            push: None,
            copy: None,
            export_ns: None,
            batch: 1000,
        };
        RunPoint { store, dim: 16, rows, round, report: Some(report), skipped: None, failed: None }
    }

    #[test]
    fn the_floors_price_the_growth_of_one_line_one_page_and_two_pages_a_key() {
        let mut points = Vec::new();
        // Two rounds; the one-line floor adds 40 and 30 µs, the one-page floor 56 and 40, the
        // two-page floor 80 and 100.
        for (round, bex, line, one, two) in [
            (1, (80.0, 160.0), (10.0, 50.0), (20.0, 76.0), (30.0, 110.0)),
            (2, (100.0, 190.0), (10.0, 40.0), (20.0, 60.0), (30.0, 130.0)),
        ] {
            for (store, (small, large)) in [
                (Store::Bex, bex),
                (Store::Floor, line),
                (Store::FloorOnePage, one),
                (Store::FloorTwoPages, two),
            ] {
                points.push(synthetic(store, 1_000_000, round, small, 150.0));
                points.push(synthetic(store, 100_000_000, round, large, 150.0));
            }
        }
        let lines = growth_at_floor_cost(&points, 16);
        assert_eq!(lines.len(), 3, "{lines:?}");
        // One line: (80 + 40) / 80 = 1.50 and (100 + 30) / 100 = 1.30, median 1.40.
        assert!(lines[0].contains("one line a key (floor)"), "{}", lines[0]);
        assert!(lines[0].contains(": 1.40 (median of 2 rounds: 1.50, 1.30)"), "{}", lines[0]);
        // One page: (80 + 56) / 80 = 1.70 and (100 + 40) / 100 = 1.40, median 1.55.
        assert!(lines[1].contains("one page a key (floor-one-page)"), "{}", lines[1]);
        assert!(lines[1].contains(": 1.55 (median of 2 rounds: 1.70, 1.40)"), "{}", lines[1]);
        // Two pages: (80 + 80) / 80 = 2.00 and (100 + 100) / 100 = 2.00.
        assert!(lines[2].contains(": 2.00 (median of 2 rounds: 2.00, 2.00)"), "{}", lines[2]);
        // Without the floors, nothing to say.
        points.retain(|p| p.store == Store::Bex);
        assert!(growth_at_floor_cost(&points, 16).is_empty());
    }

    #[test]
    fn targets_take_the_median_of_the_rounds_ratios() {
        // Round 1's 100M point is slow, round 3's 1M point: ratios 3.0, 1.2 and 1.4 (median
        // 1.4, met), where the ratio of the medians (182 / 100) would be 1.82, their mean 1.87
        // and a single first round 3.0.
        let mut points = Vec::new();
        for (round, small, large) in [(1, 100.0, 300.0), (2, 100.0, 120.0), (3, 130.0, 182.0)] {
            points.push(synthetic(Store::Bex, 1_000_000, round, small, 136.0 * 1.1));
            points.push(synthetic(
                Store::Bex,
                100_000_000,
                round,
                large,
                136.0 * (1.1 + 0.1 * round as f64),
            ));
        }
        let t = targets(&points);
        let growth = t.iter().find(|t| t.what.contains("fetch p50")).expect("a growth target");
        assert!((growth.value.unwrap() - 1.4).abs() < 1e-9, "{:?}", growth.value);
        assert_eq!(growth.met, Some(true));
        assert!(growth.what.contains("median of 3 rounds: 3.00, 1.20, 1.40"), "{}", growth.what);
        // Memory at 100M: 1.2, 1.3, 1.4 over the rounds, median 1.3: not met.
        let memory = t.iter().find(|t| t.what.contains("100M rows: memory")).expect("memory");
        assert!((memory.value.unwrap() - 1.3).abs() < 1e-9);
        assert_eq!(memory.met, Some(false));

        // 100M failed in rounds 2 and 3: the verdicts rest on round 1 alone, and say so.
        for p in points.iter_mut().filter(|p| p.rows == 100_000_000 && p.round > 1) {
            (p.report, p.failed) = (None, Some("killed".into()));
        }
        let t = targets(&points);
        let growth = t.iter().find(|t| t.what.contains("fetch p50")).expect("a growth target");
        assert_eq!(growth.value, Some(3.0));
        assert!(
            growth.what.contains("the 1 of 3 rounds that measured it: 3.00"),
            "{}",
            growth.what
        );
        let memory = t.iter().find(|t| t.what.contains("100M rows: memory")).expect("memory");
        assert!(memory.what.contains("1 of 3 rounds"), "{}", memory.what);
        // And 1M failed in round 1: no round measured both sizes, so growth is not measured
        // (a target still listed, not dropped).
        points[0].report = None;
        let t = targets(&points);
        let growth = t.iter().find(|t| t.what.contains("fetch p50")).expect("still listed");
        assert_eq!((growth.value, growth.met), (None, None));
    }

    #[test]
    fn every_option_is_documented() {
        use clap::CommandFactory;
        bex_bench::cli::assert_documented(Cli::command());
    }
}
