//! One CQ for the `ClientPoller::Thread` connections of a process on a device, as a server
//! shard has one for its connections: a new channel costs a QP and small state, not a CQ and
//! a completion channel of its own (a descriptor, and one more held by the server for as long
//! as the connection lives).
//!
//! ```text
//!  QPs of every member ──> shared CQ ──(whoever holds the hub)──> route by the wr_id's link key
//!                                                                   │
//!            member's own completions: straight into its turn <─────┤
//!            another member's: its queue, and the member listed ──> the poller thread turns it
//! ```
//!
//! Whoever drives a member (the poller thread's turn, a caller that drives its own connection
//! while it waits) takes its completions from its queue first; when the queue is empty it
//! takes the hub (try-only, like the driver token) and polls the CQ itself, so a caller that
//! drives its own connection still finds its answer with no hand-off between threads. The
//! completions it finds for other members go to their queues, in order, and those members are
//! listed with the poller thread (which is rung if it sleeps). The poller thread routes the
//! hub for idle members when its completion channel fires (the channel is in its epoll set)
//! and every millisecond while it spins; before it sleeps it arms the CQ and routes once
//! more, unless a caller drives a member's connection: that caller polls the CQ anyway (and
//! rings the thread when it routes to others), so that a lone caller's own answers never
//! wake the thread; the last such caller to stop rings it if it slept so while members had
//! calls in flight ([`Hub::stop_driving`]). An idle member's unasked frames (a GoAway) wait
//! for the thread's next wake-up then, at most its longest sleep (20 ms), as they did when a
//! caller drove a connection with a CQ of its own.
//!
//! Order: a member's completions reach it in the CQ's order. Completions enter a queue only
//! while the hub is held, and a member that holds the hub empties its queue before it polls
//! the CQ, so nothing it polls overtakes what was queued for it.
//!
//! Room: a member's queue holds up to [`QUEUE_MAX`] completions; what finds it full waits in
//! the hub's spill list, in order, and is routed first next time: never dropped. (A member's
//! completions outstanding are bounded by its QPs' queues, whose room it reserved on the CQ:
//! its driver posts nothing before it handled the completions of what it posted.)
//!
//! A member whose QPs do not fit (the CQ at the device's `max_cqe`, or 65,536 members) gets a
//! CQ of its own, as every connection had before.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use crossbeam_queue::ArrayQueue;

use crate::buf::Exclusive;
use crate::doorbell::Doorbell;
use crate::link::{LinkKey, split_wr_id};
use crate::verbs::{CompChannel, Context, Cq, ErrorKind, Provider, Result, Verb, VerbsError, Wc};

use super::group::{Listing, Poller, Source};

/// Completions polled from the CQ at once.
const BATCH: usize = 32;

/// Entries the CQ starts with; it grows (doubling) as members join.
const FIRST_CQE: u32 = 4096;

/// Completions a member's queue holds at most (1.5 KiB): more wait in the hub's spill list
/// (routed first next time). A member's own turn polls the CQ itself when its queue is empty,
/// so its queue holds only what others polled for it since its last turn.
const QUEUE_MAX: u32 = 32;

/// Members at most (the link key's index is 16 bits).
const MAX_MEMBERS: usize = 1 << 16;

/// What a member shares with whoever routes: its queue of completions and its listing.
#[derive(Debug)]
pub(crate) struct Routed {
    wcs: ArrayQueue<Wc>,
    pub(crate) listing: Listing,
}

impl Routed {
    /// For a connection with a CQ of its own (nothing is ever routed to it).
    pub(crate) fn unrouted() -> Arc<Routed> {
        Arc::new(Routed {
            wcs: ArrayQueue::new(1),
            listing: Listing::new(),
        })
    }

    /// Whether completions wait for the member.
    pub(crate) fn has_work(&self) -> bool {
        !self.wcs.is_empty()
    }
}

struct Route {
    generation: u8,
    to: Option<Arc<Routed>>,
}

struct State<P: Provider> {
    cq: P::Cq,
    routes: Vec<Route>,
    free: Vec<u16>,
    wcs: [Wc; BATCH],
    /// Completions whose member's queue was full (never expected), oldest first.
    spill: VecDeque<Wc>,
}

