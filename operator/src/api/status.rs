//! What the operator writes to `status`: conditions, shard counts, the
//! capacity plan (`status.plan`, also printed by `c10m-operator plan`) and
//! the metrics loop's state. Data only: the plan is computed in
//! [`crate::plan`], the status derived in [`crate::status`].

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::sysctl::{Sysctl, Sysctls, lenient_sysctl_names, lenient_sysctls};
use super::{CgroupMode, FailureDomain};

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
    /// `fs.epoll.max_user_watches`: epoll watches per uid on the node, when
    /// it cannot be raised.
    MaxUserWatches,
    /// `spec.availability.failureDomain`: the fleet runs on more nodes than
    /// its connections need, so that the survivors of the domain's loss
    /// hold them all (spare shards on the nodes the connections need
    /// anyway leave the per-node limit named).
    FailureDomain,
    /// `spec.availability.refillBudgetSeconds`: the fleet runs on more
    /// nodes than its connections need, so that the survivors re-accept a
    /// lost domain's connections within the budget.
    Refill,
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
            LimitingFactor::MaxUserWatches => "maxUserWatches",
            LimitingFactor::FailureDomain => "failureDomain",
            LimitingFactor::Refill => "refill",
            LimitingFactor::MaxShards => "maxShards",
        }
    }
}

