//! `c10m-loadgen`: opens many long-lived connections to a server, pings a
//! fraction of them and reports round-trip percentiles (HdrHistogram). The
//! `c10m-loadgen` binary runs [`run`] and prints its [`Report`]; the
//! server's scale tests, `make bench-server` and the end-to-end tests drive
//! it. WebSocket frames come from `c10m_server::ws`, the server's own codec.
//!
//! One process holds at most `--per-process` connections (RLIMIT_NOFILE is
//! capped at 20,000 per process on our machines), so above that the
//! generator re-executes itself as child processes, each with its own share
//! of the connections, the ramp rate and the ping rate, and its own range of
//! source addresses. Children report NDJSON events on stdout; the parent
//! merges them (histograms included) into one result.
//!
//! Source addresses: 127.S.x.y with S = `--source-net` + child index, bound
//! with `IP_BIND_ADDRESS_NO_PORT` so the kernel picks the port at
//! `connect()` time and every (source, destination) pair gets the whole
//! local port range [source: `docs/KERNEL_FACTS.md`]. Only towards loopback
//! targets: a connection to any other address (a pod on the test plane's
//! bridge) leaves the source to the route, since a 127/8 source off the
//! loopback device is a martian the kernel drops.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use serde::{Deserialize, Serialize};
use socket2::{Domain, Socket, Type};

use c10m_server::ws;

pub mod calibrate;

/// Bytes of one echo-mode ping: a fixed 16-byte message the server echoes
/// back unchanged (in WebSocket mode the same 16 bytes travel as a binary
/// frame).
pub const PING_BYTES: usize = 16;

/// Default connections per process: RLIMIT_NOFILE is 20,000 per process
/// here [`shared/DESIGN.md`, machine facts], less room for stdio and epoll.
pub const DEFAULT_PER_PROCESS: u64 = 19_000;

/// Largest round trip recorded, in microseconds (60 s); longer ones are
/// clamped. Three significant digits keep the histogram within 0.1 %.
pub const MAX_RTT_US: u64 = 60_000_000;

/// Wire protocol of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Raw bytes echoed back.
    Echo,
    /// WebSocket: upgrade first, then binary frames echoed back.
    Websocket,
}

/// `c10m-loadgen` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "c10m-loadgen",
    version,
    about = "Opens N long-lived connections over many 127.x.y.z source addresses, pings a fraction \
             of them and reports round-trip percentiles as JSON"
)]
pub struct Args {
    /// Server address (repeat to spread connections round-robin).
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub target: Vec<SocketAddrV4>,
    /// File of `ip:port` lines, re-read when it changes; every new or
    /// re-opened connection picks one of them at random, as an L4 load
    /// balancer would (so reconnects reach shards added later). Overrides --target.
    #[arg(long)]
    pub targets_file: Option<std::path::PathBuf>,
    /// Connections to open and hold.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub connections: u64,
    /// New connections per second over all processes; 0: as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Protocol of the target.
    #[arg(long, value_enum, default_value_t = Mode::Echo)]
    pub protocol: Mode,
    /// Fraction of connections that ping (0 to 1).
    #[arg(long, default_value_t = 0.01)]
    pub ping_fraction: f64,
    /// Pings per second over all processes; 0: no pings.
    #[arg(long, default_value_t = 1000.0)]
    pub ping_rate: f64,
    /// Seconds to wait idle after every connection is up, before pinging.
    #[arg(long, default_value_t = 0.0)]
    pub settle: f64,
    /// Seconds to ping (and hold) after settling; 0: hold until SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    pub hold: f64,
    /// Split the ping period into this many equal windows and report each
    /// window's p99 too (`windowRttP99Us`), so a burst of unrelated load on
    /// a shared machine shows up as one outlying window instead of moving
    /// the whole run's tail. Needs `--hold` > 0.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub windows: u32,
    /// Second octet of the first process's source addresses (127.S.x.y).
    #[arg(long, default_value_t = 100)]
    pub source_net: u8,
    /// Most connections per process; more spawns child processes.
    #[arg(long, default_value_t = DEFAULT_PER_PROCESS)]
    pub per_process: u64,
    /// Reopen connections the server closes, after a jittered backoff.
    #[arg(long)]
    pub reconnect: bool,
    /// Smallest reconnect backoff, in milliseconds (doubles per failed attempt).
    #[arg(long, default_value_t = 100)]
    pub backoff_min_ms: u64,
    /// Largest reconnect backoff, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub backoff_max_ms: u64,
    /// Seconds a connect (and WebSocket upgrade) may take before it counts as
    /// an error.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
    /// Print NDJSON events (progress, connected, result) on stdout instead
    /// of only the final result.
    #[arg(long)]
    pub events: bool,
    /// No progress bar on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Internal: run as child process INDEX (source addresses, share).
    #[arg(long, hide = true)]
    pub child: Option<u8>,
}

/// A process's share of `total` when split over `parts` processes.
pub fn share(total: u64, parts: u64, index: u64) -> u64 {
    total / parts + u64::from(index < total % parts)
}

