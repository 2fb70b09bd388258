//! Clients that stop in the middle of a WebSocket frame (issue 10, fault
//! 10): each unfinished frame is closed at the frame timeout, and what a
//! worker holds for them at once is bounded by its budget, however many
//! there are.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

/// The first `bytes` of a masked binary frame of `payload` bytes.
fn frame_start(payload: usize, bytes: usize) -> Vec<u8> {
    let f = c10m_server::ws::client_frame(true, 0x2, &vec![7u8; payload], [1, 2, 3, 4]);
    f[..bytes].to_vec()
}

/// Reads until EOF (or reset); returns what came.
fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&b[..n]),
        }
    }
}

#[test]
fn unfinished_frames_close_at_the_frame_timeout_with_1008() {
    let server = Server::start(1, &["--protocol", "websocket", "--frame-timeout-secs", "2"]);
    let mut good = ws_connect(&server);
    // Half a frame, then silence.
    let mut half = ws_connect(&server);
    // Before the write: the frame's deadline counts from after it.
    let t0 = Instant::now();
    half.write_all(&frame_start(1000, 500)).unwrap();
    // A trickle: a byte every 200 ms never finishes in time, and reads do
    // not extend the frame's deadline.
    let mut trickle = ws_connect(&server);
    let mut w = trickle.try_clone().unwrap();
    let frame = frame_start(1000, 1008);
    let trickler = std::thread::spawn(move || {
        for b in &frame[..40] {
            if w.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    // Frames that complete reset nothing for others and keep working.
    for _ in 0..3 {
        ws_echo(&mut good, b"alive");
        std::thread::sleep(Duration::from_millis(300));
    }
    let close_1008 = [0x88, 2, 0x03, 0xf0];
    assert_eq!(read_all(&mut half), close_1008);
    let after = t0.elapsed();
    assert!(
        after >= Duration::from_secs(2) && after < Duration::from_secs(4),
        "closed after {after:?} (timeout 2 s, swept once a second)"
    );
    assert_eq!(read_all(&mut trickle), close_1008);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "trickle outlived the timeout"
    );
    trickler.join().unwrap();
    let m = server.wait_metrics("frame timeouts", |m| {
        sample(m, "c10m_connections_closed_total{reason=\"frame_timeout\"}") == Some(2.0)
    });
    assert_eq!(sum(&m, "c10m_connections"), 1.0);
    assert_eq!(sum(&m, "c10m_partial_bytes"), 0.0);
    ws_echo(&mut good, b"still here");
}

/// Opens `n` upgraded connections, each of which then sends the first
/// `bytes` of a frame of `payload` bytes and stops.
fn half_sent_frames(server: &Server, n: usize, payload: usize, bytes: usize) -> Vec<TcpStream> {
    let start = frame_start(payload, bytes);
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = ws_connect(server);
        // Closed by the server (over budget) is fine: keep going.
        let _ = s.write_all(&start);
        held.push(s);
    }
    held
}

#[test]
fn two_thousand_half_sent_frames_hold_at_most_the_budget() {
    // Issue 10, fault 10: 2,000 clients each sending most of a large frame
    // took RSS from 7.5 to 140 MiB. Two workers, the default 64 KiB frame
    // limit and the default 8 MiB budget per worker.
    const N: usize = 2000;
    const BUDGET: f64 = (8 << 20) as f64;
    let server = Server::start(2, &["--protocol", "websocket", "--frame-timeout-secs", "4"]);
    let pid = server.child.id();
    // Warm up: the slab, the scratch and join buffers of both workers.
    let warm = half_sent_frames(&server, 64, 65_536, 65_536 + 14);
    drop(warm);
    server.wait_metrics("warm-up closed", |m| sum(m, "c10m_connections") == 0.0);
    let rss0 = rss_bytes(pid);
    let t0 = Instant::now();
    let held = half_sent_frames(&server, N, 65_536, 60 * 1024);
    let m = server.wait_metrics_for("every half frame read", Duration::from_secs(20), |m| {
        sum(m, "c10m_received_bytes_total") >= (N * (60 * 1024 + 150)) as f64
    });
    let rss1 = rss_bytes(pid);
    let partial = sum(&m, "c10m_partial_bytes");
    // `sample`, not `value`: the same measurement runs against servers
    // without the budget (for the figures in the README).
    let over = sample(&m, "c10m_connections_closed_total{reason=\"budget\"}").unwrap_or(0.0);
    eprintln!(
        "RSS {rss0} -> {rss1} B (+{:.1} MiB) with {N} half-sent frames of 60 KiB; \
         held {:.1} MiB, {over} closed over budget, {:.1} s",
        (rss1 as f64 - rss0 as f64) / (1 << 20) as f64,
        partial / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    assert!(partial <= 2.0 * BUDGET, "held {partial} B");
    assert!(
        partial >= BUDGET,
        "the budget was used, not refused early: {partial}"
    );
    // RSS: the two budgets plus allocator slack, not 2,000 × 60 KiB.
    assert!(
        rss1 <= rss0 + (2.0 * BUDGET) as u64 + (8 << 20),
        "RSS grew from {rss0} to {rss1}"
    );
    // Everyone the budget could not hold was told to come back later.
    assert!(over >= (N - 2 * 137) as f64, "{over} closed over budget");
    // The rest are closed at the frame timeout and their bytes released.
    let m = server.wait_metrics_for("frame timeouts", Duration::from_secs(10), |m| {
        sum(m, "c10m_connections") == 0.0
    });
    assert_eq!(sum(&m, "c10m_partial_bytes"), 0.0);
    assert_eq!(
        value(
            &m,
            "c10m_connections_closed_total{reason=\"frame_timeout\"}"
        ) + value(&m, "c10m_connections_closed_total{reason=\"budget\"}"),
        N as f64
    );
    drop(held);
    // A client with a whole frame still gets its echo.
    let mut c = ws_connect(&server);
    ws_echo(&mut c, &[3u8; 65_536]);
}
