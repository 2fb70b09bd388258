//! The operator installed the way platform teams do (Helm), running with the
//! chart's ServiceAccount and RBAC, and behaving under GitOps tools.
//!
//! The chart's Deployment lands on a KWOK node where no container runs, so
//! each test runs the operator binary locally with the chart's arguments and
//! a token of the chart's ServiceAccount (`kubectl create token`).

use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use c10m_e2e::*;
use serde_json::Value;

const MINUTE: Duration = Duration::from_secs(60);

fn chart() -> String {
    workspace()
        .join("charts/c10m-operator")
        .to_string_lossy()
        .into_owned()
}

/// The chart allows one operator per namespace: at most one cluster-wide
/// release (its ClusterRoleBinding is `c10m-operator-cluster-wide`, one per
/// cluster), and none beside a release watching one namespace (issue 21,
/// item 11). Tests run in parallel threads, so a test holding a cluster-wide
/// release (or dry-running one) holds this lock alone ([`alone`]); tests
/// whose releases each watch their own namespace share it ([`beside_others`]).
/// Take it before creating releases, so that it is released after their
/// `helm uninstall`.
static RELEASES: RwLock<()> = RwLock::new(());

fn alone() -> RwLockWriteGuard<'static, ()> {
    let guard = RELEASES.write().unwrap_or_else(|e| e.into_inner());
    remove_stale_cluster_objects();
    guard
}

fn beside_others() -> RwLockReadGuard<'static, ()> {
    let guard = RELEASES.read().unwrap_or_else(|e| e.into_inner());
    remove_stale_cluster_objects();
    guard
}

/// The chart's cluster-scoped objects (ClusterRoles, ClusterRoleBindings)
/// left by an earlier run of these tests killed before its `helm uninstall`:
/// their release namespace (`c10m-e2e-*`) is gone or going. The namespace's
/// deletion never reaches them, and a scope binding left over would refuse
/// every cluster-wide release after it.
fn remove_stale_cluster_objects() {
    for kind in ["clusterrolebindings", "clusterroles"] {
        let list: Value = serde_json::from_str(&kubectl(&[
            "get",
            kind,
            "-l",
            "app.kubernetes.io/name=c10m-operator",
            "-o",
            "json",
        ]))
        .unwrap();
        for obj in list["items"].as_array().unwrap() {
            let Some(ns) =
                obj["metadata"]["annotations"]["meta.helm.sh/release-namespace"].as_str()
            else {
                continue;
            };
            if !ns.starts_with("c10m-e2e-") {
                continue;
            }
            let live = get_json("", "namespace", ns)
                .is_some_and(|n| n["status"]["phase"] != "Terminating");
            if !live {
                let name = obj["metadata"]["name"].as_str().unwrap();
                let _ = kubectl_with(&["delete", kind, name, "--ignore-not-found"], None);
            }
        }
    }
}

/// A Helm release of the chart in its own namespace, watching `fleet_ns`
/// (`None`: every namespace, with cluster-wide RBAC); uninstalled when dropped.
struct Release {
    name: String,
    ns: Namespace,
}

impl Release {
    fn install(name: &str, fleet_ns: Option<&str>, extra: &[&str]) -> (Self, String) {
        let (release, ok, out) = Self::try_install(name, fleet_ns, extra);
        assert!(ok, "helm install: {out}");
        (release, out)
    }

    /// `helm install`, which may be refused: (the release, whether helm
    /// succeeded, its output).
    fn try_install(name: &str, fleet_ns: Option<&str>, extra: &[&str]) -> (Self, bool, String) {
        let ns = Namespace::create(&format!("{name}-op"));
        let chart = chart();
        let watch = fleet_ns.map(|f| format!("watchNamespace={f}"));
        let mut args = vec!["install", name, &chart, "-n", &ns.0];
        if let Some(watch) = &watch {
            args.extend(["--set", watch.as_str()]);
        }
        args.extend_from_slice(extra);
        let (ok, out) = helm(&args);
        (
            Release {
                name: name.into(),
                ns,
            },
            ok,
            out,
        )
    }

    /// `helm upgrade` of this release with `--reuse-values` and `extra`.
    fn upgrade(&self, extra: &[&str]) -> (bool, String) {
        let chart = chart();
        let mut args = vec![
            "upgrade",
            &self.name,
            &chart,
            "-n",
            &self.ns.0,
            "--reuse-values",
        ];
        args.extend_from_slice(extra);
        helm(&args)
    }

    fn deployment(&self) -> Value {
        get_json(
            &self.ns.0,
            "deployment",
            &format!("{}-c10m-operator", self.name),
        )
        .expect("operator deployment")
    }

    /// The chart's container args, with the metrics address moved to a free
    /// loopback port (several operators run on this one machine) and the
    /// policy file the pod would mount written from the release's ConfigMap.
    fn args(&self) -> Vec<String> {
        self.deployment()["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .map(|a| {
                if a.starts_with("--metrics-addr=") {
                    "--metrics-addr=127.0.0.1:0".into()
                } else if a.starts_with("--policy-file=") {
                    format!("--policy-file={}", self.policy_file().display())
                } else {
                    a
                }
            })
            .collect()
    }

    /// The release's policy ConfigMap, as the operator pod would see its
    /// mounted `policy.yaml`, written to `target/e2e-logs/`.
    fn policy_file(&self) -> PathBuf {
        let cm = get_json(
            &self.ns.0,
            "configmap",
            &format!("{}-c10m-operator-policy", self.name),
        )
        .expect("the chart's policy ConfigMap");
        let dir = workspace().join("target/e2e-logs");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{}-{}-policy.yaml", self.ns.0, self.name));
        std::fs::write(&path, cm["data"]["policy.yaml"].as_str().unwrap()).unwrap();
        path
    }

    /// Runs the operator as the chart's ServiceAccount with the chart's args.
    fn run_operator(&self, log_name: &str) -> (Operator, PathBuf) {
        self.run_operator_with(log_name, &[])
    }

    /// [`Self::run_operator`] with `extra` args after the chart's.
    fn run_operator_with(&self, log_name: &str, extra: &[&str]) -> (Operator, PathBuf) {
        let sa = format!("{}-c10m-operator", self.name);
        let kubeconfig = service_account_kubeconfig(&self.ns.0, &sa);
        let args = self.args();
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        (Operator::spawn(&args, &kubeconfig, log_name), kubeconfig)
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = helm(&["uninstall", &self.name, "-n", &self.ns.0]);
    }
}

