//! Checkpoints (atomic files with a checksum) and streaming snapshots (chunks of rows to
//! bootstrap a replica from a peer).
//!
//! # Checkpoint file (all little-endian)
//!
//! Header, 64 bytes:
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 8 | magic `b"BEXCKPT\0"` |
//! | 8 | 4 | version (3; 2, without row versions, and 1, without dedupe windows either, are still read) |
//! | 12 | 4 | header length (64) |
//! | 16 | 8 | body length in bytes |
//! | 24 | 4 | CRC-32 (IEEE) of the body |
//! | 28 | 4 | number of tables |
//! | 32 | 4 | shard |
//! | 36 | 4 | shards |
//! | 40 | 8 | update sequence (caller's replication position) |
//! | 48 | 8 | creation time, ms since the Unix epoch (caller's clock) |
//! | 56 | 4 | CRC-32 of bytes 0..56 |
//! | 60 | 4 | number of dedupe windows (version 1: 0) |
//!
//! Body: per table, a table header — name length (u16), name (UTF-8), dim (u32),
//! stride (u32: f32 per row including optimizer state), optimizer kind (u8:
//! 0 SGD, 1 Adagrad, 2 Adam, 3 FTRL), row count (u64) — then that many row records:
//! key (u64), row version (u64; not in versions 1 and 2), Adam step count (u32), `stride` ×
//! f32 (values, then optimizer state). Then the dedupe windows (version 2 on): client
//! (u64), highest sequence (u64), words (u32), that many u64 of window bits. The caller takes rows and windows at one point (no update in
//! between), so a push is in a checkpoint with its dedupe entry, or not at all.
//!
//! Writing goes to `<path>.tmp`, streams the body through a CRC, rewrites the header,
//! `fsync`s the file, renames the checkpoint it replaces to `<path>.prev`, renames the new one
//! to `path` and `fsync`s the directory: a crash leaves either the old checkpoint or the new
//! one, never a torn one. [`restore_checkpoint`] falls back to the previous generation when
//! the latest is missing (a crash between the renames) or its contents are unusable (a
//! corrupt disk block): a corrupt checkpoint used to stop the server with nothing to fall
//! back to. Two generations take twice the disk. Reading verifies both CRCs,
//! every length and every table against the expected definitions before returning tables;
//! any mismatch is an error (never silently wrong data).
//!
//! Rows are copied out one stripe at a time under that stripe's read lock, so a checkpoint
//! taken while pushes continue is consistent per row (not a point-in-time cut across rows);
//! the update sequence recorded is the caller's position *before* the copy began.
//!
//! # Snapshot chunk (streaming bootstrap)
//!
//! A replica pulls a peer's tables with Snapshot requests carrying a
//! [`SnapshotCursor`]; each answer is one chunk, at most `max_bytes`, of rows from one table:
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 4 | magic `b"BXSC"` |
//! | 4 | 4 | version (2) |
//! | 8 | 4 | table id |
//! | 12 | 4 | dim |
//! | 16 | 4 | stride |
//! | 20 | 4 | rows in this chunk (a windows chunk: windows) |
//! | 24 | 4 | flags (bit 0: last chunk; bit 1: dedupe windows instead of rows) |
//! | 28 | 4 | CRC-32 of the whole chunk with this field zeroed |
//! | 32 | 8 | next cursor: epoch |
//! | 40 | 4 | next cursor: table |
//! | 44 | 4 | next cursor: stripe |
//! | 48 | 4 | next cursor: row |
//! | 52 | 4 | reserved (0) |
//! | 56 | … | row records as in the checkpoint body (version 3), or dedupe windows |
//!
//! A cursor past the last table (a client asks for it first, and it follows the last table's
//! rows) gets windows chunks (table `u32::MAX`): the source's dedupe windows encoded as in
//! the checkpoint body, in client order, paged by client: the cursor's stripe and row are the
//! high and low halves of the first client id wanted, each chunk holds the windows from there
//! that fit `max_bytes`, and the last one is flagged last. (One unpaged chunk of every window
//! could outgrow the RPC frame limit with large windows, and then every copy failed.) A
//! restarted training shard learns which pushes the rows it copies already hold, so their
//! retries are answered Duplicate rather than applied twice; asked for before the rows, the
//! windows name no push whose rows the copy lacks.
//!
//! Stripes only grow and a row keeps its slot until it is evicted or expires (a displaced
//! row's slot goes to the new row), so a (table, stripe, row) cursor visits every row that
//! lives from the snapshot's start to its end once; rows created, displaced or expired
//! meanwhile may or may not be included, and the replication stream carries what they
//! became. (A layout whose rows move would need a cursor by index position, a key's hash,
//! instead; one was built and measured, then removed with the layout it was for: in this
//! slab it read rows at random, 517 ns a row at 100M rows against 34 by slot,
//! `results/table-scale`.) Rows carry versions and are applied only over older rows, so a bootstrapping
//! replica applies chunks and the replication stream as they come, in any order, and ends
//! at the newest rows (see [`crate::table`]). Rows never pushed (version 0) are not sent:
//! the receiver's initializer recreates their values.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::dedupe::WindowState;
use crate::table::{ExportRows, RecordFormat, SeenRow, TableError, TableSet, STRIPES};
#[cfg(doc)]
use crate::Table;
use bex_ps_proto::control::SnapshotCursor;
use bex_ps_proto::optim::OptimizerKind;
use bex_ps_proto::wire::{rd_u16, rd_u32, rd_u64};
use bex_ps_proto::TableSpec;

/// Checkpoint magic.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"BEXCKPT\0";
/// Checkpoint format version.
pub const CHECKPOINT_VERSION: u32 = 3;
/// Snapshot chunk format version.
const CHUNK_VERSION: u32 = 2;
/// Most words of one stored dedupe window (a window of 2^20 sequence numbers).
const MAX_WINDOW_WORDS: u32 = (1 << 20) / 64;
/// Checkpoint header length.
pub const CHECKPOINT_HEADER_LEN: usize = 64;
/// Snapshot chunk magic.
pub const CHUNK_MAGIC: [u8; 4] = *b"BXSC";
/// Snapshot chunk header length.
pub const CHUNK_HEADER_LEN: usize = 56;
const CHUNK_LAST: u32 = 1;
const CHUNK_WINDOWS: u32 = 2;
/// The table id of a windows chunk.
const WINDOWS_TABLE: u32 = u32::MAX;

/// What a checkpoint records besides rows (all chosen by the caller).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointMeta {
    /// Shard of the writer.
    pub shard: u32,
    /// Shards in the cluster when written.
    pub shards: u32,
    /// Replication sequence when the checkpoint began.
    pub update_seq: u64,
    /// Creation time, ms since the Unix epoch.
    pub created_ms: u64,
}

/// The outcome of writing a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Final path.
    pub path: PathBuf,
    /// File size.
    pub bytes: u64,
    /// Rows written.
    pub rows: u64,
    /// CRC-32 of the body.
    pub body_crc32: u32,
}

/// Why a checkpoint or snapshot chunk could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file system failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Not a checkpoint / chunk (magic), or a version this build does not read.
    #[error("not a bex checkpoint or chunk, or unsupported version: {0}")]
    Format(String),
    /// A checksum does not match: the data is corrupt.
    #[error("checksum mismatch in {what}: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Header, body or chunk.
        what: &'static str,
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// The file ends early or lengths disagree.
    #[error("truncated or inconsistent: {0}")]
    Truncated(String),
    /// The stored tables do not match the expected definitions.
    #[error("table mismatch: {0}")]
    Mismatch(String),
    /// A snapshot cursor from another epoch (the peer restarted): start again.
    #[error("snapshot cursor from epoch {got:#x}, serving epoch {serving:#x}")]
    StaleCursor {
        /// Cursor's epoch.
        got: u64,
        /// The serving set's epoch.
        serving: u64,
    },
    /// Building tables failed.
    #[error(transparent)]
    Table(#[from] TableError),
    /// Written by a newer build (a rolled-back binary): no reason to use an older generation.
    #[error("checkpoint version {0} is newer than this build reads ({CHECKPOINT_VERSION})")]
    NewerVersion(u32),
    /// Written by another shard, or with another shard count: its rows belong to another
    /// layout (a configuration mistake, the same for every generation).
    #[error(
        "{path} was written by shard {} of {}, this is shard {} of {}: its rows belong to \
         another layout",
        written.0, written.1, want.0, want.1
    )]
    OtherLayout {
        /// The file.
        path: PathBuf,
        /// (shard, shards) of its writer.
        written: (u32, u32),
        /// (shard, shards) of the reader.
        want: (u32, u32),
    },
    /// Neither the latest checkpoint nor the previous generation could be read.
    #[error("{latest}; and the previous generation: {previous}")]
    BothUnusable {
        /// The latest's problem.
        latest: Box<CheckpointError>,
        /// The previous generation's.
        previous: Box<CheckpointError>,
    },
}

