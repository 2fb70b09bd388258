//! The node profile a plan uses: the allocatable of the smallest node
//! matching `placement.nodeSelector`, `spec.node` only where it is smaller
//! (or, offline, as given), with what the runtime, kubelet and kernel of
//! every such node allow (pure).

use std::borrow::Borrow;

use k8s_openapi::api::core::v1::{Node, Taint, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;

use super::PlanError;
use super::kernel::KERNEL_BYTES_PER_SOCKET;
use crate::api::status::{ClaimSource, NodeSource, NodeValueSource};
use crate::api::sysctl::Sysctl;
use crate::api::{
    CgroupMode, ConnectionFleetSpec, MAX_NODE_MEMORY_BYTES, MAX_QUANTITY_LENGTH,
    MIN_NODE_MEMORY_BYTES, NodeProfile, QUANTITY_PATTERN,
};
use crate::names;

/// The node one shard runs on, resolved from the spec or the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeFacts {
    /// Memory available to pods, bytes.
    pub memory_bytes: i64,
    /// Whole CPUs available to pods.
    pub cpus: i64,
    /// Most pods the node runs.
    pub pods: i64,
    /// What the node's runtime and kernel let a shard's pod do.
    pub runtime: NodeRuntime,
}

/// What a node's container runtime, kubelet and kernel let a shard's pod
/// do, from its labels ([`crate::names::NODE_NOFILE_HARD_LIMIT_LABEL`],
/// [`crate::names::NODE_SYS_RESOURCE_LABEL`],
/// [`crate::names::NODE_HOST_NETWORK_NAMESPACE_LABEL`]), its annotation
/// [`crate::names::NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION`] and `spec.node`.
/// Measured on a real kubelet + containerd + runc node: a container asking
/// for a capability its node cannot grant never starts, and an init
/// container that cannot open the host's network namespace crash-loops
/// (tests/cluster/README.md, real node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRuntime {
    /// Hard RLIMIT_NOFILE containers inherit, in descriptors (`None`: not
    /// said; the plan then assumes containerd 2.x's 524,288).
    pub nofile_hard_limit: Option<i64>,
    /// The runtime can give a container CAP_SYS_RESOURCE.
    pub sys_resource: bool,
    /// A privileged container can enter the host's network namespace.
    pub host_network_namespace: bool,
    /// Sysctls the node's kubelet allows besides its safe set (`None`: not
    /// said; `spec.sysctls.allowedUnsafe` is then taken at its word).
    pub unsafe_sysctls: Option<SysctlSet>,
    /// The node's cgroup version (`None`: not said; the plan then assumes
    /// [`CgroupMode::V2`], which charges the pod more).
    pub cgroup_mode: Option<CgroupMode>,
}

/// A set of the sysctls the planner knows ([`Sysctl::ALL`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SysctlSet(u16);

const _: () = assert!(Sysctl::ALL.len() <= 16, "SysctlSet holds 16 sysctls");

impl SysctlSet {
    fn bit(sysctl: Sysctl) -> u16 {
        let i = Sysctl::ALL
            .iter()
            .position(|&s| s == sysctl)
            .expect("ALL lists every sysctl");
        1 << i
    }

    /// True when `sysctl` is in the set.
    pub fn contains(self, sysctl: Sysctl) -> bool {
        self.0 & Self::bit(sysctl) != 0
    }

    /// The sysctls a kubelet `allowedUnsafeSysctls` list allows: entries
    /// separated by commas, each a name or a `prefix*` pattern (the
    /// kubelet's syntax, `pkg/kubelet/sysctl/allowlist.go`).
    pub fn from_kubelet_list(list: &str) -> SysctlSet {
        let mut set = SysctlSet::default();
        for pattern in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            for s in Sysctl::ALL {
                let allowed = match pattern.strip_suffix('*') {
                    Some(prefix) => s.name().starts_with(prefix),
                    None => s.name() == pattern,
                };
                if allowed {
                    set.0 |= Self::bit(s);
                }
            }
        }
        set
    }
}

impl NodeRuntime {
    /// A node that says nothing: capabilities and the host's network
    /// namespace available, the runtime's nofile limit not known.
    pub const UNKNOWN: NodeRuntime = NodeRuntime {
        nofile_hard_limit: None,
        sys_resource: true,
        host_network_namespace: true,
        unsafe_sysctls: None,
        cgroup_mode: None,
    };

