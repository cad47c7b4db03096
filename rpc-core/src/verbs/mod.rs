//! The verbs layer: one provider-neutral RDMA API, several providers.
//!
//! The object life cycle is that of libibverbs:
//!
//! ```text
//! Provider::open ─> Context ─> Pd ─> Mr (lkey, rkey)
//!                      │        └──> Qp (RC) ── RESET ─> INIT ─> RTR ─> RTS ─> (ERROR)
//!                      ├──> CompChannel          ▲ needs the peer's Endpoint (out of band)
//!                      └──> Cq ◀── completions of the QPs attached to it
//! ```
//!
//! The RPC layers above are written once against these traits and monomorphised per provider:
//! there is no `dyn` and no per-provider branch on the data path. The only place a provider is
//! chosen at run time is [`ProviderKind::visit`], at setup.
//!
//! Providers:
//! - [`soft`]: a software RNIC in user space (shared memory between processes of one host). The
//!   default; needs no hardware, no root and no system package.
//! - `ib` (cargo feature `ibverbs`): real RNICs through rdma-sys: InfiniBand, RoCE, and the
//!   kernel's Soft-RoCE (`rdma_rxe`).
//!
//! A new provider is a module implementing these traits (with `const KIND`) and one entry in
//! the registry (`verbs/registry.rs`): its name, wire tag and `cfg`; `ProviderKind`, the
//! handshake's provider check and the provider-neutral handles are generated from it.
//!
//! # What a peer holding our keys can do
//!
//! A peer connected to one of our QPs and knowing an `rkey` of ours can read and/or write (as
//! the region's [`Access`] allows) exactly the bytes of that registered region, and nothing else,
//! until the region is deregistered. Every remote access is checked against key, bounds, rights
//! and registration; a violation fails the peer's request with `REM_ACCESS_ERR` and moves the
//! QPs to ERROR. Memory that was never registered with remote rights is never reachable.
//!
//! # Thread safety
//!
//! All objects are `Send + Sync`. Posting and polling take `&mut self`: one owner per QP and per
//! CQ, as in eRPC, so the fast path needs no lock.

pub mod error;
pub mod group;
pub(crate) mod registry;
pub(crate) mod shared;
pub mod soft;
pub mod types;

#[cfg(feature = "ibverbs")]
pub mod ib;

use std::fmt;
use std::os::fd::AsRawFd;
use std::time::Duration;

pub use error::{ErrorKind, PostError, Result, Verb, VerbsError, WcError};
pub use group::QpGroup;

/// Most RC queue pairs one connection may use ([`Provider::qps_per_connection`]).
pub const MAX_QPS_PER_CONNECTION: u32 = 16;
pub use types::{
    Access, AsyncEvent, Caps, ConnectAttr, DeviceInfo, Endpoint, GidFmt, LinkLayer, QpCaps,
    QpState, RecvWr, RemoteMr, SendFlags, SendWr, Sge, SrqCaps, Wc, WcFlags, WcOpcode, WcStatus,
    WrOp,
};

/// An RDMA provider: a family of verbs objects with the same semantics as libibverbs.
///
/// Implementations: [`soft::Soft`] and, with the `ibverbs` feature, `ib::Ib`.
pub trait Provider: Sized + Send + Sync + 'static {
    /// Its entry in the registry of providers (`verbs/registry.rs`).
    const KIND: ProviderKind;
    /// Short lower-case name (`soft`, `ib`): the value of `RPC_PROVIDER`.
    const NAME: &'static str = Self::KIND.name();
    /// Upper-case tag used in logs (`SOFT`, `IB`), as NCCL prints `NET/IB`.
    const TAG: &'static str = Self::KIND.log_tag();

    /// An open device.
    type Context: Context<Self>;
    /// A protection domain.
    type Pd: Pd<Self>;
    /// A registered memory region.
    type Mr: Mr;
    /// A completion channel: something to sleep on instead of spinning.
    type CompChannel: CompChannel;
    /// A completion queue.
    type Cq: Cq;
    /// A reliable-connected queue pair.
    type Qp: Qp;
    /// A shared receive queue.
    type Srq: Srq;

    /// Lists the devices of this provider. An empty list is not an error.
    ///
    /// # Errors
    /// When the provider's library cannot be queried at all.
    fn devices() -> Result<Vec<DeviceInfo>>;

    /// Opens the named device, or the first usable one when `name` is `None`.
    ///
    /// # Errors
    /// [`ErrorKind::NoDevice`] when there is none (the message says how to get one).
    fn open(name: Option<&str>) -> Result<Self::Context>;

    /// Opens every device this provider should use, in rail order: a sharded server binds
    /// shard `i` to rail `i % n` (ib: the devices and ports `RPC_IB_HCA` lists). The default
    /// opens one device with `open(None)`.
    ///
    /// # Errors
    /// As [`Provider::open`].
    fn open_rails() -> Result<Vec<Self::Context>> {
        Ok(vec![Self::open(None)?])
    }

    /// How many QPs one connection is striped over (see [`QpGroup`]; ib:
    /// `RPC_IB_QPS_PER_CONNECTION`). The default is 1.
    ///
    /// # Errors
    /// When the setting is malformed.
    fn qps_per_connection() -> Result<u32> {
        Ok(1)
    }
}

