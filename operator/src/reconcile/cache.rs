//! Cache (no client): what the controller's watches hold, so that a
//! reconcile reads the nodes and the fleet's own objects from memory and
//! skips an apply that would change nothing (issue 23). A server-side apply
//! that changes nothing is still a request, counted as a write, and some
//! still bump the resourceVersion (kubernetes#121404, #124605): at 1,000
//! fleets each periodic resync applied three objects for nothing.
//!
//! The stores are fed by the controller's own watches
//! ([`crate::controller`]): nodes (all of them; a fleet's profile is the
//! nodes its selector matches), and the Deployments, Services and
//! PodDisruptionBudgets labelled as managed by the operator, each kept
//! without `managedFields` (and nodes without their image lists), which are
//! most of an object's bytes and are read by no reconcile. The owned
//! objects are kept as compact JSON ([`Stored`]), parsed when read.
//!
//! A store lags the API by a watch event: an object the cache has not seen
//! yet is read or applied through the API as before, and an object changed
//! behind the operator's back triggers a reconcile that finds the change in
//! the store. [`difference`] decides what "would change nothing" means.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{
    Node, Pod, PodCondition, PodSpec, PodStatus, Service, Toleration,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::autoscale::observe::{controller_uid, own_replica_sets};
use crate::names::{CORDONED_ANNOTATION, POD_DELETION_COST};
use crate::plan::{NodeFacts, nodes};
use crate::unmanaged::resource_as;

/// How long a reconcile waits for the stores' first lists after a start
/// (or a leader's takeover) before it reads through the API instead; a
/// stop ([`Cache::stop`]) ends the wait at once.
pub const READY_WAIT: Duration = Duration::from_secs(30);

/// The controller's stores.
#[derive(Clone)]
pub struct Cache {
    /// Every node (without managedFields and `status.images`).
    pub nodes: Store<Node>,
    /// The operator's Deployments (without managedFields).
    pub deployments: Store<Stored<Deployment>>,
    /// The operator's Services (without managedFields).
    pub services: Store<Stored<Service>>,
    /// The operator's PodDisruptionBudgets (without managedFields).
    pub pdbs: Store<Stored<PodDisruptionBudget>>,
    /// The fleets' shard pods and their ReplicaSets ([`Shards`]).
    pub shards: Shards,
    /// Cancelled when the controller stops (SIGTERM/SIGINT). The stores are
    /// fed by the controller's trigger streams, which a stopping controller
    /// no longer polls: a reconcile still waiting for their first lists
    /// would otherwise hold the exit for the whole [`READY_WAIT`].
    pub stop: CancellationToken,
    /// The node profiles the nodes store gives, per placement
    /// ([`Cache::node_profile`]).
    pub profiles: Profiles,
    /// Resolves (`true`) once every store has had its first list
    /// ([`Cache::ready`]).
    listed: Shared<BoxFuture<'static, bool>>,
}

/// The pods carrying the fleet label and the ReplicaSets' metadata, for the
/// metrics loop: each sync of an autoscaled fleet listed its pods, its
/// Deployment's metadata and its ReplicaSets' (three requests a sync, 150 a
/// second at 1,000 fleets on a 20 s sync) and now reads them here
/// ([`Cache::fleet_pods`]). A pod is kept as a [`KeptPod`], a ReplicaSet
/// with only its name, uid and owner references.
#[derive(Clone)]
pub struct Shards {
    /// Pods labelled with the fleet label (anyone's: ownership is checked
    /// when read).
    pub pods: Store<KeptPod>,
    /// Metadata of the ReplicaSets labelled with the fleet label.
    pub replica_sets: Store<PartialObjectMeta<ReplicaSet>>,
}

