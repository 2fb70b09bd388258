//! Dropping root once the limits are raised ([`c10m_wire::env::RUN_AS`]).
//!
//! Kubernetes sets no ambient capabilities (kubernetes#56374): a container
//! started as uid 65532 with `capabilities.add: [SYS_RESOURCE]` has empty
//! permitted and effective sets after `execve`, so it cannot raise its hard
//! RLIMIT_NOFILE. In the operator's InitContainer mode the server therefore
//! starts as uid 0 with only `SETUID`, `SETGID` (and `SYS_RESOURCE` where
//! the node can grant it) and `allowPrivilegeEscalation: false`, raises the
//! limit ([`crate::limits::raise_nofile`]) and then drops to
//! `C10M_RUN_AS=UID:GID` here, before it opens a socket or starts a thread.
//!
//! The drop ([`drop_to`]): supplementary groups cleared (containerd adds
//! the primary gid, 0 for root, as an additional gid), then real, effective
//! and saved gid, then uid, then `no_new_privs`. The kernel clears the
//! permitted, effective and ambient capability sets when the last of the
//! three uids leaves 0. The result is read back from `/proc/self/status`
//! and the server refuses to serve unless every uid and gid is the target's
//! and those three capability sets are empty. RLIMIT_NOFILE is a property
//! of the process, not of its credentials, so it survives the drop.
//!
//! The system calls come from `rustix::thread`: raw `setgroups`,
//! `setresgid` and `setresuid`, which on Linux change the calling thread
//! only (glibc's wrappers broadcast to every thread; these do not). They
//! are process-wide here because [`drop_to`] refuses to run unless
//! `/proc/self/status` counts one thread; `server::run` calls it before
//! any thread exists (logging, clap and signal registration start none).

use std::fmt;
use std::str::FromStr;

use anyhow::{Context, bail};
use rustix::process::{Gid, Resource, Uid, getrlimit};
use rustix::thread::{set_no_new_privs, set_thread_groups, set_thread_res_gid, set_thread_res_uid};

use c10m_wire::env::RUN_AS;

/// The unprivileged identity to serve as: `C10M_RUN_AS=UID:GID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// User id: not 0, not 4294967295.
    pub uid: u32,
    /// Group id: not 0, not 4294967295.
    pub gid: u32,
}

impl fmt::Display for RunAs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

/// One decimal id of `UID:GID`: ASCII digits only (no sign, no spaces),
/// not 0 (dropping to root is pointless; gid 0 is root's group) and not
/// 4294967295, which `setresuid(2)`/`setresgid(2)` read as "unchanged".
fn parse_id(what: &str, s: &str) -> Result<u32, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{RUN_AS} must be UID:GID in decimal digits (e.g. 65532:65532); {what} is {s:?}"
        ));
    }
    match s.parse::<u32>() {
        Ok(0) => Err(format!(
            "{RUN_AS} names the unprivileged identity to drop to; {what} 0 is root's and is refused"
        )),
        Ok(u32::MAX) => Err(format!(
            "{RUN_AS}: {what} 4294967295 is -1, which setres{}id reads as \"unchanged\"; refused",
            &what[..1]
        )),
        Ok(id) => Ok(id),
        Err(_) => Err(format!("{RUN_AS}: {what} {s} does not fit in 32 bits")),
    }
}

impl FromStr for RunAs {
    type Err = String;

    /// Parses `UID:GID`; errors name [`RUN_AS`].
    fn from_str(s: &str) -> Result<Self, String> {
        let Some((uid, gid)) = s.split_once(':') else {
            return Err(format!(
                "{RUN_AS} must be UID:GID (e.g. 65532:65532); {s:?} has no \":GID\""
            ));
        };
        Ok(RunAs {
            uid: parse_id("uid", uid)?,
            gid: parse_id("gid", gid)?,
        })
    }
}

