//! `soft`: a software RNIC in user space, for the processes of one host.
//!
//! A faithful model of a reliable-connected RNIC, so that everything above the verbs layer runs
//! and is tested on any Linux machine, with no hardware, no root and no system package.
//!
//! # How it works
//!
//! - Opening the device creates a soft RNIC instance: two memfd segments, a *published* one
//!   that only this instance writes (header, MR table, QP table, receive rings; sealed with
//!   `F_SEAL_FUTURE_WRITE` so peers can only map it read-only) and an *inbox* that peers map
//!   read-write (receive-completion rings, doorbell words, "your QP failed" flags). The
//!   instance's identity (pid, descriptor number, random nonce) travels in
//!   [`Endpoint::gid`]; a peer finds it with `pidfd_open` + `pidfd_getfd` (fallback
//!   `/proc/PID/fd/N`) and validates it before use.
//! - [`Pd::alloc_mr`] memory lives in its own memfd (sealed against shrinking, so a peer can
//!   never make us fault). A peer maps it lazily on first access and caches the mapping: an
//!   RDMA WRITE or READ is **one memcpy by the requester**, with no CPU of the remote process
//!   involved. [`Pd::reg_mr`] on arbitrary memory works too: a peer in another process reaches
//!   it with `process_vm_readv/writev` (one system call per piece), a peer in the same process
//!   copies directly. Atomics need the target in shared memory or in the same process.
//! - Work requests execute synchronously inside [`Qp::post_send`], on the caller's thread: the
//!   caller's CPU is the NIC. A SEND claims the next receive the peer posted (lock-free ring in
//!   the peer's segments), checks it, copies the payload straight into the peer's receive
//!   buffers and publishes the peer's completion, ringing its doorbell if its CQ is armed.
//! - Shared receive queues ([`SoftSrq`]): a QP created on one publishes the SRQ's ring and
//!   index offsets instead of its own, so the peers of every QP of the SRQ claim from one
//!   ring; completions name the QP the message arrived on. A claim names its QP in the same
//!   compare-and-swap, so a receive claimed by a peer that then died is flushed (naming that
//!   QP) once the QP is in ERROR, and a live peer's claim never is. Limit: every QP of an SRQ
//!   uses the SRQ's receive CQ. A peer's process maps the SRQ's rings (megabytes) in ahead of
//!   its SENDs: the stretch they reach first while it connects, the rest on a helper thread
//!   at the lowest priority, so the data path takes no page faults and a connect does not
//!   wait for the whole rings.
//! - Completions: see [`SoftCq`] (per-QP single-producer rings and a shared ready bitmap; CQ
//!   overrun is prevented by sizing at [`Pd::create_qp`]).
//!
//! # What a peer can and cannot do
//!
//! Every remote access checks the key, that the region is still registered, the bounds, the
//! region's rights and the rights the peer's QP granted. A violation completes the request with
//! `REM_ACCESS_ERR` and moves both QPs to ERROR. Nothing outside a registered,
//! remotely-accessible range is touched by the soft RNIC. Everything a peer can write into our
//! segments (its receive completions, the claim word of our receive queue, doorbell words) is
//! validated before use: garbage gives an error completion (`vendor::CORRUPT`) and ERROR, never
//! undefined behaviour or a panic. (A peer process of the same user could of course attack us
//! by other means, such as `ptrace`: the soft RNIC protects against bugs and stale state, not
//! against a hostile local user.)
//!
//! # Progress is manual for RNR retries
//!
//! A SEND (or WRITE_WITH_IMM) that finds no receive posted is queued with everything posted
//! after it (RC order is kept) and retried every [`ConnectAttr::rnr_timer`] from later
//! [`Qp::post_send`] and [`Cq::poll`] calls, up to `rnr_retry` times (7: forever), then fails
//! with `RNR_RETRY_EXC_ERR`. While such work is queued, [`CompChannel::wait`] does not sleep
//! past the next retry time (it returns `true` so the caller polls), and the context's service
//! thread makes the channel's descriptor readable when the retry is due (for epoll/`AsyncFd`
//! sleepers, armed CQ or not). The same machinery waits
//! for a peer QP that is not connected yet (`retry_cnt` times every ACK timeout, then
//! `RETRY_EXC_ERR`). The retry machinery is lock-free: a pre-allocated queue per QP, a pending
//! bit per QP in its send CQ and a counter the CQ checks with one load.
//!
//! # Peers that die
//!
//! A service thread per context (started with its first completion channel or first peer in
//! another process) sleeps in `ppoll` on the pidfds of the peer processes (no CPU while nothing
//! happens); when one exits it sets a flag the data path reads with one atomic
//! load and wakes every completion channel of the context. Operations towards a dead peer, and
//! queued RNR sends, complete with `RETRY_EXC_ERR` (then the QP moves to ERROR and everything
//! else is flushed) instead of hanging.
//!
//! # Costs
//!
//! `post_send`, `post_recv` and `poll` allocate nothing, take no lock and make no system call on
//! their fast path. Exceptions, all off the steady state: the first access to a peer's region
//! (maps it, then cached), ringing an *armed* CQ's eventfd, queueing for an RNR retry (reads
//! the clock, may ring the channel), and regions registered with [`Pd::reg_mr`] that a peer in
//! another process reaches (one `process_vm_*` call per access).
//!
//! # Limits
//!
//! See [`CAPS`]. In addition, one CQ serves at most 32768 QP sides, a context at most 16384
//! QPs, 65536 regions and 16384 CQs. Byte counters: [`SoftContext::counters`].
//!
//! # Test hooks
//!
//! [`fault`] forces a QP into ERROR, delays execution, makes a peer look dead and writes
//! garbage into rings, for tests of the layers above.
//!
//! [`Endpoint::gid`]: crate::verbs::Endpoint::gid
//! [`Qp::post_send`]: crate::verbs::Qp::post_send
//! [`Pd::create_qp`]: crate::verbs::Pd::create_qp
//! [`ConnectAttr::rnr_timer`]: crate::verbs::ConnectAttr::rnr_timer
//! [`Cq::poll`]: crate::verbs::Cq::poll
//! [`CompChannel::wait`]: crate::verbs::CompChannel::wait

