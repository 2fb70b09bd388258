//! The connection listeners: one non-blocking SO_REUSEPORT socket per
//! worker, all bound to one port, so the kernel spreads new connections over
//! the workers by 4-tuple hash.

use std::io;
use std::net::SocketAddr;

use socket2::{Domain, Socket, Type};

/// Opens one non-blocking SO_REUSEPORT listener on `addr` with the given
/// `listen(2)` backlog (clamped by the kernel to `net.core.somaxconn`).
pub fn reuseport_listener(addr: SocketAddr, backlog: i32) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        // `--bind ::` serves IPv4 too.
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    Ok(socket.into())
}

/// Opens `n` SO_REUSEPORT listeners on one port, so the kernel spreads new
/// connections across them by 4-tuple hash. Port 0 is resolved once by the
/// first listener and shared by the others. Returns them and the bound
/// address.
pub fn bind_listeners(
    addr: SocketAddr,
    n: usize,
    backlog: i32,
) -> io::Result<(Vec<std::net::TcpListener>, SocketAddr)> {
    let first = reuseport_listener(addr, backlog)?;
    let local = first.local_addr()?;
    let mut all = Vec::with_capacity(n);
    all.push(first);
    for _ in 1..n {
        all.push(reuseport_listener(local, backlog)?);
    }
    Ok((all, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_share_one_port() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (ls, local) = bind_listeners(addr, 3, 128).unwrap();
        assert_eq!(ls.len(), 3);
        assert_ne!(local.port(), 0);
        for l in &ls {
            assert_eq!(l.local_addr().unwrap(), local);
        }
    }
}
