//! `c10m-bench-scale` (issue 23, `make bench-scale`): one operator, 1,000
//! fleets on the scale plane's 500 KWOK nodes (`tests/cluster/scale.env`),
//! measured from the client side in five phases, and written to
//! `target/bench/scale.json` with a table on stdout.
//!
//! 1. **Ramp**: the fleets are created at `--rate` per second; apply →
//!    the fleet's Deployment seen on a watch, and apply → the fleet's
//!    `Ready=True` (its KWOK pods Ready), each as p50 / p99 / max in ms;
//!    the operator's CPU seconds over the ramp.
//! 2. **Quiet window** (`--quiet-seconds`): the API server's
//!    `apiserver_request_total` and `apiserver_watch_events_total` deltas.
//!    `mutatingRequests` counts POST/PUT/PATCH/APPLY/DELETE of what only
//!    the operator writes ([`OPERATOR_WRITES`]: the API server does not say
//!    who sent a request, so the bench counts by resource, group and
//!    subresource); every mutating request is in
//!    `quietWindow.mutatingByResource` (KWOK's node leases, the
//!    controllers' status writes and events among them).
//! 3. **Restart**: SIGKILL the operator and start it again while every
//!    fleet is converged; mutating requests until it has reconciled every
//!    fleet once (`c10m_operator_reconciliations_total`), and how long that
//!    took. (It runs before the re-plan, whose rollouts would still be
//!    under way.)
//! 4. **Re-plan**: `spec.connections` ×8 on `--replan` fleets at once;
//!    p99 to their Deployments' first new `metadata.generation` on the
//!    watch (the rollout gate's patches bump it again later), split into
//!    the bench's own patch (`patchMs`), the patch sent to the fleet's new
//!    generation on the bench's watch (`fleetSeenMs`), and from there to
//!    the Deployment's (`fleetToDeploymentMs`); on the other fleets
//!    meanwhile the operator's writes (`writesToOthers`: fleet events and
//!    new Deployment generations) and all watch events
//!    (`watchEventsOnOthers`, the controller manager's status writes too).
//! 5. **Metrics loop** (`--metrics-sync-seconds`): autoscaling turned on for
//!    every fleet, against a loopback stub of Prometheus's query API
//!    ([`stub_prometheus`]: no Prometheus runs on the scale plane; it
//!    answers every query with an empty vector, so every fleet holds its
//!    shards and reports its metrics missing); after one sync period, the
//!    queries the stub answered over three sync periods, per reconcile
//!    (`prometheusQueriesPerSync`, each reconcile of such a fleet being one
//!    sync) and per fleet and sync period.
//! 6. **Burst**: delete every fleet, then one `kubectl apply` of all of
//!    them; seconds until every Deployment is seen, how long `kubectl`
//!    took, and each fleet's first watch event → its Deployment's, p50 /
//!    p99 / max in ms.
//!
//! The run stops early (and still writes what it measured, with
//! `"aborted"` saying why) when the machine's MemAvailable falls below
//! `--min-available-mib`, the operator's RSS passes `--max-rss-mib`, or the
//! run passes `--timeout-seconds`. It always stops the operator and deletes
//! its namespaces.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

/// Command line of `c10m-bench-scale`.
#[derive(Parser, Debug)]
#[command(about = "1,000 fleets on the scale plane: issue 23's scale benchmark")]
struct Args {
    /// Fleets to run.
    #[arg(long, default_value_t = 1000)]
    fleets: usize,
    /// Namespaces the fleets are spread over (`scale-00`, ...).
    #[arg(long, default_value_t = 10)]
    namespaces: usize,
    /// Fleets created per second in the ramp.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Seconds of the quiet window.
    #[arg(long, default_value_t = 120)]
    quiet_seconds: u64,
    /// Fleets re-planned at once.
    #[arg(long, default_value_t = 100)]
    replan: usize,
    /// `spec.autoscaling.syncPeriodSeconds` of the metrics-loop phase.
    #[arg(long, default_value_t = 20)]
    metrics_sync_seconds: u64,
    /// The whole run's bound, seconds.
    #[arg(long, default_value_t = 840)]
    timeout_seconds: u64,
    /// Stop when the operator's RSS passes this, MiB.
    #[arg(long, default_value_t = 256)]
    max_rss_mib: u64,
    /// Stop when the machine's MemAvailable falls below this, MiB.
    #[arg(long, default_value_t = 4096)]
    min_available_mib: u64,
    /// The operator binary.
    #[arg(
        long,
        default_value = "target/x86_64-unknown-linux-musl/release-size/c10m-operator"
    )]
    operator: PathBuf,
    /// Loopback port of the operator's /metrics.
    #[arg(long, default_value_t = 18090)]
    metrics_port: u16,
    /// Where the operator logs (emptied when a run starts).
    #[arg(long, default_value = "target/bench/scale-operator.log")]
    operator_log: PathBuf,
    /// The JSON report.
    #[arg(long, default_value = "target/bench/scale.json")]
    out: PathBuf,
}

/// Verbs that change state, as `apiserver_request_total` labels them.
const MUTATING: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// What the operator writes, as `resource[.group][/subresource]` from the
/// labels of `apiserver_request_total`. Nothing else on the scale plane
/// writes these: the controllers write Deployments' and
/// PodDisruptionBudgets' `/status`, KWOK and the scheduler pods' `/status`
/// and `/binding`, and the controller manager its events through the core
/// API (`events`; the operator's go through `events.k8s.io`).
const OPERATOR_WRITES: [&str; 8] = [
    "connectionfleets.c10m.dev",
    "connectionfleets.c10m.dev/status",
    "deployments.apps",
    "services",
    "poddisruptionbudgets.policy",
    "secrets",
    "pods",
    "events.events.k8s.io",
];

