//! Fixed-layout headers: the transport engine's, the TCP transport's and the RPC layer's.
//! Every byte of these is a field, so a header that decodes re-encodes to exactly its bytes.

use bex_transport::proto;
use bex_transport::tcp::wire::{self, Frame, Hello, Role, HELLO_LEN, PROOF_LEN};

fn array<const N: usize>(data: &[u8], at: usize) -> Option<[u8; N]> {
    data.get(at..at + N)?.try_into().ok()
}

/// The engine's 64-byte header (at offset 0), the RDMA bootstrap's hello (offset 0), the
/// prefix of a message written into a grant (offset 0), and the TCP transport's frame
/// header (offset 0, with the limit read from bytes 16..24), hello (offset 0) and proof (two
/// hellos and a proof from offset 0): decoders never panic, decoded headers re-encode to
/// their bytes (a grant prefix and a hello to bytes that decode alike), a decoded data frame
/// respects the limit, and only the right proof verifies.
pub fn transport_frame(data: &[u8]) {
    if let Ok(h) = proto::Header::decode(data) {
        let mut b = [0u8; proto::HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(b[..], data[..proto::HEADER_LEN], "engine header round trip");
    }

    let _ = bex_transport::rdma::check_hello(data);

    if let Some((len, offer)) = proto::decode_grant_prefix(data) {
        let mut b = [0u8; proto::GRANT_PREFIX_LEN];
        proto::encode_grant_prefix(len, offer, &mut b);
        assert_eq!(proto::decode_grant_prefix(&b), Some((len, offer)), "grant prefix round trip");
    }

    if let Some(f) = array::<{ wire::HEADER_LEN }>(data, 0) {
        let max = array::<8>(data, 16).map_or(u64::MAX, u64::from_le_bytes);
        if let Ok(frame) = Frame::decode(&f, max) {
            assert_eq!(frame.encode(), f, "TCP frame header round trip");
            if let Frame::Data(len) = frame {
                assert!(len <= max, "data frame of {len} bytes passed a limit of {max}");
            }
        }
    }

    if let Some(h) = array::<HELLO_LEN>(data, 0) {
        if let Ok(hello) = Hello::decode(&h) {
            assert_eq!(hello.encode(), h, "hello round trip");
        }
    }

    if let (Some(hi), Some(ha), Some(got)) = (
        array::<HELLO_LEN>(data, 0),
        array::<HELLO_LEN>(data, HELLO_LEN),
        array::<PROOF_LEN>(data, 2 * HELLO_LEN),
    ) {
        let secret = &data[2 * HELLO_LEN + PROOF_LEN..];
        for role in [Role::Initiator, Role::Acceptor] {
            let p = wire::proof(secret, role, &hi, &ha);
            assert!(wire::verify(secret, role, &hi, &ha, &p), "the right proof verifies");
            // Bound to the role and to both hellos in order, for any input.
            assert!(!wire::verify(secret, role.peer(), &hi, &ha, &p), "a reflected proof");
            if hi != ha {
                assert!(!wire::verify(secret, role, &ha, &hi, &p), "swapped hellos");
            }
            assert_eq!(wire::verify(secret, role, &hi, &ha, &got), got == p, "only it verifies");
        }
    }
}

/// The RPC frame header: never panics; a decoded header re-encodes to its bytes.
pub fn rpc_frame(data: &[u8]) {
    if let Some(h) = bex_rpc::frame::Header::decode(data) {
        let mut b = [0u8; bex_rpc::HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(b[..], data[..bex_rpc::HEADER_LEN], "RPC header round trip");
        let _ = bex_rpc::Status::from_u16(h.status);
    }
}
