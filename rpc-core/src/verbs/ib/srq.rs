//! Shared receive queues: `ibv_create_srq`, the limit (`ibv_modify_srq` with
//! `IBV_SRQ_LIMIT`) and `ibv_post_srq_recv` with work-request chains built on the stack.
//!
//! # Depth accounting
//!
//! As for a QP's queues (see `ledger`), the device never sees the caller's `wr_id`: each
//! receive carries [`RECV_TAG`] and the index of a slot of the SRQ's [`SrqSlots`], which holds
//! the caller's `wr_id` until the completion is polled. The completion names the QP the
//! message arrived on; the CQ finds that QP's ledger by `qp_num`, and the ledger of a QP
//! created on an SRQ points at the SRQ's slots, which give the `wr_id` back and count the
//! receive as polled. `post_recv` answers `QueueFull` when `max_wr` receives are posted and
//! not yet polled, on whichever CQ they complete.
//!
//! Unlike a QP's queue, an SRQ's receives do not complete in the order posted (QPs finish
//! their messages at different times, on different CQs), so slots are not a ring indexed by
//! sequence number: each has a busy flag, and the poster takes the next free one from a
//! cursor that goes round. Receives are consumed about in the order posted, so the slot under
//! the cursor is almost always free; a receive still outstanding a whole round later is
//! skipped once per round.
//!
//! A receive whose completion is still queued when its QP is destroyed is never polled (the
//! CQ drops completions of unknown QPs): its slot stays taken, as its buffer stays the
//! device's by the posting contract, until the SRQ is destroyed.
//!
//! # Completion queues
//!
//! An SRQ's receives complete at most `max_wr` at a time in all, whichever QPs consume them:
//! a receive CQ reserves the SRQ's `max_wr` once, when the first of the SRQ's QPs that uses it
//! is created, and returns it when the last of them is destroyed.

use std::borrow::Cow;
use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdma_sys::{
    ibv_create_srq, ibv_destroy_srq, ibv_modify_srq, ibv_post_srq_recv, ibv_recv_wr, ibv_sge,
    ibv_srq, ibv_srq_attr, ibv_srq_attr_mask, ibv_srq_init_attr,
};

use super::chain::{Refused, post_chain};
use super::cq::CqShared;
use super::device::{last_errno, ret_errno};
use super::ledger::RECV_TAG;
use super::mr::{IbPd, PdShared};
use super::qp::{POST_BATCH, post_errno};
use crate::verbs::error::{ErrorKind, PostError, Verb, VerbsError};
use crate::verbs::types::{RecvWr, SrqCaps};
use crate::verbs::{Result, Srq};

/// The callers' `wr_id`s of an SRQ's outstanding receives, one slot each, shared by the SRQ
/// (which posts) and the ledgers of its QPs (which the CQs credit).
///
/// A slot is written by the SRQ's owner before `ibv_post_srq_recv` hands the receive to the
/// device and read by a poller after the device wrote the completion; the poller frees it
/// (`busy` false, Release) after reading it, then counts it in `completed` (Release); the
/// owner reads `completed` (Acquire) before it looks for free slots, so every slot counted is
/// seen free.
pub(super) struct SrqSlots {
    ids: Box<[AtomicU64]>,
    busy: Box<[AtomicBool]>,
    /// Receives whose completion was polled.
    completed: AtomicU64,
}

impl SrqSlots {
    fn new(n: u32) -> SrqSlots {
        SrqSlots {
            ids: (0..n).map(|_| AtomicU64::new(0)).collect(),
            busy: (0..n).map(|_| AtomicBool::new(false)).collect(),
            completed: AtomicU64::new(0),
        }
    }

    /// The caller's `wr_id` of the receive in slot `slot`, whose completion was polled: frees
    /// the slot (poller only). A slot that is not posted (a number the device made up) gives 0
    /// and frees nothing.
    pub(super) fn complete(&self, slot: u64) -> u64 {
        let Some(i) = usize::try_from(slot).ok().filter(|&i| i < self.ids.len()) else {
            return 0;
        };
        let id = self.ids[i].load(Ordering::Acquire);
        if self.busy[i].swap(false, Ordering::AcqRel) {
            self.completed.fetch_add(1, Ordering::Release);
        }
        id
    }
}

/// An owned `ibv_srq`, kept alive by the SRQ's handle and by every QP created on it.
pub(super) struct SrqShared {
    pub(super) srq: NonNull<ibv_srq>,
    /// `ibv_srq.handle`: the number async events name it by.
    pub(super) num: u32,
    /// The depth asked for (see [`IbSrq::caps`]).
    pub(super) caps: SrqCaps,
    pub(super) slots: Arc<SrqSlots>,
    /// The receive CQs of its QPs, by address, with how many of its QPs use each; each holds
    /// a reservation of `caps.max_wr` (see the module docs).
    cqs: Mutex<Vec<(usize, u32)>>,
    pub(super) pd: Arc<PdShared>,
}