    /// The facts `node`'s labels state. A nofile label that is not a
    /// decimal integer within `spec.node.nofileHardLimit`'s bounds
    /// (1,024..=1,073,741,816) states nothing.
    pub fn of(node: &Node) -> NodeRuntime {
        let labels = node.metadata.labels.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
        NodeRuntime {
            nofile_hard_limit: label(names::NODE_NOFILE_HARD_LIMIT_LABEL)
                .and_then(|v| v.parse::<i64>().ok())
                .filter(|n| (MIN_NOFILE_HARD_LIMIT..=MAX_NOFILE_HARD_LIMIT).contains(n)),
            sys_resource: label(names::NODE_SYS_RESOURCE_LABEL) != Some(names::UNAVAILABLE),
            host_network_namespace: label(names::NODE_HOST_NETWORK_NAMESPACE_LABEL)
                != Some(names::UNAVAILABLE),
            unsafe_sysctls: node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(names::NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION))
                .map(|list| SysctlSet::from_kubelet_list(list)),
            cgroup_mode: match label(names::NODE_CGROUP_MODE_LABEL) {
                Some("v1") => Some(CgroupMode::V1),
                Some("v2") => Some(CgroupMode::V2),
                _ => None,
            },
        }
    }

    /// What holds on a node described by both `self` and `other` (a pod may
    /// land on either): the smaller nofile limit, each capability only if
    /// both have it, cgroup v1 charges only if neither says v2.
    pub fn and(self, other: NodeRuntime) -> NodeRuntime {
        NodeRuntime {
            nofile_hard_limit: match (self.nofile_hard_limit, other.nofile_hard_limit) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            sys_resource: self.sys_resource && other.sys_resource,
            host_network_namespace: self.host_network_namespace && other.host_network_namespace,
            unsafe_sysctls: match (self.unsafe_sysctls, other.unsafe_sysctls) {
                (Some(a), Some(b)) => Some(SysctlSet(a.0 & b.0)),
                (a, b) => a.or(b),
            },
            cgroup_mode: match (self.cgroup_mode, other.cgroup_mode) {
                (Some(CgroupMode::V2), _) | (_, Some(CgroupMode::V2)) => Some(CgroupMode::V2),
                (a, b) => a.or(b),
            },
        }
    }

    /// The facts `spec.node` states (unset fields state nothing).
    fn of_spec(profile: &NodeProfile) -> NodeRuntime {
        NodeRuntime {
            nofile_hard_limit: profile.nofile_hard_limit,
            sys_resource: profile.sys_resource.unwrap_or(true),
            host_network_namespace: profile.host_network_namespace.unwrap_or(true),
            unsafe_sysctls: None,
            // The nodes' alone: `spec.node.cgroupMode` is weighed once, by
            // `capacity::cgroup_mode`, to which a cluster's plan passes only
            // a claim it can trust.
            cgroup_mode: None,
        }
    }
}

/// Smallest hard nofile limit `spec.node.nofileHardLimit` admits.
const MIN_NOFILE_HARD_LIMIT: i64 = 1024;

/// Largest hard nofile limit `spec.node.nofileHardLimit` admits (the
/// kernel's `fs.nr_open` maximum).
const MAX_NOFILE_HARD_LIMIT: i64 = 1_073_741_816;

/// kubelet's default `maxPods`, used when neither spec nor node says.
pub const DEFAULT_MAX_PODS: i64 = 110;

/// Parses a quantity to whole units (bytes for memory, CPUs rounded down).
pub fn quantity_units(q: &Quantity) -> Option<i64> {
    let parsed = ParsedQuantity::try_from(q).ok()?;
    let v = parsed.to_bytes_f64()?;
    (v.is_finite() && v >= 0.0 && v < i64::MAX as f64).then_some(v.floor() as i64)
}

/// Most CPUs of one node a plan uses: the schema's bound on `spec.node.cpus`.
pub const MAX_NODE_CPUS: i64 = 100_000;

/// Most pods of one node a plan uses: the schema's bound on `spec.node.pods`.
pub const MAX_NODE_PODS: i64 = 100_000;

/// A node's allocatable quantity in whole units, capped at `max`: what a
/// node reports is not bounded by any schema (kubelet, or anyone allowed to
/// write Node objects, sets it), and the plan only ever sees node profiles
/// within the bounds `spec.node` admits. A node bigger than that is planned
/// as the biggest admitted one. Negative or unparsable: `None`.
fn observed_units(q: &Quantity, max: i64) -> Option<i64> {
    let parsed = ParsedQuantity::try_from(q).ok()?;
    let v = parsed.to_bytes_f64()?;
    (!v.is_nan() && v >= 0.0).then(|| {
        if v >= max as f64 {
            max
        } else {
            v.floor() as i64
        }
    })
}

/// True when `toleration` tolerates `taint`: Kubernetes' rule
/// (`ToleratesTaint`, k8s.io/api/core/v1/toleration.go): an empty effect
/// matches every effect, an empty key (with `Exists`) every key, `Exists`
/// any value, `Equal` (the default) only the same value.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == taint.effect);
    let key = toleration
        .key
        .as_deref()
        .is_none_or(|k| k.is_empty() || k == taint.key);
    let value = match toleration.operator.as_deref() {
        Some("Exists") => true,
        None | Some("") | Some("Equal") => {
            toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        Some(_) => false,
    };
    effect && key && value
}

