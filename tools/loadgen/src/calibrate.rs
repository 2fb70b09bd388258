//! The calibration probe's parts that need no connection: its flags, where
//! the shard pod's memory cgroup is and how to read it, the TCP line of
//! `sockstat`, and the bytes a slow reader sends. The binary
//! (`src/bin/c10m-calibrate-probe.rs`) opens the connections and takes the
//! samples; the contract (flag names, report, mount point) is
//! [`c10m_wire::calibrate`].
//!
//! Memory figures follow `server-image/bench/fidelity.py` and
//! `docs/KERNEL_FACTS.md` ("Charged to the pod's memory cgroup"): on a
//! cgroup v1 host TCP socket memory is charged only once socket accounting
//! is on, and then its buffer pages sit in `memory.kmem.tcp.usage_in_bytes`,
//! outside `memory.usage_in_bytes`; v2 charges everything to
//! `memory.current`.

use std::fs;
use std::io;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use c10m_server::ws;
use c10m_wire::calibrate::{self as wire, SLOW_READER_SEND_BYTES};
use clap::Parser;

use crate::Mode;

/// File descriptors kept spare beyond the probe's connections (stdio, the
/// epoll instance, cgroup and proc files being read).
pub const FD_MARGIN: u64 = 64;

/// How far below a `kubepods*` directory a pod's cgroup may be: the QoS
/// class level (`burstable`, `besteffort`; absent for guaranteed pods),
/// then the pod.
const POD_SEARCH_DEPTH: usize = 3;

/// How far below the pod's cgroup its processes may be: the containers'
/// cgroups (and a level more for runtimes that nest).
const PROCS_SEARCH_DEPTH: usize = 2;

/// `c10m-calibrate-probe` flags; the long names are
/// [`c10m_wire::calibrate::flag`]'s (a test holds them equal).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "c10m-calibrate-probe",
    version,
    about = "Opens idle connections to one shard in steps, then slow readers, samples the shard \
             pod's memory cgroup after each, and prints the report as JSON"
)]
pub struct Args {
    /// `IP:PORT` of the shard's connection listener.
    #[arg(long = "target")]
    pub target: SocketAddrV4,
    /// Protocol of the shard (`websocket`: a connection counts once its
    /// upgrade is answered).
    #[arg(long = "protocol", value_enum)]
    pub protocol: Mode,
    /// The shard pod's `metadata.uid`.
    #[arg(long = "pod-uid")]
    pub pod_uid: String,
    /// Comma-separated idle-connection counts to sample at, ascending.
    #[arg(long = "steps")]
    pub steps: Steps,
    /// Slow readers to open after the last step, each sending 1 MiB.
    #[arg(long = "slow-readers", default_value_t = 0)]
    pub slow_readers: u64,
    /// Seconds to wait after a step before sampling.
    #[arg(long = "settle-seconds", default_value_t = 5)]
    pub settle_seconds: u64,
    /// Seconds the whole probe may take; then it reports what it has.
    #[arg(long = "timeout-seconds", default_value_t = 600)]
    pub timeout_seconds: u64,
    /// Where the host's cgroup filesystem is (run on the host:
    /// `/sys/fs/cgroup`).
    #[arg(long, hide = true, default_value = wire::HOST_CGROUP_MOUNT)]
    pub cgroup_root: PathBuf,
    /// Where the host's procfs is (the pod has `hostPID`).
    #[arg(long, hide = true, default_value = "/proc")]
    pub proc_root: PathBuf,
}

/// Idle-connection counts to sample at: at least one, each above 0,
/// strictly ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Steps(pub Vec<u64>);

impl FromStr for Steps {
    type Err = String;

    fn from_str(s: &str) -> Result<Steps, String> {
        let steps = s
            .split(',')
            .map(|p| {
                p.trim()
                    .parse::<u64>()
                    .map_err(|e| format!("step {p:?}: {e}"))
            })
            .collect::<Result<Vec<u64>, String>>()?;
        if steps.first() == Some(&0) {
            return Err("steps start above 0 (the sample at 0 is always taken)".into());
        }
        if let Some(w) = steps.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!("steps ascend: {} then {}", w[0], w[1]));
        }
        Ok(Steps(steps))
    }
}

