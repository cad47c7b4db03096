//! Layout of a soft RNIC's two shared segments.
//!
//! A soft RNIC instance (one opened [`Context`](super::SoftContext)) owns two memfds:
//!
//! - the **published** segment, written only by its owner and sealed with
//!   `F_SEAL_FUTURE_WRITE`, so peers can map it read-only and nothing else: header, MR table,
//!   QP table and the receive-queue rings (work queue entries posted by the owner);
//! - the **inbox** segment, which peers map read-write: the per-QP words peers write
//!   (receive-queue claim word, "your QP failed" flag), the receive-completion rings peers
//!   produce into, the per-CQ doorbell words (armed flag, ready bitmap) and the per-MR pin
//!   counters of user-memory regions.
//!
//! Whatever the owner reads back from its inbox was written by someone it does not trust:
//! every index is masked or bounds-checked and every field validated by the reader.
//!
//! All words are little-endian atomics at fixed offsets; both segments are large sparse files
//! (pages are only allocated when touched).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// `"SOFTRNIC"` as a little-endian word: first word of both segments.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"SOFTRNIC");
/// Layout version; a peer with another version is refused at connect time.
pub(crate) const VERSION: u32 = 6;

/// Size of the published segment (sparse).
pub(crate) const PUB_LEN: usize = 512 << 20;
/// Size of the inbox segment (sparse).
pub(crate) const INBOX_LEN: usize = 256 << 20;

// ---- published segment ---------------------------------------------------------------------

/// Header words of the published segment.
pub(crate) mod hdr {
    /// u64 [`super::MAGIC`].
    pub(crate) const MAGIC: usize = 0;
    /// u32 layout version.
    pub(crate) const VERSION: usize = 8;
    /// u32 owner pid.
    pub(crate) const PID: usize = 12;
    /// u64 random nonce naming this instance.
    pub(crate) const NONCE: usize = 16;
    /// u32 owner's descriptor number of the inbox memfd.
    pub(crate) const INBOX_FD: usize = 24;
    /// u64 published segment length.
    pub(crate) const PUB_LEN: usize = 32;
    /// u64 inbox segment length.
    pub(crate) const INBOX_LEN: usize = 40;
}

/// Slots of the MR table (key = slot | generation << 16).
pub(crate) const MAX_MR: usize = 1 << 16;
/// Bits of the MR key holding the slot.
pub(crate) const MR_SLOT_BITS: u32 = 16;
/// Bytes per MR table entry.
pub(crate) const MR_ENTRY: usize = 64;
/// Offset of the MR table.
pub(crate) const MR_TABLE: usize = 4096;

/// Words of an MR table entry.
pub(crate) mod mr {
    /// u32 key (0: free). Written last on registration, cleared first on deregistration.
    pub(crate) const KEY: usize = 0;
    /// u32 access bits.
    pub(crate) const ACCESS: usize = 4;
    /// u32 kind ([`super::MR_KIND_SHM`] or [`super::MR_KIND_USER`]).
    pub(crate) const KIND: usize = 8;
    /// u32 owner's descriptor number of the region's memfd (shm kind).
    pub(crate) const FD: usize = 12;
    /// u64 start address in the owner's address space.
    pub(crate) const ADDR: usize = 16;
    /// u64 length.
    pub(crate) const LEN: usize = 24;
    /// u32 protection domain id.
    pub(crate) const PD: usize = 32;
    /// u32 key of the region a window lends (window kind; its slot is in [`FD`]).
    pub(crate) const PARENT_KEY: usize = 36;
    /// u64 nonce of the only peer RNIC that may use a window (window kind).
    pub(crate) const BOUND: usize = 40;
}

/// Region memory lives in its own memfd: peers map it and copy directly.
pub(crate) const MR_KIND_SHM: u32 = 1;
/// Region memory is ordinary process memory: peers reach it with process_vm_readv/writev.
pub(crate) const MR_KIND_USER: u32 = 2;
/// A memory window: `[ADDR, ADDR + LEN)` of the region in slot `FD` (still registered under
/// `PARENT_KEY`), for the peer RNIC `BOUND` only.
pub(crate) const MR_KIND_WINDOW: u32 = 3;

