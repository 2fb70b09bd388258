//! One reconcile of one fleet, as its pipeline:
//!
//! ```text
//! observe (client) → plan (pure) → metrics loop (client) → render (pure)
//!   → apply (client) → observe the workload (client) → rollout (pure)
//!   → cordon (client) → report (client)
//! ```
//!
//! [`reconcile`] is the driver, one line per step. The I/O of each step
//! lives in its own module ([`observe`], [`apply`], [`cordon`], [`report`];
//! the metrics loop in [`crate::autoscale`]); the pure steps are
//! [`crate::plan`], [`crate::render`], [`crate::rollout`] and
//! [`crate::status`]. Every path ends in
//! [`report::report`], which writes the status and events once. Controller
//! wiring (watches, CRD install, run configuration) is in
//! [`crate::controller`].

pub mod apply;
pub mod cache;
pub mod cordon;
pub mod observe;
pub mod report;
pub mod token;

use std::collections::HashMap;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use tracing::warn;

use crate::api::status::{CalibrationStatus, FigureSource, NodeSource, RolloutStatus};
use crate::api::{ConnectionFleet, Plan, SysctlMode};
use crate::autoscale::{self, act::AdminToken};
use crate::calibrate;
use crate::events::Recorder;
use crate::names::{FIELD_MANAGER, secret_name};
use crate::plan::calibration::State as CalibrationState;
use crate::plan::{self, NodeFacts, PlanError};
use crate::policy::{Policy, Refusal};
use crate::reason::Reason;
use crate::render;
use crate::rollout;
use crate::status::{self, WorkloadFailure};

/// Longest retry backoff after repeated errors.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Periodic re-check of a healthy fleet (node profile drift, lost watches).
pub const RESYNC: Duration = Duration::from_secs(300);

/// Longest message put in a condition or an event note (the Events API
/// refuses notes over 1 kB).
pub const MAX_MESSAGE_BYTES: usize = 900;

/// A failed step of one reconcile: one variant per step that talks to the
/// API server, each with its source. Every one is reported on the fleet
/// (condition + Warning event, by [`report::report`]) and retried with
/// per-fleet exponential backoff ([`error_policy`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Observe: reading the fleet or the objects it would own failed.
    #[error("{what}: {}", concise(source))]
    Observe {
        /// What the operator was reading.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Observe: the API server returned an object without a field it
    /// always sets (a proxy or a mock in the way); never a panic.
    #[error("{what}")]
    Malformed {
        /// What is missing, naming the object.
        what: String,
    },
    /// Observe: listing the nodes for the node profile failed.
    #[error("list nodes: {}", concise(source))]
    Nodes {
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Apply: reading or creating the fleet's admin Secret failed.
    #[error("ensure Secret {name}: {}", concise(source))]
    AdminSecret {
        /// The Secret's name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Apply: the fleet's admin Secret exists without a usable token.
    #[error(
        "Secret {name} has no usable `{}` key; delete the Secret to have a new token generated",
        c10m_wire::admin::TOKEN_KEY
    )]
    AdminSecretInvalid {
        /// The Secret's name.
        name: String,
    },
    /// Metrics loop: reading or annotating the fleet's pods failed.
    #[error("metrics loop: {}", concise(source))]
    MetricsLoop {
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Apply: server-side apply of an owned object failed.
    #[error("{what}: {}", concise(source))]
    Apply {
        /// What the operator was applying.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Cordon: recording a rollout's cordon on a pod failed.
    #[error("{what}: {}", concise(source))]
    Rollout {
        /// What the operator was recording.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Report: writing the fleet's status failed.
    #[error("{what}: {}", concise(source))]
    Report {
        /// What the operator was writing.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl Error {
    pub(crate) fn observe(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Observe { what, source }
    }

    /// The condition reason this error is reported with.
    pub fn reason(&self) -> Reason {
        match self {
            Error::Nodes { .. } => Reason::NodesUnavailable,
            Error::Apply { .. } => Reason::ApplyFailed,
            Error::Observe { .. }
            | Error::Malformed { .. }
            | Error::AdminSecret { .. }
            | Error::AdminSecretInvalid { .. }
            | Error::MetricsLoop { .. }
            | Error::Rollout { .. }
            | Error::Report { .. } => Reason::ReconcileFailed,
        }
    }

    /// The step that failed, as the `result` label of
    /// `c10m_operator_reconciliations_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Observe { .. } | Error::Malformed { .. } | Error::Nodes { .. } => {
                "observe_error"
            }
            Error::AdminSecret { .. } | Error::AdminSecretInvalid { .. } | Error::Apply { .. } => {
                "apply_error"
            }
            Error::MetricsLoop { .. } => "metrics_loop_error",
            Error::Rollout { .. } => "rollout_error",
            Error::Report { .. } => "report_error",
        }
    }

    /// Backoff after the `n`th consecutive failure. A Secret without a
    /// token waits for a person to fix it: the longest backoff at once.
    /// Every API failure backs off exponentially ([`backoff`]).
    pub fn retry_after(&self, n: u32) -> Duration {
        match self {
            Error::AdminSecretInvalid { .. } => MAX_BACKOFF,
            _ => backoff(n),
        }
    }
}

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

/// Backoff after the `n`th consecutive failure: 2^n s, at most [`MAX_BACKOFF`].
pub fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.min(16)).min(MAX_BACKOFF)
}

