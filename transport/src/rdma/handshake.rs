//! The bootstrap over one TCP connection: hellos (queue depths, listen address, eager limit,
//! path MTU, nonce), proofs under the shared secret ([`crate::auth`]), and only then the
//! engine's place and QP: each side sends its QP endpoint with a MAC binding it to the
//! authenticated hellos, connects its QP and sends a ready byte. Each side's engine takes the
//! smaller of the two eager limits and path MTUs, so peers configured differently (a rolling
//! change) still agree on what a receive buffer holds and how large a packet is.
//!
//! Why the QP comes after the proofs (version 3 sent its endpoint in the hello): a place on
//! an endpoint's CQ and a QP are scarce, and a stranger holding a few silent connections took
//! every place for `connect_timeout`, renewably. Now a stranger costs a task and a TCP socket
//! until its proof is due, within [`crate::auth::MAX_HANDSHAKES`] (and its share per source).

use super::*;
use crate::undo::Undo;
use bex_rnic::verbs::Mtu;

#[derive(Debug, PartialEq, Eq)]
struct Hello {
    nonce: [u8; 16],
    rq_depth: u32,
    sq_depth: u32,
    listen: SocketAddr,
    eager_max: u32,
    path_mtu: Mtu,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..24].copy_from_slice(&self.nonce);
        let e = 24;
        b[e..e + 4].copy_from_slice(&self.rq_depth.to_le_bytes());
        b[e + 4..e + 8].copy_from_slice(&self.sq_depth.to_le_bytes());
        b[e + 8..e + 24].copy_from_slice(&QpEndpoint::gid_of(self.listen.ip()));
        b[e + 24..e + 26].copy_from_slice(&self.listen.port().to_le_bytes());
        b[e + 26..e + 30].copy_from_slice(&self.eager_max.to_le_bytes());
        b[e + 30..e + 34].copy_from_slice(&self.path_mtu.bytes().to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello> {
        let refuse = |why: &str| TransportError::Refused(format!("bootstrap: {why}"));
        if b[..8] != HELLO_MAGIC {
            return Err(refuse("not a bex transport (bad magic or version)"));
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[8..24]);
        let e = 24;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let rq_depth = u32_at(e);
        let sq_depth = u32_at(e + 4);
        let rq_ok = rq_depth == 0 || (4..=16384).contains(&rq_depth);
        if !rq_ok || !(2..=16384).contains(&sq_depth) {
            return Err(refuse("queue depths out of range"));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[e + 8..e + 24]);
        let port = u16::from_le_bytes([b[e + 24], b[e + 25]]);
        let listen = QpEndpoint { gid, udp_port: port, lid: 0, qpn: 0, psn: 0 }.socket_addr();
        let eager_max = u32_at(e + 26);
        if !(64..=1 << 20).contains(&eager_max) {
            return Err(refuse("eager_max out of range"));
        }
        let path_mtu = Mtu::from_bytes(u32_at(e + 30)).ok_or_else(|| refuse("bad path MTU"))?;
        Ok(Hello { nonce, rq_depth, sq_depth, listen, eager_max, path_mtu })
    }
}

/// Decodes the first [`HELLO_LEN`] bytes of `b` as a peer's hello (`None`: too short), and
/// checks that a hello it accepts decodes again to the same fields once re-encoded: for
/// the fuzz targets (`bex-fuzz-targets`), since the hello's type is this module's. Returns
/// whether the hello was accepted.
pub fn check_hello(b: &[u8]) -> Option<bool> {
    let b: &[u8; HELLO_LEN] = b.get(..HELLO_LEN)?.try_into().ok()?;
    let Ok(hello) = Hello::decode(b) else { return Some(false) };
    let again = Hello::decode(&hello.encode());
    assert!(again.as_ref().is_ok_and(|h| *h == hello), "hello round trip: {hello:?} → {again:?}");
    Some(true)
}

/// A valid hello's bytes (a fuzz seed).
pub fn sample_hello() -> [u8; HELLO_LEN] {
    Hello {
        nonce: [3; 16],
        rq_depth: 64,
        sq_depth: 32,
        listen: SocketAddr::from(([10, 0, 0, 1], 4791)),
        eager_max: 8192,
        path_mtu: Mtu::Mtu4096,
    }
    .encode()
}

/// This transport's label in the handshake's proofs ([`crate::auth`]).
const PROOF_LABEL: &[u8] = b"bex-transport/1";
/// The label of the MAC that binds a QP endpoint to the authenticated hellos.
const ENDPOINT_LABEL: &[u8] = b"bex-transport/1 qp endpoint";
/// A QP endpoint and its MAC.
const ENDPOINT_MSG_LEN: usize = bootstrap::ENDPOINT_LEN + PROOF_LEN;

