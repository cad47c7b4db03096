//! Executing one send work request against the connected peer: the requester side of the
//! soft RNIC (and, since the requester does the responder's work too, its checks).
//!
//! Everything read from the peer's segments is validated before use: offsets were checked
//! against our mappings when connecting, indices are masked, counts bounded, keys, bounds and
//! rights checked on every access. A peer that wrote garbage gets an error completion, never
//! undefined behaviour here.

use std::cell::Cell;
use std::mem::MaybeUninit;

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use super::counters::QpCounters;
use super::layout::{self, mr, qp, qp_in, rcqe};
use super::mr::LocalMr;
use super::peer::{MapError, Peer, SharedRing};
use super::qp::shared_claim_next;
use super::shm::{self, CmaDir, Mapping};
use super::{CAPS, Device, vendor};
use crate::verbs::{
    Access, Endpoint, ErrorKind, QpState, Result, SendFlags, SendWr, Sge, Verb, VerbsError,
    WcFlags, WcOpcode, WcStatus, WrOp,
};

/// Most pieces one side of a copy can have (an SG list; inline data is one piece).
pub(crate) const MAX_PIECES: usize = CAPS.max_sge as usize;
/// Peer regions whose mapping a connection remembers (direct-mapped by slot).
const MR_CACHE: usize = 64;
/// How many receives ahead of the one a SEND fills its target lines are claimed for writing
/// (see [`Conn::own_ahead`]).
const WRITE_AHEAD: u32 = 4;

static ZERO32: AtomicU32 = AtomicU32::new(0);
static ZERO64: AtomicU64 = AtomicU64::new(0);

/// What executing a work request gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Finished with this status (the requester's completion).
    Done {
        status: WcStatus,
        byte_len: u32,
        vendor: u32,
    },
    /// The peer has no receive posted: retry after the RNR timer.
    Rnr,
    /// The peer QP is not (yet) connected to us: retry after the ACK timeout.
    NotReady,
}

impl Outcome {
    fn ok(byte_len: u32) -> Outcome {
        Outcome::Done {
            status: WcStatus::Success,
            byte_len,
            vendor: 0,
        }
    }

    fn err(status: WcStatus, vendor: u32) -> Outcome {
        Outcome::Done {
            status,
            byte_len: 0,
            vendor,
        }
    }
}

/// A work request as the executor sees it (from the caller's list or from the queue).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WrView<'a> {
    pub(crate) op: WrOp,
    pub(crate) flags: SendFlags,
    pub(crate) sges: &'a [Sge],
    /// Inline payload already copied out of the caller's buffers (queued requests).
    pub(crate) inline: Option<(*const u8, usize)>,
}

impl<'a> WrView<'a> {
    /// The view of a request from the caller's list, executed as posted.
    pub(crate) fn direct(wr: &SendWr<'a>) -> WrView<'a> {
        WrView {
            op: wr.op,
            flags: wr.flags,
            sges: wr.sg_list,
            inline: None,
        }
    }
}

/// Up to [`MAX_PIECES`] values on the stack, uninitialized until pushed. The data path builds
/// several of these per work request; zeroing whole arrays cost hundreds of bytes of stores
/// each time, and stores leave the store buffer in order, behind the cross-core stores of the
/// previous request, so a full buffer stalled the next request's first instructions.
pub(crate) struct Few<T: Copy> {
    v: [MaybeUninit<T>; MAX_PIECES],
    n: usize,
}

impl<T: Copy> Few<T> {
    fn new() -> Few<T> {
        Few {
            v: [const { MaybeUninit::uninit() }; MAX_PIECES],
            n: 0,
        }
    }

    /// Appends `t`; false when full.
    fn push(&mut self, t: T) -> bool {
        if self.n == MAX_PIECES {
            return false;
        }
        self.v[self.n].write(t);
        self.n += 1;
        true
    }

