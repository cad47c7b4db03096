//! Credits from the shard's receive pool: which connection may use how many of its slots.
//!
//! Every connection of a shard receives through the shard's one SRQ ([`RecvPool`]). A client
//! may send a frame only with a credit (as with a ring of its own), and the shard grants
//! credits so that the windows of all its connections together never exceed the pool:
//!
//! ```text
//! pool slots = free + sum of windows + lent
//! window     = client's credits + frames not reposted yet + credits owed to it
//! ```
//!
//! so a client never sends a frame that finds no receive posted (no RNR, on any provider), and
//! receive memory follows calls in flight: an idle connection holds [`FLOOR`] slots.
//!
//! - **Admission**: a new connection takes [`FLOOR`] free slots (the pool grows a chunk when
//!   fewer are free, up to its limit; past it the connection is refused).
//! - **Growth**: when a client says it ran out of data credits (a frame with
//!   [`wire::FrameFlags::STARVED`]), or a frame leaves it without one by our count, its window
//!   doubles from the free slots (up to the client's ceiling, `Geometry::recv_slots`), while
//!   more than [`LOW`] are free.
//! - **Shrinking**: while fewer than [`LOW`] slots are free, a slot of any connection above
//!   the floor goes back to the pool instead of to the client ([`wire::Conn::recv_withheld`]).
//!   (Not otherwise: a client that coalesces its frames into few SENDs uses few credits for
//!   many calls, and a window trimmed to what it used a moment ago would make it wait for
//!   credits round trip after round trip.)
//! - **Reclaim**: a connection idle for [`RECLAIM_IDLE`] with a window above the floor is
//!   asked to give back what it does not use ([`wire::Conn::reclaim`]).
//! - **Lending**: a slot lent to user code leaves its connection's window at once (the
//!   connection is owed the credit) and takes a free slot instead; it comes back free. At
//!   most half the pool is lent, and never the last [`LOW`] free slots.
//! - **Closing**: the credits a closed connection's client held may still arrive as frames
//!   that completions already in the CQ report (the QP is destroyed, later ones cannot come).
//!   They wait in `limbo` for [`LIMBO`]; each such frame takes its slot from there, and what is
//!   left is free after.
//!
//! [`RecvPool`]: crate::buf::RecvPool

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::link::LinkKey;
use crate::wire;

/// Slots a connection holds at least (its initial window): the reserve of two control credits
/// plus two data credits.
pub(crate) const FLOOR: u32 = 4;
/// Free slots below which windows shrink, grants stop and nothing is lent.
pub(crate) const LOW: u32 = 64;
/// An idle connection with more than [`FLOOR`] slots is asked for them back after this long.
pub(crate) const RECLAIM_IDLE: Duration = Duration::from_millis(100);
/// How long the window of a closed connection waits before its slots are free (see the
/// module docs): the shard polls its CQ many times meanwhile.
pub(crate) const LIMBO: Duration = Duration::from_millis(2);

/// `owner` of a slot lent to user code: out of every window.
const LENT: u32 = u32::MAX;
/// `owner` of a slot that is posted (or flushed: posted again unfilled).
const NONE: u32 = u32::MAX - 1;
/// `owner` of a slot that holds a frame of a connection closed before it was polled.
const ORPHAN: u32 = u32::MAX - 2;

const fn pack(key: LinkKey) -> u32 {
    (key.idx as u32) << 8 | key.generation as u32
}

/// What became of a slot that came back from user code or a frame's handling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Returned {
    /// It was lent, or its connection is gone: free again.
    Free,
    /// It held a frame of this connection: owe the credit back or withhold it
    /// ([`Grants::settle`]).
    Conn(LinkKey),
}

/// The pool's figures, published by the shard for [`crate::RunningServer::receive_pool`].
#[derive(Debug, Default)]
pub(crate) struct Gauge {
    slots: AtomicU64,
    free: AtomicU64,
    lent: AtomicU64,
}

impl Gauge {
    /// Slots, free, lent.
    pub(crate) fn load(&self) -> (u64, u64, u64) {
        (
            self.slots.load(Ordering::Relaxed),
            self.free.load(Ordering::Relaxed),
            self.lent.load(Ordering::Relaxed),
        )
    }
}

