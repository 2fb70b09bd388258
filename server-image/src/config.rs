//! Command line and environment configuration.
//!
//! The environment variable names and protocol values are the operator's
//! contract and come from `c10m-wire` ([`c10m_wire::env`],
//! [`c10m_wire::protocol`]): the operator renders the same constants into
//! the shard Deployment. [`Config::from_env_pairs`] runs this parser on an
//! explicit environment, so the operator's tests can check what a rendered
//! Deployment would make of it.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr};

use c10m_wire::{env, protocol};

use crate::privilege::RunAs;
use crate::ws::Subprotocols;
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};

/// Default TCP port of the connection listeners (`spec.server.port`).
pub const DEFAULT_PORT: u16 = 7000;

/// Default TCP port of the admin HTTP server (`spec.server.metricsPort`).
pub const DEFAULT_METRICS_PORT: u16 = 9090;

/// Default per-process connection cap, in connections.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 1_000_000;

/// Default `listen(2)` backlog, in pending connections, per listener:
/// [`c10m_wire::limits::LISTEN_BACKLOG`] (why that value is documented
/// there). The kernel silently clamps it to `net.core.somaxconn` (4,096 in a
/// fresh pod network namespace), which the operator raises to match.
pub const DEFAULT_BACKLOG: i32 = c10m_wire::limits::LISTEN_BACKLOG as i32;

// The cast above keeps the value: `listen(2)` takes an `int`.
const _: () = assert!(c10m_wire::limits::LISTEN_BACKLOG <= i32::MAX as u32);

/// Wire protocol the workers speak on accepted connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    /// Write back every byte read, unchanged. The load generator's ping is
    /// a 16-byte message it times until the same 16 bytes come back.
    #[value(name = protocol::ECHO)]
    Echo,
    /// WebSocket (RFC 6455): HTTP/1.1 upgrade, then text and binary
    /// messages are echoed, pings answered, closes completed.
    #[value(name = protocol::WEBSOCKET)]
    Websocket,
}

/// Default seconds a WebSocket upgrade request may take before the
/// connection is closed (slowloris guard). 10 s is generous for a client
/// that sends its request right after connecting (one round trip) while
/// bounding what a slow client can pin. Chosen, not measured.
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECS: u32 = 10;

/// Default seconds a server ping may go unanswered: 10 s, ample for a
/// round trip across continents while a stuck client is found soon after
/// its ping. Chosen, not measured.
pub const DEFAULT_WS_PONG_TIMEOUT_SECS: u32 = 10;

/// Default seconds the server waits, after its WebSocket close frame (or an
/// HTTP error answer), for the client to close its side
/// (`--close-timeout-secs`; [`crate::conn`] has the closing state). 5 s:
/// what ASP.NET Core waits for a peer's close (`WebSocketOptions.CloseTimeout`,
/// default 5 s) and nginx's `lingering_timeout` (5 s) for more client data
/// before it closes [sources: their reference docs]. A client answers a close
/// one round trip after it has read what came before it, so this covers
/// slow mobile links with seconds to spare, while a drain or a shed
/// lingers at most this long for clients that never answer. Chosen from
/// those, not measured.
pub const DEFAULT_CLOSE_TIMEOUT_SECS: u32 = 5;

/// Default seconds the server waits for a drain to finish before closing
/// what is left at once: 25 s, inside Kubernetes' default 30 s
/// `terminationGracePeriodSeconds` [source: Kubernetes pod lifecycle docs].
pub const DEFAULT_DRAIN_TIMEOUT_SECS: u64 = 25;

/// `c10m-server` configuration, from flags with environment fallbacks.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "c10m-server",
    version,
    about = "The bundled c10m connection server: one SO_REUSEPORT listener and \
             edge-triggered epoll loop per worker thread"
)]
pub struct Config {
    /// Address the connection listeners and the admin HTTP server bind to.
    #[arg(long, env = env::BIND, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    pub bind: IpAddr,

    /// TCP port of the connection listeners (one SO_REUSEPORT listener per
    /// worker). 0 picks a free port once and shares it among the workers.
    #[arg(long, env = env::PORT, default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// TCP port of the admin HTTP server (GET /metrics, GET /healthz).
    #[arg(long, env = env::METRICS_PORT, default_value_t = DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,

