//! The `ConnectionFleet` custom resource (`c10m.dev/v1alpha1`): spec, status
//! and the schema the API server validates with (OpenAPI bounds + CEL rules).
//!
//! Users declare connections, never replicas: the shard count is derived state
//! in `status.plan`, so autoscalers and GitOps tools never fight over it.

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::names::SCHEMA_REVISION_ANNOTATION;

pub mod status;
pub mod sysctl;

pub use status::{
    AutoscalingStatus, BytesPerConnection, ConnectionFleetStatus, LimitingFactor, Plan,
    RebalanceStatus, Shape, ShapeSource,
};

/// Most connections one fleet may declare (10^10): beyond any single fleet
/// and still exact in an `f64`, so the model's arithmetic stays exact.
pub const MAX_CONNECTIONS: i64 = 10_000_000_000;

/// Image of the bundled server (and of the `c10m-sysctl` init tool it carries).
pub const DEFAULT_SERVER_IMAGE: &str = "c10m/server:0.1.0";

/// A fleet of SO_REUSEPORT server shards that must hold `spec.connections`
/// concurrent connections. The operator derives shards, resources and
/// sysctls from the capacity model and reports them in `status.plan`.
// Each printcolumn repeats `type_ = ...`, which clippy takes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "c10m.dev",
    version = "v1alpha1",
    kind = "ConnectionFleet",
    plural = "connectionfleets",
    shortname = "cfleet",
    namespaced,
    status = "ConnectionFleetStatus",
    doc = "A fleet of SO_REUSEPORT server shards that must hold spec.connections concurrent connections; the operator plans shards, sysctls and resources and reports them in status.plan.",
    validation = kube::core::Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63").message("metadata.name must be a DNS-1035 label (lower-case letters, digits, '-', starting with a letter) of at most 63 characters: it names the fleet's Service"),
    printcolumn(
        name = "Connections",
        type_ = "integer",
        json_path = ".spec.connections",
        description = "Concurrent connections the fleet must hold"
    ),
    printcolumn(
        name = "Shards",
        type_ = "integer",
        json_path = ".status.desiredShards",
        description = "Planned shards"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyShards",
        description = "Shards ready"
    ),
    printcolumn(
        name = "Live",
        type_ = "integer",
        json_path = ".status.liveConnections",
        description = "Live connections"
    ),
    printcolumn(
        name = "Limit",
        type_ = "string",
        json_path = ".status.plan.limitingFactor",
        description = "What limits connections per node"
    ),
    printcolumn(
        name = "Progressing",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Progressing\")].reason",
        description = "Reason of the Progressing condition: RollingOut while a rollout runs or an old shard drains, RolloutComplete after"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        json_path = ".status.plan.nodes",
        priority = 1,
        description = "Nodes the plan needs"
    ),
    printcolumn(
        name = "Per-Shard",
        type_ = "integer",
        json_path = ".status.plan.connectionsPerShard",
        priority = 1,
        description = "Connections per shard"
    ),
    printcolumn(
        name = "Monthly",
        type_ = "number",
        json_path = ".status.plan.monthlyCost",
        priority = 1,
        description = "Monthly node cost in USD"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.server) || !has(self.server.subprotocols) || size(self.server.subprotocols) == 0 || (has(self.backend) && has(self.backend.protocol) && self.backend.protocol == 'websocket')").message("server.subprotocols needs backend.protocol: websocket").field_path(".server.subprotocols"))]
pub struct ConnectionFleetSpec {
    /// Concurrent connections the fleet must hold (1 to 10^10).
    #[schemars(range(min = 1, max = 10_000_000_000i64))]
    pub connections: i64,

    /// The server the shards run and its per-connection cost.
    #[serde(default)]
    pub backend: Backend,

    /// Node profile. In a cluster each size comes from the allocatable of
    /// the smallest node matching `placement.nodeSelector` whose taints the
    /// fleet tolerates; a value set here is used only where it is smaller
    /// (`status.plan.nodeSource` says which). Offline, the values here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeProfile>,

    /// Size and bounds of each shard (one pod, one server process).
    #[serde(default)]
    pub shard: ShardSpec,

    /// How the plan's kernel settings reach the pods and nodes.
    #[serde(default)]
    pub sysctls: SysctlSpec,

    /// Image and ports of the server container.
    #[serde(default)]
    pub server: ServerSpec,

    /// Where shards may run.
    #[serde(default)]
    pub placement: Placement,

    /// Scaling between the declared floor and shard.maxShards from live
    /// connections and socket memory (opt-in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,

    /// Moving held connections from hot shards to cold ones (opt-in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceSpec>,

    /// Where live connections and socket memory come from.
    #[serde(default)]
    pub metrics: MetricsSpec,

    /// How a shard that goes away closes its connections.
    #[serde(default)]
    pub drain: DrainSpec,

