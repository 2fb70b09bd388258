//! What the plan sets for the bundled server's connections beyond their
//! number (pure data): TCP keepalive, so that peers that vanished stop
//! counting as load, and the per-worker budget for unfinished WebSocket
//! frames, which a shard's memory must hold. The values are the contract's
//! ([`c10m_wire::keepalive`], [`c10m_wire::partial`]), where they are
//! argued; the renderer writes them into every shard's environment.

use crate::api::{BackendModel, ConnectionFleetSpec};

/// Seconds of silence before the first keepalive probe (`C10M_KEEPALIVE_IDLE_SECS`).
pub const KEEPALIVE_IDLE_SECS: i64 = c10m_wire::keepalive::IDLE_SECS as i64;

/// Seconds between keepalive probes (`C10M_KEEPALIVE_INTERVAL_SECS`).
pub const KEEPALIVE_INTERVAL_SECS: i64 = c10m_wire::keepalive::INTERVAL_SECS as i64;

/// Unanswered probes before a connection is dropped (`C10M_KEEPALIVE_COUNT`).
pub const KEEPALIVE_COUNT: i64 = c10m_wire::keepalive::COUNT as i64;

/// Seconds within which a shard stops counting a peer that vanished:
/// idle + interval × count (the server's TCP user timeout defaults to the
/// same, for peers with unacknowledged data).
pub const fn dead_peer_seconds() -> i64 {
    KEEPALIVE_IDLE_SECS + KEEPALIVE_INTERVAL_SECS * KEEPALIVE_COUNT
}

/// Bytes one worker of the bundled server may hold for unfinished frames
/// and upgrade requests (`C10M_PARTIAL_BUDGET_BYTES`).
pub const PARTIAL_BUDGET_BYTES_PER_WORKER: i64 = c10m_wire::partial::BUDGET_BYTES_PER_WORKER as i64;

/// Bytes a shard of `spec` with `cpus` CPUs may hold for unfinished input:
/// the budget times its workers (one per CPU) for the bundled server, whose budget bounds
/// it; 0 for other servers, whose buffering their `userBytesPerConnection`
/// must cover. It is a per-shard amount, not a per-connection one: a
/// thousand or a million connections share the same budget, so it goes
/// into a shard's memory beside the process base, not into
/// `bytesPerConnection`.
pub fn partial_budget_bytes(spec: &ConnectionFleetSpec, cpus: i64) -> i64 {
    match spec.backend.model {
        BackendModel::Epoll => PARTIAL_BUDGET_BYTES_PER_WORKER * cpus.max(0),
        BackendModel::Goroutine | BackendModel::Custom => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ScalingRules;

    #[test]
    fn dead_peers_go_within_one_scale_down_window() {
        // 60 + 10 × 6 = 120 s, inside the autoscaler's default scale-down
        // stabilization: a vanished peer never holds a fleet up for more
        // than one window.
        assert_eq!(dead_peer_seconds(), 120);
        let window = ScalingRules::default_down().stabilization_window_seconds;
        assert!(dead_peer_seconds() < i64::from(window));
    }

    #[test]
    fn partial_budget_is_per_worker_of_the_bundled_server() {
        let spec = |v| serde_json::from_value::<ConnectionFleetSpec>(v).unwrap();
        let epoll = spec(serde_json::json!({"connections": 1000}));
        assert_eq!(partial_budget_bytes(&epoll, 4), 4 * (8 << 20));
        let go = spec(serde_json::json!({
            "connections": 1000,
            "backend": {"model": "goroutine"}
        }));
        assert_eq!(partial_budget_bytes(&go, 4), 0);
        // The schema's largest shard: 1,024 workers, 8 GiB, no overflow.
        assert_eq!(partial_budget_bytes(&epoll, 1024), 1024 * (8 << 20));
    }
}
