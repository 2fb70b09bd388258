//! Leader election (`c10m-operator run --leader-elect`): replicas share a
//! `coordination.k8s.io/v1` Lease through [`kube_lease_manager`]; only the
//! holder runs the controller (CRD install, watches, reconciles, drain and
//! shed orders). A follower serves `/healthz` and `/metrics` and does
//! nothing else.
//!
//! Stepping down: the lease manager renews the Lease every
//! `renew_period`. A watchdog reads the Lease every [`WATCHDOG_POLL`]; when
//! the Lease names another holder, is gone, or its `renewTime` (written from
//! this process's clock) is older than `renew_deadline`, the process logs
//! why and exits, so the Deployment restarts it as a follower. Since
//! `renew_deadline < lease_duration`, the old leader has stopped before any
//! other replica may take the Lease (`renewTime + lease_duration`); the
//! difference is the clock skew tolerated between nodes.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
use tracing::{error, info, warn};

use crate::controller::{self, RunConfig};
use crate::telemetry::Metrics;

/// How often the leader re-reads its Lease to check it still holds it.
pub const WATCHDOG_POLL: Duration = Duration::from_secs(2);

/// Leader-election settings (`--leader-elect-*`).
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    /// Name of the Lease.
    pub lease_name: String,
    /// Namespace of the Lease (`None`: the client's default namespace, in a
    /// pod its own).
    pub namespace: Option<String>,
    /// This replica's holder identity (unique per process).
    pub identity: String,
    /// Seconds a Lease stays valid after its last renewal; another replica
    /// may take it after that.
    pub lease_duration: u64,
    /// Seconds between renewals by the holder.
    pub renew_period: u64,
    /// Seconds after its last successful renewal at which the holder stops
    /// acting and exits.
    pub renew_deadline: u64,
}

impl LeaderConfig {
    /// Checks `0 < renew_period < renew_deadline < lease_duration`.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.lease_name.is_empty() {
            bail!("--leader-elect-lease must not be empty");
        }
        if !(0 < self.renew_period
            && self.renew_period < self.renew_deadline
            && self.renew_deadline < self.lease_duration)
        {
            bail!(
                "leader election needs 0 < renew period ({}s) < renew deadline ({}s) < lease duration ({}s)",
                self.renew_period,
                self.renew_deadline,
                self.lease_duration
            );
        }
        Ok(())
    }

    /// The lease manager's grace: it renews `grace` seconds before the
    /// Lease would expire, i.e. every `renew_period` seconds.
    fn grace(&self) -> u64 {
        self.lease_duration - self.renew_period
    }
}

/// A holder identity: the pod name (or host name) and a random suffix, so
/// a restarted container is a new candidate.
pub fn identity(pod_name: Option<&str>) -> String {
    let base = pod_name
        .map(str::to_string)
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "c10m-operator".into());
    let mut bytes = [0u8; 4];
    // A failed random read leaves the suffix zero; the pid still differs.
    let _ = getrandom::fill(&mut bytes);
    format!(
        "{base}_{}_{:08x}",
        std::process::id(),
        u32::from_le_bytes(bytes)
    )
}

/// What a read of the Lease says about this holder: `Ok(renewTime in ms)`
/// while `identity` holds it, `Err(why)` once it does not.
pub fn still_holder(lease: Option<&Lease>, identity: &str) -> Result<Option<i64>, String> {
    let Some(lease) = lease else {
        return Err("the Lease was deleted".into());
    };
    let spec = lease.spec.as_ref();
    let holder = spec.and_then(|s| s.holder_identity.as_deref());
    if holder != Some(identity) {
        return Err(format!(
            "the Lease is held by {}",
            holder.unwrap_or("nobody")
        ));
    }
    Ok(spec
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.as_millisecond()))
}

/// Time left before the holder must stop acting, given its last renewal
/// (`renewed_ms`, epoch ms) and `now_ms`; `None` once the deadline passed.
pub fn time_left(renewed_ms: i64, renew_deadline: u64, now_ms: i64) -> Option<Duration> {
    let left = renewed_ms + (renew_deadline as i64) * 1000 - now_ms;
    (left > 0).then(|| Duration::from_millis(left as u64))
}

