//! The admin HTTP/1.1 server: `GET /metrics`, `GET /healthz`, and the
//! authenticated `POST /drain?rate=R` and `POST /shed?count=N&rate=R`.
//!
//! Paths and query keys are the operator's contract
//! ([`c10m_wire::admin`]). One thread, one request per connection
//! (`Connection: close`), requests parsed with `httparse`, query strings
//! with `form_urlencoded`. Scrapes and
//! probes are a few per second, so this stays off the workers and out of
//! their way.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use socket2::{Domain, Socket, Type};

use c10m_wire::admin::{COUNT_KEY, DRAIN_PATH, HEALTHZ_PATH, METRICS_PATH, RATE_KEY, SHED_PATH};
use subtle::ConstantTimeEq;

use crate::conn::CloseReason;
use crate::control::{CloseOrder, Shared};
use crate::metrics::{Format, Metrics};

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
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
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
    /// The `Authorization` header, if sent.
    pub authorization: Option<String>,
}

/// An order the admin port accepted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// `POST /drain?rate=R`: stop accepting, close everything at `rate`
    /// per second (`None`: the configured `--drain-rate`), then exit.
    Drain {
        /// Closes per second; 0 means all at once.
        rate: Option<f64>,
    },
    /// `POST /shed?count=N&rate=R`: close `count` connections at `rate`
    /// per second (0 or absent: at once) while still accepting.
    Shed {
        /// Connections to close.
        count: u64,
        /// Closes per second; 0 means all at once.
        rate: f64,
    },
}

/// Whether `authorization` carries `Bearer <token>`, compared in constant
/// time. Without a configured token every request fails.
pub fn authorized(authorization: Option<&str>, token: Option<&str>) -> bool {
    let (Some(auth), Some(token)) = (authorization, token) else {
        return false;
    };
    let Some((scheme, given)) = auth.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && bool::from(given.trim().as_bytes().ct_eq(token.as_bytes()))
}

fn number<T: std::str::FromStr>(query: &str, key: &str) -> Result<Option<T>, ()> {
    match form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == key) {
        None => Ok(None),
        Some((_, v)) => v.parse().map(Some).map_err(|_| ()),
    }
}

fn rate(query: &str) -> Result<Option<f64>, ()> {
    match number::<f64>(query, RATE_KEY)? {
        Some(r) if !r.is_finite() || r < 0.0 => Err(()),
        r => Ok(r),
    }
}

/// Parses the query of `POST /drain` or `POST /shed` into an [`Action`].
pub fn parse_action(path: &str, query: &str) -> Result<Action, &'static str> {
    match path {
        DRAIN_PATH => Ok(Action::Drain {
            rate: rate(query).map_err(|()| "rate must be a number >= 0")?,
        }),
        SHED_PATH => {
            let count = number::<u64>(query, COUNT_KEY)
                .map_err(|()| "count must be an integer >= 0")?
                .ok_or("count is required")?;
            let rate = rate(query).map_err(|()| "rate must be a number >= 0")?;
            Ok(Action::Shed {
                count,
                rate: rate.unwrap_or(0.0),
            })
        }
        _ => Err("unknown action"),
    }
}

