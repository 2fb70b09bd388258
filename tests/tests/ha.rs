//! Issue 11, deliverable 3: a highly available operator. Two operator
//! processes share one leader Lease; only the holder reconciles. SIGKILL
//! the leader right after a spec change (mid-reconcile): the follower takes
//! the Lease within the lease duration and converges the fleet — one
//! Deployment, status for the new generation, no announcement twice.

use std::time::{Duration, Instant};

use c10m_e2e::*;
use serde_json::Value;

const LEASE: &str = "c10m-operator";
/// The operator's default `--leader-elect-lease-duration`.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// Acquisition after expiry: the follower wakes at expiry, clears the stale
/// holder, waits up to 1 s (collision avoidance) and takes the Lease.
const SLACK: Duration = Duration::from_secs(3);

fn fleet_manifest(name: &str, connections: i64) -> String {
    format!(
        r#"
apiVersion: c10m.dev/v1alpha1
kind: ConnectionFleet
metadata:
  name: {name}
spec:
  connections: {connections}
  node:
    pricePerHour: "2.59"
  shard:
    cpus: 2
    minShards: 2
  placement:
    nodeSelector:
      c10m.dev/pool: edge
"#
    )
}

/// An operator for `ns` electing its leader on Lease `LEASE` in `ns`.
fn elected(ns: &str, log_name: &str) -> Operator {
    Operator::spawn(
        &[
            "run",
            "--namespace",
            ns,
            "--metrics-addr",
            "127.0.0.1:0",
            "--leader-elect=true",
            "--leader-elect-lease",
            LEASE,
            "--leader-elect-namespace",
            ns,
        ],
        &kubeconfig(),
        log_name,
    )
}

/// The Lease's holder identity (`<host>_<pid>_<random>`), if any.
fn holder(ns: &str) -> Option<String> {
    let lease = get_json(ns, "lease", LEASE)?;
    lease["spec"]["holderIdentity"].as_str().map(str::to_string)
}

fn holds(ns: &str, op: &Operator) -> bool {
    holder(ns).is_some_and(|h| h.contains(&format!("_{}_", op.pid())))
}

fn deployments(ns: &str) -> Vec<Value> {
    let out = kubectl(&["get", "deployments", "-n", ns, "-o", "json"]);
    serde_json::from_str::<Value>(&out).unwrap()["items"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn killing_the_leader_mid_reconcile_fails_over_within_the_lease() {
    ensure_crd();
    let ns = Namespace::create("ha");
    let ns = ns.0.as_str();

    // The first operator takes the Lease; the second waits and does nothing.
    let mut a = elected(ns, &format!("{ns}-a"));
    wait_for("operator a leads", Duration::from_secs(30), || {
        (holds(ns, &a) && a.log_text().contains("became leader")).then_some(())
    });
    let mut b = elected(ns, &format!("{ns}-b"));
    wait_for("operator b waits", Duration::from_secs(30), || {
        b.log_text()
            .contains("waiting for the leader Lease")
            .then_some(())
    });

    let (ok, out) = apply(ns, &fleet_manifest("ha-edge", 200_000));
    assert!(ok, "{out}");
    let before = wait_fleet_ready(ns, "ha-edge", Duration::from_secs(60));
    let shards_before = before["status"]["plan"]["shards"].clone();
    let log_b = b.log_text();
    assert!(
        !log_b.contains("became leader") && !log_b.contains("controller starting"),
        "the follower acted:\n{log_b}"
    );
    assert!(b.exited().is_none(), "the follower exited:\n{log_b}");

    // A spec change, and the leader dies while reconciling it.
    kubectl(&[
        "patch",
        "connectionfleet",
        "ha-edge",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"connections":8000000}}"#,
    ]);
    a.kill();
    let killed = Instant::now();
    let at_kill = deployments(ns)
        .first()
        .map(|d| d["spec"]["replicas"].clone());
    eprintln!("Deployment replicas when the leader died: {at_kill:?} (2 before the change)");

    wait_for(
        "operator b leads",
        LEASE_DURATION + SLACK + Duration::from_secs(5),
        || (holds(ns, &b) && b.log_text().contains("became leader")).then_some(()),
    );
    let failover = killed.elapsed();
    eprintln!("failover: leader killed → follower leads in {failover:?}");
    assert!(
        failover <= LEASE_DURATION + SLACK,
        "failover took {failover:?} (lease {LEASE_DURATION:?})"
    );

    // The new leader converges on the new generation.
    let after = wait_fleet_ready(ns, "ha-edge", Duration::from_secs(60));
    eprintln!(
        "converged {:?} after the kill: shards {} → {}",
        killed.elapsed(),
        shards_before,
        after["status"]["plan"]["shards"]
    );
    assert_eq!(after["spec"]["connections"], 8_000_000);
    assert_ne!(after["status"]["plan"]["shards"], shards_before);
    assert_eq!(
        after["status"]["observedGeneration"],
        after["metadata"]["generation"]
    );
    // Exactly one Deployment, scaled to the new plan.
    let deps = deployments(ns);
    assert_eq!(deps.len(), 1, "{deps:?}");
    assert_eq!(
        deps[0]["spec"]["replicas"], after["status"]["plan"]["shards"],
        "{:?}",
        deps[0]["spec"]
    );
    // No announcement twice (each plan's PlanChanged once).
    let events = events_for(ns, "ha-edge");
    let mut notes: Vec<&(String, String, String)> = events.iter().collect();
    notes.sort();
    let before_dedup = notes.len();
    notes.dedup();
    assert_eq!(before_dedup, notes.len(), "an event twice: {events:?}");
    assert!(
        events.iter().any(|(_, r, _)| r == "PlanChanged"),
        "{events:?}"
    );
    assert!(
        b.exited().is_none(),
        "the new leader exited:\n{}",
        b.log_text()
    );
}