    /// Worker threads, each with its own listener and event loop.
    /// Default: the number of CPUs in the process's affinity mask.
    #[arg(long, env = env::WORKERS, value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: Option<u16>,

    /// Per-process cap on live connections; above it new connections are
    /// accepted and closed at once (counted as rejected, reason "capacity").
    #[arg(long, env = env::MAX_CONNECTIONS, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: u64,

    /// File descriptor limit the capacity plan expects (RLIMIT_NOFILE). If the
    /// limit in force after raising soft to hard is lower, the server warns and
    /// lowers the connection cap to fit it.
    #[arg(long, env = env::NOFILE, value_parser = clap::value_parser!(u64).range(1..))]
    pub nofile: Option<u64>,

    /// listen(2) backlog per listener, in pending connections (the kernel
    /// clamps it to net.core.somaxconn).
    #[arg(
        long,
        env = env::BACKLOG,
        default_value_t = DEFAULT_BACKLOG,
        value_parser = clap::value_parser!(i32).range(1..)
    )]
    pub backlog: i32,

    /// Protocol spoken on accepted connections.
    #[arg(long, env = env::PROTOCOL, value_enum, default_value_t = Protocol::Echo)]
    pub protocol: Protocol,

    /// Seconds a WebSocket upgrade request may take before the connection is
    /// closed (enforced within one more second).
    #[arg(
        long,
        env = env::HANDSHAKE_TIMEOUT_SECS,
        default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub handshake_timeout_secs: u32,

    /// Seconds without a read after which a connection is closed; 0 (the
    /// default) never closes idle connections, as push-style fleets need.
    #[arg(long, env = env::IDLE_TIMEOUT_SECS, default_value_t = 0)]
    pub idle_timeout_secs: u32,

    /// Largest WebSocket frame payload accepted, in bytes; a larger frame
    /// closes the connection with status 1009.
    #[arg(
        long,
        env = env::MAX_FRAME_BYTES,
        default_value_t = crate::ws::DEFAULT_MAX_FRAME_BYTES,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=(1 << 30))
    )]
    pub max_frame_bytes: usize,

    /// Seconds of silence before the first TCP keepalive probe on an
    /// accepted connection; 0 turns keepalive off. With the interval and
    /// count, a peer that vanished is dropped within idle + interval ×
    /// count seconds (`c10m_wire::keepalive`).
    #[arg(
        long,
        env = env::KEEPALIVE_IDLE_SECS,
        default_value_t = c10m_wire::keepalive::IDLE_SECS,
        value_parser = clap::value_parser!(u32).range(0..=32_767)
    )]
    pub keepalive_idle_secs: u32,

    /// Seconds between TCP keepalive probes.
    #[arg(
        long,
        env = env::KEEPALIVE_INTERVAL_SECS,
        default_value_t = c10m_wire::keepalive::INTERVAL_SECS,
        value_parser = clap::value_parser!(u32).range(1..=32_767)
    )]
    pub keepalive_interval_secs: u32,

    /// Unanswered TCP keepalive probes before the kernel drops a connection.
    #[arg(
        long,
        env = env::KEEPALIVE_COUNT,
        default_value_t = c10m_wire::keepalive::COUNT,
        value_parser = clap::value_parser!(u32).range(1..=127)
    )]
    pub keepalive_count: u32,

    /// Seconds sent data may stay unacknowledged before the kernel drops the
    /// connection (TCP_USER_TIMEOUT): a dead peer with replies or pings in
    /// flight gets no keepalive probes. Default: the keepalive's idle +
    /// interval × count; 0 leaves the kernel's retransmission limit.
    #[arg(
        long,
        env = env::TCP_USER_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32).range(0..=2_147_483)
    )]
    pub tcp_user_timeout_secs: Option<u32>,

    /// Seconds a WebSocket frame may take to arrive once its first byte has;
    /// a frame still unfinished then closes the connection with status 1008
    /// (checked once a second).
    #[arg(
        long,
        env = env::FRAME_TIMEOUT_SECS,
        default_value_t = c10m_wire::partial::FRAME_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub frame_timeout_secs: u32,

    /// Bytes one worker may hold for unfinished WebSocket frames and upgrade
    /// requests, over all its connections; a connection that would hold more
    /// is closed with status 1013 (503 before the upgrade). Never below one
    /// largest frame (`--max-frame-bytes` plus its header).
    #[arg(
        long,
        env = env::PARTIAL_BUDGET_BYTES,
        default_value_t = c10m_wire::partial::BUDGET_BYTES_PER_WORKER as usize,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=(1 << 40))
    )]
    pub partial_budget_bytes: usize,

    /// Seconds without a read after which the server pings a WebSocket; 0
    /// (the default) never pings. TCP keepalive already finds vanished
    /// peers; pings also find clients whose TCP stack answers but whose
    /// application is stuck, and keep proxies that time out idle streams
    /// from doing so.
    #[arg(long, env = env::WS_PING_SECS, default_value_t = 0)]
    pub ws_ping_secs: u32,

    /// Seconds a server ping may go unanswered (no frame read at all) before
    /// the connection is closed with status 1011.
    #[arg(
        long,
        env = env::WS_PONG_TIMEOUT_SECS,
        default_value_t = DEFAULT_WS_PONG_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub ws_pong_timeout_secs: u32,

    /// Seconds the server waits, after it sent a WebSocket close frame (drain,
    /// shed, 1009, 1007, 1002, timeouts, ...) or an HTTP error answer to an
    /// upgrade, for the client to close its side: it half-closes at once
    /// (FIN) and reads and discards what the client still sends (its close
    /// answer, the rest of a message; at most 8 MiB), so that none of it
    /// draws a reset that would lose the close code (RFC 6455 §7.1.1).
    /// Then it closes the socket anyway (checked once a second: between S
    /// and S+2 s).
    #[arg(
        long,
        env = env::CLOSE_TIMEOUT_SECS,
        default_value_t = DEFAULT_CLOSE_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u32)
            .range(1..=i64::from(crate::conn::MAX_CLOSE_TIMEOUT_SECS))
    )]
    pub close_timeout_secs: u32,

    /// WebSocket subprotocols the server accepts, comma-separated (e.g.
    /// `chat,v2.example`): an upgrade's 101 names the first protocol the
    /// client offers in Sec-WebSocket-Protocol (in the client's order) that
    /// is on this list, and none if no offer is (RFC 6455 §4.2.2). Each name
    /// must be an RFC 7230 token, named once. Default: none.
    #[arg(
        long,
        env = env::SUBPROTOCOLS,
        value_name = "LIST",
        default_value = "",
        hide_default_value = true,
        value_parser = parse_subprotocols
    )]
    pub subprotocols: Subprotocols,

    /// Connections closed per second when draining on SIGTERM/SIGINT; 0 (the
    /// default) closes them all at once.
    #[arg(long, env = env::DRAIN_RATE, default_value_t = 0.0)]
    pub drain_rate: f64,

    /// Seconds a drain may take; what is still open then is closed at once
    /// and the process exits.
    #[arg(long, env = env::DRAIN_TIMEOUT_SECS, default_value_t = DEFAULT_DRAIN_TIMEOUT_SECS)]
    pub drain_timeout_secs: u64,

    /// Seconds a drain keeps the listeners open while endpoint removal
    /// propagates: connections that arrive get a protocol goodbye (WebSocket
    /// close 1001 after the upgrade; echo: FIN) instead of a refusal, then
    /// the listeners close. 0 closes them at once.
    #[arg(
        long,
        env = env::DRAIN_ACCEPT_SECS,
        default_value_t = c10m_wire::drain::ACCEPT_SECS,
        value_parser = clap::value_parser!(u64).range(0..=3600)
    )]
    pub drain_accept_secs: u64,

    /// File holding the bearer token that `POST /drain` and `POST /shed`
    /// require (surrounding whitespace ignored). Read at start (unreadable:
    /// the server does not start) and again when an order arrives, at most
    /// once per second, so a rotated Secret volume takes effect without a
    /// restart; while it gives no token (gone, empty) orders answer 503.
    /// Without a token from this file or C10M_ADMIN_TOKEN, those endpoints
    /// answer 401.
    #[arg(long, env = env::ADMIN_TOKEN_FILE)]
    pub admin_token_file: Option<std::path::PathBuf>,

    /// The bearer token itself (environment only, so it stays out of the
    /// process list), fixed for the life of the process;
    /// `--admin-token-file` wins if both are set. The operator renders the
    /// file; this stays for Deployments rendered by earlier operators and
    /// for running the server by hand.
    #[arg(
        long = "admin-token",
        env = env::ADMIN_TOKEN,
        hide = true,
        hide_env_values = true
    )]
    pub admin_token: Option<String>,

    /// UID:GID (decimal, both non-zero) to drop to after raising
    /// RLIMIT_NOFILE and before opening any socket: supplementary groups
    /// cleared, then gid, then uid; the server refuses to serve unless the
    /// ids are these and it holds no capabilities. For a container started
    /// as root with only CAP_SETUID and CAP_SETGID (plus CAP_SYS_RESOURCE
    /// where the node grants it). Already running as UID:GID: nothing to
    /// do; as another non-root uid: an error.
    #[arg(
        long,
        env = env::RUN_AS,
        value_name = "UID:GID",
        value_parser = parse_run_as
    )]
    pub run_as: Option<RunAs>,
}

