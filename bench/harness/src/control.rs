//! The TCP control channel between a benchmark's client and server: frames of a 4-byte
//! little-endian length and a JSON message, over a blocking [`Control`] or (with the `tokio`
//! feature) an [`AsyncControl`]. Each tool defines its own [`Message`] enum; the framing, the
//! frame-size limit, EOF handling and the mapping of the peer's failure report to
//! [`Error::Remote`] are here, once.

use std::io::{ErrorKind, Read, Write};
use std::marker::PhantomData;
use std::net::{SocketAddr, TcpStream};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{io, Error, Result};

/// Largest control frame accepted.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// A tool's control message: an enum tagged `#[serde(tag = "msg")]`, whose tag names it;
/// its `Failed { message }` variant (tag `failed`) is the peer's failure report.
pub trait Message: Serialize + DeserializeOwned {
    /// The tool whose processes speak this protocol (named when a frame is not one of its).
    const TOOL: &'static str;

    /// The message's name, for errors: its `msg` tag, read from its serialized form (so the
    /// name on the wire and in errors are one; a hand-written `match` per tool repeated
    /// them). Only errors ask, so serializing again costs nothing that matters.
    fn kind(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| Some(v.get("msg")?.as_str()?.to_owned()))
            .unwrap_or_else(|| "an untagged message".to_owned())
    }

    /// The peer's report of a failure, if this message is one: by convention the message
    /// tagged `failed`, whose `message` field says why.
    fn failure(&self) -> Option<String> {
        let v = serde_json::to_value(self).ok()?;
        if v.get("msg")?.as_str()? != "failed" {
            return None;
        }
        Some(v.get("message")?.as_str()?.to_owned())
    }
}

/// One framed message.
pub fn encode<M: Message>(msg: &M) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(msg)
        .map_err(|e| Error::Protocol(format!("encoding {}: {e}", msg.kind())))?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| n <= MAX_FRAME_BYTES)
        .ok_or_else(|| Error::Protocol(format!("{} frame too big", msg.kind())))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// The body length a frame header announces, if acceptable.
fn body_len<M: Message>(header: [u8; 4]) -> Result<usize> {
    let len = u32::from_le_bytes(header);
    if len > MAX_FRAME_BYTES {
        return Err(Error::Protocol(format!("frame of {len} bytes (not a {} peer?)", M::TOOL)));
    }
    Ok(len as usize)
}

fn decode<M: Message>(body: &[u8]) -> Result<M> {
    serde_json::from_slice(body).map_err(|e| Error::Protocol(format!("bad frame: {e}")))
}

fn header_error(e: std::io::Error) -> Error {
    if e.kind() == ErrorKind::UnexpectedEof {
        Error::Protocol("peer closed the control connection".into())
    } else {
        io("control: receiving")(e)
    }
}

/// `msg`, or [`Error::Remote`] when it is the peer's failure report.
fn ok<M: Message>(msg: M) -> Result<M> {
    match msg.failure() {
        Some(why) => Err(Error::Remote(why)),
        None => Ok(msg),
    }
}

/// The error for a message that is not the one the protocol expects here.
pub fn unexpected<M: Message>(wanted: &str, got: &M) -> Error {
    Error::Protocol(format!("expected {wanted}, got {}", got.kind()))
}

/// `pick(msg)`, or the protocol error naming what was `wanted`.
fn pick<M: Message, T>(wanted: &str, msg: M, pick: impl FnOnce(M) -> Option<T>) -> Result<T> {
    let kind = msg.kind();
    pick(msg).ok_or_else(|| Error::Protocol(format!("expected {wanted}, got {kind}")))
}

/// A blocking framed control connection.
#[derive(Debug)]
pub struct Control<M> {
    stream: TcpStream,
    messages: PhantomData<fn() -> M>,
}

impl<M: Message> Control<M> {
    /// Wraps a connected stream (and turns Nagle off: control messages are small and
    /// latency-bound).
    pub fn new(stream: TcpStream) -> Result<Control<M>> {
        stream.set_nodelay(true).map_err(io("control: set TCP_NODELAY"))?;
        Ok(Control { stream, messages: PhantomData })
    }

