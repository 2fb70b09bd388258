//! Measured kernel facts and kernel defaults the capacity model counts with
//! (pure data). Every constant names its source: a measurement in
//! `docs/KERNEL_FACTS.md`, a benchmark in this repository, or kernel source.

use crate::api::sysctl::{Sysctl, SysctlValue};

/// Bytes in a page: the unit of `tcp_mem` (x86_64/arm64 4 KiB pages).
pub const PAGE_BYTES: i64 = 4096;

/// Kernel bytes per idle, epoll-registered IPv4 TCP socket on Linux 6.x, slab
/// packing included: tcp_sock 2,521 + sock_inode 862 + filp 195 + dentry 195 +
/// epoll 192 (docs/KERNEL_FACTS.md, measured).
pub const KERNEL_BYTES_PER_SOCKET: i64 = 3965;

/// Of [`KERNEL_BYTES_PER_SOCKET`], the part charged to the pod's memory cgroup:
/// TCP sock + file + epoll, ~2.65–2.75 KB; inode and dentry land on the node
/// outside the pod (docs/KERNEL_FACTS.md, measured, cgroup v1; upper figure used).
pub const CGROUP_KERNEL_BYTES_PER_SOCKET: i64 = 2750;

/// Bytes per tracked connection in the `nf_conntrack` slab (docs/KERNEL_FACTS.md, measured).
pub const CONNTRACK_BYTES: i64 = 256;

/// User-space bytes per idle connection of a goroutine-per-connection Go
/// server (net/http): 11,400–11,900 B; the upper figure is used
/// (docs/KERNEL_FACTS.md, [source] design article).
pub const GOROUTINE_USER_BYTES: i64 = 11_900;

/// User-space bytes per idle connection of the bundled c10m-server (epoll),
/// echo protocol: 19.8 B measured by `make bench-server` (RSS delta of 8
/// SO_REUSEPORT server processes ÷ 150,000 idle connections,
/// target/bench/server.json; WebSocket 20.7 B) on this project's 2-vCPU VM;
/// 23.7 B with one process and 19,000 connections (`make measure-server`).
/// Rounded up to 20.
pub const EPOLL_USER_BYTES: i64 = 20;

/// Memory allowed per shard process beyond its connections: runtime, thread
/// stacks, per-worker scratch buffers, metrics. A generous 64 MiB bound: the
/// bundled server's idle RSS is 3.3–3.5 MB with 2 workers (`make
/// measure-server`) and a Go runtime's heap arenas and stacks fit too.
pub const PROCESS_BASE_BYTES: i64 = 64 << 20;

/// Descriptors allowed beyond the bundled server's own reserve, for servers
/// that open more (a Go runtime's netpoller, log files). Chosen, not measured.
pub const FD_RESERVE_SLACK: i64 = 32;

/// File descriptors a shard needs besides connections: the bundled server's
/// reserve for `workers` workers ([`c10m_wire::limits::fd_reserve`]: stdio,
/// admin listener, listener + epoll + waker + spare fd per worker) plus
/// [`FD_RESERVE_SLACK`].
pub fn fd_reserve(workers: i64) -> i64 {
    c10m_wire::limits::fd_reserve(workers.max(0) as u64) as i64 + FD_RESERVE_SLACK
}

/// Hard RLIMIT_NOFILE a container inherits when the node doesn't say:
/// containerd 2.x's unit sets no LimitNOFILE, so pods get systemd's default
/// hard limit 524,288 (docs/KERNEL_FACTS.md, [source] containerd issues).
pub const DEFAULT_NOFILE_HARD_LIMIT: i64 = 524_288;

/// Largest `fs.nr_open` the kernel accepts on 64-bit (fs/file.c
/// `sysctl_nr_open_max`; writes above it fail with EINVAL).
pub const NR_OPEN_MAX: i64 = 1_073_741_816;

/// Kernel default of `fs.nr_open` ([`c10m_wire::limits::DEFAULT_NR_OPEN`]:
/// docs/KERNEL_FACTS.md; `sysctl_nr_open` = 1024 × 1024 in fs/file.c).
pub const DEFAULT_NR_OPEN: i64 = c10m_wire::limits::DEFAULT_NR_OPEN as i64;

/// Kernel default of `net.core.somaxconn` in a new pod network namespace (docs/KERNEL_FACTS.md).
pub const DEFAULT_SOMAXCONN: i64 = 4096;

/// Listen backlog the bundled server asks for
/// ([`c10m_wire::limits::LISTEN_BACKLOG`]); the kernel caps it at
/// `somaxconn`. A 128 backlog overflowed at 19k connections and cut the
/// accept rate from ~50k/s to ~160/s (docs/KERNEL_FACTS.md, measured).
pub const LISTEN_BACKLOG: i64 = c10m_wire::limits::LISTEN_BACKLOG as i64;

/// Kernel default of `net.ipv4.tcp_max_syn_backlog`: max(128, ehash buckets
/// ÷ 128) (net/ipv4/tcp_ipv4.c `tcp_sk_init`); 2,048 with the 262,144-bucket
/// shared table measured here (docs/KERNEL_FACTS.md).
pub const DEFAULT_TCP_MAX_SYN_BACKLOG: i64 = 2048;

/// Kernel defaults of one node, derived from its memory and CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelDefaults {
    /// `net.ipv4.tcp_mem` (min, pressure, max) in pages: pressure = RAM pages ÷ 16,
    /// min = pressure ÷ 4 × 3, max = min × 2 (net/ipv4/tcp.c `tcp_init_mem`; ≈ 4.7 / 6.25 / 9.4 % of RAM).
    pub tcp_mem: [i64; 3],
    /// `fs.file-max` ≈ RAM KiB ÷ 10 (fs/file_table.c `files_maxfiles_init`; docs/KERNEL_FACTS.md).
    pub file_max: i64,
    /// `net.netfilter.nf_conntrack_max` as kube-proxy sets it: max(131072, 32768 × cores), capped at 1,048,576 (docs/KERNEL_FACTS.md).
    pub conntrack_max: i64,
}

impl KernelDefaults {
    /// Defaults for a node with `memory_bytes` of RAM and `cpus` cores.
    pub fn for_node(memory_bytes: i64, cpus: i64) -> Self {
        let pages = memory_bytes / PAGE_BYTES;
        let pressure = (pages / 16).max(128);
        let min = pressure / 4 * 3;
        KernelDefaults {
            tcp_mem: [min, pressure, min * 2],
            file_max: (memory_bytes / 1024 / 10).max(8192),
            conntrack_max: (32_768 * cpus).clamp(131_072, 1_048_576),
        }
    }
}

impl KernelDefaults {
    /// The kernel default of `sysctl` on this node. Used to render only
    /// raises and to prove plans only raise.
    pub fn value(&self, sysctl: Sysctl) -> SysctlValue {
        use SysctlValue::{One, Pages};
        match sysctl {
            Sysctl::Somaxconn => One(DEFAULT_SOMAXCONN),
            Sysctl::TcpMaxSynBacklog => One(DEFAULT_TCP_MAX_SYN_BACKLOG),
            Sysctl::TcpMigrateReq => One(0),
            Sysctl::TcpMem => Pages(self.tcp_mem),
            Sysctl::NfConntrackMax => One(self.conntrack_max),
            Sysctl::FileMax => One(self.file_max),
            Sysctl::NrOpen => One(DEFAULT_NR_OPEN),
        }
    }
}