impl CheckpointError {
    /// The file's contents are unusable (or it is missing), so an older generation may do:
    /// not for table mismatches (a configuration change, the same in every generation) nor
    /// for I/O errors other than a missing file (permissions: nothing to fall back from).
    fn older_generation_may_do(&self) -> bool {
        match self {
            CheckpointError::Io { source, .. } => source.kind() == io::ErrorKind::NotFound,
            CheckpointError::Format(_)
            | CheckpointError::Checksum { .. }
            | CheckpointError::Truncated(_) => true,
            _ => false,
        }
    }
}

/// Where a checkpoint of `path` is written before it is renamed into place (a crash between
/// the renames leaves the newest generation there alone: see [`restore_checkpoint`]).
pub fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Where the generation before the checkpoint at `path` is kept.
pub fn previous_generation(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".prev");
    path.with_file_name(name)
}

/// Where an unusable latest checkpoint is moved by [`restore_checkpoint`], kept for a look.
pub fn unusable_generation(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".unusable");
    path.with_file_name(name)
}

/// What [`restore_checkpoint`] read.
#[derive(Debug)]
pub struct Restored {
    /// The tables.
    pub tables: TableSet,
    /// The checkpoint's header fields.
    pub meta: CheckpointMeta,
    /// The dedupe windows stored with the rows.
    pub windows: Vec<WindowState>,
    /// The file read.
    pub from: PathBuf,
    /// Why the latest generation was not used, when the previous one was.
    pub latest_unusable: Option<CheckpointError>,
}

/// Reads the checkpoint at `path` ([`read_checkpoint`]) or, when it is missing or its
/// contents are unusable, the previous generation ([`previous_generation`]), for shard
/// `layout.0` of `layout.1`: a generation another layout wrote is an error
/// ([`CheckpointError::OtherLayout`]) and nothing is moved. An unusable latest file is moved
/// to [`unusable_generation`] once the previous generation has been read and checked, so
/// the next checkpoint does not rotate it into the previous generation's place (moved
/// earlier, a restore that then failed would have left it aside). `Ok(None)`: neither
/// exists.
pub fn restore_checkpoint(
    path: &Path,
    specs: &[TableSpec],
    layout: (u32, u32),
) -> Result<Option<Restored>, CheckpointError> {
    let read = |from: &Path| -> Result<Restored, CheckpointError> {
        let (tables, meta, windows) = read_checkpoint(from, specs)?;
        let written = (meta.shard, meta.shards);
        if written != layout {
            let path = from.to_owned();
            return Err(CheckpointError::OtherLayout { path, written, want: layout });
        }
        let from = from.to_owned();
        Ok(Restored { tables, meta, windows, from, latest_unusable: None })
    };
    let prev = previous_generation(path);
    let latest = match read(path) {
        Ok(r) => return Ok(Some(r)),
        Err(e) if e.older_generation_may_do() => e,
        Err(e) => return Err(e),
    };
    let missing = matches!(&latest, CheckpointError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound);
    if missing {
        // A crash between the two renames of a write: the new checkpoint is whole (written
        // and synced) under its temporary name. Finish the write.
        // A `.tmp` that is missing, cut short or corrupt (a crash while writing), or not a
        // file at all, is passed over; one this build cannot read for another reason (a newer
        // version, EIO, other tables or layout) stops the restore like a latest file would:
        // it may be the newest.
        let tmp = temporary(path);
        match read(&tmp) {
            Ok(r) => {
                fs::rename(&tmp, path).map_err(io_err(path))?;
                sync_dir(path)?;
                return Ok(Some(Restored { from: path.to_owned(), ..r }));
            }
            Err(e) if e.older_generation_may_do() => {}
            Err(CheckpointError::Io { source, .. })
                if source.kind() == io::ErrorKind::IsADirectory => {}
            Err(e) => return Err(e),
        }
    }
    match read(&prev) {
        Ok(r) => {
            if !missing {
                fs::rename(path, unusable_generation(path)).map_err(io_err(path))?;
            }
            Ok(Some(Restored { latest_unusable: Some(latest), ..r }))
        }
        Err(CheckpointError::Io { source, .. })
            if missing && source.kind() == io::ErrorKind::NotFound =>
        {
            Ok(None)
        }
        Err(CheckpointError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            Err(latest)
        }
        // A configuration matter: what is wrong with the latest is beside the point.
        Err(e @ CheckpointError::OtherLayout { .. }) => Err(e),
        Err(previous) => Err(CheckpointError::BothUnusable {
            latest: Box::new(latest),
            previous: Box::new(previous),
        }),
    }
}

/// The directory `path` is in.
fn dir_of(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Makes renames into `path`'s directory durable.
fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    let dir = dir_of(path);
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_owned(), source }
}

/// A writer that counts bytes and CRCs them.
struct CrcWriter<W> {
    inner: W,
    crc: crc32fast::Hasher,
    len: u64,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Bytes of rows copied per stripe-lock acquisition (writing) or per read (restoring).
const BATCH_BYTES: usize = 4 << 20;

/// Rows per batch for records of `record_len` bytes (at least one).
fn batch_rows(record_len: usize) -> usize {
    (BATCH_BYTES / record_len.max(1)).max(1)
}

/// Writes `tables` and the dedupe `windows` to `path` atomically (see the module docs).
pub fn write_checkpoint(
    path: &Path,
    tables: &TableSet,
    windows: &[WindowState],
    meta: &CheckpointMeta,
) -> Result<CheckpointInfo, CheckpointError> {
    let dir = dir_of(path);
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let tmp = temporary(path);
    let result = write_tmp(&tmp, tables, windows, meta);
    let (bytes, rows, body_crc32) = match result {
        Ok(v) => v,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    // The generation this one replaces stays as the previous one (a missing one, after a
    // restore moved an unusable file away, leaves the previous generation as it is).
    match fs::rename(path, previous_generation(path)) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(path)(e));
        }
    }
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path)(e));
    }
    sync_dir(path)?;
    Ok(CheckpointInfo { path: path.to_owned(), bytes, rows, body_crc32 })
}

fn write_tmp(
    tmp: &Path,
    tables: &TableSet,
    windows: &[WindowState],
    meta: &CheckpointMeta,
) -> Result<(u64, u64, u32), CheckpointError> {
    let err = io_err(tmp);
    let file = OpenOptions::new().write(true).create(true).truncate(true).open(tmp).map_err(err)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&[0u8; CHECKPOINT_HEADER_LEN]).map_err(io_err(tmp))?;
    let mut body = CrcWriter { inner: out, crc: crc32fast::Hasher::new(), len: 0 };
    let mut rows_total = 0u64;
    let mut buf = Vec::new();
    let _no_expiry = tables.hold_rows();
    for (_, t) in tables.iter() {
        // Count first so the table header can carry the count; rows created after the count
        // are left for the next checkpoint (at most `counts[s]` rows are taken per stripe).
        // A bounded stripe's count does not fall meanwhile: a row displaced for a new one is
        // replaced in its slot, and expiry waits for the checkpoint (`TableSet::no_shrink`).
        let counts: Vec<usize> = (0..STRIPES).map(|s| t.stripe_rows(s)).collect();
        let rows: u64 = counts.iter().map(|&c| c as u64).sum();
        let spec = t.spec();
        let name = spec.name.as_bytes();
        let mut th = Vec::with_capacity(2 + name.len() + 17);
        th.extend_from_slice(&(name.len() as u16).to_le_bytes());
        th.extend_from_slice(name);
        th.extend_from_slice(&spec.dim.to_le_bytes());
        th.extend_from_slice(&(t.stride() as u32).to_le_bytes());
        th.push(spec.optimizer.kind() as u8);
        th.extend_from_slice(&rows.to_le_bytes());
        body.write_all(&th).map_err(io_err(tmp))?;
        for (s, &count) in counts.iter().enumerate() {
            let (mut slot, mut written) = (0, 0);
            while written < count {
                buf.clear();
                let (scanned, n) = t.export_records(
                    ExportRows::Live,
                    s,
                    slot,
                    batch_rows(t.record_len()).min(count - written),
                    &mut buf,
                );
                if n == 0 {
                    return Err(CheckpointError::Truncated("stripe shrank while writing".into()));
                }
                body.write_all(&buf).map_err(io_err(tmp))?;
                slot += scanned;
                written += n;
            }
        }
        rows_total += rows;
    }
    let n_windows = u32::try_from(windows.len())
        .map_err(|_| CheckpointError::Truncated("too many dedupe windows".into()))?;
    buf.clear();
    encode_windows(windows, &mut buf)?;
    body.write_all(&buf).map_err(io_err(tmp))?;
    let body_len = body.len;
    let body_crc = body.crc.finalize();
    let mut out = body.inner;
    let mut h = [0u8; CHECKPOINT_HEADER_LEN];
    h[0..8].copy_from_slice(&CHECKPOINT_MAGIC);
    h[8..12].copy_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(CHECKPOINT_HEADER_LEN as u32).to_le_bytes());
    h[16..24].copy_from_slice(&body_len.to_le_bytes());
    h[24..28].copy_from_slice(&body_crc.to_le_bytes());
    h[28..32].copy_from_slice(&(tables.len() as u32).to_le_bytes());
    h[32..36].copy_from_slice(&meta.shard.to_le_bytes());
    h[36..40].copy_from_slice(&meta.shards.to_le_bytes());
    h[40..48].copy_from_slice(&meta.update_seq.to_le_bytes());
    h[48..56].copy_from_slice(&meta.created_ms.to_le_bytes());
    let hcrc = crc32fast::hash(&h[..56]);
    h[56..60].copy_from_slice(&hcrc.to_le_bytes());
    h[60..64].copy_from_slice(&n_windows.to_le_bytes());
    out.flush().map_err(io_err(tmp))?;
    let mut file = out.into_inner().map_err(|e| io_err(tmp)(e.into_error()))?;
    file.seek(SeekFrom::Start(0)).map_err(io_err(tmp))?;
    file.write_all(&h).map_err(io_err(tmp))?;
    file.sync_all().map_err(io_err(tmp))?;
    Ok((CHECKPOINT_HEADER_LEN as u64 + body_len, rows_total, body_crc))
}

