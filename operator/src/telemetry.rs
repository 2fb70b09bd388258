//! The operator's own metrics and health endpoints (`--metrics-addr`):
//! `GET /metrics` (Prometheus text via prometheus-client), `GET /healthz`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok`, or the step that failed (`observe_error`, `apply_error`,
    /// `metrics_loop_error`, `report_error`).
    pub result: String,
}

/// Labels of a request to the Kubernetes API: its HTTP method (`GET`, also
/// for lists and watches; `POST`, `PUT`, `PATCH` (server-side applies
/// too), `DELETE`), as client-go's `rest_client_requests_total` labels it,
/// and the resource it names ([`api_resource`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The HTTP method.
    pub method: String,
    /// `resource[.group][/subresource]`, as [`api_resource`] names it.
    pub resource: String,
}

/// The resource a Kubernetes API request `path` names, as
/// `resource[.group][/subresource]` (the API server's
/// `apiserver_request_total` labels `resource`, `group` and `subresource`,
/// joined): `secrets`, `replicasets.apps`,
/// `connectionfleets.c10m.dev/status`, `namespaces`. A path that names no
/// resource (discovery, `/version`, `/healthz`) is `other`; a prefix
/// before `/api` or `/apis` (a proxy's, in the kubeconfig's server URL) is
/// skipped. The operator
/// touches about fifteen, so the label's values stay few.
pub fn api_resource(path: &str) -> String {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // A kubeconfig's server URL may carry a path prefix (a proxy's).
    let from = (parts.iter())
        .position(|p| matches!(*p, "api" | "apis"))
        .unwrap_or(parts.len());
    let (group, rest) = match &parts[from..] {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return "other".into(),
    };
    let (resource, subresource) = match rest {
        [] => return "other".into(),
        // A namespace itself, or its status/finalize subresource.
        ["namespaces"] | ["namespaces", _] => ("namespaces", None),
        ["namespaces", _, sub @ ("status" | "finalize")] => ("namespaces", Some(*sub)),
        // A namespaced resource: its collection, an object, a subresource.
        ["namespaces", _, resource, more @ ..] => (*resource, more.get(1).copied()),
        // A cluster-scoped resource.
        [resource, more @ ..] => (*resource, more.get(1).copied()),
    };
    let mut label = resource.to_string();
    if !group.is_empty() {
        label.push('.');
        label.push_str(group);
    }
    if let Some(sub) = subresource {
        label.push('/');
        label.push_str(sub);
    }
    label
}

/// Operator metrics.
pub struct Metrics {
    registry: Registry,
    /// `c10m_operator_reconciliations_total{result}`.
    pub reconciliations: Family<ResultLabel, Counter>,
    /// `c10m_operator_reconcile_duration_seconds`: seconds per reconcile.
    pub reconcile_duration: Histogram,
    /// `c10m_operator_leader`: 1 while this replica acts (holds the leader
    /// Lease, or runs without leader election), else 0.
    pub leader: Gauge,
    /// `c10m_operator_api_requests_total{method,resource}`: requests this
    /// process sent to the Kubernetes API ([`Metrics::count_request`]).
    pub api_requests: Family<RequestLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("c10m_operator");
        let reconciliations = Family::<ResultLabel, Counter>::default();
        registry.register(
            "reconciliations",
            "Reconciles of ConnectionFleets by result",
            reconciliations.clone(),
        );
        // 1 ms .. ~16 s.
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register_with_unit(
            "reconcile_duration",
            "Time one reconcile of a ConnectionFleet takes",
            prometheus_client::registry::Unit::Seconds,
            reconcile_duration.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica is the leader that reconciles (always 1 without --leader-elect)",
            leader.clone(),
        );
        let api_requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "api_requests",
            "Requests sent to the Kubernetes API by HTTP method (a write is anything but GET) and resource",
            api_requests.clone(),
        );
        Metrics {
            registry,
            reconciliations,
            reconcile_duration,
            leader,
            api_requests,
        }
    }
}

