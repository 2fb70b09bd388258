//! Worker threads: one SO_REUSEPORT listener, one edge-triggered epoll loop
//! (`mio::Poll`) and one connection slab each. Workers share nothing on the
//! hot path but the process-wide live-connection count that enforces the cap.

use std::fs::File;
use std::io::{self, ErrorKind};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use rustix::io::Errno;
use slab::Slab;
use socket2::{Domain, Socket, Type};

use crate::config::Protocol;
use crate::conn::{Conn, Status, Traffic};
use crate::limits;
use crate::metrics::{CloseReason, RejectReason, WorkerMetrics};

/// Token of the worker's listener. Connection tokens are slab keys, which
/// count up from 0 and never reach the top of the `usize` range.
pub const LISTENER: Token = Token(usize::MAX);

/// Token of the worker's `mio::Waker` (shutdown requests).
pub const WAKER: Token = Token(usize::MAX - 1);

/// Size of the per-worker scratch read buffer, in bytes. One per worker, not
/// per connection. 64 KiB matches the largest single read loopback TCP
/// typically hands over (its 64 KiB MTU) without being large enough to hurt
/// cache locality.
pub const SCRATCH_BYTES: usize = 64 * 1024;

/// Readiness events taken per `epoll_wait`, in events.
pub const EVENTS_CAPACITY: usize = 1024;

/// Minimum time between two identical accept-error warnings from one worker.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// State the workers and the main thread share.
#[derive(Debug)]
pub struct Shared {
    live: AtomicU64,
    cap: u64,
    draining: Arc<AtomicBool>,
}

impl Shared {
    /// `cap` is the per-process connection cap; `draining` turns true when
    /// the server starts shutting down.
    pub fn new(cap: u64, draining: Arc<AtomicBool>) -> Self {
        Shared {
            live: AtomicU64::new(0),
            cap,
            draining,
        }
    }

