//! `c10m-pod-runner`: plays the container runtime for fleet pods on the KWOK
//! nodes of the local control plane.
//!
//! KWOK marks pods Running and gives them an IP in 127.0.0.0/8 but runs
//! nothing (pods with any other IP are on the real node, whose kubelet
//! runs them, and are left alone). This binary watches the pods the operator manages (label
//! `app.kubernetes.io/managed-by=c10m-operator`, all namespaces) and, for
//! each one that is Running with a pod IP and no deletion timestamp, starts
//! one real `c10m-server` with the args and env of the pod's `server`
//! container (literal values, Secret/ConfigMap keys and a few field refs
//! resolved) plus `C10M_BIND=<podIP>`. When the pod is deleted, or leaves
//! Running, the server gets SIGTERM (it drains), and SIGKILL once the pod's
//! termination grace period has passed. A crashed server is restarted with
//! a backoff, like a kubelet would. SIGTERM/SIGINT stop every server first.
//!
//! Invariants: at most one server per pod UID, and at most one live server
//! per IP (a new pod that reuses the IP of a draining one waits for it).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// Command line of `c10m-pod-runner`.
#[derive(Parser, Debug)]
#[command(about = "Runs a real c10m-server for every Running fleet pod on the KWOK nodes")]
struct Args {
    /// The c10m-server binary (default: <workspace>/target/debug/c10m-server).
    #[arg(long, env = "C10M_SERVER_BIN")]
    server_bin: Option<PathBuf>,
    /// Directory of the servers' logs, one `<namespace>_<pod>.log` per pod.
    #[arg(long, default_value = "target/e2e-logs/pods")]
    log_dir: PathBuf,
    /// Label selector of the pods to run.
    #[arg(long, default_value = "app.kubernetes.io/managed-by=c10m-operator")]
    selector: String,
    /// Only pods in this namespace (default: all namespaces).
    #[arg(long)]
    namespace: Option<String>,
    /// Name of the container whose args and env the server gets.
    #[arg(long, default_value = "server")]
    container: String,
    /// Seconds to wait for the servers to exit on SIGTERM/SIGINT before
    /// killing them.
    #[arg(long, default_value_t = 10)]
    shutdown_timeout_secs: u64,
}

/// Grace period when a pod does not set one (the Kubernetes default).
const DEFAULT_GRACE: Duration = Duration::from_secs(30);
/// First and largest delay before restarting a server that exited by itself.
const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A running server process.
struct Server {
    pod: String,
    ip: String,
    pid: i32,
    grace: Duration,
    /// When SIGTERM was sent and when SIGKILL is due.
    term: Option<(Instant, Instant)>,
    killed: bool,
}

/// A server's exit, reported by the task that waits on it.
struct Exit {
    uid: String,
    status: std::io::Result<ExitStatus>,
}

struct Runner {
    args: Args,
    server_bin: PathBuf,
    client: Client,
    servers: HashMap<String, Server>,
    /// Pod UID -> (earliest next start, current backoff) after a crash or a
    /// failed start.
    backoff: HashMap<String, (Instant, Duration)>,
    /// Pods already reported as waiting for their IP (logged once).
    waiting: HashSet<String>,
    exits: mpsc::UnboundedSender<Exit>,
}

fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

/// The pod's IP if it should have a server: Running, an IP in 127.0.0.0/8
/// (a KWOK node's; a pod on the real node has a bridge address and a real
/// runtime already runs it), not deleted.
fn runnable_ip(pod: &Pod) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    (status.phase.as_deref() == Some("Running"))
        .then(|| status.pod_ip.clone())
        .flatten()
        .filter(|ip| {
            ip.parse::<std::net::Ipv4Addr>()
                .is_ok_and(|a| a.is_loopback())
        })
}

