//! Shared harness: start the real `c10m-server` binary on its own loopback
//! address and talk to it over TCP and HTTP.

#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_c10m-server");

/// The `c10m-loadgen` binary (crate `tools/loadgen`), from the directory
/// cargo put [`BIN`] in (`target/<profile>/`). Another package's binary is
/// not built for this package's tests, so it is built here with the same
/// cargo and profile, once per test process (a no-op when it is fresh, as
/// after `cargo test --workspace`, `cargo build --workspace --bins` or the
/// Makefile's targets).
pub fn loadgen_bin() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let bin = std::path::Path::new(BIN).with_file_name("c10m-loadgen");
            let dir = bin.parent().and_then(|d| d.file_name());
            let profile = match dir.and_then(|d| d.to_str()) {
                Some("debug") | None => "dev",
                Some(p) => p,
            };
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let status = Command::new(cargo)
                .args([
                    "build",
                    "--quiet",
                    "-p",
                    "c10m-loadgen",
                    "--bin",
                    "c10m-loadgen",
                ])
                .args(["--profile", profile])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .stdin(Stdio::null())
                .status();
            match status {
                Ok(s) if s.success() => {}
                other if bin.exists() => {
                    eprintln!("building c10m-loadgen failed ({other:?}); using {bin:?}")
                }
                other => panic!("cannot build c10m-loadgen ({other:?}) and {bin:?} is missing"),
            }
            bin
        })
        .clone()
}
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

pub static NEXT_HOST: AtomicU8 = AtomicU8::new(1);

pub fn test_ip() -> Ipv4Addr {
    let p = (std::process::id() % 250) as u8 + 1;
    let n = NEXT_HOST.fetch_add(1, Ordering::Relaxed);
    Ipv4Addr::new(127, 77, p, n)
}

pub fn free_port(ip: Ipv4Addr) -> u16 {
    TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the real server on a fresh loopback address with two distinct
/// fresh ports, up to five times (new ports after a lost port race).
/// `command` builds the command for the address, port and admin (metrics)
/// port; it is spawned and waited on until `/healthz` answers.
///
/// With `log`, the file `command` sends the server's stderr to, only a
/// start-up that logged "Address already in use" is retried; any other
/// failure panics with the log. Without one (stderr inherited, nothing to
/// read), every failed start is retried.
pub fn start_on_fresh_ports(
    log: Option<&Path>,
    mut command: impl FnMut(Ipv4Addr, u16, u16) -> Command,
) -> Server {
    for _attempt in 0..5 {
        let ip = test_ip();
        let port = free_port(ip);
        let mut admin_port = free_port(ip);
        while admin_port == port {
            admin_port = free_port(ip);
        }
        let child = command(ip, port, admin_port)
            .spawn()
            .expect("spawn c10m-server");
        let mut server = Server {
            child,
            addr: SocketAddr::from((ip, port)),
            admin: SocketAddr::from((ip, admin_port)),
        };
        if server.wait_ready() {
            return server;
        }
        if let Some(log) = log {
            let said = std::fs::read_to_string(log).unwrap_or_default();
            if !said.contains("Address already in use") {
                panic!("c10m-server did not start:\n{said}");
            }
        }
        // Lost a port race (or, without a log, failed to start): try fresh
        // ports.
    }
    panic!("c10m-server did not become ready");
}

/// RLIMIT_NOFILE hard limit of this process; the server inherits it and
/// raises its soft limit to it.
pub fn hard_nofile() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .maximum
        .expect("finite RLIMIT_NOFILE hard limit")
}

pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
}

#[derive(Default)]
pub struct Opts<'a> {
    pub workers: u16,
    pub args: &'a [&'a str],
    pub env: &'a [(&'a str, &'a str)],
    /// Pass bind address and ports through C10M_* variables, not flags.
    pub via_env: bool,
    /// Start the server with RLIMIT_NOFILE soft = hard = this.
    pub nofile_limit: Option<u64>,
}

impl Server {
    pub fn start(workers: u16, args: &[&str]) -> Server {
        Server::start_with(Opts {
            workers,
            args,
            ..Opts::default()
        })
    }

