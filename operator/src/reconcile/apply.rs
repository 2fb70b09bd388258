//! Apply (client required): the fleet's admin Secret and the rendered
//! objects, server-side applied with the operator's one field manager.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use c10m_wire::admin::TOKEN_KEY;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::Error;
use super::cache::{self, Cache};
use crate::api::ConnectionFleet;
use crate::autoscale::observe::controller_uid;
use crate::names::{
    FIELD_MANAGER, PAUSED_BY_FLEET_ANNOTATION, ROLLOUT_FIELD_MANAGER, labels, secret_name,
};
use crate::render::Rendered;
use crate::unmanaged::Unmanaged;

/// `obj` server-side applied (forced, under [`FIELD_MANAGER`]), as stored
/// (read without its `managedFields`, [`Unmanaged`]).
async fn apply<K>(api: &Api<Unmanaged<K>>, obj: &K) -> Result<K, Error>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&name, &pp, &Patch::Apply(obj))
        .await
        .map(|stored| stored.0)
        .map_err(|source| Error::Apply {
            what: format!("apply {} {name}", K::kind(&())),
            source,
        })
}

/// Applies the Deployment, Service and PodDisruptionBudget (concurrently:
/// one round trip; each apply runs to its end, and the first failure in
/// that order is the error) and returns the Deployment as stored,
/// and whether its template was held back. One the `cache` holds already
/// as rendered ([`cache::unchanged`]) is not applied: its stored copy
/// stands for it. The Service's apply is the `services`' to run
/// ([`ServiceApplies::ensure`]): it is waited for at most
/// [`SERVICE_WAIT`], and one still under way after it goes on without this
/// reconcile. With `hold_template` (a rollout's step drains,
/// [`crate::rollout::template_waits`]: the Deployment as stored, read
/// once by the reconcile, [`super::observe::owned`]) a Deployment
/// whose pod template would change ([`cache::template_change`]) is not
/// applied either, its other changes (replicas) with it: they wait
/// together for the drain's end, at most a step.
pub async fn objects(
    client: &Client,
    cache: Option<&Cache>,
    services: &ServiceApplies,
    fleet: &ObjectRef<ConnectionFleet>,
    objects: &Rendered,
    hold_template: Option<&Deployment>,
) -> Result<(Deployment, bool), Error> {
    let ns = fleet.namespace.as_deref().unwrap_or_default();
    let want = &objects.deployment;
    let held = hold_template.filter(|live| cache::template_change(live, want).is_some());
    let deployment = async {
        match held {
            Some(live) => Ok((live.clone(), true)),
            None => Ok((
                ensure(client, ns, cache.map(|c| &c.deployments), want).await?,
                false,
            )),
        }
    };
    let (deployment, service, pdb) = futures::join!(
        deployment,
        services.ensure(client, cache, fleet, &objects.service),
        ensure(client, ns, cache.map(|c| &c.pdbs), &objects.pdb),
    );
    let deployment = deployment?;
    service?;
    pdb?;
    Ok(deployment)
}

/// Longest a reconcile waits for its fleet's Service apply
/// ([`ServiceApplies::ensure`]). The API server allocates a new Service's
/// ClusterIP under one lock for all Services, held over the IPAddress
/// object's create (`MetaAllocator::AllocateNextService`,
/// `pkg/registry/core/service/ipallocator/cidrallocator.go`). On `make
/// bench-scale`'s plane an allocation took 162 ms
/// (`kube_apiserver_clusterip_allocator_allocation_duration_seconds`), so
/// about 6 Services were created a second, and a ramp of 20 fleets a
/// second queued their applies: 15 to 30 s each, 17.4 s on average
/// (`apiserver_request_duration_seconds`, APPLY services). Each reconcile
/// waiting on one held one of the controller's
/// [`crate::controller::CONCURRENCY`] turns, so the other fleets waited for
/// a turn (issue 23, `docs/scale.md`). An API server that creates a Service
/// in tens of milliseconds is waited for, as before.
pub const SERVICE_WAIT: Duration = Duration::from_secs(1);

/// Service applies in flight at once ([`ServiceApplies`]); the others wait
/// in this process, not on a connection each (HTTP/1.1: a request in
/// flight holds a connection). The API server creates Services one at a
/// time ([`SERVICE_WAIT`]): more in flight would only queue there.
pub const SERVICE_APPLIES: usize = 16;

