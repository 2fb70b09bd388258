//! Decide (no client required): from what one sync observed and the loop's
//! memory, the shards to run, the pods to remove first, the shed orders to
//! send, and what the fleet's status and events say. Pure: no I/O, times
//! passed in. Shard counts come from [`policy`], shed orders from
//! [`rebalance`]; this module is the glue that holds the rules between them:
//!
//! - never below the floor (the plan's shards);
//! - a failed or doubtful read (any [`MetricsError`], or no Prometheus)
//!   holds what runs: never a scale-in, a victim or a shed order on missing
//!   or doubtful data;
//! - every running shard's connections count, ready or not, and a shard
//!   holding connections is never a victim for being unready (the HPA's
//!   rule: unready pods never push a scale-down);
//! - only a settled fleet is rebalanced (as many ready shards as replicas,
//!   and no change of replicas in this sync), and never while paused;
//! - scale-in victims keep the plan's spread over nodes when the plan
//!   survives the loss of a node (`failureDomain: Node`): the least loaded
//!   shards go first, but never so that one node holds two more of the
//!   fleet's shards than another ([`victims`]);
//! - a scale-in mark (pod-deletion-cost) lives only as long as its
//!   scale-in: once the ReplicaSet has removed what the Deployment no
//!   longer wants, every mark left is lifted, and the pods the ReplicaSet
//!   removed are checked against the ones marked ([`settle_marks`]);
//! - while a rollout is under way (`status.rollout`), no scale-in and no
//!   rebalancing: either would close clients on top of the rollout's
//!   drains, outside spec.rollout.maxReconnectRate, and could move a client
//!   a rollout already moved. A scale-out goes on (ADR 0011 says where the
//!   Deployment puts its shards).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::observe::{Observation, ShardPod};
use super::policy;
use super::prometheus::MetricsError;
use super::rebalance::{self, ShardLoad, ShedOrder};
use crate::api::{
    AutoscalingSpec, AutoscalingStatus, ConnectionFleet, ConnectionFleetSpec, FailureDomain, Plan,
    RebalanceSpec, RebalanceStatus,
};
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
    /// Kernel drifts announced (pod, setting).
    pub drift: super::drift::Announced,
    /// The last scale-in marked, until the ReplicaSet has carried it out.
    pub scale_in: Option<ScaleIn>,
}

/// A scale-in as marked: what [`settle_marks`] checks the ReplicaSet's
/// removals against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScaleIn {
    /// The pods marked to go.
    pub victims: Vec<String>,
    /// The fleet's active pods when they were marked.
    pub pods: Vec<String>,
}

/// Everything [`decide`] looks at.
#[derive(Clone, Debug)]
pub struct DecideInput<'a> {
    /// `spec.autoscaling`, when enabled.
    pub autoscaling: Option<&'a AutoscalingSpec>,
    /// `spec.rebalance`, when enabled.
    pub rebalance: Option<&'a RebalanceSpec>,
    /// `spec.shard.maxShards`.
    pub max_shards: i32,
    /// `spec.server.metricsPort`: where shards take admin orders.
    pub admin_port: i32,
    /// The plan's shards: the floor.
    pub floor: i32,
    /// The plan's per-shard connection cap.
    pub shard_capacity: i64,
    /// Scale-in keeps the shards spread over nodes: the plan survives the
    /// loss of a node (`failureDomain: Node`).
    pub spread: bool,
    /// The node's `tcp_mem` pressure threshold, bytes.
    pub tcp_mem_pressure_bytes: i64,
    /// The autoscaler status the fleet has now.
    pub prev_autoscaling: Option<&'a AutoscalingStatus>,
    /// The rebalancer status the fleet has now.
    pub prev_rebalance: Option<&'a RebalanceStatus>,
    /// Replicas the Deployment has now (the plan's shards if none yet).
    pub current: i32,
    /// Pods and metrics as observed in this sync.
    pub observation: &'a Observation,
    /// The fleet carries the pause annotation.
    pub paused: bool,
    /// A rollout is under way (the fleet's `status.rollout`, as the last
    /// reconcile saw it).
    pub rolling: bool,
    /// Seconds on the loop's monotonic clock.
    pub now: f64,
    /// Wall-clock time for status.
    pub wall: &'a Time,
}

impl<'a> DecideInput<'a> {
    /// The input for `fleet` with its `plan`, `current` replicas and what was
    /// observed.
    pub fn new(
        fleet: &'a ConnectionFleet,
        plan: &Plan,
        current: i32,
        observation: &'a Observation,
        now: f64,
        wall: &'a Time,
    ) -> Self {
        let spec = &fleet.spec;
        let prev = fleet.status.as_ref();
        let (autoscaling, rebalance) = enabled(spec);
        DecideInput {
            autoscaling,
            rebalance,
            max_shards: spec.shard.max_shards,
            admin_port: spec.server.metrics_port,
            floor: plan.shards,
            shard_capacity: plan.shard_connection_limit,
            spread: plan.failure_domain == FailureDomain::Node,
            tcp_mem_pressure_bytes: tcp_mem_pressure_pages(plan) * PAGE_BYTES,
            prev_autoscaling: prev.and_then(|p| p.autoscaling.as_ref()),
            prev_rebalance: prev.and_then(|p| p.rebalance.as_ref()),
            current,
            observation,
            paused: paused(fleet),
            rolling: prev.is_some_and(|p| p.rollout.is_some()),
            now,
            wall,
        }
    }

    /// The loop runs: autoscaling or rebalancing is enabled.
    pub fn on(&self) -> bool {
        self.autoscaling.is_some() || self.rebalance.is_some()
    }
}

/// `spec.autoscaling` and `spec.rebalance`, each when enabled.
fn enabled(spec: &ConnectionFleetSpec) -> (Option<&AutoscalingSpec>, Option<&RebalanceSpec>) {
    (
        spec.autoscaling.as_ref().filter(|a| a.enabled),
        spec.rebalance.as_ref().filter(|r| r.enabled),
    )
}

/// The loop runs for a fleet with `spec`: autoscaling or rebalancing is enabled.
pub fn runs(spec: &ConnectionFleetSpec) -> bool {
    let (a, r) = enabled(spec);
    a.is_some() || r.is_some()
}

/// The fleet carries [`PAUSE_ANNOTATION`]`: "true"`.
pub fn paused(fleet: &ConnectionFleet) -> bool {
    fleet
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PAUSE_ANNOTATION))
        .is_some_and(|v| v == "true")
}

/// What one sync tells the reconcile (after [`Decision::settle`]).
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// `KernelDrift` condition: (drifted, reason, message), drifted `None`
    /// (Unknown) when no shard reported what its plan sets; `None` when the
    /// shards' kernel settings were not read in this sync.
    pub kernel_drift: Option<(Option<bool>, Reason, String)>,
    /// Time until the next sync, when the loop is on.
    pub resync: Option<Duration>,
}

/// What one sync decided: the outcome for the fleet (replicas, status
/// parts, events, resync), and what [`super::act`] must do to the shards.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Replicas, status parts and events as decided; shed orders add to it
    /// once sent ([`Decision::settle`]).
    pub outcome: Outcome,
    /// Pods to remove first on this scale-in (pod-deletion-cost), least loaded first.
    pub victims: Vec<String>,
    /// Pods whose scale-in mark outlived its scale-in: the mark is lifted.
    pub unmark: Vec<String>,
    /// Shed orders to send, when the rebalancer gave some.
    pub shed: Option<ShedPlan>,
}

