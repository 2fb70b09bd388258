//! The controller: observe → plan → render → apply (server-side apply, one
//! field manager) → status. All Kubernetes I/O of the operator lives here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::utils::{PredicateConfig, WatchStreamExt};
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::api::{ConnectionFleet, ConnectionFleetStatus};
use crate::autoscale;
use crate::model::{self, PlanError};
use crate::nodes;
use crate::render;
use crate::status::{self, Outcome, Shards};

/// The one field manager the operator applies with, for objects and status.
pub const FIELD_MANAGER: &str = "c10m-operator";

/// Longest retry backoff after repeated errors.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Periodic re-check of a healthy fleet (node profile drift, lost watches).
pub const RESYNC: Duration = Duration::from_secs(300);

/// Errors of one reconcile; all are retried with per-fleet exponential backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {}", concise(source))]
    Kube {
        /// What the operator was doing.
        action: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// An error already recorded in the fleet's status and events.
    #[error("{0}")]
    Recorded(Box<Error>),
}

/// Longest message put in a condition or an event note (the Events API
/// refuses notes over 1 kB).
pub const MAX_MESSAGE_BYTES: usize = 900;

/// An API error in one readable line: the API server's own message for an
/// API error (kube's Display adds a debug dump), else the error's text; at
/// most [`MAX_MESSAGE_BYTES`].
pub fn concise(e: &kube::Error) -> String {
    let text = match e {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        other => other.to_string(),
    };
    truncate(text)
}

/// Cuts `text` to at most [`MAX_MESSAGE_BYTES`] on a character boundary.
pub fn truncate(mut text: String) -> String {
    if text.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES - 3;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

/// Shared state of the controller.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Event recorder (reporting controller `c10m-operator`).
    pub recorder: Recorder,
    /// Consecutive failures per fleet, for backoff.
    failures: Mutex<HashMap<ObjectRef<ConnectionFleet>, u32>>,
    /// The operator's own metrics.
    pub metrics: Arc<crate::telemetry::Metrics>,
    /// Prometheus, when `--prometheus-url` is set.
    pub prometheus: Option<autoscale::metrics::Reader>,
    /// HTTP client for shard admin calls (shed orders).
    pub http: reqwest::Client,
    /// Per-fleet memory of the metrics loop.
    loops: Mutex<HashMap<ObjectRef<ConnectionFleet>, autoscale::sync::Memory>>,
    /// Clock of the metrics loop.
    started: std::time::Instant,
}

impl Context {
    /// A context for `client`; `instance` names this operator replica in events.
    pub fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<crate::telemetry::Metrics>,
        prometheus: Option<autoscale::metrics::Reader>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            failures: Mutex::default(),
            metrics,
            prometheus,
            http: reqwest::Client::new(),
            loops: Mutex::default(),
            started: std::time::Instant::now(),
        }
    }
}

/// Backoff after the `n`th consecutive failure: 2^n s, at most [`MAX_BACKOFF`].
pub fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.min(16)).min(MAX_BACKOFF)
}

async fn apply<K>(api: &Api<K>, obj: &K) -> Result<K, Error>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&name, &pp, &Patch::Apply(obj))
        .await
        .map_err(kube_err(format!("apply {} {name}", K::kind(&()))))
}

/// The first object the fleet would own (Deployment, Service,
/// PodDisruptionBudget, admin Secret) that exists but is controlled by
/// something else: a message naming it. The operator never adopts or
/// rewrites such an object.
async fn foreign_object(
    client: &Client,
    ns: &str,
    name: &str,
    uid: &str,
) -> Result<Option<String>, Error> {
    async fn check<K>(api: Api<K>, name: &str, uid: &str) -> Result<Option<String>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let kind = K::kind(&());
        let obj = api
            .get_opt(name)
            .await
            .map_err(kube_err(format!("get {kind} {name}")))?;
        let ours = |o: &K| {
            o.meta()
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.controller == Some(true) && r.uid == uid)
        };
        Ok(obj.filter(|o| !ours(o)).map(|_| {
            format!("{kind} {name} already exists and is not owned by this ConnectionFleet; rename the fleet or remove the {kind}")
        }))
    }
    let found = [
        check(Api::<Deployment>::namespaced(client.clone(), ns), name, uid).await?,
        check(Api::<Service>::namespaced(client.clone(), ns), name, uid).await?,
        check(
            Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
            name,
            uid,
        )
        .await?,
        check(
            Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns),
            &autoscale::actions::secret_name(name),
            uid,
        )
        .await?,
    ];
    Ok(found.into_iter().flatten().next())
}

