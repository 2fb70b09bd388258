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
//! Secret volumes the container mounts are materialized the way the kubelet
//! writes them (a timestamped directory, a `..data` symlink to it swapped
//! atomically on update, a symlink per key), one directory per pod and
//! volume under `--volume-dir` (default under /tmp), with the volume's
//! modes and the pod's `fsGroup` as the files' group; env values and args
//! naming a path under the mount path are rewritten into that directory
//! (the servers run on the host, where the mount path does not exist).
//! Secrets carrying the pod selector's labels (the operator's admin Secrets
//! do) are watched, and one that changes is written again at the next tick
//! (a kubelet takes up to its sync period); others are read once, at start.
//! Other volume kinds are not materialized.
//!
//! For tests only, a pod annotated `c10m.dev/test-rlimit-nofile: N` has its
//! server started with RLIMIT_NOFILE at N (soft and hard) and without
//! CAP_SYS_RESOURCE, so it cannot raise the limit to its plan: a shard on a
//! node whose limits drifted below the plan. Setting or changing the
//! annotation on a running pod restarts its server (SIGTERM, then a start
//! with the new limit).
//!
//! Like a kubelet, it runs each container's HTTP readiness probe and
//! reports the result in the pod's `Ready` condition, from the server's
//! first answer on ([`probe`]): a cordoned or draining shard turns NotReady.
//!
//! Invariants: at most one server per pod UID, and at most one live server
//! per IP (a new pod that reuses the IP of a draining one waits for it).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Container, KeyToPath, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::{info, warn};

mod probe;

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
    /// Directory of the pods' Secret volumes, one `<pod uid>/<volume>` each
    /// (default: `/tmp/c10m-pod-runner.<pid>`, removed at exit). Servers
    /// that drop to an unprivileged uid read their files after the drop,
    /// so every directory above it must be enterable by that uid: /tmp is,
    /// while the log directory under /root, or a private `$TMPDIR`, may
    /// not be.
    #[arg(long)]
    volume_dir: Option<PathBuf>,
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
    /// The Secret volumes materialized for it.
    volumes: Vec<SecretVolume>,
    /// The [`TEST_RLIMIT_NOFILE`] it was started with.
    nofile: Option<u64>,
    /// Its readiness probe's results, when the container has one.
    readiness: Option<probe::Readiness>,
    /// The readiness last written to the pod's status (at start: what KWOK
    /// wrote).
    reported: Option<bool>,
}

/// Pod annotation (tests only): start the pod's server with RLIMIT_NOFILE
/// lowered to this many descriptors, beyond its reach to raise.
const TEST_RLIMIT_NOFILE: &str = "c10m.dev/test-rlimit-nofile";

/// `CAP_SYS_RESOURCE` (linux/capability.h; libc does not define it).
const CAP_SYS_RESOURCE: libc::c_ulong = 24;

/// The pod's [`TEST_RLIMIT_NOFILE`], when set to a number.
fn test_nofile(pod: &Pod) -> Option<u64> {
    pod.annotations().get(TEST_RLIMIT_NOFILE)?.parse().ok()
}

/// Default file mode of a Secret volume (`defaultMode` unset), as the API
/// server defaults it.
const SECRET_DEFAULT_MODE: u32 = 0o644;

/// A pod's Secret volume, materialized on the host.
struct SecretVolume {
    namespace: String,
    /// The Secret's name.
    secret: String,
    items: Option<Vec<KeyToPath>>,
    default_mode: u32,
    optional: bool,
    /// The pod's `fsGroup`: the files' group, with group read added.
    fs_group: Option<u32>,
    /// Where it is written: `<volume dir>/<pod uid>/<volume name>`.
    dir: PathBuf,
    /// What it holds now: path in the volume -> (bytes, mode).
    files: Files,
    /// Updates written, for unique timestamped directory names.
    generation: u64,
    /// The last failed update, logged once.
    failed: Option<String>,
}

/// A Secret volume's files: path in the volume -> (bytes, mode).
type Files = BTreeMap<String, (Vec<u8>, u32)>;