/// The shared CQ (see the module docs).
pub(crate) struct Hub<P: Provider> {
    /// Declared before `channel`: the CQ is destroyed first.
    state: Exclusive<State<P>>,
    channel: P::CompChannel,
    poller: Poller,
    doorbell: Arc<Doorbell>,
    members: AtomicUsize,
    /// Callers driving a member's connection now (see [`Hub::driving`]).
    drivers: AtomicUsize,
    /// The poller thread sleeps with the CQ unarmed while members have calls in flight.
    wants_arm: AtomicBool,
    /// The device's `max_cqe` (lowered by tests).
    max_cqe: AtomicU32,
}

impl<P: Provider> std::fmt::Debug for Hub<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("members", &self.members.load(Ordering::Relaxed))
            .finish()
    }
}

impl<P: Provider> Hub<P> {
    /// A hub on `ctx`, known to the process's poller thread.
    pub(crate) fn new(ctx: &P::Context, poller: Poller) -> Result<Arc<Hub<P>>> {
        let channel = ctx.create_comp_channel()?;
        let max_cqe = ctx.caps().max_cqe;
        let cq = ctx.create_cq(FIRST_CQE.min(max_cqe), Some(&channel))?;
        let hub = Arc::new(Hub {
            state: Exclusive::new(State {
                cq,
                routes: Vec::new(),
                free: Vec::new(),
                wcs: [Wc::default(); BATCH],
                spill: VecDeque::new(),
            }),
            channel,
            doorbell: poller.doorbell(),
            poller,
            members: AtomicUsize::new(0),
            drivers: AtomicUsize::new(0),
            wants_arm: AtomicBool::new(false),
            max_cqe: AtomicU32::new(max_cqe),
        });
        let source: Arc<dyn Source> = Arc::clone(&hub) as Arc<dyn Source>;
        poller.add_source(Arc::downgrade(&source));
        Ok(hub)
    }

    /// A caller drives a member's connection (it polls the CQ at every turn, routing what it
    /// finds for the others): meanwhile the poller thread does not arm the CQ before it
    /// sleeps, so that the caller's own completions do not wake it (what it would have to
    /// route, the caller routes, ringing it).
    pub(crate) fn driving(&self) {
        self.drivers.fetch_add(1, Ordering::SeqCst);
    }

    /// The caller stopped driving. The last one rings the poller thread if it went to sleep
    /// with the CQ unarmed while members of its had calls in flight, so that it arms it.
    pub(crate) fn stop_driving(&self) {
        // SeqCst against the thread's `arm`: it sees no driver (and arms), or we see its flag.
        if self.drivers.fetch_sub(1, Ordering::SeqCst) == 1
            && self.wants_arm.swap(false, Ordering::SeqCst)
        {
            self.doorbell.ring();
        }
    }

