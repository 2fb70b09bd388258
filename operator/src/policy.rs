//! The cluster admin's policy: what the operator renders for a fleet,
//! whoever wrote the fleet (pure: types, defaults, YAML parsing, checks).
//!
//! A fleet author has namespaced rights; the operator acts with more (it
//! creates privileged pods and raises node-wide kernel limits). Everything
//! that reaches past the fleet's namespace is the admin's to decide here,
//! never the fleet's: the privileged init container's image, which
//! namespaces may run it at all, which taints a fleet may tolerate and which
//! node labels it may select on, how long a departing shard may hold a
//! node, how far node-level sysctls may go, which Prometheus series its
//! queries may read beyond its own namespace and fleet, and whether a fleet
//! may claim its connections bypass conntrack.
//!
//! Loaded once by `c10m-operator run --policy-file` (the chart renders it
//! from `values.policy` into a ConfigMap); without a file the defaults below
//! hold. Why operator configuration rather than a cluster-scoped resource:
//! `docs/adr/0007-admin-policy-as-operator-configuration.md`. A leaf: it
//! imports no other module of the operator.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use k8s_openapi::api::core::v1::Toleration;
use serde::{Deserialize, Serialize};

/// Image of the privileged init container by default: the bundled server
/// image, which carries `c10m-sysctl` (the same as
/// `crate::api::DEFAULT_SERVER_IMAGE`; a test keeps them equal).
pub const DEFAULT_SYSCTL_IMAGE: &str = "c10m/server:0.1.0";

/// The default [`Policy::calibration_probe_image`]: the loadgen image
/// `make images` builds (tools/images.sh, the workspace's version).
pub const DEFAULT_CALIBRATION_PROBE_IMAGE: &str = "c10m/loadgen:0.1.0";

/// The taints Kubernetes puts on control-plane nodes: reserved by default,
/// so no fleet tolerates its way onto them.
pub const CONTROL_PLANE_TAINTS: [&str; 2] = [
    "node-role.kubernetes.io/control-plane",
    "node-role.kubernetes.io/master",
];

/// In a namespace list, every namespace.
pub const ALL_NAMESPACES: &str = "*";

/// In `reservedNodeLabels`, every node label key (no label key contains `*`).
pub const EVERY_LABEL: &str = "*";

/// As an `allowedNodeSelectors` value, every value (no label value contains `*`).
pub const ANY_VALUE: &str = "*";

/// Labels the operator itself confines every tenant query to; a policy's
/// `queryMatchers` cannot set them.
pub const CONFINED_LABELS: [&str; 2] = ["namespace", "fleet"];

/// Longest `terminationGracePeriodSeconds` a fleet gets by default: an hour
/// (chosen: a node drain or a rollout waits at most this long per shard).
pub const DEFAULT_MAX_TERMINATION_GRACE_SECONDS: i64 = 3600;

/// Shortest bound a policy may set on the grace period: a shard needs its
/// accept window and slack (25 s) even with nothing to drain.
pub const MIN_TERMINATION_GRACE_SECONDS: i64 = 30;

/// Default ceiling of `fs.nr_open`: 2^25 = 33,554,432 descriptors per
/// process (chosen: a shard that large holds ~150 GB of sockets; the
/// kernel's own maximum is 1,073,741,816).
pub const DEFAULT_NR_OPEN_CEILING: i64 = 1 << 25;

/// Default ceiling of `fs.file-max`: 2^27 = 134,217,728 open files on a
/// node (chosen: ~530 GB of socket memory at 3,965 B each).
pub const DEFAULT_FILE_MAX_CEILING: i64 = 1 << 27;

/// Default ceiling of every component of `net.ipv4.tcp_mem`: 2^24 pages =
/// 64 GiB of TCP buffers on a node (chosen).
pub const DEFAULT_TCP_MEM_CEILING_PAGES: i64 = 1 << 24;

/// Default ceiling of `net.netfilter.nf_conntrack_max`: 2^26 = 67,108,864
/// entries (chosen: ~17 GB of conntrack slab at 256 B each).
pub const DEFAULT_NF_CONNTRACK_MAX_CEILING: i64 = 1 << 26;

/// Default ceiling of `fs.epoll.max_user_watches`: 2^27 = 134,217,728
/// watches per uid on a node (chosen: one per file of the `fs.file-max`
/// ceiling; ~25 GB of epoll items at 184 B each).
pub const DEFAULT_MAX_USER_WATCHES_CEILING: i64 = 1 << 27;

