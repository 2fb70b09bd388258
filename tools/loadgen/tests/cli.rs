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
