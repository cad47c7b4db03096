//! Whether a mid-sized request in ordinary memory is sent pending, learned per connection.
//!
//! Sending a request pending ([`super::encode::FillJob`]) overlaps the caller's copy of its
//! large field with the server's READ of it. From [`super::PENDING_MIN`] on that always paid;
//! below it, it depends on the host: on the development VM's Intel host a 1 MiB echo took
//! 232-253 µs pending against 284-329 µs copied first, on its AMD host 112-118 µs against
//! 71-79 µs (`benches/HISTORY.md`). So a connection with the default threshold measures both
//! ways for requests from [`AUTO_MIN`] up to the threshold and sends each the way that has
//! been faster:
//!
//! - each way keeps a moving average of what its calls took, from the request's encoding to
//!   its response, per MiB of request (the handler's and the response's time are in both, the
//!   same on average);
//! - a way without a figure is tried first; after that every [`EXPLORE`]th call goes the
//!   other way, so that a figure gone stale (the host's state changed) is renewed;
//! - one sample moves an average by an eighth at most of twice its value (a call that waited
//!   for a preempted thread does not flip the choice by itself); failed calls do not count.
//!
//! Atomics only (no lock, no allocation): the driver records as responses arrive, callers
//! choose as they encode. Two callers racing may both explore, or both not: harmless.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When a request the connection chose the way of began, which way it went and its size
/// (kept with its call; [`Overlap::record`]ed when the response arrives).
#[derive(Clone, Copy, Debug)]
pub(super) struct Timed {
    pub(super) started: Instant,
    pub(super) pending: bool,
    pub(super) len: usize,
}

/// Requests from this size (encoded) up to the pending threshold are sent the way measured
/// faster. Below it a copy costs less than the BulkReady frames and READs of its parts.
pub(crate) const AUTO_MIN: usize = 1 << 20;

/// Every this many choices, the way not chosen is tried.
const EXPLORE: u32 = 16;

/// A new sample weighs 1 / 2^WEIGHT_SHIFT in the moving average.
const WEIGHT_SHIFT: u32 = 3;

/// What the two ways have cost on one connection.
#[derive(Debug, Default)]
pub(crate) struct Overlap {
    /// Nanoseconds per MiB of request: copied first `[0]`, pending `[1]` (0: no figure yet).
    cost: [AtomicU64; 2],
    /// Choices made so far.
    choices: AtomicU32,
}

impl Overlap {
    /// Whether the next mid-sized request goes pending.
    pub(crate) fn choose(&self) -> bool {
        let n = self.choices.fetch_add(1, Ordering::Relaxed);
        let whole = self.cost[0].load(Ordering::Relaxed);
        let pending = self.cost[1].load(Ordering::Relaxed);
        if whole == 0 {
            return false;
        }
        if pending == 0 {
            return true;
        }
        let faster = pending < whole;
        if n % EXPLORE == EXPLORE - 1 {
            !faster
        } else {
            faster
        }
    }

    /// A call whose request of `len` bytes went `pending` (or was copied first) got its
    /// response `took` after its encoding began.
    pub(crate) fn record(&self, pending: bool, len: usize, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let per_mib =
            (u128::from(ns) * (1 << 20) / len.max(1) as u128).min(u128::from(u64::MAX)) as u64;
        let c = &self.cost[usize::from(pending)];
        let old = c.load(Ordering::Relaxed);
        let new = if old == 0 {
            per_mib
        } else {
            let sample = per_mib.min(old.saturating_mul(2));
            old - (old >> WEIGHT_SHIFT) + (sample >> WEIGHT_SHIFT)
        };
        c.store(new.max(1), Ordering::Relaxed);
    }

    /// The averages, ns per MiB (copied first, pending; 0: none yet).
    #[cfg(test)]
    fn costs(&self) -> (u64, u64) {
        (
            self.cost[0].load(Ordering::Relaxed),
            self.cost[1].load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Makes `n` choices, recording for each what the way chosen costs.
    fn run(o: &Overlap, n: usize, whole: u64, pending: u64) -> usize {
        let mut went_pending = 0;
        for _ in 0..n {
            let p = o.choose();
            went_pending += usize::from(p);
            o.record(p, 2 * MIB, us(if p { pending } else { whole }));
        }
        went_pending
    }

    #[test]
    fn tries_each_way_first_then_keeps_the_faster() {
        let o = Overlap::default();
        assert!(!o.choose(), "copied first before any figure");
        o.record(false, 2 * MIB, us(600));
        assert!(o.choose(), "pending before it has a figure");
        o.record(true, 2 * MIB, us(400));
        assert_eq!(o.costs(), (300_000, 200_000));
        // Pending is faster: 15 of every 16 choices go pending, the 16th tries the other.
        let p = run(&o, 160, 600, 400);
        assert_eq!(p, 150);
    }

    #[test]
    fn follows_the_host_when_the_faster_way_changes() {
        let o = Overlap::default();
        run(&o, 64, 600, 400);
        let (whole, pending) = o.costs();
        assert!(pending < whole);
        // The host changes: pending now costs three times as much. The explored calls keep
        // the copied figure fresh and the pending figure climbs: the choice flips.
        run(&o, 200, 600, 1800);
        let (whole, pending) = o.costs();
        assert!(pending > whole, "{pending} <= {whole}");
        let p = run(&o, 160, 600, 1800);
        assert_eq!(p, 10, "only the explored calls go pending");
    }

    #[test]
    fn one_slow_call_does_not_flip_the_choice() {
        let o = Overlap::default();
        run(&o, 64, 600, 500);
        // A call preempted for a scheduler tick.
        o.record(true, 2 * MIB, us(4000));
        let (whole, pending) = o.costs();
        assert!(pending < whole, "{pending} >= {whole}");
    }

    #[test]
    fn figures_are_per_mib_and_saturate() {
        let o = Overlap::default();
        o.record(false, 4 * MIB, us(1000));
        assert_eq!(o.costs().0, 250_000);
        o.record(true, 1, Duration::MAX);
        assert_eq!(o.costs().1, u64::MAX);
        o.record(true, 0, Duration::ZERO);
        assert!(o.costs().1 > 0);
    }
}
