//! Observe (client required): the fleet's shard pods from the API server and
//! its live metrics from Prometheus, as one typed [`Observation`] for
//! [`super::decide`]. A failed or doubtful read is part of the observation
//! (a [`MetricsError`]), not an error: only an API failure ends the sync.

use std::collections::HashSet;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::ListParams;

use super::drift::{self, ShardKernel};
use super::prometheus::{Expected, FleetMetrics, MetricsError, Reader};
use crate::api::{ConnectionFleet, Plan};
use crate::names::{CORDONED_ANNOTATION, FLEET_LABEL, POD_DELETION_COST};

/// A shard pod as the metrics loop sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardPod {
    /// Pod name.
    pub name: String,
    /// Pod IP, once assigned.
    pub ip: Option<String>,
    /// Ready and not terminating.
    pub ready: bool,
    /// Phase `Running` and not terminating, ready or not: its connections
    /// count, and it must report them.
    pub running: bool,
    /// Counted by its ReplicaSet: not terminating, and neither `Succeeded`
    /// nor `Failed`. Only these can be scale-in victims.
    pub active: bool,
    /// The node it is bound to (`spec.nodeName`), once scheduled.
    pub node: Option<String>,
    /// It carries a scale-in mark: a pod-deletion-cost
    /// ([`POD_DELETION_COST`]) without a rollout's cordon record
    /// ([`CORDONED_ANNOTATION`], whose cost orders a rollout's old shards).
    pub marked: bool,
}

/// What one sync saw of a fleet.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    /// The fleet's pods (empty when metrics were not read: nothing to read them for).
    pub pods: Vec<ShardPod>,
    /// The metrics read, or why they cannot be trusted; `None` when they
    /// were not read (the operator has no Prometheus, or the loop is off).
    pub metrics: Option<Result<FleetMetrics, MetricsError>>,
    /// The kernel settings each running shard reports; `None` when they
    /// were not read, or the read failed (the drift condition then stays
    /// as it was).
    pub kernel: Option<Vec<ShardKernel>>,
}

impl Observation {
    /// Names of the running pods, ready or not: the shards expected to
    /// report metrics, whose connections count.
    pub fn running(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|p| p.running)
            .map(|p| p.name.clone())
            .collect()
    }
}

/// Observes `fleet` planned as `plan`: its pods (`cached`, the watch
/// caches' copy, when given; else listed through `pods`), then its metrics
/// from `reader`, checked against the running pods and the plan's bounds.
/// Without a reader nothing is read (no pod listing either).
pub async fn observe(
    reader: Option<&Reader>,
    pods: &Api<Pod>,
    cached: Option<Vec<Pod>>,
    fleet: &ConnectionFleet,
    plan: &Plan,
) -> Result<Observation, kube::Error> {
    let Some(reader) = reader else {
        return Ok(Observation::default());
    };
    let ns = fleet.metadata.namespace.clone().unwrap_or_default();
    let name = fleet.metadata.name.clone().unwrap_or_default();
    let uid = fleet.metadata.uid.clone().unwrap_or_default();
    let own = match cached {
        Some(own) => own,
        None => own_pods(pods, &ns, &name, &uid).await?,
    };
    let nodes: Vec<(String, Option<String>)> = own
        .iter()
        .map(|p| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            (p.metadata.name.clone().unwrap_or_default(), node)
        })
        .collect();
    let mut seen = Observation {
        pods: own.into_iter().map(ShardPod::from).collect(),
        metrics: None,
        kernel: None,
    };
    let expected = Expected {
        pods: seen.running(),
        shard_capacity: plan.shard_connection_limit,
        node_memory_bytes: plan.node_memory_bytes,
    };
    let read = reader
        .read(&fleet.spec.metrics, &ns, &name, &expected)
        .await;
    let running: Vec<(String, Option<String>)> = nodes
        .into_iter()
        .filter(|(pod, _)| expected.pods.contains(pod))
        .collect();
    seen.kernel = read.kernel.map(|samples| drift::group(&samples, &running));
    seen.metrics = Some(read.metrics);
    Ok(seen)
}

