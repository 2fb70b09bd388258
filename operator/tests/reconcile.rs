//! Reconcile scenarios against a mock API server ([`apiserver`]): one test
//! per behaviour of the driver, with real JSON for every object.
//!
//! The mock cluster ([`Cluster`]) stores the fleet and the objects the
//! operator writes, keyed by API path, and answers reads from what it
//! stores (404 `Status` for what it does not). Each test reconciles, then
//! asserts on the recorded calls: status writes (`PATCH …/status`), events
//! (`events.k8s.io/v1`) and applies (server-side-apply `PATCH`es).

mod apiserver;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apiserver::{ApiServer, Call, Reply};
use c10m_operator::api::ConnectionFleet;
use c10m_operator::policy::Policy;
use c10m_operator::reason::Reason;
use c10m_operator::reconcile::apply::SERVICE_WAIT;
use c10m_operator::reconcile::cache::{Cache, KeptPod, KeptReplicaSet, Shards, Stored};
use c10m_operator::reconcile::report::ROLLOUT_RECHECK;
use c10m_operator::reconcile::{Context, Error, MAX_BACKOFF, RESYNC, error_policy, reconcile};
use c10m_operator::telemetry::Metrics;
use futures::StreamExt;
use http::Method;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NS: &str = "prod";
const NAME: &str = "edge";
const UID: &str = "5f0c3a7e-1d2b-4c8e-9a61-7b3d2e4f5a60";
const FIELD_MANAGER: &str = "c10m-operator";
/// The field manager of the rollout's gate (`c10m_operator::names::ROLLOUT_FIELD_MANAGER`).
const ROLLOUT_MANAGER: &str = "fieldManager=c10m-operator-rollout";

const FLEET: &str = "/apis/c10m.dev/v1alpha1/namespaces/prod/connectionfleets/edge";
const FLEET_STATUS: &str = "/apis/c10m.dev/v1alpha1/namespaces/prod/connectionfleets/edge/status";
const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/prod/deployments/edge";
const SERVICE: &str = "/api/v1/namespaces/prod/services/edge";
const PDB: &str = "/apis/policy/v1/namespaces/prod/poddisruptionbudgets/edge";
const SECRETS: &str = "/api/v1/namespaces/prod/secrets";
const SECRET: &str = "/api/v1/namespaces/prod/secrets/edge-admin";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/prod/events";
const REPLICA_SETS: &str = "/apis/apps/v1/namespaces/prod/replicasets";
const PODS: &str = "/api/v1/namespaces/prod/pods";
const NODES: &str = "/api/v1/nodes";
/// Collections the operator lists; a GET of one answers the stored objects under it.
const COLLECTIONS: [&str; 3] = [REPLICA_SETS, PODS, NODES];
const DEPLOYMENT_UID: &str = "0d0d0d0d-0000-4000-8000-00000000000d";

/// A fleet as the API server stores it (uid, generation, namespace).
fn fleet(spec: Value) -> ConnectionFleet {
    serde_json::from_value(json!({
        "apiVersion": "c10m.dev/v1alpha1",
        "kind": "ConnectionFleet",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": UID,
            "generation": 2,
            "resourceVersion": "1001",
        },
        "spec": spec,
    }))
    .expect("a valid ConnectionFleet")
}

/// `fleet` as the API server stores it after someone changed it: a new
/// `resourceVersion`, `by` past its own.
fn touch(fleet: &mut ConnectionFleet, by: u64) {
    let rv: u64 = fleet.resource_version().unwrap().parse().unwrap();
    fleet.metadata.resource_version = Some((rv + by).to_string());
}

/// `fleet` as the API server stores it after a change of its spec: a new
/// `resourceVersion` and generation.
fn bump(fleet: &mut ConnectionFleet) {
    touch(fleet, 1000);
    fleet.metadata.generation = Some(fleet.metadata.generation.unwrap_or(1) + 1);
}

/// A spec that plans with no node in the cluster (node memory and CPUs given).
fn feasible() -> Value {
    json!({"connections": 1_000_000, "node": {"memory": "256Gi", "cpus": 64}})
}

/// What the mock cluster stores and how it misbehaves.
#[derive(Clone, Default)]
struct Cluster {
    /// Stored objects by API path (the fleet included).
    objects: BTreeMap<String, Value>,
    /// Applied Deployments report every replica ready and updated.
    ready: bool,
    /// The Deployment's apply fails with this `Status` (code, message).
    fail_deployment_apply: Option<(u16, String)>,
    /// The Service's apply fails with this `Status` (code, message).
    fail_service_apply: Option<(u16, String)>,
    /// Calls of this method on this path are answered only once the gate
    /// turns `true` (a slow API server).
    hold: Option<(Method, &'static str, watch::Receiver<bool>)>,
}

impl Cluster {
    fn with_fleet(fleet: &ConnectionFleet) -> Cluster {
        let mut c = Cluster::default();
        c.objects
            .insert(FLEET.into(), serde_json::to_value(fleet).unwrap());
        c
    }

    /// The stored fleet (with the status the operator last wrote).
    fn fleet(&self) -> ConnectionFleet {
        serde_json::from_value(self.objects[FLEET].clone()).unwrap()
    }

    /// Answers one call the way the API server would for these objects;
    /// a held one once [`Cluster::hold`] lets it go.
    fn answer(&mut self, call: &Call) -> Reply {
        let reply = self.answer_now(call);
        match &self.hold {
            Some((method, path, gate)) if call.is(method.clone(), path) => {
                reply.held_until(gate.clone())
            }
            _ => reply,
        }
    }

