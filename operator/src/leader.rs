//! Leader election (`c10m-operator run --leader-elect`): replicas share a
//! `coordination.k8s.io/v1` Lease; only the holder runs the controller (CRD
//! install, watches, reconciles, drain and shed orders). A follower serves
//! `/healthz` and `/metrics` and does nothing else.
//!
//! The Lease loop is our own (ADR 0009), on plain reads and writes with
//! optimistic concurrency: every write carries the `resourceVersion` it was
//! computed from, so of two replicas racing for a free Lease exactly one
//! wins (the other gets 409 Conflict and reads again).
//!
//! - **Following**: read the Lease; take it (write ourselves as holder) when
//!   there is none, it names no holder, or its `renewTime` +
//!   `leaseDurationSeconds` has passed on this process's clock; else sleep
//!   until that moment (at most `lease_duration`) and read again.
//! - **Leading**: renew (write `renewTime`) every `renew_period` after the
//!   last successful renewal. A failed or timed-out renewal is retried after
//!   [`RETRY_FIRST`], doubling up to [`RETRY_MAX`]; each attempt is bounded by
//!   [`LeaderConfig::attempt_timeout`] and by the deadline. The retry delay
//!   starts over after every success, so transient errors earlier in a term
//!   never lengthen the wait after the next one (kube-lease-manager 0.13,
//!   which this replaces, kept doubling its delay up to 30 s until
//!   leadership changed hands: issue 21, item 10; home-operations/kopiur#319
//!   and #324).
//! - **Stepping down**: when no renewal has succeeded for `renew_deadline`
//!   (counted from the moment the last successful write was sent, which is
//!   the `renewTime` it wrote), or a renewal finds the Lease deleted or
//!   naming another holder, the process logs `lost leadership` with the
//!   reason and exits, so the Deployment restarts it as a follower. Since
//!   `renew_deadline < lease_duration`, the old leader has stopped before
//!   any other replica may take the Lease (`renewTime + lease_duration`);
//!   the difference is the clock skew tolerated between nodes.
//! - **Handing over**: on SIGTERM/SIGINT the controller finishes its
//!   in-flight reconciles, then the Lease is released (holder cleared), and
//!   a follower takes it when it next reads it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::controller::{self, RunConfig};
use crate::names::FIELD_MANAGER;
use crate::telemetry::Metrics;

/// Delay before the first retry of a failed Lease read or write: half a
/// second, so a blip shorter than that costs one retry. The delay doubles
/// with each further failure, up to [`RETRY_MAX`], and starts over after
/// every success. (Our choice; the kubelet's node Lease starts at 200 ms,
/// `k8s.io/component-helpers/apimachinery/lease`.)
pub const RETRY_FIRST: Duration = Duration::from_millis(500);

/// Longest delay between retries of a failed Lease read or write: 2 s,
/// client-go's default leader-election retry period (`RetryPeriod`, also
/// kube-controller-manager's `--leader-elect-retry-period`). With the
/// defaults, the 5 s between a missed renewal and the renew deadline hold
/// four attempts (at +0, +0.5, +1.5 and +3.5 s) when each fails fast.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

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

    /// Longest one Lease read or write may take before it counts as failed:
    /// half the time a missed renewal leaves before the renew deadline
    /// (`(renew_deadline − renew_period) / 2`, 2.5 s by default), so an
    /// attempt that stalls (connection accepted, no answer) still leaves
    /// room for another before the deadline (home-operations/kopiur#324:
    /// one slow attempt must not use up the whole budget).
    pub fn attempt_timeout(&self) -> Duration {
        Duration::from_secs(self.renew_deadline - self.renew_period) / 2
    }
}

/// The retry delay of one run of failures: [`RETRY_FIRST`], doubling up to
/// [`RETRY_MAX`]. A success ends the run: the next failure waits
/// [`RETRY_FIRST`] again.
#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: RETRY_FIRST }
    }
}

impl Backoff {
    /// A call failed: how long to wait before the next one.
    pub fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (wait * 2).min(RETRY_MAX);
        wait
    }

    /// A call succeeded: the next failure starts over at [`RETRY_FIRST`].
    pub fn succeeded(&mut self) {
        self.next = RETRY_FIRST;
    }
}

