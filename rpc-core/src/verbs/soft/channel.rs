//! Completion channels: an eventfd that producers of completions for an armed CQ signal.
//!
//! Local producers write our eventfd; producers in peer processes write the duplicate they
//! obtained with `pidfd_getfd` when they connected. Nobody writes it unless the CQ was armed
//! with [`Cq::req_notify`](crate::verbs::Cq::req_notify), so the data path makes no system
//! call otherwise.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::Device;
use super::peer::WatchShared;
use super::shm::{self, EventFd};
use crate::verbs::{CompChannel, Result, Verb, VerbsError};

/// Shared part of a channel (CQs keep it to signal, the watchdog to wake sleepers).
#[derive(Debug)]
pub(crate) struct ChannelInner {
    pub(crate) efd: EventFd,
    /// Earliest time (`shm::now_ns`) at which queued RNR work of a CQ of this channel must be
    /// retried; `u64::MAX` when none.
    deadline: AtomicU64,
    /// Nonce of the owning device (CQs of another device may not use this channel).
    pub(crate) dev_nonce: u64,
    /// Unique in this process (published with the eventfd's number, see `layout::qp::CHAN_ID`).
    pub(crate) id: u32,
    /// The context's service thread, which rings us when the deadline passes.
    watch: Arc<WatchShared>,
}

impl ChannelInner {
    /// Wakes a sleeper.
    pub(crate) fn wake(&self) {
        self.efd.signal();
    }

    /// Records that queued work must be retried at `at_ns`; wakes a sleeper when that is
    /// earlier than what it sleeps for.
    pub(crate) fn retry_at(&self, at_ns: u64) {
        let prev = self.deadline.fetch_min(at_ns, Ordering::AcqRel);
        if at_ns < prev {
            self.efd.signal();
            self.watch.efd.signal();
        }
    }

    /// For the service thread: `None` (and the deadline cleared) when the deadline passed, so
    /// the caller rings the channel; otherwise the pending deadline (`u64::MAX`: none).
    pub(crate) fn take_due(&self, now: u64) -> Option<u64> {
        let d = self.deadline.load(Ordering::Acquire);
        if d > now {
            return Some(d);
        }
        self.deadline
            .compare_exchange(d, u64::MAX, Ordering::AcqRel, Ordering::Relaxed)
            .err()
    }
}

/// The id of the next channel made in this process.
static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

/// A completion channel of the soft RNIC: a non-blocking eventfd, usable with epoll/tokio
/// `AsyncFd` (readable = events pending; [`CompChannel::drain`] consumes them).
///
/// Producers ring it only for a CQ armed with [`Cq::req_notify`](crate::verbs::Cq::req_notify)
/// (once per arming): local producers write the eventfd, producers in peer processes write the
/// duplicate they obtained with `pidfd_getfd` when they connected. The context's watchdog also
/// rings it when a peer process dies, and queued RNR retries bound how long
/// [`CompChannel::wait`] sleeps.
#[derive(Debug)]
pub struct SoftCompChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl SoftCompChannel {
    pub(crate) fn new(dev: &Arc<Device>) -> Result<SoftCompChannel> {
        let efd = EventFd::new().map_err(|e| {
            VerbsError::from_errno(
                Verb::CreateCompChannel,
                e.raw_os_error().unwrap_or(libc::EMFILE),
                "cannot create the channel's eventfd",
            )
        })?;
        let inner = Arc::new(ChannelInner {
            efd,
            deadline: AtomicU64::new(u64::MAX),
            dev_nonce: dev.nonce,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            watch: dev.watchdog.shared.clone(),
        });
        dev.watchdog.add_channel(Arc::downgrade(&inner));
        Ok(SoftCompChannel { inner })
    }
}

impl AsRawFd for SoftCompChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.efd.as_raw_fd()
    }
}

impl CompChannel for SoftCompChannel {
    /// Sleeps until an armed CQ of this channel gets a completion, a peer process dies, or
    /// queued RNR work of one of its CQs is due for a retry (then it returns `true` without an
    /// event, so that the caller's next [`Cq::poll`](crate::verbs::Cq::poll) drives the retry),
    /// or `timeout` passes.
    fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let inner = &self.inner;
        let now = shm::now_ns();
        let deadline = inner.deadline.load(Ordering::Acquire);
        if deadline <= now {
            inner.deadline.store(u64::MAX, Ordering::Release);
            return Ok(true);
        }
        let mut sleep = timeout;
        let mut by_deadline = false;
        if deadline != u64::MAX {
            let d = Duration::from_nanos(deadline - now);
            if sleep.is_none_or(|t| d < t) {
                sleep = Some(d);
                by_deadline = true;
            }
        }
        let ready = inner.efd.wait_readable(sleep).map_err(|e| {
            VerbsError::from_errno(
                Verb::GetCqEvent,
                e.raw_os_error().unwrap_or(libc::EIO),
                "poll on the completion channel failed",
            )
        })?;
        if ready {
            self.drain()?;
            return Ok(true);
        }
        if by_deadline {
            let _ = inner.deadline.compare_exchange(
                deadline,
                u64::MAX,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
            return Ok(true);
        }
        Ok(false)
    }

    fn drain(&self) -> Result<u32> {
        let n = self.inner.efd.drain().map_err(|e| {
            VerbsError::from_errno(
                Verb::GetCqEvent,
                e.raw_os_error().unwrap_or(libc::EIO),
                "reading the completion channel failed",
            )
        })?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }
}