    /// [`Cluster::answer`], at once.
    fn answer_now(&mut self, call: &Call) -> Reply {
        let path = call.path().to_string();
        let body = call.body.clone().unwrap_or(Value::Null);
        match call.method {
            Method::GET if COLLECTIONS.contains(&path.as_str()) => {
                let prefix = format!("{path}/");
                let items: Vec<&Value> = self
                    .objects
                    .iter()
                    .filter(|(p, _)| p.starts_with(&prefix))
                    .map(|(_, o)| o)
                    .collect();
                Reply::ok(json!({
                    "apiVersion": "v1",
                    "kind": "List",
                    "metadata": {"resourceVersion": "1"},
                    "items": items,
                }))
            }
            Method::GET => match self.objects.get(&path) {
                Some(obj) => Reply::ok(obj),
                None => Reply::not_found(call),
            },
            // Server-side apply of the status subresource: the status only.
            // Every write gives the object a new resourceVersion.
            Method::PATCH if path == FLEET_STATUS => {
                let fleet = self.objects.get_mut(FLEET).expect("the fleet exists");
                fleet["status"] = body["status"].clone();
                let version = fleet["metadata"]["resourceVersion"]
                    .as_str()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                fleet["metadata"]["resourceVersion"] = json!((version + 1).to_string());
                Reply::ok(fleet.clone())
            }
            Method::PATCH if path.starts_with(EVENTS) => Reply::ok(body),
            // The rollout's gate: a merge patch of the Deployment's
            // spec.minReadySeconds under its own field manager.
            Method::PATCH if path == DEPLOYMENT && call.query().contains(ROLLOUT_MANAGER) => {
                let Some(obj) = self.objects.get_mut(&path) else {
                    return Reply::not_found(call);
                };
                obj["spec"]["minReadySeconds"] = body["spec"]["minReadySeconds"].clone();
                Reply::ok(obj.clone())
            }
            // Server-side apply of an owned object.
            Method::PATCH => {
                if path == DEPLOYMENT
                    && let Some((code, message)) = &self.fail_deployment_apply
                {
                    return Reply::failure(*code, "InternalError", message.clone());
                }
                if path == SERVICE
                    && let Some((code, message)) = &self.fail_service_apply
                {
                    return Reply::failure(*code, "Invalid", message.clone());
                }
                let mut obj = body;
                if path == DEPLOYMENT {
                    // The gate is another manager's field: an apply that
                    // leaves it out keeps it.
                    let gate = self
                        .objects
                        .get(&path)
                        .map(|d| d["spec"]["minReadySeconds"].clone());
                    if let Some(gate) = gate.filter(|g| !g.is_null()) {
                        obj["spec"]["minReadySeconds"] = gate;
                    }
                    let replicas = obj["spec"]["replicas"].as_i64().unwrap_or(1);
                    let ready = if self.ready { replicas } else { 0 };
                    obj["metadata"]["generation"] = json!(1);
                    obj["metadata"]["uid"] = json!(DEPLOYMENT_UID);
                    obj["status"] = json!({
                        "observedGeneration": 1,
                        "replicas": replicas,
                        "readyReplicas": ready,
                        "updatedReplicas": replicas,
                    });
                }
                self.objects.insert(path, obj.clone());
                Reply::ok(obj)
            }
            // Create into a collection (the admin Secret, events).
            Method::POST => {
                let name = body["metadata"]["name"].as_str().unwrap_or("unnamed");
                self.objects.insert(format!("{path}/{name}"), body.clone());
                Reply::created(body)
            }
            _ => Reply::failure(405, "MethodNotAllowed", format!("{} {path}", call.method)),
        }
    }
}

/// The mock API server over `cluster`, and an operator context on it.
struct Harness {
    cluster: Arc<Mutex<Cluster>>,
    api: ApiServer,
    ctx: Arc<Context>,
    /// The watch caches' writers, when the context reads caches.
    caches: Option<Mutex<Writers>>,
}

/// The writers of the stores a [`Cache`] reads, fed by the controller's
/// watches in the operator and by [`Harness::sync_caches`] here.
struct Writers {
    nodes: Writer<Node>,
    deployments: Writer<Stored<Deployment>>,
    services: Writer<Stored<Service>>,
    pdbs: Writer<Stored<PodDisruptionBudget>>,
    pods: Writer<KeptPod>,
    replica_sets: Writer<KeptReplicaSet>,
}

impl Harness {
    fn start(cluster: Cluster) -> Harness {
        Self::start_under(cluster, Policy::default())
    }

    /// [`Harness::start`] with the operator under the admin's `policy`.
    fn start_under(cluster: Cluster, policy: Policy) -> Harness {
        let (cluster, client, api) = Self::serve(cluster);
        let ctx = Arc::new(
            Context::new(client, None, Arc::new(Metrics::default()), None).with_policy(policy),
        );
        Harness {
            cluster,
            api,
            ctx,
            caches: None,
        }
    }

    /// [`Harness::start`] with the operator reading the watch caches, as
    /// it does in a cluster, listed from what `cluster` stores.
    fn start_cached(cluster: Cluster) -> Harness {
        let (cluster, client, api) = Self::serve(cluster);
        let mut writers = Writers {
            nodes: Writer::default(),
            deployments: Writer::default(),
            services: Writer::default(),
            pdbs: Writer::default(),
            pods: Writer::default(),
            replica_sets: Writer::default(),
        };
        let shards = Shards {
            pods: writers.pods.as_reader(),
            replica_sets: writers.replica_sets.as_reader(),
        };
        let cache = Cache::new(
            writers.nodes.as_reader(),
            writers.deployments.as_reader(),
            writers.services.as_reader(),
            writers.pdbs.as_reader(),
            shards,
            CancellationToken::new(),
        );
        writers.nodes.apply_watcher_event(&watcher::Event::InitDone);
        let ctx = Arc::new(
            Context::new(client, None, Arc::new(Metrics::default()), None).with_cache(cache),
        );
        let h = Harness {
            cluster,
            api,
            ctx,
            caches: Some(Mutex::new(writers)),
        };
        h.sync_caches();
        h
    }

    fn serve(cluster: Cluster) -> (Arc<Mutex<Cluster>>, kube::Client, ApiServer) {
        let cluster = Arc::new(Mutex::new(cluster));
        let routed = cluster.clone();
        let (client, api) = ApiServer::start(move |call| routed.lock().unwrap().answer(call));
        (cluster, client, api)
    }

    /// Lists the cluster's Deployment, Service, PodDisruptionBudget,
    /// ReplicaSets and pods into the caches again, as a watch's relist
    /// would.
    fn sync_caches(&self) {
        fn relist<K>(writer: &mut Writer<Stored<K>>, stored: Option<&Value>)
        where
            K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned + serde::Serialize,
            Stored<K>: kube::Resource<DynamicType = ()> + Clone,
        {
            writer.apply_watcher_event(&watcher::Event::Init);
            if let Some(obj) = stored {
                let obj: K = serde_json::from_value(obj.clone()).expect("a stored object");
                writer.apply_watcher_event(&watcher::Event::InitApply(Stored::new(&obj)));
            }
            writer.apply_watcher_event(&watcher::Event::InitDone);
        }
        /// The objects under `collection`, read as the watch reads them.
        fn relist_kept<K>(
            writer: &mut Writer<K>,
            objects: &BTreeMap<String, Value>,
            collection: &str,
        ) where
            K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned + Clone,
        {
            writer.apply_watcher_event(&watcher::Event::Init);
            let prefix = format!("{collection}/");
            for (_, obj) in objects.iter().filter(|(path, _)| path.starts_with(&prefix)) {
                let obj: K = serde_json::from_value(obj.clone()).expect("a watched object");
                writer.apply_watcher_event(&watcher::Event::InitApply(obj));
            }
            writer.apply_watcher_event(&watcher::Event::InitDone);
        }
        let mut writers = self
            .caches
            .as_ref()
            .expect("a cached harness")
            .lock()
            .unwrap();
        let objects = self.cluster.lock().unwrap().objects.clone();
        relist::<Deployment>(&mut writers.deployments, objects.get(DEPLOYMENT));
        relist::<Service>(&mut writers.services, objects.get(SERVICE));
        relist::<PodDisruptionBudget>(&mut writers.pdbs, objects.get(PDB));
        relist_kept(&mut writers.replica_sets, &objects, REPLICA_SETS);
        relist_kept(&mut writers.pods, &objects, PODS);
    }

