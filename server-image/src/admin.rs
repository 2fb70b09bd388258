//! The admin HTTP/1.1 server: `GET /metrics` and `GET /healthz`.
//!
//! One thread, one request per connection (`Connection: close`), requests
//! parsed with `httparse`. Scrapes and probes are a few per second, so this
//! stays off the workers and out of their way.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use socket2::{Domain, Socket, Type};

use crate::metrics::{Format, Metrics};
use crate::worker::Shared;

/// Largest request head accepted, in bytes; larger gets 431.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// Headers parsed per request; more gets 431.
pub const MAX_HEADERS: usize = 32;

/// Read and write timeout per admin connection. A stalled client can hold
/// the admin thread this long, and no longer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// A response ready to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type` header value.
    pub content_type: &'static str,
    /// Extra header lines (`Name: value`), without CRLF.
    pub headers: Vec<(&'static str, &'static str)>,
    /// Body; omitted on the wire for HEAD.
    pub body: String,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: format!("{body}\n"),
        }
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// What `/healthz` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Serving: 200.
    Serving,
    /// Draining after SIGTERM/SIGINT: 503, so readiness drops.
    Draining,
}

/// A parsed request head: what routing needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Method, e.g. `GET`.
    pub method: String,
    /// Request target, e.g. `/metrics?x=1`.
    pub target: String,
    /// The `Accept` header, if sent.
    pub accept: Option<String>,
}

/// Routes one request. Pure, apart from calling `metrics` to encode.
///
/// `GET`/`HEAD` `/metrics` (format by `Accept`, see [`Format::negotiate`])
/// and `/healthz` (query strings ignored); any other method on those paths
/// is 405 with `Allow`; any other path is 404.
pub fn route(req: &Request, health: Health, metrics: &dyn Fn(Format) -> String) -> Response {
    let (method, target) = (req.method.as_str(), req.target.as_str());
    let path = target.split(['?', '#']).next().unwrap_or(target);
    let known = matches!(path, "/metrics" | "/healthz");
    if !known {
        return Response::text(404, "not found");
    }
    if method != "GET" && method != "HEAD" {
        let mut r = Response::text(405, "method not allowed");
        r.headers.push(("Allow", "GET, HEAD"));
        return r;
    }
    match (path, health) {
        ("/metrics", _) => {
            let format = Format::negotiate(req.accept.as_deref());
            Response {
                status: 200,
                content_type: format.content_type(),
                headers: Vec::new(),
                body: metrics(format),
            }
        }
        (_, Health::Serving) => Response::text(200, "ok"),
        (_, Health::Draining) => Response::text(503, "draining"),
    }
}

/// Serialises `r`; the body is left out for HEAD.
pub fn render(r: &Response, head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        reason_phrase(r.status),
        r.content_type,
        r.body.len()
    );
    for (k, v) in &r.headers {
        out.push_str(k);
        out.push_str(": ");
        out.push_str(v);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    if !head_only {
        bytes.extend_from_slice(r.body.as_bytes());
    }
    bytes
}

/// The outcome of parsing what has been read so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A complete request head.
    Request(Request),
    /// Need more bytes.
    Partial,
    /// Not HTTP/1.x, or too many headers: answer with this status.
    Invalid(u16),
}

/// Parses a request head with `httparse`.
pub fn parse(buf: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => Parsed::Request(Request {
            method: req.method.unwrap_or_default().to_string(),
            target: req.path.unwrap_or_default().to_string(),
            accept: req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("accept"))
                .map(|h| String::from_utf8_lossy(h.value).into_owned()),
        }),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_REQUEST_HEAD => Parsed::Invalid(431),
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => Parsed::Invalid(431),
        Err(_) => Parsed::Invalid(400),
    }
}

/// Binds the admin listener (SO_REUSEADDR, so a restart does not wait out
/// TIME_WAIT; no SO_REUSEPORT, so a second server on the port fails loudly).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

