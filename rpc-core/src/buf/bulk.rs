//! The bulk pool: registered buffers for payloads above the eager threshold.
//!
//! Buffers come in power-of-two size classes and are registered with remote read and write
//! rights, because a bulk buffer is advertised to the peer as `{addr, len, rkey}`: the peer
//! RDMA-READs a rendezvous payload out of it, or RDMA-WRITEs a large response into it (a landing
//! zone). A returned buffer goes back to its class's free queue (lock-free) up to a cap on cached
//! bytes, so a steady stream of large calls registers nothing after warm-up. A miss allocates and
//! registers (a slow path, as it is on any RDMA stack).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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
    classes: Vec<ArrayQueue<P::Mr>>,
    cached_bytes: AtomicUsize,
    max_cached: usize,
    registrations: AtomicU64,
}

impl<P: Provider> BulkPool<P> {
    /// Largest bulk buffer.
    pub const MAX_LEN: usize = 1 << MAX_CLASS;

    /// A pool caching at most `max_cached` bytes of idle buffers.
    pub fn new(pd: Arc<P::Pd>, max_cached: usize) -> Arc<BulkPool<P>> {
        let classes = (0..CLASSES).map(|_| ArrayQueue::new(PER_CLASS)).collect();
        Arc::new(BulkPool {
            pd,
            classes,
            cached_bytes: AtomicUsize::new(0),
            max_cached,
            registrations: AtomicU64::new(0),
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
    /// When `len` is over [`BulkPool::MAX_LEN`] or registration fails.
    pub fn get(self: &Arc<Self>, len: usize) -> Result<BulkBuf<P>> {
        let Some(class) = Self::class_of(len) else {
            return Err(crate::verbs::VerbsError::new(
                crate::verbs::Verb::AllocMr,
                crate::verbs::ErrorKind::ExceedsCaps,
                "bulk payload larger than 1 GiB",
            ));
        };
        let q = &self.classes[(class - MIN_CLASS) as usize];
        let mr = match q.pop() {
            Some(mr) => {
                self.cached_bytes.fetch_sub(1 << class, Ordering::Relaxed);
                mr
            }
            None => {
                self.registrations.fetch_add(1, Ordering::Relaxed);
                self.pd.alloc_mr(
                    1 << class,
                    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
                )?
            }
        };
        Ok(BulkBuf {
            pool: Arc::clone(self),
            mr: Some(mr),
            len,
        })
    }

    /// How many registrations the pool has made (misses).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    fn put(&self, mr: P::Mr) {
        let size = mr.len();
        let Some(class) = Self::class_of(size) else {
            return;
        };
        if self.cached_bytes.load(Ordering::Relaxed) + size > self.max_cached {
            return; // dropped: deregistered and freed
        }
        if self.classes[(class - MIN_CLASS) as usize].push(mr).is_ok() {
            self.cached_bytes.fetch_add(size, Ordering::Relaxed);
        }
    }
}

impl<P: Provider> fmt::Debug for BulkPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkPool")
            .field("cached_bytes", &self.cached_bytes.load(Ordering::Relaxed))
            .field("registrations", &self.registrations.load(Ordering::Relaxed))
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

    /// Whether the length in use is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// What a peer needs to READ or WRITE the bytes in use.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.mr().addr(),
            len: self.len as u64,
            rkey: self.mr().rkey(),
        }
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
        if let Some(mr) = self.mr.take() {
            self.pool.put(mr);
        }
    }
}

impl<P: Provider> fmt::Debug for BulkBuf<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkBuf")
            .field("len", &self.len)
            .field("remote", &self.remote())
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