    /// Takes the hub, waiting for whoever routes now (a poll of the CQ: short). Setup and
    /// teardown only.
    fn lock(&self) -> crate::buf::handoff::ExclusiveGuard<'_, State<P>> {
        loop {
            if let Some(g) = self.state.try_lock() {
                return g;
            }
            std::thread::yield_now();
        }
    }

    /// A new member whose QPs need `cqe` entries: makes room on the CQ (growing it), then
    /// `create` makes the QPs on it, under the hub (no poll meanwhile). `Err` with
    /// [`ErrorKind::ExceedsCaps`] when it does not fit: the member then makes a CQ of its own.
    pub(crate) fn join<T>(
        self: &Arc<Self>,
        cqe: u32,
        create: impl FnOnce(&P::Cq) -> Result<T>,
    ) -> Result<(Seat<P>, T)> {
        let mut g = self.lock();
        let st = &mut *g;
        if st.free.is_empty() && st.routes.len() >= MAX_MEMBERS {
            return Err(VerbsError::new(
                Verb::CreateQp,
                ErrorKind::ExceedsCaps,
                format!("the shared CQ serves {MAX_MEMBERS} connections already"),
            ));
        }
        let room = st.cq.room();
        if room < cqe {
            let cap = st.cq.capacity();
            let max_cqe = self.max_cqe.load(Ordering::Relaxed);
            let want = cap
                .saturating_add(cqe - room)
                .max(cap.saturating_mul(2))
                .min(max_cqe);
            if want < cap.saturating_add(cqe - room) {
                return Err(VerbsError::new(
                    Verb::ResizeCq,
                    ErrorKind::ExceedsCaps,
                    format!(
                        "the shared CQ ({cap} entries) cannot grow by the {cqe} this connection's \
                         QPs need (max_cqe {max_cqe})"
                    ),
                ));
            }
            st.cq.resize(want)?;
        }
        let made = create(&st.cq)?;
        let idx = match st.free.pop() {
            Some(i) => usize::from(i),
            None => {
                st.routes.push(Route {
                    generation: 0,
                    to: None,
                });
                st.routes.len() - 1
            }
        };
        let route = &mut st.routes[idx];
        route.generation = route.generation.wrapping_add(1);
        let routed = Arc::new(Routed {
            wcs: ArrayQueue::new(cqe.clamp(1, QUEUE_MAX) as usize),
            listing: Listing::new(),
        });
        route.to = Some(Arc::clone(&routed));
        let key = LinkKey {
            idx: idx as u16,
            generation: route.generation,
        };
        drop(g);
        self.members.fetch_add(1, Ordering::Relaxed);
        Ok((
            Seat {
                hub: Arc::clone(self),
                key,
                routed,
            },
            made,
        ))
    }

    /// Polls the CQ once and routes what it holds (the hub held as `st`): completions for
    /// `me` go to `out` while it has room (then to `me`'s queue), the others to their
    /// members' queues. Returns how many went to `out`, and how many were polled.
    fn route(
        &self,
        st: &mut State<P>,
        me: Option<(LinkKey, &Routed)>,
        out: &mut [Wc],
    ) -> Result<(usize, usize)> {
        let mut mine = 0;
        if !st.spill.is_empty() {
            self.unspill(st);
        }
        let n = st.cq.poll(&mut st.wcs)?;
        for i in 0..n {
            let wc = st.wcs[i];
            let (key, _, _) = split_wr_id(wc.wr_id);
            if let Some((k, r)) = me
                && k == key
            {
                if mine < out.len() && r.wcs.is_empty() && st.spill.is_empty() {
                    out[mine] = wc;
                    mine += 1;
                } else {
                    self.push(st, key, wc);
                }
                continue;
            }
            self.push(st, key, wc);
        }
        Ok((mine, n))
    }

    /// Queues `wc` for the member `key` names and lists it; drops it when that member left
    /// (its QPs are gone: nobody waits for it).
    fn push(&self, st: &mut State<P>, key: LinkKey, wc: Wc) {
        let Some(Route {
            generation,
            to: Some(r),
        }) = st.routes.get(usize::from(key.idx))
        else {
            return;
        };
        if *generation != key.generation {
            return;
        }
        if !st.spill.is_empty() || r.wcs.push(wc).is_err() {
            // Order holds: once one waits, every later completion waits behind it.
            st.spill.push_back(wc);
            return;
        }
        self.poller.list(&r.listing);
        self.doorbell.ring();
    }

    /// Routes the spilled completions again, oldest first, as far as their queues take them.
    fn unspill(&self, st: &mut State<P>) {
        let State { routes, spill, .. } = st;
        while let Some(wc) = spill.front().copied() {
            let (key, _, _) = split_wr_id(wc.wr_id);
            let Some(Route {
                generation,
                to: Some(to),
            }) = routes.get(usize::from(key.idx))
            else {
                spill.pop_front();
                continue;
            };
            if *generation != key.generation {
                spill.pop_front();
                continue;
            }
            if to.wcs.push(wc).is_err() {
                return;
            }
            spill.pop_front();
            self.poller.list(&to.listing);
            self.doorbell.ring();
        }
    }
}

#[cfg(test)]
impl<P: Provider> Hub<P> {
    /// Members now.
    pub(crate) fn members(&self) -> usize {
        self.members.load(Ordering::Relaxed)
    }

    /// Makes the CQ refuse to grow past its capacity now (as at the device's `max_cqe`).
    pub(crate) fn stop_growing(&self) {
        let cap = self.lock().cq.capacity();
        self.max_cqe.store(cap, Ordering::Relaxed);
    }

    /// Lets the CQ grow again, up to `max`.
    pub(crate) fn grow_up_to(&self, max: u32) {
        self.max_cqe.store(max, Ordering::Relaxed);
    }

    /// Its CQ's capacity and room.
    pub(crate) fn cq_room(&self) -> (u32, u32) {
        let g = self.lock();
        (g.cq.capacity(), g.cq.room())
    }
}

impl<P: Provider> Drop for Hub<P> {
    fn drop(&mut self) {
        self.poller.forget_source(self.channel.fd());
    }
}

