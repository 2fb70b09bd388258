//! `C10M_RUN_AS`: the server raises RLIMIT_NOFILE, then drops from root to
//! an unprivileged uid:gid with no capabilities before it serves. The real
//! binary is started the way the operator's InitContainer-mode pod starts
//! it, and the kernel's view is read from `/proc/<pid>/status` and
//! `/proc/<pid>/limits`.
//!
//! These tests need root (to start the server as root and to shape its
//! capability sets); they fail, not skip, without it. CI and this machine
//! run tests as root.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use rustix::thread::CapabilitySet;

const TARGET: &str = "65532:65532";
const TOKEN: &str = "privilege-test-token";

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "tests/privilege.rs starts c10m-server as root and shapes its capabilities: run it as \
         root (CI does); euid is {}",
        rustix::process::geteuid().as_raw()
    );
}

/// A per-test scratch directory that uid 65532 can enter (the server
/// reads the token file from it after the drop); removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("c10m-privilege-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str, mode: u32) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How the child starts, set up between `fork` and `execve`.
#[derive(Clone, Copy)]
enum Start {
    /// Root, the way the InitContainer-mode pod starts it: supplementary
    /// group 0 (containerd's `additionalGids: [0]`), `no_new_privs`
    /// (`allowPrivilegeEscalation: false`), RLIMIT_NOFILE soft 1,024 under
    /// the inherited hard limit (containerd 2.x), and a bounding set of
    /// only these capabilities (`drop: [ALL], add: [...]`), which is then
    /// also root's permitted and effective set after `execve`.
    Root { keep: CapabilitySet },
    /// Already unprivileged: uid:gid 65532:65532, no groups (std's
    /// `Command::uid` clears them when the parent is root).
    Unprivileged,
}

/// Highest capability number this kernel knows.
fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn command(start: Start, env: &[(&str, &str)], log: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("C10M_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    match start {
        Start::Root { keep } => {
            let last = cap_last_cap();
            let hard = hard_nofile();
            // SAFETY: the pre-exec hook runs in the forked child, where only
            // async-signal-safe calls are allowed: each of these is one
            // system call (setgroups, prctl, setrlimit) and allocates nothing.
            #[allow(unsafe_code)]
            unsafe {
                cmd.pre_exec(move || {
                    let root = rustix::process::Gid::ROOT;
                    rustix::thread::set_thread_groups(&[root])?;
                    for cap in 0..=last {
                        let c = CapabilitySet::from_bits_retain(1 << cap);
                        if !keep.contains(c) {
                            rustix::thread::remove_capability_from_bounding_set(c)?;
                        }
                    }
                    rustix::thread::set_no_new_privs(true)?;
                    let lim = rustix::process::Rlimit {
                        current: Some(1024),
                        maximum: Some(hard),
                    };
                    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim)?;
                    Ok(())
                });
            }
        }
        Start::Unprivileged => {
            cmd.uid(65532).gid(65532);
        }
    }
    cmd
}

/// Starts the server on fresh loopback ports (new ports after a lost port
/// race); panics with its log if it exits during start-up for any other
/// reason.
fn start(start: Start, extra_env: &[(&str, &str)], log: &Path) -> Server {
    start_on_fresh_ports(Some(log), |ip, port, admin_port| {
        let (ip_s, port_s, admin_s) = (ip.to_string(), port.to_string(), admin_port.to_string());
        let mut env = vec![
            ("C10M_BIND", ip_s.as_str()),
            ("C10M_PORT", port_s.as_str()),
            ("C10M_METRICS_PORT", admin_s.as_str()),
            ("C10M_WORKERS", "2"),
            ("C10M_DRAIN_ACCEPT_SECS", "0"),
        ];
        env.extend_from_slice(extra_env);
        command(start, &env, log)
    })
}

/// Runs the server to its exit (it must not start serving); exit status
/// and log.
fn run_to_exit(start: Start, env: &[(&str, &str)], log: &Path) -> (Option<i32>, String) {
    let ip = test_ip();
    let (ip_s, port_s, admin_s) = (
        ip.to_string(),
        free_port(ip).to_string(),
        free_port(ip).to_string(),
    );
    let mut all = vec![
        ("C10M_BIND", ip_s.as_str()),
        ("C10M_PORT", port_s.as_str()),
        ("C10M_METRICS_PORT", admin_s.as_str()),
    ];
    all.extend_from_slice(env);
    let mut child = command(start, &all, log).spawn().unwrap();
    let deadline = std::time::Instant::now() + START_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "c10m-server kept running with {env:?}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status.code(), std::fs::read_to_string(log).unwrap())
}

