//! A server shard: one thread (pinned to a core when asked), one CQ, the QPs of the connections
//! assigned to it, their slots, and a task slab of in-flight handler futures.
//!
//! The poll loop: take new connections and disconnects from the inbox (lock-free), poll the CQ in
//! batches and handle each completion (dispatching requests to handlers, which run inline until
//! they wait), poll woken handler tasks, repost receive slots and return credits, expire
//! deadlines; when idle, spin, then yield, then sleep on the completion channel and the shard's
//! doorbell. Per call: no lock, no allocation, no system call.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use tracing::{debug, info, warn};

use crate::buf::Polled;
use crate::buf::encode::MAX_PIECES;
use crate::buf::{
    BulkBuf, BulkPool, EncodeMsg, Gather, Geometry, NoMsg, Piece, RawBytes, SlotArena, TaskId,
};
use crate::call::{self, Calls, Held, Ledger, Record, StreamIn, lend_read};
use crate::connect::{Hello, Welcome};
use crate::link::{
    CommitError, Control, FrameError, Lanes, Link, LinkError, LinkKey, Received, Staged, WrKind,
    completion, decode_metadata, lane_caps, split_wr_id,
};
use crate::server::call::{CallCtx, IncomingCall, Payload, Tasks, panicked};
use crate::server::notify::{Doorbell, ShardNotify, wait_readable};
use crate::server::peer::{BulkMem, BulkOp, OpKind, Peer, PeerApi, ShardInbox};
use crate::server::router::Router;
use crate::server::{PollMode, ServerConfig};
use crate::streaming::{Inbox, Item};
use crate::verbs::{
    Access, CompChannel, ConnectAttr, Context, Cq, Pd, Provider, Qp, QpCaps, Sge, Wc, WcStatus,
};
use crate::wire::{self, BulkDesc, BulkMore, CallId, Event, MAX_HEADER_LEN, Role, Transfer};
use crate::{Metadata, Status};

/// Completions taken per `poll`.
const POLL_BATCH: usize = 32;
/// Empty loop iterations spent spinning before yielding (adaptive mode).
const SPIN_ITERS: u32 = 20_000;
/// Empty loop iterations spent yielding before sleeping (adaptive mode).
const YIELD_ITERS: u32 = 200;
/// Idle iterations between two passes over the connections (reposts, credits, deadlines,
/// inbox) when nothing happens; after any work the pass runs at once.
const MAINTAIN_EVERY: u32 = 64;
/// Longest sleep, so shutdown and deadlines are noticed.
const MAX_SLEEP: Duration = Duration::from_millis(50);

/// A message to a shard from the acceptor.
pub(crate) enum ShardMsg {
    /// A client that passed the handshake checks: create its QP and answer.
    Connect {
        hello: Hello,
        peer: std::net::SocketAddr,
        reply: tokio::sync::oneshot::Sender<Result<(Welcome, LinkKey), String>>,
        /// Dropped by the shard when it closes the connection: the acceptor then closes TCP.
        closed: tokio::sync::oneshot::Sender<()>,
    },
    /// The client's TCP connection ended: drop its calls and QP.
    Disconnect(LinkKey),
}

/// What the acceptor and the server handle see of a shard.
pub(crate) struct ShardHandle {
    pub(crate) inbox: Arc<SegQueue<ShardMsg>>,
    pub(crate) doorbell: Arc<Doorbell>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) live_calls: Arc<AtomicUsize>,
    /// Response bytes sent straight from the request's buffer (see `respond_landing`).
    pub(crate) zero_copy_bytes: Arc<AtomicU64>,
    /// Bytes of one-sided transfers striped over several QPs (see `link::Lanes`).
    pub(crate) striped_bytes: Arc<AtomicU64>,
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

/// Response `bytes` fields at least this large that lie in the request's buffer are sent from
/// there instead of being copied (an echo, a slice of the request).
const ZERO_COPY_MIN: usize = 16 << 10;

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
        }
    }
}

impl<P: Provider> SrvCall<P> {
    /// Whether a READ posted for this slot is still in flight (its target is the NIC's).
    fn reads_in_flight(&self) -> bool {
        self.reading.is_some() || self.stream.reading()
    }

