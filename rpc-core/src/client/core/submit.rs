//! The caller side of a call: call cells, send slots, handing a request to the driver, and
//! waiting for its outcome (unary calls from async tasks, blocking and pipelined calls).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prost::Message;

use crate::buf::SlotReader;
use crate::client::ClientPoller;
use crate::link::decode_response_metadata;
use crate::method::MethodDesc;
use crate::poll_policy::{Budget, Spinner, Wait, with_thread_spinner};
use crate::verbs::Provider;
use crate::{Request, Response, Status};

use super::{ClientCore, Outcome, Submission};

impl<P: Provider> ClientCore<P> {
    pub(super) fn claim(&self, idx: u32) -> u32 {
        let cell = self.cells.get(idx);
        // Popped from `free`, which hands each cell to one taker.
        let ok = cell.mb.claim_exclusive();
        debug_assert!(ok, "a free cell must be claimable");
        cell.window.store(self.stream_window, Ordering::Release);
        cell.loans.store(0, Ordering::Release);
        // Only the cell's claimant writes its generation (a load and a store, not a locked
        // read-modify-write).
        let g = cell.generation.load(Ordering::Relaxed).wrapping_add(1);
        cell.generation.store(g, Ordering::Release);
        g
    }

    /// A free call cell; waits (without spinning) when all are in flight. Fails with the
    /// connection's status, marked not executed, once it is dead (nothing was handed over).
    pub(super) async fn acquire(&self) -> Result<(u32, u32), Status> {
        loop {
            if self.is_dead() {
                return Err(self.dead_status().not_executed());
            }
            if let Some(idx) = self.cells.take() {
                return Ok((idx, self.claim_async(idx)));
            }
            // Slow path: register as a waiter, then re-check before sleeping (a cell freed in
            // between is seen, or its release sees us and notifies).
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let notified = self.cell_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let again = self.cells.take();
            if again.is_none() && !self.is_dead() {
                // The poller (thread or driver task) frees cells as calls complete.
                notified.await;
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(idx) = again {
                return Ok((idx, self.claim_async(idx)));
            }
        }
    }

    pub(super) fn acquire_blocking(&self, deadline: Option<Instant>) -> Result<(u32, u32), Status> {
        with_thread_spinner(|spin| {
            loop {
                spin.before_turn(Instant::now);
                if self.is_dead() {
                    return Err(self.dead_status().not_executed());
                }
                if let Some(idx) = self.cells.take() {
                    return Ok((idx, self.claim(idx)));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(queued_too_long());
                }
                self.progress();
                self.short_wait_turn(spin);
            }
        })
    }

    /// Claims a cell for an async call.
    pub(super) fn claim_async(&self, idx: u32) -> u32 {
        self.cells.get(idx).is_async.store(true, Ordering::Release);
        self.async_calls.fetch_add(1, Ordering::AcqRel);
        self.claim(idx)
    }

    pub(super) fn release_cell(&self, idx: u32) {
        // Only the cell's owner (who releases it) writes the flag: no swap needed.
        let is_async = &self.cells.get(idx).is_async;
        if is_async.load(Ordering::Acquire) {
            is_async.store(false, Ordering::Release);
            self.async_calls.fetch_sub(1, Ordering::AcqRel);
        }
        self.cells.get(idx).mb.release();
        self.cells.put(idx);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.cell_freed.notify_one();
        }
    }

