//! Retries that never run a handler twice unless its method says that is safe: the policy
//! ([`RetryPolicy`], in gRPC A6's shape) and the per-call bookkeeping of attempts.

use std::time::{Duration, Instant};

use super::backoff;
use crate::method::{CallKind, MethodDesc};
use crate::{Code, Status};

/// Most attempts a policy may allow (gRPC A6 caps `maxAttempts` at 5 too).
pub const MAX_ATTEMPTS: u32 = 5;

/// Attempts of a call that provably reached no handler when the channel has no policy (one
/// transparent retry, as gRPC's); with a policy, its `max_attempts` when that is more.
pub const TRANSPARENT_ATTEMPTS: u32 = 2;

const _: () = assert!(TRANSPARENT_ATTEMPTS >= 1 && TRANSPARENT_ATTEMPTS <= MAX_ATTEMPTS);

/// How a channel retries failed calls, in the shape of gRPC's retry policy (A6): attempts,
/// an exponential back-off with jitter between them, and the status codes worth retrying.
/// Set it with [`ChannelBuilder::retry_policy`](crate::ChannelBuilder::retry_policy) or
/// [`Channel::with_retry_policy`](crate::Channel::with_retry_policy) (balanced channels too).
///
/// # What is retried
///
/// A call is sent again only when that cannot run a handler twice by surprise:
///
/// - it **provably reached no handler** ([`Status::is_not_executed`]): connecting or the
///   handshake failed (or the connection is in its reconnect back-off), the connection was
///   lost or the server said GoAway before the request was posted, or a draining server
///   refused it unexecuted. Such calls are retried whatever the method, as gRPC's
///   transparent retries are: up to `max_attempts` attempts in all, at least
///   [`TRANSPARENT_ATTEMPTS`] even without a policy (then at once, with no back-off). On a
///   balanced channel the next attempt goes to another replica when there is one.
/// - or its method is declared **idempotent** ([`Idempotency::Idempotent`] or
///   [`Idempotency::NoSideEffects`], from `option idempotency_level` or `#[rpc(idempotent)]`)
///   and it failed with one of the policy's retryable codes (default `UNAVAILABLE`), e.g. its
///   connection died after the request was posted. Only with a policy.
///
/// Every attempt after the first waits for the back-off (`initial_backoff`, times
/// `backoff_multiplier` per attempt, at most `max_backoff`, each ±`jitter`); on a
/// single-address channel whose reconnect is backing off, a policy's retry waits for the next
/// connect attempt too, if that comes within `max_backoff` (else the call fails at once). A request's timeout covers all attempts and waits: a retry that
/// could not start before it passes is not made, and each attempt gets only what is left of
/// it. The call fails with the last attempt's status.
///
/// # Call kinds
///
/// - Unary calls, async and blocking: as above.
/// - Server streaming: as unary calls until the first response message (the call returns
///   with it, or fails with a status that came before any message, such as a draining
///   server's refusal). A status that ends the stream after that is the caller's.
/// - Client streaming and bidirectional streaming: only while getting a connection (connect,
///   handshake, reconnect back-off): the request stream is handed to the call after that and
///   is not replayed.
/// - Pipelines ([`Channel::pipeline`](crate::Channel::pipeline)) are never retried: they stay
///   on the connection they were made on, and their calls fail with its status
///   (`is_not_executed` tells which were never posted).
///
/// # Cost
///
/// A call that is not retried costs what it did without retries: no allocation, no clone of
/// the request (the caller's request is kept until the outcome is known and sent again by
/// reference), one clock read for a call that has a timeout. A retried request is encoded
/// again (a registered `bytes` field is then copied, not sent from where it lies).
///
/// [`Idempotency::Idempotent`]: crate::Idempotency::Idempotent
/// [`Idempotency::NoSideEffects`]: crate::Idempotency::NoSideEffects
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    backoff_multiplier: f64,
    jitter: f64,
    /// Bit `c` set: code `c` is retryable.
    retryable: u32,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy::new()
    }
}