/// A shard pod as the metrics loop's store keeps it: what the loop reads
/// (`autoscale::observe::ShardPod`, the drift check's node, the ownership
/// check), taken from the watch's JSON as it is parsed. serde skips every
/// other field without building it: the containers, `managedFields`, the
/// labels, the other conditions and the container statuses, most of a
/// pod's 4.5 kB of JSON. Kept, a shard pod takes 1.2 kB of heap, against
/// 24.9 kB as a k8s-openapi `Pod` without managedFields
/// (`tests/store_heap.rs`, 2026-12-06).
///
/// The metadata kept: name, namespace, uid, resourceVersion (the store's
/// keys), owner references, deletion time, and of the annotations only the
/// scale-in mark and the rollout's cordon record ([`POD_DELETION_COST`],
/// [`CORDONED_ANNOTATION`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeptPod {
    metadata: ObjectMeta,
    node_name: Option<String>,
    phase: Option<String>,
    pod_ip: Option<String>,
    ready: Option<PodCondition>,
}

impl KeptPod {
    /// The pod with what was kept of it (an `autoscale::observe` reader
    /// takes a `Pod`): `spec.nodeName`, `status.phase`, `status.podIP` and
    /// the `Ready` condition.
    pub fn pod(&self) -> Pod {
        Pod {
            metadata: self.metadata.clone(),
            spec: Some(PodSpec {
                node_name: self.node_name.clone(),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: self.phase.clone(),
                pod_ip: self.pod_ip.clone(),
                conditions: self.ready.clone().map(|c| vec![c]),
                ..PodStatus::default()
            }),
        }
    }
}

impl<'de> serde::Deserialize<'de> for KeptPod {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
        use std::collections::BTreeMap;
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Meta {
            name: Option<String>,
            namespace: Option<String>,
            uid: Option<String>,
            resource_version: Option<String>,
            owner_references: Option<Vec<OwnerReference>>,
            deletion_timestamp: Option<Time>,
            annotations: Option<BTreeMap<String, String>>,
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Spec {
            node_name: Option<String>,
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Status {
            phase: Option<String>,
            #[serde(rename = "podIP")]
            pod_ip: Option<String>,
            conditions: Option<Vec<PodCondition>>,
        }
        #[derive(serde::Deserialize)]
        struct Wire {
            metadata: Meta,
            spec: Option<Spec>,
            status: Option<Status>,
        }
        let w = Wire::deserialize(d)?;
        let annotations: BTreeMap<String, String> = (w.metadata.annotations.into_iter())
            .flatten()
            .filter(|(k, _)| k == POD_DELETION_COST || k == CORDONED_ANNOTATION)
            .collect();
        let (phase, pod_ip, conditions) = match w.status {
            Some(s) => (s.phase, s.pod_ip, s.conditions),
            None => (None, None, None),
        };
        Ok(KeptPod {
            metadata: ObjectMeta {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                uid: w.metadata.uid,
                resource_version: w.metadata.resource_version,
                owner_references: w.metadata.owner_references,
                deletion_timestamp: w.metadata.deletion_timestamp,
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..ObjectMeta::default()
            },
            node_name: w.spec.and_then(|s| s.node_name),
            phase,
            pod_ip,
            ready: conditions
                .into_iter()
                .flatten()
                .find(|c| c.type_ == "Ready"),
        })
    }
}

resource_as!([] KeptPod => Pod, |o| &o.metadata, &mut o.metadata);

/// The node profile ([`nodes::observed`]) each placement (node selector
/// and tolerations) was last given, and the node store's epoch it was
/// computed at. Working it out reads every node's labels, taints and
/// allocatable (three quantities parsed a node): with 500 nodes it was the
/// largest share of a reconcile's CPU in `make bench-scale` (`perf`,
/// 2026-12-03). The controller bumps the epoch after the store takes a
/// change a profile is made of ([`Profiles::changed`]: a node's labels or
/// allocatable, a node deleted, a relist), never on the heartbeats.
#[derive(Clone, Default)]
pub struct Profiles {
    epoch: Arc<AtomicU64>,
    given: Arc<Mutex<HashMap<String, Given>>>,
}

/// A placement's profile and the node store's epoch it was worked out at.
type Given = (u64, Option<NodeFacts>);

/// Placements remembered at most; past it the memory starts again (a
/// cluster's fleets share a handful of placements).
const MAX_PLACEMENTS: usize = 1024;

impl Profiles {
    /// The nodes store took a change a profile is made of: every profile
    /// given before is worked out again.
    pub fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}

impl Cache {
    /// The node profile of a fleet whose pods select nodes by
    /// `node_selector` and tolerate `tolerations`: the smallest node they
    /// can land on ([`nodes::placeable`], [`nodes::observed`]), worked out
    /// from the nodes store once per change of it ([`Profiles`]).
    pub fn node_profile(
        &self,
        node_selector: &std::collections::BTreeMap<String, String>,
        tolerations: &[Toleration],
    ) -> Option<NodeFacts> {
        let key = serde_json::to_string(&(node_selector, tolerations))
            .expect("labels and tolerations serialize");
        // Read before the store: a change that lands while the profile is
        // worked out bumps the epoch past the one it is kept under.
        let epoch = self.profiles.epoch.load(Ordering::SeqCst);
        if let Some((at, facts)) = self.profiles.given.lock().unwrap().get(&key)
            && *at == epoch
        {
            return *facts;
        }
        let matching = self.nodes.state_filter(|n| {
            let labels = kube::ResourceExt::labels(n);
            node_selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        });
        let facts = nodes::observed(&nodes::placeable(&matching, tolerations));
        let mut given = self.profiles.given.lock().unwrap();
        if given.len() >= MAX_PLACEMENTS {
            given.clear();
        }
        given.insert(key, (epoch, facts));
        facts
    }

