//! Process limits: the file descriptor limit, the connection cap derived from
//! it, and whether the workers are pinned to CPUs ([`pinning`]).
//!
//! The descriptors kept back from the connection budget ([`fd_reserve`])
//! and the `fs.nr_open` fallback ([`DEFAULT_NR_OPEN`]) are shared with the
//! operator's capacity plan, so they live in [`c10m_wire::limits`]. The
//! per-worker part counts what a worker holds besides its connections: its
//! listener, epoll instance, waker eventfd and spare descriptor.

use c10m_wire::limits::{DEFAULT_NR_OPEN, fd_reserve};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// RLIMIT_NOFILE before and after [`raise_nofile`], in descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    /// Soft limit found at start.
    pub soft_before: u64,
    /// Hard limit (the ceiling the soft limit was raised towards).
    pub hard: u64,
    /// Soft limit in force now: the number of descriptors this process may
    /// hold. This is what `c10m_fd_limit` reports.
    pub effective: u64,
}

fn rlim_value(v: Option<u64>, unlimited: u64) -> u64 {
    v.unwrap_or(unlimited)
}

/// `fs.nr_open`, or the kernel default ([`DEFAULT_NR_OPEN`]) when it cannot
/// be read; used only as the value of an unlimited hard limit.
fn nr_open() -> u64 {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_NR_OPEN)
}

/// Raises RLIMIT_NOFILE: first both limits to `target` (the plan's nofile)
/// when it is above the hard limit, which succeeds only with
/// CAP_SYS_RESOURCE and `fs.nr_open` >= `target` (the operator grants the
/// capability and raises nr_open in its init container); otherwise, or if
/// that is refused, the soft limit to the hard limit.
///
/// Pods inherit the container runtime's limits; containerd 2.x leaves soft at
/// 1,024 with hard at 524,288 [source: `docs/KERNEL_FACTS.md`], so a server
/// that does not raise soft itself dies at 1k connections. An unlimited hard
/// limit is treated as `fs.nr_open`, the most the kernel grants. Never fails:
/// if `setrlimit` is refused, the limit found is reported unchanged.
pub fn raise_nofile(target: Option<u64>) -> NofileLimit {
    let ceiling = nr_open();
    let found = getrlimit(Resource::Nofile);
    let soft_before = rlim_value(found.current, ceiling);
    let mut hard = rlim_value(found.maximum, ceiling);
    if let Some(t) = target.filter(|&t| t > hard) {
        let both = Rlimit {
            current: Some(t),
            maximum: Some(t),
        };
        match setrlimit(Resource::Nofile, both) {
            Ok(()) => hard = t,
            Err(e) => tracing::info!(error = %e, target = t, hard, nr_open = ceiling,
                "cannot raise the hard RLIMIT_NOFILE (needs CAP_SYS_RESOURCE and fs.nr_open >= target)"),
        }
    }
    let now = getrlimit(Resource::Nofile);
    if rlim_value(now.current, ceiling) < hard {
        let wanted = Rlimit {
            current: Some(hard),
            maximum: now.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, wanted) {
            tracing::warn!(error = %e, soft_before, hard, "could not raise RLIMIT_NOFILE soft limit");
        }
    }
    let now = getrlimit(Resource::Nofile);
    NofileLimit {
        soft_before,
        hard,
        effective: rlim_value(now.current, ceiling),
    }
}

/// Why the connection cap is lower than `--max-connections`, if it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapLimit {
    /// The cap is `--max-connections` as configured.
    Configured,
    /// The descriptor limit cannot hold `--max-connections`; the cap is the
    /// limit minus [`fd_reserve`].
    FdLimit,
}

/// The connection cap the server enforces and how it was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCap {
    /// Live connections allowed in this process, in connections.
    pub cap: u64,
    /// What bound the cap.
    pub limited_by: CapLimit,
    /// `Some(expected)` when `--nofile` asked for more descriptors than the
    /// process has: the plan's assumption does not hold on this node.
    pub nofile_shortfall: Option<u64>,
}

