//! The bulk pool: registered buffers for payloads above the eager threshold.
//!
//! Buffers come in power-of-two size classes and are registered for local access only: the
//! region's own key gives a peer nothing. A buffer is lent to a peer by [`BulkBuf::lend`], which
//! binds a window ([`Pd::bind_window`]) over exactly the bytes in use, with exactly the right
//! the use needs (remote READ for a rendezvous payload the peer pulls, remote WRITE for a
//! landing zone the peer fills), for the peer of one connection only, under a fresh key. The
//! loan ends with [`BulkBuf::revoke`], or when the buffer is dropped: the key is revoked before
//! the buffer goes back to the pool, so no peer reaches a byte of it once its call is over, and
//! a reused buffer never answers to an old key.
//!
//! A returned buffer goes back to its class's free queue (lock-free) up to a cap on cached
//! bytes, so a steady stream of large calls registers nothing after warm-up. A miss allocates and
//! registers (a slow path, as it is on any RDMA stack).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_queue::ArrayQueue;

use crate::verbs::{Access, Mr, Pd, Provider, RemoteMr, Result, Sge};

const MIN_CLASS: u32 = 12; // 4 KiB
const MAX_CLASS: u32 = 30; // 1 GiB
const CLASSES: usize = (MAX_CLASS - MIN_CLASS + 1) as usize;
/// Idle buffers kept per size class (the byte cap `max_cached` bounds the total).
const PER_CLASS: usize = 64;

/// Pool of registered bulk buffers of one protection domain.
pub struct BulkPool<P: Provider> {
    pd: Arc<P::Pd>,
    /// Free queues by size class, each made when a buffer of its class first comes back (a
    /// pool that never caches a class costs nothing for it: a channel's pool is created on
    /// every connect).
    classes: [OnceLock<ArrayQueue<P::Mr>>; CLASSES],
    cached_bytes: AtomicUsize,
    max_cached: usize,
}

impl<P: Provider> BulkPool<P> {
    /// A pool caching at most `max_cached` bytes of idle buffers.
    pub fn new(pd: Arc<P::Pd>, max_cached: usize) -> Arc<BulkPool<P>> {
        let classes = std::array::from_fn(|_| OnceLock::new());
        Arc::new(BulkPool {
            pd,
            classes,
            cached_bytes: AtomicUsize::new(0),
            max_cached,
        })
    }

    fn class_of(len: usize) -> Option<u32> {
        let bits = usize::BITS - len.max(1).next_power_of_two().leading_zeros() - 1;
        let class = bits.max(MIN_CLASS);
        (class <= MAX_CLASS).then_some(class)
    }

    /// A buffer of at least `len` bytes (its `len()` is `len`).
    ///
    /// # Errors
    /// When `len` is over 1 GiB (the largest size class) or registration fails.
    pub fn get(self: &Arc<Self>, len: usize) -> Result<BulkBuf<P>> {
        let Some(class) = Self::class_of(len) else {
            return Err(crate::verbs::VerbsError::new(
                crate::verbs::Verb::AllocMr,
                crate::verbs::ErrorKind::ExceedsCaps,
                "bulk payload larger than 1 GiB",
            ));
        };
        let q = self.classes[(class - MIN_CLASS) as usize].get();
        let mr = match q.and_then(ArrayQueue::pop) {
            Some(mr) => {
                self.cached_bytes.fetch_sub(1 << class, Ordering::Relaxed);
                mr
            }
            None => self.pd.alloc_mr(1 << class, Access::LOCAL_WRITE)?,
        };
        Ok(BulkBuf {
            pool: Arc::clone(self),
            mr: Some(mr),
            window: None,
            len,
        })
    }

    fn put(&self, mr: P::Mr) {
        let size = mr.len();
        let Some(class) = Self::class_of(size) else {
            return;
        };
        if self.cached_bytes.load(Ordering::Relaxed) + size > self.max_cached {
            return; // dropped: deregistered and freed
        }
        let q =
            self.classes[(class - MIN_CLASS) as usize].get_or_init(|| ArrayQueue::new(PER_CLASS));
        if q.push(mr).is_ok() {
            self.cached_bytes.fetch_add(size, Ordering::Relaxed);
        }
    }
}

impl<P: Provider> fmt::Debug for BulkPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkPool")
            .field("cached_bytes", &self.cached_bytes.load(Ordering::Relaxed))
            .finish()
    }
}