/// Resolves when this process must step down, with the reason.
async fn watchdog(api: Api<Lease>, leader: LeaderConfig) -> String {
    // The Lease was renewed just before the lease manager reported us leader.
    let mut renewed_ms = Timestamp::now().as_millisecond();
    let mut first = true;
    loop {
        let Some(left) = time_left(
            renewed_ms,
            leader.renew_deadline,
            Timestamp::now().as_millisecond(),
        ) else {
            return format!(
                "the Lease was not renewed within the renew deadline ({} s)",
                leader.renew_deadline
            );
        };
        if !first {
            tokio::time::sleep(WATCHDOG_POLL.min(left)).await;
        }
        first = false;
        let Some(left) = time_left(
            renewed_ms,
            leader.renew_deadline,
            Timestamp::now().as_millisecond(),
        ) else {
            continue;
        };
        match tokio::time::timeout(left, api.get_opt(&leader.lease_name)).await {
            Ok(Ok(lease)) => match still_holder(lease.as_ref(), &leader.identity) {
                Ok(Some(ms)) => renewed_ms = renewed_ms.max(ms),
                Ok(None) => {}
                Err(why) => return why,
            },
            Ok(Err(e)) => {
                warn!(error = %e, lease = %leader.lease_name, "cannot read the leader Lease")
            }
            Err(_) => warn!(lease = %leader.lease_name, "reading the leader Lease timed out"),
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Waits for the Lease, then runs the controller while holding it. Returns
/// on SIGTERM/SIGINT (releasing the Lease for a fast hand-over); exits the
/// process when leadership is lost.
pub async fn run(
    client: Client,
    config: RunConfig,
    leader: LeaderConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    leader.validate()?;
    let namespace = leader
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let manager = LeaseManagerBuilder::new(client.clone(), &leader.lease_name)
        .with_namespace(&namespace)
        .with_identity(&leader.identity)
        .with_duration(leader.lease_duration)
        .with_grace(leader.grace())
        .build()
        .await
        .with_context(|| {
            format!(
                "cannot use Lease {namespace}/{} (RBAC: get, create, patch on leases)",
                leader.lease_name
            )
        })?;
    metrics.set_leader(false);
    info!(
        lease = %leader.lease_name,
        namespace = %namespace,
        identity = %leader.identity,
        lease_duration_s = leader.lease_duration,
        renew_period_s = leader.renew_period,
        renew_deadline_s = leader.renew_deadline,
        "waiting for the leader Lease (follower: serving /healthz and /metrics only)"
    );
    let (mut state, task) = manager.watch().await;
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        if *state.borrow_and_update() {
            break;
        }
        tokio::select! {
            changed = state.changed() => if changed.is_err() {
                bail!("the lease manager stopped: {:?}", task.await);
            },
            _ = &mut stop => {
                info!("signal received while follower; exiting");
                drop(state);
                let _ = task.await;
                return Ok(());
            }
        }
    }
    info!(lease = %leader.lease_name, identity = %leader.identity, "became leader; starting the controller");
    metrics.set_leader(true);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    let controller = controller::run_controller(client, config, metrics.clone());
    tokio::pin!(controller);
    let why = tokio::select! {
        res = &mut controller => {
            // Stopped on SIGTERM/SIGINT: hand the Lease over now rather than at expiry.
            metrics.set_leader(false);
            drop(state);
            match task.await {
                Ok(Ok(_)) => info!(lease = %leader.lease_name, "released the leader Lease"),
                other => warn!(result = ?other.map(|r| r.map(|_| ())), "could not release the leader Lease; it expires on its own"),
            }
            return res;
        }
        changed = async {
            loop {
                if state.changed().await.is_err() {
                    return "the lease manager stopped".to_string();
                }
                if !*state.borrow_and_update() {
                    return "the lease manager reports the Lease lost".to_string();
                }
            }
        } => changed,
        why = watchdog(leases, leader.clone()) => why,
    };
    metrics.set_leader(false);
    error!(
        lease = %leader.lease_name,
        identity = %leader.identity,
        reason = %why,
        "lost leadership: stopping now, before the Lease could pass to another replica; exiting to restart as a follower"
    );
    // Exiting drops every in-flight reconcile at once; nothing else runs.
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn config(duration: u64, period: u64, deadline: u64) -> LeaderConfig {
        LeaderConfig {
            lease_name: "c10m-operator".into(),
            namespace: None,
            identity: "a".into(),
            lease_duration: duration,
            renew_period: period,
            renew_deadline: deadline,
        }
    }

    #[test]
    fn deadline_sits_between_renewals_and_expiry() {
        assert!(config(15, 5, 10).validate().is_ok());
        assert_eq!(config(15, 5, 10).grace(), 10);
        assert!(config(15, 5, 15).validate().is_err());
        assert!(config(15, 10, 10).validate().is_err());
        assert!(config(15, 0, 10).validate().is_err());
        let mut empty = config(15, 5, 10);
        empty.lease_name.clear();
        assert!(empty.validate().is_err());
    }

    #[test]
    fn steps_down_at_the_renew_deadline() {
        assert_eq!(
            time_left(1_000_000, 10, 1_004_000),
            Some(Duration::from_secs(6))
        );
        assert_eq!(time_left(1_000_000, 10, 1_010_000), None);
        assert_eq!(time_left(1_000_000, 10, 1_020_000), None);
    }

    fn lease(holder: Option<&str>, renewed_ms: Option<i64>) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                renew_time: renewed_ms
                    .map(|ms| MicroTime(Timestamp::from_millisecond(ms).unwrap())),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn another_holder_or_no_lease_means_step_down() {
        assert_eq!(
            still_holder(Some(&lease(Some("a"), Some(42_000))), "a"),
            Ok(Some(42_000))
        );
        assert!(still_holder(Some(&lease(Some("b"), Some(42_000))), "a").is_err());
        assert!(still_holder(Some(&lease(None, None)), "a").is_err());
        assert!(still_holder(None, "a").is_err());
    }

    #[test]
    fn identities_differ_per_process_start() {
        let a = identity(Some("op-0"));
        let b = identity(Some("op-0"));
        assert!(a.starts_with("op-0_"), "{a}");
        assert_ne!(a, b);
    }
}
