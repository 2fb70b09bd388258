//! Calibration's pure step: from the samples the calibration probe took of
//! one shard pod (`c10m_wire::calibrate::Report`), the bytes one idle
//! connection and one slow reader really cost, and how the cost moves with
//! the connection count. The client step (`crate::calibrate`) runs the pods
//! and reads the report; this module only does arithmetic, so it is unit-
//! and property-tested.
//!
//! Every figure is a difference between samples of the same pod, so what
//! does not depend on connections (the binary's pages, the runtime's heap,
//! the pause container) cancels out.
//!
//! It also decides, for a fleet with `spec.backend.calibrate`, whether its
//! last calibration still measures what the spec runs ([`Asked`]), what
//! the operator does next ([`next`]) and the spec the plan sizes from
//! ([`sized_by`]).

use c10m_wire::calibrate::{Report, Sample};
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::api::status::CalibrationStatus;
use crate::api::{BackendModel, Calibrate, ConnectionFleetSpec, Protocol};
use crate::reason::Reason;

/// What a calibration measures under: the spec fields that make a
/// calibration stale when they change.
#[derive(Clone, Debug, PartialEq)]
pub struct Asked {
    /// `spec.server.image`.
    pub image: String,
    /// `spec.backend.model`.
    pub model: BackendModel,
    /// `spec.backend.protocol`.
    pub protocol: Protocol,
    /// `spec.backend.calibrate`.
    pub requested: Calibrate,
}

impl Asked {
    /// What `spec` asks to calibrate; `None` without `spec.backend.calibrate`.
    pub fn of(spec: &ConnectionFleetSpec) -> Option<Asked> {
        Some(Asked {
            image: spec.server.image.clone(),
            model: spec.backend.model,
            protocol: spec.backend.protocol,
            requested: spec.backend.calibrate?,
        })
    }

    /// Why `c` does not measure what this asks, naming the field; `None`
    /// when it does.
    pub fn differs(&self, c: &CalibrationStatus) -> Option<String> {
        if self.image != c.image {
            Some(format!(
                "spec.server.image is {}; the last calibration measured {}",
                self.image, c.image
            ))
        } else if self.model != c.model {
            Some(format!(
                "spec.backend.model is {:?}; the last calibration measured {:?}",
                self.model, c.model
            ))
        } else if self.protocol != c.protocol {
            Some(format!(
                "spec.backend.protocol is {:?}; the last calibration measured {:?}",
                self.protocol, c.protocol
            ))
        } else if self.requested != c.requested {
            Some(format!(
                "spec.backend.calibrate is {:?}; the last calibration ran {:?}",
                self.requested, c.requested
            ))
        } else {
            None
        }
    }
}

/// Where a fleet's calibration stands (the `Calibrated` condition).
#[derive(Clone, Debug, PartialEq)]
pub enum State {
    /// No `spec.backend.calibrate`.
    NotAsked,
    /// The last calibration measures what the spec runs.
    Measured,
    /// A run is under way since `since`; `why` it runs (no calibration
    /// yet, or what changed).
    Running {
        /// When it started.
        since: Timestamp,
        /// Why, in words.
        why: String,
    },
    /// The last run for this spec failed at `at`; the next starts at
    /// `retry_at` (or at once on a change).
    Failed {
        /// The condition's reason.
        reason: Reason,
        /// What failed, in words.
        message: String,
        /// When the next run starts.
        retry_at: Timestamp,
    },
}

/// Why a run failed: the `Calibrated` condition's reason, and the error.
pub type Failure = (Reason, String);

/// A run of this operator process as [`next`] sees it: whether it ran
/// for the spec now asked, when it started, and when it ended with which
/// failure (`None`: it measured).
pub type RunSeen = (bool, Timestamp, Option<(Timestamp, Option<Failure>)>);

