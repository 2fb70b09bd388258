//! Controller wiring: what `c10m-operator run` watches (fleets, the objects
//! they own, node profiles), the CRD install at start-up, the operator's
//! own metrics endpoint, and the run configuration. Each reconcile is
//! [`crate::reconcile::reconcile`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, NodeSpec, NodeStatus, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::utils::{PredicateConfig, WatchStreamExt};
use kube::runtime::watcher::{self, watcher};
use kube::{Resource, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{CRD_SCHEMA_REVISION, ConnectionFleet};
use crate::autoscale;
use crate::events::Recorder;
use crate::names::{
    FIELD_MANAGER, FLEET_LABEL, MANAGED_BY_SELECTOR, NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION,
    SCHEMA_REVISION_ANNOTATION,
};
use crate::policy::Policy;
use crate::reason::{EventAction, Reason};
use crate::reconcile::cache::{Cache, KeptPod, KeptReplicaSet, Shards, Stored, stored_event};
use crate::reconcile::{self, Context, error_policy, reconcile};
use crate::unmanaged::{self, Unmanaged};

/// Reconciles run at once, at most: at a start or a leader's takeover every
/// fleet is due, and each reconcile reads its pods and ReplicaSets; a bound
/// keeps those reads (and the memory they take) from arriving all at once.
/// A reconcile mostly waits on the API server, so the bound is wide:
/// `make bench-scale` (1,000 fleets ramped at 20/s) saw apply → Deployment
/// p50 grow from 4.8 s to 48 s at 16 (issue 23).
pub const CONCURRENCY: u16 = 128;

/// Drops what no reconcile reads from a watched object before the stores
/// keep it: `managedFields` (often half an object's bytes;
/// `tests/store_heap.rs` measures it). The watches already parse objects
/// without them ([`watched`]); this keeps the stores free of them whatever
/// fed them.
pub fn lean<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

/// What the node store keeps of a node: what the fleets' node profiles
/// read ([`crate::plan::nodes::placeable`], [`crate::plan::nodes::observed`]:
/// its labels, the [`NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION`], its taints
/// and its allocatable), with its name, uid and `resourceVersion`. The
/// rest (conditions with their heartbeats, addresses, capacity, node and
/// image info, other annotations) is dropped: 500 KWOK nodes took 2.9 MB
/// of the operator's 31.0 MB heap at 1,000 fleets with only the image list
/// dropped (dhat, `docs/scale.md`, 2026-12-07).
pub fn lean_node(n: &mut Node) {
    let meta = std::mem::take(&mut n.metadata);
    let annotations = meta.annotations.and_then(|mut a| {
        let kept: BTreeMap<String, String> = a
            .remove_entry(NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION)
            .into_iter()
            .collect();
        (!kept.is_empty()).then_some(kept)
    });
    n.metadata = ObjectMeta {
        name: meta.name,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        annotations,
        ..ObjectMeta::default()
    };
    n.spec = n.spec.take().map(|s| NodeSpec {
        taints: s.taints,
        ..NodeSpec::default()
    });
    n.status = n.status.take().map(|s| NodeStatus {
        allocatable: s.allocatable,
        ..NodeStatus::default()
    });
}

/// Feeds the shard stores ([`Shards`]) until dropped: the pods and
/// ReplicaSets carrying the fleet label in `namespace` (every namespace
/// when `None`), read as [`KeptPod`]s and [`KeptReplicaSet`]s. Neither
/// triggers a reconcile: a fleet's Deployment brings it back when its pods
/// come and go. A watch that fails is retried with kube-runtime's default
/// backoff (a warning each time).
async fn watch_shards(
    client: Client,
    namespace: Option<String>,
    pod_writer: reflector::store::Writer<KeptPod>,
    set_writer: reflector::store::Writer<KeptReplicaSet>,
) {
    let (pods, sets): (Api<KeptPod>, Api<KeptReplicaSet>) = match &namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    let wc = watch_config().labels(FLEET_LABEL);
    fn warn_on<K>(
        what: &'static str,
    ) -> impl FnMut(Result<K, watcher::Error>) -> std::future::Ready<()> {
        move |r| {
            if let Err(error) = r {
                warn!(%error, "watching {what}; retrying");
            }
            std::future::ready(())
        }
    }
    // Nothing to make lean: both are read without what `lean` drops.
    let pods = watcher(pods, wc.clone()).default_backoff();
    let pods = keep(pods, lean, pod_writer).for_each(warn_on("shard pods"));
    let sets = watcher(sets, wc).default_backoff();
    let sets = keep(sets, lean, set_writer).for_each(warn_on("ReplicaSets"));
    futures::join!(pods, sets);
}

/// What a controller's store can keep: a namespaced or cluster object the
/// watcher can read and the reflector can share between tasks.
pub trait Kept:
    Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Kept for K where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// How every watch of the operator starts: its initial state streamed as
/// watch events (`sendInitialEvents`, the API server's `WatchList`, beta
/// and on by default since Kubernetes 1.32), not listed in pages of 500
/// that are read and parsed whole. A list page of Deployments is about 5 MB
/// of JSON and 12 MB parsed; a streamed object is parsed alone, so a start
/// or a relist no longer holds a page of every kind at once. An API server
/// without it answers the watch with an error and the watcher retries
/// (kube-runtime `InitialListStrategy::StreamingList`).
fn watch_config() -> watcher::Config {
    watcher::Config::default().streaming_lists()
}

/// The watch of `api`'s objects under `wc`, each parsed without its
/// `managedFields` ([`Unmanaged`]: never built, where parsing them and
/// freeing them again was the largest part of a watch event's CPU).
fn watched<K: Kept>(
    api: Api<Unmanaged<K>>,
    wc: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static {
    watcher(api, wc).map_ok(unmanaged::event)
}

/// The operator's own objects of kind `K` (labelled as managed by it) as
/// they change, each made [`lean`] and kept in `writer`'s store as compact
/// JSON ([`keep_compact`]).
fn owned<K: Kept + serde::Serialize>(
    api: Api<Unmanaged<K>>,
    writer: reflector::store::Writer<Stored<K>>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    let wc = watch_config().labels(MANAGED_BY_SELECTOR);
    keep_compact(watched(api, wc), writer)
}

/// [`keep`] for an owned-object store: each object made [`lean`] and kept
/// as its [`Stored`] form (LZ4-packed compact JSON) before it is passed on; the
/// object passed on only triggers its fleet's reconcile.
pub fn keep_compact<K: Kept + serde::Serialize>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    mut writer: reflector::store::Writer<Stored<K>>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    events
        .modify(lean)
        .inspect_ok(move |event| writer.apply_watcher_event(&stored_event(event)))
        .applied_objects()
}

/// The objects of the watch `events`, each made `lean` and kept in
/// `writer`'s store before it is passed on: what the controller's stores
/// hold (`tests/store_heap.rs` feeds it 1,000 fleets' objects).
pub fn keep<K: Kept>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    lean: fn(&mut K),
    writer: reflector::store::Writer<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    events.modify(lean).reflect(writer).applied_objects()
}

