//! The receive side of a QP: posting receives into the published ring, the peer's claims,
//! flushing, and draining (and validating) the completions peers write into our inbox.

use std::sync::atomic::{AtomicU32, Ordering};

use super::{QpShared, post_err};
use crate::verbs::soft::exec;
use crate::verbs::soft::layout::{self, qp, qp_in, rcqe};
use crate::verbs::soft::vendor;
use crate::verbs::{ErrorKind, PostError, QpState, RecvWr, Verb, Wc, WcFlags, WcOpcode, WcStatus};

impl QpShared {
    pub(super) fn rq_prod(&self) -> &AtomicU32 {
        self.dev.pub32(self.entry + qp::RQ_PROD)
    }

    pub(super) fn rq_claim(&self) -> &AtomicU32 {
        self.dev.in32(self.in_entry + qp_in::RQ_CLAIM)
    }

    /// Publishes a completion for our own receive `idx` (flush or discard).
    fn publish_own(&self, idx: u32, status_raw: u32) {
        let base = self.rq_cqe + (idx & (self.rq_cap - 1)) as usize * layout::RCQE;
        self.dev
            .in32(base + rcqe::BYTE_LEN)
            .store(0, Ordering::Relaxed);
        self.dev.in32(base + rcqe::IMM).store(0, Ordering::Relaxed);
        self.dev
            .in32(base + rcqe::META)
            .store(status_raw | (WcOpcode::Recv as u32) << 8, Ordering::Relaxed);
        self.dev
            .in32(base + rcqe::SEQ)
            .store(idx.wrapping_add(1), Ordering::Release);
    }

    /// Completes every posted, unclaimed receive with WR_FLUSH_ERR (or discards it).
    pub(super) fn flush_rq_with(&self, status_raw: u32) {
        let claim = self.rq_claim();
        loop {
            let c = claim.load(Ordering::SeqCst);
            let prod = self.rq_prod().load(Ordering::SeqCst);
            let n = prod.wrapping_sub(c);
            if n == 0 {
                break;
            }
            if n > self.rq_cap {
                // The peer corrupted the claim index: take every unpublished receive back.
                claim.store(prod, Ordering::SeqCst);
                let mut i = self.rq_polled.load(Ordering::Acquire);
                while i != prod {
                    let base = self.rq_cqe + (i & (self.rq_cap - 1)) as usize * layout::RCQE;
                    if self.dev.in32(base + rcqe::SEQ).load(Ordering::Acquire) != i.wrapping_add(1)
                    {
                        self.publish_own(i, status_raw);
                    }
                    i = i.wrapping_add(1);
                }
                break;
            }
            if claim
                .compare_exchange(c, prod, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let mut i = c;
                while i != prod {
                    self.publish_own(i, status_raw);
                    i = i.wrapping_add(1);
                }
                break;
            }
        }
        self.recv_cq.set_ready(self.recv_bit, true);
    }

    pub(super) fn flush_rq(&self) {
        self.flush_rq_with(WcStatus::WrFlushErr as u32);
    }

    /// Drains receive completions into `out`; returns (count, whether more remain).
    pub(crate) fn drain_recv(&self, out: &mut [Wc]) -> (usize, bool) {
        let _ = self.state();
        let prod = self.rq_prod().load(Ordering::Acquire);
        let mut p = self.rq_polled.load(Ordering::Relaxed);
        let mask = self.rq_cap - 1;
        let mut n = 0;
        while n < out.len() && p != prod {
            let base = self.rq_cqe + (p & mask) as usize * layout::RCQE;
            let seq = self.dev.in32(base + rcqe::SEQ).load(Ordering::Acquire);
            if seq != p.wrapping_add(1) {
                if self.stuck_claim(p) {
                    self.publish_own(p, WcStatus::WrFlushErr as u32);
                    continue;
                }
                break;
            }
            let byte_len = self.dev.in32(base + rcqe::BYTE_LEN).load(Ordering::Relaxed);
            let imm = self.dev.in32(base + rcqe::IMM).load(Ordering::Relaxed);
            let meta = self.dev.in32(base + rcqe::META).load(Ordering::Relaxed);
            let slot = (p & mask) as usize;
            p = p.wrapping_add(1);
            if meta & 0xff == layout::RCQE_DISCARD {
                self.rq_polled.store(p, Ordering::Release);
                continue;
            }
            let wr_id = self.rq_wr_ids[slot].load(Ordering::Relaxed);
            let posted_len = self.rq_lens[slot].load(Ordering::Relaxed);
            out[n] = self.validate_rcqe(wr_id, posted_len, byte_len, imm, meta);
            n += 1;
            self.rq_polled.store(p, Ordering::Release);
        }
        (n, n == out.len() && p != prod)
    }

