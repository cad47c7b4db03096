//! One connection's transport: its RC queue pair, its slot arena, its protocol state
//! ([`wire::Conn`]) and the verbs it posts. Shared by server shards and clients; generic over
//! the provider, so everything here is monomorphised and the data path has no `dyn`.
//!
//! Frames are built in place in a send slot:
//!
//! ```text
//! slot:  [ .. spare .. | header | metadata | payload | .. unused .. ]
//!        0             ^ MAX_HEADER_LEN - header_len
//!                                ^ MAX_HEADER_LEN
//! ```
//!
//! The metadata and the protobuf payload are encoded first, at `MAX_HEADER_LEN`; the header is
//! written right before them once the protocol state commits the frame (so a frame can wait for
//! credits with its body already encoded), and the SEND starts at the header. One serialization
//! into registered memory; the only copy after it is the NIC's.
//!
//! Frames are not posted one by one: [`Link::post_frame`] queues the SEND and the owner's poll
//! loop calls [`Link::flush_sends`] once per turn, so the frames a turn produced (the responses
//! to a burst of requests, a burst of pipelined requests) reach the QP as one `post_send` list:
//! one doorbell on an RNIC, one ring of the peer's CQ on the soft provider, and the peer polls
//! them side by side. Inline SENDs are signaled only every [`SIGNAL_EVERY`]-th time.
//!
//! # Coalescing: several frames in one SEND
//!
//! A frame committed while an earlier frame of the same turn still waits in the queue joins
//! that SEND instead of taking a work request and a receive slot of the peer of its own, as
//! long as the SEND stays within the peer's receive slot (the eager limit, counting the
//! longest header for the new frame) and within [`BATCH_FRAMES`] frames (the QP's gather
//! list): its header and body stay in its own send slot, where they were encoded, and the
//! SEND's scatter/gather list gets one more entry, so the NIC gathers the frames back to back
//! into one receive slot (no copy by the CPU). The frame before it is marked
//! [`FrameFlags::MORE`](wire::FrameFlags::MORE), and the frame spends no credit
//! ([`wire::Conn::set_joining`]). Only what is already queued coalesces: nothing waits for
//! company, so a lone frame (a ping-pong message) goes out at the end of its turn as before.
//! A server-streaming handler that yields several messages in one turn, the responses to a
//! burst of requests, the window updates and credits riding along: each turn's frames leave
//! in as few SENDs as fit. The send slots of a SEND are chained ([`Link::release_sends`]) and
//! all return to the free stack with its completion (at the flush for an inline SEND).
//!
//! On the receiving side [`Link::on_recv`] hands over the first frame of a receive slot and
//! [`Link::next_batched`] the ones after it, each with its own guard of the slot
//! ([`RecvSlot::share`]): the slot goes back to the ring when the last frame's guard drops.
//!
//! Work-request ids name the link (`key`, with a generation so completions of a closed link are
//! ignored), the kind of work and a slot or call index.
//!
//! Posting hands the buffers a work request names to the NIC until its completion is polled or
//! the QP is destroyed; a flushed completion is a failure for everything but RECV
//! ([`completion`]); buffers of a failed or closed link wait in its [`Graveyard`] until its QPs
//! are gone (see [`owned`]).

pub mod owned;
mod stripe;
mod window;

use std::sync::Arc;
use std::time::Instant;

pub use owned::{Graveyard, ParkedStats, completion, parked_stats};
use stripe::StripeDone;
pub use stripe::{Lanes, STRIPE_MIN, lane_caps};

use crate::buf::encode::MAX_PIECES;
use crate::buf::{BulkBuf, BulkPool, EncodeMsg, RecvSlot, SlotArena};
use crate::verbs::{
    PostError, Provider, Qp, RecvWr, SendFlags, SendWr, Sge, Wc, WcOpcode, WcStatus, WrOp,
};
use crate::wire::{self, BASE_HEADER_LEN, BulkDesc, FrameHeader, MAX_HEADER_LEN, SendError};
use crate::{Metadata, Status};

/// Largest RDMA READ/WRITE posted as one work request; larger transfers are pipelined in
/// chunks of this size.
pub const CHUNK: usize = 4 << 20;

/// Most SENDs queued on a link before they go to the QP in one `post_send` (see
/// [`Link::flush_sends`]).
pub const SEND_BATCH: usize = 16;

/// An inline SEND asks for a completion at least every this many inline SENDs; the others are
/// unsignaled (their completions mean nothing, and their send-queue entries are freed by the
/// next signaled completion, as on every RC QP).
pub const SIGNAL_EVERY: u32 = 16;

/// Most frames coalesced into one SEND (one entry of its gather list each): the QPs ask for
/// this many send SGEs (less where the device has fewer; see [`Link::new`]).
pub const BATCH_FRAMES: usize = 8;

use crate::buf::slots::NO_SLOT;

/// A SEND waiting in the link's send queue for [`Link::flush_sends`]: one frame, or several
/// coalesced ones, each in its own send slot.
#[derive(Clone, Copy, Debug, Default)]
struct QueuedSend {
    sges: [Sge; BATCH_FRAMES],
    nsge: u8,
    /// Bytes of the SEND.
    len: u32,
    /// The first frame's send slot (its chain names the others).
    slot: u32,
    /// The last frame's send slot and where its header starts in it (to mark it
    /// [`MORE`](wire::FrameFlags::MORE) when another frame joins).
    last: u32,
    last_header: u32,
    /// Where the last frame ends in its slot: a packed frame ([`Link::send_packed`]) starts
    /// there.
    last_end: u32,
    /// The raw call id when the last frame is an eager StreamMessage with a base header that
    /// further messages of its stream may be packed into ([`Link::send_stream`]); 0 else.
    last_stream: u32,
}

/// The frames of one turn of the poll loop, posted together: one doorbell on an RNIC, one ring
/// of the peer's CQ on the soft provider, and the peer finds them side by side.
///
/// Room for one SEND at first, for [`SEND_BATCH`] from the first turn that queues a second
/// one (the only allocations, once in a link's life): a connection that made a call at a
/// time holds 160 bytes here, not 2.5 KiB, and one that pipelines has its whole queue after
/// its first busy turn.
#[derive(Debug, Default)]
struct SendQueue {
    /// `q[..n]` is queued; entries past `n` are room.
    q: Vec<QueuedSend>,
    n: usize,
    /// Inline SENDs posted unsignaled since the last signaled one.
    unsignaled: u32,
}

impl SendQueue {
    /// Room for one more SEND (see the type's docs): one entry, then all of them.
    #[cold]
    fn grow(&mut self) {
        let want = if self.q.is_empty() { 1 } else { SEND_BATCH };
        self.q.reserve_exact(want - self.q.len());
        self.q.resize(want, QueuedSend::default());
    }
}

/// Which link a work request belongs to: index and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinkKey {
    /// Index in the owner's table.
    pub idx: u16,
    /// Generation of that table entry.
    pub generation: u8,
}

/// What a work request was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum WrKind {
    /// A SEND of send slot `aux`.
    Send = 1,
    /// A RECV into receive slot `aux`.
    Recv = 2,
    /// The last chunk of an RDMA READ for transfer `aux`.
    Read = 3,
    /// The last chunk of an RDMA WRITE(_WITH_IMM) for transfer `aux`.
    Write = 4,
    /// A work request whose completion means nothing (inline sends).
    Nop = 5,
    /// The last chunk of a handler's one-sided bulk operation `aux`.
    Bulk = 6,
    /// The last chunk of one span of a transfer striped over several QPs (`aux` names the
    /// transfer's slot and the QP); hand it to [`Link::on_stripe`].
    Stripe = 7,
}

/// Encodes a work-request id.
pub const fn wr_id(key: LinkKey, kind: WrKind, aux: u32) -> u64 {
    (key.idx as u64) << 48 | (key.generation as u64) << 40 | (kind as u64) << 32 | aux as u64
}

/// Decodes a work-request id: link key, kind (None if unknown) and aux.
pub const fn split_wr_id(id: u64) -> (LinkKey, Option<WrKind>, u32) {
    let key = LinkKey {
        idx: (id >> 48) as u16,
        generation: (id >> 40) as u8,
    };
    let kind = match (id >> 32) as u8 {
        1 => Some(WrKind::Send),
        2 => Some(WrKind::Recv),
        3 => Some(WrKind::Read),
        4 => Some(WrKind::Write),
        5 => Some(WrKind::Nop),
        6 => Some(WrKind::Bulk),
        7 => Some(WrKind::Stripe),
        _ => None,
    };
    (key, kind, id as u32)
}

/// Why a link failed: the connection must be closed and its calls failed.
#[derive(Debug, Clone)]
pub enum LinkError {
    /// A verb failed (posting on a QP in ERROR, ...).
    Verbs(String),
    /// A work completion failed.
    Completion(crate::verbs::WcError),
    /// The peer broke the protocol.
    Protocol(String),
    /// A failure with what the link found out about its QPs ([`Link::explain`]).
    Explained(Box<LinkError>, String),
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Verbs(s) => write!(f, "verbs: {s}"),
            LinkError::Completion(e) => {
                let what = owned::what(&e.wc);
                if e.wc.status == WcStatus::WrFlushErr {
                    write!(
                        f,
                        "{what} flushed (the queue pair had already failed; the operation did \
                         not happen): {e}"
                    )
                } else {
                    write!(f, "{what} failed: {e}")
                }
            }
            LinkError::Protocol(s) => write!(f, "protocol violation by peer: {s}"),
            LinkError::Explained(e, why) => write!(f, "{e}; {why}"),
        }
    }
}

