//! Hand-offs between the threads that start calls and the one thread that drives a connection.
//!
//! - [`Mailbox`]: one in-flight call's request and response, moved between a caller and the
//!   driver by an atomic state machine (no lock; wakes the caller's task with its waker).
//! - [`Exclusive`]: the right to drive a connection. Whoever wins it polls the CQ and posts;
//!   everybody else carries on and never waits for it (a try-only lock: combining, not
//!   blocking).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;

const FREE: u8 = 0;
const CLAIMED: u8 = 1;
const SUBMITTED: u8 = 2;
const RUNNING: u8 = 3;
const DONE: u8 = 4;
const CANCELLED: u8 = 5;

/// A request of type `Q` and its response of type `R`, handed between a caller and a driver.
///
/// ```text
/// FREE ─claim─> CLAIMED ─submit─> SUBMITTED ─take─> RUNNING ─complete─> DONE ─poll_done─> CLAIMED
///                  │                  └──cancel──┐     └──cancel──┐                 release─> FREE
///                  └─(never submitted) release   CANCELLED <──────┘ (driver finishes, then release)
/// ```
///
/// The caller owns the request until `submit`, the driver from `take`; the driver owns the
/// response until `complete`, the caller after `poll_done`. A cancelled mailbox belongs to the
/// driver, which drops what it holds and releases it.
pub struct Mailbox<Q, R> {
    state: AtomicU8,
    waker: AtomicWaker,
    req: UnsafeCell<Option<Q>>,
    resp: UnsafeCell<Option<R>>,
}

// SAFETY: the request and response cells are only accessed by the side that owns them, as the
// state machine says (each transition is an atomic compare-exchange with acquire/release
// ordering, so the owner's writes are visible to the next owner); `Q` and `R` move between
// threads, hence `Send` bounds.
unsafe impl<Q: Send, R: Send> Sync for Mailbox<Q, R> {}
// SAFETY: as above.
unsafe impl<Q: Send, R: Send> Send for Mailbox<Q, R> {}

/// What [`Mailbox::take`] found.
#[derive(Debug)]
pub enum Taken<Q> {
    /// A request to run (the mailbox is now RUNNING).
    Run(Q),
    /// The caller gave up before the driver took it: drop the request and release the mailbox.
    Cancelled(Q),
    /// Nothing submitted.
    Empty,
}

/// What [`Mailbox::cancel`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The driver owns the mailbox now and will release it.
    ToDriver,
    /// The caller still owns it (it was never submitted, or the response was already there
    /// and has been dropped): the caller releases it.
    Caller,
}

impl<Q, R> Default for Mailbox<Q, R> {
    fn default() -> Self {
        Mailbox {
            state: AtomicU8::new(FREE),
            waker: AtomicWaker::new(),
            req: UnsafeCell::new(None),
            resp: UnsafeCell::new(None),
        }
    }
}

impl<Q, R> std::fmt::Debug for Mailbox<Q, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailbox")
            .field("state", &self.state.load(Ordering::Relaxed))
            .finish()
    }
}