    pub fn start_with(o: Opts) -> Server {
        // stderr is inherited, so there is no log to tell a lost port race
        // from another failure: every failed start is retried.
        start_on_fresh_ports(None, |ip, port, admin_port| {
            let mut cmd = Command::new(BIN);
            for (k, _) in std::env::vars() {
                if k.starts_with("C10M_") {
                    cmd.env_remove(k);
                }
            }
            let (ip_s, port_s, admin_s) =
                (ip.to_string(), port.to_string(), admin_port.to_string());
            if o.via_env {
                cmd.env("C10M_BIND", &ip_s)
                    .env("C10M_PORT", &port_s)
                    .env("C10M_METRICS_PORT", &admin_s);
            } else {
                cmd.args([
                    "--bind",
                    &ip_s,
                    "--port",
                    &port_s,
                    "--metrics-port",
                    &admin_s,
                ]);
            }
            if o.workers > 0 {
                cmd.args(["--workers", &o.workers.to_string()]);
            }
            cmd.args(o.args)
                .envs(o.env.iter().copied())
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            if let Some(n) = o.nofile_limit {
                use std::os::unix::process::CommandExt;
                let lim = rustix::process::Rlimit {
                    current: Some(n),
                    maximum: Some(n),
                };
                // SAFETY: the pre-exec hook runs in the forked child, where
                // only async-signal-safe calls are allowed: setrlimit is one
                // syscall and allocates nothing.
                #[allow(unsafe_code)]
                unsafe {
                    cmd.pre_exec(move || {
                        rustix::process::setrlimit(rustix::process::Resource::Nofile, lim)
                            .map_err(std::io::Error::from)
                    });
                }
            }
            cmd
        })
    }

