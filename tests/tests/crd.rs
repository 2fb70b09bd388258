//! Issue 21, item 12: an older operator never downgrades the CRD. A newer
//! operator has installed the ConnectionFleet CRD with a higher
//! `c10m.dev/schema-revision` and a field this build does not know; an
//! operator of this build starts (`--manage-crd`, the default) and keeps
//! that CRD — revision, field, and the field's value in a fleet — says so
//! in a Warning event on the CRD and a log line naming both revisions, and
//! reconciles the fleet under the newer schema.
//!
//! The CRD is cluster-wide: this binary holds this one test, so no other
//! test of it starts an operator (which would judge the CRD too) while the
//! CRD carries the newer revision, and a guard puts the checked-in CRD back
//! when the test ends, passed or not.

use std::collections::BTreeSet;
use std::time::Duration;

use c10m_e2e::*;
use serde_json::Value;

const CRD: &str = "connectionfleets.c10m.dev";
const REVISION_ANNOTATION: &str = "c10m.dev/schema-revision";
/// The field the "newer" schema adds under `spec`.
const NEWER_FIELD: &str = "fromANewerRevision";

/// The checked-in CRD (`crds/connectionfleet.yaml`), as JSON.
fn checked_in_crd() -> Value {
    let path = workspace().join("crds/connectionfleet.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

/// Server-side applies `crd` as the operator does (field manager
/// `c10m-operator`, conflicts forced) and waits until it is Established;
/// `Err` with kubectl's stderr when either fails. The fields the manager
/// owned and `crd` leaves out are removed.
fn apply_as_operator(crd: &Value) -> Result<(), String> {
    let out = kubectl_with(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=c10m-operator",
            "-f",
            "-",
        ],
        Some(&crd.to_string()),
    );
    let wait = || {
        kubectl_with(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                &format!("crd/{CRD}"),
            ],
            None,
        )
    };
    for out in [out, wait()] {
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
    }
    Ok(())
}

/// Puts the checked-in CRD back when dropped (the test passed or panicked):
/// applied as the operator would, which drops the newer field and sets the
/// revision back.
struct RestoreCrd;

impl Drop for RestoreCrd {
    fn drop(&mut self) {
        if let Err(e) = apply_as_operator(&checked_in_crd()) {
            eprintln!("could not put the checked-in CRD back: {e}");
        }
    }
}

/// Names of the events in namespace `default` regarding the CRD.
fn crd_event_names() -> BTreeSet<String> {
    crd_events()
        .iter()
        .filter_map(|e| e["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// Events in namespace `default` (where Kubernetes files events of
/// cluster-scoped objects) regarding the CRD.
fn crd_events() -> Vec<Value> {
    let out = kubectl(&["get", "events.events.k8s.io", "-n", "default", "-o", "json"]);
    serde_json::from_str::<Value>(&out).unwrap()["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["regarding"]["kind"] == "CustomResourceDefinition" && e["regarding"]["name"] == CRD
        })
        .cloned()
        .collect()
}

#[test]
fn an_operator_keeps_a_crd_of_a_newer_schema_revision() {
    ensure_crd();
    let ours: u32 = checked_in_crd()["metadata"]["annotations"][REVISION_ANNOTATION]
        .as_str()
        .expect("the checked-in CRD carries its schema revision")
        .parse()
        .unwrap();
    let newer = ours + 1;

    // What a newer operator installs: a higher revision, and one more
    // field under spec, applied with the operator's field manager (so an
    // apply of the older CRD by that manager would remove both).
    let _restore = RestoreCrd;
    let mut crd = checked_in_crd();
    crd["metadata"]["annotations"][REVISION_ANNOTATION] = Value::from(newer.to_string());
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        [NEWER_FIELD] = serde_json::json!({
        "type": "string",
        "description": "A field of a newer schema revision (test only)."
    });
    apply_as_operator(&crd).unwrap();

    let ns = Namespace::create("crd");
    let ns = ns.0.as_str();
    let (ok, out) = apply(
        ns,
        &edge_fleet_manifest("newer", 100_000, 1, &format!("  {NEWER_FIELD}: kept\n")),
    );
    assert!(ok, "{out}");
    let events_before = crd_event_names();

    let mut op = Operator::start(ns);
    // The fleet reconciles under the newer schema.
    let fleet = wait_fleet_ready(ns, "newer", Duration::from_secs(60));
    assert!(op.exited().is_none(), "{}", op.log_text());

    // The CRD was not applied over: revision and field stand, and so does
    // the fleet's value of the field.
    let installed: Value =
        serde_json::from_str(&kubectl(&["get", "crd", CRD, "-o", "json"])).unwrap();
    assert_eq!(
        installed["metadata"]["annotations"][REVISION_ANNOTATION],
        newer.to_string(),
        "the revision was lowered"
    );
    assert!(
        installed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"][NEWER_FIELD]
            .is_object(),
        "the newer field was pruned from the schema"
    );
    assert_eq!(fleet["spec"][NEWER_FIELD], "kept", "{fleet}");
    let fleet = get_json(ns, "connectionfleet", "newer").unwrap();
    assert_eq!(fleet["spec"][NEWER_FIELD], "kept", "{fleet}");

    // The log line names both revisions.
    let line = format!(
        "carries schema revision {newer}, newer than this operator's {ours}: not applying the older CRD"
    );
    let log = op.log_text();
    assert!(log.contains(&line), "no {line:?} in:\n{log}");
    assert!(
        !log.contains("CRD applied and established"),
        "the operator applied its CRD:\n{log}"
    );

    // One Warning on the CRD, naming both revisions.
    let event = wait_for(
        "the NewerCRDInstalled event",
        Duration::from_secs(10),
        || {
            crd_events().into_iter().find(|e| {
                !events_before.contains(e["metadata"]["name"].as_str().unwrap_or_default())
                    && e["reason"] == "NewerCRDInstalled"
            })
        },
    );
    let note = event["note"].as_str().unwrap_or_default();
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["reportingController"], "c10m-operator", "{event}");
    assert!(
        note.contains(&format!("{REVISION_ANNOTATION} is {newer}"))
            && note.contains(&format!("revision {ours}")),
        "{note}"
    );
    eprintln!("log: {line}\nevent: {note}");
}
