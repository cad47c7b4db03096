//! One client connection, generic over the provider: the lock-free front that callers use from
//! any thread (call cells, submission and cancellation queues, send slots) and the driver that
//! owns the QP, its completions (a CQ of its own, or its seat on the CQ the process's
//! thread-polled connections share: [`hub`]) and the protocol state.
//!
//! ```text
//! caller (any thread)                          driver (whoever holds the token)
//!   permit + cell ─> encode into a send slot     take submissions ─> header ─> SEND
//!   submit(cell) ─> queue ─> doorbell/drive      poll CQ ─> frames ─> complete(cell) ─> wake
//!   await cell (zero-copy decode from slot)      cancels, deadlines, credits, reposts
//! ```
//!
//! The driver is the process's poller thread by default ([`group`]: one thread for every such
//! connection of the process), or the calling threads themselves
//! (`ClientPoller::Caller`: each waiting caller tries to take the driver token and poll). No lock
//! is ever waited on: the token is try-only.
//!
//! This file holds the connection's types and its setup; the rest is by concern: [`submit`]
//! (call cells, send slots, unary and pipelined calls), [`encode`] (requests and the buffers
//! they lend; [`overlap`], whether a mid-sized one goes pending), [`stream`] (streaming calls), [`poller`] (who drives and how it waits; [`group`], the process's poller thread),
//! [`driver`] (the driver's turn, call life cycle, failure) and [`frames`] (what the server
//! sends). The per-call machinery shared with the server is in [`crate::call`].

mod cells;
mod driver;
mod encode;
pub(crate) use encode::PENDING_MIN;
mod frames;
mod group;
mod hub;
pub(crate) use group::Poller;
pub(crate) use hub::{Cqs, Hub};
#[cfg(test)]
mod hub_tests;
mod overlap;
mod poller;
mod sizes;
mod stream;
mod submit;
#[cfg(test)]
mod window_tests;

use crate::queue::ClearIfAny;
use cells::CellTable;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_queue::{ArrayQueue, SegQueue};

use crate::buf::{
    BulkBuf, BulkPool, Exclusive, Mailbox, Piece, RecvSlot, SlotArena, encode::MAX_PIECES,
};
use crate::call::{Calls, Ledger, Record, StreamIn};
use crate::client::{ClientPoller, RegHandle, RegisteredBytesMut};
use crate::doorbell::Doorbell;
use crate::link::{Link, LinkKey, Staged};
use crate::method::CallKind;
use crate::streaming::Inbox;
use crate::verbs::shared::SharedDevice;
use crate::verbs::{Provider, Wc};
use crate::wire::CallId;
use crate::{Metadata, Status};

const POLL_BATCH: usize = 32;

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
    /// The payload is written while the server READs it ([`encode::FillJob`]).
    pending: Option<Pending<P>>,
    /// Its copy, done by the caller as it hands the submission over.
    fill: Option<encode::FillJob>,
    landing: Option<BulkBuf<P>>,
    /// A request whose way ([`overlap`]) the connection chose: timed until its response.
    timed: Option<overlap::Timed>,
}

/// A request payload sent pending (`wire::FrameFlags::BULK_PENDING`): the caller copies the
/// message into `region` (shared with its [`encode::FillJob`], so the memory outlives
/// whichever lets go last) and publishes in `fill` how much is written; the driver lends the
/// region and tells the server, with BulkReady frames, what it may READ.
struct Pending<P: Provider> {
    /// The window the server reads the region through (first: revoked before the region
    /// can go back to its pool).
    window: Option<P::Mr>,
    region: RegHandle,
    fill: Arc<encode::Fill>,
}

/// A request payload sent from where it lies: its pieces, in order (staged in the
/// submission's bulk buffer, or the referenced field in the user's region), and the region,
/// kept alive until the server has read it. The keys are bound when the request is sent
/// ([`Driver::lend`]).
struct Gathered<P: Provider> {
    /// The window the server reads the referenced pieces of the user's region through
    /// (first: revoked before the region can go back to its pool).
    window: Option<P::Mr>,
    user: RegHandle,
    pieces: [Piece; MAX_PIECES],
    n: usize,
    referenced: u64,
}

/// A staging buffer and the pieces of a request gathered around a field in the user's region.
type Staging<P> = (BulkBuf<P>, Gathered<P>);

