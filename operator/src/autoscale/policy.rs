//! HPA-like scaling policy (pure). Shards follow live connections:
//! `desired = ceil(live ÷ (per-shard cap × target utilization))`, raised when
//! socket memory nears the node's `tcp_mem` pressure threshold, kept within
//! a tolerance of the current count, bounded by the declared floor and
//! `shard.maxShards`, smoothed by stabilization windows and rate-limited per
//! period — the Kubernetes HPA's algorithm and `behavior` semantics
//! (kubernetes.io docs, "Horizontal Pod Autoscaling").
//!
//! Times are seconds on any monotonic clock, passed in so tests control them.

use std::collections::VecDeque;

use crate::api::{AutoscalingSpec, ScalingRules};

/// What the autoscaler sees in one sync.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// Shards running now (the Deployment's replicas).
    pub current: i32,
    /// Shards the declared `spec.connections` needs: the floor.
    pub floor: i32,
    /// `shard.maxShards`.
    pub max: i32,
    /// Live connections of the whole fleet.
    pub live: i64,
    /// Connection cap of one shard (the plan's shardConnectionLimit).
    pub shard_capacity: i64,
    /// TCP socket memory of the busiest node, bytes (None: not reported).
    pub socket_memory_bytes: Option<i64>,
    /// The node's `tcp_mem` pressure threshold, bytes.
    pub tcp_mem_pressure_bytes: i64,
}

/// A recommendation: shards, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recommendation {
    /// Shards wanted, within [floor, max].
    pub shards: i32,
    /// Why, in words.
    pub reason: String,
}

/// Shards the observation calls for, before stabilization and rate limits.
pub fn recommend(spec: &AutoscalingSpec, o: &Observation) -> Recommendation {
    let target = o.shard_capacity as f64 * spec.target_utilization_percent as f64 / 100.0;
    let current = o.current.max(1);
    let ratio = o.live as f64 / (current as f64 * target);
    let (mut shards, mut reason) = if (ratio - 1.0).abs() <= spec.tolerance_percent as f64 / 100.0 {
        (
            current,
            format!(
                "{} live connections are within {} % of the target ({} % of {} per shard)",
                o.live, spec.tolerance_percent, spec.target_utilization_percent, o.shard_capacity
            ),
        )
    } else {
        let want = (o.live as f64 / target).ceil() as i64;
        (
            want.clamp(0, i32::MAX as i64) as i32,
            format!(
                "{} live connections need {want} shards at {} % of {} per shard",
                o.live, spec.target_utilization_percent, o.shard_capacity
            ),
        )
    };
    if let Some(mem) = o.socket_memory_bytes {
        let limit = o.tcp_mem_pressure_bytes as f64 * spec.socket_memory_percent as f64 / 100.0;
        if mem as f64 > limit && limit > 0.0 {
            let want = (current as f64 * mem as f64 / limit).ceil() as i32;
            if want > shards {
                shards = want;
                reason = format!(
                    "socket memory {mem} B is above {} % of the tcp_mem pressure threshold ({} B)",
                    spec.socket_memory_percent, o.tcp_mem_pressure_bytes
                );
            }
        }
    }
    let bounded = shards.clamp(o.floor.max(1), o.max.max(o.floor));
    if bounded != shards {
        reason = format!("{reason}; bounded to [{}, {}]", o.floor, o.max.max(o.floor));
    }
    Recommendation {
        shards: bounded,
        reason,
    }
}

/// Recommendations and scale events remembered between syncs.
#[derive(Clone, Debug, Default)]
pub struct History {
    recommendations: VecDeque<(f64, i32)>,
    /// (time, shards before, shards after) of each change.
    scales: VecDeque<(f64, i32, i32)>,
}

/// The decision of one sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Shards to run.
    pub shards: i32,
    /// Why, in words.
    pub reason: String,
}

/// Applies stabilization windows and rate limits to `rec` at time `now`.
/// Scale-up takes the lowest recommendation within its window, scale-down
/// the highest within its; the change per period is limited to the larger
/// of `shardsPerPeriod` and `percentPerPeriod` of the count at the period's start.
pub fn decide(
    spec: &AutoscalingSpec,
    history: &mut History,
    now: f64,
    current: i32,
    rec: &Recommendation,
) -> Decision {
    let (up, down) = (&spec.scale_up, &spec.scale_down);
    let keep = up
        .stabilization_window_seconds
        .max(down.stabilization_window_seconds)
        .max(up.period_seconds)
        .max(down.period_seconds) as f64;
    history.recommendations.push_back((now, rec.shards));
    while history
        .recommendations
        .front()
        .is_some_and(|(t, _)| now - t > keep)
    {
        history.recommendations.pop_front();
    }
    while history
        .scales
        .front()
        .is_some_and(|(t, _, _)| now - t > keep)
    {
        history.scales.pop_front();
    }
    let within = |w: i32| {
        history
            .recommendations
            .iter()
            .filter(move |(t, _)| now - t <= w as f64)
            .map(|(_, s)| *s)
    };
    let mut reason = rec.reason.clone();
    let desired = if rec.shards > current {
        let stable = within(up.stabilization_window_seconds)
            .min()
            .unwrap_or(rec.shards)
            .max(current);
        // Never below what runs: the limit slows a scale-up, never reverses it.
        let limit = limit(history, now, current, up, true).max(current);
        if stable > limit {
            reason = format!("{reason}; scale-up limited to {limit} by scaleUp rules");
        }
        stable.min(limit)
    } else if rec.shards < current {
        let stable = within(down.stabilization_window_seconds)
            .max()
            .unwrap_or(rec.shards)
            .min(current);
        if stable > rec.shards {
            reason = format!(
                "{reason}; held at {stable} by the {} s scale-down stabilization window",
                down.stabilization_window_seconds
            );
        }
        // Never above what runs: the limit slows a scale-down, never reverses it.
        let limit = limit(history, now, current, down, false).min(current);
        stable.max(limit)
    } else {
        current
    };
    if desired != current {
        history.scales.push_back((now, current, desired));
    }
    Decision {
        shards: desired,
        reason,
    }
}

