//! Peers that vanish without a FIN or RST (issue 10, fault 9): the server
//! must stop counting them as live within the keepalive time.
//!
//! Everything happens on this machine, in network namespaces the test
//! creates and deletes: the server runs in one, the clients in another,
//! joined by veth pairs with addresses from 198.18.0.0/15 (RFC 2544's
//! benchmarking range) that exist only inside those namespaces; nothing is
//! routed anywhere else. A peer vanishes when its link is deleted, or when
//! its end of the link goes down (the other end then drops every packet
//! silently). The namespaces are held by processes (`common::Netns`), so
//! nothing is left under /run/netns. Needs root, iproute2 and util-linux; without them the tests fail (they
//! do not pass silently).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Netns, enter_netns, sample, sum};

/// Two network namespaces, `server` and `clients`, joined by veth pairs;
/// both go (with every link in them) on drop.
struct Net {
    server: Netns,
    clients: Netns,
    links: u8,
}

impl Net {
    fn new() -> Net {
        Net {
            server: Netns::new(),
            clients: Netns::new(),
            links: 0,
        }
    }

    /// Adds veth pair `i` (its server end `s<i>`, client end `c<i>`) with
    /// 198.18.0.(4i+1)/30 on the server side and .(4i+2) on the clients'.
    /// Returns the server-side address.
    fn link(&mut self) -> Ipv4Addr {
        let i = self.links;
        self.links += 1;
        let (s, c) = (format!("s{i}"), format!("c{i}"));
        let clients_pid = self.clients.pid().to_string();
        self.server.ip(&[
            "link",
            "add",
            "name",
            &s,
            "type",
            "veth",
            "peer",
            "name",
            &c,
            "netns",
            &clients_pid,
        ]);
        let server_ip = Ipv4Addr::new(198, 18, 0, 4 * i + 1);
        let client_ip = Ipv4Addr::new(198, 18, 0, 4 * i + 2);
        self.server
            .ip(&["addr", "add", &format!("{server_ip}/30"), "dev", &s]);
        self.clients
            .ip(&["addr", "add", &format!("{client_ip}/30"), "dev", &c]);
        self.server.ip(&["link", "set", &s, "up"]);
        self.clients.ip(&["link", "set", &c, "up"]);
        server_ip
    }

    /// Link `i` disappears: both ends are deleted.
    fn remove(&self, i: u8) {
        self.server.ip(&["link", "del", &format!("s{i}")]);
    }

    /// Link `i` goes silent: the clients' end goes down, so the server's end
    /// drops everything it sends without telling anyone.
    fn silence(&self, i: u8) {
        self.clients.ip(&["link", "set", &format!("c{i}"), "down"]);
    }
}

/// A `c10m-server` inside the server namespace, bound to all of its
/// addresses; killed on drop.
struct NsServer {
    child: Child,
    ns: String,
    admin: u16,
}

