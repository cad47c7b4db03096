//! RC queue pairs: `ibv_create_qp`, the RESET -> INIT -> RTR -> RTS transitions with the
//! peer's [`Endpoint`] (GRH on RoCE, LID on InfiniBand), and `ibv_post_send` /
//! `ibv_post_recv` with work-request chains built on the stack.

use std::borrow::Cow;
use std::fmt;
use std::mem::{MaybeUninit, offset_of, size_of};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdma_sys::{
    ibv_alloc_pd, ibv_cq, ibv_create_cq, ibv_create_qp, ibv_dealloc_pd, ibv_destroy_cq,
    ibv_destroy_qp, ibv_gid, ibv_modify_qp, ibv_post_recv, ibv_post_send, ibv_qp, ibv_qp_attr,
    ibv_qp_attr_mask, ibv_qp_cap, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_qp,
    ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
};

use super::chain::post_chain;
use super::cq::{CqShared, IbCq};
use super::device::{RawContext, last_errno, ret_errno};
use super::ledger::{Ledger, RECV_TAG};
use super::mr::{IbPd, PdShared};
use super::select::{self, GidAddr};
use super::srq::{IbSrq, SrqShared};
use crate::verbs::error::{ErrorKind, PostError, Verb, VerbsError};
use crate::verbs::types::{
    Access, ConnectAttr, Endpoint, QpCaps, QpState, RecvWr, SendFlags, SendWr, Sge, WrOp,
};
use crate::verbs::{Qp, Result};

/// Work requests handed to one `ibv_post_send`/`ibv_post_recv` call: the size of the stack
/// array the chain is built in (16 x 128 bytes for sends).
pub const POST_BATCH: usize = 16;

/// Hop limit of our GRH (RoCE v2: the IP TTL), as NCCL sets it.
const HOP_LIMIT: u8 = 255;

// Our `Sge` is handed to libibverbs as `ibv_sge` without copying: the layouts must match.
const _: () = {
    assert!(size_of::<Sge>() == size_of::<ibv_sge>());
    assert!(std::mem::align_of::<Sge>() == std::mem::align_of::<ibv_sge>());
    assert!(offset_of!(Sge, addr) == offset_of!(ibv_sge, addr));
    assert!(offset_of!(Sge, length) == offset_of!(ibv_sge, length));
    assert!(offset_of!(Sge, lkey) == offset_of!(ibv_sge, lkey));
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(POST_BATCH >= 1);
};

/// An RC queue pair (`ibv_qp`, `IBV_QPT_RC`).
pub struct IbQp {
    qp: NonNull<ibv_qp>,
    qp_num: u32,
    /// Our view of the state, changed only by our transitions (the device may move the QP
    /// to ERROR behind it; `Qp::state` asks the device).
    state: QpState,
    caps: QpCaps,
    psn: u32,
    path_mtu: u32,
    remote: Option<Endpoint>,
    /// Outstanding work and the callers' `wr_id`s, shared with the CQs (see `ledger`).
    ledger: Arc<Ledger>,
    /// Send and receive requests handed to the device so far (the next sequence numbers).
    send_posted: u64,
    recv_posted: u64,
    pd: Arc<PdShared>,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    /// The SRQ the QP receives from (its receive queue is then the SRQ's).
    srq: Option<Arc<SrqShared>>,
}

// SAFETY: the QP handle is used for posting and transitions only through `&mut IbQp` (one
// owner), for `ibv_query_qp` through `&IbQp` (thread-safe in libibverbs) and by Drop.
unsafe impl Send for IbQp {}
// SAFETY: as above: `&IbQp` only reads plain data or calls the thread-safe `ibv_query_qp`.
unsafe impl Sync for IbQp {}

impl fmt::Debug for IbQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbQp")
            .field("qp_num", &format_args!("{:#x}", self.qp_num))
            .field("device", &self.pd.ctx.label())
            .field("state", &self.state)
            .field("caps", &self.caps)
            .field("psn", &format_args!("{:#08x}", self.psn))
            .field("path_mtu", &self.path_mtu)
            .field("remote_qp", &self.remote.map(|r| r.qp_num))
            .field("srq", &self.srq.as_ref().map(|s| s.num))
            .finish()
    }
}

impl Drop for IbQp {
    fn drop(&mut self) {
        // SAFETY: the QP is ours and destroyed exactly once, before its CQs, SRQ and PD (held
        // by our Arcs, dropped after this). Outstanding work requests are the caller's
        // contract.
        let rc = unsafe { ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_destroy_qp failed");
        }
        self.send_cq.joins.remove(self.qp_num);
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.recv_cq.joins.remove(self.qp_num);
        }
        if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.send_cq
                .release(self.caps.max_send_wr.saturating_add(self.caps.max_recv_wr));
        } else {
            self.send_cq.release(self.caps.max_send_wr);
            self.recv_cq.release(self.caps.max_recv_wr);
        }
        if let Some(srq) = &self.srq {
            srq.leave_cq(&self.recv_cq);
        }
    }
}

