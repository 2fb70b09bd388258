//! The connection listeners: one non-blocking SO_REUSEPORT socket per
//! worker, all bound to one port, so the kernel spreads new connections over
//! the workers by 4-tuple hash; and the TCP keepalive every accepted socket
//! carries ([`Keepalive`]).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};

/// TCP keepalive and user timeout of accepted connections, so that a peer
/// that vanished without a FIN or RST (its network dropped it) stops
/// counting as live.
///
/// An idle connection is probed after `idle_secs` of silence, then every
/// `interval_secs`; after `count` unanswered probes the kernel drops it and
/// the next read fails with `ETIMEDOUT` ([`crate::conn::CloseReason::Unreachable`]):
/// a dead idle peer is gone within [`Keepalive::dead_after_secs`]. Probes
/// are not sent while data is unacknowledged (a reply or server ping to a
/// dead peer is retransmitted instead, for up to ~15 minutes with the
/// default `tcp_retries2`); `TCP_USER_TIMEOUT` bounds that case: a
/// connection whose sent data stays unacknowledged for `user_timeout_secs`
/// is dropped too [tcp(7); RFC 5482].
///
/// Set on each listener, the options are inherited by every socket it
/// accepts (the kernel clones the listener's socket, options included, in
/// `sk_clone_lock`; `accepted_sockets_inherit_keepalive` checks it), which
/// saves five `setsockopt` calls per accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Seconds of silence before the first probe (`TCP_KEEPIDLE`); 0 turns
    /// keepalive off (`SO_KEEPALIVE` stays unset).
    pub idle_secs: u32,
    /// Seconds between probes (`TCP_KEEPINTVL`).
    pub interval_secs: u32,
    /// Unanswered probes before the connection is dropped (`TCP_KEEPCNT`).
    pub count: u32,
    /// Seconds sent data may stay unacknowledged (`TCP_USER_TIMEOUT`); 0
    /// leaves the kernel's retransmission limit in force.
    pub user_timeout_secs: u32,
}

impl Keepalive {
    /// Keepalive off, no user timeout: the kernel's defaults.
    pub const OFF: Keepalive = Keepalive {
        idle_secs: 0,
        interval_secs: 0,
        count: 0,
        user_timeout_secs: 0,
    };

    /// Seconds after which a silent, dead peer has been dropped: idle +
    /// interval × count (0 when keepalive is off).
    pub fn dead_after_secs(&self) -> u64 {
        if self.idle_secs == 0 {
            return 0;
        }
        u64::from(self.idle_secs) + u64::from(self.interval_secs) * u64::from(self.count)
    }

    /// Sets the options on `socket` (a listener, whose accepted sockets
    /// inherit them, or a connected socket).
    pub fn apply(&self, socket: SockRef<'_>) -> io::Result<()> {
        if self.idle_secs > 0 {
            let ka = TcpKeepalive::new()
                .with_time(Duration::from_secs(self.idle_secs.into()))
                .with_interval(Duration::from_secs(self.interval_secs.into()))
                .with_retries(self.count);
            socket.set_tcp_keepalive(&ka)?;
        }
        if self.user_timeout_secs > 0 {
            let t = Duration::from_secs(self.user_timeout_secs.into());
            socket.set_tcp_user_timeout(Some(t))?;
        }
        Ok(())
    }
}

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
    fn accepted_sockets_inherit_keepalive() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (ls, local) = bind_listeners(addr, 1, 16).unwrap();
        let ka = Keepalive {
            idle_secs: 7,
            interval_secs: 3,
            count: 4,
            user_timeout_secs: 19,
        };
        ka.apply(SockRef::from(&ls[0])).unwrap();
        let _client = std::net::TcpStream::connect(local).unwrap();
        ls[0].set_nonblocking(false).unwrap();
        let (accepted, _) = ls[0].accept().unwrap();
        let s = SockRef::from(&accepted);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(7));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(3));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 4);
        assert_eq!(s.tcp_user_timeout().unwrap(), Some(Duration::from_secs(19)));
        assert_eq!(ka.dead_after_secs(), 7 + 3 * 4);

        // Off: the kernel's defaults stay (no keepalive, no user timeout).
        let (ls, local) = bind_listeners(addr, 1, 16).unwrap();
        Keepalive::OFF.apply(SockRef::from(&ls[0])).unwrap();
        let _client = std::net::TcpStream::connect(local).unwrap();
        ls[0].set_nonblocking(false).unwrap();
        let (accepted, _) = ls[0].accept().unwrap();
        let s = SockRef::from(&accepted);
        assert!(!s.keepalive().unwrap());
        assert_eq!(s.tcp_user_timeout().unwrap(), None);
        assert_eq!(Keepalive::OFF.dead_after_secs(), 0);
    }

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
