//! Exponential back-off with jitter, written once: the reconnect back-off of a connection
//! (a single-address channel's, a balanced channel's replicas') and the waits of a
//! [`RetryPolicy`](crate::RetryPolicy) between attempts.
//!
//! A connection that could not be made is not dialled again before its back-off has passed
//! (gRPC's TRANSIENT_FAILURE): calls in that window fail at once, with the last error and the
//! time of the next attempt, instead of each call trying its own connect. The first back-off
//! is [`FIRST_BACKOFF`]; each further failure multiplies it by [`MULTIPLIER`] (gRPC's
//! connection back-off), up to [`MAX_BACKOFF`], with ±[`JITTER`] so that clients that lost
//! the same server do not come back in lock step. A success starts over.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The first reconnect back-off.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest reconnect back-off.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// What each failed reconnect multiplies the back-off by.
pub(crate) const MULTIPLIER: f64 = 1.6;
/// The reconnect back-off's jitter: each wait is the back-off times `1 ± JITTER`.
pub(crate) const JITTER: f64 = 0.2;

const _: () = assert!(FIRST_BACKOFF.as_nanos() <= MAX_BACKOFF.as_nanos());
const _: () = assert!(MULTIPLIER >= 1.0 && JITTER >= 0.0 && JITTER < 1.0);

/// `base` times `1 + jitter * r`, for `r` in `-1..=1` (`jitter` in `0..=1`).
pub(crate) fn jittered(base: Duration, jitter: f64, r: f64) -> Duration {
    let f = 1.0 + jitter.clamp(0.0, 1.0) * r.clamp(-1.0, 1.0);
    base.mul_f64(f.max(0.0))
}

/// The back-off after `base`: `base * multiplier`, at most `max` (never less than `base`
/// when `base <= max`; no overflow whatever the inputs).
pub(crate) fn grow(base: Duration, multiplier: f64, max: Duration) -> Duration {
    let m = if multiplier.is_finite() {
        multiplier.max(1.0)
    } else {
        1.0
    };
    let next = base.as_secs_f64() * m;
    if next >= max.as_secs_f64() {
        max
    } else {
        Duration::from_secs_f64(next)
    }
}

/// The `n`th wait (`n` from 1) of an exponential back-off: `initial * multiplier^(n-1)`, at
/// most `max`, before jitter.
pub(crate) fn nth(initial: Duration, multiplier: f64, max: Duration, n: u32) -> Duration {
    let mut d = initial.min(max);
    for _ in 1..n {
        if d >= max {
            break;
        }
        d = grow(d, multiplier, max);
    }
    d
}

/// A random number in `-1..=1` for jitter (xorshift64* on one process-wide state: jitter
/// needs spread, not quality; a lost update between threads only repeats a number).
pub(crate) fn random_unit() -> f64 {
    static SEED: AtomicU64 = AtomicU64::new(0);
    let mut x = SEED.load(Ordering::Relaxed);
    if x == 0 {
        x = 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()) ^ now_ns();
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    SEED.store(x, Ordering::Relaxed);
    unit(x.wrapping_mul(0x2545_f491_4f6c_dd1d))
}

/// `x` mapped to `-1..=1` (its top 53 bits).
pub(crate) fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// Nanoseconds since the process epoch (at least 1, so 0 can mean "not backing off").
pub(crate) fn now_ns() -> u64 {
    crate::link::now_ns().max(1)
}

/// The reconnect back-off of one connection target.
pub(crate) struct Reconnect {
    /// No attempt before this many nanoseconds after [`now_ns`]'s epoch (0: none failed):
    /// the per-call check is one load; `state` is locked only after a failure.
    down_until_ns: AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The next back-off (zero: the first).
    next: Duration,
    last_error: String,
}

impl Reconnect {
    pub(crate) fn new() -> Reconnect {
        Reconnect {
            down_until_ns: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        }
    }

    /// Whether an attempt must wait (at `now`, from [`now_ns`]).
    pub(crate) fn is_down(&self, now: u64) -> bool {
        now < self.down_until_ns.load(Ordering::Acquire)
    }

    /// Whether the last attempt failed (down now or not).
    pub(crate) fn has_failed(&self) -> bool {
        self.down_until_ns.load(Ordering::Acquire) != 0
    }

    /// How long until the next attempt may be made, if one must wait.
    pub(crate) fn wait_left(&self) -> Option<Duration> {
        let until = self.down_until_ns.load(Ordering::Acquire);
        let now = now_ns();
        (now < until).then(|| Duration::from_nanos(until - now))
    }

