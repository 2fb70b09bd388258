//! The `c10m-loadgen` binary end to end against a plain echo server on
//! loopback: two processes (parent and re-executed children), every
//! connection up, pings answered, one JSON report.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};

/// A thread-per-connection echo server on 127.0.0.1; returns its address.
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn holds_pings_and_reports_across_child_processes() {
    let addr = echo_server();
    let out = Command::new(env!("CARGO_BIN_EXE_c10m-loadgen"))
        .args([
            "--target",
            &addr.to_string(),
            "-n",
            "20",
            "--per-process",
            "10",
        ])
        .args(["--ping-fraction", "1", "--ping-rate", "200", "--hold", "1"])
        .args(["--quiet", "--source-net", "170"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["connections"], 20, "{r}");
    assert_eq!(r["connected"], 20, "{r}");
    assert_eq!(r["openAtEnd"], 20, "{r}");
    assert_eq!(r["connectErrors"], 0, "{r}");
    assert_eq!(r["closedByServer"], 0, "{r}");
    let (pings, pongs) = (r["pings"].as_u64().unwrap(), r["pongs"].as_u64().unwrap());
    assert!(pongs > 0 && pongs <= pings, "{r}");
    assert!(r["rttP50Us"].as_u64().unwrap() > 0, "{r}");
    // The parent merged both children's histograms: none is left over.
    assert!(r.get("histogram").is_none(), "{r}");
}

/// A server that answers every WebSocket upgrade with its 101 and a close
/// 1001 in ONE write (as a draining c10m-server's accept window does), then
/// waits for the client to close.
fn goodbye_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(n @ 1..) => req.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let text = String::from_utf8_lossy(&req).into_owned();
                let key = text
                    .lines()
                    .find_map(|l| l.strip_prefix("Sec-WebSocket-Key: "))
                    .unwrap()
                    .trim()
                    .to_string();
                let accept = c10m_server::ws::accept_key(key.as_bytes());
                let mut answer = format!(
                    "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
                )
                .into_bytes();
                answer.extend_from_slice(&[0x88, 0x02, 0x03, 0xe9]); // close 1001
                let _ = s.write_all(&answer);
                while let Ok(1..) = s.read(&mut buf) {}
            });
        }
    });
    addr
}

/// Frames right behind the 101 are the frame stream's first bytes: a close
/// there is the server's goodbye, counted by its code (it was dropped as
/// "unasked" bytes before, so goodbyes went uncounted).
#[test]
fn a_close_right_behind_the_upgrade_is_a_counted_goodbye() {
    let addr = goodbye_server();
    let out = Command::new(env!("CARGO_BIN_EXE_c10m-loadgen"))
        .args(["--target", &addr.to_string(), "-n", "5"])
        .args(["--protocol", "websocket", "--hold", "1"])
        .args(["--quiet", "--source-net", "171"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["connectErrors"], 0, "{r}");
    assert_eq!(r["closedByServer"], 5, "{r}");
    assert_eq!(r["goodbyes"]["1001"], 5, "{r}");
    let by_second: u64 = r["closesBySecond"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(by_second, 5, "{r}");
    assert_eq!(r["mostClosesPerClient"], 1, "{r}");
    assert_eq!(r["clientsClosedTwice"], 0, "{r}");
}
