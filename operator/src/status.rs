//! Derives a fleet's next status (conditions, shard counts, plan) from what a
//! reconcile observed, and the events that change announces (pure). Conditions use the standard Kubernetes shape;
//! `lastTransitionTime` moves only when a condition's status flips, so an
//! unchanged fleet gets a byte-identical status and no write.
//!
//! The workload's own failures (pods refused by admission or quota, images
//! that cannot be pulled, a stalled rollout) are read from the Deployment,
//! its ReplicaSets and pods by [`workload_failure`] and become `Degraded`.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::api::status::{CalibrationStatus, FigureSource, RolloutStatus};
use crate::api::sysctl::join_names;
use crate::api::{ConnectionFleetStatus, LimitingFactor, Plan};
use crate::autoscale::observe::controller_uid;
use crate::plan::calibration::State as CalibrationState;
use crate::plan::drain::{DRAIN_ACCEPT_SECONDS, DRAIN_SLACK_SECONDS, drain_timeout_seconds};
use crate::reason::ConditionType::Calibrated as CALIBRATED;
use crate::reason::ConditionType::{
    self, Degraded as DEGRADED, KernelDrift as KERNEL_DRIFT, MetricsAvailable as METRICS_AVAILABLE,
    Progressing as PROGRESSING, Ready as READY, SysctlsApplied as SYSCTLS_APPLIED,
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

/// Why the fleet's pods cannot run as applied, read from its Deployment,
/// ReplicaSets and pods ([`workload_failure`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadFailure {
    /// Condition reason (PodSecurityForbidden, QuotaExceeded,
    /// PodCreationFailed, ImagePullFailed, ProgressDeadlineExceeded).
    pub reason: Reason,
    /// The object that reports it and its own words, then what to change
    /// when the operator knows (the hint comes before anything is cut).
    pub message: String,
}

/// Longest quote of a Kubernetes message in a [`WorkloadFailure`]: with
/// the object's name and the hint, the condition stays within an event
/// note's 1 kB.
const MAX_QUOTE_BYTES: usize = 600;

/// What to change when PodSecurity refuses the pods.
pub const POD_SECURITY_HINT: &str = "set spec.sysctls.mode: PodSecurityContext, or label the namespace pod-security.kubernetes.io/enforce=privileged";

const QUOTA_HINT: &str = "raise the namespace's ResourceQuota, or plan fewer or smaller shards (spec.connections, spec.shard.cpus, spec.shard.maxShards)";

const IMAGE_HINT: &str = "check spec.server.image and the namespace's image pull secrets (the sysctl init container's image is the operator policy's sysctlImage: a cluster admin's)";

const UNSCHEDULABLE_HINT: &str = "a rollout adds status.plan.rolloutSurge shards before it removes as many old ones, and waits, the old shards serving, until they fit: free that room on the nodes the fleet may use (spec.placement), or lower spec.rollout.maxReconnectRate (a surge of 1 at spec.drain.rate or below)";

/// Container waiting reasons that mean its image cannot be pulled.
const IMAGE_PULL_REASONS: [&str; 4] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
];

impl WorkloadFailure {
    fn new(reason: Reason, source: String, quote: &str, hint: Option<&str>) -> Self {
        let quote = quote.trim().trim_end_matches('.');
        let quote = if quote.len() > MAX_QUOTE_BYTES {
            let mut end = MAX_QUOTE_BYTES;
            while !quote.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}...", &quote[..end])
        } else {
            quote.to_string()
        };
        let message = match hint {
            Some(hint) => format!("{source}: {quote}. To fix: {hint}"),
            None => format!("{source}: {quote}"),
        };
        WorkloadFailure { reason, message }
    }

    /// A `FailedCreate` from `source` (a ReplicaSet or the Deployment),
    /// classified by the admission or quota error it quotes.
    fn failed_create(source: String, quote: &str) -> Self {
        let (reason, hint) = if quote.contains("violates PodSecurity") {
            (Reason::PodSecurityForbidden, Some(POD_SECURITY_HINT))
        } else if quote.contains("exceeded quota") {
            (Reason::QuotaExceeded, Some(QUOTA_HINT))
        } else {
            (Reason::PodCreationFailed, None)
        };
        WorkloadFailure::new(reason, format!("{source} cannot create pods"), quote, hint)
    }
}

/// Whether the Deployment controller has observed `deployment`'s latest
/// generation (`status.observedGeneration` ≥ `metadata.generation`): its
/// status and ReplicaSets then reflect the spec as applied.
pub fn deployment_observed(deployment: &Deployment) -> bool {
    deployment
        .status
        .as_ref()
        .and_then(|s| s.observed_generation)
        >= deployment.metadata.generation
}

