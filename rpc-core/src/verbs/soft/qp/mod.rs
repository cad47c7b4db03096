//! RC queue pairs: the state machine, `post_send` (which executes work requests on the
//! caller's thread), `post_recv`, the queue of work waiting for RNR/transport retries, and the
//! two completion rings a CQ drains.
//!
//! # Send queue
//!
//! Sequence numbers: `sq_head` (next to post, written by the QP's owner), `sq_exec` (next to
//! execute) and `sq_freed` (first slot whose completion is not polled yet, written by the
//! send CQ's poller). A request whose execution must wait (RNR, peer not connected, test
//! delay) is copied into its pre-allocated slot, and so is everything posted after it (RC
//! order); whoever holds the QP's *progress flag* executes queued requests in order: the
//! thread in `post_send`, or a `Cq::poll` retrying. The flag is only ever *tried* on the fast
//! path: a `post_send` that finds it held queues its requests instead of waiting.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod rq;
mod store;

pub(crate) use rq::{Rq, SrqState, shared_claim_next};

use super::counters::QpCounters;
use super::cq::{CqShared, SoftCq};
use super::exec::{self, Conn, Outcome, WrView};
use super::layout::{self, qp, qp_in};
use super::peer::Liveness;
use super::shm;
use super::srq::srq_attach;
use super::{ACTIVE_MTU, CAPS, Device, vendor};
use crate::verbs::types;
use crate::verbs::{
    Access, ConnectAttr, Endpoint, ErrorKind, PostError, Qp, QpCaps, QpState, RecvWr, Result,
    SendFlags, SendWr, Sge, Verb, VerbsError, Wc, WcFlags, WcStatus, WrOp,
};

/// A queued send work request (fixed size; SGEs and inline bytes live in parallel arrays).
#[derive(Clone, Copy, Debug)]
struct StoredWr {
    wr_id: u64,
    op: WrOp,
    flags: SendFlags,
    nsge: u32,
    inline_len: u32,
    not_before: u64,
    /// Executed already, ahead of a delayed READ in front of it (`fault::delay_read_responses`):
    /// only its completion waits for its turn.
    early: Option<Outcome>,
}

/// A send completion in the private ring.
#[derive(Clone, Copy, Debug, Default)]
struct Scqe {
    wc: Wc,
    seq: u32,
    /// Frees queue slots without reporting a completion (reset).
    discard: bool,
}

/// What executing work requires exclusive access to (under the progress flag).
#[derive(Debug)]
struct Exec {
    conn: Option<Conn>,
    attr: ConnectAttr,
    rnr_tries: u32,
    tries: u32,
    next_retry: u64,
    /// The queue holds only delayed READs/atomics and requests executed ahead of them: an
    /// unfenced request may be executed now too (`fault::delay_read_responses`).
    overtake: bool,
}

/// Shared state of a QP: the QP handle, its CQs' pollers and retries all reach it.
#[derive(Debug)]
pub(crate) struct QpShared {
    pub(crate) dev: Arc<Device>,
    /// This QP's counters (written under the progress flag; see `counters`).
    counters: Arc<QpCounters>,
    slot: u32,
    pub(crate) qp_num: u32,
    pd: u32,
    caps: QpCaps,
    entry: usize,
    in_entry: usize,
    // send queue
    sq_cap: u32,
    sq_head: AtomicU32,
    sq_exec: AtomicU32,
    sq_freed: AtomicU32,
    /// The requests, their SGEs and inline bytes, and the send completion ring.
    store: store::SendStore,
    scq_head: AtomicU32,
    scq_tail: AtomicU32,
    progress: AtomicBool,
    exec: UnsafeCell<Exec>,
    send_cq: Arc<CqShared>,
    send_bit: u32,
    pending_marked: AtomicBool,
    /// The receive queue: our own, or the shared one we were created on.
    pub(crate) rq: Arc<Rq>,
    peer_live: Mutex<Option<Arc<Liveness>>>,
    destroyed: AtomicBool,
    /// Test hook: queued execution delay in nanoseconds.
    pub(crate) delay_ns: AtomicU64,
    /// Test hook: delay of READ and atomic responses in nanoseconds (later unfenced requests
    /// go ahead meanwhile).
    pub(crate) read_delay_ns: AtomicU64,
}

// SAFETY: the `UnsafeCell` fields are accessed under documented protocols: `exec` only by the
// holder of `progress`; the `store`'s request, SGEs and inline bytes of slot `s` written by
// the QP owner (`&mut SoftQp`, one thread) before it publishes `sq_head > s` with Release,
// read by the progress holder after an Acquire load of `sq_head`, and not rewritten until the
// slot's completion was polled; its `scq` entries written by the progress holder before a
// Release store of `scq_tail`, read by the send CQ's poller (`&mut SoftCq`, one thread) after
// an Acquire load.
unsafe impl Sync for QpShared {}

/// Exclusive access to a QP's execution state.
struct Progress<'a> {
    qp: &'a QpShared,
}

impl Progress<'_> {
    fn exec(&mut self) -> &mut Exec {
        // SAFETY: a `Progress` exists only while `qp.progress` is held by it (acquired with a
        // successful compare-exchange, released in Drop), so no other reference to `exec`
        // exists; `&mut self` prevents two from this guard.
        unsafe { &mut *self.qp.exec.get() }
    }
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        self.qp.progress.store(false, Ordering::Release);
    }
}

fn post_err(verb: Verb, posted: usize, kind: ErrorKind, detail: String) -> PostError {
    PostError {
        posted,
        error: VerbsError::new(verb, kind, detail),
    }
}