// SAFETY: the SRQ handle is posted to and modified only through `&mut IbSrq` (one owner);
// QPs use it only to be created on it (`ibv_create_qp` is thread-safe) and Drop destroys it
// once. Slots and the CQ table are atomics and a mutex.
unsafe impl Send for SrqShared {}
// SAFETY: as above.
unsafe impl Sync for SrqShared {}

impl Drop for SrqShared {
    fn drop(&mut self) {
        // SAFETY: every QP created on the SRQ holds an `Arc<SrqShared>` and destroys its QP
        // before dropping it, so the SRQ has no QP now (verbs refuses to destroy a busy one);
        // destroyed exactly once, before the PD (held by us).
        let rc = unsafe { ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_destroy_srq failed");
        }
    }
}

impl SrqShared {
    /// Admits a QP of this SRQ receiving on `cq`: the first one reserves `max_wr` on it.
    pub(super) fn join_cq(&self, cq: &CqShared) -> Result<()> {
        let key = std::ptr::from_ref(cq) as usize;
        let mut cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = cqs.iter_mut().find(|e| e.0 == key) {
            e.1 += 1;
            return Ok(());
        }
        cq.commit(self.caps.max_wr).map_err(|e| {
            VerbsError::new(
                Verb::CreateQp,
                ErrorKind::ExceedsCaps,
                format!(
                    "the receive CQ cannot hold the {} receives of SRQ {:#x} (reserved once per \
                     receive CQ, by its first QP): {}",
                    self.caps.max_wr,
                    self.num,
                    e.detail()
                ),
            )
        })?;
        cqs.push((key, 1));
        Ok(())
    }

    /// Undoes one [`SrqShared::join_cq`]: the last QP of the SRQ on `cq` returns the
    /// reservation.
    pub(super) fn leave_cq(&self, cq: &CqShared) {
        let key = std::ptr::from_ref(cq) as usize;
        let mut cqs = self.cqs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cqs.iter().position(|e| e.0 == key) {
            cqs[i].1 -= 1;
            if cqs[i].1 == 0 {
                cqs.swap_remove(i);
                cq.release(self.caps.max_wr);
            }
        }
    }
}

/// A shared receive queue (`ibv_srq`, `IBV_SRQT_BASIC`).
pub struct IbSrq {
    pub(super) shared: Arc<SrqShared>,
    /// Receives handed to the device so far.
    posted: u64,
    /// Where the search for a free slot starts.
    cursor: usize,
}

impl fmt::Debug for IbSrq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let done = self.shared.slots.completed.load(Ordering::Relaxed);
        f.debug_struct("IbSrq")
            .field("srq_num", &format_args!("{:#x}", self.shared.num))
            .field("device", &self.shared.pd.ctx.label())
            .field("caps", &self.shared.caps)
            .field("outstanding", &self.posted.wrapping_sub(done))
            .finish()
    }
}

fn exceeds(what: &str, want: u32, max: u32, dev: &str) -> VerbsError {
    VerbsError::new(
        Verb::CreateSrq,
        ErrorKind::ExceedsCaps,
        format!("SRQ {what} = {want} exceeds the device limit {max} on {dev}"),
    )
}

