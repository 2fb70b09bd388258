//! The drain's accept window: for `--drain-accept-secs` after a drain
//! starts, new connections are still accepted, and answered with the
//! protocol's goodbye instead of a refusal; then the listeners close.
//!
//! Why: endpoint removal races SIGTERM (kubernetes#86280). For a few
//! seconds after the drain starts, kube-proxy on some nodes still sends new
//! connections here, among them the clients the drain itself just told to
//! reconnect. A closed listener refuses them (`ECONNREFUSED`, which many
//! clients treat as an outage); a goodbye sends them elsewhere on their
//! next attempt, once the endpoints have caught up.
//!
//! How: `server.rs` keeps a second descriptor of every worker listener
//! (`try_clone`). When the drain starts the workers stop accepting and drop
//! theirs; the sockets stay open through these copies, so nothing that
//! reaches them is refused, and this thread accepts from all of them: a
//! WebSocket client gets its upgrade answered (101, with the subprotocol
//! the workers would choose, or the 4xx the request earns) and then close
//! 1001 (going away), an echo client gets a FIN. Each
//! goodbye is counted as rejected with reason `draining`. When the window
//! ends the copies are closed, and with them the listeners. The goodbyes
//! still under way get [`GOODBYE_DEADLINE`] from their accept to finish.

use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use slab::Slab;

use crate::config::Protocol;
use crate::metrics::{Metrics, RejectReason};
use crate::ws::{self, Handshake, Subprotocols};

/// Time a connection accepted in the window has to finish its goodbye (send
/// its upgrade request, take the answer, close): the admin port's request
/// deadline, for the same reason. Chosen, not measured.
pub const GOODBYE_DEADLINE: Duration = Duration::from_secs(2);

/// Goodbyes under way at once; a connection over this is closed at once
/// (the client reads EOF, still not a refusal). Chosen, not measured: the
/// window is seconds long and each goodbye takes one round trip.
pub const MAX_GOODBYES: usize = 1024;

/// How often the listeners are polled for connections besides their
/// events (after `EMFILE`, an edge-triggered listener says nothing more).
const TICK: Duration = Duration::from_millis(10);

/// Token base of the listeners: listener `i` is `Token(LISTENERS - i)`;
/// goodbye connections are slab keys counting up from 0.
const LISTENERS: usize = usize::MAX;

/// Where a goodbye is.
enum Stage {
    /// WebSocket: collecting the upgrade request.
    Upgrade(Vec<u8>),
    /// Writing the answer (from the offset); then FIN.
    Answer(Vec<u8>, usize),
    /// FIN sent: reading and discarding until the client closes too, so
    /// that our close does not turn into a reset that loses the goodbye.
    Linger,
}

struct Goodbye {
    stream: TcpStream,
    deadline: Instant,
    stage: Stage,
}

/// Runs the accept window on `listeners` (copies of the workers'
/// listeners) from a new thread: goodbyes until `window` has passed, then
/// the listeners close; the thread ends when the last goodbye is done.
pub fn spawn(
    listeners: Vec<std::net::TcpListener>,
    protocol: Protocol,
    subprotocols: Subprotocols,
    window: Duration,
    metrics: Arc<Metrics>,
) -> io::Result<JoinHandle<()>> {
    let poll = Poll::new()?;
    let mut ls = Vec::with_capacity(listeners.len());
    for (i, l) in listeners.into_iter().enumerate() {
        l.set_nonblocking(true)?;
        let mut l = TcpListener::from_std(l);
        poll.registry()
            .register(&mut l, Token(LISTENERS - i), Interest::READABLE)?;
        ls.push(l);
    }
    let door = Door {
        poll,
        listeners: ls,
        goodbyes: Slab::new(),
        protocol,
        subprotocols,
        end: Instant::now() + window,
        turned_away: metrics.rejected(RejectReason::Draining),
    };
    std::thread::Builder::new()
        .name("c10m-door".into())
        .spawn(move || door.run())
}

struct Door {
    poll: Poll,
    listeners: Vec<TcpListener>,
    goodbyes: Slab<Goodbye>,
    protocol: Protocol,
    /// Accepted in the upgrade the goodbye answers, as by the workers.
    subprotocols: Subprotocols,
    end: Instant,
    turned_away: prometheus_client::metrics::counter::Counter,
}