/// Slots of the QP table (qp_num = slot | generation << 14, 24 bits): the QPs of every
/// connection of a process that share its context.
pub(crate) const MAX_QP: usize = 1 << 14;
/// Bits of the QP number holding the slot.
pub(crate) const QP_SLOT_BITS: u32 = 14;
/// Bytes per QP table entry.
pub(crate) const QP_ENTRY: usize = 128;
/// Offset of the QP table.
pub(crate) const QP_TABLE: usize = MR_TABLE + MAX_MR * MR_ENTRY;

/// Words of a QP table entry (published).
pub(crate) mod qp {
    /// u32 state ([`crate::verbs::QpState`] as a number).
    pub(crate) const STATE: usize = 0;
    /// u32 QP number (0: free slot).
    pub(crate) const QP_NUM: usize = 4;
    /// u32 access rights granted to the peer (`qp_access_flags`).
    pub(crate) const ACCESS: usize = 8;
    /// u32 protection domain id.
    pub(crate) const PD: usize = 12;
    /// u64 offset of the receive-queue WQE ring in the published segment.
    pub(crate) const RQ_WQE: usize = 16;
    /// u64 offset of the receive-completion ring in the inbox.
    pub(crate) const RQ_CQE: usize = 24;
    /// u32 receive ring size (power of two).
    pub(crate) const RQ_DEPTH: usize = 32;
    /// u32 SGEs per receive WQE.
    pub(crate) const RQ_MAX_SGE: usize = 36;
    /// u32 slot of the receive CQ.
    pub(crate) const RECV_CQ: usize = 40;
    /// u32 bit of this QP in the receive CQ's ready bitmap.
    pub(crate) const RECV_BIT: usize = 44;
    /// u32 owner's descriptor number of the receive CQ's channel eventfd (u32::MAX: none).
    pub(crate) const CHAN_FD: usize = 48;
    /// u32 QP number of the connected peer QP (set at RTR).
    pub(crate) const REMOTE_QP: usize = 52;
    /// u64 nonce of the connected peer's soft RNIC (set at RTR).
    pub(crate) const REMOTE_NONCE: usize = 56;
    /// u32 receive producer index (own cache line: written by every post_recv).
    pub(crate) const RQ_PROD: usize = 64;
    /// u32 this QP's `min_rnr_timer` encoding (set at RTR): how long a requester that got an
    /// RNR NAK from us waits before retrying, as the RNR NAK carries it in IB. Read by peers
    /// only on that slow path.
    pub(crate) const RNR_TIMER: usize = 96;
    /// u32: 1 when the QP receives through a shared receive queue (its receive ring, producer
    /// and claim words are the SRQ's; peers claim one receive at a time).
    pub(crate) const SHARED_RQ: usize = 100;
    /// u64 offset of the receive producer index in the published segment (a plain QP's own
    /// [`RQ_PROD`], or its SRQ's).
    pub(crate) const RQ_PROD_AT: usize = 104;
    /// u64 offset of the receive claim word in the inbox (a plain QP's own
    /// [`super::qp_in::RQ_CLAIM`], or its SRQ's [`super::srq_in::CLAIM`]).
    pub(crate) const RQ_CLAIM_AT: usize = 112;
    /// u32 id of the receive CQ's channel, unique in the owner process: a descriptor number
    /// is reused once closed, so peers key their duplicates of [`CHAN_FD`] by both.
    pub(crate) const CHAN_ID: usize = 120;
}

/// Bytes of a receive WQE header before its SGEs.
pub(crate) const WQE_HDR: usize = 16;
/// Bytes per SGE in a receive WQE.
pub(crate) const WQE_SGE: usize = 16;

/// Start of the published heap (receive WQE rings).
pub(crate) const PUB_HEAP: usize = QP_TABLE + MAX_QP * QP_ENTRY;

/// Offset of MR table entry `slot`.
pub(crate) const fn mr_entry(slot: usize) -> usize {
    MR_TABLE + slot * MR_ENTRY
}

