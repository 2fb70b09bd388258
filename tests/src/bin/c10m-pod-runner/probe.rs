//! The kubelet's readiness prober, for the servers the pod runner runs.
//!
//! KWOK marks a pod Ready when it starts it and never looks again, so on
//! the KWOK nodes a shard that answers its readiness probe with 503 (a
//! cordon, a drain) stayed Ready in the API: in the Service's endpoints and,
//! for the Deployment and ReplicaSet controllers, available. A kubelet
//! probes and reports the result in the pod's `Ready` and `ContainersReady`
//! conditions. The runner now does the same for each server it runs, with
//! the container's `readinessProbe` (`httpGet` only, the kind every
//! rendered shard has): every `periodSeconds`, a `GET` within
//! `timeoutSeconds`; a 2xx or 3xx answer is a success; `failureThreshold`
//! failures in a row make the pod NotReady, `successThreshold` successes
//! make it Ready again (the field defaults are the API's: 10 s, 1 s, 3, 1).
//!
//! One difference is kept on purpose: the prober starts reporting only
//! after the server's first successful probe. KWOK has already said Ready
//! before the server listens, and a kubelet would not have; reporting the
//! failures before the first success would flip a new pod
//! Ready → NotReady → Ready. Tests that need a listening server still check
//! it themselves (tests/tests/rollout.rs counts a shard only once it
//! answers).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

/// A container's HTTP readiness probe, resolved against its pod's IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `http://<pod IP>:<port><path>`.
    pub url: String,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
    pub success_threshold: u32,
}

/// Field defaults of `v1.Probe` (the API server's defaulting).
const DEFAULT_PERIOD_SECONDS: i32 = 10;
const DEFAULT_TIMEOUT_SECONDS: i32 = 1;
const DEFAULT_FAILURE_THRESHOLD: i32 = 3;
const DEFAULT_SUCCESS_THRESHOLD: i32 = 1;

impl Probe {
    /// The container's `readinessProbe.httpGet` against `ip`; `None` without
    /// one, with another probe kind, or with a named port the container
    /// does not declare.
    pub fn of(container: &Container, ip: &str) -> Option<Probe> {
        let probe = container.readiness_probe.as_ref()?;
        let get = probe.http_get.as_ref()?;
        let port = match &get.port {
            IntOrString::Int(p) => *p,
            IntOrString::String(name) => {
                container
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(name.as_str()))?
                    .container_port
            }
        };
        let path = get.path.as_deref().unwrap_or("/");
        let secs = |v: Option<i32>, d: i32| Duration::from_secs(v.unwrap_or(d).max(1) as u64);
        let count = |v: Option<i32>, d: i32| v.unwrap_or(d).max(1) as u32;
        Some(Probe {
            url: format!("http://{ip}:{port}{path}"),
            period: secs(probe.period_seconds, DEFAULT_PERIOD_SECONDS),
            timeout: secs(probe.timeout_seconds, DEFAULT_TIMEOUT_SECONDS),
            failure_threshold: count(probe.failure_threshold, DEFAULT_FAILURE_THRESHOLD),
            success_threshold: count(probe.success_threshold, DEFAULT_SUCCESS_THRESHOLD),
        })
    }

    /// One probe: whether `GET url` answered 2xx or 3xx within the timeout.
    /// Blocking; run it off the runner's loop.
    pub fn call(&self) -> bool {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .proxy(None)
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(self.timeout))
            .build()
            .into();
        agent
            .get(&self.url)
            .call()
            .is_ok_and(|r| (200..400).contains(&r.status().as_u16()))
    }
}

/// A server's probe results, and the readiness they give.
#[derive(Debug)]
pub struct Readiness {
    pub probe: Probe,
    /// When the next probe is due.
    pub next: Instant,
    /// A probe is under way.
    pub in_flight: bool,
    successes: u32,
    failures: u32,
    /// The readiness the results give, once the server answered a probe
    /// once; `None` before (KWOK's word stands).
    ready: Option<bool>,
}

impl Readiness {
    pub fn new(probe: Probe, now: Instant) -> Readiness {
        Readiness {
            probe,
            next: now,
            in_flight: false,
            successes: 0,
            failures: 0,
            ready: None,
        }
    }

    /// Whether a probe is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        !self.in_flight && now >= self.next
    }

    /// Marks a probe started at `now`.
    pub fn started(&mut self, now: Instant) {
        self.in_flight = true;
        self.next = now + self.probe.period;
    }

    /// Counts a probe's result.
    pub fn observe(&mut self, ok: bool) {
        self.in_flight = false;
        if ok {
            self.successes += 1;
            self.failures = 0;
            if self.ready.is_none() || self.successes >= self.probe.success_threshold {
                self.ready = Some(true);
            }
        } else {
            self.failures += 1;
            self.successes = 0;
            if self.ready.is_some() && self.failures >= self.probe.failure_threshold {
                self.ready = Some(false);
            }
        }
    }

    /// The readiness to report, once there is one.
    pub fn ready(&self) -> Option<bool> {
        self.ready
    }
}

/// The pod's `Ready` condition status, if set.
pub fn pod_ready(pod: &Pod) -> Option<bool> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let ready = conditions.iter().find(|c| c.type_ == "Ready")?;
    Some(ready.status == "True")
}

