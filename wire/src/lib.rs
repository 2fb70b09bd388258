//! `c10m-wire`: what the operator and the bundled server must agree on.
//!
//! The operator renders these names and values into the shard Deployment
//! (env, probes, init-container args) and into its Prometheus queries and
//! admin calls; `c10m-server` and `c10m-sysctl` parse them. Both sides use
//! the constants here, so a typo cannot silently run a shard at the
//! server's defaults. This crate has no dependencies and no I/O.

#![forbid(unsafe_code)]

/// Environment variables `c10m-server` reads (each also a `--flag`).
pub mod env {
    /// Address the connection listeners and the admin server bind to.
    pub const BIND: &str = "C10M_BIND";
    /// TCP port of the connection listeners (`spec.server.port`).
    pub const PORT: &str = "C10M_PORT";
    /// TCP port of the admin HTTP server (`spec.server.metricsPort`).
    pub const METRICS_PORT: &str = "C10M_METRICS_PORT";
    /// Worker threads, one per pinned CPU (`status.plan.workers`).
    pub const WORKERS: &str = "C10M_WORKERS";
    /// Per-process connection cap, in connections
    /// (`status.plan.shardConnectionLimit`).
    pub const MAX_CONNECTIONS: &str = "C10M_MAX_CONNECTIONS";
    /// RLIMIT_NOFILE the plan expects, in descriptors (`status.plan.nofile`).
    pub const NOFILE: &str = "C10M_NOFILE";
    /// `listen(2)` backlog per listener, in pending connections.
    pub const BACKLOG: &str = "C10M_BACKLOG";
    /// Wire protocol: `echo` or `websocket` ([`super::protocol`]).
    pub const PROTOCOL: &str = "C10M_PROTOCOL";
    /// Seconds a WebSocket upgrade request may take.
    pub const HANDSHAKE_TIMEOUT_SECS: &str = "C10M_HANDSHAKE_TIMEOUT_SECS";
    /// Seconds of silence after which a connection is closed (0: never).
    pub const IDLE_TIMEOUT_SECS: &str = "C10M_IDLE_TIMEOUT_SECS";
    /// Largest WebSocket frame payload accepted, in bytes.
    pub const MAX_FRAME_BYTES: &str = "C10M_MAX_FRAME_BYTES";
    /// Drain rate on SIGTERM, in connections/s (`spec.drain.rate`).
    pub const DRAIN_RATE: &str = "C10M_DRAIN_RATE";
    /// Seconds a drain may take before the rest is closed at once.
    pub const DRAIN_TIMEOUT_SECS: &str = "C10M_DRAIN_TIMEOUT_SECS";
    /// File holding the admin bearer token.
    pub const ADMIN_TOKEN_FILE: &str = "C10M_ADMIN_TOKEN_FILE";
    /// The admin bearer token itself.
    pub const ADMIN_TOKEN: &str = "C10M_ADMIN_TOKEN";
}

/// Values of [`env::PROTOCOL`].
pub mod protocol {
    /// Every byte read is written back unchanged.
    pub const ECHO: &str = "echo";
    /// RFC 6455 WebSocket, messages echoed.
    pub const WEBSOCKET: &str = "websocket";
}

/// The admin HTTP server of `c10m-server` (on [`env::METRICS_PORT`]).
pub mod admin {
    /// `GET`: Prometheus text exposition.
    pub const METRICS_PATH: &str = "/metrics";
    /// `GET`: 200 while serving, 503 while draining; the probes' path.
    pub const HEALTHZ_PATH: &str = "/healthz";
    /// `POST`, bearer token: start a drain at `?rate=` connections/s.
    pub const DRAIN_PATH: &str = "/drain";
    /// `POST`, bearer token: close `?count=` connections at `?rate=`
    /// connections/s with a protocol goodbye.
    pub const SHED_PATH: &str = "/shed";
    /// Query key of [`SHED_PATH`]: connections to close (integer ≥ 0).
    pub const COUNT_KEY: &str = "count";
    /// Query key of [`DRAIN_PATH`] and [`SHED_PATH`]: connections/s (≥ 0).
    pub const RATE_KEY: &str = "rate";
    /// Key of the bearer token in the fleet's admin Secret.
    pub const TOKEN_KEY: &str = "token";
    /// Name of the container port serving the admin paths.
    pub const PORT_NAME: &str = "metrics";
}

