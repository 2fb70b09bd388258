//! Helpers shared by the end-to-end tests: real `kubectl` against the local
//! control plane (`tests/cluster/up.sh`), a real `c10m-operator` process per
//! test namespace, polling with deadlines.
//!
//! The cluster is found through `C10M_KUBECONFIG`, else the stable path the
//! cluster scripts write (`$C10M_CACHE/cluster/kubeconfig`, default
//! `~/.cache/c10m/cluster/kubeconfig`). Tests fail (never skip) when it is
//! missing: run them with `make test`, which brings the plane up.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod fault_proxy;

/// Root of the workspace.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Admin kubeconfig of the cluster under test.
pub fn kubeconfig() -> PathBuf {
    if let Ok(p) = std::env::var("C10M_KUBECONFIG") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("C10M_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let base = std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache"));
            base.join("c10m")
        });
    let path = cache.join("cluster/kubeconfig");
    assert!(
        path.exists(),
        "no cluster: {} is missing. Run the end-to-end tests with `make test` (or start the plane with tests/cluster/up.sh)",
        path.display()
    );
    path
}

/// kubectl with the test kubeconfig, started with `stdin` written to it
/// (then closed) and its output piped.
fn spawn_kubectl(args: &[&str], stdin: Option<&str>) -> std::process::Child {
    let mut child = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl is installed");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    child
}

/// Runs kubectl with the test kubeconfig and optional stdin.
pub fn kubectl_with(args: &[&str], stdin: Option<&str>) -> Output {
    spawn_kubectl(args, stdin).wait_with_output().unwrap()
}