    /// How a new pod template replaces the shards: the fleet-wide close
    /// budget of a rollout.
    #[serde(default)]
    pub rollout: RolloutSpec,

    /// What the fleet survives: the failure domain whose loss it absorbs
    /// and how fast the survivors re-accept that domain's connections.
    #[serde(default)]
    pub availability: AvailabilitySpec,
}

/// HPA-like autoscaling on live connections. The declared `spec.connections`
/// stays the floor; the result and its reason go to `status.autoscaling`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    /// Turns autoscaling on.
    #[serde(default)]
    pub enabled: bool,

    /// Percent of each shard's connection cap the autoscaler aims for. Default 80.
    #[serde(default = "default_target_utilization")]
    #[schemars(range(min = 10, max = 100))]
    pub target_utilization_percent: i32,

    /// Changes of the desired/current ratio within this percent are ignored. Default 10.
    #[serde(default = "default_tolerance")]
    #[schemars(range(min = 0, max = 50))]
    pub tolerance_percent: i32,

    /// Socket memory (TCP mem) above this percent of the node's tcp_mem
    /// pressure threshold adds shards. Default 80.
    #[serde(default = "default_socket_memory_percent")]
    #[schemars(range(min = 10, max = 100))]
    pub socket_memory_percent: i32,

    /// Seconds between metric reads. Default 10.
    #[serde(default = "default_sync_period")]
    #[schemars(range(min = 1, max = 3600))]
    pub sync_period_seconds: i32,

    /// Scale-up behaviour. Default: no stabilization, at most +100 % or +4 shards per 15 s (the larger).
    #[serde(default = "ScalingRules::default_up")]
    pub scale_up: ScalingRules,

    /// Scale-down behaviour. Default: 300 s stabilization, at most −10 % or −1 shard per 60 s (the larger).
    #[serde(default = "ScalingRules::default_down")]
    pub scale_down: ScalingRules,
}

fn default_target_utilization() -> i32 {
    80
}
fn default_tolerance() -> i32 {
    10
}
fn default_socket_memory_percent() -> i32 {
    80
}
fn default_sync_period() -> i32 {
    10
}

/// Rate limits and stabilization of one scaling direction (as the HPA's `behavior`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScalingRules {
    /// Seconds of past recommendations considered: scale-up takes the lowest,
    /// scale-down the highest recommendation in the window.
    #[serde(default)]
    #[schemars(range(min = 0, max = 3600))]
    pub stabilization_window_seconds: i32,

    /// Most shards added/removed per period.
    #[schemars(range(min = 1, max = 100_000))]
    pub shards_per_period: i32,

    /// Most percent of the current shards added/removed per period.
    #[schemars(range(min = 1, max = 1000))]
    pub percent_per_period: i32,

    /// Length of the rate-limit period, seconds.
    #[schemars(range(min = 1, max = 3600))]
    pub period_seconds: i32,
}

impl ScalingRules {
    /// Scale-up default (like the HPA's: fast).
    pub fn default_up() -> Self {
        ScalingRules {
            stabilization_window_seconds: 0,
            shards_per_period: 4,
            percent_per_period: 100,
            period_seconds: 15,
        }
    }
    /// Scale-down default (like the HPA's: cautious).
    pub fn default_down() -> Self {
        ScalingRules {
            stabilization_window_seconds: 300,
            shards_per_period: 1,
            percent_per_period: 10,
            period_seconds: 60,
        }
    }
}

/// Rebalancing held connections after scale-outs and restarts.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RebalanceSpec {
    /// Turns rebalancing on.
    #[serde(default)]
    pub enabled: bool,

    /// Act when the hottest shard holds more than this percent of the mean
    /// shard load (120 = 1.2 × mean). Default 120.
    #[serde(default = "default_max_to_mean")]
    #[schemars(range(min = 101, max = 1000))]
    pub max_to_mean_percent: i32,

    /// Seconds the imbalance must last before shards are told to shed. Default 20.
    #[serde(default = "default_rebalance_window")]
    #[schemars(range(min = 0, max = 3600))]
    pub window_seconds: i32,

    /// Most connections per second the whole fleet closes for rebalancing
    /// (clients reconnect at this rate). Default 1000.
    #[serde(default = "default_max_reconnect_rate")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub max_reconnect_rate: i64,
}

pub(crate) fn default_max_to_mean() -> i32 {
    120
}
fn default_rebalance_window() -> i32 {
    20
}
fn default_max_reconnect_rate() -> i64 {
    1000
}