/// What a call lends the server until it says it is done (BulkRelease, or its final frame):
/// dropping it revokes the server's keys.
struct Lent<P: Provider> {
    _buf: Option<BulkBuf<P>>,
    /// A window over a region and the region: the window drops (is revoked) first.
    _user: Option<(Option<P::Mr>, RegHandle)>,
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
    /// Large messages of the client stream staged or lent and not yet released by the
    /// server: at most `STREAM_LOANS` (the window may let many more small ones go).
    loans: AtomicU32,
    /// Woken when the window grows, a loan ends or the call ends.
    send_waker: atomic_waker::AtomicWaker,
    /// Claimed by an async call (the driver task polls for those, not for blocking calls).
    is_async: AtomicBool,
}

impl<P: Provider> Cell<P> {
    fn new() -> Cell<P> {
        Cell {
            mb: Mailbox::default(),
            generation: AtomicU32::new(0),
            window: AtomicU32::new(0),
            loans: AtomicU32::new(0),
            send_waker: atomic_waker::AtomicWaker::new(),
            is_async: AtomicBool::new(false),
        }
    }
}

/// The driver's record of a call on the wire.
struct DrvCall<P: Provider> {
    id: CallId,
    /// The method's id (what [`sizes`] learns by).
    method: u32,
    /// The caller's cell, until the outcome is delivered or the caller gave up.
    cell: Option<(u32, u32)>,
    lent_bulk: Option<Lent<P>>,
    landing: Option<BulkBuf<P>>,
    reading: Option<(BulkBuf<P>, Metadata)>,
    /// The call is over for the caller; waiting for the server to give our buffers back.
    finishing: bool,
    /// Timed for [`overlap`] until its response arrives.
    timed: Option<overlap::Timed>,
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
            method: 0,
            cell: None,
            lent_bulk: None,
            landing: None,
            reading: None,
            finishing: false,
            timed: None,
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
        self.method = 0;
        self.cell = None;
        self.lent_bulk = None;
        self.landing = None;
        self.reading = None;
        self.finishing = false;
        self.timed = None;
        self.inbox = None;
        self.stream.clear();
        self.out.clear_if_any();
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
    /// Calls whose payload is still being written: the call, how much of it the caller has
    /// written, and how much BulkReady frames told the server so far.
    filling: Vec<(CallId, Arc<encode::Fill>, u64)>,
    /// Its CQ, or its seat on the process's shared one (declared after `link`: the QPs are
    /// destroyed first).
    pub(crate) cqs: Cqs<P>,
    /// The rendezvous descriptors the server sent (the rogue-peer tests replay them).
    #[cfg(test)]
    pub(crate) seen_bulk: Vec<crate::wire::BulkDesc>,
    wcs: [Wc; POLL_BATCH],
    _pd: Arc<P::Pd>,
    /// The device (shared by the process's connections): its asynchronous events are read
    /// while the connection idles.
    dev: SharedDevice<P>,
    /// The completions in the CQ were handled once after the connection died.
    drained_dead: bool,
}

/// Counters of one connection.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) bulk_requests: AtomicU64,
    pub(crate) bulk_responses: AtomicU64,
    pub(crate) landing_responses: AtomicU64,
    /// Packed stream frames received ([`crate::wire::packed`]), and the messages they held.
    pub(crate) packed_frames: AtomicU64,
    pub(crate) packed_messages: AtomicU64,
    /// Request payload bytes sent from the user's registered memory (not copied).
    pub(crate) zero_copy_request_bytes: AtomicU64,
    /// Request payload bytes sent pending: copied while the server READ them.
    pub(crate) overlapped_request_bytes: AtomicU64,
    /// Async unary calls that found their outcome while their own task drove the connection.
    pub(crate) caller_driven: AtomicU64,
    /// Async unary calls that drove the connection for a while, then handed it to the
    /// poller thread and slept.
    pub(crate) handed_over: AtomicU64,
}

/// A connection's doorbell: the poller thread's, or its own, kept inline (made on a
/// blocking call's path, when its caller first sleeps: an `Arc` there was a heap allocation
/// in a call, which `rpc_accounting` caught).
#[derive(Debug)]
pub(crate) enum Bell {
    Shared(Arc<Doorbell>),
    Own(Doorbell),
}

impl std::ops::Deref for Bell {
    type Target = Doorbell;

    fn deref(&self) -> &Doorbell {
        match self {
            Bell::Shared(d) => d,
            Bell::Own(d) => d,
        }
    }
}

