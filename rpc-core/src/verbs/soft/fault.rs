//! Fault injection for tests: test hooks on soft objects. They change nothing unless called,
//! and cost nothing on the data path (one relaxed load of the delay word in `post_send`, and
//! one of the armed count per one-sided transfer the RPC layer posts: [`arm_one_sided`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::layout::{self, qp_in, rcqe};
use super::{SoftCq, SoftQp, SoftSrq};

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

/// Delays the responses to the RDMA READs and atomics posted on `qp` from now on by `d` (zero:
/// no delay), as a slow responder would: the READ's data is fetched and its completion
/// reported no sooner than `d` after posting, while later requests *without*
/// [`SendFlags::FENCE`](crate::verbs::SendFlags::FENCE) are executed at once (their
/// completions still come in order, after the READ's). A FENCEd request waits for every READ
/// and atomic before it. This is the hazard real RNICs have: a SEND of a buffer a READ is
/// filling may carry the old bytes unless it is fenced.
pub fn delay_read_responses(qp: &SoftQp, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    qp.s.read_delay_ns.store(ns, Ordering::Relaxed);
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
    // The claim word now points past the slot, as a peer that consumed it would leave it.
    s.dev
        .in64(layout::qp_in_entry(slot_of(qp)) + qp_in::RQ_CLAIM)
        .store(layout::claim_word(idx.wrapping_add(1), 0), Ordering::SeqCst);
    s.ring_recv_for_fault();
    true
}

/// Writes garbage into the oldest posted, unconsumed receive of `qp` (its SGE count and first
/// lkey), as a malicious owner could: the peer's SEND must fail cleanly (`REM_OP_ERR` for the
/// sender, an error completion for this receive). Returns false when nothing is posted.
pub fn corrupt_posted_recv(qp: &SoftQp) -> bool {
    qp.s.corrupt_wqe_for_fault()
}

/// How far a peer got with a claim of a shared receive queue's receive ([`claim_srq_recv`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SrqClaim {
    /// Its compare-and-swap on the claim word is done, its naming store in the completion
    /// slot is not: a peer that died right there, or a live one descheduled right there.
    Swapped,
    /// It named its claim in the completion slot too: a peer that died copying the message.
    Named,
}

/// Claims the next posted receive of `srq` as the peer of `qp` would (with the peers' claim
/// protocol, naming the claim before it in passing), got as far as `stage`, and goes no
/// further: it never completes the receive. Whether that is a dead peer's claim or a live
/// one's in progress is up to the test (see [`fake_peer_death`]). Returns false when nothing
/// is posted.
pub fn claim_srq_recv(srq: &SoftSrq, qp: &SoftQp, stage: SrqClaim) -> bool {
    let rq = &srq.rq;
    let me = qp.s.qp_num;
    let claim = rq.claim();
    let c = loop {
        let w = claim.load(Ordering::Acquire);
        let c = layout::claim_index(w);
        if rq.next_unclaimed().is_none() {
            return false;
        }
        let next = super::qp::shared_claim_next(w, me, |i| rq.name(i));
        if claim
            .compare_exchange(w, next, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            break c;
        }
    };
    if stage == SrqClaim::Named {
        rq.name(c)
            .store(layout::claim_word(c, me), Ordering::Release);
    }
    true
}

/// Sets every bit of `cq`'s ready bitmap, as garbage from a peer would: `poll` must ignore the
/// bits no QP owns.
pub fn corrupt_ready_bitmap(cq: &SoftCq) {
    cq.shared.corrupt_bitmap_for_fault();
}

/// One-sided operations of the RPC layer that [`arm_one_sided`] can fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum OneSided {
    /// A client's RDMA READ of a rendezvous response or stream message.
    ClientRead = 1,
    /// A server's RDMA READ of a rendezvous request or stream message.
    ServerRead = 2,
    /// A server's RDMA WRITE of a response into a landing zone.
    ServerWrite = 3,
    /// A handler's one-sided bulk operation (`Peer::read` / `Peer::write`).
    HandlerBulk = 4,
}

