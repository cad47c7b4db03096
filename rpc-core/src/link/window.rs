//! A client link's receive window follows its calls in flight, both ways: it doubles (a
//! region registered) as soon as the calls need more, and after a quiet spell it gives back
//! the regions they no longer need.
//!
//! ```text
//! grow:    calls in flight + reserve >= window, or the server is short of credits
//!            -> register a region, post its slots, grant their credits (wire::Conn::grant)
//! shrink:  calls in flight + reserve <= window / 4 for SHRINK_AFTER frames and SHRINK_QUIET
//!            -> retire: slots from the target on are parked as they come back instead of
//!               reposted (wire::Conn::recv_withheld: the server's credits shrink with them)
//!            -> all parked: deregister their regions (SlotArena::shrink_recv)
//!          calls need more while retiring -> the parked slots are posted and granted again
//! ```
//!
//! A receive posted to the NIC cannot be taken back (short of failing the QP), so a window
//! shrinks only as frames arrive: the receive queue is first in, first out, so each slot of
//! the retired regions comes back once within a window's worth of frames, and a slot a user
//! keeps (a lent `bytes` field) comes back when it is dropped. A channel that falls silent
//! right after a burst keeps its window until it is used again.

use super::{Link, LinkError, post_slots};
use crate::verbs::Provider;

/// Frames received, per slot of the window, at low use before it shrinks.
const SHRINK_AFTER: u64 = 4;

/// And nanoseconds of low use (a burst every second keeps its window).
const SHRINK_QUIET: u64 = 1_000_000_000;

/// Where a link's receive window is heading.
#[derive(Debug, Default)]
pub(crate) struct RecvWindow {
    /// Retiring: the window being shrunk to (slots from here on are parked as they come
    /// back); `u32::MAX` when not retiring.
    retire_to: u32,
    /// Slots of the retired regions that came back (each once: a parked slot is never
    /// posted again while parked).
    parked: Vec<u32>,
    /// Receive slots that came back since the link was made (frames received).
    consumed: u64,
    /// `consumed` when the calls last needed more than a quarter of the window.
    quiet_from: u64,
    /// When the quiet spell passed `SHRINK_AFTER` frames per slot (0: not yet).
    quiet_since: u64,
    /// The most calls in flight (with the reserve) during the timed part of the quiet spell.
    quiet_peak: u32,
}

impl RecvWindow {
    /// State for a window that may grow from `first` to `max` slots (none for a link
    /// without a window of its own: a shard's, which receives through its pool).
    pub(crate) fn new(first: u32, max: u32) -> RecvWindow {
        // Room for every slot that may be parked, so parking allocates nothing.
        let room = if first == 0 {
            0
        } else {
            max.saturating_sub(first)
        };
        RecvWindow {
            retire_to: u32::MAX,
            parked: Vec::with_capacity(room as usize),
            ..RecvWindow::default()
        }
    }

    /// Slots from this index on are parked as they come back (`u32::MAX`: none).
    #[inline]
    pub(crate) fn retire_to(&self) -> u32 {
        self.retire_to
    }

    /// A slot of a retired region came back.
    #[inline]
    pub(crate) fn park(&mut self, idx: u32) {
        self.parked.push(idx);
    }

    /// `n` slots came back (posted again or parked).
    #[inline]
    pub(crate) fn consumed(&mut self, n: u32) {
        self.consumed += u64::from(n);
    }

    fn busy(&mut self) {
        self.quiet_from = self.consumed;
        self.quiet_since = 0;
        self.quiet_peak = 0;
    }
}

