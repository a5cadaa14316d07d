//! Out-of-band connection bootstrap: two sides swap their [`QpEndpoint`]s over a TCP stream.
//! The same exchange serves the software RNIC and hardware verbs.
//!
//! Wire format (both directions, 40 bytes, little-endian): magic `b"BEXQP\0\0\x01"`,
//! gid (16), udp_port (2), lid (2), qpn (4), psn (4), reserved (4).

use std::io::{Read, Write};

use crate::verbs::QpEndpoint;

const MAGIC: [u8; 8] = *b"BEXQP\0\0\x01";
/// Size of one encoded endpoint.
pub const ENDPOINT_LEN: usize = 40;

/// Why a bootstrap exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The stream failed or closed early.
    #[error("bootstrap I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that is not a bex endpoint.
    #[error("bootstrap: bad magic from peer (not a bex RNIC endpoint, or another version)")]
    BadMagic,
    /// A field is out of range (QPN or PSN wider than 24 bits).
    #[error("bootstrap: field out of range: {0}")]
    OutOfRange(&'static str),
}

/// Encodes an endpoint.
pub fn encode(ep: &QpEndpoint) -> [u8; ENDPOINT_LEN] {
    let mut out = [0u8; ENDPOINT_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..24].copy_from_slice(&ep.gid);
    out[24..26].copy_from_slice(&ep.udp_port.to_le_bytes());
    out[26..28].copy_from_slice(&ep.lid.to_le_bytes());
    out[28..32].copy_from_slice(&ep.qpn.to_le_bytes());
    out[32..36].copy_from_slice(&ep.psn.to_le_bytes());
    out
}

/// Decodes an endpoint, validating magic and field ranges.
pub fn decode(buf: &[u8; ENDPOINT_LEN]) -> Result<QpEndpoint, BootstrapError> {
    if buf[..8] != MAGIC {
        return Err(BootstrapError::BadMagic);
    }
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&buf[8..24]);
    let ep = QpEndpoint {
        gid,
        udp_port: u16::from_le_bytes([buf[24], buf[25]]),
        lid: u16::from_le_bytes([buf[26], buf[27]]),
        qpn: u32_at(28),
        psn: u32_at(32),
    };
    if ep.qpn >= 1 << 24 {
        return Err(BootstrapError::OutOfRange("qpn"));
    }
    if ep.psn >= 1 << 24 {
        return Err(BootstrapError::OutOfRange("psn"));
    }
    Ok(ep)
}

/// Sends `local` and reads the peer's endpoint (both sides call this; order does not matter
/// because each writes before reading and the message fits a socket buffer).
pub fn exchange<S: Read + Write>(
    stream: &mut S,
    local: &QpEndpoint,
) -> Result<QpEndpoint, BootstrapError> {
    stream.write_all(&encode(local))?;
    stream.flush()?;
    let mut buf = [0u8; ENDPOINT_LEN];
    stream.read_exact(&mut buf)?;
    decode(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> QpEndpoint {
        QpEndpoint { gid: [7; 16], udp_port: 4791, lid: 3, qpn: 0xab_cdef, psn: 0x12_3456 }
    }

    #[test]
    fn round_trips() {
        assert_eq!(decode(&encode(&sample())).unwrap(), sample());
    }

    #[test]
    fn rejects_foreign_bytes_and_wide_fields() {
        let mut bad = encode(&sample());
        bad[0] = b'X';
        assert!(matches!(decode(&bad), Err(BootstrapError::BadMagic)));
        let mut wide = encode(&sample());
        wide[31] = 1;
        assert!(matches!(decode(&wide), Err(BootstrapError::OutOfRange("qpn"))));
    }

    #[test]
    fn exchanges_over_tcp() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            exchange(&mut s, &QpEndpoint { qpn: 1, ..sample() }).unwrap()
        });
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let got = exchange(&mut c, &QpEndpoint { qpn: 2, ..sample() }).unwrap();
        assert_eq!(got.qpn, 1);
        assert_eq!(server.join().unwrap().qpn, 2);
    }
}