/// Offset of QP table entry `slot`.
pub(crate) const fn qp_entry(slot: usize) -> usize {
    QP_TABLE + slot * QP_ENTRY
}

/// Stride of a receive WQE with `max_sge` SGEs (multiple of 16).
pub(crate) const fn wqe_stride(max_sge: usize) -> usize {
    WQE_HDR + max_sge * WQE_SGE
}

// ---- inbox segment -------------------------------------------------------------------------

/// Inbox header: u64 magic at 0, u64 nonce at 8.
pub(crate) const IN_NONCE: usize = 8;

/// Bytes per QP inbox entry (two cache lines: the owner reads the first on every call, the
/// peer writes the second on every receive it claims).
pub(crate) const QP_IN_ENTRY: usize = 128;
/// Offset of the QP inbox table.
pub(crate) const QP_IN_TABLE: usize = 4096;

/// Words of a QP inbox entry (written by peers).
pub(crate) mod qp_in {
    /// u32: non-zero when the connected peer failed this QP (fatal remote error).
    pub(crate) const REMOTE_ERROR: usize = 0;
    /// u64: receive claim word ([`super::claim_word`]; the peer claims WQEs with
    /// compare-and-swap, naming no QP), own line.
    pub(crate) const RQ_CLAIM: usize = 64;
}

/// Words of a shared receive queue's inbox control block (allocated in the inbox heap).
pub(crate) mod srq_in {
    /// u64 claim word ([`super::claim_word`]): peers of every QP of the SRQ claim with
    /// compare-and-swap, naming the QP they claim for (see [`super::rcqe::NAME`]).
    pub(crate) const CLAIM: usize = 0;
    /// u32 armed limit (0: disarmed): the claimer that leaves fewer receives than this
    /// disarms it and raises [`EVENT`].
    pub(crate) const LIMIT: usize = 64;
    /// u32: non-zero when a limit event is pending for the owner.
    pub(crate) const EVENT: usize = 68;
}

/// Bytes of an SRQ's inbox control block.
pub(crate) const SRQ_IN_CTRL: usize = 128;
/// Bytes of an SRQ's published control block (its producer index at 0).
pub(crate) const SRQ_PUB_CTRL: usize = 64;

/// Offset of the MR pin counters (u32 per MR slot).
pub(crate) const PIN_TABLE: usize = QP_IN_TABLE + MAX_QP * QP_IN_ENTRY;

/// Slots of the CQ table (one CQ per client connection of a process sharing the context).
pub(crate) const MAX_CQ: usize = 1 << 14;
/// Roles (QP send or receive sides) one CQ serves: bits of its ready bitmap.
pub(crate) const CQ_BITS: usize = 32768;
/// Words of a CQ's ready bitmap.
pub(crate) const CQ_WORDS: usize = CQ_BITS / 64;
/// Words of a CQ's summary of its ready bitmap: a bit per bitmap word.
pub(crate) const CQ_SUMMARY_WORDS: usize = CQ_WORDS / 64;
/// Bytes per CQ head (its inbox entry): armed word, the summary, then word 0 of the ready
/// bitmap, each on a line of its own. The heads are packed, 21 to a page, and the rest of
/// each bitmap (words 1 and up, [`CQ_TAIL`]) lies in a table of its own: a CQ with at most 64
/// sides (a client connection's) has its producers, its own process and peers alike, touch
/// its 192-byte head only, not a page of its own in each of their address spaces.
pub(crate) const CQ_IN_ENTRY: usize = 192;
/// Offset of the CQ heads.
pub(crate) const CQ_IN_TABLE: usize = PIN_TABLE + MAX_MR * 4;
/// Bytes of a CQ's bitmap words 1 and up.
pub(crate) const CQ_TAIL: usize = (CQ_WORDS - 1) * 8;
/// Offset of the CQ bitmap tails.
pub(crate) const CQ_TAIL_TABLE: usize = CQ_IN_TABLE + MAX_CQ * CQ_IN_ENTRY;

