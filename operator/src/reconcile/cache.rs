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
//! objects are kept as LZ4-packed compact JSON ([`Stored`]), unpacked and
//! parsed when read.
//!
//! A store lags the API by a watch event: an object the cache has not seen
//! yet is read or applied through the API as before, and an object changed
//! behind the operator's back triggers a reconcile that finds the change in
//! the store. [`difference`] decides what "would change nothing" means.

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared};
use k8s_openapi::api::apps::v1::{
    Deployment, ReplicaSet, ReplicaSetCondition, ReplicaSetSpec, ReplicaSetStatus,
};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateWaiting, ContainerStatus, Node, Pod, PodCondition, PodSpec,
    PodStatus, Service, Toleration,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::autoscale::observe::{controller_uid, own_replica_sets};
use crate::names::{
    CORDONED_ANNOTATION, POD_DELETION_COST, POD_TEMPLATE_HASH, REVISION_ANNOTATION,
};
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

/// The pods and ReplicaSets carrying the fleet label, for the metrics
/// loop and a reconcile's workload. Each sync of an autoscaled fleet
/// listed its pods, its Deployment's metadata and its ReplicaSets' (three
/// requests a sync, 150 a second at 1,000 fleets on a 20 s sync) and now
/// reads them here ([`Cache::fleet_pods`]); a reconcile of a fleet whose
/// shards are not all ready listed its ReplicaSets and pods (5,300 of the
/// ramp's 9,374 reads at 1,000 fleets, 2026-12-07) and, outside a rollout,
/// reads them here too ([`Cache::workload`]). A pod is kept as a
/// [`KeptPod`], a ReplicaSet as a [`KeptReplicaSet`].
#[derive(Clone)]
pub struct Shards {
    /// Pods labelled with the fleet label (anyone's: ownership is checked
    /// when read).
    pub pods: Store<KeptPod>,
    /// ReplicaSets labelled with the fleet label.
    pub replica_sets: Store<KeptReplicaSet>,
}

/// A shard pod as the stores keep it: what the metrics loop reads
/// (`autoscale::observe::ShardPod`, the drift check's node, the ownership
/// check) and what a reconcile's workload reads
/// ([`crate::status::workload_failure`], [`crate::rollout::observe`]),
/// taken from the watch's JSON as it is parsed. serde skips every other
/// field without building it: the containers, `managedFields`, the other
/// labels and conditions and the running containers' statuses, most of a
/// pod's 4.5 kB of JSON. Kept, a running shard pod takes 1.4 kB of heap
/// (2.80 MB for 2,000, 2026-12-07), against 24.9 kB as a k8s-openapi `Pod`
/// without managedFields (`tests/store_heap.rs`).
///
/// The metadata kept: name, namespace, uid, resourceVersion (the store's
/// keys), owner references, deletion time, of the labels only the
/// pod-template hash (the revision it runs), and of the annotations only
/// the scale-in mark and the rollout's cordon record
/// ([`POD_DELETION_COST`], [`CORDONED_ANNOTATION`]). Of the status: the
/// phase, the pod IP, the `Ready` condition, the `PodScheduled` condition
/// while it is False (an unschedulable shard), and the containers
/// (init containers first) that are waiting, with their image and why (an
/// image that cannot be pulled).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeptPod {
    metadata: ObjectMeta,
    template_hash: Option<String>,
    node_name: Option<String>,
    phase: Option<String>,
    pod_ip: Option<String>,
    ready: Option<PodCondition>,
    unscheduled: Option<PodCondition>,
    waiting: Box<[ContainerStatus]>,
}

impl KeptPod {
    /// The pod with what was kept of it (the readers take a `Pod`):
    /// `spec.nodeName`, `status.phase`, `status.podIP`, the conditions
    /// kept, and the waiting containers as `status.containerStatuses`.
    pub fn pod(&self) -> Pod {
        Pod {
            metadata: ObjectMeta {
                labels: template_hash_label(&self.template_hash),
                ..self.metadata.clone()
            },
            spec: Some(PodSpec {
                node_name: self.node_name.clone(),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: self.phase.clone(),
                pod_ip: self.pod_ip.clone(),
                conditions: Some(
                    self.ready
                        .iter()
                        .chain(&self.unscheduled)
                        .cloned()
                        .collect(),
                )
                .filter(|c: &Vec<PodCondition>| !c.is_empty()),
                container_statuses: (!self.waiting.is_empty()).then(|| self.waiting.to_vec()),
                ..PodStatus::default()
            }),
        }
    }
}

