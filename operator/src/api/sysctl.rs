//! The kernel settings a plan carries, typed: a name from the fixed set the
//! planner knows ([`Sysctl`]) and a numeric value ([`SysctlValue`]). In the
//! status they appear as a map of name → value string (`"65535"`,
//! `"min pressure max"` for `tcp_mem`, `"min default max"` for `tcp_rmem`), rendered from the numbers once by
//! their `Display`/`Serialize`; the CRD shape is a plain string map.

use std::collections::BTreeMap;
use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a sysctl takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Per network namespace: set inside the pod's own netns.
    Namespaced,
    /// Global to the node (or only writable from the host netns): only ever raised.
    Node,
}

/// A sysctl the planner may set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Sysctl {
    /// `net.core.somaxconn`: cap on every listen backlog (per netns).
    Somaxconn,
    /// `net.ipv4.tcp_max_syn_backlog`: half-open connection queue (per netns).
    TcpMaxSynBacklog,
    /// `net.ipv4.tcp_migrate_req`: migrate queued connections between
    /// SO_REUSEPORT listeners when one closes (per netns, kernel ≥ 5.14).
    TcpMigrateReq,
    /// `net.ipv4.tcp_rmem`: per-socket receive buffer bytes (min, default,
    /// max) (per netns; kubelet-safe).
    TcpRmem,
    /// `net.ipv4.tcp_wmem`: per-socket send buffer bytes (min, default,
    /// max) (per netns; kubelet-safe).
    TcpWmem,
    /// `net.ipv4.tcp_mem`: node-wide TCP buffer pages (min, pressure, max).
    TcpMem,
    /// `net.netfilter.nf_conntrack_max`: node-wide conntrack entries.
    NfConntrackMax,
    /// `fs.file-max`: node-wide open files.
    FileMax,
    /// `fs.nr_open`: the ceiling of any process's RLIMIT_NOFILE.
    NrOpen,
    /// `fs.epoll.max_user_watches`: epoll watches one uid may hold on the node.
    MaxUserWatches,
}

impl Sysctl {
    /// Every sysctl the planner knows, in the order of their names.
    pub const ALL: [Sysctl; 10] = [
        Sysctl::MaxUserWatches,
        Sysctl::FileMax,
        Sysctl::NrOpen,
        Sysctl::Somaxconn,
        Sysctl::TcpMaxSynBacklog,
        Sysctl::TcpMem,
        Sysctl::TcpMigrateReq,
        Sysctl::TcpRmem,
        Sysctl::TcpWmem,
        Sysctl::NfConntrackMax,
    ];

    /// The name as `sysctl(8)` and the kubelet spell it.
    pub fn name(self) -> &'static str {
        match self {
            Sysctl::Somaxconn => "net.core.somaxconn",
            Sysctl::TcpMaxSynBacklog => "net.ipv4.tcp_max_syn_backlog",
            Sysctl::TcpMigrateReq => "net.ipv4.tcp_migrate_req",
            Sysctl::TcpRmem => "net.ipv4.tcp_rmem",
            Sysctl::TcpWmem => "net.ipv4.tcp_wmem",
            Sysctl::TcpMem => "net.ipv4.tcp_mem",
            Sysctl::NfConntrackMax => "net.netfilter.nf_conntrack_max",
            Sysctl::FileMax => "fs.file-max",
            Sysctl::NrOpen => "fs.nr_open",
            Sysctl::MaxUserWatches => "fs.epoll.max_user_watches",
        }
    }

    /// The sysctl named `name`, if the planner knows it.
    pub fn from_name(name: &str) -> Option<Sysctl> {
        Sysctl::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Where it takes effect.
    pub fn scope(self) -> Scope {
        match self {
            Sysctl::Somaxconn
            | Sysctl::TcpMaxSynBacklog
            | Sysctl::TcpMigrateReq
            | Sysctl::TcpRmem
            | Sysctl::TcpWmem => Scope::Namespaced,
            Sysctl::TcpMem
            | Sysctl::NfConntrackMax
            | Sysctl::FileMax
            | Sysctl::NrOpen
            | Sysctl::MaxUserWatches => Scope::Node,
        }
    }
}

impl fmt::Display for Sysctl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Sysctl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Sysctl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Sysctl::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown sysctl {name:?}")))
    }
}

impl JsonSchema for Sysctl {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Sysctl".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string"})
    }
}

/// A sysctl's value: one number, or three (the page counts of `tcp_mem`,
/// the byte sizes of `tcp_rmem`/`tcp_wmem`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SysctlValue {
    /// A single integer (connections, files, descriptors, a flag).
    One(i64),
    /// `tcp_mem`: (min, pressure, max), in pages; `tcp_rmem`/`tcp_wmem`:
    /// (min, default, max), in bytes.
    Triple([i64; 3]),
}

