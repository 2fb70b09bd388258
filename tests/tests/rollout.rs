//! A rollout within the fleet's reconnect budget, end to end (issue 22;
//! ADR 0011): a fleet holding real `c10m-loadgen` WebSocket clients
//! (reconnect on close) on real `c10m-server` processes (pod runner) is
//! rolled by a user's `kubectl rollout restart`.
//!
//! The clients reach the shards through an L4 balancer of the test's own: a
//! targets file of the fleet's pods that are Ready and answer their
//! `/healthz` with 200, refreshed every 250 ms. That is what a readiness
//! probe and the Service's endpoints do on a real node; KWOK pods have no
//! prober, so the test probes. A cordoned shard (503) thus leaves the list
//! as it would leave the endpoints.
//!
//! The test rolls 4 shards of 1,000 clients each at a 200/s budget
//! (`drain.rate` 100: two shards a step, 20 s of closes in all), paused for
//! 10 s before its first step through the fleet's `spec.rollout.paused`.
//! `make bench-rollout` runs the same roll with 8 shards and 16,000
//! clients (`bench_rollout`, ignored in `make test`) and
//! writes `target/bench/rollout.json`. The same 4-shard roll runs again
//! with two elected operators, the leader SIGKILLed as the first step
//! drains (issue 22, item 4). Figures are printed as `FIGURE name=value`
//! lines.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use c10m_e2e::*;
use serde_json::{Value, json};

const FLEET: &str = "roll";

/// The operators' leader Lease when [`Roll::failover`] runs two.
const LEASE: &str = "c10m-operator";

/// Seconds a failover may add to a roll: the operator's default
/// `--leader-elect-lease-duration` (15 s) plus 3 s to take the Lease (see
/// `ha.rs`). The Deployment goes on stepping at the last gate meanwhile.
const FAILOVER_SECONDS: f64 = 18.0;

/// Held by each [`roll`]: rolls measure durations and close rates from
/// the client side, so they run one at a time. Two at once (the test
/// threads of this binary) share the machine's cores between 8,000
/// clients, two operators' reconciles and the pod runner's servers, and a
/// CI run saw a roll take 4.4 s longer than the same roll alone (28.4 s
/// against 24.0 s, `duration_over_ideal` 1.42 against 1.20).
static ONE_ROLL_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The Deployment annotation that marks a rollout step draining
/// (`c10m_operator::names::STEP_DRAINING_ANNOTATION`).
const STEP_DRAINING: &str = "c10m.dev/step-draining-until";

/// The admin port of the bundled server (spec.server.metricsPort default).
const ADMIN_PORT: u16 = 9090;

/// The rebalancer's tolerance the rolled fleets keep (their
/// `spec.rebalance.maxToMeanPercent`, left at its default): the hottest
/// shard at the end may hold at most this percent of the mean.
const MAX_TO_MEAN_PERCENT: u64 = 120;

/// A roll: its fleet, its clients and its budget.
struct Roll {
    /// Shards the plan must give.
    shards: u64,
    /// Clients held through the rollout (spec.connections too).
    clients: u64,
    /// Fleet-wide reconnect budget, connections/s
    /// (spec.rollout.maxReconnectRate).
    budget: u64,
    /// One departing shard's close rate, connections/s (spec.drain.rate).
    drain_rate: u64,
    /// spec.backend.connectionsPerCpu (1-CPU shards): sized so that the
    /// plan gives `shards` shards for `clients`.
    per_cpu: u64,
    /// Held paused (the fleet's `spec.rollout.paused`) this long before its
    /// first step, if at all.
    pause: Option<Duration>,
    /// Two operators elect a leader (the chart's default), and the leader
    /// is SIGKILLed as the first step's shards start to drain.
    failover: bool,
    /// A new server image in the fleet's spec (a third revision) as the
    /// first step's shards start to drain: the shards of the interrupted
    /// revision turn old as well.
    third_revision: bool,
    /// A `kubectl rollout restart` of the Deployment while the first
    /// step's shards drain, which the chart's admission policy refuses
    /// (the operator marks the drain on the Deployment).
    restart_mid_drain: bool,
}

impl Roll {
    /// Issue 22's roll: 4 shards holding 4,000 clients, a 200/s budget at
    /// a 100/s drain rate (two shards a step), no pause, one operator.
    fn four_shards() -> Roll {
        Roll {
            shards: 4,
            clients: 4000,
            budget: 200,
            drain_rate: 100,
            per_cpu: 1500,
            pause: None,
            failover: false,
            third_revision: false,
            restart_mid_drain: false,
        }
    }