/// Runs kubectl and returns stdout; panics with stderr on failure.
pub fn kubectl(args: &[&str]) -> String {
    let out = kubectl_with(args, None);
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// [`kubectl_with`] that gives up after `timeout`: the process is killed
/// and `None` returned. Stdout and stderr are read on their own threads, so
/// a chatty kubectl never blocks on a full pipe.
pub fn kubectl_within(args: &[&str], stdin: Option<&str>, timeout: Duration) -> Option<Output> {
    let mut child = spawn_kubectl(args, stdin);
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = read(Box::new(child.stdout.take().unwrap()));
    let err = read(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() >= timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    status.map(|status| Output {
        status,
        stdout,
        stderr,
    })
}

/// `kubectl apply -f -` of `manifest` in `ns`; returns (success, stdout + stderr).
pub fn apply(ns: &str, manifest: &str) -> (bool, String) {
    let out = kubectl_with(&["apply", "-n", ns, "-f", "-"], Some(manifest));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A bundled-server fleet of 2-CPU shards on the KWOK `edge` pool at
/// $2.59/h per node, at least `min_shards` of them; `extra` is appended to
/// `spec` (two-space indented YAML).
pub fn edge_fleet_manifest(name: &str, connections: i64, min_shards: u32, extra: &str) -> String {
    format!(
        r#"
apiVersion: c10m.dev/v1alpha1
kind: ConnectionFleet
metadata:
  name: {name}
spec:
  connections: {connections}
  backend:
    model: epoll
  node:
    pricePerHour: "2.59"
  shard:
    cpus: 2
    minShards: {min_shards}
  placement:
    nodeSelector:
      c10m.dev/pool: edge
{extra}"#
    )
}

/// One of a fleet's pods as the suites see it: only pods with an IP.
#[derive(Clone, Debug)]
pub struct ShardPod {
    /// Pod name.
    pub name: String,
    /// Pod IP.
    pub ip: String,
    /// Its `Ready` condition is True and it is not being deleted.
    pub ready: bool,
    /// It is being deleted (`deletionTimestamp` set).
    pub terminating: bool,
    /// Its `pod-template-hash`: which ReplicaSet (revision) it runs.
    pub hash: String,
    /// The node it is bound to (`spec.nodeName`).
    pub node: String,
    /// Its annotations.
    pub annotations: Value,
}

/// The pods of fleet `name` in `ns` that have an IP, as [`ShardPod`]s.
pub fn shard_pods(ns: &str, name: &str) -> Vec<ShardPod> {
    fleet_pods(ns, name)
        .iter()
        .filter_map(|p| {
            let terminating = !p["metadata"]["deletionTimestamp"].is_null();
            let ready =
                !terminating && condition(p, "Ready").is_some_and(|c| c["status"] == "True");
            Some(ShardPod {
                name: p["metadata"]["name"].as_str()?.to_string(),
                ip: p["status"]["podIP"].as_str()?.to_string(),
                ready,
                terminating,
                hash: p["metadata"]["labels"]["pod-template-hash"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                node: p["spec"]["nodeName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                annotations: p["metadata"]["annotations"].clone(),
            })
        })
        .collect()
}

/// Replaces the load generator's `--targets-file` at `path` with `targets`
/// (`ip:port` lines) at once (write, then rename), so c10m-loadgen never
/// reads half a list. An empty list leaves the file as it was.
pub fn write_targets(path: &Path, targets: &[String]) {
    if targets.is_empty() {
        return;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, targets.join("\n") + "\n").unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `kubectl get -o json` of one object, `None` when it does not exist.
pub fn get_json(ns: &str, kind: &str, name: &str) -> Option<Value> {
    let out = kubectl_with(&["get", "-n", ns, kind, name, "-o", "json"], None);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// Waits up to `timeout` until fleet `name` in `ns` is Ready for its
/// current generation, and returns it.
pub fn wait_fleet_ready(ns: &str, name: &str, timeout: Duration) -> Value {
    wait_condition(ns, name, "Ready", "True", None, timeout)
}

/// Waits up to `timeout` until fleet `name` in `ns` has its condition
/// `type_` at `status` (`"True"`, `"False"`), with `reason` when given, for
/// its current generation, and returns the fleet.
pub fn wait_condition(
    ns: &str,
    name: &str,
    type_: &str,
    status: &str,
    reason: Option<&str>,
    timeout: Duration,
) -> Value {
    let what = format!("fleet {name} {type_}={status} {}", reason.unwrap_or(""));
    wait_seeing(&what, timeout, || {
        let f = get_json(ns, "connectionfleet", name).ok_or("no fleet")?;
        let c = condition(&f, type_).ok_or_else(|| format!("no {type_} condition"))?;
        let current = f["status"]["observedGeneration"] == f["metadata"]["generation"];
        if !(c["status"] == status && reason.is_none_or(|r| c["reason"] == r) && current) {
            return Err(format!(
                "{c} at observedGeneration {} of {}",
                f["status"]["observedGeneration"], f["metadata"]["generation"]
            ));
        }
        Ok(f)
    })
}

/// The pods of fleet `fleet` in `ns` (label `c10m.dev/fleet`), as
/// `kubectl get -o json` items; empty when kubectl fails.
pub fn fleet_pods(ns: &str, fleet: &str) -> Vec<Value> {
    let out = kubectl_with(
        &[
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            &format!("c10m.dev/fleet={fleet}"),
            "-o",
            "json",
        ],
        None,
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .ok()
        .and_then(|v| v["items"].as_array().cloned())
        .unwrap_or_default()
}

/// Polls `f` every 250 ms until it returns `Some`, or panics after `timeout`
/// with `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    wait_seeing(what, timeout, || f().ok_or_else(String::new))
}

/// Polls `f` every 250 ms until it returns `Ok`, or panics after `timeout`
/// with `what` and what the last `Err` said it saw.
pub fn wait_seeing<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        let seen = match f() {
            Ok(v) => return v,
            Err(seen) => seen,
        };
        if start.elapsed() >= timeout {
            match seen.as_str() {
                "" => panic!("timed out after {timeout:?} waiting for {what}"),
                seen => panic!("timed out after {timeout:?} waiting for {what}; last seen: {seen}"),
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Applies the CRD once per test process and waits until it is Established.
pub fn ensure_crd() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let crd = workspace().join("crds/connectionfleet.yaml");
        kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            crd.to_str().unwrap(),
        ]);
        // Polled, not `kubectl wait --for=condition=Established`: on a CRD
        // created a moment ago, before the API server has written any
        // condition, that kubectl (1.32) fails at once (".status.conditions
        // accessor error: <nil> is of the type <nil>"), as `make test` saw
        // once on 2026-12-07.
        // (A cluster-scoped object: `get_json`'s namespace is ignored.)
        wait_seeing(
            "CRD connectionfleets.c10m.dev Established",
            Duration::from_secs(60),
            || {
                let crd =
                    get_json("default", "crd", "connectionfleets.c10m.dev").ok_or("no CRD")?;
                match condition(&crd, "Established") {
                    Some(c) if c["status"] == "True" => Ok(()),
                    c => Err(format!("Established: {c:?}")),
                }
            },
        );
    });
}

/// The chart's rollout admission policy (`templates/rollout-admission.yaml`,
/// rendered by helm for the namespaced scope of `ns`, so that it binds
/// only there and never meets a release another test installs): refuses a
/// fleet Deployment's pod-template change while the operator marks a
/// rollout step draining. Deleted when dropped.
pub struct RolloutAdmission(String);

impl RolloutAdmission {
    /// Renders and applies it. The API server enforces it once its policy
    /// informer has synced (about a second), well before a fleet rolls.
    pub fn install(ns: &str) -> Self {
        let chart = workspace().join("charts/c10m-operator");
        let watch = format!("watchNamespace={ns}");
        let (ok, rendered) = helm(&[
            "template",
            "c10m",
            chart.to_str().unwrap(),
            "-n",
            ns,
            "--kube-version",
            "1.35.4",
            "--set",
            &watch,
            "--set",
            "crd.manage=false",
            "--show-only",
            "templates/rollout-admission.yaml",
        ]);
        assert!(ok, "{rendered}");
        let out = kubectl_with(&["apply", "-f", "-"], Some(&rendered));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        RolloutAdmission(rendered)
    }
}

impl Drop for RolloutAdmission {
    fn drop(&mut self) {
        let _ = kubectl_with(&["delete", "--ignore-not-found", "-f", "-"], Some(&self.0));
    }
}

/// How every e2e namespace's name begins ([`Namespace::create`]).
pub const E2E_NAMESPACE_PREFIX: &str = "c10m-e2e-";

/// A namespace that is deleted when dropped.
pub struct Namespace(pub String);

impl Namespace {
    /// Creates `c10m-e2e-<prefix>-<pid>`.
    pub fn create(prefix: &str) -> Self {
        let name = format!("{E2E_NAMESPACE_PREFIX}{prefix}-{}", std::process::id());
        kubectl(&["create", "namespace", &name]);
        Namespace(name)
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = kubectl_with(&["delete", "namespace", &self.0, "--wait=false"], None);
    }
}

/// The operator binary: `C10M_OPERATOR_BIN`, else
/// `target/debug/c10m-operator` (built by `make test`).
pub fn operator_bin() -> PathBuf {
    let bin = std::env::var("C10M_OPERATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace().join("target/debug/c10m-operator"));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p c10m-operator` (make test does)",
        bin.display()
    );
    bin
}

/// A `c10m-operator run --namespace NS` process, killed when dropped. Its
/// log goes to `target/e2e-logs/<namespace>.log`.
pub struct Operator {
    child: Child,
    /// Where the operator logs.
    pub log: PathBuf,
}

impl Operator {
    /// Starts the operator binary (`C10M_OPERATOR_BIN`, else
    /// `target/debug/c10m-operator`, built by `make test`) for `ns`, as admin.
    pub fn start(ns: &str) -> Self {
        Self::spawn(
            &["run", "--namespace", ns, "--metrics-addr", "127.0.0.1:0"],
            &kubeconfig(),
            ns,
        )
    }

    /// Starts the operator with `args` and `kubeconfig`, logging to
    /// `target/e2e-logs/<log_name>.log`.
    pub fn spawn(args: &[&str], kubeconfig: &Path, log_name: &str) -> Self {
        let bin = operator_bin();
        let logs = workspace().join("target/e2e-logs");
        std::fs::create_dir_all(&logs).unwrap();
        let log = logs.join(format!("{log_name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(bin)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start c10m-operator");
        Operator { child, log }
    }

    /// Starts an operator for `ns` that elects its leader on Lease `lease`
    /// in `ns` (`--leader-elect`, the chart's default), logging to
    /// `target/e2e-logs/<log_name>.log`.
    pub fn elected(ns: &str, lease: &str, log_name: &str) -> Self {
        Self::elected_with(ns, lease, log_name, &kubeconfig())
    }

    /// [`Operator::elected`] talking to the API server through
    /// `kubeconfig` (e.g. one pointing at a [`fault_proxy::FaultProxy`]).
    pub fn elected_with(ns: &str, lease: &str, log_name: &str, kubeconfig: &Path) -> Self {
        Self::spawn(
            &[
                "run",
                "--namespace",
                ns,
                "--metrics-addr",
                "127.0.0.1:0",
                "--leader-elect=true",
                "--leader-elect-lease",
                lease,
                "--leader-elect-namespace",
                ns,
            ],
            kubeconfig,
            log_name,
        )
    }

    /// This process holds Lease `lease` in `ns` (its holder identity is
    /// `<host>_<pid>_<random>`).
    pub fn holds(&self, ns: &str, lease: &str) -> bool {
        get_json(ns, "lease", lease)
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
            .is_some_and(|h| h.contains(&format!("_{}_", self.pid())))
    }

    /// The operator's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the process (no clean-up, no Lease release) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `None` while the process runs, else how it ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cluster's state directory (`$C10M_STATE`, else the directory of the
/// kubeconfig the cluster scripts write there): `pids/`, `logs/`, `pki/`.
pub fn state_dir() -> PathBuf {
    if let Ok(d) = std::env::var("C10M_STATE") {
        return PathBuf::from(d);
    }
    kubeconfig()
        .parent()
        .expect("the kubeconfig lives in the state directory")
        .to_path_buf()
}

/// Pid of a control-plane component (`kube-apiserver`, `etcd`, ...) from
/// `$C10M_STATE/pids/<component>.pid`.
pub fn component_pid(component: &str) -> u32 {
    let path = state_dir().join("pids").join(format!("{component}.pid"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", path.display()))
}

/// CPU time (user + system) process `pid` has used so far, from
/// `/proc/<pid>/stat`.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // Fields after the command (which may hold spaces) in parentheses:
    // state is field 3, utime 14 and stime 15.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    #[allow(unsafe_code)]
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_secs_f64(ticks as f64 / hz as f64)
}

/// Share of one core process `pid` used over `window` (1.0 = one core busy).
pub fn cpu_share(pid: u32, window: Duration) -> f64 {
    let before = cpu_time(pid);
    let start = Instant::now();
    std::thread::sleep(window);
    let used = cpu_time(pid).saturating_sub(before);
    used.as_secs_f64() / start.elapsed().as_secs_f64()
}

/// The condition `type_` of an object's status, if present.
pub fn condition<'a>(obj: &'a Value, type_: &str) -> Option<&'a Value> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Events in `ns` whose regarding/involved object is `name`, as (type, reason, note).
pub fn events_for(ns: &str, name: &str) -> Vec<(String, String, String)> {
    events_where(ns, |regarding| regarding["name"] == name)
}

/// Events in `ns` regarding the ConnectionFleet `name` only (not its
/// Deployment or Service, which share its name), as (type, reason, note).
pub fn fleet_events(ns: &str, name: &str) -> Vec<(String, String, String)> {
    events_where(ns, |regarding| {
        regarding["name"] == name && regarding["kind"] == "ConnectionFleet"
    })
}

fn events_where(ns: &str, regarding: impl Fn(&Value) -> bool) -> Vec<(String, String, String)> {
    let out = kubectl(&["get", "events.events.k8s.io", "-n", ns, "-o", "json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| regarding(&e["regarding"]))
        .map(|e| {
            (
                e["type"].as_str().unwrap_or_default().to_string(),
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["note"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Directory of the Go-built binaries (helm, kwok, ...): `C10M_BIN_DIR`
/// (set by tests/run.sh), else what `tests/cluster/build.sh` prints.
pub fn bin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Ok(d) = std::env::var("C10M_BIN_DIR") {
            return PathBuf::from(d);
        }
        let out = Command::new("bash")
            .arg(workspace().join("tests/cluster/build.sh"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "build.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(
            String::from_utf8(out.stdout)
                .unwrap()
                .lines()
                .last()
                .unwrap()
                .trim(),
        )
    })
    .clone()
}

/// Runs helm with the test kubeconfig; returns (success, stdout + stderr).
pub fn helm(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin_dir().join("helm"))
        .args(args)
        .env("KUBECONFIG", kubeconfig())
        .output()
        .expect("helm runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A kubeconfig that authenticates as ServiceAccount `sa` in `ns` with a
/// token from `kubectl create token`, written to `target/e2e-logs/<sa>.kubeconfig`.
pub fn service_account_kubeconfig(ns: &str, sa: &str) -> PathBuf {
    let token = kubectl(&["create", "token", sa, "-n", ns, "--duration=2h"]);
    let admin: Value = serde_json::from_str(&kubectl(&[
        "config", "view", "--raw", "--minify", "-o", "json",
    ]))
    .unwrap();
    let cluster = &admin["clusters"][0]["cluster"];
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c10m", "cluster": {
            "server": cluster["server"],
            "certificate-authority-data": cluster["certificate-authority-data"],
        }}],
        "users": [{"name": sa, "user": {"token": token.trim()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c10m", "user": sa}}],
        "current-context": "sa",
    });
    let dir = workspace().join("target/e2e-logs");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{ns}-{sa}.kubeconfig"));
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    path
}

// ---------------------------------------------------------------- metrics harness
//
// Real Prometheus and real servers behind the fleets' pods (tests/cluster/
// prometheus.sh and pod-runner.sh). Both are shared by every test on the
// machine and left running; tests/run.sh and down.sh stop them.

/// Runs `bash tests/cluster/<script> <arg>`; panics with its output on failure.
/// Inside `cargo test` the harness binaries cargo built next to the test
/// (`target/debug/`) are used, so the scripts need not run cargo themselves.
fn harness_script(script: &str, arg: &str) -> String {
    let mut cmd = Command::new("bash");
    cmd.arg(workspace().join("tests/cluster").join(script))
        .arg(arg);
    if std::env::var_os("C10M_E2E_BIN_DIR").is_none()
        && let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
        && ["c10m-pod-runner", "c10m-prom-sd"]
            .iter()
            .all(|b| dir.join(b).is_file())
    {
        cmd.env("C10M_E2E_BIN_DIR", dir);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("run {script}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} {arg} failed:\n{text}");
    text
}

/// The harness's Prometheus: Debian's `prometheus` on 127.0.0.1:19090,
/// scraping every Running pod annotated `prometheus.io/scrape=true` every
/// 2 s, with labels `namespace`, `pod` and `fleet` (tests/cluster/prometheus.sh).
pub struct Prometheus;

impl Prometheus {
    /// Starts Prometheus unless it is already running (idempotent, safe to
    /// call from every test) and returns its URL, `http://127.0.0.1:19090`.
    pub fn ensure() -> String {
        harness_script("prometheus.sh", "start");
        Self::url()
    }

    /// Its URL (whether or not it runs).
    pub fn url() -> String {
        harness_script("prometheus.sh", "url").trim().to_string()
    }

    /// Stops it (for metric-outage tests; `ensure` starts it again, with
    /// its data kept).
    pub fn stop() {
        harness_script("prometheus.sh", "stop");
    }
}

/// The harness's pod runner: a real `c10m-server` bound to the IP of every
/// Running pod labelled `app.kubernetes.io/managed-by=c10m-operator`, with
/// the env of the pod's `server` container; SIGTERM when the pod goes away
/// (tests/cluster/pod-runner.sh). Servers' logs:
/// `$C10M_STATE/logs/pods/<namespace>_<pod>.log`.
pub struct PodRunner;

impl PodRunner {
    /// Starts the pod runner unless it is already running (idempotent).
    /// Needs `target/debug/c10m-server` (`make test` builds it).
    pub fn ensure() {
        harness_script("pod-runner.sh", "start");
    }

    /// Stops it, and with it every server it runs.
    pub fn stop() {
        harness_script("pod-runner.sh", "stop");
    }
}

/// A Prometheus instant query at `url` (e.g. from [`Prometheus::ensure`]):
/// one `(labels, value)` per series of a vector result (a scalar result is
/// one series without labels). Panics if Prometheus cannot be reached or
/// rejects the query; use [`try_prom_query`] to handle that.
pub fn prom_query(
    url: &str,
    promql: &str,
) -> Vec<(std::collections::BTreeMap<String, String>, f64)> {
    try_prom_query(url, promql).unwrap_or_else(|e| panic!("query {promql:?} at {url}: {e:#}"))
}

/// [`prom_query`] that returns errors (unreachable, HTTP or PromQL errors)
/// instead of panicking. Loopback URLs only; no proxy; 5 s timeout.
pub fn try_prom_query(
    url: &str,
    promql: &str,
) -> anyhow::Result<Vec<(std::collections::BTreeMap<String, String>, f64)>> {
    anyhow::ensure!(
        url.starts_with("http://127.") || url.starts_with("http://localhost"),
        "{url} is not a loopback URL"
    );
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let mut resp = agent
        .get(format!("{}/api/v1/query", url.trim_end_matches('/')))
        .query("query", promql)
        .call()?;
    let status = resp.status();
    let body: Value = serde_json::from_str(&resp.body_mut().read_to_string()?)?;
    anyhow::ensure!(
        status.is_success() && body["status"] == "success",
        "HTTP {status}: {body}"
    );
    let value = |v: &Value| -> anyhow::Result<f64> {
        let s = v[1].as_str().unwrap_or_default();
        s.parse::<f64>()
            .map_err(|e| anyhow::anyhow!("sample {s:?}: {e}"))
    };
    let data = &body["data"];
    Ok(match data["resultType"].as_str() {
        Some("vector") => data["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let labels = r["metric"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect();
                Ok((labels, value(&r["value"])?))
            })
            .collect::<anyhow::Result<_>>()?,
        Some("scalar") => vec![(Default::default(), value(&data["result"])?)],
        other => anyhow::bail!("unsupported result type {other:?} for {promql:?}"),
    })
}

/// A running `c10m-loadgen` (`target/debug/c10m-loadgen`, built by `make
/// test`) in its own process group, with `--quiet --hold=0` (it holds its
/// connections until stopped); SIGTERM through [`Loadgen::finish`] ends it
/// and yields its JSON report, dropping it kills it.
pub struct Loadgen(Option<Child>);

impl Loadgen {
    /// Starts `c10m-loadgen` with `args` (targets, protocol, connections,
    /// rate, ...).
    pub fn start(args: &[String]) -> Loadgen {
        let bin = workspace().join("target/debug/c10m-loadgen");
        assert!(
            bin.exists(),
            "{} missing: cargo build -p c10m-loadgen",
            bin.display()
        );
        let child = Command::new(bin)
            .args(["--hold=0", "--quiet"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            // Its own process group: the child processes it forks die with it.
            .process_group(0)
            .spawn()
            .expect("start c10m-loadgen");
        Loadgen(Some(child))
    }

    /// Stops the clients and returns their report.
    #[allow(unsafe_code)] // kill(2) on the child's process group
    pub fn finish(mut self) -> Value {
        let child = self.0.take().unwrap();
        // SAFETY: kill(2) on our own child's process group.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGTERM) };
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("loadgen report: {e}: {text}"))
    }
}

impl Drop for Loadgen {
    #[allow(unsafe_code)] // kill(2) on the child's process group
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // SAFETY: kill(2) on our own child's process group.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// Logging of the harness daemons (pod runner, Prometheus discovery):
/// `RUST_LOG` (default `info,kube=warn`) to stderr, colours only on a terminal.
pub fn init_stderr_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
