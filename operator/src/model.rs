//! Capacity model (pure: no I/O). From a fleet's spec and the node profile it
//! derives shards, connections per shard, shards per node, resources, file
//! descriptor limits and the sysctls that let the kernel hold them.
//!
//! Every limit is checked at the shard's *connection cap* `L`, the declared
//! connections per shard inflated by the headroom (`L = ceil(n × 100 /
//! (100 − headroom))`), against 100 % of the limit. So at the declared load
//! every limit is used at most `100 − headroom` percent, and a shard can
//! absorb its cap (imbalance, reconnect storms) without hitting any of them.
//!
//! Figures come from `../shared/KERNEL_FACTS.md` (measured on Linux 6.18) and
//! the kernel sources named beside each constant.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::{BackendModel, ConnectionFleetSpec, SysctlMode};

/// Bytes in a page: the unit of `tcp_mem` (x86_64/arm64 4 KiB pages).
pub const PAGE_BYTES: i64 = 4096;

/// Kernel bytes per idle, epoll-registered IPv4 TCP socket on Linux 6.x, slab
/// packing included: tcp_sock 2,521 + sock_inode 862 + filp 195 + dentry 195 +
/// epoll 192 (KERNEL_FACTS.md, measured).
pub const KERNEL_BYTES_PER_SOCKET: i64 = 3965;

/// Of [`KERNEL_BYTES_PER_SOCKET`], the part charged to the pod's memory cgroup:
/// TCP sock + file + epoll, ~2.65–2.75 KB; inode and dentry land on the node
/// outside the pod (KERNEL_FACTS.md, measured, cgroup v1; upper figure used).
pub const CGROUP_KERNEL_BYTES_PER_SOCKET: i64 = 2750;

/// Bytes per tracked connection in the `nf_conntrack` slab (KERNEL_FACTS.md, measured).
pub const CONNTRACK_BYTES: i64 = 256;

/// User-space bytes per idle connection of a goroutine-per-connection Go
/// server (net/http): 11,400–11,900 B; the upper figure is used
/// (KERNEL_FACTS.md, [source] design article).
pub const GOROUTINE_USER_BYTES: i64 = 11_900;

/// User-space bytes per idle connection of the bundled c10m-server (epoll),
/// echo protocol: 19.8 B measured by `make bench-server` (RSS delta of 8
/// SO_REUSEPORT server processes ÷ 150,000 idle connections,
/// target/bench/server.json; WebSocket 20.7 B) on this project's 2-vCPU VM;
/// 23.7 B with one process and 19,000 connections (`make measure-server`).
/// Rounded up to 20.
pub const EPOLL_USER_BYTES: i64 = 20;

/// Memory allowed per shard process beyond its connections: runtime, thread
/// stacks, per-worker scratch buffers, metrics. A generous 64 MiB bound: the
/// bundled server's idle RSS is 3.3–3.5 MB with 2 workers (`make
/// measure-server`) and a Go runtime's heap arenas and stacks fit too.
pub const PROCESS_BASE_BYTES: i64 = 64 << 20;

/// File descriptors a shard needs besides connections: the bundled server
/// keeps 32 + 4 per worker (stdio, admin listener, listener + epoll + waker +
/// spare fd per worker; server-image/src/limits.rs), plus 32 slack for other
/// servers.
pub fn fd_reserve(workers: i64) -> i64 {
    64 + 4 * workers
}

/// Hard RLIMIT_NOFILE a container inherits when the node doesn't say:
/// containerd 2.x's unit sets no LimitNOFILE, so pods get systemd's default
/// hard limit 524,288 (KERNEL_FACTS.md, [source] containerd issues).
pub const DEFAULT_NOFILE_HARD_LIMIT: i64 = 524_288;

/// Largest `fs.nr_open` the kernel accepts on 64-bit (fs/file.c
/// `sysctl_nr_open_max`; writes above it fail with EINVAL).
pub const NR_OPEN_MAX: i64 = 1_073_741_816;

/// Kernel default of `fs.nr_open` (KERNEL_FACTS.md; `sysctl_nr_open` = 1024 × 1024 in fs/file.c).
pub const DEFAULT_NR_OPEN: i64 = 1_048_576;

/// Kernel default of `net.core.somaxconn` in a new pod network namespace (KERNEL_FACTS.md).
pub const DEFAULT_SOMAXCONN: i64 = 4096;

/// Listen backlog the bundled server asks for; the kernel caps it at
/// `somaxconn`. A 128 backlog overflowed at 19k connections and cut the
/// accept rate from ~50k/s to ~160/s (KERNEL_FACTS.md, measured).
pub const LISTEN_BACKLOG: i64 = 65_535;

/// Kernel default of `net.ipv4.tcp_max_syn_backlog`: max(128, ehash buckets
/// ÷ 128) (net/ipv4/tcp_ipv4.c `tcp_sk_init`); 2,048 with the 262,144-bucket
/// shared table measured here (KERNEL_FACTS.md).
pub const DEFAULT_TCP_MAX_SYN_BACKLOG: i64 = 2048;