fn role(initiator: bool) -> Role {
    if initiator {
        Role::Initiator
    } else {
        Role::Acceptor
    }
}

impl<D: Device + 'static> FactoryImpl<D> {
    pub(super) async fn bootstrap(
        &self,
        mut stream: TcpStream,
        initiator: bool,
    ) -> Result<(SocketAddr, EngineRef)> {
        let _ = stream.set_nodelay(true);
        let mine = Hello {
            nonce: rand::random(),
            // 0 tells the peer this side draws on an SRQ and takes no credits.
            rq_depth: if self.cfg.srq { 0 } else { self.cfg.rq_depth },
            sq_depth: self.cfg.sq_depth,
            listen: self.listen_addr,
            // Validated to at most 1 MiB.
            eager_max: u32::try_from(self.cfg.eager_max).unwrap_or(u32::MAX),
            path_mtu: self.cfg.path_mtu,
        }
        .encode();
        // An inbound peer that leaves before proving itself counts once as refused (a
        // stranger's probe), whether it errs, sends a bad hello or proof, or is cut off by
        // the listener's timeout (which drops this future: hence a guard). A cancelled
        // outbound bootstrap is this side's doing; an outbound one refused by what the peer
        // sent counts. Once the peer has proven itself, a failure is no refusal.
        let unproven = Undo::new(|| {
            if !initiator {
                Counters::add(&self.counters.bootstrap_refused, 1);
            }
        });
        let refuse = |why: &str| {
            if initiator {
                Counters::add(&self.counters.bootstrap_refused, 1);
            }
            TransportError::Refused(format!("bootstrap: {why}"))
        };
        stream.write_all(&mine).await?;
        let mut theirs = [0u8; HELLO_LEN];
        stream.read_exact(&mut theirs).await?;
        let hello = Hello::decode(&theirs).inspect_err(|_| {
            if initiator {
                Counters::add(&self.counters.bootstrap_refused, 1);
            }
        })?;
        let (hi, ha) = if initiator { (&mine, &theirs) } else { (&theirs, &mine) };
        stream.write_all(&proof(&self.cfg.secret, PROOF_LABEL, role(initiator), hi, ha)).await?;
        let mut their_proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut their_proof).await.map_err(|_| {
            TransportError::Refused("bootstrap: the peer closed during authentication".into())
        })?;
        if !verify(&self.cfg.secret, PROOF_LABEL, role(initiator).peer(), hi, ha, &their_proof) {
            return Err(refuse("the peer does not have the cluster's shared secret"));
        }
        unproven.done();
        // From here on, a MAC that does not check is the peer's fault whichever side it is.
        let refuse = |why: &str| {
            Counters::add(&self.counters.bootstrap_refused, 1);
            TransportError::Refused(format!("bootstrap: {why}"))
        };
        // The peer is authenticated: only now a place and a QP.
        let endpoint = self.place_engine()?;
        // Given back unless the endpoint takes the engine (and with it the place).
        let placed = Undo::new(|| {
            self.engine_counts[endpoint].fetch_sub(1, Ordering::AcqRel);
        });
        let cq = &self.cqs[endpoint];
        let caps = QpCaps {
            max_send_wr: self.cfg.sq_depth,
            max_recv_wr: self.cfg.rq_depth,
            max_send_sge: 2,
            max_recv_sge: 1,
        };
        let srq = self.srqs[endpoint].as_deref();
        let td = self.tds[endpoint].as_deref();
        let qp = self.device.create_qp(
            &self.pd,
            &QpInit { send_cq: cq, recv_cq: cq, srq, thread_domain: td, caps },
        )?;
        // The endpoint travels with a MAC over both hellos, so it is as authenticated as they
        // are (it was inside the MAC'd hello before).
        let transcript = [&hi[..], &ha[..]].concat();
        let mut ours = [0u8; ENDPOINT_MSG_LEN];
        let my_endpoint = bootstrap::encode(&qp.endpoint());
        ours[..bootstrap::ENDPOINT_LEN].copy_from_slice(&my_endpoint);
        ours[bootstrap::ENDPOINT_LEN..].copy_from_slice(&proof(
            &self.cfg.secret,
            ENDPOINT_LABEL,
            role(initiator),
            &transcript,
            &my_endpoint,
        ));
        stream.write_all(&ours).await?;
        let mut theirs = [0u8; ENDPOINT_MSG_LEN];
        stream.read_exact(&mut theirs).await?;
        let (their_endpoint, mac) = theirs.split_at(bootstrap::ENDPOINT_LEN);
        let peer_role = role(initiator).peer();
        if !verify(&self.cfg.secret, ENDPOINT_LABEL, peer_role, &transcript, their_endpoint, mac) {
            return Err(refuse("the peer's QP endpoint does not carry its MAC"));
        }
        let their_endpoint: [u8; bootstrap::ENDPOINT_LEN] =
            their_endpoint.try_into().map_err(|_| refuse("short QP endpoint"))?;
        let remote = bootstrap::decode(&their_endpoint).map_err(|e| refuse(&e.to_string()))?;
        qp.to_init(&InitAttrs { port: self.cfg.qp_port, ..InitAttrs::default() })?;
        let peer = if initiator { stream.peer_addr()? } else { hello.listen };
        let driven = &self.endpoints[endpoint];
        let (cfg, path_mtu) =
            crate::config::agreed(&self.cfg, hello.eager_max as usize, hello.path_mtu);
        let parts = EngineParts {
            cfg,
            pool: self.pool,
            dev: self.dev_index,
            counters: self.counters.clone(),
            qpn: qp.qpn(),
            peer_rq_depth: hello.rq_depth,
            accepting: true,
            socket_ids: self.socket_ids.clone(),
            shared_recv: driven.ep.lock().shared_ring(),
        };
        let mut engine = Engine::<Done>::new(parts, crate::clock::now())?;
        // Its own receives go up in INIT, before the peer can send.
        if let Some(Post::Recv(wrs)) = engine.poll_post() {
            qp.post_recv(wrs)?;
        }
        let rtr = RtrAttrs { remote, path_mtu, min_rnr_timer: 12 };
        qp.to_rtr(&rtr)?;
        qp.to_rts(&RtsAttrs {
            sq_psn: qp.endpoint().psn,
            timeout: self.cfg.qp_timeout,
            retry_cnt: self.cfg.qp_retry_cnt,
            rnr_retry: self.cfg.qp_rnr_retry,
        })?;
        // The endpoint hosts the engine before the peer learns it may send (the ready byte),
        // so no completion of this QP can reach an endpoint that does not know it.
        let qpn = engine.qpn;
        driven.ep.lock().add_engine(engine, qp, peer);
        // The endpoint now owns the engine and its place (given back as it ends). Until the
        // peer's ready byte, a failed or cancelled bootstrap ends the engine: left hosted, it
        // would live on, known to no connection table, and give its place back a second time
        // when it died (the count wrapping, every later bootstrap refused as "CQ full").
        placed.done();
        let hosted = Undo::new(|| driven.ep.lock().abandon_engine(qpn));
        stream.write_all(&[1]).await?;
        let mut ready = [0u8; 1];
        stream.read_exact(&mut ready).await?;
        hosted.done();
        Counters::add(&self.counters.engines_up, 1);
        Ok((peer, EngineRef { endpoint, qpn }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            nonce: [7; 16],
            rq_depth: 64,
            sq_depth: 32,
            listen: "10.1.2.3:7000".parse().unwrap(),
            eager_max: 8192,
            path_mtu: Mtu::Mtu4096,
        }
    }

    #[test]
    fn hellos_round_trip_and_other_versions_and_ranges_are_refused() {
        let b = hello().encode();
        let h = Hello::decode(&b).unwrap();
        assert_eq!((h.nonce, h.rq_depth, h.sq_depth), ([7; 16], 64, 32));
        assert_eq!((h.listen, h.eager_max, h.path_mtu), (hello().listen, 8192, Mtu::Mtu4096));
        let refused = |edit: &dyn Fn(&mut [u8; HELLO_LEN]), why: &str| {
            let mut b = hello().encode();
            edit(&mut b);
            let e = Hello::decode(&b).err().unwrap_or_else(|| panic!("{why}: accepted"));
            assert!(e.to_string().contains(why), "{e}");
        };
        refused(&|b| b[7] = 3, "bad magic or version");
        refused(&|b| b[24..28].copy_from_slice(&2u32.to_le_bytes()), "queue depths");
        refused(&|b| b[28..32].copy_from_slice(&1u32.to_le_bytes()), "queue depths");
        refused(&|b| b[50..54].copy_from_slice(&(2u32 << 20).to_le_bytes()), "eager_max");
        refused(&|b| b[54..58].copy_from_slice(&1001u32.to_le_bytes()), "path MTU");
    }

    #[test]
    fn the_fuzz_check_accepts_the_sample_and_refuses_what_decode_refuses() {
        assert_eq!(check_hello(&sample_hello()), Some(true));
        let mut bad = sample_hello();
        bad[7] = 3;
        assert_eq!(check_hello(&bad), Some(false));
        assert_eq!(check_hello(&sample_hello()[..HELLO_LEN - 1]), None);
    }

    proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), HELLO_LEN)) {
            let mut h = [0u8; HELLO_LEN];
            h.copy_from_slice(&b);
            h[..8].copy_from_slice(&HELLO_MAGIC);
            let _ = Hello::decode(&h);
        }
    }
}