/// An open device (`ibv_context`).
pub trait Context<P: Provider>: Send + Sync + fmt::Debug {
    /// What the device is.
    fn info(&self) -> &DeviceInfo;

    /// What the device can do; these limits are enforced.
    fn caps(&self) -> &Caps;

    /// Allocates a protection domain (`ibv_alloc_pd`).
    ///
    /// # Errors
    /// When the device refuses (out of resources).
    fn alloc_pd(&self) -> Result<P::Pd>;

    /// Creates a completion channel (`ibv_create_comp_channel`).
    ///
    /// # Errors
    /// When no file descriptor can be created.
    fn create_comp_channel(&self) -> Result<P::CompChannel>;

    /// Creates a completion queue with room for at least `cqe` completions
    /// (`ibv_create_cq`), optionally reporting events to `channel`.
    ///
    /// # Errors
    /// [`ErrorKind::ExceedsCaps`] when `cqe` is over [`Caps::max_cqe`] or zero;
    /// [`ErrorKind::WrongPd`] when `channel` belongs to another device.
    fn create_cq(&self, cqe: u32, channel: Option<&P::CompChannel>) -> Result<P::Cq>;

    /// The next asynchronous event of the device, without blocking (`ibv_get_async_event` on
    /// a non-blocking descriptor, acknowledged at once); `None` when there is none. Port
    /// down, device fatal, CQ error and QP fatal events ([`AsyncEvent::is_fatal`]) mean the
    /// connections over that object have failed, for the [`AsyncEvent::cause`] given.
    ///
    /// The default (soft) has none: its failures all arrive as completions.
    ///
    /// # Errors
    /// When the event descriptor fails.
    fn poll_async_event(&self) -> Result<Option<AsyncEvent>> {
        Ok(None)
    }
}

/// A protection domain (`ibv_pd`): memory regions and queue pairs of one PD work together only.
pub trait Pd<P: Provider>: Send + Sync + fmt::Debug {
    /// Allocates `len` bytes of memory owned by the region and registers it with `access`.
    ///
    /// This is the memory to use for anything a peer reads or writes: the provider places it
    /// where its RNIC reaches it best (the soft provider: shared memory a peer maps, so remote
    /// operations are one memcpy; ib: page-aligned, pinned). The memory is zeroed.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for zero length or inconsistent flags;
    /// [`ErrorKind::ExceedsCaps`] over [`Caps::max_mr_size`]; [`ErrorKind::OutOfMemory`]
    /// (explained: RLIMIT_MEMLOCK) when memory cannot be allocated or pinned.
    fn alloc_mr(&self, len: usize, access: Access) -> Result<P::Mr>;

    /// Registers existing memory `[addr, addr + len)` with `access` (`ibv_reg_mr`).
    ///
    /// # Errors
    /// As [`Pd::alloc_mr`], plus [`ErrorKind::InvalidArgument`] when the range overflows or is
    /// not mapped.
    ///
    /// # Safety
    /// The range must stay mapped and must not be freed until the returned region is dropped
    /// and every work request that names it has completed. While a peer holds the rkey it may
    /// write the bytes at any time (as `access` allows): the caller must not hold Rust
    /// references to that memory across such writes.
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<P::Mr>;

