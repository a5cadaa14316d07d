//! The software RNIC's RoCEv2 packet codec.

use bex_rnic::soft::packet::{self, Opcode, Syndrome, BTH_LEN, ICRC_LEN};

/// Parses `data` with and without the ICRC check; a packet that parses must re-encode to the
/// same bytes except the fields the codec does not keep (MigReq, BTH byte 4, the reserved bits of
/// byte 8, an ACK's credit field, pad bytes, and the ICRC, which must match when the rest does), and the
/// re-encoding must parse (ICRC checked) to the same packet.
pub fn roce_packet(data: &[u8]) {
    let checked = packet::parse(data, true);
    let unchecked = packet::parse(data, false);
    if let Ok(p) = checked {
        assert_eq!(unchecked, Ok(p), "a packet with a good ICRC parses the same unchecked");
    }
    let Ok(p) = unchecked else { return };
    let again = packet::encode(&p.header, p.payload);
    assert_eq!(again.len(), data.len(), "re-encoding keeps the length (pad is implied)");
    let q = packet::parse(&again, true).expect("an encoded packet parses");
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
    if checked.is_ok() && again[..body_end] == data[..body_end] {
        assert_eq!(again[body_end..], data[body_end..], "same bytes, same ICRC");
    }
}
