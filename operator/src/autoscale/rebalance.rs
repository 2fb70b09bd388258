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

/// A shard's connections as the rebalancer counts them: never below 0.
fn held(l: &ShardLoad) -> i128 {
    l.connections.max(0) as i128
}

/// Total connections of `loads` (widened: no sum of `i64`s overflows it).
fn total(loads: &[ShardLoad]) -> i128 {
    loads.iter().map(held).sum()
}

/// The mean load, rounded up: what every shard sheds down to (0 when empty).
fn mean_ceil(loads: &[ShardLoad]) -> i128 {
    match loads.len() {
        0 => 0,
        n => {
            let n = n as i128;
            (total(loads) + n - 1) / n
        }
    }
}

/// Hottest shard load over the mean, percent (100 when empty, idle or
/// balanced). Total for any input: negative loads count as 0, sums are
/// widened, and the ratio saturates at `i32::MAX`.
pub fn max_to_mean_percent(loads: &[ShardLoad]) -> i32 {
    let total = total(loads);
    if loads.is_empty() || total == 0 {
        return 100;
    }
    let max = loads.iter().map(held).max().unwrap_or(0);
    // Finite: max ≤ i64::MAX, len ≥ 1 and total ≥ 1; `as` saturates.
    (max as f64 * loads.len() as f64 * 100.0 / total as f64).round() as i32
}

/// Connections that must move for a perfect balance: the excess above the
/// mean (rounded up) of every shard, at most `i64::MAX`.
pub fn excess(loads: &[ShardLoad]) -> i64 {
    let target = mean_ceil(loads);
    let excess: i128 = loads.iter().map(|l| (held(l) - target).max(0)).sum();
    excess.min(i64::MAX as i128) as i64
}