/// Metric queries. `{namespace}` and `{fleet}` are replaced before a query runs.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSpec {
    /// PromQL giving live connections per shard, one series per pod with a
    /// `pod` label. Default: the bundled server's `c10m_connections`.
    #[serde(default = "default_connections_query")]
    #[schemars(length(min = 1, max = 4096))]
    pub connections_query: String,

    /// PromQL giving the TCP socket memory of the fleet's nodes in bytes
    /// (one value: the highest). Default: the bundled server's sockstat gauge.
    #[serde(default = "default_socket_memory_query")]
    #[schemars(length(min = 1, max = 4096))]
    pub socket_memory_query: String,

    /// PromQL giving the scrape health of each shard (`up`), whose sample
    /// timestamps tell how fresh the data is.
    #[serde(default = "default_up_query")]
    #[schemars(length(min = 1, max = 4096))]
    pub up_query: String,

    /// Seconds a query may take. Default 5.
    #[serde(default = "default_query_timeout")]
    #[schemars(range(min = 1, max = 60))]
    pub query_timeout_seconds: i32,

    /// Samples older than this many seconds are stale. Default 30.
    #[serde(default = "default_stale_after")]
    #[schemars(range(min = 1, max = 3600))]
    pub stale_after_seconds: i32,
}

fn default_connections_query() -> String {
    r#"sum by (pod) (c10m_connections{namespace="{namespace}",fleet="{fleet}"})"#.into()
}
fn default_socket_memory_query() -> String {
    r#"max(c10m_tcp_memory_bytes{namespace="{namespace}",fleet="{fleet}"})"#.into()
}
fn default_up_query() -> String {
    r#"up{namespace="{namespace}",fleet="{fleet}"}"#.into()
}
fn default_query_timeout() -> i32 {
    5
}
fn default_stale_after() -> i32 {
    30
}

impl Default for MetricsSpec {
    fn default() -> Self {
        MetricsSpec {
            connections_query: default_connections_query(),
            socket_memory_query: default_socket_memory_query(),
            up_query: default_up_query(),
            query_timeout_seconds: default_query_timeout(),
            stale_after_seconds: default_stale_after(),
        }
    }
}

/// How a shard that goes away (scale-in, rollout, node drain) closes its connections.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DrainSpec {
    /// Connections per second one shard closes while draining (WebSocket
    /// close 1001 / FIN), so clients reconnect at a bounded rate; in a
    /// rollout at most spec.rollout.maxReconnectRate. Sizes the pod's
    /// terminationGracePeriodSeconds. Default 2000.
    #[serde(default = "default_drain_rate")]
    #[schemars(range(min = 1, max = 10_000_000))]
    pub rate: i64,
}

fn default_drain_rate() -> i64 {
    2000
}

impl Default for DrainSpec {
    fn default() -> Self {
        DrainSpec {
            rate: default_drain_rate(),
        }
    }
}

/// How a change of the shards' pod template (image, env, resources, a
/// re-plan, `kubectl rollout restart`) replaces them (ADR 0011).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Connections per second the whole fleet may close for a rollout
    /// (default: spec.drain.rate). The old shards drain in steps of
    /// maxReconnectRate ÷ spec.drain.rate shards (at least one, each at
    /// min(spec.drain.rate, maxReconnectRate)); a step starts only once as
    /// many updated shards are Ready and the previous step's shards have
    /// closed what they held, and every old shard not yet draining is
    /// cordoned, so clients reconnect only to updated shards and at most
    /// this fast. Without the operator the Deployment still keeps steps a
    /// shard's cap ÷ its drain rate + 5 s apart
    /// (status.plan.rolloutStepSeconds).
    pub max_reconnect_rate: Option<i64>,
    /// Holds the rollout (default false): no step starts (no surge shard
    /// is added, no old shard removed) until it is false again; a step
    /// already draining finishes. Declarative, for GitOps: the operator
    /// pauses the Deployment (`spec.paused`) and marks it, and resumes only
    /// a pause of its own; `kubectl rollout pause` of the Deployment works
    /// as well and is left to whoever made it.
    pub paused: Option<bool>,
}

impl RolloutSpec {
    /// The fleet's rollout budget, connections/s: maxReconnectRate, else
    /// `drain_rate` (spec.drain.rate: what one replaced shard closes at).
    pub fn budget(&self, drain_rate: i64) -> i64 {
        self.max_reconnect_rate.unwrap_or(drain_rate)
    }
}

/// The failure the fleet is planned to survive and its refill budget.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AvailabilitySpec {
    /// The largest failure domain whose loss the fleet absorbs with its
    /// declared connections still held: `Node` (the default: the busiest
    /// node, at least one shard; the shards spread over at least two
    /// nodes), `Shard` (one shard) or `None` (no spare capacity). The
    /// survivors' connection caps hold every declared connection.
    #[serde(default)]
    pub failure_domain: FailureDomain,

    /// Seconds within which the surviving shards can re-accept the lost
    /// domain's connections, at the measured accept rate per worker
    /// (`status.plan.refillSeconds`). Default 60.
    #[serde(default = "default_refill_budget_seconds")]
    #[schemars(range(min = 1, max = 86_400))]
    pub refill_budget_seconds: i32,
}

fn default_refill_budget_seconds() -> i32 {
    60
}

