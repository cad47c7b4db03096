//! Preallocated storage for in-flight handler futures, and their wakers.
//!
//! A server shard runs each call's handler future in place, inside a slot of a [`TaskSlab`]
//! allocated once when the shard starts: a future that is ready at once never leaves its slot
//! and costs no heap allocation; one that waits stays parked there and is polled again when its
//! waker fires. Futures larger than [`TASK_INLINE`] bytes (or over-aligned) are boxed: the only
//! allocation, counted by [`TaskSlab::boxed`].
//!
//! Wakers carry no allocation either: a waker is a pointer to a preallocated wake entry plus a
//! reference count on the shared wake state; waking pushes the slot index on a lock-free ready
//! queue (once, until it is taken) and calls the shard's notifier.

use crate::queue::PopIfAny;
use std::cell::UnsafeCell;
use std::future::Future;
use std::mem::{MaybeUninit, align_of, size_of};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use crossbeam_queue::ArrayQueue;

/// Bytes of inline storage per task slot.
pub const TASK_INLINE: usize = 1024;
const TASK_ALIGN: usize = 64;

/// The type of the context argument tasks are polled with, as a family over the lifetime of the
/// borrow (the shard lends a view of the call's connection for the duration of one poll).
pub trait CtxFamily: 'static {
    /// The context borrowed for `'a`.
    type Ctx<'a>: ?Sized;
}

/// A task the slab can hold: polled with a context argument of the family `C`.
pub trait SlabTask<C: CtxFamily>: Send {
    /// Polls the task.
    fn poll<'a>(self: Pin<&mut Self>, cx: &mut Context<'_>, ctx: &'a mut C::Ctx<'a>) -> Poll<()>;
}

/// What the shard's wakers do besides queueing: interrupt the shard's idle sleep.
pub trait Notify: Send + Sync + 'static {
    /// Called after a slot index was queued as ready.
    fn notify(&self);
}

#[repr(C, align(64))]
struct Storage([MaybeUninit<u8>; TASK_INLINE]);

const _: () = assert!(align_of::<Storage>() == TASK_ALIGN);

type PollFn<C> =
    for<'a, 'b> unsafe fn(*mut u8, &mut Context<'b>, &'a mut <C as CtxFamily>::Ctx<'a>) -> Poll<()>;

struct Slot<C: CtxFamily> {
    storage: UnsafeCell<Storage>,
    /// `Some` while the slot holds a live task.
    poll: Option<PollFn<C>>,
    drop: unsafe fn(*mut u8),
    generation: u32,
}

/// The wake state shared by a slab and its wakers.
pub struct WakeShared<N: Notify> {
    entries: Box<[WakeEntry<N>]>,
    queued: Box<[AtomicBool]>,
    ready: ArrayQueue<u32>,
    notify: N,
}

struct WakeEntry<N: Notify> {
    shared: *const WakeShared<N>,
    idx: u32,
}

// SAFETY: `WakeEntry` only holds a pointer to the `WakeShared` that contains it, which is
// itself `Sync` (atomics, a lock-free queue and a `Notify: Sync`); the pointer is only
// dereferenced while a reference count on that `Arc` is held.
unsafe impl<N: Notify> Send for WakeEntry<N> {}
// SAFETY: as above.
unsafe impl<N: Notify> Sync for WakeEntry<N> {}

impl<N: Notify> WakeShared<N> {
    fn wake(&self, idx: u32) {
        if let Some(q) = self.queued.get(idx as usize) {
            if !q.swap(true, Ordering::AcqRel) {
                // Capacity equals the slot count and an index is queued at most once.
                let _ = self.ready.push(idx);
            }
            self.notify.notify();
        }
    }
}

impl<N: Notify> std::fmt::Debug for WakeShared<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeShared")
            .field("ready", &self.ready.len())
            .finish()
    }
}

fn waker_vtable<N: Notify>() -> &'static RawWakerVTable {
    struct V<N>(std::marker::PhantomData<N>);
    impl<N: Notify> V<N> {
        const VTABLE: RawWakerVTable = RawWakerVTable::new(
            clone_raw::<N>,
            wake_raw::<N>,
            wake_by_ref_raw::<N>,
            drop_raw::<N>,
        );
    }
    &V::<N>::VTABLE
}