/// What to do about a fleet asking `asked`, given its `latest`
/// measurement and this process's `run` of it: [`State::Running`] with
/// `since == now` means start one (the caller starts it).
pub fn next(
    asked: &Asked,
    latest: Option<&CalibrationStatus>,
    run: Option<RunSeen>,
    now: Timestamp,
    retry_seconds: i64,
) -> State {
    let why = match latest.map(|c| asked.differs(c)) {
        Some(None) => return State::Measured,
        Some(Some(why)) => why,
        None => "no calibration yet".to_string(),
    };
    match run {
        Some((same, since, None)) => State::Running {
            since,
            why: if same {
                why
            } else {
                format!("{why}; a run for the spec before is still under way")
            },
        },
        Some((true, _, Some((at, Some((reason, message))))))
            if now.as_second() < at.as_second() + retry_seconds =>
        {
            State::Failed {
                reason,
                message,
                retry_at: Timestamp::from_second(at.as_second() + retry_seconds).unwrap_or(now),
            }
        }
        _ => State::Running { since: now, why },
    }
}

/// The spec the plan sizes from: with `spec.backend.calibrate` and a
/// measurement, `spec` with the measured user bytes as
/// `backend.userBytesPerConnection` (the last measurement also while a
/// newer one runs or failed: the last good plan is kept); else `None`.
pub fn sized_by(
    spec: &ConnectionFleetSpec,
    latest: Option<&CalibrationStatus>,
) -> Option<ConnectionFleetSpec> {
    let c = latest.filter(|_| spec.backend.calibrate.is_some())?;
    Some(with_user_bytes(spec, c.per_connection.user))
}

/// `spec` with `user` bytes (clamped at 0) as
/// `backend.userBytesPerConnection`: what a plan from a measurement sizes
/// from (the operator's, [`sized_by`], and the CLI's "after" plan).
pub fn with_user_bytes(spec: &ConnectionFleetSpec, user: i64) -> ConnectionFleetSpec {
    let mut sized = spec.clone();
    sized.backend.user_bytes_per_connection = Some(user.max(0));
    sized
}

/// Bytes per connection, in user space, in the kernel (as charged to the
/// pod's memory cgroup), and in the pod's memory cgroup as a whole.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Bytes {
    /// Anonymous memory (`total_rss` / `anon`).
    pub user: f64,
    /// Kernel memory charged to the pod (kmem, with TCP when accounted).
    pub kernel: f64,
    /// The pod's memory cgroup usage.
    pub pod: f64,
}

impl Bytes {
    fn delta(to: &Sample, from: &Sample, per: f64) -> Bytes {
        let d = |a: u64, b: u64| (a as f64 - b as f64) / per;
        Bytes {
            user: d(to.user_bytes, from.user_bytes),
            kernel: d(to.kernel_bytes, from.kernel_bytes),
            pod: d(to.pod_bytes, from.pod_bytes),
        }
    }
}

/// The cost at one step: what `connections` idle connections cost each,
/// counted from the sample at 0.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// Idle connections held at this sample.
    pub connections: u64,
    /// (bytes at this step − bytes at 0) ÷ connections.
    pub per_connection: Bytes,
}

/// What a calibration measured.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Fit {
    /// The host's memory cgroup version (`v1`, `v2`).
    pub cgroup_mode: String,
    /// Whether TCP socket memory was charged to the pod.
    pub socket_accounted: bool,
    /// Most idle connections held at once.
    pub connections: u64,
    /// Bytes per idle connection: the least-squares slope of bytes against
    /// connections over every idle sample (0 included).
    pub per_connection: Bytes,
    /// Each step's own per-connection figure, ascending by connections.
    pub steps: Vec<Step>,
    /// How the per-connection figure of the pod changes between the
    /// smallest and the largest step, relative (0.05 = 5 % more per
    /// connection at the largest step). 0 with a single step.
    pub pod_slope: f64,
    /// Slow readers opened after the last step (0: none measured).
    pub slow_readers: u64,
    /// Bytes per slow reader beyond an idle connection, when measured.
    pub per_slow_reader: Option<Bytes>,
}

/// Why the samples give no figure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// The probe stopped before it held any connection.
    #[error("the probe held no connection: {0}")]
    NoConnections(String),
    /// The report has no sample at 0 connections to count from.
    #[error("the probe's report has no sample at 0 connections")]
    NoBaseline,
}

