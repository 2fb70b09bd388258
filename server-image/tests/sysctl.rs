//! `c10m-sysctl` against a real kernel: namespaced sysctls in a network
//! namespace this test creates (`common::Netns`: util-linux, root; no
//! mount under /run/netns is left behind), node-level raises against a
//! scratch sysctl tree so the machine's own settings are never touched.

mod common;

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_c10m-sysctl");

#[test]
fn namespaced_sysctls_land_in_the_pod_netns_only() {
    let ns = common::Netns::new();
    let host_before = std::fs::read_to_string("/proc/sys/net/core/somaxconn").unwrap();
    let run = ns
        .command(BIN)
        .args([
            "--set=net.core.somaxconn=65535",
            "--set=net.ipv4.tcp_migrate_req=1",
        ])
        .output()
        .unwrap();
    let read =
        |f: &str| String::from_utf8(ns.command("cat").arg(f).output().unwrap().stdout).unwrap();
    let (somaxconn, migrate) = (
        read("/proc/sys/net/core/somaxconn"),
        read("/proc/sys/net/ipv4/tcp_migrate_req"),
    );
    drop(ns);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(somaxconn.trim(), "65535");
    assert_eq!(migrate.trim(), "1");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/core/somaxconn").unwrap(),
        host_before,
        "host netns untouched"
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("net.core.somaxconn: set to 65535"),
        "{stdout}"
    );
}

#[test]
fn node_sysctls_are_raised_never_lowered() {
    let dir = std::env::temp_dir().join(format!("c10m-sysctl-tree-{}", std::process::id()));
    let write = |name: &str, v: &str| {
        let p = dir.join(name.replace('.', "/"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{v}\n")).unwrap();
    };
    write("net.ipv4.tcp_mem", "100 200 300");
    write("fs.nr_open", "2000000");
    write("fs.file-max", "1000");
    // A stand-in host /proc whose PID 1 netns is this test's own, so setns runs for real.
    let host_proc = dir.join("host-proc");
    std::fs::create_dir_all(host_proc.join("1/ns")).unwrap();
    std::os::unix::fs::symlink(
        format!("/proc/{}/ns/net", std::process::id()),
        host_proc.join("1/ns/net"),
    )
    .unwrap();
    // The arguments as the operator renders them.
    use c10m_wire::sysctl_tool::{HOST_PROC_FLAG, RAISE_NODE_FLAG, arg};
    let out = Command::new(BIN)
        .args([
            format!("{HOST_PROC_FLAG}={}", host_proc.display()),
            format!("--proc-sys={}", dir.display()),
        ])
        .args([
            arg(RAISE_NODE_FLAG, "net.ipv4.tcp_mem", "50 400 350"),
            arg(RAISE_NODE_FLAG, "fs.nr_open", "1250080"),
            arg(RAISE_NODE_FLAG, "fs.file-max", "5000"),
        ])
        .output()
        .unwrap();
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name.replace('.', "/")))
            .unwrap()
            .trim()
            .to_string()
    };
    let (tcp_mem, nr_open, file_max) = (
        read("net.ipv4.tcp_mem"),
        read("fs.nr_open"),
        read("fs.file-max"),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        tcp_mem, "100 400 350",
        "each component raised, none lowered"
    );
    assert_eq!(nr_open, "2000000", "a higher node value is kept");
    assert_eq!(file_max, "5000");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("fs.nr_open: kept 2000000"), "{stdout}");
}

#[test]
fn bad_input_is_refused_without_writing() {
    let out = Command::new(BIN)
        .args(["--proc-sys=/nonexistent", "--set=net.core.somaxconn"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected name=value"));
    let out = Command::new(BIN)
        .args(["--host-proc=/nonexistent", "--raise-node=fs.file-max=1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/1/ns/net"));
    assert!(!Path::new("/nonexistent").exists());
}
