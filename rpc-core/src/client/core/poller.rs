//! Who drives the connection and how it waits: the poller thread (spin, then sleep on the
//! doorbell and the completion channel), the driver task of `ClientPoller::Caller`, and callers
//! that drive it themselves.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::Status;
use crate::client::ClientPoller;
use crate::poll_policy::{Budget, CLOCK_EVERY, Spinner, Wait};
use crate::server::notify::wait_readable;
use crate::verbs::{AsyncEvent, CompChannel, Cq, Provider};

use super::{ClientCore, Driver};

/// How a poller thread waits while idle: spins, then sleeps (no yields: it has the doorbell
/// and the completion channel to sleep on); briefly when the host is contended.
const POLLER: Budget = Budget::adaptive(20_000, 0);

const MAX_SLEEP: Duration = Duration::from_millis(20);

/// How often a busy `ClientPoller::Caller` driver reads the device's asynchronous events (an
/// idle one reads them before it sleeps, the poller thread before each sleep).
const EVENTS_EVERY: Duration = Duration::from_millis(10);

impl<P: Provider> ClientCore<P> {
    pub(super) fn kick(&self) {
        match self.mode {
            ClientPoller::Thread => self.doorbell.ring(),
            ClientPoller::Caller => {
                // With other async calls in flight the driver task is turning on this runtime
                // and posts the submission at its next turn, together with the others of the
                // round (one CQ poll and one pass over the queues for many calls); alone, the
                // call goes out at once.
                if self.async_calls.load(Ordering::Acquire) <= 1 {
                    self.progress();
                }
                // A blocking caller of this connection may be asleep holding the driver (it
                // sleeps only on a contended host; the doorbell is written only then).
                self.doorbell.ring();
                self.drive.notify_one();
            }
        }
    }

    /// Whether async calls are in flight or work is queued (something for the driver task:
    /// blocking calls drive themselves).
    pub(super) fn busy(&self) -> bool {
        self.async_calls.load(Ordering::Acquire) > 0
            || !self.stream_sends.is_empty()
            || !self.cancelled.is_empty()
    }

    /// `ClientPoller::Caller` from async code: a task on the caller's runtime that drives the
    /// connection while calls are in flight, yielding to the runtime between turns, and sleeps
    /// when none is. The futures themselves sleep on their wakers instead of spinning. It ends
    /// when the connection is dropped or stopped.
    pub(crate) async fn drive_task(weak: std::sync::Weak<Self>) {
        let drive = match weak.upgrade() {
            Some(core) => Arc::clone(&core.drive),
            None => return,
        };
        let mut turns = 0u32;
        let mut events_at = Instant::now();
        loop {
            let Some(core) = weak.upgrade() else { return };
            if core.stop.load(Ordering::Acquire) {
                return;
            }
            core.progress();
            if core.busy() {
                // Calls are in flight: look at the device's events every few milliseconds
                // (a clock read every `CLOCK_EVERY` turns).
                turns = turns.wrapping_add(1);
                if turns.is_multiple_of(CLOCK_EVERY) && events_at.elapsed() >= EVENTS_EVERY {
                    events_at = Instant::now();
                    if let Some(mut d) = core.driver.try_lock() {
                        d.device_events(&core);
                    }
                }
                drop(core);
                yield_once().await;
                continue;
            }
            if let Some(mut d) = core.driver.try_lock() {
                d.device_events(&core);
            }
            let notified = drive.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if core.busy() || core.stop.load(Ordering::Acquire) {
                continue;
            }
            drop(core);
            notified.await;
        }
    }

    /// Drives the connection once if no one else is: returns the work done (0 when idle or
    /// when another thread holds the driver token).
    pub(crate) fn progress(&self) -> usize {
        let Some(mut d) = self.driver.try_lock() else {
            return 0;
        };
        d.progress(self)
    }

    /// The poller thread's loop: spins while idle, then sleeps on the doorbell and the
    /// completion channel ([`Driver::sleep`]).
    ///
    /// Spinning pays only while the poller has a core of its own. When the scheduler takes it
    /// away (several pollers and busy servers on few cores: a client of two servers), a
    /// spinner keeps a core from the threads that have work (the server, the caller's
    /// runtime, the poller of the connection in use), and each of them waits a time slice
    /// for it: milliseconds per call. So a poller that sees it was preempted while spinning,
    /// or woke late from a sleep, sleeps at once and spins only briefly for a while (see
    /// [`crate::poll_policy`]): a sleeper woken by an event gets a core back at once.
    pub(crate) fn run_poller(self: Arc<Self>) {
        let mut spin = Spinner::new();
        while !self.stop.load(Ordering::Acquire) {
            if self.progress() > 0 {
                spin.work();
                continue;
            }
            if self.is_dead() && self.free.len() == self.cells.len() {
                // Nothing in flight on a dead connection: sleep until stopped.
                wait_readable(&[self.doorbell.fd()], MAX_SLEEP);
                continue;
            }
            match spin.idle(&POLLER, Instant::now) {
                Wait::Spin => std::hint::spin_loop(),
                Wait::Yield => std::thread::yield_now(),
                Wait::Sleep => {
                    let Some(mut d) = self.driver.try_lock() else {
                        continue;
                    };
                    let started = Instant::now();
                    let asked = d.sleep(&self, MAX_SLEEP);
                    drop(d);
                    spin.woke(started, asked.unwrap_or(Duration::ZERO), Instant::now());
                }
            }
        }
    }
}

/// Gives the runtime a turn: wakes itself and returns `Pending` once. (`tokio::task::yield_now`
/// would do, but on the multi-thread scheduler it queues the waker in a list that may grow: an
/// allocation on the per-call path.)
pub(super) async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await;
}

