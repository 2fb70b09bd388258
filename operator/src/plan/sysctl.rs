//! Which kernel settings a plan raises and which the kubelet lets a pod set
//! (pure). Names, scopes and values are typed in [`crate::api::sysctl`];
//! kernel defaults come from [`super::kernel::KernelDefaults`].

use crate::api::sysctl::{Scope, Sysctl, SysctlValue, Sysctls};
use crate::api::{ConnectionFleetSpec, SysctlMode};
use crate::policy::SysctlCeilings;

use super::kernel::{self, KernelDefaults};
use super::nodes::NodeRuntime;

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
/// Chosen, not measured.
pub const FILE_MAX_SYSTEM_RESERVE: i64 = 65_536;

/// Load the fleet puts on one node at the shards' connection caps.
#[derive(Clone, Copy, Debug)]
pub struct NodeLoad {
    /// Connections of all shards on the node.
    pub connections: i64,
    /// `tcp_mem` pages charged at peak: one per socket holding queued
    /// data, and each slow reader's bounded buffers.
    pub tcp_mem_pages: i64,
    /// File descriptors of all shards on the node.
    pub open_files: i64,
    /// RLIMIT_NOFILE of one shard.
    pub nofile: i64,
    /// Connections pass through conntrack.
    pub tracked: bool,
    /// Epoll watches of the shards' uid on the node (one per descriptor).
    pub watches: i64,
}

/// The ceiling the policy puts on node-level `sysctl` (`None` for a
/// namespaced one): for `tcp_mem`, on every component.
pub fn ceiling(ceilings: &SysctlCeilings, sysctl: Sysctl) -> Option<i64> {
    match sysctl {
        Sysctl::TcpMem => Some(ceilings.tcp_mem_pages),
        Sysctl::NfConntrackMax => Some(ceilings.nf_conntrack_max),
        Sysctl::FileMax => Some(ceilings.file_max),
        Sysctl::NrOpen => Some(ceilings.nr_open),
        Sysctl::MaxUserWatches => Some(ceilings.max_user_watches),
        Sysctl::Somaxconn
        | Sysctl::TcpMaxSynBacklog
        | Sysctl::TcpMigrateReq
        | Sysctl::TcpRmem
        | Sysctl::TcpWmem => None,
    }
}

/// `value` with each component at most `ceiling`, but never below the
/// kernel's `default` one (a raise may be cut, never turned into a lowering).
fn clamp(value: SysctlValue, default: SysctlValue, ceiling: i64) -> SysctlValue {
    let cut = |v: i64, d: i64| v.min(ceiling.max(d));
    match (value, default) {
        (SysctlValue::One(v), SysctlValue::One(d)) => SysctlValue::One(cut(v, d)),
        (SysctlValue::Triple(v), SysctlValue::Triple(d)) => {
            SysctlValue::Triple([cut(v[0], d[0]), cut(v[1], d[1]), cut(v[2], d[2])])
        }
        (v, _) => v,
    }
}

/// The `tcp_rmem`/`tcp_wmem` value the plan sets: (min, default, max) =
/// ([`kernel::SOCKET_BUFFER_MIN_BYTES`], [`kernel::SOCKET_BUFFER_DEFAULT_BYTES`],
/// [`kernel::SOCKET_BUFFER_MAX_BYTES`]) bytes.
pub fn socket_buffers() -> SysctlValue {
    SysctlValue::Triple([
        kernel::SOCKET_BUFFER_MIN_BYTES,
        kernel::SOCKET_BUFFER_DEFAULT_BYTES,
        kernel::SOCKET_BUFFER_MAX_BYTES,
    ])
}

/// True when the plan bounds socket buffers (`tcp_rmem`/`tcp_wmem`): every
/// mode but `None` can set them (kubelet-safe since Kubernetes 1.32).
pub fn bounds_socket_buffers(spec: &ConnectionFleetSpec) -> bool {
    spec.sysctls.mode != SysctlMode::None
}

