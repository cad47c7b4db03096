//! The process's poller thread (`ClientPoller::Thread`): one thread drives every such
//! connection of the process, so a process with a thousand channels has one poller, not a
//! thousand.
//!
//! ```text
//! connections join ──> [ turn every listed member ] ── work? ──> again (spin)
//!        ^ listed when it queues work     │ idle (Spinner says sleep)
//!        | (a key in `ready`)             v
//!        |          doorbell flag up, the listed and the unarmed members arm their CQs
//!        |          and look once more
//!        |                                │ nothing
//!        |                                v
//!        └── its CQ fired ── epoll_wait: the shared doorbell + every member's completion channel
//! ```
//!
//! A sweep costs the connections that have work, not all of them: a member is *listed* while
//! it has calls in flight or work queued. Whoever queues work on a connection that is not
//! listed pushes its key on the group's `ready` queue (once: a flag says it is listed); the
//! thread takes a member off the list when a turn leaves it idle, clearing the flag and then
//! looking once more, so that work queued meanwhile is never left unseen (the queuer either
//! sees the flag down and lists it, or the thread's last look sees its work). An idle member
//! is reached by its completion channel: its CQ is armed before the thread sleeps, or within
//! [`IDLE_CHECK`] while it does not (members not armed since they last had work are kept in
//! a short list for that), and while it does not sleep the thread looks at the channels
//! that fired every [`IDLE_CHECK`]. Once a second ([`FULL_EVERY`]) every member is turned,
//! whatever it said.
//!
//! Members share one doorbell (submitters ring it only while the thread sleeps; a joining
//! connection only when the thread has no member, see [`Poller::join`]); each keeps its own
//! completion channel, registered with the thread's epoll set when it is taken in and removed
//! when it stops. The thread starts with the first member and lives as long as the
//! process (asleep, without a timeout, while it has no member); a child forked after it
//! started gets its own with its first member.

use crate::queue::PopIfAny;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crossbeam_queue::{ArrayQueue, SegQueue};
use rustix::event::epoll;
use tracing::warn;

use crate::doorbell::Doorbell;
use crate::poll_policy::{Budget, Spinner, Wait};

/// How the thread waits while idle: spins, then sleeps (it has the doorbell and the
/// channels to sleep on); briefly when the host is contended.
const POLLER: Budget = Budget::adaptive(20_000, 0);

/// The longest sleep while it has members (their protocol timers are looked at after it).
pub(super) const MAX_SLEEP: Duration = Duration::from_millis(20);

/// Every this many sweeps the thread reads the clock, and every [`IDLE_CHECK`] it looks,
/// without sleeping, for idle members whose completion channel fired, and arms the CQs of
/// the idle members not armed since they last had work.
const IDLE_EVERY: u32 = 64;

/// How long what reaches an idle member (a server's GoAway, a credit reclaim) may wait while
/// the thread spins for others.
const IDLE_CHECK: Duration = Duration::from_millis(1);

/// Every member is turned at least this often, listed or not (a safety net: nothing is
/// known to need it).
const FULL_EVERY: Duration = Duration::from_secs(1);

/// Members listed at once without a sweep in between, at most; more set `overflow`, and the
/// thread then looks at every member. (Small in unit tests, so that they overflow it.)
const READY_CAP: usize = if cfg!(test) { 64 } else { 4096 };

/// The epoll data of the doorbell (members use their slab key).
const DOORBELL: u64 = u64::MAX;

/// The epoll data of a shared CQ's channel: this bit and its key among the sources.
const SOURCE: u64 = 1 << 62;

/// A connection driven by the process's poller thread.
pub(crate) trait Member: Send + Sync {
    /// Drives the connection once; the work done.
    fn turn(&self) -> usize;
    /// Whether a caller drives it for now: the thread neither turns it nor arms its CQ
    /// (the caller rings the doorbell when it gives it back with work left).
    fn driven(&self) -> bool;
    /// Whether it has calls in flight or work queued: it stays on the list (turned at every
    /// sweep) while it is; an idle one leaves it (what reaches it, such as a credit reclaim,
    /// comes through its completion channel, within [`IDLE_CHECK`] while the thread spins).
    fn busy(&self) -> bool;
    /// Whether the connection's last handle is gone: it leaves the thread.
    fn stopped(&self) -> bool;
    /// Gets ready to sleep (the doorbell flag is up): arms the CQ and looks once more.
    /// `None` when work came meanwhile, else the longest the connection may sleep and
    /// whether its CQ is armed (it is not when someone else held the driver this instant).
    fn prepare_sleep(&self, max: Duration) -> Option<(Duration, bool)>;
    /// After a sleep its completion channel woke: clears it.
    fn woke(&self);
    /// Runs `f` with its completion channel's descriptor (for the epoll set).
    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>));
    /// Its place on the thread's list.
    fn listing(&self) -> &Listing;
}