/// A fleet of 2-CPU shards. These tests are about the chart, RBAC and
/// GitOps, not availability: `failureDomain: None` plans no spare shards
/// for a lost node, so the shard counts follow the connections and
/// `minShards` alone.
fn fleet(name: &str, connections: i64) -> String {
    format!(
        "apiVersion: c10m.dev/v1alpha1\nkind: ConnectionFleet\nmetadata:\n  name: {name}\nspec:\n  connections: {connections}\n  shard:\n    cpus: 2\n    minShards: 2\n  availability:\n    failureDomain: None\n"
    )
}

fn wait_ready(ns: &str, name: &str) -> Value {
    wait_fleet_ready(ns, name, MINUTE)
}

fn rv(ns: &str, kind: &str, name: &str) -> Value {
    get_json(ns, kind, name).unwrap()["metadata"]["resourceVersion"].clone()
}

/// Object `name` of `kind` in `ns` as stored, with its managed fields
/// (`kubectl get` leaves them out by default).
fn with_managed_fields(ns: &str, kind: &str, name: &str) -> Value {
    let args = [
        "get",
        "-n",
        ns,
        kind,
        name,
        "-o",
        "json",
        "--show-managed-fields",
    ];
    serde_json::from_str(&kubectl(&args)).unwrap()
}

/// The Deployment `ns/name` without what its controller writes: no
/// `status`, no `resourceVersion`, and only the managed-fields entries of
/// writes to the main resource (each with its manager, time and fields).
/// The Deployment controller's status writes move `resourceVersion` at any
/// time (a pod turning available after `minReadySeconds`); this moves only
/// when someone writes the spec or metadata.
fn deployment_writes(ns: &str, name: &str) -> Value {
    let mut d = with_managed_fields(ns, "deployment", name);
    let o = d.as_object_mut().unwrap();
    o.remove("status");
    let meta = o["metadata"].as_object_mut().unwrap();
    meta.remove("resourceVersion");
    let fields = meta["managedFields"].as_array_mut().unwrap();
    fields.retain(|e| e["subresource"] != "status");
    assert!(!fields.is_empty(), "no managed fields on {ns}/{name}");
    d
}

/// `kubectl auth can-i ARGS` with `kubeconfig` (a ServiceAccount's).
fn can_i(kubeconfig: &Path, args: &[&str]) -> bool {
    let out = std::process::Command::new("kubectl")
        .args(["auth", "can-i"])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        answer == "yes" || answer == "no",
        "kubectl auth can-i {args:?}: {answer} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    answer == "yes"
}

/// The objects of a `helm template` rendering, as JSON.
fn manifests(rendered: &str) -> Vec<Value> {
    let mut docs = vec![String::new()];
    for line in rendered.lines() {
        if line == "---" {
            docs.push(String::new());
        } else {
            let doc = docs.last_mut().unwrap();
            doc.push_str(line);
            doc.push('\n');
        }
    }
    docs.iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|d| serde_yaml::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// The one object of `kind` among `objs`.
fn only<'a>(objs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objs.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} in {objs:?}");
    found[0]
}

/// The one object of `kind` in namespace `ns` among `objs`.
fn only_in<'a>(objs: &'a [Value], kind: &str, ns: &str) -> &'a Value {
    let found: Vec<&Value> = objs
        .iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["namespace"] == ns)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} in {ns} in {objs:?}");
    found[0]
}