    /// A send slot for an async caller: free at once (the common case: no allocation, no
    /// lock), or awaited (never slept on: the runtime's thread goes on with other tasks) until
    /// the driver sees one come back.
    pub(super) async fn send_slot(&self) -> Result<SlotLoan<'_, P>, Status> {
        loop {
            if self.is_dead() {
                return Err(self.dead_status().not_executed());
            }
            if let Some(slot) = self.arena.take_send() {
                return Ok(SlotLoan { core: self, slot });
            }
            // Slow path: register as a waiter, then look again before waiting (a slot freed
            // in between is seen here, or its release sees us and notifies). Below our cap
            // with the process's pool at its limit, a slot other channels give back ends the
            // wait too (their drivers do not know us).
            self.slot_waiters.fetch_add(1, Ordering::SeqCst);
            let pool = self.arena.send_pool();
            let exhausted = self.arena.pool_exhausted();
            if exhausted {
                pool.waiters().fetch_add(1, Ordering::SeqCst);
            }
            let notified = self.slot_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let pool_freed = pool.freed().notified();
            tokio::pin!(pool_freed);
            pool_freed.as_mut().enable();
            let again = self.arena.take_send();
            if again.is_none() && !self.is_dead() {
                // Slots come back with their SEND completions (or when queued requests get
                // credit): make sure the driver is turning.
                match self.mode {
                    ClientPoller::Thread => self.ring(),
                    ClientPoller::Caller => {
                        self.progress();
                        // A blocking caller may be asleep holding the driver.
                        self.ring();
                        self.drive.notify_one();
                    }
                }
                if exhausted {
                    tokio::select! {
                        () = notified => {}
                        () = pool_freed => {}
                    }
                } else {
                    notified.await;
                }
            }
            if exhausted {
                pool.waiters().fetch_sub(1, Ordering::SeqCst);
            }
            self.slot_waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(slot) = again {
                return Ok(SlotLoan { core: self, slot });
            }
        }
    }

    /// A send slot for a blocking caller: drives the connection, spinning, yielding, then
    /// sleeping a little, until one is free.
    pub(super) fn send_slot_blocking(&self) -> Result<SlotLoan<'_, P>, Status> {
        with_thread_spinner(|spin| {
            loop {
                spin.before_turn(Instant::now);
                if let Some(slot) = self.arena.take_send() {
                    return Ok(SlotLoan { core: self, slot });
                }
                if self.is_dead() {
                    return Err(self.dead_status().not_executed());
                }
                self.progress();
                self.short_wait_turn(spin);
            }
        })
    }

    /// Wakes async callers waiting for a send slot if one is free (after a driver turn that
    /// did work: that is when slots come back).
    pub(super) fn wake_slot_waiters(&self) {
        // Pairs with the waiter's SeqCst increment before its second look: the release put
        // the slot back with a SeqCst compare-exchange (crossbeam's queue), and this load is
        // SeqCst, so either the waiter's look finds the slot or this load sees the waiter. No
        // fence: this runs after every driver turn that did work (an MFENCE there cost 10% of
        // a 32 B call).
        if self.slot_waiters.load(Ordering::SeqCst) > 0
            && (self.arena.free_sends() > 0 || self.is_dead())
        {
            self.slot_freed.notify_waiters();
        }
    }

    /// Returns a send slot a caller took and will not post.
    pub(super) fn release_send_slot(&self, slot: u32) {
        self.arena.release_send(slot);
        if self.slot_waiters.load(Ordering::SeqCst) > 0 {
            self.slot_freed.notify_waiters();
        }
    }

    pub(super) fn submit(
        &self,
        idx: u32,
        generation: u32,
        sub: Submission<P>,
    ) -> Result<(), Status> {
        self.hand_over(idx, generation, sub)?;
        self.kick();
        Ok(())
    }

    /// Puts a prepared request in its cell and queues the cell for the driver.
    /// A request sent pending is copied here, a part at a time, once the driver has it: the
    /// caller drives the connection between parts (so the request and each BulkReady go out
    /// at once), or rings the poller thread when another thread holds the driver.
    pub(super) fn hand_over(
        &self,
        idx: u32,
        generation: u32,
        mut sub: Submission<P>,
    ) -> Result<(), Status> {
        let fill = sub.large.as_mut().and_then(|l| l.fill.take());
        if let Err(sub) = self.cells.get(idx).mb.submit(sub) {
            self.release_send_slot(sub.staged.slot);
            return Err(Status::internal("call cell not owned by the caller"));
        }
        let _ = self.submitted.push((idx, generation));
        if let Some(job) = fill {
            let drive = self.caller_drive();
            let turn = || {
                if self.progress() == 0 {
                    self.kick();
                }
            };
            turn();
            job.run(self.fill_part_min, turn);
            drop(drive);
        }
        Ok(())
    }

    /// A unary call from an async task. The request is borrowed, not consumed: the channel
    /// keeps it until the outcome is known, to send it again if the call is retried (its
    /// registered region, if any, is taken: a retry copies the payload).
    pub(crate) async fn unary<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: &mut Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let hint = request.response_size_hint();
        let registered = request.take_registered();
        let timeout = request.timeout();
        let (metadata, msg) = (request.metadata(), request.get_ref());
        // The deadline covers the wait for a free call cell; the rest of it goes on the wire.
        let (idx, generation, timeout) = match timeout {
            None => {
                let (idx, generation) = self.acquire().await?;
                (idx, generation, None)
            }
            // A free cell at once (the common case): no time was spent waiting, and no clock
            // is read or timer armed for it.
            Some(t)
                if !self.is_dead()
                    && let Some(idx) = self.cells.take() =>
            {
                (idx, self.claim_async(idx), Some(t))
            }
            Some(t) => {
                let start = Instant::now();
                let (idx, generation) = tokio::time::timeout(t, self.acquire())
                    .await
                    .map_err(|_| queued_too_long())??;
                (idx, generation, Some(t.saturating_sub(start.elapsed())))
            }
        };
        let mut guard = CellGuard::new(self, idx, generation, false);
        let slot = self.send_slot().await?;
        let sub = self.prepare(slot, method, metadata, msg, timeout, hint, registered)?;
        self.hand_over(idx, generation, sub)?;
        guard.submitted = true;
        // The process's only async call in flight drives its connection itself for a while
        // (no hand-off between threads); with company the poller thread (or driver task)
        // serves them all. Not from a handler on a server shard's thread: the shard's other
        // connections would wait.
        let waiting = super::poller::Waiting::enter();
        let mut drive = if waiting.alone()
            && self.async_calls.load(Ordering::Acquire) == 1
            && !crate::poll_policy::on_shard_thread()
        {
            self.caller_drive()
        } else {
            None
        };
        let outcome = if drive.is_some() {
            self.outcome_driving(idx, &mut drive).await
        } else {
            self.kick();
            self.outcome(idx).await
        };
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        drop(drive);
        drop(waiting);
        r
    }

    /// Waits for the final outcome of the call in cell `idx` (which the caller owns).
    pub(super) async fn outcome(&self, idx: u32) -> Outcome<P> {
        // The poller thread, or in `ClientPoller::Caller` the driver task, completes the call and
        // wakes us: polling here too only repeats the driver's work (measured: slower).
        std::future::poll_fn(|cx| self.cells.get(idx).mb.poll_done(cx)).await
    }

    /// A unary call that blocks this thread, which drives the connection itself when it can.
    pub(crate) fn unary_blocking<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: &mut Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let mut guard = self.hand_over_blocking(method, request)?;
        // A thread-polled connection is ours to drive while we wait (the poller thread
        // stands down); `ClientPoller::Caller` callers drive it anyway.
        let drive = self.caller_drive();
        if drive.is_none() {
            self.kick();
        }
        let idx = guard.idx;
        let outcome = with_thread_spinner(|spin| {
            loop {
                spin.before_turn(Instant::now);
                if let Some(o) = self.cells.get(idx).mb.try_done() {
                    break o;
                }
                if self.progress() == 0 {
                    self.wait_turn(spin);
                } else {
                    spin.work();
                }
            }
        });
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        drop(drive);
        r
    }

    /// Starts a unary call and returns its cell without waiting for the response (see
    /// [`crate::client::Pipeline`]). Waits, driving the connection, only for a free cell.
    pub(crate) fn start_unary<Req: Message>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<(u32, u32), Status> {
        let guard = self.hand_over_blocking(method, &mut request)?;
        // No kick: the pipeline's owner drives the connection (or the poller thread does),
        // so the requests of a burst go out together at the next turn.
        // (A caller asleep on the connection, contended, is woken: the doorbell is only
        // written when someone sleeps.)
        self.ring();
        let cell = (guard.idx, guard.generation);
        std::mem::forget(guard);
        Ok(cell)
    }

    /// For callers that wait by driving the connection (blocking and pipelined calls): takes
    /// a call cell (the timeout covers that wait, the rest of it goes on the wire; a cell free
    /// at once costs no clock read), prepares the request and hands it to the driver without
    /// waking it. The guard cancels the call if the caller gives up.
    pub(super) fn hand_over_blocking<Req: Message>(
        &self,
        method: &'static MethodDesc,
        request: &mut Request<Req>,
    ) -> Result<CellGuard<'_, P>, Status> {
        let hint = request.response_size_hint();
        let registered = request.take_registered();
        let timeout = request.timeout();
        let (metadata, msg) = (request.metadata(), request.get_ref());
        let (idx, generation, timeout) = match self.cells.take() {
            Some(idx) if !self.is_dead() => (idx, self.claim(idx), timeout),
            other => {
                if let Some(idx) = other {
                    self.cells.put(idx);
                }
                let start = Instant::now();
                let (idx, generation) = self.acquire_blocking(timeout.map(|t| start + t))?;
                let rest = timeout.map(|t| t.saturating_sub(start.elapsed()));
                (idx, generation, rest)
            }
        };
        let mut guard = CellGuard::new(self, idx, generation, false);
        let slot = self.send_slot_blocking()?;
        let sub = self.prepare(slot, method, metadata, msg, timeout, hint, registered)?;
        self.hand_over(idx, generation, sub)?;
        guard.submitted = true;
        Ok(guard)
    }

    /// The response of a call started by [`ClientCore::start_unary`], if it has arrived; the
    /// cell is free again once it is returned.
    pub(crate) fn try_finish<Resp: Message + Default>(
        &self,
        idx: u32,
        generation: u32,
    ) -> Option<Result<Response<Resp>, Status>> {
        let outcome = self.cells.get(idx).mb.try_done()?;
        let guard = CellGuard::new(self, idx, generation, false);
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        Some(r)
    }

    /// Gives up a call started by [`ClientCore::start_unary`] (the server is told).
    pub(crate) fn abandon(&self, idx: u32, generation: u32) {
        drop(CellGuard::new(self, idx, generation, true));
    }

    /// Whether a call cell is free now.
    pub(crate) fn has_free_cell(&self) -> bool {
        self.cells.any_free()
    }

    /// Whether a poller thread drives the connection (else the pipeline's owner does).
    pub(crate) fn polled_by_thread(&self) -> bool {
        self.mode == ClientPoller::Thread
    }
}

