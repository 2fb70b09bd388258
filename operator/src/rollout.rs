//! A rollout within the fleet's reconnect budget (pure; ADR 0011).
//!
//! The Deployment controller steps the rollout: the rendered strategy
//! (`maxSurge` = plan.rolloutSurge, `maxUnavailable: 0`, `minReadySeconds`
//! = plan.rolloutStepSeconds, see [`crate::render`]) removes old shards
//! only when as many updated ones have been Ready for a step, and a step
//! lasts as long as an old shard takes to drain its cap at plan.drainRate.
//! So at most `rolloutSurge` old shards drain at once, closing at most
//! spec.rollout.maxReconnectRate connections/s together, with or without the
//! operator.
//!
//! What the operator adds is where the closed clients go. While a rollout
//! is under way, every old shard not yet draining is cordoned
//! (`POST /cordon`): its readiness drops, it leaves the Service's
//! endpoints and keeps its connections, so the clients a drain closes can
//! only reconnect to updated shards, and none is moved twice. A paused
//! Deployment (`kubectl rollout pause`) starts no step; its old shards stay
//! cordoned (uncordoning them for the pause would let the clients of the
//! first drain after `kubectl rollout resume` race their cordon back onto
//! old shards, and move them twice). A cordoned shard that runs the
//! current template again (a rollback, `kubectl rollout undo`) is
//! uncordoned. Each cordon is recorded on the pod ([`CORDONED_ANNOTATION`]),
//! so an order is sent once and a new leader knows what the old one did.
//!
//! [`observe`] reads the rollout from the Deployment, its ReplicaSets and
//! the fleet's pods; [`Rollout::orders`] says which shards to cordon and
//! uncordon.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;

use crate::api::status::RolloutStatus;
use crate::autoscale::observe::pod_ready;
use crate::names::{CORDONED_ANNOTATION, POD_TEMPLATE_HASH, REVISION_ANNOTATION};

/// One of the fleet's shards as a rollout sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Pod name.
    pub name: String,
    /// Pod IP, once it has one.
    pub ip: Option<String>,
    /// Runs the template being rolled out.
    pub updated: bool,
    /// The operator cordoned it ([`CORDONED_ANNOTATION`]).
    pub cordoned: bool,
    /// The pod is terminating (its shard drains).
    pub terminating: bool,
    /// The pod's `Ready` condition is True (it is in the Service's
    /// endpoints).
    pub ready: bool,
}

/// The rollout as observed: progress, and the shards orders go to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rollout {
    /// Progress for `status.rollout`; `None` when every shard runs the
    /// current template.
    pub status: Option<RolloutStatus>,
    /// The fleet's shards (pods), when listed.
    pub shards: Vec<Shard>,
}

/// What to tell the shards' admin endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Orders {
    /// Shards to cordon (`POST /cordon`): old, not draining, not yet
    /// cordoned, while the rollout runs and once an updated shard is Ready
    /// (before that, the old shards are the only ones new clients can
    /// reach).
    pub cordon: Vec<Shard>,
    /// Shards to uncordon (`POST /uncordon`): cordoned ones that run the
    /// current template (a rollback made their template current again).
    pub uncordon: Vec<Shard>,
}

/// Old shards not draining that are cordoned.
fn cordoned(shards: &[Shard]) -> i32 {
    shards
        .iter()
        .filter(|s| !s.updated && !s.terminating && s.cordoned)
        .count() as i32
}

impl Rollout {
    /// The rollout once `done` (the orders the shards answered) is carried
    /// out: their cordons as they are now, and the status counting them.
    pub fn after(mut self, done: &Orders) -> Rollout {
        for s in &mut self.shards {
            if done.cordon.iter().any(|d| d.name == s.name) {
                s.cordoned = true;
            } else if done.uncordon.iter().any(|d| d.name == s.name) {
                s.cordoned = false;
            }
        }
        if let Some(st) = &mut self.status {
            st.cordoned_shards = cordoned(&self.shards);
        }
        self
    }

    /// The cordon and uncordon orders for this rollout. Draining shards
    /// and shards without an IP get none. Old shards are cordoned only in
    /// a `budgeted` rollout (spec.rollout.maxReconnectRate set): under the
    /// Deployment's unbudgeted pacing (`maxUnavailable: 1`) a cordoned,
    /// unready old shard counts as unavailable, and the controller would
    /// remove it at once. Cordons left by a budget since removed are lifted.
    pub fn orders(&self, budgeted: bool) -> Orders {
        let mut orders = Orders::default();
        let landing = self
            .shards
            .iter()
            .any(|s| s.updated && s.ready && !s.terminating);
        let running = budgeted && self.status.is_some() && landing;
        for s in self
            .shards
            .iter()
            .filter(|s| s.ip.is_some() && !s.terminating)
        {
            let old = !s.updated;
            if old && running && !s.cordoned {
                orders.cordon.push(s.clone());
            } else if s.cordoned && !(old && running) {
                orders.uncordon.push(s.clone());
            }
        }
        orders
    }
}

