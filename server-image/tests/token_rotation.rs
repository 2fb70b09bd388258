//! The admin token file is re-read as it changes (issue 13: a rotated
//! Secret takes effect without a restart).
//!
//! The token lives in a directory laid out the way the kubelet writes a
//! Secret volume: the data in a timestamped directory `..<ts>/`, a
//! `..data` symlink to it, and `token` a symlink to `..data/token`. An
//! update writes a new timestamped directory and renames a new symlink
//! over `..data` (one atomic `rename(2)`), then removes the old directory.
//! The server is started with `C10M_ADMIN_TOKEN_FILE=<dir>/token`, orders
//! are sent with the old and the new token, and the answers must follow
//! the swap within the server's reload interval (1 s), plus slack.

mod common;

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const OLD: &str = "0ld-t0ken-0123456789abcdef";
const NEW: &str = "n3w-t0ken-fedcba9876543210";

/// How long a swap may take to be seen: the server's reload interval
/// (1 s) plus slack for a loaded machine.
const SEEN_WITHIN: Duration = Duration::from_secs(5);

/// A directory laid out like a kubelet Secret volume holding key `token`.
struct SecretVolume {
    dir: PathBuf,
    generation: u32,
}

impl SecretVolume {
    /// A fresh volume holding `token`, files `mode`, group `gid` if given
    /// (what the kubelet does with `fsGroup`); the directories can be
    /// entered by anyone, as the kubelet's can.
    fn new(name: &str, token: &str, mode: u32, gid: Option<u32>) -> SecretVolume {
        let dir =
            std::env::temp_dir().join(format!("c10m-token-rotation-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut v = SecretVolume { dir, generation: 0 };
        v.write(Some(token), mode, gid);
        symlink("..data/token", v.token_path()).unwrap();
        v
    }

    fn token_path(&self) -> PathBuf {
        self.dir.join("token")
    }

    fn data_target(&self) -> Option<PathBuf> {
        std::fs::read_link(self.dir.join("..data"))
            .ok()
            .map(|t| self.dir.join(t))
    }

    /// Writes a new timestamped directory (with `token`, or without the key
    /// at all) and swaps `..data` to it atomically; removes the old one.
    fn write(&mut self, token: Option<&str>, mode: u32, gid: Option<u32>) {
        self.generation += 1;
        let ts = format!(
            "..2026_12_01_00_00_{:02}.{}",
            self.generation,
            1_000 + self.generation
        );
        let ts_dir = self.dir.join(&ts);
        std::fs::create_dir(&ts_dir).unwrap();
        std::fs::set_permissions(&ts_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        if let Some(token) = token {
            let file = ts_dir.join("token");
            std::fs::write(&file, token).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            if let Some(gid) = gid {
                std::os::unix::fs::chown(&file, None, Some(gid)).unwrap();
            }
        }
        let old = self.data_target();
        let tmp = self.dir.join("..data_tmp");
        symlink(&ts, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if let Some(old) = old {
            std::fs::remove_dir_all(old).unwrap();
        }
    }
}

impl Drop for SecretVolume {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts the server on the volume's token file, logging at info to `log`;
/// `env` is added (e.g. `C10M_RUN_AS`).
fn start(volume: &SecretVolume, env: &[(&str, &str)], log: &Path) -> Server {
    let token = volume.token_path();
    start_on_fresh_ports(Some(log), |ip, port, admin_port| {
        let mut cmd = Command::new(BIN);
        for (k, _) in std::env::vars() {
            if k.starts_with("C10M_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("C10M_BIND", ip.to_string())
            .env("C10M_PORT", port.to_string())
            .env("C10M_METRICS_PORT", admin_port.to_string())
            .env("C10M_WORKERS", "1")
            .env("C10M_DRAIN_ACCEPT_SECS", "0")
            .env("C10M_ADMIN_TOKEN_FILE", &token)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap());
        cmd
    })
}

/// `POST /shed?count=0` (an order that closes nothing) with `token`.
fn order(server: &Server, token: &str) -> u16 {
    server.post("/shed?count=0", Some(token)).0
}

/// Polls until `token` gets `status`; how long that took. Panics after
/// [`SEEN_WITHIN`].
fn until(server: &Server, token: &str, status: u16, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        let got = order(server, token);
        if got == status {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < SEEN_WITHIN,
            "{what}: still {got} after {:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn log_lines(log: &Path, needle: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Rotation through an atomic `..data` swap, a key that disappears and an
/// empty token: the old token stops working once the file holds the new
/// one, nothing is accepted while the file gives no token (503, logged
/// once), and the token works again once it is back. No restart.
#[test]
fn a_rotated_token_file_takes_effect_without_a_restart() {
    let scratch = std::env::temp_dir().join(format!("c10m-token-rotation-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let log = scratch.join("server.log");
    let mut volume = SecretVolume::new("plain", OLD, 0o440, None);
    let server = start(&volume, &[], &log);
    let pid = server.child.id();

    assert_eq!(order(&server, OLD), 202);
    assert_eq!(order(&server, NEW), 401);
    assert_eq!(server.post("/shed?count=0", None).0, 401);

    // Rotate: the kubelet's atomic swap.
    volume.write(Some(NEW), 0o440, None);
    let took = until(&server, OLD, 401, "the old token refused after the swap");
    eprintln!("old token refused {took:?} after the swap");
    assert_eq!(order(&server, NEW), 202, "the new token accepted");
    assert_eq!(order(&server, OLD), 401, "the old token stays refused");
    assert_eq!(log_lines(&log, "admin token changed"), 1);

    // The key disappears (the Secret lost it): fail closed with 503.
    volume.write(None, 0o440, None);
    until(&server, NEW, 503, "503 once the file is gone");
    for token in [NEW, OLD, ""] {
        assert_eq!(order(&server, token), 503, "{token:?}");
    }
    // An empty token is no token either.
    volume.write(Some("\n"), 0o440, None);
    std::thread::sleep(Duration::from_millis(1_100));
    for token in [NEW, OLD, ""] {
        assert_eq!(order(&server, token), 503, "empty file, {token:?}");
    }
    // Requests during the outage, a second apart, log it only once.
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(order(&server, NEW), 503);
    assert_eq!(log_lines(&log, "admin token file gives no token"), 1);

    // Back: the newest token works, the one before stays refused.
    const NEWER: &str = "n3wer-t0ken";
    volume.write(Some(NEWER), 0o440, None);
    until(&server, NEWER, 202, "the token back in the file accepted");
    assert_eq!(order(&server, NEW), 401);
    assert_eq!(log_lines(&log, "admin token file readable again"), 1);

    // Probes never needed the token, and it is the same process throughout.
    assert_eq!(server.http("GET", "/healthz", None).unwrap().0, 200);
    assert_eq!(server.child.id(), pid);
    let _ = std::fs::remove_dir_all(&scratch);
}

/// InitContainer mode on a real kubelet: the server starts as root and
/// drops to 65532:65532 before it reads the token; the Secret volume's
/// file is mode 0440, group 65532 (`defaultMode: 0440` with `fsGroup:
/// 65532`). After the drop the server reads it, and each rotated file the
/// same way. Needs root (to start as root and to chown); skipped otherwise.
#[test]
fn after_the_drop_a_group_readable_token_file_is_read_and_rotated() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipping: starting c10m-server as root needs root");
        return;
    }
    let scratch = std::env::temp_dir().join(format!("c10m-token-drop-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let log = scratch.join("server.log");
    let mut volume = SecretVolume::new("fsgroup", OLD, 0o440, Some(65532));
    let server = start(&volume, &[("C10M_RUN_AS", "65532:65532")], &log);
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["Uid:", "65532", "65532", "65532", "65532"]),
        "{status}"
    );
    assert_eq!(order(&server, OLD), 202);
    volume.write(Some(NEW), 0o440, Some(65532));
    until(
        &server,
        NEW,
        202,
        "the rotated token accepted after the drop",
    );
    assert_eq!(order(&server, OLD), 401);
    // A rotated file the serving uid cannot read (group root): refused
    // with 503, never accepted, and the server keeps serving.
    volume.write(Some(OLD), 0o440, None);
    until(&server, NEW, 503, "an unreadable file gives no token");
    assert_eq!(order(&server, OLD), 503);
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("Permission denied"), "{said}");
    assert_eq!(server.http("GET", "/healthz", None).unwrap().0, 200);
    let _ = std::fs::remove_dir_all(&scratch);
}
