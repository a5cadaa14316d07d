//! Push idempotence by (client id, sequence number).
//!
//! # Window semantics
//!
//! For each client the server remembers `high`, the highest sequence number it has
//! admitted, and one bit for each of the `W` sequence numbers `high − W + 1 ..= high`
//! (`W` = [`DedupeConfig::window`]). A request with sequence `s` is:
//!
//! - [`Verdict::New`] if `s > high` (the window slides forward: bits of skipped numbers are
//!   clear, so they can still arrive late), or if `s` is inside the window and its bit is
//!   clear (a late or reordered request). The bit is then set: the caller must apply it.
//! - [`Verdict::Duplicate`] if `s` is inside the window and its bit is set: it was admitted
//!   before; do not apply it again, answer success.
//! - [`Verdict::TooOld`] if `s ≤ high − W`: the server cannot tell whether it was applied;
//!   it is not applied now, and the client is told so (it must not assume success).
//!
//! The first request of an unknown client is New. A client keeps one id for its lifetime and
//! numbers its pushes upward (gaps are fine); a restarted client takes a fresh random id
//! (restarting its numbers under the old id would make them TooOld).
//!
//! Admission marks the bit before the push is applied, so the caller validates the request
//! fully (table, dimension, finite values) *before* asking: a request that then fails
//! validation is never marked, and a retry of it fails the same way. Retries of an admitted
//! request are answered Duplicate even while the first attempt is still being applied.
//!
//! Memory is bounded: at most [`DedupeConfig::max_clients`] windows of `W` bits. When full,
//! the least recently seen client is evicted (counted in [`Dedupe::evictions`]); its next
//! request starts a new window, so exactly-once holds only for clients that stay among the
//! `max_clients` most recent — size it above the number of live trainers (and replication
//! sources). [`Dedupe::merge`] never evicts: the clients it adds count as the least recently
//! seen (a live one is promoted by its next push), and the table shrinks back to its bound
//! at the next new client.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

/// Sizes of the dedupe state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DedupeConfig {
    /// Window `W` in sequence numbers; rounded up to a multiple of 64, at least 64.
    pub window: u32,
    /// Most clients remembered.
    pub max_clients: usize,
}

impl DedupeConfig {
    /// A server's sizes, from `[server]` of its cluster file.
    pub fn of(cfg: &bex_ps_proto::Config) -> DedupeConfig {
        DedupeConfig {
            window: cfg.server.dedupe_window,
            max_clients: cfg.server.dedupe_max_clients,
        }
    }
}

impl Default for DedupeConfig {
    fn default() -> Self {
        DedupeConfig { window: 1024, max_clients: 4096 }
    }
}

/// What to do with a (client, seq).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not seen: apply it (now recorded as seen).
    New,
    /// Seen within the window: already applied (or being applied); do not apply.
    Duplicate,
    /// Older than the window: unknown whether applied; not applied.
    TooOld,
}

#[derive(Debug)]
struct Window {
    high: u64,
    /// Bit `s mod W` is set when `s` (within the window) was admitted.
    bits: Box<[u64]>,
    last_used: u64,
    /// Restored from a smaller window: numbers up to here are unknown (TooOld).
    floor: Option<u64>,
}

impl Window {
    fn bit(&self, s: u64) -> (usize, u64) {
        let w = self.bits.len() as u64 * 64;
        let i = s % w;
        ((i / 64) as usize, 1u64 << (i % 64))
    }

    fn admit(&mut self, s: u64) -> Verdict {
        let w = self.bits.len() as u64 * 64;
        if s > self.high {
            if s - self.high >= w {
                self.bits.fill(0);
            } else {
                for x in self.high + 1..s {
                    let (word, mask) = self.bit(x);
                    self.bits[word] &= !mask;
                }
            }
            self.high = s;
            let (word, mask) = self.bit(s);
            self.bits[word] |= mask;
            return Verdict::New;
        }
        if self.high - s >= w || self.floor.is_some_and(|f| s <= f) {
            return Verdict::TooOld;
        }
        let (word, mask) = self.bit(s);
        if self.bits[word] & mask != 0 {
            Verdict::Duplicate
        } else {
            self.bits[word] |= mask;
            Verdict::New
        }
    }
}