/// An RBAC object's rules, each as compact JSON (comparable as strings).
fn rules(obj: &Value) -> Vec<String> {
    obj["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect()
}

/// Whether `obj` holds a rule on `resource` (in `group`) granting every verb of `verbs`.
fn grants(obj: &Value, group: &str, resource: &str, verbs: &[&str]) -> bool {
    obj["rules"].as_array().unwrap().iter().any(|r| {
        let has = |key: &str, v: &str| r[key].as_array().unwrap().iter().any(|x| x == v);
        has("apiGroups", group)
            && has("resources", resource)
            && verbs.iter().all(|v| has("verbs", v))
    })
}

#[test]
fn helm_lifecycle_with_least_privilege_rbac() {
    let _shared = beside_others();
    // A namespaced install never manages the CRD (a cluster-wide write): the
    // test applies it, as a cluster admin would.
    ensure_crd();
    let fleets = Namespace::create("helm-fleets");
    let fns = fleets.0.as_str();
    let (release, notes) = Release::install("c10m-h1", Some(fns), &["--set", "crd.manage=false"]);
    assert!(
        notes.contains("`helm uninstall` removes the operator only"),
        "NOTES: {notes}"
    );
    assert!(
        notes.contains("Its rights are namespaced"),
        "NOTES: {notes}"
    );

    // The rendered Deployment: restricted securityContext, chart args.
    let dep = release.deployment();
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(pod["serviceAccountName"], "c10m-h1-c10m-operator");
    let args = release.args();
    assert!(args.contains(&format!("--namespace={fns}")), "{args:?}");
    assert!(args.contains(&"--manage-crd=false".to_string()), "{args:?}");

    // The installed RBAC: a Role in the fleets' namespace, and a ClusterRole
    // that only reads.
    let role = "c10m-h1-c10m-operator";
    let installed_role = get_json(fns, "role", role).expect("Role in the watched namespace");
    assert!(grants(
        &installed_role,
        "apps",
        "deployments",
        &["create", "patch"]
    ));
    let cr: Value =
        serde_json::from_str(&kubectl(&["get", "clusterrole", role, "-o", "json"])).unwrap();
    assert_eq!(
        cr["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}])
    );

    // The operator runs with the chart's ServiceAccount token, not admin,
    // and works with the namespaced Role.
    let (op, sa_kubeconfig) = release.run_operator("helm-h1");
    let (ok, out) = apply(fns, &fleet("edge", 1_000_000));
    assert!(ok, "{out}");
    let f = wait_ready(fns, "edge");
    // 2 shards of ~508k at most: minShards 2 is what 1M needs.
    assert_eq!(f["status"]["desiredShards"], 2, "{}", f["status"]["plan"]);
    assert_eq!(f["status"]["desiredShards"], f["status"]["plan"]["shards"]);
    assert!(
        !op.log_text().contains("CRD applied"),
        "a namespaced operator must not touch the CRD: {}",
        op.log_text()
    );
    // The token really is the ServiceAccount's: it may not read secrets.
    assert!(!can_i(&sa_kubeconfig, &["list", "secrets", "-A"]));
    // Its rights end at the watched namespace: it may write what a fleet
    // owns and read fleets' Secrets there, and nowhere else.
    let other = release.ns.0.as_str();
    for (verb, resource) in [("create", "deployments"), ("get", "secrets")] {
        assert!(
            can_i(&sa_kubeconfig, &[verb, resource, "-n", fns]),
            "{verb} {resource} in {fns}"
        );
        for ns in [other, "default", "kube-system"] {
            assert!(
                !can_i(&sa_kubeconfig, &[verb, resource, "-n", ns]),
                "{verb} {resource} in {ns}"
            );
        }
    }
    assert!(can_i(&sa_kubeconfig, &["list", "nodes"]));
    assert!(!can_i(&sa_kubeconfig, &["patch", "nodes"]));
    assert!(!can_i(
        &sa_kubeconfig,
        &[
            "patch",
            "customresourcedefinitions.apiextensions.k8s.io/connectionfleets.c10m.dev"
        ]
    ));

    // Removing a needed verb (now from the namespaced Role) is reported
    // clearly, not a silent stall.
    let idx = installed_role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .position(|r| r["resources"][0] == "deployments")
        .unwrap();
    let patch = format!(
        r#"[{{"op":"replace","path":"/rules/{idx}/verbs","value":["get","list","watch","create"]}}]"#
    );
    kubectl(&[
        "patch",
        "role",
        role,
        "-n",
        fns,
        "--type=json",
        "-p",
        &patch,
    ]);
    let (ok, out) = apply(fns, &fleet("edge", 20_000_000));
    assert!(ok, "{out}");
    let f = wait_condition(fns, "edge", "Degraded", "True", Some("ApplyFailed"), MINUTE);
    let msg = condition(&f, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("forbidden") && msg.contains("deployments"),
        "{msg}"
    );
    assert_eq!(condition(&f, "Ready").unwrap()["status"], "False");
    wait_for("ApplyFailed Warning event", MINUTE, || {
        events_for(fns, "edge")
            .iter()
            .any(|(t, r, _)| t == "Warning" && r == "ApplyFailed")
            .then_some(())
    });
    assert!(
        op.log_text().contains("forbidden"),
        "the log names the RBAC error"
    );

    // helm upgrade restores the role (and a changed value rolls the operator).
    let rev0 = dep["metadata"]["annotations"]["deployment.kubernetes.io/revision"].clone();
    let (ok, out) = helm(&[
        "upgrade",
        "c10m-h1",
        &chart(),
        "-n",
        &release.ns.0,
        "--reuse-values",
        "--set",
        "logFormat=text",
    ]);
    assert!(ok, "helm upgrade: {out}");
    let dep = wait_for("operator Deployment rolled", MINUTE, || {
        let d = release.deployment();
        (d["metadata"]["annotations"]["deployment.kubernetes.io/revision"] != rev0).then_some(d)
    });
    assert!(release.args().contains(&"--log-format=text".to_string()));
    assert_eq!(
        dep["metadata"]["annotations"]["deployment.kubernetes.io/revision"],
        "2"
    );
    // The re-plan changes the template and the shard count (2 → 32) at
    // once: the Deployment first scales the old ReplicaSet up
    // (proportional scaling), then replaces those shards too, one surge
    // step each at the default budget (ADR 0011), about 3 s a step, so
    // this takes 100 s on an idle machine (2026-12-03), longer on a busy
    // one.
    let f = wait_fleet_ready(fns, "edge", 5 * MINUTE);
    assert!(f["status"]["desiredShards"].as_i64().unwrap() > 2);
    assert_eq!(condition(&f, "Degraded").unwrap()["status"], "False");
    drop(op);

    // helm uninstall leaves the fleets (and what they own) in place.
    let (ok, out) = helm(&["uninstall", "c10m-h1", "-n", &release.ns.0]);
    assert!(ok, "{out}");
    assert!(get_json(&release.ns.0, "deployment", "c10m-h1-c10m-operator").is_none());
    assert!(
        get_json(fns, "role", role).is_none(),
        "the Role goes with the release"
    );
    assert!(get_json(fns, "connectionfleet", "edge").is_some());
    assert!(get_json(fns, "deployment", "edge").is_some());
    kubectl(&["get", "crd", "connectionfleets.c10m.dev"]);
}

#[test]
fn gitops_reapply_is_a_no_op_and_managers_do_not_fight() {
    let _shared = beside_others();
    ensure_crd();
    let fleets = Namespace::create("gitops-fleets");
    let fns = fleets.0.as_str();
    let (release, _) = Release::install("c10m-g1", Some(fns), &["--set", "crd.manage=false"]);
    let (op, _) = release.run_operator("helm-g1");
    let manifest = fleet("git", 3_000_000);
    // Server-side apply as `manager`, taking over fields another manager set.
    let ssa = |manager: &str, m: &str| {
        let out = kubectl_with(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager",
                manager,
                "-n",
                fns,
                "-f",
                "-",
            ],
            Some(m),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ssa("argocd-controller", &manifest);
    // kubectl wait works on the Ready condition. The first plan (5 shards,
    // before the node's facts are read) is re-planned to 15 at once: ten
    // empty shards replaced one surge step each (about 3 s a step; ADR
    // 0011), so this takes most of a minute, longer on a loaded machine.
    kubectl(&[
        "wait",
        "-n",
        fns,
        "--for=condition=Ready",
        "connectionfleet/git",
        "--timeout=120s",
    ]);
    let f = wait_fleet_ready(fns, "git", 2 * MINUTE);
    let ready = condition(&f, "Ready").unwrap();
    assert!(
        !ready["reason"].as_str().unwrap().is_empty()
            && !ready["message"].as_str().unwrap().is_empty()
    );
    assert_eq!(ready["observedGeneration"], f["metadata"]["generation"]);

    // Re-applying the same manifest changes nothing.
    let before = (
        [rv(fns, "connectionfleet", "git"), rv(fns, "service", "git")],
        deployment_writes(fns, "git"),
    );
    ssa("argocd-controller", &manifest);
    let diff = kubectl_with(
        &[
            "diff",
            "--server-side",
            "--field-manager",
            "argocd-controller",
            "-n",
            fns,
            "-f",
            "-",
        ],
        Some(&manifest),
    );
    assert_eq!(
        diff.status.code(),
        Some(0),
        "kubectl diff: {}",
        String::from_utf8_lossy(&diff.stdout)
    );
    assert!(diff.stdout.is_empty());
    std::thread::sleep(Duration::from_secs(3));
    let after = (
        [rv(fns, "connectionfleet", "git"), rv(fns, "service", "git")],
        deployment_writes(fns, "git"),
    );
    assert_eq!(before, after, "a re-apply changed something");

    // The operator never writes spec: its managed fields are all on the status subresource.
    let f = with_managed_fields(fns, "connectionfleet", "git");
    let entries: Vec<&Value> = f["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["manager"] == "c10m-operator")
        .collect();
    assert!(!entries.is_empty());
    for e in entries {
        assert_eq!(e["subresource"], "status", "{e}");
    }

    // A foreign annotation on the Deployment survives reconciles (no fight).
    kubectl(&[
        "annotate",
        "-n",
        fns,
        "deployment/git",
        "example.com/owner=team-edge",
        "--field-manager=someone-else",
    ]);
    // Another field manager changes the spec: the plan follows within one reconcile.
    ssa(
        "flux-kustomize",
        &fleet("git", 9_000_000).replace("minShards: 2", "minShards: 4"),
    );
    let shards_before = f["status"]["plan"]["shards"].as_i64().unwrap();
    let f = wait_for("plan follows the new spec", Duration::from_secs(15), || {
        let f = get_json(fns, "connectionfleet", "git")?;
        (f["status"]["observedGeneration"] == f["metadata"]["generation"]
            && f["status"]["plan"]["shards"] != shards_before)
            .then_some(f)
    });
    assert_eq!(f["spec"]["connections"], 9_000_000);
    let shards = f["status"]["plan"]["shards"].as_i64().unwrap();
    assert!(
        shards >= 4 && shards > shards_before,
        "{}",
        f["status"]["plan"]
    );
    assert_eq!(f["status"]["desiredShards"].as_i64(), Some(shards));
    let dep = wait_for("deployment scaled", MINUTE, || {
        let d = get_json(fns, "deployment", "git")?;
        (d["spec"]["replicas"].as_i64() == Some(shards)).then_some(d)
    });
    assert_eq!(
        dep["metadata"]["annotations"]["example.com/owner"],
        "team-edge"
    );
    wait_ready(fns, "git");
    let steady = deployment_writes(fns, "git");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        deployment_writes(fns, "git"),
        steady,
        "the operator keeps rewriting its Deployment"
    );
    assert!(
        !op.log_text().contains("CRD applied"),
        "crd.manage=false must not touch the CRD"
    );
}

#[test]
fn rendered_chart_passes_a_server_side_dry_run_and_its_values_schema() {
    // Its cluster-wide rendering holds c10m-operator-cluster-wide, which a
    // cluster-wide release of another test would hold with another roleRef.
    let _alone = alone();
    ensure_crd();
    let ns = Namespace::create("helm-dry");
    let chart = chart();
    let template = |extra: &[&str]| {
        let mut args = vec![
            "template",
            "c10m",
            chart.as_str(),
            "-n",
            ns.0.as_str(),
            "--kube-version",
            "1.35.4",
        ];
        args.extend_from_slice(extra);
        helm(&args)
    };
    let (ok, rendered) = template(&[]);
    assert!(ok, "{rendered}");
    assert!(
        !rendered.contains("kind: ServiceMonitor"),
        "no ServiceMonitor API in this cluster"
    );
    assert!(
        !rendered.contains("kind: PrometheusRule"),
        "no PrometheusRule API in this cluster"
    );
    let out = kubectl_with(
        &["apply", "--dry-run=server", "-n", &ns.0, "-f", "-"],
        Some(&rendered),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for kind in [
        "serviceaccount",
        "configmap",
        "clusterrole.rbac",
        "clusterrolebinding.rbac",
        "service",
        "deployment.apps",
        "poddisruptionbudget.policy",
        "role.rbac",
        "rolebinding.rbac",
        "validatingadmissionpolicy.admissionregistration.k8s.io",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io",
    ] {
        assert!(
            text.contains(kind) && text.contains("(server dry run)"),
            "{kind} missing from {text}"
        );
    }
    // So does the namespaced rendering (its Role and RoleBinding in the
    // watched namespace, here the release's own).
    let watch = format!("watchNamespace={}", ns.0);
    let (ok, namespaced) = template(&["--set", &watch, "--set", "crd.manage=false"]);
    assert!(ok, "{namespaced}");
    let out = kubectl_with(
        &["apply", "--dry-run=server", "-n", &ns.0, "-f", "-"],
        Some(&namespaced),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for kind in ["role.rbac", "rolebinding.rbac", "clusterrole.rbac"] {
        assert!(text.contains(kind), "{kind} missing from {text}");
    }
    // The ServiceMonitor is rendered when the cluster serves its API.
    let (ok, with_sm) = template(&["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]);
    assert!(ok && with_sm.contains("kind: ServiceMonitor"), "{with_sm}");
    // So is the PrometheusRule (the alerts), when it serves that API.
    let (ok, with_pr) = template(&["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]);
    assert!(ok && with_pr.contains("kind: PrometheusRule"), "{with_pr}");
    // values.schema.json refuses bad values, naming them.
    let (ok, out) = template(&["--set", "logFormat=xml"]);
    assert!(!ok && out.contains("logFormat"), "{out}");
    let (ok, out) = template(&["--set", "metrics.port=70000"]);
    assert!(!ok && out.contains("metrics"), "{out}");
    // The admin's policy too: a grace bound below what a shard needs, an
    // unknown field.
    let (ok, out) = template(&["--set", "policy.maxTerminationGracePeriodSeconds=5"]);
    assert!(
        !ok && out.contains("maxTerminationGracePeriodSeconds"),
        "{out}"
    );
    let (ok, out) = template(&["--set", "policy.sysctlImge=x"]);
    assert!(!ok && out.contains("sysctlImge"), "{out}");
}

/// The admin's policy reaches the operator as a mounted file, and a change
/// of it rolls the operator (it is read once, at start).
#[test]
fn the_policy_is_a_mounted_config_map_and_a_change_rolls_the_operator() {
    let objs = rendered(&[]);
    let cm = only(&objs, "ConfigMap");
    assert_eq!(cm["metadata"]["name"], "c10m-c10m-operator-policy");
    let policy: serde_yaml::Value =
        serde_yaml::from_str(cm["data"]["policy.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(policy["maxTerminationGracePeriodSeconds"], 3600);
    assert_eq!(policy["sysctlCeilings"]["fs.nr_open"], 33554432);
    assert_eq!(
        policy["reservedTaints"][0],
        "node-role.kubernetes.io/control-plane"
    );
    let pod = &only(&objs, "Deployment")["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert!(
        container["args"]
            .as_array()
            .unwrap()
            .contains(&"--policy-file=/etc/c10m-operator/policy.yaml".into()),
        "{container}"
    );
    assert_eq!(
        container["volumeMounts"],
        serde_json::json!([{"name": "policy", "mountPath": "/etc/c10m-operator", "readOnly": true}])
    );
    assert_eq!(
        pod["volumes"],
        serde_json::json!([{"name": "policy", "configMap": {"name": "c10m-c10m-operator-policy"}}])
    );
    let checksum = |objs: &[Value]| {
        only(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/policy"]
            .clone()
    };
    let tighter = rendered(&["--set", "policy.maxTerminationGracePeriodSeconds=600"]);
    assert_ne!(checksum(&objs), checksum(&tighter));
    assert_eq!(checksum(&objs), checksum(&rendered(&[])));
}

/// `helm template` of the chart as release `c10m` in `c10m-system`.
fn template(extra: &[&str]) -> (bool, String) {
    let chart = chart();
    let mut args = vec![
        "template",
        "c10m",
        chart.as_str(),
        "-n",
        "c10m-system",
        "--kube-version",
        "1.35.4",
    ];
    args.extend_from_slice(extra);
    helm(&args)
}

fn rendered(extra: &[&str]) -> Vec<Value> {
    let (ok, out) = template(extra);
    assert!(ok, "helm template {extra:?}: {out}");
    manifests(&out)
}

/// The PrometheusRule holds the groups of rules/c10m.rules.yaml (the file
/// promtool tests) unchanged, carries the extra labels a ruleSelector wants,
/// and is rendered only when the API exists and it is enabled.
#[test]
fn the_prometheus_rule_is_the_tested_rule_file() {
    const API: &str = "monitoring.coreos.com/v1/PrometheusRule";
    let objs = rendered(&[
        "--api-versions",
        API,
        "--set",
        "prometheusRule.additionalLabels.release=kube-prometheus-stack",
    ]);
    let pr = only(&objs, "PrometheusRule");
    assert_eq!(pr["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(pr["metadata"]["labels"]["release"], "kube-prometheus-stack");
    let file =
        std::fs::read_to_string(workspace().join("charts/c10m-operator/rules/c10m.rules.yaml"))
            .unwrap();
    let file: Value = serde_yaml::from_str(&file).unwrap();
    assert_eq!(pr["spec"]["groups"], file["groups"]);
    let alerts: Vec<&str> = pr["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    for alert in [
        "C10mFleetNearCapacity",
        "C10mSocketMemoryNearTcpMemPressure",
        "C10mMetricsUnavailable",
        "C10mKernelDrift",
        "C10mRolloutStuck",
        "C10mShardRestarting",
        "C10mFleetMissingFromKubeStateMetrics",
        "C10mOperatorDown",
        "C10mOperatorNoLeader",
    ] {
        assert!(alerts.contains(&alert), "{alert} missing from {alerts:?}");
    }
    let kinds = |extra: &[&str]| -> Vec<Value> {
        rendered(extra)
            .into_iter()
            .filter(|o| o["kind"] == "PrometheusRule")
            .collect()
    };
    assert!(kinds(&[]).is_empty(), "no API, no PrometheusRule");
    assert!(
        kinds(&[
            "--api-versions",
            API,
            "--set",
            "prometheusRule.enabled=false"
        ])
        .is_empty(),
        "disabled"
    );
}

#[test]
fn watch_namespace_renders_namespaced_roles_and_no_cluster_wide_write() {
    const READS: [&str; 3] = ["get", "list", "watch"];
    let nodes = serde_json::json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]);
    let namespaced = rendered(&[
        "--set",
        "watchNamespace=team-a",
        "--set",
        "crd.manage=false",
    ]);

    // Cluster-wide: nothing but reads, and only of nodes (node profiles).
    let cr = only(&namespaced, "ClusterRole");
    for rule in cr["rules"].as_array().unwrap() {
        for verb in rule["verbs"].as_array().unwrap() {
            assert!(
                READS.contains(&verb.as_str().unwrap()),
                "cluster-wide {verb} in {rule}"
            );
        }
    }
    assert_eq!(cr["rules"], nodes);
    let crb = only(&namespaced, "ClusterRoleBinding");
    assert_eq!(crb["roleRef"]["kind"], "ClusterRole");
    assert_eq!(crb["roleRef"]["name"], cr["metadata"]["name"]);

    // Every namespaced right, in the watched namespace only (beside it, in
    // the release namespace, the leader-election Role: its leases only).
    let role = only_in(&namespaced, "Role", "team-a");
    assert_eq!(role["metadata"]["namespace"], "team-a");
    for (group, resource, verbs) in [
        (
            "c10m.dev",
            "connectionfleets",
            &["get", "list", "watch"][..],
        ),
        ("c10m.dev", "connectionfleets/status", &["patch"]),
        (
            "apps",
            "deployments",
            &["get", "list", "watch", "create", "patch"],
        ),
        ("", "services", &["get", "list", "watch", "create", "patch"]),
        (
            "policy",
            "poddisruptionbudgets",
            &["get", "list", "watch", "create", "patch"],
        ),
        ("", "pods", &["list", "watch", "patch"]),
        ("apps", "replicasets", &["list", "watch"]),
        ("", "secrets", &["get", "create"]),
        ("events.k8s.io", "events", &["create", "patch"]),
    ] {
        assert!(
            grants(role, group, resource, verbs),
            "Role lacks {verbs:?} on {resource}: {role}"
        );
    }
    let binding = only_in(&namespaced, "RoleBinding", "team-a");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    for b in [binding, crb] {
        assert_eq!(
            b["subjects"],
            serde_json::json!([{"kind": "ServiceAccount", "name": "c10m-c10m-operator", "namespace": "c10m-system"}])
        );
    }
    let args = only(&namespaced, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        .clone();
    assert!(
        args.as_array()
            .unwrap()
            .contains(&"--namespace=team-a".into()),
        "{args}"
    );
    assert!(
        args.as_array()
            .unwrap()
            .contains(&"--manage-crd=false".into()),
        "{args}"
    );

    // Without watchNamespace the rendering is as before: one ClusterRole
    // with the same rules (the Role's, then nodes' reads), plus CRD rights
    // when crd.manage; no Role but the leader-election one.
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let wide = rendered(&["--set", "crd.manage=false"]);
    assert!(
        !wide
            .iter()
            .any(|o| (o["kind"] == "Role" || o["kind"] == "RoleBinding")
                && o["metadata"]["name"] != "c10m-c10m-operator-leader-election")
    );
    let wide_cr = only(&wide, "ClusterRole");
    assert_eq!(
        sorted(rules(wide_cr)),
        sorted([rules(role), rules(cr)].concat()),
        "a namespaced install holds the same rights as a cluster-wide one, split by scope"
    );
    let managed = rendered(&[]);
    let managed_cr = only(&managed, "ClusterRole");
    let crd_rules: Vec<String> = rules(managed_cr)
        .into_iter()
        .filter(|r| !rules(wide_cr).contains(r))
        .collect();
    assert_eq!(
        crd_rules,
        [
            r#"{"apiGroups":["apiextensions.k8s.io"],"resources":["customresourcedefinitions"],"verbs":["create"]}"#,
            r#"{"apiGroups":["apiextensions.k8s.io"],"resourceNames":["connectionfleets.c10m.dev"],"resources":["customresourcedefinitions"],"verbs":["get","patch"]}"#,
        ]
        .map(|r| serde_json::from_str::<Value>(r).unwrap().to_string())
    );
    assert!(grants(
        managed_cr,
        "apps",
        "deployments",
        &["create", "patch"]
    ));
    let args = &only(&managed, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        args.as_array()
            .unwrap()
            .contains(&"--manage-crd=true".into()),
        "{args}"
    );
    assert!(!args.to_string().contains("--namespace"), "{args}");

    // Managing the CRD is a cluster-wide write: refused with watchNamespace,
    // naming the value to change.
    let (ok, out) = template(&["--set", "watchNamespace=team-a"]);
    assert!(!ok, "crd.manage=true with watchNamespace rendered: {out}");
    assert!(
        out.contains("watchNamespace=team-a") && out.contains("set crd.manage=false"),
        "{out}"
    );
}

#[test]
fn cluster_wide_release_manages_its_crd_with_the_chart_rbac() {
    let _alone = alone();
    ensure_crd();
    let fleets = Namespace::create("helm-wide");
    let fns = fleets.0.as_str();
    let (release, _) = Release::install("c10m-w1", None, &[]);
    let name = "c10m-w1-c10m-operator";
    let cr: Value =
        serde_json::from_str(&kubectl(&["get", "clusterrole", name, "-o", "json"])).unwrap();
    assert!(
        grants(&cr, "apps", "deployments", &["create", "patch"]),
        "{cr}"
    );
    assert!(get_json(fns, "role", name).is_none());
    let args = release.args();
    assert!(args.contains(&"--manage-crd=true".to_string()), "{args:?}");
    assert!(
        !args.iter().any(|a| a.starts_with("--namespace")),
        "{args:?}"
    );
    // With the chart's args and ServiceAccount, confined to this test's
    // namespace by one extra --namespace (other tests' operators run
    // alongside), the operator applies its CRD and runs fleets.
    let (op, sa_kubeconfig) = release.run_operator_with("helm-w1", &["--namespace", fns]);
    assert!(can_i(
        &sa_kubeconfig,
        &["create", "deployments", "-n", "default"]
    ));
    let (ok, out) = apply(fns, &fleet("wide", 1_000_000));
    assert!(ok, "{out}");
    wait_ready(fns, "wide");
    assert!(
        op.log_text().contains("CRD applied and established"),
        "{}",
        op.log_text()
    );
}

/// The chart runs two leader-elected replicas behind a PDB, with a Role on
/// its Lease only; one replica without leader election is the old
/// single-operator rendering; several without it are refused.
#[test]
fn chart_runs_two_leader_elected_replicas_with_a_pdb() {
    let objs = rendered(&[]);
    let dep = only(&objs, "Deployment");
    assert_eq!(dep["spec"]["replicas"], 2);
    assert_eq!(dep["spec"]["strategy"]["type"], "RollingUpdate");
    assert_eq!(
        dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"],
        0
    );
    let args = dep["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    for arg in [
        "--leader-elect=true",
        "--leader-elect-lease=c10m-c10m-operator",
        "--leader-elect-namespace=c10m-system",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-period=5",
        "--leader-elect-renew-deadline=10",
    ] {
        assert!(
            args.as_array().unwrap().contains(&arg.into()),
            "{arg} in {args}"
        );
    }
    let pdb = only(&objs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        dep["spec"]["selector"]["matchLabels"]
    );
    let role = only_in(&objs, "Role", "c10m-system");
    assert_eq!(
        role["metadata"]["name"],
        "c10m-c10m-operator-leader-election"
    );
    assert_eq!(
        role["rules"],
        serde_json::json!([
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "resourceNames": ["c10m-c10m-operator"], "verbs": ["get", "update", "patch"]},
        ])
    );
    let binding = only_in(&objs, "RoleBinding", "c10m-system");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);

    let single = rendered(&[
        "--set",
        "replicas=1",
        "--set",
        "leaderElection.enabled=false",
    ]);
    let dep = only(&single, "Deployment");
    assert_eq!(dep["spec"]["replicas"], 1);
    assert_eq!(dep["spec"]["strategy"]["type"], "Recreate");
    assert!(!dep.to_string().contains("--leader-elect"));
    assert!(
        !single
            .iter()
            .any(|o| o["kind"] == "PodDisruptionBudget" || o["kind"] == "Role")
    );

    let (ok, out) = template(&["--set", "leaderElection.enabled=false"]);
    assert!(
        !ok && out.contains("needs leaderElection.enabled=true"),
        "{out}"
    );
    let (ok, out) = template(&["--set", "leaderElection.renewDeadlineSeconds=20"]);
    assert!(
        !ok && out.contains("renewPeriodSeconds < renewDeadlineSeconds"),
        "{out}"
    );
}

/// Issue 21, item 8: Argo CD, Flux and `helm template` render without the
/// cluster's APIs, so `auto` renders no monitoring object there; `true`
/// renders both, and each carries the extra labels a kube-prometheus-stack
/// selects on (`release: …`). The schema refuses anything but true, false
/// or "auto", and a label that would override one the chart sets.
#[test]
fn monitoring_renders_under_gitops_when_forced_and_carries_a_release_label() {
    let monitoring = |objs: &[Value]| -> Vec<String> {
        objs.iter()
            .filter(|o| o["apiVersion"] == "monitoring.coreos.com/v1")
            .map(|o| o["kind"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert!(monitoring(&rendered(&[])).is_empty(), "auto, no API");
    let objs = rendered(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "metrics.serviceMonitor.additionalLabels.release=kube-prometheus-stack",
        "--set",
        "prometheusRule.additionalLabels.release=kube-prometheus-stack",
    ]);
    let mut kinds = monitoring(&objs);
    kinds.sort();
    assert_eq!(kinds, ["PrometheusRule", "ServiceMonitor"]);
    for kind in ["PrometheusRule", "ServiceMonitor"] {
        let o = only(&objs, kind);
        assert_eq!(
            o["metadata"]["labels"]["release"], "kube-prometheus-stack",
            "{o}"
        );
    }
    let (ok, out) = template(&["--set", "metrics.serviceMonitor.enabled=yes"]);
    assert!(!ok && out.contains("enabled"), "{out}");
    let (ok, out) = template(&[
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.additionalLabels.app\\.kubernetes\\.io/name=x",
    ]);
    assert!(!ok && out.contains("app.kubernetes.io/name"), "{out}");
}

/// Issue 21, item 11 (cert-manager#3187, scylla-operator#683): two operator
/// installations on the same fleets each elect a leader on their own Lease,
/// and both act. The chart's ClusterRoleBinding is named after what the
/// release operates on, never after the release: one name for any release,
/// in any namespace, so Helm's ownership check refuses a second release on
/// the same scope even where the chart's own check (`lookup`) cannot run.
/// The Lease follows the release's name and namespace only.
#[test]
fn the_scope_binding_and_the_lease_follow_the_scope_and_the_release_only() {
    let chart = chart();
    let render = |release: &str, ns: &str, extra: &[&str]| -> Vec<Value> {
        let mut args = vec![
            "template",
            release,
            chart.as_str(),
            "-n",
            ns,
            "--kube-version",
            "1.35.4",
        ];
        args.extend_from_slice(extra);
        let (ok, out) = helm(&args);
        assert!(ok, "helm template {args:?}: {out}");
        manifests(&out)
    };
    for (release, ns, full) in [
        ("c10m", "c10m-system", "c10m-c10m-operator"),
        ("other", "team-x", "other-c10m-operator"),
        ("my-c10m-operator", "ops", "my-c10m-operator"),
    ] {
        for (extra, binding) in [
            (&[][..], "c10m-operator-cluster-wide".to_string()),
            (
                &[
                    "--set",
                    "watchNamespace=team-a",
                    "--set",
                    "crd.manage=false",
                ][..],
                "c10m-operator-namespace-team-a".to_string(),
            ),
        ] {
            let objs = render(release, ns, extra);
            let crb = only(&objs, "ClusterRoleBinding");
            assert_eq!(crb["metadata"]["name"], binding.as_str(), "{crb}");
            assert_eq!(crb["roleRef"]["name"], full);
            assert_eq!(
                crb["subjects"],
                serde_json::json!([{"kind": "ServiceAccount", "name": full, "namespace": ns}])
            );
            // The Lease: the release's full name in its namespace, granted
            // by name; no live Deployment to read, so a rolling update.
            let dep = only(&objs, "Deployment");
            let args = &dep["spec"]["template"]["spec"]["containers"][0]["args"];
            for arg in [
                format!("--leader-elect-lease={full}"),
                format!("--leader-elect-namespace={ns}"),
            ] {
                assert!(args.as_array().unwrap().contains(&arg.into()), "{args}");
            }
            assert_eq!(dep["spec"]["strategy"]["type"], "RollingUpdate");
            let role = only_in(&objs, "Role", ns);
            assert_eq!(role["rules"][1]["resourceNames"], serde_json::json!([full]));
        }
    }

    // No value names the Lease: leaderElection.leaseName is refused, naming
    // it, but for "" (the old default, in values files copied from the
    // chart), which renders as before.
    let (ok, values) = helm(&["show", "values", chart.as_str()]);
    assert!(ok && !values.contains("leaseName:"), "{values}");
    let (ok, out) = template(&["--set", "leaderElection.leaseName=other"]);
    assert!(
        !ok && out.contains("leaderElection.leaseName=other: this value was removed"),
        "{out}"
    );
    assert_eq!(
        rendered(&["--set", "leaderElection.leaseName="]),
        rendered(&[])
    );
}

/// Issue 21, item 11 with Helm on the plane: a second cluster-wide release,
/// or a release watching a namespace beside a cluster-wide one (or the
/// reverse, or a second on that namespace), is refused at `helm install`,
/// naming the binding and the release in the way. The release in place
/// keeps its binding and its rights. Releases watching different namespaces
/// live side by side.
#[test]
fn a_second_operator_on_the_same_fleets_is_refused() {
    let _alone = alone();
    const WIDE: &str = "c10m-operator-cluster-wide";
    let fleets = Namespace::create("scope-fleets");
    let crd_off = ["--set", "crd.manage=false"];
    let (first, _) = Release::install("c10m-one", None, &[]);
    let owner = format!("release c10m-one in namespace {}", first.ns.0);
    let refusal = format!("ClusterRoleBinding {WIDE} belongs to {owner}");

    let (second, ok, out) = Release::try_install("c10m-two", None, &[]);
    assert!(!ok, "a second cluster-wide release installed: {out}");
    assert!(out.contains(&refusal), "{out}");
    assert!(get_json(&second.ns.0, "deployment", "c10m-two-c10m-operator").is_none());
    let (_third, ok, out) = Release::try_install("c10m-three", Some(&fleets.0), &crd_off);
    assert!(!ok, "a namespaced release beside a cluster-wide one: {out}");
    assert!(
        out.contains(&refusal)
            && out.contains(&format!("would reconcile fleets in namespace {}", fleets.0)),
        "{out}"
    );

    // The first release is as it was, and an upgrade of it passes its own
    // check.
    let binding = get_json("", "clusterrolebinding", WIDE).expect("the cluster-wide binding");
    assert_eq!(
        binding["metadata"]["annotations"]["meta.helm.sh/release-namespace"],
        first.ns.0.as_str()
    );
    assert_eq!(binding["roleRef"]["name"], "c10m-one-c10m-operator");
    assert_eq!(
        binding["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": "c10m-one-c10m-operator", "namespace": first.ns.0}])
    );
    let sa = service_account_kubeconfig(&first.ns.0, "c10m-one-c10m-operator");
    assert!(can_i(&sa, &["create", "deployments", "-n", &fleets.0]));
    let (ok, out) = first.upgrade(&["--set", "logFormat=text"]);
    assert!(ok, "helm upgrade of the cluster-wide release: {out}");
    let (ok, out) = helm(&["status", "c10m-one", "-n", &first.ns.0]);
    assert!(ok && out.contains("STATUS: deployed"), "{out}");
    assert!(can_i(&sa, &["create", "deployments", "-n", &fleets.0]));
    drop(first);
    assert!(get_json("", "clusterrolebinding", WIDE).is_none());

    // Without it, a release watching one namespace installs; a cluster-wide
    // release, or a second one on that namespace, is refused beside it.
    let (scoped, _) = Release::install("c10m-four", Some(&fleets.0), &crd_off);
    let refusal = format!(
        "ClusterRoleBinding c10m-operator-namespace-{} belongs to release c10m-four in namespace {}",
        fleets.0, scoped.ns.0
    );
    let (_fifth, ok, out) = Release::try_install("c10m-five", None, &[]);
    assert!(!ok && out.contains(&refusal), "{out}");
    let (_sixth, ok, out) = Release::try_install("c10m-six", Some(&fleets.0), &crd_off);
    assert!(!ok && out.contains(&refusal), "{out}");
    // Another namespace is another operator's.
    let others = Namespace::create("scope-others");
    let (_seventh, _) = Release::install("c10m-seven", Some(&others.0), &crd_off);
}

/// Issue 21, item 11, found by a fresh-clone review: a release installed
/// by the earlier chart (0.1.0) names its ClusterRoleBinding after itself
/// (`<release>-c10m-operator`), so the scope bindings alone missed it and a
/// second cluster-wide operator installed beside it. The binding here is
/// the one that chart leaves (its name, chart labels and Helm ownership
/// annotations, created with kubectl: the earlier chart is not in the
/// tree); its scope cannot be read from it, so every other release is
/// refused until it is upgraded or uninstalled.
#[test]
fn a_release_of_the_earlier_chart_refuses_a_second_operator() {
    let _alone = alone();
    let earlier = Namespace::create("earlier-op");
    let binding = "c10m-old-c10m-operator";
    struct Removed(&'static str);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = kubectl_with(
                &["delete", "clusterrolebinding", self.0, "--ignore-not-found"],
                None,
            );
        }
    }
    let _removed = Removed(binding);
    let manifest = format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {binding}
  labels:
    app.kubernetes.io/name: c10m-operator
    app.kubernetes.io/instance: c10m-old
    app.kubernetes.io/managed-by: Helm
  annotations:
    meta.helm.sh/release-name: c10m-old
    meta.helm.sh/release-namespace: {ns}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: view
subjects:
  - kind: ServiceAccount
    name: c10m-old-c10m-operator
    namespace: {ns}
"#,
        ns = earlier.0
    );
    let out = kubectl_with(&["apply", "-f", "-"], Some(&manifest));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let refusal = format!(
        "ClusterRoleBinding {binding} belongs to release c10m-old in namespace {}, installed by an earlier c10m-operator chart",
        earlier.0
    );
    let (second, ok, out) = Release::try_install("c10m-new", None, &[]);
    assert!(
        !ok,
        "a cluster-wide release beside an earlier chart's: {out}"
    );
    assert!(
        out.contains(&refusal) && out.contains("helm upgrade c10m-old"),
        "{out}"
    );
    assert!(get_json(&second.ns.0, "deployment", "c10m-new-c10m-operator").is_none());
    let fleets = Namespace::create("earlier-fleets");
    let (_third, ok, out) = Release::try_install(
        "c10m-new-ns",
        Some(&fleets.0),
        &["--set", "crd.manage=false"],
    );
    assert!(!ok && out.contains(&refusal), "{out}");
}

/// Issue 21, item 11: the Lease cannot be renamed through the chart, and
/// an upgrade whose running pods do not elect on the release's Lease (they
/// run without leader election, or, from a chart that had
/// leaderElection.leaseName, on another Lease) rolls with Recreate that
/// once: no old pod acts beside the new pods' leader.
#[test]
fn a_lease_rename_is_refused_and_a_change_of_lease_rolls_with_recreate() {
    let _shared = beside_others();
    let fleets = Namespace::create("lease-fleets");
    let crd_off = ["--set", "crd.manage=false"];
    let (refused, ok, out) = Release::try_install(
        "c10m-l0",
        Some(&fleets.0),
        &[&crd_off[..], &["--set", "leaderElection.leaseName=other"]].concat(),
    );
    assert!(
        !ok && out.contains("leaderElection.leaseName=other: this value was removed"),
        "{out}"
    );
    assert!(!helm(&["status", "c10m-l0", "-n", &refused.ns.0]).0);

    let (release, _) = Release::install(
        "c10m-l1",
        Some(&fleets.0),
        &[
            &crd_off[..],
            &[
                "--set",
                "replicas=1",
                "--set",
                "leaderElection.enabled=false",
            ],
        ]
        .concat(),
    );
    const LEASE: &str = "c10m-l1-c10m-operator";
    let strategy = || release.deployment()["spec"]["strategy"].clone();
    let election = || -> Vec<String> {
        release.deployment()["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .filter(|a| a.starts_with("--leader-elect=") || a.starts_with("--leader-elect-lease="))
            .collect()
    };
    assert_eq!(strategy()["type"], "Recreate");

    // Leader election on: the running pod acts without a Lease, so a
    // rolling update would run it beside the new pods' leader.
    let (ok, out) = release.upgrade(&[
        "--set",
        "replicas=2",
        "--set",
        "leaderElection.enabled=true",
    ]);
    assert!(ok, "{out}");
    assert_eq!(strategy()["type"], "Recreate");
    assert_eq!(
        election(),
        [
            "--leader-elect=true",
            &format!("--leader-elect-lease={LEASE}")
        ]
    );
    // The next upgrade's pods elect on the same Lease: a rolling update.
    let (ok, out) = release.upgrade(&["--set", "logFormat=text"]);
    assert!(ok, "{out}");
    assert_eq!(
        strategy(),
        serde_json::json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    );

    // A Lease name is refused at upgrade too, and changes nothing.
    // (The generation: the Deployment controller still writes its status.)
    let generation = release.deployment()["metadata"]["generation"].clone();
    let (ok, out) = release.upgrade(&["--set", "leaderElection.leaseName=other"]);
    assert!(
        !ok && out.contains("leaderElection.leaseName=other: this value was removed"),
        "{out}"
    );
    assert_eq!(release.deployment()["metadata"]["generation"], generation);

    // Pods electing on another Lease, as the chart before this one
    // rendered them with leaderElection.leaseName=c10m-old: the upgrade
    // back onto the release's Lease is a Recreate.
    let args = election();
    let dep = release.deployment();
    let all = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap();
    let idx = all
        .iter()
        .position(|a| a.as_str().unwrap().starts_with("--leader-elect-lease="))
        .unwrap();
    let patch = format!(
        r#"[{{"op":"replace","path":"/spec/template/spec/containers/0/args/{idx}","value":"--leader-elect-lease=c10m-old"}}]"#
    );
    kubectl(&[
        "patch",
        "deployment",
        LEASE,
        "-n",
        &release.ns.0,
        "--type=json",
        "-p",
        &patch,
    ]);
    let (ok, out) = release.upgrade(&[]);
    assert!(ok, "{out}");
    assert_eq!(strategy()["type"], "Recreate");
    assert_eq!(election(), args);
    let role = get_json(&release.ns.0, "role", &format!("{LEASE}-leader-election"))
        .expect("the leader-election Role");
    assert_eq!(
        role["rules"][1]["resourceNames"],
        serde_json::json!([LEASE])
    );
}