/// Shared state of the controller.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Event recorder (reporting controller [`FIELD_MANAGER`]).
    pub recorder: Recorder,
    /// Consecutive failures per fleet, for backoff.
    failures: Mutex<HashMap<ObjectRef<ConnectionFleet>, u32>>,
    /// The operator's own metrics.
    pub metrics: Arc<crate::telemetry::Metrics>,
    /// Prometheus, when `--prometheus-url` is set.
    pub prometheus: Option<autoscale::prometheus::Reader>,
    /// HTTP client for shard admin calls (shed orders).
    pub http: reqwest::Client,
    /// The cluster admin's policy (`--policy-file`; defaults without one).
    pub policy: Policy,
    /// Per-fleet memory of the metrics loop.
    loops: Mutex<HashMap<ObjectRef<ConnectionFleet>, autoscale::Memory>>,
    /// Clock of the metrics loop.
    started: Instant,
    /// The controller's stores (`None`: every read goes to the API).
    cache: Option<cache::Cache>,
    /// The Deployment's `minReadySeconds` (the rollout's gate) this
    /// process last set, per fleet: (the Deployment's uid, seconds).
    gates: Mutex<HashMap<ObjectRef<ConnectionFleet>, (String, i32)>>,
    /// The version this process last read (GET) or wrote (status) each
    /// fleet at ([`observe::fleet`]).
    versions: Mutex<HashMap<ObjectRef<ConnectionFleet>, observe::Known>>,
    /// The fleets' admin tokens, kept between reconciles ([`token`]).
    tokens: token::Tokens,
    /// The calibrations this process runs (`spec.backend.calibrate`).
    calibrations: calibrate::Runs,
    /// The fleets' Service applies ([`apply::ServiceApplies`]).
    services: apply::ServiceApplies,
    /// Where [`Context::services`] sends the fleets whose Service apply
    /// failed unwaited-for, until the controller takes it
    /// ([`Context::service_applies_ended`]).
    services_ended: Mutex<Option<ServiceAppliesEnded>>,
}

/// Fleets whose Service apply failed after their reconcile stopped
/// waiting for it ([`apply::ServiceApplies`]): a stream for the
/// controller's `reconcile_on`.
pub type ServiceAppliesEnded =
    futures::channel::mpsc::UnboundedReceiver<ObjectRef<ConnectionFleet>>;

