//! A rollout within the fleet's reconnect budget (pure; ADR 0011).
//!
//! The Deployment controller steps the rollout: the rendered strategy
//! (`maxSurge` = plan.rolloutSurge, `maxUnavailable: 0`, see
//! [`crate::render`]) removes old shards only as updated ones become
//! available, and an updated shard counts as available `minReadySeconds`
//! after it is Ready. The operator owns that one field and uses it as the
//! gate between steps ([`Rollout::pace`]): an old shard closes what it
//! holds at plan.drainRate once removed, so the next step's updated shards
//! become available only when the last step's shards have closed what
//! they held when they were cordoned. So at most `rolloutSurge` old shards
//! drain at once, closing at most spec.rollout.maxReconnectRate
//! connections/s together, and a step lasts as long as its shards' clients
//! take to move, not a full cap's drain. Outside a rollout the gate stays
//! at plan.rolloutStepSeconds (a cap's drain), so a rollout that runs while
//! no operator does (stopped, failing over) keeps the budget too, at the
//! slower pace.
//!
//! The operator also says where the closed clients go. While a rollout is
//! under way, every old shard not yet draining is cordoned (`POST
//! /cordon`): its readiness drops, it leaves the Service's endpoints and
//! keeps its connections, so the clients a drain closes can only reconnect
//! to updated shards, and none is moved twice. A paused Deployment
//! (`kubectl rollout pause`) starts no step; its old shards stay cordoned
//! (uncordoning them for the pause would let the clients of the first
//! drain after `kubectl rollout resume` race their cordon back onto old
//! shards, and move them twice). A cordoned shard that runs the current
//! template again (a rollback, `kubectl rollout undo`) is uncordoned. Each
//! cordon is recorded on the pod ([`CORDONED_ANNOTATION`], the connections
//! the shard held as it answered), so an order is sent once and a new
//! leader knows what the old one did.
//!
//! [`observe`] reads the rollout from the Deployment, its ReplicaSets and
//! the fleet's pods; [`Rollout::orders`] says which shards to cordon and
//! uncordon; [`Rollout::pace`] carries the step bookkeeping over from the
//! last status and sets the gate.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::api::status::RolloutStatus;
use crate::autoscale::observe::ready_condition;
use crate::names::{
    CORDONED_ANNOTATION, PAUSED_BY_FLEET_ANNOTATION, POD_TEMPLATE_HASH, REVISION_ANNOTATION,
    STEP_DRAINING_ANNOTATION,
};

/// Milliseconds added to a step's drain (before it is rounded up to whole
/// seconds) for clients that raced the cordon onto an old shard: the
/// endpoint update is not instant, and the e2e test's balancer follows
/// within 250 ms, so a shard may take a few clients more than it reported.
pub const STEP_MARGIN_MS: i64 = 500;

/// Seconds the first drain after a cordon waits for the cordoned shards to
/// leave the Service's endpoints: the readiness probes that see the 503
/// ([`crate::render::READINESS_SECONDS`]), plus 1 s for the endpoint
/// controller and the dataplane (kube-proxy applies an EndpointSlice
/// change within its sync period, 1 s by default; the e2e test's balancer
/// follows within 0.8 s). A client a drain closes before then may land on
/// an old shard and be moved again (`make bench-rollout` saw 106 of 16,000
/// without this wait).
pub const CORDON_SETTLE_SECONDS: i64 = crate::render::READINESS_SECONDS + 1;

/// Seconds a step's shards need to close `held` connections at `rate`
/// connections/s each, with [`STEP_MARGIN_MS`], rounded up; 0 when they
/// hold none (their step closes nothing; only a client that raced a cordon
/// could be on such a shard, and no step starts before the cordons have
/// settled, [`CORDON_SETTLE_SECONDS`]).
pub fn step_seconds(held: i64, rate: i64) -> i64 {
    if held <= 0 {
        return 0;
    }
    div_ceil(held * 1000 / rate.max(1) + STEP_MARGIN_MS, 1000)
}

/// One of the fleet's shards as a rollout sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Pod name.
    pub name: String,
    /// Pod IP, once it has one.
    pub ip: Option<String>,
    /// Runs the template being rolled out.
    pub updated: bool,
    /// The revision of its ReplicaSet, when that was listed.
    pub revision: Option<i64>,
    /// The operator cordoned it ([`CORDONED_ANNOTATION`]).
    pub cordoned: bool,
    /// Connections it held when it answered its cordon (the annotation's
    /// value), 0 when vacant ([`Orders::vacant`]: not cordoned, holding
    /// nothing); `None` when not cordoned or not recorded.
    pub held: Option<i64>,
    /// The pod is terminating (its shard drains).
    pub terminating: bool,
    /// The pod's `Ready` condition is True (it is in the Service's
    /// endpoints).
    pub ready: bool,
    /// When its `Ready` condition last turned True (1 s resolution).
    pub ready_since: Option<Timestamp>,
}

/// The rollout as observed: progress, and the shards orders go to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rollout {
    /// Progress for `status.rollout`; `None` when every shard runs the
    /// current template and none is draining (after [`Rollout::pace`]), or
    /// without a readable revision.
    pub status: Option<RolloutStatus>,
    /// The fleet's shards (pods), when listed.
    pub shards: Vec<Shard>,
    /// [`Rollout::after`] recorded a cordon carried out just now.
    pub cordoned_now: bool,
    /// Replicas the Deployment's older ReplicaSets still want: shards of an
    /// older template, whether or not their pods exist (pods refused by the
    /// API never do).
    pub old_replicas: i32,
    /// Shards not terminating that carried a cordon record when observed,
    /// of any revision, before this reconcile's orders: fewer than the last
    /// status's `cordonedShards` means cordoned shards were removed (a
    /// step), even when a new revision turned more shards old.
    pub cordons_seen: i32,
}

/// What to tell the shards' admin endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Orders {
    /// Shards to cordon (`POST /cordon`): old, not draining, not yet
    /// cordoned, while the rollout runs and once an updated shard is Ready
    /// (before that, the old shards are the only ones new clients can
    /// reach).
    pub cordon: Vec<Shard>,
    /// Shards to uncordon (`POST /uncordon`): cordoned ones that run the
    /// current template (a rollback made their template current again).
    pub uncordon: Vec<Shard>,
    /// With cordons to send: the updated shards, Ready, that the cordoned
    /// shards' clients will land on. The cordons go out only once one of
    /// them answers its readiness probe ([`crate::reconcile::cordon`]): a
    /// pod's Ready condition is the last probe's word, and can come before
    /// its server listens (KWOK's pods, whose servers may start seconds
    /// later), or outlive it.
    pub landing: Vec<Shard>,
    /// Among the orders carried out: shards to be cordoned where nothing
    /// listens at the admin endpoint (the connection was refused). Every
    /// rendered shard serves its readiness probe there, so no server runs
    /// in them and they hold no clients: a step may take them at once.
    pub vacant: Vec<Shard>,
}

/// What each updated shard may admit while a rollout moves clients
/// ([`Rollout::limits`]): `POST /limit` to `shards`, renewed at each
/// reconcile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Connections each shard admits, at most.
    pub connections: i64,
    /// Seconds the limit lasts unless renewed ([`limit_lease_seconds`]).
    pub seconds: i64,
    /// The updated shards, not terminating, with an IP.
    pub shards: Vec<Shard>,
}

/// Seconds a shard's admission limit lasts unless renewed: two of the
/// cap's steps (`cap_step_seconds`) plus [`REQUEUE_MARGIN_SECONDS`]. A
/// rollout is reconciled at least once a step (its drain's end is a
/// requeue deadline, and each step's pods change), so the limit is renewed
/// before it lapses while the rollout runs, and lapses by itself soon
/// after it ends, whatever became of the operator.
pub fn limit_lease_seconds(cap_step_seconds: i64) -> i64 {
    2 * cap_step_seconds.max(0) + REQUEUE_MARGIN_SECONDS
}

/// The plan's figures a rollout is paced by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pace {
    /// One departing shard's close rate, connections/s (plan.drainRate).
    pub drain_rate: i64,
    /// Old shards removed per step (plan.rolloutSurge).
    pub surge: i64,
    /// Seconds a shard needs to drain its cap (plan.rolloutStepSeconds):
    /// the gate outside a rollout, and its bound during one.
    pub cap_step_seconds: i64,
}

impl Pace {
    /// The cap's step, seconds, within `0..=i32::MAX / 2` (a gate, and a
    /// held gate's margin on top, fit an i32).
    fn cap(&self) -> i64 {
        self.cap_step_seconds.clamp(0, i64::from(i32::MAX / 2))
    }
}

/// The old shards not draining.
fn serving_old(shards: &[Shard]) -> impl Iterator<Item = &Shard> {
    shards.iter().filter(|s| !s.updated && !s.terminating)
}

/// Old shards not draining that are cordoned.
fn cordoned(shards: &[Shard]) -> i32 {
    serving_old(shards).filter(|s| s.cordoned).count() as i32
}

