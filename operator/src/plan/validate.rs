//! What the schema cannot check (or what a cluster without the schema's
//! validation lets through), and the values only validation derives: the
//! backend's user bytes and the node price, each parsed once here.

use crate::api::sysctl::{Scope, Sysctl};
use crate::api::{BackendModel, ConnectionFleetSpec};

use super::PlanError;
use super::kernel::{EPOLL_USER_BYTES, GOROUTINE_USER_BYTES};

/// A spec that passed [`validate`], with the values validation parsed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Validated {
    /// User-space bytes per connection of the backend (or its override).
    pub user_bytes: i64,
    /// `spec.node.pricePerHour` in USD, when given.
    pub price_per_hour: Option<f64>,
}

/// User-space bytes per connection of the spec's backend model (or its override).
fn user_bytes(spec: &ConnectionFleetSpec) -> Result<i64, PlanError> {
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
fn price_per_hour(spec: &ConnectionFleetSpec) -> Result<Option<f64>, PlanError> {
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
pub fn validate(spec: &ConnectionFleetSpec) -> Result<Validated, PlanError> {
    let bad = |m: String| Err(PlanError::Invalid(m));
    if !(1..=crate::api::MAX_CONNECTIONS).contains(&spec.connections) {
        return bad(format!(
            "spec.connections must be 1..=10000000000, got {}",
            spec.connections
        ));
    }
    let user_bytes = user_bytes(spec)?;
    let price_per_hour = price_per_hour(spec)?;
    let sh = &spec.shard;
    if let Some(c) = sh.cpus
        && !(1..=1024).contains(&c)
    {
        return bad(format!("spec.shard.cpus must be 1..=1024, got {c}"));
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
    if let Some(c) = spec.backend.connections_per_cpu
        && !(1..=crate::api::MAX_CONNECTIONS).contains(&c)
    {
        return bad(format!(
            "spec.backend.connectionsPerCpu must be 1..=10000000000, got {c}"
        ));
    }
    for (field, percent) in [
        ("queuedPercent", spec.backend.queued_percent),
        ("slowReaderPercent", spec.backend.slow_reader_percent),
    ] {
        if !(0..=100).contains(&percent) {
            return bad(format!(
                "spec.backend.{field} must be 0..=100, got {percent}"
            ));
        }
    }
    let refill = spec.availability.refill_budget_seconds;
    if !(1..=86_400).contains(&refill) {
        return bad(format!(
            "spec.availability.refillBudgetSeconds must be 1..=86400, got {refill}"
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
    if let Some(n) = spec.node.as_ref().and_then(|n| n.nofile_hard_limit)
        && !(1024..=1_073_741_816).contains(&n)
    {
        return bad(format!(
            "spec.node.nofileHardLimit must be 1024..=1073741816, got {n}"
        ));
    }
    if let Some(p) = spec.node.as_ref().and_then(|n| n.pods)
        && !(1..=100_000).contains(&p)
    {
        return bad(format!("spec.node.pods must be 1..=100000, got {p}"));
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
    if spec.sysctls.image.is_some() {
        return bad(crate::api::SYSCTL_IMAGE_REFUSED.into());
    }
    for name in &spec.sysctls.allowed_unsafe {
        if Sysctl::from_name(name).map(Sysctl::scope) != Some(Scope::Namespaced) {
            return bad(format!(
                "spec.sysctls.allowedUnsafe: {name:?} is not a namespaced sysctl the plan uses; node-level sysctls cannot be set through a pod securityContext"
            ));
        }
    }
    Ok(Validated {
        user_bytes,
        price_per_hour,
    })
}

/// The `spec.metrics` query templates of fleet `fleet` in `namespace` can be
/// confined to the fleet's own series and to the admin's `policy` matchers
/// for the namespace ([`crate::promql::render`]): the operator runs them
/// with its own Prometheus access, so a query reaching for other tenants'
/// series, or past the policy's matchers, is refused, naming the field.
pub fn queries(
    spec: &ConnectionFleetSpec,
    namespace: &str,
    fleet: &str,
    policy: &[(String, String)],
) -> Result<(), PlanError> {
    let m = &spec.metrics;
    for (field, template) in [
        ("connectionsQuery", &m.connections_query),
        ("socketMemoryQuery", &m.socket_memory_query),
        ("upQuery", &m.up_query),
    ] {
        crate::promql::render(template, namespace, fleet, policy)
            .map_err(|e| PlanError::Invalid(format!("spec.metrics.{field}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_queries_confine_and_foreign_ones_are_refused() {
        let mut spec: ConnectionFleetSpec =
            serde_json::from_value(serde_json::json!({"connections": 1})).unwrap();
        queries(&spec, "team-a", "edge", &[]).unwrap();
        spec.metrics.connections_query =
            r#"sum by (pod) (c10m_connections{namespace="team-b"})"#.into();
        let err = queries(&spec, "team-a", "edge", &[])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("spec.metrics.connectionsQuery: "), "{err}");
        spec.metrics.connections_query = "sum(".into();
        assert!(queries(&spec, "team-a", "edge", &[]).is_err());
        // A range vector has no one value per shard: refused before any read.
        spec.metrics.connections_query = "c10m_connections[5m]".into();
        let err = queries(&spec, "team-a", "edge", &[])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "spec.metrics.connectionsQuery: the query's answer is a range vector; an instant vector or a scalar is read"
        );
    }

    #[test]
    fn queries_past_the_policy_matchers_are_refused_naming_the_field() {
        let mut spec: ConnectionFleetSpec =
            serde_json::from_value(serde_json::json!({"connections": 1})).unwrap();
        let eu = [("cluster".to_string(), "eu-1".to_string())];
        queries(&spec, "team-a", "edge", &eu).unwrap();
        spec.metrics.up_query = r#"up{cluster="us-2"}"#.into();
        let err = queries(&spec, "team-a", "edge", &eu)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("spec.metrics.upQuery: "), "{err}");
        assert!(err.contains("policy (queryMatchers)"), "{err}");
        queries(&spec, "team-a", "edge", &[]).unwrap();
    }
}