    /// Old shards removed per step: the budget over the drain rate.
    fn surge(&self) -> u64 {
        self.budget / self.drain_rate
    }

    fn manifest(&self) -> String {
        format!(
            r#"apiVersion: c10m.dev/v1alpha1
kind: ConnectionFleet
metadata:
  name: {FLEET}
spec:
  connections: {clients}
  backend:
    connectionsPerCpu: {per_cpu}
    protocol: websocket
  shard:
    cpus: 1
    maxShards: 16
  drain:
    rate: {drain_rate}
  rollout:
    maxReconnectRate: {budget}
  availability:
    failureDomain: None
"#,
            clients = self.clients,
            per_cpu = self.per_cpu,
            drain_rate = self.drain_rate,
            budget = self.budget,
        )
    }
}

/// The fleet's pods with an IP, not being deleted.
fn pods(ns: &str) -> Vec<ShardPod> {
    shard_pods(ns, FLEET)
        .into_iter()
        .filter(|p| !p.terminating)
        .collect()
}

/// The status code of `GET http://ip:9090<path>` (0: no answer), and its body.
fn admin_get(ip: &str, path: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .http_status_as_error(false)
        .build()
        .into();
    match agent.get(&format!("http://{ip}:{ADMIN_PORT}{path}")).call() {
        Ok(mut r) => (
            r.status().as_u16(),
            r.body_mut().read_to_string().unwrap_or_default(),
        ),
        Err(_) => (0, String::new()),
    }
}

fn healthz(ip: &str) -> u16 {
    admin_get(ip, "/healthz").0
}

/// Sum of the samples of `family` on the shard at `ip`, `None` when it
/// does not answer.
fn metric_sum(ip: &str, family: &str) -> Option<i64> {
    let (code, body) = admin_get(ip, "/metrics");
    (code == 200).then(|| {
        body.lines()
            .filter(|l| {
                l.starts_with(&format!("{family}{{")) || l.starts_with(&format!("{family} "))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as i64
    })
}

/// Live connections of the shard at `ip` (`c10m_connections`, summed over
/// workers), `None` when it does not answer.
fn connections(ip: &str) -> Option<i64> {
    metric_sum(ip, "c10m_connections")
}

/// The pod-template hash of the Deployment's newest ReplicaSet.
fn newest_hash(ns: &str) -> Option<String> {
    let out = kubectl_with(
        &[
            "get",
            "rs",
            "-n",
            ns,
            "-l",
            &format!("c10m.dev/fleet={FLEET}"),
            "-o",
            "json",
        ],
        None,
    );
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v["items"]
        .as_array()?
        .iter()
        .filter_map(|rs| {
            let revision: i64 = rs["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
                .as_str()?
                .parse()
                .ok()?;
            Some((
                revision,
                rs["metadata"]["labels"]["pod-template-hash"]
                    .as_str()?
                    .to_string(),
            ))
        })
        .max()
        .map(|(_, hash)| hash)
}

/// Keeps `path` equal to the fleet's pods that are Ready and healthy, every
/// 250 ms, until `stop`.
fn balance(ns: String, path: PathBuf, stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let ips: Vec<String> = pods(&ns)
                .into_iter()
                .filter(|p| p.ready && healthz(&p.ip) == 200)
                .map(|p| format!("{}:7000", p.ip))
                .collect();
            write_targets(&path, &ips);
            std::thread::sleep(Duration::from_millis(250));
        }
    });
}

fn rollout_status(ns: &str) -> Value {
    get_json(ns, "connectionfleet", FLEET).expect("fleet")["status"]["rollout"].clone()
}

