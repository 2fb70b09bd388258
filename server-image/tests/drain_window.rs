//! Draining keeps the door open while endpoints update: after SIGTERM (or
//! `POST /drain`) the listeners stay open for `--drain-accept-secs`, and a
//! connection that arrives gets a protocol goodbye (WebSocket: its upgrade
//! answered, then close 1001; echo: FIN), never a refusal; `/healthz` says
//! 503 from the start; after the window the listeners are gone while the
//! drain of the held connections goes on.

mod common;

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

const TOKEN: &str = "t0ken-for-tests";
const GOODBYE_1001: [u8; 4] = [0x88, 0x02, 0x03, 0xe9];

/// How one connect attempt during the drain ended.
#[derive(Debug, PartialEq)]
enum Attempt {
    /// WebSocket: 101, then close 1001, then EOF.
    WsGoodbye,
    /// Echo: EOF without a byte.
    Fin,
    /// `ECONNREFUSED`: the listeners are gone.
    Refused,
    /// Anything else (reset, timeout, a wrong answer).
    Other(String),
}

fn attempt(server: &Server, websocket: bool) -> Attempt {
    let mut s = match TcpStream::connect_timeout(&server.addr, IO_TIMEOUT) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Attempt::Refused,
        Err(e) => return Attempt::Other(format!("connect: {e}")),
    };
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    if websocket {
        use std::io::Write;
        if let Err(e) = s.write_all(upgrade_request("dGhlIHNhbXBsZSBub25jZQ==").as_bytes()) {
            return Attempt::Other(format!("write: {e}"));
        }
    }
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        return Attempt::Other(format!("read: {e} after {raw:?}"));
    }
    if !websocket {
        return if raw.is_empty() {
            Attempt::Fin
        } else {
            Attempt::Other(format!("echo got {raw:?}"))
        };
    }
    let text = String::from_utf8_lossy(&raw);
    let Some(end) = text.find("\r\n\r\n") else {
        return Attempt::Other(format!("no answer: {text:?}"));
    };
    if text.starts_with("HTTP/1.1 101 ")
        && text.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n")
        && raw[end + 4..] == GOODBYE_1001
    {
        Attempt::WsGoodbye
    } else {
        Attempt::Other(format!("{text:?}"))
    }
}

/// One attempt every 100 ms for `span`, from a thread, so each is timed
/// from the signal whatever the previous one took.
fn attempts_every_100ms(
    server: &Server,
    websocket: bool,
    span: Duration,
) -> Vec<(Duration, Attempt)> {
    let start = Instant::now();
    let mut out = Vec::new();
    let mut next = Duration::from_millis(100);
    while next <= span {
        std::thread::sleep(next.saturating_sub(start.elapsed()));
        out.push((start.elapsed(), attempt(server, websocket)));
        next += Duration::from_millis(100);
    }
    out
}

#[test]
fn sigterm_with_40_websockets_at_rate_10_refuses_no_connect_in_the_window() {
    // The input: all 20 connects were refused from t+0.1 s. Default
    // accept window (5 s, c10m_wire::drain::ACCEPT_SECS).
    let mut server = Server::start_with(Opts {
        workers: 2,
        args: &["--protocol", "websocket", "--drain-rate", "10"],
        ..Opts::default()
    });
    let mut held: Vec<TcpStream> = (0..40).map(|_| ws_connect(&server)).collect();
    server.wait_metrics("40 live", |m| sum(m, "c10m_connections") == 40.0);
    server.signal(rustix::process::Signal::TERM);
    // Readiness drops at once.
    server.wait_draining();
    let got = attempts_every_100ms(&server, true, Duration::from_secs(2));
    assert_eq!(got.len(), 20);
    let refused = got.iter().filter(|(_, a)| *a == Attempt::Refused).count();
    eprintln!(
        "20 connects in the first 2 s of the drain: {refused} refused, {} goodbyes",
        got.iter().filter(|(_, a)| *a == Attempt::WsGoodbye).count()
    );
    for (t, a) in &got {
        assert_eq!(*a, Attempt::WsGoodbye, "connect at +{t:?}");
    }
    let m = server.metrics();
    assert_eq!(
        value(&m, "c10m_connections_rejected_total{reason=\"draining\"}"),
        20.0
    );
    // The held connections still drain at 10/s with 1001, and the process
    // exits 0 once both the drain and the window are over.
    let endings = watch_endings(&mut held, 40, Duration::from_secs(10));
    assert_eq!(endings.iter().flatten().count(), 40);
    for e in endings.iter().flatten() {
        assert_eq!(e.bytes, GOODBYE_1001);
    }
    // The clients close their side; the server waits for that (up to
    // --close-timeout-secs) before it exits.
    drop(held);
    assert_eq!(server.wait_exit(Duration::from_secs(10)).code(), Some(0));
}