/// The first failure of the fleet's workload, most specific first:
///
/// 1. a `ReplicaFailure` condition (`FailedCreate`) on one of the
///    Deployment's ReplicaSets (the newest revision first), else the same
///    condition as the Deployment mirrors it: the pods cannot be created
///    (PodSecurity, quota, or other admission errors);
/// 2. a container of one of `pods` waiting on an image it cannot pull;
/// 3. one of `pods` the scheduler found no room for (`PodScheduled=False
///    Unschedulable`, its message naming what the nodes lack: CPU, memory,
///    pods, taints), such as a rollout's surge shard;
/// 4. the Deployment's `Progressing=False` with `ProgressDeadlineExceeded`.
///
/// ReplicaSets another Deployment controls are ignored. `None` while the
/// workload shows no failure (a rollout under way is not one).
pub fn workload_failure(
    deployment: &Deployment,
    replica_sets: &[ReplicaSet],
    pods: &[Pod],
) -> Option<WorkloadFailure> {
    let uid = deployment.metadata.uid.as_deref();
    let revision = |rs: &ReplicaSet| crate::rollout::revision(rs).unwrap_or(0);
    let mut owned: Vec<&ReplicaSet> = replica_sets
        .iter()
        .filter(|rs| uid.is_some() && controller_uid(&rs.metadata) == uid)
        .collect();
    owned.sort_by_key(|rs| (std::cmp::Reverse(revision(rs)), rs.metadata.name.clone()));
    let replica_failure = owned.iter().find_map(|rs| {
        let c = rs
            .status
            .as_ref()?
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
        (c.reason.as_deref() == Some("FailedCreate")).then(|| {
            let name = rs.metadata.name.as_deref().unwrap_or_default();
            WorkloadFailure::failed_create(
                format!("ReplicaSet {name}"),
                c.message.as_deref().unwrap_or_default(),
            )
        })
    });
    let deployment_conditions = || {
        deployment
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
    };
    let name = deployment.metadata.name.as_deref().unwrap_or_default();
    let mirrored = || {
        deployment_conditions()
            .find(|c| {
                c.type_ == "ReplicaFailure"
                    && c.status == "True"
                    && c.reason.as_deref() == Some("FailedCreate")
            })
            .map(|c| {
                WorkloadFailure::failed_create(
                    format!("Deployment {name}"),
                    c.message.as_deref().unwrap_or_default(),
                )
            })
    };
    // Pods in name order, so the one a failure quotes is the same each time.
    let mut pods: Vec<&Pod> = pods.iter().collect();
    pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let image = || {
        pods.iter().find_map(|pod| {
            let st = pod.status.as_ref()?;
            st.init_container_statuses
                .iter()
                .flatten()
                .chain(st.container_statuses.iter().flatten())
                .find_map(|c| {
                    let waiting = c.state.as_ref()?.waiting.as_ref()?;
                    let reason = waiting.reason.as_deref()?;
                    IMAGE_PULL_REASONS.contains(&reason).then(|| {
                        let pod = pod.metadata.name.as_deref().unwrap_or_default();
                        let detail = waiting.message.as_deref().unwrap_or_default();
                        WorkloadFailure::new(
                            Reason::ImagePullFailed,
                            format!(
                                "pod {pod}: container {} cannot pull image {:?}",
                                c.name, c.image
                            ),
                            &format!("{reason}: {detail}"),
                            Some(IMAGE_HINT),
                        )
                    })
                })
        })
    };
    let unschedulable = || {
        pods.iter().find_map(|pod| {
            let c = pod
                .status
                .as_ref()?
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
            (c.reason.as_deref() == Some("Unschedulable")).then(|| {
                let pod = pod.metadata.name.as_deref().unwrap_or_default();
                WorkloadFailure::new(
                    Reason::ShardUnschedulable,
                    format!("pod {pod} cannot be scheduled"),
                    c.message.as_deref().unwrap_or_default(),
                    Some(UNSCHEDULABLE_HINT),
                )
            })
        })
    };
    let stalled = || {
        deployment_conditions()
            .find(|c| {
                c.type_ == "Progressing"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
            })
            .map(|c| {
                WorkloadFailure::new(
                    Reason::ProgressDeadlineExceeded,
                    format!("Deployment {name} made no progress"),
                    c.message.as_deref().unwrap_or_default(),
                    None,
                )
            })
    };
    replica_failure
        .or_else(mirrored)
        .or_else(image)
        .or_else(unschedulable)
        .or_else(stalled)
}