    /// Turns a receive completion written by a peer into a `Wc`, or into an error completion
    /// (and ERROR) when any field is invalid.
    fn validate_rcqe(&self, wr_id: u64, posted_len: u64, byte_len: u32, imm: u32, meta: u32) -> Wc {
        let status_raw = meta & 0xff;
        let status = WcStatus::from_u32(status_raw);
        let opcode = match (meta >> 8) & 0xff {
            128 => Some(WcOpcode::Recv),
            129 => Some(WcOpcode::RecvRdmaWithImm),
            _ => None,
        };
        let flags = exec::wc_flags(meta);
        let valid_status = status as u32 == status_raw;
        let valid_len = status != WcStatus::Success
            || opcode != Some(WcOpcode::Recv)
            || u64::from(byte_len) <= posted_len;
        match (opcode, flags) {
            (Some(opcode), Some(flags)) if valid_status && valid_len => Wc {
                wr_id,
                status,
                opcode,
                flags,
                byte_len,
                imm_data: if flags.contains(WcFlags::WITH_IMM) {
                    imm
                } else {
                    0
                },
                qp_num: self.qp_num,
                vendor_err: 0,
            },
            _ => {
                tracing::warn!(
                    qp = self.qp_num,
                    meta,
                    byte_len,
                    "soft RNIC: corrupt receive completion written by the peer; QP -> ERROR"
                );
                self.enter_error(false);
                Wc {
                    wr_id,
                    status: WcStatus::GeneralErr,
                    opcode: WcOpcode::Recv,
                    flags: WcFlags::NONE,
                    byte_len: 0,
                    imm_data: 0,
                    qp_num: self.qp_num,
                    vendor_err: vendor::CORRUPT,
                }
            }
        }
    }

    /// Whether receive `p`, claimed but never completed, belongs to a dead peer while we are
    /// in ERROR (then it is ours to flush).
    fn stuck_claim(&self, p: u32) -> bool {
        if self.raw_state() != QpState::Error {
            return false;
        }
        let c = self.rq_claim().load(Ordering::Acquire);
        let claimed = c.wrapping_sub(p) != 0 && c.wrapping_sub(p) <= self.rq_cap;
        if !claimed {
            return false;
        }
        let live = self.peer_live.lock().unwrap_or_else(|e| e.into_inner());
        live.as_ref().is_some_and(|l| l.is_dead())
    }

    /// `post_recv`: writes the WQEs into the published ring and publishes the producer index.
    ///
    /// # Safety
    /// As [`Qp::post_recv`](crate::verbs::Qp::post_recv).
    pub(super) unsafe fn post_recv(
        &self,
        wrs: &[RecvWr<'_>],
    ) -> std::result::Result<(), PostError> {
        let s = self;
        let verb = Verb::PostRecv;
        let st = s.state();
        if st == QpState::Reset {
            return Err(post_err(
                verb,
                0,
                ErrorKind::InvalidState,
                "post_recv on a QP in RESET: move it to INIT first".into(),
            ));
        }
        let prod_w = s.rq_prod();
        let mut prod = prod_w.load(Ordering::Relaxed);
        let mask = s.rq_cap - 1;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > s.caps.max_recv_sge as usize {
                result = Err(post_err(
                    verb,
                    i,
                    ErrorKind::InvalidArgument,
                    format!(
                        "receive has {} SGEs, the QP was created with max_recv_sge = {}",
                        wr.sg_list.len(),
                        s.caps.max_recv_sge
                    ),
                ));
                break;
            }
            if prod.wrapping_sub(s.rq_polled.load(Ordering::Acquire)) >= s.caps.max_recv_wr {
                result = Err(post_err(
                    verb,
                    i,
                    ErrorKind::QueueFull,
                    format!(
                        "receive queue full ({} posted and not yet polled): poll completions, \
                         then post the rest",
                        s.caps.max_recv_wr
                    ),
                ));
                break;
            }
            let slot = (prod & mask) as usize;
            let base = s.rq_wqe + slot * s.rq_stride;
            let mut total = 0u64;
            // Written only where they change: a consumer that reposts the same buffers in ring
            // order (an RPC link does) leaves the line alone, so it stays in the peer's cache
            // too and its next claim reads it without a cross-core miss.
            for (k, sge) in wr.sg_list.iter().enumerate() {
                let o = base + layout::WQE_HDR + k * layout::WQE_SGE;
                set64(s.dev.pub64(o), sge.addr);
                set32(s.dev.pub32(o + 8), sge.length);
                set32(s.dev.pub32(o + 12), sge.lkey);
                total += u64::from(sge.length);
            }
            set32(s.dev.pub32(base), wr.sg_list.len() as u32);
            s.rq_wr_ids[slot].store(wr.wr_id, Ordering::Relaxed);
            s.rq_lens[slot].store(total, Ordering::Relaxed);
            prod = prod.wrapping_add(1);
        }
        prod_w.store(prod, Ordering::SeqCst);
        if s.raw_state() == QpState::Error {
            s.flush_rq();
        }
        result
    }
}

/// Stores `v` unless the word holds it already (a published WQE word: only its owner writes).
#[inline]
fn set32(w: &std::sync::atomic::AtomicU32, v: u32) {
    if w.load(Ordering::Relaxed) != v {
        w.store(v, Ordering::Relaxed);
    }
}

/// As [`set32`], for a 64-bit word.
#[inline]
fn set64(w: &std::sync::atomic::AtomicU64, v: u64) {
    if w.load(Ordering::Relaxed) != v {
        w.store(v, Ordering::Relaxed);
    }
}