impl Context {
    /// A context for `client` under the default [`Policy`] (see
    /// [`Context::with_policy`]); `instance` names this operator replica in
    /// events.
    pub fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<crate::telemetry::Metrics>,
        prometheus: Option<autoscale::prometheus::Reader>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        let (services, services_ended) = apply::ServiceApplies::new();
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            failures: Mutex::default(),
            metrics,
            prometheus,
            http: reqwest::Client::new(),
            policy: Policy::default(),
            loops: Mutex::default(),
            started: Instant::now(),
            cache: None,
            gates: Mutex::default(),
            versions: Mutex::default(),
            tokens: token::Tokens::default(),
            calibrations: calibrate::Runs::default(),
            services,
            services_ended: Mutex::new(Some(services_ended)),
        }
    }

    /// The fleets to reconcile again as their Service apply fails
    /// ([`apply::ServiceApplies`]); `None` once taken.
    pub fn service_applies_ended(&self) -> Option<ServiceAppliesEnded> {
        self.services_ended.lock().unwrap().take()
    }

    /// This context reading nodes and the fleets' objects from `cache`.
    pub fn with_cache(mut self, cache: cache::Cache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// This context under the admin's `policy` (its Prometheus reader
    /// confined by the policy's `queryMatchers` too).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.prometheus = self
            .prometheus
            .map(|r| r.confined_by(&policy.query_matchers));
        self.policy = policy;
        self
    }

    /// Counts a finished reconcile of `fleet`: its metrics, and the
    /// consecutive failures its backoff grows with (reset on success).
    /// Returns the failures so far.
    pub fn finished(&self, fleet: &impl Resource, error: Option<&Error>, took: Duration) -> u32 {
        self.metrics
            .observe(error.map_or("ok", Error::metric_label), took);
        let key = fleet_key(fleet);
        let mut failures = self.failures.lock().unwrap();
        match error {
            None => {
                failures.remove(&key);
                0
            }
            Some(_) => {
                let n = failures.entry(key).or_insert(0);
                *n += 1;
                *n
            }
        }
    }

    /// Records the version `fleet` was read or written at
    /// ([`observe::cached_is_current`]).
    pub fn seen(&self, fleet: &ConnectionFleet) {
        if let Some(known) = observe::Known::of(fleet) {
            self.versions
                .lock()
                .unwrap()
                .insert(ObjectRef::from_obj(fleet), known);
        }
    }

    fn failures(&self, fleet: &impl Resource) -> u32 {
        let key = fleet_key(fleet);
        self.failures
            .lock()
            .unwrap()
            .get(&key)
            .copied()
            .unwrap_or(0)
    }
}

/// The key of `fleet` (a [`ConnectionFleet`], or the controller's kept
/// form of one) in the context's per-fleet maps: its name and namespace.
fn fleet_key(fleet: &impl Resource) -> ObjectRef<ConnectionFleet> {
    ObjectRef::new(&fleet.name_any()).within(&fleet.namespace().unwrap_or_default())
}

/// How the pipeline ended, for [`report::report`].
// One value per reconcile, moved once into the report: the size of the
// variants holding a plan costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Ended {
    /// The fleet cannot be reconciled as it stands (spec, node profile or
    /// an object in the way): nothing changes until they do.
    Rejected {
        /// Condition reason.
        reason: Reason,
        /// What to change, naming the field or object.
        message: String,
    },
    /// A step failed; retried with backoff.
    Failed {
        /// The plan, when one was made before the failure.
        plan: Option<Plan>,
        /// The metrics loop's outcome, when it ran.
        looped: Option<autoscale::Outcome>,
        /// The failure.
        error: Error,
    },
    /// The fleet's first calibration runs; its objects wait for it.
    Calibrating {
        /// The plan from the spec or the model, until the measurement.
        plan: Plan,
    },
    /// Every step ran.
    Applied {
        /// The plan.
        plan: Plan,
        /// The metrics loop's outcome (replicas, live load, events).
        looped: autoscale::Outcome,
        /// The fleet's Deployment as stored after the apply.
        deployment: Deployment,
        /// Why its pods cannot run, when the workload says so.
        failure: Option<WorkloadFailure>,
        /// The rollout under way, if any.
        rollout: Option<RolloutStatus>,
    },
}

impl From<Error> for Ended {
    fn from(error: Error) -> Self {
        Ended::Failed {
            plan: None,
            looped: None,
            error,
        }
    }
}

/// One reconcile of one fleet: the pipeline, then its report.
pub async fn reconcile(fleet: Arc<ConnectionFleet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let now = Time(Timestamp::now());
    let key = ObjectRef::from_obj(fleet.as_ref());
    let known = ctx.versions.lock().unwrap().get(&key).cloned();
    let fleet = match observe::fleet(&ctx.client, &fleet, known.as_ref()).await {
        Ok(Some(latest)) => {
            ctx.seen(&latest);
            latest
        }
        Ok(None) => {
            ctx.versions.lock().unwrap().remove(&key);
            ctx.tokens.forget(&key);
            return Ok(Action::await_change());
        }
        Err(e) => return report::report(&ctx, &fleet, e.into(), None, &now).await,
    };
    let mut calibration = None;
    let ended = pipeline(&ctx, &fleet, &mut calibration)
        .await
        .unwrap_or_else(|e| e);
    report::report(&ctx, &fleet, ended, calibration.as_ref(), &now).await
}

