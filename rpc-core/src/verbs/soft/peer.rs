//! Peers: another soft RNIC instance (in this or another process) whose segments we mapped,
//! and the watchdog that notices when a peer process dies.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use super::channel::ChannelInner;
use super::layout::{self, hdr};
use super::populate;
use super::shm::{self, EventFd, Mapping};
use super::{Device, ErrorKind, Result, Verb, VerbsError};

/// Whether a peer process is alive, as the watchdog last saw it.
#[derive(Debug)]
pub(crate) struct Liveness {
    /// `None` for this very process, which is alive for as long as anyone here can ask (and
    /// whose descriptors are duplicated directly: no `pidfd_open`, which some kernels and
    /// valgrind lack, and no descriptor held for it).
    pidfd: Option<OwnedFd>,
    /// Set once, when the process exited (or a test hook pretends it did).
    pub(crate) dead: AtomicBool,
}

impl Liveness {
    /// The liveness of process `pid`: the handle the device already holds for it (one pidfd
    /// per peer process, however many connections it opens), or a new one (`true`: the
    /// caller has the watchdog watch it).
    fn of(dev: &Device, pid: u32) -> Result<(Arc<Liveness>, bool)> {
        let mut lives = dev.lives.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = lives.get(&pid).and_then(Weak::upgrade)
            && !l.is_dead()
            && !l.exited()
        {
            return Ok((l, false));
        }
        lives.retain(|_, w| w.upgrade().is_some_and(|l| !l.is_dead()));
        if pid == dev.pid {
            let live = Arc::new(Liveness {
                pidfd: None,
                dead: AtomicBool::new(false),
            });
            lives.insert(pid, Arc::downgrade(&live));
            return Ok((live, false));
        }
        let pidfd = shm::pidfd_open(pid).map_err(|e| {
            if e.raw_os_error() == Some(libc::ESRCH) {
                bad_ep(format!(
                    "soft endpoint names process {pid}, which does not exist (the peer exited, \
                     or the endpoint is stale or forged)"
                ))
            } else {
                VerbsError::from_errno(
                    Verb::Connect,
                    e.raw_os_error().unwrap_or(libc::EIO),
                    format!("pidfd_open({pid}) failed: cannot reach the soft peer"),
                )
            }
        })?;
        let live = Arc::new(Liveness {
            pidfd: Some(pidfd),
            dead: AtomicBool::new(false),
        });
        lives.insert(pid, Arc::downgrade(&live));
        Ok((live, true))
    }

    /// Whether the process exited, asked now (its pidfd is readable), for a handle about to be
    /// shared: a process that exited and whose pid was reused must not lend its handle.
    fn exited(&self) -> bool {
        let Some(pidfd) = &self.pidfd else {
            return false;
        };
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(pidfd),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout; the descriptor is open while `self` lives.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        r != 0
    }

    /// Whether the peer is gone (one atomic load).
    #[inline]
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// A duplicate of descriptor `fd` of process `pid` (the process this names).
    fn dup_fd(&self, pid: u32, fd: u32) -> std::io::Result<OwnedFd> {
        match &self.pidfd {
            Some(pidfd) => shm::pidfd_getfd(pidfd.as_fd(), pid, fd),
            None => shm::dup_own(fd),
        }
    }
}

/// A soft RNIC instance we talk to: its segments mapped here, its regions mapped on demand.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) pid: u32,
    pub(crate) nonce: u64,
    /// The peer lives in this process (its user-memory regions are reachable directly).
    pub(crate) same_process: bool,
    pub(crate) live: Arc<Liveness>,
    /// The peer's published segment (read-only unless the peer is ourselves).
    pub(crate) pub_map: Arc<Mapping>,
    /// The peer's inbox (read-write).
    pub(crate) inbox: Arc<Mapping>,
    /// Mappings of the peer's shm regions by slot: (key, mapping).
    mrs: Mutex<HashMap<u32, (u32, Arc<Mapping>)>>,
    /// Duplicates of the peer's channel eventfds by descriptor number, the most recently
    /// signalled [`EVENTFD_CACHE`] of them (see [`Peer::signal_eventfd`]).
    efds: Mutex<EventFds>,
    /// The peer's shared receive rings already mapped in ([`Peer::populate_shared_ring`]), by
    /// their offsets.
    populated: Mutex<Vec<(usize, usize)>>,
}