    /// The stores, not yet listed, cancelled by `stop`.
    pub fn new(
        nodes: Store<Node>,
        deployments: Store<Stored<Deployment>>,
        services: Store<Stored<Service>>,
        pdbs: Store<Stored<PodDisruptionBudget>>,
        shards: Shards,
        stop: CancellationToken,
    ) -> Cache {
        let listed = {
            let (n, d, s, p) = (
                nodes.clone(),
                deployments.clone(),
                services.clone(),
                pdbs.clone(),
            );
            let (pods, sets) = (shards.pods.clone(), shards.replica_sets.clone());
            async move {
                n.wait_until_ready().await.is_ok()
                    && d.wait_until_ready().await.is_ok()
                    && s.wait_until_ready().await.is_ok()
                    && p.wait_until_ready().await.is_ok()
                    && pods.wait_until_ready().await.is_ok()
                    && sets.wait_until_ready().await.is_ok()
            }
            .boxed()
            .shared()
        };
        Cache {
            nodes,
            deployments,
            services,
            pdbs,
            shards,
            stop,
            profiles: Profiles::default(),
            listed,
        }
    }

    /// The pods of fleet `ns`/`fleet` (uid `fleet_uid`) as the watches hold
    /// them: those whose controller is a ReplicaSet of the Deployment it
    /// controls ([`own_replica_sets`], the rule of [`own_pods`]), each as
    /// kept (see [`Shards`]). Empty when the Deployment is not in the store
    /// yet. Reads the stores' metadata in place; only the fleet's own pods
    /// are copied out.
    ///
    /// [`own_pods`]: crate::autoscale::observe::own_pods
    pub fn fleet_pods(&self, ns: &str, fleet: &str, fleet_uid: &str) -> Vec<Pod> {
        let Some(deployment) = self.deployments.get(&ObjectRef::new(fleet).within(ns)) else {
            return Vec::new();
        };
        let in_ns = |m: &ObjectMeta| m.namespace.as_deref() == Some(ns);
        let sets = self.shards.replica_sets.state();
        let own = own_replica_sets(
            Some(&deployment.metadata),
            fleet_uid,
            sets.iter().map(|rs| &rs.metadata).filter(|m| in_ns(m)),
        );
        if own.is_empty() {
            return Vec::new();
        }
        (self.shards.pods.state().iter())
            .filter(|p| in_ns(&p.metadata))
            .filter(|p| controller_uid(&p.metadata).is_some_and(|u| own.contains(u)))
            .map(|p| p.pod())
            .collect()
    }

