//! The calibration probe (`c10m-calibrate-probe`, in the loadgen image) and
//! the operator's `calibrate` step: the probe's flags, where it finds the
//! host's cgroups, and the report it writes as JSON on stdout and into its
//! container's termination message, which the operator reads.
//!
//! The probe runs in a pod on the node of the shard it measures. It opens
//! idle connections to the shard in steps, then the slow readers, and after
//! each step reads the shard pod's memory cgroup (found by pod UID under the
//! host's cgroup root) and the TCP line of `/proc/PID/net/sockstat` of a
//! process in the pod (the pod's network namespace; `hostPID`).

/// The probe binary's name in the loadgen image.
pub const BINARY: &str = "c10m-calibrate-probe";

/// Where the probe pod mounts the host's `/sys/fs/cgroup` (read-only hostPath).
pub const HOST_CGROUP_MOUNT: &str = "/host/sys/fs/cgroup";

/// Bytes each slow reader sends and never reads back: 1 MiB, as
/// `make bench-fidelity` (`SLOW_SEND_BYTES`) and the plan's slow-reader
/// model assume.
pub const SLOW_READER_SEND_BYTES: u64 = 1 << 20;

/// The probe's flags (each `--name=VALUE`).
pub mod flag {
    /// `IP:PORT` of the shard's connection listener.
    pub const TARGET: &str = "--target";
    /// `echo` or `websocket` (`crate::protocol`): a WebSocket connection
    /// counts once its upgrade is answered.
    pub const PROTOCOL: &str = "--protocol";
    /// The shard pod's `metadata.uid`: its cgroup is `pod<UID>` (UID with
    /// `-` or `_`, by cgroup driver) under the host's `kubepods` tree.
    pub const POD_UID: &str = "--pod-uid";
    /// Comma-separated idle-connection counts at which to sample, ascending
    /// (a sample at 0 is always taken first).
    pub const STEPS: &str = "--steps";
    /// Slow readers opened after the last step.
    pub const SLOW_READERS: &str = "--slow-readers";
    /// Seconds to wait after a step before sampling (the kernel frees and
    /// the server settles; the sample is taken when two reads agree).
    pub const SETTLE_SECONDS: &str = "--settle-seconds";
    /// Seconds the whole probe may take before it reports what it has.
    pub const TIMEOUT_SECONDS: &str = "--timeout-seconds";
}

/// One reading of the shard pod, in bytes unless named otherwise.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "camelCase")
)]
pub struct Sample {
    /// Idle connections the probe held open (established, upgraded).
    pub idle_connections: u64,
    /// Slow readers the probe held open (each sent
    /// [`SLOW_READER_SEND_BYTES`] and read nothing).
    pub slow_readers: u64,
    /// `TCP: inuse` of the pod's network namespace (its sockets, listeners
    /// included).
    pub tcp_in_use: u64,
    /// The pod's memory: v1 `memory.usage_in_bytes` (+
    /// `memory.kmem.tcp.usage_in_bytes` when socket accounting is on), v2
    /// `memory.current`.
    pub pod_bytes: u64,
    /// Anonymous (user) memory: v1 `memory.stat` `total_rss`, v2 `anon`.
    pub user_bytes: u64,
    /// Kernel memory charged to the pod: v1 `memory.kmem.usage_in_bytes` (+
    /// `memory.kmem.tcp.usage_in_bytes` when accounted), v2 `memory.stat`
    /// `kernel` + `sock`.
    pub kernel_bytes: u64,
    /// `TCP: mem` of sockstat, in pages (host-wide: every namespace's
    /// sockets).
    pub tcp_mem_pages: u64,
}

/// What the probe writes when it ends.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "camelCase")
)]
pub struct Report {
    /// `v1` or `v2`: the host's memory cgroup hierarchy.
    pub cgroup_mode: String,
    /// Whether TCP socket memory is charged to the pod (always on v2; on v1
    /// only once some cgroup wrote `memory.kmem.tcp.limit_in_bytes`).
    pub socket_accounted: bool,
    /// The samples in the order taken: 0 connections first, each step, then
    /// the slow readers.
    pub samples: Vec<Sample>,
    /// Why the probe stopped early (a connect refused or timed out, the
    /// shard's processes gone, the timeout), or none. The samples taken
    /// before still count.
    pub error: Option<String>,
    /// OOM kills the kernel counted in the shard pod's memory cgroups when
    /// the probe ended (v1: `oom_kill` of `memory.oom_control` in the pod's
    /// cgroup and each container's, which v1 does not add up; v2: `oom_kill`
    /// of the pod's `memory.events`, which counts its children). The
    /// kernel's own word on a kill: a runtime can report an OOM-killed
    /// container as `Error` when it handles the exit before the OOM event
    /// (containerd 1.6, containerd/containerd#12260). 0 when the counters
    /// were gone or unreadable, and in reports of probes without the field.
    #[cfg_attr(feature = "serde", serde(default))]
    pub oom_kills: u64,
}