/// Per-connection bytes.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Shards on one node when the fleet's shards spread evenly over
    /// `nodes` (the pods' topology spread). Node-level sysctls hold the
    /// most the scheduler could pack on a node
    /// (`connectionsPerNode` ÷ `maxConnectionsPerShard`).
    pub shards_per_node: i32,
    /// Nodes the fleet needs.
    pub nodes: i32,
    /// Connections the plan holds at its headroom (shards × the most per shard).
    pub capacity: i64,
    /// Most connections one node holds under the model, at headroom.
    pub connections_per_node: i64,
    /// Bytes per connection.
    pub bytes_per_connection: BytesPerConnection,
    /// Memory request = limit of each shard's server container, bytes: the
    /// process allowance, the connection cap × `podBytesPerConnection`,
    /// the queued-data pages charged to the pod (cgroup v2), and the slow
    /// readers' `slowReaderBytes` (their kernel part in cgroup v2 only).
    pub memory_limit_bytes: i64,
    /// The nodes' cgroup version the charges follow (`spec.node.cgroupMode`,
    /// or the nodes' `c10m.dev/cgroup-mode` label in a cluster).
    #[serde(default)]
    pub cgroup_mode: CgroupMode,
    /// Bytes one idle connection charges to the pod's memory cgroup: user
    /// space, and the kernel objects the cgroup mode charges to the pod.
    #[serde(default)]
    pub pod_bytes_per_connection: BytesPerConnection,
    /// Bytes of each shard's memory limit beyond its connections: the
    /// process base, the fd table for `nofile` descriptors, and the
    /// per-worker budget for unfinished input.
    #[serde(default)]
    pub process_bytes: i64,
    /// Slow readers one shard is sized for at its connection cap
    /// (`spec.backend.slowReaderPercent` of `shardConnectionLimit`).
    #[serde(default)]
    pub slow_readers_per_shard: i64,
    /// Most bytes one slow reader pins beyond an idle connection: kernel
    /// socket buffers up to the plan's `tcp_rmem` + `tcp_wmem` maxima, and
    /// the server's unsent tail in user space.
    #[serde(default)]
    pub slow_reader_bytes: BytesPerConnection,
    /// Whole CPUs per shard (request = limit).
    pub cpus: i32,
    /// Worker threads per shard (one per pinned CPU).
    pub workers: i32,
    /// RLIMIT_NOFILE each shard needs: its connection cap plus its reserve.
    pub nofile: i64,
    /// Hard RLIMIT_NOFILE a container inherits on the plan's nodes, in
    /// descriptors: the smaller of `spec.node.nofileHardLimit` and the
    /// nodes' `c10m.dev/nofile-hard-limit` label, else 524,288
    /// (containerd 2.x). Binds `nofile` unless `serverRaisesNofile`.
    #[serde(default)]
    pub node_nofile_hard_limit: i64,
    /// The bundled server starts with CAP_SYS_RESOURCE, raises its hard
    /// RLIMIT_NOFILE to `nofile`, then drops to uid/gid 65532 with no
    /// capabilities before it serves (InitContainer mode, on nodes that can
    /// grant the capability). false: `nofile` fits `nodeNofileHardLimit`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub server_raises_nofile: bool,
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
    #[serde(
        default,
        skip_serializing_if = "Sysctls::is_empty",
        deserialize_with = "lenient_sysctls"
    )]
    pub sysctls: Sysctls,
    /// Sysctls the plan wants but the sysctl mode cannot apply.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "lenient_sysctl_names"
    )]
    pub sysctls_not_applied: Vec<Sysctl>,
    /// Node-level sysctls the operator's policy caps below what the fleet
    /// would otherwise raise them to (name → the policy's ceiling; for
    /// tcp_mem in pages): the ceiling limits connections per node.
    #[serde(
        default,
        skip_serializing_if = "Sysctls::is_empty",
        deserialize_with = "lenient_sysctls"
    )]
    pub sysctls_capped: Sysctls,
    /// Connections per second one departing shard closes
    /// (`C10M_DRAIN_RATE`): spec.drain.rate, at most
    /// spec.rollout.maxReconnectRate, so one draining shard alone never
    /// exceeds the fleet's budget. 0 in statuses written before it existed.
    #[serde(default)]
    pub drain_rate: i64,
    /// Seconds a departing shard needs to close its connection cap at
    /// `drainRate`.
    #[serde(default)]
    pub drain_seconds: i64,
    /// Shards a rollout replaces at once: the Deployment's `maxSurge`
    /// (with `maxUnavailable: 0`), so that many updated shards are Ready
    /// before as many old ones drain. spec.rollout.maxReconnectRate ÷
    /// `drainRate`, at least 1, at most `shards`.
    #[serde(default)]
    pub rollout_surge: i32,
    /// Seconds between a rollout's steps when nothing is known of what the
    /// old shards hold: the Deployment's `minReadySeconds` outside a
    /// rollout, so even with no operator running a step's old shards have
    /// drained their cap at `drainRate` (and their accept window ended)
    /// before the next step's drain starts; the bound of
    /// status.rollout.stepSeconds. `drainSeconds` plus the accept window.
    #[serde(default)]
    pub rollout_step_seconds: i64,
    /// terminationGracePeriodSeconds of the shards' pods: the drain, the
    /// accept window and slack, at most the operator policy's bound.
    #[serde(default)]
    pub termination_grace_period_seconds: i64,
    /// The policy's bound cut the grace period: a departing shard cannot
    /// close all its connections at spec.drain.rate and closes the rest at
    /// once when its drain times out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain_cut_by_policy: bool,
    /// Node memory the plan assumed, bytes (from where: `nodeSource.memory`).
    pub node_memory_bytes: i64,
    /// Node CPUs the plan assumed (from where: `nodeSource.cpus`).
    pub node_cpus: i32,
    /// Pods per node the plan assumed (from where: `nodeSource.pods`).
    #[serde(default)]
    pub node_pods: i32,
    /// Where `nodeMemoryBytes`, `nodeCpus` and `nodePods` came from. In a
    /// cluster each is the allocatable of the smallest node matching
    /// `spec.placement.nodeSelector`, or `spec.node`'s value where that is
    /// smaller; a larger `spec.node` claim is not used. Node-level sysctls
    /// are sized from this node, then cut to the admin policy's ceilings
    /// (`sysctlsCapped` names those cut). Each value is one of: `Cluster`
    /// (the nodes'; `spec.node` does not set it, or sets the same),
    /// `ClusterBelowSpec` (the nodes'; `spec.node` claims more and is not
    /// used), `SpecBelowCluster` (`spec.node`'s, smaller than the nodes'),
    /// `Spec` (`spec.node`'s as given: offline, or no matching node reports
    /// allocatable), `Default` (pods only: kubelet's 110). In a cluster,
    /// `kernelBytesPerSocket` and `conntrack` say whether `spec.node`'s
    /// claims of those were used.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub node_source: Option<NodeSource>,
    /// Where `bytesPerConnection.user` came from: `Calibrated`
    /// (`status.calibration`), `Spec` (`spec.backend.userBytesPerConnection`)
    /// or `Model` (the backend model's figure). The kernel figures' source
    /// is `nodeSource.kernelBytesPerSocket` (absent: the measured model).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub user_bytes_source: Option<FigureSource>,
    /// The failure domain the plan survives (`spec.availability.failureDomain`).
    #[serde(default)]
    pub failure_domain: FailureDomain,
    /// Shards lost with the largest failure domain (0 for `None`).
    #[serde(default)]
    pub failure_domain_shards: i32,
    /// Seconds the surviving shards take to re-accept the connections of
    /// the largest failure domain (one shard for `None`) at the measured
    /// accept rate per worker.
    #[serde(default)]
    pub refill_seconds: i64,
    /// Who chose the shard shape (`cpus`): `Spec` (`spec.shard.cpus`) or
    /// `Planner` (the cheapest per connection).
    #[serde(default)]
    pub shape_source: ShapeSource,
    /// The next-best shard shapes (up to 3), cheapest first, each with its
    /// cost and binding limit. When `shapeSource` is `Spec` and one holds
    /// as much for at least 20 % less, the `Degraded=False` condition's
    /// message says so.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternative_shapes: Vec<Shape>,
    /// USD per month for a million connections: node price × 730 h ÷ the most
    /// connections one node holds, in millions (the price of the nodes'
    /// capacity). Set when a node price is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_million_connections_monthly: Option<f64>,
    /// USD per month for each million declared connections: `monthlyCost` ÷
    /// `spec.connections` in millions (what the fleet really pays, spare
    /// capacity and failure domains included). Set when a node price is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_cost_per_million_connections_monthly: Option<f64>,
    /// USD per month of this plan's nodes (nodes × price × 730 h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly_cost: Option<f64>,
}

