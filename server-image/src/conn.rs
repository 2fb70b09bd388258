//! Per-connection state and the two protocol pumps (echo, WebSocket).
//!
//! A connection is one slab entry of 16 bytes on 64-bit Linux: the socket's
//! descriptor (4 B), a packed word holding its phase, a "pinged" flag and a
//! coarse timestamp (4 B), and one nullable pointer (8 B) to [`Extra`],
//! which exists only while the connection is mid-something: a write the
//! kernel did not take, an incomplete WebSocket frame or upgrade request, a
//! fragmented message in flight. An idle connection holds no buffer at all;
//! reads go through one scratch buffer owned by the worker and replies are
//! built in one output buffer owned by the worker. The kernel spends
//! ~3.9 KiB on the socket itself [measured, `docs/KERNEL_FACTS.md`].
//!
//! Bytes of unfinished frames and upgrade requests are the only input a
//! connection holds between reads. They are charged to the worker's
//! [`Budget`]: a connection that would hold more than the budget has left
//! is closed (WebSocket close 1013, or 503 during the upgrade), so however
//! many clients stop in the middle of a frame, a worker holds at most its
//! budget for them. A frame that does not complete within the frame
//! timeout is closed by the worker's sweep ([`Conn::partial_since`]).
//!
//! Closing (RFC 6455 §7.1.1, issue 21). When the server ends a WebSocket
//! on its own initiative it sends a goodbye (a close frame: 1001 for a
//! drain or shed, 1009, 1007, 1002, 1008, 1011, 1013; or an HTTP error
//! answer to an upgrade) and the connection enters [`Phase::Closing`]: it
//! sends nothing more, half-closes (FIN) as soon as the goodbye is out, and
//! reads and discards whatever the peer still sends (the rest of a message,
//! its close answer) until the peer closes its side (EOF). Closing the
//! socket at once instead would make the kernel answer those bytes with a
//! reset, and a client that had not read the close frame yet would lose its
//! code (aiohttp saw 1009 in 12 of 15 tries). The wait is bounded in time
//! (`--close-timeout-secs`, enforced by the worker's sweep with
//! [`Conn::closing_for`]) and in bytes ([`CLOSE_DISCARD_BYTES`]). It costs
//! no memory: the packed word holds the state, the tick the closing began
//! and the bytes discarded, and `Extra` is dropped once the goodbye is
//! written. A peer's own close is answered and the socket closed as soon as
//! the answer is written (the server "MUST close the underlying TCP
//! connection immediately", §5.5.1), as is every echo connection.

use std::io::{self, ErrorKind, Read, Write};

use crate::ws;

/// Bits of [`Conn`]'s packed word that hold the timestamp (seconds since the
/// worker started): 2^28 s is 8.5 years, so it never wraps in practice.
pub const TICK_BITS: u32 = 28;
const TICK_MASK: u32 = (1 << TICK_BITS) - 1;
/// Bit of the packed word set in [`Phase::Handshake`].
const HANDSHAKE_BIT: u32 = 1 << TICK_BITS;
/// Bit of the packed word set while a server ping awaits an answer.
const PINGED_BIT: u32 = 1 << (TICK_BITS + 1);
/// Bit of the packed word set in [`Phase::Closing`]. The other 31 bits then
/// mean something else: the tick the closing began, modulo 2^7, in the low
/// [`CLOSE_TICK_BITS`], and the bytes discarded since in the 24 above
/// (what an open connection uses for its timestamp, phase and ping flag,
/// none of which a closing one needs).
const CLOSING_BIT: u32 = 1 << 31;
/// Bits of the closing tick: its age is taken modulo 128 s, which is exact
/// while the sweep closes it by [`MAX_CLOSE_TIMEOUT_SECS`] + 2 s.
const CLOSE_TICK_BITS: u32 = 7;
const CLOSE_TICK_MASK: u32 = (1 << CLOSE_TICK_BITS) - 1;
/// Largest count of discarded bytes the closing word holds (2^24 − 1).
const DISCARD_MASK: u32 = (1 << (31 - CLOSE_TICK_BITS)) - 1;

/// Longest `--close-timeout-secs` accepted, in seconds: the sweep closes a
/// connection between the timeout and 2 s after it, and the closing tick
/// must not wrap before ([`CLOSE_TICK_BITS`]). A minute is far more than a
/// close answer takes (one round trip); 60, not 125, by choice.
pub const MAX_CLOSE_TIMEOUT_SECS: u32 = 60;
const _: () = assert!(MAX_CLOSE_TIMEOUT_SECS + 2 < 1 << CLOSE_TICK_BITS);

/// Most bytes a closing connection may send before the server closes its
/// socket without waiting further (a reset, if more is in flight): 8 MiB.
/// More than the largest receive window Linux offers by default
/// (`net.ipv4.tcp_rmem` max: 128 KiB to 6 MiB depending on RAM [source:
/// kernel `Documentation/networking/ip-sysctl.rst`]), so whatever a peer
/// had in flight when the close went out is read, with room for the rest
/// of a message it was still writing (an oversize one, past
/// `--max-frame-bytes`, is exactly that). A peer that sends more during the
/// close is not answering it, and reading its bytes costs the worker CPU
/// for nothing; one over the bound by more than 8 MiB loses its close code
/// to the reset. Counted exactly in the closing word (24 bits). Chosen, not
/// measured.
pub const CLOSE_DISCARD_BYTES: u32 = 8 << 20;
const _: () = assert!(CLOSE_DISCARD_BYTES < DISCARD_MASK);

/// Below this many bytes of capacity a held input buffer is never copied to
/// a smaller one; above it, a buffer more than twice the bytes it still
/// holds is (so a finished 64 KiB frame followed by 10 bytes of the next
/// does not keep 64 KiB charged). Chosen, not measured.
const SHRINK_ABOVE: usize = 1024;

/// Reads one pump call may do before yielding to the worker's other
/// connections, in reads of up to the 64 KiB scratch buffer: 16 (1 MiB) per
/// turn keeps one flooding client from starving the rest of the worker.
/// Chosen, not measured.
pub const READ_BUDGET: u32 = 16;

/// Why a held connection was closed (`c10m_connections_closed_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseReason {
    /// The peer closed its side (read returned EOF).
    Peer,
    /// The peer reset the connection (`ECONNRESET`, `EPIPE`).
    Reset,
    /// Any other socket error.
    Error,
    /// The server closed it while draining (SIGTERM/SIGINT or `POST /drain`).
    Shutdown,
    /// The server closed it on `POST /shed`.
    Shed,
    /// A WebSocket upgrade request did not complete within the handshake
    /// timeout (slowloris).
    HandshakeTimeout,
    /// Nothing was read within the idle timeout (when one is set).
    IdleTimeout,
    /// The WebSocket upgrade request was invalid (answered 4xx).
    BadHandshake,
    /// A WebSocket protocol violation (closed with 1002 or 1007).
    ProtocolError,
    /// A WebSocket frame above `--max-frame-bytes` (closed with 1009).
    TooLarge,
    /// A WebSocket frame (after the upgrade) did not complete within
    /// `--frame-timeout-secs` of its first byte (closed with 1008).
    FrameTimeout,
    /// Holding this connection's unfinished frame or upgrade request would
    /// pass the worker's `--partial-budget-bytes` (closed with 1013 "try
    /// again later", or 503 during the upgrade).
    Budget,
    /// A server ping (`--ws-ping-secs`) got no answer within
    /// `--ws-pong-timeout-secs` (closed with 1011).
    PingTimeout,
    /// The kernel gave up on the peer: keepalive probes or retransmissions
    /// went unanswered (`ETIMEDOUT`, the TCP user timeout) or the peer became
    /// unreachable (`EHOSTUNREACH`, `ENETUNREACH`, `ENETDOWN`).
    Unreachable,
}