/// Appends dedupe windows as the checkpoint body and windows chunks store them.
fn encode_windows(windows: &[WindowState], out: &mut Vec<u8>) -> Result<(), CheckpointError> {
    for w in windows {
        let words = u32::try_from(w.bits.len()).ok().filter(|&n| n <= MAX_WINDOW_WORDS);
        let words = words.ok_or_else(|| CheckpointError::Truncated("dedupe window size".into()))?;
        out.extend_from_slice(&w.client.to_le_bytes());
        out.extend_from_slice(&w.high.to_le_bytes());
        out.extend_from_slice(&words.to_le_bytes());
        for b in &w.bits {
            out.extend_from_slice(&b.to_le_bytes());
        }
    }
    Ok(())
}

/// Reads `n` windows as [`encode_windows`] wrote them, each part through `read` (which
/// fills the buffer it is given or fails: a window is at most 128 KiB, so a lying length
/// costs no more than that before the read fails).
fn decode_windows(
    n: u32,
    mut read: impl FnMut(&mut [u8], &str) -> Result<(), CheckpointError>,
) -> Result<Vec<WindowState>, CheckpointError> {
    let mut windows = Vec::new();
    let mut buf = Vec::new();
    for _ in 0..n {
        let mut wh = [0u8; 20];
        read(&mut wh, "dedupe window")?;
        let (client, high, words) = (rd_u64(&wh, 0), rd_u64(&wh, 8), rd_u32(&wh, 16));
        if words > MAX_WINDOW_WORDS {
            return Err(CheckpointError::Truncated(format!("dedupe window of {words} words")));
        }
        buf.resize(words as usize * 8, 0);
        read(&mut buf, "dedupe window bits")?;
        let bits = buf.chunks_exact(8).map(|c| rd_u64(c, 0)).collect();
        windows.push(WindowState { client, high, bits });
    }
    Ok(windows)
}

/// A reader that CRCs and counts what it reads, bounded by the declared body length.
struct CrcReader<'p, R> {
    inner: R,
    crc: crc32fast::Hasher,
    left: u64,
    path: &'p Path,
}

impl<R: Read> CrcReader<'_, R> {
    fn read_exact_body(&mut self, buf: &mut [u8], what: &str) -> Result<(), CheckpointError> {
        if (buf.len() as u64) > self.left {
            return Err(CheckpointError::Truncated(format!("{what} runs past the body")));
        }
        self.inner.read_exact(buf).map_err(|e| read_err(self.path, what, e))?;
        self.crc.update(buf);
        self.left -= buf.len() as u64;
        Ok(())
    }

    /// Reads the rest of the body through the CRC: true if it matches `stored`.
    fn rest_matches(&mut self, stored: u32) -> Result<bool, CheckpointError> {
        let mut buf = vec![0u8; BATCH_BYTES];
        while self.left > 0 {
            let n = self.left.min(buf.len() as u64) as usize;
            self.read_exact_body(&mut buf[..n], "body")?;
        }
        Ok(self.crc.clone().finalize() == stored)
    }
}

/// A read that failed: the file ending early is truncation (its contents are unusable); any
/// other error is the file system's (EIO: the same file may read next time, so it is no
/// reason to use an older generation).
fn read_err(path: &Path, what: &str, e: io::Error) -> CheckpointError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        CheckpointError::Truncated(format!("{what}: {e}"))
    } else {
        CheckpointError::Io { path: path.to_owned(), source: e }
    }
}

/// Reads and verifies the checkpoint at `path`, building tables from `specs` (matched by
/// name; a stored table must exist in `specs` with the same dim and optimizer kind; tables of
/// `specs` absent from the file start empty), and the dedupe windows stored with them (none
/// in a version-1 file). Returns nothing unless every check passes.
pub fn read_checkpoint(
    path: &Path,
    specs: &[TableSpec],
) -> Result<(TableSet, CheckpointMeta, Vec<WindowState>), CheckpointError> {
    let file = File::open(path).map_err(io_err(path))?;
    let file_len = file.metadata().map_err(io_err(path))?.len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut h = [0u8; CHECKPOINT_HEADER_LEN];
    r.read_exact(&mut h).map_err(|e| read_err(path, "header", e))?;
    if h[0..8] != CHECKPOINT_MAGIC {
        return Err(CheckpointError::Format("bad magic".into()));
    }
    let stored_hcrc = rd_u32(&h, 56);
    let hcrc = crc32fast::hash(&h[..56]);
    if stored_hcrc != hcrc {
        return Err(CheckpointError::Checksum {
            what: "header",
            stored: stored_hcrc,
            computed: hcrc,
        });
    }
    let version = rd_u32(&h, 8);
    let n_windows = rd_u32(&h, 60);
    if version > CHECKPOINT_VERSION {
        return Err(CheckpointError::NewerVersion(version));
    }
    if !(1..=CHECKPOINT_VERSION).contains(&version)
        || rd_u32(&h, 12) as usize != CHECKPOINT_HEADER_LEN
        || (version == 1 && n_windows != 0)
    {
        return Err(CheckpointError::Format(format!("version {version}")));
    }
    let body_len = rd_u64(&h, 16);
    if CHECKPOINT_HEADER_LEN as u64 + body_len != file_len {
        return Err(CheckpointError::Truncated(format!(
            "header says {} bytes, file has {file_len}",
            CHECKPOINT_HEADER_LEN as u64 + body_len
        )));
    }
    let stored_crc = rd_u32(&h, 24);
    let n_tables = rd_u32(&h, 28);
    let meta = CheckpointMeta {
        shard: rd_u32(&h, 32),
        shards: rd_u32(&h, 36),
        update_seq: rd_u64(&h, 40),
        created_ms: rd_u64(&h, 48),
    };
    let set = TableSet::new(specs.to_vec())?;
    let mut body = CrcReader { inner: r, crc: crc32fast::Hasher::new(), left: body_len, path };
    let windows = match read_body(&mut body, &set, n_tables, version, n_windows) {
        Ok(windows) => windows,
        // The body checksum is checked last; a corrupt block that makes the body parse as
        // something else (another table name or dim, a version out of range, a row count
        // past the end) is corruption all the same, which an older generation can replace.
        Err(e) if !matches!(e, CheckpointError::Io { .. }) => {
            let stored = stored_crc;
            return match body.rest_matches(stored) {
                Ok(true) => Err(e),
                Ok(false) => Err(CheckpointError::Checksum {
                    what: "body",
                    stored,
                    computed: body.crc.clone().finalize(),
                }),
                Err(io) => Err(io),
            };
        }
        Err(e) => return Err(e),
    };
    if body.left != 0 {
        return Err(CheckpointError::Truncated(format!(
            "{} bytes after the last table",
            body.left
        )));
    }
    let crc = body.crc.finalize();
    if crc != stored_crc {
        return Err(CheckpointError::Checksum { what: "body", stored: stored_crc, computed: crc });
    }
    Ok((set, meta, windows))
}

