//! The process's poller thread (`ClientPoller::Thread`): one thread drives every such
//! connection of the process, so a process with a thousand channels has one poller, not a
//! thousand.
//!
//! ```text
//! connections join ──> [ turn every member ] ── work? ──> again (spin)
//!                              │ idle (Spinner says sleep)
//!                              v
//!        doorbell flag up, each member arms its CQ and looks once more
//!                              │ nothing
//!                              v
//!        epoll_wait: the shared doorbell + every member's completion channel
//! ```
//!
//! Members share one doorbell (submitters ring it only while the thread sleeps); each keeps
//! its own completion channel, registered with the thread's epoll set when it joins and
//! removed when it stops. The thread starts with the first member and lives as long as the
//! process (asleep, without a timeout, while it has no member); a child forked after it
//! started gets its own with its first member.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;
use rustix::event::epoll;
use tracing::warn;

use crate::poll_policy::{Budget, Spinner, Wait};
use crate::server::notify::Doorbell;

/// How the thread waits while idle: spins, then sleeps (it has the doorbell and the
/// channels to sleep on); briefly when the host is contended.
const POLLER: Budget = Budget::adaptive(20_000, 0);

/// The longest sleep while it has members (their protocol timers are looked at after it).
pub(super) const MAX_SLEEP: Duration = Duration::from_millis(20);

/// Idle members are turned once in this many sweeps (and before each sleep).
const IDLE_EVERY: u32 = 64;

/// The epoll data of the doorbell (members use their slab key).
const DOORBELL: u64 = u64::MAX;

/// A connection driven by the process's poller thread.
pub(crate) trait Member: Send + Sync {
    /// Drives the connection once; the work done.
    fn turn(&self) -> usize;
    /// Whether a caller drives it for now: the thread neither turns it nor arms its CQ
    /// (the caller rings the doorbell when it gives it back with work left).
    fn driven(&self) -> bool;
    /// Whether it has calls in flight or work queued: it is turned at every sweep, the others
    /// every [`IDLE_EVERY`] sweeps (what reaches an idle connection, such as a credit
    /// reclaim, waits that long) and before the thread sleeps.
    fn busy(&self) -> bool;
    /// Whether the connection's last handle is gone: it leaves the thread.
    fn stopped(&self) -> bool;
    /// Gets ready to sleep (the doorbell flag is up): arms the CQ and looks once more.
    /// `None` when work came meanwhile, else the longest the connection may sleep.
    fn prepare_sleep(&self, max: Duration) -> Option<Duration>;
    /// After a sleep its completion channel woke: clears it.
    fn woke(&self);
    /// Runs `f` with its completion channel's descriptor (for the epoll set).
    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>));
}

/// A member as the thread keeps it.
struct Entry {
    m: Arc<dyn Member>,
    /// Its CQ was armed before a sleep and has not fired since (an armed CQ stays armed
    /// until its next completion): an idle member needs no new arming, and no second look,
    /// before the next sleep. (Its protocol timers wait for a turn: at most [`MAX_SLEEP`]
    /// plus [`IDLE_EVERY`] sweeps.)
    armed: bool,
}

struct Group {
    doorbell: Arc<Doorbell>,
    joining: SegQueue<Arc<dyn Member>>,
}

/// The process's group, with the process id that started its thread: a child forked after
/// that has no such thread and starts its own. (A failure to start is not kept: the next
/// channel tries again.)
static GROUP: Mutex<Option<(u32, &'static Group)>> = Mutex::new(None);

/// The process's poller: its doorbell (the connection rings it) and a way in.
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

    /// Hands `m` to the thread, which drives it until it stops.
    pub(crate) fn join(&self, m: Arc<dyn Member>) {
        self.0.joining.push(m);
        self.0.doorbell.ring_always();
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
        joining: SegQueue::new(),
    }));
    std::thread::Builder::new()
        .name("rpc-client-poller".into())
        .spawn(move || run(group, ep))
        .map_err(|e| format!("spawn: {e}"))?;
    Ok(group)
}

fn run(g: &Group, ep: OwnedFd) {
    let mut members: slab::Slab<Entry> = slab::Slab::new();
    let mut events = [MaybeUninit::<epoll::Event>::uninit(); 64];
    let mut spin = Spinner::new();
    let mut sweeps = 0u32;
    // The thread has just woken from a sleep: if its first sweep finds nothing to do (a CQ
    // armed before its connection's caller began to drive it fired; a timeout), it sleeps
    // again at once instead of spinning a full budget beside the threads that have work.
    let mut woke = false;
    loop {
        while let Some(m) = g.joining.pop() {
            let key = members.insert(Entry { m, armed: false });
            members[key].m.with_channel_fd(&mut |fd| {
                if let Err(e) = epoll::add(
                    &ep,
                    fd,
                    epoll::EventData::new_u64(key as u64),
                    epoll::EventFlags::IN,
                ) {
                    // It is still driven; its completions are seen at the next turn.
                    warn!("client poller: epoll_ctl(ADD) of a completion channel: {e}");
                }
            });
        }
        let mut work = 0;
        let mut gone = Vec::new();
        sweeps = sweeps.wrapping_add(1);
        let all = sweeps.is_multiple_of(IDLE_EVERY);
        for (key, Entry { m, .. }) in members.iter() {
            if m.stopped() {
                gone.push(key);
            } else if (all || m.busy()) && !m.driven() {
                work += m.turn();
            }
        }
        for key in gone {
            let Entry { m, .. } = members.remove(key);
            m.with_channel_fd(&mut |fd| {
                let _ = epoll::delete(&ep, fd);
            });
        }
        if work > 0 {
            spin.work();
            woke = false;
            continue;
        }
        // An idle sweep counts one idle turn per member: the spin budget is about time, and
        // a sweep over many connections takes as long as as many turns over one.
        let mut wait = if std::mem::take(&mut woke) {
            Wait::Sleep
        } else {
            Wait::Spin
        };
        for _ in 0..members.len().max(1) {
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
                let mut timeout = Some(MAX_SLEEP);
                if members.is_empty() {
                    timeout = None;
                }
                let mut ready = g.joining.is_empty();
                for (_, e) in members.iter_mut() {
                    if !ready {
                        break;
                    }
                    if (e.armed && !e.m.busy()) || e.m.driven() {
                        // Its CQ is armed since the last sleep and nothing is queued, or a
                        // caller drives it (and rings when it stops).
                        continue;
                    }
                    match e.m.prepare_sleep(MAX_SLEEP) {
                        Some(t) => {
                            e.armed = true;
                            timeout = timeout.map(|d| d.min(t));
                        }
                        None => ready = false,
                    }
                }
                if !ready {
                    g.doorbell.awake();
                    spin.work();
                    continue;
                }
                let started = Instant::now();
                let ts = timeout.map(|t| rustix::time::Timespec {
                    tv_sec: t.as_secs() as i64,
                    tv_nsec: i64::from(t.subsec_nanos()),
                });
                if let Ok((woke, _)) = epoll::wait(ep.as_fd(), &mut events, ts.as_ref()) {
                    for ev in woke.iter() {
                        let key = ev.data.u64();
                        if key != DOORBELL
                            && let Some(e) = members.get_mut(key as usize)
                        {
                            // Its CQ fired: armed no more.
                            e.armed = false;
                            e.m.woke();
                        }
                    }
                }
                g.doorbell.awake();
                spin.woke(started, timeout.unwrap_or(MAX_SLEEP), Instant::now());
                woke = true;
            }
        }
    }
}
