//! Benchmark floor probe: a minimal edge-triggered epoll echo loop that
//! keeps no per-connection state at all (the epoll token is the descriptor
//! itself; one static read buffer). What it costs per idle connection is
//! what the kernel costs; `make bench-server` compares c10m-server to it.
//!
//! Usage: `floor BIND_ADDR:PORT`

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use socket2::{Domain, Socket, Type};

const LISTENER: Token = Token(usize::MAX);

// The probe reads, writes and closes raw descriptors itself (no per-connection
// object to own them), so its loop needs libc calls; each carries its SAFETY.
#[allow(unsafe_code)]
fn main() -> std::io::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7000".into())
        .parse()
        .expect("BIND_ADDR:PORT");
    let socket = Socket::new(Domain::IPV4, Type::STREAM.nonblocking(), None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(c10m_server::config::DEFAULT_BACKLOG)?;
    let listener: std::net::TcpListener = socket.into();
    let mut poll = Poll::new()?;
    let lfd = listener.as_raw_fd();
    poll.registry()
        .register(&mut SourceFd(&lfd), LISTENER, Interest::READABLE)?;
    let mut events = Events::with_capacity(1024);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        poll.poll(&mut events, None)?;
        for ev in events.iter() {
            if ev.token() == LISTENER {
                loop {
                    match listener.accept() {
                        Ok((s, _)) => {
                            let _ = s.set_nonblocking(true);
                            let _ = s.set_nodelay(true);
                            let fd: RawFd = s.into_raw_fd();
                            let _ = poll.registry().register(
                                &mut SourceFd(&fd),
                                Token(fd as usize),
                                Interest::READABLE,
                            );
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(_) => break,
                    }
                }
                continue;
            }
            let fd = ev.token().0 as RawFd;
            loop {
                // SAFETY: fd is an open socket this loop accepted; buf is live.
                let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
                if n > 0 {
                    // Best effort: the probe's pings are 16 bytes.
                    // SAFETY: as above, writing n bytes just read.
                    unsafe { libc::write(fd, buf.as_ptr().cast(), n as usize) };
                    continue;
                }
                let eagain =
                    n < 0 && std::io::Error::last_os_error().kind() == ErrorKind::WouldBlock;
                if !eagain {
                    // SAFETY: closing the descriptor we own; epoll forgets it.
                    unsafe { libc::close(fd) };
                }
                break;
            }
        }
    }
}