impl Default for AvailabilitySpec {
    fn default() -> Self {
        AvailabilitySpec {
            failure_domain: FailureDomain::default(),
            refill_budget_seconds: default_refill_budget_seconds(),
        }
    }
}

/// A failure domain of a fleet.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailureDomain {
    /// One node: all the shards on the busiest node.
    #[default]
    Node,
    /// One shard.
    Shard,
    /// Nothing: the fleet holds its declared connections only while every
    /// shard runs.
    None,
}

/// Backend cost model: what one connection costs in user space.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.model != 'custom' || has(self.userBytesPerConnection)").message("backend.userBytesPerConnection is required when backend.model is custom").field_path(".userBytesPerConnection"))]
pub struct Backend {
    /// Cost model: `epoll` (the bundled c10m-server), `goroutine` (a Go
    /// goroutine-per-connection server; GOMAXPROCS and GOMEMLIMIT are set) or
    /// `custom` (userBytesPerConnection required).
    #[serde(default)]
    pub model: BackendModel,

    /// User-space bytes per idle connection. Required for `custom`; overrides
    /// the model's figure otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1_073_741_824))]
    pub user_bytes_per_connection: Option<i64>,

    /// Wire protocol of the bundled server: `echo` or `websocket`.
    #[serde(default)]
    pub protocol: Protocol,

    /// Percent of connections that hold queued (unread or unsent) data at
    /// peak; each such socket is charged at least one 4 KiB page against
    /// `tcp_mem` and memory. Default 10.
    #[serde(default = "default_queued_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub queued_percent: i32,

    /// Percent of connections that are slow readers at peak: peers that
    /// send and stop reading, so their socket buffers fill to the plan's
    /// `tcp_rmem`/`tcp_wmem` bound (`status.plan.slowReaderBytes` each).
    /// Charged against the pod (cgroup v2), node memory and `tcp_mem`.
    /// Default 1.
    #[serde(default = "default_slow_reader_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub slow_reader_percent: i32,

    /// Connections one CPU can serve at the fleet's message rate; when set,
    /// caps connections per shard at this × shard.cpus. Unset: idle-ish
    /// connections, bounded by memory and file descriptors instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10_000_000_000i64))]
    pub connections_per_cpu: Option<i64>,

    /// Measure what one connection of the fleet's image costs on the
    /// cluster, and plan from the measurement: the operator runs one shard
    /// of the image as planned with a calibration probe beside it
    /// (`c10m-operator calibrate` does the same from a shell), records the
    /// figures in `status.calibration`, and sizes the plan's user bytes per
    /// connection from them (`status.plan.userBytesSource: Calibrated`).
    /// A change of the image, model, protocol or of this field runs it
    /// again; until that run succeeds the plan keeps the last calibration.
    /// The namespace must admit privileged pods (the probe reads the node's
    /// cgroups). docs/capacity-model.md#calibration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibrate: Option<Calibrate>,
}

/// `spec.backend.calibrate`: how much load the calibration applies.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Calibrate {
    /// Idle connections at the largest step (the probe samples at half of
    /// it too). Default: what the shard's cap and one probe process (the
    /// nodes' hard RLIMIT_NOFILE) allow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 100, max = 10_000_000))]
    pub connections: Option<i64>,
    /// Slow readers opened after the last step, each sending 1 MiB and
    /// reading nothing. Default: 1 % of `connections`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1_000_000))]
    pub slow_readers: Option<i64>,
}

fn default_queued_percent() -> i32 {
    10
}

fn default_slow_reader_percent() -> i32 {
    1
}

impl Default for Backend {
    fn default() -> Self {
        Backend {
            model: BackendModel::default(),
            user_bytes_per_connection: None,
            protocol: Protocol::default(),
            queued_percent: default_queued_percent(),
            slow_reader_percent: default_slow_reader_percent(),
            connections_per_cpu: None,
            calibrate: None,
        }
    }
}

/// Backend cost model.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendModel {
    /// The bundled c10m-server: edge-triggered epoll, compact per-connection state.
    #[default]
    Epoll,
    /// A goroutine-per-connection Go server (net/http style).
    Goroutine,
    /// Any other server; `userBytesPerConnection` gives its cost.
    Custom,
}

/// Protocol spoken by the bundled server.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Echo with a small framed ping for round-trip measurement.
    #[default]
    Echo,
    /// WebSocket (RFC 6455).
    Websocket,
}

impl Protocol {
    /// The value of [`c10m_wire::env::PROTOCOL`] the bundled server parses.
    pub fn wire_name(self) -> &'static str {
        match self {
            Protocol::Echo => c10m_wire::protocol::ECHO,
            Protocol::Websocket => c10m_wire::protocol::WEBSOCKET,
        }
    }
}

