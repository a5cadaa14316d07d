//! Two-process integrity check for the software RNIC over a real network path.
//!
//! ```text
//! stream_check server --bind 10.99.0.2 --control 10.99.0.2:7700
//! stream_check client --bind 10.99.0.1 --control 10.99.0.2:7700 --messages 5000
//! ```
//!
//! The client streams `messages` SENDs of seeded random sizes; the server checks that every
//! one arrives once, in order, with the exact bytes, and both print a JSON line. Exit status
//! is 0 only when the server saw every message intact. Used by `scripts/netns-loss.sh`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use bex_rnic::clock::{wall_elapsed, wall_now};
use bex_rnic::soft::{SoftDevice, SoftMr, UdpConfig};
use bex_rnic::verbs::*;
use bex_rnic::{bootstrap, CompletionQueue, Device, MemoryRegion, QpInit, QueuePair};
use rand::{Rng, SeedableRng};

const RQ_DEPTH: usize = 256;
const SQ_DEPTH: u32 = 64;

struct Args {
    role: String,
    bind: std::net::IpAddr,
    control: SocketAddr,
    messages: u64,
    max_len: usize,
    seed: u64,
    mtu: u32,
    timeout_s: u64,
}

fn usage() -> ! {
    eprintln!(
        "usage: stream_check (server|client) --bind IP --control IP:PORT \
         [--messages N] [--max-len BYTES] [--seed S] [--mtu BYTES] [--timeout-s S]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut it = std::env::args().skip(1);
    let role = it.next().unwrap_or_else(|| usage());
    if role != "server" && role != "client" {
        usage();
    }
    let mut a = Args {
        role,
        bind: "127.0.0.1".parse().expect("literal"),
        control: "127.0.0.1:7700".parse().expect("literal"),
        messages: 2000,
        max_len: 32 * 1024,
        seed: 1,
        mtu: 4096,
        timeout_s: 120,
    };
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| usage());
        let bad = |what: &str| -> ! {
            eprintln!("stream_check: bad value {v:?} for {what}");
            std::process::exit(2)
        };
        match flag.as_str() {
            "--bind" => a.bind = v.parse().unwrap_or_else(|_| bad("--bind")),
            "--control" => a.control = v.parse().unwrap_or_else(|_| bad("--control")),
            "--messages" => a.messages = v.parse().unwrap_or_else(|_| bad("--messages")),
            "--max-len" => a.max_len = v.parse().unwrap_or_else(|_| bad("--max-len")),
            "--seed" => a.seed = v.parse().unwrap_or_else(|_| bad("--seed")),
            "--mtu" => a.mtu = v.parse().unwrap_or_else(|_| bad("--mtu")),
            "--timeout-s" => a.timeout_s = v.parse().unwrap_or_else(|_| bad("--timeout-s")),
            _ => usage(),
        }
    }
    a
}

fn message_len(seed: u64, i: u64, max_len: usize) -> usize {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ i.wrapping_mul(0x9e37_79b9));
    rng.random_range(0..=max_len)
}

fn message_byte(i: u64, k: usize) -> u8 {
    (k as u8).wrapping_mul(13) ^ (i as u8).wrapping_mul(101) ^ ((k >> 8) as u8)
}

struct Setup {
    dev: SoftDevice,
    _pd: bex_rnic::soft::SoftPd,
    cq: bex_rnic::soft::SoftCq,
    qp: bex_rnic::soft::SoftQp,
    mem: Vec<u8>,
    mr: Option<SoftMr>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.mr.take();
    }
}