    /// Waits (at most [`READY_WAIT`], and not past [`Cache::stop`]) until
    /// every store has had its first list; `false` if one has not (the
    /// reconcile then reads through the API).
    ///
    /// Every reconcile waits on one shared future, not on the stores
    /// themselves: a store's `wait_until_ready` wakes only the last task
    /// that polled it (kube-runtime 5's `DelayedInit` polls a oneshot
    /// receiver, which keeps one waker). With 128 reconciles started before
    /// the owned objects' lists came in, all but one waited the whole
    /// [`READY_WAIT`]: a restarted operator took 32 s, not 2 s, to
    /// reconcile 300 fleets (2026-12-04, `make bench-scale`).
    pub async fn ready(&self) -> bool {
        tokio::select! {
            ready = tokio::time::timeout(READY_WAIT, self.listed.clone()) => ready.unwrap_or(false),
            () = self.stop.cancelled() => false,
        }
    }
}

/// An object as an owned-object store keeps it: the metadata the store
/// is keyed by (name, namespace, uid, resourceVersion) and its owner
/// references ([`metadata`]: the ownership check reads them unparsed), and
/// the whole object as compact JSON, parsed when a reconcile reads it. k8s-openapi's typed
/// objects are several times their JSON in memory: a rendered Deployment
/// took 24.6 kB as a `Deployment` for 4.4 kB of JSON
/// (`tests/store_heap.rs`, 2026-12-03), three quarters of the stores' heap
/// at 1,000 fleets.
pub struct Stored<K> {
    metadata: ObjectMeta,
    json: Box<str>,
    kind: PhantomData<fn() -> K>,
}

// By hand: derived, they would ask `K: Clone` / `K: Debug` of a marker.
impl<K> Clone for Stored<K> {
    fn clone(&self) -> Self {
        Stored {
            metadata: self.metadata.clone(),
            json: self.json.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for Stored<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stored")
            .field("metadata", &self.metadata)
            .field("json_bytes", &self.json.len())
            .finish()
    }
}

impl<K: Resource + Serialize> Stored<K> {
    /// `o` as a store keeps it.
    pub fn new(o: &K) -> Stored<K> {
        let m = o.meta();
        Stored {
            metadata: ObjectMeta {
                name: m.name.clone(),
                namespace: m.namespace.clone(),
                uid: m.uid.clone(),
                resource_version: m.resource_version.clone(),
                owner_references: m.owner_references.clone(),
                ..ObjectMeta::default()
            },
            // Serializing a k8s-openapi object into a String cannot fail.
            json: serde_json::to_string(o).unwrap_or_default().into(),
            kind: PhantomData,
        }
    }

    /// The object as JSON.
    pub fn value(&self) -> Option<Value> {
        serde_json::from_str(&self.json).ok()
    }

