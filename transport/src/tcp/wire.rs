//! The TCP transport's wire format: the handshake (hello + proof) and the frame header.
//! Pure encoding and checking, no I/O; every decoder returns an error on bad input and never
//! panics.
//!
//! Handshake, both sides at once over the fresh connection:
//!
//! ```text
//! hello (58 B): magic "BEXTCP\0\x02" | nonce [32] | listen IP as IPv6 (v4-mapped) [16] | listen port u16 LE
//! proof (32 B): HMAC-SHA256(secret; "bex-tcp/1" | role | hello_initiator | hello_acceptor)
//! ```
//!
//! Each side sends its hello, reads the peer's, sends its proof, reads and checks the peer's.
//! The role label ("initiator"/"acceptor!") makes the two proofs of one connection differ, so
//! a peer cannot reflect ours back; both fresh random nonces make every proof single-use.
//!
//! Then frames, each a 16-byte header followed by its payload:
//!
//! ```text
//! len u64 LE | kind u32 LE (1 = data, 2 = close, 3 = keepalive) | reserved u32 = 0
//! ```
//!
//! A close frame carries no payload and ends the sender's direction; a connection that ends
//! without one ended by failure. A keepalive carries no payload either: a writer idle for
//! `tcp_keepalive_interval` sends one, so a reader that waits `tcp_keepalive_timeout` for
//! bytes in vain knows its peer is gone or hung (version 1 had none: a blackholed or stopped peer's
//! connection stayed open for good).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// First bytes of a hello: the protocol and its version.
pub const HELLO_MAGIC: [u8; 8] = *b"BEXTCP\x00\x02";
/// Bytes of a hello's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a hello.
pub const HELLO_LEN: usize = 8 + NONCE_LEN + 16 + 2;
/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = crate::auth::PROOF_LEN;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 16;

const KIND_DATA: u32 = 1;
const KIND_CLOSE: u32 = 2;
const KIND_KEEPALIVE: u32 = 3;
const PROOF_LABEL: &[u8] = b"bex-tcp/1";

/// What a side of the handshake sends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Fresh randomness of this handshake.
    pub nonce: [u8; NONCE_LEN],
    /// The address the sender's transport listens on (what its sockets' `peer()` names).
    pub listen: SocketAddr,
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..8 + NONCE_LEN].copy_from_slice(&self.nonce);
        let ip = match self.listen.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        let at = 8 + NONCE_LEN;
        b[at..at + 16].copy_from_slice(&ip.octets());
        b[at + 16..].copy_from_slice(&self.listen.port().to_le_bytes());
        b
    }

    /// Parses a hello; `Err` names what is wrong.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, &'static str> {
        if b[..8] != HELLO_MAGIC {
            return Err("not a bex TCP transport (bad magic or version)");
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[8..8 + NONCE_LEN]);
        let at = 8 + NONCE_LEN;
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[at..at + 16]);
        let port = u16::from_le_bytes([b[at + 16], b[at + 17]]);
        let listen = SocketAddr::new(Ipv6Addr::from(ip).to_canonical(), port);
        Ok(Hello { nonce, listen })
    }
}

pub use crate::auth::Role;

/// The proof `role` sends: [`crate::auth::proof`] under this transport's label.
pub fn proof(
    secret: &[u8],
    role: Role,
    hello_initiator: &[u8; HELLO_LEN],
    hello_acceptor: &[u8; HELLO_LEN],
) -> [u8; PROOF_LEN] {
    crate::auth::proof(secret, PROOF_LABEL, role, hello_initiator, hello_acceptor)
}

/// Checks (in constant time) a proof `role` sent.
pub fn verify(
    secret: &[u8],
    role: Role,
    hello_initiator: &[u8; HELLO_LEN],
    hello_acceptor: &[u8; HELLO_LEN],
    got: &[u8; PROOF_LEN],
) -> bool {
    crate::auth::verify(secret, PROOF_LABEL, role, hello_initiator, hello_acceptor, got)
}

/// A frame, as its header announces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A message of this many bytes follows.
    Data(u64),
    /// The sender closed its socket; nothing follows.
    Close,
    /// The sender is alive (its writer was idle).
    Keepalive,
}