/// What the holder does next ([`Renewal::step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sleep until then.
    Wait(Instant),
    /// Renew now; give the attempt at most this long.
    Attempt(Duration),
    /// The renew deadline has passed: stop acting.
    StepDown,
}

/// The holder's renewal schedule: when to renew, when to retry, how long an
/// attempt may take and when to give up. Pure: the caller feeds it the
/// clock and the outcome of each attempt.
#[derive(Clone, Debug)]
pub struct Renewal {
    /// When the last successful renewal was sent (its `renewTime`).
    renewed: Instant,
    /// When to retry after a failure (`None`: renew at `renewed + period`).
    retry_at: Option<Instant>,
    backoff: Backoff,
    period: Duration,
    deadline: Duration,
    attempt_timeout: Duration,
}

impl Renewal {
    /// The schedule of a holder whose last successful write (acquiring or
    /// renewing) was sent at `renewed`.
    pub fn new(leader: &LeaderConfig, renewed: Instant) -> Self {
        Renewal {
            renewed,
            retry_at: None,
            backoff: Backoff::default(),
            period: Duration::from_secs(leader.renew_period),
            deadline: Duration::from_secs(leader.renew_deadline),
            attempt_timeout: leader.attempt_timeout(),
        }
    }

    /// What to do at `now`.
    pub fn step(&self, now: Instant) -> Step {
        let deadline = self.renewed + self.deadline;
        if now >= deadline {
            return Step::StepDown;
        }
        let due = self.retry_at.unwrap_or(self.renewed + self.period);
        if now < due {
            return Step::Wait(due.min(deadline));
        }
        Step::Attempt(self.attempt_timeout.min(deadline - now))
    }

    /// A renewal sent at `sent` succeeded.
    pub fn succeeded(&mut self, sent: Instant) {
        self.renewed = self.renewed.max(sent);
        self.retry_at = None;
        self.backoff.succeeded();
    }

    /// An attempt failed (or timed out) at `now`.
    pub fn failed(&mut self, now: Instant) {
        self.retry_at = Some(now + self.backoff.failed());
    }

    /// When the last successful renewal was sent.
    pub fn renewed(&self) -> Instant {
        self.renewed
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

/// How long a follower must still wait before it may take the Lease, at
/// `now_ms` (epoch ms, this process's clock): `None` when it may take it
/// now — there is no Lease, it names no holder (or `identity`), it has no
/// `renewTime`, or `renewTime` + its `leaseDurationSeconds` (else
/// `default_duration` seconds) has passed.
pub fn held_for(
    lease: Option<&Lease>,
    identity: &str,
    default_duration: u64,
    now_ms: i64,
) -> Option<Duration> {
    let spec = lease?.spec.as_ref()?;
    let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty())?;
    if holder == identity {
        return None;
    }
    let renewed_ms = spec.renew_time.as_ref()?.0.as_millisecond();
    let duration_s = spec
        .lease_duration_seconds
        .and_then(|d| u64::try_from(d).ok())
        .unwrap_or(default_duration);
    let left = renewed_ms + (duration_s as i64) * 1000 - now_ms;
    (left > 0).then(|| Duration::from_millis(left as u64))
}

/// The Lease with `identity` as its holder from `now`: `previous` (`None`:
/// a new Lease `name`) with the holder, `acquireTime` (kept when the
/// holder already was `identity`), `renewTime`, `leaseDurationSeconds`
/// and `leaseTransitions` (one more when the holder changes) set. Its
/// `resourceVersion` is `previous`'s: the write fails with 409 Conflict if
/// the Lease changed since it was read.
pub fn claimed(
    previous: Option<&Lease>,
    name: &str,
    identity: &str,
    duration: u64,
    now: Timestamp,
) -> Lease {
    let mut lease = previous.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: None,
    });
    let old = lease.spec.take().unwrap_or_default();
    let ours = old.holder_identity.as_deref() == Some(identity);
    let transitions = old.lease_transitions.unwrap_or(0);
    lease.spec = Some(LeaseSpec {
        holder_identity: Some(identity.into()),
        acquire_time: Some(
            old.acquire_time
                .clone()
                .filter(|_| ours)
                .unwrap_or(MicroTime(now)),
        ),
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(i32::try_from(duration).unwrap_or(i32::MAX)),
        lease_transitions: Some(if ours || previous.is_none() {
            transitions
        } else {
            transitions + 1
        }),
        ..old
    });
    lease
}

