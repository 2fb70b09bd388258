//! The admin HTTP/1.1 server: `GET /metrics`, `GET /healthz`, and the
//! authenticated `POST /drain?rate=R`, `POST /shed?count=N&rate=R`,
//! `POST /cordon`, `POST /uncordon`, `POST /limit?connections=N&seconds=S`
//! and `POST /unlimit` (bearer token from [`crate::token`], re-read from its file as it
//! changes).
//!
//! Paths and query keys are the operator's contract
//! ([`c10m_wire::admin`]). One request per connection (`Connection:
//! close`), requests parsed with `httparse`, query strings with
//! `form_urlencoded`.
//!
//! The port is the kubelet's liveness and readiness probe, so no client may
//! hold it up: one thread runs a small non-blocking event loop (`mio`) over
//! every admin connection at once, so a slow or idle client costs a slot,
//! never the others' time. Each connection has a deadline on its whole
//! request ([`REQUEST_DEADLINE`], not per read), a cap on its size
//! ([`MAX_REQUEST_HEAD`], [`MAX_BODY`]), and at most
//! [`MAX_CONNECTIONS`] are held at once; over the bound the one that has
//! waited longest goes (if it has waited [`EVICT_AFTER`]), else the
//! newcomer is closed at once. Both are counted in
//! `c10m_admin_connections_dropped_total`. Scrapes and probes are a few per
//! second, so this stays off the workers and out of their way.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use slab::Slab;
use socket2::{Domain, Socket, Type};

use c10m_wire::admin::{
    CONNECTIONS_KEY, CORDON_PATH, COUNT_KEY, DRAIN_PATH, HEALTHZ_PATH, LIMIT_PATH, METRICS_PATH,
    RATE_KEY, SECONDS_KEY, SHED_PATH, UNCORDON_PATH, UNLIMIT_PATH,
};
use subtle::ConstantTimeEq;

use crate::conn::CloseReason;
use crate::control::{CloseOrder, Shared};
use crate::metrics::{AdminDrop, Format, Metrics};
use crate::token::{AdminToken, Verdict};

/// Largest request head accepted, in bytes; larger gets 431.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// Largest request body accepted, in bytes (`Content-Length`); larger gets
/// 413. The orders carry their parameters in the query, so a body is only
/// read and ignored; bodies without a length (`Transfer-Encoding`) get 411.
pub const MAX_BODY: usize = 1024;

/// Headers parsed per request; more gets 431.
pub const MAX_HEADERS: usize = 32;

/// Time from accept to the last byte of the request, head and body, in
/// total: a client that has not sent its whole request by then is closed
/// unanswered (`reason="deadline"`). One round trip suffices for a probe or
/// a scrape; 2 s is the kubelet's view of a slow probe answer (its default
/// `timeoutSeconds` is 1). Chosen, not measured.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);

/// Time the client has to take the answer once it is ready.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(2);

/// Admin connections held at once ([`c10m_wire::limits::ADMIN_MAX_CONNECTIONS`],
/// counted in the descriptor reserve).
pub const MAX_CONNECTIONS: usize = c10m_wire::limits::ADMIN_MAX_CONNECTIONS as usize;

/// At the bound, a newcomer replaces the connection that has waited longest
/// if that one has waited at least this long; else the newcomer is closed.
/// A request that is being answered takes one round trip, far less, so a
/// probe is never the one replaced, and clients that reconnect the moment
/// they are closed cannot churn the slots faster than one bound's worth
/// per this period. Chosen, not measured.
pub const EVICT_AFTER: Duration = Duration::from_millis(250);

/// A response ready to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type` header value.
    pub content_type: &'static str,
    /// Extra header lines (`Name: value`), without CRLF.
    pub headers: Vec<(&'static str, &'static str)>,
    /// Body; omitted on the wire for HEAD.
    pub body: String,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: format!("{body}\n"),
        }
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// What `/healthz` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Serving: 200.
    Serving,
    /// Draining after SIGTERM/SIGINT: 503, so readiness drops.
    Draining,
    /// Cordoned (`POST /cordon`): 503, so readiness drops while the held
    /// connections stay.
    Cordoned,
}

/// A parsed request head: what routing needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Method, e.g. `GET`.
    pub method: String,
    /// Request target, e.g. `/metrics?x=1`.
    pub target: String,
    /// The `Accept` header, if sent.
    pub accept: Option<String>,
    /// The `Authorization` header, if sent.
    pub authorization: Option<String>,
    /// Bytes of the request, head and body.
    pub len: usize,
}