mod channel;
mod counters;
mod cq;
mod exec;
pub mod fault;
mod layout;
mod mr;
mod peer;
mod populate;
mod qp;
mod shm;
mod srq;

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

pub use channel::SoftCompChannel;
pub use counters::{CounterSnapshot, process_counters};
pub use cq::SoftCq;
pub use mr::SoftMr;
pub use qp::SoftQp;
pub use srq::SoftSrq;

use super::{
    Access, Caps, Context, DeviceInfo, ErrorKind, LinkLayer, Pd, Provider, QpCaps, Result, Verb,
    VerbsError,
};
use layout::{RegionAlloc, SlotAlloc};
use peer::{Peer, Watchdog};
use shm::Mapping;

/// The software RNIC provider.
#[derive(Debug, Clone, Copy)]
pub struct Soft;

/// Name of the one soft device.
pub const DEVICE_NAME: &str = "soft0";

/// What the soft RNIC can do; every limit is enforced.
pub const CAPS: Caps = Caps {
    max_inline: 256,
    max_sge: 16,
    max_qp_wr: 4096,
    max_srq_wr: 1 << 17,
    max_cqe: 1 << 22,
    max_msg_size: 1 << 30,
    max_mr_size: 1 << 40,
    atomics: true,
    max_rd_atomic: 16,
};

/// The MTU the soft port reports (messages are copied whole; this only matters to callers that
/// size fragments by it).
pub const ACTIVE_MTU: u32 = 4096;

