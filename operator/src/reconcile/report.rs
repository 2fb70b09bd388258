//! Report (client required): the fleet's next status and the events its
//! change announces, both derived by [`crate::status`] (pure) from what the
//! pipeline ended with, then published and written. Every reconcile ends
//! here, so a failure is reported exactly once.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use super::{Context, Ended, Error, RESYNC, truncate};
use crate::api::{ConnectionFleet, ConnectionFleetStatus};
use crate::names::FIELD_MANAGER;
use crate::plan::calibration::State as CalibrationState;
use crate::reason::Announcement;
use crate::rollout;
use crate::status::{self, Outcome, Shards};
use crate::unmanaged::Unmanaged;

/// Requeue while shards roll out: Deployment status changes arrive through
/// the owned-object watch; this only covers a rollout the watch might not
/// report.
pub const ROLLOUT_RECHECK: Duration = Duration::from_secs(15);

/// The next look after a status write mid-rollout (a step seen, cordons
/// given): the step's updated shards become Ready about a pod start later
/// (0.5-0.8 s in `tests/tests/rollout.rs`), and no watch of the operator's
/// sees that (pods are not watched; the Deployment's status may not change
/// with it), yet the rollout's gate is set from it. The fleet's own status
/// write no longer triggers a reconcile (`controller::spec_change_hash`);
/// before, that reconcile was a look of this kind, at once. The timed
/// changes (a drain's end, the cordons settling) have their own requeue
/// ([`rollout::next_deadline`]).
pub const ROLLOUT_LOOK_AGAIN: Duration = Duration::from_secs(1);

/// The next look while a calibration runs: its end is seen by no watch
/// (it ends in this process). A run takes 30 s or more
/// (docs/capacity-model.md#calibration); chosen.
pub const CALIBRATION_LOOK_AGAIN: Duration = Duration::from_secs(5);

/// Derives, publishes and writes what the pipeline `ended` with (and the
/// `calibration` it saw; `None`: left as it was). Returns the
/// requeue for a fleet that is as planned or rejected (a rejected spec waits
/// for a change, never a retry loop), and the pipeline's error for a failed
/// step, after recording it (status write best effort: the API may be what
/// is failing; the log always has it). An error writing the status of a
/// successful reconcile is [`Error::Report`].
pub async fn report(
    ctx: &Context,
    fleet: &ConnectionFleet,
    ended: Ended,
    calibration: Option<&super::Calibration>,
    now: &Time,
) -> Result<Action, Error> {
    let prev = fleet.status.as_ref();
    let generation = fleet.metadata.generation.unwrap_or(0);
    let (outcome, looped, error) = match ended {
        Ended::Rejected { reason, message } => (Outcome::Rejected { reason, message }, None, None),
        Ended::Calibrating { plan } => (Outcome::Calibrating { plan }, None, None),
        Ended::Failed {
            plan,
            looped,
            error,
        } => (
            Outcome::Failed {
                plan,
                reason: error.reason(),
                message: error.to_string(),
            },
            looped,
            Some(error),
        ),
        Ended::Applied {
            plan,
            looped,
            deployment,
            failure,
            rollout,
        } => {
            let st = deployment.status.clone().unwrap_or_default();
            let shards = Shards {
                desired: looped.replicas,
                ready: st.ready_replicas.unwrap_or(0),
                updated: st.updated_replicas.unwrap_or(0),
                total: st.replicas.unwrap_or(0),
                observed: status::deployment_observed(&deployment),
            };
            (
                Outcome::Applied {
                    plan,
                    shards,
                    failure,
                    rollout,
                },
                Some(looped),
                None,
            )
        }
    };
    let mut next = status::next_status(prev, generation, fleet.spec.connections, &outcome, now);
    if let Some(l) = &looped {
        status::apply_loop(&mut next, l, generation, now);
    }
    if let Some((latest, state)) = calibration {
        status::apply_calibration(&mut next, latest.as_ref(), state, generation, now);
    }
    let events = looped.as_ref().map_or(&[][..], |l| &l.events[..]);
    let notes = status::announcements(prev, &next, &outcome, events);
    if let Outcome::Rejected { reason, message } = &outcome
        && notes.iter().any(|n| n.reason == *reason)
    {
        warn!(fleet = %fleet.name_any(), reason = reason.as_str(), %message, "fleet rejected");
    }
    for note in &notes {
        publish(ctx, fleet, note).await;
    }
    let changed = Some(&next) != prev;
    let written = if changed {
        write_status(fleet, ctx, &next).await
    } else {
        Ok(())
    };
    if let Some(error) = error {
        if let Err(w) = written {
            warn!(fleet = %fleet.name_any(), error = %w, "cannot record the failure in status");
        }
        return Err(error);
    }
    written?;
    let wait = match &outcome {
        // A drain that ends and cordons that settle are seen by no watch:
        // look again as they do.
        Outcome::Applied {
            rollout: Some(r), ..
        } => {
            let timed = rollout::next_deadline(r, now.0).map_or(ROLLOUT_RECHECK, |at| {
                let left = at.duration_since(now.0).as_millis().max(0) as u64;
                ROLLOUT_RECHECK.min(Duration::from_millis(left + 100))
            });
            if changed {
                timed.min(ROLLOUT_LOOK_AGAIN)
            } else {
                timed
            }
        }
        Outcome::Applied { shards, .. } if !shards.rolled_out() => ROLLOUT_RECHECK,
        _ => RESYNC,
    };
    let calibrating =
        calibration.is_some_and(|(_, s)| matches!(s, CalibrationState::Running { .. }));
    let wait = if calibrating {
        wait.min(CALIBRATION_LOOK_AGAIN)
    } else {
        wait
    };
    let resync = looped.and_then(|l| l.resync);
    Ok(Action::requeue(resync.map_or(wait, |r| r.min(wait))))
}

async fn publish(ctx: &Context, fleet: &ConnectionFleet, note: &Announcement) {
    let reason = note.reason.as_str();
    if note.warning {
        warn!(fleet = %fleet.name_any(), namespace = ?fleet.namespace(), reason, note = %note.note, "event");
    } else {
        info!(fleet = %fleet.name_any(), namespace = ?fleet.namespace(), reason, note = %note.note, "event");
    }
    let ev = Event {
        type_: if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(truncate(note.note.clone())),
        action: note.action.as_str().into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &fleet.object_ref(&())).await {
        warn!(error = %e, reason, "cannot publish event");
    }
}

async fn write_status(
    fleet: &ConnectionFleet,
    ctx: &Context,
    status: &ConnectionFleetStatus,
) -> Result<(), Error> {
    let name = fleet.name_any();
    let api: Api<Unmanaged<ConnectionFleet>> =
        Api::namespaced(ctx.client.clone(), &fleet.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": "c10m.dev/v1alpha1",
        "kind": "ConnectionFleet",
        "status": status,
    });
    let written = api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| Error::Report {
            what: format!("update status of ConnectionFleet {name}"),
            source,
        })?;
    ctx.seen(&written.0);
    ctx.tokens.written(fleet, &written.0);
    Ok(())
}
