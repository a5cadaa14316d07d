//! The software RNIC's RoCEv2 packet codec.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use bex_rnic::soft::packet::{self, Opcode, Syndrome, BTH_LEN, ICRC_LEN};

/// The route every input is taken to have come by (the ICRC covers the IP and UDP headers
/// it implies); the seeds are sealed for it.
pub const ROUTE: packet::Route = packet::Route {
    src: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 4791),
    dst: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), 4791),
};

/// Parses `data` and checks its ICRC; a packet that parses must re-encode to the same bytes
/// except the fields the codec does not keep (MigReq, BTH byte 4, the reserved bits of byte 8,
/// an ACK's credit field, pad bytes, and the ICRC, which must match when the rest does), and
/// the re-encoding must pass the ICRC check and parse to the same packet.
pub fn roce_packet(data: &[u8]) {
    let mut ids = packet::Ipv4Ids::default();
    let icrc_ok = packet::icrc_ok(data, &ROUTE, &mut ids);
    let Ok(p) = packet::parse(data) else { return };
    let again = packet::encode(&p.header, p.payload, &ROUTE);
    assert_eq!(again.len(), data.len(), "re-encoding keeps the length (pad is implied)");
    assert!(packet::icrc_ok(&again, &ROUTE, &mut ids), "an encoded packet's ICRC is right");
    let q = packet::parse(&again).expect("an encoded packet parses");
    assert_eq!(q, p, "decode(encode(decode(b))) == decode(b)");

    let hlen = p.header.encoded_len();
    let pad_start = hlen + p.payload.len();
    let body_end = data.len() - ICRC_LEN;
    for i in 0..data.len() {
        let mask = match i {
            // MigReq (bit 6) is not kept.
            1 => 0xbf,
            4 => 0x00,
            8 => 0x80,
            // AETH syndrome: an ACK's low five bits are credits, not kept.
            _ if i == hlen - 4
                && p.header.opcode == Opcode::Acknowledge
                && p.header.aeth.map(|a| a.syndrome) == Some(Syndrome::Ack) =>
            {
                0xe0
            }
            _ if (pad_start..body_end).contains(&i) => 0x00,
            // The ICRC covers the don't-care bits too: compared below.
            _ if i >= body_end => 0x00,
            _ => 0xff,
        };
        assert_eq!(
            again[i] & mask,
            data[i] & mask,
            "byte {i} differs after a round trip (header length {hlen}, BTH {BTH_LEN})"
        );
    }
    if icrc_ok && again[..body_end] == data[..body_end] {
        // The same bytes, so the same ICRC, unless the input was sealed for another IPv4
        // identification (which the check accepts too).
        let mut moved = again.clone();
        let same = (0..packet::IPV4_IDS).any(|id| {
            moved.copy_from_slice(&again);
            packet::set_ipv4_id(&mut moved, id, &mut ids);
            moved[body_end..] == data[body_end..]
        });
        assert!(same, "same bytes, an ICRC of one of the identifications");
    }
}
