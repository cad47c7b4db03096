//! Shared receive queues.
//!
//! An SRQ is a receive queue ([`Rq`]) that is nobody's own: its WQE ring and producer index
//! live in our published segment, its claim word, limit and event words in an inbox block,
//! and every QP created on it publishes the SRQ's offsets in its QP table entry, so the peers
//! of all those QPs claim from the same ring (one receive at a time, with a compare-and-swap
//! that also names the QP claimed for: see the `qp::rq` module docs).
//! Completions land in the SRQ's own completion ring, slot by slot as on a QP, carrying the
//! number of the QP the message arrived on; the SRQ is one side of its receive CQ (soft: every
//! QP of an SRQ uses the same receive CQ, attached by the first of them).
//!
//! The limit event: the claimer that leaves fewer unconsumed receives than the armed limit
//! disarms it (compare-and-swap to 0) and sets the event word; the owner's
//! [`Context::poll_async_event`](crate::verbs::Context::poll_async_event) takes it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::qp::{Rq, SrqState};
use super::{Device, SoftCq, layout};
use crate::verbs::{
    AsyncEvent, ErrorKind, PostError, RecvWr, Result, Srq, SrqCaps, Verb, VerbsError,
};

/// A shared receive queue of the soft RNIC.
#[derive(Debug)]
pub struct SoftSrq {
    pub(crate) rq: Arc<Rq>,
}

fn create_err(kind: ErrorKind, detail: String) -> VerbsError {
    VerbsError::new(Verb::CreateSrq, kind, detail)
}

impl SoftSrq {
    pub(crate) fn create(dev: &Arc<Device>, pd: u32, caps: SrqCaps) -> Result<SoftSrq> {
        let max = super::CAPS.max_srq_wr;
        if caps.max_wr == 0 || caps.max_wr > max {
            return Err(create_err(
                ErrorKind::ExceedsCaps,
                format!("SRQ max_wr = {} is outside 1..={max}", caps.max_wr),
            ));
        }
        if caps.max_sge > super::CAPS.max_sge {
            return Err(create_err(
                ErrorKind::ExceedsCaps,
                format!(
                    "SRQ max_sge = {} exceeds the soft RNIC's limit {}",
                    caps.max_sge,
                    super::CAPS.max_sge
                ),
            ));
        }
        let (wqe_bytes, cqe_bytes) = Rq::ring_bytes(caps.max_wr, caps.max_sge);
        let parts = [
            (true, wqe_bytes),
            (false, cqe_bytes),
            (true, layout::SRQ_PUB_CTRL),
            (false, layout::SRQ_IN_CTRL),
        ];
        let mut got: Vec<(bool, usize, usize)> = Vec::with_capacity(4);
        for (published, len) in parts {
            let heap = if published {
                &dev.pub_heap
            } else {
                &dev.in_heap
            };
            match heap.alloc(len) {
                Some(off) => got.push((published, off, len)),
                None => {
                    for (p, off, len) in got {
                        if p {
                            dev.pub_heap.free(off, len);
                        } else {
                            dev.in_heap.free(off, len);
                        }
                    }
                    return Err(create_err(
                        ErrorKind::OutOfMemory,
                        "soft RNIC: the shared segments have no room for this SRQ".into(),
                    ));
                }
            }
        }
        let (wqe, cqe, ctrl_pub, ctrl_in) = (got[0].1, got[1].1, got[2].1, got[3].1);
        dev.in32(ctrl_in + layout::srq_in::LIMIT)
            .store(0, Ordering::Relaxed);
        dev.in32(ctrl_in + layout::srq_in::EVENT)
            .store(0, Ordering::Relaxed);
        let num = dev.next_srq.fetch_add(1, Ordering::Relaxed);
        let rq = Arc::new(Rq::new(
            dev,
            caps.max_wr,
            caps.max_sge,
            wqe,
            cqe,
            ctrl_pub,
            ctrl_in + layout::srq_in::CLAIM,
            Some(SrqState::new(num, pd, ctrl_in, ctrl_pub)),
        ));
        dev.srq_live.fetch_add(1, Ordering::AcqRel);
        let mut srqs = dev.srqs.lock().unwrap_or_else(|e| e.into_inner());
        srqs.retain(|w| w.strong_count() > 0);
        srqs.push(Arc::downgrade(&rq));
        Ok(SoftSrq { rq })
    }

