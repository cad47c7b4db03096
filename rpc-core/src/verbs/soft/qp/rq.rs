//! Receive queues: a QP's own, or a shared one (SRQ) that the peers of several QPs consume.
//! Posting receives into the published ring, the peers' claims, flushing, and draining (and
//! validating) the completions peers write into our inbox.
//!
//! Both kinds are one [`Rq`]: WQEs in a published ring, a producer index only we write, a
//! claim word peers advance with compare-and-swap, and a completion ring in the inbox that
//! the claimer of receive `i` fills at slot `i`. A shared queue's completions also name the QP
//! the message arrived on (`rcqe::QP`), and its peers never claim ahead for a list (the
//! receives they would hand back may have been taken by another peer meanwhile).
//!
//! Who holds a shared queue's claim: the claim word is `(index, QP of the last claim)`, moved
//! by one compare-and-swap, so a claim is named the instant it is made. A claimer that reads
//! `(c, q)` first writes `q` as the name of receive `c - 1` (`rcqe::NAME`, forward only: see
//! [`name_claim`]), then swaps the word to `(c + 1, its QP)`, then names receive `c` itself
//! (so that the next claimer usually finds the name there and writes nothing). Receive `p`,
//! claimed and not completed, is therefore either `c - 1`, named by the word, or an earlier
//! one, named in its slot with index `p`; the owner never has to guess (see
//! [`Rq::claim_name`]). One compare-and-swap per claim, as before: the helping write is a
//! load that finds the name there unless the previous claimer is between its swap and its
//! naming store.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::{QpShared, post_err};
use crate::verbs::soft::cq::CqShared;
use crate::verbs::soft::layout::{self, rcqe, srq_in};
use crate::verbs::soft::{Device, exec, shm, vendor};
use crate::verbs::{ErrorKind, PostError, QpState, RecvWr, Verb, Wc, WcFlags, WcOpcode, WcStatus};

/// A receive queue (see the module docs).
#[derive(Debug)]
pub(crate) struct Rq {
    pub(crate) dev: Arc<Device>,
    pub(crate) cap: u32,
    max_wr: u32,
    pub(crate) max_sge: u32,
    pub(crate) wqe: usize,
    pub(crate) cqe: usize,
    pub(crate) stride: usize,
    /// Offset of the producer index in the published segment.
    pub(crate) prod_off: usize,
    /// Offset of the claim word in the inbox ([`layout::claim_word`]).
    pub(crate) claim_off: usize,
    wr_ids: Box<[AtomicU64]>,
    lens: Box<[AtomicU64]>,
    polled: AtomicU32,
    /// The receive CQ and this queue's bit in its ready bitmap: a QP's own queue gets them at
    /// creation, a shared one from its first QP.
    target: OnceLock<(Arc<CqShared>, u32)>,
    /// Set for a shared receive queue.
    pub(crate) srq: Option<SrqState>,
}

/// What only a shared receive queue has.
#[derive(Debug)]
pub(crate) struct SrqState {
    pub(crate) num: u32,
    pub(crate) pd: u32,
    /// Offset of its control block in the inbox (`srq_in`) and in the published segment.
    pub(crate) ctrl_in: usize,
    pub(crate) ctrl_pub: usize,
    /// The `SoftSrq` handle was dropped (the queue lives on while QPs use it).
    pub(crate) handle_dropped: AtomicBool,
    /// The QPs created on it (read on the stuck-claim path only: a drain that finds the
    /// next receive claimed and not completed, which a live claimer ends within
    /// microseconds).
    pub(crate) members: Mutex<Vec<Weak<QpShared>>>,
    /// Members left after the last sweep of destroyed ones (written under `members`' lock).
    pub(crate) members_kept: std::sync::atomic::AtomicUsize,
    /// Members in ERROR ([`QpShared`] counts its own moves in and out). Only a member in
    /// ERROR can hold a claim to flush, so while this is 0 a drain that finds the next
    /// receive not completed looks no further: the claim word and the claimers' names are
    /// lines the peers write on every SEND, and a drain spinning on them made each claim a
    /// cache miss.
    pub(crate) errored: std::sync::atomic::AtomicU32,
}

