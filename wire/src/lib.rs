//! `c10m-wire`: what the operator and the bundled server must agree on.
//!
//! The operator renders these names and values into the shard Deployment
//! (env, probes, init-container args) and into its Prometheus queries and
//! admin calls; `c10m-server` and `c10m-sysctl` parse them. Both sides use
//! the constants here, so a typo cannot silently run a shard at the
//! server's defaults. This crate has no I/O, and no dependencies unless its
//! `serde` feature is on (for [`calibrate::Report`]).

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
    /// Seconds a draining server keeps its listeners open, answering new
    /// connections with a protocol goodbye, while endpoint removal
    /// propagates.
    pub const DRAIN_ACCEPT_SECS: &str = "C10M_DRAIN_ACCEPT_SECS";
    /// File holding the admin bearer token: what the operator renders,
    /// [`super::admin::TOKEN_PATH`] in the fleet's admin Secret volume. The
    /// server re-reads it when it changes (at most once per second, when an
    /// order arrives), so a rotated Secret takes effect once the kubelet
    /// has updated the volume, without a restart.
    pub const ADMIN_TOKEN_FILE: &str = "C10M_ADMIN_TOKEN_FILE";
    /// The admin bearer token itself, fixed for the life of the process
    /// (a rotated Secret never reaches a running env var). The operator no
    /// longer renders it (issue 13); the server still reads it for
    /// Deployments rendered by earlier operators, which a newer server
    /// image may run under, and for running it by hand or in tests.
    /// [`ADMIN_TOKEN_FILE`] wins when both are set.
    pub const ADMIN_TOKEN: &str = "C10M_ADMIN_TOKEN";
    /// Seconds of silence before the first TCP keepalive probe (0: no
    /// keepalive); see [`super::keepalive`].
    pub const KEEPALIVE_IDLE_SECS: &str = "C10M_KEEPALIVE_IDLE_SECS";
    /// Seconds between TCP keepalive probes.
    pub const KEEPALIVE_INTERVAL_SECS: &str = "C10M_KEEPALIVE_INTERVAL_SECS";
    /// Unanswered TCP keepalive probes before a connection is dropped.
    pub const KEEPALIVE_COUNT: &str = "C10M_KEEPALIVE_COUNT";
    /// Seconds sent data may stay unacknowledged (`TCP_USER_TIMEOUT`; 0:
    /// the kernel's limit; unset: the keepalive's idle + interval × count).
    pub const TCP_USER_TIMEOUT_SECS: &str = "C10M_TCP_USER_TIMEOUT_SECS";
    /// Seconds a WebSocket frame may take to arrive once it has begun.
    pub const FRAME_TIMEOUT_SECS: &str = "C10M_FRAME_TIMEOUT_SECS";
    /// Bytes one worker may hold for unfinished frames and upgrade requests.
    pub const PARTIAL_BUDGET_BYTES: &str = "C10M_PARTIAL_BUDGET_BYTES";
    /// Seconds of silence before the server pings a WebSocket (0: never).
    pub const WS_PING_SECS: &str = "C10M_WS_PING_SECS";
    /// Seconds a server ping may go unanswered before the close.
    pub const WS_PONG_TIMEOUT_SECS: &str = "C10M_WS_PONG_TIMEOUT_SECS";
    /// Seconds the server waits, after its WebSocket close frame (or HTTP
    /// error answer), for the client to close its side before it closes
    /// the socket anyway.
    pub const CLOSE_TIMEOUT_SECS: &str = "C10M_CLOSE_TIMEOUT_SECS";
    /// WebSocket subprotocols the server accepts, comma-separated tokens
    /// (unset or empty: none).
    pub const SUBPROTOCOLS: &str = "C10M_SUBPROTOCOLS";
    /// `UID:GID` (decimal, both non-zero) the server drops to before it
    /// serves.
    ///
    /// Why: Kubernetes sets no ambient capabilities (kubernetes#56374), so a
    /// container started as a non-root uid with `capabilities.add:
    /// [SYS_RESOURCE]` has empty permitted and effective sets after
    /// `execve` and cannot raise its hard RLIMIT_NOFILE to the plan's
    /// `nofile`. So the container starts as uid 0 with `drop: [ALL]` and
    /// `add: [SETUID, SETGID]` (plus `SYS_RESOURCE` where the node can grant
    /// it) and `allowPrivilegeEscalation: false`, and the server itself
    /// drops to this uid:gid.
    ///
    /// Order, while the process is still single-threaded and before it
    /// opens any socket: raise RLIMIT_NOFILE (per process, it survives the
    /// drop); clear the supplementary groups, set real, effective and
    /// saved gid, then uid; check that the ids are the target's and that
    /// the permitted, effective and ambient capability sets are empty, or
    /// exit non-zero. Already running as this uid:gid is a no-op; running
    /// as another non-root uid is an error (it cannot switch). Unset: no
    /// change of identity.
    pub const RUN_AS: &str = "C10M_RUN_AS";
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
    /// `GET`: 200 while serving, 503 while draining or cordoned; the
    /// probes' path.
    pub const HEALTHZ_PATH: &str = "/healthz";
    /// `POST`, bearer token: start a drain at `?rate=` connections/s.
    pub const DRAIN_PATH: &str = "/drain";
    /// `POST`, bearer token: close `?count=` connections at `?rate=`
    /// connections/s with a protocol goodbye.
    pub const SHED_PATH: &str = "/shed";
    /// `POST`, bearer token: cordon the shard. `/healthz` answers 503, so
    /// its readiness drops and it leaves the Service's endpoints, while it
    /// keeps every held connection and still accepts what reaches it (a
    /// client racing the endpoint removal is served, not refused). A
    /// rollout cordons the old revision's shards before any of them
    /// drains, so the clients a drain closes reconnect to updated shards
    /// only.
    pub const CORDON_PATH: &str = "/cordon";
    /// `POST`, bearer token: lift [`CORDON_PATH`] (`/healthz` answers 200
    /// again unless draining).
    pub const UNCORDON_PATH: &str = "/uncordon";
    /// `POST`, bearer token: admit no more than `?connections=` (integer
    /// ≥ 0) connections, closing none of those held, for `?seconds=`
    /// (integer ≥ 1), after which the limit lapses by itself. A new order
    /// replaces the last one. A rollout limits its updated shards so the
    /// clients its drains move spread over them evenly (ADR 0011); the
    /// lapse means a limit never outlives the operator that keeps renewing
    /// it. A client turned away by the limit is closed at once, as at the
    /// cap (`c10m_connections_rejected_total{reason="limit"}`).
    pub const LIMIT_PATH: &str = "/limit";
    /// `POST`, bearer token: lift [`LIMIT_PATH`] at once.
    pub const UNLIMIT_PATH: &str = "/unlimit";
    /// Query key of [`LIMIT_PATH`]: connections admitted (integer ≥ 0).
    pub const CONNECTIONS_KEY: &str = "connections";
    /// Query key of [`LIMIT_PATH`]: seconds until the limit lapses
    /// (integer ≥ 1).
    pub const SECONDS_KEY: &str = "seconds";
    /// Query key of [`SHED_PATH`]: connections to close (integer ≥ 0).
    pub const COUNT_KEY: &str = "count";
    /// Query key of [`DRAIN_PATH`] and [`SHED_PATH`]: connections/s (≥ 0).
    pub const RATE_KEY: &str = "rate";
    /// Key of the bearer token in the fleet's admin Secret.
    pub const TOKEN_KEY: &str = "token";
    /// Where the server container mounts the fleet's admin Secret
    /// (read-only, only [`TOKEN_KEY`], as a file of that name). A whole
    /// directory, never a `subPath`: the kubelet updates a Secret volume by
    /// swapping its `..data` symlink, which a `subPath` mount never sees.
    pub const TOKEN_DIR: &str = "/var/run/c10m/admin";
    /// The token file in [`TOKEN_DIR`]: `TOKEN_DIR/TOKEN_KEY`, the value
    /// the operator renders into [`super::env::ADMIN_TOKEN_FILE`].
    pub const TOKEN_PATH: &str = "/var/run/c10m/admin/token";
    /// Name of the container port serving the admin paths.
    pub const PORT_NAME: &str = "metrics";

    /// What an admin token is, for both sides: the text of the Secret's
    /// [`TOKEN_KEY`] (the server's token file, or its fixed token) with
    /// surrounding whitespace trimmed (`kubectl create secret
    /// --from-file` and `echo … | base64` leave a trailing newline), and
    /// what is left made only of visible ASCII (0x21–0x7E), the characters
    /// an HTTP `Authorization: Bearer` value carries as they are (a control
    /// character makes HTTP clients refuse the header). `Ok(None)`: blank,
    /// no token. `Err`: what makes it unusable, for the error that names
    /// the Secret or the file.
    pub fn token(text: &str) -> Result<Option<&str>, String> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        match t
            .char_indices()
            .find(|(_, c)| !matches!(c, '\x21'..='\x7e'))
        {
            None => Ok(Some(t)),
            Some((at, c)) => Err(format!(
                "character {c:?} at byte {at} of the trimmed token: a token is visible ASCII only"
            )),
        }
    }
}