/// Most (scaling up) or fewest (down) shards allowed now by `rules`' period limit.
fn limit(history: &History, now: f64, current: i32, rules: &ScalingRules, up: bool) -> i32 {
    // Shards at the start of the period: undo the changes made within it.
    let start = history
        .scales
        .iter()
        .filter(|(t, _, _)| now - t < rules.period_seconds as f64)
        .map(|(_, before, _)| *before)
        .next()
        .unwrap_or(current);
    let by_percent = (start as f64 * rules.percent_per_period as f64 / 100.0).ceil() as i32;
    let step = rules.shards_per_period.max(by_percent);
    if up {
        start.saturating_add(step)
    } else {
        start.saturating_sub(step).max(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> AutoscalingSpec {
        serde_json::from_value(serde_json::json!({"enabled": true})).unwrap()
    }

    fn obs(current: i32, live: i64) -> Observation {
        Observation {
            current,
            floor: 2,
            max: 20,
            live,
            shard_capacity: 1000,
            socket_memory_bytes: None,
            tcp_mem_pressure_bytes: 1 << 30,
        }
    }

    #[test]
    fn shards_follow_live_connections_at_target_utilization() {
        // 4,000 live at 80 % of 1,000 per shard → 5 shards.
        assert_eq!(recommend(&spec(), &obs(2, 4000)).shards, 5);
        // Within tolerance (10 %): 3 shards × 800 = 2,400; 2,500 is +4 %.
        assert_eq!(recommend(&spec(), &obs(3, 2500)).shards, 3);
        // Bounded by the floor and max.
        assert_eq!(recommend(&spec(), &obs(3, 0)).shards, 2);
        let r = recommend(&spec(), &obs(3, 100_000));
        assert_eq!(r.shards, 20);
        assert!(r.reason.contains("bounded"), "{}", r.reason);
    }

    #[test]
    fn socket_memory_near_pressure_adds_shards() {
        let mut o = obs(4, 3200); // exactly on target
        o.socket_memory_bytes = Some(1 << 30); // 100 % of pressure > 80 %
        let r = recommend(&spec(), &o);
        assert_eq!(r.shards, 5, "ceil(4 × 1.0 / 0.8)");
        assert!(r.reason.contains("socket memory"));
    }

    #[test]
    fn scale_up_is_rate_limited_per_period() {
        let s = spec(); // up: max(4 shards, 100 %) per 15 s
        let mut h = History::default();
        let big = Recommendation {
            shards: 20,
            reason: "x".into(),
        };
        let d = decide(&s, &mut h, 0.0, 2, &big);
        assert_eq!(d.shards, 6, "2 + max(4, 100 % of 2)");
        assert!(d.reason.contains("limited"));
        // Same period: still measured from the period's start (2).
        assert_eq!(decide(&s, &mut h, 5.0, 6, &big).shards, 6);
        // Next period starts from 6: +6 (100 %).
        assert_eq!(decide(&s, &mut h, 16.0, 6, &big).shards, 12);
    }

    #[test]
    fn scale_down_waits_for_the_stabilization_window() {
        let s = spec(); // down: 300 s window, max(1 shard, 10 %) per 60 s
        let mut h = History::default();
        let ten = Recommendation {
            shards: 10,
            reason: "x".into(),
        };
        let three = Recommendation {
            shards: 3,
            reason: "low".into(),
        };
        assert_eq!(decide(&s, &mut h, 0.0, 10, &ten).shards, 10);
        let d = decide(&s, &mut h, 100.0, 10, &three);
        assert_eq!(d.shards, 10, "10 was recommended within 300 s");
        assert!(d.reason.contains("stabilization"));
        // After the window: down, one shard (max(1, 10 % of 10)) per period.
        assert_eq!(decide(&s, &mut h, 301.0, 10, &three).shards, 9);
        assert_eq!(decide(&s, &mut h, 330.0, 9, &three).shards, 9);
        assert_eq!(decide(&s, &mut h, 362.0, 9, &three).shards, 8);
    }

    #[test]
    fn a_rate_limit_never_turns_a_scale_around() {
        // The shards changed outside the loop after a scale within the
        // period (a manual scale, a failed apply): the limit, measured from
        // the period's start, lies beyond the shards that run now.
        let s = spec(); // up: +max(4, 100 %) per 15 s; down: −max(1, 10 %) per 60 s
        let rec = |shards| Recommendation {
            shards,
            reason: "x".into(),
        };
        let mut h = History::default();
        assert_eq!(decide(&s, &mut h, 0.0, 2, &rec(20)).shards, 6);
        // 12 run now; the period started at 2, so its limit is 6.
        let d = decide(&s, &mut h, 5.0, 12, &rec(20));
        assert_eq!(d.shards, 12, "more wanted: never fewer than run");
        let mut h = History::default();
        let mut down = s.clone();
        down.scale_down.stabilization_window_seconds = 0;
        assert_eq!(decide(&down, &mut h, 0.0, 10, &rec(3)).shards, 9);
        // 5 run now; the period started at 10, so its limit is 9.
        let d = decide(&down, &mut h, 5.0, 5, &rec(3));
        assert_eq!(d.shards, 5, "fewer wanted: never more than run");
    }
}
