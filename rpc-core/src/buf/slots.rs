//! A connection's slots: the send slots it takes from a [`SendPool`] (see [`super::sends`]:
//! its own, its shard's, or its process's), and its receive window: receive slots it
//! registers itself, in chunks, and posts to its own receive queue.
//!
//! ```text
//! send slots (the pool's chunks):   [ send 0 | send 1 | ... ] [ ... ] ...
//! receive window (its own MRs):     [ recv 0 .. W-1 ] [ W .. 2W-1 ] [ 2W .. 4W-1 ] ...
//! ```
//!
//! Ownership of a slot moves between the runtime and the NIC and is never shared:
//!
//! - a **send slot** is taken from the pool by whoever encodes a frame into it, handed to the
//!   NIC by `post_send`, and returned to the pool when the send's completion is polled (last
//!   in, first out: the next frame goes to the warmest slot, see [`super::stack`]);
//! - a **receive slot** is owned by the NIC while its RECV is posted; its completion hands it to
//!   a [`RecvSlot`] guard; dropping the guard (on any thread) puts the index on the repost
//!   queue, and the connection's driver posts the RECV again in its next batch. A slot that
//!   holds several frames (a batch, see [`crate::wire::frame`]) gets one guard per frame
//!   ([`RecvSlot::share`]): the slot goes back to the ring when the last of them drops, and it
//!   counts once in the lending budget however many of its frames are kept.
//!
//! **The receive window.** A client channel starts with [`RECV_WINDOW_START`] receive slots
//! (the credits its server starts with) and doubles it, a chunk registered at a time
//! ([`SlotArena::grow_recv`], driven by its calls in flight: see `Link::maybe_resize_recv`), up
//! to its `Geometry::recv_slots`; after a quiet spell it gives back the chunks its calls no
//! longer need ([`SlotArena::shrink_recv`], once its driver holds every slot of them back). A
//! channel thus holds a few slots of registered memory beyond what its calls in flight need,
//! not a whole ring. Receive memory is the connection's alone and goes with its arena, after
//! its QP: it is never handed to another connection, because a destroyed QP's receives may
//! still be written by a peer that was already writing (the soft RNIC's peer does the
//! responder's work; an RNIC stops at `ibv_destroy_qp`), where a deregistered region takes
//! the write harmlessly.
//!
//! Both are lock-free (the repost queue is `crossbeam-queue`'s); nothing here allocates after
//! construction but a growing pool or window registering a chunk (at a new high-water mark).

use crate::queue::PopIfAny;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_queue::ArrayQueue;
use tracing::warn;

use super::sends::SendPool;
use crate::verbs::{Access, Mr, Pd, Provider, Result, Sge};

/// Receive slots a client channel starts with: the reserve of two control credits, and room
/// for a few calls before the window grows (with 8 KiB slots, 64 KiB).
pub const RECV_WINDOW_START: u32 = 8;

/// Sizes of a connection's slot rings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per slot (send and receive alike): the largest eager frame.
    pub slot_size: u32,
    /// Number of send slots.
    pub send_slots: u32,
    /// The most receive slots (the most credits the peer gets; a client channel starts with
    /// fewer and grows to this as its calls in flight need them).
    pub recv_slots: u32,
}

impl Geometry {
    /// Smallest slot: room for the largest frame header and a little payload.
    pub const MIN_SLOT: u32 = 256;
    /// Largest slot.
    pub const MAX_SLOT: u32 = 1 << 20;
    /// Most slots in one ring.
    pub const MAX_SLOTS: u32 = 1 << 14;

    /// Whether the sizes are within limits (a peer's geometry is checked with this).
    pub fn is_valid(&self) -> bool {
        (Self::MIN_SLOT..=Self::MAX_SLOT).contains(&self.slot_size)
            && self.slot_size.is_multiple_of(64)
            && (1..=Self::MAX_SLOTS).contains(&self.send_slots)
            && (1..=Self::MAX_SLOTS).contains(&self.recv_slots)
    }
}

impl Default for Geometry {
    fn default() -> Self {
        Geometry {
            slot_size: 8192,
            send_slots: 128,
            recv_slots: 128,
        }
    }
}

/// The slots of one connection: the send slots it takes from a [`SendPool`] (its own, a
/// server shard's, or its process's, counted against a cap), and its receive window (slots of
/// the same pool) with their repost queue. Shared (in an `Arc`) by the connection's driver and
/// every [`RecvSlot`] guard, so the memory outlives any guard still held by user code after
/// the connection is gone.
pub struct SlotArena<P: Provider> {
    geometry: Geometry,
    pool: Arc<SendPool<P>>,
    /// Send slots taken and not back, counted only under a cap (`cap != u32::MAX`).
    held: AtomicU32,
    cap: u32,
    /// Per region of the window ([`Regions`]): where it is mapped, its address for the NIC
    /// and its key. Written only as the window grows, by the connection's driver, before
    /// its slots are posted.
    regions: Regions,
    /// Receive slots in the window (none for a shard's arena, which receives through its
    /// pool); written only by the connection's driver, as it grows and shrinks.
    window: AtomicU32,
    repost: ArrayQueue<u32>,
    /// Receive slots lent out of the ring (kept by user `Bytes` or unread stream messages).
    lent: AtomicU32,
    /// Most receive slots that may be lent at once ([`lending_budget`] of the window).
    lend_max: AtomicU32,
    /// Per receive slot shared by several guards (a batch): the live guards, and [`LENT`]
    /// when the slot is counted in `lent`. Zero, untouched, for a slot with one guard.
    shares: Box<[AtomicU32]>,
    /// Registering a region of the window failed (logged once): it grows no more.
    stuck: AtomicBool,
    /// Tests: registering a region fails, as with RLIMIT_MEMLOCK reached.
    #[cfg(test)]
    refuse_growth: AtomicBool,
    /// The window's regions. Declared before `pd`: dropped first.
    chunks: Mutex<Vec<P::Mr>>,
    pd: Option<Arc<P::Pd>>,
}