/// The nodes among `nodes` the scheduler may place a pod with
/// `tolerations` on: every `NoSchedule` and `NoExecute` taint of the node
/// tolerated (`PreferNoSchedule` only steers). A node a fleet's pods cannot
/// land on says nothing about the plan (a tainted real node with one CPU
/// must not shrink the shards of fleets that never go there).
/// Generic over how the nodes are held (`Node`, or the controller's
/// `Arc<Node>`: 500 nodes are not copied for each reconcile).
pub fn placeable<N: Borrow<Node> + Clone>(nodes: &[N], tolerations: &[Toleration]) -> Vec<N> {
    nodes
        .iter()
        .filter(|n| {
            let n: &Node = (*n).borrow();
            n.spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
                .all(|t| tolerations.iter().any(|tol| tolerates(tol, t)))
        })
        .cloned()
        .collect()
}

/// The node a fleet whose pods may land on any of `nodes` plans for: the
/// allocatable of the smallest (by memory, then CPUs), each value capped at
/// the bound the schema puts on the same `spec.node` field, with the
/// [`NodeRuntime`] facts that hold on all of them. `None` when the list is
/// empty or no node reports allocatable.
pub fn observed<N: Borrow<Node>>(nodes: &[N]) -> Option<NodeFacts> {
    let runtimes: Vec<NodeRuntime> = nodes.iter().map(|n| NodeRuntime::of(n.borrow())).collect();
    let mut runtime = runtimes
        .iter()
        .copied()
        .fold(NodeRuntime::UNKNOWN, NodeRuntime::and);
    // v1 charges a pod less: only where every node says v1.
    if runtime.cgroup_mode == Some(CgroupMode::V1)
        && runtimes.iter().any(|r| r.cgroup_mode.is_none())
    {
        runtime.cgroup_mode = None;
    }
    nodes
        .iter()
        .filter_map(|n| {
            let alloc = n.borrow().status.as_ref()?.allocatable.as_ref()?;
            Some(NodeFacts {
                memory_bytes: observed_units(alloc.get("memory")?, MAX_NODE_MEMORY_BYTES)?,
                cpus: observed_units(alloc.get("cpu")?, MAX_NODE_CPUS)?,
                pods: alloc
                    .get("pods")
                    .and_then(|p| observed_units(p, MAX_NODE_PODS))
                    .unwrap_or(DEFAULT_MAX_PODS),
                runtime,
            })
        })
        .min_by_key(|f| (f.memory_bytes, f.cpus))
}

/// `spec.node.memory` in bytes, with the schema's bounds checked offline
/// too: at most [`MAX_QUANTITY_LENGTH`] characters matching
/// [`QUANTITY_PATTERN`] (so no huge exponent reaches the parser), then
/// 64Mi..=1Pi. Errors name the field.
fn spec_memory(q: &Quantity) -> Result<i64, PlanError> {
    static PATTERN: std::sync::LazyLock<regex::Regex> =
        std::sync::LazyLock::new(|| regex::Regex::new(QUANTITY_PATTERN).expect("a valid pattern"));
    let bad = || {
        PlanError::Invalid(format!(
            "spec.node.memory must be a quantity between 64Mi and 1Pi (at most {MAX_QUANTITY_LENGTH} characters, a decimal exponent of at most 2 digits), got {:?}",
            q.0
        ))
    };
    if q.0.len() > MAX_QUANTITY_LENGTH || !PATTERN.is_match(&q.0) {
        return Err(bad());
    }
    quantity_units(q)
        .filter(|b| (MIN_NODE_MEMORY_BYTES..=MAX_NODE_MEMORY_BYTES).contains(b))
        .ok_or_else(bad)
}

/// Node profile for the spec ([`resolve_sourced`] without the sources).
pub fn resolve(
    spec: &ConnectionFleetSpec,
    observed: Option<NodeFacts>,
) -> Result<NodeFacts, PlanError> {
    resolve_sourced(spec, observed).map(|(node, _)| node)
}