/// One client connection.
pub(crate) struct ClientCore<P: Provider> {
    pub(crate) driver: Exclusive<Driver<P>>,
    /// The completion channel of the driver's CQ, reachable without the driver's lock (the
    /// poller thread's epoll set, the driver task's runtime registration, which shares it);
    /// `None` on the shared CQ ([`hub`]), whose channel the poller thread watches. Declared
    /// after `driver`: the CQ is destroyed before the channel.
    channel: Option<Arc<P::CompChannel>>,
    /// Call cells, taken by callers and given back when their call ends.
    cells: CellTable<Cell<P>>,
    /// Callers waiting for a free cell (slow path only).
    waiters: std::sync::atomic::AtomicUsize,
    cell_freed: tokio::sync::Notify,
    /// Async callers waiting for a free send slot (slow path only).
    slot_waiters: std::sync::atomic::AtomicUsize,
    slot_freed: tokio::sync::Notify,
    /// Wakes the driver task (`ClientPoller::Caller`) when work arrives.
    drive: Arc<tokio::sync::Notify>,
    /// Cells held by async calls.
    async_calls: std::sync::atomic::AtomicUsize,
    /// Callers driving the connection themselves while they wait (`ClientPoller::Thread`):
    /// the poller thread leaves it to them ([`poller::CallerDrive`]).
    caller_drives: std::sync::atomic::AtomicU32,
    submitted: ArrayQueue<(u32, u32)>,
    cancelled: ArrayQueue<(u32, u32)>,
    stream_sends: SegQueue<StreamSend<P>>,
    grants: SegQueue<(u32, u32, u32)>,
    /// A stream's initial window and the most it is opened to (`wire::Config`).
    stream_window: u32,
    stream_window_max: u32,
    arena: Arc<SlotArena<P>>,
    pub(crate) bulk: Arc<BulkPool<P>>,
    /// The smallest part of a pending request ([`encode::FillJob`]): larger when the
    /// connection stripes one-sided transfers over several QPs, from that size on.
    fill_part_min: usize,
    /// Requests from this size on are sent pending.
    pending_min: usize,
    /// With the default threshold: whether smaller ones from [`overlap::AUTO_MIN`] up go
    /// pending, as measured on this connection.
    overlap: Option<overlap::Overlap>,
    /// What a sleeping driver waits on besides the completion channel: the poller thread's
    /// (`ClientPoller::Thread`, set at creation), or this connection's own, made when a
    /// blocking caller first sleeps on it (`ClientPoller::Caller`: most never do, and an
    /// eventfd per connection they never use costs a client a descriptor per connection).
    /// Nobody sleeps on it before it exists, so ringers skip it until then.
    doorbell: OnceLock<Bell>,
    /// `ClientPoller::Thread`: the process's poller, and this connection's place on its list
    /// of connections with work ([`group`]).
    poller: Option<group::Poller>,
    /// Its place on the poller thread's list, and the completions the hub routed to it.
    routed: Arc<hub::Routed>,
    /// The shared CQ it is on, if it is.
    hub: Option<Arc<Hub<P>>>,
    dead: AtomicBool,
    /// The server sent GoAway: calls in flight finish here, new calls go to a new connection.
    draining: AtomicBool,
    dead_status: OnceLock<Status>,
    /// The server stopped answering on the link (retries exceeded) and the connection waits
    /// [`LOST_GRACE`] for the server's reason on the control connection before it dies: the
    /// server closes its QP right after it sends the reason, so the client's next SEND may
    /// fail first, with a cause less precise than the server's.
    lost: AtomicBool,
    lost_status: OnceLock<(Instant, Status)>,
    lost_notify: tokio::sync::Notify,
    stop: AtomicBool,
    mode: ClientPoller,
    eager_limit: usize,
    max_message: u64,
    pub(crate) counters: Counters,
    pub(crate) describe: String,
    pd: Arc<P::Pd>,
    /// The peer explicit regions are lent to (`Region::lend`).
    window_target: crate::verbs::WindowTarget,
    /// Response sizes per method, for landing zones nobody asked for ([`sizes`]).
    sizes: sizes::LearnedSizes,
}

impl<P: Provider> std::fmt::Debug for ClientCore<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCore")
            .field("connection", &self.describe)
            .field("dead", &self.dead.load(Ordering::Relaxed))
            .finish()
    }
}