/// The fleet's latest calibration and where its calibration stands, as a
/// reconcile saw them ([`calibrate::Runs`]).
pub type Calibration = (Option<CalibrationStatus>, CalibrationState);

/// observe → plan (→ calibrate) → metrics loop → render → apply → observe
/// the workload; `Err` ends it early. `calibration` gets what the
/// calibration step saw, when it ran.
// `Err` is how the pipeline ended, not a cheap error value (see [`Ended`]).
#[allow(clippy::result_large_err)]
async fn pipeline(
    ctx: &Context,
    fleet: &ConnectionFleet,
    calibration: &mut Option<Calibration>,
) -> Result<Ended, Ended> {
    let (ns, name) = (fleet.namespace().unwrap_or_default(), fleet.name_any());
    let owner = fleet
        .controller_owner_ref(&())
        .ok_or_else(|| Error::Malformed {
            what: format!("ConnectionFleet {name} as read has no metadata.uid"),
        })?;
    let cache = match &ctx.cache {
        Some(c) if c.ready().await => Some(c),
        _ => None,
    };
    let node = observe::node_facts(&ctx.client, cache, fleet).await?; // client required
    let latest = ctx.calibrations.latest(fleet);
    let (plan, facts) = plan_fleet(fleet, node, &ctx.policy, latest.as_ref())?; // no client required
    let now = Timestamp::now();
    let runs = &ctx.calibrations;
    let state = runs.tick(&ctx.client, fleet, latest.as_ref(), facts, &ctx.policy, now); // starts a run
    let first = latest.is_none() && matches!(state, CalibrationState::Running { .. });
    *calibration = Some((latest, state));
    // The admin token is the one kept from an earlier reconcile while it
    // holds ([`token`]); else the admin Secret is read beside the other
    // objects, and a new fleet's is created then instead (one round trip
    // less before its Deployment; it is the fleet's own even when another
    // object blocks the fleet). The token is needed before the applies
    // only by the metrics loop's shed orders: a fleet whose Deployment the
    // cache holds and whose loop does not run reads its Secret while it
    // applies (one round trip less before a re-plan's Deployment; a Secret
    // refused is then reported after the apply of objects that exist
    // already).
    let kept = ctx.tokens.kept(fleet, Instant::now());
    let cached = observe::deployment_cached(cache, fleet);
    let new = observe::new_fleet(cached, fleet);
    let apply_first = cached == Some(true) && !autoscale::decide::runs(&fleet.spec);
    let secret = async {
        match new {
            true => apply::create_admin_secret(&ctx.client, &ns, &name, owner.clone())
                .await
                .map(Some),
            false => apply::read_admin_secret(&ctx.client, &ns, &name).await,
        }
    };
    let mut secret = pin!(futures::future::maybe_done(secret));
    let applying = ctx
        .services
        .under_way(&ObjectRef::from_obj(fleet), &owner.uid);
    let owned = observe::owned(&ctx.client, cache, &ns, &name, &owner.uid, applying);
    let owned = match apply_first || kept.is_some() {
        true => owned.await,
        false => futures::join!(owned, secret.as_mut()).0,
    }?; // client required
    reject_conflict(owned.conflict)?; // no client required
    let live = owned.deployment;
    if first && live.is_none() {
        // A new fleet's first shards are planned from the measurement.
        return Ok(Ended::Calibrating { plan });
    }
    let previous = fleet.status.as_ref().and_then(|s| s.rollout.as_ref());
    let step = Step {
        ctx,
        fleet,
        plan: &plan,
        owner: &owner,
        cache,
        previous,
    };
    let (looped, deployment, held, token) = match kept {
        Some(token) => {
            let (looped, deployment, held) = step.apply(live, Some(&token)).await?;
            (looped, deployment, held, token)
        }
        None if apply_first => {
            let (applied, ()) = futures::join!(step.apply(live, None), secret.as_mut());
            let (looped, deployment, held) = applied?;
            let read = secret
                .take_output()
                .expect("the Secret's read ran to its end");
            let token =
                admin_token(&step, read, |e| failed(&plan, Some(looped.clone()), e)).await?;
            (looped, deployment, held, token)
        }
        None => {
            let read = secret
                .take_output()
                .expect("the Secret's read ran to its end");
            let token = admin_token(&step, read, |e| failed(&plan, None, e)).await?;
            let (looped, deployment, held) = step.apply(live, Some(&token)).await?;
            (looped, deployment, held, token)
        }
    };
    let recorded = previous.is_some();
    let workload = observe::workload(
        &ctx.client,
        cache,
        &ns,
        &name,
        &owner.uid,
        &deployment,
        recorded,
    )
    .await; // client required
    let workload = match workload {
        Ok(workload) => workload,
        Err(error) => return Err(self::failed(&plan, Some(looped), error)),
    };
    let failure = status::workload_failure(&deployment, &workload.replica_sets, &workload.pods); // no client required
    let rollout = rollout::observe(&deployment, &workload.replica_sets, &workload.pods); // no client required
    let port = fleet.spec.server.metrics_port;
    let orders = rollout.orders();
    let done = match cordon::carry_out(&ctx.client, &ctx.http, &ns, port, &token, &orders).await {
        Ok(done) => done,
        Err(error) => return Err(self::failed(&plan, Some(looped), error)),
    }; // client required
    let pace = rollout::Pace {
        drain_rate: plan.drain_rate,
        surge: i64::from(plan.rollout_surge),
        cap_step_seconds: plan.rollout_step_seconds,
    };
    // The gate as this process last set it, else as stored: the stored
    // Deployment may be the cache's copy (apply skipped), a watch event
    // behind the last gate written, and a gate written back to what a stale
    // copy shows would be skipped. Keyed by the Deployment's uid: a fleet
    // deleted and created again starts from what is stored.
    let key = ObjectRef::from_obj(fleet);
    let uid = deployment.metadata.uid.clone().unwrap_or_default();
    let stored = deployment.spec.as_ref().and_then(|s| s.min_ready_seconds);
    let written = ctx.gates.lock().unwrap().get(&key).cloned();
    let min_ready = written
        .filter(|(u, _)| *u == uid)
        .map(|(_, g)| g)
        .or(stored);
    let (rollout, gate) = rollout
        .after(&done)
        .pace(previous, &pace, Timestamp::now(), min_ready); // no client required
    let behind = !status::deployment_observed(&deployment);
    let (rollout, gate) = rollout.hold(gate, min_ready, held, behind, &pace); // no client required
    let tolerance = fleet
        .spec
        .rebalance
        .as_ref()
        .map_or(crate::api::default_max_to_mean(), |r| r.max_to_mean_percent);
    let lease = rollout::limit_lease_seconds(plan.rollout_step_seconds);
    let (rollout, limits) = rollout.limits(plan.shards, tolerance, lease); // no client required
    if let Some(limits) = &limits {
        let took = cordon::limit(&ctx.http, port, &token, limits).await; // client required
        tracing::debug!(fleet = %name, connections = limits.connections, shards = limits.shards.len(), took, "rollout admission limit sent");
    }
    let mark = rollout::drain_mark(rollout.status.as_ref(), &deployment, Timestamp::now()); // no client required
    let gate_change = (min_ready != Some(gate)).then_some(gate);
    let deployment = match rollout::gate_patch(gate_change, mark.clone()) {
        None => deployment,
        Some(patch) => {
            let st = rollout.status.as_ref();
            tracing::info!(
                fleet = %name,
                gate,
                was = ?min_ready,
                mark = ?mark,
                behind,
                held = ?held,
                draining_until = ?st.and_then(|s| s.draining_until.as_ref()).map(|t| t.0),
                old = st.map(|s| s.old_shards),
                cordoned = st.map(|s| s.cordoned_shards),
                "rollout gate (minReadySeconds) and drain mark set"
            );
            match apply::gate(&ctx.client, &ns, &name, &patch).await {
                Ok(deployment) => {
                    ctx.gates.lock().unwrap().insert(key, (uid, gate));
                    deployment
                }
                Err(error) => return Err(self::failed(&plan, Some(looped), error)),
            } // client required
        }
    };
    let want_paused = fleet.spec.rollout.paused == Some(true);
    let deployment = match rollout::pause_order(want_paused, &deployment) {
        // no client required
        None => deployment,
        Some(paused) => match apply::paused(&ctx.client, &ns, &name, paused).await {
            Ok(deployment) => deployment,
            Err(error) => return Err(self::failed(&plan, Some(looped), error)),
        }, // client required
    };
    Ok(Ended::Applied {
        plan,
        looped,
        deployment,
        failure,
        rollout: rollout.status,
    })
}