/// A member's place on the hub: its link key and queue. Dropped (after its QPs), it leaves.
pub(crate) struct Seat<P: Provider> {
    hub: Arc<Hub<P>>,
    key: LinkKey,
    routed: Arc<Routed>,
}

impl<P: Provider> std::fmt::Debug for Seat<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seat").field("key", &self.key).finish()
    }
}

impl<P: Provider> Seat<P> {
    /// The link key the member's work requests carry.
    pub(crate) fn key(&self) -> LinkKey {
        self.key
    }

    /// The hub.
    pub(crate) fn hub(&self) -> &Arc<Hub<P>> {
        &self.hub
    }

    /// What the member shares with the routers.
    pub(crate) fn routed(&self) -> &Arc<Routed> {
        &self.routed
    }

    /// The member's next completions into `out`: those queued for it, else (the queue empty)
    /// what the CQ holds for it, routing the rest, if the hub is free. No allocation, no lock
    /// waited on.
    pub(crate) fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        let mut n = self.take_queued(out);
        if n > 0 {
            return Ok(n);
        }
        let Some(mut g) = self.hub.state.try_lock() else {
            return Ok(0);
        };
        // Queued between our look and the hub: first, so that order holds.
        n = self.take_queued(out);
        if n > 0 {
            return Ok(n);
        }
        let (mine, _) = self
            .hub
            .route(&mut g, Some((self.key, &self.routed)), out)?;
        Ok(mine)
    }

    fn take_queued(&self, out: &mut [Wc]) -> usize {
        let mut n = 0;
        while n < out.len()
            && let Some(wc) = self.routed.wcs.pop()
        {
            out[n] = wc;
            n += 1;
        }
        n
    }
}

