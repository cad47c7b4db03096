//! Mapping pages in ahead of the data path, in the background and at the lowest priority.
//!
//! A peer's shared receive queue spans megabytes of rings that our SENDs walk a few bytes at a
//! time; a page first touched there is a page fault on the data path. Mapping both rings of
//! the default pool whole ([`Mapping::populate`]) costs about half a millisecond of CPU,
//! which on a host without an idle core lands on whatever the process does next: the first
//! connection's connect, or its first call. So the connect maps the part its first SENDs
//! reach ([`super::peer::Peer::populate_shared_ring`]) and queues the rest here: one helper
//! thread per process, started on demand at nice 19, maps the queued ranges in order and
//! ends when none is left. It takes an idle core's time, or a small share of a busy one:
//! pages it has not reached yet fault on first touch as they would without it.
//!
//! The queue names the process whose helper runs: a child forked while its parent's helper
//! ran inherits the queue, but not the thread, and starts a helper of its own.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::shm::{self, Mapping};

/// Ranges waiting to be mapped in, and the process whose helper thread runs (none: 0).
struct Queue {
    ranges: VecDeque<(Arc<Mapping>, usize, usize)>,
    running: u32,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    ranges: VecDeque::new(),
    running: 0,
});

/// Ranges mapped in by [`later`] so far (tests wait on it).
static DONE: AtomicU64 = AtomicU64::new(0);

/// Maps `[off, off + len)` of `map` in on the helper thread, after the ranges queued before
/// it; here and now when the thread cannot start. The queue keeps the
/// mapping alive until then.
pub(crate) fn later(map: &Arc<Mapping>, off: usize, len: usize) {
    let mut q = QUEUE.lock().unwrap_or_else(|e| e.into_inner());
    q.ranges.push_back((Arc::clone(map), off, len));
    let me = std::process::id();
    if q.running == me {
        return;
    }
    // None runs, or the one that runs is a parent's (this process is a child forked while it
    // ran, and has no such thread).
    q.running = me;
    drop(q);
    let started = std::thread::Builder::new()
        .name("soft-rnic-populate".into())
        .stack_size(64 << 10)
        .spawn(helper);
    if started.is_err() {
        // Done by the caller, at its own priority: each range is taken once.
        drain();
    }
}

/// Maps the pages of `[off, off + len)` of `map` in by reading a word of each: a page fault
/// each, which takes the lock of the mapping's own region only. (`madvise(MADV_POPULATE_*)`
/// holds the process's mmap lock while it works, and a thread of ours that maps memory
/// meanwhile, spawning a thread or allocating, waited for it: up to a millisecond behind a
/// helper that the scheduler, at nice 19, had preempted while it held the lock.) A read
/// maps a page of a shared writable mapping writable: shared memory keeps no dirty
/// accounting that would make the first write fault again.
fn touch(map: &Mapping, off: usize, len: usize) {
    let start = off - off % shm::PAGE;
    for at in (start..off.saturating_add(len)).step_by(shm::PAGE) {
        if let Some(w) = map.u32_at(at) {
            std::hint::black_box(w.load(Ordering::Relaxed));
        }
    }
}

/// The helper thread: lowest priority, then the queue until it is empty.
fn helper() {
    // SAFETY: `gettid` and `setpriority` on this thread's id (Linux keeps a nice value per
    // thread) only lower this thread's own priority; a refusal leaves it at the default,
    // which only costs a busy host a little more.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
    drain();
}

/// Maps the queued ranges in, in order, until none is left; then no helper runs.
fn drain() {
    loop {
        let next = {
            let mut q = QUEUE.lock().unwrap_or_else(|e| e.into_inner());
            let next = q.ranges.pop_front();
            if next.is_none() {
                q.running = 0;
            }
            next
        };
        let Some((map, off, len)) = next else {
            return;
        };
        touch(&map, off, len);
        DONE.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::*;

    /// Minor page faults of this thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: `getrusage` fills the zeroed struct it is given.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        u.ru_minflt
    }

    #[test]
    fn queued_ranges_are_mapped_in_for_every_thread_of_the_process() {
        const LEN: usize = 4 << 20;
        let fd = shm::memfd(c"populate-test", LEN as u64).unwrap();
        let map = Arc::new(Mapping::map(fd.as_fd(), LEN, true).unwrap());
        let before = DONE.load(Ordering::Acquire);
        later(&map, 0, LEN / 2);
        later(&map, LEN / 2, LEN / 2);
        let start = Instant::now();
        // Other tests may queue ranges too: at least ours are done then (in order).
        while DONE.load(Ordering::Acquire) < before + 2 || QUEUE.lock().unwrap().running != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the helper never mapped the ranges in"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let faults = thread_faults();
        for off in (0..LEN).step_by(shm::PAGE) {
            map.u32_at(off).unwrap().store(1, Ordering::Relaxed);
        }
        let faults = thread_faults() - faults;
        assert!(
            faults <= 2,
            "writing {} pages the helper mapped in took {faults} page faults",
            LEN / shm::PAGE
        );
    }

    /// A child forked while its parent's helper ran sees the queue say a helper runs, in the
    /// parent: it starts its own (simulated here with another process's id in the queue).
    #[test]
    fn a_child_forked_while_the_helper_ran_starts_its_own() {
        const LEN: usize = 256 << 10;
        let fd = shm::memfd(c"populate-fork-test", LEN as u64).unwrap();
        let map = Arc::new(Mapping::map(fd.as_fd(), LEN, true).unwrap());
        let parent = std::process::id().wrapping_add(1).max(1);
        let start = Instant::now();
        // Other tests' helpers may run now: wait until none does, then pose as the child.
        loop {
            let mut q = QUEUE.lock().unwrap();
            if q.running == 0 {
                q.running = parent;
                break;
            }
            drop(q);
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "a helper never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let before = DONE.load(Ordering::Acquire);
        later(&map, 0, LEN);
        while DONE.load(Ordering::Acquire) == before {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "with the parent's helper named in the queue, the range was never mapped in"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_ne!(QUEUE.lock().unwrap().running, parent);
    }
}