impl CloseReason {
    /// Every reason, in label order.
    pub const ALL: [CloseReason; 14] = [
        Self::Peer,
        Self::Reset,
        Self::Error,
        Self::Shutdown,
        Self::Shed,
        Self::HandshakeTimeout,
        Self::IdleTimeout,
        Self::BadHandshake,
        Self::ProtocolError,
        Self::TooLarge,
        Self::FrameTimeout,
        Self::Budget,
        Self::PingTimeout,
        Self::Unreachable,
    ];

    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Peer => "peer",
            Self::Reset => "reset",
            Self::Error => "error",
            Self::Shutdown => "shutdown",
            Self::Shed => "shed",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::IdleTimeout => "idle_timeout",
            Self::BadHandshake => "bad_handshake",
            Self::ProtocolError => "protocol_error",
            Self::TooLarge => "too_large",
            Self::FrameTimeout => "frame_timeout",
            Self::Budget => "budget",
            Self::PingTimeout => "ping_timeout",
            Self::Unreachable => "unreachable",
        }
    }

    /// The WebSocket close status the server sends when it closes an
    /// upgraded connection for this reason on its own initiative (drain,
    /// shed, timeouts) [RFC 6455 §7.4.1]: 1008 (policy violation) for a
    /// frame past its deadline, 1011 for an unanswered ping (as Python's
    /// `websockets` does), 1001 (going away) otherwise.
    pub fn ws_code(self) -> u16 {
        match self {
            Self::FrameTimeout => ws::code::POLICY_VIOLATION,
            Self::PingTimeout => ws::code::INTERNAL_ERROR,
            _ => ws::code::GOING_AWAY,
        }
    }
}

/// Where a connection is in its protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Exchanging data (echo, or WebSocket after the upgrade).
    Open = 0,
    /// WebSocket: waiting for the HTTP upgrade request (handshake timeout
    /// applies).
    Handshake = 1,
    /// WebSocket: the server sent its goodbye (close frame or HTTP error
    /// answer) and waits, reading and discarding, for the peer to close its
    /// side; bounded by the close timeout and [`CLOSE_DISCARD_BYTES`]. Its
    /// close is already counted; orders and other timeouts skip it.
    Closing = 2,
}

/// Everything a busy connection needs beyond its socket. Dropped as soon as
/// the connection is idle again.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Extra {
    /// Bytes the kernel has not taken yet (from `written` on).
    unsent: Vec<u8>,
    written: usize,
    /// Received bytes not consumed yet: an incomplete frame or request head.
    input: Vec<u8>,
    /// The fragmented WebSocket message in flight.
    msg: ws::Message,
    /// Close once `unsent` is flushed: the answer to the peer's close is
    /// queued (the server's own goodbyes go through [`Phase::Closing`]).
    close_after: Option<CloseReason>,
    /// Tick at which the unfinished frame in `input` began to arrive.
    partial_since: u32,
}

impl Extra {
    fn is_empty(&self) -> bool {
        self.unsent.len() == self.written
            && self.input.is_empty()
            && self.msg.is_idle()
            && self.close_after.is_none()
    }
}

/// One held connection.
#[derive(Debug)]
pub struct Conn<S> {
    /// The socket (in the server, a non-blocking `std::net::TcpStream`
    /// registered with the worker's `mio::Poll`).
    pub stream: S,
    /// Timestamp (ticks) in the low [`TICK_BITS`], then the phase bit and
    /// the pinged bit; in [`Phase::Closing`], the closing word (see
    /// [`CLOSING_BIT`]).
    meta: u32,
    /// State of a busy connection; `None` whenever it is idle.
    extra: Option<Box<Extra>>,
}

/// Bytes moved by one call of a pump.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes read from the socket.
    pub received: u64,
    /// Bytes written to the socket.
    pub sent: u64,
}

/// Where a connection stands after a pump ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Nothing pending and nothing more to read (`WouldBlock`): wait for
    /// readability.
    Idle,
    /// A write could not finish; the rest is kept: wait for writability.
    Blocked,
    /// The read budget ([`READ_BUDGET`]) ran out with data still coming: the
    /// worker must call again soon without waiting for an event (edge
    /// triggering will not report it again), after serving the others.
    Busy,
    /// The connection is over; drop it.
    Closed(CloseReason),
    /// The server queued its goodbye and the connection entered
    /// [`Phase::Closing`]: count the close now, under this reason; the
    /// socket stays open (half-closed once the goodbye is written) until
    /// the peer closes, and the worker must call again soon without
    /// waiting for an event (bytes may already be waiting), and wait for
    /// writability while [`Conn::has_unsent`].
    Closing(CloseReason),
}

/// The bytes one worker may hold for unfinished frames and upgrade
/// requests, summed over its connections (the capacity of their held input
/// buffers), and what they hold now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Budget {
    /// Most bytes held at once (`--partial-budget-bytes`).
    pub limit: usize,
    /// Bytes held now.
    pub used: usize,
}

impl Budget {
    /// An unused budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Budget { limit, used: 0 }
    }

    /// Whether a connection holding `held` bytes may hold `new` instead.
    fn allows(&self, held: usize, new: usize) -> bool {
        new <= held || self.used.saturating_sub(held).saturating_add(new) <= self.limit
    }

    /// Records that a connection holding `held` bytes now holds `new`.
    fn charge(&mut self, held: usize, new: usize) {
        self.used = self.used.saturating_sub(held).saturating_add(new);
    }

    /// Releases what a closed connection held ([`Conn::held`]).
    pub fn release(&mut self, held: usize) {
        self.charge(held, 0);
    }
}

/// Per-worker buffers and limits a pump works with.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// Read buffer shared by all of the worker's connections.
    pub scratch: &'a mut [u8],
    /// Output buffer shared by all of the worker's connections; a pump
    /// leaves it empty.
    pub out: &'a mut Vec<u8>,
    /// Buffer shared by all of the worker's connections where held input
    /// and a new read are joined when the held buffer may not grow (its
    /// capacity stays with the worker: at most a largest frame plus one
    /// read).
    pub join: &'a mut Vec<u8>,
    /// The worker's budget for held input.
    pub budget: &'a mut Budget,
    /// Largest WebSocket frame payload accepted, in bytes.
    pub max_frame: usize,
    /// WebSocket subprotocols accepted in the upgrade.
    pub subprotocols: &'a ws::Subprotocols,
    /// Current tick (seconds since the worker started).
    pub now: u32,
    /// Bytes moved, accumulated.
    pub traffic: Traffic,
}

fn close_reason(e: &io::Error) -> CloseReason {
    match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            CloseReason::Reset
        }
        ErrorKind::TimedOut
        | ErrorKind::HostUnreachable
        | ErrorKind::NetworkUnreachable
        | ErrorKind::NetworkDown => CloseReason::Unreachable,
        _ => CloseReason::Error,
    }
}

/// Writes `data` until done or `WouldBlock`. Returns how many bytes were
/// written; an error means the connection is dead.
fn write_some<W: Write>(w: &mut W, data: &[u8]) -> Result<usize, CloseReason> {
    let mut off = 0;
    while off < data.len() {
        match w.write(&data[off..]) {
            Ok(0) => return Err(CloseReason::Error),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(close_reason(&e)),
        }
    }
    Ok(off)
}

/// What reading returned.
enum Read1 {
    Data(usize),
    Drained,
    Closed(CloseReason),
}

