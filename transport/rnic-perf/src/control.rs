//! The TCP control channel between client and server.
//!
//! Frames are a 4-byte little-endian length and a JSON [`Msg`]. The client drives: it sends a
//! [`Msg::Job`], the server sets the job up and answers [`Msg::Ready`] (or [`Msg::Failed`]),
//! both run the data plane, the client sends [`Msg::Finish`] and the server answers
//! [`Msg::Done`]. RNIC jobs additionally swap QP endpoints with
//! [`bex_rnic::bootstrap::exchange`] (raw 40-byte records on the same stream) and their
//! buffers' keys with [`Msg::Buffer`].

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

use serde::{Deserialize, Serialize};

use crate::error::{io, PerfError, Result};
use crate::spec::JobSpec;

/// Version of this protocol; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest control frame accepted.
const MAX_FRAME_BYTES: u32 = 1 << 20;

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

impl Msg {
    fn kind(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::Job { .. } => "job",
            Msg::Ready { .. } => "ready",
            Msg::Finish => "finish",
            Msg::Done { .. } => "done",
            Msg::Failed { .. } => "failed",
            Msg::RdmaOpen => "rdma_open",
            Msg::RdmaClose => "rdma_close",
            Msg::Buffer { .. } => "buffer",
            Msg::Bye => "bye",
        }
    }
}

/// A framed control connection.
#[derive(Debug)]
pub struct Control {
    stream: TcpStream,
}

impl Control {
    /// Wraps a connected stream (and turns Nagle off: control messages are small and
    /// latency-bound).
    pub fn new(stream: TcpStream) -> Result<Control> {
        stream.set_nodelay(true).map_err(io("control: set TCP_NODELAY"))?;
        Ok(Control { stream })
    }

    /// The underlying stream, for the bootstrap endpoint exchange.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Sends one message.
    pub fn send(&mut self, msg: &Msg) -> Result<()> {
        let body = serde_json::to_vec(msg)
            .map_err(|e| PerfError::Protocol(format!("encoding {}: {e}", msg.kind())))?;
        let len =
            u32::try_from(body.len()).map_err(|_| PerfError::Protocol("frame too big".into()))?;
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&len.to_le_bytes());
        frame.extend_from_slice(&body);
        self.stream.write_all(&frame).map_err(io(format!("control: sending {}", msg.kind())))
    }

    /// Receives one message; a closed connection is a protocol error.
    pub fn recv(&mut self) -> Result<Msg> {
        let mut len = [0u8; 4];
        match self.stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                return Err(PerfError::Protocol("peer closed the control connection".into()))
            }
            Err(e) => return Err(io("control: receiving")(e)),
        }
        let len = u32::from_le_bytes(len);
        if len > MAX_FRAME_BYTES {
            return Err(PerfError::Protocol(format!(
                "frame of {len} bytes (not an rnic-perf peer?)"
            )));
        }
        let mut body = vec![0u8; len as usize];
        self.stream.read_exact(&mut body).map_err(io("control: receiving a frame body"))?;
        serde_json::from_slice(&body).map_err(|e| PerfError::Protocol(format!("bad frame: {e}")))
    }

    /// Receives one message and turns `Failed` into [`PerfError::Remote`].
    pub fn recv_ok(&mut self) -> Result<Msg> {
        match self.recv()? {
            Msg::Failed { message } => Err(PerfError::Remote(message)),
            m => Ok(m),
        }
    }

    /// Receives `Ready` and returns its data port.
    pub fn expect_ready(&mut self) -> Result<Option<u16>> {
        match self.recv_ok()? {
            Msg::Ready { data_port } => Ok(data_port),
            m => Err(unexpected("ready", &m)),
        }
    }

    /// Receives `Done` and returns what the server counted.
    pub fn expect_done(&mut self) -> Result<u64> {
        match self.recv_ok()? {
            Msg::Done { received } => Ok(received),
            m => Err(unexpected("done", &m)),
        }
    }

    /// Receives `Finish`.
    pub fn expect_finish(&mut self) -> Result<()> {
        match self.recv_ok()? {
            Msg::Finish => Ok(()),
            m => Err(unexpected("finish", &m)),
        }
    }

    /// True when a message (or EOF) is waiting, without consuming it or blocking.
    pub fn readable(&mut self) -> Result<bool> {
        self.stream.set_nonblocking(true).map_err(io("control: set non-blocking"))?;
        let mut b = [0u8; 1];
        let r = self.stream.peek(&mut b);
        self.stream.set_nonblocking(false).map_err(io("control: set blocking"))?;
        match r {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(io("control: peek")(e)),
        }
    }
}

/// The error for a message that is not the one the protocol expects here.
pub fn unexpected(wanted: &str, got: &Msg) -> PerfError {
    PerfError::Protocol(format!("expected {wanted}, got {}", got.kind()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TestKind;

    #[test]
    fn messages_round_trip_over_tcp() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let spec = JobSpec {
            test: TestKind::SendBw,
            size: 4096,
            mtu: Some(61440),
            iters: 10,
            warmup: 2,
            reps: 3,
            window: 64,
            batch: 8,
            signal_every: 16,
            spin_polls: 100,
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

    #[test]
    fn garbage_and_eof_are_protocol_errors() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        });
        let mut c = Control::new(TcpStream::connect(addr).unwrap()).unwrap();
        t.join().unwrap();
        assert!(matches!(c.recv(), Err(PerfError::Protocol(_))));
        assert!(matches!(c.recv(), Err(PerfError::Protocol(_))));
    }
}