/// A connection's per-call tables, sized by its call limit alone: made while the connect step
/// waits for the server's Welcome (their memory is new, and zeroing it takes page faults),
/// not after it.
pub(crate) struct Tables<P: Provider> {
    cells: CellTable<Cell<P>>,
    submitted: ArrayQueue<(u32, u32)>,
    cancelled: ArrayQueue<(u32, u32)>,
    calls: Calls<DrvCall<P>>,
    cell_slot: Box<[Option<u32>]>,
    pending: VecDeque<(u32, u32, CallId, Submission<P>)>,
    out_calls: Vec<usize>,
}

impl<P: Provider> Tables<P> {
    /// Tables for `max_calls` calls in flight.
    pub(crate) fn new(max_calls: u32) -> Tables<P> {
        let n = max_calls as usize;
        Tables {
            // Made a chunk at a time as calls in flight need them (see `cells`).
            cells: CellTable::new(n, Cell::new),
            submitted: ArrayQueue::new(n),
            cancelled: ArrayQueue::new(n),
            // Records are made as wire slots are first used (the lowest free slot goes
            // first): a connection that never has more than a few calls in flight writes a
            // few records at connect, not `n` of about 700 bytes. Every slot a frame names
            // was started here first (the wire refuses slots never used), so indexing by
            // the slots of events stays in the table.
            calls: Calls::lazy(n),
            cell_slot: vec![None; n].into_boxed_slice(),
            pending: VecDeque::with_capacity(n),
            out_calls: Vec::with_capacity(n),
        }
    }
}

/// Everything `ClientCore::new` needs from the connect step.
pub(crate) struct Parts<P: Provider> {
    pub(crate) dev: SharedDevice<P>,
    pub(crate) pd: Arc<P::Pd>,
    pub(crate) cqs: Cqs<P>,
    /// `None` on the shared CQ.
    pub(crate) channel: Option<P::CompChannel>,
    pub(crate) link: Link<P>,
    /// Sized by the connection's call limit.
    pub(crate) tables: Tables<P>,
    pub(crate) mode: ClientPoller,
    pub(crate) eager_limit: usize,
    pub(crate) max_message: u64,
    /// Lend landing zones sized from each method's last large response.
    pub(crate) learn_sizes: bool,
    /// Requests from this size on are sent pending ([`encode::FillJob`]); `None`: the
    /// default ([`PENDING_MIN`]), with the way of smaller ones learned ([`overlap`]).
    pub(crate) pending_min: Option<usize>,
    pub(crate) describe: String,
    pub(crate) stream_window: u32,
    pub(crate) stream_window_max: u32,
}

impl<P: Provider> ClientCore<P> {
    pub(crate) fn new(parts: Parts<P>) -> std::io::Result<Arc<ClientCore<P>>> {
        let t = parts.tables;
        let arena = Arc::clone(&parts.link.arena);
        let bulk = Arc::clone(&parts.link.bulk);
        let pd = Arc::clone(&parts.pd);
        let window_target = crate::verbs::Qp::window_target(&parts.link.qp);
        let channel = parts.channel.map(Arc::new);
        let (routed, hub) = match &parts.cqs {
            Cqs::Shared(seat) => (Arc::clone(seat.routed()), Some(Arc::clone(seat.hub()))),
            Cqs::Own(_) => (hub::Routed::unrouted(), None),
        };
        let poller = match parts.mode {
            ClientPoller::Thread => Some(group::Poller::get()?),
            ClientPoller::Caller => None,
        };
        let fill_part_min = if parts.link.lanes().is_empty() {
            encode::FILL_PART_MIN
        } else {
            encode::FILL_PART_MIN.max(crate::link::STRIPE_MIN)
        };
        let driver = Driver {
            #[cfg(test)]
            seen_bulk: Vec::new(),
            calls: t.calls,
            cell_slot: t.cell_slot,
            pending: t.pending,
            stream_pending: VecDeque::new(),
            out_calls: t.out_calls,
            filling: Vec::new(),
            link: parts.link,
            cqs: parts.cqs,
            wcs: [Wc::default(); POLL_BATCH],
            _pd: parts.pd,
            dev: parts.dev,
            drained_dead: false,
        };
        Ok(Arc::new(ClientCore {
            driver: Exclusive::new(driver),
            channel,
            cells: t.cells,
            waiters: std::sync::atomic::AtomicUsize::new(0),
            cell_freed: tokio::sync::Notify::new(),
            slot_waiters: std::sync::atomic::AtomicUsize::new(0),
            slot_freed: tokio::sync::Notify::new(),
            drive: Arc::new(tokio::sync::Notify::new()),
            async_calls: std::sync::atomic::AtomicUsize::new(0),
            caller_drives: std::sync::atomic::AtomicU32::new(0),
            submitted: t.submitted,
            cancelled: t.cancelled,
            stream_sends: SegQueue::new(),
            grants: SegQueue::new(),
            stream_window: parts.stream_window,
            stream_window_max: parts.stream_window_max,
            arena,
            bulk,
            fill_part_min,
            pending_min: parts
                .pending_min
                .unwrap_or(PENDING_MIN)
                .max(encode::PENDING_FLOOR),
            overlap: parts.pending_min.is_none().then(overlap::Overlap::default),
            // Connections of the process's poller thread share its doorbell.
            doorbell: match poller {
                Some(p) => OnceLock::from(Bell::Shared(p.doorbell())),
                None => OnceLock::new(),
            },
            poller,
            routed,
            hub,
            dead: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            dead_status: OnceLock::new(),
            lost: AtomicBool::new(false),
            lost_status: OnceLock::new(),
            lost_notify: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            mode: parts.mode,
            eager_limit: parts.eager_limit,
            max_message: parts.max_message,
            counters: Counters::default(),
            describe: parts.describe,
            sizes: sizes::LearnedSizes::new(parts.learn_sizes),
            pd,
            window_target,
        }))
    }

