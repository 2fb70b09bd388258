//! Reads a fleet's live metrics from Prometheus (prometheus-http-query):
//! live connections per shard, the busiest node's TCP socket memory, and how
//! fresh the scrapes are. Any doubt is an error, which the autoscaler treats
//! as "hold, never scale down": Prometheus unreachable, no samples, stale
//! samples, a running shard without a sample (partial), or a sample that
//! cannot be true ([`validate`]: not finite, negative, implausibly large, or
//! a pod reported twice).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use prometheus_http_query::Client;
use prometheus_http_query::response::Data;

use super::rebalance::ShardLoad;
use crate::api::MetricsSpec;
use crate::policy::{QueryMatchers, matchers_for};

/// A shard reporting more than this many times the plan's per-shard cap
/// (`shardConnectionLimit`) is implausible, and so is socket memory above
/// this many times the plan's node memory. The server refuses connections
/// above its cap, so a true count is at most the cap; the slack covers a
/// shard still running an older, larger plan during a rollout (up to twice
/// the new cap) and a custom query that counts a little more than the
/// server does.
pub const IMPLAUSIBLE_FACTOR: i64 = 2;

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
    /// Some running shards (ready or not) have no live-connection series.
    #[error("{missing} of {expected} running shards report no live connections ({})", names(.pods))]
    Partial {
        /// Running shards without a series.
        missing: usize,
        /// Running shards.
        expected: usize,
        /// The first few of them.
        pods: Vec<String>,
    },
    /// A query of `spec.metrics` cannot be confined to the fleet's series.
    #[error("query refused: {0}")]
    Refused(String),
    /// Some samples cannot be true (never empty).
    #[error("doubtful samples: {}", Doubts(.0))]
    Doubtful(Vec<Doubt>),
}

/// What is wrong with a sample.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Doubt {
    /// NaN or ±Inf (e.g. a query dividing by zero for an idle pod).
    #[error("{series} is {value}, not a finite number")]
    NonFinite {
        /// Which sample (metric and pod).
        series: String,
        /// Its value, as Prometheus spells it.
        value: String,
    },
    /// Below zero.
    #[error("{series} is negative ({value})")]
    Negative {
        /// Which sample.
        series: String,
        /// Its value.
        value: String,
    },
    /// Far above what can be true ([`IMPLAUSIBLE_FACTOR`] × the bound).
    #[error("{series} is {value}, above {limit} ({IMPLAUSIBLE_FACTOR} × {bound})")]
    Implausible {
        /// Which sample.
        series: String,
        /// Its value.
        value: String,
        /// The most that is plausible.
        limit: i64,
        /// What the limit is a multiple of.
        bound: String,
    },
    /// One pod has several live-connection series (a query that does not
    /// aggregate by pod): which one to believe is unknown.
    #[error("pod {pod} has {count} live-connection series, one expected")]
    Duplicate {
        /// The pod.
        pod: String,
        /// Its series.
        count: usize,
    },
}

/// At most this many pods or doubts are named in a message.
const NAMED: usize = 3;

fn names(pods: &[String]) -> String {
    let mut s = pods
        .iter()
        .take(NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if pods.len() > NAMED {
        s.push_str(&format!(" and {} more", pods.len() - NAMED));
    }
    s
}

/// Doubts as one line: the first few, and how many more.
struct Doubts<'a>(&'a [Doubt]);

impl fmt::Display for Doubts<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, d) in self.0.iter().take(NAMED).enumerate() {
            if n > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{d}")?;
        }
        if self.0.len() > NAMED {
            write!(f, "; and {} more", self.0.len() - NAMED)?;
        }
        Ok(())
    }
}

