//! The `ConnectionFleet` custom resource (`c10m.dev/v1alpha1`): spec, status
//! and the schema the API server validates with (OpenAPI bounds + CEL rules).
//!
//! Users declare connections, never replicas: the shard count is derived state
//! in `status.plan`, so autoscalers and GitOps tools never fight over it.

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::model::Plan;

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
pub struct ConnectionFleetSpec {
    /// Concurrent connections the fleet must hold (1 to 10^10).
    #[schemars(range(min = 1, max = 10_000_000_000i64))]
    pub connections: i64,

    /// The server the shards run and its per-connection cost.
    #[serde(default)]
    pub backend: Backend,

    /// Node profile. Unset fields come from the allocatable of the nodes that
    /// match `placement.nodeSelector` (the smallest of them).
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

    /// Connections one CPU can serve at the fleet's message rate; when set,
    /// caps connections per shard at this × shard.cpus. Unset: idle-ish
    /// connections, bounded by memory and file descriptors instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub connections_per_cpu: Option<i64>,
}

fn default_queued_percent() -> i32 {
    10
}

impl Default for Backend {
    fn default() -> Self {
        Backend {
            model: BackendModel::default(),
            user_bytes_per_connection: None,
            protocol: Protocol::default(),
            queued_percent: default_queued_percent(),
            connections_per_cpu: None,
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

/// Node profile: what one node offers the fleet.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
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
    /// (slab objects of a socket on Linux 6.x, KERNEL_FACTS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1_048_576))]
    pub kernel_bytes_per_socket: Option<i64>,

    /// Connections pass through conntrack (Service NAT by kube-proxy): +256 B
    /// each and `nf_conntrack_max` applies. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<bool>,

    /// Hard RLIMIT_NOFILE a container gets from the node's container runtime
    /// (containerd 2.x inherits systemd's 524288). Caps connections per shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1024, max = 1_073_741_816))]
    pub nofile_hard_limit: Option<i64>,
}

/// Pattern of a Kubernetes resource quantity without a sign (as controller-gen
/// emits for `resource.Quantity`, minus the sign).
pub const QUANTITY_PATTERN: &str = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

fn quantity_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "x-kubernetes-int-or-string": true,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "minimum": 1,
        "description": "Memory of one node available to pods, as a Kubernetes quantity (256Gi, 64G, 1073741824)."
    })
}

/// Size and bounds of each shard.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.maxShards >= self.minShards").message("shard.maxShards must be >= shard.minShards").field_path(".maxShards"))]
pub struct ShardSpec {
    /// Whole CPUs per shard, pinned (requests = limits, Guaranteed QoS); one
    /// worker thread per CPU.
    #[serde(default = "default_shard_cpus")]
    #[schemars(range(min = 1, max = 1024))]
    pub cpus: i32,

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

fn default_shard_cpus() -> i32 {
    8
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
            cpus: default_shard_cpus(),
            headroom_percent: default_headroom(),
            min_shards: default_min_shards(),
            max_shards: default_max_shards(),
        }
    }
}

/// How kernel settings are applied.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SysctlSpec {
    /// `InitContainer`: a privileged init container sets the namespaced
    /// sysctls in the pod's network namespace and raises (never lowers)
    /// node-level ones. `PodSecurityContext`: only kubelet-safe sysctls (plus
    /// `allowedUnsafe`) go into the pod's securityContext; node-level limits
    /// stay at kernel defaults and constrain the plan. `None`: nothing is set.
    #[serde(default)]
    pub mode: SysctlMode,

    /// Namespaced sysctls your kubelets allow with `--allowed-unsafe-sysctls`
    /// (PodSecurityContext mode renders them too).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub allowed_unsafe: Vec<String>,

    /// Image of the init container; must carry `c10m-sysctl`. Default: the bundled server image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
}

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
}

/// The CRD as YAML, exactly as checked into `crds/connectionfleet.yaml`.
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    format!(
        "# Generated by `c10m-operator crd`; do not edit (a test fails on drift).\n{}",
        serde_yaml::to_string(&ConnectionFleet::crd()).expect("the CRD serializes")
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
        assert_eq!(spec.shard.cpus, 8);
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
        assert!(s.contains("self.model != 'custom' || has(self.userBytesPerConnection)"));
        assert!(s.contains(QUANTITY_PATTERN.replace('\\', "\\\\").as_str()));
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