impl IbSrq {
    pub(super) fn create(pd: &IbPd, caps: SrqCaps) -> Result<IbSrq> {
        let ctx = &pd.shared.ctx;
        let dev = ctx.label();
        let lim = ctx.srq_limits;
        if lim.max_srq == 0 {
            return Err(VerbsError::new(
                Verb::CreateSrq,
                ErrorKind::ExceedsCaps,
                format!("{dev} has no shared receive queues (max_srq 0)"),
            ));
        }
        if caps.max_wr == 0 {
            return Err(VerbsError::new(
                Verb::CreateSrq,
                ErrorKind::ExceedsCaps,
                "an SRQ of zero receives (max_wr 0): ask for at least one",
            ));
        }
        for (what, want, max) in [
            ("max_wr", caps.max_wr, lim.max_srq_wr),
            ("max_sge", caps.max_sge, lim.max_srq_sge),
        ] {
            if want > max {
                return Err(exceeds(what, want, max, &dev));
            }
        }
        let mut init = ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr: caps.max_wr,
                max_sge: caps.max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is alive and stays alive as long as the SRQ through the Arc it keeps;
        // `init` is a valid attribute block, which the call updates with the granted sizes.
        let srq = unsafe { ibv_create_srq(pd.shared.pd.as_ptr(), &mut init) };
        let Some(srq) = NonNull::new(srq) else {
            let e = last_errno();
            let why = match e {
                libc::ENOMEM => format!(
                    "out of memory for an SRQ of {caps:?} on {dev}: lower max_wr or raise \
                     RLIMIT_MEMLOCK ({})",
                    super::mr::MEMLOCK_FIX
                ),
                libc::EINVAL => format!(
                    "{dev} rejected {caps:?} (device limits: {lim:?}); lower max_wr or max_sge"
                ),
                libc::EOPNOTSUPP | libc::ENOSYS => {
                    format!("{dev} does not support shared receive queues")
                }
                _ => format!(
                    "cannot create an SRQ on {dev} (out of device resources: {} SRQs at most?)",
                    lim.max_srq
                ),
            };
            return Err(VerbsError::from_errno(Verb::CreateSrq, e, why));
        };
        // SAFETY: `srq` was just returned by libibverbs; `handle` is immutable.
        let num = unsafe { (*srq.as_ptr()).handle };
        // As for QPs (see `qp`), the depth asked for is what is reported and enforced, on every
        // provider alike; a device that rounds its ring up (rxe on Linux 6.1 does not) has slack.
        tracing::debug!(
            "NET/IB : {dev} SRQ {num:#x} created: {caps:?}; device ring: {} receives of {} SGEs",
            init.attr.max_wr,
            init.attr.max_sge
        );
        Ok(IbSrq {
            shared: Arc::new(SrqShared {
                srq,
                num,
                caps,
                slots: Arc::new(SrqSlots::new(caps.max_wr)),
                cqs: Mutex::new(Vec::new()),
                pd: Arc::clone(&pd.shared),
            }),
            posted: 0,
            cursor: 0,
        })
    }

    /// How many receives may still be posted.
    fn room(&self) -> u64 {
        let done = self.shared.slots.completed.load(Ordering::Acquire);
        u64::from(self.shared.caps.max_wr).saturating_sub(self.posted.wrapping_sub(done))
    }

    /// A free slot, taken (owner only; there is one when `room() > 0` said so for it).
    fn take_slot(&mut self) -> usize {
        let slots = &self.shared.slots;
        let n = slots.busy.len();
        loop {
            let i = self.cursor;
            self.cursor = if i + 1 == n { 0 } else { i + 1 };
            if !slots.busy[i].load(Ordering::Acquire) {
                slots.busy[i].store(true, Ordering::Relaxed);
                return i;
            }
        }
    }

    /// Posts the first `n` prepared receives of `batch` as one chain; `base` is the index of
    /// `batch[0]` in the caller's list. Slots of receives the device refused are freed.
    ///
    /// # Safety
    /// `batch[..n]` must be initialised from work requests that satisfy [`Srq::post_recv`]'s
    /// contract, each with a slot taken by [`IbSrq::take_slot`].
    unsafe fn flush(
        &mut self,
        batch: &mut [MaybeUninit<ibv_recv_wr>; POST_BATCH],
        n: usize,
        base: usize,
    ) -> Result<(), PostError> {
        let srq = self.shared.srq.as_ptr();
        // SAFETY: `batch[..n]` as the caller promises; the SRQ is alive and posted to only
        // through `&mut self`; the chain is valid, NULL-terminated work requests on our stack
        // that outlive the call, and the memory their SGEs name is the caller's contract.
        let refused = unsafe {
            post_chain(batch, n, &mut self.posted, |first, bad| {
                ibv_post_srq_recv(srq, first, bad)
            })
        };
        let Err(Refused {
            first,
            taken: idx,
            rc,
        }) = refused
        else {
            return Ok(());
        };
        for k in idx..n {
            // SAFETY: k < n: an initialised element; its slot was taken for it and the device
            // refused it, so no completion will free it.
            let slot = unsafe { (*first.add(k)).wr_id } & !RECV_TAG;
            self.shared.slots.busy[slot as usize].store(false, Ordering::Release);
        }
        let errno = ret_errno(rc);
        let error = if errno == libc::ENOMEM {
            srq_full(
                "the device's SRQ ring is full below max_wr: poll receive completions, then \
                 post the rest",
            )
        } else {
            post_errno(Verb::PostSrqRecv, errno)
        };
        Err(PostError {
            posted: base + idx,
            error,
        })
    }
}

/// The back-pressure answer (`QueueFull`, no allocation).
fn srq_full(why: &'static str) -> VerbsError {
    VerbsError::new(Verb::PostSrqRecv, ErrorKind::QueueFull, Cow::Borrowed(why))
}

