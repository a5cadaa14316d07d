//! What this crate's unit tests share.

use bemalloc::Pool;
use bex_transport::tcp::TcpTransport;
use bex_transport::{Config, Transport};

/// Two TCP transports on loopback over one unregistered pool: a server's and a client's
/// (keep both: dropping one closes its sockets).
pub(crate) async fn tcp_transports() -> (&'static Pool, Transport, Transport) {
    let pool = Pool::unregistered(Default::default()).unwrap().leak();
    let any = "127.0.0.1:0".parse().unwrap();
    let start = || async {
        Transport::Tcp(TcpTransport::start(pool, any, Config::default()).await.unwrap())
    };
    (pool, start().await, start().await)
}
