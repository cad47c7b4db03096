//! What the provider knows about each QP's outstanding work, shared by the QP (which posts)
//! and its CQs (which poll): the depth accounting that makes `QueueFull` come at the depth
//! asked for, and the routing of every completion to its QP by `qp_num`.
//!
//! # Work-request ids
//!
//! The device never sees the caller's `wr_id`: each posted request carries its queue
//! sequence number instead (bit 63 set for receives), and the caller's `wr_id` waits in a
//! ring slot of the QP's [`Ledger`]. When a completion is polled, the CQ finds the ledger by
//! `qp_num` and the slot by the sequence number, gives the caller's `wr_id` back, and frees the
//! queue up to that request (RC completes each queue in order, so one completion frees the
//! unsignaled requests before it too). That works the same for error completions, whose
//! opcode, length and flags verbs leaves undefined: only `wr_id`, `status`, `qp_num` and
//! `vendor_err` are read from them, and the opcode comes from the request.
//!
//! The receives of a QP created on a shared receive queue are the SRQ's: its ledger points
//! at the SRQ's slots (see `srq`), which the completion frees instead.
//!
//! # Ordering
//!
//! A slot is written by the QP's owner before `ibv_post_send`/`ibv_post_recv` hands the
//! request to the device (the provider's doorbell write is ordered after it) and read by the
//! poller after the device wrote the completion; the owner reuses a slot only after `freed`
//! (Release by the poller, Acquire by the owner) says its completion was polled.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::srq::SrqSlots;
use crate::verbs::types::WcOpcode;

/// Bit of a device-level `wr_id` that marks a receive.
pub(super) const RECV_TAG: u64 = 1 << 63;

/// One queue (send or receive) of a QP: the caller's `wr_id`s by sequence number.
pub(super) struct Ring {
    ids: Box<[AtomicU64]>,
    /// The opcode each send request completes with (for error completions).
    ops: Box<[AtomicU8]>,
    mask: u64,
    /// The requested depth: at most this many requests outstanding.
    pub(super) depth: u64,
    /// One past the sequence number of the last request whose completion was polled.
    freed: AtomicU64,
}

impl Ring {
    fn new(depth: u32, with_ops: bool) -> Ring {
        let n = depth.max(1).next_power_of_two() as usize;
        Ring {
            ids: (0..n).map(|_| AtomicU64::new(0)).collect(),
            ops: (0..if with_ops { n } else { 0 })
                .map(|_| AtomicU8::new(0))
                .collect(),
            mask: n as u64 - 1,
            depth: u64::from(depth),
            freed: AtomicU64::new(0),
        }
    }

    /// How many requests may still be posted when `posted` have been.
    pub(super) fn room(&self, posted: u64) -> u64 {
        self.depth
            .saturating_sub(posted.wrapping_sub(self.freed.load(Ordering::Acquire)))
    }

    /// Records request `seq` (owner only, with room for it).
    pub(super) fn record(&self, seq: u64, wr_id: u64, op: WcOpcode) {
        let i = (seq & self.mask) as usize;
        self.ids[i].store(wr_id, Ordering::Release);
        if let Some(o) = self.ops.get(i) {
            o.store(op as u8, Ordering::Release);
        }
    }

    /// The caller's `wr_id` and opcode of request `seq`, which completed: frees it and every
    /// request before it (poller only).
    fn complete(&self, seq: u64) -> (u64, Option<u8>) {
        let i = (seq & self.mask) as usize;
        let id = self.ids[i].load(Ordering::Acquire);
        let op = self.ops.get(i).map(|o| o.load(Ordering::Acquire));
        self.freed.fetch_max(seq.wrapping_add(1), Ordering::AcqRel);
        (id, op)
    }

    /// Forgets every outstanding request (the QP was reset: the device dropped them without
    /// completions).
    pub(super) fn forget(&self, posted: u64) {
        self.freed.fetch_max(posted, Ordering::AcqRel);
    }
}

/// The outstanding work of one QP.
pub(super) struct Ledger {
    pub(super) qp_num: u32,
    pub(super) send: Ring,
    pub(super) recv: Ring,
    /// The slots of the SRQ the QP receives from, if any: its receive completions are the
    /// SRQ's (`recv` is then unused).
    srq: Option<Arc<SrqSlots>>,
    /// An error completion of this QP was polled: the QP is in ERROR.
    pub(super) failed: AtomicBool,
}

impl Ledger {
    pub(super) fn new(qp_num: u32, send_depth: u32, recv_depth: u32) -> Ledger {
        Ledger {
            qp_num,
            send: Ring::new(send_depth, true),
            recv: Ring::new(recv_depth, false),
            srq: None,
            failed: AtomicBool::new(false),
        }
    }