    /// Lends `[offset, offset + len)` of `mr` to the peer connected to `qp`: a fresh remote key
    /// (a memory window) that grants `access` (remote rights only: [`Access::REMOTE_READ`],
    /// [`Access::REMOTE_WRITE`], [`Access::REMOTE_ATOMIC`]) to that range and nothing else,
    /// whatever the rights of `mr` itself. Dropping the returned object revokes the key: once
    /// the drop returns, no operation through it reads or writes a byte (accesses already
    /// under way finish first), and a later one fails with `REM_ACCESS_ERR` on the peer. Only
    /// `mr`'s owner may write through its own lkey meanwhile; nothing else changes for `mr`.
    ///
    /// soft: the key is a generation of the region table, checked on every remote access, and
    /// bound to the peer's RNIC: no other peer can use it. ib: a registration of the range
    /// alone (`ibv_reg_mr`, deregistered on drop), so the key is fresh, least-privilege and
    /// revoked, but any QP of the protection domain may use it while it lives.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when the range is empty or outside `mr`, `access` asks
    /// for a local right, or a remote write or atomic right is asked of a region without
    /// [`Access::LOCAL_WRITE`]; [`ErrorKind::ExceedsCaps`] when the key table is full.
    fn bind_window(
        &self,
        mr: &P::Mr,
        offset: usize,
        len: usize,
        access: Access,
        qp: &P::Qp,
    ) -> Result<P::Mr> {
        self.bind_window_to(mr, offset, len, access, qp.window_target())
    }

    /// [`Pd::bind_window`] for the peer `to` names ([`Qp::window_target`] of a connected QP
    /// of this protection domain), from any thread: the QP itself need not be at hand.
    ///
    /// # Errors
    /// As [`Pd::bind_window`]; [`ErrorKind::WrongPd`] when `to` names a QP of another device.
    fn bind_window_to(
        &self,
        mr: &P::Mr,
        offset: usize,
        len: usize,
        access: Access,
        to: WindowTarget,
    ) -> Result<P::Mr>;

    /// Creates an RC queue pair in RESET, whose completions go to `send_cq` and `recv_cq`.
    ///
    /// # Errors
    /// [`ErrorKind::ExceedsCaps`] when `caps` exceeds the device's [`Caps`] or the CQs are too
    /// small to hold every completion the QP can generate (CQ overrun is prevented by sizing);
    /// [`ErrorKind::WrongPd`] when a CQ belongs to another device.
    fn create_qp(&self, send_cq: &P::Cq, recv_cq: &P::Cq, caps: QpCaps) -> Result<P::Qp>;

    /// Creates a shared receive queue (`ibv_create_srq`): receives posted to it are consumed
    /// by the inbound SENDs (and WRITE_WITH_IMMs) of every QP created on it with
    /// [`Pd::create_qp_on_srq`], in the order posted; each completion names the QP the
    /// message arrived on. Receive memory is then sized by messages in flight, not by
    /// connections.
    ///
    /// # Errors
    /// [`ErrorKind::ExceedsCaps`] when `caps` exceeds the device's limits or asks for zero
    /// receives.
    fn create_srq(&self, caps: SrqCaps) -> Result<P::Srq>;

    /// Creates an RC queue pair in RESET that receives from `srq` (`ibv_qp_init_attr.srq`):
    /// `caps.max_recv_wr` and `max_recv_sge` are ignored, [`Qp::post_recv`] is refused, and
    /// in ERROR the QP flushes its own send work only: the SRQ's receives stay posted for the
    /// other QPs. The receive CQ must hold the SRQ's `max_wr` completions once (the soft
    /// provider: every QP of one SRQ uses the same receive CQ).
    ///
    /// # Errors
    /// As [`Pd::create_qp`]; [`ErrorKind::WrongPd`] when `srq` belongs to another protection
    /// domain; [`ErrorKind::InvalidArgument`] (soft) when the receive CQ is not the SRQ's.
    fn create_qp_on_srq(
        &self,
        send_cq: &P::Cq,
        recv_cq: &P::Cq,
        caps: QpCaps,
        srq: &P::Srq,
    ) -> Result<P::Qp>;
}