/// The fleet's pods: those carrying its label whose controller is one of
/// the ReplicaSets of its own Deployment ([`own_replica_sets`]). A pod that
/// only carries the label (anyone's, in the namespace) is not a shard: it
/// never gets the fleet's admin token in a shed order, never counts as
/// load and is never a victim.
pub async fn shard_pods(
    api: &Api<Pod>,
    ns: &str,
    fleet: &str,
    fleet_uid: &str,
) -> Result<Vec<ShardPod>, kube::Error> {
    Ok(own_pods(api, ns, fleet, fleet_uid)
        .await?
        .into_iter()
        .map(ShardPod::from)
        .collect())
}

/// The fleet's pods as the API server has them (see [`shard_pods`]).
pub async fn own_pods(
    api: &Api<Pod>,
    ns: &str,
    fleet: &str,
    fleet_uid: &str,
) -> Result<Vec<Pod>, kube::Error> {
    let by_label = ListParams::default().labels(&format!("{FLEET_LABEL}={fleet}"));
    let pods = api.list(&by_label).await?;
    if pods.items.is_empty() {
        return Ok(Vec::new());
    }
    // Ownership is all that is read of the Deployment and its
    // ReplicaSets: their metadata alone, not their pod templates.
    let client = api.clone().into_client();
    let deployment = Api::<Deployment>::namespaced(client.clone(), ns)
        .get_metadata_opt(fleet)
        .await?;
    let sets = Api::<ReplicaSet>::namespaced(client, ns)
        .list_metadata(&by_label)
        .await?;
    let own = own_replica_sets(
        deployment.as_ref().map(|d| &d.metadata),
        fleet_uid,
        sets.items.iter().map(|rs| &rs.metadata),
    );
    Ok(pods
        .items
        .into_iter()
        .filter(|p| controller_uid(&p.metadata).is_some_and(|u| own.contains(u)))
        .collect())
}

/// The uid of the object's controller (its owner reference with
/// `controller: true`).
pub fn controller_uid(meta: &ObjectMeta) -> Option<&str> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
        .map(|r| r.uid.as_str())
}

/// Uids of the ReplicaSets among `sets` (their metadata) that the
/// Deployment of metadata `deployment` controls, when the fleet
/// `fleet_uid` controls that Deployment (else none). Metadata only, so
/// objects listed whole, listed as metadata or kept in a watch's store are
/// read alike, without a copy.
pub fn own_replica_sets<'a>(
    deployment: Option<&ObjectMeta>,
    fleet_uid: &str,
    sets: impl IntoIterator<Item = &'a ObjectMeta>,
) -> HashSet<&'a str> {
    let Some(dep) = deployment.filter(|d| controller_uid(d) == Some(fleet_uid)) else {
        return HashSet::new();
    };
    let dep_uid = dep.uid.as_deref().unwrap_or_default();
    sets.into_iter()
        .filter(|rs| !dep_uid.is_empty() && controller_uid(rs) == Some(dep_uid))
        .filter_map(|rs| rs.uid.as_deref())
        .collect()
}

/// `pod`'s `Ready` condition when it is True (being deleted or not).
pub fn ready_condition(pod: &Pod) -> Option<&PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")
}

/// Whether `pod`'s `Ready` condition is True (being deleted or not).
pub fn pod_ready(pod: &Pod) -> bool {
    ready_condition(pod).is_some()
}