/// The old shards serving (`old`) that the next step may remove, as the
/// Deployment and ReplicaSet controllers pick them: of the `surge` shards
/// a step removes, pods not Ready first (the Deployment controller's
/// cleanup of unhealthy replicas, the ReplicaSet's `ActivePodsWithRanks`),
/// then the oldest ReplicaSet's. So the step takes from the shards ranked
/// (not Ready first, then by revision, oldest first; an unknown revision
/// first) up to the rank of the `surge`-th: every shard of that rank or a
/// lower one may go. A step's drain is sized by the most one of them holds:
/// the Ready shards of an interrupted revision, not yet cordoned and their
/// counts unknown, no longer size the step that removes the cordoned shards
/// of the revision before (a 9 s stall at the cap's step,
/// `tests/tests/rollout.rs` third revision).
fn next_step<'a>(old: &[&'a Shard], surge: i64) -> impl Iterator<Item = &'a Shard> {
    let rank = |s: &Shard| (s.ready, s.revision);
    let mut ranks: Vec<_> = old.iter().map(|s| rank(s)).collect();
    ranks.sort_unstable();
    let removed = usize::try_from(surge.max(1)).unwrap_or(usize::MAX);
    let last = (removed.min(ranks.len()).checked_sub(1)).and_then(|i| ranks.get(i).copied());
    old.iter()
        .copied()
        .filter(move |s| last.is_some_and(|l| rank(s) <= l))
}

/// What an old shard holds, as far as known: what it reported at its cordon
/// (0 when vacant), or 0 without an IP (its pod not yet placed or started
/// holds no clients); `None` while its count is unknown.
fn held(s: &Shard) -> Option<i64> {
    s.held.or(s.ip.is_none().then_some(0))
}

/// `n ÷ d` rounded up, for `n ≥ 0` and `d ≥ 1`.
fn div_ceil(n: i64, d: i64) -> i64 {
    (n.max(0) + d.max(1) - 1) / d.max(1)
}

/// Whole seconds from `from` to `to`: rounded up, at least 0.
fn seconds_until(from: Timestamp, to: Timestamp) -> i64 {
    div_ceil(to.duration_since(from).as_millis() as i64, 1000)
}

impl Rollout {
    /// Whether a rollout is under way: an old shard is still serving or
    /// draining.
    pub fn under_way(&self) -> bool {
        self.status
            .as_ref()
            .is_some_and(|s| s.old_shards + s.draining_shards > 0)
    }

    /// The rollout once `done` (the orders the shards answered) is carried
    /// out: their cordons (and what the cordoned ones held) as they are
    /// now, and the status counting them.
    pub fn after(mut self, done: &Orders) -> Rollout {
        for s in &mut self.shards {
            if let Some(d) = done.cordon.iter().find(|d| d.name == s.name) {
                s.cordoned = true;
                s.held = d.held;
            } else if done.uncordon.iter().any(|d| d.name == s.name) {
                s.cordoned = false;
                s.held = None;
            } else if done.vacant.iter().any(|d| d.name == s.name) {
                s.held = Some(0);
            }
        }
        if let Some(st) = &mut self.status {
            st.cordoned_shards = cordoned(&self.shards);
        }
        self.cordoned_now |= !done.cordon.is_empty();
        self
    }

    /// The cordon and uncordon orders for this rollout. Draining shards
    /// and shards without an IP get none. Old shards are cordoned once an
    /// updated shard is Ready. Cordons are lifted from shards that run the
    /// current template again (a rollback), once no rollout is under way,
    /// and when no shard could take a new client (no updated shard Ready,
    /// none Ready and uncordoned: the new template's shards failed after
    /// the cordons). A new template whose shards are not Ready yet lifts
    /// no cordon while the interrupted revision's shards serve: the oldest
    /// shards were uncordoned by it, took new clients, and moved them
    /// twice (a third revision, `tests/tests/rollout.rs`).
    pub fn orders(&self) -> Orders {
        let mut orders = Orders::default();
        let up = |s: &&Shard| s.ready && !s.terminating;
        let landing = self.shards.iter().filter(up).any(|s| s.updated);
        let serving = self.shards.iter().filter(up).any(|s| !s.cordoned);
        let under_way = self.under_way();
        for s in self
            .shards
            .iter()
            .filter(|s| s.ip.is_some() && !s.terminating)
        {
            let old = !s.updated;
            if old && under_way && landing && !s.cordoned {
                orders.cordon.push(s.clone());
            } else if s.cordoned && (!old || !under_way || !(landing || serving)) {
                orders.uncordon.push(s.clone());
            }
        }
        if !orders.cordon.is_empty() {
            orders.landing = (self.shards.iter().filter(up))
                .filter(|s| s.updated && s.ip.is_some())
                .cloned()
                .collect();
        }
        orders
    }

    /// The rollout at `now`, given the status the last reconcile wrote
    /// (`previous`), and the Deployment's `minReadySeconds` to set, the gate
    /// between steps (`current`: what it is now).
    ///
    /// A step is seen when fewer old shards serve than `previous` counted,
    /// or fewer pods carry a cordon record than it counted cordoned (a new
    /// revision turns more shards old as the oldest go):
    /// they drain from now for `previous.stepSeconds`, until
    /// `drainingUntil`, which the status keeps (so a new leader or a
    /// restarted operator waits for it too, and the fleet's rollout is
    /// complete only once it has passed). The next step's updated shards
    /// (Ready after the last step) become available at `drainingUntil`, or
    /// at once when nothing drains, but only once every old shard serving is
    /// cordoned (until then the gate is the cap's step). Before they are
    /// Ready the gate is raised, never lowered, to at least the rest of the
    /// drain, so none of them can be available earlier. Outside a rollout
    /// it is `pace.cap_step_seconds`, unless older ReplicaSets still want
    /// replicas that have no pods (nothing to drain: 0). A shard without an
    /// IP holds no clients and needs no cordon. No step starts before
    /// [`CORDON_SETTLE_SECONDS`] after the last cordon (`lastCordonTime`).
    /// When no old shard holds a client (each vacant, unplaced, or cordoned
    /// holding none), nothing drains and the cordons have settled, the gate
    /// is 0: steps close nothing, and the Deployment rolls as fast as its
    /// updated shards become Ready. The gate is always within
    /// `0..=` the cap's step.
    pub fn pace(
        mut self,
        previous: Option<&RolloutStatus>,
        pace: &Pace,
        now: Timestamp,
        current: Option<i32>,
    ) -> (Rollout, i32) {
        let cap = pace.cap();
        let Some(mut st) = self.status.take() else {
            return (self, cap as i32);
        };
        // Removed: fewer old shards serve, or fewer cordoned ones are left
        // (a new revision turns more shards old as the oldest go).
        let removed = previous.map_or(0, |p| {
            (p.old_shards - st.old_shards).max(p.cordoned_shards - self.cordons_seen)
        });
        let stepped = previous.filter(|_| removed > 0);
        let (last_step, until, step_shards) = match stepped {
            // A removal while a step drains is the rest of that step: the
            // controller deletes a step's pods together, but their
            // deletions may reach the watch in different reconciles. Both
            // parts drain, until the later end.
            Some(p) => {
                let end = now + SignedDuration::from_secs(p.step_seconds.max(0));
                let under_way = (p.draining_until.as_ref())
                    .map(|t| t.0)
                    .filter(|u| *u > now);
                (
                    Some(now),
                    Some(under_way.map_or(end, |u| u.max(end))),
                    removed + under_way.map_or(0, |_| p.draining_shards),
                )
            }
            None => previous.map_or((None, None, 0), |p| {
                let t = |t: &Option<Time>| t.as_ref().map(|t| t.0);
                (
                    t(&p.last_step_time),
                    t(&p.draining_until),
                    p.draining_shards,
                )
            }),
        };
        let until = until.filter(|u| *u > now);
        if until.is_some() {
            st.draining_shards = st.draining_shards.max(step_shards);
        }
        st.closes_per_second = i64::from(st.draining_shards) * pace.drain_rate;
        st.last_cordon_time = if self.cordoned_now {
            Some(Time(now))
        } else {
            previous.and_then(|p| p.last_cordon_time.clone())
        };
        let settled = cordons_settled(&st);
        st.last_step_time = last_step.map(Time);
        st.draining_until = until.map(Time);
        let old: Vec<&Shard> = serving_old(&self.shards).collect();
        st.connections_on_old_shards = old.iter().filter_map(|s| held(s)).sum();
        st.connections_to_move = previous
            .map_or(0, |p| p.connections_to_move)
            .max(st.connections_on_old_shards);
        // A step seen in part (fewer shards drain than a step removes):
        // the next removal is its rest, the shards ranked next. Sized as a
        // whole step instead, the rest of the first revision's cordoned
        // shards took the interrupted revision's in, of unknown counts,
        // and drained at the cap's step: a 9 s stall, 1.47 × the ideal
        // (`tests/tests/rollout.rs` third revision, ADR 0011).
        let draining = i64::from(st.draining_shards);
        let taking = match until {
            Some(_) if (1..pace.surge).contains(&draining) => pace.surge - draining,
            _ => pace.surge,
        };
        let most = next_step(&old, taking)
            .map(held)
            .try_fold(0, |m, h| Some(m.max(h?)));
        st.step_seconds = match most {
            Some(h) => step_seconds(h, pace.drain_rate).min(cap),
            None => cap,
        };
        let steps = div_ceil(old.len() as i64, pace.surge);
        let same = previous.filter(|p| {
            (p.old_shards, p.step_seconds, &p.draining_until)
                == (st.old_shards, st.step_seconds, &st.draining_until)
        });
        st.estimated_completion_time = match same {
            Some(p) => p.estimated_completion_time.clone(),
            None => {
                let left = SignedDuration::from_secs(steps * st.step_seconds);
                Some(Time(until.unwrap_or(now) + left))
            }
        };
        if st.old_shards + st.draining_shards == 0 {
            // No old shard to pace: at rest, the gate is the cap's step; if
            // older ReplicaSets still want replicas whose pods never came
            // (refused, or not yet created), their removal closes nothing.
            let gate = if self.old_replicas > 0 { 0 } else { cap };
            return (self, gate as i32);
        }
        let gate_at = until.unwrap_or(now).max(settled.unwrap_or(now));
        // The next step's shards: updated, Ready since the last step was
        // seen. A Ready time is truncated to the second, so a shard Ready
        // in the second the step was seen counts: left out, the gate stayed
        // at the cap's step (a third revision's first surge, Ready 0.5 s
        // after its step, `tests/tests/rollout.rs`).
        let next: Vec<Timestamp> = self
            .shards
            .iter()
            .filter(|s| s.updated && s.ready && !s.terminating)
            .filter_map(|s| s.ready_since)
            .filter(|r| last_step.is_none_or(|l| *r + SignedDuration::from_secs(1) > l))
            .collect();
        let first_last = next.iter().min().zip(next.iter().max());
        // An updated shard not Ready yet: the Deployment created it for
        // this step with the others (its surge) or for a scale-out.
        let starting = (self.shards.iter()).any(|s| s.updated && !s.ready && !s.terminating);
        // Cordoned, vacant (a count without a cordon) or not placed.
        let all_cordoned = old.iter().all(|s| s.cordoned || held(s).is_some());
        let gate = match first_last {
            // Nothing drains and the cordons have settled: a step closes
            // nothing, whether or not an updated shard became Ready after
            // the last step was seen (on a node that starts pods at once,
            // the next step's shard is Ready before the reconcile that
            // sees the step: it stepped one shard every gate, 3 s, in
            // `tests/tests/ha.rs`).
            _ if all_cordoned && st.step_seconds == 0 && gate_at <= now => 0,
            Some((first, last)) if all_cordoned => step_gate(
                *first,
                *last,
                starting,
                gate_at,
                st.step_seconds,
                now,
                current,
            ),
            Some(_) => cap,
            None => i64::from(current.unwrap_or(0)).max(seconds_until(now, gate_at)),
        };
        self.status = Some(st);
        (self, gate.clamp(0, cap) as i32)
    }

