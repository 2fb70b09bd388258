//! One sync of the metrics loop for one fleet (I/O): read metrics, decide
//! shards (autoscaling) and shed orders (rebalancing), carry them out, and
//! say what happened for the fleet's status and events.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;

use super::actions::{self, ShardPod};
use super::metrics::{MetricsError, Reader};
use super::{policy, rebalance};
use crate::api::{AutoscalingStatus, ConnectionFleet, Plan, RebalanceStatus};
use crate::names::PAUSE_ANNOTATION;
use crate::plan::{kernel::PAGE_BYTES, tcp_mem_pressure_pages};
use crate::reason::{Announcement, EventAction, Reason};

/// Per-fleet memory of the loop (stabilization history, rebalance window).
#[derive(Clone, Debug, Default)]
pub struct Memory {
    /// Autoscaler recommendations and scale events.
    pub history: policy::History,
    /// Rebalancer window and quiet period.
    pub rebalance: rebalance::State,
}

/// What one sync decided.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Replicas to apply.
    pub replicas: i32,
    /// Live connections, when read.
    pub live: Option<i64>,
    /// `MetricsAvailable` condition: (ok, reason, message); `None` when the loop is off.
    pub metrics_condition: Option<(bool, Reason, String)>,
    /// Autoscaler status, when autoscaling is on.
    pub autoscaling: Option<AutoscalingStatus>,
    /// Rebalancer status, when rebalancing is on.
    pub rebalance: Option<RebalanceStatus>,
    /// Events to publish.
    pub events: Vec<Announcement>,
    /// Seconds until the next sync, when the loop is on.
    pub resync: Option<Duration>,
}

/// Everything a sync needs from the controller.
pub struct Inputs<'a> {
    /// The fleet.
    pub fleet: &'a ConnectionFleet,
    /// Its plan (the floor).
    pub plan: &'a Plan,
    /// Replicas its Deployment has now (the plan's shards if none yet).
    pub current: i32,
    /// Prometheus, when configured.
    pub reader: Option<&'a Reader>,
    /// Pods of the fleet's namespace.
    pub pods: &'a Api<Pod>,
    /// The fleet's admin token.
    pub token: &'a str,
    /// HTTP client for shard admin calls.
    pub http: &'a reqwest::Client,
    /// Seconds on the loop's monotonic clock.
    pub now: f64,
    /// Wall-clock time for status.
    pub wall: &'a Time,
}