/// Vendor error codes the soft provider puts in [`Wc::vendor_err`](super::Wc::vendor_err),
/// saying which check failed.
pub mod vendor {
    /// The key names no registered region (never registered, deregistered, or stale).
    pub const BAD_KEY: u32 = 0x50_0001;
    /// The address range is outside the region.
    pub const OUT_OF_BOUNDS: u32 = 0x50_0002;
    /// The region or the peer's QP lacks the right (REMOTE_READ/WRITE/ATOMIC, LOCAL_WRITE).
    pub const NO_RIGHT: u32 = 0x50_0003;
    /// The region belongs to another protection domain than the QP.
    pub const WRONG_PD: u32 = 0x50_0004;
    /// The peer process is gone.
    pub const PEER_DEAD: u32 = 0x50_0005;
    /// The peer QP was destroyed, is in ERROR, or never connected back to this QP.
    pub const PEER_QP_GONE: u32 = 0x50_0006;
    /// The receive the peer posted is smaller than the message.
    pub const RECV_TOO_SMALL: u32 = 0x50_0007;
    /// The receive the peer posted names a bad region (lkey, bounds, LOCAL_WRITE, PD).
    pub const BAD_RECV: u32 = 0x50_0008;
    /// Shared state written by the peer is corrupt (index out of range, bad field).
    pub const CORRUPT: u32 = 0x50_0009;
    /// An atomic targets memory of another process that is not shared memory
    /// (registered with `reg_mr`): use `alloc_mr` for atomic targets.
    pub const ATOMIC_NOT_SHARED: u32 = 0x50_000a;
    /// The message is larger than `max_msg_size`.
    pub const MSG_TOO_BIG: u32 = 0x50_000b;
    /// The peer's region could not be mapped (descriptor gone, not sealed, too small).
    pub const MAP_FAILED: u32 = 0x50_000c;
    /// A cross-process copy (`process_vm_*`) failed.
    pub const CMA_FAILED: u32 = 0x50_000d;
    /// Receiver-not-ready retries exhausted (no receive posted).
    pub const RNR: u32 = 0x50_000e;
    /// Forced by a test hook.
    pub const FAULT: u32 = 0x50_000f;
    /// The key is a memory window lent to another peer.
    pub const WRONG_PEER: u32 = 0x50_0010;
}

/// One soft RNIC instance: the shared segments and the tables (shared by every object of the
/// context through an `Arc`).
pub(crate) struct Device {
    info: DeviceInfo,
    pub(crate) pid: u32,
    pub(crate) nonce: u64,
    pub_fd: OwnedFd,
    inbox_fd: OwnedFd,
    /// The published segment (read-write for us).
    pub(crate) pub_map: Arc<Mapping>,
    /// The inbox segment.
    pub(crate) inbox: Arc<Mapping>,
    pub(crate) pub_heap: RegionAlloc,
    pub(crate) in_heap: RegionAlloc,
    pub(crate) mr_slots: SlotAlloc,
    pub(crate) qp_slots: SlotAlloc,
    pub(crate) cq_slots: SlotAlloc,
    next_pd: AtomicU32,
    peers: Mutex<HashMap<u64, Weak<Peer>>>,
    /// One liveness handle (a pidfd) per peer process, shared by every peer instance in it.
    pub(crate) lives: Mutex<HashMap<u32, Weak<peer::Liveness>>>,
    pub(crate) watchdog: Watchdog,
    pub(crate) counters: Arc<counters::DeviceCounters>,
    /// Shared receive queues (for their limit events), how many live, the next number.
    pub(crate) srqs: Mutex<Vec<Weak<qp::Rq>>>,
    pub(crate) srq_live: AtomicU32,
    pub(crate) next_srq: AtomicU32,
}

impl Drop for Device {
    fn drop(&mut self) {
        self.counters.unregister();
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftDevice")
            .field("name", &self.info.name)
            .field("pid", &self.pid)
            .field("nonce", &format_args!("{:#018x}", self.nonce))
            .field("pub_fd", &self.pub_fd.as_raw_fd())
            .field("inbox_fd", &self.inbox_fd.as_raw_fd())
            .finish_non_exhaustive()
    }
}

fn os_err(verb: Verb, e: std::io::Error, what: &'static str) -> VerbsError {
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    VerbsError::from_errno(verb, errno, what)
}

