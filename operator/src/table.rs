//! Human-readable plan tables for `c10m-operator plan -o table` and `make demo`.

use comfy_table::{Table, presets::NOTHING};

use crate::api::Plan;
use crate::api::sysctl::join_names;
use crate::calibrate::Summary;
use crate::plan::calibration::Bytes;

fn bytes(b: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {} ({b} B)", UNITS[u])
    }
}

/// `c10m-operator calibrate -o table`: the measured figures against the
/// model, each step's figure, the plan before and after, and the
/// `spec.backend` to paste for a fixed figure.
pub fn calibration_table(s: &Summary) -> String {
    let m = &s.measured;
    let mut out = format!(
        "CALIBRATION {} on node {} ({} cgroups, sockets {}accounted), {:.0} s\nimage {} ({})\n\n",
        s.fleet,
        s.node,
        m.cgroup_mode,
        if m.socket_accounted { "" } else { "not " },
        s.seconds,
        s.image,
        s.image_id,
    );
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(vec!["BYTES", "USER", "KERNEL", "POD"]);
    let model = &s.model.per_connection;
    t.add_row(vec![
        "model, per idle connection".into(),
        model.user.to_string(),
        model.kernel.to_string(),
        model.total.to_string(),
    ]);
    let row = |label: String, b: &Bytes| {
        vec![
            label,
            format!("{:.0}", b.user),
            format!("{:.0}", b.kernel),
            format!("{:.0}", b.pod),
        ]
    };
    t.add_row(row(
        format!("measured, per idle connection (fit to {})", m.connections),
        &m.per_connection,
    ));
    for step in &m.steps {
        t.add_row(row(
            format!("  at {} connections", step.connections),
            &step.per_connection,
        ));
    }
    if let Some(slow) = &m.per_slow_reader {
        let model = &s.model.per_slow_reader;
        t.add_row(vec![
            "model, per slow reader".into(),
            model.user.to_string(),
            model.kernel.to_string(),
            model.total.to_string(),
        ]);
        t.add_row(row(
            format!("measured, per slow reader ({})", m.slow_readers),
            slow,
        ));
    }
    out.push_str(&format!(
        "{t}\nper-connection pod bytes from the smallest to the largest step: {:+.1} %\n\n",
        m.pod_slope * 100.0
    ));
    let mut p = Table::new();
    p.load_preset(NOTHING);
    p.set_header(vec![
        "PLAN",
        "SHARDS",
        "NODES",
        "MEMORY LIMIT",
        "$ PER 1M / MONTH",
    ]);
    let cost = |c: Option<f64>| c.map_or("-".into(), |c| format!("{c:.2}"));
    for (label, shape) in [("model", &s.before), ("calibrated", &s.after)] {
        p.add_row(vec![
            label.to_string(),
            shape.shards.to_string(),
            shape.nodes.to_string(),
            bytes(shape.memory_limit_bytes),
            cost(shape.cost_per_million_connections_monthly),
        ]);
    }
    out.push_str(&format!("{p}\n\nspec.backend for a fixed figure:\n"));
    for (k, v) in &s.backend {
        out.push_str(&format!("  backend:\n    {k}: {v}\n"));
    }
    out
}