impl Srq for IbSrq {
    fn srq_num(&self) -> u32 {
        self.shared.num
    }

    /// The sizes asked for at creation, which the device granted (it may have rounded its
    /// ring up; the provider enforces the request, as for QPs).
    fn caps(&self) -> SrqCaps {
        self.shared.caps
    }

    fn arm_limit(&mut self, limit: u32) -> Result<()> {
        let max = self.shared.caps.max_wr;
        if limit > max {
            return Err(VerbsError::new(
                Verb::ModifySrq,
                ErrorKind::InvalidArgument,
                format!(
                    "SRQ limit {limit} above the SRQ's max_wr {max}: it could never be reached"
                ),
            ));
        }
        let mut attr = ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: the SRQ is alive and modified only through `&mut self`; `attr` is a valid
        // attribute block whose `srq_limit`, the field the mask names, is set.
        let rc = unsafe {
            ibv_modify_srq(
                self.shared.srq.as_ptr(),
                &mut attr,
                ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32,
            )
        };
        if rc != 0 {
            let e = ret_errno(rc);
            let dev = self.shared.pd.ctx.label();
            let why = match e {
                libc::EINVAL => format!(
                    "{dev} rejected limit {limit} on SRQ {:#x} (max_wr {max}): above the \
                     device's ring, or the SRQ is in error",
                    self.shared.num
                ),
                libc::EOPNOTSUPP | libc::ENOSYS => {
                    format!("{dev} does not support SRQ limit events")
                }
                _ => format!("arming limit {limit} on {dev} SRQ {:#x}", self.shared.num),
            };
            return Err(VerbsError::from_errno(Verb::ModifySrq, e, why));
        }
        Ok(())
    }

    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut batch: [MaybeUninit<ibv_recv_wr>; POST_BATCH] =
            [const { MaybeUninit::uninit() }; POST_BATCH];
        let (mut n, mut base) = (0, 0);
        let max_sge = self.shared.caps.max_sge as usize;
        let mut room = self.room();
        for (i, wr) in wrs.iter().enumerate() {
            if room == 0 {
                // The batch's `n` receives are not in `posted` yet.
                room = self.room().saturating_sub(n as u64);
            }
            let refused = if room == 0 {
                Some(srq_full(
                    "SRQ full: max_wr receives (Srq::caps) are posted and not yet polled; poll \
                     receive completions, then post the rest",
                ))
            } else if wr.sg_list.len() > max_sge {
                Some(VerbsError::new(
                    Verb::PostSrqRecv,
                    ErrorKind::InvalidArgument,
                    "more SGEs than the SRQ's max_sge",
                ))
            } else {
                None
            };
            if let Some(error) = refused {
                // SAFETY: batch[..n] were built from the caller's requests (contract above).
                unsafe { self.flush(&mut batch, n, base)? };
                return Err(PostError { posted: i, error });
            }
            let slot = self.take_slot();
            self.shared.slots.ids[slot].store(wr.wr_id, Ordering::Release);
            batch[n].write(ibv_recv_wr {
                wr_id: slot as u64 | RECV_TAG,
                next: std::ptr::null_mut(),
                sg_list: if wr.sg_list.is_empty() {
                    std::ptr::null_mut()
                } else {
                    // Same layout (checked at compile time in `qp`); providers only read it.
                    wr.sg_list.as_ptr().cast::<ibv_sge>().cast_mut()
                },
                num_sge: wr.sg_list.len() as i32,
            });
            room -= 1;
            n += 1;
            if n == POST_BATCH {
                // SAFETY: as above.
                unsafe { self.flush(&mut batch, n, base)? };
                base += n;
                n = 0;
            }
        }
        // SAFETY: as above.
        unsafe { self.flush(&mut batch, n, base) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_complete_out_of_order() {
        let s = SrqSlots::new(4);
        for (i, id) in [10u64, 11, 12].into_iter().enumerate() {
            s.ids[i].store(id, Ordering::Relaxed);
            s.busy[i].store(true, Ordering::Relaxed);
        }
        assert_eq!(s.complete(2), 12);
        assert_eq!(s.complete(0), 10);
        assert_eq!(s.completed.load(Ordering::Relaxed), 2);
        assert!(s.busy[1].load(Ordering::Relaxed));
        assert!(!s.busy[0].load(Ordering::Relaxed) && !s.busy[2].load(Ordering::Relaxed));
        // A slot completed twice, or one that does not exist, frees nothing.
        s.complete(2);
        assert_eq!(s.complete(9), 0);
        assert_eq!(s.completed.load(Ordering::Relaxed), 2);
    }
}