impl Door {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let mut scratch = vec![0u8; 4096];
        let mut turned_away = 0u64;
        loop {
            let now = Instant::now();
            if !self.listeners.is_empty() && now >= self.end {
                // Whatever is still queued on them is reset by the close.
                self.accept_all(&mut turned_away);
                self.listeners.clear();
                tracing::info!(turned_away, "accept window over; listeners closed");
            }
            if self.listeners.is_empty() && self.goodbyes.is_empty() {
                return;
            }
            if let Err(e) = self.poll.poll(&mut events, Some(TICK)) {
                if e.kind() != ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "accept window: poll failed");
                    std::thread::sleep(TICK);
                }
                continue;
            }
            for event in events.iter() {
                // Listener events need nothing here: every turn accepts.
                let Token(key) = event.token();
                if key < MAX_GOODBYES {
                    self.drive(key, &mut scratch);
                }
            }
            self.accept_all(&mut turned_away);
            let now = Instant::now();
            let late: Vec<usize> = self
                .goodbyes
                .iter()
                .filter(|(_, g)| g.deadline <= now)
                .map(|(k, _)| k)
                .collect();
            for key in late {
                self.goodbyes.remove(key);
            }
        }
    }

    /// Accepts whatever every listener has queued.
    fn accept_all(&mut self, turned_away: &mut u64) {
        for i in 0..self.listeners.len() {
            loop {
                let stream = match self.listeners[i].accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::ConnectionAborted => continue,
                    // WouldBlock, or EMFILE and friends (retried next tick).
                    Err(_) => break,
                };
                *turned_away += 1;
                self.turned_away.inc();
                self.start(stream);
            }
        }
    }

    fn start(&mut self, mut stream: TcpStream) {
        if self.goodbyes.len() >= MAX_GOODBYES {
            return; // dropped: FIN (or RST if it sent something)
        }
        let stage = match self.protocol {
            Protocol::Echo => {
                let _ = stream.shutdown(Shutdown::Write);
                Stage::Linger
            }
            Protocol::Websocket => Stage::Upgrade(Vec::new()),
        };
        let entry = self.goodbyes.vacant_entry();
        let key = entry.key();
        if self
            .poll
            .registry()
            .register(
                &mut stream,
                Token(key),
                Interest::READABLE | Interest::WRITABLE,
            )
            .is_err()
        {
            return;
        }
        entry.insert(Goodbye {
            stream,
            deadline: Instant::now() + GOODBYE_DEADLINE,
            stage,
        });
    }

    /// Moves a goodbye on as far as the socket allows.
    fn drive(&mut self, key: usize, scratch: &mut [u8]) {
        let Some(g) = self.goodbyes.get_mut(key) else {
            return;
        };
        if step(g, scratch, &self.subprotocols) {
            self.goodbyes.remove(key);
        }
    }
}

/// Drives one goodbye; returns whether it is over.
fn step(g: &mut Goodbye, scratch: &mut [u8], subprotocols: &Subprotocols) -> bool {
    loop {
        match &mut g.stage {
            Stage::Upgrade(buf) => {
                let room = ws::MAX_HANDSHAKE_BYTES
                    .saturating_sub(buf.len())
                    .clamp(1, scratch.len());
                let n = match g.stream.read(&mut scratch[..room]) {
                    Ok(0) => return true,
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => return true,
                };
                buf.extend_from_slice(&scratch[..n]);
                g.stage = match ws::handshake_with(buf, subprotocols) {
                    Handshake::Partial => continue,
                    Handshake::Accept { mut response, .. } => {
                        ws::write_close(&mut response, ws::code::GOING_AWAY);
                        Stage::Answer(response, 0)
                    }
                    Handshake::Reject { response } => Stage::Answer(response, 0),
                };
            }
            Stage::Answer(out, sent) => {
                while *sent < out.len() {
                    match g.stream.write(&out[*sent..]) {
                        Ok(0) => return true,
                        Ok(n) => *sent += n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return true,
                    }
                }
                let _ = g.stream.shutdown(Shutdown::Write);
                g.stage = Stage::Linger;
            }
            Stage::Linger => match g.stream.read(scratch) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return true,
            },
        }
    }
}