    /// Moves the targets of the slot's READs in flight into `link`'s graveyard (freed only
    /// after the link's QPs are destroyed): for a slot reused while they are posted. Their
    /// completions then find nothing to fill.
    fn park_reads(&mut self, link: &mut Link<P>) {
        if let Some(p) = self.reading.take() {
            self.stale_reads = self.stale_reads.saturating_add(u16::from(p.reads_left));
            link.park(p.buf);
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
    method: u32,
    metadata: Metadata,
    deadline_at: Option<u64>,
}

/// A staged terminal frame waiting for a credit.
#[derive(Clone, Copy, Debug)]
enum Deferred {
    Response {
        call: CallId,
        staged: Staged,
        bulk: Option<BulkDesc>,
    },
    Status {
        call: CallId,
        staged: Staged,
        code: u8,
    },
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
    _closed: tokio::sync::oneshot::Sender<()>,
    peer: std::net::SocketAddr,
    /// The largest request accepted and response sent (the server's `max_message`).
    max_message: u64,
    /// The QP takes gather lists long enough for a zero-copy response.
    gather: bool,
    zero_copy_bytes: Arc<AtomicU64>,
}

/// The shard.
pub(crate) struct Shard<P: Provider> {
    // Field order is drop order: connections (QPs, arenas) before the CQ, PD and device.
    conns: Vec<Option<ServerConn<P>>>,
    /// Indices of the live connections (what `maintain` walks).
    live: Vec<u16>,
    generations: Vec<u8>,
    tasks: Tasks,
    task_owner: Vec<(u16, CallId)>,
    cq: P::Cq,
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
    live_calls: Arc<AtomicUsize>,
    zero_copy_bytes: Arc<AtomicU64>,
    striped_bytes: Arc<AtomicU64>,
    /// QPs per connection at most.
    max_qps: u32,
    epoch: Instant,
    max_inline: u32,
    wcs: [Wc; POLL_BATCH],
    peer_api: Arc<PeerApi>,
    bulk_ops: slab::Slab<InflightOp>,
}

/// Opens the shard's device objects on the calling thread and returns the shard, ready to run.
pub(crate) fn open<P: Provider>(
    ctx: P::Context,
    id: u16,
    nshards: u16,
    cfg: Arc<ServerConfig>,
    router: Arc<Router>,
    epoch: Instant,
) -> Result<(Shard<P>, ShardHandle), crate::Error> {
    let pd = Arc::new(ctx.alloc_pd()?);
    let channel = ctx.create_comp_channel()?;
    // CQ room for `max_conns_per_shard` connections of default size; a connection that does
    // not fit any more is refused (the soft and ib providers both refuse a QP whose CQ could
    // overrun).
    let default_client_calls = 64;
    let send_slots = cfg
        .geometry
        .send_slots
        .max(default_client_calls + cfg.geometry.recv_slots + 2);
    let per_conn = qp_caps(&cfg, ctx.caps(), send_slots, default_client_calls);
    let max_qps = match cfg.qps_per_connection {
        Some(n) => n,
        None => P::qps_per_connection()?,
    };
    let lanes = lane_caps(&per_conn, ctx.caps());
    let cqe = (per_conn.max_send_wr + per_conn.max_recv_wr)
        .saturating_add((max_qps - 1).saturating_mul(lanes.max_send_wr + lanes.max_recv_wr))
        .saturating_mul(cfg.max_conns_per_shard)
        .min(ctx.caps().max_cqe);
    let cq = ctx.create_cq(cqe, Some(&channel))?;
    let doorbell = Doorbell::new()?;
    let tasks = Tasks::new(cfg.tasks_per_shard, ShardNotify(Arc::clone(&doorbell)));
    let inbox = Arc::new(SegQueue::new());
    let stop = Arc::new(AtomicBool::new(false));
    let live_calls = Arc::new(AtomicUsize::new(0));
    let zero_copy_bytes = Arc::new(AtomicU64::new(0));
    let striped_bytes = Arc::new(AtomicU64::new(0));
    let bulk = BulkPool::new(Arc::clone(&pd), cfg.bulk_cache_bytes);
    let peer_api = PeerApi::new(Arc::clone(&doorbell), Arc::clone(&bulk));
    let n = cfg.max_conns_per_shard as usize;
    let max_inline = per_conn.max_inline_data;
    info!(
        shard = id,
        "shard {id}/{nshards}: {} device {} (port {}, {:?}), CQ depth {cqe}",
        P::TAG,
        ctx.info().name,
        ctx.info().port,
        ctx.info().link_layer
    );
    let handle = ShardHandle {
        inbox: Arc::clone(&inbox),
        doorbell: Arc::clone(&doorbell),
        stop: Arc::clone(&stop),
        live_calls: Arc::clone(&live_calls),
        zero_copy_bytes: Arc::clone(&zero_copy_bytes),
        striped_bytes: Arc::clone(&striped_bytes),
        thread: std::sync::Mutex::new(None),
    };
    let shard = Shard {
        conns: (0..n).map(|_| None).collect(),
        live: Vec::with_capacity(n),
        generations: vec![0; n],
        task_owner: vec![(0, CallId(0)); cfg.tasks_per_shard as usize],
        tasks,
        cq,
        channel,
        bulk,
        pd,
        ctx,
        id,
        nshards,
        cfg,
        router,
        inbox,
        doorbell,
        stop,
        live_calls,
        zero_copy_bytes,
        striped_bytes,
        max_qps,
        epoch,
        max_inline,
        wcs: [Wc::default(); POLL_BATCH],
        peer_api,
        bulk_ops: slab::Slab::new(),
    };
    Ok((shard, handle))
}

/// Queue sizes of a connection with `send_slots` send slots whose client has `peer_calls`
/// calls: every send slot in flight, plus a READ (rendezvous request, stream message) and a
/// WRITE (landing zone, bulk handle) per call, plus control frames; within the device's limit.
fn qp_caps(
    cfg: &ServerConfig,
    caps: &crate::verbs::Caps,
    send_slots: u32,
    peer_calls: u32,
) -> QpCaps {
    QpCaps {
        max_send_wr: send_slots
            .saturating_add(peer_calls.saturating_mul(2))
            .saturating_add(16)
            .min(caps.max_qp_wr),
        max_recv_wr: cfg.geometry.recv_slots,
        max_send_sge: (MAX_PIECES as u32).min(caps.max_sge),
        max_recv_sge: 1,
        max_inline_data: caps.max_inline.min(256),
    }
}

/// The shard's view of one call, lent to `IncomingCall` and to the call's task.
struct Reply<'a, P: Provider> {
    conn: &'a mut ServerConn<P>,
    call: CallId,
    api: &'a Arc<PeerApi>,
}

impl<P: Provider> CallCtx for Reply<'_, P> {
    fn respond(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata) {
        self.conn.respond(self.call, msg, metadata);
    }

    fn fail(&mut self, status: &Status) {
        self.conn.fail(self.call, status);
    }

    fn peer(&self) -> Option<Peer> {
        Some(Peer::new(Arc::clone(self.api), self.conn.link.key()))
    }

    fn stream_ready(&mut self) -> bool {
        let link = &self.conn.link;
        let ok = link.wire.send_window(self.call).is_some_and(|w| w > 0)
            && link.wire.data_credits() > 0
            && link.arena.free_sends() > 0
            && self.conn.deferred.is_empty();
        if !ok
            && let Some(c) = self.conn.slot(self.call)
            && !c.blocked
        {
            c.blocked = true;
            self.conn.blocked.push(self.call);
        }
        ok
    }

    fn send_stream(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata) -> Result<(), Status> {
        self.conn.send_stream(self.call, msg, metadata)
    }

    fn finish_ok(&mut self, trailers: &Metadata) {
        let mut ok = Status::new(crate::Code::Ok, "");
        if !trailers.is_empty() {
            *ok.metadata_mut() = trailers.clone();
        }
        self.conn.fail(self.call, &ok);
    }
}

/// A handler's bulk operation in flight.
struct InflightOp {
    key: LinkKey,
    local: Box<dyn BulkMem>,
    kind: OpKind,
    done: tokio::sync::oneshot::Sender<Result<Box<dyn BulkMem>, Status>>,
}

impl<P: Provider> ServerConn<P> {
    fn slot(&mut self, call: CallId) -> Option<&mut SrvCall<P>> {
        self.calls.live(call)
    }

    /// Sends the unary response of `call` by the cheapest path that fits.
    fn respond(&mut self, call: CallId, msg: &dyn EncodeMsg, metadata: &Metadata) {
        // The request's buffer is released here unless the response is sent from it.
        let source = self.slot(call).and_then(|c| c.req_buf.take());
        let len = msg.encoded_len();
        let md_len = metadata.encoded_len();
        if len as u64 > self.max_message {
            return self.fail(
                call,
                &Status::resource_exhausted(format!(
                    "response of {len} bytes exceeds the {} byte message limit",
                    self.max_message
                )),
            );
        }
        let landing = self.slot(call).and_then(|c| c.landing);
        match self
            .link
            .wire
            .plan(len as u64, md_len, landing.map(|l| l.len))
        {
            Transfer::Eager => match self.link.stage(metadata, msg) {
                Ok(st) => self.commit_terminal(Deferred::Response {
                    call,
                    staged: st,
                    bulk: None,
                }),
                Err(e) => self.frame_failed(call, e),
            },
            Transfer::Landing => {
                if let Some(zone) = landing
                    && self.respond_landing(call, msg, metadata, zone, source)
                {
                    return;
                }
                self.respond_rendezvous(call, msg, metadata);
            }
            Transfer::Rendezvous => self.respond_rendezvous(call, msg, metadata),
            Transfer::TooLarge => self.fail(
                call,
                &Status::resource_exhausted(format!(
                    "response of {len} bytes exceeds the {} byte message limit",
                    self.max_message
                )),
            ),
        }
    }

