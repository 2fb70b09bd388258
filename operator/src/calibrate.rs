//! Calibration's client step (`c10m-operator calibrate`): runs one shard of
//! a fleet, exactly as planned and rendered for the cluster (its image, the
//! plan's sysctls, memory limit, CPU pinning, placement), and next to it the
//! calibration probe from the loadgen image, which fills the shard with idle
//! connections and slow readers in steps and samples the shard pod's memory
//! cgroup after each (`c10m_wire::calibrate`). Then it deletes both pods and
//! fits the samples ([`crate::plan::calibration`]).
//!
//! The probe pod reads the host's cgroups and the shard's network namespace,
//! so it runs with `hostPID` and a read-only hostPath of `/sys/fs/cgroup`:
//! the namespace must admit that (Pod Security `privileged`). Both pods
//! carry `activeDeadlineSeconds`, so a calibration whose client died stops
//! by itself; `kubectl delete pod -l c10m.dev/calibration` removes them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use c10m_wire::admin::TOKEN_KEY;
use c10m_wire::calibrate::{self as wire, Report};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Container, ContainerStateTerminated, ContainerStatus, HostPathVolumeSource, Pod, PodCondition,
    PodSpec, ResourceRequirements, Secret, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;

use crate::api::status::{CalibratedBytes, CalibrationStatus, NodeSource};
use crate::api::{BytesPerConnection, ConnectionFleet, Plan};
use crate::plan::calibration::{self, Bytes, Fit, FitError};
use crate::plan::nodes::NodeFacts;
use crate::plan::{self, PlanError};
use crate::policy::Policy;
use crate::reason::Reason;
use crate::{names, render};

/// Label on both calibration pods; its value is the fleet's name.
pub const LABEL: &str = "c10m.dev/calibration";

/// Descriptors the probe keeps for itself beyond its connections (stdio,
/// files it reads, its poller). Chosen.
const PROBE_RESERVED_FDS: u64 = 64;

/// Slow readers, percent of the last step, when none is asked for: the
/// plan's own default share (`spec.backend.slowReaderPercent` default, 1 %).
const DEFAULT_SLOW_READER_PERCENT: u64 = 1;

/// What a calibration is asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// Idle connections at which to sample, ascending; empty: half the
    /// largest and the largest the shard and the probe can hold.
    pub steps: Vec<u64>,
    /// Slow readers after the last step; `None`: 1 % of it.
    pub slow_readers: Option<u64>,
    /// The loadgen image holding the probe.
    pub probe_image: String,
    /// Seconds the whole calibration may take (also both pods'
    /// `activeDeadlineSeconds`).
    pub timeout: Duration,
}

impl Options {
    /// Both pods' `activeDeadlineSeconds`: the timeout, at least a minute.
    fn deadline_seconds(&self) -> i64 {
        self.timeout.as_secs().max(60) as i64
    }
}

/// What a calibration measured, where and on what.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The plan the shard ran under (from the cluster's nodes).
    pub plan: Plan,
    /// The plan with the measured user bytes as
    /// `spec.backend.userBytesPerConnection`.
    pub calibrated: Plan,
    /// The node the shard ran on.
    pub node: String,
    /// The shard's image as the fleet names it.
    pub image: String,
    /// The image the runtime ran (`containerStatuses[].imageID`: a digest).
    pub image_id: String,
    /// The figures.
    pub fit: Fit,
    /// Seconds from the first pod's creation to the probe's report.
    pub seconds: f64,
}

/// A plan's shape, before and after a calibration.
#[derive(Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    /// `status.plan.shards`.
    pub shards: i32,
    /// `status.plan.nodes`.
    pub nodes: i32,
    /// `status.plan.memoryLimitBytes`, per shard.
    pub memory_limit_bytes: i64,
    /// `status.plan.costPerMillionConnectionsMonthly`, when priced.
    pub cost_per_million_connections_monthly: Option<f64>,
}

impl From<&Plan> for Shape {
    fn from(p: &Plan) -> Self {
        Shape {
            shards: p.shards,
            nodes: p.nodes,
            memory_limit_bytes: p.memory_limit_bytes,
            cost_per_million_connections_monthly: p.cost_per_million_connections_monthly,
        }
    }
}

/// The model's figures a calibration is compared with.
#[derive(Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Model {
    /// `status.plan.podBytesPerConnection`.
    pub per_connection: BytesPerConnection,
    /// `status.plan.slowReaderBytes`.
    pub per_slow_reader: BytesPerConnection,
}

/// `c10m-operator calibrate -o json|yaml`.
#[derive(Serialize, Clone, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// `namespace/name` of the fleet.
    pub fleet: String,
    /// The node the shard ran on.
    pub node: String,
    /// The image as the fleet names it.
    pub image: String,
    /// The image the runtime ran (a digest).
    pub image_id: String,
    /// Seconds the calibration took.
    pub seconds: f64,
    /// What was measured.
    pub measured: Fit,
    /// What the model says.
    pub model: Model,
    /// The plan's shape now.
    pub before: Shape,
    /// The plan's shape with the measured user bytes.
    pub after: Shape,
    /// What to set in `spec.backend` for a fixed figure.
    pub backend: BTreeMap<String, i64>,
}