    /// Reconciles `fleet` (the possibly stale copy a watch delivered).
    async fn reconcile(&self, fleet: &ConnectionFleet) -> Result<Action, Error> {
        reconcile(Arc::new(fleet.clone()), self.ctx.clone()).await
    }

    fn stored_fleet(&self) -> ConnectionFleet {
        self.cluster.lock().unwrap().fleet()
    }
}

/// `calls` hold one status write, and it says `Degraded` for `reason` with
/// `message`.
fn assert_one_degraded_write(calls: &[Call], reason: &str, message: &str) {
    let written = status_writes(calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    assert_eq!(
        condition(&written[0], "Degraded"),
        ("True".into(), reason.into(), message.into())
    );
}

/// Bodies of the status writes among `calls` (the `status` they apply).
fn status_writes(calls: &[Call]) -> Vec<Value> {
    calls
        .iter()
        .filter(|c| c.is(Method::PATCH, FLEET_STATUS))
        .map(|c| c.body.clone().unwrap()["status"].clone())
        .collect()
}

/// Events published among `calls` (created or updated as a series).
fn events(calls: &[Call]) -> Vec<Value> {
    calls
        .iter()
        .filter(|c| c.path().starts_with(EVENTS))
        .map(|c| c.body.clone().unwrap())
        .collect()
}

fn warnings(calls: &[Call]) -> Vec<Value> {
    events(calls)
        .into_iter()
        .filter(|e| e["type"] == "Warning")
        .collect()
}

/// Writes (anything but GET) to `path` among `calls`.
fn writes_to<'a>(calls: &'a [Call], path: &str) -> Vec<&'a Call> {
    calls
        .iter()
        .filter(|c| c.method != Method::GET && c.path() == path)
        .collect()
}

/// The condition `type_` of a status as JSON: (status, reason, message).
fn condition(status: &Value, type_: &str) -> (String, String, String) {
    let c = status["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"));
    let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
    (s("status"), s("reason"), s("message"))
}

/// One Warning event about the fleet with `reason` and `note`.
fn assert_warning(event: &Value, reason: Reason, action: &str, note: &str) {
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["reason"], reason.as_str(), "{event}");
    assert_eq!(event["action"], action, "{event}");
    assert_eq!(event["note"], note, "{event}");
    assert_eq!(event["reportingController"], FIELD_MANAGER, "{event}");
    let regarding = &event["regarding"];
    assert_eq!(
        (
            &regarding["kind"],
            &regarding["name"],
            &regarding["namespace"],
            &regarding["uid"]
        ),
        (
            &json!("ConnectionFleet"),
            &json!(NAME),
            &json!(NS),
            &json!(UID)
        ),
        "{event}"
    );
}

#[tokio::test]
async fn a_rejected_fleet_writes_status_once_and_warns_once() {
    // A shard wider than a node: no plan can hold one connection.
    let cached = fleet(json!({
        "connections": 1_000_000,
        "node": {"memory": "256Gi", "cpus": 4},
        "shard": {"cpus": 8}
    }));
    let h = Harness::start(Cluster::with_fleet(&cached));
    let message = "spec.shard.cpus (8) exceeds the CPUs of one node (4)";

    let action = h
        .reconcile(&cached)
        .await
        .expect("a rejection is not an error");
    assert_eq!(
        action,
        Action::requeue(RESYNC),
        "waits for a change, no retry loop"
    );
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    assert_eq!(
        condition(&written[0], "Degraded"),
        ("True".into(), "PlanInfeasible".into(), message.into())
    );
    assert_eq!(condition(&written[0], "Ready").0, "False");
    assert_eq!(written[0]["observedGeneration"], 2);
    let status_patch = calls
        .iter()
        .find(|c| c.is(Method::PATCH, FLEET_STATUS))
        .unwrap();
    assert!(
        status_patch.query().contains("fieldManager=c10m-operator")
            && status_patch.query().contains("force=true"),
        "status is server-side applied: {}",
        status_patch.uri
    );
    let evs = events(&calls);
    assert_eq!(evs.len(), 1, "{evs:#?}");
    assert_warning(&evs[0], Reason::PlanInfeasible, "Plan", message);
    assert!(
        calls
            .iter()
            .all(|c| c.method == Method::GET || c.path() == FLEET_STATUS || c.path() == EVENTS),
        "nothing is applied or created for a rejected fleet: {calls:#?}"
    );

    // Again, from the same stale cache: the stored status already says it.
    let action = h.reconcile(&cached).await.unwrap();
    assert_eq!(action, Action::requeue(RESYNC));
    let calls = h.api.take();
    assert_eq!(status_writes(&calls), Vec::<Value>::new(), "{calls:#?}");
    assert_eq!(events(&calls), Vec::<Value>::new(), "{calls:#?}");
    assert!(calls.iter().all(|c| c.method == Method::GET), "{calls:#?}");
}

#[tokio::test]
async fn an_invalid_spec_is_rejected_as_invalid_spec() {
    // A custom backend must say what a connection costs it.
    let cached = fleet(json!({
        "connections": 1_000_000,
        "node": {"memory": "256Gi", "cpus": 64},
        "backend": {"model": "custom"}
    }));
    let h = Harness::start(Cluster::with_fleet(&cached));
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1);
    let (status, reason, message) = condition(&written[0], "Degraded");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "InvalidSpec"));
    assert!(message.contains("userBytesPerConnection"), "{message}");
    let warned = warnings(&calls);
    assert_eq!(warned.len(), 1);
    assert_warning(&warned[0], Reason::InvalidSpec, "Plan", &message);
}

