//! Every spec the CRD's schema admits plans without a panic: a property
//! test whose specs are drawn from the generated CRD's own bounds (each
//! integer field at its minimum, maximum, next to them or anywhere between;
//! each enum value; quantity strings of every admitted shape), so a field
//! added without a bound, or arithmetic that overflows inside the bounds,
//! fails here. `plan` must return a plan that passes [`super::check`] or a
//! named error.

use kube::CustomResourceExt;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

use super::{NodeFacts, check, nodes, plan};
use crate::api::{ConnectionFleet, ConnectionFleetSpec};

/// Quantity strings of every shape the schema's pattern admits, sane and not.
const QUANTITIES: &[&str] = &[
    "64Mi",
    "256Gi",
    "1Pi",
    "1Ei",
    "64M",
    "1",
    "0.5Gi",
    ".5Ti",
    "1e9",
    "1E+12",
    "2E6024865272343",
    "999999999999999999999999",
    "1.000000000000000000001Gi",
    "123456789012345678901234567890Ki",
];

/// A stream of choices, drawn from proptest's seeds.
struct Choices<'a>(std::slice::Iter<'a, u64>);

impl Choices<'_> {
    fn next(&mut self) -> u64 {
        self.0.next().copied().unwrap_or(0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A value for `schema`, drawn from its bounds.
fn draw(schema: &Value, c: &mut Choices) -> Option<Value> {
    if schema.get("x-kubernetes-int-or-string").is_some() {
        return Some(if c.below(2) == 0 {
            json!(QUANTITIES[c.below(QUANTITIES.len() as u64) as usize])
        } else {
            draw_int(schema, c)
        });
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return Some(values[c.below(values.len() as u64) as usize].clone());
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("integer") => Some(draw_int(schema, c)),
        Some("boolean") => Some(json!(c.below(2) == 0)),
        Some("object") => {
            let props = schema.get("properties").and_then(Value::as_object)?;
            let mut out = Map::new();
            for (k, sub) in props {
                let required = schema
                    .get("required")
                    .and_then(Value::as_array)
                    .is_some_and(|r| r.iter().any(|x| x == k));
                if (required || c.below(3) != 0)
                    && let Some(v) = draw(sub, c)
                {
                    out.insert(k.clone(), v);
                }
            }
            Some(Value::Object(out))
        }
        // Strings (images, queries, prices) and arrays keep their defaults:
        // they feed no arithmetic.
        _ => None,
    }
}

fn draw_int(schema: &Value, c: &mut Choices) -> Value {
    let int64 = schema.get("format").and_then(Value::as_str) == Some("int64");
    let (lo_default, hi_default) = if int64 {
        (i64::MIN, i64::MAX)
    } else {
        (i32::MIN as i64, i32::MAX as i64)
    };
    let lo = schema
        .get("minimum")
        .and_then(Value::as_f64)
        .map_or(lo_default, |v| v as i64);
    let hi = schema
        .get("maximum")
        .and_then(Value::as_f64)
        .map_or(hi_default, |v| v as i64);
    let span = (hi as i128 - lo as i128 + 1) as u128;
    let v = match c.below(5) {
        0 => lo,
        1 => hi,
        2 => lo.saturating_add(1).min(hi),
        3 => hi.saturating_sub(1).max(lo),
        _ => (lo as i128 + (c.next() as u128 % span) as i128) as i64,
    };
    json!(v)
}

fn spec_schema() -> Value {
    let crd = serde_json::to_value(ConnectionFleet::crd()).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn every_admitted_spec_plans_or_names_its_error(seeds in prop::collection::vec(any::<u64>(), 96)) {
        let schema = spec_schema();
        let value = draw(&schema, &mut Choices(seeds.iter())).unwrap();
        // Values the schema admits always deserialize.
        let spec: ConnectionFleetSpec = serde_json::from_value(value.clone())
            .unwrap_or_else(|e| panic!("{e}: {value}"));
        let observed = NodeFacts { memory_bytes: 256 << 30, cpus: 64, pods: 110, runtime: crate::plan::NodeRuntime::UNKNOWN };
        let node = match nodes::resolve(&spec, Some(observed)) {
            Ok(node) => node,
            Err(e) => {
                prop_assert!(e.to_string().contains("spec."), "{value}: error names no field: {e}");
                return Ok(());
            }
        };
        match plan(&spec, node) {
            Ok(p) => prop_assert!(check(&spec, &p).is_empty(), "{value}: violates {:?}", check(&spec, &p)),
            Err(e) => prop_assert!(e.to_string().contains("spec."), "{value}: error names no field: {e}"),
        }
    }
}
