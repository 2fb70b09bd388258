//! Every condition type, condition/event reason and event action the
//! operator writes, as enums: one vocabulary for `status.conditions` and the
//! fleet's Events. The "Conditions and events" table (`docs/conditions.md`) lists the same
//! reasons (a test keeps them in step).

use std::fmt;

/// Condition types in `status.conditions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionType {
    /// Every shard runs the current template and is ready.
    Ready,
    /// A rollout or scale is under way.
    Progressing,
    /// The fleet cannot be what its spec asks.
    Degraded,
    /// The metrics loop can read trustworthy live metrics.
    MetricsAvailable,
    /// The plan's sysctls are all applied.
    SysctlsApplied,
    /// Some shard runs under kernel settings below its plan.
    KernelDrift,
    /// The fleet's image is calibrated for its spec
    /// (`spec.backend.calibrate`; absent without it).
    Calibrated,
}

impl ConditionType {
    /// The type as written in the condition.
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Ready => "Ready",
            ConditionType::Progressing => "Progressing",
            ConditionType::Degraded => "Degraded",
            ConditionType::MetricsAvailable => "MetricsAvailable",
            ConditionType::SysctlsApplied => "SysctlsApplied",
            ConditionType::KernelDrift => "KernelDrift",
            ConditionType::Calibrated => "Calibrated",
        }
    }
}

/// Reasons of conditions and events (PascalCase, as Kubernetes API
/// conventions ask).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    // --- the plan and the spec ---
    /// The spec is invalid in a way the schema could not catch.
    InvalidSpec,
    /// No node matches the selector and the spec gives no node profile.
    NoNodeProfile,
    /// Not one connection fits one shard on one node.
    PlanInfeasible,
    /// `shard.maxShards` stops the fleet short of its declared connections.
    MaxShardsReached,
    /// The plan holds the declared connections.
    AsPlanned,
    /// The plan changed (event).
    PlanChanged,
    // --- the admin's policy ---
    /// A toleration reaches a taint the operator's policy reserves.
    TolerationNotAllowed,
    /// A node selector entry selects on a node label the policy reserves.
    NodeSelectorNotAllowed,
    /// `sysctls.mode: InitContainer` in a namespace the policy does not allow.
    SysctlModeNotAllowed,
    /// A shard's drain cannot finish within the policy's bound on the grace period.
    DrainCannotFinish,
    /// The policy's ceiling on a node-level sysctl limits connections per node.
    CappedByPolicy,
    // --- objects and API calls ---
    /// An object the fleet would own exists and belongs to someone else.
    ObjectConflict,
    /// Listing nodes failed.
    NodesUnavailable,
    /// Applying the fleet's objects failed.
    ApplyFailed,
    /// Another API call of the reconcile failed.
    ReconcileFailed,
    // --- rollout ---
    /// Every shard is ready on the current template.
    ShardsReady,
    /// Some shards are not ready yet.
    ShardsNotReady,
    /// The Deployment is rolling out.
    RollingOut,
    /// The rollout finished.
    RolloutComplete,
    // --- the workload (Deployment, ReplicaSets, pods) ---
    /// PodSecurity admission refuses the fleet's pods (ReplicaSet FailedCreate).
    PodSecurityForbidden,
    /// A ResourceQuota refuses the fleet's pods (ReplicaSet FailedCreate).
    QuotaExceeded,
    /// The fleet's pods cannot be created for another reason (ReplicaSet FailedCreate).
    PodCreationFailed,
    /// A shard's image cannot be pulled (the pods' container statuses).
    ImagePullFailed,
    /// A shard's pod cannot be scheduled: no node has room for it (a
    /// rollout's surge, or a scale-out).
    ShardUnschedulable,
    /// The Deployment made no progress within its progress deadline.
    ProgressDeadlineExceeded,
    // --- sysctls ---
    /// Every sysctl of the plan is applied.
    AllApplied,
    /// Some sysctls are not applied under the sysctl mode (condition).
    NotAllowedInMode,
    /// Some sysctls are not applied under the sysctl mode (event).
    SysctlsNotApplied,
    // --- metrics loop ---
    /// Live metrics were read.
    MetricsRead,
    /// The operator runs without `--prometheus-url`.
    NoPrometheus,
    /// Prometheus could not be reached.
    PrometheusUnreachable,
    /// A query returned no samples.
    NoSamples,
    /// Samples are older than `metrics.staleAfterSeconds`.
    StaleSamples,
    /// Some running shards have no sample.
    PartialSamples,
    /// Some samples cannot be true: not finite, negative, implausibly
    /// large, or a pod reported twice.
    DoubtfulSamples,
    /// The autoscaler added shards (event).
    ScaledOut,
    /// The autoscaler removed shards (event).
    ScaledIn,
    /// Shards were told to shed connections (event).
    Rebalancing,
    /// A shed order failed (event).
    ShedFailed,
    /// A scale-in removed shards other than those marked to go (event).
    ScaleInUnmarkedRemoved,
    // --- kernel drift ---
    /// A shard runs under a kernel setting below its plan (condition, event).
    BelowPlan,
    /// No running shard reported a setting its plan sets: nothing was
    /// judged (KernelDrift=Unknown).
    KernelNotReported,
    // --- the CRD (events on the CustomResourceDefinition) ---
    /// The installed CRD carries a higher schema revision than the
    /// operator's: kept, not narrowed (event).
    NewerCrdInstalled,
    /// The installed CRD's schema revision annotation cannot be read: kept
    /// (event).
    CrdRevisionUnreadable,
    // --- calibration (spec.backend.calibrate) ---
    /// A calibration of the fleet's image runs (condition Unknown; the
    /// first one holds the fleet's first shards back).
    Calibrating,
    /// The image is calibrated for the spec; the plan sizes from it.
    Measured,
    /// The calibration's shard never became Ready (image, scheduling, a
    /// container that ended).
    CalibrationShardNotReady,
    /// The calibration's shard was OOM-killed before the last step.
    CalibrationOOMKilled,
    /// The probe stopped before the last step or wrote no report.
    CalibrationIncomplete,
    /// The calibration failed otherwise (API calls, the nodes, the steps).
    CalibrationFailed,
}