/// The newest of `replica_sets` (highest [`REVISION_ANNOTATION`]): its
/// revision and pod-template hash. `None` without a readable one.
pub fn current_revision(replica_sets: &[ReplicaSet]) -> Option<(i64, String)> {
    replica_sets
        .iter()
        .filter_map(|rs| {
            let hash = rs.metadata.labels.as_ref()?.get(POD_TEMPLATE_HASH)?;
            Some((revision(rs)?, hash.clone()))
        })
        .max_by_key(|(revision, _)| *revision)
}

/// The revision of `rs` ([`REVISION_ANNOTATION`]), `None` without a
/// readable one.
pub fn revision(rs: &ReplicaSet) -> Option<i64> {
    rs.metadata
        .annotations
        .as_ref()?
        .get(REVISION_ANNOTATION)?
        .parse()
        .ok()
}

/// The rollout of a fleet whose shards close at `drain_rate`
/// connections/s each (plan.drainRate), from its `deployment`, its
/// `replica_sets` and its `pods` (empty when they were not listed).
///
/// A rollout is under way while a pod runs another template than the
/// newest ReplicaSet's; without a readable revision there is none to
/// report.
pub fn observe(
    deployment: &Deployment,
    replica_sets: &[ReplicaSet],
    pods: &[Pod],
    drain_rate: i64,
) -> Rollout {
    let Some((revision, hash)) = current_revision(replica_sets) else {
        return Rollout::default();
    };
    let shards: Vec<Shard> = pods.iter().filter_map(|p| shard(p, &hash)).collect();
    let updated = deployment
        .status
        .as_ref()
        .and_then(|s| s.updated_replicas)
        .unwrap_or(0);
    let old = |terminating: bool| {
        shards
            .iter()
            .filter(|s| !s.updated && s.terminating == terminating)
            .count() as i32
    };
    let (serving, draining) = (old(false), old(true));
    let status = (serving + draining > 0).then(|| RolloutStatus {
        revision,
        updated_shards: updated,
        old_shards: serving,
        cordoned_shards: cordoned(&shards),
        draining_shards: draining,
        closes_per_second: i64::from(draining) * drain_rate,
        paused: deployment
            .spec
            .as_ref()
            .and_then(|s| s.paused)
            .unwrap_or(false),
    });
    Rollout { status, shards }
}