/// The fleets' Service applies, run apart from the reconciles that start
/// them so that a slow one holds no reconcile's turn ([`SERVICE_WAIT`]).
/// At most one runs per fleet. A reconcile that stopped waiting leaves
/// it running. If it fails, the fleet is sent on the channel
/// [`ServiceApplies::new`] returns (the controller's `reconcile_on`), and
/// that reconcile reports the failure as any failed apply (retried with
/// the reconcile's backoff); a success is the Service watch's and the
/// cache's to show. Dropping this aborts what still runs.
pub struct ServiceApplies {
    running: Mutex<HashMap<ObjectRef<ConnectionFleet>, Running>>,
    slots: Arc<Semaphore>,
    ended: UnboundedSender<ObjectRef<ConnectionFleet>>,
}

/// One fleet's Service apply under way, for a reconcile to come.
struct Running {
    /// The Service as rendered when it started, boxed: the map's table
    /// keeps its capacity after the applies end, and a Service inline made
    /// each slot 0.9 kB (0.96 MB at 1,000 fleets, dhat, `docs/scale.md`,
    /// 2026-12-07).
    want: Box<Service>,
    /// [`WAITED`], [`DETACHED`] or [`ENDED`].
    state: Arc<AtomicU8>,
    task: JoinHandle<Result<(), Error>>,
}

/// A reconcile waits for the apply's end.
const WAITED: u8 = 0;
/// No reconcile waits: the apply's end is sent on the channel.
const DETACHED: u8 = 1;
/// The apply has ended.
const ENDED: u8 = 2;

impl ServiceApplies {
    /// No apply under way, and the receiving end of the channel on which
    /// fleets whose apply failed unwaited-for are sent.
    pub fn new() -> (Self, UnboundedReceiver<ObjectRef<ConnectionFleet>>) {
        let (ended, rx) = futures::channel::mpsc::unbounded();
        let applies = ServiceApplies {
            running: Mutex::default(),
            slots: Arc::new(Semaphore::new(SERVICE_APPLIES)),
            ended,
        };
        (applies, rx)
    }

    /// Sees that `want`, the Service of `fleet`, is applied. Nothing to do
    /// when the `cache` holds `want` already, or while an apply for the
    /// fleet is under way (its failure, or the Service watch on its
    /// success, brings the next reconcile). Else the outcome of the last
    /// apply, when it was for this render and ended unwaited-for (the
    /// cache may not show a success yet); else the outcome of an apply
    /// started now, waited for at most [`SERVICE_WAIT`] (`Ok` when it goes
    /// on without this reconcile). Errors: the apply's ([`Error::Apply`]).
    pub async fn ensure(
        &self,
        client: &Client,
        cache: Option<&Cache>,
        fleet: &ObjectRef<ConnectionFleet>,
        want: &Service,
    ) -> Result<(), Error> {
        let ns = fleet.namespace.as_deref().unwrap_or_default();
        let stored = cache.is_some_and(|c| cache::unchanged(&c.services, ns, want).is_some());
        let last = {
            let mut running = self.running.lock().unwrap();
            match running.remove(fleet) {
                Some(run) if !run.task.is_finished() => {
                    running.insert(fleet.clone(), run);
                    return Ok(());
                }
                last => last,
            }
        };
        if stored {
            return Ok(());
        }
        if let Some(run) = last {
            let outcome = joined(run.task.await);
            if *run.want == *want {
                // The cache may not show its success yet.
                return outcome;
            }
        }
        let mut run = self.start(client, fleet, want);
        match tokio::time::timeout(SERVICE_WAIT, &mut run.task).await {
            Ok(outcome) => joined(outcome),
            Err(_) => {
                let detached = run.state.compare_exchange(WAITED, DETACHED, SeqCst, SeqCst);
                if detached.is_err() {
                    // It ended as the wait did.
                    return joined(run.task.await);
                }
                self.running.lock().unwrap().insert(fleet.clone(), run);
                Ok(())
            }
        }
    }

