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
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use crate::api::{ConnectionFleet, ConnectionFleetStatus};
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
    #[error("{action}: {source}")]
    Kube {
        /// What the operator was doing.
        action: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
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
}

impl Context {
    /// A context for `client`; `instance` names this operator replica in events.
    pub fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<crate::telemetry::Metrics>,
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
        note: Some(note),
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

/// One reconcile of one fleet.
pub async fn reconcile(fleet: Arc<ConnectionFleet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = fleet.namespace().unwrap_or_default();
    let name = fleet.name_any();
    let generation = fleet.metadata.generation.unwrap_or(0);
    let fleets: Api<ConnectionFleet> = Api::namespaced(ctx.client.clone(), &ns);
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
            return Err(e);
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
            let outcome = Outcome::Rejected {
                reason,
                message: e.to_string(),
            };
            let next =
                status::next_status(prev, generation, fleet.spec.connections, &outcome, &now);
            let changed = prev.and_then(|p| status::condition(p, status::DEGRADED))
                != status::condition(&next, status::DEGRADED);
            if changed {
                warn!(fleet = %name, namespace = %ns, reason, error = %e, "fleet rejected");
                publish(
                    &ctx,
                    &fleet,
                    EventType::Warning,
                    reason,
                    "Plan",
                    e.to_string(),
                )
                .await;
            }
            if Some(&next) != prev {
                write_status(&fleets, &name, &next).await?;
            }
            // Nothing will change until the spec (or a node) does: no requeue loop.
            return Ok(Action::requeue(RESYNC));
        }
    };
    let owner = fleet
        .controller_owner_ref(&())
        .expect("a fleet from the API server has a uid");
    let objects = render::render(&fleet, &plan, owner);
    let applied = async {
        let dep = apply(
            &Api::<Deployment>::namespaced(ctx.client.clone(), &ns),
            &objects.deployment,
        )
        .await?;
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
                    desired: plan.shards,
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
    let next = status::next_status(prev, generation, fleet.spec.connections, &outcome, &now);

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
    applied?;
    let ready = matches!(outcome, Outcome::Applied { shards, .. } if shards.rolled_out());
    // Deployment status changes arrive through the owned-object watch; the
    // short requeue only covers a rollout the watch might not report.
    Ok(Action::requeue(if ready {
        RESYNC
    } else {
        Duration::from_secs(15)
    }))
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

    let ctx = Arc::new(Context::new(client, instance, metrics));
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=c10m-operator");
    info!(
        namespace = namespace.as_deref().unwrap_or("<all>"),
        "c10m-operator controller starting"
    );
    Controller::new(fleets, watcher::Config::default())
        .owns(deps, owned.clone())
        .owns(svcs, owned.clone())
        .owns(pdbs, owned)
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
