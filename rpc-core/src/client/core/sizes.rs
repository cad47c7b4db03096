//! Response sizes learned per method, so that large responses land in place by default.
//!
//! A large response without a landing zone costs the client an extra round trip: the server
//! advertises its buffer and the client READs it. With a zone lent in the request, the server
//! WRITEs the response straight into it. A caller may say how large the response will be
//! ([`crate::Request::set_response_size_hint`]); without that, the connection remembers how
//! large the last large response of each method was and lends a zone of that size (plus a
//! sixteenth) with the method's next call:
//!
//! - a response that came by READ, or into a zone, records its size;
//! - a response that came eagerly although a zone was lent (the method's responses got small)
//!   forgets the method, so small calls stop borrowing zones;
//! - a response larger than the zone is not lost: the server falls back to the READ (the plan
//!   only WRITEs a frame that fits), and the new size is recorded.
//!
//! The table is a fixed array of atomics (no allocation, no lock): written by the driver
//! only, read by callers as they build requests. Each entry packs `method id << 32 | bytes`;
//! a method that finds no free entry among its [`PROBES`] is not learned. Sizes above
//! [`MAX_LEARNED`] are not learned either: a zone that large is a caller's explicit choice.

use std::sync::atomic::{AtomicU64, Ordering};

/// Entries (methods one connection learns at most).
const ENTRIES: usize = 32;
/// Entries a method may take, starting at its hash.
const PROBES: usize = 4;
/// Largest learned response.
pub(crate) const MAX_LEARNED: u64 = 64 << 20;

/// The table.
pub(crate) struct LearnedSizes {
    entries: [AtomicU64; ENTRIES],
    /// Off ([`crate::ChannelBuilder::learn_response_sizes`]): nothing is learned.
    on: bool,
}

impl LearnedSizes {
    pub(crate) fn new(on: bool) -> LearnedSizes {
        LearnedSizes {
            entries: std::array::from_fn(|_| AtomicU64::new(0)),
            on,
        }
    }

    fn probe(method: u32) -> impl Iterator<Item = usize> {
        (0..PROBES).map(move |i| (method as usize).wrapping_add(i) % ENTRIES)
    }

    /// The landing zone to lend with a call of `method` (response bytes), if one is learned.
    pub(crate) fn hint(&self, method: u32) -> Option<usize> {
        if method == 0 {
            return None;
        }
        for i in Self::probe(method) {
            let e = self.entries[i].load(Ordering::Relaxed);
            if e >> 32 == u64::from(method) {
                let n = e & u64::from(u32::MAX);
                return (n > 0).then(|| (n + n / 16) as usize);
            }
            if e == 0 {
                return None;
            }
        }
        None
    }

    /// A large response of `len` bytes arrived for `method`.
    pub(crate) fn record(&self, method: u32, len: u64) {
        if !self.on || method == 0 || len == 0 {
            return;
        }
        let len = if len > MAX_LEARNED { 0 } else { len };
        self.store(method, len);
    }

    /// A small response arrived for `method` although a zone was lent.
    pub(crate) fn forget(&self, method: u32) {
        if method != 0 {
            self.store(method, 0);
        }
    }

    fn store(&self, method: u32, len: u64) {
        let tagged = u64::from(method) << 32 | len;
        for i in Self::probe(method) {
            let e = self.entries[i].load(Ordering::Relaxed);
            if e >> 32 == u64::from(method) || e == 0 {
                if e == 0 && len == 0 {
                    // Nothing to forget.
                    return;
                }
                self.entries[i].store(tagged, Ordering::Relaxed);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_updates_and_forgets() {
        let t = LearnedSizes::new(true);
        assert_eq!(t.hint(7), None);
        t.record(7, 1 << 20);
        assert_eq!(t.hint(7), Some((1 << 20) + (1 << 16)));
        t.record(7, 2 << 20);
        assert_eq!(t.hint(7), Some((2 << 20) + (2 << 16)));
        t.forget(7);
        assert_eq!(t.hint(7), None);
        // Forgotten entries keep their place: learning again reuses it.
        t.record(7, 4096 * 4);
        assert_eq!(t.hint(7), Some(4096 * 4 + 1024));
    }

    #[test]
    fn methods_that_collide_probe_further_and_a_full_run_learns_nothing() {
        let t = LearnedSizes::new(true);
        // Ids 1, 33, 65, 97 and 129 start at the same entry.
        for k in 0..PROBES as u32 {
            t.record(1 + 32 * k, 100_000 + u64::from(k));
        }
        for k in 0..PROBES as u32 {
            let n = 100_000 + u64::from(k);
            assert_eq!(t.hint(1 + 32 * k), Some((n + n / 16) as usize));
        }
        t.record(1 + 32 * PROBES as u32, 5_000_000);
        assert_eq!(t.hint(1 + 32 * PROBES as u32), None);
        // The others are untouched.
        assert_eq!(t.hint(1), Some(100_000 + 100_000 / 16));
    }

    #[test]
    fn huge_responses_and_id_zero_are_not_learned() {
        let t = LearnedSizes::new(true);
        t.record(3, MAX_LEARNED + 1);
        assert_eq!(t.hint(3), None);
        t.record(3, MAX_LEARNED);
        assert!(t.hint(3).is_some());
        t.record(3, MAX_LEARNED + 1);
        assert_eq!(
            t.hint(3),
            None,
            "a response above the cap forgets the method"
        );
        t.record(0, 1 << 20);
        assert_eq!(t.hint(0), None);
    }

    #[test]
    fn off_learns_nothing() {
        let t = LearnedSizes::new(false);
        t.record(5, 1 << 20);
        assert_eq!(t.hint(5), None);
    }
}
