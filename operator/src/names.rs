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