    /// The admission limit of the updated shards while this rollout moves
    /// clients (after [`Rollout::pace`], which keeps `connectionsToMove`),
    /// for a fleet of `shards` (the plan's) whose rebalancer tolerates
    /// `max_to_mean_percent` (spec.rebalance.maxToMeanPercent, 120 by
    /// default); `None` (and no `shardConnectionLimit`) when nothing is to
    /// move, an old shard serving has not said what it holds yet, or no
    /// updated shard has an IP.
    ///
    /// Without a limit each step's clients spread over the updated shards
    /// up by then, so the first steps' shards ended fullest: 131 % of the
    /// mean after four steps (`make bench-rollout`, 2026-12-06, ADR 0011).
    /// The limit is connectionsToMove ÷ `shards` × the midpoint of 100 %
    /// and the tolerance (110 % by default: the hottest shard ends inside
    /// the tolerance with room for clients that arrive during the roll),
    /// raised to what the moved clients need on the updated shards up now
    /// (connectionsToMove − connectionsOnOldShards, over them), so no moved
    /// client is turned away for lack of room. A client over the limit is
    /// closed at once by the shard it reached and tries another, as at a
    /// shard's cap; it was never held, so it is not moved.
    pub fn limits(
        mut self,
        shards: i32,
        max_to_mean_percent: i32,
        seconds: i64,
    ) -> (Rollout, Option<Limits>) {
        let under_way = self.under_way();
        // Every old shard serving has said what it holds: until then
        // `connectionsToMove` falls short.
        let counted = serving_old(&self.shards).all(|s| held(s).is_some());
        let Some(st) = self.status.as_mut() else {
            return (self, None);
        };
        let updated: Vec<Shard> = (self.shards.iter())
            .filter(|s| s.updated && !s.terminating && s.ip.is_some())
            .cloned()
            .collect();
        let to_move = st.connections_to_move;
        if to_move <= 0 || updated.is_empty() || !counted || !under_way {
            st.shard_connection_limit = None;
            return (self, None);
        }
        let percent = (100 + i64::from(max_to_mean_percent.max(100))) / 2;
        let even = div_ceil(to_move * percent, 100 * i64::from(shards.max(1)));
        let moved = (to_move - st.connections_on_old_shards).max(0);
        let room = div_ceil(moved, updated.len() as i64);
        let connections = even.max(room);
        st.shard_connection_limit = Some(connections);
        let limits = Limits {
            connections,
            seconds,
            shards: updated,
        };
        (self, Some(limits))
    }

    /// The rollout and the gate once [`Rollout::pace`] gave `gate`, given
    /// the Deployment's gate now (`current`), a pod template that waits
    /// until `held` ([`template_waits`]), and whether the Deployment
    /// controller has not yet observed the Deployment's latest generation
    /// (`behind`).
    ///
    /// While a template waits, the gate is held at the cap's step plus
    /// [`REQUEUE_MARGIN_SECONDS`], so no step starts before the
    /// template is applied, and the status says until when it waits
    /// (`templateHeldUntil`). While the controller is behind, the gate is
    /// never lowered: a template just applied may not have reached its
    /// ReplicaSets yet, and a gate lowered for the revision it replaces
    /// would start a step as the controller starts the new revision's
    /// cleanup. The controller's status write that catches up is a watch
    /// event, so the gate is lowered at the next reconcile.
    pub fn hold(
        mut self,
        gate: i32,
        current: Option<i32>,
        held: Option<Timestamp>,
        behind: bool,
        pace: &Pace,
    ) -> (Rollout, i32) {
        let mut gate = i64::from(gate);
        if held.is_some() {
            gate = gate.max(pace.cap() + REQUEUE_MARGIN_SECONDS);
        }
        if behind {
            gate = gate.max(i64::from(current.unwrap_or(0)));
        }
        if let Some(st) = &mut self.status {
            st.template_held_until = held.map(Time);
        }
        (self, gate as i32)
    }
}

/// The gate for the next step, whose updated shards were first and last
/// Ready at `first` and `last` (every old shard serving is cordoned, and
/// the step may go at `gate_at`), while another of its shards may still be
/// `starting`, at `now`, given the gate the Deployment has (`current`).
///
/// Shards Ready in one second, none starting, all become available at
/// `gate_at`: the gate is set ahead, so the step goes on time even if
/// this operator stops. Otherwise, a pod is available once
/// `minReadySeconds` have passed since it was Ready, and the ReplicaSet
/// controller (Kubernetes 1.35) recounts its pods at the earliest such
/// moment: a gate set ahead from `first` made only that shard available,
/// the Deployment removed one old shard, and the gate raised for the next
/// step held the other back a whole step (a step at half the budget,
/// 1.85 × the ideal in one third-revision run of six, ADR 0011). So the
/// gate is held until the step may go
/// ([`REQUEUE_MARGIN_SECONDS`] past it, in case this operator is late),
/// and opened then: lowered so that every Ready one is available at once,
/// in the ReplicaSet controller's next count. A shard still starting is
/// waited for up to the step's own drain (`step_seconds` past `first`), no
/// longer than a step of fewer shards would cost; past that, the Ready
/// ones go without it. Once open, a `current` gate that already makes
/// them available is kept (no write on each reconcile until the step is
/// seen).
fn step_gate(
    first: Timestamp,
    last: Timestamp,
    starting: bool,
    gate_at: Timestamp,
    step_seconds: i64,
    now: Timestamp,
    current: Option<i32>,
) -> i64 {
    if first == last && !starting {
        return seconds_until(first, gate_at);
    }
    let wait_until = if starting {
        gate_at.max(first + SignedDuration::from_secs(step_seconds))
    } else {
        gate_at
    };
    if now < wait_until {
        return seconds_until(first, wait_until) + REQUEUE_MARGIN_SECONDS;
    }
    let open = now.duration_since(last).as_secs().max(0);
    match current.map(i64::from) {
        Some(c) if c <= open => c,
        _ => open,
    }
}

/// Seconds a held gate keeps beyond the moment this operator means to
/// open it itself, so that the updated shards cannot become available
/// on their own before it does: after a template that waited
/// ([`Rollout::hold`], beyond the cap's step), or a step whose shards were
/// Ready in different seconds ([`step_gate`]). Ready times have 1 s
/// resolution, and the reconcile is requeued 100 ms after its deadline
/// and may wait behind others (a reconcile took up to 3 s under `make
/// bench-scale`'s ramp).
pub const REQUEUE_MARGIN_SECONDS: i64 = 10;

/// Until when a change of the pod template must wait, given the status the
/// last reconcile wrote: the end of the drain under way
/// (`previous.drainingUntil`), if ahead of `now`. Applied mid-drain, a new
/// template gives the Deployment controller room to remove
/// `rolloutSurge` unavailable old pods at once (its cleanup of unhealthy
/// replicas), and cordoned shards are unready: a second drain on top of
/// the one under way, above the budget (ADR 0011). Applied between
/// steps, that removal is the next step, paced like any other.
pub fn template_waits(previous: Option<&RolloutStatus>, now: Timestamp) -> Option<Timestamp> {
    previous?
        .draining_until
        .as_ref()
        .map(|t| t.0)
        .filter(|u| *u > now)
}

