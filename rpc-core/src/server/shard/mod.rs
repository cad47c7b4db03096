//! A server shard: one thread (pinned to a core when asked), one CQ, the QPs of the connections
//! assigned to it, their slots, and a task slab of in-flight handler futures.
//!
//! The poll loop: take new connections and disconnects from the inbox (lock-free), poll the CQ in
//! batches and handle each completion (dispatching requests to handlers, which run inline until
//! they wait), poll woken handler tasks, repost receive slots and return credits, expire
//! deadlines; when idle, spin, then yield, then sleep on the completion channel and the shard's
//! doorbell. Per call: no lock, no allocation, no system call.
//!
//! Every connection receives through the shard's one shared receive queue (SRQ) and sends from
//! the shard's send slots, so a connection costs a QP and small state, and registered memory
//! follows the calls in flight: [`grants`] says how the receive slots are shared out.
//!
//! This file holds the shard's and its connections' types; the rest is by concern: [`conn`]
//! (opening the shard, accepting and closing connections), [`grants`] (credits from the
//! receive pool), [`poll`] (the poll loop), [`recv`]
//! (what clients send, dispatch), [`respond`] (responses, streams, statuses) and [`bulk`]
//! (handlers' one-sided operations). The per-call machinery shared with the client is in
//! [`crate::call`].

mod bulk;
mod conn;
mod grants;
mod poll;
mod recv;
mod respond;

use bulk::InflightOp;
pub(crate) use conn::open;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_queue::SegQueue;

use crate::buf::{BulkBuf, BulkPool, RecvPool, SlotArena, TaskId};
use crate::call::{Calls, Ledger, Record, StreamIn};
use crate::connect::Hello;
use crate::doorbell::Doorbell;
use crate::link::{Link, LinkKey, Staged};
use crate::server::ServerConfig;
use crate::server::call::Tasks;
use crate::server::peer::PeerApi;
use crate::server::router::Router;
use crate::stats::Table;
use crate::streaming::Inbox;
use crate::verbs::{Provider, Wc};
use crate::wire::{BulkDesc, CallId};
use crate::{Code, Metadata, MethodDesc};

/// Completions taken per `poll`.
const POLL_BATCH: usize = 32;

/// QP numbers to connection indices: looked up for every receive completion, so hashed with
/// one multiplication (QP numbers are the device's, not a peer's choice).
type QpMap = std::collections::HashMap<u32, u16, std::hash::BuildHasherDefault<QpHasher>>;

/// Fibonacci hashing of a QP number.
#[derive(Default)]
struct QpHasher(u64);

impl std::hash::Hasher for QpHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A message to a shard from the acceptor.
pub(crate) enum ShardMsg {
    /// A client that passed the handshake checks: create its QP and answer.
    Connect {
        hello: Hello,
        peer: std::net::SocketAddr,
        /// A duplicate of the client's TCP socket, on which the shard writes the Welcome
        /// itself: the client has it without a hand-off back to the acceptor's task first
        /// (`None` when the acceptor could not duplicate it: the acceptor sends it).
        control: Option<std::os::fd::OwnedFd>,
        reply: tokio::sync::oneshot::Sender<Result<Accepted, (crate::Code, String)>>,
        /// Dropped by the shard when it closes the connection: the acceptor then closes TCP.
        closed: tokio::sync::oneshot::Sender<String>,
    },
    /// The client's TCP connection ended: drop its calls and QP.
    Disconnect(LinkKey),
}

/// A shard's answer to a [`ShardMsg::Connect`] it took.
pub(crate) struct Accepted {
    pub(crate) key: LinkKey,
    /// The framed Welcome's bytes the shard did not write (all of them without a control
    /// socket; the tail a full send buffer left), for the acceptor to send; or why writing it
    /// failed (the client went away).
    pub(crate) unsent: std::io::Result<Vec<u8>>,
}