#[test]
fn after_the_window_the_listeners_are_gone_while_the_drain_goes_on() {
    // 60 held at 10/s: the drain takes ~6 s, the window 2 s.
    let mut server = Server::start_with(Opts {
        workers: 2,
        args: &[
            "--protocol",
            "websocket",
            "--drain-rate",
            "10",
            "--drain-accept-secs",
            "2",
        ],
        ..Opts::default()
    });
    let mut held: Vec<TcpStream> = (0..60).map(|_| ws_connect(&server)).collect();
    server.wait_metrics("60 live", |m| sum(m, "c10m_connections") == 60.0);
    server.signal(rustix::process::Signal::TERM);
    server.wait_draining();
    // The drain (and its window) began at or before this mark.
    let draining = Instant::now();
    let got = attempts_every_100ms(&server, true, Duration::from_millis(1500));
    for (t, a) in &got {
        assert_eq!(*a, Attempt::WsGoodbye, "connect at +{t:?}");
    }
    // The window ends ~2 s after the drain began: refused from then on.
    let deadline = draining + Duration::from_secs(4);
    loop {
        let a = attempt(&server, true);
        if a == Attempt::Refused {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {a:?} {:?} into the drain (window 2 s)",
            draining.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Window over: refused, while the server still drains (alive, 503).
    for _ in 0..5 {
        assert_eq!(attempt(&server, true), Attempt::Refused);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(server.child.try_wait().unwrap().is_none(), "still draining");
    assert_eq!(server.http("GET", "/healthz", None).unwrap().0, 503);
    let m = server.metrics();
    assert!(sum(&m, "c10m_connections") > 0.0, "{m}");
    let endings = watch_endings(&mut held, 60, Duration::from_secs(15));
    assert_eq!(endings.iter().flatten().count(), 60);
    drop(held);
    assert_eq!(server.wait_exit(Duration::from_secs(10)).code(), Some(0));
}

#[test]
fn post_drain_on_echo_answers_newcomers_with_a_fin() {
    let mut server = Server::start_with(Opts {
        workers: 1,
        args: &["--drain-accept-secs", "2"],
        env: &[("C10M_ADMIN_TOKEN", TOKEN)],
        ..Opts::default()
    });
    let mut held = server.connect();
    echo_once(&mut held, b"hi");
    assert_eq!(server.post("/drain?rate=0", Some(TOKEN)).0, 202);
    server.wait_draining();
    let got = attempts_every_100ms(&server, false, Duration::from_millis(1500));
    for (t, a) in &got {
        assert_eq!(*a, Attempt::Fin, "connect at +{t:?}");
    }
    assert_eof(&mut held);
    // Everything drained at once; the process stays for the window, then
    // exits 0.
    let status = server.wait_exit(Duration::from_secs(5));
    assert_eq!(status.code(), Some(0));
}

#[test]
fn a_zero_window_closes_the_listeners_at_once() {
    let mut server = Server::start_with(Opts {
        workers: 1,
        args: &["--drain-rate", "5", "--drain-accept-secs", "0"],
        ..Opts::default()
    });
    let mut held: Vec<TcpStream> = (0..10).map(|_| server.connect()).collect();
    for c in &mut held {
        echo_once(c, b"x");
    }
    server.signal(rustix::process::Signal::TERM);
    server.wait_draining();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let a = attempt(&server, false);
        if a == Attempt::Refused {
            break;
        }
        assert!(Instant::now() < deadline, "still {a:?} 2 s into the drain");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.child.try_wait().unwrap().is_none(), "still draining");
    let endings = watch_endings(&mut held, 10, Duration::from_secs(10));
    assert_eq!(endings.iter().flatten().count(), 10);
    assert_eq!(server.wait_exit(Duration::from_secs(5)).code(), Some(0));
}