impl LinkError {
    /// Whether the failure says the peer is gone or stuck (its NIC never acknowledged, or it
    /// never posted a receive), or that our QP entered ERROR with no failed request of its
    /// own (the first failure is a flush: most often as the responder of a request of the
    /// peer that our NIC rejected, see [`Link::explain`]): the peer may know why better than
    /// we do, so its reason is worth waiting for.
    pub fn peer_silent(&self) -> bool {
        match self {
            LinkError::Completion(e) => {
                matches!(
                    e.wc.status,
                    WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr | WcStatus::WrFlushErr
                )
            }
            LinkError::Explained(e, _) => e.peer_silent(),
            _ => false,
        }
    }

    /// The status calls of a failed link end with.
    pub fn status(&self) -> Status {
        match self {
            LinkError::Protocol(_) => Status::internal(format!("connection closed: {self}")),
            LinkError::Explained(e, _) if matches!(**e, LinkError::Protocol(_)) => {
                Status::internal(format!("connection closed: {self}"))
            }
            _ => Status::unavailable(format!("connection lost: {self}")),
        }
    }
}

/// Why a frame could not be sent now.
#[derive(Debug)]
pub enum FrameError {
    /// Back-pressure: no send slot or no credit. Try again after completions arrive.
    Busy,
    /// The protocol refused the frame (the call is gone, or a caller bug), and why.
    Refused(SendError),
    /// The message does not fit (caller should have planned a bulk transfer).
    TooLarge,
    /// The link failed.
    Link(LinkError),
}

impl From<LinkError> for FrameError {
    fn from(e: LinkError) -> FrameError {
        FrameError::Link(e)
    }
}

/// A control frame: no payload, may use the reserved credits, and must not be lost. When it
/// finds no credit or send slot it waits in the link's backlog and goes out, in order, at the
/// next [`Link::flush_control`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// The peer may reuse the buffer(s) it lent for the call.
    BulkRelease(wire::CallId),
    /// The client gives the call up.
    Cancel(wire::CallId),
    /// More stream window for the call.
    WindowUpdate(wire::CallId, u32),
    /// This many bytes of the call's pending request payload are written.
    BulkReady(wire::CallId, u64),
    /// The server drains: no new calls.
    GoAway,
    /// The server asks the client to keep at most this many credits and give the rest back
    /// to the shard's receive pool ([`wire::Conn::reclaim`]).
    Reclaim(u32),
}

/// What the chunk loop posts.
#[derive(Clone, Copy, Debug)]
enum Chunked {
    Read,
    Write,
    WriteImm(u32),
}

/// A frame body encoded in a send slot, waiting for its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// The send slot.
    pub slot: u32,
    /// Encoded metadata bytes.
    pub md_len: usize,
    /// Encoded payload bytes.
    pub payload_len: usize,
}

/// Why a staged frame was not sent.
#[derive(Debug)]
pub enum CommitError {
    /// No credit (or no stream window): the frame is handed back, still staged.
    NoCredit(Staged),
    /// The protocol refused the frame; its slot was released.
    Refused(SendError),
    /// The link failed; the slot was released.
    Link(LinkError),
}

/// A received frame: the slot holding it, where its metadata and payload are in the slot, and
/// what the protocol made of it (everything the header said that matters; the header itself is
/// not kept: this is moved on every receive, and small is cheap).
#[derive(Debug)]
pub struct Inbound {
    /// The receive slot (dropping it reposts the RECV); taken by whoever keeps the bytes, so
    /// that the rest is handled where it lies ([`Link::on_recv`]).
    pub slot: Option<RecvSlot>,
    /// Metadata bytes within the slot.
    pub metadata: std::ops::Range<usize>,
    /// Payload bytes within the slot.
    pub payload: std::ops::Range<usize>,
    /// The protocol's reading of the frame.
    pub event: wire::Event,
}

impl Inbound {
    /// Takes the receive slot to keep the frame's bytes.
    ///
    /// # Errors
    /// When it was taken already (a bug of the caller's).
    pub fn take_slot(&mut self) -> Result<RecvSlot, LinkError> {
        self.slot
            .take()
            .ok_or_else(|| LinkError::Protocol("a received frame's slot taken twice".into()))
    }
}

/// What a receive completion carried.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // built and matched on the stack, never stored
pub enum Received {
    /// A frame in a receive slot.
    Frame(Inbound),
    /// A WRITE_WITH_IMM landed (a whole frame in a landing zone of call `imm`); the receive
    /// slot it consumed is already queued for reposting.
    Written {
        /// The immediate (a call id).
        imm: u32,
        /// Bytes written (for `Debug` output).
        #[allow(dead_code)]
        len: u32,
    },
}

/// One connection's transport state. Owned by one thread at a time.
pub struct Link<P: Provider> {
    /// The queue pair: every frame, and the one-sided transfers that are not striped.
    pub qp: P::Qp,
    /// Data QPs that large one-sided transfers are striped over (none by default).
    lanes: Lanes<P>,
    /// Send and receive slots.
    pub arena: Arc<SlotArena<P>>,
    /// Protocol state.
    pub wire: wire::Conn,
    /// Bulk buffers of this link's protection domain.
    pub bulk: Arc<BulkPool<P>>,
    key: LinkKey,
    max_inline: u32,
    epoch: Instant,
    clock: std::cell::Cell<u64>,
    clock_stale: std::cell::Cell<bool>,
    /// Turns that looked for expired deadlines (see [`Link::expiry_due`]).
    expiry_turns: u32,
    backlog: std::collections::VecDeque<Control>,
    sends: SendQueue,
    /// Frames one SEND may carry: [`BATCH_FRAMES`] or the QP's gather limit.
    gather: usize,
    /// Send slots this link holds, and the most it may ([`Link::set_slot_cap`]; `u32::MAX`:
    /// no cap, nothing counted).
    held: std::cell::Cell<u32>,
    slot_cap: u32,
    /// The rest of a receive slot whose first frames were handed over: the slot and where its
    /// next frame starts ([`Link::next_batched`]).
    batch: Option<(RecvSlot, usize)>,
    /// The SENDs posted and not completed: their send slots go back to the arena (which may
    /// be shared with other links) when their completions are polled, or when the link is
    /// dropped, after its QPs. Declared after `qp` and `lanes` for that order.
    posted: owned::PostedSends<P>,
    /// Where the receive window is heading (a client's: see [`window`]).
    window: window::RecvWindow,
    /// Buffers of posted work requests (and lent to the peer) of a failed or closed link.
    /// Declared after `qp` and `lanes` on purpose: fields drop in declaration order, so
    /// these are freed only after every QP of the link is destroyed (see [`owned`]).
    graveyard: Graveyard,
}

impl<P: Provider> std::fmt::Debug for Link<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("key", &self.key)
            .field("qp", &self.qp.qp_num())
            .field("credits", &self.wire.send_credits())
            .finish()
    }
}

/// Where a decoded frame's metadata and payload lie in `bytes`, the buffer it was decoded from.
#[inline(always)]
fn spans(
    bytes: &[u8],
    frame: &wire::Frame<'_>,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let base = bytes.as_ptr() as usize;
    let md_start = frame.metadata.as_ptr() as usize - base;
    let pl_start = frame.payload.as_ptr() as usize - base;
    (
        md_start..md_start + frame.metadata.len(),
        pl_start..pl_start + frame.payload.len(),
    )
}

fn post_err(verb: &str, e: &PostError) -> LinkError {
    LinkError::Verbs(format!("{verb}: {e}"))
}

impl<P: Provider> Link<P> {
    /// A link over a connected QP. Posts every receive slot (the credits the peer starts with).
    ///
    /// # Errors
    /// When posting the receives fails.
    pub fn new(
        qp: P::Qp,
        arena: Arc<SlotArena<P>>,
        wire: wire::Conn,
        bulk: Arc<BulkPool<P>>,
        key: LinkKey,
        max_inline: u32,
        epoch: Instant,
    ) -> Result<Link<P>, LinkError> {
        let arena_for_posted = Arc::clone(&arena);
        // Every posted SEND holds a send slot and a send queue entry.
        let max_posted = qp.caps().max_send_wr.min(arena.geometry().send_slots) as usize;
        let mut link = Link {
            qp,
            lanes: Lanes::default(),
            arena,
            wire,
            bulk,
            key,
            max_inline,
            epoch,
            clock: std::cell::Cell::new(0),
            clock_stale: std::cell::Cell::new(true),
            expiry_turns: 0,
            backlog: std::collections::VecDeque::new(),
            sends: SendQueue::default(),
            gather: 1,
            held: std::cell::Cell::new(0),
            slot_cap: u32::MAX,
            batch: None,
            posted: owned::PostedSends::new(Arc::clone(&arena_for_posted), max_posted),
            window: window::RecvWindow::new(
                arena_for_posted.first_window(),
                arena_for_posted.geometry().recv_slots,
            ),
            graveyard: Graveyard::default(),
        };
        link.gather = (link.qp.caps().max_send_sge as usize).clamp(1, BATCH_FRAMES);
        link.tick();
        link.post_recvs(false)?;
        Ok(link)
    }

    /// The link's key.
    pub fn key(&self) -> LinkKey {
        self.key
    }

