//! The send queue's private storage: the requests, their SGEs and inline bytes, and the send
//! completion ring, in one anonymous mapping per QP.
//!
//! The kernel zero-fills a page of it only when it is first touched, so a QP costs resident
//! memory for the entries it has used, not for its whole depth: a server holding thousands
//! of idle connections does not hold thousands of full queues (issue 14). Entries are
//! written before they are read (see [`QpShared`](super::QpShared)), so nothing here is ever
//! read uninitialised; all-zero bytes are valid for every cell type anyway.

use std::cell::UnsafeCell;
use std::mem::{MaybeUninit, align_of, size_of};
use std::ptr::NonNull;

use super::{Scqe, StoredWr};
use crate::verbs::Sge;

/// One anonymous private mapping holding the four arrays of a send queue of `n` entries.
#[derive(Debug)]
pub(super) struct SendStore {
    base: NonNull<u8>,
    len: usize,
    n: usize,
    max_sge: usize,
    max_inline: usize,
    sges_at: usize,
    inline_at: usize,
    scq_at: usize,
}

// SAFETY: the store is plain memory owned by the QP; the cells it hands out are `UnsafeCell`s
// whose access protocol `QpShared` documents (it is `Sync` on that basis), exactly as the
// boxed slices it replaces.
unsafe impl Send for SendStore {}
// SAFETY: as above.
unsafe impl Sync for SendStore {}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl SendStore {
    /// Storage for `n` entries of at most `max_sge` SGEs and `max_inline` inline bytes each;
    /// the OS error when the mapping cannot be made.
    pub(super) fn new(n: usize, max_sge: usize, max_inline: usize) -> std::io::Result<SendStore> {
        let overflow = || std::io::Error::other("send queue storage overflows the address space");
        let wrs = n.checked_mul(size_of::<StoredWr>()).ok_or_else(overflow)?;
        let sges_at = align_up(wrs, align_of::<Sge>().max(64));
        let sges = n
            .checked_mul(max_sge)
            .and_then(|k| k.checked_mul(size_of::<Sge>()))
            .ok_or_else(overflow)?;
        let inline_at = align_up(sges_at + sges, 64);
        let inline = n.checked_mul(max_inline).ok_or_else(overflow)?;
        let scq_at = align_up(inline_at + inline, align_of::<Scqe>().max(64));
        let scq = n.checked_mul(size_of::<Scqe>()).ok_or_else(overflow)?;
        let len = align_up(scq_at + scq, 4096).max(4096);
        // SAFETY: a new private anonymous range chosen by the kernel aliases nothing; the
        // result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap gave NULL"))?;
        Ok(SendStore {
            base,
            len,
            n,
            max_sge,
            max_inline,
            sges_at,
            inline_at,
            scq_at,
        })
    }

    /// # Safety
    /// `[at, at + k * size_of::<T>())` lies inside the mapping and `at` is aligned for `T`;
    /// all-zero bytes are a valid `T` (the kernel's zero fill).
    unsafe fn cells<T>(&self, at: usize, k: usize) -> &[UnsafeCell<T>] {
        // SAFETY: per the contract; the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(at).cast(), k) }
    }

    /// The stored requests, one per entry.
    #[inline]
    pub(super) fn wrs(&self) -> &[UnsafeCell<MaybeUninit<StoredWr>>] {
        // SAFETY: laid out in `new`: offset 0, `n` entries; any bytes are a `MaybeUninit`.
        unsafe { self.cells(0, self.n) }
    }

    /// The SGEs, `max_sge` per entry.
    #[inline]
    pub(super) fn sges(&self) -> &[UnsafeCell<Sge>] {
        // SAFETY: laid out in `new`; `Sge` is plain integers, valid as zeros.
        unsafe { self.cells(self.sges_at, self.n * self.max_sge) }
    }

    /// The inline bytes, `max_inline` per entry.
    #[inline]
    pub(super) fn inline(&self) -> &[UnsafeCell<u8>] {
        // SAFETY: laid out in `new`.
        unsafe { self.cells(self.inline_at, self.n * self.max_inline) }
    }

    /// The send completion ring, one entry per queue entry.
    #[inline]
    pub(super) fn scq(&self) -> &[UnsafeCell<MaybeUninit<Scqe>>] {
        // SAFETY: laid out in `new`; any bytes are a `MaybeUninit`.
        unsafe { self.cells(self.scq_at, self.n) }
    }
}

impl Drop for SendStore {
    fn drop(&mut self) {
        // SAFETY: exactly the range `new` mapped; no cell reference outlives `self`.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `[p, p + len)` resident in this process (`mincore`).
    fn resident(p: *const u8, len: usize) -> usize {
        let pages = len.div_ceil(4096);
        let mut v = vec![0u8; pages];
        // SAFETY: `p..p+len` is one whole mapping of ours; `v` has a byte per page.
        let r = unsafe { libc::mincore(p as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|b| **b & 1 != 0).count()
    }

    /// A deep queue costs the pages of the entries it used: after one request and one
    /// completion, a 512-entry queue (260 KiB of storage) has at most four pages resident.
    #[test]
    fn a_queue_costs_the_pages_it_touched() {
        let s = SendStore::new(512, 8, 256).unwrap();
        assert!(s.len >= 512 * (8 * size_of::<Sge>() + 256));
        assert_eq!(resident(s.base.as_ptr(), s.len), 0);
        // SAFETY: entry 0 of each array, written by this thread only.
        unsafe {
            *s.wrs()[0].get() = MaybeUninit::zeroed();
            *s.sges()[0].get() = Sge::default();
            *s.inline()[0].get() = 7;
            *s.scq()[0].get() = MaybeUninit::new(Scqe::default());
        }
        let n = resident(s.base.as_ptr(), s.len);
        assert!((1..=4).contains(&n), "{n} pages resident");
        // Every entry is addressable and the arrays do not overlap.
        let end = |p: *const u8, bytes: usize| p as usize + bytes;
        assert!(
            end(s.wrs().as_ptr().cast(), 512 * size_of::<StoredWr>()) <= s.sges().as_ptr() as usize
        );
        assert!(
            end(s.sges().as_ptr().cast(), 512 * 8 * size_of::<Sge>())
                <= s.inline().as_ptr() as usize
        );
        assert!(end(s.inline().as_ptr().cast(), 512 * 256) <= s.scq().as_ptr() as usize);
        assert!(
            end(s.scq().as_ptr().cast(), 512 * size_of::<Scqe>())
                <= s.base.as_ptr() as usize + s.len
        );
    }
}