/// Least-squares slope of `y` against `x`; `None` when every `x` is equal.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Fits a probe report. The idle samples (no slow reader yet) give the
/// per-connection figures; the sample after the slow readers gives the
/// per-slow-reader one, against the last idle sample. A report whose probe
/// stopped early still fits from the samples it took, as long as one of
/// them holds connections: `connections` then says how far it got.
///
/// Errors: [`FitError::NoBaseline`] without a sample at 0 connections,
/// [`FitError::NoConnections`] when no idle sample holds any.
pub fn fit(report: &Report) -> Result<Fit, FitError> {
    let idle: Vec<&Sample> = report
        .samples
        .iter()
        .filter(|s| s.slow_readers == 0)
        .collect();
    let base = idle
        .iter()
        .find(|s| s.idle_connections == 0)
        .ok_or(FitError::NoBaseline)?;
    let mut steps: Vec<Step> = idle
        .iter()
        .filter(|s| s.idle_connections > 0)
        .map(|s| Step {
            connections: s.idle_connections,
            per_connection: Bytes::delta(s, base, s.idle_connections as f64),
        })
        .collect();
    steps.sort_by_key(|s| s.connections);
    let Some(last) = steps.last().copied() else {
        return Err(FitError::NoConnections(
            report.error.clone().unwrap_or_else(|| "no step".into()),
        ));
    };
    let line = |f: fn(&Sample) -> u64| {
        let points: Vec<(f64, f64)> = idle
            .iter()
            .map(|s| (s.idle_connections as f64, f(s) as f64))
            .collect();
        slope(&points).expect("a sample at 0 and one above it")
    };
    let per_connection = Bytes {
        user: line(|s| s.user_bytes),
        kernel: line(|s| s.kernel_bytes),
        pod: line(|s| s.pod_bytes),
    };
    let first = steps[0];
    let pod_slope = if first.per_connection.pod > 0.0 {
        last.per_connection.pod / first.per_connection.pod - 1.0
    } else {
        0.0
    };
    let last_idle = idle
        .iter()
        .max_by_key(|s| s.idle_connections)
        .expect("a step exists");
    let slow = report
        .samples
        .iter()
        .filter(|s| s.slow_readers > 0)
        .max_by_key(|s| s.slow_readers);
    Ok(Fit {
        cgroup_mode: report.cgroup_mode.clone(),
        socket_accounted: report.socket_accounted,
        connections: last.connections,
        per_connection,
        steps,
        pod_slope,
        slow_readers: slow.map_or(0, |s| s.slow_readers),
        per_slow_reader: slow.map(|s| Bytes::delta(s, last_idle, s.slow_readers as f64)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::status::CalibratedBytes;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use proptest::prelude::*;

    fn spec(calibrate: serde_json::Value) -> ConnectionFleetSpec {
        serde_json::from_value(serde_json::json!({
            "connections": 100000,
            "backend": {"model": "goroutine", "calibrate": calibrate},
            "server": {"image": "team/chat:1"}
        }))
        .unwrap()
    }

    fn measured(s: &ConnectionFleetSpec) -> CalibrationStatus {
        CalibrationStatus {
            image: s.server.image.clone(),
            image_id: "sha256:1".into(),
            model: s.backend.model,
            protocol: s.backend.protocol,
            requested: s.backend.calibrate.unwrap_or_default(),
            node: "n".into(),
            cgroup_mode: "v2".into(),
            socket_accounted: true,
            connections: 16000,
            slow_readers: 160,
            per_connection: CalibratedBytes {
                user: 3916,
                kernel: 1500,
                pod: 5400,
            },
            per_slow_reader: None,
            pod_slope_percent: 0.4,
            time: Time(Timestamp::UNIX_EPOCH),
            duration_seconds: 31,
        }
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn a_change_of_image_model_protocol_or_request_makes_a_calibration_stale() {
        let s = spec(serde_json::json!({"connections": 16000}));
        let c = measured(&s);
        let asked = Asked::of(&s).unwrap();
        assert_eq!(asked.differs(&c), None);
        let mut image = s.clone();
        image.server.image = "team/chat:2".into();
        let why = Asked::of(&image).unwrap().differs(&c).unwrap();
        assert!(
            why.contains("spec.server.image is team/chat:2") && why.contains("team/chat:1"),
            "{why}"
        );
        let mut model = s.clone();
        model.backend.model = BackendModel::Custom;
        assert!(
            Asked::of(&model)
                .unwrap()
                .differs(&c)
                .unwrap()
                .contains("spec.backend.model")
        );
        let mut protocol = s.clone();
        protocol.backend.protocol = Protocol::Websocket;
        assert!(
            Asked::of(&protocol)
                .unwrap()
                .differs(&c)
                .unwrap()
                .contains("protocol")
        );
        let more = spec(serde_json::json!({"connections": 18000}));
        assert!(
            Asked::of(&more)
                .unwrap()
                .differs(&c)
                .unwrap()
                .contains("spec.backend.calibrate")
        );
        let mut none = s.clone();
        none.backend.calibrate = None;
        assert_eq!(Asked::of(&none), None);
    }

    #[test]
    fn next_starts_once_waits_for_a_run_and_retries_a_failure_only_after_the_delay() {
        let s = spec(serde_json::json!({}));
        let asked = Asked::of(&s).unwrap();
        let c = measured(&s);
        // Nothing measured, nothing running: start now.
        let start = next(&asked, None, None, at(100), 600);
        assert_eq!(
            start,
            State::Running {
                since: at(100),
                why: "no calibration yet".into()
            }
        );
        // Measured for this spec: nothing to do, whatever ran before.
        assert_eq!(next(&asked, Some(&c), None, at(100), 600), State::Measured);
        // A run under way is waited for, not started again.
        let running = next(&asked, None, Some((true, at(50), None)), at(100), 600);
        assert_eq!(
            running,
            State::Running {
                since: at(50),
                why: "no calibration yet".into()
            }
        );
        // A failure of this spec holds until the retry delay has passed.
        let failure = Some((
            Reason::CalibrationShardNotReady,
            "Unschedulable".to_string(),
        ));
        let failed = next(
            &asked,
            None,
            Some((true, at(50), Some((at(90), failure.clone())))),
            at(100),
            600,
        );
        assert_eq!(
            failed,
            State::Failed {
                reason: Reason::CalibrationShardNotReady,
                message: "Unschedulable".into(),
                retry_at: at(690)
            }
        );
        let retried = next(
            &asked,
            None,
            Some((true, at(50), Some((at(90), failure.clone())))),
            at(690),
            600,
        );
        assert_eq!(
            retried,
            State::Running {
                since: at(690),
                why: "no calibration yet".into()
            }
        );
        // A failure of an earlier spec does not hold a changed one.
        let changed = next(
            &asked,
            None,
            Some((false, at(50), Some((at(90), failure)))),
            at(100),
            600,
        );
        assert!(matches!(changed, State::Running { since, .. } if since == at(100)));
        // A stale calibration says why it runs again.
        let mut image = s.clone();
        image.server.image = "team/chat:2".into();
        let stale = next(&Asked::of(&image).unwrap(), Some(&c), None, at(100), 600);
        assert!(
            matches!(stale, State::Running { ref why, .. } if why.contains("team/chat:2")),
            "{stale:?}"
        );
    }

    #[test]
    fn the_plan_sizes_from_the_last_calibration_only_when_asked() {
        let s = spec(serde_json::json!({}));
        let c = measured(&s);
        let sized = sized_by(&s, Some(&c)).unwrap();
        assert_eq!(sized.backend.user_bytes_per_connection, Some(3916));
        // A stale one still sizes the plan (the last good plan is kept).
        let mut image = s.clone();
        image.server.image = "team/chat:2".into();
        assert_eq!(
            sized_by(&image, Some(&c))
                .unwrap()
                .backend
                .user_bytes_per_connection,
            Some(3916)
        );
        assert_eq!(sized_by(&s, None), None);
        let mut none = s.clone();
        none.backend.calibrate = None;
        assert_eq!(sized_by(&none, Some(&c)), None);
    }

    fn sample(n: u64, slow: u64, user: u64, kernel: u64) -> Sample {
        Sample {
            idle_connections: n,
            slow_readers: slow,
            tcp_in_use: n + slow + 1,
            pod_bytes: user + kernel + 3_000_000,
            user_bytes: user,
            kernel_bytes: kernel,
            tcp_mem_pages: 0,
        }
    }

    fn report(samples: Vec<Sample>) -> Report {
        Report {
            cgroup_mode: "v1".into(),
            socket_accounted: false,
            samples,
            error: None,
            oom_kills: 0,
        }
    }

    #[test]
    fn figures_are_differences_from_the_baseline() {
        let r = report(vec![
            sample(0, 0, 1_000_000, 200_000),
            sample(5_000, 0, 1_000_000 + 5_000 * 600, 200_000 + 5_000 * 1_500),
            sample(
                10_000,
                0,
                1_000_000 + 10_000 * 600,
                200_000 + 10_000 * 1_500,
            ),
            sample(
                10_000,
                100,
                1_000_000 + 10_000 * 600 + 100 * 4_096,
                200_000 + 10_000 * 1_500 + 100 * 300_000,
            ),
        ]);
        let f = fit(&r).unwrap();
        assert_eq!(f.connections, 10_000);
        assert!((f.per_connection.user - 600.0).abs() < 1e-6, "{f:?}");
        assert!((f.per_connection.kernel - 1_500.0).abs() < 1e-6, "{f:?}");
        assert!((f.per_connection.pod - 2_100.0).abs() < 1e-6, "{f:?}");
        assert_eq!(f.steps.len(), 2);
        assert!(f.pod_slope.abs() < 1e-9);
        assert_eq!(f.slow_readers, 100);
        let slow = f.per_slow_reader.unwrap();
        assert!((slow.user - 4_096.0).abs() < 1e-6 && (slow.kernel - 300_000.0).abs() < 1e-6);
    }

    #[test]
    fn a_cost_that_grows_with_connections_shows_in_the_slope() {
        // 500 B each at 5,000; 550 B each at 10,000 (a table that doubled).
        let r = report(vec![
            sample(0, 0, 0, 0),
            sample(5_000, 0, 2_500_000, 0),
            sample(10_000, 0, 5_500_000, 0),
        ]);
        let f = fit(&r).unwrap();
        assert!((f.pod_slope - 0.1).abs() < 1e-9, "{}", f.pod_slope);
        assert_eq!(f.per_slow_reader, None);
    }

    #[test]
    fn a_probe_that_stopped_early_fits_what_it_reached() {
        let mut r = report(vec![sample(0, 0, 0, 0), sample(3_000, 0, 3_000_000, 0)]);
        r.error = Some("connect to 10.0.0.2:7000 refused after 3000 connections".into());
        let f = fit(&r).unwrap();
        assert_eq!(f.connections, 3_000);
        assert!((f.per_connection.user - 1_000.0).abs() < 1e-6);
    }

    #[test]
    fn no_connection_or_no_baseline_is_an_error() {
        let mut r = report(vec![sample(0, 0, 0, 0)]);
        r.error = Some("shard pod not found".into());
        assert_eq!(
            fit(&r),
            Err(FitError::NoConnections("shard pod not found".into()))
        );
        let r = report(vec![sample(100, 0, 0, 0)]);
        assert_eq!(fit(&r), Err(FitError::NoBaseline));
    }

    proptest! {
        /// Linear samples (any base, any positive cost, any step counts)
        /// fit back to their cost, whatever order the samples come in.
        #[test]
        fn linear_samples_fit_back_to_their_cost(
            base in 0u64..1_000_000_000,
            user in 1u64..100_000,
            kernel in 0u64..100_000,
            mut ns in proptest::collection::btree_set(1u64..20_000, 1..5),
        ) {
            ns.insert(0);
            let mut samples: Vec<Sample> = ns
                .iter()
                .map(|&n| sample(n, 0, base + n * user, base / 2 + n * kernel))
                .collect();
            samples.reverse();
            let f = fit(&report(samples)).unwrap();
            prop_assert!((f.per_connection.user - user as f64).abs() < 1e-3 * user as f64);
            prop_assert!((f.per_connection.kernel - kernel as f64).abs() < 1e-3 * (kernel as f64 + 1.0));
            prop_assert!(f.pod_slope.abs() < 1e-6);
            prop_assert_eq!(f.connections, *ns.iter().max().unwrap());
        }
    }
}
