//! Names the operator owns: the field manager, labels and annotations it
//! sets or reads, the admin Secret, and the containers it renders. One
//! place, so the renderer, the metrics loop and the controller agree.

use std::collections::BTreeMap;

/// The one field manager the operator applies with, for objects and status;
/// also the reporting controller of its events.
pub const FIELD_MANAGER: &str = "c10m-operator";

/// Label holding the fleet name on every owned object and pod.
pub const FLEET_LABEL: &str = "c10m.dev/fleet";

/// `app.kubernetes.io/managed-by` value on every owned object.
pub const MANAGED_BY: &str = "c10m-operator";

/// Label selector of every object the operator owns (its watches use it).
pub const MANAGED_BY_SELECTOR: &str = "app.kubernetes.io/managed-by=c10m-operator";

/// Annotation that pauses autoscaling and rebalancing of one fleet
/// (`"true"`); shards then stay where they are.
pub const PAUSE_ANNOTATION: &str = "c10m.dev/autoscaling-paused";

/// Annotation the ReplicaSet controller reads to pick which pods to delete
/// first on scale-in (lower cost goes first; Kubernetes ≥ 1.22).
pub const POD_DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// Label the Deployment controller puts on a ReplicaSet and its pods: the
/// hash of their pod template (one value per revision).
pub const POD_TEMPLATE_HASH: &str = "pod-template-hash";

/// Annotation the Deployment controller puts on each ReplicaSet: its
/// revision, counting up from 1 with each new template.
pub const REVISION_ANNOTATION: &str = "deployment.kubernetes.io/revision";

/// Pod annotation the operator sets once it has cordoned the pod's shard
/// (`POST /cordon` answered), and removes once it has uncordoned it: what
/// a rollout has done survives a restart or a change of leader. Its value
/// is the connections the shard reported holding as it answered (decimal;
/// `unknown` when it did not say).
pub const CORDONED_ANNOTATION: &str = "c10m.dev/cordoned";

/// Fleet annotation a user sets to restart every shard within the
/// reconnect budget (`kubectl annotate connectionfleet NAME
/// c10m.dev/restarted-at="$(date -Iseconds)" --overwrite`): copied as is
/// onto the shards' pod template, so each new value rolls the fleet. Unlike
/// `kubectl rollout restart` of the Deployment, the change is the
/// operator's to write, so one made while a step drains waits for that
/// drain ([`crate::rollout::template_waits`], ADR 0011).
pub const RESTARTED_AT_ANNOTATION: &str = "c10m.dev/restarted-at";

/// Deployment annotation (`"true"`) the operator sets when it pauses the
/// Deployment for the fleet's `spec.rollout.paused`, and removes as it
/// resumes it: it resumes only a pause of its own, never one made with
/// `kubectl rollout pause` ([`crate::rollout::pause_order`]).
pub const PAUSED_BY_FLEET_ANNOTATION: &str = "c10m.dev/paused-by-fleet";

/// Deployment annotation the operator sets while a rollout step drains:
/// its value is the drain's end (`status.rollout.drainingUntil`, RFC 3339,
/// whole seconds). The chart's ValidatingAdmissionPolicy
/// (`charts/c10m-operator/templates/rollout-admission.yaml`) refuses a
/// change of the pod template while it is there, so a `kubectl rollout
/// restart` cannot start a second drain on top of the one under way. The
/// operator removes it as the drain ends, before it applies a template
/// that waited ([`crate::rollout::drain_mark`], ADR 0011).
pub const STEP_DRAINING_ANNOTATION: &str = "c10m.dev/step-draining-until";

/// Annotation on the ConnectionFleet CRD: the schema revision it carries
/// ([`crate::api::CRD_SCHEMA_REVISION`] of the operator that generated it),
/// a decimal integer. An operator never applies its CRD over one carrying a
/// higher revision ([`crate::controller::apply_crd`]).
pub const SCHEMA_REVISION_ANNOTATION: &str = "c10m.dev/schema-revision";