    /// The object (`None` only if the JSON does not read as `K`).
    pub fn object(&self) -> Option<K>
    where
        K: DeserializeOwned,
    {
        serde_json::from_str(&self.json).ok()
    }
}

resource_as!([K: Resource<DynamicType = ()>] Stored<K> => K, |o| &o.metadata, &mut o.metadata);

/// A watch event of `K` as its [`Stored`] form, for a store's writer.
pub fn stored_event<K: Resource + Serialize>(e: &watcher::Event<K>) -> watcher::Event<Stored<K>> {
    use watcher::Event;
    match e {
        Event::Apply(o) => Event::Apply(Stored::new(o)),
        Event::Delete(o) => Event::Delete(Stored::new(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(Stored::new(o)),
        Event::InitDone => Event::InitDone,
    }
}

/// The object `ns`/`name` in `store`, if the watch has seen it.
pub fn get<K>(store: &Store<Stored<K>>, ns: &str, name: &str) -> Option<K>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + 'static,
{
    store.get(&ObjectRef::new(name).within(ns))?.object()
}

/// The kept metadata of `ns`/`name` in `store` ([`Stored`]: name,
/// namespace, uid, resourceVersion, owner references), if the watch has
/// seen it; the object is not parsed.
pub fn metadata<K>(store: &Store<Stored<K>>, ns: &str, name: &str) -> Option<ObjectMeta>
where
    K: Resource<DynamicType = ()> + 'static,
{
    Some(
        store
            .get(&ObjectRef::new(name).within(ns))?
            .metadata
            .clone(),
    )
}

/// The stored object when it already holds everything `want` sets
/// ([`difference`] finds nothing): applying `want` would change nothing.
pub fn unchanged<K>(store: &Store<Stored<K>>, ns: &str, want: &K) -> Option<K>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + 'static,
{
    let name = want.meta().name.as_deref()?;
    let live = store.get(&ObjectRef::new(name).within(ns))?.value()?;
    let want_value = serde_json::to_value(want).ok()?;
    match difference(&live, &want_value, "") {
        None => serde_json::from_value(live).ok(),
        Some(path) => {
            tracing::debug!(kind = %K::kind(&()), %name, %path, "stored object differs: apply");
            None
        }
    }
}

/// The first path under `.spec.template` where the `live` Deployment does
/// not hold what `want` sets ([`difference`]): applying `want` would roll
/// the Deployment to a new revision. `None` when the template would stay
/// (a quantity the API server rewrote counts as a change, as for
/// [`unchanged`]: at worst a template held back for nothing until a drain
/// ends).
pub fn template_change(live: &Deployment, want: &Deployment) -> Option<String> {
    let template = |d: &Deployment| {
        d.spec
            .as_ref()
            .map(|s| serde_json::to_value(&s.template).unwrap_or(Value::Null))
            .unwrap_or(Value::Null)
    };
    difference(&template(live), &template(want), ".spec.template")
}

/// The first path (`.spec.replicas`, `.spec.template.spec.containers[0]`)
/// where `live` does not hold what `want` sets; `None` when it holds all of
/// it. `want` is a server-side apply body: every field it sets must be in
/// `live` with the same value; fields only `live` has (defaults, status,
/// other managers' fields) do not count; a field `want` sets to null, `[]`
/// or `{}` matches one `live` leaves out (the API server drops empty
/// values). Lists must have the same length and match element by element:
/// a list another manager added to (a webhook's sidecar) is applied again,
/// which the apply leaves as it is. Values compare exactly, so a quantity
/// the API server rewrites (`1000m` → `1`) counts as a difference and the
/// object is applied: never a skipped change, at worst an apply for
/// nothing.
pub fn difference(live: &Value, want: &Value, path: &str) -> Option<String> {
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    };
    match (live, want) {
        (_, Value::Null) => None,
        (Value::Object(l), Value::Object(w)) => w.iter().find_map(|(k, wv)| {
            let at = format!("{path}.{k}");
            match l.get(k) {
                Some(lv) => difference(lv, wv, &at),
                None => (!empty(wv)).then_some(at),
            }
        }),
        (Value::Array(l), Value::Array(w)) if l.len() == w.len() => l
            .iter()
            .zip(w)
            .enumerate()
            .find_map(|(i, (lv, wv))| difference(lv, wv, &format!("{path}[{i}]"))),
        (Value::Null, w) if empty(w) => None,
        (l, w) if l == w => None,
        _ => Some(if path.is_empty() {
            ".".into()
        } else {
            path.into()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::FLEET_LABEL;
    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher;
    use serde_json::json;
    use std::collections::BTreeMap;
    use tokio::time::Instant;

    /// A cache whose stores have had no list yet, with their writers (a
    /// dropped writer ends the wait with an error, not a list).
    #[allow(clippy::type_complexity)]
    fn unlisted() -> (
        Cache,
        (
            Writer<Node>,
            Writer<Stored<Deployment>>,
            Writer<Stored<Service>>,
            Writer<Stored<PodDisruptionBudget>>,
            Writer<KeptPod>,
            Writer<PartialObjectMeta<ReplicaSet>>,
        ),
    ) {
        let (nodes, n) = reflector::store();
        let (deployments, d) = reflector::store();
        let (services, s) = reflector::store();
        let (pdbs, p) = reflector::store();
        let (pods, pw) = reflector::store();
        let (replica_sets, rw) = reflector::store();
        let shards = Shards { pods, replica_sets };
        let cache = Cache::new(
            nodes,
            deployments,
            services,
            pdbs,
            shards,
            CancellationToken::new(),
        );
        (cache, (n, d, s, p, pw, rw))
    }

    fn node(name: &str, memory: &str, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"memory": memory, "cpu": "64", "pods": "110"}}
        }))
        .unwrap()
    }

