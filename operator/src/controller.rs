//! Controller wiring: what `c10m-operator run` watches (fleets, the objects
//! they own, node profiles), the CRD install at start-up, the operator's
//! own metrics endpoint, and the run configuration. Each reconcile is
//! [`crate::reconcile::reconcile`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Client;
use kube::Resource;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::utils::{PredicateConfig, WatchStreamExt};
use kube::runtime::watcher::{self, watcher};
use tracing::info;

use crate::api::ConnectionFleet;
use crate::autoscale;
use crate::names::{FIELD_MANAGER, MANAGED_BY_SELECTOR};
use crate::policy::Policy;
use crate::reconcile::cache::Cache;
use crate::reconcile::{Context, error_policy, reconcile};

/// Reconciles run at once, at most: at a start or a leader's takeover every
/// fleet is due, and each reconcile reads its pods and ReplicaSets; a bound
/// keeps those reads (and the memory they take) from arriving all at once.
/// A reconcile mostly waits on the API server, so the bound is wide:
/// `make bench-scale` (1,000 fleets ramped at 20/s) saw apply → Deployment
/// p50 grow from 4.8 s to 48 s at 16 (issue 23).
pub const CONCURRENCY: u16 = 128;

/// Drops what no reconcile reads from a watched object before the stores
/// keep it: `managedFields` (often half an object's bytes;
/// `tests/store_heap.rs` measures it).
pub fn lean<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

/// [`lean`], and a node's image list (up to 50 entries a node).
fn lean_node(n: &mut Node) {
    lean(n);
    if let Some(s) = n.status.as_mut() {
        s.images = None;
    }
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

/// The objects `api` holds under `wc` as they change, each made `lean`
/// and kept in `writer`'s store before it triggers anything ([`keep`]).
fn stored<K: Kept>(
    api: Api<K>,
    wc: watcher::Config,
    lean: fn(&mut K),
    writer: reflector::store::Writer<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    keep(watcher(api, wc), lean, writer)
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
    /// the operator upgrades its schema (Helm never upgrades `crds/`).
    pub manage_crd: bool,
    /// Prometheus the metrics loop reads (`None`: autoscaling and rebalancing hold).
    pub prometheus_url: Option<String>,
    /// The cluster admin's policy (`--policy-file`).
    pub policy: Policy,
}

/// Server-side applies the ConnectionFleet CRD (field manager
/// [`FIELD_MANAGER`]) and waits up to 60 s until it is Established.
pub async fn apply_crd(client: &Client) -> anyhow::Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::CustomResourceExt;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = ConnectionFleet::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&crd))
        .await
        .map_err(|e| anyhow::anyhow!("cannot apply CRD {name} (start with --manage-crd=false where CRDs are managed elsewhere): {e}"))?;
    for _ in 0..120 {
        let got = api
            .get(&name)
            .await
            .map_err(|e| anyhow::anyhow!("cannot read CRD {name}: {e}"))?;
        let established = got.status.and_then(|s| s.conditions).is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if established {
            info!(crd = %name, "CRD applied and established");
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("CRD {name} not Established after 60 s")
}

/// Hash of what a node contributes to plans: its labels and allocatable.
fn node_profile_hash(node: &Node) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.metadata.labels.hash(&mut h);
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| {
            a.iter()
                .map(|(k, v)| (k.clone(), v.0.clone()))
                .collect::<Vec<_>>()
        })
        .hash(&mut h);
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

/// A client from the kubeconfig or the pod's service account (as
/// `kube::Client::try_default`) that counts each request it sends into
/// `metrics` ([`crate::telemetry::Metrics::count_request`]).
pub async fn counting_client(metrics: Arc<crate::telemetry::Metrics>) -> anyhow::Result<Client> {
    let config = kube::Config::infer().await?;
    let count = tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
        metrics.count_request(req.method());
        req
    });
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&count)
        .build())
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
        apply_crd(&client).await?;
    }
    let namespace = config.namespace;
    let instance = config.instance;
    let (fleets, deps, svcs, pdbs) = match &namespace {
        Some(ns) => (
            Api::<ConnectionFleet>::namespaced(client.clone(), ns),
            Api::<Deployment>::namespaced(client.clone(), ns),
            Api::<Service>::namespaced(client.clone(), ns),
            Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
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
    let owned = watcher::Config::default().labels(MANAGED_BY_SELECTOR);
    let (fleet_store, fleet_writer) = reflector::store();
    let (deployments, deployment_writer) = reflector::store();
    let (services, service_writer) = reflector::store();
    let (pdb_store, pdb_writer) = reflector::store();
    let (nodes, node_writer) = reflector::store();
    let cache = Cache {
        nodes,
        deployments,
        services,
        pdbs: pdb_store,
    };
    let ctx = Arc::new(
        Context::new(client.clone(), instance, metrics, prometheus)
            .with_policy(policy)
            .with_cache(cache),
    );
    info!(
        namespace = namespace.as_deref().unwrap_or("<all>"),
        "c10m-operator controller starting"
    );
    let fleet_events = stored(fleets, watcher::Config::default(), lean, fleet_writer);
    let controller = Controller::for_stream(fleet_events, fleet_store)
        .with_config(controller::Config::default().concurrency(CONCURRENCY))
        .owns_stream(stored(deps, owned.clone(), lean, deployment_writer))
        .owns_stream(stored(svcs, owned.clone(), lean, service_writer))
        .owns_stream(stored(pdbs, owned, lean, pdb_writer));
    // Node profiles come from nodes' labels and allocatable: re-plan every
    // fleet when those change (not on the frequent node status heartbeats).
    let store = controller.store();
    let node_profiles = stored(
        Api::<Node>::all(client),
        watcher::Config::default(),
        lean_node,
        node_writer,
    )
    .predicate_filter(node_profile_hash, PredicateConfig::default());
    controller
        .watches_stream(node_profiles, move |_node| {
            store
                .state()
                .iter()
                .map(|f| ObjectRef::from_obj(f.as_ref()))
                .collect::<Vec<_>>()
        })
        .shutdown_on_signal()
        .run(
            |fleet, ctx: Arc<Context>| async move {
                let started = Instant::now();
                let res = reconcile(fleet.clone(), ctx.clone()).await;
                ctx.finished(&fleet, res.as_ref().err(), started.elapsed());
                res
            },
            error_policy,
            ctx,
        )
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(fleet = %obj.name, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile error"),
            }
        })
        .await;
    info!("c10m-operator controller stopped");
    Ok(())
}
