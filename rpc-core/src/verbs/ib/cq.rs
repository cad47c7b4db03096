//! Completion channels and completion queues: `ibv_create_comp_channel` (non-blocking fd,
//! `poll(2)` with a timeout, events acknowledged at once), `ibv_create_cq`, `ibv_poll_cq`
//! mapped to [`Wc`], `ibv_req_notify_cq`.

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_ack_cq_events, ibv_comp_channel, ibv_cq, ibv_create_comp_channel, ibv_create_cq,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq,
    ibv_resize_cq, ibv_wc, ibv_wc_flags, ibv_wc_opcode,
};

use super::device::{CtxShared, IbContext, last_errno, ret_errno};
use super::ledger::{Joins, Routes};
use crate::verbs::error::{ErrorKind, Verb, VerbsError};
use crate::verbs::types::{Wc, WcFlags, WcOpcode, WcStatus};
use crate::verbs::{CompChannel, Cq, Result};

/// Completions fetched per `ibv_poll_cq` call (the stack array of [`Cq::poll`]).
pub const POLL_BATCH: usize = 32;

/// An owned `ibv_comp_channel`.
pub(super) struct ChanShared {
    ch: NonNull<ibv_comp_channel>,
    fd: RawFd,
    ctx: Arc<CtxShared>,
}

// SAFETY: a completion channel is a file descriptor plus a context pointer; libibverbs allows
// `ibv_get_cq_event` from any thread, and concurrent readers of the non-blocking fd each get
// whole events (the kernel hands out one event per read). Only Drop destroys it.
unsafe impl Send for ChanShared {}
// SAFETY: as above.
unsafe impl Sync for ChanShared {}

impl Drop for ChanShared {
    fn drop(&mut self) {
        // SAFETY: every CQ attached to the channel holds an `Arc<ChanShared>`, so none is
        // alive; destroyed exactly once, before the context (held by us) is closed.
        let rc = unsafe { ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion channel (`ibv_comp_channel`) with a non-blocking descriptor.
pub struct IbCompChannel {
    shared: Arc<ChanShared>,
}

impl fmt::Debug for IbCompChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbCompChannel")
            .field("fd", &self.shared.fd)
            .field("device", &self.shared.ctx.label())
            .finish()
    }
}

impl IbCompChannel {
    pub(super) fn create(ctx: &IbContext) -> Result<IbCompChannel> {
        // SAFETY: the context is open (held by `ctx.shared`).
        let ch = unsafe { ibv_create_comp_channel(ctx.shared.raw.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| {
            VerbsError::from_errno(
                Verb::CreateCompChannel,
                last_errno(),
                "cannot create a completion channel (out of file descriptors?)",
            )
        })?;
        // SAFETY: `ch` was just returned by libibverbs and is valid.
        let fd = unsafe { (*ch.as_ptr()).fd };
        // SAFETY: the channel owns `fd` and outlives this borrow.
        crate::fdtable::opened(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
        let shared = Arc::new(ChanShared {
            ch,
            fd,
            ctx: Arc::clone(&ctx.shared),
        });
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL only change its
        // status flags.
        let ok = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(VerbsError::from_errno(
                Verb::CreateCompChannel,
                last_errno(),
                "cannot make the completion channel non-blocking (fcntl)",
            ));
        }
        Ok(IbCompChannel { shared })
    }
}

impl AsRawFd for IbCompChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.fd
    }
}

impl CompChannel for IbCompChannel {
    fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        if self.drain()? > 0 {
            return Ok(true);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ms: i32 = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    // Round up, so that a sub-millisecond wait does not become a busy loop.
                    i32::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.shared.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = last_errno();
                if e == libc::EINTR {
                    continue;
                }
                return Err(VerbsError::from_errno(
                    Verb::GetCqEvent,
                    e,
                    "poll(2) on the completion channel failed",
                ));
            }
            if rc > 0 && self.drain()? > 0 {
                return Ok(true);
            }
            if rc == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }

    fn drain(&self) -> Result<u32> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut cq_ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive; the out-pointers are valid. The fd is non-blocking,
            // so this returns at once when no event is pending.
            let rc = unsafe { ibv_get_cq_event(self.shared.ch.as_ptr(), &mut cq, &mut cq_ctx) };
            if rc != 0 {
                let e = last_errno();
                if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                    return Ok(n);
                }
                if e == libc::EINTR {
                    continue;
                }
                return Err(VerbsError::from_errno(
                    Verb::GetCqEvent,
                    e,
                    "reading the completion channel failed",
                ));
            }
            // SAFETY: `cq` is the CQ the event is for; it cannot be destroyed before its events
            // are acknowledged (`ibv_destroy_cq` waits for them), so it is alive here.
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

