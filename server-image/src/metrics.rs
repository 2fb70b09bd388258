//! Prometheus metrics (OpenMetrics text via `prometheus-client`).
//!
//! Every name follows Prometheus conventions (base units, `_total` on
//! counters) and the exposition passes `promtool check metrics`; an
//! integration test runs promtool against the live endpoint.
//!
//! Hot paths never touch a `Family` (a lock and a hash per lookup): each
//! worker takes its own [`WorkerMetrics`] handles once, at start, and those
//! are plain atomics shared with the registry.

use std::fmt;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::conn::CloseReason;

/// Exposition formats [`Metrics::encode`] can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text, what `prometheus-client` writes natively and
    /// what Prometheus asks for first in its `Accept` header.
    OpenMetrics,
    /// The classic Prometheus text format 0.0.4, for every other client
    /// (curl, `promtool check metrics`): counter families are named with
    /// their `_total` suffix and there are no `# UNIT`/`# EOF` lines.
    PrometheusText,
}

impl Format {
    /// Picks the format for a request's `Accept` header: OpenMetrics when the
    /// client lists it, the Prometheus text format otherwise.
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::PrometheusText,
        }
    }

    /// The `Content-Type` of this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::PrometheusText => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Rewrites OpenMetrics text (as `prometheus-client` writes it) into the
/// Prometheus text format 0.0.4: in OpenMetrics a counter family `x` has
/// samples `x_total`, while the older format (and `promtool check metrics`)
/// wants `# HELP`/`# TYPE` to name `x_total` itself. `# UNIT` and `# EOF`
/// lines do not exist there and are dropped. Sample lines are unchanged.
pub fn openmetrics_to_prometheus_text(om: &str) -> String {
    let counters: Vec<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        if let Some((prefix, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(&name) {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(tail);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Why a connection was accepted and closed at once
/// (`c10m_connections_rejected_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The connection cap was reached.
    Capacity,
    /// The process ran out of file descriptors (`EMFILE`/`ENFILE`); the
    /// connection was taken off the queue with the worker's spare descriptor
    /// and closed.
    FdLimit,
    /// The server is draining: during its accept window a new connection is
    /// answered with a protocol goodbye and closed ([`crate::door`]).
    Draining,
    /// A rollout's admission limit (`POST /limit`) was reached, below the
    /// cap.
    Limit,
}

impl RejectReason {
    /// Every reason, in label order.
    pub const ALL: [RejectReason; 4] = [Self::Capacity, Self::FdLimit, Self::Draining, Self::Limit];

    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Capacity => "capacity",
            Self::FdLimit => "fd_limit",
            Self::Draining => "draining",
            Self::Limit => "limit",
        }
    }
}

/// Why the admin port dropped a connection without answering it
/// (`c10m_admin_connections_dropped_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdminDrop {
    /// Over the bound on concurrent admin connections.
    Limit,
    /// The request was not complete (or the answer not taken) in time.
    Deadline,
}

impl AdminDrop {
    /// Every reason, in label order.
    pub const ALL: [AdminDrop; 2] = [Self::Limit, Self::Deadline];

    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Limit => "limit",
            Self::Deadline => "deadline",
        }
    }
}