/// Entries of a peer's shared receive queue mapped in while a QP of ours connects to it
/// ([`Peer::populate_shared_ring`]): 128 KiB of each ring of the default pool's SRQ, what
/// the next 4096 SENDs into it reach.
pub(crate) const POPULATE_AHEAD: u32 = 4096;

/// Where a peer's shared receive queue lies: its WQE ring (`depth` entries of `stride` bytes
/// at `wqe` in the published segment), its completion ring (`depth` entries of
/// [`layout::RCQE`] bytes at `cqe` in the inbox), and the entry the next SEND claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SharedRing {
    pub(crate) wqe: usize,
    pub(crate) stride: usize,
    pub(crate) cqe: usize,
    /// Entries in each ring (a power of two).
    pub(crate) depth: u32,
    /// The claim index (any lap).
    pub(crate) head: u32,
}

impl SharedRing {
    /// The entries in the order SENDs reach them, as runs (first entry, entries): up to
    /// [`POPULATE_AHEAD`] from the head on, not past the ring's end; the rest up to the end;
    /// the start of the ring up to the head. Runs may be empty.
    pub(crate) fn runs(&self) -> [(u32, u32); 3] {
        let first = self.head & (self.depth - 1);
        let now = POPULATE_AHEAD.min(self.depth - first);
        [
            (first, now),
            (first + now, self.depth - first - now),
            (0, first),
        ]
    }

    /// The bytes of `run` in each ring: ((WQE offset, length), (completion offset, length)).
    pub(crate) fn bytes(&self, (first, n): (u32, u32)) -> ((usize, usize), (usize, usize)) {
        let (first, n) = (first as usize, n as usize);
        (
            (self.wqe + first * self.stride, n * self.stride),
            (self.cqe + first * layout::RCQE, n * layout::RCQE),
        )
    }
}

/// Why mapping a peer's region failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapError {
    /// The region was deregistered meanwhile.
    Stale,
    /// The descriptor is gone, not a sealed memfd, or smaller than the region.
    Failed,
}

fn bad_ep(detail: String) -> VerbsError {
    VerbsError::new(Verb::Connect, ErrorKind::InvalidEndpoint, detail)
}

/// The error for a descriptor we could not take because this process has too many open: a
/// limit of ours, not a bad endpoint.
fn out_of_fds(e: &std::io::Error) -> Option<VerbsError> {
    let errno = e.raw_os_error()?;
    (errno == libc::EMFILE || errno == libc::ENFILE).then(|| {
        VerbsError::from_errno(
            Verb::Connect,
            errno,
            "out of file descriptors while mapping a soft peer: raise RLIMIT_NOFILE (ulimit -n) \
             or hold fewer connections",
        )
    })
}

