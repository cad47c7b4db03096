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

use crossbeam_queue::{ArrayQueue, SegQueue};
use prost::Message;
use tracing::{debug, info, warn};

use crate::buf::{
    BulkBuf, BulkPool, EncodeMsg, Exclusive, Gather, Mailbox, NoMsg, Piece, RecvSlot, SlotArena,
    SlotReader, Taken, encode::MAX_PIECES,
};
use crate::call::{self, Calls, Held, Ledger, Record, StreamIn, desc, lend_read};
use crate::client::{PollerMode, RegHandle, RegisteredBytesMut};
use crate::link::{
    CommitError, Control, FrameError, Link, LinkError, LinkKey, Received, Staged, WrKind,
    completion, decode_metadata, split_wr_id,
};
use crate::method::{CallKind, MethodDesc};
use crate::server::notify::{Doorbell, wait_readable};
use crate::streaming::{Inbox, InboxHost, Item, Streaming};
use crate::verbs::{Access, CompChannel, Cq, Mr, Provider, Wc};
use crate::wire::{self, BulkDesc, CallId, Event, FrameKind, MAX_BULK_PIECES, MAX_HEADER_LEN};
use crate::{Metadata, Request, Response, Status};

const POLL_BATCH: usize = 32;
/// Idle turns a poller thread spins before it sleeps.
const SPIN_ITERS: u32 = 20_000;
/// Idle turns it spins while the machine is contended (see [`ClientCore::run_poller`]).
const CONTENDED_SPIN_ITERS: u32 = 2 * CLOCK_EVERY;
/// A spinning poller reads the clock every this many idle turns, to notice preemption.
const CLOCK_EVERY: u32 = 16;
/// A gap this long between two clock reads of a spinning poller (a few idle turns take a
/// few microseconds, tens in a debug build) means the scheduler took its core.
const PREEMPTED: Duration = Duration::from_micros(200);
/// How long a poller that was preempted while spinning spins only briefly.
const CONTENDED_FOR: Duration = Duration::from_millis(100);
const _: () = assert!(CONTENDED_SPIN_ITERS > CLOCK_EVERY && CONTENDED_SPIN_ITERS < SPIN_ITERS);
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// A request's `bytes` field at least this large that lies in the registered region the
/// request names is sent from there (the server READs it) instead of being copied.
const ZERO_COPY_REQUEST_MIN: usize = 16 << 10;
/// The staging buffer first tried for the copied part of such a request (the smallest bulk
/// buffer); a larger one is taken when the small fields need more.
const STAGE_FIRST: usize = 4 << 10;

const _: () = assert!(MAX_PIECES <= MAX_BULK_PIECES);

/// What a caller hands the driver: a staged request frame and the buffers it lends.
pub(crate) struct Submission<P: Provider> {
    method: u32,
    kind: CallKind,
    timeout_ns: Option<u64>,
    staged: Staged,
    /// The buffers of a large call (boxed: a small call's submission stays small, and it is
    /// moved several times on its way to the wire).
    large: Option<Box<Large<P>>>,
    /// Where the server's stream goes (server-streaming and bidi calls).
    inbox: Option<Arc<Inbox>>,
}

/// What a large request lends the server: its rendezvous payload and its landing zone.
struct Large<P: Provider> {
    bulk: Option<BulkBuf<P>>,
    /// The payload is `bulk`'s staged pieces around a field in the user's region.
    gathered: Option<Gathered<P>>,
    landing: Option<BulkBuf<P>>,
}

/// A request payload sent from where it lies: its pieces, in order (staged in the
/// submission's bulk buffer, or the referenced field in the user's region), and the region,
/// kept alive until the server has read it. The keys are bound when the request is sent
/// ([`Driver::lend`]).
struct Gathered<P: Provider> {
    user: RegHandle,
    pieces: [Piece; MAX_PIECES],
    n: usize,
    referenced: u64,
    /// The window the server reads the referenced pieces of the user's region through.
    window: Option<P::Mr>,
}

/// A staging buffer and the pieces of a request gathered around a field in the user's region.
type Staging<P> = (BulkBuf<P>, Gathered<P>);

/// What a call lends the server until it says it is done (BulkRelease, or its final frame):
/// dropping it revokes the server's keys.
struct Lent<P: Provider> {
    _buf: BulkBuf<P>,
    _user: Option<(RegHandle, Option<P::Mr>)>,
}
/// One message (or the end) of a client stream, handed to the driver.
pub(crate) struct StreamSend<P: Provider> {
    idx: u32,
    generation: u32,
    staged: Option<Staged>,
    bulk: Option<BulkBuf<P>>,
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
    /// A streaming call ended cleanly (its messages went to the inbox).
    Ended,
    /// The call failed.
    Failed(Status),
}

struct Cell<P: Provider> {
    mb: Mailbox<Submission<P>, Outcome<P>>,
    generation: AtomicU32,
    /// The client stream's window as the caller sees it: messages it may still stage. Taken
    /// before a message is staged (so a message only holds a send slot while it can go out at
    /// once: a stalled stream holds none), given back by the server's WindowUpdates.
    window: AtomicU32,
    /// Woken when the window grows or the call ends.
    send_waker: atomic_waker::AtomicWaker,
    /// Claimed by an async call (the driver task polls for those, not for blocking calls).
    is_async: AtomicBool,
}

/// The driver's record of a call on the wire.
struct DrvCall<P: Provider> {
    id: CallId,
    /// The caller's cell, until the outcome is delivered or the caller gave up.
    cell: Option<(u32, u32)>,
    lent_bulk: Option<Lent<P>>,
    landing: Option<BulkBuf<P>>,
    reading: Option<(BulkBuf<P>, Metadata)>,
    /// The call is over for the caller; waiting for the server to give our buffers back.
    finishing: bool,
    /// The server's stream (server-streaming and bidi).
    inbox: Option<Arc<Inbox>>,
    /// The server's stream coming in: a large message being READ, later frames held.
    stream: StreamIn<P>,
    /// Our stream messages waiting for window or credit, in order.
    out: VecDeque<StreamSend<P>>,
    /// Our large stream messages lent to the server (released by BulkRelease, in order).
    stream_lent: Ledger<P>,
    /// The server's final status arrived while stream messages were still being READ: the
    /// stream ends (with this status, `None` for OK) once they are delivered.
    end: Option<Option<Status>>,
}

impl<P: Provider> Record<P> for DrvCall<P> {
    fn empty() -> DrvCall<P> {
        DrvCall {
            id: CallId(0),
            cell: None,
            lent_bulk: None,
            landing: None,
            reading: None,
            finishing: false,
            inbox: None,
            stream: StreamIn::new(),
            out: VecDeque::new(),
            stream_lent: Ledger::new(),
            end: None,
        }
    }

    fn id(&self) -> CallId {
        self.id
    }

    fn reset(&mut self) {
        self.id = CallId(0);
        self.cell = None;
        self.lent_bulk = None;
        self.landing = None;
        self.reading = None;
        self.finishing = false;
        self.inbox = None;
        self.stream.clear();
        self.out.clear();
        self.stream_lent.clear();
        self.end = None;
    }

    /// The buffers the NIC may still touch are a READ target and those lent to the server.
    fn park(&mut self, link: &mut Link<P>) {
        if let Some(l) = self.lent_bulk.take() {
            link.park(l);
        }
        if let Some(b) = self.landing.take() {
            link.park(b);
        }
        if let Some((b, _)) = self.reading.take() {
            link.park(b);
        }
        self.stream.park(link);
        self.stream_lent.park(link);
    }
}

impl<P: Provider> DrvCall<P> {
    fn lends(&self) -> bool {
        self.lent_bulk.is_some()
            || self.landing.is_some()
            || self.reading.is_some()
            || self.stream.reading()
            || !self.stream_lent.is_empty()
    }
}

