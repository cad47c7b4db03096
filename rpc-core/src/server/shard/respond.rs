//! Answering a call: the handler's view of it ([`Reply`]), unary responses by the cheapest
//! path that fits (eager, landing-zone WRITE, rendezvous), stream messages, statuses, and
//! terminal frames waiting for credit.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{debug, warn};

use crate::buf::encode::MAX_PIECES;
use crate::buf::{BulkBuf, EncodeMsg, Gather, NoMsg, Piece, RawBytes};
use crate::call::lend_read;
use crate::link::{CommitError, Control, FrameError};
use crate::server::call::CallCtx;
use crate::server::peer::{Peer, PeerApi};
use crate::streaming::STREAM_LOANS;
use crate::verbs::{Provider, Sge};
use crate::wire::{self, BulkDesc, CallId, MAX_HEADER_LEN, Transfer};
use crate::{Metadata, Status};

use super::{Body, Deferred, RespHold, ServerConn, Spill};

/// The shard's view of one call, lent to `IncomingCall` and to the call's task.
pub(super) struct Reply<'a, P: Provider> {
    pub(super) conn: &'a mut ServerConn<P>,
    pub(super) call: CallId,
    pub(super) api: &'a Arc<PeerApi>,
}

/// Response `bytes` fields at least this large that lie in the request's buffer are sent from
/// there instead of being copied (an echo, a slice of the request).
const ZERO_COPY_MIN: usize = 16 << 10;

impl<P: Provider> CallCtx for Reply<'_, P> {
    fn respond(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata) {
        self.conn.respond(self.call, msg, metadata);
    }

    fn fail(&mut self, status: &Status) {
        self.conn.fail(self.call, status);
    }

    fn peer(&self) -> Option<Peer> {
        Some(Peer::new(
            Arc::clone(self.api),
            self.conn.link.key(),
            self.call,
        ))
    }

    fn stream_ready(&mut self) -> bool {
        // At most `STREAM_LOANS` large messages open (not released by the client) per stream,
        // however far the window is open: the next message may be large.
        let loans_full = self
            .conn
            .slot(self.call)
            .is_some_and(|c| c.stream_bulks.len() >= STREAM_LOANS);
        let link = &self.conn.link;
        let ok = !loans_full
            && link.wire.send_window(self.call).is_some_and(|w| w > 0)
            && link.wire.data_credits() > 0
            && link.can_stage()
            && self.conn.deferred.is_empty();
        if !ok
            && let Some(c) = self.conn.slot(self.call)
            && !c.blocked
        {
            c.blocked = true;
            // A BulkRelease wakes a stream waiting for its loans (and a WindowUpdate any); the
            // list is for those waiting for credits or send slots.
            if !loans_full {
                self.conn.blocked.push(self.call);
            }
        }
        ok
    }

    fn send_stream(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata) -> Result<(), Status> {
        self.conn.send_stream(self.call, msg, metadata)
    }

    fn finish_ok(&mut self, metadata: &Metadata) {
        let mut ok = Status::new(crate::Code::Ok, "");
        if metadata.encoded_len() > 0 {
            *ok.metadata_mut() = metadata.clone();
        }
        self.conn.fail(self.call, &ok);
    }
}