/// Kinds the operator owns and watches (`resource[.group]`).
const OWNED_RESOURCES: [&str; 5] = [
    "connectionfleets.c10m.dev",
    "deployments.apps",
    "services",
    "secrets",
    "poddisruptionbudgets.policy",
];

/// Label on every object the operator owns ([`c10m_operator::names`]).
const FLEET_LABEL: &str = "c10m.dev/fleet";

/// Why a run stopped early.
#[derive(Debug)]
struct Aborted(String);

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Aborted {}

/// The run's bounds, checked by every wait and by a sampler every 250 ms.
struct Guard {
    deadline: Instant,
    max_rss: u64,
    min_available: u64,
    operator_pid: Mutex<Option<u32>>,
    rss_peak: Mutex<u64>,
    /// The phase under way, and the operator's RSS peak in each phase so
    /// far (`operatorRssBytes.peakByPhase`): which phase sets the peak.
    phase: Mutex<&'static str>,
    phase_peaks: Mutex<BTreeMap<&'static str, u64>>,
    aborted: Mutex<Option<String>>,
}

impl Guard {
    /// `Err` once a bound is passed.
    fn check(&self) -> Result<()> {
        if let Some(why) = self.aborted.lock().unwrap().clone() {
            return Err(Aborted(why).into());
        }
        if Instant::now() > self.deadline {
            let why = "the run passed its timeout".to_string();
            *self.aborted.lock().unwrap() = Some(why.clone());
            return Err(Aborted(why).into());
        }
        Ok(())
    }

    /// One sample: the operator's RSS (its peak kept) and the machine's
    /// MemAvailable against their bounds.
    fn sample(&self) {
        if let Some(pid) = *self.operator_pid.lock().unwrap()
            && let Some(rss) = rss_bytes(pid)
        {
            let mut peak = self.rss_peak.lock().unwrap();
            *peak = (*peak).max(rss);
            let phase = *self.phase.lock().unwrap();
            let mut peaks = self.phase_peaks.lock().unwrap();
            let in_phase = peaks.entry(phase).or_default();
            *in_phase = (*in_phase).max(rss);
            if rss > self.max_rss {
                self.abort(format!(
                    "the operator's RSS {} MiB passed {} MiB",
                    rss >> 20,
                    self.max_rss >> 20
                ));
            }
        }
        if let Some(avail) = mem_available_bytes()
            && avail < self.min_available
        {
            self.abort(format!(
                "MemAvailable {} MiB fell below {} MiB",
                avail >> 20,
                self.min_available >> 20
            ));
        }
    }

    /// The run enters `phase` (its RSS samples count towards it), said on
    /// stderr with `detail`.
    fn enter(&self, phase: &'static str, detail: &str) {
        eprintln!("bench-scale: {phase}{detail}");
        *self.phase.lock().unwrap() = phase;
    }

    fn abort(&self, why: String) {
        self.aborted.lock().unwrap().get_or_insert(why);
    }
}

/// `VmRSS` of `pid`, bytes.
fn rss_bytes(pid: u32) -> Option<u64> {
    proc_kib(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// Open sockets of `pid` (its file descriptors that are sockets): the
/// watches' and the idle pool's connections to the API server, and its
/// metrics listener.
fn socket_fds(pid: u32) -> Option<usize> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(
        fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().starts_with("socket:"))
            .count(),
    )
}

/// The machine's `MemAvailable`, bytes.
fn mem_available_bytes() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

/// A `NAME: N kB` line of a /proc file, in bytes.
fn proc_kib(path: &str, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// What the watches saw of one fleet (key `namespace/name`).
#[derive(Clone, Debug, Default)]
struct Seen {
    /// When the fleet was created (ramp) or patched (re-plan).
    applied: Option<Instant>,
    /// When the re-plan's patch of the fleet returned.
    patched: Option<Instant>,
    /// The fleet's newest `metadata.generation` on the bench's watch, and
    /// when it was first seen there.
    fleet_generation: Option<(i64, Instant)>,
    /// First event of the fleet on the bench's watch (the burst's fleets
    /// are created by `kubectl`, so this is their apply as a watch sees it).
    fleet_seen: Option<Instant>,
    /// First event of its Deployment.
    deployment: Option<Instant>,
    /// Its Deployment's `metadata.generation`s, each with when it was first
    /// seen, oldest first (the re-plan's apply, then the rollout gate's
    /// patches, each bump one).
    generations: Vec<(i64, Instant)>,
    /// First event with `Ready=True` on the fleet.
    ready: Option<Instant>,
    /// Watch events on the Deployment and on the fleet.
    deployment_events: u64,
    fleet_events: u64,
}

impl Seen {
    /// The newest `metadata.generation` of its Deployment seen (0: none).
    fn generation(&self) -> i64 {
        self.generations.last().map_or(0, |(g, _)| *g)
    }
}

type Book = Arc<Mutex<HashMap<String, Seen>>>;

/// Over the fleets not in `chosen`: the operator's writes seen on the
/// watches (each fleet event, the operator being the only other writer of
/// a fleet, and each new Deployment generation, a spec write), and all
/// their watch events (the controller manager's Deployment status writes
/// among them).
fn others(book: &HashMap<String, Seen>, chosen: &HashSet<String>) -> (u64, u64) {
    book.iter()
        .filter(|(k, _)| !chosen.contains(*k))
        .fold((0, 0), |(w, e), (_, s)| {
            let spec = s.generations.len() as u64;
            (
                w + s.fleet_events + spec,
                e + s.fleet_events + s.deployment_events,
            )
        })
}

/// Records every Deployment the operator owns into `book`.
fn watch_deployments(client: Client, book: Book) {
    tokio::spawn(async move {
        let api: Api<Deployment> = Api::all(client);
        let mut events = watcher(api, watcher::Config::default().labels(FLEET_LABEL)).boxed();
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let Ok(event) = event else { continue };
            match event {
                watcher::Event::Apply(d) | watcher::Event::InitApply(d) => {
                    let key = format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any());
                    let generation = d.metadata.generation.unwrap_or(0);
                    let mut book = book.lock().unwrap();
                    let seen = book.entry(key).or_default();
                    seen.deployment.get_or_insert(now);
                    seen.deployment_events += 1;
                    if generation > seen.generation() {
                        seen.generations.push((generation, now));
                    }
                }
                watcher::Event::Delete(d) => {
                    let key = format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any());
                    if let Some(seen) = book.lock().unwrap().get_mut(&key) {
                        seen.deployment = None;
                        seen.generations.clear();
                    }
                }
                _ => {}
            }
        }
    });
}