/// The tables' rows (into `set`) and the dedupe windows of a checkpoint body.
fn read_body<R: Read>(
    body: &mut CrcReader<'_, R>,
    set: &TableSet,
    n_tables: u32,
    version: u32,
    n_windows: u32,
) -> Result<Vec<WindowState>, CheckpointError> {
    let mut seen = std::collections::HashSet::new();
    let mut buf = Vec::new();
    for _ in 0..n_tables {
        let mut l = [0u8; 2];
        body.read_exact_body(&mut l, "table header")?;
        let mut name = vec![0u8; rd_u16(&l, 0) as usize];
        body.read_exact_body(&mut name, "table name")?;
        let name =
            String::from_utf8(name).map_err(|_| CheckpointError::Truncated("table name".into()))?;
        let mut th = [0u8; 17];
        body.read_exact_body(&mut th, "table header")?;
        let (dim, stride, kind, rows) = (rd_u32(&th, 0), rd_u32(&th, 4), th[8], rd_u64(&th, 9));
        let id = set.id_of(&name).ok_or_else(|| {
            CheckpointError::Mismatch(format!("table {name:?} is not configured"))
        })?;
        if !seen.insert(id) {
            return Err(CheckpointError::Mismatch(format!("table {name:?} stored twice")));
        }
        let t = set.get(id).ok_or_else(|| CheckpointError::Mismatch(name.clone()))?;
        if dim != t.spec().dim
            || stride as usize != t.stride()
            || OptimizerKind::from_u8(kind) != Some(t.spec().optimizer.kind())
        {
            return Err(CheckpointError::Mismatch(format!(
                "table {name:?}: stored dim {dim}, stride {stride}, optimizer {kind}; configured dim {}, stride {}, optimizer {:?}",
                t.spec().dim,
                t.stride(),
                t.spec().optimizer.kind()
            )));
        }
        let format = if version >= 3 { RecordFormat::Versioned } else { RecordFormat::Unversioned };
        let rl = t.record_len_of(format) as u64;
        let total = rows.checked_mul(rl).filter(|&b| b <= body.left).ok_or_else(|| {
            CheckpointError::Truncated(format!("table {name:?}: {rows} rows do not fit the body"))
        })?;
        let mut left = total;
        while left > 0 {
            let n = left.min(rl * batch_rows(rl as usize) as u64) as usize;
            buf.resize(n, 0);
            body.read_exact_body(&mut buf, "rows")?;
            t.import_records(&buf, format, &mut |_| {})?;
            left -= n as u64;
        }
    }
    decode_windows(n_windows, |b, what| body.read_exact_body(b, what))
}

/// When the next periodic checkpoint is due (pure; `now` from the caller's clock). On-demand
/// checkpoints also count as done, postponing the next periodic one by a full interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointSchedule {
    interval: Option<Duration>,
    next: Option<Instant>,
}

impl CheckpointSchedule {
    /// Every `interval` from `now` (`Duration::ZERO`: never periodic).
    pub fn new(interval: Duration, now: Instant) -> CheckpointSchedule {
        let interval = (!interval.is_zero()).then_some(interval);
        CheckpointSchedule { interval, next: interval.map(|i| now + i) }
    }

    /// The deadline of the next periodic checkpoint, if any (for a timer).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.next
    }

    /// True when a periodic checkpoint is due at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        self.next.is_some_and(|n| now >= n)
    }

    /// A checkpoint (periodic or on demand) finished at `now`.
    pub fn completed(&mut self, now: Instant) {
        self.next = self.interval.map(|i| now + i);
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming snapshots.

/// A decoded snapshot chunk (what [`apply_snapshot_chunk`] did).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Table of the rows.
    pub table: u32,
    /// Rows applied.
    pub rows: u32,
    /// Cursor for the next request; `None` after the last chunk.
    pub next: Option<SnapshotCursor>,
    /// The source's dedupe windows (a windows chunk; empty otherwise).
    pub windows: Vec<WindowState>,
}

impl ChunkInfo {
    /// True for a chunk of dedupe windows (rows chunks name a table).
    pub fn is_windows(&self) -> bool {
        self.table == WINDOWS_TABLE
    }
}

/// Appends to `out` the chunk that continues `cursor` over `tables`, at most `max_bytes`
/// (but always at least one row when rows remain; `max_bytes` must hold the header and one
/// row of every table); past the last table, the windows chunk of `windows()` from the
/// cursor's client on (as many whole windows as fit, and at least one).
/// Returns the number of rows (or windows) in it. A cursor from another epoch is
/// [`CheckpointError::StaleCursor`]; [`SnapshotCursor::START`] is accepted by any epoch.
pub fn snapshot_chunk(
    tables: &TableSet,
    cursor: SnapshotCursor,
    max_bytes: usize,
    windows: impl FnOnce() -> Vec<WindowState>,
    out: &mut Vec<u8>,
) -> Result<u32, CheckpointError> {
    if cursor.epoch != 0 && cursor.epoch != tables.epoch() {
        return Err(CheckpointError::StaleCursor { got: cursor.epoch, serving: tables.epoch() });
    }
    let start = out.len();
    out.resize(start + CHUNK_HEADER_LEN, 0);
    if cursor.table as usize >= tables.len() {
        let from = (u64::from(cursor.stripe) << 32) | u64::from(cursor.row);
        let mut windows = windows();
        windows.retain(|w| w.client >= from);
        windows.sort_unstable_by_key(|w| w.client);
        let mut n = 0usize;
        for w in &windows {
            // At least one window per chunk, so paging always advances: a window is at most
            // 128 KiB, well inside a frame, even where `max_bytes` is smaller.
            let len = 20 + w.bits.len() * 8;
            if n > 0 && out.len() - start + len > max_bytes {
                break;
            }
            encode_windows(std::slice::from_ref(w), out)?;
            n += 1;
        }
        let (flags, next) = match windows.get(n) {
            Some(w) => {
                let (stripe, row) = ((w.client >> 32) as u32, w.client as u32);
                (
                    CHUNK_WINDOWS,
                    SnapshotCursor { epoch: tables.epoch(), table: WINDOWS_TABLE, stripe, row },
                )
            }
            None => {
                (CHUNK_LAST | CHUNK_WINDOWS, SnapshotCursor { epoch: tables.epoch(), ..cursor })
            }
        };
        let n = u32::try_from(n)
            .map_err(|_| CheckpointError::Truncated("too many dedupe windows".into()))?;
        finish_chunk(&mut out[start..], WINDOWS_TABLE, (0, 0), n, flags, next);
        return Ok(n);
    }
    let (mut table, mut stripe, mut row) =
        (cursor.table, cursor.stripe as usize, cursor.row as usize);
    let mut rows = 0usize;
    let mut chunk_table = table;
    let mut dim = 0u32;
    let mut stride = 0u32;
    // Skip exhausted stripes/tables until a row is found or everything is done; then fill
    // from that table only.
    while let Some(t) = tables.get(table) {
        if stripe >= STRIPES {
            table += 1;
            stripe = 0;
            row = 0;
            continue;
        }
        if rows == 0 {
            chunk_table = table;
            dim = t.spec().dim;
            stride = t.stride() as u32;
            if CHUNK_HEADER_LEN + t.record_len() > max_bytes {
                return Err(CheckpointError::Truncated(format!(
                    "max_bytes {max_bytes} cannot hold one row of table {table}"
                )));
            }
        } else if table != chunk_table {
            break;
        }
        let room = max_bytes.saturating_sub(out.len() - start) / t.record_len();
        if room == 0 {
            break;
        }
        // Rows never pushed hold initial values, which the receiver's initializer recreates.
        let (scanned, n) = t.export_records(ExportRows::Pushed, stripe, row, room, out);
        rows += n;
        row += scanned;
        if n < room {
            // Stripe exhausted (for now).
            stripe += 1;
            row = 0;
        } else {
            break;
        }
    }
    // Past the last table the windows chunk follows (never "last" here).
    let next =
        SnapshotCursor { epoch: tables.epoch(), table, stripe: stripe as u32, row: row as u32 };
    finish_chunk(&mut out[start..], chunk_table, (dim, stride), rows as u32, 0, next);
    Ok(rows as u32)
}

/// Writes the header of the chunk in `chunk` (header then body) and its CRC.
fn finish_chunk(
    chunk: &mut [u8],
    table: u32,
    (dim, stride): (u32, u32),
    rows: u32,
    flags: u32,
    next: SnapshotCursor,
) {
    let h = &mut chunk[..CHUNK_HEADER_LEN];
    h[0..4].copy_from_slice(&CHUNK_MAGIC);
    h[4..8].copy_from_slice(&CHUNK_VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&table.to_le_bytes());
    h[12..16].copy_from_slice(&dim.to_le_bytes());
    h[16..20].copy_from_slice(&stride.to_le_bytes());
    h[20..24].copy_from_slice(&rows.to_le_bytes());
    h[24..28].copy_from_slice(&flags.to_le_bytes());
    h[28..32].fill(0);
    h[32..40].copy_from_slice(&next.epoch.to_le_bytes());
    h[40..44].copy_from_slice(&next.table.to_le_bytes());
    h[44..48].copy_from_slice(&next.stripe.to_le_bytes());
    h[48..52].copy_from_slice(&next.row.to_le_bytes());
    h[52..56].fill(0);
    let crc = crc32fast::hash(chunk);
    chunk[28..32].copy_from_slice(&crc.to_le_bytes());
}

