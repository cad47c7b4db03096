//! Process-wide set-up and device events: `ibv_fork_init` before the first verb, and
//! `ibv_get_async_event` read without blocking into a typed [`AsyncEvent`].

use std::sync::OnceLock;

use rdma_sys::{
    ibv_ack_async_event, ibv_async_event, ibv_event_type, ibv_fork_init, ibv_is_fork_initialized,
};

use super::device::{RawContext, last_errno};
use crate::verbs::error::{Verb, VerbsError};
use crate::verbs::types::AsyncEvent;

/// `RPC_IB_FORK_INIT=0` skips `ibv_fork_init` (on by default, as UCX's `UCX_IB_FORK_INIT`).
pub const ENV_FORK_INIT: &str = "RPC_IB_FORK_INIT";

/// Calls `ibv_fork_init` once, before the first other verb, unless `RPC_IB_FORK_INIT=0`:
/// registered memory then stays correct in a parent that forks (a child running a command,
/// a daemonising library). On kernels that copy pinned pages on fork (Linux 5.13+) it costs
/// nothing (`IBV_FORK_UNNEEDED`); `RDMAV_FORK_SAFE`/`IBV_FORK_SAFE` in the environment make
/// libibverbs do the same on its own.
pub(super) fn fork_init() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if std::env::var(ENV_FORK_INIT).is_ok_and(|v| v.trim() == "0") {
            tracing::debug!("NET/IB : {ENV_FORK_INIT}=0: ibv_fork_init skipped");
            return;
        }
        // SAFETY: called once, before any other verb of this process's provider (the device
        // list is read after it); it only sets libibverbs' global fork mode.
        let rc = unsafe { ibv_fork_init() };
        // SAFETY: a query of libibverbs' global fork mode, no arguments.
        let mode = unsafe { ibv_is_fork_initialized() };
        let mode = match mode {
            rdma_sys::IBV_FORK_ENABLED => "enabled",
            rdma_sys::IBV_FORK_UNNEEDED => "unneeded (the kernel copies pinned pages on fork)",
            _ => "disabled",
        };
        if rc == 0 {
            tracing::debug!("NET/IB : ibv_fork_init: fork support {mode}");
        } else {
            tracing::warn!(
                "NET/IB : ibv_fork_init failed (errno {}): fork support {mode}; a child of this \
                 process must not touch registered memory",
                super::device::ret_errno(rc)
            );
        }
    });
}