/// The value of `Name:` in a `/proc/<pid>/status` text, whitespace-joined.
fn status_field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {name}: in\n{status}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Soft and hard `Max open files` from `/proc/<pid>/limits`.
fn max_open_files(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (v[0], v[1])
}

fn caps(c: CapabilitySet) -> String {
    format!("{:016x}", c.bits())
}

/// The InitContainer-mode start: root with only CAP_SETUID and CAP_SETGID,
/// group 0, `no_new_privs`, soft nofile 1,024, and `C10M_NOFILE` above the
/// hard limit.
///
/// On this VM no process can hold CAP_SYS_RESOURCE (it is not in any
/// bounding set) and the hard RLIMIT_NOFILE is capped (20,000), so the
/// raise of the hard limit to `C10M_NOFILE` is refused, and logged; the
/// server still raises soft to hard before the drop. So the limit in force
/// after the drop, in `/proc/<pid>/limits` and `c10m_fd_limit`, is the hard
/// limit it started with, soft and hard: the rlimit survives `setresuid`.
/// Where CAP_SYS_RESOURCE is granted the same path reaches `C10M_NOFILE`;
/// that cannot be shown here.
#[test]
fn drops_to_run_as_after_raising_nofile_and_still_serves() {
    require_root();
    let scratch = Scratch::new("drop");
    let log = scratch.0.join("server.log");
    let token = scratch.file("token", TOKEN, 0o644);
    let hard = hard_nofile();
    let want_nofile = (hard + 1024).to_string();
    let keep = CapabilitySet::SETUID | CapabilitySet::SETGID;
    let mut server = start(
        Start::Root { keep },
        &[
            ("C10M_RUN_AS", TARGET),
            ("C10M_NOFILE", &want_nofile),
            ("C10M_ADMIN_TOKEN_FILE", token.to_str().unwrap()),
        ],
        &log,
    );
    let pid = server.child.id();

    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(
        status_field(&status, "Uid"),
        "65532 65532 65532 65532",
        "{status}"
    );
    assert_eq!(
        status_field(&status, "Gid"),
        "65532 65532 65532 65532",
        "{status}"
    );
    assert_eq!(
        status_field(&status, "Groups"),
        "",
        "group 0 must be gone:\n{status}"
    );
    for set in ["CapPrm", "CapEff", "CapAmb", "CapInh"] {
        assert_eq!(
            status_field(&status, set),
            caps(CapabilitySet::empty()),
            "{set}:\n{status}"
        );
    }
    // The bounding set stays as the runtime left it (dropping from it needs
    // CAP_SETPCAP); with no_new_privs nothing can be regained from it.
    assert_eq!(status_field(&status, "CapBnd"), caps(keep), "{status}");
    assert_eq!(status_field(&status, "NoNewPrivs"), "1", "{status}");

    assert_eq!(
        max_open_files(pid),
        (hard, hard),
        "soft raised to hard, kept after the drop"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("cannot raise the hard RLIMIT_NOFILE")
            && said.contains(&format!("target={want_nofile}")),
        "the refused raise must be logged:\n{said}"
    );
    let identity = said
        .lines()
        .find(|l| l.contains("process identity"))
        .unwrap_or_else(|| panic!("no identity line:\n{said}"));
    for field in [
        "uid=65532 ",
        "gid=65532 ",
        "groups=[] ",
        "cap_eff=0x0 ",
        "cap_prm=0x0 ",
        "cap_amb=0x0 ",
        "cap_bnd=0xc0 ",
        "no_new_privs=true ",
        &format!("nofile_soft={hard} "),
        &format!("nofile_hard={hard} "),
        "run_as=65532:65532 ",
        "change=\"dropped from 0:0\"",
    ] {
        assert!(
            identity.contains(field),
            "{field:?} missing from\n{identity}"
        );
    }
    // The drop came first: no socket before it.
    let drop_at = said.find("process identity").unwrap();
    assert!(
        said[..drop_at].lines().all(|l| !l.contains("serving")),
        "{said}"
    );

    // It serves as 65532, and what it reads after the drop was readable.
    let mut c = server.connect();
    echo_once(&mut c, b"x");
    let m = server.metrics();
    assert_eq!(value(&m, "c10m_fd_limit"), hard as f64);
    assert_eq!(value(&m, "c10m_process_uid"), 65532.0);
    assert_eq!(value(&m, "c10m_process_gid"), 65532.0);
    assert_eq!(value(&m, "c10m_process_capabilities_effective"), 0.0);
    assert!(
        value(&m, "c10m_tcp_sockets{state=\"inuse\"}") >= 1.0,
        "/proc/net/sockstat:\n{m}"
    );
    let nr_open: f64 = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        value(
            &m,
            "c10m_kernel_sysctl{name=\"fs.nr_open\",field=\"value\"}"
        ),
        nr_open
    );
    assert!(
        value(&m, "process_resident_memory_bytes") > 0.0,
        "/proc/self/statm:\n{m}"
    );

    // The token file was read as 65532: the order it guards is accepted.
    assert_eq!(server.post("/drain?rate=0", Some("wrong")).0, 401);
    assert_eq!(server.post("/drain?rate=0", Some(TOKEN)).0, 202);
    let exit = server.wait_exit(Duration::from_secs(5));
    assert_eq!(exit.code(), Some(0), "{exit}");
    assert_eof(&mut c);
}

