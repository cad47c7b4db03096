//! The soft RNIC's own accounting: payload bytes it copied, work requests it executed, RNR
//! retries, rings of peers' CQs and send completions it wrote. Tests read them to show what the
//! layers above cost (one copy per payload byte, one ring per list of work requests).
//!
//! Every count is kept per QP and written only by the holder of that QP's progress flag, one
//! thread at a time (the flag's Acquire/Release hands the values from one holder to the next),
//! so an increment is a plain load and store: exact, and without a locked instruction on the
//! data path. That matters more than it looks: a locked instruction waits until the store
//! buffer drains, and the stores before it are the cross-core writes of the payload and the
//! completion, so one shared atomic counter made every work request wait for its cache misses
//! instead of overlapping them with the next. Readers sum the QPs of a device (and of the
//! process) under a lock, off the data path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A snapshot of a soft RNIC's counters (of one context, one QP or the whole process).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Payload bytes the soft RNIC copied as requester (SEND, WRITE, READ, atomics).
    pub bytes_copied: u64,
    /// Work requests executed (successfully or not), flushes not counted.
    pub ops: u64,
    /// RNR retries (a SEND or WRITE_WITH_IMM retried because no receive was posted).
    pub rnr_retries: u64,
    /// Times the RNIC marked a peer's CQ ready after receive completions (once per list of
    /// work requests posted together, once per request posted alone).
    pub rings: u64,
    /// Send completions written (signaled requests, and every failed one).
    pub send_cqes: u64,
}

impl CounterSnapshot {
    const ZERO: CounterSnapshot = CounterSnapshot {
        bytes_copied: 0,
        ops: 0,
        rnr_retries: 0,
        rings: 0,
        send_cqes: 0,
    };

    fn add(&mut self, o: &CounterSnapshot) {
        self.bytes_copied = self.bytes_copied.wrapping_add(o.bytes_copied);
        self.ops = self.ops.wrapping_add(o.ops);
        self.rnr_retries = self.rnr_retries.wrapping_add(o.rnr_retries);
        self.rings = self.rings.wrapping_add(o.rings);
        self.send_cqes = self.send_cqes.wrapping_add(o.send_cqes);
    }
}

/// The counters of one QP. Only the holder of the QP's progress flag calls the `add_*`
/// methods (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct QpCounters {
    bytes_copied: AtomicU64,
    ops: AtomicU64,
    rnr_retries: AtomicU64,
    rings: AtomicU64,
    send_cqes: AtomicU64,
}

/// `c += n` by its only writer: a load and a store, no read-modify-write.
#[inline]
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

impl QpCounters {
    #[inline]
    pub(crate) fn add_op(&self, bytes: u64) {
        bump(&self.ops, 1);
        if bytes != 0 {
            bump(&self.bytes_copied, bytes);
        }
    }

    #[inline]
    pub(crate) fn add_rnr(&self) {
        bump(&self.rnr_retries, 1);
    }

    #[inline]
    pub(crate) fn add_ring(&self) {
        bump(&self.rings, 1);
    }

    #[inline]
    pub(crate) fn add_send_cqe(&self) {
        bump(&self.send_cqes, 1);
    }

    fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            bytes_copied: self.bytes_copied.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            rnr_retries: self.rnr_retries.load(Ordering::Relaxed),
            rings: self.rings.load(Ordering::Relaxed),
            send_cqes: self.send_cqes.load(Ordering::Relaxed),
        }
    }
}

/// A device's counters: its live QPs' and the totals of those gone.
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    inner: Mutex<DeviceInner>,
}

#[derive(Debug, Default)]
struct DeviceInner {
    live: Vec<Arc<QpCounters>>,
    retired: CounterSnapshot,
}

/// Every device of the process, and the totals of devices gone.
static DEVICES: Mutex<Vec<Arc<DeviceCounters>>> = Mutex::new(Vec::new());
static RETIRED: Mutex<CounterSnapshot> = Mutex::new(CounterSnapshot::ZERO);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DeviceCounters {
    /// A new device's counters, counted in [`process_counters`] from now on.
    pub(crate) fn register() -> Arc<DeviceCounters> {
        let d = Arc::new(DeviceCounters::default());
        lock(&DEVICES).push(Arc::clone(&d));
        d
    }

    /// The device is gone: its totals stay in the process's.
    pub(crate) fn unregister(self: &Arc<Self>) {
        let mut devices = lock(&DEVICES);
        devices.retain(|d| !Arc::ptr_eq(d, self));
        lock(&RETIRED).add(&self.snapshot());
    }

    /// Counters for a new QP of this device.
    pub(crate) fn qp(&self) -> Arc<QpCounters> {
        let q = Arc::new(QpCounters::default());
        lock(&self.inner).live.push(Arc::clone(&q));
        q
    }

    /// The QP is gone: its totals stay in the device's.
    pub(crate) fn retire(&self, q: &Arc<QpCounters>) {
        let mut inner = lock(&self.inner);
        inner.live.retain(|l| !Arc::ptr_eq(l, q));
        inner.retired.add(&q.snapshot());
    }

    /// The device's totals.
    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        let inner = lock(&self.inner);
        let mut t = inner.retired;
        for q in &inner.live {
            t.add(&q.snapshot());
        }
        t
    }
}

/// The counters of every soft RNIC (context) of this process added up: what the RPC layers'
/// tests read to show that the only payload copies are the RNIC's.
pub fn process_counters() -> CounterSnapshot {
    let devices = lock(&DEVICES);
    let mut t = *lock(&RETIRED);
    for d in devices.iter() {
        t.add(&d.snapshot());
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_and_process_totals_survive_their_qps() {
        let before = process_counters();
        let d = DeviceCounters::register();
        let a = d.qp();
        let b = d.qp();
        a.add_op(100);
        a.add_ring();
        b.add_op(0);
        b.add_rnr();
        b.add_send_cqe();
        let s = d.snapshot();
        assert_eq!((s.ops, s.bytes_copied, s.rings), (2, 100, 1));
        assert_eq!((s.rnr_retries, s.send_cqes), (1, 1));
        d.retire(&a);
        assert_eq!(d.snapshot(), s, "a retired QP's counts stay");
        d.unregister();
        let after = process_counters();
        // Other tests' devices may count meanwhile: at least ours is there.
        assert!(after.ops >= before.ops + 2);
        assert!(after.bytes_copied >= before.bytes_copied + 100);
    }
}
