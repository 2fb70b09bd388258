//! Per-connection state and the two protocol pumps (echo, WebSocket).
//!
//! A connection is one slab entry of 16 bytes on 64-bit Linux: the socket's
//! descriptor (4 B), a packed word holding its phase and a coarse timestamp
//! (4 B), and one nullable pointer (8 B) to [`Extra`], which exists only
//! while the connection is mid-something: a write the kernel did not take,
//! an incomplete WebSocket frame or upgrade request, a fragmented message in
//! flight. An idle connection holds no buffer at all; reads go through one
//! scratch buffer owned by the worker and replies are built in one output
//! buffer owned by the worker. The kernel spends ~3.9 KiB on the socket
//! itself [measured, `shared/KERNEL_FACTS.md`].

use std::io::{self, ErrorKind, Read, Write};

use crate::ws;

/// Bits of [`Conn`]'s packed word that hold the timestamp (seconds since the
/// worker started): 2^28 s is 8.5 years, so it never wraps in practice.
pub const TICK_BITS: u32 = 28;
const TICK_MASK: u32 = (1 << TICK_BITS) - 1;

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
}

impl CloseReason {
    /// Every reason, in label order.
    pub const ALL: [CloseReason; 10] = [
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
    /// Close once `unsent` is flushed (a goodbye or error reply is queued).
    close_after: Option<CloseReason>,
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
    /// Phase in the top bits, timestamp (ticks) in the low [`TICK_BITS`].
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
}

/// Per-worker buffers and limits a pump works with.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// Read buffer shared by all of the worker's connections.
    pub scratch: &'a mut [u8],
    /// Output buffer shared by all of the worker's connections; a pump
    /// leaves it empty.
    pub out: &'a mut Vec<u8>,
    /// Largest WebSocket frame payload accepted, in bytes.
    pub max_frame: usize,
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

impl<S: Read + Write> Conn<S> {
    /// A connection accepted at tick `now`, in `phase`.
    pub fn new(stream: S, phase: Phase, now: u32) -> Self {
        Conn {
            stream,
            meta: ((phase as u32) << TICK_BITS) | (now & TICK_MASK),
            extra: None,
        }
    }

    /// The protocol phase.
    pub fn phase(&self) -> Phase {
        if self.meta >> TICK_BITS == Phase::Handshake as u32 {
            Phase::Handshake
        } else {
            Phase::Open
        }
    }

    fn set_phase(&mut self, p: Phase) {
        self.meta = ((p as u32) << TICK_BITS) | (self.meta & TICK_MASK);
    }

    /// Tick of the last read (or of the accept, before any).
    pub fn since(&self) -> u32 {
        self.meta & TICK_MASK
    }

    fn touch(&mut self, now: u32) {
        self.meta = (self.meta & !TICK_MASK) | (now & TICK_MASK);
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
    /// arrives; replies are written at once, their unsent tail kept.
    pub fn websocket(&mut self, ctx: &mut Ctx<'_>) -> Status {
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
            if let Some(r) = closing {
                if self.has_unsent() {
                    self.extra().close_after = Some(r);
                    return Status::Blocked;
                }
                return Status::Closed(r);
            }
            if self.has_unsent() {
                return Status::Blocked;
            }
        }
        Status::Busy
    }

    /// Runs the protocol over the kept input plus the `n` new bytes in
    /// `ctx.scratch`, appending replies to `ctx.out`; keeps what is left of
    /// an incomplete frame. Returns a close reason if the connection ends.
    fn consume(&mut self, n: usize, ctx: &mut Ctx<'_>) -> Option<CloseReason> {
        let mut phase = self.phase();
        let mut msg = self.extra.as_deref().map(|e| e.msg).unwrap_or_default();
        let kept = self
            .extra
            .as_deref_mut()
            .map(|e| std::mem::take(&mut e.input));
        let (consumed, closing, mut buf) = match kept {
            Some(mut input) if !input.is_empty() => {
                input.extend_from_slice(&ctx.scratch[..n]);
                let (c, r) = step(&mut phase, &mut msg, &input, ctx.out, ctx.max_frame);
                (c, r, Some(input))
            }
            _ => {
                let (c, r) = step(
                    &mut phase,
                    &mut msg,
                    &ctx.scratch[..n],
                    ctx.out,
                    ctx.max_frame,
                );
                (c, r, None)
            }
        };
        self.set_phase(phase);
        if closing.is_some() {
            return closing;
        }
        let leftover: Vec<u8> = match buf.as_mut() {
            Some(input) => {
                input.drain(..consumed);
                std::mem::take(input)
            }
            None => ctx.scratch[consumed..n].to_vec(),
        };
        if !leftover.is_empty() || !msg.is_idle() {
            let e = self.extra();
            e.input = leftover;
            e.msg = msg;
        } else if let Some(e) = self.extra.as_deref_mut() {
            e.msg = msg;
        }
        None
    }

    /// Queues a protocol goodbye (WebSocket close 1001 once upgraded;
    /// nothing for echo) and tries to write it, best effort: the caller
    /// shuts the socket down and drops it next.
    pub fn goodbye(&mut self, websocket: bool, out: &mut Vec<u8>, t: &mut Traffic) {
        if websocket && self.phase() == Phase::Open {
            ws::write_close(out, ws::code::GOING_AWAY);
            let _ = self.send(out, t);
        }
        out.clear();
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
) -> (usize, Option<CloseReason>) {
    let mut start = 0;
    if *phase == Phase::Handshake {
        match ws::handshake(buf) {
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
    }

    impl Bufs {
        fn new(scratch: usize) -> Self {
            Bufs {
                scratch: vec![0; scratch],
                out: Vec::new(),
            }
        }
        fn ctx(&mut self) -> Ctx<'_> {
            Ctx {
                scratch: &mut self.scratch,
                out: &mut self.out,
                max_frame: 1024,
                now: 9,
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
        c.stream.reads.push_back(Err(ErrorKind::TimedOut.into()));
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

        // The close reply does not fit: blocked first, closed once flushed.
        let big = ws::client_frame(true, ws::opcode::BINARY, &[9; 2000], M);
        let mut c = fake(&[UPGRADE, &big], 0, Phase::Handshake);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        assert_eq!(c.unsent().len(), response_len());
        c.stream.window = usize::MAX;
        // The 101 goes out, then the oversize frame is read: 1009.
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closed(CloseReason::TooLarge)
        );
        assert!(c.stream.written.ends_with(&[0x88, 2, 0x03, 0xf1]));

        let mut c = fake(&[b"GET / HTTP/1.1\r\n\r\n"], 3, Phase::Handshake);
        assert_eq!(c.websocket(&mut b.ctx()), Status::Blocked);
        c.stream.window = usize::MAX;
        assert_eq!(
            c.websocket(&mut b.ctx()),
            Status::Closed(CloseReason::BadHandshake)
        );
        assert!(c.stream.written.starts_with(b"HTTP/1.1 400 "));
    }

    #[test]
    fn goodbye_sends_1001_only_to_open_websockets() {
        let mut b = Bufs::new(8);
        let mut t = Traffic::default();
        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.goodbye(true, &mut b.out, &mut t);
        assert_eq!(c.stream.written, [0x88, 2, 0x03, 0xe9]);
        let mut c = fake(&[], usize::MAX, Phase::Handshake);
        c.goodbye(true, &mut b.out, &mut t);
        assert!(c.stream.written.is_empty());
        let mut c = fake(&[], usize::MAX, Phase::Open);
        c.goodbye(false, &mut b.out, &mut t);
        assert!(c.stream.written.is_empty());
        assert!(b.out.is_empty());
    }
}
