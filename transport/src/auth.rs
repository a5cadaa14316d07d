//! Peer authentication, one scheme for both transports' handshakes: after exchanging hellos
//! (each with a fresh random nonce), each side sends an HMAC-SHA256 under the cluster's
//! shared secret of a per-transport label, its role, and both hellos (the initiator's first),
//! and checks the other's in constant time. The role in the MAC refuses a reflected proof;
//! the nonces refuse a replayed one; the label keeps an RDMA proof from passing as a TCP one.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;

/// Inbound handshakes in progress at once, per transport; further connections are refused
/// and counted (`bootstrap_refused`), so a stranger's storm of silent connections costs a
/// bounded number of tasks and sockets until `connect_timeout` ends each.
pub const MAX_HANDSHAKES: usize = 1024;

/// Of [`MAX_HANDSHAKES`], how many one source may hold: an IPv4 address, or an IPv6 /64 (one
/// host commonly has a whole /64 to pick addresses from); loopback excepted, also as an
/// IPv4-mapped IPv6 address on a dual-stack listener (every local process shares it, and a
/// local stranger has the host already). One source could otherwise take every place for
/// `connect_timeout`, renewably, and keep every peer out; a legitimate process opens far
/// fewer connections to one transport at once.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 128;

/// The source whose share a connection from `from` counts against (`None`: loopback).
fn source_of(from: IpAddr) -> Option<IpAddr> {
    match from.to_canonical() {
        ip if ip.is_loopback() => None,
        IpAddr::V6(v6) => Some(IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into())),
        v4 => Some(v4),
    }
}

/// The places of inbound handshakes in progress: [`MAX_HANDSHAKES`] in all,
/// [`MAX_HANDSHAKES_PER_SOURCE`] per source address.
#[derive(Clone)]
pub(crate) struct HandshakeSlots {
    total: Arc<Semaphore>,
    per_source: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One inbound handshake's place, given back on drop.
pub(crate) struct HandshakeSlot {
    _total: OwnedSemaphorePermit,
    source: Option<IpAddr>,
    per_source: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// Why an inbound handshake got no place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoSlot {
    /// Every place is taken.
    Full,
    /// Its source holds its share already.
    SourceFull,
}

impl NoSlot {
    /// For the refusal's log line.
    pub(crate) fn why(self) -> &'static str {
        match self {
            NoSlot::Full => "too many handshakes in progress",
            NoSlot::SourceFull => "too many handshakes in progress from this address",
        }
    }
}

impl HandshakeSlots {
    pub(crate) fn new() -> HandshakeSlots {
        HandshakeSlots {
            total: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
            per_source: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A place for a handshake from `from`, if there is one.
    pub(crate) fn try_take(&self, from: IpAddr) -> Result<HandshakeSlot, NoSlot> {
        let total = self.total.clone().try_acquire_owned().map_err(|_| NoSlot::Full)?;
        let source = source_of(from);
        if let Some(ip) = source {
            let mut held = self.per_source.lock();
            let n = held.entry(ip).or_default();
            if *n >= MAX_HANDSHAKES_PER_SOURCE {
                return Err(NoSlot::SourceFull);
            }
            *n += 1;
        }
        Ok(HandshakeSlot { _total: total, source, per_source: self.per_source.clone() })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let Some(ip) = self.source else { return };
        let mut held = self.per_source.lock();
        if let Some(n) = held.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&ip);
            }
        }
    }
}

/// Which side of a handshake computes a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Initiator,
    /// The side that accepted.
    Acceptor,
}

impl Role {
    /// The other side.
    pub fn peer(self) -> Role {
        match self {
            Role::Initiator => Role::Acceptor,
            Role::Acceptor => Role::Initiator,
        }
    }
}

fn mac(secret: &[u8], label: &[u8], role: Role, hello_i: &[u8], hello_a: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length (long ones are hashed), so this cannot fail.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(label);
    mac.update(match role {
        Role::Initiator => b"initiator",
        Role::Acceptor => b"acceptor!",
    });
    mac.update(hello_i);
    mac.update(hello_a);
    mac
}

/// The proof `role` sends.
pub fn proof(
    secret: &[u8],
    label: &[u8],
    role: Role,
    hello_initiator: &[u8],
    hello_acceptor: &[u8],
) -> [u8; PROOF_LEN] {
    mac(secret, label, role, hello_initiator, hello_acceptor).finalize().into_bytes().into()
}

/// Checks, in constant time, a proof `role` sent.
pub fn verify(
    secret: &[u8],
    label: &[u8],
    role: Role,
    hello_initiator: &[u8],
    hello_acceptor: &[u8],
    got: &[u8],
) -> bool {
    mac(secret, label, role, hello_initiator, hello_acceptor).verify_slice(got).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_source_takes_at_most_its_share_of_handshakes_and_gives_them_back() {
        let slots = HandshakeSlots::new();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let held: Vec<_> =
            (0..MAX_HANDSHAKES_PER_SOURCE).map(|_| slots.try_take(a).unwrap()).collect();
        assert_eq!(slots.try_take(a).err(), Some(NoSlot::SourceFull));
        let other = slots.try_take(b).expect("another source still gets a place");
        drop(held);
        assert!(slots.try_take(a).is_ok(), "given back on drop");
        assert!(slots.per_source.lock().get(&a).is_none(), "no entry left behind");
        // Loopback has no share of its own; the total bounds it.
        let local: Vec<_> = (0..MAX_HANDSHAKES - 1)
            .map(|_| slots.try_take("127.0.0.1".parse().unwrap()).unwrap())
            .collect();
        assert_eq!(slots.try_take(b).err(), Some(NoSlot::Full));
        drop((local, other));
        // Loopback mapped into IPv6 (a dual-stack listener) is loopback.
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let local: Vec<_> =
            (0..MAX_HANDSHAKES_PER_SOURCE + 1).map(|_| slots.try_take(mapped).unwrap()).collect();
        drop(local);
        // One IPv6 /64 is one source, whichever of its addresses a connection comes from.
        let in_64 = |i: u16| -> IpAddr { format!("2001:db8:0:1::{i:x}").parse().unwrap() };
        let held: Vec<_> = (0..MAX_HANDSHAKES_PER_SOURCE as u16)
            .map(|i| slots.try_take(in_64(i)).unwrap())
            .collect();
        assert_eq!(slots.try_take(in_64(999)).err(), Some(NoSlot::SourceFull));
        assert!(slots.try_take("2001:db8:0:2::1".parse().unwrap()).is_ok(), "another /64");
        drop(held);
    }

    #[test]
    fn proofs_bind_secret_label_role_and_both_hellos() {
        let (hi, ha) = ([1u8; 40], [2u8; 40]);
        let p = proof(b"s", b"L", Role::Initiator, &hi, &ha);
        assert!(verify(b"s", b"L", Role::Initiator, &hi, &ha, &p));
        assert!(!verify(b"s", b"L", Role::Acceptor, &hi, &ha, &p), "a reflected proof");
        assert!(!verify(b"t", b"L", Role::Initiator, &hi, &ha, &p), "another secret");
        assert!(!verify(b"s", b"M", Role::Initiator, &hi, &ha, &p), "another transport's");
        assert!(!verify(b"s", b"L", Role::Initiator, &ha, &hi, &p), "swapped hellos");
        assert!(!verify(b"s", b"L", Role::Initiator, &hi, &ha, &p[..31]), "a short proof");
        assert_eq!(Role::Initiator.peer(), Role::Acceptor);
    }
}
