//! Command line and environment configuration.
//!
//! The flag and environment variable names here are a contract: the operator
//! renders them into the shard Deployment (`operator/src/render`). Rename
//! nothing without changing the renderer in the same change.

use std::net::{IpAddr, Ipv4Addr};

use clap::{Parser, ValueEnum};

/// Default TCP port of the connection listeners (`spec.server.port`).
pub const DEFAULT_PORT: u16 = 7000;

/// Default TCP port of the admin HTTP server (`spec.server.metricsPort`).
pub const DEFAULT_METRICS_PORT: u16 = 9090;

/// Default per-process connection cap, in connections.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 1_000_000;

/// Default `listen(2)` backlog, in pending connections, per listener.
///
/// The kernel silently clamps it to `net.core.somaxconn` (4,096 in a fresh pod
/// network namespace). A 128 backlog overflowed at 19k connections and cut the
/// accept rate from ~50k/s to ~160/s [measured, `shared/KERNEL_FACTS.md`], so
/// ask for the largest value a `u16` socket queue length can hold and let the
/// operator raise `somaxconn` to match.
pub const DEFAULT_BACKLOG: i32 = 65_535;

/// Wire protocol the workers speak on accepted connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    /// Write back every byte read, unchanged.
    Echo,
}

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
    #[arg(long, env = "C10M_BIND", default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    pub bind: IpAddr,

    /// TCP port of the connection listeners (one SO_REUSEPORT listener per
    /// worker). 0 picks a free port once and shares it among the workers.
    #[arg(long, env = "C10M_PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// TCP port of the admin HTTP server (GET /metrics, GET /healthz).
    #[arg(long, env = "C10M_METRICS_PORT", default_value_t = DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,

    /// Worker threads, each with its own listener and event loop.
    /// Default: the number of CPUs in the process's affinity mask.
    #[arg(long, env = "C10M_WORKERS", value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: Option<u16>,

    /// Per-process cap on live connections; above it new connections are
    /// accepted and closed at once (counted as rejected, reason "capacity").
    #[arg(long, env = "C10M_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: u64,

    /// File descriptor limit the capacity plan expects (RLIMIT_NOFILE). If the
    /// limit in force after raising soft to hard is lower, the server warns and
    /// lowers the connection cap to fit it.
    #[arg(long, env = "C10M_NOFILE", value_parser = clap::value_parser!(u64).range(1..))]
    pub nofile: Option<u64>,

    /// listen(2) backlog per listener, in pending connections (the kernel
    /// clamps it to net.core.somaxconn).
    #[arg(
        long,
        env = "C10M_BACKLOG",
        default_value_t = DEFAULT_BACKLOG,
        value_parser = clap::value_parser!(i32).range(1..)
    )]
    pub backlog: i32,

    /// Protocol spoken on accepted connections.
    #[arg(long, env = "C10M_PROTOCOL", value_enum, default_value_t = Protocol::Echo)]
    pub protocol: Protocol,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

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
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse(&["--workers", "0"]).is_err());
        assert!(parse(&["--backlog", "0"]).is_err());
        assert!(parse(&["--protocol", "websocket"]).is_err());
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
            ("bind", "C10M_BIND"),
            ("port", "C10M_PORT"),
            ("metrics-port", "C10M_METRICS_PORT"),
            ("workers", "C10M_WORKERS"),
            ("max-connections", "C10M_MAX_CONNECTIONS"),
            ("nofile", "C10M_NOFILE"),
            ("backlog", "C10M_BACKLOG"),
            ("protocol", "C10M_PROTOCOL"),
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
}