impl<P: Provider> Drop for Seat<P> {
    fn drop(&mut self) {
        let mut g = self.hub.lock();
        if let Some(r) = g.routes.get_mut(usize::from(self.key.idx))
            && r.generation == self.key.generation
        {
            r.to = None;
            g.free.push(self.key.idx);
        }
        drop(g);
        self.hub.members.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<P: Provider> Source for Hub<P> {
    fn route_all(&self) -> usize {
        let Some(mut g) = self.state.try_lock() else {
            return 0;
        };
        let mut work = 0;
        for _ in 0..8 {
            match self.route(&mut g, None, &mut []) {
                Ok((_, n)) => {
                    work += n;
                    if n < BATCH {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!("client hub: polling the shared CQ failed: {e}");
                    break;
                }
            }
        }
        work
    }

    fn arm(&self, needed: bool) -> bool {
        if needed {
            self.wants_arm.store(true, Ordering::SeqCst);
        }
        if self.drivers.load(Ordering::SeqCst) > 0 {
            // A caller polls it, routing what it finds for the others (and ringing), so that
            // its own answers do not wake the thread; the last one to stop rings the thread if
            // `needed` (see `stop_driving`).
            return true;
        }
        self.wants_arm.store(false, Ordering::SeqCst);
        let Some(mut g) = self.state.try_lock() else {
            // Someone routes this instant: not quiet.
            return false;
        };
        let _ = g.cq.req_notify(false);
        // A completion that landed before the arming rang nobody: look once more.
        !matches!(self.route(&mut g, None, &mut []), Ok((_, n)) if n > 0)
    }

    fn woke(&self) {
        let _ = self.channel.drain();
    }

    fn with_channel_fd(&self, f: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>)) {
        f(self.channel.fd());
    }
}

/// Where a connection's completions come from: a CQ of its own, or its seat on the hub.
pub(crate) enum Cqs<P: Provider> {
    Own(P::Cq),
    Shared(Seat<P>),
}

impl<P: Provider> Cqs<P> {
    /// The connection's next completions (see [`Seat::poll`]).
    pub(crate) fn poll(&mut self, out: &mut [Wc]) -> Result<usize> {
        match self {
            Cqs::Own(cq) => cq.poll(out),
            Cqs::Shared(seat) => seat.poll(out),
        }
    }

    /// Arms a CQ of its own (the poller thread arms the hub's).
    pub(crate) fn req_notify(&self) {
        if let Cqs::Own(cq) = self {
            let _ = cq.req_notify(false);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::link::{WrKind, wr_id};
    use crate::verbs::soft::Soft;
    use crate::verbs::{
        Access, ConnectAttr, Mr as _, Pd as _, Qp as _, QpCaps, RecvWr, SendFlags, SendWr,
        WcStatus, WrOp,
    };

    const CAPS: QpCaps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 128,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };

    /// A member's 100 receive completions, polled and routed by another member: 32 fit its
    /// queue, the rest wait in the spill list; it gets all of them, in order, none is lost,
    /// and nothing reaches the member that routed them. Once it left, what still comes for
    /// it is dropped without holding up the others.
    #[test]
    fn another_members_completions_arrive_in_order_through_queue_and_spill() {
        let ctx = Soft::open(None).unwrap();
        let hub = Hub::<Soft>::new(&ctx, Poller::get().unwrap()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (a, mut qa) = hub.join(256, |cq| pd.create_qp(cq, cq, CAPS)).unwrap();
        let (b, _qb) = hub.join(256, |cq| pd.create_qp(cq, cq, CAPS)).unwrap();
        assert_ne!(a.key(), b.key());
        // The sender: another device context of this process, with a CQ of its own.
        let pctx = Soft::open(None).unwrap();
        let ppd = pctx.alloc_pd().unwrap();
        let pcq = pctx.create_cq(256, None).unwrap();
        let mut qp = ppd.create_qp(&pcq, &pcq, CAPS).unwrap();
        let attr = ConnectAttr {
            access: Access::LOCAL_WRITE,
            ..ConnectAttr::default()
        };
        let (ea, ep) = (qa.endpoint(), qp.endpoint());
        qa.connect(&ep, &attr).unwrap();
        qp.connect(&ea, &attr).unwrap();
        let rmr = pd.alloc_mr(100 * 64, Access::LOCAL_WRITE).unwrap();
        let smr = ppd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
        const N: u32 = 100;
        for i in 0..N {
            let sge = [rmr.sge(i as usize * 64, 64).unwrap()];
            let wr = RecvWr {
                wr_id: wr_id(a.key(), WrKind::Recv, i),
                sg_list: &sge,
            };
            // SAFETY: the region outlives the QP's use of it (both end with the test).
            unsafe { qa.post_recv(&[wr]).unwrap() };
        }
        for i in 0..N {
            let sge = [smr.sge(0, 8).unwrap()];
            let wr = SendWr {
                wr_id: u64::from(i),
                op: WrOp::Send,
                sg_list: &sge,
                flags: SendFlags::SIGNALED,
            };
            // SAFETY: as above.
            unsafe { qp.post_send(&[wr]).unwrap() };
        }
        let mut pcq = pcq;
        let mut sent = 0;
        let mut wcs = [Wc::default(); 32];
        let start = std::time::Instant::now();
        while sent < N {
            assert!(start.elapsed().as_secs() < 10, "SENDs done: {sent}");
            sent += pcq.poll(&mut wcs).unwrap() as u32;
        }
        // B polls: A's completions go to A's queue (32) and then the spill list.
        for _ in 0..8 {
            assert_eq!(b.poll(&mut wcs).unwrap(), 0, "nothing of B's");
        }
        assert_eq!(a.routed().wcs.len(), QUEUE_MAX as usize);
        assert!(a.routed().has_work());
        // A takes them all, in order.
        let mut got = Vec::new();
        let start = std::time::Instant::now();
        while got.len() < N as usize {
            assert!(start.elapsed().as_secs() < 10, "got {}", got.len());
            let n = a.poll(&mut wcs).unwrap();
            got.extend_from_slice(&wcs[..n]);
        }
        for (i, wc) in got.iter().enumerate() {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_eq!(
                split_wr_id(wc.wr_id),
                (a.key(), Some(WrKind::Recv), i as u32)
            );
        }
        assert_eq!(a.poll(&mut wcs).unwrap(), 0);
        assert_eq!(hub.members(), 2);

        // A leaves; receives posted for it complete (flushed) with its QP's end, and B's
        // polls drop them.
        for i in 0..4 {
            let sge = [rmr.sge(i * 64, 64).unwrap()];
            let wr = RecvWr {
                wr_id: wr_id(a.key(), WrKind::Recv, 1000 + i as u32),
                sg_list: &sge,
            };
            // SAFETY: as above.
            unsafe { qa.post_recv(&[wr]).unwrap() };
        }
        let routed = Arc::clone(a.routed());
        drop(qa);
        drop(a);
        assert_eq!(hub.members(), 1);
        for _ in 0..4 {
            assert_eq!(b.poll(&mut wcs).unwrap(), 0);
        }
        assert!(!routed.has_work(), "nothing routed to a member that left");
    }
}