/// An order the admin port accepted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// `POST /drain?rate=R`: stop accepting, close everything at `rate`
    /// per second (`None`: the configured `--drain-rate`), then exit.
    Drain {
        /// Closes per second; 0 means all at once.
        rate: Option<f64>,
    },
    /// `POST /shed?count=N&rate=R`: close `count` connections at `rate`
    /// per second (0 or absent: at once) while still accepting.
    Shed {
        /// Connections to close.
        count: u64,
        /// Closes per second; 0 means all at once.
        rate: f64,
    },
    /// `POST /cordon` (`true`) or `POST /uncordon` (`false`): readiness
    /// drops (or comes back); held connections stay, accepting goes on.
    Cordon(bool),
    /// `POST /limit?connections=N&seconds=S`: admit no more than `N`
    /// connections for `S` seconds (held ones stay); `POST /unlimit`
    /// (`None`): lift the limit.
    Limit(Option<(u64, u64)>),
}

/// Whether `authorization` carries `Bearer <token>`, compared in constant
/// time. Without a configured token every request fails.
pub fn authorized(authorization: Option<&str>, token: Option<&str>) -> bool {
    let (Some(auth), Some(token)) = (authorization, token) else {
        return false;
    };
    let Some((scheme, given)) = auth.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && bool::from(given.trim().as_bytes().ct_eq(token.as_bytes()))
}

fn number<T: std::str::FromStr>(query: &str, key: &str) -> Result<Option<T>, ()> {
    match form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == key) {
        None => Ok(None),
        Some((_, v)) => v.parse().map(Some).map_err(|_| ()),
    }
}

fn rate(query: &str) -> Result<Option<f64>, ()> {
    match number::<f64>(query, RATE_KEY)? {
        Some(r) if !r.is_finite() || r < 0.0 => Err(()),
        r => Ok(r),
    }
}

/// Parses the path and query of an order (`POST /drain`, `/shed`,
/// `/cordon`, `/uncordon`) into an [`Action`].
pub fn parse_action(path: &str, query: &str) -> Result<Action, &'static str> {
    match path {
        DRAIN_PATH => Ok(Action::Drain {
            rate: rate(query).map_err(|()| "rate must be a number >= 0")?,
        }),
        SHED_PATH => {
            let count = number::<u64>(query, COUNT_KEY)
                .map_err(|()| "count must be an integer >= 0")?
                .ok_or("count is required")?;
            let rate = rate(query).map_err(|()| "rate must be a number >= 0")?;
            Ok(Action::Shed {
                count,
                rate: rate.unwrap_or(0.0),
            })
        }
        CORDON_PATH => Ok(Action::Cordon(true)),
        UNCORDON_PATH => Ok(Action::Cordon(false)),
        LIMIT_PATH => {
            let connections = number::<u64>(query, CONNECTIONS_KEY)
                .map_err(|()| "connections must be an integer >= 0")?
                .ok_or("connections is required")?;
            let seconds = number::<u64>(query, SECONDS_KEY)
                .ok()
                .flatten()
                .filter(|s| *s >= 1)
                .ok_or("seconds is required, an integer >= 1")?;
            Ok(Action::Limit(Some((connections, seconds))))
        }
        UNLIMIT_PATH => Ok(Action::Limit(None)),
        _ => Err("unknown action"),
    }
}

/// Routes one request against a fixed `token` ([`route_checked`] with
/// [`authorized`]): without one every order is 401.
pub fn route(
    req: &Request,
    health: Health,
    token: Option<&str>,
    metrics: &dyn Fn(Format) -> String,
    act: &mut dyn FnMut(Action) -> String,
) -> Response {
    let check = |authorization: Option<&str>| {
        if authorized(authorization, token) {
            Verdict::Allowed
        } else {
            Verdict::Denied
        }
    };
    route_checked(req, health, &check, metrics, act)
}

