//! Capacity model (pure: no I/O). From a fleet's spec and the node profile it
//! derives the shard shape, shards, connections per shard, shards per node,
//! resources, file descriptor limits and the sysctls that let the kernel
//! hold them.
//!
//! Every limit is checked at the shard's *connection cap* `L`, the declared
//! connections per shard inflated by the headroom (`L = ceil(n × 100 /
//! (100 − headroom))`), against 100 % of the limit. So at the declared load
//! every limit is used at most `100 − headroom` percent, and a shard can
//! absorb its cap (imbalance, reconnect storms) without hitting any of them.
//! The fleet also survives its largest failure domain
//! (`spec.availability`): the survivors' caps hold every declared
//! connection, and they re-accept the lost ones within the refill budget.
//!
//! What a connection charges to its pod follows the nodes' cgroup version
//! ([`CgroupMode`]): under v2 the socket and its buffers, under v1 only its
//! file, inode, dentry and epoll items. Slow readers pin the socket buffers
//! the plan bounds with `tcp_rmem`/`tcp_wmem`.
//!
//! Figures come from [`super::kernel`] (measured on Linux 6.18, cited in
//! `docs/KERNEL_FACTS.md`, re-measured by `make bench-fidelity`) and the
//! kernel sources named beside each constant.

use std::cmp::Reverse;

use crate::api::status::{FigureSource, NodeSource};
use crate::api::sysctl::{Sysctl, SysctlValue, Sysctls};
use crate::api::{
    BackendModel, BytesPerConnection, CgroupMode, ConnectionFleetSpec, FailureDomain,
    LimitingFactor, Plan, Shape, ShapeSource, SysctlMode,
};
use crate::policy::{Policy, SysctlCeilings};

use super::bundled::partial_budget_bytes;
use super::drain;
use super::kernel::*;
use super::nodes::NodeRuntime;
use super::sysctl::{
    FILE_MAX_SYSTEM_RESERVE, NodeLoad, bounds_socket_buffers, plan_sysctls, raises_node_sysctls,
};
use super::validate::{Validated, validate};
use super::{NodeFacts, PlanError};

/// Most connections a fleet plans per shard search (the API's bound on
/// `spec.connections`).
const SEARCH_CEILING: i64 = crate::api::MAX_CONNECTIONS;

/// Next-best shapes a plan lists (`status.plan.alternativeShapes`).
const ALTERNATIVE_SHAPES: usize = 3;

/// A shape at most this percent of the chosen one's cost is worth naming
/// when the spec fixed the shape.
pub const CHEAPER_SHAPE_PERCENT: i64 = 80;

/// Most file descriptors one shard process can get on a node with `runtime`.
/// The bundled server in InitContainer mode, where the node can grant
/// CAP_SYS_RESOURCE, raises its hard RLIMIT_NOFILE itself, up to
/// `fs.nr_open`, which the init container raises: its ceiling is
/// [`NR_OPEN_MAX`]. Any other server keeps the hard limit of the node's
/// container runtime (`runtime.nofile_hard_limit`, default
/// [`DEFAULT_NOFILE_HARD_LIMIT`]).
pub fn nofile_ceiling(spec: &ConnectionFleetSpec, runtime: &NodeRuntime) -> i64 {
    if raises_own_nofile(spec, runtime) {
        NR_OPEN_MAX
    } else {
        runtime
            .nofile_hard_limit
            .unwrap_or(DEFAULT_NOFILE_HARD_LIMIT)
    }
}

/// True when the shard server raises its own hard RLIMIT_NOFILE: the
/// bundled server in InitContainer mode on nodes whose runtime can give it
/// CAP_SYS_RESOURCE (it drops to an unprivileged uid/gid right after).
pub fn raises_own_nofile(spec: &ConnectionFleetSpec, runtime: &NodeRuntime) -> bool {
    spec.backend.model == BackendModel::Epoll
        && spec.sysctls.mode == SysctlMode::InitContainer
        && runtime.sys_resource
}

/// The cgroup version the plan charges by: v2 unless the nodes (or, where
/// they say nothing, `spec.node.cgroupMode`) say v1 and neither says v2.
pub fn cgroup_mode(spec: &ConnectionFleetSpec, runtime: &NodeRuntime) -> CgroupMode {
    let claimed = spec.node.as_ref().and_then(|n| n.cgroup_mode);
    match (runtime.cgroup_mode, claimed) {
        (Some(CgroupMode::V2), _) | (_, Some(CgroupMode::V2)) => CgroupMode::V2,
        (Some(CgroupMode::V1), _) | (None, Some(CgroupMode::V1)) => CgroupMode::V1,
        (None, None) => CgroupMode::V2,
    }
}

/// Resolved inputs of the model for one shard shape.
#[derive(Clone, Debug)]
struct Inputs {
    connections: i64,
    user: i64,
    /// Bytes of a shard process beyond its connections, fd table and
    /// unfinished input.
    base: i64,
    /// Bytes a shard holds for unfinished input, beyond its connections
    /// ([`partial_budget_bytes`]).
    partial: i64,
    /// Kernel bytes of an idle connection on the node: socket, conntrack.
    kernel_idle: i64,
    /// Of `kernel_idle`, the bytes charged to the pod.
    pod_kernel_idle: i64,
    /// Queued-data bytes per connection at peak (the `queuedPercent` page share).
    queued_bytes: i64,
    /// Socket buffers are charged to the pod (cgroup v2).
    buffers_in_pod: bool,
    slow_percent: i64,
    slow_kernel: i64,
    slow_user: i64,
    headroom: i64,
    cpus: i64,
    fd_reserve: i64,
    nofile_hard: i64,
    connections_per_cpu: Option<i64>,
    queued_percent: i64,
    tracked: bool,
    raise_node_sysctls: bool,
    cgroup_mode: CgroupMode,
    failure_domain: FailureDomain,
    refill_budget: i64,
    node: NodeFacts,
    defaults: KernelDefaults,
    ceilings: SysctlCeilings,
}

/// Node-wide limits a shard layout is checked against.
struct NodeLimits {
    tcp_mem_pressure: i64,
    conntrack_max: i64,
    file_max: i64,
    nr_open: i64,
    max_user_watches: i64,
}

impl Inputs {
    /// Connection cap of a shard that declares `n` connections.
    fn cap(&self, n: i64) -> i64 {
        ceil_div(n * 100, 100 - self.headroom)
    }

    /// Declared connections whose cap holds `l`: the least `n` with `cap(n) ≥ l`.
    fn declared_for_cap(&self, l: i64) -> i64 {
        ceil_div(l * (100 - self.headroom), 100)
    }

    /// RLIMIT_NOFILE of a shard with cap `l`.
    fn nofile(&self, l: i64) -> i64 {
        l + self.fd_reserve
    }

    /// Slow readers a shard with cap `l` is sized for.
    fn slow_readers(&self, l: i64) -> i64 {
        ceil_div(l * self.slow_percent, 100)
    }

    /// Sockets of a shard with cap `l` holding a queued page at peak.
    fn queued_sockets(&self, l: i64) -> i64 {
        ceil_div(l * self.queued_percent, 100)
    }

    /// Pages a shard with cap `l` charges to `tcp_mem` at peak: one per
    /// queued socket, and each slow reader's buffers.
    fn tcp_mem_pages(&self, l: i64) -> i64 {
        self.queued_sockets(l) + self.slow_readers(l) * ceil_div(self.slow_kernel, PAGE_BYTES)
    }

    /// Kernel buffer bytes of a shard with cap `l` at peak: the queued
    /// pages and the slow readers' bounded buffers. Charged to the pod
    /// under cgroup v2, to the node outside it under v1 (`i128` like
    /// [`Self::pod_bytes`]).
    fn buffer_bytes(&self, l: i64) -> i128 {
        self.queued_sockets(l) as i128 * PAGE_BYTES as i128
            + self.slow_readers(l) as i128 * self.slow_kernel as i128
    }

    /// Bytes of a shard's memory beyond its connections: the process base,
    /// the fd table for its `nofile`, the budget for unfinished input.
    fn process_bytes(&self, l: i64) -> i64 {
        self.base + self.partial + fd_table_bytes(self.nofile(l))
    }

    /// Bytes one idle connection charges to the pod.
    fn pod_bytes_per_connection(&self) -> BytesPerConnection {
        BytesPerConnection {
            user: self.user,
            kernel: self.pod_kernel_idle,
            total: self.user + self.pod_kernel_idle,
        }
    }

    /// Bytes one slow reader pins beyond an idle connection.
    fn slow_reader_bytes(&self) -> BytesPerConnection {
        BytesPerConnection {
            user: self.slow_user,
            kernel: self.slow_kernel,
            total: self.slow_user + self.slow_kernel,
        }
    }

    /// Memory of a shard container with cap `l` at peak, bytes (`i128`:
    /// cap × bytes passes `i64` for a 1 GiB custom backend near the
    /// connection bound).
    fn pod_bytes(&self, l: i64) -> i128 {
        self.process_bytes(l) as i128
            + l as i128 * (self.user + self.pod_kernel_idle) as i128
            + self.slow_readers(l) as i128 * self.slow_user as i128
            + if self.buffers_in_pod {
                self.buffer_bytes(l)
            } else {
                0
            }
    }

    /// Memory limit of a shard container with cap `l`, rounded up to MiB
    /// and saturated: a limit that large fits no node, so the memory check
    /// refuses it.
    fn memory_limit(&self, l: i64) -> i64 {
        saturate(ceil_div_wide(self.pod_bytes(l), 1 << 20) * (1 << 20))
    }

    /// Node bytes one shard with cap `l` uses: its container limit plus the
    /// kernel bytes charged outside its cgroup (saturated like
    /// [`Self::memory_limit`]).
    fn node_bytes_per_shard(&self, l: i64) -> i64 {
        saturate(
            self.memory_limit(l) as i128
                + l as i128 * (self.kernel_idle - self.pod_kernel_idle) as i128
                + if self.buffers_in_pod {
                    0
                } else {
                    self.buffer_bytes(l)
                },
        )
    }