impl Summary {
    /// The summary of `outcome` for fleet `name`.
    pub fn new(name: String, o: &Outcome) -> Summary {
        let user = o.calibrated.bytes_per_connection.user;
        Summary {
            fleet: name,
            node: o.node.clone(),
            image: o.image.clone(),
            image_id: o.image_id.clone(),
            seconds: (o.seconds * 10.0).round() / 10.0,
            measured: o.fit.clone(),
            model: Model {
                per_connection: o.plan.pod_bytes_per_connection,
                per_slow_reader: o.plan.slow_reader_bytes,
            },
            before: (&o.plan).into(),
            after: (&o.calibrated).into(),
            backend: BTreeMap::from([("userBytesPerConnection".into(), user)]),
        }
    }
}

/// Why a calibration gave no figure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The fleet cannot be planned on the cluster's nodes.
    #[error("no plan: {0}")]
    Plan(#[from] PlanError),
    /// Another calibration of the fleet holds its Secret.
    #[error(
        "another calibration of this fleet is running (Secret {0} exists; delete it if none is)"
    )]
    Busy(String),
    /// The steps ask for more than the shard or the probe can hold.
    #[error("{0}")]
    Steps(String),
    /// A Kubernetes API call failed.
    #[error("{what}: {source}")]
    Kube {
        /// The call.
        what: String,
        /// The client's error.
        source: kube::Error,
    },
    /// The shard never became Ready.
    #[error("the shard pod {pod} never became Ready: {reason}")]
    NeverReady {
        /// The pod's name.
        pod: String,
        /// The container's waiting or terminated reason, or the timeout.
        reason: String,
    },
    /// The probe ended without a report.
    #[error("the probe pod {pod} wrote no report: {reason}")]
    NoReport {
        /// The pod's name.
        pod: String,
        /// Its state, or the parse error.
        reason: String,
    },
    /// The shard was OOM-killed before the last step.
    #[error(
        "the shard was OOM-killed after {reached} idle connections (pod bytes then: {pod_bytes}); its memory limit is {limit} B ({evidence})"
    )]
    Oom {
        /// Idle connections held at the last sample.
        reached: u64,
        /// The pod's bytes at the last sample.
        pod_bytes: u64,
        /// The plan's memory limit, bytes.
        limit: i64,
        /// What said so: the kernel's count, the runtime's reason.
        evidence: String,
    },
    /// The probe could not reach a step.
    #[error("the probe stopped: {0}")]
    Probe(String),
    /// The samples give no figure.
    #[error(transparent)]
    Fit(#[from] FitError),
}

impl Error {
    /// The `Calibrated` condition's reason for this failure.
    pub fn reason(&self) -> Reason {
        match self {
            Error::NeverReady { .. } => Reason::CalibrationShardNotReady,
            Error::Oom { .. } => Reason::CalibrationOOMKilled,
            Error::NoReport { .. } | Error::Probe(_) => Reason::CalibrationIncomplete,
            _ => Reason::CalibrationFailed,
        }
    }
}

fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

/// The steps to run: the asked ones, checked against the shard's cap and
/// the probe's descriptors (the nodes' hard RLIMIT_NOFILE, one process), or
/// half and all of what both allow. Errors name the bound a step passes.
pub fn steps(plan: &Plan, asked: &[u64], slow: Option<u64>) -> Result<(Vec<u64>, u64), Error> {
    let probe_max = (plan.node_nofile_hard_limit.max(0) as u64).saturating_sub(PROBE_RESERVED_FDS);
    let shard_max = plan.shard_connection_limit.max(0) as u64;
    let share = |n: u64| slow.unwrap_or((n * DEFAULT_SLOW_READER_PERCENT).div_ceil(100));
    let steps = if asked.is_empty() {
        // The most n with n + its slow readers within both bounds.
        let bound = probe_max.min(shard_max);
        let top = bound * 100 / (100 + DEFAULT_SLOW_READER_PERCENT);
        let top = slow.map_or(top, |s| bound.saturating_sub(s));
        vec![top / 2, top]
    } else {
        asked.to_vec()
    };
    if steps.is_empty() || steps.contains(&0) || steps.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Steps(format!(
            "steps must be ascending and above 0, got {steps:?}"
        )));
    }
    let top = *steps.last().expect("not empty");
    let slow = share(top);
    if top + slow > shard_max {
        return Err(Error::Steps(format!(
            "{top} connections + {slow} slow readers exceed the shard's cap \
             (status.plan.shardConnectionLimit {shard_max})"
        )));
    }
    if top + slow > probe_max {
        return Err(Error::Steps(format!(
            "{top} connections + {slow} slow readers exceed what one probe process may open \
             (the nodes' hard RLIMIT_NOFILE {} less {PROBE_RESERVED_FDS})",
            plan.node_nofile_hard_limit
        )));
    }
    Ok((steps, slow))
}

/// The calibration's admin-token Secret: one per fleet, so a second
/// calibration of the same fleet is refused while one runs (its create
/// conflicts).
pub fn secret_name(fleet: &str) -> String {
    format!("{fleet}-calibration-admin")
}

