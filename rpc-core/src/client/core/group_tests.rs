//! The poller thread's list (`group`), with fake members: work queued from several threads
//! is all done (no member is left with work and off the list), and a sweep turns the
//! members with work, not the idle ones.

use std::sync::atomic::AtomicU32;

use super::*;

/// A connection without a connection: `queued` is its work, a turn does all of it.
struct Fake {
    listing: Listing,
    queued: AtomicU32,
    done: AtomicU32,
    turns: AtomicU32,
    stop: AtomicBool,
    /// A turn takes this long (milliseconds): the thread is away meanwhile.
    slow_ms: AtomicU32,
    /// Never written: an idle member's "completion channel" never fires.
    fd: OwnedFd,
}

impl Fake {
    fn new() -> Arc<Fake> {
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        Arc::new(Fake {
            listing: Listing::new(),
            queued: AtomicU32::new(0),
            done: AtomicU32::new(0),
            turns: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            slow_ms: AtomicU32::new(0),
            fd,
        })
    }

    /// What a connection does when it queues work.
    fn queue(&self, p: Poller) {
        self.queued.fetch_add(1, Ordering::SeqCst);
        p.list(&self.listing);
        p.doorbell().ring();
    }
}

impl Member for Fake {
    fn turn(&self) -> usize {
        self.turns.fetch_add(1, Ordering::Relaxed);
        let slow = self.slow_ms.load(Ordering::Relaxed);
        if slow > 0 && self.busy() {
            std::thread::sleep(Duration::from_millis(u64::from(slow)));
        }
        let n = self.queued.swap(0, Ordering::AcqRel);
        self.done.fetch_add(n, Ordering::AcqRel);
        n as usize
    }
    fn driven(&self) -> bool {
        false
    }
    fn busy(&self) -> bool {
        self.queued.load(Ordering::SeqCst) > 0
    }
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
    fn prepare_sleep(&self, max: Duration) -> Option<(Duration, bool)> {
        (!self.busy()).then_some((max, true))
    }
    fn woke(&self) {}
    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>)) {
        f(self.fd.as_fd());
    }
    fn listing(&self) -> &Listing {
        &self.listing
    }
}

/// Waits (sleeping, bounded) until `done` holds.
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn joined(p: Poller, n: usize) -> Vec<Arc<Fake>> {
    (0..n)
        .map(|_| {
            let m = Fake::new();
            p.join(Arc::clone(&m) as Arc<dyn Member>);
            m
        })
        .collect()
}

/// Work queued from several threads on many members, while the thread sweeps, unlists
/// and sleeps (the queuers pause now and then so that it does), is all done: no member
/// is left with work and off the list.
#[test]
fn all_queued_work_is_turned() {
    let p = Poller(start().unwrap());
    let members = Arc::new(joined(p, 300));
    let per_thread = 20_000u32;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let members = Arc::clone(&members);
            std::thread::spawn(move || {
                let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for i in 0..per_thread {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    members[(x % members.len() as u64) as usize].queue(p);
                    if i % 2000 == 0 {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let total = 4 * per_thread;
    wait_until("every queued piece of work done", || {
        members
            .iter()
            .map(|m| m.done.load(Ordering::Acquire))
            .sum::<u32>()
            == total
    });
    assert!(
        members
            .iter()
            .all(|m| m.queued.load(Ordering::Acquire) == 0)
    );
    for m in members.iter() {
        m.stop.store(true, Ordering::Release);
        p.list(&m.listing);
    }
}

/// A sweep turns the members with work, not all of them: beside one busy member, a
/// thousand idle ones are turned about once each (when they join, and once a second),
/// not at every sweep.
#[test]
fn idle_members_are_not_swept() {
    let p = Poller(start().unwrap());
    let idle = joined(p, 1000);
    let busy = joined(p, 1).pop().unwrap();
    let started = Instant::now();
    let n = 50_000u32;
    for i in 0..n {
        busy.queue(p);
        if i % 64 == 0 {
            // Let the thread sweep between bursts.
            wait_until("the busy member's work done", || !busy.busy());
        }
    }
    wait_until("the busy member's work done", || {
        busy.done.load(Ordering::Acquire) == n
    });
    let secs = started.elapsed().as_secs() as u32;
    let most = idle
        .iter()
        .map(|m| m.turns.load(Ordering::Relaxed))
        .max()
        .unwrap();
    let busy_turns = busy.turns.load(Ordering::Relaxed);
    assert!(
        most <= 2 + secs,
        "an idle member was turned {most} times in {secs} s ({busy_turns} turns of the busy one)"
    );
    assert!(
        busy_turns >= n / 64,
        "{busy_turns} turns of the busy member"
    );
    for m in idle.iter().chain([&busy]) {
        m.stop.store(true, Ordering::Release);
        p.list(&m.listing);
    }
}

/// More members listed at once than `ready` holds (while the thread is busy with a slow
/// turn): it overflows, and the thread then looks at every member; nothing is lost.
#[test]
fn an_overflowing_ready_queue_loses_nothing() {
    let p = Poller(start().unwrap());
    let members = joined(p, 4 * READY_CAP);
    let slow = joined(p, 1).pop().unwrap();
    slow.slow_ms.store(50, Ordering::Relaxed);
    wait_until("the members joined and left the list", || {
        members
            .iter()
            .chain([&slow])
            .all(|m| !m.listing.listed.load(Ordering::SeqCst))
    });
    slow.queue(p);
    wait_until("the slow turn started", || {
        slow.turns.load(Ordering::Relaxed) >= 2
    });
    for m in &members {
        m.queue(p);
    }
    assert!(
        p.0.overflow.load(Ordering::SeqCst)
            || members.iter().any(|m| m.done.load(Ordering::Acquire) > 0),
        "the queue did not overflow while the thread was away"
    );
    wait_until("every member's work done", || {
        members.iter().all(|m| m.done.load(Ordering::Acquire) == 1)
    });
    for m in members.iter().chain([&slow]) {
        m.stop.store(true, Ordering::Release);
        p.list(&m.listing);
    }
}

/// A connection joins without a ring unless the thread has no member: the first one wakes a
/// thread asleep for ever; the next ones are taken in at the thread's next wake-up (within
/// `MAX_SLEEP`), and work one of them queues before that is done at once (its ring wakes the
/// thread, which takes it in first).
#[test]
fn joining_wakes_the_thread_only_when_it_has_no_member() {
    let p = Poller(start().unwrap());
    let first = joined(p, 1).pop().unwrap();
    wait_until("the first member taken in", || {
        first.turns.load(Ordering::Relaxed) >= 1
    });
    wait_until("the thread asleep with a timeout", || {
        !p.0.sleeps_unbounded.load(Ordering::SeqCst)
    });
    let later = joined(p, 50);
    wait_until("the later members taken in without a ring", || {
        later.iter().all(|m| m.turns.load(Ordering::Relaxed) >= 1)
    });
    // Joins, then queues work at once: the work is not left for the next timeout.
    let eager = joined(p, 1).pop().unwrap();
    eager.queue(p);
    wait_until("the new member's work done", || {
        eager.done.load(Ordering::Acquire) == 1
    });
    for m in later.iter().chain([&first, &eager]) {
        m.stop.store(true, Ordering::Release);
        p.list(&m.listing);
    }
}