/// Checks the arguments of [`Pd::bind_window`] against the region's length and rights (the
/// same rules on every provider): a non-empty range inside the region, remote rights only and
/// at least one, remote write or atomic only on a region with [`Access::LOCAL_WRITE`].
pub(crate) fn check_window(
    region_len: usize,
    region_access: Access,
    offset: usize,
    len: usize,
    access: Access,
) -> Result<()> {
    let bad = |detail: String| {
        Err(VerbsError::new(
            Verb::BindMw,
            ErrorKind::InvalidArgument,
            detail,
        ))
    };
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > region_len) {
        return bad(format!(
            "window [{offset}, +{len}) is empty or outside the {region_len}-byte region"
        ));
    }
    let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    if access == Access::NONE || !remote.contains(access) {
        return bad(format!(
            "a window grants remote rights only, and at least one (asked {access:?})"
        ));
    }
    let writes = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    if access.bits() & writes.bits() != 0 && !region_access.contains(Access::LOCAL_WRITE) {
        return bad("a remote write or atomic window needs a region with LOCAL_WRITE".into());
    }
    Ok(())
}

/// Whom a memory window is for: the peer of a connected queue pair, as
/// [`Qp::window_target`] names it. A plain value, so that code without the QP at hand (the
/// owner of an explicit region, on any thread) can lend memory to that peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowTarget {
    /// The device the QP belongs to (soft: its RNIC's nonce; ib: 0).
    pub(crate) device: u64,
    /// The peer's RNIC (soft: its nonce, 0 before RTR; ib: 0, windows are PD-wide).
    pub(crate) peer: u64,
}

/// A registered memory region (`ibv_mr`). Dropping it deregisters it (and frees the memory of a
/// region made by [`Pd::alloc_mr`]).
pub trait Mr: Send + Sync + fmt::Debug {
    /// Start address in this process (what SGEs and remote operations name).
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty (never true: zero-length registrations are refused).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
    /// Access rights.
    fn access(&self) -> Access;

    /// Pointer to the first byte.
    fn as_ptr(&self) -> *mut u8 {
        self.addr() as *mut u8
    }

    /// What a peer needs to address the whole region.
    fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }

    /// An SGE for `[offset, offset + len)`, or `None` when the range is outside the region.
    fn sge(&self, offset: usize, len: u32) -> Option<Sge> {
        let end = offset.checked_add(len as usize)?;
        if end > self.len() {
            return None;
        }
        Some(Sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.lkey(),
        })
    }
}

/// A completion channel (`ibv_comp_channel`). Its file descriptor becomes readable when a CQ
/// armed with [`Cq::req_notify`] gets a completion, so it can be registered with epoll/tokio.
pub trait CompChannel: Send + Sync + fmt::Debug + AsRawFd {
    /// Sleeps until an armed CQ of this channel has an event or `timeout` passes; consumes and
    /// acknowledges the events (`ibv_get_cq_event` + `ibv_ack_cq_events`). Returns whether an
    /// event arrived.
    ///
    /// The canonical loop: poll until empty, [`Cq::req_notify`], poll once more (a completion
    /// may have landed before arming), then `wait`.
    ///
    /// # Errors
    /// When the underlying descriptor fails.
    fn wait(&self, timeout: Option<Duration>) -> Result<bool>;

    /// Consumes pending events without blocking; returns how many there were.
    ///
    /// # Errors
    /// When the underlying descriptor fails.
    fn drain(&self) -> Result<u32>;

    /// The descriptor, borrowed (for `poll(2)` sets).
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor is owned by `self` and stays open while the borrow lives.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

/// A completion queue (`ibv_cq`).
pub trait Cq: Send + Sync + fmt::Debug {
    /// Polls up to `wcs.len()` completions into `wcs`; returns how many (`ibv_poll_cq`).
    /// No allocation, no system call, no lock.
    ///
    /// # Errors
    /// When the CQ itself failed (overrun, corrupt shared state): not for failed work
    /// requests, which arrive as completions with an error [`WcStatus`].
    fn poll(&mut self, wcs: &mut [Wc]) -> Result<usize>;

    /// Arms the CQ: the next completion (or the next solicited one) raises an event on the
    /// completion channel (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// When the CQ has no channel.
    fn req_notify(&self, solicited_only: bool) -> Result<()>;

    /// Capacity in completions.
    fn capacity(&self) -> u32;

    /// Completions QPs may still reserve on this CQ: its capacity minus the queue depths of
    /// the QPs attached (and, once, of each SRQ whose QPs receive here). A QP whose queues
    /// need more is refused with [`ErrorKind::ExceedsCaps`], so the CQ cannot overrun. A
    /// destroyed QP's room is back once the CQ was polled after it (the soft RNIC's CQ lets
    /// go of the QP there).
    fn room(&self) -> u32;