/// Regions a window can have: the first, and one per doubling up to `Geometry::MAX_SLOTS`.
const MAX_REGIONS: usize = 14;

/// The regions of a receive window: the first holds slots `0..first`, and region `k >= 1`,
/// registered when the window doubled the `k`th time, slots `first << (k - 1) .. first << k`
/// (the last one cut at `Geometry::recv_slots`), so a slot's region is a shift and a count of
/// leading zeros away. `first` is a power of two, or the whole window (which never grows).
struct Regions {
    first: u32,
    shift: u32,
    ptr: [AtomicU64; MAX_REGIONS],
    addr: [AtomicU64; MAX_REGIONS],
    lkey: [AtomicU32; MAX_REGIONS],
}

/// Regions a window that starts at `first` slots has when it has grown to `max`: the first,
/// and one per doubling.
fn regions_to_reach(first: u32, max: u32) -> usize {
    let mut n = 1;
    let mut w = first.max(1);
    while w < max && n < MAX_REGIONS {
        w = w.saturating_mul(2);
        n += 1;
    }
    n
}

impl Regions {
    fn new(first: u32) -> Regions {
        Regions {
            first,
            shift: first.max(1).trailing_zeros(),
            ptr: Default::default(),
            addr: Default::default(),
            lkey: Default::default(),
        }
    }

    /// Where region `k` ends (slots; before `Geometry::recv_slots` cuts the last one).
    fn end(&self, k: usize) -> u32 {
        self.first << k
    }

    /// The region of slot `idx`.
    #[inline]
    fn region(&self, idx: u32) -> usize {
        if idx < self.first {
            0
        } else {
            (u32::BITS - (idx >> self.shift).leading_zeros()) as usize
        }
    }

    /// Slot `idx`'s region and its byte offset there (`slot_size` bytes a slot).
    #[inline]
    fn find(&self, idx: u32, slot_size: u32) -> (usize, usize) {
        let k = self.region(idx);
        let start = if k == 0 { 0 } else { self.first << (k - 1) };
        (k, (idx - start) as usize * slot_size as usize)
    }
}

pub use super::sends::NO_SLOT;

/// In a receive slot's share count: the slot is counted in the lending budget.
const LENT: u32 = 1 << 31;
/// In a receive slot's share count: the number of live guards.
const GUARDS: u32 = LENT - 1;

/// How many of a connection's `window` receive slots received data may keep out of the ring
/// at once: half of them, so the other half keeps serving every call whatever the user keeps.
///
/// A received frame stays in its slot (zero copy) while a `bytes` field decoded from it, or an
/// unread stream message, is alive. With no bound, a user that keeps what it receives would
/// hold every slot, and with no slot to repost the connection has no credit left for any call.
/// Past the budget the data is copied out of the slot (one allocation) and the slot goes back
/// to the ring at once. The budget follows the window as it grows: slots kept out leave the
/// peer short of credits, which grows the window (up to `Geometry::recv_slots`).
pub(crate) fn lending_budget(window: u32) -> u32 {
    window / 2
}

fn invalid(what: &'static str) -> crate::verbs::VerbsError {
    crate::verbs::VerbsError::new(
        crate::verbs::Verb::AllocMr,
        crate::verbs::ErrorKind::InvalidArgument,
        what,
    )
}

impl<P: Provider> SlotArena<P> {
    /// An arena with a send pool of its own and its whole receive window at once (tests).
    /// All receive slots start on the repost queue, so the driver's first batch posts them.
    ///
    /// # Errors
    /// When the geometry is invalid or registration fails.
    #[cfg(test)]
    pub fn new(pd: &Arc<P::Pd>, geometry: Geometry) -> Result<Arc<SlotArena<P>>> {
        if !geometry.is_valid() {
            return Err(invalid("slot geometry out of range"));
        }
        let sends = SendPool::growing(Arc::clone(pd), geometry.slot_size, geometry.send_slots)?;
        Self::alloc(pd, geometry, sends, u32::MAX, geometry.recv_slots)
    }

    /// An arena whose send slots come from `sends`, shared with other connections (a client
    /// process's channels on one device): this connection holds at most
    /// `geometry.send_slots` of them at once. Its receive window starts at `window` slots (a
    /// power of two, at least 4: the reserve of two control credits and two data credits),
    /// registered now and on the repost queue, and doubles up to `geometry.recv_slots`.
    ///
    /// # Errors
    /// When the geometry is invalid or not the pool's, `window` is out of range, or
    /// registration fails.
    pub fn with_sends(
        pd: &Arc<P::Pd>,
        geometry: Geometry,
        sends: Arc<SendPool<P>>,
        window: u32,
    ) -> Result<Arc<SlotArena<P>>> {
        if !geometry.is_valid()
            || sends.slot_size() != geometry.slot_size
            || !(4..=geometry.recv_slots).contains(&window)
            || !window.is_power_of_two()
        {
            return Err(invalid(
                "slot geometry or receive window out of range, or not the send pool's",
            ));
        }
        Self::alloc(pd, geometry, sends, geometry.send_slots, window)
    }