/// Field manager of the one Deployment field a rollout owns,
/// `spec.minReadySeconds`: the gate between its steps
/// ([`crate::rollout::Rollout::pace`]). The rendered objects never set it.
pub const ROLLOUT_FIELD_MANAGER: &str = "c10m-operator-rollout";

/// Node label: the hard RLIMIT_NOFILE, in descriptors, that containers on
/// the node inherit from its container runtime (containerd passes its own
/// limit on: `LimitNOFILE` of its unit, 524,288 with containerd 2.x). A
/// decimal integer; the plan's nodes get the smallest value any of them
/// carries. Set by the node's admin (tests/cluster/node.sh measures it).
pub const NODE_NOFILE_HARD_LIMIT_LABEL: &str = "c10m.dev/nofile-hard-limit";

/// Node label: [`UNAVAILABLE`] when the node's runtime cannot give a
/// container CAP_SYS_RESOURCE (no process under the node's init holds it in
/// its bounding set; runc then refuses `capabilities.add: [SYS_RESOURCE]`
/// with "unable to apply caps: operation not permitted").
pub const NODE_SYS_RESOURCE_LABEL: &str = "c10m.dev/sys-resource";

/// Node label: [`UNAVAILABLE`] when a privileged container cannot enter the
/// host's network namespace (opening `/proc/1/ns/net` is refused), so the
/// init container cannot raise node-level sysctls.
pub const NODE_HOST_NETWORK_NAMESPACE_LABEL: &str = "c10m.dev/host-network-namespace";

/// Node label: the node's cgroup version, `v1` or `v2`
/// ([`crate::api::CgroupMode`]): what a connection charges to its pod.
pub const NODE_CGROUP_MODE_LABEL: &str = "c10m.dev/cgroup-mode";

/// Node annotation: the namespaced sysctls the node's kubelet allows besides
/// the safe set (its `allowedUnsafeSysctls`, which the API does not show),
/// in the kubelet's syntax: comma-separated names or `prefix*` patterns.
/// PodSecurityContext mode renders an `allowedUnsafe` sysctl only where
/// every node of the plan allows it (a pod asking for one its kubelet
/// refuses is `SysctlForbidden`).
pub const NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION: &str = "c10m.dev/allowed-unsafe-sysctls";

/// Value of the node-fact labels that says the node cannot do the thing.
pub const UNAVAILABLE: &str = "unavailable";

/// Name of the privileged init container that applies sysctls.
pub const SYSCTL_INIT_CONTAINER: &str = "sysctls";

/// Name of the server container.
pub const SERVER_CONTAINER: &str = "server";

/// Name of the container port clients connect to.
pub const CONNECTION_PORT_NAME: &str = "conn";

/// Name of the admin Secret of fleet `fleet`; its token is under
/// [`c10m_wire::admin::TOKEN_KEY`].
pub fn secret_name(fleet: &str) -> String {
    format!("{fleet}-admin")
}

/// Labels on every object and pod of the fleet `name`.
pub fn labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "c10m-server".into()),
        ("app.kubernetes.io/instance".into(), name.into()),
        ("app.kubernetes.io/managed-by".into(), MANAGED_BY.into()),
        (FLEET_LABEL.into(), name.into()),
    ])
}

/// The selector of the fleet `name`'s pods.
pub fn selector(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(FLEET_LABEL.into(), name.into())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managed_by_selector_matches_the_labels() {
        let (k, v) = MANAGED_BY_SELECTOR.split_once('=').unwrap();
        assert_eq!(labels("f").get(k).map(String::as_str), Some(v));
        assert_eq!(FIELD_MANAGER, MANAGED_BY);
        assert_eq!(
            selector("f").get(FLEET_LABEL).map(String::as_str),
            Some("f")
        );
    }
}
