//! The TCP control channel between client and server (async: both processes run their
//! transports on a tokio runtime).
//!
//! Frames are a 4-byte little-endian length and a JSON [`Ctl`]. The client drives: `Hello` →
//! `Welcome`; per job `Setup` → `Ready` (the bootstrap addresses of the server's transports),
//! the data plane runs over the transports, then `Finish` → `Done` (the server's counters);
//! finally `Bye`. A job the server cannot set up is answered with `Failed` and the session
//! goes on.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use bex_bench::control::Message;
use serde::{Deserialize, Serialize};

use crate::error::BenchError;
use crate::spec::ServerSetup;

/// Version of this protocol; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 2;

/// One control message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Ctl {
    /// Client → server, first message.
    Hello {
        /// The client's [`PROTOCOL_VERSION`].
        version: u32,
    },
    /// Server → client, answer to `Hello`.
    Welcome {
        /// The server's [`PROTOCOL_VERSION`].
        version: u32,
        /// The server's process id (recorded, so a test can check it is gone).
        pid: u32,
    },
    /// Client → server: start transports for a job.
    Setup {
        /// What to start.
        setup: ServerSetup,
    },
    /// Server → client: the transports listen at these bootstrap addresses.
    Ready {
        /// One per transport.
        addrs: Vec<SocketAddr>,
    },
    /// Client → server: the job is over; stop its transports.
    Finish,
    /// Server → client: stopped; the transports' counters, summed.
    Done {
        /// Counter name → value.
        counters: BTreeMap<String, u64>,
    },
    /// Server → client: the job could not be set up.
    Failed {
        /// Why.
        message: String,
    },
    /// Client → server: the session is over.
    Bye,
}

impl Message for Ctl {
    const TOOL: &'static str = "bex-perf";
}

/// The control connection of a `bex-perf` session.
pub type Control = bex_bench::control::AsyncControl<Ctl>;

/// The error for a message that is not the one the protocol expects here.
pub fn unexpected(wanted: &str, got: &Ctl) -> BenchError {
    bex_bench::control::unexpected(wanted, got).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Knobs, TransportKind};

    #[tokio::test]
    async fn messages_round_trip_and_garbage_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let setup = ServerSetup {
            kind: TransportKind::Rdma,
            transports: 3,
            knobs: Knobs::default(),
            echo_max: u64::MAX,
            ack_bytes: 32,
            rpc: false,
        };
        let msgs = vec![
            Ctl::Hello { version: PROTOCOL_VERSION },
            Ctl::Setup { setup },
            Ctl::Ready { addrs: vec!["127.0.0.1:9".parse().unwrap()] },
            Ctl::Done { counters: BTreeMap::from([("messages_sent".to_string(), 7)]) },
            Ctl::Failed { message: "nope".into() },
            Ctl::Bye,
        ];
        let sent = msgs.clone();
        let server = tokio::spawn(async move {
            let mut c = Control::new(listener.accept().await.unwrap().0).unwrap();
            let mut got = Vec::new();
            for _ in 0..sent.len() - 2 {
                got.push(c.recv().await.unwrap());
            }
            let failed = c.recv_ok().await;
            assert!(matches!(failed, Err(bex_bench::Error::Remote(ref m)) if m == "nope"));
            got.push(c.recv().await.unwrap());
            assert!(matches!(c.recv().await, Err(bex_bench::Error::Protocol(_))), "EOF");
            got
        });
        let mut c = Control::new(tokio::net::TcpStream::connect(addr).await.unwrap()).unwrap();
        for m in &msgs {
            c.send(m).await.unwrap();
        }
        drop(c);
        let got = server.await.unwrap();
        let want: Vec<Ctl> =
            msgs.into_iter().filter(|m| !matches!(m, Ctl::Failed { .. })).collect();
        assert_eq!(got, want);
    }
}