impl Metrics {
    /// Records one reconcile that ended with `result` (see [`ResultLabel`]).
    pub fn observe(&self, result: &str, took: Duration) {
        let result = result.to_string();
        self.reconciliations
            .get_or_create(&ResultLabel { result })
            .inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    /// Counts one request to the Kubernetes API sent with `method` to
    /// `path` (its resource: [`api_resource`]).
    pub fn count_request(&self, method: &http::Method, path: &str) {
        self.api_requests
            .get_or_create(&RequestLabels {
                method: method.as_str().to_string(),
                resource: api_resource(path),
            })
            .inc();
    }

    /// Sets `c10m_operator_leader`.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Serves `/metrics` and `/healthz` on `addr` until the process exits.
pub async fn serve(addr: String, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(|| async { (StatusCode::OK, "ok").into_response() }),
        );
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on --metrics-addr {addr}: {e}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    axum::serve(listener, app).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_reconciles_by_result() {
        let m = Metrics::default();
        m.observe("ok", Duration::from_millis(3));
        m.observe("ok", Duration::from_millis(5));
        m.observe("apply_error", Duration::from_millis(7));
        let text = m.encode();
        assert!(
            text.contains(r#"c10m_operator_reconciliations_total{result="ok"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"c10m_operator_reconciliations_total{result="apply_error"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("c10m_operator_reconcile_duration_seconds_count 3"),
            "{text}"
        );
        assert!(text.contains("c10m_operator_leader 0"), "{text}");
        m.set_leader(true);
        assert!(m.encode().contains("c10m_operator_leader 1"));
    }

    #[test]
    fn requests_are_counted_by_method_and_the_resource_their_path_names() {
        let cases = [
            ("/api/v1/namespaces/prod/secrets/edge-admin", "secrets"),
            ("/api/v1/namespaces/prod/pods", "pods"),
            ("/api/v1/namespaces/prod/pods/edge-1/status", "pods/status"),
            ("/api/v1/nodes", "nodes"),
            ("/api/v1/namespaces", "namespaces"),
            ("/api/v1/namespaces/prod", "namespaces"),
            ("/api/v1/namespaces/prod/finalize", "namespaces/finalize"),
            (
                "/apis/apps/v1/namespaces/prod/replicasets",
                "replicasets.apps",
            ),
            (
                "/apis/apps/v1/namespaces/prod/deployments/edge",
                "deployments.apps",
            ),
            (
                "/apis/c10m.dev/v1alpha1/namespaces/prod/connectionfleets/edge/status",
                "connectionfleets.c10m.dev/status",
            ),
            (
                "/apis/c10m.dev/v1alpha1/connectionfleets",
                "connectionfleets.c10m.dev",
            ),
            (
                "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/connectionfleets.c10m.dev",
                "customresourcedefinitions.apiextensions.k8s.io",
            ),
            (
                "/apis/coordination.k8s.io/v1/namespaces/c10m/leases/c10m-operator",
                "leases.coordination.k8s.io",
            ),
            ("/k8s/clusters/c-1/api/v1/namespaces/prod/pods", "pods"),
            ("/apis/apps/v1", "other"),
            ("/version", "other"),
            ("/", "other"),
        ];
        for (path, resource) in cases {
            assert_eq!(api_resource(path), resource, "{path}");
        }
        let m = Metrics::default();
        let get = http::Method::GET;
        m.count_request(&get, "/api/v1/namespaces/prod/secrets/edge-admin");
        m.count_request(&get, "/api/v1/namespaces/prod/secrets/web-admin");
        m.count_request(
            &http::Method::PATCH,
            "/apis/apps/v1/namespaces/prod/deployments/edge",
        );
        let text = m.encode();
        assert!(
            text.contains(r#"c10m_operator_api_requests_total{method="GET",resource="secrets"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"c10m_operator_api_requests_total{method="PATCH",resource="deployments.apps"} 1"#
            ),
            "{text}"
        );
    }
}