impl QpShared {
    #[inline]
    fn try_progress(&self) -> Option<Progress<'_>> {
        self.progress
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Progress { qp: self })
    }

    /// Waits for the progress flag (setup paths; a holder only executes bounded work).
    fn progress_blocking(&self) -> Progress<'_> {
        loop {
            if let Some(p) = self.try_progress() {
                return p;
            }
            std::thread::yield_now();
        }
    }

    #[inline]
    fn state_word(&self) -> &AtomicU32 {
        self.dev.pub32(self.entry + qp::STATE)
    }

    #[inline]
    fn raw_state(&self) -> QpState {
        QpState::from_u8(self.state_word().load(Ordering::Acquire) as u8).unwrap_or(QpState::Error)
    }

    /// The state, moving to ERROR first when the peer failed us.
    #[inline]
    pub(crate) fn state(&self) -> QpState {
        let s = self.raw_state();
        if matches!(s, QpState::Init | QpState::Rtr | QpState::Rts)
            && self
                .dev
                .in32(self.in_entry + qp_in::REMOTE_ERROR)
                .load(Ordering::Relaxed)
                != 0
        {
            self.enter_error(false);
            return QpState::Error;
        }
        s
    }

    fn set_state(&self, s: QpState) {
        let old = self.state_word().swap(s as u32, Ordering::SeqCst);
        self.count_errored(old, s as u32);
    }

    /// Keeps the shared receive queue's count of members in ERROR ([`SrqState::errored`])
    /// as the state moves from `old` to `new`.
    fn count_errored(&self, old: u32, new: u32) {
        let Some(st) = &self.rq.srq else { return };
        let error = QpState::Error as u32;
        if old != error && new == error {
            st.errored.fetch_add(1, Ordering::AcqRel);
        } else if old == error && new != error {
            st.errored.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Moves to ERROR (from any state when `force`, else not from RESET) and flushes.
    pub(crate) fn enter_error(&self, force: bool) {
        let w = self.state_word();
        let mut cur = w.load(Ordering::SeqCst);
        loop {
            let s = QpState::from_u8(cur as u8);
            if s == Some(QpState::Error) || (s == Some(QpState::Reset) && !force) {
                return;
            }
            match w.compare_exchange(
                cur,
                QpState::Error as u32,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(c) => cur = c,
            }
        }
        self.count_errored(cur, QpState::Error as u32);
        self.flush_rq();
        match self.try_progress() {
            Some(mut p) => self.flush_pending(&mut p),
            None => self.mark_pending(0), // the holder (or the next poll) flushes
        }
    }

    pub(crate) fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }

    // ---- send side --------------------------------------------------------------------

    /// Pushes a send completion (progress holder only).
    fn push_scqe(&self, _p: &Progress<'_>, e: Scqe) {
        let t = self.scq_tail.load(Ordering::Relaxed);
        let h = self.scq_head.load(Ordering::Acquire);
        if t.wrapping_sub(h) as usize >= self.store.scq().len() {
            // Cannot happen: every entry stands for a distinct unfreed queue slot and the ring
            // is larger than the queue. Dropping is the safe choice should it ever.
            tracing::error!(qp = self.qp_num, "soft RNIC: send completion ring overrun");
            return;
        }
        let i = t as usize & (self.store.scq().len() - 1);
        // SAFETY: slot `i` is outside `[head, tail)`, so the poller does not read it; only the
        // progress holder (us, proven by `_p`) writes entries.
        unsafe { *self.store.scq()[i].get() = MaybeUninit::new(e) };
        self.scq_tail.store(t.wrapping_add(1), Ordering::Release);
        self.counters.add_send_cqe();
        let solicited = e.wc.status != WcStatus::Success;
        self.send_cq.set_ready(self.send_bit, solicited);
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        p: &Progress<'_>,
        seq: u32,
        wr_id: u64,
        op: &WrOp,
        status: WcStatus,
        byte_len: u32,
        vendor_err: u32,
    ) {
        self.push_scqe(
            p,
            Scqe {
                wc: Wc {
                    wr_id,
                    status,
                    opcode: op.wc_opcode(),
                    flags: WcFlags::NONE,
                    byte_len,
                    imm_data: 0,
                    qp_num: self.qp_num,
                    vendor_err,
                },
                seq,
                discard: false,
            },
        );
    }

    /// Flushes every queued request with WR_FLUSH_ERR.
    fn flush_pending(&self, p: &mut Progress<'_>) {
        loop {
            let e = self.sq_exec.load(Ordering::Relaxed);
            if e == self.sq_head.load(Ordering::Acquire) {
                break;
            }
            let w = self.stored(e);
            self.complete(p, e, w.wr_id, &w.op, WcStatus::WrFlushErr, 0, 0);
            self.sq_exec.store(e.wrapping_add(1), Ordering::Release);
        }
        self.unmark_pending();
    }

    fn stored(&self, seq: u32) -> StoredWr {
        let i = seq as usize & (self.sq_cap as usize - 1);
        // SAFETY: slot `seq` was written before `sq_head` passed it (Release/Acquire) and is
        // not rewritten until its completion is polled, which requires it executed first.
        unsafe { (*self.store.wrs()[i].get()).assume_init() }
    }

    /// Copies `wr` into queue slot `seq` (owner only, before publishing `sq_head`).
    ///
    /// # Safety
    /// Inline SGEs must name readable memory (post_send contract).
    unsafe fn store(&self, seq: u32, wr: &SendWr<'_>, not_before: u64, early: Option<Outcome>) {
        let i = seq as usize & (self.sq_cap as usize - 1);
        let max_sge = self.caps.max_send_sge.max(1) as usize;
        let max_inline = self.caps.max_inline_data as usize;
        let mut inline_len = 0usize;
        if wr.flags.contains(SendFlags::INLINE) {
            for sge in wr.sg_list {
                let l = sge.length as usize;
                if l == 0 {
                    continue;
                }
                let dst = &self.store.inline()[i * max_inline + inline_len..][..l];
                // SAFETY: `dst` is `l` bytes of our inline buffer for slot `i` (inline totals
                // are checked against max_inline_data before storing); the source is caller
                // memory readable per the post_send contract. The slot is ours (see above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        sge.addr as *const u8,
                        UnsafeCell::raw_get(dst.as_ptr()),
                        l,
                    );
                }
                inline_len += l;
            }
        } else {
            for (k, sge) in wr.sg_list.iter().enumerate() {
                // SAFETY: slot `i` belongs to the owner until it publishes `sq_head`.
                unsafe { *self.store.sges()[i * max_sge + k].get() = *sge };
            }
        }
        // SAFETY: as above.
        unsafe {
            *self.store.wrs()[i].get() = MaybeUninit::new(StoredWr {
                wr_id: wr.wr_id,
                op: wr.op,
                flags: wr.flags,
                nsge: wr.sg_list.len() as u32,
                inline_len: inline_len as u32,
                not_before,
                early,
            });
        }
    }

    fn mark_pending(&self, at_ns: u64) {
        if !self.pending_marked.swap(true, Ordering::AcqRel) {
            self.send_cq.pending_count.fetch_add(1, Ordering::AcqRel);
        }
        self.send_cq.mark_pending(self.send_bit);
        if let Some(ch) = &self.send_cq.channel {
            ch.retry_at(at_ns);
        }
    }

    fn unmark_pending(&self) {
        if self.pending_marked.swap(false, Ordering::AcqRel) {
            self.send_cq.pending_count.fetch_sub(1, Ordering::AcqRel);
        }
        self.send_cq.clear_pending(self.send_bit);
        // A request queued while we were clearing must not be forgotten.
        if self.sq_exec.load(Ordering::SeqCst) != self.sq_head.load(Ordering::SeqCst) {
            self.mark_pending(0);
        }
    }

    /// Retries queued work if the progress flag is free (called by the send CQ's poll).
    pub(crate) fn progress_pending(&self, now: u64) {
        if let Some(mut p) = self.try_progress() {
            self.run_pending(&mut p, now);
        }
    }

    /// Executes queued requests in order while they are due.
    fn run_pending(&self, p: &mut Progress<'_>, now: u64) {
        loop {
            let seq = self.sq_exec.load(Ordering::Relaxed);
            if seq == self.sq_head.load(Ordering::Acquire) {
                self.unmark_pending();
                return;
            }
            match self.state() {
                QpState::Error => {
                    self.flush_pending(p);
                    return;
                }
                QpState::Rts => {}
                _ => return, // reset meanwhile: the queue was discarded
            }
            let w = self.stored(seq);
            if let Some(out) = w.early {
                // Executed ahead of the delayed READ before it: only its completion was due.
                self.settle(p, seq, w.wr_id, &w.op, w.flags, out, now);
                continue;
            }
            let due = p.exec().next_retry.max(w.not_before);
            if now < due {
                if let Some(ch) = &self.send_cq.channel {
                    ch.retry_at(due);
                }
                return;
            }
            let i = seq as usize & (self.sq_cap as usize - 1);
            let max_sge = self.caps.max_send_sge.max(1) as usize;
            let max_inline = self.caps.max_inline_data as usize;
            let sges: &[Sge] = if w.flags.contains(SendFlags::INLINE) {
                &[]
            } else {
                let s = &self.store.sges()[i * max_sge..i * max_sge + w.nsge as usize];
                // SAFETY: `UnsafeCell<Sge>` has the layout of `Sge`; the slot's SGEs were
                // written before `sq_head` was published and are not rewritten while queued.
                unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<Sge>(), s.len()) }
            };
            let inline = w.flags.contains(SendFlags::INLINE).then(|| {
                (
                    UnsafeCell::raw_get(self.store.inline()[i * max_inline..].as_ptr())
                        .cast_const(),
                    w.inline_len as usize,
                )
            });
            let view = WrView {
                op: w.op,
                flags: w.flags,
                sges,
                inline,
            };
            let out = self.run_one(p, &view);
            if !self.settle(p, seq, w.wr_id, &w.op, w.flags, out, now) {
                return;
            }
        }
    }

    /// Executes one request against the connection.
    fn run_one(&self, p: &mut Progress<'_>, view: &WrView<'_>) -> Outcome {
        let dev = &*self.dev;
        let pd = self.pd;
        match p.exec().conn.as_mut() {
            Some(c) => c.execute(dev, pd, view),
            None => Outcome::Done {
                status: WcStatus::RetryExcErr,
                byte_len: 0,
                vendor: vendor::PEER_QP_GONE,
            },
        }
    }

    /// Applies an outcome to request `seq` (already queued or about to be marked executed).
    /// Returns whether the request is finished (false: it stays queued for a retry).
    #[allow(clippy::too_many_arguments)]
    fn settle(
        &self,
        p: &mut Progress<'_>,
        seq: u32,
        wr_id: u64,
        op: &WrOp,
        flags: SendFlags,
        out: Outcome,
        now: u64,
    ) -> bool {
        let (status, byte_len, vendor_err) = match out {
            Outcome::Done {
                status,
                byte_len,
                vendor,
            } => (status, byte_len, vendor),
            Outcome::Rnr | Outcome::NotReady => {
                let rnr = out == Outcome::Rnr;
                let ex = p.exec();
                let (tries, limit, interval) = if rnr {
                    self.counters.add_rnr();
                    ex.rnr_tries += 1;
                    let lim = if ex.attr.rnr_retry >= 7 {
                        u32::MAX
                    } else {
                        u32::from(ex.attr.rnr_retry)
                    };
                    // The RNR NAK carries the responder's timer (IB 9.7.5.2.8): the peer's
                    // `min_rnr_timer`, not ours.
                    let responder = ex
                        .conn
                        .as_ref()
                        .map_or(ex.attr.min_rnr_timer, |c| c.peer_rnr_timer());
                    (ex.rnr_tries, lim, types::rnr_timer(responder))
                } else {
                    ex.tries += 1;
                    let t = ex.attr.ack_timeout().unwrap_or(ex.attr.rnr_timer());
                    (ex.tries, u32::from(ex.attr.retry_cnt.min(7)), t)
                };
                if tries <= limit {
                    let at = now.saturating_add(u64::try_from(interval.as_nanos()).unwrap_or(0));
                    ex.next_retry = at;
                    self.mark_pending(at);
                    return false;
                }
                if rnr {
                    (WcStatus::RnrRetryExcErr, 0, vendor::RNR)
                } else {
                    (WcStatus::RetryExcErr, 0, vendor::PEER_QP_GONE)
                }
            }
        };
        let ex = p.exec();
        ex.rnr_tries = 0;
        ex.tries = 0;
        ex.next_retry = 0;
        self.sq_exec.store(seq.wrapping_add(1), Ordering::Release);
        if status != WcStatus::Success || flags.contains(SendFlags::SIGNALED) {
            self.complete(p, seq, wr_id, op, status, byte_len, vendor_err);
        }
        if status != WcStatus::Success {
            self.enter_error(false);
        }
        true
    }

    /// Drains send completions into `out`; returns (count, whether more remain).
    pub(crate) fn drain_send(&self, out: &mut [Wc]) -> (usize, bool) {
        let _ = self.state();
        let mut h = self.scq_head.load(Ordering::Relaxed);
        let t = self.scq_tail.load(Ordering::Acquire);
        let mut n = 0;
        while h != t && n < out.len() {
            // SAFETY: `h` is in `[head, tail)`: written by the producer before its Release
            // store of `tail`, which we loaded with Acquire; the producer does not rewrite it
            // until we advance `head` past it.
            let e = unsafe {
                (*self.store.scq()[h as usize & (self.store.scq().len() - 1)].get()).assume_init()
            };
            if !e.discard {
                out[n] = e.wc;
                n += 1;
            }
            self.sq_freed
                .store(e.seq.wrapping_add(1), Ordering::Release);
            h = h.wrapping_add(1);
        }
        self.scq_head.store(h, Ordering::Release);
        (n, h != t)
    }
}

