//! Several queue pairs per connection (like `NCCL_IB_QPS_PER_CONNECTION`): on real fabrics a
//! single QP is served by one NIC processing unit and hashed onto one ECMP path, so striping a
//! connection's bulk traffic over more QPs spreads it over more of both.
//!
//! The link's primary QP carries every frame (SEND/RECV and the WRITE_WITH_IMM that tells the
//! peer a response landed). Its *lanes* (data QPs, connected pairwise to the peer's during the
//! handshake) carry only chunks of large one-sided transfers:
//!
//! ```text
//! transfer of len >= STRIPE_MIN, n = lanes + 1 spans of ~len/n bytes (4 KiB multiples):
//!   span 0 .. span n-2  -> lane 0 .. lane n-2   READ/WRITE chunks, last one signaled STRIPE
//!   span n-1            -> primary QP            READ/WRITE: last chunk signaled STRIPE
//!                                                WRITE_WITH_IMM: chunks posted, the last
//!                                                one (the IMM) held back
//! READ only: a lane's span, once complete, is followed on that lane by a zero-length
//!   RDMA WRITE (the *fence*, signaled STRIPE too)
//! every STRIPE completion counts down the transfer's slot; at zero:
//!   READ/WRITE      -> the transfer completes (the caller sees its original wr_id)
//!   WRITE_WITH_IMM  -> the held-back last chunk is posted on the primary QP, signaled with
//!                      the original wr_id: RC orders it after the primary's own chunks, and
//!                      the lanes' completions mean their bytes were placed, so the peer's
//!                      receive completion still means "every byte landed"
//! ```
//!
//! # Why a striped READ fences its lanes
//!
//! A READ's completion is what lets the reader tell the lender "done" (the response to a
//! request it read, a `BulkRelease` of a response), and the lender then ends the loan: it
//! deregisters the key. On one QP that order is safe: RC retransmits a READ request only
//! until the READ completes, and the "done" frame follows every copy of it on the same QP, so
//! the lender's NIC has seen them all before the frame. Across QPs nothing orders them: a
//! retransmitted copy of a lane's READ request (the requester timed out while the responses
//! were on their way, or some were lost) can reach the lender *after* the "done" frame
//! arrived on the primary QP and the key was revoked. The lender's NIC treats it as a
//! duplicate and executes it again (RC re-executes duplicate READs), finds the key gone and
//! answers with a remote access NAK, which the reader ignores (that READ already completed),
//! while the lender's lane QP enters ERROR without a completion of its own (a responder
//! error). The next striped transfer over that lane then fails or never completes. Seen on
//! Soft-RoCE between two hosts; hardware re-executes duplicate READs the same way.
//!
//! So a lane's READ span is not done when its data arrived: the reader then posts a
//! zero-length RDMA WRITE on the same lane and waits for its acknowledgement. The lender's
//! responder handles a QP's requests in order, and every copy of the READ request was sent
//! before the fence (a READ is not retransmitted once complete), so once the fence is
//! acknowledged no copy of the READ is left in flight (RoCE keeps a QP's packets in order).
//! A zero-length WRITE checks no key (IB spec C9-88) and a copy of it arriving late is only
//! acknowledged again, never executed. Cost: one more round trip on each lane, overlapped
//! with the spans still in flight. WRITEs need no fence: duplicate WRITEs are not executed.
//!
//! A transfer's local memory belongs to the NIC until every span completed, or the QPs are
//! destroyed: a failed span ends the transfer early (with its error) but not the other spans,
//! so a failed transfer's buffers wait for the QPs' destruction (see `owned`).
//!
//! No allocation or lock on this path: the slot table and the lanes are sized when the link
//! is built. A transfer that finds no free slot or not enough room on a lane's send queue
//! goes over the primary QP alone, as with one QP.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::buf::encode::MAX_PIECES;
use crate::verbs::{Caps, Provider, QpCaps, Sge, WcStatus};