    fn as_slice(&self) -> &[T] {
        // SAFETY: `v[..n]` were written by `push` (and `n <= MAX_PIECES`).
        unsafe { std::slice::from_raw_parts(self.v.as_ptr().cast::<T>(), self.n) }
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for Few<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Local payload pieces: addresses in this process.
#[derive(Debug)]
pub(crate) struct Pieces {
    p: Few<(*mut u8, usize)>,
    total: u64,
}

impl Pieces {
    fn new() -> Pieces {
        Pieces {
            p: Few::new(),
            total: 0,
        }
    }

    fn push(&mut self, ptr: *mut u8, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        if !self.p.push((ptr, len)) {
            return false;
        }
        self.total += len as u64;
        true
    }

    fn as_slice(&self) -> &[(*mut u8, usize)] {
        self.p.as_slice()
    }
}

/// Resolves the local payload of `wr` into `pieces` (empty): lkey, PD, bounds and
/// (`need_write`) LOCAL_WRITE of every SGE, in our own MR table (which only we write).
pub(crate) fn local_pieces(
    dev: &Device,
    pd: u32,
    wr: &WrView<'_>,
    need_write: bool,
    pieces: &mut Pieces,
) -> std::result::Result<(), (WcStatus, u32)> {
    if let Some((ptr, len)) = wr.inline {
        pieces.push(ptr.cast_mut(), len);
        return Ok(());
    }
    let inline = wr.flags.contains(SendFlags::INLINE);
    for sge in wr.sges {
        if sge.length == 0 {
            continue;
        }
        if !inline {
            let m =
                LocalMr::lookup(dev, sge.lkey).ok_or((WcStatus::LocProtErr, vendor::BAD_KEY))?;
            if m.pd != pd {
                return Err((WcStatus::LocProtErr, vendor::WRONG_PD));
            }
            if !m.contains(sge.addr, u64::from(sge.length)) {
                return Err((WcStatus::LocProtErr, vendor::OUT_OF_BOUNDS));
            }
            if need_write && !m.access.contains(Access::LOCAL_WRITE) {
                return Err((WcStatus::LocProtErr, vendor::NO_RIGHT));
            }
        }
        if !pieces.push(sge.addr as *mut u8, sge.length as usize) {
            return Err((WcStatus::LocQpOpErr, vendor::CORRUPT));
        }
    }
    if pieces.total > CAPS.max_msg_size {
        return Err((WcStatus::LocLenErr, vendor::MSG_TOO_BIG));
    }
    Ok(())
}

/// A remote range resolved for access: either a pointer in this process (our mapping of the
/// peer's memfd, or the peer's own address when it lives in this process) or an address in
/// the peer process (reached with `process_vm_*`).
#[derive(Debug, Clone, Copy)]
struct Target {
    ptr: *mut u8,
    addr: u64,
    len: usize,
}

/// Pin counters raised for user-memory regions, lowered on drop.
struct Pins {
    w: Few<NonNull<AtomicU32>>,
}

impl Pins {
    fn new() -> Pins {
        Pins { w: Few::new() }
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for w in self.w.as_slice() {
            // SAFETY: each pointer names a pin word in the peer's inbox mapping, which the
            // connection's `Arc<Peer>` keeps mapped for the whole execution this guard lives
            // in (the guard never outlives `Conn::execute`).
            unsafe { w.as_ref() }.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Result of claiming a receive of the peer.
enum Claim {
    Got(u32),
    Empty,
    Corrupt,
}

/// The connection of one of our QPs to a peer QP: validated geometry of the peer's queue and
/// cached mappings of its regions. Lives under the QP's progress flag.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) peer: Arc<Peer>,
    peer_qp_num: u32,
    pe: usize,
    pin_entry: usize,
    peer_pd: u32,
    rq_wqe: usize,
    rq_cqe: usize,
    rq_mask: u32,
    rq_stride: usize,
    rq_max_sge: u32,
    /// Offsets of the peer's receive producer index (published) and claim word (inbox):
    /// its QP's own, or its shared receive queue's.
    rq_prod: usize,
    rq_claim: usize,
    /// The peer QP receives through a shared receive queue: claims go one at a time, name
    /// the QP, and may raise the queue's limit event.
    shared_rq: bool,
    /// Our side's bit in the peer's receive CQ.
    ready: layout::ReadyBit,
    /// The number and id of the peer's completion-channel eventfd (signalled through the
    /// peer's bounded cache of duplicates, [`Peer::signal_eventfd`]), if its receive CQ has
    /// one, and whether we hold its duplicate ([`Peer::hold_eventfd`]; released on drop).
    efd: Option<(u32, u32)>,
    efd_held: bool,
    cache: [(u32, Option<Arc<Mapping>>); MR_CACHE],
    my_qp_num: u32,
    my_nonce: u64,
    /// The counters of our QP (written under its progress flag, as everything here).
    counters: Arc<QpCounters>,
    /// Inside a list of work requests ([`Conn::begin_list`]): rings wait for its end.
    in_list: Cell<bool>,
    /// A ring owed at the end of the list: bit 0 owed, bit 1 solicited.
    owed: Cell<u8>,
    /// The CPU has PREFETCHW (see [`Conn::own_ahead`]).
    prefetchw: bool,
    /// Receives of the peer claimed for the current list, `[next, end)` (see
    /// [`Conn::begin_list`]).
    ahead: Cell<(u32, u32)>,
}

fn bad_ep(detail: String) -> VerbsError {
    VerbsError::new(Verb::Connect, ErrorKind::InvalidEndpoint, detail)
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let (Some((fd, id)), true) = (self.efd, self.efd_held) {
            self.peer.release_eventfd(fd, id);
        }
    }
}

/// Whether the CPU has PREFETCHW (every x86-64 CPU of the last decade; checked once).
fn has_prefetchw() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            // CPUID itself is on every x86-64 CPU; leaf 0x8000_0001 ECX bit 8 is PREFETCHW.
            let max = std::arch::x86_64::__cpuid(0x8000_0000).eax;
            max >= 0x8000_0001 && (std::arch::x86_64::__cpuid(0x8000_0001).ecx >> 8) & 1 == 1
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks for the cache line at `p` in a writable state (PREFETCHW). Only called where
/// [`has_prefetchw`] said yes.
#[inline(always)]
fn prefetch_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and has no architectural effect, whatever the address;
    // the CPU supports the instruction (checked by the caller through `has_prefetchw`).
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Decodes a soft endpoint's gid: (pid, descriptor of the published segment, nonce).
pub(crate) fn decode_gid(gid: &[u8; 16]) -> (u32, u32, u64) {
    let pid = u32::from_le_bytes([gid[0], gid[1], gid[2], gid[3]]);
    let fd = u32::from_le_bytes([gid[4], gid[5], gid[6], gid[7]]);
    let mut n = [0u8; 8];
    n.copy_from_slice(&gid[8..16]);
    (pid, fd, u64::from_le_bytes(n))
}

/// Encodes (pid, descriptor, nonce) as a gid.
pub(crate) fn encode_gid(pid: u32, fd: u32, nonce: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0..4].copy_from_slice(&pid.to_le_bytes());
    g[4..8].copy_from_slice(&fd.to_le_bytes());
    g[8..16].copy_from_slice(&nonce.to_le_bytes());
    g
}

impl Conn {
    /// Validates `ep` and attaches to the peer QP it names (INIT -> RTR).
    pub(crate) fn connect(
        dev: &Arc<Device>,
        my_qp_num: u32,
        ep: &Endpoint,
        counters: Arc<QpCounters>,
    ) -> Result<Conn> {
        if ep.provider != Endpoint::PROVIDER_SOFT {
            return Err(bad_ep(format!(
                "the endpoint is for provider tag {} (ib), not soft: both ends must use the same \
                 provider (RPC_PROVIDER)",
                ep.provider
            )));
        }
        let (pid, fd, nonce) = decode_gid(&ep.gid);
        let peer = dev.attach(pid, fd, nonce)?;
        let slot = (ep.qp_num & ((1 << layout::QP_SLOT_BITS) - 1)) as usize;
        let pe = layout::qp_entry(slot);
        let rd32 = |off: usize| {
            peer.pub_map
                .u32_at(pe + off)
                .map_or(0, |w| w.load(Ordering::Acquire))
        };
        let rd64 = |off: usize| {
            peer.pub_map
                .u64_at(pe + off)
                .map_or(0, |w| w.load(Ordering::Acquire))
        };
        if ep.qp_num == 0 || rd32(qp::QP_NUM) != ep.qp_num {
            return Err(bad_ep(format!(
                "no QP {:#x} on the soft RNIC of process {pid}: it was destroyed (stale endpoint) \
                 or never existed (forged endpoint)",
                ep.qp_num
            )));
        }
        match QpState::from_u8(rd32(qp::STATE) as u8) {
            Some(QpState::Error) => {
                return Err(bad_ep(format!(
                    "peer QP {:#x} is in ERROR: it cannot be connected to",
                    ep.qp_num
                )));
            }
            None => {
                return Err(VerbsError::new(
                    Verb::Connect,
                    ErrorKind::Corrupt,
                    format!("peer QP {:#x} has a corrupt state word", ep.qp_num),
                ));
            }
            _ => {}
        }
        let corrupt = |what: &str| {
            VerbsError::new(
                Verb::Connect,
                ErrorKind::Corrupt,
                format!(
                    "peer QP {:#x} in process {pid} has a corrupt {what}: refusing to connect",
                    ep.qp_num
                ),
            )
        };
        let depth = rd32(qp::RQ_DEPTH);
        // A QP of an SRQ publishes the SRQ's ring, which may be deeper than a QP's own.
        if !depth.is_power_of_two() || depth > 2 * CAPS.max_qp_wr.max(CAPS.max_srq_wr) {
            return Err(corrupt("receive queue depth"));
        }
        let max_sge = rd32(qp::RQ_MAX_SGE);
        if max_sge > CAPS.max_sge {
            return Err(corrupt("receive SGE count"));
        }
        let stride = layout::wqe_stride(max_sge.max(1) as usize);
        let rq_wqe = usize::try_from(rd64(qp::RQ_WQE)).unwrap_or(usize::MAX);
        let rq_cqe = usize::try_from(rd64(qp::RQ_CQE)).unwrap_or(usize::MAX);
        if rq_wqe < layout::PUB_HEAP
            || rq_wqe % 16 != 0
            || !peer.pub_map.contains(rq_wqe, depth as usize * stride)
        {
            return Err(corrupt("receive ring offset"));
        }
        if rq_cqe < layout::IN_HEAP
            || rq_cqe % 16 != 0
            || !peer.inbox.contains(rq_cqe, depth as usize * layout::RCQE)
        {
            return Err(corrupt("completion ring offset"));
        }
        let shared_rq = match rd32(qp::SHARED_RQ) {
            0 => false,
            1 => true,
            _ => return Err(corrupt("receive queue kind")),
        };
        let rq_prod = usize::try_from(rd64(qp::RQ_PROD_AT)).unwrap_or(usize::MAX);
        let rq_claim = usize::try_from(rd64(qp::RQ_CLAIM_AT)).unwrap_or(usize::MAX);
        let own = (
            pe + qp::RQ_PROD,
            layout::qp_in_entry(slot) + qp_in::RQ_CLAIM,
        );
        let valid_rq_words = if shared_rq {
            rq_prod >= layout::PUB_HEAP
                && rq_prod % 64 == 0
                && peer.pub_map.contains(rq_prod, 4)
                && rq_claim >= layout::IN_HEAP
                && rq_claim % 64 == 0
                && peer.inbox.contains(rq_claim, layout::SRQ_IN_CTRL)
        } else {
            (rq_prod, rq_claim) == own
        };
        if !valid_rq_words {
            return Err(corrupt("receive queue index offsets"));
        }
        if shared_rq {
            let head = peer
                .inbox
                .u64_at(rq_claim)
                .map_or(0, |w| layout::claim_index(w.load(Ordering::Acquire)));
            let ring = SharedRing {
                wqe: rq_wqe,
                stride,
                cqe: rq_cqe,
                depth,
                head,
            };
            peer.populate_shared_ring(&ring);
        }
        let cq = rd32(qp::RECV_CQ) as usize;
        let bit = rd32(qp::RECV_BIT) as usize;
        if cq >= layout::MAX_CQ || bit >= layout::CQ_BITS {
            return Err(corrupt("receive CQ"));
        }
        let chan = rd32(qp::CHAN_FD);
        let chan_id = rd32(qp::CHAN_ID);
        let efd = (chan != u32::MAX).then_some((chan, chan_id));
        let efd_held = efd.is_some() && peer.hold_eventfd(chan, chan_id);
        if efd.is_some() && !efd_held {
            tracing::warn!(
                pid,
                fd = chan,
                "soft RNIC: cannot reach the peer's completion channel; its sleepers will \
                     not be woken by our completions"
            );
        }
        Ok(Conn {
            peer_qp_num: ep.qp_num,
            pe,
            pin_entry: layout::qp_in_entry(slot),
            peer_pd: rd32(qp::PD),
            rq_wqe,
            rq_cqe,
            rq_mask: depth - 1,
            rq_stride: stride,
            rq_max_sge: max_sge,
            rq_prod,
            rq_claim,
            shared_rq,
            ready: layout::ReadyBit::new(cq, bit),
            efd,
            efd_held,
            cache: std::array::from_fn(|_| (0, None)),
            my_qp_num,
            my_nonce: dev.nonce,
            peer,
            counters,
            in_list: Cell::new(false),
            owed: Cell::new(0),
            prefetchw: has_prefetchw(),
            ahead: Cell::new((0, 0)),
        })
    }

    /// The connected peer QP's `min_rnr_timer` (its RNR NAK timer), as published at its RTR.
    pub(crate) fn peer_rnr_timer(&self) -> u8 {
        (self.p32(self.pe + qp::RNR_TIMER).load(Ordering::Relaxed) & 31) as u8
    }

    #[inline]
    fn p32(&self, off: usize) -> &AtomicU32 {
        self.peer.pub_map.u32_at(off).unwrap_or(&ZERO32)
    }

    #[inline]
    fn p64(&self, off: usize) -> &AtomicU64 {
        self.peer.pub_map.u64_at(off).unwrap_or(&ZERO64)
    }

    #[inline]
    fn i32(&self, off: usize) -> &AtomicU32 {
        self.peer.inbox.u32_at(off).unwrap_or(&ZERO32)
    }

    #[inline]
    fn i64(&self, off: usize) -> &AtomicU64 {
        self.peer.inbox.u64_at(off).unwrap_or(&ZERO64)
    }

    /// Whether the peer QP still is the one we connected to, connected back to us, and ready.
    /// Gives the rights it grants, or the outcome to report.
    #[inline]
    fn check_peer(&self) -> std::result::Result<Access, Outcome> {
        if self.peer.live.is_dead() {
            return Err(Outcome::err(WcStatus::RetryExcErr, vendor::PEER_DEAD));
        }
        if self.p32(self.pe + qp::QP_NUM).load(Ordering::Acquire) != self.peer_qp_num {
            return Err(Outcome::err(WcStatus::RetryExcErr, vendor::PEER_QP_GONE));
        }
        match QpState::from_u8(self.p32(self.pe + qp::STATE).load(Ordering::Acquire) as u8) {
            Some(QpState::Rtr | QpState::Rts) => {}
            Some(QpState::Reset | QpState::Init) => return Err(Outcome::NotReady),
            Some(QpState::Error) => {
                return Err(Outcome::err(WcStatus::RetryExcErr, vendor::PEER_QP_GONE));
            }
            None => return Err(Outcome::err(WcStatus::RetryExcErr, vendor::CORRUPT)),
        }
        if self.p32(self.pe + qp::REMOTE_QP).load(Ordering::Relaxed) != self.my_qp_num
            || self.p64(self.pe + qp::REMOTE_NONCE).load(Ordering::Relaxed) != self.my_nonce
        {
            // Connected to someone else (or not yet to us): its packets would be dropped.
            return Err(Outcome::NotReady);
        }
        Ok(Access::from_bits_truncate(
            self.p32(self.pe + qp::ACCESS).load(Ordering::Relaxed),
        ))
    }

    /// Marks the peer QP failed (fatal remote error) and rings it so it notices.
    fn fail_peer(&self) {
        self.i32(self.pin_entry + qp_in::REMOTE_ERROR)
            .store(1, Ordering::SeqCst);
        self.ring(true);
    }

    /// Starts executing a list of work requests posted together, `consumers` of which take a
    /// receive of the peer (SENDs and WRITE_WITH_IMMs): the peer's CQ is rung once, at
    /// [`Conn::end_list`], as an RNIC writes a burst of completions before the consumer looks
    /// (and the one cross-core write to the peer's ready bitmap is paid once a burst); and the
    /// receives they will fill are claimed with one compare-exchange rather than one each (a
    /// locked instruction waits for every earlier store, the previous SEND's cross-core ones
    /// included, to drain).
    #[inline]
    pub(crate) fn begin_list(&self, consumers: usize) {
        self.in_list.set(true);
        // A shared queue's receives are claimed one at a time: the ones a list would hand
        // back may have been taken by another peer meanwhile.
        if consumers < 2 || self.shared_rq {
            return;
        }
        // None posted, or a corrupt index: each request claims (and reports) on its own.
        if let (Claim::Got(c), k) = self.claim_up_to(u32::try_from(consumers).unwrap_or(u32::MAX)) {
            self.ahead.set((c, c.wrapping_add(k)));
        }
    }

    /// Ends a list: gives back the receives claimed for it that it did not fill, and rings the
    /// peer if anything in it completed there.
    #[inline]
    pub(crate) fn end_list(&self) {
        let (next, end) = self.ahead.replace((0, 0));
        if next != end {
            // Only the owner's flush moves the claim besides us: if it did, the receives we
            // held are ours to complete, flushed as the owner flushed the rest.
            let claim = self.i64(self.rq_claim);
            let (held, back) = (layout::claim_word(end, 0), layout::claim_word(next, 0));
            if claim
                .compare_exchange(held, back, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                let mut i = next;
                while i != end {
                    self.recv_complete(
                        i,
                        WcStatus::WrFlushErr,
                        WcOpcode::Recv,
                        0,
                        None,
                        false,
                        false,
                    );
                    i = i.wrapping_add(1);
                }
            }
        }
        self.in_list.set(false);
        let owed = self.owed.replace(0);
        if owed & 1 != 0 {
            self.ring(owed & 2 != 0);
        }
    }

    /// Sets our bit in the peer's receive CQ and signals its channel when armed.
    #[inline]
    fn ring(&self, solicited: bool) {
        if self.in_list.get() {
            self.owed
                .set(self.owed.get() | 1 | u8::from(solicited) << 1);
            return;
        }
        self.counters.add_ring();
        if self
            .ready
            .raise(|o| self.i64(o), |o| self.i32(o), solicited)
            && let Some((fd, id)) = self.efd
        {
            self.peer.signal_eventfd(fd, id);
        }
    }

    /// Claims the next receive the peer posted.
    #[inline]
    fn claim(&self) -> Claim {
        let (next, end) = self.ahead.get();
        if next != end {
            self.ahead.set((next.wrapping_add(1), end));
            return Claim::Got(next);
        }
        self.claim_up_to(1).0
    }

    /// Claims up to `max` (at least 1) consecutive receives the peer posted, with one
    /// compare-exchange: the first and how many (one at a time from a shared queue).
    fn claim_up_to(&self, max: u32) -> (Claim, u32) {
        let claim = self.i64(self.rq_claim);
        loop {
            // Claim first, then the producer index: the owner never moves the claim past a
            // producer index it published, so `c <= prod` unless the peer is corrupt.
            let w = claim.load(Ordering::Acquire);
            let c = layout::claim_index(w);
            let prod = self.p32(self.rq_prod).load(Ordering::Acquire);
            let avail = prod.wrapping_sub(c);
            if avail == 0 {
                return (Claim::Empty, 0);
            }
            if avail > self.rq_mask + 1 {
                return (Claim::Corrupt, 0);
            }
            let (k, next) = if self.shared_rq {
                // The word names the last claim (`c - 1`'s) only: it is named in its slot
                // before the word moves past it (usually its claimer did so already).
                let name_of = |i: u32| self.i64(self.rcqe_at(i) + rcqe::NAME);
                (1, shared_claim_next(w, self.peer_qp_num, name_of))
            } else {
                let k = avail.min(max.max(1));
                (k, layout::claim_word(c.wrapping_add(k), 0))
            };
            if claim
                .compare_exchange(w, next, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                if self.shared_rq {
                    self.claimed_shared(c, avail - k);
                }
                return (Claim::Got(c), k);
            }
        }
    }

    /// The offset of the peer's receive completion slot of receive `idx`.
    #[inline]
    fn rcqe_at(&self, idx: u32) -> usize {
        self.rq_cqe + (idx & self.rq_mask) as usize * layout::RCQE
    }

    /// After claiming receive `idx` of a shared queue (named by the claim word until the next
    /// claim), `left` others still posted: names the claim in its slot too (so that the next
    /// claimer finds it named and writes nothing there; a plain store, since only an older
    /// lap's name can be there: a later lap needs this receive completed first), and raises
    /// the queue's limit event when fewer than the armed limit are left (the one claimer that
    /// disarms the limit raises it).
    #[inline]
    fn claimed_shared(&self, idx: u32, left: u32) {
        self.i64(self.rcqe_at(idx) + rcqe::NAME)
            .store(layout::claim_word(idx, self.peer_qp_num), Ordering::Release);
        let ctrl = self.rq_claim - layout::srq_in::CLAIM;
        let limit = self.i32(ctrl + layout::srq_in::LIMIT);
        let armed = limit.load(Ordering::Relaxed);
        if armed != 0
            && left < armed
            && limit
                .compare_exchange(armed, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.i32(ctrl + layout::srq_in::EVENT)
                .store(1, Ordering::Release);
        }
    }

    /// SGE `i` of the peer's receive WQE at `base`: (address, length, key), as the peer wrote
    /// them (checked by whoever uses them).
    #[inline]
    fn peer_sge(&self, base: usize, i: usize) -> (u64, u32, u32) {
        let s = base + layout::WQE_HDR + i * layout::WQE_SGE;
        (
            self.p64(s).load(Ordering::Relaxed),
            self.p32(s + 8).load(Ordering::Relaxed),
            self.p32(s + 12).load(Ordering::Relaxed),
        )
    }

    /// Starts taking ownership of the lines a later SEND will write: the start of the buffer
    /// of the peer's receive `idx` (when it is posted and lies in a region already mapped; as
    /// many bytes as this SEND carries, up to two lines) and its completion entry. Those lines
    /// were last read by the peer, on another core: each store to one waits for the line to
    /// come over, and x86 commits stores in order, so without this every SEND of a list waits
    /// for its own lines in turn (and its later stores, to the stack included, queue behind
    /// them). Asked a few receives ahead, the transfers overlap. A hint only: nothing is
    /// written, and nothing read here is trusted.
    #[inline]
    fn own_ahead(&self, idx: u32, bytes: u64) {
        if !self.prefetchw {
            return;
        }
        let prod = self.p32(self.rq_prod).load(Ordering::Relaxed);
        let posted = prod.wrapping_sub(idx);
        if posted == 0 || posted > self.rq_mask + 1 {
            return;
        }
        let cqe = self.rcqe_at(idx);
        if let Some(w) = self.peer.inbox.u32_at(cqe) {
            prefetch_write(w.as_ptr().cast());
        }
        let base = self.rq_wqe + (idx & self.rq_mask) as usize * self.rq_stride;
        if self.p32(base).load(Ordering::Relaxed) == 0 {
            return;
        }
        let (addr, len, lkey) = self.peer_sge(base, 0);
        let len = len as usize;
        let slot = (lkey & ((1 << layout::MR_SLOT_BITS) - 1)) as usize;
        let (key, Some(map)) = &self.cache[slot % MR_CACHE] else {
            return;
        };
        if *key != lkey || lkey == 0 {
            return;
        }
        let mr_base = self
            .p64(layout::mr_entry(slot) + mr::ADDR)
            .load(Ordering::Relaxed);
        let Some(off) = addr
            .checked_sub(mr_base)
            .and_then(|o| usize::try_from(o).ok())
        else {
            return;
        };
        let n = (bytes as usize).clamp(1, 128).min(len.max(1));
        if map.writable() && map.contains(off, n) {
            let p = map.ptr().wrapping_add(off);
            prefetch_write(p);
            if n > 64 - (p as usize & 63) {
                prefetch_write(p.wrapping_add(64));
            }
        }
    }

    /// Publishes the completion of the peer's receive `idx`.
    #[allow(clippy::too_many_arguments)]
    fn recv_complete(
        &self,
        idx: u32,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        solicited: bool,
        fatal: bool,
    ) {
        let base = self.rcqe_at(idx);
        let flags = if imm.is_some() { 1u32 } else { 0 };
        let meta = status as u32 | (opcode as u32) << 8 | flags << 16 | u32::from(solicited) << 24;
        self.i32(base + rcqe::BYTE_LEN)
            .store(byte_len, Ordering::Relaxed);
        self.i32(base + rcqe::IMM)
            .store(imm.unwrap_or(0), Ordering::Relaxed);
        self.i32(base + rcqe::META).store(meta, Ordering::Relaxed);
        self.i32(base + rcqe::QP)
            .store(self.peer_qp_num, Ordering::Relaxed);
        self.i32(base + rcqe::SEQ)
            .store(idx.wrapping_add(1), Ordering::Release);
        if fatal {
            self.i32(self.pin_entry + qp_in::REMOTE_ERROR)
                .store(1, Ordering::SeqCst);
        }
        self.ring(solicited || fatal || status != WcStatus::Success);
    }

    /// Resolves `[addr, addr + len)` of the peer's region `key` for `need`. `qp_access` is
    /// the right the peer's QP grants (None for receive buffers, which need LOCAL_WRITE).
    fn resolve(
        &mut self,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
        qp_access: Option<Access>,
        pins: &mut Pins,
    ) -> std::result::Result<Target, u32> {
        let slot = key & ((1 << layout::MR_SLOT_BITS) - 1);
        let e = layout::mr_entry(slot as usize);
        let key_word = self.p32(e + mr::KEY);
        let k1 = key_word.load(Ordering::Acquire);
        if key == 0 || k1 != key {
            return Err(vendor::BAD_KEY);
        }
        let access = Access::from_bits_truncate(self.p32(e + mr::ACCESS).load(Ordering::Relaxed));
        let kind = self.p32(e + mr::KIND).load(Ordering::Relaxed);
        let fd = self.p32(e + mr::FD).load(Ordering::Relaxed);
        let base = self.p64(e + mr::ADDR).load(Ordering::Relaxed);
        let mlen = self.p64(e + mr::LEN).load(Ordering::Relaxed);
        let pd = self.p32(e + mr::PD).load(Ordering::Relaxed);
        let parent_key = self.p32(e + mr::PARENT_KEY).load(Ordering::Relaxed);
        let bound = self.p64(e + mr::BOUND).load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if key_word.load(Ordering::Relaxed) != k1 {
            return Err(vendor::BAD_KEY);
        }
        if pd != self.peer_pd {
            return Err(vendor::WRONG_PD);
        }
        if !access.contains(need) || qp_access.is_some_and(|q| !q.contains(need)) {
            return Err(vendor::NO_RIGHT);
        }
        let inside = addr >= base
            && base.checked_add(mlen).is_some()
            && addr.checked_add(len).is_some_and(|end| end <= base + mlen);
        if !inside {
            return Err(vendor::OUT_OF_BOUNDS);
        }
        let len_us = usize::try_from(len).map_err(|_| vendor::OUT_OF_BOUNDS)?;
        match kind {
            layout::MR_KIND_SHM => self.shm_target(slot, key, fd, base, mlen, addr, len_us),
            layout::MR_KIND_WINDOW => {
                // Bound to one peer RNIC: ours, or the access is refused.
                if bound != self.my_nonce {
                    return Err(vendor::WRONG_PEER);
                }
                // Pinned before the key is checked again, so the owner's revocation (which
                // clears the key, then waits for the pin count to drop) either sees this
                // access and waits for it, or this access sees the cleared key.
                self.pin(slot, pins)?;
                if key_word.load(Ordering::SeqCst) != key {
                    return Err(vendor::BAD_KEY);
                }
                // The region the window lends, still registered under the key it had when the
                // window was bound.
                let ps = fd & ((1 << layout::MR_SLOT_BITS) - 1);
                let pe = layout::mr_entry(ps as usize);
                let pkey_word = self.p32(pe + mr::KEY);
                if parent_key == 0 || pkey_word.load(Ordering::Acquire) != parent_key {
                    return Err(vendor::BAD_KEY);
                }
                let pkind = self.p32(pe + mr::KIND).load(Ordering::Relaxed);
                let pfd = self.p32(pe + mr::FD).load(Ordering::Relaxed);
                let pbase = self.p64(pe + mr::ADDR).load(Ordering::Relaxed);
                let plen = self.p64(pe + mr::LEN).load(Ordering::Relaxed);
                fence(Ordering::Acquire);
                if pkey_word.load(Ordering::Relaxed) != parent_key {
                    return Err(vendor::BAD_KEY);
                }
                if pkind != layout::MR_KIND_SHM {
                    return Err(vendor::CORRUPT);
                }
                self.shm_target(ps, parent_key, pfd, pbase, plen, addr, len_us)
            }
            layout::MR_KIND_USER => {
                self.pin(slot, pins)?;
                if key_word.load(Ordering::SeqCst) != key {
                    return Err(vendor::BAD_KEY);
                }
                let ptr = if self.peer.same_process {
                    addr as *mut u8
                } else {
                    std::ptr::null_mut()
                };
                Ok(Target {
                    ptr,
                    addr,
                    len: len_us,
                })
            }
            _ => Err(vendor::CORRUPT),
        }
    }

    /// Raises the pin counter of the peer's region `slot` (in the peer's inbox) for the
    /// duration of this access: `pins` drops it again when the access is over.
    #[inline]
    fn pin(&self, slot: u32, pins: &mut Pins) -> std::result::Result<(), u32> {
        let pin = self
            .peer
            .inbox
            .u32_at(layout::pin(slot as usize))
            .ok_or(vendor::CORRUPT)?;
        if pins.w.n == MAX_PIECES {
            return Err(vendor::CORRUPT);
        }
        pin.fetch_add(1, Ordering::SeqCst);
        pins.w.push(NonNull::from(pin));
        Ok(())
    }

    /// The target `[addr, addr + len)` inside the peer's shared-memory region in `slot`
    /// (registered under `key`, descriptor `fd`, `[base, base + mlen)`), through the
    /// connection's cache of mappings.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn shm_target(
        &mut self,
        slot: u32,
        key: u32,
        fd: u32,
        base: u64,
        mlen: u64,
        addr: u64,
        len: usize,
    ) -> std::result::Result<Target, u32> {
        // Borrowed, not cloned: a clone and its drop are two locked instructions on a shared
        // count per SEND.
        let c = &mut self.cache[slot as usize % MR_CACHE];
        if c.0 != key || c.1.is_none() {
            let m = self.peer.map_mr(slot, key, fd, mlen).map_err(|e| match e {
                MapError::Stale => vendor::BAD_KEY,
                MapError::Failed => vendor::MAP_FAILED,
            })?;
            *c = (key, Some(m));
        }
        let Some(map) = &c.1 else {
            return Err(vendor::MAP_FAILED);
        };
        let off = addr
            .checked_sub(base)
            .and_then(|o| usize::try_from(o).ok())
            .ok_or(vendor::OUT_OF_BOUNDS)?;
        if !map.contains(off, len) || !map.writable() {
            return Err(vendor::MAP_FAILED);
        }
        // The mapping stays alive: the cache (and the peer's map table) hold it for at least
        // as long as this execution.
        Ok(Target {
            // SAFETY: `off + len <= map.len()` was checked just above.
            ptr: unsafe { map.ptr().add(off) },
            addr,
            len,
        })
    }

    /// Executes one work request.
    pub(crate) fn execute(&mut self, dev: &Device, pd: u32, wr: &WrView<'_>) -> Outcome {
        let peer_access = match self.check_peer() {
            Ok(a) => a,
            Err(o) => return o,
        };
        let need_write = matches!(
            wr.op,
            WrOp::Read { .. } | WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. }
        );
        // Filled in place: returning it by value compiled to a wide copy of just-written
        // fields, which waits for every earlier store (the cross-core ones included) to drain.
        let mut local = Pieces::new();
        if let Err((s, v)) = local_pieces(dev, pd, wr, need_write, &mut local) {
            self.counters.add_op(0);
            return Outcome::err(s, v);
        }
        let solicited = wr.flags.contains(SendFlags::SOLICITED);
        let out = match wr.op {
            WrOp::Send => self.send(&local, None, solicited),
            WrOp::SendWithImm { imm } => self.send(&local, Some(imm), solicited),
            WrOp::Write { remote_addr, rkey } => {
                self.write(&local, remote_addr, rkey, None, solicited, peer_access)
            }
            WrOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => self.write(&local, remote_addr, rkey, Some(imm), solicited, peer_access),
            WrOp::Read { remote_addr, rkey } => self.read(&local, remote_addr, rkey, peer_access),
            WrOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => self.atomic(&local, remote_addr, rkey, peer_access, |w| {
                match w.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(v) | Err(v) => v,
                }
            }),
            WrOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => self.atomic(&local, remote_addr, rkey, peer_access, |w| {
                w.fetch_add(add, Ordering::SeqCst)
            }),
        };
        match out {
            Outcome::Done { status, .. } => {
                let bytes = if status == WcStatus::Success {
                    local.total
                } else {
                    0
                };
                self.counters.add_op(bytes);
            }
            Outcome::Rnr | Outcome::NotReady => {}
        }
        out
    }

