//! What the operator writes to `status`: conditions, shard counts, the
//! capacity plan (`status.plan`, also printed by `c10m-operator plan`) and
//! the metrics loop's state. Data only: the plan is computed in
//! [`crate::plan`], the status derived in [`crate::status`].

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::sysctl::{Sysctl, Sysctls};

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
    /// Sysctls the plan applies (name → value); only raises over kernel
    /// defaults. Absent when the plan applies none.
    // Omitted when empty, never `{}`: server-side apply turns an empty map
    // that replaces a non-empty one into null, which the schema refuses, so
    // the status write of a fleet switched to a mode that applies none
    // (e.g. PodSecurityContext with only unsafe sysctls wanted) failed.
    #[serde(default, skip_serializing_if = "Sysctls::is_empty")]
    pub sysctls: Sysctls,
    /// Sysctls the plan wants but the sysctl mode cannot apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sysctls_not_applied: Vec<Sysctl>,
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

/// Observed state of a fleet, written only through the status subresource.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionFleetStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Ready, Progressing, Degraded and SysctlsApplied, in the standard
    /// Kubernetes condition shape.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,

    /// The capacity plan for the current spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,

    /// Shards the fleet should run.
    #[serde(default)]
    pub desired_shards: i32,

    /// Shards whose pods are ready.
    #[serde(default)]
    pub ready_shards: i32,

    /// Shards running the current pod template.
    #[serde(default)]
    pub updated_shards: i32,

    /// Connections the shards hold now (from metrics; 0 until metrics are read).
    #[serde(default)]
    pub live_connections: i64,

    /// The autoscaler's last decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,

    /// The rebalancer's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceStatus>,
}

/// What the autoscaler decided and why.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// Shards the autoscaler wants (bounded by the declared floor and shard.maxShards).
    pub desired_shards: i32,
    /// Why, in words (e.g. "live 1,200,000 > 80 % of 4 × 375,000").
    pub reason: String,
    /// When the shard count last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
}

/// Rebalancer state.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RebalanceStatus {
    /// Hottest shard's load over the mean, in percent (100 = balanced).
    pub max_to_mean_percent: i32,
    /// Connections shards were told to shed so far.
    pub shed_ordered: i64,
    /// When shards were last told to shed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_order_time: Option<Time>,
}
