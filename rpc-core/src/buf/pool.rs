//! A server shard's receive pool: the receive slots of all its connections, posted to one
//! shared receive queue (SRQ), so receive memory follows the calls in flight, not the number
//! of connections.
//!
//! ```text
//! chunk 0 (one MR, LOCAL_WRITE)        chunk 1                      ...
//! [ slot 0 | slot 1 | .. | slot C-1 ]  [ slot C | .. | slot 2C-1 ]   up to `max_slots`
//! ```
//!
//! The pool grows a chunk at a time ([`RecvPool::grow`], by the shard, as connections come)
//! and never shrinks: an SRQ's receives cannot be taken back one by one. Which connection may
//! use how many of the slots is the shard's business (credits granted from the pool, see
//! [`crate::wire::Conn::grant`]); the pool only holds the memory, the repost queue and the
//! lending rule, and is shared (in an `Arc`) by the shard and every [`RecvSlot`] guard.
//!
//! Ownership as with a connection's own ring ([`super::slots`]): a posted slot is the NIC's
//! until its completion is polled; the completion hands it to a guard; dropping the last guard
//! (on any thread) queues the index for reposting, and the shard posts it again.
//!
//! **Lending.** A guard may be lent to user code (a `bytes` field borrowing it) only while the
//! shard handles the frame in it, synchronously ([`RecvPool::open`] .. [`RecvPool::close`]),
//! and only within the allowance the shard set for that frame: the shard takes a lent slot
//! out of the connection's window at once (it owes the connection the credit as if the slot
//! had been reposted) and out of the pool's spare grants, so what a user keeps never blocks a
//! connection. Asked at any other time, the pool refuses and the data is copied.

use crate::queue::PopIfAny;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_queue::ArrayQueue;

use super::slots::{RecvSlot, Repost};
use crate::verbs::{Access, ErrorKind, Mr, Pd, Provider, Result, Sge, Verb, VerbsError};

/// Bytes of registered memory per chunk (its slots: this over the slot size).
pub const CHUNK_BYTES: usize = 4 << 20;

struct Chunk<P: Provider> {
    mr: P::Mr,
    /// Per slot: live guards and the LENT bit, as [`super::slots::SlotArena`]'s.
    shares: Box<[AtomicU32]>,
}

/// The receive pool of one shard. See the module docs.
pub struct RecvPool<P: Provider> {
    chunks: Box<[OnceLock<Chunk<P>>]>,
    slot_size: u32,
    per_chunk: u32,
    /// `log2(per_chunk)` when it is a power of two (the usual case), so that finding a slot's
    /// chunk takes a shift and a mask, not two divisions (20-40 cycles each), twice per
    /// received frame ([`RecvPool::shares`]); `None` else.
    chunk_shift: Option<u32>,
    /// Slots allocated so far (a multiple of `per_chunk`); written by the shard only.
    slots: AtomicU32,
    repost: ArrayQueue<u32>,
    /// `slot + 1` while the shard handles the frames of that slot; 0 otherwise.
    open: AtomicU32,
    /// Slots that may still be lent while the slot is open.
    allowance: AtomicU32,
    /// Whether the open slot was lent.
    lent: AtomicU32,
}