/// Issue 13: what the admin's policy refuses is refused before anything is
/// applied, with its own reason, naming the field, warned once.
#[tokio::test]
async fn the_policy_refuses_before_anything_is_applied() {
    let policy = Policy::from_yaml(
        "initContainerNamespaces: [infra]\nsysctlImage: registry.example/c10m/server@sha256:0000000000000000000000000000000000000000000000000000000000000000\n",
    )
    .unwrap();
    let nothing_applied = |calls: &[Call]| {
        calls
            .iter()
            .all(|c| c.method == Method::GET || c.path() == FLEET_STATUS || c.path() == EVENTS)
    };
    let mut refused = Vec::new();
    for (spec, reason, field) in [
        (
            json!({"connections": 1_000_000, "node": {"memory": "256Gi", "cpus": 64},
                   "sysctls": {"mode": "PodSecurityContext"},
                   "placement": {"tolerations": [{"key": "dedicated", "value": "edge"}, {"operator": "Exists"}]}}),
            Reason::TolerationNotAllowed,
            "spec.placement.tolerations[1] ",
        ),
        (
            feasible(),
            Reason::SysctlModeNotAllowed,
            "spec.sysctls.mode: InitContainer",
        ),
    ] {
        let cached = fleet(spec);
        let h = Harness::start_under(Cluster::with_fleet(&cached), policy.clone());
        let action = h
            .reconcile(&cached)
            .await
            .expect("a refusal is not an error");
        assert_eq!(action, Action::requeue(RESYNC));
        let calls = h.api.take();
        let written = status_writes(&calls);
        assert_eq!(written.len(), 1, "{calls:#?}");
        let (status, got, message) = condition(&written[0], "Degraded");
        assert_eq!((status.as_str(), got.as_str()), ("True", reason.as_str()));
        assert!(message.starts_with(field), "{message}");
        assert_eq!(condition(&written[0], "Ready").0, "False");
        let warned = warnings(&calls);
        assert_eq!(warned.len(), 1, "{warned:#?}");
        assert_warning(&warned[0], reason, "Plan", &message);
        assert!(nothing_applied(&calls), "{calls:#?}");
        refused.push(message);
    }
    assert!(
        refused[1].contains("set spec.sysctls.mode: PodSecurityContext"),
        "{}",
        refused[1]
    );

    // Where the policy allows it, the privileged container runs the
    // policy's image, and no shard pod mounts a ServiceAccount token.
    let cached = fleet(json!({"connections": 10_000_000, "node": {"memory": "256Gi", "cpus": 64}}));
    let mut allowed = policy.clone();
    allowed.init_container_namespaces = vec![NS.into()];
    let h = Harness::start_under(Cluster::with_fleet(&cached), allowed.clone());
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    let applied: Vec<&Call> = writes_to(&calls, DEPLOYMENT)
        .into_iter()
        .filter(|c| !c.query().contains(ROLLOUT_MANAGER))
        .collect();
    assert_eq!(applied.len(), 1, "{calls:#?}");
    let pod = &applied[0].body.as_ref().unwrap()["spec"]["template"]["spec"];
    assert_eq!(
        pod["initContainers"][0]["image"],
        allowed.sysctl_image.as_str()
    );
    assert_eq!(pod["automountServiceAccountToken"], false);
}

/// Issue 13: in a cluster the nodes size the plan, never the fleet's
/// `spec.node` claim: a 1 PiB, 100,000-CPU claim on an 8 GiB, 4-CPU node is
/// planned, and its node-level sysctls raised, for the node, and
/// `status.plan.nodeSource` says the claim was passed over.
#[tokio::test]
async fn a_claim_bigger_than_the_nodes_is_planned_and_raised_for_the_nodes() {
    let cached = fleet(json!({
        "connections": 100_000_000,
        "node": {"memory": "1Pi", "cpus": 100_000},
        "shard": {"cpus": 2}
    }));
    let mut cluster = Cluster::with_fleet(&cached);
    cluster.objects.insert(
        format!("{NODES}/small"),
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "small"},
            "status": {"allocatable": {"memory": "8Gi", "cpu": "4", "pods": "110"}}
        }),
    );
    let h = Harness::start(cluster);
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    assert!(
        calls.iter().any(|c| c.is(Method::GET, NODES)),
        "the nodes are listed although spec.node gives every size: {calls:#?}"
    );
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    let plan = &written[0]["plan"];
    assert_eq!(plan["nodeMemoryBytes"], json!(8i64 << 30), "{plan}");
    assert_eq!(plan["nodeCpus"], 4, "{plan}");
    assert_eq!(plan["nodePods"], 110, "{plan}");
    assert_eq!(
        plan["nodeSource"],
        json!({"memory": "ClusterBelowSpec", "cpus": "ClusterBelowSpec", "pods": "Cluster"})
    );
    assert_eq!(
        plan["sysctls"]["net.netfilter.nf_conntrack_max"], "1261600",
        "two 2-CPU shards on the 8 GiB node, not the claim's 67108800: {plan}"
    );
    assert!(plan.get("sysctlsCapped").is_none(), "{plan}");
    let applied = writes_to(&calls, DEPLOYMENT);
    let init = &applied[0].body.as_ref().unwrap()["spec"]["template"]["spec"]["initContainers"][0];
    assert!(
        init["args"].as_array().unwrap().contains(&json!(
            "--raise-node=net.netfilter.nf_conntrack_max=1261600"
        )),
        "{init}"
    );
}

#[tokio::test]
async fn an_unchanged_rolled_out_fleet_writes_no_status_and_sends_no_event() {
    let cached = fleet(feasible());
    let h = Harness::start(Cluster {
        ready: true,
        ..Cluster::with_fleet(&cached)
    });

    // First pass: the fleet is planned, applied and reported.
    h.reconcile(&cached).await.unwrap();
    let first = h.api.take();
    let written = status_writes(&first);
    assert_eq!(written.len(), 1, "{first:#?}");
    assert_eq!(condition(&written[0], "Ready").0, "True");
    assert_eq!(condition(&written[0], "Degraded").0, "False");
    let evs = events(&first);
    assert_eq!(evs.len(), 1, "{evs:#?}");
    assert_eq!(
        (&evs[0]["type"], &evs[0]["reason"]),
        (&json!("Normal"), &json!("PlanChanged"))
    );
    assert_eq!(
        writes_to(&first, SECRETS).len(),
        1,
        "the admin Secret is created once"
    );
    // Without watch caches, each object the fleet would own is read once
    // (the owner check and the Deployment's replicas share the read).
    for path in [DEPLOYMENT, SERVICE, PDB, SECRET] {
        let reads = first.iter().filter(|c| c.is(Method::GET, path)).count();
        assert_eq!(reads, 1, "{path}: {first:#?}");
    }
    // The gate between rollout steps is set once, outside a rollout to the
    // plan's step (a cap's drain), under its own field manager.
    let plan = written[0]["plan"].clone();
    let gates: Vec<&Call> = writes_to(&first, DEPLOYMENT)
        .into_iter()
        .filter(|c| c.query().contains(ROLLOUT_MANAGER))
        .collect();
    assert_eq!(gates.len(), 1, "{first:#?}");
    assert_eq!(
        gates[0].body.as_ref().unwrap()["spec"]["minReadySeconds"],
        plan["rolloutStepSeconds"]
    );

    // Second pass: the stored status is what reconcile would write.
    let stored = h.stored_fleet();
    let action = h.reconcile(&cached).await.unwrap();
    assert_eq!(action, Action::requeue(RESYNC));
    let calls = h.api.take();
    assert_eq!(status_writes(&calls), Vec::<Value>::new(), "{calls:#?}");
    assert_eq!(events(&calls), Vec::<Value>::new(), "{calls:#?}");
    assert_eq!(h.stored_fleet().status, stored.status);
    assert!(writes_to(&calls, SECRETS).is_empty());
    // The objects are applied again (idempotent server-side apply), and
    // nothing else is written.
    for path in [DEPLOYMENT, SERVICE, PDB] {
        let applies = writes_to(&calls, path);
        assert_eq!(applies.len(), 1, "{path}: {calls:#?}");
        assert_eq!(applies[0].method, Method::PATCH);
        assert!(
            applies[0].query().contains("fieldManager=c10m-operator")
                && applies[0].query().contains("force=true"),
            "{}",
            applies[0].uri
        );
    }
    let other_writes: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method != Method::GET && ![DEPLOYMENT, SERVICE, PDB].contains(&c.path()))
        .collect();
    assert!(other_writes.is_empty(), "{other_writes:#?}");
    // The Deployment as applied runs the planned shards.
    let deployment: Deployment =
        serde_json::from_value(writes_to(&calls, DEPLOYMENT)[0].body.clone().unwrap()).unwrap();
    let plan = stored.status.unwrap().plan.unwrap();
    assert_eq!(deployment.spec.unwrap().replicas, Some(plan.shards));
}