/// Node profile: what one node offers the fleet.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(format!(
    "!has(self.memory) || (type(self.memory) == int ? (self.memory >= {MIN_NODE_MEMORY_BYTES} && self.memory <= {MAX_NODE_MEMORY_BYTES}) : \
     (size(self.memory) <= {MAX_QUANTITY_LENGTH} && self.memory.matches('{QUANTITY_PATTERN}') && \
     isQuantity(self.memory) && quantity(self.memory).compareTo(quantity('64Mi')) >= 0 && quantity(self.memory).compareTo(quantity('1Pi')) <= 0))"
)).message("node.memory must be a quantity between 64Mi and 1Pi (at most 32 characters, a decimal exponent of at most 2 digits)").field_path(".memory"))]
pub struct NodeProfile {
    /// Memory of one node available to pods (a quantity such as 256Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub memory: Option<Quantity>,

    /// Whole CPUs of one node available to pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100_000))]
    pub cpus: Option<i32>,

    /// Most pods one node runs (kubelet maxPods). Default: node allocatable, else 110.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100_000))]
    pub pods: Option<i32>,

    /// Price of one node per hour, USD, as a decimal string ("2.59").
    /// Enables `costPerMillionConnectionsMonthly` and `monthlyCost` in the plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]{1,9}(\.[0-9]{1,6})?$"), length(max = 16))]
    pub price_per_hour: Option<String>,

    /// Kernel bytes per idle, epoll-registered TCP socket. Default 3965
    /// (slab objects of a socket on Linux 6.x, docs/KERNEL_FACTS.md). The
    /// operator uses a smaller value only in offline plans; in a cluster
    /// it never plans below 3965 (`status.plan.nodeSource`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1_048_576))]
    pub kernel_bytes_per_socket: Option<i64>,

    /// Connections pass through conntrack (Service NAT by kube-proxy): +256 B
    /// each and `nf_conntrack_max` applies. Default true. In a cluster,
    /// false counts only where the operator's policy says `conntrack: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<bool>,

    /// Hard RLIMIT_NOFILE a container gets from the node's container runtime
    /// (containerd 2.x inherits systemd's 524288). Caps connections per shard
    /// unless the server raises its own limit (`sysResource`). In a cluster
    /// the plan uses the smaller of this and the nodes' label
    /// `c10m.dev/nofile-hard-limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1024, max = 1_073_741_816))]
    pub nofile_hard_limit: Option<i64>,

    /// The node's runtime can give a container CAP_SYS_RESOURCE (the bundled
    /// server then raises its own hard RLIMIT_NOFILE in InitContainer mode).
    /// Default true; false on nodes labelled `c10m.dev/sys-resource:
    /// unavailable`, whatever this says. false: nofile is bound by
    /// `nofileHardLimit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sys_resource: Option<bool>,

    /// A privileged container on the node can enter the host's network
    /// namespace, so InitContainer mode raises node-level sysctls
    /// (`tcp_mem`, `nf_conntrack_max`, `fs.file-max`, `fs.nr_open`).
    /// Default true; false on nodes labelled
    /// `c10m.dev/host-network-namespace: unavailable`, whatever this says.
    /// false: the plan fits the kernel's defaults for those.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network_namespace: Option<bool>,

    /// The nodes' cgroup version, which decides what a connection charges
    /// to the pod's memory limit: `v2` (the default; sockets and their
    /// buffers are charged to the pod) or `v1` (without socket accounting:
    /// only files, inodes and epoll items are). In a cluster the plan uses
    /// `v1` only where every placeable node is labelled
    /// `c10m.dev/cgroup-mode: v1` (`v2` here makes it v2 anyway; `v1` here
    /// is used only offline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_mode: Option<CgroupMode>,
}

/// A node's cgroup version, as it bears on memory charges.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMode {
    /// cgroup v2: socket memory (the socket and its buffers) is charged to
    /// the pod that owns the socket.
    #[default]
    V2,
    /// cgroup v1 without socket accounting (as the kubelet leaves it): the
    /// socket object and its buffers are charged to no pod.
    V1,
}

impl CgroupMode {
    /// The name used in specs, labels and the plan.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupMode::V2 => "v2",
            CgroupMode::V1 => "v1",
        }
    }
}

/// Pattern of a memory quantity without a sign, with bounded parts: at most
/// 20 digits on each side of the point and a decimal exponent of at most 2
/// digits. Kubernetes' own quantity pattern admits any exponent, and
/// parsing `2E6024865272343` in a CEL `quantity()` pins a kube-apiserver
/// core (the kind of kubernetes#131063); with this pattern (checked first,
/// inside the CEL rule too) no such string reaches a quantity parser. No
/// backslashes, so the same text serves as a CEL string literal.
pub const QUANTITY_PATTERN: &str = "^(([0-9]{1,20}([.][0-9]{0,20})?)|([.][0-9]{1,20}))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?$";

/// Longest memory quantity string admitted, in characters.
pub const MAX_QUANTITY_LENGTH: usize = 32;

