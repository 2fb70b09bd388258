//! The real [`Reader`] against a fake Prometheus, then the real
//! [`decide`]: what a fleet does on each kind of sample a real Prometheus
//! can hand over but cannot easily be made to (NaN from a query dividing by
//! zero for an idle pod, ±Inf, negative or absurd values from a broken
//! exporter or recording rule, a pod reported twice by a query that does not
//! aggregate, a running pod without a sample).
//!
//! The fake is a mock: a tiny HTTP server on 127.0.0.1 answering
//! `/api/v1/query` with canned JSON, in Prometheus's own response format.
//! The end-to-end test with a real Prometheus is tests/tests/metrics_loop.rs.
//! Fleet: 3 shards with a cap of 500,000 each at an 80 % target (400,000
//! per shard), floor 1, scale-down without a stabilization window, and
//! rebalancing on, so that a trusted read of these loads would scale in and
//! shed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::decide::{DecideInput, Decision, Memory, decide};
use super::observe::{Observation, ShardPod};
use super::prometheus::{Expected, PART_LABEL, Reader};
use crate::api::{AutoscalingSpec, MetricsSpec, RebalanceSpec};
use crate::reason::Reason;

/// One instant-vector sample of `pod` with `value` as Prometheus writes it
/// (a string: "380000", "NaN", "+Inf").
fn sample(pod: &str, value: &str) -> Value {
    json!({"metric": {"__name__": "x", "pod": pod}, "value": [1_700_000_000.0, value]})
}

/// Canned answers to the one query of a sync, by part.
#[derive(Clone)]
struct Answers {
    /// `time() - timestamp(up…)`: scrape ages.
    ages: Vec<Value>,
    /// The connections query.
    connections: Vec<Value>,
    /// The socket-memory query.
    socket_memory: Vec<Value>,
}

impl Answers {
    /// Fresh scrapes of p0..p2, `loads` for the connections, 1 MiB of socket memory.
    fn with(loads: &[(&str, &str)]) -> Answers {
        Answers {
            ages: ["p0", "p1", "p2"]
                .iter()
                .map(|p| sample(p, "1.5"))
                .collect(),
            connections: loads.iter().map(|(p, v)| sample(p, v)).collect(),
            socket_memory: vec![json!({"metric": {}, "value": [1_700_000_000.0, "1048576"]})],
        }
    }

    /// The answer to a request line (`GET /api/v1/query?query=… HTTP/1.1`):
    /// the series of each part the query asks for, labelled with the part
    /// as its `label_replace` would (the default queries, URL-encoded;
    /// their metric names need no escaping). No kernel settings: the drift
    /// judgement has tests of its own.
    fn answer(&self, request_line: &str) -> Value {
        let mut result = Vec::new();
        for (asked, part, series) in [
            ("timestamp", "age", &self.ages),
            ("c10m_connections", "connections", &self.connections),
            (
                "c10m_tcp_memory_bytes",
                "socket_memory",
                &self.socket_memory,
            ),
        ] {
            if request_line.contains(asked) {
                result.extend(series.iter().cloned().map(|mut s| {
                    s["metric"][PART_LABEL] = json!(part);
                    s
                }));
            }
        }
        if result.is_empty() {
            return json!({"status": "error", "errorType": "bad_data", "error": "unknown query"});
        }
        json!({"status": "success", "data": {"resultType": "vector", "result": result}})
    }
}