    /// Grows the CQ to hold at least `cqe` completions (`ibv_resize_cq`), keeping those it
    /// holds: QPs created afterwards may reserve the new room. A server grows its CQ as
    /// connections come instead of sizing it for the most it may ever hold.
    ///
    /// # Errors
    /// [`ErrorKind::ExceedsCaps`] over [`Caps::max_cqe`]; [`ErrorKind::InvalidArgument`]
    /// below the current capacity (CQs only grow); the device's error otherwise.
    fn resize(&mut self, cqe: u32) -> Result<()>;
}

/// Checks a [`Cq::resize`] request against the current capacity and the device's limit (the
/// same rules on every provider).
pub(crate) fn check_resize(current: u32, cqe: u32, max_cqe: u32) -> Result<()> {
    if cqe > max_cqe {
        return Err(VerbsError::new(
            Verb::ResizeCq,
            ErrorKind::ExceedsCaps,
            format!("CQ of {cqe} entries: the device allows at most {max_cqe}"),
        ));
    }
    if cqe < current {
        return Err(VerbsError::new(
            Verb::ResizeCq,
            ErrorKind::InvalidArgument,
            format!("CQ of {current} entries cannot shrink to {cqe}: CQs only grow"),
        ));
    }
    Ok(())
}

/// A reliable-connected queue pair (`ibv_qp` of type `IBV_QPT_RC`).
///
/// State transitions follow the RC state machine; posting in a state that does not allow it is
/// an error (`post_recv` needs INIT, RTR or RTS; `post_send` needs RTS), never undefined. In
/// ERROR every posted and every later work request completes with `WR_FLUSH_ERR`.
pub trait Qp: Send + Sync + fmt::Debug {
    /// QP number.
    fn qp_num(&self) -> u32;

    /// Current state (it can move to ERROR at any time on a failure).
    fn state(&self) -> QpState;

    /// The sizes actually granted at creation.
    fn caps(&self) -> QpCaps;

    /// What the peer needs to connect to this QP (send it out of band).
    fn endpoint(&self) -> Endpoint;

    /// The peer windows are bound to ([`Pd::bind_window_to`]); meaningful once connected.
    fn window_target(&self) -> WindowTarget;

    /// RESET -> INIT, granting `access` to the peer (`qp_access_flags`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidState`] unless in RESET.
    fn modify_to_init(&mut self, access: Access) -> Result<()>;

    /// INIT -> RTR with the peer's endpoint: after this, inbound traffic from that peer is
    /// accepted. The path MTU is the minimum of `attr.path_mtu` and both ends' active MTU.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidState`] unless in INIT; [`ErrorKind::InvalidEndpoint`] when the
    /// endpoint is for another provider, forged or stale (no such peer or QP).
    fn modify_to_rtr(&mut self, remote: &Endpoint, attr: &ConnectAttr) -> Result<()>;

    /// RTR -> RTS: sends may be posted.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidState`] unless in RTR.
    fn modify_to_rts(&mut self, attr: &ConnectAttr) -> Result<()>;

    /// Any state -> ERROR: outstanding work requests are flushed with `WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// When the provider fails to change the state.
    fn modify_to_error(&mut self) -> Result<()>;

    /// Any state -> RESET: queues are emptied without completions.
    ///
    /// # Errors
    /// When the provider fails to change the state.
    fn modify_to_reset(&mut self) -> Result<()>;

    /// RESET/INIT -> INIT -> RTR -> RTS in one call.
    ///
    /// # Errors
    /// As the three transitions.
    fn connect(&mut self, remote: &Endpoint, attr: &ConnectAttr) -> Result<()> {
        if self.state() == QpState::Reset {
            self.modify_to_init(attr.access)?;
        }
        self.modify_to_rtr(remote, attr)?;
        self.modify_to_rts(attr)
    }