/// Computes the per-process connection cap.
///
/// The cap never exceeds what the descriptor limit can hold (limit minus the
/// reserve for listeners, epoll and admin), whether or not `--nofile` was
/// given: a cap the server cannot honour would turn into `EMFILE` on accept.
/// `nofile_expected` only decides whether the mismatch is a planning error
/// worth a warning.
pub fn connection_cap(
    max_connections: u64,
    nofile_expected: Option<u64>,
    fd_limit: u64,
    workers: u64,
) -> ConnectionCap {
    let budget = fd_limit.saturating_sub(fd_reserve(workers));
    let (cap, limited_by) = if max_connections > budget {
        (budget, CapLimit::FdLimit)
    } else {
        (max_connections, CapLimit::Configured)
    };
    ConnectionCap {
        cap,
        limited_by,
        nofile_shortfall: nofile_expected.filter(|&n| n > fd_limit),
    }
}

/// CPUs in the calling thread's affinity mask, ascending. Call it before
/// pinning any thread. Falls back to `0..available_parallelism` if the mask
/// cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    match sched_getaffinity(None) {
        Ok(set) => {
            let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect();
            if !cpus.is_empty() {
                return cpus;
            }
        }
        Err(e) => tracing::debug!(error = %e, "sched_getaffinity failed"),
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..n).collect()
}

/// Where the workers run: pinned one per CPU, or wherever the kernel puts
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pinning {
    /// Worker *i* is pinned to the *i*-th CPU of the list, which has one CPU
    /// per worker.
    Pinned(Vec<usize>),
    /// No worker is pinned; the kernel schedules them over the mask.
    Unpinned(Unpinned),
}

/// Why the workers are not pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unpinned {
    /// The mask holds more CPUs than there are workers: a shared pool (the
    /// kubelet's `none` CPU manager policy, or a cpuset larger than the
    /// plan), whose CPUs other processes use too. Pinning there put every
    /// single-worker shard of a node on the pool's first CPU.
    SharedPool,
    /// The mask holds fewer CPUs than there are workers: pinning would put
    /// two workers on one CPU while the kernel could move them.
    FewerCpusThanWorkers,
}

impl Unpinned {
    /// For the start-up log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SharedPool => "affinity mask has more CPUs than workers (shared pool)",
            Self::FewerCpusThanWorkers => "affinity mask has fewer CPUs than workers",
        }
    }
}

impl Pinning {
    /// The CPU worker `worker` is pinned to, if the workers are pinned.
    pub fn cpu(&self, worker: usize) -> Option<usize> {
        match self {
            Pinning::Pinned(cpus) => cpus.get(worker).copied(),
            Pinning::Unpinned(_) => None,
        }
    }

    /// Whether the workers are pinned.
    pub fn pinned(&self) -> bool {
        matches!(self, Pinning::Pinned(_))
    }
}

/// Decides whether to pin `workers` workers given the process's affinity
/// `mask` (its allowed CPUs, from [`allowed_cpus`]).
///
/// Pins only when the mask holds exactly one CPU per worker: that is what a
/// cpuset the process owns looks like (the kubelet's `static` CPU manager
/// policy gives a Guaranteed pod with integer CPUs exclusive CPUs, as many
/// as it requests, and the plan runs one worker per requested CPU; so does
/// `taskset -c` with as many CPUs as `--workers`). Any other mask is shared
/// with other processes or cannot give each worker its own CPU, and there
/// the kernel's scheduler places the threads better than a fixed pin: with
/// several single-worker processes in a shared pool, pinning each one's
/// worker to the first CPU of its mask put them all on one CPU.
pub fn pinning(mask: &[usize], workers: usize) -> Pinning {
    if mask.len() > workers {
        Pinning::Unpinned(Unpinned::SharedPool)
    } else if mask.len() < workers {
        Pinning::Unpinned(Unpinned::FewerCpusThanWorkers)
    } else {
        Pinning::Pinned(mask.to_vec())
    }
}

