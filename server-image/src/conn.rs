//! Per-connection state and the echo pump.
//!
//! A connection is one slab entry: the socket and, only while a write could
//! not finish, the bytes the kernel has not taken yet. An idle connection
//! holds no buffer at all; reads go through one scratch buffer owned by the
//! worker. That keeps user-space bytes per idle connection at the size of
//! [`Conn`] (16 bytes on 64-bit Linux: a 4-byte descriptor and one pointer),
//! next to ~3.9 KiB the kernel spends on the socket [measured,
//! `shared/KERNEL_FACTS.md`].

use std::io::{self, ErrorKind, Read, Write};

use crate::metrics::CloseReason;

/// One held connection: the socket and its unsent bytes, if any.
#[derive(Debug)]
pub struct Conn<S> {
    /// The socket (in the server, a non-blocking `std::net::TcpStream`
    /// registered with the worker's `mio::Poll`).
    pub stream: S,
    /// Bytes read but not yet written back; `None` whenever the last write
    /// finished. While `Some`, the connection waits for writability and
    /// reads nothing more (backpressure to the peer). Boxed so the common
    /// case costs one pointer.
    pub unsent: Option<Box<Unsent>>,
}

/// The tail of a write the kernel did not take.
#[derive(Debug, PartialEq, Eq)]
pub struct Unsent {
    bytes: Box<[u8]>,
    written: usize,
}

impl Unsent {
    fn new(bytes: &[u8]) -> Box<Self> {
        Box::new(Unsent {
            bytes: bytes.into(),
            written: 0,
        })
    }

    /// The bytes still to write.
    pub fn remaining(&self) -> &[u8] {
        &self.bytes[self.written..]
    }
}

/// Bytes moved by one [`Conn::echo`] call.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes read from the socket.
    pub received: u64,
    /// Bytes written to the socket.
    pub sent: u64,
}

/// Where a connection stands after [`Conn::echo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Everything read was written back and the socket has nothing more to
    /// read (`WouldBlock`): wait for readability.
    Idle,
    /// A write could not finish; the rest is in `unsent`: wait for
    /// writability.
    Blocked,
    /// The connection is over; drop it.
    Closed(CloseReason),
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

impl<S: Read + Write> Conn<S> {
    /// A connection with nothing pending.
    pub fn new(stream: S) -> Self {
        Conn {
            stream,
            unsent: None,
        }
    }

    /// Tries to write the unsent bytes. Keeps only what is still unsent.
    fn flush_unsent(&mut self, t: &mut Traffic) -> Result<(), CloseReason> {
        if let Some(mut u) = self.unsent.take() {
            let n = write_some(&mut self.stream, u.remaining())?;
            t.sent += n as u64;
            u.written += n;
            if !u.remaining().is_empty() {
                self.unsent = Some(u);
            }
        }
        Ok(())
    }