fn read_once<R: Read>(r: &mut R, buf: &mut [u8]) -> Read1 {
    loop {
        return match r.read(buf) {
            Ok(0) => Read1::Closed(CloseReason::Peer),
            Ok(n) => Read1::Data(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Read1::Drained,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => Read1::Closed(close_reason(&e)),
        };
    }
}

/// What a connection's socket does besides reading and writing.
pub trait Socket: Read + Write {
    /// Shuts the write side down: FIN after what was written. An error is
    /// ignored (a dead socket shows on the next read).
    fn shut_write(&mut self);
}

impl Socket for std::net::TcpStream {
    fn shut_write(&mut self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

impl<S: Socket> Conn<S> {
    /// A connection accepted at tick `now`, in `phase`.
    pub fn new(stream: S, phase: Phase, now: u32) -> Self {
        let mut c = Conn {
            stream,
            meta: now & TICK_MASK,
            extra: None,
        };
        c.set_phase(phase);
        c
    }

    /// The protocol phase.
    pub fn phase(&self) -> Phase {
        if self.meta & CLOSING_BIT != 0 {
            Phase::Closing
        } else if self.meta & HANDSHAKE_BIT != 0 {
            Phase::Handshake
        } else {
            Phase::Open
        }
    }

    /// Switches between the handshake and open phases ([`Phase::Closing`]
    /// is entered through [`Conn::begin_closing`] only, and never left).
    fn set_phase(&mut self, p: Phase) {
        match p {
            Phase::Handshake => self.meta |= HANDSHAKE_BIT,
            Phase::Open => self.meta &= !HANDSHAKE_BIT,
            Phase::Closing => debug_assert!(self.phase() == Phase::Closing),
        }
    }

    /// Tick of the last read (or of the accept, before any); in
    /// [`Phase::Closing`], of the closing's start modulo 128 (see
    /// [`Conn::closing_for`]).
    pub fn since(&self) -> u32 {
        if self.meta & CLOSING_BIT != 0 {
            self.meta & CLOSE_TICK_MASK
        } else {
            self.meta & TICK_MASK
        }
    }

    /// Seconds (ticks) the connection has been in [`Phase::Closing`] at
    /// tick `now`; `None` in the other phases.
    pub fn closing_for(&self, now: u32) -> Option<u32> {
        (self.meta & CLOSING_BIT != 0)
            .then(|| now.wrapping_sub(self.meta & CLOSE_TICK_MASK) & CLOSE_TICK_MASK)
    }

    /// Bytes read and discarded since the connection entered
    /// [`Phase::Closing`] (0 in the other phases).
    pub fn discarded(&self) -> u32 {
        if self.meta & CLOSING_BIT != 0 {
            (self.meta >> CLOSE_TICK_BITS) & DISCARD_MASK
        } else {
            0
        }
    }

    /// Counts `n` more bytes discarded while closing; `false` once the
    /// total passes [`CLOSE_DISCARD_BYTES`].
    fn discard(&mut self, n: usize) -> bool {
        let total = u64::from(self.discarded()) + n as u64;
        if total > u64::from(CLOSE_DISCARD_BYTES) {
            return false;
        }
        self.meta =
            CLOSING_BIT | (self.meta & CLOSE_TICK_MASK) | ((total as u32) << CLOSE_TICK_BITS);
        true
    }

    /// Records a read at tick `now`; any read answers a server ping.
    fn touch(&mut self, now: u32) {
        self.meta = (self.meta & !(TICK_MASK | PINGED_BIT)) | (now & TICK_MASK);
    }

    /// Whether a server ping was sent and nothing was read since.
    pub fn pinged(&self) -> bool {
        self.meta & (PINGED_BIT | CLOSING_BIT) == PINGED_BIT
    }

    /// Whether the connection is closing: in [`Phase::Closing`], or the
    /// answer to the peer's close is queued and it closes once that is
    /// written. No ping or other goodbye may follow either.
    pub fn closing(&self) -> bool {
        self.phase() == Phase::Closing
            || self
                .extra
                .as_deref()
                .is_some_and(|e| e.close_after.is_some())
    }

    /// Tick at which the unfinished frame this connection holds began to
    /// arrive; `None` if it holds no unfinished frame (upgrade requests are
    /// bounded by the handshake timeout instead).
    pub fn partial_since(&self) -> Option<u32> {
        match self.extra.as_deref() {
            Some(e) if !e.input.is_empty() && self.phase() == Phase::Open => Some(e.partial_since),
            _ => None,
        }
    }

    /// Bytes this connection holds for unfinished input, as charged to the
    /// worker's [`Budget`]: the worker releases them when it drops the
    /// connection.
    pub fn held(&self) -> usize {
        self.extra.as_deref().map_or(0, |e| e.input.capacity())
    }

    /// Whether the connection holds no state beyond its 16 bytes.
    pub fn is_idle(&self) -> bool {
        self.extra.is_none()
    }

    /// Bytes the kernel has not taken yet.
    pub fn unsent(&self) -> &[u8] {
        self.extra
            .as_deref()
            .map_or(&[], |e| &e.unsent[e.written..])
    }

    /// Whether a write is pending (the connection waits for writability).
    pub fn has_unsent(&self) -> bool {
        !self.unsent().is_empty()
    }

    fn extra(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    /// Drops `Extra` if nothing in it is needed any more.
    fn shrink(&mut self) {
        if self.extra.as_deref().is_some_and(Extra::is_empty) {
            self.extra = None;
        }
    }

    /// Tries to write the unsent bytes. Keeps only what is still unsent.
    fn flush_unsent(&mut self, t: &mut Traffic) -> Result<(), CloseReason> {
        let Some(e) = self.extra.as_deref_mut() else {
            return Ok(());
        };
        if e.written < e.unsent.len() {
            let n = write_some(&mut self.stream, &e.unsent[e.written..])?;
            t.sent += n as u64;
            e.written += n;
        }
        if e.written == e.unsent.len() {
            e.unsent = Vec::new();
            e.written = 0;
        }
        Ok(())
    }

    /// Writes `out` (then clears it); what the kernel does not take is kept.
    fn send(&mut self, out: &mut Vec<u8>, t: &mut Traffic) -> Result<(), CloseReason> {
        if out.is_empty() {
            return Ok(());
        }
        if self.has_unsent() {
            self.extra().unsent.extend_from_slice(out);
            out.clear();
            return Ok(());
        }
        let w = write_some(&mut self.stream, out);
        let w = match w {
            Ok(w) => w,
            Err(r) => {
                out.clear();
                return Err(r);
            }
        };
        t.sent += w as u64;
        if w < out.len() {
            let e = self.extra();
            e.unsent = out[w..].to_vec();
            e.written = 0;
        }
        out.clear();
        Ok(())
    }

    /// Flushes pending bytes; `Some(status)` if the caller must stop there
    /// (still blocked, or a queued close is now due).
    fn resume(&mut self, t: &mut Traffic) -> Option<Status> {
        if let Err(r) = self.flush_unsent(t) {
            return Some(Status::Closed(r));
        }
        if self.has_unsent() {
            return Some(Status::Blocked);
        }
        if let Some(r) = self.extra.as_deref().and_then(|e| e.close_after) {
            return Some(Status::Closed(r));
        }
        None
    }

    /// Echo: every byte read is written back. Reads until `WouldBlock`
    /// (edge-triggered readiness); if a write cannot finish, only its unsent
    /// tail is kept and reading stops until the socket is writable again.
    pub fn echo(&mut self, ctx: &mut Ctx<'_>) -> Status {
        if let Some(s) = self.resume(&mut ctx.traffic) {
            return s;
        }
        for _ in 0..READ_BUDGET {
            match read_once(&mut self.stream, ctx.scratch) {
                Read1::Closed(r) => return Status::Closed(r),
                Read1::Drained => {
                    self.shrink();
                    return Status::Idle;
                }
                Read1::Data(n) => {
                    ctx.traffic.received += n as u64;
                    self.touch(ctx.now);
                    let chunk = &ctx.scratch[..n];
                    match write_some(&mut self.stream, chunk) {
                        Ok(w) => {
                            ctx.traffic.sent += w as u64;
                            if w < n {
                                let e = self.extra();
                                e.unsent = chunk[w..].to_vec();
                                e.written = 0;
                                return Status::Blocked;
                            }
                        }
                        Err(r) => return Status::Closed(r),
                    }
                }
            }
        }
        Status::Busy
    }

    /// WebSocket: the upgrade handshake, then frames (see [`ws::process`]).
    /// Incomplete requests and frames are kept in `Extra` until the rest
    /// arrives; replies are written at once, their unsent tail kept. A
    /// goodbye of the server's (close frame or HTTP error answer) enters
    /// [`Phase::Closing`] ([`Status::Closing`]), which [`Conn::linger`]
    /// carries on.
    pub fn websocket(&mut self, ctx: &mut Ctx<'_>) -> Status {
        if self.phase() == Phase::Closing {
            return self.linger(ctx);
        }
        if let Some(s) = self.resume(&mut ctx.traffic) {
            return s;
        }
        for _ in 0..READ_BUDGET {
            let n = match read_once(&mut self.stream, ctx.scratch) {
                Read1::Closed(r) => return Status::Closed(r),
                Read1::Drained => {
                    self.shrink();
                    return Status::Idle;
                }
                Read1::Data(n) => n,
            };
            ctx.traffic.received += n as u64;
            let closing = self.consume(n, ctx);
            // The timestamp of a connection still in its handshake stays at
            // its accept, so a slowloris trickle cannot extend the timeout.
            if self.phase() == Phase::Open {
                self.touch(ctx.now);
            }
            if let Err(r) = self.send(ctx.out, &mut ctx.traffic) {
                return Status::Closed(r);
            }
            match closing {
                // The peer's close is answered: close once that is written.
                Some(CloseReason::Peer) if self.has_unsent() => {
                    self.extra().close_after = Some(CloseReason::Peer);
                    return Status::Blocked;
                }
                Some(CloseReason::Peer) => return Status::Closed(CloseReason::Peer),
                // The server's goodbye is queued: wait for the peer's close.
                Some(r) => {
                    self.begin_closing(ctx.now, ctx.budget);
                    return Status::Closing(r);
                }
                None => {}
            }
            if self.has_unsent() {
                return Status::Blocked;
            }
        }
        Status::Busy
    }

    /// [`Phase::Closing`]: writes what is left of the goodbye, half-closes
    /// once it is out, and reads and discards until the peer closes its
    /// side (`Closed(Peer)`), an error, or more than
    /// [`CLOSE_DISCARD_BYTES`] (`Closed(Error)`; the worker closes the
    /// socket either way and counts nothing more: the close was counted
    /// when it began). Reads go on while the goodbye waits for the kernel:
    /// a peer blocked writing to us reads our close only once we read.
    fn linger(&mut self, ctx: &mut Ctx<'_>) -> Status {
        if self.extra.is_some() {
            if let Err(r) = self.flush_unsent(&mut ctx.traffic) {
                return Status::Closed(r);
            }
            if !self.has_unsent() {
                self.extra = None;
                self.stream.shut_write();
            }
        }
        for _ in 0..READ_BUDGET {
            match read_once(&mut self.stream, ctx.scratch) {
                Read1::Closed(r) => return Status::Closed(r),
                Read1::Drained if self.has_unsent() => return Status::Blocked,
                Read1::Drained => return Status::Idle,
                Read1::Data(n) => {
                    ctx.traffic.received += n as u64;
                    if !self.discard(n) {
                        return Status::Closed(CloseReason::Error);
                    }
                }
            }
        }
        Status::Busy
    }

    /// Enters [`Phase::Closing`] at tick `now`, its goodbye already sent or
    /// queued: what the connection held for unfinished input is released
    /// (to `budget`) and dropped, and so is `Extra` unless the goodbye is
    /// still being written; once it is out, the write side is shut (FIN).
    fn begin_closing(&mut self, now: u32, budget: &mut Budget) {
        budget.release(self.held());
        self.meta = CLOSING_BIT | (now & CLOSE_TICK_MASK);
        if self.has_unsent() {
            let e = self.extra();
            e.input = Vec::new();
            e.msg = ws::Message::default();
            e.close_after = None;
        } else {
            self.extra = None;
            self.stream.shut_write();
        }
    }

    /// The server's own goodbye to an open WebSocket (drain, shed,
    /// timeouts): sends a close frame with `code` (what the kernel does not
    /// take is kept) and enters [`Phase::Closing`], releasing what the
    /// connection held to `budget`. An error means the connection is dead:
    /// the caller closes it. The caller waits for writability if
    /// [`Conn::has_unsent`], and drives it soon (bytes may be waiting).
    pub fn start_close(
        &mut self,
        code: u16,
        out: &mut Vec<u8>,
        t: &mut Traffic,
        now: u32,
        budget: &mut Budget,
    ) -> Result<(), CloseReason> {
        debug_assert!(self.phase() == Phase::Open && !self.closing());
        ws::write_close(out, code);
        self.send(out, t)?;
        self.begin_closing(now, budget);
        Ok(())
    }

    /// Runs the protocol over the held input plus the `n` new bytes in
    /// `ctx.scratch`, appending replies to `ctx.out`; holds what is left of
    /// an unfinished frame or request, charged to `ctx.budget`. Returns a
    /// close reason if the connection ends.
    ///
    /// The held buffer grows in place (doubling, up to the unfinished
    /// frame's size) while the budget allows. When it does not, the held
    /// bytes and the new ones are joined in the worker's `ctx.join` buffer
    /// instead: a frame that completes there costs nothing held, and only a
    /// connection that would then hold more than before is closed
    /// ([`CloseReason::Budget`]).
    fn consume(&mut self, n: usize, ctx: &mut Ctx<'_>) -> Option<CloseReason> {
        let mut phase = self.phase();
        let (mut msg, mut kept, since) = match self.extra.as_deref_mut() {
            Some(e) => (e.msg, std::mem::take(&mut e.input), e.partial_since),
            None => (ws::Message::default(), Vec::new(), ctx.now),
        };
        let held = kept.capacity();
        let fresh = &ctx.scratch[..n];
        let max_frame = ctx.max_frame;
        let mut joined = false;
        if !kept.is_empty() {
            let need = kept.len() + n;
            if need > kept.capacity() {
                let target = need.max(
                    kept.capacity()
                        .saturating_mul(2)
                        .min(grow_limit(phase, &kept, max_frame)),
                );
                if ctx.budget.allows(held, target) {
                    kept.reserve_exact(target - kept.len());
                } else {
                    ctx.join.clear();
                    ctx.join.extend_from_slice(&kept);
                    joined = true;
                }
            }
            if joined {
                ctx.join.extend_from_slice(fresh);
            } else {
                kept.extend_from_slice(fresh);
            }
        }
        // Where the bytes to run are: the held buffer (grown), the join
        // buffer, or (nothing held) the read itself.
        let in_kept = !joined && !kept.is_empty();
        let input: &[u8] = if joined {
            ctx.join
        } else if in_kept {
            &kept
        } else {
            fresh
        };
        let (consumed, closing) = step(
            &mut phase,
            &mut msg,
            input,
            ctx.out,
            max_frame,
            ctx.subprotocols,
        );
        self.set_phase(phase);
        if closing.is_some() {
            ctx.budget.release(held);
            return closing;
        }
        let rest = input.len() - consumed;
        // The unfinished frame (or request) at the start of what is left is
        // the one held before if nothing was consumed; else it began with
        // this read.
        let started = if consumed == 0 && held > 0 {
            since
        } else {
            ctx.now
        };
        let leftover = if rest == 0 {
            Vec::new()
        } else if in_kept && (kept.capacity() <= SHRINK_ABOVE || kept.capacity() <= 2 * rest) {
            // Keep the grown buffer: it still fits what is left.
            kept.drain(..consumed);
            kept
        } else if joined && rest <= held {
            // The old buffer holds what is left: no new charge.
            kept.clear();
            kept.extend_from_slice(&ctx.join[consumed..]);
            kept
        } else if ctx.budget.allows(held, rest) {
            let from: &[u8] = if joined {
                ctx.join
            } else if in_kept {
                &kept
            } else {
                fresh
            };
            from[consumed..].to_vec()
        } else {
            ctx.budget.release(held);
            over_budget(phase, ctx.out);
            return Some(CloseReason::Budget);
        };
        ctx.budget.charge(held, leftover.capacity());
        if !leftover.is_empty() || !msg.is_idle() {
            let e = self.extra();
            e.input = leftover;
            e.msg = msg;
            e.partial_since = started;
        } else if let Some(e) = self.extra.as_deref_mut() {
            e.msg = msg;
        }
        None
    }

    /// Sends a server ping (empty payload) and marks the connection as
    /// pinged until its next read. Like any reply, what the kernel does not
    /// take is kept; the caller waits for writability if
    /// [`Conn::has_unsent`] says so.
    pub fn ping(&mut self, out: &mut Vec<u8>, t: &mut Traffic) -> Result<(), CloseReason> {
        ws::write_header(out, true, ws::opcode::PING, 0);
        self.meta |= PINGED_BIT;
        self.send(out, t)
    }

    /// Queues a protocol goodbye (WebSocket close with the status for
    /// `reason` once upgraded, see [`CloseReason::ws_code`]; nothing for
    /// echo) and tries to write it, best effort: the caller shuts the socket
    /// down and drops it next, without waiting for the peer's close (the
    /// drain deadline; [`Conn::start_close`] waits).
    pub fn goodbye(
        &mut self,
        websocket: bool,
        reason: CloseReason,
        out: &mut Vec<u8>,
        t: &mut Traffic,
    ) {
        if websocket && self.phase() == Phase::Open {
            ws::write_close(out, reason.ws_code());
            let _ = self.send(out, t);
        }
        out.clear();
    }
}

/// The most a held buffer grows to by doubling: the size of the unfinished
/// frame it starts with when its header has arrived (a largest frame plus
/// its header at most), the request head limit during the upgrade.
fn grow_limit(phase: Phase, kept: &[u8], max_frame: usize) -> usize {
    match phase {
        Phase::Handshake => ws::MAX_HANDSHAKE_BYTES,
        Phase::Open => match ws::parse_header(kept) {
            Ok(Some(h)) => h
                .header_len
                .saturating_add(usize::try_from(h.len).unwrap_or(usize::MAX))
                .min(max_frame.saturating_add(ws::MAX_HEADER_BYTES)),
            _ => ws::MAX_HEADER_BYTES,
        },
        // A closing connection holds no input (it runs no protocol).
        Phase::Closing => 0,
    }
}

/// Appends the answer to a connection the budget cannot hold: 503 during
/// the upgrade, close 1013 ("try again later") after it.
fn over_budget(phase: Phase, out: &mut Vec<u8>) {
    match phase {
        Phase::Handshake => out.extend_from_slice(ws::BUSY_RESPONSE),
        Phase::Open => ws::write_close(out, ws::code::TRY_AGAIN_LATER),
        Phase::Closing => {}
    }
}

/// Runs the handshake or the frame processor over `buf`. Returns the bytes
/// consumed and a close reason if the connection ends.
fn step(
    phase: &mut Phase,
    msg: &mut ws::Message,
    buf: &[u8],
    out: &mut Vec<u8>,
    max_frame: usize,
    subprotocols: &ws::Subprotocols,
) -> (usize, Option<CloseReason>) {
    let mut start = 0;
    if *phase == Phase::Handshake {
        match ws::handshake_with(buf, subprotocols) {
            ws::Handshake::Partial => return (0, None),
            ws::Handshake::Reject { response } => {
                out.extend_from_slice(&response);
                return (buf.len(), Some(CloseReason::BadHandshake));
            }
            ws::Handshake::Accept { response, consumed } => {
                out.extend_from_slice(&response);
                *phase = Phase::Open;
                start = consumed;
            }
        }
    }
    let (c, outcome) = ws::process(&buf[start..], msg, out, max_frame);
    let reason = match outcome {
        ws::Outcome::Continue => None,
        ws::Outcome::Closed => Some(CloseReason::Peer),
        ws::Outcome::Fail(ws::code::TOO_BIG) => Some(CloseReason::TooLarge),
        ws::Outcome::Fail(_) => Some(CloseReason::ProtocolError),
    };
    (start + c, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A fake non-blocking socket: scripted reads, a write window that
    /// accepts a given number of bytes before `WouldBlock`.
    #[derive(Default)]
    struct Fake {
        reads: VecDeque<io::Result<Vec<u8>>>,
        written: Vec<u8>,
        window: usize,
        write_err: Option<ErrorKind>,
        /// The write side was shut down, after `written` bytes.
        shut: Option<usize>,
    }

    impl Socket for Fake {
        fn shut_write(&mut self) {
            assert!(self.shut.is_none(), "shut down twice");
            self.shut = Some(self.written.len());
        }
    }

    impl Read for Fake {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            match self.reads.pop_front() {
                None => Err(ErrorKind::WouldBlock.into()),
                Some(Err(e)) => Err(e),
                Some(Ok(mut d)) => {
                    let n = d.len().min(buf.len());
                    buf[..n].copy_from_slice(&d[..n]);
                    if n < d.len() {
                        self.reads.push_front(Ok(d.split_off(n)));
                    }
                    Ok(n)
                }
            }
        }
    }

    impl Write for Fake {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            assert!(self.shut.is_none(), "write after the write side was shut");
            if let Some(k) = self.write_err {
                return Err(k.into());
            }
            if self.window == 0 {
                return Err(ErrorKind::WouldBlock.into());
            }
            // Accept at most 3 bytes per call to exercise the write loop.
            let n = buf.len().min(self.window).min(3);
            self.written.extend_from_slice(&buf[..n]);
            self.window -= n;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn fake(reads: &[&[u8]], window: usize, phase: Phase) -> Conn<Fake> {
        Conn::new(
            Fake {
                reads: reads.iter().map(|r| Ok(r.to_vec())).collect(),
                window,
                ..Fake::default()
            },
            phase,
            7,
        )
    }

    struct Bufs {
        scratch: Vec<u8>,
        out: Vec<u8>,
        join: Vec<u8>,
        budget: Budget,
        subprotocols: ws::Subprotocols,
        now: u32,
    }

    impl Bufs {
        fn new(scratch: usize) -> Self {
            Bufs {
                scratch: vec![0; scratch],
                out: Vec::new(),
                join: Vec::new(),
                budget: Budget::new(1 << 20),
                subprotocols: ws::Subprotocols::default(),
                now: 9,
            }
        }
        fn ctx(&mut self) -> Ctx<'_> {
            Ctx {
                scratch: &mut self.scratch,
                out: &mut self.out,
                join: &mut self.join,
                budget: &mut self.budget,
                max_frame: 1024,
                subprotocols: &self.subprotocols,
                now: self.now,
                traffic: Traffic::default(),
            }
        }
    }

    #[test]
    fn conn_is_small() {
        // A 4-byte fd, a 4-byte packed word and a nullable pointer.
        assert_eq!(std::mem::size_of::<Conn<std::net::TcpStream>>(), 16);
        // The descriptor's niche (never -1) holds an enum's discriminant, so
        // wrapping it (as the slab's vacant/occupied entry does) adds nothing.
        assert_eq!(std::mem::size_of::<Option<Conn<std::net::TcpStream>>>(), 16);
    }

    #[test]
    fn packed_word_keeps_phase_and_tick() {
        let mut c = fake(&[], 0, Phase::Handshake);
        assert_eq!((c.phase(), c.since()), (Phase::Handshake, 7));
        c.touch(TICK_MASK);
        assert_eq!((c.phase(), c.since()), (Phase::Handshake, TICK_MASK));
        c.set_phase(Phase::Open);
        assert_eq!((c.phase(), c.since()), (Phase::Open, TICK_MASK));
        c.touch(TICK_MASK + 5); // wraps within the tick bits
        assert_eq!((c.phase(), c.since()), (Phase::Open, 4));
    }

    #[test]
    fn echoes_everything_then_idles() {
        let mut c = fake(&[b"hello ", b"world"], usize::MAX, Phase::Open);
        let mut b = Bufs::new(4);
        let mut ctx = b.ctx();
        assert_eq!(c.echo(&mut ctx), Status::Idle);
        assert_eq!(
            ctx.traffic,
            Traffic {
                received: 11,
                sent: 11
            }
        );
        assert_eq!(c.stream.written, b"hello world");
        assert!(c.is_idle());
        assert_eq!(c.since(), 9);
    }

    #[test]
    fn a_flood_yields_after_the_read_budget_and_resumes() {
        let chunks: Vec<Vec<u8>> = (0..READ_BUDGET + 3).map(|i| vec![i as u8; 4]).collect();
        let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
        let mut c = fake(&refs, usize::MAX, Phase::Open);
        let mut b = Bufs::new(4);
        assert_eq!(c.echo(&mut b.ctx()), Status::Busy);
        assert_eq!(c.stream.written.len(), 4 * READ_BUDGET as usize);
        assert_eq!(c.stream.reads.len(), 3);
        assert_eq!(c.echo(&mut b.ctx()), Status::Idle);
        assert_eq!(c.stream.written, chunks.concat());
    }

    #[test]
    fn eof_closes_as_peer() {
        let mut c = fake(&[b"bye"], usize::MAX, Phase::Open);
        c.stream.reads.push_back(Ok(Vec::new()));
        let mut b = Bufs::new(64);
        assert_eq!(c.echo(&mut b.ctx()), Status::Closed(CloseReason::Peer));
        assert_eq!(c.stream.written, b"bye");
    }

    #[test]
    fn partial_write_keeps_only_unsent_bytes_and_stops_reading() {
        let mut c = fake(&[b"0123456789", b"later"], 4, Phase::Open);
        let mut b = Bufs::new(64);
        let mut ctx = b.ctx();
        assert_eq!(c.echo(&mut ctx), Status::Blocked);
        assert_eq!(c.stream.written, b"0123");
        assert_eq!(c.unsent(), b"456789");
        assert_eq!(c.stream.reads.len(), 1, "read on while blocked");
        assert_eq!((ctx.traffic.received, ctx.traffic.sent), (10, 4));

        assert_eq!(c.echo(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.unsent(), b"456789");
        c.stream.window = 2;
        assert_eq!(c.echo(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.unsent(), b"6789");
        c.stream.window = usize::MAX;
        assert_eq!(c.echo(&mut b.ctx()), Status::Idle);
        assert!(c.is_idle());
        assert_eq!(c.stream.written, b"0123456789later");
    }

    #[test]
    fn errors_map_to_reasons() {
        let mut b = Bufs::new(8);
        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.stream
            .reads
            .push_back(Err(ErrorKind::ConnectionReset.into()));
        assert_eq!(c.echo(&mut b.ctx()), Status::Closed(CloseReason::Reset));

        let mut c = fake(&[b"x"], usize::MAX, Phase::Open);
        c.stream.write_err = Some(ErrorKind::BrokenPipe);
        assert_eq!(c.echo(&mut b.ctx()), Status::Closed(CloseReason::Reset));

        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.stream.reads.push_back(Err(ErrorKind::Interrupted.into()));
        c.stream.reads.push_back(Ok(b"ok".to_vec()));
        c.stream
            .reads
            .push_back(Err(ErrorKind::PermissionDenied.into()));
        assert_eq!(c.echo(&mut b.ctx()), Status::Closed(CloseReason::Error));
        assert_eq!(c.stream.written, b"ok");
    }

    const UPGRADE: &[u8] =
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    const M: [u8; 4] = [1, 2, 3, 4];

    fn response_len() -> usize {
        match ws::handshake(UPGRADE) {
            ws::Handshake::Accept { response, .. } => response.len(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn websocket_upgrade_split_across_reads_then_frames_then_idle() {
        let frame = ws::client_frame(true, ws::opcode::TEXT, b"hi", M);
        let mut tail = UPGRADE[40..].to_vec();
        tail.extend_from_slice(&frame[..3]);
        let mut c = fake(&[&UPGRADE[..40], &tail], usize::MAX, Phase::Handshake);
        let mut b = Bufs::new(16);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.phase(), Phase::Open);
        assert!(!c.is_idle(), "half a frame is kept");
        assert_eq!(c.stream.written.len(), response_len());
        assert!(c.stream.written.starts_with(b"HTTP/1.1 101 "));

        c.stream.reads.push_back(Ok(frame[3..].to_vec()));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert!(c.is_idle(), "nothing held once the frame completed");
        assert_eq!(&c.stream.written[response_len()..], b"\x81\x02hi");
        assert!(b.out.is_empty());
    }

    #[test]
    fn trickled_handshake_keeps_its_accept_timestamp() {
        let mut c = fake(
            &[b"GET / HTTP/1.1\r\n", b"Ho"],
            usize::MAX,
            Phase::Handshake,
        );
        let mut b = Bufs::new(64);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!((c.phase(), c.since()), (Phase::Handshake, 7));
        let mut c2 = fake(&[UPGRADE], usize::MAX, Phase::Handshake);
        assert_eq!(c2.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!((c2.phase(), c2.since()), (Phase::Open, 9));
    }

    #[test]
    fn websocket_fragmented_message_holds_state_until_final_frame() {
        let mut first = UPGRADE.to_vec();
        first.extend(ws::client_frame(false, ws::opcode::TEXT, b"a", M));
        let mut c = fake(&[&first], usize::MAX, Phase::Handshake);
        let mut b = Bufs::new(4096);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert!(!c.is_idle());
        let fin = ws::client_frame(true, ws::opcode::CONTINUATION, b"b", M);
        c.stream.reads.push_back(Ok(fin));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert!(c.is_idle());
        assert_eq!(&c.stream.written[response_len()..], b"\x01\x01a\x80\x01b");
    }

    #[test]
    fn websocket_close_and_errors_flush_then_close() {
        let mut input = UPGRADE.to_vec();
        input.extend(ws::client_frame(
            true,
            ws::opcode::CLOSE,
            &1000u16.to_be_bytes(),
            M,
        ));
        let mut c = fake(&[&input], usize::MAX, Phase::Handshake);
        let mut b = Bufs::new(4096);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Closed(CloseReason::Peer));
        assert!(c.stream.written.ends_with(&[0x88, 2, 0x03, 0xe8]));
        assert_eq!(c.stream.shut, None, "the peer's close: closed at once");

        // The upgrade does not fit: blocked first; once it is out the
        // oversize frame is read: 1009, and the server's close begins.
        let big = ws::client_frame(true, ws::opcode::BINARY, &[9; 2000], M);
        let mut c = fake(&[UPGRADE, &big], 0, Phase::Handshake);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.unsent().len(), response_len());
        c.stream.window = usize::MAX;
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closing(CloseReason::TooLarge)
        );
        assert!(c.stream.written.ends_with(&[0x88, 2, 0x03, 0xf1]));
        assert_eq!(c.phase(), Phase::Closing);
        assert_eq!(
            c.stream.shut,
            Some(c.stream.written.len()),
            "FIN after the close"
        );
        assert!(c.is_idle(), "nothing held while closing");
        // The rest of the frame is read and discarded; the peer's EOF ends it.
        c.stream
            .reads
            .push_back(Ok(big[big.len() - 1000..].to_vec()));
        c.stream.reads.push_back(Ok(Vec::new()));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Closed(CloseReason::Peer));
        assert_eq!(c.discarded(), 1000);

        // An HTTP error answer waits for the peer's close the same way.
        let mut c = fake(&[b"GET / HTTP/1.1\r\n\r\n"], 3, Phase::Handshake);
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closing(CloseReason::BadHandshake)
        );
        assert_eq!((c.phase(), c.stream.shut), (Phase::Closing, None));
        assert!(c.has_unsent());
        c.stream.window = usize::MAX;
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert!(c.stream.written.starts_with(b"HTTP/1.1 400 "));
        assert_eq!(c.stream.shut, Some(c.stream.written.len()));
        assert!(c.is_idle());
    }

    #[test]
    fn goodbye_sends_1001_only_to_open_websockets() {
        let mut b = Bufs::new(8);
        let mut t = Traffic::default();
        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.goodbye(true, CloseReason::Shutdown, &mut b.out, &mut t);
        assert_eq!(c.stream.written, [0x88, 2, 0x03, 0xe9]);
        let mut c = fake(&[], usize::MAX, Phase::Handshake);
        c.goodbye(true, CloseReason::Shutdown, &mut b.out, &mut t);
        assert!(c.stream.written.is_empty());
        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.goodbye(false, CloseReason::Shutdown, &mut b.out, &mut t);
        assert!(c.stream.written.is_empty());
        assert!(b.out.is_empty());
        // Timeouts name themselves: 1008 for a frame past its deadline,
        // 1011 for an unanswered ping.
        for (reason, code) in [
            (CloseReason::FrameTimeout, 1008u16),
            (CloseReason::PingTimeout, 1011),
            (CloseReason::Shed, 1001),
            (CloseReason::IdleTimeout, 1001),
        ] {
            let mut c = fake(&[], usize::MAX, Phase::Open);
            c.goodbye(true, reason, &mut b.out, &mut t);
            let mut want = vec![0x88, 2];
            want.extend_from_slice(&code.to_be_bytes());
            assert_eq!(c.stream.written, want, "{reason:?}");
        }
    }

    /// An upgraded connection (the 101 already written and cleared).
    fn open(reads: &[&[u8]]) -> Conn<Fake> {
        fake(reads, usize::MAX, Phase::Open)
    }

    #[test]
    fn a_partial_frame_is_charged_while_held_and_released_when_done() {
        let frame = ws::client_frame(true, ws::opcode::BINARY, &[5; 600], M);
        let mut c = open(&[&frame[..100]]);
        let mut b = Bufs::new(4096);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.held(), 100, "exactly what is held");
        assert_eq!(b.budget.used, 100);
        assert_eq!(c.partial_since(), Some(9));
        // More of the same frame, later: the buffer grows by doubling (up
        // to the frame's size), the frame keeps its start time.
        b.now = 12;
        c.stream.reads.push_back(Ok(frame[100..300].to_vec()));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.held(), 300);
        assert_eq!(b.budget.used, 300);
        assert_eq!(c.partial_since(), Some(9), "a trickle does not extend it");
        c.stream.reads.push_back(Ok(frame[300..].to_vec()));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!((c.held(), b.budget.used), (0, 0));
        assert!(c.is_idle());
        assert_eq!(c.partial_since(), None);
        assert_eq!(c.stream.written.len(), 600 + 4);
    }

    #[test]
    fn growth_stops_at_the_frame_size() {
        let frame = ws::client_frame(true, ws::opcode::BINARY, &[5; 1000], M);
        let mut c = open(&[&frame[..600], &frame[600..700]]);
        let mut b = Bufs::new(600);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        // 600, then 700 needed: doubling would give 1200, the frame is 1008.
        assert_eq!(c.held(), frame.len());
        assert_eq!(b.budget.used, frame.len());
    }

    #[test]
    fn a_new_frame_restarts_the_clock_and_a_finished_big_one_is_not_kept() {
        let big = ws::client_frame(true, ws::opcode::BINARY, &[1; 1024], M);
        let next = ws::client_frame(true, ws::opcode::TEXT, b"hello", M);
        let mut c = open(&[&big[..1028]]);
        let mut b = Bufs::new(2048);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.partial_since(), Some(9));
        b.now = 15;
        let mut tail = big[1028..].to_vec();
        tail.extend_from_slice(&next[..3]);
        c.stream.reads.push_back(Ok(tail));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.partial_since(), Some(15), "the next frame began at 15");
        // 3 bytes left of a 1 KiB buffer: copied to a small one.
        assert_eq!((c.held(), b.budget.used), (3, 3));
    }

    #[test]
    fn over_budget_closes_with_1013_after_the_upgrade_and_503_before() {
        let frame = ws::client_frame(true, ws::opcode::BINARY, &[5; 900], M);
        let mut b = Bufs::new(4096);
        b.budget = Budget::new(1000);
        let mut first = open(&[&frame[..600]]);
        assert_eq!(first.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(b.budget.used, 600);
        // A second connection may hold 400 more, not 500.
        let mut second = open(&[&frame[..500]]);
        assert_eq!(
            second.websocket(&mut b.ctx()),
            Status::Closing(CloseReason::Budget)
        );
        assert_eq!(second.stream.written, [0x88, 2, 0x03, 0xf5]);
        assert_eq!((second.held(), b.budget.used), (0, 600));
        // The first may not grow past the budget either: its next read
        // closes it, and what it held is released.
        first.stream.reads.push_back(Ok(frame[600..700].to_vec()));
        b.budget.used += 350; // others hold 350 now
        assert_eq!(
            first.websocket(&mut b.ctx()),
            Status::Closing(CloseReason::Budget)
        );
        assert_eq!((first.held(), b.budget.used), (0, 350));
        // Before the upgrade: 503 with Retry-After.
        b.budget = Budget::new(10);
        let mut c = fake(&[&UPGRADE[..40]], usize::MAX, Phase::Handshake);
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closing(CloseReason::Budget)
        );
        assert_eq!(c.stream.written, ws::BUSY_RESPONSE);
        assert_eq!(b.budget.used, 0);
    }

    #[test]
    fn a_frame_that_completes_needs_no_budget() {
        // The budget is spent by others: a held frame that this read
        // completes is joined in the worker's buffer, echoed and freed.
        let frame = ws::client_frame(true, ws::opcode::BINARY, &[5; 900], M);
        let mut b = Bufs::new(4096);
        b.budget = Budget::new(1000);
        let mut c = open(&[&frame[..100]]);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        b.budget.used = 1000;
        let mut rest = frame[100..].to_vec();
        let next = ws::client_frame(true, ws::opcode::TEXT, b"hi", M);
        rest.extend_from_slice(&next[..50.min(next.len() - 1)]);
        c.stream.reads.push_back(Ok(rest));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.stream.written.len(), 904);
        // What is left (part of the next frame) fits the old buffer.
        assert_eq!(c.held(), 100);
        assert_eq!(b.budget.used, 1000);
        assert!(b.join.capacity() >= frame.len());
    }

    #[test]
    fn ping_marks_until_the_next_read() {
        let mut c = open(&[]);
        let mut b = Bufs::new(64);
        let mut t = Traffic::default();
        assert!(!c.pinged());
        c.ping(&mut b.out, &mut t).unwrap();
        assert!(c.pinged());
        assert_eq!(c.stream.written, [0x89, 0]);
        assert_eq!((t.sent, c.since()), (2, 7));
        let pong = ws::client_frame(true, ws::opcode::PONG, b"", M);
        c.stream.reads.push_back(Ok(pong));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert!(!c.pinged());
        assert_eq!(c.since(), 9);
        // A ping the kernel does not take waits like any reply.
        let mut c = fake(&[], 1, Phase::Open);
        c.ping(&mut b.out, &mut t).unwrap();
        assert!(c.has_unsent());
        assert!(b.out.is_empty());
        assert!(!c.closing());
        // A close that is still being written makes the connection closing
        // (the worker sends no ping after it).
        let close = ws::client_frame(true, ws::opcode::CLOSE, &1000u16.to_be_bytes(), M);
        let mut c = fake(&[&close], 0, Phase::Open);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        assert!(c.closing());
    }

    #[test]
    fn the_closing_word_keeps_its_tick_and_counts_discarded_bytes() {
        let mut c = open(&[]);
        c.touch(200);
        c.meta |= PINGED_BIT;
        let mut budget = Budget::new(1 << 20);
        c.begin_closing(300, &mut budget);
        assert_eq!(c.phase(), Phase::Closing);
        assert!(!c.pinged() && c.closing());
        assert_eq!(c.partial_since(), None);
        assert_eq!((c.closing_for(300), c.closing_for(305)), (Some(0), Some(5)));
        // The tick is kept modulo 128: exact for any age the sweep lets live.
        assert_eq!(c.closing_for(300 + 62), Some(62));
        assert!(c.discard(64 * 1024));
        assert!(c.discard(CLOSE_DISCARD_BYTES as usize - 64 * 1024));
        assert_eq!(c.discarded(), CLOSE_DISCARD_BYTES);
        assert_eq!(
            c.phase(),
            Phase::Closing,
            "the count never reaches the flag"
        );
        assert_eq!(c.closing_for(310), Some(10), "nor the tick");
        assert!(!c.discard(1), "one byte over the bound");
        // An open connection counts nothing and has no closing age.
        let o = open(&[]);
        assert_eq!((o.closing_for(5), o.discarded()), (None, 0));
    }

    #[test]
    fn closing_discards_until_the_peer_closes_or_the_byte_bound() {
        // The server's goodbye (an order's 1001) to a connection holding
        // half a frame: what it held is released, FIN goes after the close.
        let frame = ws::client_frame(true, ws::opcode::BINARY, &[5; 600], M);
        let mut c = open(&[&frame[..100]]);
        let mut b = Bufs::new(64 * 1024);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(b.budget.used, 100);
        let mut t = Traffic::default();
        c.start_close(1001, &mut b.out, &mut t, 20, &mut b.budget)
            .unwrap();
        assert_eq!(c.stream.written, [0x88, 2, 0x03, 0xe9]);
        assert_eq!(c.stream.shut, Some(4));
        assert_eq!((c.held(), b.budget.used, c.is_idle()), (0, 0, true));
        assert!(b.out.is_empty());
        // Frames, a ping, the close answer: all discarded, nothing answered.
        let mut more = frame[100..].to_vec();
        more.extend(ws::client_frame(true, ws::opcode::PING, b"p", M));
        more.extend(ws::client_frame(
            true,
            ws::opcode::CLOSE,
            &1001u16.to_be_bytes(),
            M,
        ));
        let n = more.len();
        c.stream.reads.push_back(Ok(more));
        let mut ctx = b.ctx();
        assert_eq!(c.websocket(&mut ctx), Status::Idle);
        assert_eq!((ctx.traffic.received, ctx.traffic.sent), (n as u64, 0));
        assert_eq!(c.stream.written.len(), 4);
        assert_eq!(c.discarded(), n as u32);
        c.stream.reads.push_back(Ok(Vec::new()));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Closed(CloseReason::Peer));

        // A flood: yields after the read budget like any connection, and
        // is cut off once it passes the bound.
        let mut c = open(&[]);
        c.start_close(1001, &mut b.out, &mut t, 20, &mut b.budget)
            .unwrap();
        let chunk = vec![0u8; 64 * 1024];
        for _ in 0..(CLOSE_DISCARD_BYTES as usize / chunk.len() + 1) {
            c.stream.reads.push_back(Ok(chunk.clone()));
        }
        let mut rounds = 0;
        let end = loop {
            rounds += 1;
            match c.websocket(&mut b.ctx()) {
                Status::Busy => continue,
                other => break other,
            }
        };
        assert_eq!(end, Status::Closed(CloseReason::Error));
        assert_eq!(c.discarded(), CLOSE_DISCARD_BYTES);
        assert_eq!(rounds, CLOSE_DISCARD_BYTES / (64 * 1024 * READ_BUDGET) + 1);
        // A reset while closing ends it too.
        let mut c = open(&[]);
        c.start_close(1001, &mut b.out, &mut t, 20, &mut b.budget)
            .unwrap();
        c.stream
            .reads
            .push_back(Err(ErrorKind::ConnectionReset.into()));
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closed(CloseReason::Reset)
        );
    }

    #[test]
    fn a_blocked_goodbye_keeps_reading_and_shuts_down_once_written() {
        // The peer is not reading: the close frame waits behind an unsent
        // echo. Reads go on (discarded), so a peer blocked writing to us
        // gets unstuck and reads the close; FIN only once it is all out.
        let mut c = fake(&[], 0, Phase::Open);
        let mut b = Bufs::new(4096);
        let mut t = Traffic::default();
        b.out.extend_from_slice(b"unsent echo");
        c.send(&mut b.out, &mut t).unwrap();
        assert!(c.has_unsent());
        c.start_close(1009, &mut b.out, &mut t, 3, &mut b.budget)
            .unwrap();
        assert_eq!((c.phase(), c.stream.shut), (Phase::Closing, None));
        assert_eq!(c.unsent().len(), 11 + 4);
        c.stream.reads.push_back(Ok(vec![1; 3000]));
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.discarded(), 3000);
        c.stream.window = 5;
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.stream.shut, None);
        c.stream.window = usize::MAX;
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        assert_eq!(c.stream.written, b"unsent echo\x88\x02\x03\xf1");
        assert_eq!(c.stream.shut, Some(15));
        assert!(c.is_idle());
    }

    #[test]
    fn subprotocols_reach_the_upgrade() {
        let offer = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
Sec-WebSocket-Protocol: mqtt, chat\r\n\r\n";
        let mut c = fake(&[offer], usize::MAX, Phase::Handshake);
        let mut b = Bufs::new(4096);
        b.subprotocols = ws::Subprotocols::parse("chat").unwrap();
        assert_eq!(c.websocket(&mut b.ctx()), Status::Idle);
        let r = String::from_utf8(c.stream.written.clone()).unwrap();
        assert!(r.contains("\r\nSec-WebSocket-Protocol: chat\r\n"), "{r}");
    }

    #[test]
    fn kernel_timeouts_close_as_unreachable() {
        for kind in [
            ErrorKind::TimedOut,
            ErrorKind::HostUnreachable,
            ErrorKind::NetworkUnreachable,
            ErrorKind::NetworkDown,
        ] {
            let mut c = open(&[]);
            c.stream.reads.push_back(Err(kind.into()));
            let mut b = Bufs::new(8);
            assert_eq!(
                c.websocket(&mut b.ctx()),
                Status::Closed(CloseReason::Unreachable),
                "{kind:?}"
            );
        }
    }
}