/// The calibration's admin-token Secret holding `token` (the shard's admin
/// server needs one; the fleet's own `<fleet>-admin` may not exist yet).
pub fn admin_secret(fleet: &ConnectionFleet, token: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(&fleet.name_any())),
            namespace: fleet.namespace(),
            labels: Some(labels(&fleet.name_any(), "shard")),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// The shard pod: the fleet's rendered pod template with calibration
/// labels (so no Service, ReplicaSet or PodDisruptionBudget of the fleet
/// selects it), `restartPolicy: Never` (an OOM kill ends it, visibly) and
/// the deadline.
pub fn shard_pod(fleet: &ConnectionFleet, plan: &Plan, policy: &Policy, deadline: i64) -> Pod {
    // render wants the fleet's owner reference for the Deployment; the
    // calibration keeps only the pod template, which carries none.
    let owner = OwnerReference::default();
    let template = render::render(fleet, plan, owner, 1, policy)
        .deployment
        .spec
        .expect("render sets the Deployment's spec")
        .template;
    let name = fleet.name_any();
    let mut spec = template.spec.expect("render sets the pod spec");
    let fleet_secret = names::secret_name(&name);
    for v in spec.volumes.iter_mut().flatten() {
        if let Some(secret) = v.secret.as_mut()
            && secret.secret_name.as_deref() == Some(fleet_secret.as_str())
        {
            secret.secret_name = Some(secret_name(&name));
        }
    }
    spec.restart_policy = Some("Never".into());
    spec.active_deadline_seconds = Some(deadline);
    let annotations = template.metadata.and_then(|m| m.annotations);
    Pod {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}-calibrate-")),
            namespace: fleet.namespace(),
            labels: Some(labels(&name, "shard")),
            annotations,
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

fn labels(fleet: &str, role: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL.into(), fleet.into()),
        ("c10m.dev/calibration-role".into(), role.into()),
        (
            "app.kubernetes.io/managed-by".into(),
            "c10m-operator".into(),
        ),
    ])
}