#[derive(Debug, Default)]
struct Part {
    clients: HashMap<u64, Window, ahash::RandomState>,
}

const PARTS: usize = 16;

/// The dedupe table of one server (thread-safe; clients are spread over 16 locks).
///
/// The bound and the recency order are the whole table's, not a part's: a bound per part
/// (`max_clients / 16` each) evicted a live client as soon as a few others hashed to its
/// part, and its retried push was then applied twice. Eviction locks every part (in order),
/// which only a new client arriving at a full table does.
#[derive(Debug)]
pub struct Dedupe {
    parts: Box<[Mutex<Part>]>,
    words: usize,
    max_clients: usize,
    /// Clients in all parts; changes only under a part's lock.
    count: AtomicUsize,
    /// Recency: every admission takes the next tick (merged-in windows have tick 0).
    clock: AtomicU64,
    evictions: AtomicU64,
}

impl Dedupe {
    /// Empty state of the given sizes.
    pub fn new(config: DedupeConfig) -> Dedupe {
        let words = (config.window.max(1) as usize).div_ceil(64);
        Dedupe {
            parts: (0..PARTS).map(|_| Mutex::new(Part::default())).collect(),
            words,
            max_clients: config.max_clients.max(1),
            count: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The window in sequence numbers (after rounding).
    pub fn window(&self) -> u64 {
        self.words as u64 * 64
    }

    /// Decides and records (client, seq); see the module docs.
    pub fn admit(&self, client: u64, seq: u64) -> Verdict {
        let i = part_of(client);
        {
            let mut p = self.parts[i].lock();
            let now = self.tick();
            if let Some(w) = p.clients.get_mut(&client) {
                w.last_used = now;
                return w.admit(seq);
            }
            // A place is taken before the insert, so threads of different parts cannot
            // together overshoot the bound.
            if self.count.fetch_add(1, Ordering::AcqRel) < self.max_clients {
                p.clients.insert(client, self.first_window(seq, now));
                return Verdict::New;
            }
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        // Full: make room among all parts (another thread may add this client meanwhile).
        let mut all = self.lock_all();
        let now = self.tick();
        if let Some(w) = all[i].clients.get_mut(&client) {
            w.last_used = now;
            return w.admit(seq);
        }
        self.make_room(&mut all);
        self.insert(&mut all[i], client, self.first_window(seq, now));
        Verdict::New
    }

    /// A new client's window, holding `seq`.
    fn first_window(&self, seq: u64, now: u64) -> Window {
        let mut w = Window {
            high: seq,
            bits: vec![0u64; self.words].into_boxed_slice(),
            last_used: now,
            floor: None,
        };
        let (word, mask) = w.bit(seq);
        w.bits[word] |= mask;
        w
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Adds a client this part does not hold.
    fn insert(&self, p: &mut Part, client: u64, w: Window) {
        let fresh = p.clients.insert(client, w).is_none();
        debug_assert!(fresh, "insert of a known client");
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Every part, locked in order (so two threads doing this cannot deadlock).
    fn lock_all(&self) -> Vec<MutexGuard<'_, Part>> {
        self.parts.iter().map(|p| p.lock()).collect()
    }

    /// Clients remembered.
    pub fn clients(&self) -> usize {
        self.parts.iter().map(|p| p.lock().clients.len()).sum()
    }

    /// The most clients remembered (the configured bound).
    pub fn max_clients(&self) -> usize {
        self.max_clients
    }

    /// Clients evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Forgets every client.
    pub fn clear(&self) {
        let mut all = self.lock_all();
        for p in all.iter_mut() {
            p.clients.clear();
        }
        self.count.store(0, Ordering::Release);
    }

    /// Every client's window, for a checkpoint (least recently seen first, so a restore
    /// into a smaller table keeps the most recent).
    pub fn export(&self) -> Vec<WindowState> {
        let mut out = Vec::new();
        for p in self.parts.iter() {
            let p = p.lock();
            for (&client, w) in &p.clients {
                out.push((
                    w.last_used,
                    WindowState { client, high: w.high, bits: w.bits.to_vec() },
                ));
            }
        }
        out.sort_by_key(|(used, s)| (*used, s.client));
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// Replaces the state with `windows` (from [`Dedupe::export`], maybe of another window
    /// size): a window of the same size is taken whole; one of another size keeps `high`
    /// and the bits that still fall in this window, and treats the rest as too old. Later
    /// entries count as more recently seen.
    pub fn import(&self, windows: &[WindowState]) {
        self.clear();
        for s in windows {
            self.import_one(s);
        }
    }

    /// Adds `s` as a newly seen client's window (see [`Dedupe::import`]).
    fn import_one(&self, s: &WindowState) {
        let mut all = self.lock_all();
        let now = self.tick();
        let i = part_of(s.client);
        if all[i].clients.remove(&s.client).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        self.make_room(&mut all);
        let win = self.window_from(s, now);
        self.insert(&mut all[i], s.client, win);
    }

    /// Evicts the least recently seen clients of the whole table until a new one fits: one
    /// pass that picks them all (after a merge the table may hold twice its bound, and a
    /// scan per eviction made that thousands of scans with every push of the shard waiting).
    fn make_room(&self, all: &mut [MutexGuard<'_, Part>]) {
        let excess = (self.count.load(Ordering::Acquire) + 1).saturating_sub(self.max_clients);
        if excess == 0 {
            return;
        }
        let mut ages: Vec<(u64, u64, usize)> = all
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.clients.iter().map(move |(&c, w)| (w.last_used, c, i)))
            .collect();
        let excess = excess.min(ages.len());
        if excess == 0 {
            return;
        }
        // The `excess` oldest (ties by client id: the same choice in every run) come first.
        ages.select_nth_unstable(excess - 1);
        for &(_, c, i) in &ages[..excess] {
            all[i].clients.remove(&c);
            self.count.fetch_sub(1, Ordering::AcqRel);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// This table's window for a stored one (maybe of another size): the bits that fall in
    /// this window; below a smaller stored window everything is unknown (a floor).
    fn window_from(&self, s: &WindowState, last_used: u64) -> Window {
        let w = self.window();
        let stored = s.bits.len() as u64 * 64;
        let floor = (stored < w).then(|| s.high.saturating_sub(stored));
        let mut win = Window {
            high: s.high,
            bits: vec![0u64; self.words].into_boxed_slice(),
            last_used,
            floor,
        };
        for x in admitted(s, w) {
            let (word, mask) = win.bit(x);
            win.bits[word] |= mask;
        }
        win
    }
}

/// The part (lock) of `client`.
fn part_of(client: u64) -> usize {
    (bex_ps_proto::shard::mix64(client) % PARTS as u64) as usize
}

/// The sequence numbers `s` records as admitted, within the last `w` below its high.
fn admitted(s: &WindowState, w: u64) -> impl Iterator<Item = u64> + '_ {
    let stored = s.bits.len() as u64 * 64;
    // An empty stored window admits nothing (and `1..=0` is empty).
    let (from, to) =
        if stored == 0 { (1, 0) } else { (s.high.saturating_sub(w.min(stored) - 1), s.high) };
    (from..=to).filter(move |&x| {
        let i = x % stored;
        s.bits[(i / 64) as usize] & (1 << (i % 64)) != 0
    })
}

impl Dedupe {
    /// Adds what `windows` (another server's [`Dedupe::export`]) know to this state: every
    /// number admitted there is admitted here too (numbers already below a window here stay
    /// too old), and numbers neither side can vouch for are too old. A restarted training
    /// shard merges its replicas' windows, which know the pushes whose replication reached
    /// them, into its checkpoint's.
    ///
    /// It never evicts a client this table knows: the peer's other clients are added as the
    /// least recently seen (the peer may hold windows of long-gone incarnations, which must
    /// not push out live trainers), so the table may exceed its bound until the next new
    /// client shrinks it back (at most twice the bound; past that they are dropped and
    /// counted as evictions).
    pub fn merge(&self, windows: &[WindowState]) {
        let w = self.window();
        for s in windows {
            let mut p = self.parts[part_of(s.client)].lock();
            if !p.clients.contains_key(&s.client) {
                if self.count.load(Ordering::Acquire) >= 2 * self.max_clients {
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let win = self.window_from(s, 0);
                self.insert(&mut p, s.client, win);
                continue;
            }
            let win = p.clients.get_mut(&s.client).expect("checked above");
            let stored = s.bits.len() as u64 * 64;
            if stored == 0 {
                continue;
            }
            let old_high = win.high;
            for x in admitted(s, stored) {
                win.admit(x);
            }
            // A smaller peer window forgot what lies below it. Where that is above what this
            // side knew, nobody can say whether those numbers were applied: too old, not New
            // (which would apply a late retry twice).
            let peer_floor = s.high.saturating_sub(stored);
            if stored < w && peer_floor > old_high {
                win.floor = Some(win.floor.map_or(peer_floor, |f| f.max(peer_floor)));
            }
        }
    }
}

/// One client's window as a checkpoint stores it: the highest sequence admitted and the
/// admitted bits of the window below it (bit `s mod (64 · bits.len())`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowState {
    /// The client (push identity or replication identity).
    pub client: u64,
    /// Highest sequence admitted.
    pub high: u64,
    /// The window's bits.
    pub bits: Vec<u64>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn merging_a_peers_windows_adds_what_it_admitted() {
        let cfg = DedupeConfig { window: 128, max_clients: 8 };
        let (a, b) = (Dedupe::new(cfg), Dedupe::new(cfg));
        for s in [1, 2, 5] {
            a.admit(7, s);
        }
        for s in [2, 3, 9] {
            b.admit(7, s);
        }
        b.admit(8, 4);
        a.merge(&b.export());
        for (client, seq, want) in [
            (7, 1, Verdict::Duplicate),
            (7, 3, Verdict::Duplicate),
            (7, 9, Verdict::Duplicate),
            (7, 4, Verdict::New),
            (8, 4, Verdict::Duplicate),
            (8, 5, Verdict::New),
        ] {
            assert_eq!(a.admit(client, seq), want, "client {client} seq {seq}");
        }
    }

    use super::*;

    fn d(window: u32, max_clients: usize) -> Dedupe {
        Dedupe::new(DedupeConfig { window, max_clients })
    }

    /// `n` clients that all fall in `client`'s part.
    fn same_part(client: u64, n: usize) -> Vec<u64> {
        let part_of = |c: u64| bex_ps_proto::shard::mix64(c) % PARTS as u64;
        (client + 1..).filter(|&c| part_of(c) == part_of(client)).take(n).collect()
    }

    #[test]
    fn merging_never_evicts_a_client_this_side_knows() {
        // Room for one client: the local trainer fills the table.
        let (a, b) = (d(64, 1), d(64, 1));
        let live = 1u64;
        let stale = same_part(live, 1)[0];
        a.admit(live, 5);
        b.admit(stale, 9);
        a.merge(&b.export());
        assert_eq!(a.evictions(), 0);
        assert_eq!(a.admit(live, 5), Verdict::Duplicate, "the live trainer's window survived");
        assert_eq!(a.admit(stale, 9), Verdict::Duplicate, "and the peer's was added");
        // Over the bound until the next new client, which brings the table back to it.
        let fresh = same_part(live, 2)[1];
        a.admit(fresh, 1);
        assert_eq!(a.clients(), 1);
        assert_eq!(a.admit(fresh, 1), Verdict::Duplicate);
    }

    #[test]
    fn merged_in_clients_go_first_when_room_is_needed() {
        let (a, b) = (d(64, 2), d(64, 2));
        let live = 3u64;
        let others = same_part(live, 3);
        a.admit(live, 1);
        b.admit(others[0], 1);
        a.merge(&b.export());
        // A new client (bound 2): the merged-in, never-seen-since one goes.
        a.admit(others[1], 1);
        assert_eq!(a.admit(live, 1), Verdict::Duplicate);
        assert_eq!(a.admit(others[1], 1), Verdict::Duplicate);
        assert_eq!(a.admit(others[0], 1), Verdict::New, "evicted, so unknown again");
    }

    #[test]
    fn a_smaller_peer_window_leaves_what_it_forgot_too_old() {
        // Local: W = 256, knows client 7 up to 100. Peer: W = 64, knows 7 up to 400, so
        // numbers up to 336 are unknown to it; 101..=336 are unknown to both.
        let (a, b) = (d(256, 8), d(64, 8));
        a.admit(7, 100);
        for s in [390, 400] {
            b.admit(7, s);
        }
        a.merge(&b.export());
        assert_eq!(a.admit(7, 400), Verdict::Duplicate);
        assert_eq!(a.admit(7, 390), Verdict::Duplicate);
        assert_eq!(a.admit(7, 300), Verdict::TooOld, "forgotten by the peer, unseen here");
        assert_eq!(a.admit(7, 336), Verdict::TooOld);
        assert_eq!(a.admit(7, 337), Verdict::New, "inside the peer's window, never admitted");
    }

    #[test]
    fn duplicates_within_the_window_are_rejected() {
        let d = d(64, 10);
        assert_eq!(d.admit(1, 10), Verdict::New);
        assert_eq!(d.admit(1, 10), Verdict::Duplicate);
        assert_eq!(d.admit(1, 11), Verdict::New);
        assert_eq!(d.admit(1, 10), Verdict::Duplicate);
        // Another client's numbers are independent.
        assert_eq!(d.admit(2, 10), Verdict::New);
    }

    #[test]
    fn reordered_requests_inside_the_window_are_new_once() {
        let d = d(64, 10);
        assert_eq!(d.admit(1, 100), Verdict::New);
        assert_eq!(d.admit(1, 105), Verdict::New);
        for s in 101..105 {
            assert_eq!(d.admit(1, s), Verdict::New, "{s} skipped earlier, arrives late");
            assert_eq!(d.admit(1, s), Verdict::Duplicate);
        }
        // 41 is the oldest number in the window [42, 105] minus one.
        assert_eq!(d.admit(1, 42), Verdict::New);
        assert_eq!(d.admit(1, 41), Verdict::TooOld);
    }

    #[test]
    fn old_ones_beyond_the_window_are_reported() {
        let d = d(128, 10);
        assert_eq!(d.window(), 128);
        assert_eq!(d.admit(7, 0), Verdict::New);
        assert_eq!(d.admit(7, 127), Verdict::New);
        assert_eq!(d.admit(7, 0), Verdict::Duplicate, "0 is still inside [0, 127]");
        assert_eq!(d.admit(7, 128), Verdict::New);
        assert_eq!(d.admit(7, 0), Verdict::TooOld, "window is now [1, 128]");
        // A big jump clears everything.
        assert_eq!(d.admit(7, 10_000), Verdict::New);
        assert_eq!(d.admit(7, 9_999), Verdict::New);
        assert_eq!(d.admit(7, 9_873), Verdict::New);
        assert_eq!(d.admit(7, 9_872), Verdict::TooOld);
        assert_eq!(d.admit(7, 128), Verdict::TooOld);
    }

    #[test]
    fn wrap_of_bits_does_not_alias() {
        // s and s + W share a bit; after sliding past s, s + W must be New.
        let d = d(64, 10);
        assert_eq!(d.admit(1, 5), Verdict::New);
        assert_eq!(d.admit(1, 69), Verdict::New);
        assert_eq!(d.admit(1, 5), Verdict::TooOld);
        assert_eq!(d.admit(1, 69), Verdict::Duplicate);
        assert_eq!(d.admit(1, 133), Verdict::New);
    }

    #[test]
    fn window_rounds_up_to_words() {
        assert_eq!(d(1, 1).window(), 64);
        assert_eq!(d(65, 1).window(), 128);
    }

    #[test]
    fn least_recently_seen_client_is_evicted() {
        // Room for two; `a` seen again after `b`, so the third client evicts `b`, whichever
        // parts they fall in.
        let d = d(64, 2);
        let (a, b, c) = (1u64, 2u64, 3u64);
        assert_eq!(d.admit(a, 1), Verdict::New);
        assert_eq!(d.admit(b, 1), Verdict::New);
        assert_eq!(d.admit(a, 2), Verdict::New);
        assert_eq!(d.admit(c, 1), Verdict::New);
        assert_eq!(d.evictions(), 1);
        assert_eq!(d.admit(a, 1), Verdict::Duplicate, "seen recently: kept");
        assert_eq!(d.admit(c, 1), Verdict::Duplicate);
        // `b` was forgotten: its duplicate is (wrongly but by design) New again.
        assert_eq!(d.admit(b, 1), Verdict::New);
        assert_eq!(d.evictions(), 2);
        assert_eq!(d.clients(), 2);
        d.clear();
        assert_eq!(d.clients(), 0);
    }

    #[test]
    fn clients_crowded_into_one_part_are_kept_below_the_bound() {
        // 64 places; 9 clients that all hash to one of the 16 locks. A bound per lock (4)
        // evicted the first and answered its retry New: applied twice.
        let d = d(64, 64);
        let first = 1u64;
        assert_eq!(d.admit(first, 1), Verdict::New);
        for c in same_part(first, 8) {
            assert_eq!(d.admit(c, 1), Verdict::New);
        }
        assert_eq!(d.evictions(), 0);
        assert_eq!(d.admit(first, 1), Verdict::Duplicate, "the retry is recognised");
        assert_eq!(d.clients(), 9);
    }

    #[test]
    fn a_table_over_its_bound_after_a_merge_sheds_the_oldest_at_once() {
        let (a, b) = (d(64, 4), d(64, 4));
        for c in 1..=4u64 {
            a.admit(c, 1);
        }
        for c in 11..=14u64 {
            b.admit(c, 1);
        }
        a.merge(&b.export());
        assert_eq!(a.clients(), 8, "a merge may hold up to twice the bound");
        // The next new client: the 4 merged-in ones and the oldest local one go.
        assert_eq!(a.admit(20, 1), Verdict::New);
        assert_eq!((a.clients(), a.evictions()), (4, 5));
        for c in [2u64, 3, 4, 20] {
            assert_eq!(a.admit(c, 1), Verdict::Duplicate, "client {c} kept");
        }
        assert_eq!(a.admit(11, 1), Verdict::New, "a merged-in one went first");
    }

    #[test]
    fn concurrent_new_clients_end_at_the_bound_with_every_eviction_counted() {
        let d = std::sync::Arc::new(d(64, 32));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for c in 0..500 {
                        assert_eq!(d.admit(t * 1_000_000 + c, 1), Verdict::New);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(d.clients(), 32);
        assert_eq!(d.evictions(), 4 * 500 - 32);
    }

    #[test]
    fn an_exported_window_restores_the_same_verdicts() {
        let a = d(128, 64);
        for s in [3u64, 5, 90, 200, 201] {
            assert_eq!(a.admit(9, s), Verdict::New);
        }
        assert_eq!(a.admit(4, 1), Verdict::New);
        let b = d(128, 64);
        b.import(&a.export());
        for s in [90u64, 200, 201] {
            assert_eq!(b.admit(9, s), Verdict::Duplicate, "{s} was admitted before");
        }
        assert_eq!(b.admit(9, 100), Verdict::New, "inside the window, never admitted");
        assert_eq!(b.admit(9, 5), Verdict::TooOld);
        assert_eq!(b.admit(4, 1), Verdict::Duplicate);
        // Into a smaller window: what still fits keeps its verdict, the rest is too old.
        let c = d(64, 64);
        c.import(&a.export());
        assert_eq!(c.admit(9, 201), Verdict::Duplicate);
        assert_eq!(c.admit(9, 200), Verdict::Duplicate);
        assert_eq!(c.admit(9, 90), Verdict::TooOld);
        assert_eq!(c.admit(9, 150), Verdict::New);
        // Into a larger window: below the stored window is unknown, so TooOld, not New.
        let e = d(256, 64);
        e.import(&a.export());
        assert_eq!(e.admit(9, 201), Verdict::Duplicate);
        assert_eq!(e.admit(9, 73), Verdict::TooOld, "below 201 - 128");
        assert_eq!(e.admit(9, 74), Verdict::New, "inside the stored window, never admitted");
    }

    #[test]
    fn concurrent_retries_apply_once() {
        use std::sync::Arc;
        let d = Arc::new(d(1024, 64));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let d = Arc::clone(&d);
                std::thread::spawn(move || {
                    let mut news = 0u32;
                    for client in 0..8u64 {
                        for seq in 0..500u64 {
                            if d.admit(client, seq) == Verdict::New {
                                news += 1;
                            }
                        }
                    }
                    news
                })
            })
            .collect();
        let total: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, 8 * 500, "each (client, seq) admitted exactly once across threads");
    }
}