    fn send(&mut self, local: &Pieces, imm: Option<u32>, solicited: bool) -> Outcome {
        let idx = match self.claim() {
            Claim::Got(i) => i,
            Claim::Empty => return Outcome::Rnr,
            Claim::Corrupt => {
                self.fail_peer();
                return Outcome::err(WcStatus::RemOpErr, vendor::CORRUPT);
            }
        };
        self.own_ahead(idx.wrapping_add(WRITE_AHEAD), local.total);
        let opcode = WcOpcode::Recv;
        let base = self.rq_wqe + (idx & self.rq_mask) as usize * self.rq_stride;
        let nsge = self.p32(base).load(Ordering::Relaxed);
        if nsge > self.rq_max_sge {
            self.recv_complete(idx, WcStatus::LocQpOpErr, opcode, 0, None, true, true);
            return Outcome::err(WcStatus::RemOpErr, vendor::BAD_RECV);
        }
        let mut targets = Few::<Target>::new();
        let mut cap = 0u64;
        let mut pins = Pins::new();
        for i in 0..nsge as usize {
            let (addr, len, lkey) = self.peer_sge(base, i);
            if len == 0 {
                continue;
            }
            match self.resolve(
                lkey,
                addr,
                u64::from(len),
                Access::LOCAL_WRITE,
                None,
                &mut pins,
            ) {
                // At most `rq_max_sge` (<= MAX_PIECES, checked at connect) targets.
                Ok(t) if targets.push(t) => cap += u64::from(len),
                Ok(_) => {
                    drop(pins);
                    self.recv_complete(idx, WcStatus::LocQpOpErr, opcode, 0, None, true, true);
                    return Outcome::err(WcStatus::RemOpErr, vendor::BAD_RECV);
                }
                Err(_) => {
                    drop(pins);
                    self.recv_complete(idx, WcStatus::LocProtErr, opcode, 0, None, true, true);
                    return Outcome::err(WcStatus::RemOpErr, vendor::BAD_RECV);
                }
            }
        }
        if local.total > cap {
            drop(pins);
            self.recv_complete(idx, WcStatus::LocLenErr, opcode, 0, None, true, true);
            return Outcome::err(WcStatus::RemInvReqErr, vendor::RECV_TOO_SMALL);
        }
        // SAFETY: local pieces are caller memory valid for reading (post_send contract) or
        // our own inline buffer; targets were resolved and bounds-checked just above and are
        // kept mapped/pinned by `self`/`pins` until the copy returns.
        let r = unsafe { copy_out(local, targets.as_slice(), self.peer.pid) };
        drop(pins);
        if let Err(v) = r {
            if v == vendor::PEER_DEAD {
                return Outcome::err(WcStatus::RetryExcErr, v);
            }
            self.recv_complete(idx, WcStatus::LocProtErr, opcode, 0, None, true, true);
            return Outcome::err(WcStatus::RemOpErr, v);
        }
        let len = u32::try_from(local.total).unwrap_or(u32::MAX);
        self.recv_complete(idx, WcStatus::Success, opcode, len, imm, solicited, false);
        Outcome::ok(0)
    }