/// Shed orders of one sync, and what announcing them needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ShedPlan {
    /// One order per hot shard.
    pub orders: Vec<Shed>,
    /// The shards' admin port.
    pub port: i32,
    /// `spec.rebalance.maxReconnectRate`, for the event.
    pub max_reconnect_rate: i64,
    /// When the orders were decided.
    pub at: Time,
}

/// One shed order and where its shard takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shed {
    /// The order.
    pub order: ShedOrder,
    /// The shard's pod IP; `None`: no IP yet, the order is not sent.
    pub ip: Option<String>,
}

/// What carrying out a decision did ([`super::act`]), for [`Decision::settle`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Acted {
    /// Connections the shards accepted orders to shed.
    pub sent: i64,
    /// A `ShedFailed` Warning per order that did not go through.
    pub failures: Vec<Announcement>,
}

impl Decision {
    /// Shed orders decided (none when the plan is empty).
    pub fn shed_orders(&self) -> &[Shed] {
        self.shed.as_ref().map_or(&[], |s| &s.orders[..])
    }

    /// The outcome once the decision was carried out: failed orders
    /// announced, and the connections the shards took orders for counted in
    /// the rebalancer status and announced as `Rebalancing`.
    pub fn settle(self, acted: Acted) -> Outcome {
        let mut out = self.outcome;
        out.events.extend(acted.failures);
        if let (Some(plan), Some(status)) = (self.shed, out.rebalance.as_mut())
            && acted.sent > 0
        {
            status.shed_ordered = status.shed_ordered.saturating_add(acted.sent);
            status.last_order_time = Some(plan.at);
            out.events.push(Announcement::normal(
                Reason::Rebalancing,
                EventAction::Autoscale,
                format!(
                    "hottest shard at {} % of the mean: {} shards shed {} connections at ≤ {} connections/s in total",
                    status.max_to_mean_percent,
                    plan.orders.len(),
                    acted.sent,
                    plan.max_reconnect_rate
                ),
            ));
        }
        out
    }
}

/// Decides one sync, updating `memory`.
pub fn decide(i: &DecideInput<'_>, memory: &mut Memory) -> Decision {
    let mut d = decide_shards(i, memory);
    settle_marks(i, &mut d, memory);
    d
}

/// Replicas, victims, shed orders, status parts and events of one sync.
fn decide_shards(i: &DecideInput<'_>, memory: &mut Memory) -> Decision {
    let floor = i.floor;
    let mut d = Decision::default();
    let out = &mut d.outcome;
    out.replicas = floor;
    if !i.on() {
        return d;
    }
    let period = i.autoscaling.map_or(10, |a| a.sync_period_seconds).max(1) as u64;
    out.resync = Some(Duration::from_secs(period));
    // Until a good reading says otherwise, hold what runs (never below the floor).
    let hold = if i.autoscaling.is_some() {
        i.current.max(floor)
    } else {
        floor
    };
    out.replicas = hold;
    out.autoscaling = i
        .autoscaling
        .map(|_| i.prev_autoscaling.cloned().unwrap_or_default());
    out.rebalance = i
        .rebalance
        .map(|_| i.prev_rebalance.cloned().unwrap_or_default());

    let m = match &i.observation.metrics {
        None => {
            out.metrics_condition = Some((
                false,
                Reason::NoPrometheus,
                "the operator runs without --prometheus-url; holding the current shards".into(),
            ));
            return d;
        }
        Some(Err(e)) => {
            out.metrics_condition = Some((
                false,
                doubt(e),
                format!("{e}; holding {hold} shards, never scaling down on missing data"),
            ));
            if let Some(a) = out.autoscaling.as_mut() {
                a.desired_shards = hold;
                a.reason = format!("holding: {e}");
            }
            return d;
        }
        Some(Ok(m)) => m,
    };
    out.live = Some(m.live);
    out.metrics_condition = Some((
        true,
        Reason::MetricsRead,
        format!("{} live connections on {} shards", m.live, m.shards.len()),
    ));

    if let (Some(a), Some(status)) = (i.autoscaling, out.autoscaling.as_mut()) {
        if i.paused {
            status.desired_shards = hold;
            status.reason = format!("paused by the {PAUSE_ANNOTATION} annotation");
        } else {
            let obs = policy::Observation {
                current: i.current,
                floor,
                max: i.max_shards,
                live: m.live,
                shard_capacity: i.shard_capacity,
                socket_memory_bytes: m.socket_memory_bytes,
                tcp_mem_pressure_bytes: i.tcp_mem_pressure_bytes,
            };
            let mut rec = policy::recommend(a, &obs);
            if i.rolling && rec.shards < i.current {
                rec.reason = format!(
                    "{}; scale-in to {} waits for the rollout under way",
                    rec.reason, rec.shards
                );
                rec.shards = i.current;
            }
            let p = policy::decide(a, &mut memory.history, i.now, i.current, &rec);
            let target = p.shards.max(floor);
            if target < i.current {
                d.victims = victims(
                    &i.observation.pods,
                    &m.shards,
                    i.current.saturating_sub(target) as usize,
                    i.spread,
                );
                out.events.push(Announcement::normal(
                    Reason::ScaledIn,
                    EventAction::Autoscale,
                    format!(
                        "{} → {target} shards, removing {}: {}",
                        i.current,
                        d.victims.join(", "),
                        p.reason
                    ),
                ));
            } else if target > i.current {
                out.events.push(Announcement::normal(
                    Reason::ScaledOut,
                    EventAction::Autoscale,
                    format!("{} → {target} shards: {}", i.current, p.reason),
                ));
            }
            if target != i.current {
                status.last_scale_time = Some(i.wall.clone());
            }
            status.desired_shards = target;
            status.reason = p.reason;
            out.replicas = target;
        }
    }

    if let (Some(r), Some(status)) = (i.rebalance, out.rebalance.as_mut()) {
        status.max_to_mean_percent = rebalance::max_to_mean_percent(&m.shards);
        // Only a settled fleet is rebalanced: new shards must be up to receive.
        let ready = i.observation.pods.iter().filter(|p| p.ready).count();
        let settled = out.replicas == i.current && ready as i32 == i.current;
        if settled && !i.paused && !i.rolling {
            let orders = rebalance::plan(r, &m.shards, i.now, &mut memory.rebalance);
            if !orders.is_empty() {
                d.shed = Some(ShedPlan {
                    orders: orders
                        .into_iter()
                        .map(|order| Shed {
                            ip: i
                                .observation
                                .pods
                                .iter()
                                .find(|p| p.name == order.pod)
                                .and_then(|p| p.ip.clone()),
                            order,
                        })
                        .collect(),
                    port: i.admin_port,
                    max_reconnect_rate: r.max_reconnect_rate,
                    at: i.wall.clone(),
                });
            }
        }
    }
    d
}

/// The `MetricsAvailable` reason of a doubtful read.
fn doubt(e: &MetricsError) -> Reason {
    match e {
        MetricsError::Unreachable(_) => Reason::PrometheusUnreachable,
        MetricsError::Empty(_) => Reason::NoSamples,
        MetricsError::Stale { .. } => Reason::StaleSamples,
        MetricsError::Partial { .. } => Reason::PartialSamples,
        MetricsError::Doubtful(_) => Reason::DoubtfulSamples,
        MetricsError::Refused(_) => Reason::InvalidSpec,
    }
}