/// What the apply step of one reconcile reads: the fleet, its plan, its
/// owner reference, the watch caches (when ready) and the rollout its
/// status records.
struct Step<'a> {
    ctx: &'a Context,
    fleet: &'a ConnectionFleet,
    plan: &'a Plan,
    owner: &'a OwnerReference,
    cache: Option<&'a cache::Cache>,
    previous: Option<&'a RolloutStatus>,
}

impl Step<'_> {
    /// metrics loop → render → apply, given the Deployment as stored
    /// (`live`) and the admin `token` (`None` when the loop does not run:
    /// it sends no shed orders then). Returns the loop's outcome, the
    /// Deployment as stored after the apply, and until when a template
    /// change waits for a drain under way when it was held back
    /// ([`rollout::template_waits`]).
    async fn apply(
        &self,
        live: Option<Deployment>,
        token: Option<&AdminToken>,
    ) -> Result<(autoscale::Outcome, Deployment, Option<Timestamp>), Ended> {
        let (ctx, fleet, plan) = (self.ctx, self.fleet, self.plan);
        let (ns, name) = (fleet.namespace().unwrap_or_default(), fleet.name_any());
        let current = live.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
        let looped = metrics_loop(ctx, self.cache, fleet, plan, current, token).await; // client required
        let looped = looped.map_err(|e| failed(plan, None, e))?;
        let owner = self.owner.clone();
        let objects = render::render(fleet, plan, owner, looped.replicas, &ctx.policy); // no client required
        let now = Timestamp::now();
        let waits = rollout::template_waits(self.previous, now); // no client required
        // A template about to be applied as a drain ends goes in only once
        // the drain mark is gone: the admission policy refuses a template
        // change while the mark stands, this operator's own included.
        // Otherwise the mark goes with the gate (after the apply).
        let lift = live.as_ref().is_some_and(|live| {
            rollout::drain_mark(self.previous, live, now) == Some(None)
                && cache::template_change(live, &objects.deployment).is_some()
        }); // no client required
        let live = if lift {
            let patch = rollout::gate_patch(None, Some(None)).expect("a mark to remove");
            match apply::gate(&ctx.client, &ns, &name, &patch).await {
                Ok(deployment) => Some(deployment),
                Err(error) => return Err(failed(plan, None, error)),
            } // client required
        } else {
            live
        };
        let hold = live.as_ref().filter(|_| waits.is_some());
        let key = ObjectRef::from_obj(fleet);
        let services = &ctx.services;
        let applied = apply::objects(&ctx.client, self.cache, services, &key, &objects, hold).await; // client required
        match applied {
            Ok((deployment, held)) => Ok((looped, deployment, waits.filter(|_| held))),
            Err(error) => Err(failed(plan, Some(looped), error)),
        }
    }
}