fn setup(bind: std::net::IpAddr, mem_len: usize) -> Setup {
    let dev = SoftDevice::open_udp(UdpConfig::new(SocketAddr::new(bind, 0)))
        .unwrap_or_else(|e| fail(&format!("open device: {e}")));
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(4096).expect("cq");
    let caps = QpCaps {
        max_send_wr: SQ_DEPTH,
        max_recv_wr: RQ_DEPTH as u32,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let qp = dev
        .create_qp(
            &pd,
            &QpInit { send_cq: &cq, recv_cq: &cq, srq: None, thread_domain: None, caps },
        )
        .unwrap_or_else(|e| fail(&format!("create qp: {e}")));
    let mut mem = vec![0u8; mem_len];
    // SAFETY: `mem` is never reallocated and Setup's Drop releases the MR before the memory.
    let mr = unsafe { dev.reg_mr(&pd, mem.as_mut_ptr(), mem_len, Access::ALL) }
        .unwrap_or_else(|e| fail(&format!("reg_mr: {e}")));
    Setup { dev, _pd: pd, cq, qp, mem, mr: Some(mr) }
}

fn fail(msg: &str) -> ! {
    eprintln!("stream_check: {msg}");
    std::process::exit(1)
}

/// Connects the QP; `recvs` are posted in INIT, before any packet can arrive.
fn connect(s: &Setup, stream: &mut TcpStream, mtu: u32, recvs: &[RecvWr]) {
    let remote = bootstrap::exchange(stream, &s.qp.endpoint())
        .unwrap_or_else(|e| fail(&format!("bootstrap: {e}")));
    let attrs = ConnectAttrs {
        path_mtu: Mtu::from_bytes(mtu).unwrap_or_else(|| fail("bad --mtu")),
        timeout: 12, // 16.8 ms: a loaded 2-core machine stalls threads for milliseconds
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..ConnectAttrs::default()
    };
    s.qp.to_init(&attrs.init).unwrap_or_else(|e| fail(&format!("qp to INIT: {e}")));
    s.qp.post_recv(recvs).unwrap_or_else(|e| fail(&format!("post_recv: {e}")));
    let rtr = RtrAttrs { remote, path_mtu: attrs.path_mtu, min_rnr_timer: attrs.min_rnr_timer };
    s.qp.to_rtr(&rtr).unwrap_or_else(|e| fail(&format!("qp to RTR: {e}")));
    let rts = RtsAttrs {
        sq_psn: s.qp.endpoint().psn,
        timeout: attrs.timeout,
        retry_cnt: attrs.retry_cnt,
        rnr_retry: attrs.rnr_retry,
    };
    s.qp.to_rts(&rts).unwrap_or_else(|e| fail(&format!("qp to RTS: {e}")));
}

fn main() {
    let a = parse_args();
    let start = wall_now();
    let limit = Duration::from_secs(a.timeout_s);
    let mut wcs = [WorkCompletion::default(); 32];
    if a.role == "server" {
        let listener = TcpListener::bind(a.control).unwrap_or_else(|e| fail(&format!("{e}")));
        println!("{{\"ready\":true}}");
        let (mut stream, _) = listener.accept().unwrap_or_else(|e| fail(&format!("{e}")));
        let mut params = [0u8; 24];
        stream.read_exact(&mut params).unwrap_or_else(|e| fail(&format!("params: {e}")));
        let n = u64::from_le_bytes(params[0..8].try_into().expect("8"));
        let seed = u64::from_le_bytes(params[8..16].try_into().expect("8"));
        let max_len = u64::from_le_bytes(params[16..24].try_into().expect("8")) as usize;
        let slot = max_len.max(1).next_multiple_of(64);
        let s = setup(a.bind, slot * RQ_DEPTH);
        let keys = s.mr.as_ref().expect("mr").keys();
        let recv = |i: usize| RecvWr {
            wr_id: i as u64,
            sg_list: SgList::one(Sge {
                addr: keys.addr + (i * slot) as u64,
                length: slot as u32,
                lkey: keys.lkey,
            }),
        };
        let all: Vec<_> = (0..RQ_DEPTH).map(recv).collect();
        connect(&s, &mut stream, a.mtu, &all);
        let (mut got, mut bad) = (0u64, 0u64);
        while got < n {
            if wall_elapsed(start) > limit {
                fail(&format!("timed out after {got} of {n} messages"));
            }
            let k = s.cq.poll(&mut wcs).unwrap_or_else(|e| fail(&format!("poll: {e}")));
            for wc in &wcs[..k] {
                if wc.status != WcStatus::Success {
                    fail(&format!("message {got}: completion {wc:?}"));
                }
                let slot_i = wc.wr_id as usize;
                let want = message_len(seed, got, max_len);
                let off = slot_i * slot;
                let intact = wc.byte_len as usize == want
                    && s.mem[off..off + want]
                        .iter()
                        .enumerate()
                        .all(|(k, b)| *b == message_byte(got, k));
                if !intact {
                    bad += 1;
                }
                got += 1;
                s.qp.post_recv(&[recv(slot_i)]).unwrap_or_else(|e| fail(&format!("repost: {e}")));
            }
            if k == 0 {
                std::thread::yield_now();
            }
        }
        let c = s.dev.counters();
        println!(
            "{{\"role\":\"server\",\"messages\":{got},\"corrupt_or_misordered\":{bad},\"seq_naks_sent\":{},\"duplicates\":{},\"out_of_sequence\":{},\"rnr_naks_sent\":{},\"bad_icrc\":{},\"wire_recv_errors\":{},\"seconds\":{:.3}}}",
            c.seq_naks_sent, c.rx_duplicates, c.rx_out_of_sequence, c.rnr_naks_sent, c.rx_bad_icrc, c.wire_recv_errors,
            wall_elapsed(start).as_secs_f64()
        );
        let _ = stream.write_all(&[u8::from(bad == 0)]);
        // Keep answering until the client has all its completions and hangs up: with loss, the
        // ACK of the last messages may be dropped, and a retransmission must find us here.
        let _ = stream.set_nonblocking(true);
        let mut byte = [0u8; 1];
        while wall_elapsed(start) < limit {
            let _ = s.cq.poll(&mut wcs);
            match stream.read(&mut byte) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                _ => break,
            }
        }
        // Close the device before exiting (exit skips destructors).
        drop(s);
        std::process::exit(if bad == 0 { 0 } else { 1 });
    }
    // Client.
    let mut stream = loop {
        match TcpStream::connect(a.control) {
            Ok(s) => break s,
            Err(_) if wall_elapsed(start) < Duration::from_secs(10) => std::thread::yield_now(),
            Err(e) => fail(&format!("control connect: {e}")),
        }
    };
    let mut params = Vec::new();
    params.extend_from_slice(&a.messages.to_le_bytes());
    params.extend_from_slice(&a.seed.to_le_bytes());
    params.extend_from_slice(&(a.max_len as u64).to_le_bytes());
    stream.write_all(&params).unwrap_or_else(|e| fail(&format!("params: {e}")));
    let slot = a.max_len.max(1).next_multiple_of(64);
    let ring = SQ_DEPTH as usize;
    let mut s = setup(a.bind, slot * ring);
    connect(&s, &mut stream, a.mtu, &[]);
    let keys = s.mr.as_ref().expect("mr").keys();
    let (mut posted, mut done) = (0u64, 0u64);
    while done < a.messages {
        if wall_elapsed(start) > limit {
            fail(&format!("timed out after {done} of {} sends", a.messages));
        }
        while posted < a.messages && posted - done < u64::from(SQ_DEPTH) {
            let len = message_len(a.seed, posted, a.max_len);
            let off = (posted as usize % ring) * slot;
            for (k, b) in s.mem[off..off + len].iter_mut().enumerate() {
                *b = message_byte(posted, k);
            }
            let wr = SendWr {
                wr_id: posted,
                op: SendOp::Send,
                sg_list: SgList::one(Sge {
                    addr: keys.addr + off as u64,
                    length: len as u32,
                    lkey: keys.lkey,
                }),
                signaled: true,
            };
            s.qp.post_send(&[wr]).unwrap_or_else(|e| fail(&format!("post_send: {e}")));
            posted += 1;
        }
        let k = s.cq.poll(&mut wcs).unwrap_or_else(|e| fail(&format!("poll: {e}")));
        for wc in &wcs[..k] {
            if wc.status != WcStatus::Success || wc.wr_id != done {
                fail(&format!("send {done}: completion {wc:?}"));
            }
            done += 1;
        }
        if k == 0 {
            std::thread::yield_now();
        }
    }
    let c = s.dev.counters();
    let mut verdict = [0u8; 1];
    let server_ok = stream.read_exact(&mut verdict).is_ok() && verdict[0] == 1;
    println!(
        "{{\"role\":\"client\",\"messages\":{done},\"retransmitted_packets\":{},\"ack_timeouts\":{},\"seq_naks_received\":{},\"rnr_naks_received\":{},\"tx_packets\":{},\"wire_send_errors\":{},\"server_ok\":{server_ok},\"seconds\":{:.3}}}",
        c.retransmitted_packets, c.ack_timeouts, c.seq_naks_received, c.rnr_naks_received,
        c.tx_packets, c.wire_send_errors, wall_elapsed(start).as_secs_f64()
    );
    drop(s);
    std::process::exit(if server_ok { 0 } else { 1 });
}
