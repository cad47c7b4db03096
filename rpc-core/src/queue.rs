//! Popping the lock-free queues that poll loops look at every turn.
//!
//! `crossbeam-queue`'s `pop` on an empty queue issues a `SeqCst` fence (a locked instruction
//! on x86, tens of cycles) before it reads the tail, and a poll loop's pops are mostly of
//! empty queues: the client's repost and grant queues were 7% of a pipelining client
//! thread's samples, two thirds of it that fence. [`PopIfAny::pop_if_any`] reads head and
//! tail first (`is_empty`: two `SeqCst` loads, plain loads on x86) and pops only when
//! something is there. An item pushed concurrently may be missed as `pop` could miss it: every
//! caller polls again (a loop's next turn), or sleeps only after a re-check made under its
//! wake-up protocol (a flag or a waker set before the check, the producer's push before its
//! wake), which `is_empty`'s `SeqCst` loads keep as `pop`'s fence did.

//!
//! The same for the `VecDeque`s of call records, reset at every call: `clear` is an
//! out-of-line call (`truncate`) even on an empty deque, and most calls hold and lend nothing
//! ([`ClearIfAny::clear_if_any`]).

use std::collections::VecDeque;

use crossbeam_queue::{ArrayQueue, SegQueue};

/// A `clear` that costs a comparison on an empty deque (see the module docs).
pub(crate) trait ClearIfAny {
    /// Empties the deque (keeping its capacity).
    fn clear_if_any(&mut self);
}

impl<T> ClearIfAny for VecDeque<T> {
    #[inline]
    fn clear_if_any(&mut self) {
        if !self.is_empty() {
            self.clear();
        }
    }
}

/// A `pop` without the fence of an empty pop (see the module docs).
pub(crate) trait PopIfAny<T> {
    /// The next item; `None` when the queue looked empty.
    fn pop_if_any(&self) -> Option<T>;
}

impl<T> PopIfAny<T> for ArrayQueue<T> {
    #[inline]
    fn pop_if_any(&self) -> Option<T> {
        if self.is_empty() { None } else { self.pop() }
    }
}

impl<T> PopIfAny<T> for SegQueue<T> {
    #[inline]
    fn pop_if_any(&self) -> Option<T> {
        if self.is_empty() { None } else { self.pop() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clear_if_any_empties_and_keeps_the_capacity() {
        let mut d: VecDeque<u32> = VecDeque::new();
        d.clear_if_any();
        assert!(d.is_empty());
        d.extend([1, 2, 3]);
        let cap = d.capacity();
        d.clear_if_any();
        assert!(d.is_empty());
        assert_eq!(d.capacity(), cap);
    }

    #[test]
    fn pops_in_order_and_none_when_empty() {
        let a = ArrayQueue::new(4);
        let s = SegQueue::new();
        assert_eq!(a.pop_if_any(), None::<u32>);
        assert_eq!(s.pop_if_any(), None::<u32>);
        for i in 0..3 {
            a.push(i).unwrap();
            s.push(i);
        }
        for i in 0..3 {
            assert_eq!(a.pop_if_any(), Some(i));
            assert_eq!(s.pop_if_any(), Some(i));
        }
        assert_eq!(a.pop_if_any(), None);
        assert_eq!(s.pop_if_any(), None);
    }

    /// Nothing pushed by one thread is lost or duplicated by a consumer that only pops with
    /// `pop_if_any`. Either side yields only when it found nothing to do (the test runs
    /// beside busy threads too, where a yield can give the core away for a time slice).
    #[test]
    fn a_consumer_sees_every_item_of_a_concurrent_producer() {
        const N: u32 = 20_000;
        let a = std::sync::Arc::new(ArrayQueue::new(64));
        let s = std::sync::Arc::new(SegQueue::new());
        let (pa, ps) = (a.clone(), s.clone());
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                while pa.push(i).is_err() {
                    std::thread::yield_now();
                }
                ps.push(i);
            }
        });
        let (mut next_a, mut next_s) = (0, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while next_a < N || next_s < N {
            let mut got = false;
            if let Some(v) = a.pop_if_any() {
                assert_eq!(v, next_a);
                next_a += 1;
                got = true;
            }
            if let Some(v) = s.pop_if_any() {
                assert_eq!(v, next_s);
                next_s += 1;
                got = true;
            }
            if !got {
                assert!(
                    std::time::Instant::now() < deadline,
                    "stuck at {next_a}/{next_s}"
                );
                std::thread::yield_now();
            }
        }
        producer.join().unwrap();
        assert_eq!((a.pop_if_any(), s.pop_if_any()), (None, None));
    }
}