impl Peer {
    /// Finds, maps and validates the soft RNIC named by (`pid`, `fd`, `nonce`).
    pub(crate) fn attach(dev: &Arc<Device>, pid: u32, fd: u32, nonce: u64) -> Result<Peer> {
        if nonce == dev.nonce && (pid != dev.pid || fd != dev.pub_fd_num()) {
            return Err(bad_ep(format!(
                "the endpoint carries this soft RNIC's nonce with another process or descriptor \
                 ({pid}/{fd}): it is forged"
            )));
        }
        let same_process = pid == dev.pid;
        let (live, fresh) = Liveness::of(dev, pid)?;

        if nonce == dev.nonce {
            // Loopback within one context: our own segments.
            return Ok(Peer {
                pid,
                nonce,
                same_process,
                live,
                pub_map: dev.pub_map.clone(),
                inbox: dev.inbox.clone(),
                mrs: Mutex::new(HashMap::new()),
                efds: Mutex::new(EventFds::default()),
                populated: Mutex::new(Vec::new()),
            });
        }

        let pub_fd = live.dup_fd(pid, fd).map_err(|e| {
            out_of_fds(&e).unwrap_or_else(|| {
                bad_ep(format!(
                    "process {pid} has no soft RNIC control segment at descriptor {fd} ({e}): \
                     the endpoint is stale or forged"
                ))
            })
        })?;
        let size = shm::file_size(pub_fd.as_fd()).unwrap_or(0);
        if size < layout::PUB_LEN as u64
            || shm::seals(pub_fd.as_fd()).unwrap_or(0) & libc::F_SEAL_SHRINK == 0
        {
            return Err(bad_ep(format!(
                "descriptor {fd} of process {pid} is not a soft RNIC control segment: the \
                 endpoint is stale or forged"
            )));
        }
        let pub_map = Mapping::map(pub_fd.as_fd(), layout::PUB_LEN, false).map_err(|e| {
            VerbsError::from_errno(
                Verb::Connect,
                e.raw_os_error().unwrap_or(libc::EIO),
                "cannot map the soft peer's control segment",
            )
        })?;
        let rd64 = |m: &Mapping, off| m.u64_at(off).map_or(0, |w| w.load(Ordering::Acquire));
        let rd32 = |m: &Mapping, off| m.u32_at(off).map_or(0, |w| w.load(Ordering::Acquire));
        if rd64(&pub_map, hdr::MAGIC) != layout::MAGIC {
            return Err(bad_ep(format!(
                "descriptor {fd} of process {pid} is not a soft RNIC control segment (bad magic): \
                 the endpoint is stale or forged"
            )));
        }
        if rd32(&pub_map, hdr::VERSION) != layout::VERSION {
            return Err(bad_ep(format!(
                "the soft RNIC of process {pid} has layout version {}, we have {}: mixed builds",
                rd32(&pub_map, hdr::VERSION),
                layout::VERSION
            )));
        }
        if rd64(&pub_map, hdr::NONCE) != nonce || rd32(&pub_map, hdr::PID) != pid {
            return Err(bad_ep(format!(
                "soft RNIC nonce mismatch in process {pid}: the instance the endpoint names no \
                 longer exists (stale endpoint) or the endpoint is forged"
            )));
        }
        let in_fd_num = rd32(&pub_map, hdr::INBOX_FD);
        let in_fd = live.dup_fd(pid, in_fd_num).map_err(|e| {
            out_of_fds(&e).unwrap_or_else(|| {
                bad_ep(format!(
                    "cannot reach the inbox of the soft RNIC in process {pid} ({e})"
                ))
            })
        })?;
        if shm::file_size(in_fd.as_fd()).unwrap_or(0) < layout::INBOX_LEN as u64
            || shm::seals(in_fd.as_fd()).unwrap_or(0) & libc::F_SEAL_SHRINK == 0
        {
            return Err(bad_ep(format!(
                "the soft RNIC of process {pid} has a bad inbox segment"
            )));
        }
        let inbox = Mapping::map(in_fd.as_fd(), layout::INBOX_LEN, true).map_err(|e| {
            VerbsError::from_errno(
                Verb::Connect,
                e.raw_os_error().unwrap_or(libc::EIO),
                "cannot map the soft peer's inbox",
            )
        })?;
        if rd64(&inbox, 0) != layout::MAGIC || rd64(&inbox, layout::IN_NONCE) != nonce {
            return Err(bad_ep(format!(
                "the inbox of the soft RNIC in process {pid} does not match its control segment"
            )));
        }
        if fresh && !same_process {
            dev.watchdog.watch(live.clone());
        }
        Ok(Peer {
            pid,
            nonce,
            same_process,
            live,
            pub_map: Arc::new(pub_map),
            inbox: Arc::new(inbox),
            mrs: Mutex::new(HashMap::new()),
            efds: Mutex::new(EventFds::default()),
            populated: Mutex::new(Vec::new()),
        })
    }

