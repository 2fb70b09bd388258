//! End-to-end at scale, ignored by `cargo test` and run by
//! `make test-server-scale`:
//!
//! - 40,000 connections held across 3 `c10m-server` processes sharing one
//!   port (SO_REUSEPORT), opened and pinged by `c10m-loadgen` (3 child
//!   processes: 20,000 descriptors per process here), with zero errors;
//! - 100,000 abusive connections (slowloris, garbage, oversize frames,
//!   resets) leave no descriptor or memory growth while a well-behaved
//!   WebSocket client keeps working.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = env!("CARGO_BIN_EXE_c10m-server");
const N: u64 = 40_000;
const PROCS: usize = 3;

fn free_port(ip: Ipv4Addr) -> u16 {
    TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn live(admin: SocketAddr) -> f64 {
    let mut s = TcpStream::connect(admin).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .filter(|l| l.starts_with("c10m_connections{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

struct Kill(Vec<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
#[ignore = "40k connections, ~30 s: run with `make test-server-scale`"]
fn holds_40k_connections_across_3_processes_with_zero_errors() {
    let loadgen = common::loadgen_bin();
    let ip = Ipv4Addr::new(127, 78, (std::process::id() % 250) as u8 + 1, 1);
    let port = free_port(ip);
    let mut servers = Kill(Vec::new());
    let mut admins = Vec::new();
    for _ in 0..PROCS {
        let admin = SocketAddr::from((ip, free_port(ip)));
        let child = Command::new(SERVER)
            .args(["--bind", &ip.to_string(), "--port", &port.to_string()])
            .args([
                "--metrics-port",
                &admin.port().to_string(),
                "--workers",
                "1",
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        servers.0.push(child);
        admins.push(admin);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while admins.iter().any(|a| TcpStream::connect(a).is_err()) {
        assert!(Instant::now() < deadline, "servers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut lg = Command::new(loadgen)
        .args(["--target", &format!("{ip}:{port}"), "-n", &N.to_string()])
        .args([
            "--ping-fraction",
            "0.01",
            "--ping-rate",
            "1000",
            "--settle",
            "3",
            "--hold",
            "5",
        ])
        .args(["--events", "--quiet", "--source-net", "140"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut held = None;
    let mut result = None;
    for line in BufReader::new(lg.stdout.take().unwrap()).lines() {
        let ev: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        match ev["event"].as_str() {
            Some("connected") => {
                // Give the servers a moment to accept the last ones.
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut total = 0.0;
                while Instant::now() < deadline {
                    total = admins.iter().map(|&a| live(a)).sum::<f64>();
                    if total == N as f64 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                let per: Vec<f64> = admins.iter().map(|&a| live(a)).collect();
                held = Some((total, per));
            }
            Some("result") => result = Some(ev),
            _ => {}
        }
    }
    assert!(lg.wait().unwrap().success());
    let r = result.expect("load generator result");
    let (total, per) = held.expect("connected event");
    eprintln!("held {total} ({per:?}); result {r}");
    assert_eq!(total, N as f64, "servers held {per:?}");
    // SO_REUSEPORT spreads by hash: each process holds a real share.
    assert!(per.iter().all(|&p| p > N as f64 / 6.0), "{per:?}");
    assert_eq!(r["connected"], N);
    assert_eq!(r["openAtEnd"], N);
    assert_eq!(r["connectErrors"], 0);
    assert_eq!(r["closedByServer"], 0);
    assert!(r["pings"].as_u64().unwrap() > 1000, "{r}");
    assert_eq!(r["pings"], r["pongs"], "every ping answered");
}

/// Connects from `src` (port chosen at connect time) to `dst`, blocking.
fn connect_from(src: Ipv4Addr, dst: SocketAddr) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    c10m_loadgen::bind_address_no_port(&s).unwrap();
    s.bind(&SocketAddr::from((src, 0)).into()).unwrap();
    s.connect(&dst.into()).unwrap();
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

#[test]
#[ignore = "100k abusive connections, ~1 min: run with `make test-server-scale`"]
fn abuse_100k_leaves_no_fd_or_memory_growth() {
    use common::*;
    const ROUNDS: usize = 20;
    const EACH: usize = 1250; // per kind per round: 4 x 1,250 x 20 = 100,000
    let server = Server::start(
        2,
        &["--protocol", "websocket", "--handshake-timeout-secs", "1"],
    );
    let pid = server.child.id();
    let mut good = ws_connect(&server);
    ws_echo(&mut good, b"before");
    let fds0 = open_fds(pid);
    let mut n: u64 = 0;
    let mut src = || {
        n += 1;
        Ipv4Addr::new(127, 79, ((n / 250) % 250) as u8 + 1, (n % 250) as u8 + 1)
    };
    let mut rss_after_first = 0;
    for round in 1..=ROUNDS {
        let mut held = Vec::with_capacity(3 * EACH);
        for _ in 0..EACH {
            let mut s = connect_from(src(), server.addr);
            s.write_all(b"GET / HTTP/1.1\r\nHo").unwrap();
            held.push(s);
        }
        for _ in 0..EACH {
            let mut s = connect_from(src(), server.addr);
            s.write_all(b"\x16\x03\x01\x00garbage\r\n\r\n").unwrap();
            held.push(s);
        }
        for _ in 0..EACH {
            let mut s = ws_upgrade(connect_from(src(), server.addr));
            let mut h = vec![0x82, 0xff];
            h.extend_from_slice(&(1u64 << 20).to_be_bytes());
            h.extend_from_slice(&[1, 2, 3, 4]);
            s.write_all(&h).unwrap();
            held.push(s);
        }
        for _ in 0..EACH {
            let mut s = ws_upgrade(connect_from(src(), server.addr));
            s.write_all(&[0x81, 0x85, 1, 2]).unwrap();
            socket2::SockRef::from(&s)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
        }
        let k = (EACH * round) as f64;
        let m = server.wait_metrics_for("round closed", Duration::from_secs(20), |m| {
            sum(m, "c10m_connections") == 1.0
                && sample(
                    m,
                    "c10m_connections_closed_total{reason=\"handshake_timeout\"}",
                ) == Some(k)
        });
        assert_eq!(
            value(
                &m,
                "c10m_connections_closed_total{reason=\"bad_handshake\"}"
            ),
            k
        );
        assert_eq!(
            value(&m, "c10m_connections_closed_total{reason=\"too_large\"}"),
            k
        );
        drop(held);
        ws_echo(&mut good, format!("round {round}").as_bytes());
        if round == 1 {
            rss_after_first = rss_bytes(pid);
        }
    }
    let m = server.wait_metrics("resets counted", |m| {
        sample(m, "c10m_connections_closed_total{reason=\"reset\"}").unwrap_or(0.0)
            + sample(m, "c10m_connections_closed_total{reason=\"peer\"}").unwrap_or(0.0)
            == (EACH * ROUNDS) as f64
    });
    assert_eq!(sum(&m, "c10m_connections"), 1.0);
    // The refused and the 1009s wait for their clients' close (issue 21).
    server.wait_metrics("no close handshake left", |m| {
        sum(m, "c10m_connections_closing") == 0.0
    });
    let (fds, rss) = (open_fds(pid), rss_bytes(pid));
    eprintln!("fds {fds0} -> {fds}; rss after round 1 {rss_after_first} B, after 100k {rss} B");
    assert_eq!(fds, fds0, "descriptors leaked");
    assert!(
        rss <= rss_after_first + 1024 * 1024,
        "resident memory grew from {rss_after_first} to {rss} bytes over 95,000 more abusive connections"
    );
}