/// Source address of connection `i` in process `child`: 127.S.x.y with
/// x, y in 1..=250, so no address ends in .0 or .255.
pub fn source_addr(source_net: u8, child: u8, i: u64) -> Ipv4Addr {
    let s = source_net.wrapping_add(child);
    Ipv4Addr::new(127, s, ((i / 250) % 250) as u8 + 1, (i % 250) as u8 + 1)
}

/// Reconnect delay after `attempt` failures: uniform in
/// `[0, min(max, min · 2^attempt)]` ("full jitter", so a fleet of clients
/// cut off at once does not come back at once).
pub fn backoff(attempt: u32, min_ms: u64, max_ms: u64, rng: &mut fastrand::Rng) -> Duration {
    let ceiling = min_ms
        .saturating_mul(1u64 << attempt.min(20))
        .min(max_ms)
        .max(1);
    Duration::from_millis(rng.u64(0..=ceiling))
}

/// The upgrade request the generator sends.
pub fn upgrade_request(host: SocketAddrV4, key: &str) -> Vec<u8> {
    format!(
        "GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    .into_bytes()
}

/// NDJSON lines a process writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Event {
    /// Once a second while ramping.
    Progress {
        /// Connections open now.
        open: u64,
        /// Connect (or upgrade) errors so far.
        errors: u64,
    },
    /// Every connection of the ramp has been opened or has failed.
    #[serde(rename_all = "camelCase")]
    Connected {
        /// Connections open now.
        open: u64,
        /// Connect errors so far.
        errors: u64,
        /// Seconds from start to this point.
        ramp_seconds: f64,
    },
    /// Final report.
    Result(Box<Report>),
}

/// What a run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Connections asked for.
    pub connections: u64,
    /// Connections open at the end of the ramp.
    pub connected: u64,
    /// Connections open at the end of the run.
    pub open_at_end: u64,
    /// Connect and upgrade failures, total.
    pub connect_errors: u64,
    /// Failures by kind (`refused`, `timeout`, `reset`, `upgrade`, ...).
    pub error_kinds: BTreeMap<String, u64>,
    /// Connections the server closed (EOF, reset or WebSocket close).
    pub closed_by_server: u64,
    /// [`Report::closed_by_server`] by the Unix second (UTC wall clock) the
    /// client saw each close in: the fleet-wide close rate, second by
    /// second, as the clients felt it (the rollout e2e test holds it to the
    /// reconnect budget). Keys are the seconds in decimal (strings: the
    /// children's NDJSON events, an internally tagged enum, cannot carry
    /// integer map keys through serde); seconds without a close are absent.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub closes_by_second: BTreeMap<String, u64>,
    /// Most server closes one client saw over the run (a client is one
    /// connection slot with all its reconnects): 1 when a rollout moved
    /// each client once at most.
    #[serde(default)]
    pub most_closes_per_client: u64,
    /// Clients the server closed more than once.
    #[serde(default)]
    pub clients_closed_twice: u64,
    /// WebSocket close frames received, by status code.
    pub goodbyes: BTreeMap<String, u64>,
    /// Reconnects started.
    pub reconnects: u64,
    /// Seconds to open every connection.
    pub ramp_seconds: f64,
    /// Connections opened per second during the ramp.
    pub connect_rate_per_sec: f64,
    /// Pings sent.
    pub pings: u64,
    /// Ping replies received.
    pub pongs: u64,
    /// Round-trip percentiles, microseconds.
    pub rtt_p50_us: u64,
    /// 99th percentile round trip, microseconds.
    pub rtt_p99_us: u64,
    /// 99.9th percentile round trip, microseconds.
    pub rtt_p999_us: u64,
    /// Longest round trip, microseconds.
    pub rtt_max_us: u64,
    /// 99th percentile round trip of each `--windows` window, microseconds.
    #[serde(default)]
    pub window_rtt_p99_us: Vec<u64>,
    /// The round-trip histogram, HdrHistogram V2, base64 (children only).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub histogram: String,
    /// Per-window histograms, as `histogram` (children only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub window_histograms: Vec<String>,
}

/// A fresh round-trip histogram (1 µs to [`MAX_RTT_US`], 3 digits).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_RTT_US, 3).expect("valid histogram bounds")
}

/// 99th percentile of `h` (0 if empty).
pub fn p99(h: &Histogram<u64>) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(0.99)
    }
}

/// Encodes a histogram as base64 HdrHistogram V2.
pub fn encode_histogram(h: &Histogram<u64>) -> String {
    let mut buf = Vec::new();
    V2Serializer::new()
        .serialize(h, &mut buf)
        .expect("serializing to memory");
    base64::engine::general_purpose::STANDARD.encode(buf)
}

/// Decodes [`encode_histogram`]'s output.
pub fn decode_histogram(s: &str) -> Option<Histogram<u64>> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
    Deserializer::new().deserialize(&mut bytes.as_slice()).ok()
}

impl Report {
    /// Fills the percentiles from `h`.
    pub fn set_rtt(&mut self, h: &Histogram<u64>) {
        if h.is_empty() {
            return;
        }
        self.rtt_p50_us = h.value_at_quantile(0.5);
        self.rtt_p99_us = h.value_at_quantile(0.99);
        self.rtt_p999_us = h.value_at_quantile(0.999);
        self.rtt_max_us = h.max();
    }

