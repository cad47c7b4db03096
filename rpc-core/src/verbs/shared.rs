//! One device context per process: every client connection of a process that opens the same
//! device of the same provider shares one opened context, as NCCL and UCX keep one per NIC.
//! A new connection then costs its PD, CQ and QPs, not a device: no second open, port query,
//! GID read or inline probe (ib), no second pair of shared segments and service thread (soft).
//!
//! The layers above keep what their connections share per context here too
//! ([`SharedDevice::per_context`]: the client's protection domain and bulk pool), made on first
//! use and dropped with the context.
//!
//! Asynchronous events belong to the device, so they are fanned out: every holder of a
//! [`SharedDevice`] sees every event raised after it opened (an event log with one cursor per
//! holder), and decides for itself whether it concerns its objects. A device that reported
//! [`AsyncEvent::DeviceFatal`] is retired from the registry: whoever opens it next gets a
//! fresh context (verbs: close it and open the device again), while its holders fail.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::{AsyncEvent, Context, Provider, ProviderKind, Result};

/// Events kept for holders that have not read them yet (a holder further behind misses the
/// oldest, and is told so in a log line).
const LOG_CAP: usize = 256;

/// A device context shared by the connections of a process (see the module docs).
pub(crate) struct SharedDevice<P: Provider> {
    entry: Arc<Entry<P>>,
    /// Sequence number of the next event this holder reads.
    seen: AtomicU64,
}

struct Entry<P: Provider> {
    /// What the layers above keep per context ([`SharedDevice::per_context`]), one value per
    /// type; declared before `ctx`, so dropped before it.
    above: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
    ctx: P::Context,
    /// Sequence number one past the newest logged event (read without the lock).
    tail: AtomicU64,
    log: Mutex<Log>,
}

#[derive(Default)]
struct Log {
    /// Sequence number of `events[0]`.
    first: u64,
    events: VecDeque<AsyncEvent>,
}

/// The open devices: provider, device name as asked, and a `Weak<Entry<P>>`.
type Registry = Vec<(ProviderKind, Option<String>, Box<dyn Any + Send + Sync>)>;
static OPEN: Mutex<Registry> = Mutex::new(Vec::new());

impl<P: Provider> std::fmt::Debug for SharedDevice<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDevice")
            .field("ctx", &self.entry.ctx)
            .field("holders", &Arc::strong_count(&self.entry))
            .finish()
    }
}

