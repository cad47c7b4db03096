//! Buffers the NIC owns while posted (`STYLE.md` #4, eRPC's `MsgBuffer`).
//!
//! Posting a work request hands every buffer it names (a send slot, a READ target, a WRITE
//! source, a landing zone the peer writes, a handler's bulk buffer) to the NIC. It comes back
//! in exactly two ways:
//!
//! - its **completion is polled**, and [`completion`] says it succeeded (or, for a RECV, was
//!   flushed: the slot was never filled); a failed or flushed READ/WRITE/SEND/bulk operation is
//!   an error of the link, never a finished operation, and its buffers are *not* released by
//!   the completion handler (a striped transfer fails at its first failed span while other
//!   spans may still be in flight on other QPs);
//! - or the **QP is destroyed** (the drop of `P::Qp`, which the link owns): after that no
//!   work request of it can touch memory.
//!
//! Moving a QP to ERROR is not enough (an RNIC may still be processing requests until their
//! flush completions are generated). So when a link fails or a connection closes, the owner
//! moves the buffers of posted work requests into the link's [`Graveyard`], a field of
//! [`Link`](super::Link) declared after its QPs: Rust drops fields in declaration order, so the
//! graveyard (and everything in it) is dropped only after the QPs are destroyed.
//!
//! Failure and close paths only: the per-call path never parks anything (no allocation there).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{LinkError, WrKind, split_wr_id};
use crate::verbs::{Provider, Wc, WcError, WcStatus};

/// Buffers parked in a graveyard since the process started.
static PARKED: AtomicU64 = AtomicU64::new(0);
/// Parked buffers freed (after their QPs were destroyed).
static BURIED: AtomicU64 = AtomicU64::new(0);

/// Counts of buffers parked until their QP was destroyed, process-wide: test observables.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkedStats {
    /// Buffers moved into a link's graveyard (named by a posted work request, or lent to the
    /// peer, when the link failed or closed).
    pub parked: u64,
    /// Of those, freed: each after the QPs of its link were destroyed.
    pub buried: u64,
}

/// The process-wide [`ParkedStats`].
#[doc(hidden)]
pub fn parked_stats() -> ParkedStats {
    // `buried` first: a reader never sees more buried than parked.
    let buried = BURIED.load(Ordering::Acquire);
    ParkedStats {
        parked: PARKED.load(Ordering::Acquire),
        buried,
    }
}

/// Buffers that posted work requests (or the peer, through a key we advertised) may still
/// touch, kept until the link's QPs are destroyed. See the module docs.
#[derive(Default)]
pub struct Graveyard {
    parked: Vec<Box<dyn Send>>,
}

impl std::fmt::Debug for Graveyard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graveyard")
            .field("parked", &self.parked.len())
            .finish()
    }
}

impl Graveyard {
    /// Keeps `t` until the QPs are destroyed. Allocates: failure and close paths only.
    pub fn park<T: Send + 'static>(&mut self, t: T) {
        if std::mem::size_of::<T>() == 0 {
            return;
        }
        self.parked.push(Box::new(t));
        PARKED.fetch_add(1, Ordering::AcqRel);
    }

    /// How many buffers are parked.
    pub fn len(&self) -> usize {
        self.parked.len()
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        let n = self.parked.len() as u64;
        self.parked.clear();
        BURIED.fetch_add(n, Ordering::AcqRel);
    }
}

/// The one completion check of both sides: `Ok` when the work request named by `wc.wr_id`
/// finished, or when it is a RECV that was flushed (the slot was never filled: the caller
/// reposts it later or drops it with the link). Every other non-success, `WR_FLUSH_ERR`
/// included, is a failure of the link: the operation did **not** happen (a flushed READ's
/// target holds no data; a flushed WRITE's bytes were not placed).
///
/// The kind is read from the `wr_id` (the opcode of an error completion is undefined on an
/// RNIC). A flush is only ever the *first* error an owner sees when the QP failed without one
/// of its own requests failing (the peer failed it, or a verb did): when an earlier completion
/// failed, the owner already failed the link with that one, and calls end with its status
/// ([`LinkError::status`]); later flushes of a failed link are ignored.
///
/// # Errors
/// The failed completion, as [`LinkError::Completion`].
#[inline]
pub fn completion(wc: &Wc) -> Result<(), LinkError> {
    match wc.status {
        WcStatus::Success => Ok(()),
        WcStatus::WrFlushErr if split_wr_id(wc.wr_id).1 == Some(WrKind::Recv) => Ok(()),
        _ => Err(LinkError::Completion(WcError { wc: *wc })),
    }
}