impl Rq {
    /// A receive queue of `max_wr` receives of `max_sge` SGEs with its rings allocated, its
    /// producer index at `prod_off` and claim word at `claim_off` (both zeroed here).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dev: &Arc<Device>,
        max_wr: u32,
        max_sge: u32,
        wqe: usize,
        cqe: usize,
        prod_off: usize,
        claim_off: usize,
        srq: Option<SrqState>,
    ) -> Rq {
        let cap = ring_cap(max_wr);
        // Fresh completion ring: no sequence word may match before a completion is written.
        // Names of the lap before the first (behind every real claim of their slot).
        for i in 0..cap {
            let base = cqe + i as usize * layout::RCQE;
            dev.in32(base + rcqe::SEQ).store(0, Ordering::Relaxed);
            dev.in32(base + rcqe::QP).store(0, Ordering::Relaxed);
            dev.in64(base + rcqe::NAME).store(
                layout::claim_word(i.wrapping_sub(cap), 0),
                Ordering::Relaxed,
            );
        }
        // The receive ring's pages, touched now: posting walks the whole ring before it wraps
        // (an SRQ of the default pool, 65,536 receives, spans megabytes), and a page first
        // touched there is a page fault on the data path every few hundred posts. The words
        // written are no WQE yet: only those below the producer index are read.
        let (wqe_bytes, _) = Rq::ring_bytes(max_wr, max_sge);
        for off in (0..wqe_bytes)
            .step_by(shm::PAGE)
            .chain([wqe_bytes.saturating_sub(4)])
        {
            dev.pub32(wqe + off).store(0, Ordering::Relaxed);
        }
        dev.pub32(prod_off).store(0, Ordering::Relaxed);
        dev.in64(claim_off)
            .store(layout::claim_word(0, 0), Ordering::Relaxed);
        Rq {
            dev: dev.clone(),
            cap,
            max_wr,
            max_sge,
            wqe,
            cqe,
            stride: layout::wqe_stride(max_sge.max(1) as usize),
            prod_off,
            claim_off,
            wr_ids: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..cap).map(|_| AtomicU64::new(0)).collect(),
            polled: AtomicU32::new(0),
            target: OnceLock::new(),
            srq,
        }
    }

    /// Bytes of the WQE ring and of the completion ring of a queue of `max_wr` (`max_sge`).
    pub(crate) fn ring_bytes(max_wr: u32, max_sge: u32) -> (usize, usize) {
        let cap = ring_cap(max_wr) as usize;
        (
            cap * layout::wqe_stride(max_sge.max(1) as usize),
            cap * layout::RCQE,
        )
    }

    /// Sets the receive CQ (once); false when it was set already.
    pub(crate) fn set_target(&self, cq: Arc<CqShared>, bit: u32) -> bool {
        self.target.set((cq, bit)).is_ok()
    }

    /// The receive CQ and our bit in it.
    pub(crate) fn target(&self) -> Option<&(Arc<CqShared>, u32)> {
        self.target.get()
    }

    /// Rings our bit in the receive CQ.
    pub(crate) fn ring(&self, solicited: bool) {
        if let Some((cq, bit)) = self.target.get() {
            cq.set_ready(*bit, solicited);
        }
    }

    fn prod(&self) -> &AtomicU32 {
        self.dev.pub32(self.prod_off)
    }

    /// The claim word ([`layout::claim_word`]).
    pub(crate) fn claim(&self) -> &AtomicU64 {
        self.dev.in64(self.claim_off)
    }

    /// The claim name word of receive `idx`'s completion slot (`rcqe::NAME`).
    pub(crate) fn name(&self, idx: u32) -> &AtomicU64 {
        self.dev.in64(self.cqe_at(idx) + rcqe::NAME)
    }

    fn cqe_at(&self, idx: u32) -> usize {
        self.cqe + (idx & (self.cap - 1)) as usize * layout::RCQE
    }

    /// Publishes a completion for our own receive `idx` (flush or discard), naming `qp_num`.
    fn publish_own(&self, idx: u32, status_raw: u32, qp_num: u32) {
        let base = self.cqe_at(idx);
        let w = |off: usize, v: u32| self.dev.in32(base + off).store(v, Ordering::Relaxed);
        w(rcqe::BYTE_LEN, 0);
        w(rcqe::IMM, 0);
        w(rcqe::QP, qp_num);
        w(rcqe::META, status_raw | (WcOpcode::Recv as u32) << 8);
        self.dev
            .in32(base + rcqe::SEQ)
            .store(idx.wrapping_add(1), Ordering::Release);
    }

    /// Completes every posted, unclaimed receive with `status_raw` (WR_FLUSH_ERR, or a
    /// discard), naming `qp_num`. Only for a QP's own queue: a shared queue's receives
    /// outlive the failure of any one QP.
    pub(crate) fn flush_with(&self, status_raw: u32, qp_num: u32) {
        debug_assert!(self.srq.is_none());
        let claim = self.claim();
        loop {
            let w = claim.load(Ordering::SeqCst);
            let c = layout::claim_index(w);
            let prod = self.prod().load(Ordering::SeqCst);
            let n = prod.wrapping_sub(c);
            if n == 0 {
                break;
            }
            if n > self.cap {
                // The peer corrupted the claim word: take every unpublished receive back.
                claim.store(layout::claim_word(prod, 0), Ordering::SeqCst);
                let mut i = self.polled.load(Ordering::Acquire);
                while i != prod {
                    let seq = self.dev.in32(self.cqe_at(i) + rcqe::SEQ);
                    if seq.load(Ordering::Acquire) != i.wrapping_add(1) {
                        self.publish_own(i, status_raw, qp_num);
                    }
                    i = i.wrapping_add(1);
                }
                break;
            }
            let to = layout::claim_word(prod, layout::claim_qp(w));
            if claim
                .compare_exchange(w, to, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let mut i = c;
                while i != prod {
                    self.publish_own(i, status_raw, qp_num);
                    i = i.wrapping_add(1);
                }
                break;
            }
        }
        self.ring(true);
    }

    /// Drains receive completions into `out`; returns (count, whether more remain). `owner`
    /// is the QP of a QP's own queue (`None`: a shared queue, whose completions name theirs).
    pub(crate) fn drain(&self, out: &mut [Wc], owner: Option<&QpShared>) -> (usize, bool) {
        let prod = self.prod().load(Ordering::Acquire);
        let mut p = self.polled.load(Ordering::Relaxed);
        let mask = self.cap - 1;
        let mut n = 0;
        while n < out.len() && p != prod {
            let base = self.cqe_at(p);
            let seq = self.dev.in32(base + rcqe::SEQ).load(Ordering::Acquire);
            if seq != p.wrapping_add(1) {
                let stuck = match owner {
                    Some(qp) => qp.stuck_claim(p).then_some(qp.qp_num),
                    None => self.srq_stuck(p),
                };
                if let Some(qp_num) = stuck {
                    self.publish_own(p, WcStatus::WrFlushErr as u32, qp_num);
                    continue;
                }
                break;
            }
            let byte_len = self.dev.in32(base + rcqe::BYTE_LEN).load(Ordering::Relaxed);
            let imm = self.dev.in32(base + rcqe::IMM).load(Ordering::Relaxed);
            let meta = self.dev.in32(base + rcqe::META).load(Ordering::Relaxed);
            let qp_num = match owner {
                Some(qp) => qp.qp_num,
                None => self.dev.in32(base + rcqe::QP).load(Ordering::Relaxed),
            };
            let slot = (p & mask) as usize;
            p = p.wrapping_add(1);
            if meta & 0xff == layout::RCQE_DISCARD {
                self.polled.store(p, Ordering::Release);
                continue;
            }
            let wr_id = self.wr_ids[slot].load(Ordering::Relaxed);
            let posted_len = self.lens[slot].load(Ordering::Relaxed);
            out[n] = match decode_rcqe(wr_id, posted_len, byte_len, imm, meta, qp_num) {
                Ok(wc) => wc,
                Err(wc) => {
                    tracing::warn!(
                        qp = qp_num,
                        meta,
                        byte_len,
                        "soft RNIC: corrupt receive completion written by the peer; QP -> ERROR"
                    );
                    if let Some(qp) = owner {
                        qp.enter_error(false);
                    }
                    wc
                }
            };
            n += 1;
            self.polled.store(p, Ordering::Release);
        }
        (n, n == out.len() && p != prod)
    }

    /// A shared queue's receive `p`, claimed but never completed: the QP it was claimed for
    /// when that QP is in ERROR and its peer is dead (the receive is then ours to flush,
    /// naming that QP). A claim of a live peer, however young, is never taken: its claimer
    /// may still write the buffer.
    fn srq_stuck(&self, p: u32) -> Option<u32> {
        let st = self.srq.as_ref()?;
        if st.errored.load(Ordering::Acquire) == 0 {
            return None;
        }
        let holder = self.claim_name(p)?;
        let members = st.members.lock().unwrap_or_else(|e| e.into_inner());
        members.iter().filter_map(Weak::upgrade).find(|qp| {
            qp.qp_num == holder && qp.raw_state() == QpState::Error && qp.peer_is_dead()
        })?;
        Some(holder)
    }

    /// The QP a shared queue's receive `p` was claimed for, when it is claimed: the claim
    /// word's for the last claim, the slot's name (which must carry index `p`) for an earlier
    /// one. `None` when `p` is not claimed, or when a corrupt peer left no valid name (the
    /// receive then waits: it is never guessed to be a dead peer's).
    fn claim_name(&self, p: u32) -> Option<u32> {
        let w = self.claim().load(Ordering::Acquire);
        let ahead = layout::claim_index(w).wrapping_sub(p);
        if ahead == 0 || ahead > self.cap {
            return None;
        }
        let name = if ahead == 1 {
            w
        } else {
            // Written before the claim word moved past `p + 1` (by the claimer of `p + 1` at
            // the latest), which the acquire load above saw.
            let n = self.name(p).load(Ordering::Acquire);
            if layout::claim_index(n) != p {
                return None;
            }
            n
        };
        Some(layout::claim_qp(name)).filter(|&q| q != 0)
    }

    /// Posts receives: writes the WQEs into the published ring and publishes the producer
    /// index. `verb` names the caller's verb in errors.
    ///
    /// # Safety
    /// As [`Qp::post_recv`](crate::verbs::Qp::post_recv).
    pub(crate) unsafe fn post(
        &self,
        verb: Verb,
        wrs: &[RecvWr<'_>],
    ) -> std::result::Result<(), PostError> {
        let prod_w = self.prod();
        let mut prod = prod_w.load(Ordering::Relaxed);
        let mask = self.cap - 1;
        let what = if self.srq.is_some() { "SRQ" } else { "QP" };
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.max_sge as usize {
                result = Err(post_err(
                    verb,
                    i,
                    ErrorKind::InvalidArgument,
                    format!(
                        "receive has {} SGEs, the {what} was created with {} SGEs per receive",
                        wr.sg_list.len(),
                        self.max_sge
                    ),
                ));
                break;
            }
            if prod.wrapping_sub(self.polled.load(Ordering::Acquire)) >= self.max_wr {
                result = Err(post_err(
                    verb,
                    i,
                    ErrorKind::QueueFull,
                    format!(
                        "receive queue full ({} posted and not yet polled): poll completions, \
                         then post the rest",
                        self.max_wr
                    ),
                ));
                break;
            }
            let slot = (prod & mask) as usize;
            let base = self.wqe + slot * self.stride;
            let mut total = 0u64;
            // Written only where they change: a consumer that reposts the same buffers in ring
            // order (an RPC link does) leaves the line alone, so it stays in the peer's cache
            // too and its next claim reads it without a cross-core miss.
            for (k, sge) in wr.sg_list.iter().enumerate() {
                let o = base + layout::WQE_HDR + k * layout::WQE_SGE;
                set64(self.dev.pub64(o), sge.addr);
                set32(self.dev.pub32(o + 8), sge.length);
                set32(self.dev.pub32(o + 12), sge.lkey);
                total += u64::from(sge.length);
            }
            set32(self.dev.pub32(base), wr.sg_list.len() as u32);
            self.wr_ids[slot].store(wr.wr_id, Ordering::Relaxed);
            self.lens[slot].store(total, Ordering::Relaxed);
            prod = prod.wrapping_add(1);
        }
        prod_w.store(prod, Ordering::SeqCst);
        result
    }

    /// The next unclaimed receive (index, completion slot offset), if any (test hooks).
    pub(crate) fn next_unclaimed(&self) -> Option<(u32, usize)> {
        let c = layout::claim_index(self.claim().load(Ordering::Acquire));
        if c == self.prod().load(Ordering::Acquire) {
            return None;
        }
        Some((c, self.cqe_at(c)))
    }

    /// The limit word and event word of a shared queue.
    fn limit_words(&self) -> Option<(&AtomicU32, &AtomicU32)> {
        let st = self.srq.as_ref()?;
        Some((
            self.dev.in32(st.ctrl_in + srq_in::LIMIT),
            self.dev.in32(st.ctrl_in + srq_in::EVENT),
        ))
    }

    /// Arms the limit event (0 disarms).
    pub(crate) fn arm_limit(&self, limit: u32) -> crate::verbs::Result<()> {
        if limit > self.max_wr {
            return Err(crate::verbs::VerbsError::new(
                Verb::ModifySrq,
                ErrorKind::InvalidArgument,
                format!(
                    "SRQ limit {limit} exceeds the queue's {} receives",
                    self.max_wr
                ),
            ));
        }
        if let Some((l, _)) = self.limit_words() {
            l.store(limit, Ordering::SeqCst);
        }
        Ok(())
    }

    /// Takes a pending limit event.
    pub(crate) fn take_limit_event(&self) -> bool {
        self.limit_words().is_some_and(|(_, e)| {
            e.load(Ordering::Relaxed) != 0 && e.swap(0, Ordering::AcqRel) != 0
        })
    }

    /// Posted receives.
    pub(crate) fn max_wr(&self) -> u32 {
        self.max_wr
    }
}