    /// Whether an apply of `fleet`'s Service, rendered for the fleet of
    /// `uid`, is under way in this process. While it is, the Service is
    /// the fleet's own in the making, and a reconcile does not read it to
    /// check its owner ([`super::observe::owned`]): on `make bench-scale`'s
    /// plane, where a Service waits 15–30 s for its ClusterIP, those reads
    /// were 4,012 of the ramp's 16,924 (2026-12-07).
    pub fn under_way(&self, fleet: &ObjectRef<ConnectionFleet>, uid: &str) -> bool {
        let running = self.running.lock().unwrap();
        running.get(fleet).is_some_and(|run| {
            !run.task.is_finished() && controller_uid(&run.want.metadata) == Some(uid)
        })
    }

    /// An apply of `want` started for `fleet`: it waits for one of the
    /// [`SERVICE_APPLIES`] slots, and sends the fleet when it fails with
    /// no reconcile waiting.
    fn start(
        &self,
        client: &Client,
        fleet: &ObjectRef<ConnectionFleet>,
        want: &Service,
    ) -> Running {
        let state = Arc::new(AtomicU8::new(WAITED));
        let api = Api::namespaced(
            client.clone(),
            fleet.namespace.as_deref().unwrap_or_default(),
        );
        let (slots, ended) = (self.slots.clone(), self.ended.clone());
        let (end, key, obj) = (state.clone(), fleet.clone(), want.clone());
        let task = tokio::spawn(async move {
            let _slot = slots
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            let outcome = apply(&api, &obj).await.map(drop);
            if end.swap(ENDED, SeqCst) == DETACHED && outcome.is_err() {
                // The receiver is gone only when the controller stopped.
                let _ = ended.unbounded_send(key);
            }
            outcome
        });
        Running {
            want: Box::new(want.clone()),
            state,
            task,
        }
    }
}

impl Drop for ServiceApplies {
    fn drop(&mut self) {
        for run in self.running.get_mut().unwrap().values() {
            run.task.abort();
        }
    }
}

/// The outcome of an apply task that ended: its panic goes on.
fn joined(outcome: Result<Result<(), Error>, tokio::task::JoinError>) -> Result<(), Error> {
    match outcome {
        Ok(outcome) => outcome,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => unreachable!("an apply task is aborted only with its owner: {e}"),
    }
}

/// `want` as stored: the `store`'s copy when it holds `want` already, else
/// `want` applied.
async fn ensure<K>(
    client: &Client,
    ns: &str,
    store: Option<&Store<cache::Stored<K>>>,
    want: &K,
) -> Result<K, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Serialize
        + DeserializeOwned
        + Clone
        + std::fmt::Debug
        + 'static,
{
    match store.and_then(|s| cache::unchanged(s, ns, want)) {
        Some(stored) => Ok(stored),
        None => apply(&Api::namespaced(client.clone(), ns), want).await,
    }
}

/// Sets the Deployment `name`'s rollout gate and drain mark: `patch` is
/// [`crate::rollout::gate_patch`]'s (`spec.minReadySeconds`, the gate
/// between a rollout's steps, which the rendered objects leave out, and the
/// [`crate::names::STEP_DRAINING_ANNOTATION`]), merged under
/// [`ROLLOUT_FIELD_MANAGER`]. Returns the Deployment as stored.
pub async fn gate(
    client: &Client,
    ns: &str,
    name: &str,
    patch: &serde_json::Value,
) -> Result<Deployment, Error> {
    let what = || format!("set the rollout gate of Deployment {name} ({patch})");
    rollout_patch(client, ns, name, patch, what).await
}

/// Merge-patches the Deployment `name` with `patch` under
/// [`ROLLOUT_FIELD_MANAGER`], and returns it as stored (without its
/// `managedFields`); `what` names the change in the error.
async fn rollout_patch(
    client: &Client,
    ns: &str,
    name: &str,
    patch: &serde_json::Value,
    what: impl FnOnce() -> String,
) -> Result<Deployment, Error> {
    let pp = PatchParams {
        field_manager: Some(ROLLOUT_FIELD_MANAGER.into()),
        ..Default::default()
    };
    Api::<Unmanaged<Deployment>>::namespaced(client.clone(), ns)
        .patch(name, &pp, &Patch::Merge(patch))
        .await
        .map(|stored| stored.0)
        .map_err(|source| Error::Apply {
            what: what(),
            source,
        })
}

