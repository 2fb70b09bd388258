//! Derives a fleet's next status (conditions, shard counts, plan) from what a
//! reconcile observed, and the events that change announces (pure). Conditions use the standard Kubernetes shape;
//! `lastTransitionTime` moves only when a condition's status flips, so an
//! unchanged fleet gets a byte-identical status and no write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::api::sysctl::join_names;
use crate::api::{ConnectionFleetStatus, LimitingFactor, Plan};
use crate::reason::ConditionType::{
    self, Degraded as DEGRADED, MetricsAvailable as METRICS_AVAILABLE, Progressing as PROGRESSING,
    Ready as READY, SysctlsApplied as SYSCTLS_APPLIED,
};
use crate::reason::{Announcement, EventAction, Reason};

/// Shard counts read from the fleet's Deployment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shards {
    /// `spec.replicas` the operator applied.
    pub desired: i32,
    /// `status.readyReplicas`.
    pub ready: i32,
    /// `status.updatedReplicas`.
    pub updated: i32,
    /// `status.replicas` (all pods, old and new).
    pub total: i32,
    /// The Deployment controller has seen the latest Deployment spec.
    pub observed: bool,
}

impl Shards {
    /// Every shard runs the current template and is ready, with none extra.
    pub fn rolled_out(&self) -> bool {
        self.observed
            && self.ready >= self.desired
            && self.updated >= self.desired
            && self.total == self.desired
    }
}

/// What one reconcile found.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The spec cannot be planned; `reason` is a PascalCase condition reason.
    Rejected {
        /// Condition reason (InvalidSpec, NoNodeProfile, PlanInfeasible, ObjectConflict).
        reason: Reason,
        /// Human-readable message naming the field to fix.
        message: String,
    },
    /// The plan was made and its objects applied.
    Applied {
        /// The plan.
        plan: Plan,
        /// Shard counts of the Deployment.
        shards: Shards,
    },
    /// An API call failed (listing nodes, applying objects); retried with backoff.
    Failed {
        /// The plan, when one was made before the failure.
        plan: Option<Plan>,
        /// Condition reason (NodesUnavailable, ApplyFailed, ReconcileFailed).
        reason: Reason,
        /// The API server's error.
        message: String,
    },
}

