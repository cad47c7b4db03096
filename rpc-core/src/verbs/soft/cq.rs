//! Completion queues.
//!
//! A soft CQ does not copy completions into one ring: each QP side attached to it (the send
//! side or the receive side of a QP) keeps its own single-producer ring, and the CQ has a
//! *ready bitmap* (in the inbox, so producers in other processes can set bits) with one bit per
//! attached side, and a *summary* with one bit per bitmap word. Producers publish an entry,
//! then set the side's bit, then its word's summary bit; [`SoftCq::poll`] swaps the summary to
//! zero, then the bitmap words it names, and drains the rings those name: a poll reads a few
//! words whatever the number of sides (a shard's CQ serves a send side per connection). No
//! producer ever claims a slot it might fail to fill, so a producer process that dies mid-way
//! cannot wedge the CQ.
//!
//! - Send-side completions are produced by whoever executes the QP's work requests (the
//!   thread in `post_send`, or a poller retrying queued work) into a ring in private memory.
//! - Receive-side completions are produced by the peer that consumed the receive (in another
//!   process or not) into a ring in our inbox, in the slot of the receive it consumed; the
//!   poller validates every field (the peer may have written garbage).
//! - A shared receive queue is one side of its receive CQ: its completion ring is filled by
//!   the peers of all its QPs, each entry naming the QP it arrived on.
//!
//! # Overrun is prevented by sizing
//!
//! [`Pd::create_qp`](crate::verbs::Pd::create_qp) fails with
//! [`ErrorKind::ExceedsCaps`] when a CQ's capacity is
//! smaller than the sum of the queue depths of the QP sides attached to it (`max_send_wr` for
//! each QP using it as send CQ, `max_recv_wr` for each using it as receive CQ). A work
//! request's queue slot is released only when its completion is *polled* (for unsignaled
//! sends: when a later completion of the same QP is polled), so a QP can never have more
//! completions waiting than its depth, and the CQ never overruns.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::channel::{ChannelInner, SoftCompChannel};
use super::layout::{self, cq_in, summary_of};
use super::qp::{QpShared, Rq};
use super::{CAPS, Device};
use crate::verbs::{Cq, ErrorKind, Result, Verb, VerbsError, Wc};

/// Shared part of a CQ: what producers (QPs, peers) need.
#[derive(Debug)]
pub(crate) struct CqShared {
    pub(crate) dev: Arc<Device>,
    pub(crate) slot: u32,
    /// Capacity (grows with `resize`; read under `reserved`).
    cap: AtomicU32,
    /// Completions the attached QP sides can generate (sum of their depths).
    reserved: Mutex<u64>,
    /// Offset of our inbox entry (armed word, ready bitmap).
    entry: usize,
    bits: Mutex<Vec<u32>>,
    next_bit: AtomicU32,
    /// QP send sides with queued (RNR/delayed) work: bit per side, in private memory.
    pending: Box<[AtomicU64]>,
    pub(crate) pending_count: AtomicU32,
    pub(crate) channel: Option<Arc<ChannelInner>>,
}

impl CqShared {
    /// Sets `bit` in the ready bitmap and rings the channel when the CQ is armed for this kind
    /// of completion.
    #[inline]
    pub(crate) fn set_ready(&self, bit: u32, solicited: bool) {
        let ready = layout::ReadyBit::new(self.slot as usize, bit as usize);
        if ready.raise(|o| self.dev.in64(o), |o| self.dev.in32(o), solicited)
            && let Some(ch) = &self.channel
        {
            ch.wake();
        }
    }

    /// Capacity in completions.
    pub(crate) fn cap(&self) -> u32 {
        self.cap.load(Ordering::Acquire)
    }

    /// Test hook: every bit of the ready bitmap set.
    pub(crate) fn corrupt_bitmap_for_fault(&self) {
        for w in 0..layout::CQ_WORDS {
            self.dev
                .in64(layout::cq_bitmap_word(self.slot as usize, w))
                .store(u64::MAX, Ordering::SeqCst);
        }
        for i in 0..layout::CQ_SUMMARY_WORDS {
            self.dev
                .in64(layout::cq_summary_word(self.entry, i))
                .store(u64::MAX, Ordering::SeqCst);
        }
    }

    /// Offset of the ready-bitmap word holding `bit` (what a peer needs to set it).
    pub(crate) fn bitmap_word(&self, bit: u32) -> usize {
        layout::cq_bitmap_word(self.slot as usize, bit as usize / 64)
    }