/// The labels of a kept object: its pod-template hash, if it has one. Kept
/// apart from the metadata as a plain string: a map of one entry takes a
/// whole B-tree node (about 0.5 kB), as much again as the rest of a kept
/// pod.
fn template_hash_label(
    hash: &Option<String>,
) -> Option<std::collections::BTreeMap<String, String>> {
    hash.clone()
        .map(|h| std::collections::BTreeMap::from([(POD_TEMPLATE_HASH.to_string(), h)]))
}

/// Of `map`, the entries named in `keep`; `None` when none is there.
fn only(
    map: Option<std::collections::BTreeMap<String, String>>,
    keep: &[&str],
) -> Option<std::collections::BTreeMap<String, String>> {
    let kept: std::collections::BTreeMap<String, String> = map
        .into_iter()
        .flatten()
        .filter(|(k, _)| keep.contains(&k.as_str()))
        .collect();
    (!kept.is_empty()).then_some(kept)
}

/// The metadata a kept pod or ReplicaSet is read with: its keys, owner
/// references, deletion time, labels and annotations; serde skips the rest
/// (`managedFields` among it) unbuilt.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    owner_references: Option<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>>,
    deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    labels: Option<std::collections::BTreeMap<String, String>>,
    annotations: Option<std::collections::BTreeMap<String, String>>,
}

impl WireMeta {
    /// The metadata kept (keys, owner references, deletion time and the
    /// annotations named; no labels), and the pod-template hash label.
    fn kept(self, annotations: &[&str]) -> (ObjectMeta, Option<String>) {
        let hash = self.labels.and_then(|mut l| l.remove(POD_TEMPLATE_HASH));
        let meta = ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            uid: self.uid,
            resource_version: self.resource_version,
            owner_references: self.owner_references,
            deletion_timestamp: self.deletion_timestamp,
            annotations: only(self.annotations, annotations),
            ..ObjectMeta::default()
        };
        (meta, hash)
    }
}