    /// Writes the whole Response frame into the client's landing zone with WRITE_WITH_IMM.
    /// Returns false (nothing sent) when there is no credit or buffer now.
    ///
    /// Zero copy: `bytes` fields of the response that lie in `source` (the buffer the request
    /// was READ into, which the request's `bytes` fields share) are not encoded into the
    /// staging buffer: the WRITE's gather list sends them from where they are, and the call
    /// keeps `source` until the WRITE completes.
    fn respond_landing(
        &mut self,
        call: CallId,
        msg: &dyn EncodeMsg,
        metadata: &Metadata,
        zone: BulkDesc,
        source: Option<Arc<BulkBuf<P>>>,
    ) -> bool {
        let md_len = metadata.encoded_len();
        let len = msg.encoded_len();
        let body = MAX_HEADER_LEN + md_len;
        let Ok(mut buf) = self.link.bulk.get(body + len) else {
            return false;
        };
        let source = source.filter(|_| self.gather);
        let mut pieces = [Piece::Staged { offset: 0, len: 0 }; MAX_PIECES];
        let (npieces, referenced) = {
            let b = buf.as_mut_slice();
            metadata.encode(&mut b[MAX_HEADER_LEN..body]);
            let region = source.as_deref().map_or(&[][..], BulkBuf::as_slice);
            let mut g = Gather::new(&mut b[body..], region, ZERO_COPY_MIN);
            if msg.encode_gather(&mut g).is_none() || g.len() != len {
                return false;
            }
            pieces[..g.pieces().len()].copy_from_slice(g.pieces());
            (g.pieces().len(), g.referenced())
        };
        let header = match self.link.wire.response(call, len, md_len, None, true) {
            Ok(h) => h,
            Err(_) => return false,
        };
        let hlen = header.encoded_len();
        let start = MAX_HEADER_LEN - hlen;
        if header
            .encode(&mut buf.as_mut_slice()[start..MAX_HEADER_LEN])
            .is_err()
        {
            return false;
        }
        // The gather list: header and metadata, then the pieces; staged pieces that follow
        // each other in the staging buffer merge into one SGE.
        let mut sges = [Sge::default(); MAX_PIECES];
        let mut n = 0;
        let mut push = |sge: Option<Sge>| -> bool {
            let Some(sge) = sge else { return false };
            if n > 0
                && sges[n - 1].lkey == sge.lkey
                && sges[n - 1].addr + u64::from(sges[n - 1].length) == sge.addr
            {
                sges[n - 1].length += sge.length;
                return true;
            }
            if n == MAX_PIECES {
                return false;
            }
            sges[n] = sge;
            n += 1;
            true
        };
        let mut ok = push(buf.sge(start, (body - start) as u32));
        for p in &pieces[..npieces] {
            ok &= match (*p, source.as_deref()) {
                (Piece::Staged { offset, len }, _) => push(buf.sge(body + offset, len as u32)),
                (Piece::Region { offset, len }, Some(src)) => push(src.sge(offset, len as u32)),
                (Piece::Region { .. }, None) => false,
            };
        }
        if !ok {
            return false;
        }
        // Counted before posting: the client may have the response before this thread runs
        // again (a failed post closes the connection anyway).
        if referenced > 0 {
            self.zero_copy_bytes
                .fetch_add(referenced as u64, Ordering::Relaxed);
        }
        // SAFETY: `buf` and `source` are kept in the slot's `writing` until the WRITE's
        // successful completion is polled (or, the connection failed or closed, in the link's
        // graveyard until the QPs are destroyed), and nothing writes them meanwhile (`source`
        // is shared only with the request's immutable `bytes`).
        let r = unsafe {
            self.link
                .post_write_imm_gather(call.slot(), &sges[..n], zone, call.0)
        };
        let hold = RespHold {
            _buf: buf,
            _source: source.filter(|_| referenced > 0),
        };
        match r {
            Ok(()) => {
                // Into the slot's queue whatever call the slot holds now: its completion pops
                // that queue, in order.
                match self.calls.get_mut(call.slot() as usize) {
                    Some(c) => {
                        c.writing.push_back(hold);
                        if c.id == call {
                            c.lent = false;
                        }
                    }
                    None => self.link.park(hold),
                }
                self.link.wire.finish(call);
                true
            }
            Err(e) => {
                // Part of the WRITE may be posted (the link then failed its QPs).
                warn!("landing write failed: {e}");
                self.link.park(hold);
                true
            }
        }
    }

    /// Puts the response in a bulk buffer and sends its descriptor for the client to READ.
    fn respond_rendezvous(&mut self, call: CallId, msg: &dyn EncodeMsg, metadata: &Metadata) {
        let len = msg.encoded_len();
        let mut buf = match self.link.bulk.get(len) {
            Ok(b) => b,
            Err(e) => {
                return self.fail(
                    call,
                    &Status::resource_exhausted(format!("bulk buffer: {e}")),
                );
            }
        };
        if msg.encode_into(buf.as_mut_slice()).is_none() {
            return self.fail(call, &Status::internal("response encoding failed"));
        }
        // Lent to this connection's client only, for reading, until its BulkRelease.
        let desc = match lend_read(&mut buf, &self.link.qp) {
            Ok(d) => d,
            Err(e) => {
                return self.fail(
                    call,
                    &Status::resource_exhausted(format!("cannot lend the response: {e}")),
                );
            }
        };
        match self.link.stage(metadata, &NoMsg) {
            Ok(st) => {
                if let Some(c) = self.slot(call) {
                    c.resp_bulk = Some(RespHold::new(buf));
                }
                self.commit_terminal(Deferred::Response {
                    call,
                    staged: st,
                    bulk: Some(desc),
                });
            }
            Err(e) => self.frame_failed(call, e),
        }
    }

    /// Sends one message of the handler's stream (the caller checked `stream_ready`).
    fn send_stream(
        &mut self,
        call: CallId,
        msg: &dyn EncodeMsg,
        metadata: &Metadata,
    ) -> Result<(), Status> {
        let len = msg.encoded_len();
        let md_len = metadata.encoded_len();
        let refused = |e: CommitError| match e {
            CommitError::Refused(wire::SendError::Gone) => Status::cancelled("the call ended"),
            e => Status::internal(format!("stream message: {e:?}")),
        };
        match self.link.wire.plan(len as u64, md_len, None) {
            Transfer::Eager | Transfer::Landing => {
                let st = self
                    .link
                    .stage(metadata, msg)
                    .map_err(|e| Status::internal(format!("stream message: {e:?}")))?;
                self.link
                    .commit(st, |w, pl, ml| w.stream_message(call, pl, ml, None))
                    .map_err(refused)
            }
            Transfer::Rendezvous => {
                let mut buf = self
                    .link
                    .bulk
                    .get(len)
                    .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
                if msg.encode_into(buf.as_mut_slice()).is_none() {
                    return Err(Status::internal("stream message encoding failed"));
                }
                let desc = lend_read(&mut buf, &self.link.qp)
                    .map_err(|e| Status::resource_exhausted(format!("cannot lend: {e}")))?;
                let st = self
                    .link
                    .stage(metadata, &NoMsg)
                    .map_err(|e| Status::internal(format!("stream message: {e:?}")))?;
                self.link
                    .commit(st, |w, _, ml| w.stream_message(call, 0, ml, Some(desc)))
                    .map_err(refused)?;
                if let Some(c) = self.slot(call) {
                    c.stream_bulks.lend(buf);
                }
                Ok(())
            }
            Transfer::TooLarge => Err(Status::resource_exhausted(format!(
                "stream message of {len} bytes exceeds the {} byte message limit",
                self.link.wire.config().max_message
            ))),
        }
    }

