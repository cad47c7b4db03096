//! An indexed binary min-heap of deadlines keyed by call-table slot: O(log n) insert, remove
//! of any slot and pop of the earliest, O(1) peek. Both arrays are allocated once, in
//! [`DeadlineHeap::new`]; nothing grows afterwards.

/// Marks a slot that is not in the heap.
const ABSENT: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct DeadlineHeap {
    /// `(deadline, slot)`, heap-ordered by deadline (ties by slot, so the order is total).
    heap: Box<[(u64, u32)]>,
    len: usize,
    /// `pos[slot]`: index of the slot in `heap`, or [`ABSENT`].
    pos: Box<[u32]>,
}

impl DeadlineHeap {
    /// A heap for slots `0..capacity`. `capacity` is at most 65,536 (a call table's size).
    pub(crate) fn new(capacity: usize) -> DeadlineHeap {
        DeadlineHeap {
            heap: vec![(0, 0); capacity].into_boxed_slice(),
            len: 0,
            pos: vec![ABSENT; capacity].into_boxed_slice(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The earliest `(deadline, slot)`.
    pub(crate) fn peek(&self) -> Option<(u64, u32)> {
        if self.len == 0 {
            None
        } else {
            self.heap.first().copied()
        }
    }

    /// Adds `slot` with `deadline`, or moves it there if it is already in.
    pub(crate) fn insert(&mut self, slot: u32, deadline: u64) {
        let s = slot as usize;
        let Some(&p) = self.pos.get(s) else {
            debug_assert!(false, "slot {slot} beyond heap capacity");
            return;
        };
        if p != ABSENT {
            self.remove(slot);
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
        let Some(&p) = self.pos.get(slot as usize) else {
            return false;
        };
        if p == ABSENT {
            return false;
        }
        let i = p as usize;
        let last = self.len - 1;
        self.len = last;
        if let Some(p) = self.pos.get_mut(slot as usize) {
            *p = ABSENT;
        }
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

    /// Checks the heap order and the position index (tests and fuzzing).
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
        let present = self.pos.iter().filter(|&&p| p != ABSENT).count();
        if present != self.len {
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
        Remove(u32),
        Pop(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..16, 0u64..100).prop_map(|(s, d)| Op::Insert(s, d)),
            (0u32..16).prop_map(Op::Remove),
            (0u64..120).prop_map(Op::Pop),
        ]
    }

    proptest! {
        /// The heap behaves like an ordered map of slot -> deadline.
        #[test]
        fn matches_a_reference_model(ops in proptest::collection::vec(op(), 0..200)) {
            let mut h = DeadlineHeap::new(16);
            let mut model: BTreeMap<u32, u64> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(s, d) => {
                        h.insert(s, d);
                        model.insert(s, d);
                    }
                    Op::Remove(s) => {
                        prop_assert_eq!(h.remove(s), model.remove(&s).is_some());
                    }
                    Op::Pop(now) => {
                        let want = model
                            .iter()
                            .map(|(&s, &d)| (d, s))
                            .min()
                            .filter(|&(d, _)| d <= now);
                        if let Some((_, s)) = want {
                            model.remove(&s);
                        }
                        prop_assert_eq!(h.pop_due(now), want);
                    }
                }
                prop_assert_eq!(h.len(), model.len());
                prop_assert_eq!(h.check(), Ok(()));
            }
        }
    }
}