// ---- test hooks (see `fault`) -----------------------------------------------------------
impl QpShared {
    pub(crate) fn peer_live_for_fault(&self) -> Option<Arc<Liveness>> {
        self.peer_live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The next unclaimed receive (index, completion slot offset), if any.
    pub(crate) fn next_recv_slot_for_fault(&self) -> Option<(u32, usize)> {
        self.rq.next_unclaimed()
    }

    pub(crate) fn ring_recv_for_fault(&self) {
        self.rq.ring(true);
    }

    pub(crate) fn corrupt_wqe_for_fault(&self) -> bool {
        let Some((c, _)) = self.rq.next_unclaimed() else {
            return false;
        };
        let base = self.rq.wqe + (c & (self.rq.cap - 1)) as usize * self.rq.stride;
        self.dev.pub32(base).store(0xffff, Ordering::Release);
        self.dev
            .pub32(base + layout::WQE_HDR + 12)
            .store(0xdead_beef, Ordering::Release);
        true
    }
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // A member in ERROR leaves the shared queue's count (it can flush nothing now). Read
        // before the slot, and with it the state word, is freed.
        let state = self.state_word().load(Ordering::Acquire);
        self.count_errored(state, QpState::Reset as u32);
        self.dev.counters.retire(&self.counters);
        self.dev
            .pub32(self.entry + qp::QP_NUM)
            .store(0, Ordering::SeqCst);
        self.dev.qp_slots.free(self.slot);
        self.send_cq.unreserve(u64::from(self.caps.max_send_wr));
        if *self.pending_marked.get_mut() {
            self.send_cq.pending_count.fetch_sub(1, Ordering::AcqRel);
        }
        self.send_cq.free_bit(self.send_bit);
        // The receive queue gives its reservation and bit back when its last user goes.
    }
}

