//! WebSocket mode against the real binary: an independent client (Python
//! `websockets`), timeouts, and abuse (slowloris, garbage, oversize frames,
//! resets) leaving no descriptor or memory growth behind.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn independent_client_python_websockets() {
    let have = Command::new("python3")
        .args(["-c", "import websockets"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        eprintln!(
            "SKIPPED: python3 package `websockets` missing \
             (bash tests/cluster/install-deps.sh installs it)"
        );
        return;
    }
    let server = Server::start(2, &["--protocol", "websocket", "--max-frame-bytes", "4096"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ws_client.py");
    let uri = format!("ws://{}/", server.addr);
    let out = Command::new("python3")
        .args([script, &uri, "4096"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("10 passed, 0 failed"), "{said}");
    let m = server.wait_metrics("3 closes", |m| sum(m, "c10m_connections") == 0.0);
    assert_eq!(
        value(&m, "c10m_connections_closed_total{reason=\"too_large\"}"),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "c10m_connections_closed_total{reason=\"protocol_error\"}"
        ),
        1.0
    );
    assert_eq!(
        value(&m, "c10m_connections_closed_total{reason=\"peer\"}"),
        1.0
    );
}

#[test]
fn slowloris_handshake_times_out_and_idle_websockets_stay() {
    let server = Server::start(
        1,
        &["--protocol", "websocket", "--handshake-timeout-secs", "1"],
    );
    let mut upgraded = ws_connect(&server);
    let mut slow = server.connect();
    // Trickle the request a byte every 100 ms: reads do not extend the
    // handshake deadline, which counts from the accept.
    let mut w = slow.try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        for b in b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n".iter() {
            if w.write_all(&[*b]).is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    });
    // Closed with no reply once the timeout passes (within one more second).
    let mut b = [0u8; 64];
    let n = match slow.read(&mut b) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(n, 0, "no reply to an unfinished request");
    assert!(
        trickler.join().unwrap(),
        "closed before the trickle (4.7 s) ended"
    );
    let m = server.wait_metrics("handshake timeout", |m| {
        sample(
            m,
            "c10m_connections_closed_total{reason=\"handshake_timeout\"}",
        ) == Some(1.0)
    });
    assert_eq!(sum(&m, "c10m_connections"), 1.0);
    // The upgraded connection was idle all along and is still served.
    ws_echo(&mut upgraded, b"still here");
}

#[test]
fn idle_timeout_closes_only_silent_connections() {
    let server = Server::start(1, &["--idle-timeout-secs", "1"]);
    let mut silent = server.connect();
    let mut chatty = server.connect();
    echo_once(&mut silent, b"once");
    let mut b = [0u8; 8];
    silent.set_nonblocking(true).unwrap();
    let mut closed = false;
    for _ in 0..40 {
        echo_once(&mut chatty, b"tick");
        match silent.read(&mut b) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => panic!("unexpected {n} bytes"),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    assert!(closed, "silent connection not closed by the idle timeout");
    let m = server.metrics();
    assert_eq!(
        value(&m, "c10m_connections_closed_total{reason=\"idle_timeout\"}"),
        1.0
    );
    echo_once(&mut chatty, b"alive");
}

/// One round of abuse: `n` each of slowloris, garbage, oversize frames and
/// abrupt resets. Returns when the server has closed all of them.
fn abuse_round(server: &Server, n: usize, round: f64) {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut s = server.connect();
        s.write_all(b"GET / HTTP/1.1\r\nHo").unwrap();
        held.push(s);
    }
    for _ in 0..n {
        let mut s = server.connect();
        s.write_all(b"\x16\x03\x01\x00garbage\r\n\r\n").unwrap();
        held.push(s);
    }
    for _ in 0..n {
        let mut s = ws_connect(server);
        // Header of a 1 MiB masked binary frame; the payload never comes.
        let mut h = vec![0x82, 0xff];
        h.extend_from_slice(&(1u64 << 20).to_be_bytes());
        h.extend_from_slice(&[1, 2, 3, 4]);
        s.write_all(&h).unwrap();
        held.push(s);
    }
    for _ in 0..n {
        let mut s = ws_connect(server);
        s.write_all(&[0x81, 0x85, 1, 2]).unwrap(); // half a frame
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(s); // RST
    }
    let k = n as f64;
    server.wait_metrics_for("abuse closed", Duration::from_secs(10), |m| {
        sum(m, "c10m_connections") == 1.0
            && sample(
                m,
                "c10m_connections_closed_total{reason=\"handshake_timeout\"}",
            ) == Some(k * round)
    });
    let m = server.metrics();
    assert_eq!(
        value(
            &m,
            "c10m_connections_closed_total{reason=\"bad_handshake\"}"
        ),
        k * round
    );
    assert_eq!(
        value(&m, "c10m_connections_closed_total{reason=\"too_large\"}"),
        k * round
    );
    let resets = value(&m, "c10m_connections_closed_total{reason=\"reset\"}")
        + value(&m, "c10m_connections_closed_total{reason=\"peer\"}");
    assert_eq!(resets, k * round);
    drop(held);
}