/// Runs one sync.
pub async fn sync(i: Inputs<'_>, memory: &mut Memory) -> Result<Outcome, kube::Error> {
    let spec = &i.fleet.spec;
    let prev = i.fleet.status.as_ref();
    let auto = spec.autoscaling.as_ref().filter(|a| a.enabled);
    let reb = spec.rebalance.as_ref().filter(|r| r.enabled);
    let floor = i.plan.shards;
    let mut out = Outcome {
        replicas: floor,
        ..Default::default()
    };
    if auto.is_none() && reb.is_none() {
        return Ok(out);
    }
    let period = auto.map(|a| a.sync_period_seconds).unwrap_or(10).max(1) as u64;
    out.resync = Some(Duration::from_secs(period));
    // Until a good reading says otherwise, hold what runs (never below the floor).
    let hold = if auto.is_some() {
        i.current.max(floor)
    } else {
        floor
    };
    out.replicas = hold;
    out.autoscaling = auto.map(|_| prev.and_then(|p| p.autoscaling.clone()).unwrap_or_default());
    out.rebalance = reb.map(|_| prev.and_then(|p| p.rebalance.clone()).unwrap_or_default());

    let paused = i
        .fleet
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PAUSE_ANNOTATION))
        .is_some_and(|v| v == "true");
    let Some(reader) = i.reader else {
        out.metrics_condition = Some((
            false,
            Reason::NoPrometheus,
            "the operator runs without --prometheus-url; holding the current shards".into(),
        ));
        return Ok(out);
    };
    let pods =
        actions::shard_pods(i.pods, &i.fleet.metadata.name.clone().unwrap_or_default()).await?;
    let ready: Vec<String> = pods
        .iter()
        .filter(|p| p.ready)
        .map(|p| p.name.clone())
        .collect();
    let ns = i.fleet.metadata.namespace.clone().unwrap_or_default();
    let name = i.fleet.metadata.name.clone().unwrap_or_default();
    let m = match reader.read(&spec.metrics, &ns, &name, &ready).await {
        Ok(m) => m,
        Err(e) => {
            let reason = match e {
                MetricsError::Unreachable(_) => Reason::PrometheusUnreachable,
                MetricsError::Empty(_) => Reason::NoSamples,
                MetricsError::Stale { .. } => Reason::StaleSamples,
                MetricsError::Partial { .. } => Reason::PartialSamples,
            };
            out.metrics_condition = Some((
                false,
                reason,
                format!("{e}; holding {hold} shards, never scaling down on missing data"),
            ));
            if let Some(a) = out.autoscaling.as_mut() {
                a.desired_shards = hold;
                a.reason = format!("holding: {e}");
            }
            return Ok(out);
        }
    };
    out.live = Some(m.live);
    out.metrics_condition = Some((
        true,
        Reason::MetricsRead,
        format!("{} live connections on {} shards", m.live, m.shards.len()),
    ));

    if let (Some(a), Some(status)) = (auto, out.autoscaling.as_mut()) {
        if paused {
            status.desired_shards = hold;
            status.reason = format!("paused by the {PAUSE_ANNOTATION} annotation");
        } else {
            let obs = policy::Observation {
                current: i.current,
                floor,
                max: spec.shard.max_shards,
                live: m.live,
                shard_capacity: i.plan.shard_connection_limit,
                socket_memory_bytes: m.socket_memory_bytes,
                tcp_mem_pressure_bytes: tcp_mem_pressure_pages(i.plan) * PAGE_BYTES,
            };
            let rec = policy::recommend(a, &obs);
            let d = policy::decide(a, &mut memory.history, i.now, i.current, &rec);
            let target = d.shards.max(floor);
            if target < i.current {
                let victims = least_loaded(&pods, &m.shards, (i.current - target) as usize);
                actions::mark_for_deletion(i.pods, &victims).await?;
                out.events.push(Announcement::normal(
                    Reason::ScaledIn,
                    EventAction::Autoscale,
                    format!(
                        "{} → {target} shards, removing {}: {}",
                        i.current,
                        victims.join(", "),
                        d.reason
                    ),
                ));
            } else if target > i.current {
                out.events.push(Announcement::normal(
                    Reason::ScaledOut,
                    EventAction::Autoscale,
                    format!("{} → {target} shards: {}", i.current, d.reason),
                ));
            }
            if target != i.current {
                status.last_scale_time = Some(i.wall.clone());
            }
            status.desired_shards = target;
            status.reason = d.reason;
            out.replicas = target;
        }
    }

    if let (Some(r), Some(status)) = (reb, out.rebalance.as_mut()) {
        status.max_to_mean_percent = rebalance::max_to_mean_percent(&m.shards);
        // Only a settled fleet is rebalanced: new shards must be up to receive.
        let settled = out.replicas == i.current && ready.len() as i32 == i.current;
        if settled && !paused {
            let orders = rebalance::plan(r, &m.shards, i.now, &mut memory.rebalance);
            let mut sent = 0;
            for o in &orders {
                let Some(ip) = pods
                    .iter()
                    .find(|p| p.name == o.pod)
                    .and_then(|p| p.ip.clone())
                else {
                    continue;
                };
                match actions::shed(i.http, &ip, spec.server.metrics_port, i.token, o).await {
                    Ok(()) => sent += o.count,
                    Err(e) => out.events.push(Announcement::warning(
                        Reason::ShedFailed,
                        EventAction::Autoscale,
                        e.to_string(),
                    )),
                }
            }
            if sent > 0 {
                status.shed_ordered += sent;
                status.last_order_time = Some(i.wall.clone());
                out.events.push(Announcement::normal(
                    Reason::Rebalancing,
                    EventAction::Autoscale,
                    format!(
                        "hottest shard at {} % of the mean: {} shards shed {sent} connections at ≤ {} connections/s in total",
                        status.max_to_mean_percent,
                        orders.len(),
                        r.max_reconnect_rate
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The `n` ready shards holding the fewest connections (not-ready ones first).
fn least_loaded(pods: &[ShardPod], loads: &[rebalance::ShardLoad], n: usize) -> Vec<String> {
    let load = |p: &ShardPod| {
        loads
            .iter()
            .find(|l| l.pod == p.name)
            .map(|l| l.connections)
            .unwrap_or(0)
    };
    let mut v: Vec<&ShardPod> = pods.iter().collect();
    v.sort_by_key(|p| (p.ready, load(p), p.name.clone()));
    v.into_iter().take(n).map(|p| p.name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_in_picks_the_least_loaded_shards() {
        let pods: Vec<ShardPod> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| ShardPod {
                name: n.to_string(),
                ip: None,
                ready: *n != "d",
            })
            .collect();
        let loads = vec![
            rebalance::ShardLoad {
                pod: "a".into(),
                connections: 500,
            },
            rebalance::ShardLoad {
                pod: "b".into(),
                connections: 20,
            },
            rebalance::ShardLoad {
                pod: "c".into(),
                connections: 300,
            },
        ];
        assert_eq!(
            least_loaded(&pods, &loads, 2),
            vec!["d", "b"],
            "a not-ready shard goes first, then the emptiest"
        );
    }
}
