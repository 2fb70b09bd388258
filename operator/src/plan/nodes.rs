//! The node profile a plan uses: spec values first, else the allocatable of
//! the smallest node matching `placement.nodeSelector` (pure).

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;

use super::PlanError;
use crate::api::{
    ConnectionFleetSpec, MAX_NODE_MEMORY_BYTES, MAX_QUANTITY_LENGTH, MIN_NODE_MEMORY_BYTES,
    QUANTITY_PATTERN,
};

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

/// Allocatable of the smallest of `nodes` (by memory, then CPUs), or `None`
/// when the list is empty or no node reports allocatable. Each value is
/// capped at the bound the schema puts on the same `spec.node` field.
pub fn smallest_allocatable(nodes: &[Node]) -> Option<NodeFacts> {
    nodes
        .iter()
        .filter_map(|n| {
            let alloc = n.status.as_ref()?.allocatable.as_ref()?;
            Some(NodeFacts {
                memory_bytes: observed_units(alloc.get("memory")?, MAX_NODE_MEMORY_BYTES)?,
                cpus: observed_units(alloc.get("cpu")?, MAX_NODE_CPUS)?,
                pods: alloc
                    .get("pods")
                    .and_then(|p| observed_units(p, MAX_NODE_PODS))
                    .unwrap_or(DEFAULT_MAX_PODS),
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

/// Node profile for the spec: each `spec.node` field wins, the observed
/// node fills the rest. Errors name the fields to set when neither has a value.
pub fn resolve(
    spec: &ConnectionFleetSpec,
    observed: Option<NodeFacts>,
) -> Result<NodeFacts, PlanError> {
    let profile = spec.node.clone().unwrap_or_default();
    let memory = match &profile.memory {
        Some(q) => Some(spec_memory(q)?),
        None => observed.map(|o| o.memory_bytes),
    };
    let cpus = profile.cpus.map(i64::from).or(observed.map(|o| o.cpus));
    let (Some(memory_bytes), Some(cpus)) = (memory, cpus) else {
        return Err(PlanError::Invalid(format!(
            "no node profile: no nodes match spec.placement.nodeSelector {:?} and spec.node.memory / spec.node.cpus are not both set",
            spec.placement.node_selector
        )));
    };
    if memory_bytes < MIN_NODE_MEMORY_BYTES {
        return Err(PlanError::Invalid(format!(
            "spec.node.memory must be at least 64Mi, got {memory_bytes} bytes"
        )));
    }
    if cpus < 1 {
        return Err(PlanError::Invalid("node CPUs must be at least 1".into()));
    }
    let pods = profile
        .pods
        .map(i64::from)
        .or(observed.map(|o| o.pods))
        .unwrap_or(DEFAULT_MAX_PODS);
    Ok(NodeFacts {
        memory_bytes,
        cpus,
        pods,
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
    fn smallest_node_wins_and_spec_overrides() {
        let nodes = vec![node("256Gi", "64"), node("128Gi", "32")];
        let obs = smallest_allocatable(&nodes).unwrap();
        assert_eq!(
            obs,
            NodeFacts {
                memory_bytes: 128 << 30,
                cpus: 32,
                pods: 110
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
            let obs = smallest_allocatable(&[node(mem, cpu, pods)])
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
        assert_eq!(smallest_allocatable(&[node("-1Gi", "64", "110")]), None);
        assert_eq!(smallest_allocatable(&[node("9e30", "64", "110")]), None);
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
}