/// The admin token file is read after the drop, as the serving uid: one
/// only root can read stops the start, naming the file and the uid.
#[test]
fn a_token_file_only_root_can_read_stops_the_start() {
    require_root();
    let scratch = Scratch::new("token");
    let log = scratch.0.join("server.log");
    let token = scratch.file("token", TOKEN, 0o600);
    let keep = CapabilitySet::SETUID | CapabilitySet::SETGID;
    let (code, said) = run_to_exit(
        Start::Root { keep },
        &[
            ("C10M_RUN_AS", TARGET),
            ("C10M_ADMIN_TOKEN_FILE", token.to_str().unwrap()),
        ],
        &log,
    );
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains(token.to_str().unwrap())
            && said.contains("as uid 65532 gid 65532")
            && said.contains("Permission denied"),
        "{said}"
    );
    assert!(!said.contains("c10m-server serving"), "{said}");
}

#[test]
fn root_or_malformed_run_as_exits_nonzero_naming_the_variable() {
    require_root();
    let scratch = Scratch::new("bad");
    let log = scratch.0.join("server.log");
    let keep = CapabilitySet::SETUID | CapabilitySet::SETGID;
    for (value, says) in [
        ("0:0", "uid 0 is root's"),
        ("65532:0", "gid 0 is root's"),
        ("65532", "has no \":GID\""),
        ("nobody:nogroup", "decimal digits"),
        ("", "has no \":GID\""),
    ] {
        let (code, said) = run_to_exit(Start::Root { keep }, &[("C10M_RUN_AS", value)], &log);
        assert_eq!(code, Some(2), "C10M_RUN_AS={value:?}: {said}");
        assert!(
            said.contains("C10M_RUN_AS") && said.contains(says),
            "C10M_RUN_AS={value:?}: {said}"
        );
    }
}

/// A root container without CAP_SETUID (say, `drop: [ALL]` and only
/// SETGID added) cannot finish the drop: the server exits rather than
/// serve as root.
#[test]
fn without_cap_setuid_the_server_refuses_to_serve() {
    require_root();
    let scratch = Scratch::new("nosetuid");
    let log = scratch.0.join("server.log");
    let (code, said) = run_to_exit(
        Start::Root {
            keep: CapabilitySet::SETGID,
        },
        &[("C10M_RUN_AS", TARGET)],
        &log,
    );
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("C10M_RUN_AS=65532:65532: setresuid(65532,65532,65532) refused")
            && said.contains("CAP_SETUID"),
        "{said}"
    );
    assert!(!said.contains("c10m-server serving"), "{said}");
}

/// In the other modes the container already runs as 65532:65532: the same
/// C10M_RUN_AS is a no-op, a different one an error (it cannot switch).
#[test]
fn already_the_target_is_a_no_op_and_another_uid_cannot_switch() {
    require_root();
    let scratch = Scratch::new("noop");
    let log = scratch.0.join("server.log");
    let mut server = start(Start::Unprivileged, &[("C10M_RUN_AS", TARGET)], &log);
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    assert_eq!(status_field(&status, "Uid"), "65532 65532 65532 65532");
    assert_eq!(
        status_field(&status, "CapEff"),
        caps(CapabilitySet::empty())
    );
    let mut c = server.connect();
    echo_once(&mut c, b"y");
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("process identity") && said.contains("change=\"none, already the target\""),
        "{said}"
    );
    assert_eq!(value(&server.metrics(), "c10m_process_uid"), 65532.0);
    server.signal(rustix::process::Signal::TERM);
    assert_eq!(server.wait_exit(Duration::from_secs(5)).code(), Some(0));

    let (code, said) = run_to_exit(Start::Unprivileged, &[("C10M_RUN_AS", "1000:1000")], &log);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("C10M_RUN_AS=1000:1000, but the server runs as uid 65532 gid 65532, not root: it cannot switch"),
        "{said}"
    );
}