/// The admin's policy. Every field has a default; a policy file sets only
/// what it changes, and an unknown field is an error (a typo must not
/// silently leave a default in force).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Policy {
    /// Image of the privileged `c10m-sysctl` init container (pin it by
    /// digest). Fleets cannot choose it.
    pub sysctl_image: String,
    /// Image of the calibration probe (`c10m-calibrate-probe`), which runs
    /// with `hostPID` and the node's cgroups beside a calibrated shard
    /// (`spec.backend.calibrate`); pin it by digest. Fleets cannot choose it.
    pub calibration_probe_image: String,
    /// Namespaces whose fleets may use `sysctls.mode: InitContainer` (a
    /// privileged container with the host's `/proc`); `*` is every namespace.
    pub init_container_namespaces: Vec<String>,
    /// Taint keys a fleet may not tolerate (whatever the effect or value,
    /// and including a key-less `operator: Exists`, which tolerates every
    /// taint) unless [`Policy::allowed_tolerations`] lists the toleration.
    pub reserved_taints: Vec<String>,
    /// Tolerations of reserved taints the admin allows, exactly as listed
    /// (key, operator, value, effect), in the listed namespaces.
    pub allowed_tolerations: Vec<AllowedToleration>,
    /// Node label keys a fleet's `placement.nodeSelector` may not select
    /// on unless [`Policy::allowed_node_selectors`] lists the key and value
    /// for its namespace; `*` reserves every key. Default none: the node
    /// selector is the tenant's.
    pub reserved_node_labels: Vec<String>,
    /// Node selector entries on reserved labels the admin allows: key and
    /// value (`*`: any value), in the listed namespaces.
    pub allowed_node_selectors: Vec<AllowedNodeSelector>,
    /// Longest `terminationGracePeriodSeconds` a shard gets; a drain that
    /// needs longer is cut, and the fleet says so.
    pub max_termination_grace_period_seconds: i64,
    /// Highest values the plan may raise node-level sysctls to.
    pub sysctl_ceilings: SysctlCeilings,
    /// Label matchers every `spec.metrics` query of the listed namespaces'
    /// fleets is confined to, beside `namespace` and `fleet` (which hold
    /// for every fleet). Default none.
    pub query_matchers: Vec<QueryMatchers>,
    /// Whether connections to fleets on the cluster's nodes pass through
    /// conntrack (kube-proxy's Service NAT). `true` (the default): every
    /// plan in the cluster counts conntrack's bytes and table, whatever
    /// `spec.node.conntrack` says. `false` (nodes that track no connections,
    /// e.g. a kube-proxy replacement without netfilter): a fleet's
    /// `spec.node.conntrack: false` is used. Offline plans take
    /// `spec.node.conntrack` as given.
    pub conntrack: bool,
}

/// Ceilings of the node-level sysctls a plan raises. A node already above
/// one keeps its value (raises never lower anything); the plan only never
/// asks for more, and is sized so that its shards fit under them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SysctlCeilings {
    /// `fs.nr_open`: descriptors one process may open.
    #[serde(rename = "fs.nr_open")]
    pub nr_open: i64,
    /// `fs.file-max`: open files on the node.
    #[serde(rename = "fs.file-max")]
    pub file_max: i64,
    /// `net.ipv4.tcp_mem`: every component (min, pressure, max), in pages.
    #[serde(rename = "net.ipv4.tcp_mem")]
    pub tcp_mem_pages: i64,
    /// `net.netfilter.nf_conntrack_max`: tracked connections on the node.
    #[serde(rename = "net.netfilter.nf_conntrack_max")]
    pub nf_conntrack_max: i64,
    /// `fs.epoll.max_user_watches`: epoll watches of one uid on the node.
    #[serde(rename = "fs.epoll.max_user_watches")]
    pub max_user_watches: i64,
}

impl Default for SysctlCeilings {
    fn default() -> Self {
        SysctlCeilings {
            nr_open: DEFAULT_NR_OPEN_CEILING,
            file_max: DEFAULT_FILE_MAX_CEILING,
            tcp_mem_pages: DEFAULT_TCP_MEM_CEILING_PAGES,
            nf_conntrack_max: DEFAULT_NF_CONNTRACK_MAX_CEILING,
            max_user_watches: DEFAULT_MAX_USER_WATCHES_CEILING,
        }
    }
}

/// A toleration of a reserved taint the admin allows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedToleration {
    /// The toleration's key (absent: a key-less `Exists`, every taint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `Equal` (the default) or `Exists`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    /// The value, for `Equal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute` (absent: every effect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
    /// Namespaces whose fleets may use it; `*` (the default) is every namespace.
    #[serde(default = "every_namespace")]
    pub namespaces: Vec<String>,
}

/// A node selector entry on a reserved label the admin allows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedNodeSelector {
    /// The node label key, exactly.
    pub key: String,
    /// The value, exactly, or `*` for any value.
    pub value: String,
    /// Namespaces whose fleets may use it; `*` (the default) is every namespace.
    #[serde(default = "every_namespace")]
    pub namespaces: Vec<String>,
}

/// Label matchers (label = value) the listed namespaces' queries are
/// confined to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QueryMatchers {
    /// Namespaces whose fleets' queries get them; `*` (the default) is every namespace.
    #[serde(default = "every_namespace")]
    pub namespaces: Vec<String>,
    /// Label name → the value every selector must match exactly.
    pub matchers: BTreeMap<String, String>,
}

fn every_namespace() -> Vec<String> {
    vec![ALL_NAMESPACES.to_string()]
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            sysctl_image: DEFAULT_SYSCTL_IMAGE.to_string(),
            calibration_probe_image: DEFAULT_CALIBRATION_PROBE_IMAGE.to_string(),
            init_container_namespaces: every_namespace(),
            reserved_taints: CONTROL_PLANE_TAINTS.map(String::from).to_vec(),
            allowed_tolerations: Vec::new(),
            reserved_node_labels: Vec::new(),
            allowed_node_selectors: Vec::new(),
            max_termination_grace_period_seconds: DEFAULT_MAX_TERMINATION_GRACE_SECONDS,
            sysctl_ceilings: SysctlCeilings::default(),
            query_matchers: Vec::new(),
            conntrack: true,
        }
    }
}

/// Why a policy cannot be used; names the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(String);