unsafe fn clone_raw<N: Notify>(data: *const ()) -> RawWaker {
    let e = data.cast::<WakeEntry<N>>();
    // SAFETY: `data` is a `WakeEntry` inside a live `WakeShared` (this waker holds a count on
    // its `Arc`); taking one more count keeps it alive for the clone.
    unsafe { Arc::increment_strong_count((*e).shared) };
    RawWaker::new(data, waker_vtable::<N>())
}

unsafe fn wake_raw<N: Notify>(data: *const ()) {
    // SAFETY: same pointer contract as `clone_raw`; `wake` consumes this waker's count.
    unsafe {
        wake_by_ref_raw::<N>(data);
        drop_raw::<N>(data);
    }
}

unsafe fn wake_by_ref_raw<N: Notify>(data: *const ()) {
    let e = data.cast::<WakeEntry<N>>();
    // SAFETY: the waker holds a count on the `Arc<WakeShared>` that owns the entry, so both are
    // alive.
    unsafe { (*(*e).shared).wake((*e).idx) };
}

unsafe fn drop_raw<N: Notify>(data: *const ()) {
    let e = data.cast::<WakeEntry<N>>();
    // SAFETY: releases the count this waker held (taken in `TaskSlab::waker` or `clone_raw`);
    // the entry is read before the count is released.
    unsafe {
        let shared = (*e).shared;
        Arc::decrement_strong_count(shared);
    }
}

/// A fixed set of task slots with in-place futures.
pub struct TaskSlab<C: CtxFamily, N: Notify> {
    slots: Box<[Slot<C>]>,
    free: Vec<u32>,
    wake: Arc<WakeShared<N>>,
    boxed: u64,
}

// SAFETY: the slab is owned by one shard thread; the tasks it holds are `Send` (checked in
// `spawn`), and the wake state is `Sync`. Moving the whole slab to another thread moves its
// tasks with it, which `Send` tasks allow.
unsafe impl<C: CtxFamily, N: Notify> Send for TaskSlab<C, N> {}

/// What [`TaskSlab::spawn`] did with a task.
#[derive(Debug)]
pub enum Spawned {
    /// It finished at once; its slot is free again.
    Done,
    /// It waits, parked in its slot.
    Parked(TaskId),
    /// It panicked (and was dropped).
    Panicked(Box<dyn std::any::Any + Send>),
}

/// What [`TaskSlab::poll`] did.
#[derive(Debug)]
pub enum Polled {
    /// The task waits.
    Pending,
    /// The task finished (or the id was stale).
    Done,
    /// The task panicked (and was dropped).
    Panicked(Box<dyn std::any::Any + Send>),
}

/// Handle to a spawned task: slot index and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskId {
    /// Slot index.
    pub idx: u32,
    /// Generation of the slot when the task was spawned.
    pub generation: u32,
}

unsafe fn poll_in_place<'a, T: SlabTask<C>, C: CtxFamily>(
    p: *mut u8,
    cx: &mut Context<'_>,
    ctx: &'a mut C::Ctx<'a>,
) -> Poll<()> {
    // SAFETY: `p` points to a live `T` written by `spawn` into a slot that never moves (the
    // slots are a boxed slice allocated once) until `drop_in_place` runs: pinning holds.
    let t = unsafe { Pin::new_unchecked(&mut *p.cast::<T>()) };
    t.poll(cx, ctx)
}

unsafe fn drop_in_place<T>(p: *mut u8) {
    // SAFETY: `p` points to a live `T` written by `spawn`; called once, when the task ends or
    // the slab is dropped.
    unsafe { std::ptr::drop_in_place(p.cast::<T>()) }
}

struct Boxed<T>(Pin<Box<T>>);

impl<T: SlabTask<C>, C: CtxFamily> SlabTask<C> for Boxed<T> {
    fn poll<'a>(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        ctx: &'a mut C::Ctx<'a>,
    ) -> Poll<()> {
        self.0.as_mut().poll(cx, ctx)
    }
}