/// Serves `answers` on 127.0.0.1 (one request per connection) until the
/// test ends, counting the requests into `asked`; the URL to give the reader.
async fn fake_prometheus(answers: Answers, asked: Arc<AtomicUsize>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (answers, asked) = (answers.clone(), asked.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                asked.fetch_add(1, Ordering::SeqCst);
                let head = String::from_utf8_lossy(&head);
                let body = answers
                    .answer(head.lines().next().unwrap_or_default())
                    .to_string();
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    url
}

/// Pods p0..p2, all running; `unready` ones not ready.
fn pods(unready: &[&str]) -> Vec<ShardPod> {
    ["p0", "p1", "p2"]
        .iter()
        .enumerate()
        .map(|(n, name)| ShardPod {
            name: name.to_string(),
            ip: Some(format!("127.1.1.{n}")),
            ready: !unready.contains(name),
            running: true,
            active: true,
            ..Default::default()
        })
        .collect()
}

/// What the fleet decides after the real reader read `answers` from a fake
/// Prometheus, with `pods` observed. The read is one query (issue 23: one
/// request per fleet and sync).
async fn sync(answers: Answers, pods: Vec<ShardPod>) -> (Observation, Decision) {
    let asked = Arc::new(AtomicUsize::new(0));
    let reader = Reader::new(&fake_prometheus(answers, asked.clone()).await).unwrap();
    let mut seen = Observation {
        pods,
        metrics: None,
        kernel: None,
    };
    let expected = Expected {
        pods: seen.running(),
        shard_capacity: 500_000,
        node_memory_bytes: 64 << 30,
    };
    let read = reader
        .read(&MetricsSpec::default(), "ns", "f", &expected)
        .await;
    assert_eq!(asked.load(Ordering::SeqCst), 1, "one query a sync");
    assert_eq!(read.kernel, Some(vec![]), "the query was answered");
    seen.metrics = Some(read.metrics);
    let autoscaling: AutoscalingSpec = serde_json::from_value(json!({
        "enabled": true,
        "targetUtilizationPercent": 80,
        "scaleDown": {"stabilizationWindowSeconds": 0, "shardsPerPeriod": 8, "percentPerPeriod": 100, "periodSeconds": 15},
    }))
    .unwrap();
    let rebalance: RebalanceSpec =
        serde_json::from_value(json!({"enabled": true, "windowSeconds": 0})).unwrap();
    let wall = Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap());
    let input = DecideInput {
        autoscaling: Some(&autoscaling),
        rebalance: Some(&rebalance),
        max_shards: 8,
        admin_port: 9090,
        floor: 1,
        shard_capacity: 500_000,
        spread: false,
        tcp_mem_pressure_bytes: 1 << 40,
        prev_autoscaling: None,
        prev_rebalance: None,
        current: 3,
        observation: &seen,
        paused: false,
        rolling: false,
        now: 100.0,
        wall: &wall,
    };
    let d = decide(&input, &mut Memory::default());
    (seen, d)
}

/// Holds 3 shards with `MetricsAvailable=False` for `reason`, the message
/// containing `names`: no victims, no shed orders, no live count.
fn holds(d: &Decision, reason: Reason, names: &str) {
    let (ok, got, message) = d.outcome.metrics_condition.clone().unwrap();
    assert_eq!((ok, got), (false, reason), "{message}");
    assert!(message.contains(names), "{message:?} lacks {names:?}");
    assert!(message.contains("holding 3 shards"), "{message}");
    assert_eq!(d.outcome.replicas, 3);
    assert!(d.victims.is_empty(), "victims {:?}", d.victims);
    assert!(d.shed.is_none() && d.outcome.events.is_empty());
    assert_eq!(d.outcome.live, None);
    assert_eq!(d.outcome.autoscaling.as_ref().unwrap().desired_shards, 3);
}

/// The fake is believable: a trusted read of the same shape scales in
/// (760,000 live need 2 shards) and names the empty shard as the victim.
#[tokio::test]
async fn a_trusted_read_scales_in_the_empty_shard() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "0")];
    let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
    assert_eq!(d.outcome.live, Some(760_000));
    assert_eq!(d.outcome.metrics_condition.unwrap().1, Reason::MetricsRead);
    assert_eq!(d.outcome.replicas, 2);
    assert_eq!(d.victims, vec!["p2"]);
}

/// Issue 10, fault 1: p2 reports "NaN". It used to read as 0: live 760,000,
/// `MetricsAvailable=True`, 3 → 2 shards with p2 (full in reality) the victim.
#[tokio::test]
async fn a_nan_sample_holds_the_fleet() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "NaN")];
    let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
    holds(
        &d,
        Reason::DoubtfulSamples,
        "pod p2's live connections is NaN, not a finite number",
    );
}

/// The same kind: infinities, either sign.
#[tokio::test]
async fn an_infinite_sample_holds_the_fleet() {
    for v in ["+Inf", "-Inf"] {
        let loads = [("p0", "380000"), ("p1", "380000"), ("p2", v)];
        let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
        holds(
            &d,
            Reason::DoubtfulSamples,
            &format!("is {v}, not a finite"),
        );
    }
}

