//! Kubernetes Events (`events.k8s.io/v1`) about the operator's objects,
//! with repeats folded into a series, as kube-runtime's `Recorder` and
//! client-go's event broadcaster fold them.
//!
//! An event repeated within [`SERIES_TTL`] of its last publication (the same
//! type, reason, action, reporting controller and instance, and the same
//! regarded object, `resourceVersion` included: kube-runtime's key) is not
//! created again: the first one's `series` is patched (`count` 2, 3, …,
//! `lastObservedTime`), and its note stays the first one's (the API server
//! keeps an event's note immutable).
//!
//! Why not kube-runtime's `Recorder`: it keeps every event it published in
//! the last 6 min whole, key and object, and prunes them only when it
//! publishes again, so a burst's events stay for good in a fleet that has
//! gone quiet. At 1,000 fleets that was 3.3 MB of the operator's 31 MB live
//! heap at the end of `make bench-scale`'s quiet window, for 1,000 events
//! (a dhat profile, `docs/scale.md`, "What the heap holds"). This one keeps
//! a 64-bit hash of each key with the event's name, count and time
//! (under 100 bytes an event, its name included) and prunes on every publication.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::{Api, Client};

/// How long after its last publication an event is folded into a series
/// rather than created again: 6 min, kube-runtime's `CACHE_TTL`
/// (`kube-runtime/src/events.rs`) and client-go's `finishTime`
/// (`tools/events/event_broadcaster.go`).
pub const SERIES_TTL: SignedDuration = SignedDuration::from_mins(6);

/// An event published within [`SERIES_TTL`]: what its series needs.
struct Published {
    /// The Event object's name (in the regarded object's namespace).
    name: Box<str>,
    /// Times published: 1, then the series' count.
    count: i32,
    /// When it was last published.
    last: Timestamp,
}

/// Publishes events as `reporter`, folding repeats into series.
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    /// The events published in the last [`SERIES_TTL`], by the hash of
    /// their key ([`Recorder::key`]).
    published: Mutex<HashMap<u64, Published>>,
}