/// Serves the admin endpoints on `listener` from a new thread, for the life
/// of the process.
pub fn spawn(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("c10m-admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        if let Err(e) = serve(s, &metrics, &shared) {
                            tracing::debug!(error = %e, "admin connection failed");
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "admin accept failed");
                        // EMFILE and friends: back off instead of spinning.
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        })
}

fn serve(mut stream: TcpStream, metrics: &Metrics, shared: &Shared) -> io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buf = vec![0u8; MAX_REQUEST_HEAD];
    let mut len = 0;
    let (response, head_only) = loop {
        let n = stream.read(&mut buf[len..])?;
        if n == 0 {
            return Ok(()); // closed before a full request
        }
        len += n;
        match parse(&buf[..len]) {
            Parsed::Partial => continue,
            Parsed::Invalid(status) => break (Response::text(status, "bad request"), false),
            Parsed::Request(req) => {
                let health = if shared.draining() {
                    Health::Draining
                } else {
                    Health::Serving
                };
                let r = route(&req, health, &|f| metrics.encode(f));
                break (r, req.method == "HEAD");
            }
        }
    };
    stream.write_all(&render(&response, head_only))?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(f: Format) -> String {
        format!("x 1 {f:?}\n")
    }

    fn req(method: &str, target: &str) -> Request {
        Request {
            method: method.into(),
            target: target.into(),
            accept: None,
        }
    }

    #[test]
    fn routes() {
        let r = route(&req("GET", "/metrics"), Health::Serving, &m);
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "x 1 PrometheusText\n");
        assert_eq!(r.content_type, "text/plain; version=0.0.4; charset=utf-8");
        let mut om = req("GET", "/metrics");
        om.accept = Some("application/openmetrics-text;version=1.0.0".into());
        let r = route(&om, Health::Serving, &m);
        assert_eq!(r.body, "x 1 OpenMetrics\n");
        assert!(r.content_type.starts_with("application/openmetrics-text"));

        assert_eq!(
            route(&req("GET", "/metrics?a=b"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("GET", "/healthz"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("HEAD", "/healthz"), Health::Serving, &m).status,
            200
        );
        assert_eq!(
            route(&req("GET", "/healthz"), Health::Draining, &m).status,
            503
        );
        assert_eq!(route(&req("GET", "/"), Health::Serving, &m).status, 404);
        assert_eq!(
            route(&req("GET", "/metricsx"), Health::Serving, &m).status,
            404
        );
        assert_eq!(
            route(&req("POST", "/nope"), Health::Serving, &m).status,
            404
        );

        let r = route(&req("POST", "/metrics"), Health::Serving, &m);
        assert_eq!(r.status, 405);
        assert_eq!(r.headers, vec![("Allow", "GET, HEAD")]);
        assert_eq!(
            route(&req("DELETE", "/healthz"), Health::Serving, &m).status,
            405
        );
    }

    #[test]
    fn parses_with_httparse() {
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\nACCEPT: text/plain\r\n\r\n"),
            Parsed::Request(Request {
                method: "GET".into(),
                target: "/metrics".into(),
                accept: Some("text/plain".into()),
            })
        );
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\nHo"), Parsed::Partial);
        assert_eq!(parse(b"\x00\x01garbage\r\n\r\n"), Parsed::Invalid(400));
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse(&many), Parsed::Invalid(431));
        let huge = [b'a'; MAX_REQUEST_HEAD];
        let mut req = b"GET /".to_vec();
        req.extend_from_slice(&huge);
        assert_eq!(parse(&req[..MAX_REQUEST_HEAD]), Parsed::Invalid(431));
    }

    #[test]
    fn renders_head_without_body() {
        let r = Response::text(200, "ok");
        let full = String::from_utf8(render(&r, false)).unwrap();
        assert!(full.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(full.contains("Content-Length: 3\r\n"));
        assert!(full.ends_with("\r\n\r\nok\n"));
        let head = String::from_utf8(render(&r, true)).unwrap();
        assert!(head.ends_with("\r\n\r\n"));
        assert!(head.contains("Content-Length: 3\r\n"));
    }
}