    pub fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                eprintln!("c10m-server exited during start-up: {status}");
                return false;
            }
            if let Ok((200, _, _)) = self.http("GET", "/healthz", None) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Waits (up to [`IO_TIMEOUT`]) until `/healthz` answers 503
    /// `draining`: the drain has begun, so no worker accepts any more and a new connection
    /// meets the accept window. `POST /drain`'s 202 only says the order was
    /// taken; the main thread starts the drain a moment later, and a connect
    /// in between is a worker's, closed by the drain mid-handshake.
    pub fn wait_draining(&self) {
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            match self.http("GET", "/healthz", None) {
                Ok((503, _, body)) => {
                    assert_eq!(body, "draining\n");
                    return;
                }
                other => assert!(Instant::now() < deadline, "still {other:?}"),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    /// One HTTP/1.1 request; returns status, headers (lower-cased names) and body.
    #[allow(clippy::type_complexity)]
    pub fn http(
        &self,
        method: &str,
        path: &str,
        accept: Option<&str>,
    ) -> std::io::Result<(u16, Vec<(String, String)>, String)> {
        let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
        self.request(method, path, &accept)
    }

    /// `POST path` with `Authorization: Bearer token` (if any); status and body.
    pub fn post(&self, path: &str, token: Option<&str>) -> (u16, String) {
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        let (status, _, body) = self.request("POST", path, &auth).expect("POST");
        (status, body)
    }

    /// One HTTP/1.1 request with extra header lines (each ending in CRLF).
    #[allow(clippy::type_complexity)]
    pub fn request(
        &self,
        method: &str,
        path: &str,
        extra_headers: &str,
    ) -> std::io::Result<(u16, Vec<(String, String)>, String)> {
        let mut s = TcpStream::connect_timeout(&self.admin, IO_TIMEOUT)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: test\r\n{extra_headers}Connection: close\r\n\r\n"
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let n = match resp.parse(&raw) {
            Ok(httparse::Status::Complete(n)) => n,
            other => panic!(
                "bad response {other:?}: {:?}",
                String::from_utf8_lossy(&raw)
            ),
        };
        let hs = resp
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        let body = String::from_utf8(raw[n..].to_vec()).unwrap();
        Ok((resp.code.unwrap(), hs, body))
    }

    pub fn metrics(&self) -> String {
        let (status, _, body) = self.http("GET", "/metrics", None).expect("GET /metrics");
        assert_eq!(status, 200);
        body
    }

    /// Polls /metrics until `pred` holds (closes and rejections are
    /// asynchronous to the client); panics with the last scrape otherwise.
    pub fn wait_metrics(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.wait_metrics_for(what, IO_TIMEOUT, pred)
    }

    /// [`Server::wait_metrics`] with its own time limit.
    pub fn wait_metrics_for(
        &self,
        what: &str,
        within: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + within;
        loop {
            let m = self.metrics();
            if pred(&m) {
                return m;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; last scrape:\n{m}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, sig).unwrap();
    }

    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > within {
                panic!("c10m-server still running {within:?} after the signal");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Value of the series named exactly `series` (name plus labels).
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

pub fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

/// Sum over every series of `family`.
pub fn sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

pub fn echo_once(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
}

pub fn assert_eof(s: &mut TcpStream) {
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        other => panic!("expected EOF, got {other:?}"),
    }
}

/// Descriptors the process `pid` has open.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Resident memory of process `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib * 1024
}

/// A WebSocket upgrade request for `key`.
pub fn upgrade_request(key: &str) -> String {
    format!(
        "GET / HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
}

/// Opens a connection and completes the WebSocket upgrade with raw bytes.
pub fn ws_connect(server: &Server) -> TcpStream {
    ws_upgrade(server.connect())
}

/// Completes the WebSocket upgrade on a connected stream with raw bytes.
pub fn ws_upgrade(mut s: TcpStream) -> TcpStream {
    s.write_all(upgrade_request("dGhlIHNhbXBsZSBub25jZQ==").as_bytes())
        .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    assert!(head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"));
    s
}

/// Sends one masked binary frame and reads its unmasked echo.
pub fn ws_echo(s: &mut TcpStream, payload: &[u8]) {
    let frame = c10m_server::ws::client_frame(true, 0x2, payload, [9, 8, 7, 6]);
    s.write_all(&frame).unwrap();
    let mut want = Vec::new();
    c10m_server::ws::write_header(&mut want, true, 0x2, payload.len());
    want.extend_from_slice(payload);
    let mut back = vec![0u8; want.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, want);
}

/// How a watched connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    /// When the first byte of the ending (close frame or EOF) was seen.
    pub at: Instant,
    /// Bytes received before EOF (a WebSocket close frame, if any).
    pub bytes: Vec<u8>,
}

/// Watches `conns` (made non-blocking) until `want` of them have ended or
/// `within` passes; returns each connection's ending, if any.
pub fn watch_endings(
    conns: &mut [TcpStream],
    want: usize,
    within: Duration,
) -> Vec<Option<Ending>> {
    for c in conns.iter() {
        c.set_nonblocking(true).unwrap();
    }
    let mut out: Vec<Option<Ending>> = vec![None; conns.len()];
    let mut done = vec![false; conns.len()];
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 64];
    while done.iter().filter(|&&d| d).count() < want && Instant::now() < deadline {
        for (i, c) in conns.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            loop {
                match c.read(&mut buf) {
                    Ok(0) => {
                        out[i].get_or_insert_with(|| Ending {
                            at: Instant::now(),
                            bytes: Vec::new(),
                        });
                        done[i] = true;
                        break;
                    }
                    Ok(n) => {
                        out[i]
                            .get_or_insert_with(|| Ending {
                                at: Instant::now(),
                                bytes: Vec::new(),
                            })
                            .bytes
                            .extend_from_slice(&buf[..n]);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        out[i].get_or_insert_with(|| Ending {
                            at: Instant::now(),
                            bytes: Vec::new(),
                        });
                        done[i] = true;
                        break;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for c in conns.iter() {
        c.set_nonblocking(false).unwrap();
    }
    out
}

/// Seconds from `t` to the last of the endings seen. With `t` taken just
/// before an order (POST or signal), a lower bound on this is sound however
/// the closes bunch up: the order's allowance counts from its start, at or
/// after `t`.
pub fn last_ending_since(t: Instant, endings: &[Option<Ending>]) -> f64 {
    let last = endings.iter().flatten().map(|e| e.at).max().unwrap();
    (last - t).as_secs_f64()
}

/// A network namespace held by a child process (`unshare --net sleep
/// infinity`, util-linux), never by a bind mount under `/run/netns`: it is
/// gone once the holder is killed on drop and no thread or process is left
/// in it. `ip netns add` would mount `/run/netns` on a host that had none,
/// and nothing unmounts it, so `make test`'s host check would see the host
/// changed (issue 21). Needs root (unshare, nsenter, setns).
pub struct Netns {
    holder: Child,
    path: String,
}

impl Netns {
    /// Starts the holder and waits (up to [`START_TIMEOUT`]) until it runs
    /// in a namespace other than the caller's; its loopback is brought up.
    ///
    /// Panics if `unshare` cannot run or the namespace never appears.
    pub fn new() -> Netns {
        let holder = Command::new("unshare")
            .args(["--net", "--", "sleep", "infinity"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run `unshare` (util-linux; root): {e}"));
        let path = format!("/proc/{}/ns/net", holder.id());
        let ns = Netns { holder, path };
        let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
        let deadline = Instant::now() + START_TIMEOUT;
        while std::fs::read_link(&ns.path).ok().is_none_or(|l| l == ours) {
            assert!(Instant::now() < deadline, "unshare --net did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// The holder's pid: what `ip link … netns PID` takes.
    pub fn pid(&self) -> u32 {
        self.holder.id()
    }

    /// `/proc/PID/ns/net` of the holder.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `program` run inside the namespace (`nsenter --net=PATH -- program`).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path)).arg("--").arg(program);
        c
    }

    /// Runs `ip ARGS` inside the namespace, panicking with its output if it
    /// fails (iproute2 needed).
    pub fn ip(&self, args: &[&str]) {
        let out = self
            .command("ip")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run `nsenter … ip`: {e}"));
        assert!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs `f` on a thread inside the namespace; sockets it opens stay in
    /// the namespace after it returns.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        enter_netns(&self.path, f)
    }
}

/// Runs `f` on a thread that has joined the network namespace at `path`
/// (`/proc/PID/ns/net`).
pub fn enter_netns<T: Send>(path: &str, f: impl FnOnce() -> T + Send) -> T {
    use std::os::fd::AsFd;
    std::thread::scope(|s| {
        s.spawn(move || {
            let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
            rustix::thread::move_into_link_name_space(
                file.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .expect("setns into the test's network namespace");
            f()
        })
        .join()
        .unwrap()
    })
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}
