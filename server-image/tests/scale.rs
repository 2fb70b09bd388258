//! End-to-end at scale: 40,000 connections held across 3 `c10m-server`
//! processes sharing one port (SO_REUSEPORT), opened and pinged by
//! `c10m-loadgen` (3 child processes: 20,000 descriptors per process here),
//! with zero errors. Takes ~30 s, so it is ignored by `cargo test` and run
//! by `make test-server-scale`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = env!("CARGO_BIN_EXE_c10m-server");
const LOADGEN: &str = env!("CARGO_BIN_EXE_c10m-loadgen");
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
    let mut lg = Command::new(LOADGEN)
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