    /// Allocates registered memory for an explicit region, lent to this connection's peer
    /// only by its leases.
    pub(crate) fn alloc_region(
        &self,
        len: usize,
    ) -> Result<Box<dyn super::region::RegionMem>, Status> {
        super::region::alloc::<P>(&self.pd, self.window_target, len)
    }

    /// The connection's slots and its process's pool of them.
    pub(crate) fn slots(&self) -> crate::client::ChannelSlots {
        let pool = self.arena.send_pool();
        let g = self.arena.geometry();
        crate::client::ChannelSlots {
            registered: u64::from(pool.registered()),
            free: pool.free() as u64,
            send_held: u64::from(self.arena.held_sends()),
            send_cap: u64::from(g.send_slots),
            recv_window: u64::from(self.arena.recv_window()),
            recv_max: u64::from(g.recv_slots),
            slot_size: g.slot_size,
        }
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

    /// Calls this connection may have in flight at once (its call cells).
    pub(crate) fn max_calls(&self) -> usize {
        self.cells.len()
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

    /// Whether the link failed and the connection waits for the server's reason.
    #[inline]
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Waits until the link fails; gives why.
    pub(crate) async fn link_lost(&self) -> Status {
        loop {
            let notified = self.lost_notify.notified();
            if let Some((_, st)) = self.lost_status.get() {
                return st.clone();
            }
            notified.await;
        }
    }

    /// Marks the connection dead (TCP closed, QP failed); every call fails with `status`.
    pub(crate) fn kill(&self, status: Status) {
        let _ = self.dead_status.set(status);
        self.dead.store(true, Ordering::Release);
        self.cell_freed.notify_waiters();
        self.slot_freed.notify_waiters();
        self.ring_always();
        // Whoever drives next fails the calls; make sure someone does.
        self.progress();
    }

    /// Stops the poller thread (when the last handle is dropped).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.ring_always();
        self.drive.notify_one();
    }
}

/// How long a connection whose link failed waits for the server's reason (sent on the control
/// connection just before the server closes its QP) before its calls fail with the link's
/// error. Real RNICs report a vanished peer only after their retries (about half a second with
/// the usual ACK timeout), so the reason is normally there already; the wait matters when the
/// peer's QP is gone at once (soft) or when the host is loaded.
pub(crate) const LOST_GRACE: Duration = Duration::from_millis(250);

/// When the connection dies by itself if nobody acted on the link's failure (its control
/// connection's task is gone).
const LOST_FALLBACK: Duration = Duration::from_secs(1);

/// Key of a client's only link.
pub(crate) const CLIENT_LINK: LinkKey = LinkKey {
    idx: 0,
    generation: 1,
};

/// Start time shared by every connection (the protocols' clock).
pub(crate) use crate::link::epoch;

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