/// Pins the calling thread to `cpu`. Returns whether it worked; failure (a
/// CPU outside the cgroup's cpuset, a seccomp filter) is not an error, the
/// thread just stays unpinned.
pub fn pin_current_thread(cpu: usize) -> bool {
    if cpu >= CpuSet::MAX_CPU {
        return false;
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_is_configured_when_fds_suffice() {
        let c = connection_cap(10_000, None, 1_048_576, 8);
        assert_eq!(c.cap, 10_000);
        assert_eq!(c.limited_by, CapLimit::Configured);
        assert_eq!(c.nofile_shortfall, None);
    }

    #[test]
    fn cap_is_lowered_to_fd_limit_minus_reserve() {
        // The default 1M cap on this machine's 20,000 descriptors, 2 workers.
        let c = connection_cap(1_000_000, None, 20_000, 2);
        use c10m_wire::limits::ADMIN_MAX_CONNECTIONS;
        use c10m_wire::limits::{FD_RESERVE_BASE, FD_RESERVE_PER_WORKER};
        assert_eq!(
            c.cap,
            20_000 - (FD_RESERVE_BASE + ADMIN_MAX_CONNECTIONS + 2 * FD_RESERVE_PER_WORKER)
        );
        assert_eq!(c.cap, 19_830);
        assert_eq!(c.limited_by, CapLimit::FdLimit);
        assert_eq!(c.nofile_shortfall, None);
    }

    #[test]
    fn nofile_shortfall_is_reported() {
        let c = connection_cap(1_000_000, Some(1_048_576), 20_000, 2);
        assert_eq!(c.nofile_shortfall, Some(1_048_576));
        assert_eq!(c.cap, 19_830);
        // Asking for no more than we have is no shortfall.
        let c = connection_cap(1_000, Some(20_000), 20_000, 2);
        assert_eq!(c.nofile_shortfall, None);
        assert_eq!(c.cap, 1_000);
    }

    #[test]
    fn tiny_fd_limit_gives_zero_not_underflow() {
        let c = connection_cap(100, None, 10, 4);
        assert_eq!(c.cap, 0);
        assert_eq!(c.limited_by, CapLimit::FdLimit);
    }

    #[test]
    fn pins_only_with_one_cpu_per_worker() {
        // A static-CPU-manager cpuset of the plan's size: one CPU each.
        assert_eq!(pinning(&[2, 5, 7], 3), Pinning::Pinned(vec![2, 5, 7]));
        assert_eq!(pinning(&[1], 1), Pinning::Pinned(vec![1]));
        let p = pinning(&[2, 5, 7], 3);
        assert_eq!(
            (0..4).map(|w| p.cpu(w)).collect::<Vec<_>>(),
            [Some(2), Some(5), Some(7), None]
        );
        // Fault 12: single-worker shards in a shared pool all took CPU 0.
        assert_eq!(pinning(&[0, 1], 1), Pinning::Unpinned(Unpinned::SharedPool));
        let pool: Vec<usize> = (0..64).collect();
        for workers in [1, 2, 8, 63] {
            let p = pinning(&pool, workers);
            assert_eq!(p, Pinning::Unpinned(Unpinned::SharedPool), "{workers}");
            assert!(!p.pinned());
            assert_eq!(p.cpu(0), None);
        }
        assert!(pinning(&pool, 64).pinned());
        // More workers than CPUs: pinning would stack two on one CPU.
        assert_eq!(
            pinning(&[3], 2),
            Pinning::Unpinned(Unpinned::FewerCpusThanWorkers)
        );
        assert_eq!(
            pinning(&[], 1),
            Pinning::Unpinned(Unpinned::FewerCpusThanWorkers)
        );
    }

    #[test]
    fn affinity_mask_is_readable_and_matches_parallelism() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
        // std reads the same mask (and cgroup quota, which can only lower it).
        let par = std::thread::available_parallelism().unwrap().get();
        assert!(par <= cpus.len(), "{par} > {cpus:?}");
    }

    #[test]
    fn raise_nofile_reaches_hard_limit() {
        // A target above the hard limit is refused here (no CAP_SYS_RESOURCE
        // in this VM, where the hard limit is capped): soft still reaches hard.
        let before = getrlimit(Resource::Nofile).maximum;
        let l = raise_nofile(before.map(|h| h + 1024));
        assert!(l.effective >= l.soft_before);
        assert_eq!(getrlimit(Resource::Nofile).maximum, before);
        assert_eq!(l.effective, l.hard, "{l:?}");
        assert_eq!(Some(l.effective), getrlimit(Resource::Nofile).current);
    }
}