/// Verifies a chunk and applies its rows (values, optimizer state, steps, version) to
/// `tables`, each only over an older row; `seen(table, key, version)` gets every row of it.
/// The chunk's table must match the local definition (dim and stride). A windows chunk's
/// windows are returned, not applied.
pub fn apply_snapshot_chunk(
    tables: &TableSet,
    chunk: &[u8],
    seen: &mut dyn FnMut(u32, SeenRow),
) -> Result<ChunkInfo, CheckpointError> {
    if chunk.len() < CHUNK_HEADER_LEN {
        return Err(CheckpointError::Truncated(format!("chunk of {} bytes", chunk.len())));
    }
    if chunk[0..4] != CHUNK_MAGIC || rd_u32(chunk, 4) != CHUNK_VERSION {
        return Err(CheckpointError::Format("snapshot chunk magic or version".into()));
    }
    let stored = rd_u32(chunk, 28);
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&chunk[..28]);
    hasher.update(&[0u8; 4]);
    hasher.update(&chunk[32..]);
    let computed = hasher.finalize();
    if stored != computed {
        return Err(CheckpointError::Checksum { what: "snapshot chunk", stored, computed });
    }
    let (table, dim, stride, rows, flags) = (
        rd_u32(chunk, 8),
        rd_u32(chunk, 12),
        rd_u32(chunk, 16),
        rd_u32(chunk, 20),
        rd_u32(chunk, 24),
    );
    let next = SnapshotCursor {
        epoch: rd_u64(chunk, 32),
        table: rd_u32(chunk, 40),
        stripe: rd_u32(chunk, 44),
        row: rd_u32(chunk, 48),
    };
    let next = (flags & CHUNK_LAST == 0).then_some(next);
    let records = &chunk[CHUNK_HEADER_LEN..];
    if flags & CHUNK_WINDOWS != 0 {
        let mut at = 0;
        let windows = decode_windows(rows, |b, what| {
            let part = records.get(at..at + b.len()).ok_or_else(|| {
                CheckpointError::Truncated(format!("{what} past the end of the chunk"))
            })?;
            b.copy_from_slice(part);
            at += b.len();
            Ok(())
        })?;
        if at != records.len() {
            return Err(CheckpointError::Truncated("bytes after the dedupe windows".into()));
        }
        return Ok(ChunkInfo { table, rows: 0, next, windows });
    }
    if rows == 0 {
        if !records.is_empty() {
            return Err(CheckpointError::Truncated("rows after an empty chunk header".into()));
        }
        return Ok(ChunkInfo { table, rows, next, windows: Vec::new() });
    }
    let t = tables
        .get(table)
        .ok_or_else(|| CheckpointError::Mismatch(format!("chunk for unknown table {table}")))?;
    if dim != t.spec().dim || stride as usize != t.stride() {
        return Err(CheckpointError::Mismatch(format!(
            "table {table}: chunk dim {dim} stride {stride}, local dim {} stride {}",
            t.spec().dim,
            t.stride()
        )));
    }
    if records.len() as u64 != u64::from(rows) * t.record_len() as u64 {
        return Err(CheckpointError::Truncated(format!(
            "{rows} rows but {} record bytes",
            records.len()
        )));
    }
    t.import_records(records, RecordFormat::Versioned, &mut |row| seen(table, row))?;
    Ok(ChunkInfo { table, rows, next, windows: Vec::new() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bex_ps_proto::init::Initializer;
    use bex_ps_proto::optim::Optimizer;
    use bex_testkit::scratch::Scratch;

    fn specs() -> Vec<TableSpec> {
        vec![
            TableSpec {
                name: "user".into(),
                dim: 4,
                seed: 1,
                init: Initializer::Uniform { scale: 0.1 },
                optimizer: Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
                admission: Default::default(),
                capacity: Default::default(),
            },
            TableSpec {
                name: "item".into(),
                dim: 3,
                seed: 2,
                init: Initializer::Normal { std: 0.1 },
                optimizer: Optimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-8 },
                admission: Default::default(),
                capacity: Default::default(),
            },
            TableSpec {
                name: "empty".into(),
                dim: 2,
                seed: 3,
                init: Initializer::Zeros,
                optimizer: Optimizer::Sgd { lr: 0.1 },
                admission: Default::default(),
                capacity: Default::default(),
            },
        ]
    }

    fn filled() -> TableSet {
        let set = TableSet::new(specs()).unwrap();
        for (id, t) in set.iter().take(2) {
            let dim = t.dim();
            let keys: Vec<u64> = (0..3000u64).map(|k| k * 13 + u64::from(id)).collect();
            let grads: Vec<f32> =
                (0..keys.len() * dim).map(|i| ((i % 11) as f32 - 5.0) * 0.01).collect();
            t.push(&keys, &grads, None).unwrap();
            t.push(&keys[..100], &grads[..100 * dim], None).unwrap();
        }
        set
    }

    /// Every row, bit for bit, with state and steps, sorted by key.
    fn dump(set: &TableSet) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        for (id, t) in set.iter() {
            let mut buf = Vec::new();
            for s in 0..STRIPES {
                t.export_records(ExportRows::Live, s, 0, usize::MAX, &mut buf);
            }
            let mut recs: Vec<Vec<u8>> =
                buf.chunks_exact(t.record_len()).map(<[u8]>::to_vec).collect();
            recs.sort();
            out.push((id, recs.concat()));
        }
        out
    }

    #[test]
    fn schedule() {
        let t0 = crate::test_clock::origin();
        let s = Duration::from_secs;
        let mut c = CheckpointSchedule::new(s(300), t0);
        assert!(!c.is_due(t0 + s(299)));
        assert!(c.is_due(t0 + s(300)));
        c.completed(t0 + s(100)); // on demand at +100 s
        assert_eq!(c.next_deadline(), Some(t0 + s(400)));
        let off = CheckpointSchedule::new(Duration::ZERO, t0);
        assert!(!off.is_due(t0 + s(1_000_000)));
        assert_eq!(off.next_deadline(), None);
    }

    /// Two generations: the latest, or the previous one when the latest is missing or
    /// corrupt; a corrupt latest is moved aside so the next checkpoint keeps the good previous
    /// one; both unusable is an error naming both; a table mismatch does not fall back.
    #[test]
    fn a_restore_falls_back_to_the_previous_generation() {
        let dir = Scratch::unique("ps-core-generations");
        let path = dir.join("shard0.ckpt");
        let (prev, aside) = (previous_generation(&path), unusable_generation(&path));
        let meta = |seq| CheckpointMeta { shard: 0, shards: 1, update_seq: seq, created_ms: 1 };
        assert!(restore_checkpoint(&path, &specs(), (0, 1)).unwrap().is_none(), "nothing yet");
        let older = filled();
        write_checkpoint(&path, &older, &[], &meta(1)).unwrap();
        assert!(!prev.exists(), "a first checkpoint has no previous generation");
        let newer = filled();
        let t = newer.get(0).unwrap();
        t.push(&[5, 6, 7], &vec![0.5; 3 * t.dim()], None).unwrap();
        write_checkpoint(&path, &newer, &[], &meta(2)).unwrap();
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert_eq!(
            (r.meta.update_seq, r.from.as_path(), r.latest_unusable.is_none()),
            (2, path.as_path(), true)
        );
        assert_eq!(dump(&r.tables), dump(&newer));
        assert_eq!(read_checkpoint(&prev, &specs()).unwrap().1.update_seq, 1);

        // A corrupt block in the latest: the previous generation, bit-exact.
        let mut bytes = fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert_eq!((r.meta.update_seq, r.from.as_path()), (1, prev.as_path()));
        assert!(
            matches!(r.latest_unusable, Some(CheckpointError::Checksum { .. })),
            "{:?}",
            r.latest_unusable
        );
        assert_eq!(dump(&r.tables), dump(&older));
        assert!(!path.exists() && aside.exists(), "the corrupt file moved aside");
        // The next checkpoint leaves the good previous generation in place.
        write_checkpoint(&path, &newer, &[], &meta(3)).unwrap();
        assert_eq!(read_checkpoint(&prev, &specs()).unwrap().1.update_seq, 1);

        // A crash between the two renames: the latest is missing, the new one whole under
        // its temporary name; the restore finishes the write.
        fs::rename(&path, temporary(&path)).unwrap();
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert_eq!((r.from.as_path(), r.meta.update_seq), (path.as_path(), 3));
        assert!(path.exists() && !temporary(&path).exists());
        // Without the temporary file: the previous generation.
        fs::remove_file(&path).unwrap();
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert_eq!(r.from, prev);

        // Corruption where the body parses as something else (here a table's name): found
        // by the body checksum, so the previous generation is used all the same.
        write_checkpoint(&path, &newer, &[], &meta(7)).unwrap();
        let mut bytes = fs::read(&path).unwrap();
        bytes[CHECKPOINT_HEADER_LEN + 2] ^= 0x01;
        fs::write(&path, &bytes).unwrap();
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert!(
            matches!(r.latest_unusable, Some(CheckpointError::Checksum { .. })),
            "{:?}",
            r.latest_unusable
        );

        // Written by a newer build: not corruption, no fallback (a rolled-back binary must not
        // quietly serve older rows).
        write_checkpoint(&path, &newer, &[], &meta(8)).unwrap();
        let mut bytes = fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&(CHECKPOINT_VERSION + 1).to_le_bytes());
        let hcrc = crc32fast::hash(&bytes[..56]);
        bytes[56..60].copy_from_slice(&hcrc.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let e = restore_checkpoint(&path, &specs(), (0, 1)).unwrap_err();
        assert!(matches!(e, CheckpointError::NewerVersion(_)), "{e}");
        assert!(path.exists(), "left where it is");
        // The same under `.tmp` after a crash between the renames: it may be the newest
        // generation, so no fallback to the previous one either.
        fs::rename(&path, temporary(&path)).unwrap();
        let e = restore_checkpoint(&path, &specs(), (0, 1)).unwrap_err();
        assert!(matches!(e, CheckpointError::NewerVersion(_)), "{e}");
        assert!(temporary(&path).exists() && !path.exists(), "left where it is");
        fs::remove_file(temporary(&path)).unwrap();

        // Both unusable.
        write_checkpoint(&path, &newer, &[], &meta(4)).unwrap();
        for p in [&path, &prev] {
            let mut b = fs::read(p).unwrap();
            b.truncate(b.len() - 5);
            fs::write(p, &b).unwrap();
        }
        let e = restore_checkpoint(&path, &specs(), (0, 1)).unwrap_err();
        assert!(matches!(e, CheckpointError::BothUnusable { .. }), "{e}");
        assert!(e.to_string().contains("previous generation"), "{e}");

        // Other table definitions: a configuration matter, no fallback.
        write_checkpoint(&path, &newer, &[], &meta(5)).unwrap();
        write_checkpoint(&path, &newer, &[], &meta(6)).unwrap();
        let mut other = specs();
        other[0].dim = 9;
        let e = restore_checkpoint(&path, &other, (0, 1)).unwrap_err();
        assert!(matches!(e, CheckpointError::Mismatch(_)), "{e}");
        assert!(path.exists(), "left where it is");

        // Another shard's or shard count's checkpoint: no fallback, nothing moved, also when
        // the latest is corrupt and only the previous generation says whose it is (before,
        // the latest was moved aside before its caller checked the layout, and the start
        // then stopped with the file gone from its place).
        let e = restore_checkpoint(&path, &specs(), (1, 2)).unwrap_err();
        assert!(
            matches!(e, CheckpointError::OtherLayout { written: (0, 1), want: (1, 2), .. }),
            "{e}"
        );
        let mut bytes = fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let _ = fs::remove_file(&aside);
        let e = restore_checkpoint(&path, &specs(), (1, 2)).unwrap_err();
        assert!(matches!(e, CheckpointError::OtherLayout { .. }), "{e}");
        assert!(path.exists() && !aside.exists(), "left where it is");
        let r = restore_checkpoint(&path, &specs(), (0, 1)).unwrap().unwrap();
        assert_eq!((r.from.as_path(), r.meta.update_seq), (prev.as_path(), 5));
    }

    #[test]
    fn round_trip_is_bit_exact() {
        let dir = Scratch::unique("ps-core");
        let path = dir.join("sub/shard0.ckpt");
        let set = filled();
        let meta = CheckpointMeta { shard: 1, shards: 4, update_seq: 99, created_ms: 1234 };
        let dedupe = crate::dedupe::Dedupe::new(crate::dedupe::DedupeConfig::default());
        for (client, seq) in [(7u64, 3u64), (7, 900), (u64::MAX, 1)] {
            dedupe.admit(client, seq);
        }
        let windows = dedupe.export();
        assert_eq!(windows.len(), 2);
        let info = write_checkpoint(&path, &set, &windows, &meta).unwrap();
        assert_eq!(info.rows, 6000);
        assert_eq!(info.bytes, fs::metadata(&path).unwrap().len());
        assert!(!dir.join("sub/shard0.ckpt.tmp").exists());
        let (back, m, w) = read_checkpoint(&path, &specs()).unwrap();
        assert_eq!(m, meta);
        assert_eq!(w, windows);
        assert_eq!(dump(&back), dump(&set));
        assert_eq!(back.get(0).unwrap().rows(), 3000);
        // Overwrite atomically with a newer state.
        set.get(0).unwrap().push(&[1], &[1.0; 4], None).unwrap();
        write_checkpoint(&path, &set, &windows, &meta).unwrap();
        let (back, _, _) = read_checkpoint(&path, &specs()).unwrap();
        assert_eq!(dump(&back), dump(&set));
    }

    #[test]
    fn a_bounded_table_round_trips_bit_exactly_and_a_smaller_bound_keeps_the_newest() {
        let bounded = |max_rows: u64| {
            let mut s = specs();
            s[0].capacity.max_rows = max_rows;
            s
        };
        let set = TableSet::new(bounded(640)).unwrap();
        let t = set.get(0).unwrap();
        for i in 0..40u64 {
            set.raise_version_floor(1 + i);
            let keys: Vec<u64> = (i * 50..i * 50 + 50).collect();
            t.push(&keys, &vec![0.5; keys.len() * t.dim()], None).unwrap();
        }
        assert_eq!(t.rows(), 640);
        assert!(t.evicted() > 0);
        let dir = Scratch::unique("ps-core");
        let path = dir.join("bounded.ckpt");
        let info = write_checkpoint(&path, &set, &[], &CheckpointMeta::default()).unwrap();
        assert_eq!(info.rows, 640, "evicted rows are not written");
        let (back, _, _) = read_checkpoint(&path, &bounded(640)).unwrap();
        assert_eq!(dump(&back), dump(&set), "bit-exact, evictions included");
        // Restored under a smaller bound: each stripe keeps its 2 (128 / 64) most recently
        // pushed rows (stripes are the same keys everywhere: seeded by the table).
        let (small, _, _) = read_checkpoint(&path, &bounded(128)).unwrap();
        let st = small.get(0).unwrap();
        assert_eq!(st.rows(), 128);
        let stripe_records = |t: &crate::Table, s: usize| {
            let mut buf = Vec::new();
            t.export_records(ExportRows::Live, s, 0, usize::MAX, &mut buf);
            let mut recs: Vec<Vec<u8>> =
                buf.chunks_exact(t.record_len()).map(<[u8]>::to_vec).collect();
            // Newest first: version (bytes 8..16), then key (0..8).
            recs.sort_by_key(|r| std::cmp::Reverse((rd_u64(r, 8), rd_u64(r, 0))));
            recs
        };
        for s in 0..STRIPES {
            let mut want = stripe_records(t, s);
            want.truncate(2);
            let mut got = stripe_records(st, s);
            got.sort();
            want.sort();
            assert_eq!(got, want, "stripe {s}");
        }
    }

    #[test]
    fn corruption_is_detected_everywhere() {
        let dir = Scratch::unique("ps-core");
        let path = dir.join("c.ckpt");
        let windows = [WindowState { client: 5, high: 77, bits: vec![0xf0f0, 1] }];
        write_checkpoint(&path, &filled(), &windows, &CheckpointMeta::default()).unwrap();
        let good = fs::read(&path).unwrap();
        // Flip one bit at many positions (header and body): never accepted.
        let step = (good.len() / 97).max(1);
        let windows_at = good.len() - 36;
        for at in
            (0..good.len()).step_by(step).chain([0, 30, 60, 63, 64, windows_at, good.len() - 1])
        {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            fs::write(&path, &bad).unwrap();
            assert!(read_checkpoint(&path, &specs()).is_err(), "flip at {at} accepted");
        }
        // Truncation and extension.
        for len in [0, 10, 64, good.len() - 1] {
            fs::write(&path, &good[..len]).unwrap();
            assert!(read_checkpoint(&path, &specs()).is_err(), "truncated to {len} accepted");
        }
        let mut longer = good.clone();
        longer.push(0);
        fs::write(&path, &longer).unwrap();
        assert!(read_checkpoint(&path, &specs()).is_err());
        fs::write(&path, &good).unwrap();
        assert!(read_checkpoint(&path, &specs()).is_ok());
    }

    #[test]
    fn definitions_must_match() {
        let dir = Scratch::unique("ps-core");
        let path = dir.join("c.ckpt");
        write_checkpoint(&path, &filled(), &[], &CheckpointMeta::default()).unwrap();
        let mut other = specs();
        other[1].dim = 5;
        assert!(matches!(read_checkpoint(&path, &other), Err(CheckpointError::Mismatch(_))));
        let mut other = specs();
        other[0].optimizer = Optimizer::Sgd { lr: 0.1 };
        assert!(matches!(read_checkpoint(&path, &other), Err(CheckpointError::Mismatch(_))));
        let mut other = specs();
        other.remove(0);
        assert!(matches!(read_checkpoint(&path, &other), Err(CheckpointError::Mismatch(_))));
        // A new table in the configuration starts empty; order does not matter.
        let mut more = specs();
        more.reverse();
        more.push(TableSpec { name: "new".into(), ..specs()[2].clone() });
        let (set, _, _) = read_checkpoint(&path, &more).unwrap();
        assert_eq!(set.get(set.id_of("new").unwrap()).unwrap().rows(), 0);
        assert_eq!(set.get(set.id_of("user").unwrap()).unwrap().rows(), 3000);
        assert!(matches!(
            read_checkpoint(&dir.join("missing"), &specs()),
            Err(CheckpointError::Io { .. })
        ));
    }

    fn bootstrap(src: &TableSet, dst: &TableSet, max_bytes: usize) -> (usize, u64) {
        let mut cursor = SnapshotCursor::START;
        let (mut chunks, mut rows) = (0, 0u64);
        loop {
            let mut buf = Vec::new();
            let n = snapshot_chunk(src, cursor, max_bytes, Vec::new, &mut buf).unwrap();
            assert!(buf.len() <= max_bytes.max(CHUNK_HEADER_LEN));
            let info = apply_snapshot_chunk(dst, &buf, &mut |_, _| {}).unwrap();
            assert_eq!(info.rows, n);
            chunks += 1;
            rows += u64::from(n);
            match info.next {
                Some(c) => cursor = c,
                None => return (chunks, rows),
            }
        }
    }

    #[test]
    fn snapshot_bootstraps_a_replica_exactly() {
        let src = filled();
        for max_bytes in [200usize, 4096, 1 << 20] {
            let dst = TableSet::new(specs()).unwrap();
            let (chunks, rows) = bootstrap(&src, &dst, max_bytes);
            assert_eq!(rows, 6000);
            assert_eq!(dump(&dst), dump(&src), "max_bytes {max_bytes}");
            if max_bytes == 1 << 20 {
                assert!(chunks <= 4, "{chunks} chunks");
            }
        }
        // Empty source: a chunk with no rows, then the (empty) windows chunk.
        let empty = TableSet::new(specs()).unwrap();
        let dst = TableSet::new(specs()).unwrap();
        assert_eq!(bootstrap(&empty, &dst, 4096), (2, 0));
    }

    #[test]
    fn a_snapshot_leaves_out_rows_never_pushed() {
        let src = TableSet::new(specs()).unwrap();
        let t = src.get(0).unwrap();
        let dim = t.dim();
        let fetched: Vec<u64> = (0..500).collect();
        t.fetch_into(&fetched, &mut vec![0f32; 500 * dim]).unwrap();
        t.push(&[3, 7], &vec![0.5; 2 * dim], None).unwrap();
        let dst = TableSet::new(specs()).unwrap();
        assert_eq!(bootstrap(&src, &dst, 4096).1, 2, "only the pushed rows travel");
        let (mut a, mut b) = (vec![0f32; 500 * dim], vec![0f32; 500 * dim]);
        t.read_into(&fetched, &mut a).unwrap();
        dst.get(0).unwrap().read_into(&fetched, &mut b).unwrap();
        assert_eq!(a, b, "the rest reads as its initial values on both");
    }

    #[test]
    fn a_snapshot_ends_with_the_sources_dedupe_windows() {
        let src = filled();
        let windows = vec![
            WindowState { client: 7, high: 130, bits: vec![u64::MAX, 5] },
            WindowState { client: 9, high: 3, bits: vec![0b1010] },
        ];
        let past = SnapshotCursor { table: src.len() as u32, ..SnapshotCursor::START };
        let mut buf = Vec::new();
        let n = snapshot_chunk(&src, past, 4096, || windows.clone(), &mut buf).unwrap();
        assert_eq!(n, 2);
        let dst = TableSet::new(specs()).unwrap();
        let info = apply_snapshot_chunk(&dst, &buf, &mut |_, _| {}).unwrap();
        assert!(info.is_windows());
        assert_eq!((info.rows, info.next, info.windows), (0, None, windows));
        // Truncated or padded windows are refused (the CRC fixed up, so the parse decides).
        for bad in [buf[..buf.len() - 8].to_vec(), [&buf[..], &[0u8; 8]].concat()] {
            let mut bad = bad;
            bad[28..32].fill(0);
            let crc = crc32fast::hash(&bad);
            bad[28..32].copy_from_slice(&crc.to_le_bytes());
            assert!(apply_snapshot_chunk(&dst, &bad, &mut |_, _| {}).is_err());
        }
    }

    #[test]
    fn dedupe_windows_are_paged_by_client_within_max_bytes() {
        let src = filled();
        // 300 windows of 1024 sequence numbers (148 B each): 44 kB, paged into 4 kB chunks.
        let windows: Vec<WindowState> = (0..300u64)
            .map(|i| WindowState {
                client: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                high: i,
                bits: vec![i; 16],
            })
            .collect();
        let dst = TableSet::new(specs()).unwrap();
        let mut cursor = SnapshotCursor { table: u32::MAX, ..SnapshotCursor::START };
        let (mut got, mut chunks) = (Vec::new(), 0);
        loop {
            let mut buf = Vec::new();
            snapshot_chunk(&src, cursor, 4096, || windows.clone(), &mut buf).unwrap();
            assert!(buf.len() <= 4096, "{} bytes", buf.len());
            let info = apply_snapshot_chunk(&dst, &buf, &mut |_, _| {}).unwrap();
            assert!(info.is_windows() && !info.windows.is_empty());
            got.extend(info.windows);
            chunks += 1;
            match info.next {
                Some(c) => cursor = c,
                None => break,
            }
        }
        assert!(chunks >= 11, "{chunks} chunks");
        let mut want = windows.clone();
        want.sort_by_key(|w| w.client);
        assert_eq!(got, want, "every window once, in client order");
        // Too small for one window: one per chunk all the same, so paging always advances.
        let mut buf = Vec::new();
        let first = SnapshotCursor { table: u32::MAX, ..SnapshotCursor::START };
        assert_eq!(snapshot_chunk(&src, first, 100, || windows.clone(), &mut buf).unwrap(), 1);
    }

    #[test]
    fn snapshot_errors() {
        let src = filled();
        let mut buf = Vec::new();
        // Too small for one row.
        assert!(snapshot_chunk(&src, SnapshotCursor::START, 60, Vec::new, &mut buf).is_err());
        // Stale epoch.
        let stale = SnapshotCursor { epoch: src.epoch() ^ 2, ..SnapshotCursor::START };
        assert!(matches!(
            snapshot_chunk(&src, stale, 4096, Vec::new, &mut buf),
            Err(CheckpointError::StaleCursor { .. })
        ));
        // Corruption anywhere in a chunk.
        buf.clear();
        snapshot_chunk(&src, SnapshotCursor::START, 4096, Vec::new, &mut buf).unwrap();
        let dst = TableSet::new(specs()).unwrap();
        for at in [0, 8, 20, 28, 40, 56, buf.len() - 1] {
            let mut bad = buf.clone();
            bad[at] ^= 1;
            assert!(apply_snapshot_chunk(&dst, &bad, &mut |_, _| {}).is_err(), "flip at {at}");
        }
        assert!(apply_snapshot_chunk(&dst, &buf[..30], &mut |_, _| {}).is_err());
        // Mismatched local definitions.
        let mut other = specs();
        other[0].dim = 8;
        let dst = TableSet::new(other).unwrap();
        assert!(matches!(
            apply_snapshot_chunk(&dst, &buf, &mut |_, _| {}),
            Err(CheckpointError::Mismatch(_))
        ));
    }

    /// Table 0 unbounded, table 1 bounded at 32 rows a stripe.
    fn growing_and_bounded() -> Vec<TableSpec> {
        let mut s = specs();
        s[1].capacity.max_rows = 64 * 32;
        s
    }

    /// About 8 keys a stripe, well under the bounded stripes' quota of 32.
    fn kept_keys() -> Vec<u64> {
        (0..500u64).map(|k| k * 7919 + 1).collect()
    }

    /// Pushes `keys` at a new version, so they become the stripe's most recently pushed.
    fn push(t: &crate::Table, keys: &[u64]) {
        t.advance_version_floor(0);
        t.push(keys, &vec![0.5; keys.len() * t.dim()], None).unwrap();
    }

    #[test]
    fn a_snapshot_sends_every_row_alive_throughout_while_indexes_grow_and_rows_are_displaced() {
        // The cursor's contract, whatever the layout: a row that lives from the first chunk to
        // the last reaches the replica once, though between chunks the index it sits in is
        // rebuilt larger and other rows are displaced (today's cursor is by slot, and rows
        // never move; a layout whose rows move would page by index position instead).
        let s = growing_and_bounded();
        let src = TableSet::new(s.clone()).unwrap();
        let (grow, bound) = (src.get(0).unwrap(), src.get(1).unwrap());
        let kept = kept_keys();
        push(grow, &kept);
        push(bound, &kept);
        let (rows_before, evicted_before) = (grow.rows(), bound.evicted());
        let dst = TableSet::new(s).unwrap();
        let (mut cursor, mut chunks, mut fresh) = (SnapshotCursor::START, 0u64, 1u64 << 40);
        let mut sent = std::collections::HashMap::<(u32, u64), u32>::new();
        loop {
            let mut buf = Vec::new();
            snapshot_chunk(&src, cursor, 1024, Vec::new, &mut buf).unwrap();
            assert!(buf.len() <= 1024, "a chunk of {} bytes", buf.len());
            chunks += 1;
            // Between chunks: in the first 40, 300 new rows in the unbounded table (its
            // stripes' indexes are rebuilt larger again and again; for ever, its snapshot would
            // not end); in every one, 60 in the bounded table, which displace its least
            // recently pushed, then the kept keys pushed again so they stay the newest.
            let new: Vec<u64> = (fresh..fresh + 300).collect();
            fresh += 300;
            if chunks <= 40 {
                push(grow, &new);
            }
            push(bound, &new[..60]);
            push(bound, &kept);
            let mut count = |table: u32, row: SeenRow| {
                *sent.entry((table, row.key)).or_insert(0) += 1;
            };
            match apply_snapshot_chunk(&dst, &buf, &mut count).unwrap().next {
                // Each cursor after the last, as the copier checks (the windows follow).
                Some(c) if (c.table as usize) < src.len() => {
                    let place = |c: SnapshotCursor| (c.table, c.stripe, c.row);
                    assert!(place(c) > place(cursor), "{c:?} after {cursor:?}");
                    cursor = c;
                }
                Some(c) => cursor = c,
                None => break,
            }
        }
        assert!(chunks > 20, "{chunks} chunks: the snapshot spanned the changes");
        let twice = sent.iter().filter(|&(_, &n)| n > 1).count();
        assert_eq!(twice, 0, "{twice} of {} rows were sent more than once", sent.len());
        assert!(grow.rows() > 8 * rows_before, "{} rows: the indexes grew", grow.rows());
        assert!(bound.evicted() > evicted_before + 1000, "rows were displaced");
        for id in [0, 1] {
            let mut recs = Vec::new();
            let d = dst.get(id).unwrap();
            for stripe in 0..STRIPES {
                d.export_records(ExportRows::Live, stripe, 0, usize::MAX, &mut recs);
            }
            let got: std::collections::HashSet<u64> =
                recs.chunks_exact(d.record_len()).map(|r| rd_u64(r, 0)).collect();
            let lost: Vec<u64> = kept.iter().copied().filter(|k| !got.contains(k)).collect();
            assert!(
                lost.is_empty(),
                "table {id}: {} rows alive throughout never arrived",
                lost.len()
            );
        }
    }

    #[test]
    fn a_checkpoint_written_while_rows_are_displaced_holds_every_row_alive_throughout() {
        // The writer counts each stripe's rows, then exports them, without stopping pushes: a
        // bounded stripe's count must still be there to export though rows were displaced
        // meanwhile, and a row alive throughout must be written (a layout that moved rows on
        // displacement would fail "stripe shrank" or skip one). With 4 MiB batches each stripe
        // is one export here, so pushes interleave between counts and exports and stripes.
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let s = growing_and_bounded();
        let quota = s[1].capacity.max_rows;
        let set = TableSet::new(s.clone()).unwrap();
        let (grow, bound) = (set.get(0).unwrap(), set.get(1).unwrap());
        let kept = kept_keys();
        const FRESH: u64 = 1 << 40;
        let filler: Vec<u64> = (FRESH..FRESH + 3000).collect();
        push(bound, &filler);
        push(grow, &kept);
        // Twice: the filler's last rows ran ahead of the floor within their one push (a full
        // stripe's new row goes above the row it displaces), so after one push the kept rows
        // can tie with them on version with lower keys, and the pusher's first new rows
        // displaced them (a first version of this test assumed them alive throughout).
        push(bound, &kept);
        push(bound, &kept);
        assert_eq!(bound.rows(), quota);
        let mut values = vec![0f32; kept.len() * bound.dim()];
        assert_eq!(bound.read_into(&kept, &mut values).unwrap().missing, 0, "kept keys stored");
        let evicted_before = bound.evicted();
        let (stop, rounds) = (AtomicBool::new(false), AtomicU64::new(0));
        let dir = Scratch::unique("ps-core");
        let path = dir.join("displaced.ckpt");
        let (mut writes, mut overlapped) = (0, 0);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut fresh = FRESH + 3000;
                while !stop.load(Ordering::Relaxed) {
                    let new: Vec<u64> = (fresh..fresh + 60).collect();
                    fresh += 60;
                    push(bound, &new);
                    push(bound, &kept);
                    if grow.rows() < 100_000 {
                        push(grow, &new);
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            });
            // Stops the pusher however this thread leaves the scope (a failed assertion too:
            // the scope would otherwise wait for the pusher for ever).
            struct StopOnDrop<'a>(&'a AtomicBool);
            impl Drop for StopOnDrop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = StopOnDrop(&stop);
            while overlapped < 5 && writes < 500 {
                let before = rounds.load(Ordering::Relaxed);
                let info = write_checkpoint(&path, &set, &[], &CheckpointMeta::default())
                    .unwrap_or_else(|e| panic!("write {writes}: {e}"));
                writes += 1;
                overlapped += usize::from(rounds.load(Ordering::Relaxed) > before);
                let (back, _, _) = read_checkpoint(&path, &s).unwrap();
                let b = back.get(1).unwrap();
                assert_eq!(b.rows(), quota, "write {writes}: the bounded table is full");
                assert_eq!(info.rows, back.get(0).unwrap().rows() + quota);
                for id in [0, 1] {
                    let t = back.get(id).unwrap();
                    let mut recs = Vec::new();
                    for stripe in 0..STRIPES {
                        t.export_records(ExportRows::Live, stripe, 0, usize::MAX, &mut recs);
                    }
                    let keys: std::collections::HashSet<u64> =
                        recs.chunks_exact(t.record_len()).map(|r| rd_u64(r, 0)).collect();
                    assert_eq!(keys.len() as u64, t.rows(), "write {writes}: no key twice");
                    let lost = kept.iter().filter(|k| !keys.contains(k)).count();
                    assert_eq!(lost, 0, "write {writes}, table {id}: rows alive throughout");
                    assert!(
                        keys.iter().all(|k| *k >= FRESH || kept.contains(k)),
                        "write {writes}, table {id}: a key never pushed"
                    );
                }
            }
        });
        assert!(overlapped >= 5, "{overlapped} of {writes} writes overlapped pushes");
        assert!(bound.evicted() > evicted_before + 1000, "rows were displaced");
    }

    #[test]
    fn keys_at_the_ends_of_the_range_are_rows_like_any_other() {
        // 0 and u64::MAX are keys a client may send; no layout may take either for "empty".
        let src = TableSet::new(specs()).unwrap();
        let t = src.get(0).unwrap();
        let keys = [0, 1, u64::MAX - 1, u64::MAX];
        t.push(&keys, &vec![0.5; keys.len() * t.dim()], None).unwrap();
        assert_eq!(t.rows(), 4);
        let dst = TableSet::new(specs()).unwrap();
        assert_eq!(bootstrap(&src, &dst, 4096).1, 4);
        assert_eq!(dump(&dst), dump(&src));
        let dir = Scratch::unique("ps-core");
        let path = dir.join("ends.ckpt");
        write_checkpoint(&path, &src, &[], &CheckpointMeta::default()).unwrap();
        let (back, _, _) = read_checkpoint(&path, &specs()).unwrap();
        assert_eq!(dump(&back), dump(&src));
        let (mut a, mut b) = (vec![0f32; 4 * t.dim()], vec![0f32; 4 * t.dim()]);
        t.read_into(&keys, &mut a).unwrap();
        back.get(0).unwrap().read_into(&keys, &mut b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn snapshot_during_pushes_then_replication_catch_up_converges() {
        // The documented protocol: buffer replication from before the first chunk, apply
        // chunks, then the buffer; the replica equals the source in values.
        let src = filled();
        let dst = TableSet::new(specs()).unwrap();
        let t = src.get(0).unwrap();
        let mut buffered: Vec<(Vec<u64>, Vec<f32>)> = Vec::new();
        let mut cursor = SnapshotCursor::START;
        let mut step = 0u64;
        loop {
            // A push lands between chunks; its resulting rows are "replicated" (buffered).
            let keys: Vec<u64> = (0..20).map(|k| (k * 13 + step * 7) % 50_000).collect();
            let grads = vec![0.25f32; keys.len() * 4];
            let mut rows = vec![0f32; keys.len() * 4];
            t.push(&keys, &grads, Some(&mut rows)).unwrap();
            buffered.push((keys, rows));
            step += 1;
            let mut buf = Vec::new();
            snapshot_chunk(&src, cursor, 2048, Vec::new, &mut buf).unwrap();
            match apply_snapshot_chunk(&dst, &buf, &mut |_, _| {}).unwrap().next {
                Some(c) => cursor = c,
                None => break,
            }
        }
        for (keys, rows) in &buffered {
            dst.get(0).unwrap().apply_replica(keys, rows).unwrap();
        }
        // Compare values (replicas take values; state may lag): fetch every source key.
        let mut keys = Vec::new();
        let mut recs = Vec::new();
        for s in 0..STRIPES {
            t.export_records(ExportRows::Live, s, 0, usize::MAX, &mut recs);
        }
        for r in recs.chunks_exact(t.record_len()) {
            keys.push(rd_u64(r, 0));
        }
        let (mut a, mut b) = (vec![0f32; keys.len() * 4], vec![0f32; keys.len() * 4]);
        t.read_into(&keys, &mut a).unwrap();
        dst.get(0).unwrap().read_into(&keys, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
