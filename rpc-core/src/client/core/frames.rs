//! What the server sends: completions, response frames (in a receive slot, in the landing
//! zone, or by rendezvous READ), stream frames, releases and the final status.

use std::sync::atomic::Ordering;

use tracing::info;

use crate::buf::RecvSlot;
use crate::call::{self, Held};
use crate::link::{
    Control, LinkError, Received, WrKind, completion, decode_response_metadata, split_wr_id,
};
use crate::streaming::Item;
use crate::verbs::{Provider, Wc};
use crate::wire::{CallId, Event, FrameKind};
use crate::{Metadata, Status};

use super::{ClientCore, Driver, Outcome};

impl<P: Provider> Driver<P> {
    pub(super) fn on_completion(&mut self, core: &ClientCore<P>, wc: &Wc) -> Result<(), LinkError> {
        let (key, kind, aux) = split_wr_id(wc.wr_id);
        if key != self.link.key() {
            return Ok(());
        }
        // Every completion goes through `completion` (a flush fails everything but RECV): a failed
        // one fails the link, and the buffers its work request named go to the link's
        // graveyard in `fail_all`, never back to a pool here.
        match kind {
            Some(WrKind::Send) => call::send_done(&mut self.link, wc, aux),
            Some(WrKind::Nop) => completion(wc),
            Some(WrKind::Recv) => {
                // Every frame of the slot (a batch), in order, before the next completion.
                let mut cur = None;
                self.link.on_recv(wc, aux, &mut cur)?;
                while let Some(r) = &mut cur {
                    match r {
                        Received::Frame(f) => self.on_frame(
                            core,
                            &f.event,
                            f.slot.take(),
                            f.metadata.clone(),
                            f.payload.clone(),
                        )?,
                        Received::Written { imm, .. } => self.on_written(core, CallId(*imm))?,
                    }
                    cur = None;
                    self.link.next_batched(&mut cur)?;
                }
                Ok(())
            }
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

    pub(super) fn on_frame(
        &mut self,
        core: &ClientCore<P>,
        event: &Event,
        slot: Option<RecvSlot>,
        md: std::ops::Range<usize>,
        payload: std::ops::Range<usize>,
    ) -> Result<(), LinkError> {
        match *event {
            Event::Response {
                call,
                bulk: Some(desc),
                ..
            } => {
                #[cfg(test)]
                self.seen_bulk.push(desc);
                let s = call.slot() as usize;
                let metadata = match slot
                    .as_ref()
                    .map(|sl| decode_response_metadata(&sl.bytes()[md]))
                {
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
                // The next call of the method lends a zone this large ([`super::sizes`]).
                core.sizes.record(self.calls[s].method, desc.len);
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
                if self.calls[s].landing.is_some() {
                    // A zone was lent for a response that came eagerly: stop lending them.
                    core.sizes.forget(self.calls[s].method);
                }
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
                        // The trailers, after the response headers when no stream message
                        // carried those.
                        if let Ok((first, second)) = Metadata::decode_sections(&bytes[md]) {
                            let trailers = match second {
                                Some(trailers) => {
                                    if let Some(inbox) = &self.calls[s].inbox {
                                        inbox.set_metadata(first);
                                    }
                                    trailers
                                }
                                None => first,
                            };
                            *st.metadata_mut() = trailers;
                        }
                        st
                    }
                    None => Status::new(crate::Code::from_u8(code), ""),
                };
                // The server's runtime may say the call reached no handler (it drains).
                let status = status.recognise_not_executed();
                drop(slot);
                if code == 0
                    && let Some(inbox) = &self.calls[s].inbox
                {
                    inbox.set_trailers(status.metadata().clone());
                }
                let end = if code == 0 { None } else { Some(status) };
                if self.calls[s].inbox.is_some() && self.calls[s].stream.busy() {
                    // Earlier stream messages are still being READ: end after them.
                    self.calls[s].end = Some(end);
                } else {
                    self.end_call(core, s, end);
                }
            }
            Event::StreamMessage {
                call, bulk, packed, ..
            } => {
                let s = call.slot() as usize;
                if self.calls[s].id != call {
                    return Ok(());
                }
                if packed > 0 {
                    core.counters.packed_frames.fetch_add(1, Ordering::Relaxed);
                    core.counters
                        .packed_messages
                        .fetch_add(u64::from(packed), Ordering::Relaxed);
                }
                if let (Some(inbox), Some(sl)) = (&self.calls[s].inbox, &slot)
                    && !md.is_empty()
                    && let Ok(m) = Metadata::decode(&sl.bytes()[md.clone()])
                {
                    inbox.set_metadata(m);
                }
                let held = match (bulk, slot) {
                    (Some(d), _) => Held::Bulk(d),
                    (None, Some(slot)) => Held::Item(Item::from_frame(slot, payload, packed)),
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
                        let cell = core.cells.get(idx);
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
                    if let Some((idx, generation)) = self.calls[s].cell {
                        let cell = core.cells.get(idx);
                        if cell.generation.load(Ordering::Acquire) == generation {
                            let _ =
                                cell.loans
                                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                        n.checked_sub(1)
                                    });
                            cell.send_waker.wake();
                        }
                    }
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
            // A server never sends Surrendered (the protocol core takes it only on a server).
            Event::CreditOnly | Event::Surrendered { .. } => {}
            Event::Request { .. }
            | Event::Cancel { .. }
            | Event::EndOfStream { .. }
            | Event::BulkReady { .. } => {
                return Err(LinkError::Protocol(
                    "server sent a client-only frame".into(),
                ));
            }
        }
        Ok(())
    }

    pub(super) fn on_written(
        &mut self,
        core: &ClientCore<P>,
        call: CallId,
    ) -> Result<(), LinkError> {
        let s = call.slot() as usize;
        let Some(c) = self.calls.get_mut(s) else {
            return Err(LinkError::Protocol(
                "landing write for an unknown call".into(),
            ));
        };
        let c_method = c.method;
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
                core.sizes.record(c_method, payload.len() as u64);
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
                self.on_frame(core, &other, None, md, payload)?;
                if self.calls[s].finishing && !self.calls[s].lends() {
                    self.retire(s);
                }
            }
        }
        Ok(())
    }

    /// The READ of the call in slot `s` completed successfully (`completion` passed: a failed or
    /// flushed READ never comes here, it fails the link).
    pub(super) fn on_read_done(&mut self, core: &ClientCore<P>, s: usize) -> Result<(), LinkError> {
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

    pub(super) fn release_peer(&mut self, call: CallId) -> Result<(), LinkError> {
        self.link.control(Control::BulkRelease(call))
    }

    /// The server's final status for the call in slot `s`: ends its stream (if any), delivers
    /// the outcome, and frees the call once the server has our buffers back.
    pub(super) fn end_call(&mut self, core: &ClientCore<P>, s: usize, end: Option<Status>) {
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
}
