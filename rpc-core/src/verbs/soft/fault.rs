//! Fault injection for tests: test hooks on soft objects. They change nothing unless called,
//! and cost nothing on the data path (one relaxed load of the delay word in `post_send`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::layout::{self, qp_in, rcqe};
use super::{SoftCq, SoftQp};

/// Moves `qp` to ERROR as if its peer had failed it (a fatal remote error): everything
/// outstanding and everything posted later completes with `WR_FLUSH_ERR`.
pub fn force_error(qp: &SoftQp) {
    let s = &*qp.s;
    s.dev
        .in32(layout::qp_in_entry(slot_of(qp)) + qp_in::REMOTE_ERROR)
        .store(1, Ordering::SeqCst);
    let _ = s.state();
}

/// Delays execution of the send requests posted on `qp` from now on by `d` (zero: no delay):
/// they are queued and executed (and complete) no sooner than `d` after being posted, driven
/// by later `post_send` and `Cq::poll` calls like RNR retries.
pub fn delay_completions(qp: &SoftQp, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    qp.s.delay_ns.store(ns, Ordering::Relaxed);
}

/// Makes the peer `qp` is connected to look dead, as the watchdog would when its process
/// exits: operations towards it complete with `RETRY_EXC_ERR`. Returns false when `qp` is not
/// connected. Affects every QP of this context connected to the same peer instance.
pub fn fake_peer_death(qp: &SoftQp) -> bool {
    let s = &*qp.s;
    let live = s.peer_live_for_fault();
    match live {
        Some(l) => {
            s.dev.watchdog.declare_dead(&l);
            true
        }
        None => false,
    }
}

/// Writes a garbage receive completion into `qp`'s next receive slot, as a malicious peer
/// could (valid sequence number, invalid status, opcode and length), and rings its CQ.
/// Returns false when `qp` has no posted receive to corrupt.
pub fn corrupt_recv_completion(qp: &SoftQp) -> bool {
    let s = &*qp.s;
    let Some((idx, base)) = s.next_recv_slot_for_fault() else {
        return false;
    };
    s.dev
        .in32(base + rcqe::BYTE_LEN)
        .store(u32::MAX, Ordering::Relaxed);
    s.dev
        .in32(base + rcqe::META)
        .store(0x77 | 0x03 << 8 | 0xee << 16, Ordering::Relaxed);
    s.dev
        .in32(base + rcqe::SEQ)
        .store(idx.wrapping_add(1), Ordering::Release);
    // The claim index now points past the slot, as a peer that consumed it would leave it.
    s.dev
        .in32(layout::qp_in_entry(slot_of(qp)) + qp_in::RQ_CLAIM)
        .fetch_add(1, Ordering::SeqCst);
    s.ring_recv_for_fault();
    true
}

/// Writes garbage into the oldest posted, unconsumed receive of `qp` (its SGE count and first
/// lkey), as a malicious owner could: the peer's SEND must fail cleanly (`REM_OP_ERR` for the
/// sender, an error completion for this receive). Returns false when nothing is posted.
pub fn corrupt_posted_recv(qp: &SoftQp) -> bool {
    qp.s.corrupt_wqe_for_fault()
}

/// Sets every bit of `cq`'s ready bitmap, as garbage from a peer would: `poll` must ignore the
/// bits no QP owns.
pub fn corrupt_ready_bitmap(cq: &SoftCq) {
    cq.shared.corrupt_bitmap_for_fault();
}

fn slot_of(qp: &SoftQp) -> usize {
    (qp.s.qp_num & ((1 << layout::QP_SLOT_BITS) - 1)) as usize
}