/// Rolls a fleet as `r` says and returns what the clients and the fleet
/// showed: `{"shards", "connections", "budget", "peakClosesPerSecond",
/// "movedTwice", "movedTwiceAllowed", "mostClosesPerClient",
/// "revisionChanges", "reachedOldRevision", "reachedInterruptedRevision",
/// "durationSeconds",
/// "idealSeconds", "podStartSeconds", "mostPods", "surge",
/// "closedWhilePaused", "connectionsByShardAtEnd", "hottestToMeanPercent"}`.
/// Asserts
/// what must hold for the figures to mean anything (every client held at
/// the end, each closed by the server with 1001, the fleet complete);
/// [`check`] asserts the bounds.
fn roll(r: &Roll) -> Value {
    // A roll that failed (panicked) leaves nothing the next one needs.
    let _alone = ONE_ROLL_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    ensure_crd();
    PodRunner::ensure();
    // One namespace per roll: the last one may still be terminating.
    let namespace = Namespace::create(if r.failover {
        "rollout-failover"
    } else {
        "rollout"
    });
    let ns = namespace.0.as_str();
    let admission = RolloutAdmission::install(ns);
    let mut ops = if r.failover {
        let a = Operator::elected(ns, LEASE, &format!("{ns}-a"));
        let b = Operator::elected(ns, LEASE, &format!("{ns}-b"));
        vec![a, b]
    } else {
        vec![Operator::start(ns)]
    };
    let (ok, out) = apply(ns, &r.manifest());
    assert!(ok, "{out}");
    let shards = r.shards as usize;
    let f = wait_fleet_ready(ns, FLEET, Duration::from_secs(60));
    let plan = &f["status"]["plan"];
    assert_eq!(plan["shards"], r.shards, "{plan}");
    assert_eq!(plan["drainRate"], r.drain_rate, "{plan}");
    assert_eq!(plan["rolloutSurge"], r.surge(), "{plan}");
    let cap = plan["shardConnectionLimit"].as_u64().expect("cap");
    let step = plan["rolloutStepSeconds"]
        .as_u64()
        .expect("rolloutStepSeconds");
    assert_eq!(step, cap.div_ceil(r.drain_rate) + 5, "{plan}");
    // Outside a rollout the gate between steps is a cap's drain: the pace
    // that holds the budget with no operator running.
    let dep = get_json(ns, "deployment", FLEET).expect("deployment");
    assert_eq!(dep["spec"]["minReadySeconds"].as_u64(), Some(step));
    assert_eq!(
        dep["spec"]["strategy"]["rollingUpdate"],
        json!({"maxSurge": r.surge(), "maxUnavailable": 0})
    );

    let targets = workspace().join(format!("target/e2e-logs/{ns}-targets"));
    let stop = Arc::new(AtomicBool::new(false));
    balance(ns.to_string(), targets.clone(), stop.clone());
    wait_for(
        "every shard a healthy target",
        Duration::from_secs(60),
        || {
            let text = std::fs::read_to_string(&targets).ok()?;
            (text.lines().count() == shards).then_some(())
        },
    );
    let load = Loadgen::start(&[
        format!("--targets-file={}", targets.display()),
        "--protocol=websocket".into(),
        "--reconnect".into(),
        "--backoff-min-ms=200".into(),
        "--backoff-max-ms=2000".into(),
        "--ping-rate=0".into(),
        format!("--connections={}", r.clients),
        "--rate=1000".into(),
        "--source-net=150".into(),
    ]);
    let old = pods(ns);
    assert_eq!(old.len(), shards, "{old:?}");
    let clients = r.clients as i64;
    wait_for("every client on a shard", Duration::from_secs(120), || {
        let held: Option<i64> = old.iter().map(|p| connections(&p.ip)).sum();
        (held == Some(clients)).then_some(())
    });
    let old_hash = old[0].hash.clone();

    // A user's restart: a new pod template, outside the operator.
    let started = Instant::now();
    let started_wall = SystemTime::now();
    let deployment = format!("deployment/{FLEET}");
    kubectl(&["rollout", "restart", "-n", ns, &deployment]);
    let new_hash = wait_for("the new ReplicaSet", Duration::from_secs(30), || {
        newest_hash(ns).filter(|h| *h != old_hash)
    });
    // Paused before its first step, through the fleet (`spec.rollout.paused`,
    // as a GitOps tool would): updated shards come up, the old ones are
    // cordoned, and none drains.
    let pause_fleet = |paused: bool| {
        let patch = format!(r#"{{"spec":{{"rollout":{{"paused":{paused}}}}}}}"#);
        let fleet = format!("connectionfleet/{FLEET}");
        kubectl(&["patch", "-n", ns, &fleet, "--type", "merge", "-p", &patch]);
    };
    if r.pause.is_some() {
        pause_fleet(true);
    }
    let pod_start = wait_for("an updated shard", Duration::from_secs(30), || {
        pods(ns)
            .iter()
            .any(|p| p.hash == new_hash && healthz(&p.ip) == 200)
            .then(|| started.elapsed())
    });
    let mut paused_for = Duration::ZERO;
    let mut paused_window = None;
    if let Some(pause) = r.pause {
        wait_for("the old shards cordoned", Duration::from_secs(30), || {
            old.iter().all(|p| healthz(&p.ip) == 503).then_some(())
        });
        let st = wait_for("status.rollout", Duration::from_secs(10), || {
            let st = rollout_status(ns);
            (st["cordonedShards"] == r.shards && st["paused"] == true).then_some(st)
        });
        let held: Option<i64> = old.iter().map(|p| connections(&p.ip)).sum();
        assert_eq!(held, Some(clients), "a cordon keeps every client");
        assert_eq!(st["connectionsOnOldShards"], r.clients, "{st}");
        // A step as long as the fullest old shard's clients take to close
        // (+0.5 s, rounded up), not a cap's drain: the balancer spreads the
        // clients within a few percent.
        let fullest = old
            .iter()
            .filter_map(|p| connections(&p.ip))
            .max()
            .expect("counts") as u64;
        assert_eq!(
            st["stepSeconds"],
            (fullest * 1000 / r.drain_rate + 500).div_ceil(1000),
            "fullest shard {fullest}: {st}"
        );
        assert!(st["stepSeconds"].as_u64().unwrap() < step, "{st}");
        assert!(st["estimatedCompletionTime"].is_string(), "{st}");
        // The updated shards admit 110 % of an even share of what moves
        // (the midpoint of 100 % and the default tolerance, 120 %), and
        // say so in their metrics.
        let midpoint = (100 + MAX_TO_MEAN_PERCENT) / 2;
        let limit = (r.clients * midpoint).div_ceil(100 * r.shards);
        assert_eq!(st["connectionsToMove"], r.clients, "{st}");
        assert_eq!(st["shardConnectionLimit"], limit, "{st}");
        let updated: Vec<ShardPod> = pods(ns)
            .into_iter()
            .filter(|p| p.hash == new_hash)
            .collect();
        assert!(!updated.is_empty());
        for p in &updated {
            wait_for("the updated shard's limit", Duration::from_secs(10), || {
                (metric_sum(&p.ip, "c10m_connections_limit") == Some(limit as i64)).then_some(())
            });
        }
        let paused_at = Instant::now();
        let from = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        std::thread::sleep(pause);
        let old_left = pods(ns).iter().filter(|p| p.hash == old_hash).count();
        assert_eq!(old_left, shards, "a step started while paused");
        paused_for = paused_at.elapsed();
        paused_window = Some((from.as_secs(), (from + paused_for).as_secs()));
        pause_fleet(false);
    } else {
        wait_for("the old shards cordoned", Duration::from_secs(30), || {
            let now = pods(ns);
            old.iter()
                .all(|p| healthz(&p.ip) != 200 || !now.iter().any(|q| q.name == p.name))
                .then_some(())
        });
    }
    // Every old shard still there is cordoned: from here on, every
    // connection one accepts is a reconnect that reached an old revision.
    // By pod name: (IP, accepted at its cordon, accepted last seen, of the
    // interrupted revision).
    let mut accepted: BTreeMap<String, (String, i64, i64, bool)> = old
        .iter()
        .filter_map(|p| {
            let n = metric_sum(&p.ip, "c10m_connections_accepted_total")?;
            Some((p.name.clone(), (p.ip.clone(), n, n, false)))
        })
        .collect();
    // The revisions rolled away from (the interrupted one joins with
    // `third_revision`), and the one rolled to.
    let mut old_hashes = vec![old_hash.clone()];
    let mut target_hash = new_hash.clone();
    let mut restarted_again: Option<Instant> = None;
    // Clients the interrupted revision's shards held when first seen
    // cordoned or draining: the only ones a third revision may move again.
    let mut interrupted_held = 0;
    // The refusal of a `kubectl rollout restart` mid-drain, once tried.
    let mut refused: Option<String> = None;

    // Completion: every shard updated, the old ones gone, every client held
    // by an updated shard.
    let timeout = Duration::from_secs(r.shards * step + 120);
    // Pods at any poll: all of them, and those not Terminating.
    let mut most_pods = 0;
    let mut most_serving_pods = 0;
    // The leader killed (failover): the survivor and when.
    let mut killed: Option<(usize, Instant)> = None;
    let finals = wait_for("the rollout to complete", timeout, || {
        // KWOK hands a deleted pod's IP to the next pod: a read counts for
        // an old shard only when its pod holds that IP in listings taken
        // before and after the reads.
        let holds = |listed: &[ShardPod], name: &str, ip: &str| {
            listed.iter().any(|p| p.name == name && p.ip == ip)
        };
        let before = pods(ns);
        let reads: Vec<(String, i64)> = accepted
            .iter()
            .filter(|(name, (ip, ..))| holds(&before, name, ip))
            .filter_map(|(name, (ip, ..))| {
                Some((
                    name.clone(),
                    metric_sum(ip, "c10m_connections_accepted_total")?,
                ))
            })
            .collect();
        let after = pods(ns);
        for (name, n) in reads {
            let (ip, _, last, _) = accepted.get_mut(&name).expect("read above");
            if holds(&after, &name, ip) {
                *last = (*last).max(n);
            }
        }
        let listed = fleet_pods(ns, FLEET);
        most_pods = most_pods.max(listed.len());
        let serving = listed
            .iter()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null());
        most_serving_pods = most_serving_pods.max(serving.count());
        let stepped = after.iter().filter(|p| p.hash == old_hash).count() < shards;
        if r.third_revision && restarted_again.is_none() && stepped {
            // Through the fleet, as a user would.
            let image = r#"{"spec":{"server":{"image":"c10m.local/server:third-revision"}}}"#;
            let fleet = format!("connectionfleet/{FLEET}");
            kubectl(&["patch", "-n", ns, &fleet, "--type=merge", "-p", image]);
            restarted_again = Some(Instant::now());
            println!(
                "FIGURE third_revision_at_seconds={:.1}",
                started.elapsed().as_secs_f64()
            );
        }
        if restarted_again.is_some()
            && target_hash == new_hash
            && let Some(h) = newest_hash(ns).filter(|h| *h != new_hash)
        {
            old_hashes.push(new_hash.clone());
            target_hash = h;
        }
        // The interrupted revision's shards count as old from their cordon
        // (or their drain) on.
        if old_hashes.len() > 1 {
            for p in &after {
                if p.hash != new_hash || accepted.contains_key(&p.name) || healthz(&p.ip) != 503 {
                    continue;
                }
                let n = metric_sum(&p.ip, "c10m_connections_accepted_total");
                if let (Some(n), Some(held)) = (n, connections(&p.ip)) {
                    interrupted_held += held;
                    accepted.insert(p.name.clone(), (p.ip.clone(), n, n, true));
                }
            }
        }
        if r.restart_mid_drain && refused.is_none() && stepped {
            let dep = get_json(ns, "deployment", FLEET)?;
            let mark = &dep["metadata"]["annotations"][STEP_DRAINING];
            if mark.is_string() {
                let out = kubectl_with(&["rollout", "restart", "-n", ns, &deployment], None);
                let err = String::from_utf8_lossy(&out.stderr).into_owned();
                assert!(!out.status.success(), "a restart mid-drain went through");
                assert!(
                    err.contains(&format!("drains until {}", mark.as_str().unwrap())),
                    "{err}"
                );
                println!(
                    "FIGURE restart_refused_mid_drain_at_seconds={:.1}",
                    started.elapsed().as_secs_f64()
                );
                refused = Some(err);
            }
        }
        if r.failover && killed.is_none() && stepped {
            let leader = ops
                .iter()
                .position(|o| o.holds(ns, LEASE))
                .expect("a leader mid-rollout");
            ops[leader].kill();
            killed = Some((1 - leader, Instant::now()));
            println!(
                "FIGURE failover_killed_leader_at_seconds={:.1}",
                started.elapsed().as_secs_f64()
            );
        }
        let f = get_json(ns, "connectionfleet", FLEET)?;
        let now = pods(ns);
        let done = f["status"]["rollout"].is_null()
            && f["status"]["updatedShards"] == r.shards
            && now.len() == shards
            && now.iter().all(|p| p.hash == target_hash);
        if !done {
            return None;
        }
        let held: Option<i64> = now.iter().map(|p| connections(&p.ip)).sum();
        (held == Some(clients)).then_some(now)
    });
    let took = started.elapsed();
    if let Some((survivor, at)) = killed {
        let op = &ops[survivor];
        assert!(
            op.holds(ns, LEASE) && op.log_text().contains("became leader"),
            "the survivor never led: {}",
            op.log_text()
        );
        println!(
            "FIGURE failover_rollout_seconds_after_kill={:.1}",
            at.elapsed().as_secs_f64()
        );
    }
    // Where the clients are at the end, by shard, and the hottest shard
    // against the mean, as the rebalancer weighs them
    // (`spec.rebalance.maxToMeanPercent`).
    let mut by_shard: Vec<i64> = finals.iter().filter_map(|p| connections(&p.ip)).collect();
    by_shard.sort_unstable();
    let mean = by_shard.iter().sum::<i64>() as f64 / by_shard.len().max(1) as f64;
    let hottest_to_mean = by_shard
        .last()
        .map_or(0.0, |&c| c as f64 / mean.max(1.0) * 100.0);
    println!(
        "FIGURE rollout_connections_by_shard_at_end={by_shard:?} hottest_to_mean_percent={hottest_to_mean:.0}"
    );
    stop.store(true, Ordering::Relaxed);
    let report = load.finish();
    assert!(
        !r.restart_mid_drain || refused.is_some(),
        "no drain was ever marked on the Deployment"
    );
    // The mark goes with the last drain.
    let dep = get_json(ns, "deployment", FLEET).expect("deployment");
    assert!(
        dep["metadata"]["annotations"][STEP_DRAINING].is_null(),
        "{}",
        dep["metadata"]
    );

    // Every client was closed by the server (its old shard's drain, 1001)
    // and is held again at the end, by an updated shard.
    assert_eq!(report["openAtEnd"].as_u64(), Some(r.clients), "{report}");
    assert!(
        report["closedByServer"].as_u64() >= Some(r.clients),
        "{report}"
    );
    assert_eq!(
        report["goodbyes"]["1001"], report["closedByServer"],
        "{report}"
    );
    for p in &finals {
        assert!(!old.iter().any(|o| o.name == p.name), "{} is old", p.name);
    }
    let by_second: BTreeMap<u64, u64> = report["closesBySecond"]
        .as_object()
        .expect("closesBySecond")
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap()))
        .collect();
    let peak = by_second.values().copied().max().unwrap_or(0);
    let reached = |interrupted: bool| -> i64 {
        accepted
            .values()
            .filter(|a| a.3 == interrupted)
            .map(|(_, first, last, _)| last - first)
            .sum()
    };
    // Nothing closed while paused (the seconds strictly inside the pause).
    let closed_paused: u64 = paused_window.map_or(0, |(from, to)| {
        by_second.range(from + 1..to).map(|(_, n)| n).sum()
    });
    // Duration, the pause left out: from the restart to the fleet's own
    // `Progressing=False RolloutComplete` (its last old shard drained;
    // 1 s resolution, rounded up here, read from the condition rather than
    // from this loop's polls).
    let f = get_json(ns, "connectionfleet", FLEET).expect("fleet");
    let complete = condition(&f, "Progressing").expect("Progressing");
    assert_eq!(complete["reason"], "RolloutComplete", "{complete}");
    let complete_at: SystemTime = complete["lastTransitionTime"]
        .as_str()
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .expect("lastTransitionTime")
        .into();
    let completed = complete_at
        .duration_since(started_wall)
        .expect("complete after the restart");
    let start_second = started_wall.duration_since(UNIX_EPOCH).unwrap().as_secs();
    let timeline: Vec<String> = by_second
        .iter()
        .map(|(t, n)| format!("{}:{n}", t.saturating_sub(start_second)))
        .collect();
    println!(
        "FIGURE rollout_closes_by_second_since_restart={}",
        timeline.join(",")
    );
    println!(
        "FIGURE rollout_seconds={:.1} observed_by_test_seconds={:.1} paused_seconds={:.1} cap_step_seconds={step}",
        completed.as_secs_f64(),
        took.as_secs_f64(),
        paused_for.as_secs_f64()
    );
    assert!(
        fleet_events(ns, FLEET)
            .iter()
            .all(|(t, _, _)| t != "Warning"),
        "{:?}",
        fleet_events(ns, FLEET)
    );
    let rolled = completed.as_secs_f64() + 1.0 - paused_for.as_secs_f64();

    // Nothing of this roll may serve the next one (rolls run one at a
    // time, [`ONE_ROLL_AT_A_TIME`]): KWOK hands a deleted pod's IP to the
    // next pod, and a server of this roll still listening there takes the
    // next roll's clients (a failover roll started right after another
    // saw clients closed up to 12 times and 49 reach an old shard).
    let ips: Vec<String> = finals.iter().map(|p| p.ip.clone()).collect();
    let name = ns.to_string();
    drop(ops);
    drop(admission);
    drop(namespace);
    wait_for(
        "the roll's pods and servers gone",
        Duration::from_secs(90),
        || (pods(&name).is_empty() && ips.iter().all(|ip| healthz(ip) == 0)).then_some(()),
    );
    json!({
        "shards": r.shards,
        "connections": r.clients,
        "budget": r.budget,
        "surge": r.surge(),
        "peakClosesPerSecond": peak,
        "movedTwice": report["clientsClosedTwice"],
        "movedTwiceAllowed": interrupted_held,
        "mostClosesPerClient": report["mostClosesPerClient"],
        "revisionChanges": old_hashes.len(),
        "reachedOldRevision": reached(false),
        "reachedInterruptedRevision": reached(true),
        "durationSeconds": (rolled * 10.0).round() / 10.0,
        "idealSeconds": (r.clients as i64 + interrupted_held) as f64 / r.budget as f64,
        "podStartSeconds": (pod_start.as_secs_f64() * 10.0).round() / 10.0,
        "mostPods": most_pods,
        "mostServingPods": most_serving_pods,
        "closedWhilePaused": closed_paused,
        "connectionsByShardAtEnd": by_shard,
        "hottestToMeanPercent": hottest_to_mean.round(),
        "maxToMeanPercent": MAX_TO_MEAN_PERCENT,
        "failoverAllowanceSeconds": if r.failover { FAILOVER_SECONDS } else { 0.0 },
    })
}

