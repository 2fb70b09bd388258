//! Human-readable plan tables for `c10m-operator plan -o table` and `make demo`.

use comfy_table::{Table, presets::NOTHING};

use crate::api::Plan;
use crate::api::sysctl::join_names;

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
    row("memoryLimitBytes", bytes(plan.memory_limit_bytes));
    row(
        "cpus / workers",
        format!("{} / {}", plan.cpus, plan.workers),
    );
    row("nofile", plan.nofile.to_string());
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
    if let Some(c) = plan.monthly_cost {
        row("monthlyCost", format!("${c:.2}"));
    }
    t.to_string()
}