/// A JSON merge patch of the pod's status that reports `ready` as a
/// kubelet does: the `Ready` and `ContainersReady` conditions (their
/// transition time `now`, their reason and message the kubelet's when not
/// ready) and each container status's `ready`. Merge patches replace lists
/// whole, so the other conditions and container statuses are copied from
/// `pod`.
pub fn status_patch(pod: &Pod, ready: bool, now: Time) -> Value {
    let status = pod.status.clone().unwrap_or_default();
    let names: Vec<String> = (status.container_statuses.iter().flatten())
        .map(|c| c.name.clone())
        .collect();
    let mut conditions = status.conditions.unwrap_or_default();
    for kind in ["Ready", "ContainersReady"] {
        let value = if ready { "True" } else { "False" };
        let condition = PodCondition {
            type_: kind.to_string(),
            status: value.to_string(),
            last_transition_time: Some(now.clone()),
            reason: (!ready).then(|| "ContainersNotReady".to_string()),
            message: (!ready)
                .then(|| format!("containers with unready status: [{}]", names.join(" "))),
            ..Default::default()
        };
        match conditions.iter_mut().find(|c| c.type_ == kind) {
            Some(c) if c.status == value => {}
            Some(c) => *c = condition,
            None => conditions.push(condition),
        }
    }
    let mut containers = status.container_statuses.unwrap_or_default();
    for c in &mut containers {
        c.ready = ready;
    }
    json!({"status": {"conditions": conditions, "containerStatuses": containers}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerPort, ContainerStatus, HTTPGetAction, PodStatus, Probe as KubeProbe,
    };

    fn container(port: IntOrString, failure: Option<i32>) -> Container {
        Container {
            name: "server".into(),
            ports: Some(vec![ContainerPort {
                name: Some("admin".into()),
                container_port: 9090,
                ..Default::default()
            }]),
            readiness_probe: Some(KubeProbe {
                http_get: Some(HTTPGetAction {
                    path: Some("/healthz".into()),
                    port,
                    ..Default::default()
                }),
                period_seconds: Some(1),
                failure_threshold: failure,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_probe_resolves_named_ports_and_takes_the_api_defaults() {
        let p = Probe::of(
            &container(IntOrString::String("admin".into()), None),
            "127.0.1.2",
        )
        .unwrap();
        assert_eq!(p.url, "http://127.0.1.2:9090/healthz");
        assert_eq!(p.period, Duration::from_secs(1));
        assert_eq!(p.timeout, Duration::from_secs(1));
        assert_eq!((p.failure_threshold, p.success_threshold), (3, 1));
        assert!(
            Probe::of(
                &container(IntOrString::String("web".into()), None),
                "127.0.1.2"
            )
            .is_none()
        );
        assert!(Probe::of(&Container::default(), "127.0.1.2").is_none());
    }

    #[test]
    fn readiness_follows_the_thresholds_only_after_a_first_success() {
        let probe = Probe::of(&container(IntOrString::Int(9090), Some(2)), "127.0.1.2").unwrap();
        let now = Instant::now();
        let mut r = Readiness::new(probe, now);
        assert!(r.due(now));
        r.started(now);
        assert!(!r.due(now + Duration::from_secs(5)), "one probe at a time");
        // Not listening yet: KWOK's Ready stands.
        r.observe(false);
        r.observe(false);
        assert_eq!(r.ready(), None);
        assert!(r.due(now + Duration::from_secs(1)));
        r.observe(true);
        assert_eq!(r.ready(), Some(true));
        // Cordoned: NotReady after two failures in a row, not one.
        r.observe(false);
        assert_eq!(r.ready(), Some(true));
        r.observe(true);
        r.observe(false);
        r.observe(false);
        assert_eq!(r.ready(), Some(false));
        r.observe(true);
        assert_eq!(r.ready(), Some(true));
    }

    #[test]
    fn the_patch_reports_readiness_as_a_kubelet_does_and_keeps_the_rest() {
        let condition = |t: &str, s: &str| PodCondition {
            type_: t.into(),
            status: s.into(),
            ..Default::default()
        };
        let pod = Pod {
            status: Some(PodStatus {
                conditions: Some(vec![
                    condition("Initialized", "True"),
                    condition("Ready", "True"),
                    condition("ContainersReady", "True"),
                ]),
                container_statuses: Some(vec![ContainerStatus {
                    name: "server".into(),
                    ready: true,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(pod_ready(&pod), Some(true));
        let now = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap());
        let patch = status_patch(&pod, false, now);
        let conditions = patch["status"]["conditions"].as_array().unwrap();
        assert_eq!(conditions.len(), 3);
        assert_eq!(conditions[0]["type"], "Initialized");
        assert_eq!(conditions[0]["status"], "True");
        for c in &conditions[1..] {
            assert_eq!(c["status"], "False", "{c}");
            assert_eq!(c["reason"], "ContainersNotReady", "{c}");
            assert_eq!(
                c["message"], "containers with unready status: [server]",
                "{c}"
            );
            assert_eq!(c["lastTransitionTime"], "2027-01-15T08:00:00Z", "{c}");
        }
        assert_eq!(patch["status"]["containerStatuses"][0]["ready"], false);
        assert_eq!(patch["status"]["containerStatuses"][0]["name"], "server");
    }
}