/// Routes one request. Pure, apart from calling `check` on an order's
/// `Authorization` header (the server's [`AdminToken::check`], which may
/// re-read the token file), `metrics` to encode and `act` to carry out an
/// accepted order (it returns the JSON body).
///
/// `GET`/`HEAD` `/metrics` (format by `Accept`, see [`Format::negotiate`])
/// and `/healthz` (query strings ignored); any other method on those paths
/// is 405 with `Allow`. `POST /drain` and `POST /shed` need
/// `Authorization: Bearer <token>` (else 401; 503 while the token file
/// gives no token), valid parameters (else 400) and answer 202; other
/// methods there are 405. Any other path is 404.
///
/// [`AdminToken::check`]: crate::token::AdminToken::check
pub fn route_checked(
    req: &Request,
    health: Health,
    check: &dyn Fn(Option<&str>) -> Verdict,
    metrics: &dyn Fn(Format) -> String,
    act: &mut dyn FnMut(Action) -> String,
) -> Response {
    let (method, target) = (req.method.as_str(), req.target.as_str());
    let path = target.split(['?', '#']).next().unwrap_or(target);
    if matches!(
        path,
        DRAIN_PATH | SHED_PATH | CORDON_PATH | UNCORDON_PATH | LIMIT_PATH | UNLIMIT_PATH
    ) {
        if method != "POST" {
            let mut r = Response::text(405, "method not allowed");
            r.headers.push(("Allow", "POST"));
            return r;
        }
        match check(req.authorization.as_deref()) {
            Verdict::Allowed => {}
            Verdict::Denied => {
                let mut r = Response::text(401, "unauthorized");
                r.headers.push(("WWW-Authenticate", "Bearer"));
                return r;
            }
            Verdict::Unavailable => return Response::text(503, "admin token unavailable"),
        }
        let query = target
            .split_once('?')
            .map_or("", |(_, q)| q.split('#').next().unwrap_or(""));
        return match parse_action(path, query) {
            Ok(action) => Response {
                status: 202,
                content_type: "application/json",
                headers: Vec::new(),
                body: act(action) + "\n",
            },
            Err(e) => Response::text(400, e),
        };
    }
    let known = matches!(path, METRICS_PATH | HEALTHZ_PATH);
    if !known {
        return Response::text(404, "not found");
    }
    if method != "GET" && method != "HEAD" {
        let mut r = Response::text(405, "method not allowed");
        r.headers.push(("Allow", "GET, HEAD"));
        return r;
    }
    match (path, health) {
        (METRICS_PATH, _) => {
            let format = Format::negotiate(req.accept.as_deref());
            Response {
                status: 200,
                content_type: format.content_type(),
                headers: Vec::new(),
                body: metrics(format),
            }
        }
        (_, Health::Serving) => Response::text(200, "ok"),
        (_, Health::Draining) => Response::text(503, "draining"),
        (_, Health::Cordoned) => Response::text(503, "cordoned"),
    }
}

/// Serialises `r`; the body is left out for HEAD.
pub fn render(r: &Response, head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        reason_phrase(r.status),
        r.content_type,
        r.body.len()
    );
    for (k, v) in &r.headers {
        out.push_str(k);
        out.push_str(": ");
        out.push_str(v);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    if !head_only {
        bytes.extend_from_slice(r.body.as_bytes());
    }
    bytes
}

/// The outcome of parsing what has been read so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A complete request: head and body.
    Request(Request),
    /// Need more bytes.
    Partial,
    /// Not HTTP/1.x, too many headers, too large, or a body without a
    /// length: answer with this status.
    Invalid(u16),
}

/// Parses a request (head with `httparse`, then a body of
/// `Content-Length` bytes, at most [`MAX_BODY`]) from the start of `buf`.
pub fn parse(buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n > MAX_REQUEST_HEAD => return Parsed::Invalid(431),
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_REQUEST_HEAD => {
            return Parsed::Invalid(431);
        }
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => return Parsed::Invalid(431),
        Err(_) => return Parsed::Invalid(400),
    };
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).into_owned())
    };
    if header("transfer-encoding").is_some() {
        return Parsed::Invalid(411);
    }
    // Every Content-Length line must agree [RFC 9110 §8.6]; a list of
    // equal values counts as one.
    let mut body: Option<usize> = None;
    for h in req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        for v in h.value.split(|&b| b == b',') {
            let v = v.trim_ascii();
            if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
                return Parsed::Invalid(400);
            }
            // Saturates: any length this large is over the cap anyway.
            let n = std::str::from_utf8(v)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(usize::MAX);
            if body.is_some_and(|b| b != n) {
                return Parsed::Invalid(400);
            }
            body = Some(n);
        }
    }
    let body = body.unwrap_or(0);
    if body > MAX_BODY {
        return Parsed::Invalid(413);
    }
    let len = head + body;
    if buf.len() < len {
        return Parsed::Partial;
    }
    Parsed::Request(Request {
        method: req.method.unwrap_or_default().to_string(),
        target: req.path.unwrap_or_default().to_string(),
        accept: header("accept"),
        authorization: header("authorization"),
        len,
    })
}

/// Collects one request over any number of reads, never holding more than
/// a request may be ([`MAX_REQUEST_HEAD`] + [`MAX_BODY`]).
#[derive(Debug, Default)]
pub struct RequestReader {
    buf: Vec<u8>,
}

impl RequestReader {
    /// Most bytes a request may take.
    pub const CAP: usize = MAX_REQUEST_HEAD + MAX_BODY;

    /// Bytes that may still be read into it.
    pub fn room(&self) -> usize {
        Self::CAP - self.buf.len()
    }

