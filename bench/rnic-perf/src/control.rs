//! The TCP control channel between client and server.
//!
//! Frames are a 4-byte little-endian length and a JSON [`Msg`]. The client drives: it sends a
//! [`Msg::Job`], the server sets the job up and answers [`Msg::Ready`] (or [`Msg::Failed`]),
//! both run the data plane, the client sends [`Msg::Finish`] and the server answers
//! [`Msg::Done`]. RNIC jobs additionally swap QP endpoints with
//! [`bex_rnic::bootstrap::exchange`] (raw 40-byte records on the same stream) and their
//! buffers' keys with [`Msg::Buffer`].

use bex_bench::control::Message;
use serde::{Deserialize, Serialize};

use crate::error::{PerfError, Result};
use crate::spec::JobSpec;

/// Version of this protocol; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;

/// One control message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    /// Client → server, first message of a session.
    Hello {
        /// The client's [`PROTOCOL_VERSION`].
        version: u32,
    },
    /// Server → client, answer to `Hello`.
    Welcome {
        /// The server's [`PROTOCOL_VERSION`].
        version: u32,
    },
    /// Client → server: set up a baseline job, or (inside an RNIC session) an RNIC job.
    Job {
        /// Its parameters.
        spec: JobSpec,
    },
    /// Server → client: the job (or RNIC session) is set up; baselines name their data port.
    Ready {
        /// TCP or UDP port of the baseline's data socket.
        data_port: Option<u16>,
    },
    /// Client → server: the measured part is over.
    Finish,
    /// Server → client: the job is over on the server.
    Done {
        /// Messages (or bytes, for tcp_bw) the server received during the job.
        received: u64,
    },
    /// Either way: the job or session failed.
    Failed {
        /// Why.
        message: String,
    },
    /// Client → server: open the server's RNIC for a series of RNIC jobs.
    RdmaOpen,
    /// Client → server: the series of RNIC jobs is over; close the RNIC.
    RdmaClose,
    /// Either way: the registered buffer the peer may target.
    Buffer {
        /// Its address.
        addr: u64,
        /// Its remote key.
        rkey: u32,
        /// Its length.
        len: u64,
    },
    /// Client → server: the session is over.
    Bye,
}

impl Message for Msg {
    const TOOL: &'static str = "rnic-perf";
}

/// The control connection of an `rnic-perf` session.
pub type Control = bex_bench::control::Control<Msg>;

/// The replies a job waits for.
pub trait Replies {
    /// Receives `Ready` and returns its data port.
    fn expect_ready(&mut self) -> Result<Option<u16>>;
    /// Receives `Done` and returns what the server counted.
    fn expect_done(&mut self) -> Result<u64>;
    /// Receives `Finish`.
    fn expect_finish(&mut self) -> Result<()>;
}

impl Replies for Control {
    fn expect_ready(&mut self) -> Result<Option<u16>> {
        Ok(self.expect("ready", |m| match m {
            Msg::Ready { data_port } => Some(data_port),
            _ => None,
        })?)
    }

    fn expect_done(&mut self) -> Result<u64> {
        Ok(self.expect("done", |m| match m {
            Msg::Done { received } => Some(received),
            _ => None,
        })?)
    }

    fn expect_finish(&mut self) -> Result<()> {
        Ok(self.expect("finish", |m| matches!(m, Msg::Finish).then_some(()))?)
    }
}

/// The error for a message that is not the one the protocol expects here.
pub fn unexpected(wanted: &str, got: &Msg) -> PerfError {
    bex_bench::control::unexpected(wanted, got).into()
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use super::*;
    use crate::spec::{Knobs, TestKind};

    #[test]
    fn messages_round_trip_over_tcp() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let spec = JobSpec {
            test: TestKind::SendBw,
            size: 4096,
            mtu: Some(61440),
            iters: 10,
            reps: 3,
            knobs: Knobs { warmup: 2, window: 64, batch: 8, signal_every: 16, spin_polls: 100 },
        };
        let msgs = vec![
            Msg::Hello { version: PROTOCOL_VERSION },
            Msg::Job { spec },
            Msg::Ready { data_port: Some(7) },
            Msg::Buffer { addr: u64::MAX, rkey: 5, len: 4096 },
            Msg::Failed { message: "nope".into() },
            Msg::Bye,
        ];
        let sent = msgs.clone();
        let t = std::thread::spawn(move || {
            let mut c = Control::new(listener.accept().unwrap().0).unwrap();
            (0..sent.len()).map(|_| c.recv().unwrap()).collect::<Vec<_>>()
        });
        let mut c = Control::new(TcpStream::connect(addr).unwrap()).unwrap();
        for m in &msgs {
            c.send(m).unwrap();
        }
        assert_eq!(t.join().unwrap(), msgs);
    }
}
