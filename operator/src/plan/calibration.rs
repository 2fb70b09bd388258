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

use c10m_wire::calibrate::{Report, Sample};
use serde::{Deserialize, Serialize};

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
    use proptest::prelude::*;

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
