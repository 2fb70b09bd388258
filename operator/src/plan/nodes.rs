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

/// Allocatable of the smallest of `nodes` (by memory, then CPUs), or `None`
/// when the list is empty or no node reports allocatable.
pub fn smallest_allocatable(nodes: &[Node]) -> Option<NodeFacts> {
    nodes
        .iter()
        .filter_map(|n| {
            let alloc = n.status.as_ref()?.allocatable.as_ref()?;
            Some(NodeFacts {
                memory_bytes: quantity_units(alloc.get("memory")?)?,
                cpus: quantity_units(alloc.get("cpu")?)?,
                pods: alloc
                    .get("pods")
                    .and_then(quantity_units)
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
}