/// Metric names of `c10m-server` that the operator's default queries use.
pub mod metrics {
    /// Gauge: open connections of one process, in connections.
    pub const CONNECTIONS: &str = "c10m_connections";
    /// Gauge: node-wide TCP socket memory from `/proc/net/sockstat`, in bytes.
    pub const TCP_MEMORY_BYTES: &str = "c10m_tcp_memory_bytes";
}

/// Shutdown timing both sides count with.
pub mod drain {
    /// Seconds a draining server keeps accepting (and answering with a
    /// protocol goodbye) after SIGTERM, before it closes its listeners: the
    /// default of [`super::env::DRAIN_ACCEPT_SECS`], which the operator
    /// renders and adds to `terminationGracePeriodSeconds`.
    ///
    /// Endpoint removal races SIGTERM (kubernetes#86280): the pod leaves
    /// its EndpointSlices while the kubelet signals it, and each node's
    /// kube-proxy rewrites its rules at most once per
    /// `--iptables-min-sync-period` (default 1 s since kubernetes#92836)
    /// after its watch delivers the change. 5 s covers that sync plus watch
    /// delivery on a loaded control plane, with room; load balancers that
    /// follow endpoints more slowly need a larger value. Chosen from those
    /// sources, not measured.
    pub const ACCEPT_SECS: u64 = 5;
}