/// The credentials and capability sets of the process, from
/// `/proc/self/status` (the main thread's, which is the thread that
/// drops).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Real, effective, saved and filesystem uid (`Uid:`).
    pub uid: [u32; 4],
    /// Real, effective, saved and filesystem gid (`Gid:`).
    pub gid: [u32; 4],
    /// Supplementary groups (`Groups:`).
    pub groups: Vec<u32>,
    /// Inheritable capabilities (`CapInh:`), a bitmask.
    pub cap_inh: u64,
    /// Permitted capabilities (`CapPrm:`).
    pub cap_prm: u64,
    /// Effective capabilities (`CapEff:`).
    pub cap_eff: u64,
    /// Bounding set (`CapBnd:`): what an `execve` could ever regain; it
    /// stays as the runtime set it (dropping from it needs `CAP_SETPCAP`),
    /// harmless with `no_new_privs` and no capabilities held.
    pub cap_bnd: u64,
    /// Ambient capabilities (`CapAmb:`).
    pub cap_amb: u64,
    /// `no_new_privs` (`NoNewPrivs:`): no `execve` can gain privileges.
    pub no_new_privs: bool,
    /// Threads in the process (`Threads:`).
    pub threads: u32,
}

impl Identity {
    /// Whether every uid and gid is `target`'s.
    pub fn is(&self, target: RunAs) -> bool {
        self.uid.iter().all(|&u| u == target.uid) && self.gid.iter().all(|&g| g == target.gid)
    }

    /// Whether the permitted, effective and ambient sets are all empty.
    pub fn holds_no_capabilities(&self) -> bool {
        self.cap_prm == 0 && self.cap_eff == 0 && self.cap_amb == 0
    }
}

/// Four ids as the log shows them: one number when all are equal, else
/// real/effective/saved/filesystem.
fn ids(v: &[u32; 4]) -> String {
    if v.iter().all(|&x| x == v[0]) {
        v[0].to_string()
    } else {
        format!("{}/{}/{}/{}", v[0], v[1], v[2], v[3])
    }
}

/// Parses `/proc/<pid>/status` text; the error names the missing or
/// malformed field.
pub fn parse_status(text: &str) -> Result<Identity, String> {
    let field = |name: &str| -> Result<&str, String> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .ok_or_else(|| format!("no {name}: line in /proc/self/status"))
    };
    let numbers = |name: &str| -> Result<Vec<u32>, String> {
        field(name)?
            .split_whitespace()
            .map(|n| n.parse().map_err(|_| format!("bad {name}: value {n:?}")))
            .collect()
    };
    let four = |name: &str| -> Result<[u32; 4], String> {
        numbers(name)?
            .try_into()
            .map_err(|v| format!("{name}: has {v:?}, not four ids"))
    };
    let mask = |name: &str| -> Result<u64, String> {
        let v = field(name)?;
        u64::from_str_radix(v, 16).map_err(|_| format!("bad {name}: value {v:?}"))
    };
    Ok(Identity {
        uid: four("Uid")?,
        gid: four("Gid")?,
        groups: numbers("Groups")?,
        cap_inh: mask("CapInh")?,
        cap_prm: mask("CapPrm")?,
        cap_eff: mask("CapEff")?,
        cap_bnd: mask("CapBnd")?,
        cap_amb: mask("CapAmb")?,
        no_new_privs: field("NoNewPrivs")? == "1",
        threads: numbers("Threads")?
            .first()
            .copied()
            .ok_or("empty Threads: line")?,
    })
}

/// Reads `/proc/self/status` ([`parse_status`]).
pub fn read_identity() -> anyhow::Result<Identity> {
    let text = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    parse_status(&text).map_err(anyhow::Error::msg)
}

/// What [`drop_to`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Groups, gid and uid were switched from this uid:gid (effective ids).
    Dropped {
        /// Effective uid before the drop (0).
        uid: u32,
        /// Effective gid before the drop.
        gid: u32,
    },
    /// The process already ran as the target: nothing to do.
    AlreadyTarget,
}