impl<'de> serde::Deserialize<'de> for KeptPod {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Spec {
            node_name: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct State {
            waiting: Option<ContainerStateWaiting>,
        }
        #[derive(serde::Deserialize)]
        struct Container {
            name: String,
            #[serde(default)]
            image: String,
            state: Option<State>,
        }
        #[derive(Default, serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Status {
            phase: Option<String>,
            #[serde(rename = "podIP")]
            pod_ip: Option<String>,
            conditions: Option<Vec<PodCondition>>,
            init_container_statuses: Option<Vec<Container>>,
            container_statuses: Option<Vec<Container>>,
        }
        #[derive(serde::Deserialize)]
        struct Wire {
            metadata: WireMeta,
            spec: Option<Spec>,
            status: Option<Status>,
        }
        let w = Wire::deserialize(d)?;
        let Status {
            phase,
            pod_ip,
            conditions,
            init_container_statuses: init,
            container_statuses: containers,
        } = w.status.unwrap_or_default();
        let mut conditions = conditions.unwrap_or_default();
        let mut take = |f: &dyn Fn(&PodCondition) -> bool| {
            conditions
                .iter()
                .position(f)
                .map(|i| conditions.swap_remove(i))
        };
        let ready = take(&|c| c.type_ == "Ready");
        let unscheduled = take(&|c| c.type_ == "PodScheduled" && c.status == "False");
        let waiting = (init.into_iter().flatten())
            .chain(containers.into_iter().flatten())
            .filter_map(|c| {
                let waiting = c.state?.waiting?;
                Some(ContainerStatus {
                    name: c.name,
                    image: c.image,
                    state: Some(ContainerState {
                        waiting: Some(waiting),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                })
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        let (metadata, template_hash) = w.metadata.kept(&[POD_DELETION_COST, CORDONED_ANNOTATION]);
        Ok(KeptPod {
            metadata,
            template_hash,
            node_name: w.spec.and_then(|s| s.node_name),
            phase,
            pod_ip,
            ready,
            unscheduled,
            waiting,
        })
    }
}

/// A ReplicaSet as the stores keep it: what the ownership check, the
/// rollout ([`crate::rollout::observe`]) and a refusal
/// ([`crate::status::workload_failure`]) read, taken from the watch's JSON
/// as it is parsed: the metadata's keys and owner references, of the labels
/// the pod-template hash, of the annotations the Deployment's revision,
/// `spec.replicas`, `status.replicas` and a `ReplicaFailure` condition
/// that is True. The pod template, most of a ReplicaSet's JSON, is skipped
/// unbuilt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeptReplicaSet {
    metadata: ObjectMeta,
    template_hash: Option<String>,
    revision: Option<String>,
    replicas: Option<i32>,
    status_replicas: i32,
    failure: Option<ReplicaSetCondition>,
}

impl KeptReplicaSet {
    /// The ReplicaSet with what was kept of it (its selector empty).
    pub fn replica_set(&self) -> ReplicaSet {
        ReplicaSet {
            metadata: ObjectMeta {
                labels: template_hash_label(&self.template_hash),
                annotations: (self.revision.clone()).map(|r| {
                    std::collections::BTreeMap::from([(REVISION_ANNOTATION.to_string(), r)])
                }),
                ..self.metadata.clone()
            },
            spec: Some(ReplicaSetSpec {
                replicas: self.replicas,
                ..ReplicaSetSpec::default()
            }),
            status: Some(ReplicaSetStatus {
                replicas: self.status_replicas,
                conditions: self.failure.clone().map(|c| vec![c]),
                ..ReplicaSetStatus::default()
            }),
        }
    }
}

impl<'de> serde::Deserialize<'de> for KeptReplicaSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Spec {
            replicas: Option<i32>,
        }
        #[derive(serde::Deserialize)]
        struct Status {
            #[serde(default)]
            replicas: i32,
            conditions: Option<Vec<ReplicaSetCondition>>,
        }
        #[derive(serde::Deserialize)]
        struct Wire {
            metadata: WireMeta,
            spec: Option<Spec>,
            status: Option<Status>,
        }
        let mut w = Wire::deserialize(d)?;
        let revision =
            (w.metadata.annotations.as_mut()).and_then(|a| a.remove(REVISION_ANNOTATION));
        let (metadata, template_hash) = w.metadata.kept(&[]);
        let (status_replicas, conditions) = match w.status {
            Some(s) => (s.replicas, s.conditions),
            None => (0, None),
        };
        Ok(KeptReplicaSet {
            metadata,
            template_hash,
            revision,
            replicas: w.spec.and_then(|s| s.replicas),
            status_replicas,
            failure: (conditions.into_iter().flatten())
                .find(|c| c.type_ == "ReplicaFailure" && c.status == "True"),
        })
    }
}