    /// Adds a child's counts into this report.
    pub fn absorb(&mut self, o: &Report) {
        self.connections += o.connections;
        self.connected += o.connected;
        self.open_at_end += o.open_at_end;
        self.connect_errors += o.connect_errors;
        for (k, v) in &o.error_kinds {
            *self.error_kinds.entry(k.clone()).or_default() += v;
        }
        self.closed_by_server += o.closed_by_server;
        for (k, v) in &o.closes_by_second {
            *self.closes_by_second.entry(k.clone()).or_default() += v;
        }
        self.most_closes_per_client = self.most_closes_per_client.max(o.most_closes_per_client);
        self.clients_closed_twice += o.clients_closed_twice;
        for (k, v) in &o.goodbyes {
            *self.goodbyes.entry(k.clone()).or_default() += v;
        }
        self.reconnects += o.reconnects;
        self.pings += o.pings;
        self.pongs += o.pongs;
    }
}

fn error_kind(e: &io::Error) -> &'static str {
    match e.kind() {
        ErrorKind::ConnectionRefused => "refused",
        ErrorKind::ConnectionReset => "reset",
        ErrorKind::TimedOut => "timeout",
        ErrorKind::AddrInUse => "addr_in_use",
        ErrorKind::AddrNotAvailable => "addr_not_available",
        _ if e.raw_os_error() == Some(libc::EMFILE) => "emfile",
        _ => "other",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Connecting,
    Upgrading,
    Open,
    Waiting,
    Dead,
}

struct Client {
    stream: Option<TcpStream>,
    st: St,
    since: Instant,
    ping_at: Option<Instant>,
    got: usize,
    attempts: u32,
    upgrade: Vec<u8>,
    /// Times the server closed this client.
    closes: u64,
}

/// One process's event loop.
/// Where connections go: `--target` round-robin, or `--targets-file` at random.
struct Targets {
    list: Vec<SocketAddrV4>,
    file: Option<std::path::PathBuf>,
    modified: Option<std::time::SystemTime>,
    checked: Instant,
}

/// Parses `ip:port` lines (blank lines and `#` comments skipped).
pub fn parse_targets(text: &str) -> anyhow::Result<Vec<SocketAddrV4>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.parse().map_err(|e| anyhow::anyhow!("target {l:?}: {e}")))
        .collect()
}

impl Targets {
    /// How often a changed targets file is noticed.
    const RECHECK: Duration = Duration::from_millis(500);

    fn new(args: &Args) -> anyhow::Result<Targets> {
        let mut t = Targets {
            list: args.target.clone(),
            file: args.targets_file.clone(),
            modified: None,
            checked: Instant::now(),
        };
        if t.file.is_some() {
            t.reload()?;
            anyhow::ensure!(!t.list.is_empty(), "--targets-file lists no target");
        }
        Ok(t)
    }

    fn reload(&mut self) -> anyhow::Result<()> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let modified = std::fs::metadata(path)?.modified().ok();
        if modified != self.modified || modified.is_none() {
            let list = parse_targets(&std::fs::read_to_string(path)?)?;
            // A file caught mid-write may be empty: keep the last good list.
            if !list.is_empty() {
                self.list = list;
                self.modified = modified;
            }
        }
        Ok(())
    }

    fn pick(&mut self, i: usize, rng: &mut fastrand::Rng) -> SocketAddrV4 {
        if self.file.is_none() {
            return self.list[i % self.list.len()];
        }
        if self.checked.elapsed() >= Self::RECHECK {
            self.checked = Instant::now();
            let _ = self.reload();
        }
        self.list[rng.usize(..self.list.len())]
    }
}

struct Gen {
    args: Args,
    targets: Targets,
    child: u8,
    n: u64,
    poll: Poll,
    clients: Vec<Client>,
    active: Vec<usize>,
    next_active: usize,
    report: Report,
    hist: Histogram<u64>,
    windows: Vec<Histogram<u64>>,
    window: usize,
    rng: fastrand::Rng,
    retry: BinaryHeap<Reverse<(Instant, usize)>>,
    open: u64,
    pending: u64,
    opened: u64,
    ws_key: String,
}

/// Sets `IP_BIND_ADDRESS_NO_PORT` (Linux 4.2+) on `s`: a later `bind` to a
/// source address with port 0 leaves the port to `connect`, so every
/// (source, destination) pair gets the whole local port range. Neither
/// socket2 nor rustix wraps this option. The server's scale test opens its
/// abusive connections with it too.
#[allow(unsafe_code)]
pub fn bind_address_no_port(s: &Socket) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `s` is an open socket we own for the whole call, and the
    // option value points to a live `c_int` whose size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A non-blocking connect to `dst`, from `src` when given (bound with