/// Node profile for the fleet: nodes matching its nodeSelector, then spec overrides.
async fn node_facts(
    client: &Client,
    fleet: &ConnectionFleet,
) -> Result<Result<model::NodeFacts, PlanError>, Error> {
    let spec_complete = fleet
        .spec
        .node
        .as_ref()
        .is_some_and(|n| n.memory.is_some() && n.cpus.is_some());
    let observed = if spec_complete {
        None
    } else {
        let selector = fleet
            .spec
            .placement
            .node_selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let list = Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(kube_err("list nodes"))?;
        nodes::smallest_allocatable(&list.items)
    };
    Ok(nodes::resolve(&fleet.spec, observed))
}

async fn publish(
    ctx: &Context,
    fleet: &ConnectionFleet,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(truncate(note)),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &fleet.object_ref(&())).await {
        warn!(error = %e, reason, "cannot publish event");
    }
}

async fn write_status(
    api: &Api<ConnectionFleet>,
    name: &str,
    status: &ConnectionFleetStatus,
) -> Result<(), Error> {
    let patch = serde_json::json!({
        "apiVersion": "c10m.dev/v1alpha1",
        "kind": "ConnectionFleet",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube_err(format!("update status of ConnectionFleet {name}")))?;
    Ok(())
}

/// Records a failed API call on the fleet: a Warning event when the Degraded
/// condition changes, and the status (best effort: the status write may be
/// what is failing; the log always has the error).
async fn report_failure(
    ctx: &Context,
    fleet: &ConnectionFleet,
    api: &Api<ConnectionFleet>,
    outcome: &Outcome,
    now: &Time,
) {
    let prev = fleet.status.as_ref();
    let next = status::next_status(
        prev,
        fleet.metadata.generation.unwrap_or(0),
        fleet.spec.connections,
        outcome,
        now,
    );
    let degraded = status::condition(&next, status::DEGRADED);
    if prev.and_then(|p| status::condition(p, status::DEGRADED)) != degraded
        && let Some(c) = degraded
    {
        publish(
            ctx,
            fleet,
            EventType::Warning,
            &c.reason,
            "Reconcile",
            c.message.clone(),
        )
        .await;
    }
    if Some(&next) != prev
        && let Err(e) = write_status(api, &fleet.name_any(), &next).await
    {
        warn!(fleet = %fleet.name_any(), error = %e, "cannot record the failure in status");
    }
}

/// Records why the fleet cannot be reconciled as it stands (Degraded with
/// `reason`, a Warning event when that changes) and waits: nothing changes
/// until the spec, a node or the conflicting object does, so no retry loop.
async fn reject(
    ctx: &Context,
    fleet: &ConnectionFleet,
    api: &Api<ConnectionFleet>,
    reason: &'static str,
    message: String,
    now: &Time,
) -> Result<Action, Error> {
    let prev = fleet.status.as_ref();
    let outcome = Outcome::Rejected {
        reason,
        message: message.clone(),
    };
    let next = status::next_status(
        prev,
        fleet.metadata.generation.unwrap_or(0),
        fleet.spec.connections,
        &outcome,
        now,
    );
    if prev.and_then(|p| status::condition(p, status::DEGRADED))
        != status::condition(&next, status::DEGRADED)
    {
        warn!(fleet = %fleet.name_any(), reason, %message, "fleet rejected");
        publish(ctx, fleet, EventType::Warning, reason, "Plan", message).await;
    }
    if Some(&next) != prev {
        write_status(api, &fleet.name_any(), &next).await?;
    }
    Ok(Action::requeue(RESYNC))
}

/// One reconcile of one fleet. A failure not yet recorded becomes a
/// `Degraded=True ReconcileFailed` condition and a Warning event, so that a
/// missing RBAC verb or an API outage is visible on the fleet, not only in logs.
pub async fn reconcile(fleet: Arc<ConnectionFleet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let res = reconcile_fleet(fleet.clone(), ctx.clone()).await;
    if let Err(e @ Error::Kube { .. }) = &res {
        let outcome = Outcome::Failed {
            plan: None,
            reason: "ReconcileFailed",
            message: e.to_string(),
        };
        let api = Api::namespaced(ctx.client.clone(), &fleet.namespace().unwrap_or_default());
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        report_failure(&ctx, &fleet, &api, &outcome, &now).await;
    }
    res
}

async fn reconcile_fleet(fleet: Arc<ConnectionFleet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = fleet.namespace().unwrap_or_default();
    let name = fleet.name_any();
    let fleets: Api<ConnectionFleet> = Api::namespaced(ctx.client.clone(), &ns);
    // The cached fleet may predate our last status write (a reconcile
    // triggered by an owned object can run before that write's watch event
    // arrives): decide from the stored status, so a stale cache never flips
    // a condition's transition time or repeats an event.
    let fleet = match fleets
        .get_opt(&name)
        .await
        .map_err(kube_err(format!("get ConnectionFleet {name}")))?
    {
        Some(latest) => Arc::new(latest),
        None => return Ok(Action::await_change()),
    };
    let generation = fleet.metadata.generation.unwrap_or(0);
    let prev = fleet.status.as_ref();
    let now = Time(k8s_openapi::jiff::Timestamp::now());

    let node = match node_facts(&ctx.client, &fleet).await {
        Ok(node) => node,
        Err(e) => {
            let outcome = Outcome::Failed {
                plan: None,
                reason: "NodesUnavailable",
                message: e.to_string(),
            };
            report_failure(&ctx, &fleet, &fleets, &outcome, &now).await;
            return Err(Error::Recorded(Box::new(e)));
        }
    };
    let planned = match node {
        Err(e) => Err(("NoNodeProfile", e)),
        Ok(node) => model::plan(&fleet.spec, node).map_err(|e| match e {
            PlanError::Invalid(_) => ("InvalidSpec", e),
            PlanError::Infeasible(_) => ("PlanInfeasible", e),
        }),
    };
    let plan = match planned {
        Ok(plan) => plan,
        Err((reason, e)) => {
            return reject(&ctx, &fleet, &fleets, reason, e.to_string(), &now).await;
        }
    };
    let owner = fleet
        .controller_owner_ref(&())
        .expect("a fleet from the API server has a uid");
    if let Some(conflict) = foreign_object(&ctx.client, &ns, &name, owner.uid.as_str()).await? {
        return reject(&ctx, &fleet, &fleets, "ObjectConflict", conflict, &now).await;
    }
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), &ns);
    let current = deployments
        .get_opt(&name)
        .await
        .map_err(kube_err(format!("get Deployment {name}")))?
        .and_then(|d| d.spec.and_then(|s| s.replicas))
        .unwrap_or(plan.shards);
    let token = autoscale::actions::ensure_admin_secret(
        &Api::namespaced(ctx.client.clone(), &ns),
        &name,
        owner.clone(),
    )
    .await
    .map_err(kube_err(format!(
        "ensure Secret {}",
        autoscale::actions::secret_name(&name)
    )))?;
    let key = ObjectRef::from_obj(fleet.as_ref());
    let mut memory = ctx.loops.lock().unwrap().remove(&key).unwrap_or_default();
    let looped = autoscale::sync::sync(
        autoscale::sync::Inputs {
            fleet: &fleet,
            plan: &plan,
            current,
            reader: ctx.prometheus.as_ref(),
            pods: &Api::namespaced(ctx.client.clone(), &ns),
            token: &token,
            http: &ctx.http,
            now: ctx.started.elapsed().as_secs_f64(),
            wall: &now,
        },
        &mut memory,
    )
    .await;
    ctx.loops.lock().unwrap().insert(key, memory);
    let looped = looped.map_err(kube_err("metrics loop"))?;

    let objects = render::render(&fleet, &plan, owner, looped.replicas);
    let applied = async {
        let dep = apply(&deployments, &objects.deployment).await?;
        apply(
            &Api::<Service>::namespaced(ctx.client.clone(), &ns),
            &objects.service,
        )
        .await?;
        apply(
            &Api::<PodDisruptionBudget>::namespaced(ctx.client.clone(), &ns),
            &objects.pdb,
        )
        .await?;
        Ok::<_, Error>(dep)
    }
    .await;

    let outcome = match &applied {
        Ok(dep) => {
            let st = dep.status.clone().unwrap_or_default();
            Outcome::Applied {
                plan: plan.clone(),
                shards: Shards {
                    desired: looped.replicas,
                    ready: st.ready_replicas.unwrap_or(0),
                    updated: st.updated_replicas.unwrap_or(0),
                    total: st.replicas.unwrap_or(0),
                    observed: st.observed_generation >= dep.metadata.generation,
                },
            }
        }
        Err(e) => Outcome::Failed {
            plan: Some(plan.clone()),
            reason: "ApplyFailed",
            message: e.to_string(),
        },
    };
    let mut next = status::next_status(prev, generation, fleet.spec.connections, &outcome, &now);
    status::apply_loop(&mut next, &looped, generation, &now);
    let metrics_before = prev
        .and_then(|p| status::condition(p, status::METRICS_AVAILABLE))
        .map(|c| c.status.clone());
    if let Some(c) = status::condition(&next, status::METRICS_AVAILABLE)
        && metrics_before.as_ref() != Some(&c.status)
    {
        let type_ = if c.status == "True" {
            EventType::Normal
        } else {
            EventType::Warning
        };
        publish(
            &ctx,
            &fleet,
            type_,
            &c.reason.clone(),
            "ReadMetrics",
            c.message.clone(),
        )
        .await;
    }
    for (warning, reason, note) in &looped.events {
        let type_ = if *warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        info!(fleet = %name, namespace = %ns, reason, note = %note, "metrics loop");
        publish(&ctx, &fleet, type_, reason, "Autoscale", note.clone()).await;
    }

    // A plan that cannot hold the declared connections (maxShards) is a Warning once.
    if applied.is_ok()
        && let Some(d) = status::condition(&next, status::DEGRADED).filter(|d| d.status == "True")
        && prev
            .and_then(|p| status::condition(p, status::DEGRADED))
            .map(|c| (&c.status, &c.reason))
            != Some((&d.status, &d.reason))
    {
        publish(
            &ctx,
            &fleet,
            EventType::Warning,
            &d.reason.clone(),
            "Plan",
            d.message.clone(),
        )
        .await;
    }
    if prev.and_then(|p| p.plan.as_ref()) != Some(&plan) {
        let note = format!(
            "{} shards × {} connections ({} per node, {} nodes), limited by {}",
            plan.shards,
            plan.connections_per_shard,
            plan.shards_per_node,
            plan.nodes,
            plan.limiting_factor.as_str()
        );
        info!(fleet = %name, namespace = %ns, shards = plan.shards, limit = plan.limiting_factor.as_str(), "plan changed");
        publish(&ctx, &fleet, EventType::Normal, "PlanChanged", "Plan", note).await;
    }
    let sysctl_cond_changed = prev
        .and_then(|p| status::condition(p, status::SYSCTLS_APPLIED))
        .map(|c| &c.status)
        != status::condition(&next, status::SYSCTLS_APPLIED).map(|c| &c.status);
    if sysctl_cond_changed && !plan.sysctls_not_applied.is_empty() {
        let msg = status::condition(&next, status::SYSCTLS_APPLIED)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        publish(
            &ctx,
            &fleet,
            EventType::Warning,
            "SysctlsNotApplied",
            "Plan",
            msg,
        )
        .await;
    }
    if applied.is_err() {
        report_failure(&ctx, &fleet, &fleets, &outcome, &now).await;
    } else if Some(&next) != prev {
        write_status(&fleets, &name, &next).await?;
    }
    applied.map_err(|e| Error::Recorded(Box::new(e)))?;
    let ready = matches!(outcome, Outcome::Applied { shards, .. } if shards.rolled_out());
    // Deployment status changes arrive through the owned-object watch; the
    // short requeue only covers a rollout the watch might not report.
    let wait = if ready {
        RESYNC
    } else {
        Duration::from_secs(15)
    };
    Ok(Action::requeue(looped.resync.map_or(wait, |r| r.min(wait))))
}