/// What an armed [`OneSided`] fault does to its QP right before the operation is posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OneSidedFault {
    /// [`force_error`]: the operation (and everything after it) completes with `WR_FLUSH_ERR`.
    Flush,
    /// [`delay_completions`] by this much, from this operation on: it stays posted, in the
    /// NIC's hands, until then.
    Delay(Duration),
}

static ARMED_OP: AtomicU32 = AtomicU32::new(0);
static ARMED_LEFT: AtomicU32 = AtomicU32::new(0);
/// `u64::MAX`: flush; otherwise a delay in nanoseconds.
static ARMED_FAULT: AtomicU64 = AtomicU64::new(0);

/// Process-wide: the next `count` operations of kind `op` that the RPC layer posts on a soft QP
/// get `fault` first (a test binary arms one at a time). Replaces what was armed; a `count` of
/// 0 disarms.
pub fn arm_one_sided(op: OneSided, fault: OneSidedFault, count: u32) {
    let f = match fault {
        OneSidedFault::Flush => u64::MAX,
        OneSidedFault::Delay(d) => u64::try_from(d.as_nanos()).unwrap_or(u64::MAX - 1),
    };
    ARMED_LEFT.store(0, Ordering::SeqCst);
    ARMED_FAULT.store(f, Ordering::SeqCst);
    ARMED_OP.store(op as u32, Ordering::SeqCst);
    ARMED_LEFT.store(count, Ordering::SeqCst);
}

/// How many armed operations are still to come (0: none armed, or all were posted).
pub fn one_sided_left() -> u32 {
    ARMED_LEFT.load(Ordering::SeqCst)
}

/// Whether a one-sided fault is armed: the one load the RPC layer's post path pays.
#[doc(hidden)]
#[inline]
pub fn one_sided_armed() -> bool {
    ARMED_LEFT.load(Ordering::Relaxed) != 0
}

/// Called by the RPC layer right before it posts an `op` on `qp` (when [`one_sided_armed`]):
/// applies the armed fault if it is for `op` and `qp` is a soft QP.
#[doc(hidden)]
#[cold]
pub fn before_one_sided(qp: &mut dyn std::any::Any, op: OneSided) {
    let Some(qp) = qp.downcast_mut::<SoftQp>() else {
        return;
    };
    if ARMED_OP.load(Ordering::SeqCst) != op as u32 {
        return;
    }
    let took = ARMED_LEFT.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if took.is_err() {
        return;
    }
    match ARMED_FAULT.load(Ordering::SeqCst) {
        u64::MAX => force_error(qp),
        ns => delay_completions(qp, Duration::from_nanos(ns)),
    }
}

fn slot_of(qp: &SoftQp) -> usize {
    (qp.s.qp_num & ((1 << layout::QP_SLOT_BITS) - 1)) as usize
}

/// Events raised by [`raise_async_event`], for the next soft context that polls.
static ASYNC_EVENTS: std::sync::Mutex<std::collections::VecDeque<crate::verbs::AsyncEvent>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());
static ASYNC_PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Process-wide: the next soft context that polls its asynchronous events
/// ([`crate::verbs::Context::poll_async_event`]) gets `ev`, as if its device had raised it (a
/// port going down, the device failing). What an RPC server does with it can so be tested.
pub fn raise_async_event(ev: crate::verbs::AsyncEvent) {
    ASYNC_EVENTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push_back(ev);
    ASYNC_PENDING.store(true, Ordering::Release);
}

/// The oldest raised event, if any (one relaxed load when none is pending).
pub(super) fn take_async_event() -> Option<crate::verbs::AsyncEvent> {
    if !ASYNC_PENDING.load(Ordering::Relaxed) {
        return None;
    }
    let mut q = ASYNC_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    let ev = q.pop_front();
    if q.is_empty() {
        ASYNC_PENDING.store(false, Ordering::Release);
    }
    ev
}