impl<P: Provider> Driver<P> {
    /// The poller thread's sleep, the verbs way: announce it (doorbell flag), arm the CQ, then
    /// look once more (queues and the CQ) and sleep only if nothing came. A completion that
    /// landed between the last poll and the arming rang nobody (the soft RNIC and a real one
    /// alike signal only completions that arrive after `req_notify`): without the second look
    /// it waits for the next event or the timeout (at most `max`). Returns the timeout it
    /// slept with, `None` when it did not sleep.
    pub(super) fn sleep(&mut self, core: &ClientCore<P>, max: Duration) -> Option<Duration> {
        self.device_events(core);
        core.doorbell.prepare_sleep();
        let _ = self.cq.req_notify(false);
        // Anything queued before the doorbell flag was visible, or completed before the CQ was
        // armed, is seen by this re-check (the flag and the arming are SeqCst stores, the
        // ringers' and the RNIC's checks SeqCst loads).
        if !core.submitted.is_empty() || !core.cancelled.is_empty() || self.progress(core) > 0 {
            core.doorbell.awake();
            return None;
        }
        if core.is_lost() {
            // Nothing to poll: wait for the kill (it rings the doorbell) or the fallback.
            wait_readable(&[core.doorbell.fd()], max);
            core.doorbell.awake();
            return Some(max);
        }
        let deadline = self.link.wire.poll_timeout().map(|t| {
            Duration::from_nanos(t.saturating_sub(self.link.now())).max(Duration::from_micros(50))
        });
        let timeout = deadline.unwrap_or(max).min(max);
        wait_readable(&[core.doorbell.fd(), self.channel.fd()], timeout);
        let _ = self.channel.drain();
        core.doorbell.awake();
        Some(timeout)
    }

    pub(super) fn progress(&mut self, core: &ClientCore<P>) -> usize {
        if core.is_dead() {
            if !self.drained_dead {
                self.drained_dead = true;
                self.last_completions(core);
            }
            return self.fail_all(core, core.dead_status());
        }
        if core.is_lost() {
            return self.while_lost(core);
        }
        match self.step(core) {
            Ok(work) => {
                if work > 0 {
                    core.wake_slot_waiters();
                }
                work
            }
            Err(e) => {
                let e = self.link.explain(e);
                warn!("{}: connection failed: {e}", core.describe);
                if e.peer_silent() {
                    self.lose(core, e.status())
                } else {
                    self.die(core, e.status())
                }
            }
        }
    }

    /// The peer stopped answering: nothing more is posted or polled; the control
    /// connection's task waits [`super::LOST_GRACE`] for the server's reason, then kills the
    /// connection with it, or with `status`.
    fn lose(&mut self, core: &ClientCore<P>, status: Status) -> usize {
        let _ = core.lost_status.set((Instant::now(), status));
        core.lost.store(true, Ordering::Release);
        core.lost_notify.notify_one();
        0
    }

    /// Waits for the control connection's task to kill the connection; kills it after
    /// [`super::LOST_FALLBACK`] if nobody did.
    fn while_lost(&mut self, core: &ClientCore<P>) -> usize {
        match core.lost_status.get() {
            Some((at, st)) if at.elapsed() >= super::LOST_FALLBACK => {
                let st = st.clone();
                self.die(core, st)
            }
            Some(_) => 0,
            None => self.die(core, Status::unavailable("connection lost")),
        }
    }

    /// Handles the completions already in the CQ of a connection found dead (the server
    /// answered, then closed it: a drained shutdown), so that answers that arrived are not
    /// failed; posts nothing. Stops at the first error.
    fn last_completions(&mut self, core: &ClientCore<P>) {
        for _ in 0..64 {
            let n = match self.cq.poll(&mut self.wcs) {
                Ok(n) => n,
                Err(_) => return,
            };
            for i in 0..n {
                let wc = self.wcs[i];
                if self.on_completion(core, &wc).is_err() {
                    return;
                }
            }
            if n < self.wcs.len() {
                return;
            }
        }
    }

    /// The connection is dead: every call fails with `status`, new ones reconnect.
    fn die(&mut self, core: &ClientCore<P>, status: Status) -> usize {
        let _ = core.dead_status.set(status.clone());
        core.dead.store(true, Ordering::Release);
        core.cell_freed.notify_waiters();
        core.slot_freed.notify_waiters();
        self.fail_all(core, status)
    }

    /// Reads the device's asynchronous events (ib: a non-blocking read of its event channel;
    /// soft: those a test raised) when the connection idles, off the busy path. A failed
    /// device or CQ, or a failed QP of this connection, kills the connection with
    /// `UNAVAILABLE` naming the cause; the other events are logged.
    pub(super) fn device_events(&mut self, core: &ClientCore<P>) {
        if core.is_dead() {
            return;
        }
        let mut fatal = None;
        let dev = &self.dev;
        crate::link::device_events(
            || dev.poll_async_event(),
            &core.describe,
            |ev, why| {
                let ours = match ev {
                    AsyncEvent::DeviceFatal | AsyncEvent::CqError => true,
                    AsyncEvent::QpFatal { qp_num } => self.link.owns_qp(qp_num),
                    _ => false,
                };
                if ours {
                    warn!(
                        "{}: {} ({ev:?}): the connection fails",
                        core.describe,
                        ev.cause()
                    );
                    fatal = Some(why);
                    return false;
                }
                info!("{}: {} ({ev:?})", core.describe, ev.cause());
                true
            },
        );
        if let Some(why) = fatal {
            self.die(core, why);
        }
    }
}