/// A CQ shared by members ([`super::hub`]): a listed member's turn polls it (routing what
/// it finds for the others), and the thread routes it for idle members when its channel
/// fires, within [`IDLE_CHECK`] while it spins, and before it sleeps.
pub(crate) trait Source: Send + Sync {
    /// Polls the CQ and hands each completion to its member (which is listed); how many.
    fn route_all(&self) -> usize;
    /// Gets ready to sleep: arms the CQ and routes once more (`needed`: members the thread
    /// drives have calls in flight). Whether nothing came.
    fn arm(&self, needed: bool) -> bool;
    /// After a sleep its completion channel woke: clears it.
    fn woke(&self);
    /// Runs `f` with its completion channel's descriptor (for the epoll set).
    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>));
}

/// What a member shares with the thread about the list: whether it is on it, and its key.
#[derive(Debug)]
pub(crate) struct Listing {
    listed: AtomicBool,
    key: AtomicUsize,
}

impl Listing {
    /// A member about to join: listed from the start (the thread turns it first), so nobody
    /// pushes it on `ready` before it has a key.
    pub(crate) fn new() -> Listing {
        Listing {
            listed: AtomicBool::new(true),
            key: AtomicUsize::new(usize::MAX),
        }
    }
}

/// A member as the thread keeps it.
struct Entry {
    m: Arc<dyn Member>,
    /// Its CQ was armed before a sleep and has not fired since (an armed CQ stays armed
    /// until its next completion): an idle member needs no new arming, and no second look,
    /// before the next sleep. (An idle member's protocol timers wait for a turn: at most
    /// [`FULL_EVERY`].)
    armed: bool,
    /// It is in the thread's `active` list (turned at every sweep).
    active: bool,
    /// It is in the thread's `unarmed` list (armed before the next sleep).
    unarmed: bool,
}

struct Group {
    doorbell: Arc<Doorbell>,
    /// The thread's epoll set (a shared CQ takes its channel out when it goes).
    ep: OwnedFd,
    joining: SegQueue<Arc<dyn Member>>,
    /// Shared CQs to take in.
    sources: SegQueue<Weak<dyn Source>>,
    /// The thread's next sleep has no timeout (it has no member): a joining connection rings
    /// the doorbell. Otherwise it is taken in at the next wake-up, within [`MAX_SLEEP`].
    sleeps_unbounded: AtomicBool,
    /// Keys of members that queued work while not listed.
    ready: ArrayQueue<usize>,
    /// `ready` was full: the thread lists every member once.
    overflow: AtomicBool,
}

/// The process's group, with the process id that started its thread: a child forked after
/// that has no such thread and starts its own. (A failure to start is not kept: the next
/// channel tries again.)
static GROUP: Mutex<Option<(u32, &'static Group)>> = Mutex::new(None);

/// The process's poller: its doorbell (the connection rings it) and a way in.
#[derive(Clone, Copy)]
pub(crate) struct Poller(&'static Group);

impl Poller {
    /// The process's poller thread, started on first use (once per connect: a lock and a
    /// process-id read, off the call path).
    pub(crate) fn get() -> std::io::Result<Poller> {
        let pid = std::process::id();
        let mut g = GROUP
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((owner, group)) = *g
            && owner == pid
        {
            return Ok(Poller(group));
        }
        let group = start().map_err(|e| {
            std::io::Error::other(format!(
                "the process's client poller thread could not start: {e}"
            ))
        })?;
        *g = Some((pid, group));
        Ok(Poller(group))
    }

    /// The doorbell members ring when they queue work.
    pub(crate) fn doorbell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.0.doorbell)
    }

    /// Hands `m` to the thread, which drives it until it stops. The thread is rung only when
    /// it would sleep for ever: a connection that joins a thread with members is taken in
    /// at its next wake-up (at most [`MAX_SLEEP`] away, sooner when a member has work), which
    /// spares a connect the thread's wake-up. Until then the new connection is driven by its
    /// callers (a blocking call, a lone async call) or rings the doorbell itself when it
    /// hands work over; only what reaches it unasked (a GoAway) waits that long.
    pub(crate) fn join(&self, m: Arc<dyn Member>) {
        self.0.joining.push(m);
        // SeqCst against the thread's store before it looks at `joining` one last time: it
        // sees this member, or this load sees its flag.
        if self.0.sleeps_unbounded.load(Ordering::SeqCst) {
            self.0.doorbell.ring_always();
        }
    }

    /// Hands a shared CQ to the thread, which routes it and sleeps on its channel for as long
    /// as its connections hold it (the thread holds it only while it looks at it: it goes
    /// with its last connection, as a connection's own CQ does). The thread is rung (it may
    /// sleep without a timeout).
    pub(crate) fn add_source(&self, s: Weak<dyn Source>) {
        self.0.sources.push(s);
        self.0.doorbell.ring_always();
    }

    /// A shared CQ goes: its channel leaves the epoll set (before it is closed: the server
    /// holds a duplicate of it, so closing ours would not take it out).
    pub(crate) fn forget_source(&self, fd: std::os::fd::BorrowedFd<'_>) {
        let _ = epoll::delete(&self.0.ep, fd);
    }

    /// A member queued work (before this call): lists it if it is not listed. No allocation
    /// or lock: a fence and a load when it is listed already, a swap and a bounded push when
    /// it is not.
    pub(crate) fn list(&self, l: &Listing) {
        // SeqCst against the thread's unlisting: the work queued before this fence is seen
        // by the thread's last look, or the flag it cleared is seen here.
        fence(Ordering::SeqCst);
        if l.listed.load(Ordering::Relaxed) || l.listed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.0.ready.push(l.key.load(Ordering::Acquire)).is_err() {
            self.0.overflow.store(true, Ordering::SeqCst);
        }
    }
}