impl Steps {
    /// The largest step: the idle connections held at the end.
    pub fn last(&self) -> u64 {
        self.0.last().copied().unwrap_or(0)
    }
}

/// Descriptors the probe needs for `idle` idle connections and `slow` slow
/// readers held at once, checked against RLIMIT_NOFILE's hard limit
/// (20,000 per process on our machines).
pub fn fds_needed(idle: u64, slow: u64, hard_limit: u64) -> Result<u64, String> {
    let needed = idle + slow + FD_MARGIN;
    if needed > hard_limit {
        return Err(format!(
            "{idle} idle connections + {slow} slow readers + {FD_MARGIN} spare need {needed} file \
             descriptors, above this process's hard RLIMIT_NOFILE of {hard_limit}"
        ));
    }
    Ok(needed)
}

/// What one slow reader sends, all of it: [`SLOW_READER_SEND_BYTES`] raw
/// bytes (echo), or as much payload in masked binary frames of
/// [`ws::DEFAULT_MAX_FRAME_BYTES`] (64 KiB, the server's default
/// `C10M_MAX_FRAME_BYTES`; 16 frames).
pub fn slow_reader_stream(protocol: Mode, mask: [u8; 4]) -> Vec<u8> {
    let total = SLOW_READER_SEND_BYTES as usize;
    match protocol {
        Mode::Echo => vec![b'x'; total],
        Mode::Websocket => {
            let chunk = vec![b'x'; ws::DEFAULT_MAX_FRAME_BYTES];
            let mut out = Vec::with_capacity(total + total / chunk.len() * ws::MAX_HEADER_BYTES);
            let mut left = total;
            while left > 0 {
                let n = left.min(chunk.len());
                out.extend(ws::client_frame(
                    true,
                    ws::opcode::BINARY,
                    &chunk[..n],
                    mask,
                ));
                left -= n;
            }
            out
        }
    }
}

/// Whether two readings of the pod's bytes agree within 1 %.
pub fn agree(a: u64, b: u64) -> bool {
    a.abs_diff(b) * 100 <= a.max(b)
}

/// The `TCP:` line of `/proc/PID/net/sockstat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SockstatTcp {
    /// `inuse`: TCP sockets of the network namespace (listeners included).
    pub in_use: u64,
    /// `mem`: pages charged to `net.ipv4.tcp_mem`, host-wide.
    pub mem_pages: u64,
}

impl SockstatTcp {
    /// Parses a `sockstat` file; `None` without a complete `TCP:` line.
    pub fn parse(text: &str) -> Option<SockstatTcp> {
        let line = text.lines().find_map(|l| l.strip_prefix("TCP:"))?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let get = |key: &str| {
            fields
                .chunks_exact(2)
                .find(|kv| kv[0] == key)
                .and_then(|kv| kv[1].parse().ok())
        };
        Some(SockstatTcp {
            in_use: get("inuse")?,
            mem_pages: get("mem")?,
        })
    }
}

/// The value of `key` in a `memory.stat` file (`key value` lines).
pub fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The host's memory cgroup hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupMode {
    /// cgroup v1: the memory controller at `ROOT/memory`.
    V1,
    /// cgroup v2: one unified hierarchy at `ROOT` (it has
    /// `cgroup.controllers`).
    V2,
}

impl CgroupMode {
    /// The mode of the cgroup filesystem mounted at `root`.
    pub fn detect(root: &Path) -> CgroupMode {
        if root.join("cgroup.controllers").exists() {
            CgroupMode::V2
        } else {
            CgroupMode::V1
        }
    }

    /// `v1` or `v2`, as the report names it.
    pub fn name(self) -> &'static str {
        match self {
            CgroupMode::V1 => "v1",
            CgroupMode::V2 => "v2",
        }
    }

    /// The root of the memory hierarchy under the mount at `root`.
    pub fn memory_root(self, root: &Path) -> PathBuf {
        match self {
            CgroupMode::V1 => root.join("memory"),
            CgroupMode::V2 => root.to_path_buf(),
        }
    }
}