impl Device {
    fn open() -> Result<Arc<Device>> {
        let verb = Verb::OpenDevice;
        let pid = std::process::id();
        let nonce = shm::random_u64();
        let pub_fd = shm::memfd(c"soft-rnic-pub", layout::PUB_LEN as u64).map_err(|e| {
            os_err(
                verb,
                e,
                "soft RNIC: cannot create the shared control segment",
            )
        })?;
        let inbox_fd = shm::memfd(c"soft-rnic-inbox", layout::INBOX_LEN as u64)
            .map_err(|e| os_err(verb, e, "soft RNIC: cannot create the shared inbox segment"))?;
        let pub_map = Mapping::map(pub_fd.as_fd(), layout::PUB_LEN, true)
            .map_err(|e| os_err(verb, e, "soft RNIC: cannot map the control segment"))?;
        let inbox = Mapping::map(inbox_fd.as_fd(), layout::INBOX_LEN, true)
            .map_err(|e| os_err(verb, e, "soft RNIC: cannot map the inbox segment"))?;
        let seal_common = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        shm::add_seals(
            pub_fd.as_fd(),
            seal_common | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL,
        )
        .map_err(|e| os_err(verb, e, "soft RNIC: cannot seal the control segment"))?;
        shm::add_seals(inbox_fd.as_fd(), seal_common | libc::F_SEAL_SEAL)
            .map_err(|e| os_err(verb, e, "soft RNIC: cannot seal the inbox segment"))?;

        let w32 = |m: &Mapping, off: usize, v: u32| {
            if let Some(w) = m.u32_at(off) {
                w.store(v, Ordering::Relaxed);
            }
        };
        let w64 = |m: &Mapping, off: usize, v: u64| {
            if let Some(w) = m.u64_at(off) {
                w.store(v, Ordering::Relaxed);
            }
        };
        w32(&pub_map, layout::hdr::VERSION, layout::VERSION);
        w32(&pub_map, layout::hdr::PID, pid);
        w64(&pub_map, layout::hdr::NONCE, nonce);
        w32(&pub_map, layout::hdr::INBOX_FD, inbox_fd.as_raw_fd() as u32);
        w64(&pub_map, layout::hdr::PUB_LEN, layout::PUB_LEN as u64);
        w64(&pub_map, layout::hdr::INBOX_LEN, layout::INBOX_LEN as u64);
        w64(&inbox, layout::IN_NONCE, nonce);
        w64(&inbox, 0, layout::MAGIC);
        // The magic goes last: a reader that sees it sees the whole header.
        if let Some(w) = pub_map.u64_at(layout::hdr::MAGIC) {
            w.store(layout::MAGIC, Ordering::Release);
        }

        let info = DeviceInfo {
            name: DEVICE_NAME.to_string(),
            provider: Soft::NAME,
            port: 1,
            link_layer: LinkLayer::SharedMemory,
            active_mtu: ACTIVE_MTU,
            fw_ver: format!("soft-rnic {}", layout::VERSION),
        };
        Ok(Arc::new(Device {
            info,
            pid,
            nonce,
            pub_fd,
            inbox_fd,
            pub_map: Arc::new(pub_map),
            inbox: Arc::new(inbox),
            pub_heap: RegionAlloc::new(layout::PUB_HEAP, layout::PUB_LEN),
            in_heap: RegionAlloc::new(layout::IN_HEAP, layout::INBOX_LEN),
            mr_slots: SlotAlloc::new(layout::MAX_MR, 32 - layout::MR_SLOT_BITS),
            qp_slots: SlotAlloc::new(layout::MAX_QP, 24 - layout::QP_SLOT_BITS),
            cq_slots: SlotAlloc::new(layout::MAX_CQ, 8),
            next_pd: AtomicU32::new(1),
            peers: Mutex::new(HashMap::new()),
            lives: Mutex::new(HashMap::new()),
            watchdog: Watchdog::new()
                .map_err(|e| os_err(verb, e, "soft RNIC: cannot create the watchdog eventfd"))?,
            counters: counters::DeviceCounters::register(),
            srqs: Mutex::new(Vec::new()),
            srq_live: AtomicU32::new(0),
            next_srq: AtomicU32::new(1),
        }))
    }

    /// A word of our published segment (offsets computed by us: always in range).
    #[inline]
    pub(crate) fn pub32(&self, off: usize) -> &AtomicU32 {
        self.pub_map.u32_at(off).unwrap_or(&DUMMY32)
    }

    /// A 64-bit word of our published segment.
    #[inline]
    pub(crate) fn pub64(&self, off: usize) -> &AtomicU64 {
        self.pub_map.u64_at(off).unwrap_or(&DUMMY64)
    }