impl Reason {
    /// Every reason, in declaration order.
    pub const ALL: [Reason; 50] = [
        Reason::InvalidSpec,
        Reason::NoNodeProfile,
        Reason::PlanInfeasible,
        Reason::MaxShardsReached,
        Reason::AsPlanned,
        Reason::PlanChanged,
        Reason::TolerationNotAllowed,
        Reason::NodeSelectorNotAllowed,
        Reason::SysctlModeNotAllowed,
        Reason::DrainCannotFinish,
        Reason::CappedByPolicy,
        Reason::ObjectConflict,
        Reason::NodesUnavailable,
        Reason::ApplyFailed,
        Reason::ReconcileFailed,
        Reason::ShardsReady,
        Reason::ShardsNotReady,
        Reason::RollingOut,
        Reason::RolloutComplete,
        Reason::PodSecurityForbidden,
        Reason::QuotaExceeded,
        Reason::PodCreationFailed,
        Reason::ImagePullFailed,
        Reason::ShardUnschedulable,
        Reason::ProgressDeadlineExceeded,
        Reason::AllApplied,
        Reason::NotAllowedInMode,
        Reason::SysctlsNotApplied,
        Reason::MetricsRead,
        Reason::NoPrometheus,
        Reason::PrometheusUnreachable,
        Reason::NoSamples,
        Reason::StaleSamples,
        Reason::PartialSamples,
        Reason::DoubtfulSamples,
        Reason::ScaledOut,
        Reason::ScaledIn,
        Reason::Rebalancing,
        Reason::ShedFailed,
        Reason::ScaleInUnmarkedRemoved,
        Reason::BelowPlan,
        Reason::KernelNotReported,
        Reason::NewerCrdInstalled,
        Reason::CrdRevisionUnreadable,
        Reason::Calibrating,
        Reason::Measured,
        Reason::CalibrationShardNotReady,
        Reason::CalibrationOOMKilled,
        Reason::CalibrationIncomplete,
        Reason::CalibrationFailed,
    ];