/// A sample value as Prometheus spells it (`NaN`, `+Inf`, `-Inf`), with
/// huge values in scientific notation.
fn show(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.abs() < 1e15 {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// `v` as a whole count, if it is finite, not negative and at most
/// `limit` (`bound` names what the limit is a multiple of).
fn count(series: impl Fn() -> String, v: f64, limit: i64, bound: &str) -> Result<i64, Doubt> {
    if !v.is_finite() {
        Err(Doubt::NonFinite {
            series: series(),
            value: show(v),
        })
    } else if v < 0.0 {
        Err(Doubt::Negative {
            series: series(),
            value: show(v),
        })
    } else if v > limit as f64 {
        Err(Doubt::Implausible {
            series: series(),
            value: show(v),
            limit,
            bound: bound.into(),
        })
    } else {
        // Finite and within [0, limit ≤ i64::MAX]: `as` cannot wrap.
        Ok(v.round() as i64)
    }
}

/// What a fleet's samples are checked against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    /// Pods that must each report one live-connection sample: the fleet's
    /// running, non-terminating pods, ready or not.
    pub pods: Vec<String>,
    /// The plan's per-shard connection cap (`shardConnectionLimit`).
    pub shard_capacity: i64,
    /// The plan's node memory, bytes.
    pub node_memory_bytes: i64,
}

impl Expected {
    /// The most live connections one shard can plausibly report.
    pub fn connection_limit(&self) -> i64 {
        self.shard_capacity
            .max(1)
            .saturating_mul(IMPLAUSIBLE_FACTOR)
    }

    /// The most socket memory one node can plausibly report, bytes.
    pub fn socket_memory_limit(&self) -> i64 {
        self.node_memory_bytes
            .max(1)
            .saturating_mul(IMPLAUSIBLE_FACTOR)
    }
}

/// A fleet's metrics at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetMetrics {
    /// Live connections per running shard (pod), ready or not.
    pub shards: Vec<ShardLoad>,
    /// Live connections of the fleet (a saturating sum).
    pub live: i64,
    /// TCP socket memory of the busiest node, bytes, if reported.
    pub socket_memory_bytes: Option<i64>,
}

/// Checks one read's answers against `expected` (pure): every expected pod
/// has exactly one live-connection sample, and every sample the decision
/// uses (connections of expected pods, socket memory) is finite, not
/// negative and plausible. Samples of other pods (gone, or not running
/// yet) are ignored. Any doubt is reported before missing pods; socket
/// memory is the highest of the values (the busiest node).
pub fn validate(
    connections: &[(HashMap<String, String>, f64)],
    socket_memory: &[f64],
    expected: &Expected,
) -> Result<FleetMetrics, MetricsError> {
    let mut by_pod: BTreeMap<&str, Vec<f64>> = expected
        .pods
        .iter()
        .map(|p| (p.as_str(), Vec::new()))
        .collect();
    for (labels, v) in connections {
        if let Some(values) = labels.get("pod").and_then(|p| by_pod.get_mut(p.as_str())) {
            values.push(*v);
        }
    }
    let (mut doubts, mut missing, mut shards) = (Vec::new(), Vec::new(), Vec::new());
    let limit = expected.connection_limit();
    let cap = format!("the shard cap of {}", expected.shard_capacity);
    for pod in &expected.pods {
        match by_pod.get(pod.as_str()).map_or(&[][..], |v| &v[..]) {
            [] => missing.push(pod.clone()),
            [v] => match count(|| format!("pod {pod}'s live connections"), *v, limit, &cap) {
                Ok(connections) => shards.push(ShardLoad {
                    pod: pod.clone(),
                    connections,
                }),
                Err(d) => doubts.push(d),
            },
            many => doubts.push(Doubt::Duplicate {
                pod: pod.clone(),
                count: many.len(),
            }),
        }
    }
    let limit = expected.socket_memory_limit();
    let node = format!("the node's {} B", expected.node_memory_bytes);
    let mut socket_memory_bytes: Option<i64> = None;
    for v in socket_memory {
        match count(|| "TCP socket memory".into(), *v, limit, &node) {
            Ok(b) => socket_memory_bytes = Some(socket_memory_bytes.map_or(b, |m| m.max(b))),
            Err(d) => doubts.push(d),
        }
    }
    if !doubts.is_empty() {
        return Err(MetricsError::Doubtful(doubts));
    }
    if !missing.is_empty() {
        return Err(MetricsError::Partial {
            missing: missing.len(),
            expected: expected.pods.len(),
            pods: missing,
        });
    }
    Ok(FleetMetrics {
        live: shards
            .iter()
            .fold(0i64, |sum, s| sum.saturating_add(s.connections)),
        shards,
        socket_memory_bytes,
    })
}