    pub(crate) fn pd(&self) -> u32 {
        self.rq.srq.as_ref().map_or(0, |s| s.pd)
    }
}

/// Makes `recv_cq` the receive CQ of the shared queue `rq` (on its first QP: reserves its
/// receives and takes a bit), or checks that it is the one already attached.
pub(crate) fn srq_attach(rq: &Arc<Rq>, recv_cq: &SoftCq) -> Result<()> {
    let bad = |kind: ErrorKind, detail: String| Err(VerbsError::new(Verb::CreateQp, kind, detail));
    if recv_cq.dev_nonce() != rq.dev.nonce {
        return bad(
            ErrorKind::WrongPd,
            "the SRQ belongs to another soft context than the CQ".into(),
        );
    }
    // Serialised by the member list: two first QPs created at once attach once.
    let Some(st) = &rq.srq else {
        return bad(
            ErrorKind::InvalidArgument,
            "not a shared receive queue".into(),
        );
    };
    let _members = st.members.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((cq, _)) = rq.target() {
        if Arc::ptr_eq(cq, &recv_cq.shared) {
            return Ok(());
        }
        return bad(
            ErrorKind::InvalidArgument,
            "soft RNIC: every QP of a shared receive queue must use the same receive CQ (the \
             one its first QP was created with)"
                .into(),
        );
    }
    let cq = &recv_cq.shared;
    if let Err(total) = cq.reserve(u64::from(rq.max_wr())) {
        return bad(
            ErrorKind::ExceedsCaps,
            format!(
                "the CQ (capacity {}) cannot hold the {total} completions its QPs and SRQs can \
                 generate: create it with cqe >= {total} (CQ overrun is prevented by sizing)",
                cq.cap()
            ),
        );
    }
    let Some(bit) = cq.alloc_bit() else {
        cq.unreserve(u64::from(rq.max_wr()));
        return bad(
            ErrorKind::ExceedsCaps,
            format!(
                "soft RNIC: the receive CQ serves {} sides already",
                layout::CQ_BITS
            ),
        );
    };
    rq.set_target(cq.clone(), bit);
    recv_cq.attach_srq(bit, rq.clone());
    Ok(())
}

/// The next pending limit event of `dev`'s shared receive queues (one relaxed load when the
/// device has none).
pub(crate) fn take_limit_event(dev: &Device) -> Option<AsyncEvent> {
    if dev.srq_live.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let srqs = dev.srqs.lock().unwrap_or_else(|e| e.into_inner());
    srqs.iter()
        .filter_map(std::sync::Weak::upgrade)
        .find_map(|rq| {
            rq.take_limit_event().then(|| AsyncEvent::SrqLimitReached {
                srq_num: rq.srq.as_ref().map_or(0, |s| s.num),
            })
        })
}

impl Drop for SoftSrq {
    fn drop(&mut self) {
        if let Some(st) = &self.rq.srq {
            st.handle_dropped.store(true, Ordering::Release);
        }
        // Let the CQ notice (it lets go once no QP uses the queue either).
        self.rq.ring(false);
    }
}

impl Srq for SoftSrq {
    fn srq_num(&self) -> u32 {
        self.rq.srq.as_ref().map_or(0, |s| s.num)
    }

    fn caps(&self) -> SrqCaps {
        SrqCaps {
            max_wr: self.rq.max_wr(),
            max_sge: self.rq.max_sge,
        }
    }

    fn arm_limit(&mut self, limit: u32) -> Result<()> {
        self.rq.arm_limit(limit)
    }

    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        // SAFETY: forwarded contract.
        unsafe { self.rq.post(Verb::PostSrqRecv, wrs) }
    }
}