/// The status of a call whose deadline passed while it waited for a free call cell.
pub(super) fn queued_too_long() -> Status {
    Status::deadline_exceeded("deadline exceeded while waiting for a free call slot")
}

/// How a blocking call or a pipeline waits for its responses: spins, then yields; never
/// sleeps on a quiet host, so a long call does not lose its core to a sleep. Contended, it
/// spins briefly, then sleeps on the connection's completion channel ([`ClientCore::wait_turn`]).
const CALLER_WAIT: Budget = Budget::adaptive(2_000, u32::MAX);

/// Waits that should be short (a free call cell, a send slot): spins, yields, then sleeps a
/// little ([`SHORT_SLEEP`]).
const SHORT_WAIT: Budget = Budget::adaptive(2_000, 200);

/// The sleep of a short wait, and of a contended caller that cannot sleep on the completion
/// channel (a poller thread drives the connection, or another caller holds the driver).
const SHORT_SLEEP: Duration = Duration::from_micros(50);

/// The longest sleep of a contended caller on the completion channel. Other threads'
/// submissions ring the doorbell, so it is only a bound for what rings no one.
pub(super) const CALLER_MAX_SLEEP: Duration = Duration::from_millis(2);

impl<P: Provider> ClientCore<P> {
    /// One idle turn of a thread that waits by driving the connection itself (blocking calls,
    /// pipelines) for responses, as `spin` says under [`CALLER_WAIT`] (see
    /// [`crate::poll_policy`]): spin, yield, or, contended, sleep on the completion channel
    /// and the doorbell when it drives the connection (`ClientPoller::Caller`, the driver
    /// free), [`SHORT_SLEEP`] otherwise.
    pub(crate) fn wait_turn(&self, spin: &mut Spinner) {
        self.turn(spin, &CALLER_WAIT, true);
    }