/// An owned `ibv_cq`.
pub(super) struct CqShared {
    pub(super) cq: NonNull<ibv_cq>,
    pub(super) ctx: Arc<CtxShared>,
    /// The channel events go to (kept alive as long as the CQ).
    channel: Option<Arc<ChanShared>>,
    /// What QPs are admitted against (grows with `resize`).
    pub(super) capacity: AtomicU32,
    /// Completions the QPs attached to this CQ can have outstanding at once.
    committed: AtomicU64,
    /// QPs attached and detached since the poller last looked (see `ledger`).
    pub(super) joins: Joins,
}

// SAFETY: the CQ handle is used for polling only through `&mut IbCq` (one poller), for arming
// (`ibv_req_notify_cq`, thread-safe in libibverbs) and by Drop; the rest is plain data and an
// atomic.
unsafe impl Send for CqShared {}
// SAFETY: as above.
unsafe impl Sync for CqShared {}

impl CqShared {
    /// Reserves room for `n` more outstanding completions; refuses when the CQ could
    /// overrun.
    pub(super) fn commit(&self, n: u32) -> Result<()> {
        let cap = u64::from(self.capacity.load(Ordering::Acquire));
        self.committed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                (c + u64::from(n) <= cap).then_some(c + u64::from(n))
            })
            .map(|_| ())
            .map_err(|c| {
                VerbsError::new(
                    Verb::CreateQp,
                    ErrorKind::ExceedsCaps,
                    format!(
                        "the CQ ({cap} entries) is too small: its QPs already need {c} and this \
                         QP {n} more; a CQ overrun would break every QP on it, so create a \
                         larger CQ (up to Caps::max_cqe) or smaller queues"
                    ),
                )
            })
    }

    /// Returns what [`CqShared::commit`] reserved.
    pub(super) fn release(&self, n: u32) {
        self.committed.fetch_sub(u64::from(n), Ordering::AcqRel);
    }
}

impl Drop for CqShared {
    fn drop(&mut self) {
        // SAFETY: every QP attached to this CQ holds an `Arc<CqShared>`, so none is alive;
        // every event of this CQ was acknowledged when it was read (`drain`); destroyed
        // exactly once, before its channel and context (held by us).
        let rc = unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_destroy_cq failed");
        }
    }
}

/// A completion queue (`ibv_cq`).
pub struct IbCq {
    pub(super) shared: Arc<CqShared>,
    /// The ledgers of the QPs attached, by `qp_num` (owned by the poller).
    routes: Routes,
}

impl fmt::Debug for IbCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbCq")
            .field("device", &self.shared.ctx.label())
            .field("capacity", &self.shared.capacity.load(Ordering::Relaxed))
            .field("committed", &self.shared.committed.load(Ordering::Relaxed))
            .field("channel", &self.shared.channel.as_ref().map(|c| c.fd))
            .finish()
    }
}

impl IbCq {
    pub(super) fn create(
        ctx: &IbContext,
        cqe: u32,
        channel: Option<&IbCompChannel>,
    ) -> Result<IbCq> {
        let max = ctx.shared.caps.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(VerbsError::new(
                Verb::CreateCq,
                ErrorKind::ExceedsCaps,
                format!(
                    "CQ of {cqe} entries: want 1..={max} on {}",
                    ctx.shared.label()
                ),
            ));
        }
        if let Some(ch) = channel
            && !Arc::ptr_eq(&ch.shared.ctx, &ctx.shared)
        {
            return Err(VerbsError::new(
                Verb::CreateCq,
                ErrorKind::WrongPd,
                format!(
                    "the completion channel belongs to {}, not to {}",
                    ch.shared.ctx.label(),
                    ctx.shared.label()
                ),
            ));
        }
        let ch_ptr = channel.map_or(std::ptr::null_mut(), |c| c.shared.ch.as_ptr());
        // SAFETY: the context is open; `ch_ptr` is NULL or a live channel of the same context
        // (checked above), which the CQ keeps alive through its Arc; cqe is in range.
        let cq = unsafe {
            ibv_create_cq(
                ctx.shared.raw.as_ptr(),
                cqe as i32,
                std::ptr::null_mut(),
                ch_ptr,
                0,
            )
        };
        let cq = NonNull::new(cq).ok_or_else(|| {
            VerbsError::from_errno(
                Verb::CreateCq,
                last_errno(),
                format!(
                    "cannot create a CQ of {cqe} entries on {} (out of device resources or \
                     RLIMIT_MEMLOCK too low for its ring)",
                    ctx.shared.label()
                ),
            )
        })?;
        // SAFETY: `cq` is valid; `cqe` holds the size the device granted (>= requested).
        let granted = unsafe { (*cq.as_ptr()).cqe };
        tracing::debug!(
            "NET/IB : {} CQ of {cqe} entries (device granted {granted})",
            ctx.label()
        );
        Ok(IbCq {
            shared: Arc::new(CqShared {
                cq,
                ctx: Arc::clone(&ctx.shared),
                channel: channel.map(|c| Arc::clone(&c.shared)),
                // What was asked for, not what the device rounded up to (rxe: 2n - 1): QPs are
                // admitted against the same capacity on every provider, and the device has at
                // least this much room.
                capacity: AtomicU32::new(cqe),
                committed: AtomicU64::new(0),
                joins: Joins::default(),
            }),
            routes: Routes::default(),
        })
    }
}

