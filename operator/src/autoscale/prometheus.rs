//! Reads a fleet's live metrics from Prometheus (prometheus-http-query):
//! live connections per shard, the busiest node's TCP socket memory, and how
//! fresh the scrapes are. Any doubt (unreachable, empty, stale, partial) is
//! an error, which the autoscaler treats as "hold, never scale down".

use std::collections::HashMap;
use std::time::Duration;

use prometheus_http_query::Client;
use prometheus_http_query::response::Data;

use super::rebalance::ShardLoad;
use crate::api::MetricsSpec;

/// Why a fleet's metrics cannot be trusted now.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum MetricsError {
    /// Prometheus did not answer (or answered an error) within the timeout.
    #[error("Prometheus unreachable: {0}")]
    Unreachable(String),
    /// The query returned no series.
    #[error("no samples for {0}")]
    Empty(String),
    /// The newest scrape of some shard is older than `staleAfterSeconds`.
    #[error("stale samples: a shard was last scraped {age:.0} s ago (limit {limit} s)")]
    Stale {
        /// Seconds since the stalest shard's last scrape.
        age: f64,
        /// `metrics.staleAfterSeconds`.
        limit: i32,
    },
    /// Some ready shards have no live-connection series.
    #[error("{missing} of {expected} ready shards report no live connections")]
    Partial {
        /// Ready shards without a series.
        missing: usize,
        /// Ready shards.
        expected: usize,
    },
}

/// A fleet's metrics at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetMetrics {
    /// Live connections per shard (pod).
    pub shards: Vec<ShardLoad>,
    /// Live connections of the fleet.
    pub live: i64,
    /// TCP socket memory of the busiest node, bytes, if reported.
    pub socket_memory_bytes: Option<i64>,
}

/// Substitutes `{namespace}` and `{fleet}` in a query template.
pub fn render_query(template: &str, namespace: &str, fleet: &str) -> String {
    template
        .replace("{namespace}", namespace)
        .replace("{fleet}", fleet)
}

/// A Prometheus client.
#[derive(Clone)]
pub struct Reader {
    client: Client,
}

impl Reader {
    /// A reader for the Prometheus at `url` (http://host:port). Errors on a malformed URL.
    pub fn new(url: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()?;
        let client = Client::from(http, url)
            .map_err(|e| anyhow::anyhow!("--prometheus-url {url:?}: {e}"))?;
        Ok(Reader { client })
    }

    async fn vector(
        &self,
        query: &str,
        timeout: Duration,
    ) -> Result<Vec<(HashMap<String, String>, f64)>, MetricsError> {
        let fut = self
            .client
            .query(query)
            .timeout(timeout.as_millis() as i64)
            .get();
        let res = tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| {
                MetricsError::Unreachable(format!("no answer within {} s", timeout.as_secs()))
            })?
            .map_err(|e| MetricsError::Unreachable(e.to_string()))?;
        match res.into_inner().0 {
            Data::Vector(v) => Ok(v
                .into_iter()
                .map(|iv| {
                    let (labels, sample) = iv.into_inner();
                    (labels, sample.value())
                })
                .collect()),
            Data::Scalar(s) => Ok(vec![(HashMap::new(), s.value())]),
            Data::Matrix(_) => Err(MetricsError::Unreachable(format!(
                "{query}: a range vector, expected an instant vector"
            ))),
        }
    }

    /// Reads the fleet's metrics; `ready_pods` are the shards expected to report.
    pub async fn read(
        &self,
        spec: &MetricsSpec,
        namespace: &str,
        fleet: &str,
        ready_pods: &[String],
    ) -> Result<FleetMetrics, MetricsError> {
        let timeout = Duration::from_secs(spec.query_timeout_seconds.max(1) as u64);
        let up = render_query(&spec.up_query, namespace, fleet);
        let ages = self
            .vector(&format!("time() - timestamp({up})"), timeout)
            .await?;
        if ages.is_empty() {
            return Err(MetricsError::Empty(up));
        }
        let age = ages.iter().map(|(_, a)| *a).fold(0.0, f64::max);
        if age > spec.stale_after_seconds as f64 {
            return Err(MetricsError::Stale {
                age,
                limit: spec.stale_after_seconds,
            });
        }
        let q = render_query(&spec.connections_query, namespace, fleet);
        let per_pod = self.vector(&q, timeout).await?;
        if per_pod.is_empty() {
            return Err(MetricsError::Empty(q));
        }
        let shards: Vec<ShardLoad> = per_pod
            .iter()
            .filter_map(|(labels, v)| {
                Some(ShardLoad {
                    pod: labels.get("pod")?.clone(),
                    connections: v.max(0.0).round() as i64,
                })
            })
            .collect();
        let missing = ready_pods
            .iter()
            .filter(|p| !shards.iter().any(|s| &s.pod == *p))
            .count();
        if missing > 0 {
            return Err(MetricsError::Partial {
                missing,
                expected: ready_pods.len(),
            });
        }
        let shards: Vec<ShardLoad> = shards
            .into_iter()
            .filter(|s| ready_pods.contains(&s.pod))
            .collect();
        let mem = self
            .vector(
                &render_query(&spec.socket_memory_query, namespace, fleet),
                timeout,
            )
            .await?;
        Ok(FleetMetrics {
            live: shards.iter().map(|s| s.connections).sum(),
            shards,
            socket_memory_bytes: mem.first().map(|(_, v)| v.max(0.0) as i64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_the_fleet() {
        let spec = MetricsSpec::default();
        assert_eq!(
            render_query(&spec.connections_query, "edge", "push"),
            r#"sum by (pod) (c10m_connections{namespace="edge",fleet="push"})"#
        );
    }

    #[tokio::test]
    async fn an_unreachable_prometheus_is_an_error_not_zero() {
        // Nothing listens on this loopback port: connection refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let r = Reader::new(&format!("http://127.0.0.1:{port}")).unwrap();
        let err = r
            .read(&MetricsSpec::default(), "ns", "f", &[])
            .await
            .unwrap_err();
        assert!(matches!(err, MetricsError::Unreachable(_)), "{err:?}");
    }
}