    fn write(
        &mut self,
        local: &Pieces,
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
        solicited: bool,
        peer_access: Access,
    ) -> Outcome {
        let mut pins = Pins::new();
        let target = if local.total == 0 {
            None // zero-length RDMA: the rkey is not checked (IB spec C9-88)
        } else {
            match self.resolve(
                rkey,
                remote_addr,
                local.total,
                Access::REMOTE_WRITE,
                Some(peer_access),
                &mut pins,
            ) {
                Ok(t) => Some(t),
                Err(v) => {
                    drop(pins);
                    self.fail_peer();
                    return Outcome::err(WcStatus::RemAccessErr, v);
                }
            }
        };
        let idx = if imm.is_some() {
            match self.claim() {
                Claim::Got(i) => Some(i),
                Claim::Empty => return Outcome::Rnr,
                Claim::Corrupt => {
                    drop(pins);
                    self.fail_peer();
                    return Outcome::err(WcStatus::RemOpErr, vendor::CORRUPT);
                }
            }
        } else {
            None
        };
        if let Some(t) = target {
            // SAFETY: as in `send`: local memory valid per contract, target resolved,
            // bounds-checked and kept mapped/pinned until the copy returns.
            if let Err(v) = unsafe { copy_out(local, &[t], self.peer.pid) } {
                drop(pins);
                if v == vendor::PEER_DEAD {
                    return Outcome::err(WcStatus::RetryExcErr, v);
                }
                if let Some(i) = idx {
                    self.recv_complete(
                        i,
                        WcStatus::WrFlushErr,
                        WcOpcode::RecvRdmaWithImm,
                        0,
                        None,
                        true,
                        true,
                    );
                } else {
                    self.fail_peer();
                }
                return Outcome::err(WcStatus::RemAccessErr, v);
            }
        }
        drop(pins);
        if let Some(i) = idx {
            let len = u32::try_from(local.total).unwrap_or(u32::MAX);
            self.recv_complete(
                i,
                WcStatus::Success,
                WcOpcode::RecvRdmaWithImm,
                len,
                imm,
                solicited,
                false,
            );
        }
        Outcome::ok(0)
    }

