//! The heap the controller's stores take at 1,000 fleets (issue 23, slice
//! 3): a memory gate that needs no cluster, in the style of
//! `kube-runtime/benches/memory.rs` (dhat counting every allocation).
//!
//! It feeds the operator's own store paths (made lean, then kept in a
//! reflector store: [`keep_compact`] for the fleets and what they own,
//! [`keep`] for the shards and nodes) a watch's initial list of 1,000 ConnectionFleets with a plan in
//! their status, and of the 3,000 objects they own (a Deployment, a
//! Service and a PodDisruptionBudget each, as [`render::render`] makes
//! them, with the `status` and `managedFields` an API server adds), and
//! the shard stores: every fleet's shard pods (one a planned
//! shard, from the rendered template, with a kubelet's status) and its
//! ReplicaSet; and the node store, fed the 500 KWOK nodes of the scale
//! plane. The
//! same objects are kept again as typed objects (lean, then without
//! [`lean`]), side by side, for the ratios. It prints one JSON line and
//! asserts a bound on the peak heap bytes (a bound on bytes, not on time).
//!
//! One test in this binary: the global allocator counts for the whole
//! process, and a second test running alongside would count too.

use std::collections::BTreeMap;

use c10m_operator::api::ConnectionFleet;
use c10m_operator::controller::{Kept, keep, keep_compact, lean, lean_node};
use c10m_operator::plan::{self, NodeFacts, NodeRuntime};
use c10m_operator::policy::Policy;
use c10m_operator::reconcile::cache::{KeptPod, KeptReplicaSet, Stored};
use c10m_operator::render;
use futures::{StreamExt, stream};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const FLEETS: usize = 1_000;

/// The scale plane's nodes (`make bench-scale`).
const NODES: usize = 500;

/// Peak heap bytes allowed while the stores fill as the controller fills
/// them, with the input made one object at a time. Measured 2026-12-03
/// (this test, x86_64): 11,011,574 B peak with the owned objects kept as
/// compact JSON and their owner references (the Deployments 5.1 MB, 4.4 kB
/// of JSON each), against 32,460,612 B kept as typed objects (the
/// Deployments 24.6 MB, 24.6 kB each). With the metrics loop's stores
/// (2026-12-06): 14,909,201 B peak, the 2,000 shard pods 2.38 MB kept as
/// [`KeptPod`]s (1.2 kB each, for 4.5 kB of lean JSON) against 49.8 MB as
/// typed pods, and the 1,000 ReplicaSets' metadata 0.95 MB. With what a
/// reconcile's workload reads kept too (2026-12-07: a pod's template hash
/// and unscheduled condition, a ReplicaSet watched whole and kept as a
/// [`KeptReplicaSet`]): 15,551,251 B peak, the pods 2.80 MB, the
/// ReplicaSets 1.08 MB (24.8 MB as typed ReplicaSets). With the scale
/// plane's 500 nodes, kept as [`lean_node`] keeps them (2026-12-07, later):
/// 16,818,622 B peak, the nodes 1.61 MB (2.85 MB as typed nodes with only
/// their managedFields dropped). With the owned objects' JSON LZ4-packed
/// against the first of their kind (2026-12-07, evening): 11,833,721 B
/// peak, the Deployments 1.21 MB (5.09 MB as plain compact JSON), the
/// Services 1.02 MB (1.53) and the budgets 1.01 MB (1.60); what is left of
/// each is mostly its kept metadata and the store's key. With the fleets
/// kept so too (2026-12-07, evening): 9,744,732 B peak, the fleets 1.00 MB
/// (3.09 MB as typed fleets). The bound leaves 18 % over it, so a change
/// that keeps more of each object (plain JSON again: 16.8 MB; typed
/// objects: 110 MB; managedFields: 328 MB; a second copy) fails here, not
/// in a cluster.
const PEAK_HEAP_BOUND_BYTES: usize = 11 << 20;