impl From<Pod> for ShardPod {
    /// Ready: the pod's `Ready` condition is True; running: its phase is
    /// `Running`; active: its phase is neither `Succeeded` nor `Failed`;
    /// none of them while it is being deleted. Node and mark as the pod
    /// has them.
    fn from(p: Pod) -> Self {
        let alive = p.metadata.deletion_timestamp.is_none();
        let status = p.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
        let ready = pod_ready(&p);
        let (running, active) = (
            alive && phase == "Running",
            alive && phase != "Succeeded" && phase != "Failed",
        );
        let annotated = |key: &str| {
            p.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(key))
        };
        let marked = annotated(POD_DELETION_COST) && !annotated(CORDONED_ANNOTATION);
        ShardPod {
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            marked,
            name: p.metadata.name.unwrap_or_default(),
            ip: p.status.and_then(|s| s.pod_ip),
            ready: alive && ready,
            running,
            active,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(phase: &str, ready: &str, deleting: bool) -> Pod {
        let mut meta = serde_json::json!({"name": "p", "labels": {FLEET_LABEL: "f"}});
        if deleting {
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z".into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": meta,
            "status": {
                "phase": phase,
                "podIP": "127.1.1.7",
                "conditions": [{"type": "Ready", "status": ready}],
            },
        }))
        .unwrap()
    }

    fn owned(name: &str, uid: &str, controller: Option<&str>) -> serde_json::Value {
        let mut meta = serde_json::json!({"name": name, "uid": uid});
        if let Some(c) = controller {
            meta["ownerReferences"] = serde_json::json!([{
                "apiVersion": "v1", "kind": "X", "name": "owner", "uid": c, "controller": true
            }]);
        }
        serde_json::json!({ "metadata": meta })
    }

    #[test]
    fn only_the_replica_sets_of_the_fleets_own_deployment_count() {
        let dep: Deployment =
            serde_json::from_value(owned("f", "dep-uid", Some("fleet-uid"))).unwrap();
        let sets: Vec<ReplicaSet> = [
            owned("f-1", "rs-1", Some("dep-uid")),
            owned("f-2", "rs-2", Some("dep-uid")),
            // Carries the label, controlled by something else.
            owned("f-x", "rs-x", Some("other-uid")),
            owned("f-y", "rs-y", None),
        ]
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
        let metas = || sets.iter().map(|rs| &rs.metadata);
        assert_eq!(
            own_replica_sets(Some(&dep.metadata), "fleet-uid", metas()),
            HashSet::from(["rs-1", "rs-2"])
        );
        // A Deployment of that name the fleet does not control owns nothing.
        assert!(own_replica_sets(Some(&dep.metadata), "another-fleet", metas()).is_empty());
        assert!(own_replica_sets(None, "fleet-uid", metas()).is_empty());
    }

    #[test]
    fn a_shard_is_ready_when_its_pod_is_ready_and_not_terminating() {
        let p = ShardPod::from(pod("Running", "True", false));
        assert_eq!(
            p,
            ShardPod {
                name: "p".into(),
                ip: Some("127.1.1.7".into()),
                ready: true,
                running: true,
                active: true,
                node: None,
                marked: false,
            }
        );
        assert!(!ShardPod::from(pod("Running", "False", false)).ready);
        assert!(
            !ShardPod::from(pod("Running", "True", true)).ready,
            "a terminating pod is no longer a shard to count on"
        );
        assert!(!ShardPod::from(Pod::default()).ready, "no status yet");
    }

    /// Issue 21, item 7: only a scale-in's pod-deletion-cost is a mark; a
    /// rollout's (on a cordoned shard) is the rollout's own.
    #[test]
    fn a_scale_in_mark_is_a_deletion_cost_without_a_cordon_record() {
        let with = |annotations: serde_json::Value| {
            let mut p = serde_json::to_value(pod("Running", "True", false)).unwrap();
            p["metadata"]["annotations"] = annotations;
            p["spec"] = serde_json::json!({"nodeName": "n1", "containers": []});
            ShardPod::from(serde_json::from_value::<Pod>(p).unwrap())
        };
        let marked = with(serde_json::json!({POD_DELETION_COST: "-1000"}));
        assert!(marked.marked);
        assert_eq!(marked.node.as_deref(), Some("n1"));
        let cordoned =
            with(serde_json::json!({POD_DELETION_COST: "-380", CORDONED_ANNOTATION: "380"}));
        assert!(!cordoned.marked);
        assert!(!with(serde_json::json!({})).marked);
        assert_eq!(ShardPod::from(Pod::default()).node, None, "not scheduled");
    }

    #[test]
    fn a_running_shard_counts_whatever_its_readiness() {
        let unready = ShardPod::from(pod("Running", "False", false));
        assert!(unready.running && unready.active && !unready.ready);
        let pending = ShardPod::from(pod("Pending", "False", false));
        assert!(!pending.running && pending.active);
        let no_status = ShardPod::from(Pod::default());
        assert!(!no_status.running && no_status.active, "Pending until told");
        for gone in [
            pod("Running", "True", true),
            pod("Failed", "False", false),
            pod("Succeeded", "False", false),
        ] {
            let p = ShardPod::from(gone);
            assert!(!p.running && !p.active && !p.ready, "{p:?}");
        }
        let seen = Observation {
            pods: vec![
                ShardPod::from(pod("Running", "True", false)),
                ShardPod {
                    name: "q".into(),
                    ..unready
                },
                ShardPod {
                    name: "r".into(),
                    ..pending
                },
            ],
            metrics: None,
            kernel: None,
        };
        assert_eq!(seen.running(), vec!["p", "q"]);
    }
}