/// How `c10m-operator run` runs.
#[derive(Clone, Debug, Default)]
pub struct RunConfig {
    /// Watch only this namespace (`None`: all namespaces).
    pub namespace: Option<String>,
    /// This replica's name in events (the pod name).
    pub instance: Option<String>,
    /// Server-side apply the ConnectionFleet CRD at start-up, so upgrading
    /// the operator upgrades its schema (Helm never upgrades `crds/`);
    /// never over a CRD of a higher schema revision ([`apply_crd`]).
    pub manage_crd: bool,
    /// Prometheus the metrics loop reads (`None`: autoscaling and rebalancing hold).
    pub prometheus_url: Option<String>,
    /// The cluster admin's policy (`--policy-file`).
    pub policy: Policy,
}

/// What [`apply_crd`] does with the ConnectionFleet CRD it finds installed
/// ([`decide_crd`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CrdDecision {
    /// Apply ours: nothing is installed, or what is installed carries no
    /// revision, or one no higher than ours.
    Apply,
    /// Keep the installed CRD: it carries a higher schema revision than
    /// ours (a newer operator installed it), and applying ours would
    /// narrow its schema and prune the fields it added.
    KeepNewer {
        /// The installed CRD's revision.
        installed: u32,
    },
    /// Keep the installed CRD: its revision annotation is not a decimal
    /// integer this build can read, so it cannot tell whether ours is
    /// older; it never narrows what it cannot judge.
    KeepUnreadable {
        /// The annotation's value, as found.
        value: String,
    },
}