/// The status after `outcome`, carrying over transition times from `prev`.
pub fn next_status(
    prev: Option<&ConnectionFleetStatus>,
    generation: i64,
    declared: i64,
    outcome: &Outcome,
    now: &Time,
) -> ConnectionFleetStatus {
    let mut status = prev.cloned().unwrap_or_default();
    status.observed_generation = Some(generation);
    let mut set = |type_: ConditionType, ok: bool, reason: Reason, message: String| {
        set_condition(
            &mut status.conditions,
            type_,
            ok,
            reason,
            message,
            generation,
            now,
        );
    };
    match outcome {
        Outcome::Rejected { reason, message } => {
            set(READY, false, *reason, message.clone());
            set(
                PROGRESSING,
                false,
                *reason,
                "waiting for a spec change".into(),
            );
            set(DEGRADED, true, *reason, message.clone());
        }
        Outcome::Failed {
            reason, message, ..
        } => {
            set(READY, false, *reason, message.clone());
            set(PROGRESSING, false, *reason, "retrying with backoff".into());
            set(DEGRADED, true, *reason, message.clone());
        }
        Outcome::Applied { plan, shards } => {
            let done = shards.rolled_out();
            let counts = format!(
                "{}/{} shards ready, {} updated",
                shards.ready, shards.desired, shards.updated
            );
            if done {
                set(
                    READY,
                    true,
                    Reason::ShardsReady,
                    format!(
                        "{counts}; the fleet holds up to {} connections",
                        shards.desired as i64 * plan.sized_connections_per_shard
                    ),
                );
                set(PROGRESSING, false, Reason::RolloutComplete, counts);
            } else {
                set(READY, false, Reason::ShardsNotReady, counts.clone());
                set(PROGRESSING, true, Reason::RollingOut, counts);
            }
            if plan.limiting_factor == LimitingFactor::MaxShards {
                set(
                    DEGRADED,
                    true,
                    Reason::MaxShardsReached,
                    format!(
                        "spec.shard.maxShards caps the fleet at {} shards holding {} of {} declared connections",
                        plan.shards, plan.capacity, declared
                    ),
                );
            } else {
                set(
                    DEGRADED,
                    false,
                    Reason::AsPlanned,
                    format!("the plan holds {} connections", plan.capacity),
                );
            }
        }
    }
    let plan = match outcome {
        Outcome::Applied { plan, .. }
        | Outcome::Failed {
            plan: Some(plan), ..
        } => Some(plan),
        _ => None,
    };
    if let Some(plan) = plan {
        if plan.sysctls_not_applied.is_empty() {
            set_condition(
                &mut status.conditions,
                SYSCTLS_APPLIED,
                true,
                Reason::AllApplied,
                format!("{} sysctls applied", plan.sysctls.len()),
                generation,
                now,
            );
        } else {
            set_condition(
                &mut status.conditions,
                SYSCTLS_APPLIED,
                false,
                Reason::NotAllowedInMode,
                format!(
                    "not applied under spec.sysctls.mode: {}; listen backlog capped at {}",
                    join_names(&plan.sysctls_not_applied),
                    plan.listen_backlog
                ),
                generation,
                now,
            );
        }
        status.desired_shards = plan.shards;
        status.plan = Some(plan.clone());
    }
    if let Outcome::Applied { shards, .. } = outcome {
        // The autoscaler may run more shards than the plan's floor.
        status.desired_shards = shards.desired;
        status.ready_shards = shards.ready;
        status.updated_shards = shards.updated;
    }
    status
}

/// Folds one sync of the metrics loop into `status`: live connections, the
/// autoscaler's and rebalancer's state, and the MetricsAvailable condition.
pub fn apply_loop(
    status: &mut ConnectionFleetStatus,
    looped: &crate::autoscale::Outcome,
    generation: i64,
    now: &Time,
) {
    if let Some(live) = looped.live {
        status.live_connections = live;
    }
    status.autoscaling = looped.autoscaling.clone();
    status.rebalance = looped.rebalance.clone();
    match &looped.metrics_condition {
        Some((ok, reason, message)) => set_condition(
            &mut status.conditions,
            METRICS_AVAILABLE,
            *ok,
            *reason,
            message.clone(),
            generation,
            now,
        ),
        None => status
            .conditions
            .retain(|c| c.type_ != METRICS_AVAILABLE.as_str()),
    }
}