/// The shard's accounting of its receive pool. See the module docs.
pub(crate) struct Grants {
    /// Slots in no window and not lent.
    free: u32,
    /// Slots lent to user code.
    lent: u32,
    /// Slots of the pool.
    total: u32,
    /// The limbo: per close of a connection, oldest first, when the slots of its window are
    /// free and how many of them are left (see the module docs).
    closes: std::collections::VecDeque<(std::time::Instant, u32)>,
    /// Per slot: the connection whose frame is in it (packed key), [`LENT`] or [`NONE`].
    owner: Vec<u32>,
}

impl std::fmt::Debug for Grants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grants")
            .field("total", &self.total)
            .field("free", &self.free)
            .field("lent", &self.lent)
            .field("limbo", &self.limbo())
            .finish()
    }
}

impl Grants {
    pub(crate) fn new() -> Grants {
        Grants {
            free: 0,
            lent: 0,
            total: 0,
            closes: std::collections::VecDeque::new(),
            owner: Vec::new(),
        }
    }

    /// Publishes the figures (slots, free, lent) to `g`.
    pub(crate) fn publish(&self, g: &Gauge) {
        g.slots.store(u64::from(self.total), Ordering::Relaxed);
        g.free.store(u64::from(self.free), Ordering::Relaxed);
        g.lent.store(u64::from(self.lent), Ordering::Relaxed);
    }

    /// Free slots.
    pub(crate) fn free(&self) -> u32 {
        self.free
    }

    /// Slots in the limbo (closed connections' windows, free within [`LIMBO`]).
    fn limbo(&self) -> u32 {
        self.closes.iter().map(|c| c.1).sum()
    }

    /// Slots lent to user code.
    #[cfg(test)]
    pub(crate) fn lent(&self) -> u32 {
        self.lent
    }

    /// The pool grew by `n` slots, `posted` of them posted (the others wait on the repost
    /// queue, and are free once posted: see [`Grants::returned`]).
    pub(crate) fn grown(&mut self, n: u32, posted: u32) {
        self.total += n;
        self.free += posted;
        self.owner.resize(self.total as usize, NONE);
        let start = (self.total - n + posted) as usize;
        for o in &mut self.owner[start..] {
            *o = ORPHAN;
        }
    }

    /// Whether the pool should grow before admitting a connection (counting the limbo,
    /// which is free within [`LIMBO`]).
    pub(crate) fn wants_growth(&self) -> bool {
        self.free + self.limbo() < FLOOR + LOW
    }

    /// Takes [`FLOOR`] slots for a new connection (at `now`, freeing the limbo if it is old
    /// enough); false when too few are free.
    pub(crate) fn admit(&mut self, now: std::time::Instant) -> bool {
        self.release_limbo(now);
        if self.free < FLOOR {
            return false;
        }
        self.free -= FLOOR;
        true
    }

    /// A connection admitted with [`Grants::admit`] could not be opened: its slots are free.
    pub(crate) fn refused(&mut self) {
        self.free += FLOOR;
    }

    /// A connection closed (its QPs destroyed): its window but the slots its frames hold
    /// (they come back free, their owner being gone) waits in limbo for [`LIMBO`].
    pub(crate) fn closed(&mut self, w: &wire::Conn, now: std::time::Instant) {
        let n = w.peer_credits() + w.owed_credits();
        if n > 0 {
            self.closes.push_back((now + LIMBO, n));
        }
    }

    /// Frees the slots of the closes at least [`LIMBO`] old. Each close has its own deadline:
    /// connections that keep closing less than [`LIMBO`] apart (a client that reconnects in
    /// a loop) must not keep each other's slots out of the pool, or it grows for nothing.
    pub(crate) fn release_limbo(&mut self, now: std::time::Instant) {
        while let Some(&(due, n)) = self.closes.front()
            && due <= now
        {
            self.closes.pop_front();
            self.free += n;
        }
    }

    /// Slot `idx` completed a receive of a connection already closed: it takes its slot from
    /// the limbo, and comes back free.
    pub(crate) fn orphan_received(&mut self, idx: u32) {
        if let Some(o) = self.owner.get_mut(idx as usize) {
            *o = ORPHAN;
        }
        if let Some(c) = self.closes.front_mut() {
            // The oldest close's (which frame's connection it was does not matter: all the
            // limbo's slots are alike).
            c.1 -= 1;
            if c.1 == 0 {
                self.closes.pop_front();
            }
        } else {
            // Its limbo was released already (a completion polled very late): the slot was
            // counted free though it held the frame; it is counted again when it comes back.
            self.free = self.free.saturating_sub(1);
        }
    }

    /// The client gave `n` credits back ([`wire::Event::Surrendered`]).
    pub(crate) fn surrendered(&mut self, n: u32) {
        self.free += n;
    }