/// Most connections a fleet plans per shard search (the API's bound on
/// `spec.connections`).
const SEARCH_CEILING: i64 = crate::api::MAX_CONNECTIONS;

/// What limits connections per node (and so the node count and cost).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub enum LimitingFactor {
    /// Node memory (user + kernel bytes of all shards) or the pod memory limit.
    Memory,
    /// `net.ipv4.tcp_mem` pressure threshold (pages), when it cannot be raised.
    TcpMem,
    /// File descriptors: the per-shard hard RLIMIT_NOFILE, or `fs.file-max`.
    Nofile,
    /// CPUs: connections per CPU, or whole shards per node.
    Cpu,
    /// `net.netfilter.nf_conntrack_max`, when it cannot be raised.
    Conntrack,
    /// Pods per node (kubelet maxPods).
    Pods,
    /// `shard.maxShards` stops the fleet short of the declared connections.
    MaxShards,
}

impl LimitingFactor {
    /// The camelCase name used in the plan.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitingFactor::Memory => "memory",
            LimitingFactor::TcpMem => "tcpMem",
            LimitingFactor::Nofile => "nofile",
            LimitingFactor::Cpu => "cpu",
            LimitingFactor::Conntrack => "conntrack",
            LimitingFactor::Pods => "pods",
            LimitingFactor::MaxShards => "maxShards",
        }
    }
}

/// Per-connection bytes.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BytesPerConnection {
    /// User-space bytes of the backend per connection.
    pub user: i64,
    /// Kernel bytes per connection on the node: socket slab objects, conntrack
    /// entry if tracked, and the queued-data page share at peak.
    pub kernel: i64,
    /// user + kernel.
    pub total: i64,
}

/// The capacity plan (`status.plan`; printed by `c10m-operator plan`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// Shards (pods, one server process each).
    pub shards: i32,
    /// Declared connections per shard (the fleet's connections spread evenly).
    pub connections_per_shard: i64,
    /// Most declared connections one shard can hold under the model (at headroom).
    pub max_connections_per_shard: i64,
    /// Connections each shard is sized for (its cap, memory and nofile follow
    /// from this): connectionsPerShard rounded up to a step of 1/16 of the
    /// most a shard can hold, so that a small change of spec.connections
    /// changes only the shard count, not the pod template (no restarts).
    pub sized_connections_per_shard: i64,
    /// Per-shard connection cap passed to the server: connectionsPerShard plus headroom.
    pub shard_connection_limit: i64,
    /// Shards placed on one node.
    pub shards_per_node: i32,
    /// Nodes the fleet needs.
    pub nodes: i32,
    /// Connections the plan holds at its headroom (shards × the most per shard).
    pub capacity: i64,
    /// Most connections one node holds under the model, at headroom.
    pub connections_per_node: i64,
    /// Bytes per connection.
    pub bytes_per_connection: BytesPerConnection,
    /// Memory request = limit of each shard's server container, bytes.
    pub memory_limit_bytes: i64,
    /// Whole CPUs per shard (request = limit).
    pub cpus: i32,
    /// Worker threads per shard (one per pinned CPU).
    pub workers: i32,
    /// RLIMIT_NOFILE each shard needs: its connection cap plus its reserve.
    pub nofile: i64,
    /// Listen backlog the shard gets (min of the requested backlog and somaxconn).
    pub listen_backlog: i64,
    /// What limits connections per node.
    pub limiting_factor: LimitingFactor,
    /// Sysctls the plan applies (name → value); only raises over kernel defaults.
    pub sysctls: BTreeMap<String, String>,
    /// Sysctls the plan wants but the sysctl mode cannot apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sysctls_not_applied: Vec<String>,
    /// Node memory the plan assumed, bytes.
    pub node_memory_bytes: i64,
    /// Node CPUs the plan assumed.
    pub node_cpus: i32,
    /// USD per month for a million connections: node price × 730 h ÷ the most
    /// connections one node holds, in millions. Set when a node price is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_million_connections_monthly: Option<f64>,
    /// USD per month of this plan's nodes (nodes × price × 730 h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly_cost: Option<f64>,
}

/// The node one shard runs on, resolved from the spec or the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeFacts {
    /// Memory available to pods, bytes.
    pub memory_bytes: i64,
    /// Whole CPUs available to pods.
    pub cpus: i64,
    /// Most pods the node runs.
    pub pods: i64,
}

/// Kernel defaults of one node, derived from its memory and CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelDefaults {
    /// `net.ipv4.tcp_mem` (min, pressure, max) in pages: pressure = RAM pages ÷ 16,
    /// min = pressure ÷ 4 × 3, max = min × 2 (net/ipv4/tcp.c `tcp_init_mem`; ≈ 4.7 / 6.25 / 9.4 % of RAM).
    pub tcp_mem: [i64; 3],
    /// `fs.file-max` ≈ RAM KiB ÷ 10 (fs/file_table.c `files_maxfiles_init`; KERNEL_FACTS.md).
    pub file_max: i64,
    /// `net.netfilter.nf_conntrack_max` as kube-proxy sets it: max(131072, 32768 × cores), capped at 1,048,576 (KERNEL_FACTS.md).
    pub conntrack_max: i64,
}