/// Decides whether to apply our CRD, of schema revision `ours`
/// ([`crate::api::CRD_SCHEMA_REVISION`]), over the installed one, whose
/// [`SCHEMA_REVISION_ANNOTATION`] is `installed` (`None`: no CRD is
/// installed, or it has no such annotation):
///
/// | installed annotation | decision | why |
/// |---|---|---|
/// | absent (or no CRD) | [`CrdDecision::Apply`] | a CRD from before schema revisions (or none): older than any revision |
/// | lower than `ours` | [`CrdDecision::Apply`] | the upgrade `--manage-crd` is for |
/// | equal to `ours` | [`CrdDecision::Apply`] | the same schema (a test pins one digest per revision): idempotent, and it puts back a hand edit and this operator's field ownership, as every start did before revisions |
/// | higher than `ours` | [`CrdDecision::KeepNewer`] | a newer operator's schema; ours would prune its fields |
/// | not a decimal integer (empty, signed, spaces, `1.5`, above `u32::MAX`) | [`CrdDecision::KeepUnreadable`] | it cannot be judged, and keeping a CRD never loses data |
///
/// Pure; [`apply_crd`] reads the annotation and acts on the decision.
pub fn decide_crd(installed: Option<&str>, ours: u32) -> CrdDecision {
    let Some(value) = installed else {
        return CrdDecision::Apply;
    };
    let revision = (!value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
        .then(|| value.parse::<u32>().ok())
        .flatten();
    match revision {
        None => CrdDecision::KeepUnreadable {
            value: value.to_string(),
        },
        Some(installed) if installed > ours => CrdDecision::KeepNewer { installed },
        Some(_) => CrdDecision::Apply,
    }
}

/// Installs this build's ConnectionFleet CRD ([`crate::api::crd`]), unless
/// the installed one carries a higher schema revision or one it cannot read
/// ([`decide_crd`]), and waits up to 60 s until the CRD is Established.
///
/// It reads the installed CRD (404: none), decides, and server-side applies
/// with field manager [`FIELD_MANAGER`] (forced) and the installed
/// `resourceVersion` as a precondition, so a CRD changed between the read
/// and the apply (another replica, a newer operator) is read and judged
/// again (up to 5 times) rather than overwritten. When it keeps the
/// installed CRD it logs a warning naming both revisions and publishes a
/// Warning event on the CRD (reason `NewerCRDInstalled` or
/// `CRDRevisionUnreadable`, in namespace `default`, where Kubernetes files
/// events of cluster-scoped objects; reporting instance `instance`), then
/// returns `Ok`: the operator runs on with the installed schema. It
/// ignores the fields it does not know, and fleets keep them; were a
/// newer schema to refuse a status it writes, that write fails and the
/// fleet's reconcile reports it.
///
/// # Errors
///
/// The CRD cannot be read or applied (RBAC, API down; the message names
/// `--manage-crd=false`), it changed under every attempt, or it is not
/// Established within 60 s. A failed event is only logged.
pub async fn apply_crd(client: &Client, instance: Option<String>) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut ours = crate::api::crd();
    let name = ours.metadata.name.clone().unwrap_or_default();
    const ATTEMPTS: u32 = 5;
    let mut attempt = 1;
    let (installed_revision, kept) = loop {
        let installed = api.get_opt(&name).await.map_err(|e| {
            anyhow::anyhow!("cannot read CRD {name} (start with --manage-crd=false where CRDs are managed elsewhere): {e}")
        })?;
        let annotation = installed.as_ref().and_then(|c| {
            c.metadata
                .annotations
                .as_ref()?
                .get(SCHEMA_REVISION_ANNOTATION)
                .cloned()
        });
        let decision = decide_crd(annotation.as_deref(), CRD_SCHEMA_REVISION);
        if decision != CrdDecision::Apply {
            // Only a CRD that exists is kept.
            let installed = installed.expect("a kept CRD is installed");
            break (annotation, Some((decision, installed)));
        }
        ours.metadata.resource_version = installed.and_then(|c| c.metadata.resource_version);
        match api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&ours),
            )
            .await
        {
            Ok(_) => break (annotation, None),
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < ATTEMPTS => {
                info!(crd = %name, attempt, "CRD changed since it was read; reading it again");
                attempt += 1;
            }
            Err(e) => anyhow::bail!(
                "cannot apply CRD {name} (start with --manage-crd=false where CRDs are managed elsewhere): {e}"
            ),
        }
    };
    if let Some((decision, installed)) = &kept {
        keep_crd(client, instance, decision, installed).await;
    }
    wait_established(&api, &name).await?;
    match kept {
        None => info!(
            crd = %name,
            revision = CRD_SCHEMA_REVISION,
            replaced = installed_revision.as_deref().unwrap_or("none"),
            "CRD applied and established"
        ),
        Some(_) => info!(crd = %name, "CRD kept as installed and established"),
    }
    Ok(())
}

/// Says why the installed CRD is kept ([`decide_crd`]): a warning log line
/// naming both revisions, and a Warning event on the CRD.
async fn keep_crd(
    client: &Client,
    instance: Option<String>,
    decision: &CrdDecision,
    installed: &CustomResourceDefinition,
) {
    let name = installed.metadata.name.clone().unwrap_or_default();
    let ours = CRD_SCHEMA_REVISION;
    let (reason, note) = match decision {
        CrdDecision::KeepNewer { installed } => {
            warn!(
                crd = %name,
                installed_revision = installed,
                operator_revision = ours,
                "CRD {name} carries schema revision {installed}, newer than this operator's {ours}: not applying the older CRD; running with the installed schema"
            );
            (
                Reason::NewerCrdInstalled,
                format!(
                    "{SCHEMA_REVISION_ANNOTATION} is {installed}, newer than this operator's revision {ours}: the operator kept the installed CRD (applying its own would prune the newer fields) and runs with it. Upgrade the operator to a version of revision {installed} or later."
                ),
            )
        }
        CrdDecision::KeepUnreadable { value } => {
            warn!(
                crd = %name,
                installed_revision = %value,
                operator_revision = ours,
                "CRD {name} carries schema revision {value:?}, which is not a revision this operator (revision {ours}) can read: not applying its CRD; running with the installed schema"
            );
            (
                Reason::CrdRevisionUnreadable,
                format!(
                    "{SCHEMA_REVISION_ANNOTATION} is {value:?}, not a decimal revision: the operator (revision {ours}) cannot tell whether its CRD is older, so it kept the installed one and runs with it. Apply the CRD of the operator you run (crds/connectionfleet.yaml) to resolve."
                ),
            )
        }
        CrdDecision::Apply => return,
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        },
    );
    let event = Event {
        type_: EventType::Warning,
        reason: reason.as_str().into(),
        note: Some(note),
        action: EventAction::ApplyCrd.as_str().into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &installed.object_ref(&())).await {
        warn!(crd = %name, reason = %reason, error = %e, "cannot publish the CRD's event");
    }
}

