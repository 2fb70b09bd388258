//! Observe (client required): what the cluster holds for one fleet: the
//! stored fleet, the node profile its pods can land on, any object in the
//! way, the replicas its Deployment runs now, and (after the apply) the
//! ReplicaSets and pods its workload's failures show on.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::Error;
use super::cache::{self, Cache};
use crate::api::ConnectionFleet;
use crate::api::status::NodeSource;
use crate::autoscale::observe::controller_uid;
use crate::names::{FLEET_LABEL, secret_name};
use crate::plan::{NodeFacts, PlanError, nodes};
use crate::unmanaged::{self, Unmanaged};

/// The `resourceVersion` and `metadata.generation` this process last read
/// (GET) or wrote (status) a fleet at ([`super::Context::seen`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Known {
    resource_version: String,
    generation: i64,
}

impl Known {
    /// `fleet`'s version, if it carries a `resourceVersion`.
    pub fn of(fleet: &ConnectionFleet) -> Option<Known> {
        Some(Known {
            resource_version: fleet.metadata.resource_version.clone()?,
            generation: fleet.metadata.generation.unwrap_or(0),
        })
    }
}

/// Whether the cached copy of a fleet a reconcile is triggered with
/// (`cached`, from this process's watch) is as new as the stored fleet as
/// far as this process's own writes go, so it needs no GET, given what
/// this process last read or wrote it at (`known`):
/// - nothing (`None`): this process has written nothing the copy could
///   miss (a new fleet, or the first reconcile after a start or a
///   failover, whose watch listed the fleets after the last leader
///   stopped); a later change by anyone else is a watch event and another
///   reconcile;
/// - the same `resourceVersion`;
/// - a higher `generation`: the copy carries a spec change made after this
///   process's last read or write, so it holds that write too (a re-plan).
///
/// Otherwise (the copy is older than this process's last status write: an
/// owned object's event can arrive first) the fleet is read.
pub fn cached_is_current(cached: &ConnectionFleet, known: Option<&Known>) -> bool {
    let Some(known) = known else {
        return true;
    };
    cached.metadata.resource_version.as_deref() == Some(known.resource_version.as_str())
        || cached.metadata.generation.unwrap_or(0) > known.generation
}

/// The latest stored `fleet`, or `None` when it is gone. The cached copy a
/// reconcile is triggered with may predate the operator's last status write
/// (an owned object's event can arrive first): deciding from the stored
/// status means a stale cache never flips a condition's transition time or
/// repeats an event. A cached copy that [`cached_is_current`] given what
/// this process last read or wrote it at (`known`) is used without a GET
/// (most reconciles; a GET each was a third of a reconcile's reads, and
/// one round trip more before a new or re-planned fleet's Deployment is
/// applied, issue 23).
pub async fn fleet(
    client: &Client,
    fleet: &ConnectionFleet,
    known: Option<&Known>,
) -> Result<Option<ConnectionFleet>, Error> {
    if cached_is_current(fleet, known) {
        return Ok(Some(fleet.clone()));
    }
    let name = fleet.name_any();
    Api::<Unmanaged<ConnectionFleet>>::namespaced(
        client.clone(),
        &fleet.namespace().unwrap_or_default(),
    )
    .get_opt(&name)
    .await
    .map(|read| read.map(|f| f.0))
    .map_err(Error::observe(format!("get ConnectionFleet {name}")))
}

