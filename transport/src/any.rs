//! [`Transport`] and [`Socket`]: either kind of transport behind one type, for the RPC layer
//! (which falls back from RDMA to TCP and compares the two).
//!
//! The common API delegates; [`Socket::send_to`] and [`Socket::expose`] need RDMA and fail
//! with [`TransportError::Invalid`] on TCP and on simulated transports.

use std::net::SocketAddr;

use bemalloc::Pool;

use crate::config::CounterSnapshot;
use crate::error::{Result, TransportError};
use crate::msg::{Msg, Payload, SharedMsg};
use crate::proto::RemoteTarget;
use crate::rdma::{RdmaSocket, RdmaTransport};
use crate::simio::{SimTransport, SimTransportSocket};
use crate::tcp::{TcpSocket, TcpTransport};

/// Which transport a [`Transport`] or [`Socket`] runs on (the one enum of
/// `bex-transport-kind`, shared with the config and the tools).
pub use bex_transport_kind::TransportKind;

/// A transport of either kind.
#[derive(Clone, Debug)]
pub enum Transport {
    /// An RDMA transport.
    Rdma(RdmaTransport),
    /// A TCP transport.
    Tcp(TcpTransport),
    /// A transport on a simulated node, standing for either kind ([`crate::simio`]).
    Sim(SimTransport),
}

impl From<RdmaTransport> for Transport {
    fn from(t: RdmaTransport) -> Self {
        Transport::Rdma(t)
    }
}

impl From<TcpTransport> for Transport {
    fn from(t: TcpTransport) -> Self {
        Transport::Tcp(t)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} transport at {}", self.kind(), self.local_addr())
    }
}

impl Transport {
    /// The kind.
    pub fn kind(&self) -> TransportKind {
        match self {
            Transport::Rdma(_) => TransportKind::Rdma,
            Transport::Tcp(_) => TransportKind::Tcp,
            Transport::Sim(t) => t.kind(),
        }
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            Transport::Rdma(t) => t.local_addr(),
            Transport::Tcp(t) => t.local_addr(),
            Transport::Sim(t) => t.local_addr(),
        }
    }

    /// The registered-memory pool messages come from.
    pub fn pool(&self) -> &'static Pool {
        match self {
            Transport::Rdma(t) => t.pool(),
            Transport::Tcp(t) => t.pool(),
            Transport::Sim(t) => t.pool(),
        }
    }

    /// Counters.
    pub fn counters(&self) -> CounterSnapshot {
        match self {
            Transport::Rdma(t) => t.counters(),
            Transport::Tcp(t) => t.counters(),
            Transport::Sim(t) => t.counters(),
        }
    }

    /// Opens a socket to the transport (of the same kind) listening at `addr`.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Socket> {
        Ok(match self {
            Transport::Rdma(t) => Socket::Rdma(t.connect(addr).await?),
            Transport::Tcp(t) => Socket::Tcp(t.connect(addr).await?),
            Transport::Sim(t) => Socket::Sim(t.connect(addr).await?),
        })
    }

    /// Waits for a socket opened by a peer.
    pub async fn accept(&self) -> Result<Socket> {
        Ok(match self {
            Transport::Rdma(t) => Socket::Rdma(t.accept().await?),
            Transport::Tcp(t) => Socket::Tcp(t.accept().await?),
            Transport::Sim(t) => Socket::Sim(t.accept().await?),
        })
    }

    /// Shuts the transport down; every socket fails.
    pub fn shutdown(&self) {
        match self {
            Transport::Rdma(t) => t.shutdown(),
            Transport::Tcp(t) => t.shutdown(),
            Transport::Sim(t) => t.shutdown(),
        }
    }
}

/// A socket of either kind.
#[derive(Debug)]
pub enum Socket {
    /// A socket on an RDMA engine.
    Rdma(RdmaSocket),
    /// A socket on its own TCP connection.
    Tcp(TcpSocket),
    /// A socket of a simulated transport.
    Sim(SimTransportSocket),
}

