//! Issue 11, deliverable 3: a highly available operator. Two operator
//! processes share one leader Lease; only the holder reconciles. SIGKILL
//! the leader right after a spec change (mid-reconcile): the follower takes
//! the Lease within the lease duration and converges the fleet — one
//! Deployment, status for the new generation, no announcement twice. Kill
//! etcd and kube-apiserver right after a spec change and bring them back
//! with `tests/cluster/up.sh`: the operators converge, never panic, and
//! stay quiet while the API is gone.

use std::time::{Duration, Instant};

use c10m_e2e::*;
use serde_json::Value;

const LEASE: &str = "c10m-operator";

/// The API-server restart would disturb the failover test: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
/// The operator's default `--leader-elect-lease-duration`.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// Acquisition after expiry: the follower wakes at expiry, clears the stale
/// holder, waits up to 1 s (collision avoidance) and takes the Lease.
const SLACK: Duration = Duration::from_secs(3);

fn fleet_manifest(name: &str, connections: i64) -> String {
    edge_fleet_manifest(name, connections, 2, "")
}

/// An operator for `ns` electing its leader on Lease `LEASE` in `ns`.
fn elected(ns: &str, log_name: &str) -> Operator {
    Operator::elected(ns, LEASE, log_name)
}

fn holds(ns: &str, op: &Operator) -> bool {
    op.holds(ns, LEASE)
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
    let _serial = serial();
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

/// Two elected operators, restarted when they exit as the Deployment's
/// `restartPolicy: Always` would.
struct Replicas {
    ns: String,
    ops: Vec<Operator>,
    started: usize,
    exits: Vec<(std::process::ExitStatus, String)>,
}

impl Replicas {
    fn start(ns: &str) -> Self {
        let mut r = Replicas {
            ns: ns.into(),
            ops: Vec::new(),
            started: 0,
            exits: Vec::new(),
        };
        for _ in 0..2 {
            let op = r.spawn();
            r.ops.push(op);
        }
        r
    }

    fn spawn(&mut self) -> Operator {
        self.started += 1;
        elected(&self.ns, &format!("{}-{}", self.ns, self.started))
    }

    /// Restarts exited replicas, remembering how and why they ended.
    fn supervise(&mut self) {
        for i in 0..self.ops.len() {
            if let Some(status) = self.ops[i].exited() {
                let log = self.ops[i].log_text();
                self.exits.push((status, log));
                self.ops[i] = self.spawn();
            }
        }
    }

    fn logs(&self) -> String {
        let mut all: String = self.exits.iter().map(|(_, l)| l.as_str()).collect();
        for op in &self.ops {
            all.push_str(&op.log_text());
        }
        all
    }

    fn cpu(&self) -> Duration {
        self.ops.iter().map(|o| cpu_time(o.pid())).sum()
    }

    fn log_lines(&self) -> usize {
        self.ops.iter().map(|o| o.log_text().lines().count()).sum()
    }
}

#[test]
fn the_operator_converges_after_etcd_and_kube_apiserver_restart() {
    let _serial = serial();
    ensure_crd();
    let ns = Namespace::create("ha-api");
    let ns = ns.0.as_str();
    let mut replicas = Replicas::start(ns);
    wait_for("a leader", Duration::from_secs(30), || {
        replicas.supervise();
        replicas.ops.iter().any(|o| holds(ns, o)).then_some(())
    });
    let (ok, out) = apply(ns, &fleet_manifest("api-edge", 200_000));
    assert!(ok, "{out}");
    let before = wait_fleet_ready(ns, "api-edge", Duration::from_secs(60));

    // A spec change, then the control plane's store and API go away.
    kubectl(&[
        "patch",
        "connectionfleet",
        "api-edge",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"connections":8000000}}"#,
    ]);
    let etcd = component_pid("etcd");
    let apiserver = component_pid("kube-apiserver");
    let (cpu0, lines0) = (replicas.cpu(), replicas.log_lines());
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &apiserver.to_string(), &etcd.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill etcd and kube-apiserver");
    let down = Instant::now();
    // The API is gone for 8 s: the operators back off, they do not spin.
    std::thread::sleep(Duration::from_secs(8));
    let (cpu1, lines1) = (replicas.cpu(), replicas.log_lines());
    let outage = down.elapsed();
    let share = (cpu1.saturating_sub(cpu0)).as_secs_f64() / outage.as_secs_f64();
    eprintln!(
        "API down {outage:?}: operators used {share:.3} of a core and logged {} lines",
        lines1.saturating_sub(lines0)
    );

    let up = std::process::Command::new("bash")
        .arg(workspace().join("tests/cluster/up.sh"))
        .env("C10M_REAL_NODE", "0")
        .output()
        .expect("run tests/cluster/up.sh");
    assert!(
        up.status.success(),
        "up.sh: {}{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr)
    );
    assert_ne!(
        component_pid("kube-apiserver"),
        apiserver,
        "apiserver restarted"
    );
    eprintln!("API back after {:?}", down.elapsed());

    let after = wait_for(
        "the fleet converges after the restart",
        // The operator re-plans within seconds of the API's return; the
        // shards' readiness waits on kube-controller-manager, the scheduler
        // and kwok reconnecting too.
        Duration::from_secs(180),
        || {
            replicas.supervise();
            let f = get_json(ns, "connectionfleet", "api-edge")?;
            let ready = condition(&f, "Ready")?["status"] == "True";
            (ready
                && f["status"]["observedGeneration"] == f["metadata"]["generation"]
                && f["status"]["plan"]["shards"] != before["status"]["plan"]["shards"])
                .then_some(f)
        },
    );
    eprintln!(
        "converged {:?} after the API went down; replicas that exited: {}",
        down.elapsed(),
        replicas.exits.len()
    );
    let deps = deployments(ns);
    assert_eq!(deps.len(), 1, "{deps:?}");
    assert_eq!(
        deps[0]["spec"]["replicas"],
        after["status"]["plan"]["shards"]
    );
    let logs = replicas.logs();
    assert!(!logs.contains("panicked"), "a panic:\n{logs}");
    // A replica ends only by stepping down (exit 1 with its reason), never by a panic or a signal.
    for (status, log) in &replicas.exits {
        assert_eq!(status.code(), Some(1), "{status:?}:\n{log}");
        assert!(log.contains("lost leadership"), "{log}");
    }
    // No hot loop while the API was down: a tenth of a core at most, a
    // bounded log.
    assert!(
        share < 0.1,
        "operators used {share:.3} of a core with the API down"
    );
    assert!(
        lines1.saturating_sub(lines0) < 200,
        "{} log lines in {outage:?}",
        lines1 - lines0
    );
    // And quiet again once converged.
    let (cpu2, t2) = (replicas.cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let idle = replicas.cpu().saturating_sub(cpu2).as_secs_f64() / t2.elapsed().as_secs_f64();
    eprintln!("after convergence: {idle:.3} of a core");
    assert!(
        idle < 0.1,
        "operators busy after converging: {idle:.3} of a core"
    );
}