impl RetryPolicy {
    /// Three attempts, 100 ms initial back-off doubling up to 1 s with ±20% jitter, retrying
    /// `UNAVAILABLE`.
    pub const fn new() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            backoff_multiplier: 2.0,
            jitter: 0.2,
            retryable: 1 << Code::Unavailable as u32,
        }
    }

    /// Attempts in all, the first included (clamped to `1..=`[`MAX_ATTEMPTS`]; 1: no retry
    /// of calls that may have executed, transparent retries only).
    #[must_use]
    pub const fn max_attempts(mut self, n: u32) -> RetryPolicy {
        self.max_attempts = if n < 1 {
            1
        } else if n > MAX_ATTEMPTS {
            MAX_ATTEMPTS
        } else {
            n
        };
        self
    }

    /// The wait before the second attempt.
    #[must_use]
    pub const fn initial_backoff(mut self, d: Duration) -> RetryPolicy {
        self.initial_backoff = d;
        self
    }

    /// The longest wait between attempts.
    #[must_use]
    pub const fn max_backoff(mut self, d: Duration) -> RetryPolicy {
        self.max_backoff = d;
        self
    }

    /// What each further wait is multiplied by (at least 1; not a number counts as 1).
    #[must_use]
    pub fn backoff_multiplier(mut self, m: f64) -> RetryPolicy {
        self.backoff_multiplier = if m.is_finite() { m.max(1.0) } else { 1.0 };
        self
    }

    /// Each wait is the back-off times `1 ± jitter`, at random (clamped to `0..=1`).
    #[must_use]
    pub fn jitter(mut self, fraction: f64) -> RetryPolicy {
        self.jitter = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        self
    }

    /// The codes worth retrying for idempotent methods (replacing the default
    /// `UNAVAILABLE`). `OK` is ignored.
    #[must_use]
    pub fn retryable_codes(mut self, codes: &[Code]) -> RetryPolicy {
        self.retryable = codes
            .iter()
            .filter(|c| **c != Code::Ok)
            .fold(0, |m, c| m | 1 << (*c as u32));
        self
    }

    /// Whether `code` is one of the retryable codes.
    pub fn is_retryable(&self, code: Code) -> bool {
        self.retryable & (1 << (code as u32)) != 0
    }

    /// The wait before attempt `n + 1` (after `n` attempts, `n >= 1`), before jitter.
    fn backoff(&self, n: u32) -> Duration {
        backoff::nth(
            self.initial_backoff,
            self.backoff_multiplier,
            self.max_backoff,
            n,
        )
    }
}