/// Why a fleet is refused by the policy. Each message names the spec field
/// and says what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A toleration reaches a reserved taint and is not allowed.
    Toleration {
        /// Its index in `spec.placement.tolerations`.
        index: usize,
        /// The toleration, as JSON.
        toleration: String,
        /// The reserved taint it tolerates.
        taint: String,
    },
    /// A node selector entry on a reserved node label, not allowed.
    NodeSelector {
        /// The label key.
        key: String,
        /// The value the fleet selects.
        value: String,
    },
    /// `sysctls.mode: InitContainer` in a namespace the policy does not list.
    InitContainer {
        /// The fleet's namespace.
        namespace: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Toleration {
                index,
                toleration,
                taint,
            } => write!(
                f,
                "spec.placement.tolerations[{index}] {toleration} tolerates the taint {taint}, which the operator's policy reserves (reservedTaints); remove it, or ask a cluster admin to allow this toleration (policy allowedTolerations)"
            ),
            Refusal::NodeSelector { key, value } => write!(
                f,
                "spec.placement.nodeSelector[{key:?}] = {value:?} selects on the node label {key}, which the operator's policy reserves (reservedNodeLabels); remove it, or ask a cluster admin to allow this selector (policy allowedNodeSelectors)"
            ),
            Refusal::InitContainer { namespace } => write!(
                f,
                "spec.sysctls.mode: InitContainer (a privileged init container) is not allowed in namespace {namespace} by the operator's policy (initContainerNamespaces); set spec.sysctls.mode: PodSecurityContext (kubelet-safe sysctls in the pod, no privileged container) or None, or ask a cluster admin to allow the namespace"
            ),
        }
    }
}

fn lists(namespaces: &[String], namespace: &str) -> bool {
    namespaces
        .iter()
        .any(|n| n == ALL_NAMESPACES || n == namespace)
}

/// Two namespace lists name a namespace in common (`*` names them all).
fn overlap(a: &[String], b: &[String]) -> bool {
    a.iter().any(|n| n == ALL_NAMESPACES || lists(b, n))
}