/// Whether the directory `name` is the cgroup of the pod `uid`: `pod<UID>`
/// (the kubelet's cgroupfs driver) or `kubepods[-QOS]-pod<UID>.slice` with
/// the UID's `-` as `_` (the systemd driver).
pub fn is_pod_dir(name: &str, uid: &str) -> bool {
    let dashed = uid.replace('_', "-");
    let underscored = uid.replace('-', "_");
    name == format!("pod{dashed}")
        || (name.starts_with("kubepods") && name.ends_with(&format!("-pod{underscored}.slice")))
}

/// Subdirectories of `dir`, sorted by name; none if it cannot be read.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// The first directory at most `depth` levels below `dir` whose name
/// `matches`, breadth first.
fn find_below(dir: &Path, depth: usize, matches: &dyn Fn(&str) -> bool) -> Option<PathBuf> {
    let mut level = vec![dir.to_path_buf()];
    for _ in 0..depth {
        level = level.iter().flat_map(|d| subdirs(d)).collect();
        if let Some(hit) = level
            .iter()
            .find(|d| d.file_name().and_then(|n| n.to_str()).is_some_and(matches))
        {
            return Some(hit.clone());
        }
    }
    None
}

/// The memory cgroup of `uid` under the memory hierarchy `memory_root`: a
/// pod directory below one of its `kubepods*` directories (`kubepods`,
/// `kubepods.slice`).
pub fn find_pod_cgroup(memory_root: &Path, uid: &str) -> Option<PathBuf> {
    subdirs(memory_root)
        .into_iter()
        .filter(|d| {
            d.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("kubepods"))
        })
        .find_map(|d| find_below(&d, POD_SEARCH_DEPTH, &|n| is_pod_dir(n, uid)))
}

/// PIDs in `cgroup` and the cgroups below it (its containers'), from their
/// `cgroup.procs` (host PIDs: the probe shares the host's PID namespace).
pub fn cgroup_pids(cgroup: &Path) -> Vec<u32> {
    let mut dirs = vec![cgroup.to_path_buf()];
    let mut level = dirs.clone();
    for _ in 0..PROCS_SEARCH_DEPTH {
        level = level.iter().flat_map(|d| subdirs(d)).collect();
        dirs.extend(level.iter().cloned());
    }
    dirs.iter()
        .filter_map(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

fn read_u64(path: &Path) -> io::Result<u64> {
    let text = fs::read_to_string(path)?;
    text.trim().parse().map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {text:?}: {e}", path.display()),
        )
    })
}

/// Whether TCP socket memory is charged to memory cgroups on this host.
/// Always on v2. On v1 it is switched on host-wide (a static key) by the
/// first write of any cgroup's `memory.kmem.tcp.limit_in_bytes`
/// [docs/KERNEL_FACTS.md], so: whether any cgroup of the hierarchy has a
/// TCP limit below the root's (which cannot be written: its value is
/// "unlimited"), or has charged TCP pages (`memory.kmem.tcp.max_usage_in_bytes`
/// above 0: only cgroups with a written limit charge them). A write of the
/// unlimited value itself by a cgroup that never held a socket is missed.
pub fn socket_accounted(mode: CgroupMode, memory_root: &Path) -> io::Result<bool> {
    if mode == CgroupMode::V2 {
        return Ok(true);
    }
    let unlimited = read_u64(&memory_root.join("memory.kmem.tcp.limit_in_bytes"))?;
    let mut stack = subdirs(memory_root);
    while let Some(dir) = stack.pop() {
        let limited =
            read_u64(&dir.join("memory.kmem.tcp.limit_in_bytes")).is_ok_and(|l| l < unlimited);
        let charged =
            read_u64(&dir.join("memory.kmem.tcp.max_usage_in_bytes")).is_ok_and(|u| u > 0);
        if limited || charged {
            return Ok(true);
        }
        stack.extend(subdirs(&dir));
    }
    Ok(false)
}