/// An RC queue pair of the soft RNIC.
#[derive(Debug)]
pub struct SoftQp {
    pub(crate) s: Arc<QpShared>,
}

fn create_err(kind: ErrorKind, detail: String) -> VerbsError {
    VerbsError::new(Verb::CreateQp, kind, detail)
}

impl SoftQp {
    /// The nonce of the peer RNIC this QP is connected to (0 before RTR).
    pub(crate) fn peer_nonce(&self) -> u64 {
        self.s
            .dev
            .pub64(self.s.entry + qp::REMOTE_NONCE)
            .load(Ordering::Relaxed)
    }

    pub(crate) fn create(
        dev: &Arc<Device>,
        pd: u32,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        caps: QpCaps,
        srq: Option<&Arc<Rq>>,
    ) -> Result<SoftQp> {
        if send_cq.dev_nonce() != dev.nonce || recv_cq.dev_nonce() != dev.nonce {
            return Err(create_err(
                ErrorKind::WrongPd,
                "a CQ belongs to another soft context than the protection domain".into(),
            ));
        }
        let over = |what: &str, v: u32, max: u32| {
            create_err(
                ErrorKind::ExceedsCaps,
                format!("{what} = {v} exceeds the soft RNIC's limit {max}"),
            )
        };
        // A QP of a shared receive queue has no receive queue of its own.
        let caps = match srq {
            Some(_) => QpCaps {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..caps
            },
            None => caps,
        };
        if caps.max_send_wr == 0 || caps.max_send_wr > CAPS.max_qp_wr {
            return Err(over("max_send_wr", caps.max_send_wr, CAPS.max_qp_wr));
        }
        if caps.max_recv_wr > CAPS.max_qp_wr {
            return Err(over("max_recv_wr", caps.max_recv_wr, CAPS.max_qp_wr));
        }
        if caps.max_send_sge > CAPS.max_sge {
            return Err(over("max_send_sge", caps.max_send_sge, CAPS.max_sge));
        }
        if caps.max_recv_sge > CAPS.max_sge {
            return Err(over("max_recv_sge", caps.max_recv_sge, CAPS.max_sge));
        }
        if caps.max_inline_data > CAPS.max_inline {
            return Err(over(
                "max_inline_data",
                caps.max_inline_data,
                CAPS.max_inline,
            ));
        }
        let sq_cap = (caps.max_send_wr + 1).next_power_of_two();
        let store = store::SendStore::new(
            sq_cap as usize,
            caps.max_send_sge.max(1) as usize,
            caps.max_inline_data as usize,
        )
        .map_err(|e| {
            create_err(
                ErrorKind::OutOfMemory,
                format!("soft RNIC: cannot map the send queue's storage ({sq_cap} entries): {e}"),
            )
        })?;
        let (scq, rcq) = (&send_cq.shared, &recv_cq.shared);
        if let Some(q) = srq {
            srq_attach(q, recv_cq)?;
        }
        // CQ overrun is prevented by sizing (an SRQ's receives count once, at its attach).
        let sizing = |cq: &CqShared, need: u64| {
            cq.reserve(need).map_err(|total| {
                create_err(
                    ErrorKind::ExceedsCaps,
                    format!(
                        "the CQ (capacity {}) cannot hold the {total} completions its QPs can \
                         generate: create it with cqe >= {total} (CQ overrun is prevented by \
                         sizing)",
                        cq.cap()
                    ),
                )
            })
        };
        if srq.is_none() && Arc::ptr_eq(scq, rcq) {
            sizing(
                scq,
                u64::from(caps.max_send_wr) + u64::from(caps.max_recv_wr),
            )?;
        } else {
            sizing(scq, u64::from(caps.max_send_wr))?;
            if srq.is_none()
                && let Err(e) = sizing(rcq, u64::from(caps.max_recv_wr))
            {
                scq.unreserve(u64::from(caps.max_send_wr));
                return Err(e);
            }
        }
        // Until the receive queue owns its reservation and bit, they are given back here.
        let unreserve = || {
            scq.unreserve(u64::from(caps.max_send_wr));
            if srq.is_none() {
                rcq.unreserve(u64::from(caps.max_recv_wr));
            }
        };
        let full = |what: &str| create_err(ErrorKind::ExceedsCaps, format!("soft RNIC: {what}"));

        let Some(send_bit) = scq.alloc_bit() else {
            unreserve();
            return Err(full(&format!(
                "the send CQ serves {} QP sides already",
                layout::CQ_BITS
            )));
        };
        let recv_bit = match srq {
            Some(q) => q.target().map_or(0, |t| t.1),
            None => {
                let Some(b) = rcq.alloc_bit() else {
                    scq.free_bit(send_bit);
                    unreserve();
                    return Err(full(&format!(
                        "the receive CQ serves {} QP sides already",
                        layout::CQ_BITS
                    )));
                };
                b
            }
        };
        let free_recv_bit = || {
            if srq.is_none() {
                rcq.free_bit(recv_bit);
            }
        };
        let Some((slot, gen_)) = dev.qp_slots.alloc() else {
            scq.free_bit(send_bit);
            free_recv_bit();
            unreserve();
            return Err(full(&format!("{} QPs exist already", layout::MAX_QP)));
        };
        let entry = layout::qp_entry(slot as usize);
        let in_entry = layout::qp_in_entry(slot as usize);
        let rq = match srq {
            Some(q) => q.clone(),
            None => {
                let (wqe_bytes, cqe_bytes) = Rq::ring_bytes(caps.max_recv_wr, caps.max_recv_sge);
                let rq_wqe = dev.pub_heap.alloc(wqe_bytes);
                let rq_cqe = dev.in_heap.alloc(cqe_bytes);
                let (Some(rq_wqe), Some(rq_cqe)) = (rq_wqe, rq_cqe) else {
                    if let Some(o) = rq_wqe {
                        dev.pub_heap.free(o, wqe_bytes);
                    }
                    if let Some(o) = rq_cqe {
                        dev.in_heap.free(o, cqe_bytes);
                    }
                    dev.qp_slots.free(slot);
                    scq.free_bit(send_bit);
                    free_recv_bit();
                    unreserve();
                    return Err(create_err(
                        ErrorKind::OutOfMemory,
                        "soft RNIC: the shared segments have no room for this queue".into(),
                    ));
                };
                let rq = Rq::new(
                    dev,
                    caps.max_recv_wr,
                    caps.max_recv_sge,
                    rq_wqe,
                    rq_cqe,
                    entry + qp::RQ_PROD,
                    in_entry + qp_in::RQ_CLAIM,
                    None,
                );
                // From here the queue gives its reservation and bit back when dropped.
                rq.set_target(rcq.clone(), recv_bit);
                Arc::new(rq)
            }
        };
        let qp_num = slot | (gen_ << layout::QP_SLOT_BITS);
        let w32 = |off: usize, v: u32| dev.pub32(entry + off).store(v, Ordering::Relaxed);
        let w64 = |off: usize, v: u64| dev.pub64(entry + off).store(v, Ordering::Relaxed);
        w32(qp::STATE, QpState::Reset as u32);
        w32(qp::ACCESS, 0);
        w32(qp::PD, pd);
        w64(qp::RQ_WQE, rq.wqe as u64);
        w64(qp::RQ_CQE, rq.cqe as u64);
        w32(qp::RQ_DEPTH, rq.cap);
        w32(qp::RQ_MAX_SGE, rq.max_sge.max(1));
        w32(qp::RECV_CQ, rcq.slot);
        w32(qp::RECV_BIT, recv_bit);
        let chan = rcq
            .channel
            .as_ref()
            .map_or(u32::MAX, |c| std::os::fd::AsRawFd::as_raw_fd(&c.efd) as u32);
        w32(qp::CHAN_FD, chan);
        w32(qp::CHAN_ID, rcq.channel.as_ref().map_or(0, |c| c.id));
        w32(qp::REMOTE_QP, 0);
        w64(qp::REMOTE_NONCE, 0);
        w32(qp::SHARED_RQ, u32::from(srq.is_some()));
        w64(qp::RQ_PROD_AT, rq.prod_off as u64);
        w64(qp::RQ_CLAIM_AT, rq.claim_off as u64);
        w32(
            qp::RNR_TIMER,
            u32::from(ConnectAttr::default().min_rnr_timer),
        );
        dev.in32(in_entry + qp_in::REMOTE_ERROR)
            .store(0, Ordering::Relaxed);
        dev.pub32(entry + qp::QP_NUM)
            .store(qp_num, Ordering::Release);

        let s = Arc::new(QpShared {
            counters: dev.counters.qp(),
            dev: dev.clone(),
            slot,
            qp_num,
            pd,
            caps,
            entry,
            in_entry,
            sq_cap,
            sq_head: AtomicU32::new(0),
            sq_exec: AtomicU32::new(0),
            sq_freed: AtomicU32::new(0),
            store,
            scq_head: AtomicU32::new(0),
            scq_tail: AtomicU32::new(0),
            progress: AtomicBool::new(false),
            exec: UnsafeCell::new(Exec {
                conn: None,
                attr: ConnectAttr::default(),
                rnr_tries: 0,
                tries: 0,
                next_retry: 0,
                overtake: false,
            }),
            send_cq: scq.clone(),
            send_bit,
            pending_marked: AtomicBool::new(false),
            rq,
            peer_live: Mutex::new(None),
            destroyed: AtomicBool::new(false),
            delay_ns: AtomicU64::new(0),
            read_delay_ns: AtomicU64::new(0),
        });
        send_cq.attach(send_bit, s.clone(), false);
        match &s.rq.srq {
            Some(st) => {
                let mut m = st.members.lock().unwrap_or_else(|e| e.into_inner());
                // Destroyed members are dropped once the list doubled since the last time:
                // amortised O(1) per QP made (an SRQ may serve tens of thousands).
                let kept = st.members_kept.load(Ordering::Relaxed);
                if m.len() >= (2 * kept).max(64) {
                    m.retain(|w| w.strong_count() > 0);
                    st.members_kept.store(m.len(), Ordering::Relaxed);
                }
                m.push(Arc::downgrade(&s));
            }
            None => recv_cq.attach(recv_bit, s.clone(), true),
        }
        Ok(SoftQp { s })
    }