/// The node the plans are made for (64 CPUs, 256 GiB), as in the render
/// tests.
const NODE: NodeFacts = NodeFacts {
    memory_bytes: 256 << 30,
    cpus: 64,
    pods: 110,
    runtime: NodeRuntime::UNKNOWN,
};

/// Fleet `i` of mixed sizes (10k to 2M connections), as a user applies it
/// and the API server stores it (uid, generation, status with its plan).
fn fleet(i: usize) -> ConnectionFleet {
    let connections = [10_000, 100_000, 500_000, 2_000_000][i % 4];
    let mut f: ConnectionFleet = serde_json::from_value(json!({
        "apiVersion": "c10m.dev/v1alpha1",
        "kind": "ConnectionFleet",
        "metadata": {
            "name": format!("fleet-{i}"),
            "namespace": format!("team-{}", i % 50),
            "uid": format!("00000000-0000-4000-8000-{i:012}"),
            "generation": 1,
            "resourceVersion": format!("{}", 1000 + i),
        },
        "spec": {
            "connections": connections,
            "backend": {"connectionsPerCpu": 50_000, "protocol": "websocket"},
        },
    }))
    .expect("fleet");
    let plan = plan::plan_under(&f.spec, NODE, &Policy::default()).expect("plan");
    f.status = Some(serde_json::from_value(json!({"plan": plan})).expect("status"));
    f
}

/// A field set like the one server-side apply records for `v`: every
/// field name as `f:name`, down to the leaves.
fn fields(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (format!("f:{k}"), fields(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Object(
            a.iter()
                .enumerate()
                .map(|(i, v)| (format!("k:{{\"index\":{i}}}"), fields(v)))
                .collect(),
        ),
        _ => json!({}),
    }
}

/// `o` as a watch delivers it: the applier's and the status writer's
/// managedFields, a uid and a resourceVersion.
fn as_watched<K: Resource + Serialize>(mut o: K, i: usize) -> K {
    let body = serde_json::to_value(&o).expect("json");
    let entry = |manager: &str, operation: &str, fields: Value| ManagedFieldsEntry {
        api_version: Some("v1".into()),
        fields_type: Some("FieldsV1".into()),
        fields_v1: Some(FieldsV1(fields)),
        manager: Some(manager.into()),
        operation: Some(operation.into()),
        time: Some(Time(Timestamp::from_second(1_796_083_200).unwrap())),
        ..ManagedFieldsEntry::default()
    };
    let meta = o.meta_mut();
    meta.uid = Some(format!("11111111-0000-4000-8000-{i:012}"));
    meta.resource_version = Some(format!("{}", 5000 + i));
    meta.managed_fields = Some(vec![
        entry("c10m-operator", "Apply", fields(&body["spec"])),
        entry("kube-controller-manager", "Update", fields(&body["status"])),
    ]);
    o
}

/// The 3,000 objects the fleets own, with the status a controller writes.
fn owned(i: usize) -> render::Rendered {
    let f = fleet(i);
    let plan = f.status.as_ref().unwrap().plan.clone().expect("plan");
    let owner = f.controller_owner_ref(&()).expect("owner");
    let mut r = render::render(&f, &plan, owner, plan.shards, &Policy::default());
    r.deployment.status = Some(
        serde_json::from_value(json!({
            "observedGeneration": 1, "replicas": plan.shards, "updatedReplicas": plan.shards,
            "readyReplicas": plan.shards, "availableReplicas": plan.shards,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                 "message": "Deployment has minimum availability.",
                 "lastUpdateTime": "2026-12-01T00:00:00Z", "lastTransitionTime": "2026-12-01T00:00:00Z"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                 "message": format!("ReplicaSet \"fleet-{i}-5d8f7c9b6d\" has successfully progressed."),
                 "lastUpdateTime": "2026-12-01T00:00:00Z", "lastTransitionTime": "2026-12-01T00:00:00Z"}
            ]
        }))
        .expect("deployment status"),
    );
    r.pdb.status = Some(
        serde_json::from_value(json!({
            "observedGeneration": 1, "currentHealthy": plan.shards, "desiredHealthy": plan.shards - 1,
            "disruptionsAllowed": 1, "expectedPods": plan.shards
        }))
        .expect("pdb status"),
    );
    r
}