    /// Delivers a client stream frame to the call's inbox, in order behind a READ in flight.
    fn stream_in(&mut self, call: CallId, held: Held) -> Result<(), LinkError> {
        let Some(c) = self.calls.live(call) else {
            return Ok(());
        };
        c.stream
            .stream_in(&mut self.link, c.inbox.as_deref(), call, held, "client")
    }

    /// A client stream message finished its READ: deliver it, release the client's buffer, and
    /// deliver what waited behind it.
    fn stream_read_done(&mut self, call: CallId) -> Result<(), LinkError> {
        let Some(c) = self.calls.live(call) else {
            return Ok(());
        };
        let idle = c
            .stream
            .read_done(&mut self.link, c.inbox.as_deref(), call, "client")?;
        // Every READ of the call done: an end that waited for it is finished now.
        if idle && c.drop_after_read && c.reading.is_none() {
            c.drop_after_read = false;
            self.end_call(call);
        }
        Ok(())
    }

    fn fail(&mut self, call: CallId, status: &Status) {
        let msg = status.message().as_bytes();
        let msg = &msg[..msg.len().min(1024)];
        match self.link.stage(status.metadata(), &RawBytes(msg)) {
            Ok(st) => self.commit_terminal(Deferred::Status {
                call,
                staged: st,
                code: status.code() as u8,
            }),
            Err(FrameError::TooLarge) => self.fail_without_trailers(call, status),
            Err(e) => self.frame_failed(call, e),
        }
    }

    /// Ends the call with RESOURCE_EXHAUSTED when its status does not fit a frame (trailers
    /// larger than the connection's slots): the caller learns the original code and message.
    fn fail_without_trailers(&mut self, call: CallId, status: &Status) {
        let room = (self.link.wire.config().eager_limit as usize).saturating_sub(MAX_HEADER_LEN);
        let why = format!(
            "status {} with {} bytes of trailing metadata does not fit a {} byte frame: {}",
            status.code().name(),
            status.metadata().encoded_len(),
            self.link.wire.config().eager_limit,
            status.message()
        );
        let mut end = why.len().min(room).min(1024);
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        match self
            .link
            .stage(&Metadata::new(), &RawBytes(&why.as_bytes()[..end]))
        {
            Ok(st) => self.commit_terminal(Deferred::Status {
                call,
                staged: st,
                code: crate::Code::ResourceExhausted as u8,
            }),
            Err(e) => self.frame_failed(call, e),
        }
    }

    fn frame_failed(&mut self, call: CallId, e: FrameError) {
        // Send slots are sized so a terminal frame always finds one; failing here means the
        // metadata did not fit or the link broke.
        warn!(%call, "cannot send the terminal frame: {e:?}");
        self.end_call(call);
    }

    /// Commits a staged terminal frame now, or queues it until a credit arrives.
    fn commit_terminal(&mut self, d: Deferred) {
        if !self.deferred.is_empty() {
            self.deferred.push_back(d);
            return;
        }
        if let Some(d) = self.try_commit(d) {
            self.deferred.push_back(d);
        }
    }

    /// Returns the frame back when there is no credit.
    fn try_commit(&mut self, d: Deferred) -> Option<Deferred> {
        let r = match d {
            Deferred::Response { call, staged, bulk } => self
                .link
                .commit(staged, |w, pl, ml| w.response(call, pl, ml, bulk, false)),
            Deferred::Status { call, staged, code } => self
                .link
                .commit(staged, |w, pl, ml| w.status(call, code, pl, ml)),
        };
        let call = match d {
            Deferred::Response { call, .. } | Deferred::Status { call, .. } => call,
        };
        match r {
            Ok(()) => {
                let keep_bulk = matches!(d, Deferred::Response { bulk: Some(_), .. });
                if let Some(c) = self.slot(call) {
                    c.task = None;
                    c.lent = false;
                    c.req_buf = None;
                    if !keep_bulk {
                        c.resp_bulk = None;
                    }
                }
                self.link.wire.finish(call);
                None
            }
            Err(CommitError::NoCredit(staged)) => Some(match d {
                Deferred::Response { call, bulk, .. } => Deferred::Response { call, staged, bulk },
                Deferred::Status { call, code, .. } => Deferred::Status { call, staged, code },
            }),
            Err(CommitError::Refused(e)) => {
                debug!(%call, "terminal frame refused: {e}");
                self.end_call(call);
                None
            }
            Err(CommitError::Link(e)) => {
                warn!(%call, "terminal frame failed: {e}");
                None
            }
        }
    }

    fn flush_deferred(&mut self) {
        while let Some(d) = self.deferred.pop_front() {
            if let Some(back) = self.try_commit(d) {
                self.deferred.push_front(back);
                break;
            }
        }
    }

    /// Forgets a call without a terminal frame (cancelled, expired, replaced).
    fn end_call(&mut self, call: CallId) {
        let mut release = false;
        if let Some(c) = self.slot(call) {
            c.task = None;
            c.landing = None;
            if let Some(inbox) = c.inbox.take() {
                inbox.finish(Some(Status::cancelled("the call was cancelled")));
            }
            // The client's memory of a READ in flight stays lent until the READ completed:
            // a BulkRelease now would let the client revoke it under the READ (and the
            // client pairs releases with its lent buffers in order). The end is finished when
            // the READ completes.
            if c.reads_in_flight() {
                c.drop_after_read = true;
                return;
            }
            release = c.lent;
            c.lent = false;
            c.resp_bulk = None;
            c.req_buf = None;
        }
        if release && let Err(e) = self.link.control(Control::BulkRelease(call)) {
            warn!(%call, "returning the client's buffer: {e}");
        }
        self.link.wire.finish(call);
    }
}