    /// Maps in, once per ring, the pages of a shared receive queue of the peer that a QP of
    /// ours connects to: its WQE ring in the published segment and its completion ring in the
    /// inbox ([`SharedRing`]). An SRQ's rings span megabytes, and our SENDs walk all of them
    /// before they wrap: unmapped, every few hundred SENDs would take a page fault. Mapping
    /// both rings whole takes about half a millisecond of CPU, so the connect maps only the
    /// [`POPULATE_AHEAD`] entries from the queue's claim position on (where our first SENDs
    /// land) and queues the rest, nearest pages first, for a helper thread at the lowest
    /// priority ([`populate`]). (An offset reused by a later SRQ is not done again: a hint
    /// only.)
    pub(crate) fn populate_shared_ring(&self, ring: &SharedRing) {
        {
            let mut done = self.populated.lock().unwrap_or_else(|e| e.into_inner());
            if done.contains(&(ring.wqe, ring.cqe)) {
                return;
            }
            if done.len() >= 64 {
                done.clear();
            }
            done.push((ring.wqe, ring.cqe));
        }
        let [now, later @ ..] = ring.runs();
        let (w, c) = ring.bytes(now);
        self.pub_map.populate(w.0, w.1);
        self.inbox.populate(c.0, c.1);
        for run in later.into_iter().filter(|r| r.1 > 0) {
            let (w, c) = ring.bytes(run);
            populate::later(&self.pub_map, w.0, w.1);
            populate::later(&self.inbox, c.0, c.1);
        }
    }

    /// The mapping of the peer's shm region in `slot` with key `key`, whose owner-side
    /// descriptor is `fd` and length `len`. Slow path (first access): maps and caches.
    pub(crate) fn map_mr(
        &self,
        slot: u32,
        key: u32,
        fd: u32,
        len: u64,
    ) -> std::result::Result<Arc<Mapping>, MapError> {
        let mut mrs = self.mrs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, m)) = mrs.get(&slot)
            && *k == key
        {
            return Ok(m.clone());
        }
        let len = usize::try_from(len).map_err(|_| MapError::Failed)?;
        let dup = self
            .live
            .dup_fd(self.pid, fd)
            .map_err(|_| MapError::Failed)?;
        // The key still being current after we got the descriptor proves the descriptor was
        // still the region's: the owner clears the key before it closes the memfd.
        let key_word = self
            .pub_map
            .u32_at(layout::mr_entry(slot as usize) + layout::mr::KEY)
            .ok_or(MapError::Failed)?;
        if key_word.load(Ordering::SeqCst) != key {
            return Err(MapError::Stale);
        }
        // A region whose file could shrink could make our copies fault (SIGBUS): require the
        // seal and a size covering the region.
        let sealed = shm::seals(dup.as_fd()).unwrap_or(0) & libc::F_SEAL_SHRINK != 0;
        let size = shm::file_size(dup.as_fd()).unwrap_or(0);
        if !sealed || size < len as u64 {
            return Err(MapError::Failed);
        }
        let m = Arc::new(Mapping::map(dup.as_fd(), len, true).map_err(|_| MapError::Failed)?);
        mrs.insert(slot, (key, m.clone()));
        Ok(m)
    }

    /// Whether the peer's descriptor `fd` is an eventfd we can reach (a completion channel).
    /// A connection of ours that will signal it holds the duplicate until
    /// [`Peer::release_eventfd`]. Setup path.
    pub(crate) fn hold_eventfd(&self, fd: u32, id: u32) -> bool {
        let mut efds = self.efds.lock().unwrap_or_else(|e| e.into_inner());
        efds.hold(fd, id, || self.dup_eventfd(fd))
    }

    /// A connection of ours that held the peer's channel `fd` ended: the duplicate is closed
    /// with its last holder, so a client that reconnects again and again leaves none behind.
    pub(crate) fn release_eventfd(&self, fd: u32, id: u32) {
        let mut efds = self.efds.lock().unwrap_or_else(|e| e.into_inner());
        efds.release(fd, id);
    }

    /// Wakes the peer's completion channel `fd` (its armed CQ got a completion). The
    /// duplicates are cached, the most recently signalled [`EVENTFD_CACHE`] per peer, so a
    /// server with thousands of clients' channels holds a bounded number of descriptors; a
    /// miss takes a new duplicate (two system calls more, on a path that already makes one to
    /// wake a sleeper).
    pub(crate) fn signal_eventfd(&self, fd: u32, id: u32) {
        let mut efds = self.efds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dup) = efds.get(fd, id, || self.dup_eventfd(fd)) {
            shm::signal_fd(dup.as_fd());
        }
    }

    /// A duplicate of the peer's descriptor `fd`, checked to be an eventfd.
    fn dup_eventfd(&self, fd: u32) -> Option<OwnedFd> {
        let dup = self.live.dup_fd(self.pid, fd).ok()?;
        shm::is_eventfd(dup.as_fd()).then_some(dup)
    }
}