/// The pods fleet `i` runs (one a shard, as its ReplicaSet makes them from
/// the rendered template) with the status a kubelet writes, and its
/// ReplicaSet with the status its controller writes, as a watch delivers
/// them: what the shard stores are fed ([`KeptPod`], [`KeptReplicaSet`]).
fn shards(i: usize) -> (Vec<Pod>, ReplicaSet) {
    let f = fleet(i);
    let r = owned(i);
    let ns = f.metadata.namespace.clone().unwrap();
    let d = r.deployment;
    let rs_name = format!("fleet-{i}-5d8f7c9b6d");
    let rs_uid = format!("22222222-0000-4000-8000-{i:012}");
    let template = d.spec.as_ref().unwrap().template.clone();
    let mut labels = template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap_or_default();
    labels.insert("pod-template-hash".into(), "5d8f7c9b6d".into());
    let shards = d.spec.as_ref().unwrap().replicas.unwrap_or(1) as usize;
    let mut template_labelled = template.clone();
    template_labelled.metadata.as_mut().unwrap().labels = Some(labels.clone());
    let rs: ReplicaSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {
            "name": rs_name, "namespace": ns, "uid": rs_uid, "labels": labels,
            "annotations": {"deployment.kubernetes.io/desired-replicas": "4",
                            "deployment.kubernetes.io/max-replicas": "6",
                            "deployment.kubernetes.io/revision": "1"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                 "name": format!("fleet-{i}"),
                                 "uid": format!("11111111-0000-4000-8000-{i:012}"),
                                 "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": {"replicas": shards, "selector": d.spec.as_ref().unwrap().selector,
                 "template": template_labelled},
        "status": {"replicas": shards, "fullyLabeledReplicas": shards, "readyReplicas": shards,
                   "availableReplicas": shards, "observedGeneration": 1},
    }))
    .expect("replica set");
    let rs = as_watched(rs, i);
    let at = "2026-12-01T00:00:00Z";
    let pods = (0..shards)
        .map(|k| {
            let mut spec = template.spec.clone().unwrap();
            spec.node_name = Some(format!("kwok-node-{}", (i + k) % 500));
            let containers: Vec<Value> = spec
                .containers
                .iter()
                .map(|c| json!({
                    "name": c.name, "image": c.image, "imageID": format!("docker.io/library/{}@sha256:{}", c.name, "0".repeat(64)),
                    "containerID": format!("containerd://{}", "1".repeat(64)),
                    "ready": true, "restartCount": 0, "started": true,
                    "state": {"running": {"startedAt": at}},
                }))
                .collect();
            let conditions: Vec<Value> = [
                "PodReadyToStartContainers",
                "Initialized",
                "Ready",
                "ContainersReady",
                "PodScheduled",
            ]
            .map(|t| json!({"type": t, "status": "True", "lastTransitionTime": at}))
            .into();
            let mut pod: Pod = serde_json::from_value(json!({
                "metadata": {
                    "name": format!("{rs_name}-{k:05}"), "namespace": ns,
                    "labels": labels.clone(),
                    "annotations": template.metadata.as_ref().unwrap().annotations.clone(),
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                         "name": rs_name, "uid": rs_uid,
                                         "controller": true, "blockOwnerDeletion": true}],
                },
                "spec": spec,
                "status": {
                    "phase": "Running", "podIP": format!("10.{}.{}.{}", i / 250, i % 250, k + 2),
                    "podIPs": [{"ip": format!("10.{}.{}.{}", i / 250, i % 250, k + 2)}],
                    "hostIP": "10.0.0.2", "hostIPs": [{"ip": "10.0.0.2"}],
                    "qosClass": "Guaranteed", "startTime": at,
                    "conditions": conditions,
                    "containerStatuses": containers,
                },
            }))
            .expect("pod");
            pod.metadata.uid = Some(format!("33333333-{k:04}-4000-8000-{i:012}"));
            as_watched(pod, i)
        })
        .collect();
    (pods, rs)
}