/// Makes a group and starts its thread (the group lives as long as the process).
fn start() -> Result<&'static Group, String> {
    let doorbell = Doorbell::new().map_err(|e| format!("eventfd: {e}"))?;
    let ep =
        epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| format!("epoll_create: {e}"))?;
    epoll::add(
        &ep,
        doorbell.fd(),
        epoll::EventData::new_u64(DOORBELL),
        epoll::EventFlags::IN,
    )
    .map_err(|e| format!("epoll_ctl(ADD, doorbell): {e}"))?;
    let group: &'static Group = Box::leak(Box::new(Group {
        doorbell,
        ep,
        joining: SegQueue::new(),
        sources: SegQueue::new(),
        sleeps_unbounded: AtomicBool::new(true),
        ready: ArrayQueue::new(READY_CAP),
        overflow: AtomicBool::new(false),
    }));
    std::thread::Builder::new()
        .name("rpc-client-poller".into())
        .spawn(move || run(group))
        .map_err(|e| format!("spawn: {e}"))?;
    Ok(group)
}

/// The thread's view of its members.
struct Members {
    all: slab::Slab<Entry>,
    /// Listed members (turned at every sweep).
    active: Vec<usize>,
    /// Members not listed whose CQ is not armed (armed before the next sleep, or at the next
    /// [`IDLE_CHECK`]). May hold stale keys: `Entry::unarmed` says.
    unarmed: Vec<usize>,
}

impl Members {
    fn activate(&mut self, key: usize) {
        if let Some(e) = self.all.get_mut(key)
            && !e.active
        {
            e.active = true;
            self.active.push(key);
        }
    }