/// Who chose a plan's shard shape.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShapeSource {
    /// `spec.shard.cpus`.
    #[default]
    Spec,
    /// The planner, as the cheapest shape per connection.
    Planner,
}

/// One shard shape the planner weighed (`status.plan.alternativeShapes`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    /// Whole CPUs per shard.
    pub cpus: i32,
    /// Shards of the fleet with this shape.
    pub shards: i32,
    /// Shards on one node.
    pub shards_per_node: i32,
    /// Nodes the fleet needs.
    pub nodes: i32,
    /// Connections the fleet holds with this shape (below
    /// `spec.connections` only when `maxShards` stops it).
    pub capacity: i64,
    /// Most connections one node holds, at headroom.
    pub connections_per_node: i64,
    /// What binds this shape.
    pub limiting_factor: LimitingFactor,
    /// As `status.plan.costPerMillionConnectionsMonthly`, for this shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_million_connections_monthly: Option<f64>,
    /// As `status.plan.monthlyCost`, for this shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly_cost: Option<f64>,
}

/// Where each size of the plan's node profile came from
/// (`status.plan.nodeSource`), and, in a cluster, whether `spec.node`'s
/// per-connection kernel claims were used.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSource {
    /// Where `nodeMemoryBytes` came from (`spec.node.memory`, node allocatable `memory`).
    pub memory: NodeValueSource,
    /// Where `nodeCpus` came from (`spec.node.cpus`, node allocatable `cpu`).
    pub cpus: NodeValueSource,
    /// Where `nodePods` came from (`spec.node.pods`, node allocatable `pods`).
    pub pods: NodeValueSource,
    /// In a cluster, whether `spec.node.kernelBytesPerSocket` was used
    /// (absent: not set, or offline, where it is used as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_bytes_per_socket: Option<ClaimSource>,
    /// In a cluster, whether `spec.node.conntrack` was used (absent: not
    /// set, or offline, where it is used as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<ClaimSource>,
}