impl Drop for Rq {
    fn drop(&mut self) {
        let (wqe_bytes, cqe_bytes) = Rq::ring_bytes(self.max_wr, self.max_sge);
        self.dev.pub_heap.free(self.wqe, wqe_bytes);
        self.dev.in_heap.free(self.cqe, cqe_bytes);
        if let Some((cq, bit)) = self.target.get() {
            cq.unreserve(u64::from(self.max_wr));
            cq.free_bit(*bit);
        }
        if let Some(st) = &self.srq {
            self.dev.in_heap.free(st.ctrl_in, layout::SRQ_IN_CTRL);
            self.dev.pub_heap.free(st.ctrl_pub, layout::SRQ_PUB_CTRL);
            self.dev.srq_live.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl SrqState {
    pub(crate) fn new(num: u32, pd: u32, ctrl_in: usize, ctrl_pub: usize) -> SrqState {
        SrqState {
            num,
            pd,
            ctrl_in,
            ctrl_pub,
            handle_dropped: AtomicBool::new(false),
            members: Mutex::new(Vec::new()),
            members_kept: std::sync::atomic::AtomicUsize::new(0),
            errored: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// The ring size of a queue of `max_wr` receives (a power of two).
fn ring_cap(max_wr: u32) -> u32 {
    max_wr.max(1).next_power_of_two()
}

/// Turns a receive completion written by a peer into a `Wc`, or into an error completion
/// (`Err`, the QP must move to ERROR) when any field is invalid.
fn decode_rcqe(
    wr_id: u64,
    posted_len: u64,
    byte_len: u32,
    imm: u32,
    meta: u32,
    qp_num: u32,
) -> Result<Wc, Wc> {
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
        (Some(opcode), Some(flags)) if valid_status && valid_len => Ok(Wc {
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
            qp_num,
            vendor_err: 0,
        }),
        _ => Err(Wc {
            wr_id,
            status: WcStatus::GeneralErr,
            opcode: WcOpcode::Recv,
            flags: WcFlags::NONE,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            vendor_err: vendor::CORRUPT,
        }),
    }
}

impl QpShared {
    /// Completes every posted, unclaimed receive of our own queue with WR_FLUSH_ERR (a QP
    /// of a shared queue flushes nothing: the receives are the queue's).
    pub(super) fn flush_rq(&self) {
        self.flush_rq_with(WcStatus::WrFlushErr as u32);
    }

    pub(super) fn flush_rq_with(&self, status_raw: u32) {
        if self.rq.srq.is_none() {
            self.rq.flush_with(status_raw, self.qp_num);
        } else {
            // A receive of the queue claimed by our dead peer may now be flushed.
            self.rq.ring(true);
        }
    }

    /// Drains our own queue's receive completions into `out`; returns (count, more).
    pub(crate) fn drain_recv(&self, out: &mut [Wc]) -> (usize, bool) {
        let _ = self.state();
        self.rq.drain(out, Some(self))
    }

    /// Whether receive `p`, claimed but never completed, belongs to a dead peer while we are
    /// in ERROR (then it is ours to flush).
    fn stuck_claim(&self, p: u32) -> bool {
        if self.raw_state() != QpState::Error {
            return false;
        }
        let c = layout::claim_index(self.rq.claim().load(Ordering::Acquire));
        let claimed = c.wrapping_sub(p) != 0 && c.wrapping_sub(p) <= self.rq.cap;
        claimed && self.peer_is_dead()
    }

    /// Whether the connected peer's process is gone.
    pub(crate) fn peer_is_dead(&self) -> bool {
        let live = self.peer_live.lock().unwrap_or_else(|e| e.into_inner());
        live.as_ref().is_some_and(|l| l.is_dead())
    }

    /// `post_recv`: refused in RESET and on a QP of a shared queue; in ERROR the receives
    /// are flushed at once.
    ///
    /// # Safety
    /// As [`Qp::post_recv`](crate::verbs::Qp::post_recv).
    pub(super) unsafe fn post_recv(
        &self,
        wrs: &[RecvWr<'_>],
    ) -> std::result::Result<(), PostError> {
        let verb = Verb::PostRecv;
        if self.rq.srq.is_some() {
            return Err(post_err(
                verb,
                0,
                ErrorKind::InvalidArgument,
                "post_recv on a QP of a shared receive queue: post to the SRQ".into(),
            ));
        }
        if self.state() == QpState::Reset {
            return Err(post_err(
                verb,
                0,
                ErrorKind::InvalidState,
                "post_recv on a QP in RESET: move it to INIT first".into(),
            ));
        }
        // SAFETY: forwarded contract.
        let result = unsafe { self.rq.post(verb, wrs) };
        if self.raw_state() == QpState::Error {
            self.flush_rq();
        }
        result
    }
}

/// The claim word a claimer for `me` swaps in for `w` (read from a shared queue's claim word;
/// receive `claim_index(w)` is posted): `(index + 1, me)`, after naming the claim `w` names
/// (that of `index - 1`, if any) in its slot, `name_of(i)` being the name word of receive
/// `i`. The one claim protocol of shared queues, for peers and the fault hooks alike.
#[inline]
pub(crate) fn shared_claim_next<'a>(
    w: u64,
    me: u32,
    name_of: impl FnOnce(u32) -> &'a AtomicU64,
) -> u64 {
    let (c, last) = (layout::claim_index(w), layout::claim_qp(w));
    if last != 0 {
        let prev = c.wrapping_sub(1);
        name_claim(name_of(prev), prev, last);
    }
    layout::claim_word(c.wrapping_add(1), me)
}

/// Writes `(idx, qp_num)` into the claim name word `name` of receive `idx`'s slot, unless the
/// word names `idx` already or a later lap of its slot: names move forward only, so a helper
/// that read the claim word long ago and writes late never overwrites a newer claim's name.
/// (Lock-free: a retry means another writer moved the word forward.)
#[inline]
fn name_claim(name: &AtomicU64, idx: u32, qp_num: u32) {
    let want = layout::claim_word(idx, qp_num);
    let mut cur = name.load(Ordering::Acquire);
    // Signed distance: laps are at most 2^31 apart in any ring the soft RNIC creates.
    while cur != want && (idx.wrapping_sub(layout::claim_index(cur)) as i32) > 0 {
        match name.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

/// Stores `v` unless the word holds it already (a published WQE word: only its owner writes).
#[inline]
fn set32(w: &AtomicU32, v: u32) {
    if w.load(Ordering::Relaxed) != v {
        w.store(v, Ordering::Relaxed);
    }
}

/// As [`set32`], for a 64-bit word.
#[inline]
fn set64(w: &AtomicU64, v: u64) {
    if w.load(Ordering::Relaxed) != v {
        w.store(v, Ordering::Relaxed);
    }
}