/// Node profile for the spec, and where each size came from. With
/// `observed` nodes (a cluster), each size (memory, CPUs, pods) is the
/// smaller of `spec.node`'s and the nodes': a spec can plan for less than
/// the real node, never for more. Without (offline), `spec.node`'s values
/// as given. Of the [`NodeRuntime`] facts the more restrictive of spec and
/// node holds too (a spec can take a capability away, never grant one a
/// node lacks). Errors name the fields to set when neither has a value.
pub fn resolve_sourced(
    spec: &ConnectionFleetSpec,
    observed: Option<NodeFacts>,
) -> Result<(NodeFacts, NodeSource), PlanError> {
    let profile = spec.node.clone().unwrap_or_default();
    let spec_memory = profile.memory.as_ref().map(spec_memory).transpose()?;
    let memory = smaller(spec_memory, observed.map(|o| o.memory_bytes));
    let cpus = smaller(profile.cpus.map(i64::from), observed.map(|o| o.cpus));
    let (Some((memory_bytes, memory_source)), Some((cpus, cpus_source))) = (memory, cpus) else {
        return Err(PlanError::Invalid(format!(
            "no node profile: no nodes match spec.placement.nodeSelector {:?} and spec.node.memory / spec.node.cpus are not both set",
            spec.placement.node_selector
        )));
    };
    // spec.node's own values are bounded above; what falls short here is
    // the nodes'.
    if memory_bytes < MIN_NODE_MEMORY_BYTES {
        return Err(PlanError::Invalid(format!(
            "the nodes matching spec.placement.nodeSelector {:?} have {memory_bytes} bytes of allocatable memory; a plan needs at least 64Mi",
            spec.placement.node_selector
        )));
    }
    if cpus < 1 {
        return Err(PlanError::Invalid(match cpus_source {
            NodeValueSource::Spec | NodeValueSource::SpecBelowCluster => {
                format!("spec.node.cpus must be at least 1, got {cpus}")
            }
            _ => format!(
                "the nodes matching spec.placement.nodeSelector {:?} have no whole allocatable CPU; a plan needs at least 1",
                spec.placement.node_selector
            ),
        }));
    }
    let (pods, pods_source) = smaller(profile.pods.map(i64::from), observed.map(|o| o.pods))
        .unwrap_or((DEFAULT_MAX_PODS, NodeValueSource::Default));
    let runtime = observed.map_or(NodeRuntime::UNKNOWN, |o| o.runtime);
    Ok((
        NodeFacts {
            memory_bytes,
            cpus,
            pods,
            runtime: runtime.and(NodeRuntime::of_spec(&profile)),
        },
        NodeSource {
            memory: memory_source,
            cpus: cpus_source,
            pods: pods_source,
            kernel_bytes_per_socket: None,
            conntrack: None,
        },
    ))
}

/// `spec` with only the per-connection kernel claims of `spec.node` a plan
/// in a cluster can trust, and whether each claim was used (`None`: not
/// made). Neither is observable on a node, and both lower what a connection
/// costs the node, so a claim is used only where it cannot make the plan
/// pack more connections on a node, or raise its limits less, than they
/// need:
///
/// - `kernelBytesPerSocket` only at or above the measured
///   [`KERNEL_BYTES_PER_SOCKET`]; a lower claim is replaced by it;
/// - `conntrack: false` only where `conntrack_off` (the admin's policy says
///   the cluster's nodes track no connections); otherwise the plan counts
///   conntrack. `conntrack: true` is always used;
/// - `cgroupMode: v1` never: only the nodes' label makes a plan v1.
///
/// Offline the spec is the planner's own and its claims are taken as given
/// (this function is not called).
pub fn trusted_kernel_claims(
    spec: &ConnectionFleetSpec,
    conntrack_off: bool,
) -> (
    ConnectionFleetSpec,
    Option<ClaimSource>,
    Option<ClaimSource>,
) {
    let mut trusted = spec.clone();
    let Some(node) = trusted.node.as_mut() else {
        return (trusted, None, None);
    };
    let kernel = node.kernel_bytes_per_socket.map(|claim| {
        if claim >= KERNEL_BYTES_PER_SOCKET {
            ClaimSource::Spec
        } else {
            node.kernel_bytes_per_socket = Some(KERNEL_BYTES_PER_SOCKET);
            ClaimSource::SpecNotTrusted
        }
    });
    let conntrack = node.conntrack.map(|tracked| {
        if tracked || conntrack_off {
            ClaimSource::Spec
        } else {
            node.conntrack = Some(true);
            ClaimSource::SpecNotTrusted
        }
    });
    // A v1 claim charges a pod less than v2 nodes do: in a cluster only the
    // nodes' own `c10m.dev/cgroup-mode` label makes a plan v1.
    if node.cgroup_mode == Some(CgroupMode::V1) {
        node.cgroup_mode = None;
    }
    (trusted, kernel, conntrack)
}

