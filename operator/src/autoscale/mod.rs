//! Live-metrics loop: read Prometheus ([`metrics`]), decide shard counts
//! ([`policy`], pure) and rebalancing orders ([`rebalance`], pure), and carry
//! them out on the shards ([`actions`]).

pub mod actions;
pub mod metrics;
pub mod policy;
pub mod rebalance;
pub mod sync;

/// Annotation that pauses autoscaling and rebalancing of one fleet
/// (`"true"`); shards then stay where they are.
pub const PAUSE_ANNOTATION: &str = "c10m.dev/autoscaling-paused";

/// Annotation the ReplicaSet controller reads to pick which pods to delete
/// first on scale-in (lower cost goes first; Kubernetes ≥ 1.22).
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";