    /// One idle turn of a short wait (see [`ClientCore::wait_turn`]).
    fn short_wait_turn(&self, spin: &mut Spinner) {
        self.turn(spin, &SHORT_WAIT, false);
    }

    fn turn(&self, spin: &mut Spinner, budget: &Budget, on_channel: bool) {
        match spin.idle(budget, Instant::now) {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::Sleep => {
                let started = Instant::now();
                if on_channel
                    && self.mode == ClientPoller::Caller
                    && let Some(mut d) = self.driver.try_lock()
                {
                    match d.sleep(self, CALLER_MAX_SLEEP) {
                        Some(asked) => spin.woke(started, asked, Instant::now()),
                        // Work came while it got ready to sleep.
                        None => spin.work(),
                    }
                    return;
                }
                std::thread::sleep(SHORT_SLEEP);
                spin.woke(started, SHORT_SLEEP, Instant::now());
            }
        }
    }
}

/// A send slot a caller took and has not staged yet: back to the arena (waking a waiter)
/// if the request fails before it is staged.
pub(super) struct SlotLoan<'a, P: Provider> {
    pub(super) core: &'a ClientCore<P>,
    pub(super) slot: u32,
}

impl<P: Provider> SlotLoan<'_, P> {
    /// The slot, now owned by the staged frame.
    pub(super) fn into_slot(self) -> u32 {
        let slot = self.slot;
        std::mem::forget(self);
        slot
    }
}