/// Pauses (`paused`) or resumes the Deployment `name` for the fleet's
/// `spec.rollout.paused` ([`crate::rollout::pause_order`]): a merge patch of
/// `spec.paused` and [`PAUSED_BY_FLEET_ANNOTATION`] (set while paused)
/// under [`ROLLOUT_FIELD_MANAGER`]; returns the Deployment as stored.
pub async fn paused(
    client: &Client,
    ns: &str,
    name: &str,
    paused: bool,
) -> Result<Deployment, Error> {
    let mark = paused.then_some("true");
    let patch = serde_json::json!({
        "metadata": {"annotations": {PAUSED_BY_FLEET_ANNOTATION: mark}},
        "spec": {"paused": paused},
    });
    let verb = if paused { "pause" } else { "resume" };
    let what = || format!("{verb} Deployment {name} (spec.rollout.paused)");
    rollout_patch(client, ns, name, &patch, what).await
}

/// The token an admin Secret holds under [`TOKEN_KEY`], as both sides read
/// it ([`c10m_wire::admin::token`]): a trailing newline from `kubectl create
/// secret --from-file` or `echo … | base64` is no part of it. `None`: no
/// usable token (missing, blank, not UTF-8, or not visible ASCII).
pub fn secret_token(secret: &Secret) -> Option<String> {
    let bytes = &secret.data.as_ref()?.get(TOKEN_KEY)?.0;
    let text = std::str::from_utf8(bytes).ok()?;
    c10m_wire::admin::token(text)
        .ok()
        .flatten()
        .map(str::to_string)
}

/// The fleet's admin Secret `<fleet>-admin` as stored (it holds the bearer
/// token of its shards' `/drain`, `/cordon` and `/shed`, [`secret_token`]);
/// `None` when there is none. Secrets are not watched (that needs `list`
/// and `watch` on every Secret; the chart grants `get` and `create`), so it
/// is read through the API. Errors: the GET failed, as
/// [`Error::AdminSecret`].
pub async fn read_admin_secret(
    client: &Client,
    ns: &str,
    fleet: &str,
) -> Result<Option<Secret>, Error> {
    let name = secret_name(fleet);
    Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(&name)
        .await
        .map_err(|source| Error::AdminSecret { name, source })
}

/// Creates the fleet's admin Secret `<fleet>-admin` (32 random bytes, hex,
/// with the fleet as `owner`; never rotated by the operator) and returns it
/// as stored; when one exists already (409: the fleet's own, made before or
/// by a reconcile that raced this one, or another's), that one, read. The
/// caller checks who controls it ([`super::observe::secret_conflict`]).
/// Errors: the create or the read failed, as [`Error::AdminSecret`].
pub async fn create_admin_secret(
    client: &Client,
    ns: &str,
    fleet: &str,
    owner: OwnerReference,
) -> Result<Secret, Error> {
    let api = Api::<Secret>::namespaced(client.clone(), ns);
    let name = secret_name(fleet);
    let err = |source| Error::AdminSecret {
        name: name.clone(),
        source,
    };
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random source works");
    let fresh: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(labels(fleet)),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            ByteString(fresh.into_bytes()),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => Ok(created),
        Err(kube::Error::Api(e)) if e.code == 409 => api.get(&name).await.map_err(err),
        Err(e) => Err(err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(bytes: &[u8]) -> Secret {
        Secret {
            data: Some(BTreeMap::from([(
                TOKEN_KEY.to_string(),
                ByteString(bytes.to_vec()),
            )])),
            ..Default::default()
        }
    }

    /// Issue 21: a Secret rotated with `kubectl create secret --from-file`
    /// holds the token and a newline; the operator sends the token alone
    /// (reqwest refuses a header value with a newline in it).
    #[test]
    fn a_rotated_secret_with_a_trailing_newline_gives_the_bare_token() {
        let token = secret_token(&secret(b"s3cret\n"));
        assert_eq!(token.as_deref(), Some("s3cret"));
        let header = format!("Bearer {}", token.unwrap());
        assert!(reqwest::header::HeaderValue::from_str(&header).is_ok());
        assert!(reqwest::header::HeaderValue::from_str("Bearer s3cret\n").is_err());
        assert_eq!(secret_token(&secret(b" \n")), None);
        assert_eq!(secret_token(&secret(b"two words")), None);
        assert_eq!(secret_token(&secret(&[0xff, 0xfe])), None);
        assert_eq!(secret_token(&Secret::default()), None);
    }
}