/// The bounds of issue 22 on a roll's figures ([`roll`]): peak closes in
/// any 1 s window ≤ 1.1 × the budget, 0 clients moved twice (with a third
/// revision: no more than the interrupted revision's shards held, and none
/// closed more than once per revision change), 0 reconnects accepted by an
/// old-revision shard after its cordon, 0 closes while paused, pods not
/// Terminating ≤ shards + surge, and the duration, the pause left out, ≤ 1.3 × the
/// ideal (every client closed at the budget) + 2 pod starts (the first
/// step's surge, and the last step's, which no drain hides), plus
/// [`FAILOVER_SECONDS`] when the leader was killed, and the shards end
/// balanced: the hottest within the rebalancer's tolerance of the mean
/// (`spec.rebalance.maxToMeanPercent`, 120 by default). Without the
/// updated shards' admission limit the 8-shard bench and a third revision
/// ended at 131 % (ADR 0011).
fn check(fig: &Value) {
    let f = |k: &str| fig[k].as_f64().unwrap_or_else(|| panic!("{k} in {fig}"));
    let (budget, ideal) = (f("budget"), f("idealSeconds"));
    println!(
        "FIGURE rollout_peak_over_budget={:.2} moved_twice={} reached_old_revision={} duration_over_ideal={:.2} pod_start_seconds={} most_pods={} ({fig})",
        f("peakClosesPerSecond") / budget,
        fig["movedTwice"],
        fig["reachedOldRevision"],
        f("durationSeconds") / ideal,
        fig["podStartSeconds"],
        fig["mostPods"],
    );
    assert!(f("peakClosesPerSecond") <= 1.1 * budget, "peak: {fig}");
    // Only a client on a shard of the interrupted revision, at its cordon
    // or reaching it after, can be moved twice.
    assert!(
        f("movedTwice") <= f("movedTwiceAllowed") + f("reachedInterruptedRevision"),
        "moved twice: {fig}"
    );
    assert!(
        f("mostClosesPerClient") <= f("revisionChanges"),
        "moved more than once per revision change: {fig}"
    );
    assert_eq!(fig["reachedOldRevision"], 0, "{fig}");
    assert_eq!(fig["closedWhilePaused"], 0, "{fig}");
    // Terminating pods are not bounded: the Deployment controller does not
    // count them (kubernetes#95498) and creates the next step's surge as
    // soon as it removes old pods. On KWOK a deleted pod goes within a
    // moment, yet a poll in that moment lists it: 1 of 6 third-revision
    // runs on 2026-12-05 saw 7 pods (ADR 0011). `mostPods` reports them.
    assert!(
        f("mostServingPods") <= f("shards") + f("surge"),
        "pods: {fig}"
    );
    assert!(
        f("hottestToMeanPercent") <= f("maxToMeanPercent"),
        "the shards ended unbalanced: {fig}"
    );
    let bound = 1.3 * ideal + 2.0 * f("podStartSeconds") + f("failoverAllowanceSeconds");
    assert!(
        f("durationSeconds") <= bound,
        "duration above 1.3 × ideal + 2 pod starts = {bound:.1} s: {fig}"
    );
}

