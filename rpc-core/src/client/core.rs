//! One client connection, generic over the provider: the lock-free front that callers use from
//! any thread (call cells, submission and cancellation queues, send slots) and the driver that
//! owns the QP, the CQ and the protocol state.
//!
//! ```text
//! caller (any thread)                          driver (whoever holds the token)
//!   permit + cell ─> encode into a send slot     take submissions ─> header ─> SEND
//!   submit(cell) ─> queue ─> doorbell/drive      poll CQ ─> frames ─> complete(cell) ─> wake
//!   await cell (zero-copy decode from slot)      cancels, deadlines, credits, reposts
//! ```
//!
//! The driver is a dedicated poller thread by default, or the calling threads themselves
//! (`PollerMode::Caller`: each waiting caller tries to take the driver token and poll). No lock
//! is ever waited on: the token is try-only.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use prost::Message;
use tracing::{debug, info, warn};

use crate::buf::{
    BulkBuf, BulkPool, EncodeMsg, Exclusive, Mailbox, NoMsg, RecvSlot, SlotArena, SlotReader, Taken,
};
use crate::client::PollerMode;
use crate::link::{
    CommitError, FrameError, Link, LinkError, LinkKey, Received, Staged, WrKind, decode_metadata,
    split_wr_id,
};
use crate::method::{CallKind, MethodDesc};
use crate::server::notify::{Doorbell, wait_readable};
use crate::verbs::{CompChannel, Cq, Provider, Wc, WcStatus};
use crate::wire::{self, BulkDesc, CallId, Event, FrameKind, MAX_HEADER_LEN};
use crate::{Metadata, Request, Response, Status};

const POLL_BATCH: usize = 32;
const SPIN_ITERS: u32 = 20_000;
const MAX_SLEEP: Duration = Duration::from_millis(20);

/// What a caller hands the driver: a staged request frame and the buffers it lends.
pub(crate) struct Submission<P: Provider> {
    method: u32,
    kind: CallKind,
    timeout_ns: Option<u64>,
    staged: Staged,
    bulk: Option<BulkBuf<P>>,
    landing: Option<BulkBuf<P>>,
}

/// What the driver hands back.
pub(crate) enum Outcome<P: Provider> {
    /// The response frame in a receive slot.
    Frame {
        slot: RecvSlot,
        md: std::ops::Range<usize>,
        payload: std::ops::Range<usize>,
    },
    /// The response frame in the landing zone.
    Landing {
        buf: BulkBuf<P>,
        md: std::ops::Range<usize>,
        payload: std::ops::Range<usize>,
    },
    /// A rendezvous response READ into a bulk buffer.
    Bulk { buf: BulkBuf<P>, md: Metadata },
    /// The call failed.
    Failed(Status),
}

struct Cell<P: Provider> {
    mb: Mailbox<Submission<P>, Outcome<P>>,
    generation: AtomicU32,
}

/// The driver's record of a call on the wire.
struct DrvCall<P: Provider> {
    id: CallId,
    /// The caller's cell, until the outcome is delivered or the caller gave up.
    cell: Option<(u32, u32)>,
    lent_bulk: Option<BulkBuf<P>>,
    landing: Option<BulkBuf<P>>,
    reading: Option<(BulkBuf<P>, Metadata)>,
    /// The call is over for the caller; waiting for the server to give our buffers back.
    finishing: bool,
}

impl<P: Provider> DrvCall<P> {
    fn empty() -> DrvCall<P> {
        DrvCall {
            id: CallId(0),
            cell: None,
            lent_bulk: None,
            landing: None,
            reading: None,
            finishing: false,
        }
    }

    fn lends(&self) -> bool {
        self.lent_bulk.is_some() || self.landing.is_some() || self.reading.is_some()
    }
}

/// State only the driver touches.
pub(crate) struct Driver<P: Provider> {
    link: Link<P>,
    calls: Box<[DrvCall<P>]>,
    /// Per cell: the wire call slot it runs as.
    cell_slot: Box<[Option<u32>]>,
    pending: VecDeque<(u32, u32, CallId, Submission<P>)>,
    cancel_retry: VecDeque<CallId>,
    cq: P::Cq,
    channel: P::CompChannel,
    _pd: Arc<P::Pd>,
    _ctx: P::Context,
}

/// Counters of one connection.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) calls: AtomicU64,
    pub(crate) bulk_requests: AtomicU64,
    pub(crate) bulk_responses: AtomicU64,
    pub(crate) landing_responses: AtomicU64,
}