    fn read(
        &mut self,
        local: &Pieces,
        remote_addr: u64,
        rkey: u32,
        peer_access: Access,
    ) -> Outcome {
        if local.total == 0 {
            return Outcome::ok(0);
        }
        let mut pins = Pins::new();
        let t = match self.resolve(
            rkey,
            remote_addr,
            local.total,
            Access::REMOTE_READ,
            Some(peer_access),
            &mut pins,
        ) {
            Ok(t) => t,
            Err(v) => {
                drop(pins);
                self.fail_peer();
                return Outcome::err(WcStatus::RemAccessErr, v);
            }
        };
        // SAFETY: local pieces are caller memory valid for writing and not accessed by Rust
        // code until the completion is polled (post_send contract), LOCAL_WRITE checked; the
        // target is resolved and kept mapped/pinned until the copy returns.
        let r = unsafe { copy_in(&t, local, self.peer.pid) };
        drop(pins);
        match r {
            Ok(()) => Outcome::ok(u32::try_from(local.total).unwrap_or(u32::MAX)),
            Err(v) if v == vendor::PEER_DEAD => Outcome::err(WcStatus::RetryExcErr, v),
            Err(v) => {
                self.fail_peer();
                Outcome::err(WcStatus::RemAccessErr, v)
            }
        }
    }

