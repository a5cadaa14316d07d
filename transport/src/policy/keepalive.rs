//! Connection monitoring (paper §7.2): each engine sends its peer a rising sequence number
//! every `interval`; if the peer's number has not advanced for `timeout`, the engine fails.

use std::time::{Duration, Instant};

/// Keepalive state of one engine; time is passed in.
#[derive(Clone, Debug)]
pub struct Keepalive {
    interval: Duration,
    timeout: Duration,
    next_send: Instant,
    my_seq: u64,
    peer_seq: u64,
    peer_advanced_at: Instant,
}

impl Keepalive {
    /// Starts at `now`: the first keepalive goes out after `interval`.
    pub fn new(now: Instant, interval: Duration, timeout: Duration) -> Keepalive {
        Keepalive {
            interval,
            timeout,
            next_send: now + interval,
            my_seq: 0,
            peer_seq: 0,
            peer_advanced_at: now,
        }
    }
    /// The sequence number to send now, if one is due.
    pub fn poll_send(&mut self, now: Instant) -> Option<u64> {
        if now < self.next_send {
            return None;
        }
        self.next_send = now + self.interval;
        self.my_seq += 1;
        Some(self.my_seq)
    }
    /// The peer's keepalive arrived.
    pub fn on_peer(&mut self, seq: u64, now: Instant) {
        if seq > self.peer_seq {
            self.peer_seq = seq;
            self.peer_advanced_at = now;
        }
    }
    /// Any traffic from the peer proves it alive too.
    pub fn on_traffic(&mut self, now: Instant) {
        self.peer_advanced_at = now;
    }
    /// True once the peer has been silent for the timeout.
    pub fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.peer_advanced_at) >= self.timeout
    }
    /// When something is next due (a send, or the expiry).
    pub fn next_deadline(&self) -> Instant {
        self.next_send.min(self.peer_advanced_at + self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_rising_numbers_on_schedule_and_expires_on_silence() {
        let t0 = crate::clock::origin();
        let ms = Duration::from_millis;
        let mut k = Keepalive::new(t0, ms(10), ms(35));
        assert_eq!(k.poll_send(t0 + ms(5)), None);
        assert_eq!(k.poll_send(t0 + ms(10)), Some(1));
        assert_eq!(k.poll_send(t0 + ms(20)), Some(2));
        k.on_peer(1, t0 + ms(20));
        assert!(!k.expired(t0 + ms(54)));
        assert!(k.expired(t0 + ms(55)));
        // A stale (non-advancing) number does not count.
        k.on_peer(1, t0 + ms(50));
        assert!(k.expired(t0 + ms(55)));
        k.on_peer(2, t0 + ms(50));
        assert!(!k.expired(t0 + ms(55)));
        // The next send (30 ms) comes before the expiry (50 + 35 ms).
        assert_eq!(k.next_deadline(), t0 + ms(30));
        // Silence: the expiry comes first.
        let k = Keepalive::new(t0, ms(100), ms(35));
        assert_eq!(k.next_deadline(), t0 + ms(35));
    }
}