    /// An arena of send slots only, shared by the connections of a server shard (which
    /// receive through the shard's [`super::RecvPool`]): up to `send_slots` of them,
    /// registered as the shard first needs them (see [`super::sends`]).
    ///
    /// # Errors
    /// When the sizes are out of range or registration fails.
    pub fn send_only(
        pd: &Arc<P::Pd>,
        slot_size: u32,
        send_slots: u32,
    ) -> Result<Arc<SlotArena<P>>> {
        let geometry = Geometry {
            slot_size,
            send_slots,
            recv_slots: 0,
        };
        if !(Geometry {
            recv_slots: 1,
            ..geometry
        })
        .is_valid()
        {
            return Err(invalid("send slot sizes out of range"));
        }
        let sends = SendPool::growing(Arc::clone(pd), slot_size, send_slots)?;
        Self::alloc(pd, geometry, sends, u32::MAX, 0)
    }

    fn alloc(
        pd: &Arc<P::Pd>,
        geometry: Geometry,
        pool: Arc<SendPool<P>>,
        cap: u32,
        window: u32,
    ) -> Result<Arc<SlotArena<P>>> {
        let n = geometry.recv_slots as usize;
        let arena = SlotArena {
            geometry,
            pool,
            held: AtomicU32::new(0),
            cap,
            regions: Regions::new(window),
            window: AtomicU32::new(0),
            repost: ArrayQueue::new(n.max(1)),
            lent: AtomicU32::new(0),
            lend_max: AtomicU32::new(0),
            shares: (0..n).map(|_| AtomicU32::new(0)).collect(),
            stuck: AtomicBool::new(false),
            #[cfg(test)]
            refuse_growth: AtomicBool::new(false),
            // Room for every region the window may grow to, so growing allocates nothing.
            chunks: Mutex::new(Vec::with_capacity(if window == 0 {
                0
            } else {
                regions_to_reach(window, geometry.recv_slots)
            })),
            pd: (n > 0).then(|| Arc::clone(pd)),
        };
        if window > 0 {
            for i in arena.register_recv(window, 0)? {
                let _ = arena.repost.push(i);
            }
        }
        Ok(Arc::new(arena))
    }

    /// Doubles the receive window (one registered region, never past `geometry.recv_slots`)
    /// and returns the new slots' indices: unposted, for the caller to post (the NIC's from
    /// then on) and grant to the peer as credits. None when the window is whole, or
    /// registering failed (logged once; the window stays as it is). Only the connection's
    /// driver calls it.
    #[cold]
    pub fn grow_recv(&self) -> std::ops::Range<u32> {
        let w = self.recv_window();
        let k = 1 + (w >> self.regions.shift).max(1).ilog2() as usize;
        if self.stuck.load(Ordering::Relaxed)
            || !self.regions.first.is_power_of_two()
            || k >= MAX_REGIONS
        {
            return w..w;
        }
        match self.register_recv(w, k) {
            Ok(r) => r,
            Err(e) => {
                self.stuck.store(true, Ordering::Relaxed);
                warn!(
                    "cannot register more receive slots ({w} of {} in the window, {} bytes \
                     each): {e}; the connection keeps the window it has",
                    self.geometry.recv_slots, self.geometry.slot_size
                );
                w..w
            }
        }
    }

    /// Registers up to `n` more receive slots as region `k` and adds them to the window.
    fn register_recv(&self, n: u32, k: usize) -> Result<std::ops::Range<u32>> {
        let from = self.recv_window();
        let n = n.min(self.geometry.recv_slots - from);
        let Some(pd) = self.pd.as_ref().filter(|_| n > 0) else {
            return Ok(from..from);
        };
        #[cfg(test)]
        if self.refuse_growth.load(Ordering::Relaxed) {
            return Err(crate::verbs::VerbsError::new(
                crate::verbs::Verb::AllocMr,
                crate::verbs::ErrorKind::OutOfMemory,
                "refused by the test",
            ));
        }
        let mr = pd.alloc_mr(
            self.geometry.slot_size as usize * n as usize,
            Access::LOCAL_WRITE,
        )?;
        let r = &self.regions;
        r.ptr[k].store(mr.as_ptr() as u64, Ordering::Relaxed);
        r.addr[k].store(mr.addr(), Ordering::Relaxed);
        r.lkey[k].store(mr.lkey(), Ordering::Relaxed);
        self.chunks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(mr);
        self.window.store(from + n, Ordering::Relaxed);
        self.lend_max
            .store(lending_budget(from + n), Ordering::Relaxed);
        Ok(from..from + n)
    }

    /// Receive slots lent out of the ring now (kept by user `Bytes` or unread stream
    /// messages).
    #[inline]
    pub fn lent_recv(&self) -> u32 {
        self.lent.load(Ordering::Relaxed)
    }

    /// The window the arena started with (its first region): it never shrinks below it.
    #[inline]
    pub fn first_window(&self) -> u32 {
        self.regions.first
    }