    /// Offset of the armed word.
    pub(crate) fn armed_word(&self) -> usize {
        self.entry + cq_in::ARMED
    }

    /// Marks the send side `bit` as having queued work (retried by `poll`).
    pub(crate) fn mark_pending(&self, bit: u32) {
        self.pending[bit as usize / 64].fetch_or(1u64 << (bit % 64), Ordering::SeqCst);
    }

    /// Clears the pending mark of `bit`.
    pub(crate) fn clear_pending(&self, bit: u32) {
        self.pending[bit as usize / 64].fetch_and(!(1u64 << (bit % 64)), Ordering::SeqCst);
    }

    /// Reserves room for `n` more completions; false when the CQ is too small.
    pub(crate) fn reserve(&self, n: u64) -> std::result::Result<(), u64> {
        let mut r = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        if *r + n > u64::from(self.cap()) {
            return Err(*r + n);
        }
        *r += n;
        Ok(())
    }

    /// Capacity not reserved yet.
    pub(crate) fn room(&self) -> u32 {
        let r = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        u64::from(self.cap()).saturating_sub(*r) as u32
    }

    /// Releases a reservation.
    pub(crate) fn unreserve(&self, n: u64) {
        let mut r = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        *r = r.saturating_sub(n);
    }

    /// A free bit of the ready bitmap, or `None` when the CQ serves the maximum of sides.
    pub(crate) fn alloc_bit(&self) -> Option<u32> {
        let mut free = self.bits.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = free.pop() {
            return Some(b);
        }
        let b = self.next_bit.load(Ordering::Relaxed);
        if b as usize >= layout::CQ_BITS {
            return None;
        }
        self.next_bit.store(b + 1, Ordering::Release);
        Some(b)
    }

    /// Returns `bit` (its side was destroyed).
    pub(crate) fn free_bit(&self, bit: u32) {
        self.clear_pending(bit);
        let w = self.bitmap_word(bit);
        self.dev
            .in64(w)
            .fetch_and(!(1u64 << (bit % 64)), Ordering::SeqCst);
        self.bits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(bit);
    }
}

impl Drop for CqShared {
    fn drop(&mut self) {
        // The slot's next CQ finds its bitmap clear: the words past the head that this one's
        // sides used are cleared here, not every word at creation (which would touch a page
        // of the tail for every CQ made). A peer's late ring may still set a bit: a ready bit
        // is a hint, and a spurious one costs its poll one look at an empty ring.
        let words = (self.next_bit.load(Ordering::Acquire) as usize).div_ceil(64);
        for w in 1..words.min(layout::CQ_WORDS) {
            self.dev
                .in64(layout::cq_bitmap_word(self.slot as usize, w))
                .store(0, Ordering::Relaxed);
        }
        self.dev.cq_slots.free(self.slot);
    }
}

/// What a bit stands for: a QP's send or receive side, or a shared receive queue.
#[derive(Debug)]
enum Side {
    Send(Arc<QpShared>),
    Recv(Arc<QpShared>),
    Srq(Arc<Rq>),
}

impl Side {
    /// Whether its owner is gone (then the CQ lets go of it).
    fn is_gone(&self) -> bool {
        match self {
            Side::Send(qp) | Side::Recv(qp) => qp.is_destroyed(),
            // Dropped by its user and used by no QP: only this reference is left.
            Side::Srq(rq) => {
                rq.srq
                    .as_ref()
                    .is_some_and(|s| s.handle_dropped.load(Ordering::Acquire))
                    && Arc::strong_count(rq) == 1
            }
        }
    }
}

/// A completion queue of the soft RNIC.
///
/// Each QP side attached to it (send or receive) has its own single-producer ring; a ready
/// bitmap in shared memory (one bit per side, set by producers in any process) tells
/// [`poll`](Cq::poll) which rings to drain, so a producer that dies mid-way can never wedge the
/// CQ. `poll` also drives the retries of queued RNR work of its QPs (see the
/// [module docs](super)).
///
/// # Overrun is prevented by sizing
///
/// [`Pd::create_qp`](crate::verbs::Pd::create_qp) fails with
/// [`ErrorKind::ExceedsCaps`] when the CQ's capacity is smaller than the sum of the depths of
/// the QP sides attached to it (`max_send_wr` of each QP using it as send CQ plus `max_recv_wr`
/// of each using it as receive CQ). A queue slot is released only when its completion is
/// *polled* (unsignaled sends: when a later completion of the same QP is polled), so no QP ever
/// has more completions waiting than its depth and the CQ never overruns; there is no overrun
/// error to handle.
#[derive(Debug)]
pub struct SoftCq {
    pub(crate) shared: Arc<CqShared>,
    /// Side per bit. Only `create_qp` (through `&self`) adds; `poll` (through `&mut self`,
    /// hence never concurrently with `create_qp`) reads without locking and removes.
    sides: Mutex<Vec<Option<Side>>>,
    /// Where the next scan of the bitmap starts (fairness between sides).
    cursor: usize,
}

