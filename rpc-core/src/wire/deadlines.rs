//! The deadlines of a connection's calls, keyed by call-table slot: O(1) peek, and O(1)
//! insert and remove for deadlines that come in order (each no earlier than the last one
//! inserted: one timeout for every call, a clock that moves forward), whichever slot is
//! removed; O(log n) for the others.
//!
//! Deadlines in order go to the *run*, a ring sorted by deadline: insert appends; remove marks
//! the entry dead, and dead entries leave when they reach either end of the run, or when the
//! ring fills (it has room for twice the slots, so a compaction then drops at least half of
//! it: amortized O(1)). A deadline earlier than the run's last one goes to an indexed binary
//! min-heap instead. The earliest deadline is the run's first or the heap's top. Equal
//! deadlines leave in any order. The arrays cover the slots up to the highest one given a
//! deadline so far (they grow, at least doubling, the first time a higher slot comes, up to
//! the capacity; never per call): a connection with few calls in flight holds a few entries,
//! not its whole call table's.
//!
//! A pipelining client removed the earliest of 32 entries of a binary heap at every call's
//! response (a sift-down through five levels); that was the largest part of the 250
//! instructions per call this structure cost (callgrind).

/// Marks a slot that holds no deadline.
const ABSENT: u32 = u32::MAX;
/// Set in a `pos` entry that indexes the run (else it indexes the heap).
const IN_RUN: u32 = 1 << 31;
/// The slot of a run entry that was removed.
const DEAD: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct Deadlines {
    /// `(deadline, slot)`, heap-ordered (ties by slot): the deadlines that came out of order.
    heap: Vec<(u64, u32)>,
    len: usize,
    /// `(deadline, slot)` in deadline order from `head`, `run_n` entries (the dead ones
    /// included, never first or last); a power of two long.
    run: Vec<(u64, u32)>,
    head: usize,
    run_n: usize,
    /// Live entries of the run.
    run_live: usize,
    /// `pos[slot]`: the slot's index in `heap`, or in `run` with [`IN_RUN`]; [`ABSENT`].
    pos: Vec<u32>,
    /// Slots `pos` (and `heap`) may grow to.
    capacity: usize,
}

impl Deadlines {
    /// Deadlines for slots `0..capacity`. `capacity` is at most 65,536 (a call table's size).
    /// Nothing is allocated until the first insert.
    pub(crate) fn new(capacity: usize) -> Deadlines {
        Deadlines {
            heap: Vec::new(),
            len: 0,
            run: Vec::new(),
            head: 0,
            run_n: 0,
            run_live: 0,
            pos: Vec::new(),
            capacity,
        }
    }

