//! The fleets' admin tokens as this process keeps them between reconciles
//! (no client). A fleet's token is read from its Secret `<fleet>-admin`
//! through the API (Secrets are not watched: [`super::apply::read_admin_secret`]),
//! and a reconcile needs it for every order to the shards. Read on every
//! reconcile, it was the one API read of a settled fleet's metrics-loop
//! sync (1.0 a sync, issue 23) and 3,633 of the 16,924 reads of a ramp of
//! 1,000 fleets (`docs/scale.md`, 2026-12-07). It is now read again only
//! when:
//! - this process holds no token for the fleet (a new fleet, a start, a
//!   failover, a fleet deleted and made again under its name: its uid);
//! - the fleet was changed by anyone but this process since (its
//!   `resourceVersion` is not the one the token was read or last carried
//!   at; this process's own status writes carry it, [`Tokens::written`]),
//!   which is how a person fixing the Secret has it read at once: touch
//!   the fleet (`docs/conditions.md`);
//! - [`KEPT_FOR`] has passed since it was read;
//! - a shard rejected it (an order answered 401 or 403,
//!   [`AdminToken::rejected`]): the Secret was rotated and the shards'
//!   mounted copy is already the new one.
//!
//! A Secret that turns unusable or is deleted while its fleet is settled
//! is thus seen within [`KEPT_FOR`] or at the fleet's next change, not at
//! the next reconcile; the shards keep the file the kubelet last wrote.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;

use crate::api::ConnectionFleet;
use crate::autoscale::act::AdminToken;

/// How long a token read from a fleet's Secret is used without reading the
/// Secret again: the settled fleet's resync ([`super::RESYNC`], 300 s), so
/// a change of the Secret is seen no later than a change of any object the
/// operator does not watch.
pub const KEPT_FOR: Duration = super::RESYNC;

/// One fleet's kept token: the fleet's uid, the `resourceVersion` it holds
/// for, when it was read, and the token.
#[derive(Debug)]
struct Kept {
    uid: String,
    resource_version: String,
    read: Instant,
    token: Arc<AdminToken>,
}

/// The tokens kept, one per fleet.
#[derive(Debug, Default)]
pub struct Tokens(Mutex<HashMap<ObjectRef<ConnectionFleet>, Kept>>);

impl Tokens {
    /// The token kept for `fleet` as a reconcile sees it at `now`, when it
    /// still holds (module docs): kept for this fleet's uid and at its
    /// `resourceVersion`, read less than [`KEPT_FOR`] before `now`, and
    /// not rejected by a shard. `None`: read the Secret.
    pub fn kept(&self, fleet: &ConnectionFleet, now: Instant) -> Option<Arc<AdminToken>> {
        let tokens = self.0.lock().unwrap();
        let kept = tokens.get(&ObjectRef::from_obj(fleet))?;
        let holds = Some(kept.uid.as_str()) == fleet.metadata.uid.as_deref()
            && Some(kept.resource_version.as_str()) == fleet.metadata.resource_version.as_deref()
            && now.saturating_duration_since(kept.read) < KEPT_FOR
            && !kept.token.rejected();
        holds.then(|| kept.token.clone())
    }

    /// Keeps `token`, read from `fleet`'s Secret at `now` by a reconcile of
    /// `fleet` (at its `resourceVersion`), and returns it. A fleet without
    /// a uid or a `resourceVersion` (never from the API server) keeps
    /// nothing.
    pub fn keep(&self, fleet: &ConnectionFleet, token: String, now: Instant) -> Arc<AdminToken> {
        let token = Arc::new(AdminToken::new(token));
        let meta = &fleet.metadata;
        if let (Some(uid), Some(resource_version)) = (&meta.uid, &meta.resource_version) {
            let kept = Kept {
                uid: uid.clone(),
                resource_version: resource_version.clone(),
                read: now,
                token: token.clone(),
            };
            (self.0.lock().unwrap()).insert(ObjectRef::from_obj(fleet), kept);
        }
        token
    }

    /// Carries the token kept at `before` (the version a reconcile worked
    /// on) to `written` (the version its status write returned): this
    /// process's own writes do not make it read the Secret again. A token
    /// kept at another version (the fleet changed in between) stays there,
    /// and the next reconcile reads the Secret.
    pub fn written(&self, before: &ConnectionFleet, written: &ConnectionFleet) {
        let mut tokens = self.0.lock().unwrap();
        let Some(kept) = tokens.get_mut(&ObjectRef::from_obj(before)) else {
            return;
        };
        if Some(kept.resource_version.as_str()) == before.metadata.resource_version.as_deref()
            && let Some(rv) = &written.metadata.resource_version
        {
            kept.resource_version = rv.clone();
        }
    }

    /// Forgets the token of fleet `key` (the fleet is gone).
    pub fn forget(&self, key: &ObjectRef<ConnectionFleet>) {
        self.0.lock().unwrap().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(uid: &str, rv: &str) -> ConnectionFleet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "c10m.dev/v1alpha1",
            "kind": "ConnectionFleet",
            "metadata": {"name": "edge", "namespace": "prod", "uid": uid, "resourceVersion": rv},
            "spec": {"connections": 1000, "backend": {"model": "epoll"}}
        }))
        .unwrap()
    }

    #[test]
    fn a_kept_token_holds_until_the_fleet_changes_or_it_is_old_or_rejected() {
        let tokens = Tokens::default();
        let t0 = Instant::now();
        let at_1 = fleet("u1", "1");
        assert!(tokens.kept(&at_1, t0).is_none(), "nothing kept yet");
        tokens.keep(&at_1, "s3cret".into(), t0);
        let kept = tokens.kept(&at_1, t0 + Duration::from_secs(20)).unwrap();
        assert_eq!(kept.as_str(), "s3cret");

        // This process's status write carries it.
        let at_2 = fleet("u1", "2");
        tokens.written(&at_1, &at_2);
        assert!(tokens.kept(&at_2, t0).is_some());
        assert!(tokens.kept(&at_1, t0).is_none(), "a stale copy reads");

        // Anyone else's change does not: a write on top of a version the
        // token was not kept at leaves it there.
        let at_3 = fleet("u1", "3");
        assert!(tokens.kept(&at_3, t0).is_none());
        tokens.written(&at_3, &fleet("u1", "4"));
        assert!(tokens.kept(&fleet("u1", "4"), t0).is_none());
        assert!(tokens.kept(&at_2, t0).is_some());

        // A fleet made again under the name has another uid.
        assert!(tokens.kept(&fleet("u2", "2"), t0).is_none());

        // Old.
        assert!(
            tokens
                .kept(&at_2, t0 + KEPT_FOR - Duration::from_millis(1))
                .is_some()
        );
        assert!(tokens.kept(&at_2, t0 + KEPT_FOR).is_none());

        // Rejected by a shard, through the token the reconcile used.
        assert!(!kept.rejected());
        kept.reject();
        assert!(tokens.kept(&at_2, t0).is_none());

        // Kept again once read; forgotten with the fleet.
        tokens.keep(&at_2, "n3w".into(), t0);
        assert_eq!(tokens.kept(&at_2, t0).unwrap().as_str(), "n3w");
        tokens.forget(&ObjectRef::from_obj(&at_2));
        assert!(tokens.kept(&at_2, t0).is_none());
    }
}