/// Whether a plan in a cluster used this per-connection kernel claim of
/// `spec.node` (absent: not claimed, or offline, where it is used as
/// given): `Spec` (used: `kernelBytesPerSocket` at least the measured
/// 3,965 B; `conntrack: true`, or `false` under a policy saying the nodes
/// track no connections), `SpecNotTrusted` (not used: it would make a
/// connection cheaper than the operator can check, and so pack more
/// connections on a node, and raise its limits less, than they need; the
/// plan counts the measured default).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimSource {
    /// `spec.node`'s value: `kernelBytesPerSocket` at least the measured
    /// 3,965 B, `conntrack: true`, or `conntrack: false` where the policy
    /// says the cluster's nodes track no connections (`conntrack: false`).
    Spec,
    /// Not used: `kernelBytesPerSocket` below the measured 3,965 B, or
    /// `conntrack: false` where the policy says nodes track connections
    /// (its default); the plan counts the measured default instead.
    SpecNotTrusted,
}

impl ClaimSource {
    /// The name used in the plan.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimSource::Spec => "Spec",
            ClaimSource::SpecNotTrusted => "SpecNotTrusted",
        }
    }
}

/// Where one size of the plan's node profile came from. `spec.node` can
/// only make a size smaller than the cluster's nodes, never larger.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeValueSource {
    /// The allocatable of the smallest node matching
    /// `spec.placement.nodeSelector`; `spec.node` does not set it, or sets
    /// the same.
    Cluster,
    /// The nodes' allocatable: `spec.node` claims more than the nodes have,
    /// and the claim is not used.
    ClusterBelowSpec,
    /// `spec.node`'s value, smaller than the nodes' allocatable.
    SpecBelowCluster,
    /// `spec.node`'s value as given: no node to compare it with (offline
    /// planning, or no node matching `spec.placement.nodeSelector` reports
    /// allocatable).
    Spec,
    /// Neither says: kubelet's default `maxPods`, 110 (pods only).
    Default,
}

impl NodeValueSource {
    /// The name used in the plan.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeValueSource::Cluster => "Cluster",
            NodeValueSource::ClusterBelowSpec => "ClusterBelowSpec",
            NodeValueSource::SpecBelowCluster => "SpecBelowCluster",
            NodeValueSource::Spec => "Spec",
            NodeValueSource::Default => "Default",
        }
    }
}

/// A derived status field read leniently: a value this operator cannot
/// read (written by another version of it, e.g. a sysctl it does not know
/// after a rollback, or by hand through the status subresource) reads as
/// absent, and the next reconcile derives and writes it again. One fleet's
/// status must never fail the list of every fleet (the watch, and the
/// start-up check, read them all at once).
fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).ok())
}

/// [`lenient`] per item: the conditions this operator can read.
fn lenient_items<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let items = Option::<Vec<serde_json::Value>>::deserialize(d)?.unwrap_or_default();
    Ok(items
        .into_iter()
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect())
}

/// Where a per-connection figure of the plan came from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FigureSource {
    /// Measured on the cluster (`status.calibration`).
    Calibrated,
    /// Given in the spec.
    Spec,
    /// The backend model's figure (docs/capacity-model.md).
    Model,
}

/// Bytes one connection (or one slow reader) costs a shard pod, as
/// calibrated: least-squares slopes over the probe's samples, rounded.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CalibratedBytes {
    /// Anonymous memory (v1 `memory.stat` `total_rss`, v2 `anon`).
    pub user: i64,
    /// Kernel memory charged to the pod (v1 kmem [+ kmem.tcp], v2
    /// `kernel` + `sock`).
    pub kernel: i64,
    /// The pod's memory (v1 `usage_in_bytes` [+ kmem.tcp], v2
    /// `memory.current`).
    pub pod: i64,
}