/// Lifts the scale-in marks that outlived their scale-in, and checks what
/// the ReplicaSet removed (issue 21, item 7). A mark left behind (an apply
/// that failed after the marks, a leader that exited between them, a
/// scale-in called off) would make the ReplicaSet remove that shard on
/// some later scale-down, however full it has become since (kubernetes
/// #126138).
///
/// Nothing is judged while the ReplicaSet has yet to act (more active pods
/// than the Deployment's replicas: a scale-in under way, or a rollout's
/// surge), nor on a read that holds (a hold touches no pod, and says
/// nothing but why it holds; the check waits for the next good read), nor
/// without a pod listing. Otherwise every marked active pod
/// that is not a victim of this sync is unmarked, and a scale-in marked
/// earlier ([`Memory::scale_in`]) is checked: when the ReplicaSet removed
/// pods other than the marked ones (it ranks a pod that is not ready, or
/// not running, before any pod-deletion-cost), a `ScaleInUnmarkedRemoved`
/// Warning names them and the marked shards it kept.
fn settle_marks(i: &DecideInput<'_>, d: &mut Decision, memory: &mut Memory) {
    let active: Vec<&ShardPod> = i.observation.pods.iter().filter(|p| p.active).collect();
    let read = matches!(i.observation.metrics, Some(Ok(_)));
    if !read || active.is_empty() || active.len() as i32 > i.current {
        return;
    }
    let is_active = |name: &String| active.iter().any(|p| &p.name == name);
    d.unmark = active
        .iter()
        .filter(|p| p.marked && !d.victims.contains(&p.name))
        .map(|p| p.name.clone())
        .collect();
    if let Some(s) = memory.scale_in.take() {
        let removed: Vec<&String> = s.pods.iter().filter(|n| !is_active(n)).collect();
        let unmarked: Vec<&str> = removed
            .iter()
            .filter(|n| !s.victims.contains(**n))
            .map(|n| n.as_str())
            .collect();
        if !unmarked.is_empty() {
            let kept: Vec<&str> = s
                .victims
                .iter()
                .filter(|n| is_active(n))
                .map(|n| n.as_str())
                .collect();
            d.outcome.events.push(Announcement::warning(
                Reason::ScaleInUnmarkedRemoved,
                EventAction::Autoscale,
                format!(
                    "the ReplicaSet removed {} instead of the shards marked to go ({}): it ranks a shard that is not ready or not running before any pod-deletion-cost",
                    unmarked.join(", "),
                    if kept.is_empty() { "none left".to_string() } else { kept.join(", ") }
                ),
            ));
        }
    }
    if !d.victims.is_empty() {
        memory.scale_in = Some(ScaleIn {
            victims: d.victims.clone(),
            pods: active.iter().map(|p| p.name.clone()).collect(),
        });
    }
}

/// The `n` active shards to remove first: the fewest connections first
/// ([`by_load`]); with `spread`, only shards whose removal leaves the
/// fleet's spread over nodes within one shard, or no wider than it was
/// (the `maxSkew: 1` the scheduler placed them under, see
/// [`crate::render`]), counting every node that holds one of its active
/// shards now. A pod on the node holding the most always qualifies, so
/// there are always `n` victims when `n` active pods exist. Pods not yet
/// bound to a node leave the spread as it is.
fn victims(pods: &[ShardPod], loads: &[ShardLoad], n: usize, spread: bool) -> Vec<String> {
    let mut left = by_load(pods, loads);
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &left {
        if let Some(node) = &p.node {
            *per_node.entry(node).or_default() += 1;
        }
    }
    let skew =
        |m: &BTreeMap<&str, usize>| m.values().max().unwrap_or(&0) - m.values().min().unwrap_or(&0);
    let mut out = Vec::new();
    while out.len() < n {
        let keeps_spread = |p: &&ShardPod| {
            let Some(node) = p.node.as_deref().filter(|_| spread) else {
                return true;
            };
            let mut after = per_node.clone();
            after.entry(node).and_modify(|c| *c -= 1);
            skew(&after) <= skew(&per_node).max(1)
        };
        let Some(k) = left.iter().position(keeps_spread) else {
            break;
        };
        let p = left.remove(k);
        if let Some(c) = p.node.as_deref().and_then(|node| per_node.get_mut(node)) {
            *c -= 1;
        }
        out.push(p.name.clone());
    }
    out
}