/// A Prometheus label name (`[a-zA-Z_][a-zA-Z0-9_]*`).
fn is_prometheus_label(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Checks a namespace list; errors name `field`.
fn check_namespaces(field: &str, namespaces: &[String]) -> Result<(), PolicyError> {
    match namespaces
        .iter()
        .find(|ns| *ns != ALL_NAMESPACES && !is_label(ns))
    {
        Some(ns) => Err(PolicyError(format!(
            "{field}: {ns:?} is neither a namespace name nor \"*\""
        ))),
        None => Ok(()),
    }
}

/// A DNS-1123 label (a namespace name).
fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

const OPERATORS: [&str; 2] = ["Equal", "Exists"];
const EFFECTS: [&str; 3] = ["NoSchedule", "PreferNoSchedule", "NoExecute"];

impl Policy {
    /// Parses a policy file's YAML (an empty document is the defaults) and
    /// checks it ([`Policy::validate`]).
    pub fn from_yaml(text: &str) -> Result<Policy, PolicyError> {
        let policy = if text.trim().is_empty() {
            Policy::default()
        } else {
            serde_yaml::from_str::<Option<Policy>>(text)
                .map_err(|e| PolicyError(format!("policy: {e}")))?
                .unwrap_or_default()
        };
        policy.validate()?;
        Ok(policy)
    }

    /// Reads and parses the policy file at `path`; `None` is the defaults.
    pub fn load(path: Option<&Path>) -> Result<Policy, PolicyError> {
        let Some(path) = path else {
            return Ok(Policy::default());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| PolicyError(format!("cannot read policy file {}: {e}", path.display())))?;
        Policy::from_yaml(&text).map_err(|e| PolicyError(format!("{}: {e}", path.display())))
    }

    /// Checks what the types cannot. Errors name the field.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let bad = |m: String| Err(PolicyError(m));
        for (field, image) in [
            ("sysctlImage", &self.sysctl_image),
            ("calibrationProbeImage", &self.calibration_probe_image),
        ] {
            if image.is_empty() || image.len() > 512 || image.chars().any(char::is_whitespace) {
                return bad(format!(
                    "policy.{field} must be an image reference (1-512 characters, no spaces), got {image:?}"
                ));
            }
        }
        for ns in &self.init_container_namespaces {
            if ns != ALL_NAMESPACES && !is_label(ns) {
                return bad(format!(
                    "policy.initContainerNamespaces: {ns:?} is neither a namespace name nor \"*\""
                ));
            }
        }
        for taint in &self.reserved_taints {
            if taint.is_empty() || taint.len() > 317 {
                return bad(format!(
                    "policy.reservedTaints: {taint:?} is not a taint key"
                ));
            }
        }
        for (i, a) in self.allowed_tolerations.iter().enumerate() {
            let field = format!("policy.allowedTolerations[{i}]");
            if let Some(op) = &a.operator
                && !OPERATORS.contains(&op.as_str())
            {
                return bad(format!(
                    "{field}.operator must be Equal or Exists, got {op:?}"
                ));
            }
            if let Some(effect) = &a.effect
                && !EFFECTS.contains(&effect.as_str())
            {
                return bad(format!(
                    "{field}.effect must be NoSchedule, PreferNoSchedule or NoExecute, got {effect:?}"
                ));
            }
            let exists = a.operator.as_deref() == Some("Exists");
            if exists && a.value.as_deref().is_some_and(|v| !v.is_empty()) {
                return bad(format!("{field}.value must be empty with operator Exists"));
            }
            if !exists && a.key.as_deref().unwrap_or_default().is_empty() {
                return bad(format!("{field}.key is required unless operator is Exists"));
            }
            for ns in &a.namespaces {
                if ns != ALL_NAMESPACES && !is_label(ns) {
                    return bad(format!(
                        "{field}.namespaces: {ns:?} is neither a namespace name nor \"*\""
                    ));
                }
            }
        }
        for key in &self.reserved_node_labels {
            if key.is_empty() || key.len() > 317 || key.chars().any(char::is_whitespace) {
                return bad(format!(
                    "policy.reservedNodeLabels: {key:?} is neither a node label key nor \"*\""
                ));
            }
        }
        for (i, a) in self.allowed_node_selectors.iter().enumerate() {
            let field = format!("policy.allowedNodeSelectors[{i}]");
            if a.key.is_empty()
                || a.key == EVERY_LABEL
                || a.key.len() > 317
                || a.key.chars().any(char::is_whitespace)
            {
                return bad(format!(
                    "{field}.key must be a node label key, got {:?}",
                    a.key
                ));
            }
            if a.value.len() > 63 || a.value.chars().any(char::is_whitespace) {
                return bad(format!(
                    "{field}.value must be a label value (at most 63 characters) or \"*\", got {:?}",
                    a.value
                ));
            }
            check_namespaces(&format!("{field}.namespaces"), &a.namespaces)?;
        }
        for (i, q) in self.query_matchers.iter().enumerate() {
            let field = format!("policy.queryMatchers[{i}]");
            check_namespaces(&format!("{field}.namespaces"), &q.namespaces)?;
            if q.matchers.is_empty() {
                return bad(format!("{field}.matchers must name at least one label"));
            }
            for (label, value) in &q.matchers {
                if !is_prometheus_label(label) || label.starts_with("__") {
                    return bad(format!(
                        "{field}.matchers: {label:?} is not a Prometheus label name (letters, digits and _, not starting with a digit or __)"
                    ));
                }
                if CONFINED_LABELS.contains(&label.as_str()) {
                    return bad(format!(
                        "{field}.matchers: {label:?} is set by the operator for every query (namespace and fleet); it cannot be set by the policy"
                    ));
                }
                if value.is_empty() {
                    return bad(format!(
                        "{field}.matchers.{label} must not be empty (an empty value would match only series without the label)"
                    ));
                }
            }
            // Two entries that apply to one namespace must agree, else that
            // namespace's queries could match nothing.
            for (j, other) in self.query_matchers[..i].iter().enumerate() {
                if !overlap(&q.namespaces, &other.namespaces) {
                    continue;
                }
                for (label, value) in &q.matchers {
                    if let Some(theirs) = other.matchers.get(label)
                        && theirs != value
                    {
                        return bad(format!(
                            "{field}.matchers.{label} is {value:?} but policy.queryMatchers[{j}] sets it to {theirs:?} for a namespace both list"
                        ));
                    }
                }
            }
        }
        let grace = self.max_termination_grace_period_seconds;
        if grace < MIN_TERMINATION_GRACE_SECONDS {
            return bad(format!(
                "policy.maxTerminationGracePeriodSeconds must be at least {MIN_TERMINATION_GRACE_SECONDS}, got {grace}"
            ));
        }
        let c = &self.sysctl_ceilings;
        for (name, v) in [
            ("fs.nr_open", c.nr_open),
            ("fs.file-max", c.file_max),
            ("net.ipv4.tcp_mem", c.tcp_mem_pages),
            ("net.netfilter.nf_conntrack_max", c.nf_conntrack_max),
            ("fs.epoll.max_user_watches", c.max_user_watches),
        ] {
            if v < 1 {
                return bad(format!(
                    "policy.sysctlCeilings.{name} must be at least 1, got {v}"
                ));
            }
        }
        Ok(())
    }

    /// Whether fleets in `namespace` may use `sysctls.mode: InitContainer`.
    pub fn allows_init_container(&self, namespace: &str) -> bool {
        lists(&self.init_container_namespaces, namespace)
    }

    /// The reserved taint `toleration` tolerates, if any: one whose key it
    /// names, or any, for a key-less toleration (which Kubernetes reads as
    /// `Exists` on every key). Effect and value are not looked at: a
    /// reserved key is reserved whatever they are.
    pub fn reserved_taint_tolerated(&self, toleration: &Toleration) -> Option<&str> {
        let key = toleration.key.as_deref().unwrap_or_default();
        self.reserved_taints
            .iter()
            .find(|t| key.is_empty() || key == t.as_str())
            .map(String::as_str)
    }

    /// Whether the admin allows `toleration` in `namespace`: an entry of
    /// [`Policy::allowed_tolerations`] with the same key, operator (`Equal`
    /// when unset), value and effect, listing the namespace.
    pub fn allows_toleration(&self, namespace: &str, toleration: &Toleration) -> bool {
        let s = |v: &Option<String>| v.clone().unwrap_or_default();
        let op = |v: &Option<String>| v.clone().unwrap_or_else(|| "Equal".into());
        self.allowed_tolerations.iter().any(|a| {
            s(&a.key) == s(&toleration.key)
                && op(&a.operator) == op(&toleration.operator)
                && s(&a.value) == s(&toleration.value)
                && s(&a.effect) == s(&toleration.effect)
                && lists(&a.namespaces, namespace)
        })
    }

    /// Whether the admin allows a fleet in `namespace` to select nodes
    /// whose label `key` is `value`: the key is not reserved, or an entry of
    /// [`Policy::allowed_node_selectors`] with the key and the value (or
    /// `*`) lists the namespace.
    pub fn allows_node_selector(&self, namespace: &str, key: &str, value: &str) -> bool {
        let reserved = self
            .reserved_node_labels
            .iter()
            .any(|k| k == EVERY_LABEL || k == key);
        !reserved
            || self.allowed_node_selectors.iter().any(|a| {
                a.key == key
                    && (a.value == ANY_VALUE || a.value == value)
                    && lists(&a.namespaces, namespace)
            })
    }

    /// The label matchers every query of a fleet in `namespace` is
    /// confined to besides `namespace` and `fleet`: those of every
    /// [`Policy::query_matchers`] entry listing it (validation keeps them
    /// from disagreeing), sorted by label.
    pub fn query_matchers(&self, namespace: &str) -> Vec<(String, String)> {
        matchers_for(&self.query_matchers, namespace)
    }

    /// Checks a fleet in `namespace` against the policy: its tolerations,
    /// its node selector, and whether it asks for the privileged init
    /// container (`init_container`: its `sysctls.mode` is `InitContainer`).
    /// The first refusal, naming the field. An empty node selector needs no
    /// permission: it narrows nothing (keeping fleets off nodes is the
    /// reserved taints' job).
    pub fn check_fleet(
        &self,
        namespace: &str,
        init_container: bool,
        tolerations: &[Toleration],
        node_selector: &BTreeMap<String, String>,
    ) -> Result<(), Refusal> {
        for (index, t) in tolerations.iter().enumerate() {
            if let Some(taint) = self.reserved_taint_tolerated(t)
                && !self.allows_toleration(namespace, t)
            {
                return Err(Refusal::Toleration {
                    index,
                    toleration: serde_json::to_string(t).unwrap_or_default(),
                    taint: taint.to_string(),
                });
            }
        }
        for (key, value) in node_selector {
            if !self.allows_node_selector(namespace, key, value) {
                return Err(Refusal::NodeSelector {
                    key: key.clone(),
                    value: value.clone(),
                });
            }
        }
        if init_container && !self.allows_init_container(namespace) {
            return Err(Refusal::InitContainer {
                namespace: namespace.to_string(),
            });
        }
        Ok(())
    }
}

