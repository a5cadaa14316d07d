//! The software RNIC's ICRC checked on real traffic: a tcpdump capture of two software RNICs
//! talking across network namespaces (`scripts/roce-capture.sh` makes it, with GSO sends
//! segmented by the kernel so every segment's real IP header is on the wire), against an
//! implementation of RoCEv2's ICRC written here from the spec's rules, apart from the codec's.
//!
//! Run by the script (it needs root for the namespaces): `BEX_ROCE_PCAP=FILE cargo test -p
//! bex-rnic --test icrc_capture -- --ignored`.

/// RoCEv2's ICRC (IBA Annex A17; Linux rxe's `rxe_icrc_hdr`): CRC-32 over 8 bytes of ones, the
/// IP header with TOS/TTL/checksum (IPv4) or traffic class/flow label/hop limit (IPv6) set to
/// ones, the UDP header with its checksum set to ones, the BTH with byte 4 set to ones, and the
/// rest up to the trailer; bitwise, no tables, no library.
fn icrc(ip: &[u8], udp: &[u8], roce: &[u8]) -> u32 {
    let mut ip = ip.to_vec();
    if ip[0] >> 4 == 4 {
        ip[1] = 0xff;
        ip[8] = 0xff;
        ip[10..12].fill(0xff);
    } else {
        ip[0] |= 0x0f;
        ip[1..4].fill(0xff);
        ip[7] = 0xff;
    }
    let mut udp = udp.to_vec();
    udp[6..8].fill(0xff);
    let mut bth = roce.to_vec();
    bth[4] = 0xff;
    let mut crc = !0u32;
    for byte in [0xffu8; 8].iter().chain(&ip).chain(&udp).chain(&bth) {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// What the capture holds.
#[derive(Debug, Default)]
struct Tally {
    v4: usize,
    v6: usize,
    /// IPv4 packets with a non-zero identification (segments of GSO sends).
    v4_nonzero_id: usize,
    bad: Vec<String>,
}

/// Checks every UDP packet of an Ethernet pcap (the classic format tcpdump writes).
fn check_pcap(data: &[u8]) -> Tally {
    let u32_at = |b: &[u8], at: usize, be: bool| {
        let v = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        if be {
            u32::from_be_bytes(v)
        } else {
            u32::from_le_bytes(v)
        }
    };
    assert!(data.len() >= 24, "not a pcap: {} bytes", data.len());
    let magic = u32_at(data, 0, false);
    let be = match magic {
        0xa1b2_c3d4 | 0xa1b2_3c4d => false,
        0xd4c3_b2a1 | 0x4d3c_b2a1 => true,
        _ => panic!("not a classic pcap (magic {magic:#x}): write it with tcpdump -w"),
    };
    assert_eq!(u32_at(data, 20, be), 1, "link type must be Ethernet");
    let mut t = Tally::default();
    let mut at = 24;
    while at + 16 <= data.len() {
        let (incl, orig) = (u32_at(data, at + 8, be) as usize, u32_at(data, at + 12, be) as usize);
        let frame = &data[at + 16..(at + 16 + incl).min(data.len())];
        at += 16 + incl;
        assert_eq!(incl, orig, "truncated capture: use tcpdump -s 0");
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        let (ip, udp_at) = match ethertype {
            0x0800 if frame[14 + 9] == 17 => {
                let ihl = usize::from(frame[14] & 0x0f) * 4;
                (&frame[14..14 + ihl], 14 + ihl)
            }
            0x86dd if frame[14 + 6] == 17 => (&frame[14..54], 54),
            _ => continue,
        };
        let udp = &frame[udp_at..udp_at + 8];
        let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
        let payload = &frame[udp_at + 8..udp_at + udp_len];
        if payload.len() < 12 + 4 {
            continue;
        }
        let (roce, trailer) = payload.split_at(payload.len() - 4);
        let wire = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
        let want = icrc(ip, udp, roce);
        if ethertype == 0x0800 {
            t.v4 += 1;
            if ip[4..6] != [0, 0] {
                t.v4_nonzero_id += 1;
            }
        } else {
            t.v6 += 1;
        }
        if wire != want && t.bad.len() < 5 {
            t.bad.push(format!(
                "{} B UDP payload, opcode {:#04x}: ICRC {wire:#010x}, RoCEv2 says {want:#010x}",
                payload.len(),
                roce[0]
            ));
        }
    }
    t
}

#[test]
#[ignore = "needs a capture: scripts/roce-capture.sh runs it"]
fn captured_packets_carry_rocev2_icrcs() {
    let path = std::env::var("BEX_ROCE_PCAP").expect("BEX_ROCE_PCAP names the capture");
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let t = check_pcap(&data);
    println!(
        "{path}: {} IPv4 packets ({} with a non-zero identification), {} IPv6 packets",
        t.v4, t.v4_nonzero_id, t.v6
    );
    assert!(t.bad.is_empty(), "ICRC mismatches: {:#?}", t.bad);
    assert!(t.v4 > 100 && t.v6 > 100, "both families captured: {t:?}");
    assert!(t.v4_nonzero_id > 0, "GSO segments (identification > 0) captured: {t:?}");
}

#[test]
fn the_checker_agrees_with_a_packet_a_connectx_4_sent() {
    // A CNP captured on a ConnectX-4 Lx (published with scapy's RoCE tests), as a pcap.
    let frame: Vec<u8> = [
        "e41d2dab2bc27cfe90643b32080045c2003c718c4000401191610a0011010a001201",
        "000012b7002800008100ffff40000118",
        &"00".repeat(20), // the BTH's last 4 bytes and the CNP's 16 of padding
        "82fd002a",
    ]
    .concat()
    .as_bytes()
    .chunks(2)
    .map(|h| u8::from_str_radix(std::str::from_utf8(h).unwrap(), 16).unwrap())
    .collect();
    let mut pcap = Vec::new();
    for v in [0xa1b2_c3d4u32, 0x0004_0002, 0, 0, 65535, 1] {
        pcap.extend_from_slice(&v.to_le_bytes());
    }
    pcap.truncate(24);
    let n = frame.len() as u32;
    for v in [0u32, 0, n, n] {
        pcap.extend_from_slice(&v.to_le_bytes());
    }
    pcap.extend_from_slice(&frame);
    let t = check_pcap(&pcap);
    assert_eq!((t.v4, t.v4_nonzero_id, t.bad.len()), (1, 1, 0), "{t:?}");
    // One flipped payload bit is caught.
    let last = pcap.len() - 6;
    pcap[last] ^= 1;
    assert_eq!(check_pcap(&pcap).bad.len(), 1);
}
