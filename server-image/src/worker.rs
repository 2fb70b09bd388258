//! The worker event loop: each worker thread owns one listener (from
//! [`crate::listen`]), one edge-triggered epoll loop (`mio::Poll`) and one
//! connection slab. It accepts, drives connections ([`crate::conn`]), sweeps
//! timeouts and sends WebSocket pings once a second, and carries out drain
//! and shed orders. Workers share nothing on the hot path but
//! [`crate::control::Shared`], whose live-connection count enforces the
//! cap; each has its own budget for unfinished input ([`Budget`]).
//!
//! A WebSocket the server closes on its own initiative (an order, a
//! timeout, a protocol error) gets its close frame and stays in the slab in
//! [`Phase::Closing`] until the peer closes its side or the close timeout
//! passes ([`crate::conn`] has why). Its close is counted when it begins
//! (`c10m_connections_closed_total`, and it leaves `c10m_connections`), so
//! orders keep their rate; while it lasts it counts in
//! `c10m_connections_closing` and keeps its slot under the cap (it still
//! holds a descriptor), and no order or other timeout takes it.

use std::fs::File;
use std::io::{self, ErrorKind};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use rustix::io::Errno;
use slab::Slab;

use crate::config::{Config, Protocol};
use crate::conn::{Budget, CloseReason, Conn, Ctx, Phase, Status, Traffic};
use crate::control::{CloseOrder, Shared};
use crate::limits;
use crate::listen::Keepalive;
use crate::metrics::{RejectReason, WorkerMetrics};
use crate::ws::Subprotocols;

/// Token of the worker's listener. Connection tokens are slab keys, which
/// count up from 0 and never reach the top of the `usize` range.
pub const LISTENER: Token = Token(usize::MAX);

/// Token of the worker's `mio::Waker` (shutdown requests).
pub const WAKER: Token = Token(usize::MAX - 1);

/// Size of the per-worker scratch read buffer, in bytes. One per worker, not
/// per connection ([`c10m_wire::limits::READ_CHUNK_BYTES`]: 64 KiB matches
/// the largest single read loopback TCP typically hands over without being
/// large enough to hurt cache locality).
pub const SCRATCH_BYTES: usize = c10m_wire::limits::READ_CHUNK_BYTES;

/// Readiness events taken per `epoll_wait`, in events.
pub const EVENTS_CAPACITY: usize = 1024;

/// Minimum time between two identical accept-error warnings from one worker.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A running worker.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Worker index.
    pub id: u32,
    /// Wakes the worker's event loop (to notice a drain or shed order).
    pub waker: Arc<Waker>,
    /// The worker thread; it returns once the worker has closed everything.
    pub thread: JoinHandle<io::Result<()>>,
}

/// Protocol and limits a worker applies to every connection.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Protocol spoken on accepted connections.
    pub protocol: Protocol,
    /// WebSocket: seconds an upgrade request may take (slowloris guard).
    pub handshake_timeout_secs: u32,
    /// Seconds without a read before a connection is closed; 0: never.
    pub idle_timeout_secs: u32,
    /// WebSocket: largest frame payload, in bytes.
    pub max_frame_bytes: usize,
    /// WebSocket: seconds an unfinished frame may take to complete.
    pub frame_timeout_secs: u32,
    /// Bytes the worker may hold for unfinished frames and upgrade requests.
    pub partial_budget_bytes: usize,
    /// WebSocket: seconds without a read before a server ping; 0: never.
    pub ws_ping_secs: u32,
    /// WebSocket: seconds a server ping may go unanswered.
    pub ws_pong_timeout_secs: u32,
    /// WebSocket: seconds the server waits for the peer's close after its
    /// own ([`Phase::Closing`]).
    pub close_timeout_secs: u32,
    /// WebSocket: subprotocols accepted in the upgrade.
    pub subprotocols: Subprotocols,
    /// TCP keepalive and user timeout of accepted connections.
    pub keepalive: Keepalive,
}