/// Node profile for the fleet and where its sizes came from: the
/// allocatable of the smallest node matching its nodeSelector whose taints
/// it tolerates, `spec.node`
/// only where it is smaller ([`nodes::resolve_sourced`]). The nodes are
/// listed even when `spec.node` gives every size: a fleet's claim never
/// sizes node-level limits past the real node. The nodes come from the
/// `cache` when there is one (the controller's node watch; the profile is
/// worked out once per change of it, [`Cache::node_profile`]), else from a
/// list. The inner error is the plan's (no profile), the outer one an API
/// failure.
pub async fn node_facts(
    client: &Client,
    cache: Option<&Cache>,
    fleet: &ConnectionFleet,
) -> Result<Result<(NodeFacts, NodeSource), PlanError>, Error> {
    let placement = &fleet.spec.placement;
    let observed = match cache {
        Some(c) => c.node_profile(&placement.node_selector, &placement.tolerations),
        None => {
            let selector = placement
                .node_selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            let matching = Api::<Node>::all(client.clone())
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|source| Error::Nodes { source })?
                .items;
            nodes::observed(&nodes::placeable(&matching, &placement.tolerations))
        }
    };
    Ok(nodes::resolve_sourced(&fleet.spec, observed))
}

/// What fleet `name` would own, as stored, read once a reconcile and all
/// at once (one round trip where the watch caches miss, not one per
/// object): its Deployment, and the first of its objects that exists but
/// is controlled by something else. Its admin Secret is read or created
/// apart, at the same time ([`super::apply::read_admin_secret`],
/// [`super::apply::create_admin_secret`]).
#[derive(Clone, Debug, Default)]
pub struct Owned {
    /// The Deployment as stored (`None` before it exists): its replicas now
    /// (the metrics loop's start) and its pod template (a template change
    /// held back during a rollout's drain, [`super::apply::objects`]).
    pub deployment: Option<Deployment>,
    /// A message naming the first object (Deployment, Service,
    /// PodDisruptionBudget) that exists and is not controlled
    /// by the fleet's `uid`. The operator never adopts or rewrites such an
    /// object.
    pub conflict: Option<String>,
}

/// Reads [`Owned`] for fleet `name` (uid `uid`) in `ns`. An object the
/// `cache` holds is read from it (it carries the operator's labels, but the
/// owner is still checked); the others through the API, concurrently,
/// except the Service while this process's apply of it is under way
/// (`service_applying`, [`super::apply::ServiceApplies::under_way`]): the
/// fleet's own in the making. Errors: the first failed GET, as
/// [`Error::Observe`].
pub async fn owned(
    client: &Client,
    cache: Option<&Cache>,
    ns: &str,
    name: &str,
    uid: &str,
    service_applying: bool,
) -> Result<Owned, Error> {
    type Cached<K> = kube::runtime::reflector::Store<cache::Stored<K>>;
    /// Object `name` of kind `K` through the API (`None`: not found).
    async fn get<K>(client: &Client, ns: &str, name: &str) -> Result<Option<K>, Error>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug,
    {
        Api::<K>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(Error::observe(format!("get {} {name}", K::kind(&()))))
    }
    /// The metadata of object `name` of kind `K`: the `store`'s when it
    /// holds it (the object is not parsed), else the API's.
    async fn meta<K>(
        client: &Client,
        store: Option<&Cached<K>>,
        ns: &str,
        name: &str,
    ) -> Result<Option<ObjectMeta>, Error>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug
            + 'static,
    {
        match store.and_then(|s| cache::metadata(s, ns, name)) {
            Some(m) => Ok(Some(m)),
            None => Ok(get::<K>(client, ns, name).await?.map(|o| o.meta().clone())),
        }
    }
    let deployment = async {
        match cache.and_then(|c| cache::get(&c.deployments, ns, name)) {
            Some(d) => Ok(Some(d)),
            None => get::<Deployment>(client, ns, name).await,
        }
    };
    let (deployment, service, pdb) = futures::try_join!(
        deployment,
        async {
            match service_applying {
                true => Ok(cache.and_then(|c| cache::metadata(&c.services, ns, name))),
                false => meta::<Service>(client, cache.map(|c| &c.services), ns, name).await,
            }
        },
        meta::<PodDisruptionBudget>(client, cache.map(|c| &c.pdbs), ns, name),
    )?;
    let conflict = [
        not_ours::<Deployment>(deployment.as_ref().map(|o| &o.metadata), name, uid),
        not_ours::<Service>(service.as_ref(), name, uid),
        not_ours::<PodDisruptionBudget>(pdb.as_ref(), name, uid),
    ]
    .into_iter()
    .flatten()
    .next();
    Ok(Owned {
        deployment,
        conflict,
    })
}