/// The admin token from the fleet's Secret as `read` (`Ok(None)`: there
/// is none, and one is created now), once the Secret's controller is
/// checked, kept for the reconciles after ([`token::Tokens::keep`]).
/// Errors: the read or the create failed, or the Secret holds no usable
/// token (`failed`), or it is not the fleet's (`ObjectConflict`).
async fn admin_token(
    step: &Step<'_>,
    read: Result<Option<Secret>, Error>,
    failed: impl Fn(Error) -> Ended,
) -> Result<Arc<AdminToken>, Ended> {
    let (client, fleet, owner) = (&step.ctx.client, step.fleet, step.owner);
    let (ns, name) = (fleet.namespace().unwrap_or_default(), fleet.name_any());
    let secret = match read.map_err(&failed)? {
        Some(secret) => secret,
        None => apply::create_admin_secret(client, &ns, &name, owner.clone())
            .await
            .map_err(&failed)?, // client required
    };
    reject_conflict(observe::secret_conflict(&secret, &name, &owner.uid))?; // no client required
    let token = apply::secret_token(&secret).ok_or_else(|| {
        failed(Error::AdminSecretInvalid {
            name: secret_name(&name),
        })
    })?;
    Ok(step.ctx.tokens.keep(fleet, token, Instant::now()))
}