/// Smallest node memory a plan accepts, in bytes (64 MiB: one shard's base).
pub const MIN_NODE_MEMORY_BYTES: i64 = 64 << 20;

/// Largest node memory a plan accepts, in bytes (1 PiB).
pub const MAX_NODE_MEMORY_BYTES: i64 = 1 << 50;

fn quantity_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "x-kubernetes-int-or-string": true,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "maxLength": MAX_QUANTITY_LENGTH,
        "minimum": MIN_NODE_MEMORY_BYTES,
        "maximum": MAX_NODE_MEMORY_BYTES,
        "description": "Memory of one node available to pods, as a Kubernetes quantity (256Gi, 64G, 1073741824)."
    })
}

/// Size and bounds of each shard.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.maxShards >= self.minShards").message("shard.maxShards must be >= shard.minShards").field_path(".maxShards"))]
pub struct ShardSpec {
    /// Whole CPUs per shard, pinned (requests = limits, Guaranteed QoS); one
    /// worker thread per CPU. Unset: the planner picks the shape (CPUs per
    /// shard, so shards per node) that costs least per connection under
    /// every constraint (`status.plan.shapeSource: Planner`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub cpus: Option<i32>,

    /// Percent of every limit (memory, file descriptors, tcp_mem, conntrack)
    /// kept free at the declared connections, 0–90.
    #[serde(default = "default_headroom")]
    #[schemars(range(min = 0, max = 90))]
    pub headroom_percent: i32,

    /// Fewest shards the fleet runs.
    #[serde(default = "default_min_shards")]
    #[schemars(range(min = 1, max = 100_000))]
    pub min_shards: i32,

    /// Most shards the fleet runs; if the plan needs more, it holds fewer
    /// connections than declared and says so (limitingFactor maxShards).
    #[serde(default = "default_max_shards")]
    #[schemars(range(min = 1, max = 100_000))]
    pub max_shards: i32,
}

fn default_headroom() -> i32 {
    20
}
fn default_min_shards() -> i32 {
    1
}
fn default_max_shards() -> i32 {
    1000
}

impl Default for ShardSpec {
    fn default() -> Self {
        ShardSpec {
            cpus: None,
            headroom_percent: default_headroom(),
            min_shards: default_min_shards(),
            max_shards: default_max_shards(),
        }
    }
}

/// How kernel settings are applied.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.image)").message(SYSCTL_IMAGE_REFUSED).field_path(".image"))]
pub struct SysctlSpec {
    /// `InitContainer`: a privileged init container sets the namespaced
    /// sysctls in the pod's network namespace and raises (never lowers)
    /// node-level ones. `PodSecurityContext`: only kubelet-safe sysctls (plus
    /// `allowedUnsafe`) go into the pod's securityContext; node-level limits
    /// stay at kernel defaults and constrain the plan. `None`: nothing is set.
    #[serde(default)]
    pub mode: SysctlMode,

    /// Namespaced sysctls your kubelets allow with `--allowed-unsafe-sysctls`
    /// (PodSecurityContext mode renders them too, except where the nodes'
    /// annotation `c10m.dev/allowed-unsafe-sysctls` says their kubelets do
    /// not allow them: those are reported, never rendered).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub allowed_unsafe: Vec<String>,

    /// Not allowed (refused at admission): the privileged init container
    /// runs the image the operator's policy names (sysctlImage), never one a
    /// fleet chooses. Kept in the schema only so the refusal can name it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
}

/// The message a fleet setting `spec.sysctls.image` is refused with.
pub const SYSCTL_IMAGE_REFUSED: &str = "spec.sysctls.image is not allowed: the privileged init container runs the image the operator's policy names (sysctlImage), never one a fleet chooses; remove the field";

impl Default for SysctlSpec {
    fn default() -> Self {
        SysctlSpec {
            mode: SysctlMode::InitContainer,
            allowed_unsafe: Vec::new(),
            image: None,
        }
    }
}

/// Sysctl application mode.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SysctlMode {
    /// Privileged init container (namespaced + raise-only node-level).
    #[default]
    InitContainer,
    /// Pod `securityContext.sysctls` (kubelet-safe and allowed-unsafe only).
    PodSecurityContext,
    /// No sysctls are set.
    None,
}

/// Server container settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.port != self.metricsPort").message("server.metricsPort must differ from server.port").field_path(".metricsPort"))]
pub struct ServerSpec {
    /// Container image of the shard server.
    #[serde(default = "default_image")]
    #[schemars(length(min = 1, max = 512))]
    pub image: String,

    /// Port clients connect to (1–65535).
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,

    /// Port serving /metrics and /healthz (1–65535).
    #[serde(default = "default_metrics_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub metrics_port: i32,

    /// Service type exposing the fleet: ClusterIP, NodePort or LoadBalancer.
    #[serde(default)]
    pub service_type: ServiceType,