/// State only the driver touches.
pub(crate) struct Driver<P: Provider> {
    pub(crate) link: Link<P>,
    calls: Calls<DrvCall<P>>,
    /// Per cell: the wire call slot it runs as.
    cell_slot: Box<[Option<u32>]>,
    pending: VecDeque<(u32, u32, CallId, Submission<P>)>,
    /// Stream messages of calls whose request is not sent yet.
    stream_pending: VecDeque<StreamSend<P>>,
    /// Call slots with stream messages waiting in `out`.
    out_calls: Vec<usize>,
    pub(crate) cq: P::Cq,
    channel: P::CompChannel,
    /// The rendezvous descriptors the server sent (the rogue-peer tests replay them).
    #[cfg(test)]
    pub(crate) seen_bulk: Vec<BulkDesc>,
    wcs: [Wc; POLL_BATCH],
    _pd: Arc<P::Pd>,
    _ctx: P::Context,
}

/// Counters of one connection.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) bulk_requests: AtomicU64,
    pub(crate) bulk_responses: AtomicU64,
    pub(crate) landing_responses: AtomicU64,
    /// Request payload bytes sent from the user's registered memory (not copied).
    pub(crate) zero_copy_request_bytes: AtomicU64,
}

/// One client connection.
pub(crate) struct ClientCore<P: Provider> {
    pub(crate) driver: Exclusive<Driver<P>>,
    cells: Box<[Cell<P>]>,
    free: ArrayQueue<u32>,
    /// Callers waiting for a free cell (slow path only).
    waiters: std::sync::atomic::AtomicUsize,
    cell_freed: tokio::sync::Notify,
    /// Async callers waiting for a free send slot (slow path only).
    slot_waiters: std::sync::atomic::AtomicUsize,
    slot_freed: tokio::sync::Notify,
    /// Wakes the driver task (`PollerMode::Caller`) when work arrives.
    drive: Arc<tokio::sync::Notify>,
    /// Cells held by async calls.
    async_calls: std::sync::atomic::AtomicUsize,
    submitted: ArrayQueue<(u32, u32)>,
    cancelled: ArrayQueue<(u32, u32)>,
    stream_sends: SegQueue<StreamSend<P>>,
    grants: SegQueue<(u32, u32, u32)>,
    stream_window: u32,
    arena: Arc<SlotArena<P>>,
    pub(crate) bulk: Arc<BulkPool<P>>,
    doorbell: Arc<Doorbell>,
    dead: AtomicBool,
    /// The server sent GoAway: calls in flight finish here, new calls go to a new connection.
    draining: AtomicBool,
    dead_status: OnceLock<Status>,
    stop: AtomicBool,
    mode: PollerMode,
    eager_limit: usize,
    max_message: u64,
    pub(crate) counters: Counters,
    pub(crate) describe: String,
    pd: Arc<P::Pd>,
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
    pub(crate) stream_window: u32,
}