fn failed(plan: &Plan, looped: Option<autoscale::Outcome>, error: Error) -> Ended {
    Ended::Failed {
        plan: Some(plan.clone()),
        looped,
        error,
    }
}

/// The plan step: a plan under the admin's `policy`, or the rejection
/// naming what to change. What the policy refuses (a reserved toleration, a
/// node selector on a reserved label, the privileged init container in a
/// namespace it does not allow) is refused before anything is planned or
/// applied. The plan is a cluster's: `spec.node`'s per-connection kernel
/// claims only where the policy can trust them
/// ([`plan::capacity::plan_in_cluster`]), with the user bytes of the
/// fleet's `calibration` when it asks for one. Returns the node facts it
/// planned on with the plan.
#[allow(clippy::result_large_err)]
fn plan_fleet(
    fleet: &ConnectionFleet,
    node: Result<(NodeFacts, NodeSource), PlanError>,
    policy: &Policy,
    calibration: Option<&CalibrationStatus>,
) -> Result<(Plan, (NodeFacts, NodeSource)), Ended> {
    let rejected = |reason, e: PlanError| Ended::Rejected {
        reason,
        message: e.to_string(),
    };
    let ns = fleet.namespace().unwrap_or_default();
    let spec = &fleet.spec;
    policy
        .check_fleet(
            &ns,
            spec.sysctls.mode == SysctlMode::InitContainer,
            &spec.placement.tolerations,
            &spec.placement.node_selector,
        )
        .map_err(|refusal| Ended::Rejected {
            reason: match refusal {
                Refusal::Toleration { .. } => Reason::TolerationNotAllowed,
                Refusal::NodeSelector { .. } => Reason::NodeSelectorNotAllowed,
                Refusal::InitContainer { .. } => Reason::SysctlModeNotAllowed,
            },
            message: refusal.to_string(),
        })?;
    let node = node.map_err(|e| rejected(Reason::NoNodeProfile, e))?;
    plan::validate::queries(spec, &ns, &fleet.name_any(), &policy.query_matchers(&ns))
        .map_err(|e| rejected(Reason::InvalidSpec, e))?;
    let sized = plan::calibration::sized_by(spec, calibration);
    let mut plan = plan::capacity::plan_in_cluster(sized.as_ref().unwrap_or(spec), node, policy)
        .map_err(|e| match e {
            PlanError::Invalid(_) => rejected(Reason::InvalidSpec, e),
            PlanError::Infeasible(_) => rejected(Reason::PlanInfeasible, e),
        })?;
    if sized.is_some() {
        plan.user_bytes_source = Some(FigureSource::Calibrated);
    }
    Ok((plan, node))
}

#[allow(clippy::result_large_err)]
fn reject_conflict(conflict: Option<String>) -> Result<(), Ended> {
    match conflict {
        Some(message) => Err(Ended::Rejected {
            reason: Reason::ObjectConflict,
            message,
        }),
        None => Ok(()),
    }
}

/// The metrics loop step, with the fleet's memory carried between syncs;
/// the fleet's pods come from `cache` when its stores are ready.
async fn metrics_loop(
    ctx: &Context,
    cache: Option<&cache::Cache>,
    fleet: &ConnectionFleet,
    plan: &Plan,
    current: Option<i32>,
    token: Option<&AdminToken>,
) -> Result<autoscale::Outcome, Error> {
    let key = ObjectRef::from_obj(fleet);
    let ns = fleet.namespace().unwrap_or_default();
    let mut memory = ctx.loops.lock().unwrap().remove(&key).unwrap_or_default();
    let wall = Time(Timestamp::now());
    let observed = ctx.prometheus.is_some() && autoscale::decide::runs(&fleet.spec);
    let cached_pods = match cache {
        Some(c) if observed => {
            Some(c.fleet_pods(&ns, &fleet.name_any(), &fleet.uid().unwrap_or_default()))
        }
        _ => None,
    };
    let looped = autoscale::sync(
        autoscale::Inputs {
            fleet,
            plan,
            current: current.unwrap_or(plan.shards),
            reader: ctx.prometheus.as_ref(),
            pods: &kube::Api::namespaced(ctx.client.clone(), &ns),
            cached_pods,
            token,
            http: &ctx.http,
            now: ctx.started.elapsed().as_secs_f64(),
            wall: &wall,
        },
        &mut memory,
    )
    .await;
    ctx.loops.lock().unwrap().insert(key, memory);
    looped.map_err(|source| Error::MetricsLoop { source })
}

