//! Who drives the connection and how it waits: the poller thread (spin, then sleep on the
//! doorbell and the completion channel), the driver task of `ClientPoller::Caller`, and callers
//! that drive it themselves.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

use crate::Status;
use crate::client::ClientPoller;
use crate::doorbell::{Doorbell, wait_readable};
use crate::poll_policy::{Budget, CLOCK_EVERY, TimedSpin, Wait, with_thread_spinner};
use crate::verbs::{AsyncEvent, CompChannel, Provider};

use super::group::{Listing, Member};
use super::submit::CALLER_MAX_SLEEP;
use super::{Bell, ClientCore, Driver, Outcome};

/// How often an idle `ClientPoller::Caller` driver task polls a connection that still has
/// calls no caller waits for, or control frames waiting for credit.
const PENDING_TICK: Duration = Duration::from_millis(2);

/// How often a busy `ClientPoller::Caller` driver reads the device's asynchronous events (an
/// idle one reads them before it sleeps, the poller thread before each sleep).
const EVENTS_EVERY: Duration = Duration::from_millis(10);

impl<P: Provider> ClientCore<P> {
    /// Work was queued (before this call) for whoever drives the connection: the poller
    /// thread lists it (`ClientPoller::Thread`), and a sleeping driver is woken.
    pub(super) fn ring(&self) {
        self.list();
        self.ring_doorbell();
    }

    /// As [`ClientCore::ring`], waking the driver whether it sleeps or not.
    pub(super) fn ring_always(&self) {
        self.list();
        if let Some(d) = self.doorbell.get() {
            d.ring_always();
        }
    }

    /// Rings the doorbell if a driver sleeps on it (none can before it exists).
    fn ring_doorbell(&self) {
        if let Some(d) = self.doorbell.get() {
            d.ring();
        }
    }

    /// Puts the connection on its poller thread's list (`ClientPoller::Thread`).
    fn list(&self) {
        if let Some(p) = self.poller {
            p.list(&self.routed.listing);
        }
    }