    /// How many slots may be lent while the shard handles the next frame.
    pub(crate) fn allowance(&self) -> u32 {
        if self.free > LOW && self.lent < self.total / 2 {
            1
        } else {
            0
        }
    }

    /// Slot `idx` completed a receive of the connection `key`.
    pub(crate) fn received(&mut self, idx: u32, key: LinkKey) {
        if let Some(o) = self.owner.get_mut(idx as usize) {
            *o = pack(key);
        }
    }

    /// The frame(s) in slot `idx` were handled and the slot was lent to user code: it leaves
    /// the connection's window (which is owed the credit now, `w`) for the lent slots.
    pub(crate) fn lent_out(&mut self, idx: u32, w: &mut wire::Conn) -> Result<(), wire::SendError> {
        w.recv_reposted(1)?;
        if let Some(o) = self.owner.get_mut(idx as usize) {
            *o = LENT;
        }
        self.free -= 1;
        self.lent += 1;
        Ok(())
    }

    /// Slot `idx` is back on the repost queue (posted again by the caller): whose it was.
    pub(crate) fn returned(&mut self, idx: u32) -> Returned {
        let Some(o) = self.owner.get_mut(idx as usize) else {
            return Returned::Free;
        };
        let was = std::mem::replace(o, NONE);
        match was {
            LENT => {
                self.lent -= 1;
                self.free += 1;
                Returned::Free
            }
            ORPHAN => {
                self.free += 1;
                Returned::Free
            }
            NONE => {
                // A flushed receive: it was posted, so it was never counted out of `free`.
                Returned::Free
            }
            k => Returned::Conn(LinkKey {
                idx: (k >> 8) as u16,
                generation: k as u8,
            }),
        }
    }

    /// A slot of a connection whose key no longer names a live one: free again.
    pub(crate) fn orphan(&mut self) {
        self.free += 1;
    }

    /// A slot of the live connection `w` came back: owes it the credit, or withholds it
    /// (the window shrinks) when the pool runs low.
    ///
    /// # Errors
    /// When the protocol state refuses the accounting (a bug).
    pub(crate) fn settle(&mut self, w: &mut wire::Conn) -> Result<(), wire::SendError> {
        if w.window() > FLOOR && self.free < LOW {
            w.recv_withheld(1)?;
            self.free += 1;
        } else {
            w.recv_reposted(1)?;
        }
        Ok(())
    }

    /// After a frame of `w` was handled: a client that said it ran out of data credits
    /// ([`wire::FrameFlags::STARVED`]), or is left without one by our count, gets its window
    /// doubled from the free slots, while enough are free.
    pub(crate) fn maybe_grow(&mut self, w: &mut wire::Conn) {
        if !w.peer_wants_credit() || self.free <= LOW {
            return;
        }
        let g = w.grant(w.window().min(self.free - LOW));
        self.free -= g;
    }