/// What one reconcile found.
// One value per reconcile, read once by the report: the size of the
// variant holding a plan and a rollout costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
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
        /// Why its pods cannot run, when the workload says so.
        failure: Option<WorkloadFailure>,
        /// The rollout under way ([`crate::rollout::observe`]), if any.
        rollout: Option<RolloutStatus>,
    },
    /// The fleet's first calibration runs (`spec.backend.calibrate`): its
    /// objects wait, so its first shards are planned from the measurement.
    Calibrating {
        /// The plan from the spec or the model, until the measurement.
        plan: Plan,
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
        Outcome::Calibrating { .. } => {
            let message = "no shard yet: the fleet's first shards wait for the calibration of its image (condition Calibrated)".to_string();
            set(READY, false, Reason::Calibrating, message.clone());
            set(PROGRESSING, true, Reason::Calibrating, message.clone());
            set(DEGRADED, false, Reason::Calibrating, message);
        }
        Outcome::Applied {
            plan,
            shards,
            failure,
            rollout,
        } => {
            // Complete only when no old shard is left, draining ones
            // included (the Deployment stops counting Terminating pods).
            let done = shards.rolled_out() && rollout.is_none();
            let mut counts = format!(
                "{}/{} shards ready, {} updated",
                shards.ready, shards.desired, shards.updated
            );
            if let Some(r) = rollout {
                counts.push_str(&format!(
                    "; revision {}: {} old shards ({} cordoned, holding {} connections), {} draining at {} connections/s{}{}{}",
                    r.revision,
                    r.old_shards,
                    r.cordoned_shards,
                    r.connections_on_old_shards,
                    r.draining_shards,
                    r.closes_per_second,
                    r.estimated_completion_time
                        .as_ref()
                        .map_or(String::new(), |t| format!("; done by {}", t.0)),
                    if r.paused { "; paused" } else { "" },
                    r.template_held_until
                        .as_ref()
                        .map_or(String::new(), |t| format!(
                            "; a new pod template waits for the drain to end at {}",
                            t.0
                        )),
                ));
            }
            if done {
                set(
                    READY,
                    true,
                    Reason::ShardsReady,
                    format!(
                        "{counts}; the fleet holds up to {} connections",
                        i64::from(shards.desired).saturating_mul(plan.sized_connections_per_shard)
                    ),
                );
                set(PROGRESSING, false, Reason::RolloutComplete, counts);
            } else {
                set(READY, false, Reason::ShardsNotReady, counts.clone());
                set(PROGRESSING, true, Reason::RollingOut, counts);
            }
            if let Some(failure) = failure {
                set(DEGRADED, true, failure.reason, failure.message.clone());
            } else if plan.limiting_factor == LimitingFactor::MaxShards {
                set(
                    DEGRADED,
                    true,
                    Reason::MaxShardsReached,
                    if plan.capacity >= declared {
                        format!(
                            "spec.shard.maxShards caps the fleet at {} shards: they hold its {} declared connections, but not after losing its failure domain ({:?}: {} shards)",
                            plan.shards, declared, plan.failure_domain, plan.failure_domain_shards
                        )
                    } else {
                        format!(
                            "spec.shard.maxShards caps the fleet at {} shards holding {} of {} declared connections",
                            plan.shards, plan.capacity, declared
                        )
                    },
                );
            } else if plan.drain_cut_by_policy {
                set(
                    DEGRADED,
                    true,
                    Reason::DrainCannotFinish,
                    drain_cut_message(plan),
                );
            } else {
                let mut message = format!("the plan holds {} connections", plan.capacity);
                if let Some(hint) = cheaper_shape_hint(plan, declared) {
                    message.push_str("; ");
                    message.push_str(&hint);
                }
                set(DEGRADED, false, Reason::AsPlanned, message);
            }
        }
    }
    let plan = match outcome {
        Outcome::Applied { plan, .. }
        | Outcome::Calibrating { plan }
        | Outcome::Failed {
            plan: Some(plan), ..
        } => Some(plan),
        _ => None,
    };
    if let Some(plan) = plan {
        if plan.sysctls_not_applied.is_empty() && !plan.sysctls_capped.is_empty() {
            set_condition(
                &mut status.conditions,
                SYSCTLS_APPLIED,
                true,
                Reason::CappedByPolicy,
                format!(
                    "{} sysctls applied; the operator's policy caps {}, which limits connections per node ({} shards of {} connections)",
                    plan.sysctls.len(),
                    plan.sysctls_capped
                        .iter()
                        .map(|(n, v)| format!("{n} at {v}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    plan.shards_per_node,
                    plan.max_connections_per_shard
                ),
                generation,
                now,
            );
        } else if plan.sysctls_not_applied.is_empty() {
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
    if let Outcome::Applied {
        shards, rollout, ..
    } = outcome
    {
        // The autoscaler may run more shards than the plan's floor.
        status.desired_shards = shards.desired;
        status.ready_shards = shards.ready;
        status.updated_shards = shards.updated;
        status.rollout = rollout.clone();
    }
    status
}

/// When the spec fixed the shard shape and the planner found one holding
/// as much at most [`crate::plan::capacity::CHEAPER_SHAPE_PERCENT`] % of
/// its cost, a sentence naming it and what it saves (`None` otherwise).
fn cheaper_shape_hint(plan: &crate::api::Plan, declared: i64) -> Option<String> {
    let alt = plan
        .alternative_shapes
        .iter()
        .find(|alt| crate::plan::capacity::is_much_cheaper(alt, plan, declared))?;
    let cost = |nodes: i32, cpm: Option<f64>| match cpm {
        Some(c) => format!("{nodes} nodes at ${c:.2} per million connections monthly"),
        None => format!("{nodes} nodes"),
    };
    Some(format!(
        "{} CPUs per shard would cost {} ({} connections per node) against {} ({} per node) with spec.shard.cpus {}; leave spec.shard.cpus unset to let the planner pick the shape",
        alt.cpus,
        cost(alt.nodes, alt.cost_per_million_connections_monthly),
        alt.connections_per_node,
        cost(plan.nodes, plan.cost_per_million_connections_monthly),
        plan.connections_per_node,
        plan.cpus
    ))
}

/// What `Degraded=True DrainCannotFinish` says: the shard's drain, the
/// bound that cut it, when the rest is closed, and the rate that would fit.
fn drain_cut_message(plan: &Plan) -> String {
    let grace = plan.termination_grace_period_seconds;
    let room = (grace - DRAIN_ACCEPT_SECONDS - DRAIN_SLACK_SECONDS).max(1);
    let limit = plan.shard_connection_limit;
    format!(
        "a departing shard cannot drain its {limit} connections at spec.drain.rate: it needs {} s, and the operator's policy bounds terminationGracePeriodSeconds at {grace} s; after {} s it closes the rest at once. Set spec.drain.rate to at least {} or plan smaller shards",
        plan.drain_seconds,
        drain_timeout_seconds(grace),
        (limit + room - 1) / room
    )
}

/// Folds one sync of the metrics loop into `status`: live connections, the
/// autoscaler's and rebalancer's state, the MetricsAvailable condition, and
/// the KernelDrift condition when the shards' kernel settings were read
/// (kept as it was when they were not; dropped with the loop).
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
            .retain(|c| c.type_ != METRICS_AVAILABLE.as_str() && c.type_ != KERNEL_DRIFT.as_str()),
    }
    if let Some((drifted, reason, message)) = &looped.kernel_drift {
        set_condition_status(
            &mut status.conditions,
            KERNEL_DRIFT,
            *drifted,
            *reason,
            message.clone(),
            generation,
            now,
        );
    }
}

/// Folds the fleet's calibration into `status`: the `latest` measurement
/// as `status.calibration` (a failed or running one keeps the last), and
/// the `Calibrated` condition from `state` (dropped without
/// `spec.backend.calibrate`). The plan's `userBytesSource` says whether
/// the plan sized from it.
pub fn apply_calibration(
    status: &mut ConnectionFleetStatus,
    latest: Option<&CalibrationStatus>,
    state: &CalibrationState,
    generation: i64,
    now: &Time,
) {
    if let Some(c) = latest {
        status.calibration = Some(c.clone());
    }
    let (ok, reason, message) = match state {
        CalibrationState::NotAsked => {
            status.conditions.retain(|c| c.type_ != CALIBRATED.as_str());
            return;
        }
        CalibrationState::Measured => {
            let measured = status.calibration.as_ref().map_or_else(String::new, |c| {
                format!(
                    "{} ({}) on node {} at {} connections: {} B user + {} B kernel, {} B pod per idle connection; ",
                    c.image,
                    c.image_id,
                    c.node,
                    c.connections,
                    c.per_connection.user,
                    c.per_connection.kernel,
                    c.per_connection.pod
                )
            });
            let message = format!("{measured}{}", sized_from(status));
            (Some(true), Reason::Measured, message)
        }
        CalibrationState::Running { since, why } => (
            None,
            Reason::Calibrating,
            format!("calibrating since {since} ({why}); {}", sized_from(status)),
        ),
        CalibrationState::Failed {
            reason,
            message,
            retry_at,
        } => (
            Some(false),
            *reason,
            format!(
                "{message}; {}; next try at {retry_at}, or at once when the image, model, protocol or spec.backend.calibrate changes",
                sized_from(status)
            ),
        ),
    };
    set_condition_status(
        &mut status.conditions,
        CALIBRATED,
        ok,
        reason,
        message,
        generation,
        now,
    );
}

/// What the plan in `status` sizes its user bytes from, in words.
fn sized_from(status: &ConnectionFleetStatus) -> String {
    match status.plan.as_ref().and_then(|p| p.user_bytes_source) {
        Some(FigureSource::Calibrated) => match &status.calibration {
            Some(c) => format!(
                "the plan sizes from the calibration of {} ({} B user per connection)",
                c.image, c.per_connection.user
            ),
            None => "the plan sizes from a calibration".into(),
        },
        Some(FigureSource::Spec) => {
            "the plan sizes from spec.backend.userBytesPerConnection".into()
        }
        _ => "the plan sizes from the backend model's figure".into(),
    }
}

/// The events a change from `prev` to `next` announces, after a reconcile
/// that ended in `outcome` (with the metrics loop's own `loop_events`):
///
/// - `MetricsAvailable` flipping: Normal when True, else Warning;
/// - the metrics loop's events, as decided;
/// - `Degraded=True` newly set: a Warning. For a rejected spec or a failed
///   API call any change of the condition counts (a new error is news); for
///   an applied plan (maxShards, or the workload's failure) only a change of
///   status or reason, so a changed connection count or a new pod name in a
///   refusal does not repeat it;
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

    if let Some(c) = condition(next, CALIBRATED)
        && before(CALIBRATED).map(|p| (&p.status, &p.reason)) != Some((&c.status, &c.reason))
        && let Some(reason) = reason_of(c)
    {
        out.push(Announcement {
            warning: c.status == "False",
            reason,
            action: EventAction::Calibrate,
            note: c.message.clone(),
        });
    }

    if let Some(d) = condition(next, DEGRADED).filter(|d| d.status == "True")
        && let Some(reason) = reason_of(d)
    {
        let (changed, action) = match outcome {
            Outcome::Applied { failure, .. } => (
                before(DEGRADED).map(|p| (&p.status, &p.reason)) != Some((&d.status, &d.reason)),
                if failure.is_some() {
                    EventAction::Rollout
                } else {
                    EventAction::Plan
                },
            ),
            Outcome::Rejected { .. } | Outcome::Calibrating { .. } => {
                (before(DEGRADED) != Some(d), EventAction::Plan)
            }
            Outcome::Failed { .. } => (before(DEGRADED) != Some(d), EventAction::Reconcile),
        };
        if changed {
            out.push(Announcement::warning(reason, action, d.message.clone()));
        }
    }

    let plan = match outcome {
        Outcome::Applied { plan, .. }
        | Outcome::Calibrating { plan }
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
    set_condition_status(
        conditions,
        type_,
        Some(ok),
        reason,
        message,
        generation,
        now,
    );
}

/// [`set_condition`] with an `Unknown` status for `ok` = `None` (nothing
/// could be judged).
pub fn set_condition_status(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    ok: Option<bool>,
    reason: Reason,
    message: String,
    generation: i64,
    now: &Time,
) {
    let status = match ok {
        Some(true) => "True",
        Some(false) => "False",
        None => "Unknown",
    }
    .to_string();
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
                runtime: crate::plan::NodeRuntime::UNKNOWN,
            },
        )
        .unwrap()
    }

    #[test]
    fn a_rollout_under_way_is_told_in_progressing_and_in_status() {
        let p = a_plan();
        let rollout = RolloutStatus {
            revision: 3,
            updated_shards: 2,
            old_shards: 1,
            cordoned_shards: 1,
            draining_shards: 1,
            closes_per_second: 50,
            connections_on_old_shards: 420,
            estimated_completion_time: Some(t(30)),
            ..Default::default()
        };
        let rolling = Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: 4,
                ready: 2,
                updated: 2,
                total: 5,
                observed: true,
            },
            failure: None,
            rollout: Some(rollout.clone()),
        };
        let s = next_status(None, 1, 1000000, &rolling, &t(10));
        let progressing = condition(&s, PROGRESSING).unwrap();
        assert_eq!(progressing.status, "True");
        assert_eq!(
            progressing.message,
            "2/4 shards ready, 2 updated; revision 3: 1 old shards (1 cordoned, holding 420 connections), 1 draining at 50 connections/s; done by 1970-01-01T00:00:30Z"
        );
        assert_eq!(s.rollout, Some(rollout.clone()));
        let Outcome::Applied {
            plan,
            shards,
            failure,
            ..
        } = rolling
        else {
            unreachable!()
        };
        let paused = Outcome::Applied {
            plan,
            shards,
            failure,
            rollout: Some(RolloutStatus {
                paused: true,
                ..rollout
            }),
        };
        let s = next_status(Some(&s), 1, 1000000, &paused, &t(20));
        assert!(
            condition(&s, PROGRESSING)
                .unwrap()
                .message
                .ends_with("; paused"),
            "{:?}",
            condition(&s, PROGRESSING)
        );
    }

    /// Issue 22: the Deployment counts the last old shard out as soon as
    /// its pod is Terminating; the rollout is complete only when it is
    /// gone (`status.rollout` empty).
    #[test]
    fn a_rollout_with_an_old_shard_still_draining_is_not_complete() {
        let Outcome::Applied {
            plan,
            shards,
            failure,
            ..
        } = rolled_out(&a_plan())
        else {
            unreachable!()
        };
        let desired = shards.desired;
        let draining = Outcome::Applied {
            plan,
            shards,
            failure,
            rollout: Some(RolloutStatus {
                revision: 2,
                updated_shards: desired,
                old_shards: 0,
                cordoned_shards: 0,
                draining_shards: 1,
                closes_per_second: 50,
                ..Default::default()
            }),
        };
        let s = next_status(None, 1, 1000000, &draining, &t(10));
        let progressing = condition(&s, PROGRESSING).unwrap();
        assert_eq!(
            (progressing.status.as_str(), progressing.reason.as_str()),
            ("True", "RollingOut")
        );
        assert_eq!(condition(&s, READY).unwrap().status, "False");
        let s = next_status(Some(&s), 1, 1000000, &rolled_out(&a_plan()), &t(20));
        assert_eq!(
            condition(&s, PROGRESSING).unwrap().reason,
            "RolloutComplete"
        );
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
            failure: None,
            rollout: None,
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
            failure: None,
            rollout: None,
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
            failure: None,
            rollout: None,
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
                runtime: crate::plan::NodeRuntime::UNKNOWN,
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
            failure: None,
            rollout: None,
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

    /// KernelDrift follows each kernel read, stays as it was when the
    /// settings were not read, and goes with the loop.
    #[test]
    fn kernel_drift_follows_the_reads_and_goes_with_the_loop() {
        let p = a_plan();
        let mut s = next_status(None, 1, 1_000_000, &rolled_out(&p), &t(1));
        let drifted = crate::autoscale::Outcome {
            metrics_condition: Some((true, Reason::MetricsRead, "read".into())),
            kernel_drift: Some((
                Some(true),
                Reason::BelowPlan,
                "shard p on node n: nofile is 1024, planned 20000".into(),
            )),
            ..Default::default()
        };
        apply_loop(&mut s, &drifted, 1, &t(2));
        let c = condition(&s, KERNEL_DRIFT).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "BelowPlan")
        );
        assert!(c.message.contains("nofile is 1024"));
        let unread = crate::autoscale::Outcome {
            kernel_drift: None,
            ..drifted.clone()
        };
        apply_loop(&mut s, &unread, 1, &t(3));
        assert_eq!(condition(&s, KERNEL_DRIFT).unwrap().status, "True");
        let fixed = crate::autoscale::Outcome {
            kernel_drift: Some((Some(false), Reason::AsPlanned, "as planned".into())),
            ..drifted.clone()
        };
        apply_loop(&mut s, &fixed, 1, &t(4));
        assert_eq!(condition(&s, KERNEL_DRIFT).unwrap().reason, "AsPlanned");
        apply_loop(&mut s, &crate::autoscale::Outcome::default(), 1, &t(5));
        assert!(condition(&s, KERNEL_DRIFT).is_none());
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

    /// Issue 13: a drain the policy's grace bound cuts is Degraded, says
    /// what happens and what rate would fit, and is warned once.
    #[test]
    fn a_drain_cut_by_the_policy_is_degraded_and_warned_once() {
        let p = plan_for(serde_json::json!({"connections": 1_000_000, "drain": {"rate": 1}}));
        assert!(p.drain_cut_by_policy);
        assert_eq!(p.termination_grace_period_seconds, 3600);
        let done = rolled_out(&p);
        let s1 = next_status(None, 1, 1_000_000, &done, &t(1));
        let d = condition(&s1, DEGRADED).unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "DrainCannotFinish")
        );
        let limit = p.shard_connection_limit;
        let fits = (limit + 3574) / 3575;
        for part in [
            format!("cannot drain its {limit} connections at spec.drain.rate"),
            format!("it needs {limit} s"),
            "bounds terminationGracePeriodSeconds at 3600 s".to_string(),
            "after 3585 s it closes the rest at once".to_string(),
            format!("Set spec.drain.rate to at least {fits}"),
        ] {
            assert!(d.message.contains(&part), "{part:?} not in {}", d.message);
        }
        // The suggested rate does fit.
        let ok = plan_for(serde_json::json!({"connections": 1_000_000, "drain": {"rate": fits}}));
        assert!(!ok.drain_cut_by_policy, "rate {fits}");
        assert_eq!(
            warnings(&announcements(None, &s1, &done, &[])),
            vec![&Announcement::warning(
                Reason::DrainCannotFinish,
                EventAction::Plan,
                d.message.clone()
            )]
        );
        let s2 = next_status(Some(&s1), 1, 1_000_000, &done, &t(2));
        assert!(warnings(&announcements(Some(&s1), &s2, &done, &[])).is_empty());
        // Ready still tells the truth about the shards.
        assert_eq!(condition(&s1, READY).unwrap().status, "True");
    }

    /// Issue 13: a policy ceiling that limits the plan shows in the
    /// SysctlsApplied condition (the sysctls the plan has are applied).
    #[test]
    fn a_policy_ceiling_that_binds_is_said_in_sysctls_applied() {
        let spec: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 10_000_000,
            "shard": {"cpus": 8},
            "backend": {"slowReaderPercent": 0}
        }))
        .unwrap();
        let policy = crate::policy::Policy::from_yaml(
            "sysctlCeilings: {net.netfilter.nf_conntrack_max: 2000000}\n",
        )
        .unwrap();
        let node = NodeFacts {
            memory_bytes: 256 << 30,
            cpus: 64,
            pods: 110,
            runtime: crate::plan::NodeRuntime::UNKNOWN,
        };
        let p = crate::plan::plan_under(&spec, node, &policy).unwrap();
        let s1 = next_status(None, 1, 10_000_000, &rolled_out(&p), &t(1));
        let c = condition(&s1, SYSCTLS_APPLIED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "CappedByPolicy")
        );
        assert!(
            c.message
                .contains("the operator's policy caps net.netfilter.nf_conntrack_max at 2000000"),
            "{}",
            c.message
        );
        assert_eq!(condition(&s1, DEGRADED).unwrap().reason, "AsPlanned");
        let uncapped = plan_for(serde_json::json!({
            "connections": 1_000_000,
            "shard": {"cpus": 8},
            "backend": {"slowReaderPercent": 0}
        }));
        assert!(
            uncapped.sysctls_capped.is_empty(),
            "{:?}",
            uncapped.sysctls_capped
        );
        let free = next_status(None, 1, 10_000_000, &rolled_out(&uncapped), &t(1));
        assert_eq!(
            condition(&free, SYSCTLS_APPLIED).unwrap().reason,
            "AllApplied"
        );
    }

    #[test]
    fn max_shards_warns_once_and_not_again_for_a_new_message() {
        let p = plan_for(
            serde_json::json!({"connections": 10_000_000, "shard": {"cpus": 8, "maxShards": 1}}),
        );
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
            "sysctls": {"mode": "None"}
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

    // ------------------------------------------------ the workload's failures

    const DEPLOYMENT_UID: &str = "d-uid";

    fn deployment(conditions: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge", "namespace": "prod", "uid": DEPLOYMENT_UID},
            "status": {"replicas": 0, "conditions": conditions}
        }))
        .unwrap()
    }

    fn replica_set(
        name: &str,
        owner: &str,
        revision: &str,
        conditions: serde_json::Value,
    ) -> ReplicaSet {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "namespace": "prod",
                "annotations": {"deployment.kubernetes.io/revision": revision},
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "Deployment", "name": "edge",
                    "uid": owner, "controller": true
                }]
            },
            "spec": {"selector": {}},
            "status": {"replicas": 0, "conditions": conditions}
        }))
        .unwrap()
    }

    fn failed_create(message: &str) -> serde_json::Value {
        serde_json::json!([{
            "type": "ReplicaFailure", "status": "True",
            "reason": "FailedCreate", "message": message
        }])
    }

    /// What the ReplicaSet controller records when a baseline namespace
    /// refuses the InitContainer mode's privileged init container.
    const POD_SECURITY_REFUSAL: &str = r#"pods "edge-5d8f7c9b4-x2k9q" is forbidden: violates PodSecurity "baseline:latest": host namespaces (hostPID=false), hostPath volumes (volume "host-proc"), privileged (container "sysctls" must not set securityContext.privileged=true)"#;

    fn not_ready(p: &Plan, failure: Option<WorkloadFailure>) -> Outcome {
        Outcome::Applied {
            plan: p.clone(),
            shards: Shards {
                desired: p.shards,
                ready: 0,
                updated: 0,
                total: 0,
                observed: true,
            },
            failure,
            rollout: None,
        }
    }

    #[test]
    fn a_pod_security_refusal_is_degraded_with_the_hint_and_warned_once() {
        let rs = replica_set(
            "edge-5d8f7c9b4",
            DEPLOYMENT_UID,
            "1",
            failed_create(POD_SECURITY_REFUSAL),
        );
        let failure = workload_failure(&deployment(serde_json::json!([])), &[rs], &[]).unwrap();
        assert_eq!(failure.reason, Reason::PodSecurityForbidden);
        assert!(
            failure.message.starts_with("ReplicaSet edge-5d8f7c9b4 cannot create pods: pods \"edge-5d8f7c9b4-x2k9q\" is forbidden: violates PodSecurity"),
            "{}",
            failure.message
        );
        assert!(
            failure
                .message
                .ends_with(&format!("To fix: {POD_SECURITY_HINT}")),
            "{}",
            failure.message
        );

        let p = a_plan();
        let s0 = next_status(None, 1, 1_000_000, &not_ready(&p, None), &t(1));
        let refused = not_ready(&p, Some(failure.clone()));
        let s1 = next_status(Some(&s0), 1, 1_000_000, &refused, &t(2));
        let d = condition(&s1, DEGRADED).unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str(), d.message.as_str()),
            ("True", "PodSecurityForbidden", failure.message.as_str())
        );
        // The shard counts stay as the Deployment reports them.
        let ready = condition(&s1, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "ShardsNotReady")
        );
        assert_eq!(
            ready.message,
            format!("0/{} shards ready, 0 updated", p.shards)
        );
        assert_eq!(
            announcements(Some(&s0), &s1, &refused, &[]),
            vec![Announcement::warning(
                Reason::PodSecurityForbidden,
                EventAction::Rollout,
                failure.message.clone()
            )]
        );
        // The same refusal for a new pod name (a new ReplicaSet): no second Warning.
        let again = workload_failure(
            &deployment(serde_json::json!([])),
            &[replica_set(
                "edge-77c4d",
                DEPLOYMENT_UID,
                "2",
                failed_create(&POD_SECURITY_REFUSAL.replace("5d8f7c9b4-x2k9q", "77c4d-abcde")),
            )],
            &[],
        );
        let refused_again = not_ready(&p, again);
        let s2 = next_status(Some(&s1), 2, 1_000_000, &refused_again, &t(3));
        assert_ne!(condition(&s2, DEGRADED).unwrap().message, d.message);
        assert_eq!(condition(&s2, DEGRADED).unwrap().last_transition_time, t(2));
        assert_eq!(announcements(Some(&s1), &s2, &refused_again, &[]), vec![]);
        // Fixed: Degraded clears, without a Warning.
        let fixed = not_ready(&p, None);
        let s3 = next_status(Some(&s2), 3, 1_000_000, &fixed, &t(4));
        let d = condition(&s3, DEGRADED).unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("False", "AsPlanned")
        );
        assert!(warnings(&announcements(Some(&s2), &s3, &fixed, &[])).is_empty());
    }

    #[test]
    fn failed_creates_are_classified_by_what_refused_them() {
        let d = deployment(serde_json::json!([]));
        let case = |message: &str| {
            workload_failure(
                &d,
                &[replica_set(
                    "edge-1",
                    DEPLOYMENT_UID,
                    "1",
                    failed_create(message),
                )],
                &[],
            )
            .unwrap()
        };
        let quota = case(
            r#"pods "edge-1-abc" is forbidden: exceeded quota: shards, requested: limits.cpu=8, used: limits.cpu=16, limited: limits.cpu=16"#,
        );
        assert_eq!(quota.reason, Reason::QuotaExceeded);
        assert!(
            quota.message.contains("exceeded quota: shards")
                && quota.message.contains("ResourceQuota"),
            "{}",
            quota.message
        );
        let other = case(
            r#"pods "edge-1-abc" is forbidden: error looking up service account prod/edge: serviceaccount "edge" not found"#,
        );
        assert_eq!(other.reason, Reason::PodCreationFailed);
        assert_eq!(
            other.message,
            r#"ReplicaSet edge-1 cannot create pods: pods "edge-1-abc" is forbidden: error looking up service account prod/edge: serviceaccount "edge" not found"#
        );
        // A FailedDelete is not a failure to run; no condition: no failure.
        let deleting = serde_json::json!([{"type": "ReplicaFailure", "status": "True", "reason": "FailedDelete", "message": "x"}]);
        assert_eq!(
            workload_failure(
                &d,
                &[replica_set("edge-1", DEPLOYMENT_UID, "1", deleting)],
                &[]
            ),
            None
        );
        assert_eq!(
            workload_failure(
                &d,
                &[replica_set(
                    "edge-1",
                    DEPLOYMENT_UID,
                    "1",
                    serde_json::json!([])
                )],
                &[]
            ),
            None
        );
    }

    #[test]
    fn only_the_deployments_own_replica_sets_count_newest_first() {
        let d = deployment(serde_json::json!([]));
        let foreign = replica_set(
            "other-1",
            "someone-else",
            "9",
            failed_create(POD_SECURITY_REFUSAL),
        );
        assert_eq!(
            workload_failure(&d, std::slice::from_ref(&foreign), &[]),
            None
        );
        let old = replica_set(
            "edge-old",
            DEPLOYMENT_UID,
            "1",
            failed_create(r#"pods "edge-old-a" is forbidden: exceeded quota: q"#),
        );
        let new = replica_set(
            "edge-new",
            DEPLOYMENT_UID,
            "2",
            failed_create(POD_SECURITY_REFUSAL),
        );
        let f = workload_failure(&d, &[old, foreign, new], &[]).unwrap();
        assert_eq!(f.reason, Reason::PodSecurityForbidden);
        assert!(
            f.message.starts_with("ReplicaSet edge-new "),
            "{}",
            f.message
        );
        // The Deployment's mirror of the condition counts when no ReplicaSet shows it.
        let mirrored = deployment(failed_create(
            r#"pods "edge-x" is forbidden: exceeded quota: q"#,
        ));
        let f = workload_failure(&mirrored, &[], &[]).unwrap();
        assert_eq!(f.reason, Reason::QuotaExceeded);
        assert!(
            f.message
                .starts_with("Deployment edge cannot create pods: "),
            "{}",
            f.message
        );
    }

    #[test]
    fn image_pull_errors_and_a_stalled_rollout_come_after_refusals() {
        let pod = |name: &str, reason: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "status": {"containerStatuses": [{
                    "name": "server", "image": "example.com/nope:1", "imageID": "",
                    "ready": false, "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": "Back-off pulling image \"example.com/nope:1\""}}
                }]}
            }))
            .unwrap()
        };
        let stalled = deployment(serde_json::json!([{
            "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet \"edge-1\" has timed out progressing."
        }]));
        let pods = [
            pod("edge-1-b", "ContainerCreating"),
            pod("edge-1-a", "ImagePullBackOff"),
        ];
        let f = workload_failure(&stalled, &[], &pods).unwrap();
        assert_eq!(f.reason, Reason::ImagePullFailed);
        assert_eq!(
            f.message,
            format!(
                "pod edge-1-a: container server cannot pull image \"example.com/nope:1\": ImagePullBackOff: Back-off pulling image \"example.com/nope:1\". To fix: {IMAGE_HINT}"
            )
        );
        let f = workload_failure(&stalled, &[], &pods[..1]).unwrap();
        assert_eq!(
            (f.reason, f.message.as_str()),
            (
                Reason::ProgressDeadlineExceeded,
                "Deployment edge made no progress: ReplicaSet \"edge-1\" has timed out progressing"
            )
        );
        let refused = replica_set(
            "edge-1",
            DEPLOYMENT_UID,
            "1",
            failed_create(POD_SECURITY_REFUSAL),
        );
        assert_eq!(
            workload_failure(&stalled, &[refused], &pods)
                .unwrap()
                .reason,
            Reason::PodSecurityForbidden
        );
        assert_eq!(
            workload_failure(&deployment(serde_json::json!([])), &[], &pods[..1]),
            None
        );
    }

    /// Issue 22, item 2: a surge shard with no room on the nodes says so,
    /// quoting what the scheduler found missing; an image that cannot be
    /// pulled comes first, a stalled rollout after.
    #[test]
    fn a_surge_shard_without_room_names_what_the_nodes_lack() {
        let pending = |name: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "status": {"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 2 Insufficient cpu, 1 Insufficient memory. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod."
                }]}
            }))
            .unwrap()
        };
        let scheduled: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge-1-a"},
            "status": {"phase": "Running", "conditions": [
                {"type": "PodScheduled", "status": "True"}
            ]}
        }))
        .unwrap();
        let stalled = deployment(serde_json::json!([{
            "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet \"edge-2\" has timed out progressing."
        }]));
        let pods = [scheduled.clone(), pending("edge-2-x")];
        let f = workload_failure(&stalled, &[], &pods).unwrap();
        assert_eq!(f.reason, Reason::ShardUnschedulable);
        assert_eq!(
            f.message,
            format!(
                "pod edge-2-x cannot be scheduled: 0/3 nodes are available: 2 Insufficient cpu, 1 Insufficient memory. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod. To fix: {UNSCHEDULABLE_HINT}"
            )
        );
        assert_eq!(
            workload_failure(&deployment(serde_json::json!([])), &[], &[scheduled]),
            None
        );
    }

    #[test]
    fn a_long_refusal_keeps_its_hint() {
        let long = format!(
            "{POD_SECURITY_REFUSAL}, {}",
            "seccompProfile (pod must not set it to Unconfined), ".repeat(40)
        );
        let rs = replica_set("edge-1", DEPLOYMENT_UID, "1", failed_create(&long));
        let f = workload_failure(&deployment(serde_json::json!([])), &[rs], &[]).unwrap();
        assert!(f.message.len() < 900, "{}", f.message.len());
        assert!(f.message.ends_with(POD_SECURITY_HINT), "{}", f.message);
        assert!(f.message.contains("violates PodSecurity"));
    }

    #[test]
    fn a_workload_failure_outranks_max_shards() {
        let p = plan_for(
            serde_json::json!({"connections": 10_000_000, "shard": {"cpus": 8, "maxShards": 1}}),
        );
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        let failure =
            WorkloadFailure::failed_create("ReplicaSet edge-1".into(), POD_SECURITY_REFUSAL);
        let s = next_status(None, 1, 10_000_000, &not_ready(&p, Some(failure)), &t(1));
        assert_eq!(
            condition(&s, DEGRADED).unwrap().reason,
            "PodSecurityForbidden"
        );
        let s = next_status(Some(&s), 1, 10_000_000, &not_ready(&p, None), &t(2));
        let d = condition(&s, DEGRADED).unwrap();
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "MaxShardsReached")
        );
    }

    /// Server-side apply turns `sysctls: {}` replacing a non-empty map into
    /// null, which the schema refuses: the status write of an epoll fleet
    /// switched to PodSecurityContext mode failed on every reconcile. A plan
    /// applying no sysctl leaves the field out, and reads back the same.
    #[test]
    fn a_plan_applying_no_sysctl_omits_the_field() {
        let p = plan_for(serde_json::json!({
            "connections": 1_000_000,
            "sysctls": {"mode": "None"}
        }));
        assert!(p.sysctls.is_empty(), "{:?}", p.sysctls);
        let json = serde_json::to_value(&p).unwrap();
        assert!(json.get("sysctls").is_none(), "{json}");
        assert_eq!(serde_json::from_value::<Plan>(json).unwrap(), p);
        let with = a_plan();
        assert!(serde_json::to_value(&with).unwrap()["sysctls"].is_object());
    }

    #[test]
    fn a_fixed_shape_with_a_much_cheaper_one_says_so() {
        // Issue 8: 8-CPU goroutine shards bind at the runtime's nofile;
        // the planner's shape costs far less, and the condition names it.
        let fixed = plan_for(serde_json::json!({
            "connections": 10_000_000,
            "backend": {"model": "goroutine"},
            "node": {"pricePerHour": "2.59"},
            "shard": {"cpus": 8}
        }));
        let s = next_status(None, 1, 10_000_000, &rolled_out(&fixed), &t(1));
        let c = condition(&s, DEGRADED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "AsPlanned")
        );
        let best = &fixed.alternative_shapes[0];
        assert!(
            c.message.contains(&format!(
                "{} CPUs per shard would cost {} nodes",
                best.cpus, best.nodes
            )) && c.message.contains("leave spec.shard.cpus unset"),
            "{}",
            c.message
        );
        // The planner's own choice has nothing to add.
        let free = plan_for(serde_json::json!({
            "connections": 10_000_000,
            "backend": {"model": "goroutine"},
            "node": {"pricePerHour": "2.59"}
        }));
        let s = next_status(None, 1, 10_000_000, &rolled_out(&free), &t(1));
        assert_eq!(
            condition(&s, DEGRADED).unwrap().message,
            format!("the plan holds {} connections", free.capacity)
        );
    }

    #[test]
    fn calibration_state_becomes_the_calibrated_condition_and_a_failure_keeps_the_last_figures() {
        use crate::api::status::{CalibratedBytes, CalibrationStatus};
        let c = CalibrationStatus {
            image: "team/chat:1".into(),
            image_id: "sha256:1".into(),
            model: crate::api::BackendModel::Goroutine,
            protocol: crate::api::Protocol::Echo,
            requested: Default::default(),
            node: "n1".into(),
            cgroup_mode: "v1".into(),
            socket_accounted: false,
            connections: 16000,
            slow_readers: 160,
            per_connection: CalibratedBytes {
                user: 3916,
                kernel: 1504,
                pod: 5413,
            },
            per_slow_reader: None,
            pod_slope_percent: -2.5,
            time: t(10),
            duration_seconds: 31,
        };
        let mut s = ConnectionFleetStatus::default();
        let running = CalibrationState::Running {
            since: t(5).0,
            why: "no calibration yet".into(),
        };
        apply_calibration(&mut s, None, &running, 1, &t(5));
        let cond = condition(&s, CALIBRATED).unwrap();
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("Unknown", "Calibrating")
        );
        assert!(
            cond.message.contains("no calibration yet"),
            "{}",
            cond.message
        );

        let mut plan = a_plan();
        plan.user_bytes_source = Some(FigureSource::Calibrated);
        s.plan = Some(plan);
        apply_calibration(&mut s, Some(&c), &CalibrationState::Measured, 1, &t(10));
        assert_eq!(s.calibration.as_ref(), Some(&c));
        let cond = condition(&s, CALIBRATED).unwrap();
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("True", "Measured")
        );
        assert!(
            cond.message.contains("3916 B user") && cond.message.contains("n1"),
            "{}",
            cond.message
        );

        let failed = CalibrationState::Failed {
            reason: Reason::CalibrationShardNotReady,
            message: "Unschedulable: 0/1 nodes are available: 1 Insufficient cpu".into(),
            retry_at: t(610).0,
        };
        apply_calibration(&mut s, None, &failed, 2, &t(20));
        assert_eq!(
            s.calibration.as_ref(),
            Some(&c),
            "a failure keeps the last calibration"
        );
        let cond = condition(&s, CALIBRATED).unwrap();
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("False", "CalibrationShardNotReady")
        );
        assert!(
            cond.message.contains("Insufficient cpu")
                && cond.message.contains("team/chat:1 (3916 B user"),
            "{}",
            cond.message
        );
        let notes = announcements(
            Some(&ConnectionFleetStatus {
                conditions: vec![],
                ..s.clone()
            }),
            &s,
            &Outcome::Rejected {
                reason: Reason::InvalidSpec,
                message: String::new(),
            },
            &[],
        );
        assert!(
            notes
                .iter()
                .any(|n| n.warning && n.reason == Reason::CalibrationShardNotReady),
            "{notes:?}"
        );

        apply_calibration(&mut s, None, &CalibrationState::NotAsked, 3, &t(30));
        assert!(condition(&s, CALIBRATED).is_none());
    }
}
