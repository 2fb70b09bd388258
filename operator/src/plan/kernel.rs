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

/// Of [`KERNEL_BYTES_PER_SOCKET`], the part an idle connection charges to
/// its pod's memory cgroup under cgroup v1 without socket accounting (as
/// the kubelet leaves it): file, inode, dentry and epoll items, not the
/// 2,368 B `tcp_sock`: ~1,485 B (docs/KERNEL_FACTS.md, measured with the
/// bundled server in its own memory cgroup, 15,000–18,760 connections;
/// re-measured by `make bench-fidelity`). Under cgroup v2 the whole socket
/// is charged: [`KERNEL_BYTES_PER_SOCKET`] (measured ~3,860 B; the slab
/// figure is kept, 2.7 % above).
pub const POD_KERNEL_BYTES_PER_SOCKET_V1: i64 = 1485;

/// Bytes of a process's fd table per RLIMIT_NOFILE slot, in tenths of a
/// byte: ~8.5 B (an 8 B `struct file *` plus the open/close-on-exec/full
/// bitmaps), allocated in powers of two as descriptors are opened and
/// charged to the pod (docs/KERNEL_FACTS.md, measured: 64 MiB at nofile
/// 6.45M; `fs/file.c` `alloc_fdtable`).
pub const FD_TABLE_TENTHS_PER_SLOT: i64 = 85;

/// Bytes of the fd table of a process holding `nofile` descriptors: the
/// slots rounded up to a power of two × [`FD_TABLE_TENTHS_PER_SLOT`].
pub fn fd_table_bytes(nofile: i64) -> i64 {
    let slots = (nofile.max(1) as u64).next_power_of_two() as i64;
    (slots * FD_TABLE_TENTHS_PER_SLOT + 9) / 10
}

/// Per-socket buffer bound the plan sets as the max of both
/// `net.ipv4.tcp_rmem` and `net.ipv4.tcp_wmem`, bytes: 64 KiB, one
/// WebSocket frame of the bundled server's default largest size (65,536)
/// and one read chunk ([`c10m_wire::limits::READ_CHUNK_BYTES`]). Idle
/// connections hold no buffers, so the bound costs them nothing; it caps
/// what a peer that stops reading can pin (docs/KERNEL_FACTS.md).
pub const SOCKET_BUFFER_MAX_BYTES: i64 = 65_536;

/// `tcp_rmem`/`tcp_wmem` min and default the plan sets with
/// [`SOCKET_BUFFER_MAX_BYTES`], bytes: the kernel's own min (one page) and
/// its `tcp_wmem` default (16 KiB, `net/ipv4/tcp.c` `tcp_init`).
pub const SOCKET_BUFFER_MIN_BYTES: i64 = 4096;
/// See [`SOCKET_BUFFER_MIN_BYTES`].
pub const SOCKET_BUFFER_DEFAULT_BYTES: i64 = 16_384;

/// Kernel bytes one slow reader (a peer that sends and never reads) pins
/// with buffers bounded by [`SOCKET_BUFFER_MAX_BYTES`]: its receive queue
/// and the send queue of the server's replies, each charged by skb
/// truesize up to the buffer bound (`sk_rcvbuf`, `sk_sndbuf`), plus one
/// page each side may overshoot by. Measured by `make bench-fidelity`:
/// 128,150–135,170 B per slow reader in the server's socket (receive queue
/// ~64.3 KB, send queue ~68.5 KB, reserve ~2.3 KB; 1 MiB sent and never
/// read; docs/KERNEL_FACTS.md).
pub const SLOW_READER_KERNEL_BYTES: i64 = 2 * SOCKET_BUFFER_MAX_BYTES + 2 * PAGE_BYTES;

/// Kernel bytes one slow reader pins with the kernel's default buffers
/// (when the plan cannot set `tcp_rmem`/`tcp_wmem`): the send queue grows
/// to the `tcp_wmem` max (4 MiB) and the receive queue to ~1.5 MB
/// (docs/KERNEL_FACTS.md, measured: ~5.7 MB per slow reader).
pub const SLOW_READER_KERNEL_BYTES_UNBOUNDED: i64 = 5_700_000;