/// Waits up to 60 s (polling every 500 ms) until CRD `name` is Established.
async fn wait_established(api: &Api<CustomResourceDefinition>, name: &str) -> anyhow::Result<()> {
    for _ in 0..120 {
        let got = api
            .get(name)
            .await
            .map_err(|e| anyhow::anyhow!("cannot read CRD {name}: {e}"))?;
        let established = got.status.and_then(|s| s.conditions).is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if established {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("CRD {name} not Established after 60 s")
}

/// Hash of what a reconcile is asked for by on an object whose status no
/// reconcile reads: its spec (`metadata.generation`), labels, annotations
/// (a fleet's pause annotation), owner references and deletion
/// (kube-runtime keys the hashes by uid too, so an object deleted and
/// created again under its name passes as new). Not its status:
/// - a fleet's only the operator writes, and a reconcile triggered by its
///   own status write found nothing to do (the store still gets every
///   change; a reconcile reads the status there). Timed work (a drain's
///   end, the metrics loop's sync) is requeued by the reconcile that
///   starts it, not by its status write;
/// - a PodDisruptionBudget's the disruption controller rewrites as each
///   pod turns Ready or not, and nothing reads it.
///
/// A change of the spec, or of the labels or owner an apply sets, by
/// someone else still triggers the reconcile that applies it again.
pub fn spec_change_hash<K: Resource>(obj: &K) -> Option<u64> {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    hash_meta(obj, &mut h);
    Some(h.finish())
}

/// Feeds `h` what [`spec_change_hash`] hashes of `obj`'s metadata.
fn hash_meta<K: Resource>(obj: &K, h: &mut impl std::hash::Hasher) {
    use std::hash::Hash;
    let m = obj.meta();
    m.generation.hash(h);
    m.labels.hash(h);
    m.annotations.hash(h);
    for o in m.owner_references.iter().flatten() {
        (&o.uid, &o.kind, &o.name, o.controller).hash(h);
    }
    m.deletion_timestamp.is_some().hash(h);
}

/// Hash of what a reconcile reads of a fleet's Deployment: what
/// [`spec_change_hash`] covers, and of its status the counts and failures
/// the fleet's status and the rollout take from it (`observedGeneration`,
/// `replicas`, `updatedReplicas`, `readyReplicas`; a `ReplicaFailure`
/// that is True and a `Progressing` that is False, with reason and
/// message, which `status::workload_failure` quotes). Not the rest,
/// which no reconcile reads: `availableReplicas`, `unavailableReplicas`,
/// `terminatingReplicas`, the `Available` condition, a `Progressing`
/// that is True, and the conditions' update times. The Deployment
/// controller writes those on its own schedule: a new shard turns
/// available `minReadySeconds` (a cap's drain outside a rollout, ADR
/// 0011) after it is Ready, and each such write took a reconcile that
/// found nothing to do: `make bench-scale` counted 3,827 reconciles over
/// its ramp of 1,000 fleets without this filter and 2,852 with it, one
/// run each, side by side (issue 23, `docs/scale.md`).
pub fn deployment_change_hash(deployment: &Deployment) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    hash_meta(deployment, &mut h);
    if let Some(s) = &deployment.status {
        (
            s.observed_generation,
            s.replicas,
            s.updated_replicas,
            s.ready_replicas,
        )
            .hash(&mut h);
        for c in s.conditions.iter().flatten().filter(|c| {
            (c.type_ == "ReplicaFailure" && c.status == "True")
                || (c.type_ == "Progressing" && c.status == "False")
        }) {
            (&c.type_, &c.reason, &c.message).hash(&mut h);
        }
    }
    Some(h.finish())
}

/// Hash of what a node contributes to plans (what [`lean_node`] keeps):
/// its labels, its [`NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION`], its taints
/// (a fleet plans only for nodes it tolerates,
/// [`crate::plan::nodes::placeable`]) and its allocatable. Not its status
/// heartbeats.
fn node_profile_hash(node: &Node) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.metadata.labels.hash(&mut h);
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION))
        .hash(&mut h);
    for t in node.spec.iter().flat_map(|s| s.taints.iter().flatten()) {
        (&t.key, &t.value, &t.effect).hash(&mut h);
    }
    for (k, v) in node
        .status
        .iter()
        .flat_map(|s| s.allocatable.iter().flatten())
    {
        (k, &v.0).hash(&mut h);
    }
    Some(h.finish())
}

/// Starts serving `/metrics` and `/healthz` on `addr` (when set) and
/// returns the metrics the controller records into.
pub fn serve_metrics(addr: Option<String>) -> Arc<crate::telemetry::Metrics> {
    let metrics = Arc::new(crate::telemetry::Metrics::default());
    if let Some(addr) = addr {
        let m = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::telemetry::serve(addr, m).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
    }
    metrics
}

/// Runs the controller until SIGTERM/SIGINT (no leader election: this
/// process is the only one acting), recording into `metrics`.
pub async fn run(
    client: Client,
    config: RunConfig,
    metrics: Arc<crate::telemetry::Metrics>,
) -> anyhow::Result<()> {
    metrics.set_leader(true);
    run_controller(client, config, metrics).await
}

/// Seconds an idle connection to the API server stays open. kube-client's
/// own builder keeps every idle connection for ever (hyper-util's pool
/// without a timer): after a burst of [`CONCURRENCY`] reconciles the
/// operator held 143-167 idle connections, each with its TLS state and
/// read buffer (ADR 0012). 90 s is the Go client's `IdleConnTimeout`
/// (net/http's `DefaultTransport`, which client-go keeps).
pub const API_IDLE_SECONDS: u64 = 90;