impl<P: Provider> SharedDevice<P> {
    /// The process's context for device `name` of provider `P` (the provider's first usable
    /// device for `None`), opened on first use and kept while anyone holds it.
    ///
    /// # Errors
    /// As [`Provider::open`].
    pub(crate) fn open(name: Option<&str>) -> Result<SharedDevice<P>> {
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|(_, _, w)| {
            w.downcast_ref::<Weak<Entry<P>>>()
                .is_none_or(|w| w.strong_count() > 0)
        });
        let found = open
            .iter()
            .filter(|(k, n, _)| *k == P::KIND && n.as_deref() == name)
            .find_map(|(_, _, w)| w.downcast_ref::<Weak<Entry<P>>>()?.upgrade());
        let entry = match found {
            Some(e) => e,
            None => {
                // Opened under the lock: two first users open the device once.
                let e = Arc::new(Entry {
                    above: Mutex::new(Vec::new()),
                    ctx: P::open(name)?,
                    tail: AtomicU64::new(0),
                    log: Mutex::new(Log::default()),
                });
                open.push((
                    P::KIND,
                    name.map(str::to_owned),
                    Box::new(Arc::downgrade(&e)),
                ));
                e
            }
        };
        let seen = AtomicU64::new(entry.tail.load(Ordering::Acquire));
        Ok(SharedDevice { entry, seen })
    }

    /// The device context.
    pub(crate) fn ctx(&self) -> &P::Context {
        &self.entry.ctx
    }

    /// The value of type `T` that every holder of this context shares, made by `init` on the
    /// first call (under a lock: two first callers make it once) and kept until the context
    /// closes. A device retired after a fatal event gets fresh values with its fresh context.
    ///
    /// # Errors
    /// What `init` returns.
    pub(crate) fn per_context<T: Any + Send + Sync>(
        &self,
        init: impl FnOnce(&P::Context) -> Result<T>,
    ) -> Result<Arc<T>> {
        let mut above = self.entry.above.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = above
            .iter()
            .find_map(|a| Arc::clone(a).downcast::<T>().ok())
        {
            return Ok(t);
        }
        let t = Arc::new(init(&self.entry.ctx)?);
        above.push(Arc::clone(&t) as Arc<dyn Any + Send + Sync>);
        Ok(t)
    }

    /// The next asynchronous event of the device this holder has not seen, without blocking.
    /// Without news: the provider's own non-blocking poll and one atomic load, no lock.
    ///
    /// # Errors
    /// When the device's event descriptor fails.
    pub(crate) fn poll_async_event(&self) -> Result<Option<AsyncEvent>> {
        let e = &*self.entry;
        if let Some(ev) = e.ctx.poll_async_event()? {
            self.log(ev);
        }
        let seen = self.seen.load(Ordering::Relaxed);
        if seen == e.tail.load(Ordering::Acquire) {
            return Ok(None);
        }
        let log = e.log.lock().unwrap_or_else(|p| p.into_inner());
        let mut at = seen;
        if at < log.first {
            tracing::warn!(
                "{}: missed {} device events (more than {LOG_CAP} arrived unread)",
                P::TAG,
                log.first - at
            );
            at = log.first;
        }
        let ev = usize::try_from(at - log.first)
            .ok()
            .and_then(|i| log.events.get(i).copied());
        if ev.is_some() {
            at += 1;
        }
        self.seen.store(at, Ordering::Relaxed);
        Ok(ev)
    }

    /// Appends an event for every holder; retires a failed device from the registry.
    fn log(&self, ev: AsyncEvent) {
        let e = &*self.entry;
        {
            let mut log = e.log.lock().unwrap_or_else(|p| p.into_inner());
            log.events.push_back(ev);
            if log.events.len() > LOG_CAP {
                log.events.pop_front();
                log.first += 1;
            }
            e.tail
                .store(log.first + log.events.len() as u64, Ordering::Release);
        }
        if ev == AsyncEvent::DeviceFatal {
            let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
            open.retain(|(_, _, w)| {
                w.downcast_ref::<Weak<Entry<P>>>()
                    .is_none_or(|w| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.entry)))
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::Soft;

    #[test]
    fn one_context_per_device_and_every_holder_sees_every_event() {
        // A name no other test of this binary opens, so the registry entry is ours.
        let a = SharedDevice::<Soft>::open(Some("soft0:1")).unwrap();
        let b = SharedDevice::<Soft>::open(Some("soft0:1")).unwrap();
        assert_eq!(a.ctx().nonce(), b.ctx().nonce(), "opened twice");
        let other = SharedDevice::<Soft>::open(Some("soft0")).unwrap();
        assert_ne!(a.ctx().nonce(), other.ctx().nonce());

        // An event pulled from the device by one holder (`log`, as `poll_async_event` does):
        // both holders see it, each once.
        let ev = AsyncEvent::PortError { port: 1 };
        b.log(ev);
        assert_eq!(b.poll_async_event().unwrap(), Some(ev));
        assert_eq!(a.poll_async_event().unwrap(), Some(ev));
        assert_eq!(a.poll_async_event().unwrap(), None);
        assert_eq!(b.poll_async_event().unwrap(), None);
        // A holder that opens later does not see older events.
        let c = SharedDevice::<Soft>::open(Some("soft0:1")).unwrap();
        assert_eq!(c.poll_async_event().unwrap(), None);

        // A fatal device is retired: the next open gets a fresh context.
        c.log(AsyncEvent::DeviceFatal);
        assert_eq!(a.poll_async_event().unwrap(), Some(AsyncEvent::DeviceFatal));
        assert_eq!(c.poll_async_event().unwrap(), Some(AsyncEvent::DeviceFatal));
        let d = SharedDevice::<Soft>::open(Some("soft0:1")).unwrap();
        assert_ne!(
            d.ctx().nonce(),
            a.ctx().nonce(),
            "a failed device was handed out again"
        );

        // Values kept per context: one per type, shared by its holders, fresh for a fresh
        // context.
        let x = a.per_context(|_| Ok(7u32)).unwrap();
        let y = b
            .per_context(|_| -> Result<u32> { panic!("made twice") })
            .unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        assert_eq!(*a.per_context(|_| Ok(9u64)).unwrap(), 9);
        assert_eq!(
            *d.per_context(|_| Ok(8u32)).unwrap(),
            8,
            "a retired context's value"
        );
        let weak = Arc::downgrade(&x);
        drop((x, y));

        drop((a, b, c, d));
        assert!(weak.upgrade().is_none(), "a value outlived its context");
        let e = SharedDevice::<Soft>::open(Some("soft0:1")).unwrap();
        drop(e);
        let open = OPEN.lock().unwrap();
        assert!(
            open.iter()
                .filter(|(k, n, _)| *k == ProviderKind::Soft && n.as_deref() == Some("soft0:1"))
                .all(|(_, _, w)| w
                    .downcast_ref::<Weak<Entry<Soft>>>()
                    .is_some_and(|w| w.strong_count() == 0)),
            "an entry outlived its holders"
        );
    }
}
