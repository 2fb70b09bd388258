//! The live-metrics loop of one fleet, one [`sync`] per reconcile:
//!
//! ```text
//! observe (client) → decide (pure) → act (client) → settle (pure)
//! ```
//!
//! - [`observe`]: the fleet's shard pods and its metrics from Prometheus
//!   ([`prometheus`]), checked against the running pods (ready or not) and
//!   the plan's bounds, as one [`Observation`]; a doubtful read (missing,
//!   stale, partial, or a sample that cannot be true) is observed, not an
//!   error;
//! - [`decide`]: replicas, scale-in victims, shed orders, status parts and
//!   events, from the observation and the loop's [`Memory`]; shard counts
//!   from [`policy`] (HPA-like), shed orders from [`rebalance`];
//! - [`act`]: marks the victims (pod-deletion-cost) and sends the shed
//!   orders, turning failed orders into events;
//! - [`Decision::settle`]: folds what was sent into the [`Outcome`] the
//!   reconcile applies and reports;
//! - [`drift`]: the kernel settings the shards report against the plan
//!   (`KernelDrift` condition, a Warning per new drift).

pub mod act;
pub mod decide;
pub mod drift;
pub mod observe;
pub mod policy;
pub mod prometheus;
pub mod rebalance;
#[cfg(test)]
mod tests;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;

use crate::api::{ConnectionFleet, Plan};
pub use decide::{DecideInput, Decision, Memory, Outcome};
pub use observe::Observation;
use prometheus::Reader;

/// Everything a sync needs from the controller.
pub struct Inputs<'a> {
    /// The fleet.
    pub fleet: &'a ConnectionFleet,
    /// Its plan (the floor).
    pub plan: &'a Plan,
    /// Replicas its Deployment has now (the plan's shards if none yet).
    pub current: i32,
    /// Prometheus, when configured.
    pub reader: Option<&'a Reader>,
    /// Pods of the fleet's namespace.
    pub pods: &'a Api<Pod>,
    /// The fleet's own pods as the controller's watch caches hold them
    /// (the same ownership rule as [`observe::own_pods`]); `None`: listed
    /// through `pods`.
    pub cached_pods: Option<Vec<Pod>>,
    /// The fleet's admin token, for shed orders; `None` when the loop does
    /// not run ([`decide::runs`]), which sends none then.
    pub token: Option<&'a act::AdminToken>,
    /// HTTP client for shard admin calls.
    pub http: &'a reqwest::Client,
    /// Seconds on the loop's monotonic clock.
    pub now: f64,
    /// Wall-clock time for status.
    pub wall: &'a Time,
}

/// Runs one sync: observe → decide → act → settle. Only an API call
/// (listing or annotating pods) fails it; a fleet with the loop off is
/// neither observed nor acted on.
pub async fn sync(i: Inputs<'_>, memory: &mut Memory) -> Result<Outcome, kube::Error> {
    let observation = if decide::runs(&i.fleet.spec) {
        observe::observe(i.reader, i.pods, i.cached_pods, i.fleet, i.plan).await? // client required
    } else {
        Observation::default()
    };
    let input = DecideInput::new(i.fleet, i.plan, i.current, &observation, i.now, i.wall);
    let decision = decide::decide(&input, memory); // no client required
    let acted = act::act(&decision, i.pods, i.http, i.token).await?; // client required
    let mut outcome = decision.settle(acted); // no client required
    if let Some(kernel) = &observation.kernel {
        let (condition, events) = drift::read(i.plan, kernel, &mut memory.drift);
        outcome.kernel_drift = Some(condition);
        outcome.events.extend(events);
    }
    Ok(outcome)
}