/// Node `i` of the scale plane's 500 (`make bench-scale`): a KWOK node as
/// its API server stores it (labels, annotations, capacity, allocatable,
/// the five conditions with heartbeats, addresses, node info), its
/// `managedFields` added by [`as_watched`]; one in ten tainted.
fn node(i: usize) -> Node {
    let at = "2026-12-07T06:16:54Z";
    let condition = |type_: &str, status: &str, reason: &str, message: &str| {
        json!({"type": type_, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": at, "lastTransitionTime": at})
    };
    let mut n: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": format!("kwok-node-{i}"),
            "creationTimestamp": at,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
                "c10m.dev/pool": "edge", "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": format!("kwok-node-{i}"), "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": "c10m-64x256",
                "topology.kubernetes.io/zone": "zone-a", "type": "kwok"}
        },
        "spec": {"podCIDR": format!("127.1.{}.0/24", i % 250), "podCIDRs": [format!("127.1.{}.0/24", i % 250)]},
        "status": {
            "addresses": [{"address": format!("127.0.100.{}", i % 250), "type": "InternalIP"},
                {"address": format!("kwok-node-{i}"), "type": "Hostname"}],
            "allocatable": {"cpu": "64", "ephemeral-storage": "1Ti", "memory": "256Gi", "pods": "110"},
            "capacity": {"cpu": "64", "ephemeral-storage": "1Ti", "memory": "256Gi", "pods": "110"},
            "conditions": [
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("NetworkUnavailable", "False", "RouteCreated", "RouteController created a route")
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"architecture": "amd64", "bootID": "", "containerRuntimeVersion": "kwok-v0.7.0",
                "kernelVersion": "", "kubeProxyVersion": "", "kubeletVersion": "fake",
                "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": ""},
            "phase": "Running"
        }
    }))
    .expect("node");
    if i.is_multiple_of(10) {
        n.spec.get_or_insert_default().taints = Some(vec![
            serde_json::from_value(
                json!({"key": "dedicated", "value": "edge", "effect": "NoSchedule"}),
            )
            .expect("taint"),
        ]);
    }
    as_watched(n, i)
}

/// `objects` (made one at a time) as a watch's initial list.
fn initial_list<K: Send + 'static>(
    objects: impl Iterator<Item = K> + Send + 'static,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static {
    stream::iter(
        std::iter::once(watcher::Event::Init)
            .chain(objects.map(watcher::Event::InitApply))
            .chain(std::iter::once(watcher::Event::InitDone))
            .map(Ok),
    )
}

/// Keeps `objects` through [`keep`] (typed), made lean with `lean`; the store.
fn fill<K: Kept>(objects: impl Iterator<Item = K> + Send + 'static, lean: fn(&mut K)) -> Store<K> {
    let (store, writer) = reflector::store();
    futures::executor::block_on(keep(initial_list(objects), lean, writer).for_each(|_| async {}));
    store
}

/// Keeps `objects` through [`keep_compact`], as the controller keeps the
/// fleets and the objects they own; the store.
fn fill_compact<K: Kept + Serialize>(
    objects: impl Iterator<Item = K> + Send + 'static,
) -> Store<Stored<K>> {
    let (store, writer) = reflector::store();
    futures::executor::block_on(keep_compact(initial_list(objects), writer).for_each(|_| async {}));
    store
}