    fn check_state(&self, want: QpState, verb: Verb, what: &str) -> Result<()> {
        let st = self.s.state();
        if st != want {
            return Err(VerbsError::new(
                verb,
                ErrorKind::InvalidState,
                format!("{what} needs the QP in {want:?}, it is in {st:?}"),
            ));
        }
        Ok(())
    }

    /// The byte counters of the context this QP belongs to.
    pub fn counters(&self) -> super::CounterSnapshot {
        self.s.dev.counters.snapshot()
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        let s = &*self.s;
        // Peers see the QP gone: their operations towards us fail with RETRY_EXC_ERR and
        // its endpoint is refused as stale (the slot itself is freed once the CQs let go).
        s.set_state(QpState::Error);
        s.dev.pub32(s.entry + qp::QP_NUM).store(0, Ordering::SeqCst);
        {
            let mut p = s.progress_blocking();
            p.exec().conn = None;
        }
        s.destroyed.store(true, Ordering::Release);
        // Let the CQs notice and drop their references.
        s.send_cq.set_ready(s.send_bit, false);
        s.rq.ring(false);
    }
}

impl Qp for SoftQp {
    fn qp_num(&self) -> u32 {
        self.s.qp_num
    }

    fn window_target(&self) -> crate::verbs::WindowTarget {
        crate::verbs::WindowTarget {
            device: self.s.dev.nonce,
            peer: self.peer_nonce(),
        }
    }