fn shard(pod: &Pod, current_hash: &str) -> Option<Shard> {
    let hash = pod.metadata.labels.as_ref()?.get(POD_TEMPLATE_HASH)?;
    let status = pod.status.as_ref();
    Some(Shard {
        name: pod.metadata.name.clone()?,
        ip: status.and_then(|s| s.pod_ip.clone()),
        updated: hash == current_hash,
        cordoned: pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(CORDONED_ANNOTATION)),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        ready: pod_ready(pod),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rs(revision: &str, hash: &str) -> ReplicaSet {
        serde_json::from_value(json!({
            "metadata": {
                "name": format!("f-{hash}"),
                "labels": {POD_TEMPLATE_HASH: hash},
                "annotations": {REVISION_ANNOTATION: revision}
            }
        }))
        .unwrap()
    }

    fn pod(name: &str, hash: &str, cordoned: bool, terminating: bool) -> Pod {
        let mut p = json!({
            "metadata": {"name": name, "labels": {POD_TEMPLATE_HASH: hash}},
            "status": {
                "podIP": format!("10.0.0.{}", name.len()),
                "conditions": [{"type": "Ready", "status": "True"}]
            }
        });
        if cordoned {
            p["metadata"]["annotations"] = json!({CORDONED_ANNOTATION: "true"});
        }
        if terminating {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
        }
        serde_json::from_value(p).unwrap()
    }

    fn deployment(replicas: i32, updated: i32, paused: bool) -> Deployment {
        serde_json::from_value(json!({
            "spec": {"replicas": replicas, "paused": paused, "selector": {}, "template": {}},
            "status": {"updatedReplicas": updated}
        }))
        .unwrap()
    }

    fn names(shards: &[Shard]) -> Vec<&str> {
        shards.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn the_newest_replica_set_is_current_by_revision_not_by_order() {
        let sets = [rs("9", "new"), rs("10", "newer"), rs("x", "bad")];
        assert_eq!(current_revision(&sets), Some((10, "newer".into())));
        assert_eq!(current_revision(&[]), None);
    }

    #[test]
    fn mid_rollout_the_old_serving_shards_are_cordoned_and_counted() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            pod("a", "new", false, false),
            pod("bb", "old", false, false),
            pod("ccc", "old", true, false),
            pod("dddd", "old", true, true),
        ];
        let r = observe(&deployment(4, 1, false), &sets, &pods, 50);
        assert_eq!(
            r.status,
            Some(RolloutStatus {
                revision: 2,
                updated_shards: 1,
                old_shards: 2,
                cordoned_shards: 1,
                draining_shards: 1,
                closes_per_second: 50,
                paused: false,
            })
        );
        let o = r.orders(true);
        // The old shard is cordoned, once; the draining one and the updated
        // one get nothing.
        assert_eq!(names(&o.cordon), ["bb"]);
        assert!(o.uncordon.is_empty());
        // Once carried out, the status counts both old shards cordoned.
        let after = r.after(&o);
        assert_eq!(after.status.unwrap().cordoned_shards, 2);
    }

    /// Issue 22: until an updated shard is Ready, the old shards are the
    /// only ones new clients can reach, so none is cordoned; the first
    /// Ready updated shard cordons them all at once.
    #[test]
    fn old_shards_are_cordoned_only_once_an_updated_shard_is_ready() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let mut starting = pod("a", "new", false, false);
        starting.status.as_mut().unwrap().conditions = None;
        let old = [
            pod("bb", "old", false, false),
            pod("ccc", "old", false, false),
        ];
        let pods: Vec<Pod> = std::iter::once(starting).chain(old.clone()).collect();
        let r = observe(&deployment(2, 1, false), &sets, &pods, 50);
        assert!(r.status.is_some(), "the rollout is under way");
        assert_eq!(r.orders(true), Orders::default());
        let pods: Vec<Pod> = std::iter::once(pod("a", "new", false, false))
            .chain(old)
            .collect();
        let r = observe(&deployment(2, 1, false), &sets, &pods, 50);
        assert_eq!(names(&r.orders(true).cordon), ["bb", "ccc"]);
    }

    /// A paused rollout keeps (and completes) its cordons: the Deployment
    /// starts no step, and the first drain after the resume finds every
    /// old shard out of the endpoints already.
    #[test]
    fn a_paused_rollout_keeps_its_old_shards_cordoned() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            pod("a", "new", false, false),
            pod("bb", "old", true, false),
            pod("ccc", "old", false, false),
        ];
        let r = observe(&deployment(3, 1, true), &sets, &pods, 50);
        assert!(r.status.as_ref().unwrap().paused);
        let o = r.orders(true);
        assert_eq!(names(&o.cordon), ["ccc"]);
        assert!(o.uncordon.is_empty());
        let st = r.after(&o).status.unwrap();
        assert_eq!((st.old_shards, st.cordoned_shards), (2, 2));
    }

    #[test]
    fn a_finished_rollout_reports_nothing_and_uncordons_a_rolled_back_shard() {
        let sets = [rs("3", "back"), rs("2", "new")];
        // Revision 3 is the old template again: its shards were cordoned by
        // the rollout to revision 2 and must take clients now.
        let pods = [
            pod("a", "back", false, false),
            pod("bb", "back", true, false),
        ];
        let r = observe(&deployment(2, 2, false), &sets, &pods, 50);
        assert_eq!(r.status, None);
        let o = r.orders(true);
        assert!(o.cordon.is_empty());
        assert_eq!(names(&o.uncordon), ["bb"]);
    }

    #[test]
    fn a_first_rollout_or_a_scale_out_is_no_rollout() {
        // One ReplicaSet, pods still starting: nothing to report or order.
        let sets = [rs("1", "only")];
        let pods = [pod("a", "only", false, false)];
        let r = observe(&deployment(3, 1, false), &sets, &pods, 50);
        assert_eq!(r.status, None);
        assert_eq!(r.orders(true), Orders::default());
    }

    #[test]
    fn shards_without_an_ip_get_no_order() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let mut p = pod("bb", "old", false, false);
        p.status.as_mut().unwrap().pod_ip = None;
        let r = observe(&deployment(1, 0, false), &sets, &[p], 50);
        assert!(r.orders(true).cordon.is_empty());
    }
}