/// The label matchers of `entries` that apply to `namespace`, sorted by
/// label (for a reader holding only the policy's `queryMatchers`).
pub fn matchers_for(entries: &[QueryMatchers], namespace: &str) -> Vec<(String, String)> {
    let mut all = BTreeMap::new();
    for q in entries.iter().filter(|q| lists(&q.namespaces, namespace)) {
        all.extend(q.matchers.iter().map(|(l, v)| (l.clone(), v.clone())));
    }
    all.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toleration(v: serde_json::Value) -> Toleration {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_are_finite_and_match_the_bundled_image() {
        let p = Policy::default();
        assert_eq!(p.sysctl_image, crate::api::DEFAULT_SERVER_IMAGE);
        assert_eq!(
            p.calibration_probe_image,
            crate::api::DEFAULT_SERVER_IMAGE.replace("/server:", "/loadgen:")
        );
        assert_eq!(p.max_termination_grace_period_seconds, 3600);
        assert_eq!(p.init_container_namespaces, ["*"]);
        assert_eq!(p.reserved_taints, CONTROL_PLANE_TAINTS);
        assert!(p.allowed_tolerations.is_empty());
        assert!(p.reserved_node_labels.is_empty() && p.allowed_node_selectors.is_empty());
        assert!(p.query_matchers.is_empty());
        assert!(p.conntrack);
        let c = p.sysctl_ceilings;
        assert_eq!(
            (c.nr_open, c.file_max, c.tcp_mem_pages, c.nf_conntrack_max),
            (33_554_432, 134_217_728, 16_777_216, 67_108_864)
        );
        assert_eq!(c.max_user_watches, 134_217_728);
        // Above the kernel defaults of a big node, below the kernel's own maximum.
        assert!(c.nr_open > crate::plan::kernel::DEFAULT_NR_OPEN);
        assert!(c.nr_open < crate::plan::kernel::NR_OPEN_MAX);
        p.validate().unwrap();
    }

    #[test]
    fn an_empty_file_is_the_defaults_and_a_partial_one_keeps_the_rest() {
        assert_eq!(Policy::from_yaml("").unwrap(), Policy::default());
        assert_eq!(Policy::from_yaml("{}\n").unwrap(), Policy::default());
        assert_eq!(Policy::from_yaml("---\n").unwrap(), Policy::default());
        let p = Policy::from_yaml(
            r#"
sysctlImage: registry.example/c10m/server@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
initContainerNamespaces: [edge, push]
maxTerminationGracePeriodSeconds: 600
sysctlCeilings:
  net.netfilter.nf_conntrack_max: 2000000
allowedTolerations:
  - key: node-role.kubernetes.io/control-plane
    operator: Exists
    effect: NoSchedule
    namespaces: [infra]
"#,
        )
        .unwrap();
        assert!(p.sysctl_image.ends_with("0123456789abcdef"));
        assert_eq!(p.init_container_namespaces, ["edge", "push"]);
        assert_eq!(p.max_termination_grace_period_seconds, 600);
        assert_eq!(p.sysctl_ceilings.nf_conntrack_max, 2_000_000);
        assert_eq!(
            p.sysctl_ceilings.nr_open, DEFAULT_NR_OPEN_CEILING,
            "unset ceilings keep their defaults"
        );
        assert_eq!(p.reserved_taints, CONTROL_PLANE_TAINTS);
        assert_eq!(p.allowed_tolerations[0].namespaces, ["infra"]);
    }

    #[test]
    fn bad_policies_are_refused_naming_the_field() {
        for (yaml, field) in [
            ("sysctlImge: x\n", "sysctlImge"),
            ("sysctlImage: ''\n", "policy.sysctlImage"),
            ("sysctlImage: 'a b'\n", "policy.sysctlImage"),
            (
                "calibrationProbeImage: ''\n",
                "policy.calibrationProbeImage",
            ),
            (
                "maxTerminationGracePeriodSeconds: 5\n",
                "maxTerminationGracePeriodSeconds",
            ),
            (
                "maxTerminationGracePeriodSeconds: lots\n",
                "maxTerminationGracePeriodSeconds",
            ),
            (
                "initContainerNamespaces: [Team_A]\n",
                "policy.initContainerNamespaces",
            ),
            (
                "sysctlCeilings: {fs.nr_open: 0}\n",
                "policy.sysctlCeilings.fs.nr_open",
            ),
            ("sysctlCeilings: {fs.nropen: 5}\n", "fs.nropen"),
            ("reservedTaints: ['']\n", "policy.reservedTaints"),
            (
                "allowedTolerations: [{key: a, operator: Maybe}]\n",
                "policy.allowedTolerations[0].operator",
            ),
            (
                "allowedTolerations: [{key: a, effect: Sometimes}]\n",
                "policy.allowedTolerations[0].effect",
            ),
            (
                "allowedTolerations: [{key: a, operator: Exists, value: b}]\n",
                "policy.allowedTolerations[0].value",
            ),
            (
                "allowedTolerations: [{operator: Equal}]\n",
                "policy.allowedTolerations[0].key",
            ),
            (
                "allowedTolerations: [{key: a, namespaces: ['*x']}]\n",
                "policy.allowedTolerations[0].namespaces",
            ),
            ("reservedNodeLabels: ['']\n", "policy.reservedNodeLabels"),
            ("reservedNodeLabels: ['a b']\n", "policy.reservedNodeLabels"),
            (
                "allowedNodeSelectors: [{key: pool}]\n",
                "missing field `value`",
            ),
            (
                "allowedNodeSelectors: [{key: '*', value: '*'}]\n",
                "policy.allowedNodeSelectors[0].key",
            ),
            (
                "allowedNodeSelectors: [{key: pool, value: 'a b'}]\n",
                "policy.allowedNodeSelectors[0].value",
            ),
            (
                "allowedNodeSelectors: [{key: pool, value: a, namespaces: [Team]}]\n",
                "policy.allowedNodeSelectors[0].namespaces",
            ),
            (
                "allowedNodeSelectors: [{key: pool, value: a, operator: In}]\n",
                "operator",
            ),
            (
                "queryMatchers: [{namespaces: [a]}]\n",
                "missing field `matchers`",
            ),
            (
                "queryMatchers: [{matchers: {}}]\n",
                "policy.queryMatchers[0].matchers must name",
            ),
            (
                "queryMatchers: [{matchers: {namespace: other}}]\n",
                "policy.queryMatchers[0].matchers: \"namespace\"",
            ),
            (
                "queryMatchers: [{matchers: {fleet: other}}]\n",
                "policy.queryMatchers[0].matchers: \"fleet\"",
            ),
            (
                "queryMatchers: [{matchers: {__name__: up}}]\n",
                "policy.queryMatchers[0].matchers: \"__name__\"",
            ),
            (
                "queryMatchers: [{matchers: {0cluster: a}}]\n",
                "policy.queryMatchers[0].matchers: \"0cluster\"",
            ),
            (
                "queryMatchers: [{matchers: {cluster: ''}}]\n",
                "policy.queryMatchers[0].matchers.cluster must not be empty",
            ),
            (
                "queryMatchers: [{namespaces: ['*x'], matchers: {cluster: a}}]\n",
                "policy.queryMatchers[0].namespaces",
            ),
            (
                "queryMatchers: [{namespaces: [a, b], matchers: {cluster: eu}}, {namespaces: [b], matchers: {cluster: us}}]\n",
                "policy.queryMatchers[1].matchers.cluster is \"us\" but policy.queryMatchers[0]",
            ),
            (
                "queryMatchers: [{namespaces: [a], matchers: {cluster: eu}}, {matchers: {cluster: us}}]\n",
                "policy.queryMatchers[1].matchers.cluster",
            ),
            ("conntrack: maybe\n", "conntrack"),
        ] {
            let err = Policy::from_yaml(yaml).unwrap_err().to_string();
            assert!(err.contains(field), "{yaml:?}: {err}");
        }
    }

    #[test]
    fn load_names_the_file() {
        let err = Policy::load(Some(Path::new("/nonexistent/policy.yaml")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/policy.yaml"), "{err}");
        assert_eq!(Policy::load(None).unwrap(), Policy::default());
        let dir = std::env::temp_dir().join(format!("c10m-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("policy.yaml");
        std::fs::write(&file, "maxTerminationGracePeriodSeconds: 1\n").unwrap();
        let err = Policy::load(Some(&file)).unwrap_err().to_string();
        assert!(
            err.contains("policy.yaml") && err.contains("maxTerminationGracePeriodSeconds"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn control_plane_tolerations_are_refused_by_default() {
        let p = Policy::default();
        for t in [
            serde_json::json!({"operator": "Exists"}),
            serde_json::json!({"operator": "Exists", "effect": "NoSchedule"}),
            serde_json::json!({"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}),
            serde_json::json!({"key": "node-role.kubernetes.io/control-plane", "operator": "Equal", "value": ""}),
            serde_json::json!({"key": "node-role.kubernetes.io/master", "operator": "Exists"}),
            serde_json::json!({"key": "node-role.kubernetes.io/master", "effect": "NoExecute", "tolerationSeconds": 5}),
        ] {
            let tolerations = [
                toleration(serde_json::json!({"key": "dedicated", "value": "edge"})),
                toleration(t.clone()),
            ];
            let err = p
                .check_fleet("team-a", false, &tolerations, &BTreeMap::new())
                .unwrap_err();
            let Refusal::Toleration {
                index, ref taint, ..
            } = err
            else {
                panic!("{err:?}")
            };
            assert_eq!(index, 1, "{t}");
            assert!(CONTROL_PLANE_TAINTS.contains(&taint.as_str()), "{t}");
            let message = err.to_string();
            assert!(
                message.starts_with("spec.placement.tolerations[1] "),
                "{message}"
            );
            assert!(message.contains("allowedTolerations"), "{message}");
        }
        // Tolerations of other taints are the tenant's.
        for t in [
            serde_json::json!({"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}),
            serde_json::json!({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}),
            serde_json::json!({"key": "node-role.kubernetes.io/control-plane-ish", "operator": "Exists"}),
        ] {
            p.check_fleet("team-a", false, &[toleration(t.clone())], &BTreeMap::new())
                .unwrap_or_else(|e| panic!("{t}: {e}"));
        }
        p.check_fleet("team-a", true, &[], &BTreeMap::new())
            .unwrap();
    }

    #[test]
    fn an_allowed_toleration_passes_exactly_as_listed_in_its_namespaces() {
        let p = Policy::from_yaml(
            r#"
reservedTaints: [node-role.kubernetes.io/control-plane, dedicated]
allowedTolerations:
  - {key: node-role.kubernetes.io/control-plane, operator: Exists, effect: NoSchedule, namespaces: [infra]}
  - {key: dedicated, value: edge}
"#,
        )
        .unwrap();
        let cp = toleration(
            serde_json::json!({"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}),
        );
        p.check_fleet("infra", false, std::slice::from_ref(&cp), &BTreeMap::new())
            .unwrap();
        assert!(
            p.check_fleet("team-a", false, std::slice::from_ref(&cp), &BTreeMap::new())
                .is_err(),
            "other namespaces"
        );
        let mut wider = cp.clone();
        wider.effect = None;
        assert!(
            p.check_fleet("infra", false, &[wider], &BTreeMap::new())
                .is_err(),
            "not as listed: every effect"
        );
        let any = toleration(serde_json::json!({"operator": "Exists"}));
        assert!(
            p.check_fleet("infra", false, &[any], &BTreeMap::new())
                .is_err(),
            "a key-less Exists reaches every reserved taint"
        );
        // Operator Equal is the default on both sides.
        let edge = toleration(
            serde_json::json!({"key": "dedicated", "operator": "Equal", "value": "edge"}),
        );
        p.check_fleet("team-b", false, &[edge], &BTreeMap::new())
            .unwrap();
        let other = toleration(serde_json::json!({"key": "dedicated", "value": "batch"}));
        let err = p
            .check_fleet("team-b", false, &[other], &BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tolerates the taint dedicated"), "{err}");
        // The master taint is no longer reserved by this policy.
        let master = toleration(
            serde_json::json!({"key": "node-role.kubernetes.io/master", "operator": "Exists"}),
        );
        p.check_fleet("team-b", false, &[master], &BTreeMap::new())
            .unwrap();
    }

    #[test]
    fn init_container_mode_only_in_listed_namespaces() {
        let p = Policy::from_yaml("initContainerNamespaces: [edge]\n").unwrap();
        assert!(p.allows_init_container("edge"));
        assert!(!p.allows_init_container("team-a"));
        p.check_fleet("team-a", false, &[], &BTreeMap::new())
            .unwrap();
        let err = p
            .check_fleet("team-a", true, &[], &BTreeMap::new())
            .unwrap_err();
        assert_eq!(
            err,
            Refusal::InitContainer {
                namespace: "team-a".into()
            }
        );
        let message = err.to_string();
        assert!(
            message.starts_with("spec.sysctls.mode: InitContainer"),
            "{message}"
        );
        assert!(
            message.contains("set spec.sysctls.mode: PodSecurityContext"),
            "{message}"
        );
        let none = Policy::from_yaml("initContainerNamespaces: []\n").unwrap();
        assert!(!none.allows_init_container("edge"));
        assert!(Policy::default().allows_init_container("anything"));
    }

    /// The chart's `values.policy` is this policy's defaults, spelled out.
    #[test]
    fn chart_values_hold_the_defaults() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../charts/c10m-operator/values.yaml"
        );
        let values: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let policy: Policy = serde_yaml::from_value(values["policy"].clone()).unwrap();
        assert_eq!(policy, Policy::default());
        let keys: Vec<&str> = values["policy"]
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "sysctlImage",
                "calibrationProbeImage",
                "initContainerNamespaces",
                "reservedTaints",
                "allowedTolerations",
                "reservedNodeLabels",
                "allowedNodeSelectors",
                "maxTerminationGracePeriodSeconds",
                "sysctlCeilings",
                "queryMatchers",
                "conntrack"
            ],
            "every field spelled out in the chart"
        );
    }

    #[test]
    fn node_selectors_are_the_tenants_unless_a_label_is_reserved() {
        let none = BTreeMap::new();
        let select = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // The default reserves nothing: any selector, any namespace.
        let p = Policy::default();
        p.check_fleet(
            "team-a",
            false,
            &[],
            &select(&[("kubernetes.io/hostname", "node-1"), ("pool", "gpu")]),
        )
        .unwrap();

        let p = Policy::from_yaml(
            r#"
reservedNodeLabels: [kubernetes.io/hostname, c10m.dev/pool]
allowedNodeSelectors:
  - {key: c10m.dev/pool, value: edge}
  - {key: c10m.dev/pool, value: payments, namespaces: [payments]}
  - {key: kubernetes.io/hostname, value: "*", namespaces: [infra]}
"#,
        )
        .unwrap();
        // An empty selector needs no permission.
        p.check_fleet("team-a", false, &[], &none).unwrap();
        // Unreserved keys are the tenant's.
        p.check_fleet("team-a", false, &[], &select(&[("zone", "a")]))
            .unwrap();
        // Allowed as listed: every namespace for edge, one for payments.
        p.check_fleet("team-a", false, &[], &select(&[("c10m.dev/pool", "edge")]))
            .unwrap();
        p.check_fleet(
            "payments",
            false,
            &[],
            &select(&[("c10m.dev/pool", "payments")]),
        )
        .unwrap();
        let err = p
            .check_fleet(
                "team-a",
                false,
                &[],
                &select(&[("c10m.dev/pool", "payments"), ("zone", "a")]),
            )
            .unwrap_err();
        assert_eq!(
            err,
            Refusal::NodeSelector {
                key: "c10m.dev/pool".into(),
                value: "payments".into()
            }
        );
        let message = err.to_string();
        assert_eq!(
            message,
            r#"spec.placement.nodeSelector["c10m.dev/pool"] = "payments" selects on the node label c10m.dev/pool, which the operator's policy reserves (reservedNodeLabels); remove it, or ask a cluster admin to allow this selector (policy allowedNodeSelectors)"#
        );
        // "*" is any value, in its namespaces only.
        p.check_fleet(
            "infra",
            false,
            &[],
            &select(&[("kubernetes.io/hostname", "node-7")]),
        )
        .unwrap();
        assert!(
            p.check_fleet(
                "team-a",
                false,
                &[],
                &select(&[("kubernetes.io/hostname", "node-7")])
            )
            .is_err()
        );
        // Tolerations are checked first, the init container last.
        let any = toleration(serde_json::json!({"operator": "Exists"}));
        let pinned = select(&[("kubernetes.io/hostname", "node-7")]);
        assert!(matches!(
            p.check_fleet("team-a", true, &[any], &pinned),
            Err(Refusal::Toleration { .. })
        ));
        let closed = Policy {
            init_container_namespaces: vec![],
            ..p.clone()
        };
        assert!(matches!(
            closed.check_fleet("team-a", true, &[], &pinned),
            Err(Refusal::NodeSelector { .. })
        ));
    }

    #[test]
    fn every_label_reserved_leaves_only_the_allowed_selectors() {
        let p = Policy::from_yaml(
            "reservedNodeLabels: ['*']\nallowedNodeSelectors: [{key: c10m.dev/pool, value: edge}]\n",
        )
        .unwrap();
        assert!(p.allows_node_selector("team-a", "c10m.dev/pool", "edge"));
        assert!(!p.allows_node_selector("team-a", "c10m.dev/pool", "gpu"));
        assert!(!p.allows_node_selector("team-a", "zone", "a"));
        p.check_fleet("team-a", false, &[], &BTreeMap::new())
            .unwrap();
    }

    #[test]
    fn query_matchers_apply_to_their_namespaces() {
        let p = Policy::from_yaml(
            r#"
queryMatchers:
  - {matchers: {cluster: eu-1}}
  - {namespaces: [team-a], matchers: {tenant: a, cluster: eu-1}}
  - {namespaces: [team-b], matchers: {tenant: b}}
"#,
        )
        .unwrap();
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(l, v)| (l.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            p.query_matchers("team-a"),
            pairs(&[("cluster", "eu-1"), ("tenant", "a")])
        );
        assert_eq!(
            p.query_matchers("team-b"),
            pairs(&[("cluster", "eu-1"), ("tenant", "b")])
        );
        assert_eq!(p.query_matchers("team-c"), pairs(&[("cluster", "eu-1")]));
        assert!(Policy::default().query_matchers("team-a").is_empty());
        // Entries for disjoint namespaces may disagree.
        Policy::from_yaml(
            "queryMatchers: [{namespaces: [a], matchers: {cluster: eu}}, {namespaces: [b], matchers: {cluster: us}}]\n",
        )
        .unwrap();
    }

    #[test]
    fn conntrack_is_on_unless_the_admin_says_off() {
        assert!(Policy::default().conntrack);
        assert!(!Policy::from_yaml("conntrack: false\n").unwrap().conntrack);
    }
}
