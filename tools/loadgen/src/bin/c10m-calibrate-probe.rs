//! `c10m-calibrate-probe`: the calibration probe of `c10m_wire::calibrate`.
//! Runs in a pod with `hostPID` and the host's `/sys/fs/cgroup` mounted
//! read-only, on the node of the shard pod it measures. It samples the pod
//! at 0 connections, opens idle connections up to each `--steps` count and
//! samples, then opens `--slow-readers` connections that each send 1 MiB
//! and never read, waits until the shard has taken what it will and
//! samples again. All connections come from this one process and are held
//! until the last sample.
//!
//! The report is one line of JSON on stdout, also written to
//! `/dev/termination-log` when that exists (the pod's termination message,
//! which the operator reads). On the first failure the probe stops and
//! reports the samples it has, with `error` saying why and how far it got;
//! it exits 1 then, else 0. Progress goes to stderr.

use std::fs;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use base64::Engine as _;
use c10m_loadgen::calibrate::{self as cal, Args, CgroupMode, PodCgroup, SockstatTcp};
use c10m_loadgen::{Mode, open_socket, upgrade_request};
use c10m_wire::calibrate::{Report, Sample};
use clap::Parser;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use socket2::Socket;

/// Most connections connecting (or upgrading) at once.
const IN_FLIGHT: usize = 256;

/// Seconds a connect, and a WebSocket upgrade after it, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Re-reads after the settle pause until two consecutive readings of the
/// pod's bytes agree within 1 %, one a second, at most this many.
const REREADS: usize = 10;
const REREAD_EVERY: Duration = Duration::from_secs(1);

/// The slow readers have been taken in when none could send more for
/// [`ABSORB_QUIET_ROUNDS`] rounds of [`ABSORB_ROUND`] and sockstat's `TCP
/// mem` did not move over them (as `make bench-fidelity` decides it); the
/// sample is taken anyway after [`ABSORB_LIMIT`].
const ABSORB_ROUND: Duration = Duration::from_millis(250);
const ABSORB_QUIET_ROUNDS: u32 = 3;
const ABSORB_LIMIT: Duration = Duration::from_secs(60);

/// Kubernetes' default `terminationMessagePath`; it keeps at most 4,096
/// bytes of it.
const TERMINATION_LOG: &str = "/dev/termination-log";
const TERMINATION_LOG_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Sends nothing after its upgrade.
    Idle,
    /// Sends [`c10m_wire::calibrate::SLOW_READER_SEND_BYTES`], reads nothing.
    Slow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting,
    /// Upgrade request sent, response not complete.
    Upgrading,
    Open,
}

struct Conn {
    stream: TcpStream,
    kind: Kind,
    phase: Phase,
    since: Instant,
    /// The upgrade response so far.
    response: Vec<u8>,
    /// Bytes of the slow reader's stream written so far.
    sent: usize,
}

/// The probe's connections to the shard, driven by one mio loop.
struct Conns {
    poll: Poll,
    events: Events,
    target: SocketAddrV4,
    protocol: Mode,
    deadline: Instant,
    timeout_seconds: u64,
    list: Vec<Conn>,
    /// Connections open (upgraded), by kind.
    idle: u64,
    slow: u64,
    /// Connections connecting or upgrading.
    pending: usize,
    request: Vec<u8>,
    slow_stream: Vec<u8>,
    /// Bytes the slow readers wrote since this was last reset.
    written: u64,
    last_timeout_check: Instant,
}

impl Conns {
    fn new(args: &Args, deadline: Instant) -> Result<Conns, String> {
        let mut rng = fastrand::Rng::new();
        let key: [u8; 16] = std::array::from_fn(|_| rng.u8(..));
        let key = base64::engine::general_purpose::STANDARD.encode(key);
        Ok(Conns {
            poll: Poll::new().map_err(|e| format!("epoll: {e}"))?,
            events: Events::with_capacity(1024),
            target: args.target,
            protocol: args.protocol,
            deadline,
            timeout_seconds: args.timeout_seconds,
            list: Vec::new(),
            idle: 0,
            slow: 0,
            pending: 0,
            request: upgrade_request(args.target, &key),
            slow_stream: cal::slow_reader_stream(
                args.protocol,
                std::array::from_fn(|_| rng.u8(..)),
            ),
            written: 0,
            last_timeout_check: Instant::now(),
        })
    }