    /// A word of our inbox.
    #[inline]
    pub(crate) fn in32(&self, off: usize) -> &AtomicU32 {
        self.inbox.u32_at(off).unwrap_or(&DUMMY32)
    }

    /// A 64-bit word of our inbox.
    #[inline]
    pub(crate) fn in64(&self, off: usize) -> &AtomicU64 {
        self.inbox.u64_at(off).unwrap_or(&DUMMY64)
    }

    /// The descriptor number peers use to reach our published segment.
    pub(crate) fn pub_fd_num(&self) -> u32 {
        self.pub_fd.as_raw_fd() as u32
    }

    /// The peer named by (`pid`, `fd`, `nonce`), attached (mapped and validated) on first use.
    pub(crate) fn attach(self: &Arc<Self>, pid: u32, fd: u32, nonce: u64) -> Result<Arc<Peer>> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = peers.get(&nonce).and_then(Weak::upgrade)
            && p.pid == pid
        {
            return Ok(p);
        }
        peers.retain(|_, w| w.strong_count() > 0);
        let p = Arc::new(Peer::attach(self, pid, fd, nonce)?);
        peers.insert(nonce, Arc::downgrade(&p));
        Ok(p)
    }
}

/// Stand-in for out-of-range offsets of our own segments (never happens: our offsets are
/// computed from constants checked at compile time). Writes to it are lost, reads give 0.
static DUMMY32: AtomicU32 = AtomicU32::new(0);
static DUMMY64: AtomicU64 = AtomicU64::new(0);

/// An open soft RNIC (one instance: its own shared segments, tables and watchdog).
#[derive(Debug, Clone)]
pub struct SoftContext {
    dev: Arc<Device>,
}

impl SoftContext {
    /// The byte and operation counters of this soft RNIC.
    pub fn counters(&self) -> CounterSnapshot {
        self.dev.counters.snapshot()
    }

    /// The random nonce naming this instance (what a peer's endpoint must carry).
    pub fn nonce(&self) -> u64 {
        self.dev.nonce
    }
}

impl Provider for Soft {
    const KIND: super::ProviderKind = super::ProviderKind::Soft;

    type Context = SoftContext;
    type Pd = SoftPd;
    type Mr = SoftMr;
    type CompChannel = SoftCompChannel;
    type Cq = SoftCq;
    type Qp = SoftQp;
    type Srq = SoftSrq;

    fn devices() -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo {
            name: DEVICE_NAME.to_string(),
            provider: Soft::NAME,
            port: 1,
            link_layer: LinkLayer::SharedMemory,
            active_mtu: ACTIVE_MTU,
            fw_ver: format!("soft-rnic {}", layout::VERSION),
        }])
    }

    fn open(name: Option<&str>) -> Result<SoftContext> {
        // `soft0` or `soft0:1` (device:port, as rails are named).
        let name = name.map(|n| n.strip_suffix(":1").unwrap_or(n));
        if let Some(n) = name
            && n != DEVICE_NAME
        {
            return Err(VerbsError::new(
                Verb::OpenDevice,
                ErrorKind::NoDevice,
                format!("no soft device named {n:?}: the soft provider has one device, `soft0`"),
            ));
        }
        Ok(SoftContext {
            dev: Device::open()?,
        })
    }
}

impl Context<Soft> for SoftContext {
    /// Limit events of shared receive queues, and events a test raised with
    /// [`fault::raise_async_event`] (the soft RNIC has no others: its failures all arrive as
    /// completions). Two relaxed loads when none is pending.
    fn poll_async_event(&self) -> Result<Option<crate::verbs::AsyncEvent>> {
        Ok(fault::take_async_event().or_else(|| srq::take_limit_event(&self.dev)))
    }

    fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    fn caps(&self) -> &Caps {
        &CAPS
    }

    fn alloc_pd(&self) -> Result<SoftPd> {
        let id = self.dev.next_pd.fetch_add(1, Ordering::Relaxed);
        if id == 0 {
            return Err(VerbsError::new(
                Verb::AllocPd,
                ErrorKind::ExceedsCaps,
                "protection domain ids exhausted",
            ));
        }
        Ok(SoftPd {
            dev: self.dev.clone(),
            id,
        })
    }

