//! A connection's call cells, made [`CHUNK`] at a time as the calls in flight first need them:
//! a channel that makes a call at a time holds one chunk (about 2 KiB), not its whole call
//! limit's worth (64 cells of about 264 bytes by default), and a busy one has all it needs
//! after its first burst. Cells go back to a FIFO free queue and are reused from it; a chunk
//! is made only when every cell made so far is in use. Making one takes a lock (the only lock,
//! a few times in a connection's life); taking and giving back a cell take none.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crossbeam_queue::ArrayQueue;

/// Cells made at once.
pub(crate) const CHUNK: usize = 8;

pub(crate) struct CellTable<T> {
    /// Whole chunks (the last one may have cells past `len`, never handed out).
    chunks: Box<[OnceLock<Box<[T; CHUNK]>>]>,
    /// Cells made and not in use. Holds every index at most once.
    free: ArrayQueue<u32>,
    /// Cells that may be handed out so far (`CHUNK` per chunk made, at most `len`).
    made: AtomicUsize,
    growing: Mutex<()>,
    len: usize,
    make: fn() -> T,
}

impl<T> CellTable<T> {
    /// A table of up to `len` cells (at least 1), each made by `make` when first needed.
    pub(crate) fn new(len: usize, make: fn() -> T) -> CellTable<T> {
        let len = len.max(1);
        CellTable {
            chunks: (0..len.div_ceil(CHUNK)).map(|_| OnceLock::new()).collect(),
            free: ArrayQueue::new(len),
            made: AtomicUsize::new(0),
            growing: Mutex::new(()),
            len,
            make,
        }
    }

    /// The cell `idx`, which [`CellTable::take`] handed out (so it is made).
    ///
    /// # Panics
    /// For an index never handed out: a bug of the caller, not something a peer can cause
    /// (peers name wire slots, which the driver maps to cells it took).
    #[inline(always)]
    pub(crate) fn get(&self, idx: u32) -> &T {
        let i = idx as usize;
        let chunk = self.chunks[i / CHUNK].get();
        &chunk.expect("a cell index is handed out only once its chunk is made")[i % CHUNK]
    }

    /// A cell not in use, made if every cell made so far is in use; `None` when all `len`
    /// are in use.
    #[inline]
    pub(crate) fn take(&self) -> Option<u32> {
        self.free.pop().or_else(|| self.grow())
    }

    /// Gives back a cell [`CellTable::take`] handed out.
    #[inline]
    pub(crate) fn put(&self, idx: u32) {
        let pushed = self.free.push(idx);
        debug_assert!(pushed.is_ok(), "cell {idx} given back twice");
    }

    /// Makes the next chunk and hands out its first cell (the others go to the free queue).
    #[cold]
    fn grow(&self) -> Option<u32> {
        let _one_at_a_time = self.growing.lock().unwrap_or_else(|e| e.into_inner());
        // Another taker may have made a chunk meanwhile, or a cell come back.
        if let Some(i) = self.free.pop() {
            return Some(i);
        }
        let made = self.made.load(Ordering::Relaxed);
        if made >= self.len {
            return None;
        }
        let n = CHUNK.min(self.len - made);
        let chunk = Box::new(std::array::from_fn(|_| (self.make)()));
        if self.chunks[made / CHUNK].set(chunk).is_err() {
            debug_assert!(false, "chunk {} made twice", made / CHUNK);
            return None;
        }
        // Counted before its cells are free: `in_use` may read a few too many meanwhile,
        // never too few.
        self.made.store(made + n, Ordering::Release);
        for i in made + 1..made + n {
            let _ = self.free.push(i as u32);
        }
        Some(made as u32)
    }

    /// Cells in use (a snapshot: takers may run meanwhile).
    pub(crate) fn in_use(&self) -> usize {
        self.made
            .load(Ordering::Acquire)
            .saturating_sub(self.free.len())
    }

    /// Whether a cell may be taken now without waiting (a snapshot).
    pub(crate) fn any_free(&self) -> bool {
        !self.free.is_empty() || self.made.load(Ordering::Acquire) < self.len
    }

    /// Cells the table may hold (the connection's call limit).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Cells made so far.
    #[cfg(test)]
    pub(crate) fn made(&self) -> usize {
        self.made.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;

    /// One call at a time uses one chunk however many calls it makes; chunks are made only
    /// when every cell made is in use, up to the limit; cells come back and are reused.
    #[test]
    fn chunks_follow_the_cells_in_use() {
        let t = CellTable::<AtomicU32>::new(20, || AtomicU32::new(7));
        assert_eq!((t.made(), t.in_use(), t.len()), (0, 0, 20));
        for _ in 0..100 {
            let i = t.take().unwrap();
            assert_eq!(t.get(i).load(Ordering::Relaxed), 7);
            t.put(i);
        }
        assert_eq!((t.made(), t.in_use()), (CHUNK, 0));
        let held: Vec<u32> = (0..20).map(|_| t.take().unwrap()).collect();
        assert_eq!(t.made(), 20, "two full chunks and a short one");
        assert_eq!(t.in_use(), 20);
        assert!(t.take().is_none() && !t.any_free(), "the limit");
        let mut sorted = held.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<u32>>(), "each cell once");
        t.put(held[5]);
        assert!(t.any_free());
        assert_eq!(t.take(), Some(held[5]));
    }

    /// Takers on several threads get distinct cells, and the table never makes more than
    /// the cells in use at once need.
    #[test]
    fn concurrent_takers_get_distinct_cells() {
        let t = Arc::new(CellTable::<AtomicU32>::new(64, || AtomicU32::new(0)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let a = t.take().unwrap();
                        let b = t.take().unwrap();
                        // Nobody else holds them: the counts stay ours.
                        assert_eq!(t.get(a).fetch_add(1, Ordering::SeqCst), 0);
                        assert_eq!(t.get(b).fetch_add(1, Ordering::SeqCst), 0);
                        t.get(a).fetch_sub(1, Ordering::SeqCst);
                        t.get(b).fetch_sub(1, Ordering::SeqCst);
                        t.put(a);
                        t.put(b);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        assert_eq!(t.in_use(), 0);
        assert!(t.made() <= 8 + CHUNK, "8 in use at most: {} made", t.made());
    }
}