impl<P: Provider> Drop for SlotLoan<'_, P> {
    fn drop(&mut self) {
        self.core.release_send_slot(self.slot);
    }
}

/// Returns the cell when the call ends early, or cancels it when the caller's future is dropped
/// while in flight.
pub(super) struct CellGuard<'a, P: Provider> {
    pub(super) core: &'a ClientCore<P>,
    pub(super) idx: u32,
    pub(super) generation: u32,
    pub(super) submitted: bool,
}

impl<'a, P: Provider> CellGuard<'a, P> {
    /// The guard of the call in cell `idx` of `generation`; `submitted` once the driver has
    /// the request.
    pub(super) fn new(core: &'a ClientCore<P>, idx: u32, generation: u32, submitted: bool) -> Self {
        CellGuard {
            core,
            idx,
            generation,
            submitted,
        }
    }
}

impl<P: Provider> Drop for CellGuard<'_, P> {
    fn drop(&mut self) {
        if self.submitted {
            match self.core.cells.get(self.idx).mb.cancel() {
                crate::buf::CancelOutcome::ToDriver => {
                    let _ = self.core.cancelled.push((self.idx, self.generation));
                    match self.core.mode {
                        ClientPoller::Thread => self.core.ring(),
                        ClientPoller::Caller => {
                            self.core.progress();
                            self.core.ring();
                            // The Cancel may wait for the server's credits, which come after
                            // this caller is gone (a dropped pipeline): the driver task polls
                            // until it is out.
                            self.core.drive.notify_one();
                        }
                    }
                }
                crate::buf::CancelOutcome::Caller => self.core.release_cell(self.idx),
            }
        } else {
            self.core.release_cell(self.idx);
        }
    }
}

pub(super) fn decode_outcome<P: Provider, Resp: Message + Default>(
    outcome: Outcome<P>,
) -> Result<Response<Resp>, Status> {
    let decode_err =
        |e: prost::DecodeError| Status::internal(format!("failed to decode response: {e}"));
    match outcome {
        Outcome::Frame { slot, md, payload } => {
            let metadata = decode_response_metadata(&slot.bytes()[md])?;
            let msg = Resp::decode(SlotReader::new(slot, payload.start, payload.end))
                .map_err(decode_err)?;
            Ok(Response::from_wire(metadata, msg))
        }
        Outcome::Landing { buf, md, payload } => {
            let metadata = decode_response_metadata(&buf.as_slice()[md])?;
            let msg = Resp::decode(SlotReader::new(buf, payload.start, payload.end))
                .map_err(decode_err)?;
            Ok(Response::from_wire(metadata, msg))
        }
        Outcome::Bulk { buf, md } => {
            let n = buf.len();
            let msg = Resp::decode(SlotReader::new(buf, 0, n)).map_err(decode_err)?;
            Ok(Response::from_wire(md, msg))
        }
        Outcome::Ended => Err(Status::internal("a unary call got a stream's end")),
        Outcome::Failed(status) => Err(status),
    }
}