impl<P: Provider> ServerConn<P> {
    /// Sends the unary response of `call` by the cheapest path that fits.
    pub(super) fn respond(&mut self, call: CallId, msg: &dyn EncodeMsg, metadata: &Metadata) {
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
            Transfer::Eager => match self.stage_terminal(metadata, msg) {
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
    pub(super) fn respond_landing(
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
                self.stat_end(call, crate::Code::Ok, Some((len, true)));
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
    pub(super) fn respond_rendezvous(
        &mut self,
        call: CallId,
        msg: &dyn EncodeMsg,
        metadata: &Metadata,
    ) {
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
        match self.stage_terminal(metadata, &NoMsg) {
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
    pub(super) fn send_stream(
        &mut self,
        call: CallId,
        msg: &dyn EncodeMsg,
        metadata: &Metadata,
    ) -> Result<(), Status> {
        let len = msg.encoded_len();
        let md_len = metadata.encoded_len();
        let refused = |e: FrameError| match e {
            FrameError::Refused(wire::SendError::Gone) => Status::cancelled("the call ended"),
            e => Status::internal(format!("stream message: {e:?}")),
        };
        let bulk = match self.link.wire.plan(len as u64, md_len, None) {
            Transfer::Eager | Transfer::Landing => {
                self.link
                    .send_stream(call, metadata, msg, len)
                    .map_err(refused)?;
                false
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
                let st = self.link.stage(metadata, &NoMsg).map_err(refused)?;
                self.link
                    .commit_now(st, |w, _, ml| w.stream_message(call, 0, ml, Some(desc)))
                    .map_err(refused)?;
                if let Some(c) = self.slot(call) {
                    c.stream_bulks.lend(buf);
                }
                true
            }
            Transfer::TooLarge => {
                return Err(Status::resource_exhausted(format!(
                    "stream message of {len} bytes exceeds the {} byte message limit",
                    self.link.wire.config().max_message
                )));
            }
        };
        self.stat_message(call, len, bulk);
        Ok(())
    }

    /// Ends `call` with `status` (a handler's, or one of the runtime's). The reserved
    /// not-executed trailer is never passed on: a handler that returns a status it got from a
    /// call of its own has run (see [`crate::NOT_EXECUTED_KEY`]).
    pub(super) fn fail(&mut self, call: CallId, status: &Status) {
        if status.metadata().get(crate::NOT_EXECUTED_KEY).is_some() {
            let mut st = status.clone();
            st.metadata_mut().remove(crate::NOT_EXECUTED_KEY);
            return self.send_status(call, &st);
        }
        self.send_status(call, status);
    }

    /// Refuses `call`, which reached no handler (the server drains), with `UNAVAILABLE` and
    /// the not-executed trailer: the client may send it elsewhere whatever its method.
    pub(super) fn refuse_not_executed(&mut self, call: CallId, message: &str) {
        let mut st = Status::unavailable(message);
        // A short ASCII key and value: within the metadata limits.
        let _ = st.metadata_mut().insert(crate::NOT_EXECUTED_KEY, "1");
        self.send_status(call, &st);
    }

    fn send_status(&mut self, call: CallId, status: &Status) {
        // As much of the message as the frame holds beside the header and the trailers, up
        // to MAX_STATUS_MESSAGE_LEN, never cut inside a character.
        let room = (self.link.wire.config().eager_limit as usize)
            .saturating_sub(MAX_HEADER_LEN + status.metadata().encoded_len());
        let max = room.min(crate::status::MAX_STATUS_MESSAGE_LEN);
        let msg = crate::status::cut_at_char(status.message(), max).as_bytes();
        match self.stage_terminal(status.metadata(), &RawBytes(msg)) {
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
    pub(super) fn fail_without_trailers(&mut self, call: CallId, status: &Status) {
        let room = (self.link.wire.config().eager_limit as usize).saturating_sub(MAX_HEADER_LEN);
        let why = format!(
            "status {} with {} bytes of trailing metadata does not fit a {} byte frame: {}",
            status.code().name(),
            status.metadata().encoded_len(),
            self.link.wire.config().eager_limit,
            status.message()
        );
        let why = crate::status::cut_at_char(&why, room.min(crate::status::MAX_STATUS_MESSAGE_LEN));
        match self.stage_terminal(&Metadata::new(), &RawBytes(why.as_bytes())) {
            Ok(st) => self.commit_terminal(Deferred::Status {
                call,
                staged: st,
                code: crate::Code::ResourceExhausted as u8,
            }),
            Err(e) => self.frame_failed(call, e),
        }
    }

    /// Encodes a terminal frame's body into a send slot, or, when the shard has none free,
    /// onto the heap (spilled, one allocation): a terminal frame is never lost for want of a
    /// slot, and goes out when one frees ([`ServerConn::flush_deferred`]).
    fn stage_terminal(
        &mut self,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
    ) -> Result<Body, FrameError> {
        match self.link.stage(metadata, msg) {
            Ok(st) => Ok(Body::Slot(st)),
            Err(FrameError::Busy) => {
                let md_len = metadata.encoded_len();
                let len = msg.encoded_len();
                if MAX_HEADER_LEN + md_len + len > self.link.wire.config().eager_limit as usize {
                    return Err(FrameError::TooLarge);
                }
                let mut bytes = vec![0u8; md_len + len];
                metadata.encode(&mut bytes[..md_len]);
                if msg.encode_into(&mut bytes[md_len..]) != Some(len) {
                    return Err(FrameError::TooLarge);
                }
                Ok(Body::Spilled(Box::new(Spill { bytes, md_len })))
            }
            Err(e) => Err(e),
        }
    }

    pub(super) fn frame_failed(&mut self, call: CallId, e: FrameError) {
        // A terminal frame always finds a slot or spills; failing here means the metadata did
        // not fit or the link broke.
        warn!(%call, "cannot send the terminal frame: {e:?}");
        self.end_call(call);
    }

    /// Commits a staged terminal frame now, or queues it until a credit arrives.
    pub(super) fn commit_terminal(&mut self, d: Deferred) {
        match d {
            Deferred::Response {
                call,
                ref staged,
                bulk,
            } => {
                let bytes = bulk.map_or(staged.payload_len(), |b| b.len as usize);
                self.stat_end(call, crate::Code::Ok, Some((bytes, bulk.is_some())));
            }
            Deferred::Status { call, code, .. } => {
                self.stat_end(call, crate::Code::from_u8(code), None);
            }
        }
        let d = if self.deferred.is_empty() {
            match self.try_commit(d) {
                None => return,
                Some(d) => d,
            }
        } else {
            d
        };
        if let Some(t) = &self.stats {
            t.transport.credit_stalls.fetch_add(1, Ordering::Relaxed);
        }
        self.deferred.push_back(d);
    }

    /// Returns the frame back when there is no credit (staged in a slot), or when, spilled, it
    /// found no send slot yet (still spilled).
    pub(super) fn try_commit(&mut self, d: Deferred) -> Option<Deferred> {
        let (call, body) = match d {
            Deferred::Response {
                call, ref staged, ..
            }
            | Deferred::Status {
                call, ref staged, ..
            } => (call, staged),
        };
        let staged = match body {
            Body::Slot(st) => *st,
            Body::Spilled(spill) => match self.link.stage_copy(&spill.bytes, spill.md_len) {
                Ok(st) => st,
                Err(FrameError::Busy) => return Some(d),
                Err(e) => {
                    debug!(%call, "spilled terminal frame: {e:?}");
                    self.end_call(call);
                    return None;
                }
            },
        };
        let r = match d {
            Deferred::Response { bulk, .. } => self
                .link
                .commit(staged, |w, pl, ml| w.response(call, pl, ml, bulk, false)),
            Deferred::Status { code, .. } => self
                .link
                .commit(staged, |w, pl, ml| w.status(call, code, pl, ml)),
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
            Err(CommitError::NoCredit(staged)) => {
                let staged = Body::Slot(staged);
                Some(match d {
                    Deferred::Response { call, bulk, .. } => {
                        Deferred::Response { call, staged, bulk }
                    }
                    Deferred::Status { call, code, .. } => Deferred::Status { call, staged, code },
                })
            }
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

    /// Sends the terminal frames that wait, while credit allows. A spilled one that finds
    /// no send slot yet lets those behind it (which hold theirs) go first: they belong to
    /// other calls, and their completions are what frees slots.
    pub(super) fn flush_deferred(&mut self) {
        for _ in 0..self.deferred.len() {
            let Some(d) = self.deferred.pop_front() else {
                break;
            };
            match self.try_commit(d) {
                None => {}
                Some(
                    back @ (Deferred::Response {
                        staged: Body::Spilled(_),
                        ..
                    }
                    | Deferred::Status {
                        staged: Body::Spilled(_),
                        ..
                    }),
                ) => self.deferred.push_back(back),
                Some(back) => {
                    self.deferred.push_front(back);
                    break;
                }
            }
        }
    }

    /// Forgets a call without a terminal frame (cancelled, expired, replaced).
    pub(super) fn end_call(&mut self, call: CallId) {
        self.stat_end(call, crate::Code::Cancelled, None);
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
            // A pending payload with no READ in flight: its buffer is ours again.
            c.reading = None;
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