/// True when the plan raises node-level sysctls (`tcp_mem`,
/// `nf_conntrack_max`, `fs.file-max`, `fs.nr_open`): InitContainer mode on
/// nodes where its init container can enter the host's network namespace.
/// Otherwise the plan fits the kernel's defaults for them.
pub fn raises_node_sysctls(spec: &ConnectionFleetSpec, runtime: &NodeRuntime) -> bool {
    spec.sysctls.mode == SysctlMode::InitContainer && runtime.host_network_namespace
}

/// The sysctls the plan applies under the spec's mode (only raises over
/// the node's kernel defaults, node-level ones at most to the policy's
/// `ceilings`, and only when [`raises_node_sysctls`]) and those it wants
/// but cannot apply: in PodSecurityContext mode the kubelet-safe ones go
/// in, and `spec.sysctls.allowedUnsafe` ones where the nodes' kubelets
/// allow them (`runtime.unsafe_sysctls`, when the nodes say). The capacity model sizes shards so the load fits under the
/// ceilings; the cut here only keeps the raise under them whatever the load.
pub fn plan_sysctls(
    spec: &ConnectionFleetSpec,
    runtime: &NodeRuntime,
    defaults: &KernelDefaults,
    ceilings: &SysctlCeilings,
    load: NodeLoad,
) -> (Sysctls, Vec<Sysctl>) {
    use SysctlValue::{One, Triple};
    let mut wants: Vec<(Sysctl, SysctlValue)> = vec![
        (Sysctl::Somaxconn, One(kernel::LISTEN_BACKLOG)),
        (Sysctl::TcpMaxSynBacklog, One(kernel::LISTEN_BACKLOG)),
        // With 1, closing one SO_REUSEPORT listener migrates its queued
        // connections instead of resetting them (docs/KERNEL_FACTS.md, measured).
        (Sysctl::TcpMigrateReq, One(1)),
        // Bounded socket buffers: what a slow reader can pin (kubelet-safe,
        // so PodSecurityContext mode sets them too).
        (Sysctl::TcpRmem, socket_buffers()),
        (Sysctl::TcpWmem, socket_buffers()),
    ];
    const {
        assert!(
            kernel::LISTEN_BACKLOG > kernel::DEFAULT_SOMAXCONN
                && kernel::LISTEN_BACKLOG > kernel::DEFAULT_TCP_MAX_SYN_BACKLOG
        )
    };

    let mode = spec.sysctls.mode;
    if raises_node_sysctls(spec, runtime) {
        let [min, pressure, max] = defaults.tcp_mem;
        if load.tcp_mem_pages > pressure {
            let p = load.tcp_mem_pages;
            wants.push((Sysctl::TcpMem, Triple([min, p, max.max(p + p / 2)])));
        }
        if load.tracked && load.connections > defaults.conntrack_max {
            wants.push((Sysctl::NfConntrackMax, One(load.connections)));
        }
        let files = load.open_files + FILE_MAX_SYSTEM_RESERVE;
        if files > defaults.file_max {
            wants.push((Sysctl::FileMax, One(files)));
        }
        if load.nofile > kernel::DEFAULT_NR_OPEN {
            wants.push((Sysctl::NrOpen, One(load.nofile)));
        }
        if load.watches > defaults.max_user_watches {
            wants.push((Sysctl::MaxUserWatches, One(load.watches)));
        }
    }

    let mut applied = Sysctls::new();
    let mut not_applied = Vec::new();
    for (sysctl, value) in wants {
        let value = match (sysctl.scope(), ceiling(ceilings, sysctl)) {
            (Scope::Node, Some(c)) => {
                let default = defaults.value(sysctl);
                let value = clamp(value, default, c);
                if !value.raises(default) {
                    continue;
                }
                value
            }
            _ => value,
        };
        let ok = match mode {
            SysctlMode::InitContainer => true,
            SysctlMode::PodSecurityContext => {
                KUBELET_SAFE.contains(&sysctl.name())
                    || (spec
                        .sysctls
                        .allowed_unsafe
                        .iter()
                        .any(|a| a == sysctl.name())
                        && runtime
                            .unsafe_sysctls
                            .is_none_or(|set| set.contains(sysctl)))
            }
            SysctlMode::None => false,
        };
        if ok {
            applied.insert(sysctl, value);
        } else {
            not_applied.push(sysctl);
        }
    }
    (applied, not_applied)
}