/// The events a change from `prev` to `next` announces, after a reconcile
/// that ended in `outcome` (with the metrics loop's own `loop_events`):
///
/// - `MetricsAvailable` flipping: Normal when True, else Warning;
/// - the metrics loop's events, as decided;
/// - `Degraded=True` newly set: a Warning. For a rejected spec or a failed
///   API call any change of the condition counts (a new error is news); for
///   an applied plan (maxShards) only a change of status or reason, so a
///   changed connection count does not repeat it;
/// - a new plan: `PlanChanged`;
/// - `SysctlsApplied` flipping while sysctls are left out: `SysctlsNotApplied`.
///
/// An unchanged fleet announces nothing.
pub fn announcements(
    prev: Option<&ConnectionFleetStatus>,
    next: &ConnectionFleetStatus,
    outcome: &Outcome,
    loop_events: &[Announcement],
) -> Vec<Announcement> {
    let before = |t: ConditionType| prev.and_then(|p| condition(p, t));
    let reason_of = |c: &Condition| Reason::parse(&c.reason);
    let mut out = Vec::new();

    if let Some(c) = condition(next, METRICS_AVAILABLE)
        && before(METRICS_AVAILABLE).map(|p| &p.status) != Some(&c.status)
        && let Some(reason) = reason_of(c)
    {
        out.push(Announcement {
            warning: c.status != "True",
            reason,
            action: EventAction::ReadMetrics,
            note: c.message.clone(),
        });
    }
    out.extend(loop_events.iter().cloned());

    if let Some(d) = condition(next, DEGRADED).filter(|d| d.status == "True")
        && let Some(reason) = reason_of(d)
    {
        let (changed, action) = match outcome {
            Outcome::Applied { .. } => (
                before(DEGRADED).map(|p| (&p.status, &p.reason)) != Some((&d.status, &d.reason)),
                EventAction::Plan,
            ),
            Outcome::Rejected { .. } => (before(DEGRADED) != Some(d), EventAction::Plan),
            Outcome::Failed { .. } => (before(DEGRADED) != Some(d), EventAction::Reconcile),
        };
        if changed {
            out.push(Announcement::warning(reason, action, d.message.clone()));
        }
    }

    let plan = match outcome {
        Outcome::Applied { plan, .. }
        | Outcome::Failed {
            plan: Some(plan), ..
        } => Some(plan),
        _ => None,
    };
    if let Some(plan) = plan {
        if prev.and_then(|p| p.plan.as_ref()) != Some(plan) {
            out.push(Announcement::normal(
                Reason::PlanChanged,
                EventAction::Plan,
                format!(
                    "{} shards × {} connections ({} per node, {} nodes), limited by {}",
                    plan.shards,
                    plan.connections_per_shard,
                    plan.shards_per_node,
                    plan.nodes,
                    plan.limiting_factor.as_str()
                ),
            ));
        }
        if let Some(c) = condition(next, SYSCTLS_APPLIED)
            && before(SYSCTLS_APPLIED).map(|p| &p.status) != Some(&c.status)
            && !plan.sysctls_not_applied.is_empty()
        {
            out.push(Announcement::warning(
                Reason::SysctlsNotApplied,
                EventAction::Plan,
                c.message.clone(),
            ));
        }
    }
    out
}

/// Sets condition `type_` in `conditions`, keeping its lastTransitionTime
/// unless its status flips.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    ok: bool,
    reason: Reason,
    message: String,
    generation: i64,
    now: &Time,
) {
    let status = if ok { "True" } else { "False" }.to_string();
    let new = |t: Time| Condition {
        type_: type_.as_str().into(),
        status: status.clone(),
        reason: reason.as_str().into(),
        message: message.clone(),
        observed_generation: Some(generation),
        last_transition_time: t,
    };
    match conditions.iter_mut().find(|c| c.type_ == type_.as_str()) {
        Some(c) => {
            let t = if c.status == status {
                c.last_transition_time.clone()
            } else {
                now.clone()
            };
            *c = new(t);
        }
        None => conditions.push(new(now.clone())),
    }
}

