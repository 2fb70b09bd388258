//! CPU pinning only with exclusive CPUs: a process pins its workers only
//! when its affinity mask holds exactly one CPU per worker (a cpuset it
//! owns); in a shared pool the kernel schedules them. Checked on the
//! workers' own affinity (`/proc/PID/task/TID/status`, Cpus_allowed_list)
//! and on `c10m_cpu_pinned`, with the mask set by `taskset`.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};

use common::*;

/// Starts `c10m-server --workers N` under `taskset -c CPUS`.
fn start_under_taskset(cpus: &str, workers: u16) -> Server {
    for _ in 0..5 {
        let ip = test_ip();
        let (port, admin) = (free_port(ip), free_port(ip));
        if port == admin {
            continue;
        }
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", cpus, BIN])
            .args(["--bind", &ip.to_string()])
            .args(["--port", &port.to_string()])
            .args(["--metrics-port", &admin.to_string()])
            .args(["--workers", &workers.to_string()]);
        for (k, _) in std::env::vars() {
            if k.starts_with("C10M_") {
                cmd.env_remove(k);
            }
        }
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("taskset");
        let mut server = Server {
            child,
            addr: SocketAddr::from((ip, port)),
            admin: SocketAddr::from((ip, admin)),
        };
        if server.wait_ready() {
            return server;
        }
    }
    panic!("c10m-server under taskset did not start");
}

/// Cpus_allowed_list of each worker thread (`c10m-worker-N`), by N.
fn worker_affinity(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let comm = comm.trim();
        if !comm.starts_with("c10m-worker-") {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        out.push((comm.to_string(), allowed));
    }
    out.sort();
    out
}

/// Whether this test process may run on CPUs 0 and 1.
fn have_cpus_0_and_1() -> bool {
    let mask = c10m_server::limits::allowed_cpus();
    let ok = mask.contains(&0) && mask.contains(&1);
    if !ok {
        eprintln!("skipping: CPUs 0 and 1 are not both allowed here ({mask:?})");
    }
    ok
}

#[test]
fn single_worker_shards_in_a_shared_pool_are_not_pinned() {
    // Fault 12: each single-worker process pinned its worker to the first
    // CPU of its mask, so every one of them ran on CPU 0.
    if !have_cpus_0_and_1() {
        return;
    }
    let a = start_under_taskset("0,1", 1);
    let b = start_under_taskset("0,1", 1);
    for s in [&a, &b] {
        let aff = worker_affinity(s.child.id());
        eprintln!("shared pool 0,1, 1 worker: {aff:?}");
        assert_eq!(aff, [("c10m-worker-0".to_string(), "0-1".to_string())]);
        assert_eq!(value(&s.metrics(), "c10m_cpu_pinned"), 0.0);
    }
}

#[test]
fn a_cpuset_with_one_cpu_per_worker_is_pinned() {
    if !have_cpus_0_and_1() {
        return;
    }
    let one = start_under_taskset("1", 1);
    let aff = worker_affinity(one.child.id());
    eprintln!("cpuset 1, 1 worker: {aff:?}");
    assert_eq!(aff, [("c10m-worker-0".to_string(), "1".to_string())]);
    assert_eq!(value(&one.metrics(), "c10m_cpu_pinned"), 1.0);

    let two = start_under_taskset("0,1", 2);
    let aff = worker_affinity(two.child.id());
    eprintln!("cpuset 0,1, 2 workers: {aff:?}");
    assert_eq!(
        aff,
        [
            ("c10m-worker-0".to_string(), "0".to_string()),
            ("c10m-worker-1".to_string(), "1".to_string()),
        ]
    );
    assert_eq!(value(&two.metrics(), "c10m_cpu_pinned"), 1.0);
}

#[test]
fn more_workers_than_cpus_are_not_pinned() {
    if !have_cpus_0_and_1() {
        return;
    }
    let s = start_under_taskset("1", 3);
    let aff = worker_affinity(s.child.id());
    assert_eq!(aff.len(), 3);
    for (_, allowed) in &aff {
        assert_eq!(allowed, "1", "{aff:?}");
    }
    assert_eq!(value(&s.metrics(), "c10m_cpu_pinned"), 0.0);
}