/// `IP_BIND_ADDRESS_NO_PORT`), else from the address the route picks.
pub fn open_socket(src: Option<Ipv4Addr>, dst: SocketAddrV4) -> io::Result<TcpStream> {
    let s = Socket::new(
        Domain::IPV4,
        Type::STREAM.nonblocking().cloexec(),
        Some(socket2::Protocol::TCP),
    )?;
    s.set_tcp_nodelay(true)?;
    if let Some(src) = src {
        bind_address_no_port(&s)?;
        s.bind(&SocketAddr::from((src, 0)).into())?;
    }
    match s.connect(&SocketAddr::V4(dst).into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(TcpStream::from_std(s.into()))
}

impl Gen {
    fn new(args: Args, child: u8, n: u64) -> io::Result<Gen> {
        let stride = if args.ping_fraction > 0.0 {
            (1.0 / args.ping_fraction.min(1.0)).round().max(1.0) as u64
        } else {
            u64::MAX
        };
        let active = (0..n)
            .filter(|i| args.ping_rate > 0.0 && i % stride == 0)
            .map(|i| i as usize)
            .collect();
        let mut rng = fastrand::Rng::with_seed(0xc10 + u64::from(child));
        let key: [u8; 16] = std::array::from_fn(|_| rng.u8(..));
        let targets = Targets::new(&args).map_err(io::Error::other)?;
        Ok(Gen {
            targets,
            child,
            n,
            poll: Poll::new()?,
            clients: Vec::with_capacity(n as usize),
            active,
            next_active: 0,
            report: Report {
                connections: n,
                ..Report::default()
            },
            hist: new_histogram(),
            windows: (0..args.windows).map(|_| new_histogram()).collect(),
            window: 0,
            rng,
            retry: BinaryHeap::new(),
            open: 0,
            pending: 0,
            opened: 0,
            ws_key: base64::engine::general_purpose::STANDARD.encode(key),
            args,
        })
    }

    /// Counts a close of client `i` by the server: in the totals, in its
    /// second and against the client.
    fn closed_by_server(&mut self, i: usize) {
        let r = &mut self.report;
        r.closed_by_server += 1;
        let second = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        *r.closes_by_second.entry(second.to_string()).or_default() += 1;
        let c = &mut self.clients[i];
        c.closes += 1;
        r.most_closes_per_client = r.most_closes_per_client.max(c.closes);
        if c.closes == 2 {
            r.clients_closed_twice += 1;
        }
    }

    fn fail(&mut self, i: usize, kind: &'static str, counts_as_error: bool) {
        let c = &mut self.clients[i];
        if let Some(mut s) = c.stream.take() {
            let _ = self.poll.registry().deregister(&mut s);
        }
        match c.st {
            St::Open => self.open -= 1,
            St::Connecting | St::Upgrading => self.pending -= 1,
            _ => {}
        }
        c.ping_at = None;
        c.got = 0;
        c.upgrade = Vec::new();
        if counts_as_error {
            self.report.connect_errors += 1;
            *self.report.error_kinds.entry(kind.into()).or_default() += 1;
        }
        if self.args.reconnect {
            c.attempts += 1;
            let d = backoff(
                c.attempts,
                self.args.backoff_min_ms,
                self.args.backoff_max_ms,
                &mut self.rng,
            );
            c.st = St::Waiting;
            self.retry.push(Reverse((Instant::now() + d, i)));
        } else {
            c.st = St::Dead;
        }
    }

    fn connect(&mut self, i: usize) {
        let dst = self.targets.pick(i, &mut self.rng);
        let src = dst
            .ip()
            .is_loopback()
            .then(|| source_addr(self.args.source_net, self.child, i as u64));
        let now = Instant::now();
        if i == self.clients.len() {
            self.clients.push(Client {
                stream: None,
                st: St::Connecting,
                since: now,
                ping_at: None,
                got: 0,
                attempts: 0,
                upgrade: Vec::new(),
                closes: 0,
            });
        }
        let c = &mut self.clients[i];
        c.st = St::Connecting;
        c.since = now;
        self.pending += 1;
        match open_socket(src, dst) {
            Ok(mut s) => {
                let r = self.poll.registry().register(
                    &mut s,
                    Token(i),
                    Interest::READABLE | Interest::WRITABLE,
                );
                c.stream = Some(s);
                if let Err(e) = r {
                    self.fail(i, error_kind(&e), true);
                }
            }
            Err(e) => self.fail(i, error_kind(&e), true),
        }
    }

    fn on_event(&mut self, i: usize, scratch: &mut [u8]) {
        let st = self.clients[i].st;
        match st {
            St::Connecting => {
                let c = &mut self.clients[i];
                let Some(s) = c.stream.as_mut() else { return };
                match s.take_error() {
                    Ok(Some(e)) | Err(e) => return self.fail(i, error_kind(&e), true),
                    Ok(None) => {}
                }
                let peer = match s.peer_addr() {
                    Ok(SocketAddr::V4(a)) => a,
                    Ok(SocketAddr::V6(_)) => return self.fail(i, "ipv6", true),
                    Err(e) if e.kind() == ErrorKind::NotConnected => return,
                    Err(e) => return self.fail(i, error_kind(&e), true),
                };
                if self.args.protocol == Mode::Websocket {
                    let req = upgrade_request(peer, &self.ws_key);
                    if s.write_all(&req).is_err() {
                        return self.fail(i, "upgrade", true);
                    }
                    c.st = St::Upgrading;
                    self.on_readable(i, scratch);
                } else {
                    self.established(i);
                }
            }
            St::Upgrading | St::Open => self.on_readable(i, scratch),
            St::Waiting | St::Dead => {}
        }
    }

    fn established(&mut self, i: usize) {
        let c = &mut self.clients[i];
        c.st = St::Open;
        c.attempts = 0;
        c.upgrade = Vec::new();
        self.pending -= 1;
        self.open += 1;
        if let Some(s) = c.stream.as_mut() {
            let _ = self
                .poll
                .registry()
                .reregister(s, Token(i), Interest::READABLE);
        }
    }

    fn on_readable(&mut self, i: usize, scratch: &mut [u8]) {
        loop {
            let c = &mut self.clients[i];
            let Some(s) = c.stream.as_mut() else { return };
            let n = match s.read(scratch) {
                Ok(0) => {
                    let upgrading = c.st == St::Upgrading;
                    if !upgrading {
                        self.closed_by_server(i);
                    }
                    return self.fail(i, "upgrade", upgrading);
                }
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    let upgrading = c.st == St::Upgrading;
                    if !upgrading {
                        self.closed_by_server(i);
                    }
                    return self.fail(i, error_kind(&e), upgrading);
                }
            };
            let data = &scratch[..n];
            if c.st == St::Upgrading {
                c.upgrade.extend_from_slice(data);
                let Some(end) = c.upgrade.windows(4).position(|w| w == b"\r\n\r\n") else {
                    if c.upgrade.len() > 4096 {
                        return self.fail(i, "upgrade", true);
                    }
                    continue;
                };
                if !c.upgrade.starts_with(b"HTTP/1.1 101") {
                    return self.fail(i, "upgrade", true);
                }
                // A server may send frames right behind its 101 (a draining
                // server's accept window answers with close 1001 at once):
                // they are the first bytes of the frame stream.
                let extra = c.upgrade.split_off(end + 4);
                self.established(i);
                if !extra.is_empty() && self.on_frames(i, &extra) {
                    return;
                }
                continue;
            }
            if self.on_frames(i, data) {
                return;
            }
        }
    }

    /// Bytes of client `i`'s frame stream (echo bytes, or WebSocket frames):
    /// a close frame as the first bytes is the server's goodbye, counted by
    /// its code; otherwise they count towards the pending ping's echo.
    /// True when the connection is gone.
    fn on_frames(&mut self, i: usize, data: &[u8]) -> bool {
        let n = data.len();
        let c = &mut self.clients[i];
        if self.args.protocol == Mode::Websocket && c.got == 0 && data[0] == 0x88 {
            let code = if n >= 4 {
                u16::from_be_bytes([data[2], data[3]]).to_string()
            } else {
                "none".into()
            };
            *self.report.goodbyes.entry(code).or_default() += 1;
            self.closed_by_server(i);
            self.fail(i, "goodbye", false);
            return true;
        }
        let want = match self.args.protocol {
            Mode::Echo => PING_BYTES,
            Mode::Websocket => PING_BYTES + 2,
        };
        if let Some(at) = c.ping_at {
            c.got += n;
            if c.got >= want {
                let us = at.elapsed().as_micros().clamp(1, u128::from(MAX_RTT_US)) as u64;
                let _ = self.hist.record(us);
                if let Some(w) = self.windows.get_mut(self.window) {
                    let _ = w.record(us);
                }
                self.report.pongs += 1;
                let c = &mut self.clients[i];
                c.ping_at = None;
                c.got = 0;
            }
        }
        false
    }

    fn ping_one(&mut self) -> bool {
        let len = self.active.len();
        for _ in 0..len {
            let i = self.active[self.next_active % len];
            self.next_active = (self.next_active + 1) % len;
            let Some(c) = self.clients.get_mut(i) else {
                continue;
            };
            if c.st != St::Open || c.ping_at.is_some() {
                continue;
            }
            let payload = [0x70u8; PING_BYTES];
            let bytes = match self.args.protocol {
                Mode::Echo => payload.to_vec(),
                Mode::Websocket => {
                    ws::client_frame(true, ws::opcode::BINARY, &payload, [1, 2, 3, 4])
                }
            };
            let Some(s) = c.stream.as_mut() else { continue };
            c.ping_at = Some(Instant::now());
            c.got = 0;
            if s.write_all(&bytes).is_err() {
                self.closed_by_server(i);
                self.fail(i, "reset", false);
                continue;
            }
            self.report.pings += 1;
            return true;
        }
        false
    }

    fn check_timeouts(&mut self) {
        let limit = Duration::from_secs(self.args.connect_timeout);
        let now = Instant::now();
        let late: Vec<usize> = self
            .clients
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                matches!(c.st, St::Connecting | St::Upgrading) && now - c.since > limit
            })
            .map(|(i, _)| i)
            .collect();
        for i in late {
            self.fail(i, "timeout", true);
        }
    }

    fn run(mut self, stop: &AtomicBool, out: &mut dyn FnMut(&Event)) -> io::Result<Report> {
        let mut events = Events::with_capacity(4096);
        let mut scratch = vec![0u8; 64 * 1024];
        let start = Instant::now();
        let mut last_progress = start;
        let mut last_timeout_check = start;
        let mut ramp_done: Option<Instant> = None;
        let per_proc_ping = self.args.ping_rate;
        let mut pings_due_from: Option<Instant> = None;
        let mut pinged: u64 = 0;
        loop {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let now = Instant::now();
            // Ramp: open what the rate allows by now.
            if self.opened < self.n {
                let allowed = if self.args.rate > 0.0 {
                    ((now - start).as_secs_f64() * self.args.rate) as u64 + 1
                } else {
                    self.opened + 512
                };
                while self.opened < self.n.min(allowed) && self.pending < 4096 {
                    let i = self.opened as usize;
                    self.opened += 1;
                    self.connect(i);
                }
            }
            // Retries whose backoff has passed.
            while let Some(Reverse((at, i))) = self.retry.peek().copied() {
                if at > now {
                    break;
                }
                self.retry.pop();
                self.report.reconnects += 1;
                self.connect(i);
            }
            if ramp_done.is_none() && self.opened == self.n && self.pending == 0 {
                let t = now;
                ramp_done = Some(t);
                self.report.connected = self.open;
                self.report.ramp_seconds = (t - start).as_secs_f64();
                out(&Event::Connected {
                    open: self.open,
                    errors: self.report.connect_errors,
                    ramp_seconds: self.report.ramp_seconds,
                });
                pings_due_from = Some(t + Duration::from_secs_f64(self.args.settle));
            }
            if let Some(t0) = pings_due_from.filter(|&t0| now >= t0) {
                {
                    let end = t0 + Duration::from_secs_f64(self.args.hold);
                    if self.args.hold > 0.0 && now >= end {
                        break;
                    }
                    if self.args.hold > 0.0 {
                        let frac = (now - t0).as_secs_f64() / self.args.hold;
                        self.window = ((frac * f64::from(self.args.windows)) as usize)
                            .min(self.windows.len().saturating_sub(1));
                    }
                    if per_proc_ping > 0.0 {
                        let due = ((now - t0).as_secs_f64() * per_proc_ping) as u64 + 1;
                        while pinged < due {
                            pinged += 1;
                            if !self.ping_one() {
                                break;
                            }
                        }
                        pinged = pinged.max(due);
                    }
                }
            }
            if now - last_progress >= Duration::from_secs(1) {
                last_progress = now;
                if ramp_done.is_none() {
                    out(&Event::Progress {
                        open: self.open,
                        errors: self.report.connect_errors,
                    });
                }
            }
            if now - last_timeout_check >= Duration::from_secs(1) {
                last_timeout_check = now;
                self.check_timeouts();
            }
            // Sleep until the next thing due: the next ramp step (1 ms
            // steps), or the next ping, else 50 ms (retries, timeouts,
            // progress), so idle children do not steal the CPUs whose
            // scheduling latency the pings measure.
            let mut timeout = Duration::from_millis(50);
            if self.opened < self.n {
                timeout = Duration::from_millis(1);
            }
            if let Some(t0) = pings_due_from {
                if per_proc_ping > 0.0 && !self.active.is_empty() {
                    let next = t0 + Duration::from_secs_f64(pinged as f64 / per_proc_ping);
                    timeout = timeout.min(next.saturating_duration_since(Instant::now()));
                } else if self.args.hold > 0.0 {
                    let end = t0 + Duration::from_secs_f64(self.args.hold);
                    timeout = timeout.min(end.saturating_duration_since(Instant::now()));
                }
            }
            match self.poll.poll(&mut events, Some(timeout)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for ev in events.iter() {
                self.on_event(ev.token().0, &mut scratch);
            }
        }
        if ramp_done.is_none() {
            self.report.connected = self.open;
            self.report.ramp_seconds = start.elapsed().as_secs_f64();
        }
        if self.report.ramp_seconds > 0.0 {
            self.report.connect_rate_per_sec =
                self.report.connected as f64 / self.report.ramp_seconds;
        }
        self.report.open_at_end = self.open;
        // Abortive close (RST): no TIME_WAIT left behind on 127.x addresses.
        for c in &mut self.clients {
            if let Some(s) = c.stream.take() {
                let sock = Socket::from(std::net::TcpStream::from(s));
                let _ = sock.set_linger(Some(Duration::ZERO));
            }
        }
        self.report.set_rtt(&self.hist);
        self.report.histogram = encode_histogram(&self.hist);
        self.report.window_rtt_p99_us = self.windows.iter().map(p99).collect();
        self.report.window_histograms = self.windows.iter().map(encode_histogram).collect();
        Ok(self.report)
    }
}