/// Smallest transfer that is striped; smaller ones go over the primary QP.
pub const STRIPE_MIN: usize = 256 << 10;
/// Send-queue depth of a lane (data QP): chunks of striped transfers in flight on it.
pub const LANE_WRS: u32 = 64;
/// Most striped transfers in flight per link.
const SLOTS: usize = 64;
/// Queue sizes of a lane (data QP) next to a primary QP of `primary`'s sizes on a device of
/// `caps`: only chunks of striped transfers are posted on it, and it receives nothing.
pub fn lane_caps(primary: &QpCaps, caps: &Caps) -> QpCaps {
    QpCaps {
        max_send_wr: LANE_WRS.min(caps.max_qp_wr),
        max_recv_wr: 1,
        max_send_sge: primary.max_send_sge,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

/// Most QPs per connection, the primary included.
pub const MAX_QPS: usize = crate::verbs::MAX_QPS_PER_CONNECTION as usize;

/// The held-back last chunk of a striped WRITE_WITH_IMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Held {
    pub(super) sges: [Sge; MAX_PIECES],
    pub(super) nsge: usize,
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
    pub(super) imm: u32,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    busy: bool,
    generation: u8,
    /// The work-request id the caller gave the transfer.
    orig: u64,
    /// Signaled spans still to complete.
    remaining: u8,
    /// Work requests posted on each lane for this transfer (returned on its completion).
    wrs: [u16; MAX_QPS],
    /// The WRITE_WITH_IMM to post when every span is done.
    held: Option<Held>,
    /// READ: the lender's address and key, for the zero-length fence WRITE each lane posts
    /// after its span (see the module docs); `None` for a WRITE.
    fence: Option<(u64, u32)>,
}

const EMPTY: Slot = Slot {
    busy: false,
    generation: 0,
    orig: 0,
    remaining: 0,
    wrs: [0; MAX_QPS],
    held: None,
    fence: None,
};

/// The bookkeeping of striped transfers, apart from the QPs (unit-testable).
#[derive(Debug)]
struct Table {
    slots: Vec<Slot>,
    free: u64,
    /// Work requests in flight on each lane, and the most allowed.
    posted: [u32; MAX_QPS],
    cap: u32,
    lanes: usize,
    striped_bytes: Option<Arc<AtomicU64>>,
}

impl Table {
    fn new(lanes: usize, cap: u32, striped_bytes: Option<Arc<AtomicU64>>) -> Table {
        Table {
            slots: vec![EMPTY; SLOTS],
            free: u64::MAX,
            posted: [0; MAX_QPS],
            cap,
            lanes,
            striped_bytes,
        }
    }

    fn plan(&self, len: usize) -> Option<(usize, usize)> {
        if self.lanes == 0 || len < STRIPE_MIN {
            return None;
        }
        let n = self.lanes + 1;
        let span = len.div_ceil(n).next_multiple_of(4096);
        let used = len.div_ceil(span);
        (used >= 2).then_some((span, used))
    }

    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        orig: u64,
        len: usize,
        span: usize,
        used: usize,
        chunk: usize,
        fence: Option<(u64, u32)>,
    ) -> Option<(u32, u8)> {
        if used < 2 || used - 1 > self.lanes {
            return None;
        }
        let mut wrs = [0u16; MAX_QPS];
        for (j, w) in wrs.iter_mut().enumerate().take(used - 1) {
            let s = j * span;
            let e = (s + span).min(len);
            // A READ's lane also posts its fence.
            let n = (e - s).div_ceil(chunk) as u32 + u32::from(fence.is_some());
            if self.posted[j] + n > self.cap {
                return None;
            }
            *w = n as u16;
        }
        if self.free == 0 {
            return None;
        }
        let slot = self.free.trailing_zeros() as usize;
        self.free &= !(1u64 << slot);
        for (p, &n) in self.posted.iter_mut().zip(&wrs) {
            *p += u32::from(n);
        }
        let s = &mut self.slots[slot];
        s.busy = true;
        s.generation = s.generation.wrapping_add(1);
        s.orig = orig;
        s.remaining = 0;
        s.wrs = wrs;
        s.held = None;
        s.fence = fence;
        if let Some(c) = &self.striped_bytes {
            c.fetch_add(len as u64, Ordering::Relaxed);
        }
        Some((slot as u32, s.generation))
    }

    fn done(&mut self, aux: u32, status: WcStatus) -> StripeDone {
        let (slot, generation, lane, is_fence) = split_stripe_aux(aux);
        let Some(s) = self.slots.get_mut(slot) else {
            return StripeDone::Pending;
        };
        if !s.busy || s.generation != generation {
            return StripeDone::Pending;
        }
        // A lane's span that must now be fenced keeps one work request (the fence's).
        let fence = match s.fence {
            Some(f) if status == WcStatus::Success && !is_fence && lane > 0 => Some(f),
            _ => None,
        };
        if lane > 0 && lane <= MAX_QPS {
            let keep = u16::from(fence.is_some()).min(s.wrs[lane - 1]);
            self.posted[lane - 1] =
                self.posted[lane - 1].saturating_sub(u32::from(s.wrs[lane - 1] - keep));
            s.wrs[lane - 1] = keep;
        }
        if status == WcStatus::Success {
            s.remaining = s.remaining.saturating_sub(1);
            if let Some((remote_addr, rkey)) = fence {
                return StripeDone::Fence {
                    lane: lane - 1,
                    aux: stripe_fence_aux(aux),
                    remote_addr,
                    rkey,
                };
            }
            if s.remaining > 0 {
                return StripeDone::Pending;
            }
        }
        let (orig, held) = (s.orig, s.held.take());
        s.busy = false;
        self.free |= 1u64 << slot;
        match held {
            Some(h) if status == WcStatus::Success => StripeDone::PostHeld(orig, h),
            _ => StripeDone::Complete(orig),
        }
    }
}