/// The pod's memory, in bytes, as [`c10m_wire::calibrate::Sample`] defines
/// its fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// Everything charged to the pod (`pod_bytes`).
    pub pod: u64,
    /// Anonymous memory (`user_bytes`).
    pub user: u64,
    /// Kernel memory (`kernel_bytes`).
    pub kernel: u64,
}

/// v1: `memory.usage_in_bytes` (`usage`), `memory.stat` `total_rss`,
/// `memory.kmem.usage_in_bytes` (`kmem`) and, when sockets are accounted,
/// `memory.kmem.tcp.usage_in_bytes` (`kmem_tcp`: the TCP buffer pages,
/// which v1 keeps outside both other counters).
pub fn memory_v1(
    usage: u64,
    stat: &str,
    kmem: u64,
    kmem_tcp: u64,
    accounted: bool,
) -> Result<Memory, String> {
    let tcp = if accounted { kmem_tcp } else { 0 };
    Ok(Memory {
        pod: usage + tcp,
        user: stat_field(stat, "total_rss").ok_or("memory.stat has no total_rss")?,
        kernel: kmem + tcp,
    })
}

/// v2: `memory.current` (`current`), `memory.stat` `anon`, and `kernel`
/// (before Linux 5.18: `slab` + `kernel_stack` + `pagetables` + `percpu`)
/// + `sock`.
pub fn memory_v2(current: u64, stat: &str) -> Result<Memory, String> {
    let field = |k: &str| stat_field(stat, k).ok_or(format!("memory.stat has no {k}"));
    let kernel = match stat_field(stat, "kernel") {
        Some(k) => k,
        None => ["slab", "kernel_stack", "pagetables", "percpu"]
            .iter()
            .map(|k| field(k))
            .sum::<Result<u64, String>>()?,
    };
    Ok(Memory {
        pod: current,
        user: field("anon")?,
        kernel: kernel + field("sock")?,
    })
}

/// The shard pod's memory cgroup.
#[derive(Debug, Clone)]
pub struct PodCgroup {
    /// The host's hierarchy.
    pub mode: CgroupMode,
    /// The pod's directory in the memory hierarchy.
    pub dir: PathBuf,
}

impl PodCgroup {
    /// Reads the pod's memory now; `accounted`: whether TCP socket memory
    /// is charged ([`socket_accounted`]).
    pub fn memory(&self, accounted: bool) -> Result<Memory, String> {
        let file = |name: &str| self.dir.join(name);
        let int = |name: &str| read_u64(&file(name)).map_err(|e| format!("{name}: {e}"));
        let text = |name: &str| fs::read_to_string(file(name)).map_err(|e| format!("{name}: {e}"));
        match self.mode {
            CgroupMode::V1 => memory_v1(
                int("memory.usage_in_bytes")?,
                &text("memory.stat")?,
                int("memory.kmem.usage_in_bytes")?,
                int("memory.kmem.tcp.usage_in_bytes")?,
                accounted,
            ),
            CgroupMode::V2 => memory_v2(int("memory.current")?, &text("memory.stat")?),
        }
    }