fn emit_line(e: &Event) {
    let mut stdout = io::stdout().lock();
    let _ = serde_json::to_writer(&mut stdout, e);
    let _ = stdout.write_all(b"\n");
    let _ = stdout.flush();
}

fn progress_bar(open: u64, errors: u64, n: u64, started: Instant) {
    let width = 30;
    let filled = (open.min(n) * width / n.max(1)) as usize;
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    eprintln!(
        "[{}{}] {open}/{n} open, {errors} errors, {:.0} conn/s",
        "#".repeat(filled),
        " ".repeat(width as usize - filled),
        open as f64 / secs
    );
}

/// Runs the generator as `args` says; returns the merged report.
pub fn run(args: Args) -> anyhow::Result<Report> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    anyhow::ensure!(!args.target.is_empty(), "no --target");
    if let Some(child) = args.child {
        let g = Gen::new(args.clone(), child, args.connections)?;
        let report = g.run(&stop, &mut |e| emit_line(e))?;
        emit_line(&Event::Result(Box::new(report.clone())));
        return Ok(report);
    }
    let procs = args.connections.div_ceil(args.per_process.max(1)).max(1);
    anyhow::ensure!(
        procs <= 200,
        "too many processes ({procs}); raise --per-process"
    );
    let started = Instant::now();
    let exe = std::env::current_exe()?;
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Event)>();
    let mut children = Vec::new();
    for p in 0..procs {
        let n = share(args.connections, procs, p);
        let mut cmd = std::process::Command::new(&exe);
        let targets: Vec<String> = args
            .target
            .iter()
            .map(|t| format!("--target={t}"))
            .collect();
        cmd.args(&targets)
            .arg(format!("--connections={n}"))
            .arg(format!("--rate={}", args.rate / procs as f64))
            .arg(format!(
                "--protocol={}",
                match args.protocol {
                    Mode::Echo => "echo",
                    Mode::Websocket => "websocket",
                }
            ))
            .arg(format!("--ping-fraction={}", args.ping_fraction))
            .arg(format!("--ping-rate={}", args.ping_rate / procs as f64))
            .arg(format!("--settle={}", args.settle))
            .arg(format!("--hold={}", args.hold))
            .arg(format!("--windows={}", args.windows))
            .arg(format!("--source-net={}", args.source_net))
            .arg(format!("--per-process={}", args.per_process))
            .arg(format!("--backoff-min-ms={}", args.backoff_min_ms))
            .arg(format!("--backoff-max-ms={}", args.backoff_max_ms))
            .arg(format!("--connect-timeout={}", args.connect_timeout))
            .arg(format!("--child={p}"))
            .stdout(std::process::Stdio::piped())
            .stdin(std::process::Stdio::null());
        if args.reconnect {
            cmd.arg("--reconnect");
        }
        if let Some(f) = &args.targets_file {
            cmd.arg("--targets-file").arg(f);
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().expect("piped stdout");
        let tx = tx.clone();
        let idx = p as usize;
        std::thread::spawn(move || {
            for line in io::BufRead::lines(io::BufReader::new(stdout)).map_while(Result::ok) {
                if let Ok(e) = serde_json::from_str::<Event>(&line) {
                    let _ = tx.send((idx, e));
                }
            }
        });
        children.push(child);
    }
    drop(tx);
    let k = children.len();
    let mut open = vec![0u64; k];
    let mut errors = vec![0u64; k];
    let mut connected = vec![false; k];
    let mut results: Vec<Option<Report>> = vec![None; k];
    let mut ramp_seconds = 0.0;
    let mut forwarded = false;
    let mut last_bar = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) && !forwarded {
            forwarded = true;
            for c in &children {
                let pid = rustix::process::Pid::from_raw(c.id() as i32);
                if let Some(pid) = pid {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                }
            }
        }
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((i, Event::Progress { open: o, errors: e })) => {
                open[i] = o;
                errors[i] = e;
            }
            Ok((
                i,
                Event::Connected {
                    open: o, errors: e, ..
                },
            )) => {
                open[i] = o;
                errors[i] = e;
                connected[i] = true;
                if connected.iter().all(|&c| c) {
                    ramp_seconds = started.elapsed().as_secs_f64();
                    let ev = Event::Connected {
                        open: open.iter().sum(),
                        errors: errors.iter().sum(),
                        ramp_seconds,
                    };
                    if !args.quiet {
                        progress_bar(
                            open.iter().sum(),
                            errors.iter().sum(),
                            args.connections,
                            started,
                        );
                    }
                    if args.events {
                        emit_line(&ev);
                    }
                }
            }
            Ok((i, Event::Result(r))) => results[i] = Some(*r),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if !connected.iter().all(|&c| c) && last_bar.elapsed() >= Duration::from_secs(1) {
            last_bar = Instant::now();
            let (o, e) = (open.iter().sum(), errors.iter().sum());
            if !args.quiet {
                progress_bar(o, e, args.connections, started);
            }
            if args.events {
                emit_line(&Event::Progress { open: o, errors: e });
            }
        }
    }
    for mut c in children {
        let _ = c.wait();
    }
    let mut report = Report::default();
    let mut hist = new_histogram();
    let mut windows: Vec<Histogram<u64>> = (0..args.windows).map(|_| new_histogram()).collect();
    for r in results.iter().flatten() {
        report.absorb(r);
        if let Some(h) = decode_histogram(&r.histogram) {
            let _ = hist.add(&h);
        }
        for (w, enc) in windows.iter_mut().zip(&r.window_histograms) {
            if let Some(h) = decode_histogram(enc) {
                let _ = w.add(&h);
            }
        }
    }
    report.window_rtt_p99_us = windows.iter().map(p99).collect();
    anyhow::ensure!(
        results.iter().all(Option::is_some),
        "{} of {k} load generator processes did not report",
        results.iter().filter(|r| r.is_none()).count()
    );
    report.ramp_seconds = if ramp_seconds > 0.0 {
        ramp_seconds
    } else {
        results
            .iter()
            .flatten()
            .map(|r| r.ramp_seconds)
            .fold(0.0, f64::max)
    };
    if report.ramp_seconds > 0.0 {
        report.connect_rate_per_sec = report.connected as f64 / report.ramp_seconds;
    }
    report.set_rtt(&hist);
    Ok(report)
}