impl<C: CtxFamily, N: Notify> TaskSlab<C, N> {
    /// A slab of `n` slots; `notify` is called whenever a parked task is woken.
    pub fn new(n: u32, notify: N) -> TaskSlab<C, N> {
        let slots = (0..n)
            .map(|_| Slot {
                storage: UnsafeCell::new(Storage([MaybeUninit::uninit(); TASK_INLINE])),
                poll: None,
                drop: drop_in_place::<()>,
                generation: 0,
            })
            .collect();
        let wake = Arc::new_cyclic(|weak| {
            let ptr = weak.as_ptr();
            WakeShared {
                entries: (0..n).map(|idx| WakeEntry { shared: ptr, idx }).collect(),
                queued: (0..n).map(|_| AtomicBool::new(false)).collect(),
                ready: ArrayQueue::new(n.max(1) as usize),
                notify,
            }
        });
        TaskSlab {
            slots,
            free: (0..n).rev().collect(),
            wake,
            boxed: 0,
        }
    }

    /// Free slots.
    #[cfg(test)]
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Tasks that did not fit inline and were boxed, since creation.
    #[cfg(test)]
    pub fn boxed(&self) -> u64 {
        self.boxed
    }

    /// Live tasks.
    pub fn live(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Moves `task` into a free slot and polls it once. Gives the task back when no slot is
    /// free.
    ///
    /// # Errors
    /// The task, when every slot is taken.
    pub fn spawn<'a, T: SlabTask<C> + 'static>(
        &mut self,
        task: T,
        ctx: &'a mut C::Ctx<'a>,
    ) -> Result<Spawned, T> {
        let Some(idx) = self.free.pop() else {
            return Err(task);
        };
        if size_of::<T>() <= TASK_INLINE && align_of::<T>() <= TASK_ALIGN {
            self.place(idx, task);
        } else {
            self.boxed += 1;
            self.place(idx, Boxed(Box::pin(task)));
        }
        // The slot's `queued` flag is left as it is: it says whether the index sits in the
        // ready queue (maybe from a stale waker of the previous task), which stays true.
        let id = TaskId {
            idx,
            generation: self.slots[idx as usize].generation,
        };
        Ok(match self.poll(id, ctx) {
            Polled::Pending => Spawned::Parked(id),
            Polled::Done => Spawned::Done,
            Polled::Panicked(p) => Spawned::Panicked(p),
        })
    }

    fn place<T: SlabTask<C> + 'static>(&mut self, idx: u32, task: T) {
        let slot = &mut self.slots[idx as usize];
        debug_assert!(slot.poll.is_none());
        let p = slot.storage.get().cast::<T>();
        // SAFETY: the slot is free (taken from `free`), its storage is `TASK_INLINE` bytes
        // aligned to 64, and the caller checked `T` fits both; writing moves the (not yet
        // pinned) task into place, where it stays until `finish`.
        unsafe { p.write(task) };
        slot.poll = Some(poll_in_place::<T, C>);
        slot.drop = drop_in_place::<T>;
    }

    fn queued_reset(&self, idx: u32) {
        self.wake.queued[idx as usize].store(false, Ordering::Release);
    }

    /// A waker for slot `idx`.
    fn waker(&self, idx: u32) -> Waker {
        let e: *const WakeEntry<N> = &self.wake.entries[idx as usize];
        // A count held by the new waker, released by its drop (`drop_raw`).
        std::mem::forget(Arc::clone(&self.wake));
        // SAFETY: the vtable functions uphold `RawWaker`'s contract: the data pointer is a
        // `WakeEntry` inside the `WakeShared` whose count was just taken above.
        unsafe { Waker::from_raw(RawWaker::new(e.cast(), waker_vtable::<N>())) }
    }