#[tokio::test]
async fn a_foreign_deployment_is_an_object_conflict_and_is_left_alone() {
    let cached = fleet(feasible());
    let mut cluster = Cluster::with_fleet(&cached);
    let foreign = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": "d0d0d0d0-0000-4000-8000-000000000001",
            "ownerReferences": [{
                "apiVersion": "c10m.dev/v1alpha1",
                "kind": "ConnectionFleet",
                "name": NAME,
                "uid": "0ther000-0000-4000-8000-000000000002",
                "controller": true
            }]
        },
        "spec": {
            "selector": {"matchLabels": {"app": "theirs"}},
            "template": {
                "metadata": {"labels": {"app": "theirs"}},
                "spec": {"containers": [{"name": "app", "image": "theirs:1"}]}
            }
        }
    });
    // It must parse as a Deployment, as the operator reads it.
    let _: Deployment = serde_json::from_value(foreign.clone()).unwrap();
    cluster.objects.insert(DEPLOYMENT.into(), foreign.clone());
    let h = Harness::start(cluster);

    let action = h
        .reconcile(&cached)
        .await
        .expect("a conflict is a rejection");
    assert_eq!(action, Action::requeue(RESYNC));
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    let message = "Deployment edge already exists and is not owned by this ConnectionFleet; rename the fleet or remove the Deployment";
    assert_eq!(
        condition(&written[0], "Degraded"),
        ("True".into(), "ObjectConflict".into(), message.into())
    );
    let warned = warnings(&calls);
    assert_eq!(warned.len(), 1, "{calls:#?}");
    assert_warning(&warned[0], Reason::ObjectConflict, "Plan", message);
    for path in [DEPLOYMENT, SERVICE, PDB, SECRETS] {
        assert!(writes_to(&calls, path).is_empty(), "{path}: {calls:#?}");
    }
    assert_eq!(h.cluster.lock().unwrap().objects[DEPLOYMENT], foreign);
}

#[tokio::test]
async fn an_apply_error_is_reported_once_and_retried_with_growing_backoff() {
    let cached = fleet(feasible());
    let h = Harness::start(Cluster {
        ready: true,
        fail_deployment_apply: Some((500, "etcdserver: request timed out".into())),
        ..Cluster::with_fleet(&cached)
    });
    let message = "apply Deployment edge: etcdserver: request timed out (500)";
    let fleet = Arc::new(cached.clone());

    // reconcile → ctx.finished → error_policy, as the controller runs them.
    let mut waits = Vec::new();
    for pass in 1..=3 {
        let err = h.reconcile(&cached).await.expect_err("the apply failed");
        assert!(matches!(err, Error::Apply { .. }), "{err:?}");
        assert_eq!(err.reason(), Reason::ApplyFailed);
        assert_eq!(err.metric_label(), "apply_error");
        assert_eq!(err.to_string(), message);
        let failures = h
            .ctx
            .finished(&cached, Some(&err), Duration::from_millis(5));
        assert_eq!(failures, pass);
        waits.push(error_policy(fleet.as_ref(), &err, h.ctx.clone()));

        let calls = h.api.take();
        let deployment_applies = writes_to(&calls, DEPLOYMENT);
        assert_eq!(deployment_applies.len(), 1, "{calls:#?}");
        assert_eq!(
            (
                writes_to(&calls, SERVICE).len(),
                writes_to(&calls, PDB).len()
            ),
            (1, 1),
            "the Service and the budget are applied beside the Deployment"
        );
        let written = status_writes(&calls);
        if pass == 1 {
            assert_eq!(written.len(), 1, "{calls:#?}");
            assert_eq!(
                condition(&written[0], "Degraded"),
                ("True".into(), "ApplyFailed".into(), message.into())
            );
            assert_eq!(
                condition(&written[0], "Progressing").2,
                "retrying with backoff"
            );
            assert!(written[0]["plan"]["shards"].as_i64().unwrap() > 0);
            let warned = warnings(&calls);
            assert_eq!(warned.len(), 1, "{calls:#?}");
            assert_warning(&warned[0], Reason::ApplyFailed, "Reconcile", message);
        } else {
            // The same failure again: already on the fleet, not repeated.
            assert_eq!(written, Vec::<Value>::new(), "pass {pass}: {calls:#?}");
            assert_eq!(events(&calls), Vec::<Value>::new(), "pass {pass}");
        }
    }
    assert_eq!(
        waits,
        [2, 4, 8].map(|s| Action::requeue(Duration::from_secs(s))),
        "backoff doubles per consecutive failure"
    );

    // The API recovers: the fleet is applied and the failure count resets.
    h.cluster.lock().unwrap().fail_deployment_apply = None;
    let action = h.reconcile(&cached).await.expect("applied");
    assert_eq!(action, Action::requeue(RESYNC));
    assert_eq!(h.ctx.finished(&cached, None, Duration::from_millis(5)), 0);
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1);
    assert_eq!(condition(&written[0], "Degraded").0, "False");
    assert_eq!(condition(&written[0], "Ready").0, "True");

    // A later failure is news again, and its backoff starts over.
    h.cluster.lock().unwrap().fail_deployment_apply =
        Some((503, "the server is shutting down".into()));
    let err = h.reconcile(&cached).await.expect_err("the apply failed");
    assert_eq!(h.ctx.finished(&cached, Some(&err), Duration::ZERO), 1);
    assert_eq!(
        error_policy(fleet.as_ref(), &err, h.ctx.clone()),
        Action::requeue(Duration::from_secs(2))
    );
    let calls = h.api.take();
    assert_one_degraded_write(
        &calls,
        "ApplyFailed",
        "apply Deployment edge: the server is shutting down (503)",
    );
    // Within kube's event cache TTL (6 min) the Recorder folds an event
    // with the same type, reason, action and object into the first one's
    // series (a merge PATCH, count 2) and keeps the first note: the new
    // message is in the status condition above, not in the event.
    let warned = warnings(&calls);
    assert_eq!(warned.len(), 1, "{calls:#?}");
    assert_eq!(
        (&warned[0]["reason"], &warned[0]["action"]),
        (&json!("ApplyFailed"), &json!("Reconcile"))
    );
    assert_eq!(warned[0]["series"]["count"], 2, "{}", warned[0]);
    let event_writes: Vec<&Call> = calls
        .iter()
        .filter(|c| c.path().starts_with(EVENTS))
        .collect();
    assert_eq!(event_writes.len(), 1);
    assert_eq!(event_writes[0].method, Method::PATCH);
}