    fn atomic(
        &mut self,
        local: &Pieces,
        remote_addr: u64,
        rkey: u32,
        peer_access: Access,
        op: impl FnOnce(&AtomicU64) -> u64,
    ) -> Outcome {
        let dst = match local.as_slice() {
            [(p, 8)] => *p,
            _ => return Outcome::err(WcStatus::LocLenErr, vendor::CORRUPT),
        };
        let mut pins = Pins::new();
        let t = match self.resolve(
            rkey,
            remote_addr,
            8,
            Access::REMOTE_ATOMIC,
            Some(peer_access),
            &mut pins,
        ) {
            Ok(t) => t,
            Err(v) => {
                drop(pins);
                self.fail_peer();
                return Outcome::err(WcStatus::RemAccessErr, v);
            }
        };
        if t.ptr.is_null() {
            drop(pins);
            self.fail_peer();
            return Outcome::err(WcStatus::RemOpErr, vendor::ATOMIC_NOT_SHARED);
        }
        if !(t.ptr as usize).is_multiple_of(8) {
            drop(pins);
            self.fail_peer();
            return Outcome::err(WcStatus::RemInvReqErr, vendor::OUT_OF_BOUNDS);
        }
        // SAFETY: `t.ptr` is 8-aligned (checked), points at 8 bytes inside a peer region that
        // is mapped here (or pinned memory of this process) for the duration of the call, and
        // every concurrent requester uses atomic operations on the word too.
        let old = op(unsafe { &*t.ptr.cast::<AtomicU64>() });
        drop(pins);
        // SAFETY: `dst` is an 8-byte local piece with LOCAL_WRITE (checked by local_pieces),
        // valid for writing per the post_send contract; no alignment is required.
        unsafe { dst.cast::<u64>().write_unaligned(old) };
        Outcome::ok(8)
    }
}

