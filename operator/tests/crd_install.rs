//! The CRD install at start-up (`--manage-crd`, [`apply_crd`]) against a
//! mock API server ([`apiserver`]): what it reads, applies and publishes
//! for each installed schema revision, and when the CRD changes between
//! its read and its apply.

// The mock's helpers that only the reconcile scenarios use.
#[allow(dead_code)]
mod apiserver;

use std::sync::{Arc, Mutex};

use apiserver::{ApiServer, Call, Reply};
use c10m_operator::api::CRD_SCHEMA_REVISION;
use c10m_operator::controller::apply_crd;
use c10m_operator::names::SCHEMA_REVISION_ANNOTATION;
use http::Method;
use serde_json::{Value, json};

const CRD: &str =
    "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/connectionfleets.c10m.dev";
/// Where events of a cluster-scoped object go.
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

/// The mock cluster: the installed CRD, if any, and what the next apply
/// meets.
#[derive(Default)]
struct Cluster {
    /// The installed CRD (`None`: 404).
    crd: Option<Value>,
    /// Before answering the next apply, another writer sets the installed
    /// CRD's revision to this (and bumps its resourceVersion).
    changed_before_apply: Option<String>,
}

/// An installed CRD whose revision annotation is `revision` (`None`:
/// none), at `resourceVersion` `rv`, Established.
fn installed(revision: Option<&str>, rv: u64) -> Value {
    let mut crd = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": "connectionfleets.c10m.dev",
            "uid": "3c1d5e7f-0000-4000-8000-0000000000cd",
            "resourceVersion": rv.to_string(),
        },
        "spec": {
            "group": "c10m.dev",
            "names": {"kind": "ConnectionFleet", "plural": "connectionfleets"},
            "scope": "Namespaced",
            "versions": [],
        },
        "status": established(),
    });
    if let Some(r) = revision {
        crd["metadata"]["annotations"] = json!({ SCHEMA_REVISION_ANNOTATION: r });
    }
    crd
}

fn established() -> Value {
    json!({"conditions": [{"type": "Established", "status": "True"}]})
}

impl Cluster {
    fn answer(&mut self, call: &Call) -> Reply {
        match (&call.method, call.path()) {
            (&Method::GET, CRD) => match &self.crd {
                Some(crd) => Reply::ok(crd),
                None => Reply::not_found(call),
            },
            (&Method::PATCH, CRD) => {
                let body = call.body.clone().unwrap_or(Value::Null);
                if let Some(revision) = self.changed_before_apply.take() {
                    let rv = self.rv() + 1;
                    self.crd = Some(installed(Some(&revision), rv));
                }
                // The resourceVersion in an apply is a precondition.
                let wanted = body["metadata"]["resourceVersion"].as_str();
                if let Some(wanted) = wanted
                    && self.crd.is_some()
                    && wanted != self.rv().to_string()
                {
                    return Reply::failure(
                        409,
                        "Conflict",
                        "Operation cannot be fulfilled on customresourcedefinitions.apiextensions.k8s.io \"connectionfleets.c10m.dev\": the object has been modified; please apply your changes to the latest version and try again",
                    );
                }
                let mut crd = body;
                crd["metadata"]["resourceVersion"] = json!((self.rv() + 1).to_string());
                crd["status"] = established();
                self.crd = Some(crd.clone());
                Reply::ok(crd)
            }
            (&Method::POST, EVENTS) => Reply::created(call.body.clone().unwrap_or(Value::Null)),
            _ => Reply::failure(
                405,
                "MethodNotAllowed",
                format!("{} {}", call.method, call.uri),
            ),
        }
    }

    /// The installed CRD's resourceVersion (0 without one).
    fn rv(&self) -> u64 {
        self.crd
            .as_ref()
            .and_then(|c| c["metadata"]["resourceVersion"].as_str()?.parse().ok())
            .unwrap_or(0)
    }
}

/// Runs [`apply_crd`] (instance `op-0`) against `cluster`; returns its
/// result, the calls it made and the CRD installed afterwards.
async fn install(cluster: Cluster) -> (anyhow::Result<()>, Vec<Call>, Option<Value>) {
    let cluster = Arc::new(Mutex::new(cluster));
    let routed = cluster.clone();
    let (client, api) = ApiServer::start(move |call| routed.lock().unwrap().answer(call));
    let result = apply_crd(&client, Some("op-0".into())).await;
    let crd = cluster.lock().unwrap().crd.clone();
    (result, api.calls(), crd)
}

fn applies(calls: &[Call]) -> Vec<&Call> {
    calls.iter().filter(|c| c.is(Method::PATCH, CRD)).collect()
}

fn events(calls: &[Call]) -> Vec<Value> {
    calls
        .iter()
        .filter(|c| c.is(Method::POST, EVENTS))
        .map(|c| c.body.clone().unwrap())
        .collect()
}

fn revision_of(crd: &Value) -> &Value {
    &crd["metadata"]["annotations"][SCHEMA_REVISION_ANNOTATION]
}