impl KernelDefaults {
    /// Defaults for a node with `memory_bytes` of RAM and `cpus` cores.
    pub fn for_node(memory_bytes: i64, cpus: i64) -> Self {
        let pages = memory_bytes / PAGE_BYTES;
        let pressure = (pages / 16).max(128);
        let min = pressure / 4 * 3;
        KernelDefaults {
            tcp_mem: [min, pressure, min * 2],
            file_max: (memory_bytes / 1024 / 10).max(8192),
            conntrack_max: (32_768 * cpus).clamp(131_072, 1_048_576),
        }
    }
}

/// Why no plan could be made. Each message names the spec field to change.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The spec is invalid in a way the schema could not catch.
    #[error("{0}")]
    Invalid(String),
    /// Not even one connection fits one shard on one node.
    #[error("{0}")]
    Infeasible(String),
}

/// Most file descriptors one shard process can get. The bundled server in
/// InitContainer mode holds CAP_SYS_RESOURCE and raises its hard
/// RLIMIT_NOFILE itself, up to `fs.nr_open`, which the init container raises:
/// its ceiling is [`NR_OPEN_MAX`]. Any other server keeps the hard limit of the
/// node's container runtime (`spec.node.nofileHardLimit`, default
/// [`DEFAULT_NOFILE_HARD_LIMIT`]).
pub fn nofile_ceiling(spec: &ConnectionFleetSpec) -> i64 {
    if raises_own_nofile(spec) {
        NR_OPEN_MAX
    } else {
        spec.node
            .as_ref()
            .and_then(|n| n.nofile_hard_limit)
            .unwrap_or(DEFAULT_NOFILE_HARD_LIMIT)
    }
}

/// True when the shard server raises its own hard RLIMIT_NOFILE (the bundled
/// server, given CAP_SYS_RESOURCE in InitContainer mode).
pub fn raises_own_nofile(spec: &ConnectionFleetSpec) -> bool {
    spec.backend.model == BackendModel::Epoll && spec.sysctls.mode == SysctlMode::InitContainer
}

/// Resolved inputs of the model.
#[derive(Clone, Debug)]
struct Inputs {
    connections: i64,
    user: i64,
    kernel_node: i64,
    kernel_pod: i64,
    headroom: i64,
    cpus: i64,
    fd_reserve: i64,
    nofile_hard: i64,
    connections_per_cpu: Option<i64>,
    queued_percent: i64,
    tracked: bool,
    raise_node_sysctls: bool,
    node: NodeFacts,
    defaults: KernelDefaults,
}

impl Inputs {
    /// Connection cap of a shard that declares `n` connections.
    fn cap(&self, n: i64) -> i64 {
        ceil_div(n * 100, 100 - self.headroom)
    }

    /// Pages a shard with cap `l` charges to `tcp_mem` at peak: one per queued socket.
    fn queued_pages(&self, l: i64) -> i64 {
        ceil_div(l * self.queued_percent, 100)
    }

    /// Memory limit of a shard container with cap `l`, rounded up to MiB.
    fn memory_limit(&self, l: i64) -> i64 {
        round_up(
            PROCESS_BASE_BYTES + l * (self.user + self.kernel_pod),
            1 << 20,
        )
    }

    /// Node bytes one shard with cap `l` uses: its container limit plus the
    /// kernel bytes charged outside its cgroup.
    fn node_bytes_per_shard(&self, l: i64) -> i64 {
        self.memory_limit(l) + l * (self.kernel_node - self.kernel_pod)
    }

    /// Constraints violated by `s` shards per node of `n` declared connections
    /// each, in the order they are reported as the limiting factor. With
    /// `sysctls`, raisable node limits are checked against those values.
    fn violations(
        &self,
        n: i64,
        s: i64,
        sysctls: Option<&BTreeMap<String, String>>,
    ) -> Vec<LimitingFactor> {
        let l = self.cap(n);
        let mut v = Vec::new();
        let (pressure, conntrack_max, file_max, nr_open) = self.node_limits(sysctls);
        // i128: s × bytes can pass i64 for absurd inputs during the search.
        if (s as i128) * (self.node_bytes_per_shard(l) as i128) > self.node.memory_bytes as i128 {
            v.push(LimitingFactor::Memory);
        }
        if let Some(p) = pressure
            && s * self.queued_pages(l) > p
        {
            v.push(LimitingFactor::TcpMem);
        }
        let nofile = l + self.fd_reserve;
        if nofile > self.nofile_hard || nofile > nr_open || file_max.is_some_and(|f| s * nofile > f)
        {
            v.push(LimitingFactor::Nofile);
        }
        if self.connections_per_cpu.is_some_and(|c| l > c * self.cpus)
            || s * self.cpus > self.node.cpus
        {
            v.push(LimitingFactor::Cpu);
        }
        if self.tracked
            && let Some(c) = conntrack_max
            && s * l > c
        {
            v.push(LimitingFactor::Conntrack);
        }
        if s > self.node.pods {
            v.push(LimitingFactor::Pods);
        }
        v
    }