    /// A placement's profile is worked out once per change of the node
    /// store: a node added behind the epoch's back is not seen until
    /// [`Profiles::changed`], then is. Each placement has its own.
    #[test]
    fn a_profile_is_worked_out_again_only_after_the_nodes_change() {
        let (cache, (mut nodes, ..)) = unlisted();
        let big = node("big", "256Gi", json!({"pool": "a"}));
        nodes.apply_watcher_event(&watcher::Event::Apply(big));
        let any = BTreeMap::new();
        let pool_b = BTreeMap::from([("pool".to_string(), "b".to_string())]);
        let memory =
            |sel: &BTreeMap<String, String>| cache.node_profile(sel, &[]).map(|f| f.memory_bytes);
        assert_eq!(memory(&any), Some(256 << 30));
        assert_eq!(memory(&pool_b), None);
        let small = node("small", "64Gi", json!({"pool": "b"}));
        nodes.apply_watcher_event(&watcher::Event::Apply(small));
        // Kept: the controller has not said the store changed.
        assert_eq!(memory(&any), Some(256 << 30));
        assert_eq!(memory(&pool_b), None);
        cache.profiles.changed();
        assert_eq!(memory(&any), Some(64 << 30));
        assert_eq!(memory(&pool_b), Some(64 << 30));
    }

    // The clock is tokio's paused one: elapsed times are exact, not measured.