#[tokio::test]
async fn a_missing_crd_is_applied_without_a_precondition() {
    let (result, calls, crd) = install(Cluster::default()).await;
    result.unwrap();
    let applied = applies(&calls);
    assert_eq!(applied.len(), 1, "{calls:#?}");
    let query = applied[0].query();
    assert!(
        query.contains("fieldManager=c10m-operator") && query.contains("force=true"),
        "{query}"
    );
    let body = applied[0].body.as_ref().unwrap();
    assert!(body["metadata"]["resourceVersion"].is_null(), "{body}");
    assert_eq!(
        revision_of(&crd.unwrap()),
        &json!(CRD_SCHEMA_REVISION.to_string())
    );
    assert_eq!(events(&calls), Vec::<Value>::new());
}

#[tokio::test]
async fn an_older_or_equal_or_unrevised_crd_is_applied_over() {
    let older = CRD_SCHEMA_REVISION - 1;
    for revision in [
        None,
        Some(older.to_string()),
        Some(CRD_SCHEMA_REVISION.to_string()),
    ] {
        let cluster = Cluster {
            crd: Some(installed(revision.as_deref(), 41)),
            ..Cluster::default()
        };
        let (result, calls, crd) = install(cluster).await;
        result.unwrap();
        let applied = applies(&calls);
        assert_eq!(applied.len(), 1, "{revision:?}: {calls:#?}");
        assert_eq!(
            applied[0].body.as_ref().unwrap()["metadata"]["resourceVersion"],
            "41",
            "{revision:?}: the installed resourceVersion is the apply's precondition"
        );
        assert_eq!(
            revision_of(&crd.unwrap()),
            &json!(CRD_SCHEMA_REVISION.to_string())
        );
        assert_eq!(events(&calls), Vec::<Value>::new(), "{revision:?}");
    }
}

#[tokio::test]
async fn a_crd_of_a_newer_revision_is_kept_with_a_warning_event() {
    let newer = (CRD_SCHEMA_REVISION + 1).to_string();
    let cluster = Cluster {
        crd: Some(installed(Some(&newer), 41)),
        ..Cluster::default()
    };
    let (result, calls, crd) = install(cluster).await;
    result.expect("the operator goes on with the installed CRD");
    assert_eq!(applies(&calls).len(), 0, "{calls:#?}");
    assert_eq!(revision_of(&crd.unwrap()), &json!(newer));
    let evs = events(&calls);
    assert_eq!(evs.len(), 1, "{calls:#?}");
    let e = &evs[0];
    assert_eq!(e["type"], "Warning", "{e}");
    assert_eq!(e["reason"], "NewerCRDInstalled", "{e}");
    assert_eq!(e["action"], "ApplyCRD", "{e}");
    assert_eq!(e["reportingController"], "c10m-operator", "{e}");
    assert_eq!(e["reportingInstance"], "op-0", "{e}");
    assert_eq!(
        (
            &e["regarding"]["kind"],
            &e["regarding"]["name"],
            &e["regarding"]["namespace"]
        ),
        (
            &json!("CustomResourceDefinition"),
            &json!("connectionfleets.c10m.dev"),
            &Value::Null
        ),
        "{e}"
    );
    let note = e["note"].as_str().unwrap();
    assert!(
        note.contains(&format!("{SCHEMA_REVISION_ANNOTATION} is {newer}"))
            && note.contains(&format!("revision {CRD_SCHEMA_REVISION}")),
        "{note}"
    );
}

#[tokio::test]
async fn an_unreadable_revision_is_kept_with_a_warning_event() {
    let cluster = Cluster {
        crd: Some(installed(Some("v2"), 41)),
        ..Cluster::default()
    };
    let (result, calls, crd) = install(cluster).await;
    result.unwrap();
    assert_eq!(applies(&calls).len(), 0, "{calls:#?}");
    assert_eq!(revision_of(&crd.unwrap()), &json!("v2"));
    let evs = events(&calls);
    assert_eq!(evs.len(), 1, "{calls:#?}");
    assert_eq!(evs[0]["type"], "Warning");
    assert_eq!(evs[0]["reason"], "CRDRevisionUnreadable");
    assert!(
        evs[0]["note"].as_str().unwrap().contains("\"v2\""),
        "{}",
        evs[0]
    );
}

#[tokio::test]
async fn a_crd_made_newer_between_the_read_and_the_apply_is_read_again_and_kept() {
    let older = CRD_SCHEMA_REVISION - 1;
    let newer = (CRD_SCHEMA_REVISION + 1).to_string();
    let cluster = Cluster {
        crd: Some(installed(Some(&older.to_string()), 41)),
        // A newer operator applies between this one's read and apply.
        changed_before_apply: Some(newer.clone()),
    };
    let (result, calls, crd) = install(cluster).await;
    result.unwrap();
    let applied = applies(&calls);
    assert_eq!(
        applied.len(),
        1,
        "one apply, refused by its precondition: {calls:#?}"
    );
    assert_eq!(
        revision_of(&crd.unwrap()),
        &json!(newer),
        "the newer CRD stands"
    );
    let evs = events(&calls);
    assert_eq!(evs.len(), 1, "{calls:#?}");
    assert_eq!(evs[0]["reason"], "NewerCRDInstalled");
}