/// One client connection.
pub(crate) struct ClientCore<P: Provider> {
    driver: Exclusive<Driver<P>>,
    cells: Box<[Cell<P>]>,
    free: ArrayQueue<u32>,
    permits: tokio::sync::Semaphore,
    submitted: ArrayQueue<(u32, u32)>,
    cancelled: ArrayQueue<(u32, u32)>,
    arena: Arc<SlotArena<P>>,
    bulk: Arc<BulkPool<P>>,
    doorbell: Arc<Doorbell>,
    dead: AtomicBool,
    dead_status: OnceLock<Status>,
    stop: AtomicBool,
    mode: PollerMode,
    eager_limit: usize,
    max_message: u64,
    pub(crate) counters: Counters,
    pub(crate) describe: String,
}

impl<P: Provider> std::fmt::Debug for ClientCore<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCore")
            .field("connection", &self.describe)
            .field("dead", &self.dead.load(Ordering::Relaxed))
            .finish()
    }
}

/// Everything `ClientCore::new` needs from the connect step.
pub(crate) struct Parts<P: Provider> {
    pub(crate) ctx: P::Context,
    pub(crate) pd: Arc<P::Pd>,
    pub(crate) cq: P::Cq,
    pub(crate) channel: P::CompChannel,
    pub(crate) link: Link<P>,
    pub(crate) max_calls: u32,
    pub(crate) mode: PollerMode,
    pub(crate) eager_limit: usize,
    pub(crate) max_message: u64,
    pub(crate) describe: String,
}

impl<P: Provider> ClientCore<P> {
    pub(crate) fn new(parts: Parts<P>) -> std::io::Result<Arc<ClientCore<P>>> {
        let n = parts.max_calls as usize;
        let arena = Arc::clone(&parts.link.arena);
        let bulk = Arc::clone(&parts.link.bulk);
        let driver = Driver {
            calls: (0..n).map(|_| DrvCall::empty()).collect(),
            cell_slot: vec![None; n].into_boxed_slice(),
            pending: VecDeque::with_capacity(n),
            cancel_retry: VecDeque::with_capacity(n),
            link: parts.link,
            cq: parts.cq,
            channel: parts.channel,
            _pd: parts.pd,
            _ctx: parts.ctx,
        };
        let free = ArrayQueue::new(n);
        for i in 0..n as u32 {
            let _ = free.push(i);
        }
        Ok(Arc::new(ClientCore {
            driver: Exclusive::new(driver),
            cells: (0..n)
                .map(|_| Cell {
                    mb: Mailbox::default(),
                    generation: AtomicU32::new(0),
                })
                .collect(),
            free,
            permits: tokio::sync::Semaphore::new(n),
            submitted: ArrayQueue::new(n),
            cancelled: ArrayQueue::new(n),
            arena,
            bulk,
            doorbell: Doorbell::new()?,
            dead: AtomicBool::new(false),
            dead_status: OnceLock::new(),
            stop: AtomicBool::new(false),
            mode: parts.mode,
            eager_limit: parts.eager_limit,
            max_message: parts.max_message,
            counters: Counters::default(),
            describe: parts.describe,
        }))
    }