/// Idle connections kept to the API server: the watches hold their own
/// (one each, never idle), so these serve the reconciles' requests between
/// bursts. client-go keeps 25 a host (`MaxIdleConnsPerHost` in
/// `k8s.io/apimachinery/pkg/util/net`'s `SetTransportDefaults`).
pub const API_MAX_IDLE: usize = 25;

/// A client from the kubeconfig or the pod's service account (as
/// `kube::Client::try_default`) that counts each request it sends into
/// `metrics` ([`crate::telemetry::Metrics::count_request`]), and closes
/// idle connections ([`API_IDLE_SECONDS`], [`API_MAX_IDLE`]).
///
/// It is kube-client's default stack (TLS, the config's timeouts, the
/// base URI, retries of 429/503/504 when the config asks for them, auth,
/// extra headers) over a connection pool with those limits, which
/// kube-client's builder does not expose. Errors: a config that cannot be
/// inferred, or a TLS or auth setup it describes that cannot be built.
pub async fn counting_client(metrics: Arc<crate::telemetry::Metrics>) -> anyhow::Result<Client> {
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt;
    use tower::ServiceBuilder;

    let config = kube::Config::infer().await?;
    let count = tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
        metrics.count_request(req.method(), req.uri().path());
        req
    });
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    let mut connector =
        hyper_timeout::TimeoutConnector::new(config.rustls_https_connector_with_connector(tcp)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let pool = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(API_IDLE_SECONDS))
        .pool_max_idle_per_host(API_MAX_IDLE)
        .build(connector);
    let retry = (config.default_retry)
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .layer(count)
        .map_err(tower::BoxError::from)
        .service(pool);
    Ok(Client::new(service, config.default_namespace))
}