/// What the acceptor and the server handle see of a shard.
pub(crate) struct ShardHandle {
    pub(crate) inbox: Arc<SegQueue<ShardMsg>>,
    pub(crate) doorbell: Arc<Doorbell>,
    pub(crate) stop: Arc<AtomicBool>,
    /// Set by a graceful shutdown (not by dropping the server): the drain lingers for
    /// requests still on the way (see `DRAIN_LINGER`).
    pub(crate) linger: Arc<AtomicBool>,
    pub(crate) live_calls: Arc<AtomicUsize>,
    /// Connections the shard holds open.
    pub(crate) open_conns: Arc<AtomicUsize>,
    /// Response bytes sent straight from the request's buffer (see `respond_landing`).
    pub(crate) zero_copy_bytes: Arc<AtomicU64>,
    /// Bytes of one-sided transfers striped over several QPs (see `link::Lanes`).
    pub(crate) striped_bytes: Arc<AtomicU64>,
    /// Call statistics ([`crate::ServerBuilder::stats`]).
    pub(crate) stats: Option<Arc<Table>>,
    /// The receive pool's figures, as the shard last published them.
    pub(crate) pool: Arc<grants::Gauge>,
    pub(crate) thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ShardHandle {
    pub(crate) fn send(&self, msg: ShardMsg) {
        self.inbox.push(msg);
        self.doorbell.ring();
    }
}

/// A call of the server, indexed by the client's call slot.
struct SrvCall<P: Provider> {
    id: CallId,
    task: Option<TaskId>,
    landing: Option<BulkDesc>,
    /// The client lent a buffer (rendezvous payload or landing zone) for this call.
    lent: bool,
    /// A rendezvous request payload being READ: the buffer and what to dispatch it with.
    reading: Option<PendingDispatch<P>>,
    /// Our buffer lent to the client (rendezvous response).
    resp_bulk: Option<RespHold<P>>,
    /// Sources of landing-zone WRITEs posted for this slot whose completions are not polled
    /// yet, oldest first (completions of one slot come in posting order: a slot's next call
    /// starts only after the client saw the previous WRITE_WITH_IMM, posted last on the
    /// primary QP). The NIC's, not the call's: kept across calls of the slot, returned one by
    /// one by successful WRITE completions, parked when the connection fails or closes.
    writing: VecDeque<RespHold<P>>,
    /// READ completions still to come for targets parked when the slot was reused under them
    /// (`park_reads`): skipped, so they are not taken for the new call's (READs of one slot
    /// complete in posting order on the primary QP).
    stale_reads: u16,
    /// The buffer a rendezvous request was READ into, shared with the request's `bytes`
    /// fields: a response may be sent from it (`respond_landing`).
    req_buf: Option<Arc<BulkBuf<P>>>,
    /// The call was dropped while its READ was in flight: release after the READ completes.
    drop_after_read: bool,
    /// Counted in the shard's live calls (accepted, not finished).
    active: bool,
    /// The client's stream (client-streaming and bidi calls).
    inbox: Option<Arc<Inbox>>,
    /// The client's stream coming in: a large message being READ, later frames held.
    stream: StreamIn<P>,
    /// Our large stream messages lent to the client, released by its BulkReleases in order.
    stream_bulks: Ledger<P>,
    /// The handler's stream waits for window, credit or a send slot.
    blocked: bool,
    /// The method's path (for messages).
    path: &'static str,
    /// The method, while the call is counted in the statistics (taken when its end is).
    stat: Option<&'static MethodDesc>,
    /// When the call's request was taken from the CQ (the link's clock of that turn, from the
    /// process epoch as `link::now_ns`), for its latency.
    stat_start: u64,
    /// The call's trace context, when the request carried one (current while it runs).
    trace: Option<crate::trace::TraceContext>,
    /// The call's `rpc.server` span (disabled unless traced and a subscriber wants it).
    span: tracing::Span,
}

/// A request buffer shared by the request's `bytes` fields and the call.
struct SharedBuf<P: Provider>(Arc<BulkBuf<P>>);

impl<P: Provider> AsRef<[u8]> for SharedBuf<P> {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// What a response sent from our memory keeps alive until the peer is done with it.
struct RespHold<P: Provider> {
    /// The buffer the frame (or its staged part) is in.
    _buf: BulkBuf<P>,
    /// The request's buffer, when the frame references bytes in it.
    _source: Option<Arc<BulkBuf<P>>>,
}

impl<P: Provider> RespHold<P> {
    fn new(buf: BulkBuf<P>) -> Self {
        RespHold {
            _buf: buf,
            _source: None,
        }
    }
}

/// Uncounts a call from the shard's live calls (once). Only the shard's thread writes the
/// count (others read it), so a load and a store do, without a locked instruction.
fn retire<P: Provider>(live: &AtomicUsize, c: &mut SrvCall<P>) {
    if c.active {
        c.active = false;
        live.store(live.load(Ordering::Relaxed) - 1, Ordering::Release);
    }
}

impl<P: Provider> Record<P> for SrvCall<P> {
    fn id(&self) -> CallId {
        self.id
    }