    /// The smallest window of whole regions that holds `n` slots (at least the first
    /// region, at most the window now).
    pub fn window_for(&self, n: u32) -> u32 {
        let w = self.recv_window();
        if n <= self.regions.first || w <= self.regions.first {
            return self.regions.first.min(w);
        }
        // The window ends where the region holding slot `n - 1` does.
        self.regions.end(self.regions.region(n.min(w) - 1)).min(w)
    }

    /// Shrinks the receive window to `to` slots (a value [`SlotArena::window_for`] gave):
    /// the regions above it are deregistered. Returns the window now.
    ///
    /// The caller (the connection's driver) must hold every slot from `to` on out of the
    /// NIC's and everyone's hands: not posted, no guard alive, not on the repost queue
    /// (`Link` parks them as they come back, and shrinks once all of them are parked).
    pub fn shrink_recv(&self, to: u32) -> u32 {
        let w = self.recv_window();
        if to >= w || to < self.regions.first {
            return w;
        }
        // The regions up to the one holding slot `to - 1`.
        let keep = self.regions.region(to - 1) + 1;
        self.window.store(to, Ordering::Relaxed);
        self.lend_max.store(lending_budget(to), Ordering::Relaxed);
        // Popped under the lock, deregistered after it (the Vec keeps its capacity, so
        // growing again allocates nothing).
        let mut gone: [Option<P::Mr>; MAX_REGIONS] = Default::default();
        {
            let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
            let mut i = 0;
            while chunks.len() > keep {
                gone[i] = chunks.pop();
                i += 1;
            }
        }
        drop(gone);
        to
    }

    /// Tests: the receive slot of the window that `p` points into.
    #[cfg(test)]
    pub(crate) fn slot_holding(&self, p: *const u8) -> Option<u32> {
        let size = self.geometry.slot_size as usize;
        (0..self.recv_window()).find(|&i| {
            let start = self.recv_ptr(i) as usize;
            (start..start + size).contains(&(p as usize))
        })
    }

    /// Tests: every registration of a new region fails from now on.
    #[cfg(test)]
    pub(crate) fn refuse_growth(&self) {
        self.refuse_growth.store(true, Ordering::Relaxed);
    }

    /// Receive slots in the window now.
    #[inline]
    pub fn recv_window(&self) -> u32 {
        self.window.load(Ordering::Relaxed)
    }