    /// Whether the connection is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn dead_status(&self) -> Status {
        self.dead_status
            .get()
            .cloned()
            .unwrap_or_else(|| Status::unavailable("connection closed"))
    }

    /// Marks the connection dead (TCP closed, QP failed); every call fails with `status`.
    pub(crate) fn kill(&self, status: Status) {
        let _ = self.dead_status.set(status);
        self.dead.store(true, Ordering::Release);
        self.permits.close();
        self.doorbell.ring_always();
        // Whoever drives next fails the calls; make sure someone does.
        self.progress();
    }

    /// Stops the poller thread (when the last handle is dropped).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.doorbell.ring_always();
    }

    // ----- caller side ---------------------------------------------------------------------

    fn claim(&self, idx: u32) -> u32 {
        let cell = &self.cells[idx as usize];
        let ok = cell.mb.claim();
        debug_assert!(ok, "a free cell must be claimable");
        cell.generation
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1)
    }

    async fn acquire(&self) -> Result<(u32, u32), Status> {
        if self.is_dead() {
            return Err(self.dead_status());
        }
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| self.dead_status())?;
        permit.forget();
        let Some(idx) = self.free.pop() else {
            self.permits.add_permits(1);
            return Err(Status::internal("call cells out of sync with permits"));
        };
        Ok((idx, self.claim(idx)))
    }

    fn acquire_blocking(&self, deadline: Option<Instant>) -> Result<(u32, u32), Status> {
        let mut spins = 0u32;
        loop {
            if self.is_dead() {
                return Err(self.dead_status());
            }
            match self.permits.try_acquire() {
                Ok(p) => {
                    p.forget();
                    let Some(idx) = self.free.pop() else {
                        self.permits.add_permits(1);
                        return Err(Status::internal("call cells out of sync with permits"));
                    };
                    return Ok((idx, self.claim(idx)));
                }
                Err(tokio::sync::TryAcquireError::Closed) => return Err(self.dead_status()),
                Err(tokio::sync::TryAcquireError::NoPermits) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(queued_too_long());
                    }
                    self.progress();
                    spins = backoff(spins);
                }
            }
        }
    }

    fn release_cell(&self, idx: u32) {
        self.cells[idx as usize].mb.release();
        let _ = self.free.push(idx);
        self.permits.add_permits(1);
    }

    /// Encodes the request: eager into a send slot, or by rendezvous from a bulk buffer.
    fn prepare(
        &self,
        method: &MethodDesc,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        timeout: Option<Duration>,
        landing_hint: Option<usize>,
    ) -> Result<Submission<P>, Status> {
        let len = msg.encoded_len();
        let md_len = metadata.encoded_len();
        if len as u64 > self.max_message {
            return Err(Status::resource_exhausted(format!(
                "request of {len} bytes exceeds the {} byte message limit",
                self.max_message
            )));
        }
        if MAX_HEADER_LEN + md_len > self.eager_limit {
            return Err(Status::resource_exhausted(
                "request metadata too large for a frame",
            ));
        }
        let eager = MAX_HEADER_LEN + md_len + len <= self.eager_limit;
        let mut bulk = None;
        let staged = if eager {
            self.stage(metadata, msg)?
        } else {
            let mut buf = self
                .bulk
                .get(len)
                .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
            if msg.encode_into(buf.as_mut_slice()).is_none() {
                return Err(Status::internal("request encoding failed"));
            }
            bulk = Some(buf);
            self.counters.bulk_requests.fetch_add(1, Ordering::Relaxed);
            self.stage(metadata, &NoMsg)?
        };
        let landing = match landing_hint {
            // No zone for a response the caller could not accept anyway.
            Some(n) if MAX_HEADER_LEN + n > self.eager_limit && n as u64 <= self.max_message => {
                match self.bulk.get(MAX_HEADER_LEN + crate::MAX_METADATA_LEN + n) {
                    Ok(mut b) => {
                        let cap = b.capacity();
                        b.set_len(cap);
                        Some(b)
                    }
                    Err(_) => None,
                }
            }
            _ => None,
        };
        Ok(Submission {
            method: method.id,
            kind: method.kind,
            timeout_ns: timeout.map(|t| t.as_nanos().min(u128::from(u64::MAX)) as u64),
            staged,
            bulk,
            landing,
        })
    }

    fn stage(&self, metadata: &Metadata, msg: &dyn EncodeMsg) -> Result<Staged, Status> {
        let mut spins = 0;
        loop {
            let Some(slot) = self.arena.take_send() else {
                if self.is_dead() {
                    return Err(self.dead_status());
                }
                self.progress();
                spins = backoff(spins);
                continue;
            };
            // SAFETY: we took `slot` and have not posted it.
            let buf = unsafe { self.arena.send_buf(slot) };
            let md_len = metadata.encoded_len();
            let Some(body) = buf.get_mut(MAX_HEADER_LEN..) else {
                self.arena.release_send(slot);
                return Err(Status::internal("slot smaller than a header"));
            };
            let Some(md_buf) = body.get_mut(..md_len) else {
                self.arena.release_send(slot);
                return Err(Status::resource_exhausted("metadata larger than a slot"));
            };
            metadata.encode(md_buf);
            let Some(n) = body.get_mut(md_len..).and_then(|b| msg.encode_into(b)) else {
                self.arena.release_send(slot);
                return Err(Status::resource_exhausted("request larger than a slot"));
            };
            return Ok(Staged {
                slot,
                md_len,
                payload_len: n,
            });
        }
    }

    fn submit(&self, idx: u32, generation: u32, sub: Submission<P>) -> Result<(), Status> {
        if let Err(sub) = self.cells[idx as usize].mb.submit(sub) {
            self.arena.release_send(sub.staged.slot);
            return Err(Status::internal("call cell not owned by the caller"));
        }
        let _ = self.submitted.push((idx, generation));
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        match self.mode {
            PollerMode::Thread => self.doorbell.ring(),
            PollerMode::Caller => {
                self.progress();
            }
        }
        Ok(())
    }

    /// A unary call from an async task.
    pub(crate) async fn unary<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let hint = request.response_size_hint();
        let (metadata, msg, timeout) = request.into_parts();
        // The deadline covers the wait for a free call cell; the rest of it goes on the wire.
        let (idx, generation, timeout) = match timeout {
            None => {
                let (idx, generation) = self.acquire().await?;
                (idx, generation, None)
            }
            Some(t) => {
                let start = Instant::now();
                let (idx, generation) = tokio::time::timeout(t, self.acquire())
                    .await
                    .map_err(|_| queued_too_long())??;
                (idx, generation, Some(t.saturating_sub(start.elapsed())))
            }
        };
        let mut guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let sub = self.prepare(method, &metadata, &msg, timeout, hint)?;
        drop(msg);
        self.submit(idx, generation, sub)?;
        guard.submitted = true;
        let outcome = std::future::poll_fn(|cx| {
            if self.mode == PollerMode::Caller {
                self.progress();
            }
            match self.cells[idx as usize].mb.poll_done(cx) {
                Poll::Ready(o) => Poll::Ready(o),
                Poll::Pending => {
                    if self.mode == PollerMode::Caller {
                        cx.waker().wake_by_ref();
                    }
                    Poll::Pending
                }
            }
        })
        .await;
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        r
    }

    /// A unary call that blocks this thread, which drives the connection itself when it can.
    pub(crate) fn unary_blocking<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let hint = request.response_size_hint();
        let (metadata, msg, timeout) = request.into_parts();
        // The deadline covers the wait for a free call cell; the rest of it goes on the wire.
        let start = Instant::now();
        let (idx, generation) = self.acquire_blocking(timeout.map(|t| start + t))?;
        let timeout = timeout.map(|t| t.saturating_sub(start.elapsed()));
        let mut guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let sub = self.prepare(method, &metadata, &msg, timeout, hint)?;
        self.submit(idx, generation, sub)?;
        guard.submitted = true;
        let mut spins = 0;
        let outcome = loop {
            if let Some(o) = self.cells[idx as usize].mb.try_done() {
                break o;
            }
            if self.progress() == 0 {
                spins = backoff(spins);
            }
        };
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        r
    }

    // ----- driver side ---------------------------------------------------------------------

    /// Drives the connection once if no one else is: returns the work done (0 when idle or
    /// when another thread holds the driver token).
    pub(crate) fn progress(&self) -> usize {
        let Some(mut d) = self.driver.try_lock() else {
            return 0;
        };
        d.progress(self)
    }

    /// The poller thread's loop.
    pub(crate) fn run_poller(self: Arc<Self>) {
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            if self.progress() > 0 {
                idle = 0;
                continue;
            }
            if self.is_dead() && self.permits.available_permits() == self.cells.len() {
                // Nothing in flight on a dead connection: sleep until stopped.
                wait_readable(&[self.doorbell.fd()], MAX_SLEEP);
                continue;
            }
            idle += 1;
            if idle < SPIN_ITERS {
                std::hint::spin_loop();
                continue;
            }
            let Some(d) = self.driver.try_lock() else {
                continue;
            };
            self.doorbell.prepare_sleep();
            let _ = d.cq.req_notify(false);
            let fd = d.channel.fd();
            let deadline = d.link.wire.poll_timeout().map(|t| {
                Duration::from_nanos(t.saturating_sub(d.link.now())).max(Duration::from_micros(50))
            });
            let busy = !self.submitted.is_empty() || !self.cancelled.is_empty();
            if !busy {
                wait_readable(
                    &[self.doorbell.fd(), fd],
                    deadline.unwrap_or(MAX_SLEEP).min(MAX_SLEEP),
                );
            }
            let _ = d.channel.drain();
            self.doorbell.awake();
            drop(d);
            idle = SPIN_ITERS / 2;
        }
    }
}