    /// The reason spelled `s`, if it is one of the operator's.
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The reason as written in conditions and events.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidSpec => "InvalidSpec",
            Reason::NoNodeProfile => "NoNodeProfile",
            Reason::PlanInfeasible => "PlanInfeasible",
            Reason::MaxShardsReached => "MaxShardsReached",
            Reason::AsPlanned => "AsPlanned",
            Reason::PlanChanged => "PlanChanged",
            Reason::TolerationNotAllowed => "TolerationNotAllowed",
            Reason::NodeSelectorNotAllowed => "NodeSelectorNotAllowed",
            Reason::SysctlModeNotAllowed => "SysctlModeNotAllowed",
            Reason::DrainCannotFinish => "DrainCannotFinish",
            Reason::CappedByPolicy => "CappedByPolicy",
            Reason::ObjectConflict => "ObjectConflict",
            Reason::NodesUnavailable => "NodesUnavailable",
            Reason::ApplyFailed => "ApplyFailed",
            Reason::ReconcileFailed => "ReconcileFailed",
            Reason::ShardsReady => "ShardsReady",
            Reason::ShardsNotReady => "ShardsNotReady",
            Reason::RollingOut => "RollingOut",
            Reason::RolloutComplete => "RolloutComplete",
            Reason::PodSecurityForbidden => "PodSecurityForbidden",
            Reason::QuotaExceeded => "QuotaExceeded",
            Reason::PodCreationFailed => "PodCreationFailed",
            Reason::ImagePullFailed => "ImagePullFailed",
            Reason::ShardUnschedulable => "ShardUnschedulable",
            Reason::ProgressDeadlineExceeded => "ProgressDeadlineExceeded",
            Reason::AllApplied => "AllApplied",
            Reason::NotAllowedInMode => "NotAllowedInMode",
            Reason::SysctlsNotApplied => "SysctlsNotApplied",
            Reason::MetricsRead => "MetricsRead",
            Reason::NoPrometheus => "NoPrometheus",
            Reason::PrometheusUnreachable => "PrometheusUnreachable",
            Reason::NoSamples => "NoSamples",
            Reason::StaleSamples => "StaleSamples",
            Reason::PartialSamples => "PartialSamples",
            Reason::DoubtfulSamples => "DoubtfulSamples",
            Reason::ScaledOut => "ScaledOut",
            Reason::ScaledIn => "ScaledIn",
            Reason::Rebalancing => "Rebalancing",
            Reason::ShedFailed => "ShedFailed",
            Reason::ScaleInUnmarkedRemoved => "ScaleInUnmarkedRemoved",
            Reason::BelowPlan => "BelowPlan",
            Reason::KernelNotReported => "KernelNotReported",
            Reason::NewerCrdInstalled => "NewerCRDInstalled",
            Reason::CrdRevisionUnreadable => "CRDRevisionUnreadable",
            Reason::Calibrating => "Calibrating",
            Reason::Measured => "Measured",
            Reason::CalibrationShardNotReady => "CalibrationShardNotReady",
            Reason::CalibrationOOMKilled => "CalibrationOOMKilled",
            Reason::CalibrationIncomplete => "CalibrationIncomplete",
            Reason::CalibrationFailed => "CalibrationFailed",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `action` of an Event: what the operator was doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventAction {
    /// Planning the fleet.
    Plan,
    /// Reconciling (API calls).
    Reconcile,
    /// Rolling out the fleet's pods (the workload's own failures).
    Rollout,
    /// Reading live metrics.
    ReadMetrics,
    /// Scaling or rebalancing.
    Autoscale,
    /// Installing the CRD at start-up (`--manage-crd`).
    ApplyCrd,
    /// Calibrating the fleet's image (`spec.backend.calibrate`).
    Calibrate,
}

impl EventAction {
    /// The action as written in the Event.
    pub fn as_str(self) -> &'static str {
        match self {
            EventAction::Plan => "Plan",
            EventAction::Reconcile => "Reconcile",
            EventAction::Rollout => "Rollout",
            EventAction::ReadMetrics => "ReadMetrics",
            EventAction::Autoscale => "Autoscale",
            EventAction::ApplyCrd => "ApplyCRD",
            EventAction::Calibrate => "Calibrate",
        }
    }
}

/// An event the operator means to publish on a fleet: decided by pure code
/// (status derivation, the metrics loop's decision), sent by the reconcile's
/// report step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// A Warning (else Normal) event.
    pub warning: bool,
    /// Its reason.
    pub reason: Reason,
    /// What the operator was doing.
    pub action: EventAction,
    /// The note, in words.
    pub note: String,
}

impl Announcement {
    /// A Normal event.
    pub fn normal(reason: Reason, action: EventAction, note: impl Into<String>) -> Self {
        Announcement {
            warning: false,
            reason,
            action,
            note: note.into(),
        }
    }

    /// A Warning event.
    pub fn warning(reason: Reason, action: EventAction, note: impl Into<String>) -> Self {
        Announcement {
            warning: true,
            reason,
            action,
            note: note.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn all_lists_every_reason_once() {
        let names: BTreeSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for r in Reason::ALL {
            assert!(
                r.as_str().chars().next().unwrap().is_ascii_uppercase()
                    && r.as_str().chars().all(|c| c.is_ascii_alphanumeric()),
                "{r} is not PascalCase"
            );
        }
    }

    /// The "Conditions and events" table (`docs/conditions.md`) names
    /// exactly these reasons.
    #[test]
    fn the_conditions_table_lists_every_reason() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/conditions.md");
        let section = std::fs::read_to_string(path).unwrap();
        let in_table: BTreeSet<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        let in_code: BTreeSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            in_table, in_code,
            "docs/conditions.md reasons (left) and Reason::ALL (right) differ"
        );
    }
}