/// The active shards by load, fewest connections first: a not-ready shard
/// (or one not running yet, with no sample) goes before a ready one only
/// at the same load, so only when it holds nothing does it go first.
/// Terminating pods are no victims: their ReplicaSet no longer counts
/// them.
fn by_load<'a>(pods: &'a [ShardPod], loads: &[ShardLoad]) -> Vec<&'a ShardPod> {
    let load = |p: &ShardPod| {
        loads
            .iter()
            .find(|l| l.pod == p.name)
            .map_or(0, |l| l.connections)
    };
    let mut v: Vec<&ShardPod> = pods.iter().filter(|p| p.active).collect();
    v.sort_by_key(|p| (load(p), p.ready, p.name.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ScalingRules;
    use crate::autoscale::prometheus::{Doubt, FleetMetrics};
    use proptest::prelude::*;

    const FLOOR: i32 = 2;
    const MAX: i32 = 8;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    /// Autoscaling as the end-to-end tests run it: fast scale-down.
    fn autoscaling() -> AutoscalingSpec {
        serde_json::from_value(serde_json::json!({
            "enabled": true,
            "syncPeriodSeconds": 2,
            "scaleDown": {"stabilizationWindowSeconds": 4, "shardsPerPeriod": 8, "percentPerPeriod": 100, "periodSeconds": 2},
        }))
        .unwrap()
    }

    fn rebalancing() -> RebalanceSpec {
        serde_json::from_value(
            serde_json::json!({"enabled": true, "windowSeconds": 0, "maxReconnectRate": 100}),
        )
        .unwrap()
    }

    /// Running pods `(name, ready, connections)`, each with an IP; metrics
    /// read from all of them, ready or not.
    fn seen(pods: &[(&str, bool, i64)]) -> Observation {
        let shards: Vec<ShardLoad> = pods
            .iter()
            .map(|(name, _, c)| ShardLoad {
                pod: name.to_string(),
                connections: *c,
            })
            .collect();
        Observation {
            pods: pods
                .iter()
                .map(|(name, ready, _)| ShardPod {
                    name: name.to_string(),
                    ip: Some(format!("127.1.1.{}", name.len())),
                    ready: *ready,
                    running: true,
                    active: true,
                    ..Default::default()
                })
                .collect(),
            metrics: Some(Ok(FleetMetrics {
                live: shards.iter().map(|s| s.connections).sum(),
                shards,
                socket_memory_bytes: None,
            })),
            kernel: None,
        }
    }

    /// Shards of 500 connections (target 400 at 80 %), floor 2, at most 8.
    fn input<'a>(
        autoscaling: Option<&'a AutoscalingSpec>,
        rebalance: Option<&'a RebalanceSpec>,
        current: i32,
        observation: &'a Observation,
        wall: &'a Time,
    ) -> DecideInput<'a> {
        DecideInput {
            autoscaling,
            rebalance,
            max_shards: MAX,
            admin_port: 9090,
            floor: FLOOR,
            shard_capacity: 500,
            spread: false,
            tcp_mem_pressure_bytes: 1 << 40,
            prev_autoscaling: None,
            prev_rebalance: None,
            current,
            observation,
            paused: false,
            rolling: false,
            now: 100.0,
            wall,
        }
    }

    fn reasons(d: &Decision) -> Vec<Reason> {
        d.outcome.events.iter().map(|e| e.reason).collect()
    }

    #[test]
    fn with_the_loop_off_the_plan_decides() {
        let obs = seen(&[("a", true, 5000), ("b", true, 5000)]);
        let wall = t(1);
        let d = decide(&input(None, None, 5, &obs, &wall), &mut Memory::default());
        assert_eq!(
            d,
            Decision {
                outcome: Outcome {
                    replicas: FLOOR,
                    ..Default::default()
                },
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_load_over_the_threshold_scales_out_and_says_why() {
        let a = autoscaling();
        let obs = seen(&[("a", true, 750), ("b", true, 750)]);
        let wall = t(1);
        let d = decide(
            &input(Some(&a), None, 2, &obs, &wall),
            &mut Memory::default(),
        );
        let out = &d.outcome;
        assert_eq!(out.replicas, 4, "1,500 live at 400 per shard");
        assert_eq!(out.live, Some(1500));
        assert_eq!(out.resync, Some(Duration::from_secs(2)));
        let (ok, reason, _) = out.metrics_condition.clone().unwrap();
        assert!(ok);
        assert_eq!(reason, Reason::MetricsRead);
        let status = out.autoscaling.as_ref().unwrap();
        assert_eq!(status.desired_shards, 4);
        assert_eq!(status.last_scale_time, Some(wall.clone()));
        assert!(status.reason.contains("live connections need 4 shards"));
        assert_eq!(reasons(&d), vec![Reason::ScaledOut]);
        assert!(out.events[0].note.starts_with("2 → 4 shards: "));
        assert!(d.victims.is_empty() && d.shed.is_none());
    }

    #[test]
    fn scale_in_removes_the_least_loaded_shards() {
        let a = autoscaling();
        let obs = seen(&[
            ("a", true, 300),
            ("b", true, 20),
            ("c", true, 250),
            ("d", true, 30),
        ]);
        let wall = t(1);
        let d = decide(
            &input(Some(&a), None, 4, &obs, &wall),
            &mut Memory::default(),
        );
        assert_eq!(d.outcome.replicas, 2, "600 live at 400 per shard");
        assert_eq!(d.victims, vec!["b", "d"]);
        assert_eq!(reasons(&d), vec![Reason::ScaledIn]);
        assert!(
            d.outcome.events[0]
                .note
                .starts_with("4 → 2 shards, removing b, d: "),
            "{:?}",
            d.outcome.events
        );
    }

    /// `seen` with each pod on a node: `(name, node, connections)`, all
    /// ready.
    fn seen_on(pods: &[(&str, &str, i64)]) -> Observation {
        let mut obs = seen(
            &pods
                .iter()
                .map(|(n, _, c)| (*n, true, *c))
                .collect::<Vec<_>>(),
        );
        for (p, (_, node, _)) in obs.pods.iter_mut().zip(pods) {
            p.node = Some(node.to_string());
        }
        obs
    }

    /// Issue 21, item 6: the least loaded shards all share node A. Six
    /// shards on three nodes scale in to 3 (a `Node` plan).
    #[test]
    fn scale_in_keeps_the_spread_over_nodes_when_the_least_loaded_share_one() {
        let a = autoscaling();
        let obs = seen_on(&[
            ("a1", "A", 0),
            ("a2", "A", 5),
            ("b1", "B", 240),
            ("b2", "B", 260),
            ("c1", "C", 230),
            ("c2", "C", 265),
        ]);
        let wall = t(1);
        let spread = DecideInput {
            spread: true,
            ..input(Some(&a), None, 6, &obs, &wall)
        };
        let d = decide(&spread, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 3, "1,000 live at 400 per shard");
        // a1, then a2 would leave A empty beside two on B and C: the next
        // least loaded of B and C instead, then A's last would empty it.
        assert_eq!(d.victims, vec!["a1", "c1", "b1"]);
        // Without the plan's spread, load alone: A is emptied.
        let load_only = decide(
            &input(Some(&a), None, 6, &obs, &wall),
            &mut Memory::default(),
        );
        assert_eq!(load_only.victims, vec!["a1", "a2", "c1"]);
    }

    #[test]
    fn a_pod_not_yet_on_a_node_leaves_the_spread_as_it_is() {
        let mut obs = seen_on(&[("a1", "A", 0), ("b1", "B", 10), ("b2", "B", 20)]);
        obs.pods.push(ShardPod {
            name: "pending".into(),
            active: true,
            ..Default::default()
        });
        let loads = match &obs.metrics {
            Some(Ok(m)) => m.shards.clone(),
            _ => unreachable!(),
        };
        assert_eq!(
            victims(&obs.pods, &loads, 2, true),
            vec!["pending", "b1"],
            "A's only shard stays while B has two"
        );
    }

    proptest! {
        /// Issue 21, item 6: victims never widen the spread over nodes
        /// beyond one shard (or beyond what it was), and there are always
        /// as many as asked for, up to the active pods.
        #[test]
        fn victims_keep_the_spread_and_are_as_many_as_asked(
            pods in proptest::collection::vec((0u8..4, 0i64..1000, any::<bool>()), 1..12),
            n in 0usize..12,
        ) {
            let shard_pods: Vec<ShardPod> = pods
                .iter()
                .enumerate()
                .map(|(k, (node, _, ready))| ShardPod {
                    name: format!("p{k}"),
                    ready: *ready,
                    running: true,
                    active: true,
                    node: Some(format!("n{node}")),
                    ..Default::default()
                })
                .collect();
            let loads: Vec<ShardLoad> = pods
                .iter()
                .enumerate()
                .map(|(k, (_, c, _))| ShardLoad { pod: format!("p{k}"), connections: *c })
                .collect();
            let skew = |names: &[String]| {
                let mut per: BTreeMap<&str, i64> = BTreeMap::new();
                for p in &shard_pods {
                    let e = per.entry(p.node.as_deref().unwrap()).or_default();
                    if !names.contains(&p.name) {
                        *e += 1;
                    }
                }
                per.values().max().unwrap() - per.values().min().unwrap()
            };
            let v = victims(&shard_pods, &loads, n, true);
            prop_assert_eq!(v.len(), n.min(shard_pods.len()));
            prop_assert!(skew(&v) <= skew(&[]).max(1), "{v:?}");
        }
    }

    /// Issue 21, item 7: a mark whose scale-in never happened (the apply
    /// failed after the marks, or the scale-in was called off) is lifted
    /// once no scale-in is wanted; none is lifted while the ReplicaSet has
    /// yet to act.
    #[test]
    fn a_mark_that_outlived_its_scale_in_is_lifted() {
        let a = autoscaling();
        let wall = t(1);
        let mut obs = seen(&[("a", true, 390), ("b", true, 380), ("c", true, 250)]);
        obs.pods[0].marked = true;
        let d = decide(
            &input(Some(&a), None, 3, &obs, &wall),
            &mut Memory::default(),
        );
        assert_eq!(d.outcome.replicas, 3, "1,020 live: no scale-in");
        assert_eq!(d.unmark, vec!["a"]);
        // A fourth pod the ReplicaSet has yet to remove: nothing is judged.
        obs.pods.push(ShardPod {
            name: "d".into(),
            active: true,
            marked: true,
            ..Default::default()
        });
        let d = decide(
            &input(Some(&a), None, 3, &obs, &wall),
            &mut Memory::default(),
        );
        assert!(d.unmark.is_empty(), "{:?}", d.unmark);
        // A new scale-in keeps its own victims marked.
        let mut idle = seen(&[("a", true, 20), ("b", true, 300), ("c", true, 10)]);
        idle.pods[2].marked = true;
        let d = decide(
            &input(Some(&a), None, 3, &idle, &wall),
            &mut Memory::default(),
        );
        assert_eq!(d.victims, vec!["c"]);
        assert!(d.unmark.is_empty(), "{:?}", d.unmark);
    }

    /// Issue 21, item 7: the ReplicaSet removed a shard that was not
    /// marked (it was not ready: readiness ranks before pod-deletion-cost);
    /// the next sync says so, and lifts the mark of the shard it kept.
    #[test]
    fn a_scale_in_that_removed_an_unmarked_shard_is_reported() {
        let a = autoscaling();
        let wall = t(1);
        let mut memory = Memory::default();
        let obs = seen(&[("a", true, 200), ("b", false, 180), ("c", true, 10)]);
        let d = decide(&input(Some(&a), None, 3, &obs, &wall), &mut memory);
        assert_eq!(d.victims, vec!["c"]);
        assert_eq!(
            memory.scale_in,
            Some(ScaleIn {
                victims: vec!["c".into()],
                pods: vec!["a".into(), "b".into(), "c".into()],
            })
        );
        // The ReplicaSet removed b; c is still there, marked.
        let mut after = seen(&[("a", true, 290), ("c", true, 100)]);
        after.pods[1].marked = true;
        let d = decide(&input(Some(&a), None, 2, &after, &wall), &mut memory);
        assert_eq!(reasons(&d), vec![Reason::ScaleInUnmarkedRemoved]);
        let note = &d.outcome.events[0].note;
        assert!(
            note.starts_with("the ReplicaSet removed b instead of the shards marked to go (c)"),
            "{note}"
        );
        assert_eq!(d.unmark, vec!["c"]);
        assert_eq!(memory.scale_in, None);
        // Removed as marked: nothing to say.
        let mut memory = Memory::default();
        decide(&input(Some(&a), None, 3, &obs, &wall), &mut memory);
        let as_marked = seen(&[("a", true, 200), ("b", false, 190)]);
        let d = decide(&input(Some(&a), None, 2, &as_marked, &wall), &mut memory);
        assert!(reasons(&d).is_empty(), "{:?}", d.outcome.events);
    }

    #[test]
    fn scale_in_picks_the_least_loaded_shards() {
        let pods: Vec<ShardPod> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| ShardPod {
                name: n.to_string(),
                ip: None,
                ready: *n != "d",
                running: *n != "d",
                active: true,
                ..Default::default()
            })
            .collect();
        let loads = vec![
            ShardLoad {
                pod: "a".into(),
                connections: 500,
            },
            ShardLoad {
                pod: "b".into(),
                connections: 20,
            },
            ShardLoad {
                pod: "c".into(),
                connections: 300,
            },
        ];
        assert_eq!(
            victims(&pods, &loads, 2, false),
            vec!["d", "b"],
            "a not-ready shard holding nothing goes first, then the emptiest"
        );
    }

    /// Issue 10, fault 2: a not-ready shard's connections sorted it first.
    #[test]
    fn an_unready_shard_is_never_a_victim_for_being_unready() {
        let pod = |name: &str, ready, running, active| ShardPod {
            name: name.into(),
            ip: None,
            ready,
            running,
            active,
            ..Default::default()
        };
        let load = |pod: &str, connections| ShardLoad {
            pod: pod.into(),
            connections,
        };
        let pods = vec![
            pod("a", true, true, true),
            pod("b", true, true, true),
            pod("full", false, true, true), // running, not ready, holding 380
            pod("idle", false, true, true), // running, not ready, holding 0
            pod("pending", false, false, true),
            pod("leaving", false, false, false), // terminating
        ];
        let loads = vec![
            load("a", 20),
            load("b", 0),
            load("full", 380),
            load("idle", 0),
        ];
        assert_eq!(
            victims(&pods, &loads, 6, false),
            vec!["idle", "pending", "b", "a", "full"],
            "by load; unready first only at the same load; a terminating pod never"
        );
        assert_eq!(
            victims(&pods, &loads, 3, false),
            vec!["idle", "pending", "b"]
        );
    }

    /// Issue 10, fault 2, end to end in decide: all three shards hold
    /// 380,000 (cap 500,000, 80 % target) and p2 is not ready.
    #[test]
    fn an_unready_shards_connections_count_toward_live_load() {
        let a = autoscaling();
        let wall = t(1);
        let obs = seen(&[
            ("p0", true, 380_000),
            ("p1", true, 380_000),
            ("p2", false, 380_000),
        ]);
        let mut i = input(Some(&a), None, 3, &obs, &wall);
        (i.floor, i.shard_capacity) = (1, 500_000);
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.live, Some(1_140_000));
        assert_eq!(
            d.outcome.replicas, 3,
            "0.95 of 3 × 400,000: within tolerance"
        );
        assert!(d.victims.is_empty() && d.outcome.events.is_empty());
        // Far less load: a scale-in, and the loaded unready shard goes last.
        let obs = seen(&[("p0", true, 10), ("p1", true, 20), ("p2", false, 30_000)]);
        let i = DecideInput {
            observation: &obs,
            ..i
        };
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 1);
        assert_eq!(d.victims, vec!["p0", "p1"]);
    }

    /// Issue 10, fault 1, in decide: a doubtful read (the reader's answer
    /// to p2 = NaN) holds 3 shards where a NaN read as 0 recommended 2.
    #[test]
    fn a_doubtful_read_holds_and_names_the_doubt() {
        let (a, r) = (autoscaling(), rebalancing());
        let wall = t(1);
        let mut obs = seen(&[
            ("p0", true, 380_000),
            ("p1", true, 380_000),
            ("p2", true, 0),
        ]);
        obs.metrics = Some(Err(MetricsError::Doubtful(vec![Doubt::NonFinite {
            series: "pod p2's live connections".into(),
            value: "NaN".into(),
        }])));
        let mut i = input(Some(&a), Some(&r), 3, &obs, &wall);
        (i.floor, i.shard_capacity) = (1, 500_000);
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 3);
        assert!(d.victims.is_empty() && d.shed.is_none());
        assert_eq!(d.outcome.live, None);
        let (ok, reason, message) = d.outcome.metrics_condition.unwrap();
        assert_eq!((ok, reason), (false, Reason::DoubtfulSamples));
        assert!(
            message.starts_with("doubtful samples: pod p2's live connections is NaN, not a finite number; holding 3 shards"),
            "{message}"
        );
    }

    #[test]
    fn an_outage_holds_the_shards_and_says_why() {
        let a = autoscaling();
        let r = rebalancing();
        let wall = t(1);
        let doubts = [
            (
                MetricsError::Unreachable("connection refused".into()),
                Reason::PrometheusUnreachable,
            ),
            (MetricsError::Empty("up".into()), Reason::NoSamples),
            (
                MetricsError::Stale {
                    age: 90.0,
                    limit: 60,
                },
                Reason::StaleSamples,
            ),
            (
                MetricsError::Partial {
                    missing: 1,
                    expected: 4,
                    pods: vec!["d".into()],
                },
                Reason::PartialSamples,
            ),
            (
                MetricsError::Doubtful(vec![Doubt::Duplicate {
                    pod: "d".into(),
                    count: 2,
                }]),
                Reason::DoubtfulSamples,
            ),
        ];
        for (e, want) in doubts {
            let mut obs = seen(&[
                ("a", true, 0),
                ("b", true, 0),
                ("c", true, 0),
                ("d", true, 900),
            ]);
            obs.metrics = Some(Err(e.clone()));
            let d = decide(
                &input(Some(&a), Some(&r), 4, &obs, &wall),
                &mut Memory::default(),
            );
            assert_eq!(d.outcome.replicas, 4, "{e}: holds what runs");
            assert!(d.victims.is_empty() && d.shed.is_none(), "{e}");
            assert!(d.outcome.events.is_empty(), "{e}");
            assert_eq!(d.outcome.live, None);
            let (ok, reason, message) = d.outcome.metrics_condition.clone().unwrap();
            assert!(!ok);
            assert_eq!(reason, want);
            assert!(message.contains("holding 4 shards"), "{message}");
            let status = d.outcome.autoscaling.unwrap();
            assert_eq!(status.desired_shards, 4);
            assert_eq!(status.reason, format!("holding: {e}"));
        }
    }

    #[test]
    fn without_prometheus_the_loop_holds_and_keeps_the_last_status() {
        let a = autoscaling();
        let wall = t(1);
        let obs = Observation::default();
        let last = AutoscalingStatus {
            desired_shards: 3,
            reason: "earlier".into(),
            last_scale_time: Some(t(0)),
        };
        let mut i = input(Some(&a), None, 3, &obs, &wall);
        i.prev_autoscaling = Some(&last);
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 3);
        assert_eq!(d.outcome.autoscaling, Some(last));
        let (ok, reason, _) = d.outcome.metrics_condition.unwrap();
        assert_eq!((ok, reason), (false, Reason::NoPrometheus));
        // Never below the floor, even holding.
        let d = decide(
            &input(Some(&a), None, 1, &obs, &wall),
            &mut Memory::default(),
        );
        assert_eq!(d.outcome.replicas, FLOOR);
    }

    #[test]
    fn a_paused_fleet_holds_and_sheds_nothing() {
        let (a, r) = (autoscaling(), rebalancing());
        let wall = t(1);
        let obs = seen(&[("a", true, 3000), ("b", true, 0)]);
        let mut i = input(Some(&a), Some(&r), 2, &obs, &wall);
        i.paused = true;
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 2, "3,000 live would need 8");
        assert!(d.shed.is_none() && d.outcome.events.is_empty());
        let status = d.outcome.autoscaling.unwrap();
        assert!(
            status.reason.contains(PAUSE_ANNOTATION),
            "{}",
            status.reason
        );
        assert_eq!(d.outcome.rebalance.unwrap().max_to_mean_percent, 200);
    }

    /// Issue 22, item 4: mid-rollout, a load that calls for fewer shards
    /// scales nothing in and sheds nothing (both would close clients on
    /// top of the rollout's drains); more load still scales out.
    #[test]
    fn mid_rollout_no_scale_in_and_no_shed_but_a_scale_out() {
        let (a, r) = (autoscaling(), rebalancing());
        let wall = t(1);
        let obs = seen(&[
            ("a", true, 600),
            ("b", true, 0),
            ("c", true, 0),
            ("d", true, 0),
        ]);
        let mut i = input(Some(&a), Some(&r), 4, &obs, &wall);
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 2, "600 live need 2 shards");
        i.rolling = true;
        let d = decide(&i, &mut Memory::default());
        assert_eq!(d.outcome.replicas, 4);
        assert!(d.victims.is_empty() && d.shed.is_none() && d.outcome.events.is_empty());
        let status = d.outcome.autoscaling.unwrap();
        assert!(
            status
                .reason
                .ends_with("scale-in to 2 waits for the rollout under way"),
            "{}",
            status.reason
        );
        assert_eq!(status.desired_shards, 4);
        let full = seen(&[("a", true, 500), ("b", true, 500)]);
        let mut i = input(Some(&a), None, 2, &full, &wall);
        i.rolling = true;
        let d = decide(&i, &mut Memory::default());
        assert!(d.outcome.replicas > 2, "1,000 live on 2 × 400: {d:?}");
        assert_eq!(reasons(&d), [Reason::ScaledOut]);
    }

    #[test]
    fn only_a_settled_fleet_is_rebalanced() {
        let r = rebalancing();
        let wall = t(1);
        let hot = [("a", true, 600), ("b", true, 0), ("c", true, 0)];
        let obs = seen(&hot);
        // Rebalancing only: the plan's shards (floor 2) are what runs.
        let mut floor3 = input(None, Some(&r), 3, &obs, &wall);
        floor3.floor = 3;
        let d = decide(&floor3, &mut Memory::default());
        let plan = d.shed.clone().expect("a settled, hot fleet sheds");
        assert_eq!(plan.port, 9090);
        assert_eq!(
            plan.orders,
            vec![Shed {
                order: ShedOrder {
                    pod: "a".into(),
                    count: 400,
                    rate: 100
                },
                ip: Some("127.1.1.1".into()),
            }]
        );
        assert!(d.outcome.events.is_empty(), "announced once sent");
        // A shard not ready yet: not settled.
        let obs = seen(&[("a", true, 600), ("b", true, 0), ("c", false, 0)]);
        let i = DecideInput {
            observation: &obs,
            ..floor3.clone()
        };
        assert!(decide(&i, &mut Memory::default()).shed.is_none());
        // Replicas about to change (the plan says 2, 3 run): not settled.
        let obs = seen(&hot);
        let d = decide(
            &input(None, Some(&r), 3, &obs, &wall),
            &mut Memory::default(),
        );
        assert_eq!(d.outcome.replicas, FLOOR);
        assert!(d.shed.is_none());
    }

    #[test]
    fn settling_counts_and_announces_what_was_sent() {
        let r = rebalancing();
        let wall = t(7);
        let obs = seen(&[("a", true, 600), ("b", true, 0), ("c", true, 0)]);
        let last = RebalanceStatus {
            max_to_mean_percent: 150,
            shed_ordered: 10,
            last_order_time: Some(t(1)),
        };
        let mut i = input(None, Some(&r), 3, &obs, &wall);
        i.floor = 3;
        i.prev_rebalance = Some(&last);
        let d = decide(&i, &mut Memory::default());
        let failed = Announcement::warning(Reason::ShedFailed, EventAction::Autoscale, "x");
        let out = d.clone().settle(Acted {
            sent: 400,
            failures: vec![failed.clone()],
        });
        let status = out.rebalance.clone().unwrap();
        assert_eq!(status.shed_ordered, 410);
        assert_eq!(status.last_order_time, Some(wall.clone()));
        assert_eq!(status.max_to_mean_percent, 300);
        assert_eq!(out.events[0], failed, "failures first, as they happened");
        assert_eq!(out.events[1].reason, Reason::Rebalancing);
        assert_eq!(
            out.events[1].note,
            "hottest shard at 300 % of the mean: 1 shards shed 400 connections at ≤ 100 connections/s in total"
        );
        // Nothing went through: nothing counted, nothing announced but the failure.
        let out = d.settle(Acted {
            sent: 0,
            failures: vec![failed.clone()],
        });
        assert_eq!(out.events, vec![failed]);
        assert_eq!(
            out.rebalance.unwrap(),
            RebalanceStatus {
                max_to_mean_percent: 300,
                ..last
            }
        );
    }

    #[test]
    fn the_input_reads_the_fleet() {
        let fleet: ConnectionFleet = serde_json::from_value(serde_json::json!({
            "apiVersion": "c10m.dev/v1alpha1",
            "kind": "ConnectionFleet",
            "metadata": {"name": "f", "namespace": "ns", "annotations": {PAUSE_ANNOTATION: "true"}},
            "spec": {
                "connections": 1000000,
                "autoscaling": {"enabled": false},
                "rebalance": {"enabled": true},
            },
        }))
        .unwrap();
        let plan = crate::plan::plan(
            &fleet.spec,
            crate::plan::NodeFacts {
                memory_bytes: 256 << 30,
                cpus: 64,
                pods: 110,
                runtime: crate::plan::NodeRuntime::UNKNOWN,
            },
        )
        .unwrap();
        let (obs, wall) = (Observation::default(), t(1));
        let i = DecideInput::new(&fleet, &plan, 3, &obs, 5.0, &wall);
        assert!(i.autoscaling.is_none(), "disabled is off");
        assert!(i.rebalance.is_some() && i.on() && runs(&fleet.spec));
        assert!(i.paused);
        assert_eq!((i.floor, i.current), (plan.shards, 3));
        assert_eq!(i.shard_capacity, plan.shard_connection_limit);
        assert_eq!(i.max_shards, fleet.spec.shard.max_shards);
    }

    // --- properties, over runs of syncs with the memory carried between them ---

    /// One sync's world.
    #[derive(Clone, Debug)]
    struct Step {
        /// Replicas follow the last decision (else `current`).
        follow: bool,
        current: i32,
        /// (state, has an IP, connections) per pod; state 0: running and
        /// ready, 1: running, not ready, 2: pending, 3: terminating.
        pods: Vec<(u8, bool, i64)>,
        /// Replicas follow the last decision, with as many pods, all ready
        /// (else `pods` as they are).
        settled: bool,
        /// 0: a good read; 1..=8: a MetricsError (5..=8: each kind of
        /// doubtful sample); 9: no Prometheus.
        read: u8,
        socket_memory_bytes: Option<i64>,
        paused: bool,
        /// A rollout is under way.
        rolling: bool,
        /// Seconds since the last sync.
        dt: f64,
    }

    #[derive(Clone, Debug)]
    struct Run {
        autoscaling: Option<AutoscalingSpec>,
        rebalance: Option<RebalanceSpec>,
        floor: i32,
        max_shards: i32,
        shard_capacity: i64,
        steps: Vec<Step>,
    }

    fn arb_rules() -> impl Strategy<Value = ScalingRules> {
        (0i32..=30, 1i32..=10, 1i32..=200, 1i32..=30).prop_map(|(w, s, p, period)| ScalingRules {
            stabilization_window_seconds: w,
            shards_per_period: s,
            percent_per_period: p,
            period_seconds: period,
        })
    }

    fn arb_autoscaling() -> impl Strategy<Value = Option<AutoscalingSpec>> {
        let spec = (
            10i32..=100,
            0i32..=50,
            10i32..=100,
            1i32..=60,
            arb_rules(),
            arb_rules(),
        )
            .prop_map(|(target, tolerance, mem, sync, up, down)| {
                let mut a = autoscaling();
                a.target_utilization_percent = target;
                a.tolerance_percent = tolerance;
                a.socket_memory_percent = mem;
                a.sync_period_seconds = sync;
                a.scale_up = up;
                a.scale_down = down;
                a
            });
        proptest::option::weighted(0.6, spec)
    }

    fn arb_rebalance() -> impl Strategy<Value = Option<RebalanceSpec>> {
        let spec = (101i32..=200, 0i32..=10, 1i64..=2000).prop_map(|(ratio, window, rate)| {
            let mut r = rebalancing();
            r.max_to_mean_percent = ratio;
            r.window_seconds = window;
            r.max_reconnect_rate = rate;
            r
        });
        proptest::option::weighted(0.7, spec)
    }

    fn arb_step() -> impl Strategy<Value = Step> {
        (
            any::<bool>(),
            0i32..=14,
            prop::collection::vec(
                (
                    prop_oneof![14 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)],
                    prop::bool::weighted(0.9),
                    0i64..=3000,
                ),
                0..=12,
            ),
            any::<bool>(),
            prop_oneof![3 => Just(0u8), 2 => 1u8..=9],
            proptest::option::of(0i64..=(4 << 30)),
            prop::bool::weighted(0.15),
            prop::bool::weighted(0.2),
            0.0f64..=40.0,
        )
            .prop_map(
                |(
                    follow,
                    current,
                    pods,
                    settled,
                    read,
                    socket_memory_bytes,
                    paused,
                    rolling,
                    dt,
                )| Step {
                    follow,
                    current,
                    pods,
                    settled,
                    read,
                    socket_memory_bytes,
                    paused,
                    rolling,
                    dt,
                },
            )
    }

    fn arb_run() -> impl Strategy<Value = Run> {
        (
            arb_autoscaling(),
            arb_rebalance(),
            1i32..=6,
            0i32..=8,
            50i64..=2000,
        )
            .prop_flat_map(|(autoscaling, rebalance, floor, extra, shard_capacity)| {
                prop::collection::vec(arb_step(), 1..=12).prop_map(move |steps| Run {
                    autoscaling: autoscaling.clone(),
                    rebalance: rebalance.clone(),
                    floor,
                    // The plan never needs more than maxShards: floor ≤ maxShards.
                    max_shards: floor + extra,
                    shard_capacity,
                    steps,
                })
            })
    }

    /// What `s` shows with `current` replicas.
    fn observation(s: &Step, current: i32) -> Observation {
        let seen: Vec<(u8, bool, i64)> = if s.settled {
            (0..current.max(0) as usize)
                .map(|n| s.pods.get(n).map_or((0, true, 0), |p| (0, p.1, p.2)))
                .collect()
        } else {
            s.pods.clone()
        };
        let pods: Vec<ShardPod> = seen
            .iter()
            .enumerate()
            .map(|(n, (state, ip, _))| ShardPod {
                name: format!("p{n}"),
                ip: ip.then(|| format!("127.1.1.{n}")),
                ready: *state == 0,
                running: *state <= 1,
                active: *state <= 2,
                ..Default::default()
            })
            .collect();
        // As the reader reports them: every running pod, ready or not.
        let shards: Vec<ShardLoad> = seen
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 <= 1)
            .map(|(n, p)| ShardLoad {
                pod: format!("p{n}"),
                connections: p.2,
            })
            .collect();
        let doubt = |d: Doubt| Some(Err(MetricsError::Doubtful(vec![d])));
        let series = || "pod p0's live connections".to_string();
        let metrics = match s.read {
            0 => Some(Ok(FleetMetrics {
                live: shards.iter().map(|l| l.connections).sum(),
                shards,
                socket_memory_bytes: s.socket_memory_bytes,
            })),
            1 => Some(Err(MetricsError::Unreachable("timeout".into()))),
            2 => Some(Err(MetricsError::Empty("up".into()))),
            3 => Some(Err(MetricsError::Stale {
                age: 120.0,
                limit: 60,
            })),
            4 => Some(Err(MetricsError::Partial {
                missing: 1,
                expected: 2,
                pods: vec!["p1".into()],
            })),
            5 => doubt(Doubt::NonFinite {
                series: series(),
                value: "NaN".into(),
            }),
            6 => doubt(Doubt::Negative {
                series: series(),
                value: "-1".into(),
            }),
            7 => doubt(Doubt::Implausible {
                series: series(),
                value: "1e12".into(),
                limit: 1000,
                bound: "the shard cap of 500".into(),
            }),
            8 => doubt(Doubt::Duplicate {
                pod: "p0".into(),
                count: 2,
            }),
            _ => None,
        };
        Observation {
            pods,
            metrics,
            kernel: None,
        }
    }

    /// Runs `run`, calling `check(input, decision)` after every sync.
    fn replay(
        run: &Run,
        mut check: impl FnMut(&DecideInput<'_>, &Decision) -> Result<(), TestCaseError>,
    ) -> Result<(), TestCaseError> {
        let mut memory = Memory::default();
        let (mut now, mut replicas) = (0.0, run.floor);
        let wall = t(0);
        for s in &run.steps {
            now += s.dt;
            let current = if s.follow || s.settled {
                replicas
            } else {
                s.current
            };
            let observation = observation(s, current);
            let i = DecideInput {
                autoscaling: run.autoscaling.as_ref(),
                rebalance: run.rebalance.as_ref(),
                max_shards: run.max_shards,
                admin_port: 9090,
                floor: run.floor,
                shard_capacity: run.shard_capacity,
                spread: false,
                tcp_mem_pressure_bytes: 1 << 30,
                prev_autoscaling: None,
                prev_rebalance: None,
                current,
                observation: &observation,
                paused: s.paused,
                rolling: s.rolling,
                now,
                wall: &wall,
            };
            let d = decide(&i, &mut memory);
            check(&i, &d)?;
            replicas = d.outcome.replicas;
        }
        Ok(())
    }

    fn good_read(i: &DecideInput<'_>) -> bool {
        matches!(i.observation.metrics, Some(Ok(_)))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn never_below_the_floor(run in arb_run()) {
            replay(&run, |i, d| {
                prop_assert!(d.outcome.replicas >= i.floor, "{} < floor {}", d.outcome.replicas, i.floor);
                if let Some(a) = &d.outcome.autoscaling && good_read(i) {
                    prop_assert!(a.desired_shards >= i.floor);
                }
                Ok(())
            })?;
        }

        #[test]
        fn never_scales_in_on_a_failed_or_doubtful_read(run in arb_run()) {
            replay(&run, |i, d| {
                if !good_read(i) {
                    let hold = if i.autoscaling.is_some() { i.current.max(i.floor) } else { i.floor };
                    prop_assert_eq!(d.outcome.replicas, hold);
                    prop_assert!(i.autoscaling.is_none() || d.outcome.replicas >= i.current);
                    prop_assert!(d.victims.is_empty());
                    prop_assert!(d.shed.is_none());
                    prop_assert!(d.outcome.events.is_empty());
                    prop_assert_eq!(d.outcome.live, None);
                    if i.on() {
                        prop_assert!(d.outcome.metrics_condition.as_ref().is_some_and(|c| !c.0));
                    }
                }
                // While a rollout is under way, never a scale-in.
                if i.rolling && i.autoscaling.is_some() {
                    prop_assert!(d.outcome.replicas >= i.current, "{} < {} mid-rollout", d.outcome.replicas, i.current);
                }
                // Victims only on a scale-in, one per shard removed at most.
                if !d.victims.is_empty() {
                    prop_assert!(good_read(i) && !i.paused && !i.rolling && i.autoscaling.is_some());
                    prop_assert!(d.outcome.replicas < i.current);
                    prop_assert!(d.victims.len() <= (i.current - d.outcome.replicas) as usize);
                }
                Ok(())
            })?;
        }

        /// Victims are active pods, each holding no more than any active
        /// pod kept: never one chosen for being unready while it holds more.
        #[test]
        fn victims_are_the_least_loaded_whatever_their_readiness(run in arb_run()) {
            replay(&run, |i, d| {
                let Some(Ok(m)) = &i.observation.metrics else {
                    prop_assert!(d.victims.is_empty());
                    return Ok(());
                };
                let load = |name: &str| m.shards.iter().find(|l| l.pod == name).map_or(0, |l| l.connections);
                for v in &d.victims {
                    let pod = i.observation.pods.iter().find(|p| &p.name == v);
                    prop_assert!(pod.is_some_and(|p| p.active), "{} is not an active pod", v);
                    for kept in i.observation.pods.iter().filter(|p| p.active && !d.victims.contains(&p.name)) {
                        prop_assert!(load(v) <= load(&kept.name), "{} ({}) chosen over {} ({})", v, load(v), kept.name, load(&kept.name));
                    }
                }
                Ok(())
            })?;
        }

        #[test]
        fn no_shed_orders_while_shards_are_unsettled_or_paused(run in arb_run()) {
            replay(&run, |i, d| {
                if !d.shed_orders().is_empty() {
                    let ready = i.observation.pods.iter().filter(|p| p.ready).count();
                    prop_assert!(!i.paused, "shed while paused");
                    prop_assert!(!i.rolling, "shed mid-rollout");
                    prop_assert_eq!(d.outcome.replicas, i.current, "shed while scaling");
                    prop_assert_eq!(ready as i32, i.current, "shed while shards are not ready");
                    prop_assert!(good_read(i) && i.rebalance.is_some());
                    let budget = i.rebalance.unwrap().max_reconnect_rate;
                    let rates: i64 = d.shed_orders().iter().map(|s| s.order.rate).sum();
                    prop_assert!(rates <= budget, "{} > budget {}", rates, budget);
                }
                prop_assert!(d.shed.as_ref().is_none_or(|s| !s.orders.is_empty()));
                Ok(())
            })?;
        }

        #[test]
        fn never_above_max_shards_unless_already_there(run in arb_run()) {
            replay(&run, |i, d| {
                if i.autoscaling.is_some() {
                    prop_assert!(
                        d.outcome.replicas <= i.max_shards.max(i.current),
                        "{} > maxShards {} (current {})", d.outcome.replicas, i.max_shards, i.current
                    );
                } else {
                    prop_assert_eq!(d.outcome.replicas, i.floor, "without autoscaling the plan decides");
                }
                Ok(())
            })?;
        }
    }
}