#[test]
fn abuse_leaves_no_fd_or_memory_growth_and_good_clients_keep_working() {
    const N: usize = 250;
    let server = Server::start(
        1,
        &["--protocol", "websocket", "--handshake-timeout-secs", "1"],
    );
    let pid = server.child.id();
    let mut good = ws_connect(&server);
    ws_echo(&mut good, b"before");
    let fds0 = open_fds(pid);
    abuse_round(&server, N, 1.0);
    ws_echo(&mut good, b"between");
    let (fds1, rss1) = (open_fds(pid), rss_bytes(pid));
    assert_eq!(fds1, fds0, "descriptors leaked");
    abuse_round(&server, N, 2.0);
    ws_echo(&mut good, b"after");
    let (fds2, rss2) = (open_fds(pid), rss_bytes(pid));
    assert_eq!(fds2, fds0, "descriptors leaked");
    // A second round of 1,000 abusive connections reuses what the first
    // allocated: growth stays under 64 KiB (vs 1 MiB frames announced).
    assert!(
        rss2 <= rss1 + 64 * 1024,
        "resident memory grew from {rss1} to {rss2} bytes"
    );
}

#[test]
fn raw_protocol_errors_get_close_codes() {
    let server = Server::start(1, &["--protocol", "websocket"]);
    // Unmasked client frame: 1002.
    let mut s = ws_connect(&server);
    s.write_all(&[0x81, 0x01, b'x']).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert_eq!(back, [0x88, 0x02, 0x03, 0xea]);
    // Wrong version: 426 naming 13, then closed.
    let mut s: TcpStream = server.connect();
    s.write_all(
        upgrade_request("dGhlIHNhbXBsZSBub25jZQ==")
            .replace("Version: 13", "Version: 8")
            .as_bytes(),
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    assert!(r.starts_with("HTTP/1.1 426 "), "{r}");
    assert!(r.contains("Sec-WebSocket-Version: 13\r\n"));
}

/// Sends `request` on a new connection; returns the response head and
/// whether the connection then echoes a frame (an accepted upgrade) or is
/// closed (a refusal).
fn raw_upgrade(server: &Server, request: &str) -> (String, bool) {
    let mut s = server.connect();
    s.write_all(request.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).unwrap() == 0 {
            break;
        }
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    if head.starts_with("HTTP/1.1 101 ") {
        ws_echo(&mut s, b"upgraded");
        (head, true)
    } else {
        assert_eof(&mut s);
        (head, false)
    }
}

#[test]
fn handshake_honours_split_list_fields_and_header_cardinality() {
    // Issue 10, fault 6, and the RFCs' other MUSTs, over raw sockets.
    let server = Server::start(1, &["--protocol", "websocket"]);
    let key = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    let req = |line: &str, fields: &str| format!("{line}\r\n{fields}\r\n");
    let ok_fields = |connection: &str, upgrade: &str| {
        format!("Host: test\r\n{upgrade}{connection}{key}Sec-WebSocket-Version: 13\r\n")
    };
    let accepted = [
        ok_fields(
            "Connection: keep-alive\r\nConnection: Upgrade\r\n",
            "Upgrade: websocket\r\n",
        ),
        ok_fields(
            "Connection: Upgrade\r\n",
            "Upgrade: h2c\r\nUpgrade: websocket\r\n",
        ),
        ok_fields(
            "connection: keep-alive ,  UPGRADE\r\n",
            "upgrade: WebSocket\r\n",
        ),
    ];
    for f in &accepted {
        let (head, upgraded) = raw_upgrade(&server, &req("GET / HTTP/1.1", f));
        assert!(upgraded, "{f:?} -> {head}");
        assert!(head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"));
    }
    let (head, upgraded) = raw_upgrade(&server, &req("GET / HTTP/1.2", &accepted[0]));
    assert!(upgraded, "HTTP/1.2 is processed as 1.1: {head}");

    let base = ok_fields("Connection: Upgrade\r\n", "Upgrade: websocket\r\n");
    let refused = [
        ("GET / HTTP/1.1", format!("{base}{key}"), 400), // two keys
        ("GET / HTTP/1.1", format!("{base}Host: other\r\n"), 400), // two Hosts
        ("GET / HTTP/1.1", base.replace("Host: test\r\n", ""), 400), // no Host
        (
            "GET / HTTP/1.1",
            format!("{base}Sec-WebSocket-Version: 13\r\n"),
            400,
        ), // two versions
        (
            "GET / HTTP/1.1",
            base.replace("Version: 13", "Version: 8"),
            426,
        ),
        (
            "GET / HTTP/1.1",
            format!("{base}Transfer-Encoding: chunked\r\n"),
            400,
        ),
        ("GET / HTTP/2.0", base.clone(), 505),
        ("GET / HTTP/1.0", base.clone(), 400),
        ("POST / HTTP/1.1", base.clone(), 400),
        ("GET * HTTP/1.1", base.clone(), 400),
    ];
    for (line, fields, want) in &refused {
        let (head, upgraded) = raw_upgrade(&server, &req(line, fields));
        assert!(!upgraded);
        assert!(
            head.starts_with(&format!("HTTP/1.1 {want} ")),
            "{line} {fields:?} -> {head}"
        );
    }
    server.wait_metrics("refusals counted, upgrades closed by their peers", |m| {
        sample(m, "c10m_connections_closed_total{reason=\"bad_handshake\"}")
            == Some(refused.len() as f64)
            && sum(m, "c10m_connections") == 0.0
    });
}

#[test]
fn server_pings_close_stuck_clients_and_spare_answering_ones() {
    let server = Server::start(
        1,
        &[
            "--protocol",
            "websocket",
            "--ws-ping-secs",
            "1",
            "--ws-pong-timeout-secs",
            "1",
        ],
    );
    let mut stuck = ws_connect(&server);
    let mut answering = ws_connect(&server);
    let t0 = std::time::Instant::now();
    let stop = t0 + Duration::from_secs(5);
    let responder = std::thread::spawn(move || {
        answering
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let pong = c10m_server::ws::client_frame(true, 0xA, b"", [1, 2, 3, 4]);
        let mut pings = 0;
        let mut b = [0u8; 2];
        while std::time::Instant::now() < stop {
            match answering.read_exact(&mut b) {
                Ok(()) => {
                    assert_eq!(b, [0x89, 0], "only pings come unasked");
                    pings += 1;
                    answering.write_all(&pong).unwrap();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("{e}"),
            }
        }
        (answering, pings)
    });
    // Silent for 1 s: pinged; no answer for 1 more: closed with 1011
    // (each checked once a second).
    let mut got = Vec::new();
    stuck.read_to_end(&mut got).unwrap();
    let took = t0.elapsed();
    assert_eq!(got, [0x89, 0, 0x88, 2, 0x03, 0xf3]);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(5),
        "{took:?}"
    );
    let (mut answering, pings) = responder.join().unwrap();
    assert!(pings >= 2, "{pings} pings in 5 s");
    ws_echo(&mut answering, b"still here");
    let m = server.metrics();
    assert_eq!(
        value(&m, "c10m_connections_closed_total{reason=\"ping_timeout\"}"),
        1.0
    );
    assert_eq!(sum(&m, "c10m_connections"), 1.0);
}