/// A query template rendered for the fleet and confined to its own series
/// and the `policy` matchers of its namespace ([`crate::promql::render`]);
/// a query that cannot be confined is [`MetricsError::Refused`] (the
/// reconcile refuses such a spec first).
pub fn render_query(
    template: &str,
    namespace: &str,
    fleet: &str,
    policy: &[(String, String)],
) -> Result<String, MetricsError> {
    crate::promql::render(template, namespace, fleet, policy)
        .map_err(|e| MetricsError::Refused(format!("{template}: {e}")))
}

/// A Prometheus client.
#[derive(Clone)]
pub struct Reader {
    client: Client,
    /// The admin policy's `queryMatchers`: every query of a fleet is
    /// confined to those of its namespace too.
    confinement: Vec<QueryMatchers>,
}

impl Reader {
    /// A reader for the Prometheus at `url` (http://host:port). Errors on a malformed URL.
    pub fn new(url: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()?;
        let client = Client::from(http, url)
            .map_err(|e| anyhow::anyhow!("--prometheus-url {url:?}: {e}"))?;
        Ok(Reader {
            client,
            confinement: Vec::new(),
        })
    }

    /// This reader with every fleet's queries confined to the admin
    /// policy's `queryMatchers` for its namespace, beside its namespace and
    /// fleet.
    pub fn confined_by(mut self, query_matchers: &[QueryMatchers]) -> Self {
        self.confinement = query_matchers.to_vec();
        self
    }

    async fn vector(&self, query: &str, timeout: Duration) -> Result<Samples, MetricsError> {
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

    /// Reads the fleet's metrics and kernel settings in one query
    /// ([`fleet_query`]), and [`validate`]s the metrics against `expected`.
    /// Prometheus unreachable (or answering an error) and a spec whose
    /// queries cannot be confined are the `metrics` error, with no kernel
    /// read.
    pub async fn read(
        &self,
        spec: &MetricsSpec,
        namespace: &str,
        fleet: &str,
        expected: &Expected,
    ) -> Reading {
        let timeout = Duration::from_secs(spec.query_timeout_seconds.max(1) as u64);
        let policy = matchers_for(&self.confinement, namespace);
        let query = match fleet_query(spec, namespace, fleet, &policy) {
            Ok(q) => q,
            Err(e) => return Reading::failed(e),
        };
        let samples = match self.vector(&query.text, timeout).await {
            Ok(samples) => samples,
            Err(e) => return Reading::failed(e),
        };
        let mut parts = Parts::default();
        for (mut labels, v) in samples {
            let part = labels.remove(PART_LABEL);
            let into = match part.as_deref() {
                Some(Part::AGE) => &mut parts.ages,
                Some(Part::CONNECTIONS) => &mut parts.connections,
                Some(Part::SOCKET_MEMORY) => &mut parts.socket_memory,
                Some(Part::KERNEL) => &mut parts.kernel,
                _ => continue,
            };
            into.push((labels, v));
        }
        Reading {
            metrics: judge(&query, &parts, spec, expected),
            kernel: Some(parts.kernel),
        }
    }
}

/// The label the one query of a sync sets on each series to tell its
/// parts apart ([`fleet_query`]).
pub const PART_LABEL: &str = "c10m_read";

/// The values of [`PART_LABEL`].
struct Part;

impl Part {
    const AGE: &str = "age";
    const CONNECTIONS: &str = "connections";
    const SOCKET_MEMORY: &str = "socket_memory";
    const KERNEL: &str = "kernel";
}

/// The one query a sync sends for a fleet, and the parts its errors name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetQuery {
    /// The PromQL sent.
    pub text: String,
    /// `upQuery`, rendered for the fleet.
    pub up: String,
    /// `connectionsQuery`, rendered for the fleet.
    pub connections: String,
}