/// A link's data QPs and its striped transfers in flight.
pub struct Lanes<P: Provider> {
    qps: Vec<P::Qp>,
    table: Option<Table>,
}

impl<P: Provider> std::fmt::Debug for Lanes<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("qps", &self.qps)
            .field("table", &self.table)
            .finish()
    }
}

impl<P: Provider> Default for Lanes<P> {
    fn default() -> Self {
        Lanes {
            qps: Vec::new(),
            table: None,
        }
    }
}

/// What a STRIPE completion meant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StripeDone {
    /// The transfer is not finished (or the completion is of a transfer already failed).
    Pending,
    /// Every span is done: handle the completion as the transfer's own (`wr_id`).
    Complete(u64),
    /// Every span is done and the held-back WRITE_WITH_IMM must now be posted.
    PostHeld(u64, Held),
    /// A lane's READ span is done: post the zero-length fence WRITE on lane `lane` (index
    /// among the lanes), signaled STRIPE with `aux`, at the lender's `remote_addr`/`rkey`
    /// (see the module docs). The transfer completes with the last fence.
    Fence {
        lane: usize,
        aux: u32,
        remote_addr: u64,
        rkey: u32,
    },
}

impl<P: Provider> Lanes<P> {
    /// Lanes over connected data QPs, each with a send queue of `cap` work requests;
    /// `striped_bytes` (if any) counts the bytes of striped transfers.
    pub fn new(qps: Vec<P::Qp>, cap: u32, striped_bytes: Option<Arc<AtomicU64>>) -> Lanes<P> {
        if qps.is_empty() {
            return Lanes::default();
        }
        let qps: Vec<P::Qp> = qps.into_iter().take(MAX_QPS - 1).collect();
        let table = Table::new(qps.len(), cap, striped_bytes);
        Lanes {
            qps,
            table: Some(table),
        }
    }

    /// Number of data QPs.
    pub fn len(&self) -> usize {
        self.qps.len()
    }

    /// Whether there are none (one QP per connection).
    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
    }

    /// Whether one of the data QPs has number `qp_num`.
    pub fn has_qp(&self, qp_num: u32) -> bool {
        self.qps
            .iter()
            .any(|q| crate::verbs::Qp::qp_num(q) == qp_num)
    }

    /// The data QPs, mutably.
    pub(super) fn qps_mut(&mut self) -> &mut [P::Qp] {
        &mut self.qps
    }

    /// The data QPs.
    pub(super) fn qps(&self) -> &[P::Qp] {
        &self.qps
    }

    /// How `len` bytes are cut: the span length and the number of spans (one per QP used, at
    /// least 2), or `None` when the transfer is not striped.
    pub(super) fn plan(&self, len: usize) -> Option<(usize, usize)> {
        self.table.as_ref()?.plan(len)
    }

    /// Reserves a slot for a transfer of `used` spans of `span` bytes (`len` in all) whose
    /// first `used - 1` spans go on lanes `0..used - 1` in chunks of `chunk`; `fence` (a
    /// READ's: the lender's address and key) makes each lane fence after its span (see the
    /// module docs). `None` when no slot is free or a lane's send queue has no room (the
    /// caller posts on the primary).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin(
        &mut self,
        orig: u64,
        len: usize,
        span: usize,
        used: usize,
        chunk: usize,
        fence: Option<(u64, u32)>,
    ) -> Option<(u32, u8)> {
        self.table
            .as_mut()?
            .begin(orig, len, span, used, chunk, fence)
    }

    /// Records how many signaled spans (and fences) the transfer in `slot` waits for, and
    /// the held-back WRITE_WITH_IMM if any.
    pub(super) fn armed(&mut self, slot: u32, remaining: u8, held: Option<Held>) {
        if let Some(t) = self.table.as_mut()
            && let Some(s) = t.slots.get_mut(slot as usize)
        {
            s.remaining = remaining;
            s.held = held;
        }
    }

    /// A STRIPE completion: `aux` from [`stripe_aux`], `status` its outcome. A failed span
    /// (flushed included) completes the transfer at once with its error: the caller fails the
    /// link ([`super::completion`] refuses the status) and must keep the transfer's buffers
    /// until the QPs are destroyed ([`super::Link::park`]), since the other spans may still be
    /// in flight on other QPs; their completions are then ignored.
    pub(super) fn done(&mut self, aux: u32, status: WcStatus) -> StripeDone {
        match self.table.as_mut() {
            Some(t) => t.done(aux, status),
            None => StripeDone::Pending,
        }
    }
}