    /// Keeps `t` (a buffer a posted work request names, or one lent to the peer) until the
    /// link's QPs are destroyed: for failure and close paths, where the completions that
    /// would have returned it will never be polled. Allocates.
    pub fn park<T: Send + 'static>(&mut self, t: T) {
        self.graveyard.park(t);
    }

    /// Buffers parked until the QPs are destroyed ([`Link::park`]).
    pub fn parked(&self) -> usize {
        self.graveyard.len()
    }

    /// Moves the link's QPs to ERROR (a failed link: the NIC stops working on its requests,
    /// the peer's accesses through it fail). Buffers stay the NIC's until the QPs are
    /// destroyed.
    pub fn fail_qps(&mut self) {
        let _ = self.qp.modify_to_error();
        for qp in self.lanes.qps_mut() {
            let _ = qp.modify_to_error();
        }
    }

    /// Stripes large one-sided transfers over `lanes` too (data QPs connected to the peer's;
    /// see [`Lanes`]).
    pub fn set_lanes(&mut self, lanes: Lanes<P>) {
        self.lanes = lanes;
    }

    /// Whether QP `qp_num` is one of this link's (the primary or a data QP).
    pub fn owns_qp(&self, qp_num: u32) -> bool {
        crate::verbs::Qp::qp_num(&self.qp) == qp_num || self.lanes.has_qp(qp_num)
    }

    /// The data QPs (empty with one QP per connection).
    pub fn lanes(&self) -> &Lanes<P> {
        &self.lanes
    }

    /// `e` with what the link knows of the QP a failed completion names: which of the
    /// connection's QPs it is, and, when the first failure is a flush, the state of each QP
    /// now. A flush as the first failure means the QP entered ERROR without a failed request
    /// of its own: as the *responder* of a request of the peer (which NAKed it: a revoked or
    /// out-of-bounds key, an invalid request), through an asynchronous error, or by a
    /// `modify_qp` of ours. Called on the failure path only (it asks the device for each
    /// QP's state).
    pub fn explain(&self, e: LinkError) -> LinkError {
        let LinkError::Completion(we) = &e else {
            return e;
        };
        let qp_num = we.wc.qp_num;
        let lanes = self.lanes.qps().len();
        let role = |q: u32| {
            if q == self.qp.qp_num() {
                "the primary QP".to_owned()
            } else {
                match self.lanes.qps().iter().position(|l| l.qp_num() == q) {
                    Some(j) => format!("data QP {} of {lanes}", j + 1),
                    None => "not one of this connection's QPs".to_owned(),
                }
            }
        };
        let mut why = format!("QP {qp_num:#x} is {}", role(qp_num));
        if we.wc.status == WcStatus::WrFlushErr {
            let states: Vec<String> = std::iter::once(&self.qp)
                .chain(self.lanes.qps())
                .map(|q| format!("{:#x} {:?}", q.qp_num(), q.state()))
                .collect();
            why.push_str(&format!(
                "; no request of it failed before: it entered ERROR as the responder of a \
                 request of the peer (which the peer's NIC then saw rejected: a revoked or \
                 out-of-bounds rkey, an invalid request), or through a device error; QP \
                 states now: {}",
                states.join(", ")
            ));
        }
        LinkError::Explained(Box::new(e), why)
    }

    /// A completion of kind [`WrKind::Stripe`]: when it finishes its transfer, the completion
    /// to handle in its place (its `wr_id` is the transfer's own); a held-back WRITE_WITH_IMM
    /// is posted here, and its own completion comes later.
    ///
    /// # Errors
    /// When posting the held-back WRITE_WITH_IMM fails.
    pub fn on_stripe(&mut self, wc: &Wc, aux: u32) -> Result<Option<Wc>, LinkError> {
        match self.lanes.done(aux, wc.status) {
            StripeDone::Pending => Ok(None),
            StripeDone::Complete(orig) => Ok(Some(Wc { wr_id: orig, ..*wc })),
            StripeDone::Fence {
                lane,
                aux,
                remote_addr,
                rkey,
            } => {
                let wr = SendWr {
                    wr_id: wr_id(self.key, WrKind::Stripe, aux),
                    op: WrOp::Write { remote_addr, rkey },
                    sg_list: &[],
                    flags: SendFlags::SIGNALED,
                };
                let Some(qp) = self.lanes.qps_mut().get_mut(lane) else {
                    return Err(LinkError::Protocol(format!(
                        "a striped READ names data QP {lane}, which this link lacks"
                    )));
                };
                // SAFETY: a zero-length WRITE names no local memory.
                unsafe { qp.post_send(std::slice::from_ref(&wr)) }.map_err(|e| {
                    post_err("post_send(zero-length RDMA WRITE fencing a lane)", &e)
                })?;
                Ok(None)
            }
            StripeDone::PostHeld(orig, h) => {
                self.flush_sends()?;
                let wr = SendWr {
                    wr_id: orig,
                    op: WrOp::WriteWithImm {
                        remote_addr: h.remote_addr,
                        rkey: h.rkey,
                        imm: h.imm,
                    },
                    sg_list: &h.sges[..h.nsge],
                    flags: SendFlags::SIGNALED,
                };
                // SAFETY: the SGEs name the transfer's local memory, which its poster keeps
                // alive and unmodified until this work request's completion is polled or the QP
                // is destroyed (the contract of the `post_*` call that striped it).
                unsafe { self.qp.post_send(std::slice::from_ref(&wr)) }
                    .map_err(|e| post_err("post_send(RDMA WRITE_WITH_IMM)", &e))?;
                Ok(None)
            }
        }
    }

    /// Nanoseconds since the runtime's epoch: the protocol's clock. Read at most once per turn
    /// of the poll loop (after [`Link::tick`]), and only when something needs the time.
    pub fn now(&self) -> u64 {
        if self.clock_stale.get() {
            self.clock.set(self.epoch.elapsed().as_nanos() as u64);
            self.clock_stale.set(false);
        }
        self.clock.get()
    }

    /// Starts a turn of the poll loop: the next [`Link::now`] reads the clock.
    pub fn tick(&mut self) {
        self.clock_stale.set(true);
    }

    /// Turns between two clock reads made only to look for expired deadlines: on an idle
    /// spinning loop the read costs more than the rest of the turn, and deadlines are coarse.
    pub const EXPIRY_EVERY: u32 = 16;

    /// Once per turn: the time, when a deadline of this link may have passed (expire calls
    /// with [`wire::Conn::expire`] at it). Reads the clock only when this turn read it already
    /// or on every [`Link::EXPIRY_EVERY`]th turn, so an expired call is found a few turns
    /// late at most.
    pub fn expiry_due(&mut self) -> Option<u64> {
        let t = self.wire.poll_timeout()?;
        self.expiry_turns = self.expiry_turns.wrapping_add(1);
        if self.clock_stale.get() && !self.expiry_turns.is_multiple_of(Self::EXPIRY_EVERY) {
            return None;
        }
        let now = self.now();
        (t <= now).then_some(now)
    }

    /// Receive slots that must be waiting before a busy loop reposts them: posting in batches
    /// costs one doorbell (and on `soft` one ring update) per batch instead of per message. An
    /// idle loop reposts whatever waits ([`Link::post_recvs`]).
    pub const REPOST_BATCH: usize = 8;

    /// [`Link::post_recvs`] when at least [`Link::REPOST_BATCH`] slots wait, when the peer is
    /// down to half the window, or when `idle`.
    ///
    /// # Errors
    /// As [`Link::post_recvs`].
    pub fn repost_batched(&mut self, idle: bool) -> Result<u32, LinkError> {
        // Small rings repost sooner: a batch never holds more than an eighth of the ring; and
        // a window that starts small (a client's) reposts once the peer, by our count, is
        // down to half of it, so slots held back never cost the peer more than that.
        let ring = self.arena.geometry().recv_slots as usize;
        let batch = Self::REPOST_BATCH.min((ring / 8).max(1));
        let waiting = self.arena.reposts_waiting();
        if idle
            || waiting >= batch
            || waiting > 0 && self.wire.peer_credits() * 2 <= self.arena.recv_window()
        {
            self.post_recvs(true)
        } else {
            Ok(0)
        }
    }

    /// Posts the receive slots waiting on the repost queue, in batches. With `report`, the
    /// protocol counts them as credits to return to the peer (false only for the initial post).
    ///
    /// # Errors
    /// When `post_recv` fails.
    pub fn post_recvs(&mut self, report: bool) -> Result<u32, LinkError> {
        if !self.arena.has_reposts() {
            return Ok(0);
        }
        let arena = &*self.arena;
        // Slots of regions being retired are parked, not posted (see `window`).
        let retire_to = self.window.retire_to();
        let window = &mut self.window;
        let mut parked = 0;
        let total = post_slots(
            &mut self.qp,
            arena,
            self.key,
            || loop {
                let idx = arena.take_repost()?;
                if idx < retire_to {
                    return Some(idx);
                }
                window.park(idx);
                parked += 1;
            },
            |idx| arena.repost_later(idx),
        )?;
        if report {
            self.window.consumed(total + parked);
            let credits = |e| LinkError::Protocol(format!("credit accounting: {e}"));
            if total > 0 {
                self.wire.recv_reposted(total).map_err(credits)?;
            }
            if parked > 0 {
                self.wire.recv_withheld(parked).map_err(credits)?;
            }
        }
        Ok(total)
    }

    /// Encodes `metadata` and `msg` into send slot `slot` after the header room; returns the
    /// metadata and payload lengths, or `None` when they do not fit the slot.
    pub fn encode_body(
        &self,
        slot: u32,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
    ) -> Option<(usize, usize)> {
        // SAFETY: the caller took `slot` from the arena and has not posted it.
        let buf = unsafe { self.arena.send_buf(slot) };
        let body = buf.get_mut(MAX_HEADER_LEN..)?;
        let md_len = metadata.encoded_len();
        let md = body.get_mut(..md_len)?;
        metadata.encode(md);
        let n = msg.encode_into(body.get_mut(md_len..)?)?;
        Some((md_len, n))
    }

    /// Writes `header` right before the body of send slot `slot` and queues the SEND; it goes
    /// to the QP with the next [`Link::flush_sends`] (or at once when the queue is full). With
    /// `join` (the frame was built joining, see [`Link::can_join`]) the frame is appended to
    /// the last queued SEND instead. The slot returns to the free stack when the send
    /// completes (at the flush for inline sends).
    ///
    /// # Errors
    /// When the header does not fit, or a full queue's `post_send` fails.
    fn post_frame(&mut self, slot: u32, header: &FrameHeader, join: bool) -> Result<(), LinkError> {
        let hlen = header.encoded_len();
        let body = header.metadata_len as usize + header.payload_len as usize;
        let start = MAX_HEADER_LEN - hlen;
        {
            // SAFETY: the caller owns `slot` (taken, not posted).
            let buf = unsafe { self.arena.send_buf(slot) };
            if MAX_HEADER_LEN + body > buf.len() {
                self.give(slot);
                return Err(LinkError::Protocol("frame larger than a slot".into()));
            }
            if let Err(e) = header.encode(&mut buf[start..MAX_HEADER_LEN]) {
                self.give(slot);
                return Err(LinkError::Protocol(format!("header encode: {e}")));
            }
        }
        let len = (hlen + body) as u32;
        let mut sge = self
            .arena
            .send_sge(slot, MAX_HEADER_LEN as u32 + body as u32);
        sge.addr += start as u64;
        sge.length = len;
        self.arena.chain(slot, NO_SLOT);
        if join && let Some(open) = self.sends.n.checked_sub(1).map(|i| &mut self.sends.q[i]) {
            debug_assert!((open.nsge as usize) < self.gather);
            // SAFETY: `open.last` is a send slot of a queued, not yet posted SEND: ours.
            let prev = unsafe { self.arena.send_buf(open.last) };
            if let Err(e) = wire::mark_more(&mut prev[open.last_header as usize..]) {
                self.give(slot);
                return Err(LinkError::Protocol(format!("batch: {e}")));
            }
            self.arena.chain(open.last, slot);
            open.sges[open.nsge as usize] = sge;
            open.nsge += 1;
            open.len += len;
            open.last = slot;
            open.last_header = start as u32;
            open.last_end = (MAX_HEADER_LEN + body) as u32;
            open.last_stream = 0;
            return Ok(());
        }
        if self.sends.n == SEND_BATCH
            && let Err(e) = self.flush_sends()
        {
            self.give(slot);
            return Err(e);
        }
        if self.sends.n == self.sends.q.len() {
            self.sends.grow();
        }
        // Written field by field in its place: a whole `QueuedSend` built and moved in is a
        // 160-byte copy per frame (a `memmove` call), and entries past `nsge` are never read.
        let q = &mut self.sends.q[self.sends.n];
        q.sges[0] = sge;
        q.nsge = 1;
        q.len = len;
        q.slot = slot;
        q.last = slot;
        q.last_header = start as u32;
        q.last_end = (MAX_HEADER_LEN + body) as u32;
        q.last_stream = 0;
        self.sends.n += 1;
        Ok(())
    }

    /// Builds a data frame whose header has no extension (an eager stream message: `build`
    /// must not add one) and queues it. While the last queued SEND has room, the frame is
    /// *packed*: its body is encoded straight into that SEND's last send slot, right after the
    /// frame there, its header written before it, and the SEND's last gather entry grows over
    /// it. No send slot and no gather entry of its own, so a turn's small messages (a
    /// server-streaming handler's burst) fill the peer's receive slot up to the eager limit,
    /// not [`BATCH_FRAMES`] frames, and hold one send slot, not one each. The bytes on the
    /// wire are the same as a joined frame's (a batch, the frames back to back). Without room
    /// it is [`Link::stage`] then [`Link::commit`].
    ///
    /// # Errors
    /// As [`Link::send_frame`]: [`FrameError::Busy`] when no send slot, credit or stream
    /// window is there (nothing was sent or spent).
    pub fn send_packed(
        &mut self,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        build: impl FnOnce(&mut wire::Conn, usize, usize) -> Result<FrameHeader, SendError>,
    ) -> Result<(), FrameError> {
        let md_len = metadata.encoded_len();
        let len = msg.encoded_len();
        let Some(at) = self.pack_room(md_len + len) else {
            let staged = self.stage(metadata, msg)?;
            return self.commit_now(staged, build);
        };
        let i = self.sends.n - 1;
        let (last, last_header) = (self.sends.q[i].last, self.sends.q[i].last_header);
        let body_at = at + BASE_HEADER_LEN;
        let end = body_at + md_len + len;
        // SAFETY: `last` is a send slot of a queued SEND not posted yet: ours. The bytes past
        // the SEND's end are not in its gather list until the frame is committed below.
        let buf = unsafe { self.arena.send_buf(last) };
        {
            let body = &mut buf[body_at..end];
            metadata.encode(&mut body[..md_len]);
            if msg.encode_into(&mut body[md_len..]) != Some(len) {
                return Err(FrameError::TooLarge);
            }
        }
        self.wire.set_joining(true);
        let built = build(&mut self.wire, len, md_len);
        self.wire.set_joining(false);
        let h = match built {
            Ok(h) => h,
            Err(SendError::NoCredit | SendError::Window) => return Err(FrameError::Busy),
            Err(e) => return Err(FrameError::Refused(e)),
        };
        // Committed: from here on a failure is the link's (a caller that broke the contract).
        if h.encoded_len() != BASE_HEADER_LEN {
            return Err(LinkError::Protocol("a packed frame has a header extension".into()).into());
        }
        h.encode(&mut buf[at..body_at])
            .and_then(|_| wire::mark_more(&mut buf[last_header as usize..]))
            .map_err(|e| LinkError::Protocol(format!("packed frame: {e}")))?;
        let open = &mut self.sends.q[i];
        let grown = (end - at) as u32;
        open.len += grown;
        open.sges[open.nsge as usize - 1].length += grown;
        open.last_header = at as u32;
        open.last_end = end as u32;
        open.last_stream = 0;
        Ok(())
    }

    /// Sends an eager message of `call`'s stream (`msg`, of `len` bytes encoded). When the
    /// frame built last is a message of the same stream, still in the last queued SEND, the
    /// message is packed into that frame ([`wire::packed`]: its length and bytes appended to
    /// the frame's payload, one message of the window, no header, no credit), while the
    /// SEND's slot and the peer's receive slot have room; otherwise it is a frame of its own,
    /// as [`Link::send_packed`] builds it. So a burst of small messages reaches the peer as
    /// one frame: one header to check and one hand-off to the stream's consumer, not one per
    /// message.
    ///
    /// # Errors
    /// As [`Link::send_packed`].
    pub fn send_stream(
        &mut self,
        call: wire::CallId,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        len: usize,
    ) -> Result<(), FrameError> {
        if metadata.is_empty() && self.pack_stream(call, msg, len)? {
            return Ok(());
        }
        self.send_packed(metadata, msg, |w, pl, ml| {
            w.stream_message(call, pl, ml, None)
        })?;
        if let Some(open) = self.sends.n.checked_sub(1).map(|i| &mut self.sends.q[i]) {
            open.last_stream = call.0;
        }
        Ok(())
    }

    /// Packs `msg` into `call`'s stream frame at the end of the last queued SEND: `Ok(false)`
    /// (nothing done) when that is not the last frame built or there is no room.
    fn pack_stream(
        &mut self,
        call: wire::CallId,
        msg: &dyn EncodeMsg,
        len: usize,
    ) -> Result<bool, FrameError> {
        let Some(i) = self.sends.n.checked_sub(1) else {
            return Ok(false);
        };
        let open = &self.sends.q[i];
        if call.0 == 0 || open.last_stream != call.0 {
            return Ok(false);
        }
        let (last, last_header, last_end, open_len) =
            (open.last, open.last_header, open.last_end, open.len);
        // SAFETY: `open.last` is a send slot of a queued SEND not posted yet: ours. The bytes
        // past the SEND's end are not in its gather list until the message is appended below.
        let buf = unsafe { self.arena.send_buf(last) };
        let Some(frame) = buf.get_mut(last_header as usize..) else {
            return Ok(false);
        };
        let grown = wire::packed::growth(wire::packed::is_packed(frame), len);
        let eager = self.wire.config().eager_limit as usize;
        if last_end as usize + grown > self.arena.geometry().slot_size as usize
            || open_len as usize + grown > eager
        {
            return Ok(false);
        }
        match self.wire.stream_message_packed(call) {
            Ok(()) => {}
            Err(SendError::Window | SendError::NoCredit) => return Err(FrameError::Busy),
            Err(e) => return Err(FrameError::Refused(e)),
        }
        // Counted by the protocol: from here on a failure is the link's.
        let grown = wire::packed::append(frame, len, |out| msg.encode_measured(out))
            .map_err(|e| LinkError::Protocol(format!("packing a stream message: {e}")))?;
        let open = &mut self.sends.q[i];
        open.len += grown as u32;
        open.sges[open.nsge as usize - 1].length += grown as u32;
        open.last_end += grown as u32;
        Ok(true)
    }

    /// Where a frame of `body` bytes (metadata and payload) with a base header would start
    /// in the last queued SEND's last slot, if it fits there and in the peer's receive slot.
    fn pack_room(&self, body: usize) -> Option<usize> {
        let open = self.sends.q.get(self.sends.n.checked_sub(1)?)?;
        let at = open.last_end as usize;
        let frame = BASE_HEADER_LEN + body;
        (at + frame <= self.arena.geometry().slot_size as usize
            && open.len as usize + frame <= self.wire.config().eager_limit as usize)
            .then_some(at)
    }

    /// Whether a frame of `body` bytes (metadata and payload) may join the last queued SEND:
    /// one is queued, its gather list has room, and with the frame (counted with the longest
    /// header) it still fits the peer's receive slot.
    fn can_join(&self, body: usize) -> bool {
        let Some(open) = self.sends.n.checked_sub(1).map(|i| &self.sends.q[i]) else {
            return false;
        };
        (open.nsge as usize) < self.gather
            && open.len as usize + MAX_HEADER_LEN + body <= self.wire.config().eager_limit as usize
    }

    /// Returns the send slots of a SEND whose first frame is in `slot` to the free stack: it
    /// was never posted, or (inline) the NIC has copied it.
    fn release_sends(&self, slot: u32) {
        let n = self.arena.release_chain(slot);
        self.gave(n);
    }

    /// The completion of the SEND whose first frame is in `slot` was polled: its send slots
    /// go back to the free stack.
    pub fn send_completed(&mut self, slot: u32) {
        let n = self.posted.completed(slot);
        self.gave(n);
    }

    /// Caps the send slots this link holds at once (taken and not yet back: staged, queued,
    /// or posted and not completed) at `cap`, for a link whose arena is shared (a server
    /// shard's): every SEND posted and not completed holds a slot, so its QP's send queue,
    /// sized for `cap` SENDs besides its one-sided operations, never overflows, and no
    /// connection takes every slot of the shard.
    pub fn set_slot_cap(&mut self, cap: u32) {
        self.slot_cap = cap;
    }

    /// A send slot of the arena, counted against the cap.
    fn take(&self) -> Option<u32> {
        if self.slot_cap != u32::MAX && self.held.get() >= self.slot_cap {
            return None;
        }
        let slot = self.arena.take_send()?;
        if self.slot_cap != u32::MAX {
            self.held.set(self.held.get() + 1);
        }
        Some(slot)
    }

    /// A send slot taken with [`Link::take`] goes back unposted.
    fn give(&self, slot: u32) {
        self.arena.release_send(slot);
        self.gave(1);
    }

    /// `n` slots went back: uncounts them.
    fn gave(&self, n: u32) {
        if self.slot_cap != u32::MAX {
            self.held.set(self.held.get().saturating_sub(n));
        }
    }

    /// Whether SENDs wait for [`Link::flush_sends`].
    pub fn has_queued_sends(&self) -> bool {
        self.sends.n > 0
    }

    /// Posts the queued SENDs, in order, with one `post_send`. The poll loops call it once per
    /// turn, after handling what the turn polled; every other post on the QP calls it first,
    /// so the QP sees frames and one-sided operations in the order they were made (and no
    /// frame joins a SEND across a one-sided operation).
    ///
    /// # Errors
    /// When `post_send` fails (the slots of the requests it did not take are released).
    pub fn flush_sends(&mut self) -> Result<(), LinkError> {
        let n = self.sends.n;
        if n == 0 {
            return Ok(());
        }
        self.sends.n = 0;
        let mut ids = [0u64; SEND_BATCH];
        let mut flags = [SendFlags::NONE; SEND_BATCH];
        let mut inline = [false; SEND_BATCH];
        for (i, s) in self.sends.q[..n].iter().enumerate() {
            inline[i] = s.len <= self.max_inline;
            if inline[i] {
                ids[i] = wr_id(self.key, WrKind::Nop, s.slot);
                self.sends.unsignaled += 1;
                flags[i] = if self.sends.unsignaled >= SIGNAL_EVERY {
                    self.sends.unsignaled = 0;
                    SendFlags::SIGNALED | SendFlags::INLINE
                } else {
                    SendFlags::INLINE
                };
            } else {
                ids[i] = wr_id(self.key, WrKind::Send, s.slot);
                flags[i] = SendFlags::SIGNALED;
                self.sends.unsignaled = 0;
            }
        }
        let mut wrs = [SendWr {
            wr_id: 0,
            op: WrOp::Send,
            sg_list: &[],
            flags: SendFlags::NONE,
        }; SEND_BATCH];
        for (i, (w, s)) in wrs.iter_mut().zip(&self.sends.q[..n]).enumerate() {
            w.wr_id = ids[i];
            w.sg_list = &s.sges[..s.nsge as usize];
            w.flags = flags[i];
        }
        // SAFETY: each SGE covers bytes of a send slot we own, inside the arena's MR, valid
        // until the send completes (the slots of a SEND are released only by its completion,
        // or right after an inline post, when the NIC has already copied the bytes).
        let r = unsafe { self.qp.post_send(&wrs[..n]) };
        let posted = match &r {
            Ok(()) => n,
            Err(e) => e.posted.min(n),
        };
        for (i, s) in self.sends.q[..n].iter().enumerate() {
            if inline[i] || i >= posted {
                self.release_sends(s.slot);
            } else {
                self.posted.push(s.slot);
            }
        }
        r.map_err(|e| post_err("post_send(SEND)", &e))
    }

    /// Takes a send slot and encodes `metadata` and `msg` into it, ready for a header.
    ///
    /// # Errors
    /// [`FrameError::Busy`] when no send slot is free; [`FrameError::TooLarge`] when the body
    /// does not fit a slot.
    pub fn stage(&self, metadata: &Metadata, msg: &dyn EncodeMsg) -> Result<Staged, FrameError> {
        self.stage_keeping(metadata, msg, self.control_reserve())
    }

    /// Whether [`Link::stage`] finds a send slot now.
    pub fn can_stage(&self) -> bool {
        self.arena.free_sends() > self.control_reserve()
            && (self.slot_cap == u32::MAX || self.held.get() < self.slot_cap)
    }

    /// Send slots a data frame leaves to control frames: a frame that waits for credit holds
    /// its slot, and with every slot held that way no CreditUpdate could go out to bring the
    /// credits back (control frames are small and inline: their slots come back at once).
    fn control_reserve(&self) -> usize {
        (self.arena.geometry().send_slots as usize / 8).clamp(1, 16)
    }

    /// [`Link::stage`] that takes a slot only while more than `keep` are free.
    fn stage_keeping(
        &self,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        keep: usize,
    ) -> Result<Staged, FrameError> {
        if keep > 0 && self.arena.free_sends() <= keep {
            return Err(FrameError::Busy);
        }
        // Control frames (`keep == 0`) are small and inline: their slot comes back at the
        // flush, so they may go past the cap (a CreditUpdate must always find one).
        let slot = if keep == 0 {
            let s = self.arena.take_send();
            if s.is_some() && self.slot_cap != u32::MAX {
                self.held.set(self.held.get() + 1);
            }
            s
        } else {
            self.take()
        };
        let Some(slot) = slot else {
            return Err(FrameError::Busy);
        };
        match self.encode_body(slot, metadata, msg) {
            Some((md_len, payload_len)) => Ok(Staged {
                slot,
                md_len,
                payload_len,
            }),
            None => {
                self.give(slot);
                Err(FrameError::TooLarge)
            }
        }
    }

    /// Takes a send slot and copies a frame body encoded elsewhere into it (`body` is the
    /// metadata, `md_len` bytes, then the payload), ready for a header.
    ///
    /// # Errors
    /// [`FrameError::Busy`] when no send slot is free; [`FrameError::TooLarge`] when the body
    /// does not fit a slot.
    pub fn stage_copy(&self, body: &[u8], md_len: usize) -> Result<Staged, FrameError> {
        if self.arena.free_sends() <= self.control_reserve() {
            return Err(FrameError::Busy);
        }
        let Some(slot) = self.take() else {
            return Err(FrameError::Busy);
        };
        // SAFETY: we took `slot` and have not posted it.
        let buf = unsafe { self.arena.send_buf(slot) };
        match buf.get_mut(MAX_HEADER_LEN..MAX_HEADER_LEN + body.len()) {
            Some(dst) if md_len <= body.len() => {
                crate::memcopy::copy(dst, body);
                Ok(Staged {
                    slot,
                    md_len,
                    payload_len: body.len() - md_len,
                })
            }
            _ => {
                self.give(slot);
                Err(FrameError::TooLarge)
            }
        }
    }

    /// Builds the header of a staged frame with `build` (which commits the frame in the
    /// protocol state, spending a credit unless it joins the last queued SEND) and queues it.
    ///
    /// # Errors
    /// [`CommitError::NoCredit`] gives the staged frame back to try again later; other errors
    /// release its slot.
    pub fn commit(
        &mut self,
        staged: Staged,
        build: impl FnOnce(&mut wire::Conn, usize, usize) -> Result<FrameHeader, SendError>,
    ) -> Result<(), CommitError> {
        let join = self.can_join(staged.md_len + staged.payload_len);
        self.wire.set_joining(join);
        let built = build(&mut self.wire, staged.payload_len, staged.md_len);
        self.wire.set_joining(false);
        match built {
            Ok(h) => self
                .post_frame(staged.slot, &h, join)
                .map_err(CommitError::Link),
            Err(SendError::NoCredit | SendError::Window) => Err(CommitError::NoCredit(staged)),
            Err(e) => {
                self.give(staged.slot);
                Err(CommitError::Refused(e))
            }
        }
    }

    /// Drops a staged frame, releasing its slot.
    pub fn discard(&self, staged: Staged) {
        self.give(staged.slot);
    }

    /// [`Link::stage`] then [`Link::commit`]; no credit is [`FrameError::Busy`].
    ///
    /// # Errors
    /// As the two steps.
    pub fn send_frame(
        &mut self,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        build: impl FnOnce(&mut wire::Conn, usize, usize) -> Result<FrameHeader, SendError>,
    ) -> Result<(), FrameError> {
        // Control frames (this is how they go out) may use the slots data frames leave.
        let staged = self.stage_keeping(metadata, msg, 0)?;
        self.commit_now(staged, build)
    }

    /// [`Link::commit`] that drops the staged frame when it cannot go now (no credit is
    /// [`FrameError::Busy`]).
    ///
    /// # Errors
    /// As [`Link::commit`], the staged frame released in every case.
    pub fn commit_now(
        &mut self,
        staged: Staged,
        build: impl FnOnce(&mut wire::Conn, usize, usize) -> Result<FrameHeader, SendError>,
    ) -> Result<(), FrameError> {
        match self.commit(staged, build) {
            Ok(()) => Ok(()),
            Err(CommitError::NoCredit(st)) => {
                self.discard(st);
                Err(FrameError::Busy)
            }
            Err(CommitError::Refused(e)) => Err(FrameError::Refused(e)),
            Err(CommitError::Link(e)) => Err(FrameError::Link(e)),
        }
    }

    /// Posts an RDMA READ of `remote` into `local[..remote.len]`, in chunks; only the last chunk
    /// is signaled (RC completes READs in order), with `wr_id(key, Read, aux)`.
    ///
    /// # Errors
    /// When `local` is too small or `post_send` fails.
    ///
    /// # Safety
    /// `local` must stay alive, and not be read by Rust code, until the last chunk's completion
    /// is polled (and [`completion`] said it succeeded: a flushed READ filled nothing) or the
    /// QP is destroyed. A failed or flushed completion fails the link: the buffer then goes to
    /// the [`Graveyard`] ([`Link::park`]), not back to its pool. On an error return some
    /// chunks may already be posted: the QPs are then in ERROR and the same holds.
    pub unsafe fn post_read(
        &mut self,
        aux: u32,
        local: &BulkBuf<P>,
        remote: BulkDesc,
    ) -> Result<(), LinkError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_read_ranges(aux, local, std::slice::from_ref(&remote)) }
    }

    /// Posts RDMA READs of `ranges`, one after the other, into consecutive bytes of `local`
    /// (a payload the peer advertised in pieces): one completion per range, each with
    /// `wr_id(key, Read, aux)` (its last chunk is signaled), whatever QPs the chunks go on.
    ///
    /// # Errors
    /// When `local` is too small for them all or `post_send` fails.
    ///
    /// # Safety
    /// As [`Link::post_read`], until every range's completion is polled or the QP is
    /// destroyed.
    pub unsafe fn post_read_ranges(
        &mut self,
        aux: u32,
        local: &BulkBuf<P>,
        ranges: &[BulkDesc],
    ) -> Result<(), LinkError> {
        let total = ranges
            .iter()
            .try_fold(0u64, |t, d| t.checked_add(d.len))
            .unwrap_or(u64::MAX);
        if total > local.capacity() as u64 {
            return Err(LinkError::Protocol(
                "bulk READ larger than the local buffer".into(),
            ));
        }
        let mut at = 0usize;
        for d in ranges {
            let off = at;
            at += d.len as usize;
            // SAFETY: forwarded contract; the range lies in `local` (checked above).
            unsafe { self.post_read_at(aux, local, off, *d) }?;
        }
        Ok(())
    }

    /// Posts an RDMA READ of `remote` into `local` from byte `at` on: one completion, with
    /// `wr_id(key, Read, aux)` (its last chunk is signaled).
    ///
    /// # Errors
    /// When the range does not fit in `local` from `at` or `post_send` fails.
    ///
    /// # Safety
    /// As [`Link::post_read`].
    pub unsafe fn post_read_at(
        &mut self,
        aux: u32,
        local: &BulkBuf<P>,
        at: usize,
        remote: BulkDesc,
    ) -> Result<(), LinkError> {
        let fits = (at as u64)
            .checked_add(remote.len)
            .is_some_and(|end| end <= local.capacity() as u64);
        if !fits {
            return Err(LinkError::Protocol(
                "bulk READ larger than the local buffer".into(),
            ));
        }
        // SAFETY: forwarded contract; the range lies in `local` (checked above).
        unsafe {
            self.post_chunked(
                WrKind::Read,
                aux,
                |o, l| local.sge(at + o, l),
                remote_mr(remote),
                remote.len as usize,
                Chunked::Read,
            )
        }
    }

    /// A WRITE with immediate whose bytes are a gather list: `pieces[i]` (in order) are
    /// `(sge_of_piece, len)` where each piece's SGE covers its whole length; chunks that span
    /// pieces carry several SGEs (at most [`MAX_PIECES`], within the QP's
    /// `max_send_sge`, which the caller checked).
    ///
    /// # Errors
    /// When `post_send` fails or the pieces exceed the landing zone.
    ///
    /// # Safety
    /// Every piece's memory must stay alive and unmodified until the last chunk's completion is
    /// polled (successfully, see [`Link::post_read`]) or the QP is destroyed.
    pub unsafe fn post_write_imm_gather(
        &mut self,
        aux: u32,
        pieces: &[Sge],
        remote: BulkDesc,
        imm: u32,
    ) -> Result<(), LinkError> {
        let len: usize = pieces.iter().map(|p| p.length as usize).sum();
        if len as u64 > remote.len || pieces.len() > MAX_PIECES {
            return Err(LinkError::Protocol(
                "bulk WRITE larger than the landing zone".into(),
            ));
        }
        let remote = remote_mr(remote);
        let sges_of = |off: usize, n: u32, out: &mut [Sge; MAX_PIECES]| {
            let (end, mut k, mut at) = (off + n as usize, 0, 0usize);
            for p in pieces {
                let (p_start, p_end) = (at, at + p.length as usize);
                at = p_end;
                let (s, e) = (p_start.max(off), p_end.min(end));
                if s < e {
                    out[k] = Sge {
                        addr: p.addr + (s - p_start) as u64,
                        length: (e - s) as u32,
                        lkey: p.lkey,
                    };
                    k += 1;
                }
            }
            Some(k)
        };
        // SAFETY: forwarded contract.
        unsafe {
            self.post_chunked_sg(
                WrKind::Write,
                aux,
                sges_of,
                remote,
                len,
                Chunked::WriteImm(imm),
            )
        }
    }

    /// Posts a one-sided RDMA READ (`write == false`) or WRITE of `len` bytes between local
    /// memory (`sge_of(offset, len)` gives the SGE of a piece) and `remote`, in chunks; only the
    /// last chunk is signaled, with `wr_id(key, kind, aux)`.
    ///
    /// # Errors
    /// When a piece is outside the local memory or `post_send` fails.
    ///
    /// # Safety
    /// The local memory must stay alive (and untouched by Rust code for a READ) until the last
    /// chunk's completion is polled (successfully, see [`Link::post_read`]) or the QP is
    /// destroyed.
    pub unsafe fn post_one_sided(
        &mut self,
        kind: WrKind,
        aux: u32,
        sge_of: impl Fn(usize, u32) -> Option<Sge>,
        remote: crate::verbs::RemoteMr,
        len: usize,
        write: bool,
    ) -> Result<(), LinkError> {
        let op = if write { Chunked::Write } else { Chunked::Read };
        // SAFETY: forwarded contract.
        unsafe { self.post_chunked(kind, aux, sge_of, remote, len, op) }
    }

    /// The chunk loop behind the one-sided posts: pieces of at most [`CHUNK`] bytes, all
    /// unsignaled but the last (signaled as `kind`); `WriteImm` makes the last a
    /// WRITE_WITH_IMM.
    ///
    /// # Safety
    /// As [`Link::post_one_sided`].
    unsafe fn post_chunked(
        &mut self,
        kind: WrKind,
        aux: u32,
        sge_of: impl Fn(usize, u32) -> Option<Sge>,
        remote: crate::verbs::RemoteMr,
        len: usize,
        op: Chunked,
    ) -> Result<(), LinkError> {
        let sges_of = |off: usize, n: u32, out: &mut [Sge; MAX_PIECES]| {
            out[0] = sge_of(off, n)?;
            Some(1)
        };
        // SAFETY: forwarded contract.
        unsafe { self.post_chunked_sg(kind, aux, sges_of, remote, len, op) }
    }

    /// The chunk loop with a gather list: `sges_of(offset, len, out)` fills `out` with the
    /// SGEs of bytes `[offset, offset + len)` of the local side and returns how many.
    ///
    /// # Safety
    /// As [`Link::post_one_sided`].
    unsafe fn post_chunked_sg(
        &mut self,
        kind: WrKind,
        aux: u32,
        sges_of: impl Fn(usize, u32, &mut [Sge; MAX_PIECES]) -> Option<usize>,
        remote: crate::verbs::RemoteMr,
        len: usize,
        op: Chunked,
    ) -> Result<(), LinkError> {
        self.flush_sends()?;
        if crate::verbs::soft::fault::one_sided_armed() {
            self.inject_fault(kind);
        }
        let mut posted = false;
        // SAFETY: forwarded contract.
        let r = unsafe { self.post_transfer(kind, aux, sges_of, remote, len, op, &mut posted) };
        if r.is_err() && posted {
            // Part of the transfer is posted and its signaled last chunk is not: nothing would
            // ever complete it. Fail the QPs (the link fails; the caller's buffer stays the
            // NIC's until the QPs are destroyed, or until the flushes on soft, which happen
            // inside `modify_to_error`).
            self.fail_qps();
        }
        r
    }

    /// The test hook of [`crate::verbs::soft::fault::arm_one_sided`] (soft QPs only).
    #[cold]
    fn inject_fault(&mut self, kind: WrKind) {
        use crate::verbs::soft::fault::{OneSided, before_one_sided};
        let op = match (kind, self.wire.role()) {
            (WrKind::Read, wire::Role::Client) => OneSided::ClientRead,
            (WrKind::Read, wire::Role::Server) => OneSided::ServerRead,
            (WrKind::Write, _) => OneSided::ServerWrite,
            (WrKind::Bulk, _) => OneSided::HandlerBulk,
            _ => return,
        };
        before_one_sided(&mut self.qp, op);
    }

    /// The body of [`Link::post_chunked_sg`]; `posted` says whether any work request was
    /// posted (also on an error return).
    ///
    /// # Safety
    /// As [`Link::post_one_sided`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn post_transfer(
        &mut self,
        kind: WrKind,
        aux: u32,
        sges_of: impl Fn(usize, u32, &mut [Sge; MAX_PIECES]) -> Option<usize>,
        remote: crate::verbs::RemoteMr,
        len: usize,
        op: Chunked,
        posted: &mut bool,
    ) -> Result<(), LinkError> {
        let orig = wr_id(self.key, kind, aux);
        // A striped READ fences its lanes before it completes (see `stripe`).
        let fence = matches!(op, Chunked::Read).then_some((remote.addr, remote.rkey));
        if let Some((span, used)) = self.lanes.plan(len)
            && let Some((slot, generation)) = self.lanes.begin(orig, len, span, used, CHUNK, fence)
        {
            // Spans 0..used-1 on the lanes, the last on the primary QP (see `stripe`).
            let plain = match op {
                Chunked::Read => Chunked::Read,
                Chunked::Write | Chunked::WriteImm(_) => Chunked::Write,
            };
            for j in 0..used - 1 {
                let id = wr_id(
                    self.key,
                    WrKind::Stripe,
                    stripe::stripe_aux(slot, generation, j + 1),
                );
                let qp = &mut self.lanes.qps_mut()[j];
                // SAFETY: forwarded contract.
                unsafe {
                    post_span::<P>(
                        qp,
                        j * span,
                        span.min(len - j * span),
                        &sges_of,
                        remote,
                        plain,
                        id,
                        false,
                        posted,
                    )
                }?;
            }
            let start = (used - 1) * span;
            let (remaining, last_id) = match op {
                Chunked::WriteImm(_) => (used - 1, orig),
                // Every span, and each lane's fence.
                Chunked::Read => (
                    2 * used - 1,
                    wr_id(
                        self.key,
                        WrKind::Stripe,
                        stripe::stripe_aux(slot, generation, 0),
                    ),
                ),
                Chunked::Write => (
                    used,
                    wr_id(
                        self.key,
                        WrKind::Stripe,
                        stripe::stripe_aux(slot, generation, 0),
                    ),
                ),
            };
            let hold = matches!(op, Chunked::WriteImm(_));
            // SAFETY: forwarded contract.
            let held = unsafe {
                post_span::<P>(
                    &mut self.qp,
                    start,
                    len - start,
                    &sges_of,
                    remote,
                    op,
                    last_id,
                    hold,
                    posted,
                )
            }?;
            self.lanes.armed(slot, remaining as u8, held);
            return Ok(());
        }
        // SAFETY: forwarded contract.
        unsafe {
            post_span::<P>(
                &mut self.qp,
                0,
                len,
                &sges_of,
                remote,
                op,
                orig,
                false,
                posted,
            )
        }?;
        Ok(())
    }

    /// Parses a frame alone in `bytes` (a landing zone: never a batch; `bytes` may be longer
    /// than the frame) and runs it through the protocol.
    ///
    /// # Errors
    /// When the bytes are not a valid frame or the frame breaks the protocol.
    pub fn parse(
        &mut self,
        bytes: &[u8],
    ) -> Result<
        (
            FrameHeader,
            std::ops::Range<usize>,
            std::ops::Range<usize>,
            wire::Event,
        ),
        LinkError,
    > {
        let frame = wire::decode(bytes).map_err(|e| LinkError::Protocol(format!("{e}")))?;
        if frame.header.flags.contains(wire::FrameFlags::MORE) {
            // The protocol would count the next received frame as part of a batch.
            return Err(LinkError::Protocol(
                "a frame outside a receive slot says another follows it (MORE)".into(),
            ));
        }
        self.handle_decoded(bytes, &frame)
    }

    /// Runs a frame decoded from `bytes` through the protocol; returns its header, where its
    /// metadata and payload lie in `bytes`, and the protocol's event.
    #[inline(always)]
    fn handle_decoded(
        &mut self,
        bytes: &[u8],
        frame: &wire::Frame<'_>,
    ) -> Result<
        (
            FrameHeader,
            std::ops::Range<usize>,
            std::ops::Range<usize>,
            wire::Event,
        ),
        LinkError,
    > {
        let (md, pl) = spans(bytes, frame);
        let event = self.protocol_event(&frame.header)?;
        Ok((frame.header, md, pl, event))
    }

    /// Runs a received frame's header through the protocol, now.
    #[inline(always)]
    fn protocol_event(&mut self, header: &FrameHeader) -> Result<wire::Event, LinkError> {
        let now = self.now();
        self.wire
            .handle_frame(header, now)
            .map_err(|e| LinkError::Protocol(format!("{e}")))
    }

    /// When `wc` is a receive completion of this link, asks the CPU to start loading its frame
    /// (see [`SlotArena::prefetch_recv`]): the poll loops call it for every completion of a
    /// multi-completion poll before handling the first. A hint only.
    #[inline]
    pub fn prefetch(&self, wc: &Wc) {
        if let (key, Some(WrKind::Recv), slot) = split_wr_id(wc.wr_id)
            && key == self.key
        {
            self.arena.prefetch_recv(slot, wc.byte_len);
        }
    }

    /// Handles a receive completion of this link: `out` gets its first frame, or `None` (a
    /// flushed receive). `out` is written in place (a [`Received`] is large, and returning one
    /// through `Result`s cost a `memcpy` of it per frame); it must hold nothing.
    ///
    /// # Errors
    /// When the completion failed (other than a flush), or the frame is invalid.
    #[inline(always)]
    pub fn on_recv(
        &mut self,
        wc: &Wc,
        slot_idx: u32,
        out: &mut Option<Received>,
    ) -> Result<(), LinkError> {
        if wc.status != WcStatus::Success {
            // The NIC gave the slot back (its completion is polled), unfilled, because the QP
            // is in ERROR: it stays unposted (a receive posted now would only be flushed
            // again, and reporting it as a credit would count a frame that never came).
            completion(wc)?;
            return Ok(());
        }
        if slot_idx >= self.arena.recv_window() {
            return Err(LinkError::Protocol(
                "receive completion for an unknown slot".into(),
            ));
        }
        // SAFETY: this is the completion of the RECV posted for `slot_idx` (its wr_id says so
        // and it was polled); the slot is not posted again until the guard drops.
        let slot = unsafe { self.arena.recv_slot(slot_idx, wc.byte_len) };
        self.on_slot(wc, slot, out)
    }

    /// Handles the successful receive completion `wc` whose bytes are in `slot` (a slot of
    /// this link's ring, or of a receive pool the link's QP shares: see
    /// [`crate::buf::RecvPool`]): `out` gets the first frame in it, or what a WRITE_WITH_IMM
    /// wrote (in place, as [`Link::on_recv`]).
    ///
    /// # Errors
    /// When the frame is invalid or breaks the protocol.
    #[inline(always)]
    pub fn on_slot(
        &mut self,
        wc: &Wc,
        slot: RecvSlot,
        out: &mut Option<Received>,
    ) -> Result<(), LinkError> {
        // A receive slot's frames are all handed over before the next completion.
        debug_assert!(self.batch.is_none(), "next_batched not drained");
        self.batch = None;
        if wc.opcode == WcOpcode::RecvRdmaWithImm {
            drop(slot);
            *out = Some(Received::Written {
                imm: wc.imm_data,
                len: wc.byte_len,
            });
            return Ok(());
        }
        self.frame_at(slot, 0, out)
    }

    /// The next frame of the receive slot [`Link::on_recv`] handed the first frame of, when
    /// it holds several (a batch), into `out` (`None`: no more; in place, as
    /// [`Link::on_recv`]): call it after handling each frame until `None`, before the next
    /// completion. Each frame comes with its own guard of the slot.
    ///
    /// # Errors
    /// When the bytes are not a valid frame or the frame breaks the protocol.
    #[inline(always)]
    pub fn next_batched(&mut self, out: &mut Option<Received>) -> Result<(), LinkError> {
        match self.batch.take() {
            None => {
                *out = None;
                Ok(())
            }
            Some((slot, at)) => self.frame_at(slot, at, out),
        }
    }

    /// Parses the frame at offset `at` of a receive slot and runs it through the protocol,
    /// into `out`; when another frame follows it, keeps a guard of the slot for
    /// [`Link::next_batched`].
    #[inline(always)]
    fn frame_at(
        &mut self,
        mut slot: RecvSlot,
        at: usize,
        out: &mut Option<Received>,
    ) -> Result<(), LinkError> {
        let bytes = slot.bytes();
        let rest = bytes.get(at..).unwrap_or_default();
        let frame = wire::decode(rest).map_err(|e| LinkError::Protocol(format!("{e}")))?;
        let next = wire::next_in_batch(bytes, at, &frame)
            .map_err(|e| LinkError::Protocol(format!("{e}")))?;
        let (metadata, payload) = spans(bytes, &frame);
        let event = self.protocol_event(&frame.header)?;
        if let Some(next) = next {
            let rest = slot.share();
            self.batch = Some((rest, next));
        }
        *out = Some(Received::Frame(Inbound {
            slot: Some(slot),
            metadata,
            payload,
            event,
        }));
        Ok(())
    }

    /// Sends a control frame now, or queues it behind earlier ones until credit allows.
    /// Frames the protocol refuses (the call is long gone) are dropped.
    ///
    /// # Errors
    /// When the link failed.
    pub fn control(&mut self, c: Control) -> Result<(), LinkError> {
        if !self.backlog.is_empty() {
            self.backlog.push_back(c);
            return self.flush_control();
        }
        if !self.try_control(c)? {
            self.backlog.push_back(c);
        }
        Ok(())
    }

    /// Whether control frames wait for credit (they go out once the peer's credits arrive).
    pub fn has_backlog(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// Sends queued control frames while credit allows.
    ///
    /// # Errors
    /// When the link failed.
    pub fn flush_control(&mut self) -> Result<(), LinkError> {
        while let Some(&c) = self.backlog.front() {
            if !self.try_control(c)? {
                break;
            }
            self.backlog.pop_front();
        }
        Ok(())
    }

    /// Tries once: `Ok(false)` when there is no credit or slot now.
    fn try_control(&mut self, c: Control) -> Result<bool, LinkError> {
        let md = Metadata::new();
        let r = match c {
            Control::BulkRelease(call) => {
                self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| w.bulk_release(call))
            }
            Control::Cancel(call) => self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| {
                match w.cancel(call) {
                    // The call was finished while its Cancel waited for credit.
                    Err(SendError::BadCall(_)) => w.cancel_finished(call),
                    r => r,
                }
            }),
            Control::WindowUpdate(call, n) => {
                self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| w.window_update(call, n))
            }
            Control::BulkReady(call, ready) => {
                self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| w.bulk_ready(call, ready))
            }
            Control::GoAway => self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| w.go_away()),
            Control::Reclaim(keep) => {
                self.send_frame(&md, &crate::buf::NoMsg, |w, _, _| w.reclaim(keep))
            }
        };
        match r {
            Ok(()) | Err(FrameError::TooLarge) => Ok(true),
            Err(FrameError::Refused(e)) => {
                // Moot by now (the call ended, or the answer came meanwhile).
                tracing::debug!(?c, "control frame not sent: {e}");
                Ok(true)
            }
            Err(FrameError::Busy) => Ok(false),
            Err(FrameError::Link(e)) => Err(e),
        }
    }

    /// Sends a CreditUpdate if the protocol asks for one.
    ///
    /// # Errors
    /// When posting fails.
    pub fn maybe_credit_update(&mut self) -> Result<(), LinkError> {
        if self.wire.wants_credit_update() {
            match self.send_frame(&Metadata::new(), &crate::buf::NoMsg, |w, _, _| {
                w.credit_update()
            }) {
                Ok(()) | Err(FrameError::Busy) | Err(FrameError::Refused(_)) => {}
                Err(FrameError::TooLarge) => {}
                Err(FrameError::Link(e)) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Posts the receive slots `next` yields, in batches of one `post_recv`; a slot that could
/// not be posted goes to `unposted`. Returns how many were posted.
fn post_slots<P: Provider>(
    qp: &mut P::Qp,
    arena: &SlotArena<P>,
    key: LinkKey,
    mut next: impl FnMut() -> Option<u32>,
    mut unposted: impl FnMut(u32),
) -> Result<u32, LinkError> {
    const BATCH: usize = 16;
    let mut total = 0;
    loop {
        let mut sges = [Sge::default(); BATCH];
        let mut ids = [0u64; BATCH];
        let mut n = 0;
        while n < BATCH {
            let Some(idx) = next() else {
                break;
            };
            sges[n] = arena.recv_sge(idx);
            ids[n] = wr_id(key, WrKind::Recv, idx);
            n += 1;
        }
        if n == 0 {
            break;
        }
        let wrs: [RecvWr<'_>; BATCH] = std::array::from_fn(|i| RecvWr {
            wr_id: ids[i],
            sg_list: std::slice::from_ref(&sges[i]),
        });
        // SAFETY: each SGE names a receive slot of the window of `arena`, the link's, which
        // lives (in the link, and in any guard) until `qp` is gone; the slot is owned by the
        // NIC from now until its completion is polled (it came off the repost queue, or
        // is new to the window, so no guard refers to it).
        let r = unsafe { qp.post_recv(&wrs[..n]) };
        if let Err(e) = r {
            for id in &ids[e.posted.min(n)..n] {
                unposted(split_wr_id(*id).2);
            }
            return Err(post_err("post_recv", &e));
        }
        total += n as u32;
    }
    Ok(total)
}

/// The verbs view of a peer's advertised buffer.
fn remote_mr(d: BulkDesc) -> crate::verbs::RemoteMr {
    crate::verbs::RemoteMr {
        addr: d.addr,
        len: d.len,
        rkey: d.rkey,
    }
}

/// Posts bytes `[start, start + len)` of a one-sided transfer on `qp` in chunks of at most
/// [`CHUNK`], all unsignaled but the last (signaled with `last_id`). `WriteImm` makes the last
/// chunk a WRITE_WITH_IMM; with `hold` that chunk is not posted but returned, to be posted
/// later (see [`Link::on_stripe`]). Sets `posted` when it posts anything.
///
/// # Safety
/// As [`Link::post_one_sided`].
#[allow(clippy::too_many_arguments)]
unsafe fn post_span<P: Provider>(
    qp: &mut P::Qp,
    start: usize,
    len: usize,
    sges_of: &impl Fn(usize, u32, &mut [Sge; MAX_PIECES]) -> Option<usize>,
    remote: crate::verbs::RemoteMr,
    op: Chunked,
    last_id: u64,
    hold: bool,
    posted: &mut bool,
) -> Result<Option<stripe::Held>, LinkError> {
    let end = start + len;
    let mut off = start;
    let mut sges = [Sge::default(); MAX_PIECES];
    loop {
        let n = (end - off).min(CHUNK);
        let last = off + n >= end;
        let Some(nsge) = sges_of(off, n as u32, &mut sges) else {
            return Err(LinkError::Protocol(
                "bulk operation outside the local buffer".into(),
            ));
        };
        let remote_addr = remote.addr + off as u64;
        let rkey = remote.rkey;
        if last
            && hold
            && let Chunked::WriteImm(imm) = op
        {
            return Ok(Some(stripe::Held {
                sges,
                nsge,
                remote_addr,
                rkey,
                imm,
            }));
        }
        let wr = SendWr {
            wr_id: if last {
                last_id
            } else {
                last_id & !(0xff << 32) | (WrKind::Nop as u64) << 32
            },
            op: match op {
                Chunked::Read => WrOp::Read { remote_addr, rkey },
                Chunked::WriteImm(imm) if last => WrOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                },
                Chunked::Write | Chunked::WriteImm(_) => WrOp::Write { remote_addr, rkey },
            },
            sg_list: &sges[..nsge],
            flags: if last {
                SendFlags::SIGNALED
            } else {
                SendFlags::NONE
            },
        };
        // SAFETY: the SGEs are inside the caller's local memory, kept alive (and untouched
        // for a READ) until the completion is polled or the QP destroyed (this function's
        // contract).
        unsafe { qp.post_send(std::slice::from_ref(&wr)) }
            .map_err(|e| post_err("post_send(RDMA READ/WRITE)", &e))?;
        *posted = true;
        off += n;
        if last {
            return Ok(None);
        }
    }
}

/// Metadata decoded from a frame, or the reason it is invalid.
/// The process's epoch: every link's clock ([`Link::now`]) and the call statistics count
/// nanoseconds from it, so their times compare.
pub(crate) fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`] now (a vDSO clock read, no syscall).
pub(crate) fn now_ns() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The metadata a peer sent, or INTERNAL naming what is wrong with it.
#[inline]
pub fn decode_metadata(bytes: &[u8]) -> Result<Metadata, Status> {
    metadata_or_empty(bytes, Metadata::decode)
}

/// No metadata (most small calls) is answered inline, without the decoder's call and its
/// large `Result` (about 125 instructions per call on a shard, callgrind).
#[inline]
fn metadata_or_empty(
    bytes: &[u8],
    decode: fn(&[u8]) -> Result<Metadata, crate::request::InvalidMetadata>,
) -> Result<Metadata, Status> {
    if bytes.is_empty() {
        return Ok(Metadata::new());
    }
    decode(bytes).map_err(|e| Status::internal(format!("bad metadata from peer: {e}")))
}

/// Reads up to 16 asynchronous events with `poll` (never waits) and hands each to `on_event`
/// with the status its connections fail with when it is fatal for them: the reading loop the
/// client driver and the server shards share. `who` names the reader in the log line of a
/// failed read. Stops early when `on_event` returns false.
pub(crate) fn device_events(
    mut poll: impl FnMut() -> crate::verbs::Result<Option<crate::verbs::AsyncEvent>>,
    who: &dyn std::fmt::Display,
    mut on_event: impl FnMut(crate::verbs::AsyncEvent, Status) -> bool,
) {
    for _ in 0..16 {
        let ev = match poll() {
            Ok(Some(ev)) => ev,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("{who}: reading the device's events: {e}");
                return;
            }
        };
        let why = Status::unavailable(format!("the RDMA device reported: {} ({ev:?})", ev.cause()));
        if !on_event(ev, why) {
            return;
        }
    }
}

/// A response frame's metadata block (headers, then trailers after a separator), or the
/// reason it is invalid.
#[inline]
pub fn decode_response_metadata(bytes: &[u8]) -> Result<Metadata, Status> {
    metadata_or_empty(bytes, Metadata::decode_block)
}

impl<P: Provider> Drop for Link<P> {
    fn drop(&mut self) {
        // Move the QPs to ERROR so the NIC stops working on our requests; they are destroyed
        // when `qp` and `lanes` drop, right after this, and only then the graveyard (declared
        // after them) frees what it kept.
        self.fail_qps();
        // SENDs never posted (each with the slots of the frames coalesced into it): their
        // slots were never the NIC's.
        for s in &self.sends.q[..self.sends.n] {
            self.arena.release_chain(s.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        let k = LinkKey {
            idx: 513,
            generation: 7,
        };
        for kind in [
            WrKind::Send,
            WrKind::Recv,
            WrKind::Read,
            WrKind::Write,
            WrKind::Nop,
            WrKind::Bulk,
            WrKind::Stripe,
        ] {
            let id = wr_id(k, kind, 0xdead_beef);
            assert_eq!(split_wr_id(id), (k, Some(kind), 0xdead_beef));
        }
        assert_eq!(split_wr_id(0).1, None);
    }
}