/// Most duplicates of one peer's channel eventfds kept open.
pub(crate) const EVENTFD_CACHE: usize = 64;

/// A peer's eventfd duplicates by descriptor number and channel id, least recently used
/// first out; each closed when the last connection of ours that holds it ends.
#[derive(Debug, Default)]
pub(crate) struct EventFds {
    entries: Vec<EventFdEntry>,
    clock: u64,
}

#[derive(Debug)]
struct EventFdEntry {
    /// The descriptor number in the peer and its channel id.
    fd: u32,
    id: u32,
    dup: OwnedFd,
    last_use: u64,
    /// Connections of ours that signal this channel.
    holders: u32,
}

impl EventFds {
    /// The duplicate of channel (`fd`, `id`), made with `dup` on a miss.
    fn get(&mut self, fd: u32, id: u32, dup: impl FnOnce() -> Option<OwnedFd>) -> Option<&OwnedFd> {
        self.lookup(fd, id, dup).map(|i| &self.entries[i].dup)
    }

    /// [`EventFds::get`], counting one more holder.
    fn hold(&mut self, fd: u32, id: u32, dup: impl FnOnce() -> Option<OwnedFd>) -> bool {
        let Some(i) = self.lookup(fd, id, dup) else {
            return false;
        };
        self.entries[i].holders += 1;
        true
    }

    /// One holder of channel (`fd`, `id`) fewer; the last closes the duplicate. (An entry
    /// evicted meanwhile and made again by a signal has no holders: the release closes it.)
    fn release(&mut self, fd: u32, id: u32) {
        if let Some(i) = self.entries.iter().position(|e| (e.fd, e.id) == (fd, id)) {
            let e = &mut self.entries[i];
            e.holders = e.holders.saturating_sub(1);
            if e.holders == 0 {
                self.entries.swap_remove(i);
            }
        }
    }

    fn lookup(&mut self, fd: u32, id: u32, dup: impl FnOnce() -> Option<OwnedFd>) -> Option<usize> {
        self.clock += 1;
        let now = self.clock;
        if let Some(i) = self.entries.iter().position(|e| (e.fd, e.id) == (fd, id)) {
            self.entries[i].last_use = now;
            return Some(i);
        }
        // The number now names another channel: a duplicate of the closed one would wake
        // nobody (and keep its file open).
        self.entries.retain(|e| e.fd != fd);
        let dup = dup()?;
        if self.entries.len() >= EVENTFD_CACHE
            && let Some(i) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_use)
        {
            self.entries.swap_remove(i);
        }
        self.entries.push(EventFdEntry {
            fd,
            id,
            dup,
            last_use: now,
            holders: 0,
        });
        Some(self.entries.len() - 1)
    }

    #[cfg(test)]
    fn open(&self) -> Vec<(u32, u32, u32)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .map(|e| (e.fd, e.id, e.holders))
            .collect();
        v.sort_unstable();
        v
    }
}

/// Shared state of a context's watchdog thread.
#[derive(Debug)]
pub(crate) struct WatchShared {
    /// Wakes the thread (new peer, new deadline, stop).
    pub(crate) efd: EventFd,
    stop: AtomicBool,
    peers: Mutex<Vec<Arc<Liveness>>>,
    /// Completion channels of the context, woken when a peer dies.
    pub(crate) channels: Mutex<Vec<Weak<ChannelInner>>>,
}