    /// WebSocket subprotocols the bundled server accepts (RFC 6455 §1.9):
    /// the upgrade's answer names the first one the client offers, in the
    /// client's order, that is on this list (`Sec-WebSocket-Protocol`), and
    /// a client offering none of them is answered without one. Clients
    /// that offer one and require an answer (Node's `ws`, browsers) need
    /// it listed. Each an HTTP token (letters, digits and
    /// ``!#$%&'*+-.^_`|~``), at most 64 characters, none twice, at most
    /// 16; only with `backend.protocol: websocket`. Rendered as
    /// `C10M_SUBPROTOCOLS`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(length(min = 1, max = 64), regex(pattern = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub subprotocols: Vec<String>,
}

fn default_image() -> String {
    DEFAULT_SERVER_IMAGE.to_string()
}
fn default_port() -> i32 {
    7000
}
fn default_metrics_port() -> i32 {
    9090
}

impl Default for ServerSpec {
    fn default() -> Self {
        ServerSpec {
            image: default_image(),
            port: default_port(),
            metrics_port: default_metrics_port(),
            service_type: ServiceType::default(),
            subprotocols: Vec::new(),
        }
    }
}

/// Kubernetes Service type.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServiceType {
    /// Cluster-internal virtual IP.
    #[default]
    ClusterIP,
    /// A port on every node.
    NodePort,
    /// A cloud load balancer.
    LoadBalancer,
}

impl ServiceType {
    /// The Service `spec.type` string.
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceType::ClusterIP => "ClusterIP",
            ServiceType::NodePort => "NodePort",
            ServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

/// Pod placement.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Node labels shards must match; also selects the nodes whose
    /// allocatable fills in an unset node profile.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Tolerations of the shard pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

/// Revision of the ConnectionFleet CRD's schema this build generates: an
/// integer, one more with each change of the CRD's `spec` (fields, bounds,
/// CEL rules, defaults, descriptions, printer columns). The CRD carries it
/// in annotation [`SCHEMA_REVISION_ANNOTATION`] ([`crd`]); an operator never
/// applies its CRD over one carrying a higher revision
/// ([`crate::controller::apply_crd`]), so a rollback or an old replica
/// cannot narrow the schema. A unit test pins it together with a SHA-256 of
/// the CRD's `spec`: change the schema without raising this and that test
/// fails, naming the new revision and digest to pin.
pub const CRD_SCHEMA_REVISION: u32 = 7;

/// The ConnectionFleet CRD as the operator installs it and `make crd`
/// writes it: the types' CRD (`ConnectionFleet::crd()`) with annotation
/// [`SCHEMA_REVISION_ANNOTATION`] set to [`CRD_SCHEMA_REVISION`] (decimal).
pub fn crd() -> CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = ConnectionFleet::crd();
    crd.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            SCHEMA_REVISION_ANNOTATION.into(),
            CRD_SCHEMA_REVISION.to_string(),
        );
    crd
}