#[cfg(test)]
mod tests {
    #[test]
    fn children_closes_merge_by_second_and_the_worst_client_wins() {
        let mut a = super::Report {
            closed_by_server: 3,
            closes_by_second: [("100".into(), 2), ("101".into(), 1)].into(),
            most_closes_per_client: 1,
            ..Default::default()
        };
        let b = super::Report {
            closed_by_server: 4,
            closes_by_second: [("101".into(), 2), ("105".into(), 2)].into(),
            most_closes_per_client: 2,
            clients_closed_twice: 1,
            ..Default::default()
        };
        a.absorb(&b);
        assert_eq!(a.closed_by_server, 7);
        let by_second: Vec<(&str, u64)> = a
            .closes_by_second
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(by_second, [("100", 2), ("101", 3), ("105", 2)]);
        assert_eq!((a.most_closes_per_client, a.clients_closed_twice), (2, 1));
    }

    #[test]
    fn targets_files_parse_and_are_picked_at_random() {
        let list = super::parse_targets("# shards\n127.1.1.2:7000\n\n 127.1.2.3:7000 \n").unwrap();
        assert_eq!(list.len(), 2);
        assert!(super::parse_targets("127.1.1.2").is_err());
        let path = std::env::temp_dir().join(format!("c10m-targets-{}", std::process::id()));
        std::fs::write(&path, "127.1.1.2:7000\n127.1.2.3:7000\n").unwrap();
        let mut args = Args::parse_from(["c10m-loadgen"]);
        args.targets_file = Some(path.clone());
        let mut t = super::Targets::new(&args).unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        let picked: std::collections::BTreeSet<_> = (0..64).map(|_| t.pick(0, &mut rng)).collect();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            picked.len(),
            2,
            "the same connection index reaches both targets"
        );
    }

    use super::*;

    #[test]
    fn shares_add_up() {
        let parts: Vec<u64> = (0..8).map(|i| share(150_000, 8, i)).collect();
        assert_eq!(parts.iter().sum::<u64>(), 150_000);
        assert_eq!(parts[0], 18_750);
        let parts: Vec<u64> = (0..3).map(|i| share(40_000, 3, i)).collect();
        assert_eq!(parts, [13_334, 13_333, 13_333]);
    }

    #[test]
    fn source_addresses_stay_in_loopback_and_avoid_0_and_255() {
        assert_eq!(source_addr(100, 0, 0), Ipv4Addr::new(127, 100, 1, 1));
        assert_eq!(source_addr(100, 2, 250), Ipv4Addr::new(127, 102, 2, 1));
        for i in (0..100_000).step_by(997) {
            let a = source_addr(100, 7, i);
            assert!(a.is_loopback());
            let o = a.octets();
            assert!((1..=250).contains(&o[2]) && (1..=250).contains(&o[3]));
        }
    }

    #[test]
    fn backoff_is_jittered_and_capped() {
        let mut rng = fastrand::Rng::with_seed(7);
        for attempt in 0..30 {
            let d = backoff(attempt, 100, 5000, &mut rng);
            assert!(d <= Duration::from_millis((100u64 << attempt.min(20)).min(5000)));
        }
        let ds: std::collections::HashSet<Duration> =
            (0..50).map(|_| backoff(6, 100, 5000, &mut rng)).collect();
        assert!(ds.len() > 10, "not jittered: {ds:?}");
    }

    #[test]
    fn histograms_round_trip_and_merge() {
        let mut a = new_histogram();
        for v in 1..=1000 {
            a.record(v).unwrap();
        }
        let b = decode_histogram(&encode_histogram(&a)).unwrap();
        assert_eq!(b.len(), 1000);
        let mut r = Report::default();
        r.set_rtt(&b);
        assert_eq!((r.rtt_p50_us, r.rtt_p99_us, r.rtt_max_us), (500, 990, 1000));
    }

    #[test]
    fn upgrade_request_is_accepted_by_the_server_side_parser() {
        let req = upgrade_request(
            "127.0.0.1:7000".parse().unwrap(),
            "dGhlIHNhbXBsZSBub25jZQ==",
        );
        assert!(matches!(ws::handshake(&req), ws::Handshake::Accept { .. }));
    }
}