/// Descriptors and queue sizes both sides count with.
pub mod limits {
    /// File descriptors kept back from the connection budget regardless of
    /// the worker count, in descriptors: stdio, the admin listener and its
    /// event loop, the signal self-pipe, slack. Chosen, not measured.
    pub const FD_RESERVE_BASE: u64 = 32;

    /// Most connections the admin port holds at once, in connections: more
    /// than the probes, scrapes and orders a shard sees together, and more
    /// than the 100 slow or idle clients it must outlast while answering
    /// `/healthz`. Counted in [`fd_reserve`], so a full shard still has the
    /// descriptors to answer its probes. Chosen, not measured.
    pub const ADMIN_MAX_CONNECTIONS: u64 = 128;

    /// File descriptors each worker holds besides its connections, in
    /// descriptors: its SO_REUSEPORT listener, a second descriptor of that
    /// listener kept for the drain's accept window, its epoll instance, the
    /// eventfd behind its waker and a spare descriptor for accepting under
    /// `EMFILE`. Counted from the server's code.
    pub const FD_RESERVE_PER_WORKER: u64 = 5;

    /// Descriptors kept back from the connection budget for `workers`
    /// workers: the plan's `nofile` is the connection cap plus this.
    pub const fn fd_reserve(workers: u64) -> u64 {
        FD_RESERVE_BASE + ADMIN_MAX_CONNECTIONS + FD_RESERVE_PER_WORKER * workers
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

    /// Bytes a worker reads from one socket at a time (its scratch buffer):
    /// 64 KiB, the largest single read loopback TCP typically hands over
    /// (its 64 KiB MTU). Also the most a connection whose peer stopped
    /// reading keeps in user space: the unsent tail of one read.
    pub const READ_CHUNK_BYTES: usize = 64 * 1024;
}

/// TCP keepalive of the bundled server's connections: the server's defaults
/// and what the operator renders (`C10M_KEEPALIVE_*`).
///
/// A peer that vanishes without a FIN or RST (its network dropped it, its
/// node died) leaves an idle connection the server would otherwise count
/// as live forever, and the autoscaler would size the fleet for it. With
/// these times the kernel drops it within `dead_after_secs` = 60 + 10 ×
/// 6 = 120 s: inside the autoscaler's default 300 s scale-down
/// stabilization window, so dead peers never hold a fleet up for more than
/// one window. The Linux defaults (7,200 s, then 9 probes 75 s apart) would
/// take 2 h 11 min. A 60 s idle time also refreshes idle-flow state of the
/// common cloud load balancers (AWS NLB 350 s, Azure LB 240 s by default)
/// and NATs. The cost is one probe and its ACK per idle connection per
/// minute: ~17k small packets/s each way for a shard of 1M idle
/// connections. Chosen from these figures, not measured.
pub mod keepalive {
    /// Seconds of silence before the first probe (`TCP_KEEPIDLE`).
    pub const IDLE_SECS: u32 = 60;
    /// Seconds between probes (`TCP_KEEPINTVL`).
    pub const INTERVAL_SECS: u32 = 10;
    /// Unanswered probes before the connection is dropped (`TCP_KEEPCNT`).
    pub const COUNT: u32 = 6;

