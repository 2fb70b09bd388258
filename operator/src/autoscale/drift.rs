//! Kernel drift (pure): the kernel settings each shard reports running
//! under (`c10m_fd_limit`, `c10m_kernel_sysctl{name,field}`), read from
//! Prometheus, against what the plan sets. A shard whose effective value is
//! below the planned one drifted: the `KernelDrift` condition names it, its
//! node, the setting and both values, and each new drift is one Warning.
//!
//! Compared, and only when the plan sets them:
//!
//! - `nofile`: `c10m_fd_limit` (RLIMIT_NOFILE in force) against `plan.nofile`;
//! - every sysctl of `plan.sysctls` the server reads (`net.core.somaxconn`,
//!   `fs.nr_open`; `net.ipv4.tcp_mem` by its `pressure` and `max` fields),
//!   except those the plan says are not applied under its sysctl mode
//!   (`sysctlsNotApplied`: `SysctlsApplied=False` already says so).
//!
//! A value at or above the plan is as planned; a shard without a sample
//! for a setting is not judged on it (the metrics loop reports missing
//! samples). `tcp_rmem` and `tcp_wmem` are exported but not compared: the
//! plan sets them as bounds on what a slow reader pins, not as floors.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use crate::api::Plan;
use crate::api::sysctl::{Sysctl, SysctlValue};
use crate::reason::{Announcement, EventAction, Reason};

/// The kernel settings the shards report: the kernel part of a sync's one
/// query ([`super::prometheus::fleet_query`]), confined to the fleet.
pub const KERNEL_QUERY: &str = "c10m_fd_limit or c10m_kernel_sysctl";

/// The setting name of `nofile`.
pub const NOFILE: &str = "nofile";

/// At most this many drifts are named in the condition's message.
const NAMED: usize = 4;

/// The kernel settings one running shard reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardKernel {
    /// The shard's pod.
    pub pod: String,
    /// Its node, once scheduled.
    pub node: Option<String>,
    /// Effective value by setting (`nofile`, `net.core.somaxconn`,
    /// `net.ipv4.tcp_mem pressure`, ...).
    pub values: BTreeMap<String, i64>,
}

/// One setting of one shard below the plan.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Drift {
    /// The shard's pod.
    pub pod: String,
    /// Its node (`unknown` before it is scheduled).
    pub node: String,
    /// The setting.
    pub setting: String,
    /// The plan's value.
    pub planned: i64,
    /// The value the shard runs under.
    pub effective: i64,
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shard {} on node {}: {} is {}, planned {}",
            self.pod, self.node, self.setting, self.effective, self.planned
        )
    }
}

/// The setting a sample is of: `c10m_fd_limit` is `nofile`;
/// `c10m_kernel_sysctl{name,field}` is the sysctl's name, followed by the
/// field for a multi-value one (`net.ipv4.tcp_mem pressure`).
pub fn setting_of(labels: &HashMap<String, String>) -> Option<String> {
    match labels.get("__name__").map(String::as_str) {
        Some("c10m_fd_limit") => Some(NOFILE.into()),
        Some("c10m_kernel_sysctl") => {
            let name = labels.get("name")?;
            match labels.get("field").map(String::as_str) {
                None | Some("value") => Some(name.clone()),
                Some(field) => Some(format!("{name} {field}")),
            }
        }
        _ => None,
    }
}

/// The samples of a kernel read grouped by the `running` shards (pod →
/// node); samples of other pods, of no setting, or not a finite
/// non-negative number are left out.
pub fn group(
    samples: &[(HashMap<String, String>, f64)],
    running: &[(String, Option<String>)],
) -> Vec<ShardKernel> {
    let mut shards: Vec<ShardKernel> = running
        .iter()
        .map(|(pod, node)| ShardKernel {
            pod: pod.clone(),
            node: node.clone(),
            values: BTreeMap::new(),
        })
        .collect();
    for (labels, v) in samples {
        let (Some(pod), Some(setting)) = (labels.get("pod"), setting_of(labels)) else {
            continue;
        };
        if !v.is_finite() || *v < 0.0 || *v > i64::MAX as f64 {
            continue;
        }
        if let Some(s) = shards.iter_mut().find(|s| s.pod == *pod) {
            s.values.insert(setting, v.round() as i64);
        }
    }
    shards
}