/// User-space bytes the bundled server keeps for a connection whose peer
/// stopped reading: at most the unsent tail of one read
/// ([`c10m_wire::limits::READ_CHUNK_BYTES`]) and its allocation overhead;
/// it stops reading that connection until the tail is sent
/// (`server-image/src/conn.rs`). `make bench-fidelity` measured
/// 27,000–49,500 B on average (server RSS delta ÷ slow readers): the
/// bound is what the plan charges.
pub const SLOW_READER_USER_BYTES: i64 = c10m_wire::limits::READ_CHUNK_BYTES as i64 + 4096;

/// Connections one worker of the bundled server accepts per second while
/// a shard refills, connections/s: `make bench-fidelity` measured the idle
/// fill rate of a 1-worker server at 49,500–91,800/s on a quiet 2-vCPU VM
/// (the clients, on the same vCPUs, were the bound: the worker was 23–43 %
/// busy) and down to ~18,000–23,700/s with the local control plane running
/// beside it; the plan counts on 20,000 (docs/KERNEL_FACTS.md).
pub const ACCEPTS_PER_SECOND_PER_WORKER: i64 = 20_000;

/// Bytes of one epoll watch (`struct epitem` + `struct eppoll_entry`,
/// `EP_ITEM_COST` in `fs/eventpoll.c`): ~184 B (docs/KERNEL_FACTS.md).
pub const EPOLL_WATCH_BYTES: i64 = 184;

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

/// Memory allowed per shard process beyond its connections for servers
/// other than the bundled one: runtime, thread stacks, per-worker scratch
/// buffers, metrics. A generous 64 MiB bound, chosen: a Go runtime's heap
/// arenas and stacks fit.
pub const PROCESS_BASE_BYTES: i64 = 64 << 20;

/// Memory allowed per bundled `c10m-server` process beyond its
/// connections, its fd table and its unfinished-input budget: 16 MiB. Its
/// idle RSS is 3.3–3.5 MB with 2 workers (`make measure-server`), and
/// `make bench-fidelity` measured 1.0–1.3 MB charged to its memory cgroup
/// before the first client; each worker adds a 64 KiB read buffer and its
/// event array.
pub const BUNDLED_PROCESS_BASE_BYTES: i64 = 16 << 20;

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
    /// `fs.epoll.max_user_watches`: 4 % of RAM ÷ [`EPOLL_WATCH_BYTES`]
    /// (`fs/eventpoll.c` `eventpoll_init`; 5,491,489 on a 24 GiB host, docs/KERNEL_FACTS.md).
    pub max_user_watches: i64,
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
            max_user_watches: memory_bytes / 25 / EPOLL_WATCH_BYTES,
        }
    }
}

impl KernelDefaults {
    /// The kernel default of `sysctl` on this node. Used to render only
    /// raises and to prove plans only raise.
    pub fn value(&self, sysctl: Sysctl) -> SysctlValue {
        use SysctlValue::{One, Triple};
        match sysctl {
            Sysctl::Somaxconn => One(DEFAULT_SOMAXCONN),
            Sysctl::TcpMaxSynBacklog => One(DEFAULT_TCP_MAX_SYN_BACKLOG),
            Sysctl::TcpMigrateReq => One(0),
            Sysctl::TcpMem => Triple(self.tcp_mem),
            Sysctl::NfConntrackMax => One(self.conntrack_max),
            Sysctl::FileMax => One(self.file_max),
            Sysctl::NrOpen => One(DEFAULT_NR_OPEN),
            Sysctl::MaxUserWatches => One(self.max_user_watches),
            // Host values are copied into each new netns; the kernel's own
            // defaults (`tcp_init`) for a 256 GiB node.
            Sysctl::TcpRmem => Triple([4096, 131_072, 6_291_456]),
            Sysctl::TcpWmem => Triple([4096, 16_384, 4_194_304]),
        }
    }
}