    /// Posts send work requests (`ibv_post_send`). No allocation, no system call, no lock.
    ///
    /// # Errors
    /// A [`PostError`] saying how many were posted and why the next was refused:
    /// [`ErrorKind::QueueFull`] is back-pressure (poll, then post the rest);
    /// [`ErrorKind::InvalidState`] before RTS; [`ErrorKind::InvalidArgument`] for too many
    /// SGEs, inline data over the limit, or an unaligned atomic.
    ///
    /// # Safety
    /// Every SGE of a non-inline request must name memory of a live region of this QP's PD
    /// that stays valid, and (for READ and atomic results) is not accessed by Rust code, until
    /// the request's completion has been polled, or until the QP has been moved to ERROR and
    /// its flush completion polled, or the QP destroyed. Unsignaled requests complete when a
    /// later signaled request on the same QP completes.
    unsafe fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<(), PostError>;

    /// Posts receive work requests (`ibv_post_recv`). No allocation, no system call, no lock.
    ///
    /// # Errors
    /// As [`Qp::post_send`]; [`ErrorKind::InvalidState`] in RESET. In ERROR the request is
    /// accepted and completes with `WR_FLUSH_ERR`, as in verbs.
    ///
    /// # Safety
    /// Every SGE must name memory of a live region with `LOCAL_WRITE` that stays valid and is
    /// not accessed by Rust code until the receive's completion has been polled (or the QP has
    /// been destroyed).
    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
}

/// A shared receive queue (`ibv_srq`), the receive queue of any number of QPs of its
/// protection domain. Dropping it while QPs still use it keeps it alive until the last of
/// them is destroyed (verbs refuses to destroy a busy SRQ).
pub trait Srq: Send + Sync + fmt::Debug {
    /// The number naming it in [`AsyncEvent::SrqLimitReached`] (unique per context).
    fn srq_num(&self) -> u32;

    /// The sizes granted at creation.
    fn caps(&self) -> SrqCaps;

    /// Arms the limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): once fewer than `limit`
    /// posted receives remain unconsumed, one [`AsyncEvent::SrqLimitReached`] is raised on
    /// the context ([`Context::poll_async_event`]) and the limit is disarmed until armed
    /// again. 0 disarms.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `limit` exceeds [`SrqCaps::max_wr`].
    fn arm_limit(&mut self, limit: u32) -> Result<()>;

    /// Posts receives (`ibv_post_srq_recv`). No allocation, no system call, no lock.
    ///
    /// # Errors
    /// [`ErrorKind::QueueFull`] when `max_wr` receives are posted and not yet polled;
    /// [`ErrorKind::InvalidArgument`] for too many SGEs.
    ///
    /// # Safety
    /// As [`Qp::post_recv`]: every SGE names live memory of a region with `LOCAL_WRITE` of the
    /// SRQ's protection domain, untouched by Rust code until the receive's completion has
    /// been polled (or every QP of the SRQ and the SRQ itself are destroyed).
    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
}

registry::providers!(@each kind {});
pub(crate) use registry::{any_provider, with_any};

/// Something to run with a provider type chosen at run time: see [`ProviderKind::visit`].
pub trait ProviderVisitor {
    /// What the visit returns.
    type Output;
    /// Runs with `P` as the provider.
    fn visit<P: Provider>(self) -> Self::Output;
}

impl ProviderKind {
    /// The environment variable naming the provider (`soft` or `ib`).
    pub const ENV: &'static str = "RPC_PROVIDER";

    /// The provider named by `RPC_PROVIDER`, or [`ProviderKind::Soft`] when unset.
    ///
    /// # Errors
    /// When the variable names an unknown provider, or `ib` in a build without `ibverbs`.
    pub fn from_env() -> Result<ProviderKind> {
        match std::env::var(Self::ENV) {
            Ok(v) => v.parse(),
            Err(_) => Ok(ProviderKind::Soft),
        }
    }
}

impl std::str::FromStr for ProviderKind {
    type Err = VerbsError;

    fn from_str(s: &str) -> Result<ProviderKind> {
        let s = s.trim().to_ascii_lowercase();
        if s.is_empty() {
            return Ok(ProviderKind::ALL[0]);
        }
        match ProviderKind::lookup(&s) {
            Some(kind) if kind.is_compiled() => Ok(kind),
            Some(kind) => Err(kind.not_compiled()),
            None => {
                let names: Vec<&str> = ProviderKind::ALL.iter().map(|k| k.name()).collect();
                Err(VerbsError::new(
                    Verb::OpenDevice,
                    ErrorKind::InvalidArgument,
                    format!(
                        "unknown provider {s:?}: RPC_PROVIDER must be one of {}",
                        names.join(", ")
                    ),
                ))
            }
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