impl Frame {
    /// The header's bytes.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let (len, kind) = match self {
            Frame::Data(len) => (len, KIND_DATA),
            Frame::Close => (0, KIND_CLOSE),
            Frame::Keepalive => (0, KIND_KEEPALIVE),
        };
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&len.to_le_bytes());
        b[8..12].copy_from_slice(&kind.to_le_bytes());
        b
    }

    /// Parses a header, refusing data frames longer than `max_len`; `Err` says why.
    pub fn decode(b: &[u8; HEADER_LEN], max_len: u64) -> Result<Frame, String> {
        let mut len = [0u8; 8];
        len.copy_from_slice(&b[..8]);
        let len = u64::from_le_bytes(len);
        let kind = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let reserved = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if reserved != 0 {
            return Err(format!("reserved header field is {reserved:#x}, not 0"));
        }
        match kind {
            KIND_DATA if len <= max_len => Ok(Frame::Data(len)),
            KIND_DATA => Err(format!("message of {len} bytes exceeds the limit of {max_len}")),
            KIND_CLOSE if len == 0 => Ok(Frame::Close),
            KIND_CLOSE => Err(format!("close frame with a {len}-byte payload")),
            KIND_KEEPALIVE if len == 0 => Ok(Frame::Keepalive),
            KIND_KEEPALIVE => Err(format!("keepalive frame with a {len}-byte payload")),
            k => Err(format!("unknown frame kind {k}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hello_round_trips_v4_and_v6() {
        for listen in ["127.0.0.1:7000", "[::1]:65535", "10.1.2.3:1"] {
            let h = Hello { nonce: [9; NONCE_LEN], listen: listen.parse().unwrap() };
            assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn hello_layout_is_pinned() {
        let h = Hello { nonce: [0xab; NONCE_LEN], listen: "1.2.3.4:258".parse().unwrap() };
        let b = h.encode();
        assert_eq!(&b[..8], b"BEXTCP\x00\x02");
        assert_eq!(&b[8..40], &[0xab; 32]);
        assert_eq!(&b[40..56], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 1, 2, 3, 4]);
        assert_eq!(&b[56..], &[2, 1]);
    }

    #[test]
    fn hello_with_another_magic_or_version_is_refused() {
        let mut b = Hello { nonce: [1; NONCE_LEN], listen: "1.2.3.4:5".parse().unwrap() }.encode();
        b[7] = 1;
        assert!(Hello::decode(&b).is_err(), "version 1 (no keepalives)");
        b[7] = 2;
        b[0] = b'X';
        assert!(Hello::decode(&b).is_err());
    }

    #[test]
    fn proofs_depend_on_role_secret_and_both_hellos() {
        let hi = Hello { nonce: [1; NONCE_LEN], listen: "1.2.3.4:5".parse().unwrap() }.encode();
        let ha = Hello { nonce: [2; NONCE_LEN], listen: "1.2.3.4:6".parse().unwrap() }.encode();
        let p = proof(b"s", Role::Initiator, &hi, &ha);
        assert!(verify(b"s", Role::Initiator, &hi, &ha, &p));
        assert!(!verify(b"s", Role::Acceptor, &hi, &ha, &p), "a reflected proof is refused");
        assert!(!verify(b"t", Role::Initiator, &hi, &ha, &p), "another secret is refused");
        assert!(!verify(b"s", Role::Initiator, &ha, &hi, &p), "swapped hellos are refused");
        let mut other = ha;
        other[8] ^= 1;
        assert!(!verify(b"s", Role::Initiator, &hi, &other, &p), "another nonce is refused");
    }

    #[test]
    fn frame_header_layout_is_pinned() {
        let b = Frame::Data(0x0102_0304_0506_0708).encode();
        assert_eq!(b, [8, 7, 6, 5, 4, 3, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Frame::Close.encode(), [0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Frame::Keepalive.encode(), [0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn frame_lengths_up_to_the_limit_pass_and_one_more_fails() {
        assert_eq!(Frame::decode(&Frame::Data(0).encode(), 100), Ok(Frame::Data(0)));
        assert_eq!(Frame::decode(&Frame::Data(100).encode(), 100), Ok(Frame::Data(100)));
        assert!(Frame::decode(&Frame::Data(101).encode(), 100).is_err());
        assert!(Frame::decode(&Frame::Data(u64::MAX).encode(), u64::MAX - 1).is_err());
        assert_eq!(Frame::decode(&Frame::Close.encode(), 0), Ok(Frame::Close));
    }

    #[test]
    fn bad_kinds_reserved_bits_and_close_payloads_fail() {
        let mut b = Frame::Data(1).encode();
        b[8] = 4;
        assert!(Frame::decode(&b, 10).is_err());
        let mut b = Frame::Keepalive.encode();
        b[0] = 1;
        assert!(Frame::decode(&b, 10).is_err());
        let mut b = Frame::Data(1).encode();
        b[15] = 1;
        assert!(Frame::decode(&b, 10).is_err());
        let mut b = Frame::Close.encode();
        b[0] = 1;
        assert!(Frame::decode(&b, 10).is_err());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(any::<u8>(), HELLO_LEN), max in any::<u64>()) {
            let mut h = [0u8; HELLO_LEN];
            h.copy_from_slice(&b);
            let _ = Hello::decode(&h);
            let mut f = [0u8; HEADER_LEN];
            f.copy_from_slice(&b[..HEADER_LEN]);
            let _ = Frame::decode(&f, max);
        }

        // Random bytes almost never form a data header (kind 1, reserved 0): the limit is
        // checked on headers that are one.
        #[test]
        fn a_data_frame_is_accepted_exactly_up_to_the_limit(len in any::<u64>(), max in any::<u64>()) {
            let decoded = Frame::decode(&Frame::Data(len).encode(), max);
            if len <= max {
                prop_assert_eq!(decoded, Ok(Frame::Data(len)));
            } else {
                prop_assert!(decoded.is_err());
            }
            prop_assert_eq!(Frame::decode(&Frame::Data(max).encode(), max), Ok(Frame::Data(max)));
        }
    }
}