impl<Q, R> Mailbox<Q, R> {
    fn cas(&self, from: u8, to: u8) -> bool {
        self.state
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Caller: takes a FREE mailbox. Returns false when it is not free.
    #[cfg(test)]
    pub fn claim(&self) -> bool {
        self.cas(FREE, CLAIMED)
    }

    /// Caller: takes a FREE mailbox that nobody else can be claiming (the caller got it from
    /// a free list that hands each mailbox to one taker): a store, not a compare-exchange.
    /// Returns false (and takes nothing) when it is not free.
    pub fn claim_exclusive(&self) -> bool {
        if self.state.load(Ordering::Acquire) != FREE {
            return false;
        }
        self.state.store(CLAIMED, Ordering::Release);
        true
    }

    /// Caller: hands `req` to the driver. Returns it back when the mailbox is not CLAIMED.
    ///
    /// # Errors
    /// The request, when the caller does not own the mailbox.
    pub fn submit(&self, req: Q) -> Result<(), Q> {
        if self.state.load(Ordering::Acquire) != CLAIMED {
            return Err(req);
        }
        // SAFETY: CLAIMED: only the caller touches `req`, and nobody reads it until the
        // release-store of SUBMITTED below.
        unsafe { *self.req.get() = Some(req) };
        self.state.store(SUBMITTED, Ordering::Release);
        Ok(())
    }

    /// Driver: takes the submitted request.
    pub fn take(&self) -> Taken<Q> {
        if self.cas(SUBMITTED, RUNNING) {
            // SAFETY: RUNNING: the driver owns `req`; the caller's write happened before its
            // release-store of SUBMITTED, which our acquire CAS observed.
            return match unsafe { (*self.req.get()).take() } {
                Some(q) => Taken::Run(q),
                None => Taken::Empty,
            };
        }
        if self.state.load(Ordering::Acquire) == CANCELLED {
            // SAFETY: CANCELLED belongs to the driver; the request (if the driver never took
            // it) is still in the cell and nobody else touches it.
            if let Some(q) = unsafe { (*self.req.get()).take() } {
                return Taken::Cancelled(q);
            }
        }
        Taken::Empty
    }

    /// Driver: delivers the response and wakes the caller. Returns it back when the caller
    /// cancelled meanwhile (the driver then releases the mailbox).
    ///
    /// # Errors
    /// The response, when the call was cancelled.
    #[cfg(test)]
    pub fn complete(&self, resp: R) -> Result<(), R> {
        self.complete_waking(resp, true)
    }

    /// Driver: delivers the response, waking the caller only when `wake` (a caller that waits
    /// by polling [`Mailbox::try_done`] never registers a waker; waking none still costs a
    /// locked instruction). Returns it back when the caller cancelled meanwhile.
    ///
    /// # Errors
    /// The response, when the call was cancelled.
    pub fn complete_waking(&self, resp: R, wake: bool) -> Result<(), R> {
        if self.state.load(Ordering::Acquire) != RUNNING {
            return Err(resp);
        }
        // SAFETY: RUNNING: the response cell belongs to the driver (the caller reads it only
        // after seeing DONE).
        unsafe { *self.resp.get() = Some(resp) };
        if self.cas(RUNNING, DONE) {
            if wake {
                self.waker.wake();
            }
            Ok(())
        } else {
            // The caller moved it to CANCELLED: take the response back (still ours).
            // SAFETY: CANCELLED belongs to the driver.
            match unsafe { (*self.resp.get()).take() } {
                Some(r) => Err(r),
                None => Ok(()),
            }
        }
    }

    /// Caller: the response, once delivered (the mailbox is CLAIMED again afterwards).
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<R> {
        if let Some(r) = self.try_done() {
            return Poll::Ready(r);
        }
        self.waker.register(cx.waker());
        match self.try_done() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }

    /// Caller: the response if delivered, without registering a waker.
    pub fn try_done(&self) -> Option<R> {
        if self.state.load(Ordering::Acquire) != DONE {
            return None;
        }
        // SAFETY: DONE: the response cell belongs to the caller; the driver's write happened
        // before its release CAS to DONE, which the acquire load observed.
        let r = unsafe { (*self.resp.get()).take() };
        self.state.store(CLAIMED, Ordering::Release);
        r
    }

    /// Caller: gives the call up.
    pub fn cancel(&self) -> CancelOutcome {
        loop {
            match self.state.load(Ordering::Acquire) {
                SUBMITTED if self.cas(SUBMITTED, CANCELLED) => return CancelOutcome::ToDriver,
                RUNNING if self.cas(RUNNING, CANCELLED) => return CancelOutcome::ToDriver,
                DONE => {
                    drop(self.try_done());
                    return CancelOutcome::Caller;
                }
                SUBMITTED | RUNNING => continue,
                _ => return CancelOutcome::Caller,
            }
        }
    }

    /// Whether the request is submitted or running (no response yet, not cancelled).
    pub fn is_running(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), SUBMITTED | RUNNING)
    }

    /// Whether the caller gave the call up (driver side).
    pub fn is_cancelled(&self) -> bool {
        self.state.load(Ordering::Acquire) == CANCELLED
    }

    /// Releases the mailbox (caller after its response, or driver after a cancellation).
    pub fn release(&self) {
        // SAFETY: the releasing side owns the mailbox (CLAIMED by the caller, or CANCELLED by
        // the driver), so nobody else touches the cells; clearing drops anything left.
        unsafe {
            *self.req.get() = None;
            *self.resp.get() = None;
        }
        self.state.store(FREE, Ordering::Release);
    }
}

/// A value one thread at a time may use; others get `None` instead of waiting.
pub struct Exclusive<T> {
    busy: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and at most one guard exists at a time
// (the `busy` flag is taken with an acquire swap and released with a release store), so `T`
// is used by one thread at a time: `T: Send` suffices.
unsafe impl<T: Send> Sync for Exclusive<T> {}

impl<T> Exclusive<T> {
    /// Wraps `value`.
    pub fn new(value: T) -> Exclusive<T> {
        Exclusive {
            busy: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// The value, if no one else holds it.
    pub fn try_lock(&self) -> Option<ExclusiveGuard<'_, T>> {
        if self.busy.swap(true, Ordering::Acquire) {
            return None;
        }
        Some(ExclusiveGuard { owner: self })
    }

    /// Whether someone holds it now.
    pub fn is_held(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }
}

impl<T> std::fmt::Debug for Exclusive<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exclusive")
            .field("held", &self.is_held())
            .finish()
    }
}

