//! How long a departing shard takes (pure): the drain of its connections at
//! `spec.drain.rate`, the accept window, and the grace period its pod gets,
//! bounded by the operator's policy
//! ([`crate::policy::Policy::max_termination_grace_period_seconds`]).

/// Seconds added to the drain time for the grace period: process start-up
/// of the drain, the last closes, and exit.
pub const DRAIN_SLACK_SECONDS: i64 = 20;

/// Seconds a draining shard keeps its listeners open, answering new
/// connections with a protocol goodbye instead of a refusal, while its
/// endpoint removal propagates: rendered as `C10M_DRAIN_ACCEPT_SECS`. The
/// value and where it comes from are [`c10m_wire::drain::ACCEPT_SECS`].
pub const DRAIN_ACCEPT_SECONDS: i64 = c10m_wire::drain::ACCEPT_SECS as i64;

/// The pod's `terminationGracePeriodSeconds` for a shard holding
/// `connections` that drains at `rate` per second, without a bound: the
/// drain time, plus the accept window ([`DRAIN_ACCEPT_SECONDS`]), plus
/// [`DRAIN_SLACK_SECONDS`].
///
/// After SIGTERM the server closes its connections at the rate and, at the
/// same time, keeps accepting for the window; it exits when both are over,
/// so it lives at most the longer of the two (the drain is cut at
/// `C10M_DRAIN_TIMEOUT_SECS`, [`drain_timeout_seconds`]; the window's last
/// goodbyes take at most 2 s more). Adding the window to the drain time
/// bounds that from above whichever is longer, so the kubelet's SIGKILL
/// never cuts the window or the drain short.
pub fn grace_seconds(connections: i64, rate: i64) -> i64 {
    drain_seconds(connections, rate) + DRAIN_ACCEPT_SECONDS + DRAIN_SLACK_SECONDS
}

/// Seconds a shard holding `connections` needs to close them at `rate` per second.
pub fn drain_seconds(connections: i64, rate: i64) -> i64 {
    (connections + rate.max(1) - 1) / rate.max(1)
}

/// `C10M_DRAIN_TIMEOUT_SECS` for a pod with `grace` seconds: the grace less
/// the accept window and half the slack. With an unbounded grace that is the
/// drain time plus half the slack; with a grace the policy cut, the server
/// closes what is still open at once this long after SIGTERM, before the
/// kubelet's SIGKILL.
pub fn drain_timeout_seconds(grace: i64) -> i64 {
    grace - DRAIN_ACCEPT_SECONDS - DRAIN_SLACK_SECONDS / 2
}

/// A shard's drain under the policy's bound on the grace period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drain {
    /// Seconds the drain needs at the rate.
    pub seconds: i64,
    /// The grace period the pod gets: [`grace_seconds`], at most the bound.
    pub grace: i64,
    /// The bound cut the grace: the drain cannot finish, and what is still
    /// open when it times out is closed at once.
    pub cut: bool,
}

/// The drain of a shard holding `connections` at `rate` per second, with a
/// grace period of at most `max_grace` seconds.
pub fn drain(connections: i64, rate: i64, max_grace: i64) -> Drain {
    let needed = grace_seconds(connections, rate);
    Drain {
        seconds: drain_seconds(connections, rate),
        grace: needed.min(max_grace),
        cut: needed > max_grace,
    }
}

/// One departing shard's close rate, connections/s: `rate`
/// (spec.drain.rate), at most the fleet's budget `max_reconnect_rate`
/// (spec.rollout.maxReconnectRate), so a shard draining alone never exceeds it.
pub fn shard_rate(rate: i64, max_reconnect_rate: i64) -> i64 {
    rate.min(max_reconnect_rate).max(1)
}

/// How a rollout replaces the shards within the fleet's reconnect budget
/// (see [`rollout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rollout {
    /// Shards replaced per step: the Deployment's `maxSurge`
    /// (`maxUnavailable` is 0).
    pub surge: i64,
    /// Seconds between steps: the Deployment's `minReadySeconds`.
    pub step_seconds: i64,
}