/// The last successful calibration of the fleet's image
/// (`spec.backend.calibrate`; docs/capacity-model.md#calibration).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CalibrationStatus {
    /// `spec.server.image` as the fleet named it when measured.
    pub image: String,
    /// The image the node ran (`containerStatuses[].imageID`, a digest).
    pub image_id: String,
    /// `spec.backend.model` when measured.
    pub model: super::BackendModel,
    /// `spec.backend.protocol` when measured.
    pub protocol: super::Protocol,
    /// `spec.backend.calibrate` when measured.
    pub requested: super::Calibrate,
    /// The node the shard ran on.
    pub node: String,
    /// The node's cgroup version (`v1`, `v2`) and whether sockets were
    /// charged to the pod (v1 only with kmem.tcp accounting).
    pub cgroup_mode: String,
    /// Sockets' buffers charged to the pod's memory cgroup.
    pub socket_accounted: bool,
    /// Idle connections at the largest step.
    pub connections: i64,
    /// Slow readers after the last step.
    pub slow_readers: i64,
    /// Bytes per idle connection.
    pub per_connection: CalibratedBytes,
    /// Bytes per slow reader (1 MiB sent, nothing read); absent when none
    /// was opened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_slow_reader: Option<CalibratedBytes>,
    /// Per-connection pod bytes from the smallest to the largest step,
    /// percent change (near 0: the figure does not grow with N).
    pub pod_slope_percent: f64,
    /// When it ended.
    pub time: Time,
    /// Seconds from the shard pod's creation to the probe's report.
    pub duration_seconds: i64,
}

/// Observed state of a fleet, written only through the status subresource.
// Its derived parts (conditions, plan, autoscaling, rebalance) are read
// leniently: what cannot be read is dropped, never an error.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionFleetStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Ready, Progressing, Degraded and SysctlsApplied, in the standard
    /// Kubernetes condition shape.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "lenient_items"
    )]
    pub conditions: Vec<Condition>,

    /// The capacity plan for the current spec.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
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
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub autoscaling: Option<AutoscalingStatus>,

    /// The rebalancer's state.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub rebalance: Option<RebalanceStatus>,

    /// The rollout under way (a new pod template replacing the shards
    /// within spec.rollout.maxReconnectRate); absent when every shard runs
    /// the current template.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub rollout: Option<RolloutStatus>,

    /// The last successful calibration (`spec.backend.calibrate`); kept
    /// when a later one fails, which the `Calibrated` condition reports.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient"
    )]
    pub calibration: Option<CalibrationStatus>,
}