    /// Polls the task `id` if it is still live (a stale id from an earlier task in the slot is
    /// ignored: `Done`). A task that panics is dropped, and the panic is returned instead of
    /// unwinding through the caller's poll loop.
    pub fn poll<'a>(&mut self, id: TaskId, ctx: &'a mut C::Ctx<'a>) -> Polled {
        let Some(slot) = self.slots.get(id.idx as usize) else {
            return Polled::Done;
        };
        let Some(poll) = slot.poll else {
            return Polled::Done;
        };
        if slot.generation != id.generation {
            return Polled::Pending;
        }
        let waker = self.waker(id.idx);
        let mut cx = Context::from_waker(&waker);
        let p = slot.storage.get().cast::<u8>();
        // Unwind safety: after a panic the task is only dropped, never polled again.
        let cx = &mut cx;
        // The context goes through a raw pointer because closures cannot capture a `&'a mut`
        // of a GAT projection invariant in `'a`.
        let ctx: *mut C::Ctx<'a> = ctx;
        let r = std::panic::catch_unwind(AssertUnwindSafe(move || {
            // SAFETY: `ctx` is the `&'a mut` this function received, used once here and never
            // elsewhere; the slot holds a live task of the type `poll` was made for (set
            // together in `place`), polled from the owning thread only (`&mut self`).
            unsafe { poll(p, cx, &mut *ctx) }
        }));
        match r {
            Ok(Poll::Pending) => Polled::Pending,
            Ok(Poll::Ready(())) => {
                self.finish(id.idx);
                Polled::Done
            }
            Err(payload) => {
                self.finish(id.idx);
                Polled::Panicked(payload)
            }
        }
    }

    /// Drops the task `id` without finishing it (cancellation). Stale ids are ignored.
    pub fn cancel(&mut self, id: TaskId) {
        if self.is_live(id) {
            self.finish(id.idx);
        }
    }

    /// Whether `id` is still live.
    pub fn is_live(&self, id: TaskId) -> bool {
        self.slots
            .get(id.idx as usize)
            .is_some_and(|s| s.poll.is_some() && s.generation == id.generation)
    }

    fn finish(&mut self, idx: u32) {
        let slot = &mut self.slots[idx as usize];
        if slot.poll.take().is_some() {
            let p = slot.storage.get().cast::<u8>();
            let drop_fn = slot.drop;
            // A destructor that panics must not unwind through the poll loop either; the slot
            // is reclaimed whatever happens.
            let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the slot held a live task of the type `drop` was made for; `poll`
                // was cleared first so it is dropped exactly once.
                unsafe { drop_fn(p) };
            }));
            slot.generation = slot.generation.wrapping_add(1);
            self.free.push(idx);
        }
    }

    /// Wakes task `id` from the owning thread (as its waker would), if it is still live.
    pub fn wake(&self, id: TaskId) {
        if self.is_live(id) {
            self.wake.wake(id.idx);
        }
    }

    /// Takes the next woken task, if any: `(slot index, its current id)`.
    pub fn next_ready(&mut self) -> Option<TaskId> {
        loop {
            let idx = self.wake.ready.pop_if_any()?;
            self.queued_reset(idx);
            let slot = &self.slots[idx as usize];
            if slot.poll.is_some() {
                return Some(TaskId {
                    idx,
                    generation: slot.generation,
                });
            }
        }
    }
}

impl<C: CtxFamily, N: Notify> Drop for TaskSlab<C, N> {
    fn drop(&mut self) {
        for idx in 0..self.slots.len() as u32 {
            self.finish(idx);
        }
    }
}

impl<C: CtxFamily, N: Notify> std::fmt::Debug for TaskSlab<C, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskSlab")
            .field("slots", &self.slots.len())
            .field("live", &self.live())
            .field("boxed", &self.boxed)
            .finish()
    }
}

/// Adapts a plain future whose output is consumed by `F` into a [`SlabTask`].
#[derive(Debug)]
pub struct FutureTask<Fut, F> {
    fut: Fut,
    on_done: Option<F>,
}

impl<Fut, F> FutureTask<Fut, F> {
    /// `fut`, whose output is handed to `on_done` with the context when it completes.
    pub fn new(fut: Fut, on_done: F) -> FutureTask<Fut, F> {
        FutureTask {
            fut,
            on_done: Some(on_done),
        }
    }
}