/// Requeue after an error, by its kind and the fleet's consecutive
/// failures (the failure itself was already reported on the fleet).
pub fn error_policy(fleet: &impl Resource, error: &Error, ctx: Arc<Context>) -> Action {
    let n = ctx.failures(fleet).max(1);
    let wait = error.retry_after(n);
    warn!(fleet = %fleet.name_any(), error = %error, step = error.metric_label(), failures = n, retry_in_s = wait.as_secs(), "reconcile failed");
    Action::requeue(wait)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::status::ClaimSource;

    fn fleet(spec: serde_json::Value) -> ConnectionFleet {
        let mut f = ConnectionFleet::new("edge", serde_json::from_value(spec).unwrap());
        f.metadata.namespace = Some("team-a".into());
        f
    }

    /// The plan step under `policy`, on `spec.node` as the only node.
    #[allow(clippy::result_large_err)]
    fn plan_step(f: &ConnectionFleet, policy: &Policy) -> Result<Plan, Ended> {
        plan_fleet(f, plan::nodes::resolve_sourced(&f.spec, None), policy, None).map(|(p, _)| p)
    }

    fn rejected(r: Result<Plan, Ended>) -> (Reason, String) {
        match r {
            Err(Ended::Rejected { reason, message }) => (reason, message),
            Ok(_) => panic!("planned"),
            Err(_) => panic!("not a rejection"),
        }
    }

    /// The policy's node selectors, query matchers and kernel claims reach
    /// the plan step: a refusal with its reason, naming the field.
    #[test]
    fn the_plan_step_applies_the_whole_policy() {
        let policy = Policy::from_yaml(
            "reservedNodeLabels: [kubernetes.io/hostname]\nqueryMatchers: [{namespaces: [team-a], matchers: {cluster: eu-1}}]\n",
        )
        .unwrap();
        let node = serde_json::json!({"memory": "8Gi", "cpus": 4, "kernelBytesPerSocket": 0, "conntrack": false});
        let (reason, message) = rejected(plan_step(
            &fleet(
                serde_json::json!({"connections": 1000, "shard": {"cpus": 2}, "node": node,
                "placement": {"nodeSelector": {"kubernetes.io/hostname": "n1"}}}),
            ),
            &policy,
        ));
        assert_eq!(reason, Reason::NodeSelectorNotAllowed);
        assert!(
            message.starts_with(r#"spec.placement.nodeSelector["kubernetes.io/hostname"]"#),
            "{message}"
        );
        let (reason, message) = rejected(plan_step(
            &fleet(
                serde_json::json!({"connections": 1000, "shard": {"cpus": 2}, "node": node,
                "metrics": {"upQuery": "up{cluster=\"us-2\"}"}}),
            ),
            &policy,
        ));
        assert_eq!(reason, Reason::InvalidSpec);
        assert!(
            message.starts_with("spec.metrics.upQuery: ") && message.contains("queryMatchers"),
            "{message}"
        );
        // Admitted: planned as a cluster's plan, the cheap claims not used.
        let plan = plan_step(
            &fleet(
                serde_json::json!({"connections": 1000, "shard": {"cpus": 2}, "node": node,
                "placement": {"nodeSelector": {"c10m.dev/pool": "edge"}}}),
            ),
            &policy,
        )
        .unwrap_or_else(|_| panic!("refused"));
        let source = plan.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (
                Some(ClaimSource::SpecNotTrusted),
                Some(ClaimSource::SpecNotTrusted)
            )
        );
    }
}