impl SecretVolume {
    /// The files `secret` (`None`: it does not exist) projects into this
    /// volume: the listed items (each key must exist unless the volume is
    /// optional), or every key; file modes from the item, else the
    /// volume's default, plus group read with an `fsGroup` (the kubelet's
    /// ownership change for read-only volumes).
    fn project(&self, secret: Option<&Secret>) -> Result<Files> {
        let data = match secret {
            Some(s) => s.data.clone().unwrap_or_default(),
            None if self.optional => BTreeMap::new(),
            None => anyhow::bail!("secret {}/{} not found", self.namespace, self.secret),
        };
        let group_read = if self.fs_group.is_some() { 0o440 } else { 0 };
        let mut files = Files::new();
        match &self.items {
            Some(items) => {
                for item in items {
                    let Some(bytes) = data.get(&item.key) else {
                        if self.optional {
                            continue;
                        }
                        anyhow::bail!(
                            "secret {}/{} has no key {}",
                            self.namespace,
                            self.secret,
                            item.key
                        );
                    };
                    let mode = item.mode.map_or(self.default_mode, |m| m as u32);
                    files.insert(item.path.clone(), (bytes.0.clone(), mode | group_read));
                }
            }
            None => {
                for (key, bytes) in data {
                    files.insert(key, (bytes.0, self.default_mode | group_read));
                }
            }
        }
        for path in files.keys() {
            anyhow::ensure!(
                !path.is_empty()
                    && !path.starts_with('/')
                    && !path.starts_with("..")
                    && Path::new(path)
                        .components()
                        .all(|c| matches!(c, std::path::Component::Normal(_))),
                "secret volume path {path:?} is not a relative path inside the volume"
            );
        }
        Ok(files)
    }

    /// Writes `files` the kubelet's way: a new timestamped directory, a
    /// `..data` symlink renamed over the old one (atomic: a reader opening
    /// `<dir>/<key>` gets the old or the new file, whole), a `<key>` ->
    /// `..data/<key>` symlink per top-level name, then the old directory and
    /// stale names go.
    fn write(&mut self, files: Files) -> std::io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt, symlink};
        let mkdir = |d: &Path| {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(d)
        };
        mkdir(&self.dir)?;
        self.generation += 1;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ts = format!(
            "..{}.{:09}.{}",
            stamp.as_secs(),
            stamp.subsec_nanos(),
            self.generation
        );
        let ts_dir = self.dir.join(&ts);
        mkdir(&ts_dir)?;
        for (path, (bytes, mode)) in &files {
            let file = ts_dir.join(path);
            if let Some(parent) = file.parent() {
                mkdir(parent)?;
            }
            std::fs::write(&file, bytes)?;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(*mode))?;
            if let Some(gid) = self.fs_group {
                match std::os::unix::fs::chown(&file, None, Some(gid)) {
                    // Not root: the server runs as this user and cannot
                    // drop, so the file is readable as it is.
                    Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {}
                    other => other?,
                }
            }
        }
        let data = self.dir.join("..data");
        let old = std::fs::read_link(&data).ok();
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        symlink(&ts, &tmp)?;
        std::fs::rename(&tmp, &data)?;
        let tops: BTreeSet<String> = files
            .keys()
            .filter_map(|p| p.split('/').next().map(String::from))
            .collect();
        for top in &tops {
            let link = self.dir.join(top);
            if std::fs::symlink_metadata(&link).is_err() {
                symlink(format!("..data/{top}"), &link)?;
            }
        }
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !name.starts_with("..") && !tops.contains(&name) {
                std::fs::remove_file(self.dir.join(&name))?;
            }
        }
        if let Some(old) = old
            && old.as_os_str() != ts.as_str()
        {
            std::fs::remove_dir_all(self.dir.join(old))?;
        }
        self.files = files;
        Ok(())
    }

    /// Writes the volume again if `secret` now projects other files; a
    /// failure keeps what is there (as the kubelet does) and is logged once.
    fn refresh(&mut self, pod: &str, secret: Option<&Secret>) {
        let result = self.project(secret).and_then(|files| {
            if files != self.files {
                self.write(files)?;
                info!(%pod, secret = %self.secret, dir = %self.dir.display(),
                      "secret changed: volume rewritten");
            }
            Ok(())
        });
        match result {
            Ok(()) => self.failed = None,
            Err(e) => {
                let e = format!("{e:#}");
                if self.failed.as_ref() != Some(&e) {
                    warn!(%pod, secret = %self.secret, "secret volume not updated: {e}");
                    self.failed = Some(e);
                }
            }
        }
    }
}