    fn open_of(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Idle => self.idle,
            Kind::Slow => self.slow,
        }
    }

    /// Opens connections of `kind` until `count` of them are open.
    fn open(&mut self, kind: Kind, count: u64) -> Result<(), String> {
        let mut last_progress = Instant::now();
        while self.open_of(kind) < count {
            let mut started = self.open_of(kind) + self.pending as u64;
            while self.pending < IN_FLIGHT && started < count {
                self.connect(kind)?;
                started += 1;
            }
            self.poll_once(Duration::from_millis(50))?;
            if last_progress.elapsed() >= Duration::from_secs(1) {
                last_progress = Instant::now();
                eprintln!("  {kind:?}: {} of {count} open", self.open_of(kind));
            }
        }
        Ok(())
    }

    fn connect(&mut self, kind: Kind) -> Result<(), String> {
        let target = self.target;
        let mut stream =
            open_socket(None, target).map_err(|e| format!("connect to {target}: {e}"))?;
        self.poll
            .registry()
            .register(
                &mut stream,
                Token(self.list.len()),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| format!("epoll: {e}"))?;
        self.list.push(Conn {
            stream,
            kind,
            phase: Phase::Connecting,
            since: Instant::now(),
            response: Vec::new(),
            sent: 0,
        });
        self.pending += 1;
        Ok(())
    }

    /// Handles what is ready within `timeout`; fails on the deadline, a
    /// failed or timed-out connect, or a connection the server closed.
    fn poll_once(&mut self, timeout: Duration) -> Result<(), String> {
        if Instant::now() >= self.deadline {
            return Err(format!(
                "timed out after {} s (--timeout-seconds)",
                self.timeout_seconds
            ));
        }
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(format!("epoll: {e}")),
        }
        let ready: Vec<usize> = self.events.iter().map(|e| e.token().0).collect();
        for i in ready {
            match self.list[i].phase {
                Phase::Connecting => self.on_connect(i)?,
                Phase::Upgrading => self.on_upgrade(i)?,
                Phase::Open => match self.list[i].kind {
                    Kind::Idle => self.on_idle(i)?,
                    Kind::Slow => self.push(i)?,
                },
            }
        }
        if self.pending > 0 && self.last_timeout_check.elapsed() >= Duration::from_millis(500) {
            self.last_timeout_check = Instant::now();
            if let Some(c) = self
                .list
                .iter()
                .find(|c| c.phase != Phase::Open && c.since.elapsed() > CONNECT_TIMEOUT)
            {
                let what = match c.phase {
                    Phase::Upgrading => "WebSocket upgrade",
                    _ => "connect",
                };
                return Err(format!(
                    "{what} to {} timed out after {} s",
                    self.target,
                    CONNECT_TIMEOUT.as_secs()
                ));
            }
        }
        Ok(())
    }

    /// Handles events for `d`.
    fn pump(&mut self, d: Duration) -> Result<(), String> {
        let until = Instant::now() + d;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            self.poll_once(left.min(Duration::from_millis(100)))?;
        }
    }

    fn on_connect(&mut self, i: usize) -> Result<(), String> {
        let target = self.target;
        let c = &mut self.list[i];
        match c.stream.take_error() {
            Ok(Some(e)) | Err(e) => return Err(format!("connect to {target}: {e}")),
            Ok(None) => {}
        }
        match c.stream.peer_addr() {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotConnected => return Ok(()),
            Err(e) => return Err(format!("connect to {target}: {e}")),
        }
        if self.protocol == Mode::Echo {
            return self.established(i);
        }
        match c.stream.write(&self.request) {
            Ok(n) if n == self.request.len() => {}
            Ok(_) | Err(_) => {
                return Err(format!("cannot send the WebSocket upgrade to {target}"));
            }
        }
        c.phase = Phase::Upgrading;
        self.poll
            .registry()
            .reregister(&mut c.stream, Token(i), Interest::READABLE)
            .map_err(|e| format!("epoll: {e}"))
    }

    fn on_upgrade(&mut self, i: usize) -> Result<(), String> {
        let mut buf = [0u8; 4096];
        let c = &mut self.list[i];
        loop {
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    return Err(
                        "the server closed a connection during its WebSocket upgrade".into(),
                    );
                }
                Ok(n) => c.response.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("WebSocket upgrade: {e}")),
            }
            let Some(end) = c.response.windows(4).position(|w| w == b"\r\n\r\n") else {
                if c.response.len() > c10m_server::ws::MAX_HANDSHAKE_BYTES {
                    return Err("the WebSocket upgrade response has no end".into());
                }
                continue;
            };
            if !c.response.starts_with(b"HTTP/1.1 101") {
                let status = String::from_utf8_lossy(&c.response[..end]);
                let status = status.lines().next().unwrap_or_default().to_owned();
                return Err(format!("WebSocket upgrade refused: {status}"));
            }
            if c.response.get(end + 4) == Some(&0x88) {
                return Err("the server closed a connection right after its upgrade".into());
            }
            c.response = Vec::new();
            return self.established(i);
        }
    }

    fn established(&mut self, i: usize) -> Result<(), String> {
        self.pending -= 1;
        let c = &mut self.list[i];
        c.phase = Phase::Open;
        let interest = match c.kind {
            Kind::Idle => {
                self.idle += 1;
                Interest::READABLE
            }
            Kind::Slow => {
                self.slow += 1;
                Interest::WRITABLE
            }
        };
        self.poll
            .registry()
            .reregister(&mut c.stream, Token(i), interest)
            .map_err(|e| format!("epoll: {e}"))?;
        if c.kind == Kind::Slow {
            self.push(i)?;
        }
        Ok(())
    }

    /// An idle connection is readable: the server closed it (or sent a
    /// WebSocket ping, which is dropped unanswered; the bundled server
    /// sends none unless `C10M_WS_PING_SECS` is set).
    fn on_idle(&mut self, i: usize) -> Result<(), String> {
        let mut buf = [0u8; 4096];
        loop {
            match self.list[i].stream.read(&mut buf) {
                Ok(0) => return Err("the server closed an idle connection".into()),
                Ok(n) if self.protocol == Mode::Websocket && buf[0] == 0x88 => {
                    let code = (n >= 4).then(|| u16::from_be_bytes([buf[2], buf[3]]));
                    return Err(format!(
                        "the server closed an idle connection (WebSocket close {})",
                        code.map_or("without a code".into(), |c| c.to_string())
                    ));
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("an idle connection failed: {e}")),
            }
        }
    }

    /// Writes as much of slow reader `i`'s stream as its socket takes.
    fn push(&mut self, i: usize) -> Result<(), String> {
        let c = &mut self.list[i];
        while c.sent < self.slow_stream.len() {
            match c.stream.write(&self.slow_stream[c.sent..]) {
                Ok(n) => {
                    c.sent += n;
                    self.written += n as u64;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(format!(
                        "a slow reader failed after sending {} bytes: {e}",
                        c.sent
                    ));
                }
            }
        }
        Ok(())
    }

    /// Waits until the slow readers' bytes are taken in as far as the
    /// shard takes them (see [`ABSORB_ROUND`]); `tcp_mem` reads sockstat's
    /// `TCP mem`, in pages.
    fn absorb(&mut self, mut tcp_mem: impl FnMut() -> Result<u64, String>) -> Result<(), String> {
        let start = Instant::now();
        let (mut quiet, mut last) = (0, None);
        while quiet < ABSORB_QUIET_ROUNDS {
            if start.elapsed() >= ABSORB_LIMIT {
                eprintln!(
                    "slow readers still sending after {} s; sampling anyway",
                    ABSORB_LIMIT.as_secs()
                );
                break;
            }
            self.written = 0;
            self.pump(ABSORB_ROUND)?;
            let mem = tcp_mem()?;
            quiet = if self.written == 0 && last == Some(mem) {
                quiet + 1
            } else {
                0
            };
            last = Some(mem);
        }
        let sent: usize = self.list.iter().map(|c| c.sent).sum();
        eprintln!(
            "  slow readers: {sent} of {} bytes sent ({:.1} s)",
            self.slow * self.slow_stream.len() as u64,
            start.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Closes every connection with a reset (no FIN exchange, no
    /// TIME_WAIT left behind).
    fn close(self) {
        for c in self.list {
            let s = Socket::from(std::net::TcpStream::from(c.stream));
            let _ = s.set_linger(Some(Duration::ZERO));
        }
    }
}

/// The shard pod as the probe reads it.
struct Shard {
    cgroup: PodCgroup,
    accounted: bool,
    proc_root: PathBuf,
    /// A process of the pod (its network namespace's sockstat).
    pid: Option<u32>,
}

impl Shard {
    fn gone(&self) -> Result<(), String> {
        if self.cgroup.dir.exists() {
            Ok(())
        } else {
            Err(format!(
                "the shard pod's cgroup {} is gone (OOM-killed or deleted)",
                self.cgroup.dir.display()
            ))
        }
    }

    fn read_sockstat(&self, pid: u32) -> Option<SockstatTcp> {
        let path = self.proc_root.join(pid.to_string()).join("net/sockstat");
        SockstatTcp::parse(&fs::read_to_string(path).ok()?)
    }

    /// The pod's `TCP:` sockstat line, through the process read last or,
    /// once that is gone, another of the pod's.
    fn sockstat(&mut self) -> Result<SockstatTcp, String> {
        if let Some(s) = self.pid.and_then(|p| self.read_sockstat(p)) {
            return Ok(s);
        }
        self.gone()?;
        for pid in cal::cgroup_pids(&self.cgroup.dir) {
            if let Some(s) = self.read_sockstat(pid) {
                self.pid = Some(pid);
                return Ok(s);
            }
        }
        Err(format!(
            "no process of the shard pod ({}) has a readable {}/PID/net/sockstat",
            self.cgroup.dir.display(),
            self.proc_root.display()
        ))
    }

    fn read(&mut self, conns: &Conns) -> Result<Sample, String> {
        let tcp = self.sockstat()?;
        let m = self.cgroup.memory(self.accounted).map_err(|e| {
            self.gone()
                .err()
                .unwrap_or_else(|| format!("{}: {e}", self.cgroup.dir.display()))
        })?;
        Ok(Sample {
            idle_connections: conns.idle,
            slow_readers: conns.slow,
            tcp_in_use: tcp.in_use,
            pod_bytes: m.pod,
            user_bytes: m.user,
            kernel_bytes: m.kernel,
            tcp_mem_pages: tcp.mem_pages,
        })
    }

    /// A sample after `settle`, re-read until two readings of the pod's
    /// bytes agree within 1 % ([`REREADS`]).
    fn settled(&mut self, conns: &mut Conns, settle: Duration) -> Result<Sample, String> {
        conns.pump(settle)?;
        let mut last = self.read(conns)?;
        for _ in 0..REREADS {
            conns.pump(REREAD_EVERY)?;
            let s = self.read(conns)?;
            if cal::agree(last.pod_bytes, s.pod_bytes) {
                return Ok(s);
            }
            last = s;
        }
        eprintln!("pod bytes still moving after {REREADS} re-reads; taking the last");
        Ok(last)
    }
}

/// Raises RLIMIT_NOFILE's soft limit to its hard one, which must leave
/// room for `idle` + `slow` connections.
fn raise_nofile(idle: u64, slow: u64) -> Result<(), String> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    cal::fds_needed(idle, slow, lim.maximum.unwrap_or(u64::MAX))?;
    lim.current = lim.maximum;
    setrlimit(Resource::Nofile, lim).map_err(|e| format!("raising RLIMIT_NOFILE: {e}"))
}

fn probe(args: &Args, report: &mut Report, conns: &mut Option<Conns>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_seconds);
    let mode = CgroupMode::detect(&args.cgroup_root);
    report.cgroup_mode = mode.name().into();
    raise_nofile(args.steps.last(), args.slow_readers)?;
    let memory_root = mode.memory_root(&args.cgroup_root);
    let dir = cal::find_pod_cgroup(&memory_root, &args.pod_uid).ok_or_else(|| {
        format!(
            "no cgroup of pod {} under {}/kubepods*",
            args.pod_uid,
            memory_root.display()
        )
    })?;
    report.socket_accounted = cal::socket_accounted(mode, &memory_root)
        .map_err(|e| format!("reading {}: {e}", memory_root.display()))?;
    eprintln!(
        "pod cgroup {} (cgroup {}, sockets accounted: {})",
        dir.display(),
        mode.name(),
        report.socket_accounted
    );
    let mut shard = Shard {
        cgroup: PodCgroup { mode, dir },
        accounted: report.socket_accounted,
        proc_root: args.proc_root.clone(),
        pid: None,
    };
    let conns = conns.insert(Conns::new(args, deadline)?);
    let result = steps(args, &mut shard, conns, report);
    // Read once it ended: a shard OOM-killed mid-step resets the probe's
    // connections at once, before its runtime removes the container's
    // cgroup with the counter in it.
    report.oom_kills = shard.cgroup.oom_kills();
    result
}

