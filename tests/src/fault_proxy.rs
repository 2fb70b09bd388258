//! A loopback TCP proxy in front of the test plane's kube-apiserver that
//! injects the faults a flaky network gives a client: connections cut
//! (every live one at once, with new ones refused for a while) and single
//! requests lost. It forwards bytes and never reads them: the API server's
//! TLS runs end to end between the client and kube-apiserver, so a client
//! sees exactly the errors a real cut gives (EOF mid-request, a failed
//! handshake), from the real server and its real client stack.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{kubeconfig, workspace};

/// How long the proxy waits for the API server to accept a connection it
/// forwards before it gives up on it (the client then sees EOF). Loopback
/// connects take microseconds; this only bounds a dead API server.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A running proxy on `127.0.0.1:<ephemeral port>`; stopped (its listener
/// closed, every connection cut) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    /// Refuse (accept and close at once) new connections until then.
    refuse_until: Mutex<Option<Instant>>,
    /// Cut the connection carrying each of the next this-many requests.
    drop_next: AtomicUsize,
    /// Live forwarded connections: id → (client side, upstream side).
    live: Mutex<Vec<(u64, TcpStream, TcpStream)>>,
    next_id: AtomicU64,
    refused: AtomicUsize,
    dropped: AtomicUsize,
    accepted: AtomicUsize,
    stop: AtomicBool,
}

impl State {
    fn refusing(&self) -> bool {
        self.refuse_until
            .lock()
            .unwrap()
            .is_some_and(|t| Instant::now() < t)
    }

    fn forget(&self, id: u64) {
        self.live.lock().unwrap().retain(|(i, _, _)| *i != id);
    }

    fn cut_all(&self) {
        for (_, client, upstream) in self.live.lock().unwrap().drain(..) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
        }
    }
}

impl FaultProxy {
    /// Starts a proxy to `upstream` (host:port).
    pub fn start(upstream: &str) -> FaultProxy {
        let upstream: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(upstream)
            .unwrap_or_else(|e| panic!("resolve {upstream}: {e}"))
            .next()
            .unwrap_or_else(|| panic!("{upstream} resolves to nothing"));
        assert!(
            upstream.ip().is_loopback(),
            "the fault proxy only forwards to loopback, not {upstream}"
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = conn else { continue };
                if st.refusing() {
                    st.refused.fetch_add(1, Ordering::SeqCst);
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect_timeout(&upstream, UPSTREAM_CONNECT_TIMEOUT)
                else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                st.accepted.fetch_add(1, Ordering::SeqCst);
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let id = st.next_id.fetch_add(1, Ordering::SeqCst);
                st.live.lock().unwrap().push((
                    id,
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                ));
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let up = st.clone();
                std::thread::spawn(move || pump(id, client, server, Some(up)));
                let down = st.clone();
                std::thread::spawn(move || {
                    pump(id, s2, c2, None);
                    down.forget(id);
                });
            }
        });
        FaultProxy { addr, state }
    }

    /// Starts a proxy to the API server of the test kubeconfig and writes a
    /// copy of that kubeconfig pointing at it, as
    /// `target/e2e-logs/<name>.kubeconfig` (same CA, same credentials: the
    /// API server's certificate is issued for 127.0.0.1).
    pub fn for_api_server(name: &str) -> (FaultProxy, PathBuf) {
        let text = std::fs::read_to_string(kubeconfig()).unwrap();
        let mut config: Value = serde_yaml::from_str(&text).unwrap();
        let server = config["clusters"][0]["cluster"]["server"]
            .as_str()
            .expect("the kubeconfig names a server")
            .to_string();
        let host_port = server
            .strip_prefix("https://")
            .unwrap_or_else(|| panic!("{server} is not https://host:port"))
            .trim_end_matches('/');
        let proxy = FaultProxy::start(host_port);
        for cluster in config["clusters"].as_array_mut().unwrap() {
            cluster["cluster"]["server"] = Value::String(format!("https://{}", proxy.addr()));
        }
        let dir = workspace().join("target/e2e-logs");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.kubeconfig"));
        std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
        (proxy, path)
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A network blip: cuts every live connection now and refuses new ones
    /// for `length`; returns at once.
    pub fn blip(&self, length: Duration) {
        *self.state.refuse_until.lock().unwrap() = Some(Instant::now() + length);
        self.state.cut_all();
    }

    /// Loses the next `n` requests: the connection that carries the first
    /// bytes of each (a request on a kept-alive connection, or the TLS
    /// handshake of a new one) is cut before they reach the API server.
    pub fn drop_next(&self, n: usize) {
        self.state.drop_next.store(n, Ordering::SeqCst);
    }

    /// Requests still to be lost from the last [`FaultProxy::drop_next`].
    pub fn drops_pending(&self) -> usize {
        self.state.drop_next.load(Ordering::SeqCst)
    }

    /// Requests lost so far.
    pub fn dropped(&self) -> usize {
        self.state.dropped.load(Ordering::SeqCst)
    }

    /// Connections refused so far (during blips).
    pub fn refused(&self) -> usize {
        self.state.refused.load(Ordering::SeqCst)
    }

    /// Connections forwarded so far.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect(self.addr);
        self.state.cut_all();
    }
}

/// Copies `from` → `to` until either side ends. On the client → server
/// direction (`faults` set), with requests to lose, the connection is cut
/// at the next bytes the client sends: a client that only makes small
/// requests one at a time (a follower's Lease reads) sends each request, or
/// the handshake of a new connection, in one burst.
fn pump(id: u64, mut from: TcpStream, mut to: TcpStream, faults: Option<Arc<State>>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(st) = &faults
            && st
                .drop_next
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |k| k.checked_sub(1))
                .is_ok()
        {
            st.dropped.fetch_add(1, Ordering::SeqCst);
            st.forget(id);
            break;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
