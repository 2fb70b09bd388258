//! What the kernel reports about sockets and the process, read from /proc:
//! `/proc/net/sockstat` (TCP sockets and their memory), `/proc/self/statm`
//! (resident memory) and the sysctls the capacity model depends on. Parsers
//! are pure and take the file's text.

use std::path::Path;

/// Page size assumed when `sysconf` is not consulted, in bytes: 4 KiB on
/// x86_64 and the default arm64 kernels. `tcp_mem` and `TCP mem` in sockstat
/// count pages of this size [source: kernel `Documentation/networking/ip-sysctl.rst`].
pub const PAGE_BYTES: u64 = 4096;

/// The sysctls read at start and exported as `c10m_kernel_sysctl`, with the
/// names of their space-separated fields. Units as the kernel reports them:
/// `tcp_mem` in pages, `tcp_rmem`/`tcp_wmem` in bytes, the rest counts.
/// Namespaced ones (`somaxconn`, `tcp_rmem`, `tcp_wmem`) are the values of
/// the server's network namespace, the others the node's: what the shard
/// runs under, which the operator compares with its plan (kernel drift).
pub const SYSCTLS: &[(&str, &[&str])] = &[
    ("net.core.somaxconn", &["value"]),
    ("net.ipv4.tcp_mem", &["min", "pressure", "max"]),
    ("net.ipv4.tcp_rmem", &["min", "default", "max"]),
    ("net.ipv4.tcp_wmem", &["min", "default", "max"]),
    ("fs.nr_open", &["value"]),
    ("fs.epoll.max_user_watches", &["value"]),
];

/// The TCP line of `/proc/net/sockstat`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TcpSockstat {
    /// Sockets in use (per network namespace).
    pub inuse: u64,
    /// Orphaned sockets (closed by the process, still in the kernel; global).
    pub orphan: u64,
    /// Sockets in TIME_WAIT (per network namespace).
    pub tw: u64,
    /// Allocated sockets (global).
    pub alloc: u64,
    /// Pages charged against `tcp_mem` (global).
    pub mem_pages: u64,
}

/// Parses `/proc/net/sockstat` text; `None` without a TCP line.
pub fn parse_sockstat(text: &str) -> Option<TcpSockstat> {
    let line = text.lines().find_map(|l| l.strip_prefix("TCP:"))?;
    let mut s = TcpSockstat::default();
    let mut it = line.split_whitespace();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        let v: u64 = v.parse().ok()?;
        match k {
            "inuse" => s.inuse = v,
            "orphan" => s.orphan = v,
            "tw" => s.tw = v,
            "alloc" => s.alloc = v,
            "mem" => s.mem_pages = v,
            _ => {}
        }
    }
    Some(s)
}

/// Resident set size in bytes from `/proc/self/statm` text (second field,
/// in pages).
pub fn parse_statm_rss(text: &str) -> Option<u64> {
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * PAGE_BYTES)
}

/// The fields of a sysctl value (`"4096\t131072\t6291456"` → three).
pub fn parse_sysctl(text: &str) -> Vec<i64> {
    text.split_whitespace()
        .map_while(|f| f.parse().ok())
        .collect()
}

/// Reads `/proc/net/sockstat`.
pub fn sockstat() -> Option<TcpSockstat> {
    parse_sockstat(&std::fs::read_to_string("/proc/net/sockstat").ok()?)
}

/// This process's resident memory, in bytes.
pub fn resident_bytes() -> Option<u64> {
    parse_statm_rss(&std::fs::read_to_string("/proc/self/statm").ok()?)
}

/// Reads every sysctl in [`SYSCTLS`] under `proc` (normally `/proc`):
/// `(name, field, value)` for each field found.
pub fn read_sysctls(proc: &Path) -> Vec<(&'static str, &'static str, i64)> {
    let mut out = Vec::new();
    for (name, fields) in SYSCTLS {
        let path = proc.join("sys").join(name.replace('.', "/"));
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        for (field, v) in fields.iter().zip(parse_sysctl(&text)) {
            out.push((*name, *field, v));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sockstat() {
        let text = "sockets: used 202\nTCP: inuse 177 orphan 3 tw 6 alloc 180 mem 267\n\
                    UDP: inuse 0 mem 0\n";
        assert_eq!(
            parse_sockstat(text),
            Some(TcpSockstat {
                inuse: 177,
                orphan: 3,
                tw: 6,
                alloc: 180,
                mem_pages: 267
            })
        );
        assert_eq!(parse_sockstat("UDP: inuse 0 mem 0\n"), None);
        assert_eq!(parse_sockstat("TCP: inuse x\n"), None);
    }

    #[test]
    fn parses_statm_and_sysctls() {
        assert_eq!(
            parse_statm_rss("5000 300 200 1 0 400 0\n"),
            Some(300 * 4096)
        );
        assert_eq!(parse_statm_rss(""), None);
        assert_eq!(
            parse_sysctl("4096\t131072\t33554432\n"),
            [4096, 131_072, 33_554_432]
        );
        assert_eq!(parse_sysctl("4096\n"), [4096]);
    }

    #[test]
    fn reads_the_live_kernel() {
        let s = sockstat().expect("/proc/net/sockstat");
        assert!(s.alloc >= s.orphan);
        assert!(resident_bytes().unwrap() > 0);
        let got = read_sysctls(Path::new("/proc"));
        let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn").unwrap();
        assert!(got.contains(&(
            "net.core.somaxconn",
            "value",
            somaxconn.trim().parse().unwrap()
        )));
        assert_eq!(got.iter().filter(|g| g.0 == "net.ipv4.tcp_mem").count(), 3);
        // Every sysctl the operator compares with its plan is read.
        for (name, fields) in SYSCTLS {
            for field in *fields {
                let path = Path::new("/proc/sys").join(name.replace('.', "/"));
                let want = parse_sysctl(&std::fs::read_to_string(&path).unwrap());
                let n = fields.iter().position(|f| f == field).unwrap();
                assert!(
                    got.contains(&(*name, *field, want[n])),
                    "{name} {field}: {got:?}"
                );
            }
        }
        assert!(
            got.iter()
                .any(|g| g.0 == "fs.epoll.max_user_watches" && g.2 > 0)
        );
    }
}