/// Records every fleet's events and first `Ready=True` into `book`.
fn watch_fleets(api: Api<DynamicObject>, book: Book) {
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let Ok(watcher::Event::Apply(f) | watcher::Event::InitApply(f)) = event else {
                continue;
            };
            let key = format!("{}/{}", f.namespace().unwrap_or_default(), f.name_any());
            let ready = f.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            let generation = f.metadata.generation.unwrap_or(0);
            let mut book = book.lock().unwrap();
            let seen = book.entry(key).or_default();
            seen.fleet_seen.get_or_insert(now);
            seen.fleet_events += 1;
            if seen.fleet_generation.is_none_or(|(g, _)| generation > g) {
                seen.fleet_generation = Some((generation, now));
            }
            if ready {
                seen.ready.get_or_insert(now);
            }
        }
    });
}

/// Waits `d`, checking the guard every 500 ms (`Err` once it trips).
async fn hold(guard: &Guard, d: Duration) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < d {
        guard.check()?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// Polls `done` every 200 ms until it holds, the guard trips, or `limit`
/// passes (an abort naming `what`).
async fn wait_until(
    guard: &Guard,
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    let start = Instant::now();
    loop {
        guard.check()?;
        if done() {
            return Ok(());
        }
        if start.elapsed() > limit {
            let why = format!("{what} did not happen within {} s", limit.as_secs());
            guard.abort(why.clone());
            return Err(Aborted(why).into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// p50 / p99 / max of `ms`, in ms, or null without samples.
fn percentiles(mut ms: Vec<f64>) -> Value {
    if ms.is_empty() {
        return Value::Null;
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
    let r = |x: f64| (x * 10.0).round() / 10.0;
    json!({"p50": r(at(0.50)), "p99": r(at(0.99)), "max": r(at(1.0))})
}

/// Milliseconds from `a` to `b`.
fn ms(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1000.0
}

/// The API server's `/metrics` as `(family, labels) → value` for the two
/// families the bench reads.
async fn apiserver_counters(
    client: &Client,
) -> Result<Vec<(String, HashMap<String, String>, f64)>> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await.context("GET /metrics")?;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))?;
    Ok(scrape
        .samples
        .into_iter()
        .filter(|s| {
            s.metric == "apiserver_request_total" || s.metric == "apiserver_watch_events_total"
        })
        .filter_map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => return None,
            };
            let labels = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            Some((s.metric, labels, v))
        })
        .collect())
}

/// What changed between two [`apiserver_counters`] scrapes: mutating
/// requests by `resource[.group][/subresource]`, and watch events by
/// `resource[.group]`.
struct Delta {
    mutating: BTreeMap<String, f64>,
    watch_events: BTreeMap<String, f64>,
}

impl Delta {
    fn between(
        before: &[(String, HashMap<String, String>, f64)],
        after: &[(String, HashMap<String, String>, f64)],
    ) -> Delta {
        let key = |m: &str, l: &HashMap<String, String>| {
            let mut labels: Vec<_> = l.iter().collect();
            labels.sort();
            format!("{m}{labels:?}")
        };
        let old: HashMap<String, f64> = before.iter().map(|(m, l, v)| (key(m, l), *v)).collect();
        let mut d = Delta {
            mutating: BTreeMap::new(),
            watch_events: BTreeMap::new(),
        };
        for (m, l, v) in after {
            let n = v - old.get(&key(m, l)).copied().unwrap_or(0.0);
            if n <= 0.0 {
                continue;
            }
            let get = |k: &str| l.get(k).map(String::as_str).unwrap_or("");
            let (group, sub) = (get("group"), get("subresource"));
            let resource = match get("resource") {
                "" => get("kind").to_lowercase(),
                r if group.is_empty() => r.to_string(),
                r => format!("{r}.{group}"),
            };
            if m == "apiserver_request_total" && MUTATING.contains(&get("verb")) {
                let name = if sub.is_empty() {
                    resource
                } else {
                    format!("{resource}/{sub}")
                };
                *d.mutating.entry(name).or_default() += n;
            } else if m == "apiserver_watch_events_total" {
                *d.watch_events.entry(resource).or_default() += n;
            }
        }
        d
    }

    /// Mutating requests of what only the operator writes.
    fn operator_writes(&self) -> f64 {
        self.mutating
            .iter()
            .filter(|(k, _)| OPERATOR_WRITES.contains(&k.as_str()))
            .map(|(_, n)| n)
            .sum()
    }

    /// Status writes on fleets.
    fn status_writes(&self) -> f64 {
        self.mutating
            .get("connectionfleets.c10m.dev/status")
            .copied()
            .unwrap_or(0.0)
    }

    /// Watch events on the kinds the operator owns.
    fn owned_watch_events(&self) -> f64 {
        self.watch_events
            .iter()
            .filter(|(k, _)| OWNED_RESOURCES.contains(&k.as_str()))
            .map(|(_, n)| n)
            .sum()
    }
}