/// Drops the process to `target` and checks the result; see the module
/// docs for the order. Must run while the process has one thread (checked).
///
/// Errors, each meaning "do not serve": `/proc/self/status` unreadable;
/// more than one thread; running as a non-root uid other than the target
/// (it cannot switch); a refused system call (the container lacks
/// `CAP_SETUID`/`CAP_SETGID`); afterwards an id that is not the target's
/// or a capability still permitted, effective or ambient.
pub fn drop_to(target: RunAs) -> anyhow::Result<(Change, Identity)> {
    let before = read_identity()
        .with_context(|| format!("{RUN_AS}={target}: cannot check the process's identity"))?;
    if before.is(target) {
        check(target, &before, false)?;
        return Ok((Change::AlreadyTarget, before));
    }
    if before.uid[1] != 0 {
        bail!(
            "{RUN_AS}={target}, but the server runs as uid {} gid {}, not root: it cannot \
             switch. Start it as root with CAP_SETUID and CAP_SETGID (it drops to {target} \
             after raising RLIMIT_NOFILE), or as {target}",
            ids(&before.uid),
            ids(&before.gid),
        );
    }
    if before.threads != 1 {
        bail!(
            "{RUN_AS}={target}: the process has {} threads; the drop changes only the calling \
             thread's credentials, so it must run before any thread starts",
            before.threads
        );
    }
    let (uid, gid) = (Uid::from_raw(target.uid), Gid::from_raw(target.gid));
    set_thread_groups(&[]).with_context(|| {
        format!("{RUN_AS}={target}: setgroups([]) refused (the container needs CAP_SETGID)")
    })?;
    set_thread_res_gid(gid, gid, gid).with_context(|| {
        format!(
            "{RUN_AS}={target}: setresgid({0},{0},{0}) refused (the container needs CAP_SETGID)",
            target.gid
        )
    })?;
    set_thread_res_uid(uid, uid, uid).with_context(|| {
        format!(
            "{RUN_AS}={target}: setresuid({0},{0},{0}) refused (the container needs CAP_SETUID)",
            target.uid
        )
    })?;
    // No execve can regain what the bounding set still lists (the server
    // never execs; this makes it so even without allowPrivilegeEscalation:
    // false). Needs no privilege.
    set_no_new_privs(true).with_context(|| format!("{RUN_AS}={target}: setting no_new_privs"))?;
    let after = read_identity().with_context(|| {
        format!("{RUN_AS}={target}: cannot check the process's identity after the drop")
    })?;
    check(target, &after, true)?;
    Ok((
        Change::Dropped {
            uid: before.uid[1],
            gid: before.gid[1],
        },
        after,
    ))
}

/// Refuses an identity that is not `target`'s or still holds capabilities;
/// after a drop the supplementary groups must be empty too. Already
/// running as the target, supplementary groups cannot be cleared (that
/// needs `CAP_SETGID`); gid 0 among them is worth a warning.
fn check(target: RunAs, id: &Identity, dropped: bool) -> anyhow::Result<()> {
    if !id.is(target) || !id.holds_no_capabilities() || (dropped && !id.groups.is_empty()) {
        bail!(
            "{RUN_AS}={target}: refusing to serve as uid {} gid {} groups {:?} with \
             CapPrm={:#x} CapEff={:#x} CapAmb={:#x} (want uid and gid {target}{}, no \
             permitted, effective or ambient capabilities)",
            ids(&id.uid),
            ids(&id.gid),
            id.groups,
            id.cap_prm,
            id.cap_eff,
            id.cap_amb,
            if dropped { ", no groups" } else { "" },
        );
    }
    if id.groups.contains(&0) {
        tracing::warn!(
            groups = ?id.groups,
            "supplementary group 0 (root's) is held and cannot be cleared without CAP_SETGID; \
             set runAsGroup, or start as root and let {RUN_AS} drop it"
        );
    }
    Ok(())
}