/// Routes one request. Pure, apart from calling `metrics` to encode and
/// `act` to carry out an accepted order (it returns the JSON body).
///
/// `GET`/`HEAD` `/metrics` (format by `Accept`, see [`Format::negotiate`])
/// and `/healthz` (query strings ignored); any other method on those paths
/// is 405 with `Allow`. `POST /drain` and `POST /shed` need
/// `Authorization: Bearer <token>` (else 401), valid parameters (else 400)
/// and answer 202; other methods there are 405. Any other path is 404.
pub fn route(
    req: &Request,
    health: Health,
    token: Option<&str>,
    metrics: &dyn Fn(Format) -> String,
    act: &mut dyn FnMut(Action) -> String,
) -> Response {
    let (method, target) = (req.method.as_str(), req.target.as_str());
    let path = target.split(['?', '#']).next().unwrap_or(target);
    if matches!(path, DRAIN_PATH | SHED_PATH) {
        if method != "POST" {
            let mut r = Response::text(405, "method not allowed");
            r.headers.push(("Allow", "POST"));
            return r;
        }
        if !authorized(req.authorization.as_deref(), token) {
            let mut r = Response::text(401, "unauthorized");
            r.headers.push(("WWW-Authenticate", "Bearer"));
            return r;
        }
        let query = target
            .split_once('?')
            .map_or("", |(_, q)| q.split('#').next().unwrap_or(""));
        return match parse_action(path, query) {
            Ok(action) => Response {
                status: 202,
                content_type: "application/json",
                headers: Vec::new(),
                body: act(action) + "\n",
            },
            Err(e) => Response::text(400, e),
        };
    }
    let known = matches!(path, METRICS_PATH | HEALTHZ_PATH);
    if !known {
        return Response::text(404, "not found");
    }
    if method != "GET" && method != "HEAD" {
        let mut r = Response::text(405, "method not allowed");
        r.headers.push(("Allow", "GET, HEAD"));
        return r;
    }
    match (path, health) {
        (METRICS_PATH, _) => {
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
            authorization: req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("authorization"))
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

/// What the admin thread needs besides its listener.
pub struct AdminState {
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// Worker state (draining flag, close orders).
    pub shared: Arc<Shared>,
    /// Bearer token for `POST /drain` and `POST /shed`; `None`: always 401.
    pub token: Option<String>,
    /// Starts a drain at the given rate (the main thread runs it, with its
    /// deadline).
    pub drain: Box<dyn Fn(f64) + Send>,
    /// `--drain-rate`, for a `POST /drain` without `rate`.
    pub default_drain_rate: f64,
}

/// Serves the admin endpoints on `listener` from a new thread, for the life
/// of the process.
pub fn spawn(listener: TcpListener, state: AdminState) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("c10m-admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(s) => {
                        if let Err(e) = serve(s, &state) {
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

fn act(state: &AdminState, action: Action) -> String {
    let shared = &state.shared;
    match action {
        Action::Drain { rate } => {
            let rate = rate.unwrap_or(state.default_drain_rate);
            (state.drain)(rate);
            format!(
                "{{\"action\":\"drain\",\"rate\":{rate},\"live\":{}}}",
                shared.live()
            )
        }
        Action::Shed { count, rate } => {
            if shared.draining() {
                return format!(
                    "{{\"action\":\"shed\",\"ignored\":\"draining\",\"live\":{}}}",
                    shared.live()
                );
            }
            shared.set_order(CloseOrder::new(CloseReason::Shed, count, rate));
            format!(
                "{{\"action\":\"shed\",\"count\":{count},\"rate\":{rate},\"live\":{}}}",
                shared.live()
            )
        }
    }
}

fn serve(mut stream: TcpStream, state: &AdminState) -> io::Result<()> {
    let (metrics, shared) = (&state.metrics, &state.shared);
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
                let encode = |f| {
                    metrics.refresh_system();
                    if let Some(o) = shared.order() {
                        let left = o.count.saturating_sub(o.taken()).min(shared.live());
                        metrics
                            .close_pending
                            .set(i64::try_from(left).unwrap_or(i64::MAX));
                    }
                    metrics.encode(f)
                };
                let r = route(&req, health, state.token.as_deref(), &encode, &mut |a| {
                    act(state, a)
                });
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
            authorization: None,
        }
    }

    fn route(req: &Request, health: Health, m: &dyn Fn(Format) -> String) -> Response {
        super::route(req, health, Some("tok"), m, &mut |_| unreachable!())
    }

    #[test]
    fn orders_need_the_bearer_token() {
        let mut got = Vec::new();
        let mut call = |r: &Request, token: Option<&str>| {
            super::route(r, Health::Serving, token, &m, &mut |a| {
                got.push(a);
                "{}".into()
            })
        };
        let mut r = req("POST", "/shed?count=10&rate=2.5");
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Bearer nope".into());
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Basic tok".into());
        assert_eq!(call(&r, Some("tok")).status, 401);
        r.authorization = Some("Bearer tok".into());
        assert_eq!(call(&r, None).status, 401, "no token configured: refused");
        let ok = call(&r, Some("tok"));
        assert_eq!((ok.status, ok.body.as_str()), (202, "{}\n"));
        let mut d = req("POST", "/drain?rate=100");
        d.authorization = Some("bearer  tok ".into());
        assert_eq!(call(&d, Some("tok")).status, 202);
        d.target = "/drain".into();
        assert_eq!(call(&d, Some("tok")).status, 202);
        for bad in [
            "/shed",
            "/shed?count=-1",
            "/shed?count=5&rate=-1",
            "/drain?rate=x",
            "/shed?count=1&rate=inf",
        ] {
            d.target = bad.into();
            assert_eq!(call(&d, Some("tok")).status, 400, "{bad}");
        }
        d.method = "GET".into();
        let r405 = call(&d, Some("tok"));
        assert_eq!(
            (r405.status, r405.headers.clone()),
            (405, vec![("Allow", "POST")])
        );
        assert_eq!(
            got,
            [
                Action::Shed {
                    count: 10,
                    rate: 2.5
                },
                Action::Drain { rate: Some(100.0) },
                Action::Drain { rate: None },
            ]
        );
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
                authorization: None,
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