/// Takes the samples: none open, each step of idle connections, then the
/// slow readers.
fn steps(
    args: &Args,
    shard: &mut Shard,
    conns: &mut Conns,
    report: &mut Report,
) -> Result<(), String> {
    let settle = Duration::from_secs(args.settle_seconds);
    let take = |shard: &mut Shard, conns: &mut Conns, report: &mut Report| {
        let s = shard.settled(conns, settle)?;
        eprintln!(
            "sample: {} idle, {} slow, tcp inuse {}, pod {} B, user {} B, kernel {} B, \
             tcp mem {} pages",
            s.idle_connections,
            s.slow_readers,
            s.tcp_in_use,
            s.pod_bytes,
            s.user_bytes,
            s.kernel_bytes,
            s.tcp_mem_pages
        );
        report.samples.push(s);
        Ok::<(), String>(())
    };
    take(shard, conns, report)?;
    for &step in &args.steps.0 {
        conns.open(Kind::Idle, step)?;
        take(shard, conns, report)?;
    }
    if args.slow_readers > 0 {
        conns.open(Kind::Slow, args.slow_readers)?;
        conns.absorb(|| shard.sockstat().map(|s| s.mem_pages))?;
        take(shard, conns, report)?;
    }
    Ok(())
}

/// Writes `json` as the container's termination message, if it has one.
fn write_termination_log(json: &str) {
    let path = Path::new(TERMINATION_LOG);
    if !path.exists() {
        return;
    }
    if json.len() >= TERMINATION_LOG_MAX {
        eprintln!(
            "the report is {} bytes; Kubernetes keeps {TERMINATION_LOG_MAX} of {TERMINATION_LOG}",
            json.len()
        );
    }
    let written = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut f| f.write_all(json.as_bytes()));
    if let Err(e) = written {
        eprintln!("cannot write {TERMINATION_LOG}: {e}");
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut report = Report::default();
    let mut conns = None;
    eprintln!(
        "{}: {} {:?}, steps {:?}, {} slow readers",
        c10m_wire::calibrate::BINARY,
        SocketAddr::V4(args.target),
        args.protocol,
        args.steps.0,
        args.slow_readers
    );
    if let Err(e) = probe(&args, &mut report, &mut conns) {
        let (idle, slow) = conns.as_ref().map_or((0, 0), |c| (c.idle, c.slow));
        report.error = Some(format!(
            "{e} (reached {idle} idle connections and {slow} slow readers)"
        ));
    }
    let json = serde_json::to_string(&report).expect("a report serializes");
    println!("{json}");
    let _ = io::stdout().flush();
    write_termination_log(&json);
    if let Some(c) = conns {
        c.close();
    }
    match &report.error {
        None => ExitCode::SUCCESS,
        Some(e) => {
            eprintln!("{}: {e}", c10m_wire::calibrate::BINARY);
            ExitCode::FAILURE
        }
    }
}