/// Words of a CQ inbox entry.
pub(crate) mod cq_in {
    /// u32 armed: 0 no, 1 any completion, 2 solicited or error completions only.
    pub(crate) const ARMED: usize = 0;
    /// Start of the summary (u64 words, [`super::CQ_SUMMARY_WORDS`] of them): bit `w` set
    /// when word `w` of the ready bitmap may have bits set (bit 0 unused: word 0 is read at
    /// every poll). A producer sets the bitmap's bit first, then the summary's; the CQ's poll
    /// takes (swaps) the summary first, then the words it names: it reads a few words, not the
    /// whole bitmap, with thousands of sides.
    pub(crate) const SUMMARY: usize = 64;
    /// Word 0 of the ready bitmap (u64); the others are in the CQ's tail.
    pub(crate) const BITMAP: usize = 128;
}

/// Offset of word `w` of the ready bitmap of CQ `slot`: word 0 in its head, the others in
/// its tail.
pub(crate) const fn cq_bitmap_word(slot: usize, w: usize) -> usize {
    if w == 0 {
        cq_in_entry(slot) + cq_in::BITMAP
    } else {
        CQ_TAIL_TABLE + slot * CQ_TAIL + (w - 1) * 8
    }
}

/// Offset of word `i` of the summary of the CQ inbox entry at `entry`.
pub(crate) const fn cq_summary_word(entry: usize, i: usize) -> usize {
    entry + cq_in::SUMMARY + i * 8
}

/// The summary word (offset in a CQ inbox entry) and bit for bitmap word `w`; none for word
/// 0, which the poll reads every time: a CQ with at most 64 sides (a client connection's)
/// has its producers touch one line of the entry, as before the summary, not two.
pub(crate) fn summary_of(w: usize) -> Option<(usize, u64)> {
    (w > 0).then(|| (cq_summary_word(0, w / 64), 1u64 << (w % 64)))
}

/// Where one side of a QP announces its completions in its CQ's inbox entry: its bit of the
/// ready bitmap, that word's summary bit, and the entry's armed word. Producers in the CQ's
/// own process (`CqShared::set_ready`) and in a peer's (`exec::Conn::ring`) both raise it
/// with [`ReadyBit::raise`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadyBit {
    word: usize,
    bit: u64,
    summary: Option<(usize, u64)>,
    armed: usize,
}

impl ReadyBit {
    /// Side `side` of CQ `slot`.
    pub(crate) fn new(slot: usize, side: usize) -> ReadyBit {
        let entry = cq_in_entry(slot);
        ReadyBit {
            word: cq_bitmap_word(slot, side / 64),
            bit: 1u64 << (side % 64),
            summary: summary_of(side / 64).map(|(w, b)| (entry + w, b)),
            armed: entry + cq_in::ARMED,
        }
    }

    /// Sets the ready bit, then its summary bit, and disarms the CQ when it is armed for
    /// this completion (any, or `solicited` ones): `true` when the caller must then signal
    /// the CQ's completion channel. `u64_at` and `u32_at` give the inbox's words by offset.
    #[inline]
    pub(crate) fn raise<'a>(
        &self,
        u64_at: impl Fn(usize) -> &'a AtomicU64,
        u32_at: impl Fn(usize) -> &'a AtomicU32,
        solicited: bool,
    ) -> bool {
        u64_at(self.word).fetch_or(self.bit, Ordering::SeqCst);
        if let Some((w, b)) = self.summary {
            u64_at(w).fetch_or(b, Ordering::SeqCst);
        }
        let armed = u32_at(self.armed);
        let a = armed.load(Ordering::SeqCst);
        (a == 1 || (a == 2 && solicited))
            && armed
                .compare_exchange(a, 0, Ordering::SeqCst, Ordering::Relaxed)
                .is_ok()
    }
}

/// Start of the inbox heap (receive-completion rings).
pub(crate) const IN_HEAP: usize = CQ_TAIL_TABLE + MAX_CQ * CQ_TAIL;

/// Bytes per receive completion (seq, byte_len, imm, meta, qp, claim name).
pub(crate) const RCQE: usize = 32;