impl SoftCq {
    pub(crate) fn new(
        dev: &Arc<Device>,
        cqe: u32,
        channel: Option<&SoftCompChannel>,
    ) -> Result<SoftCq> {
        let verb = Verb::CreateCq;
        if cqe == 0 || cqe > CAPS.max_cqe {
            return Err(VerbsError::new(
                verb,
                ErrorKind::ExceedsCaps,
                format!(
                    "CQ size {cqe} is outside 1..={} (the soft RNIC's max_cqe)",
                    CAPS.max_cqe
                ),
            ));
        }
        if let Some(ch) = channel
            && ch.inner.dev_nonce != dev.nonce
        {
            return Err(VerbsError::new(
                verb,
                ErrorKind::WrongPd,
                "the completion channel belongs to another soft context",
            ));
        }
        let (slot, _) = dev.cq_slots.alloc().ok_or_else(|| {
            VerbsError::new(
                verb,
                ErrorKind::ExceedsCaps,
                format!("the soft RNIC has {} CQs already", layout::MAX_CQ),
            )
        })?;
        let entry = layout::cq_in_entry(slot as usize);
        dev.in32(entry + cq_in::ARMED).store(0, Ordering::Relaxed);
        // Words past the head were cleared by the slot's last CQ (see `Drop`).
        dev.in64(layout::cq_bitmap_word(slot as usize, 0))
            .store(0, Ordering::Relaxed);
        for i in 0..layout::CQ_SUMMARY_WORDS {
            dev.in64(layout::cq_summary_word(entry, i))
                .store(0, Ordering::Relaxed);
        }
        let shared = Arc::new(CqShared {
            dev: dev.clone(),
            slot,
            cap: AtomicU32::new(cqe),
            reserved: Mutex::new(0),
            entry,
            bits: Mutex::new(Vec::new()),
            next_bit: AtomicU32::new(0),
            pending: (0..layout::CQ_WORDS).map(|_| AtomicU64::new(0)).collect(),
            pending_count: AtomicU32::new(0),
            channel: channel.map(|c| c.inner.clone()),
        });
        Ok(SoftCq {
            shared,
            sides: Mutex::new(Vec::new()),
            cursor: 0,
        })
    }

    /// Attaches a QP side to `bit` (create_qp).
    pub(crate) fn attach(&self, bit: u32, qp: Arc<QpShared>, recv: bool) {
        let mut sides = self.sides.lock().unwrap_or_else(|e| e.into_inner());
        let i = bit as usize;
        if sides.len() <= i {
            sides.resize_with(i + 1, || None);
        }
        sides[i] = Some(if recv { Side::Recv(qp) } else { Side::Send(qp) });
    }

    /// Attaches a shared receive queue to `bit` (its first QP's creation).
    pub(crate) fn attach_srq(&self, bit: u32, rq: Arc<Rq>) {
        let mut sides = self.sides.lock().unwrap_or_else(|e| e.into_inner());
        let i = bit as usize;
        if sides.len() <= i {
            sides.resize_with(i + 1, || None);
        }
        sides[i] = Some(Side::Srq(rq));
    }

    /// The device this CQ belongs to.
    pub(crate) fn dev_nonce(&self) -> u64 {
        self.shared.dev.nonce
    }
}

impl Cq for SoftCq {
    fn poll(&mut self, wcs: &mut [Wc]) -> Result<usize> {
        if wcs.is_empty() {
            return Ok(0);
        }
        let shared = &*self.shared;
        let sides = self.sides.get_mut().unwrap_or_else(|e| e.into_inner());
        let words = (shared.next_bit.load(Ordering::Acquire) as usize).div_ceil(64);

        // Queued send work (RNR, not-ready peer, delay) is retried from here.
        if shared.pending_count.load(Ordering::Relaxed) != 0 {
            let now = super::shm::now_ns();
            for w in 0..words {
                let mut bits = shared.pending[w].load(Ordering::Acquire);
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if let Some(Some(Side::Send(qp))) = sides.get(w * 64 + b) {
                        qp.progress_pending(now);
                    }
                }
            }
        }