    fn create_comp_channel(&self) -> Result<SoftCompChannel> {
        SoftCompChannel::new(&self.dev)
    }

    fn create_cq(&self, cqe: u32, channel: Option<&SoftCompChannel>) -> Result<SoftCq> {
        SoftCq::new(&self.dev, cqe, channel)
    }
}

/// A protection domain of the soft RNIC.
#[derive(Debug)]
pub struct SoftPd {
    dev: Arc<Device>,
    id: u32,
}

impl Pd<Soft> for SoftPd {
    fn alloc_mr(&self, len: usize, access: Access) -> Result<SoftMr> {
        SoftMr::alloc(&self.dev, self.id, len, access)
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<SoftMr> {
        // SAFETY: forwarded contract: the caller keeps the range mapped and valid while the
        // region lives and completions are outstanding.
        unsafe { SoftMr::register(&self.dev, self.id, addr, len, access) }
    }

    fn bind_window_to(
        &self,
        mr: &SoftMr,
        offset: usize,
        len: usize,
        access: Access,
        to: crate::verbs::WindowTarget,
    ) -> Result<SoftMr> {
        if to.device != self.dev.nonce {
            return Err(VerbsError::new(
                Verb::BindMw,
                ErrorKind::WrongPd,
                "the QP belongs to another soft context than the protection domain",
            ));
        }
        SoftMr::window(&self.dev, self.id, mr, offset, len, access, to.peer)
    }

    fn create_qp(&self, send_cq: &SoftCq, recv_cq: &SoftCq, caps: QpCaps) -> Result<SoftQp> {
        SoftQp::create(&self.dev, self.id, send_cq, recv_cq, caps, None)
    }

    fn create_srq(&self, caps: crate::verbs::SrqCaps) -> Result<SoftSrq> {
        SoftSrq::create(&self.dev, self.id, caps)
    }

    fn create_qp_on_srq(
        &self,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        caps: QpCaps,
        srq: &SoftSrq,
    ) -> Result<SoftQp> {
        if srq.rq.dev.nonce != self.dev.nonce || srq.pd() != self.id {
            return Err(VerbsError::new(
                Verb::CreateQp,
                ErrorKind::WrongPd,
                "the SRQ belongs to another protection domain",
            ));
        }
        SoftQp::create(&self.dev, self.id, send_cq, recv_cq, caps, Some(&srq.rq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_lists_soft0() {
        let d = Soft::devices().unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].name, "soft0");
        assert_eq!(d[0].link_layer, LinkLayer::SharedMemory);
    }

    /// The shared receive queue counts its members in ERROR (a drain looks for a dead
    /// claimer's receive only while one is): in and out with each move, and out when a member
    /// in ERROR is destroyed.
    #[test]
    fn an_srq_counts_its_members_in_error() {
        use crate::verbs::{Context as _, Pd as _, Qp as _, QpCaps, SrqCaps};
        let ctx = Soft::open(None).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4096, None).unwrap();
        let srq = pd
            .create_srq(SrqCaps {
                max_wr: 64,
                max_sge: 1,
            })
            .unwrap();
        let errored = || srq.rq.srq.as_ref().unwrap().errored.load(Ordering::Acquire);
        let caps = QpCaps {
            max_recv_wr: 0,
            ..QpCaps::default()
        };
        let mut a = pd.create_qp_on_srq(&cq, &cq, caps, &srq).unwrap();
        let mut b = pd.create_qp_on_srq(&cq, &cq, caps, &srq).unwrap();
        assert_eq!(errored(), 0);
        a.modify_to_error().unwrap();
        a.modify_to_error().unwrap();
        assert_eq!(errored(), 1, "counted once");
        b.modify_to_error().unwrap();
        assert_eq!(errored(), 2);
        a.modify_to_reset().unwrap();
        assert_eq!(errored(), 1, "out of ERROR");
        drop(b);
        drop(cq);
        assert_eq!(errored(), 0, "a destroyed member in ERROR leaves the count");
        drop(a);
        assert_eq!(errored(), 0);
    }

    #[test]
    fn open_by_name() {
        assert!(Soft::open(Some("soft0")).is_ok());
        let e = Soft::open(Some("mlx5_0")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice);
    }
}