    /// Constraints violated by `s` shards per node of `n` declared connections
    /// each, in the order they are reported as the limiting factor. With
    /// `sysctls`, raisable node limits are checked against those values.
    fn violations(&self, n: i64, s: i64, sysctls: Option<&Sysctls>) -> Vec<LimitingFactor> {
        let l = self.cap(n);
        let mut v = Vec::new();
        let lim = self.node_limits(sysctls);
        // i128: s × bytes can pass i64 for absurd inputs during the search.
        if (s as i128) * (self.node_bytes_per_shard(l) as i128) > self.node.memory_bytes as i128 {
            v.push(LimitingFactor::Memory);
        }
        if (s as i128) * (self.tcp_mem_pages(l) as i128) > lim.tcp_mem_pressure as i128 {
            v.push(LimitingFactor::TcpMem);
        }
        let nofile = self.nofile(l);
        if nofile > self.nofile_hard || nofile > lim.nr_open || s * nofile > lim.file_max {
            v.push(LimitingFactor::Nofile);
        }
        if self
            .connections_per_cpu
            .is_some_and(|c| l as i128 > c as i128 * self.cpus as i128)
            || s * self.cpus > self.node.cpus
        {
            v.push(LimitingFactor::Cpu);
        }
        if self.tracked && s * l > lim.conntrack_max {
            v.push(LimitingFactor::Conntrack);
        }
        if s > self.node.pods {
            v.push(LimitingFactor::Pods);
        }
        if s * nofile > lim.max_user_watches {
            v.push(LimitingFactor::MaxUserWatches);
        }
        v
    }

    /// Node-wide limits to check. While planning, a limit the plan raises
    /// is checked against the most the policy's ceilings let it raise to
    /// ([`Self::raisable`]); with the plan's `sysctls` every limit is
    /// checked against them (kernel defaults where the plan sets none).
    fn node_limits(&self, sysctls: Option<&Sysctls>) -> NodeLimits {
        match sysctls {
            Some(m) => {
                let get = |sysctl: Sysctl| -> i64 {
                    m.get(&sysctl)
                        .unwrap_or(&self.defaults.value(sysctl))
                        .limit()
                };
                NodeLimits {
                    tcp_mem_pressure: get(Sysctl::TcpMem),
                    conntrack_max: get(Sysctl::NfConntrackMax),
                    file_max: get(Sysctl::FileMax),
                    nr_open: get(Sysctl::NrOpen),
                    max_user_watches: get(Sysctl::MaxUserWatches),
                }
            }
            None if self.raise_node_sysctls => self.raisable(),
            None => NodeLimits {
                tcp_mem_pressure: self.defaults.tcp_mem[1],
                conntrack_max: self.defaults.conntrack_max,
                file_max: self.defaults.file_max,
                nr_open: DEFAULT_NR_OPEN,
                max_user_watches: self.defaults.max_user_watches,
            },
        }
    }

    /// The most the plan may raise each node limit to under the policy's
    /// ceilings, never below the kernel default. The plan raises
    /// `tcp_mem`'s max to 1.5 × its pressure and `fs.file-max` to the
    /// shards' files plus [`FILE_MAX_SYSTEM_RESERVE`], so those leave room
    /// for that under their ceilings.
    fn raisable(&self) -> NodeLimits {
        let (c, d) = (&self.ceilings, &self.defaults);
        let pressure = (c.tcp_mem_pages as i128 * 2 / 3) as i64;
        NodeLimits {
            tcp_mem_pressure: d.tcp_mem[1].max(pressure),
            conntrack_max: d.conntrack_max.max(c.nf_conntrack_max),
            file_max: d
                .file_max
                .max(c.file_max.saturating_sub(FILE_MAX_SYSTEM_RESERVE)),
            nr_open: DEFAULT_NR_OPEN.max(c.nr_open),
            max_user_watches: d.max_user_watches.max(c.max_user_watches),
        }
    }

    /// Node-level sysctls whose ceilings `s` shards per node of `n`
    /// declared connections each would pass, among those behind `factor`
    /// (name → the ceiling). Empty unless the plan raises node limits: with
    /// kernel defaults, no ceiling is what binds.
    fn capped(&self, n: i64, s: i64, factor: LimitingFactor) -> Sysctls {
        let mut capped = Sysctls::new();
        if !self.raise_node_sysctls {
            return capped;
        }
        let l = self.cap(n);
        let nofile = self.nofile(l);
        let lim = self.raisable();
        let c = &self.ceilings;
        let mut cap = |sysctl, ceiling| {
            capped.insert(sysctl, SysctlValue::One(ceiling));
        };
        match factor {
            LimitingFactor::TcpMem if s * self.tcp_mem_pages(l) > lim.tcp_mem_pressure => {
                cap(Sysctl::TcpMem, c.tcp_mem_pages)
            }
            LimitingFactor::Conntrack if self.tracked && s * l > lim.conntrack_max => {
                cap(Sysctl::NfConntrackMax, c.nf_conntrack_max)
            }
            LimitingFactor::Nofile => {
                if nofile > lim.nr_open && lim.nr_open < self.nofile_hard {
                    cap(Sysctl::NrOpen, c.nr_open);
                }
                if s * nofile > lim.file_max {
                    cap(Sysctl::FileMax, c.file_max);
                }
            }
            LimitingFactor::MaxUserWatches if s * nofile > lim.max_user_watches => {
                cap(Sysctl::MaxUserWatches, c.max_user_watches)
            }
            _ => {}
        }
        capped
    }

