//! Renders a fleet's Deployment, Service and PodDisruptionBudget from its
//! plan (pure). Env names, admin paths and the init tool's flags come from
//! the operator↔server contract, [`c10m_wire`]. The objects are complete server-side-apply intents: every
//! field the operator owns is set here, and nothing else.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, HTTPGetAction, HostPathVolumeSource, KeyToPath,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SecretVolumeSource,
    SecurityContext, Service, ServicePort, ServiceSpec, TopologySpreadConstraint, Volume,
    VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use c10m_wire::{admin, env as wire_env, sysctl_tool};

use crate::api::sysctl::Scope;
use crate::api::{
    BackendModel, ConnectionFleet, ConnectionFleetSpec, FailureDomain, Plan, SysctlMode,
};
use crate::names::{
    CONNECTION_PORT_NAME, POD_TEMPLATE_HASH, RESTARTED_AT_ANNOTATION, SERVER_CONTAINER,
    SYSCTL_INIT_CONTAINER, labels, secret_name, selector,
};
use crate::plan;
use crate::policy::Policy;

/// Seconds between the kubelet's readiness probes of a shard (`/healthz`).
pub const READINESS_PERIOD_SECONDS: i32 = 1;

/// Failed readiness probes before the kubelet marks a shard NotReady: one,
/// so a cordoned shard (503) leaves the endpoints within a probe period.
pub const READINESS_FAILURE_THRESHOLD: i32 = 1;

/// Seconds from a cordon until its shard is out of the Service's
/// endpoints: the probes that see it (period × threshold). What the
/// endpoint controller and the dataplane add comes on top
/// ([`crate::rollout::CORDON_SETTLE_SECONDS`]).
pub const READINESS_SECONDS: i64 = (READINESS_PERIOD_SECONDS * READINESS_FAILURE_THRESHOLD) as i64;

/// Fraction of the container memory limit given to GOMEMLIMIT for the
/// goroutine model: 90 %, leaving room for non-heap memory (Go's GC guide
/// recommends a limit with headroom below the container limit).
pub const GOMEMLIMIT_PERCENT: i64 = 90;

// The drain and grace period are sized by the plan, within the policy's
// bound; their constants and formulas live there.
pub use crate::plan::drain::{
    DRAIN_ACCEPT_SECONDS, DRAIN_SLACK_SECONDS, drain_seconds, drain_timeout_seconds, grace_seconds,
};

/// The objects a fleet owns.
#[derive(Clone, Debug)]
pub struct Rendered {
    /// The shards.
    pub deployment: Deployment,
    /// The fleet's connection and metrics endpoints.
    pub service: Service,
    /// At most one shard disrupted at a time.
    pub pdb: PodDisruptionBudget,
}

fn env(name: &str, value: impl ToString) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.to_string()),
        ..Default::default()
    }
}

/// uid the bundled server serves as (the image's `USER`, server-image/Dockerfile).
pub const SERVER_UID: i64 = 65532;

/// gid the bundled server serves as. Set explicitly: `runAsUser` alone in a
/// FROM-scratch image (no /etc/passwd) gives the process gid 0, measured
/// on a real kubelet + containerd (tests/cluster/README.md, real node).
pub const SERVER_GID: i64 = 65532;

/// Seconds the Deployment's `progressDeadlineSeconds` adds to a rollout
/// step (`minReadySeconds`): the Deployment controller's default deadline
/// (600 s), counted from where a step is due to make progress. Chosen.
pub const PROGRESS_DEADLINE_SLACK_SECONDS: i32 = 600;

/// True when the bundled server's container starts as root and drops to
/// [`SERVER_UID`]:[`SERVER_GID`] itself (`C10M_RUN_AS`): InitContainer mode,
/// whose pods are privileged already. Kubernetes sets no ambient
/// capabilities (kubernetes#56374), so a container started as uid 65532
/// loses every added capability at `execve`; started as root it keeps
/// them, raises its hard RLIMIT_NOFILE, and gives them all up when it
/// switches uid, before it opens a socket (docs/adr/0008).
pub fn starts_as_root(spec: &ConnectionFleetSpec) -> bool {
    spec.backend.model == BackendModel::Epoll && spec.sysctls.mode == SysctlMode::InitContainer
}

/// The bundled server container's security context. Starting as root
/// ([`starts_as_root`]): capabilities SETUID and SETGID to switch to
/// [`SERVER_UID`]:[`SERVER_GID`], plus SYS_RESOURCE where the plan has the
/// server raise its own nofile (`plan.serverRaisesNofile`: only on nodes
/// that can grant it; a runtime asked for a capability it cannot grant
/// never starts the container). Otherwise uid/gid 65532 with no
/// capabilities. Always no privilege escalation and a read-only root.
fn server_security_context(spec: &ConnectionFleetSpec, plan: &Plan) -> SecurityContext {
    let root = starts_as_root(spec);
    let add: Vec<String> = if root {
        let mut caps = vec!["SETUID".to_string(), "SETGID".to_string()];
        if plan.server_raises_nofile {
            caps.push("SYS_RESOURCE".into());
        }
        caps
    } else {
        vec![]
    };
    let (uid, gid) = if root {
        (0, 0)
    } else {
        (SERVER_UID, SERVER_GID)
    };
    SecurityContext {
        run_as_non_root: Some(!root),
        run_as_user: Some(uid),
        run_as_group: Some(gid),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: (!add.is_empty()).then_some(add),
        }),
        ..Default::default()
    }
}