/// Issue 22, items 1 and 3: a `kubectl rollout restart`, paused 10 s
/// through the fleet before its first step. A second `kubectl rollout
/// restart` while that step drains is refused by the chart's admission
/// policy, naming the drain's end (ADR 0011), and the roll goes on within
/// the budget.
#[test]
fn a_rollout_restart_moves_every_client_once_within_the_budget() {
    let fig = roll(&Roll {
        pause: Some(Duration::from_secs(10)),
        restart_mid_drain: true,
        ..Roll::four_shards()
    });
    check(&fig);
}

/// Issue 22, item 4: the leader of two operators is SIGKILLed as the first
/// step's shards drain. The Deployment goes on stepping at the gate the
/// dead leader last set, the survivor takes the Lease and carries the
/// rollout on from the status (its cordon records and `drainingUntil`):
/// no shard drains twice, no client moves twice, the budget holds.
#[test]
fn killing_the_leader_mid_rollout_keeps_the_budget_and_moves_every_client_once() {
    let fig = roll(&Roll {
        failover: true,
        ..Roll::four_shards()
    });
    check(&fig);
}

/// Issue 22, item 3: a new template while a rollout is under way (a new
/// `spec.server.image` as the first step's shards drain). The template
/// waits for that drain's end (the gate held meanwhile); the Deployment
/// controller's removal of cordoned old shards that a new template allows
/// is then the next step, paced like the others. The interrupted
/// revision's shards stay serving until a shard of the third is Ready,
/// are then cordoned with the rest and drain in later steps: a client
/// moves at most once per revision change, only clients those shards held
/// move twice, and the budget holds (ADR 0011). A step whose updated
/// shards were Ready in different seconds is opened for all of them at
/// once (`rollout::step_gate`): before that, one run in six removed one
/// shard in its first step and took 1.85 × the ideal. The test plane's pods
/// follow their readiness probe (the pod runner writes it, as a kubelet
/// does): before that, a cordoned shard stayed Ready and available, the
/// Deployment controller's cleanup removed the interrupted revision's
/// shards first (unavailable behind the held gate, uncordoned, holding
/// clients), and one full `make test` saw a client closed 4 times and 1.87
/// × the ideal (ADR 0011).
#[test]
fn a_third_revision_mid_rollout_moves_each_client_once_per_revision_change() {
    let fig = roll(&Roll {
        third_revision: true,
        ..Roll::four_shards()
    });
    check(&fig);
}