/// A ReplicaSet of the fleet's Deployment whose pods PodSecurity refuses,
/// as the ReplicaSet controller records it.
fn refused_replica_set() -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": "edge-5d8f7c9b4",
            "namespace": NS,
            "uid": "0e0e0e0e-0000-4000-8000-00000000000e",
            "labels": {"c10m.dev/fleet": NAME},
            "annotations": {"deployment.kubernetes.io/revision": "1"},
            "ownerReferences": [{
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": NAME,
                "uid": DEPLOYMENT_UID,
                "controller": true
            }]
        },
        "spec": {"selector": {"matchLabels": {"c10m.dev/fleet": NAME}}},
        "status": {
            "replicas": 0,
            "conditions": [{
                "type": "ReplicaFailure",
                "status": "True",
                "reason": "FailedCreate",
                "message": "pods \"edge-5d8f7c9b4-x2k9q\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes (volume \"host-proc\"), privileged (container \"sysctls\" must not set securityContext.privileged=true)"
            }]
        }
    })
}

/// Listed through the API, or read from the watches' stores (outside a
/// rollout, with no list sent), the refusal reads the same.
#[tokio::test]
async fn a_workload_whose_pods_are_refused_is_degraded_and_warned_once() {
    for cached_stores in [false, true] {
        workload_refused(cached_stores).await;
    }
}

async fn workload_refused(cached_stores: bool) {
    let cached = fleet(feasible());
    let rs_path = format!("{REPLICA_SETS}/edge-5d8f7c9b4");
    let mut cluster = Cluster::with_fleet(&cached);
    cluster
        .objects
        .insert(rs_path.clone(), refused_replica_set());
    let h = match cached_stores {
        false => Harness::start(cluster),
        true => Harness::start_cached(cluster),
    };
    let listed = |calls: &[Call], path: &str| calls.iter().any(|c| c.is(Method::GET, path));

    let action = h.reconcile(&cached).await.expect("not an operator error");
    assert_eq!(action, Action::requeue(ROLLOUT_RECHECK));
    let calls = h.api.take();
    match cached_stores {
        false => assert!(
            calls.iter().any(|c| c.is(Method::GET, REPLICA_SETS)
                && c.query().contains("labelSelector=c10m.dev%2Ffleet%3Dedge")),
            "ReplicaSets listed by the fleet label: {calls:#?}"
        ),
        true => assert!(
            !listed(&calls, REPLICA_SETS) && !listed(&calls, PODS),
            "read from the stores: {calls:#?}"
        ),
    }
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    let (status, reason, message) = condition(&written[0], "Degraded");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "PodSecurityForbidden")
    );
    assert!(
        message.starts_with("ReplicaSet edge-5d8f7c9b4 cannot create pods: pods \"edge-5d8f7c9b4-x2k9q\" is forbidden: violates PodSecurity")
            && message.ends_with("To fix: set spec.sysctls.mode: PodSecurityContext, or label the namespace pod-security.kubernetes.io/enforce=privileged"),
        "{message}"
    );
    assert_eq!(condition(&written[0], "Ready").1, "ShardsNotReady");
    let warned = warnings(&calls);
    assert_eq!(warned.len(), 1, "{calls:#?}");
    assert_warning(
        &warned[0],
        Reason::PodSecurityForbidden,
        "Rollout",
        &message,
    );

    // Still refused: nothing new to write or say.
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    assert_eq!(status_writes(&calls), Vec::<Value>::new(), "{calls:#?}");
    assert_eq!(events(&calls), Vec::<Value>::new(), "{calls:#?}");

    // The ReplicaSet controller clears the condition once pods are created,
    // and the Deployment's status counts them ready.
    {
        let mut c = h.cluster.lock().unwrap();
        c.objects.get_mut(&rs_path).unwrap()["status"] = json!({"replicas": 3});
        c.ready = true;
        let status = &mut c.objects.get_mut(DEPLOYMENT).unwrap()["status"];
        status["readyReplicas"] = status["replicas"].clone();
    }
    if cached_stores {
        h.sync_caches();
    }
    assert_eq!(h.reconcile(&cached).await.unwrap(), Action::requeue(RESYNC));
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    assert_eq!(condition(&written[0], "Degraded").1, "AsPlanned");
    assert_eq!(condition(&written[0], "Ready").0, "True");
    assert_eq!(warnings(&calls), Vec::<Value>::new());
    assert!(
        !listed(&calls, PODS),
        "pods are listed only while replicas are missing: {calls:#?}"
    );
}

#[tokio::test]
async fn a_secret_without_a_token_waits_for_a_person() {
    let cached = fleet(feasible());
    let mut cluster = Cluster::with_fleet(&cached);
    cluster.objects.insert(
        SECRET.into(),
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "edge-admin",
                "namespace": NS,
                "ownerReferences": [{
                    "apiVersion": "c10m.dev/v1alpha1",
                    "kind": "ConnectionFleet",
                    "name": NAME,
                    "uid": UID,
                    "controller": true
                }]
            },
            "data": {"other": "eA=="}
        }),
    );
    let h = Harness::start(cluster);
    let err = h.reconcile(&cached).await.expect_err("no token");
    assert!(matches!(err, Error::AdminSecretInvalid { .. }), "{err:?}");
    assert_eq!(h.ctx.finished(&cached, Some(&err), Duration::ZERO), 1);
    assert_eq!(
        error_policy(&cached, &err, h.ctx.clone()),
        Action::requeue(MAX_BACKOFF),
        "no fast retry: the Secret needs a person"
    );
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1);
    let (status, reason, message) = condition(&written[0], "Degraded");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "ReconcileFailed")
    );
    assert!(
        message.starts_with("Secret edge-admin has no usable `token` key"),
        "{message}"
    );
    assert_eq!(warnings(&calls).len(), 1);
    for path in [DEPLOYMENT, SERVICE, PDB, SECRETS, SECRET] {
        assert!(writes_to(&calls, path).is_empty(), "{path}: {calls:#?}");
    }
}