    fn state(&self) -> QpState {
        self.s.state()
    }

    fn caps(&self) -> QpCaps {
        self.s.caps
    }

    fn endpoint(&self) -> Endpoint {
        let d = &self.s.dev;
        Endpoint {
            provider: Endpoint::PROVIDER_SOFT,
            port: 1,
            lid: 0,
            qp_num: self.s.qp_num,
            psn: ((d.nonce ^ u64::from(self.s.qp_num)) & 0x00ff_ffff) as u32,
            mtu: ACTIVE_MTU,
            gid: exec::encode_gid(d.pid, d.pub_fd_num(), d.nonce),
            aux: 0,
        }
    }

    fn modify_to_init(&mut self, access: Access) -> Result<()> {
        self.check_state(QpState::Reset, Verb::ModifyQp, "RESET -> INIT")?;
        if !access.is_valid() {
            return Err(VerbsError::new(
                Verb::ModifyQp,
                ErrorKind::InvalidArgument,
                format!("invalid qp_access_flags {access:?}"),
            ));
        }
        let s = &*self.s;
        s.dev
            .pub32(s.entry + qp::ACCESS)
            .store(access.bits(), Ordering::Relaxed);
        s.set_state(QpState::Init);
        Ok(())
    }

    fn modify_to_rtr(&mut self, remote: &Endpoint, attr: &ConnectAttr) -> Result<()> {
        self.check_state(QpState::Init, Verb::ModifyQp, "INIT -> RTR")?;
        attr.validate()?;
        let s = &*self.s;
        let conn = Conn::connect(&s.dev, s.qp_num, remote, Arc::clone(&s.counters))?;
        *s.peer_live.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.peer.live.clone());
        s.dev
            .pub32(s.entry + qp::REMOTE_QP)
            .store(remote.qp_num, Ordering::Relaxed);
        s.dev
            .pub64(s.entry + qp::REMOTE_NONCE)
            .store(conn.peer.nonce, Ordering::Relaxed);
        s.dev
            .pub32(s.entry + qp::RNR_TIMER)
            .store(u32::from(attr.min_rnr_timer), Ordering::Relaxed);
        {
            let mut p = s.progress_blocking();
            let ex = p.exec();
            ex.conn = Some(conn);
            ex.attr = *attr;
            ex.rnr_tries = 0;
            ex.tries = 0;
            ex.next_retry = 0;
        }
        s.set_state(QpState::Rtr);
        Ok(())
    }

    fn modify_to_rts(&mut self, attr: &ConnectAttr) -> Result<()> {
        self.check_state(QpState::Rtr, Verb::ModifyQp, "RTR -> RTS")?;
        attr.validate()?;
        let s = &*self.s;
        {
            let mut p = s.progress_blocking();
            p.exec().attr = *attr;
        }
        s.set_state(QpState::Rts);
        Ok(())
    }

    fn modify_to_error(&mut self) -> Result<()> {
        let s = &*self.s;
        s.enter_error(true);
        let mut p = s.progress_blocking();
        s.flush_pending(&mut p);
        Ok(())
    }

    fn modify_to_reset(&mut self) -> Result<()> {
        let s = &*self.s;
        let mut p = s.progress_blocking();
        s.set_state(QpState::Reset);
        // Queued sends vanish without completions; their slots (and those of unsignaled
        // requests never followed by a completion) are freed through a discard entry.
        let head = s.sq_head.load(Ordering::Relaxed);
        s.sq_exec.store(head, Ordering::Release);
        if head != s.sq_freed.load(Ordering::Acquire) {
            s.push_scqe(
                &p,
                Scqe {
                    wc: Wc::default(),
                    seq: head.wrapping_sub(1),
                    discard: true,
                },
            );
        }
        s.unmark_pending();
        let ex = p.exec();
        ex.conn = None;
        ex.rnr_tries = 0;
        ex.tries = 0;
        ex.next_retry = 0;
        drop(p);
        s.flush_rq_with(layout::RCQE_DISCARD);
        *s.peer_live.lock().unwrap_or_else(|e| e.into_inner()) = None;
        s.dev
            .in32(s.in_entry + qp_in::REMOTE_ERROR)
            .store(0, Ordering::SeqCst);
        s.dev
            .pub32(s.entry + qp::REMOTE_QP)
            .store(0, Ordering::Relaxed);
        s.dev
            .pub64(s.entry + qp::REMOTE_NONCE)
            .store(0, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn post_send(&mut self, wrs: &[SendWr<'_>]) -> std::result::Result<(), PostError> {
        let s = &*self.s;
        let verb = Verb::PostSend;
        let st = s.state();
        if !matches!(st, QpState::Rts | QpState::Error) {
            return Err(post_err(
                verb,
                0,
                ErrorKind::InvalidState,
                format!("post_send needs the QP in RTS, it is in {st:?} (connect it first)"),
            ));
        }
        let mut guard = s.try_progress();
        let mut now = 0u64;
        if let Some(p) = guard.as_mut()
            && s.sq_exec.load(Ordering::Relaxed) != s.sq_head.load(Ordering::Relaxed)
        {
            now = shm::now_ns();
            s.run_pending(p, now);
        }
        let delay = s.delay_ns.load(Ordering::Relaxed);
        let read_delay = s.read_delay_ns.load(Ordering::Relaxed);
        // A list rings the peer once, at its end (see `Conn::begin_list`).
        let list = wrs.len() > 1;
        if list && let Some(c) = guard.as_mut().and_then(|p| p.exec().conn.as_ref()) {
            // Only requests executed here, in order, may use receives claimed for the list
            // (none while earlier ones wait in the queue).
            let consumers = if s.sq_exec.load(Ordering::Relaxed)
                == s.sq_head.load(Ordering::Relaxed)
                && delay == 0
                && read_delay == 0
            {
                wrs.iter().filter(|w| w.op.consumes_receive()).count()
            } else {
                0
            };
            c.begin_list(consumers);
        }
        let r: std::result::Result<(), PostError> = 'list: {
            for (i, wr) in wrs.iter().enumerate() {
                if let Err(e) = self.check_wr(wr) {
                    break 'list Err(PostError {
                        posted: i,
                        error: e,
                    });
                }
                let seq = s.sq_head.load(Ordering::Relaxed);
                if seq.wrapping_sub(s.sq_freed.load(Ordering::Acquire)) >= s.caps.max_send_wr {
                    break 'list Err(post_err(
                        verb,
                        i,
                        ErrorKind::QueueFull,
                        format!(
                            "send queue full ({} outstanding): poll completions (unsignaled requests \
                             are freed by a later signaled one), then post the rest",
                            s.caps.max_send_wr
                        ),
                    ));
                }
                let is_read = matches!(
                    wr.op,
                    WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
                );
                let queue_empty = s.sq_exec.load(Ordering::Relaxed) == seq;
                if read_delay != 0
                    && let Some(p) = guard.as_mut()
                    && s.raw_state() == QpState::Rts
                {
                    let ex = p.exec();
                    if queue_empty {
                        ex.overtake = false;
                    }
                    if is_read && (queue_empty || ex.overtake) {
                        // A slow responder: the READ waits, what follows may overtake it.
                        ex.overtake = true;
                        if now == 0 {
                            now = shm::now_ns();
                        }
                        let due = now.saturating_add(read_delay);
                        // SAFETY: forwarded post_send contract (inline SGEs readable).
                        unsafe { s.store(seq, wr, due, None) };
                        s.sq_head.store(seq.wrapping_add(1), Ordering::SeqCst);
                        s.mark_pending(due);
                        continue;
                    }
                    if !queue_empty
                        && ex.overtake
                        && !is_read
                        && !wr.flags.contains(SendFlags::FENCE)
                    {
                        let out = s.run_one(p, &WrView::direct(wr));
                        let early = match out {
                            Outcome::Done { .. } => Some(out),
                            // Waiting for the peer: it queues in order like any other.
                            Outcome::Rnr | Outcome::NotReady => {
                                p.exec().overtake = false;
                                None
                            }
                        };
                        // SAFETY: forwarded post_send contract (inline SGEs readable).
                        unsafe { s.store(seq, wr, 0, early) };
                        s.sq_head.store(seq.wrapping_add(1), Ordering::SeqCst);
                        continue;
                    }
                    if !queue_empty {
                        // A FENCEd request waits for the READs before it; so does everything
                        // behind it (RC order).
                        ex.overtake = false;
                    }
                }
                let direct = delay == 0 && queue_empty;
                match guard.as_mut() {
                    Some(p) if direct => {
                        if s.raw_state() == QpState::Error {
                            s.sq_head.store(seq.wrapping_add(1), Ordering::Release);
                            s.sq_exec.store(seq.wrapping_add(1), Ordering::Release);
                            s.complete(p, seq, wr.wr_id, &wr.op, WcStatus::WrFlushErr, 0, 0);
                            continue;
                        }
                        let out = s.run_one(p, &WrView::direct(wr));
                        if matches!(out, Outcome::Rnr | Outcome::NotReady) {
                            // SAFETY: forwarded post_send contract (inline SGEs readable).
                            unsafe { s.store(seq, wr, 0, None) };
                            s.sq_head.store(seq.wrapping_add(1), Ordering::SeqCst);
                            if now == 0 {
                                now = shm::now_ns();
                            }
                        } else {
                            s.sq_head.store(seq.wrapping_add(1), Ordering::Release);
                        }
                        s.settle(p, seq, wr.wr_id, &wr.op, wr.flags, out, now);
                    }
                    _ => {
                        if now == 0 {
                            now = shm::now_ns();
                        }
                        let not_before = if delay == 0 {
                            0
                        } else {
                            now.saturating_add(delay)
                        };
                        // SAFETY: forwarded post_send contract (inline SGEs readable).
                        unsafe { s.store(seq, wr, not_before, None) };
                        s.sq_head.store(seq.wrapping_add(1), Ordering::SeqCst);
                        // Behind a queued head we hold the flag for, the head's retry is already
                        // scheduled (and the QP marked); otherwise make the next poll run it.
                        if guard.is_none() || delay != 0 {
                            s.mark_pending(not_before);
                        }
                    }
                }
            }
            Ok(())
        };
        if list && let Some(c) = guard.as_mut().and_then(|p| p.exec().conn.as_ref()) {
            c.end_list();
        }
        r
    }

    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        // SAFETY: forwarded contract.
        unsafe { self.s.post_recv(wrs) }
    }
}