/// What the work request of a failed completion was for, in words.
pub(super) fn what(wc: &Wc) -> &'static str {
    match split_wr_id(wc.wr_id).1 {
        Some(WrKind::Send) => "SEND of a frame",
        Some(WrKind::Recv) => "RECV",
        Some(WrKind::Read) => "RDMA READ of a rendezvous payload",
        Some(WrKind::Write) => "RDMA WRITE into a landing zone",
        Some(WrKind::Nop) => "inline SEND or chunk of a one-sided transfer",
        Some(WrKind::Bulk) => "handler's one-sided bulk operation",
        Some(WrKind::Stripe) => "span of a striped transfer",
        None => "unknown work request",
    }
}

/// SENDs in flight a link has room for at first (see [`PostedSends`]).
const POSTED_FIRST: usize = 64;

/// The SENDs a link posted whose completions are not polled yet (their first send slots,
/// oldest first). Completions come back in posting order on the QP, so the one polled is
/// (almost always) the oldest. Dropped after the link's QPs (field order), it returns the
/// slots of the SENDs that never completed to the arena: the QPs being destroyed, the NIC no
/// longer touches them. Bounded by as many SENDs as can be posted at once (the QP's send
/// queue, or the arena's send slots if fewer); room for [`POSTED_FIRST`] at first, doubled the
/// first times more are in flight (a few times in a connection's life, never per call).
pub(crate) struct PostedSends<P: Provider> {
    arena: std::sync::Arc<crate::buf::SlotArena<P>>,
    slots: std::collections::VecDeque<u32>,
}

impl<P: Provider> PostedSends<P> {
    /// Room for `max` SENDs in flight, made as they come ([`POSTED_FIRST`] at first: an
    /// idle connection holds 256 bytes here, not its whole send queue's worth).
    pub(crate) fn new(arena: std::sync::Arc<crate::buf::SlotArena<P>>, max: usize) -> Self {
        PostedSends {
            arena,
            slots: std::collections::VecDeque::with_capacity(max.min(POSTED_FIRST)),
        }
    }

    /// A SEND whose first frame is in `slot` was posted.
    pub(crate) fn push(&mut self, slot: u32) {
        self.slots.push_back(slot);
    }

    /// The completion of the SEND in `slot` was polled: its slots go back (how many).
    pub(crate) fn completed(&mut self, slot: u32) -> u32 {
        if self.slots.front() == Some(&slot) {
            self.slots.pop_front();
        } else if let Some(i) = self.slots.iter().position(|&s| s == slot) {
            self.slots.remove(i);
        } else {
            // Not ours (a forged or duplicated completion): nothing to give back.
            return 0;
        }
        self.arena.release_chain(slot)
    }
}

impl<P: Provider> Drop for PostedSends<P> {
    fn drop(&mut self) {
        for &s in &self.slots {
            self.arena.release_chain(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::{LinkKey, wr_id};

    fn wc(kind: WrKind, status: WcStatus) -> Wc {
        let key = LinkKey {
            idx: 3,
            generation: 1,
        };
        Wc {
            wr_id: wr_id(key, kind, 7),
            status,
            ..Wc::default()
        }
    }

    #[test]
    fn a_flush_fails_every_operation_but_recv() {
        for kind in [
            WrKind::Send,
            WrKind::Read,
            WrKind::Write,
            WrKind::Nop,
            WrKind::Bulk,
            WrKind::Stripe,
        ] {
            assert!(completion(&wc(kind, WcStatus::Success)).is_ok());
            let e = completion(&wc(kind, WcStatus::WrFlushErr)).unwrap_err();
            let s = e.status();
            assert_eq!(s.code(), crate::Code::Unavailable, "{kind:?}");
            assert!(s.message().contains("WR_FLUSH_ERR"), "{kind:?}: {s}");
            assert!(s.message().contains(what(&wc(kind, WcStatus::WrFlushErr))));
            assert!(completion(&wc(kind, WcStatus::RemAccessErr)).is_err());
        }
        assert!(completion(&wc(WrKind::Recv, WcStatus::WrFlushErr)).is_ok());
        assert!(completion(&wc(WrKind::Recv, WcStatus::LocLenErr)).is_err());
    }

    #[test]
    fn a_graveyard_counts_what_it_buries() {
        let before = parked_stats();
        let mut g = Graveyard::default();
        g.park(vec![1u8; 16]);
        g.park(());
        assert_eq!(g.len(), 1, "nothing to keep for a zero-sized value");
        drop(g);
        let after = parked_stats();
        assert!(after.parked > before.parked && after.buried > before.buried);
    }
}