    /// Echoes until the socket would block: first the unsent bytes, then
    /// reads into `scratch` (edge-triggered readiness means reading until
    /// `WouldBlock`) and writes each chunk straight back. If a write cannot
    /// finish, only its unsent tail is copied into `unsent`, and reading
    /// stops until the socket is writable again.
    pub fn echo(&mut self, scratch: &mut [u8], t: &mut Traffic) -> Status {
        if let Err(r) = self.flush_unsent(t) {
            return Status::Closed(r);
        }
        if self.unsent.is_some() {
            return Status::Blocked;
        }
        loop {
            match self.stream.read(scratch) {
                Ok(0) => return Status::Closed(CloseReason::Peer),
                Ok(n) => {
                    t.received += n as u64;
                    let chunk = &scratch[..n];
                    match write_some(&mut self.stream, chunk) {
                        Ok(w) => {
                            t.sent += w as u64;
                            if w < n {
                                self.unsent = Some(Unsent::new(&chunk[w..]));
                                return Status::Blocked;
                            }
                        }
                        Err(r) => return Status::Closed(r),
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Status::Idle,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Status::Closed(close_reason(&e)),
            }
        }
    }
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

    fn fake(reads: &[&[u8]], window: usize) -> Conn<Fake> {
        Conn::new(Fake {
            reads: reads.iter().map(|r| Ok(r.to_vec())).collect(),
            window,
            ..Fake::default()
        })
    }

    fn unsent(c: &Conn<Fake>) -> Option<&[u8]> {
        c.unsent.as_deref().map(Unsent::remaining)
    }

    #[test]
    fn conn_is_small() {
        // A 4-byte fd and a nullable pointer, aligned to 8.
        assert_eq!(std::mem::size_of::<Conn<std::net::TcpStream>>(), 16);
    }

    #[test]
    fn echoes_everything_then_idles() {
        let mut c = fake(&[b"hello ", b"world"], usize::MAX);
        let mut t = Traffic::default();
        // A scratch smaller than a read exercises the read loop.
        let mut scratch = [0u8; 4];
        assert_eq!(c.echo(&mut scratch, &mut t), Status::Idle);
        assert_eq!(c.stream.written, b"hello world");
        assert_eq!(unsent(&c), None);
        assert_eq!(
            t,
            Traffic {
                received: 11,
                sent: 11
            }
        );
    }

    #[test]
    fn eof_closes_as_peer() {
        let mut c = fake(&[b"bye"], usize::MAX);
        c.stream.reads.push_back(Ok(Vec::new()));
        let mut t = Traffic::default();
        let s = c.echo(&mut [0u8; 64], &mut t);
        assert_eq!(s, Status::Closed(CloseReason::Peer));
        assert_eq!(c.stream.written, b"bye");
    }

    #[test]
    fn partial_write_keeps_only_unsent_bytes_and_stops_reading() {
        let mut c = fake(&[b"0123456789", b"later"], 4);
        let mut t = Traffic::default();
        let mut scratch = [0u8; 64];
        assert_eq!(c.echo(&mut scratch, &mut t), Status::Blocked);
        assert_eq!(c.stream.written, b"0123");
        assert_eq!(unsent(&c), Some(&b"456789"[..]));
        // "later" was not read while blocked.
        assert_eq!(c.stream.reads.len(), 1);
        assert_eq!(t.received, 10);
        assert_eq!(t.sent, 4);

        // Still no room: stays blocked, nothing lost.
        let mut t = Traffic::default();
        assert_eq!(c.echo(&mut scratch, &mut t), Status::Blocked);
        assert_eq!(unsent(&c), Some(&b"456789"[..]));

        // Some room: the remainder shrinks to what is still unsent.
        c.stream.window = 2;
        assert_eq!(c.echo(&mut scratch, &mut t), Status::Blocked);
        assert_eq!(unsent(&c), Some(&b"6789"[..]));

        // Room for all: flushes, then resumes reading.
        c.stream.window = usize::MAX;
        assert_eq!(c.echo(&mut scratch, &mut t), Status::Idle);
        assert_eq!(unsent(&c), None);
        assert_eq!(c.stream.written, b"0123456789later");
    }

    #[test]
    fn errors_map_to_reasons() {
        let mut c = fake(&[], usize::MAX);
        c.stream
            .reads
            .push_back(Err(ErrorKind::ConnectionReset.into()));
        let s = c.echo(&mut [0u8; 8], &mut Traffic::default());
        assert_eq!(s, Status::Closed(CloseReason::Reset));

        let mut c = fake(&[b"x"], usize::MAX);
        c.stream.write_err = Some(ErrorKind::BrokenPipe);
        let s = c.echo(&mut [0u8; 8], &mut Traffic::default());
        assert_eq!(s, Status::Closed(CloseReason::Reset));

        let mut c = fake(&[], usize::MAX);
        c.stream.reads.push_back(Err(ErrorKind::Interrupted.into()));
        c.stream.reads.push_back(Ok(b"ok".to_vec()));
        c.stream.reads.push_back(Err(ErrorKind::TimedOut.into()));
        let s = c.echo(&mut [0u8; 8], &mut Traffic::default());
        assert_eq!(s, Status::Closed(CloseReason::Error));
        assert_eq!(c.stream.written, b"ok");
    }
}