impl Recorder {
    /// A recorder for `reporter` (its `controller` becomes the events'
    /// `reportingController`, its `instance`, or else the controller, their
    /// `reportingInstance`).
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Recorder {
            client,
            reporter,
            published: Mutex::default(),
        }
    }

    /// Publishes `ev` about `regarding`, in `regarding`'s namespace (or
    /// `default`): creates the Event, or patches the series of the one
    /// published with the same key within [`SERIES_TTL`].
    ///
    /// # Errors
    ///
    /// The API server's refusal of the create or patch. A refused create
    /// is not remembered (the next publication creates again); a refused
    /// series patch leaves the series as it was (the next one patches it
    /// again), as kube-runtime's `Recorder` does.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = self.key(ev, regarding);
        let earlier = {
            let mut published = self.published.lock().expect("events lock");
            published.retain(|_, p| p.last + SERIES_TTL > now);
            published
                .get(&key)
                .map(|p| (p.name.clone(), p.count.saturating_add(1)))
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let (name, count) = match earlier {
            Some((name, count)) => {
                let mut event = self.event(ev, regarding, &name, namespace, None);
                event.series = Some(EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                });
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&event))
                    .await?;
                (name, count)
            }
            None => {
                let name = format!(
                    "{}.{:x}",
                    regarding
                        .name
                        .as_deref()
                        .unwrap_or(&self.reporter.controller),
                    now.as_nanosecond()
                );
                let event = self.event(ev, regarding, &name, namespace, Some(now));
                api.create(&PostParams::default(), &event).await?;
                (name.into_boxed_str(), 1)
            }
        };
        self.published.lock().expect("events lock").insert(
            key,
            Published {
                name,
                count,
                last: now,
            },
        );
        Ok(())
    }

    /// The hash of `ev`'s key: type, action, reason, this reporter, and
    /// `regarding` and `ev.secondary` whole (kube-runtime's `EventKey`).
    fn key(&self, ev: &Event, regarding: &ObjectReference) -> u64 {
        let mut h = DefaultHasher::new();
        matches!(ev.type_, EventType::Warning).hash(&mut h);
        (&ev.action, &ev.reason).hash(&mut h);
        (&self.reporter.controller, &self.reporter.instance).hash(&mut h);
        for r in std::iter::once(regarding).chain(&ev.secondary) {
            (
                &r.api_version,
                &r.kind,
                &r.namespace,
                &r.name,
                &r.uid,
                &r.resource_version,
                &r.field_path,
            )
                .hash(&mut h);
        }
        h.finish()
    }

    /// The Event object for `ev` named `name`; `first` is its `eventTime`
    /// and note for a create, `None` for a series patch (both immutable).
    fn event(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
        name: &str,
        namespace: &str,
        first: Option<Timestamp>,
    ) -> K8sEvent {
        K8sEvent {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..ObjectMeta::default()
            },
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            type_: Some(
                match ev.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .into(),
            ),
            event_time: first.map(MicroTime),
            note: first.and(ev.note.clone()),
            regarding: Some(regarding.clone()),
            related: ev.secondary.clone(),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..K8sEvent::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::{Value, json};

    /// Publishes `events` in turn through a recorder on a mock API server
    /// that accepts every write; returns each request's method, path and
    /// body.
    async fn published(events: &[(Event, ObjectReference)]) -> Vec<(String, String, Value)> {
        let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let body = body.collect_bytes().await.expect("a request body");
                let body: Value = serde_json::from_slice(&body).expect("a JSON body");
                let status = if parts.method == http::Method::POST {
                    201
                } else {
                    200
                };
                send.send_response(
                    Response::builder()
                        .status(status)
                        .body(Body::from(serde_json::to_vec(&body).expect("JSON")))
                        .expect("a response"),
                );
                seen.push((parts.method.to_string(), parts.uri.path().to_owned(), body));
            }
            seen
        });
        let recorder = Recorder::new(
            Client::new(mock, "default"),
            Reporter {
                controller: "c10m-operator".into(),
                instance: Some("pod-a".into()),
            },
        );
        for (event, regarding) in events {
            recorder.publish(event, regarding).await.expect("published");
        }
        drop(recorder);
        server.await.expect("the mock server")
    }

    fn warning(note: &str) -> Event {
        Event {
            type_: EventType::Warning,
            reason: "ApplyFailed".into(),
            note: Some(note.into()),
            action: "Reconcile".into(),
            secondary: None,
        }
    }

    fn fleet(resource_version: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("c10m.dev/v1alpha1".into()),
            kind: Some("ConnectionFleet".into()),
            name: Some("edge".into()),
            namespace: Some("prod".into()),
            uid: Some("5f0c3a7e".into()),
            resource_version: Some(resource_version.into()),
            field_path: None,
        }
    }

    #[tokio::test]
    async fn a_repeat_patches_the_first_events_series_and_another_object_version_is_a_new_event() {
        let calls = published(&[
            (warning("apply Deployment edge: 503"), fleet("7")),
            (warning("apply Deployment edge: 500"), fleet("7")),
            (warning("apply Deployment edge: 500"), fleet("7")),
            (warning("apply Deployment edge: 503"), fleet("8")),
        ])
        .await;
        let events = "/apis/events.k8s.io/v1/namespaces/prod/events";
        let methods: Vec<(&str, &str)> = calls
            .iter()
            .map(|(m, p, _)| (m.as_str(), p.as_str()))
            .collect();
        let first = calls[0].2["metadata"]["name"].as_str().expect("a name");
        let series_path = format!("{events}/{first}");
        assert_eq!(
            methods,
            [
                ("POST", events),
                ("PATCH", series_path.as_str()),
                ("PATCH", series_path.as_str()),
                ("POST", events),
            ]
        );
        let created = &calls[0].2;
        assert_eq!(created["note"], "apply Deployment edge: 503");
        assert_eq!(created["type"], "Warning");
        assert_eq!(created["reportingController"], "c10m-operator");
        assert_eq!(created["reportingInstance"], "pod-a");
        assert_eq!(created["regarding"]["resourceVersion"], "7");
        assert!(created["eventTime"].is_string(), "{created}");
        assert!(created["series"].is_null(), "{created}");
        assert!(first.starts_with("edge."), "{first}");
        for (n, (_, _, patch)) in calls[1..3].iter().enumerate() {
            assert_eq!(patch["series"]["count"], json!(n + 2), "{patch}");
            assert!(patch["series"]["lastObservedTime"].is_string(), "{patch}");
            // The note and eventTime are immutable: left out, the first stays.
            assert!(
                patch["note"].is_null() && patch["eventTime"].is_null(),
                "{patch}"
            );
            assert_eq!(
                (&patch["reason"], &patch["type"]),
                (&json!("ApplyFailed"), &json!("Warning"))
            );
        }
        assert_eq!(calls[3].2["regarding"]["resourceVersion"], "8");
        assert!(calls[3].2["series"].is_null());
    }
}