    /// The geometry (for an arena with shared send slots, `send_slots` is its cap).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Send slots this connection holds (counted under a cap only; 0 else).
    pub fn held_sends(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// The pool the send slots come from.
    pub fn send_pool(&self) -> &Arc<SendPool<P>> {
        &self.pool
    }

    /// Where receive slot `idx` of the window is mapped.
    #[inline]
    fn recv_ptr(&self, idx: u32) -> *mut u8 {
        debug_assert!(idx < self.recv_window());
        let (k, off) = self.regions.find(idx, self.geometry.slot_size);
        (self.regions.ptr[k].load(Ordering::Relaxed) as *mut u8).wrapping_add(off)
    }

    /// Takes a free send slot; `None` when this connection holds its cap, or the pool has
    /// none (back-pressure).
    #[inline]
    pub fn take_send(&self) -> Option<u32> {
        if self.cap == u32::MAX {
            return self.pool.take();
        }
        if self.held.fetch_add(1, Ordering::Relaxed) >= self.cap {
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let s = self.pool.take();
        if s.is_none() {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        s
    }

    /// `n` send slots went back to the pool.
    #[inline]
    fn gave(&self, n: u32) {
        if self.cap != u32::MAX {
            self.held.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// Returns a send slot whose send completed.
    #[inline]
    pub fn release_send(&self, idx: u32) {
        self.pool.release(idx);
        self.gave(1);
    }

    /// Chains send slot `next` after send slot `slot` (`NO_SLOT`: `slot` is the last) in a
    /// SEND that coalesces several frames; followed by [`SlotArena::release_chain`] when the
    /// SEND completes. The caller owns `slot`.
    #[inline]
    pub fn chain(&self, slot: u32, next: u32) {
        self.pool.chain(slot, next);
    }

    /// Returns the send slots of a SEND whose first frame is in `slot` (chained with
    /// [`SlotArena::chain`]) to the free stack: its completion was polled, it was never
    /// posted, or its QP is destroyed.
    /// Returns how many slots went back.
    #[inline]
    pub fn release_chain(&self, slot: u32) -> u32 {
        let n = self.pool.release_chain(slot);
        self.gave(n);
        n
    }

    /// How many send slots this connection may take now: what is left of its cap, as far as
    /// the shared pool has them (free, or still to be registered); or what a pool of its own
    /// or its shard's has. Data frames leave the last few to control frames
    /// (`Link::control_reserve`), so near the pool's limit every channel keeps its credits
    /// flowing.
    #[inline]
    pub fn free_sends(&self) -> usize {
        if self.cap == u32::MAX {
            self.pool.available()
        } else {
            (self.cap.saturating_sub(self.held.load(Ordering::Relaxed)) as usize)
                .min(self.pool.available())
        }
    }

    /// Whether this connection could take a send slot by its cap, but the shared pool has
    /// none (it is at its limit): a waiter then waits for the pool's [`SendPool::freed`]
    /// (this connection's driver does not see other channels' slots come back).
    pub fn pool_exhausted(&self) -> bool {
        self.cap != u32::MAX
            && self.held.load(Ordering::Relaxed) < self.cap
            && self.pool.available() == 0
    }

    /// The bytes of send slot `idx`, to encode a frame into.
    ///
    /// # Safety
    /// The caller owns slot `idx` (took it with [`SlotArena::take_send`] and has not posted or
    /// released it), so nothing else reads or writes it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn send_buf(&self, idx: u32) -> &mut [u8] {
        // SAFETY: forwarded contract.
        unsafe { self.pool.buf(idx) }
    }

    /// The SGE covering the first `len` bytes of send slot `idx`.
    #[inline]
    pub fn send_sge(&self, idx: u32, len: u32) -> Sge {
        self.pool.sge(idx, len)
    }

    /// The SGE covering receive slot `idx` of the window (for `post_recv`).
    #[inline]
    pub fn recv_sge(&self, idx: u32) -> Sge {
        debug_assert!(idx < self.recv_window());
        let (k, off) = self.regions.find(idx, self.geometry.slot_size);
        Sge {
            addr: self.regions.addr[k].load(Ordering::Relaxed) + off as u64,
            length: self.geometry.slot_size,
            lkey: self.regions.lkey[k].load(Ordering::Relaxed),
        }
    }

    /// Asks the CPU to start loading the first bytes of receive slot `idx` (`len` bytes landed
    /// there), for a poll loop that got several completions at once: their frames were written
    /// by another core, so each first read is a cache miss, and prefetching them all before
    /// handling the first overlaps those misses instead of paying them one after the other.
    /// A hint only: no effect on what is read.
    #[inline]
    pub fn prefetch_recv(&self, idx: u32, len: u32) {
        if idx >= self.recv_window() {
            return;
        }
        prefetch_lines(self.recv_ptr(idx), len);
    }

    /// Whether receive slots wait to be posted again.
    pub fn has_reposts(&self) -> bool {
        !self.repost.is_empty()
    }

    /// How many receive slots wait to be posted again.
    pub fn reposts_waiting(&self) -> usize {
        self.repost.len()
    }

    /// Pops a receive slot to post again; `None` when none is waiting.
    pub fn take_repost(&self) -> Option<u32> {
        self.repost.pop_if_any()
    }

    /// Hands a completed receive slot to a guard.
    ///
    /// # Safety
    /// The RECV of slot `idx` has completed (its completion was polled) and it is not posted
    /// again until the guard is dropped; `len` is the completion's byte length.
    pub unsafe fn recv_slot(self: &Arc<Self>, idx: u32, len: u32) -> RecvSlot {
        let len = len.min(self.geometry.slot_size);
        let ptr = self.recv_ptr(idx);
        let owner: Arc<dyn Repost> = Arc::clone(self) as Arc<dyn Repost>;
        // SAFETY: forwarded contract; the slot's bytes lie in a region of the window, which
        // `owner` keeps registered and mapped.
        unsafe { RecvSlot::new(owner, ptr, idx, len) }
    }

    /// Returns a receive slot to the repost queue without a guard (e.g. a flushed receive).
    pub fn repost_later(&self, idx: u32) {
        debug_assert!(idx < self.recv_window());
        // Capacity equals the number of receive slots and each index is held once.
        let _ = self.repost.push(idx);
    }
}

impl<P: Provider> fmt::Debug for SlotArena<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotArena")
            .field("geometry", &self.geometry)
            .field("pool", &self.pool)
            .field("held", &self.held.load(Ordering::Relaxed))
            .field("window", &self.recv_window())
            .field("repost", &self.repost.len())
            .finish()
    }
}

/// What a [`RecvSlot`] needs of its arena: a way back to the repost queue and the lending
/// budget. Object-safe, so a slot guard does not name the provider.
pub trait Repost: Send + Sync + 'static {
    /// Queues receive slot `idx` for reposting.
    fn repost(&self, idx: u32);
    /// Counts receive slot `idx` as lent out of the ring; false (and nothing counted) past
    /// the budget.
    fn try_lend(&self, idx: u32) -> bool;
    /// Uncounts a slot counted by [`Repost::try_lend`].
    fn unlend(&self);
    /// The share count of receive slot `idx` (guards and [`LENT`]; see [`RecvSlot::share`]).
    fn shares(&self, idx: u32) -> &AtomicU32;
}

impl<P: Provider> Repost for SlotArena<P> {
    fn repost(&self, idx: u32) {
        self.repost_later(idx);
    }

    fn try_lend(&self, _idx: u32) -> bool {
        // A load first: past the budget (a user keeping everything) no write to the shared
        // counter is made at all.
        let max = self.lend_max.load(Ordering::Relaxed);
        if self.lent.load(Ordering::Relaxed) >= max {
            return false;
        }
        if self.lent.fetch_add(1, Ordering::AcqRel) < max {
            return true;
        }
        self.lent.fetch_sub(1, Ordering::AcqRel);
        false
    }

    fn unlend(&self) {
        self.lent.fetch_sub(1, Ordering::AcqRel);
    }