/// Words of a receive completion.
pub(crate) mod rcqe {
    /// u32 sequence: index + 1 of the WQE it completes, written last (Release).
    pub(crate) const SEQ: usize = 0;
    /// u32 bytes received.
    pub(crate) const BYTE_LEN: usize = 4;
    /// u32 immediate data.
    pub(crate) const IMM: usize = 8;
    /// u32 status | opcode << 8 | flags << 16 | solicited << 24.
    pub(crate) const META: usize = 12;
    /// u32 number of the QP the message arrived on (read for shared receive queues; written
    /// with the completion).
    pub(crate) const QP: usize = 16;
    /// u64 name of the claim of a shared queue's receive ([`super::claim_word`]: the index
    /// claimed and the QP it was claimed for). The claim word names the last claim only; a
    /// claimer names the claim before its own (the one the word it replaces named) here
    /// before its compare-and-swap, and its own right after, so every claim but the last
    /// is named here, carrying its index, by the time the claim word has moved past it.
    /// Names only move forward (a stale write of an older lap's name is refused).
    pub(crate) const NAME: usize = 24;
}

/// A claim word or claim name: receive index `idx` (low half), claimed for QP `qp_num`
/// (high half; 0 in a QP's own queue, and before the first claim).
pub(crate) const fn claim_word(idx: u32, qp_num: u32) -> u64 {
    idx as u64 | (qp_num as u64) << 32
}

/// The receive index of a claim word (the next receive to claim) or claim name.
pub(crate) const fn claim_index(w: u64) -> u32 {
    w as u32
}

/// The QP number of a claim word (the last claim's) or claim name.
pub(crate) const fn claim_qp(w: u64) -> u32 {
    (w >> 32) as u32
}

/// `META` status value meaning "discarded by a reset: no completion".
pub(crate) const RCQE_DISCARD: u32 = 0xff;

/// Offset of QP inbox entry `slot`.
pub(crate) const fn qp_in_entry(slot: usize) -> usize {
    QP_IN_TABLE + slot * QP_IN_ENTRY
}

/// Offset of the pin counter of MR slot `slot`.
pub(crate) const fn pin(slot: usize) -> usize {
    PIN_TABLE + slot * 4
}

/// Offset of CQ inbox entry `slot`.
pub(crate) const fn cq_in_entry(slot: usize) -> usize {
    CQ_IN_TABLE + slot * CQ_IN_ENTRY
}

const _: () = assert!(PUB_HEAP < PUB_LEN / 2);
const _: () = assert!(IN_HEAP < INBOX_LEN / 2);
const _: () = assert!(QP_ENTRY >= qp::RQ_CLAIM_AT + 8 && qp::RNR_TIMER >= qp::RQ_PROD + 4);
const _: () = assert!(MAX_MR <= 1 << MR_SLOT_BITS && MAX_QP <= 1 << QP_SLOT_BITS);
const _: () = assert!(CQ_IN_ENTRY.is_multiple_of(64) && MR_TABLE.is_multiple_of(4096));
const _: () =
    assert!(cq_in::SUMMARY + CQ_SUMMARY_WORDS * 8 <= cq_in::BITMAP && CQ_WORDS.is_multiple_of(64));
// 64-bit claim words and names: 8-aligned (completion rings start 16-aligned, the SRQ
// control block and the QP inbox table 64-aligned), and inside their blocks.
const _: () = assert!(rcqe::NAME.is_multiple_of(8) && rcqe::NAME + 8 <= RCQE);
const _: () = assert!(RCQE.is_multiple_of(16) && rcqe::QP + 4 <= rcqe::NAME);
const _: () = assert!(srq_in::CLAIM.is_multiple_of(8) && srq_in::CLAIM + 8 <= srq_in::LIMIT);
const _: () = assert!(qp_in::RQ_CLAIM.is_multiple_of(8) && qp_in::RQ_CLAIM + 8 <= QP_IN_ENTRY);
const _: () = assert!(QP_IN_ENTRY.is_multiple_of(64) && QP_IN_TABLE.is_multiple_of(64));

/// A first-fit allocator of byte ranges inside a heap (setup path only).
#[derive(Debug)]
pub(crate) struct RegionAlloc {
    free: Mutex<Vec<(usize, usize)>>,
}