resource_as!([] KeptReplicaSet => ReplicaSet, |o| &o.metadata, &mut o.metadata);
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
        self.owned(ns, &deployment.metadata, fleet_uid, true).1
    }

    /// The ReplicaSets in `ns` that `deployment` (fleet `fleet_uid`'s, as
    /// applied) controls and, with `pods`, their pods, as the watches hold them
    /// ([`KeptReplicaSet`], [`KeptPod`]), each in name order: what a
    /// reconcile's workload listed through the API (`observe::workload`).
    /// Empty while the watches have not seen them yet.
    pub fn workload(
        &self,
        ns: &str,
        deployment: &Deployment,
        fleet_uid: &str,
        pods: bool,
    ) -> (Vec<ReplicaSet>, Vec<Pod>) {
        let (sets, mut pods) = self.owned(ns, &deployment.metadata, fleet_uid, pods);
        let mut sets: Vec<ReplicaSet> = sets.iter().map(|rs| rs.replica_set()).collect();
        // In name order, as a list gives them.
        sets.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        (sets, pods)
    }

    /// The ReplicaSets in `ns` that the Deployment of metadata
    /// `deployment` controls (when fleet `fleet_uid` controls it) and,
    /// with `pods`, the pods they control, copied out of the stores.
    fn owned(
        &self,
        ns: &str,
        deployment: &ObjectMeta,
        fleet_uid: &str,
        pods: bool,
    ) -> (Vec<Arc<KeptReplicaSet>>, Vec<Pod>) {
        let in_ns = |m: &ObjectMeta| m.namespace.as_deref() == Some(ns);
        let sets = self.shards.replica_sets.state();
        let own = own_replica_sets(
            Some(deployment),
            fleet_uid,
            sets.iter().map(|rs| &rs.metadata).filter(|m| in_ns(m)),
        );
        if own.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let pods = match pods {
            true => (self.shards.pods.state().iter())
                .filter(|p| in_ns(&p.metadata))
                .filter(|p| controller_uid(&p.metadata).is_some_and(|u| own.contains(u)))
                .map(|p| p.pod())
                .collect(),
            false => Vec::new(),
        };
        let own_sets = (sets.iter())
            .filter(|rs| in_ns(&rs.metadata))
            .filter(|rs| (rs.metadata.uid.as_deref()).is_some_and(|u| own.contains(u)))
            .cloned()
            .collect();
        (own_sets, pods)
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
/// the whole object as compact JSON, LZ4-compressed against a dictionary
/// ([`dictionary`]), unpacked and parsed when a reconcile reads it.
/// k8s-openapi's typed objects are several times their JSON in memory: a
/// rendered Deployment took 24.6 kB as a `Deployment` for 4.4 kB of JSON
/// (`tests/store_heap.rs`, 2026-12-03), three quarters of the stores' heap
/// at 1,000 fleets. The objects one operator renders differ in a few
/// values (names, sizes, hashes), so against the first object of its kind
/// as a dictionary a Deployment's 4.4 kB of JSON packs into a few hundred
/// bytes (`tests/store_heap.rs` prints the figures).
pub struct Stored<K> {
    metadata: ObjectMeta,
    /// The JSON, LZ4 block format with its length in front.
    packed: Box<[u8]>,
    /// The dictionary `packed` was compressed against.
    dictionary: Arc<[u8]>,
    kind: PhantomData<fn() -> K>,
}

// By hand: derived, they would ask `K: Clone` / `K: Debug` of a marker.
impl<K> Clone for Stored<K> {
    fn clone(&self) -> Self {
        Stored {
            metadata: self.metadata.clone(),
            packed: self.packed.clone(),
            dictionary: self.dictionary.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for Stored<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stored")
            .field("metadata", &self.metadata)
            .field("packed_bytes", &self.packed.len())
            .finish()
    }
}

/// The dictionary `kind`'s [`Stored`] objects are compressed against:
/// the JSON of the first object of that kind this process stored (`json`,
/// when there is none yet). It is kept for the life of the process (one
/// fleet and one object of each kind it owns: 8.4 kB of JSON with
/// `store_heap.rs`'s objects); each [`Stored`] holds the one it was packed
/// with, so the choice never has to be made again.
fn dictionary(kind: &str, json: &[u8]) -> Arc<[u8]> {
    static DICTIONARIES: Mutex<BTreeMap<String, Arc<[u8]>>> = Mutex::new(BTreeMap::new());
    let mut all = DICTIONARIES.lock().unwrap();
    if let Some(d) = all.get(kind) {
        return d.clone();
    }
    let d: Arc<[u8]> = json.into();
    all.insert(kind.to_string(), d.clone());
    d
}

impl<K: Resource<DynamicType = ()> + Serialize> Stored<K> {
    /// `o` as a store keeps it.
    pub fn new(o: &K) -> Stored<K> {
        let m = o.meta();
        // Serializing a k8s-openapi object into a Vec cannot fail.
        let json = serde_json::to_vec(o).unwrap_or_default();
        let dictionary = dictionary(&K::kind(&()), &json);
        let packed = lz4_flex::block::compress_prepend_size_with_dict(&json, &dictionary);
        Stored {
            metadata: ObjectMeta {
                name: m.name.clone(),
                namespace: m.namespace.clone(),
                uid: m.uid.clone(),
                resource_version: m.resource_version.clone(),
                owner_references: m.owner_references.clone(),
                ..ObjectMeta::default()
            },
            packed: packed.into(),
            dictionary,
            kind: PhantomData,
        }
    }

    /// The object's JSON (`None` only if it does not unpack, which a
    /// block this process packed always does).
    fn json(&self) -> Option<Vec<u8>> {
        lz4_flex::block::decompress_size_prepended_with_dict(&self.packed, &self.dictionary).ok()
    }

    /// The object as JSON.
    pub fn value(&self) -> Option<Value> {
        serde_json::from_slice(&self.json()?).ok()
    }

    /// The object (`None` only if the JSON does not read as `K`).
    pub fn object(&self) -> Option<K>
    where
        K: DeserializeOwned,
    {
        serde_json::from_slice(&self.json()?).ok()
    }
}

/// A `K` read as JSON, kept (the controller's bound on what its store
/// keeps; the fleets' watch feeds it [`Stored::new`]).
impl<'de, K> serde::Deserialize<'de> for Stored<K>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned,
{
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(d).map(|o| Stored::new(&o))
    }
}

resource_as!([K: Resource<DynamicType = ()>] Stored<K> => K, |o| &o.metadata, &mut o.metadata);

/// A watch event of `K` as its [`Stored`] form, for a store's writer.
pub fn stored_event<K: Resource<DynamicType = ()> + Serialize>(
    e: &watcher::Event<K>,
) -> watcher::Event<Stored<K>> {
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
    differs(live, want).map(|below| match format!("{path}{below}") {
        at if at.is_empty() => ".".into(),
        at => at,
    })
}

/// [`difference`]'s walk: the path below `live` and `want` where they
/// differ (`""`: at them). It is built only on the way back from a
/// difference; building each field's path on the way down was 1.6 million
/// strings over `make bench-scale`'s ramp, nearly all for fields that
/// matched (dhat, 2026-12-07).
fn differs(live: &Value, want: &Value) -> Option<String> {
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    };
    match (live, want) {
        (_, Value::Null) => None,
        (Value::Object(l), Value::Object(w)) => w.iter().find_map(|(k, wv)| match l.get(k) {
            Some(lv) => differs(lv, wv).map(|below| format!(".{k}{below}")),
            None => (!empty(wv)).then(|| format!(".{k}")),
        }),
        (Value::Array(l), Value::Array(w)) if l.len() == w.len() => l
            .iter()
            .zip(w)
            .enumerate()
            .find_map(|(i, (lv, wv))| differs(lv, wv).map(|below| format!("[{i}]{below}"))),
        (Value::Null, w) if empty(w) => None,
        (l, w) if l == w => None,
        _ => Some(String::new()),
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
            Writer<KeptReplicaSet>,
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
            let rs: KeptReplicaSet = serde_json::from_value(json!({
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": name, "namespace": ns, "uid": uid,
                             "ownerReferences": owner(controller)},
            }))
            .unwrap();
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

    /// A reconcile reads the same failure and the same rollout from the
    /// kept objects ([`Cache::workload`]) as from the whole objects the API
    /// lists: a refused ReplicaSet, a pod whose init container cannot pull
    /// its image, an unschedulable pod, a cordoned old shard being deleted
    /// and a ready new one.
    #[test]
    fn the_workload_reads_the_same_from_the_kept_objects_as_from_the_listed_ones() {
        use crate::status::workload_failure;
        let (cache, (_, _, _, _, mut pods, mut sets)) = unlisted();
        let owner = |kind: &str, uid: &str| {
            json!([{"apiVersion": "apps/v1", "kind": kind, "name": "x",
                    "uid": uid, "controller": true}])
        };
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "edge", "namespace": "team-a", "uid": "dep-1",
                         "generation": 2, "ownerReferences": owner("ConnectionFleet", "fleet-1")},
            "spec": {"replicas": 3, "selector": {}, "template": {}},
            "status": {"observedGeneration": 2, "replicas": 4, "updatedReplicas": 2,
                       "readyReplicas": 2},
        }))
        .unwrap();
        let rs = |name: &str,
                  uid: &str,
                  hash: &str,
                  revision: &str,
                  replicas: i32,
                  failure: bool| {
            let conditions = match failure {
                true => {
                    json!([{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                "message": "pods \"edge-b-x\" is forbidden: exceeded quota"}])
                }
                false => json!([]),
            };
            json!({
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": name, "namespace": "team-a", "uid": uid,
                             "labels": {FLEET_LABEL: "edge", POD_TEMPLATE_HASH: hash},
                             "annotations": {REVISION_ANNOTATION: revision,
                                             "deployment.kubernetes.io/desired-replicas": "3"},
                             "managedFields": [{"manager": "kube-controller-manager"}],
                             "ownerReferences": owner("Deployment", "dep-1")},
                "spec": {"replicas": replicas, "selector": {"matchLabels": {FLEET_LABEL: "edge"}},
                         "template": {"spec": {"containers": [{"name": "server", "image": "s:2"}]}}},
                "status": {"replicas": replicas, "readyReplicas": replicas, "conditions": conditions},
            })
        };
        let pod = |name: &str, rs_uid: &str, hash: &str, status: Value, extra: Value| {
            let mut p = json!({
                "metadata": {"name": name, "namespace": "team-a", "uid": format!("{name}-uid"),
                             "labels": {FLEET_LABEL: "edge", POD_TEMPLATE_HASH: hash},
                             "ownerReferences": owner("ReplicaSet", rs_uid)},
                "spec": {"nodeName": "n1", "containers": [{"name": "server", "image": "s:2"}]},
                "status": status,
            });
            if let Some(extra) = extra.as_object() {
                for (k, v) in extra {
                    p["metadata"][k] = v.clone();
                }
            }
            p
        };
        let ready = json!({"type": "Ready", "status": "True",
                           "lastTransitionTime": "2026-12-07T00:00:00Z"});
        let listed_sets = vec![
            rs("edge-a", "rs-a", "aaaa", "1", 2, false),
            rs("edge-b", "rs-b", "bbbb", "2", 2, true),
        ];
        let listed_pods = vec![
            // An old shard, cordoned and being deleted.
            pod(
                "edge-a-1",
                "rs-a",
                "aaaa",
                json!({"phase": "Running", "podIP": "10.0.0.9", "conditions": [ready.clone()]}),
                json!({"deletionTimestamp": "2026-12-07T00:00:05Z",
                       "annotations": {CORDONED_ANNOTATION: "120", "other": "x"}}),
            ),
            // A new one, ready.
            pod(
                "edge-b-1",
                "rs-b",
                "bbbb",
                json!({"phase": "Running", "podIP": "10.0.0.10",
                       "conditions": [ready, {"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [{"name": "server", "image": "s:2", "imageID": "",
                                              "ready": true, "restartCount": 0,
                                              "state": {"running": {}}}]}),
                json!({}),
            ),
            // A new one whose init container cannot pull its image.
            pod(
                "edge-b-2",
                "rs-b",
                "bbbb",
                json!({"phase": "Pending",
                       "initContainerStatuses": [{"name": "sysctls", "image": "s:2", "imageID": "",
                                                  "ready": false, "restartCount": 0,
                                                  "state": {"waiting": {"reason": "ErrImagePull",
                                                                        "message": "not found"}}}]}),
                json!({}),
            ),
            // A new one no node can take.
            pod(
                "edge-b-3",
                "rs-b",
                "bbbb",
                json!({"phase": "Pending",
                       "conditions": [{"type": "PodScheduled", "status": "False",
                                       "reason": "Unschedulable",
                                       "message": "0/3 nodes are available: 3 Insufficient cpu."}]}),
                json!({}),
            ),
        ];
        for set in &listed_sets {
            sets.apply_watcher_event(&watcher::Event::Apply(
                serde_json::from_value(set.clone()).unwrap(),
            ));
        }
        for p in &listed_pods {
            pods.apply_watcher_event(&watcher::Event::Apply(
                serde_json::from_value(p.clone()).unwrap(),
            ));
        }
        let listed_sets: Vec<ReplicaSet> = listed_sets
            .into_iter()
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();
        let listed_pods: Vec<Pod> = listed_pods
            .into_iter()
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();

        let (kept_sets, kept_pods) = cache.workload("team-a", &deployment, "fleet-1", true);
        assert_eq!(kept_sets.len(), 2);
        assert_eq!(kept_pods.len(), 4);
        let failure = workload_failure(&deployment, &listed_sets, &listed_pods);
        assert!(failure.is_some());
        assert_eq!(
            workload_failure(&deployment, &kept_sets, &kept_pods),
            failure
        );
        // Without the refusal, the image; without both, the scheduling.
        let others =
            |pods: &[Pod]| workload_failure(&deployment, &[], pods).map(|f| format!("{f:?}"));
        let unpulled = others(&listed_pods);
        assert!(
            unpulled
                .as_deref()
                .is_some_and(|f| f.contains("ErrImagePull")),
            "{unpulled:?}"
        );
        assert_eq!(others(&kept_pods), unpulled);
        // All but the pod that cannot pull (the third in name order).
        let pulled = |pods: &[Pod]| -> Vec<Pod> {
            (pods.iter().enumerate())
                .filter(|(i, _)| *i != 2)
                .map(|(_, p)| p.clone())
                .collect()
        };
        let placed = others(&pulled(&listed_pods));
        let kept_placed = others(&pulled(&kept_pods));
        assert!(
            placed
                .as_deref()
                .is_some_and(|f| f.contains("Insufficient cpu")),
            "{placed:?}"
        );
        assert_eq!(kept_placed, placed);
        let rollout = crate::rollout::observe(&deployment, &listed_sets, &listed_pods);
        assert_eq!(rollout.status.as_ref().map(|s| s.draining_shards), Some(1));
        assert_eq!(
            crate::rollout::observe(&deployment, &kept_sets, &kept_pods),
            rollout
        );
        // Without the pods, the ReplicaSets alone; another fleet's uid
        // owns nothing.
        assert_eq!(
            cache.workload("team-a", &deployment, "fleet-1", false).1,
            Vec::<Pod>::new()
        );
        assert_eq!(
            cache.workload("team-a", &deployment, "fleet-2", true),
            (vec![], vec![])
        );
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

    /// Objects of one kind that differ in a few values pack into a fraction
    /// of their JSON against the kind's dictionary, and read back exactly,
    /// whichever of them the dictionary came from. (The dictionary is the
    /// process's: no other test of this crate stores a Service.)
    #[test]
    fn objects_of_a_kind_pack_against_its_dictionary_and_read_back_exactly() {
        let service = |i: usize| -> Service {
            serde_json::from_value(json!({
                "metadata": {"name": format!("fleet-{i}"), "namespace": format!("team-{i}"),
                             "uid": format!("00000000-0000-0000-0000-{i:012}"),
                             "resourceVersion": format!("{}", 1000 + i),
                             "labels": {"app.kubernetes.io/managed-by": "c10m-operator",
                                        "c10m.dev/fleet": format!("fleet-{i}")}},
                "spec": {"selector": {"c10m.dev/fleet": format!("fleet-{i}")},
                         "ports": [{"name": "ws", "port": 8080 + i, "protocol": "TCP",
                                    "targetPort": 8080 + i},
                                   {"name": "metrics", "port": 9100, "protocol": "TCP",
                                    "targetPort": 9100}],
                         "clusterIP": format!("127.2.0.{i}"), "type": "ClusterIP",
                         "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"}
            }))
            .unwrap()
        };
        let stored: Vec<_> = (1..=3).map(|i| Stored::new(&service(i))).collect();
        for (i, s) in (1..=3).zip(&stored) {
            assert_eq!(s.object(), Some(service(i)));
        }
        let json = serde_json::to_vec(&service(3)).unwrap().len();
        let packed = stored[2].packed.len();
        assert!(packed * 4 < json, "{packed} B packed for {json} B of JSON");
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