impl SysctlValue {
    /// The value the limit is checked against: the number itself, or the
    /// middle component of three: the pressure threshold of `tcp_mem`
    /// (where the kernel starts to moderate buffers).
    pub fn limit(self) -> i64 {
        match self {
            SysctlValue::One(v) => v,
            SysctlValue::Triple([_, pressure, _]) => pressure,
        }
    }

    /// Components, as the kernel prints them.
    pub fn components(self) -> Vec<i64> {
        match self {
            SysctlValue::One(v) => vec![v],
            SysctlValue::Triple(p) => p.to_vec(),
        }
    }

    /// True when every component is ≥ the matching one of `default` and at
    /// least one is greater: the value only raises the default.
    pub fn raises(self, default: SysctlValue) -> bool {
        let (v, d) = (self.components(), default.components());
        v.len() == d.len() && v.iter().zip(&d).all(|(a, b)| a >= b) && v != d
    }
}

impl fmt::Display for SysctlValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SysctlValue::One(v) => write!(f, "{v}"),
            SysctlValue::Triple([a, b, c]) => write!(f, "{a} {b} {c}"),
        }
    }
}

impl std::str::FromStr for SysctlValue {
    type Err = String;
    /// Parses `"N"` or `"A B C"` (whitespace-separated integers).
    fn from_str(s: &str) -> Result<Self, String> {
        let parts = s
            .split_whitespace()
            .map(str::parse::<i64>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("sysctl value {s:?}: {e}"))?;
        match parts[..] {
            [v] => Ok(SysctlValue::One(v)),
            [a, b, c] => Ok(SysctlValue::Triple([a, b, c])),
            _ => Err(format!("sysctl value {s:?}: expected 1 or 3 integers")),
        }
    }
}

impl Serialize for SysctlValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SysctlValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for SysctlValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "SysctlValue".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string"})
    }
}

/// The sysctls of a plan: name → value, ordered by name.
pub type Sysctls = BTreeMap<Sysctl, SysctlValue>;

/// Reads a stored plan's sysctls, skipping entries this operator cannot
/// read (a sysctl another version plans, or one added by hand) instead of
/// failing the whole fleet. The entries it can read are what it compares
/// its next plan with, so a foreign entry causes no rewrite.
pub fn lenient_sysctls<'de, D: Deserializer<'de>>(d: D) -> Result<Sysctls, D::Error> {
    let entries = Option::<BTreeMap<String, serde_json::Value>>::deserialize(d)?;
    Ok(entries
        .into_iter()
        .flatten()
        .filter_map(|(name, value)| {
            Some((Sysctl::from_name(&name)?, value.as_str()?.parse().ok()?))
        })
        .collect())
}

/// [`lenient_sysctls`] for a list of names.
pub fn lenient_sysctl_names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Sysctl>, D::Error> {
    let names = Option::<Vec<serde_json::Value>>::deserialize(d)?;
    Ok(names
        .into_iter()
        .flatten()
        .filter_map(|n| Sysctl::from_name(n.as_str()?))
        .collect())
}

/// `sysctls`' names joined with ", " (for messages and tables).
pub fn join_names(sysctls: &[Sysctl]) -> String {
    sysctls
        .iter()
        .map(|s| s.name())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_sorted_in_all() {
        for s in Sysctl::ALL {
            assert_eq!(Sysctl::from_name(s.name()), Some(s));
        }
        let names: Vec<_> = Sysctl::ALL.iter().map(|s| s.name()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert_eq!(Sysctl::from_name("kernel.pid_max"), None);
    }

    #[test]
    fn scopes() {
        assert_eq!(Sysctl::Somaxconn.scope(), Scope::Namespaced);
        assert_eq!(Sysctl::TcpMem.scope(), Scope::Node);
    }

    #[test]
    fn values_render_once_and_parse_back() {
        let m: Sysctls = BTreeMap::from([
            (Sysctl::Somaxconn, SysctlValue::One(65535)),
            (Sysctl::TcpMem, SysctlValue::Triple([10, 20, 30])),
        ]);
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"net.core.somaxconn": "65535", "net.ipv4.tcp_mem": "10 20 30"})
        );
        let back: Sysctls = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
        assert!("1 2".parse::<SysctlValue>().is_err());
        assert!("x".parse::<SysctlValue>().is_err());
    }

    #[test]
    fn raise_compares_every_component() {
        let one = SysctlValue::One;
        assert!(one(65535).raises(one(4096)));
        assert!(!one(4096).raises(one(4096)));
        let pages = SysctlValue::Triple;
        assert!(pages([10, 30, 40]).raises(pages([10, 20, 30])));
        assert!(!pages([10, 30, 20]).raises(pages([10, 20, 30])));
        assert!(!one(1).raises(pages([1, 1, 1])));
    }
}