    /// Claims a slot for one more connection, unless the cap is reached.
    /// Never lets the count exceed the cap, however many workers race.
    pub fn try_admit(&self) -> bool {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.cap).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back the slot of a closed connection.
    pub fn release(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// Live connections in the process.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// Whether the server is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
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

/// A running worker.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Worker index.
    pub id: u32,
    /// Wakes the worker's event loop (to notice the draining flag).
    pub waker: Arc<Waker>,
    /// The worker thread; it returns once the worker has closed everything.
    pub thread: JoinHandle<io::Result<()>>,
}

/// How to start one worker.
#[derive(Debug)]
pub struct WorkerSpec {
    /// Worker index, 0-based (the `worker` metric label).
    pub id: u32,
    /// Its listener, from [`bind_listeners`].
    pub listener: std::net::TcpListener,
    /// CPU to pin the thread to, if any.
    pub cpu: Option<usize>,
    /// Protocol spoken on accepted connections.
    pub protocol: Protocol,
}

/// Starts a worker thread. `on_exit` runs on the worker thread when its loop
/// ends, with the loop's result (the main thread uses it to notice a worker
/// that died).
pub fn spawn(
    spec: WorkerSpec,
    shared: Arc<Shared>,
    metrics: WorkerMetrics,
    on_exit: impl FnOnce(u32, &io::Result<()>) + Send + 'static,
) -> io::Result<WorkerHandle> {
    let poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let mut listener = TcpListener::from_std(spec.listener);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let id = spec.id;
    let worker = Worker {
        id,
        poll,
        listener: Some(listener),
        shared,
        metrics,
        protocol: spec.protocol,
        spare: open_spare(),
        last_warn: None,
    };
    let cpu = spec.cpu;
    let thread = std::thread::Builder::new()
        .name(format!("c10m-worker-{id}"))
        .spawn(move || {
            if let Some(cpu) = cpu {
                let pinned = limits::pin_current_thread(cpu);
                tracing::debug!(worker = id, cpu, pinned, "worker started");
            }
            let result = worker.run();
            on_exit(id, &result);
            result
        })?;
    Ok(WorkerHandle { id, waker, thread })
}

/// A descriptor held in reserve so that, out of descriptors (`EMFILE`), the
/// worker can still take a connection off the accept queue and close it
/// instead of leaving it (and the edge-triggered listener) stuck.
fn open_spare() -> Option<File> {
    File::open("/dev/null").ok()
}

struct Worker {
    id: u32,
    poll: Poll,
    listener: Option<TcpListener>,
    shared: Arc<Shared>,
    metrics: WorkerMetrics,
    protocol: Protocol,
    spare: Option<File>,
    last_warn: Option<Instant>,
}

impl Worker {
    fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(EVENTS_CAPACITY);
        let mut scratch = vec![0u8; SCRATCH_BYTES].into_boxed_slice();
        let mut conns: Slab<Conn<TcpStream>> = Slab::new();
        loop {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                self.close_all(&mut conns, CloseReason::Error);
                return Err(e);
            }
            let mut drain = false;
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(&mut conns),
                    WAKER => drain |= self.shared.draining(),
                    Token(key) => self.drive(&mut conns, key, &mut scratch),
                }
            }
            if drain || self.shared.draining() {
                self.stop_accepting();
                self.close_all(&mut conns, CloseReason::Shutdown);
                tracing::debug!(worker = self.id, "worker drained");
                return Ok(());
            }
        }
    }

    /// Accepts until the queue is empty (edge-triggered).
    fn accept_all(&mut self, conns: &mut Slab<Conn<TcpStream>>) {
        loop {
            if self.shared.draining() {
                return;
            }
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _peer)) => self.admit(conns, stream.into()),
                Err(e) => match e.kind() {
                    ErrorKind::WouldBlock => return,
                    ErrorKind::Interrupted | ErrorKind::ConnectionAborted => {}
                    _ => {
                        let errno = Errno::from_io_error(&e);
                        if (errno == Some(Errno::MFILE) || errno == Some(Errno::NFILE))
                            && self.shed_one()
                        {
                            continue;
                        }
                        self.warn_accept(&e);
                        return;
                    }
                },
            }
        }
    }

    /// Holds `stream` if the cap allows, else closes it (counted as rejected).
    fn admit(&mut self, conns: &mut Slab<Conn<TcpStream>>, stream: TcpStream) {
        if !self.shared.try_admit() {
            // Closing sends FIN: the client reads EOF, no reset.
            drop(stream);
            self.metrics.rejected(RejectReason::Capacity).inc();
            return;
        }
        // Echo answers small writes; do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let entry = conns.vacant_entry();
        let token = Token(entry.key());
        self.metrics.accepted.inc();
        let registered = self.poll.registry().register(
            &mut SourceFd(&stream.as_raw_fd()),
            token,
            Interest::READABLE,
        );
        match registered {
            Ok(()) => {
                entry.insert(Conn::new(stream));
                self.metrics.connections.inc();
            }
            Err(e) => {
                tracing::warn!(worker = self.id, error = %e, "epoll registration failed");
                self.shared.release();
                self.metrics.closed(CloseReason::Error).inc();
            }
        }
    }

    /// Out of descriptors: frees the spare, accepts one connection with it,
    /// closes that, takes the spare back. Returns whether a connection was
    /// shed (so the accept loop may go on).
    fn shed_one(&mut self) -> bool {
        let Some(listener) = &self.listener else {
            return false;
        };
        if self.spare.take().is_none() {
            return false;
        }
        let shed = listener.accept().is_ok();
        if shed {
            self.metrics.rejected(RejectReason::FdLimit).inc();
        }
        self.spare = open_spare();
        shed
    }

    fn warn_accept(&mut self, e: &io::Error) {
        let now = Instant::now();
        if self
            .last_warn
            .is_none_or(|t| now.duration_since(t) >= WARN_EVERY)
        {
            self.last_warn = Some(now);
            tracing::warn!(worker = self.id, error = %e, "accept failed");
        }
    }

    /// Runs the protocol on a ready connection and updates its interest.
    fn drive(&mut self, conns: &mut Slab<Conn<TcpStream>>, key: usize, scratch: &mut [u8]) {
        let Some(conn) = conns.get_mut(key) else {
            return; // closed earlier in this batch of events
        };
        let was_blocked = conn.unsent.is_some();
        let mut traffic = Traffic::default();
        let status = match self.protocol {
            Protocol::Echo => conn.echo(scratch, &mut traffic),
        };
        if traffic.received > 0 {
            self.metrics.received_bytes.inc_by(traffic.received);
        }
        if traffic.sent > 0 {
            self.metrics.sent_bytes.inc_by(traffic.sent);
        }
        let interest = match status {
            Status::Idle if was_blocked => Interest::READABLE,
            Status::Blocked if !was_blocked => {
                tracing::trace!(
                    worker = self.id,
                    conn = key,
                    "write blocked; holding unsent bytes"
                );
                Interest::READABLE | Interest::WRITABLE
            }
            Status::Idle | Status::Blocked => return,
            Status::Closed(reason) => return self.close(conns, key, reason),
        };
        let fd = conn.stream.as_raw_fd();
        if let Err(e) = self
            .poll
            .registry()
            .reregister(&mut SourceFd(&fd), Token(key), interest)
        {
            tracing::debug!(worker = self.id, error = %e, "epoll re-registration failed");
            self.close(conns, key, CloseReason::Error);
        }
    }

    fn close(&mut self, conns: &mut Slab<Conn<TcpStream>>, key: usize, reason: CloseReason) {
        // Closing the descriptor also removes it from the epoll set.
        drop(conns.remove(key));
        self.shared.release();
        self.metrics.connections.dec();
        self.metrics.closed(reason).inc();
    }

    fn stop_accepting(&mut self) {
        if let Some(mut listener) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
    }

    fn close_all(&mut self, conns: &mut Slab<Conn<TcpStream>>, reason: CloseReason) {
        let n = conns.len() as u64;
        for conn in conns.drain() {
            // FIN first, so the peer reads EOF even if its last bytes are
            // still unread here (a bare close would then send RST).
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            drop(conn);
            self.shared.release();
        }
        self.metrics.connections.dec_by(n as i64);
        self.metrics.closed(reason).inc_by(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_never_exceeds_the_cap() {
        let shared = Arc::new(Shared::new(1000, Arc::new(AtomicBool::new(false))));
        let admitted: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let shared = &shared;
                    s.spawn(move || (0..600).filter(|_| shared.try_admit()).count() as u64)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1000);
        assert_eq!(shared.live(), 1000);
        assert!(!shared.try_admit());
        shared.release();
        assert_eq!(shared.live(), 999);
        assert!(shared.try_admit());
        assert!(!shared.try_admit());
    }

    #[test]
    fn zero_cap_admits_nothing() {
        let shared = Shared::new(0, Arc::new(AtomicBool::new(false)));
        assert!(!shared.try_admit());
        assert_eq!(shared.live(), 0);
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