impl From<RdmaSocket> for Socket {
    fn from(s: RdmaSocket) -> Self {
        Socket::Rdma(s)
    }
}

impl From<TcpSocket> for Socket {
    fn from(s: TcpSocket) -> Self {
        Socket::Tcp(s)
    }
}

impl std::fmt::Display for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} socket to {}", self.kind(), self.peer())
    }
}

impl Socket {
    /// The kind.
    pub fn kind(&self) -> TransportKind {
        match self {
            Socket::Rdma(_) => TransportKind::Rdma,
            Socket::Tcp(_) => TransportKind::Tcp,
            Socket::Sim(s) => s.kind(),
        }
    }

    /// The peer transport's address.
    pub fn peer(&self) -> SocketAddr {
        match self {
            Socket::Rdma(s) => s.peer(),
            Socket::Tcp(s) => s.peer(),
            Socket::Sim(s) => s.peer(),
        }
    }

    /// Sends a message (see [`RdmaSocket::send`] and [`TcpSocket::send`] for when it
    /// resolves).
    pub async fn send(&self, msg: Msg) -> Result<()> {
        match self {
            Socket::Rdma(s) => s.send(msg).await,
            Socket::Tcp(s) => s.send(msg).await,
            Socket::Sim(s) => s.send(msg).await,
        }
    }

    /// Sends a shared message without copying it: one more use of its registered buffer,
    /// which lives until the last use is done (`paper/002`).
    pub async fn send_shared(&self, msg: &SharedMsg) -> Result<()> {
        match self {
            Socket::Rdma(s) => s.send_shared(msg).await,
            Socket::Tcp(s) => s.send_shared(msg).await,
            Socket::Sim(s) => s.send_detached(msg).await,
        }
    }

    /// Queues a message (owned or shared) without waiting for the transport to finish with
    /// it (see [`RdmaSocket::send_detached`]).
    pub async fn send_detached(&self, msg: impl Into<Payload>) -> Result<()> {
        let msg = msg.into();
        match self {
            Socket::Rdma(s) => s.send_detached(msg).await,
            Socket::Tcp(s) => s.send_detached(msg).await,
            Socket::Sim(s) => s.send_detached(msg).await,
        }
    }

    /// The next message, in order.
    pub async fn recv(&self) -> Result<Msg> {
        match self {
            Socket::Rdma(s) => s.recv().await,
            Socket::Tcp(s) => s.recv().await,
            Socket::Sim(s) => s.recv().await,
        }
    }

    /// Writes a message straight into a buffer the peer exposed ([`RdmaSocket::send_to`]).
    /// RDMA only: on TCP the message is dropped and this fails with `Invalid`.
    pub async fn send_to(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        match self {
            Socket::Rdma(s) => s.send_to(msg, target).await,
            Socket::Tcp(_) | Socket::Sim(_) => {
                Err(TransportError::Invalid("send_to needs RDMA".into()))
            }
        }
    }

    /// [`Socket::send_to`] without waiting for the transport to finish with the message.
    /// RDMA only: on TCP the message is dropped and this fails with `Invalid`.
    pub async fn send_to_detached(&self, msg: Msg, target: RemoteTarget) -> Result<()> {
        match self {
            Socket::Rdma(s) => s.send_to_detached(msg, target).await,
            Socket::Tcp(_) | Socket::Sim(_) => {
                Err(TransportError::Invalid("send_to needs RDMA".into()))
            }
        }
    }

    /// True when the socket can place messages in exposed buffers ([`Socket::send_to`]).
    pub fn can_place(&self) -> bool {
        matches!(self, Socket::Rdma(_))
    }

    /// Exposes a buffer for the peer's [`Socket::send_to`] ([`RdmaSocket::expose`]). RDMA
    /// only: on TCP this fails with `Invalid`.
    pub async fn expose(&self, buf: Msg) -> Result<RemoteTarget> {
        match self {
            Socket::Rdma(s) => s.expose(buf).await,
            Socket::Tcp(_) | Socket::Sim(_) => {
                Err(TransportError::Invalid("expose needs RDMA".into()))
            }
        }
    }
}