/// One table per fleet: each plan field with its value and unit.
pub fn plan_table(name: &str, connections: i64, plan: &Plan) -> String {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(vec![format!("FLEET {name}"), String::new()]);
    let mut row = |k: &str, v: String| {
        t.add_row(vec![k.to_string(), v]);
    };
    row("connections (declared)", connections.to_string());
    row("shards", plan.shards.to_string());
    row(
        "connectionsPerShard",
        plan.connections_per_shard.to_string(),
    );
    row(
        "maxConnectionsPerShard",
        plan.max_connections_per_shard.to_string(),
    );
    row(
        "sizedConnectionsPerShard",
        plan.sized_connections_per_shard.to_string(),
    );
    row(
        "shardConnectionLimit",
        plan.shard_connection_limit.to_string(),
    );
    row("shardsPerNode", plan.shards_per_node.to_string());
    row("nodes", plan.nodes.to_string());
    row(
        "connectionsPerNode (max)",
        plan.connections_per_node.to_string(),
    );
    row("capacity", plan.capacity.to_string());
    let b = &plan.bytes_per_connection;
    row(
        "bytesPerConnection",
        format!("user {} + kernel {} = {} B", b.user, b.kernel, b.total),
    );
    let pod = &plan.pod_bytes_per_connection;
    row(
        "podBytesPerConnection",
        format!(
            "user {} + kernel {} = {} B (cgroup {})",
            pod.user,
            pod.kernel,
            pod.total,
            plan.cgroup_mode.as_str()
        ),
    );
    let slow = &plan.slow_reader_bytes;
    row(
        "slowReadersPerShard",
        format!(
            "{} × (user {} + kernel {} = {} B)",
            plan.slow_readers_per_shard, slow.user, slow.kernel, slow.total
        ),
    );
    row("processBytes", bytes(plan.process_bytes));
    row("memoryLimitBytes", bytes(plan.memory_limit_bytes));
    row(
        "cpus / workers",
        format!(
            "{} / {} (shape from {})",
            plan.cpus,
            plan.workers,
            match plan.shape_source {
                crate::api::ShapeSource::Spec => "spec.shard.cpus",
                crate::api::ShapeSource::Planner => "the planner",
            }
        ),
    );
    row(
        "nofile",
        if plan.server_raises_nofile {
            format!(
                "{} (the server raises its hard limit; fs.nr_open allows it)",
                plan.nofile
            )
        } else {
            format!(
                "{} (within the runtime's hard limit {})",
                plan.nofile, plan.node_nofile_hard_limit
            )
        },
    );
    row("listenBacklog", plan.listen_backlog.to_string());
    row("limitingFactor", plan.limiting_factor.as_str().to_string());
    row(
        "node",
        format!(
            "{} CPUs, {}, {} pods",
            plan.node_cpus,
            bytes(plan.node_memory_bytes),
            plan.node_pods
        ),
    );
    if let Some(s) = &plan.node_source {
        row(
            "nodeSource",
            format!(
                "cpus {}, memory {}, pods {}",
                s.cpus.as_str(),
                s.memory.as_str(),
                s.pods.as_str()
            ),
        );
    }
    for (k, v) in &plan.sysctls {
        row(&format!("sysctl {k}"), v.to_string());
    }
    if !plan.sysctls_not_applied.is_empty() {
        row("sysctls not applied", join_names(&plan.sysctls_not_applied));
    }
    for (k, v) in &plan.sysctls_capped {
        row(&format!("capped by policy {k}"), v.to_string());
    }
    row(
        "failureDomain",
        match plan.failure_domain_shards {
            0 => format!(
                "{:?}: no spare; one lost shard refilled in {} s",
                plan.failure_domain, plan.refill_seconds
            ),
            lost if lost >= plan.shards => format!(
                "{:?}: all {} shards lost: not survivable (spec.shard.maxShards)",
                plan.failure_domain, plan.shards
            ),
            lost => format!(
                "{:?}: {lost} of {} shards lost, refilled in {} s",
                plan.failure_domain, plan.shards, plan.refill_seconds
            ),
        },
    );
    row("drainSeconds", plan.drain_seconds.to_string());
    row(
        "terminationGracePeriodSeconds",
        if plan.drain_cut_by_policy {
            format!(
                "{} (policy bound: the drain cannot finish)",
                plan.termination_grace_period_seconds
            )
        } else {
            plan.termination_grace_period_seconds.to_string()
        },
    );
    if let Some(c) = plan.cost_per_million_connections_monthly {
        row("costPerMillionConnectionsMonthly", format!("${c:.2}"));
    }
    if let Some(c) = plan.actual_cost_per_million_connections_monthly {
        row("actualCostPerMillionConnectionsMonthly", format!("${c:.2}"));
    }
    if let Some(c) = plan.monthly_cost {
        row("monthlyCost", format!("${c:.2}"));
    }
    for (i, alt) in plan.alternative_shapes.iter().enumerate() {
        let much = if crate::plan::capacity::is_much_cheaper(alt, plan, connections) {
            " (≥ 20 % cheaper)"
        } else {
            ""
        };
        let price = alt
            .cost_per_million_connections_monthly
            .map(|c| format!(", ${c:.2}/1M"))
            .unwrap_or_default();
        row(
            &format!("alternative shape {}", i + 1),
            format!(
                "{} CPUs × {} on {} nodes, {}/node{price}, {}{much}",
                alt.cpus,
                alt.shards,
                alt.nodes,
                alt.connections_per_node,
                alt.limiting_factor.as_str()
            ),
        );
    }
    t.to_string()
}