/// Installs the CRD (when managed) and runs the controller until
/// SIGTERM/SIGINT, recording into `metrics`. With leader election this
/// runs only while the Lease is held ([`crate::leader::run`]).
pub async fn run_controller(
    client: Client,
    config: RunConfig,
    metrics: Arc<crate::telemetry::Metrics>,
) -> anyhow::Result<()> {
    if config.manage_crd {
        apply_crd(&client, config.instance.clone()).await?;
    }
    let namespace = config.namespace;
    let instance = config.instance;
    let (fleets, deps, svcs, pdbs) = match &namespace {
        Some(ns) => (
            Api::<Unmanaged<ConnectionFleet>>::namespaced(client.clone(), ns),
            Api::<Unmanaged<Deployment>>::namespaced(client.clone(), ns),
            Api::<Unmanaged<Service>>::namespaced(client.clone(), ns),
            Api::<Unmanaged<PodDisruptionBudget>>::namespaced(client.clone(), ns),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
        ),
    };
    // Fail fast with a clear message when the CRD is missing or RBAC forbids reading fleets.
    fleets
        .list(&ListParams::default().limit(1))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot list connectionfleets.c10m.dev (is the CRD applied and RBAC granted?): {e}"
            )
        })?;

    let prometheus = config
        .prometheus_url
        .as_deref()
        .map(autoscale::prometheus::Reader::new)
        .transpose()?;
    let policy = config.policy;
    info!(
        sysctl_image = %policy.sysctl_image,
        init_container_namespaces = ?policy.init_container_namespaces,
        reserved_taints = ?policy.reserved_taints,
        allowed_tolerations = policy.allowed_tolerations.len(),
        max_termination_grace_period_seconds = policy.max_termination_grace_period_seconds,
        sysctl_ceilings = ?policy.sysctl_ceilings,
        "policy"
    );
    // The watches feed the stores a reconcile reads (reconcile::cache) and
    // trigger the reconciles.
    let (fleet_store, fleet_writer) = reflector::store();
    let (deployments, deployment_writer) = reflector::store();
    let (services, service_writer) = reflector::store();
    let (pdb_store, pdb_writer) = reflector::store();
    let (nodes, node_writer) = reflector::store();
    // SIGTERM/SIGINT stops the controller (it finishes the reconciles under
    // way) and ends their waits for stores that have not listed yet.
    let stop = CancellationToken::new();
    let signal = tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown_signal().await;
            info!("signal received; finishing the reconciles under way");
            stop.cancel();
        }
    });
    let (pod_store, pod_writer) = reflector::store();
    let (set_store, set_writer) = reflector::store();
    let shards = Shards {
        pods: pod_store,
        replica_sets: set_store,
    };
    let shard_watches = tokio::spawn(watch_shards(
        client.clone(),
        namespace.clone(),
        pod_writer,
        set_writer,
    ));
    let cache = Cache::new(
        nodes,
        deployments,
        services,
        pdb_store,
        shards,
        stop.clone(),
    );
    let profiles = cache.profiles.clone();
    let ctx = Arc::new(
        Context::new(client.clone(), instance, metrics, prometheus)
            .with_policy(policy)
            .with_cache(cache),
    );
    info!(
        namespace = namespace.as_deref().unwrap_or("<all>"),
        "c10m-operator controller starting"
    );
    // The fleets are kept packed too ([`Stored`]; 4.9 kB a fleet as typed
    // objects at 1,000 fleets, docs/scale.md). What triggers a reconcile is
    // filtered typed, then packed again to name its fleet: only spec,
    // label, annotation and owner changes, a few per fleet.
    let fleet_events = keep_compact(watched(fleets, watch_config()), fleet_writer)
        .predicate_filter(spec_change_hash, PredicateConfig::default())
        .map_ok(|fleet| Stored::new(&fleet));
    let controller = Controller::for_stream(fleet_events, fleet_store)
        .with_config(controller::Config::default().concurrency(CONCURRENCY))
        .owns_stream(
            owned(deps, deployment_writer)
                .predicate_filter(deployment_change_hash, PredicateConfig::default()),
        )
        .owns_stream(owned(svcs, service_writer))
        .owns_stream(
            owned(pdbs, pdb_writer).predicate_filter(spec_change_hash, PredicateConfig::default()),
        );
    // Node profiles come from nodes' labels and allocatable: re-plan every
    // fleet when those change (not on the frequent node status heartbeats).
    let store = controller.store();
    // The profiles the reconciles take from the node store are worked out
    // again after a change of one (passed on below), a node deleted or a
    // relist. The epoch is bumped after `reflect`, never before: a profile
    // worked out at the new epoch must see the change (so not `keep`, whose
    // stages have no place for it between).
    let node_events = watched(Api::<Unmanaged<Node>>::all(client), watch_config())
        .modify(lean_node)
        .reflect(node_writer)
        .inspect_ok({
            let profiles = profiles.clone();
            move |event| {
                if matches!(event, watcher::Event::Delete(_) | watcher::Event::InitDone) {
                    profiles.changed();
                }
            }
        })
        .applied_objects();
    let node_profiles = node_events.predicate_filter(node_profile_hash, PredicateConfig::default());
    // A Service apply that failed after its reconcile stopped waiting for it
    // (reconcile::apply::ServiceApplies) is reported by the next reconcile.
    let services_ended = ctx
        .service_applies_ended()
        .expect("a new context's channel is taken once");
    let services_ended = services_ended.map(|fleet| {
        let ns = fleet.namespace.unwrap_or_default();
        ObjectRef::<Stored<ConnectionFleet>>::new(&fleet.name).within(&ns)
    });
    controller
        .reconcile_on(services_ended)
        .watches_stream(node_profiles, move |_node| {
            profiles.changed();
            store
                .state()
                .iter()
                .map(|f| ObjectRef::from_obj(f.as_ref()))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(
            |stored, ctx: Arc<Context>| async move {
                let started = Instant::now();
                let res = match stored.object() {
                    Some(fleet) => reconcile(Arc::new(fleet), ctx.clone()).await,
                    None => Err(reconcile::Error::Malformed {
                        what: format!(
                            "ConnectionFleet {} as kept does not read back",
                            stored.name_any()
                        ),
                    }),
                };
                ctx.finished(stored.as_ref(), res.as_ref().err(), started.elapsed());
                res
            },
            |stored, error, ctx| error_policy(stored.as_ref(), error, ctx),
            ctx,
        )
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(fleet = %obj.name, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile error"),
            }
        })
        .await;
    signal.abort();
    shard_watches.abort();
    info!("c10m-operator controller stopped");
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn each_installed_revision_is_decided() {
        // No CRD, or one from before schema revisions: older, applied.
        assert_eq!(decide_crd(None, 3), CrdDecision::Apply);
        // Lower (the upgrade) and equal (idempotent): applied.
        assert_eq!(decide_crd(Some("2"), 3), CrdDecision::Apply);
        assert_eq!(decide_crd(Some("0"), 3), CrdDecision::Apply);
        assert_eq!(decide_crd(Some("3"), 3), CrdDecision::Apply);
        assert_eq!(decide_crd(Some("003"), 3), CrdDecision::Apply);
        // Higher: a newer operator's CRD, kept.
        assert_eq!(
            decide_crd(Some("4"), 3),
            CrdDecision::KeepNewer { installed: 4 }
        );
        assert_eq!(
            decide_crd(Some("4294967295"), 3),
            CrdDecision::KeepNewer {
                installed: u32::MAX
            }
        );
        // Unreadable: kept, never narrowed.
        for value in [
            "",
            " 3",
            "3 ",
            "+3",
            "-1",
            "1.5",
            "three",
            "0x4",
            "4294967296",
        ] {
            assert_eq!(
                decide_crd(Some(value), 3),
                CrdDecision::KeepUnreadable {
                    value: value.into()
                },
                "{value:?}"
            );
        }
    }

    /// A status write, the operator's own, triggers no reconcile; a spec
    /// change (generation), an annotation (the pause), a label and a
    /// deletion each do.
    #[test]
    fn only_what_a_person_changes_on_a_fleet_triggers_its_reconcile() {
        let spec = serde_json::json!({"connections": 1000});
        let mut fleet = ConnectionFleet::new("edge", serde_json::from_value(spec).unwrap());
        fleet.metadata.generation = Some(1);
        let base = spec_change_hash(&fleet);
        let changed = |edit: &dyn Fn(&mut ConnectionFleet)| {
            let mut f = fleet.clone();
            edit(&mut f);
            spec_change_hash(&f)
        };
        let status = changed(&|f| {
            f.status = Some(Default::default());
            f.metadata.resource_version = Some("42".into());
        });
        assert_eq!(status, base);
        let triggers: [&dyn Fn(&mut ConnectionFleet); 4] = [
            &|f| f.metadata.generation = Some(2),
            &|f| {
                f.metadata.annotations =
                    Some([(crate::names::PAUSE_ANNOTATION.to_string(), "true".into())].into())
            },
            &|f| f.metadata.labels = Some([("team".to_string(), "a".to_string())].into()),
            &|f| {
                f.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ))
            },
        ];
        for (i, edit) in triggers.iter().enumerate() {
            assert_ne!(changed(*edit), base, "change {i} must trigger a reconcile");
        }
    }

    /// The disruption controller's status writes on a fleet's
    /// PodDisruptionBudget trigger no reconcile; a spec change or another
    /// owner does.
    #[test]
    fn a_budget_s_status_write_triggers_no_reconcile() {
        use k8s_openapi::api::policy::v1::PodDisruptionBudget;
        let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge", "namespace": "ns", "uid": "p1", "generation": 1,
                "ownerReferences": [{"apiVersion": "c10m.dev/v1alpha1",
                    "kind": "ConnectionFleet", "name": "edge", "uid": "f1", "controller": true}]},
            "spec": {"maxUnavailable": 1}
        }))
        .unwrap();
        let base = spec_change_hash(&pdb);
        let mut healthy = pdb.clone();
        healthy.status = serde_json::from_value(serde_json::json!({
            "currentHealthy": 3, "desiredHealthy": 2, "disruptionsAllowed": 1,
            "expectedPods": 3, "observedGeneration": 1
        }))
        .unwrap();
        healthy.metadata.resource_version = Some("77".into());
        assert_eq!(spec_change_hash(&healthy), base);
        let mut respecced = pdb.clone();
        respecced.metadata.generation = Some(2);
        assert_ne!(spec_change_hash(&respecced), base);
        let mut adopted = pdb.clone();
        adopted.metadata.owner_references.as_mut().unwrap()[0].uid = "f2".into();
        assert_ne!(spec_change_hash(&adopted), base);
    }

    /// The Deployment controller's availability writes on a fleet's
    /// Deployment trigger no reconcile; what the fleet's status and the
    /// rollout read (ready and updated counts, the observed generation, a
    /// failure) and a spec change do.
    #[test]
    fn a_deployment_s_availability_write_triggers_no_reconcile() {
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge", "namespace": "ns", "uid": "d1", "generation": 1},
            "spec": {"replicas": 3, "selector": {}, "template": {}},
            "status": {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3,
                "readyReplicas": 3, "unavailableReplicas": 3, "conditions": [
                    {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated",
                        "lastUpdateTime": "2026-12-05T10:00:00Z"},
                    {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"}]}
        }))
        .unwrap();
        let base = deployment_change_hash(&deployment);
        let changed = |status: serde_json::Value| {
            let mut d = deployment.clone();
            let mut s = serde_json::to_value(d.status.take()).unwrap();
            for (k, v) in status.as_object().unwrap() {
                s[k] = v.clone();
            }
            d.status = Some(serde_json::from_value(s).unwrap());
            d.metadata.resource_version = Some("78".into());
            deployment_change_hash(&d)
        };
        let available = changed(serde_json::json!({
            "availableReplicas": 3, "unavailableReplicas": 0, "terminatingReplicas": 1,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                    "lastUpdateTime": "2026-12-05T10:00:20Z"},
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}]
        }));
        assert_eq!(available, base);
        let triggers = [
            serde_json::json!({"readyReplicas": 2}),
            serde_json::json!({"updatedReplicas": 1}),
            serde_json::json!({"replicas": 5}),
            serde_json::json!({"observedGeneration": 2}),
            serde_json::json!({"conditions": [{"type": "Progressing", "status": "False",
                "reason": "ProgressDeadlineExceeded", "message": "timed out"}]}),
            serde_json::json!({"conditions": [{"type": "ReplicaFailure", "status": "True",
                "reason": "FailedCreate", "message": "quota"}]}),
        ];
        for (i, status) in triggers.into_iter().enumerate() {
            assert_ne!(changed(status), base, "change {i} must trigger a reconcile");
        }
        let mut respecced = deployment.clone();
        respecced.metadata.generation = Some(2);
        assert_ne!(deployment_change_hash(&respecced), base);
    }

    /// A node as a kubelet reports it: labels, annotations (the c10m one
    /// among others), a taint, capacity and allocatable, conditions with
    /// heartbeats, addresses, node info and images.
    fn kubelet_node() -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "uid": "u1", "resourceVersion": "7",
                "labels": {"kubernetes.io/hostname": "n1", "c10m.dev/cgroup-mode": "v1",
                    "c10m.dev/nofile-hard-limit": "1048576"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                    "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                    NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION: "net.ipv4.tcp_rmem,net.ipv4.tcp_wmem"}},
            "spec": {"podCIDR": "127.1.1.0/24", "providerID": "kwok://n1",
                "taints": [{"key": "dedicated", "value": "edge", "effect": "NoSchedule"}]},
            "status": {
                "capacity": {"cpu": "16", "memory": "64Gi", "pods": "110"},
                "allocatable": {"cpu": "15", "memory": "60Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                    "lastHeartbeatTime": "2026-12-07T07:00:00Z",
                    "lastTransitionTime": "2026-12-07T06:00:00Z"}],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.9"}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {"architecture": "amd64", "bootID": "b", "containerRuntimeVersion": "containerd://2",
                    "kernelVersion": "6.1", "kubeProxyVersion": "", "kubeletVersion": "v1.35.0",
                    "machineID": "m", "operatingSystem": "linux", "osImage": "Debian", "systemUUID": "s"},
                "images": [{"names": ["registry.local/c10m/server:dev"], "sizeBytes": 14800000}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn the_node_store_keeps_what_a_profile_reads_and_nothing_else() {
        use crate::plan::nodes;
        let full = kubelet_node();
        let mut kept = full.clone();
        lean_node(&mut kept);
        // The profile is the same from the kept node, tolerated or not.
        let edge = serde_json::from_value(serde_json::json!(
            {"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}
        ))
        .unwrap();
        for tolerations in [vec![], vec![edge]] {
            let profile = |n: &Node| {
                nodes::observed(&nodes::placeable(std::slice::from_ref(n), &tolerations))
            };
            assert_eq!(profile(&kept), profile(&full));
        }
        let facts = nodes::observed(&[kept.clone()]).expect("a profile");
        assert_eq!(facts.cpus, 15);
        assert_eq!(facts.memory_bytes, 60 << 30);
        assert!(facts.runtime.unsafe_sysctls.is_some());
        assert_eq!(node_profile_hash(&kept), node_profile_hash(&full));
        // Nothing else is kept.
        assert_eq!(
            serde_json::to_value(&kept).unwrap(),
            serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "uid": "u1", "resourceVersion": "7",
                    "labels": full.metadata.labels,
                    "annotations": {NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION:
                        "net.ipv4.tcp_rmem,net.ipv4.tcp_wmem"}},
                "spec": {"taints": [{"key": "dedicated", "value": "edge", "effect": "NoSchedule"}]},
                "status": {"allocatable": {"cpu": "15", "memory": "60Gi", "pods": "110"}}
            })
        );
        // A node without them keeps none.
        let mut bare: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n2", "annotations": {"node.alpha.kubernetes.io/ttl": "0"}}
        }))
        .unwrap();
        lean_node(&mut bare);
        assert_eq!(
            serde_json::to_value(&bare).unwrap(),
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"}})
        );
    }

    #[test]
    fn a_node_re_plans_on_what_its_profile_reads_not_on_heartbeats() {
        let base = node_profile_hash(&kubelet_node());
        let changed = |edit: fn(&mut Node)| {
            let mut n = kubelet_node();
            edit(&mut n);
            n.metadata.resource_version = Some("8".into());
            node_profile_hash(&n)
        };
        let quiet: [fn(&mut Node); 2] = [
            |n| {
                let c = &mut n.status.as_mut().unwrap().conditions.as_mut().unwrap()[0];
                c.last_heartbeat_time = None;
            },
            |n| {
                n.metadata
                    .annotations
                    .as_mut()
                    .unwrap()
                    .insert("other".into(), "x".into());
            },
        ];
        for (i, edit) in quiet.into_iter().enumerate() {
            assert_eq!(changed(edit), base, "edit {i} must not re-plan");
        }
        let replan: [fn(&mut Node); 5] = [
            |n| {
                let taints = n.spec.as_mut().unwrap().taints.as_mut().unwrap();
                taints[0].effect = "NoExecute".into();
            },
            |n| n.spec.as_mut().unwrap().taints = None,
            |n| {
                let a = n.metadata.annotations.as_mut().unwrap();
                a.insert(
                    NODE_ALLOWED_UNSAFE_SYSCTLS_ANNOTATION.into(),
                    "net.core.somaxconn".into(),
                );
            },
            |n| {
                let l = n.metadata.labels.as_mut().unwrap();
                l.insert("c10m.dev/cgroup-mode".into(), "v2".into());
            },
            |n| {
                let a = n.status.as_mut().unwrap().allocatable.as_mut().unwrap();
                let memory = k8s_openapi::apimachinery::pkg::api::resource::Quantity("30Gi".into());
                a.insert("memory".into(), memory);
            },
        ];
        for (i, edit) in replan.into_iter().enumerate() {
            assert_ne!(changed(edit), base, "edit {i} must re-plan");
        }
    }

    proptest! {
        /// A numeric revision is applied exactly when it is no higher than ours.
        #[test]
        fn applies_only_what_is_no_newer(installed: u32, ours: u32) {
            let decision = decide_crd(Some(&installed.to_string()), ours);
            if installed <= ours {
                prop_assert_eq!(decision, CrdDecision::Apply);
            } else {
                prop_assert_eq!(decision, CrdDecision::KeepNewer { installed });
            }
        }

        /// Whatever the annotation holds, the CRD is applied only when it
        /// reads as a revision no higher than ours.
        #[test]
        fn never_applies_over_what_it_cannot_read(value in "[0-9]{0,11}|\\PC{0,12}", ours: u32) {
            let applied = decide_crd(Some(&value), ours) == CrdDecision::Apply;
            let readable_and_no_newer = !value.is_empty()
                && value.bytes().all(|b| b.is_ascii_digit())
                && value.parse::<u32>().is_ok_and(|r| r <= ours);
            prop_assert_eq!(applied, readable_and_no_newer, "{:?}", value);
        }
    }
}
