//! `c10m-sysctl`, the init container that applies a fleet plan's kernel
//! settings: namespaced sysctls are written in the pod's own network
//! namespace; node-level ones are only ever raised (component-wise, never
//! lowered), in the host network namespace entered through the host's
//! `/proc/1/ns/net`.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// A `name=value` setting from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// Dotted sysctl name (`net.core.somaxconn`).
    pub name: String,
    /// Value as written to /proc/sys (space-separated for vectors like `tcp_mem`).
    pub value: String,
}

/// Parses `name=value`. Errors on a missing `=`, an empty part, or a name
/// that could escape /proc/sys (`..`, `/`).
pub fn parse_setting(s: &str) -> anyhow::Result<Setting> {
    let Some((name, value)) = s.split_once('=') else {
        bail!("{s:?}: expected name=value");
    };
    let (name, value) = (name.trim(), value.trim());
    if name.is_empty() || value.is_empty() {
        bail!("{s:?}: name and value must be non-empty");
    }
    if name.contains('/') || name.split('.').any(|p| p.is_empty() || p == "..") {
        bail!("{name:?}: not a sysctl name");
    }
    Ok(Setting {
        name: name.into(),
        value: value.into(),
    })
}

/// The file of sysctl `name` under `proc_sys` (normally `/proc/sys`).
pub fn sysctl_path(proc_sys: &Path, name: &str) -> PathBuf {
    proc_sys.join(name.replace('.', "/"))
}

/// The component-wise maximum of `current` and `wanted` when it differs from
/// `current` (a raise), `None` when `current` already meets `wanted`.
/// Errors when either is not whitespace-separated integers of equal length.
pub fn raise(current: &str, wanted: &str) -> anyhow::Result<Option<String>> {
    let parse = |s: &str| -> anyhow::Result<Vec<i64>> {
        s.split_whitespace()
            .map(|t| {
                t.parse::<i64>()
                    .with_context(|| format!("{t:?} is not an integer"))
            })
            .collect()
    };
    let (cur, want) = (parse(current)?, parse(wanted)?);
    if cur.len() != want.len() {
        bail!(
            "{wanted:?} has {} values, the kernel's {current:?} has {}",
            want.len(),
            cur.len()
        );
    }
    let merged: Vec<i64> = cur.iter().zip(&want).map(|(c, w)| *c.max(w)).collect();
    Ok((merged != cur).then(|| {
        merged
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }))
}

/// What happened to one setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Written as given (namespaced).
    Set,
    /// Raised from the old value to the new.
    Raised {
        /// The kernel's value before.
        from: String,
        /// The value written.
        to: String,
    },
    /// Left alone: the kernel's value already meets or exceeds the plan's.
    Kept {
        /// The kernel's value, kept.
        current: String,
    },
}

fn read(path: &Path) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("read {}", path.display()))?
        .trim()
        .to_string())
}

fn write(path: &Path, value: &str) -> anyhow::Result<()> {
    std::fs::write(path, format!("{value}\n"))
        .with_context(|| format!("write {value:?} to {}", path.display()))
}

/// Writes a namespaced setting.
pub fn set(proc_sys: &Path, s: &Setting) -> anyhow::Result<Applied> {
    write(&sysctl_path(proc_sys, &s.name), &s.value)?;
    Ok(Applied::Set)
}

/// Raises a node-level setting, never lowering any component.
pub fn raise_node(proc_sys: &Path, s: &Setting) -> anyhow::Result<Applied> {
    let path = sysctl_path(proc_sys, &s.name);
    let current = read(&path)?;
    match raise(&current, &s.value).with_context(|| s.name.clone())? {
        Some(to) => {
            write(&path, &to)?;
            Ok(Applied::Raised { from: current, to })
        }
        None => Ok(Applied::Kept { current }),
    }
}

/// Moves this thread into the network namespace of the host's PID 1, seen
/// through `host_proc` (the host's /proc mounted into the container).
pub fn enter_host_netns(host_proc: &Path) -> anyhow::Result<()> {
    let path = host_proc.join("1/ns/net");
    let f = File::open(&path).with_context(|| format!("open {}", path.display()))?;
    rustix::thread::move_into_link_name_space(
        f.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .with_context(|| format!("setns({})", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_refuse_bad_names() {
        assert_eq!(
            parse_setting("net.ipv4.tcp_mem=1 2 3").unwrap(),
            Setting {
                name: "net.ipv4.tcp_mem".into(),
                value: "1 2 3".into()
            }
        );
        assert!(parse_setting("net.core.somaxconn").is_err());
        assert!(parse_setting("=1").is_err());
        assert!(parse_setting("net..x=1").is_err());
        assert!(parse_setting("../etc/passwd=1").is_err());
        assert_eq!(
            sysctl_path(Path::new("/proc/sys"), "fs.file-max"),
            Path::new("/proc/sys/fs/file-max")
        );
    }

    #[test]
    fn raise_never_lowers() {
        assert_eq!(raise("4096", "65535").unwrap().as_deref(), Some("65535"));
        assert_eq!(raise("100000", "65535").unwrap(), None);
        assert_eq!(
            raise("10 20 30", "5 40 25").unwrap().as_deref(),
            Some("10 40 30")
        );
        assert_eq!(raise("10 20 30", "1 2 3").unwrap(), None);
        assert!(raise("1 2 3", "4").is_err());
        assert!(raise("1", "x").is_err());
    }
}