/// Whether the `cache` (ready) holds `fleet`'s Deployment (read without
/// parsing it); `None` without a cache.
pub fn deployment_cached(cache: Option<&Cache>, fleet: &ConnectionFleet) -> Option<bool> {
    let (ns, name) = (fleet.namespace().unwrap_or_default(), fleet.name_any());
    cache.map(|c| cache::metadata(&c.deployments, &ns, &name).is_some())
}

/// `fleet` is new: it has no status (no reconcile has ended for it; the
/// copy a reconcile takes is as new as this process's last status write,
/// [`cached_is_current`]) and the cache holds no Deployment for it
/// ([`deployment_cached`] says `Some(false)`). Its admin Secret most
/// likely does not exist either, and is created without being read first
/// ([`super::apply::create_admin_secret`]). Not the cache alone: it lags
/// the applies under load, and each reconcile of a fleet before its
/// Deployment reached the cache then sent a create that failed (409) and
/// a read (`make bench-scale`, 2026-12-06: 1,400 more writes and 5,000
/// more reads over the ramp). `false` without a cache.
pub fn new_fleet(deployment_cached: Option<bool>, fleet: &ConnectionFleet) -> bool {
    fleet.status.is_none() && deployment_cached == Some(false)
}

/// The message naming the fleet's admin Secret (`<fleet>-admin`) when
/// `secret` is not controlled by the fleet's `uid`, as [`Owned::conflict`]
/// names its other objects.
pub fn secret_conflict(secret: &Secret, fleet: &str, uid: &str) -> Option<String> {
    not_ours::<Secret>(Some(&secret.metadata), &secret_name(fleet), uid)
}

/// The message naming object `name` of kind `K` when it exists (`meta`)
/// and no controller owner reference names the fleet's `uid`.
fn not_ours<K: Resource<DynamicType = ()>>(
    meta: Option<&ObjectMeta>,
    name: &str,
    uid: &str,
) -> Option<String> {
    let kind = K::kind(&());
    meta.filter(|m| controller_uid(m) != Some(uid)).map(|_| {
        format!("{kind} {name} already exists and is not owned by this ConnectionFleet; rename the fleet or remove the {kind}")
    })
}

/// The fleet's ReplicaSets and, while its Deployment has fewer ready
/// replicas than it asks for or a rollout is under way, its pods: what
/// [`crate::status::workload_failure`] reads a refusal or an image pull
/// error from, and [`crate::rollout::observe`] the rollout.
#[derive(Clone, Debug, Default)]
pub struct Workload {
    /// ReplicaSets labelled with the fleet (the Deployment's, old and new).
    pub replica_sets: Vec<ReplicaSet>,
    /// The fleet's pods; empty while every replica is ready and one
    /// ReplicaSet holds them all.
    pub pods: Vec<Pod>,
}

/// Whether `deployment` stands as asked, nothing under way: the Deployment
/// controller has observed its latest generation, and every replica it
/// asks for runs the current template and is ready (`status.replicas`
/// counts the old template's pods too).
pub fn settled(deployment: &Deployment) -> bool {
    let (Some(spec), Some(status)) = (&deployment.spec, &deployment.status) else {
        return false;
    };
    let wanted = spec.replicas.unwrap_or(1);
    deployment.metadata.generation.is_some()
        && status.observed_generation == deployment.metadata.generation
        && status.replicas == Some(wanted)
        && status.updated_replicas == Some(wanted)
        && status.ready_replicas == Some(wanted)
}