/// `--run-as`/`C10M_RUN_AS` ([`RunAs`]'s `FromStr`, whose errors name the
/// variable).
fn parse_run_as(s: &str) -> Result<RunAs, String> {
    s.parse()
}

/// `--subprotocols`/`C10M_SUBPROTOCOLS` ([`Subprotocols::parse`]); errors
/// name both, whichever was used.
fn parse_subprotocols(s: &str) -> Result<Subprotocols, String> {
    Subprotocols::parse(s).map_err(|e| format!("--subprotocols ({}): {e}", env::SUBPROTOCOLS))
}

impl Config {
    /// Parses the configuration from an explicit environment, the way the
    /// `c10m-server` binary parses its own environment when started with
    /// no flags, without reading or changing the process environment.
    ///
    /// Each pair is a variable name and its value, as in a container's
    /// `env`. Names the server reads (the `env` of each flag, i.e. the
    /// [`c10m_wire::env`] constants) become that flag; any other name is
    /// ignored, as the server ignores unknown variables (so a misspelt name
    /// shows up as a default value, which is what a caller should compare).
    /// When a name occurs more than once the last value wins, as for a
    /// container's `env` list. The process's own `C10M_*` variables play no
    /// part. Flags that are not set fall back to their
    /// defaults; bad values give the same `clap::Error` the binary would
    /// print.
    ///
    /// ```
    /// let c = c10m_server::Config::from_env_pairs([
    ///     ("C10M_PORT", "7100"),
    ///     ("C10M_PROTOCOL", "websocket"),
    /// ])
    /// .unwrap();
    /// assert_eq!((c.port, c.protocol), (7100, c10m_server::Protocol::Websocket));
    /// ```
    pub fn from_env_pairs<K, V>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Config, clap::Error>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let env: BTreeMap<String, String> = pairs
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
            .collect();
        let cmd = Config::command();
        let mut argv = vec![OsString::from(cmd.get_name())];
        for arg in cmd.get_arguments() {
            let (Some(name), Some(long)) = (arg.get_env(), arg.get_long()) else {
                continue;
            };
            if let Some(value) = name.to_str().and_then(|n| env.get(n)) {
                // `--flag=value`, so a value starting with `-` stays a value.
                argv.push(format!("--{long}={value}").into());
            }
        }
        // clap reads each flag's variable from the process environment when
        // the command is built; drop those, so only `pairs` count.
        let mut cmd = cmd.mut_args(|a| a.env(None::<&str>));
        let matches = cmd.try_get_matches_from_mut(argv)?;
        Config::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
    }

    /// The admin bearer token now, read once: from `--admin-token-file` if
    /// given ([`crate::token::read_token_file`]), else C10M_ADMIN_TOKEN. An
    /// empty token counts as none. The server itself keeps an
    /// [`crate::token::AdminToken`], which re-reads the file as it changes.
    pub fn admin_token(&self) -> std::io::Result<Option<String>> {
        match &self.admin_token_file {
            Some(path) => crate::token::read_token_file(path),
            None => {
                let token = self.admin_token.as_deref().unwrap_or_default().trim();
                Ok((!token.is_empty()).then(|| token.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(std::iter::once("c10m-server").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_the_contract() {
        // Only meaningful when none of the env fallbacks are set.
        if std::env::vars().any(|(k, _)| k.starts_with("C10M_")) {
            eprintln!("skipping: C10M_* variables are set in the environment");
            return;
        }
        let c = parse(&[]).unwrap();
        assert_eq!(c.bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(c.port, 7000);
        assert_eq!(c.metrics_port, 9090);
        assert_eq!(c.workers, None);
        assert_eq!(c.max_connections, 1_000_000);
        assert_eq!(c.nofile, None);
        assert_eq!(c.backlog, 65_535);
        assert_eq!(c.protocol, Protocol::Echo);
        assert_eq!(c.handshake_timeout_secs, 10);
        assert_eq!(c.idle_timeout_secs, 0);
        assert_eq!(c.max_frame_bytes, 65_536);
        assert_eq!(c.drain_rate, 0.0);
        assert_eq!(c.drain_timeout_secs, 25);
        assert_eq!(c.drain_accept_secs, 5);
        assert_eq!(c.admin_token().unwrap(), None);
        assert_eq!(c.run_as, None);
        assert_eq!(c.close_timeout_secs, 5);
        assert!(c.subprotocols.is_empty());
    }

    #[test]
    fn flags_parse() {
        let c = parse(&[
            "--bind",
            "127.0.0.2",
            "--port",
            "7100",
            "--metrics-port",
            "9100",
            "--workers",
            "3",
            "--max-connections",
            "42",
            "--nofile",
            "1048576",
            "--backlog",
            "1024",
            "--protocol",
            "echo",
        ])
        .unwrap();
        assert_eq!(c.bind, "127.0.0.2".parse::<IpAddr>().unwrap());
        assert_eq!(c.port, 7100);
        assert_eq!(c.metrics_port, 9100);
        assert_eq!(c.workers, Some(3));
        assert_eq!(c.max_connections, 42);
        assert_eq!(c.nofile, Some(1_048_576));
        assert_eq!(c.backlog, 1024);
        assert_eq!(c.protocol, Protocol::Echo);
        let c = parse(&["--protocol", "websocket", "--max-frame-bytes", "100"]).unwrap();
        assert_eq!((c.protocol, c.max_frame_bytes), (Protocol::Websocket, 100));
    }

    #[test]
    fn admin_token_comes_from_file_first() {
        let dir = std::env::temp_dir().join(format!("c10m-token-{}", std::process::id()));
        std::fs::write(&dir, "  s3cret\n").unwrap();
        let mut c = parse(&[]).unwrap();
        c.admin_token = Some("from-env".into());
        assert_eq!(c.admin_token().unwrap().as_deref(), Some("from-env"));
        c.admin_token_file = Some(dir.clone());
        assert_eq!(c.admin_token().unwrap().as_deref(), Some("s3cret"));
        std::fs::write(&dir, "\n").unwrap();
        assert_eq!(c.admin_token().unwrap(), None);
        std::fs::remove_file(&dir).unwrap();
        assert!(c.admin_token().is_err(), "a missing token file is an error");
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse(&["--workers", "0"]).is_err());
        assert!(parse(&["--backlog", "0"]).is_err());
        assert!(parse(&["--protocol", "http"]).is_err());
        assert!(parse(&["--max-frame-bytes", "0"]).is_err());
        assert!(parse(&["--handshake-timeout-secs", "0"]).is_err());
        assert!(parse(&["--bind", "localhost"]).is_err());
        assert!(parse(&["--port", "70000"]).is_err());
    }

    #[test]
    fn env_fallback_names_are_the_contract() {
        let cmd = Config::command();
        let envs: Vec<(String, String)> = cmd
            .get_arguments()
            .filter_map(|a| {
                Some((
                    a.get_long()?.to_string(),
                    a.get_env()?.to_string_lossy().into_owned(),
                ))
            })
            .collect();
        let expected = [
            ("bind", env::BIND),
            ("port", env::PORT),
            ("metrics-port", env::METRICS_PORT),
            ("workers", env::WORKERS),
            ("max-connections", env::MAX_CONNECTIONS),
            ("nofile", env::NOFILE),
            ("backlog", env::BACKLOG),
            ("protocol", env::PROTOCOL),
            ("handshake-timeout-secs", env::HANDSHAKE_TIMEOUT_SECS),
            ("idle-timeout-secs", env::IDLE_TIMEOUT_SECS),
            ("max-frame-bytes", env::MAX_FRAME_BYTES),
            ("keepalive-idle-secs", env::KEEPALIVE_IDLE_SECS),
            ("keepalive-interval-secs", env::KEEPALIVE_INTERVAL_SECS),
            ("keepalive-count", env::KEEPALIVE_COUNT),
            ("tcp-user-timeout-secs", env::TCP_USER_TIMEOUT_SECS),
            ("frame-timeout-secs", env::FRAME_TIMEOUT_SECS),
            ("partial-budget-bytes", env::PARTIAL_BUDGET_BYTES),
            ("ws-ping-secs", env::WS_PING_SECS),
            ("ws-pong-timeout-secs", env::WS_PONG_TIMEOUT_SECS),
            ("close-timeout-secs", env::CLOSE_TIMEOUT_SECS),
            ("subprotocols", env::SUBPROTOCOLS),
            ("drain-rate", env::DRAIN_RATE),
            ("drain-timeout-secs", env::DRAIN_TIMEOUT_SECS),
            ("drain-accept-secs", env::DRAIN_ACCEPT_SECS),
            ("admin-token-file", env::ADMIN_TOKEN_FILE),
            ("admin-token", env::ADMIN_TOKEN),
            ("run-as", env::RUN_AS),
        ];
        for (flag, env) in expected {
            assert!(
                envs.iter().any(|(f, e)| f == flag && e == env),
                "--{flag} must fall back to {env}; have {envs:?}"
            );
        }
        assert_eq!(envs.len(), expected.len());
        cmd.debug_assert();
    }

    #[test]
    fn liveness_and_partial_input_flags() {
        let none: [(&str, &str); 0] = [];
        let c = Config::from_env_pairs(none).unwrap();
        assert_eq!(
            (
                c.keepalive_idle_secs,
                c.keepalive_interval_secs,
                c.keepalive_count
            ),
            (60, 10, 6)
        );
        assert_eq!(c.tcp_user_timeout_secs, None);
        assert_eq!(c.frame_timeout_secs, 10);
        assert_eq!(c.partial_budget_bytes, 8 << 20);
        assert_eq!((c.ws_ping_secs, c.ws_pong_timeout_secs), (0, 10));
        let c = Config::from_env_pairs([
            (env::KEEPALIVE_IDLE_SECS, "2"),
            (env::KEEPALIVE_INTERVAL_SECS, "1"),
            (env::KEEPALIVE_COUNT, "3"),
            (env::TCP_USER_TIMEOUT_SECS, "0"),
            (env::FRAME_TIMEOUT_SECS, "4"),
            (env::PARTIAL_BUDGET_BYTES, "65536"),
            (env::WS_PING_SECS, "30"),
            (env::WS_PONG_TIMEOUT_SECS, "5"),
        ])
        .unwrap();
        assert_eq!(
            (
                c.keepalive_idle_secs,
                c.keepalive_interval_secs,
                c.keepalive_count
            ),
            (2, 1, 3)
        );
        assert_eq!(c.tcp_user_timeout_secs, Some(0));
        assert_eq!((c.frame_timeout_secs, c.partial_budget_bytes), (4, 65_536));
        assert_eq!((c.ws_ping_secs, c.ws_pong_timeout_secs), (30, 5));
        // The kernel's bounds (TCP_KEEPIDLE/INTVL <= 32767, KEEPCNT <= 127,
        // TCP_USER_TIMEOUT in int milliseconds) and the positive ones.
        for (name, value) in [
            (env::KEEPALIVE_IDLE_SECS, "32768"),
            (env::KEEPALIVE_INTERVAL_SECS, "0"),
            (env::KEEPALIVE_COUNT, "0"),
            (env::KEEPALIVE_COUNT, "128"),
            (env::TCP_USER_TIMEOUT_SECS, "2147484"),
            (env::FRAME_TIMEOUT_SECS, "0"),
            (env::PARTIAL_BUDGET_BYTES, "0"),
            (env::WS_PONG_TIMEOUT_SECS, "0"),
            (env::WS_PING_SECS, "-1"),
        ] {
            assert!(
                Config::from_env_pairs([(name, value)]).is_err(),
                "{name}={value}"
            );
        }
    }

    #[test]
    fn protocol_values_are_the_contract() {
        let name = |p: Protocol| p.to_possible_value().unwrap().get_name().to_string();
        assert_eq!(name(Protocol::Echo), protocol::ECHO);
        assert_eq!(name(Protocol::Websocket), protocol::WEBSOCKET);
    }

    /// Issue 21, items 14 and 15: the close timeout and the subprotocols,
    /// from flags or variables; bad values are refused naming them.
    #[test]
    fn close_timeout_and_subprotocols() {
        let c = parse(&[
            "--close-timeout-secs",
            "1",
            "--subprotocols",
            "chat, v2.example",
        ])
        .unwrap();
        assert_eq!(c.close_timeout_secs, 1);
        let names: Vec<&str> = c.subprotocols.names().iter().map(|n| &**n).collect();
        assert_eq!(names, ["chat", "v2.example"]);
        let c =
            Config::from_env_pairs([(env::CLOSE_TIMEOUT_SECS, "60"), (env::SUBPROTOCOLS, "mqtt")])
                .unwrap();
        assert_eq!(c.close_timeout_secs, 60);
        assert_eq!(c.subprotocols.to_string(), "mqtt");
        // An empty variable means none, as an unset one does.
        let c = Config::from_env_pairs([(env::SUBPROTOCOLS, "")]).unwrap();
        assert!(c.subprotocols.is_empty());
        for (name, value) in [
            (env::CLOSE_TIMEOUT_SECS, "0"),
            (env::CLOSE_TIMEOUT_SECS, "61"),
            (env::SUBPROTOCOLS, "chat,bad token"),
            (env::SUBPROTOCOLS, "a/b"),
            (env::SUBPROTOCOLS, "chat,chat"),
        ] {
            let e = Config::from_env_pairs([(name, value)]).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{name}={value}: {e}"
            );
            assert!(e.to_string().contains(value), "{e}");
        }
        let e = parse(&["--subprotocols", "x y"]).unwrap_err().to_string();
        assert!(
            e.contains(env::SUBPROTOCOLS) && e.contains("\"x y\"") && e.contains("token"),
            "{e}"
        );
    }

    #[test]
    fn every_env_variable_parses_from_explicit_pairs() {
        // from_env_pairs turns each variable into `--flag=value`: every
        // flag with an env fallback must take a value for that to hold.
        for a in Config::command().get_arguments() {
            if a.get_env().is_some() {
                assert!(a.get_action().takes_values(), "{:?}", a.get_id());
            }
        }
        let c = Config::from_env_pairs([
            (env::BIND, "127.0.0.9"),
            (env::PORT, "7100"),
            (env::METRICS_PORT, "9100"),
            (env::WORKERS, "3"),
            (env::MAX_CONNECTIONS, "42"),
            (env::NOFILE, "1048608"),
            (env::BACKLOG, "1024"),
            (env::PROTOCOL, protocol::WEBSOCKET),
            (env::HANDSHAKE_TIMEOUT_SECS, "5"),
            (env::IDLE_TIMEOUT_SECS, "600"),
            (env::MAX_FRAME_BYTES, "100"),
            (env::DRAIN_RATE, "250.5"),
            (env::DRAIN_TIMEOUT_SECS, "20"),
            (env::DRAIN_ACCEPT_SECS, "7"),
            (env::ADMIN_TOKEN, "-s3cret"),
            (env::RUN_AS, "65532:65533"),
        ])
        .unwrap();
        assert_eq!(c.bind, "127.0.0.9".parse::<IpAddr>().unwrap());
        assert_eq!((c.port, c.metrics_port), (7100, 9100));
        assert_eq!(c.workers, Some(3));
        assert_eq!(c.max_connections, 42);
        assert_eq!(c.nofile, Some(1_048_608));
        assert_eq!(c.backlog, 1024);
        assert_eq!(c.protocol, Protocol::Websocket);
        assert_eq!((c.handshake_timeout_secs, c.idle_timeout_secs), (5, 600));
        assert_eq!(c.max_frame_bytes, 100);
        assert_eq!(c.drain_rate, 250.5);
        assert_eq!(c.drain_timeout_secs, 20);
        assert_eq!(c.drain_accept_secs, 7);
        assert_eq!(c.admin_token().unwrap().as_deref(), Some("-s3cret"));
        assert_eq!(
            c.run_as,
            Some(RunAs {
                uid: 65532,
                gid: 65533
            })
        );
        let c = Config::from_env_pairs([(env::ADMIN_TOKEN_FILE, "/run/token")]).unwrap();
        assert_eq!(c.admin_token_file, Some("/run/token".into()));
    }

    #[test]
    fn explicit_env_ignores_other_names_and_takes_the_last_value() {
        let pairs = vec![
            ("RUST_LOG".to_string(), "debug".to_string()),
            ("C10M_MAX_CONNECTION".to_string(), "7".to_string()),
            (env::PORT.to_string(), "7100".to_string()),
            (env::PORT.to_string(), "7200".to_string()),
        ];
        let c = Config::from_env_pairs(pairs).unwrap();
        assert_eq!(c.port, 7200);
        assert_eq!(
            c.max_connections, DEFAULT_MAX_CONNECTIONS,
            "a misspelt name is ignored"
        );
        let none: [(&str, &str); 0] = [];
        let c = Config::from_env_pairs(none).unwrap();
        assert_eq!((c.port, c.backlog), (DEFAULT_PORT, DEFAULT_BACKLOG));
    }

    #[test]
    fn explicit_env_rejects_what_the_binary_rejects() {
        for (name, value) in [
            (env::WORKERS, "0"),
            (env::BACKLOG, "0"),
            (env::PROTOCOL, "http"),
            (env::PORT, "70000"),
            (env::PORT, ""),
            (env::MAX_CONNECTIONS, "-1"),
            (env::BIND, "localhost"),
            (env::DRAIN_ACCEPT_SECS, "-1"),
            (env::DRAIN_ACCEPT_SECS, "3601"),
        ] {
            let e = Config::from_env_pairs([(name, value)]).unwrap_err();
            assert!(
                matches!(
                    e.kind(),
                    clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
                ),
                "{name}={value:?}: {e}"
            );
            assert!(e.to_string().contains(value), "{e}");
        }
    }

    #[test]
    fn run_as_errors_name_the_variable() {
        let c = Config::from_env_pairs([(env::RUN_AS, "65532:65532")]).unwrap();
        assert_eq!(
            c.run_as,
            Some(RunAs {
                uid: 65532,
                gid: 65532
            })
        );
        let c = parse(&["--run-as", "1000:1001"]).unwrap();
        assert_eq!(c.run_as.map(|r| (r.uid, r.gid)), Some((1000, 1001)));
        for (value, says) in [
            ("0:0", "uid 0"),
            ("65532:0", "gid 0"),
            ("65532", ":GID"),
            ("65532:", "decimal"),
            ("nobody:nogroup", "decimal"),
            ("", ":GID"),
            ("4294967295:1", "unchanged"),
        ] {
            let e = Config::from_env_pairs([(env::RUN_AS, value)]).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{value:?}: {e}"
            );
            let text = e.to_string();
            assert!(
                text.contains(env::RUN_AS) && text.contains(says) && text.contains(value),
                "{value:?}: {text}"
            );
        }
    }
}