/// How the owned objects are kept.
#[derive(Clone, Copy, PartialEq)]
enum Keeping {
    /// As the controller keeps them: the fleets and what they own lean,
    /// LZ4-packed compact JSON.
    Controller,
    /// Typed k8s-openapi objects, lean (the controller before compact JSON).
    Typed,
    /// Typed, with their managedFields.
    TypedFull,
}

/// The four stores at 1,000 fleets: the objects each holds, and the heap
/// bytes each took. The stores live as long as this does.
struct Stores {
    counts: BTreeMap<&'static str, usize>,
    bytes: BTreeMap<&'static str, usize>,
    _kept: Vec<Box<dyn std::any::Any>>,
}

/// The stores filled `how`.
fn stores(how: Keeping) -> Stores {
    fn none<K>(_: &mut K) {}
    let mut s = Stores {
        counts: BTreeMap::new(),
        bytes: BTreeMap::new(),
        _kept: Vec::new(),
    };
    let mut at = dhat::HeapStats::get().curr_bytes;
    let mut took = |s: &mut Stores, kind, count, kept: Box<dyn std::any::Any>| {
        let now = dhat::HeapStats::get().curr_bytes;
        s.bytes.insert(kind, now - at);
        s.counts.insert(kind, count);
        s._kept.push(kept);
        at = now;
    };
    macro_rules! kept_store {
        ($kind:literal, $objects:expr, $ty:ty) => {{
            let objects = $objects;
            match how {
                Keeping::Controller => {
                    let st = fill_compact(objects);
                    took(&mut s, $kind, st.state().len(), Box::new(st));
                }
                Keeping::Typed | Keeping::TypedFull => {
                    let lean: fn(&mut $ty) = if how == Keeping::Typed {
                        lean::<$ty>
                    } else {
                        none::<$ty>
                    };
                    let st = fill(objects, lean);
                    took(&mut s, $kind, st.state().len(), Box::new(st));
                }
            }
        }};
    }
    let watched = |i| as_watched(fleet(i), i);
    kept_store!("fleets", (0..FLEETS).map(watched), ConnectionFleet);
    macro_rules! owned_store {
        ($kind:literal, $field:ident, $ty:ty) => {{
            let objects = (0..FLEETS).map(|i| as_watched(owned(i).$field, i));
            kept_store!($kind, objects, $ty)
        }};
    }
    owned_store!("deployments", deployment, Deployment);
    owned_store!("services", service, Service);
    owned_store!("pdbs", pdb, PodDisruptionBudget);
    // The shard stores: every fleet's shard pods (as many as its
    // plan's shards) and its ReplicaSet.
    let pods = (0..FLEETS).flat_map(|i| shards(i).0);
    let sets = (0..FLEETS).map(|i| shards(i).1);
    match how {
        Keeping::Controller => {
            // As the watch parses them: each pod's JSON straight into a
            // KeptPod.
            let kept = pods.map(|p| {
                let wire = serde_json::to_vec(&p).expect("json");
                serde_json::from_slice::<KeptPod>(&wire).expect("kept pod")
            });
            let st = fill(kept, lean);
            took(&mut s, "pods", st.state().len(), Box::new(st));
            let kept = sets.map(|rs| {
                let wire = serde_json::to_vec(&rs).expect("json");
                serde_json::from_slice::<KeptReplicaSet>(&wire).expect("kept replica set")
            });
            let st = fill(kept, lean);
            took(&mut s, "replicaSets", st.state().len(), Box::new(st));
        }
        Keeping::Typed | Keeping::TypedFull => {
            let full = how == Keeping::TypedFull;
            let st = fill(pods, if full { none::<Pod> } else { lean::<Pod> });
            took(&mut s, "pods", st.state().len(), Box::new(st));
            let lean_set = if full {
                none::<ReplicaSet>
            } else {
                lean::<ReplicaSet>
            };
            let st = fill(sets, lean_set);
            took(&mut s, "replicaSets", st.state().len(), Box::new(st));
        }
    }
    // The node store: as the controller keeps it ([`lean_node`]), else
    // typed and lean, or whole.
    let nodes = (0..NODES).map(node);
    let st = match how {
        Keeping::Controller => fill(nodes, lean_node),
        Keeping::Typed => fill(nodes, lean::<Node>),
        Keeping::TypedFull => fill(nodes, none::<Node>),
    };
    took(&mut s, "nodes", st.state().len(), Box::new(st));
    s
}