        // Sides are drained from the one after the side that filled the last full batch
        // (`cursor`, a bit index), so that a side with many completions waiting (an SRQ fed
        // by many QPs) cannot starve the sides after it: a full batch resumes where it
        // stopped, as an RNIC's CQ hands out completions in the order they came.
        let mut n = 0;
        let start = if words == 0 {
            0
        } else {
            self.cursor % (words * 64)
        };
        let (start_word, start_bit) = (start / 64, start % 64);
        // Take the summary (the words that may have bits), then those words, from the start
        // word on and around.
        let summary_at = |i: usize| shared.dev.in64(layout::cq_summary_word(shared.entry, i));
        let mut summary = [0u64; layout::CQ_SUMMARY_WORDS];
        let mut any = 0;
        for (i, sum) in summary.iter_mut().enumerate().take(words.div_ceil(64)) {
            let at = summary_at(i);
            if at.load(Ordering::Relaxed) != 0 {
                *sum = at.swap(0, Ordering::AcqRel);
                any |= *sum;
            }
        }
        // Word 0 has no summary bit (see `summary_of`): it is looked at every time.
        if shared
            .dev
            .in64(layout::cq_bitmap_word(shared.slot as usize, 0))
            .load(Ordering::Relaxed)
            != 0
        {
            summary[0] |= 1;
            any |= 1;
        }
        if any == 0 {
            return Ok(0);
        }
        let mark = |w: usize| {
            if let Some((sw, sb)) = summary_of(w) {
                shared
                    .dev
                    .in64(shared.entry + sw)
                    .fetch_or(sb, Ordering::AcqRel);
            }
        };
        for (lo, hi) in [(start_word, words), (0, start_word)] {
            let mut from = lo;
            while let Some(w) = take_lowest(&mut summary, from, hi) {
                from = w + 1;
                let word = shared
                    .dev
                    .in64(layout::cq_bitmap_word(shared.slot as usize, w));
                if word.load(Ordering::Relaxed) == 0 {
                    continue;
                }
                let all = word.swap(0, Ordering::AcqRel);
                // The start word from the start bit, its lower bits last.
                let low = if w == start_word { start_bit } else { 0 };
                let high = all & (u64::MAX << low);
                let parts = [high, all & !high];
                for (p, &part) in parts.iter().enumerate() {
                    let mut bits = part;
                    while bits != 0 {
                        let b = bits.trailing_zeros() as usize;
                        let mask = 1u64 << b;
                        bits &= !mask;
                        let idx = w * 64 + b;
                        let Some(slot) = sides.get_mut(idx) else {
                            continue; // a bit nobody owns: garbage from a peer, ignore
                        };
                        let Some(side) = slot.as_ref() else {
                            continue;
                        };
                        if side.is_gone() {
                            *slot = None; // drops our reference; the owner frees its bits and slots
                            continue;
                        }
                        let (got, more) = match side {
                            Side::Recv(qp) => qp.drain_recv(&mut wcs[n..]),
                            Side::Send(qp) => qp.drain_send(&mut wcs[n..]),
                            Side::Srq(rq) => rq.drain(&mut wcs[n..], None),
                        };
                        n += got;
                        if more {
                            word.fetch_or(mask, Ordering::AcqRel);
                            mark(w);
                        }
                        if n == wcs.len() {
                            // A full batch: what it did not reach stays for the next poll.
                            let rest = bits | parts.get(p + 1).copied().unwrap_or(0);
                            if rest != 0 {
                                word.fetch_or(rest, Ordering::AcqRel);
                                mark(w);
                            }
                            summary[0] &= !1;
                            for (i, &sum) in summary.iter().enumerate() {
                                if sum != 0 {
                                    summary_at(i).fetch_or(sum, Ordering::AcqRel);
                                }
                            }
                            self.cursor = idx + 1;
                            return Ok(n);
                        }
                    }
                }
            }
        }
        Ok(n)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.shared.channel.is_none() {
            return Err(VerbsError::new(
                Verb::ReqNotifyCq,
                ErrorKind::InvalidArgument,
                "req_notify on a CQ created without a completion channel",
            ));
        }
        let armed = self.shared.dev.in32(self.shared.armed_word());
        armed.store(if solicited_only { 2 } else { 1 }, Ordering::SeqCst);
        Ok(())
    }

    fn capacity(&self) -> u32 {
        self.shared.cap()
    }

    fn room(&self) -> u32 {
        self.shared.room()
    }

    fn resize(&mut self, cqe: u32) -> Result<()> {
        // A soft CQ holds no entries of its own (each side has its ring): its capacity is
        // the admission bound only.
        let _r = self
            .shared
            .reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        crate::verbs::check_resize(self.shared.cap(), cqe, CAPS.max_cqe)?;
        self.shared.cap.store(cqe, Ordering::Release);
        Ok(())
    }
}

