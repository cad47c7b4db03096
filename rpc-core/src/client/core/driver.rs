//! The driver's turn: queued submissions, cancellations and grants go to the wire, completions
//! are polled, deadlines expire; calls are started, delivered to their cells and retired once
//! the server has our buffers back; a dead connection fails them all.

use crate::queue::PopIfAny;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::debug;

use crate::Status;
use crate::buf::{Taken, encode::MAX_PIECES};
use crate::call::Record;
use crate::link::{CommitError, Control, LinkError};
use crate::streaming::Inbox;
use crate::verbs::Provider;
use crate::wire::{self, BulkDesc, CallId};

use super::{ClientCore, Driver, DrvCall, Large, Lent, Outcome, Submission, overlap};
use crate::buf::BulkBuf;

impl<P: Provider> Driver<P> {
    pub(super) fn step(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        self.link.tick();
        let mut work = self.link.repost_batched(false)? as usize;
        while let Some((idx, generation)) = core.cancelled.pop_if_any() {
            work += 1;
            self.cancel_cell(core, idx, generation)?;
        }
        self.link.flush_control()?;
        work += self.start_pending(core)?;
        while self.pending.is_empty()
            && let Some((idx, generation)) = core.submitted.pop_if_any()
        {
            work += 1;
            match core.cells.get(idx).mb.take() {
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
        while let Some(ss) = core.stream_sends.pop_if_any() {
            work += 1;
            self.route_stream_send(core, ss)?;
        }
        while let Some((idx, generation, n)) = core.grants.pop_if_any() {
            work += 1;
            if core.cells.get(idx).generation.load(Ordering::Acquire) == generation
                && let Some(slot) = self.cell_slot[idx as usize]
            {
                let call = self.calls[slot as usize].id;
                self.link.control(Control::WindowUpdate(call, n))?;
            }
        }
        if !self.filling.is_empty() {
            work += self.announce_ready()?;
        }
        // What this turn queued goes out before we look for answers (one post for the lot).
        self.link.flush_sends()?;
        let n = self
            .cqs
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
        // More receive slots when the calls in flight need them (their credits go out now
        // when the server is at its reserve, else on the next request), fewer after a
        // quiet spell.
        self.link.maybe_resize_recv()?;
        self.link.maybe_credit_update()?;
        self.link.flush_sends()?;
        Ok(work)
    }

    pub(super) fn start(
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
            // Its record exists from now on (the call table is lazy): every slot the wire
            // has started, and so every slot an event or a deadline can name, is in it.
            Ok(c) if self.calls.get_mut(c.slot() as usize).is_some() => c,
            Ok(c) => {
                return Err(LinkError::Protocol(format!(
                    "the wire started a call in slot {}, beyond the call table",
                    c.slot()
                )));
            }
            Err(wire::StartError::TooManyCalls) => {
                // Calls still finishing hold wire slots: wait for them.
                self.pending.push_back((idx, generation, CallId(0), sub));
                return Ok(());
            }
            Err(e) => {
                core.arena.release_send(sub.staged.slot);
                let status = match e {
                    // The server said GoAway before this request left: it ran nowhere.
                    wire::StartError::GoingAway => {
                        Status::unavailable("server is shutting down (GoAway)").not_executed()
                    }
                    e => Status::internal(format!("cannot start call: {e}")),
                };
                self.fail_unsent(core, idx, generation, sub.inbox, status);
                return Ok(());
            }
        };
        self.send_request(core, idx, generation, call, sub)
    }

    pub(super) fn send_request(
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
        let pending = sub.large.as_ref().is_some_and(|l| l.pending.is_some());
        match self.link.commit(sub.staged, |w, pl, ml| {
            if pending {
                w.request_pending(call, ml, ranges[0], landing, now)
            } else {
                w.request_pieces(call, pl, ml, ranges, landing, now)
            }
        }) {
            Ok(()) => {
                let slot = call.slot() as usize;
                // What a large request lends (a small one lends nothing: no moves of empty
                // options for it).
                let large = sub.large.map(|l| self.lent_parts(core, call, *l));
                // In place: a DrvCall is large, and building and moving a whole one per call
                // showed up as memcpy. `retire` left it reset; it is reset here only if not.
                let Some(c) = self.calls.get_mut(slot) else {
                    return Err(LinkError::Protocol(format!(
                        "the wire started a call in slot {slot}, beyond the call table"
                    )));
                };
                if c.id != CallId(0) {
                    c.reset();
                }
                c.id = call;
                c.method = sub.method;
                c.cell = Some((idx, generation));
                if let Some((lent, landing, timed)) = large {
                    c.lent_bulk = lent;
                    c.landing = landing;
                    c.timed = timed;
                }
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

    /// What a large request's call keeps until the server is done: the buffers and windows
    /// it lends (counted as sent from the user's memory or pending), its landing zone and
    /// its timing for [`overlap`].
    fn lent_parts(
        &mut self,
        core: &ClientCore<P>,
        call: CallId,
        l: Large<P>,
    ) -> (Option<Lent<P>>, Option<BulkBuf<P>>, Option<overlap::Timed>) {
        let user = l.gathered.map(|g| {
            core.counters
                .zero_copy_request_bytes
                .fetch_add(g.referenced, Ordering::Relaxed);
            (g.window, g.user)
        });
        let user = user.or_else(|| {
            let p = l.pending?;
            core.counters
                .overlapped_request_bytes
                .fetch_add(p.fill.len(), Ordering::Relaxed);
            self.filling.push((call, p.fill, 0));
            Some((p.window, p.region))
        });
        let bulk = l.bulk;
        let lent = (bulk.is_some() || user.is_some()).then(|| Lent {
            _buf: bulk,
            _user: user,
        });
        (lent, l.landing, l.timed)
    }

    /// Tells the server how much of each pending payload the callers have written since the
    /// last BulkReady; forgets a payload once all of it was announced or its call ended.
    fn announce_ready(&mut self) -> Result<usize, LinkError> {
        let mut n = 0;
        let mut i = 0;
        while let Some((call, fill, sent)) = self.filling.get(i) {
            let (call, ready, len, sent) = (*call, fill.ready(), fill.len(), *sent);
            let live = self.link.wire.send_window(call).is_some();
            if live && ready > sent {
                self.link.control(Control::BulkReady(call, ready))?;
                self.filling[i].2 = ready;
                n += 1;
            }
            if !live || ready >= len {
                self.filling.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(n)
    }

    pub(super) fn start_pending(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
        let mut n = 0;
        while let Some((idx, generation, call, sub)) = self.pending.pop_front() {
            if core.cells.get(idx).mb.is_cancelled() {
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
    pub(super) fn deliver_cell(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
        o: Outcome<P>,
    ) {
        let cell = core.cells.get(idx);
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
    pub(super) fn fail_unsent(
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
    pub(super) fn deliver(&mut self, core: &ClientCore<P>, slot: usize, o: Outcome<P>) {
        if let Some(t) = self.calls[slot].timed.take()
            && let Some(overlap) = &core.overlap
            && !matches!(o, Outcome::Failed(_))
        {
            overlap.record(t.pending, t.len, t.started.elapsed());
        }
        if let Some((idx, generation)) = self.calls[slot].cell.take() {
            self.deliver_cell(core, idx, generation, o);
        }
    }

    /// Frees the call's wire slot and every buffer it lent (the server is done with them).
    pub(super) fn retire(&mut self, slot: usize) {
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

    pub(super) fn cancel_cell(
        &mut self,
        core: &ClientCore<P>,
        idx: u32,
        generation: u32,
    ) -> Result<(), LinkError> {
        if core.cells.get(idx).generation.load(Ordering::Acquire) != generation {
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
    pub(super) fn give_up(
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

    pub(super) fn expire(&mut self, core: &ClientCore<P>) -> Result<usize, LinkError> {
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

    pub(super) fn expire_pending(&mut self, core: &ClientCore<P>, call: CallId) {
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

    /// Fails every call of a dead connection with `status`. The QPs go to ERROR; what the
    /// calls' posted work requests name (READ targets) and what the server may still reach
    /// through our keys (lent payloads, landing zones) is parked in the link's graveyard, freed
    /// only once the QPs are destroyed (the CQ is not polled any more, so no completion would
    /// ever give it back). Send slots of posted SENDs stay taken for the same reason.
    ///
    /// The calls end with the connection's first recorded cause when there is one (a flush
    /// that followed the real failure, or a second error, does not replace it).
    pub(super) fn fail_all(&mut self, core: &ClientCore<P>, status: Status) -> usize {
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
        while let Some(ss) = core.stream_sends.pop_if_any() {
            self.discard(ss);
        }
        // Requests that were never posted (queued for a credit or a call slot, or not taken
        // from their cells yet) reached no handler: their status says so, and the channel may
        // send them elsewhere. The calls above were posted: they may have run.
        let unsent = status.clone().not_executed();
        while let Some((idx, generation, _call, sub)) = self.pending.pop_front() {
            core.arena.release_send(sub.staged.slot);
            self.fail_unsent(core, idx, generation, sub.inbox, unsent.clone());
            n += 1;
        }
        while let Some((idx, generation)) = core.submitted.pop_if_any() {
            n += 1;
            match core.cells.get(idx).mb.take() {
                Taken::Run(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    self.fail_unsent(core, idx, generation, sub.inbox, unsent.clone());
                }
                Taken::Cancelled(sub) => {
                    core.arena.release_send(sub.staged.slot);
                    core.release_cell(idx);
                }
                Taken::Empty => {}
            }
        }
        while let Some((idx, generation)) = core.cancelled.pop_if_any() {
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