    /// The underlying stream (for exchanges of raw records on the same connection).
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// The local address of the connection (the IP the peer reached this process on).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.stream.local_addr().map_err(io("control: local address"))
    }

    /// Sends one message.
    pub fn send(&mut self, msg: &M) -> Result<()> {
        let frame = encode(msg)?;
        self.stream.write_all(&frame).map_err(|e| io(format!("control: sending {}", msg.kind()))(e))
    }

    /// Receives one message; a closed connection is a protocol error.
    pub fn recv(&mut self) -> Result<M> {
        let mut header = [0u8; 4];
        self.stream.read_exact(&mut header).map_err(header_error)?;
        let mut body = vec![0u8; body_len::<M>(header)?];
        self.stream.read_exact(&mut body).map_err(io("control: receiving a frame body"))?;
        decode(&body)
    }

    /// Receives one message and turns the peer's failure report into [`Error::Remote`].
    pub fn recv_ok(&mut self) -> Result<M> {
        ok(self.recv()?)
    }

    /// Receives the message `pick` accepts (what it returns), or fails naming `wanted`.
    pub fn expect<T>(&mut self, wanted: &str, f: impl FnOnce(M) -> Option<T>) -> Result<T> {
        pick(wanted, self.recv_ok()?, f)
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

/// A framed control connection on a tokio stream.
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub struct AsyncControl<M> {
    stream: tokio::net::TcpStream,
    messages: PhantomData<fn() -> M>,
}

#[cfg(feature = "tokio")]
impl<M: Message> AsyncControl<M> {
    /// Wraps a connected stream (Nagle off).
    pub fn new(stream: tokio::net::TcpStream) -> Result<AsyncControl<M>> {
        stream.set_nodelay(true).map_err(io("control: set TCP_NODELAY"))?;
        Ok(AsyncControl { stream, messages: PhantomData })
    }

    /// The local address of the connection (the IP the peer reached this process on).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.stream.local_addr().map_err(io("control: local address"))
    }

    /// Sends one message.
    pub async fn send(&mut self, msg: &M) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let frame = encode(msg)?;
        let sent = self.stream.write_all(&frame).await;
        sent.map_err(|e| io(format!("control: sending {}", msg.kind()))(e))
    }

    /// Receives one message; a closed connection is a protocol error.
    pub async fn recv(&mut self) -> Result<M> {
        use tokio::io::AsyncReadExt;
        let mut header = [0u8; 4];
        self.stream.read_exact(&mut header).await.map_err(header_error)?;
        let mut body = vec![0u8; body_len::<M>(header)?];
        self.stream.read_exact(&mut body).await.map_err(io("control: receiving a frame body"))?;
        decode(&body)
    }

    /// Receives one message and turns the peer's failure report into [`Error::Remote`].
    pub async fn recv_ok(&mut self) -> Result<M> {
        ok(self.recv().await?)
    }

    /// Receives the message `pick` accepts (what it returns), or fails naming `wanted`.
    pub async fn expect<T>(&mut self, wanted: &str, f: impl FnOnce(M) -> Option<T>) -> Result<T> {
        pick(wanted, self.recv_ok().await?, f)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "msg", rename_all = "snake_case")]
    enum Msg {
        Hello { version: u32 },
        Ready { port: Option<u16> },
        Failed { message: String },
        Bye,
    }

    impl Message for Msg {
        const TOOL: &'static str = "test";
    }

    fn pair() -> (Control<Msg>, Control<Msg>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let b = listener.accept().unwrap().0;
        (Control::new(a).unwrap(), Control::new(b).unwrap())
    }

    #[test]
    fn messages_round_trip_and_failures_become_remote_errors() {
        let (mut a, mut b) = pair();
        let msgs = [Msg::Hello { version: 3 }, Msg::Ready { port: Some(7) }, Msg::Bye];
        for m in &msgs {
            a.send(m).unwrap();
        }
        assert!(b.readable().unwrap());
        for m in &msgs {
            assert_eq!(&b.recv().unwrap(), m);
        }
        assert!(!b.readable().unwrap());
        a.send(&Msg::Failed { message: "nope".into() }).unwrap();
        assert!(matches!(b.recv_ok(), Err(Error::Remote(m)) if m == "nope"));
        a.send(&Msg::Bye).unwrap();
        let e = b.expect("ready", |m| match m {
            Msg::Ready { port } => Some(port),
            _ => None,
        });
        assert!(
            matches!(e, Err(Error::Protocol(ref m)) if m == "expected ready, got bye"),
            "{e:?}"
        );
        a.send(&Msg::Ready { port: None }).unwrap();
        let port = b.expect("ready", |m| match m {
            Msg::Ready { port } => Some(port),
            _ => None,
        });
        assert_eq!(port.unwrap(), None);
    }

    #[test]
    fn a_message_is_named_by_its_tag_and_failed_is_the_failure_report() {
        assert_eq!(Msg::Hello { version: 1 }.kind(), "hello");
        assert_eq!(Msg::Bye.kind(), "bye");
        assert_eq!(Msg::Failed { message: "x".into() }.kind(), "failed");
        assert_eq!(Msg::Failed { message: "x".into() }.failure().as_deref(), Some("x"));
        assert_eq!(Msg::Ready { port: Some(1) }.failure(), None);
    }

    #[test]
    fn garbage_oversized_frames_and_eof_are_protocol_errors() {
        let (mut a, mut b) = pair();
        a.stream().write_all(b"GET / HTTP/1.1\r\n").unwrap();
        let e = b.recv().unwrap_err();
        assert!(e.to_string().contains("not a test peer"), "{e}");
        let (mut a, mut b) = pair();
        a.stream().write_all(&5u32.to_le_bytes()).unwrap();
        a.stream().write_all(b"{nope").unwrap();
        assert!(matches!(b.recv(), Err(Error::Protocol(m)) if m.starts_with("bad frame")));
        drop(a);
        assert!(matches!(b.recv(), Err(Error::Protocol(m)) if m.contains("closed")));
    }

    #[tokio::test]
    #[cfg(feature = "tokio")]
    async fn the_async_channel_speaks_the_same_frames() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = Control::<Msg>::new(listener.accept().unwrap().0).unwrap();
            let m = c.recv().unwrap();
            c.send(&m).unwrap();
            c.send(&Msg::Failed { message: "x".into() }).unwrap();
        });
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut c = AsyncControl::<Msg>::new(s).unwrap();
        c.send(&Msg::Hello { version: 9 }).await.unwrap();
        assert_eq!(c.recv().await.unwrap(), Msg::Hello { version: 9 });
        assert!(matches!(c.recv_ok().await, Err(Error::Remote(_))));
        t.join().unwrap();
        assert!(matches!(c.recv().await, Err(Error::Protocol(_))));
    }
}
