//! A lock-free LIFO of slot indices: the free send slots of an arena.
//!
//! The slot taken next is the one released last, whose cache lines (and pages) are still
//! warm. A FIFO cycles through every free slot: a server shard's 2048 send slots (16 MiB) made
//! every response land in memory untouched for 2048 calls, and faulted each page in on the
//! first pass.
//!
//! A Treiber stack over a fixed table: `head` packs a tag and the top index, `next[i]` links
//! free slot `i` to the one below it. Every change of `head` bumps the tag, so a pop that read
//! `head`, then lost the slot to another thread that popped and pushed it back, fails its
//! compare-exchange instead of linking a stale `next` (the ABA problem). Nothing is freed, and
//! no allocation happens after construction.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// `n` zeroed atomics, allocated zeroed: pages of the table that are never used are never
/// touched (a pool's tables are sized for its limit, its use is far below it).
pub(crate) fn zeroed<T: Copy + Default, A>(n: usize) -> Box<[A]> {
    assert!(size_of::<A>() == size_of::<T>() && align_of::<A>() == align_of::<T>());
    let mut v = std::mem::ManuallyDrop::new(vec![T::default(); n]);
    // SAFETY: `A` (an atomic) has the size and alignment of `T` (its integer) and all-zero is
    // a valid value of both; the vector's allocation is handed over whole (pointer, length,
    // capacity), and `v` is not dropped.
    let v = unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<A>(), v.len(), v.capacity()) };
    v.into_boxed_slice()
}

/// No slot: the bottom of the stack.
const NIL: u32 = u32::MAX;

pub(crate) struct SlotStack {
    /// `tag << 32 | top index` (`NIL` when empty).
    head: AtomicU64,
    /// Per slot: the free slot below it, while it is on the stack.
    next: Box<[AtomicU32]>,
    /// Slots on the stack, at least (a push counts before it lands, a pop after it left).
    len: AtomicU32,
}

fn pack(tag: u32, idx: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(idx)
}

fn unpack(h: u64) -> (u32, u32) {
    ((h >> 32) as u32, h as u32)
}

impl SlotStack {
    /// A stack holding slots `0..n`, slot 0 on top (the lowest addresses are used first).
    #[cfg(test)]
    pub(crate) fn full(n: u32) -> SlotStack {
        let next = (0..n)
            .map(|i| AtomicU32::new(if i + 1 < n { i + 1 } else { NIL }))
            .collect();
        SlotStack {
            head: AtomicU64::new(pack(0, if n > 0 { 0 } else { NIL })),
            next,
            len: AtomicU32::new(n),
        }
    }

    /// An empty stack with room for slots `0..cap` ([`SlotStack::push`] them as they come;
    /// a slot's link is written when it is pushed, so the table starts zeroed, untouched).
    pub(crate) fn empty(cap: u32) -> SlotStack {
        SlotStack {
            head: AtomicU64::new(pack(0, NIL)),
            next: zeroed::<u32, AtomicU32>(cap as usize),
            len: AtomicU32::new(0),
        }
    }

    /// Takes the slot on top; `None` when empty.
    pub(crate) fn pop(&self) -> Option<u32> {
        let mut h = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(h);
            if top == NIL {
                return None;
            }
            // Stale if another thread took `top` meanwhile: then `head`'s tag moved and the
            // exchange below fails.
            let below = self.next[top as usize].load(Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                h,
                pack(tag.wrapping_add(1), below),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    return Some(top);
                }
                Err(now) => h = now,
            }
        }
    }

    /// Puts slot `idx` (held by the caller, not on the stack) on top.
    pub(crate) fn push(&self, idx: u32) {
        debug_assert!((idx as usize) < self.next.len());
        self.len.fetch_add(1, Ordering::Relaxed);
        let mut h = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(h);
            self.next[idx as usize].store(top, Ordering::Relaxed);
            // Release: the link above is seen by whoever pops `idx`.
            match self.head.compare_exchange_weak(
                h,
                pack(tag.wrapping_add(1), idx),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => h = now,
            }
        }
    }

    /// How many slots are free (exact when nobody pushes or pops meanwhile).
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_released_is_taken_first() {
        let s = SlotStack::full(4);
        assert_eq!(s.len(), 4);
        assert_eq!(s.pop(), Some(0));
        assert_eq!(s.pop(), Some(1));
        s.push(0);
        assert_eq!(s.pop(), Some(0));
        assert_eq!(s.pop(), Some(2));
        assert_eq!(s.pop(), Some(3));
        assert_eq!(s.len(), 0);
        assert_eq!(s.pop(), None);
        s.push(3);
        s.push(1);
        assert_eq!((s.pop(), s.pop(), s.pop()), (Some(1), Some(3), None));
        assert_eq!(SlotStack::full(0).pop(), None);
        let e = SlotStack::empty(8);
        assert_eq!((e.len(), e.pop()), (0, None));
        e.push(5);
        e.push(6);
        assert_eq!((e.pop(), e.pop(), e.pop()), (Some(6), Some(5), None));
    }

    #[test]
    fn threads_taking_and_releasing_lose_and_duplicate_nothing() {
        const SLOTS: u32 = 64;
        let s = std::sync::Arc::new(SlotStack::full(SLOTS));
        // Each slot's owner count: a slot held twice at once would show here.
        let held: std::sync::Arc<Vec<AtomicU32>> =
            std::sync::Arc::new((0..SLOTS).map(|_| AtomicU32::new(0)).collect());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (s, held) = (s.clone(), held.clone());
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..50_000u32 {
                        if (i + t) % 3 != 2 {
                            if let Some(x) = s.pop() {
                                assert_eq!(held[x as usize].fetch_add(1, Ordering::SeqCst), 0);
                                mine.push(x);
                            }
                        } else if let Some(x) = mine.pop() {
                            assert_eq!(held[x as usize].fetch_sub(1, Ordering::SeqCst), 1);
                            s.push(x);
                        }
                    }
                    for x in mine {
                        held[x as usize].fetch_sub(1, Ordering::SeqCst);
                        s.push(x);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(s.len(), SLOTS as usize);
        let mut all: Vec<u32> = std::iter::from_fn(|| s.pop()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..SLOTS).collect::<Vec<_>>());
    }
}