/// `make bench-rollout`: 8 shards, 16,000 clients, a 400/s budget (two
/// shards a step at 200/s each); writes `target/bench/rollout.json`, then
/// checks the same bounds as the test.
#[test]
#[ignore = "make bench-rollout"]
fn bench_rollout() {
    let fig = roll(&Roll {
        shards: 8,
        clients: 16_000,
        budget: 400,
        drain_rate: 200,
        per_cpu: 2800,
        ..Roll::four_shards()
    });
    let out = workspace().join("target/bench/rollout.json");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&out, format!("{fig}\n")).unwrap();
    println!("{fig}");
    check(&fig);
}

/// Issue 22, item 2: a rollout whose surge shard finds no room on the
/// nodes waits with every old shard serving, and the fleet says at once
/// what the nodes lack. Two 32-CPU shards fill `kwok-node-1` (64 CPUs); a
/// `kubectl rollout restart` asks for a third.
#[test]
fn a_surge_without_room_waits_and_says_what_the_nodes_lack() {
    ensure_crd();
    let ns = Namespace::create("surge");
    let ns = ns.0.as_str();
    let _op = Operator::start(ns);
    let manifest = r#"apiVersion: c10m.dev/v1alpha1
kind: ConnectionFleet
metadata:
  name: full
spec:
  connections: 10000
  shard:
    cpus: 32
    minShards: 2
  availability:
    failureDomain: None
  placement:
    nodeSelector:
      kubernetes.io/hostname: kwok-node-1
"#;
    let (ok, out) = apply(ns, manifest);
    assert!(ok, "{out}");
    let f = wait_fleet_ready(ns, "full", Duration::from_secs(60));
    assert_eq!(f["status"]["plan"]["shards"], 2, "{}", f["status"]["plan"]);
    let before = condition(&f, "Degraded").expect("Degraded");
    assert_eq!(before["status"], "False", "{before}");
    let old: Vec<ShardPod> = shard_pods(ns, "full");
    assert_eq!(old.len(), 2, "{old:?}");

    let restarted = Instant::now();
    kubectl(&["rollout", "restart", "-n", ns, "deployment/full"]);
    let f = wait_condition(
        ns,
        "full",
        "Degraded",
        "True",
        Some("ShardUnschedulable"),
        Duration::from_secs(30),
    );
    println!(
        "FIGURE surge_unschedulable_reported_seconds={:.1}",
        restarted.elapsed().as_secs_f64()
    );
    let degraded = condition(&f, "Degraded").unwrap();
    let message = degraded["message"].as_str().unwrap();
    assert_eq!(degraded["status"], "True", "{degraded}");
    for part in [
        "cannot be scheduled",
        "Insufficient cpu",
        "spec.rollout.maxReconnectRate",
    ] {
        assert!(message.contains(part), "{part:?} missing: {message}");
    }
    // The fallback: the rollout waits; both old shards still serve.
    let now = shard_pods(ns, "full");
    for p in &old {
        assert!(
            now.iter()
                .any(|q| q.name == p.name && q.ready && !q.terminating),
            "{} left: {now:?}",
            p.name
        );
    }
    assert_eq!(
        condition(&f, "Progressing").unwrap()["reason"],
        "RollingOut"
    );
    wait_for(
        "ShardUnschedulable Warning",
        Duration::from_secs(10),
        || {
            fleet_events(ns, "full")
                .iter()
                .any(|(t, r, _)| t == "Warning" && r == "ShardUnschedulable")
                .then_some(())
        },
    );
}