    /// Takes a member that is idle after its turn off the list, unless work came (see the
    /// module docs). Whether it left.
    fn unlist(&mut self, key: usize) -> bool {
        let e = &mut self.all[key];
        let l = e.m.listing();
        l.listed.store(false, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if e.m.busy() {
            // Work came: it stays (a queuer that saw the flag down pushed its key too; that
            // copy finds it active and is dropped).
            l.listed.store(true, Ordering::SeqCst);
            return false;
        }
        e.active = false;
        if !e.armed && !e.unarmed {
            e.unarmed = true;
            self.unarmed.push(key);
        }
        true
    }

    /// Turns every listed member once (idle ones leave the list); the work done. Members
    /// that stopped leave the thread.
    fn sweep(&mut self, ep: &OwnedFd) -> usize {
        let mut work = 0;
        let mut i = 0;
        while i < self.active.len() {
            let key = self.active[i];
            let m = &self.all[key].m;
            if m.stopped() {
                self.active.swap_remove(i);
                let e = self.all.remove(key);
                e.m.with_channel_fd(&mut |fd| {
                    let _ = epoll::delete(ep, fd);
                });
                continue;
            }
            if !m.driven() {
                work += m.turn();
            }
            if !m.busy() && self.unlist(key) {
                self.active.swap_remove(i);
            } else {
                i += 1;
            }
        }
        work
    }

    /// Arms the CQs of the idle members not armed since they last had work (they look once
    /// more as they do), shortening `timeout` to theirs. Those that found work are listed.
    /// Whether none did.
    fn arm_unarmed(&mut self, timeout: &mut Option<Duration>) -> bool {
        let mut quiet = true;
        let mut i = 0;
        while i < self.unarmed.len() {
            let key = self.unarmed[i];
            match self.all.get_mut(key) {
                Some(e) if e.unarmed && !e.active => {
                    if e.m.driven() {
                        i += 1;
                        continue;
                    }
                    match e.m.prepare_sleep(MAX_SLEEP) {
                        Some((t, true)) => {
                            *timeout = timeout.map(|d| d.min(t));
                            e.armed = true;
                            e.unarmed = false;
                        }
                        Some((t, false)) => {
                            // Someone held its driver: it stays for the next time.
                            *timeout = timeout.map(|d| d.min(t));
                            i += 1;
                            continue;
                        }
                        None => {
                            quiet = false;
                            e.unarmed = false;
                            e.m.listing().listed.store(true, Ordering::SeqCst);
                            self.activate(key);
                        }
                    }
                }
                Some(e) if e.active => {
                    // Listed again: armed with the listed ones.
                    e.unarmed = false;
                }
                _ => {}
            }
            self.unarmed.swap_remove(i);
        }
        quiet
    }

    /// Whether a listed member the thread drives has work (calls in flight).
    fn busy_undriven(&self) -> bool {
        self.active.iter().any(|&k| {
            let m = &self.all[k].m;
            !m.driven() && m.busy()
        })
    }

    /// Lists every member (after `ready` overflowed, and every [`FULL_EVERY`]). No
    /// allocation: the keys are walked up to the slab's capacity.
    fn list_all(&mut self) {
        for key in 0..self.all.capacity() {
            if let Some(e) = self.all.get(key) {
                e.m.listing().listed.store(true, Ordering::SeqCst);
                self.activate(key);
            }
        }
    }

    /// A member's completion channel fired: its CQ is armed no more; it is listed.
    fn fired(&mut self, key: usize) {
        if let Some(e) = self.all.get_mut(key) {
            e.armed = false;
            e.m.woke();
            e.m.listing().listed.store(true, Ordering::SeqCst);
            self.activate(key);
        }
    }

    /// Gets every member that may need it ready for a sleep: the listed ones and the unarmed
    /// ones arm their CQs and look once more. `None` when work came, else the timeout.
    fn prepare_sleep(&mut self, mut timeout: Option<Duration>) -> Option<Option<Duration>> {
        for &key in &self.active {
            let e = &mut self.all[key];
            if (e.armed && !e.m.busy()) || e.m.driven() {
                // Its CQ is armed since the last sleep and nothing is queued, or a caller
                // drives it (and rings when it stops).
                continue;
            }
            let (t, armed) = e.m.prepare_sleep(MAX_SLEEP)?;
            e.armed = armed;
            timeout = timeout.map(|d| d.min(t));
        }
        self.arm_unarmed(&mut timeout).then_some(timeout)
    }
}

fn run(g: &Group) {
    let ep = &g.ep;
    let mut members = Members {
        all: slab::Slab::new(),
        active: Vec::new(),
        unarmed: Vec::new(),
    };
    let mut sources: slab::Slab<Weak<dyn Source>> = slab::Slab::new();
    let mut events = [MaybeUninit::<epoll::Event>::uninit(); 64];
    let mut spin = Spinner::new();
    let mut sweeps = 0u32;
    let mut full_at = Instant::now();
    let mut idle_at = Instant::now();
    // The thread has just woken from a sleep: if its first sweep finds nothing to do (a CQ
    // armed before its connection's caller began to drive it fired; a timeout), it sleeps
    // again at once instead of spinning a full budget beside the threads that have work.
    let mut woke = false;
    loop {
        spin.before_turn(Instant::now);
        while let Some(m) = g.joining.pop_if_any() {
            let key = members.all.insert(Entry {
                m,
                armed: false,
                active: false,
                unarmed: false,
            });
            let m = Arc::clone(&members.all[key].m);
            m.listing().key.store(key, Ordering::Release);
            m.with_channel_fd(&mut |fd| {
                if let Err(e) = epoll::add(
                    ep,
                    fd,
                    epoll::EventData::new_u64(key as u64),
                    epoll::EventFlags::IN,
                ) {
                    // It is still driven; its completions are seen at its turns (the full
                    // sweep's, at least).
                    warn!("client poller: epoll_ctl(ADD) of a completion channel: {e}");
                }
            });
            // Room for every member in both lists, so that turns never allocate.
            let n = members.all.len();
            members
                .active
                .reserve(n.saturating_sub(members.active.len()));
            members
                .unarmed
                .reserve(n.saturating_sub(members.unarmed.len()));
            members.activate(key);
        }
        while let Some(s) = g.sources.pop_if_any() {
            let Some(live) = s.upgrade() else {
                continue;
            };
            let key = sources.insert(s);
            live.with_channel_fd(&mut |fd| {
                if let Err(e) = epoll::add(
                    ep,
                    fd,
                    epoll::EventData::new_u64(SOURCE | key as u64),
                    epoll::EventFlags::IN,
                ) {
                    warn!("client poller: epoll_ctl(ADD) of a shared CQ's channel: {e}");
                }
            });
        }
        let mut work = 0;
        while let Some(key) = g.ready.pop_if_any() {
            members.activate(key);
        }
        sweeps = sweeps.wrapping_add(1);
        if g.overflow.load(Ordering::Relaxed) && g.overflow.swap(false, Ordering::SeqCst) {
            members.list_all();
        }
        if sweeps.is_multiple_of(IDLE_EVERY) && idle_at.elapsed() >= IDLE_CHECK {
            idle_at = Instant::now();
            // Channels that fired while the thread did not sleep, and the unarmed members.
            let zero = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            if let Ok((fired, _)) = epoll::wait(ep.as_fd(), &mut events, Some(&zero)) {
                for ev in fired.iter() {
                    fired_one(ev.data.u64(), &mut members, &sources);
                }
            }
            if !members.arm_unarmed(&mut None) {
                work += 1;
            }
            // What came on the shared CQs for idle members (a listed member's turn polls its
            // CQ itself, routing the others', and a caller driving its own connection does).
            for (_, s) in &sources {
                if let Some(s) = s.upgrade() {
                    work += s.route_all();
                }
            }
            if full_at.elapsed() >= FULL_EVERY {
                full_at = Instant::now();
                members.list_all();
                // The shared CQs gone with their connections leave (each took its channel
                // out of the epoll set as it went).
                sources.retain(|_, s| s.strong_count() > 0);
            }
        }
        work += members.sweep(ep);
        if work > 0 {
            spin.work();
            woke = false;
            continue;
        }
        // An idle sweep counts one idle turn per listed member: the spin budget is about
        // time, and a sweep over many connections takes as long as as many turns over one.
        let mut wait = if std::mem::take(&mut woke) {
            Wait::Sleep
        } else {
            Wait::Spin
        };
        for _ in 0..members.active.len().max(1) {
            if wait == Wait::Sleep {
                break;
            }
            wait = spin.idle(&POLLER, Instant::now);
            if !matches!(wait, Wait::Spin) {
                break;
            }
        }
        match wait {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::Sleep => {
                g.doorbell.prepare_sleep();
                let timeout = if members.all.is_empty() {
                    None
                } else {
                    Some(MAX_SLEEP)
                };
                g.sleeps_unbounded
                    .store(timeout.is_none(), Ordering::SeqCst);
                let timeout = if g.joining.is_empty()
                    && g.sources.is_empty()
                    && g.ready.is_empty()
                    && !g.overflow.load(Ordering::SeqCst)
                    && {
                        let needed = members.busy_undriven();
                        sources
                            .iter()
                            .all(|(_, s)| s.upgrade().is_none_or(|s| s.arm(needed)))
                    } {
                    members.prepare_sleep(timeout)
                } else {
                    None
                };
                let Some(timeout) = timeout else {
                    g.doorbell.awake();
                    spin.work();
                    continue;
                };
                let started = Instant::now();
                let ts = timeout.map(|t| rustix::time::Timespec {
                    tv_sec: t.as_secs() as i64,
                    tv_nsec: i64::from(t.subsec_nanos()),
                });
                if let Ok((fired, _)) = epoll::wait(ep.as_fd(), &mut events, ts.as_ref()) {
                    for ev in fired.iter() {
                        fired_one(ev.data.u64(), &mut members, &sources);
                    }
                }
                g.doorbell.awake();
                spin.woke(started, timeout.unwrap_or(MAX_SLEEP), Instant::now());
                woke = true;
            }
        }
    }
}

/// What an epoll event names: a shared CQ's channel, a member's, or the doorbell.
fn fired_one(data: u64, members: &mut Members, sources: &slab::Slab<Weak<dyn Source>>) {
    if data == DOORBELL {
        return;
    }
    if data & SOURCE != 0 {
        if let Some(s) = sources
            .get((data & !SOURCE) as usize)
            .and_then(Weak::upgrade)
        {
            s.woke();
            // Its members get their completions (and are listed).
            s.route_all();
        }
        return;
    }
    members.fired(data as usize);
}

#[cfg(test)]
#[path = "group_tests.rs"]
mod tests;