/// The probe pod, on `node`, aimed at the shard pod `uid` at `ip`.
#[allow(clippy::too_many_arguments)]
pub fn probe_pod(
    fleet: &ConnectionFleet,
    image: &str,
    node: &str,
    uid: &str,
    ip: &str,
    steps: &[u64],
    slow: u64,
    deadline: i64,
) -> Pod {
    let spec = &fleet.spec;
    let join = steps
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let args = vec![
        format!("{}={ip}:{}", wire::flag::TARGET, spec.server.port),
        format!(
            "{}={}",
            wire::flag::PROTOCOL,
            spec.backend.protocol.wire_name()
        ),
        format!("{}={uid}", wire::flag::POD_UID),
        format!("{}={join}", wire::flag::STEPS),
        format!("{}={slow}", wire::flag::SLOW_READERS),
        // The probe stops a little before the pod's deadline, so its
        // report is written.
        format!(
            "{}={}",
            wire::flag::TIMEOUT_SECONDS,
            (deadline - 15).max(30)
        ),
    ];
    let quantity = |s: &str| Quantity(s.into());
    Pod {
        metadata: ObjectMeta {
            generate_name: Some(format!("{}-calibrate-probe-", fleet.name_any())),
            namespace: fleet.namespace(),
            labels: Some(labels(&fleet.name_any(), "probe")),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            host_pid: Some(true),
            restart_policy: Some("Never".into()),
            active_deadline_seconds: Some(deadline),
            automount_service_account_token: Some(false),
            // Bound to the shard's node by name: whatever taints keep other
            // pods off it, the probe must run there.
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "probe".into(),
                image: Some(image.into()),
                image_pull_policy: Some("IfNotPresent".into()),
                command: Some(vec![format!("/{}", wire::BINARY)]),
                args: Some(args),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                resources: Some(ResourceRequirements {
                    // No CPU request: the shard may hold every allocatable
                    // CPU of its node (the kubelet would refuse the probe,
                    // OutOfcpu); the probe mostly waits on the kernel.
                    requests: Some(BTreeMap::from([("memory".into(), quantity("64Mi"))])),
                    limits: Some(BTreeMap::from([("memory".into(), quantity("512Mi"))])),
                    ..Default::default()
                }),
                volume_mounts: Some(vec![VolumeMount {
                    name: "host-cgroup".into(),
                    mount_path: wire::HOST_CGROUP_MOUNT.into(),
                    read_only: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            volumes: Some(vec![Volume {
                name: "host-cgroup".into(),
                host_path: Some(HostPathVolumeSource {
                    path: "/sys/fs/cgroup".into(),
                    type_: Some("Directory".into()),
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

fn statuses(pod: &Pod) -> &[ContainerStatus] {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_deref())
        .unwrap_or_default()
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Seconds a calibration's pod may stay unschedulable before the
/// calibration gives up on it. Chosen: a minute lets a pod that is being
/// deleted (a shard draining nothing, a calibration just ended) free its
/// CPUs; a full node stays full.
const UNSCHEDULABLE_SECONDS: i64 = 60;

/// A pod that will not become Ready by waiting: unschedulable for
/// [`UNSCHEDULABLE_SECONDS`], a pull or create error, or a container that
/// ended.
fn stuck(pod: &Pod) -> Option<String> {
    if let Some(phase) = pod.status.as_ref().and_then(|s| s.phase.as_deref())
        && matches!(phase, "Failed" | "Succeeded")
    {
        return Some(format!("pod phase {phase}"));
    }
    // No node has room (or none matches) for a while: the scheduler's
    // message names what is missing ("0/3 nodes are available: 3
    // Insufficient cpu"). Room a terminating pod holds comes back within
    // its grace period; the wait allows for that.
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_deref());
    let since = |c: &PodCondition| {
        c.last_transition_time
            .as_ref()
            .map_or(0, |t| Timestamp::now().duration_since(t.0).as_secs())
    };
    if let Some(c) = conditions.unwrap_or_default().iter().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
            && since(c) >= UNSCHEDULABLE_SECONDS
    }) {
        return Some(format!(
            "Unschedulable: {}",
            c.message.as_deref().unwrap_or_default()
        ));
    }
    let init = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_deref())
        .unwrap_or_default();
    init.iter().chain(statuses(pod)).find_map(|c| {
        let state = c.state.as_ref()?;
        if let Some(w) = &state.waiting {
            let reason = w.reason.as_deref().unwrap_or_default();
            let fatal = [
                "ErrImagePull",
                "ImagePullBackOff",
                "ErrImageNeverPull",
                "InvalidImageName",
                "CreateContainerConfigError",
                "CreateContainerError",
                "RunContainerError",
            ];
            return fatal.contains(&reason).then(|| {
                format!(
                    "container {}: {reason}: {}",
                    c.name,
                    w.message.as_deref().unwrap_or_default()
                )
            });
        }
        // An init container that ended well is how init containers end.
        let ended = state
            .terminated
            .as_ref()
            .filter(|t| t.exit_code != 0 || !init.contains(c));
        ended.map(|t| exited(c, t))
    })
}

/// `container NAME exited CODE (REASON)`: how a container's end is quoted.
fn exited(c: &ContainerStatus, t: &ContainerStateTerminated) -> String {
    format!(
        "container {} exited {} ({})",
        c.name,
        t.exit_code,
        t.reason.as_deref().unwrap_or_default()
    )
}

/// How long a calibration whose probe stopped early waits for the kubelet
/// to report its shard's end before it takes the shard as still running:
/// the kubelet notices a container's exit at its next relist (1 s) and
/// posts the pod's status after; 30 s leaves room for a loaded node.
const SHARD_END_WAIT: Duration = Duration::from_secs(30);

/// Whether a container of `pod` has ended.
fn container_ended(pod: &Pod) -> bool {
    statuses(pod)
        .iter()
        .any(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

fn oom_killed(pod: &Pod) -> bool {
    statuses(pod).iter().any(|c| {
        c.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.reason.as_deref())
            == Some("OOMKilled")
    })
}

/// What says the shard was OOM-killed, if anything does: the kernel
/// counted a kill in its pod ([`Report::oom_kills`], read by the probe),
/// or its runtime says `OOMKilled`. Either alone can miss one: a runtime
/// that handles the exit before the OOM event reports `Error` (containerd
/// 1.6, containerd/containerd#12260), and a container's v1 counter goes
/// with its cgroup.
fn oom_evidence(report: &Report, shard: &Pod) -> Option<String> {
    let runtime = statuses(shard)
        .iter()
        .find_map(|c| Some(exited(c, c.state.as_ref()?.terminated.as_ref()?)));
    let runtime = runtime.unwrap_or_else(|| "the runtime has not reported its end".into());
    match report.oom_kills {
        0 if oom_killed(shard) => Some(runtime),
        0 => None,
        n => Some(format!(
            "the kernel counted {n} OOM kill(s) in the pod; {runtime}"
        )),
    }
}

/// Polls `name` until `done` says something or `until` passes.
async fn watch<T>(
    pods: &Api<Pod>,
    name: &str,
    until: Instant,
    mut done: impl FnMut(&Pod) -> Option<T>,
) -> Result<Result<T, Pod>, Error> {
    loop {
        let pod = pods
            .get(name)
            .await
            .map_err(kube(format!("get pod {name}")))?;
        if let Some(t) = done(&pod) {
            return Ok(Ok(t));
        }
        if Instant::now() >= until {
            return Ok(Err(pod));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Deletes the calibration's pods and Secret, and waits (bounded) until
/// the pods are gone.
async fn remove(pods: &Api<Pod>, secrets: &Api<Secret>, names: &[String], secret: &str) {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    if let Err(e) = secrets.delete(secret, &now).await {
        tracing::warn!(secret, error = %e, "cannot delete the calibration's Secret");
    }
    for n in names {
        if let Err(e) = pods.delete(n, &now).await {
            tracing::warn!(pod = %n, error = %e, "cannot delete a calibration pod");
        }
    }
    let until = Instant::now() + Duration::from_secs(60);
    for n in names {
        while Instant::now() < until && pods.get_opt(n).await.ok().flatten().is_some() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Seconds past its pods' deadline after which a calibration's Secret
/// can belong to no live run (its client died: a CLI interrupted, an
/// operator that lost its lease): the next run removes it and what it
/// left. Chosen: a minute for the pods' deletion.
const STALE_AFTER_DEADLINE_SECONDS: i64 = 60;

/// Creates the calibration's Secret, the run's lock. A Secret left by a
/// run that can no longer be alive (older than the pods' deadline + a
/// minute) is removed with the pods it left, and the lock taken; a younger
/// one is [`Error::Busy`].
async fn lock(
    pods: &Api<Pod>,
    secrets: &Api<Secret>,
    fleet: &ConnectionFleet,
    token: &str,
    deadline: i64,
) -> Result<Secret, Error> {
    let name = secret_name(&fleet.name_any());
    let secret = admin_secret(fleet, token);
    match secrets.create(&PostParams::default(), &secret).await {
        Err(kube::Error::Api(ref a)) if a.code == 409 => {}
        created => return created.map_err(kube("create the calibration's admin Secret")),
    }
    let held = secrets
        .get_opt(&name)
        .await
        .map_err(kube("read the calibration's admin Secret"))?;
    let age = held
        .as_ref()
        .and_then(|s| s.metadata.creation_timestamp.as_ref())
        .map_or(0, |t| Timestamp::now().duration_since(t.0).as_secs());
    if held.is_some() && age <= deadline + STALE_AFTER_DEADLINE_SECONDS {
        return Err(Error::Busy(name));
    }
    let left = pods
        .list(&kube::api::ListParams::default().labels(&format!("{LABEL}={}", fleet.name_any())))
        .await
        .map_err(kube("list the calibration's pods"))?;
    let left: Vec<String> = left.items.iter().map(|p| p.name_any()).collect();
    tracing::info!(secret = %name, age, pods = ?left, "removing what a calibration that is no longer running left");
    remove(pods, secrets, &left, &name).await;
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .map_err(|e| match e {
            kube::Error::Api(ref a) if a.code == 409 => Error::Busy(name.clone()),
            e => kube("create the calibration's admin Secret")(e),
        })
}

/// Runs a calibration of `fleet` on the cluster `client` reaches, its shard
/// planned as the operator plans it on nodes like `facts`
/// ([`plan::capacity::plan_in_cluster`]), and removes its pods whatever the
/// outcome.
pub async fn run(
    client: &Client,
    fleet: &ConnectionFleet,
    facts: (NodeFacts, NodeSource),
    policy: &Policy,
    options: &Options,
) -> Result<Outcome, Error> {
    let plan = plan::capacity::plan_in_cluster(&fleet.spec, facts, policy)?;
    let (steps, slow) = steps(&plan, &options.steps, options.slow_readers)?;
    let ns = fleet.namespace().unwrap_or_else(|| "default".into());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let deadline = options.deadline_seconds();
    let started = Instant::now();
    let until = started + options.timeout;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random source works");
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let secret = lock(&pods, &secrets, fleet, &token, deadline).await?;
    let shard = pods
        .create(
            &PostParams::default(),
            &shard_pod(fleet, &plan, policy, deadline),
        )
        .await
        .map_err(kube("create the shard pod"));
    let shard = match shard {
        Ok(shard) => shard,
        Err(e) => {
            remove(&pods, &secrets, &[], &secret.name_any()).await;
            return Err(e);
        }
    };
    let mut created = vec![shard.name_any()];
    let result = measure(
        &pods,
        fleet,
        options,
        &plan,
        &shard,
        &steps,
        slow,
        until,
        &mut created,
    )
    .await;
    remove(&pods, &secrets, &created, &secret.name_any()).await;
    let (node, image_id, report) = result?;
    let seconds = started.elapsed().as_secs_f64();
    let fit = calibration::fit(&report)?;
    if let Some(e) = report.error {
        return Err(Error::Probe(format!(
            "{e} (reached {} idle connections)",
            fit.connections
        )));
    }
    let measured =
        calibration::with_user_bytes(&fleet.spec, fit.per_connection.user.round() as i64);
    let calibrated = plan::capacity::plan_in_cluster(&measured, facts, policy)?;
    Ok(Outcome {
        image: fleet.spec.server.image.clone(),
        plan,
        calibrated,
        node,
        image_id,
        fit,
        seconds,
    })
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    pods: &Api<Pod>,
    fleet: &ConnectionFleet,
    options: &Options,
    plan: &Plan,
    shard: &Pod,
    steps: &[u64],
    slow: u64,
    until: Instant,
    created: &mut Vec<String>,
) -> Result<(String, String, Report), Error> {
    let name = shard.name_any();
    let deadline = options.deadline_seconds();
    let running = watch(pods, &name, until, |p| {
        if ready(p) {
            Some(Ok(p.clone()))
        } else {
            stuck(p).map(Err)
        }
    })
    .await?;
    let shard = match running {
        Ok(Ok(p)) => p,
        Ok(Err(reason)) => return Err(Error::NeverReady { pod: name, reason }),
        Err(p) => {
            let phase = p.status.and_then(|s| s.phase).unwrap_or_default();
            let reason = format!("not Ready within {:?} (phase {phase})", options.timeout);
            return Err(Error::NeverReady { pod: name, reason });
        }
    };
    let status = shard.status.as_ref().expect("a Ready pod has a status");
    let node = shard
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let ip = status.pod_ip.clone().unwrap_or_default();
    let image_id = statuses(&shard)
        .first()
        .map(|c| c.image_id.clone())
        .unwrap_or_default();
    let uid = shard.uid().unwrap_or_default();
    let probe = probe_pod(
        fleet,
        &options.probe_image,
        &node,
        &uid,
        &ip,
        steps,
        slow,
        deadline,
    );
    let probe = pods
        .create(&PostParams::default(), &probe)
        .await
        .map_err(kube("create the probe pod"))?;
    let probe_name = probe.name_any();
    created.push(probe_name.clone());
    let ended = watch(pods, &probe_name, until, |p| {
        let ended = statuses(p).first().and_then(|c| {
            let t = c.state.as_ref()?.terminated.as_ref()?;
            Some(Ok(t.message.clone().unwrap_or_default()))
        });
        // Refused by the kubelet (OutOfcpu, OutOfmemory) or past its
        // deadline before its container ran.
        let status = p.status.as_ref();
        let failed = status
            .filter(|s| s.phase.as_deref() == Some("Failed"))
            .map(|s| {
                Err(format!(
                    "pod Failed: {} {}",
                    s.reason.as_deref().unwrap_or_default(),
                    s.message.as_deref().unwrap_or_default()
                ))
            });
        ended.or(failed)
    })
    .await?;
    let ended = match ended {
        Ok(Err(reason)) => {
            return Err(Error::NoReport {
                pod: probe_name,
                reason,
            });
        }
        Ok(Ok(message)) => Ok(message),
        Err(p) => Err(p),
    };
    let message = ended.map_err(|p| Error::NoReport {
        pod: probe_name.clone(),
        reason: format!(
            "not finished within {:?} (phase {})",
            options.timeout,
            p.status.and_then(|s| s.phase).unwrap_or_default()
        ),
    })?;
    // The report is the last line (FallbackToLogsOnError may add log lines).
    let line = message
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_default();
    let report: Report = serde_json::from_str(line).map_err(|e| Error::NoReport {
        pod: probe_name.clone(),
        reason: format!("{e}: {message:?}"),
    })?;
    // A probe that stopped early may have lost its shard: the kubelet
    // reports the shard's end (and an OOM kill) a relist or more after the
    // probe saw its connections reset, so wait for the end, bounded, unless
    // the kernel's counter already said so.
    let shard_now = if report.error.is_some() && report.oom_kills == 0 {
        let until = until.min(Instant::now() + SHARD_END_WAIT);
        watch(pods, &name, until, |p| {
            container_ended(p).then(|| p.clone())
        })
        .await?
        .unwrap_or_else(|p| p)
    } else {
        pods.get(&name)
            .await
            .map_err(kube(format!("get pod {name}")))?
    };
    if let Some(evidence) = oom_evidence(&report, &shard_now) {
        let last = report.samples.iter().rfind(|s| s.slow_readers == 0);
        return Err(Error::Oom {
            reached: last.map_or(0, |s| s.idle_connections),
            pod_bytes: last.map_or(0, |s| s.pod_bytes),
            limit: plan.memory_limit_bytes,
            evidence,
        });
    }
    Ok((node, image_id, report))
}

/// `status.calibration` for `outcome`, a run of `fleet` as it asked
/// (`spec.backend.calibrate`), ended at `at`.
pub fn status_of(fleet: &ConnectionFleet, outcome: &Outcome, at: Timestamp) -> CalibrationStatus {
    let bytes = |b: &Bytes| CalibratedBytes {
        user: b.user.round() as i64,
        kernel: b.kernel.round() as i64,
        pod: b.pod.round() as i64,
    };
    let backend = &fleet.spec.backend;
    let fit = &outcome.fit;
    CalibrationStatus {
        image: outcome.image.clone(),
        image_id: outcome.image_id.clone(),
        model: backend.model,
        protocol: backend.protocol,
        requested: backend.calibrate.unwrap_or_default(),
        node: outcome.node.clone(),
        cgroup_mode: fit.cgroup_mode.clone(),
        socket_accounted: fit.socket_accounted,
        connections: fit.connections as i64,
        slow_readers: fit.slow_readers as i64,
        per_connection: bytes(&fit.per_connection),
        per_slow_reader: fit.per_slow_reader.as_ref().map(bytes),
        pod_slope_percent: (fit.pod_slope * 1000.0).round() / 10.0,
        time: Time(at),
        duration_seconds: outcome.seconds.round() as i64,
    }
}

/// Seconds a run the operator starts may take (both pods'
/// `activeDeadlineSeconds`): 10 minutes, room for a cold image pull and
/// a probe at the node's full nofile. Chosen.
pub const OPERATOR_TIMEOUT: Duration = Duration::from_secs(600);

/// Seconds before a failed run of an unchanged spec is tried again (a
/// change of the image, model, protocol or `spec.backend.calibrate` runs
/// it at once). Chosen: no retry loop, yet a node that was full gets
/// another chance.
pub const RETRY_SECONDS: i64 = 600;

type Key = (String, String);

struct Run {
    asked: calibration::Asked,
    since: Timestamp,
    ended: Option<(Timestamp, Result<CalibrationStatus, calibration::Failure>)>,
}

/// The calibrations this operator process runs (`spec.backend.calibrate`),
/// by fleet. Only the leader reconciles, so only the leader starts them; a
/// process that stops mid-run leaves its pods to their
/// `activeDeadlineSeconds` and its Secret to the next run, which takes it
/// over once stale ([`lock`]).
#[derive(Clone, Default)]
pub struct Runs(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Key, Run>>>);

fn key(fleet: &ConnectionFleet) -> Key {
    (fleet.namespace().unwrap_or_default(), fleet.name_any())
}

impl Runs {
    /// The latest measurement of `fleet`: a run of this process that ended
    /// well and is not in the status yet, else `status.calibration`.
    pub fn latest(&self, fleet: &ConnectionFleet) -> Option<CalibrationStatus> {
        let stored = fleet.status.as_ref().and_then(|s| s.calibration.clone());
        let mut runs = self.0.lock().unwrap();
        let k = key(fleet);
        let ran = match runs.get(&k).and_then(|r| r.ended.as_ref()) {
            Some((_, Ok(c))) => c.clone(),
            _ => return stored,
        };
        if stored.as_ref() == Some(&ran) {
            runs.remove(&k);
        }
        Some(ran)
    }

    /// What `fleet`'s calibration is doing, given its `latest` measurement;
    /// starts a run (planned on nodes like `facts`) when one is due. Does
    /// nothing and says [`calibration::State::NotAsked`] without
    /// `spec.backend.calibrate`.
    pub fn tick(
        &self,
        client: &Client,
        fleet: &ConnectionFleet,
        latest: Option<&CalibrationStatus>,
        facts: (NodeFacts, NodeSource),
        policy: &Policy,
        now: Timestamp,
    ) -> calibration::State {
        let Some(asked) = calibration::Asked::of(&fleet.spec) else {
            return calibration::State::NotAsked;
        };
        let k = key(fleet);
        let mut runs = self.0.lock().unwrap();
        let run = runs.get(&k).map(|r| {
            let ended = r.ended.as_ref();
            let ended = ended.map(|(at, result)| (*at, result.as_ref().err().cloned()));
            (r.asked == asked, r.since, ended)
        });
        let idle = run.as_ref().is_none_or(|(_, _, ended)| ended.is_some());
        let next = calibration::next(&asked, latest, run, now, RETRY_SECONDS);
        if let calibration::State::Running { since, .. } = &next
            && idle
        {
            runs.insert(
                k.clone(),
                Run {
                    asked: asked.clone(),
                    since: *since,
                    ended: None,
                },
            );
            self.spawn(client, fleet, facts, policy, asked);
        }
        next
    }

    fn spawn(
        &self,
        client: &Client,
        fleet: &ConnectionFleet,
        facts: (NodeFacts, NodeSource),
        policy: &Policy,
        asked: calibration::Asked,
    ) {
        let (client, fleet, policy, runs) =
            (client.clone(), fleet.clone(), policy.clone(), self.clone());
        let requested = fleet.spec.backend.calibrate.unwrap_or_default();
        let options = Options {
            steps: requested
                .connections
                .map_or_else(Vec::new, |n| vec![n as u64 / 2, n as u64]),
            slow_readers: requested.slow_readers.map(|n| n as u64),
            probe_image: policy.calibration_probe_image.clone(),
            timeout: OPERATOR_TIMEOUT,
        };
        tokio::spawn(async move {
            let k = key(&fleet);
            tracing::info!(fleet = %k.1, namespace = %k.0, image = %asked.image, "calibration started");
            let result = run(&client, &fleet, facts, &policy, &options).await;
            let at = Timestamp::now();
            let ended = match result {
                Ok(outcome) => {
                    let c = status_of(&fleet, &outcome, at);
                    tracing::info!(fleet = %k.1, namespace = %k.0, user = c.per_connection.user,
                        kernel = c.per_connection.kernel, pod = c.per_connection.pod,
                        seconds = c.duration_seconds, "calibration measured");
                    Ok(c)
                }
                Err(e) => {
                    tracing::warn!(fleet = %k.1, namespace = %k.0, error = %e, "calibration failed");
                    Err((e.reason(), e.to_string()))
                }
            };
            if let Some(r) = runs.0.lock().unwrap().get_mut(&k) {
                r.ended = Some((at, ended));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> ConnectionFleet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "c10m.dev/v1alpha1",
            "kind": "ConnectionFleet",
            "metadata": {"name": "chat", "namespace": "team-a"},
            "spec": {
                "connections": 100000,
                "backend": {"model": "epoll", "protocol": "websocket"},
                "node": {"memory": "16Gi", "cpus": 4}
            }
        }))
        .unwrap()
    }

    fn planned() -> (ConnectionFleet, Plan) {
        let f = fleet();
        let node = plan::nodes::resolve_sourced(&f.spec, None).unwrap();
        let p = plan::capacity::plan_sourced(&f.spec, node, &Policy::default()).unwrap();
        (f, p)
    }

    #[test]
    fn a_pod_unschedulable_for_a_minute_is_stuck_with_the_schedulers_words() {
        let pod = |seconds_ago: i64| -> Pod {
            let at = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(seconds_ago);
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "chat-calibrate-x"},
                "status": {"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/4 nodes are available: 1 Insufficient cpu.",
                    "lastTransitionTime": Time(at),
                }]}
            }))
            .unwrap()
        };
        assert_eq!(
            stuck(&pod(5)),
            None,
            "room a terminating pod holds may come back"
        );
        let why = stuck(&pod(UNSCHEDULABLE_SECONDS + 1)).unwrap();
        assert!(
            why.starts_with("Unschedulable: 0/4 nodes") && why.contains("Insufficient cpu"),
            "{why}"
        );
    }

    #[test]
    fn a_shard_ends_when_its_container_terminates_and_an_oom_kill_says_so() {
        let pod = |state: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "chat-calibrate-x"},
                "status": {"phase": "Running", "containerStatuses": [{
                    "name": "server", "image": "c10m/goecho:0.1.0", "imageID": "",
                    "ready": false, "restartCount": 0, "state": state,
                }]}
            }))
            .unwrap()
        };
        let running = pod(serde_json::json!({"running": {}}));
        assert!(!container_ended(&running) && !oom_killed(&running));
        let killed =
            pod(serde_json::json!({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}));
        assert!(container_ended(&killed) && oom_killed(&killed));
        let failed = pod(serde_json::json!({"terminated": {"exitCode": 1, "reason": "Error"}}));
        assert!(container_ended(&failed) && !oom_killed(&failed));
        // The kernel's count decides when the runtime lost the OOM event.
        let lost = pod(serde_json::json!({"terminated": {"exitCode": 137, "reason": "Error"}}));
        let mut report = Report::default();
        assert_eq!(oom_evidence(&report, &lost), None);
        assert_eq!(oom_evidence(&report, &running), None);
        assert_eq!(
            oom_evidence(&report, &killed).as_deref(),
            Some("container server exited 137 (OOMKilled)")
        );
        report.oom_kills = 1;
        assert_eq!(
            oom_evidence(&report, &lost).as_deref(),
            Some(
                "the kernel counted 1 OOM kill(s) in the pod; container server exited 137 (Error)"
            )
        );
        assert_eq!(
            oom_evidence(&report, &running).as_deref(),
            Some(
                "the kernel counted 1 OOM kill(s) in the pod; the runtime has not reported its end"
            )
        );
        let unknown: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "x"}})).unwrap();
        assert!(!container_ended(&unknown));
    }

    #[test]
    fn default_steps_fit_the_shard_and_the_probe() {
        let (_, mut p) = planned();
        p.node_nofile_hard_limit = 20_000;
        p.shard_connection_limit = 50_000;
        let (s, slow) = steps(&p, &[], None).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s[1] + slow <= 20_000 - PROBE_RESERVED_FDS, "{s:?} {slow}");
        assert_eq!(s[0], s[1] / 2);
        assert_eq!(slow, s[1].div_ceil(100));
    }

    #[test]
    fn steps_past_a_bound_name_it() {
        let (_, mut p) = planned();
        p.node_nofile_hard_limit = 20_000;
        p.shard_connection_limit = 8_000;
        let e = steps(&p, &[4_000, 8_000], None).unwrap_err().to_string();
        assert!(e.contains("shardConnectionLimit 8000"), "{e}");
        p.shard_connection_limit = 50_000;
        let e = steps(&p, &[25_000], Some(0)).unwrap_err().to_string();
        assert!(e.contains("RLIMIT_NOFILE 20000"), "{e}");
        let e = steps(&p, &[5_000, 5_000], None).unwrap_err().to_string();
        assert!(e.contains("ascending"), "{e}");
    }

    #[test]
    fn the_shard_pod_is_the_rendered_template_under_calibration_labels() {
        let (f, p) = planned();
        let pod = shard_pod(&f, &p, &Policy::default(), 300);
        let rendered = render::render(&f, &p, OwnerReference::default(), 1, &Policy::default());
        let template = rendered.deployment.spec.unwrap().template.spec.unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(spec.containers, template.containers);
        assert_eq!(spec.init_containers, template.init_containers);
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.active_deadline_seconds, Some(300));
        let labels = pod.metadata.labels.unwrap();
        let selector = rendered.service.spec.unwrap().selector.unwrap();
        assert!(
            selector.iter().any(|(k, v)| labels.get(k) != Some(v)),
            "the fleet's Service must not select a calibration pod"
        );
        assert_eq!(labels[LABEL], "chat");
        let secrets: Vec<_> = spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.secret.as_ref()?.secret_name.clone())
            .collect();
        assert_eq!(secrets, vec!["chat-calibration-admin".to_string()]);
        assert_eq!(pod.metadata.namespace.as_deref(), Some("team-a"));
    }

    #[test]
    fn the_probe_pod_aims_at_the_shard_with_the_wire_flags() {
        let f = fleet();
        let pod = probe_pod(
            &f,
            "c10m/loadgen:1",
            "node-1",
            "u-1",
            "10.0.0.9",
            &[10, 20],
            1,
            120,
        );
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(spec.host_pid, Some(true));
        let args = spec.containers[0].args.clone().unwrap();
        let port = f.spec.server.port;
        assert_eq!(
            args,
            vec![
                format!("--target=10.0.0.9:{port}"),
                "--protocol=websocket".into(),
                "--pod-uid=u-1".into(),
                "--steps=10,20".into(),
                "--slow-readers=1".into(),
                "--timeout-seconds=105".into(),
            ]
        );
    }
}