    /// Checks `total = free + windows + lent` against the windows of the live connections
    /// and the slots their frames hold (tests and debug builds).
    #[cfg(test)]
    pub(crate) fn check(&self, windows: u32) -> Result<(), String> {
        if self.free + windows + self.lent + self.limbo() != self.total {
            return Err(format!(
                "pool slots not conserved: {} free + {windows} in windows + {} lent + {} in \
                 limbo != {}",
                self.free,
                self.lent,
                self.limbo(),
                self.total
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Config, Conn, Role};

    fn conn(max: u32) -> Conn {
        Conn::new(
            Role::Server,
            Config {
                recv_depth: FLOOR,
                recv_max: max,
                initial_send_credits: 8,
                max_send_credits: 8,
                credit_update_threshold: 2,
                ..Config::DEFAULT
            },
        )
        .unwrap()
    }

    /// A frame of `w` arrives in slot `idx` (the client's request).
    fn frame(g: &mut Grants, w: &mut Conn, idx: u32, key: LinkKey) {
        let mut h = wire::FrameHeader::new(wire::FrameKind::CreditUpdate, 0);
        // Return the server's credit the test's own CreditUpdates spent.
        h.credits = u16::from(w.send_credits() < 8);
        w.handle_frame(&h, 0).unwrap();
        g.received(idx, key);
    }

    const K: LinkKey = LinkKey {
        idx: 3,
        generation: 1,
    };

    #[test]
    fn windows_and_free_slots_always_add_up_to_the_pool() {
        let mut g = Grants::new();
        g.grown(128, 128);
        assert!(g.admit(std::time::Instant::now()));
        let mut w = conn(64);
        g.check(w.window()).unwrap();
        // Two frames leave the client at its reserve: the window doubles.
        frame(&mut g, &mut w, 0, K);
        frame(&mut g, &mut w, 1, K);
        g.maybe_grow(&mut w);
        assert_eq!(w.window(), 8);
        g.check(w.window()).unwrap();
        // One slot is lent: the client is owed its credit at once.
        g.lent_out(0, &mut w).unwrap();
        assert_eq!(
            (g.lent(), w.owed_credits()),
            (1, 5),
            "the 4 granted and the lent slot's credit"
        );
        g.check(w.window()).unwrap();
        // The lent slot comes back free; the other goes back to the client.
        assert_eq!(g.returned(0), Returned::Free);
        assert_eq!(g.returned(1), Returned::Conn(K));
        g.settle(&mut w).unwrap();
        g.check(w.window()).unwrap();
        assert_eq!(g.lent(), 0);
        let t = std::time::Instant::now();
        g.closed(&w, t);
        g.check(0).unwrap();
        g.release_limbo(t + LIMBO);
        assert_eq!(g.free(), 128);
    }

    #[test]
    fn windows_shrink_only_when_the_pool_runs_low() {
        let mut g = Grants::new();
        g.grown(LOW + 12, LOW + 12);
        assert!(g.admit(std::time::Instant::now()));
        let mut w = conn(64);
        for i in 0..3 {
            frame(&mut g, &mut w, i, K);
        }
        g.maybe_grow(&mut w);
        assert_eq!(w.window(), 8, "doubled once, leaving LOW free");
        g.check(w.window()).unwrap();
        // Plenty free: a slot that comes back is owed to the client, whatever it uses.
        assert_eq!(g.returned(0), Returned::Conn(K));
        g.settle(&mut w).unwrap();
        assert_eq!(w.window(), 8);
        // Two more connections leave fewer than LOW free: the window shrinks.
        let t = std::time::Instant::now();
        assert!(g.admit(t) && g.admit(t));
        assert!(g.free() < LOW);
        assert_eq!(g.returned(1), Returned::Conn(K));
        g.settle(&mut w).unwrap();
        assert_eq!(w.window(), 7);
        g.check(w.window() + 2 * FLOOR).unwrap();
        // Never below the floor.
        for i in 3..12 {
            if w.owed_credits() > 0 {
                w.credit_update().unwrap();
            }
            frame(&mut g, &mut w, i, K);
            assert_eq!(g.returned(i), Returned::Conn(K));
            g.settle(&mut w).unwrap();
        }
        assert_eq!(w.window(), FLOOR);
    }

    #[test]
    fn a_pool_without_room_admits_no_one_and_lends_nothing() {
        let mut g = Grants::new();
        g.grown(FLOOR + 1, FLOOR + 1);
        assert!(g.admit(std::time::Instant::now()));
        assert!(
            !g.admit(std::time::Instant::now()),
            "one slot left, a connection needs four"
        );
        assert_eq!(g.allowance(), 0, "nothing lent from a pool this low");
        assert!(g.wants_growth());
    }

    #[test]
    fn connections_that_keep_closing_free_their_slots_on_time() {
        // A client that reconnects every millisecond: each close's slots are free LIMBO
        // after it, though another close follows sooner (once, the whole limbo waited for
        // a pause in the closes, and the pool grew a chunk every 128 reconnections).
        let mut g = Grants::new();
        let total = FLOOR + LOW + 4 * FLOOR;
        g.grown(total, total);
        let t0 = std::time::Instant::now();
        for i in 0..1000u32 {
            let now = t0 + Duration::from_millis(u64::from(i));
            assert!(!g.wants_growth(), "connection {i}: {g:?}");
            assert!(g.admit(now), "connection {i} refused: {g:?}");
            let w = conn(64);
            g.check(w.window()).unwrap_or_else(|e| panic!("{e}"));
            g.closed(&w, now);
            assert!(g.limbo() <= 3 * FLOOR, "connection {i}: {g:?}");
        }
        // A frame of a closed connection polled late takes its slot from the oldest close.
        g.orphan_received(0);
        g.release_limbo(t0 + Duration::from_secs(2));
        assert_eq!((g.limbo(), g.closes.len()), (0, 0));
        assert_eq!(
            g.free(),
            total - 1,
            "the orphan's slot is free when it comes back"
        );
    }
}
