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

/// Label of a request to the Kubernetes API: its HTTP method (`GET`, also
/// for lists and watches; `POST`, `PUT`, `PATCH` (server-side applies
/// too), `DELETE`), as client-go's `rest_client_requests_total` labels it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    /// The HTTP method.
    pub method: String,
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
    /// `c10m_operator_api_requests_total{method}`: requests this process
    /// sent to the Kubernetes API ([`Metrics::count_request`]).
    pub api_requests: Family<MethodLabel, Counter>,
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
        let api_requests = Family::<MethodLabel, Counter>::default();
        registry.register(
            "api_requests",
            "Requests sent to the Kubernetes API by HTTP method (a write is anything but GET)",
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

    /// Counts one request to the Kubernetes API sent with `method`.
    pub fn count_request(&self, method: &http::Method) {
        self.api_requests
            .get_or_create(&MethodLabel {
                method: method.as_str().to_string(),
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
}
