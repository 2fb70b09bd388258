//! What the workers, the admin thread and the main thread share: admission
//! under the process-wide connection cap and a rollout's lapsing limit
//! (`POST /limit`), the draining flag, the drain
//! deadline, and the running close order (drain or shed) with the wakers
//! that tell the workers about it. Nothing here does I/O except waking the
//! workers' event loops.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use mio::Waker;

use crate::conn::CloseReason;
use crate::metrics::RejectReason;

/// An order to close connections at a bounded rate: a drain (SIGTERM or
/// `POST /drain`, every connection) or a shed (`POST /shed`, `count` of
/// them while still accepting). Workers claim closes from it; the total
/// claimed never runs ahead of `rate × elapsed`, whichever worker claims.
#[derive(Debug)]
pub struct CloseOrder {
    /// Reason the closes are counted under.
    pub reason: CloseReason,
    /// Connections to close (`u64::MAX`: all of them).
    pub count: u64,
    /// Closes per second over all workers; 0 means no limit.
    pub rate: f64,
    start: Instant,
    taken: AtomicU64,
    /// When a shed order lapses with closes still unclaimed (the
    /// connections it counted closed by themselves, or were in their
    /// handshake, which a shed never cuts): `None` for a drain, which runs
    /// until the last connection.
    lapses: Option<Instant>,
}

/// Seconds a shed order outlives the time its count takes at its rate,
/// before it lapses unfinished. Chosen: a worker claims its share within
/// one event-loop turn, so any close still unclaimed after this has no
/// connection left to take.
pub const SHED_LAPSE_SECONDS: f64 = 5.0;