/// Applies `run_as` (the parsed [`RUN_AS`], if set) and logs the identity
/// the server serves as, with the RLIMIT_NOFILE in force after the drop.
/// Without `run_as` nothing changes; running as root then is a warning.
/// Returns the identity, if `/proc/self/status` could be read.
pub fn apply(run_as: Option<RunAs>) -> anyhow::Result<Option<Identity>> {
    let (change, identity) = match run_as {
        Some(target) => {
            let (change, id) = drop_to(target)?;
            (Some(change), Some(id))
        }
        None => match read_identity() {
            Ok(id) => (None, Some(id)),
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "cannot read the process's identity"
                );
                (None, None)
            }
        },
    };
    let change = match change {
        Some(Change::Dropped { uid, gid }) => format!("dropped from {uid}:{gid}"),
        Some(Change::AlreadyTarget) => "none, already the target".to_string(),
        None => "none".to_string(),
    };
    let nofile = getrlimit(Resource::Nofile);
    let limit = |v: Option<u64>| v.map_or("unlimited".to_string(), |n| n.to_string());
    if let Some(id) = &identity {
        tracing::info!(
            uid = %ids(&id.uid),
            gid = %ids(&id.gid),
            groups = ?id.groups,
            cap_eff = %format!("{:#x}", id.cap_eff),
            cap_prm = %format!("{:#x}", id.cap_prm),
            cap_amb = %format!("{:#x}", id.cap_amb),
            cap_inh = %format!("{:#x}", id.cap_inh),
            cap_bnd = %format!("{:#x}", id.cap_bnd),
            no_new_privs = id.no_new_privs,
            nofile_soft = %limit(nofile.current),
            nofile_hard = %limit(nofile.maximum),
            run_as = %run_as.map_or("unset".to_string(), |r| r.to_string()),
            change,
            "process identity"
        );
        if run_as.is_none() && id.uid[1] == 0 {
            tracing::warn!(
                "serving as root: set {RUN_AS}=UID:GID to drop to an unprivileged identity \
                 after raising RLIMIT_NOFILE"
            );
        }
    }
    Ok(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_uid_gid() {
        assert_eq!(
            "65532:65532".parse::<RunAs>(),
            Ok(RunAs {
                uid: 65532,
                gid: 65532
            })
        );
        assert_eq!(
            "1:4294967294".parse::<RunAs>(),
            Ok(RunAs {
                uid: 1,
                gid: 4_294_967_294
            })
        );
        assert_eq!(
            RunAs {
                uid: 1000,
                gid: 2000
            }
            .to_string(),
            "1000:2000"
        );
    }

    #[test]
    fn rejects_what_is_not_a_non_root_uid_gid() {
        for bad in [
            "",
            "65532",
            "65532:",
            ":65532",
            "0:0",
            "0:65532",
            "65532:0",
            "nobody:nogroup",
            "65532:65532:1",
            " 65532:65532",
            "65532:65532\n",
            "+65532:65532",
            "-1:65532",
            "4294967295:65532",
            "65532:4294967295",
            "4294967296:1",
            "0x10:1",
        ] {
            let e = bad.parse::<RunAs>().unwrap_err();
            assert!(e.contains(RUN_AS), "{bad:?}: {e}");
        }
        let e = "0:0".parse::<RunAs>().unwrap_err();
        assert!(e.contains("uid 0"), "{e}");
        let e = "65532:0".parse::<RunAs>().unwrap_err();
        assert!(e.contains("gid 0"), "{e}");
        let e = "65532".parse::<RunAs>().unwrap_err();
        assert!(e.contains(":GID"), "{e}");
        let e = "4294967295:1".parse::<RunAs>().unwrap_err();
        assert!(e.contains("setresuid"), "{e}");
    }

    const STATUS: &str = "Name:\tc10m-server\nUmask:\t0022\nState:\tS (sleeping)\n\
        Uid:\t65532\t65532\t65532\t65532\nGid:\t65532\t65532\t65532\t65532\n\
        FDSize:\t64\nGroups:\t \nNStgid:\t1\nThreads:\t1\n\
        CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
        CapEff:\t0000000000000000\nCapBnd:\t00000000010000c0\n\
        CapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n";

    #[test]
    fn parses_proc_status() {
        let id = parse_status(STATUS).unwrap();
        assert_eq!(id.uid, [65532; 4]);
        assert_eq!(id.gid, [65532; 4]);
        assert!(id.groups.is_empty());
        assert_eq!(id.cap_bnd, 0x0100_00c0, "SETGID, SETUID, SYS_RESOURCE");
        assert_eq!(
            (id.cap_inh, id.cap_prm, id.cap_eff, id.cap_amb),
            (0, 0, 0, 0)
        );
        assert!(id.no_new_privs);
        assert_eq!(id.threads, 1);
        let target = RunAs {
            uid: 65532,
            gid: 65532,
        };
        assert!(id.is(target) && id.holds_no_capabilities());
        assert!(check(target, &id, true).is_ok());

        // The measured pod fault: runAsUser without runAsGroup gives gid 0.
        let root_group = STATUS
            .replace("Gid:\t65532\t65532\t65532\t65532", "Gid:\t0\t0\t0\t0")
            .replace("Groups:\t ", "Groups:\t0 ")
            .replace("Threads:\t1", "Threads:\t3");
        let id = parse_status(&root_group).unwrap();
        assert_eq!(
            (id.gid, id.groups.clone(), id.threads),
            ([0; 4], vec![0], 3)
        );
        assert!(!id.is(target));
        let e = check(target, &id, false).unwrap_err().to_string();
        assert!(e.contains("gid 0") && e.contains(RUN_AS), "{e}");

        // A capability left anywhere but the bounding set is refused.
        for set in ["CapPrm", "CapEff", "CapAmb"] {
            let text = STATUS.replace(
                &format!("{set}:\t0000000000000000"),
                &format!("{set}:\t0000000001000000"),
            );
            let id = parse_status(&text).unwrap();
            assert!(!id.holds_no_capabilities(), "{set}");
            let e = check(target, &id, true).unwrap_err().to_string();
            assert!(e.contains("0x1000000"), "{set}: {e}");
        }
        // After a drop a supplementary group left behind is refused.
        let id = parse_status(&STATUS.replace("Groups:\t ", "Groups:\t0 ")).unwrap();
        assert!(check(target, &id, true).is_err());
        assert!(
            check(target, &id, false).is_ok(),
            "cannot be cleared: warn only"
        );
    }

    #[test]
    fn malformed_proc_status_names_the_field() {
        let e = parse_status(&STATUS.replace("CapAmb", "CapXyz")).unwrap_err();
        assert!(e.contains("CapAmb"), "{e}");
        let e = parse_status(&STATUS.replace("Uid:\t65532\t", "Uid:\t")).unwrap_err();
        assert!(e.contains("Uid"), "{e}");
    }

    #[test]
    fn own_status_parses() {
        let id = read_identity().unwrap();
        assert!(id.threads >= 1);
        assert_eq!(id.uid[1], rustix::process::geteuid().as_raw());
        assert_eq!(id.gid[1], rustix::process::getegid().as_raw());
    }

    #[test]
    fn refuses_to_drop_with_more_than_one_thread() {
        // A second thread is alive for the whole call, so drop_to must stop
        // before any set*id (as root: the thread check; otherwise: it
        // cannot switch). Either way this test process keeps its ids.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || rx.recv());
        let before = read_identity().unwrap();
        assert!(before.threads >= 2);
        let e = drop_to(RunAs {
            uid: 65532,
            gid: 65532,
        })
        .unwrap_err()
        .to_string();
        if before.uid[1] == 0 {
            assert!(e.contains("threads") && e.contains(RUN_AS), "{e}");
        } else {
            assert!(e.contains("cannot switch"), "{e}");
        }
        let after = read_identity().unwrap();
        assert_eq!((after.uid, after.gid), (before.uid, before.gid));
        assert_eq!(after.groups, before.groups);
        drop(tx);
        let _ = other.join();
    }

    #[test]
    fn shows_ids_compactly() {
        assert_eq!(ids(&[7; 4]), "7");
        assert_eq!(ids(&[0, 65532, 0, 65532]), "0/65532/0/65532");
    }
}
