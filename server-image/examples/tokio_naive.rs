//! Benchmark baseline: the echo server a user writes first with tokio, one
//! task per connection with an 8 KiB `BufReader` and an 8 KiB `BufWriter`.
//! `make bench-server` runs 8 of these on one port (SO_REUSEPORT) to compare
//! memory per connection with c10m-server.
//!
//! Usage: `tokio_naive BIND_ADDR:PORT`

use std::net::SocketAddr;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpSocket;

/// Buffer size of the reader and of the writer, in bytes: tokio's (and
/// std's) default `BufReader`/`BufWriter` capacity.
const BUF_BYTES: usize = 8 * 1024;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7000".into())
        .parse()
        .expect("BIND_ADDR:PORT");
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(c10m_wire::limits::LISTEN_BACKLOG)?;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(_) => continue,
        };
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let (r, w) = stream.into_split();
            let mut r = BufReader::with_capacity(BUF_BYTES, r);
            let mut w = BufWriter::with_capacity(BUF_BYTES, w);
            loop {
                let n = match r.fill_buf().await {
                    Ok([]) | Err(_) => return,
                    Ok(buf) => {
                        if w.write_all(buf).await.is_err() {
                            return;
                        }
                        buf.len()
                    }
                };
                r.consume(n);
                if w.flush().await.is_err() {
                    return;
                }
            }
        });
    }
}