/// `mine` renewed at `now` (`renewTime` set; the rest, `resourceVersion`
/// included, as last written).
pub fn renewed(mine: &Lease, now: Timestamp) -> Lease {
    let mut lease = mine.clone();
    lease.spec.get_or_insert_with(Default::default).renew_time = Some(MicroTime(now));
    lease
}

/// `mine` released: no holder, no times, no duration (the transitions
/// count stays), so a follower takes it at its next read.
pub fn released(mine: &Lease) -> Lease {
    let mut lease = mine.clone();
    let spec = lease.spec.get_or_insert_with(Default::default);
    spec.holder_identity = None;
    spec.acquire_time = None;
    spec.renew_time = None;
    spec.lease_duration_seconds = None;
    lease
}

/// One read (and maybe a write) of a follower.
enum Acquire {
    /// We hold the Lease: the object written, and when the write was sent.
    Led(Box<Lease>, Instant),
    /// Another holder's Lease is valid this much longer.
    Held(Duration),
    /// Another replica wrote the Lease between our read and our write.
    Raced,
}

/// One renewal attempt of the holder.
enum Renew {
    /// Renewed: the object written, and when the write was sent.
    Done(Box<Lease>, Instant),
    /// The Lease is no longer ours (why).
    Lost(String),
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// The Lease, through `api`, as `leader.identity`.
struct LeaseLock {
    api: Api<Lease>,
    leader: LeaderConfig,
}

impl LeaseLock {
    fn params() -> PostParams {
        PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        }
    }

    async fn try_acquire(&self) -> Result<Acquire, kube::Error> {
        let name = &self.leader.lease_name;
        let current = self.api.get_opt(name).await?;
        // `sent` no later than the `renewTime` written: the renew deadline
        // counts from it.
        let sent = Instant::now();
        let now = Timestamp::now();
        if let Some(left) = held_for(
            current.as_ref(),
            &self.leader.identity,
            self.leader.lease_duration,
            now.as_millisecond(),
        ) {
            return Ok(Acquire::Held(left));
        }
        let claim = claimed(
            current.as_ref(),
            name,
            &self.leader.identity,
            self.leader.lease_duration,
            now,
        );
        let written = match &current {
            None => self.api.create(&Self::params(), &claim).await,
            Some(_) => self.api.replace(name, &Self::params(), &claim).await,
        };
        match written {
            Ok(lease) => Ok(Acquire::Led(Box::new(lease), sent)),
            // 409: AlreadyExists (create) or Conflict (replace); 404: deleted
            // since the read. Either way, read again.
            Err(e) if is_status(&e, 409) || is_status(&e, 404) => Ok(Acquire::Raced),
            Err(e) => Err(e),
        }
    }