impl SoftQp {
    /// Post-time checks of a send work request (what `ibv_post_send` refuses with EINVAL).
    fn check_wr(&self, wr: &SendWr<'_>) -> Result<()> {
        let s = &*self.s;
        let bad =
            |detail: String| VerbsError::new(Verb::PostSend, ErrorKind::InvalidArgument, detail);
        if wr.sg_list.len() > s.caps.max_send_sge as usize {
            return Err(bad(format!(
                "work request {:#x} has {} SGEs, the QP was created with max_send_sge = {}",
                wr.wr_id,
                wr.sg_list.len(),
                s.caps.max_send_sge
            )));
        }
        if wr.flags.contains(SendFlags::INLINE) {
            if !matches!(
                wr.op,
                WrOp::Send
                    | WrOp::SendWithImm { .. }
                    | WrOp::Write { .. }
                    | WrOp::WriteWithImm { .. }
            ) {
                return Err(bad(format!(
                    "work request {:#x}: INLINE is only for SEND and WRITE",
                    wr.wr_id
                )));
            }
            let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if total > u64::from(s.caps.max_inline_data) {
                return Err(bad(format!(
                    "work request {:#x}: {total} inline bytes exceed max_inline_data = {}",
                    wr.wr_id, s.caps.max_inline_data
                )));
            }
        }
        if let WrOp::CompareSwap { remote_addr, .. } | WrOp::FetchAdd { remote_addr, .. } = wr.op {
            if remote_addr % 8 != 0 {
                return Err(bad(format!(
                    "work request {:#x}: atomic target {remote_addr:#x} is not 8-byte aligned",
                    wr.wr_id
                )));
            }
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(bad(format!(
                    "work request {:#x}: an atomic needs exactly one 8-byte SGE for the old value",
                    wr.wr_id
                )));
            }
        }
        Ok(())
    }
}
