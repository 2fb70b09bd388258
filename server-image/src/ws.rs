//! WebSocket (RFC 6455) as pure functions over byte slices: the HTTP/1.1
//! upgrade ([`handshake`]) and the frame processor ([`process`]) that echoes
//! data frames, answers pings, completes the close handshake and fails the
//! connection with the right status code on protocol errors.
//!
//! Nothing here does I/O or keeps a buffer: the caller (`conn`) feeds the
//! bytes it has, gets back how many were consumed and what to write. Bytes of
//! an incomplete frame stay with the caller until more arrive, so an idle
//! connection (no partial frame, no fragmented message in flight) holds
//! nothing. The parsers are fuzzed (`server-image/fuzz`).

use base64::Engine as _;
use sha1::{Digest, Sha1};

/// GUID appended to `Sec-WebSocket-Key` before hashing [RFC 6455 §1.3].
pub const ACCEPT_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Largest upgrade request head accepted, in bytes; larger is answered 431.
/// Browsers send 0.5–2 KiB; 8 KiB is the common server limit (nginx's
/// `large_client_header_buffers` default) [source: nginx docs].
pub const MAX_HANDSHAKE_BYTES: usize = 8 * 1024;

/// Headers parsed in an upgrade request; more is answered 431.
pub const MAX_HANDSHAKE_HEADERS: usize = 32;

/// Longest frame header, in bytes: 2, 8 for a 64-bit length, 4 for the
/// mask [RFC 6455 §5.2].
pub const MAX_HEADER_BYTES: usize = 14;

/// Largest payload of a control frame (ping, pong, close), in bytes
/// [RFC 6455 §5.5].
pub const MAX_CONTROL_PAYLOAD: usize = 125;

/// Default largest frame payload accepted, in bytes (`--max-frame-bytes`).
/// A frame is buffered until complete, so this bounds what one connection
/// can make the server hold: 64 KiB, the payload size most push and chat
/// protocols stay far below. Chosen, not measured.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 * 1024;

/// Close status codes the server sends [RFC 6455 §7.4.1].
pub mod code {
    /// Normal closure.
    pub const NORMAL: u16 = 1000;
    /// Going away: the server is draining or shedding connections.
    pub const GOING_AWAY: u16 = 1001;
    /// Protocol error.
    pub const PROTOCOL_ERROR: u16 = 1002;
    /// Invalid frame payload data (text that is not UTF-8).
    pub const INVALID_PAYLOAD: u16 = 1007;
    /// Policy violation: a frame did not complete within the frame
    /// timeout.
    pub const POLICY_VIOLATION: u16 = 1008;
    /// Message too big (a frame above `--max-frame-bytes`).
    pub const TOO_BIG: u16 = 1009;
    /// Internal error: here, a server ping went unanswered (the code
    /// Python's `websockets` sends for its keepalive timeout).
    pub const INTERNAL_ERROR: u16 = 1011;
    /// Try again later [IANA WebSocket close code registry, RFC 6455
    /// §11.7]: the worker's budget for unfinished frames is spent, a
    /// temporary condition that says nothing against the client's frame.
    pub const TRY_AGAIN_LATER: u16 = 1013;
}

/// Frame opcodes [RFC 6455 §5.2].
pub mod opcode {
    /// Continuation of a fragmented message.
    pub const CONTINUATION: u8 = 0x0;
    /// Text data frame.
    pub const TEXT: u8 = 0x1;
    /// Binary data frame.
    pub const BINARY: u8 = 0x2;
    /// Close control frame.
    pub const CLOSE: u8 = 0x8;
    /// Ping control frame.
    pub const PING: u8 = 0x9;
    /// Pong control frame.
    pub const PONG: u8 = 0xA;
}

/// What an upgrade request turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handshake {
    /// The request head is not complete yet.
    Partial,
    /// A valid upgrade: write `response` (101) and switch to frames; the
    /// request head was `consumed` bytes long (bytes after it are frames).
    Accept {
        /// The 101 response to write.
        response: Vec<u8>,
        /// Length of the request head.
        consumed: usize,
    },
    /// Not a valid upgrade: write `response` (4xx) and close.
    Reject {
        /// The error response to write.
        response: Vec<u8>,
    },
}

/// `Sec-WebSocket-Accept` for a `Sec-WebSocket-Key` [RFC 6455 §4.2.2]:
/// base64(SHA-1(key + GUID)).
pub fn accept_key(key: &[u8]) -> String {
    let mut h = Sha1::new();
    h.update(key);
    h.update(ACCEPT_GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// Whether the comma-separated list `value` holds `token` as one of its
/// elements, compared case-insensitively, with optional whitespace around
/// each element and empty elements ignored [RFC 9110 §5.6.1].
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Whether `b` is a `tchar`, a character of an HTTP token [RFC 7230 §3.2.6,
/// unchanged in RFC 9110 §5.6.2]: letters, digits and ``!#$%&'*+-.^_`|~``.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The WebSocket subprotocols the server accepts (`--subprotocols`): names
/// an upgrade's answer may choose from what the client offers
/// ([`handshake_with`]). Each is an HTTP token, as RFC 6455 §4.1 requires
/// of the values of `Sec-WebSocket-Protocol` ("characters in the range
/// U+0021 to U+007E not including separator characters"), and none is
/// named twice. Cheap to clone: the workers and the drain's accept window
/// share one list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subprotocols(std::sync::Arc<[Box<str>]>);

impl Subprotocols {
    /// Parses a comma-separated list (`chat, v2.example`): whitespace around
    /// names and empty elements are ignored, so an empty value means none.
    /// The error names the offending element.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut names: Vec<Box<str>> = Vec::new();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if !name.bytes().all(is_tchar) {
                return Err(format!(
                    "{name:?} is not an RFC 7230 token (letters, digits and \
                     !#$%&'*+-.^_`|~ only; no spaces, quotes, slashes or other separators)"
                ));
            }
            if names.iter().any(|n| **n == *name) {
                return Err(format!("{name:?} is named twice"));
            }
            names.push(name.into());
        }
        Ok(Subprotocols(names.into()))
    }

    /// The accepted names, in the order configured.
    pub fn names(&self) -> &[Box<str>] {
        &self.0
    }

    /// Whether no subprotocol is accepted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The first name in `offers` (the values of the request's
    /// `Sec-WebSocket-Protocol` field lines, in order; each a
    /// comma-separated list) that is accepted. Names compare exactly, as
    /// clients compare the answer with what they offered.
    fn choose<'a>(&self, offers: impl IntoIterator<Item = &'a [u8]>) -> Option<&'a [u8]> {
        if self.is_empty() {
            return None;
        }
        offers
            .into_iter()
            .flat_map(|v| v.split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .find(|o| self.0.iter().any(|n| n.as_bytes() == *o))
    }
}