    /// Reads the Lease until this process holds it; returns the object
    /// written and when the write was sent. Fails only when the API refuses
    /// us the Lease (401/403: credentials or RBAC).
    async fn acquire(&self) -> anyhow::Result<(Lease, Instant)> {
        let limit = self.leader.attempt_timeout();
        let max_wait = Duration::from_secs(self.leader.lease_duration);
        let mut backoff = Backoff::default();
        loop {
            let failure = match tokio::time::timeout(limit, self.try_acquire()).await {
                Ok(Ok(Acquire::Led(lease, sent))) => return Ok((*lease, sent)),
                Ok(Ok(Acquire::Held(left))) => {
                    backoff.succeeded();
                    tokio::time::sleep(left.min(max_wait)).await;
                    continue;
                }
                Ok(Ok(Acquire::Raced)) => {
                    backoff.succeeded();
                    continue;
                }
                Ok(Err(e)) if is_status(&e, 401) || is_status(&e, 403) => {
                    return Err(e).with_context(|| {
                        format!(
                            "cannot use the leader Lease {} (RBAC: get, create, update on leases)",
                            self.leader.lease_name
                        )
                    });
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {limit:?}"),
            };
            let wait = backoff.failed();
            warn!(lease = %self.leader.lease_name, error = %failure, retry_in = ?wait, "cannot read or take the leader Lease");
            tokio::time::sleep(wait).await;
        }
    }

    async fn try_renew(&self, mine: &Lease) -> Result<Renew, kube::Error> {
        let name = &self.leader.lease_name;
        let sent = Instant::now();
        match self
            .api
            .replace(name, &Self::params(), &renewed(mine, Timestamp::now()))
            .await
        {
            Ok(lease) => Ok(Renew::Done(Box::new(lease), sent)),
            Err(e) if is_status(&e, 404) => Ok(Renew::Lost("the Lease was deleted".into())),
            Err(e) if is_status(&e, 409) => {
                // Written since our last write: by another replica, or by our
                // own write whose answer was lost. Read it and judge.
                let current = self.api.get_opt(name).await?;
                if let Err(why) = still_holder(current.as_ref(), &self.leader.identity) {
                    return Ok(Renew::Lost(why));
                }
                let current = current.expect("still_holder saw a Lease");
                let sent = Instant::now();
                let lease = self
                    .api
                    .replace(name, &Self::params(), &renewed(&current, Timestamp::now()))
                    .await?;
                Ok(Renew::Done(Box::new(lease), sent))
            }
            Err(e) => Err(e),
        }
    }

    /// Renews the Lease on [`Renewal`]'s schedule; resolves, with the
    /// reason, when this process must step down.
    async fn hold(&self, mut mine: Lease, sent: Instant) -> String {
        let mut renewal = Renewal::new(&self.leader, sent);
        loop {
            let limit = match renewal.step(Instant::now()) {
                Step::StepDown => {
                    return format!(
                        "the Lease was not renewed within the renew deadline ({} s)",
                        self.leader.renew_deadline
                    );
                }
                Step::Wait(until) => {
                    tokio::time::sleep_until(until).await;
                    continue;
                }
                Step::Attempt(limit) => limit,
            };
            let failure = match tokio::time::timeout(limit, self.try_renew(&mine)).await {
                Ok(Ok(Renew::Done(lease, sent))) => {
                    mine = *lease;
                    renewal.succeeded(sent);
                    continue;
                }
                Ok(Ok(Renew::Lost(why))) => return why,
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {limit:?}"),
            };
            renewal.failed(Instant::now());
            let left = (renewal.renewed() + Duration::from_secs(self.leader.renew_deadline))
                .saturating_duration_since(Instant::now());
            warn!(lease = %self.leader.lease_name, error = %failure, deadline_in = ?left, "cannot renew the leader Lease; retrying");
        }
    }

    /// Clears the holder if it is still us.
    async fn release(&self) -> Result<bool, kube::Error> {
        let name = &self.leader.lease_name;
        let current = self.api.get_opt(name).await?;
        match current {
            Some(lease) if still_holder(Some(&lease), &self.leader.identity).is_ok() => {
                self.api
                    .replace(name, &Self::params(), &released(&lease))
                    .await?;
                Ok(true)
            }
            _ => Ok(false),
        }
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
    let lock = LeaseLock {
        api: Api::namespaced(client.clone(), &namespace),
        leader: leader.clone(),
    };
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
    let (mine, sent) = tokio::select! {
        got = lock.acquire() => got.with_context(|| format!("Lease {namespace}/{}", leader.lease_name))?,
        _ = controller::shutdown_signal() => {
            info!("signal received while follower; exiting");
            return Ok(());
        }
    };
    info!(lease = %leader.lease_name, identity = %leader.identity, "became leader; starting the controller");
    metrics.set_leader(true);
    let controller = controller::run_controller(client, config, metrics.clone());
    tokio::pin!(controller);
    let why = tokio::select! {
        res = &mut controller => {
            // Stopped on SIGTERM/SIGINT: hand the Lease over now rather than at expiry.
            metrics.set_leader(false);
            match tokio::time::timeout(leader.attempt_timeout(), lock.release()).await {
                Ok(Ok(true)) => info!(lease = %leader.lease_name, "released the leader Lease"),
                Ok(Ok(false)) => info!(lease = %leader.lease_name, "the leader Lease was no longer ours to release"),
                Ok(Err(e)) => warn!(error = %e, "could not release the leader Lease; it expires on its own"),
                Err(_) => warn!("releasing the leader Lease timed out; it expires on its own"),
            }
            return res;
        }
        why = lock.hold(mine, sent) => why,
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
        assert_eq!(
            config(15, 5, 10).attempt_timeout(),
            Duration::from_millis(2500)
        );
        assert!(config(15, 5, 15).validate().is_err());
        assert!(config(15, 10, 10).validate().is_err());
        assert!(config(15, 0, 10).validate().is_err());
        let mut empty = config(15, 5, 10);
        empty.lease_name.clear();
        assert!(empty.validate().is_err());
    }

    #[test]
    fn the_retry_delay_doubles_to_its_bound_and_starts_over_after_a_success() {
        let mut b = Backoff::default();
        let run: Vec<Duration> = (0..5).map(|_| b.failed()).collect();
        assert_eq!(
            run,
            [500, 1000, 2000, 2000, 2000].map(Duration::from_millis)
        );
        b.succeeded();
        assert_eq!(b.failed(), RETRY_FIRST);
    }

    /// Drives a holder's [`Renewal`] (defaults: renew every 5 s, deadline
    /// 10 s) for `horizon`, each attempt taking `rtt` when answered. An
    /// attempt started while `down(now, last renewal)` (offsets from the
    /// start) fails: at once when `stall` is false, else when it times out.
    /// Returns the offsets at which renewals were sent, or the offset of
    /// the step-down. Asserts that no attempt may run past the deadline.
    fn drive(
        horizon: Duration,
        rtt: Duration,
        stall: bool,
        mut down: impl FnMut(Duration, Duration) -> bool,
    ) -> Result<Vec<Duration>, Duration> {
        let leader = config(15, 5, 10);
        let t0 = Instant::now();
        let mut renewal = Renewal::new(&leader, t0);
        let mut now = t0;
        let mut sent = vec![Duration::ZERO];
        while now - t0 < horizon {
            match renewal.step(now) {
                Step::StepDown => return Err(now - t0),
                Step::Wait(until) => {
                    assert!(until > now, "a wait that does not advance");
                    now = until;
                }
                Step::Attempt(limit) => {
                    assert!(
                        now + limit <= renewal.renewed() + Duration::from_secs(10),
                        "an attempt may run past the deadline"
                    );
                    let last = *sent.last().unwrap();
                    if down(now - t0, last) {
                        now += if stall { limit } else { rtt.min(limit) };
                        renewal.failed(now);
                    } else {
                        let at = now;
                        now += rtt;
                        renewal.succeeded(at);
                        sent.push(at - t0);
                    }
                }
            }
        }
        Ok(sent)
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn a_blip_at_every_renewal_of_a_term_never_reaches_the_deadline() {
        // The e2e's fault (tests/tests/ha.rs): from 4.5 s to 6 s after each
        // renewal, every call fails — so every renewal due at 5 s fails, 50
        // times in one term.
        let renewals = drive(Duration::from_secs(400), ms(30), false, |now, last| {
            now >= last + ms(4500) && now < last + ms(6000)
        })
        .expect("a leader stepped down over 1.5 s blips");
        assert!(renewals.len() > 50, "{} renewals", renewals.len());
        for pair in renewals.windows(2) {
            // Fails at 5 s (answered after 30 ms), retries 0.5 s later
            // (fails), then 1 s later (renews): the same gap at the 50th
            // blip as at the first.
            assert_eq!(
                pair[1] - pair[0],
                ms(5000 + 30 + 500 + 30 + 1000),
                "{renewals:?}"
            );
        }
    }

    #[test]
    fn a_stalled_renewal_leaves_room_for_a_retry() {
        // No answer from 5 s to 7.9 s after each renewal (kopiur#319): the
        // attempt at 5 s times out at 7.5 s, the retry at 8 s renews.
        let renewals = drive(Duration::from_secs(100), ms(30), true, |now, last| {
            now >= last + ms(5000) && now < last + ms(7900)
        })
        .expect("a leader stepped down over 2.9 s stalls");
        for pair in renewals.windows(2) {
            assert_eq!(pair[1] - pair[0], ms(8000), "{renewals:?}");
        }
    }

    #[test]
    fn an_outage_longer_than_the_deadline_steps_down_at_the_deadline() {
        for stall in [false, true] {
            let outcome = drive(Duration::from_secs(60), ms(30), stall, |now, _| {
                now >= Duration::from_secs(12)
            });
            // Renewed at 0, 5, 10 s; then nothing answers: out at 20 s.
            assert_eq!(outcome, Err(Duration::from_millis(20_000)), "stall {stall}");
        }
    }

    fn lease(holder: Option<&str>, renewed_ms: Option<i64>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("c10m-operator".into()),
                resource_version: Some("7".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                renew_time: renewed_ms
                    .map(|ms| MicroTime(Timestamp::from_millisecond(ms).unwrap())),
                acquire_time: Some(MicroTime(Timestamp::from_millisecond(1_000).unwrap())),
                lease_duration_seconds: Some(15),
                lease_transitions: Some(3),
                ..Default::default()
            }),
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
    fn a_follower_takes_a_lease_that_is_free_or_expired_on_its_clock() {
        let now = 100_000;
        assert_eq!(held_for(None, "a", 15, now), None);
        assert_eq!(held_for(Some(&lease(None, Some(now))), "a", 15, now), None);
        assert_eq!(
            held_for(Some(&lease(Some(""), Some(now))), "a", 15, now),
            None
        );
        assert_eq!(
            held_for(Some(&lease(Some("a"), Some(now))), "a", 15, now),
            None
        );
        assert_eq!(held_for(Some(&lease(Some("b"), None)), "a", 15, now), None);
        // Valid until renewTime + the Lease's own 15 s.
        assert_eq!(
            held_for(Some(&lease(Some("b"), Some(now - 4_000))), "a", 60, now),
            Some(ms(11_000))
        );
        assert_eq!(
            held_for(Some(&lease(Some("b"), Some(now - 15_000))), "a", 60, now),
            None
        );
        // No leaseDurationSeconds: ours.
        let mut bare = lease(Some("b"), Some(now - 4_000));
        bare.spec.as_mut().unwrap().lease_duration_seconds = None;
        assert_eq!(held_for(Some(&bare), "a", 60, now), Some(ms(56_000)));
    }

    #[test]
    fn a_claim_names_us_and_counts_a_change_of_holder() {
        let now = Timestamp::from_millisecond(50_000).unwrap();
        let at = |t: &Option<MicroTime>| t.as_ref().map(|t| t.0.as_millisecond());

        let taken = claimed(Some(&lease(Some("b"), Some(20_000))), "x", "a", 15, now);
        assert_eq!(taken.metadata.resource_version.as_deref(), Some("7"));
        let spec = taken.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(at(&spec.acquire_time), Some(50_000));
        assert_eq!(at(&spec.renew_time), Some(50_000));
        assert_eq!(spec.lease_duration_seconds, Some(15));
        assert_eq!(spec.lease_transitions, Some(4));

        // Our own (a write whose answer was lost): same term, same count.
        let again = claimed(Some(&lease(Some("a"), Some(20_000))), "x", "a", 15, now);
        let spec = again.spec.unwrap();
        assert_eq!(at(&spec.acquire_time), Some(1_000));
        assert_eq!(spec.lease_transitions, Some(3));

        // No Lease yet: a new one, named, with no resourceVersion.
        let new = claimed(None, "x", "a", 15, now);
        assert_eq!(new.metadata.name.as_deref(), Some("x"));
        assert_eq!(new.metadata.resource_version, None);
        assert_eq!(new.spec.unwrap().lease_transitions, Some(0));

        let renew = renewed(&lease(Some("a"), Some(20_000)), now);
        assert_eq!(renew.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(at(&renew.spec.unwrap().renew_time), Some(50_000));

        let free = released(&lease(Some("a"), Some(20_000))).spec.unwrap();
        assert_eq!(free.holder_identity, None);
        assert_eq!(free.renew_time, None);
        assert_eq!(free.lease_transitions, Some(3));
        assert_eq!(
            held_for(Some(&released(&lease(Some("a"), Some(20_000)))), "b", 15, 0),
            None
        );
    }

    #[test]
    fn identities_differ_per_process_start() {
        let a = identity(Some("op-0"));
        let b = identity(Some("op-0"));
        assert!(a.starts_with("op-0_"), "{a}");
        assert_ne!(a, b);
    }
}