#[allow(unsafe_code)] // kill(2) through libc
fn signal_pid(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

impl Runner {
    /// Brings the servers in line with the pods in the store.
    async fn reconcile(&mut self, pods: &[Arc<Pod>]) {
        let now = Instant::now();
        let by_uid: HashMap<String, &Pod> = pods
            .iter()
            .filter_map(|p| Some((p.uid()?, p.as_ref())))
            .collect();

        // Stop the servers of pods that are gone, deleted or not Running.
        for (uid, s) in &mut self.servers {
            let pod = by_uid.get(uid);
            if s.term.is_some() || pod.and_then(|p| runnable_ip(p)).is_some() {
                continue;
            }
            let grace = pod
                .and_then(|p| p.metadata.deletion_grace_period_seconds)
                .map(|g| Duration::from_secs(g.max(0) as u64))
                .unwrap_or(s.grace);
            info!(pod = %s.pod, pid = s.pid, ip = %s.ip, grace_s = grace.as_secs(),
                  "pod gone or terminating: SIGTERM");
            signal_pid(s.pid, libc::SIGTERM);
            s.term = Some((now, now + grace));
        }
        self.kill_overdue(now);

        // Start servers for runnable pods that have none.
        let busy: HashSet<String> = self.servers.values().map(|s| s.ip.clone()).collect();
        for (uid, pod) in &by_uid {
            let Some(ip) = runnable_ip(pod) else { continue };
            if self.servers.contains_key(uid) {
                continue;
            }
            if self.backoff.get(uid).is_some_and(|(at, _)| now < *at) {
                continue;
            }
            if busy.contains(&ip) {
                if self.waiting.insert(uid.clone()) {
                    info!(pod = %pod_key(pod), %ip, "IP still held by another server; waiting");
                }
                continue;
            }
            self.waiting.remove(uid);
            if let Err(e) = self.start(uid, pod, &ip).await {
                let delay = self.bump_backoff(uid);
                warn!(pod = %pod_key(pod), "cannot start server: {e:#}; retrying in {delay:?}");
            }
        }
        // Forget state of pods that no longer exist.
        self.backoff.retain(|uid, _| by_uid.contains_key(uid));
        self.waiting.retain(|uid| by_uid.contains_key(uid));
    }

    /// SIGKILL for servers still running past their grace period.
    fn kill_overdue(&mut self, now: Instant) {
        for s in self.servers.values_mut() {
            if let Some((_, deadline)) = s.term
                && now >= deadline
                && !s.killed
            {
                warn!(pod = %s.pod, pid = s.pid, "still running after the grace period: SIGKILL");
                signal_pid(s.pid, libc::SIGKILL);
                s.killed = true;
            }
        }
    }

    fn bump_backoff(&mut self, uid: &str) -> Duration {
        let delay = self
            .backoff
            .get(uid)
            .map_or(BACKOFF_START, |(_, d)| (*d * 2).min(BACKOFF_MAX));
        self.backoff
            .insert(uid.to_string(), (Instant::now() + delay, delay));
        delay
    }

    #[allow(unsafe_code)] // pre_exec(prctl) for PR_SET_PDEATHSIG
    async fn start(&mut self, uid: &str, pod: &Pod, ip: &str) -> Result<()> {
        let spec = pod.spec.as_ref().context("pod has no spec")?;
        let container = spec
            .containers
            .iter()
            .find(|c| c.name == self.args.container)
            .or_else(|| spec.containers.first())
            .context("pod has no containers")?;
        let env = self.resolve_env(pod, container).await?;
        let key = pod_key(pod);
        let log_path = self.args.log_dir.join(format!(
            "{}_{}.log",
            pod.namespace().unwrap_or_default(),
            pod.name_any()
        ));
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("open {}", log_path.display()))?;
        {
            use std::io::Write;
            writeln!(
                log,
                "==== c10m-pod-runner: starting {} for pod {key} (uid {uid}) on {ip}",
                self.server_bin.display()
            )?;
        }
        let mut cmd = tokio::process::Command::new(&self.server_bin);
        cmd.args(container.args.iter().flatten())
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(&env)
            .env("C10M_BIND", ip)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Own process group: a terminal's Ctrl-C reaches only the runner,
            // which stops the servers itself.
            .process_group(0);
        if let Ok(v) = std::env::var("RUST_LOG_SERVER") {
            cmd.env("RUST_LOG", v);
        }
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child.
        unsafe {
            // The server dies with the runner, even if the runner is killed.
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", self.server_bin.display()))?;
        let pid = child.id().context("child has no pid")? as i32;
        let grace = spec
            .termination_grace_period_seconds
            .map_or(DEFAULT_GRACE, |g| Duration::from_secs(g.max(0) as u64));
        info!(pod = %key, pid, %ip, log = %log_path.display(), "started c10m-server");
        self.servers.insert(
            uid.to_string(),
            Server {
                pod: key,
                ip: ip.to_string(),
                pid,
                grace,
                term: None,
                killed: false,
            },
        );
        let exits = self.exits.clone();
        let uid = uid.to_string();
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = exits.send(Exit { uid, status });
        });
        Ok(())
    }

    /// The container's environment: literal values, `secretKeyRef` and
    /// `configMapKeyRef` read from the API, `fieldRef` for the usual fields.
    async fn resolve_env(
        &self,
        pod: &Pod,
        container: &Container,
    ) -> Result<BTreeMap<String, String>> {
        let ns = pod.namespace().unwrap_or_default();
        let mut out = BTreeMap::new();
        if container.env_from.as_ref().is_some_and(|e| !e.is_empty()) {
            warn!(pod = %pod_key(pod), "envFrom is not supported; ignored");
        }
        for var in container.env.iter().flatten() {
            let value = if let Some(v) = &var.value {
                Some(v.clone())
            } else if let Some(from) = &var.value_from {
                if let Some(r) = &from.secret_key_ref {
                    let api: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
                    let secret = api.get_opt(&r.name).await?;
                    let v = secret.and_then(|s| {
                        let data = s.data.unwrap_or_default();
                        data.get(&r.key)
                            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                    });
                    if v.is_none() && r.optional != Some(true) {
                        anyhow::bail!(
                            "{}: secret {}/{} key {} not found",
                            var.name,
                            ns,
                            r.name,
                            r.key
                        );
                    }
                    v
                } else if let Some(r) = &from.config_map_key_ref {
                    let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
                    let cm = api.get_opt(&r.name).await?;
                    let v = cm.and_then(|c| c.data.unwrap_or_default().get(&r.key).cloned());
                    if v.is_none() && r.optional != Some(true) {
                        anyhow::bail!(
                            "{}: configmap {}/{} key {} not found",
                            var.name,
                            ns,
                            r.name,
                            r.key
                        );
                    }
                    v
                } else if let Some(f) = &from.field_ref {
                    let status = pod.status.clone().unwrap_or_default();
                    match f.field_path.as_str() {
                        "metadata.name" => Some(pod.name_any()),
                        "metadata.namespace" => Some(ns.clone()),
                        "metadata.uid" => pod.uid(),
                        "spec.nodeName" => pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                        "status.podIP" => status.pod_ip,
                        "status.hostIP" => status.host_ip,
                        other => {
                            warn!(pod = %pod_key(pod), "fieldRef {other} is not supported; {} unset", var.name);
                            None
                        }
                    }
                } else {
                    warn!(pod = %pod_key(pod), "unsupported valueFrom for {}; unset", var.name);
                    None
                }
            } else {
                Some(String::new())
            };
            if let Some(v) = value {
                out.insert(var.name.clone(), v);
            }
        }
        Ok(out)
    }

    /// Records a server's exit; schedules a restart if its pod still wants one.
    fn exited(&mut self, exit: Exit) {
        let Some(s) = self.servers.remove(&exit.uid) else {
            return;
        };
        let status = match &exit.status {
            Ok(st) => st.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        match s.term {
            Some((at, _)) => info!(pod = %s.pod, pid = s.pid, %status,
                                   after_ms = at.elapsed().as_millis() as u64, "server stopped"),
            None => {
                let delay = self.bump_backoff(&exit.uid);
                warn!(pod = %s.pod, pid = s.pid, %status, "server exited by itself; restarting in {delay:?}");
            }
        }
    }

    /// SIGTERM to every server, SIGKILL to those left after `timeout`; reaps them.
    async fn shutdown(&mut self, exits: &mut mpsc::UnboundedReceiver<Exit>, timeout: Duration) {
        let now = Instant::now();
        for s in self.servers.values_mut() {
            if s.term.is_none() {
                signal_pid(s.pid, libc::SIGTERM);
                s.term = Some((now, now + timeout));
            }
        }
        info!(
            servers = self.servers.len(),
            "shutting down: SIGTERM sent to every server"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.servers.is_empty() {
            match tokio::time::timeout_at(deadline, exits.recv()).await {
                Ok(Some(exit)) => self.exited(exit),
                Ok(None) => break,
                Err(_) => {
                    for s in self.servers.values() {
                        warn!(pod = %s.pod, pid = s.pid, "SIGKILL at shutdown");
                        signal_pid(s.pid, libc::SIGKILL);
                    }
                    while !self.servers.is_empty() {
                        match tokio::time::timeout(Duration::from_secs(5), exits.recv()).await {
                            Ok(Some(exit)) => self.exited(exit),
                            _ => break,
                        }
                    }
                }
            }
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    c10m_e2e::init_stderr_logging();
    let args = Args::parse();
    let server_bin = args.server_bin.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/c10m-server")
    });
    anyhow::ensure!(
        server_bin.is_file(),
        "{} is missing: run `cargo build -p c10m-server`",
        server_bin.display()
    );
    std::fs::create_dir_all(&args.log_dir)
        .with_context(|| format!("create {}", args.log_dir.display()))?;
    let client = Client::try_default().await.context("kube client")?;

    let (store, writer) = reflector::store::<Pod>();
    let pods: Api<Pod> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut events = std::pin::pin!(reflector(
        writer,
        watcher(pods, watcher::Config::default().labels(&args.selector)).default_backoff()
    ));
    let (tx, mut exits) = mpsc::unbounded_channel();
    let shutdown_timeout = Duration::from_secs(args.shutdown_timeout_secs);
    info!(selector = %args.selector, server = %server_bin.display(),
          logs = %args.log_dir.display(), "c10m-pod-runner watching pods");
    let mut runner = Runner {
        args,
        server_bin,
        client,
        servers: HashMap::new(),
        backoff: HashMap::new(),
        waiting: HashSet::new(),
        exits: tx,
    };
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ready = false;
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(watcher::Event::InitDone)) => ready = true,
                Some(Ok(_)) => {}
                Some(Err(e)) => { warn!("watch: {e}"); continue }
                None => break,
            },
            Some(exit) = exits.recv() => runner.exited(exit),
            _ = tick.tick() => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if ready {
            runner.reconcile(&store.state()).await;
        }
    }
    runner.shutdown(&mut exits, shutdown_timeout).await;
    info!("c10m-pod-runner stopped");
    Ok(())
}