impl CloseOrder {
    /// An order starting now. A shed ([`CloseReason::Shed`]) lapses
    /// [`SHED_LAPSE_SECONDS`] after its count would have been closed at
    /// its rate.
    pub fn new(reason: CloseReason, count: u64, rate: f64) -> Self {
        let rate = if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            0.0
        };
        let start = Instant::now();
        let lapses = (reason == CloseReason::Shed).then(|| {
            let closing = if rate > 0.0 { count as f64 / rate } else { 0.0 };
            start + std::time::Duration::from_secs_f64((closing + SHED_LAPSE_SECONDS).min(1e9))
        });
        CloseOrder {
            reason,
            count,
            rate,
            start,
            taken: AtomicU64::new(0),
            lapses,
        }
    }

    /// Whether the order is over at `now`: every close claimed, or a shed
    /// past its lapse time.
    pub fn over(&self, now: Instant) -> bool {
        self.done() || self.lapses.is_some_and(|t| now >= t)
    }

    /// Whether a connection in `phase` may be closed by this order: a shed
    /// never cuts a connection in its WebSocket handshake (it was not one
    /// the order counted on, and its client would get no close code); a
    /// drain closes every connection; no order takes one already closing.
    pub fn takes(&self, phase: crate::conn::Phase) -> bool {
        use crate::conn::Phase;
        match phase {
            // Already closing: its close was counted.
            Phase::Closing => false,
            Phase::Handshake => self.reason != CloseReason::Shed,
            Phase::Open => true,
        }
    }

    /// Closes allowed by `now` in total: one at once, then `rate` per
    /// second, never more than `count`.
    pub fn allowed(&self, now: Instant) -> u64 {
        if self.rate == 0.0 {
            return self.count;
        }
        let secs = now.saturating_duration_since(self.start).as_secs_f64();
        let n = (self.rate * secs).floor() + 1.0;
        if n >= self.count as f64 {
            self.count
        } else {
            n as u64
        }
    }

    /// Claims up to `want` closes allowed by `now`; returns how many.
    pub fn claim(&self, want: u64, now: Instant) -> u64 {
        let allowed = self.allowed(now);
        let mut got = 0;
        let _ = self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                got = allowed.saturating_sub(t).min(want);
                (got > 0).then_some(t + got)
            });
        got
    }

    /// Closes claimed so far.
    pub fn taken(&self) -> u64 {
        self.taken.load(Ordering::Acquire)
    }

    /// Gives back `n` claimed closes a worker could not use (it ran out of
    /// connections), so another worker may take them.
    pub fn unclaim(&self, n: u64) {
        if n > 0 {
            self.taken.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Whether every close of the order has been claimed.
    pub fn done(&self) -> bool {
        self.taken() >= self.count
    }
}

/// State the workers, the admin thread and the main thread share.
#[derive(Debug)]
pub struct Shared {
    /// Connections held, closing ones included: each holds a descriptor and
    /// a socket, so the cap counts them.
    live: AtomicU64,
    /// Of those, connections in their close handshake
    /// ([`crate::conn::Phase::Closing`]): their close is counted, no order
    /// can take them.
    closing: AtomicU64,
    cap: u64,
    /// Admission limit of `POST /limit` (`u64::MAX`: none), in force until
    /// `limit_until`.
    limit: AtomicU64,
    limit_until: Mutex<Option<Instant>>,
    draining: Arc<AtomicBool>,
    /// Cordoned by `POST /cordon`: readiness drops, nothing else changes.
    cordoned: AtomicBool,
    /// Drain deadline passed: close what is left at once.
    force: AtomicBool,
    order: Mutex<Option<Arc<CloseOrder>>>,
    order_gen: AtomicU64,
    wakers: OnceLock<Vec<Arc<Waker>>>,
}

impl Shared {
    /// `cap` is the per-process connection cap; `draining` turns true when
    /// the server starts shutting down.
    pub fn new(cap: u64, draining: Arc<AtomicBool>) -> Self {
        Shared {
            live: AtomicU64::new(0),
            closing: AtomicU64::new(0),
            cap,
            limit: AtomicU64::new(u64::MAX),
            limit_until: Mutex::new(None),
            draining,
            cordoned: AtomicBool::new(false),
            force: AtomicBool::new(false),
            order: Mutex::new(None),
            order_gen: AtomicU64::new(0),
            wakers: OnceLock::new(),
        }
    }

    /// Claims a slot for one more connection, unless the cap is reached
    /// ([`RejectReason::Capacity`]) or the limit in force
    /// ([`RejectReason::Limit`]). Never lets the count exceed either,
    /// however many workers race. The limit's lapse is checked only when it
    /// would turn a connection away, so admission stays two atomic loads.
    pub fn try_admit(&self) -> Result<(), RejectReason> {
        loop {
            let limit = self.limit.load(Ordering::Acquire);
            let bound = self.cap.min(limit);
            let claimed = self
                .live
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < bound).then_some(n + 1)
                });
            match claimed {
                Ok(_) => return Ok(()),
                Err(n) if n < self.cap && limit < self.cap => {
                    if !self.lapse(limit, Instant::now()) {
                        return Err(RejectReason::Limit);
                    }
                }
                Err(_) => return Err(RejectReason::Capacity),
            }
        }
    }

    /// Lifts `limit` if it is still the one in force and its time is over
    /// at `now`; true when no limit is in force any more (lifted here, or
    /// replaced or lifted meanwhile: admission is tried again).
    fn lapse(&self, limit: u64, now: Instant) -> bool {
        let mut until = self.limit_until.lock().unwrap_or_else(|e| e.into_inner());
        if self.limit.load(Ordering::Acquire) != limit {
            return true;
        }
        if until.is_some_and(|u| now < u) {
            return false;
        }
        *until = None;
        self.limit.store(u64::MAX, Ordering::Release);
        true
    }

    /// Sets the admission limit (`POST /limit`): at most `connections`
    /// live, for `seconds` from `now`; `None` lifts it (`POST /unlimit`).
    /// Held connections above it stay: only admission stops.
    pub fn set_limit(&self, limit: Option<(u64, Duration)>, now: Instant) {
        let mut until = self.limit_until.lock().unwrap_or_else(|e| e.into_inner());
        *until = limit.map(|(_, d)| now + d);
        let n = limit.map_or(u64::MAX, |(n, _)| n);
        self.limit.store(n, Ordering::Release);
    }

    /// The connections admitted now, at most: the cap, or a lower limit in
    /// force at `now` (a lapsed one is lifted here).
    pub fn admitting(&self, now: Instant) -> u64 {
        let limit = self.limit.load(Ordering::Acquire);
        if limit < self.cap && self.lapse(limit, now) {
            return self.cap;
        }
        self.cap.min(limit)
    }

    /// Gives back the slot of a closed connection.
    pub fn release(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// A connection entered its close handshake: it keeps its slot until
    /// [`Shared::release_closing`].
    pub fn begin_closing(&self) {
        self.closing.fetch_add(1, Ordering::AcqRel);
    }

    /// A connection in its close handshake was closed: gives back its slot.
    pub fn release_closing(&self) {
        // Slot first: `serving` may read one too few for a moment, never
        // one too many.
        self.release();
        self.closing.fetch_sub(1, Ordering::AcqRel);
    }

    /// Connections held in the process, closing ones included (what the
    /// cap counts).
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// Connections held and not closing: what an order can still close,
    /// what `c10m_connections` sums to, and the `live` the admin API
    /// reports.
    pub fn serving(&self) -> u64 {
        let closing = self.closing.load(Ordering::Acquire);
        self.live().saturating_sub(closing)
    }

    /// Whether the server is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Whether the shard is cordoned (`POST /cordon`, not lifted since).
    pub fn cordoned(&self) -> bool {
        self.cordoned.load(Ordering::Acquire)
    }

    /// Cordons the shard (`true`) or lifts the cordon (`false`).
    pub fn set_cordoned(&self, on: bool) {
        self.cordoned.store(on, Ordering::Release);
    }

    /// Records the workers' wakers (once, after they started).
    pub fn set_wakers(&self, wakers: Vec<Arc<Waker>>) {
        let _ = self.wakers.set(wakers);
    }

    /// Wakes every worker's event loop.
    pub fn wake_all(&self) {
        for w in self.wakers.get().into_iter().flatten() {
            if let Err(e) = w.wake() {
                tracing::warn!(error = %e, "could not wake worker");
            }
        }
    }

    /// Starts a drain: stop accepting, then close every connection at
    /// `rate` per second (0: all at once) with a protocol goodbye.
    pub fn start_drain(&self, rate: f64) {
        self.draining.store(true, Ordering::Release);
        self.set_order(CloseOrder::new(CloseReason::Shutdown, u64::MAX, rate));
    }

    /// Replaces the running close order (if any) and wakes the workers.
    pub fn set_order(&self, order: CloseOrder) {
        *self.order.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(order));
        self.order_gen.fetch_add(1, Ordering::AcqRel);
        self.wake_all();
    }

    /// The running close order, if any.
    pub fn order(&self) -> Option<Arc<CloseOrder>> {
        self.order.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Bumped by every [`Shared::set_order`], so a worker notices a new
    /// order with one atomic load.
    pub(crate) fn order_gen(&self) -> u64 {
        self.order_gen.load(Ordering::Acquire)
    }

    /// The drain deadline passed: workers close what is left at once.
    pub fn force_close(&self) {
        self.force.store(true, Ordering::Release);
        self.wake_all();
    }

    /// Whether [`Shared::force_close`] was called.
    pub(crate) fn forced(&self) -> bool {
        self.force.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn admission_never_exceeds_the_cap() {
        let shared = Arc::new(Shared::new(1000, Arc::new(AtomicBool::new(false))));
        let admitted: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let shared = &shared;
                    s.spawn(move || (0..600).filter(|_| shared.try_admit().is_ok()).count() as u64)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1000);
        assert_eq!(shared.live(), 1000);
        assert_eq!(shared.try_admit(), Err(RejectReason::Capacity));
        shared.release();
        assert_eq!(shared.live(), 999);
        assert!(shared.try_admit().is_ok());
        assert!(shared.try_admit().is_err());
    }

    #[test]
    fn closing_connections_hold_their_slot_but_do_not_serve() {
        let shared = Shared::new(2, Arc::new(AtomicBool::new(false)));
        assert!(shared.try_admit().is_ok() && shared.try_admit().is_ok());
        shared.begin_closing();
        assert_eq!((shared.live(), shared.serving()), (2, 1));
        assert!(
            shared.try_admit().is_err(),
            "a closing connection keeps its slot"
        );
        shared.release_closing();
        assert_eq!((shared.live(), shared.serving()), (1, 1));
        assert!(shared.try_admit().is_ok());
    }

    #[test]
    fn zero_cap_admits_nothing() {
        let shared = Shared::new(0, Arc::new(AtomicBool::new(false)));
        assert!(shared.try_admit().is_err());
        assert_eq!(shared.live(), 0);
    }

    /// A limit turns connections away above it and keeps the held ones; it
    /// lapses by itself once its time is over, can be replaced, and can be
    /// lifted; the cap still binds under a higher limit.
    #[test]
    fn a_limit_turns_away_above_it_until_it_lapses_or_is_lifted() {
        let shared = Shared::new(5, Arc::new(AtomicBool::new(false)));
        for _ in 0..3 {
            shared.try_admit().unwrap();
        }
        let now = Instant::now();
        shared.set_limit(Some((2, Duration::from_secs(60))), now);
        assert_eq!(shared.try_admit(), Err(RejectReason::Limit));
        assert_eq!(shared.live(), 3, "held connections stay");
        assert_eq!(shared.admitting(now), 2);
        shared.release();
        shared.release();
        assert!(shared.try_admit().is_ok(), "below the limit");
        assert_eq!(shared.try_admit(), Err(RejectReason::Limit));
        // Its time over: lifted, and the cap binds again.
        assert_eq!(shared.admitting(now + Duration::from_secs(61)), 5);
        assert!(shared.try_admit().is_ok());
        // A limit already past its time lifts itself at the next refusal.
        shared.set_limit(Some((2, Duration::ZERO)), now);
        assert!(shared.try_admit().is_ok(), "a lapsed limit admits");
        assert_eq!(shared.live(), 4);
        // Above the cap, the cap turns away; a lift restores the cap.
        shared.set_limit(Some((100, Duration::from_secs(60))), Instant::now());
        assert!(shared.try_admit().is_ok());
        assert_eq!(shared.try_admit(), Err(RejectReason::Capacity));
        shared.set_limit(Some((1, Duration::from_secs(60))), Instant::now());
        shared.set_limit(None, Instant::now());
        assert_eq!(shared.admitting(Instant::now()), 5);
    }

    #[test]
    fn close_order_follows_its_rate_and_count() {
        let o = CloseOrder::new(CloseReason::Shed, 100, 50.0);
        let t0 = o.start;
        // One at once, then 50 per second, never more than asked.
        assert_eq!(o.claim(10, t0), 1);
        assert_eq!(o.claim(10, t0), 0);
        assert_eq!(o.claim(100, t0 + Duration::from_millis(500)), 25);
        assert_eq!(o.taken(), 26);
        o.unclaim(6);
        assert_eq!(o.claim(3, t0 + Duration::from_millis(500)), 3);
        assert_eq!(o.claim(1000, t0 + Duration::from_secs(60)), 77);
        assert!(o.done());
        assert_eq!(o.claim(1, t0 + Duration::from_secs(61)), 0);
        // No rate: everything at once.
        let all = CloseOrder::new(CloseReason::Shutdown, u64::MAX, 0.0);
        assert_eq!(all.claim(5000, all.start), 5000);
        assert!(!all.done());
        assert_eq!(CloseOrder::new(CloseReason::Shed, 3, f64::NAN).rate, 0.0);
    }

    /// Issue 21: a shed that cannot find its count lapses after its time
    /// at its rate plus the lapse; a drain never does. A shed spares
    /// connections in their handshake; a drain takes them.
    #[test]
    fn a_shed_lapses_and_spares_handshakes_a_drain_does_neither() {
        use crate::conn::Phase;
        let shed = CloseOrder::new(CloseReason::Shed, 20, 10.0);
        let t0 = shed.start;
        assert!(!shed.over(t0 + Duration::from_secs(6)));
        assert!(shed.over(t0 + Duration::from_secs_f64(2.0 + SHED_LAPSE_SECONDS)));
        assert!(!shed.takes(Phase::Handshake));
        assert!(shed.takes(Phase::Open));
        let drain = CloseOrder::new(CloseReason::Shutdown, u64::MAX, 10.0);
        assert!(!drain.over(drain.start + Duration::from_secs(1_000_000)));
        assert!(drain.takes(Phase::Handshake));
        assert!(!drain.takes(Phase::Closing) && !shed.takes(Phase::Closing));
    }
}