/// A registered bulk buffer borrowed from a [`BulkPool`]; returns to it when dropped.
///
/// Whoever holds it owns the bytes, except while they are advertised to a peer or named by a
/// posted work request: the protocol keeps the guard alive (and Rust code off the bytes) until
/// the peer said it is done or the completion was polled.
pub struct BulkBuf<P: Provider> {
    pool: Arc<BulkPool<P>>,
    mr: Option<P::Mr>,
    /// The window a peer reaches the bytes through while they are lent ([`BulkBuf::lend`]);
    /// boxed, so that the buffer stays small in what small calls move around.
    window: Option<Box<P::Mr>>,
    len: usize,
}

impl<P: Provider> BulkBuf<P> {
    fn mr(&self) -> &P::Mr {
        match &self.mr {
            Some(mr) => mr,
            None => unreachable!("BulkBuf used after drop"),
        }
    }

    /// Length in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Sets the length in use (at most the buffer's capacity).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.mr().len());
    }

    /// Capacity (the size class).
    pub fn capacity(&self) -> usize {
        self.mr().len()
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the MR's memory is valid for `capacity >= len` bytes while `self.mr` lives;
        // the guard's holder owns the bytes (see the type docs): no posted work request or
        // peer writes them while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.mr().as_ptr(), self.len) }
    }

    /// The bytes in use, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.mr().as_ptr(), self.len) }
    }

    /// Lends the bytes in use to the peer connected to `qp` with `access` (one remote right)
    /// until [`BulkBuf::revoke`] or the drop of the buffer: what that peer needs to READ or
    /// WRITE them. A buffer is lent once at a time (lending again revokes the earlier key).
    ///
    /// While lent, the peer may read (REMOTE_READ) or write (REMOTE_WRITE) the bytes at any
    /// time: the holder must not write them (READ) or read them (WRITE) until the peer said it
    /// is done.
    ///
    /// # Errors
    /// When the window cannot be bound (empty buffer, key table full).
    pub fn lend(&mut self, access: Access, qp: &P::Qp) -> Result<RemoteMr> {
        self.revoke();
        let w = self
            .pool
            .pd
            .bind_window(self.mr(), 0, self.len.max(1), access, qp)?;
        let r = RemoteMr {
            addr: w.addr(),
            len: self.len as u64,
            rkey: w.rkey(),
        };
        self.window = Some(Box::new(w));
        Ok(r)
    }

    /// A window on `[offset, offset + len)` of the buffer for the peer connected to `qp` with
    /// `access`, owned by the caller (the buffer itself is not marked lent: for memory several
    /// requests share read-only, each with a loan of its own). Dropping it revokes the key.
    ///
    /// # Errors
    /// When the window cannot be bound (range outside the buffer, key table full).
    pub fn window(&self, offset: usize, len: usize, access: Access, qp: &P::Qp) -> Result<P::Mr> {
        self.pool.pd.bind_window(self.mr(), offset, len, access, qp)
    }

    /// Ends the loan: the peer's key is revoked (its later accesses fail with
    /// `REM_ACCESS_ERR`) before this returns. Nothing when the buffer is not lent.
    pub fn revoke(&mut self) {
        self.window = None;
    }

    /// Whether a peer holds a key to the bytes now.
    pub fn is_lent(&self) -> bool {
        self.window.is_some()
    }

    /// What the peer holding the current loan was given, if the bytes are lent.
    pub fn lent(&self) -> Option<RemoteMr> {
        self.window.as_ref().map(|w| RemoteMr {
            addr: w.addr(),
            len: self.len as u64,
            rkey: w.rkey(),
        })
    }

    /// The identity of the pool the buffer returns to (its protection domain's): memory is
    /// only advertised on connections of that pool.
    pub(crate) fn pool_id(&self) -> usize {
        Arc::as_ptr(&self.pool) as *const () as usize
    }

    /// An SGE for `[offset, offset + len)`.
    pub fn sge(&self, offset: usize, len: u32) -> Option<Sge> {
        self.mr().sge(offset, len)
    }
}

impl<P: Provider> AsRef<[u8]> for BulkBuf<P> {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl<P: Provider> Drop for BulkBuf<P> {
    fn drop(&mut self) {
        // Revoked before the buffer can be handed to anyone else.
        self.window = None;
        if let Some(mr) = self.mr.take() {
            self.pool.put(mr);
        }
    }
}

impl<P: Provider> fmt::Debug for BulkBuf<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkBuf")
            .field("len", &self.len)
            .field("lent", &self.lent())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        type B = BulkPool<crate::verbs::soft::Soft>;
        assert_eq!(B::class_of(1), Some(12));
        assert_eq!(B::class_of(4096), Some(12));
        assert_eq!(B::class_of(4097), Some(13));
        assert_eq!(B::class_of(1 << 30), Some(30));
        assert_eq!(B::class_of((1 << 30) + 1), None);
    }
}