    /// Appends what one read returned (up to [`RequestReader::room`]; the
    /// rest is ignored) and parses what has come so far.
    pub fn feed(&mut self, bytes: &[u8]) -> Parsed {
        let n = bytes.len().min(self.room());
        self.buf.extend_from_slice(&bytes[..n]);
        match parse(&self.buf) {
            // Full yet incomplete cannot happen (the head is capped below
            // the buffer, the body by MAX_BODY), but never wait on it.
            Parsed::Partial if self.room() == 0 => Parsed::Invalid(431),
            p => p,
        }
    }
}

/// Binds the admin listener (SO_REUSEADDR, so a restart does not wait out
/// TIME_WAIT; no SO_REUSEPORT, so a second server on the port fails loudly).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

/// What the admin thread needs besides its listener.
pub struct AdminState {
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// Worker state (draining flag, close orders).
    pub shared: Arc<Shared>,
    /// Bearer token for `POST /drain` and `POST /shed` (none: always 401).
    pub token: AdminToken,
    /// Starts a drain at the given rate (the main thread runs it, with its
    /// deadline). Called once the `POST /drain` that ordered it is answered
    /// (or its connection is gone): a drain at rate 0 can end the process
    /// at once, and the order's 202 must not be lost with it.
    pub drain: Box<dyn Fn(f64) + Send>,
    /// `--drain-rate`, for a `POST /drain` without `rate`.
    pub default_drain_rate: f64,
}

/// Serves the admin endpoints on `listener` from a new thread, for the life
/// of the process.
pub fn spawn(listener: TcpListener, state: AdminState) -> io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    let poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let admin = Admin {
        poll,
        listener,
        conns: Slab::with_capacity(MAX_CONNECTIONS),
        state,
        accept_retry: None,
        scratch: vec![0u8; 4096],
    };
    std::thread::Builder::new()
        .name("c10m-admin".into())
        .spawn(move || admin.run())
}

const LISTENER: Token = Token(usize::MAX);

/// Retry period of `accept` after an error such as `EMFILE`.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// One admin connection: reading its request, or writing its answer.
struct AdminConn {
    stream: TcpStream,
    /// When it was accepted.
    since: Instant,
    /// When it is closed unanswered if not done.
    deadline: Instant,
    reader: RequestReader,
    /// The answer, once there is one, and how much of it went out.
    out: Vec<u8>,
    sent: usize,
    /// The drain rate a `POST /drain` on it ordered, started when the
    /// connection is removed ([`Admin::drop_conn`]), after its answer.
    drain: Option<f64>,
}

/// What to do with a connection after driving it.
enum Next {
    Keep,
    Close,
}

struct Admin {
    poll: Poll,
    listener: mio::net::TcpListener,
    conns: Slab<AdminConn>,
    state: AdminState,
    accept_retry: Option<Instant>,
    scratch: Vec<u8>,
}

impl Admin {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            let now = Instant::now();
            let next = self
                .conns
                .iter()
                .map(|(_, c)| c.deadline)
                .chain(self.accept_retry)
                .min();
            let timeout = next.map(|t| t.saturating_duration_since(now));
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "admin event loop failed; retrying");
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(),
                    Token(key) => self.drive(key),
                }
            }
            let now = Instant::now();
            if self.accept_retry.is_some_and(|t| t <= now) {
                self.accept_retry = None;
                self.accept_all();
            }
            self.expire(now);
        }
    }

    /// Accepts until the queue is empty (edge-triggered), making room under
    /// the bound as it goes.
    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // EMFILE and friends: try again shortly instead of
                    // spinning (the listener stays readable, but an
                    // edge-triggered loop would not hear of it again).
                    tracing::debug!(error = %e, "admin accept failed");
                    self.accept_retry = Some(Instant::now() + ACCEPT_RETRY);
                    return;
                }
            }
        }
    }

    fn admit(&mut self, mut stream: TcpStream) {
        let now = Instant::now();
        if self.conns.len() >= MAX_CONNECTIONS {
            let oldest = self
                .conns
                .iter()
                .min_by_key(|(_, c)| c.since)
                .map(|(k, c)| (k, c.since));
            match oldest {
                Some((key, since)) if now.duration_since(since) >= EVICT_AFTER => {
                    self.drop_conn(key, Some(AdminDrop::Limit));
                }
                _ => {
                    // Closing sends FIN: the client reads EOF at once.
                    drop(stream);
                    self.state.metrics.admin_dropped(AdminDrop::Limit).inc();
                    return;
                }
            }
        }
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut stream, Token(key), Interest::READABLE)
        {
            tracing::debug!(error = %e, "admin registration failed");
            return;
        }
        entry.insert(AdminConn {
            stream,
            since: now,
            deadline: now + REQUEST_DEADLINE,
            reader: RequestReader::default(),
            out: Vec::new(),
            sent: 0,
            drain: None,
        });
        // The request is often there already: no need to wait for an event.
        self.drive(key);
    }

    fn drive(&mut self, key: usize) {
        let next = match self.conns.get_mut(key) {
            None => return,
            Some(c) if c.out.is_empty() => {
                let next = read_request(c, &mut self.scratch, &self.state);
                if !c.out.is_empty() {
                    c.deadline = Instant::now() + WRITE_DEADLINE;
                    match write_answer(c) {
                        Next::Keep => {
                            let fd = &mut c.stream;
                            if self
                                .poll
                                .registry()
                                .reregister(fd, Token(key), Interest::WRITABLE)
                                .is_err()
                            {
                                Next::Close
                            } else {
                                Next::Keep
                            }
                        }
                        other => other,
                    }
                } else {
                    next
                }
            }
            Some(c) => write_answer(c),
        };
        if let Next::Close = next {
            self.drop_conn(key, None);
        }
    }

    /// Removes connection `key` (closing it sends the FIN), counts it as
    /// dropped for `reason` if given, and starts the drain it ordered.
    fn drop_conn(&mut self, key: usize, reason: Option<AdminDrop>) {
        let Some(c) = self.conns.try_remove(key) else {
            return;
        };
        if let Some(reason) = reason {
            self.state.metrics.admin_dropped(reason).inc();
        }
        drop(c.stream);
        if let Some(rate) = c.drain {
            (self.state.drain)(rate);
        }
    }

    /// Closes every connection past its deadline.
    fn expire(&mut self, now: Instant) {
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(k, _)| k)
            .collect();
        for key in late {
            self.drop_conn(key, Some(AdminDrop::Deadline));
        }
    }
}