    fn reset(&mut self) {
        self.id = CallId(0);
        self.task = None;
        self.landing = None;
        self.lent = false;
        self.reading = None;
        self.resp_bulk = None;
        self.req_buf = None;
        self.drop_after_read = false;
        self.active = false;
        self.inbox = None;
        self.stream.clear();
        self.stream_bulks.clear();
        self.blocked = false;
        self.path = "?";
        self.stat = None;
        if self.trace.take().is_some() {
            self.span = tracing::Span::none();
        }
        // Not `writing` nor `stale_reads`: those follow the NIC's completions, not calls.
    }

    /// Besides the slot's READ targets, WRITE sources and response buffers, the request's
    /// buffer (a WRITE may send from it).
    fn park(&mut self, link: &mut Link<P>) {
        self.park_reads(link);
        if let Some(h) = self.resp_bulk.take() {
            link.park(h);
        }
        if let Some(b) = self.req_buf.take() {
            link.park(b);
        }
        self.stream_bulks.park(link);
        if !self.writing.is_empty() {
            link.park(std::mem::take(&mut self.writing));
        }
    }

    fn empty() -> SrvCall<P> {
        SrvCall {
            id: CallId(0),
            task: None,
            landing: None,
            lent: false,
            reading: None,
            resp_bulk: None,
            req_buf: None,
            drop_after_read: false,
            active: false,
            inbox: None,
            stream: StreamIn::new(),
            stream_bulks: Ledger::new(),
            writing: VecDeque::new(),
            stale_reads: 0,
            blocked: false,
            path: "?",
            stat: None,
            stat_start: 0,
            trace: None,
            span: tracing::Span::none(),
        }
    }
}

impl<P: Provider> SrvCall<P> {
    /// Whether a READ posted for this slot is still in flight (its target is the NIC's).
    fn reads_in_flight(&self) -> bool {
        self.request_read_in_flight() || self.stream.reading()
    }

    /// Whether a READ of the request's payload is in flight (a pending payload waiting for
    /// its next BulkReady has none).
    fn request_read_in_flight(&self) -> bool {
        self.reading.as_ref().is_some_and(|p| p.reads_left > 0)
    }