    fn shares(&self, idx: u32) -> &AtomicU32 {
        &self.shares[idx as usize]
    }
}

/// A received frame's slot, owned by the runtime until dropped. Dropping it (on any thread)
/// queues the slot for reposting. Its bytes can back `bytes::Bytes` without a copy
/// (`Bytes::from_owner`) once [`RecvSlot::try_lend`] said the connection's lending budget
/// allows it. The arena stays alive (and registered) while a guard exists.
pub struct RecvSlot {
    owner: Arc<dyn Repost>,
    ptr: *const u8,
    idx: u32,
    len: u32,
    /// Counted in the arena's lending budget (uncounted on drop); for a shared slot, the slot
    /// is counted (once, by its share count's [`LENT`]).
    lent: bool,
    /// Other guards of the same slot may exist ([`RecvSlot::share`]): the slot's share count
    /// decides who reposts it and who uncounts its loan.
    shared: bool,
}

// SAFETY: the guard owns its slot's bytes exclusively (the RECV is not reposted while it
// lives) and `owner` keeps the memory mapped; reading them from another thread is fine.
unsafe impl Send for RecvSlot {}
// SAFETY: shared access only reads the bytes, which nothing writes while the guard lives.
unsafe impl Sync for RecvSlot {}

impl RecvSlot {
    /// A guard of receive slot `idx` of `owner`, holding `len` received bytes at `ptr`.
    ///
    /// # Safety
    /// The slot's RECV completed (its completion was polled) and the slot is not posted again
    /// until the guard (and every guard [`RecvSlot::share`] makes of it) is dropped;
    /// `ptr .. ptr + len` lies in registered memory that `owner` keeps alive and mapped.
    pub(crate) unsafe fn new(owner: Arc<dyn Repost>, ptr: *const u8, idx: u32, len: u32) -> Self {
        RecvSlot {
            owner,
            ptr,
            idx,
            len,
            lent: false,
            shared: false,
        }
    }

    /// The received bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slot's RECV completed and it is not reposted while this guard lives
        // (`SlotArena::recv_slot`'s contract), so neither the NIC nor a peer writes it; the
        // range is inside the arena's MR (`len <= slot_size`), which `owner` keeps alive.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }

    /// Asks the connection's lending budget whether this slot may stay out of the ring for as
    /// long as user code keeps it (a `bytes` field borrowing it, an unread stream message):
    /// true when it may (counted until the guard drops; asking again is free), false past the
    /// budget, when the caller must copy what it keeps and drop the guard.
    pub fn try_lend(&mut self) -> bool {
        if self.lent {
            return true;
        }
        if !self.shared {
            self.lent = self.owner.try_lend(self.idx);
            return self.lent;
        }
        // A slot several guards share counts once, whichever of them asks first.
        let count = self.owner.shares(self.idx);
        if count.load(Ordering::Acquire) & LENT == 0 {
            if !self.owner.try_lend(self.idx) {
                return false;
            }
            if count.fetch_or(LENT, Ordering::AcqRel) & LENT != 0 {
                // Another guard counted it meanwhile.
                self.owner.unlend();
            }
        }
        self.lent = true;
        true
    }

    /// Another guard of this slot, for the next frame of a batch in it: the slot is reposted
    /// when the last guard drops, and counted once in the lending budget (see
    /// [`RecvSlot::try_lend`]). One atomic operation on the slot's share count (a store, the
    /// first time).
    pub fn share(&mut self) -> RecvSlot {
        let count = self.owner.shares(self.idx);
        if self.shared {
            // We hold a guard, so the count cannot reach zero meanwhile.
            count.fetch_add(1, Ordering::Relaxed);
        } else {
            // The only guard: nobody else reads or writes the count now.
            count.store(2 | if self.lent { LENT } else { 0 }, Ordering::Relaxed);
            self.shared = true;
        }
        RecvSlot {
            owner: Arc::clone(&self.owner),
            ptr: self.ptr,
            idx: self.idx,
            len: self.len,
            lent: self.lent,
            shared: true,
        }
    }
}

impl AsRef<[u8]> for RecvSlot {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for RecvSlot {
    fn drop(&mut self) {
        if self.shared {
            let count = self.owner.shares(self.idx);
            // AcqRel: every other guard's reads of the bytes happen before the repost below.
            let before = count.fetch_sub(1, Ordering::AcqRel);
            if before & GUARDS != 1 {
                return;
            }
            // The last guard: nobody else touches the count until the slot is received again.
            count.store(0, Ordering::Relaxed);
            if before & LENT != 0 {
                self.owner.unlend();
            }
        } else if self.lent {
            self.owner.unlend();
        }
        self.owner.repost(self.idx);
    }
}

impl fmt::Debug for RecvSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvSlot")
            .field("idx", &self.idx)
            .field("len", &self.len)
            .field("lent", &self.lent)
            .field("shared", &self.shared)
            .finish()
    }
}

/// Prefetch hints for the cache lines of the first `len` bytes at `start` (at most 256).
#[inline]
pub(crate) fn prefetch_lines(start: *const u8, len: u32) {
    let lines = (len as usize).clamp(1, 256).div_ceil(64);
    for i in 0..lines {
        prefetch(start.wrapping_add(i * 64));
    }
}