impl NsServer {
    fn start(net: &Net, port: u16, admin: u16, args: &[&str]) -> NsServer {
        let child = net
            .server
            .command(BIN)
            .args(["--bind", "0.0.0.0", "--workers", "2"])
            .args([
                "--port",
                &port.to_string(),
                "--metrics-port",
                &admin.to_string(),
            ])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nsenter c10m-server");
        let s = NsServer {
            child,
            ns: net.server.path().to_string(),
            admin,
        };
        let deadline = Instant::now() + common::START_TIMEOUT;
        while s.try_metrics().is_none() {
            assert!(
                Instant::now() < deadline,
                "server did not start in {}",
                s.ns
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn try_metrics(&self) -> Option<String> {
        let admin = self.admin;
        enter_netns(&self.ns, move || {
            let mut s = TcpStream::connect(("127.0.0.1", admin)).ok()?;
            s.set_read_timeout(Some(common::IO_TIMEOUT)).ok()?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                .ok()?;
            let mut r = String::new();
            s.read_to_string(&mut r).ok()?;
            Some(r.split_once("\r\n\r\n")?.1.to_string())
        })
    }

    fn metrics(&self) -> String {
        self.try_metrics().expect("GET /metrics")
    }

    fn live(&self) -> f64 {
        sum(&self.metrics(), "c10m_connections")
    }
}

impl Drop for NsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Opens `n` connections from the clients' namespace to `to`, each
/// checked with one echo (or upgraded, for WebSocket).
fn clients(net: &Net, to: SocketAddrV4, n: usize, websocket: bool) -> Vec<TcpStream> {
    net.clients.enter(|| {
        (0..n)
            .map(|_| {
                let addr = SocketAddr::V4(to);
                let mut s = TcpStream::connect_timeout(&addr, common::IO_TIMEOUT).unwrap();
                s.set_read_timeout(Some(common::IO_TIMEOUT)).unwrap();
                if websocket {
                    common::ws_upgrade(s)
                } else {
                    common::echo_once(&mut s, b"hello");
                    s
                }
            })
            .collect()
    })
}

/// Waits until `pred` holds for the server's live count; returns when.
fn wait_live(s: &NsServer, within: Duration, pred: impl Fn(f64) -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if pred(s.live()) {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

const PORT: u16 = 7000;

#[test]
fn vanished_peers_stop_counting_within_the_keepalive_time() {
    // 200 clients vanish (100 by link removal, 100 by a link that goes
    // silent); 20 on a third link stay. Keepalive 2 s idle, then 2 probes
    // 1 s apart: dead peers go within 2 + 1 × 2 = 4 s. A second server with
    // keepalive off, as before the fix, holds all of them.
    let mut net = Net::new();
    let (removed, kept, silenced) = (net.link(), net.link(), net.link());
    let on = NsServer::start(
        &net,
        PORT,
        9090,
        &[
            "--keepalive-idle-secs",
            "2",
            "--keepalive-interval-secs",
            "1",
            "--keepalive-count",
            "2",
        ],
    );
    let off = NsServer::start(&net, PORT + 1, 9091, &["--keepalive-idle-secs", "0"]);
    let mut survivors = Vec::new();
    let mut vanishing = Vec::new();
    for (srv, port) in [(&on, PORT), (&off, PORT + 1)] {
        vanishing.extend(clients(&net, SocketAddrV4::new(removed, port), 100, false));
        vanishing.extend(clients(&net, SocketAddrV4::new(silenced, port), 100, false));
        survivors.extend(clients(&net, SocketAddrV4::new(kept, port), 20, false));
        assert_eq!(srv.live(), 220.0);
    }
    let t0 = Instant::now();
    net.remove(0);
    net.silence(2);
    let dead_after = Duration::from_secs(4);
    let slack = Duration::from_secs(3);
    let took = wait_live(&on, dead_after + slack, |n| n == 20.0);
    let took = took.unwrap_or_else(|| {
        panic!(
            "still {} live {:?} after 200 peers vanished",
            on.live(),
            t0.elapsed()
        )
    });
    eprintln!(
        "200 vanished peers stopped counting {:.2} s after they vanished \
         (keepalive 2 + 1 × 2 = 4 s)",
        t0.elapsed().as_secs_f64()
    );
    assert!(took >= Duration::from_secs(2), "{took:?}: too soon");
    let m = on.metrics();
    assert_eq!(
        sample(&m, "c10m_connections_closed_total{reason=\"unreachable\"}"),
        Some(200.0),
        "{m}"
    );
    // Keepalive off: the same 200 still count.
    assert_eq!(off.live(), 220.0);
    // Idle survivors were probed too, and answered: still served.
    net.clients.enter(|| {
        for s in &mut survivors {
            common::echo_once(s, b"still here");
        }
    });
    assert_eq!(on.live(), 20.0);
    drop(vanishing);
}

/// Answers server pings on `conns` with pongs until `stop`.
fn answer_pings(conns: &mut [TcpStream], stop: Instant) {
    for c in conns.iter() {
        c.set_nonblocking(true).unwrap();
    }
    let pong = c10m_server::ws::client_frame(true, 0xA, b"", [1, 2, 3, 4]);
    let mut b = [0u8; 64];
    while Instant::now() < stop {
        for c in conns.iter_mut() {
            match c.read(&mut b) {
                Ok(n) if n > 0 => {
                    // Server pings are [0x89, 0x00]: one pong each.
                    let pings = b[..n].windows(2).filter(|w| w == &[0x89, 0]).count();
                    for _ in 0..pings {
                        c.write_all(&pong).unwrap();
                    }
                }
                Ok(_) => panic!("a live client was closed"),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_vanished_peer_with_unacknowledged_data_goes_at_the_user_timeout() {
    // Keepalive sends no probes while sent data is unacknowledged: here a
    // server ping to a peer that vanished. TCP_USER_TIMEOUT (3 s) drops it
    // long before keepalive (30 s idle) or the pong deadline (60 s) would.
    let mut net = Net::new();
    let (vanish, kept) = (net.link(), net.link());
    let server = NsServer::start(
        &net,
        PORT,
        9090,
        &[
            "--protocol",
            "websocket",
            "--ws-ping-secs",
            "1",
            "--ws-pong-timeout-secs",
            "60",
            "--keepalive-idle-secs",
            "30",
            "--tcp-user-timeout-secs",
            "3",
        ],
    );
    let vanishing = clients(&net, SocketAddrV4::new(vanish, PORT), 50, true);
    let mut survivors = clients(&net, SocketAddrV4::new(kept, PORT), 5, true);
    assert_eq!(server.live(), 55.0);
    let t0 = Instant::now();
    net.silence(0);
    let stop = t0 + Duration::from_secs(9);
    let answered = std::thread::scope(|s| {
        let h = s.spawn(|| answer_pings(&mut survivors, stop));
        // Pinged within 2 s of silence, then 3 s unacknowledged: 5 s, plus
        // the kernel's next retransmission timer.
        let took = wait_live(&server, Duration::from_secs(9), |n| n == 5.0);
        h.join().unwrap();
        took
    });
    let took = answered.unwrap_or_else(|| panic!("still {} live", server.live()));
    eprintln!(
        "50 vanished peers with a ping in flight stopped counting {:.2} s after they vanished",
        took.as_secs_f64()
    );
    let m = server.metrics();
    assert_eq!(
        sample(&m, "c10m_connections_closed_total{reason=\"unreachable\"}"),
        Some(50.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "c10m_connections_closed_total{reason=\"ping_timeout\"}"),
        Some(0.0)
    );
    assert_eq!(server.live(), 5.0, "survivors answered their pings");
    drop(vanishing);
}