/// Maps one `ibv_wc` to our [`Wc`] (status and opcode numbers are the verbs ones; immediate
/// data arrives in network order and is returned in host order). `wr_id` is the device-level
/// one; the caller's is put in by [`IbCq::poll`].
///
/// An error completion defines only `wr_id`, `status`, `qp_num` and `vendor_err` (verbs
/// leaves the opcode, length, flags and immediate data undefined): only those are read;
/// the opcode is `fallback` (from the request: see `ledger`), the rest zero.
pub(super) fn wc_from_raw(w: &ibv_wc, fallback: WcOpcode) -> Wc {
    let status = WcStatus::from_u32(w.status);
    if status != WcStatus::Success {
        return Wc {
            wr_id: w.wr_id,
            status,
            opcode: fallback,
            flags: WcFlags::NONE,
            byte_len: 0,
            imm_data: 0,
            qp_num: w.qp_num,
            vendor_err: w.vendor_err,
        };
    }
    let with_imm = w.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    let opcode = match w.opcode {
        ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        ibv_wc_opcode::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
        ibv_wc_opcode::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
        ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => fallback,
    };
    let imm_data = if with_imm {
        // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate data (a plain u32;
        // every bit pattern is valid either way).
        u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })
    } else {
        0
    };
    Wc {
        wr_id: w.wr_id,
        status,
        opcode,
        flags: if with_imm {
            WcFlags::WITH_IMM
        } else {
            WcFlags::NONE
        },
        byte_len: w.byte_len,
        imm_data,
        qp_num: w.qp_num,
        vendor_err: 0,
    }
}