    /// Moves the targets of the slot's READs in flight into `link`'s graveyard (freed only
    /// after the link's QPs are destroyed): for a slot reused while they are posted. Their
    /// completions then find nothing to fill.
    fn park_reads(&mut self, link: &mut Link<P>) {
        if let Some(p) = self.reading.take() {
            self.stale_reads = self.stale_reads.saturating_add(u16::from(p.reads_left));
            if p.reads_left > 0 {
                link.park(p.buf);
            }
        }
        if self.stream.park(link) {
            self.stale_reads = self.stale_reads.saturating_add(1);
        }
    }
}

struct PendingDispatch<P: Provider> {
    buf: BulkBuf<P>,
    /// READs (one per remote range of the payload) whose completion is still to come.
    reads_left: u8,
    /// A payload sent pending ([`crate::wire::FrameFlags::BULK_PENDING`]): its one range, and how
    /// much of it is READ (posted) and ready (what the client's BulkReady frames said). One
    /// READ at a time (the send queue holds one per call); the call is dispatched once all
    /// of it is READ. Otherwise every range's READ is posted at once: `range` is the first,
    /// and `posted == ready ==` the whole payload's length (so `posted >= range.len`).
    range: BulkDesc,
    posted: u64,
    ready: u64,
    method: u32,
    metadata: Metadata,
    deadline_at: Option<u64>,
}

/// A terminal frame waiting for a credit (or, spilled, for a send slot).
#[derive(Debug)]
enum Deferred {
    Response {
        call: CallId,
        staged: Body,
        bulk: Option<BulkDesc>,
    },
    Status {
        call: CallId,
        staged: Body,
        code: u8,
    },
}

/// The body (metadata and payload) of a terminal frame: in a send slot, or, when the shard
/// had none free (they are shared by its connections), encoded on the heap until one frees.
#[derive(Debug)]
enum Body {
    Slot(Staged),
    Spilled(Box<Spill>),
}

/// A frame body encoded off the send slots: `bytes` is the metadata then the payload.
#[derive(Debug)]
struct Spill {
    bytes: Vec<u8>,
    md_len: usize,
}

impl Body {
    fn payload_len(&self) -> usize {
        match self {
            Body::Slot(s) => s.payload_len,
            Body::Spilled(s) => s.bytes.len() - s.md_len,
        }
    }
}

/// One connection of the shard.
pub(crate) struct ServerConn<P: Provider> {
    link: Link<P>,
    /// Calls whose handler stream waits for credit or a send slot.
    blocked: Vec<CallId>,
    /// GoAway was sent (the server is draining).
    goaway_sent: bool,
    calls: Calls<SrvCall<P>>,
    deferred: VecDeque<Deferred>,
    /// Tells the connection's bootstrap task why we close it (it tells the client).
    pub(super) closed: Option<tokio::sync::oneshot::Sender<String>>,
    peer: std::net::SocketAddr,
    /// The largest request accepted and response sent (the server's `max_message`).
    max_message: u64,
    /// The QP takes gather lists long enough for a zero-copy response.
    gather: bool,
    zero_copy_bytes: Arc<AtomicU64>,
    /// The shard's call statistics, if kept.
    stats: Option<Arc<Table>>,
    /// When a full sweep first found the client silent since the one before (cleared by its
    /// next frame; see `grants::RECLAIM_IDLE`).
    idle_since: Option<Instant>,
}

/// The shard.
pub(crate) struct Shard<P: Provider> {
    // Field order is drop order: connections (QPs) before the SRQ, the slots they use, the
    // CQ, PD and device.
    conns: Vec<Option<ServerConn<P>>>,
    /// The shard's shared receive queue: every connection's QP receives from it.
    srq: P::Srq,
    /// The receive slots posted to `srq`, and what user code keeps of them.
    pool: Arc<RecvPool<P>>,
    /// Who may use how many of the pool's slots.
    grants: grants::Grants,
    /// Free slots of the pool, unposted: the most recently used on top (see `post_excess`).
    stash: Vec<u32>,
    /// The send slots of every connection of the shard.
    sends: Arc<SlotArena<P>>,
    /// The connection of each primary QP (receive completions of the SRQ name the QP).
    qp_conn: QpMap,
    /// Where the pool's figures are published ([`crate::RunningServer::receive_pool`]).
    gauge: Arc<grants::Gauge>,
    /// Indices of the live connections (what the sweep of `maintain` walks, a slice at a
    /// time).
    live: Vec<u16>,
    /// Connections with work since the last sweep (a completion, a handler that ran, a bulk
    /// operation, a window grant, a new connection, the sweep's slice): what a turn flushes
    /// and maintains, so that its cost follows the connections that are busy, not all that
    /// are open.
    touched: Vec<u16>,
    is_touched: Vec<bool>,
    /// When `maintain` last swept a slice of the connections, where the next slice starts in
    /// `live`, the earliest protocol deadline the pass in progress found, and the one the
    /// last whole pass found (`next_deadline`).
    swept_at: Instant,
    sweep_cursor: usize,
    /// Entries of `conns` that closed connections left empty, reused by the next ones.
    free_conns: Vec<u16>,
    pass_deadline: Option<u64>,
    swept_deadline: Option<u64>,
    generations: Vec<u8>,
    tasks: Tasks,
    task_owner: Vec<(u16, CallId)>,
    /// The first CQ: the SRQ's receives and the send completions of the first connections.
    cq: P::Cq,
    /// CQs for the send completions of further connections, once `cq` reached `cq_limit`
    /// (see `create_qp_with`); all on `channel`.
    more_cqs: Vec<P::Cq>,
    /// The most entries one CQ may have: the device's `max_cqe`, or
    /// [`crate::ServerBuilder::max_cq_entries`].
    cq_limit: u32,
    channel: P::CompChannel,
    bulk: Arc<BulkPool<P>>,
    pd: Arc<P::Pd>,
    ctx: P::Context,
    id: u16,
    nshards: u16,
    cfg: Arc<ServerConfig>,
    router: Arc<Router>,
    inbox: Arc<SegQueue<ShardMsg>>,
    doorbell: Arc<Doorbell>,
    stop: Arc<AtomicBool>,
    linger: Arc<AtomicBool>,
    live_calls: Arc<AtomicUsize>,
    open_conns: Arc<AtomicUsize>,
    zero_copy_bytes: Arc<AtomicU64>,
    striped_bytes: Arc<AtomicU64>,
    stats: Option<Arc<Table>>,
    /// QPs per connection at most.
    max_qps: u32,
    epoch: Instant,
    /// When the device's asynchronous events are read next (`async_events`).
    events_due: Instant,
    max_inline: u32,
    wcs: [Wc; POLL_BATCH],
    peer_api: Arc<PeerApi>,
    bulk_ops: slab::Slab<InflightOp>,
}

impl<P: Provider> ServerConn<P> {
    fn slot(&mut self, call: CallId) -> Option<&mut SrvCall<P>> {
        self.calls.live(call)
    }