fn exceeds(what: &str, want: u32, max: u32, dev: &str) -> VerbsError {
    VerbsError::new(
        Verb::CreateQp,
        ErrorKind::ExceedsCaps,
        format!("{what} = {want} exceeds the device limit {max} on {dev}"),
    )
}

/// A random 24-bit initial packet sequence number.
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: `b` is a valid 4-byte buffer for the duration of the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let v = if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        // No entropy source: any value works (the PSN only has to match the peer's view).
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5eed, |d| d.subsec_nanos())
    };
    v & 0x00ff_ffff
}

fn qp_state_from_raw(s: u32) -> QpState {
    match s {
        ibv_qp_state::IBV_QPS_RESET => QpState::Reset,
        ibv_qp_state::IBV_QPS_INIT => QpState::Init,
        ibv_qp_state::IBV_QPS_RTR => QpState::Rtr,
        // SQD (draining) still sends what was posted: closest to RTS.
        ibv_qp_state::IBV_QPS_RTS | ibv_qp_state::IBV_QPS_SQD => QpState::Rts,
        _ => QpState::Error,
    }
}

/// Reserves room for every completion a QP with `caps` can generate on its CQs; for a QP on
/// `srq`, the SRQ's receives once per receive CQ (its `caps` have no receive queue).
fn commit(
    send_cq: &CqShared,
    recv_cq: &CqShared,
    caps: &QpCaps,
    srq: Option<&SrqShared>,
) -> Result<()> {
    if let Some(srq) = srq {
        send_cq.commit(caps.max_send_wr)?;
        return srq
            .join_cq(recv_cq)
            .inspect_err(|_| send_cq.release(caps.max_send_wr));
    }
    if std::ptr::eq(send_cq, recv_cq) {
        return send_cq.commit(caps.max_send_wr.saturating_add(caps.max_recv_wr));
    }
    send_cq.commit(caps.max_send_wr)?;
    recv_cq
        .commit(caps.max_recv_wr)
        .inspect_err(|_| send_cq.release(caps.max_send_wr))
}