/// `value` with a leading mount path (`at`, or `at/...`) replaced by the
/// directory it is materialized in.
fn rewrite(value: &str, mounts: &[(String, PathBuf)]) -> String {
    for (at, dir) in mounts {
        let at = at.trim_end_matches('/');
        if value == at {
            return dir.display().to_string();
        }
        if let Some(rest) = value.strip_prefix(at).and_then(|r| r.strip_prefix('/')) {
            return dir.join(rest).display().to_string();
        }
    }
    value.to_string()
}

/// A readiness probe's result, reported by the task that ran it.
struct Probed {
    uid: String,
    ok: bool,
}

/// A server's exit, reported by the task that waits on it.
struct Exit {
    uid: String,
    status: std::io::Result<ExitStatus>,
}

struct Runner {
    args: Args,
    server_bin: PathBuf,
    /// Root of the pods' Secret volumes.
    volume_dir: PathBuf,
    client: Client,
    servers: HashMap<String, Server>,
    /// Pod UID -> (earliest next start, current backoff) after a crash or a
    /// failed start.
    backoff: HashMap<String, (Instant, Duration)>,
    /// Pods already reported as waiting for their IP (logged once).
    waiting: HashSet<String>,
    exits: mpsc::UnboundedSender<Exit>,
    probes: mpsc::UnboundedSender<Probed>,
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
    /// Brings the servers in line with the pods in the store, and their
    /// Secret volumes in line with the Secrets.
    async fn reconcile(&mut self, pods: &[Arc<Pod>], secrets: &Store<Secret>) {
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

        // Restart the servers whose pods' test nofile changed.
        for (uid, s) in &mut self.servers {
            let Some(pod) = by_uid.get(uid) else { continue };
            if s.term.is_some() || test_nofile(pod) == s.nofile {
                continue;
            }
            info!(pod = %s.pod, pid = s.pid, nofile = ?test_nofile(pod),
                  "{TEST_RLIMIT_NOFILE} changed: SIGTERM, then a restart");
            signal_pid(s.pid, libc::SIGTERM);
            s.term = Some((now, now + s.grace));
        }

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

        self.probe(now, &by_uid).await;

        // Secrets that changed reach the volumes of running servers.
        for s in self.servers.values_mut().filter(|s| s.term.is_none()) {
            for v in &mut s.volumes {
                let key = ObjectRef::<Secret>::new(&v.secret).within(&v.namespace);
                // Only watched Secrets; a deleted one keeps its files, as
                // the kubelet keeps them.
                if let Some(secret) = secrets.get(&key) {
                    v.refresh(&s.pod, Some(&secret));
                }
            }
        }
    }

    /// Starts the readiness probes that are due, and writes a readiness
    /// that changed to its pod's status. A failed write is retried at the
    /// next reconcile.
    async fn probe(&mut self, now: Instant, pods: &HashMap<String, &Pod>) {
        for (uid, s) in &mut self.servers {
            let Some(r) = s.readiness.as_mut().filter(|_| s.term.is_none()) else {
                continue;
            };
            if r.due(now) {
                r.started(now);
                let (probe, probes, uid) = (r.probe.clone(), self.probes.clone(), uid.clone());
                tokio::task::spawn_blocking(move || {
                    let ok = probe.call();
                    let _ = probes.send(Probed { uid, ok });
                });
            }
            let (Some(ready), Some(pod)) = (r.ready(), pods.get(uid)) else {
                continue;
            };
            if s.reported == Some(ready) {
                continue;
            }
            let api: Api<Pod> =
                Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            let patch = Patch::Merge(probe::status_patch(pod, ready, now));
            match api
                .patch_status(&pod.name_any(), &PatchParams::default(), &patch)
                .await
            {
                Ok(_) => {
                    info!(pod = %s.pod, ready, "readiness probe: pod status written");
                    s.reported = Some(ready);
                }
                Err(e) => warn!(pod = %s.pod, ready, "readiness not written: {e}"),
            }
        }
    }