impl<P: Provider> RecvPool<P> {
    /// An empty pool of at most `max_slots` slots of `slot_size` bytes, rounded down to whole
    /// chunks ([`RecvPool::grow`] adds them). Allocates the repost queue now, nothing
    /// registered yet.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `slot_size` is not a multiple of 64 between 256 B
    /// and [`CHUNK_BYTES`], or `max_slots` is 0.
    pub fn new(slot_size: u32, max_slots: u32) -> Result<Arc<RecvPool<P>>> {
        if !(256..=CHUNK_BYTES as u32).contains(&slot_size)
            || !slot_size.is_multiple_of(64)
            || max_slots == 0
        {
            return Err(VerbsError::new(
                Verb::AllocMr,
                ErrorKind::InvalidArgument,
                format!("receive pool of {max_slots} slots of {slot_size} bytes"),
            ));
        }
        let per_chunk = (CHUNK_BYTES as u32 / slot_size).min(max_slots);
        let nchunks = max_slots / per_chunk;
        Ok(Arc::new(RecvPool {
            chunks: (0..nchunks).map(|_| OnceLock::new()).collect(),
            slot_size,
            per_chunk,
            chunk_shift: per_chunk
                .is_power_of_two()
                .then(|| per_chunk.trailing_zeros()),
            slots: AtomicU32::new(0),
            repost: ArrayQueue::new((nchunks * per_chunk) as usize),
            open: AtomicU32::new(0),
            allowance: AtomicU32::new(0),
            lent: AtomicU32::new(0),
        }))
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u32 {
        self.slot_size
    }

    /// Slots allocated so far.
    pub fn slots(&self) -> u32 {
        self.slots.load(Ordering::Acquire)
    }

    /// The most slots the pool may grow to.
    pub fn max_slots(&self) -> u32 {
        self.chunks.len() as u32 * self.per_chunk
    }

    /// Registers one more chunk and returns its slots, unposted: the caller posts them (they
    /// are the NIC's from then on). Only the shard calls it, from one thread.
    ///
    /// # Errors
    /// [`ErrorKind::ExceedsCaps`] at `max_slots`; registration errors.
    pub fn grow(&self, pd: &P::Pd) -> Result<std::ops::Range<u32>> {
        let have = self.slots.load(Ordering::Relaxed);
        let i = (have / self.per_chunk) as usize;
        let Some(cell) = self.chunks.get(i) else {
            return Err(VerbsError::new(
                Verb::AllocMr,
                ErrorKind::ExceedsCaps,
                format!(
                    "the shard's receive pool is at its limit of {} slots",
                    self.max_slots()
                ),
            ));
        };
        let mr = pd.alloc_mr(
            self.per_chunk as usize * self.slot_size as usize,
            Access::LOCAL_WRITE,
        )?;
        let shares = (0..self.per_chunk).map(|_| AtomicU32::new(0)).collect();
        if cell.set(Chunk { mr, shares }).is_err() {
            // One grower only: unreachable, but never hand out slots twice.
            return Err(VerbsError::new(
                Verb::AllocMr,
                ErrorKind::InvalidArgument,
                "receive pool grown from two threads",
            ));
        }
        // Release: a guard on another thread that learns a slot of this chunk (through the
        // shard) sees the chunk set.
        self.slots.store(have + self.per_chunk, Ordering::Release);
        Ok(have..have + self.per_chunk)
    }

    fn chunk(&self, idx: u32) -> Option<(&Chunk<P>, usize)> {
        let (c, i) = self.locate(idx)?;
        Some((c, i * self.slot_size as usize))
    }

    /// The chunk of slot `idx` and the slot's index in it.
    #[inline]
    fn locate(&self, idx: u32) -> Option<(&Chunk<P>, usize)> {
        let (chunk, i) = match self.chunk_shift {
            Some(k) => (idx >> k, idx & (self.per_chunk - 1)),
            None => (idx / self.per_chunk, idx % self.per_chunk),
        };
        Some((self.chunks.get(chunk as usize)?.get()?, i as usize))
    }

    /// The SGE covering slot `idx` (for `post_srq_recv`); `None` for a slot not allocated.
    pub fn recv_sge(&self, idx: u32) -> Option<Sge> {
        let (c, off) = self.chunk(idx)?;
        Some(Sge {
            addr: c.mr.addr() + off as u64,
            length: self.slot_size,
            lkey: c.mr.lkey(),
        })
    }

    /// Hands a completed receive slot to a guard; `None` for a slot not allocated (a forged
    /// completion).
    ///
    /// # Safety
    /// The RECV of slot `idx` has completed (its completion was polled) and it is not posted
    /// again until the guard is dropped; `len` is the completion's byte length.
    pub unsafe fn recv_slot(self: &Arc<Self>, idx: u32, len: u32) -> Option<RecvSlot> {
        let (c, off) = self.chunk(idx)?;
        // SAFETY: `off + slot_size` is inside the chunk's MR (idx % per_chunk < per_chunk and
        // per_chunk * slot_size <= CHUNK_BYTES); the caller's contract makes the bytes ours.
        let ptr = unsafe { c.mr.as_ptr().add(off) };
        let owner: Arc<dyn Repost> = Arc::clone(self) as Arc<dyn Repost>;
        // SAFETY: forwarded contract; `ptr .. ptr + slot_size` lies in memory `owner` keeps.
        Some(unsafe { RecvSlot::new(owner, ptr, idx, len.min(self.slot_size)) })
    }

    /// Asks the CPU to start loading the first bytes of slot `idx` (see
    /// [`super::SlotArena::prefetch_recv`]). A hint only.
    #[inline]
    pub fn prefetch_recv(&self, idx: u32, len: u32) {
        if let Some((c, off)) = self.chunk(idx) {
            super::slots::prefetch_lines(c.mr.as_ptr().wrapping_add(off), len);
        }
    }

    /// Pops a slot to post again; `None` when none is waiting.
    pub fn take_repost(&self) -> Option<u32> {
        self.repost.pop_if_any()
    }

    /// Returns a slot to the repost queue without a guard (a flushed or refused receive).
    pub fn repost_later(&self, idx: u32) {
        // Capacity covers every slot and each index is held once.
        let _ = self.repost.push(idx);
    }

    /// The shard starts handling the frames of slot `idx`: until [`RecvPool::close`], a
    /// guard of it may be lent if `allowance > 0`.
    pub fn open(&self, idx: u32, allowance: u32) {
        self.lent.store(0, Ordering::Relaxed);
        self.allowance.store(allowance, Ordering::Relaxed);
        self.open.store(idx + 1, Ordering::Relaxed);
    }

    /// The shard is done with the frames of the open slot: whether one of them was lent.
    pub fn close(&self) -> bool {
        self.open.store(0, Ordering::Relaxed);
        self.lent.swap(0, Ordering::Relaxed) != 0
    }
}

impl<P: Provider> Repost for RecvPool<P> {
    fn repost(&self, idx: u32) {
        self.repost_later(idx);
    }