/// The operator's `c10m_operator_reconciliations_total`, summed over
/// results; `None` while it does not answer.
fn reconciliations(port: u16) -> Option<f64> {
    operator_counter(port, "c10m_operator_reconciliations_total{", |_| true)
}

/// The GET requests (reads, lists and watches) the operator counts itself
/// as sent (`c10m_operator_api_requests_total`).
fn operator_reads(port: u16) -> Option<f64> {
    operator_counter(port, "c10m_operator_api_requests_total{", |l| {
        l.contains(r#"method="GET""#)
    })
}

/// The requests the operator counts itself as sent with another method
/// than GET (`c10m_operator_api_requests_total`): its writes, by its own
/// account.
fn operator_writes(port: u16) -> Option<f64> {
    operator_counter(port, "c10m_operator_api_requests_total{", |l| {
        !l.contains(r#"method="GET""#)
    })
}

/// The requests the operator counts itself as sent, by method and
/// resource (`"GET secrets"`: `c10m_operator_api_requests_total`'s
/// labels); `None` while it does not answer.
fn operator_requests_by_resource(port: u16) -> Option<BTreeMap<String, f64>> {
    let text = operator_metrics(port)?;
    let label = |line: &str, name: &str| {
        let from = line.find(&format!("{name}=\""))? + name.len() + 2;
        let len = line[from..].find('"')?;
        Some(line[from..from + len].to_string())
    };
    let mut by = BTreeMap::new();
    for line in text.lines() {
        if !line.starts_with("c10m_operator_api_requests_total{") {
            continue;
        }
        let (Some(method), Some(resource)) = (label(line, "method"), label(line, "resource"))
        else {
            continue;
        };
        let Some(n) = line.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok()) else {
            continue;
        };
        *by.entry(format!("{method} {resource}")).or_insert(0.0) += n;
    }
    Some(by)
}

/// The operator's `/metrics` text; `None` while it does not answer.
fn operator_metrics(port: u16) -> Option<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    agent
        .get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()
}

/// The sum of the operator's samples whose line starts with `prefix` and
/// passes `keep`; `None` while it does not answer.
fn operator_counter(port: u16, prefix: &str, keep: impl Fn(&str) -> bool) -> Option<f64> {
    let text = operator_metrics(port)?;
    Some(
        text.lines()
            .filter(|l| l.starts_with(prefix) && keep(l))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// The operator's CPU time (user + system), seconds.
fn cpu_seconds(pid: u32) -> f64 {
    c10m_e2e::cpu_time(pid).as_secs_f64()
}

/// One operator process for all namespaces, logging to `log` (appended),
/// reading its metrics from the stub at `prometheus`.
fn start_operator(a: &Args, prometheus: &str) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.operator_log)
        .with_context(|| a.operator_log.display().to_string())?;
    Command::new(&a.operator)
        .args([
            "run",
            "--metrics-addr",
            &format!("127.0.0.1:{}", a.metrics_port),
            "--prometheus-url",
            prometheus,
        ])
        .env("RUST_LOG", "info,kube=warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("start {}", a.operator.display()))
}

/// Fleet `i`: mixed sizes, 1 to 4 shards of 2 CPUs on the `edge` pool.
fn fleet(a: &Args, i: usize) -> Value {
    let sizes = [20_000, 50_000, 100_000, 200_000];
    json!({
        "apiVersion": "c10m.dev/v1alpha1",
        "kind": "ConnectionFleet",
        "metadata": {"name": format!("f-{i:04}"), "namespace": namespace(a, i)},
        "spec": {
            "connections": sizes[i % sizes.len()],
            "backend": {"model": "epoll"},
            "node": {"pricePerHour": "2.59"},
            "shard": {"cpus": 2, "minShards": 1 + (i / sizes.len()) % 4},
            "availability": {"failureDomain": "None"},
            "placement": {"nodeSelector": {"c10m.dev/pool": "edge"}}
        }
    })
}

fn namespace(a: &Args, i: usize) -> String {
    format!("scale-{:02}", i % a.namespaces)
}

fn key(a: &Args, i: usize) -> String {
    format!("{}/f-{i:04}", namespace(a, i))
}

/// Everything measured so far (the report's JSON).
#[derive(Default)]
struct Report(serde_json::Map<String, Value>);

impl Report {
    fn set(&mut self, k: &str, v: Value) {
        self.0.insert(k.into(), v);
    }
}

struct Run<'a> {
    a: &'a Args,
    client: Client,
    fleets: Api<DynamicObject>,
    ar: ApiResource,
    book: Book,
    guard: Arc<Guard>,
    operator: Option<Child>,
    prometheus: Stub,
}