#[tokio::test]
async fn a_fleet_read_without_a_uid_is_a_reported_error_not_a_panic() {
    let mut cached = fleet(feasible());
    cached.metadata.uid = None;
    let h = Harness::start(Cluster::with_fleet(&cached));
    let err = h.reconcile(&cached).await.expect_err("no uid");
    assert!(matches!(err, Error::Malformed { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "ConnectionFleet edge as read has no metadata.uid"
    );
    assert_eq!(err.reason(), Reason::ReconcileFailed);
    let calls = h.api.take();
    let written = status_writes(&calls);
    assert_eq!(written.len(), 1, "{calls:#?}");
    assert_eq!(condition(&written[0], "Degraded").1, "ReconcileFailed");
    for path in [DEPLOYMENT, SERVICE, PDB, SECRETS] {
        assert!(writes_to(&calls, path).is_empty(), "{path}: {calls:#?}");
    }
}

/// Issue 23: a reconcile handed a fleet this process has not written yet
/// (a new fleet, or the first reconcile after a start), or the fleet at
/// the version this process last wrote (the watch has caught up with its
/// status write), or a newer generation (a re-plan) takes it from the
/// cache, not with a GET; a copy from before the last write (a stale
/// cache) is read again.
#[tokio::test]
async fn a_fleet_the_cache_holds_as_last_written_is_not_read_again() {
    let cached = fleet(feasible());
    let h = Harness::start(Cluster::with_fleet(&cached));
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    assert!(
        !calls.iter().any(|c| c.is(Method::GET, FLEET)),
        "{calls:#?}"
    );
    assert_eq!(status_writes(&calls).len(), 1, "{calls:#?}");
    // The watch delivers the fleet as written: no GET, and nothing to write.
    let written = h.stored_fleet();
    assert_ne!(
        written.metadata.resource_version,
        cached.metadata.resource_version
    );
    h.reconcile(&written).await.unwrap();
    let calls = h.api.take();
    assert!(
        !calls.iter().any(|c| c.is(Method::GET, FLEET)),
        "{calls:#?}"
    );
    assert!(status_writes(&calls).is_empty(), "{calls:#?}");
    // A stale copy (from before the write) is read again, and the status
    // it lacks is not written once more.
    h.reconcile(&cached).await.unwrap();
    let calls = h.api.take();
    assert!(calls.iter().any(|c| c.is(Method::GET, FLEET)), "{calls:#?}");
    assert!(status_writes(&calls).is_empty(), "{calls:#?}");
}

#[tokio::test]
async fn a_deleted_fleet_is_left_alone() {
    let cached = fleet(feasible());
    let h = Harness::start(Cluster::with_fleet(&cached));
    // Reconciled once (its status written), then deleted; the reconcile
    // handed the copy from before that write reads the fleet again.
    h.reconcile(&cached).await.unwrap();
    h.api.take();
    h.cluster.lock().unwrap().objects.remove(FLEET);
    let action = h.reconcile(&cached).await.unwrap();
    assert_eq!(action, Action::await_change());
    let calls = h.api.calls();
    assert_eq!(calls.len(), 1, "{calls:#?}");
    assert!(calls[0].is(Method::GET, FLEET));
}

/// Issue 22, item 3: a change of the pod template made while a rollout's
/// step drains is not applied until the drain ends (applied mid-drain, the
/// Deployment controller would start a second drain on top, ADR 0011), and
/// the gate is held meanwhile so no step starts; the drain over, the
/// template is applied.
#[tokio::test]
async fn a_template_change_mid_drain_waits_for_the_drain_to_end() {
    let cached = fleet(feasible());
    let h = Harness::start(Cluster {
        ready: true,
        ..Cluster::with_fleet(&cached)
    });
    h.reconcile(&cached).await.unwrap();
    h.api.take();
    let plan = h.stored_fleet().status.unwrap().plan.unwrap();

    let change = |drain_ends_in: i64| {
        let until = k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_secs(drain_ends_in);
        let mut c = h.cluster.lock().unwrap();
        let f = c.objects.get_mut(FLEET).unwrap();
        f["spec"]["server"] = json!({"image": "c10m.local/server:next"});
        f["status"]["rollout"] = json!({
            "revision": 2, "updatedShards": 2, "oldShards": 2, "cordonedShards": 2,
            "drainingShards": 2, "closesPerSecond": 200, "drainingUntil": until.to_string(),
        });
    };
    let applied_images = |calls: &[Call]| -> Vec<Value> {
        writes_to(calls, DEPLOYMENT)
            .into_iter()
            .filter(|c| !c.query().contains(ROLLOUT_MANAGER))
            .map(|c| {
                c.body.as_ref().unwrap()["spec"]["template"]["spec"]["containers"][0]["image"]
                    .clone()
            })
            .collect()
    };

    change(30);
    h.reconcile(&h.stored_fleet()).await.unwrap();
    let calls = h.api.take();
    assert_eq!(applied_images(&calls), Vec::<Value>::new(), "{calls:#?}");
    let gates: Vec<Value> = writes_to(&calls, DEPLOYMENT)
        .into_iter()
        .filter(|c| c.query().contains(ROLLOUT_MANAGER))
        .map(|c| c.body.as_ref().unwrap()["spec"]["minReadySeconds"].clone())
        .collect();
    let held = plan.rollout_step_seconds + c10m_operator::rollout::REQUEUE_MARGIN_SECONDS;
    assert_eq!(gates, vec![json!(held)], "{calls:#?}");

    change(-1);
    h.reconcile(&h.stored_fleet()).await.unwrap();
    let calls = h.api.take();
    assert_eq!(
        applied_images(&calls),
        vec![json!("c10m.local/server:next")],
        "{calls:#?}"
    );
}

/// Issue 23: a Service apply the API server is slow to answer (it creates
/// Services one at a time) holds no reconcile past `SERVICE_WAIT`: the
/// reconcile applies the Deployment, reports and ends. As the apply ends
/// the fleet is sent for another reconcile, which takes its outcome (here
/// a failure, reported as any failed apply) without applying again; the
/// retry after the backoff applies anew.
#[tokio::test(start_paused = true)]
async fn a_slow_service_apply_holds_no_reconcile_and_its_end_is_reported() {
    let cached = fleet(feasible());
    let (open, gate) = watch::channel(false);
    let message = "Service \"edge\" is invalid: spec.ports[0].nodePort: Invalid value: 30080: provided port is already allocated";
    let h = Harness::start(Cluster {
        ready: true,
        fail_service_apply: Some((422, message.into())),
        hold: Some((Method::PATCH, SERVICE, gate)),
        ..Cluster::with_fleet(&cached)
    });
    let mut ended = h.ctx.service_applies_ended().expect("not taken yet");

    let started = tokio::time::Instant::now();
    let action = h.reconcile(&cached).await.expect("the reconcile ends");
    assert_eq!(
        started.elapsed(),
        SERVICE_WAIT,
        "it waited for the Service that long"
    );
    assert_eq!(action, Action::requeue(RESYNC));
    let calls = h.api.take();
    let applied = |path| {
        writes_to(&calls, path)
            .iter()
            .filter(|c| c.query().contains("force=true"))
            .count()
    };
    assert_eq!(
        (applied(DEPLOYMENT), applied(SERVICE)),
        (1, 1),
        "{calls:#?}"
    );
    assert_eq!(condition(&status_writes(&calls)[0], "Ready").0, "True");
    assert!(ended.try_recv().is_err(), "no apply has ended yet");

    // A reconcile while it runs starts no second apply, and does not read
    // the Service it is making to check its owner.
    let again = h
        .reconcile(&h.stored_fleet())
        .await
        .expect("the reconcile ends");
    assert_eq!(again, Action::requeue(RESYNC));
    let calls = h.api.take();
    assert_eq!(writes_to(&calls, SERVICE).len(), 0);
    assert!(
        !calls.iter().any(|c| c.is(Method::GET, SERVICE)),
        "{calls:#?}"
    );

    open.send(true).unwrap();
    let sent = ended
        .next()
        .await
        .expect("the fleet is sent as the apply ends");
    assert_eq!(sent, ObjectRef::from_obj(&cached));
    let err = h
        .reconcile(&h.stored_fleet())
        .await
        .expect_err("the apply failed");
    assert!(matches!(err, Error::Apply { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("apply Service edge: {message} (422)")
    );
    let calls = h.api.take();
    assert_eq!(
        writes_to(&calls, SERVICE).len(),
        0,
        "its outcome taken, not applied again"
    );
    let reported = format!("apply Service edge: {message} (422)");
    assert_one_degraded_write(&calls, "ApplyFailed", &reported);

    // Fixed: the retry applies the Service again, answered at once.
    h.cluster.lock().unwrap().fail_service_apply = None;
    h.reconcile(&h.stored_fleet()).await.expect("applied");
    let calls = h.api.take();
    assert_eq!(writes_to(&calls, SERVICE).len(), 1, "{calls:#?}");
    assert_eq!(condition(&status_writes(&calls)[0], "Degraded").0, "False");
    assert!(ended.try_recv().is_err(), "an apply waited for is not sent");
}

/// Issue 23: a new fleet (no status, no Deployment in the watch cache) has its admin
/// Secret created at once, not read first, beside the read of its other
/// objects: its Deployment is applied after two round trips, not three.
/// Once its Deployment is cached and its metrics loop does not run, a
/// re-plan applies while the Secret is read: the Deployment's apply does
/// not wait for that read (held here until the apply is seen).
#[tokio::test(start_paused = true)]
async fn a_new_fleet_creates_its_secret_unread_and_a_replan_applies_while_it_is_read() {
    let cached = fleet(feasible());
    let (open, gate) = watch::channel(false);
    let h = Harness::start_cached(Cluster {
        ready: true,
        ..Cluster::with_fleet(&cached)
    });

    h.reconcile(&cached).await.expect("applied");
    let calls = h.api.take();
    let secret_reads = |calls: &[Call]| calls.iter().filter(|c| c.is(Method::GET, SECRET)).count();
    assert_eq!(secret_reads(&calls), 0, "{calls:#?}");
    let created = writes_to(&calls, SECRETS);
    assert_eq!(created.len(), 1, "{calls:#?}");
    assert_eq!(
        created[0].body.as_ref().unwrap()["metadata"]["ownerReferences"][0]["uid"],
        UID
    );
    let applies = |calls: &[Call]| -> Vec<Value> {
        writes_to(calls, DEPLOYMENT)
            .into_iter()
            .filter(|c| c.query().contains("force=true"))
            .map(|c| c.body.clone().unwrap())
            .collect()
    };
    let first = applies(&calls);
    assert_eq!(first.len(), 1, "{calls:#?}");

    // The Deployment reaches the cache; the fleet is re-planned and its
    // Secret's read is slow.
    h.sync_caches();
    h.cluster.lock().unwrap().hold = Some((Method::GET, SECRET, gate));
    let mut replanned = h.stored_fleet();
    replanned.spec.connections = 2_000_000;
    bump(&mut replanned);
    let ctx = h.ctx.clone();
    let reconciling = tokio::spawn(reconcile(Arc::new(replanned), ctx));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!reconciling.is_finished(), "the Secret's read is held");
    let calls = h.api.take();
    assert_eq!(secret_reads(&calls), 1, "{calls:#?}");
    let applied = applies(&calls);
    assert_eq!(
        applied.len(),
        1,
        "applied before the read returned: {calls:#?}"
    );
    assert_ne!(
        applied[0]["spec"], first[0]["spec"],
        "the re-plan's Deployment"
    );

    open.send(true).unwrap();
    let action = reconciling.await.unwrap().expect("reconciled");
    assert_eq!(action, Action::requeue(RESYNC));
    let calls = h.api.take();
    assert!(writes_to(&calls, SECRETS).is_empty(), "{calls:#?}");
    assert_eq!(condition(&status_writes(&calls)[0], "Degraded").0, "False");
}

/// Issue 23: the admin token read (or created) by one reconcile is kept
/// for the next ones: a settled fleet nobody changed reads no Secret (at
/// one read a sync, it was all the API reads of an autoscaled fleet's
/// metrics loop). A change of the fleet by anyone but the operator has it
/// read again, which is how a person who fixed the Secret has it seen
/// (`tests/tests/fleet.rs`).
#[tokio::test]
async fn a_kept_admin_token_is_read_again_only_after_someone_changes_the_fleet() {
    let cached = fleet(feasible());
    let h = Harness::start_cached(Cluster {
        ready: true,
        ..Cluster::with_fleet(&cached)
    });
    let secret_reads = |calls: &[Call]| calls.iter().filter(|c| c.is(Method::GET, SECRET)).count();

    h.reconcile(&cached).await.expect("applied");
    let calls = h.api.take();
    assert_eq!(writes_to(&calls, SECRETS).len(), 1, "{calls:#?}");
    assert_eq!(secret_reads(&calls), 0, "{calls:#?}");
    h.sync_caches();

    // The watch delivers the fleet as the operator wrote its status: the
    // token created above is used, nothing read, nothing created.
    for _ in 0..3 {
        h.reconcile(&h.stored_fleet()).await.expect("reconciled");
        let calls = h.api.take();
        assert_eq!(secret_reads(&calls), 0, "{calls:#?}");
        assert!(writes_to(&calls, SECRETS).is_empty(), "{calls:#?}");
    }

    // Someone annotates the fleet: a new resourceVersion, the same
    // generation. The Secret is read once, then kept again.
    let mut touched = h.stored_fleet();
    touched
        .annotations_mut()
        .insert("e2e.c10m.dev/poke".into(), "1".into());
    touch(&mut touched, 1);
    h.cluster
        .lock()
        .unwrap()
        .objects
        .insert(FLEET.into(), serde_json::to_value(&touched).unwrap());
    h.reconcile(&touched).await.expect("reconciled");
    let calls = h.api.take();
    assert_eq!(secret_reads(&calls), 1, "{calls:#?}");
    h.reconcile(&h.stored_fleet()).await.expect("reconciled");
    let calls = h.api.take();
    assert_eq!(secret_reads(&calls), 0, "{calls:#?}");
}