/// The per-context service thread: it sleeps in `ppoll` on the peers' pidfds (zero CPU while
/// nothing happens) and marks peers that exit dead, and it rings completion channels whose
/// queued RNR work falls due (so that a sleeper on the channel's descriptor, e.g. tokio
/// `AsyncFd`, is woken without calling [`CompChannel::wait`](crate::verbs::CompChannel::wait)).
/// Started with the first completion channel or the first peer of another process.
#[derive(Debug)]
pub(crate) struct Watchdog {
    pub(crate) shared: Arc<WatchShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Watchdog {
    pub(crate) fn new() -> std::io::Result<Watchdog> {
        Ok(Watchdog {
            shared: Arc::new(WatchShared {
                efd: EventFd::new()?,
                stop: AtomicBool::new(false),
                peers: Mutex::new(Vec::new()),
                channels: Mutex::new(Vec::new()),
            }),
            thread: Mutex::new(None),
        })
    }

    /// Starts watching `live`.
    pub(crate) fn watch(&self, live: Arc<Liveness>) {
        self.shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(live);
        self.ensure_thread();
        self.shared.efd.signal();
    }

    fn ensure_thread(&self) {
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() {
            let shared = self.shared.clone();
            *t = std::thread::Builder::new()
                .name("soft-rnic-watchdog".into())
                .spawn(move || run(&shared))
                .ok();
            if t.is_none() {
                tracing::warn!(
                    "soft RNIC: cannot start the service thread: dead peers and RNR deadlines \
                     will only be noticed by callers of CompChannel::wait and Cq::poll"
                );
            }
        }
    }

    /// Registers a completion channel to wake when a peer dies.
    pub(crate) fn add_channel(&self, ch: Weak<ChannelInner>) {
        let mut v = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Dropped channels are pruned only when the list would grow: one scan per doubling
        // of its capacity, not one per channel (a process with thousands of connections
        // adds thousands of channels).
        if v.len() == v.capacity() {
            v.retain(|w| w.strong_count() > 0);
        }
        v.push(ch);
        drop(v);
        self.ensure_thread();
    }

    /// Marks `live` dead and wakes every channel (what the thread does on exit; also the test
    /// hook).
    pub(crate) fn declare_dead(&self, live: &Liveness) {
        declare_dead(&self.shared, live);
    }
}

fn declare_dead(shared: &WatchShared, live: &Liveness) {
    if !live.dead.swap(true, Ordering::SeqCst) {
        let chans = shared.channels.lock().unwrap_or_else(|e| e.into_inner());
        for c in chans.iter().filter_map(Weak::upgrade) {
            c.wake();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.efd.signal();
        if let Some(t) = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }
}

/// Rings the channels whose retry deadline has passed; returns how long until the next one.
fn fire_deadlines(shared: &WatchShared) -> Option<u64> {
    let now = super::shm::now_ns();
    let mut next = u64::MAX;
    let chans = shared.channels.lock().unwrap_or_else(|e| e.into_inner());
    for c in chans.iter().filter_map(Weak::upgrade) {
        match c.take_due(now) {
            Some(d) => next = next.min(d),
            None => c.wake(),
        }
    }
    (next != u64::MAX).then(|| next.saturating_sub(now))
}

/// The watchdog loop: poll the pidfds (and our eventfd for changes) until the next channel
/// deadline; mark exited peers dead, ring channels whose deadline passed.
fn run(shared: &WatchShared) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut lives: Vec<Arc<Liveness>> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let next = fire_deadlines(shared);
        {
            let mut peers = shared.peers.lock().unwrap_or_else(|e| e.into_inner());
            // Forget peers nobody else references (our own clones of the last round are
            // dropped first, or they would count), and those already dead.
            lives.clear();
            peers.retain(|l| Arc::strong_count(l) > 1 && !l.is_dead());
            lives.extend(peers.iter().cloned());
        }
        fds.clear();
        fds.push(libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&shared.efd),
            events: libc::POLLIN,
            revents: 0,
        });
        for l in &lives {
            // Only other processes are watched (see `Peer::attach`); poll skips a negative
            // descriptor, and each entry stays at its peer's index.
            fds.push(libc::pollfd {
                fd: l.pidfd.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let ts = next.map(|ns| libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `fds` is a valid array of `fds.len()` pollfds and `tsp` null or a valid
        // timespec for the duration of the call; every descriptor in `fds` is kept open by
        // `lives`/`shared` until after the call.
        let r = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                tsp,
                std::ptr::null(),
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            continue;
        }
        if fds[0].revents != 0 {
            let _ = shared.efd.drain();
        }
        for (p, l) in fds[1..].iter().zip(&lives) {
            if p.revents != 0 {
                declare_dead(shared, l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eventfd() -> Option<OwnedFd> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        // SAFETY: a new descriptor that nothing else owns.
        (fd >= 0).then(|| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    #[test]
    fn this_process_needs_no_pidfd_and_its_descriptors_duplicate_directly() {
        let dev = Device::open().unwrap();
        let (live, fresh) = Liveness::of(&dev, dev.pid).unwrap();
        assert!(live.pidfd.is_none(), "no pidfd_open for ourselves");
        assert!(!fresh, "the watchdog never watches this process");
        assert!(!live.exited() && !live.is_dead());
        // The same handle for the next connection.
        let (again, _) = Liveness::of(&dev, dev.pid).unwrap();
        assert!(Arc::ptr_eq(&live, &again));
        // A duplicate of our own control segment is the same file.
        let fd = dev.pub_fd_num();
        let dup = live.dup_fd(dev.pid, fd).unwrap();
        let ino = |fd: i32| {
            // SAFETY: `stat` is plain data for which all-zero is valid.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstat writes only into the struct passed, which lives on this frame.
            assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
            (st.st_dev, st.st_ino)
        };
        assert_eq!(ino(fd as i32), ino(std::os::fd::AsRawFd::as_raw_fd(&dup)));
        assert!(live.dup_fd(dev.pid, u32::MAX).is_err());
    }

    #[test]
    fn a_shared_ring_is_mapped_from_its_head_on_nearest_first() {
        let ring = |depth, head| SharedRing {
            wqe: 1 << 20,
            stride: 32,
            cqe: 2 << 20,
            depth,
            head,
        };
        assert_eq!(
            ring(65_536, 0).runs(),
            [
                (0, POPULATE_AHEAD),
                (POPULATE_AHEAD, 65_536 - POPULATE_AHEAD),
                (0, 0)
            ]
        );
        // A later lap, near the end: the connect maps up to the end, the helper the start of
        // the ring first (what the SENDs reach next).
        assert_eq!(
            ring(65_536, 65_536 + 65_000).runs(),
            [(65_000, 536), (65_536, 0), (0, 65_000)]
        );
        // A ring smaller than the window is mapped whole from its head to its end now.
        assert_eq!(ring(1024, 5).runs(), [(5, 1019), (1024, 0), (0, 5)]);
        for (depth, head) in [(65_536, 77), (4096, 4095), (1 << 14, 123_456)] {
            let r = ring(depth, head);
            assert_eq!(r.runs().iter().map(|x| x.1).sum::<u32>(), depth);
        }
        let r = ring(65_536, 10);
        assert_eq!(
            r.bytes((10, 4)),
            (
                ((1 << 20) + 320, 128),
                ((2 << 20) + 10 * layout::RCQE, 4 * layout::RCQE)
            )
        );
    }

    #[test]
    fn an_eventfd_duplicate_closes_with_its_last_holder() {
        let mut efds = EventFds::default();
        assert!(efds.hold(7, 1, eventfd));
        assert!(efds.hold(7, 1, || panic!("a hit makes no duplicate")));
        assert!(
            efds.get(7, 1, || panic!("a hit makes no duplicate"))
                .is_some()
        );
        assert_eq!(efds.open(), vec![(7, 1, 2)]);
        efds.release(7, 1);
        assert_eq!(efds.open(), vec![(7, 1, 1)], "one holder is left");
        efds.release(7, 1);
        assert_eq!(efds.open(), vec![], "closed with the last holder");
        efds.release(7, 1);
        assert!(
            !efds.hold(8, 1, || None),
            "an unreachable channel is not held"
        );
        assert_eq!(efds.open(), vec![]);
    }

    #[test]
    fn a_reused_number_or_a_full_cache_drops_the_old_duplicate() {
        let mut efds = EventFds::default();
        assert!(efds.hold(7, 1, eventfd));
        // The peer closed channel 1 and number 7 now names channel 2.
        assert!(efds.hold(7, 2, eventfd));
        assert_eq!(efds.open(), vec![(7, 2, 1)]);
        // Signals alone keep at most EVENTFD_CACHE duplicates, the least recently used out.
        for fd in 100..100 + EVENTFD_CACHE as u32 {
            assert!(efds.get(fd, 9, eventfd).is_some());
        }
        let open = efds.open();
        assert_eq!(open.len(), EVENTFD_CACHE);
        assert!(
            !open.contains(&(7, 2, 1)),
            "the least recently used went first"
        );
        // Its holder's release finds nothing to close; a signal makes it again, unheld.
        efds.release(7, 2);
        assert!(efds.get(7, 2, eventfd).is_some());
        efds.release(7, 2);
        assert!(efds.open().iter().all(|e| e.0 != 7));
    }
}