/// The settings `plan` sets that a shard reports, with their planned values.
pub fn planned(plan: &Plan) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    if plan.nofile > 0 {
        out.push((NOFILE.to_string(), plan.nofile));
    }
    for (sysctl, value) in &plan.sysctls {
        if plan.sysctls_not_applied.contains(sysctl) {
            continue;
        }
        match (sysctl, value) {
            (_, SysctlValue::One(v)) => out.push((sysctl.name().to_string(), *v)),
            (Sysctl::TcpMem, SysctlValue::Triple([_, pressure, max])) => {
                out.push((format!("{} pressure", sysctl.name()), *pressure));
                out.push((format!("{} max", sysctl.name()), *max));
            }
            // tcp_rmem/tcp_wmem are bounds, not floors: a shard below them
            // has not drifted in a way that breaks the plan.
            _ => {}
        }
    }
    out
}

/// Every setting of every shard below `plan`, by pod then setting.
pub fn drifts(plan: &Plan, shards: &[ShardKernel]) -> Vec<Drift> {
    let planned = planned(plan);
    let mut out: Vec<Drift> = shards
        .iter()
        .flat_map(|s| {
            planned.iter().filter_map(|(setting, want)| {
                let have = *s.values.get(setting)?;
                (have < *want).then(|| Drift {
                    pod: s.pod.clone(),
                    node: s.node.clone().unwrap_or_else(|| "unknown".into()),
                    setting: setting.clone(),
                    planned: *want,
                    effective: have,
                })
            })
        })
        .collect();
    out.sort();
    out
}

/// The drifts announced so far, by (pod, setting): each is announced once
/// while it lasts, and again if it comes back.
pub type Announced = BTreeSet<(String, String)>;

/// What a read of the `shards`' kernel settings says against `plan`: the
/// `KernelDrift` condition (drifted, reason, message) and a Warning per new
/// drift ([`judge`]). A read in which no shard reported a single setting
/// the plan sets (no shard running yet, servers that export no kernel
/// series, a scrape that lost them) judged nothing: the condition is
/// Unknown (`KernelNotReported`), never a clean bill, and `announced` is
/// kept as it was.
pub fn read(
    plan: &Plan,
    shards: &[ShardKernel],
    announced: &mut Announced,
) -> ((Option<bool>, Reason, String), Vec<Announcement>) {
    let planned = planned(plan);
    let reported = shards
        .iter()
        .filter(|s| {
            planned
                .iter()
                .any(|(setting, _)| s.values.contains_key(setting))
        })
        .count();
    if reported == 0 {
        let settings: Vec<&str> = planned.iter().map(|(s, _)| s.as_str()).collect();
        return (
            (
                None,
                Reason::KernelNotReported,
                format!(
                    "none of the {} running shards reported its kernel settings ({}; query {KERNEL_QUERY}): nothing was judged",
                    shards.len(),
                    settings.join(", "),
                ),
            ),
            Vec::new(),
        );
    }
    let ((drifted, reason, message), events) = judge(&drifts(plan, shards), announced);
    ((Some(drifted), reason, message), events)
}

