//! Send slots: registered memory that frames are encoded into, shared by the connections
//! that send from it.
//!
//! ```text
//! chunk 0 (one MR): [ slot 0 | slot 1 | ... | slot C-1 ]     registered at creation
//! chunk 1 (one MR): [ slot C | ... | slot 2C-1 ]             registered when first needed
//! ...                                                        up to `max` slots
//! ```
//!
//! A server shard's connections send from one growing pool ([`SendPool::growing`]), and so do
//! a client process's channels on one device (one pool per slot size): a
//! channel takes a slot while it encodes a frame and gives it back when the SEND completes
//! (at once for an inline SEND), so the slots in use at any moment follow the frames in
//! flight of the whole process, not its number of channels. A chunk is registered the first
//! time every registered slot is taken, by whoever takes (the rare slow path: one lock, one
//! registration); nothing is deregistered before the pool goes. Each channel still counts
//! its own slots against a cap (its `Geometry::send_slots`, see
//! [`super::SlotArena::with_sends`]), so no channel takes what the others need and its QP's
//! send queue never overflows.
//!
//! Taking and giving back are lock-free (the free slots are a [`SlotStack`], the warmest on
//! top); a slot's address is its chunk's base, read with one load, plus its offset. A chunk's
//! entry is written before its slots are pushed on the stack (release), and a taker pops a
//! slot (acquire) before it looks the chunk up, so it always finds the entry.
//!
//! When the pool is at its limit, or registering a chunk failed, a taker finds no slot:
//! blocking callers keep driving their connection and look again; async ones wait for
//! [`SendPool::freed`], notified by every release while someone waits.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tracing::warn;

use super::stack::{SlotStack, zeroed};
use crate::verbs::{Access, Mr, Pd, Provider, Result, Sge};

/// No next slot in a SEND's chain of send slots.
pub const NO_SLOT: u32 = u32::MAX;

/// Bytes a growing pool registers at a time (at least one slot).
const CHUNK_BYTES: usize = 256 << 10;

/// Chunks a growing pool registers when it is made.
const FIRST_CHUNKS: u32 = 2;

/// Bytes a growing pool registers at most.
const MAX_BYTES: usize = 1 << 30;

/// What growing needs: the PD to register with and the regions, owned here until the pool
/// goes (declared before `pd`: dropped first).
struct Grow<P: Provider> {
    mrs: Vec<P::Mr>,
    pd: Arc<P::Pd>,
}

/// Registered send slots, in chunks (see the module docs).
pub struct SendPool<P: Provider> {
    slot_size: u32,
    /// log2 of the slots per chunk.
    shift: u32,
    /// Slots registered so far (a multiple of the chunk's, up to `max`).
    registered: AtomicU32,
    max: u32,
    /// Per chunk: where its slots are mapped, their address and key (0 until registered).
    ptrs: Box<[AtomicU64]>,
    addrs: Box<[AtomicU64]>,
    lkeys: Box<[AtomicU32]>,
    free: SlotStack,
    /// Per slot: the slot of the next frame coalesced into the same SEND, or [`NO_SLOT`],
    /// stored XORed with `NO_SLOT` (so a zeroed entry reads `NO_SLOT`). Written and read by
    /// the slot's owner only.
    next: Box<[AtomicU32]>,
    /// A registration failed (logged once): the pool stays as it is, no take retries it.
    stuck: std::sync::atomic::AtomicBool,
    /// Async takers waiting for a slot of the pool (not for their own cap), and their wake-up.
    waiters: AtomicU32,
    freed: tokio::sync::Notify,
    grow: Mutex<Grow<P>>,
}

impl<P: Provider> SendPool<P> {
    /// A pool that registers [`FIRST_CHUNKS`] chunks of [`CHUNK_BYTES`] of slots now and a chunk
    /// more whenever every registered slot is taken, up to `max_slots` (and [`MAX_BYTES`]).
    ///
    /// # Errors
    /// When the first chunk's registration fails.
    pub fn growing(pd: Arc<P::Pd>, slot_size: u32, max_slots: u32) -> Result<Arc<SendPool<P>>> {
        let per_chunk = (CHUNK_BYTES / slot_size.max(1) as usize).max(1);
        // A power of two, so that a slot's chunk is a shift away.
        let per_chunk = 1u32 << per_chunk.ilog2();
        // Whole chunks: at least what was asked (within the byte limit).
        let max = (max_slots as usize)
            .min(MAX_BYTES / slot_size.max(1) as usize)
            .next_multiple_of(per_chunk as usize) as u32;
        // The first chunks now: a burst of a few dozen frames (a turn's responses, a pipeline's
        // requests) then needs no registration on the data path.
        let first = FIRST_CHUNKS.min(max / per_chunk);
        let mrs = (0..first)
            .map(|_| pd.alloc_mr(slot_size as usize * per_chunk as usize, Access::LOCAL_WRITE))
            .collect::<Result<Vec<_>>>()?;
        let pool = Self::empty(slot_size, per_chunk, max, pd);
        {
            let mut g = pool.grow.lock().unwrap_or_else(|p| p.into_inner());
            // The last chunk first: the lowest slot ends on top of the stack.
            for (i, mr) in mrs.into_iter().enumerate().rev() {
                pool.publish(&mut g.mrs, i as u32, mr, per_chunk, false);
            }
        }
        Ok(Arc::new(pool))
    }

