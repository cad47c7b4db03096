//! Waking an idle poll loop: an eventfd written only when the loop said it is going to sleep, so
//! a busy loop costs its wakers no system call. Shared by the server's shards and the client's
//! poller thread and callers (both sleep on one).

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::event::{EventfdFlags, eventfd};

/// A doorbell for a poll loop.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
    sleeping: AtomicBool,
}

impl Doorbell {
    /// A new doorbell (non-blocking eventfd).
    ///
    /// # Errors
    /// When no eventfd can be created.
    pub fn new() -> std::io::Result<Arc<Doorbell>> {
        Doorbell::unshared().map(Arc::new)
    }

    /// A new doorbell for one owner, to keep inline: made without a heap allocation (a
    /// connection makes its own on a call's path, see [`crate::client`]'s core).
    ///
    /// # Errors
    /// When no eventfd can be created.
    pub(crate) fn unshared() -> std::io::Result<Doorbell> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        crate::fdtable::opened(&fd);
        Ok(Doorbell {
            fd,
            sleeping: AtomicBool::new(false),
        })
    }

    /// Rings if the loop is asleep (or about to sleep).
    pub fn ring(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
    }

    /// Rings unconditionally.
    pub fn ring_always(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// The loop announces it is about to sleep; it must re-check its queues after this and
    /// before sleeping (a ringer that queued work before seeing the flag has been seen by
    /// then).
    pub fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
    }

    /// The loop is awake again; clears pending rings.
    pub fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
    }

    /// The descriptor to include in the loop's `poll(2)` set.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Doorbell {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Sleeps until one of `fds` (at most 4) is readable or `timeout` passes.
pub(crate) fn wait_readable(fds: &[std::os::fd::BorrowedFd<'_>], timeout: std::time::Duration) {
    use rustix::event::{PollFd, PollFlags, poll};
    let Some(&first) = fds.first() else { return };
    let mut pfds: [PollFd<'_>; 4] = std::array::from_fn(|i| {
        PollFd::from_borrowed_fd(fds.get(i).copied().unwrap_or(first), PollFlags::IN)
    });
    let n = fds.len().min(4);
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let _ = poll(&mut pfds[..n], Some(&ts));
}