/// The condition `type_`, if present.
pub fn condition(status: &ConnectionFleetStatus, type_: ConditionType) -> Option<&Condition> {
    status.conditions.iter().find(|c| c.type_ == type_.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ConnectionFleetSpec;
    use crate::plan::{NodeFacts, plan};

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    fn a_plan() -> Plan {
        let spec: ConnectionFleetSpec =
            serde_json::from_value(serde_json::json!({"connections": 1000000})).unwrap();
        plan(
            &spec,
            NodeFacts {
                memory_bytes: 256 << 30,
                cpus: 64,
                pods: 110,
            },
        )
        .unwrap()
    }

    #[test]
    fn ready_when_rolled_out_and_times_stay_put() {
        let p = a_plan();
        let rolling = Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: p.shards,
                ready: 0,
                updated: p.shards,
                total: p.shards,
                observed: true,
            },
        };
        let s1 = next_status(None, 1, 1000000, &rolling, &t(10));
        assert_eq!(condition(&s1, READY).unwrap().status, "False");
        assert_eq!(condition(&s1, PROGRESSING).unwrap().status, "True");
        let done = Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: p.shards,
                ready: p.shards,
                updated: p.shards,
                total: p.shards,
                observed: true,
            },
        };
        let s2 = next_status(Some(&s1), 1, 1000000, &done, &t(20));
        let ready = condition(&s2, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("True", "ShardsReady")
        );
        assert_eq!(ready.last_transition_time, t(20));
        assert_eq!(
            condition(&s2, DEGRADED).unwrap().last_transition_time,
            t(10),
            "unchanged status keeps its time"
        );
        let s3 = next_status(Some(&s2), 1, 1000000, &done, &t(30));
        assert_eq!(s2, s3, "a steady fleet's status does not change");
        assert_eq!(s3.observed_generation, Some(1));
        assert_eq!(s3.ready_shards, p.shards);
    }

    #[test]
    fn rejection_is_degraded_and_keeps_the_last_plan() {
        let p = a_plan();
        let done = Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: p.shards,
                ready: p.shards,
                updated: p.shards,
                total: p.shards,
                observed: true,
            },
        };
        let s1 = next_status(None, 1, 1, &done, &t(1));
        let bad = Outcome::Rejected {
            reason: Reason::InvalidSpec,
            message: "spec.x is bad".into(),
        };
        let s2 = next_status(Some(&s1), 2, 1, &bad, &t(2));
        let d = condition(&s2, DEGRADED).unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str(), d.message.as_str()),
            ("True", "InvalidSpec", "spec.x is bad")
        );
        assert_eq!(d.observed_generation, Some(2));
        assert_eq!(s2.plan, Some(p), "the running plan stays visible");
    }

    fn plan_for(spec: serde_json::Value) -> Plan {
        let spec: ConnectionFleetSpec = serde_json::from_value(spec).unwrap();
        plan(
            &spec,
            NodeFacts {
                memory_bytes: 256 << 30,
                cpus: 64,
                pods: 110,
            },
        )
        .unwrap()
    }

    fn rolled_out(p: &Plan) -> Outcome {
        Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: p.shards,
                ready: p.shards,
                updated: p.shards,
                total: p.shards,
                observed: true,
            },
        }
    }

    fn warnings(events: &[Announcement]) -> Vec<&Announcement> {
        events.iter().filter(|e| e.warning).collect()
    }

    #[test]
    fn a_rejected_fleet_warns_once() {
        let message = "spec.shard.cpus (8) exceeds spec.node.cpus (4)";
        let bad = Outcome::Rejected {
            reason: Reason::PlanInfeasible,
            message: message.into(),
        };
        let s1 = next_status(None, 3, 1000, &bad, &t(1));
        assert_eq!(
            announcements(None, &s1, &bad, &[]),
            vec![Announcement::warning(
                Reason::PlanInfeasible,
                EventAction::Plan,
                message
            )]
        );
        let s2 = next_status(Some(&s1), 3, 1000, &bad, &t(2));
        assert_eq!(s2, s1, "the same rejection writes no new status");
        assert_eq!(announcements(Some(&s1), &s2, &bad, &[]), vec![]);
        // A different rejection is news.
        let other = Outcome::Rejected {
            reason: Reason::InvalidSpec,
            message: "backend.userBytesPerConnection is required".into(),
        };
        let s3 = next_status(Some(&s2), 4, 1000, &other, &t(3));
        assert_eq!(
            announcements(Some(&s2), &s3, &other, &[]),
            vec![Announcement::warning(
                Reason::InvalidSpec,
                EventAction::Plan,
                "backend.userBytesPerConnection is required"
            )]
        );
    }

    #[test]
    fn a_failed_call_warns_once_as_a_reconcile_event() {
        let p = a_plan();
        let s0 = next_status(None, 1, 1_000_000, &rolled_out(&p), &t(1));
        let failed = Outcome::Failed {
            plan: Some(p.clone()),
            reason: Reason::ApplyFailed,
            message: "apply Deployment edge: etcd is down (500)".into(),
        };
        let s1 = next_status(Some(&s0), 1, 1_000_000, &failed, &t(2));
        assert_eq!(
            announcements(Some(&s0), &s1, &failed, &[]),
            vec![Announcement::warning(
                Reason::ApplyFailed,
                EventAction::Reconcile,
                "apply Deployment edge: etcd is down (500)"
            )],
            "the plan is unchanged, so only the failure is announced"
        );
        let s2 = next_status(Some(&s1), 1, 1_000_000, &failed, &t(3));
        assert_eq!(s2, s1);
        assert_eq!(announcements(Some(&s1), &s2, &failed, &[]), vec![]);
    }

    #[test]
    fn a_steady_applied_fleet_announces_nothing() {
        let p = a_plan();
        let done = rolled_out(&p);
        let mut prev = next_status(None, 1, 1_000_000, &done, &t(1));
        let first = announcements(None, &prev, &done, &[]);
        assert_eq!(first.len(), 1, "{first:?}");
        assert_eq!(
            (first[0].reason, first[0].warning),
            (Reason::PlanChanged, false)
        );
        for second in 2..5 {
            let next = next_status(Some(&prev), 1, 1_000_000, &done, &t(second));
            assert_eq!(announcements(Some(&prev), &next, &done, &[]), vec![]);
            prev = next;
        }
    }

    #[test]
    fn a_new_plan_is_announced_once() {
        let p1 = a_plan();
        let p2 = plan_for(serde_json::json!({"connections": 3_000_000}));
        assert_ne!(p1, p2);
        let s1 = next_status(None, 1, 1_000_000, &rolled_out(&p1), &t(1));
        let done = rolled_out(&p2);
        let s2 = next_status(Some(&s1), 2, 3_000_000, &done, &t(2));
        let events = announcements(Some(&s1), &s2, &done, &[]);
        assert_eq!(
            events,
            vec![Announcement::normal(
                Reason::PlanChanged,
                EventAction::Plan,
                format!(
                    "{} shards × {} connections ({} per node, {} nodes), limited by {}",
                    p2.shards,
                    p2.connections_per_shard,
                    p2.shards_per_node,
                    p2.nodes,
                    p2.limiting_factor.as_str()
                )
            )]
        );
        let s3 = next_status(Some(&s2), 2, 3_000_000, &done, &t(3));
        assert_eq!(announcements(Some(&s2), &s3, &done, &[]), vec![]);
    }

    #[test]
    fn metrics_available_flips_are_announced_both_ways() {
        let p = a_plan();
        let done = rolled_out(&p);
        let steady = |prev: &ConnectionFleetStatus, ok: bool, reason: Reason, msg: &str, at| {
            let mut s = next_status(Some(prev), 1, 1_000_000, &done, &t(at));
            set_condition(
                &mut s.conditions,
                METRICS_AVAILABLE,
                ok,
                reason,
                msg.into(),
                1,
                &t(at),
            );
            s
        };
        let s0 = next_status(None, 1, 1_000_000, &done, &t(1));
        // First reading fails: a Warning (no earlier condition).
        let s1 = steady(&s0, false, Reason::NoSamples, "no samples", 2);
        assert_eq!(
            announcements(Some(&s0), &s1, &done, &[]),
            vec![Announcement::warning(
                Reason::NoSamples,
                EventAction::ReadMetrics,
                "no samples"
            )]
        );
        // Back: Normal.
        let s2 = steady(
            &s1,
            true,
            Reason::MetricsRead,
            "1200 live connections on 4 shards",
            3,
        );
        assert_eq!(
            announcements(Some(&s1), &s2, &done, &[]),
            vec![Announcement::normal(
                Reason::MetricsRead,
                EventAction::ReadMetrics,
                "1200 live connections on 4 shards"
            )]
        );
        // Still read, other numbers: nothing.
        let s3 = steady(
            &s2,
            true,
            Reason::MetricsRead,
            "1300 live connections on 4 shards",
            4,
        );
        assert_eq!(announcements(Some(&s2), &s3, &done, &[]), vec![]);
        // Lost again: Warning, with the new reason.
        let s4 = steady(
            &s3,
            false,
            Reason::PrometheusUnreachable,
            "connection refused",
            5,
        );
        assert_eq!(
            announcements(Some(&s3), &s4, &done, &[]),
            vec![Announcement::warning(
                Reason::PrometheusUnreachable,
                EventAction::ReadMetrics,
                "connection refused"
            )]
        );
        // Still lost, for another reason: no repeat.
        let s5 = steady(&s4, false, Reason::StaleSamples, "samples are 90 s old", 6);
        assert_eq!(announcements(Some(&s4), &s5, &done, &[]), vec![]);
    }

    #[test]
    fn loop_events_are_passed_on_in_order() {
        let p = a_plan();
        let done = rolled_out(&p);
        let s1 = next_status(None, 1, 1_000_000, &done, &t(1));
        let s2 = next_status(Some(&s1), 1, 1_000_000, &done, &t(2));
        let looped = vec![
            Announcement::normal(Reason::ScaledOut, EventAction::Autoscale, "2 → 3 shards"),
            Announcement::warning(Reason::ShedFailed, EventAction::Autoscale, "timeout"),
        ];
        assert_eq!(announcements(Some(&s1), &s2, &done, &looped), looped);
    }

    #[test]
    fn max_shards_warns_once_and_not_again_for_a_new_message() {
        let p = plan_for(serde_json::json!({"connections": 10_000_000, "shard": {"maxShards": 1}}));
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        assert!(p.capacity < 10_000_000);
        let done = rolled_out(&p);
        let s1 = next_status(None, 1, 10_000_000, &done, &t(1));
        let first = announcements(None, &s1, &done, &[]);
        let degraded = condition(&s1, DEGRADED).unwrap();
        assert_eq!(
            warnings(&first),
            vec![&Announcement::warning(
                Reason::MaxShardsReached,
                EventAction::Plan,
                degraded.message.clone()
            )]
        );
        assert!(
            degraded.message.contains("10000000 declared"),
            "{}",
            degraded.message
        );
        // More connections declared, same plan: the message changes, the news does not.
        let s2 = next_status(Some(&s1), 2, 12_000_000, &done, &t(2));
        let d2 = condition(&s2, DEGRADED).unwrap();
        assert_ne!(d2.message, degraded.message);
        assert_eq!(d2.status, "True");
        assert_eq!(announcements(Some(&s1), &s2, &done, &[]), vec![]);
    }

    #[test]
    fn sysctls_not_applied_warns_once() {
        let p = plan_for(serde_json::json!({
            "connections": 1_000_000,
            "sysctls": {"mode": "PodSecurityContext"}
        }));
        assert!(!p.sysctls_not_applied.is_empty());
        let done = rolled_out(&p);
        let s1 = next_status(None, 1, 1_000_000, &done, &t(1));
        let first = announcements(None, &s1, &done, &[]);
        let c = condition(&s1, SYSCTLS_APPLIED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "NotAllowedInMode")
        );
        assert_eq!(
            warnings(&first),
            vec![&Announcement::warning(
                Reason::SysctlsNotApplied,
                EventAction::Plan,
                c.message.clone()
            )]
        );
        assert!(c.message.contains("net.core.somaxconn"), "{}", c.message);
        let s2 = next_status(Some(&s1), 1, 1_000_000, &done, &t(2));
        assert_eq!(announcements(Some(&s1), &s2, &done, &[]), vec![]);
        // With every sysctl applied there is nothing to warn about.
        let ok = rolled_out(&a_plan());
        let s = next_status(None, 1, 1_000_000, &ok, &t(1));
        assert!(warnings(&announcements(None, &s, &ok, &[])).is_empty());
    }
}
