//! Tenant safety (issue 13), end to end on the local control plane: a fleet
//! author with the namespaced `edit` role plus the fleet verbs (applying as
//! that ServiceAccount with `kubectl --as`) cannot make the operator do what
//! the admin's policy does not allow. Each case is refused at admission
//! naming the field, or refused/clamped by the operator with a condition
//! saying so.

use std::path::PathBuf;
use std::time::Duration;

use c10m_e2e::*;

const MINUTE: Duration = Duration::from_secs(60);

/// The tenant's ServiceAccount in every test namespace.
const AUTHOR: &str = "fleet-author";

/// A namespace with a fleet author: ServiceAccount [`AUTHOR`], bound to the
/// built-in `edit` ClusterRole by a RoleBinding, plus a Role with the
/// ConnectionFleet verbs (`edit` does not aggregate them).
struct Tenant {
    ns: Namespace,
}

impl Tenant {
    fn create(prefix: &str) -> Self {
        let ns = Namespace::create(prefix);
        let n = ns.0.as_str();
        kubectl(&["create", "serviceaccount", AUTHOR, "-n", n]);
        kubectl(&[
            "create",
            "rolebinding",
            "fleet-author-edit",
            "-n",
            n,
            "--clusterrole=edit",
            &format!("--serviceaccount={n}:{AUTHOR}"),
        ]);
        kubectl(&[
            "create",
            "role",
            "fleet-author-fleets",
            "-n",
            n,
            "--verb=get,list,watch,create,update,patch,delete",
            "--resource=connectionfleets.c10m.dev",
        ]);
        kubectl(&[
            "create",
            "rolebinding",
            "fleet-author-fleets",
            "-n",
            n,
            "--role=fleet-author-fleets",
            &format!("--serviceaccount={n}:{AUTHOR}"),
        ]);
        Tenant { ns }
    }

    fn name(&self) -> &str {
        &self.ns.0
    }

    fn user(&self) -> String {
        format!("system:serviceaccount:{}:{AUTHOR}", self.name())
    }