    /// OOM kills the kernel counted in the pod ([`Report::oom_kills`]):
    /// v1 adds `memory.oom_control` `oom_kill` of the pod's directory and
    /// of each directory below it (a container's), since v1 counts a kill
    /// only in the cgroup it happened in; v2 reads the pod's
    /// `memory.events`, which counts its descendants'. Unreadable counters
    /// (a container's cgroup removed after its exit) count 0.
    ///
    /// [`Report::oom_kills`]: c10m_wire::calibrate::Report::oom_kills
    pub fn oom_kills(&self) -> u64 {
        let read = |dir: &Path, file: &str| {
            fs::read_to_string(dir.join(file))
                .ok()
                .and_then(|t| stat_field(&t, "oom_kill"))
                .unwrap_or(0)
        };
        match self.mode {
            CgroupMode::V1 => {
                let children = fs::read_dir(&self.dir).into_iter().flatten().flatten();
                let dirs = children
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path());
                std::iter::once(self.dir.clone())
                    .chain(dirs)
                    .map(|d| read(&d, "memory.oom_control"))
                    .sum()
            }
            CgroupMode::V2 => read(&self.dir, "memory.events"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use c10m_wire::calibrate::flag;
    use clap::CommandFactory;

    #[test]
    fn long_flag_names_are_the_contracts() {
        let cmd = Args::command();
        let longs: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).collect();
        for name in [
            flag::TARGET,
            flag::PROTOCOL,
            flag::POD_UID,
            flag::STEPS,
            flag::SLOW_READERS,
            flag::SETTLE_SECONDS,
            flag::TIMEOUT_SECONDS,
        ] {
            let long = name.strip_prefix("--").expect("flags start with --");
            assert!(longs.contains(&long), "no --{long} among {longs:?}");
        }
        assert_eq!(cmd.get_name(), wire::BINARY);
        use clap::ValueEnum;
        let names: Vec<String> = Mode::value_variants()
            .iter()
            .map(|m| m.to_possible_value().unwrap().get_name().to_owned())
            .collect();
        assert_eq!(
            names,
            [c10m_wire::protocol::ECHO, c10m_wire::protocol::WEBSOCKET]
        );
    }

    #[test]
    fn flags_parse_as_the_operator_renders_them() {
        let a = Args::try_parse_from([
            wire::BINARY,
            "--target=10.0.0.5:7000",
            "--protocol=websocket",
            "--pod-uid=0f6c1d2e-aaaa-bbbb-cccc-123456789abc",
            "--steps=2000,4000",
            "--slow-readers=100",
            "--timeout-seconds=285",
        ])
        .unwrap();
        assert_eq!(a.steps, Steps(vec![2000, 4000]));
        assert_eq!((a.slow_readers, a.settle_seconds), (100, 5));
        assert_eq!(a.cgroup_root, Path::new(wire::HOST_CGROUP_MOUNT));
        assert_eq!(a.proc_root, Path::new("/proc"));
    }

    #[test]
    fn steps_are_positive_and_ascending() {
        assert_eq!("500, 1000,4000".parse(), Ok(Steps(vec![500, 1000, 4000])));
        assert_eq!(Steps(vec![500, 1000]).last(), 1000);
        for bad in ["", "0,100", "100,100", "200,100", "1k"] {
            assert!(bad.parse::<Steps>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn descriptors_fit_under_the_hard_limit_or_say_why_not() {
        assert_eq!(fds_needed(16_000, 300, 20_000), Ok(16_364));
        let e = fds_needed(19_900, 100, 20_000).unwrap_err();
        assert!(e.contains("need 20064") && e.contains("of 20000"), "{e}");
    }

    #[test]
    fn slow_readers_send_one_mib_in_frames_the_server_accepts() {
        assert_eq!(
            slow_reader_stream(Mode::Echo, [1, 2, 3, 4]).len() as u64,
            SLOW_READER_SEND_BYTES
        );
        let stream = slow_reader_stream(Mode::Websocket, [1, 2, 3, 4]);
        let (mut at, mut payload, mut frames) = (0, 0, 0);
        while at < stream.len() {
            let h = ws::parse_header(&stream[at..]).unwrap().unwrap();
            assert!(h.fin && h.mask.is_some() && h.opcode == ws::opcode::BINARY);
            assert!(h.len as usize <= ws::DEFAULT_MAX_FRAME_BYTES);
            at += h.header_len + h.len as usize;
            payload += h.len;
            frames += 1;
        }
        assert_eq!((payload, frames), (SLOW_READER_SEND_BYTES, 16));
        let mut msg = ws::Message::default();
        let mut out = Vec::new();
        let (used, outcome) = ws::process(&stream, &mut msg, &mut out, ws::DEFAULT_MAX_FRAME_BYTES);
        assert_eq!((used, outcome), (stream.len(), ws::Outcome::Continue));
    }

    #[test]
    fn readings_agree_within_one_percent() {
        assert!(agree(100_000, 100_999));
        assert!(agree(101_000, 100_000));
        assert!(!agree(100_000, 102_000));
        assert!(agree(0, 0));
    }

    #[test]
    fn sockstat_tcp_line() {
        let text = "sockets: used 173\n\
                    TCP: inuse 148 orphan 0 tw 2 alloc 148 mem 95\n\
                    UDP: inuse 0 mem 0\n";
        assert_eq!(
            SockstatTcp::parse(text),
            Some(SockstatTcp {
                in_use: 148,
                mem_pages: 95
            })
        );
        assert_eq!(SockstatTcp::parse("UDP: inuse 0 mem 0\n"), None);
        assert_eq!(SockstatTcp::parse("TCP: inuse 3 orphan 0\n"), None);
    }

    const V1_STAT: &str = "cache 135168\nrss 1892352\nrss_huge 0\nshmem 0\n\
        hierarchical_memory_limit 9223372036854771712\n\
        total_cache 270336\ntotal_rss 3784704\ntotal_rss_huge 0\n";

    const V2_STAT: &str = "anon 2101248\nfile 8192\nkernel 1462272\nkernel_stack 65536\n\
        pagetables 98304\nsec_pagetables 0\npercpu 720\nsock 12288\nvmalloc 0\n\
        slab 1221000\n";

    #[test]
    fn memory_stat_fields_by_exact_key() {
        assert_eq!(stat_field(V1_STAT, "rss"), Some(1_892_352));
        assert_eq!(stat_field(V1_STAT, "total_rss"), Some(3_784_704));
        assert_eq!(stat_field(V1_STAT, "swap"), None);
    }

    #[test]
    fn v1_adds_tcp_pages_only_when_accounted() {
        let off = memory_v1(50_000_000, V1_STAT, 20_000_000, 0, false).unwrap();
        assert_eq!(
            off,
            Memory {
                pod: 50_000_000,
                user: 3_784_704,
                kernel: 20_000_000
            }
        );
        let on = memory_v1(50_000_000, V1_STAT, 20_000_000, 4_096_000, true).unwrap();
        assert_eq!((on.pod, on.kernel), (54_096_000, 24_096_000));
        assert!(memory_v1(1, "rss 1\n", 1, 0, false).is_err());
    }

    #[test]
    fn v2_kernel_is_kernel_plus_sock_or_its_parts() {
        let m = memory_v2(9_000_000, V2_STAT).unwrap();
        assert_eq!((m.pod, m.user, m.kernel), (9_000_000, 2_101_248, 1_474_560));
        let old = V2_STAT.replace("kernel 1462272\n", "");
        let m = memory_v2(9_000_000, &old).unwrap();
        assert_eq!(m.kernel, 1_221_000 + 65_536 + 98_304 + 720 + 12_288);
        assert!(memory_v2(1, "anon 1\n").is_err());
    }

    #[test]
    fn pod_dirs_by_either_cgroup_driver() {
        let uid = "0f6c1d2e-aaaa-bbbb-cccc-123456789abc";
        assert!(is_pod_dir(&format!("pod{uid}"), uid));
        assert!(is_pod_dir(
            "kubepods-burstable-pod0f6c1d2e_aaaa_bbbb_cccc_123456789abc.slice",
            uid
        ));
        assert!(is_pod_dir(
            "kubepods-pod0f6c1d2e_aaaa_bbbb_cccc_123456789abc.slice",
            uid
        ));
        assert!(!is_pod_dir(&format!("pod{uid}x"), uid));
        assert!(!is_pod_dir("pod0f6c1d2e", uid));
    }

    /// A fresh directory under the system's temp dir, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let dir =
                std::env::temp_dir().join(format!("c10m-calibrate-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Tree(dir)
        }

        fn file(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn finds_the_pod_and_its_processes_in_a_v1_tree() {
        let t = Tree::new("v1");
        let uid = "11111111-2222-3333-4444-555555555555";
        let pod = format!("memory/kubepods/burstable/pod{uid}");
        t.file(
            "memory/memory.kmem.tcp.limit_in_bytes",
            "9223372036854771712\n",
        );
        t.file("memory/kubepods/besteffort/podaaaa/cgroup.procs", "7\n");
        t.file(&format!("{pod}/cgroup.procs"), "");
        t.file(&format!("{pod}/abc123/cgroup.procs"), "4242\n4243\n");
        t.file(&format!("{pod}/def456/cgroup.procs"), "99\n");
        t.file(&format!("{pod}/memory.usage_in_bytes"), "60000000\n");
        t.file(&format!("{pod}/memory.stat"), V1_STAT);
        t.file(&format!("{pod}/memory.kmem.usage_in_bytes"), "21000000\n");
        t.file(&format!("{pod}/memory.kmem.tcp.usage_in_bytes"), "0\n");
        t.file(
            &format!("{pod}/memory.kmem.tcp.limit_in_bytes"),
            "9223372036854771712\n",
        );
        t.file(&format!("{pod}/memory.kmem.tcp.max_usage_in_bytes"), "0\n");

        assert_eq!(CgroupMode::detect(&t.0), CgroupMode::V1);
        let root = CgroupMode::V1.memory_root(&t.0);
        let dir = find_pod_cgroup(&root, uid).unwrap();
        assert_eq!(dir, t.0.join(&pod));
        assert_eq!(
            find_pod_cgroup(&root, "99999999-2222-3333-4444-555555555555"),
            None
        );
        assert_eq!(cgroup_pids(&dir), [4242, 4243, 99]);
        let cg = PodCgroup {
            mode: CgroupMode::V1,
            dir,
        };
        assert_eq!(cg.memory(false).unwrap().kernel, 21_000_000);
        // v1 counts a kill only where it happened: the pod's counter says 0
        // while a container's says 1; a container without the file adds 0.
        assert_eq!(cg.oom_kills(), 0);
        let control = "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n";
        t.file(
            &format!("{pod}/memory.oom_control"),
            &control.replace("{}", "0"),
        );
        t.file(
            &format!("{pod}/abc123/memory.oom_control"),
            &control.replace("{}", "1"),
        );
        assert_eq!(cg.oom_kills(), 1);

        assert!(!socket_accounted(CgroupMode::V1, &root).unwrap());
        t.file(
            "memory/kubepods/besteffort/podaaaa/memory.kmem.tcp.limit_in_bytes",
            "1125899906842624\n",
        );
        assert!(socket_accounted(CgroupMode::V1, &root).unwrap());
    }

    #[test]
    fn finds_the_pod_in_a_v2_systemd_tree() {
        let t = Tree::new("v2");
        let uid = "11111111-2222-3333-4444-555555555555";
        let pod = "kubepods.slice/kubepods-besteffort.slice/\
                   kubepods-besteffort-pod11111111_2222_3333_4444_555555555555.slice";
        t.file("cgroup.controllers", "cpuset cpu io memory pids\n");
        t.file(
            &format!("{pod}/cri-containerd-abc.scope/cgroup.procs"),
            "314\n",
        );
        t.file(&format!("{pod}/memory.current"), "9000000\n");
        t.file(&format!("{pod}/memory.stat"), V2_STAT);

        let mode = CgroupMode::detect(&t.0);
        assert_eq!(mode, CgroupMode::V2);
        let dir = find_pod_cgroup(&mode.memory_root(&t.0), uid).unwrap();
        assert_eq!(dir, t.0.join(pod));
        assert_eq!(cgroup_pids(&dir), [314]);
        let cg = PodCgroup { mode, dir };
        let m = cg.memory(true).unwrap();
        assert_eq!(m.pod, 9_000_000);
        assert_eq!(cg.oom_kills(), 0);
        t.file(
            &format!("{pod}/memory.events"),
            "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n",
        );
        assert_eq!(cg.oom_kills(), 1);
        assert!(socket_accounted(mode, &t.0).unwrap());
    }
}