/// Whether every pod `deployment` runs is of one template by its own
/// status: it has had no other (generation 1, as created), or its
/// controller counts no pod of a template older than the one it last
/// observed (`status.replicas == status.updatedReplicas`). A rollout under
/// way, or a Deployment with no status past its first generation, is not.
///
/// A generation the controller has not observed yet passes: the rollout
/// gate's own patch (`minReadySeconds`) makes one right after every new
/// fleet's create, and those reconciles listed 1,334 times each at 1,000
/// fleets (2026-12-07). A template change it carries shows in the
/// controller's next status write, which brings the fleet back; until the
/// controller has acted on it a list finds no new ReplicaSet either, and
/// one the store already holds sends the reconcile to the lists
/// ([`rolling`]).
pub fn one_template(deployment: &Deployment) -> bool {
    let counted = (deployment.status.as_ref()).filter(|s| s.replicas == s.updated_replicas);
    deployment.metadata.generation == Some(1) || counted.is_some()
}

/// Whether two of `replica_sets` want or run pods: a rollout, even before
/// the new one's first pod exists (its status still says 0) and before
/// the Deployment's status says anything.
fn rolling(replica_sets: &[ReplicaSet]) -> bool {
    replica_sets
        .iter()
        .filter(|rs| {
            rs.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0
                || rs.status.as_ref().is_some_and(|s| s.replicas > 0)
        })
        .count()
        > 1
}