impl RegionAlloc {
    /// An allocator of `[start, end)`.
    pub(crate) fn new(start: usize, end: usize) -> RegionAlloc {
        RegionAlloc {
            free: Mutex::new(vec![(start, end - start)]),
        }
    }

    /// Allocates `len` bytes aligned to 64; `None` when the heap is exhausted.
    pub(crate) fn alloc(&self, len: usize) -> Option<usize> {
        let len = len.checked_add(63)? & !63;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = free[i];
        if l == len {
            free.remove(i);
        } else {
            free[i] = (off + len, l - len);
        }
        Some(off)
    }

    /// Returns `[off, off + len)` (as passed to and returned by `alloc`).
    pub(crate) fn free(&self, off: usize, len: usize) {
        let len = (len + 63) & !63;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|&(o, _)| o < off);
        free.insert(i, (off, len));
        // Merge with the next and the previous range.
        if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
            free[i].1 += free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
            free[i - 1].1 += free[i].1;
            free.remove(i);
        }
    }
}

/// Slots of a table with a generation per slot, handed out oldest-freed first so that a
/// stale key or QP number takes as long as possible to become valid again.
#[derive(Debug)]
pub(crate) struct SlotAlloc {
    inner: Mutex<SlotInner>,
    gen_bits: u32,
}

#[derive(Debug)]
struct SlotInner {
    /// Slots freed, oldest first: handed out once no slot is left that was never used.
    free: std::collections::VecDeque<u32>,
    /// Slots from here to `gens.len()` were never handed out. (A free list of every slot,
    /// made up front, was hundreds of kilobytes touched when a process opened the device.)
    fresh: u32,
    gens: Vec<u32>,
}

impl SlotAlloc {
    /// `n` slots; generations have `gen_bits` bits and are never 0.
    pub(crate) fn new(n: usize, gen_bits: u32) -> SlotAlloc {
        SlotAlloc {
            inner: Mutex::new(SlotInner {
                free: std::collections::VecDeque::new(),
                fresh: 0,
                gens: vec![0; n],
            }),
            gen_bits,
        }
    }

    /// A free slot and its new generation.
    pub(crate) fn alloc(&self) -> Option<(u32, u32)> {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let slot = if (s.fresh as usize) < s.gens.len() {
            s.fresh += 1;
            s.fresh - 1
        } else {
            s.free.pop_front()?
        };
        let g = &mut s.gens[slot as usize];
        let mask = (1u32 << self.gen_bits) - 1;
        *g = (*g + 1) & mask;
        if *g == 0 {
            *g = 1;
        }
        Some((slot, *g))
    }

