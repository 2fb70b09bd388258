//! Rebalancing held connections (pure). SO_REUSEPORT and load balancers
//! spread new connections, not held ones, so after a scale-out the old
//! shards stay hot. When the hottest shard stays above `maxToMeanPercent` of
//! the mean for `windowSeconds`, every shard above the mean is told to shed
//! its excess (down to the mean, rounded up), at rates that add up to at most
//! `maxReconnectRate` connections/s fleet-wide; clients reconnect and land on
//! colder shards. No new order goes out until the last one has had time to
//! finish and the window has passed again.

use crate::api::RebalanceSpec;

/// Live connections of one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLoad {
    /// Pod name.
    pub pod: String,
    /// Live connections.
    pub connections: i64,
}

/// An order to one shard: close `count` connections at `rate` connections/s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShedOrder {
    /// Pod name.
    pub pod: String,
    /// Connections to close.
    pub count: i64,
    /// Connections per second.
    pub rate: i64,
}

/// Rebalancer memory between syncs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct State {
    /// Since when the fleet has been above the threshold.
    pub above_since: Option<f64>,
    /// No new orders before this time (the last orders are still running).
    pub quiet_until: f64,
}

/// Hottest shard load over the mean, percent (100 when empty or balanced).
pub fn max_to_mean_percent(loads: &[ShardLoad]) -> i32 {
    let total: i64 = loads.iter().map(|l| l.connections).sum();
    if loads.is_empty() || total == 0 {
        return 100;
    }
    let max = loads.iter().map(|l| l.connections).max().unwrap_or(0);
    (max as f64 * loads.len() as f64 * 100.0 / total as f64).round() as i32
}

/// Connections that must move for a perfect balance: the excess above the
/// mean (rounded up) of every shard.
pub fn excess(loads: &[ShardLoad]) -> i64 {
    let total: i64 = loads.iter().map(|l| l.connections).sum();
    if loads.is_empty() {
        return 0;
    }
    let target = (total as f64 / loads.len() as f64).ceil() as i64;
    loads.iter().map(|l| (l.connections - target).max(0)).sum()
}

/// The orders to send now (possibly none), updating `state`.
pub fn plan(
    spec: &RebalanceSpec,
    loads: &[ShardLoad],
    now: f64,
    state: &mut State,
) -> Vec<ShedOrder> {
    if max_to_mean_percent(loads) <= spec.max_to_mean_percent || loads.len() < 2 {
        state.above_since = None;
        return Vec::new();
    }
    let since = *state.above_since.get_or_insert(now);
    if now - since < spec.window_seconds as f64 || now < state.quiet_until {
        return Vec::new();
    }
    let total: i64 = loads.iter().map(|l| l.connections).sum();
    let target = (total as f64 / loads.len() as f64).ceil() as i64;
    let mut hot: Vec<(&ShardLoad, i64)> = loads
        .iter()
        .map(|l| (l, l.connections - target))
        .filter(|(_, e)| *e > 0)
        .collect();
    hot.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.pod.cmp(&b.0.pod)));
    // Every order needs at least 1 connection/s: never more orders than the budget.
    hot.truncate(spec.max_reconnect_rate.max(1) as usize);
    let excess: i64 = hot.iter().map(|(_, e)| e).sum();
    let orders: Vec<ShedOrder> = hot
        .into_iter()
        .map(|(l, e)| ShedOrder {
            pod: l.pod.clone(),
            count: e,
            rate: ((spec.max_reconnect_rate as i128 * e as i128 / excess as i128) as i64).max(1),
        })
        .collect();
    let longest = orders
        .iter()
        .map(|o| o.count as f64 / o.rate as f64)
        .fold(0.0, f64::max);
    state.quiet_until = now + longest + spec.window_seconds as f64;
    state.above_since = None;
    orders
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RebalanceSpec {
        serde_json::from_value(
            serde_json::json!({"enabled": true, "maxReconnectRate": 1000, "windowSeconds": 10}),
        )
        .unwrap()
    }

    fn loads(v: &[i64]) -> Vec<ShardLoad> {
        v.iter()
            .enumerate()
            .map(|(i, c)| ShardLoad {
                pod: format!("p{i}"),
                connections: *c,
            })
            .collect()
    }

    #[test]
    fn balanced_fleets_get_no_orders() {
        let mut st = State::default();
        assert_eq!(max_to_mean_percent(&loads(&[100, 110, 90])), 110);
        assert!(plan(&spec(), &loads(&[100, 110, 90]), 0.0, &mut st).is_empty());
        assert_eq!(st.above_since, None);
    }

    #[test]
    fn hot_shards_shed_their_excess_after_the_window_within_the_budget() {
        let mut st = State::default();
        // After a scale-out 3 → 6: old shards hold 3,000 each, new ones 0.
        let l = loads(&[3000, 3000, 3000, 0, 0, 0]);
        assert_eq!(max_to_mean_percent(&l), 200);
        assert!(
            plan(&spec(), &l, 0.0, &mut st).is_empty(),
            "window not elapsed"
        );
        let orders = plan(&spec(), &l, 10.0, &mut st);
        assert_eq!(orders.len(), 3);
        assert!(orders.iter().all(|o| o.count == 1500));
        assert_eq!(
            orders.iter().map(|o| o.count).sum::<i64>(),
            excess(&l),
            "sheds exactly what must move"
        );
        assert!(
            orders.iter().map(|o| o.rate).sum::<i64>() <= 1000,
            "fleet-wide reconnect budget"
        );
        assert_eq!(orders[0].rate, 333);
        // 1,500 at 333/s takes ~4.5 s; quiet until then plus the window.
        assert!((st.quiet_until - (10.0 + 1500.0 / 333.0 + 10.0)).abs() < 1e-6);
        assert!(plan(&spec(), &l, 20.0, &mut st).is_empty(), "still quiet");
    }

    #[test]
    fn a_tiny_budget_limits_the_number_of_orders() {
        let mut s = spec();
        s.max_reconnect_rate = 2;
        s.window_seconds = 0;
        let orders = plan(
            &s,
            &loads(&[50, 40, 30, 0, 0, 0, 0, 0]),
            0.0,
            &mut State::default(),
        );
        assert_eq!(orders.len(), 2);
        assert_eq!(orders.iter().map(|o| o.rate).sum::<i64>(), 2);
    }
}