/// Access to an [`Exclusive`] value; releases it when dropped.
pub struct ExclusiveGuard<'a, T> {
    owner: &'a Exclusive<T>,
}

impl<T> std::ops::Deref for ExclusiveGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while `busy` is held by it: no other reference.
        unsafe { &*self.owner.value.get() }
    }
}

impl<T> std::ops::DerefMut for ExclusiveGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { &mut *self.owner.value.get() }
    }
}

impl<T> Drop for ExclusiveGuard<'_, T> {
    fn drop(&mut self) {
        self.owner.busy.store(false, Ordering::Release);
    }
}

impl<T> std::fmt::Debug for ExclusiveGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExclusiveGuard")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_call_round_trip() {
        let m: Mailbox<u32, String> = Mailbox::default();
        assert!(m.claim());
        assert!(!m.claim());
        m.submit(7).unwrap();
        match m.take() {
            Taken::Run(q) => assert_eq!(q, 7),
            other => panic!("{other:?}"),
        }
        m.complete("ok".into()).unwrap();
        assert_eq!(m.try_done().as_deref(), Some("ok"));
        m.release();
        assert!(m.claim());
    }

    #[test]
    fn an_exclusive_claim_takes_only_a_free_mailbox_and_a_quiet_completion_delivers() {
        let m: Mailbox<u32, u32> = Mailbox::default();
        assert!(m.claim_exclusive());
        assert!(!m.claim_exclusive());
        assert!(!m.claim());
        m.submit(3).unwrap();
        assert!(matches!(m.take(), Taken::Run(3)));
        m.complete_waking(4, false).unwrap();
        assert_eq!(m.try_done(), Some(4));
        m.release();
        assert!(m.claim_exclusive());
    }

    #[test]
    fn cancel_before_take_hands_the_request_to_the_driver() {
        let m: Mailbox<u32, u32> = Mailbox::default();
        m.claim();
        m.submit(1).unwrap();
        assert_eq!(m.cancel(), CancelOutcome::ToDriver);
        assert!(matches!(m.take(), Taken::Cancelled(1)));
        m.release();
        assert!(m.claim());
    }

    #[test]
    fn cancel_while_running_returns_the_response_to_the_driver() {
        let m: Mailbox<u32, u32> = Mailbox::default();
        m.claim();
        m.submit(1).unwrap();
        assert!(matches!(m.take(), Taken::Run(1)));
        assert_eq!(m.cancel(), CancelOutcome::ToDriver);
        assert_eq!(m.complete(5), Err(5));
        m.release();
    }

    #[test]
    fn cancel_after_done_drops_the_response() {
        let m: Mailbox<u32, Arc<()>> = Mailbox::default();
        let probe = Arc::new(());
        m.claim();
        m.submit(1).unwrap();
        let _ = m.take();
        m.complete(Arc::clone(&probe)).unwrap();
        assert_eq!(m.cancel(), CancelOutcome::Caller);
        assert_eq!(Arc::strong_count(&probe), 1);
    }

    #[test]
    fn exclusive_is_try_only() {
        let e = Exclusive::new(0u32);
        let mut g = e.try_lock().unwrap();
        *g += 1;
        assert!(e.try_lock().is_none());
        drop(g);
        assert_eq!(*e.try_lock().unwrap(), 1);
    }

    #[test]
    fn racing_cancel_and_complete_never_lose_or_double_the_response() {
        for _ in 0..2000 {
            let m: Arc<Mailbox<u32, Arc<()>>> = Arc::new(Mailbox::default());
            let probe = Arc::new(());
            m.claim();
            m.submit(1).unwrap();
            let _ = m.take();
            let m2 = Arc::clone(&m);
            let p2 = Arc::clone(&probe);
            let t = std::thread::spawn(move || m2.complete(p2).err());
            let c = m.cancel();
            let back = t.join().unwrap();
            match c {
                CancelOutcome::ToDriver => {
                    drop(back);
                    m.release();
                }
                CancelOutcome::Caller => assert!(back.is_none()),
            }
            assert_eq!(Arc::strong_count(&probe), 1);
        }
    }
}