impl EncodeLabelValue for AdminDrop {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Label set `{reason="..."}` for admin connections dropped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AdminDropLabel {
    /// Why the connection was dropped.
    pub reason: AdminDrop,
}

impl EncodeLabelValue for CloseReason {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for RejectReason {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), fmt::Error> {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Label set `{worker="N"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct WorkerLabel {
    /// Worker index, 0-based.
    pub worker: u32,
}

/// Label set `{reason="..."}` for closes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CloseLabel {
    /// Why the connection closed.
    pub reason: CloseReason,
}

/// Label set `{reason="..."}` for rejections.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RejectLabel {
    /// Why the connection was rejected.
    pub reason: RejectReason,
}

/// Label set `{state="..."}` for `c10m_tcp_sockets`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SockLabel {
    /// `inuse`, `orphan`, `tw` or `alloc` (the fields of /proc/net/sockstat).
    pub state: &'static str,
}

/// Label set `{name="...",field="..."}` for `c10m_kernel_sysctl`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SysctlLabel {
    /// Sysctl name, e.g. `net.ipv4.tcp_mem`.
    pub name: &'static str,
    /// Field of a multi-value sysctl (`min`, `pressure`, `max`, ...) or `value`.
    pub field: &'static str,
}

/// The name to register a metric with `unit` under so that it is exported
/// as `exported`: `prometheus-client` appends the unit (`_bytes`) itself.
fn unit_base<'a>(exported: &'a str, unit: &Unit) -> &'a str {
    exported
        .strip_suffix(unit.as_str())
        .and_then(|n| n.strip_suffix('_'))
        .unwrap_or_else(|| panic!("{exported:?} does not end in _{}", unit.as_str()))
}

/// All server metrics and the registry that exposes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    connections: Family<WorkerLabel, Gauge>,
    closing: Family<WorkerLabel, Gauge>,
    accepted: Family<WorkerLabel, Counter>,
    received: Family<WorkerLabel, Counter>,
    sent: Family<WorkerLabel, Counter>,
    partial: Family<WorkerLabel, Gauge>,
    closed: Family<CloseLabel, Counter>,
    rejected: Family<RejectLabel, Counter>,
    /// `c10m_connections_capacity`: the connection cap in force, in
    /// connections (after lowering it to fit the descriptor limit).
    pub capacity: Gauge,
    /// `c10m_connections_limit`: the connections admitted now, at most:
    /// the cap, or a rollout's lower limit in force (`POST /limit`).
    pub limit: Gauge,
    /// `c10m_fd_limit`: RLIMIT_NOFILE soft limit in force, in descriptors.
    pub fd_limit: Gauge,
    /// `c10m_draining`: 1 once SIGTERM/SIGINT started the drain, else 0.
    pub draining: Gauge,
    /// `c10m_cordoned`: 1 while cordoned by `POST /cordon`, else 0.
    pub cordoned: Gauge,
    /// `c10m_workers`: worker threads (one listener and event loop each).
    pub workers: Gauge,
    /// `c10m_close_pending`: connections still to close on the current
    /// `POST /shed` or drain order (0 when none is running).
    pub close_pending: Gauge,
    tcp_sockets: Family<SockLabel, Gauge>,
    tcp_memory: Gauge,
    resident: Gauge,
    sysctl: Family<SysctlLabel, Gauge>,
    /// `c10m_cpu_pinned`: 1 when the workers are pinned one per CPU (the
    /// affinity mask holds exactly one CPU per worker), 0 when the kernel
    /// schedules them ([`crate::limits::pinning`]).
    pub cpu_pinned: Gauge,
    admin_dropped: Family<AdminDropLabel, Counter>,
    process_uid: Gauge,
    process_gid: Gauge,
    process_capabilities: Gauge,
}

/// One worker's metric handles: atomics shared with the registry, so
/// updating them costs one atomic add and no lookup.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    /// Live connections held by this worker, not counting those in their
    /// close handshake.
    pub connections: Gauge,
    /// Connections of this worker in their close handshake (the server's
    /// close sent and counted, the peer's awaited).
    pub closing: Gauge,
    /// Connections this worker admitted.
    pub accepted: Counter,
    /// Bytes read from connections.
    pub received_bytes: Counter,
    /// Bytes written to connections.
    pub sent_bytes: Counter,
    /// Bytes held for unfinished WebSocket frames and upgrade requests.
    pub partial_bytes: Gauge,
    closed: [Counter; CloseReason::ALL.len()],
    rejected: [Counter; RejectReason::ALL.len()],
}

impl WorkerMetrics {
    /// The closed-connections counter for `reason` (process-wide).
    pub fn closed(&self, reason: CloseReason) -> &Counter {
        &self.closed[reason as usize]
    }

    /// The rejected-connections counter for `reason` (process-wide).
    pub fn rejected(&self, reason: RejectReason) -> &Counter {
        &self.rejected[reason as usize]
    }
}

impl Metrics {
    /// Registers every metric, with a series per worker and per reason so
    /// that each exists (at 0) from the first scrape.
    pub fn new(workers: u32) -> Self {
        let mut m = Metrics {
            connections: Family::default(),
            closing: Family::default(),
            accepted: Family::default(),
            received: Family::default(),
            sent: Family::default(),
            partial: Family::default(),
            closed: Family::default(),
            rejected: Family::default(),
            capacity: Gauge::default(),
            limit: Gauge::default(),
            fd_limit: Gauge::default(),
            draining: Gauge::default(),
            cordoned: Gauge::default(),
            workers: Gauge::default(),
            close_pending: Gauge::default(),
            tcp_sockets: Family::default(),
            tcp_memory: Gauge::default(),
            resident: Gauge::default(),
            sysctl: Family::default(),
            cpu_pinned: Gauge::default(),
            admin_dropped: Family::default(),
            process_uid: Gauge::default(),
            process_gid: Gauge::default(),
            process_capabilities: Gauge::default(),
            registry: Registry::default(),
        };
        let registry = &mut m.registry;
        registry.register(
            c10m_wire::metrics::CONNECTIONS,
            "Live connections held, per worker (not those in their close handshake: c10m_connections_closing)",
            m.connections.clone(),
        );
        registry.register(
            "c10m_connections_closing",
            "Connections in their close handshake, per worker: the server sent its close (already counted in c10m_connections_closed_total) and waits for the client's, at most --close-timeout-secs",
            m.closing.clone(),
        );
        registry.register(
            "c10m_connections_accepted",
            "Connections accepted and held, per worker",
            m.accepted.clone(),
        );
        registry.register(
            "c10m_connections_closed",
            "Held connections closed, by reason (peer, reset, timeouts, protocol errors, ...; see the server README)",
            m.closed.clone(),
        );
        registry.register(
            "c10m_connections_rejected",
            "Connections accepted and closed at once, by reason (capacity, fd_limit, draining, limit)",
            m.rejected.clone(),
        );
        registry.register(
            "c10m_connections_capacity",
            "Cap on live connections in this process",
            m.capacity.clone(),
        );
        registry.register(
            "c10m_connections_limit",
            "Connections admitted now, at most: the cap, or a rollout's lower limit in force (POST /limit)",
            m.limit.clone(),
        );
        registry.register(
            "c10m_fd_limit",
            "RLIMIT_NOFILE soft limit in force, in file descriptors",
            m.fd_limit.clone(),
        );
        registry.register(
            "c10m_draining",
            "1 while the server drains after SIGTERM or SIGINT, else 0",
            m.draining.clone(),
        );
        registry.register(
            "c10m_cordoned",
            "1 while the shard is cordoned (POST /cordon: not ready, held connections kept), else 0",
            m.cordoned.clone(),
        );
        registry.register(
            "c10m_workers",
            "Worker threads, each with its own SO_REUSEPORT listener",
            m.workers.clone(),
        );
        registry.register_with_unit(
            "c10m_received",
            "Bytes read from connections, per worker",
            Unit::Bytes,
            m.received.clone(),
        );
        registry.register_with_unit(
            "c10m_sent",
            "Bytes written to connections, per worker",
            Unit::Bytes,
            m.sent.clone(),
        );
        registry.register_with_unit(
            "c10m_partial",
            "Bytes held for unfinished WebSocket frames and upgrade requests, per worker (bounded by --partial-budget-bytes)",
            Unit::Bytes,
            m.partial.clone(),
        );
        registry.register(
            "c10m_close_pending",
            "Connections still to close under the running drain or shed order",
            m.close_pending.clone(),
        );
        registry.register(
            "c10m_tcp_sockets",
            "TCP sockets from /proc/net/sockstat by state (inuse and tw per network namespace, orphan and alloc node-wide)",
            m.tcp_sockets.clone(),
        );
        registry.register_with_unit(
            unit_base(c10m_wire::metrics::TCP_MEMORY_BYTES, &Unit::Bytes),
            "Memory charged against net.ipv4.tcp_mem (node-wide, /proc/net/sockstat TCP mem times the page size)",
            Unit::Bytes,
            m.tcp_memory.clone(),
        );
        registry.register(
            "c10m_kernel_sysctl",
            "Kernel settings read at start, by sysctl name and field (tcp_mem in pages, tcp_rmem and tcp_wmem in bytes, somaxconn, nr_open and epoll max_user_watches in counts)",
            m.sysctl.clone(),
        );
        registry.register(
            "c10m_cpu_pinned",
            "1 if the workers are pinned one per CPU (the affinity mask holds exactly one CPU per worker), 0 if the kernel schedules them",
            m.cpu_pinned.clone(),
        );
        registry.register(
            "c10m_admin_connections_dropped",
            "Admin port connections closed without an answer, by reason (limit: over the bound on concurrent connections; deadline: request not complete in time)",
            m.admin_dropped.clone(),
        );
        registry.register(
            "c10m_process_uid",
            "Effective user id the server serves as (after the drop to C10M_RUN_AS, if set)",
            m.process_uid.clone(),
        );
        registry.register(
            "c10m_process_gid",
            "Effective group id the server serves as (after the drop to C10M_RUN_AS, if set)",
            m.process_gid.clone(),
        );
        registry.register(
            "c10m_process_capabilities_effective",
            "Effective capability set of the server as a bitmask (CapEff); 0 when it holds no capabilities, -1 if unreadable",
            m.process_capabilities.clone(),
        );
        // The process collector's conventional name, so stock dashboards work.
        registry.register_with_unit(
            "process_resident_memory",
            "Resident memory of the server process",
            Unit::Bytes,
            m.resident.clone(),
        );
        for state in ["inuse", "orphan", "tw", "alloc"] {
            m.tcp_sockets.get_or_create_owned(&SockLabel { state });
        }
        for w in 0..workers {
            let l = WorkerLabel { worker: w };
            m.connections.get_or_create_owned(&l);
            m.closing.get_or_create_owned(&l);
            m.accepted.get_or_create_owned(&l);
            m.received.get_or_create_owned(&l);
            m.sent.get_or_create_owned(&l);
            m.partial.get_or_create_owned(&l);
        }
        for reason in CloseReason::ALL {
            m.closed.get_or_create_owned(&CloseLabel { reason });
        }
        for reason in RejectReason::ALL {
            m.rejected.get_or_create_owned(&RejectLabel { reason });
        }
        for reason in AdminDrop::ALL {
            m.admin_dropped
                .get_or_create_owned(&AdminDropLabel { reason });
        }
        m.workers.set(i64::from(workers));
        m
    }

    /// Handles for worker `worker`.
    pub fn worker(&self, worker: u32) -> WorkerMetrics {
        let l = WorkerLabel { worker };
        WorkerMetrics {
            connections: self.connections.get_or_create_owned(&l),
            closing: self.closing.get_or_create_owned(&l),
            accepted: self.accepted.get_or_create_owned(&l),
            received_bytes: self.received.get_or_create_owned(&l),
            sent_bytes: self.sent.get_or_create_owned(&l),
            partial_bytes: self.partial.get_or_create_owned(&l),
            closed: CloseReason::ALL
                .map(|reason| self.closed.get_or_create_owned(&CloseLabel { reason })),
            rejected: RejectReason::ALL
                .map(|reason| self.rejected.get_or_create_owned(&RejectLabel { reason })),
        }
    }

    /// The admin port's dropped-connections counter for `reason`.
    pub fn admin_dropped(&self, reason: AdminDrop) -> Counter {
        self.admin_dropped
            .get_or_create_owned(&AdminDropLabel { reason })
    }

    /// The rejected-connections counter for `reason`, for code outside the
    /// workers (the drain's accept window).
    pub fn rejected(&self, reason: RejectReason) -> Counter {
        self.rejected.get_or_create_owned(&RejectLabel { reason })
    }

    /// Records the effective uid, gid and capability set of the calling
    /// thread (system calls, not `/proc`); called at start, after the drop
    /// to `C10M_RUN_AS`.
    pub fn set_identity(&self) {
        self.process_uid
            .set(i64::from(rustix::process::geteuid().as_raw()));
        self.process_gid
            .set(i64::from(rustix::process::getegid().as_raw()));
        let caps = rustix::thread::capabilities(None)
            .ok()
            .and_then(|c| i64::try_from(c.effective.bits()).ok())
            .unwrap_or(-1);
        self.process_capabilities.set(caps);
    }

    /// Records the kernel settings read at start (see
    /// [`crate::system::read_sysctls`]).
    pub fn set_sysctls(&self, values: &[(&'static str, &'static str, i64)]) {
        for &(name, field, v) in values {
            self.sysctl
                .get_or_create_owned(&SysctlLabel { name, field })
                .set(v);
        }
    }

    /// Re-reads what the kernel reports (sockstat, resident memory); called
    /// before each scrape.
    pub fn refresh_system(&self) {
        if let Some(s) = crate::system::sockstat() {
            let set = |state, v: u64| {
                self.tcp_sockets
                    .get_or_create_owned(&SockLabel { state })
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            };
            set("inuse", s.inuse);
            set("orphan", s.orphan);
            set("tw", s.tw);
            set("alloc", s.alloc);
            self.tcp_memory
                .set(i64::try_from(s.mem_pages * crate::system::PAGE_BYTES).unwrap_or(i64::MAX));
        }
        if let Some(rss) = crate::system::resident_bytes() {
            self.resident.set(i64::try_from(rss).unwrap_or(i64::MAX));
        }
    }

    /// The exposition in `format` (see [`Format::content_type`]).
    pub fn encode(&self, format: Format) -> String {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        match format {
            Format::OpenMetrics => out,
            Format::PrometheusText => openmetrics_to_prometheus_text(&out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_index_their_arrays() {
        for (i, r) in CloseReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, r) in RejectReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, r) in AdminDrop::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
    }

    #[test]
    fn exposition_has_every_series() {
        let m = Metrics::new(2);
        m.capacity.set(19_960);
        m.fd_limit.set(20_000);
        let w1 = m.worker(1);
        w1.connections.inc();
        w1.connections.inc();
        w1.accepted.inc_by(3);
        w1.closed(CloseReason::Reset).inc();
        w1.rejected(RejectReason::Capacity).inc_by(5);
        w1.received_bytes.inc_by(10);
        let text = m.encode(Format::OpenMetrics);
        for line in [
            "# TYPE c10m_connections gauge",
            "c10m_connections{worker=\"0\"} 0",
            "c10m_connections{worker=\"1\"} 2",
            "# TYPE c10m_connections_closing gauge",
            "c10m_connections_closing{worker=\"0\"} 0",
            "c10m_connections_closing{worker=\"1\"} 0",
            "# TYPE c10m_connections_accepted counter",
            "c10m_connections_accepted_total{worker=\"1\"} 3",
            "c10m_connections_closed_total{reason=\"reset\"} 1",
            "c10m_connections_closed_total{reason=\"shutdown\"} 0",
            "c10m_connections_rejected_total{reason=\"capacity\"} 5",
            "c10m_connections_rejected_total{reason=\"fd_limit\"} 0",
            "c10m_connections_capacity 19960",
            "c10m_connections_limit 0",
            "c10m_connections_rejected_total{reason=\"limit\"} 0",
            "c10m_fd_limit 20000",
            "c10m_draining 0",
            "c10m_cordoned 0",
            "c10m_workers 2",
            "# UNIT c10m_received_bytes bytes",
            "c10m_received_bytes_total{worker=\"1\"} 10",
            "c10m_sent_bytes_total{worker=\"0\"} 0",
            "# TYPE c10m_partial_bytes gauge",
            "c10m_partial_bytes{worker=\"1\"} 0",
            "c10m_connections_closed_total{reason=\"frame_timeout\"} 0",
            "c10m_connections_closed_total{reason=\"budget\"} 0",
            "c10m_connections_closed_total{reason=\"ping_timeout\"} 0",
            "c10m_connections_closed_total{reason=\"unreachable\"} 0",
            "c10m_connections_rejected_total{reason=\"draining\"} 0",
            "# TYPE c10m_cpu_pinned gauge",
            "c10m_cpu_pinned 0",
            "# TYPE c10m_admin_connections_dropped counter",
            "c10m_admin_connections_dropped_total{reason=\"limit\"} 0",
            "c10m_admin_connections_dropped_total{reason=\"deadline\"} 0",
            "# TYPE c10m_process_uid gauge",
            "# TYPE c10m_process_gid gauge",
            "# TYPE c10m_process_capabilities_effective gauge",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
    }

    /// What the operator compares with its plan (kernel drift): every sysctl
    /// read at start, one series per field, beside `c10m_fd_limit`.
    #[test]
    fn kernel_settings_are_exported_by_name_and_field() {
        let m = Metrics::new(1);
        m.fd_limit.set(1_024);
        m.set_sysctls(&crate::system::read_sysctls(std::path::Path::new("/proc")));
        let text = m.encode(Format::PrometheusText);
        assert!(text.lines().any(|l| l == "c10m_fd_limit 1024"), "{text}");
        for (name, fields) in crate::system::SYSCTLS {
            for field in *fields {
                let series = format!("c10m_kernel_sysctl{{name=\"{name}\",field=\"{field}\"}} ");
                assert!(
                    text.lines().any(|l| l.starts_with(&series)),
                    "missing {series:?} in:\n{text}"
                );
            }
        }
    }

    #[test]
    fn prometheus_text_names_counters_with_total() {
        let m = Metrics::new(1);
        m.worker(0).accepted.inc();
        let text = m.encode(Format::PrometheusText);
        for line in [
            "# HELP c10m_connections_accepted_total Connections accepted and held, per worker.",
            "# TYPE c10m_connections_accepted_total counter",
            "c10m_connections_accepted_total{worker=\"0\"} 1",
            "# TYPE c10m_connections gauge",
            "# TYPE c10m_received_bytes_total counter",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("# UNIT"));
        assert!(!text.contains("# TYPE c10m_connections_accepted counter"));
    }

    #[test]
    fn names_the_operator_queries_are_exported_as_in_the_wire() {
        use c10m_wire::metrics::{CONNECTIONS, TCP_MEMORY_BYTES};
        let m = Metrics::new(1);
        for format in [Format::OpenMetrics, Format::PrometheusText] {
            let text = m.encode(format);
            for line in [
                format!("# TYPE {CONNECTIONS} gauge"),
                format!("{CONNECTIONS}{{worker=\"0\"}} 0"),
                format!("# TYPE {TCP_MEMORY_BYTES} gauge"),
                format!("{TCP_MEMORY_BYTES} 0"),
            ] {
                assert!(
                    text.lines().any(|l| l == line),
                    "missing {line:?} in:\n{text}"
                );
            }
        }
    }

    #[test]
    fn negotiates_format() {
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prom)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("*/*")), Format::PrometheusText);
        assert_eq!(Format::negotiate(None), Format::PrometheusText);
    }
}