    /// Seconds after which a silent dead peer is dropped: idle + interval
    /// × count.
    pub const fn dead_after_secs(idle: u32, interval: u32, count: u32) -> u64 {
        idle as u64 + interval as u64 * count as u64
    }
}

/// What the bundled server holds for clients that stop in the middle of a
/// WebSocket frame or upgrade request.
pub mod partial {
    /// Default bytes one worker may hold for unfinished frames and upgrade
    /// requests (`C10M_PARTIAL_BUDGET_BYTES`), summed over its connections:
    /// 8 MiB, 128 frames of the default 64 KiB limit in flight at once per
    /// worker. A frame split across reads is normally in flight for about
    /// one round trip, so that sustains ~80 MiB/s of largest frames at a
    /// 100 ms round trip per worker, more than one echo worker moves;
    /// clients that stop mid-frame (issue 10: 2,000 of them pinned 140 MiB)
    /// get no more than this. The operator adds it, per worker, to a
    /// shard's memory. Chosen from that arithmetic, not measured.
    pub const BUDGET_BYTES_PER_WORKER: u64 = 8 << 20;

    /// Default seconds a WebSocket frame may take to arrive once its first
    /// byte has (`C10M_FRAME_TIMEOUT_SECS`): a 64 KiB frame at 64 kbit/s
    /// takes 8 s. Budget held by clients that stopped is free again after
    /// this. Chosen, not measured.
    pub const FRAME_TIMEOUT_SECS: u32 = 10;
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

pub mod calibrate;

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21: the bytes a rotated Secret holds after `kubectl create
    /// secret --from-file` or `echo … | base64` are the same token as
    /// without the newline, on both sides.
    #[test]
    fn a_token_is_its_trimmed_visible_ascii() {
        assert_eq!(admin::token("s3cret\n"), Ok(Some("s3cret")));
        assert_eq!(admin::token("\t s3cret \r\n"), Ok(Some("s3cret")));
        assert_eq!(admin::token("\n \n"), Ok(None));
        assert_eq!(admin::token(""), Ok(None));
        let e = admin::token("two words").unwrap_err();
        assert!(e.contains("' ' at byte 3"), "{e}");
        assert!(admin::token("t\u{7f}k").is_err());
        assert!(admin::token("tök").is_err());
    }

    #[test]
    fn fd_reserve_counts_base_and_workers() {
        assert_eq!(limits::fd_reserve(0), 32 + 128);
        assert_eq!(limits::fd_reserve(8), 32 + 128 + 40);
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
            env::DRAIN_ACCEPT_SECS,
            env::ADMIN_TOKEN_FILE,
            env::ADMIN_TOKEN,
            env::KEEPALIVE_IDLE_SECS,
            env::KEEPALIVE_INTERVAL_SECS,
            env::KEEPALIVE_COUNT,
            env::TCP_USER_TIMEOUT_SECS,
            env::FRAME_TIMEOUT_SECS,
            env::PARTIAL_BUDGET_BYTES,
            env::WS_PING_SECS,
            env::WS_PONG_TIMEOUT_SECS,
            env::CLOSE_TIMEOUT_SECS,
            env::SUBPROTOCOLS,
        ];
        let set: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(set.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("C10M_")));
    }

    #[test]
    fn the_token_file_is_the_token_key_in_the_token_dir() {
        assert_eq!(
            admin::TOKEN_PATH,
            format!("{}/{}", admin::TOKEN_DIR, admin::TOKEN_KEY)
        );
        assert!(admin::TOKEN_DIR.starts_with('/') && !admin::TOKEN_DIR.ends_with('/'));
    }

    #[test]
    fn keepalive_drops_dead_peers_within_two_minutes() {
        use keepalive::*;
        assert_eq!(dead_after_secs(IDLE_SECS, INTERVAL_SECS, COUNT), 120);
        assert_eq!(dead_after_secs(0, 0, 0), 0);
    }

    #[test]
    fn sysctl_arg_is_flag_equals_setting() {
        assert_eq!(
            sysctl_tool::arg(sysctl_tool::SET_FLAG, "net.core.somaxconn", "65535"),
            "--set=net.core.somaxconn=65535"
        );
    }
}