impl<P: Provider> Link<P> {
    /// Once per driver turn: grows the receive window when its calls in flight need more
    /// (the server said it ran out of data credits, or is at its reserve by our count, or
    /// the calls fill the window but for the reserve), and shrinks it after a quiet spell
    /// (see the module docs). A few compares when nothing changes.
    ///
    /// # Errors
    /// When `post_recv` fails.
    #[inline]
    pub fn maybe_resize_recv(&mut self) -> Result<(), LinkError> {
        let window = self.arena.recv_window();
        if window == 0 {
            return Ok(());
        }
        let need = self.wire.calls_in_flight() + self.wire.config().reserved_credits;
        let target = self.window.retire_to.min(window);
        if self.wire.peer_wants_credit() || need >= target {
            self.window.busy();
            if target < window {
                return self.unretire();
            }
            if window < self.arena.geometry().recv_slots {
                return self.grow_recv();
            }
            return Ok(());
        }
        if target < window {
            if self.window.parked.len() as u32 == window - target {
                self.finish_retire(target);
            }
            return Ok(());
        }
        if need * 4 > window || window <= self.arena.first_window() {
            self.window.busy();
            return Ok(());
        }
        self.window.quiet_peak = self.window.quiet_peak.max(need);
        if self.window.consumed - self.window.quiet_from >= SHRINK_AFTER * u64::from(window) {
            self.maybe_retire(window, need);
        }
        Ok(())
    }

    /// Tests: the window being retired to, while it is.
    #[cfg(test)]
    pub(crate) fn recv_retiring_to(&self) -> Option<u32> {
        (self.window.retire_to != u32::MAX).then_some(self.window.retire_to)
    }

    /// Quiet for `SHRINK_AFTER` frames per slot: starts retiring once that also lasted
    /// `SHRINK_QUIET` (the clock is read once per window's worth of frames meanwhile).
    #[cold]
    fn maybe_retire(&mut self, window: u32, need: u32) {
        let now = self.now().max(1);
        let w = &mut self.window;
        if w.quiet_since == 0 {
            // The timed part of the spell starts: its peak is what the window keeps room
            // for (not the tail of the burst before it).
            w.quiet_since = now;
            w.quiet_peak = need;
        }
        if now - w.quiet_since < SHRINK_QUIET {
            // Look again a window's worth of frames later.
            w.quiet_from += u64::from(window);
            return;
        }
        // Room for twice the busiest moment of the quiet spell, besides the slots users keep
        // (lent: not serving calls until they come back).
        let need = w.quiet_peak.saturating_mul(2) + self.arena.lent_recv();
        let to = self.arena.window_for(need);
        w.busy();
        if to < window {
            w.retire_to = to;
        }
    }

    #[cold]
    fn finish_retire(&mut self, to: u32) {
        self.arena.shrink_recv(to);
        self.window.parked.clear();
        self.window.retire_to = u32::MAX;
    }

    /// The calls need the window again while it was being retired: the slots parked so far
    /// are posted again and their credits granted (the others were never withheld).
    #[cold]
    fn unretire(&mut self) -> Result<(), LinkError> {
        self.window.retire_to = u32::MAX;
        let mut parked = std::mem::take(&mut self.window.parked);
        let mut next = parked.iter().copied();
        let posted = post_slots(&mut self.qp, &self.arena, self.key, || next.next(), |_| {});
        parked.clear();
        self.window.parked = parked;
        self.grant_posted(posted?)
    }

    #[cold]
    fn grow_recv(&mut self) -> Result<(), LinkError> {
        let new = self.arena.grow_recv();
        if new.is_empty() {
            return Ok(());
        }
        let mut next = new.clone();
        // A slot that could not be posted stays in the window, unposted and never granted:
        // the link has failed (the error below closes it).
        let posted = post_slots(&mut self.qp, &self.arena, self.key, || next.next(), |_| {})?;
        self.grant_posted(posted)
    }

    fn grant_posted(&mut self, posted: u32) -> Result<(), LinkError> {
        let granted = self.wire.grant(posted);
        if granted != posted {
            return Err(LinkError::Protocol(format!(
                "receive window: {posted} slots posted, {granted} granted"
            )));
        }
        Ok(())
    }
}