    /// Counts a stream message of `call` in the statistics.
    fn stat_message(&mut self, call: CallId, bytes: usize, rendezvous: bool) {
        let Some(table) = self.stats.as_deref() else {
            return;
        };
        if let Some(desc) = self.calls.live(call).and_then(|c| c.stat)
            && let Some(cell) = table.cell(desc)
        {
            cell.response(bytes, rendezvous);
        }
    }

    /// Counts every call still counted as ended with `code` (the connection closes).
    fn stat_end_all(&mut self, code: Code) {
        if self.stats.is_none() {
            return;
        }
        let ids: Vec<CallId> = self
            .calls
            .iter_mut()
            .filter(|c| c.stat.is_some())
            .map(|c| c.id)
            .collect();
        for call in ids {
            self.stat_end(call, code, None);
        }
    }

    /// Counts the end of `call` in the statistics (once: later ends of it are not counted),
    /// with its response of `resp` bytes, by rendezvous or not.
    fn stat_end(&mut self, call: CallId, code: Code, resp: Option<(usize, bool)>) {
        let Some(table) = self.stats.as_deref() else {
            return;
        };
        let now = crate::link::now_ns();
        let Some(c) = self.calls.live(call) else {
            return;
        };
        let Some(desc) = c.stat.take() else { return };
        if let Some(cell) = table.cell(desc) {
            if let Some((bytes, rendezvous)) = resp {
                cell.response(bytes, rendezvous);
            }
            cell.finish(code, now.saturating_sub(c.stat_start));
        }
    }
}