/// When a rollout's `status` changes by the clock alone, if ahead of
/// `now`: the end of the drain under way (`drainingUntil`) or the settling
/// of the last cordons (`lastCordonTime` + [`CORDON_SETTLE_SECONDS`]),
/// whichever comes first. No watch sees either; the reconcile is requeued
/// for it.
pub fn next_deadline(status: &RolloutStatus, now: Timestamp) -> Option<Timestamp> {
    let settled = cordons_settled(status);
    let until = status.draining_until.as_ref().map(|t| t.0);
    [until, settled]
        .into_iter()
        .flatten()
        .filter(|t| *t > now)
        .min()
}

/// When the last cordons of a rollout have taken effect: `lastCordonTime`
/// + [`CORDON_SETTLE_SECONDS`]; `None` before any cordon.
fn cordons_settled(status: &RolloutStatus) -> Option<Timestamp> {
    status
        .last_cordon_time
        .as_ref()
        .map(|t| t.0 + SignedDuration::from_secs(CORDON_SETTLE_SECONDS))
}

/// Each of `replica_sets` with a pod-template hash and a readable revision
/// ([`REVISION_ANNOTATION`]): (hash, revision).
fn revisions(replica_sets: &[ReplicaSet]) -> Vec<(&String, i64)> {
    replica_sets
        .iter()
        .filter_map(|rs| {
            Some((
                rs.metadata.labels.as_ref()?.get(POD_TEMPLATE_HASH)?,
                revision(rs)?,
            ))
        })
        .collect()
}

/// The newest of `revisions` ([`revisions`]: highest revision), the
/// current template's: its revision and pod-template hash. `None` without
/// one.
fn current_revision<'a>(revisions: &[(&'a String, i64)]) -> Option<(i64, &'a String)> {
    revisions
        .iter()
        .map(|&(hash, revision)| (revision, hash))
        .max_by_key(|(revision, _)| *revision)
}

/// Whether `deployment` is paused (`spec.paused`), by anyone.
fn is_paused(deployment: &Deployment) -> bool {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.paused)
        .unwrap_or(false)
}

/// What the fleet's `spec.rollout.paused` (`paused`) asks of its
/// `deployment`: `Some(true)` to pause it (and mark the pause as the
/// fleet's, [`PAUSED_BY_FLEET_ANNOTATION`]), `Some(false)` to resume a pause
/// the fleet made, `None` for nothing. A Deployment already paused by
/// someone else (`kubectl rollout pause`) is left alone either way.
pub fn pause_order(paused: bool, deployment: &Deployment) -> Option<bool> {
    let by_fleet = deployment
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(PAUSED_BY_FLEET_ANNOTATION));
    match (paused, is_paused(deployment), by_fleet) {
        (true, false, _) => Some(true),
        (false, _, true) => Some(false),
        _ => None,
    }
}

/// The change of `deployment`'s [`STEP_DRAINING_ANNOTATION`] that the
/// rollout `status` asks for at `now`: `Some(Some(until))` to set it to the
/// end of the drain under way (`drainingUntil`, truncated to the second as
/// the status stores it), `Some(None)` to remove it (no drain under way),
/// `None` when the Deployment carries what it should. A fleet with no
/// rollout never gets one, so nothing is written for it.
pub fn drain_mark(
    status: Option<&RolloutStatus>,
    deployment: &Deployment,
    now: Timestamp,
) -> Option<Option<String>> {
    let want = status
        .and_then(|s| s.draining_until.as_ref())
        .map(|t| t.0)
        .filter(|u| *u > now)
        .and_then(|u| Timestamp::from_second(u.as_second()).ok())
        .map(|u| u.to_string());
    let has = (deployment.metadata.annotations.as_ref())
        .and_then(|a| a.get(STEP_DRAINING_ANNOTATION))
        .cloned();
    (want != has).then_some(want)
}

/// The merge patch that sets the Deployment's gate (`minReadySeconds`,
/// when `gate` is given) and its drain mark (when `mark` is given,
/// [`drain_mark`]; `Some(None)` removes it); `None` when neither changes.
pub fn gate_patch(gate: Option<i32>, mark: Option<Option<String>>) -> Option<serde_json::Value> {
    let mut patch = serde_json::Map::new();
    if let Some(gate) = gate {
        patch.insert("spec".into(), serde_json::json!({"minReadySeconds": gate}));
    }
    if let Some(mark) = mark {
        let annotations = serde_json::json!({STEP_DRAINING_ANNOTATION: mark});
        patch.insert(
            "metadata".into(),
            serde_json::json!({"annotations": annotations}),
        );
    }
    (!patch.is_empty()).then_some(serde_json::Value::Object(patch))
}

/// The revision of `rs` ([`REVISION_ANNOTATION`]), `None` without a
/// readable one.
pub fn revision(rs: &ReplicaSet) -> Option<i64> {
    rs.metadata
        .annotations
        .as_ref()?
        .get(REVISION_ANNOTATION)?
        .parse()
        .ok()
}

/// The shards of a fleet from its `deployment`, its `replica_sets` and its
/// `pods` (empty when they were not listed), with the counts of a rollout
/// ([`Rollout::pace`] completes the status and says whether one is under
/// way). `status` is `None` without a readable revision.
pub fn observe(deployment: &Deployment, replica_sets: &[ReplicaSet], pods: &[Pod]) -> Rollout {
    let revisions = revisions(replica_sets);
    let Some((revision, hash)) = current_revision(&revisions) else {
        return Rollout::default();
    };
    let shards: Vec<Shard> = pods
        .iter()
        .filter_map(|p| shard(p, hash, &revisions))
        .collect();
    let updated = deployment
        .status
        .as_ref()
        .and_then(|s| s.updated_replicas)
        .unwrap_or(0);
    let old = |terminating: bool| {
        shards
            .iter()
            .filter(|s| !s.updated && s.terminating == terminating)
            .count() as i32
    };
    let status = Some(RolloutStatus {
        revision,
        updated_shards: updated,
        old_shards: old(false),
        cordoned_shards: cordoned(&shards),
        draining_shards: old(true),
        paused: is_paused(deployment),
        ..Default::default()
    });
    let old_replicas = replica_sets
        .iter()
        .filter(|rs| {
            rs.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(POD_TEMPLATE_HASH))
                != Some(hash)
        })
        .filter_map(|rs| rs.spec.as_ref()?.replicas)
        .sum();
    let cordons_seen = shards
        .iter()
        .filter(|s| s.cordoned && !s.terminating)
        .count() as i32;
    Rollout {
        status,
        shards,
        old_replicas,
        cordoned_now: false,
        cordons_seen,
    }
}