impl Limits {
    /// The limits `config` asks for. The budget is raised to one largest
    /// frame with its header if set below that (else no such frame could
    /// ever complete); the TCP user timeout defaults to the time keepalive
    /// takes to drop a dead peer.
    pub fn from_config(config: &Config) -> Self {
        let dead_after = c10m_wire::keepalive::dead_after_secs(
            config.keepalive_idle_secs,
            config.keepalive_interval_secs,
            config.keepalive_count,
        );
        let user_timeout =
            config
                .tcp_user_timeout_secs
                .unwrap_or(if config.keepalive_idle_secs > 0 {
                    u32::try_from(dead_after).unwrap_or(u32::MAX)
                } else {
                    0
                });
        Limits {
            protocol: config.protocol,
            handshake_timeout_secs: config.handshake_timeout_secs,
            idle_timeout_secs: config.idle_timeout_secs,
            max_frame_bytes: config.max_frame_bytes,
            frame_timeout_secs: config.frame_timeout_secs,
            partial_budget_bytes: config
                .partial_budget_bytes
                .max(config.max_frame_bytes + crate::ws::MAX_HEADER_BYTES),
            ws_ping_secs: config.ws_ping_secs,
            ws_pong_timeout_secs: config.ws_pong_timeout_secs,
            close_timeout_secs: config.close_timeout_secs,
            subprotocols: config.subprotocols.clone(),
            keepalive: Keepalive {
                idle_secs: config.keepalive_idle_secs,
                interval_secs: config.keepalive_interval_secs,
                count: config.keepalive_count,
                user_timeout_secs: user_timeout,
            },
        }
    }
}

/// How to start one worker.
#[derive(Debug)]
pub struct WorkerSpec {
    /// Worker index, 0-based (the `worker` metric label).
    pub id: u32,
    /// Its listener, from [`crate::listen::bind_listeners`].
    pub listener: std::net::TcpListener,
    /// CPU to pin the thread to, if any.
    pub cpu: Option<usize>,
    /// Protocol and limits.
    pub limits: Limits,
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
    // Accepted sockets inherit the listener's keepalive options.
    spec.limits
        .keepalive
        .apply(socket2::SockRef::from(&spec.listener))?;
    let mut listener = TcpListener::from_std(spec.listener);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let id = spec.id;
    let budget = Budget::new(spec.limits.partial_budget_bytes);
    let worker = Worker {
        id,
        poll,
        listener: Some(listener),
        shared,
        metrics,
        limits: spec.limits,
        spare: open_spare(),
        last_warn: None,
        start: Instant::now(),
        order: None,
        order_gen: 0,
        cursor: 0,
        out: Vec::new(),
        join: Vec::new(),
        budget,
        closing: 0,
        doomed: Vec::new(),
        pings: Vec::new(),
        last_sweep: 0,
        ready: Vec::new(),
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

/// Event-loop wake-up period while a close order runs, so closes follow the
/// order's rate within 10 ms. Chosen, not measured.
pub const ORDER_TICK: Duration = Duration::from_millis(10);

/// Most connections one worker closes per wake-up under an order, so a fast
/// order does not stall the loop for long. Chosen, not measured.
pub const ORDER_BATCH: u64 = 1024;

struct Worker {
    id: u32,
    poll: Poll,
    listener: Option<TcpListener>,
    shared: Arc<Shared>,
    metrics: WorkerMetrics,
    limits: Limits,
    spare: Option<File>,
    last_warn: Option<Instant>,
    start: Instant,
    order: Option<Arc<CloseOrder>>,
    order_gen: u64,
    /// Slab key where the next order batch starts looking.
    cursor: usize,
    /// Reply buffer shared by all connections (left empty between uses).
    out: Vec<u8>,
    /// Where held input and a new read are joined when the budget does not
    /// let the held buffer grow.
    join: Vec<u8>,
    /// Bytes held for unfinished frames and upgrade requests.
    budget: Budget,
    /// Connections in the slab in [`Phase::Closing`].
    closing: usize,
    /// Keys to close, collected by a sweep or an order batch.
    doomed: Vec<(usize, CloseReason)>,
    /// Keys to ping, collected by a sweep.
    pings: Vec<usize>,
    last_sweep: u32,
    /// Connections that used up their read budget with data left: driven
    /// again on the next turn of the loop without waiting for an event.
    ready: Vec<usize>,
}

type Conns = Slab<Conn<TcpStream>>;

impl Worker {
    /// Seconds since the worker started (the connections' timestamps).
    fn tick(&self) -> u32 {
        self.start.elapsed().as_secs() as u32
    }

    fn sweeps(&self) -> bool {
        self.limits.protocol == Protocol::Websocket || self.limits.idle_timeout_secs > 0
    }

    fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(EVENTS_CAPACITY);
        let mut scratch = vec![0u8; SCRATCH_BYTES].into_boxed_slice();
        let mut conns: Conns = Slab::new();
        let mut again = Vec::new();
        loop {
            let timeout = if !self.ready.is_empty() {
                Some(Duration::ZERO)
            } else if self.order.is_some() {
                Some(ORDER_TICK)
            } else if self.sweeps() && !conns.is_empty() {
                // Wake at the next whole second of the worker's clock.
                let e = self.start.elapsed();
                Some(Duration::from_secs(e.as_secs() + 1) - e)
            } else {
                None
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                self.close_all(&mut conns, CloseReason::Error);
                return Err(e);
            }
            let now = self.tick();
            // Budget-limited connections first, then the new events; a key
            // reused since is driven once for nothing (its read would block).
            std::mem::swap(&mut again, &mut self.ready);
            for key in again.drain(..) {
                self.drive(&mut conns, key, &mut scratch, now);
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(&mut conns, now),
                    WAKER => {}
                    Token(key) => self.drive(&mut conns, key, &mut scratch, now),
                }
            }
            if self.shared.draining() {
                self.stop_accepting();
            }
            if self.shared.order_gen() != self.order_gen {
                self.order_gen = self.shared.order_gen();
                self.order = self.shared.order();
            }
            if self.shared.forced() {
                self.close_all(&mut conns, CloseReason::Shutdown);
            }
            if self.order.is_some() {
                self.run_order(&mut conns, now);
            }
            if self.shared.draining() && conns.is_empty() {
                tracing::debug!(worker = self.id, "worker drained");
                return Ok(());
            }
            if self.sweeps() && now != self.last_sweep {
                self.last_sweep = now;
                self.sweep(&mut conns, now);
            }
        }
    }