    /// The ledger of a QP created on an SRQ with `slots`.
    pub(super) fn on_srq(qp_num: u32, send_depth: u32, slots: Arc<SrqSlots>) -> Ledger {
        Ledger {
            srq: Some(slots),
            ..Ledger::new(qp_num, send_depth, 0)
        }
    }

    /// Resolves the device-level `tag` of a polled completion: the caller's `wr_id`, whether
    /// it was a receive, and the send opcode recorded at post time.
    pub(super) fn resolve(&self, tag: u64, ok: bool) -> (u64, bool, Option<WcOpcode>) {
        if !ok {
            self.failed.store(true, Ordering::Release);
        }
        if tag & RECV_TAG != 0 {
            let id = match &self.srq {
                Some(slots) => slots.complete(tag & !RECV_TAG),
                None => self.recv.complete(tag & !RECV_TAG).0,
            };
            (id, true, None)
        } else {
            let (id, op) = self.send.complete(tag);
            (id, false, op.map(opcode_from_u8))
        }
    }
}

fn opcode_from_u8(v: u8) -> WcOpcode {
    [
        WcOpcode::Send,
        WcOpcode::RdmaWrite,
        WcOpcode::RdmaRead,
        WcOpcode::CompSwap,
        WcOpcode::FetchAdd,
    ]
    .into_iter()
    .find(|o| *o as u8 == v)
    .unwrap_or(WcOpcode::Send)
}

enum Change {
    Add(Arc<Ledger>),
    Remove(u32),
}

/// QPs joining and leaving a CQ, applied by its poller at its next poll (so that the poller's
/// table needs no lock: only setup takes this one).
#[derive(Default)]
pub(super) struct Joins {
    changes: Mutex<Vec<Change>>,
    dirty: AtomicBool,
}

impl Joins {
    pub(super) fn add(&self, l: Arc<Ledger>) {
        self.push(Change::Add(l));
    }

    pub(super) fn remove(&self, qp_num: u32) {
        self.push(Change::Remove(qp_num));
    }

    fn push(&self, c: Change) {
        self.changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(c);
        self.dirty.store(true, Ordering::Release);
    }
}

/// The poller's table: ledgers by `qp_num` (sorted, binary search: no hashing, no lock).
#[derive(Default)]
pub(super) struct Routes {
    by_qpn: Vec<(u32, Arc<Ledger>)>,
}

impl Routes {
    /// The ledger of `qp_num`, applying pending joins first when there are any (one Acquire
    /// load when there are none) or when the QP is not known yet.
    #[inline]
    pub(super) fn find(&mut self, joins: &Joins, qp_num: u32) -> Option<&Arc<Ledger>> {
        if joins.dirty.load(Ordering::Acquire) || self.index(qp_num).is_err() {
            self.apply(joins);
        }
        let i = self.index(qp_num).ok()?;
        Some(&self.by_qpn[i].1)
    }

    fn index(&self, qp_num: u32) -> std::result::Result<usize, usize> {
        self.by_qpn.binary_search_by_key(&qp_num, |(q, _)| *q)
    }

    #[cold]
    fn apply(&mut self, joins: &Joins) {
        if !joins.dirty.swap(false, Ordering::AcqRel) {
            return;
        }
        let changes = std::mem::take(&mut *joins.changes.lock().unwrap_or_else(|e| e.into_inner()));
        for c in changes {
            match c {
                Change::Add(l) => match self.index(l.qp_num) {
                    Ok(i) => self.by_qpn[i] = (l.qp_num, l),
                    Err(i) => self.by_qpn.insert(i, (l.qp_num, l)),
                },
                Change::Remove(q) => {
                    if let Ok(i) = self.index(q) {
                        self.by_qpn.remove(i);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_and_routing() {
        let l = Arc::new(Ledger::new(0x42, 4, 2));
        assert_eq!(l.send.room(0), 4);
        for seq in 0..4 {
            l.send.record(seq, 100 + seq, WcOpcode::RdmaWrite);
        }
        assert_eq!(l.send.room(4), 0);
        let joins = Joins::default();
        let mut routes = Routes::default();
        assert!(routes.find(&joins, 0x42).is_none());
        joins.add(Arc::clone(&l));
        // One signaled completion (seq 2) frees the unsignaled requests before it.
        let r = routes.find(&joins, 0x42).expect("joined");
        assert_eq!(r.resolve(2, true), (102, false, Some(WcOpcode::RdmaWrite)));
        assert_eq!(l.send.room(4), 3);
        l.recv.record(0, 7, WcOpcode::Recv);
        assert_eq!(l.resolve(RECV_TAG, false), (7, true, None));
        assert!(l.failed.load(Ordering::Relaxed));
        assert_eq!(l.recv.room(1), 2);
        l.send.forget(4);
        assert_eq!(l.send.room(4), 4);
        joins.remove(0x42);
        assert!(routes.find(&joins, 0x42).is_none());
    }
}