    /// Most declared connections per shard with `s` shards per node (0 if none fit).
    fn max_per_shard(&self, s: i64) -> i64 {
        let (mut lo, mut hi) = (0i64, SEARCH_CEILING);
        while lo < hi {
            let mid = lo + (hi - lo + 1) / 2;
            if self.violations(mid, s, None).is_empty() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// How `shards` shards of at most `per_node` a node spread: (nodes,
    /// shards lost with the largest failure domain). Under `Node` they
    /// spread evenly over at least two nodes.
    fn layout(&self, shards: i64, per_node: i64) -> (i64, i64) {
        let nodes = ceil_div(shards, per_node);
        match self.failure_domain {
            FailureDomain::Node => {
                let nodes = nodes.max(2).min(shards);
                (nodes, ceil_div(shards, nodes))
            }
            FailureDomain::Shard => (nodes, 1),
            FailureDomain::None => (nodes, 0),
        }
    }

    /// Seconds the survivors of losing `lost` of `shards` shards (one at
    /// least) take to re-accept the lost shards' declared connections at
    /// [`ACCEPTS_PER_SECOND_PER_WORKER`] per worker.
    fn refill_seconds(&self, shards: i64, lost: i64) -> i64 {
        let lost = lost.max(1);
        let connections = lost as i128 * ceil_div(self.connections, shards) as i128;
        let survivors = (shards - lost).max(1);
        let rate = survivors as i128 * self.cpus as i128 * ACCEPTS_PER_SECOND_PER_WORKER as i128;
        saturate(ceil_div_wide(connections, rate))
    }

    /// What the fleet still lacks with `shards` shards whose caps can reach
    /// `max_cap`: `FailureDomain` when the survivors of its largest domain
    /// cannot hold every declared connection, `Refill` when they cannot
    /// re-accept the lost ones within the budget (not checked under `None`).
    fn availability_gap(&self, shards: i64, per_node: i64, max_cap: i64) -> Option<LimitingFactor> {
        let (_, lost) = self.layout(shards, per_node);
        if lost == 0 {
            return None;
        }
        let survivors = shards - lost;
        if survivors < 1 || (survivors as i128) * (max_cap as i128) < self.connections as i128 {
            return Some(LimitingFactor::FailureDomain);
        }
        (self.refill_seconds(shards, lost) > self.refill_budget).then_some(LimitingFactor::Refill)
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

fn ceil_div_wide(a: i128, b: i128) -> i128 {
    (a + b - 1) / b
}

/// `x` as `i64`, `i64::MAX` when it does not fit.
fn saturate(x: i128) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

/// Computes the plan for `spec` on nodes like `node` under the default
/// [`Policy`] ([`plan_under`]).
pub fn plan(spec: &ConnectionFleetSpec, node: NodeFacts) -> Result<Plan, PlanError> {
    plan_under(spec, node, &Policy::default())
}

/// CPUs per shard the planner weighs when `spec.shard.cpus` is unset:
/// powers of two up to the node's CPUs (at most the schema's 1,024), and
/// the node's CPUs themselves.
fn shape_candidates(node_cpus: i64) -> Vec<i64> {
    let top = node_cpus.clamp(1, 1024);
    let mut c: Vec<i64> = std::iter::successors(Some(1i64), |c| Some(c * 2))
        .take_while(|&c| c <= top)
        .collect();
    if c.last() != Some(&top) {
        c.push(top);
    }
    c
}

/// Order of shapes, cheapest first: a shape `maxShards` does not stop
/// (it holds the declared connections and survives its failure domain),
/// and among those that fall short the one holding the most; then fewest
/// nodes (the fleet's monthly cost), then most connections per node (the
/// price of capacity), then a drain that fits the policy's grace bound,
/// then fewest shards.
fn shape_rank(p: &Plan) -> (bool, Reverse<i64>, i32, Reverse<i64>, bool, i32) {
    let short = p.limiting_factor == LimitingFactor::MaxShards;
    (
        short,
        Reverse(if short { p.capacity } else { 0 }),
        p.nodes,
        Reverse(p.connections_per_node),
        p.drain_cut_by_policy,
        p.shards,
    )
}

/// The plan's shape as an alternative.
fn shape_of(p: &Plan) -> Shape {
    Shape {
        cpus: p.cpus,
        shards: p.shards,
        shards_per_node: p.shards_per_node,
        nodes: p.nodes,
        capacity: p.capacity,
        connections_per_node: p.connections_per_node,
        limiting_factor: p.limiting_factor,
        cost_per_million_connections_monthly: p.cost_per_million_connections_monthly,
        monthly_cost: p.monthly_cost,
    }
}

/// True when `plan`'s shape was fixed by the spec and `alt` is worth
/// naming instead: it holds at least what `plan` holds of the `declared`
/// connections (and is not stopped by `maxShards` where `plan` is not) and
/// costs at most [`CHEAPER_SHAPE_PERCENT`] of it: its nodes (the monthly
/// cost), or with as many nodes, its price of capacity (connections per
/// node). A shape the planner chose has nothing cheaper to name.
pub fn is_much_cheaper(alt: &Shape, plan: &Plan, declared: i64) -> bool {
    let pct = CHEAPER_SHAPE_PERCENT as i128;
    let comparable = plan.shape_source == ShapeSource::Spec
        && alt.capacity >= plan.capacity.min(declared)
        && (alt.limiting_factor != LimitingFactor::MaxShards
            || plan.limiting_factor == LimitingFactor::MaxShards);
    comparable
        && ((alt.nodes as i128) * 100 <= plan.nodes as i128 * pct
            || (alt.nodes <= plan.nodes
                && (plan.connections_per_node as i128) * 100
                    <= alt.connections_per_node as i128 * pct))
}

/// Computes the plan for `spec` on nodes like `node` under the admin's
/// `policy`: node-level sysctls are raised at most to its ceilings (the
/// shards are sized to fit under them, and `sysctlsCapped` names a ceiling
/// that limits connections per node), and the grace period is at most its
/// bound (`drainCutByPolicy` says when the drain cannot finish in it).
/// With `spec.shard.cpus` unset the planner plans every shape of
/// [`shape_candidates`] and keeps the cheapest ([`shape_rank`]); either
/// way the next-best shapes are listed (`alternativeShapes`).
///
/// Errors: [`PlanError::Invalid`] for a spec the schema should have refused,
/// [`PlanError::Infeasible`] when not one connection fits a shard on a node
/// (shard.cpus above node CPUs, or node memory below one shard's base).
pub fn plan_under(
    spec: &ConnectionFleetSpec,
    node: NodeFacts,
    policy: &Policy,
) -> Result<Plan, PlanError> {
    let valid = validate(spec)?;
    let mut shapes: Vec<Result<Plan, PlanError>> = shape_candidates(node.cpus)
        .into_iter()
        .filter(|&c| Some(c) != spec.shard.cpus.map(i64::from))
        .map(|cpus| plan_shape(spec, &valid, cpus, node, policy))
        .collect();
    let chosen = match spec.shard.cpus {
        Some(cpus) => {
            let mut p = plan_shape(spec, &valid, i64::from(cpus), node, policy)?;
            p.shape_source = ShapeSource::Spec;
            p
        }
        None => {
            let best = shapes
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().ok().map(|p| (i, p)))
                .min_by_key(|(_, p)| shape_rank(p))
                .map(|(i, _)| i);
            let Some(i) = best else {
                // No shape fits: the smallest one's error says why.
                return shapes.swap_remove(0);
            };
            let mut p = shapes.swap_remove(i).expect("an Ok shape was found");
            p.shape_source = ShapeSource::Planner;
            p
        }
    };
    let mut others: Vec<Plan> = shapes.into_iter().filter_map(Result::ok).collect();
    others.sort_by_key(shape_rank);
    let mut plan = chosen;
    plan.alternative_shapes = others
        .iter()
        .take(ALTERNATIVE_SHAPES)
        .map(shape_of)
        .collect();
    Ok(plan)
}

/// The plan for `spec` with `cpus` CPUs per shard.
fn plan_shape(
    spec: &ConnectionFleetSpec,
    valid: &Validated,
    cpus: i64,
    node: NodeFacts,
    policy: &Policy,
) -> Result<Plan, PlanError> {
    let inputs = Inputs::new(spec, valid.user_bytes, cpus, node, policy.sysctl_ceilings);
    let tracked = inputs.tracked;

    if cpus > node.cpus {
        return Err(PlanError::Infeasible(format!(
            "spec.shard.cpus ({cpus}) exceeds the CPUs of one node ({})",
            node.cpus
        )));
    }
    // Fill each node's CPUs (and pod slots) with shards; fewer per node only
    // when memory cannot hold that many shards' base.
    let slots = (node.cpus / cpus).min(node.pods);
    // The most shards per node of which each holds a connection (fewer
    // shards per node only hold more each: a binary search).
    let (mut lo, mut hi) = (0i64, slots);
    while lo < hi {
        let mid = lo + (hi - lo + 1) / 2;
        if inputs.max_per_shard(mid) > 0 {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let per_node_shards = lo;
    let per_shard = if lo > 0 { inputs.max_per_shard(lo) } else { 0 };
    if per_shard == 0 {
        return Err(PlanError::Infeasible(format!(
            "not one connection fits a shard: node memory {} B, per-shard base {} B, {} B per connection; raise spec.node.memory (each shard needs a base (16 MiB for the bundled server, 64 MiB for others), 8 MiB per worker of the bundled server, its fd table, plus its connections)",
            node.memory_bytes,
            inputs.process_bytes(1),
            inputs.user + inputs.kernel_idle
        )));
    }

    let sh = &spec.shard;
    let max_cap = inputs.cap(per_shard);
    let needed = ceil_div(inputs.connections, per_shard).max(sh.min_shards as i64);
    let max_shards = sh.max_shards as i64;
    // Add shards until the fleet survives its largest failure domain and
    // refills it within the budget (or maxShards stops it).
    let mut shards = needed.min(max_shards);
    let mut grown_for = None;
    while let Some(gap) = inputs.availability_gap(shards, per_node_shards, max_cap) {
        if shards >= max_shards {
            grown_for = Some(LimitingFactor::MaxShards);
            break;
        }
        grown_for = Some(gap);
        shards += 1;
    }
    let (nodes, lost) = inputs.layout(shards, per_node_shards);
    // Slots bound first when no more shards fit a node; else the per-shard limit.
    let binding = *inputs
        .violations(per_shard + 1, per_node_shards, None)
        .first()
        .expect("max_per_shard stops below the search ceiling only when a constraint binds");
    // Availability names itself only where it costs nodes: more shards on
    // the nodes the connections need anyway leave the per-node limit binding.
    let bare_nodes = ceil_div(needed.min(max_shards), per_node_shards);
    let limiting_factor = match grown_for {
        _ if needed > shards => LimitingFactor::MaxShards,
        Some(LimitingFactor::MaxShards) => LimitingFactor::MaxShards,
        Some(gap) if nodes > bare_nodes => gap,
        // The Node domain's second node, with no shard added.
        None if nodes > bare_nodes => LimitingFactor::FailureDomain,
        _ => binding,
    };
    let sysctls_capped = inputs.capped(per_shard + 1, per_node_shards, binding);
    let connections_per_shard = ceil_div(inputs.connections, shards).min(per_shard);
    // Each survivor's cap holds its share of the declared connections once
    // the largest domain is lost.
    let failover_cap = if lost > 0 && shards > lost {
        ceil_div(inputs.connections, shards - lost)
    } else {
        0
    };
    let sized_connections_per_shard = size_step(
        connections_per_shard
            .max(inputs.declared_for_cap(failover_cap))
            .min(per_shard),
        per_shard,
    );
    let shard_connection_limit = inputs.cap(sized_connections_per_shard);
    let shards_per_node = ceil_div(shards, nodes);
    // Node-level sysctls hold the most shards the scheduler may pack on a
    // node (the spread over nodes is required only under a Node domain).
    let packed = per_node_shards.min(shards);
    let nofile = inputs.nofile(shard_connection_limit);

    let budget = spec.rollout.budget(spec.drain.rate);
    let drain_rate = drain::shard_rate(spec.drain.rate, budget);
    let drain = drain::drain(
        shard_connection_limit,
        drain_rate,
        policy.max_termination_grace_period_seconds,
    );
    let rollout = drain::rollout(shards, drain_rate, budget, drain);
    let (sysctls, sysctls_not_applied) = plan_sysctls(
        spec,
        &node.runtime,
        &inputs.defaults,
        &inputs.ceilings,
        NodeLoad {
            connections: packed * shard_connection_limit,
            tcp_mem_pages: packed * inputs.tcp_mem_pages(shard_connection_limit),
            open_files: packed * nofile,
            nofile,
            tracked,
            watches: packed * nofile,
        },
    );
    let listen_backlog = LISTEN_BACKLOG.min(
        sysctls
            .get(&Sysctl::Somaxconn)
            .map_or(DEFAULT_SOMAXCONN, |v| v.limit()),
    );

    let connections_per_node = per_node_shards * per_shard;
    let price = valid.price_per_hour;
    let round_cents = |x: f64| (x * 100.0).round() / 100.0;
    let monthly_cost = price.map(|p| nodes as f64 * p * HOURS_PER_MONTH);
    let plan = Plan {
        shards: shards as i32,
        connections_per_shard,
        max_connections_per_shard: per_shard,
        sized_connections_per_shard,
        shard_connection_limit,
        shards_per_node: shards_per_node as i32,
        nodes: nodes as i32,
        capacity: shards * sized_connections_per_shard,
        connections_per_node,
        bytes_per_connection: BytesPerConnection {
            user: inputs.user,
            kernel: inputs.kernel_idle + inputs.queued_bytes,
            total: inputs.user + inputs.kernel_idle + inputs.queued_bytes,
        },
        memory_limit_bytes: inputs.memory_limit(shard_connection_limit),
        cgroup_mode: inputs.cgroup_mode,
        pod_bytes_per_connection: inputs.pod_bytes_per_connection(),
        process_bytes: inputs.process_bytes(shard_connection_limit),
        slow_readers_per_shard: inputs.slow_readers(shard_connection_limit),
        slow_reader_bytes: inputs.slow_reader_bytes(),
        cpus: cpus as i32,
        workers: cpus as i32,
        nofile,
        node_nofile_hard_limit: node
            .runtime
            .nofile_hard_limit
            .unwrap_or(DEFAULT_NOFILE_HARD_LIMIT),
        server_raises_nofile: raises_own_nofile(spec, &node.runtime),
        listen_backlog,
        limiting_factor,
        sysctls,
        sysctls_not_applied,
        sysctls_capped,
        drain_rate,
        drain_seconds: drain.seconds,
        rollout_surge: rollout.surge as i32,
        rollout_step_seconds: rollout.step_seconds,
        termination_grace_period_seconds: drain.grace,
        drain_cut_by_policy: drain.cut,
        node_memory_bytes: node.memory_bytes,
        node_cpus: node.cpus as i32,
        node_pods: node.pods.clamp(0, i32::MAX as i64) as i32,
        node_source: None,
        user_bytes_source: Some(if spec.backend.user_bytes_per_connection.is_some() {
            FigureSource::Spec
        } else {
            FigureSource::Model
        }),
        failure_domain: inputs.failure_domain,
        failure_domain_shards: lost as i32,
        refill_seconds: inputs.refill_seconds(shards, lost),
        shape_source: ShapeSource::Spec,
        alternative_shapes: Vec::new(),
        cost_per_million_connections_monthly: price
            .map(|p| round_cents(p * HOURS_PER_MONTH / (connections_per_node as f64 / 1e6))),
        actual_cost_per_million_connections_monthly: monthly_cost
            .map(|m| round_cents(m / (inputs.connections as f64 / 1e6))),
        monthly_cost: monthly_cost.map(round_cents),
    };
    // Self-check: a plan that breaks one of its own constraints is never returned.
    let violated = check(spec, &plan);
    if !violated.is_empty() {
        return Err(PlanError::Infeasible(format!(
            "internal: plan violates {violated:?}; please report this spec"
        )));
    }
    Ok(plan)
}

/// [`plan_under`] on a node profile from [`super::nodes::resolve_sourced`]:
/// the plan also says where its node's sizes came from (`nodeSource`).
pub fn plan_sourced(
    spec: &ConnectionFleetSpec,
    (node, source): (NodeFacts, NodeSource),
    policy: &Policy,
) -> Result<Plan, PlanError> {
    let mut plan = plan_under(spec, node, policy)?;
    plan.node_source = Some(source);
    Ok(plan)
}

/// [`plan_sourced`] for a fleet in a cluster, planned by the operator:
/// `spec.node`'s per-connection kernel claims are used only where they
/// cannot under-count what a connection costs the node
/// ([`super::nodes::trusted_kernel_claims`]: `kernelBytesPerSocket` at
/// least the measured default, `conntrack: false` only under a policy with
/// `conntrack: false`), and `nodeSource` says whether each was. Offline
/// plans ([`plan_sourced`]) take them as given.
pub fn plan_in_cluster(
    spec: &ConnectionFleetSpec,
    (node, source): (NodeFacts, NodeSource),
    policy: &Policy,
) -> Result<Plan, PlanError> {
    let (trusted, kernel, conntrack) = super::nodes::trusted_kernel_claims(spec, !policy.conntrack);
    let source = NodeSource {
        kernel_bytes_per_socket: kernel,
        conntrack,
        ..source
    };
    plan_sourced(&trusted, (node, source), policy)
}

/// The `tcp_mem` pressure threshold (pages) the plan's nodes run with: the
/// plan's raised value, else the kernel default for the node.
pub fn tcp_mem_pressure_pages(plan: &Plan) -> i64 {
    plan.sysctls.get(&Sysctl::TcpMem).map_or_else(
        || KernelDefaults::for_node(plan.node_memory_bytes, plan.node_cpus as i64).tcp_mem[1],
        |v| v.limit(),
    )
}

/// Steps a shard's size is rounded to: 1/16 of the most one shard holds
/// (at most 6.25 % of a full shard's memory left unused by rounding).
pub const SIZE_STEPS: i64 = 16;

/// `n` rounded up to the next step of `max` ÷ [`SIZE_STEPS`], at most `max`.
pub fn size_step(n: i64, max: i64) -> i64 {
    let step = ceil_div(max, SIZE_STEPS).max(1);
    (ceil_div(n, step) * step).min(max)
}

/// Hours in a billing month, as cloud price sheets count them (8,760 h ÷ 12).
pub const HOURS_PER_MONTH: f64 = 730.0;

/// Constraints a finished plan violates on its own nodes, checking raisable
/// limits against the plan's sysctls (empty when the plan is sound). Used by
/// the tests and as a self-check before a plan is applied.
pub fn check(spec: &ConnectionFleetSpec, plan: &Plan) -> Vec<LimitingFactor> {
    let node = NodeFacts {
        memory_bytes: plan.node_memory_bytes,
        cpus: plan.node_cpus as i64,
        pods: i64::MAX,
        runtime: NodeRuntime {
            nofile_hard_limit: Some(plan.node_nofile_hard_limit),
            sys_resource: plan.server_raises_nofile,
            // Unused: the plan's own sysctls are checked.
            host_network_namespace: true,
            unsafe_sysctls: None,
            cgroup_mode: Some(plan.cgroup_mode),
        },
    };
    let Ok(valid) = validate(spec) else {
        return vec![];
    };
    let inputs = Inputs::new(
        spec,
        valid.user_bytes,
        plan.cpus as i64,
        node,
        SysctlCeilings::default(),
    );
    // The most shards the scheduler may put on one node (the spread is
    // required only under a Node domain).
    let packed = (plan.connections_per_node / plan.max_connections_per_shard.max(1))
        .clamp(1, plan.shards.max(1) as i64);
    let mut violated = inputs.violations(
        plan.sized_connections_per_shard,
        packed,
        Some(&plan.sysctls),
    );
    if plan.limiting_factor != LimitingFactor::MaxShards
        && let Some(gap) =
            inputs.availability_gap(plan.shards as i64, packed, plan.shard_connection_limit)
    {
        violated.push(gap);
    }
    violated
}

impl Inputs {
    /// Resolves the model's inputs from a validated spec (model defaults for
    /// unset fields), its backend's `user` bytes per connection, the shard's
    /// `cpus` and the policy's sysctl `ceilings`.
    fn new(
        spec: &ConnectionFleetSpec,
        user: i64,
        cpus: i64,
        node: NodeFacts,
        ceilings: SysctlCeilings,
    ) -> Inputs {
        let node_profile = spec.node.clone().unwrap_or_default();
        let tracked = node_profile.conntrack.unwrap_or(true);
        let kernel_socket = node_profile
            .kernel_bytes_per_socket
            .unwrap_or(KERNEL_BYTES_PER_SOCKET);
        let mode = cgroup_mode(spec, &node.runtime);
        let bundled = spec.backend.model == BackendModel::Epoll;
        Inputs {
            connections: spec.connections,
            user,
            base: if bundled {
                BUNDLED_PROCESS_BASE_BYTES
            } else {
                PROCESS_BASE_BYTES
            },
            partial: partial_budget_bytes(spec, cpus),
            kernel_idle: kernel_socket + if tracked { CONNTRACK_BYTES } else { 0 },
            pod_kernel_idle: match mode {
                CgroupMode::V2 => kernel_socket,
                CgroupMode::V1 => kernel_socket.min(POD_KERNEL_BYTES_PER_SOCKET_V1),
            },
            queued_bytes: ceil_div(spec.backend.queued_percent as i64 * PAGE_BYTES, 100),
            buffers_in_pod: mode == CgroupMode::V2,
            slow_percent: spec.backend.slow_reader_percent as i64,
            slow_kernel: if bounds_socket_buffers(spec) {
                SLOW_READER_KERNEL_BYTES
            } else {
                SLOW_READER_KERNEL_BYTES_UNBOUNDED
            },
            // Other servers' buffering is in their userBytesPerConnection.
            slow_user: if bundled { SLOW_READER_USER_BYTES } else { 0 },
            headroom: spec.shard.headroom_percent as i64,
            cpus,
            fd_reserve: fd_reserve(cpus),
            nofile_hard: nofile_ceiling(spec, &node.runtime),
            connections_per_cpu: spec.backend.connections_per_cpu,
            queued_percent: spec.backend.queued_percent as i64,
            tracked,
            raise_node_sysctls: raises_node_sysctls(spec, &node.runtime),
            cgroup_mode: mode,
            failure_domain: spec.availability.failure_domain,
            refill_budget: spec.availability.refill_budget_seconds as i64,
            node,
            defaults: KernelDefaults::for_node(node.memory_bytes, node.cpus),
            ceilings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::sysctl::SysctlValue;
    use proptest::prelude::*;

    const NODE: NodeFacts = NodeFacts {
        memory_bytes: 256 << 30,
        cpus: 64,
        pods: 110,
        runtime: crate::plan::NodeRuntime::UNKNOWN,
    };

    /// A spec from JSON; without `availability`, one that plans no spare
    /// capacity (`failureDomain: None`), and without `shard.cpus`, 8-CPU
    /// shards, so that the per-node limits of one shape are what a test
    /// sees. Availability and the free shape have their own tests.
    fn spec(mut v: serde_json::Value) -> ConnectionFleetSpec {
        if v.get("availability").is_none() {
            v["availability"] = serde_json::json!({"failureDomain": "None"});
        }
        if v.pointer("/shard/cpus").is_none() {
            if v.get("shard").is_none() {
                v["shard"] = serde_json::json!({});
            }
            v["shard"]["cpus"] = serde_json::json!(8);
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn epoll_10m_on_64_cpu_256_gib_is_memory_bound_without_slow_readers() {
        let s = spec(serde_json::json!({
            "connections": 10_000_000,
            "node": {"pricePerHour": "2.59"},
            "backend": {"slowReaderPercent": 0}
        }));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Memory);
        assert_eq!(p.bytes_per_connection.user, EPOLL_USER_BYTES);
        // 3965 socket + 256 conntrack + 10 % × 4096 queued page share.
        assert_eq!(p.bytes_per_connection.kernel, 3965 + 256 + 410);
        assert_eq!(p.shards_per_node, 2);
        assert_eq!(p.nodes, 1);
        assert_eq!(p.shards as i64 * p.connections_per_shard, 10_000_000);
        assert_eq!(p.connections_per_shard, 5_000_000);
        let step = ceil_div(p.max_connections_per_shard, SIZE_STEPS);
        assert_eq!(
            p.sized_connections_per_shard,
            ceil_div(5_000_000, step) * step
        );
        assert_eq!(
            p.shard_connection_limit,
            ceil_div(p.sized_connections_per_shard * 100, 80)
        );
        assert_eq!(p.nofile, p.shard_connection_limit + fd_reserve(8));
        assert_eq!(p.sysctls[&Sysctl::NrOpen], SysctlValue::One(p.nofile));
        assert_eq!(p.sysctls[&Sysctl::Somaxconn], SysctlValue::One(65535));
        assert_eq!(p.monthly_cost, Some(1890.70));
        // Node capacity at 80 % of 256 GiB ÷ ~4,695 B (4,651 per connection
        // and each shard's process allowance) ≈ 46.8M connections.
        let expect = (256u64 << 30) as f64 * 0.8 / 4695.0;
        assert!(
            (p.connections_per_node as f64 - expect).abs() / expect < 0.01,
            "{}",
            p.connections_per_node
        );
    }

    #[test]
    fn slow_readers_bind_tcp_mem_at_the_policy_ceiling() {
        // The default 1 % slow readers each pin 34 pages of bounded
        // buffers: with queued pages that is ~0.44 pages per connection at
        // the cap, and the policy's tcp_mem ceiling (2^24 pages, pressure
        // 2/3 of it) binds before node memory does.
        let s = spec(serde_json::json!({"connections": 10_000_000}));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::TcpMem);
        assert_eq!(
            p.sysctls_capped,
            Sysctls::from([(Sysctl::TcpMem, SysctlValue::One(1 << 24))])
        );
        assert_eq!(ceil_div(SLOW_READER_KERNEL_BYTES, PAGE_BYTES), 34);
        let pressure = (1i64 << 24) * 2 / 3;
        let per_connection = 0.10 + 0.01 * 34.0;
        let expect = pressure as f64 / per_connection * 0.8;
        assert!(
            (p.connections_per_node as f64 - expect).abs() / expect < 0.01,
            "{} vs {expect}",
            p.connections_per_node
        );
        assert!(check(&s, &p).is_empty());
    }

    /// The memory limit the model gives a shard, recomputed from the
    /// plan's own figures: process allowance (base, unfinished-input
    /// budget, fd table), idle connections, queued pages and slow readers,
    /// the buffers only under cgroup v2.
    fn expected_limit(p: &Plan, partial: i64, queued_percent: i64) -> i64 {
        let l = p.shard_connection_limit;
        let v2 = p.cgroup_mode == CgroupMode::V2;
        let buffers = |b: i64| if v2 { b } else { 0 };
        // The bundled server's base when it has a partial budget.
        let base = if partial > 0 {
            BUNDLED_PROCESS_BASE_BYTES
        } else {
            PROCESS_BASE_BYTES
        };
        let bytes = base
            + partial
            + fd_table_bytes(p.nofile)
            + l * p.pod_bytes_per_connection.total
            + buffers(ceil_div(l * queued_percent, 100) * PAGE_BYTES)
            + p.slow_readers_per_shard
                * (p.slow_reader_bytes.user + buffers(p.slow_reader_bytes.kernel));
        ceil_div(bytes, 1 << 20) * (1 << 20)
    }

    #[test]
    fn shard_memory_holds_the_unfinished_input_budget_of_its_workers() {
        // Issue 10, fault 10: what clients that stop mid-frame can make the
        // bundled server hold is its per-worker budget, a per-shard amount.
        for cpus in [1, 2, 8] {
            let s = spec(serde_json::json!({
                "connections": 1_000_000,
                "shard": {"cpus": cpus, "minShards": 4}
            }));
            let p = plan(&s, NODE).unwrap();
            assert_eq!(
                p.process_bytes,
                BUNDLED_PROCESS_BASE_BYTES + i64::from(cpus) * (8 << 20) + fd_table_bytes(p.nofile)
            );
            assert_eq!(
                p.memory_limit_bytes,
                expected_limit(&p, i64::from(cpus) * (8 << 20), 10),
                "{cpus} CPUs"
            );
            assert_eq!(
                p.bytes_per_connection.user, EPOLL_USER_BYTES,
                "not per connection"
            );
            assert!(check(&s, &p).is_empty());
        }
        // Other servers' buffering is theirs to declare.
        let s = spec(serde_json::json!({
            "connections": 1_000_000,
            "shard": {"cpus": 2, "minShards": 4},
            "backend": {"model": "custom", "userBytesPerConnection": 100}
        }));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.slow_reader_bytes.user, 0);
        assert_eq!(p.memory_limit_bytes, expected_limit(&p, 0, 10));
    }

    #[test]
    fn the_pod_charge_follows_the_cgroup_mode() {
        // Issue 8: cgroup v2 charges the whole socket and its buffers to
        // the pod; v1 without socket accounting only ~1,485 B of it.
        let at = |mode: &str| {
            let s = spec(serde_json::json!({
                "connections": 100_000,
                "node": {"cgroupMode": mode},
                "shard": {"cpus": 1},
                "availability": {"failureDomain": "None"}
            }));
            let p = plan(&s, NODE).unwrap();
            assert!(check(&s, &p).is_empty());
            p
        };
        let (v2, v1) = (at("v2"), at("v1"));
        assert_eq!(
            (v2.cgroup_mode, v1.cgroup_mode),
            (CgroupMode::V2, CgroupMode::V1)
        );
        assert_eq!(v2.pod_bytes_per_connection.kernel, KERNEL_BYTES_PER_SOCKET);
        assert_eq!(
            v1.pod_bytes_per_connection.kernel,
            POD_KERNEL_BYTES_PER_SOCKET_V1
        );
        assert_eq!(v2.memory_limit_bytes, expected_limit(&v2, 8 << 20, 10));
        assert_eq!(v1.memory_limit_bytes, expected_limit(&v1, 8 << 20, 10));
        assert!(v2.memory_limit_bytes > v1.memory_limit_bytes);
        // The node pays the same either way: what v1 leaves out of the pod
        // is counted outside it.
        assert_eq!(v2.bytes_per_connection, v1.bytes_per_connection);
        // Slow readers: 1 % of the cap, bounded buffers, the server's tail.
        assert_eq!(
            v2.slow_readers_per_shard,
            ceil_div(v2.shard_connection_limit, 100)
        );
        assert_eq!(v2.slow_reader_bytes.kernel, SLOW_READER_KERNEL_BYTES);
        assert_eq!(v2.slow_reader_bytes.user, SLOW_READER_USER_BYTES);
        assert_eq!(
            v2.sysctls[&Sysctl::TcpWmem],
            SysctlValue::Triple([4096, 16_384, SOCKET_BUFFER_MAX_BYTES])
        );
        assert_eq!(v2.sysctls[&Sysctl::TcpRmem], v2.sysctls[&Sysctl::TcpWmem]);
    }

    #[test]
    fn unbounded_buffers_charge_what_a_slow_reader_pins_by_default() {
        let s = spec(serde_json::json!({
            "connections": 100_000,
            "sysctls": {"mode": "None"},
            "shard": {"cpus": 1}
        }));
        let p = plan(&s, NODE).unwrap();
        assert!(!p.sysctls.contains_key(&Sysctl::TcpRmem));
        assert_eq!(
            p.slow_reader_bytes.kernel,
            SLOW_READER_KERNEL_BYTES_UNBOUNDED
        );
        assert!(check(&s, &p).is_empty());
    }

    #[test]
    fn the_fleet_survives_its_largest_failure_domain() {
        let at = |domain: &str| {
            let s = spec(serde_json::json!({
                "connections": 10_000_000,
                "shard": {"cpus": 8},
                "availability": {"failureDomain": domain}
            }));
            let p = plan(&s, NODE).unwrap();
            assert!(check(&s, &p).is_empty(), "{domain}: {:?}", check(&s, &p));
            p
        };
        let node = at("Node");
        assert!(node.nodes >= 2);
        assert_eq!(node.failure_domain_shards, node.shards_per_node);
        let survivors = (node.shards - node.failure_domain_shards) as i64;
        assert!(survivors * node.shard_connection_limit >= 10_000_000);
        assert!(node.refill_seconds <= 60);
        let shard = at("Shard");
        assert_eq!(shard.failure_domain_shards, 1);
        assert!((shard.shards as i64 - 1) * shard.shard_connection_limit >= 10_000_000);
        let none = at("None");
        assert_eq!(none.failure_domain_shards, 0);
        assert!(none.shards <= shard.shards && shard.shards <= node.shards);
        // A tight refill budget adds shards (more workers re-accept).
        let s = spec(serde_json::json!({
            "connections": 10_000_000,
            "shard": {"cpus": 8},
            "availability": {"refillBudgetSeconds": 1}
        }));
        let p = plan(&s, NODE).unwrap();
        assert!(p.refill_seconds <= 1, "{}", p.refill_seconds);
        assert!(p.shards > node.shards);
        assert_eq!(p.limiting_factor, LimitingFactor::Refill);
    }

    #[test]
    fn edge_plans_found_by_a_fresh_user() {
        let p256 = serde_json::json!({"memory": "256Gi", "cpus": 64, "pricePerHour": "2.59"});
        // A node hard limit outside the schema's range is refused naming
        // the field (it used to panic with no limit binding).
        let s: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 1000,
            "backend": {"model": "custom", "userBytesPerConnection": 0, "slowReaderPercent": 0, "queuedPercent": 0},
            "node": {"memory": "1Pi", "cpus": 1, "kernelBytesPerSocket": 0, "conntrack": false, "nofileHardLimit": 100_000_000_000i64}
        }))
        .unwrap();
        let err = plan(&s, NODE).unwrap_err().to_string();
        assert!(err.contains("spec.node.nofileHardLimit"), "{err}");
        // When maxShards stops every shape, the one holding the most wins.
        let s: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 50_000_000,
            "node": p256,
            "shard": {"minShards": 2, "maxShards": 2}
        }))
        .unwrap();
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        assert!(
            p.alternative_shapes
                .iter()
                .all(|a| a.capacity <= p.capacity),
            "{p:?}"
        );
        // A shape that survives its node beats one that does not at the same cost.
        let s: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 10_000_000,
            "node": p256,
            "shard": {"minShards": 2, "maxShards": 2}
        }))
        .unwrap();
        let p = plan(&s, NODE).unwrap();
        assert_ne!(p.limiting_factor, LimitingFactor::MaxShards, "{p:?}");
        assert!(check(&s, &p).is_empty());
        // The Node domain's second node is named even with no shard added.
        let s: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 3_000_000,
            "node": p256,
            "shard": {"cpus": 8}
        }))
        .unwrap();
        let p = plan(&s, NODE).unwrap();
        assert_eq!(
            (p.nodes, p.limiting_factor),
            (2, LimitingFactor::FailureDomain)
        );
        // An alternative that holds less is never "much cheaper".
        let s: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 10_000_000_000i64,
            "node": p256,
            "availability": {"failureDomain": "None"},
            "shard": {"cpus": 64, "maxShards": 492}
        }))
        .unwrap();
        let p = plan(&s, NODE).unwrap();
        for alt in &p.alternative_shapes {
            assert!(!is_much_cheaper(alt, &p, s.connections), "{alt:?}");
        }
    }

    #[test]
    fn a_v1_claim_is_not_trusted_in_a_cluster() {
        // v1 charges a pod less: only the nodes' label makes a plan v1.
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "node": {"cgroupMode": "v1", "memory": "256Gi", "cpus": 64}}),
        );
        let resolve = crate::plan::nodes::resolve_sourced;
        // Offline the claim is the planner's own.
        let offline = plan_sourced(&s, resolve(&s, None).unwrap(), &Policy::default()).unwrap();
        assert_eq!(offline.cgroup_mode, CgroupMode::V1);
        // In a cluster, through the operator's path: the profile resolved
        // from unlabelled nodes and the spec, then planned as a cluster's.
        let cluster =
            plan_in_cluster(&s, resolve(&s, Some(NODE)).unwrap(), &Policy::default()).unwrap();
        assert_eq!(cluster.cgroup_mode, CgroupMode::V2);
        let labelled = NodeFacts {
            runtime: NodeRuntime {
                cgroup_mode: Some(CgroupMode::V1),
                ..NodeRuntime::UNKNOWN
            },
            ..NODE
        };
        let cluster =
            plan_in_cluster(&s, resolve(&s, Some(labelled)).unwrap(), &Policy::default()).unwrap();
        assert_eq!(cluster.cgroup_mode, CgroupMode::V1);
    }

    #[test]
    fn the_planner_picks_the_cheapest_shape() {
        // Issue 8 "done when": 10M goroutine connections on 64-CPU /
        // 256 GiB / $2.59 nodes with the shape left free cost at most
        // 1.25 × the seed's $189 per 1M per month.
        let free: ConnectionFleetSpec = serde_json::from_value(serde_json::json!({
            "connections": 10_000_000,
            "backend": {"model": "goroutine"},
            "node": {"pricePerHour": "2.59"}
        }))
        .unwrap();
        let p = plan(&free, NODE).unwrap();
        assert_eq!(p.shape_source, ShapeSource::Planner);
        assert!(check(&free, &p).is_empty());
        let price = p.cost_per_million_connections_monthly.unwrap();
        assert!(price <= 1.25 * 189.0, "{price}");
        assert_eq!(
            p.actual_cost_per_million_connections_monthly,
            Some(((p.monthly_cost.unwrap() / 10.0) * 100.0).round() / 100.0)
        );
        // Every alternative costs at least as much.
        assert!(!p.alternative_shapes.is_empty());
        for alt in &p.alternative_shapes {
            assert!(
                (alt.nodes, Reverse(alt.connections_per_node))
                    >= (p.nodes, Reverse(p.connections_per_node)),
                "{alt:?}"
            );
        }
        // The 8-CPU shape the user might guess: nofile binds at 524,288,
        // and the planner's shape is named as much cheaper.
        let fixed = spec(serde_json::json!({
            "connections": 10_000_000,
            "backend": {"model": "goroutine"},
            "node": {"pricePerHour": "2.59"},
            "shard": {"cpus": 8}
        }));
        let f = plan(&fixed, NODE).unwrap();
        assert_eq!(f.shape_source, ShapeSource::Spec);
        assert!(f.nofile <= DEFAULT_NOFILE_HARD_LIMIT);
        let best = &f.alternative_shapes[0];
        assert_eq!(best.cpus, p.cpus);
        assert!(is_much_cheaper(best, &f, 10_000_000));
        assert!(!is_much_cheaper(&p.alternative_shapes[0], &p, 10_000_000));
    }

    #[test]
    fn small_changes_of_connections_keep_the_pod_template() {
        let at = |c: i64| {
            plan(
                &spec(serde_json::json!({"connections": c, "shard": {"minShards": 3}})),
                NODE,
            )
            .unwrap()
        };
        let (a, b) = (at(1_000_000), at(1_100_000));
        assert_eq!(a.shards, b.shards);
        assert_ne!(a.connections_per_shard, b.connections_per_shard);
        assert_eq!(
            (a.shard_connection_limit, a.memory_limit_bytes, a.nofile),
            (b.shard_connection_limit, b.memory_limit_bytes, b.nofile)
        );
        // A larger step does resize the shards.
        assert!(at(3_000_000).memory_limit_bytes > a.memory_limit_bytes);
    }

    #[test]
    fn goroutine_is_bounded_by_the_runtime_nofile_limit() {
        let s =
            spec(serde_json::json!({"connections": 10_000_000, "backend": {"model": "goroutine"}}));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Nofile);
        assert!(p.nofile <= DEFAULT_NOFILE_HARD_LIMIT);
        assert_eq!(p.shards_per_node, 8);
        assert_eq!(p.nodes, 3);
        assert!(!p.sysctls.contains_key(&Sysctl::NrOpen));
    }

    #[test]
    fn custom_needs_user_bytes() {
        let s = spec(serde_json::json!({"connections": 10, "backend": {"model": "custom"}}));
        let err = plan(&s, NODE).unwrap_err().to_string();
        assert!(err.contains("spec.backend.userBytesPerConnection"), "{err}");
        let s = spec(
            serde_json::json!({"connections": 10, "backend": {"model": "custom", "userBytesPerConnection": 1000}}),
        );
        assert_eq!(plan(&s, NODE).unwrap().bytes_per_connection.user, 1000);
    }

    #[test]
    fn max_shards_caps_and_reports() {
        let s = spec(
            serde_json::json!({"connections": 10_000_000, "backend": {"model": "goroutine"}, "shard": {"maxShards": 4}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        assert_eq!(p.shards, 4);
        assert!(p.capacity < 10_000_000);
    }

    #[test]
    fn pod_security_context_mode_keeps_node_defaults_and_reports_unsafe() {
        let s = spec(
            serde_json::json!({"connections": 2_000_000, "sysctls": {"mode": "PodSecurityContext"}}),
        );
        let p = plan(&s, NODE).unwrap();
        // Only the kubelet-safe socket buffer bounds.
        assert_eq!(
            p.sysctls.keys().copied().collect::<Vec<_>>(),
            [Sysctl::TcpRmem, Sysctl::TcpWmem]
        );
        assert_eq!(
            p.sysctls_not_applied,
            vec![
                Sysctl::Somaxconn,
                Sysctl::TcpMaxSynBacklog,
                Sysctl::TcpMigrateReq
            ]
        );
        assert_eq!(p.listen_backlog, DEFAULT_SOMAXCONN);
        // Without raising sysctls, the default conntrack table (1,048,576) binds.
        assert_eq!(p.limiting_factor, LimitingFactor::Conntrack);
        let s = spec(
            serde_json::json!({"connections": 2_000_000, "sysctls": {"mode": "PodSecurityContext", "allowedUnsafe": ["net.core.somaxconn"]}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(
            p.sysctls.get(&Sysctl::Somaxconn),
            Some(&SysctlValue::One(65535))
        );
        assert_eq!(p.listen_backlog, LISTEN_BACKLOG);

        // Issue 9: an allowedUnsafe sysctl the nodes' kubelets do not allow
        // is reported, never rendered (the pod would be SysctlForbidden).
        let s = spec(
            serde_json::json!({"connections": 2_000_000, "sysctls": {"mode": "PodSecurityContext", "allowedUnsafe": ["net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog"]}}),
        );
        let strict = NodeFacts {
            runtime: NodeRuntime {
                unsafe_sysctls: Some(super::super::SysctlSet::from_kubelet_list(
                    "net.core.somaxconn",
                )),
                ..NodeRuntime::UNKNOWN
            },
            ..NODE
        };
        let p = plan(&s, strict).unwrap();
        assert_eq!(
            p.sysctls.keys().copied().collect::<Vec<_>>(),
            vec![Sysctl::Somaxconn, Sysctl::TcpRmem, Sysctl::TcpWmem]
        );
        assert_eq!(
            p.sysctls_not_applied,
            vec![Sysctl::TcpMaxSynBacklog, Sysctl::TcpMigrateReq]
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(
            p.sysctls.keys().copied().collect::<Vec<_>>(),
            vec![
                Sysctl::Somaxconn,
                Sysctl::TcpMaxSynBacklog,
                Sysctl::TcpRmem,
                Sysctl::TcpWmem
            ]
        );

        let s = spec(
            serde_json::json!({"connections": 1, "sysctls": {"mode": "PodSecurityContext", "allowedUnsafe": ["net.ipv4.tcp_mem"]}}),
        );
        assert!(
            plan(&s, NODE)
                .unwrap_err()
                .to_string()
                .contains("spec.sysctls.allowedUnsafe")
        );
    }

    #[test]
    fn tcp_mem_binds_when_it_cannot_be_raised() {
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"queuedPercent": 100, "slowReaderPercent": 0},
            "node": {"conntrack": false}, "sysctls": {"mode": "None"}}),
        );
        let small = NodeFacts {
            memory_bytes: 8 << 30,
            cpus: 64,
            pods: 110,
            runtime: crate::plan::NodeRuntime::UNKNOWN,
        };
        let p = plan(&s, small).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::TcpMem);
        // Raised instead in InitContainer mode.
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"queuedPercent": 100, "slowReaderPercent": 0}, "node": {"conntrack": false}}),
        );
        let p = plan(&s, small).unwrap();
        assert!(p.sysctls.contains_key(&Sysctl::TcpMem));
        assert_ne!(p.limiting_factor, LimitingFactor::TcpMem);
    }

    #[test]
    fn cpu_binds_with_a_per_cpu_rate() {
        let s = spec(
            serde_json::json!({"connections": 1_000_000, "backend": {"connectionsPerCpu": 10000}}),
        );
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::Cpu);
        assert!(p.shard_connection_limit <= 80_000);
    }

    /// Issue 10 inputs: a schema-valid `connectionsPerCpu` used to overflow
    /// (a panic in debug builds, 1000 shards × 6 connections in release).
    #[test]
    fn huge_connections_per_cpu_is_refused_naming_the_field() {
        for c in [i64::MAX, 2_305_843_009_213_693_953, 10_000_000_001] {
            let s = spec(
                serde_json::json!({"connections": 1_000_000, "backend": {"connectionsPerCpu": c}}),
            );
            let err = plan(&s, NODE).unwrap_err().to_string();
            assert!(err.contains("spec.backend.connectionsPerCpu"), "{err}");
        }
        // At the bound it plans, and CPU does not bind.
        let s = spec(serde_json::json!({"connections": 1_000_000,
            "backend": {"connectionsPerCpu": 10_000_000_000i64}}));
        let p = plan(&s, NODE).unwrap();
        assert_ne!(p.limiting_factor, LimitingFactor::Cpu);
        assert_eq!(p.shards as i64 * p.connections_per_shard, 1_000_000);
    }

    /// Another unbounded product of the same kind: cap × bytes for a 1 GiB
    /// custom backend at the connection bound passes `i64`.
    #[test]
    fn largest_custom_backend_does_not_overflow() {
        let s = spec(serde_json::json!({"connections": 10_000_000_000i64,
            "backend": {"model": "custom", "userBytesPerConnection": 1_073_741_824},
            "shard": {"headroomPercent": 90, "maxShards": 100_000}}));
        let p = plan(&s, NODE).unwrap();
        assert_eq!(p.limiting_factor, LimitingFactor::MaxShards);
        assert!(check(&s, &p).is_empty());
    }

    #[test]
    fn infeasible_shard_is_an_error_naming_the_field() {
        let s = spec(serde_json::json!({"connections": 10, "shard": {"cpus": 128}}));
        assert!(
            plan(&s, NODE)
                .unwrap_err()
                .to_string()
                .contains("spec.shard.cpus")
        );
    }

    fn policy_with(ceilings: serde_json::Value) -> Policy {
        Policy::from_yaml(&serde_json::json!({"sysctlCeilings": ceilings}).to_string()).unwrap()
    }

    /// Issue 13: node-level sysctls are raised at most to the admin's
    /// ceilings. The shards are sized to fit under them (more shards, more
    /// nodes), the plan stays sound, and it names the ceiling that binds.
    #[test]
    fn policy_ceilings_cap_node_sysctls_and_the_plan_fits_under_them() {
        let s = spec(
            serde_json::json!({"connections": 10_000_000, "backend": {"slowReaderPercent": 0}}),
        );
        let free = plan(&s, NODE).unwrap();
        assert!(
            free.sysctls_capped.is_empty(),
            "the defaults do not bind here"
        );
        let conntrack = free.sysctls[&Sysctl::NfConntrackMax].limit();
        assert!(conntrack > 2_000_000, "{conntrack}");

        let policy = policy_with(serde_json::json!({"net.netfilter.nf_conntrack_max": 2_000_000}));
        let p = plan_under(&s, NODE, &policy).unwrap();
        assert!(check(&s, &p).is_empty(), "{:?}", check(&s, &p));
        assert!(p.sysctls[&Sysctl::NfConntrackMax].limit() <= 2_000_000);
        assert_eq!(p.limiting_factor, LimitingFactor::Conntrack);
        assert_eq!(
            p.sysctls_capped,
            Sysctls::from([(Sysctl::NfConntrackMax, SysctlValue::One(2_000_000))])
        );
        assert!(p.shards > free.shards && p.shards as i64 * p.connections_per_shard >= 10_000_000);

        // fs.nr_open caps a shard's descriptors, so its size.
        let policy = policy_with(serde_json::json!({"fs.nr_open": 2_000_000}));
        let p = plan_under(&s, NODE, &policy).unwrap();
        assert!(check(&s, &p).is_empty());
        assert!(p.nofile <= 2_000_000, "{}", p.nofile);
        assert_eq!(p.sysctls[&Sysctl::NrOpen], SysctlValue::One(p.nofile));
        assert_eq!(p.limiting_factor, LimitingFactor::Nofile);
        assert!(p.sysctls_capped.contains_key(&Sysctl::NrOpen));

        // fs.file-max, less the reserve the node keeps for itself.
        let policy = policy_with(serde_json::json!({"fs.file-max": 4_000_000}));
        let p = plan_under(&s, NODE, &policy).unwrap();
        assert!(check(&s, &p).is_empty());
        let file_max = p.sysctls.get(&Sysctl::FileMax).map_or(0, |v| v.limit());
        assert!(file_max <= 4_000_000, "{file_max}");
        assert!(p.sysctls_capped.contains_key(&Sysctl::FileMax), "{p:?}");

        // tcp_mem: every component under the ceiling, pressure included.
        let small = NodeFacts {
            memory_bytes: 8 << 30,
            cpus: 64,
            pods: 110,
            runtime: crate::plan::NodeRuntime::UNKNOWN,
        };
        let queued = spec(serde_json::json!({"connections": 1_000_000,
            "backend": {"queuedPercent": 100}, "node": {"conntrack": false}}));
        let free = plan(&queued, small).unwrap();
        let SysctlValue::Triple([_, pressure, _]) = free.sysctls[&Sysctl::TcpMem] else {
            panic!("tcp_mem is raised without a tight ceiling")
        };
        let ceiling = pressure; // below the 1.5 × pressure the free plan's max needs
        let policy = policy_with(serde_json::json!({"net.ipv4.tcp_mem": ceiling}));
        let p = plan_under(&queued, small, &policy).unwrap();
        assert!(check(&queued, &p).is_empty());
        if let Some(SysctlValue::Triple(c)) = p.sysctls.get(&Sysctl::TcpMem) {
            let default = KernelDefaults::for_node(small.memory_bytes, small.cpus).tcp_mem;
            for (v, d) in c.iter().zip(default) {
                assert!(*v <= ceiling.max(d), "{c:?}");
            }
        }
        assert_eq!(p.limiting_factor, LimitingFactor::TcpMem);
        assert!(p.sysctls_capped.contains_key(&Sysctl::TcpMem));
    }

    /// What a fleet claims about its node (`spec.node`) no longer sets
    /// node-wide limits without bound: the claims of issue 13 stay under
    /// the default ceilings.
    #[test]
    fn made_up_node_profiles_raise_nothing_past_the_default_ceilings() {
        let policy = Policy::default();
        let c = policy.sysctl_ceilings;
        let mut planned = 0;
        for node in [
            serde_json::json!({"memory": "1Pi", "cpus": 1, "kernelBytesPerSocket": 0}),
            serde_json::json!({"memory": "671Mi", "cpus": 1, "kernelBytesPerSocket": 0}),
            serde_json::json!({"memory": "64Mi", "cpus": 1, "kernelBytesPerSocket": 0, "conntrack": false}),
        ] {
            let s = spec(serde_json::json!({
                "connections": 10_000_000_000i64,
                "backend": {"model": "custom", "userBytesPerConnection": 0, "queuedPercent": 100},
                "node": node,
                "shard": {"cpus": 1, "headroomPercent": 0, "maxShards": 100_000}
            }));
            let facts = super::super::nodes::resolve(&s, None).unwrap();
            let Ok(p) = plan_under(&s, facts, &policy) else {
                continue;
            };
            planned += 1;
            assert!(check(&s, &p).is_empty(), "{node}");
            let d = KernelDefaults::for_node(facts.memory_bytes, facts.cpus);
            for (sysctl, value) in &p.sysctls {
                if let Some(ceiling) = super::super::sysctl::ceiling(&c, *sysctl) {
                    for (v, d) in value.components().iter().zip(d.value(*sysctl).components()) {
                        assert!(*v <= ceiling.max(d), "{node}: {sysctl}={value}");
                    }
                }
            }
        }
        assert!(planned >= 2, "only {planned} of the claims planned");
    }

    /// Issue 13: in a cluster, node-level raises are sized from the real
    /// node, never from a fleet's claim. A 1 PiB, 100,000-CPU claim on
    /// 8 GiB, 4-CPU nodes: planned as claimed (offline, where the claim is
    /// all there is) the nodes' conntrack table would go to the policy's
    /// ceiling; on the nodes, it goes to what two 2-CPU shards on one of
    /// them hold, the same as for a fleet claiming nothing.
    #[test]
    fn node_level_raises_follow_the_real_node_not_the_claim() {
        use crate::api::status::NodeValueSource::ClusterBelowSpec;
        use crate::plan::nodes::{resolve, resolve_sourced};
        let claim = spec(serde_json::json!({
            "connections": 100_000_000,
            "node": {"memory": "1Pi", "cpus": 100_000},
            "shard": {"cpus": 2},
            "backend": {"slowReaderPercent": 0}
        }));
        let small = NodeFacts {
            memory_bytes: 8 << 30,
            cpus: 4,
            pods: 110,
            runtime: NodeRuntime::UNKNOWN,
        };
        let policy = Policy::default();
        let conntrack = |p: &Plan| p.sysctls[&Sysctl::NfConntrackMax].limit();

        let claimed =
            plan_sourced(&claim, resolve_sourced(&claim, None).unwrap(), &policy).unwrap();
        assert_eq!(claimed.node_memory_bytes, 1 << 50);
        assert_eq!(conntrack(&claimed), 67_108_800);
        assert!(claimed.sysctls_capped.contains_key(&Sysctl::NfConntrackMax));

        let real = plan_sourced(
            &claim,
            resolve_sourced(&claim, Some(small)).unwrap(),
            &policy,
        )
        .unwrap();
        assert!(check(&claim, &real).is_empty());
        assert_eq!(
            (real.node_memory_bytes, real.node_cpus, real.node_pods),
            (8 << 30, 4, 110)
        );
        let source = real.node_source.unwrap();
        assert_eq!(
            (source.memory, source.cpus),
            (ClusterBelowSpec, ClusterBelowSpec)
        );
        assert_eq!(real.shards_per_node, 2);
        assert_eq!(conntrack(&real), 1_828_430);
        assert!(real.sysctls_capped.is_empty(), "{:?}", real.sysctls_capped);

        let mut unclaimed = claim.clone();
        unclaimed.node = None;
        let plain = plan_under(
            &unclaimed,
            resolve(&unclaimed, Some(small)).unwrap(),
            &policy,
        )
        .unwrap();
        assert_eq!(real.sysctls, plain.sysctls);
        assert_eq!(
            plain.node_source, None,
            "plan_under says nothing of sources"
        );
    }

    /// Issue 13: in a cluster, a fleet claiming cheaper connections than
    /// the operator can check (0 kernel bytes per socket, no conntrack) is
    /// planned as if it claimed nothing: the same connections per node and
    /// the same node-level raises; offline the claim is the planner's and
    /// is used as given.
    #[test]
    fn cheap_kernel_claims_are_not_trusted_in_a_cluster() {
        use crate::api::status::ClaimSource::{Spec, SpecNotTrusted};
        use crate::plan::nodes::resolve_sourced;
        let node = NodeFacts {
            memory_bytes: 8 << 30,
            cpus: 4,
            pods: 110,
            runtime: NodeRuntime::UNKNOWN,
        };
        let claim = spec(serde_json::json!({
            "connections": 10_000_000,
            "node": {"kernelBytesPerSocket": 0, "conntrack": false},
            "shard": {"cpus": 2}
        }));
        let mut unclaimed = claim.clone();
        unclaimed.node = None;
        let policy = Policy::default();
        let sourced = |s: &ConnectionFleetSpec| resolve_sourced(s, Some(node)).unwrap();

        let offline = plan_sourced(&claim, sourced(&claim), &policy).unwrap();
        assert_eq!(
            offline.bytes_per_connection.kernel, 410,
            "only the queued share"
        );
        let source = offline.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (None, None)
        );

        let plain = plan_in_cluster(&unclaimed, sourced(&unclaimed), &policy).unwrap();
        let real = plan_in_cluster(&claim, sourced(&claim), &policy).unwrap();
        assert_eq!(real.bytes_per_connection.kernel, 3965 + 256 + 410);
        assert_eq!(real.bytes_per_connection, plain.bytes_per_connection);
        assert_eq!(real.connections_per_node, plain.connections_per_node);
        assert!(offline.connections_per_node > real.connections_per_node * 2);
        assert_eq!(real.sysctls, plain.sysctls);
        assert_eq!(real.memory_limit_bytes, plain.memory_limit_bytes);
        let source = real.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (Some(SpecNotTrusted), Some(SpecNotTrusted))
        );
        assert_eq!(plain.node_source.unwrap().conntrack, None);
        assert!(check(&unclaimed, &real).is_empty());

        // Under a policy saying the nodes track no connections, conntrack:
        // false is used (no conntrack bytes, no nf_conntrack_max raise);
        // the socket bytes still are not.
        let untracked = Policy {
            conntrack: false,
            ..Policy::default()
        };
        let p = plan_in_cluster(&claim, sourced(&claim), &untracked).unwrap();
        assert_eq!(p.bytes_per_connection.kernel, 3965 + 410);
        assert!(!p.sysctls.contains_key(&Sysctl::NfConntrackMax));
        let source = p.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (Some(SpecNotTrusted), Some(Spec))
        );
        // A claim dearer than measured is the fleet's to make.
        let dear = spec(serde_json::json!({
            "connections": 10_000_000,
            "node": {"kernelBytesPerSocket": 8000, "conntrack": true},
            "shard": {"cpus": 2}
        }));
        let p = plan_in_cluster(&dear, sourced(&dear), &policy).unwrap();
        assert_eq!(p.bytes_per_connection.kernel, 8000 + 256 + 410);
        let source = p.node_source.unwrap();
        assert_eq!(
            (source.kernel_bytes_per_socket, source.conntrack),
            (Some(Spec), Some(Spec))
        );
    }

    fn arb_spec() -> impl Strategy<Value = (ConnectionFleetSpec, NodeFacts)> {
        (
            1i64..=2_000_000_000,
            prop_oneof![Just("epoll"), Just("goroutine"), Just("custom")],
            0i64..=200_000,
            0i32..=100,
            prop_oneof![Just(1), Just(2), Just(4), Just(8), Just(16)],
            0i32..=90,
            prop_oneof![Just("InitContainer"), Just("PodSecurityContext"), Just("None")],
            any::<bool>(),
            (1i64..=1024, 4i64..=1024, 1i32..=200),
            (proptest::option::of(1024i64..=4_000_000), any::<bool>(), any::<bool>()),
            (
                prop_oneof![Just("Node"), Just("Shard"), Just("None")],
                0i32..=100,
                1i32..=3600,
                prop_oneof![Just(CgroupMode::V1), Just(CgroupMode::V2)],
            ),
        )
            .prop_map(|(c, model, user, queued, cpus, headroom, mode, tracked, (gib, ncpu, min_shards), (nofile, sys_resource, netns), (domain, slow, refill, cgroup))| {
                let s = spec(serde_json::json!({
                    "connections": c,
                    "backend": {"model": model, "userBytesPerConnection": user, "queuedPercent": queued, "slowReaderPercent": slow},
                    "node": {"conntrack": tracked},
                    "shard": {"cpus": cpus, "headroomPercent": headroom, "minShards": min_shards, "maxShards": 100000},
                    "sysctls": {"mode": mode},
                    "availability": {"failureDomain": domain, "refillBudgetSeconds": refill},
                }));
                let runtime = NodeRuntime {
                    nofile_hard_limit: nofile,
                    sys_resource,
                    host_network_namespace: netns,
                    unsafe_sysctls: None,
                    cgroup_mode: Some(cgroup),
                };
                (s, NodeFacts { memory_bytes: gib << 30, cpus: ncpu.max(cpus as i64), pods: 110, runtime })
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn every_constraint_holds_and_sysctls_only_raise((s, node) in arb_spec()) {
            let Ok(p) = plan(&s, node) else { return Ok(()); };
            prop_assert!(check(&s, &p).is_empty(), "violations {:?}", check(&s, &p));
            prop_assert!(p.shards as i64 * p.connections_per_shard >= s.connections.min(p.capacity));
            prop_assert!(p.shards >= s.shard.min_shards);
            prop_assert!(p.shards_per_node as i64 * p.cpus as i64 <= node.cpus);
            prop_assert!(p.nofile <= nofile_ceiling(&s, &node.runtime));
            if !p.server_raises_nofile {
                prop_assert!(p.nofile <= p.node_nofile_hard_limit);
            }
            if !node.runtime.host_network_namespace {
                prop_assert!(
                    p.sysctls.keys().all(|s| s.scope() == crate::api::sysctl::Scope::Namespaced),
                    "node-level sysctls on a node whose host netns is closed: {:?}", p.sysctls
                );
            }
            let defaults = KernelDefaults::for_node(node.memory_bytes, node.cpus);
            for (sysctl, value) in &p.sysctls {
                if matches!(sysctl, Sysctl::TcpRmem | Sysctl::TcpWmem) {
                    // Bounds, not raises: what a slow reader may pin.
                    prop_assert_eq!(*value, super::super::sysctl::socket_buffers());
                    continue;
                }
                let d = defaults.value(*sysctl);
                prop_assert!(value.raises(d), "{sysctl}={value} does not raise {d}");
            }
            // Headroom: at the declared load each shard uses at most (100 − h) % of its cap.
            prop_assert!(p.connections_per_shard * 100 <= p.shard_connection_limit * (100 - s.shard.headroom_percent as i64));
            // Availability: the survivors of the largest failure domain hold
            // every declared connection, and re-accept the lost ones in budget.
            if p.limiting_factor != LimitingFactor::MaxShards && p.failure_domain != FailureDomain::None {
                let survivors = (p.shards - p.failure_domain_shards) as i64;
                prop_assert!(p.failure_domain_shards >= 1);
                prop_assert!(survivors as i128 * p.shard_connection_limit as i128 >= s.connections as i128);
                prop_assert!(p.refill_seconds <= s.availability.refill_budget_seconds as i64);
                if p.failure_domain == FailureDomain::Node {
                    prop_assert!(p.nodes >= 2 && p.failure_domain_shards == p.shards_per_node);
                }
            }
            // Slow readers and the pod charge follow the spec and the mode.
            prop_assert_eq!(p.slow_readers_per_shard, ceil_div(p.shard_connection_limit * s.backend.slow_reader_percent as i64, 100));
            prop_assert!(p.memory_limit_bytes >= p.process_bytes + p.shard_connection_limit * p.pod_bytes_per_connection.total);
        }

        /// With the shape left free the plan is sound, and no alternative
        /// shape it lists ranks before it.
        #[test]
        fn a_free_shape_is_sound_and_the_cheapest((s, node) in arb_spec()) {
            let mut free = s.clone();
            free.shard.cpus = None;
            let Ok(p) = plan(&free, node) else { return Ok(()); };
            prop_assert_eq!(p.shape_source, ShapeSource::Planner);
            prop_assert!(check(&free, &p).is_empty(), "violations {:?}", check(&free, &p));
            for alt in &p.alternative_shapes {
                prop_assert!(alt.cpus != p.cpus);
                let key = |short: bool, capacity: i64, nodes: i32, per_node: i64| {
                    (short, Reverse(if short { capacity } else { 0 }), nodes, Reverse(per_node))
                };
                let short = |f: LimitingFactor| f == LimitingFactor::MaxShards;
                prop_assert!(
                    key(short(alt.limiting_factor), alt.capacity, alt.nodes, alt.connections_per_node)
                        >= key(short(p.limiting_factor), p.capacity, p.nodes, p.connections_per_node),
                    "{:?} ranks before the chosen shape", alt
                );
            }
        }

        #[test]
        fn shards_never_decrease_as_slow_readers_grow((s, node) in arb_spec(), extra in 0i32..=100) {
            let Ok(a) = plan(&s, node) else { return Ok(()); };
            let mut slower = s.clone();
            slower.backend.slow_reader_percent = (s.backend.slow_reader_percent + extra).min(100);
            let Ok(b) = plan(&slower, node) else { return Ok(()); };
            prop_assert!(b.shards >= a.shards, "{} < {}", b.shards, a.shards);
        }

        /// Under any ceilings the plan is sound, raises only, and never
        /// asks for more than a ceiling (or the kernel default above it).
        #[test]
        fn node_sysctls_stay_under_any_ceilings(
            (s, node) in arb_spec(),
            (nr_open, file_max, tcp_mem, conntrack) in (1i64..=1 << 31, 1i64..=1 << 34, 1i64..=1 << 30, 1i64..=1 << 31),
        ) {
            let policy = Policy {
                sysctl_ceilings: SysctlCeilings { nr_open, file_max, tcp_mem_pages: tcp_mem, nf_conntrack_max: conntrack, max_user_watches: file_max },
                ..Policy::default()
            };
            let Ok(p) = plan_under(&s, node, &policy) else { return Ok(()); };
            prop_assert!(check(&s, &p).is_empty(), "violations {:?}", check(&s, &p));
            let defaults = KernelDefaults::for_node(node.memory_bytes, node.cpus);
            for (sysctl, value) in &p.sysctls {
                let d = defaults.value(*sysctl);
                if sysctl.scope() == crate::api::sysctl::Scope::Node {
                    prop_assert!(value.raises(d), "{sysctl}={value} does not raise {d}");
                }
                if let Some(c) = super::super::sysctl::ceiling(&policy.sysctl_ceilings, *sysctl) {
                    for (v, d) in value.components().iter().zip(d.components()) {
                        prop_assert!(*v <= c.max(d), "{sysctl}={value} above ceiling {c}");
                    }
                }
            }
            for sysctl in p.sysctls_capped.keys() {
                prop_assert!(super::super::sysctl::ceiling(&policy.sysctl_ceilings, *sysctl).is_some());
            }
        }

        #[test]
        fn limiting_factor_is_the_one_that_binds((s, node) in arb_spec()) {
            let Ok(p) = plan(&s, node) else { return Ok(()); };
            if matches!(p.limiting_factor, LimitingFactor::MaxShards | LimitingFactor::FailureDomain | LimitingFactor::Refill) {
                return Ok(());
            }
            // One more connection per shard at the node's full packing breaks the named limit.
            let inputs = Inputs::new(&s, validate(&s).unwrap().user_bytes, p.cpus as i64, node, SysctlCeilings::default());
            let per_shard = p.max_connections_per_shard;
            let v = inputs.violations(per_shard + 1, p.connections_per_node / per_shard, None);
            prop_assert_eq!(v.first().copied(), Some(p.limiting_factor));
        }

        #[test]
        fn shards_never_decrease_as_connections_grow((s, node) in arb_spec(), extra in 0i64..1_000_000_000) {
            let Ok(a) = plan(&s, node) else { return Ok(()); };
            let mut bigger = s.clone();
            bigger.connections = (s.connections + extra).min(crate::api::MAX_CONNECTIONS);
            let b = plan(&bigger, node).unwrap();
            prop_assert!(b.shards >= a.shards);
            prop_assert!(b.nodes >= a.nodes);
        }

        #[test]
        fn shards_never_decrease_as_bytes_grow((s, node) in arb_spec(), extra in 0i64..100_000) {
            let Ok(a) = plan(&s, node) else { return Ok(()); };
            let mut heavier = s.clone();
            heavier.backend.user_bytes_per_connection = Some(a.bytes_per_connection.user + extra);
            let Ok(b) = plan(&heavier, node) else { return Ok(()); };
            prop_assert!(b.shards >= a.shards, "{} < {}", b.shards, a.shards);
        }
    }
}