/// What a kernel read says: the `KernelDrift` condition (drifted, reason,
/// message) and a Warning per drift not in `announced`, which becomes the
/// drifts of now.
pub fn judge(
    drifts: &[Drift],
    announced: &mut Announced,
) -> ((bool, Reason, String), Vec<Announcement>) {
    let events = drifts
        .iter()
        .filter(|d| !announced.contains(&(d.pod.clone(), d.setting.clone())))
        .map(|d| {
            Announcement::warning(
                Reason::BelowPlan,
                EventAction::ReadMetrics,
                format!("{d}: the shard runs below its plan"),
            )
        })
        .collect();
    *announced = drifts
        .iter()
        .map(|d| (d.pod.clone(), d.setting.clone()))
        .collect();
    if drifts.is_empty() {
        return (
            (
                false,
                Reason::AsPlanned,
                "every shard runs under the kernel settings of its plan".into(),
            ),
            events,
        );
    }
    let mut message = drifts
        .iter()
        .take(NAMED)
        .map(Drift::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if drifts.len() > NAMED {
        message.push_str(&format!("; and {} more", drifts.len() - NAMED));
    }
    ((true, Reason::BelowPlan, message), events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::sysctl::Sysctl;

    fn plan() -> Plan {
        let mut p: Plan =
            serde_json::from_value(crate::api::status::first_release_plan_json()).unwrap();
        p.nofile = 20_000;
        p.sysctls = [
            (Sysctl::Somaxconn, SysctlValue::One(65_535)),
            (Sysctl::TcpMem, SysctlValue::Triple([100, 200, 300])),
            (Sysctl::NrOpen, SysctlValue::One(1_048_576)),
            (Sysctl::FileMax, SysctlValue::One(2_000_000)),
        ]
        .into_iter()
        .collect();
        p
    }

    fn sample(
        name: &str,
        pod: &str,
        extra: &[(&str, &str)],
        v: f64,
    ) -> (HashMap<String, String>, f64) {
        let mut l: HashMap<String, String> = [("__name__", name), ("pod", pod)]
            .into_iter()
            .chain(extra.iter().copied())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        l.insert("namespace".into(), "ns".into());
        (l, v)
    }

    fn sysctl(pod: &str, name: &str, field: &str, v: f64) -> (HashMap<String, String>, f64) {
        sample(
            "c10m_kernel_sysctl",
            pod,
            &[("name", name), ("field", field)],
            v,
        )
    }

    fn fleet(nofile: f64, somaxconn: f64, pressure: f64) -> Vec<(HashMap<String, String>, f64)> {
        let mut s = Vec::new();
        for pod in ["p0", "p1"] {
            let lowered = pod == "p1";
            s.push(sample(
                "c10m_fd_limit",
                pod,
                &[],
                if lowered { nofile } else { 20_000.0 },
            ));
            s.push(sysctl(
                pod,
                "net.core.somaxconn",
                "value",
                if lowered { somaxconn } else { 65_535.0 },
            ));
            s.push(sysctl(pod, "net.ipv4.tcp_mem", "min", 1.0));
            s.push(sysctl(
                pod,
                "net.ipv4.tcp_mem",
                "pressure",
                if lowered { pressure } else { 200.0 },
            ));
            s.push(sysctl(pod, "net.ipv4.tcp_mem", "max", 300.0));
            s.push(sysctl(pod, "net.ipv4.tcp_rmem", "max", 1.0));
            s.push(sysctl(pod, "fs.nr_open", "value", 1_048_576.0));
            s.push(sysctl(pod, "fs.epoll.max_user_watches", "value", 1.0));
        }
        s
    }

    fn running() -> Vec<(String, Option<String>)> {
        vec![
            ("p0".into(), Some("n0".into())),
            ("p1".into(), Some("n1".into())),
        ]
    }

    #[test]
    fn a_fleet_at_or_above_its_plan_has_no_drift() {
        // Above the plan is fine; settings no plan sets (tcp_rmem, watches)
        // and sysctls the server does not read (file-max) are not judged.
        let shards = group(&fleet(20_001.0, 65_535.0, 200.0), &running());
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[1].values["net.ipv4.tcp_mem pressure"], 200);
        assert!(drifts(&plan(), &shards).is_empty());
    }

    #[test]
    fn a_setting_below_the_plan_names_shard_node_setting_and_values() {
        let shards = group(&fleet(1_024.0, 4_096.0, 199.0), &running());
        let d = drifts(&plan(), &shards);
        assert_eq!(
            d.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [
                "shard p1 on node n1: net.core.somaxconn is 4096, planned 65535",
                "shard p1 on node n1: net.ipv4.tcp_mem pressure is 199, planned 200",
                "shard p1 on node n1: nofile is 1024, planned 20000",
            ]
        );
    }

    #[test]
    fn sysctls_the_plan_does_not_apply_are_not_judged() {
        let mut p = plan();
        p.sysctls_not_applied = vec![Sysctl::Somaxconn, Sysctl::TcpMem];
        let shards = group(&fleet(1_024.0, 4_096.0, 199.0), &running());
        let d = drifts(&p, &shards);
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].setting.as_str(), d[0].planned, d[0].effective),
            ("nofile", 20_000, 1_024)
        );
    }

    #[test]
    fn samples_of_other_pods_or_doubtful_values_are_left_out() {
        let mut s = fleet(1_024.0, 65_535.0, 200.0);
        s.push(sample("c10m_fd_limit", "gone", &[], 1.0));
        s.push(sysctl("p0", "net.core.somaxconn", "value", f64::NAN));
        s.push(sample("c10m_connections", "p0", &[], 0.0));
        let shards = group(&s, &[("p1".into(), None)]);
        assert_eq!(shards.len(), 1);
        let d = drifts(&plan(), &shards);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].node, "unknown");
        // A shard without samples is not judged.
        assert!(drifts(&plan(), &group(&[], &running())).is_empty());
    }

    #[test]
    fn each_drift_is_announced_once_while_it_lasts() {
        let shards = group(&fleet(1_024.0, 4_096.0, 200.0), &running());
        let d = drifts(&plan(), &shards);
        let mut announced = Announced::new();
        let ((on, reason, message), events) = judge(&d, &mut announced);
        assert!(on);
        assert_eq!(reason, Reason::BelowPlan);
        assert_eq!(
            message,
            "shard p1 on node n1: net.core.somaxconn is 4096, planned 65535; shard p1 on node n1: nofile is 1024, planned 20000"
        );
        assert_eq!(events.len(), 2);
        assert!(
            events
                .iter()
                .all(|e| e.warning && e.reason == Reason::BelowPlan)
        );
        assert_eq!(
            events[1].note,
            "shard p1 on node n1: nofile is 1024, planned 20000: the shard runs below its plan"
        );
        // The same drifts again: nothing new to say.
        let (_, events) = judge(&d, &mut announced);
        assert!(events.is_empty());
        // Fixed: condition False, and a drift that comes back is news again.
        let ((on, reason, _), events) = judge(&[], &mut announced);
        assert!(!on && reason == Reason::AsPlanned && events.is_empty());
        assert_eq!(judge(&d[1..], &mut announced).1.len(), 1);
    }

    /// Issue 21: a read in which no shard reported a planned setting (no
    /// samples at all, or shards listed without a single series) is
    /// Unknown with a reason, never `AsPlanned`; one reporting shard is
    /// enough to judge.
    #[test]
    fn an_empty_kernel_read_is_unknown_not_as_planned() {
        let mut announced = Announced::new();
        for shards in [
            Vec::new(),
            vec![ShardKernel {
                pod: "p1".into(),
                node: Some("n1".into()),
                values: BTreeMap::new(),
            }],
        ] {
            let ((drifted, reason, message), events) = read(&plan(), &shards, &mut announced);
            assert_eq!((drifted, reason), (None, Reason::KernelNotReported));
            assert!(message.contains("nothing was judged"), "{message}");
            assert!(events.is_empty());
        }
        let shards = group(&fleet(1_024.0, 4_096.0, 200.0), &running());
        let ((drifted, reason, _), events) = read(&plan(), &shards, &mut announced);
        assert_eq!((drifted, reason), (Some(true), Reason::BelowPlan));
        assert!(!events.is_empty());
    }

    /// The kernel query reads only the fleet's own series, and the policy's.
    #[test]
    fn the_kernel_query_is_confined_like_every_query_of_the_fleet() {
        let policy = vec![("tenant".to_string(), "a".to_string())];
        let q =
            super::super::prometheus::render_query(KERNEL_QUERY, "ns", "edge", &policy).unwrap();
        assert_eq!(
            q,
            r#"c10m_fd_limit{fleet="edge",namespace="ns",tenant="a"} or c10m_kernel_sysctl{fleet="edge",namespace="ns",tenant="a"}"#
        );
    }

    #[test]
    fn many_drifts_make_one_short_message() {
        let shards: Vec<ShardKernel> = (0..6)
            .map(|n| ShardKernel {
                pod: format!("p{n}"),
                node: Some("n".into()),
                values: [(NOFILE.to_string(), 1)].into_iter().collect(),
            })
            .collect();
        let ((_, _, message), events) = judge(&drifts(&plan(), &shards), &mut Announced::new());
        assert!(message.ends_with("; and 2 more"), "{message}");
        assert_eq!(events.len(), 6);
    }
}