    pub(super) fn kick(&self) {
        match self.mode {
            ClientPoller::Thread => self.ring(),
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
                self.ring_doorbell();
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
    pub(crate) fn spawn_drive_task(self: &Arc<Self>) {
        // Registered now, at connect: the registration allocates, which a call must not.
        let channel = self
            .channel
            .as_ref()
            .and_then(|c| register_channel(Arc::clone(c)));
        tokio::spawn(Self::drive_task(Arc::downgrade(self), channel));
    }

    async fn drive_task(weak: std::sync::Weak<Self>, channel: Option<AsyncFd<ChannelFd<P>>>) {
        let drive = match weak.upgrade() {
            Some(core) => Arc::clone(&core.drive),
            None => return,
        };
        let mut turns = 0u32;
        let mut events_at = Instant::now();
        // While calls are in flight the task turns once per runtime turn for up to
        // `DRIVE_SPIN_FOR` without work, then sleeps on the completion channel: a task that
        // only yields to its runtime keeps its thread runnable, and on a host with more
        // runnable threads than cores (client processes beside the server) the server and
        // the other processes waited for it, a scheduler tick at a time.
        let mut spin = TimedSpin::new(DRIVE_SPIN_FOR);
        // On a current-thread runtime, `block_on`'s own future is polled only between rounds
        // of up to 61 tasks (tokio's `event_interval`), and a task that wakes itself is
        // polled again within the round: after a turn that delivered something, the task
        // defers its wake-up until the round is over (`tokio::task::yield_now`), or a
        // consumer in `block_on` (the common `#[tokio::main(flavor = "current_thread")]`
        // shape) waited for dozens of idle turns to see its message: 32 B streaming
        // ping-pong took 8.4 µs a round trip, 3.4 µs with the deferral. The multi-thread
        // scheduler runs the task a wake-up readied first, and its deferral list may grow
        // in a call (an allocation), so there it wakes itself as before.
        let defer_after_work = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
        loop {
            let Some(core) = weak.upgrade() else { return };
            if core.stop.load(Ordering::Acquire) {
                return;
            }
            let work = core.progress();
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
                if work > 0 {
                    spin.work();
                    drop(core);
                    yield_after_work(defer_after_work).await;
                    continue;
                }
                match spin.idle(Instant::now) {
                    Wait::Spin => {}
                    Wait::Yield => std::thread::yield_now(),
                    Wait::Sleep => {
                        core.sleep_async(&drive, channel.as_ref(), &mut spin).await;
                        continue;
                    }
                }
                drop(core);
                yield_once().await;
                continue;
            }
            // Calls whose callers are gone (a dropped pipeline's, cancelled) or control frames
            // waiting for the server's credits need the CQ polled although no caller waits:
            // then it looks again every `PENDING_TICK`. So does a driver held by a caller this
            // instant: it may leave a backlog (a dropped pipeline's Cancels) and return.
            let mut pending = core.cells.in_use() != 0;
            match core.driver.try_lock() {
                Some(mut d) => {
                    d.device_events(&core);
                    pending |= d.link.has_backlog();
                }
                None => pending = true,
            }
            let notified = drive.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if core.busy() || core.stop.load(Ordering::Acquire) {
                continue;
            }
            drop(core);
            if pending {
                let _ = tokio::time::timeout(PENDING_TICK, notified).await;
            } else {
                notified.await;
            }
        }
    }

    /// The driver task's sleep once it spun long enough, the async twin of [`Driver::sleep`]: arms
    /// the CQ (unless work came meanwhile) and waits for the completion channel, a
    /// submission (`drive`, notified by every `kick`), or the timeout (a protocol timer, at
    /// most [`CALLER_MAX_SLEEP`]). `channel` is the channel registered with the runtime.
    async fn sleep_async(
        &self,
        drive: &tokio::sync::Notify,
        channel: Option<&AsyncFd<ChannelFd<P>>>,
        spin: &mut TimedSpin,
    ) {
        let notified = drive.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let asked = match self.driver.try_lock() {
            Some(mut d) => d.prepare_sleep(self, CALLER_MAX_SLEEP),
            None => None,
        };
        spin.work();
        let Some(asked) = asked else {
            // Work came, or a caller drives the connection this instant.
            return;
        };
        match channel {
            Some(ch) if !self.is_lost() => {
                tokio::select! {
                    () = &mut notified => {}
                    r = ch.readable() => {
                        if let Ok(mut ready) = r {
                            ready.clear_ready();
                        }
                    }
                    () = tokio::time::sleep(asked) => {}
                }
                if let Some(_d) = self.driver.try_lock()
                    && let Some(c) = &self.channel
                {
                    let _ = c.drain();
                }
            }
            _ => {
                let _ = tokio::time::timeout(asked, notified).await;
            }
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

    /// Hands the connection to the process's poller thread ([`super::group`]).
    pub(crate) fn join_poller(self: &Arc<Self>) -> std::io::Result<()> {
        super::group::Poller::get()?.join(Arc::clone(self) as Arc<dyn Member>);
        Ok(())
    }
}

/// How long a lone async caller of a thread-polled connection drives it itself before it
/// hands it to the poller thread and sleeps on its waker. It covers an answer from a server
/// shard that slept (woken by the request: tens of microseconds on a VM), and is short as
/// busy waits inside a poll go (the task's worker runs nothing else meanwhile).
const CALLER_DRIVE_FOR: Duration = Duration::from_micros(200);

/// The spinning of that drive: no limit in turns on a quiet host (the time is), the
/// detector's brief spin on a contended one, and a yield every `poll_policy::GIVE_WAY` (the
/// server's shard or the poller thread may share the core).
const CALLER_DRIVE: Budget = Budget::adaptive(u32::MAX, 0);

/// How long the `ClientPoller::Caller` driver task turns without work, while calls are in
/// flight, before it sleeps on the completion channel: as long as a lone async caller of a
/// thread-polled connection drives it (an answer from a shard that slept is in it).
const DRIVE_SPIN_FOR: Duration = CALLER_DRIVE_FOR;

/// A completion channel as the runtime's registration holds it: the channel stays open until
/// the registration is dropped (the driver task may end after its connection), so the runtime
/// never deregisters a descriptor number that meanwhile names another file.
pub(super) struct ChannelFd<P: Provider>(Arc<P::CompChannel>);

impl<P: Provider> std::os::fd::AsRawFd for ChannelFd<P> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// A runtime registration of the completion channel; `None` (the task then sleeps on its
/// timer and submissions only) when it cannot be made.
fn register_channel<P: Provider>(channel: Arc<P::CompChannel>) -> Option<AsyncFd<ChannelFd<P>>> {
    // SAFETY: the `AsyncFd` owns a reference to the channel, which closes its descriptor
    // only when dropped (the last reference), and never replaces it: the descriptor stays
    // open, the same file, for the registration's whole life.
    unsafe {
        AsyncFd::register_with_interest(ChannelFd::<P>(channel), tokio::io::Interest::READABLE)
    }
    .map_err(|e| {
        warn!(
            "cannot register a completion channel with the runtime ({e}): the driver task \
             sleeps on timers"
        );
    })
    .ok()
}

/// Async calls of this process waiting for their outcome: a call drives its connection
/// from its own task only when it is the only one (a task that busy-waits inside its poll
/// holds up every other task of its runtime's worker).
static ASYNC_WAITING: AtomicUsize = AtomicUsize::new(0);

/// An async call counted in [`ASYNC_WAITING`] until it is dropped.
pub(super) struct Waiting(bool);

impl Waiting {
    /// Counts the caller in; whether it is the process's only waiting async call.
    pub(super) fn enter() -> Waiting {
        Waiting(ASYNC_WAITING.fetch_add(1, Ordering::AcqRel) == 0)
    }

    pub(super) fn alone(&self) -> bool {
        self.0
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        ASYNC_WAITING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A caller of a `ClientPoller::Thread` connection that drives it itself while it waits (a
/// blocking call; a lone async call, for a while): the poller thread leaves the connection
/// alone meanwhile (it neither turns it nor arms its CQ), so that the waiting thread finds
/// its answer with no hand-off between threads and no third thread spins. Dropped, it gives
/// the connection back: the poller thread is rung if calls are still in flight (drop it after
/// releasing the caller's own cell).
pub(super) struct CallerDrive<'a, P: Provider> {
    core: &'a ClientCore<P>,
}

impl<P: Provider> ClientCore<P> {
    /// The connection for this caller to drive, on a thread-polled connection (`None` with
    /// `ClientPoller::Caller`, whose callers drive it anyway).
    pub(super) fn caller_drive(&self) -> Option<CallerDrive<'_, P>> {
        if self.mode != ClientPoller::Thread {
            return None;
        }
        self.caller_drives.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = &self.hub {
            h.driving();
        }
        Some(CallerDrive { core: self })
    }

    /// Whether a caller drives the connection (the poller thread stands down).
    fn driven_by_caller(&self) -> bool {
        self.caller_drives.load(Ordering::SeqCst) > 0
    }

    /// Waits for the outcome of the async call in cell `idx` (which the caller owns) driving
    /// the connection from the waiting task, for at most [`CALLER_DRIVE_FOR`] inside this
    /// poll (a short busy wait: the task does not return to the runtime, whose wake-up of a
    /// parked worker costs more than the answer takes); then, or at once on a contended
    /// host, it hands the connection to the poller thread and sleeps on its waker.
    ///
    /// `drive` is left `None` after a hand-over; the caller drops it (if still there) once it
    /// has released its cell, so that its own finished call does not count as work left for
    /// the poller thread.
    pub(super) async fn outcome_driving(
        &self,
        idx: u32,
        drive: &mut Option<CallerDrive<'_, P>>,
    ) -> Outcome<P> {
        let mb = &self.cells.get(idx).mb;
        std::future::poll_fn(|cx| {
            if let Some(o) = mb.try_done() {
                return Poll::Ready(o);
            }
            if drive.is_some() {
                let start = Instant::now();
                let mut idle = 0u32;
                let done = with_thread_spinner(|spin| {
                    loop {
                        spin.before_turn(Instant::now);
                        if self.progress() > 0 {
                            spin.work();
                        } else {
                            match spin.idle(&CALLER_DRIVE, Instant::now) {
                                Wait::Sleep => return None,
                                Wait::Yield => std::thread::yield_now(),
                                Wait::Spin => std::hint::spin_loop(),
                            }
                            idle = idle.wrapping_add(1);
                            if idle.is_multiple_of(CLOCK_EVERY)
                                && start.elapsed() >= CALLER_DRIVE_FOR
                            {
                                return None;
                            }
                        }
                        if let Some(o) = mb.try_done() {
                            return Some(o);
                        }
                    }
                });
                if let Some(o) = done {
                    self.counters.caller_driven.fetch_add(1, Ordering::Relaxed);
                    return Poll::Ready(o);
                }
                // Long enough: the poller thread takes over (rung if it sleeps).
                *drive = None;
                self.counters.handed_over.fetch_add(1, Ordering::Relaxed);
            }
            mb.poll_done(cx)
        })
        .await
    }
}

impl<P: Provider> Drop for CallerDrive<'_, P> {
    fn drop(&mut self) {
        // SeqCst against the poller's sleep: it either sees the count fall (and turns the
        // connection), or it had announced its sleep and we ring it.
        self.core.caller_drives.fetch_sub(1, Ordering::SeqCst);
        if let Some(h) = &self.core.hub {
            h.stop_driving();
        }
        if Member::busy(self.core) {
            self.core.ring();
        }
    }
}

/// A `ClientPoller::Thread` connection, as the process's poller thread drives it.
impl<P: Provider> Member for ClientCore<P> {
    fn turn(&self) -> usize {
        self.progress()
    }

    fn driven(&self) -> bool {
        self.driven_by_caller()
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn busy(&self) -> bool {
        self.cells.in_use() != 0
            || !self.submitted.is_empty()
            || !self.cancelled.is_empty()
            || !self.stream_sends.is_empty()
            || !self.grants.is_empty()
            || self.routed.has_work()
    }

    fn prepare_sleep(&self, max: Duration) -> Option<(Duration, bool)> {
        if self.is_dead() && self.cells.in_use() == 0 {
            // Nothing in flight on a dead connection: nothing to wait for.
            return Some((max, true));
        }
        match self.driver.try_lock() {
            Some(mut d) => d.prepare_sleep(self, max).map(|t| (t, true)),
            // Someone else drives it this instant: look again soon.
            None => Some((Duration::from_micros(100), false)),
        }
    }

    fn woke(&self) {
        if let Some(_d) = self.driver.try_lock()
            && let Some(c) = &self.channel
        {
            let _ = c.drain();
        }
    }

    fn listing(&self) -> &Listing {
        &self.routed.listing
    }

    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>)) {
        if let Some(c) = &self.channel {
            f(c.fd());
        }
    }
}

/// Gives the runtime a turn after a turn that woke someone: deferred until the runtime's round
/// is over where `defer` (a current-thread runtime: `block_on`'s future runs first), else
/// [`yield_once`].
async fn yield_after_work(defer: bool) {
    if defer {
        tokio::task::yield_now().await;
    } else {
        yield_once().await;
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
    /// A sleep on the connection's own descriptors, the verbs way (a contended caller of
    /// `ClientPoller::Caller`): announce it (doorbell flag), arm the CQ, then look once more
    /// ([`Driver::prepare_sleep`]) and sleep only if nothing came. Returns the timeout it
    /// slept with, `None` when it did not sleep.
    pub(super) fn sleep(&mut self, core: &ClientCore<P>, max: Duration) -> Option<Duration> {
        // The first sleep makes the doorbell; a ringer acts on its flag, raised below before
        // the last look for work. Without one (no descriptor left) the sleep waits on the
        // channel and its timeout alone.
        let bell = match core.doorbell.get() {
            Some(d) => Some(&**d),
            None => Doorbell::unshared()
                .ok()
                .map(|d| &**core.doorbell.get_or_init(|| Bell::Own(d))),
        };
        if let Some(b) = bell {
            b.prepare_sleep();
        }
        let Some(timeout) = self.prepare_sleep(core, max) else {
            if let Some(b) = bell {
                b.awake();
            }
            return None;
        };
        // A lost connection has nothing to poll (it waits for the kill, which rings).
        let channel = core.channel.as_deref().filter(|_| !core.is_lost());
        match (bell, channel) {
            (Some(b), None) => wait_readable(&[b.fd()], timeout),
            (Some(b), Some(c)) => wait_readable(&[b.fd(), c.fd()], timeout),
            (None, None) => std::thread::sleep(timeout),
            (None, Some(c)) => wait_readable(&[c.fd()], timeout),
        }
        if let Some(c) = channel {
            let _ = c.drain();
        }
        if let Some(b) = bell {
            b.awake();
        }
        Some(timeout)
    }

    /// Gets ready to sleep once the doorbell's flag is up: reads the device's events, arms
    /// the CQ, then looks once more (queues and the CQ). A completion that landed between the
    /// last poll and the arming rang nobody (the soft RNIC and a real one alike signal only
    /// completions that arrive after `req_notify`): without the second look the sleeper waits
    /// for the next event or the timeout. Anything queued before the flag was visible, or
    /// completed before the CQ was armed, is seen by it (the flag and the arming are SeqCst
    /// stores, the ringers' and the RNIC's checks SeqCst loads). `None` when work came, else
    /// how long it may sleep (at most `max`; less when a protocol timer is due).
    pub(super) fn prepare_sleep(
        &mut self,
        core: &ClientCore<P>,
        max: Duration,
    ) -> Option<Duration> {
        self.device_events(core);
        self.cqs.req_notify();
        if !core.submitted.is_empty() || !core.cancelled.is_empty() || self.progress(core) > 0 {
            return None;
        }
        if core.is_lost() {
            // Nothing to poll: wait for the kill (it rings the doorbell) or the fallback.
            return Some(max);
        }
        let deadline = self.link.wire.poll_timeout().map(|t| {
            Duration::from_nanos(t.saturating_sub(self.link.now())).max(Duration::from_micros(50))
        });
        Some(deadline.unwrap_or(max).min(max))
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
            let n = match self.cqs.poll(&mut self.wcs) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32};

    /// Turns of a driver-like task on a current-thread runtime after the turn that woke
    /// `block_on`'s future, until that future ran: each turn wakes itself ([`yield_once`]),
    /// except the waking turn, which ends with [`yield_after_work`]`(defer)`.
    fn turns_before_block_on_runs(defer: bool) -> u32 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let turns = Arc::new(AtomicU32::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let waker = Arc::new(atomic_waker::AtomicWaker::new());
            const WAKES_AT: u32 = 5;
            let task = {
                let (turns, stop, waker) = (turns.clone(), stop.clone(), waker.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Acquire) && turns.load(Ordering::Relaxed) < 10_000 {
                        let n = turns.fetch_add(1, Ordering::Relaxed) + 1;
                        if n == WAKES_AT {
                            waker.wake();
                            yield_after_work(defer).await;
                        } else {
                            yield_once().await;
                        }
                    }
                })
            };
            let seen = std::future::poll_fn(|cx| {
                waker.register(cx.waker());
                let n = turns.load(Ordering::Relaxed);
                if n >= WAKES_AT {
                    Poll::Ready(n - WAKES_AT)
                } else {
                    Poll::Pending
                }
            })
            .await;
            stop.store(true, Ordering::Release);
            task.await.unwrap();
            seen
        })
    }

    #[test]
    fn a_turn_that_delivered_lets_block_on_run_before_the_next_turn() {
        assert_eq!(turns_before_block_on_runs(true), 0);
        // What the deferral is for: waking itself, the task turns on for the rest of the
        // runtime's round (tokio's `event_interval`, 61) before `block_on`'s future runs.
        assert!(turns_before_block_on_runs(false) > 10);
    }
}