impl<P: Provider> ClientCore<P> {
    pub(crate) fn new(parts: Parts<P>) -> std::io::Result<Arc<ClientCore<P>>> {
        let n = parts.max_calls as usize;
        let arena = Arc::clone(&parts.link.arena);
        let bulk = Arc::clone(&parts.link.bulk);
        let pd = Arc::clone(&parts.pd);
        let driver = Driver {
            #[cfg(test)]
            seen_bulk: Vec::new(),
            calls: Calls::new(n),
            cell_slot: vec![None; n].into_boxed_slice(),
            pending: VecDeque::with_capacity(n),

            stream_pending: VecDeque::new(),
            out_calls: Vec::with_capacity(n),
            link: parts.link,
            cq: parts.cq,
            channel: parts.channel,
            wcs: [Wc::default(); POLL_BATCH],
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
                    window: AtomicU32::new(0),
                    send_waker: atomic_waker::AtomicWaker::new(),
                    is_async: AtomicBool::new(false),
                })
                .collect(),
            free,
            waiters: std::sync::atomic::AtomicUsize::new(0),
            cell_freed: tokio::sync::Notify::new(),
            slot_waiters: std::sync::atomic::AtomicUsize::new(0),
            slot_freed: tokio::sync::Notify::new(),
            drive: Arc::new(tokio::sync::Notify::new()),
            async_calls: std::sync::atomic::AtomicUsize::new(0),
            submitted: ArrayQueue::new(n),
            cancelled: ArrayQueue::new(n),
            stream_sends: SegQueue::new(),
            grants: SegQueue::new(),
            stream_window: parts.stream_window,
            arena,
            bulk,
            doorbell: Doorbell::new()?,
            dead: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            dead_status: OnceLock::new(),
            stop: AtomicBool::new(false),
            mode: parts.mode,
            eager_limit: parts.eager_limit,
            max_message: parts.max_message,
            counters: Counters::default(),
            describe: parts.describe,
            pd,
        }))
    }

    /// Allocates registered memory peers may read and write through its rkey.
    pub(crate) fn alloc_region(&self, len: usize) -> Result<Box<dyn crate::verbs::Mr>, Status> {
        use crate::verbs::{Access, Pd};
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let mr = self
            .pd
            .alloc_mr(len, access)
            .map_err(|e| Status::resource_exhausted(format!("register {len} bytes: {e}")))?;
        Ok(Box::new(mr))
    }

    /// Registered memory for request payloads, from the bulk pool (`Channel::alloc_bytes`).
    pub(crate) fn alloc_bytes(&self, len: usize) -> Result<RegisteredBytesMut, Status> {
        let mut buf = self
            .bulk
            .get(len)
            .map_err(|e| Status::resource_exhausted(format!("register {len} bytes: {e}")))?;
        // A buffer from the pool holds what its last user left: start from zeros.
        buf.as_mut_slice().fill(0);
        Ok(RegisteredBytesMut::new(Box::new(buf)))
    }

    /// Registers caller memory for remote read and write.
    ///
    /// # Safety
    /// As [`crate::verbs::Pd::reg_mr`].
    pub(crate) unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn crate::verbs::Mr>, Status> {
        use crate::verbs::{Access, Pd};
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        // SAFETY: forwarded contract.
        let mr = unsafe { self.pd.reg_mr(ptr, len, access) }
            .map_err(|e| Status::resource_exhausted(format!("register {len} bytes: {e}")))?;
        Ok(Box::new(mr))
    }

    /// Whether the connection is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Whether new calls should use another connection (dead, or the server is draining).
    pub(crate) fn is_usable(&self) -> bool {
        !self.dead.load(Ordering::Acquire) && !self.draining.load(Ordering::Acquire)
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
        self.cell_freed.notify_waiters();
        self.slot_freed.notify_waiters();
        self.doorbell.ring_always();
        // Whoever drives next fails the calls; make sure someone does.
        self.progress();
    }

    /// Stops the poller thread (when the last handle is dropped).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.doorbell.ring_always();
        self.drive.notify_one();
    }

    // ----- caller side ---------------------------------------------------------------------

    fn claim(&self, idx: u32) -> u32 {
        let cell = &self.cells[idx as usize];
        // Popped from `free`, which hands each cell to one taker.
        let ok = cell.mb.claim_exclusive();
        debug_assert!(ok, "a free cell must be claimable");
        cell.window.store(self.stream_window, Ordering::Release);
        // Only the cell's claimant writes its generation (a load and a store, not a locked
        // read-modify-write).
        let g = cell.generation.load(Ordering::Relaxed).wrapping_add(1);
        cell.generation.store(g, Ordering::Release);
        g
    }

    /// A free call cell; waits (without spinning) when all are in flight.
    async fn acquire(&self) -> Result<(u32, u32), Status> {
        loop {
            if self.is_dead() {
                return Err(self.dead_status());
            }
            if let Some(idx) = self.free.pop() {
                return Ok((idx, self.claim_async(idx)));
            }
            // Slow path: register as a waiter, then re-check before sleeping (a cell freed in
            // between is seen, or its release sees us and notifies).
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let notified = self.cell_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let again = self.free.pop();
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

    fn acquire_blocking(&self, deadline: Option<Instant>) -> Result<(u32, u32), Status> {
        let mut spins = 0u32;
        loop {
            if self.is_dead() {
                return Err(self.dead_status());
            }
            if let Some(idx) = self.free.pop() {
                return Ok((idx, self.claim(idx)));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(queued_too_long());
            }
            self.progress();
            spins = backoff(spins);
        }
    }

    /// Claims a cell for an async call.
    fn claim_async(&self, idx: u32) -> u32 {
        self.cells[idx as usize]
            .is_async
            .store(true, Ordering::Release);
        self.async_calls.fetch_add(1, Ordering::AcqRel);
        self.claim(idx)
    }

    fn release_cell(&self, idx: u32) {
        // Only the cell's owner (who releases it) writes the flag: no swap needed.
        let is_async = &self.cells[idx as usize].is_async;
        if is_async.load(Ordering::Acquire) {
            is_async.store(false, Ordering::Release);
            self.async_calls.fetch_sub(1, Ordering::AcqRel);
        }
        self.cells[idx as usize].mb.release();
        let _ = self.free.push(idx);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.cell_freed.notify_one();
        }
    }

    /// Encodes the request: eager into a send slot, or by rendezvous from a bulk buffer.
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        slot: SlotLoan<'_, P>,
        method: &MethodDesc,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        timeout: Option<Duration>,
        landing_hint: Option<usize>,
        registered: Option<RegHandle>,
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
        let mut gathered = None;
        let staged = if eager {
            self.stage(slot, metadata, msg)?
        } else {
            // Registered memory of this connection's pool may be referenced; other memory
            // (another connection's, after a reconnect) is copied.
            let own = Arc::as_ptr(&self.bulk) as *const () as usize;
            match registered
                .filter(|r| r.0.pool_id() == own)
                .map(|r| self.encode_gathered(msg, len, r))
                .transpose()?
                .flatten()
            {
                Some((buf, g)) => {
                    bulk = Some(buf);
                    gathered = Some(g);
                }
                None => {
                    let mut buf = self
                        .bulk
                        .get(len)
                        .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
                    if msg.encode_into(buf.as_mut_slice()).is_none() {
                        return Err(Status::internal("request encoding failed"));
                    }
                    bulk = Some(buf);
                }
            }
            self.counters.bulk_requests.fetch_add(1, Ordering::Relaxed);
            self.stage(slot, metadata, &NoMsg)?
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
            large: (bulk.is_some() || gathered.is_some() || landing.is_some()).then(|| {
                Box::new(Large {
                    bulk,
                    gathered,
                    landing,
                })
            }),
            inbox: None,
        })
    }

    /// Encodes `msg` (`len` bytes) with its large `bytes` field referenced where it lies in
    /// `user`'s region and the rest staged in a small bulk buffer. `None` when nothing was
    /// referenced (the caller copies as usual).
    fn encode_gathered(
        &self,
        msg: &dyn EncodeMsg,
        len: usize,
        user: RegHandle,
    ) -> Result<Option<Staging<P>>, Status> {
        let region = user.0.as_slice();
        let mut want = len.min(STAGE_FIRST);
        for _ in 0..2 {
            let mut buf = self
                .bulk
                .get(want)
                .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
            let mut g = Gather::new(buf.as_mut_slice(), region, ZERO_COPY_REQUEST_MIN);
            if msg.encode_gather(&mut g).is_none() {
                // The small fields need more room than the first try: once more with what
                // they need.
                want = g.needed();
                continue;
            }
            if g.referenced() == 0 || g.len() != len {
                return Ok(None);
            }
            let (n, referenced) = (g.pieces().len(), g.referenced() as u64);
            let mut pieces = [Piece::Staged { offset: 0, len: 0 }; MAX_PIECES];
            pieces[..n].copy_from_slice(g.pieces());
            let gathered = Gathered {
                user,
                pieces,
                n,
                referenced,
                window: None,
            };
            return Ok(Some((buf, gathered)));
        }
        Ok(None)
    }

    /// A send slot for an async caller: free at once (the common case: no allocation, no
    /// lock), or awaited (never slept on: the runtime's thread goes on with other tasks) until
    /// the driver sees one come back.
    async fn send_slot(&self) -> Result<SlotLoan<'_, P>, Status> {
        loop {
            if self.is_dead() {
                return Err(self.dead_status());
            }
            if let Some(slot) = self.arena.take_send() {
                return Ok(SlotLoan { core: self, slot });
            }
            // Slow path: register as a waiter, then look again before waiting (a slot freed
            // in between is seen here, or its release sees us and notifies).
            self.slot_waiters.fetch_add(1, Ordering::SeqCst);
            let notified = self.slot_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let again = self.arena.take_send();
            if again.is_none() && !self.is_dead() {
                // Slots come back with their SEND completions (or when queued requests get
                // credit): make sure the driver is turning.
                match self.mode {
                    PollerMode::Thread => self.doorbell.ring(),
                    PollerMode::Caller => {
                        self.progress();
                        self.drive.notify_one();
                    }
                }
                notified.await;
            }
            self.slot_waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(slot) = again {
                return Ok(SlotLoan { core: self, slot });
            }
        }
    }

    /// A send slot for a blocking caller: drives the connection, spinning, yielding, then
    /// sleeping a little, until one is free.
    fn send_slot_blocking(&self) -> Result<SlotLoan<'_, P>, Status> {
        let mut spins = 0;
        loop {
            if let Some(slot) = self.arena.take_send() {
                return Ok(SlotLoan { core: self, slot });
            }
            if self.is_dead() {
                return Err(self.dead_status());
            }
            self.progress();
            spins = backoff(spins);
        }
    }

    /// Wakes async callers waiting for a send slot if one is free (after a driver turn that
    /// did work: that is when slots come back).
    fn wake_slot_waiters(&self) {
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

    fn stage(
        &self,
        slot: SlotLoan<'_, P>,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
    ) -> Result<Staged, Status> {
        // SAFETY: we took the slot (the loan owns it) and have not posted it.
        let buf = unsafe { self.arena.send_buf(slot.slot) };
        let md_len = metadata.encoded_len();
        let Some(body) = buf.get_mut(MAX_HEADER_LEN..) else {
            return Err(Status::internal("slot smaller than a header"));
        };
        let Some(md_buf) = body.get_mut(..md_len) else {
            return Err(Status::resource_exhausted("metadata larger than a slot"));
        };
        metadata.encode(md_buf);
        let Some(n) = body.get_mut(md_len..).and_then(|b| msg.encode_into(b)) else {
            return Err(Status::resource_exhausted("request larger than a slot"));
        };
        Ok(Staged {
            slot: slot.into_slot(),
            md_len,
            payload_len: n,
        })
    }

    /// Returns a send slot a caller took and will not post.
    fn release_send_slot(&self, slot: u32) {
        self.arena.release_send(slot);
        if self.slot_waiters.load(Ordering::SeqCst) > 0 {
            self.slot_freed.notify_waiters();
        }
    }

    fn submit(&self, idx: u32, generation: u32, sub: Submission<P>) -> Result<(), Status> {
        self.hand_over(idx, generation, sub)?;
        self.kick();
        Ok(())
    }

    /// Puts a prepared request in its cell and queues the cell for the driver.
    fn hand_over(&self, idx: u32, generation: u32, sub: Submission<P>) -> Result<(), Status> {
        if let Err(sub) = self.cells[idx as usize].mb.submit(sub) {
            self.release_send_slot(sub.staged.slot);
            return Err(Status::internal("call cell not owned by the caller"));
        }
        let _ = self.submitted.push((idx, generation));
        Ok(())
    }

    /// A unary call from an async task.
    pub(crate) async fn unary<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let hint = request.response_size_hint();
        let registered = request.take_registered();
        let (metadata, msg, timeout) = request.into_parts();
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
                    && let Some(idx) = self.free.pop() =>
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
        let mut guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let slot = self.send_slot().await?;
        let sub = self.prepare(slot, method, &metadata, &msg, timeout, hint, registered)?;
        drop(msg);
        self.submit(idx, generation, sub)?;
        guard.submitted = true;
        let outcome = self.outcome(idx).await;
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        r
    }

    // ----- streaming calls (caller side) ----------------------------------------------------

    fn kick(&self) {
        match self.mode {
            PollerMode::Thread => self.doorbell.ring(),
            PollerMode::Caller => {
                // With other async calls in flight the driver task is turning on this runtime
                // and posts the submission at its next turn, together with the others of the
                // round (one CQ poll and one pass over the queues for many calls); alone, the
                // call goes out at once.
                if self.async_calls.load(Ordering::Acquire) <= 1 {
                    self.progress();
                }
                self.drive.notify_one();
            }
        }
    }

    /// Whether async calls are in flight or work is queued (something for the driver task:
    /// blocking calls drive themselves).
    fn busy(&self) -> bool {
        self.async_calls.load(Ordering::Acquire) > 0
            || !self.stream_sends.is_empty()
            || !self.cancelled.is_empty()
    }

    /// `PollerMode::Caller` from async code: a task on the caller's runtime that drives the
    /// connection while calls are in flight, yielding to the runtime between turns, and sleeps
    /// when none is. The futures themselves sleep on their wakers instead of spinning. It ends
    /// when the connection is dropped or stopped.
    pub(crate) async fn drive_task(weak: std::sync::Weak<Self>) {
        let drive = match weak.upgrade() {
            Some(core) => Arc::clone(&core.drive),
            None => return,
        };
        loop {
            let Some(core) = weak.upgrade() else { return };
            if core.stop.load(Ordering::Acquire) {
                return;
            }
            core.progress();
            if core.busy() {
                drop(core);
                yield_once().await;
                continue;
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

    /// Starts a streaming call: sends its Request (with `msg` for server streaming, metadata
    /// only otherwise) and returns its cell and, for server-streaming and bidi calls, the
    /// `Streaming` of the server's messages.
    async fn start_stream<Resp: Message + Default>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        timeout: Option<Duration>,
        registered: Option<RegHandle>,
    ) -> Result<(u32, u32, Option<Streaming<Resp>>), Status> {
        let (idx, generation) = self.acquire().await?;
        let mut guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let slot = self.send_slot().await?;
        let mut sub = self.prepare(slot, method, metadata, msg, timeout, None, registered)?;
        let streaming = if method.kind.server_streams() {
            let inbox = Inbox::new(self.stream_window);
            inbox.set_host(Box::new(CallHost {
                core: Arc::clone(self),
                idx,
                generation,
            }));
            sub.inbox = Some(Arc::clone(&inbox));
            Some(Streaming::from_inbox(inbox))
        } else {
            None
        };
        self.submit(idx, generation, sub)?;
        guard.submitted = true;
        std::mem::forget(guard);
        Ok((idx, generation, streaming))
    }

    /// Whether the call in cell `idx` is still the one of `generation` and not over.
    fn call_live(&self, idx: u32, generation: u32) -> bool {
        let c = &self.cells[idx as usize];
        c.generation.load(Ordering::Acquire) == generation && !self.is_dead() && c.mb.is_running()
    }

    /// Queues one client stream message, waiting while the stream window is used up.
    ///
    /// The caller-side window mirrors the wire's: a message is staged into a send slot only
    /// when the window has room, so the driver can post it at once (credit permitting).
    async fn send_item(
        &self,
        idx: u32,
        generation: u32,
        msg: &dyn EncodeMsg,
    ) -> Result<(), Status> {
        let cell = &self.cells[idx as usize];
        std::future::poll_fn(|cx| {
            if !self.call_live(idx, generation) {
                return Poll::Ready(());
            }
            if cell.window.load(Ordering::Acquire) > 0 {
                return Poll::Ready(());
            }
            cell.send_waker.register(cx.waker());
            if cell.window.load(Ordering::Acquire) > 0 {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await;
        if !self.call_live(idx, generation) {
            return Err(self.dead_status_or_ended());
        }
        let len = msg.encoded_len();
        let md = Metadata::new();
        let slot = self.send_slot().await?;
        let (staged, bulk) = if MAX_HEADER_LEN + len <= self.eager_limit {
            (self.stage(slot, &md, msg)?, None)
        } else {
            if len as u64 > self.max_message {
                return Err(Status::resource_exhausted(format!(
                    "stream message of {len} bytes exceeds the {} byte message limit",
                    self.max_message
                )));
            }
            let mut buf = self
                .bulk
                .get(len)
                .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
            if msg.encode_into(buf.as_mut_slice()).is_none() {
                return Err(Status::internal("stream message encoding failed"));
            }
            (self.stage(slot, &md, &NoMsg)?, Some(buf))
        };
        // Only this call's pump takes window (one message at a time); the driver only gives.
        let _ = cell
            .window
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| w.checked_sub(1));
        self.stream_sends.push(StreamSend {
            idx,
            generation,
            staged: Some(staged),
            bulk,
        });
        self.kick();
        Ok(())
    }

    fn dead_status_or_ended(&self) -> Status {
        if self.is_dead() {
            self.dead_status()
        } else {
            Status::cancelled("the call ended before its stream was sent")
        }
    }

    /// Half-closes the client stream.
    fn send_end(&self, idx: u32, generation: u32) {
        if self.call_live(idx, generation) {
            self.stream_sends.push(StreamSend {
                idx,
                generation,
                staged: None,
                bulk: None,
            });
            self.kick();
        }
    }

    /// Sends every message of `stream`, then the end of the stream. Stops (and drops the
    /// stream) as soon as the call is over: the server answered, the call was cancelled or
    /// expired, or the connection died; also while the stream has nothing to give, since
    /// the end of the call wakes the cell's `send_waker`.
    async fn pump<S>(&self, idx: u32, generation: u32, stream: S)
    where
        S: futures_core::Stream + Send,
        S::Item: Message,
    {
        let cell = &self.cells[idx as usize];
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = std::future::poll_fn(|cx| {
                if !self.call_live(idx, generation) {
                    return Poll::Ready(None);
                }
                cell.send_waker.register(cx.waker());
                if !self.call_live(idx, generation) {
                    return Poll::Ready(None);
                }
                match stream.as_mut().poll_next(cx) {
                    Poll::Ready(item) => Poll::Ready(Some(item)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match next {
                None => return,
                Some(None) => break,
                Some(Some(item)) => {
                    if self.send_item(idx, generation, &item).await.is_err() {
                        return;
                    }
                }
            }
        }
        self.send_end(idx, generation);
    }

    /// Waits for the final outcome of the call in cell `idx` (which the caller owns).
    async fn outcome(&self, idx: u32) -> Outcome<P> {
        // The poller thread, or in `PollerMode::Caller` the driver task, completes the call and
        // wakes us: polling here too only repeats the driver's work (measured: slower).
        std::future::poll_fn(|cx| self.cells[idx as usize].mb.poll_done(cx)).await
    }

    /// A server-streaming call.
    pub(crate) async fn server_streaming<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let registered = request.take_registered();
        let (metadata, msg, timeout) = request.into_parts();
        let (_, _, streaming) = self
            .start_stream::<Resp>(method, &metadata, &msg, timeout, registered)
            .await?;
        let streaming = streaming.ok_or_else(|| Status::internal("no stream"))?;
        Ok(Response::new(streaming))
    }

    /// A client-streaming call: sends the stream, then waits for the response.
    pub(crate) async fn client_streaming<S, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Resp>, Status>
    where
        S: futures_core::Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        let (metadata, stream, timeout) = request.into_parts();
        let (idx, generation, _) = self
            .start_stream::<Resp>(method, &metadata, &NoMsg, timeout, None)
            .await?;
        let guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: true,
        };
        self.pump(idx, generation, stream).await;
        let outcome = self.outcome(idx).await;
        let mut guard = guard;
        guard.submitted = false;
        decode_outcome::<P, Resp>(outcome)
    }

    /// A bidirectional-streaming call: the request stream is sent by a task of its own while
    /// the caller reads the responses.
    pub(crate) async fn streaming<S, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        S: futures_core::Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        let (metadata, stream, timeout) = request.into_parts();
        let (idx, generation, streaming) = self
            .start_stream::<Resp>(method, &metadata, &NoMsg, timeout, None)
            .await?;
        let streaming = streaming.ok_or_else(|| Status::internal("no stream"))?;
        let core = Arc::clone(self);
        tokio::spawn(async move { core.pump(idx, generation, stream).await });
        Ok(Response::new(streaming))
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
        let mut guard = self.hand_over_blocking(method, request)?;
        self.kick();
        let idx = guard.idx;
        let mut spins = 0;
        let outcome = loop {
            if let Some(o) = self.cells[idx as usize].mb.try_done() {
                break o;
            }
            if self.progress() == 0 {
                spins = spin_then_yield(spins);
            }
        };
        guard.submitted = false;
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        r
    }

    // ----- pipelined calls (one thread, many in flight, no tasks) ----------------------------

    /// Starts a unary call and returns its cell without waiting for the response (see
    /// [`crate::client::Pipeline`]). Waits, driving the connection, only for a free cell.
    pub(crate) fn start_unary<Req: Message>(
        &self,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<(u32, u32), Status> {
        let guard = self.hand_over_blocking(method, request)?;
        // No kick: the pipeline's owner drives the connection (or the poller thread does),
        // so the requests of a burst go out together at the next turn.
        if self.mode == PollerMode::Thread {
            self.doorbell.ring();
        }
        let cell = (guard.idx, guard.generation);
        std::mem::forget(guard);
        Ok(cell)
    }

    /// For callers that wait by driving the connection (blocking and pipelined calls): takes
    /// a call cell (the timeout covers that wait, the rest of it goes on the wire; a cell free
    /// at once costs no clock read), prepares the request and hands it to the driver without
    /// waking it. The guard cancels the call if the caller gives up.
    fn hand_over_blocking<Req: Message>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<CellGuard<'_, P>, Status> {
        let hint = request.response_size_hint();
        let registered = request.take_registered();
        let (metadata, msg, timeout) = request.into_parts();
        let (idx, generation, timeout) = match self.free.pop() {
            Some(idx) if !self.is_dead() => (idx, self.claim(idx), timeout),
            other => {
                if let Some(idx) = other {
                    let _ = self.free.push(idx);
                }
                let start = Instant::now();
                let (idx, generation) = self.acquire_blocking(timeout.map(|t| start + t))?;
                let rest = timeout.map(|t| t.saturating_sub(start.elapsed()));
                (idx, generation, rest)
            }
        };
        let mut guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let slot = self.send_slot_blocking()?;
        let sub = self.prepare(slot, method, &metadata, &msg, timeout, hint, registered)?;
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
        let outcome = self.cells[idx as usize].mb.try_done()?;
        let guard = CellGuard {
            core: self,
            idx,
            generation,
            submitted: false,
        };
        let r = decode_outcome::<P, Resp>(outcome);
        drop(guard);
        Some(r)
    }

    /// Gives up a call started by [`ClientCore::start_unary`] (the server is told).
    pub(crate) fn abandon(&self, idx: u32, generation: u32) {
        drop(CellGuard {
            core: self,
            idx,
            generation,
            submitted: true,
        });
    }

    /// Whether a call cell is free now.
    pub(crate) fn has_free_cell(&self) -> bool {
        !self.free.is_empty()
    }

    /// Whether a poller thread drives the connection (else the pipeline's owner does).
    pub(crate) fn polled_by_thread(&self) -> bool {
        self.mode == PollerMode::Thread
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

    /// The poller thread's loop: spins while idle, then sleeps on the doorbell and the
    /// completion channel ([`Driver::sleep`]).
    ///
    /// Spinning pays only while the poller has a core of its own. When the scheduler takes it
    /// away (several pollers and busy servers on few cores: a client of two servers), a
    /// spinner keeps a core from the threads that have work (the server, the caller's
    /// runtime, the poller of the connection in use), and each of them waits a time slice
    /// for it: milliseconds per call. So a poller that sees it was preempted while spinning
    /// sleeps at once and spins only briefly for [`CONTENDED_FOR`]: a sleeper woken by an
    /// event gets a core back at once.
    pub(crate) fn run_poller(self: Arc<Self>) {
        let mut idle = 0u32;
        let mut budget = SPIN_ITERS;
        let mut last = None::<Instant>;
        let mut contended_until = None::<Instant>;
        while !self.stop.load(Ordering::Acquire) {
            if self.progress() > 0 {
                idle = 0;
                continue;
            }
            if self.is_dead() && self.free.len() == self.cells.len() {
                // Nothing in flight on a dead connection: sleep until stopped.
                wait_readable(&[self.doorbell.fd()], MAX_SLEEP);
                continue;
            }
            if idle == 0 {
                // A new idle phase (not per call: this is the poller's thread).
                let now = Instant::now();
                budget = match contended_until {
                    Some(t) if now < t => CONTENDED_SPIN_ITERS,
                    _ => SPIN_ITERS,
                };
                last = Some(now);
            }
            idle += 1;
            if idle < budget {
                if idle.is_multiple_of(CLOCK_EVERY) {
                    let now = Instant::now();
                    if last.is_some_and(|l| now.duration_since(l) > PREEMPTED) {
                        contended_until = Some(now + CONTENDED_FOR);
                        idle = budget;
                    }
                    last = Some(now);
                }
                std::hint::spin_loop();
                continue;
            }
            let Some(mut d) = self.driver.try_lock() else {
                continue;
            };
            d.sleep(&self);
            drop(d);
            idle = 0;
        }
    }
}

/// The status of a call whose deadline passed while it waited for a free call cell.
fn queued_too_long() -> Status {
    Status::deadline_exceeded("deadline exceeded while waiting for a free call slot")
}

/// Gives the runtime a turn: wakes itself and returns `Pending` once. (`tokio::task::yield_now`
/// would do, but on the multi-thread scheduler it queues the waker in a list that may grow: an
/// allocation on the per-call path.)
async fn yield_once() {
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

/// Spins, then yields (never sleeps): how a blocking call waits for its own response, so a
/// long call does not lose its core to a sleep.
fn spin_then_yield(spins: u32) -> u32 {
    if spins < 2_000 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    spins.saturating_add(1)
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

/// The host of a client-side inbox: owns the call's cell for as long as the stream lives.
struct CallHost<P: Provider> {
    core: Arc<ClientCore<P>>,
    idx: u32,
    generation: u32,
}

impl<P: Provider> InboxHost for CallHost<P> {
    fn grant(&self, n: u32) {
        self.core.grants.push((self.idx, self.generation, n));
        self.core.kick();
    }

    fn abandon(&self) {
        let core = &self.core;
        let cell = &core.cells[self.idx as usize];
        if cell.generation.load(Ordering::Acquire) != self.generation {
            return;
        }
        match cell.mb.cancel() {
            crate::buf::CancelOutcome::ToDriver => {
                let _ = core.cancelled.push((self.idx, self.generation));
                core.kick();
            }
            crate::buf::CancelOutcome::Caller => core.release_cell(self.idx),
        }
        // A bidi call's pump waiting for the request stream learns the call is over.
        cell.send_waker.wake();
    }

    fn waiting(&self, _cx: &mut std::task::Context<'_>) {
        if self.core.mode == PollerMode::Caller {
            // A chance to see our messages at once; the driver task keeps polling meanwhile.
            self.core.progress();
        }
    }
}

/// A send slot a caller took and has not staged yet: back to the arena (waking a waiter)
/// if the request fails before it is staged.
struct SlotLoan<'a, P: Provider> {
    core: &'a ClientCore<P>,
    slot: u32,
}

impl<P: Provider> SlotLoan<'_, P> {
    /// The slot, now owned by the staged frame.
    fn into_slot(self) -> u32 {
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
        Outcome::Ended => Err(Status::internal("a unary call got a stream's end")),
        Outcome::Failed(status) => Err(status),
    }
}

impl<P: Provider> Driver<P> {
    /// The poller thread's sleep, the verbs way: announce it (doorbell flag), arm the CQ, then
    /// look once more (queues and the CQ) and sleep only if nothing came. A completion that
    /// landed between the last poll and the arming rang nobody (the soft RNIC and a real one
    /// alike signal only completions that arrive after `req_notify`): without the second look
    /// it waits for the next event or the timeout. Returns whether it slept.
    fn sleep(&mut self, core: &ClientCore<P>) -> bool {
        core.doorbell.prepare_sleep();
        let _ = self.cq.req_notify(false);
        // Anything queued before the doorbell flag was visible, or completed before the CQ was
        // armed, is seen by this re-check (the flag and the arming are SeqCst stores, the
        // ringers' and the RNIC's checks SeqCst loads).
        if !core.submitted.is_empty() || !core.cancelled.is_empty() || self.progress(core) > 0 {
            core.doorbell.awake();
            return false;
        }
        let deadline = self.link.wire.poll_timeout().map(|t| {
            Duration::from_nanos(t.saturating_sub(self.link.now())).max(Duration::from_micros(50))
        });
        wait_readable(
            &[core.doorbell.fd(), self.channel.fd()],
            deadline.unwrap_or(MAX_SLEEP).min(MAX_SLEEP),
        );
        let _ = self.channel.drain();
        core.doorbell.awake();
        true
    }

    fn progress(&mut self, core: &ClientCore<P>) -> usize {
        if core.is_dead() {
            return self.fail_all(core, core.dead_status());
        }
        match self.step(core) {
            Ok(work) => {
                if work > 0 {
                    core.wake_slot_waiters();
                }
                work
            }
            Err(e) => {
                warn!("{}: connection failed: {e}", core.describe);
                let _ = core.dead_status.set(e.status());
                core.dead.store(true, Ordering::Release);
                core.cell_freed.notify_waiters();
                core.slot_freed.notify_waiters();
                self.fail_all(core, e.status())
            }
        }
    }

    fn step(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        self.link.tick();
        let mut work = self.link.repost_batched(false)? as usize;
        while let Some((idx, generation)) = core.cancelled.pop() {
            work += 1;
            self.cancel_cell(core, idx, generation)?;
        }
        self.link.flush_control()?;
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
        if !self.stream_pending.is_empty() {
            for ss in std::mem::take(&mut self.stream_pending) {
                self.route_stream_send(core, ss)?;
            }
        }
        while let Some(ss) = core.stream_sends.pop() {
            work += 1;
            self.route_stream_send(core, ss)?;
        }
        while let Some((idx, generation, n)) = core.grants.pop() {
            work += 1;
            if core.cells[idx as usize].generation.load(Ordering::Acquire) == generation
                && let Some(slot) = self.cell_slot[idx as usize]
            {
                let call = self.calls[slot as usize].id;
                self.link.control(Control::WindowUpdate(call, n))?;
            }
        }
        // What this turn queued goes out before we look for answers (one post for the lot).
        self.link.flush_sends()?;
        let n = self
            .cq
            .poll(&mut self.wcs)
            .map_err(|e| LinkError::Verbs(e.to_string()))?;
        if n > 1 {
            // Start loading every received frame before handling the first.
            for wc in &self.wcs[..n] {
                self.link.prefetch(wc);
            }
        }
        for i in 0..n {
            let wc = self.wcs[i];
            self.on_completion(core, &wc)?;
        }
        work += n;
        if n > 0 {
            work += self.start_pending(core)?;
            if !self.out_calls.is_empty() {
                for slot in std::mem::take(&mut self.out_calls) {
                    self.flush_out(slot)?;
                }
            }
        }
        work += self.expire(core)?;
        if work == 0 {
            // Idle turn: repost whatever waits (a busy turn waits for a batch).
            self.link.post_recvs(true)?;
        }
        self.link.maybe_credit_update()?;
        self.link.flush_sends()?;
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
                self.fail_unsent(core, idx, generation, sub.inbox, status);
                return Ok(());
            }
        };
        self.send_request(core, idx, generation, call, sub)
    }

    /// Lends what a large request gives the server, each with the least right and for this
    /// connection only: its rendezvous payload (remote READ) and the referenced span of the
    /// user's region (remote READ), whose ranges go to `ranges` (how many is the first value),
    /// and its landing zone (remote WRITE), whose descriptor is the second.
    fn lend(
        &self,
        l: &mut Large<P>,
        ranges: &mut [BulkDesc; MAX_PIECES],
    ) -> Result<(usize, Option<BulkDesc>), Status> {
        let qp = &self.link.qp;
        let refused = |e: crate::verbs::VerbsError| {
            Status::resource_exhausted(format!("cannot lend a bulk buffer to the server: {e}"))
        };
        let bulk = match l.bulk.as_mut() {
            Some(b) => Some(b.lend(Access::REMOTE_READ, qp).map_err(refused)?),
            None => None,
        };
        let n = match (l.gathered.as_mut(), bulk) {
            (Some(g), Some(stage)) => {
                let region = |p: &Piece| match *p {
                    Piece::Region { offset, len } => Some((offset, offset + len)),
                    Piece::Staged { .. } => None,
                };
                let span = g.pieces[..g.n]
                    .iter()
                    .filter_map(region)
                    .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
                let user = match span {
                    Some((start, end)) => {
                        let b = g.user.0.as_any().downcast_ref::<BulkBuf<P>>();
                        let b = b.ok_or_else(|| {
                            Status::internal("registered bytes of another provider")
                        })?;
                        let w = b
                            .window(start, end - start, Access::REMOTE_READ, qp)
                            .map_err(refused)?;
                        let r = (w.addr() - start as u64, w.rkey());
                        g.window = Some(w);
                        r
                    }
                    None => (0, 0),
                };
                for (r, p) in ranges.iter_mut().zip(&g.pieces[..g.n]) {
                    *r = match *p {
                        Piece::Staged { offset, len } => BulkDesc {
                            addr: stage.addr + offset as u64,
                            len: len as u64,
                            rkey: stage.rkey,
                        },
                        Piece::Region { offset, len } => BulkDesc {
                            addr: user.0 + offset as u64,
                            len: len as u64,
                            rkey: user.1,
                        },
                    };
                }
                g.n
            }
            (_, Some(stage)) => {
                ranges[0] = desc(stage);
                1
            }
            (_, None) => 0,
        };
        let landing = match l.landing.as_mut() {
            Some(b) => Some(desc(b.lend(Access::REMOTE_WRITE, qp).map_err(refused)?)),
            None => None,
        };
        Ok((n, landing))
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
        let mut sub = sub;
        let mut ranges = [BulkDesc::default(); MAX_PIECES];
        let (n, landing) = match sub.large.as_deref_mut() {
            None => (0, None),
            Some(l) => match self.lend(l, &mut ranges) {
                Ok(lent) => lent,
                Err(status) => {
                    core.arena.release_send(sub.staged.slot);
                    self.link.wire.finish(call);
                    self.fail_unsent(core, idx, generation, sub.inbox, status);
                    return Ok(());
                }
            },
        };
        let ranges = &ranges[..n];
        match self.link.commit(sub.staged, |w, pl, ml| {
            w.request_pieces(call, pl, ml, ranges, landing, now)
        }) {
            Ok(()) => {
                let slot = call.slot() as usize;
                let (bulk, gathered, landing) = match sub.large {
                    Some(l) => {
                        let l = *l;
                        (l.bulk, l.gathered, l.landing)
                    }
                    None => (None, None, None),
                };
                let user = gathered.map(|g| {
                    core.counters
                        .zero_copy_request_bytes
                        .fetch_add(g.referenced, Ordering::Relaxed);
                    (g.user, g.window)
                });
                // In place: the slot was reset when its last call retired (a DrvCall is large;
                // building and moving a whole one per call showed up as memcpy).
                let c = &mut self.calls[slot];
                c.reset();
                c.id = call;
                c.cell = Some((idx, generation));
                c.lent_bulk = bulk.map(|b| Lent {
                    _buf: b,
                    _user: user,
                });
                c.landing = landing;
                c.inbox = sub.inbox;
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
                self.fail_unsent(core, idx, generation, sub.inbox, status);
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
        // Only async callers register wakers (blocking and pipelined ones poll the cell).
        let is_async = cell.is_async.load(Ordering::Acquire);
        let r = cell.mb.complete_waking(o, is_async);
        if is_async {
            // A client stream waiting for window learns the call is over.
            cell.send_waker.wake();
        }
        if let Err(o) = r {
            drop(o);
            core.release_cell(idx);
        }
    }

    /// Fails a call whose request never left; its stream, if it has one, ends with `status`
    /// (the caller of a streaming call waits on the stream, not on the cell).
    fn fail_unsent(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
        inbox: Option<Arc<Inbox>>,
        status: Status,
    ) {
        if let Some(inbox) = inbox {
            inbox.finish(Some(status.clone()));
        }
        self.deliver_cell(core, idx, generation, Outcome::Failed(status));
    }

    /// Delivers the outcome of the call in wire slot `slot` (if its caller still waits).
    fn deliver(&mut self, core: &ClientCore<P>, slot: usize, o: Outcome<P>) {
        if let Some((idx, generation)) = self.calls[slot].cell.take() {
            self.deliver_cell(core, idx, generation, o);
        }
    }

    /// Frees the call's wire slot and every buffer it lent (the server is done with them).
    fn retire(&mut self, slot: usize) {
        let c = &mut self.calls[slot];
        while let Some(ss) = c.out.pop_front() {
            if let Some(st) = ss.staged {
                self.link.arena.release_send(st.slot);
            }
        }
        let id = c.id;
        c.reset();
        if id.0 != 0 {
            self.link.wire.finish(id);
        }
    }

    /// Drops a client stream message that will not be sent.
    fn discard(&self, ss: StreamSend<P>) {
        if let Some(st) = ss.staged {
            self.link.arena.release_send(st.slot);
        }
    }

    /// Routes a client stream message to its call's queue (or holds it until the call's
    /// request is sent).
    fn route_stream_send(
        &mut self,
        core: &ClientCore<P>,
        ss: StreamSend<P>,
    ) -> Result<(), LinkError> {
        let cell = &core.cells[ss.idx as usize];
        if cell.generation.load(Ordering::Acquire) != ss.generation || cell.mb.is_cancelled() {
            self.discard(ss);
            return Ok(());
        }
        match self.cell_slot[ss.idx as usize] {
            Some(slot) => {
                let slot = slot as usize;
                self.calls[slot].out.push_back(ss);
                self.flush_out(slot)
            }
            None => {
                // No wire slot yet: the request is still queued (in `pending`, or submitted and
                // not taken yet: the caller's submission and this message can race past one
                // `step`), or the call is over. A running mailbox means not started.
                if cell.mb.is_running() {
                    self.stream_pending.push_back(ss);
                } else {
                    self.discard(ss);
                }
                Ok(())
            }
        }
    }

    /// Sends the call's queued stream messages while window and credit last.
    fn flush_out(&mut self, slot: usize) -> Result<(), LinkError> {
        let call = self.calls[slot].id;
        while let Some(mut ss) = self.calls[slot].out.pop_front() {
            let (idx, generation) = (ss.idx, ss.generation);
            // A large message is lent to the server (remote READ, this connection only) when it
            // goes out; its key is revoked by the server's BulkRelease.
            let lend_failed = match ss.bulk.as_mut() {
                Some(b) if !b.is_lent() => lend_read(b, &self.link.qp).is_err(),
                _ => false,
            };
            let r = match ss.staged {
                None => match self
                    .link
                    .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.end_of_stream(call))
                {
                    Ok(()) => Ok(()),
                    Err(FrameError::Busy) => Err(None),
                    Err(FrameError::Link(e)) => return Err(e),
                    Err(_) => Err(Some(())),
                },
                Some(st) if lend_failed => {
                    // No key for the server to READ the message with: the message fails.
                    self.link.discard(st);
                    Err(Some(()))
                }
                Some(st) => {
                    let desc_of = ss.bulk.as_ref().and_then(BulkBuf::lent).map(desc);
                    match self
                        .link
                        .commit(st, |w, pl, ml| w.stream_message(call, pl, ml, desc_of))
                    {
                        Ok(()) => {
                            if let Some(b) = ss.bulk {
                                self.calls[slot].stream_lent.lend(b);
                            }
                            Ok(())
                        }
                        Err(CommitError::NoCredit(st)) => {
                            self.calls[slot].out.push_front(StreamSend {
                                staged: Some(st),
                                ..ss
                            });
                            if !self.out_calls.contains(&slot) {
                                self.out_calls.push(slot);
                            }
                            return Ok(());
                        }
                        Err(CommitError::Refused(_)) => Err(Some(())),
                        Err(CommitError::Link(e)) => return Err(e),
                    }
                }
            };
            match r {
                Ok(()) => {}
                Err(None) => {
                    // No credit or slot for the EndOfStream: try again later.
                    self.calls[slot].out.push_front(StreamSend {
                        idx,
                        generation,
                        staged: None,
                        bulk: None,
                    });
                    if !self.out_calls.contains(&slot) {
                        self.out_calls.push(slot);
                    }
                    return Ok(());
                }
                Err(Some(())) => {
                    // The call ended: nothing more of its stream goes out.
                    let rest = std::mem::take(&mut self.calls[slot].out);
                    for ss in rest {
                        self.discard(ss);
                    }
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The server's final status for the call in slot `s`: ends its stream (if any), delivers
    /// the outcome, and frees the call once the server has our buffers back.
    fn end_call(&mut self, core: &ClientCore<P>, s: usize, end: Option<Status>) {
        let outcome = match (&end, self.calls[s].inbox.take()) {
            (None, Some(inbox)) => {
                inbox.finish(None);
                Outcome::Ended
            }
            (Some(st), Some(inbox)) => {
                inbox.finish(Some(st.clone()));
                Outcome::Failed(st.clone())
            }
            (Some(st), None) => Outcome::Failed(st.clone()),
            (None, None) => Outcome::Failed(Status::internal("OK status for a unary call")),
        };
        self.deliver(core, s, outcome);
        if self.calls[s].lends() {
            self.calls[s].finishing = true;
        } else {
            self.retire(s);
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
        let tell = self.link.wire.cancel_local(call);
        self.give_up(
            core,
            slot,
            Status::cancelled("the call was cancelled"),
            tell,
        )
    }

    /// Ends the call in `slot` for the caller with `status` (its stream too), tells the server
    /// with a Cancel when `tell`, and frees the call once the server has our buffers back.
    fn give_up(
        &mut self,
        core: &ClientCore<P>,
        slot: usize,
        status: Status,
        tell: bool,
    ) -> Result<(), LinkError> {
        let call = self.calls[slot].id;
        if let Some(inbox) = self.calls[slot].inbox.take() {
            inbox.finish(Some(status.clone()));
        }
        for ss in std::mem::take(&mut self.calls[slot].out) {
            self.discard(ss);
        }
        self.deliver(core, slot, Outcome::Failed(status));
        if tell {
            self.link.control(Control::Cancel(call))?;
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
        let Some(now) = self.link.expiry_due() else {
            return Ok(0);
        };
        while let Some(call) = self.link.wire.expire(now) {
            n += 1;
            let slot = call.slot() as usize;
            if self.calls[slot].id != call {
                // Expired while waiting for a credit: the pending entry fails when retried.
                self.expire_pending(core, call);
                continue;
            }
            debug!(%call, "deadline exceeded");
            let status = Status::deadline_exceeded("deadline exceeded");
            self.give_up(core, slot, status, true)?;
        }
        Ok(n)
    }

    fn expire_pending(&mut self, core: &ClientCore<P>, call: CallId) {
        if let Some(pos) = self.pending.iter().position(|p| p.2 == call)
            && let Some((idx, generation, call, sub)) = self.pending.remove(pos)
        {
            {
                core.arena.release_send(sub.staged.slot);
                self.link.wire.finish(call);
                let status = Status::deadline_exceeded("deadline exceeded waiting for credit");
                self.fail_unsent(core, idx, generation, sub.inbox, status);
            }
        }
    }

    fn on_completion(&mut self, core: &ClientCore<P>, wc: &Wc) -> Result<(), LinkError> {
        let (key, kind, aux) = split_wr_id(wc.wr_id);
        if key != self.link.key() {
            return Ok(());
        }
        // Every completion goes through `check` (a flush fails everything but RECV): a failed
        // one fails the link, and the buffers its work request named go to the link's
        // graveyard in `fail_all`, never back to a pool here.
        match kind {
            Some(WrKind::Send) => call::send_done(&self.link, wc, aux),
            Some(WrKind::Nop) => completion(wc),
            Some(WrKind::Recv) => match self.link.on_recv(wc, aux)? {
                None => Ok(()),
                Some(Received::Frame(f)) => {
                    self.on_frame(core, f.event, Some(f.slot), f.metadata, f.payload)
                }
                Some(Received::Written { imm, .. }) => self.on_written(core, CallId(imm)),
            },
            Some(WrKind::Read) => {
                // A flushed READ filled nothing: never decode its buffer.
                completion(wc)?;
                self.on_read_done(core, aux as usize)
            }
            Some(WrKind::Write) => completion(wc),
            Some(WrKind::Bulk) => Err(LinkError::Protocol("bulk completion on a client".into())),
            Some(WrKind::Stripe) => match self.link.on_stripe(wc, aux)? {
                Some(whole) => self.on_completion(core, &whole),
                None => Ok(()),
            },
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
    ) -> Result<(), LinkError> {
        match event {
            Event::Response {
                call,
                bulk: Some(desc),
                ..
            } => {
                #[cfg(test)]
                self.seen_bulk.push(desc);
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
                // SAFETY: `buf` is kept in the call's `reading` until the READ's completion is
                // polled, or in the link's graveyard until the QPs are destroyed; nothing
                // touches it meanwhile.
                if let Err(e) = unsafe { self.link.post_read(call.slot(), &buf, desc) } {
                    self.link.park(buf);
                    return Err(e);
                }
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
                let end = if code == 0 { None } else { Some(status) };
                if self.calls[s].inbox.is_some() && self.calls[s].stream.busy() {
                    // Earlier stream messages are still being READ: end after them.
                    self.calls[s].end = Some(end);
                } else {
                    self.end_call(core, s, end);
                }
            }
            Event::StreamMessage { call, bulk, .. } => {
                let s = call.slot() as usize;
                if self.calls[s].id != call {
                    return Ok(());
                }
                if let (Some(inbox), Some(sl)) = (&self.calls[s].inbox, &slot)
                    && !md.is_empty()
                    && let Ok(m) = Metadata::decode(&sl.bytes()[md.clone()])
                {
                    inbox.set_metadata(m);
                }
                let held = match (bulk, slot) {
                    (Some(d), _) => Held::Bulk(d),
                    (None, Some(slot)) => {
                        Held::Item(Item::from_slot(slot, payload.start, payload.end))
                    }
                    (None, None) => return Ok(()),
                };
                let c = &mut self.calls[s];
                c.stream
                    .stream_in(&mut self.link, c.inbox.as_deref(), call, held, "server")?;
            }
            Event::WindowUpdate { call, grant } => {
                let s = call.slot() as usize;
                if self.calls[s].id == call {
                    if let Some((idx, generation)) = self.calls[s].cell {
                        let cell = &core.cells[idx as usize];
                        if cell.generation.load(Ordering::Acquire) == generation {
                            cell.window.fetch_add(grant, Ordering::AcqRel);
                            cell.send_waker.wake();
                        }
                    }
                    self.flush_out(s)?;
                }
            }
            Event::BulkRelease { call } => {
                let s = call.slot() as usize;
                if self.calls[s].id == call && self.calls[s].stream_lent.release() {
                    if self.calls[s].finishing && !self.calls[s].lends() {
                        self.retire(s);
                    }
                } else if self.calls[s].id == call {
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
                    // The server's terminal frame returns the request's payload and landing
                    // zone; stream messages it may still READ stay lent until their
                    // BulkReleases (a revoked key under a READ would break the connection).
                    self.calls[s].lent_bulk = None;
                    self.calls[s].landing = None;
                    if !self.calls[s].lends() {
                        self.retire(s);
                    }
                }
            }
            Event::GoAway => {
                info!(
                    "{}: server is going away: new calls will reconnect",
                    core.describe
                );
                core.draining.store(true, Ordering::Release);
            }
            Event::CreditOnly => {}
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
        let Some(mut buf) = c.landing.take() else {
            return Err(LinkError::Protocol(
                "landing write for a call without a landing zone".into(),
            ));
        };
        // The server's write is complete (its immediate arrived after the data): its key ends
        // here, before a byte is read.
        buf.revoke();
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
                self.on_frame(core, other, None, md, payload)?;
                if self.calls[s].finishing && !self.calls[s].lends() {
                    self.retire(s);
                }
            }
        }
        Ok(())
    }

    /// The READ of the call in slot `s` completed successfully (`check` passed: a failed or
    /// flushed READ never comes here, it fails the link).
    fn on_read_done(&mut self, core: &ClientCore<P>, s: usize) -> Result<(), LinkError> {
        let Some(c) = self.calls.get_mut(s) else {
            return Ok(());
        };
        if c.stream.reading() {
            let call = c.id;
            let idle = c
                .stream
                .read_done(&mut self.link, c.inbox.as_deref(), call, "server")?;
            if idle && let Some(end) = self.calls[s].end.take() {
                self.end_call(core, s, end);
            } else if self.calls[s].finishing && !self.calls[s].lends() {
                self.retire(s);
            }
            return Ok(());
        }
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
        self.link.control(Control::BulkRelease(call))
    }

    /// Fails every call of a dead connection with `status`. The QPs go to ERROR; what the
    /// calls' posted work requests name (READ targets) and what the server may still reach
    /// through our keys (lent payloads, landing zones) is parked in the link's graveyard, freed
    /// only once the QPs are destroyed (the CQ is not polled any more, so no completion would
    /// ever give it back). Send slots of posted SENDs stay taken for the same reason.
    ///
    /// The calls end with the connection's first recorded cause when there is one (a flush
    /// that followed the real failure, or a second error, does not replace it).
    fn fail_all(&mut self, core: &ClientCore<P>, status: Status) -> usize {
        use crate::verbs::{Qp, QpState};
        let status = core.dead_status.get().cloned().unwrap_or(status);
        if self.link.qp.state() != QpState::Error {
            self.link.fail_qps();
        }
        let mut n = 0;
        for s in 0..self.calls.len() {
            if self.calls[s].id.0 != 0 {
                if let Some(inbox) = self.calls[s].inbox.take() {
                    inbox.finish(Some(status.clone()));
                }
                self.deliver(core, s, Outcome::Failed(status.clone()));
                let mut c = std::mem::replace(&mut self.calls[s], DrvCall::empty());
                for ss in std::mem::take(&mut c.out) {
                    self.discard(ss);
                }
                c.park(&mut self.link);
                n += 1;
            }
        }
        for ss in std::mem::take(&mut self.stream_pending) {
            self.discard(ss);
        }
        while let Some(ss) = core.stream_sends.pop() {
            self.discard(ss);
        }
        while let Some((idx, generation, _call, sub)) = self.pending.pop_front() {
            core.arena.release_send(sub.staged.slot);
            self.fail_unsent(core, idx, generation, sub.inbox, status.clone());
            n += 1;
        }
        while let Some((idx, generation)) = core.submitted.pop() {
            n += 1;
            match core.cells[idx as usize].mb.take() {
                Taken::Run(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    self.fail_unsent(core, idx, generation, sub.inbox, status.clone());
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

impl<P: Provider> Drop for Driver<P> {
    fn drop(&mut self) {
        // Teardown with calls in flight (the last handle dropped them): what they lent or
        // posted goes to the graveyard, which `link` frees after destroying its QPs (its
        // fields drop after this), whatever the order of this struct's fields.
        self.calls.park_all(&mut self.link);
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
#[cfg(test)]
mod size_guard {
    use crate::verbs::soft::Soft;

    /// What every small call moves around by value stays small: these moves showed up as
    /// memcpy in profiles of 32 B calls when a submission was 336 bytes and a received frame
    /// 384 (large-call buffers are boxed; a received frame keeps no copy of its header).
    #[test]
    fn hot_path_structs_stay_small() {
        let sub = std::mem::size_of::<super::Submission<Soft>>();
        let inbound = std::mem::size_of::<crate::link::Inbound>();
        let outcome = std::mem::size_of::<super::Outcome<Soft>>();
        assert!(sub <= 96, "Submission is {sub} bytes");
        assert!(inbound <= 256, "Inbound is {inbound} bytes");
        assert!(outcome <= 128, "Outcome is {outcome} bytes");
    }
}