/// Reads what the socket has; once the request is complete (or invalid)
/// puts the answer in `c.out`.
fn read_request(c: &mut AdminConn, scratch: &mut [u8], state: &AdminState) -> Next {
    loop {
        let room = c.reader.room().min(scratch.len());
        let n = match c.stream.read(&mut scratch[..room]) {
            Ok(0) => return Next::Close, // closed before a full request
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return Next::Close,
        };
        match c.reader.feed(&scratch[..n]) {
            Parsed::Partial => {}
            Parsed::Invalid(status) => {
                c.out = render(&Response::text(status, "bad request"), false);
                return Next::Keep;
            }
            Parsed::Request(req) => {
                c.out = answer(state, &req, &mut c.drain);
                return Next::Keep;
            }
        }
    }
}

/// Writes what is left of the answer; closes once it is out (closing
/// sends the FIN, so the client sees EOF only once the descriptor is gone).
fn write_answer(c: &mut AdminConn) -> Next {
    while c.sent < c.out.len() {
        match c.stream.write(&c.out[c.sent..]) {
            Ok(0) => return Next::Close,
            Ok(n) => c.sent += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Next::Close,
        }
    }
    Next::Close
}

/// Routes a complete request and serialises the answer; an accepted
/// `POST /drain` leaves its rate in `drain`.
fn answer(state: &AdminState, req: &Request, drain: &mut Option<f64>) -> Vec<u8> {
    let (metrics, shared) = (&state.metrics, &state.shared);
    let health = if shared.draining() {
        Health::Draining
    } else if shared.cordoned() {
        Health::Cordoned
    } else {
        Health::Serving
    };
    let encode = |f| {
        metrics.refresh_system();
        let admitting = shared.admitting(Instant::now());
        metrics
            .limit
            .set(i64::try_from(admitting).unwrap_or(i64::MAX));
        if let Some(o) = shared.order() {
            let left = if o.over(Instant::now()) {
                0
            } else {
                o.count.saturating_sub(o.taken()).min(shared.serving())
            };
            metrics
                .close_pending
                .set(i64::try_from(left).unwrap_or(i64::MAX));
        }
        metrics.encode(f)
    };
    let check = |authorization: Option<&str>| state.token.check(authorization);
    let r = route_checked(req, health, &check, &encode, &mut |a| act(state, a, drain));
    render(&r, req.method == "HEAD")
}