/// Shard pods of all the fleets: one a shard of each plan.
fn pod_count() -> usize {
    (0..FLEETS).map(|i| shards(i).0.len()).sum()
}

/// Bytes of `o`'s JSON as a watch would send it, made lean.
fn json_len<K: Resource + Serialize>(o: K) -> usize {
    let mut o = as_watched(o, 0);
    lean(&mut o);
    serde_json::to_vec(&o).expect("json").len()
}

#[test]
fn the_stores_of_1000_fleets_stay_within_their_heap_bound() {
    let _profiler = dhat::Profiler::builder()
        .testing()
        .trim_backtraces(Some(1))
        .build();
    let before = dhat::HeapStats::get().curr_bytes;
    let kept = stores(Keeping::Controller);
    let after = dhat::HeapStats::get();
    let peak = after.max_bytes;
    let kept_bytes = after.curr_bytes - before;
    let pods = pod_count();
    let expected = |kind: &str| match kind {
        "pods" => pods,
        "nodes" => NODES,
        _ => FLEETS,
    };
    let all_kept = |s: &Stores| s.counts.iter().all(|(k, n)| *n == expected(k));
    assert!(all_kept(&kept), "{:?}", kept.counts);
    // The same objects kept the ways the controller kept them before, for
    // the ratios.
    let mark = dhat::HeapStats::get().curr_bytes;
    let typed = stores(Keeping::Typed);
    let typed_bytes = dhat::HeapStats::get().curr_bytes - mark;
    let mark = dhat::HeapStats::get().curr_bytes;
    let full = stores(Keeping::TypedFull);
    let full_bytes = dhat::HeapStats::get().curr_bytes - mark;
    assert!(all_kept(&typed) && all_kept(&full));
    let ratio = |a: usize, b: usize| (a as f64 / b as f64 * 1000.0).round() / 1000.0;
    println!(
        "{}",
        json!({
            "fleets": FLEETS,
            "ownedObjects": 3 * FLEETS,
            "shardPods": pods,
            "replicaSets": FLEETS,
            "nodes": NODES,
            "peakHeapBytes": peak,
            "peakHeapBoundBytes": PEAK_HEAP_BOUND_BYTES,
            "storedBytes": kept_bytes,
            "storedBytesByKind": kept.bytes,
            "leanJsonBytesOfFleet3": {
                "fleet": json_len(fleet(3)),
                "deployment": json_len(owned(3).deployment),
                "service": json_len(owned(3).service),
                "pdb": json_len(owned(3).pdb),
                "pod": json_len(shards(3).0.remove(0)),
            },
            "storedTypedBytesByKind": typed.bytes,
            "storedTypedBytes": typed_bytes,
            "storedTypedWithManagedFieldsBytes": full_bytes,
            "compactOverTypedRatio": ratio(kept_bytes, typed_bytes),
            "leanOverFullRatio": ratio(typed_bytes, full_bytes),
        })
    );
    // Each step the controller takes keeps less: compact JSON under typed
    // objects, lean under managedFields.
    assert!(kept_bytes < typed_bytes, "{kept_bytes} ≥ {typed_bytes}");
    assert!(typed_bytes < full_bytes, "{typed_bytes} ≥ {full_bytes}");
    assert!(
        peak <= PEAK_HEAP_BOUND_BYTES,
        "peak heap {peak} B over the bound {PEAK_HEAP_BOUND_BYTES} B"
    );
}