    /// Node-wide limits to check: (tcp_mem pressure, conntrack max, file-max,
    /// nr_open). A `None` limit is raised by the plan to fit and not checked
    /// while planning; with the plan's `sysctls` every limit is checked.
    fn node_limits(
        &self,
        sysctls: Option<&BTreeMap<String, String>>,
    ) -> (Option<i64>, Option<i64>, Option<i64>, i64) {
        let get = |name: &str, idx: usize, default: i64| -> i64 {
            sysctls
                .and_then(|m| m.get(name))
                .and_then(|v| v.split_whitespace().nth(idx))
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let d = &self.defaults;
        match sysctls {
            Some(_) => (
                Some(get("net.ipv4.tcp_mem", 1, d.tcp_mem[1])),
                Some(get("net.netfilter.nf_conntrack_max", 0, d.conntrack_max)),
                Some(get("fs.file-max", 0, d.file_max)),
                get("fs.nr_open", 0, DEFAULT_NR_OPEN),
            ),
            None if self.raise_node_sysctls => (None, None, None, i64::MAX),
            None => (
                Some(d.tcp_mem[1]),
                Some(d.conntrack_max),
                Some(d.file_max),
                DEFAULT_NR_OPEN,
            ),
        }
    }

    /// Most declared connections per shard with `s` shards per node (0 if none fit).
    fn max_per_shard(&self, s: i64) -> i64 {
        let (mut lo, mut hi) = (0i64, SEARCH_CEILING);
        while lo < hi {
            let mid = lo + (hi - lo + 1) / 2;
            if self.violations(mid, s, None).is_empty() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

fn round_up(a: i64, unit: i64) -> i64 {
    ceil_div(a, unit) * unit
}

/// User-space bytes per connection of the spec's backend model (or its override).
pub fn user_bytes(spec: &ConnectionFleetSpec) -> Result<i64, PlanError> {
    match (spec.backend.model, spec.backend.user_bytes_per_connection) {
        (_, Some(b)) if b >= 0 => Ok(b),
        (_, Some(b)) => Err(PlanError::Invalid(format!(
            "spec.backend.userBytesPerConnection must be >= 0, got {b}"
        ))),
        (BackendModel::Epoll, None) => Ok(EPOLL_USER_BYTES),
        (BackendModel::Goroutine, None) => Ok(GOROUTINE_USER_BYTES),
        (BackendModel::Custom, None) => Err(PlanError::Invalid(
            "spec.backend.userBytesPerConnection is required when spec.backend.model is custom"
                .into(),
        )),
    }
}

/// Parses `spec.node.pricePerHour` (USD, decimal string).
pub fn price_per_hour(spec: &ConnectionFleetSpec) -> Result<Option<f64>, PlanError> {
    let Some(raw) = spec.node.as_ref().and_then(|n| n.price_per_hour.as_deref()) else {
        return Ok(None);
    };
    // The schema's pattern: digits with an optional fraction (no sign, no exponent).
    let (int, frac) = raw.split_once('.').unwrap_or((raw, "0"));
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    match raw.parse::<f64>() {
        Ok(p) if digits(int) && digits(frac) && int.len() <= 9 && p.is_finite() => Ok(Some(p)),
        _ => Err(PlanError::Invalid(format!(
            "spec.node.pricePerHour must be a non-negative decimal such as \"2.59\", got {raw:?}"
        ))),
    }
}

/// Checks what the schema cannot (or what a cluster without the schema's
/// validation lets through). Each message names the field.
pub fn validate(spec: &ConnectionFleetSpec) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::Invalid(m));
    if !(1..=crate::api::MAX_CONNECTIONS).contains(&spec.connections) {
        return bad(format!(
            "spec.connections must be 1..=10000000000, got {}",
            spec.connections
        ));
    }
    user_bytes(spec)?;
    price_per_hour(spec)?;
    let sh = &spec.shard;
    if sh.cpus < 1 {
        return bad(format!("spec.shard.cpus must be >= 1, got {}", sh.cpus));
    }
    if !(0..=90).contains(&sh.headroom_percent) {
        return bad(format!(
            "spec.shard.headroomPercent must be 0..=90, got {}",
            sh.headroom_percent
        ));
    }
    if sh.min_shards < 1 || sh.max_shards < sh.min_shards {
        return bad(format!(
            "spec.shard.maxShards ({}) must be >= spec.shard.minShards ({}) >= 1",
            sh.max_shards, sh.min_shards
        ));
    }
    if !(0..=100).contains(&spec.backend.queued_percent) {
        return bad(format!(
            "spec.backend.queuedPercent must be 0..=100, got {}",
            spec.backend.queued_percent
        ));
    }
    for (field, port) in [
        ("port", spec.server.port),
        ("metricsPort", spec.server.metrics_port),
    ] {
        if !(1..=65535).contains(&port) {
            return bad(format!("spec.server.{field} must be 1..=65535, got {port}"));
        }
    }
    if let Some(k) = spec.node.as_ref().and_then(|n| n.kernel_bytes_per_socket)
        && k < 0
    {
        return bad(format!(
            "spec.node.kernelBytesPerSocket must be >= 0, got {k}"
        ));
    }
    if spec.server.port == spec.server.metrics_port {
        return bad(format!(
            "spec.server.metricsPort must differ from spec.server.port ({})",
            spec.server.port
        ));
    }
    for name in &spec.sysctls.allowed_unsafe {
        if crate::sysctl::scope(name) != Some(crate::sysctl::Scope::Namespaced) {
            return bad(format!(
                "spec.sysctls.allowedUnsafe: {name:?} is not a namespaced sysctl the plan uses; node-level sysctls cannot be set through a pod securityContext"
            ));
        }
    }
    Ok(())
}

/// Computes the plan for `spec` on nodes like `node`.
///
/// Errors: [`PlanError::Invalid`] for a spec the schema should have refused,
/// [`PlanError::Infeasible`] when not one connection fits a shard on a node
/// (shard.cpus above node CPUs, or node memory below one shard's base).
pub fn plan(spec: &ConnectionFleetSpec, node: NodeFacts) -> Result<Plan, PlanError> {
    validate(spec)?;
    let inputs = Inputs::new(spec, node)?;
    let cpus = inputs.cpus;
    let tracked = inputs.tracked;

    if cpus > node.cpus {
        return Err(PlanError::Infeasible(format!(
            "spec.shard.cpus ({cpus}) exceeds the CPUs of one node ({})",
            node.cpus
        )));
    }
    // Fill each node's CPUs (and pod slots) with shards; fewer per node only
    // when memory cannot hold that many shards' base.
    let slots = (node.cpus / cpus).min(node.pods);
    let (per_node_shards, per_shard) = (1..=slots)
        .rev()
        .map(|s| (s, inputs.max_per_shard(s)))
        .find(|&(_, n)| n > 0)
        .unwrap_or((0, 0));
    if per_shard == 0 {
        return Err(PlanError::Infeasible(format!(
            "not one connection fits a shard: node memory {} B, per-shard base {} B, {} B per connection; raise spec.node.memory (each shard needs a 64 MiB base plus its connections)",
            node.memory_bytes,
            PROCESS_BASE_BYTES,
            inputs.user + inputs.kernel_node
        )));
    }

    let sh = &spec.shard;
    let needed = ceil_div(inputs.connections, per_shard).max(sh.min_shards as i64);
    let shards = needed.min(sh.max_shards as i64);
    let limiting_factor = if needed > shards {
        LimitingFactor::MaxShards
    } else {
        // Slots bound first when no more shards fit a node; else the per-shard limit.
        *inputs
            .violations(per_shard + 1, per_node_shards, None)
            .first()
            .expect("max_per_shard stops below the search ceiling only when a constraint binds")
    };
    let connections_per_shard = ceil_div(inputs.connections, shards).min(per_shard);
    let sized_connections_per_shard = size_step(connections_per_shard, per_shard);
    let shard_connection_limit = inputs.cap(sized_connections_per_shard);
    let shards_per_node = per_node_shards.min(shards);
    let nodes = ceil_div(shards, shards_per_node);
    let nofile = shard_connection_limit + inputs.fd_reserve;

    let (sysctls, sysctls_not_applied) = crate::sysctl::plan_sysctls(
        spec,
        &inputs.defaults,
        crate::sysctl::NodeLoad {
            connections: shards_per_node * shard_connection_limit,
            queued_pages: shards_per_node * inputs.queued_pages(shard_connection_limit),
            open_files: shards_per_node * nofile,
            nofile,
            tracked,
        },
    );
    let listen_backlog = LISTEN_BACKLOG.min(
        sysctls
            .get("net.core.somaxconn")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_SOMAXCONN),
    );

    let connections_per_node = per_node_shards * per_shard;
    let price = price_per_hour(spec)?;
    let round_cents = |x: f64| (x * 100.0).round() / 100.0;
    let plan = Plan {
        shards: shards as i32,
        connections_per_shard,
        max_connections_per_shard: per_shard,
        sized_connections_per_shard,
        shard_connection_limit,
        shards_per_node: shards_per_node as i32,
        nodes: nodes as i32,
        capacity: shards * sized_connections_per_shard,
        connections_per_node,
        bytes_per_connection: BytesPerConnection {
            user: inputs.user,
            kernel: inputs.kernel_node,
            total: inputs.user + inputs.kernel_node,
        },
        memory_limit_bytes: inputs.memory_limit(shard_connection_limit),
        cpus: cpus as i32,
        workers: cpus as i32,
        nofile,
        listen_backlog,
        limiting_factor,
        sysctls,
        sysctls_not_applied,
        node_memory_bytes: node.memory_bytes,
        node_cpus: node.cpus as i32,
        cost_per_million_connections_monthly: price
            .map(|p| round_cents(p * HOURS_PER_MONTH / (connections_per_node as f64 / 1e6))),
        monthly_cost: price.map(|p| round_cents(nodes as f64 * p * HOURS_PER_MONTH)),
    };
    // Self-check: a plan that breaks one of its own constraints is never returned.
    let violated = check(spec, &plan);
    if !violated.is_empty() {
        return Err(PlanError::Infeasible(format!(
            "internal: plan violates {violated:?}; please report this spec"
        )));
    }
    Ok(plan)
}

/// The `tcp_mem` pressure threshold (pages) the plan's nodes run with: the
/// plan's raised value, else the kernel default for the node.
pub fn tcp_mem_pressure_pages(plan: &Plan) -> i64 {
    plan.sysctls
        .get("net.ipv4.tcp_mem")
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            KernelDefaults::for_node(plan.node_memory_bytes, plan.node_cpus as i64).tcp_mem[1]
        })
}