/// Makes the context's async-event descriptor non-blocking, so that
/// [`poll_async_event`] never waits.
pub(super) fn nonblocking_async_fd(raw: &RawContext) -> Result<(), VerbsError> {
    // SAFETY: the context is open; `async_fd` is its descriptor, which F_GETFL/F_SETFL only
    // change the status flags of.
    let ok = unsafe {
        let fd = (*raw.as_ptr()).async_fd;
        let fl = libc::fcntl(fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(VerbsError::from_errno(
            Verb::OpenDevice,
            last_errno(),
            "cannot make the device's async event descriptor non-blocking (fcntl)",
        ))
    }
}

/// The next async event of `raw`, if any (acknowledged before returning).
pub(super) fn poll_async_event(raw: &RawContext) -> Result<Option<AsyncEvent>, VerbsError> {
    loop {
        let mut ev = std::mem::MaybeUninit::<ibv_async_event>::uninit();
        // SAFETY: the context is open; `ev` is a valid out-pointer; the descriptor is
        // non-blocking (set at open), so this returns at once when nothing is pending.
        let rc = unsafe { rdma_sys::ibv_get_async_event(raw.as_ptr(), ev.as_mut_ptr()) };
        if rc != 0 {
            return match last_errno() {
                libc::EAGAIN => Ok(None),
                libc::EINTR => continue,
                e => Err(VerbsError::from_errno(
                    Verb::QueryDevice,
                    e,
                    "reading the device's async events failed",
                )),
            };
        }
        // SAFETY: ibv_get_async_event succeeded and filled the event.
        let mut ev = unsafe { ev.assume_init() };
        let code = ev.event_type as u32;
        // SAFETY: the union member read is the one the event type names; a QP event's QP
        // (an SRQ event's SRQ) is alive until the event is acknowledged (ibv_destroy_qp and
        // ibv_destroy_srq wait for that), below.
        let (port, num) = unsafe {
            if is_qp_event(code) {
                (0, ev.element.qp.as_ref().map_or(0, |q| q.qp_num))
            } else if is_srq_event(code) {
                (0, ev.element.srq.as_ref().map_or(0, |q| q.handle))
            } else {
                (ev.element.port_num, 0)
            }
        };
        // SAFETY: the event came from ibv_get_async_event and is acknowledged once.
        unsafe { ibv_ack_async_event(&mut ev) };
        let e = event_from_raw(code, port, num);
        if code == ibv_event_type::IBV_EVENT_SRQ_ERR as u32 {
            tracing::warn!(
                "NET/IB : async event SRQ_ERR on SRQ {num:#x}: the shared receive queue failed; \
                 its QPs receive nothing more (destroy them and the SRQ)"
            );
            return Ok(Some(e));
        }
        if e.is_fatal() {
            tracing::warn!("NET/IB : async event {e:?}: {}", e.cause());
        } else {
            tracing::info!("NET/IB : async event {e:?}: {}", e.cause());
        }
        return Ok(Some(e));
    }
}

/// Events whose element is a QP.
const QP_EVENTS: [ibv_event_type; 8] = [
    ibv_event_type::IBV_EVENT_QP_FATAL,
    ibv_event_type::IBV_EVENT_QP_REQ_ERR,
    ibv_event_type::IBV_EVENT_QP_ACCESS_ERR,
    ibv_event_type::IBV_EVENT_PATH_MIG_ERR,
    ibv_event_type::IBV_EVENT_COMM_EST,
    ibv_event_type::IBV_EVENT_SQ_DRAINED,
    ibv_event_type::IBV_EVENT_PATH_MIG,
    ibv_event_type::IBV_EVENT_QP_LAST_WQE_REACHED,
];
/// The first four of [`QP_EVENTS`]: the QP is in ERROR.
const QP_FATAL: usize = 4;

/// Port events other than up, down and GID change.
const PORT_CHANGES: [ibv_event_type; 4] = [
    ibv_event_type::IBV_EVENT_LID_CHANGE,
    ibv_event_type::IBV_EVENT_PKEY_CHANGE,
    ibv_event_type::IBV_EVENT_SM_CHANGE,
    ibv_event_type::IBV_EVENT_CLIENT_REREGISTER,
];

fn position(set: &[ibv_event_type], code: u32) -> Option<usize> {
    set.iter().position(|t| *t as u32 == code)
}

fn is_qp_event(code: u32) -> bool {
    position(&QP_EVENTS, code).is_some()
}

/// Events whose element is an SRQ.
fn is_srq_event(code: u32) -> bool {
    position(
        &[
            ibv_event_type::IBV_EVENT_SRQ_ERR,
            ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED,
        ],
        code,
    )
    .is_some()
}

/// Maps an `ibv_event_type` number and its element to our event: `port` for port events,
/// `num` the QP's number for QP events and the SRQ's handle for SRQ events. `SRQ_ERR` has no
/// event of its own: it is `Other` with its code (not fatal to any connection by itself: the
/// SRQ's QPs fail on their own).
pub(super) fn event_from_raw(code: u32, port: i32, num: u32) -> AsyncEvent {
    use ibv_event_type::*;
    let port = u8::try_from(port).unwrap_or(0);
    if let Some(i) = position(&QP_EVENTS, code) {
        return if i < QP_FATAL {
            AsyncEvent::QpFatal { qp_num: num }
        } else {
            AsyncEvent::QpInfo { qp_num: num }
        };
    }
    if code == IBV_EVENT_SRQ_LIMIT_REACHED as u32 {
        return AsyncEvent::SrqLimitReached { srq_num: num };
    }
    if position(&PORT_CHANGES, code).is_some() {
        return AsyncEvent::PortChange { port };
    }
    let singles = [
        (IBV_EVENT_PORT_ACTIVE, AsyncEvent::PortActive { port }),
        (IBV_EVENT_PORT_ERR, AsyncEvent::PortError { port }),
        (IBV_EVENT_GID_CHANGE, AsyncEvent::GidChange { port }),
        (IBV_EVENT_DEVICE_FATAL, AsyncEvent::DeviceFatal),
        (IBV_EVENT_CQ_ERR, AsyncEvent::CqError),
    ];
    singles
        .into_iter()
        .find(|(t, _)| *t as u32 == code)
        .map_or(AsyncEvent::Other { code }, |(_, e)| e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ibv_event_type::*;

    #[test]
    fn async_event_mapping() {
        let ev = |t: ibv_event_type, port, qp| event_from_raw(t as u32, port, qp);
        assert_eq!(
            ev(IBV_EVENT_PORT_ERR, 1, 0),
            AsyncEvent::PortError { port: 1 }
        );
        assert!(ev(IBV_EVENT_PORT_ERR, 1, 0).is_fatal());
        assert_eq!(
            ev(IBV_EVENT_PORT_ACTIVE, 2, 0),
            AsyncEvent::PortActive { port: 2 }
        );
        assert!(!ev(IBV_EVENT_PORT_ACTIVE, 2, 0).is_fatal());
        assert_eq!(
            ev(IBV_EVENT_GID_CHANGE, 1, 0),
            AsyncEvent::GidChange { port: 1 }
        );
        assert_eq!(ev(IBV_EVENT_DEVICE_FATAL, 0, 0), AsyncEvent::DeviceFatal);
        assert_eq!(ev(IBV_EVENT_CQ_ERR, 0, 0), AsyncEvent::CqError);
        assert_eq!(
            ev(IBV_EVENT_QP_ACCESS_ERR, 0, 0x1a),
            AsyncEvent::QpFatal { qp_num: 0x1a }
        );
        assert_eq!(
            ev(IBV_EVENT_COMM_EST, 0, 0x1a),
            AsyncEvent::QpInfo { qp_num: 0x1a }
        );
        assert_eq!(
            ev(IBV_EVENT_SM_CHANGE, 1, 0),
            AsyncEvent::PortChange { port: 1 }
        );
        assert_eq!(
            ev(IBV_EVENT_SRQ_LIMIT_REACHED, 0, 7),
            AsyncEvent::SrqLimitReached { srq_num: 7 }
        );
        assert!(!ev(IBV_EVENT_SRQ_LIMIT_REACHED, 0, 7).is_fatal());
        assert_eq!(
            ev(IBV_EVENT_SRQ_ERR, 0, 7),
            AsyncEvent::Other {
                code: IBV_EVENT_SRQ_ERR as u32
            }
        );
        assert_eq!(
            ev(IBV_EVENT_QP_LAST_WQE_REACHED, 0, 0x1b),
            AsyncEvent::QpInfo { qp_num: 0x1b }
        );
        assert!(is_qp_event(IBV_EVENT_QP_FATAL as u32));
        assert!(!is_qp_event(IBV_EVENT_PORT_ERR as u32));
        assert!(is_srq_event(IBV_EVENT_SRQ_LIMIT_REACHED as u32));
        assert!(!is_srq_event(IBV_EVENT_QP_LAST_WQE_REACHED as u32));
    }
}