/// The fleet's four reads as one PromQL query, so that a sync costs one
/// request per fleet (issue 23: 1,000 fleets at four queries each were
/// 4,000 requests a sync period): the scrape age of each shard (`time() -
/// timestamp(upQuery)`), `connectionsQuery`, `socketMemoryQuery` and the
/// kernel settings ([`super::drift::KERNEL_QUERY`]), each rendered and
/// confined on its own ([`render_query`]), labelled with [`PART_LABEL`]
/// (`label_replace`) and joined with `or`. `or` keeps every series of its
/// left side and those of its right side whose labels (the metric name
/// aside) match none on the left; the part label differs between the
/// parts, so no series of one part can hide one of another, and a part
/// that has no series leaves the others as they are. A part whose answer
/// is a scalar is already a vector here ([`crate::promql::render`]).
/// Errors: a template that cannot be confined ([`MetricsError::Refused`]).
pub fn fleet_query(
    spec: &MetricsSpec,
    namespace: &str,
    fleet: &str,
    policy: &[(String, String)],
) -> Result<FleetQuery, MetricsError> {
    let up = render_query(&spec.up_query, namespace, fleet, policy)?;
    let connections = render_query(&spec.connections_query, namespace, fleet, policy)?;
    let socket_memory = render_query(&spec.socket_memory_query, namespace, fleet, policy)?;
    let kernel = render_query(super::drift::KERNEL_QUERY, namespace, fleet, policy)?;
    let text = [
        (Part::AGE, format!("time() - timestamp({up})")),
        (Part::CONNECTIONS, connections.clone()),
        (Part::SOCKET_MEMORY, socket_memory),
        (Part::KERNEL, kernel),
    ]
    .iter()
    .map(|(part, q)| format!(r#"label_replace({q}, "{PART_LABEL}", "{part}", "", "")"#))
    .collect::<Vec<_>>()
    .join(" or ");
    Ok(FleetQuery {
        text,
        up,
        connections,
    })
}

/// Samples as a query returns them: labels and value.
type Samples = Vec<(HashMap<String, String>, f64)>;

/// One answer split by [`PART_LABEL`].
#[derive(Default)]
struct Parts {
    ages: Samples,
    connections: Samples,
    socket_memory: Samples,
    kernel: Samples,
}

/// One sync's read of a fleet ([`Reader::read`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    /// The fleet's load, or why it cannot be trusted.
    pub metrics: Result<FleetMetrics, MetricsError>,
    /// The kernel settings its shards report ([`super::drift::KERNEL_QUERY`]),
    /// one sample per shard and setting; `None` when nothing was read.
    pub kernel: Option<Samples>,
}

impl Reading {
    fn failed(e: MetricsError) -> Reading {
        Reading {
            metrics: Err(e),
            kernel: None,
        }
    }
}

/// The metrics in `parts`, checked in order: every shard has a scrape age
/// (else [`MetricsError::Empty`] naming `upQuery`), each believable and
/// within `staleAfterSeconds`; the connections have series (else `Empty`
/// naming `connectionsQuery`); then [`validate`] against `expected`.
fn judge(
    query: &FleetQuery,
    parts: &Parts,
    spec: &MetricsSpec,
    expected: &Expected,
) -> Result<FleetMetrics, MetricsError> {
    let ages = &parts.ages;
    if ages.is_empty() {
        return Err(MetricsError::Empty(query.up.clone()));
    }
    // A NaN age is no age: never "fresh" (f64::max would skip it).
    let doubts: Vec<Doubt> = ages
        .iter()
        .filter(|(_, a)| !a.is_finite() || *a < 0.0)
        .map(|(labels, a)| {
            let series = format!(
                "the scrape age of {}",
                labels.get("pod").map_or("a shard", String::as_str)
            );
            let value = show(*a);
            if a.is_finite() {
                Doubt::Negative { series, value }
            } else {
                Doubt::NonFinite { series, value }
            }
        })
        .collect();
    if !doubts.is_empty() {
        return Err(MetricsError::Doubtful(doubts));
    }
    let age = ages.iter().map(|(_, a)| *a).fold(0.0, f64::max);
    if age > spec.stale_after_seconds as f64 {
        return Err(MetricsError::Stale {
            age,
            limit: spec.stale_after_seconds,
        });
    }
    if parts.connections.is_empty() {
        return Err(MetricsError::Empty(query.connections.clone()));
    }
    let mem: Vec<f64> = parts.socket_memory.iter().map(|(_, v)| *v).collect();
    validate(&parts.connections, &mem, expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one query of a sync holds each part confined on its own, told
    /// apart by the part label; every selector in it carries the fleet's
    /// and the policy's matchers.
    #[test]
    fn a_sync_sends_one_query_with_every_part_confined() {
        let policy = vec![("cluster".to_string(), "eu-1".to_string())];
        let q = fleet_query(&MetricsSpec::default(), "edge", "push", &policy).unwrap();
        let m = r#"cluster="eu-1",fleet="push",namespace="edge""#;
        assert_eq!(
            q.text,
            format!(
                r#"label_replace(time() - timestamp(up{{{m}}}), "c10m_read", "age", "", "") or label_replace(sum by (pod) (c10m_connections{{{m}}}), "c10m_read", "connections", "", "") or label_replace(max(c10m_tcp_memory_bytes{{{m}}}), "c10m_read", "socket_memory", "", "") or label_replace(c10m_fd_limit{{{m}}} or c10m_kernel_sysctl{{{m}}}, "c10m_read", "kernel", "", "")"#
            )
        );
        assert_eq!(q.up, format!("up{{{m}}}"));
        // Confining the whole query again changes nothing: it already was.
        let enforced = [
            ("namespace", "edge"),
            ("fleet", "push"),
            ("cluster", "eu-1"),
        ];
        let again = crate::promql::confine(&q.text, &enforced).unwrap();
        assert_eq!(
            promql_parser::parser::parse(&again).unwrap(),
            promql_parser::parser::parse(&q.text).unwrap()
        );
        // A query that cannot be confined refuses the read, naming it.
        let spec = MetricsSpec {
            socket_memory_query: r#"max(x{namespace="other"})"#.into(),
            ..MetricsSpec::default()
        };
        let err = fleet_query(&spec, "edge", "push", &[]).unwrap_err();
        assert!(
            matches!(&err, MetricsError::Refused(m) if m.starts_with(r#"max(x{namespace="other"})"#)),
            "{err:?}"
        );
    }

    #[test]
    fn templates_name_the_fleet() {
        let spec = MetricsSpec::default();
        assert_eq!(
            render_query(&spec.connections_query, "edge", "push", &[]).unwrap(),
            r#"sum by (pod) (c10m_connections{fleet="push",namespace="edge"})"#
        );
        assert!(matches!(
            render_query(r#"up{namespace="other"}"#, "edge", "push", &[]),
            Err(MetricsError::Refused(_))
        ));
    }

    /// The queries the reader runs carry the policy's matchers for the
    /// fleet's namespace (a Prometheus answering every query with an empty
    /// vector: the error names the query sent).
    #[tokio::test]
    async fn the_reader_runs_queries_confined_by_the_policy() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            }
        });
        let policy = crate::policy::Policy::from_yaml(
            "queryMatchers: [{namespaces: [edge], matchers: {cluster: eu-1}}]\n",
        )
        .unwrap();
        let reader = Reader::new(&url)
            .unwrap()
            .confined_by(&policy.query_matchers);
        let expected = Expected {
            pods: vec![],
            shard_capacity: 1,
            node_memory_bytes: 1,
        };
        let spec = MetricsSpec::default();
        let read = reader.read(&spec, "edge", "push", &expected).await;
        assert_eq!(
            read.metrics.unwrap_err(),
            MetricsError::Empty(r#"up{cluster="eu-1",fleet="push",namespace="edge"}"#.into())
        );
        assert_eq!(read.kernel, Some(vec![]), "the query was answered");
        // Another namespace: not confined by that entry.
        let read = reader.read(&spec, "other", "push", &expected).await;
        assert_eq!(
            read.metrics.unwrap_err(),
            MetricsError::Empty(r#"up{fleet="push",namespace="other"}"#.into())
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
        let read = r
            .read(&MetricsSpec::default(), "ns", "f", &Expected::default())
            .await;
        assert!(
            matches!(read.metrics, Err(MetricsError::Unreachable(_))),
            "{read:?}"
        );
        assert_eq!(read.kernel, None);
    }

    fn expected(pods: &[&str]) -> Expected {
        Expected {
            pods: pods.iter().map(|p| p.to_string()).collect(),
            shard_capacity: 500_000,
            node_memory_bytes: 64 << 30,
        }
    }

    fn series(pod: &str, v: f64) -> (HashMap<String, String>, f64) {
        (HashMap::from([("pod".to_string(), pod.to_string())]), v)
    }

    fn doubts(r: Result<FleetMetrics, MetricsError>) -> Vec<Doubt> {
        match r {
            Err(MetricsError::Doubtful(d)) => d,
            other => panic!("not doubtful: {other:?}"),
        }
    }

    #[test]
    fn good_samples_of_every_running_shard_are_the_load() {
        let e = expected(&["p0", "p1", "p2"]);
        let read = vec![
            series("p0", 380_000.0),
            series("p1", 380_000.4),
            series("p2", 0.0),
            series("gone", f64::NAN), // a pod no longer running: ignored
            (HashMap::new(), 7.0),    // no pod label: ignored
        ];
        let m = validate(&read, &[100.0, 4096.0], &e).unwrap();
        assert_eq!(m.live, 760_000);
        assert_eq!(m.shards.len(), 3);
        assert_eq!(m.socket_memory_bytes, Some(4096), "the busiest node");
        assert_eq!(validate(&read, &[], &e).unwrap().socket_memory_bytes, None);
    }

    #[test]
    fn every_kind_of_doubt_is_named() {
        let e = expected(&["p0", "p1", "p2"]);
        let with = |p2: f64| vec![series("p0", 1.0), series("p1", 2.0), series("p2", p2)];
        let cases = [
            (
                f64::NAN,
                "pod p2's live connections is NaN, not a finite number",
            ),
            (
                f64::INFINITY,
                "pod p2's live connections is +Inf, not a finite number",
            ),
            (
                f64::NEG_INFINITY,
                "pod p2's live connections is -Inf, not a finite number",
            ),
            (-3.0, "pod p2's live connections is negative (-3)"),
            (
                1_000_001.0,
                "pod p2's live connections is 1000001, above 1000000 (2 × the shard cap of 500000)",
            ),
            (
                1e300,
                "pod p2's live connections is 1e300, above 1000000 (2 × the shard cap of 500000)",
            ),
        ];
        for (v, want) in cases {
            let d = doubts(validate(&with(v), &[], &e));
            assert_eq!(d.len(), 1, "{v}");
            assert_eq!(d[0].to_string(), want);
        }
        // Exactly twice the cap is still plausible.
        assert!(validate(&with(1_000_000.0), &[], &e).is_ok());
        // Two series for one pod: which to believe?
        let mut read = with(5.0);
        read.push(series("p1", 2.0));
        let err = validate(&read, &[], &e).unwrap_err();
        assert_eq!(
            err.to_string(),
            "doubtful samples: pod p1 has 2 live-connection series, one expected"
        );
        // Socket memory gets the same checks (bound: 2 × the node's memory).
        for (v, want) in [
            (f64::NAN, "TCP socket memory is NaN, not a finite number"),
            (-1.0, "TCP socket memory is negative (-1)"),
            (
                (256u64 << 30) as f64,
                "TCP socket memory is 274877906944, above 137438953472 (2 × the node's 68719476736 B)",
            ),
        ] {
            let d = doubts(validate(&with(5.0), &[1.0, v], &e));
            assert_eq!(d[0].to_string(), want);
        }
    }

    #[test]
    fn a_running_shard_without_a_sample_is_partial() {
        let e = expected(&["p0", "p1", "p2", "p3", "p4"]);
        let err = validate(&[series("p0", 1.0)], &[], &e).unwrap_err();
        assert_eq!(
            err,
            MetricsError::Partial {
                missing: 4,
                expected: 5,
                pods: vec!["p1".into(), "p2".into(), "p3".into(), "p4".into()],
            }
        );
        assert_eq!(
            err.to_string(),
            "4 of 5 running shards report no live connections (p1, p2, p3 and 1 more)"
        );
        // A doubt is told before a gap.
        let err = validate(&[series("p0", f64::NAN)], &[], &e).unwrap_err();
        assert!(matches!(err, MetricsError::Doubtful(_)), "{err}");
    }

    #[test]
    fn many_doubts_make_one_short_message() {
        let e = expected(&["a", "b", "c", "d", "e"]);
        let read: Vec<_> = e.pods.iter().map(|p| series(p, -1.0)).collect();
        let msg = validate(&read, &[], &e).unwrap_err().to_string();
        assert!(msg.ends_with("; and 2 more"), "{msg}");
        assert_eq!(msg.matches("negative").count(), 3);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// A read is trusted only when every expected pod has exactly one
        /// finite, non-negative, plausible sample; then the sum saturates.
        #[test]
        fn only_believable_samples_are_trusted(
            values in proptest::collection::vec(
                proptest::prop_oneof![
                    4 => 0.0f64..=1_200_000.0,
                    1 => proptest::num::f64::ANY,
                    1 => proptest::sample::select(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, -1.0, 1e300]),
                ],
                0..=8,
            ),
            cap in proptest::prop_oneof![1i64..=1_000_000, proptest::strategy::Just(i64::MAX)],
            present in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
            twice in proptest::option::of(0usize..8),
        ) {
            let pods: Vec<String> = (0..values.len()).map(|n| format!("p{n}")).collect();
            let e = Expected { pods: pods.clone(), shard_capacity: cap, node_memory_bytes: 1 << 30 };
            let mut read: Vec<_> = values
                .iter()
                .enumerate()
                .filter(|(n, _)| present[*n])
                .map(|(n, v)| series(&pods[n], *v))
                .collect();
            if let Some(n) = twice.filter(|n| *n < values.len()) {
                read.push(series(&pods[n], 1.0));
            }
            let r = validate(&read, &[], &e);
            let believable = |v: f64| v.is_finite() && v >= 0.0 && v <= e.connection_limit() as f64;
            // What each pod reported, as read.
            let per_pod: Vec<Vec<f64>> = pods
                .iter()
                .map(|p| read.iter().filter(|(l, _)| l["pod"] == *p).map(|(_, v)| *v).collect())
                .collect();
            let trusted = per_pod.iter().all(|v| v.len() == 1 && believable(v[0]));
            match r {
                Ok(m) => {
                    proptest::prop_assert!(trusted, "{:?}", per_pod);
                    proptest::prop_assert_eq!(m.shards.len(), values.len());
                    let sum: i128 = m.shards.iter().map(|s| s.connections as i128).sum();
                    proptest::prop_assert_eq!(m.live as i128, sum.min(i64::MAX as i128));
                    proptest::prop_assert!(m.shards.iter().all(|s| s.connections >= 0));
                }
                Err(MetricsError::Doubtful(d)) => proptest::prop_assert!(!d.is_empty() && !trusted),
                Err(MetricsError::Partial { missing, .. }) => {
                    proptest::prop_assert!(!trusted);
                    proptest::prop_assert_eq!(missing, per_pod.iter().filter(|v| v.is_empty()).count());
                }
                Err(other) => proptest::prop_assert!(false, "{}", other),
            }
        }
    }
}