impl Cq for IbCq {
    fn poll(&mut self, wcs: &mut [Wc]) -> Result<usize> {
        let mut raw: [MaybeUninit<ibv_wc>; POLL_BATCH] =
            [const { MaybeUninit::uninit() }; POLL_BATCH];
        let mut done = 0;
        while done < wcs.len() {
            let want = (wcs.len() - done).min(POLL_BATCH);
            // SAFETY: the CQ is alive and polled only through `&mut self`; `raw` has room for
            // `want` <= POLL_BATCH completions, which the provider writes before returning
            // their count.
            let n = unsafe {
                ibv_poll_cq(
                    self.shared.cq.as_ptr(),
                    want as i32,
                    raw.as_mut_ptr().cast(),
                )
            };
            if n < 0 {
                return Err(VerbsError::new(
                    Verb::PollCq,
                    ErrorKind::Os,
                    format!(
                        "ibv_poll_cq returned {n}: the CQ is in error (overrun: more outstanding \
                         completions than its {} entries?)",
                        self.shared.capacity.load(Ordering::Relaxed)
                    ),
                ));
            }
            let n = (n as usize).min(want);
            let mut kept = 0;
            for src in &raw[..n] {
                // SAFETY: the provider initialised the first `n` entries.
                let w = unsafe { src.assume_init_ref() };
                let Some(l) = self.routes.find(&self.shared.joins, w.qp_num) else {
                    // A QP destroyed with completions still queued: nobody to give them to.
                    tracing::debug!("NET/IB : completion for unknown QP {:#x} dropped", w.qp_num);
                    continue;
                };
                let ok = w.status == rdma_sys::ibv_wc_status::IBV_WC_SUCCESS;
                let (wr_id, recv, op) = l.resolve(w.wr_id, ok);
                let fallback = if recv {
                    WcOpcode::Recv
                } else {
                    op.unwrap_or(WcOpcode::Send)
                };
                let mut wc = wc_from_raw(w, fallback);
                wc.wr_id = wr_id;
                wcs[done + kept] = wc;
                kept += 1;
            }
            done += kept;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.shared.channel.is_none() {
            return Err(VerbsError::new(
                Verb::ReqNotifyCq,
                ErrorKind::InvalidArgument,
                "the CQ has no completion channel: create it with one to be notified",
            ));
        }
        // SAFETY: the CQ is alive; arming is thread-safe in libibverbs.
        let rc = unsafe { ibv_req_notify_cq(self.shared.cq.as_ptr(), i32::from(solicited_only)) };
        if rc != 0 {
            return Err(VerbsError::from_errno(
                Verb::ReqNotifyCq,
                ret_errno(rc),
                "arming the CQ failed",
            ));
        }
        Ok(())
    }

    fn capacity(&self) -> u32 {
        self.shared.capacity.load(Ordering::Acquire)
    }

    fn room(&self) -> u32 {
        let committed = self.shared.committed.load(Ordering::Acquire);
        u64::from(self.capacity()).saturating_sub(committed) as u32
    }

    fn resize(&mut self, cqe: u32) -> Result<()> {
        let current = self.capacity();
        crate::verbs::check_resize(current, cqe, self.shared.ctx.caps.max_cqe)?;
        if cqe == current {
            return Ok(());
        }
        // SAFETY: the CQ is alive and polled only through `&mut self`, so no poll runs
        // concurrently (verbs requires that of a resize); `cqe` is within the device's limit.
        let rc = unsafe { ibv_resize_cq(self.shared.cq.as_ptr(), cqe as i32) };
        if rc != 0 {
            return Err(VerbsError::from_errno(
                Verb::ResizeCq,
                ret_errno(rc),
                format!(
                    "cannot grow the CQ from {current} to {cqe} entries on {} (out of device                      resources or RLIMIT_MEMLOCK too low for the larger ring)",
                    self.shared.ctx.label()
                ),
            ));
        }
        // Admission grows only once the device has the room.
        self.shared.capacity.store(cqe, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_wc(status: u32, opcode: u32, flags: u32, imm_be: u32) -> ibv_wc {
        // SAFETY: all-zero bytes are a valid `ibv_wc` (integers and an integer union).
        let mut w: ibv_wc = unsafe { std::mem::zeroed() };
        w.wr_id = 7;
        w.status = status;
        w.opcode = opcode;
        w.wc_flags = flags;
        w.byte_len = 42;
        w.qp_num = 0x11;
        w.vendor_err = 0x81;
        w.imm_data_invalidated_rkey_union.imm_data = imm_be;
        w
    }

    #[test]
    fn wc_mapping() {
        let w = wc_from_raw(&raw_wc(0, 128, 2, 0x1234_5678u32.to_be()), WcOpcode::Send);
        assert_eq!(w.wr_id, 7);
        assert!(w.is_ok());
        assert_eq!(w.opcode, WcOpcode::Recv);
        assert_eq!(w.imm(), Some(0x1234_5678));
        assert_eq!((w.byte_len, w.qp_num, w.vendor_err), (42, 0x11, 0));
        // An error completion: only wr_id, status, qp_num and vendor_err are read; the
        // opcode, length, flags and immediate data (undefined in verbs) are not.
        let w = wc_from_raw(&raw_wc(10, 0, 2, 99), WcOpcode::RdmaRead);
        assert_eq!(w.status, WcStatus::RemAccessErr);
        assert_eq!(w.opcode, WcOpcode::RdmaRead);
        assert_eq!((w.wr_id, w.qp_num, w.vendor_err), (7, 0x11, 0x81));
        assert_eq!((w.byte_len, w.imm(), w.imm_data), (0, None, 0));
        let w = wc_from_raw(&raw_wc(5, 0xdead, 0, 0), WcOpcode::Recv);
        assert_eq!(w.status, WcStatus::WrFlushErr);
        assert_eq!(w.opcode, WcOpcode::Recv);
        assert_eq!(
            wc_from_raw(&raw_wc(0, 129, 2, 1u32.to_be()), WcOpcode::Send).opcode,
            WcOpcode::RecvRdmaWithImm
        );
    }

    #[test]
    fn wc_layout_matches_c() {
        assert_eq!(std::mem::size_of::<ibv_wc>(), 48);
    }
}