impl IbQp {
    /// Creates a QP; on `srq`, the receive sizes of `caps` are ignored (taken as 0).
    pub(super) fn create(
        pd: &IbPd,
        send_cq: &IbCq,
        recv_cq: &IbCq,
        mut caps: QpCaps,
        srq: Option<&IbSrq>,
    ) -> Result<IbQp> {
        let ctx = &pd.shared.ctx;
        let dev = ctx.label();
        let srq = srq.map(|s| &s.shared);
        if let Some(srq) = srq {
            if !Arc::ptr_eq(&srq.pd, &pd.shared) {
                return Err(VerbsError::new(
                    Verb::CreateQp,
                    ErrorKind::WrongPd,
                    format!(
                        "SRQ {:#x} belongs to another protection domain (on {}): a QP receives \
                         only from an SRQ of its own PD",
                        srq.num,
                        srq.pd.ctx.label()
                    ),
                ));
            }
            caps.max_recv_wr = 0;
            caps.max_recv_sge = 0;
        }
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.shared.ctx, ctx) {
                return Err(VerbsError::new(
                    Verb::CreateQp,
                    ErrorKind::WrongPd,
                    format!(
                        "a CQ belongs to {}, the PD to {dev}: QP, PD and CQs must share a device",
                        cq.shared.ctx.label()
                    ),
                ));
            }
        }
        let dc = &ctx.caps;
        let checks = [
            ("max_send_wr", caps.max_send_wr, dc.max_qp_wr),
            ("max_recv_wr", caps.max_recv_wr, dc.max_qp_wr),
            ("max_send_sge", caps.max_send_sge, dc.max_sge),
            ("max_recv_sge", caps.max_recv_sge, dc.max_sge),
            ("max_inline_data", caps.max_inline_data, dc.max_inline),
        ];
        for (what, want, max) in checks {
            if want > max {
                return Err(exceeds(what, want, max, &dev));
            }
        }
        if caps.max_send_wr == 0 && caps.max_recv_wr == 0 && srq.is_none() {
            return Err(VerbsError::new(
                Verb::CreateQp,
                ErrorKind::InvalidArgument,
                "a QP with neither send nor receive queue",
            ));
        }
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.shared.cq.as_ptr(),
            recv_cq: recv_cq.shared.cq.as_ptr(),
            srq: srq.map_or(std::ptr::null_mut(), |s| s.srq.as_ptr()),
            cap: ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD, both CQs and the SRQ (if any) are alive and of one device (checked
        // above), and stay alive as long as the QP through the Arcs it keeps; `init` is a
        // valid attribute block.
        let qp = unsafe { ibv_create_qp(pd.shared.pd.as_ptr(), &mut init) };
        let Some(qp) = NonNull::new(qp) else {
            let e = last_errno();
            let why = match e {
                libc::ENOMEM => format!(
                    "out of memory for the queues of a QP with {caps:?} on {dev}: lower the \
                     depths or raise RLIMIT_MEMLOCK ({})",
                    super::mr::MEMLOCK_FIX
                ),
                libc::EINVAL => format!(
                    "{dev} rejected {caps:?} (device caps: {dc:?}); lower the depths, SGEs or \
                     inline size"
                ),
                _ => format!("cannot create a QP on {dev}"),
            };
            return Err(VerbsError::from_errno(Verb::CreateQp, e, why));
        };
        // SAFETY: `qp` was just returned by libibverbs; `qp_num` is immutable.
        let qp_num = unsafe { (*qp.as_ptr()).qp_num };
        // The device may grant more than asked (mlx5, and rxe since Linux 6.2, report their
        // rounded-up rings: 2^n - 1). The provider accounts for what was asked, on every
        // provider alike: `caps()` reports it and the CQs reserve room for it, so code sized
        // for one provider is admitted on the others; the device's extra room is slack.
        if let Err(e) = commit(&send_cq.shared, &recv_cq.shared, &caps, srq.map(|s| &**s)) {
            // SAFETY: the QP was just created, nothing was posted; destroyed once.
            unsafe { ibv_destroy_qp(qp.as_ptr()) };
            return Err(e);
        }
        let g = &init.cap;
        tracing::debug!(
            "NET/IB : {dev} QP {qp_num:#x} created: {caps:?}; device rings: send {} recv {} \
             inline {}",
            g.max_send_wr,
            g.max_recv_wr,
            g.max_inline_data
        );
        let ledger = Arc::new(match srq {
            Some(s) => Ledger::on_srq(qp_num, caps.max_send_wr, Arc::clone(&s.slots)),
            None => Ledger::new(qp_num, caps.max_send_wr, caps.max_recv_wr),
        });
        send_cq.shared.joins.add(Arc::clone(&ledger));
        if !Arc::ptr_eq(&send_cq.shared, &recv_cq.shared) {
            recv_cq.shared.joins.add(Arc::clone(&ledger));
        }
        Ok(IbQp {
            qp,
            qp_num,
            state: QpState::Reset,
            caps,
            psn: random_psn(),
            path_mtu: 0,
            remote: None,
            ledger,
            send_posted: 0,
            recv_posted: 0,
            pd: Arc::clone(&pd.shared),
            send_cq: Arc::clone(&send_cq.shared),
            recv_cq: Arc::clone(&recv_cq.shared),
            srq: srq.map(Arc::clone),
        })
    }

    /// The path MTU chosen when the QP moved to RTR (0 before).
    pub fn path_mtu(&self) -> u32 {
        self.path_mtu
    }

    /// The peer this QP is connected to, once past RTR.
    pub fn remote(&self) -> Option<&Endpoint> {
        self.remote.as_ref()
    }

    /// `rxe0:1/RoCE`: the device and port of this QP.
    pub fn label(&self) -> String {
        self.pd.ctx.label()
    }

    fn modify(&mut self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str) -> Result<()> {
        // SAFETY: the QP is alive and only modified through `&mut self`; `attr` is a fully
        // initialised attribute block whose fields named by `mask` are set.
        let rc = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) };
        if rc != 0 {
            let e = ret_errno(rc);
            let why = match e {
                libc::EINVAL => format!(
                    "{what} on {} QP {:#x} rejected: the attributes are invalid for the device \
                     (RoCE: wrong GID index - see RPC_IB_GID_INDEX and rpc-doctor - or a GID of \
                     the wrong RoCE version; path MTU above the port MTU; rd_atomic above the \
                     device limit) or the transition is not allowed in the current state",
                    self.label(),
                    self.qp_num
                ),
                libc::ETIMEDOUT | libc::ENETUNREACH | libc::EHOSTUNREACH => format!(
                    "{what} on {}: no route to the peer's GID (RoCE: is the peer's IP reachable \
                     from this port's netdev? check `ip route get`)",
                    self.label()
                ),
                _ => format!("{what} on {} QP {:#x} failed", self.label(), self.qp_num),
            };
            return Err(VerbsError::from_errno(Verb::ModifyQp, e, why));
        }
        Ok(())
    }

    fn expect_state(&self, want: QpState, what: &'static str) -> Result<()> {
        if self.state == want {
            return Ok(());
        }
        Err(VerbsError::new(
            Verb::ModifyQp,
            ErrorKind::InvalidState,
            format!(
                "{what} needs the QP in {want:?}, it is in {:?} (QP {:#x})",
                self.state, self.qp_num
            ),
        ))
    }

    fn check_remote(&self, remote: &Endpoint) -> Result<()> {
        let bad = |why: String| VerbsError::new(Verb::Connect, ErrorKind::InvalidEndpoint, why);
        if remote.provider != Endpoint::PROVIDER_IB {
            return Err(bad(format!(
                "the peer endpoint is for provider tag {} (not ib): both sides must use the same \
                 RPC_PROVIDER",
                remote.provider
            )));
        }
        if remote.qp_num == 0 || remote.qp_num > 0x00ff_ffff {
            return Err(bad(format!(
                "the peer QP number {:#x} is not a valid 24-bit QPN",
                remote.qp_num
            )));
        }
        if self.pd.ctx.is_roce() {
            if remote.gid == [0; 16] {
                return Err(bad(
                    "the peer endpoint has no GID, but this port is RoCE: the peer is on an \
                     InfiniBand port (link layers must match) or sent a forged endpoint"
                        .to_owned(),
                ));
            }
        } else if remote.lid == 0 {
            return Err(bad(
                "the peer endpoint has LID 0, but this port is InfiniBand: the peer is on a RoCE \
                 port (link layers must match), or its port has no LID yet (subnet manager)"
                    .to_owned(),
            ));
        }
        Ok(())
    }
}