    #[tokio::test(start_paused = true)]
    async fn a_stop_ends_the_wait_for_stores_that_never_list() {
        let (cache, _writers) = unlisted();
        let stop = cache.stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.cancel();
        });
        let start = Instant::now();
        assert!(!cache.ready().await);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        // Once stopped, a later reconcile does not wait at all.
        let start = Instant::now();
        assert!(!cache.ready().await);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_stop_the_wait_is_bounded_and_a_full_list_ends_it() {
        let (cache, mut writers) = unlisted();
        let start = Instant::now();
        assert!(!cache.ready().await);
        assert_eq!(start.elapsed(), READY_WAIT);
        writers.0.apply_watcher_event(&watcher::Event::InitDone);
        writers.1.apply_watcher_event(&watcher::Event::InitDone);
        writers.2.apply_watcher_event(&watcher::Event::InitDone);
        let start = Instant::now();
        assert!(!cache.ready().await, "one store still unlisted");
        assert_eq!(start.elapsed(), READY_WAIT);
        writers.3.apply_watcher_event(&watcher::Event::InitDone);
        writers.4.apply_watcher_event(&watcher::Event::InitDone);
        let start = Instant::now();
        assert!(!cache.ready().await, "the ReplicaSets still unlisted");
        assert_eq!(start.elapsed(), READY_WAIT);
        writers.5.apply_watcher_event(&watcher::Event::InitDone);
        let start = Instant::now();
        assert!(cache.ready().await);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    /// Every reconcile waiting for the first lists is woken when they come
    /// in, not only the last one to wait (which is all a store's own
    /// readiness wakes).
    #[tokio::test(start_paused = true)]
    async fn every_reconcile_waiting_for_the_lists_is_woken() {
        let (cache, mut writers) = unlisted();
        let start = Instant::now();
        let waiting: Vec<_> = (0..128)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move { cache.ready().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        writers.0.apply_watcher_event(&watcher::Event::InitDone);
        writers.1.apply_watcher_event(&watcher::Event::InitDone);
        writers.2.apply_watcher_event(&watcher::Event::InitDone);
        writers.3.apply_watcher_event(&watcher::Event::InitDone);
        writers.4.apply_watcher_event(&watcher::Event::InitDone);
        writers.5.apply_watcher_event(&watcher::Event::InitDone);
        for w in waiting {
            assert!(w.await.unwrap());
        }
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    /// The metrics loop's pods from the stores: only those whose
    /// ReplicaSet the fleet's own Deployment controls, in its namespace,
    /// each with what the loop reads of it.
    #[test]
    fn a_fleet_s_pods_are_those_of_its_own_deployment_s_replica_sets() {
        let (cache, (_, mut deployments, _, _, mut pods, mut sets)) = unlisted();
        let owner = |uid: &str| {
            json!([{"apiVersion": "v1", "kind": "X", "name": "x",
                                        "uid": uid, "controller": true}])
        };
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "edge", "namespace": "team-a", "uid": "dep-1",
                         "ownerReferences": owner("fleet-1")},
        }))
        .unwrap();
        deployments.apply_watcher_event(&watcher::Event::Apply(Stored::new(&deployment)));
        for (ns, name, uid, controller) in [
            ("team-a", "edge-1", "rs-1", "dep-1"),
            // Someone else's ReplicaSet, labelled as the fleet's.
            ("team-a", "edge-2", "rs-2", "dep-other"),
            // The same Deployment uid in another namespace cannot be ours.
            ("team-b", "edge-1", "rs-3", "dep-1"),
        ] {
            let mut rs: PartialObjectMeta<ReplicaSet> = serde_json::from_value(json!({
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": name, "namespace": ns, "uid": uid,
                             "ownerReferences": owner(controller)},
            }))
            .unwrap();
            crate::controller::lean_owned(&mut rs);
            sets.apply_watcher_event(&watcher::Event::Apply(rs));
        }
        for (ns, name, rs) in [
            ("team-a", "edge-1-a", "rs-1"),
            ("team-a", "edge-2-a", "rs-2"),
            ("team-b", "edge-1-b", "rs-3"),
        ] {
            let pod: KeptPod = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": ns, "uid": format!("{name}-uid"),
                             "labels": {FLEET_LABEL: "edge"},
                             "annotations": {"a": "1", CORDONED_ANNOTATION: "12"},
                             "managedFields": [{"manager": "kubelet", "operation": "Update"}],
                             "ownerReferences": owner(rs)},
                "spec": {"nodeName": "n1", "containers": [{"name": "server", "image": "i"}]},
                "status": {"phase": "Running", "podIP": "10.0.0.9",
                           "hostIP": "10.0.0.2",
                           "conditions": [{"type": "Ready", "status": "True"},
                                          {"type": "PodScheduled", "status": "True"}]},
            }))
            .unwrap();
            pods.apply_watcher_event(&watcher::Event::Apply(pod));
        }
        let found = cache.fleet_pods("team-a", "edge", "fleet-1");
        assert_eq!(found.len(), 1, "{found:#?}");
        let pod = &found[0];
        assert_eq!(pod.metadata.name.as_deref(), Some("edge-1-a"));
        // Of the annotations, only the mark and the record the loop reads.
        let annotations = pod.metadata.annotations.clone().unwrap();
        assert_eq!(
            annotations,
            BTreeMap::from([(CORDONED_ANNOTATION.to_string(), "12".to_string())])
        );
        assert_eq!(pod.metadata.labels, None);
        assert_eq!(pod.metadata.managed_fields, None);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(spec.containers.is_empty());
        let status = pod.status.as_ref().unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.9"));
        assert_eq!(status.host_ip, None);
        let conditions: Vec<_> = status
            .conditions
            .iter()
            .flatten()
            .map(|c| &c.type_)
            .collect();
        assert_eq!(conditions, ["Ready"]);
        // Another fleet's uid owns nothing here; an unknown fleet has no
        // Deployment.
        assert!(cache.fleet_pods("team-a", "edge", "fleet-2").is_empty());
        assert!(cache.fleet_pods("team-a", "other", "fleet-1").is_empty());
    }

    /// A kept object reads back whole, and its owner references read
    /// without it.
    #[test]
    fn a_stored_object_keeps_its_owner_unparsed_and_reads_back_whole() {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "edge", "namespace": "team-a", "uid": "d-1",
                         "resourceVersion": "7", "labels": {"a": "1"},
                         "ownerReferences": [{"apiVersion": "c10m.dev/v1alpha1",
                             "kind": "ConnectionFleet", "name": "edge", "uid": "f-1",
                             "controller": true}]},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"a": "1"}},
                     "template": {"spec": {"containers": [{"name": "s", "image": "i"}]}}},
            "status": {"readyReplicas": 2}
        }))
        .unwrap();
        let (store, mut writer) = reflector::store::<Stored<Deployment>>();
        writer.apply_watcher_event(&stored_event(&watcher::Event::Apply(d.clone())));
        let meta = metadata(&store, "team-a", "edge").unwrap();
        assert_eq!(meta.owner_references, d.metadata.owner_references);
        assert_eq!(meta.uid.as_deref(), Some("d-1"));
        assert_eq!(
            meta.labels, None,
            "only what the store and the owner check read"
        );
        assert_eq!(get(&store, "team-a", "edge"), Some(d));
        assert_eq!(metadata(&store, "team-b", "edge"), None);
    }

    #[test]
    fn what_the_api_server_adds_is_no_difference() {
        let want = json!({"metadata": {"name": "f", "labels": {"a": "1"}},
                          "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "s", "args": []}]}}}});
        let live = json!({"metadata": {"name": "f", "labels": {"a": "1"}, "resourceVersion": "7",
                                       "annotations": {"deployment.kubernetes.io/revision": "1"}},
                          "spec": {"replicas": 2, "revisionHistoryLimit": 10,
                                   "template": {"spec": {"containers": [{"name": "s", "imagePullPolicy": "IfNotPresent"}]}}},
                          "status": {"replicas": 2}});
        assert_eq!(difference(&live, &want, ""), None);
    }

    #[test]
    fn a_changed_missing_or_extra_value_is_a_difference_named_by_its_path() {
        let want = json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "s", "image": "b"}]}}}});
        let live = json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "s", "image": "a"}]}}}});
        assert_eq!(
            difference(&live, &want, "").as_deref(),
            Some(".spec.template.spec.containers[0].image")
        );
        let live = json!({"spec": {"replicas": 2}});
        assert_eq!(
            difference(&live, &want, "").as_deref(),
            Some(".spec.replicas")
        );
        let live = json!({"spec": {"replicas": 3}});
        assert_eq!(
            difference(&live, &want, "").as_deref(),
            Some(".spec.template")
        );
        // A sidecar another manager added: the lists differ in length.
        let live = json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [
            {"name": "s", "image": "b"}, {"name": "proxy"}]}}}});
        assert_eq!(
            difference(&live, &want, "").as_deref(),
            Some(".spec.template.spec.containers")
        );
        // A quantity the API server rewrote compares as a difference.
        assert_eq!(
            difference(&json!({"cpu": "1"}), &json!({"cpu": "1000m"}), "").as_deref(),
            Some(".cpu")
        );
        assert_eq!(difference(&json!(1), &json!(2), "").as_deref(), Some("."));
    }

    /// A rollout holds back a template change, not a change of replicas.
    #[test]
    fn only_a_pod_template_change_is_a_template_change() {
        let d = |replicas: i32, image: &str| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "f", "generation": 3},
                "spec": {"replicas": replicas, "selector": {},
                         "template": {"spec": {"containers": [
                             {"name": "server", "image": image,
                              "terminationMessagePath": "/dev/termination-log"}]}}}
            }))
            .unwrap()
        };
        let want = |replicas: i32, image: &str| -> Deployment {
            let mut w = d(replicas, image);
            let c = &mut w
                .spec
                .as_mut()
                .unwrap()
                .template
                .spec
                .as_mut()
                .unwrap()
                .containers[0];
            c.termination_message_path = None;
            w
        };
        let live = d(3, "c10m.local/server:1");
        assert_eq!(
            template_change(&live, &want(3, "c10m.local/server:1")),
            None
        );
        assert_eq!(
            template_change(&live, &want(5, "c10m.local/server:1")),
            None
        );
        assert_eq!(
            template_change(&live, &want(3, "c10m.local/server:2")).as_deref(),
            Some(".spec.template.spec.containers[0].image")
        );
    }
}