    /// The error of the last failed attempt.
    pub(crate) fn last_error(&self) -> String {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last_error.clone()
    }

    /// An attempt succeeded: the back-off starts over.
    pub(crate) fn succeeded(&self) {
        if self.has_failed() {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            *s = State::default();
            self.down_until_ns.store(0, Ordering::Release);
        }
    }

    /// An attempt failed with `why`: no attempt for the next back-off (with `r` in `-1..=1`
    /// as the jitter's random number), which is returned.
    ///
    /// Failures while it already backs off (calls that raced the first failure of the same
    /// outage) do not grow the back-off: one outage, one step.
    pub(crate) fn failed(&self, why: &str, r: f64) -> Duration {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (now, until) = (now_ns(), self.down_until_ns.load(Ordering::Acquire));
        if now < until {
            why.clone_into(&mut s.last_error);
            return Duration::from_nanos(until - now);
        }
        let base = if s.next.is_zero() {
            FIRST_BACKOFF
        } else {
            s.next
        };
        let wait = jittered(base, JITTER, r);
        let until = now_ns().saturating_add(u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX));
        self.down_until_ns.store(until, Ordering::Release);
        s.next = grow(base, MULTIPLIER, MAX_BACKOFF);
        why.clone_into(&mut s.last_error);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_grow_by_the_multiplier_up_to_the_cap() {
        let ms = Duration::from_millis;
        assert_eq!(nth(ms(100), 2.0, ms(1000), 1), ms(100));
        assert_eq!(nth(ms(100), 2.0, ms(1000), 2), ms(200));
        assert_eq!(nth(ms(100), 2.0, ms(1000), 4), ms(800));
        assert_eq!(nth(ms(100), 2.0, ms(1000), 5), ms(1000));
        assert_eq!(nth(ms(100), 2.0, ms(1000), u32::MAX), ms(1000));
        // Initial above the cap, multiplier below 1, NaN: still bounded, never shrinking.
        assert_eq!(nth(ms(5000), 2.0, ms(1000), 1), ms(1000));
        assert_eq!(nth(ms(100), 0.5, ms(1000), 3), ms(100));
        assert_eq!(nth(ms(100), f64::NAN, ms(1000), 3), ms(100));
        assert_eq!(grow(Duration::MAX, 10.0, ms(7)), ms(7));
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let base = Duration::from_millis(1000);
        assert_eq!(jittered(base, 0.2, 1.0), Duration::from_millis(1200));
        assert_eq!(jittered(base, 0.2, -1.0), Duration::from_millis(800));
        assert_eq!(jittered(base, 0.0, 0.7), base);
        // Out-of-range inputs are clamped.
        assert_eq!(jittered(base, 5.0, -3.0), Duration::ZERO);
        for _ in 0..10_000 {
            let r = random_unit();
            assert!((-1.0..=1.0).contains(&r), "{r}");
        }
        assert_eq!(unit(0), -1.0);
        assert!(unit(u64::MAX) <= 1.0);
    }

    #[test]
    fn reconnect_backs_off_exponentially_and_starts_over_on_success() {
        let r = Reconnect::new();
        // The window passes (as if the wait went by).
        let pass = |r: &Reconnect| r.down_until_ns.store(1, Ordering::Release);
        assert!(!r.is_down(now_ns()) && r.wait_left().is_none() && !r.has_failed());
        // No jitter (r = 0): 200 ms, 320 ms, 512 ms, ...
        assert_eq!(r.failed("refused", 0.0), FIRST_BACKOFF);
        assert!(r.is_down(now_ns()));
        assert!(r.wait_left().is_some_and(|w| w <= FIRST_BACKOFF));
        assert_eq!(r.last_error(), "refused");
        // Failures within the window (the same outage) wait out the same window.
        let again = r.failed("refused too", 1.0);
        assert!(again <= FIRST_BACKOFF, "{again:?}");
        assert_eq!(r.last_error(), "refused too");
        pass(&r);
        assert_eq!(r.failed("again", 0.0), Duration::from_millis(320));
        pass(&r);
        assert_eq!(r.failed("again", 0.0), Duration::from_millis(512));
        let mut last = Duration::ZERO;
        for _ in 0..40 {
            pass(&r);
            last = r.failed("down", 0.0);
        }
        assert_eq!(last, MAX_BACKOFF);
        pass(&r);
        assert_eq!(r.failed("down", 1.0), MAX_BACKOFF.mul_f64(1.0 + JITTER));
        r.succeeded();
        assert!(!r.has_failed() && r.wait_left().is_none());
        assert_eq!(r.failed("x", 0.0), FIRST_BACKOFF);
    }
}