/// Steps a shard's size is rounded to: 1/16 of the most one shard holds
/// (at most 6.25 % of a full shard's memory left unused by rounding).
pub const SIZE_STEPS: i64 = 16;

/// `n` rounded up to the next step of `max` ÷ [`SIZE_STEPS`], at most `max`.
pub fn size_step(n: i64, max: i64) -> i64 {
    round_up(n, ceil_div(max, SIZE_STEPS).max(1)).min(max)
}

/// Hours in a billing month, as cloud price sheets count them (8,760 h ÷ 12).
pub const HOURS_PER_MONTH: f64 = 730.0;

/// Constraints a finished plan violates on its own nodes, checking raisable
/// limits against the plan's sysctls (empty when the plan is sound). Used by
/// the tests and as a self-check before a plan is applied.
pub fn check(spec: &ConnectionFleetSpec, plan: &Plan) -> Vec<LimitingFactor> {
    let node = NodeFacts {
        memory_bytes: plan.node_memory_bytes,
        cpus: plan.node_cpus as i64,
        pods: i64::MAX,
    };
    let Ok(inputs) = Inputs::new(spec, node) else {
        return vec![];
    };
    inputs.violations(
        plan.sized_connections_per_shard,
        plan.shards_per_node as i64,
        Some(&plan.sysctls),
    )
}