/// A throw-away PD and CQ for probing; destroyed on drop (CQ first).
struct Probe {
    pd: NonNull<rdma_sys::ibv_pd>,
    cq: NonNull<ibv_cq>,
}

impl Probe {
    fn new(raw: &RawContext) -> Result<Probe, (&'static str, i32)> {
        // SAFETY: the context is open for the lifetime of the probe (the caller holds it).
        let pd = NonNull::new(unsafe { ibv_alloc_pd(raw.as_ptr()) })
            .ok_or(("ibv_alloc_pd", last_errno()))?;
        // SAFETY: as above; no channel, 4 entries.
        let cq = unsafe {
            ibv_create_cq(
                raw.as_ptr(),
                4,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let Some(cq) = NonNull::new(cq) else {
            let e = last_errno();
            // SAFETY: `pd` was just allocated, has no children and is freed once.
            unsafe { ibv_dealloc_pd(pd.as_ptr()) };
            return Err(("ibv_create_cq", e));
        };
        Ok(Probe { pd, cq })
    }

    /// Whether an RC QP with `inline` bytes of inline data can be created; the size the
    /// device granted.
    fn try_inline(&self, inline: u32) -> Option<u32> {
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.cq.as_ptr(),
            recv_cq: self.cq.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: 1,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: inline,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD and CQ are alive (owned by `self`) and of one context; `init` is a
        // valid attribute block.
        let qp = NonNull::new(unsafe { ibv_create_qp(self.pd.as_ptr(), &mut init) })?;
        // SAFETY: the QP was just created, nothing was posted to it; destroyed once.
        unsafe { ibv_destroy_qp(qp.as_ptr()) };
        Some(init.cap.max_inline_data.max(inline))
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // SAFETY: every probe QP was destroyed right after creation, so the CQ and then the
        // PD have no children; each is destroyed once.
        unsafe {
            ibv_destroy_cq(self.cq.as_ptr());
            ibv_dealloc_pd(self.pd.as_ptr());
        }
    }
}

/// Probes the largest inline size an RC QP of this device accepts (verbs does not report it),
/// by creating throw-away QPs (a binary search, about a dozen). Returns 0 when even a QP
/// without inline data cannot be created (the reason is logged).
pub(super) fn probe_max_inline(raw: &RawContext, name: &str, max: u32) -> u32 {
    let probe = match Probe::new(raw) {
        Ok(p) => p,
        Err((verb, errno)) => {
            tracing::warn!("NET/IB : {name}: cannot probe the inline size: {verb}: errno {errno}");
            return 0;
        }
    };
    if probe.try_inline(0).is_none() {
        tracing::warn!(
            "NET/IB : {name}: cannot create a test QP (errno {}): inline size taken as 0",
            last_errno()
        );
        return 0;
    }
    let (mut lo, mut hi) = (0u32, max);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if probe.try_inline(mid).is_some() {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    probe.try_inline(lo).unwrap_or(lo)
}

/// The error of a refused `ibv_post_send`/`ibv_post_recv`.
pub(super) fn post_errno(verb: Verb, errno: i32) -> VerbsError {
    match errno {
        // ENOMEM is the queue-full answer of every provider: back-pressure, no allocation.
        libc::ENOMEM => VerbsError::from_errno(verb, errno, ""),
        libc::EINVAL => VerbsError::from_errno(
            verb,
            errno,
            "the device rejected the work request: too many SGEs, inline data over the QP's \
             limit, an opcode the QP does not allow, or a QP in the wrong state",
        ),
        _ => VerbsError::from_errno(verb, errno, ""),
    }
}

/// The back-pressure answer at the depth asked for (`QueueFull`, as `ibv_post_*`'s ENOMEM;
/// no allocation: back-pressure is part of the data path).
fn queue_full(verb: Verb) -> VerbsError {
    VerbsError::from_errno(
        verb,
        libc::ENOMEM,
        Cow::Borrowed(
            "queue full at the depth the QP was created with (Qp::caps): poll completions \
             (unsignaled sends are freed by a later signaled one), then post the rest",
        ),
    )
}

fn wr_invalid(verb: Verb, why: &'static str) -> VerbsError {
    VerbsError::new(verb, ErrorKind::InvalidArgument, Cow::Borrowed(why))
}

impl IbQp {
    /// Checks one send work request against the QP (no allocation on success).
    fn check_send(&self, wr: &SendWr<'_>) -> Result<()> {
        if wr.sg_list.len() > self.caps.max_send_sge as usize {
            return Err(wr_invalid(
                Verb::PostSend,
                "more SGEs than the QP's max_send_sge",
            ));
        }
        if matches!(wr.op, WrOp::Read { .. }) && wr.sg_list.len() > self.pd.ctx.max_sge_rd as usize
        {
            return Err(wr_invalid(
                Verb::PostSend,
                "an RDMA READ with more SGEs than the device's max_sge_rd",
            ));
        }
        if wr.flags.contains(SendFlags::INLINE) {
            if !matches!(
                wr.op,
                WrOp::Send
                    | WrOp::SendWithImm { .. }
                    | WrOp::Write { .. }
                    | WrOp::WriteWithImm { .. }
            ) {
                return Err(wr_invalid(
                    Verb::PostSend,
                    "INLINE is only valid for SEND and RDMA WRITE",
                ));
            }
            let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if total > u64::from(self.caps.max_inline_data) {
                return Err(wr_invalid(
                    Verb::PostSend,
                    "inline payload larger than the QP's max_inline_data",
                ));
            }
        }
        if let WrOp::CompareSwap { remote_addr, .. } | WrOp::FetchAdd { remote_addr, .. } = wr.op {
            if !self.pd.ctx.caps.atomics {
                return Err(VerbsError::new(
                    Verb::PostSend,
                    ErrorKind::Unsupported,
                    "this device does not support atomic operations (Caps::atomics is false)",
                ));
            }
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(wr_invalid(
                    Verb::PostSend,
                    "an atomic needs exactly one 8-byte SGE for the old value",
                ));
            }
            if remote_addr % 8 != 0 {
                return Err(wr_invalid(
                    Verb::PostSend,
                    "an atomic's remote address must be 8-byte aligned",
                ));
            }
        }
        Ok(())
    }
}

fn send_flags(f: SendFlags) -> u32 {
    let mut out = 0;
    for (ours, theirs) in [
        (SendFlags::SIGNALED, ibv_send_flags::IBV_SEND_SIGNALED),
        (SendFlags::INLINE, ibv_send_flags::IBV_SEND_INLINE),
        (SendFlags::FENCE, ibv_send_flags::IBV_SEND_FENCE),
        (SendFlags::SOLICITED, ibv_send_flags::IBV_SEND_SOLICITED),
    ] {
        if f.contains(ours) {
            out |= theirs.0;
        }
    }
    out
}

/// Builds the `ibv_send_wr` of one work request (its `next` is set when the chain is posted).
fn build_send(wr: &SendWr<'_>) -> ibv_send_wr {
    // SAFETY: all-zero bytes are a valid `ibv_send_wr` (integers, raw pointers, unions of
    // those).
    let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = wr.wr_id;
    w.sg_list = if wr.sg_list.is_empty() {
        std::ptr::null_mut()
    } else {
        // The layouts match (checked at compile time above). libibverbs takes a mutable
        // pointer for historical reasons; providers only read the SG list.
        wr.sg_list.as_ptr().cast::<ibv_sge>().cast_mut()
    };
    w.num_sge = wr.sg_list.len() as i32;
    w.send_flags = send_flags(wr.flags);
    match wr.op {
        WrOp::Send => w.opcode = ibv_wr_opcode::IBV_WR_SEND,
        WrOp::SendWithImm { imm } => {
            w.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            w.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        WrOp::Write { remote_addr, rkey } => {
            w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            w.wr.rdma = rdma_sys::rdma_t { remote_addr, rkey };
        }
        WrOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            w.wr.rdma = rdma_sys::rdma_t { remote_addr, rkey };
            w.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        WrOp::Read { remote_addr, rkey } => {
            w.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
            w.wr.rdma = rdma_sys::rdma_t { remote_addr, rkey };
        }
        WrOp::CompareSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => {
            w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
            w.wr.atomic = rdma_sys::atomic_t {
                remote_addr,
                compare_add: compare,
                swap,
                rkey,
            };
        }
        WrOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        } => {
            w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
            w.wr.atomic = rdma_sys::atomic_t {
                remote_addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        }
    }
    w
}

impl IbQp {
    /// Posts the first `n` prepared sends of `batch` as one chain; `base` is the index of
    /// `batch[0]` in the caller's list.
    ///
    /// # Safety
    /// `batch[..n]` must be initialised by [`build_send`] from work requests that satisfy
    /// [`Qp::post_send`]'s contract.
    unsafe fn flush_send(
        &mut self,
        batch: &mut [MaybeUninit<ibv_send_wr>; POST_BATCH],
        n: usize,
        base: usize,
    ) -> Result<(), PostError> {
        let qp = self.qp.as_ptr();
        // SAFETY: `batch[..n]` as the caller promises; the QP is alive and posted to only
        // through `&mut self`; the chain is valid, NULL-terminated work requests on our stack
        // that outlive the call, and the memory their SGEs name is the caller's contract.
        unsafe {
            post_chain(batch, n, &mut self.send_posted, |first, bad| {
                ibv_post_send(qp, first, bad)
            })
        }
        .map_err(|r| PostError {
            posted: base + r.taken,
            error: post_errno(Verb::PostSend, ret_errno(r.rc)),
        })
    }

    /// As [`IbQp::flush_send`] for receives.
    ///
    /// # Safety
    /// `batch[..n]` must be initialised from work requests that satisfy [`Qp::post_recv`]'s
    /// contract.
    unsafe fn flush_recv(
        &mut self,
        batch: &mut [MaybeUninit<ibv_recv_wr>; POST_BATCH],
        n: usize,
        base: usize,
    ) -> Result<(), PostError> {
        let qp = self.qp.as_ptr();
        // SAFETY: as in `flush_send`, for the receive queue.
        unsafe {
            post_chain(batch, n, &mut self.recv_posted, |first, bad| {
                ibv_post_recv(qp, first, bad)
            })
        }
        .map_err(|r| PostError {
            posted: base + r.taken,
            error: post_errno(Verb::PostRecv, ret_errno(r.rc)),
        })
    }
}

impl Qp for IbQp {
    fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Windows are registrations of the protection domain on ib: any of its QPs may use them.
    fn window_target(&self) -> crate::verbs::WindowTarget {
        crate::verbs::WindowTarget { device: 0, peer: 0 }
    }

    /// Asks the device (`ibv_query_qp`, one system call): a QP can move to ERROR on its own.
    /// Falls back to the last state we set when the query fails.
    fn state(&self) -> QpState {
        // SAFETY: all-zero bytes are valid attribute blocks (integers, pointers, unions).
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is alive; both out-pointers are valid; querying is thread-safe.
        let rc = unsafe {
            ibv_query_qp(
                self.qp.as_ptr(),
                &mut attr,
                ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        if rc == 0 {
            qp_state_from_raw(attr.qp_state)
        } else {
            self.state
        }
    }

    /// The sizes asked for at creation, which the device granted (it may have rounded its
    /// rings up; the provider accounts for the request, see the module docs).
    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn endpoint(&self) -> Endpoint {
        let ctx = &self.pd.ctx;
        Endpoint {
            provider: Endpoint::PROVIDER_IB,
            port: ctx.port.num,
            lid: ctx.port.lid,
            qp_num: self.qp_num,
            psn: self.psn,
            mtu: ctx.active_mtu_now(),
            gid: ctx.gid.gid,
            aux: u64::from(ctx.gid.index),
        }
    }

    fn modify_to_init(&mut self, access: Access) -> Result<()> {
        self.expect_state(QpState::Reset, "RESET->INIT")?;
        // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.pd.ctx.port.num;
        a.qp_access_flags = access.bits();
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, mask, "RESET->INIT")?;
        self.state = QpState::Init;
        Ok(())
    }

    fn modify_to_rtr(&mut self, remote: &Endpoint, attr: &ConnectAttr) -> Result<()> {
        self.expect_state(QpState::Init, "INIT->RTR")?;
        attr.validate()?;
        self.check_remote(remote)?;
        let ctx = Arc::clone(&self.pd.ctx);
        let mtu = select::path_mtu(ctx.active_mtu_now(), remote.mtu, attr.path_mtu)?;
        let sgid_index = u8::try_from(ctx.gid.index).map_err(|_| {
            VerbsError::new(
                Verb::ModifyQp,
                ErrorKind::InvalidArgument,
                format!(
                    "GID index {} does not fit the address vector (max 255): set \
                     RPC_IB_GID_INDEX to a lower index",
                    ctx.gid.index
                ),
            )
        })?;
        let dest_rd = u32::from(attr.max_dest_rd_atomic).min(ctx.max_dest_rd_atomic);
        // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = select::mtu_enum(mtu).unwrap_or(1);
        a.dest_qp_num = remote.qp_num;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = dest_rd as u8;
        a.min_rnr_timer = attr.min_rnr_timer;
        a.ah_attr.port_num = ctx.port.num;
        a.ah_attr.sl = ctx.service_level;
        a.ah_attr.dlid = remote.lid;
        if ctx.is_roce() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = sgid_index;
            a.ah_attr.grh.hop_limit = HOP_LIMIT;
            a.ah_attr.grh.traffic_class = ctx.traffic_class;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        let what = if ctx.is_roce() {
            format!(
                "INIT->RTR to peer QP {:#x} GID {} (our GID index {})",
                remote.qp_num,
                GidAddr(&remote.gid),
                ctx.gid.index
            )
        } else {
            format!(
                "INIT->RTR to peer QP {:#x} LID {:#x}",
                remote.qp_num, remote.lid
            )
        };
        self.modify(&mut a, mask, &what).map_err(|e| {
            // Our side (GID index, MTU, depths) was validated above: what the device refuses
            // here is the peer's address (a GID no route leads to, a LID it rejects).
            match e.errno() {
                Some(libc::EINVAL | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ETIMEDOUT) => {
                    VerbsError::new(
                        Verb::Connect,
                        ErrorKind::InvalidEndpoint,
                        format!(
                            "the device refused the peer's address: {e} (a forged or stale \
                             endpoint, a GID of another RoCE version, or no route to it)"
                        ),
                    )
                }
                _ => e,
            }
        })?;
        self.state = QpState::Rtr;
        self.path_mtu = mtu;
        self.remote = Some(*remote);
        Ok(())
    }

    fn modify_to_rts(&mut self, attr: &ConnectAttr) -> Result<()> {
        self.expect_state(QpState::Rtr, "RTR->RTS")?;
        attr.validate()?;
        let ctx = Arc::clone(&self.pd.ctx);
        let rd = u32::from(attr.max_rd_atomic).min(ctx.caps.max_rd_atomic);
        // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = ctx.transport.timeout.unwrap_or(attr.timeout);
        a.retry_cnt = ctx.transport.retry_cnt.unwrap_or(attr.retry_cnt);
        a.rnr_retry = attr.rnr_retry;
        a.sq_psn = self.psn;
        a.max_rd_atomic = rd as u8;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask, "RTR->RTS")?;
        self.state = QpState::Rts;
        let peer = self.remote.map_or(0, |r| r.qp_num);
        tracing::info!(
            "NET/IB : [{}]{} QP {:#x} -> RTS: connected to QP {peer:#x} via IB/{}/RC (MTU {}, \
             GID index {}, rd_atomic {rd})",
            ctx.rail,
            ctx.label(),
            self.qp_num,
            ctx.info.name,
            self.path_mtu,
            ctx.gid.index,
        );
        Ok(())
    }

    fn modify_to_error(&mut self) -> Result<()> {
        // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "->ERROR")?;
        self.state = QpState::Error;
        Ok(())
    }

    fn modify_to_reset(&mut self) -> Result<()> {
        // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "->RESET")?;
        // The device dropped every outstanding request without a completion.
        self.ledger.send.forget(self.send_posted);
        self.ledger.recv.forget(self.recv_posted);
        self.ledger.failed.store(false, Ordering::Relaxed);
        self.state = QpState::Reset;
        self.remote = None;
        self.path_mtu = 0;
        Ok(())
    }

    unsafe fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        if matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(PostError {
                posted: 0,
                error: VerbsError::new(
                    Verb::PostSend,
                    ErrorKind::InvalidState,
                    Cow::Borrowed("post_send before RTS: connect the QP first"),
                ),
            });
        }
        let mut batch: [MaybeUninit<ibv_send_wr>; POST_BATCH] =
            [const { MaybeUninit::uninit() }; POST_BATCH];
        let (mut n, mut base) = (0, 0);
        let mut room = self.ledger.send.room(self.send_posted);
        for (i, wr) in wrs.iter().enumerate() {
            if room == 0 {
                room = self.ledger.send.room(self.send_posted + n as u64);
            }
            let checked = if room == 0 {
                Err(queue_full(Verb::PostSend))
            } else {
                self.check_send(wr)
            };
            if let Err(error) = checked {
                // SAFETY: batch[..n] were built from the caller's requests (contract above).
                unsafe { self.flush_send(&mut batch, n, base)? };
                return Err(PostError { posted: i, error });
            }
            let seq = self.send_posted + n as u64;
            self.ledger.send.record(seq, wr.wr_id, wr.op.wc_opcode());
            let mut w = build_send(wr);
            w.wr_id = seq;
            batch[n].write(w);
            room -= 1;
            n += 1;
            if n == POST_BATCH {
                // SAFETY: as above.
                unsafe { self.flush_send(&mut batch, n, base)? };
                base += n;
                n = 0;
            }
        }
        // SAFETY: as above.
        unsafe { self.flush_send(&mut batch, n, base) }
    }

    unsafe fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        // Refused before anything else: the rxe re-flush below never runs for such a QP (its
        // receives are the SRQ's, which ERROR does not flush).
        if self.srq.is_some() {
            return Err(PostError {
                posted: 0,
                error: VerbsError::new(
                    Verb::PostRecv,
                    ErrorKind::InvalidArgument,
                    Cow::Borrowed("QP is on a shared receive queue: post to the SRQ"),
                ),
            });
        }
        if self.state == QpState::Reset {
            return Err(PostError {
                posted: 0,
                error: VerbsError::new(
                    Verb::PostRecv,
                    ErrorKind::InvalidState,
                    Cow::Borrowed("post_recv in RESET: move the QP to INIT first"),
                ),
            });
        }
        let mut batch: [MaybeUninit<ibv_recv_wr>; POST_BATCH] =
            [const { MaybeUninit::uninit() }; POST_BATCH];
        let (mut n, mut base) = (0, 0);
        let mut room = self.ledger.recv.room(self.recv_posted);
        for (i, wr) in wrs.iter().enumerate() {
            if room == 0 {
                room = self.ledger.recv.room(self.recv_posted + n as u64);
            }
            let refused = if room == 0 {
                Some(queue_full(Verb::PostRecv))
            } else if wr.sg_list.len() > self.caps.max_recv_sge as usize {
                Some(wr_invalid(
                    Verb::PostRecv,
                    "more SGEs than the QP's max_recv_sge",
                ))
            } else {
                None
            };
            if let Some(error) = refused {
                // SAFETY: batch[..n] were built from the caller's requests (contract above).
                unsafe { self.flush_recv(&mut batch, n, base)? };
                return Err(PostError { posted: i, error });
            }
            let seq = self.recv_posted + n as u64;
            self.ledger
                .recv
                .record(seq, wr.wr_id, crate::verbs::WcOpcode::Recv);
            room -= 1;
            batch[n].write(ibv_recv_wr {
                wr_id: seq | RECV_TAG,
                next: std::ptr::null_mut(),
                sg_list: if wr.sg_list.is_empty() {
                    std::ptr::null_mut()
                } else {
                    // Same layout (checked at compile time); providers only read the list.
                    wr.sg_list.as_ptr().cast::<ibv_sge>().cast_mut()
                },
                num_sge: wr.sg_list.len() as i32,
            });
            n += 1;
            if n == POST_BATCH {
                // SAFETY: as above.
                unsafe { self.flush_recv(&mut batch, n, base)? };
                base += n;
                n = 0;
            }
        }
        // SAFETY: as above.
        unsafe { self.flush_recv(&mut batch, n, base)? };
        // Did the device move the QP to ERROR on its own? An error completion of this QP
        // (routed to it by qp_num when its CQ was polled) says so: one relaxed load, no system
        // call, and never because of another QP's failure.
        if self.state != QpState::Error && self.ledger.failed.load(Ordering::Relaxed) {
            self.state = QpState::Error;
        }
        if self.state == QpState::Error && self.pd.ctx.quirks.reflush_recv {
            // A receive posted in ERROR must complete with WR_FLUSH_ERR. Soft-RoCE (Linux 6.1)
            // only flushes the receive queue when the QP enters ERROR, so enter it again
            // (ERROR -> ERROR is a legal transition; one system call, only on such a device
            // and only in this state: hardware flushes it on its own).
            // SAFETY: all-zero bytes are a valid `ibv_qp_attr`.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = ibv_qp_state::IBV_QPS_ERR;
            if let Err(e) = self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERROR->ERROR") {
                tracing::debug!("NET/IB : flushing receives posted in ERROR: {e}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_wr_encoding() {
        let sge = [Sge {
            addr: 0x1000,
            length: 8,
            lkey: 5,
        }];
        let w = build_send(&SendWr {
            wr_id: 9,
            op: WrOp::WriteWithImm {
                remote_addr: 0x2000,
                rkey: 7,
                imm: 0x0102_0304,
            },
            sg_list: &sge,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        });
        assert_eq!(w.wr_id, 9);
        assert_eq!(w.num_sge, 1);
        assert_eq!(w.opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(w.send_flags, 2 | 8);
        // SAFETY: test reads of the fields just written.
        unsafe {
            assert_eq!(
                w.imm_data_invalidated_rkey_union.imm_data,
                0x0102_0304u32.to_be()
            );
            assert_eq!((w.wr.rdma.remote_addr, w.wr.rdma.rkey), (0x2000, 7));
            assert_eq!((*w.sg_list).addr, 0x1000);
            assert_eq!((*w.sg_list).lkey, 5);
        }
        let w = build_send(&SendWr {
            wr_id: 1,
            op: WrOp::CompareSwap {
                remote_addr: 0x40,
                rkey: 3,
                compare: 10,
                swap: 20,
            },
            sg_list: &sge,
            flags: SendFlags::NONE,
        });
        assert_eq!(w.opcode, ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP);
        assert_eq!(w.send_flags, 0);
        // SAFETY: as above.
        unsafe {
            let a = w.wr.atomic;
            assert_eq!(
                (a.remote_addr, a.compare_add, a.swap, a.rkey),
                (0x40, 10, 20, 3)
            );
        }
        let w = build_send(&SendWr {
            wr_id: 2,
            op: WrOp::FetchAdd {
                remote_addr: 0x48,
                rkey: 3,
                add: 5,
            },
            sg_list: &[],
            flags: SendFlags::FENCE | SendFlags::SOLICITED,
        });
        assert_eq!(w.opcode, ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD);
        assert!(w.sg_list.is_null());
        assert_eq!(w.send_flags, 1 | 4);
    }

    #[test]
    fn qp_states() {
        assert_eq!(qp_state_from_raw(ibv_qp_state::IBV_QPS_RTS), QpState::Rts);
        assert_eq!(qp_state_from_raw(ibv_qp_state::IBV_QPS_ERR), QpState::Error);
        assert_eq!(qp_state_from_raw(ibv_qp_state::IBV_QPS_SQE), QpState::Error);
        assert_eq!(
            qp_state_from_raw(ibv_qp_state::IBV_QPS_RESET),
            QpState::Reset
        );
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..64 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }

    #[test]
    fn post_errors() {
        let e = post_errno(Verb::PostSend, libc::EINVAL);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("ibv_post_send"), "{e}");
    }
}
