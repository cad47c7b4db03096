//! What a client sends: requests (eager, or READ by rendezvous before dispatch), cancels,
//! releases and stream frames; dispatch to the handler; dropping a call.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::{debug, warn};

use crate::call::{Held, Record};
use crate::link::{Control, Inbound, LinkError, Received, completion, decode_metadata};
use crate::server::call::{CallCtx, IncomingCall, Payload};
use crate::server::peer::ShardInbox;
use crate::streaming::{Inbox, Item};
use crate::trace::TraceContext;
use crate::verbs::{Provider, Wc, WcStatus};
use crate::wire::{self, BulkDesc, BulkMore, CallId, Event};
use crate::{Metadata, Status};

use super::respond::Reply;
use super::{PendingDispatch, ServerConn, Shard, SharedBuf, retire};

/// The status of a call that arrived while the server drains: it never reached a handler.
pub(crate) const NOT_EXECUTED_DRAINING: &str =
    "the server is shutting down (GoAway): the call was not executed; retry it elsewhere";

impl<P: Provider> Shard<P> {
    /// A receive completion of the shard's SRQ for pool slot `slot`: the connection is the
    /// one whose QP the completion names. Handles every frame of the slot (one, or a batch),
    /// lends the slot to user code where the pool allows, and grows the connection's window
    /// when its client ran out of data credits (see [`super::grants`]).
    pub(super) fn on_pool_recv(&mut self, wc: &Wc, slot: u32) {
        let idx = match self.qp_conn.get(&wc.qp_num) {
            Some(&i) => usize::from(i),
            None => {
                // A frame (or a flushed receive) of a connection closed meanwhile.
                self.grants.orphan_received(slot);
                self.pool.repost_later(slot);
                return;
            }
        };
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            self.grants.orphan_received(slot);
            self.pool.repost_later(slot);
            return;
        };
        let key = conn.link.key();
        if wc.status != WcStatus::Success {
            // The NIC gave the slot back unfilled (its QP failed): post it again for the
            // others. A flush is the echo of an earlier failure; anything else fails the
            // connection.
            self.pool.repost_later(slot);
            if let Err(e) = completion(wc) {
                warn!("connection failed: {e}");
                self.close_failed(key, &e.status());
            }
            return;
        }
        // SAFETY: this is the completion of the RECV posted for `slot` (its wr_id says so and
        // it was polled); the slot is not posted again until the guard drops.
        let Some(guard) = (unsafe { self.pool.recv_slot(slot, wc.byte_len) }) else {
            let e = LinkError::Protocol("receive completion for an unknown pool slot".into());
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
            return;
        };
        self.grants.received(slot, key);
        conn.idle_since = None;
        self.pool.open(slot, self.grants.allowance());
        let mut cur = None;
        let r = match conn.link.on_slot(wc, guard, &mut cur) {
            Ok(()) => self.on_frames(idx, &mut cur),
            Err(e) => Err(e),
        };
        // What a frame that failed left of itself goes before the slot closes.
        drop(cur);
        let lent = self.pool.close();
        if let Err(e) = r {
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
            return;
        }
        if let Some(Some(conn)) = self.conns.get_mut(idx)
            && conn.link.key() == key
        {
            if lent && let Err(e) = self.grants.lent_out(slot, &mut conn.link.wire) {
                warn!(shard = self.id, "receive credit accounting: {e}");
            }
            self.grants.maybe_grow(&mut conn.link.wire);
        }
        // A loan or a grant took free slots: their credits need receives behind them before
        // any frame carries them.
        self.post_excess();
    }

    /// Handles `cur` and the frames after it in the same receive slot (each read into `cur`
    /// in place: see [`crate::link::Link::on_recv`]).
    fn on_frames(&mut self, idx: usize, cur: &mut Option<Received>) -> Result<(), LinkError> {
        while let Some(received) = cur {
            let inbound = match received {
                Received::Written { .. } => {
                    return Err(LinkError::Protocol(
                        "a client wrote into a server's slot".into(),
                    ));
                }
                Received::Frame(f) => f,
            };
            self.on_frame(idx, inbound)?;
            *cur = None;
            if let Some(Some(conn)) = self.conns.get_mut(idx) {
                conn.link.next_batched(cur)?;
            }
        }
        Ok(())
    }

    /// Handles one frame, in place: what keeps its bytes takes `inbound.slot`, whatever is
    /// left of it drops after.
    fn on_frame(&mut self, idx: usize, inbound: &mut Inbound) -> Result<(), LinkError> {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return Ok(());
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
                pending,
                landing,
                replaced,
            } => {
                if let Some(old) = replaced {
                    self.drop_call(idx, old);
                }
                let draining = self.stop.load(Ordering::Acquire);
                let Some(Some(conn)) = self.conns.get_mut(idx) else {
                    return Ok(());
                };
                let metadata = if draining {
                    // Sent before the client saw our GoAway: refused unexecuted, so the client
                    // may safely send it elsewhere.
                    Err(None)
                } else {
                    let bytes = inbound.slot.as_ref().map_or(&[][..], |s| s.bytes());
                    decode_metadata(bytes.get(inbound.metadata.clone()).unwrap_or_default())
                        .map_err(Some)
                };
                let metadata = match metadata {
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
                        match st {
                            Some(st) => conn.fail(call, &st),
                            None => conn.refuse_not_executed(call, NOT_EXECUTED_DRAINING),
                        }
                        return Ok(());
                    }
                };
                let Some(sc) = conn.calls.get_mut(call.slot() as usize) else {
                    return Err(LinkError::Protocol(
                        "call slot beyond the call table".into(),
                    ));
                };
                let inbox = kind.client_streams().then(|| {
                    let cfg = conn.link.wire.config();
                    let inbox = Inbox::new(cfg.stream_window, cfg.stream_window_max);
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
                    drop(inbound.slot.take());
                    let head = (method_id, metadata, deadline_at);
                    self.start_read(idx, call, head, desc, bulk_more, pending);
                } else {
                    let payload = Payload::Slot {
                        start: inbound.payload.start,
                        end: inbound.payload.end,
                        slot: inbound.take_slot()?,
                    };
                    self.dispatch(idx, call, method_id, payload, metadata, deadline_at);
                }
            }
            Event::Cancel { call } => {
                drop(inbound.slot.take());
                self.drop_call(idx, call);
            }
            Event::BulkReady { call, ready } => {
                drop(inbound.slot.take());
                if let Some(p) = conn.slot(call).and_then(|c| c.reading.as_mut()) {
                    p.ready = ready;
                    self.read_more(idx, call);
                }
            }
            Event::BulkRelease { call } => {
                // Only for this very call: a late release of an earlier call in the same slot
                // must not free the buffer the current call lent.
                if let Some(c) = conn.slot(call) {
                    if !c.stream_bulks.release() {
                        c.resp_bulk = None;
                    } else if std::mem::take(&mut c.blocked)
                        && let Some(t) = c.task
                    {
                        // A stream that waited for its loans may go on.
                        self.tasks.wake(t);
                    }
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
            Event::StreamMessage {
                call, bulk, packed, ..
            } => {
                let held = match bulk {
                    Some(desc) => {
                        drop(inbound.slot.take());
                        Held::Bulk(desc)
                    }
                    None => Held::Item(Item::from_frame(
                        inbound.take_slot()?,
                        inbound.payload.clone(),
                        packed,
                    )),
                };
                conn.stream_in(call, held)?;
            }
            Event::EndOfStream { call } => {
                drop(inbound.slot.take());
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
            Event::Surrendered { credits } => self.grants.surrendered(credits),
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
    /// the other) into one bulk buffer and dispatches the call once every READ completed. A
    /// `pending` payload (one range) is READ as the client's BulkReady frames say its bytes
    /// are ready ([`Shard::read_more`]).
    pub(super) fn start_read(
        &mut self,
        idx: usize,
        call: CallId,
        (method, metadata, deadline_at): (u32, Metadata, Option<u64>),
        desc: BulkDesc,
        more: BulkMore,
        pending: bool,
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
        if pending {
            // Nothing is READ before a BulkReady; the codec allows one range only.
            if let Some(c) = conn.calls.get_mut(call.slot() as usize) {
                c.reading = Some(PendingDispatch {
                    buf,
                    reads_left: 0,
                    range: desc,
                    posted: 0,
                    ready: 0,
                    method,
                    metadata,
                    deadline_at,
                });
            }
            return;
        }
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
            self.close_failed(key, &e.status());
            return;
        }
        if let Some(c) = conn.calls.get_mut(call.slot() as usize) {
            c.reading = Some(PendingDispatch {
                buf,
                reads_left: 1 + more.len() as u8,
                range: desc,
                posted: total,
                ready: total,
                method,
                metadata,
                deadline_at,
            });
        }
    }

    /// READs what the client said is ready of `call`'s pending payload and is not READ yet,
    /// unless a READ of it is in flight (its completion comes back here).
    pub(super) fn read_more(&mut self, idx: usize, call: CallId) {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return;
        };
        let Some(c) = conn.calls.live(call) else {
            return;
        };
        if c.drop_after_read {
            return;
        }
        let Some(p) = c.reading.as_mut() else {
            return;
        };
        if p.reads_left > 0 || p.ready <= p.posted {
            return;
        }
        let remote = BulkDesc {
            addr: p.range.addr.wrapping_add(p.posted),
            len: p.ready - p.posted,
            rkey: p.range.rkey,
        };
        // SAFETY: the buffer stays in the call's `reading` (or is parked) until the READ's
        // completion; nothing reads the range meanwhile (the call is dispatched only once the
        // whole payload is READ).
        let r = unsafe {
            conn.link
                .post_read_at(call.slot(), &p.buf, p.posted as usize, remote)
        };
        match r {
            Ok(()) => {
                p.reads_left = 1;
                p.posted = p.ready;
            }
            Err(e) => {
                warn!("rendezvous READ failed: {e}");
                if let Some(p) = c.reading.take() {
                    conn.link.park(p.buf);
                }
                let key = conn.link.key();
                self.close_failed(key, &e.status());
            }
        }
    }

    pub(super) fn on_read_done(&mut self, idx: usize, wc: &Wc, slot: u32) -> Result<(), LinkError> {
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
        let call = c.id;
        let Some(p) = c.reading.as_mut() else {
            return Ok(());
        };
        p.reads_left = p.reads_left.saturating_sub(1);
        if p.reads_left > 0 {
            return Ok(());
        }
        if p.posted < p.range.len && !c.drop_after_read {
            // A pending payload: READ what became ready meanwhile, or wait for it.
            self.read_more(idx, call);
            return Ok(());
        }
        let Some(pending) = c.reading.take() else {
            return Ok(());
        };
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
            method,
            metadata,
            deadline_at,
            ..
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

    pub(super) fn dispatch(
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
                if let Some(table) = reply.conn.stats.as_deref() {
                    let (bytes, rendezvous) = match &payload {
                        Payload::Slot { start, end, .. } => (end - start, false),
                        Payload::Owned(b) => ((**b).as_ref().len(), true),
                    };
                    if let Some(cell) = table.cell(desc) {
                        cell.start(bytes, rendezvous);
                    }
                    if let Some(c) = reply.conn.slot(call) {
                        c.stat = Some(desc);
                        c.stat_start = now;
                    }
                }
                let inbox = reply.conn.slot(call).and_then(|c| c.inbox.clone());
                let traced = TraceContext::from_metadata(&metadata).map(|parent| {
                    let ctx = parent.child();
                    (ctx, crate::trace::server_span(desc.path, &ctx, &parent))
                });
                let (_trace, span) = match traced {
                    Some((ctx, span)) => {
                        if let Some(c) = reply.conn.slot(call) {
                            c.trace = Some(ctx);
                            c.span = span.clone();
                        }
                        (crate::trace::enter(Some(ctx)), span)
                    }
                    None => (crate::trace::enter(None), tracing::Span::none()),
                };
                let _span = span.enter();
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
                // The client names the path it called (it knows it; the frame carries only
                // the id); the server's services are not listed to whoever asks.
                debug!("unknown method id {method:#010x}");
                reply.fail(&Status::unimplemented(crate::status::UNKNOWN_METHOD));
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
    pub(super) fn drop_call(&mut self, idx: usize, call: CallId) {
        let Some(Some(conn)) = self.conns.get_mut(idx) else {
            return;
        };
        let Some(c) = conn.slot(call) else { return };
        let task = c.task.take();
        if !c.request_read_in_flight() {
            // With a READ in flight the call is retired when the READ completes.
            retire(&self.live_calls, c);
        }
        conn.end_call(call);
        if let Some(t) = task {
            self.tasks.cancel(t);
        }
    }
}

impl<P: Provider> ServerConn<P> {
    /// Delivers a client stream frame to the call's inbox, in order behind a READ in flight.
    pub(super) fn stream_in(&mut self, call: CallId, held: Held) -> Result<(), LinkError> {
        let Some(c) = self.calls.live(call) else {
            return Ok(());
        };
        c.stream
            .stream_in(&mut self.link, c.inbox.as_deref(), call, held, "client")
    }

    /// A client stream message finished its READ: deliver it, release the client's buffer, and
    /// deliver what waited behind it.
    pub(super) fn stream_read_done(&mut self, call: CallId) -> Result<(), LinkError> {
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
}