    fn try_lend(&self, idx: u32) -> bool {
        // Only the shard's thread opens a slot, and only while it handles it, so these
        // relaxed operations never race: asked anywhere else, `open` does not match.
        if self.open.load(Ordering::Relaxed) != idx + 1 {
            return false;
        }
        if self.lent.load(Ordering::Relaxed) != 0 {
            return true;
        }
        if self.allowance.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.lent.store(1, Ordering::Relaxed);
        true
    }

    fn unlend(&self) {
        // The shard accounts a lent slot when it comes back on the repost queue.
    }

    fn shares(&self, idx: u32) -> &AtomicU32 {
        match self.locate(idx) {
            Some((c, i)) => &c.shares[i],
            // A guard exists only for an allocated slot.
            None => unreachable!("share count of a slot that was never allocated"),
        }
    }
}

impl<P: Provider> fmt::Debug for RecvPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvPool")
            .field("slot_size", &self.slot_size)
            .field("slots", &self.slots())
            .field("max_slots", &self.max_slots())
            .field("repost", &self.repost.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::Soft;
    use crate::verbs::{Context, Provider};

    /// A slot's address and share count are found alike whether the slots per chunk are a
    /// power of two (shift and mask) or not (division).
    #[test]
    fn slots_are_located_alike_with_and_without_the_shift() {
        let ctx = Soft::open(None).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        // 4 MiB / 8 KiB = 512 per chunk (a power of two); 4 MiB / 12 KiB = 341 (not one).
        for (size, per_chunk, pow2) in [(8192u32, 512u32, true), (12288, 341, false)] {
            let pool = RecvPool::<Soft>::new(size, 2 * per_chunk).unwrap();
            assert_eq!(pool.per_chunk, per_chunk);
            assert_eq!(pool.chunk_shift.is_some(), pow2);
            assert_eq!(pool.grow(&pd).unwrap(), 0..per_chunk);
            assert_eq!(pool.grow(&pd).unwrap(), per_chunk..2 * per_chunk);
            for idx in [
                0,
                1,
                per_chunk - 1,
                per_chunk,
                per_chunk + 7,
                2 * per_chunk - 1,
            ] {
                let (chunk, i) = ((idx / per_chunk) as usize, (idx % per_chunk) as usize);
                let c = pool.chunks[chunk].get().unwrap();
                let sge = pool.recv_sge(idx).unwrap();
                let off = (i * size as usize) as u64;
                assert_eq!(sge.addr, c.mr.addr() + off, "slot {idx}");
                assert!(std::ptr::eq(pool.shares(idx), &c.shares[i]), "slot {idx}");
            }
            assert!(pool.recv_sge(2 * per_chunk).is_none(), "past the slots");
        }
    }
}