/// A prefetch hint for the cache line holding `p` (nothing on targets without one).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and has no architectural effect, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::Soft;
    use crate::verbs::{Context, Provider};

    fn arena(recv_slots: u32) -> Arc<SlotArena<Soft>> {
        let ctx = Soft::open(None).unwrap();
        let pd = Arc::new(ctx.alloc_pd().unwrap());
        let a = SlotArena::new(
            &pd,
            Geometry {
                slot_size: 256,
                send_slots: 1,
                recv_slots,
            },
        )
        .unwrap();
        // Every slot starts on the repost queue: take them off, as posting would.
        while a.take_repost().is_some() {}
        a
    }

    #[test]
    fn a_shared_slot_is_reposted_when_its_last_guard_drops() {
        let a = arena(4);
        // SAFETY: slot 1 is not posted (taken off the repost queue) and has no other guard.
        let mut first = unsafe { a.recv_slot(1, 100) };
        let mut second = first.share();
        let third = second.share();
        assert_eq!(third.bytes().len(), 100);
        assert_eq!(third.bytes().as_ptr(), first.bytes().as_ptr());
        drop(second);
        drop(first);
        assert!(!a.has_reposts(), "a guard still holds the slot");
        drop(third);
        assert_eq!(a.take_repost(), Some(1));
        assert!(!a.has_reposts(), "reposted once");
        assert_eq!(
            a.shares(1).load(Ordering::Relaxed),
            0,
            "count reset for the next use"
        );
        // The next use of the slot starts unshared and shares again from scratch.
        // SAFETY: as above, slot 1 was taken off the repost queue again.
        let mut again = unsafe { a.recv_slot(1, 10) };
        let other = again.share();
        drop(again);
        drop(other);
        assert_eq!(a.take_repost(), Some(1));
    }

    #[test]
    fn a_shared_slot_counts_once_in_the_lending_budget() {
        let a = arena(4); // budget: 2 slots
        // SAFETY: slots 0 and 1 are not posted and have no other guard.
        let mut s0 = unsafe { a.recv_slot(0, 64) };
        let mut s0b = s0.share();
        let mut s0c = s0b.share();
        assert!(s0.try_lend());
        assert!(s0b.try_lend(), "the slot is already counted");
        assert!(s0c.try_lend());
        assert_eq!(a.lent.load(Ordering::Relaxed), 1, "three borrows, one slot");
        // SAFETY: as above.
        let mut s1 = unsafe { a.recv_slot(1, 64) };
        assert!(s1.try_lend());
        // SAFETY: as above (slot 2).
        let mut s2 = unsafe { a.recv_slot(2, 64) };
        let mut s2b = s2.share();
        assert!(!s2b.try_lend(), "past the budget: copy instead");
        assert!(!s2.try_lend());
        drop((s2, s2b));
        assert_eq!(a.lent.load(Ordering::Relaxed), 2);
        drop(s0);
        drop(s0c);
        assert_eq!(
            a.lent.load(Ordering::Relaxed),
            2,
            "one guard still borrows slot 0"
        );
        drop(s0b);
        assert_eq!(a.lent.load(Ordering::Relaxed), 1);
        drop(s1);
        assert_eq!(a.lent.load(Ordering::Relaxed), 0);
        // A guard lent before it was shared carries its loan to the slot.
        // SAFETY: as above (slot 3).
        let mut s3 = unsafe { a.recv_slot(3, 64) };
        assert!(s3.try_lend());
        let s3b = s3.share();
        drop(s3);
        assert_eq!(
            a.lent.load(Ordering::Relaxed),
            1,
            "the other guard keeps the loan"
        );
        drop(s3b);
        assert_eq!(a.lent.load(Ordering::Relaxed), 0);
        let mut reposted: Vec<u32> = std::iter::from_fn(|| a.take_repost()).collect();
        reposted.sort_unstable();
        assert_eq!(reposted, [0, 1, 2, 3]);
    }

    #[test]
    fn guards_of_one_slot_drop_on_many_threads() {
        let a = arena(2);
        for round in 0..50u32 {
            // SAFETY: slot 0 is off the repost queue and has no guard (the previous round's
            // last guard reposted it and we took it off again).
            let mut g = unsafe { a.recv_slot(0, 64) };
            let guards: Vec<RecvSlot> = (0..8).map(|_| g.share()).collect();
            let threads: Vec<_> = guards
                .into_iter()
                .enumerate()
                .map(|(i, mut s)| {
                    std::thread::spawn(move || {
                        if i % 2 == 0 {
                            let _ = s.try_lend();
                        }
                        drop(s);
                    })
                })
                .collect();
            drop(g);
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(a.take_repost(), Some(0), "round {round}");
            assert!(!a.has_reposts());
            assert_eq!(a.lent.load(Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn a_receive_window_doubles_in_regions_of_its_own() {
        let (_ctx, a) = window_arena(40);
        let (pd, sends, g) = (
            a.pd.clone().unwrap(),
            Arc::clone(a.send_pool()),
            a.geometry(),
        );
        assert_eq!(
            (a.recv_window(), a.lend_max.load(Ordering::Relaxed)),
            (8, 4)
        );
        let first: Vec<u32> = std::iter::from_fn(|| a.take_repost()).collect();
        assert_eq!(first, (0..8).collect::<Vec<_>>(), "all on the repost queue");
        assert_eq!(a.grow_recv(), 8..16);
        assert_eq!(a.grow_recv(), 16..32);
        assert_eq!(a.grow_recv(), 32..40, "never past recv_slots");
        assert_eq!(a.grow_recv(), 40..40);
        assert_eq!(
            (a.recv_window(), a.lend_max.load(Ordering::Relaxed)),
            (40, 20)
        );
        let chunks = a.chunks.lock().unwrap();
        assert_eq!(chunks.len(), 4, "a region per growth");
        assert_eq!(chunks.capacity(), 4, "room for them all from the start");
        drop(chunks);
        assert_eq!(regions_to_reach(8, 128), 5);
        assert_eq!(regions_to_reach(8, 8), 1);
        assert_eq!(regions_to_reach(4, 6), 2);
        // Every receive slot is its own 4 KiB, apart from the others and from the send slots.
        let send = a.take_send().unwrap();
        let mut spans: Vec<(u64, u32)> = (0..40)
            .map(|i| {
                let sge = a.recv_sge(i);
                assert_eq!(sge.length, 4096);
                // SAFETY: slot `i` is not posted (never was) and has no other guard.
                let mut g = unsafe { a.recv_slot(i, 4096) };
                assert_eq!(g.bytes().as_ptr(), a.recv_ptr(i).cast_const());
                assert!(g.try_lend() || i >= 20, "slot {i}: within the budget");
                (sge.addr, sge.lkey)
            })
            .collect();
        assert_eq!(a.lent.load(Ordering::Relaxed), 0, "every guard dropped");
        spans.push((sends.sge(send, 4096).addr, sends.sge(send, 4096).lkey));
        spans.sort_unstable();
        assert!(
            spans
                .windows(2)
                .all(|w| w[1].0 >= w[0].0 + 4096 || w[1].1 != w[0].1)
        );
        a.release_send(send);
        // A window below the reserve, above recv_slots, or not a power of two, is refused.
        assert!(SlotArena::with_sends(&pd, g, Arc::clone(&sends), 3).is_err());
        assert!(SlotArena::with_sends(&pd, g, Arc::clone(&sends), 12).is_err());
        assert!(SlotArena::with_sends(&pd, g, sends, 41).is_err());
    }

    /// An arena of 4 KiB slots whose receive window starts at 8 slots and may grow to
    /// `recv_slots` (with the context it lives in).
    fn window_arena(recv_slots: u32) -> (crate::verbs::soft::SoftContext, Arc<SlotArena<Soft>>) {
        let ctx = Soft::open(None).unwrap();
        let pd = Arc::new(ctx.alloc_pd().unwrap());
        let sends = SendPool::<Soft>::growing(Arc::clone(&pd), 4096, 64).unwrap();
        let g = Geometry {
            slot_size: 4096,
            send_slots: 8,
            recv_slots,
        };
        let a = SlotArena::with_sends(&pd, g, sends, 8).unwrap();
        (ctx, a)
    }

    #[test]
    fn a_window_shrinks_by_whole_regions_and_grows_again() {
        let (_ctx, a) = window_arena(40);
        assert_eq!(a.window_for(3), 8, "never below the first region");
        assert_eq!(a.window_for(30), 8, "never above the window now");
        for _ in 0..3 {
            a.grow_recv();
        }
        assert_eq!(a.recv_window(), 40);
        let fits: Vec<u32> = [0, 8, 9, 16, 17, 32, 33, 40, 99]
            .iter()
            .map(|&n| a.window_for(n))
            .collect();
        assert_eq!(fits, [8, 8, 16, 16, 32, 32, 40, 40, 40]);
        let before: Vec<u64> = (0..16).map(|i| a.recv_sge(i).addr).collect();
        assert_eq!(a.shrink_recv(16), 16);
        assert_eq!(
            (a.recv_window(), a.lend_max.load(Ordering::Relaxed)),
            (16, 8)
        );
        assert_eq!(
            a.chunks.lock().unwrap().len(),
            2,
            "two regions deregistered"
        );
        let kept: Vec<u64> = (0..16).map(|i| a.recv_sge(i).addr).collect();
        assert_eq!(kept, before, "the slots that stay are where they were");
        assert_eq!(a.shrink_recv(20), 16, "not a growth");
        assert_eq!(a.shrink_recv(4), 16, "never below the first region");
        // It grows again region by region, without allocating a place for them.
        assert_eq!(a.grow_recv(), 16..32);
        assert_eq!(a.grow_recv(), 32..40);
        let chunks = a.chunks.lock().unwrap();
        assert_eq!((chunks.len(), chunks.capacity()), (4, 4));
        drop(chunks);
        assert_eq!(a.shrink_recv(8), 8);
        assert_eq!(a.chunks.lock().unwrap().len(), 1);
        assert_eq!(a.grow_recv(), 8..16);
    }

    #[test]
    fn a_window_whose_registration_fails_keeps_what_it_has() {
        let (_ctx, a) = window_arena(64);
        assert_eq!(a.grow_recv(), 8..16);
        a.refuse_growth();
        assert_eq!(a.grow_recv(), 16..16, "a failed registration adds nothing");
        a.refuse_growth.store(false, Ordering::Relaxed);
        assert_eq!(a.grow_recv(), 16..16, "and the window grows no more");
        assert_eq!(
            (a.recv_window(), a.lend_max.load(Ordering::Relaxed)),
            (16, 8)
        );
        assert_eq!(a.chunks.lock().unwrap().len(), 2);
        // The slots it has are whole and usable.
        for i in 0..16 {
            assert_eq!(a.recv_sge(i).length, 4096);
        }
    }
}