impl<P: Provider> Shard<P> {
    /// Runs the poll loop until the server stops and every call has finished.
    pub(crate) fn run(mut self, rt: tokio::runtime::Handle) {
        let _enter = rt.enter();
        if let Some(core) = self.cfg.core_of(self.id) {
            pin_to_core(core);
        }
        let mut idle: u32 = 0;
        let mut stop_at: Option<Instant> = None;
        loop {
            let mut work = self.poll_cq();
            work += self.run_ready();
            if work > 0 {
                // The responses of this turn go out together: one post per connection.
                self.flush_sends();
            }
            // Stopping: check every pass, or a sleeping shard notices only every
            // MAINTAIN_EVERY sleeps (up to 64 x MAX_SLEEP) that its last call is gone.
            if work > 0 || idle.is_multiple_of(MAINTAIN_EVERY) || self.stop.load(Ordering::Relaxed)
            {
                let idle_turn = work == 0;
                work += self.drain_inbox();
                work += self.start_bulk_ops();
                work += self.maintain(idle_turn);
                self.flush_sends();
                if self.stop.load(Ordering::Acquire) {
                    // Draining: stop once every call finished, or when the grace period is up
                    // (the handlers still running are then dropped with their connections).
                    let deadline =
                        *stop_at.get_or_insert_with(|| Instant::now() + self.cfg.shutdown_grace);
                    let live = self.live_calls.load(Ordering::Acquire);
                    if live == 0 {
                        break;
                    }
                    if Instant::now() >= deadline {
                        warn!(
                            shard = self.id,
                            "shutdown grace period over: dropping {live} call(s) still running"
                        );
                        break;
                    }
                }
            }
            if work > 0 {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            match self.cfg.poll_mode {
                PollMode::Busy => std::hint::spin_loop(),
                PollMode::Adaptive if idle < SPIN_ITERS => std::hint::spin_loop(),
                PollMode::Adaptive if idle < SPIN_ITERS + YIELD_ITERS => std::thread::yield_now(),
                _ => self.sleep(),
            }
        }
        // Close what is left (calls past the grace period, bulk operations and READs in
        // flight): each connection's QPs are destroyed before anything they may touch is
        // released (see `close`).
        let why = Status::unavailable("the server shut down");
        for idx in std::mem::take(&mut self.live) {
            if let Some(Some(conn)) = self.conns.get(idx as usize) {
                let key = conn.link.key();
                self.close(key, &why);
            }
        }
        info!(
            shard = self.id,
            "shard {}/{} stopped", self.id, self.nshards
        );
    }

    fn sleep(&mut self) {
        self.doorbell.prepare_sleep();
        let _ = self.cq.req_notify(false);
        // Anything that arrived before the doorbell flag was visible is seen by this re-check.
        if !self.inbox.is_empty()
            || !self.peer_api.ops.is_empty()
            || !self.peer_api.grants.is_empty()
            || self.poll_cq() > 0
            || self.run_ready() > 0
        {
            self.flush_sends();
            self.doorbell.awake();
            return;
        }
        let timeout = self.next_deadline().map_or(MAX_SLEEP, |d| d.min(MAX_SLEEP));
        wait_readable(&[self.doorbell.fd(), self.channel.fd()], timeout);
        let _ = self.channel.drain();
        self.doorbell.awake();
    }

    fn next_deadline(&self) -> Option<Duration> {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.conns
            .iter()
            .flatten()
            .filter_map(|c| c.link.wire.poll_timeout())
            .min()
            .map(|d| Duration::from_nanos(d.saturating_sub(now)))
    }

    fn drain_inbox(&mut self) -> usize {
        let mut n = 0;
        while let Some(msg) = self.inbox.pop() {
            n += 1;
            match msg {
                ShardMsg::Connect {
                    hello,
                    peer,
                    reply,
                    closed,
                } => {
                    let r = self.connect(hello, peer, closed);
                    let _ = reply.send(r);
                }
                ShardMsg::Disconnect(key) => {
                    self.close(key, &Status::unavailable("client disconnected"));
                }
            }
        }
        n
    }

    fn connect(
        &mut self,
        hello: Hello,
        peer: std::net::SocketAddr,
        closed: tokio::sync::oneshot::Sender<()>,
    ) -> Result<(Welcome, LinkKey), String> {
        let Some(idx) = self.conns.iter().position(Option::is_none) else {
            return Err(format!(
                "server shard {} is full ({} connections)",
                self.id, self.cfg.max_conns_per_shard
            ));
        };
        let cfg = &self.cfg;
        // Every call of the client's table may hold a staged terminal frame in a send slot while
        // it waits for a credit, besides the frames in flight (at most the client's receive
        // ring): with fewer send slots a terminal frame would find none and its call would
        // never be answered.
        let need = hello
            .max_calls
            .saturating_add(hello.geometry.recv_slots)
            .saturating_add(2)
            .min(Geometry::MAX_SLOTS);
        let geometry = Geometry {
            send_slots: cfg.geometry.send_slots.max(need),
            ..cfg.geometry
        };
        let caps = qp_caps(cfg, self.ctx.caps(), geometry.send_slots, hello.max_calls);
        let mut qp = self
            .pd
            .create_qp(&self.cq, &self.cq, caps)
            .map_err(|e| format!("create QP: {e}"))?;
        let attr = ConnectAttr {
            access: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            ..ConnectAttr::default()
        };
        qp.connect(&hello.endpoint, &attr)
            .map_err(|e| format!("connect QP: {e}"))?;
        // Data QPs: as many as both sides allow, connected to the client's first ones.
        let nlanes = (self.max_qps as usize - 1).min(hello.data_endpoints.len());
        let lcaps = lane_caps(&caps, self.ctx.caps());
        let mut lanes = Vec::with_capacity(nlanes);
        for ep in &hello.data_endpoints[..nlanes] {
            let mut q = self
                .pd
                .create_qp(&self.cq, &self.cq, lcaps)
                .map_err(|e| format!("create data QP: {e}"))?;
            q.connect(ep, &attr)
                .map_err(|e| format!("connect data QP: {e}"))?;
            lanes.push(q);
        }
        let data_endpoints: Vec<_> = lanes.iter().map(Qp::endpoint).collect();
        let arena = SlotArena::<P>::new(&self.pd, geometry).map_err(|e| format!("slots: {e}"))?;
        let wcfg = wire::Config {
            max_calls: hello.max_calls,
            peer_max_calls: hello.max_calls,
            initial_send_credits: hello.geometry.recv_slots,
            recv_depth: cfg.geometry.recv_slots,
            reserved_credits: 2,
            credit_update_threshold: (cfg.geometry.recv_slots / 4).max(2),
            eager_limit: cfg.geometry.slot_size.min(hello.geometry.slot_size),
            // Clients do not know our limit: a request above it fails its call with
            // RESOURCE_EXHAUSTED (`start_read`), it does not close the connection.
            max_message: u64::MAX,
            stream_window: 16,
        };
        let wire = wire::Conn::new(Role::Server, wcfg).map_err(|e| format!("protocol: {e}"))?;
        self.generations[idx] = self.generations[idx].wrapping_add(1);
        let key = LinkKey {
            idx: idx as u16,
            generation: self.generations[idx],
        };
        let link = Link::new(
            qp,
            arena,
            wire,
            Arc::clone(&self.bulk),
            key,
            self.max_inline,
            self.epoch,
        )
        .map_err(|e| format!("post receives: {e}"))?;
        let mut link = link;
        link.set_lanes(Lanes::new(
            lanes,
            lcaps.max_send_wr,
            Some(Arc::clone(&self.striped_bytes)),
        ));
        let welcome = Welcome {
            endpoint: link.qp.endpoint(),
            geometry: cfg.geometry,
            max_calls: hello.max_calls,
            shard: self.id,
            shards: self.nshards,
            data_endpoints,
        };
        info!(
            "accepted {peer} via {}/RC on shard {}/{}: QP {:#x} <-> {:#x} in RTS{}",
            P::TAG,
            self.id,
            self.nshards,
            link.qp.qp_num(),
            hello.endpoint.qp_num,
            if link.lanes().is_empty() {
                String::new()
            } else {
                format!(", {} QPs per connection", link.lanes().len() + 1)
            }
        );
        let calls = Calls::new(hello.max_calls as usize);
        let link_gather = link.qp.caps().max_send_sge as usize >= MAX_PIECES;
        self.live.push(idx as u16);
        self.conns[idx] = Some(ServerConn {
            blocked: Vec::with_capacity(hello.max_calls as usize),
            link,
            goaway_sent: false,
            calls,
            deferred: VecDeque::with_capacity(geometry.send_slots as usize),
            _closed: closed,
            peer,
            max_message: cfg.max_message,
            gather: link_gather,
            zero_copy_bytes: Arc::clone(&self.zero_copy_bytes),
        });
        Ok((welcome, key))
    }

    /// Closes a connection: drops its handlers and QP; its TCP connection is closed by the
    /// acceptor when it sees the `closed` sender dropped.
    ///
    /// Nothing the NIC may still touch is released before the QPs are destroyed: the buffers
    /// of posted work requests (READ targets, WRITE sources, handlers' bulk operations) and
    /// those lent to the client go to the link's graveyard, which the link frees after its
    /// QPs (when `conn` drops); handlers whose bulk operations were in flight learn the
    /// outcome only then.
    fn close(&mut self, key: LinkKey, why: &Status) {
        let idx = key.idx as usize;
        let Some(Some(conn)) = self.conns.get(idx) else {
            return;
        };
        if conn.link.key() != key {
            return;
        }
        let Some(mut conn) = self.conns[idx].take() else {
            return;
        };
        self.live.retain(|&i| i as usize != idx);
        for c in conn.calls.iter_mut() {
            if let Some(t) = c.task.take() {
                self.tasks.cancel(t);
            }
            retire(&self.live_calls, c);
            c.park(&mut conn.link);
        }
        let ops: Vec<usize> = self
            .bulk_ops
            .iter()
            .filter(|(_, op)| op.key == key)
            .map(|(i, _)| i)
            .collect();
        let mut answers = Vec::with_capacity(ops.len());
        for i in ops {
            let InflightOp { local, done, .. } = self.bulk_ops.remove(i);
            conn.link.park(local);
            answers.push(done);
        }
        info!(
            "connection from {} closed: {} ({} buffer(s) kept until its QPs are destroyed)",
            conn.peer,
            why.message(),
            conn.link.parked()
        );
        // The QPs are destroyed here, then the graveyard is freed.
        drop(conn);
        for done in answers {
            let _ = done.send(Err(why.clone()));
        }
    }

    /// Posts the frames each connection queued this turn ([`Link::flush_sends`]).
    fn flush_sends(&mut self) {
        let mut failed = None;
        for &i in &self.live {
            if let Some(Some(conn)) = self.conns.get_mut(i as usize)
                && conn.link.has_queued_sends()
                && let Err(e) = conn.link.flush_sends()
            {
                failed = Some((conn.link.key(), e));
                break;
            }
        }
        if let Some((key, e)) = failed {
            warn!("connection failed: {e}");
            self.close(key, &e.status());
        }
    }

    fn poll_cq(&mut self) -> usize {
        let n = match self.cq.poll(&mut self.wcs) {
            Ok(n) => n,
            Err(e) => {
                warn!("poll_cq failed: {e}");
                return 0;
            }
        };
        // One clock read per batch and connection (at its first frame that needs the time),
        // not one per frame; and with more than one completion, start loading every received
        // frame before handling the first.
        for wc in &self.wcs[..n] {
            if let Some(Some(c)) = self.conns.get_mut(split_wr_id(wc.wr_id).0.idx as usize) {
                c.link.tick();
                if n > 1 {
                    c.link.prefetch(wc);
                }
            }
        }
        for i in 0..n {
            let wc = self.wcs[i];
            self.on_completion(&wc);
        }
        n
    }

    fn on_completion(&mut self, wc: &Wc) {
        let (key, kind, aux) = split_wr_id(wc.wr_id);
        let idx = key.idx as usize;
        let live = matches!(self.conns.get(idx), Some(Some(c)) if c.link.key() == key);
        if !live {
            return; // a completion of a connection already closed
        }
        let result = match kind {
            Some(WrKind::Recv) => self.on_recv(idx, wc, aux),
            Some(WrKind::Send) => match self.conns.get(idx) {
                Some(Some(c)) => call::send_done(&c.link, wc, aux),
                _ => completion(wc),
            },
            Some(WrKind::Read) => self.on_read_done(idx, wc, aux),
            Some(WrKind::Write) => completion(wc).map(|()| {
                // Only a WRITE that succeeded gives its source back (a failed one fails the
                // connection, whose close parks it until the QPs are destroyed: a striped
                // WRITE may still be in flight on another QP).
                if let Some(Some(c)) = self.conns.get_mut(idx)
                    && let Some(call) = c.calls.get_mut(aux as usize)
                {
                    call.writing.pop_front();
                }
            }),
            Some(WrKind::Nop) => completion(wc),
            Some(WrKind::Bulk) => self.on_bulk_done(wc, aux as usize),
            Some(WrKind::Stripe) => match self.conns.get_mut(idx) {
                Some(Some(c)) => match c.link.on_stripe(wc, aux) {
                    Ok(Some(whole)) => {
                        self.on_completion(&whole);
                        Ok(())
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                },
                _ => Ok(()),
            },
            None => Err(LinkError::Protocol(
                "completion with an unknown work-request id".into(),
            )),
        };
        if let Err(e) = result {
            warn!("connection failed: {e}");
            self.close(key, &e.status());
        }
    }

    fn on_bulk_done(&mut self, wc: &Wc, op: usize) -> Result<(), LinkError> {
        let Some(op) = self.bulk_ops.try_remove(op) else {
            return Ok(());
        };
        let Err(failed) = completion(wc) else {
            let _ = op.done.send(Ok(op.local));
            return Ok(());
        };
        // Failed or flushed: the operation did not happen, and the connection fails. The
        // buffer is not the handler's again: a striped operation may still be in flight on
        // another QP, so it waits in the graveyard until the QPs are destroyed.
        let InflightOp {
            key,
            local,
            kind,
            done,
        } = op;
        match self.conns.get_mut(key.idx as usize) {
            Some(Some(conn)) if conn.link.key() == key => conn.link.park(local),
            // The connection is gone, and with it its QPs: nothing can touch the buffer.
            _ => drop(local),
        }
        let e = crate::verbs::WcError { wc: *wc };
        let what = if kind == OpKind::Read {
            "READ"
        } else {
            "WRITE"
        };
        let code = match wc.status {
            WcStatus::RemAccessErr => {
                Status::permission_denied(format!("bulk {what} of the client's memory: {e}"))
            }
            WcStatus::WrFlushErr => Status::unavailable(format!(
                "bulk {what} not done: the connection had already failed ({e})"
            )),
            _ => Status::unavailable(format!("bulk {what} failed: {e}")),
        };
        let _ = done.send(Err(code));
        Err(failed)
    }

    /// Posts the bulk operations handlers queued.
    fn start_bulk_ops(&mut self) -> usize {
        let mut n = 0;
        while let Some(op) = self.peer_api.ops.pop() {
            n += 1;
            let BulkOp {
                key,
                kind,
                remote,
                local,
                len,
                done,
            } = op;
            let idx = key.idx as usize;
            let Some(Some(conn)) = self.conns.get_mut(idx) else {
                let _ = done.send(Err(Status::unavailable("the connection is closed")));
                continue;
            };
            if conn.link.key() != key {
                let _ = done.send(Err(Status::unavailable("the connection is closed")));
                continue;
            }
            let entry = self.bulk_ops.vacant_entry();
            let aux = entry.key() as u32;
            // SAFETY: `local` is kept in `bulk_ops` until the operation's successful completion
            // is polled (a failed one, a failed post, or the connection's close park it in the
            // link's graveyard until the QPs are destroyed), untouched meanwhile.
            let r = unsafe {
                conn.link.post_one_sided(
                    WrKind::Bulk,
                    aux,
                    |off, l| local.sge(off, l),
                    remote,
                    len,
                    kind == OpKind::Write,
                )
            };
            match r {
                Ok(()) => {
                    entry.insert(InflightOp {
                        key,
                        local,
                        kind,
                        done,
                    });
                }
                Err(e) => {
                    // Some chunks may be posted (the link then failed its QPs).
                    conn.link.park(local);
                    let _ = done.send(Err(Status::unavailable(format!("bulk operation: {e}"))));
                }
            }
        }
        n
    }

    fn on_recv(&mut self, idx: usize, wc: &Wc, slot: u32) -> Result<(), LinkError> {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return Ok(());
        };
        let inbound = match conn.link.on_recv(wc, slot)? {
            None => return Ok(()),
            Some(Received::Written { .. }) => {
                return Err(LinkError::Protocol(
                    "a client wrote into a server's slot".into(),
                ));
            }
            Some(Received::Frame(f)) => f,
        };
        conn.flush_deferred();
        match inbound.event {
            Event::Request {
                call,
                method_id,
                kind,
                deadline_at,
                bulk,
                bulk_more,
                landing,
                replaced,
            } => {
                if let Some(old) = replaced {
                    self.drop_call(idx, old);
                }
                let Some(Some(conn)) = self.conns.get_mut(idx) else {
                    return Ok(());
                };
                let metadata =
                    match decode_metadata(&inbound.slot.bytes()[inbound.metadata.clone()]) {
                        Ok(m) => m,
                        Err(st) => {
                            let Some(sc) = conn.calls.get_mut(call.slot() as usize) else {
                                return Err(LinkError::Protocol(
                                    "call slot beyond the call table".into(),
                                ));
                            };
                            if sc.reads_in_flight() {
                                sc.park_reads(&mut conn.link);
                            }
                            // In place: the slot's WRITEs in flight stay (see `writing`).
                            sc.reset();
                            sc.id = call;
                            conn.fail(call, &st);
                            return Ok(());
                        }
                    };
                let Some(sc) = conn.calls.get_mut(call.slot() as usize) else {
                    return Err(LinkError::Protocol(
                        "call slot beyond the call table".into(),
                    ));
                };
                let inbox = kind.client_streams().then(|| {
                    let inbox = Inbox::new(conn.link.wire.config().stream_window);
                    inbox.set_host(Box::new(ShardInbox {
                        api: Arc::clone(&self.peer_api),
                        key: conn.link.key(),
                        call,
                    }));
                    inbox
                });
                if sc.reads_in_flight() {
                    // A new call in a slot whose old call still READs (only a broken client
                    // does that): the old target stays the NIC's.
                    sc.park_reads(&mut conn.link);
                }
                // In place (a SrvCall is large; building and moving a whole one per call
                // showed up as memcpy).
                sc.reset();
                sc.id = call;
                sc.landing = landing;
                sc.lent = bulk.is_some() || landing.is_some();
                sc.active = true;
                sc.inbox = inbox;
                // Only this thread writes it (see `retire`).
                self.live_calls.store(
                    self.live_calls.load(Ordering::Relaxed) + 1,
                    Ordering::Release,
                );
                if let Some(desc) = bulk {
                    drop(inbound);
                    let head = (method_id, metadata, deadline_at);
                    self.start_read(idx, call, head, desc, bulk_more);
                } else {
                    let payload = Payload::Slot {
                        start: inbound.payload.start,
                        end: inbound.payload.end,
                        slot: inbound.slot,
                    };
                    self.dispatch(idx, call, method_id, payload, metadata, deadline_at);
                }
            }
            Event::Cancel { call } => {
                drop(inbound);
                self.drop_call(idx, call);
            }
            Event::BulkRelease { call } => {
                // Only for this very call: a late release of an earlier call in the same slot
                // must not free the buffer the current call lent.
                if let Some(c) = conn.slot(call)
                    && !c.stream_bulks.release()
                {
                    c.resp_bulk = None;
                }
            }
            Event::Stale {
                call,
                bulk: Some(_),
                ..
            } => {
                // Behind a READ of the same call in flight: released after it, in order.
                let held = conn
                    .slot(call)
                    .is_some_and(|c| c.stream.hold(Held::Release).is_ok());
                if !held {
                    conn.link.control(Control::BulkRelease(call))?;
                }
            }
            Event::StreamMessage { call, bulk, .. } => {
                let held = match bulk {
                    Some(desc) => {
                        drop(inbound);
                        Held::Bulk(desc)
                    }
                    None => Held::Item(Item::from_slot(
                        inbound.slot,
                        inbound.payload.start,
                        inbound.payload.end,
                    )),
                };
                conn.stream_in(call, held)?;
            }
            Event::EndOfStream { call } => {
                drop(inbound);
                conn.stream_in(call, Held::End)?;
            }
            Event::WindowUpdate { call, .. } => {
                if let Some(c) = conn.slot(call)
                    && std::mem::take(&mut c.blocked)
                    && let Some(t) = c.task
                {
                    self.tasks.wake(t);
                }
            }
            Event::CreditOnly | Event::Stale { .. } => {}
            Event::Response { .. } | Event::Status { .. } | Event::GoAway => {
                return Err(LinkError::Protocol(
                    "client sent a server-only frame".into(),
                ));
            }
        }
        Ok(())
    }

    /// READs a rendezvous request payload (the range `desc`, then those of `more`, one after
    /// the other) into one bulk buffer and dispatches the call once every READ completed.
    fn start_read(
        &mut self,
        idx: usize,
        call: CallId,
        (method, metadata, deadline_at): (u32, Metadata, Option<u64>),
        desc: BulkDesc,
        more: BulkMore,
    ) {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return;
        };
        // The frame codec refused totals that overflow; saturate anyway.
        let total = more
            .as_slice()
            .iter()
            .fold(desc.len, |a, d| a.saturating_add(d.len));
        let got = if total > conn.max_message {
            Err(format!(
                "request of {total} bytes exceeds the {} byte message limit",
                conn.max_message
            ))
        } else {
            conn.link
                .bulk
                .get(total as usize)
                .map_err(|e| format!("request too large: {e}"))
        };
        let buf = match got {
            Ok(mut b) => {
                b.set_len(total as usize);
                b
            }
            Err(why) => {
                if let Some(c) = conn.slot(call) {
                    retire(&self.live_calls, c);
                }
                conn.fail(call, &Status::resource_exhausted(why));
                return;
            }
        };
        // `buf` is stored in the call's `reading` until the READs' completions (or the
        // connection's end); nothing reads it meanwhile.
        // One READ per range, into consecutive offsets; each range's completion is counted
        // (`reads_left`), so it is correct whatever QP or order the link posts the chunks on.
        let mut ranges = [desc; wire::MAX_BULK_PIECES];
        let n = 1 + more.len();
        ranges[1..n].copy_from_slice(more.as_slice());
        // SAFETY: as just said.
        let r = unsafe { conn.link.post_read_ranges(call.slot(), &buf, &ranges[..n]) };
        if let Err(e) = r {
            warn!("rendezvous READ failed: {e}");
            // Some chunks may be posted: the buffer waits for the QPs' destruction.
            conn.link.park(buf);
            let key = conn.link.key();
            self.close(key, &e.status());
            return;
        }
        if let Some(c) = conn.calls.get_mut(call.slot() as usize) {
            c.reading = Some(PendingDispatch {
                buf,
                reads_left: 1 + more.len() as u8,
                method,
                metadata,
                deadline_at,
            });
        }
    }