    /// Accepts until the queue is empty (edge-triggered).
    fn accept_all(&mut self, conns: &mut Conns, now: u32) {
        loop {
            if self.shared.draining() {
                return;
            }
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _peer)) => self.admit(conns, stream.into(), now),
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

    /// Holds `stream` if the cap and the limit in force allow, else closes
    /// it (counted as rejected, by which of the two).
    fn admit(&mut self, conns: &mut Conns, stream: TcpStream, now: u32) {
        if let Err(reason) = self.shared.try_admit() {
            // Closing sends FIN: the client reads EOF, no reset.
            drop(stream);
            self.metrics.rejected(reason).inc();
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
                let phase = match self.limits.protocol {
                    Protocol::Echo => Phase::Open,
                    Protocol::Websocket => Phase::Handshake,
                };
                entry.insert(Conn::new(stream, phase, now));
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
    fn drive(&mut self, conns: &mut Conns, key: usize, scratch: &mut [u8], now: u32) {
        let Some(conn) = conns.get_mut(key) else {
            return; // closed earlier in this batch of events
        };
        let was_blocked = conn.has_unsent();
        let mut ctx = Ctx {
            scratch,
            out: &mut self.out,
            join: &mut self.join,
            budget: &mut self.budget,
            max_frame: self.limits.max_frame_bytes,
            subprotocols: &self.limits.subprotocols,
            now,
            traffic: Traffic::default(),
        };
        let status = match self.limits.protocol {
            Protocol::Echo => conn.echo(&mut ctx),
            Protocol::Websocket => conn.websocket(&mut ctx),
        };
        let traffic = ctx.traffic;
        self.metrics.partial_bytes.set(self.budget.used as i64);
        if traffic.received > 0 {
            self.metrics.received_bytes.inc_by(traffic.received);
        }
        if traffic.sent > 0 {
            self.metrics.sent_bytes.inc_by(traffic.sent);
        }
        match status {
            Status::Closed(reason) => return self.close(conns, key, reason),
            Status::Busy => self.ready.push(key),
            Status::Closing(reason) => {
                self.count_closing(reason);
                // Bytes may wait behind the ones that made it close.
                self.ready.push(key);
            }
            Status::Idle | Status::Blocked => {}
        }
        // Writability is watched exactly while bytes wait for the kernel.
        let blocked = conn.has_unsent();
        if blocked == was_blocked {
            return;
        }
        let interest = if blocked {
            tracing::trace!(
                worker = self.id,
                conn = key,
                "write blocked; holding unsent bytes"
            );
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        let fd = conn.stream.as_raw_fd();
        self.rearm(conns, key, fd, interest);
    }

    /// Watches `key`'s descriptor `fd` for `interest` from now on; a
    /// connection epoll refuses is closed (counted as an error).
    fn rearm(&mut self, conns: &mut Conns, key: usize, fd: RawFd, interest: Interest) {
        if let Err(e) = self
            .poll
            .registry()
            .reregister(&mut SourceFd(&fd), Token(key), interest)
        {
            tracing::debug!(worker = self.id, error = %e, "epoll re-registration failed");
            self.close(conns, key, CloseReason::Error);
        }
    }

    /// Drops a connection and gives back its slot. Its close is counted
    /// under `reason`, unless it was in its close handshake, whose close
    /// was counted when it began ([`Worker::count_closing`]).
    fn close(&mut self, conns: &mut Conns, key: usize, reason: CloseReason) {
        // Closing the descriptor also removes it from the epoll set.
        let conn = conns.remove(key);
        if conn.held() > 0 {
            self.budget.release(conn.held());
            self.metrics.partial_bytes.set(self.budget.used as i64);
        }
        let was_closing = conn.phase() == Phase::Closing;
        drop(conn);
        if was_closing {
            self.closing -= 1;
            self.shared.release_closing();
            self.metrics.closing.dec();
        } else {
            self.shared.release();
            self.metrics.connections.dec();
            self.metrics.closed(reason).inc();
        }
    }

    /// A connection entered its close handshake: its close counts now, it
    /// leaves `c10m_connections` for `c10m_connections_closing`, and keeps
    /// its slot until [`Worker::close`].
    fn count_closing(&mut self, reason: CloseReason) {
        self.closing += 1;
        self.shared.begin_closing();
        // The gauges first: a scrape that sees the close counted sees them
        // moved too.
        self.metrics.connections.dec();
        self.metrics.closing.inc();
        self.metrics.closed(reason).inc();
    }

    /// Closes with a protocol goodbye. An open WebSocket gets a close frame
    /// (the status for `reason`, [`CloseReason::ws_code`]) and enters its
    /// close handshake, counted now; the socket closes when the peer closes
    /// its side or at the close timeout. One already closing is closed at
    /// once (its time is up); the others (echo, an upgrade under way, a
    /// WebSocket answering its peer's close) get [`Worker::close_now`].
    fn close_politely(&mut self, conns: &mut Conns, key: usize, reason: CloseReason, now: u32) {
        let Some(conn) = conns.get_mut(key) else {
            return;
        };
        match conn.phase() {
            Phase::Closing => return self.close(conns, key, reason),
            Phase::Open if self.limits.protocol == Protocol::Websocket && !conn.closing() => {}
            Phase::Open | Phase::Handshake => return self.close_now(conns, key, reason),
        }
        let was_blocked = conn.has_unsent();
        let mut t = Traffic::default();
        let sent = conn.start_close(
            reason.ws_code(),
            &mut self.out,
            &mut t,
            now,
            &mut self.budget,
        );
        self.metrics.sent_bytes.inc_by(t.sent);
        self.metrics.partial_bytes.set(self.budget.used as i64);
        if sent.is_err() {
            return self.close(conns, key, reason);
        }
        self.count_closing(reason);
        // Read what may already wait (the peer's answer, a blocked reply's
        // backlog) on the next turn.
        self.ready.push(key);
        if was_blocked || !conn.has_unsent() {
            return;
        }
        let fd = conn.stream.as_raw_fd();
        self.rearm(conns, key, fd, Interest::READABLE | Interest::WRITABLE);
    }

    /// Closes at once with a best-effort goodbye (WebSocket close 1001 if
    /// open and not closing yet), then FIN: for the drain deadline and a
    /// failed poll, which cannot wait for peers.
    fn close_now(&mut self, conns: &mut Conns, key: usize, reason: CloseReason) {
        if let Some(conn) = conns.get_mut(key) {
            let mut t = Traffic::default();
            conn.goodbye(
                self.limits.protocol == Protocol::Websocket && !conn.closing(),
                reason,
                &mut self.out,
                &mut t,
            );
            self.metrics.sent_bytes.inc_by(t.sent);
            // FIN first, so the peer reads EOF even if its last bytes are
            // still unread here (a bare close would then send RST).
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
        self.close(conns, key, reason);
    }

    /// Closes what the running order allows now, starting at the cursor.
    fn run_order(&mut self, conns: &mut Conns, now: u32) {
        let Some(order) = self.order.clone() else {
            return;
        };
        if order.over(Instant::now()) {
            self.order = None;
            return;
        }
        let want = ((conns.len() - self.closing) as u64).min(ORDER_BATCH);
        let got = order.claim(want, Instant::now());
        let mut left = got;
        let cap = conns.capacity();
        let mut scanned = 0;
        self.doomed.clear();
        while left > 0 && scanned < cap {
            if self.cursor >= cap {
                self.cursor = 0;
            }
            if conns
                .get(self.cursor)
                .is_some_and(|c| order.takes(c.phase()) && !c.closing())
            {
                self.doomed.push((self.cursor, order.reason));
                left -= 1;
            }
            self.cursor += 1;
            scanned += 1;
        }
        order.unclaim(left);
        let doomed = std::mem::take(&mut self.doomed);
        for &(key, reason) in &doomed {
            self.close_politely(conns, key, reason, now);
        }
        self.doomed = doomed;
    }

    /// Once a second: closes WebSocket connections whose upgrade is
    /// overdue, whose unfinished frame is older than the frame timeout, or
    /// whose server ping went unanswered; with an idle timeout, connections
    /// that read nothing for that long; those in their close handshake for
    /// longer than the close timeout (at once, with no more goodbye); and
    /// pings WebSockets silent for `--ws-ping-secs`. Timestamps are whole
    /// seconds, so "more than `t` ticks ago" means at least `t` and under
    /// `t + 2` seconds. Walks the
    /// slab (tens of microseconds per 10k connections) so that no
    /// per-connection timer exists.
    fn sweep(&mut self, conns: &mut Conns, now: u32) {
        let hs = self.limits.handshake_timeout_secs;
        let idle = self.limits.idle_timeout_secs;
        let frame = self.limits.frame_timeout_secs;
        let ping = match self.limits.protocol {
            Protocol::Websocket => self.limits.ws_ping_secs,
            Protocol::Echo => 0,
        };
        let pong = self.limits.ws_pong_timeout_secs;
        let close = self.limits.close_timeout_secs;
        self.doomed.clear();
        self.pings.clear();
        for (key, c) in conns.iter() {
            let age = now.wrapping_sub(c.since());
            match c.phase() {
                // The reason is not counted: the close was, when it began.
                Phase::Closing if c.closing_for(now).is_some_and(|t| t > close) => {
                    self.doomed.push((key, CloseReason::Shutdown));
                }
                Phase::Handshake if age > hs => {
                    self.doomed.push((key, CloseReason::HandshakeTimeout));
                }
                Phase::Open if idle > 0 && age > idle => {
                    self.doomed.push((key, CloseReason::IdleTimeout));
                }
                Phase::Open
                    if c.partial_since()
                        .is_some_and(|t| now.wrapping_sub(t) > frame) =>
                {
                    self.doomed.push((key, CloseReason::FrameTimeout));
                }
                Phase::Open if ping > 0 && c.pinged() && age > ping.saturating_add(pong) => {
                    self.doomed.push((key, CloseReason::PingTimeout));
                }
                Phase::Open if ping > 0 && !c.pinged() && !c.closing() && age >= ping => {
                    self.pings.push(key);
                }
                _ => {}
            }
        }
        let doomed = std::mem::take(&mut self.doomed);
        for &(key, reason) in &doomed {
            self.close_politely(conns, key, reason, now);
        }
        self.doomed = doomed;
        if self.doomed.capacity() > 4 * ORDER_BATCH as usize {
            self.doomed = Vec::new();
        }
        let pings = std::mem::take(&mut self.pings);
        for &key in &pings {
            self.ping(conns, key);
        }
        self.pings = pings;
        if self.pings.capacity() > 4 * ORDER_BATCH as usize {
            self.pings = Vec::new();
        }
    }

    /// Sends a server ping; waits for writability if it did not all go out.
    fn ping(&mut self, conns: &mut Conns, key: usize) {
        let Some(conn) = conns.get_mut(key) else {
            return;
        };
        let was_blocked = conn.has_unsent();
        let mut t = Traffic::default();
        let sent = conn.ping(&mut self.out, &mut t);
        self.metrics.sent_bytes.inc_by(t.sent);
        if let Err(reason) = sent {
            return self.close(conns, key, reason);
        }
        if !was_blocked && conn.has_unsent() {
            let fd = conn.stream.as_raw_fd();
            self.rearm(conns, key, fd, Interest::READABLE | Interest::WRITABLE);
        }
    }

    fn stop_accepting(&mut self) {
        if let Some(mut listener) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
    }

    fn close_all(&mut self, conns: &mut Conns, reason: CloseReason) {
        let keys: Vec<usize> = conns.iter().map(|(k, _)| k).collect();
        for key in keys {
            self.close_now(conns, key, reason);
        }
    }
}