/// The orders to send now (possibly none), updating `state`. Total for any
/// input (no division by zero, no overflow): an order's count is at most
/// its shard's connections, and the rates add up to at most the budget.
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
    let target = mean_ceil(loads);
    let mut hot: Vec<(&ShardLoad, i128)> = loads
        .iter()
        .map(|l| (l, held(l) - target))
        .filter(|(_, e)| *e > 0)
        .collect();
    hot.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.pod.cmp(&b.0.pod)));
    // Every order needs at least 1 connection/s: never more orders than the budget.
    let budget = spec.max_reconnect_rate.max(1);
    hot.truncate(usize::try_from(budget).unwrap_or(usize::MAX));
    let excess: i128 = hot.iter().map(|(_, e)| e).sum();
    if excess <= 0 {
        // Unreachable above the threshold (the hottest shard is above the
        // mean), but never a division by zero.
        state.above_since = None;
        return Vec::new();
    }
    // Each order gets 1 connection/s, and the rest of the budget is shared
    // in proportion to the excess (rounded down): the rates never add up to
    // more than the budget.
    let spare = budget as i128 - hot.len() as i128;
    let orders: Vec<ShedOrder> = hot
        .into_iter()
        .map(|(l, e)| ShedOrder {
            pod: l.pod.clone(),
            // 0 < e ≤ the shard's connections ≤ i64::MAX.
            count: e.min(i64::MAX as i128) as i64,
            // e ≤ excess: 1 + at most the spare budget, an i64.
            rate: (1 + spare * e / excess).min(i64::MAX as i128) as i64,
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

    #[test]
    fn rates_never_add_up_to_more_than_the_budget() {
        // One shard far hotter than two barely hot ones (excess 860, 60,
        // 60): rounding each share up to 1/s used to give 2 + 1 + 1 = 4 of a
        // budget of 3.
        let mut s = spec();
        s.max_reconnect_rate = 3;
        s.window_seconds = 0;
        let orders = plan(
            &s,
            &loads(&[1000, 200, 200, 0, 0, 0, 0, 0, 0, 0]),
            0.0,
            &mut State::default(),
        );
        assert_eq!(orders.len(), 3);
        assert_eq!(orders.iter().map(|o| o.rate).sum::<i64>(), 3);
    }

    /// Issue 10, fault 8: samples of +Inf, +Inf and 5 (which an unvalidated
    /// read cast to i64::MAX) summed past i64::MAX, and the rates divided by
    /// an excess that had wrapped to 0: a panic, in release builds too.
    #[test]
    fn saturated_loads_never_divide_by_zero() {
        let l = loads(&[i64::MAX, i64::MAX, 5]);
        assert_eq!(max_to_mean_percent(&l), 150);
        let m = i64::MAX as i128;
        let mean = (2 * m + 5 + 2) / 3;
        assert_eq!(excess(&l) as i128, 2 * (m - mean), "no sum wraps");
        let four_full_eight_empty: Vec<i64> = [i64::MAX; 4].into_iter().chain([0; 8]).collect();
        assert_eq!(
            excess(&loads(&four_full_eight_empty)),
            i64::MAX,
            "saturates"
        );
        let mut s = spec();
        s.window_seconds = 0;
        let orders = plan(&s, &l, 0.0, &mut State::default());
        assert_eq!(orders.len(), 2);
        assert!(orders.iter().all(|o| o.count > 0 && o.rate >= 1));
        assert!(orders.iter().map(|o| o.rate).sum::<i64>() <= 1000);
        // Idle, empty, negative: balanced, nothing to move.
        for l in [loads(&[0, 0, 0]), loads(&[]), loads(&[-5, -1, 0])] {
            assert_eq!(max_to_mean_percent(&l), 100);
            assert_eq!(excess(&l), 0);
            assert!(plan(&s, &l, 0.0, &mut State::default()).is_empty());
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Any load, with the edges (0, negatives, i64::MAX and near it) often.
        fn arb_load() -> impl Strategy<Value = i64> {
            prop_oneof![
                2 => 0i64..=5000,
                1 => Just(0i64),
                1 => (i64::MAX - 10)..=i64::MAX,
                1 => any::<i64>(),
            ]
        }

        fn arb_spec() -> impl Strategy<Value = RebalanceSpec> {
            (
                101i32..=1000,
                0i32..=10,
                prop_oneof![1i64..=5, 1i64..=5000, Just(i64::MAX), any::<i64>()],
            )
                .prop_map(|(ratio, window, rate)| {
                    let mut s = spec();
                    s.max_to_mean_percent = ratio;
                    s.window_seconds = window;
                    s.max_reconnect_rate = rate;
                    s
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// plan, max_to_mean_percent and excess are total (no panic,
            /// overflow checks on in tests), and the orders keep their promises.
            #[test]
            fn the_rebalancer_never_panics(
                spec in arb_spec(),
                values in prop::collection::vec(arb_load(), 0..=12),
                times in prop::collection::vec(0.0f64..=30.0, 1..=4),
            ) {
                let l = loads(&values);
                let ratio = max_to_mean_percent(&l);
                prop_assert!(ratio >= 100, "the hottest shard is never below the mean");
                let need = excess(&l);
                prop_assert!(need >= 0);
                let mut st = State::default();
                let mut now = 0.0;
                for dt in times {
                    now += dt;
                    let orders = plan(&spec, &l, now, &mut st);
                    prop_assert!(orders.len() as i64 <= spec.max_reconnect_rate.max(1));
                    let rates: i128 = orders.iter().map(|o| o.rate as i128).sum();
                    prop_assert!(rates <= spec.max_reconnect_rate.max(1) as i128, "{} over budget", rates);
                    let counts: i128 = orders.iter().map(|o| o.count as i128).sum();
                    prop_assert!(counts <= need as i128 || need == i64::MAX);
                    for o in &orders {
                        let held = l.iter().find(|x| x.pod == o.pod).unwrap().connections;
                        prop_assert!(o.count > 0 && o.count <= held && o.rate >= 1, "{:?}", o);
                    }
                    prop_assert!(!st.quiet_until.is_nan());
                }
            }
        }
    }
}