/// One size of the node profile from `spec.node`'s value and the observed
/// nodes': the smaller, and where it came from.
fn smaller(spec: Option<i64>, node: Option<i64>) -> Option<(i64, NodeValueSource)> {
    Some(match (spec, node) {
        (Some(s), Some(n)) if s < n => (s, NodeValueSource::SpecBelowCluster),
        (Some(s), Some(n)) if s > n => (n, NodeValueSource::ClusterBelowSpec),
        (_, Some(n)) => (n, NodeValueSource::Cluster),
        (Some(s), None) => (s, NodeValueSource::Spec),
        (None, None) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn node(mem: &str, cpu: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "status": {"allocatable": {"memory": mem, "cpu": cpu, "pods": "110"}}
        }))
        .unwrap()
    }

    #[test]
    fn quantities_parse_to_units() {
        assert_eq!(quantity_units(&Quantity("256Gi".into())), Some(256 << 30));
        assert_eq!(quantity_units(&Quantity("63500m".into())), Some(63));
        assert_eq!(quantity_units(&Quantity("1G".into())), Some(1_000_000_000));
        assert_eq!(quantity_units(&Quantity("bogus".into())), None);
    }

    /// Issue 10 input: a huge decimal exponent matched the old pattern and
    /// pinned kube-apiserver's quantity parser; offline it is refused by the
    /// bounded pattern before any parser sees it, as are its kin.
    #[test]
    fn memory_quantities_are_bounded_before_parsing() {
        let with_memory = |m: serde_json::Value| -> ConnectionFleetSpec {
            serde_json::from_value(
                serde_json::json!({"connections": 1, "node": {"memory": m, "cpus": 4}}),
            )
            .unwrap()
        };
        for bad in [
            serde_json::json!("2E6024865272343"),
            serde_json::json!("1e100"),
            serde_json::json!("123456789012345678901234567890Ki"),
            serde_json::json!("2Pi"),
            serde_json::json!("63Mi"),
            serde_json::json!(1_125_899_906_842_625i64),
        ] {
            let started = std::time::Instant::now();
            let err = resolve(&with_memory(bad.clone()), None)
                .unwrap_err()
                .to_string();
            assert!(err.contains("spec.node.memory"), "{bad}: {err}");
            assert!(
                started.elapsed() < std::time::Duration::from_secs(1),
                "{bad}"
            );
        }
        for (good, bytes) in [
            (serde_json::json!("64Mi"), 64i64 << 20),
            (serde_json::json!("1Pi"), 1 << 50),
            (serde_json::json!("1e12"), 1_000_000_000_000),
            (serde_json::json!(1_125_899_906_842_624i64), 1 << 50),
        ] {
            assert_eq!(
                resolve(&with_memory(good), None).unwrap().memory_bytes,
                bytes
            );
        }
    }

    #[test]
    fn smallest_node_wins_and_a_smaller_spec_value_restricts_it() {
        let nodes = vec![node("256Gi", "64"), node("128Gi", "32")];
        let obs = observed(&nodes).unwrap();
        assert_eq!(
            obs,
            NodeFacts {
                memory_bytes: 128 << 30,
                cpus: 32,
                pods: 110,
                runtime: crate::plan::NodeRuntime::UNKNOWN,
            }
        );
        let mut spec: ConnectionFleetSpec =
            serde_json::from_value(serde_json::json!({"connections": 1, "node": {"cpus": 16}}))
                .unwrap();
        let r = resolve(&spec, Some(obs)).unwrap();
        assert_eq!((r.memory_bytes, r.cpus), (128 << 30, 16));
        spec.node = None;
        spec.placement.node_selector = BTreeMap::from([("pool".into(), "edge".into())]);
        let err = resolve(&spec, None).unwrap_err().to_string();
        assert!(
            err.contains("spec.placement.nodeSelector") && err.contains("pool"),
            "{err}"
        );
    }

    fn sized(node: serde_json::Value) -> ConnectionFleetSpec {
        serde_json::from_value(serde_json::json!({"connections": 1, "node": node})).unwrap()
    }

    const SMALL: NodeFacts = NodeFacts {
        memory_bytes: 8 << 30,
        cpus: 4,
        pods: 110,
        runtime: NodeRuntime::UNKNOWN,
    };

    fn source(memory: NodeValueSource, cpus: NodeValueSource, pods: NodeValueSource) -> NodeSource {
        NodeSource {
            memory,
            cpus,
            pods,
            kernel_bytes_per_socket: None,
            conntrack: None,
        }
    }

    /// Issue 13: in a cluster, a fleet's `spec.node` claim of a bigger node
    /// is not used; the plan's node is the smallest matching node, and says
    /// the claim was passed over.
    #[test]
    fn a_claim_bigger_than_the_nodes_is_planned_at_the_nodes_size() {
        use NodeValueSource::*;
        let claim = sized(serde_json::json!({"memory": "1Pi", "cpus": 100_000, "pods": 100_000}));
        let nodes = [node("16Gi", "8"), node("8Gi", "4")];
        let (facts, from) = resolve_sourced(&claim, observed(&nodes)).unwrap();
        assert_eq!(facts, SMALL);
        assert_eq!(
            from,
            source(ClusterBelowSpec, ClusterBelowSpec, ClusterBelowSpec)
        );
        // A claim of the nodes' own size is the cluster's value.
        let same = sized(serde_json::json!({"memory": "8Gi", "cpus": 4, "pods": 110}));
        let (facts, from) = resolve_sourced(&same, Some(SMALL)).unwrap();
        assert_eq!(facts, SMALL);
        assert_eq!(from, source(Cluster, Cluster, Cluster));
        // Without spec.node, the cluster's values.
        let (facts, from) = resolve_sourced(&sized(serde_json::json!({})), Some(SMALL)).unwrap();
        assert_eq!(facts, SMALL);
        assert_eq!(from, source(Cluster, Cluster, Cluster));
    }

    /// A `spec.node` value below the nodes' is a hint the plan uses (a plan
    /// for a smaller node fits the real one), reported as such; each size
    /// on its own.
    #[test]
    fn a_smaller_spec_hint_wins_and_says_so() {
        use NodeValueSource::*;
        let hint = sized(serde_json::json!({"memory": "4Gi", "cpus": 8, "pods": 20}));
        let (facts, from) = resolve_sourced(&hint, Some(SMALL)).unwrap();
        assert_eq!(
            (facts.memory_bytes, facts.cpus, facts.pods),
            (4 << 30, 4, 20)
        );
        assert_eq!(
            from,
            source(SpecBelowCluster, ClusterBelowSpec, SpecBelowCluster)
        );
        assert_eq!(resolve(&hint, Some(SMALL)).unwrap(), facts);
    }

    /// Offline (no nodes to compare with) `spec.node` is taken as given, as
    /// before; kubelet's default fills pods.
    #[test]
    fn offline_the_spec_is_taken_as_given() {
        use NodeValueSource::*;
        let claim = sized(serde_json::json!({"memory": "1Pi", "cpus": 100_000}));
        let (facts, from) = resolve_sourced(&claim, None).unwrap();
        assert_eq!(
            (facts.memory_bytes, facts.cpus, facts.pods),
            (1 << 50, 100_000, DEFAULT_MAX_PODS)
        );
        assert_eq!(from, source(Spec, Spec, Default));
        let with_pods = sized(serde_json::json!({"memory": "1Gi", "cpus": 2, "pods": 7}));
        assert_eq!(resolve_sourced(&with_pods, None).unwrap().1.pods, Spec);
    }

    /// What falls short of a plan's minimum names where it came from.
    #[test]
    fn too_small_a_node_names_its_source() {
        let tiny = NodeFacts {
            memory_bytes: 1 << 20,
            cpus: 0,
            ..SMALL
        };
        let err = resolve(&sized(serde_json::json!({"memory": "1Gi"})), Some(tiny))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.placement.nodeSelector") && err.contains("64Mi"),
            "{err}"
        );
        let err = resolve(
            &sized(serde_json::json!({"cpus": 2})),
            Some(NodeFacts { cpus: 0, ..SMALL }),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("spec.placement.nodeSelector"), "{err}");
    }

    proptest::proptest! {
        /// In a cluster a size is never above the nodes' nor the spec's.
        #[test]
        fn a_spec_never_plans_a_node_above_the_real_one(
            (mem_mi, cpus, pods) in (64i64..=1 << 30, 1i32..=100_000, 1i32..=100_000),
            (node_mem, node_cpus, node_pods) in (64i64 << 20..=1 << 50, 1i64..=100_000, 1i64..=100_000),
        ) {
            let spec = sized(serde_json::json!({"memory": format!("{mem_mi}Mi"), "cpus": cpus, "pods": pods}));
            let real = NodeFacts { memory_bytes: node_mem, cpus: node_cpus, pods: node_pods, runtime: NodeRuntime::UNKNOWN };
            let (facts, _) = resolve_sourced(&spec, Some(real)).unwrap();
            proptest::prop_assert_eq!(facts.memory_bytes, node_mem.min(mem_mi << 20));
            proptest::prop_assert_eq!(facts.cpus, node_cpus.min(cpus.into()));
            proptest::prop_assert_eq!(facts.pods, node_pods.min(pods.into()));
        }
    }

    /// A Node's allocatable is not bounded by any schema: a node reporting
    /// 9×10^12 CPUs and pods made the planner loop over every pod slot (the
    /// reconcile never returned) and overflow in debug builds. Observed
    /// values are capped at the bounds `spec.node` admits.
    #[test]
    fn absurd_node_allocatable_is_capped_to_the_admitted_profile() {
        let node = |mem: &str, cpu: &str, pods: &str| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n"},
                "status": {"allocatable": {"memory": mem, "cpu": cpu, "pods": pods}}
            }))
            .unwrap()
        };
        let spec: ConnectionFleetSpec = serde_json::from_value(
            serde_json::json!({"connections": 1_000_000, "shard": {"cpus": 1}}),
        )
        .unwrap();
        for (mem, cpu, pods) in [
            ("1Pi", "9000000000000", "9000000000000"),
            ("16Pi", "4096", "110"),
            ("1e15", "1e12", "1e12"),
            ("256Gi", "64", "0"),
        ] {
            let obs = observed(&[node(mem, cpu, pods)])
                .unwrap_or_else(|| panic!("{mem} {cpu} {pods}: no profile"));
            assert!(obs.memory_bytes <= MAX_NODE_MEMORY_BYTES, "{obs:?}");
            assert!(
                obs.cpus <= MAX_NODE_CPUS && obs.pods <= MAX_NODE_PODS,
                "{obs:?}"
            );
            let started = std::time::Instant::now();
            let _ = crate::plan::plan(&spec, resolve(&spec, Some(obs)).unwrap());
            assert!(
                started.elapsed() < std::time::Duration::from_secs(5),
                "{mem} {cpu} {pods}: {:?}",
                started.elapsed()
            );
        }
        // Negative, or past what the parser holds (a decimal beyond ~7.9e28):
        // no profile from that node, never a panic.
        assert_eq!(observed(&[node("-1Gi", "64", "110")]), None);
        assert_eq!(observed(&[node("9e30", "64", "110")]), None);
    }

    /// The caps are the schema's own bounds on `spec.node.cpus` and `pods`.
    #[test]
    fn caps_match_the_schema() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(crate::api::ConnectionFleet::crd()).unwrap();
        let node = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["node"]["properties"];
        assert_eq!(node["cpus"]["maximum"].as_f64(), Some(MAX_NODE_CPUS as f64));
        assert_eq!(node["pods"]["maximum"].as_f64(), Some(MAX_NODE_PODS as f64));
    }

    fn labelled(labels: serde_json::Value) -> Node {
        let mut n = node("256Gi", "64");
        n.metadata.labels = serde_json::from_value(labels).unwrap();
        n
    }

    /// Issue 9: node-fact labels reach the plan's node, and a pod that may
    /// land on any of the nodes gets what holds on all of them.
    #[test]
    fn runtime_facts_come_from_node_labels_and_hold_on_every_node() {
        let real = labelled(serde_json::json!({
            "c10m.dev/nofile-hard-limit": "20000",
            "c10m.dev/sys-resource": "unavailable",
            "c10m.dev/host-network-namespace": "unavailable",
        }));
        let plain = labelled(serde_json::json!({"c10m.dev/nofile-hard-limit": "524288"}));
        assert_eq!(
            NodeRuntime::of(&real),
            NodeRuntime {
                nofile_hard_limit: Some(20_000),
                sys_resource: false,
                host_network_namespace: false,
                unsafe_sysctls: None,
                cgroup_mode: None,
            }
        );
        assert_eq!(NodeRuntime::of(&node("1Gi", "1")), NodeRuntime::UNKNOWN);
        let both = observed(&[plain.clone(), real]).unwrap().runtime;
        assert_eq!(both.nofile_hard_limit, Some(20_000));
        assert!(!both.sys_resource && !both.host_network_namespace);
        let one = observed(&[plain]).unwrap().runtime;
        assert_eq!(one.nofile_hard_limit, Some(524_288));
        assert!(one.sys_resource && one.host_network_namespace);
        for bad in ["lots", "-5", "1023", "1073741817", "20000 "] {
            let n = labelled(serde_json::json!({"c10m.dev/nofile-hard-limit": bad}));
            assert_eq!(NodeRuntime::of(&n).nofile_hard_limit, None, "{bad:?}");
        }
    }

    /// A tainted node is planned for only by fleets that tolerate the
    /// taint (the test plane's real node: 1 CPU, no SYS_RESOURCE).
    #[test]
    fn only_nodes_whose_taints_are_tolerated_are_planned_for() {
        let mut real = labelled(serde_json::json!({"c10m.dev/sys-resource": "unavailable"}));
        real.spec = serde_json::from_value(serde_json::json!({"taints": [
            {"key": "c10m.dev/real-node", "value": "true", "effect": "NoSchedule"},
            {"key": "soft", "effect": "PreferNoSchedule"}
        ]}))
        .unwrap();
        let kwok = node("256Gi", "64");
        let tol = |v: serde_json::Value| -> Vec<Toleration> { serde_json::from_value(v).unwrap() };
        let none = placeable(&[real.clone(), kwok.clone()], &[]);
        assert_eq!(none.len(), 1);
        assert!(observed(&none).unwrap().runtime.sys_resource);
        for (t, fits) in [
            (
                serde_json::json!([{"key": "c10m.dev/real-node", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]),
                true,
            ),
            (
                serde_json::json!([{"key": "c10m.dev/real-node", "value": "true"}]),
                true,
            ),
            (
                serde_json::json!([{"key": "c10m.dev/real-node", "operator": "Exists"}]),
                true,
            ),
            (serde_json::json!([{"operator": "Exists"}]), true),
            (
                serde_json::json!([{"key": "c10m.dev/real-node", "value": "false"}]),
                false,
            ),
            (
                serde_json::json!([{"key": "c10m.dev/real-node", "operator": "Exists", "effect": "NoExecute"}]),
                false,
            ),
            (
                serde_json::json!([{"key": "other", "operator": "Exists"}]),
                false,
            ),
        ] {
            let nodes = placeable(&[real.clone(), kwok.clone()], &tol(t.clone()));
            assert_eq!(nodes.len(), if fits { 2 } else { 1 }, "{t}");
        }
    }

    /// The kubelet's `allowedUnsafeSysctls` syntax: names and `prefix*`.
    #[test]
    fn kubelet_unsafe_sysctl_lists_parse_names_and_prefixes() {
        let set = SysctlSet::from_kubelet_list("net.core.somaxconn, kernel.msg*");
        assert!(set.contains(Sysctl::Somaxconn));
        assert!(!set.contains(Sysctl::TcpMaxSynBacklog));
        let set = SysctlSet::from_kubelet_list("net.ipv4.tcp_*");
        assert!(set.contains(Sysctl::TcpMaxSynBacklog) && set.contains(Sysctl::TcpMigrateReq));
        assert!(!set.contains(Sysctl::Somaxconn));
        assert_eq!(SysctlSet::from_kubelet_list(""), SysctlSet::default());
        let mut a = labelled(serde_json::json!({}));
        a.metadata.annotations = Some(
            [(
                "c10m.dev/allowed-unsafe-sysctls".to_string(),
                "net.core.somaxconn,net.ipv4.tcp_max_syn_backlog".to_string(),
            )]
            .into(),
        );
        let mut b = a.clone();
        b.metadata.annotations = Some(
            [(
                "c10m.dev/allowed-unsafe-sysctls".to_string(),
                "net.core.*".to_string(),
            )]
            .into(),
        );
        let both = observed(&[a, b]).unwrap().runtime.unsafe_sysctls.unwrap();
        assert!(both.contains(Sysctl::Somaxconn));
        assert!(!both.contains(Sysctl::TcpMaxSynBacklog));
    }

    /// A spec can take a capability away or lower the nofile limit, never
    /// grant what the cluster's nodes say they lack.
    #[test]
    fn a_spec_restricts_runtime_facts_but_never_grants_them() {
        let observed_node = NodeFacts {
            memory_bytes: 1 << 30,
            cpus: 2,
            pods: 110,
            runtime: NodeRuntime {
                nofile_hard_limit: Some(20_000),
                sys_resource: false,
                host_network_namespace: true,
                unsafe_sysctls: None,
                cgroup_mode: None,
            },
        };
        let with = |n: serde_json::Value| -> NodeRuntime {
            let spec: ConnectionFleetSpec =
                serde_json::from_value(serde_json::json!({"connections": 1, "node": n})).unwrap();
            resolve(&spec, Some(observed_node)).unwrap().runtime
        };
        let claims = with(serde_json::json!({
            "sysResource": true, "hostNetworkNamespace": true, "nofileHardLimit": 1_000_000
        }));
        assert_eq!(claims, observed_node.runtime);
        let lowers =
            with(serde_json::json!({"hostNetworkNamespace": false, "nofileHardLimit": 4096}));
        assert_eq!(
            lowers,
            NodeRuntime {
                nofile_hard_limit: Some(4096),
                sys_resource: false,
                host_network_namespace: false,
                unsafe_sysctls: None,
                cgroup_mode: None,
            }
        );
        // Offline (no cluster): the spec's word.
        let spec: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 1,
            "node": {"memory": "1Gi", "cpus": 2, "sysResource": false}
        }))
        .unwrap();
        let offline = resolve(&spec, None).unwrap().runtime;
        assert!(!offline.sys_resource && offline.host_network_namespace);
        assert_eq!(offline.nofile_hard_limit, None);
    }

    #[test]
    fn kernel_claims_are_trusted_only_where_they_cost_no_less() {
        use ClaimSource::{Spec, SpecNotTrusted};
        let with = |node: serde_json::Value| -> ConnectionFleetSpec {
            serde_json::from_value(serde_json::json!({"connections": 1, "node": node})).unwrap()
        };
        let claims = |s: &ConnectionFleetSpec| {
            let n = s.node.clone().unwrap_or_default();
            (n.kernel_bytes_per_socket, n.conntrack)
        };
        // Cheaper than measured: not used, under the default policy.
        let cheap = with(serde_json::json!({"kernelBytesPerSocket": 0, "conntrack": false}));
        let (t, k, c) = trusted_kernel_claims(&cheap, false);
        assert_eq!(claims(&t), (Some(KERNEL_BYTES_PER_SOCKET), Some(true)));
        assert_eq!((k, c), (Some(SpecNotTrusted), Some(SpecNotTrusted)));
        // Where the admin says nodes track no connections, conntrack: false is used.
        let (t, k, c) = trusted_kernel_claims(&cheap, true);
        assert_eq!(claims(&t), (Some(KERNEL_BYTES_PER_SOCKET), Some(false)));
        assert_eq!((k, c), (Some(SpecNotTrusted), Some(Spec)));
        // At or above the measured cost: used as given.
        for bytes in [KERNEL_BYTES_PER_SOCKET, 8000] {
            let dear = with(serde_json::json!({"kernelBytesPerSocket": bytes, "conntrack": true}));
            let (t, k, c) = trusted_kernel_claims(&dear, false);
            assert_eq!(claims(&t), (Some(bytes), Some(true)));
            assert_eq!((k, c), (Some(Spec), Some(Spec)));
            assert_eq!(t, dear);
        }
        // No claim: nothing to say, the spec unchanged.
        for plain in [
            with(serde_json::json!({"memory": "8Gi"})),
            serde_json::from_value(serde_json::json!({"connections": 1})).unwrap(),
        ] {
            let (t, k, c) = trusted_kernel_claims(&plain, false);
            assert_eq!((t, k, c), (plain, None, None));
        }
    }
}
