//! Peer authentication, one scheme for both transports' handshakes: after exchanging hellos
//! (each with a fresh random nonce), each side sends an HMAC-SHA256 under the cluster's
//! shared secret of a per-transport label, its role, and both hellos (the initiator's first),
//! and checks the other's in constant time. The role in the MAC refuses a reflected proof;
//! the nonces refuse a replayed one; the label keeps an RDMA proof from passing as a TCP one.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;

/// Inbound handshakes in progress at once, per transport; further connections are refused
/// and counted (`bootstrap_refused`), so a stranger's storm of silent connections costs a
/// bounded number of tasks and sockets until `connect_timeout` ends each.
pub const MAX_HANDSHAKES: usize = 1024;

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