/// The workload of fleet `ns`/`name` (uid `fleet_uid`), as the Deployment
/// stored after the apply stands. Nothing when the Deployment is
/// [`settled`] and the fleet's status has no rollout to carry on
/// (`rollout_recorded` false, so no drain to wait out): no rollout, no
/// refusal and no pull error can be read then, and only the current
/// ReplicaSet and the older ones at 0 replicas would be found. Most of a
/// fleet's reconciles (its status, its Service or budget, a node's change)
/// come while it is settled.
///
/// Outside a rollout (none recorded, the Deployment runs [`one_template`]
/// and the stores hold no second ReplicaSet with pods), while shards start
/// or one is not ready, the ReplicaSets and pods are read from the
/// watches' stores ([`Cache::workload`]) when the `cache` is given: at 1,000 fleets those
/// reconciles listed both, 5,300 of the ramp's 9,374 reads (2026-12-07). A
/// store lags the API by a watch event; a refusal or a pull error is read
/// at the next reconcile, as a list would read one that came a moment
/// after it. A rollout's reconciles, whose cordons and gate go by the
/// shards' revisions, list through the API: the ReplicaSets by the fleet
/// label (ReplicaSets carry the pod template's labels, so no watch on every
/// ReplicaSet in the cluster) and, while fewer replicas are ready than
/// asked or two ReplicaSets want or run pods, the pods, both read without
/// their `managedFields` ([`unmanaged::list`]).
pub async fn workload(
    client: &Client,
    cache: Option<&Cache>,
    ns: &str,
    name: &str,
    fleet_uid: &str,
    deployment: &Deployment,
    rollout_recorded: bool,
) -> Result<Workload, Error> {
    if !rollout_recorded && settled(deployment) {
        return Ok(Workload::default());
    }
    let wanted = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let ready = deployment
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    if let Some(cache) = cache.filter(|_| !rollout_recorded && one_template(deployment)) {
        let (replica_sets, pods) = cache.workload(ns, deployment, fleet_uid, ready < wanted);
        if !rolling(&replica_sets) {
            return Ok(Workload { replica_sets, pods });
        }
    }
    let by_fleet = ListParams::default().labels(&format!("{FLEET_LABEL}={name}"));
    let replica_sets: Vec<ReplicaSet> =
        unmanaged::list(&Api::namespaced(client.clone(), ns), &by_fleet)
            .await
            .map_err(Error::observe(format!("list ReplicaSets of {name}")))?;
    let pods = if ready < wanted || rolling(&replica_sets) {
        unmanaged::list::<Pod>(&Api::namespaced(client.clone(), ns), &by_fleet)
            .await
            .map_err(Error::observe(format!("list pods of {name}")))?
    } else {
        Vec::new()
    };
    Ok(Workload { replica_sets, pods })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(resource_version: &str, generation: i64) -> ConnectionFleet {
        let mut f: ConnectionFleet = serde_json::from_value(serde_json::json!({
            "apiVersion": "c10m.dev/v1alpha1",
            "kind": "ConnectionFleet",
            "metadata": {"name": "f", "namespace": "ns"},
            "spec": {"connections": 1000, "backend": {"model": "epoll"}}
        }))
        .unwrap();
        f.metadata.resource_version = Some(resource_version.into());
        f.metadata.generation = Some(generation);
        f
    }

    fn deployment(generation: i64, status: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "f", "namespace": "ns", "generation": generation},
            "spec": {"replicas": 4, "selector": {}, "template": {}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn only_a_deployment_standing_as_asked_is_settled() {
        let all = serde_json::json!({
            "observedGeneration": 3, "replicas": 4, "updatedReplicas": 4, "readyReplicas": 4
        });
        assert!(settled(&deployment(3, all.clone())));
        // A template the controller has not observed yet.
        assert!(!settled(&deployment(4, all.clone())));
        // A rollout: old pods beside the updated ones, or updated ones not
        // ready yet.
        let mut rolling = all.clone();
        rolling["replicas"] = 6.into();
        assert!(!settled(&deployment(3, rolling)));
        let mut starting = all.clone();
        starting["updatedReplicas"] = 2.into();
        assert!(!settled(&deployment(3, starting)));
        let mut unready = all;
        unready["readyReplicas"] = 3.into();
        assert!(!settled(&deployment(3, unready)));
        // Just created: no status yet.
        assert!(!settled(&deployment(1, serde_json::json!({}))));
    }

    #[test]
    fn only_a_deployment_counting_no_older_pod_runs_one_template() {
        let counts = |replicas: i64, updated: i64| {
            serde_json::json!({"observedGeneration": 1, "replicas": replicas,
                               "updatedReplicas": updated, "readyReplicas": 1})
        };
        // As created, before its controller writes a status.
        assert!(one_template(&deployment(1, serde_json::json!({}))));
        // Starting shards, and the rollout gate's generation not observed
        // yet: the controller counts no pod of an older template.
        assert!(one_template(&deployment(2, counts(4, 4))));
        // A rollout: pods of an older template beside the updated ones.
        assert!(!one_template(&deployment(3, counts(6, 2))));
        // Past its first generation with no status: not told.
        let mut bare = deployment(2, serde_json::json!({}));
        bare.status = None;
        assert!(!one_template(&bare));
    }

    #[test]
    fn two_replica_sets_with_pods_wanted_or_running_are_a_rollout() {
        let rs = |spec: i32, status: i32| -> ReplicaSet {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "x"},
                "spec": {"replicas": spec, "selector": {}},
                "status": {"replicas": status},
            }))
            .unwrap()
        };
        assert!(!rolling(&[rs(4, 4), rs(0, 0)]));
        // The new one wants pods before its first exists.
        assert!(rolling(&[rs(4, 4), rs(1, 0)]));
        // The old one, scaled to 0, still runs pods.
        assert!(rolling(&[rs(0, 2), rs(4, 4)]));
        assert!(!rolling(&[]));
    }

    #[test]
    fn a_cached_fleet_is_read_again_only_when_it_may_miss_this_process_s_write() {
        let written = Known::of(&at("120", 3));
        // Never read or written by this process: the watch's copy.
        assert!(cached_is_current(&at("100", 1), None));
        // The version last written.
        assert!(cached_is_current(&at("120", 3), written.as_ref()));
        // A spec change after the write (a re-plan): newer than the write.
        assert!(cached_is_current(&at("130", 4), written.as_ref()));
        // Behind the status write (an owned object's event came first), or
        // another version of the same generation: read again.
        assert!(!cached_is_current(&at("110", 3), written.as_ref()));
        assert!(!cached_is_current(&at("90", 2), written.as_ref()));
        // No resourceVersion: nothing to remember.
        let mut bare = at("1", 1);
        bare.metadata.resource_version = None;
        assert_eq!(Known::of(&bare), None);
    }
}