/// Renders the fleet's objects for `plan`. `owner` is the fleet's controller
/// owner reference (so deleting the fleet deletes them). What is privileged
/// comes from the admin's `policy`, never from the fleet: the init
/// container's image (the grace period's bound is already in the plan).
pub fn render(
    fleet: &ConnectionFleet,
    plan: &Plan,
    owner: OwnerReference,
    replicas: i32,
    policy: &Policy,
) -> Rendered {
    let name = fleet.metadata.name.clone().unwrap_or_default();
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: fleet.metadata.namespace.clone(),
        labels: Some(labels(&name)),
        owner_references: Some(vec![owner]),
        ..Default::default()
    };
    let spec = &fleet.spec;
    let server = &spec.server;

    let mut env_vars = vec![
        env(wire_env::PORT, server.port),
        env(wire_env::METRICS_PORT, server.metrics_port),
        env(wire_env::WORKERS, plan.workers),
        env(wire_env::MAX_CONNECTIONS, plan.shard_connection_limit),
        env(wire_env::NOFILE, plan.nofile),
        env(wire_env::BACKLOG, plan.listen_backlog),
        env(wire_env::PROTOCOL, spec.backend.protocol.wire_name()),
        // Dead peers stop counting within plan::bundled::dead_peer_seconds;
        // unfinished input stays within the budget the shard's memory holds.
        env(
            wire_env::KEEPALIVE_IDLE_SECS,
            plan::bundled::KEEPALIVE_IDLE_SECS,
        ),
        env(
            wire_env::KEEPALIVE_INTERVAL_SECS,
            plan::bundled::KEEPALIVE_INTERVAL_SECS,
        ),
        env(wire_env::KEEPALIVE_COUNT, plan::bundled::KEEPALIVE_COUNT),
        env(
            wire_env::PARTIAL_BUDGET_BYTES,
            plan::bundled::PARTIAL_BUDGET_BYTES_PER_WORKER,
        ),
    ];
    // Drain: close at the plan's shard rate on SIGTERM, keep accepting
    // (with a goodbye) for the accept window meanwhile, finishing both
    // before the grace period ends. A grace the policy cut ends the drain
    // early.
    let grace = plan.termination_grace_period_seconds;
    env_vars.push(env(wire_env::DRAIN_RATE, plan.drain_rate));
    env_vars.push(env(
        wire_env::DRAIN_TIMEOUT_SECS,
        drain_timeout_seconds(grace),
    ));
    env_vars.push(env(wire_env::DRAIN_ACCEPT_SECS, DRAIN_ACCEPT_SECONDS));
    // The admin token is a file in the fleet's Secret volume, re-read by the
    // server as the kubelet updates it (never an env var, which a rotated
    // Secret never reaches).
    env_vars.push(env(wire_env::ADMIN_TOKEN_FILE, admin::TOKEN_PATH));
    if starts_as_root(spec) {
        env_vars.push(env(wire_env::RUN_AS, format!("{SERVER_UID}:{SERVER_GID}")));
    }
    if !server.subprotocols.is_empty() {
        env_vars.push(env(wire_env::SUBPROTOCOLS, server.subprotocols.join(",")));
    }
    if spec.backend.model == BackendModel::Goroutine {
        env_vars.push(env("GOMAXPROCS", plan.cpus));
        env_vars.push(env(
            "GOMEMLIMIT",
            plan.memory_limit_bytes / 100 * GOMEMLIMIT_PERCENT,
        ));
    }
    let resources: BTreeMap<String, Quantity> = BTreeMap::from([
        ("cpu".into(), Quantity(plan.cpus.to_string())),
        (
            "memory".into(),
            Quantity(plan.memory_limit_bytes.to_string()),
        ),
    ]);
    let health = |initial: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(admin::HEALTHZ_PATH.into()),
            port: IntOrString::String(admin::PORT_NAME.into()),
            ..Default::default()
        }),
        initial_delay_seconds: Some(initial),
        period_seconds: Some(5),
        ..Default::default()
    };
    // A shard leaves the Service's endpoints within one failed probe of
    // its cordon (or drain); the rollout waits that long, and a little
    // more, before the first drain ([`READINESS_SECONDS`]).
    let readiness = Probe {
        period_seconds: Some(READINESS_PERIOD_SECONDS),
        failure_threshold: Some(READINESS_FAILURE_THRESHOLD),
        ..health(1)
    };
    let bundled = spec.backend.model == BackendModel::Epoll;
    let server_container = Container {
        name: SERVER_CONTAINER.into(),
        image: Some(server.image.clone()),
        env: Some(env_vars),
        ports: Some(vec![
            ContainerPort {
                name: Some(CONNECTION_PORT_NAME.into()),
                container_port: server.port,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some(admin::PORT_NAME.into()),
                container_port: server.metrics_port,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(resources.clone()),
            limits: Some(resources),
            ..Default::default()
        }),
        readiness_probe: Some(readiness),
        liveness_probe: Some(health(10)),
        security_context: bundled.then(|| server_security_context(spec, plan)),
        volume_mounts: Some(vec![admin_token_mount()]),
        ..Default::default()
    };

    let mode = spec.sysctls.mode;
    let init_containers =
        (mode == SysctlMode::InitContainer && !plan.sysctls.is_empty()).then(|| {
            // The admin's image: spec.sysctls.image is refused at admission
            // and never read.
            vec![sysctl_init_container(&policy.sysctl_image, plan)]
        });
    let pod_sysctls =
        (mode == SysctlMode::PodSecurityContext && !plan.sysctls.is_empty()).then(|| {
            plan.sysctls
                .iter()
                .map(|(n, v)| k8s_openapi::api::core::v1::Sysctl {
                    name: n.name().into(),
                    value: v.to_string(),
                })
                .collect()
        });
    let pod_security = PodSecurityContext {
        // The admin token file's group (see admin_token_volume).
        fs_group: Some(SERVER_GID),
        sysctls: pod_sysctls,
        ..Default::default()
    };

    let mut volumes = Vec::new();
    if init_containers.is_some() && raises_node_sysctls(plan) {
        volumes.push(Volume {
            name: HOST_PROC_VOLUME.into(),
            host_path: Some(HostPathVolumeSource {
                path: "/proc".into(),
                type_: Some("Directory".into()),
            }),
            ..Default::default()
        });
    }
    volumes.push(admin_token_volume(&name));

    let pod = PodSpec {
        volumes: Some(volumes),
        init_containers,
        containers: vec![server_container],
        security_context: Some(pod_security),
        node_selector: (!spec.placement.node_selector.is_empty())
            .then(|| spec.placement.node_selector.clone()),
        tolerations: (!spec.placement.tolerations.is_empty())
            .then(|| spec.placement.tolerations.clone()),
        topology_spread_constraints: Some(vec![spread_over_nodes(&name, plan)]),
        termination_grace_period_seconds: Some(grace),
        // Shards never talk to the API server: no ServiceAccount token in
        // their pods (the admin token comes from the fleet's own Secret).
        automount_service_account_token: Some(false),
        ..Default::default()
    };

    let mut pod_annotations = BTreeMap::new();
    pod_annotations.insert("prometheus.io/scrape".to_string(), "true".to_string());
    pod_annotations.insert(
        "prometheus.io/port".to_string(),
        server.metrics_port.to_string(),
    );
    pod_annotations.insert(
        "prometheus.io/path".to_string(),
        admin::METRICS_PATH.to_string(),
    );
    let restarted_at = fleet.metadata.annotations.as_ref();
    if let Some(at) = restarted_at.and_then(|a| a.get(RESTARTED_AT_ANNOTATION)) {
        pod_annotations.insert(RESTARTED_AT_ANNOTATION.to_string(), at.clone());
    }

    // A rollout within the fleet's reconnect budget (ADR 0011):
    // `rolloutSurge` updated shards come up before as many old ones are
    // removed; none is removed first. The surge needs room on the nodes:
    // without it the rollout waits, and the old shards keep serving.
    // `minReadySeconds`, the gate between steps, is not rendered: the
    // rollout owns it under its own field manager ([`crate::rollout::Rollout::pace`],
    // `rolloutStepSeconds` outside a rollout). The progress deadline must
    // exceed it (API validation, and the gate never passes the step); a
    // step makes progress at least every step, so the deadline marks a
    // rollout stuck only when a step takes 10 minutes longer than planned.
    let step_seconds = i32::try_from(plan.rollout_step_seconds).unwrap_or(i32::MAX / 2);
    let rolling = RollingUpdateDeployment {
        max_surge: Some(IntOrString::Int(plan.rollout_surge.max(1))),
        max_unavailable: Some(IntOrString::Int(0)),
    };
    let progress_deadline_seconds =
        Some(step_seconds.saturating_add(PROGRESS_DEADLINE_SLACK_SECONDS));
    let deployment = Deployment {
        metadata: meta.clone(),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(rolling),
            }),
            progress_deadline_seconds,
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(&name)),
                    annotations: Some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    };

    let service = Service {
        metadata: meta.clone(),
        spec: Some(ServiceSpec {
            type_: Some(server.service_type.as_str().into()),
            selector: Some(selector(&name)),
            ports: Some(vec![ServicePort {
                name: Some(CONNECTION_PORT_NAME.into()),
                port: server.port,
                target_port: Some(IntOrString::String(CONNECTION_PORT_NAME.into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };

    let pdb = PodDisruptionBudget {
        metadata: meta,
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };

    Rendered {
        deployment,
        service,
        pdb,
    }
}

/// How a fleet's shards spread over nodes: evenly by hostname, counting
/// each revision's pods apart (`pod-template-hash`), so a rollout's new
/// pods spread too. A plan that survives its busiest node
/// (`failureDomain: Node`) requires the spread over at least two nodes
/// (`DoNotSchedule`, `minDomains: 2`, over the nodes whose taints the fleet
/// tolerates): the scheduler never packs more of its shards on one node
/// than the survivors can cover, and a shard that cannot be placed so (a
/// one-node cluster) stays Pending and says why. Other plans prefer it
/// (`ScheduleAnyway`).
fn spread_over_nodes(name: &str, plan: &Plan) -> TopologySpreadConstraint {
    let required = plan.failure_domain == FailureDomain::Node;
    TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".into(),
        when_unsatisfiable: if required {
            "DoNotSchedule"
        } else {
            "ScheduleAnyway"
        }
        .into(),
        node_taints_policy: Some("Honor".into()),
        min_domains: required.then_some(2),
        label_selector: Some(LabelSelector {
            match_labels: Some(selector(name)),
            ..Default::default()
        }),
        match_label_keys: Some(vec![POD_TEMPLATE_HASH.into()]),
        ..Default::default()
    }
}

/// The privileged init container: `c10m-sysctl --set` for namespaced
/// sysctls (inside the pod's netns) and `--raise-node` for node-level ones
/// (entered through the host's /proc; raise-only, never lowers).
/// The host's /proc is mounted (read-only, as volume [`HOST_PROC_VOLUME`])
/// only where the plan raises a node-level sysctl.
fn sysctl_init_container(image: &str, plan: &Plan) -> Container {
    let host_proc = raises_node_sysctls(plan);
    let mut args: Vec<String> = host_proc
        .then(|| {
            format!(
                "{}={}",
                sysctl_tool::HOST_PROC_FLAG,
                sysctl_tool::HOST_PROC_MOUNT
            )
        })
        .into_iter()
        .collect();
    for (sysctl, value) in &plan.sysctls {
        let flag = match sysctl.scope() {
            Scope::Node => sysctl_tool::RAISE_NODE_FLAG,
            Scope::Namespaced => sysctl_tool::SET_FLAG,
        };
        args.push(sysctl_tool::arg(flag, sysctl.name(), &value.to_string()));
    }
    let small: BTreeMap<String, Quantity> = BTreeMap::from([
        ("cpu".into(), Quantity("100m".into())),
        ("memory".into(), Quantity("32Mi".into())),
    ]);
    Container {
        name: SYSCTL_INIT_CONTAINER.into(),
        image: Some(image.into()),
        command: Some(vec![sysctl_tool::BINARY.into()]),
        args: Some(args),
        // requests = limits keeps the pod in the Guaranteed QoS class.
        resources: Some(ResourceRequirements {
            requests: Some(small.clone()),
            limits: Some(small),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            privileged: Some(true),
            run_as_user: Some(0),
            run_as_non_root: Some(false),
            ..Default::default()
        }),
        volume_mounts: host_proc.then(|| {
            vec![VolumeMount {
                name: HOST_PROC_VOLUME.into(),
                mount_path: sysctl_tool::HOST_PROC_MOUNT.into(),
                read_only: Some(true),
                ..Default::default()
            }]
        }),
        ..Default::default()
    }
}

/// Name of the volume holding the host's /proc in the init container.
const HOST_PROC_VOLUME: &str = "host-proc";

/// Name of the volume holding the fleet's admin Secret in the server
/// container.
const ADMIN_TOKEN_VOLUME: &str = "admin-token";

/// Mode of the admin token file: read for its owner (root) and its group
/// (the pod's `fsGroup`, [`SERVER_GID`]), nothing for anyone else.
pub const ADMIN_TOKEN_FILE_MODE: i32 = 0o440;

/// The fleet's admin Secret as a volume holding only its token, as the
/// file [`c10m_wire::admin::TOKEN_KEY`] (the Secret must exist and hold
/// the key, or the pod does not start; the operator creates it before the
/// Deployment).
///
/// The kubelet writes Secret volume files as root with the volume's mode,
/// then, with the pod's `fsGroup`, gives them that group (and group read).
/// With `defaultMode: 0440` and `fsGroup: 65532` the token is
/// `root:65532 0440`: readable by a process whose gid or a supplementary
/// group is 65532, by no one else. That holds in every mode: starting as
/// 65532:65532 (PodSecurityContext and None modes; gid 65532), and in
/// InitContainer mode too, where the server starts as root:root (65532 is
/// then one of its supplementary groups), clears its supplementary groups
/// and switches to 65532:65532 before it reads the file (docs/adr/0008):
/// its gid is the file's group. Other backends' images read it through
/// the supplementary group `fsGroup` adds to their processes, whatever
/// their uid. `fsGroup` is not applied to the host `/proc` (hostPath
/// volumes keep their ownership).
///
/// The kubelet updates the file when the Secret changes (within its sync
/// period, about a minute by default) by swapping the volume's `..data`
/// symlink; the server re-reads it, so a rotated token takes effect
/// without a restart.
fn admin_token_volume(fleet: &str) -> Volume {
    Volume {
        name: ADMIN_TOKEN_VOLUME.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret_name(fleet)),
            items: Some(vec![KeyToPath {
                key: admin::TOKEN_KEY.into(),
                path: admin::TOKEN_KEY.into(),
                mode: None,
            }]),
            default_mode: Some(ADMIN_TOKEN_FILE_MODE),
            optional: Some(false),
        }),
        ..Default::default()
    }
}

/// The server container's read-only mount of [`admin_token_volume`] at
/// [`c10m_wire::admin::TOKEN_DIR`]: the whole volume, never a `subPath`
/// (a `subPath` mount never sees the kubelet's updates).
fn admin_token_mount() -> VolumeMount {
    VolumeMount {
        name: ADMIN_TOKEN_VOLUME.into(),
        mount_path: admin::TOKEN_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

/// True when `plan` raises a node-level sysctl (the init container then
/// enters the host's network namespace through its /proc).
fn raises_node_sysctls(plan: &Plan) -> bool {
    plan.sysctls.keys().any(|s| s.scope() == Scope::Node)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::sysctl::Sysctl;
    use crate::names::FLEET_LABEL;
    use crate::plan::NodeFacts;
    use k8s_openapi::api::core::v1::Sysctl as PodSysctl;
    use kube::Resource;
    use serde_json::json;

    const NODE: NodeFacts = NodeFacts {
        memory_bytes: 256 << 30,
        cpus: 64,
        pods: 110,
        runtime: crate::plan::NodeRuntime::UNKNOWN,
    };

    /// Every `C10M_*` name of the contract, from `c10m_wire::env`.
    const WIRE_ENV: [&str; 27] = [
        wire_env::BIND,
        wire_env::PORT,
        wire_env::METRICS_PORT,
        wire_env::WORKERS,
        wire_env::MAX_CONNECTIONS,
        wire_env::NOFILE,
        wire_env::BACKLOG,
        wire_env::PROTOCOL,
        wire_env::HANDSHAKE_TIMEOUT_SECS,
        wire_env::IDLE_TIMEOUT_SECS,
        wire_env::MAX_FRAME_BYTES,
        wire_env::DRAIN_RATE,
        wire_env::DRAIN_TIMEOUT_SECS,
        wire_env::DRAIN_ACCEPT_SECS,
        wire_env::ADMIN_TOKEN_FILE,
        wire_env::ADMIN_TOKEN,
        wire_env::KEEPALIVE_IDLE_SECS,
        wire_env::KEEPALIVE_INTERVAL_SECS,
        wire_env::KEEPALIVE_COUNT,
        wire_env::TCP_USER_TIMEOUT_SECS,
        wire_env::FRAME_TIMEOUT_SECS,
        wire_env::PARTIAL_BUDGET_BYTES,
        wire_env::WS_PING_SECS,
        wire_env::WS_PONG_TIMEOUT_SECS,
        wire_env::RUN_AS,
        wire_env::CLOSE_TIMEOUT_SECS,
        wire_env::SUBPROTOCOLS,
    ];

    struct Case {
        fleet: ConnectionFleet,
        plan: Plan,
        owner: OwnerReference,
        out: Rendered,
    }

    fn fleet(spec: serde_json::Value) -> ConnectionFleet {
        let mut f = ConnectionFleet::new("edge", serde_json::from_value(spec).unwrap());
        f.metadata.namespace = Some("prod".into());
        f.metadata.uid = Some("0b6c1d1e-fleet-uid".into());
        f
    }

    /// Plans `spec` on a 64-CPU, 256 GiB node and renders it at the plan's
    /// shards, under the default policy.
    fn case(spec: serde_json::Value) -> Case {
        case_under(spec, &Policy::default())
    }

    /// [`case`] under `policy`.
    fn case_under(spec: serde_json::Value, policy: &Policy) -> Case {
        let fleet = fleet(spec);
        let node = plan::nodes::resolve(&fleet.spec, Some(NODE)).unwrap();
        let plan = plan::plan_under(&fleet.spec, node, policy).unwrap();
        let owner = fleet.controller_owner_ref(&()).unwrap();
        let out = render(&fleet, &plan, owner.clone(), plan.shards, policy);
        Case {
            fleet,
            plan,
            owner,
            out,
        }
    }

    fn pod(r: &Rendered) -> &PodSpec {
        r.deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
    }

    fn server(r: &Rendered) -> &Container {
        let containers = &pod(r).containers;
        assert_eq!(containers.len(), 1, "one server container");
        assert_eq!(containers[0].name, SERVER_CONTAINER);
        &containers[0]
    }

    fn env_value<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.as_deref())
    }

    fn volume_names(p: &PodSpec) -> Vec<&str> {
        p.volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect()
    }

    fn pod_sysctls(p: &PodSpec) -> Option<Vec<PodSysctl>> {
        p.security_context.as_ref().and_then(|s| s.sysctls.clone())
    }

    fn caps(c: &Container) -> (Vec<String>, Option<Vec<String>>) {
        let caps = c
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .clone()
            .unwrap();
        (caps.drop.unwrap_or_default(), caps.add)
    }

    /// Issue 9: a container started as uid 65532 loses added capabilities
    /// at execve (no ambient set), so in InitContainer mode the server
    /// starts as root with only what the switch and the raise need, and
    /// drops to 65532:65532 itself (`C10M_RUN_AS`).
    #[test]
    fn epoll_starts_as_root_and_drops_itself_in_init_container_mode() {
        let c = case(json!({"connections": 1_000_000}));
        let s = server(&c.out);
        let sc = s.security_context.clone().unwrap();
        assert_eq!(
            (sc.run_as_user, sc.run_as_group, sc.run_as_non_root),
            (Some(0), Some(0), Some(false))
        );
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.privileged, None);
        assert!(c.plan.server_raises_nofile);
        assert_eq!(
            caps(s),
            (
                vec!["ALL".to_string()],
                Some(vec![
                    "SETUID".to_string(),
                    "SETGID".to_string(),
                    "SYS_RESOURCE".to_string()
                ])
            )
        );
        assert_eq!(env_value(s, wire_env::RUN_AS), Some("65532:65532"));

        // A node that cannot grant CAP_SYS_RESOURCE: never asked for (the
        // runtime would refuse to start the container), nofile fits the
        // node's hard limit, and the server still drops to 65532.
        let c = case(
            json!({"connections": 1_000_000, "node": {"sysResource": false, "nofileHardLimit": 20000}}),
        );
        let s = server(&c.out);
        assert!(!c.plan.server_raises_nofile);
        assert_eq!(c.plan.node_nofile_hard_limit, 20_000);
        assert!(c.plan.nofile <= 20_000, "nofile {}", c.plan.nofile);
        assert_eq!(
            caps(s),
            (
                vec!["ALL".to_string()],
                Some(vec!["SETUID".to_string(), "SETGID".to_string()])
            )
        );
        assert_eq!(env_value(s, wire_env::RUN_AS), Some("65532:65532"));

        for mode in ["PodSecurityContext", "None"] {
            let c = case(json!({"connections": 1_000_000, "sysctls": {"mode": mode}}));
            let s = server(&c.out);
            let sc = s.security_context.as_ref().unwrap();
            assert_eq!(
                (sc.run_as_non_root, sc.run_as_user, sc.run_as_group),
                (Some(true), Some(65532), Some(65532)),
                "{mode}"
            );
            assert_eq!(
                caps(s),
                (vec!["ALL".to_string()], None),
                "{mode}: no capability is added back"
            );
            assert_eq!(env_value(s, wire_env::RUN_AS), None, "{mode}");
        }
    }

    /// A node whose init container cannot enter the host's network
    /// namespace: the plan raises no node-level sysctl (the init container
    /// would crash-loop on `--raise-node`), only namespaced ones.
    #[test]
    fn a_node_without_the_host_netns_gets_no_node_level_raise() {
        let big = json!({"connections": 10_000_000, "backend": {"queuedPercent": 100}});
        let c = case(big.clone());
        assert!(c.plan.sysctls.keys().any(|s| s.scope() == Scope::Node));
        let mut closed = big;
        closed["node"] = json!({"hostNetworkNamespace": false});
        let c = case(closed);
        assert!(
            c.plan
                .sysctls
                .keys()
                .all(|s| s.scope() == Scope::Namespaced),
            "{:?}",
            c.plan.sysctls
        );
        let init = &pod(&c.out).init_containers.as_ref().unwrap()[0];
        let args = init.args.as_ref().unwrap();
        assert!(
            !args
                .iter()
                .any(|a| a.starts_with(sysctl_tool::RAISE_NODE_FLAG)),
            "{args:?}"
        );
    }

    #[test]
    fn goroutine_keeps_its_image_defaults_and_gets_go_runtime_limits() {
        let c = case(json!({"connections": 1_000_000, "backend": {"model": "goroutine"}}));
        let s = server(&c.out);
        assert_eq!(s.security_context, None);
        assert_eq!(
            env_value(s, "GOMAXPROCS"),
            Some(c.plan.cpus.to_string().as_str())
        );
        let gomemlimit: i64 = env_value(s, "GOMEMLIMIT").unwrap().parse().unwrap();
        assert_eq!(gomemlimit, c.plan.memory_limit_bytes / 100 * 90);
        assert!(gomemlimit < c.plan.memory_limit_bytes);
    }

    #[test]
    fn custom_keeps_its_image_defaults_without_go_settings() {
        let c = case(json!({
            "connections": 1_000_000,
            "backend": {"model": "custom", "userBytesPerConnection": 4096}
        }));
        let s = server(&c.out);
        assert_eq!(s.security_context, None);
        assert_eq!(env_value(s, "GOMAXPROCS"), None);
        assert_eq!(env_value(s, "GOMEMLIMIT"), None);
        let epoll = case(json!({"connections": 1_000_000}));
        assert_eq!(env_value(server(&epoll.out), "GOMAXPROCS"), None);
    }

    #[test]
    fn init_container_sets_namespaced_and_raises_node_sysctls() {
        // 10M connections on one node need node-level sysctls as well.
        let c = case(json!({"connections": 10_000_000}));
        assert!(c.plan.sysctls.contains_key(&Sysctl::Somaxconn));
        assert!(c.plan.sysctls.contains_key(&Sysctl::NrOpen));
        let p = pod(&c.out);
        let inits = p.init_containers.as_ref().unwrap();
        assert_eq!(inits.len(), 1);
        let init = &inits[0];
        assert_eq!(init.name, SYSCTL_INIT_CONTAINER);
        assert_eq!(
            init.image.as_deref(),
            Some(crate::policy::DEFAULT_SYSCTL_IMAGE)
        );
        assert_eq!(init.command, Some(vec!["c10m-sysctl".to_string()]));
        let args = init.args.clone().unwrap();
        assert_eq!(args[0], "--host-proc=/host/proc");
        assert_eq!(args.len(), c.plan.sysctls.len() + 1, "{args:?}");
        assert!(args.contains(&"--set=net.core.somaxconn=65535".to_string()));
        assert!(args.contains(&"--set=net.ipv4.tcp_max_syn_backlog=65535".to_string()));
        assert!(args.contains(&"--set=net.ipv4.tcp_migrate_req=1".to_string()));
        assert!(args.contains(&format!("--raise-node=fs.nr_open={}", c.plan.nofile)));
        for (sysctl, value) in &c.plan.sysctls {
            let flag = match sysctl.scope() {
                Scope::Node => "--raise-node",
                Scope::Namespaced => "--set",
            };
            let want = format!("{flag}={}={value}", sysctl.name());
            assert!(args.contains(&want), "{want} missing from {args:?}");
        }
        // Node-level values reach the host through its /proc, read-only mounted.
        let sc = init.security_context.as_ref().unwrap();
        assert_eq!(sc.privileged, Some(true));
        assert_eq!(sc.run_as_user, Some(0));
        let mounts = init.volume_mounts.as_ref().unwrap();
        assert_eq!(
            (
                mounts[0].name.as_str(),
                mounts[0].mount_path.as_str(),
                mounts[0].read_only
            ),
            ("host-proc", "/host/proc", Some(true))
        );
        let volumes = p.volumes.as_ref().unwrap();
        assert_eq!(volumes[0].name, "host-proc");
        assert_eq!(volumes[0].host_path.as_ref().unwrap().path, "/proc");
        assert_eq!(volume_names(p), ["host-proc", "admin-token"]);
        assert_eq!(pod_sysctls(p), None, "no pod sysctls in this mode");
    }

    /// Issue 13: the privileged container's image is the admin's. A fleet
    /// naming one is refused (at admission, and by the plan where the
    /// schema's rule is not enforced), never rendered.
    #[test]
    fn the_init_container_runs_the_policy_image_only() {
        let digest = "registry.example/c10m/server@sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let policy = Policy {
            sysctl_image: digest.into(),
            ..Policy::default()
        };
        let c = case_under(json!({"connections": 10_000_000}), &policy);
        let inits = pod(&c.out).init_containers.clone().unwrap();
        assert_eq!(inits[0].image.as_deref(), Some(digest));
        assert_eq!(
            server(&c.out).image.as_deref(),
            Some(crate::api::DEFAULT_SERVER_IMAGE),
            "the server's own image stays the fleet's"
        );
        let spec =
            fleet(json!({"connections": 10_000_000, "sysctls": {"image": "me/tools:1"}})).spec;
        let err = plan::plan_under(&spec, NODE, &policy)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("spec.sysctls.image is not allowed"),
            "{err}"
        );
    }

    /// Issue 13: shard pods hold no API credentials, and the bundled server
    /// runs with a fixed non-root group too.
    #[test]
    fn shard_pods_mount_no_service_account_token_and_run_as_group_65532() {
        for spec in [
            json!({"connections": 1_000_000}),
            json!({"connections": 1_000_000, "sysctls": {"mode": "PodSecurityContext"}}),
            json!({"connections": 1_000_000, "backend": {"model": "goroutine"}}),
        ] {
            let c = case(spec.clone());
            assert_eq!(
                pod(&c.out).automount_service_account_token,
                Some(false),
                "{spec}"
            );
        }
        let c = case(json!({"connections": 1_000_000, "sysctls": {"mode": "PodSecurityContext"}}));
        let sc = server(&c.out).security_context.clone().unwrap();
        assert_eq!(
            (sc.run_as_user, sc.run_as_group, sc.run_as_non_root),
            (Some(65532), Some(65532), Some(true))
        );
    }

    /// Issue 13: `drain.rate: 1` rendered a grace period of years. The
    /// policy bounds it, and the server cuts its drain before SIGKILL.
    #[test]
    fn a_drain_that_cannot_finish_gets_the_policy_bound() {
        let c = case(json!({"connections": 1_000_000, "drain": {"rate": 1}}));
        assert!(c.plan.drain_cut_by_policy);
        assert_eq!(c.plan.drain_seconds, c.plan.shard_connection_limit);
        let grace = pod(&c.out).termination_grace_period_seconds.unwrap();
        assert_eq!(grace, 3600);
        assert_eq!(c.plan.termination_grace_period_seconds, 3600);
        let timeout: i64 = env_value(server(&c.out), wire_env::DRAIN_TIMEOUT_SECS)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(timeout, 3600 - 5 - 10);
        // A tighter policy, tighter still.
        let policy = Policy {
            max_termination_grace_period_seconds: 600,
            ..Policy::default()
        };
        let c = case_under(
            json!({"connections": 1_000_000, "drain": {"rate": 1}}),
            &policy,
        );
        assert_eq!(pod(&c.out).termination_grace_period_seconds, Some(600));
        // A drain that fits is not cut.
        let c = case(json!({"connections": 1_000_000, "drain": {"rate": 2000}}));
        assert!(!c.plan.drain_cut_by_policy);
        assert_eq!(
            pod(&c.out).termination_grace_period_seconds,
            Some(grace_seconds(c.plan.shard_connection_limit, 2000))
        );
    }

    #[test]
    fn no_init_container_without_sysctls() {
        let mut c = case(json!({"connections": 1_000_000}));
        assert!(pod(&c.out).init_containers.is_some());
        c.plan.sysctls.clear();
        let out = render(
            &c.fleet,
            &c.plan,
            c.owner.clone(),
            c.plan.shards,
            &Policy::default(),
        );
        assert_eq!(pod(&out).init_containers, None);
        assert_eq!(
            volume_names(pod(&out)),
            ["admin-token"],
            "no host /proc without the init container"
        );
        assert_eq!(pod_sysctls(pod(&out)), None);
    }

    #[test]
    fn pod_security_context_mode_renders_pod_sysctls_and_no_init_container() {
        let c = case(json!({
            "connections": 1_000_000,
            "sysctls": {
                "mode": "PodSecurityContext",
                "allowedUnsafe": ["net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog"]
            }
        }));
        let p = pod(&c.out);
        assert_eq!(p.init_containers, None);
        assert_eq!(volume_names(p), ["admin-token"]);
        let sysctls = p.security_context.as_ref().unwrap().sysctls.clone();
        assert_eq!(
            sysctls,
            Some(vec![
                PodSysctl {
                    name: "net.core.somaxconn".into(),
                    value: "65535".into()
                },
                PodSysctl {
                    name: "net.ipv4.tcp_max_syn_backlog".into(),
                    value: "65535".into()
                },
                PodSysctl {
                    name: "net.ipv4.tcp_rmem".into(),
                    value: "4096 16384 65536".into()
                },
                PodSysctl {
                    name: "net.ipv4.tcp_wmem".into(),
                    value: "4096 16384 65536".into()
                },
            ])
        );
        // Without allowed unsafe sysctls only the kubelet-safe socket
        // buffer bounds go in.
        let c = case(json!({"connections": 1_000_000, "sysctls": {"mode": "PodSecurityContext"}}));
        let names: Vec<String> = pod_sysctls(pod(&c.out))
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"]);
        assert_eq!(pod(&c.out).init_containers, None);
    }

    #[test]
    fn none_mode_renders_neither_init_container_nor_pod_sysctls() {
        let c = case(json!({"connections": 1_000_000, "sysctls": {"mode": "None"}}));
        let p = pod(&c.out);
        assert_eq!(p.init_containers, None);
        assert_eq!(volume_names(p), ["admin-token"]);
        assert_eq!(pod_sysctls(p), None);
        assert!(!c.plan.sysctls_not_applied.is_empty());
    }

    #[test]
    fn grace_period_follows_the_drain_rate() {
        for (rate, budget) in [(1_000i64, 5_000i64), (7_000, 5_000), (7_000, 200_000)] {
            let c = case(json!({
                "connections": 1_000_000,
                "drain": {"rate": rate},
                "rollout": {"maxReconnectRate": budget}
            }));
            let limit = c.plan.shard_connection_limit;
            // One shard never closes faster than the fleet's budget.
            let rate = rate.min(budget);
            let drain = (limit as f64 / rate as f64).ceil() as i64;
            // Drain time + the 5 s accept window + 20 s of slack.
            let grace = drain + 5 + 20;
            let p = pod(&c.out);
            assert_eq!(
                p.termination_grace_period_seconds,
                Some(grace),
                "rate {rate}"
            );
            let s = server(&c.out);
            assert_eq!(
                env_value(s, wire_env::DRAIN_TIMEOUT_SECS),
                Some((drain + 10).to_string().as_str()),
                "the drain ends before the grace period does"
            );
            assert_eq!(env_value(s, wire_env::DRAIN_ACCEPT_SECS), Some("5"));
            assert_eq!(
                env_value(s, wire_env::DRAIN_RATE),
                Some(rate.to_string().as_str())
            );
        }
        let slow = case(json!({"connections": 1_000_000, "drain": {"rate": 1000}}));
        let fast = case(
            json!({"connections": 1_000_000, "drain": {"rate": 100000}, "rollout": {"maxReconnectRate": 100000}}),
        );
        assert!(
            pod(&slow.out).termination_grace_period_seconds
                > pod(&fast.out).termination_grace_period_seconds
        );
    }

    #[test]
    fn env_is_the_wire_contract_with_the_plan_values() {
        let c = case(json!({
            "connections": 3_000_000,
            "backend": {"protocol": "websocket"},
            "server": {"port": 7100, "metricsPort": 9100},
            "drain": {"rate": 2500}
        }));
        let s = server(&c.out);
        let names: Vec<&str> = s.env.iter().flatten().map(|e| e.name.as_str()).collect();
        let mut distinct = names.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), names.len(), "no env name twice: {names:?}");
        for n in names.iter().filter(|n| n.starts_with("C10M_")) {
            assert!(WIRE_ENV.contains(n), "{n} is not a c10m_wire::env name");
        }
        let p = &c.plan;
        let expected = [
            (wire_env::PORT, "7100".to_string()),
            (wire_env::METRICS_PORT, "9100".to_string()),
            (wire_env::WORKERS, p.workers.to_string()),
            (
                wire_env::MAX_CONNECTIONS,
                p.shard_connection_limit.to_string(),
            ),
            (wire_env::NOFILE, p.nofile.to_string()),
            (wire_env::BACKLOG, p.listen_backlog.to_string()),
            (wire_env::PROTOCOL, "websocket".to_string()),
            (wire_env::DRAIN_RATE, "2500".to_string()),
            (wire_env::DRAIN_ACCEPT_SECS, "5".to_string()),
        ];
        for (name, value) in expected {
            assert_eq!(env_value(s, name), Some(value.as_str()), "{name}");
        }
        // The admin token is a file of the fleet's Secret volume, never
        // inline and never an env var (a rotated Secret never reaches one).
        assert_eq!(
            env_value(s, wire_env::ADMIN_TOKEN_FILE),
            Some("/var/run/c10m/admin/token")
        );
        assert!(
            s.env
                .iter()
                .flatten()
                .all(|e| e.name != wire_env::ADMIN_TOKEN && e.value_from.is_none()),
            "no token env, nothing from a Secret key: {:?}",
            s.env
        );
    }

    /// Issue 13: the admin token reaches the server as a mounted Secret
    /// file the kubelet keeps up to date, readable by the serving uid
    /// (group 65532, mode 0440) in every mode and backend.
    #[test]
    fn the_admin_token_is_a_read_only_secret_file_of_group_65532() {
        for spec in [
            json!({"connections": 10_000_000}),
            json!({"connections": 1_000_000, "sysctls": {"mode": "PodSecurityContext"}}),
            json!({"connections": 1_000_000, "sysctls": {"mode": "None"}}),
            json!({"connections": 1_000_000, "backend": {"model": "goroutine"}}),
        ] {
            let c = case(spec.clone());
            let p = pod(&c.out);
            let volume = p
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == "admin-token")
                .unwrap_or_else(|| panic!("{spec}: no admin-token volume"));
            let secret = volume.secret.as_ref().expect("a secret volume");
            assert_eq!(secret.secret_name.as_deref(), Some("edge-admin"), "{spec}");
            assert_eq!(secret.secret_name, Some(secret_name("edge")));
            assert_eq!(secret.optional, Some(false));
            assert_eq!(secret.default_mode, Some(0o440), "{spec}");
            let items = secret.items.clone().unwrap();
            assert_eq!(items.len(), 1, "only the token key: {items:?}");
            assert_eq!(
                (items[0].key.as_str(), items[0].path.as_str(), items[0].mode),
                (admin::TOKEN_KEY, "token", None)
            );
            assert_eq!(
                p.security_context.as_ref().unwrap().fs_group,
                Some(65532),
                "{spec}: the file's group is the server's gid"
            );
            let s = server(&c.out);
            let mounts = s.volume_mounts.clone().unwrap();
            assert_eq!(mounts.len(), 1, "{mounts:?}");
            let m = &mounts[0];
            assert_eq!(
                (m.name.as_str(), m.mount_path.as_str(), m.read_only),
                ("admin-token", "/var/run/c10m/admin", Some(true))
            );
            assert_eq!(m.sub_path, None, "a subPath mount is never updated");
            assert_eq!(
                env_value(s, wire_env::ADMIN_TOKEN_FILE).map(String::from),
                Some(format!("{}/{}", m.mount_path, items[0].path)),
                "{spec}: the env names the mounted file"
            );
            // Only the server sees it: the privileged init container does not.
            for init in p.init_containers.iter().flatten() {
                assert!(
                    init.volume_mounts
                        .iter()
                        .flatten()
                        .all(|m| m.name != "admin-token"),
                    "{spec}"
                );
            }
        }
        // In InitContainer mode the server starts as root and drops to
        // 65532:65532 (clearing its supplementary groups) before it reads
        // the file: its gid after the drop is the file's group.
        let c = case(json!({"connections": 1_000_000}));
        assert_eq!(
            env_value(server(&c.out), wire_env::RUN_AS),
            Some("65532:65532")
        );
        assert_eq!(
            pod(&c.out).security_context.as_ref().unwrap().fs_group,
            Some(SERVER_GID)
        );
    }

    #[test]
    fn requests_equal_limits_for_guaranteed_qos() {
        let c = case(json!({"connections": 10_000_000}));
        let p = pod(&c.out);
        for container in p
            .containers
            .iter()
            .chain(p.init_containers.iter().flatten())
        {
            let r = container.resources.as_ref().unwrap();
            assert!(r.requests.is_some(), "{}", container.name);
            assert_eq!(r.requests, r.limits, "{}", container.name);
            let limits = r.limits.as_ref().unwrap();
            assert!(
                limits.contains_key("cpu") && limits.contains_key("memory"),
                "{}",
                container.name
            );
        }
        let limits = server(&c.out)
            .resources
            .as_ref()
            .unwrap()
            .limits
            .clone()
            .unwrap();
        assert_eq!(limits["cpu"], Quantity(c.plan.cpus.to_string()));
        assert_eq!(
            limits["memory"],
            Quantity(c.plan.memory_limit_bytes.to_string())
        );
    }

    #[test]
    fn probes_use_the_wire_healthz_path_on_the_metrics_port() {
        let c =
            case(json!({"connections": 1_000_000, "server": {"port": 7100, "metricsPort": 9100}}));
        let s = server(&c.out);
        for probe in [&s.readiness_probe, &s.liveness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            assert_eq!(get.path.as_deref(), Some("/healthz"));
            assert_eq!(get.port, IntOrString::String("metrics".into()));
        }
        let ports = s.ports.as_ref().unwrap();
        let port = |name: &str| {
            ports
                .iter()
                .find(|p| p.name.as_deref() == Some(name))
                .map(|p| p.container_port)
        };
        assert_eq!(port(admin::PORT_NAME), Some(9100));
        assert_eq!(port(CONNECTION_PORT_NAME), Some(7100));
        let annotations = c
            .out
            .deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap()
            .annotations
            .clone()
            .unwrap();
        assert_eq!(annotations["prometheus.io/port"], "9100");
        assert_eq!(annotations["prometheus.io/path"], admin::METRICS_PATH);
    }

    /// A restart through the fleet: its `c10m.dev/restarted-at` goes onto
    /// the pod template (a new value is a new template, rolled within the
    /// budget); without it the template carries none.
    #[test]
    fn a_restart_annotation_on_the_fleet_is_carried_onto_the_pod_template() {
        let template_annotations = |f: &ConnectionFleet, c: &Case| {
            let out = render(
                f,
                &c.plan,
                c.owner.clone(),
                c.plan.shards,
                &Policy::default(),
            );
            out.deployment
                .spec
                .unwrap()
                .template
                .metadata
                .unwrap()
                .annotations
                .unwrap()
        };
        let c = case(serde_json::json!({"connections": 100_000}));
        assert!(!template_annotations(&c.fleet, &c).contains_key(RESTARTED_AT_ANNOTATION));
        let mut restarted = c.fleet.clone();
        restarted.metadata.annotations = Some(BTreeMap::from([(
            RESTARTED_AT_ANNOTATION.to_string(),
            "2026-12-04T17:40:00Z".to_string(),
        )]));
        assert_eq!(
            template_annotations(&restarted, &c)[RESTARTED_AT_ANNOTATION],
            "2026-12-04T17:40:00Z"
        );
    }

    #[test]
    fn a_fleet_that_survives_a_node_requires_the_spread() {
        // Issue 8: the plan's failure domain holds only if the scheduler
        // never packs more shards on a node than it assumed.
        let spread = |availability: serde_json::Value| {
            let c = case(json!({"connections": 1_000_000, "availability": availability}));
            let t = pod(&c.out).topology_spread_constraints.clone().unwrap();
            assert_eq!(t.len(), 1);
            let t = t[0].clone();
            assert_eq!(t.topology_key, "kubernetes.io/hostname");
            assert_eq!(t.max_skew, 1);
            assert_eq!(t.node_taints_policy.as_deref(), Some("Honor"));
            assert_eq!(
                t.match_label_keys,
                Some(vec!["pod-template-hash".to_string()])
            );
            t.when_unsatisfiable
        };
        assert_eq!(spread(json!({})), "DoNotSchedule");
        assert_eq!(spread(json!({"failureDomain": "Shard"})), "ScheduleAnyway");
        assert_eq!(spread(json!({"failureDomain": "None"})), "ScheduleAnyway");
    }

    #[test]
    fn service_and_pdb_select_the_fleet_pods() {
        let c = case(
            json!({"connections": 1_000_000, "server": {"port": 7100, "serviceType": "NodePort"}}),
        );
        let d = c.out.deployment.spec.as_ref().unwrap();
        let want = BTreeMap::from([(FLEET_LABEL.to_string(), "edge".to_string())]);
        assert_eq!(d.selector.match_labels.as_ref(), Some(&want));
        let pod_labels = d
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .clone()
            .unwrap();
        for (k, v) in &want {
            assert_eq!(pod_labels.get(k), Some(v), "the pods carry the selector");
        }
        let svc = c.out.service.spec.as_ref().unwrap();
        assert_eq!(svc.selector.as_ref(), Some(&want));
        assert_eq!(svc.type_.as_deref(), Some("NodePort"));
        let ports = svc.ports.as_ref().unwrap();
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].port, 7100);
        assert_eq!(
            ports[0].target_port,
            Some(IntOrString::String(CONNECTION_PORT_NAME.into()))
        );
        let pdb = c.out.pdb.spec.as_ref().unwrap();
        assert_eq!(pdb.max_unavailable, Some(IntOrString::Int(1)));
        assert_eq!(pdb.min_available, None);
        assert_eq!(
            pdb.selector.as_ref().unwrap().match_labels.as_ref(),
            Some(&want)
        );
    }

    #[test]
    fn every_object_is_named_labelled_and_owned_by_the_fleet() {
        let c = case(json!({"connections": 1_000_000}));
        assert_eq!(c.owner.controller, Some(true));
        assert_eq!(c.owner.uid, "0b6c1d1e-fleet-uid");
        assert_eq!(c.owner.kind, "ConnectionFleet");
        for meta in [
            &c.out.deployment.metadata,
            &c.out.service.metadata,
            &c.out.pdb.metadata,
        ] {
            assert_eq!(meta.name.as_deref(), Some("edge"));
            assert_eq!(meta.namespace.as_deref(), Some("prod"));
            assert_eq!(meta.labels, Some(labels("edge")));
            assert_eq!(meta.owner_references, Some(vec![c.owner.clone()]));
        }
        let template = c
            .out
            .deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .clone();
        assert_eq!(template.unwrap().labels, Some(labels("edge")));
        assert_eq!(c.fleet.metadata.name.as_deref(), Some("edge"));
    }

    #[test]
    fn replicas_are_the_given_count_rolled_in_budgeted_steps() {
        // The budget defaults to the drain rate: one shard a step.
        let d = case(json!({"connections": 1_000_000}));
        assert_eq!((d.plan.drain_rate, d.plan.rollout_surge), (2000, 1));
        let rolling = d.out.deployment.spec.unwrap().strategy.unwrap();
        let rolling = rolling.rolling_update.unwrap();
        assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
        assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
        let c = case(json!({"connections": 1_000_000, "rollout": {"maxReconnectRate": 5000}}));
        let out = render(
            &c.fleet,
            &c.plan,
            c.owner.clone(),
            c.plan.shards + 3,
            &Policy::default(),
        );
        let spec = out.deployment.spec.unwrap();
        assert_eq!(spec.replicas, Some(c.plan.shards + 3));
        let rolling = spec.strategy.unwrap().rolling_update.unwrap();
        // 5000/s of budget over 2000/s per shard: two shards a step, none
        // removed before its replacement is up.
        assert_eq!((c.plan.drain_rate, c.plan.rollout_surge), (2000, 2));
        assert_eq!(rolling.max_surge, Some(IntOrString::Int(2)));
        assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
        let step = c.plan.drain_seconds + DRAIN_ACCEPT_SECONDS;
        assert_eq!(c.plan.rollout_step_seconds, step);
        // The gate between steps is the rollout's to set, not the render's.
        assert_eq!(spec.min_ready_seconds, None);
        assert_eq!(spec.progress_deadline_seconds, Some(step as i32 + 600));
        // A budget below the shard rate: one shard a step, at the budget.
        let slow = case(json!({"connections": 1_000_000, "rollout": {"maxReconnectRate": 50}}));
        assert_eq!((slow.plan.drain_rate, slow.plan.rollout_surge), (50, 1));
        let s = slow.out.deployment.spec.unwrap();
        let rolling = s.strategy.unwrap().rolling_update.unwrap();
        assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
        assert_eq!(
            env_value(
                &s.template.spec.unwrap().containers[0],
                wire_env::DRAIN_RATE
            ),
            Some("50")
        );
    }

    /// What the server makes of the rendered env, parsed by its own config
    /// parser (`c10m_server::Config`), with the Secret volume in place: the
    /// Secret's token written where the kubelet puts it (each item's path
    /// in the mount's directory), into `root`, and paths under the mount
    /// rewritten into `root` (the test cannot write the mount path itself).
    fn server_config(c: &Case, root: &std::path::Path) -> c10m_server::Config {
        let s = server(&c.out);
        let mut mounts = Vec::new();
        for m in s.volume_mounts.iter().flatten() {
            let volume = pod(&c.out)
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .expect("every mount has its volume");
            let secret = volume.secret.as_ref().expect("only Secret volumes");
            assert_eq!(secret.secret_name, Some(secret_name("edge")));
            let dir = root.join(&m.name);
            std::fs::create_dir_all(&dir).unwrap();
            for item in secret.items.iter().flatten() {
                assert_eq!(
                    item.key,
                    admin::TOKEN_KEY,
                    "the Secret holds only the token"
                );
                std::fs::write(dir.join(&item.path), "t0ken-from-the-secret\n").unwrap();
            }
            mounts.push((m.mount_path.clone(), dir));
        }
        let pairs: Vec<(String, String)> = s
            .env
            .iter()
            .flatten()
            .map(|e| {
                let value = match (&e.value, &e.value_from) {
                    (Some(v), None) => v.clone(),
                    other => panic!("env {} has {other:?}", e.name),
                };
                let value = mounts
                    .iter()
                    .find_map(|(at, dir)| {
                        let rest = value.strip_prefix(at.as_str())?.strip_prefix('/')?;
                        Some(dir.join(rest).display().to_string())
                    })
                    .unwrap_or(value);
                (e.name.clone(), value)
            })
            .collect();
        c10m_server::Config::from_env_pairs(pairs).expect("the server accepts its rendered env")
    }

    /// Issue 21, item 15: `spec.server.subprotocols` reaches the bundled
    /// server as the list it accepts, in order; none listed renders nothing.
    #[test]
    fn subprotocols_reach_the_server_as_listed() {
        let c = case(json!({
            "connections": 2_000_000,
            "backend": {"protocol": "websocket"},
            "server": {"subprotocols": ["mqtt", "v2.chat.example"]},
        }));
        let root =
            std::env::temp_dir().join(format!("c10m-render-subprotocols-{}", std::process::id()));
        let cfg = server_config(&c, &root);
        std::fs::remove_dir_all(&root).unwrap();
        let names: Vec<&str> = cfg.subprotocols.names().iter().map(|n| &**n).collect();
        assert_eq!(names, ["mqtt", "v2.chat.example"]);
        let none = case(json!({"connections": 2_000_000, "backend": {"protocol": "websocket"}}));
        assert!(
            !server(&none.out)
                .env
                .iter()
                .flatten()
                .any(|e| e.name == wire_env::SUBPROTOCOLS)
        );
    }

    #[test]
    fn the_server_parses_the_rendered_env_as_planned() {
        use clap::CommandFactory;
        let read_by_server: Vec<String> = c10m_server::Config::command()
            .get_arguments()
            .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
            .collect();
        for (protocol, want) in [
            ("echo", c10m_server::Protocol::Echo),
            ("websocket", c10m_server::Protocol::Websocket),
        ] {
            let c = case(json!({
                "connections": 2_000_000,
                "backend": {"protocol": protocol},
                "server": {"port": 7100, "metricsPort": 9100},
                "drain": {"rate": 3000}
            }));
            for e in server(&c.out).env.iter().flatten() {
                if e.name.starts_with("C10M_") {
                    assert!(
                        read_by_server.contains(&e.name),
                        "{} is rendered but the server does not read it",
                        e.name
                    );
                }
            }
            let root = std::env::temp_dir().join(format!(
                "c10m-render-volume-{}-{protocol}",
                std::process::id()
            ));
            let cfg = server_config(&c, &root);
            let p = &c.plan;
            assert_eq!(cfg.protocol, want, "{protocol}");
            assert_eq!((cfg.port, cfg.metrics_port), (7100, 9100));
            assert_eq!(cfg.workers.map(i32::from), Some(p.workers));
            assert_eq!(cfg.max_connections as i64, p.shard_connection_limit);
            assert_eq!(cfg.nofile.map(|n| n as i64), Some(p.nofile));
            assert_eq!(cfg.backlog as i64, p.listen_backlog);
            assert_eq!(cfg.drain_rate, 3000.0);
            let grace = pod(&c.out).termination_grace_period_seconds.unwrap();
            assert_eq!(cfg.drain_timeout_secs as i64, grace - 10 - 5);
            assert_eq!(cfg.drain_accept_secs, c10m_wire::drain::ACCEPT_SECS);
            // The server lives at most the longer of the drain and the
            // window (+2 s of goodbyes); the grace period outlasts both.
            let lives = (cfg.drain_timeout_secs).max(cfg.drain_accept_secs + 2) as i64;
            assert!(lives < grace, "{lives} >= {grace}");
            assert!(cfg.drain_timeout_secs as i64 >= drain_seconds(p.shard_connection_limit, 3000));
            // The file the env names is the one the Secret volume holds.
            assert_eq!(
                cfg.admin_token().unwrap().as_deref(),
                Some("t0ken-from-the-secret")
            );
            assert_eq!(cfg.admin_token, None, "no fixed token");
            std::fs::remove_dir_all(&root).unwrap();
            // The plan's values, not the server's defaults.
            assert_ne!(
                cfg.max_connections,
                c10m_server::config::DEFAULT_MAX_CONNECTIONS
            );
            assert_ne!(
                cfg.drain_timeout_secs,
                c10m_server::config::DEFAULT_DRAIN_TIMEOUT_SECS
            );
            // Keepalive and the unfinished-input budget the plan accounts.
            let dead_after = c10m_wire::keepalive::dead_after_secs(
                cfg.keepalive_idle_secs,
                cfg.keepalive_interval_secs,
                cfg.keepalive_count,
            );
            assert_eq!(dead_after as i64, plan::bundled::dead_peer_seconds());
            assert_eq!(cfg.keepalive_idle_secs, 60);
            assert_eq!(
                cfg.partial_budget_bytes as i64 * i64::from(p.workers),
                plan::bundled::partial_budget_bytes(&c.fleet.spec, i64::from(p.workers))
            );
        }
    }
}