impl<Fut, F, C> SlabTask<C> for FutureTask<Fut, F>
where
    C: CtxFamily,
    Fut: Future + Send,
    F: for<'a> FnOnce(Fut::Output, &'a mut C::Ctx<'a>) + Send,
{
    fn poll<'a>(self: Pin<&mut Self>, cx: &mut Context<'_>, ctx: &'a mut C::Ctx<'a>) -> Poll<()> {
        // SAFETY: structural pinning of `fut` (never moved out of `self`); `on_done` is not
        // pinned (only taken by value).
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: `this.fut` is pinned because `self` is.
        let fut = unsafe { Pin::new_unchecked(&mut this.fut) };
        match fut.poll(cx) {
            Poll::Ready(out) => {
                if let Some(f) = this.on_done.take() {
                    f(out, ctx);
                }
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct VecCtx;
    impl CtxFamily for VecCtx {
        type Ctx<'a> = Vec<u32>;
    }
    struct UnitCtx;
    impl CtxFamily for UnitCtx {
        type Ctx<'a> = ();
    }

    #[derive(Default)]
    struct CountNotify(AtomicUsize);
    impl Notify for Arc<CountNotify> {
        fn notify(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn ready_task_finishes_inline_and_frees_its_slot() {
        let n = Arc::new(CountNotify::default());
        let mut slab: TaskSlab<VecCtx, _> = TaskSlab::new(2, Arc::clone(&n));
        let mut out = Vec::new();
        let t = FutureTask::new(async { 5u32 }, |v, out: &mut Vec<u32>| out.push(v));
        assert!(matches!(slab.spawn(t, &mut out), Ok(Spawned::Done)));
        assert_eq!(out, [5]);
        assert_eq!(slab.available(), 2);
        assert_eq!(slab.boxed(), 0);
    }

    #[test]
    fn parked_task_is_repolled_after_wake() {
        let n = Arc::new(CountNotify::default());
        let mut slab: TaskSlab<VecCtx, _> = TaskSlab::new(4, Arc::clone(&n));
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let mut out = Vec::new();
        let t = FutureTask::new(
            async move { rx.await.unwrap_or(0) },
            |v, o: &mut Vec<u32>| o.push(v),
        );
        let Ok(Spawned::Parked(id)) = slab.spawn(t, &mut out) else {
            panic!("not parked")
        };
        assert!(slab.next_ready().is_none());
        tx.send(42).unwrap();
        assert!(n.0.load(Ordering::Relaxed) >= 1);
        let r = slab.next_ready().expect("woken");
        assert_eq!(r, id);
        assert!(matches!(slab.poll(r, &mut out), Polled::Done));
        assert_eq!(out, [42]);
        assert!(!slab.is_live(id));
    }

    #[test]
    fn large_futures_are_boxed_and_cancel_drops() {
        let n = Arc::new(CountNotify::default());
        let mut slab: TaskSlab<UnitCtx, _> = TaskSlab::new(1, n);
        let big = [0u8; 4096];
        let (_tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let dropped = Arc::new(AtomicUsize::new(0));
        struct OnDrop(Arc<AtomicUsize>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let guard = OnDrop(Arc::clone(&dropped));
        let t = FutureTask::new(
            async move {
                let _g = guard;
                let _ = rx.await;
                big[0]
            },
            |_, _: &mut ()| {},
        );
        let Ok(Spawned::Parked(id)) = slab.spawn(t, &mut ()) else {
            panic!("not parked")
        };
        assert_eq!(slab.boxed(), 1);
        assert_eq!(slab.available(), 0);
        slab.cancel(id);
        assert_eq!(dropped.load(Ordering::Relaxed), 1);
        assert_eq!(slab.available(), 1);
    }

    #[test]
    fn a_panicking_task_is_dropped_and_reported() {
        let n = Arc::new(CountNotify::default());
        let mut slab: TaskSlab<UnitCtx, _> = TaskSlab::new(1, n);
        let t = FutureTask::new(async { panic!("boom") }, |_: (), _: &mut ()| {});
        let Ok(Spawned::Panicked(p)) = slab.spawn(t, &mut ()) else {
            panic!("no panic seen")
        };
        assert_eq!(p.downcast_ref::<&str>().copied(), Some("boom"));
        assert_eq!(slab.available(), 1, "the slot is free again");
    }

    #[test]
    fn stale_wakers_are_harmless() {
        let n = Arc::new(CountNotify::default());
        let slab: TaskSlab<UnitCtx, _> = TaskSlab::new(1, n);
        let waker = slab.waker(0);
        drop(slab);
        // The shared state outlives the slab through the waker's count.
        waker.wake_by_ref();
        drop(waker);
    }
}