    /// Returns `slot`.
    pub(crate) fn free(&self, slot: u32) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.free.push_back(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A side's bit, its word's summary bit (none for word 0) and the armed word, in a
    /// private copy of CQ 3's head and tail; the channel is owed a signal only when armed for
    /// the completion, once.
    #[test]
    fn a_ready_bit_sets_its_bits_and_disarms_once() {
        const CQ: usize = 3;
        let head: Vec<AtomicU64> = (0..CQ_IN_ENTRY / 8).map(|_| AtomicU64::new(0)).collect();
        let tail: Vec<AtomicU64> = (0..CQ_TAIL / 8).map(|_| AtomicU64::new(0)).collect();
        let entry = cq_in_entry(CQ);
        let tail_at = CQ_TAIL_TABLE + CQ * CQ_TAIL;
        let at64 = |o: usize| {
            if (entry..entry + CQ_IN_ENTRY).contains(&o) {
                &head[(o - entry) / 8]
            } else {
                assert!((tail_at..tail_at + CQ_TAIL).contains(&o), "outside CQ {CQ}");
                &tail[(o - tail_at) / 8]
            }
        };
        let armed = AtomicU32::new(0);
        let at32 = |o: usize| {
            assert_eq!(o, entry + cq_in::ARMED);
            &armed
        };
        let word = |o: usize| at64(o).load(Ordering::Relaxed);
        let summary = |i: usize| word(cq_summary_word(entry, i));

        assert!(!ReadyBit::new(CQ, 5).raise(at64, at32, true), "not armed");
        assert_eq!(
            cq_bitmap_word(CQ, 0),
            entry + cq_in::BITMAP,
            "word 0 in the head"
        );
        assert_eq!(word(cq_bitmap_word(CQ, 0)), 1 << 5);
        assert!(
            (0..CQ_SUMMARY_WORDS).all(|i| summary(i) == 0),
            "word 0 has no summary bit"
        );

        let side = 64 * 70 + 3; // bitmap word 70: summary word 1, bit 6
        armed.store(2, Ordering::Relaxed);
        assert!(
            !ReadyBit::new(CQ, side).raise(at64, at32, false),
            "armed for solicited only"
        );
        assert_eq!(armed.load(Ordering::Relaxed), 2);
        assert_eq!(
            cq_bitmap_word(CQ, 70),
            tail_at + 69 * 8,
            "word 70 in the tail"
        );
        assert_eq!(word(cq_bitmap_word(CQ, 70)), 1 << 3);
        assert_eq!(summary(1), 1 << 6);
        assert!(
            ReadyBit::new(CQ, side).raise(at64, at32, true),
            "solicited: signal"
        );
        assert_eq!(armed.load(Ordering::Relaxed), 0, "disarmed");

        armed.store(1, Ordering::Relaxed);
        assert!(
            ReadyBit::new(CQ, 1).raise(at64, at32, false),
            "armed for any"
        );
        assert!(
            !ReadyBit::new(CQ, 1).raise(at64, at32, false),
            "signalled once"
        );
    }

    /// CQ heads are packed (21 to a page) and apart from the tails; the last tail ends
    /// before the receive rings.
    #[test]
    fn cq_heads_are_packed_and_tails_apart() {
        const { assert!(4096 / CQ_IN_ENTRY >= 21) };
        assert_eq!(cq_in_entry(1) - cq_in_entry(0), CQ_IN_ENTRY);
        assert!(cq_in_entry(MAX_CQ - 1) + CQ_IN_ENTRY <= CQ_TAIL_TABLE);
        assert_eq!(cq_bitmap_word(MAX_CQ - 1, CQ_WORDS - 1) + 8, IN_HEAP);
        assert!(cq_bitmap_word(0, 1) >= CQ_TAIL_TABLE);
    }

    #[test]
    fn region_alloc_merges() {
        let a = RegionAlloc::new(1024, 1024 + 64 * 10);
        let x = a.alloc(64).unwrap();
        let y = a.alloc(100).unwrap();
        let z = a.alloc(64).unwrap();
        assert_eq!((x, y, z), (1024, 1088, 1216));
        assert!(a.alloc(64 * 8).is_none());
        a.free(y, 100);
        a.free(x, 64);
        a.free(z, 64);
        assert_eq!(a.alloc(64 * 10), Some(1024));
    }

    #[test]
    fn slot_generations_never_zero() {
        let s = SlotAlloc::new(2, 2);
        let mut seen = Vec::new();
        for _ in 0..8 {
            let (slot, g) = s.alloc().unwrap();
            assert_ne!(g, 0);
            seen.push((slot, g));
            s.free(slot);
        }
        assert_eq!(seen[0], (0, 1));
        assert_eq!(seen[1], (1, 1));
        assert_eq!(seen[2], (0, 2));
    }

    #[test]
    fn slots_come_unused_first_then_oldest_freed_first() {
        let s = SlotAlloc::new(4, 8);
        let a = s.alloc().unwrap().0;
        let b = s.alloc().unwrap().0;
        s.free(b);
        s.free(a);
        // Never-used slots before any freed one, then the freed ones in the order freed.
        let order: Vec<u32> = (0..4).map(|_| s.alloc().unwrap().0).collect();
        assert_eq!((a, b), (0, 1));
        assert_eq!(order, [2, 3, 1, 0]);
        assert!(s.alloc().is_none(), "all 4 slots are out");
        s.free(3);
        assert_eq!(
            s.alloc(),
            Some((3, 2)),
            "the slot's second life has generation 2"
        );
    }
}