/// Takes (clears and returns) the lowest bitmap word in `from..to` whose summary bit is set.
fn take_lowest(summary: &mut [u64], from: usize, to: usize) -> Option<usize> {
    let mut i = from / 64;
    while i * 64 < to {
        let mut bits = *summary.get(i)?;
        if i == from / 64 {
            bits &= u64::MAX << (from % 64);
        }
        if bits != 0 {
            let w = i * 64 + bits.trailing_zeros() as usize;
            if w >= to {
                return None;
            }
            summary[i] &= !(1u64 << (w % 64));
            return Some(w);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::Soft;
    use crate::verbs::{
        Access, ConnectAttr, Context, Mr, Pd, Provider, Qp, QpCaps, RecvWr, SendFlags, SendWr,
        WcStatus, WrOp,
    };

    #[test]
    fn take_lowest_walks_the_summary_in_order_within_bounds() {
        let mut s = [0u64; 3];
        assert_eq!(summary_of(0), None, "word 0 is read every time");
        for w in [3, 64, 70, 129] {
            let (off, bit) = summary_of(w).unwrap();
            s[(off - cq_in::SUMMARY) / 8] |= bit;
        }
        assert_eq!(take_lowest(&mut s, 65, 130), Some(70));
        assert_eq!(take_lowest(&mut s, 71, 129), None, "129 is past the end");
        assert_eq!(take_lowest(&mut s, 71, 130), Some(129));
        assert_eq!(take_lowest(&mut s, 0, 65), Some(3));
        assert_eq!(take_lowest(&mut s, 4, 65), Some(64));
        assert_eq!(s, [0, 0, 0], "each word taken once");
        assert_eq!(take_lowest(&mut s, 0, 192), None);
    }

    /// More sides than one summary word covers (64 bitmap words: 4096 sides), polled in
    /// small batches: every completion arrives once, wherever its side's bit is.
    #[test]
    fn thousands_of_sides_on_one_cq_each_completion_once() {
        const PAIRS: usize = 1100; // 2200 QPs, a send and a receive side each: 4400 bits
        let ctx = Soft::open(None).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq((PAIRS * 4) as u32, None).unwrap();
        let caps = QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let attr = ConnectAttr::default();
        let mut qps: Vec<_> = (0..2 * PAIRS)
            .map(|_| {
                let mut q = pd.create_qp(&cq, &cq, caps).unwrap();
                q.modify_to_init(attr.access).unwrap();
                q
            })
            .collect();
        for i in 0..PAIRS {
            let (a, b) = (qps[2 * i].endpoint(), qps[2 * i + 1].endpoint());
            qps[2 * i].connect(&b, &attr).unwrap();
            qps[2 * i + 1].connect(&a, &attr).unwrap();
        }
        let mr = pd.alloc_mr(PAIRS * 16, Access::ALL).unwrap();
        for i in 0..PAIRS {
            let sge = [mr.sge(i * 16 + 8, 8).unwrap()];
            let wr = RecvWr {
                wr_id: (2 * i + 1) as u64,
                sg_list: &sge,
            };
            // SAFETY: `mr` outlives every work request (all are polled below).
            unsafe { qps[2 * i + 1].post_recv(std::slice::from_ref(&wr)) }.unwrap();
        }
        for i in (0..PAIRS).rev() {
            let sge = [mr.sge(i * 16, 8).unwrap()];
            let wr = SendWr {
                wr_id: (2 * i) as u64,
                op: WrOp::Send,
                sg_list: &sge,
                flags: SendFlags::SIGNALED,
            };
            // SAFETY: as above.
            unsafe { qps[2 * i].post_send(std::slice::from_ref(&wr)) }.unwrap();
        }
        let mut seen = vec![false; 2 * PAIRS];
        let mut got = 0;
        let mut wcs = [Wc::default(); 7];
        let start = std::time::Instant::now();
        while got < 2 * PAIRS {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "{got} completions"
            );
            let n = cq.poll(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                let i = wc.wr_id as usize;
                assert!(!seen[i], "completion of {i} twice");
                seen[i] = true;
            }
            got += n;
        }
        assert_eq!(cq.poll(&mut wcs).unwrap(), 0, "nothing more");
    }
}