    /// Makes room for `slot` (within the capacity): at least doubles the slots covered, and
    /// the run's ring with them (its entries moved to its start, in order).
    #[cold]
    fn grow(&mut self, slot: usize) {
        let n = crate::slot_table::grown_len(self.pos.len(), slot, self.capacity);
        if n <= self.pos.len() {
            return;
        }
        self.pos.resize(n, ABSENT);
        self.heap.resize(n, (0, 0));
        let ring = (2 * n).next_power_of_two().max(2);
        if ring > self.run.len() {
            let mut run = vec![(0, DEAD); ring];
            for (k, e) in run.iter_mut().enumerate().take(self.run_n) {
                *e = self.run[self.index(k)];
                if e.1 != DEAD {
                    self.pos[e.1 as usize] = IN_RUN | k as u32;
                }
            }
            self.run = run;
            self.head = 0;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len + self.run_live
    }

    /// The earliest `(deadline, slot)`.
    pub(crate) fn peek(&self) -> Option<(u64, u32)> {
        let run = (self.run_n > 0).then(|| self.run[self.head]);
        let heap = (self.len > 0).then(|| self.heap[0]);
        match (run, heap) {
            (Some(r), Some(h)) => Some(r.min(h)),
            (r, h) => r.or(h),
        }
    }

    /// Adds `slot` with `deadline`, or moves it there if it is already in.
    pub(crate) fn insert(&mut self, slot: u32, deadline: u64) {
        let s = slot as usize;
        if s >= self.pos.len() {
            self.grow(s);
        }
        let Some(&p) = self.pos.get(s) else {
            debug_assert!(false, "slot {slot} beyond heap capacity");
            return;
        };
        if p != ABSENT {
            self.remove(slot);
        }
        if self.run_n == 0 || deadline >= self.run[self.last()].0 {
            if self.run_n == self.run.len() {
                self.compact();
            }
            let i = self.index(self.run_n);
            self.run[i] = (deadline, slot);
            self.pos[s] = IN_RUN | i as u32;
            self.run_n += 1;
            self.run_live += 1;
            return;
        }
        let i = self.len;
        if i >= self.heap.len() {
            debug_assert!(false, "heap full");
            return;
        }
        self.len += 1;
        self.set(i, (deadline, slot));
        self.sift_up(i);
    }

    /// Removes `slot` if it is in; returns whether it was.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let Some(p) = self.pos.get_mut(slot as usize) else {
            return false;
        };
        let p = std::mem::replace(p, ABSENT);
        if p == ABSENT {
            return false;
        }
        if p & IN_RUN != 0 {
            self.run[(p & !IN_RUN) as usize].1 = DEAD;
            self.run_live -= 1;
            // The run's ends stay live: its first entry is the earliest, and its last one
            // bounds what may be appended.
            while self.run_n > 0 && self.run[self.head].1 == DEAD {
                self.head = self.index(1);
                self.run_n -= 1;
            }
            while self.run_n > 0 && self.run[self.last()].1 == DEAD {
                self.run_n -= 1;
            }
            return true;
        }
        let i = p as usize;
        let last = self.len - 1;
        self.len = last;
        if i != last {
            let moved = self.heap[last];
            self.set(i, moved);
            // The moved entry may belong above or below `i`.
            let i = self.sift_up(i);
            self.sift_down(i);
        }
        true
    }

    /// Removes and returns the earliest `(deadline, slot)` if its deadline is `<= now`.
    pub(crate) fn pop_due(&mut self, now: u64) -> Option<(u64, u32)> {
        let top = self.peek()?;
        if top.0 > now {
            return None;
        }
        self.remove(top.1);
        Some(top)
    }

    /// The ring index `k` entries after the run's first.
    fn index(&self, k: usize) -> usize {
        (self.head + k) & (self.run.len() - 1)
    }

    /// The ring index of the run's last entry (the run is not empty).
    fn last(&self) -> usize {
        self.index(self.run_n - 1)
    }

    /// Drops the dead entries of a full run, keeping the order (in place: an entry only ever
    /// moves towards the head).
    #[cold]
    fn compact(&mut self) {
        let mut kept = 0;
        for k in 0..self.run_n {
            let e = self.run[self.index(k)];
            if e.1 == DEAD {
                continue;
            }
            let to = self.index(kept);
            self.run[to] = e;
            self.pos[e.1 as usize] = IN_RUN | to as u32;
            kept += 1;
        }
        self.run_n = kept;
    }

    fn set(&mut self, i: usize, e: (u64, u32)) {
        self.heap[i] = e;
        self.pos[e.1 as usize] = i as u32;
    }

    fn key(&self, i: usize) -> (u64, u32) {
        self.heap[i]
    }

    fn sift_up(&mut self, mut i: usize) -> usize {
        let e = self.heap[i];
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.key(parent) <= e {
                break;
            }
            let p = self.heap[parent];
            self.set(i, p);
            i = parent;
        }
        self.set(i, e);
        i
    }

    fn sift_down(&mut self, mut i: usize) {
        let e = self.heap[i];
        loop {
            let l = 2 * i + 1;
            if l >= self.len {
                break;
            }
            let r = l + 1;
            let c = if r < self.len && self.key(r) < self.key(l) {
                r
            } else {
                l
            };
            if e <= self.key(c) {
                break;
            }
            let ce = self.heap[c];
            self.set(i, ce);
            i = c;
        }
        self.set(i, e);
    }

    /// Checks the heap order, the run's order and the position index (tests and fuzzing).
    pub(crate) fn check(&self) -> Result<(), &'static str> {
        for i in 0..self.len {
            let (_, slot) = self.heap[i];
            if self.pos.get(slot as usize) != Some(&(i as u32)) {
                return Err("heap position index out of sync");
            }
            if i > 0 && self.heap[(i - 1) / 2] > self.heap[i] {
                return Err("heap order broken");
            }
        }
        let (mut live, mut prev) = (0, 0);
        for k in 0..self.run_n {
            let i = self.index(k);
            let (d, slot) = self.run[i];
            if slot == DEAD {
                if k == 0 || k + 1 == self.run_n {
                    return Err("run ends with a dead entry");
                }
                continue;
            }
            if self.pos.get(slot as usize) != Some(&(IN_RUN | i as u32)) {
                return Err("run position index out of sync");
            }
            if d < prev {
                return Err("run order broken");
            }
            prev = d;
            live += 1;
        }
        if live != self.run_live {
            return Err("run count out of sync");
        }
        let present = self.pos.iter().filter(|&&p| p != ABSENT).count();
        if present != self.len + self.run_live {
            return Err("heap index holds stale slots");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u32, u64),
        /// Insert at the latest deadline so far plus this much (the usual order).
        Later(u32, u64),
        Remove(u32),
        Pop(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..16, 0u64..100).prop_map(|(s, d)| Op::Insert(s, d)),
            (0u32..16, 0u64..3).prop_map(|(s, d)| Op::Later(s, d)),
            (0u32..16, 0u64..3).prop_map(|(s, d)| Op::Later(s, d)),
            (0u32..16).prop_map(Op::Remove),
            (0u64..120).prop_map(Op::Pop),
        ]
    }

    proptest! {
        /// The structure behaves like a map of slot -> deadline whose earliest deadline
        /// leaves first (equal deadlines in any order).
        #[test]
        fn matches_a_reference_model(ops in proptest::collection::vec(op(), 0..300)) {
            let mut h = Deadlines::new(16);
            let mut model: BTreeMap<u32, u64> = BTreeMap::new();
            let mut latest = 0;
            for op in ops {
                match op {
                    Op::Insert(s, d) => {
                        h.insert(s, d);
                        model.insert(s, d);
                        latest = latest.max(d);
                    }
                    Op::Later(s, step) => {
                        latest += step;
                        h.insert(s, latest);
                        model.insert(s, latest);
                    }
                    Op::Remove(s) => {
                        prop_assert_eq!(h.remove(s), model.remove(&s).is_some());
                    }
                    Op::Pop(now) => {
                        let earliest = model.values().copied().min().filter(|&d| d <= now);
                        let got = h.pop_due(now);
                        match (earliest, got) {
                            (None, None) => {}
                            (Some(d), Some((gd, gs))) => {
                                prop_assert_eq!(gd, d);
                                prop_assert_eq!(model.remove(&gs), Some(d));
                            }
                            (want, got) => prop_assert!(false, "want {want:?}, got {got:?}"),
                        }
                    }
                }
                prop_assert_eq!(h.len(), model.len());
                prop_assert_eq!(h.check(), Ok(()));
                let earliest = model.values().copied().min();
                prop_assert_eq!(h.peek().map(|(d, _)| d), earliest);
            }
        }
    }

    /// Deadlines in order never touch the heap, and a run that fills with dead entries (an
    /// early call that stays while thousands after it come and go) is compacted in place.
    #[test]
    fn in_order_deadlines_stay_in_the_run_and_dead_ones_are_dropped() {
        let mut h = Deadlines::new(8);
        h.insert(0, 1);
        for i in 0..10_000u64 {
            let slot = 1 + (i % 7) as u32;
            h.insert(slot, 2 + i);
            if i >= 6 {
                // The oldest of the others finishes; slot 0 stays first.
                h.remove(1 + ((i - 6) % 7) as u32);
            }
            assert_eq!(h.check(), Ok(()));
            assert_eq!(h.len, 0, "nothing in the heap");
            assert!(h.run_n <= h.run.len());
        }
        assert_eq!(h.peek(), Some((1, 0)));
        assert_eq!(h.pop_due(1), Some((1, 0)));
        assert_eq!(h.len(), 6);
        // An earlier deadline goes to the heap and still leaves first.
        h.insert(0, 5);
        assert_eq!(h.len, 1);
        assert_eq!(h.pop_due(u64::MAX), Some((5, 0)));
        assert_eq!(h.check(), Ok(()));
    }

    /// Nothing is allocated before the first deadline; the arrays then cover the highest
    /// slot used (doubling, up to the capacity), and growing keeps the run's order even when
    /// its ring had wrapped.
    #[test]
    fn arrays_grow_with_the_highest_slot_and_keep_the_order() {
        let mut h = Deadlines::new(64);
        assert_eq!((h.pos.len(), h.run.len(), h.heap.len()), (0, 0, 0));
        h.insert(0, 10);
        assert_eq!((h.pos.len(), h.run.len()), (1, 2));
        h.insert(1, 11);
        assert_eq!((h.pos.len(), h.run.len()), (2, 4));
        // The earliest call ends and its slot is used again, later: the run moves round the
        // four-entry ring until it wraps.
        for (slot, d) in [(0, 12), (1, 13), (0, 14)] {
            h.remove(slot);
            h.insert(slot, d);
        }
        assert_eq!((h.head, h.run_n), (3, 2), "the run wraps the ring's end");
        h.insert(2, 30);
        h.insert(3, 5); // out of order: the heap
        assert_eq!((h.pos.len(), h.run.len(), h.head), (4, 8, 0));
        assert_eq!(h.check(), Ok(()));
        h.insert(40, 50);
        assert_eq!(h.pos.len(), 41);
        h.insert(63, 60);
        assert_eq!(h.pos.len(), 64);
        assert_eq!(h.check(), Ok(()));
        let mut order = Vec::new();
        while let Some((d, s)) = h.pop_due(u64::MAX) {
            order.push((d, s));
        }
        assert_eq!(
            order,
            [(5, 3), (13, 1), (14, 0), (30, 2), (50, 40), (60, 63)]
        );
    }
}
