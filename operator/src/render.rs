//! Renders a fleet's Deployment, Service and PodDisruptionBudget from its
//! plan (pure). Env names, admin paths and the init tool's flags come from
//! the operator↔server contract, [`c10m_wire`]. The objects are complete server-side-apply intents: every
//! field the operator owns is set here, and nothing else.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    HostPathVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SecretKeySelector, SecurityContext, Service, ServicePort, ServiceSpec,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use c10m_wire::{admin, env as wire_env, sysctl_tool};

use crate::api::sysctl::Scope;
use crate::api::{BackendModel, ConnectionFleet, DEFAULT_SERVER_IMAGE, Plan, SysctlMode};
use crate::names::{
    CONNECTION_PORT_NAME, SERVER_CONTAINER, SYSCTL_INIT_CONTAINER, labels, secret_name, selector,
};
use crate::plan;

/// Fraction of the container memory limit given to GOMEMLIMIT for the
/// goroutine model: 90 %, leaving room for non-heap memory (Go's GC guide
/// recommends a limit with headroom below the container limit).
pub const GOMEMLIMIT_PERCENT: i64 = 90;

/// Seconds added to the drain time for the grace period: process start-up
/// of the drain, the last closes, and exit.
pub const DRAIN_SLACK_SECONDS: i64 = 20;

/// Seconds a shard holding `connections` needs to close them at `rate` per second.
pub fn drain_seconds(connections: i64, rate: i64) -> i64 {
    (connections + rate.max(1) - 1) / rate.max(1)
}

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

/// Renders the fleet's objects for `plan`. `owner` is the fleet's controller
/// owner reference (so deleting the fleet deletes them).
pub fn render(
    fleet: &ConnectionFleet,
    plan: &Plan,
    owner: OwnerReference,
    replicas: i32,
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
    ];
    // Drain: close at the fleet's rate on SIGTERM, finishing before the grace period ends.
    let grace = drain_seconds(plan.shard_connection_limit, spec.drain.rate) + DRAIN_SLACK_SECONDS;
    env_vars.push(env(wire_env::DRAIN_RATE, spec.drain.rate));
    env_vars.push(env(
        wire_env::DRAIN_TIMEOUT_SECS,
        grace - DRAIN_SLACK_SECONDS / 2,
    ));
    env_vars.push(EnvVar {
        name: wire_env::ADMIN_TOKEN.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret_name(&name),
                key: admin::TOKEN_KEY.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
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
        readiness_probe: Some(health(1)),
        liveness_probe: Some(health(10)),
        // The bundled server runs unprivileged; with the plan's sysctls it
        // keeps only CAP_SYS_RESOURCE, to raise its hard RLIMIT_NOFILE to the
        // plan's nofile (up to fs.nr_open). Users' images keep their defaults.
        security_context: bundled.then(|| SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: plan::raises_own_nofile(spec).then(|| vec!["SYS_RESOURCE".into()]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };

    let mode = spec.sysctls.mode;
    let init_containers =
        (mode == SysctlMode::InitContainer && !plan.sysctls.is_empty()).then(|| {
            vec![sysctl_init_container(
                spec.sysctls
                    .image
                    .as_deref()
                    .unwrap_or(DEFAULT_SERVER_IMAGE),
                plan,
            )]
        });
    let pod_sysctls =
        (mode == SysctlMode::PodSecurityContext && !plan.sysctls.is_empty()).then(|| {
            PodSecurityContext {
                sysctls: Some(
                    plan.sysctls
                        .iter()
                        .map(|(n, v)| k8s_openapi::api::core::v1::Sysctl {
                            name: n.name().into(),
                            value: v.to_string(),
                        })
                        .collect(),
                ),
                ..Default::default()
            }
        });

    let pod = PodSpec {
        init_containers: init_containers.clone(),
        containers: vec![server_container],
        volumes: init_containers.map(|_| {
            vec![Volume {
                name: "host-proc".into(),
                host_path: Some(HostPathVolumeSource {
                    path: "/proc".into(),
                    type_: Some("Directory".into()),
                }),
                ..Default::default()
            }]
        }),
        security_context: pod_sysctls,
        node_selector: (!spec.placement.node_selector.is_empty())
            .then(|| spec.placement.node_selector.clone()),
        tolerations: (!spec.placement.tolerations.is_empty())
            .then(|| spec.placement.tolerations.clone()),
        topology_spread_constraints: Some(vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: "kubernetes.io/hostname".into(),
            when_unsatisfiable: "ScheduleAnyway".into(),
            label_selector: Some(LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        termination_grace_period_seconds: Some(grace),
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

    let deployment = Deployment {
        metadata: meta.clone(),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector(&name)),
                ..Default::default()
            },
            // One shard at a time and no surge: a surge pod may find no free
            // CPUs on nodes the plan fills, which would stall the rollout.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::Int(1)),
                }),
            }),
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

/// The privileged init container: `c10m-sysctl --set` for namespaced
/// sysctls (inside the pod's netns) and `--raise-node` for node-level ones
/// (entered through the host's /proc; raise-only, never lowers).
fn sysctl_init_container(image: &str, plan: &Plan) -> Container {
    let mut args = vec![format!(
        "{}={}",
        sysctl_tool::HOST_PROC_FLAG,
        sysctl_tool::HOST_PROC_MOUNT
    )];
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
        volume_mounts: Some(vec![VolumeMount {
            name: "host-proc".into(),
            mount_path: sysctl_tool::HOST_PROC_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    }
}
