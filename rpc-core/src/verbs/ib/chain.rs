//! Chains of work requests for one `ibv_post_*` call: the requests of a batch are built in a
//! stack array, linked through their `next` pointers, and a refusal names the first request
//! the device did not take (`bad_wr`) by its address in that array.

use std::mem::{MaybeUninit, size_of};

use rdma_sys::{ibv_recv_wr, ibv_send_wr};

/// A libibverbs work request that is posted in a chain (`ibv_send_wr`, `ibv_recv_wr`).
pub(super) trait ChainedWr: Sized {
    /// The request's `next` pointer.
    fn next_mut(&mut self) -> &mut *mut Self;
}

impl ChainedWr for ibv_send_wr {
    #[inline]
    fn next_mut(&mut self) -> &mut *mut Self {
        &mut self.next
    }
}

impl ChainedWr for ibv_recv_wr {
    #[inline]
    fn next_mut(&mut self) -> &mut *mut Self {
        &mut self.next
    }
}

/// Links the first `n` requests of `batch` into a NULL-terminated chain and returns its head.
///
/// # Safety
/// `batch[..n]` must be initialised and `n <= N`.
#[inline]
pub(super) unsafe fn link_chain<W: ChainedWr, const N: usize>(
    batch: &mut [MaybeUninit<W>; N],
    n: usize,
) -> *mut W {
    debug_assert!(n <= N);
    let first = batch.as_mut_ptr().cast::<W>();
    for k in 0..n {
        let next = if k + 1 < n {
            // SAFETY: k + 1 < n <= N: inside the array.
            unsafe { first.add(k + 1) }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: k < n: an initialised element of the array (caller's contract).
        unsafe { *(*first.add(k)).next_mut() = next };
    }
    first
}

/// How many requests of the chain of `n` headed by `first` the device took before `bad`
/// (the `bad_wr` it reported; NULL: none), at most `n`.
#[inline]
pub(super) fn taken<W>(first: *const W, bad: *const W, n: usize) -> usize {
    if bad.is_null() {
        0
    } else {
        ((bad as usize).wrapping_sub(first as usize) / size_of::<W>()).min(n)
    }
}

/// The device refused a chain from its request `taken` on (the requests before it were
/// posted); `rc` is what the verb returned.
pub(super) struct Refused<W> {
    pub(super) first: *mut W,
    pub(super) taken: usize,
    pub(super) rc: i32,
}

/// Links the first `n` requests of `batch` (none: nothing to do) and posts them with `post`,
/// the verb called on the chain's head and its `bad_wr` (`ibv_post_send`, `ibv_post_recv`,
/// `ibv_post_srq_recv` on a live queue); adds the number the device took to `posted`.
///
/// # Safety
/// `batch[..n]` must be initialised from work requests that satisfy the verb's contract, and
/// `n <= N`.
#[inline]
pub(super) unsafe fn post_chain<W: ChainedWr, const N: usize>(
    batch: &mut [MaybeUninit<W>; N],
    n: usize,
    posted: &mut u64,
    post: impl FnOnce(*mut W, &mut *mut W) -> i32,
) -> Result<(), Refused<W>> {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: `batch[..n]` is initialised and n <= N (caller's contract).
    let first = unsafe { link_chain(batch, n) };
    let mut bad: *mut W = std::ptr::null_mut();
    let rc = post(first, &mut bad);
    if rc == 0 {
        *posted += n as u64;
        return Ok(());
    }
    let taken = taken(first, bad, n);
    *posted += taken as u64;
    Err(Refused { first, taken, rc })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_the_first_n_and_finds_the_refused_one() {
        let mut batch: [MaybeUninit<ibv_recv_wr>; 4] = [const { MaybeUninit::uninit() }; 4];
        for (i, w) in batch.iter_mut().enumerate().take(3) {
            // SAFETY: all-zero bytes are a valid `ibv_recv_wr` (integers and pointers).
            let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = i as u64;
            w.write(wr);
        }
        // SAFETY: the first 3 are initialised.
        let first = unsafe { link_chain(&mut batch, 3) };
        let mut seen = Vec::new();
        let mut p = first;
        while !p.is_null() {
            // SAFETY: the chain links initialised elements of `batch` only.
            let wr = unsafe { &*p };
            seen.push(wr.wr_id);
            p = wr.next;
        }
        assert_eq!(seen, [0, 1, 2]);
        assert_eq!(taken(first, std::ptr::null(), 3), 0);
        assert_eq!(taken(first, first.wrapping_add(2), 3), 2);
        assert_eq!(taken(first, first.wrapping_add(3), 3), 3);
        assert_eq!(taken(first, first.wrapping_sub(1), 3), 3);
    }
}