/// The status of a call whose deadline passed while it waited for a free call cell.
fn queued_too_long() -> Status {
    Status::deadline_exceeded("deadline exceeded while waiting for a free call slot")
}

/// Spins, then yields, then sleeps a little: for waits that should be short.
fn backoff(spins: u32) -> u32 {
    if spins < 2_000 {
        std::hint::spin_loop();
    } else if spins < 2_200 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
    spins.saturating_add(1)
}

/// Returns the cell when the call ends early, or cancels it when the caller's future is dropped
/// while in flight.
struct CellGuard<'a, P: Provider> {
    core: &'a ClientCore<P>,
    idx: u32,
    generation: u32,
    submitted: bool,
}

impl<P: Provider> Drop for CellGuard<'_, P> {
    fn drop(&mut self) {
        if self.submitted {
            match self.core.cells[self.idx as usize].mb.cancel() {
                crate::buf::CancelOutcome::ToDriver => {
                    let _ = self.core.cancelled.push((self.idx, self.generation));
                    match self.core.mode {
                        PollerMode::Thread => self.core.doorbell.ring(),
                        PollerMode::Caller => {
                            self.core.progress();
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

fn decode_outcome<P: Provider, Resp: Message + Default>(
    outcome: Outcome<P>,
) -> Result<Response<Resp>, Status> {
    let decode_err =
        |e: prost::DecodeError| Status::internal(format!("failed to decode response: {e}"));
    match outcome {
        Outcome::Frame { slot, md, payload } => {
            let metadata = decode_metadata(&slot.bytes()[md])?;
            let msg = Resp::decode(SlotReader::new(slot, payload.start, payload.end))
                .map_err(decode_err)?;
            Ok(Response::from_parts(metadata, msg))
        }
        Outcome::Landing { buf, md, payload } => {
            let metadata = decode_metadata(&buf.as_slice()[md])?;
            let msg = Resp::decode(SlotReader::new(buf, payload.start, payload.end))
                .map_err(decode_err)?;
            Ok(Response::from_parts(metadata, msg))
        }
        Outcome::Bulk { buf, md } => {
            let n = buf.len();
            let msg = Resp::decode(SlotReader::new(buf, 0, n)).map_err(decode_err)?;
            Ok(Response::from_parts(md, msg))
        }
        Outcome::Failed(status) => Err(status),
    }
}

impl<P: Provider> Driver<P> {
    fn progress(&mut self, core: &ClientCore<P>) -> usize {
        if core.is_dead() {
            return self.fail_all(core, core.dead_status());
        }
        match self.step(core) {
            Ok(work) => work,
            Err(e) => {
                warn!("{}: connection failed: {e}", core.describe);
                let _ = core.dead_status.set(e.status());
                core.dead.store(true, Ordering::Release);
                core.permits.close();
                self.fail_all(core, e.status())
            }
        }
    }

    fn step(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        let mut work = self.link.post_recvs(true)? as usize;
        while let Some((idx, generation)) = core.cancelled.pop() {
            work += 1;
            self.cancel_cell(core, idx, generation)?;
        }
        while let Some(call) = self.cancel_retry.pop_front() {
            match self
                .link
                .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.cancel(call))
            {
                Err(FrameError::Busy) => {
                    self.cancel_retry.push_front(call);
                    break;
                }
                Err(FrameError::Link(e)) => return Err(e),
                _ => {}
            }
        }
        work += self.start_pending(core)?;
        while self.pending.is_empty()
            && let Some((idx, generation)) = core.submitted.pop()
        {
            work += 1;
            match core.cells[idx as usize].mb.take() {
                Taken::Run(sub) => self.start(core, idx, generation, sub)?,
                Taken::Cancelled(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    drop(sub);
                    core.release_cell(idx);
                }
                Taken::Empty => {}
            }
        }
        let mut wcs = [Wc::default(); POLL_BATCH];
        let n = self
            .cq
            .poll(&mut wcs)
            .map_err(|e| LinkError::Verbs(e.to_string()))?;
        for wc in &wcs[..n] {
            self.on_completion(core, wc)?;
        }
        work += n;
        if n > 0 {
            work += self.start_pending(core)?;
        }
        work += self.expire(core)?;
        self.link.maybe_credit_update()?;
        Ok(work)
    }

    fn start(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
        sub: Submission<P>,
    ) -> Result<(), LinkError> {
        let now = self.link.now();
        let call = match self
            .link
            .wire
            .start_call(sub.method, sub.kind, sub.timeout_ns, now)
        {
            Ok(c) => c,
            Err(wire::StartError::TooManyCalls) => {
                // Calls still finishing hold wire slots: wait for them.
                self.pending.push_back((idx, generation, CallId(0), sub));
                return Ok(());
            }
            Err(e) => {
                core.arena.release_send(sub.staged.slot);
                let status = match e {
                    wire::StartError::GoingAway => {
                        Status::unavailable("server is shutting down (GoAway)")
                    }
                    e => Status::internal(format!("cannot start call: {e}")),
                };
                self.deliver_cell(core, idx, generation, Outcome::Failed(status));
                return Ok(());
            }
        };
        self.send_request(core, idx, generation, call, sub)
    }

    fn send_request(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
        call: CallId,
        sub: Submission<P>,
    ) -> Result<(), LinkError> {
        let now = self.link.now();
        let bulk = sub.bulk.as_ref().map(desc);
        let landing = sub.landing.as_ref().map(desc);
        match self.link.commit(sub.staged, |w, pl, ml| {
            w.request(call, pl, ml, bulk, landing, now)
        }) {
            Ok(()) => {
                let slot = call.slot() as usize;
                self.calls[slot] = DrvCall {
                    id: call,
                    cell: Some((idx, generation)),
                    lent_bulk: sub.bulk,
                    landing: sub.landing,
                    reading: None,
                    finishing: false,
                };
                self.cell_slot[idx as usize] = Some(call.slot());
                Ok(())
            }
            Err(CommitError::NoCredit(staged)) => {
                self.pending
                    .push_back((idx, generation, call, Submission { staged, ..sub }));
                Ok(())
            }
            Err(CommitError::Refused(e)) => {
                self.link.wire.finish(call);
                let status = match e {
                    wire::SendError::Expired => {
                        Status::deadline_exceeded("deadline passed before the request was sent")
                    }
                    e => Status::internal(format!("request refused: {e}")),
                };
                self.deliver_cell(core, idx, generation, Outcome::Failed(status));
                Ok(())
            }
            Err(CommitError::Link(e)) => Err(e),
        }
    }

    fn start_pending(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        let mut n = 0;
        while let Some((idx, generation, call, sub)) = self.pending.pop_front() {
            if core.cells[idx as usize].mb.is_cancelled() {
                core.arena.release_send(sub.staged.slot);
                if call.0 != 0 {
                    self.link.wire.cancel_local(call);
                    self.link.wire.finish(call);
                }
                core.release_cell(idx);
                n += 1;
                continue;
            }
            let before = self.pending.len();
            if call.0 == 0 {
                self.start(core, idx, generation, sub)?;
            } else {
                self.send_request(core, idx, generation, call, sub)?;
            }
            if self.pending.len() > before {
                // Put back at the front (still no credit or call slot): keep the order.
                if let Some(last) = self.pending.pop_back() {
                    self.pending.push_front(last);
                }
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Delivers an outcome to a caller's cell, or releases the cell if the caller gave up.
    fn deliver_cell(&mut self, core: &ClientCore<P>, idx: u32, generation: u32, o: Outcome<P>) {
        let cell = &core.cells[idx as usize];
        if cell.generation.load(Ordering::Acquire) != generation {
            return;
        }
        if let Some(s) = self.cell_slot.get_mut(idx as usize) {
            *s = None;
        }
        if let Err(o) = cell.mb.complete(o) {
            drop(o);
            core.release_cell(idx);
        }
    }

    /// Delivers the outcome of the call in wire slot `slot` (if its caller still waits).
    fn deliver(&mut self, core: &ClientCore<P>, slot: usize, o: Outcome<P>) {
        if let Some((idx, generation)) = self.calls[slot].cell.take() {
            self.deliver_cell(core, idx, generation, o);
        }
    }

    /// Frees the call's wire slot and every buffer it lent (the server is done with them).
    fn retire(&mut self, slot: usize) {
        let c = std::mem::replace(&mut self.calls[slot], DrvCall::empty());
        if c.id.0 != 0 {
            self.link.wire.finish(c.id);
        }
    }

    fn cancel_cell(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
    ) -> Result<(), LinkError> {
        if core.cells[idx as usize].generation.load(Ordering::Acquire) != generation {
            return Ok(());
        }
        let Some(slot) = self.cell_slot[idx as usize].take() else {
            // Not started yet (still queued): `take` or `start_pending` will see the cancel.
            return Ok(());
        };
        let slot = slot as usize;
        if self.calls[slot].cell != Some((idx, generation)) {
            return Ok(());
        }
        self.calls[slot].cell = None;
        core.release_cell(idx);
        let call = self.calls[slot].id;
        if self.link.wire.cancel_local(call) {
            match self
                .link
                .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.cancel(call))
            {
                Err(FrameError::Busy) => self.cancel_retry.push_back(call),
                Err(FrameError::Link(e)) => return Err(e),
                _ => {}
            }
        }
        if self.calls[slot].lends() {
            self.calls[slot].finishing = true;
        } else {
            self.retire(slot);
        }
        Ok(())
    }

    fn expire(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        let mut n = 0;
        let Some(t) = self.link.wire.poll_timeout() else {
            return Ok(0);
        };
        let now = self.link.now();
        if t > now {
            return Ok(0);
        }
        while let Some(call) = self.link.wire.expire(now) {
            n += 1;
            let slot = call.slot() as usize;
            if self.calls[slot].id != call {
                // Expired while waiting for a credit: the pending entry fails when retried.
                self.expire_pending(core, call);
                continue;
            }
            debug!(%call, "deadline exceeded");
            self.deliver(
                core,
                slot,
                Outcome::Failed(Status::deadline_exceeded("deadline exceeded")),
            );
            match self
                .link
                .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.cancel(call))
            {
                Err(FrameError::Busy) => self.cancel_retry.push_back(call),
                Err(FrameError::Link(e)) => return Err(e),
                _ => {}
            }
            if self.calls[slot].lends() {
                self.calls[slot].finishing = true;
            } else {
                self.retire(slot);
            }
        }
        Ok(n)
    }

    fn expire_pending(&mut self, core: &ClientCore<P>, call: CallId) {
        if let Some(pos) = self.pending.iter().position(|p| p.2 == call) {
            if let Some((idx, generation, call, sub)) = self.pending.remove(pos) {
                core.arena.release_send(sub.staged.slot);
                self.link.wire.finish(call);
                let status = Status::deadline_exceeded("deadline exceeded waiting for credit");
                self.deliver_cell(core, idx, generation, Outcome::Failed(status));
            }
        }
    }

    fn on_completion(&mut self, core: &ClientCore<P>, wc: &Wc) -> Result<(), LinkError> {
        let (key, kind, aux) = split_wr_id(wc.wr_id);
        if key != self.link.key() {
            return Ok(());
        }
        match kind {
            Some(WrKind::Send) => {
                core.arena.release_send(aux);
                check(wc)
            }
            Some(WrKind::Nop) => check(wc),
            Some(WrKind::Recv) => match self.link.on_recv(wc, aux)? {
                None => Ok(()),
                Some(Received::Frame(f)) => self.on_frame(
                    core,
                    f.event,
                    Some(f.slot),
                    f.metadata,
                    f.payload,
                    f.header.payload_len,
                ),
                Some(Received::Written { imm, .. }) => self.on_written(core, CallId(imm)),
            },
            Some(WrKind::Read) => {
                check(wc)?;
                self.on_read_done(core, aux as usize)
            }
            Some(WrKind::Write) => check(wc),
            None => Err(LinkError::Protocol(
                "completion with an unknown work-request id".into(),
            )),
        }
    }

    fn on_frame(
        &mut self,
        core: &ClientCore<P>,
        event: Event,
        slot: Option<RecvSlot>,
        md: std::ops::Range<usize>,
        payload: std::ops::Range<usize>,
        _payload_len: u32,
    ) -> Result<(), LinkError> {
        match event {
            Event::Response {
                call,
                bulk: Some(desc),
                ..
            } => {
                let s = call.slot() as usize;
                let metadata = match slot.as_ref().map(|sl| decode_metadata(&sl.bytes()[md])) {
                    Some(Ok(m)) => m,
                    Some(Err(st)) => {
                        self.deliver(core, s, Outcome::Failed(st));
                        Metadata::new()
                    }
                    None => Metadata::new(),
                };
                drop(slot);
                self.calls[s].lent_bulk = None;
                self.calls[s].landing = None;
                let got = if desc.len > core.max_message {
                    Err(format!(
                        "response of {} bytes exceeds the {} byte message limit",
                        desc.len, core.max_message
                    ))
                } else {
                    core.bulk
                        .get(desc.len as usize)
                        .map_err(|e| format!("response too large: {e}"))
                };
                let mut buf = match got {
                    Ok(b) => b,
                    Err(why) => {
                        self.deliver(core, s, Outcome::Failed(Status::resource_exhausted(why)));
                        self.release_peer(call)?;
                        self.retire(s);
                        return Ok(());
                    }
                };
                buf.set_len(desc.len as usize);
                // SAFETY: `buf` is kept in the call's `reading` until the READ completes (or the
                // connection ends) and nothing touches it meanwhile.
                unsafe { self.link.post_read(call.slot(), &buf, desc)? };
                core.counters.bulk_responses.fetch_add(1, Ordering::Relaxed);
                self.calls[s].reading = Some((buf, metadata));
            }
            Event::Response {
                call,
                written: false,
                ..
            } => {
                let s = call.slot() as usize;
                if let Some(slot) = slot {
                    self.deliver(core, s, Outcome::Frame { slot, md, payload });
                }
                self.retire(s);
            }
            Event::Response {
                call,
                written: true,
                ..
            } => {
                // Handled in `on_written`, which parsed the frame from the landing zone.
                let _ = call;
            }
            Event::Status { call, code } => {
                let s = call.slot() as usize;
                let status = match &slot {
                    Some(sl) => {
                        let bytes = sl.bytes();
                        let msg = String::from_utf8_lossy(&bytes[payload]).into_owned();
                        let mut st = Status::new(crate::Code::from_u8(code), msg);
                        if let Ok(m) = Metadata::decode(&bytes[md]) {
                            *st.metadata_mut() = m;
                        }
                        st
                    }
                    None => Status::new(crate::Code::from_u8(code), ""),
                };
                drop(slot);
                self.deliver(core, s, Outcome::Failed(status));
                self.retire(s);
            }
            Event::BulkRelease { call } => {
                let s = call.slot() as usize;
                if self.calls[s].id == call {
                    self.calls[s].lent_bulk = None;
                    self.calls[s].landing = None;
                    if self.calls[s].finishing && !self.calls[s].lends() {
                        self.retire(s);
                    }
                }
            }
            Event::Stale { call, kind, bulk } => {
                if bulk.is_some() {
                    self.release_peer(call)?;
                }
                let s = call.slot() as usize;
                let terminal = matches!(kind, FrameKind::Response | FrameKind::Status);
                if terminal && self.calls[s].id == call && self.calls[s].finishing {
                    self.retire(s);
                }
            }
            Event::GoAway => {
                info!("{}: server is going away", core.describe);
            }
            Event::CreditOnly | Event::WindowUpdate { .. } | Event::StreamMessage { .. } => {}
            Event::Request { .. } | Event::Cancel { .. } | Event::EndOfStream { .. } => {
                return Err(LinkError::Protocol(
                    "server sent a client-only frame".into(),
                ));
            }
        }
        Ok(())
    }

    fn on_written(&mut self, core: &ClientCore<P>, call: CallId) -> Result<(), LinkError> {
        let s = call.slot() as usize;
        let Some(c) = self.calls.get_mut(s) else {
            return Err(LinkError::Protocol(
                "landing write for an unknown call".into(),
            ));
        };
        let Some(buf) = c.landing.take() else {
            return Err(LinkError::Protocol(
                "landing write for a call without a landing zone".into(),
            ));
        };
        let (_h, md, payload, event) = self.link.parse(buf.as_slice())?;
        match event {
            Event::Response {
                call,
                written: true,
                ..
            } => {
                core.counters
                    .landing_responses
                    .fetch_add(1, Ordering::Relaxed);
                let outcome = if payload.len() as u64 > core.max_message {
                    Outcome::Failed(Status::resource_exhausted(format!(
                        "response of {} bytes exceeds the {} byte message limit",
                        payload.len(),
                        core.max_message
                    )))
                } else {
                    Outcome::Landing { buf, md, payload }
                };
                self.deliver(core, call.slot() as usize, outcome);
                self.retire(s);
            }
            other => {
                drop(buf);
                self.on_frame(core, other, None, md, payload, 0)?;
                if self.calls[s].finishing && !self.calls[s].lends() {
                    self.retire(s);
                }
            }
        }
        Ok(())
    }

    fn on_read_done(&mut self, core: &ClientCore<P>, s: usize) -> Result<(), LinkError> {
        let Some(c) = self.calls.get_mut(s) else {
            return Ok(());
        };
        let Some((buf, md)) = c.reading.take() else {
            return Ok(());
        };
        let call = c.id;
        self.release_peer(call)?;
        self.deliver(core, s, Outcome::Bulk { buf, md });
        self.retire(s);
        Ok(())
    }

    fn release_peer(&mut self, call: CallId) -> Result<(), LinkError> {
        match self
            .link
            .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.bulk_release(call))
        {
            Err(FrameError::Link(e)) => Err(e),
            _ => Ok(()),
        }
    }

    fn fail_all(&mut self, core: &ClientCore<P>, status: Status) -> usize {
        let mut n = 0;
        for s in 0..self.calls.len() {
            if self.calls[s].id.0 != 0 {
                self.deliver(core, s, Outcome::Failed(status.clone()));
                self.calls[s] = DrvCall::empty();
                n += 1;
            }
        }
        while let Some((idx, generation, _call, sub)) = self.pending.pop_front() {
            core.arena.release_send(sub.staged.slot);
            self.deliver_cell(core, idx, generation, Outcome::Failed(status.clone()));
            n += 1;
        }
        while let Some((idx, generation)) = core.submitted.pop() {
            n += 1;
            match core.cells[idx as usize].mb.take() {
                Taken::Run(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    self.deliver_cell(core, idx, generation, Outcome::Failed(status.clone()));
                }
                Taken::Cancelled(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    core.release_cell(idx);
                }
                Taken::Empty => {}
            }
        }
        while let Some((idx, generation)) = core.cancelled.pop() {
            n += 1;
            let _ = self.cancel_cell(core, idx, generation);
        }
        n
    }
}

fn desc<P: Provider>(b: &BulkBuf<P>) -> BulkDesc {
    let r = b.remote();
    BulkDesc {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey,
    }
}

fn check(wc: &Wc) -> Result<(), LinkError> {
    match wc.status {
        WcStatus::Success | WcStatus::WrFlushErr => Ok(()),
        _ => Err(LinkError::Completion(crate::verbs::WcError { wc: *wc })),
    }
}

/// Key of a client's only link.
pub(crate) const CLIENT_LINK: LinkKey = LinkKey {
    idx: 0,
    generation: 1,
};

/// Start time shared by every connection (the protocols' clock).
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}