    /// `kubectl --as=<the author> apply -n NS -f -`: (success, stdout + stderr).
    fn apply(&self, manifest: &str) -> (bool, String) {
        let user = self.user();
        let as_user = format!("--as={user}");
        let out = kubectl_with(
            &[&as_user, "apply", "-n", self.name(), "-f", "-"],
            Some(manifest),
        );
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// `kubectl auth can-i` as the author.
    fn can_i(&self, args: &[&str]) -> bool {
        let as_user = format!("--as={}", self.user());
        let mut all = vec!["auth", "can-i", as_user.as_str()];
        all.extend_from_slice(args);
        let out = kubectl_with(&all, None);
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    }
}

/// A fleet of the author's: 1M connections in 2-CPU shards on the KWOK
/// nodes, with `extra` spec lines (indented two spaces).
fn fleet(name: &str, extra: &str) -> String {
    format!(
        "apiVersion: c10m.dev/v1alpha1\nkind: ConnectionFleet\nmetadata:\n  name: {name}\nspec:\n  connections: 1000000\n  shard:\n    cpus: 2\n    minShards: 2\n{extra}"
    )
}

/// A policy file for an operator, in `target/e2e-logs/`.
fn policy_file(name: &str, yaml: &str) -> PathBuf {
    let dir = workspace().join("target/e2e-logs");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-policy.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn a_tenant_cannot_reach_past_the_policy() {
    ensure_crd();
    let tenant = Tenant::create("tenant");
    let ns = tenant.name();
    // The author's rights: fleets and workloads in their namespace, nothing
    // elsewhere, no fleet status, no nodes.
    assert!(tenant.can_i(&["create", "connectionfleets.c10m.dev", "-n", ns]));
    assert!(tenant.can_i(&["create", "deployments", "-n", ns]));
    assert!(!tenant.can_i(&["create", "connectionfleets.c10m.dev", "-n", "default"]));
    assert!(!tenant.can_i(&[
        "patch",
        "connectionfleets.c10m.dev",
        "--subresource=status",
        "-n",
        ns
    ]));
    assert!(!tenant.can_i(&["list", "nodes"]));
    let op = Operator::start(ns);

    // 1. An init-container image of the author's choice: refused at
    //    admission, naming the field; nothing is stored.
    let (ok, out) = tenant.apply(&fleet(
        "own-image",
        "  sysctls:\n    image: attacker.example/root-shell:latest\n",
    ));
    assert!(!ok, "spec.sysctls.image was admitted: {out}");
    assert!(out.contains("spec.sysctls.image is not allowed"), "{out}");
    assert!(get_json(ns, "connectionfleet", "own-image").is_none());

    // 2. Tolerations reaching the control plane: Degraded naming the field,
    //    no Deployment. Both the explicit taint and a key-less Exists.
    for (name, toleration) in [
        (
            "control-plane",
            "{key: node-role.kubernetes.io/control-plane, operator: Exists, effect: NoSchedule}",
        ),
        ("everywhere", "{operator: Exists}"),
    ] {
        let (ok, out) = tenant.apply(&fleet(
            name,
            &format!("  placement:\n    tolerations:\n    - {toleration}\n"),
        ));
        assert!(ok, "{out}");
        let f = wait_condition(
            ns,
            name,
            "Degraded",
            "True",
            Some("TolerationNotAllowed"),
            MINUTE,
        );
        let message = condition(&f, "Degraded").unwrap()["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            message.starts_with("spec.placement.tolerations[0] ")
                && message.contains("node-role.kubernetes.io/control-plane"),
            "{message}"
        );
        assert_eq!(condition(&f, "Ready").unwrap()["status"], "False");
        assert!(
            get_json(ns, "deployment", name).is_none(),
            "a refused fleet gets no pods"
        );
        let warned = events_for(ns, name)
            .into_iter()
            .filter(|(t, r, _)| t == "Warning" && r == "TolerationNotAllowed")
            .count();
        assert_eq!(warned, 1, "one Warning for {name}");
        println!("FIGURE tenant toleration {toleration}: Degraded TolerationNotAllowed: {message}");
    }

    // 3. drain.rate 1: the grace period is the policy's bound (an hour), not
    //    years; the fleet runs, and says its drain cannot finish.
    let (ok, out) = tenant.apply(&fleet("slow-drain", "  drain:\n    rate: 1\n"));
    assert!(ok, "{out}");
    let f = wait_condition(
        ns,
        "slow-drain",
        "Degraded",
        "True",
        Some("DrainCannotFinish"),
        MINUTE,
    );
    let plan = &f["status"]["plan"];
    assert_eq!(plan["drainCutByPolicy"], true, "{plan}");
    assert_eq!(plan["terminationGracePeriodSeconds"], 3600, "{plan}");
    assert!(plan["drainSeconds"].as_i64().unwrap() > 3600, "{plan}");
    let dep = wait_for("slow-drain Deployment", MINUTE, || {
        get_json(ns, "deployment", "slow-drain")
    });
    let pod = &dep["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap();
    assert!(grace <= 3600, "grace {grace}");
    assert_eq!(pod["automountServiceAccountToken"], false);
    // InitContainer mode: the server starts as root and drops to
    // 65532:65532 itself (ADR 0008); never group 0 once serving.
    let server = &pod["containers"][0];
    assert_eq!(server["securityContext"]["runAsGroup"], 0, "{pod}");
    assert!(
        server["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "C10M_RUN_AS" && e["value"] == "65532:65532"),
        "{pod}"
    );
    let message = condition(&f, "Degraded").unwrap()["message"].clone();
    println!(
        "FIGURE tenant drain.rate 1: terminationGracePeriodSeconds {grace} (drain needs {} s): {message}",
        plan["drainSeconds"]
    );

    // 4. A query reaching another namespace's series: refused, naming the field.
    let (ok, out) = tenant.apply(&fleet(
        "peek",
        "  metrics:\n    connectionsQuery: 'sum by (pod) (c10m_connections{namespace=\"kube-system\"})'\n",
    ));
    assert!(ok, "{out}");
    let f = wait_condition(ns, "peek", "Degraded", "True", Some("InvalidSpec"), MINUTE);
    let message = condition(&f, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("spec.metrics.connectionsQuery"),
        "{message}"
    );
    assert!(get_json(ns, "deployment", "peek").is_none());
    println!("FIGURE tenant foreign query: Degraded InvalidSpec: {message}");

    // The operator stays up through all of it.
    assert!(op.log_text().contains("policy"), "{}", op.log_text());
}

/// The admin's policy file: where the privileged init container may run,
/// with whose image, and how far node sysctls go.
#[test]
fn the_admin_policy_file_decides_init_containers_images_and_ceilings() {
    ensure_crd();
    // A namespace the policy does not list: InitContainer mode is refused
    // with the hint; PodSecurityContext mode runs.
    let closed = Tenant::create("tenant-closed");
    let cns = closed.name();
    let file = policy_file(cns, "initContainerNamespaces: [some-other-namespace]\n");
    let args = [
        "run",
        "--namespace",
        cns,
        "--metrics-addr",
        "127.0.0.1:0",
        "--policy-file",
        file.to_str().unwrap(),
    ];
    let _closed_op = Operator::spawn(&args, &kubeconfig(), cns);
    let (ok, out) = closed.apply(&fleet("privileged", ""));
    assert!(ok, "{out}");
    let f = wait_condition(
        cns,
        "privileged",
        "Degraded",
        "True",
        Some("SysctlModeNotAllowed"),
        MINUTE,
    );
    let message = condition(&f, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("spec.sysctls.mode: InitContainer")
            && message.contains("set spec.sysctls.mode: PodSecurityContext"),
        "{message}"
    );
    assert!(get_json(cns, "deployment", "privileged").is_none());
    println!(
        "FIGURE tenant InitContainer where not allowed: Degraded SysctlModeNotAllowed: {message}"
    );
    let (ok, out) = closed.apply(&fleet(
        "unprivileged",
        "  sysctls:\n    mode: PodSecurityContext\n",
    ));
    assert!(ok, "{out}");
    wait_condition(
        cns,
        "unprivileged",
        "Ready",
        "True",
        Some("ShardsReady"),
        MINUTE,
    );

    // A namespace it lists: the init container runs the policy's image, and
    // the node's conntrack table is raised no further than the ceiling.
    let open = Tenant::create("tenant-open");
    let ons = open.name();
    let image = "registry.example/c10m/server@sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";
    let file = policy_file(
        ons,
        &format!(
            "initContainerNamespaces: [{ons}]\nsysctlImage: {image}\nsysctlCeilings:\n  net.netfilter.nf_conntrack_max: 1200000\n"
        ),
    );
    let args = [
        "run",
        "--namespace",
        ons,
        "--metrics-addr",
        "127.0.0.1:0",
        "--policy-file",
        file.to_str().unwrap(),
    ];
    let _open_op = Operator::spawn(&args, &kubeconfig(), ons);
    // 16-CPU shards: without the ceiling, 2 shards raise conntrack to
    // 1,841,480; under it, smaller shards (more of them) fit 1,200,000.
    let (ok, out) = open.apply(&fleet("tuned", "").replace("cpus: 2", "cpus: 16"));
    assert!(ok, "{out}");
    let f = wait_condition(
        ons,
        "tuned",
        "SysctlsApplied",
        "True",
        Some("CappedByPolicy"),
        MINUTE,
    );
    let plan = &f["status"]["plan"];
    assert_eq!(
        plan["sysctlsCapped"]["net.netfilter.nf_conntrack_max"], "1200000",
        "{plan}"
    );
    assert_eq!(plan["limitingFactor"], "conntrack", "{plan}");
    let dep = wait_for("tuned Deployment", MINUTE, || {
        get_json(ons, "deployment", "tuned")
    });
    let init = &dep["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["image"], image);
    let raised: i64 = init["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| {
            a.as_str()?
                .strip_prefix("--raise-node=net.netfilter.nf_conntrack_max=")
        })
        .map(|v| v.parse().unwrap())
        .next()
        .expect("conntrack is raised");
    assert!(raised > 1_048_576 && raised <= 1_200_000, "{raised}");
    let message = condition(&f, "SysctlsApplied").unwrap()["message"].clone();
    println!("FIGURE tenant conntrack ceiling 1200000: raised to {raised}; {message}");
}

/// The admin's policy file on placement, queries and kernel claims: a node
/// selector on a reserved label is refused unless allowed; every query of
/// the namespace is confined to the policy's matchers, at admission and
/// when the operator runs it; a claim of cheaper connections than the
/// operator can check (`kernelBytesPerSocket: 0`, `conntrack: false`) is
/// not used in the cluster.
#[test]
fn the_admin_policy_file_decides_node_selectors_queries_and_kernel_claims() {
    ensure_crd();
    let prom = Prometheus::ensure();
    let tenant = Tenant::create("tenant-placed");
    let ns = tenant.name();
    let file = policy_file(
        ns,
        &format!(
            "reservedNodeLabels: [kubernetes.io/hostname, c10m.dev/pool]\nallowedNodeSelectors:\n  - {{key: c10m.dev/pool, value: edge, namespaces: [{ns}]}}\nqueryMatchers:\n  - {{namespaces: [{ns}], matchers: {{cluster: eu-1}}}}\n"
        ),
    );
    let args = [
        "run",
        "--namespace",
        ns,
        "--metrics-addr",
        "127.0.0.1:0",
        "--prometheus-url",
        &prom,
        "--policy-file",
        file.to_str().unwrap(),
    ];
    let _op = Operator::spawn(&args, &kubeconfig(), ns);

    // 1. Pinned to one node by a reserved label: Degraded naming the
    //    field and the policy keys, one Warning, no Deployment.
    let (ok, out) = tenant.apply(&fleet(
        "pinned",
        "  placement:\n    nodeSelector:\n      kubernetes.io/hostname: kwok-node-1\n",
    ));
    assert!(ok, "{out}");
    let f = wait_condition(
        ns,
        "pinned",
        "Degraded",
        "True",
        Some("NodeSelectorNotAllowed"),
        MINUTE,
    );
    let message = condition(&f, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with(
            r#"spec.placement.nodeSelector["kubernetes.io/hostname"] = "kwok-node-1" "#
        ) && message.contains("(reservedNodeLabels)")
            && message.contains("(policy allowedNodeSelectors)"),
        "{message}"
    );
    assert_eq!(condition(&f, "Ready").unwrap()["status"], "False");
    assert!(get_json(ns, "deployment", "pinned").is_none());
    let warned = events_for(ns, "pinned")
        .into_iter()
        .filter(|(t, r, _)| t == "Warning" && r == "NodeSelectorNotAllowed")
        .count();
    assert_eq!(warned, 1, "one Warning for pinned");
    println!(
        "FIGURE tenant nodeSelector on a reserved label: Degraded NodeSelectorNotAllowed: {message}"
    );

    // 2. A query reaching past the policy's matchers: refused, naming the
    //    field and the policy key.
    let (ok, out) = tenant.apply(&fleet(
        "elsewhere",
        "  metrics:\n    connectionsQuery: 'sum by (pod) (c10m_connections{cluster=\"us-2\"})'\n",
    ));
    assert!(ok, "{out}");
    let f = wait_condition(
        ns,
        "elsewhere",
        "Degraded",
        "True",
        Some("InvalidSpec"),
        MINUTE,
    );
    let message = condition(&f, "Degraded").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("spec.metrics.connectionsQuery") && message.contains("(queryMatchers)"),
        "{message}"
    );
    assert!(get_json(ns, "deployment", "elsewhere").is_none());
    println!("FIGURE tenant query past the policy's matchers: Degraded InvalidSpec: {message}");

    // 3. The allowed selector, with cheap kernel claims: it runs on the
    //    nodes, sized as if it claimed nothing, and says the claims were not
    //    used. The queries the operator runs carry cluster="eu-1" (the
    //    harness's Prometheus has no such label: no samples, naming it).
    let (ok, out) = tenant.apply(&fleet(
        "pooled",
        "  placement:\n    nodeSelector:\n      c10m.dev/pool: edge\n  node:\n    kernelBytesPerSocket: 0\n    conntrack: false\n  autoscaling:\n    enabled: true\n    syncPeriodSeconds: 2\n",
    ));
    assert!(ok, "{out}");
    let f = wait_condition(ns, "pooled", "Ready", "True", Some("ShardsReady"), MINUTE);
    let plan = &f["status"]["plan"];
    assert_eq!(
        plan["nodeSource"]["kernelBytesPerSocket"], "SpecNotTrusted",
        "{plan}"
    );
    assert_eq!(plan["nodeSource"]["conntrack"], "SpecNotTrusted", "{plan}");
    assert_eq!(plan["nodeSource"]["memory"], "Cluster", "{plan}");
    let kernel = plan["bytesPerConnection"]["kernel"].as_i64().unwrap();
    assert!(kernel >= 3965 + 256, "{plan}");
    let f = wait_condition(
        ns,
        "pooled",
        "MetricsAvailable",
        "False",
        Some("NoSamples"),
        MINUTE,
    );
    let message = condition(&f, "MetricsAvailable").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(message.contains(r#"cluster="eu-1""#), "{message}");
    println!(
        "FIGURE tenant kernelBytesPerSocket 0, conntrack false: {kernel} kernel bytes per connection, nodeSource {}; metrics: {message}",
        plan["nodeSource"]
    );
}