    fn empty(slot_size: u32, per_chunk: u32, max: u32, pd: Arc<P::Pd>) -> SendPool<P> {
        SendPool {
            slot_size,
            shift: per_chunk.trailing_zeros(),
            registered: AtomicU32::new(0),
            max,
            ptrs: zeroed::<u64, AtomicU64>(max.div_ceil(per_chunk) as usize),
            addrs: zeroed::<u64, AtomicU64>(max.div_ceil(per_chunk) as usize),
            lkeys: zeroed::<u32, AtomicU32>(max.div_ceil(per_chunk) as usize),
            free: SlotStack::empty(max),
            next: zeroed::<u32, AtomicU32>(max as usize),
            stuck: std::sync::atomic::AtomicBool::new(false),
            waiters: AtomicU32::new(0),
            freed: tokio::sync::Notify::new(),
            grow: Mutex::new(Grow {
                mrs: Vec::new(),
                pd,
            }),
        }
    }

    /// Makes `mr` chunk `i` with its first `n` slots free, the lowest on top, or all but the
    /// first, returned for the caller (`keep_first`). Called once per chunk, with the `grow`
    /// lock held (`mrs` is its list of regions).
    fn publish(
        &self,
        mrs: &mut Vec<P::Mr>,
        i: u32,
        mr: P::Mr,
        n: u32,
        keep_first: bool,
    ) -> Option<u32> {
        self.ptrs[i as usize].store(mr.as_ptr() as u64, Ordering::Relaxed);
        self.addrs[i as usize].store(mr.addr(), Ordering::Relaxed);
        self.lkeys[i as usize].store(mr.lkey(), Ordering::Relaxed);
        mrs.push(mr);
        let first = i << self.shift;
        self.registered.fetch_max(first + n, Ordering::Release);
        // Pushed with release: a taker that pops one sees the entry above.
        let from = first + u32::from(keep_first);
        for s in (from..first + n).rev() {
            self.free.push(s);
        }
        keep_first.then_some(first)
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u32 {
        self.slot_size
    }

    /// Slots registered so far.
    pub fn registered(&self) -> u32 {
        self.registered.load(Ordering::Acquire)
    }

    /// How many registered slots are free.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Slots that can still be taken: the free ones, and those the pool may still register.
    #[inline]
    pub fn available(&self) -> usize {
        let growable = if self.stuck.load(Ordering::Relaxed) {
            0
        } else {
            self.max
                .saturating_sub(self.registered.load(Ordering::Relaxed))
        };
        self.free() + growable as usize
    }

    /// Takes a free slot, registering a chunk when none is; `None` at the limit (or when
    /// registering failed).
    pub fn take(&self) -> Option<u32> {
        self.free.pop().or_else(|| self.grow_and_take())
    }

    #[cold]
    fn grow_and_take(&self) -> Option<u32> {
        let mut g = self.grow.lock().unwrap_or_else(|p| p.into_inner());
        // Another taker may have grown the pool, or a slot come back, meanwhile.
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let have = self.registered.load(Ordering::Relaxed);
        if have >= self.max || self.stuck.load(Ordering::Relaxed) {
            return None;
        }
        let per_chunk = 1u32 << self.shift;
        // Registered under the lock: the slow path of a process's first burst, once per chunk.
        match g.pd.alloc_mr(
            self.slot_size as usize * per_chunk as usize,
            Access::LOCAL_WRITE,
        ) {
            Ok(mr) => self.publish(&mut g.mrs, have >> self.shift, mr, per_chunk, true),
            Err(e) => {
                self.stuck.store(true, Ordering::Relaxed);
                warn!(
                    "cannot register more send slots ({have} of {} registered, {} bytes \
                     each): {e}; the channels of this process share the slots they have",
                    self.max, self.slot_size
                );
                None
            }
        }
    }

    /// Returns a slot whose send completed (or that was never posted).
    pub fn release(&self, idx: u32) {
        debug_assert!(idx < self.registered());
        self.free.push(idx);
        // Pairs with the waiter's SeqCst increment before its second look (as
        // `SlotStack::push`'s compare-exchange is SeqCst-ordered with it through `len`).
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Async takers that found no slot of the pool count themselves here while they wait
    /// on [`SendPool::freed`] (and look once more after counting).
    pub fn waiters(&self) -> &AtomicU32 {
        &self.waiters
    }

    /// Notified by every release while [`SendPool::waiters`] is not zero.
    pub fn freed(&self) -> &tokio::sync::Notify {
        &self.freed
    }

    /// Chains slot `next` after slot `slot` (`NO_SLOT`: `slot` is the last) in a SEND that
    /// coalesces several frames. The caller owns `slot`.
    pub fn chain(&self, slot: u32, next: u32) {
        if let Some(n) = self.next.get(slot as usize) {
            n.store(next ^ NO_SLOT, Ordering::Relaxed);
        }
    }

    /// The slot chained after `slot`, or `NO_SLOT`.
    pub fn next_in_chain(&self, slot: u32) -> u32 {
        self.next
            .get(slot as usize)
            .map_or(NO_SLOT, |n| n.load(Ordering::Relaxed) ^ NO_SLOT)
    }

    /// Returns the slots of a SEND whose first frame is in `slot`; how many went back.
    pub fn release_chain(&self, slot: u32) -> u32 {
        let mut s = slot;
        // A chain never holds more than a SEND's frames; bounded all the same.
        for n in 1..=64 {
            let next = self.next_in_chain(s);
            self.release(s);
            if next == NO_SLOT {
                return n;
            }
            s = next;
        }
        64
    }

    /// Slot `idx`'s chunk and its offset there.
    #[inline]
    fn chunk(&self, idx: u32) -> (usize, usize) {
        debug_assert!(idx < self.registered());
        let off = (idx & ((1 << self.shift) - 1)) as usize * self.slot_size as usize;
        ((idx >> self.shift) as usize, off)
    }

    /// The bytes of slot `idx`.
    ///
    /// # Safety
    /// The caller owns slot `idx` (took it and has not posted or released it), so nothing
    /// else reads or writes it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn buf(&self, idx: u32) -> &mut [u8] {
        let (c, off) = self.chunk(idx);
        let base = self.ptrs[c].load(Ordering::Relaxed) as *mut u8;
        // SAFETY: slot `idx` was taken, so its chunk is registered and its entry written
        // before the slot was pushed (see the module docs); `off + slot_size` lies inside the
        // chunk's MR, which the pool owns; the caller owns the slot exclusively.
        unsafe { std::slice::from_raw_parts_mut(base.add(off), self.slot_size as usize) }
    }

    /// The SGE covering the first `len` bytes of slot `idx`.
    #[inline]
    pub fn sge(&self, idx: u32, len: u32) -> Sge {
        debug_assert!(len <= self.slot_size);
        let (c, off) = self.chunk(idx);
        Sge {
            addr: self.addrs[c].load(Ordering::Relaxed) + off as u64,
            length: len,
            lkey: self.lkeys[c].load(Ordering::Relaxed),
        }
    }
}

impl<P: Provider> fmt::Debug for SendPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendPool")
            .field("slot_size", &self.slot_size)
            .field("registered", &self.registered())
            .field("max", &self.max)
            .field("free", &self.free())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::{Geometry, SlotArena};
    use crate::verbs::soft::Soft;
    use crate::verbs::{Context, Provider};