    fn on_read_done(&mut self, idx: usize, wc: &Wc, slot: u32) -> Result<(), LinkError> {
        // A failed or flushed READ filled nothing: the connection fails (its close parks the
        // target until the QPs are destroyed); nothing is dispatched.
        completion(wc)?;
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return Ok(());
        };
        let Some(c) = conn.calls.get_mut(slot as usize) else {
            return Ok(());
        };
        if c.stale_reads > 0 {
            // The READ of a call this slot held before (its target is parked).
            c.stale_reads -= 1;
            return Ok(());
        }
        if c.stream.reading() {
            let call = c.id;
            return conn.stream_read_done(call);
        }
        if let Some(p) = c.reading.as_mut()
            && p.reads_left > 1
        {
            p.reads_left -= 1;
            return Ok(());
        }
        let Some(pending) = c.reading.take() else {
            return Ok(());
        };
        let call = c.id;
        if c.drop_after_read {
            c.drop_after_read = false;
            retire(&self.live_calls, c);
            drop(pending);
            conn.end_call(call);
            return Ok(());
        }
        // The client's buffer is no longer needed once read; the terminal frame returns it.
        let PendingDispatch {
            buf,
            reads_left: _,
            method,
            metadata,
            deadline_at,
        } = pending;
        // Shared with the call: a response may be sent from it (`respond_landing`).
        let buf = Arc::new(buf);
        c.req_buf = Some(Arc::clone(&buf));
        self.dispatch(
            idx,
            call,
            method,
            Payload::Owned(Box::new(SharedBuf(buf))),
            metadata,
            deadline_at,
        );
        Ok(())
    }

    fn dispatch(
        &mut self,
        idx: usize,
        call: CallId,
        method: u32,
        payload: Payload,
        metadata: Metadata,
        deadline_at: Option<u64>,
    ) {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return;
        };
        let now = conn.link.now();
        let timeout = deadline_at.map(|d| Duration::from_nanos(d.saturating_sub(now)));
        let mut spawned = None;
        let mut reply = Reply {
            conn,
            call,
            api: &self.peer_api,
        };
        match self.router.get(method) {
            Some((service, desc)) => {
                let inbox = reply.conn.slot(call).and_then(|c| c.inbox.clone());
                let incoming = IncomingCall {
                    inbox,
                    tasks: &mut self.tasks,
                    ctx: &mut reply,
                    payload,
                    metadata,
                    timeout,
                    spawned: &mut spawned,
                    path: desc.path,
                };
                let _ = service.call(method, incoming);
            }
            None => {
                drop(payload);
                reply.fail(&Status::unimplemented(format!(
                    "unknown method id {method:#010x}: the server has no such method (services: \
                     {})",
                    self.router.service_names().join(", ")
                )));
            }
        }
        match spawned {
            Some(task) => {
                self.task_owner[task.idx as usize] = (idx as u16, call);
                if let Some(c) = reply.conn.slot(call) {
                    c.task = Some(task);
                }
            }
            None => {
                if let Some(c) = reply.conn.calls.get_mut(call.slot() as usize)
                    && c.id == call
                {
                    retire(&self.live_calls, c);
                }
            }
        }
    }

    /// Drops a call the client cancelled, that expired or that was replaced.
    fn drop_call(&mut self, idx: usize, call: CallId) {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return;
        };
        let Some(c) = conn.slot(call) else { return };
        let task = c.task.take();
        if c.reading.is_none() {
            // With a READ in flight the call is retired when the READ completes.
            retire(&self.live_calls, c);
        }
        conn.end_call(call);
        if let Some(t) = task {
            self.tasks.cancel(t);
        }
    }

    fn run_ready(&mut self) -> usize {
        let mut n = 0;
        while let Some(task) = self.tasks.next_ready() {
            n += 1;
            let (idx, call) = self.task_owner[task.idx as usize];
            let Some(Some(conn)) = self.conns.get_mut(idx as usize) else {
                self.tasks.cancel(task);
                continue;
            };
            let mut reply = Reply {
                conn,
                call,
                api: &self.peer_api,
            };
            let done = match self.tasks.poll(task, &mut reply) {
                Polled::Pending => false,
                Polled::Done => true,
                Polled::Panicked(payload) => {
                    let path = reply.conn.slot(call).map_or("?", |c| c.path);
                    reply.fail(&panicked(path, payload.as_ref()));
                    true
                }
            };
            if done
                && let Some(c) = reply.conn.calls.get_mut(call.slot() as usize)
                && c.id == call
            {
                if c.task == Some(task) {
                    c.task = None;
                }
                retire(&self.live_calls, c);
            }
        }
        n
    }

    /// Reposts receive slots, returns credits, sends deferred frames, expires deadlines.
    fn maintain(&mut self, idle: bool) -> usize {
        while let Some((key, call, n)) = self.peer_api.grants.pop() {
            if let Some(Some(conn)) = self.conns.get_mut(key.idx as usize)
                && conn.link.key() == key
                && let Err(e) = conn.link.control(Control::WindowUpdate(call, n))
            {
                warn!(%call, "window update: {e}");
            }
        }
        let stopping = self.stop.load(Ordering::Acquire);
        let mut failed = None;
        let mut expired: [(usize, CallId); 8] = [(0, CallId(0)); 8];
        let mut n_expired = 0;
        let mut work = 0;
        for &i in &self.live {
            let idx = i as usize;
            let Some(Some(conn)) = self.conns.get_mut(idx) else {
                continue;
            };
            if stopping && !conn.goaway_sent {
                // Draining: tell the client to start no new call here.
                conn.goaway_sent = true;
                if let Err(e) = conn.link.control(Control::GoAway) {
                    failed = Some((conn.link.key(), e));
                    break;
                }
            }
            match conn.link.repost_batched(idle) {
                Ok(k) => work += k as usize,
                Err(e) => {
                    failed = Some((conn.link.key(), e));
                    break;
                }
            }
            conn.flush_deferred();
            if let Err(e) = conn.link.flush_control() {
                failed = Some((conn.link.key(), e));
                break;
            }
            if !conn.blocked.is_empty()
                && conn.link.wire.data_credits() > 0
                && conn.link.arena.free_sends() > 0
            {
                for call in std::mem::take(&mut conn.blocked) {
                    if let Some(c) = conn.slot(call)
                        && std::mem::take(&mut c.blocked)
                        && let Some(t) = c.task
                    {
                        self.tasks.wake(t);
                        work += 1;
                    }
                }
            }
            if let Err(e) = conn.link.maybe_credit_update() {
                failed = Some((conn.link.key(), e));
                break;
            }
            conn.link.tick();
            if let Some(now) = conn.link.expiry_due() {
                while n_expired < expired.len() {
                    let Some(call) = conn.link.wire.expire(now) else {
                        break;
                    };
                    expired[n_expired] = (idx, call);
                    n_expired += 1;
                }
            }
        }
        if let Some((key, e)) = failed {
            warn!("connection failed: {e}");
            self.close(key, &e.status());
        }
        for &(idx, call) in &expired[..n_expired] {
            debug!(%call, "deadline exceeded on the server: handler dropped");
            self.drop_call(idx, call);
        }
        work + n_expired
    }
}

fn pin_to_core(core: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(core);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        warn!("could not pin shard to core {core}: {e}");
    }
}