/// A rollout's progress, read from the fleet's ReplicaSets and pods.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The Deployment revision being rolled out
    /// (`deployment.kubernetes.io/revision` of its newest ReplicaSet).
    pub revision: i64,
    /// Shards running the new template.
    pub updated_shards: i32,
    /// Old shards not draining yet: they hold their clients until their
    /// step.
    #[serde(default)]
    pub old_shards: i32,
    /// Of `oldShards`, those cordoned (not ready, out of the Service's
    /// endpoints, their held connections kept), so no client lands on
    /// them: all of them once an updated shard is Ready.
    pub cordoned_shards: i32,
    /// Old shards draining: those the last step removed, until
    /// `drainingUntil`, or old pods still terminating, whichever is more.
    pub draining_shards: i32,
    /// Connections per second the draining shards close together
    /// (`drainingShards` × plan.drainRate); at most
    /// spec.rollout.maxReconnectRate.
    pub closes_per_second: i64,
    /// Connections the old shards not yet draining hold, as each reported
    /// when it was cordoned (a cordoned shard takes no new clients, so this
    /// is an upper bound; shards not cordoned yet are not counted).
    #[serde(default)]
    pub connections_on_old_shards: i64,
    /// Connections this rollout moves: the most `connectionsOnOldShards`
    /// has been since the rollout began (all old shards cordoned), which
    /// sizes `shardConnectionLimit`.
    #[serde(default)]
    pub connections_to_move: i64,
    /// The most connections each updated shard admits while the rollout
    /// moves clients (`POST /limit` on its admin endpoint, renewed at each
    /// reconcile, lapsing by itself when no longer renewed), so the moved
    /// clients spread evenly over them: connectionsToMove ÷ plan.shards ×
    /// the midpoint of 100 % and spec.rebalance.maxToMeanPercent, raised
    /// so the updated shards up now can hold every client moved so far.
    /// Absent while nothing is to move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_connection_limit: Option<i64>,
    /// Seconds the next step's shards need to close what they hold at
    /// plan.drainRate (the most any of them held when cordoned, plus half a
    /// second for clients that raced the cordon, rounded up), at most
    /// plan.rolloutStepSeconds (also used while a shard's count is unknown).
    #[serde(default)]
    pub step_seconds: i64,
    /// When the operator last cordoned an old shard: no step starts until
    /// the cordoned shards are out of the Service's endpoints (one failed
    /// readiness probe, plus the dataplane's delay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_cordon_time: Option<Time>,
    /// When the last step's old shards left the fleet (their drain began).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_step_time: Option<Time>,
    /// When the last step's shards will have closed what they held: the
    /// next step starts no earlier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining_until: Option<Time>,
    /// When the last old shard will have drained, at this pace: the end of
    /// the current step's drain (or when it was estimated, with none under
    /// way), plus `stepSeconds` for each step to come. Kept as it was while
    /// the steps, the old shards and their counts stay the same, so it moves
    /// only when the rollout does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_completion_time: Option<Time>,
    /// The Deployment is paused (`kubectl rollout pause`): no new step
    /// starts; the old shards stay cordoned, and shards already draining
    /// finish.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// A change of the fleet's pod template (image, env, resources, a
    /// re-plan) made while a step drains waits until the drain ends, this
    /// time, and no step starts meanwhile: applied mid-drain, the
    /// Deployment controller would at once remove as many cordoned old
    /// shards as the surge, a second drain on top of the one under way
    /// (ADR 0011, "A third revision mid-rollout").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_held_until: Option<Time>,
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

