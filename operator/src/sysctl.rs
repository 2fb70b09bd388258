//! Which kernel settings a plan raises, where each one lives (pod network
//! namespace or node), and which the kubelet lets a pod set. Pure.

use std::collections::BTreeMap;

use crate::api::{ConnectionFleetSpec, SysctlMode};
use crate::model::{self, KernelDefaults};

/// Where a sysctl takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Per network namespace: set inside the pod's own netns.
    Namespaced,
    /// Global to the node (or only writable from the host netns): only ever raised.
    Node,
}

/// Sysctls the plan may set, with their scope and kernel default.
/// Defaults: KERNEL_FACTS.md ("Limits and where they live") and model.rs.
const KNOWN: &[(&str, Scope)] = &[
    ("net.core.somaxconn", Scope::Namespaced),
    ("net.ipv4.tcp_max_syn_backlog", Scope::Namespaced),
    ("net.ipv4.tcp_migrate_req", Scope::Namespaced),
    ("net.ipv4.tcp_mem", Scope::Node),
    ("net.netfilter.nf_conntrack_max", Scope::Node),
    ("fs.file-max", Scope::Node),
    ("fs.nr_open", Scope::Node),
];

/// Sysctls the kubelet allows in a pod's `securityContext.sysctls` without
/// `--allowed-unsafe-sysctls`, as of Kubernetes 1.35 ("Using sysctls in a
/// Kubernetes Cluster", kubernetes.io docs; `pkg/kubelet/sysctl/safe_sysctls.go`).
pub const KUBELET_SAFE: &[&str] = &[
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
];

/// Files a node keeps open besides the fleet's shards (system daemons,
/// kubelet, container runtime): a 65,536 allowance when raising `fs.file-max`.
pub const FILE_MAX_SYSTEM_RESERVE: i64 = 65_536;

/// Scope of a sysctl the plan knows, `None` for any other name.
pub fn scope(name: &str) -> Option<Scope> {
    KNOWN.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// Load the fleet puts on one node at the shards' connection caps.
#[derive(Clone, Copy, Debug)]
pub struct NodeLoad {
    /// Connections of all shards on the node.
    pub connections: i64,
    /// `tcp_mem` pages charged at peak (one per socket holding queued data).
    pub queued_pages: i64,
    /// File descriptors of all shards on the node.
    pub open_files: i64,
    /// RLIMIT_NOFILE of one shard.
    pub nofile: i64,
    /// Connections pass through conntrack.
    pub tracked: bool,
}

/// The sysctls the plan applies under the spec's mode (name → value, only
/// raises over kernel defaults) and the names it wants but cannot apply.
pub fn plan_sysctls(
    spec: &ConnectionFleetSpec,
    defaults: &KernelDefaults,
    load: NodeLoad,
) -> (BTreeMap<String, String>, Vec<String>) {
    let mut wants: Vec<(&str, String)> = vec![
        ("net.core.somaxconn", model::LISTEN_BACKLOG.to_string()),
        (
            "net.ipv4.tcp_max_syn_backlog",
            model::LISTEN_BACKLOG.to_string(),
        ),
        // With 1, closing one SO_REUSEPORT listener migrates its queued
        // connections instead of resetting them (KERNEL_FACTS.md, measured).
        ("net.ipv4.tcp_migrate_req", "1".to_string()),
    ];
    const {
        assert!(
            model::LISTEN_BACKLOG > model::DEFAULT_SOMAXCONN
                && model::LISTEN_BACKLOG > model::DEFAULT_TCP_MAX_SYN_BACKLOG
        )
    };

    let mode = spec.sysctls.mode;
    if mode == SysctlMode::InitContainer {
        let [min, pressure, max] = defaults.tcp_mem;
        if load.queued_pages > pressure {
            let p = load.queued_pages;
            wants.push((
                "net.ipv4.tcp_mem",
                format!("{min} {p} {}", max.max(p + p / 2)),
            ));
        }
        if load.tracked && load.connections > defaults.conntrack_max {
            wants.push((
                "net.netfilter.nf_conntrack_max",
                load.connections.to_string(),
            ));
        }
        let files = load.open_files + FILE_MAX_SYSTEM_RESERVE;
        if files > defaults.file_max {
            wants.push(("fs.file-max", files.to_string()));
        }
        if load.nofile > model::DEFAULT_NR_OPEN {
            wants.push(("fs.nr_open", load.nofile.to_string()));
        }
    }

    let mut applied = BTreeMap::new();
    let mut not_applied = Vec::new();
    for (name, value) in wants {
        let ok = match mode {
            SysctlMode::InitContainer => true,
            SysctlMode::PodSecurityContext => {
                KUBELET_SAFE.contains(&name)
                    || spec.sysctls.allowed_unsafe.iter().any(|a| a == name)
            }
            SysctlMode::None => false,
        };
        if ok {
            applied.insert(name.to_string(), value);
        } else {
            not_applied.push(name.to_string());
        }
    }
    (applied, not_applied)
}

/// Kernel default of a sysctl the plan knows, as the kernel prints it, for
/// the node described by `defaults`. Used to prove plans only raise.
pub fn default_value(name: &str, defaults: &KernelDefaults) -> Option<String> {
    Some(match name {
        "net.core.somaxconn" => model::DEFAULT_SOMAXCONN.to_string(),
        "net.ipv4.tcp_max_syn_backlog" => model::DEFAULT_TCP_MAX_SYN_BACKLOG.to_string(),
        "net.ipv4.tcp_migrate_req" => "0".to_string(),
        "net.ipv4.tcp_mem" => defaults.tcp_mem.map(|p| p.to_string()).join(" "),
        "net.netfilter.nf_conntrack_max" => defaults.conntrack_max.to_string(),
        "fs.file-max" => defaults.file_max.to_string(),
        "fs.nr_open" => model::DEFAULT_NR_OPEN.to_string(),
        _ => return None,
    })
}

/// True when every whitespace-separated component of `value` is >= the
/// matching component of `default` (and at least one is greater).
pub fn is_raise(value: &str, default: &str) -> bool {
    let parse = |s: &str| {
        s.split_whitespace()
            .map(|t| t.parse::<i64>())
            .collect::<Result<Vec<_>, _>>()
    };
    match (parse(value), parse(default)) {
        (Ok(v), Ok(d)) if v.len() == d.len() => v.iter().zip(&d).all(|(a, b)| a >= b) && v != d,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raise_compares_every_component() {
        assert!(is_raise("65535", "4096"));
        assert!(!is_raise("4096", "4096"));
        assert!(is_raise("10 30 40", "10 20 30"));
        assert!(!is_raise("10 30 20", "10 20 30"));
        assert!(!is_raise("x", "1"));
        assert!(!is_raise("1 2", "1"));
    }

    #[test]
    fn scopes() {
        assert_eq!(scope("net.core.somaxconn"), Some(Scope::Namespaced));
        assert_eq!(scope("net.ipv4.tcp_mem"), Some(Scope::Node));
        assert_eq!(scope("kernel.pid_max"), None);
    }
}