/// The CRD ([`crd`]) as YAML, exactly as checked into
/// `crds/connectionfleet.yaml` and the chart's `crds/`.
pub fn crd_yaml() -> String {
    format!(
        "# Generated by `c10m-operator crd`; do not edit (a test fails on drift).\n{}",
        serde_yaml::to_string(&crd()).expect("the CRD serializes")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn checked_in_crd_matches_the_types() {
        for file in [
            "crds/connectionfleet.yaml",
            "charts/c10m-operator/crds/connectionfleet.yaml",
        ] {
            let path = format!("{}/../{file}", env!("CARGO_MANIFEST_DIR"));
            let on_disk = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(on_disk == crd_yaml(), "{file} is stale: run `make crd`");
        }
    }

    /// The schema revision and the SHA-256 (hex) of the CRD's canonical
    /// `spec` JSON ([`spec_digest`]) at that revision.
    const PINNED_SCHEMA: (u32, &str) = (
        7,
        "c1ecd6efbba441b32a7461c27434410ea2457a026c08340c97c939dc933e23fd",
    );

    /// `v` as JSON with every object's keys sorted and no whitespace: the
    /// same bytes for the same value, whatever order serde wrote it in.
    fn canonical_json(v: &serde_json::Value, out: &mut String) {
        use serde_json::Value;
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(k).unwrap());
                    out.push(':');
                    canonical_json(&map[k], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical_json(item, out);
                }
                out.push(']');
            }
            scalar => out.push_str(&serde_json::to_string(scalar).unwrap()),
        }
    }

    /// SHA-256 (lower-case hex) of the canonical JSON of the CRD's `spec`:
    /// the schema, names and printer columns, not the metadata (so not the
    /// revision annotation).
    fn spec_digest() -> String {
        let mut json = String::new();
        canonical_json(&serde_json::to_value(&crd().spec).unwrap(), &mut json);
        ring::digest::digest(&ring::digest::SHA256, json.as_bytes())
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn a_schema_change_bumps_the_schema_revision() {
        let (pinned_revision, pinned_digest) = PINNED_SCHEMA;
        let digest = spec_digest();
        let next = pinned_revision + 1;
        assert!(
            CRD_SCHEMA_REVISION == pinned_revision || digest != pinned_digest,
            "CRD_SCHEMA_REVISION is {CRD_SCHEMA_REVISION} but the CRD's spec is the one pinned \
             for revision {pinned_revision}: a revision names one schema; set it back to \
             {pinned_revision}"
        );
        assert!(
            CRD_SCHEMA_REVISION >= pinned_revision,
            "CRD_SCHEMA_REVISION went down from {pinned_revision} to {CRD_SCHEMA_REVISION}: \
             revisions only count up (operators keep a CRD of a higher revision)"
        );
        assert!(
            (CRD_SCHEMA_REVISION, digest.as_str()) == PINNED_SCHEMA,
            "the ConnectionFleet CRD's schema changed (spec SHA-256 {digest}, pinned \
             {pinned_digest} for revision {pinned_revision}). Set CRD_SCHEMA_REVISION in \
             operator/src/api.rs to {next}, pin PINNED_SCHEMA = ({next}, \"{digest}\") in its \
             tests, and run `make crd`: without the bump, an operator with the old schema \
             would apply it over this one and prune the new fields (operators only keep a CRD \
             of a higher revision)"
        );
    }

    #[test]
    fn the_crd_carries_its_schema_revision() {
        let crd = crd();
        let annotations = crd.metadata.annotations.unwrap_or_default();
        assert_eq!(
            annotations.get(SCHEMA_REVISION_ANNOTATION),
            Some(&CRD_SCHEMA_REVISION.to_string())
        );
        assert!(
            crd_yaml().contains(&format!(
                "{SCHEMA_REVISION_ANNOTATION}: '{CRD_SCHEMA_REVISION}'"
            )),
            "{}",
            crd_yaml()
        );
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let mut a = String::new();
        canonical_json(
            &serde_json::json!({"b": [{"y": 1, "x": "s"}], "a": null}),
            &mut a,
        );
        assert_eq!(a, r#"{"a":null,"b":[{"x":"s","y":1}]}"#);
    }

    fn schema() -> serde_json::Value {
        let crd = ConnectionFleet::crd();
        serde_json::to_value(&crd.spec.versions[0].schema).unwrap()
    }

    #[test]
    fn defaults_fill_an_empty_spec() {
        let spec: ConnectionFleetSpec =
            serde_json::from_value(serde_json::json!({"connections": 5})).unwrap();
        assert_eq!(spec.backend.model, BackendModel::Epoll);
        assert_eq!(spec.backend.queued_percent, 10);
        assert_eq!(spec.backend.slow_reader_percent, 1);
        assert_eq!(spec.shard.cpus, None);
        assert_eq!(spec.availability.failure_domain, FailureDomain::Node);
        assert_eq!(spec.availability.refill_budget_seconds, 60);
        assert_eq!(spec.shard.headroom_percent, 20);
        assert_eq!(spec.sysctls.mode, SysctlMode::InitContainer);
        assert_eq!(spec.server.port, 7000);
        assert_eq!(spec.server.image, DEFAULT_SERVER_IMAGE);
    }

    #[test]
    fn schema_carries_bounds_and_cel_rules() {
        let s = schema().to_string();
        assert!(
            s.contains(r#""maximum":10000000000"#),
            "connections bound missing"
        );
        assert!(s.contains("self.maxShards >= self.minShards"));
        assert!(s.contains("!has(self.image)") && s.contains(SYSCTL_IMAGE_REFUSED));
        assert!(s.contains("self.model != 'custom' || has(self.userBytesPerConnection)"));
        assert!(s.contains(QUANTITY_PATTERN));
        assert!(
            s.contains(&format!("matches('{QUANTITY_PATTERN}')")),
            "the CEL rule checks the same pattern before parsing"
        );
        assert!(
            s.contains(r#""enum":["epoll","goroutine","custom"]"#),
            "{s}"
        );
    }

    #[test]
    fn every_spec_field_has_a_description() {
        fn walk(v: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
            if let Some(props) = v.get("properties").and_then(|p| p.as_object()) {
                for (k, sub) in props {
                    let p = format!("{path}.{k}");
                    if sub.get("description").is_none() {
                        missing.push(p.clone());
                    }
                    walk(sub, &p, missing);
                    if let Some(items) = sub.get("items") {
                        walk(items, &p, missing);
                    }
                }
            }
        }
        let mut missing = Vec::new();
        let root = schema();
        walk(
            &root["openAPIV3Schema"]["properties"]["spec"],
            "spec",
            &mut missing,
        );
        assert!(
            missing.is_empty(),
            "fields without description: {missing:?}"
        );
    }
}