/// Copies the local pieces, in order, into the remote targets, in order.
///
/// # Safety
/// Local pieces must be readable memory of this process; every target with a non-null
/// pointer must be writable memory of length `len` that stays mapped for the call; targets
/// with a null pointer are addresses in process `pid`.
unsafe fn copy_out(local: &Pieces, targets: &[Target], pid: u32) -> std::result::Result<(), u32> {
    let src = local.as_slice();
    let (mut li, mut loff) = (0usize, 0usize);
    for t in targets {
        let mut done = 0usize;
        if t.ptr.is_null() {
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; MAX_PIECES];
            let mut n = 0;
            while done < t.len && li < src.len() && n < MAX_PIECES {
                let (p, l) = src[li];
                let take = (l - loff).min(t.len - done);
                // SAFETY: `loff + take <= l`: inside local piece `li`.
                let base = unsafe { p.add(loff) };
                iov[n] = libc::iovec {
                    iov_base: base.cast(),
                    iov_len: take,
                };
                n += 1;
                done += take;
                loff += take;
                if loff == l {
                    li += 1;
                    loff = 0;
                }
            }
            // SAFETY: the iovecs name readable local memory (contract above).
            unsafe { shm::cma_copy(pid, CmaDir::Write, &mut iov[..n], t.addr) }
                .map_err(cma_vendor)?;
        } else {
            while done < t.len && li < src.len() {
                let (p, l) = src[li];
                let take = (l - loff).min(t.len - done);
                // SAFETY: source range inside local piece `li`, destination inside target
                // `t` (`done + take <= t.len`); the two cannot overlap unless the caller posts
                // a SEND whose source is its peer's posted receive buffer, which the
                // post_send contract rules out (the receive buffer is not to be accessed).
                unsafe { crate::memcopy::copy_raw(p.add(loff), t.ptr.add(done), take) };
                done += take;
                loff += take;
                if loff == l {
                    li += 1;
                    loff = 0;
                }
            }
        }
        if li >= src.len() {
            break;
        }
    }
    Ok(())
}