/// Issue 10, fault 8 through the reader: +Inf, +Inf, 5 made the rebalancer
/// divide by zero; now the read is doubt and nothing is rebalanced.
#[tokio::test]
async fn infinite_loads_never_reach_the_rebalancer() {
    let loads = [("p0", "+Inf"), ("p1", "+Inf"), ("p2", "5")];
    let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
    holds(
        &d,
        Reason::DoubtfulSamples,
        "pod p0's live connections is +Inf",
    );
    assert!(d.outcome.rebalance.unwrap().max_to_mean_percent <= 100);
}

#[tokio::test]
async fn a_negative_sample_holds_the_fleet() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "-12")];
    let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
    holds(&d, Reason::DoubtfulSamples, "is negative (-12)");
}

/// More than twice the shard cap (1,000,000) is more than a shard can hold.
#[tokio::test]
async fn an_implausible_sample_holds_the_fleet() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "1e12")];
    let (_, d) = sync(Answers::with(&loads), pods(&[])).await;
    holds(
        &d,
        Reason::DoubtfulSamples,
        "pod p2's live connections is 1000000000000, above 1000000 (2 × the shard cap of 500000)",
    );
}

/// A query that does not aggregate by pod gives p1 two series.
#[tokio::test]
async fn a_duplicate_series_holds_the_fleet() {
    let mut answers = Answers::with(&[("p0", "380000"), ("p1", "190000"), ("p2", "0")]);
    answers.connections.push(json!(
        {"metric": {"pod": "p1", "worker": "1"}, "value": [1_700_000_000.0, "190000"]}
    ));
    let (_, d) = sync(answers, pods(&[])).await;
    holds(
        &d,
        Reason::DoubtfulSamples,
        "pod p1 has 2 live-connection series, one expected",
    );
}

/// p2 runs (not ready) but has no sample: partial, whatever its readiness.
#[tokio::test]
async fn a_running_pod_without_a_sample_holds_the_fleet() {
    let loads = [("p0", "380000"), ("p1", "10")];
    let (_, d) = sync(Answers::with(&loads), pods(&["p2"])).await;
    holds(
        &d,
        Reason::PartialSamples,
        "1 of 3 running shards report no live connections (p2)",
    );
}

/// Socket memory and scrape ages are samples too.
#[tokio::test]
async fn doubtful_socket_memory_or_scrape_ages_hold_the_fleet() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "0")];
    let mut answers = Answers::with(&loads);
    answers.socket_memory = vec![json!({"metric": {}, "value": [1_700_000_000.0, "NaN"]})];
    let (_, d) = sync(answers, pods(&[])).await;
    holds(&d, Reason::DoubtfulSamples, "TCP socket memory is NaN");

    let mut answers = Answers::with(&loads);
    answers.ages[1] = sample("p1", "NaN");
    let (_, d) = sync(answers, pods(&[])).await;
    holds(&d, Reason::DoubtfulSamples, "the scrape age of p1 is NaN");
}

/// Issue 10, fault 2: all three shards hold 380,000 and p2 is not ready.
/// It used to count 760,000 live, recommend 2 and pick p2 first.
#[tokio::test]
async fn a_not_ready_shards_connections_count() {
    let loads = [("p0", "380000"), ("p1", "380000"), ("p2", "380000")];
    let (seen, d) = sync(Answers::with(&loads), pods(&["p2"])).await;
    assert_eq!(seen.running(), vec!["p0", "p1", "p2"]);
    assert_eq!(d.outcome.live, Some(1_140_000));
    assert_eq!(d.outcome.metrics_condition.unwrap().1, Reason::MetricsRead);
    assert_eq!(d.outcome.replicas, 3, "1,140,000 ÷ 400,000: 3 shards");
    assert!(d.victims.is_empty());
    assert!(d.shed.is_none(), "not settled: p2 is not ready");

    // Less load, so a scale-in: the not-ready shard holding the most goes last.
    let loads = [("p0", "1000"), ("p1", "2000"), ("p2", "300000")];
    let (_, d) = sync(Answers::with(&loads), pods(&["p2"])).await;
    assert_eq!(d.outcome.live, Some(303_000));
    assert_eq!(d.outcome.replicas, 1);
    assert_eq!(d.victims, vec!["p0", "p1"]);
}