/// The `aux` of a span's STRIPE work request: slot, its generation, and the QP (0: primary,
/// `j + 1`: lane `j`).
pub const fn stripe_aux(slot: u32, generation: u8, qp: usize) -> u32 {
    ((qp as u32) & 0xff) << 16 | (generation as u32) << 8 | slot
}

/// Bit of a STRIPE `aux` that marks a lane's fence (see the module docs).
const FENCE_BIT: u32 = 1 << 24;

/// The `aux` of the fence that follows the span of `aux`.
const fn stripe_fence_aux(aux: u32) -> u32 {
    aux | FENCE_BIT
}

/// Slot, generation, QP (0: primary, `j + 1`: lane `j`) and whether it is a fence.
const fn split_stripe_aux(aux: u32) -> (usize, u8, usize, bool) {
    (
        (aux & 0xff) as usize,
        (aux >> 8) as u8,
        ((aux >> 16) & 0xff) as usize,
        aux & FENCE_BIT != 0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn plans_cut_large_transfers_into_page_multiple_spans() {
        let t = Table::new(3, LANE_WRS, None);
        assert_eq!(
            t.plan(STRIPE_MIN - 1),
            None,
            "small transfers use the primary QP"
        );
        assert_eq!(t.plan(16 * MIB), Some((4 * MIB, 4)));
        // Spans are 4 KiB multiples; the last one takes the rest.
        let (span, used) = t.plan(STRIPE_MIN + 1).unwrap();
        assert_eq!(span % 4096, 0);
        assert!(span * (used - 1) <= STRIPE_MIN && span * used > STRIPE_MIN);
        assert_eq!(
            Table::new(0, LANE_WRS, None).plan(64 * MIB),
            None,
            "no lanes"
        );
        let aux = stripe_aux(63, 250, 16);
        assert_eq!(split_stripe_aux(aux), (63, 250, 16, false));
        assert_eq!(split_stripe_aux(stripe_fence_aux(aux)), (63, 250, 16, true));
    }

    #[test]
    fn a_transfer_completes_when_every_span_is_done() {
        let count = Arc::new(AtomicU64::new(0));
        let mut t = Table::new(1, LANE_WRS, Some(Arc::clone(&count)));
        let (slot, g) = t.begin(77, MIB, MIB / 2, 2, 4 * MIB, None).unwrap();
        assert_eq!(t.posted[0], 1);
        t.slots[slot as usize].remaining = 2;
        assert_eq!(
            t.done(stripe_aux(slot, g, 1), WcStatus::Success),
            StripeDone::Pending
        );
        assert_eq!(t.posted[0], 0, "the lane's work requests are returned");
        assert_eq!(
            t.done(stripe_aux(slot, g, 0), WcStatus::Success),
            StripeDone::Complete(77)
        );
        // A stale completion of a finished transfer is ignored.
        assert_eq!(
            t.done(stripe_aux(slot, g, 0), WcStatus::Success),
            StripeDone::Pending
        );
        assert_eq!(count.load(Ordering::Relaxed), MIB as u64);
    }

    #[test]
    fn a_held_write_with_imm_goes_out_after_the_lanes() {
        let mut t = Table::new(2, LANE_WRS, None);
        let (slot, g) = t.begin(5, 3 * MIB, MIB, 3, 4 * MIB, None).unwrap();
        let held = Held {
            sges: [Sge::default(); MAX_PIECES],
            nsge: 1,
            remote_addr: 4096,
            rkey: 9,
            imm: 42,
        };
        t.slots[slot as usize].remaining = 2;
        t.slots[slot as usize].held = Some(held);
        assert_eq!(
            t.done(stripe_aux(slot, g, 2), WcStatus::Success),
            StripeDone::Pending
        );
        match t.done(stripe_aux(slot, g, 1), WcStatus::Success) {
            StripeDone::PostHeld(5, h) => assert_eq!((h.imm, h.rkey), (42, 9)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_failed_span_ends_the_transfer_at_once() {
        let mut t = Table::new(2, LANE_WRS, None);
        let (slot, g) = t.begin(78, 3 * MIB, MIB, 3, 4 * MIB, None).unwrap();
        t.slots[slot as usize].remaining = 3;
        assert_eq!(
            t.done(stripe_aux(slot, g, 1), WcStatus::RemAccessErr),
            StripeDone::Complete(78)
        );
        assert_eq!(
            t.done(stripe_aux(slot, g, 2), WcStatus::WrFlushErr),
            StripeDone::Pending
        );
    }

    #[test]
    fn a_striped_read_completes_only_after_each_lane_is_fenced() {
        let mut t = Table::new(2, LANE_WRS, None);
        let fence = Some((0x1000, 7));
        let (slot, g) = t.begin(9, 3 * MIB, MIB, 3, 4 * MIB, fence).unwrap();
        assert_eq!(
            t.posted[..2],
            [2, 2],
            "each lane reserves its span and its fence"
        );
        // Three spans and two fences.
        t.slots[slot as usize].remaining = 5;
        let f = t.done(stripe_aux(slot, g, 2), WcStatus::Success);
        let StripeDone::Fence {
            lane,
            aux,
            remote_addr,
            rkey,
        } = f
        else {
            panic!("a lane's READ span asks for its fence: {f:?}");
        };
        assert_eq!((lane, remote_addr, rkey), (1, 0x1000, 7));
        assert_eq!(t.posted[1], 1, "the fence's work request stays counted");
        // The primary's span needs no fence.
        assert_eq!(
            t.done(stripe_aux(slot, g, 0), WcStatus::Success),
            StripeDone::Pending
        );
        assert_eq!(t.done(aux, WcStatus::Success), StripeDone::Pending);
        assert_eq!(t.posted[1], 0);
        let StripeDone::Fence { aux: aux0, .. } = t.done(stripe_aux(slot, g, 1), WcStatus::Success)
        else {
            panic!("lane 0 fences too");
        };
        assert_eq!(
            t.done(aux0, WcStatus::Success),
            StripeDone::Complete(9),
            "the last fence completes the READ"
        );
        assert_eq!(t.posted[..2], [0, 0]);
    }

    #[test]
    fn a_failed_fence_fails_the_read() {
        let mut t = Table::new(1, LANE_WRS, None);
        let (slot, g) = t.begin(4, MIB, MIB / 2, 2, 4 * MIB, Some((0, 1))).unwrap();
        t.slots[slot as usize].remaining = 3;
        let StripeDone::Fence { aux, .. } = t.done(stripe_aux(slot, g, 1), WcStatus::Success)
        else {
            panic!("fence expected");
        };
        assert_eq!(t.done(aux, WcStatus::RemAccessErr), StripeDone::Complete(4));
        // A failed READ span asks for no fence.
        let (slot, g) = t.begin(5, MIB, MIB / 2, 2, 4 * MIB, Some((0, 1))).unwrap();
        t.slots[slot as usize].remaining = 3;
        assert_eq!(
            t.done(stripe_aux(slot, g, 1), WcStatus::WrFlushErr),
            StripeDone::Complete(5)
        );
    }

    #[test]
    fn full_lanes_and_full_tables_fall_back_to_the_primary() {
        let mut t = Table::new(1, 2, None);
        // 12 MiB on the lane in 4 MiB chunks: 3 work requests, over the cap of 2.
        assert_eq!(t.begin(1, 24 * MIB, 12 * MIB, 2, 4 * MIB, None), None);
        let mut t = Table::new(1, LANE_WRS, None);
        for i in 0..SLOTS {
            assert!(t.begin(i as u64, MIB, MIB / 2, 2, MIB, None).is_some());
        }
        assert_eq!(
            t.begin(99, MIB, MIB / 2, 2, MIB, None),
            None,
            "no free slot"
        );
    }
}