/// Copies one remote target into the local pieces.
///
/// # Safety
/// Local pieces must be writable memory of this process not otherwise accessed during the
/// call; the target as for [`copy_out`] (readable).
unsafe fn copy_in(t: &Target, local: &Pieces, pid: u32) -> std::result::Result<(), u32> {
    let dst = local.as_slice();
    if t.ptr.is_null() {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_PIECES];
        for (i, &(p, l)) in dst.iter().enumerate() {
            iov[i] = libc::iovec {
                iov_base: p.cast(),
                iov_len: l,
            };
        }
        // SAFETY: the iovecs name writable local memory (contract above).
        return unsafe { shm::cma_copy(pid, CmaDir::Read, &mut iov[..dst.len()], t.addr) }
            .map_err(cma_vendor);
    }
    let mut off = 0usize;
    for &(p, l) in dst {
        let take = l.min(t.len - off);
        // SAFETY: destination is local piece memory (contract), source inside the target
        // (`off + take <= t.len`).
        unsafe { crate::memcopy::copy_raw(t.ptr.add(off), p, take) };
        off += take;
    }
    Ok(())
}

/// The vendor error of a failed cross-process copy: the peer process vanished, or the copy
/// failed.
fn cma_vendor(e: std::io::Error) -> u32 {
    if e.raw_os_error() == Some(libc::ESRCH) {
        vendor::PEER_DEAD
    } else {
        vendor::CMA_FAILED
    }
}

/// Flags of a receive completion from its meta word.
pub(crate) fn wc_flags(meta: u32) -> Option<WcFlags> {
    match (meta >> 16) & 0xff {
        0 => Some(WcFlags::NONE),
        1 => Some(WcFlags::WITH_IMM),
        _ => None,
    }
}