/// The shard `pod` is, given the current template's hash and each
/// ReplicaSet's hash and revision.
fn shard(pod: &Pod, current_hash: &str, revisions: &[(&String, i64)]) -> Option<Shard> {
    let hash = pod.metadata.labels.as_ref()?.get(POD_TEMPLATE_HASH)?;
    let status = pod.status.as_ref();
    let cordon = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CORDONED_ANNOTATION));
    let ready = ready_condition(pod);
    let ready_since = ready
        .and_then(|c| c.last_transition_time.as_ref())
        .map(|t| t.0);
    Some(Shard {
        name: pod.metadata.name.clone()?,
        ip: status.and_then(|s| s.pod_ip.clone()),
        updated: hash == current_hash,
        revision: revisions.iter().find(|(h, _)| *h == hash).map(|(_, r)| *r),
        cordoned: cordon.is_some(),
        held: cordon.and_then(|v| v.parse().ok()),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        ready: ready.is_some(),
        ready_since,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rs(revision: &str, hash: &str) -> ReplicaSet {
        serde_json::from_value(json!({
            "metadata": {
                "name": format!("f-{hash}"),
                "labels": {POD_TEMPLATE_HASH: hash},
                "annotations": {REVISION_ANNOTATION: revision}
            }
        }))
        .unwrap()
    }

    fn pod(name: &str, hash: &str, cordoned: bool, terminating: bool) -> Pod {
        let mut p = json!({
            "metadata": {"name": name, "labels": {POD_TEMPLATE_HASH: hash}},
            "status": {
                "podIP": format!("10.0.0.{}", name.len()),
                "conditions": [{"type": "Ready", "status": "True",
                                "lastTransitionTime": "2026-12-01T00:00:00Z"}]
            }
        });
        if cordoned {
            p["metadata"]["annotations"] = json!({CORDONED_ANNOTATION: "500"});
        }
        if terminating {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
        }
        serde_json::from_value(p).unwrap()
    }

    /// A pod Ready since `ready` seconds after [`T0`], its cordon (if any)
    /// recording `held`.
    fn shard_pod(name: &str, hash: &str, ready: i64, held: Option<&str>) -> Pod {
        let mut p = pod(name, hash, false, false);
        p.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].last_transition_time =
            Some(Time(at(ready)));
        if let Some(h) = held {
            p.metadata.annotations =
                Some([(CORDONED_ANNOTATION.to_string(), h.to_string())].into());
        }
        p
    }

    const T0: i64 = 1_796_083_200; // 2026-12-01T00:00:00Z

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(T0 + seconds).unwrap()
    }

    fn deployment(replicas: i32, updated: i32, paused: bool) -> Deployment {
        serde_json::from_value(json!({
            "spec": {"replicas": replicas, "paused": paused, "selector": {}, "template": {}},
            "status": {"updatedReplicas": updated}
        }))
        .unwrap()
    }

    /// The status after `shards` old shards were all cordoned at `t`
    /// seconds after [`T0`].
    fn cordoned_at(shards: i32, t: i64) -> RolloutStatus {
        RolloutStatus {
            old_shards: shards,
            cordoned_shards: shards,
            last_cordon_time: Some(Time(at(t))),
            ..Default::default()
        }
    }

    fn names(shards: &[Shard]) -> Vec<&str> {
        shards.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn the_newest_replica_set_is_current_by_revision_not_by_order() {
        let sets = [rs("9", "new"), rs("10", "newer"), rs("x", "bad")];
        let newer = "newer".to_string();
        assert_eq!(current_revision(&revisions(&sets)), Some((10, &newer)));
        assert_eq!(current_revision(&revisions(&[])), None);
    }

    #[test]
    fn mid_rollout_the_old_serving_shards_are_cordoned_and_counted() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            pod("a", "new", false, false),
            pod("bb", "old", false, false),
            pod("ccc", "old", true, false),
            pod("dddd", "old", true, true),
        ];
        let r = observe(&deployment(4, 1, false), &sets, &pods);
        assert_eq!(
            r.status,
            Some(RolloutStatus {
                revision: 2,
                updated_shards: 1,
                old_shards: 2,
                cordoned_shards: 1,
                draining_shards: 1,
                ..Default::default()
            })
        );
        let o = r.orders();
        // The old shard is cordoned, once; the draining one and the updated
        // one get nothing.
        assert_eq!(names(&o.cordon), ["bb"]);
        assert!(o.uncordon.is_empty());
        // Once carried out, the status counts both old shards cordoned.
        let after = r.after(&o);
        assert_eq!(after.status.unwrap().cordoned_shards, 2);
    }

    /// Issue 22: until an updated shard is Ready, the old shards are the
    /// only ones new clients can reach, so none is cordoned; the first
    /// Ready updated shard cordons them all at once.
    #[test]
    fn old_shards_are_cordoned_only_once_an_updated_shard_is_ready() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let mut starting = pod("a", "new", false, false);
        starting.status.as_mut().unwrap().conditions = None;
        let old = [
            pod("bb", "old", false, false),
            pod("ccc", "old", false, false),
        ];
        let pods: Vec<Pod> = std::iter::once(starting).chain(old.clone()).collect();
        let r = observe(&deployment(2, 1, false), &sets, &pods);
        assert!(r.status.is_some(), "the rollout is under way");
        assert_eq!(r.orders(), Orders::default());
        let pods: Vec<Pod> = std::iter::once(pod("a", "new", false, false))
            .chain(old)
            .collect();
        let r = observe(&deployment(2, 1, false), &sets, &pods);
        assert_eq!(names(&r.orders().cordon), ["bb", "ccc"]);
    }

    /// A third revision not Ready yet: the first revision's shards stay
    /// cordoned while the interrupted revision's serve, and those are
    /// cordoned once a shard of the third is Ready. Should the new shards
    /// fail with every other shard cordoned, the cordons are lifted: new
    /// clients always have a shard to land on.
    #[test]
    fn a_third_revision_keeps_the_oldest_cordoned_until_its_own_shards_are_ready() {
        let sets = [rs("1", "one"), rs("2", "two"), rs("3", "three")];
        let mut starting = pod("m1", "three", false, false);
        starting.status.as_mut().unwrap().conditions = None;
        let pods = [
            starting.clone(),
            pod("o3", "one", true, false),
            pod("o4", "one", true, false),
            pod("n1", "two", false, false),
            pod("n2", "two", false, false),
        ];
        let r = observe(&deployment(4, 0, false), &sets, &pods);
        assert_eq!(r.orders(), Orders::default());

        let mut pods = pods;
        pods[0] = pod("m1", "three", false, false);
        let o = observe(&deployment(4, 1, false), &sets, &pods).orders();
        assert_eq!(names(&o.cordon), ["n1", "n2"]);
        assert!(o.uncordon.is_empty());

        // m1 failed its readiness after every other shard was cordoned.
        pods[0] = starting;
        pods[3] = pod("n1", "two", true, false);
        pods[4] = pod("n2", "two", true, false);
        let o = observe(&deployment(4, 0, false), &sets, &pods).orders();
        assert!(o.cordon.is_empty());
        assert_eq!(names(&o.uncordon), ["o3", "o4", "n1", "n2"]);
    }

    /// A paused rollout keeps (and completes) its cordons: the Deployment
    /// starts no step, and the first drain after the resume finds every
    /// old shard out of the endpoints already.
    #[test]
    fn a_paused_rollout_keeps_its_old_shards_cordoned() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            pod("a", "new", false, false),
            pod("bb", "old", true, false),
            pod("ccc", "old", false, false),
        ];
        let r = observe(&deployment(3, 1, true), &sets, &pods);
        assert!(r.status.as_ref().unwrap().paused);
        let o = r.orders();
        assert_eq!(names(&o.cordon), ["ccc"]);
        assert!(o.uncordon.is_empty());
        let st = r.after(&o).status.unwrap();
        assert_eq!((st.old_shards, st.cordoned_shards), (2, 2));
    }

    #[test]
    fn a_finished_rollout_reports_nothing_and_uncordons_a_rolled_back_shard() {
        let sets = [rs("3", "back"), rs("2", "new")];
        // Revision 3 is the old template again: its shards were cordoned by
        // the rollout to revision 2 and must take clients now.
        let pods = [
            pod("a", "back", false, false),
            pod("bb", "back", true, false),
        ];
        let r = observe(&deployment(2, 2, false), &sets, &pods);
        assert!(!r.under_way());
        let o = r.orders();
        assert!(o.cordon.is_empty());
        assert_eq!(names(&o.uncordon), ["bb"]);
    }

    #[test]
    fn a_first_rollout_or_a_scale_out_is_no_rollout() {
        // One ReplicaSet, pods still starting: nothing to report or order.
        let sets = [rs("1", "only")];
        let pods = [pod("a", "only", false, false)];
        let r = observe(&deployment(3, 1, false), &sets, &pods);
        assert!(!r.under_way());
        assert_eq!(r.orders(), Orders::default());
        let (r, gate) = r.pace(None, &PACE, at(0), Some(0));
        assert_eq!(
            (r.status, gate),
            (None, 16),
            "outside a rollout: the cap's step"
        );
    }

    #[test]
    fn shards_without_an_ip_get_no_order() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let mut p = pod("bb", "old", false, false);
        p.status.as_mut().unwrap().pod_ip = None;
        let r = observe(&deployment(1, 0, false), &sets, &[p]);
        assert!(r.orders().cordon.is_empty());
    }

    /// 100 connections/s a shard, two shards a step, a cap's drain 16 s.
    const PACE: Pace = Pace {
        drain_rate: 100,
        surge: 2,
        cap_step_seconds: 16,
    };

    /// Issue 22: a step lasts as long as its shards take to close what they
    /// held, not a cap's drain; the first one starts as soon as the updated
    /// shards are Ready and every old one is cordoned; the next waits for
    /// the drain, and its updated shards cannot be available earlier.
    #[test]
    fn steps_are_paced_by_what_the_old_shards_held() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let old = |n: &str, held| shard_pod(n, "old", -100, held);
        // The updated shards' admission limit at a tolerance of 120 %:
        // (connections, seconds, shards sent to), and the status' figure.
        let limit = |r: &Rollout, tolerance| {
            let (r, l) = r.clone().limits(4, tolerance, 40);
            let st = r.status.and_then(|s| s.shard_connection_limit);
            (l.map(|l| (l.connections, l.seconds, l.shards.len())), st)
        };
        // Step 1: two updated shards Ready at +3 s, the four old ones
        // cordoned holding 1,000, 950, 400 and (not yet answered) ?.
        let pods = [
            shard_pod("n1", "new", 3, None),
            shard_pod("n2", "new", 3, None),
            old("o1", Some("1000")),
            old("o2", Some("950")),
            old("o3", Some("400")),
            old("o4", None),
        ];
        let r = observe(&deployment(4, 2, false), &sets, &pods);
        let (r, gate) = r.clone().pace(None, &PACE, at(4), Some(16));
        let st = r.status.clone().unwrap();
        assert_eq!(gate, 16, "an old shard is not cordoned yet: the cap's step");
        assert_eq!((st.connections_on_old_shards, st.step_seconds), (2350, 16));
        assert_eq!(st.connections_to_move, 2350, "o4 counts once it answers");
        assert_eq!(limit(&r, 120), (None, None), "not all counted yet");
        // o4 answers its cordon holding 980.
        let done = Orders {
            cordon: vec![Shard {
                held: Some(980),
                ..r.shards[5].clone()
            }],
            ..Orders::default()
        };
        let (r, gate) = r.after(&done).pace(None, &PACE, at(4), Some(16));
        // 3,330 to move over 4 shards at 110 % (the midpoint of 100 % and
        // the tolerance): 916 each; at a tolerance of 200 %, 150 %.
        assert_eq!(limit(&r, 120), (Some((916, 40, 2)), Some(916)));
        assert_eq!(limit(&r, 200).0, Some((1249, 40, 2)));
        let st1 = r.status.unwrap();
        assert_eq!(st1.connections_to_move, 3330);
        assert_eq!(
            i64::from(gate),
            1 + CORDON_SETTLE_SECONDS,
            "nothing drains: available once the cordons have left the endpoints"
        );
        assert_eq!(st1.last_cordon_time, Some(Time(at(4))));
        assert_eq!(
            (st1.connections_on_old_shards, st1.cordoned_shards),
            (3330, 4)
        );
        assert_eq!(st1.step_seconds, 11, "1,000 at 100/s, and half a second");
        assert_eq!(st1.draining_until, None);
        assert_eq!(st1.estimated_completion_time, Some(Time(at(4 + 2 * 11))));

        // The Deployment removes two old shards at +5 s; two more updated
        // shards start. Their drain runs until +16 s; the gate goes up so
        // that no updated shard becomes available before then.
        let pods = [
            shard_pod("n1", "new", 3, None),
            shard_pod("n2", "new", 3, None),
            old("o3", Some("400")),
            old("o4", Some("980")),
        ];
        let r = observe(&deployment(4, 4, false), &sets, &pods);
        let (r, gate) = r.pace(Some(&st1), &PACE, at(5), Some(1));
        // 1,950 moved onto the two updated shards up: room for 975 each.
        assert_eq!(limit(&r, 120).0, Some((975, 40, 2)));
        let st2 = r.status.unwrap();
        assert_eq!(st2.connections_to_move, 3330, "the most, kept");
        assert_eq!(st2.last_step_time, Some(Time(at(5))));
        assert_eq!(st2.draining_until, Some(Time(at(16))));
        assert_eq!((st2.draining_shards, st2.closes_per_second), (2, 200));
        assert_eq!(gate, 11, "raised to the rest of the drain");
        assert_eq!(st2.step_seconds, 11, "980 at 100/s, and half a second");
        assert_eq!(st2.estimated_completion_time, Some(Time(at(16 + 11))));

        // At +8 s the next two are Ready: available at +16 s, not earlier.
        let pods = [
            shard_pod("n1", "new", 3, None),
            shard_pod("n2", "new", 3, None),
            shard_pod("n3", "new", 8, None),
            shard_pod("n4", "new", 8, None),
            old("o3", Some("400")),
            old("o4", Some("980")),
        ];
        let r = observe(&deployment(4, 4, false), &sets, &pods);
        let (r, gate) = r.pace(Some(&st2), &PACE, at(8), Some(11));
        assert_eq!(limit(&r, 120).0, Some((916, 40, 4)), "four up: the share");
        let st3 = r.status.unwrap();
        assert_eq!(gate, 8, "Ready at +8 s, available at +16 s");
        assert_eq!(st3.draining_until, st2.draining_until);
        assert_eq!(st3.estimated_completion_time, st2.estimated_completion_time);

        // At +16 s the last two old shards go: the rollout is reported until
        // their drain ends at +27 s, then it is over and the gate is the cap.
        let pods = [
            shard_pod("n1", "new", 3, None),
            shard_pod("n2", "new", 3, None),
            shard_pod("n3", "new", 8, None),
            shard_pod("n4", "new", 8, None),
        ];
        let r = observe(&deployment(4, 4, false), &sets, &pods);
        assert!(!r.under_way());
        let (r, gate) = r.clone().pace(Some(&st3), &PACE, at(16), Some(8));
        assert_eq!(limit(&r, 120).0, Some((916, 40, 4)), "the last drain");
        let st4 = r.status.unwrap();
        assert_eq!((st4.old_shards, st4.draining_shards), (0, 2));
        assert_eq!(st4.draining_until, Some(Time(at(27))));
        assert_eq!(gate, 11);
        let r = observe(&deployment(4, 4, false), &sets, &pods);
        let (r, gate) = r.pace(Some(&st4), &PACE, at(27), Some(11));
        assert_eq!(limit(&r, 120), (None, None), "over: nothing limited");
        assert_eq!((r.status, gate), (None, 16));
    }

    /// Issue 22, item 3: a new template as a step's cordoned shards go
    /// turns the interrupted revision's shards old, so more old shards serve
    /// than before; the step is still seen, from the cordoned shards that
    /// are gone, and paced.
    #[test]
    fn a_step_is_seen_when_a_new_revision_turns_more_shards_old() {
        let sets = [rs("1", "r1"), rs("2", "r2")];
        let pods = [
            shard_pod("a1", "r2", 3, None),
            shard_pod("a2", "r2", 3, None),
            shard_pod("a3", "r2", 8, None),
            shard_pod("a4", "r2", 8, None),
            shard_pod("o1", "r1", -100, Some("1000")),
            shard_pod("o2", "r1", -100, Some("1000")),
        ];
        let r = observe(&deployment(4, 4, false), &sets, &pods);
        let (r, _) = r.pace(None, &PACE, at(9), Some(16));
        let st = r.status.unwrap();
        assert_eq!((st.old_shards, st.cordoned_shards), (2, 2));
        // Revision 3 appears; the controller removes the two cordoned r1
        // shards at once. Four r2 shards are old now, none cordoned yet.
        let sets = [rs("1", "r1"), rs("2", "r2"), rs("3", "r3")];
        let r = observe(&deployment(4, 0, false), &sets, &pods[..4]);
        let (r, _) = r.pace(Some(&st), &PACE, at(12), Some(8));
        let st3 = r.status.clone().unwrap();
        assert_eq!((st3.revision, st3.old_shards), (3, 4));
        assert_eq!(st3.draining_shards, 2, "the two r1 shards drain");
        assert_eq!(st3.draining_until, Some(Time(at(12 + 11))));
        assert_eq!(st3.closes_per_second, 200);
    }

    /// The same step seen in two parts: the controller deletes both
    /// cordoned r1 shards, and the watch shows one gone a reconcile before
    /// the other. The rest of the step is sized by the r1 shard left (not
    /// by the interrupted revision's, of unknown counts, at the cap's
    /// step), and both parts drain to the later end, together.
    #[test]
    fn a_step_seen_in_two_parts_drains_as_one() {
        let sets = [rs("1", "r1"), rs("2", "r2"), rs("3", "r3")];
        let mut pods: Vec<Pod> = (1..=4)
            .map(|i| shard_pod(&format!("i{i}"), "r2", 3, None))
            .collect();
        pods.push(shard_pod("o1", "r1", -100, Some("1000")));
        for p in &mut pods[4..] {
            p.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
        }
        let before = RolloutStatus {
            old_shards: 2,
            cordoned_shards: 2,
            step_seconds: 11,
            ..Default::default()
        };
        let pace = |pods: &[Pod], previous: &RolloutStatus, t: i64| {
            let r = observe(&deployment(4, 0, false), &sets, pods);
            r.pace(Some(previous), &PACE, at(t), Some(26))
                .0
                .status
                .unwrap()
        };
        let part = pace(&pods, &before, 12);
        assert_eq!((part.old_shards, part.cordoned_shards), (5, 1));
        assert_eq!(part.draining_shards, 1);
        assert_eq!(part.draining_until, Some(Time(at(12 + 11))));
        assert_eq!(part.step_seconds, 11, "the r1 shard left, not the cap's 16");
        let rest = pace(&pods[..4], &part, 13);
        assert_eq!(rest.draining_shards, 2, "both parts drain");
        assert_eq!(rest.closes_per_second, 200);
        assert_eq!(rest.draining_until, Some(Time(at(13 + 11))));
        assert_eq!(rest.step_seconds, 16, "the next step: r2, counts unknown");
        // A part seen late ends no earlier than the drain under way.
        let late = RolloutStatus {
            step_seconds: 3,
            ..part.clone()
        };
        let rest = pace(&pods[..4], &late, 13);
        assert_eq!(rest.draining_until, Some(Time(at(12 + 11))));
    }

    /// The Deployment carries the drain's end while a step drains, to the
    /// second the status keeps, and loses it once the drain is over; a
    /// Deployment that carries what it should is not written.
    #[test]
    fn the_drain_mark_follows_the_drain_under_way() {
        let draining = |until: Timestamp| RolloutStatus {
            draining_until: Some(Time(until)),
            ..Default::default()
        };
        let marked = |mark: Option<&str>| {
            let mut d = deployment(4, 2, false);
            if let Some(m) = mark {
                d.metadata.annotations =
                    Some([(STEP_DRAINING_ANNOTATION.to_string(), m.to_string())].into());
            }
            d
        };
        let until = at(20) + SignedDuration::from_millis(300);
        let unmarked = marked(None);
        let want = drain_mark(Some(&draining(until)), &unmarked, at(12));
        assert_eq!(want, Some(Some("2026-12-01T00:00:20Z".to_string())));
        let done = marked(Some("2026-12-01T00:00:20Z"));
        assert_eq!(drain_mark(Some(&draining(until)), &done, at(12)), None);
        assert_eq!(
            drain_mark(Some(&draining(at(20))), &done, at(20)),
            Some(None)
        );
        assert_eq!(drain_mark(None, &done, at(20)), Some(None));
        assert_eq!(drain_mark(None, &unmarked, at(20)), None, "no rollout");
        assert_eq!(
            drain_mark(Some(&RolloutStatus::default()), &unmarked, at(20)),
            None
        );
    }

    /// One merge patch for the gate and the mark, each only when it
    /// changes; a removed mark is a null.
    #[test]
    fn the_gate_patch_holds_what_changes() {
        assert_eq!(gate_patch(None, None), None);
        assert_eq!(
            gate_patch(Some(7), None),
            Some(json!({"spec": {"minReadySeconds": 7}}))
        );
        assert_eq!(
            gate_patch(None, Some(None)),
            Some(json!({"metadata": {"annotations": {STEP_DRAINING_ANNOTATION: null}}}))
        );
        assert_eq!(
            gate_patch(Some(0), Some(Some("2026-12-01T00:00:20Z".into()))),
            Some(json!({
                "spec": {"minReadySeconds": 0},
                "metadata": {"annotations": {STEP_DRAINING_ANNOTATION: "2026-12-01T00:00:20Z"}}
            }))
        );
    }

    /// `spec.rollout.paused` pauses the Deployment and resumes only a
    /// pause of its own; a `kubectl rollout pause` is left alone.
    #[test]
    fn the_fleet_resumes_only_its_own_pause() {
        let d = |paused: bool, by_fleet: bool| -> Deployment {
            let mut d = deployment(4, 0, paused);
            if by_fleet {
                d.metadata.annotations =
                    Some([(PAUSED_BY_FLEET_ANNOTATION.to_string(), "true".to_string())].into());
            }
            d
        };
        assert_eq!(pause_order(true, &d(false, false)), Some(true));
        assert_eq!(pause_order(true, &d(true, true)), None, "paused already");
        assert_eq!(
            pause_order(true, &d(true, false)),
            None,
            "kubectl's pause, kept"
        );
        assert_eq!(pause_order(false, &d(true, true)), Some(false), "resumed");
        assert_eq!(
            pause_order(false, &d(true, false)),
            None,
            "kubectl's pause, kept"
        );
        assert_eq!(pause_order(false, &d(false, false)), None);
        // Resumed by kubectl while the fleet's mark stayed: the mark goes.
        assert_eq!(pause_order(false, &d(false, true)), Some(false));
    }

    #[test]
    fn a_step_is_the_drain_and_half_a_second_rounded_up() {
        assert_eq!(step_seconds(1000, 100), 11);
        assert_eq!(step_seconds(1049, 100), 11);
        assert_eq!(step_seconds(1050, 100), 11);
        assert_eq!(step_seconds(1051, 100), 12);
        assert_eq!(step_seconds(0, 100), 0, "nothing to close");
        assert_eq!(step_seconds(1_000_000, 2000), 501);
    }

    /// An old shard where nothing listens (no server runs: it holds no
    /// clients) does not hold the gate; one that answers without a count
    /// (an older server) paces its step at the cap.
    #[test]
    fn a_vacant_shard_holds_no_clients_and_does_not_hold_the_gate() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            shard_pod("n1", "new", 0, None),
            shard_pod("o1", "old", -50, None),
            shard_pod("o2", "old", -50, Some("300")),
        ];
        let r = observe(&deployment(2, 1, false), &sets, &pods);
        let orders = r.orders();
        assert_eq!(names(&orders.cordon), ["o1"]);
        let done = Orders {
            vacant: orders.cordon.clone(),
            ..Orders::default()
        };
        let (r, gate) = r.after(&done).pace(None, &PACE, at(3), Some(16));
        let st = r.status.unwrap();
        assert_eq!(gate, 3, "every old shard settled: available now");
        assert_eq!((st.cordoned_shards, st.connections_on_old_shards), (1, 300));
        assert_eq!(st.step_seconds, 4, "300 at 100/s, and half a second");
    }

    /// Issue 22 (found by the fleet suite): pods the API refused never
    /// exist, so an older ReplicaSet wanting them holds nothing to drain and
    /// must not hold the new template back a cap's step; at rest the gate
    /// is the cap's step.
    #[test]
    fn old_replicas_without_pods_do_not_hold_the_gate() {
        let mut sets = [rs("1", "old"), rs("2", "new")];
        sets[0].spec =
            Some(serde_json::from_value(json!({"replicas": 3, "selector": {}})).unwrap());
        let pods = [shard_pod("n1", "new", 0, None)];
        let r = observe(&deployment(3, 1, false), &sets, &pods);
        assert_eq!(r.old_replicas, 3);
        let (r, gate) = r.pace(None, &PACE, at(2), Some(16));
        assert_eq!((r.status, gate), (None, 0));
        sets[0].spec =
            Some(serde_json::from_value(json!({"replicas": 0, "selector": {}})).unwrap());
        let r = observe(&deployment(3, 3, false), &sets, &pods);
        let (_, gate) = r.pace(None, &PACE, at(3), Some(0));
        assert_eq!(gate, 16);
        // An old pod not placed yet (no IP) holds nothing and needs no cordon.
        let mut pending = shard_pod("o1", "old", 0, None);
        pending.status.as_mut().unwrap().pod_ip = None;
        let r = observe(
            &deployment(2, 1, false),
            &sets,
            &[shard_pod("n1", "new", 0, None), pending],
        );
        let (r, gate) = r.pace(None, &PACE, at(2), Some(16));
        assert_eq!(gate, 0, "it holds nothing: no gate");
        assert_eq!(r.status.unwrap().step_seconds, 0);
    }

    /// Old shards that hold no client (a fleet without traffic, or shards
    /// whose server never ran) close nothing when they go: no gate holds
    /// the rollout back, before or after a step. One that holds clients
    /// brings the gate back.
    #[test]
    fn old_shards_holding_nothing_roll_without_a_gate() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            shard_pod("n1", "new", 0, None),
            shard_pod("o1", "old", -50, Some("0")),
            shard_pod("o2", "old", -50, Some("0")),
            shard_pod("o3", "old", -50, None),
        ];
        let r = observe(&deployment(3, 1, false), &sets, &pods);
        let done = Orders {
            vacant: vec![r.shards[3].clone()],
            ..Orders::default()
        };
        let (r, gate) = r.after(&done).pace(None, &PACE, at(30), Some(16));
        let st = r.status.unwrap();
        assert_eq!((gate, st.step_seconds), (0, 0));
        // o1 went: nothing drains, and the next updated shard is not Ready
        // yet; the gate stays open.
        let r = observe(
            &deployment(3, 2, false),
            &sets,
            &[pods[0].clone(), pods[2].clone()],
        );
        let (r, gate) = r.pace(Some(&st), &PACE, at(31), Some(0));
        let st2 = r.status.unwrap();
        assert_eq!(
            (gate, st2.draining_until.clone(), st2.draining_shards),
            (0, None, 0)
        );
        // An old shard that holds clients paces its step again: the gate
        // is back (the next updated shard, Ready at +33 s, is available at
        // once, since nothing drains), and its step is its drain.
        let busy = [
            pods[0].clone(),
            shard_pod("n2", "new", 33, None),
            shard_pod("o2", "old", -50, Some("500")),
        ];
        let r = observe(&deployment(3, 2, false), &sets, &busy);
        let (r, gate) = r.pace(Some(&st2), &PACE, at(34), Some(0));
        assert_eq!(gate, 1, "Ready at +33 s, available at +34 s");
        assert_eq!(
            r.status.unwrap().step_seconds,
            6,
            "500 at 100/s, and half a second"
        );
    }

    /// On a node that starts pods at once (KWOK), the next step's updated
    /// shard is Ready before the reconcile that sees the step: with nothing
    /// to drain and the cordons settled, the gate opens all the same (it
    /// stayed at the settle's 3 s, one shard a step, in `tests/tests/ha.rs`).
    #[test]
    fn a_step_that_closes_nothing_opens_the_gate_though_its_shard_was_ready_first() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let previous = cordoned_at(3, 0);
        let pods = [
            shard_pod("n1", "new", 0, None),
            shard_pod("n2", "new", 29, None),
            shard_pod("o2", "old", -50, Some("0")),
            shard_pod("o3", "old", -50, Some("0")),
        ];
        let r = observe(&deployment(3, 2, false), &sets, &pods);
        let (r, gate) = r.pace(Some(&previous), &PACE, at(30), Some(3));
        let st = r.status.unwrap();
        assert_eq!(st.last_step_time, Some(Time(at(30))), "o1 went");
        assert_eq!((gate, st.step_seconds), (0, 0));
        // The same step a second after the cordons, n2 Ready in the second
        // it is seen: the gate holds until the cordons have settled (n2
        // available at +2 s).
        let early = [
            pods[0].clone(),
            shard_pod("n2", "new", 1, None),
            pods[2].clone(),
            pods[3].clone(),
        ];
        let (_, gate) = observe(&deployment(3, 2, false), &sets, &early).pace(
            Some(&previous),
            &PACE,
            at(1),
            Some(3),
        );
        assert_eq!(gate, CORDON_SETTLE_SECONDS as i32 - 1);
    }

    /// A step's two updated shards Ready in different seconds: a gate set
    /// ahead from the first would make it available a second before the
    /// other, and the ReplicaSet controller counts at that moment (one old
    /// shard removed). The gate holds instead, and the reconcile at the
    /// cordons' settling opens it for both at once.
    #[test]
    fn a_step_whose_shards_were_ready_in_different_seconds_opens_for_all_at_once() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let previous = cordoned_at(4, 4);
        let old = |n: &str| shard_pod(n, "old", -100, Some("900"));
        let pods = [
            shard_pod("n1", "new", 3, None),
            shard_pod("n2", "new", 4, None),
            old("o1"),
            old("o2"),
            old("o3"),
            old("o4"),
        ];
        let pace = |now, current| {
            let r = observe(&deployment(4, 2, false), &sets, &pods);
            r.pace(Some(&previous), &PACE, now, current).1
        };
        let settled = 4 + CORDON_SETTLE_SECONDS;
        let held = pace(at(5), Some(16));
        assert_eq!(
            i64::from(held),
            settled - 3 + REQUEUE_MARGIN_SECONDS,
            "held past the settling: neither is available before it"
        );
        let opened = pace(at(settled) + SignedDuration::from_millis(100), Some(held));
        assert_eq!(
            i64::from(opened),
            settled - 4,
            "n2 (Ready at +4 s) and n1 are available at once"
        );
        let later = pace(at(settled + 1), Some(opened));
        assert_eq!(later, opened, "kept until the step is seen");
    }

    /// One of a step's updated shards is still starting: the gate waits
    /// for it, at most the step's drain past the first one's Ready, then
    /// lets the Ready one go alone.
    #[test]
    fn a_step_waits_for_a_starting_shard_no_longer_than_its_drain() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let previous = cordoned_at(4, 0);
        let mut starting = shard_pod("n2", "new", 0, None);
        starting
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()[0]
            .status = "False".into();
        let old = |n: &str| shard_pod(n, "old", -100, Some("500"));
        let pods = [
            shard_pod("n1", "new", 3, None),
            starting,
            old("o1"),
            old("o2"),
            old("o3"),
            old("o4"),
        ];
        let r = observe(&deployment(4, 2, false), &sets, &pods);
        assert_eq!(r.status.as_ref().unwrap().old_shards, 4);
        let pace = |now| {
            let r = observe(&deployment(4, 2, false), &sets, &pods);
            let (r, gate) = r.pace(Some(&previous), &PACE, at(now), Some(16));
            (r.status.unwrap().step_seconds, gate)
        };
        let (step, gate) = pace(CORDON_SETTLE_SECONDS + 1);
        assert_eq!(step, 6, "500 at 100/s, and half a second");
        assert_eq!(
            i64::from(gate),
            (step + REQUEUE_MARGIN_SECONDS).min(PACE.cap_step_seconds),
            "n1 is held for n2"
        );
        assert_eq!(pace(3 + step).1, step as i32, "n2 given up: n1 goes alone");
    }

    proptest::proptest! {
        /// [`step_gate`], for any Ready times, moment, drain and current
        /// gate: shards Ready in one second, none starting, are available
        /// exactly when the step may go; otherwise no shard of the step is
        /// available until [`REQUEUE_MARGIN_SECONDS`] past that moment, and
        /// from then on every Ready one is available now.
        #[test]
        fn a_step_gate_holds_every_shard_then_opens_for_all(
            first in 0i64..100,
            spread in 0i64..5,
            starting: bool,
            gate_at in 0i64..200,
            step in 0i64..60,
            now_ms in 0i64..300_000,
            current in proptest::option::of(0i32..300),
        ) {
            let (first_t, last_t, gate_t) = (at(first), at(first + spread), at(gate_at));
            let now = at(0) + SignedDuration::from_millis(now_ms);
            proptest::prop_assume!(now >= last_t);
            let may_go = if starting {
                gate_t.max(first_t + SignedDuration::from_secs(step))
            } else {
                gate_t
            };
            let gate = step_gate(first_t, last_t, starting, gate_t, step, now, current);
            let available = |ready: Timestamp| ready + SignedDuration::from_secs(gate);
            if spread == 0 && !starting {
                proptest::prop_assert_eq!(available(first_t), gate_t.max(first_t));
            } else if now < may_go {
                let margin = SignedDuration::from_secs(REQUEUE_MARGIN_SECONDS);
                proptest::prop_assert!(available(first_t) >= may_go + margin, "{gate}");
            } else {
                proptest::prop_assert!(gate >= 0 && available(last_t) <= now, "{gate}");
            }
        }
    }

    /// The clock alone ends a drain and settles cordons: the next of them
    /// still ahead is when the reconcile looks again.
    #[test]
    fn the_next_deadline_is_the_nearest_of_drain_end_and_cordon_settling() {
        let st = RolloutStatus {
            last_cordon_time: Some(Time(at(0))),
            draining_until: Some(Time(at(10))),
            ..Default::default()
        };
        let settled = at(CORDON_SETTLE_SECONDS);
        assert_eq!(next_deadline(&st, at(0)), Some(settled));
        assert_eq!(next_deadline(&st, settled), Some(at(10)));
        assert_eq!(next_deadline(&st, at(10)), None);
        assert_eq!(next_deadline(&RolloutStatus::default(), at(0)), None);
    }

    /// Issue 22, item 3: once a third revision's ReplicaSet exists, the
    /// interrupted revision's shards are old too, Ready and not yet
    /// cordoned (their counts unknown). The next step removes the two
    /// cordoned shards of the first revision (the oldest ReplicaSet's, and
    /// not Ready where their probes fail): it is sized by what those held,
    /// not at the cap's step.
    #[test]
    fn the_step_is_sized_by_the_shards_it_removes_first() {
        let sets = [rs("1", "r1"), rs("2", "r2"), rs("3", "r3")];
        let mut pods = vec![
            shard_pod("o1", "r1", -100, Some("1000")),
            shard_pod("o2", "r1", -100, Some("1040")),
        ];
        pods.extend((1..=4).map(|i| shard_pod(&format!("i{i}"), "r2", 3, None)));
        let step = |pods: &[Pod]| {
            let r = observe(&deployment(4, 0, false), &sets, pods);
            let st = r.pace(None, &PACE, at(12), Some(16)).0.status.unwrap();
            (st.old_shards as usize, st.step_seconds)
        };
        // All Ready (KWOK, whose pods run no probes): the oldest revision's.
        assert_eq!(step(&pods), (6, 11), "1,040 at 100/s + 0.5 s, rounded up");
        // Not Ready (probes failing on their cordon): the same two.
        for p in &mut pods[..2] {
            p.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status = "False".into();
        }
        assert_eq!(step(&pods), (6, 11));
        // One left: the step may take a shard of unknown count as well.
        assert_eq!(step(&pods[1..]), (5, 16), "the cap's step");
    }

    /// A shard whose cordon recorded no count (an older server, or an
    /// operator that cordoned before counts were kept) is paced as holding
    /// its cap; the gate never passes the cap's step.
    #[test]
    fn an_unknown_count_paces_a_step_at_the_cap() {
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            shard_pod("n1", "new", 0, None),
            shard_pod("o1", "old", -50, Some("unknown")),
            shard_pod("o2", "old", -50, Some("true")),
        ];
        let r = observe(&deployment(2, 1, false), &sets, &pods);
        let previous = RolloutStatus {
            old_shards: 3,
            step_seconds: 40,
            ..Default::default()
        };
        let (r, gate) = r.pace(Some(&previous), &PACE, at(2), Some(16));
        let st = r.status.unwrap();
        assert_eq!(st.step_seconds, 16);
        assert_eq!(st.connections_on_old_shards, 0);
        assert_eq!(gate, 16, "40 s of drain left, bounded by the cap's step");
    }

    /// Issue 22, item 3: a template changed as a step drains waits for the
    /// drain's end, and no step starts meanwhile; once applied, the gate is
    /// not lowered until the Deployment controller has observed it.
    #[test]
    fn a_template_changed_mid_drain_waits_for_its_end_and_holds_the_gate() {
        let previous = RolloutStatus {
            step_seconds: 6,
            last_step_time: Some(Time(at(10))),
            draining_until: Some(Time(at(16))),
            ..cordoned_at(2, 0)
        };
        assert_eq!(template_waits(Some(&previous), at(12)), Some(at(16)));
        assert_eq!(template_waits(Some(&previous), at(16)), None);
        assert_eq!(template_waits(None, at(12)), None);

        // Mid-drain: n2, Ready at +12 s, would be available as the drain
        // ends (a gate of 4 s); held, it is not, and the status says why.
        let sets = [rs("1", "old"), rs("2", "new")];
        let pods = [
            shard_pod("n1", "new", 5, None),
            shard_pod("n2", "new", 12, None),
            shard_pod("o2", "old", -50, Some("500")),
            shard_pod("o3", "old", -50, Some("500")),
        ];
        let paced = observe(&deployment(3, 2, false), &sets, &pods).pace(
            Some(&previous),
            &PACE,
            at(13),
            Some(4),
        );
        assert_eq!(paced.1, 4, "unheld: available at the drain's end");
        let (r, gate) = paced.0.hold(paced.1, Some(4), Some(at(16)), false, &PACE);
        let cap = PACE.cap_step_seconds + REQUEUE_MARGIN_SECONDS;
        assert_eq!(i64::from(gate), cap);
        assert_eq!(r.status.unwrap().template_held_until, Some(Time(at(16))));

        // The drain over, the template applied and not yet observed by the
        // controller: the held gate stays; observed, it is paced again (n2,
        // Ready at +12 s, available now, at +17 s).
        let observed = |behind| {
            let (r, gate) = observe(&deployment(3, 2, false), &sets, &pods).pace(
                Some(&previous),
                &PACE,
                at(17),
                Some(cap as i32),
            );
            r.hold(gate, Some(cap as i32), None, behind, &PACE)
        };
        let (r, gate) = observed(true);
        assert_eq!(i64::from(gate), cap);
        assert_eq!(r.status.unwrap().template_held_until, None);
        assert_eq!(observed(false).1, 5);
    }
}