/// Metric names of `c10m-server` that the operator's default queries use.
pub mod metrics {
    /// Gauge: open connections of one process, in connections.
    pub const CONNECTIONS: &str = "c10m_connections";
    /// Gauge: node-wide TCP socket memory from `/proc/net/sockstat`, in bytes.
    pub const TCP_MEMORY_BYTES: &str = "c10m_tcp_memory_bytes";
}

/// Descriptors and queue sizes both sides count with.
pub mod limits {
    /// File descriptors kept back from the connection budget regardless of
    /// the worker count, in descriptors: stdio, the admin listener and its
    /// connections, the signal self-pipe, slack. Chosen, not measured.
    pub const FD_RESERVE_BASE: u64 = 32;

    /// File descriptors each worker holds besides its connections, in
    /// descriptors: its SO_REUSEPORT listener, its epoll instance, the
    /// eventfd behind its waker and a spare descriptor for accepting under
    /// `EMFILE`. Counted from the server's worker code.
    pub const FD_RESERVE_PER_WORKER: u64 = 4;

    /// Descriptors kept back from the connection budget for `workers`
    /// workers: the plan's `nofile` is the connection cap plus this.
    pub const fn fd_reserve(workers: u64) -> u64 {
        FD_RESERVE_BASE + FD_RESERVE_PER_WORKER * workers
    }

    /// `listen(2)` backlog per listener, in pending connections: the largest
    /// a `u16` socket queue length holds. A 128 backlog overflowed at 19k
    /// connections and cut the accept rate from ~50k/s to ~160/s
    /// [measured, `docs/KERNEL_FACTS.md`]; the operator raises
    /// `net.core.somaxconn` to match, since the kernel clamps to it.
    pub const LISTEN_BACKLOG: u32 = 65_535;

    /// `fs.nr_open` kernel default, the ceiling on any RLIMIT_NOFILE, in
    /// descriptors [source: `docs/KERNEL_FACTS.md`, "Limits and where they
    /// live"; kernel `fs/file.c` `sysctl_nr_open = 1024 * 1024`].
    pub const DEFAULT_NR_OPEN: u64 = 1_048_576;
}

/// `c10m-sysctl`, the init tool that applies a plan's sysctls.
pub mod sysctl_tool {
    /// The binary's name in the server image.
    pub const BINARY: &str = "c10m-sysctl";
    /// `--set NAME=VALUE`: write a namespaced sysctl in the pod's netns.
    pub const SET_FLAG: &str = "--set";
    /// `--raise-node NAME=VALUE`: raise (never lower) a node-level sysctl
    /// in the host's network namespace.
    pub const RAISE_NODE_FLAG: &str = "--raise-node";
    /// `--host-proc PATH`: where the host's `/proc` is mounted.
    pub const HOST_PROC_FLAG: &str = "--host-proc";
    /// Default and rendered mount point of the host's `/proc`.
    pub const HOST_PROC_MOUNT: &str = "/host/proc";

    /// One argument as the operator renders it: `--flag=NAME=VALUE`.
    pub fn arg(flag: &str, name: &str, value: &str) -> String {
        format!("{flag}={name}={value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_reserve_counts_base_and_workers() {
        assert_eq!(limits::fd_reserve(0), 32);
        assert_eq!(limits::fd_reserve(8), 64);
    }

    #[test]
    fn env_names_are_distinct_and_prefixed() {
        let names = [
            env::BIND,
            env::PORT,
            env::METRICS_PORT,
            env::WORKERS,
            env::MAX_CONNECTIONS,
            env::NOFILE,
            env::BACKLOG,
            env::PROTOCOL,
            env::HANDSHAKE_TIMEOUT_SECS,
            env::IDLE_TIMEOUT_SECS,
            env::MAX_FRAME_BYTES,
            env::DRAIN_RATE,
            env::DRAIN_TIMEOUT_SECS,
            env::ADMIN_TOKEN_FILE,
            env::ADMIN_TOKEN,
        ];
        let set: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(set.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("C10M_")));
    }

    #[test]
    fn sysctl_arg_is_flag_equals_setting() {
        assert_eq!(
            sysctl_tool::arg(sysctl_tool::SET_FLAG, "net.core.somaxconn", "65535"),
            "--set=net.core.somaxconn=65535"
        );
    }
}