    /// Counts a readiness probe's result.
    fn probed(&mut self, p: Probed) {
        if let Some(r) = self
            .servers
            .get_mut(&p.uid)
            .and_then(|s| s.readiness.as_mut())
        {
            r.observe(p.ok);
        }
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

    #[allow(unsafe_code)] // pre_exec(prctl, setrlimit) for PR_SET_PDEATHSIG and the test nofile
    async fn start(&mut self, uid: &str, pod: &Pod, ip: &str) -> Result<()> {
        let spec = pod.spec.as_ref().context("pod has no spec")?;
        let container = spec
            .containers
            .iter()
            .find(|c| c.name == self.args.container)
            .or_else(|| spec.containers.first())
            .context("pod has no containers")?;
        let volumes = match self.materialize(uid, pod, container).await {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_dir_all(self.volume_dir.join(uid));
                return Err(e);
            }
        };
        let mounts: Vec<(String, PathBuf)> = container
            .volume_mounts
            .iter()
            .flatten()
            .filter_map(|m| {
                let dir = self.volume_dir.join(uid).join(&m.name);
                volumes
                    .iter()
                    .any(|v| v.dir == dir)
                    .then(|| (m.mount_path.clone(), dir))
            })
            .collect();
        let env: BTreeMap<String, String> = self
            .resolve_env(pod, container)
            .await?
            .into_iter()
            .map(|(k, v)| (k, rewrite(&v, &mounts)))
            .collect();
        let args: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|a| rewrite(a, &mounts))
            .collect();
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
        cmd.args(&args)
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
        let nofile = test_nofile(pod);
        // SAFETY: prctl and setrlimit are async-signal-safe; nothing else
        // runs in the child.
        unsafe {
            // The server dies with the runner, even if the runner is killed.
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if let Some(n) = nofile {
                    let lim = libc::rlimit {
                        rlim_cur: n as libc::rlim_t,
                        rlim_max: n as libc::rlim_t,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // Out of the bounding set: a server exec'd as root gets
                    // no CAP_SYS_RESOURCE to raise the limit back.
                    libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0);
                }
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
        let readiness =
            probe::Probe::of(container, ip).map(|p| probe::Readiness::new(p, Instant::now()));
        info!(pod = %key, pid, %ip, log = %log_path.display(), ?nofile,
              probe = ?readiness.as_ref().map(|r| &r.probe.url), "started c10m-server");
        self.servers.insert(
            uid.to_string(),
            Server {
                pod: key,
                ip: ip.to_string(),
                pid,
                grace,
                term: None,
                killed: false,
                volumes,
                nofile,
                readiness,
                reported: probe::pod_ready(pod),
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

    /// Materializes the Secret volumes `container` mounts (read from the
    /// API now) under `<volume dir>/<pod uid>/<volume name>`. A missing
    /// Secret or key is an error unless the volume is optional (the kubelet
    /// would not start the container either).
    async fn materialize(
        &self,
        uid: &str,
        pod: &Pod,
        container: &Container,
    ) -> Result<Vec<SecretVolume>> {
        let ns = pod.namespace().unwrap_or_default();
        let spec = pod.spec.as_ref().context("pod has no spec")?;
        let fs_group = spec
            .security_context
            .as_ref()
            .and_then(|s| s.fs_group)
            .and_then(|g| u32::try_from(g).ok());
        let mut out = Vec::new();
        for m in container.volume_mounts.iter().flatten() {
            let Some(source) = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .and_then(|v| v.secret.as_ref())
            else {
                continue;
            };
            if m.sub_path.is_some() || m.sub_path_expr.is_some() {
                warn!(pod = %pod_key(pod), volume = %m.name, "subPath mounts are not supported; not materialized");
                continue;
            }
            let name = source.secret_name.clone().unwrap_or_default();
            let mut v = SecretVolume {
                namespace: ns.clone(),
                secret: name.clone(),
                items: source.items.clone(),
                default_mode: source
                    .default_mode
                    .map_or(SECRET_DEFAULT_MODE, |m| m as u32),
                optional: source.optional == Some(true),
                fs_group,
                dir: self.volume_dir.join(uid).join(&m.name),
                files: Files::new(),
                generation: 0,
                failed: None,
            };
            let api: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
            let secret = api.get_opt(&name).await?;
            let files = v
                .project(secret.as_ref())
                .with_context(|| format!("volume {}", m.name))?;
            v.write(files)
                .with_context(|| format!("writing volume {} to {}", m.name, v.dir.display()))?;
            out.push(v);
        }
        Ok(out)
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

    /// Records a server's exit; schedules a restart if its pod still wants
    /// one (which materializes its volumes afresh).
    fn exited(&mut self, exit: Exit) {
        let Some(s) = self.servers.remove(&exit.uid) else {
            return;
        };
        if !s.volumes.is_empty() {
            let _ = std::fs::remove_dir_all(self.volume_dir.join(&exit.uid));
        }
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
    // The default directory is this process's own: emptied at start and
    // removed at exit. A given one is left as it is; only the pods'
    // directories in it are removed as their servers stop.
    let own_volume_dir = args.volume_dir.is_none();
    let volume_dir = args
        .volume_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/c10m-pod-runner.{}", std::process::id())));
    {
        use std::os::unix::fs::DirBuilderExt;
        if own_volume_dir {
            let _ = std::fs::remove_dir_all(&volume_dir);
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&volume_dir)
            .with_context(|| format!("create {}", volume_dir.display()))?;
    }
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
    // The Secrets of the same selector (the operator's admin Secrets), so a
    // rotated one reaches the volumes of the servers that mount it.
    let (secrets, secret_writer) = reflector::store::<Secret>();
    let secret_api: Api<Secret> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut secret_events = std::pin::pin!(reflector(
        secret_writer,
        watcher(
            secret_api,
            watcher::Config::default().labels(&args.selector)
        )
        .default_backoff()
    ));
    let (tx, mut exits) = mpsc::unbounded_channel();
    let (probe_tx, mut probes) = mpsc::unbounded_channel();
    let shutdown_timeout = Duration::from_secs(args.shutdown_timeout_secs);
    info!(selector = %args.selector, server = %server_bin.display(),
          logs = %args.log_dir.display(), volumes = %volume_dir.display(),
          "c10m-pod-runner watching pods and their Secrets");
    let mut runner = Runner {
        args,
        server_bin,
        volume_dir: volume_dir.clone(),
        client,
        servers: HashMap::new(),
        backoff: HashMap::new(),
        waiting: HashSet::new(),
        exits: tx,
        probes: probe_tx,
    };
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // A quarter of the rendered probe period (1 s), so a probe starts
    // within 250 ms of being due.
    let mut tick = tokio::time::interval(Duration::from_millis(250));
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
            Some(ev) = secret_events.next() => {
                if let Err(e) = ev {
                    warn!("secret watch: {e}");
                }
            }
            Some(exit) = exits.recv() => runner.exited(exit),
            Some(p) = probes.recv() => runner.probed(p),
            _ = tick.tick() => {}
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if ready {
            runner.reconcile(&store.state(), &secrets).await;
        }
    }
    runner.shutdown(&mut exits, shutdown_timeout).await;
    if own_volume_dir {
        let _ = std::fs::remove_dir_all(&volume_dir);
    }
    info!("c10m-pod-runner stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::os::unix::fs::MetadataExt;

    fn secret(token: &str) -> Secret {
        Secret {
            data: Some(BTreeMap::from([
                ("token".to_string(), ByteString(token.as_bytes().to_vec())),
                ("other".to_string(), ByteString(b"x".to_vec())),
            ])),
            ..Default::default()
        }
    }

    fn volume(dir: &Path, items: Option<Vec<KeyToPath>>, fs_group: Option<u32>) -> SecretVolume {
        SecretVolume {
            namespace: "ns".into(),
            secret: "edge-admin".into(),
            items,
            default_mode: 0o440,
            optional: false,
            fs_group,
            dir: dir.to_path_buf(),
            files: Files::new(),
            generation: 0,
            failed: None,
        }
    }

    fn token_item() -> Option<Vec<KeyToPath>> {
        Some(vec![KeyToPath {
            key: "token".into(),
            path: "token".into(),
            mode: None,
        }])
    }

    #[test]
    fn a_secret_volume_is_written_and_swapped_the_kubelets_way() {
        let root =
            std::env::temp_dir().join(format!("c10m-pod-runner-test-{}", std::process::id()));
        let dir = root.join("uid").join("admin-token");
        let root_user = std::fs::metadata("/proc/self").unwrap().uid() == 0;
        let mut v = volume(&dir, token_item(), Some(65532));
        let files = v.project(Some(&secret("old"))).unwrap();
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            ["token"],
            "only the listed key"
        );
        v.write(files).unwrap();
        let token = dir.join("token");
        assert_eq!(
            std::fs::read_link(&token).unwrap(),
            Path::new("..data/token")
        );
        let first = std::fs::read_link(dir.join("..data")).unwrap();
        assert!(first.to_string_lossy().starts_with(".."), "{first:?}");
        assert_eq!(std::fs::read_to_string(&token).unwrap(), "old");
        let meta = std::fs::metadata(&token).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o440);
        if root_user {
            assert_eq!(meta.gid(), 65532, "fsGroup is the file's group");
        }

        // An update: a new directory behind ..data, the old one gone.
        v.refresh("ns/pod", Some(&secret("new")));
        assert_eq!(std::fs::read_to_string(&token).unwrap(), "new");
        let second = std::fs::read_link(dir.join("..data")).unwrap();
        assert_ne!(first, second);
        assert!(!dir.join(&first).exists());
        // Nothing changed: nothing written.
        v.refresh("ns/pod", Some(&secret("new")));
        assert_eq!(std::fs::read_link(dir.join("..data")).unwrap(), second);
        // The key gone: the files stay, the failure is kept once.
        let mut lost = secret("x");
        lost.data.as_mut().unwrap().remove("token");
        v.refresh("ns/pod", Some(&lost));
        assert_eq!(std::fs::read_to_string(&token).unwrap(), "new");
        assert!(v.failed.as_deref().unwrap().contains("no key token"));
        let names: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            BTreeSet::from([
                "..data".to_string(),
                "token".to_string(),
                second.display().to_string()
            ])
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn projection_follows_the_volume_source() {
        let dir = Path::new("/nonexistent");
        // Every key without items; modes from the default, group read with fsGroup.
        let mut all = volume(dir, None, None);
        all.default_mode = 0o400;
        let files = all.project(Some(&secret("t"))).unwrap();
        assert_eq!(files["token"], (b"t".to_vec(), 0o400));
        assert_eq!(files["other"].1, 0o400);
        all.fs_group = Some(65532);
        assert_eq!(all.project(Some(&secret("t"))).unwrap()["token"].1, 0o440);
        // A missing Secret or key is an error unless optional.
        let mut v = volume(dir, token_item(), None);
        assert!(v.project(None).is_err());
        let mut lost = secret("x");
        lost.data.as_mut().unwrap().remove("token");
        assert!(v.project(Some(&lost)).is_err());
        v.optional = true;
        assert!(v.project(None).unwrap().is_empty());
        assert!(v.project(Some(&lost)).unwrap().is_empty());
        // Paths stay inside the volume.
        for bad in ["../x", "/etc/x", "a/../../x", ""] {
            let v = volume(
                dir,
                Some(vec![KeyToPath {
                    key: "token".into(),
                    path: bad.into(),
                    mode: None,
                }]),
                None,
            );
            assert!(v.project(Some(&secret("t"))).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn paths_under_a_mount_are_rewritten_into_its_directory() {
        let mounts = vec![(
            "/var/run/c10m/admin".to_string(),
            PathBuf::from("/tmp/r/uid/admin-token"),
        )];
        assert_eq!(
            rewrite("/var/run/c10m/admin/token", &mounts),
            "/tmp/r/uid/admin-token/token"
        );
        assert_eq!(
            rewrite("/var/run/c10m/admin", &mounts),
            "/tmp/r/uid/admin-token"
        );
        assert_eq!(
            rewrite("/var/run/c10m/administrator", &mounts),
            "/var/run/c10m/administrator"
        );
        assert_eq!(rewrite("7000", &mounts), "7000");
    }
}