/// The attempts of one call: whether a failed one is tried again, after what wait, with what
/// timeout. Lives on the caller's stack; reads the clock only when the call has a timeout.
pub(crate) struct Attempts<'a> {
    policy: Option<&'a RetryPolicy>,
    method: &'a MethodDesc,
    /// Attempts made so far.
    made: u32,
    /// The request's timeout and when the call started (only when it has one).
    deadline: Option<(Instant, Duration)>,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(
        policy: Option<&'a RetryPolicy>,
        method: &'a MethodDesc,
        timeout: Option<Duration>,
    ) -> Attempts<'a> {
        Attempts {
            policy,
            method,
            made: 0,
            deadline: timeout.map(|t| (Instant::now(), t)),
        }
    }

    /// After a failed attempt with `status`: the wait before the next one, or `None` to give
    /// up. `connect_in` is how long until the channel's next connect attempt when its
    /// reconnect is backing off. `random` is in `-1..=1` (the jitter).
    pub(crate) fn retry(
        &mut self,
        status: &Status,
        connect_in: Option<Duration>,
        random: f64,
    ) -> Option<Duration> {
        self.made = self.made.saturating_add(1);
        let limit = self.policy.map_or(0, |p| p.max_attempts);
        let wait = if status.is_not_executed() {
            if self.made >= limit.max(TRANSPARENT_ATTEMPTS) {
                return None;
            }
            match self.policy {
                // Transparent retry without a policy: at once, unless there is nothing to
                // try before the channel's next connect (the attempt would fail the same).
                None if connect_in.is_some() => return None,
                None => Duration::ZERO,
                Some(p) => self.wait(p, connect_in, random)?,
            }
        } else {
            let p = self.policy?;
            // A server-streaming call fails here only before its first message.
            let kind_ok = matches!(
                self.method.kind,
                CallKind::Unary | CallKind::ServerStreaming
            );
            if !kind_ok
                || !self.method.idempotency.is_retry_safe()
                || !p.is_retryable(status.code())
                || self.made >= limit
            {
                return None;
            }
            self.wait(p, connect_in, random)?
        };
        if let Some((start, t)) = self.deadline
            && start.elapsed().saturating_add(wait) >= t
        {
            return None;
        }
        Some(wait)
    }

    /// The policy's back-off before the next attempt, or the channel's next connect if that
    /// is later; `None` when the connect is further off than the policy's longest wait (a
    /// long outage fails the call instead of holding it).
    fn wait(&self, p: &RetryPolicy, connect_in: Option<Duration>, random: f64) -> Option<Duration> {
        let w = backoff::jittered(p.backoff(self.made), p.jitter, random);
        match connect_in {
            Some(c) if c > p.max_backoff.max(w) => None,
            Some(c) => Some(w.max(c)),
            None => Some(w),
        }
    }

    /// What is left of the request's timeout for the next attempt.
    pub(crate) fn timeout_left(&self) -> Option<Duration> {
        self.deadline
            .map(|(start, t)| t.saturating_sub(start.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Idempotency;

    const PLAIN: MethodDesc = MethodDesc::new("/t.S/Plain", CallKind::Unary);
    const IDEM: MethodDesc =
        MethodDesc::new("/t.S/Idem", CallKind::Unary).with_idempotency(Idempotency::Idempotent);
    const IDEM_STREAM: MethodDesc = MethodDesc::new("/t.S/Watch", CallKind::ServerStreaming)
        .with_idempotency(Idempotency::NoSideEffects);

    fn lost() -> Status {
        Status::unavailable("connection lost")
    }

    fn refused() -> Status {
        Status::unavailable("draining").not_executed()
    }

    #[test]
    fn policy_setters_clamp() {
        let p = RetryPolicy::new()
            .max_attempts(99)
            .backoff_multiplier(f64::NAN)
            .jitter(7.0);
        assert_eq!(p.max_attempts, MAX_ATTEMPTS);
        assert_eq!(p.backoff_multiplier, 1.0);
        assert_eq!(p.jitter, 1.0);
        assert_eq!(RetryPolicy::new().max_attempts(0).max_attempts, 1);
        assert!(RetryPolicy::default().is_retryable(Code::Unavailable));
        assert!(!RetryPolicy::default().is_retryable(Code::Internal));
        let p = RetryPolicy::new().retryable_codes(&[Code::Ok, Code::Aborted, Code::Internal]);
        assert!(p.is_retryable(Code::Aborted) && p.is_retryable(Code::Internal));
        assert!(!p.is_retryable(Code::Unavailable) && !p.is_retryable(Code::Ok));
    }

    #[test]
    fn backoff_follows_a6() {
        let p = RetryPolicy::new()
            .initial_backoff(Duration::from_millis(10))
            .max_backoff(Duration::from_millis(35))
            .backoff_multiplier(2.0);
        let ms = Duration::from_millis;
        assert_eq!(
            [p.backoff(1), p.backoff(2), p.backoff(3), p.backoff(4)],
            [ms(10), ms(20), ms(35), ms(35)]
        );
    }

    #[test]
    fn not_executed_is_retried_without_a_policy_once_and_at_once() {
        let mut a = Attempts::new(None, &PLAIN, None);
        assert_eq!(a.retry(&refused(), None, 0.0), Some(Duration::ZERO));
        assert_eq!(a.retry(&refused(), None, 0.0), None);
        // Nothing to gain while the channel's reconnect backs off.
        let mut a = Attempts::new(None, &PLAIN, None);
        assert_eq!(
            a.retry(&refused(), Some(Duration::from_millis(5)), 0.0),
            None
        );
        // A call that may have run is never retried without a policy.
        let mut a = Attempts::new(None, &IDEM, None);
        assert_eq!(a.retry(&lost(), None, 0.0), None);
    }

    #[test]
    fn may_have_run_is_retried_only_for_idempotent_unary_and_retryable_codes() {
        let p = RetryPolicy::new()
            .max_attempts(3)
            .initial_backoff(Duration::from_millis(10))
            .jitter(0.0);
        let mut a = Attempts::new(Some(&p), &PLAIN, None);
        assert_eq!(a.retry(&lost(), None, 0.0), None);
        let mut a = Attempts::new(Some(&p), &IDEM, None);
        assert_eq!(a.retry(&Status::internal("x"), None, 0.0), None);
        let mut a = Attempts::new(Some(&p), &IDEM_STREAM, None);
        assert!(
            a.retry(&lost(), None, 0.0).is_some(),
            "before its first message"
        );
        const BIDI: MethodDesc = MethodDesc::new("/t.S/Chat", CallKind::Streaming)
            .with_idempotency(Idempotency::Idempotent);
        let mut a = Attempts::new(Some(&p), &BIDI, None);
        assert_eq!(a.retry(&lost(), None, 0.0), None);
        let mut a = Attempts::new(Some(&p), &IDEM, None);
        assert_eq!(a.retry(&lost(), None, 0.0), Some(Duration::from_millis(10)));
        assert_eq!(a.retry(&lost(), None, 0.0), Some(Duration::from_millis(20)));
        assert_eq!(a.retry(&lost(), None, 0.0), None, "three attempts in all");
        // Not-executed retries take the policy's back-off and the reconnect's wait.
        let mut a = Attempts::new(Some(&p), &PLAIN, None);
        let c = Duration::from_millis(40);
        assert_eq!(a.retry(&refused(), Some(c), 0.0), Some(c));
        // ... but not a connect further off than the longest back-off (1 s here).
        let mut far = Attempts::new(Some(&p), &PLAIN, None);
        assert_eq!(
            far.retry(&refused(), Some(Duration::from_secs(5)), 0.0),
            None
        );
        assert_eq!(
            a.retry(&refused(), None, 0.0),
            Some(Duration::from_millis(20))
        );
        assert_eq!(a.retry(&refused(), None, 0.0), None);
        // A policy of one attempt still allows the transparent retry.
        let one = p.max_attempts(1);
        let mut a = Attempts::new(Some(&one), &IDEM, None);
        assert!(a.retry(&refused(), None, 0.0).is_some());
        let mut a = Attempts::new(Some(&one), &IDEM, None);
        assert_eq!(a.retry(&lost(), None, 0.0), None);
    }

    #[test]
    fn the_deadline_bounds_attempts_and_waits() {
        let p = RetryPolicy::new()
            .initial_backoff(Duration::from_millis(50))
            .jitter(0.0);
        let mut a = Attempts::new(Some(&p), &IDEM, Some(Duration::from_millis(30)));
        assert_eq!(
            a.retry(&lost(), None, 0.0),
            None,
            "the wait passes the deadline"
        );
        let mut a = Attempts::new(Some(&p), &IDEM, Some(Duration::from_secs(60)));
        assert!(a.retry(&lost(), None, 0.0).is_some());
        let left = a.timeout_left().expect("a timeout");
        assert!(left <= Duration::from_secs(60) && left > Duration::from_secs(59));
        assert!(Attempts::new(None, &PLAIN, None).timeout_left().is_none());
    }
}