impl std::fmt::Display for Subprotocols {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

/// Whether every element of the list `value` is `0` (a `Content-Length` of
/// zero, possibly repeated [RFC 9112 §6.3]).
fn all_zero(value: &[u8]) -> bool {
    value.split(|&b| b == b',').all(|t| t.trim_ascii() == b"0")
}

/// Whether `value` can be a `Host` field value: `uri-host [":" port]`
/// [RFC 9110 §7.2, RFC 3986 §3.2.2], non-empty (a WebSocket URI always has
/// an authority [RFC 6455 §3]). Checked by character set, not by grammar.
fn valid_host(value: &[u8]) -> bool {
    !value.is_empty()
        && value
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:[]%".contains(&b))
}

/// Whether `target` is a request-target a WebSocket upgrade may carry: the
/// origin form (`/path?query`) or the absolute form with an `http`/`https`
/// URI [RFC 6455 §4.2.1 item 1, RFC 9112 §3.2]; not `*` or an authority.
fn valid_target(target: &str) -> bool {
    let t = target.as_bytes();
    let scheme = |s: &[u8]| t.len() > s.len() && t[..s.len()].eq_ignore_ascii_case(s);
    t.first() == Some(&b'/') || scheme(b"http://") || scheme(b"https://")
}

fn reject(status: u16, reason: &str, extra: &str) -> Handshake {
    Handshake::Reject {
        response: format!(
            "HTTP/1.1 {status} {reason}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .into_bytes(),
    }
}

fn bad_request() -> Handshake {
    reject(400, "Bad Request", "")
}

fn too_large() -> Handshake {
    reject(431, "Request Header Fields Too Large", "")
}

/// The answer to a connection whose upgrade request cannot be buffered
/// because the worker's budget for unfinished input is spent: 503 with
/// `Retry-After`, then close.
pub const BUSY_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n\
Content-Length: 0\r\nConnection: close\r\n\r\n";

/// Parses an HTTP/1.1 upgrade request (with `httparse`) and answers it.
///
/// The rules are RFC 6455 §4.2.1 and the HTTP MUSTs it builds on:
///
/// - the method is `GET` and the version HTTP/1.1 or a later 1.x (processed
///   as 1.1 [RFC 9112 §2.3]); HTTP/1.0 is 400, another major version 505;
/// - the request-target is in origin or absolute (`http`/`https`) form;
/// - exactly one `Host` field line, with a valid non-empty value
///   [RFC 9112 §3.2: 400 for none or more than one];
/// - `Upgrade` includes `websocket` and `Connection` includes `Upgrade`, as
///   list elements, case-insensitive, with whitespace around commas; list
///   fields repeated over several lines are one comma-joined list
///   [RFC 9110 §5.3], so `Connection: keep-alive` plus `Connection: Upgrade`
///   is an upgrade;
/// - at most one `Sec-WebSocket-Key` and one `Sec-WebSocket-Version` line
///   [RFC 6455 §11.3.1, §11.3.5]: more is 400;
/// - `Sec-WebSocket-Version: 13`, else 426 naming 13 and, as every 426
///   must, the protocol to upgrade to [RFC 9110 §15.5.22];
/// - a `Sec-WebSocket-Key` that base64-decodes to 16 bytes;
/// - no request content: `Transfer-Encoding` or a non-zero
///   `Content-Length` is 400 (bytes after the head are frames).
///
/// Anything else that is not a well-formed head (bad syntax, whitespace
/// before a colon, obsolete line folding; `httparse` refuses those in
/// requests) is 400; a head over [`MAX_HANDSHAKE_BYTES`] or with more than
/// [`MAX_HANDSHAKE_HEADERS`] field lines is 431.
///
/// No subprotocol is accepted: the 101 never names one. See
/// [`handshake_with`].
pub fn handshake(buf: &[u8]) -> Handshake {
    handshake_with(buf, &Subprotocols::default())
}

/// [`handshake`], accepting the `subprotocols` configured: the 101 names
/// (`Sec-WebSocket-Protocol`) the first protocol the client offers that is
/// on the list, in the client's order (its field lines in order, each a
/// comma-separated list, RFC 9110 §5.3), and has no such field if none is
/// [RFC 6455 §4.2.2, item 5.4]. Offers never make a request invalid.
pub fn handshake_with(buf: &[u8], subprotocols: &Subprotocols) -> Handshake {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HANDSHAKE_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => answer(&req, n, subprotocols),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HANDSHAKE_BYTES => too_large(),
        Ok(httparse::Status::Partial) => Handshake::Partial,
        Err(httparse::Error::TooManyHeaders) => too_large(),
        Err(httparse::Error::Version) => later_version(buf, subprotocols),
        Err(_) => bad_request(),
    }
}

/// `httparse` knows HTTP/1.0 and 1.1 only. A request line ending in
/// `HTTP/1.x` with a later minor version is processed as HTTP/1.1
/// [RFC 9112 §2.3]; another well-formed version is 505; anything else 400.
fn later_version(buf: &[u8], subprotocols: &Subprotocols) -> Handshake {
    // Empty lines before the request line are skipped [RFC 9112 §2.2].
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    let Some(end) = buf[start..].iter().position(|&b| b == b'\n') else {
        return if buf.len() >= MAX_HANDSHAKE_BYTES {
            too_large()
        } else {
            Handshake::Partial
        };
    };
    let line = &buf[start..start + end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(sp) = line.iter().rposition(|&b| b == b' ') else {
        return bad_request();
    };
    match line[sp + 1..] {
        [b'H', b'T', b'T', b'P', b'/', b'1', b'.', b'2'..=b'9'] => {
            // Parse a copy that says 1.1: the head keeps its length, so
            // `consumed` holds for `buf` too. (1.0 and 1.1 get here only
            // if `httparse` objected to something else: 400 below.)
            let mut copy = buf[..buf.len().min(MAX_HANDSHAKE_BYTES)].to_vec();
            copy[start + sp + 8] = b'1';
            handshake_with(&copy, subprotocols)
        }
        [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
            if major != b'1' && major.is_ascii_digit() && minor.is_ascii_digit() =>
        {
            reject(505, "HTTP Version Not Supported", "")
        }
        _ => bad_request(),
    }
}

/// Checks a complete request head against the rules of [`handshake`].
fn answer(
    req: &httparse::Request<'_, '_>,
    consumed: usize,
    subprotocols: &Subprotocols,
) -> Handshake {
    if consumed > MAX_HANDSHAKE_BYTES {
        return too_large();
    }
    if req.method != Some("GET") || req.version != Some(1) || !req.path.is_some_and(valid_target) {
        return bad_request();
    }
    let (mut hosts, mut host) = (0, &b""[..]);
    let (mut keys, mut key) = (0, None);
    let (mut versions, mut version) = (0, None);
    let (mut upgrade, mut connection) = (false, false);
    for h in req.headers.iter() {
        let name = |n: &str| h.name.eq_ignore_ascii_case(n);
        let value = h.value.trim_ascii();
        if name("host") {
            hosts += 1;
            host = value;
        } else if name("sec-websocket-key") {
            keys += 1;
            key = Some(value);
        } else if name("sec-websocket-version") {
            versions += 1;
            version = Some(value);
        } else if name("upgrade") {
            upgrade |= has_token(value, "websocket");
        } else if name("connection") {
            connection |= has_token(value, "upgrade");
        } else if name("transfer-encoding") || (name("content-length") && !all_zero(value)) {
            return bad_request();
        }
    }
    if hosts != 1 || !valid_host(host) || keys > 1 || versions > 1 {
        return bad_request();
    }
    if !upgrade || !connection {
        return bad_request();
    }
    if version != Some(b"13") {
        return Handshake::Reject {
            response: b"HTTP/1.1 426 Upgrade Required\r\nSec-WebSocket-Version: 13\r\n\
Upgrade: websocket\r\nContent-Length: 0\r\nConnection: Upgrade, close\r\n\r\n"
                .to_vec(),
        };
    }
    let Some(key) = key else {
        return bad_request();
    };
    let decoded = base64::engine::general_purpose::STANDARD.decode(key);
    if decoded.map(|k| k.len()) != Ok(16) {
        return bad_request();
    }
    let offers = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("sec-websocket-protocol"))
        .map(|h| h.value);
    // A chosen name is one of the configured tokens, so plain ASCII.
    let protocol = subprotocols
        .choose(offers)
        .map(|p| format!("Sec-WebSocket-Protocol: {}\r\n", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {}\r\n{protocol}\r\n",
        accept_key(key)
    )
    .into_bytes();
    Handshake::Accept { response, consumed }
}

/// A frame header as read off the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// FIN bit: last frame of a message.
    pub fin: bool,
    /// RSV1–3 bits (must be 0: no extension is negotiated).
    pub rsv: u8,
    /// Opcode (see [`opcode`]).
    pub opcode: u8,
    /// Masking key, if the MASK bit is set.
    pub mask: Option<[u8; 4]>,
    /// Payload length, in bytes.
    pub len: u64,
    /// Header length, in bytes (2 to 14).
    pub header_len: usize,
}

/// Parses a frame header [RFC 6455 §5.2]. `None` if `buf` does not hold all
/// of it yet. Lengths are taken as sent (including non-minimal encodings,
/// which RFC 6455 forbids but no client depends on the server rejecting); a
/// 64-bit length with the top bit set is a protocol error.
pub fn parse_header(buf: &[u8]) -> Result<Option<Header>, u16> {
    let [b0, b1, ..] = *buf else {
        return Ok(None);
    };
    let masked = b1 & 0x80 != 0;
    let (len, mut n) = match b1 & 0x7f {
        126 => match buf.get(2..4) {
            Some(b) => (u64::from(u16::from_be_bytes([b[0], b[1]])), 4),
            None => return Ok(None),
        },
        127 => match buf.get(2..10) {
            Some(b) => {
                let l = u64::from_be_bytes(b.try_into().expect("8 bytes"));
                if l >> 63 != 0 {
                    return Err(code::PROTOCOL_ERROR);
                }
                (l, 10)
            }
            None => return Ok(None),
        },
        l => (u64::from(l), 2),
    };
    let mask = if masked {
        match buf.get(n..n + 4) {
            Some(m) => {
                n += 4;
                Some(m.try_into().expect("4 bytes"))
            }
            None => return Ok(None),
        }
    } else {
        None
    };
    Ok(Some(Header {
        fin: b0 & 0x80 != 0,
        rsv: (b0 >> 4) & 0x7,
        opcode: b0 & 0x0f,
        mask,
        len,
        header_len: n,
    }))
}

/// Appends a server frame header (unmasked) for a payload of `len` bytes.
pub fn write_header(out: &mut Vec<u8>, fin: bool, op: u8, len: usize) {
    out.push(if fin { 0x80 } else { 0 } | op);
    if len < 126 {
        out.push(len as u8);
    } else if let Ok(l) = u16::try_from(len) {
        out.push(126);
        out.extend_from_slice(&l.to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

/// Appends a close frame with `status` and no reason text.
pub fn write_close(out: &mut Vec<u8>, status: u16) {
    write_header(out, true, opcode::CLOSE, 2);
    out.extend_from_slice(&status.to_be_bytes());
}

/// Appends `payload` unmasked with `mask` (XOR with the key, cycling).
fn unmask_into(out: &mut Vec<u8>, payload: &[u8], mask: [u8; 4]) {
    let start = out.len();
    out.extend_from_slice(payload);
    for (i, b) in out[start..].iter_mut().enumerate() {
        *b ^= mask[i & 3];
    }
}

/// A close status a peer may send [RFC 6455 §7.4]: 1000–1003, 1007–1011,
/// and 3000–4999 (registered and private); 1004–1006, 1015 and the rest are
/// reserved.
pub fn valid_close_code(c: u16) -> bool {
    matches!(c, 1000..=1003 | 1007..=1011 | 3000..=4999)
}

/// State that outlives one frame: the fragmented message in flight, if any.
/// Six bytes; `conn` keeps it only while a message is in flight.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// A fragmented message is open (its first frame had FIN clear).
    pub open: bool,
    /// The open message is text (validate UTF-8 across its fragments).
    pub text: bool,
    /// Up to 3 bytes of a UTF-8 sequence split across fragments.
    pub carry: [u8; 3],
    /// How many of `carry` are in use.
    pub carry_len: u8,
}

impl Message {
    /// Whether nothing is in flight (the connection may hold no state).
    pub fn is_idle(&self) -> bool {
        !self.open
    }
}

/// Validates `data` as the next piece of a UTF-8 text, carrying an incomplete
/// trailing sequence in `msg`. At the end of the message (`fin`) nothing may
/// remain incomplete. Returns whether the text is still valid.
fn utf8_step(msg: &mut Message, data: &[u8], fin: bool) -> bool {
    let mut rest = data;
    if msg.carry_len > 0 {
        // Complete the carried sequence with up to 3 more bytes.
        let mut tmp = [0u8; 7];
        let c = usize::from(msg.carry_len);
        tmp[..c].copy_from_slice(&msg.carry[..c]);
        let take = rest.len().min(4 - c);
        tmp[c..c + take].copy_from_slice(&rest[..take]);
        match std::str::from_utf8(&tmp[..c + take]) {
            Ok(_) => {
                msg.carry_len = 0;
                rest = &rest[take..];
            }
            Err(e) if e.error_len().is_some() && e.valid_up_to() == 0 => return false,
            Err(e) if e.valid_up_to() == 0 => {
                // Still incomplete: all of data went into the carry.
                msg.carry[..c + take].copy_from_slice(&tmp[..c + take]);
                msg.carry_len = (c + take) as u8;
                return !fin;
            }
            Err(e) => {
                // The carried sequence completed; continue after it.
                let used = e.valid_up_to() - c;
                msg.carry_len = 0;
                rest = &rest[used..];
            }
        }
    }
    match std::str::from_utf8(rest) {
        Ok(_) => true,
        Err(e) if e.error_len().is_some() => false,
        Err(e) => {
            let tail = &rest[e.valid_up_to()..];
            msg.carry[..tail.len()].copy_from_slice(tail);
            msg.carry_len = tail.len() as u8;
            !fin
        }
    }
}

/// What [`process`] decided about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Keep going; wait for more bytes.
    Continue,
    /// The peer closed (close frame received and answered in `out`): write
    /// `out`, then close the connection.
    Closed,
    /// Fail the connection with this close status (already appended to
    /// `out`): write `out`, then close.
    Fail(u16),
}

/// Processes as many complete frames of `input` as there are, appending the
/// server's replies to `out`: data frames are echoed unmasked with the same
/// opcode and FIN bit (so fragmentation is preserved), pings are answered
/// with pongs carrying the same payload, pongs are ignored, a close is
/// answered with a close carrying the same status code.
///
/// Enforced [RFC 6455 §5]: client frames are masked; RSV bits are 0; control
/// frames are final and at most 125 bytes; opcodes are known; continuation
/// frames only inside a fragmented message and data frames only outside one;
/// text is UTF-8 (checked across fragments); close codes are valid and close
/// reasons UTF-8; payloads are at most `max_frame` bytes (else 1009).
///
/// Returns the bytes consumed (the start of an incomplete frame is left for
/// the caller to keep) and the outcome. After `Closed` or `Fail`, the rest of
/// `input` is ignored.
pub fn process(
    input: &[u8],
    msg: &mut Message,
    out: &mut Vec<u8>,
    max_frame: usize,
) -> (usize, Outcome) {
    let mut pos = 0;
    let fail = |out: &mut Vec<u8>, c: u16| {
        write_close(out, c);
        Outcome::Fail(c)
    };
    loop {
        let buf = &input[pos..];
        let h = match parse_header(buf) {
            Ok(Some(h)) => h,
            Ok(None) => return (pos, Outcome::Continue),
            Err(c) => return (input.len(), fail(out, c)),
        };
        let control = h.opcode & 0x8 != 0;
        let Some(mask) = h.mask else {
            return (input.len(), fail(out, code::PROTOCOL_ERROR));
        };
        if h.rsv != 0 {
            return (input.len(), fail(out, code::PROTOCOL_ERROR));
        }
        if control && (!h.fin || h.len > MAX_CONTROL_PAYLOAD as u64) {
            return (input.len(), fail(out, code::PROTOCOL_ERROR));
        }
        if h.len > max_frame as u64 {
            return (input.len(), fail(out, code::TOO_BIG));
        }
        let len = h.len as usize;
        if buf.len() < h.header_len + len {
            return (pos, Outcome::Continue);
        }
        let payload = &buf[h.header_len..h.header_len + len];
        pos += h.header_len + len;
        match h.opcode {
            opcode::TEXT | opcode::BINARY | opcode::CONTINUATION => {
                let continuation = h.opcode == opcode::CONTINUATION;
                if continuation != msg.open {
                    return (input.len(), fail(out, code::PROTOCOL_ERROR));
                }
                let text = if continuation {
                    msg.text
                } else {
                    h.opcode == opcode::TEXT
                };
                let start = out.len();
                write_header(out, h.fin, h.opcode, len);
                let body = out.len();
                unmask_into(out, payload, mask);
                if text {
                    msg.text = true;
                    if !utf8_step(msg, &out[body..], h.fin) {
                        out.truncate(start);
                        return (input.len(), fail(out, code::INVALID_PAYLOAD));
                    }
                }
                if h.fin {
                    *msg = Message::default();
                } else {
                    msg.open = true;
                    msg.text = text;
                }
            }
            opcode::PING => {
                write_header(out, true, opcode::PONG, len);
                unmask_into(out, payload, mask);
            }
            opcode::PONG => {}
            opcode::CLOSE => {
                let mut body = Vec::with_capacity(len);
                unmask_into(&mut body, payload, mask);
                return match body.len() {
                    0 => {
                        write_header(out, true, opcode::CLOSE, 0);
                        (input.len(), Outcome::Closed)
                    }
                    1 => (input.len(), fail(out, code::PROTOCOL_ERROR)),
                    _ => {
                        let c = u16::from_be_bytes([body[0], body[1]]);
                        if !valid_close_code(c) {
                            (input.len(), fail(out, code::PROTOCOL_ERROR))
                        } else if std::str::from_utf8(&body[2..]).is_err() {
                            (input.len(), fail(out, code::INVALID_PAYLOAD))
                        } else {
                            write_close(out, c);
                            (input.len(), Outcome::Closed)
                        }
                    }
                };
            }
            _ => return (input.len(), fail(out, code::PROTOCOL_ERROR)),
        }
    }
}

/// Builds a masked client frame (what a client sends); for tests, fuzz seeds
/// and the load generator.
pub fn client_frame(fin: bool, op: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    write_header(&mut out, fin, op, payload.len());
    out[1] |= 0x80;
    out.extend_from_slice(&mask);
    unmask_into(&mut out, payload, mask);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: [u8; 4] = [0x37, 0xfa, 0x21, 0x3d];

    fn run(input: &[u8]) -> (usize, Outcome, Vec<u8>, Message) {
        let mut msg = Message::default();
        let mut out = Vec::new();
        let (n, o) = process(input, &mut msg, &mut out, DEFAULT_MAX_FRAME_BYTES);
        (n, o, out, msg)
    }

    fn server_frame(fin: bool, op: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        write_header(&mut v, fin, op, payload.len());
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn accept_key_matches_rfc_example() {
        // RFC 6455 §1.3.
        assert_eq!(
            accept_key(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    const REQ: &[u8] = b"GET /chat HTTP/1.1\r\nHost: server.example.com\r\nUpgrade: websocket\r\n\
Connection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
Sec-WebSocket-Version: 13\r\n\r\n";

    #[test]
    fn handshake_accepts_a_valid_upgrade() {
        let mut with_frame = REQ.to_vec();
        with_frame.extend_from_slice(b"\x81");
        match handshake(&with_frame) {
            Handshake::Accept { response, consumed } => {
                assert_eq!(consumed, REQ.len());
                let r = String::from_utf8(response).unwrap();
                assert!(r.starts_with("HTTP/1.1 101 Switching Protocols\r\n"), "{r}");
                assert!(r.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"));
                assert!(r.ends_with("\r\n\r\n"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(handshake(&REQ[..REQ.len() - 2]), Handshake::Partial);
    }

    fn status(h: Handshake) -> u16 {
        match h {
            Handshake::Reject { response } => std::str::from_utf8(&response[9..12])
                .unwrap()
                .parse()
                .unwrap(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn handshake_rejects_bad_requests() {
        let s = |from: &str, to: &str| {
            String::from_utf8(REQ.to_vec())
                .unwrap()
                .replace(from, to)
                .into_bytes()
        };
        assert_eq!(status(handshake(&s("GET", "POST"))), 400);
        assert_eq!(status(handshake(&s("HTTP/1.1", "HTTP/1.0"))), 400);
        assert_eq!(
            status(handshake(&s("Upgrade: websocket", "Upgrade: h2c"))),
            400
        );
        assert_eq!(status(handshake(&s("keep-alive, Upgrade", "close"))), 400);
        assert_eq!(status(handshake(&s("Version: 13", "Version: 8"))), 426);
        assert_eq!(
            status(handshake(&s("dGhlIHNhbXBsZSBub25jZQ==", "c2hvcnQ="))),
            400
        );
        assert_eq!(status(handshake(&s("Sec-WebSocket-Key", "X-Key"))), 400);
        assert_eq!(status(handshake(b"\x16\x03\x01garbage\r\n\r\n")), 400);
        assert_eq!(status(handshake(&[b'A'; MAX_HANDSHAKE_BYTES])), 431);
        // 426 names the version the server speaks.
        if let Handshake::Reject { response } = handshake(&s("Version: 13", "Version: 8")) {
            assert!(
                String::from_utf8(response)
                    .unwrap()
                    .contains("Sec-WebSocket-Version: 13")
            );
        }
    }

    /// A request from a request line and field lines (CRLF added).
    fn request(line: &str, fields: &[&str]) -> Vec<u8> {
        let mut r = format!("{line}\r\n");
        for f in fields {
            r.push_str(f);
            r.push_str("\r\n");
        }
        r.push_str("\r\n");
        r.into_bytes()
    }

    /// The fields of a valid upgrade, in order.
    const FIELDS: [&str; 5] = [
        "Host: server.example.com",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ];

    /// [`FIELDS`] with the field lines named by `drop` (prefixes) left out
    /// and `add` appended.
    fn fields_with<'a>(drop: &[&str], add: &[&'a str]) -> Vec<&'a str> {
        FIELDS
            .iter()
            .copied()
            .filter(|f| !drop.iter().any(|d| f.starts_with(d)))
            .chain(add.iter().copied())
            .collect()
    }

    fn answer_to(fields: &[&str]) -> u16 {
        match handshake(&request("GET /chat HTTP/1.1", fields)) {
            Handshake::Accept { .. } => 101,
            h => status(h),
        }
    }

    #[test]
    fn list_fields_split_over_lines_are_one_list() {
        // RFC 9110 §5.3: field lines of one list field, combined in order
        // with commas, mean the same as one line. Fault 6 of issue 10.
        for (drop, add) in [
            (
                "Connection",
                &["Connection: keep-alive", "Connection: Upgrade"][..],
            ),
            (
                "Connection",
                &["Connection: Upgrade", "Connection: keep-alive"],
            ),
            ("Upgrade:", &["Upgrade: h2c", "Upgrade: websocket"]),
            ("Upgrade:", &["Upgrade: websocket", "Upgrade: h2c"]),
            (
                "Connection",
                &["Connection: keep-alive", "Connection: , UPGRADE ,"],
            ),
            ("Upgrade:", &["Upgrade: h2c", "Upgrade: foo/2,WebSocket"]),
        ] {
            assert_eq!(answer_to(&fields_with(&[drop], add)), 101, "{add:?}");
        }
        // Both split at once, in any case, with whitespace around commas.
        let f = fields_with(
            &["Upgrade:", "Connection"],
            &[
                "upgrade: h2c ,  websocket ",
                "CONNECTION: keep-alive",
                "connection:\tTE , upgrade",
            ],
        );
        assert_eq!(answer_to(&f), 101);
    }

    #[test]
    fn list_tokens_match_whole_elements_only() {
        for (drop, add) in [
            ("Connection", "Connection: Upgraded"),
            ("Connection", "Connection: keep-alive upgrade"),
            ("Connection", "Connection: \"Upgrade\""),
            ("Upgrade:", "Upgrade: websockets"),
            ("Upgrade:", "Upgrade: websocket/13"),
            ("Upgrade:", "Upgrade: h2c"),
            ("Upgrade:", "X-Upgrade: websocket"),
        ] {
            assert_eq!(answer_to(&fields_with(&[drop], &[add])), 400, "{add}");
        }
        assert_eq!(answer_to(&fields_with(&["Connection"], &[])), 400);
        assert_eq!(answer_to(&fields_with(&["Upgrade:"], &[])), 400);
    }

    #[test]
    fn exactly_one_host() {
        // RFC 9112 §3.2: 400 for none, more than one, or an invalid value.
        assert_eq!(answer_to(&fields_with(&["Host"], &[])), 400);
        for host in [
            "Host: server.example.com",
            "Host: other.example.com",
            "host: server.example.com",
        ] {
            assert_eq!(answer_to(&fields_with(&[], &[host])), 400, "{host}");
        }
        for bad in ["Host:", "Host: a b", "Host: a/b", "Host: a\"b", "Host: a@b"] {
            assert_eq!(answer_to(&fields_with(&["Host"], &[bad])), 400, "{bad}");
        }
        for good in [
            "Host: 127.0.0.1:7000",
            "Host: [::1]:7000",
            "HOST: Example.COM",
            "Host: xn--bcher-kva.example",
        ] {
            assert_eq!(answer_to(&fields_with(&["Host"], &[good])), 101, "{good}");
        }
    }

    #[test]
    fn exactly_one_key_of_16_bytes() {
        assert_eq!(answer_to(&fields_with(&["Sec-WebSocket-Key"], &[])), 400);
        // RFC 6455 §11.3.1: the key MUST NOT appear more than once, even
        // with the same value.
        let twice = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==";
        assert_eq!(answer_to(&fields_with(&[], &[twice])), 400);
        let other = "sec-websocket-key: AAAAAAAAAAAAAAAAAAAAAA==";
        assert_eq!(answer_to(&fields_with(&[], &[other])), 400);
        for bad in [
            "Sec-WebSocket-Key: c2hvcnQ=",                    // 5 bytes
            "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAAA=",    // 17 bytes
            "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA",      // unpadded
            "Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAB==",    // trailing bits
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==, x", // a list
            "Sec-WebSocket-Key: !!!!!!!!!!!!!!!!!!!!!!==",    // not base64
            "Sec-WebSocket-Key:",
        ] {
            let f = fields_with(&["Sec-WebSocket-Key"], &[bad]);
            assert_eq!(answer_to(&f), 400, "{bad}");
        }
        let spaced = "Sec-WebSocket-Key:   AAAAAAAAAAAAAAAAAAAAAA==  ";
        assert_eq!(
            answer_to(&fields_with(&["Sec-WebSocket-Key"], &[spaced])),
            101
        );
    }

    #[test]
    fn version_13_else_426_naming_it() {
        for v in [
            None,
            Some("Sec-WebSocket-Version: 8"),
            Some("Sec-WebSocket-Version: 13, 8"),
            Some("Sec-WebSocket-Version: 013"),
            Some("Sec-WebSocket-Version:"),
        ] {
            let f = fields_with(&["Sec-WebSocket-Version"], v.as_slice());
            let h = handshake(&request("GET /chat HTTP/1.1", &f));
            let Handshake::Reject { response } = h else {
                panic!("{v:?}: {h:?}");
            };
            let r = String::from_utf8(response).unwrap();
            assert!(
                r.starts_with("HTTP/1.1 426 Upgrade Required\r\n"),
                "{v:?}: {r}"
            );
            assert!(r.contains("\r\nSec-WebSocket-Version: 13\r\n"), "{r}");
            // RFC 9110 §15.5.22 and §7.8: a 426 names the protocol in
            // Upgrade, which Connection then lists.
            assert!(r.contains("\r\nUpgrade: websocket\r\n"), "{r}");
            assert!(r.contains("\r\nConnection: Upgrade, close\r\n"), "{r}");
        }
        // RFC 6455 §11.3.5: the version MUST NOT appear more than once.
        let twice = fields_with(&[], &["Sec-WebSocket-Version: 13"]);
        assert_eq!(answer_to(&twice), 400);
        let spaced = fields_with(&["Sec-WebSocket-Version"], &["sec-websocket-version:  13 "]);
        assert_eq!(answer_to(&spaced), 101);
    }

    #[test]
    fn get_over_http_1_1_or_later_only() {
        let at = |line: &str| match handshake(&request(line, &FIELDS)) {
            Handshake::Accept { .. } => 101,
            h => status(h),
        };
        assert_eq!(at("GET /chat HTTP/1.1"), 101);
        // RFC 9112 §2.3: a later minor version is processed as 1.1.
        assert_eq!(at("GET /chat HTTP/1.2"), 101);
        assert_eq!(at("GET /chat HTTP/1.9"), 101);
        assert_eq!(at("GET /chat HTTP/1.0"), 400);
        assert_eq!(at("GET /chat HTTP/2.0"), 505);
        assert_eq!(at("GET /chat HTTP/3.0"), 505);
        assert_eq!(at("GET /chat HTTP/1.10"), 400);
        assert_eq!(at("GET /chat HTTP/1.x"), 400);
        assert_eq!(at("GET /chat HTTP/1.5 HTTP/1.2"), 400);
        assert_eq!(at("GET /chat http/1.1"), 400);
        assert_eq!(at("GET /chat"), 400);
        for method in ["POST", "HEAD", "PUT", "get", "CONNECT"] {
            assert_eq!(at(&format!("{method} /chat HTTP/1.1")), 400, "{method}");
        }
        // Origin or absolute form only.
        assert_eq!(at("GET http://server.example.com/chat HTTP/1.1"), 101);
        assert_eq!(at("GET HTTPS://server.example.com/ HTTP/1.1"), 101);
        for target in ["*", "server.example.com:80", "chat", "ws://x/"] {
            assert_eq!(at(&format!("GET {target} HTTP/1.1")), 400, "{target}");
        }
        // A later minor version: `consumed` is the head of the original.
        let mut with_frame = request("GET /chat HTTP/1.4", &FIELDS);
        let head = with_frame.len();
        with_frame.extend_from_slice(b"\x81\x80");
        assert!(
            matches!(handshake(&with_frame), Handshake::Accept { consumed, .. } if consumed == head)
        );
        let partial = request("GET /chat HTTP/1.4", &FIELDS);
        assert_eq!(handshake(&partial[..partial.len() - 2]), Handshake::Partial);
        assert_eq!(handshake(b"GET /chat HTTP/1.4"), Handshake::Partial);
    }

    #[test]
    fn no_request_content() {
        for bad in [
            "Transfer-Encoding: chunked",
            "transfer-encoding: identity",
            "Content-Length: 5",
            "Content-Length: 0, 5",
        ] {
            assert_eq!(answer_to(&fields_with(&[], &[bad])), 400, "{bad}");
        }
        assert_eq!(answer_to(&fields_with(&[], &["Content-Length: 0"])), 101);
        assert_eq!(answer_to(&fields_with(&[], &["Content-Length: 0, 0"])), 101);
    }

    #[test]
    fn malformed_field_lines_are_400() {
        // RFC 9112 §5.1: whitespace between name and colon MUST be 400;
        // §5.2: obsolete line folding is 400 (or unfolded) in a request.
        let space = request(
            "GET /chat HTTP/1.1",
            &fields_with(&["Host"], &["Host : server.example.com"]),
        );
        assert_eq!(status(handshake(&space)), 400);
        let folded = request(
            "GET /chat HTTP/1.1",
            &fields_with(&["Connection"], &["Connection: keep-alive,", " Upgrade"]),
        );
        assert_eq!(status(handshake(&folded)), 400);
        let no_colon = request("GET /chat HTTP/1.1", &fields_with(&[], &["X-Junk"]));
        assert_eq!(status(handshake(&no_colon)), 400);
        // Other fields (Origin, protocols, extensions) are allowed and
        // ignored, repeated or not; empty lines before the request line are
        // skipped (RFC 9112 §2.2).
        let f = fields_with(
            &[],
            &[
                "Origin: http://example.com",
                "Sec-WebSocket-Protocol: chat",
                "Sec-WebSocket-Protocol: superchat",
                "Sec-WebSocket-Extensions: permessage-deflate",
            ],
        );
        assert_eq!(answer_to(&f), 101);
        let mut lead = b"\r\n".to_vec();
        lead.extend(request("GET /chat HTTP/1.1", &FIELDS));
        assert!(
            matches!(handshake(&lead), Handshake::Accept { consumed, .. } if consumed == lead.len())
        );
    }

    /// The subprotocol a 101 names, if any (`None` for a refusal).
    fn chosen(fields: &[&str], accepted: &str) -> Option<Option<String>> {
        let accepted = Subprotocols::parse(accepted).unwrap();
        let req = request("GET /chat HTTP/1.1", &fields_with(&[], fields));
        let Handshake::Accept { response, .. } = handshake_with(&req, &accepted) else {
            return None;
        };
        let r = String::from_utf8(response).unwrap();
        let names: Vec<String> = r
            .lines()
            .filter_map(|l| l.strip_prefix("Sec-WebSocket-Protocol: "))
            .map(String::from)
            .collect();
        assert!(names.len() <= 1, "{r}");
        assert!(
            r.ends_with("\r\n\r\n") && !r.ends_with("\r\n\r\n\r\n"),
            "{r}"
        );
        Some(names.into_iter().next())
    }

    #[test]
    fn subprotocol_is_the_first_accepted_offer_in_client_order() {
        // Issue 21, item 15. RFC 6455 §4.2.2: one of the offered values, or
        // no field at all.
        let some = |s: &str| Some(Some(s.to_string()));
        let list = "chat,v2.example";
        assert_eq!(
            chosen(&["Sec-WebSocket-Protocol: v2.example, chat"], list),
            some("v2.example")
        );
        assert_eq!(
            chosen(&["Sec-WebSocket-Protocol: chat, v2.example"], list),
            some("chat")
        );
        assert_eq!(
            chosen(&["Sec-WebSocket-Protocol: mqtt,chat"], list),
            some("chat")
        );
        // Several field lines are one list, in order (RFC 9110 §5.3);
        // whitespace and empty elements are ignored.
        assert_eq!(
            chosen(
                &[
                    "Sec-WebSocket-Protocol: mqtt",
                    "sec-websocket-protocol: ,  v2.example\t, chat",
                    "Sec-WebSocket-Protocol: chat",
                ],
                list
            ),
            some("v2.example")
        );
        // No match, exact comparison, nothing offered, nothing accepted:
        // still an upgrade, without the field.
        for (fields, accepted) in [
            (&["Sec-WebSocket-Protocol: mqtt, Chat, CHAT, v2"][..], list),
            (&["Sec-WebSocket-Protocol: chat;v=2, \"chat\""], list),
            (&["Sec-WebSocket-Protocol:"], list),
            (&[], list),
            (&["Sec-WebSocket-Protocol: chat"], ""),
        ] {
            assert_eq!(
                chosen(fields, accepted),
                Some(None),
                "{fields:?} {accepted:?}"
            );
        }
        // Offers never make a request invalid.
        assert_eq!(
            chosen(&["Sec-WebSocket-Protocol: a b, /, \u{e9}"], list),
            Some(None)
        );
        // HTTP/1.x later minor versions negotiate too.
        let req = request(
            "GET /chat HTTP/1.3",
            &fields_with(&[], &["Sec-WebSocket-Protocol: chat"]),
        );
        let Handshake::Accept { response, .. } =
            handshake_with(&req, &Subprotocols::parse(list).unwrap())
        else {
            panic!()
        };
        assert!(
            String::from_utf8(response)
                .unwrap()
                .contains("\r\nSec-WebSocket-Protocol: chat\r\n")
        );
    }

    #[test]
    fn configured_subprotocols_are_unique_tokens() {
        let names = |l: &str| {
            Subprotocols::parse(l)
                .map(|s| s.names().iter().map(|n| n.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(names("").unwrap(), Vec::<String>::new());
        assert_eq!(names(" , ").unwrap(), Vec::<String>::new());
        assert_eq!(names("chat").unwrap(), ["chat"]);
        assert_eq!(
            names(" chat , v2.example,,mqtt ").unwrap(),
            ["chat", "v2.example", "mqtt"]
        );
        assert_eq!(names("a!#$%&'*+-.^_`|~9Z").unwrap(), ["a!#$%&'*+-.^_`|~9Z"]);
        assert_eq!(
            Subprotocols::parse("chat, v2").unwrap().to_string(),
            "chat,v2"
        );
        for (bad, says) in [
            ("chat,bad token", "\"bad token\""),
            ("a/b", "\"a/b\""),
            ("\"chat\"", "token"),
            ("chat;v=2", "token"),
            ("caf\u{e9}", "token"),
            ("chat,x,chat", "twice"),
            ("(x)", "token"),
            ("a\tb", "token"),
        ] {
            let e = Subprotocols::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn too_many_or_too_long_field_lines_are_431() {
        let many: Vec<String> = (0..MAX_HANDSHAKE_HEADERS)
            .map(|i| format!("X-{i}: y"))
            .collect();
        let many: Vec<&str> = FIELDS
            .iter()
            .copied()
            .chain(many.iter().map(String::as_str))
            .collect();
        assert_eq!(answer_to(&many), 431);
        let long = format!("X-Long: {}", "y".repeat(MAX_HANDSHAKE_BYTES));
        assert_eq!(answer_to(&fields_with(&[], &[long.as_str()])), 431);
    }

    #[test]
    fn parses_header_lengths() {
        assert_eq!(parse_header(b"\x81"), Ok(None));
        let h = parse_header(&[0x81, 0x85, 1, 2, 3, 4]).unwrap().unwrap();
        assert_eq!((h.fin, h.opcode, h.len, h.header_len), (true, 1, 5, 6));
        assert_eq!(h.mask, Some([1, 2, 3, 4]));
        let h = parse_header(&[0x02, 126, 0x01, 0x00]).unwrap().unwrap();
        assert_eq!((h.fin, h.len, h.header_len, h.mask), (false, 256, 4, None));
        let mut b = vec![0x82, 127];
        b.extend_from_slice(&70_000u64.to_be_bytes());
        assert_eq!(parse_header(&b).unwrap().unwrap().len, 70_000);
        assert_eq!(parse_header(&b[..9]), Ok(None));
        b[2] = 0x80;
        assert_eq!(parse_header(&b), Err(code::PROTOCOL_ERROR));
        // The server's own headers round-trip.
        for len in [0, 125, 126, 65_535, 65_536] {
            let mut v = Vec::new();
            write_header(&mut v, true, opcode::BINARY, len);
            let h = parse_header(&v).unwrap().unwrap();
            assert_eq!((h.len, h.header_len), (len as u64, v.len()));
        }
    }

    #[test]
    fn echoes_text_and_binary_unmasked() {
        let mut input = client_frame(true, opcode::TEXT, b"Hello", M);
        input.extend(client_frame(true, opcode::BINARY, &[0, 1, 2, 255], M));
        let (n, o, out, msg) = run(&input);
        assert_eq!((n, o), (input.len(), Outcome::Continue));
        let mut want = server_frame(true, opcode::TEXT, b"Hello");
        want.extend(server_frame(true, opcode::BINARY, &[0, 1, 2, 255]));
        assert_eq!(out, want);
        assert!(msg.is_idle());
    }

    #[test]
    fn rfc_masked_hello_example() {
        // RFC 6455 §5.7: a single-frame masked text message "Hello".
        let input = [
            0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        let (_, _, out, _) = run(&input);
        assert_eq!(out, [0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f]);
    }

    #[test]
    fn incomplete_frames_are_left_for_later() {
        let f = client_frame(true, opcode::BINARY, &[7u8; 300], M);
        for cut in [1, 2, 3, 7, 8, 100, f.len() - 1] {
            let (n, o, out, _) = run(&f[..cut]);
            assert_eq!((n, o, out.len()), (0, Outcome::Continue, 0), "cut {cut}");
        }
        let mut two = client_frame(true, opcode::TEXT, b"a", M);
        let first = two.len();
        two.extend_from_slice(&f[..10]);
        let (n, _, out, _) = run(&two);
        assert_eq!(n, first);
        assert_eq!(out, server_frame(true, opcode::TEXT, b"a"));
    }

    #[test]
    fn fragmented_text_is_echoed_per_fragment_with_interleaved_ping() {
        // "€" (e2 82 ac) split across fragments, a ping in the middle.
        let mut input = client_frame(false, opcode::TEXT, b"ab\xe2", M);
        input.extend(client_frame(true, opcode::PING, b"p", M));
        input.extend(client_frame(false, opcode::CONTINUATION, b"\x82", M));
        let (n, o, out, msg) = run(&input);
        assert_eq!((n, o), (input.len(), Outcome::Continue));
        assert!(msg.open && msg.text && msg.carry_len == 2);
        let mut want = server_frame(false, opcode::TEXT, b"ab\xe2");
        want.extend(server_frame(true, opcode::PONG, b"p"));
        want.extend(server_frame(false, opcode::CONTINUATION, b"\x82"));
        assert_eq!(out, want);

        let mut msg2 = msg;
        let mut out = Vec::new();
        let fin = client_frame(true, opcode::CONTINUATION, b"\xac!", M);
        let (_, o) = process(&fin, &mut msg2, &mut out, 1024);
        assert_eq!(o, Outcome::Continue);
        assert_eq!(out, server_frame(true, opcode::CONTINUATION, b"\xac!"));
        assert!(msg2.is_idle());

        // Ending the message in the middle of a code point is invalid.
        let mut msg3 = msg;
        let mut out = Vec::new();
        let fin = client_frame(true, opcode::CONTINUATION, b"\xac\xe2", M);
        let (_, o) = process(&fin, &mut msg3, &mut out, 1024);
        assert_eq!(o, Outcome::Fail(code::INVALID_PAYLOAD));
    }

    #[test]
    fn invalid_utf8_fails_with_1007_and_echoes_nothing_of_it() {
        let input = client_frame(true, opcode::TEXT, b"ok\xff", M);
        let (_, o, out, _) = run(&input);
        assert_eq!(o, Outcome::Fail(code::INVALID_PAYLOAD));
        assert_eq!(out, [0x88, 2, 0x03, 0xef]);
        // Binary frames are not validated.
        let (_, o, _, _) = run(&client_frame(true, opcode::BINARY, b"\xff", M));
        assert_eq!(o, Outcome::Continue);
    }

    #[test]
    fn utf8_carry_handles_every_split_point() {
        let text = "aé€😀z".as_bytes();
        for a in 0..=text.len() {
            for b in a..=text.len() {
                let mut msg = Message::default();
                assert!(utf8_step(&mut msg, &text[..a], false), "{a} {b}");
                assert!(utf8_step(&mut msg, &text[a..b], false), "{a} {b}");
                assert!(utf8_step(&mut msg, &text[b..], true), "{a} {b}");
            }
        }
        let mut msg = Message::default();
        assert!(utf8_step(&mut msg, b"\xf0\x9f", false));
        assert!(!utf8_step(&mut msg, b"\x41", false));
    }

    #[test]
    fn protocol_errors_fail_with_1002() {
        let cases: Vec<Vec<u8>> = vec![
            // unmasked client frame
            server_frame(true, opcode::TEXT, b"x"),
            // RSV1 without an extension
            {
                let mut f = client_frame(true, opcode::TEXT, b"x", M);
                f[0] |= 0x40;
                f
            },
            // fragmented control frame
            client_frame(false, opcode::PING, b"x", M),
            // oversize control frame
            client_frame(true, opcode::PING, &[0; 126], M),
            // continuation without a message
            client_frame(true, opcode::CONTINUATION, b"x", M),
            // new data frame inside a fragmented message
            {
                let mut f = client_frame(false, opcode::TEXT, b"x", M);
                f.extend(client_frame(true, opcode::BINARY, b"y", M));
                f
            },
            // reserved opcodes
            client_frame(true, 0x3, b"", M),
            client_frame(true, 0xB, b"", M),
            // close with a one-byte body, with a reserved code
            client_frame(true, opcode::CLOSE, &[3], M),
            client_frame(true, opcode::CLOSE, &1005u16.to_be_bytes(), M),
            client_frame(true, opcode::CLOSE, &999u16.to_be_bytes(), M),
        ];
        for (i, c) in cases.iter().enumerate() {
            let (n, o, out, _) = run(c);
            assert_eq!(o, Outcome::Fail(code::PROTOCOL_ERROR), "case {i}");
            assert_eq!(n, c.len());
            assert!(out.ends_with(&[0x88, 2, 0x03, 0xea]), "case {i}: {out:?}");
        }
    }

    #[test]
    fn oversize_frame_fails_with_1009_before_its_payload_arrives() {
        let f = client_frame(true, opcode::BINARY, &[0; 2000], M);
        let mut msg = Message::default();
        let mut out = Vec::new();
        // Only the header has arrived.
        let (_, o) = process(&f[..8], &mut msg, &mut out, 1000);
        assert_eq!(o, Outcome::Fail(code::TOO_BIG));
        assert_eq!(out, [0x88, 2, 0x03, 0xf1]);
    }

    #[test]
    fn close_handshake_echoes_the_code() {
        let mut body = 1000u16.to_be_bytes().to_vec();
        body.extend_from_slice(b"bye");
        let mut input = client_frame(true, opcode::CLOSE, &body, M);
        input.extend(client_frame(true, opcode::TEXT, b"after close", M));
        let (n, o, out, _) = run(&input);
        assert_eq!((n, o), (input.len(), Outcome::Closed));
        assert_eq!(out, [0x88, 2, 0x03, 0xe8]);
        let (_, o, out, _) = run(&client_frame(true, opcode::CLOSE, b"", M));
        assert_eq!(o, Outcome::Closed);
        assert_eq!(out, [0x88, 0]);
        let mut bad = 1000u16.to_be_bytes().to_vec();
        bad.push(0xff);
        let (_, o, _, _) = run(&client_frame(true, opcode::CLOSE, &bad, M));
        assert_eq!(o, Outcome::Fail(code::INVALID_PAYLOAD));
        assert!(valid_close_code(4999) && valid_close_code(3000) && valid_close_code(1011));
        assert!(!valid_close_code(1006) && !valid_close_code(1015) && !valid_close_code(5000));
    }

    #[test]
    fn ping_gets_pong_and_pong_is_ignored() {
        let mut input = client_frame(true, opcode::PING, b"12345", M);
        input.extend(client_frame(true, opcode::PONG, b"zz", M));
        let (n, o, out, _) = run(&input);
        assert_eq!((n, o), (input.len(), Outcome::Continue));
        assert_eq!(out, server_frame(true, opcode::PONG, b"12345"));
    }
}