impl Run<'_> {
    fn fleets_in(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &self.ar)
    }

    fn operator_pid(&self) -> u32 {
        self.operator.as_ref().map_or(0, Child::id)
    }

    fn spawn_operator(&mut self) -> Result<()> {
        let child = start_operator(self.a, &self.prometheus.url)?;
        *self.guard.operator_pid.lock().unwrap() = Some(child.id());
        self.operator = Some(child);
        Ok(())
    }

    fn kill_operator(&mut self) {
        *self.guard.operator_pid.lock().unwrap() = None;
        if let Some(mut c) = self.operator.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn count(&self, f: impl Fn(&Seen) -> bool) -> usize {
        self.book.lock().unwrap().values().filter(|s| f(s)).count()
    }

    /// Milliseconds from each fleet's apply to `at`, for the fleets that
    /// have both.
    fn since_applied(&self, at: impl Fn(&Seen) -> Option<Instant>) -> Vec<f64> {
        let book = self.book.lock().unwrap();
        book.values()
            .filter_map(|s| Some(ms(s.applied?, at(s)?)))
            .collect()
    }

    async fn ramp(&mut self, r: &mut Report) -> Result<()> {
        let a = self.a;
        let cpu0 = cpu_seconds(self.operator_pid());
        let period = Duration::from_secs_f64(1.0 / a.rate.max(0.1));
        let start = Instant::now();
        for i in 0..a.fleets {
            self.guard.check()?;
            let at = start + period * i as u32;
            tokio::time::sleep_until(at.into()).await;
            let obj: DynamicObject = serde_json::from_value(fleet(a, i))?;
            let applied = Instant::now();
            self.book
                .lock()
                .unwrap()
                .entry(key(a, i))
                .or_default()
                .applied = Some(applied);
            self.fleets_in(&namespace(a, i))
                .create(&Default::default(), &obj)
                .await
                .with_context(|| format!("create {}", key(a, i)))?;
        }
        let n = a.fleets;
        let created = start.elapsed().as_secs_f64();
        let deployed = wait_until(
            &self.guard,
            "every Deployment",
            Duration::from_secs(180),
            || self.count(|s| s.deployment.is_some()) >= n,
        )
        .await;
        // Recorded even when not every Deployment came (then over those
        // that did, with their count).
        let seen = self.since_applied(|s| s.deployment);
        r.set("deploymentsSeen", json!(seen.len()));
        r.set("rampCreateSeconds", json!(round2(created)));
        r.set("applyToDeploymentMs", percentiles(seen));
        // The operator's share of the ramp so far (again once all are Ready).
        let (pid, port) = (self.operator_pid(), a.metrics_port);
        let spent = |r: &mut Report| {
            let cpu = round2(cpu_seconds(pid) - cpu0);
            r.set("operatorCpuSeconds", json!({ "ramp": cpu }));
            r.set("reconciles", json!({"ramp": reconciliations(port)}));
            r.set(
                "operatorRequests",
                json!({"ramp": {
                    "reads": operator_reads(port),
                    "writes": operator_writes(port),
                    "byResource": operator_requests_by_resource(port),
                }}),
            );
        };
        spent(r);
        deployed?;
        let ready = wait_until(
            &self.guard,
            "every fleet Ready",
            Duration::from_secs(240),
            || self.count(|s| s.ready.is_some()) >= n,
        )
        .await;
        r.set(
            "applyToReadyMs",
            percentiles(self.since_applied(|s| s.ready)),
        );
        r.set(
            "rampSeconds",
            json!((start.elapsed().as_secs_f64() * 10.0).round() / 10.0),
        );
        spent(r);
        ready
    }

    async fn quiet(&mut self, r: &mut Report) -> Result<()> {
        // Let the last pods' status settle before counting.
        tokio::time::sleep(Duration::from_secs(10)).await;
        self.guard.check()?;
        let cpu0 = cpu_seconds(self.operator_pid());
        let before = apiserver_counters(&self.client).await?;
        let own_before = operator_writes(self.a.metrics_port);
        hold(&self.guard, Duration::from_secs(self.a.quiet_seconds)).await?;
        let after = apiserver_counters(&self.client).await?;
        let d = Delta::between(&before, &after);
        let rss = rss_bytes(self.operator_pid()).unwrap_or(0);
        r.set(
            "quietWindow",
            json!({
                "seconds": self.a.quiet_seconds,
                "operatorSocketsAtEnd": socket_fds(self.operator_pid()),
                "mutatingRequests": d.operator_writes() as u64,
                "operatorCountedWrites": own_before.zip(operator_writes(self.a.metrics_port)).map(|(b, a)| a - b),
                "statusWrites": d.status_writes() as u64,
                "watchEventsOnOwnedKinds": d.owned_watch_events() as u64,
                "mutatingByResource": d.mutating,
            }),
        );
        r.0.entry("operatorCpuSeconds")
            .or_insert(json!({}))
            .as_object_mut()
            .unwrap()
            .insert(
                "quiet".into(),
                json!(round2(cpu_seconds(self.operator_pid()) - cpu0)),
            );
        // Steady RSS split as the kernel counts it: anonymous (heap,
        // stacks, the allocator's retained pages) and file-backed (the
        // binary's touched text and data).
        let status = format!("/proc/{}/status", self.operator_pid());
        r.set(
            "operatorRssBytes",
            json!({
                "steady": rss,
                "steadyAnon": proc_kib(&status, "RssAnon:"),
                "steadyFile": proc_kib(&status, "RssFile:"),
                "peak": Value::Null,
            }),
        );
        Ok(())
    }

    async fn replan(&mut self, r: &mut Report) -> Result<()> {
        let a = self.a;
        let every = (a.fleets / a.replan.max(1)).max(1);
        let chosen: Vec<usize> = (0..a.fleets).step_by(every).take(a.replan).collect();
        let chosen_keys: HashSet<String> = chosen.iter().map(|&i| key(a, i)).collect();
        let (generations, others_before) = {
            let book = self.book.lock().unwrap();
            let generations: HashMap<String, i64> = chosen
                .iter()
                .map(|&i| (key(a, i), book.get(&key(a, i)).map_or(0, Seen::generation)))
                .collect();
            (generations, others(&book, &chosen_keys))
        };
        let patches = chosen.iter().map(|&i| {
            let api = self.fleets_in(&namespace(a, i));
            let connections = fleet(a, i)["spec"]["connections"].as_i64().unwrap_or(0) * 8;
            let book = self.book.clone();
            let k = key(a, i);
            async move {
                let patch = json!({"spec": {"connections": connections}});
                book.lock().unwrap().entry(k.clone()).or_default().applied = Some(Instant::now());
                let patched = api
                    .patch(
                        &k[k.find('/').unwrap() + 1..],
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await;
                book.lock().unwrap().entry(k).or_default().patched = Some(Instant::now());
                patched
            }
        });
        for p in futures::future::join_all(patches).await {
            p.context("patch spec.connections")?;
        }
        let book = self.book.clone();
        let moved = |g: &HashMap<String, i64>| {
            let book = book.lock().unwrap();
            g.iter()
                .filter(|(k, g0)| book.get(*k).is_some_and(|s| s.generation() > **g0))
                .count()
        };
        let n = generations.len();
        let waited = wait_until(
            &self.guard,
            "every re-planned Deployment's new generation",
            Duration::from_secs(60),
            || moved(&generations) >= n,
        )
        .await;
        // Writes the re-plan causes elsewhere land within a few syncs.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let book = self.book.lock().unwrap();
        // To the first generation past the one before the patch: later ones
        // (the rollout gate's patches) came after the re-plan had landed.
        // Each one's time split where the bench sees it: its own patch's
        // round trip; the patch sent to the fleet's new generation on the
        // bench's watch (the API server's write and its watch's delivery);
        // and from there to the Deployment's (the operator's reconcile,
        // its requests and the watch's delivery).
        let (mut took, mut patch, mut fleet_seen, mut fleet_to_deployment) =
            (vec![], vec![], vec![], vec![]);
        for (k, g0) in &generations {
            let Some(s) = book.get(k) else { continue };
            let Some((_, seen)) = s.generations.iter().find(|(g, _)| g > g0) else {
                continue;
            };
            let Some(applied) = s.applied else { continue };
            took.push(ms(applied, *seen));
            patch.extend(s.patched.map(|p| ms(applied, p)));
            if let Some((_, f)) = s.fleet_generation {
                fleet_seen.push(ms(applied, f));
                fleet_to_deployment.push(ms(f, *seen));
            }
        }
        let others_after = others(&book, &chosen_keys);
        let p = percentiles(took);
        r.set(
            "replan",
            json!({"fleets": n, "p99Ms": p["p99"], "ms": p,
                "patchMs": percentiles(patch),
                "fleetSeenMs": percentiles(fleet_seen),
                "fleetToDeploymentMs": percentiles(fleet_to_deployment),
                "writesToOthers": others_after.0 - others_before.0,
                "watchEventsOnOthers": others_after.1 - others_before.1}),
        );
        waited
    }

    async fn restart(&mut self, r: &mut Report) -> Result<()> {
        let before = apiserver_counters(&self.client).await?;
        self.kill_operator();
        let start = Instant::now();
        self.spawn_operator()?;
        let n = self.a.fleets as f64;
        let port = self.a.metrics_port;
        let waited = wait_until(
            &self.guard,
            "a reconcile of every fleet after the restart",
            Duration::from_secs(180),
            || reconciliations(port).is_some_and(|c| c >= n),
        )
        .await;
        let reconciled = start.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = apiserver_counters(&self.client).await?;
        let d = Delta::between(&before, &after);
        r.set(
            "restart",
            json!({
                "mutatingRequests": d.operator_writes() as u64,
                "operatorCountedWrites": operator_writes(self.a.metrics_port),
                "reconciledSeconds": round2(reconciled),
                "operatorSocketsAfter": socket_fds(self.operator_pid()),
                "mutatingByResource": d.mutating,
            }),
        );
        waited
    }

    async fn burst(&mut self, r: &mut Report) -> Result<()> {
        let a = self.a;
        let dp = DeleteParams::default();
        for ns in (0..a.namespaces).map(|i| format!("scale-{i:02}")) {
            self.fleets_in(&ns)
                .delete_collection(&dp, &Default::default())
                .await?;
        }
        wait_until(
            &self.guard,
            "every Deployment gone",
            Duration::from_secs(180),
            || self.count(|s| s.deployment.is_some()) == 0,
        )
        .await?;
        self.book.lock().unwrap().clear();
        let list = json!({
            "apiVersion": "v1",
            "kind": "List",
            "items": (0..a.fleets).map(|i| fleet(a, i)).collect::<Vec<_>>(),
        });
        let file = a.out.with_file_name("scale-burst.json");
        std::fs::write(&file, list.to_string())?;
        let start = Instant::now();
        // Waited for beside the guard: past a bound, the apply is killed.
        let mut apply = tokio::process::Command::new("kubectl")
            .args(["apply", "-f"])
            .arg(&file)
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("kubectl apply")?;
        let status = loop {
            tokio::select! {
                status = apply.wait() => break status.context("kubectl apply")?,
                () = tokio::time::sleep(Duration::from_millis(500)) => self.guard.check()?,
            }
        };
        if !status.success() {
            bail!("kubectl apply -f {} failed: {status}", file.display());
        }
        let applied = start.elapsed().as_secs_f64();
        let n = a.fleets;
        let waited = wait_until(
            &self.guard,
            "every Deployment after the burst",
            Duration::from_secs(120),
            || self.count(|s| s.deployment.is_some()) >= n,
        )
        .await;
        let book = self.book.lock().unwrap();
        let last = book.values().filter_map(|s| s.deployment).max();
        // Each fleet from its first watch event to its Deployment's: what
        // the operator adds while the fleets arrive at kubectl's pace.
        let each = book
            .values()
            .filter_map(|s| Some(ms(s.fleet_seen?, s.deployment?)))
            .collect();
        drop(book);
        r.set(
            "burstAllDeploymentsSeconds",
            json!(last.map(|l| round2(ms(start, l) / 1000.0))),
        );
        r.set("burstFleetToDeploymentMs", percentiles(each));
        r.set("burstKubectlApplySeconds", json!(round2(applied)));
        waited
    }

    /// Phase 5: autoscaling on for every fleet (merge patches, 50 at a
    /// time), one sync period to settle, then three sync periods counted.
    async fn metrics_loop(&mut self, r: &mut Report) -> Result<()> {
        let a = self.a;
        let period = a.metrics_sync_seconds.max(1);
        let patch =
            json!({"spec": {"autoscaling": {"enabled": true, "syncPeriodSeconds": period}}});
        let pp = PatchParams::default();
        let start = Instant::now();
        for chunk in (0..a.fleets).collect::<Vec<_>>().chunks(50) {
            self.guard.check()?;
            let patches = chunk.iter().map(|&i| {
                let api = self.fleets_in(&namespace(a, i));
                let (patch, pp) = (&patch, &pp);
                async move {
                    api.patch(&format!("f-{i:04}"), pp, &Patch::Merge(patch))
                        .await
                }
            });
            for p in futures::future::join_all(patches).await {
                p.context("patch spec.autoscaling")?;
            }
        }
        let patched = start.elapsed().as_secs_f64();
        hold(&self.guard, Duration::from_secs(period + 10)).await?;
        let port = a.metrics_port;
        let queries = || {
            self.prometheus
                .queries
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let pid = self.operator_pid();
        let (q0, rec0) = (queries(), reconciliations(port));
        let (reads0, writes0, cpu0) = (
            operator_reads(port),
            operator_writes(port),
            cpu_seconds(pid),
        );
        let by_resource0 = operator_requests_by_resource(port);
        let window = Duration::from_secs(3 * period);
        hold(&self.guard, window).await?;
        let (asked, reconciles) = (
            (queries() - q0) as f64,
            rec0.zip(reconciliations(port)).map(|(b, a)| a - b),
        );
        let cpu = round2(cpu_seconds(pid) - cpu0);
        let delta = |before: Option<f64>, after: Option<f64>| before.zip(after).map(|(b, a)| a - b);
        let (reads, writes) = (
            delta(reads0, operator_reads(port)),
            delta(writes0, operator_writes(port)),
        );
        // What the window's requests went to, by method and resource.
        let by_resource =
            by_resource0
                .zip(operator_requests_by_resource(port))
                .map(|(before, after)| {
                    (after.into_iter())
                        .map(|(k, n)| (k.clone(), n - before.get(&k).copied().unwrap_or(0.0)))
                        .filter(|(_, n)| *n > 0.0)
                        .collect::<BTreeMap<_, _>>()
                });
        let syncs_due = a.fleets as f64 * window.as_secs_f64() / period as f64;
        let per_sync = reconciles.filter(|n| *n > 0.0).map(|n| round2(asked / n));
        // The operator's API requests a reconcile of the window (each an
        // autoscaled fleet's sync).
        let per_reconcile = |n: Option<f64>| {
            n.zip(reconciles.filter(|r| *r > 0.0))
                .map(|(n, r)| round2(n / r))
        };
        r.set("prometheusQueriesPerSync", json!(per_sync));
        r.set(
            "metricsLoop",
            json!({
                "fleets": a.fleets,
                "syncPeriodSeconds": period,
                "patchSeconds": round2(patched),
                "windowSeconds": window.as_secs(),
                "queries": asked,
                "reconciles": reconciles,
                "queriesPerFleetPerSyncPeriod": round2(asked / syncs_due),
                "operatorCpuSeconds": cpu,
                "operatorRequests": {"reads": reads, "writes": writes, "byResource": by_resource},
                "operatorRequestsPerSync": {
                    "reads": per_reconcile(reads),
                    "writes": per_reconcile(writes),
                },
            }),
        );
        Ok(())
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

async fn run(run: &mut Run<'_>, r: &mut Report) -> Result<()> {
    let a = run.a;
    for i in 0..a.namespaces {
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": format!("scale-{i:02}")}}))?;
        Api::<Namespace>::all(run.client.clone())
            .create(&Default::default(), &ns)
            .await
            .with_context(|| {
                format!("create namespace scale-{i:02} (left from an earlier run? make down-scale)")
            })?;
    }
    // One run's log: the restart phase's operator appends to it.
    std::fs::File::create(&a.operator_log).with_context(|| a.operator_log.display().to_string())?;
    run.spawn_operator()?;
    // The operator installs the CRD; the fleet watch starts once it exists.
    let crd_ok = || {
        Command::new("kubectl")
            .args(["get", "crd", "connectionfleets.c10m.dev"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    wait_until(&run.guard, "the CRD", Duration::from_secs(60), crd_ok).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    watch_fleets(run.fleets.clone(), run.book.clone());
    let ramp = format!(" ({} fleets at {}/s)", a.fleets, a.rate);
    run.guard.enter("ramp", &ramp);
    run.ramp(r).await?;
    run.guard
        .enter("quiet", &format!(" ({} s)", a.quiet_seconds));
    run.quiet(r).await?;
    run.guard.enter("restart", "");
    run.restart(r).await?;
    run.guard
        .enter("replan", &format!(" ({} fleets)", a.replan));
    run.replan(r).await?;
    let sync = format!(" (every fleet, a {} s sync)", a.metrics_sync_seconds);
    run.guard.enter("metricsLoop", &sync);
    run.metrics_loop(r).await?;
    run.guard.enter("burst", "");
    run.burst(r).await
}

/// A loopback stub of Prometheus's query API, counting what it is asked.
struct Stub {
    /// `http://127.0.0.1:PORT`.
    url: String,
    /// Queries answered.
    queries: Arc<std::sync::atomic::AtomicU64>,
}

/// Serves `GET /api/v1/query` on 127.0.0.1 (axum) with an empty instant
/// vector, in Prometheus's response format, counting each request; for the
/// life of the bench.
async fn stub_prometheus() -> Result<Stub> {
    const EMPTY: &str = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let queries = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = queries.clone();
    let app = axum::Router::new().route(
        "/api/v1/query",
        axum::routing::get(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async { ([(http::header::CONTENT_TYPE, "application/json")], EMPTY) }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("bench-scale: the Prometheus stub stopped: {e}");
        }
    });
    Ok(Stub { url, queries })
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let client = Client::try_default()
        .await
        .context("kubeconfig ($KUBECONFIG)")?;
    let gvk = GroupVersionKind::gvk("c10m.dev", "v1alpha1", "ConnectionFleet");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "connectionfleets");
    let guard = Arc::new(Guard {
        deadline: Instant::now() + Duration::from_secs(a.timeout_seconds),
        max_rss: a.max_rss_mib << 20,
        min_available: a.min_available_mib << 20,
        operator_pid: Mutex::new(None),
        rss_peak: Mutex::new(0),
        phase: Mutex::new("start"),
        phase_peaks: Mutex::new(BTreeMap::new()),
        aborted: Mutex::new(None),
    });
    // The watchdog (tools/watchdog.sh) or a user's ^C: stop, clean up and
    // write what was measured.
    let stopper = guard.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => stopper.abort("stopped by SIGTERM".into()),
            _ = int.recv() => stopper.abort("stopped by SIGINT".into()),
        }
    });
    let sampler = guard.clone();
    tokio::spawn(async move {
        loop {
            sampler.sample();
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let book: Book = Arc::default();
    watch_deployments(client.clone(), book.clone());
    let mut r = Report::default();
    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .list_metadata(&Default::default())
        .await?
        .items
        .len();
    r.set("fleets", json!(a.fleets));
    r.set("nodes", json!(nodes));
    let mut state = Run {
        a: &a,
        fleets: Api::all_with(client.clone(), &ar),
        client: client.clone(),
        ar,
        book,
        guard: guard.clone(),
        operator: None,
        prometheus: stub_prometheus().await?,
    };
    let started = Instant::now();
    let outcome = run(&mut state, &mut r).await;
    guard.sample();
    state.kill_operator();
    for i in 0..a.namespaces {
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&format!("scale-{i:02}"), &DeleteParams::background())
            .await;
    }
    let peak = *guard.rss_peak.lock().unwrap();
    let by_phase = guard.phase_peaks.lock().unwrap().clone();
    let rss =
        r.0.entry("operatorRssBytes")
            .or_insert(json!({"steady": null}))
            .as_object_mut()
            .unwrap();
    rss.insert("peak".into(), json!(peak));
    rss.insert("peakByPhase".into(), json!(by_phase));
    r.set("runSeconds", json!(round2(started.elapsed().as_secs_f64())));
    let aborted = match &outcome {
        Ok(()) => Value::Null,
        Err(e) => json!(format!("{e:#}")),
    };
    r.set("aborted", aborted);
    let report = Value::Object(r.0);
    std::fs::write(&a.out, format!("{report}\n"))?;
    print_table(&report);
    let mut out = std::io::stdout();
    writeln!(out, "{report}")?;
    if let Err(e) = outcome {
        bail!("bench-scale stopped early: {e:#}");
    }
    Ok(())
}

/// The report as a table a person reads.
fn print_table(r: &Value) {
    let row = |name: &str, v: &Value| println!("{name:<44} {v}");
    println!("{:<44} value", "figure");
    row(
        "fleets / nodes",
        &json!(format!("{} / {}", r["fleets"], r["nodes"])),
    );
    row(
        "apply → Deployment ms (p50/p99/max)",
        &r["applyToDeploymentMs"],
    );
    row("apply → fleet Ready ms (p50/p99/max)", &r["applyToReadyMs"]);
    row("operator RSS bytes (steady/peak)", &r["operatorRssBytes"]);
    row("operator CPU s (ramp/quiet)", &r["operatorCpuSeconds"]);
    row(
        "operator sockets: quiet window's end, 5 s after the restart",
        &json!([
            r["quietWindow"]["operatorSocketsAtEnd"],
            r["restart"]["operatorSocketsAfter"]
        ]),
    );
    row("ramp: operator reconciles", &r["reconciles"]["ramp"]);
    row(
        "ramp: operator requests (reads/writes)",
        &r["operatorRequests"]["ramp"],
    );
    row(
        "quiet: mutating requests",
        &r["quietWindow"]["mutatingRequests"],
    );
    row("quiet: status writes", &r["quietWindow"]["statusWrites"]);
    row(
        "quiet: watch events on owned kinds",
        &r["quietWindow"]["watchEventsOnOwnedKinds"],
    );
    row("re-plan p99 ms", &r["replan"]["p99Ms"]);
    row("re-plan: the patch p99 ms", &r["replan"]["patchMs"]["p99"]);
    row(
        "re-plan: patch sent -> fleet seen p99 ms",
        &r["replan"]["fleetSeenMs"]["p99"],
    );
    row(
        "re-plan: fleet seen -> Deployment p99 ms",
        &r["replan"]["fleetToDeploymentMs"]["p99"],
    );
    row(
        "re-plan writes to the others",
        &r["replan"]["writesToOthers"],
    );
    row(
        "restart: mutating requests",
        &r["restart"]["mutatingRequests"],
    );
    row(
        "restart: every fleet reconciled s",
        &r["restart"]["reconciledSeconds"],
    );
    row(
        "burst: every Deployment s",
        &r["burstAllDeploymentsSeconds"],
    );
    row("burst: kubectl apply s", &r["burstKubectlApplySeconds"]);
    row(
        "burst: fleet seen -> Deployment p99 ms",
        &r["burstFleetToDeploymentMs"]["p99"],
    );
    row(
        "Prometheus queries per sync",
        &r["prometheusQueriesPerSync"],
    );
    row(
        "Prometheus queries per fleet and sync period",
        &r["metricsLoop"]["queriesPerFleetPerSyncPeriod"],
    );
    row(
        "metrics loop: operator requests per sync (reads/writes)",
        &r["metricsLoop"]["operatorRequestsPerSync"],
    );
    row(
        "metrics loop: operator CPU s",
        &r["metricsLoop"]["operatorCpuSeconds"],
    );
    row("aborted", &r["aborted"]);
}