/// The rollout of `shards` shards whose departures close at `shard_rate`
/// connections/s each, under a fleet budget of `max_reconnect_rate`
/// connections/s, for a `drain` ([`drain`]).
///
/// A step surges `surge` = budget ÷ shard rate updated shards (at least 1,
/// at most `shards`), so the step's old shards, draining together, close
/// at most `max(budget, shard rate)` = the budget (the shard rate is at
/// most the budget, [`shard_rate`]). The Deployment controller removes old
/// shards only when as many updated ones have been Ready for
/// `minReadySeconds`; setting that to the time an old shard needs to close
/// its cap (cut where the policy cuts the drain: the server closes the rest
/// at its drain timeout) plus the accept window keeps each step's drain
/// from overlapping the next one's. Shards hold at most their cap, so the
/// bound holds whatever they hold.
pub fn rollout(shards: i64, shard_rate: i64, max_reconnect_rate: i64, drain: Drain) -> Rollout {
    let surge = (max_reconnect_rate / shard_rate.max(1)).clamp(1, shards.max(1));
    let closing = drain.seconds.min(drain_timeout_seconds(drain.grace).max(0));
    Rollout {
        surge,
        step_seconds: closing + DRAIN_ACCEPT_SECONDS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_seconds_round_up() {
        assert_eq!(drain_seconds(1000, 100), 10);
        assert_eq!(drain_seconds(1001, 100), 11);
        assert_eq!(drain_seconds(1, 1000), 1);
        assert_eq!(drain_seconds(0, 1000), 0);
        assert_eq!(
            drain_seconds(5, 0),
            5,
            "a zero rate counts as one per second"
        );
    }

    #[test]
    fn grace_covers_the_drain_and_the_accept_window() {
        assert_eq!(DRAIN_ACCEPT_SECONDS, 5);
        assert_eq!(grace_seconds(1000, 100), 10 + 5 + 20);
        assert_eq!(grace_seconds(0, 1000), 5 + 20);
        // Whichever of drain and window is longer, the grace period is longer
        // than the server's life after SIGTERM: max(drain + slack/2, window + 2).
        for (conns, rate) in [(0, 1000), (1, 1), (100_000, 10), (1_000_000, 100_000)] {
            let grace = grace_seconds(conns, rate);
            let drain_timeout = drain_timeout_seconds(grace);
            assert_eq!(
                drain_timeout,
                drain_seconds(conns, rate) + DRAIN_SLACK_SECONDS / 2
            );
            let window = DRAIN_ACCEPT_SECONDS + 2;
            assert!(grace > drain_timeout.max(window));
        }
    }

    /// Issue 13: `drain.rate: 1` used to give a shard of a billion
    /// connections a grace period of ~34 years.
    #[test]
    fn the_policy_bounds_the_grace_and_says_the_drain_is_cut() {
        let d = drain(1_073_741_000, 1, 3600);
        assert_eq!(d.seconds, 1_073_741_000);
        assert_eq!(d.grace, 3600);
        assert!(d.cut);
        // The server gives up before the kubelet's SIGKILL, after the window.
        let timeout = drain_timeout_seconds(d.grace);
        assert_eq!(timeout, 3600 - 15);
        assert!(timeout < d.grace && timeout > DRAIN_ACCEPT_SECONDS + 2);
        // At the smallest bound a policy may set the server still outlives the window.
        let d = drain(1_000_000, 1, crate::policy::MIN_TERMINATION_GRACE_SECONDS);
        assert!(drain_timeout_seconds(d.grace) >= DRAIN_ACCEPT_SECONDS + 2);
        // A drain that fits is not cut, exactly at the bound either.
        let fits = drain(3600 - 25, 1, 3600);
        assert_eq!((fits.grace, fits.cut), (3600, false));
        let over = drain(3600 - 24, 1, 3600);
        assert_eq!((over.grace, over.cut), (3600, true));
    }

    #[test]
    fn a_shard_drains_within_the_fleet_budget() {
        assert_eq!(shard_rate(2000, 5000), 2000);
        assert_eq!(shard_rate(2000, 50), 50);
        assert_eq!(shard_rate(0, 0), 1, "never a zero rate");
    }

    #[test]
    fn rollout_steps_close_within_the_budget_and_never_overlap() {
        let d = drain(10_000, 2000, 3600);
        // 5000/s over 2000/s per shard: two shards a step, 4000/s together.
        let r = rollout(8, 2000, 5000, d);
        assert_eq!(r.surge, 2);
        assert!(r.surge * 2000 <= 5000);
        // A step lasts the cap's drain (5 s) plus the accept window.
        assert_eq!(r.step_seconds, 5 + DRAIN_ACCEPT_SECONDS);
        // A budget below one shard's rate: one shard a step.
        assert_eq!(rollout(8, 50, 50, drain(200, 50, 3600)).surge, 1);
        // Never more than the fleet has, never none.
        assert_eq!(rollout(3, 10, 1_000_000, d).surge, 3);
        assert_eq!(rollout(0, 10, 5, d).surge, 1);
        // A drain the policy cuts ends at the server's drain timeout.
        let cut = drain(1_000_000, 1, 600);
        assert!(cut.cut);
        assert_eq!(
            rollout(4, 1, 1, cut).step_seconds,
            drain_timeout_seconds(600) + DRAIN_ACCEPT_SECONDS
        );
    }
}