impl Inputs {
    /// Resolves the model's inputs from the spec (model defaults for unset fields).
    fn new(spec: &ConnectionFleetSpec, node: NodeFacts) -> Result<Inputs, PlanError> {
        let node_profile = spec.node.clone().unwrap_or_default();
        let tracked = node_profile.conntrack.unwrap_or(true);
        let kernel_socket = node_profile
            .kernel_bytes_per_socket
            .unwrap_or(KERNEL_BYTES_PER_SOCKET);
        let queued_bytes = ceil_div(spec.backend.queued_percent as i64 * PAGE_BYTES, 100);
        let cpus = spec.shard.cpus as i64;
        Ok(Inputs {
            connections: spec.connections,
            user: user_bytes(spec)?,
            kernel_node: kernel_socket + if tracked { CONNTRACK_BYTES } else { 0 } + queued_bytes,
            kernel_pod: kernel_socket.min(CGROUP_KERNEL_BYTES_PER_SOCKET) + queued_bytes,
            headroom: spec.shard.headroom_percent as i64,
            cpus,
            fd_reserve: fd_reserve(cpus),
            nofile_hard: nofile_ceiling(spec),
            connections_per_cpu: spec.backend.connections_per_cpu,
            queued_percent: spec.backend.queued_percent as i64,
            tracked,
            raise_node_sysctls: spec.sysctls.mode == SysctlMode::InitContainer,
            node,
            defaults: KernelDefaults::for_node(node.memory_bytes, node.cpus),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysctl;
    use proptest::prelude::*;

    const NODE: NodeFacts = NodeFacts {
        memory_bytes: 256 << 30,
        cpus: 64,
        pods: 110,
    };

    fn spec(v: serde_json::Value) -> ConnectionFleetSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn epoll_10m_on_64_cpu_256_gib_is_memory_bound() {
        let s =
            spec(serde_json::json!({"connections": 10_000_000, "node": {"pricePerHour": "2.59"}}));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Memory);
        assert_eq!(p.bytes_per_connection.user, EPOLL_USER_BYTES);
        // 3965 socket + 256 conntrack + 10 % × 4096 queued page share.
        assert_eq!(p.bytes_per_connection.kernel, 3965 + 256 + 410);
        assert_eq!(p.shards_per_node, 2);
        assert_eq!(p.nodes, 1);
        assert_eq!(p.shards as i64 * p.connections_per_shard, 10_000_000);
        assert_eq!(p.connections_per_shard, 5_000_000);
        let step = ceil_div(p.max_connections_per_shard, SIZE_STEPS);
        assert_eq!(
            p.sized_connections_per_shard,
            ceil_div(5_000_000, step) * step
        );
        assert_eq!(
            p.shard_connection_limit,
            ceil_div(p.sized_connections_per_shard * 100, 80)
        );
        assert_eq!(p.nofile, p.shard_connection_limit + fd_reserve(8));
        assert_eq!(p.sysctls["fs.nr_open"], p.nofile.to_string());
        assert_eq!(p.sysctls["net.core.somaxconn"], "65535");
        assert_eq!(p.monthly_cost, Some(1890.70));
        // Node capacity at 80 % of 256 GiB ÷ 4,695 B ≈ 46.8M connections.
        let expect = (256u64 << 30) as f64 * 0.8 / 4695.0;
        assert!(
            (p.connections_per_node as f64 - expect).abs() / expect < 0.01,
            "{}",
            p.connections_per_node
        );
    }

    #[test]
    fn small_changes_of_connections_keep_the_pod_template() {
        let at = |c: i64| {
            plan(
                &spec(serde_json::json!({"connections": c, "shard": {"minShards": 3}})),
                NODE,
            )
            .unwrap()
        };
        let (a, b) = (at(1_000_000), at(1_100_000));
        assert_eq!(a.shards, b.shards);
        assert_ne!(a.connections_per_shard, b.connections_per_shard);
        assert_eq!(
            (a.shard_connection_limit, a.memory_limit_bytes, a.nofile),
            (b.shard_connection_limit, b.memory_limit_bytes, b.nofile)
        );
        // A larger step does resize the shards.
        assert!(at(3_000_000).memory_limit_bytes > a.memory_limit_bytes);
    }

    #[test]
    fn goroutine_is_bounded_by_the_runtime_nofile_limit() {
        let s =
            spec(serde_json::json!({"connections": 10_000_000, "backend": {"model": "goroutine"}}));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Nofile);
        assert!(p.nofile <= DEFAULT_NOFILE_HARD_LIMIT);
        assert_eq!(p.shards_per_node, 8);
        assert_eq!(p.nodes, 3);
        assert!(!p.sysctls.contains_key("fs.nr_open"));
    }

    #[test]
    fn custom_needs_user_bytes() {
        let s = spec(serde_json::json!({"connections": 10, "backend": {"model": "custom"}}));
        let err = plan(&s, NODE).unwrap_err().to_string();
        assert!(err.contains("spec.backend.userBytesPerConnection"), "{err}");
        let s = spec(
            serde_json::json!({"connections": 10, "backend": {"model": "custom", "userBytesPerConnection": 1000}}),
        );
        assert_eq!(plan(&s, NODE).unwrap().bytes_per_connection.user, 1000);
    }

    #[test]
    fn max_shards_caps_and_reports() {
        let s = spec(
            serde_json::json!({"connections": 10_000_000, "backend": {"model": "goroutine"}, "shard": {"maxShards": 4}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        assert_eq!(p.shards, 4);
        assert!(p.capacity < 10_000_000);
    }

    #[test]
    fn pod_security_context_mode_keeps_node_defaults_and_reports_unsafe() {
        let s = spec(
            serde_json::json!({"connections": 2_000_000, "sysctls": {"mode": "PodSecurityContext"}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert!(p.sysctls.is_empty(), "{:?}", p.sysctls);
        assert_eq!(
            p.sysctls_not_applied,
            vec![
                "net.core.somaxconn",
                "net.ipv4.tcp_max_syn_backlog",
                "net.ipv4.tcp_migrate_req"
            ]
        );
        assert_eq!(p.listen_backlog, DEFAULT_SOMAXCONN);
        // Without raising sysctls, the default conntrack table (1,048,576) binds.
        assert_eq!(p.limiting_factor, LimitingFactor::Conntrack);
        let s = spec(
            serde_json::json!({"connections": 2_000_000, "sysctls": {"mode": "PodSecurityContext", "allowedUnsafe": ["net.core.somaxconn"]}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(
            p.sysctls.get("net.core.somaxconn").map(String::as_str),
            Some("65535")
        );
        assert_eq!(p.listen_backlog, LISTEN_BACKLOG);
        let s = spec(
            serde_json::json!({"connections": 1, "sysctls": {"mode": "PodSecurityContext", "allowedUnsafe": ["net.ipv4.tcp_mem"]}}),
        );
        assert!(
            plan(&s, NODE)
                .unwrap_err()
                .to_string()
                .contains("spec.sysctls.allowedUnsafe")
        );
    }

    #[test]
    fn tcp_mem_binds_when_it_cannot_be_raised() {
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"queuedPercent": 100},
            "node": {"conntrack": false}, "sysctls": {"mode": "None"}}),
        );
        let small = NodeFacts {
            memory_bytes: 8 << 30,
            cpus: 64,
            pods: 110,
        };
        let p = plan(&s, small).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::TcpMem);
        // Raised instead in InitContainer mode.
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"queuedPercent": 100}, "node": {"conntrack": false}}),
        );
        let p = plan(&s, small).unwrap();
        assert!(p.sysctls.contains_key("net.ipv4.tcp_mem"));
        assert_ne!(p.limiting_factor, LimitingFactor::TcpMem);
    }

    #[test]
    fn cpu_binds_with_a_per_cpu_rate() {
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"connectionsPerCpu": 10000}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Cpu);
        assert!(p.shard_connection_limit <= 80_000);
    }

    #[test]
    fn infeasible_shard_is_an_error_naming_the_field() {
        let s = spec(serde_json::json!({"connections": 10, "shard": {"cpus": 128}}));
        assert!(
            plan(&s, NODE)
                .unwrap_err()
                .to_string()
                .contains("spec.shard.cpus")
        );
    }

    fn arb_spec() -> impl Strategy<Value = (ConnectionFleetSpec, NodeFacts)> {
        (
            1i64..=2_000_000_000,
            prop_oneof![Just("epoll"), Just("goroutine"), Just("custom")],
            0i64..=200_000,
            0i32..=100,
            prop_oneof![Just(1), Just(2), Just(4), Just(8), Just(16)],
            0i32..=90,
            prop_oneof![Just("InitContainer"), Just("PodSecurityContext"), Just("None")],
            any::<bool>(),
            (1i64..=1024, 4i64..=1024, 1i32..=200),
        )
            .prop_map(|(c, model, user, queued, cpus, headroom, mode, tracked, (gib, ncpu, min_shards))| {
                let s = spec(serde_json::json!({
                    "connections": c,
                    "backend": {"model": model, "userBytesPerConnection": user, "queuedPercent": queued},
                    "node": {"conntrack": tracked},
                    "shard": {"cpus": cpus, "headroomPercent": headroom, "minShards": min_shards, "maxShards": 100000},
                    "sysctls": {"mode": mode},
                }));
                (s, NodeFacts { memory_bytes: gib << 30, cpus: ncpu.max(cpus as i64), pods: 110 })
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn every_constraint_holds_and_sysctls_only_raise((s, node) in arb_spec()) {
            let Ok(p) = plan(&s, node) else { return Ok(()); };
            prop_assert!(check(&s, &p).is_empty(), "violations {:?}", check(&s, &p));
            prop_assert!(p.shards as i64 * p.connections_per_shard >= s.connections.min(p.capacity));
            prop_assert!(p.shards >= s.shard.min_shards);
            prop_assert!(p.shards_per_node as i64 * p.cpus as i64 <= node.cpus);
            prop_assert!(p.nofile <= nofile_ceiling(&s));
            let defaults = KernelDefaults::for_node(node.memory_bytes, node.cpus);
            for (name, value) in &p.sysctls {
                let d = sysctl::default_value(name, &defaults).unwrap();
                prop_assert!(sysctl::is_raise(value, &d), "{name}={value} does not raise {d}");
            }
            // Headroom: at the declared load each shard uses at most (100 − h) % of its cap.
            prop_assert!(p.connections_per_shard * 100 <= p.shard_connection_limit * (100 - s.shard.headroom_percent as i64));
        }

        #[test]
        fn limiting_factor_is_the_one_that_binds((s, node) in arb_spec()) {
            let Ok(p) = plan(&s, node) else { return Ok(()); };
            if p.limiting_factor == LimitingFactor::MaxShards { return Ok(()); }
            // One more connection per shard at the node's full packing breaks the named limit.
            let inputs = Inputs::new(&s, node).unwrap();
            let per_shard = p.max_connections_per_shard;
            let v = inputs.violations(per_shard + 1, p.connections_per_node / per_shard, None);
            prop_assert_eq!(v.first().copied(), Some(p.limiting_factor));
        }

        #[test]
        fn shards_never_decrease_as_connections_grow((s, node) in arb_spec(), extra in 0i64..1_000_000_000) {
            let Ok(a) = plan(&s, node) else { return Ok(()); };
            let mut bigger = s.clone();
            bigger.connections = (s.connections + extra).min(crate::api::MAX_CONNECTIONS);
            let b = plan(&bigger, node).unwrap();
            prop_assert!(b.shards >= a.shards);
            prop_assert!(b.nodes >= a.nodes);
        }

        #[test]
        fn shards_never_decrease_as_bytes_grow((s, node) in arb_spec(), extra in 0i64..100_000) {
            let Ok(a) = plan(&s, node) else { return Ok(()); };
            let mut heavier = s.clone();
            heavier.backend.user_bytes_per_connection = Some(a.bytes_per_connection.user + extra);
            let Ok(b) = plan(&heavier, node) else { return Ok(()); };
            prop_assert!(b.shards >= a.shards, "{} < {}", b.shards, a.shards);
        }
    }
}