/// Requeue after an error with per-fleet exponential backoff.
pub fn error_policy(fleet: Arc<ConnectionFleet>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj(fleet.as_ref());
    let n = {
        let mut f = ctx.failures.lock().unwrap();
        let n = f.entry(key).or_insert(0);
        *n += 1;
        *n
    };
    let wait = backoff(n);
    warn!(fleet = %fleet.name_any(), error = %error, failures = n, retry_in_s = wait.as_secs(), "reconcile failed");
    Action::requeue(wait)
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
    /// Address of `/metrics` and `/healthz` (`None`: not served).
    pub metrics_addr: Option<String>,
    /// Prometheus the metrics loop reads (`None`: autoscaling and rebalancing hold).
    pub prometheus_url: Option<String>,
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

/// Runs the controller until SIGTERM/SIGINT.
pub async fn run(client: Client, config: RunConfig) -> anyhow::Result<()> {
    let metrics = Arc::new(crate::telemetry::Metrics::default());
    if let Some(addr) = config.metrics_addr.clone() {
        let m = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::telemetry::serve(addr, m).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
    }
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
        .map(autoscale::metrics::Reader::new)
        .transpose()?;
    let ctx = Arc::new(Context::new(client, instance, metrics, prometheus));
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=c10m-operator");
    info!(
        namespace = namespace.as_deref().unwrap_or("<all>"),
        "c10m-operator controller starting"
    );
    let controller = Controller::new(fleets, watcher::Config::default())
        .owns(deps, owned.clone())
        .owns(svcs, owned.clone())
        .owns(pdbs, owned);
    // Node profiles come from nodes' labels and allocatable: re-plan every
    // fleet when those change (not on the frequent node status heartbeats).
    let store = controller.store();
    let node_profiles = watcher(
        Api::<Node>::all(ctx.client.clone()),
        watcher::Config::default(),
    )
    .applied_objects()
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
                let key = ObjectRef::from_obj(fleet.as_ref());
                let started = std::time::Instant::now();
                let res = reconcile(fleet, ctx.clone()).await;
                ctx.metrics.observe(res.is_ok(), started.elapsed());
                if res.is_ok() {
                    ctx.failures.lock().unwrap().remove(&key);
                }
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