/// Carries out `action` and returns the answer's JSON body; a drain is only
/// recorded in `drain`, for the caller to start once the answer is out.
fn act(state: &AdminState, action: Action, drain: &mut Option<f64>) -> String {
    let shared = &state.shared;
    match action {
        Action::Drain { rate } => {
            let rate = rate.unwrap_or(state.default_drain_rate);
            *drain = Some(rate);
            format!(
                "{{\"action\":\"drain\",\"rate\":{rate},\"live\":{}}}",
                shared.serving()
            )
        }
        Action::Shed { count, rate } => {
            if shared.draining() {
                return format!(
                    "{{\"action\":\"shed\",\"ignored\":\"draining\",\"live\":{}}}",
                    shared.serving()
                );
            }
            // Bounded by what is live as the order arrives: a client that
            // connects later is never one of its victims, nor is one already
            // in its close handshake (issue 21).
            let count = count.min(shared.serving());
            shared.set_order(CloseOrder::new(CloseReason::Shed, count, rate));
            format!(
                "{{\"action\":\"shed\",\"count\":{count},\"rate\":{rate},\"live\":{}}}",
                shared.serving()
            )
        }
        Action::Cordon(on) => {
            shared.set_cordoned(on);
            state.metrics.cordoned.set(i64::from(on));
            format!(
                "{{\"action\":\"{}\",\"live\":{}}}",
                if on { "cordon" } else { "uncordon" },
                shared.serving()
            )
        }
        Action::Limit(limit) => {
            let now = Instant::now();
            let order = limit.map(|(n, s)| (n, Duration::from_secs(s)));
            shared.set_limit(order, now);
            match limit {
                Some((n, s)) => format!(
                    "{{\"action\":\"limit\",\"connections\":{n},\"seconds\":{s},\"live\":{}}}",
                    shared.serving()
                ),
                None => format!("{{\"action\":\"unlimit\",\"live\":{}}}", shared.serving()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(f: Format) -> String {
        format!("x 1 {f:?}\n")
    }

    fn req(method: &str, target: &str) -> Request {
        Request {
            method: method.into(),
            target: target.into(),
            accept: None,
            authorization: None,
            len: 0,
        }
    }

    fn route(req: &Request, health: Health, m: &dyn Fn(Format) -> String) -> Response {
        super::route(req, health, Some("tok"), m, &mut |_| unreachable!())
    }

    #[test]
    fn orders_need_the_bearer_token() {
        let mut got = Vec::new();
        let mut call = |r: &Request, token: Option<&str>| {
            super::route(r, Health::Serving, token, &m, &mut |a| {
                got.push(a);
                "{}".into()
            })
        };
        let mut r = req("POST", "/shed?count=10&rate=2.5");
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Bearer nope".into());
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Basic tok".into());
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Bearer tok".into());
        assert_eq!(call(&r, None).status, 401, "no token configured: refused");
        let ok = call(&r, Some("tok"));
        assert_eq!((ok.status, ok.body.as_str()), (202, "{}\n"));
        let mut d = req("POST", "/drain?rate=100");
        d.authorization = Some("bearer  tok ".into());
        assert_eq!(call(&d, Some("tok")).status, 202);
        d.target = "/drain".into();
        assert_eq!(call(&d, Some("tok")).status, 202);
        for bad in [
            "/shed",
            "/shed?count=-1",
            "/shed?count=5&rate=-1",
            "/drain?rate=x",
            "/shed?count=1&rate=inf",
        ] {
            d.target = bad.into();
            assert_eq!(call(&d, Some("tok")).status, 400, "{bad}");
        }
        d.method = "GET".into();
        let r405 = call(&d, Some("tok"));
        assert_eq!(
            (r405.status, r405.headers.clone()),
            (405, vec![("Allow", "POST")])
        );
        assert_eq!(
            got,
            [
                Action::Shed {
                    count: 10,
                    rate: 2.5
                },
                Action::Drain { rate: Some(100.0) },
                Action::Drain { rate: None },
            ]
        );
    }

    #[test]
    fn orders_are_refused_with_503_while_the_token_file_gives_none() {
        let unavailable = |_: Option<&str>| Verdict::Unavailable;
        let mut r = req("POST", "/drain");
        r.authorization = Some("Bearer tok".into());
        for target in ["/drain", "/shed?count=1"] {
            r.target = target.into();
            let got = route_checked(&r, Health::Serving, &unavailable, &m, &mut |_| {
                unreachable!("never carried out")
            });
            assert_eq!(
                (got.status, got.body.as_str()),
                (503, "admin token unavailable\n")
            );
        }
        // Probes and scrapes never ask for the token.
        let asked = std::cell::Cell::new(0);
        let counting = |_: Option<&str>| {
            asked.set(asked.get() + 1);
            Verdict::Unavailable
        };
        for path in ["/healthz", "/metrics"] {
            let got = route_checked(
                &req("GET", path),
                Health::Serving,
                &counting,
                &m,
                &mut |_| unreachable!(),
            );
            assert_eq!(got.status, 200, "{path}");
        }
        // Nor does a wrong method on an order's path.
        let got = route_checked(
            &req("GET", "/shed"),
            Health::Serving,
            &counting,
            &m,
            &mut |_| unreachable!(),
        );
        assert_eq!(got.status, 405);
        assert_eq!(asked.get(), 0);
    }

    #[test]
    fn a_cordon_drops_readiness_and_an_uncordon_restores_it() {
        let mut got = Vec::new();
        for (target, want) in [
            ("/cordon", Action::Cordon(true)),
            ("/uncordon", Action::Cordon(false)),
        ] {
            let mut r = req("POST", target);
            r.authorization = Some("Bearer tok".into());
            let answer = super::route(&r, Health::Serving, Some("tok"), &m, &mut |a| {
                got.push(a);
                "{}".into()
            });
            assert_eq!(answer.status, 202, "{target}");
            assert_eq!(got.pop(), Some(want));
            r.authorization = None;
            assert_eq!(route(&r, Health::Serving, &m).status, 401, "{target}");
            r.method = "GET".into();
            assert_eq!(route(&r, Health::Serving, &m).status, 405, "{target}");
        }
        let probe = route(&req("GET", "/healthz"), Health::Cordoned, &m);
        assert_eq!((probe.status, probe.body.as_str()), (503, "cordoned\n"));
        let scrape = route(&req("GET", "/metrics"), Health::Cordoned, &m);
        assert_eq!(scrape.status, 200, "a cordoned shard is still scraped");
    }

    /// `POST /limit` needs both its connections and a lapse of at least a
    /// second, and its token; `POST /unlimit` lifts it.
    #[test]
    fn a_limit_needs_connections_and_seconds_and_an_unlimit_lifts_it() {
        assert_eq!(
            parse_action("/limit", "connections=1100&seconds=30"),
            Ok(Action::Limit(Some((1100, 30))))
        );
        assert_eq!(parse_action("/unlimit", ""), Ok(Action::Limit(None)));
        for (query, error) in [
            ("seconds=30", "connections is required"),
            (
                "connections=-1&seconds=30",
                "connections must be an integer >= 0",
            ),
            ("connections=10", "seconds is required, an integer >= 1"),
            (
                "connections=10&seconds=0",
                "seconds is required, an integer >= 1",
            ),
            (
                "connections=10&seconds=x",
                "seconds is required, an integer >= 1",
            ),
        ] {
            assert_eq!(parse_action("/limit", query), Err(error), "{query}");
        }
        let mut r = req("POST", "/limit?connections=5&seconds=9");
        r.authorization = Some("Bearer tok".into());
        let mut got = None;
        let answer = super::route(&r, Health::Serving, Some("tok"), &m, &mut |a| {
            got = Some(a);
            "{}".into()
        });
        assert_eq!(
            (answer.status, got),
            (202, Some(Action::Limit(Some((5, 9)))))
        );
        r.target = "/limit?connections=5".into();
        assert_eq!(route(&r, Health::Serving, &m).status, 400);
        r.authorization = None;
        assert_eq!(route(&r, Health::Serving, &m).status, 401);
    }

    #[test]
    fn routes() {
        let r = route(&req("GET", "/metrics"), Health::Serving, &m);
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "x 1 PrometheusText\n");
        assert_eq!(r.content_type, "text/plain; version=0.0.4; charset=utf-8");
        let mut om = req("GET", "/metrics");
        om.accept = Some("application/openmetrics-text;version=1.0.0".into());
        let r = route(&om, Health::Serving, &m);
        assert_eq!(r.body, "x 1 OpenMetrics\n");
        assert!(r.content_type.starts_with("application/openmetrics-text"));

        assert_eq!(
            route(&req("GET", "/metrics?a=b"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("GET", "/healthz"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("HEAD", "/healthz"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("GET", "/healthz"), Health::Draining, &m).status,
            503
        );
        assert_eq!(route(&req("GET", "/"), Health::Serving, &m).status, 404);
        assert_eq!(
            route(&req("GET", "/metricsx"), Health::Serving, &m).status,
            404
        );
        assert_eq!(
            route(&req("POST", "/nope"), Health::Serving, &m).status,
            404
        );

        let r = route(&req("POST", "/metrics"), Health::Serving, &m);
        assert_eq!(r.status, 405);
        assert_eq!(r.headers, vec![("Allow", "GET, HEAD")]);
        assert_eq!(
            route(&req("DELETE", "/healthz"), Health::Serving, &m).status,
            405
        );
    }

    #[test]
    fn parses_with_httparse() {
        let get = b"GET /metrics HTTP/1.1\r\nHost: x\r\nACCEPT: text/plain\r\n\r\n";
        assert_eq!(
            parse(get),
            Parsed::Request(Request {
                method: "GET".into(),
                target: "/metrics".into(),
                accept: Some("text/plain".into()),
                authorization: None,
                len: get.len(),
            })
        );
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\nHo"), Parsed::Partial);
        assert_eq!(parse(b"\x00\x01garbage\r\n\r\n"), Parsed::Invalid(400));
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse(&many), Parsed::Invalid(431));
        let huge = [b'a'; MAX_REQUEST_HEAD];
        let mut req = b"GET /".to_vec();
        req.extend_from_slice(&huge);
        assert_eq!(parse(&req[..MAX_REQUEST_HEAD]), Parsed::Invalid(431));
    }

    #[test]
    fn bodies_are_bounded_and_read_whole() {
        let post = |extra: &str, body: &str| {
            format!("POST /drain HTTP/1.1\r\nHost: x\r\n{extra}\r\n{body}").into_bytes()
        };
        let full = post("Content-Length: 5\r\n", "hello");
        let Parsed::Request(r) = parse(&full) else {
            panic!("{:?}", parse(&full))
        };
        assert_eq!(r.len, full.len());
        assert_eq!(r.target, "/drain");
        // The body is part of the request: not complete until it is here.
        assert_eq!(parse(&full[..full.len() - 1]), Parsed::Partial);
        // Pipelined bytes after the request are not part of it.
        let mut more = full.clone();
        more.extend_from_slice(b"GET / HTTP/1.1\r\n");
        assert!(matches!(parse(&more), Parsed::Request(r) if r.len == full.len()));
        for (extra, status) in [
            (format!("Content-Length: {}\r\n", MAX_BODY + 1), 413),
            ("Content-Length: 99999999999999999999999\r\n".into(), 413),
            ("Content-Length: -1\r\n".into(), 400),
            ("Content-Length: 1\r\nContent-Length: 2\r\n".into(), 400),
            ("Content-Length: 1, 2\r\n".into(), 400),
            ("Content-Length: \r\n".into(), 400),
            ("Transfer-Encoding: chunked\r\n".into(), 411),
        ] {
            assert_eq!(
                parse(&post(&extra, "")),
                Parsed::Invalid(status),
                "{extra:?}"
            );
        }
        // Repeated equal lengths are one length.
        let same = post("Content-Length: 2\r\nContent-Length: 2, 2\r\n", "ok");
        assert!(matches!(parse(&same), Parsed::Request(r) if r.len == same.len()));
    }

    #[test]
    fn the_reader_never_holds_more_than_a_request() {
        // Byte by byte, the same answer as all at once.
        let req = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut r = RequestReader::default();
        for (i, b) in req.iter().enumerate() {
            let p = r.feed(std::slice::from_ref(b));
            if i + 1 < req.len() {
                assert_eq!(p, Parsed::Partial, "{i}");
            } else {
                assert!(matches!(p, Parsed::Request(q) if q.target == "/healthz"));
            }
        }
        // An endless header is cut off at the cap with 431.
        let mut r = RequestReader::default();
        assert_eq!(r.feed(b"GET / HTTP/1.1\r\nX: "), Parsed::Partial);
        let junk = vec![b'a'; 64 * 1024];
        assert_eq!(r.feed(&junk), Parsed::Invalid(431));
        assert_eq!(r.room(), 0);
        assert_eq!(r.feed(&junk), Parsed::Invalid(431));
    }

    #[test]
    fn renders_head_without_body() {
        let r = Response::text(200, "ok");
        let full = String::from_utf8(render(&r, false)).unwrap();
        assert!(full.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(full.contains("Content-Length: 3\r\n"));
        assert!(full.ends_with("\r\n\r\nok\n"));
        let head = String::from_utf8(render(&r, true)).unwrap();
        assert!(head.ends_with("\r\n\r\n"));
        assert!(head.contains("Content-Length: 3\r\n"));
    }

    /// A drain starts only once its order is answered: a drain at rate 0
    /// may end the process at once, and the 202 must not go down with it.
    /// Here the drain blocks, as a process that has ended would, until the
    /// client has read the whole answer (a blocked drain before the write
    /// would leave the client with nothing).
    #[test]
    fn a_drain_starts_once_its_order_is_answered() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (ordered, orders) = std::sync::mpsc::channel::<f64>();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = std::sync::Mutex::new(released);
        let state = AdminState {
            metrics: Arc::new(Metrics::new(1)),
            shared: Arc::new(Shared::new(10, Arc::default())),
            token: AdminToken::fixed("tok"),
            drain: Box::new(move |rate| {
                ordered.send(rate).unwrap();
                let _ = released
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(10));
            }),
            default_drain_rate: 50.0,
        };
        spawn(listener, state).unwrap();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        client
            .write_all(b"POST /drain?rate=0 HTTP/1.1\r\nAuthorization: Bearer tok\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let read = client.read_to_string(&mut answer);
        let rate = orders.recv_timeout(Duration::from_secs(5));
        release.send(()).unwrap();
        read.unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 202 Accepted\r\n"),
            "{answer:?}"
        );
        assert!(
            answer.ends_with("{\"action\":\"drain\",\"rate\":0,\"live\":0}\n"),
            "{answer:?}"
        );
        assert_eq!(rate, Ok(0.0));
    }
}