/// A plan as the first release wrote it: only the fields every version
/// writes, each 1 (tests of reading plans from other versions start here).
#[cfg(test)]
pub(crate) fn first_release_plan_json() -> serde_json::Value {
    serde_json::json!({
            "bytesPerConnection": {"kernel": 1, "total": 2, "user": 1},
            "capacity": 1, "connectionsPerNode": 1, "connectionsPerShard": 1, "cpus": 1,
            "limitingFactor": "memory", "listenBacklog": 1, "maxConnectionsPerShard": 1,
            "memoryLimitBytes": 1, "nodeCpus": 1, "nodeMemoryBytes": 1, "nodes": 1,
            "nofile": 1, "shardConnectionLimit": 1, "shards": 1, "shardsPerNode": 1,
            "sizedConnectionsPerShard": 1, "workers": 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ConnectionFleet;
    use crate::api::sysctl::SysctlValue;

    /// A fleet whose status holds what this operator cannot read: a sysctl
    /// from another version, a condition without its time, an autoscaling
    /// state of another shape. Before, `ConnectionFleet` failed to
    /// deserialize, and with it the list of every fleet: the operator
    /// stopped at start-up ("cannot list connectionfleets.c10m.dev").
    #[test]
    fn a_status_from_another_version_reads_without_its_unreadable_parts() {
        let fleet = serde_json::json!({
            "apiVersion": "c10m.dev/v1alpha1",
            "kind": "ConnectionFleet",
            "metadata": {"name": "one", "namespace": "prod"},
            "spec": {"connections": 1000},
            "status": {
                "observedGeneration": 3,
                "readyShards": 2,
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "ShardsReady", "message": "",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"},
                    {"type": "Degraded", "status": "False", "reason": "AsPlanned"}
                ],
                "plan": {"sysctls": {"net.ipv4.tcp_fastopen": "3"}, "shards": 1},
                "autoscaling": {"desiredShards": "many"},
                "rebalance": {"maxToMeanPercent": 120, "shedOrdered": 5}
            }
        });
        let read: ConnectionFleet = serde_json::from_value(fleet).expect("readable");
        let status = read.status.unwrap();
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.ready_shards, 2);
        assert_eq!(status.plan, None, "a plan missing its fields is dropped");
        assert_eq!(status.autoscaling, None);
        assert_eq!(status.rebalance.map(|r| r.shed_ordered), Some(5));
        let types: Vec<&str> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Ready"]);
        // What this operator writes reads back the same.
        let empty: ConnectionFleetStatus = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(empty, ConnectionFleetStatus::default());
    }

    /// A sysctl this operator does not know (added by hand, or planned by
    /// another version) is skipped; the rest of the plan stays, so the next
    /// plan compares equal and nothing is rewritten in a loop.
    #[test]
    fn unknown_sysctls_are_skipped_not_the_plan() {
        let mut plan = first_release_plan_json();
        plan["sysctls"] = serde_json::json!({
            "net.core.somaxconn": "65535",
            "net.ipv4.tcp_fastopen": "3",
            "fs.nr_open": "lots"
        });
        plan["sysctlsNotApplied"] =
            serde_json::json!(["net.ipv4.tcp_migrate_req", "kernel.future"]);
        let read: Plan = serde_json::from_value(plan).unwrap();
        assert_eq!(
            read.sysctls,
            Sysctls::from([(Sysctl::Somaxconn, SysctlValue::One(65535))])
        );
        assert_eq!(read.sysctls_not_applied, [Sysctl::TcpMigrateReq]);
    }

    /// A plan written before `nodePods` and `nodeSource` reads (pods 0, no
    /// source, until the next reconcile writes them); a source this
    /// operator cannot read drops only itself; what it writes reads back.
    #[test]
    fn node_source_is_optional_and_read_leniently() {
        let mut plan = first_release_plan_json();
        plan["nodeCpus"] = 4.into();
        plan["nodeMemoryBytes"] = 8_589_934_592i64.into();
        let old: Plan = serde_json::from_value(plan.clone()).unwrap();
        assert_eq!((old.node_pods, old.node_source), (0, None));
        plan["nodePods"] = 110.into();
        plan["nodeSource"] =
            serde_json::json!({"memory": "FromTheFuture", "cpus": "Cluster", "pods": "Cluster"});
        let odd: Plan = serde_json::from_value(plan.clone()).unwrap();
        assert_eq!((odd.node_pods, odd.node_source), (110, None));
        plan["nodeSource"] = serde_json::json!(
            {"memory": "ClusterBelowSpec", "cpus": "SpecBelowCluster", "pods": "Default"}
        );
        let read: Plan = serde_json::from_value(plan.clone()).unwrap();
        assert_eq!(
            read.node_source,
            Some(NodeSource {
                memory: NodeValueSource::ClusterBelowSpec,
                cpus: NodeValueSource::SpecBelowCluster,
                pods: NodeValueSource::Default,
                kernel_bytes_per_socket: None,
                conntrack: None,
            })
        );
        assert_eq!(
            serde_json::to_value(&read).unwrap()["nodeSource"],
            plan["nodeSource"]
        );
        // In a cluster, the kernel claims' use too.
        plan["nodeSource"] = serde_json::json!(
            {"memory": "Cluster", "cpus": "Cluster", "pods": "Cluster",
             "kernelBytesPerSocket": "SpecNotTrusted", "conntrack": "Spec"}
        );
        let read: Plan = serde_json::from_value(plan.clone()).unwrap();
        let source = read.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (Some(ClaimSource::SpecNotTrusted), Some(ClaimSource::Spec))
        );
        assert_eq!(
            serde_json::to_value(&read).unwrap()["nodeSource"],
            plan["nodeSource"]
        );
    }
}