    fn pd() -> Arc<<Soft as Provider>::Pd> {
        let ctx = Box::leak(Box::new(Soft::open(None).unwrap()));
        Arc::new(ctx.alloc_pd().unwrap())
    }

    #[test]
    fn a_growing_pool_registers_a_chunk_when_every_slot_is_taken() {
        // 4 KiB slots: 64 per 256 KiB chunk, two at first; at most 3 chunks.
        let pool = SendPool::<Soft>::growing(pd(), 4096, 192).unwrap();
        assert_eq!((pool.registered(), pool.free()), (128, 128));
        let mut taken: Vec<u32> = (0..128).map(|_| pool.take().unwrap()).collect();
        assert_eq!(
            pool.registered(),
            128,
            "nothing registered while slots were free"
        );
        assert_eq!(taken, (0..128).collect::<Vec<_>>(), "the lowest first");
        taken.push(pool.take().unwrap());
        assert_eq!(pool.registered(), 192, "one chunk more");
        assert_eq!(*taken.last().unwrap(), 128, "the new chunk's first slot");
        while let Some(s) = pool.take() {
            taken.push(s);
        }
        assert_eq!((pool.registered(), taken.len()), (192, 192), "at the limit");
        let mut sorted = taken.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 192, "no slot handed out twice");
        // Every slot's bytes and SGE lie in its own chunk's region, apart from the others'.
        let mut spans: Vec<(u64, u32)> = taken
            .iter()
            .map(|&s| {
                let sge = pool.sge(s, 4096);
                // SAFETY: we own every slot (taken, not released).
                let buf = unsafe { pool.buf(s) };
                buf[0] = s as u8;
                buf[4095] = s as u8;
                assert_eq!(buf.len(), 4096);
                (sge.addr, sge.lkey)
            })
            .collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[1].0 >= w[0].0 + 4096));
        for &s in &taken {
            // SAFETY: as above.
            let buf = unsafe { pool.buf(s) };
            assert_eq!((buf[0], buf[4095]), (s as u8, s as u8), "slot {s}");
        }
        for s in taken {
            pool.release(s);
        }
        assert_eq!((pool.free(), pool.registered()), (192, 192));
    }

    #[test]
    fn channels_share_the_pool_each_up_to_its_cap() {
        let pd = pd();
        let pool = SendPool::<Soft>::growing(Arc::clone(&pd), 8192, 4096).unwrap();
        let g = Geometry {
            slot_size: 8192,
            send_slots: 40,
            recv_slots: 8,
        };
        let a = SlotArena::with_sends(&pd, g, Arc::clone(&pool), 4).unwrap();
        let b = SlotArena::with_sends(&pd, g, Arc::clone(&pool), 4).unwrap();
        let held_a: Vec<u32> = std::iter::from_fn(|| a.take_send()).collect();
        assert_eq!(
            (held_a.len(), a.free_sends()),
            (40, 0),
            "a stops at its cap"
        );
        assert_eq!(pool.registered(), 64, "32 slots a chunk: the first two");
        let held_b: Vec<u32> = (0..10).map(|_| b.take_send().unwrap()).collect();
        assert_eq!(b.free_sends(), 30, "b has its own cap");
        assert!(held_b.iter().all(|s| !held_a.contains(s)));
        // a chain of three goes back at once, and counts three against the cap.
        a.chain(held_a[0], held_a[1]);
        a.chain(held_a[1], held_a[2]);
        a.chain(held_a[2], NO_SLOT);
        assert_eq!(a.release_chain(held_a[0]), 3);
        assert_eq!(a.free_sends(), 3);
        for &s in &held_a[3..] {
            a.release_send(s);
        }
        assert_eq!(a.free_sends(), 40);
        assert_eq!(
            b.take_send(),
            Some(held_a[39]),
            "the warmest slot, whoever gave it back"
        );
        // A wrong slot size is refused.
        let g4 = Geometry {
            slot_size: 4096,
            ..g
        };
        assert!(SlotArena::with_sends(&pd, g4, pool, 4).is_err());
    }

    #[test]
    fn at_its_limit_a_pool_says_so_and_a_release_wakes_its_waiters() {
        let pd = pd();
        let pool = SendPool::<Soft>::growing(Arc::clone(&pd), 8192, 32).unwrap();
        let g = Geometry {
            slot_size: 8192,
            send_slots: 128,
            recv_slots: 8,
        };
        let a = SlotArena::with_sends(&pd, g, Arc::clone(&pool), 4).unwrap();
        let held: Vec<u32> = std::iter::from_fn(|| a.take_send()).collect();
        assert_eq!(held.len(), 32, "the pool's limit, below the cap");
        assert!(a.pool_exhausted());
        assert_eq!(a.free_sends(), 0, "below its cap, but the pool has none");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            pool.waiters().fetch_add(1, Ordering::SeqCst);
            let freed = pool.freed().notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            a.release_send(held[5]);
            tokio::time::timeout(std::time::Duration::from_secs(10), freed)
                .await
                .expect("a release wakes the pool's waiters");
            pool.waiters().fetch_sub(1, Ordering::SeqCst);
        });
        assert!(!a.pool_exhausted());
        assert_eq!(a.take_send(), Some(held[5]));
    }

    #[test]
    fn a_shards_send_slots_are_registered_as_it_needs_them() {
        let pd = pd();
        let a = SlotArena::<Soft>::send_only(&pd, 8192, 2048).unwrap();
        let pool = Arc::clone(a.send_pool());
        assert_eq!((pool.registered(), a.free_sends()), (64, 2048));
        let held: Vec<u32> = (0..65).map(|_| a.take_send().unwrap()).collect();
        assert_eq!((pool.registered(), a.free_sends()), (96, 2048 - 65));
        for s in held {
            a.release_send(s);
        }
        assert_eq!(a.free_sends(), 2048);
        // Asked in whole chunks: 100 slots of 8 KiB round up to 128.
        let b = SlotArena::<Soft>::send_only(&pd, 8192, 100).unwrap();
        assert_eq!(b.free_sends(), 128);
    }
}
