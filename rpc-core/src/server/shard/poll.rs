//! The shard's poll loop: completions in batches, ready handler tasks, sends posted per turn,
//! upkeep of every connection (reposts, credits, deferred frames, deadlines), and the idle
//! spin, yield and sleep.

use crate::queue::PopIfAny;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::Status;
use crate::buf::Polled;
use crate::call;
use crate::doorbell::wait_readable;
use crate::link::{Control, LinkError, WrKind, completion, split_wr_id};
use crate::poll_policy::{Budget, Spinner, Wait};
use crate::server::ShardPolling;
use crate::server::call::{CallCtx, panicked};
use crate::verbs::{AsyncEvent, CompChannel, Cq, Provider, Wc, WcStatus};
use crate::wire::CallId;

use super::conn::POOL_KEY;
use super::grants::{FLOOR, RECLAIM_IDLE, Returned};
use super::respond::Reply;
use super::{Shard, retire};

/// Empty loop iterations spent spinning before yielding (adaptive mode).
const SPIN_ITERS: u32 = 20_000;
/// Empty loop iterations spent yielding before sleeping (adaptive mode).
const YIELD_ITERS: u32 = 200;
/// How an idle shard waits in each mode ([`ShardPolling`]; `Event` sleeps at once).
const ADAPTIVE: Budget = Budget::adaptive(SPIN_ITERS, YIELD_ITERS);
/// Idle iterations between two passes over the connections (reposts, credits, deadlines,
/// inbox) when nothing happens; after any work the pass runs at once.
const MAINTAIN_EVERY: u32 = 64;
/// A busy shard maintains the connections it touched each turn, and this often sweeps a
/// slice of the others (deadlines, deferred frames, credits and idle windows of connections
/// that had no completion meanwhile).
const SWEEP_EVERY: Duration = Duration::from_millis(1);
/// Connections one sweep visits at most: a pass over all of them takes `live / SWEEP_SLICE`
/// sweeps (40 ms with 10,000 connections), so a shard holding many idle connections spends
/// a bounded share of its time on them.
const SWEEP_SLICE: usize = 256;
/// How often an idle shard reads the device's asynchronous events (one system call on ib).
const EVENTS_EVERY: Duration = Duration::from_millis(10);
/// Longest sleep, so shutdown and deadlines are noticed.
const MAX_SLEEP: Duration = Duration::from_millis(50);

/// How long a draining shard goes on after its last call finished (within the grace period):
/// requests a client posted before it saw our GoAway are still in flight then, and are
/// refused unexecuted (the client sends them elsewhere) instead of being lost with the
/// connection, which would leave the client unable to tell whether they ran.
const DRAIN_LINGER: Duration = Duration::from_millis(100);

impl<P: Provider> Shard<P> {
    /// Runs the poll loop until the server stops and every call has finished.
    pub(crate) fn run(mut self, rt: tokio::runtime::Handle) {
        let _enter = rt.enter();
        crate::poll_policy::mark_shard_thread();
        if let Some(core) = self.cfg.core_of(self.id) {
            pin_to_core(core);
        }
        let mut idle: u32 = 0;
        let mut spin = Spinner::new();
        let mut stop_at: Option<(Instant, Instant)> = None;
        loop {
            spin.before_turn(Instant::now);
            let mut work = self.poll_cq();
            work += self.run_ready();
            if work > 0 {
                // The responses of this turn go out together: one post per connection.
                self.flush_sends();
            }
            // Stopping: check every pass, or a sleeping shard notices only every
            // MAINTAIN_EVERY sleeps (up to 64 x MAX_SLEEP) that its last call is gone.
            if work > 0 || idle.is_multiple_of(MAINTAIN_EVERY) || self.stop.load(Ordering::Relaxed)
            {
                let idle_turn = work == 0;
                if idle_turn {
                    // Also while spinning idle, not only before sleeping (a shard whose
                    // calls come often enough never sleeps), but at most every EVENTS_EVERY.
                    let now = Instant::now();
                    if now >= self.events_due {
                        self.events_due = now + EVENTS_EVERY;
                        self.async_events();
                    }
                }
                work += self.drain_inbox();
                work += self.start_bulk_ops();
                let swept = self.maintain(&mut work);
                self.flush_sends();
                if swept {
                    self.clear_touched();
                }
                if self.stop.load(Ordering::Acquire) {
                    // Draining: stop once every call finished, or when the grace period is up
                    // (the handlers still running are then dropped with their connections).
                    // A graceful shutdown lingers a little after the last call, while
                    // connections are open (see DRAIN_LINGER); dropping the server does not.
                    let now = Instant::now();
                    let (linger, deadline) = *stop_at.get_or_insert_with(|| {
                        let grace = now + self.cfg.shutdown_grace;
                        let linger = if self.linger.load(Ordering::Acquire) {
                            DRAIN_LINGER
                        } else {
                            Duration::ZERO
                        };
                        ((now + linger).min(grace), grace)
                    });
                    let live = self.live_calls.load(Ordering::Acquire);
                    if live == 0 && (now >= linger || self.live.is_empty()) {
                        break;
                    }
                    if Instant::now() >= deadline {
                        warn!(
                            shard = self.id,
                            "shutdown grace period over: dropping {live} call(s) still running"
                        );
                        break;
                    }
                }
            }
            if work > 0 {
                idle = 0;
                spin.work();
                continue;
            }
            idle = idle.saturating_add(1);
            // Busy and Adaptive spin while the shard has its core; once it sees it has not
            // (clock gaps while spinning, late wake-ups), both spin only briefly and sleep on
            // the completion channel until the host is quiet again (see `ShardPolling`).
            let wait = match self.cfg.poll_mode {
                ShardPolling::Busy => spin.idle(&Budget::BUSY, Instant::now),
                ShardPolling::Adaptive => spin.idle(&ADAPTIVE, Instant::now),
                ShardPolling::Event => Wait::Sleep,
            };
            match wait {
                Wait::Spin => std::hint::spin_loop(),
                Wait::Yield => std::thread::yield_now(),
                Wait::Sleep => {
                    let started = Instant::now();
                    match self.sleep() {
                        Some(asked) => spin.woke(started, asked, Instant::now()),
                        None => spin.work(),
                    }
                }
            }
        }
        // Close what is left (calls past the grace period, bulk operations and READs in
        // flight): each connection's QPs are destroyed before anything they may touch is
        // released (see `close`).
        let why = Status::unavailable("the server shut down");
        for idx in std::mem::take(&mut self.live) {
            if let Some(Some(conn)) = self.conns.get(idx as usize) {
                let key = conn.link.key();
                self.close(key, &why);
            }
        }
        info!(
            shard = self.id,
            "shard {}/{} stopped", self.id, self.nshards
        );
    }

    /// Sleeps on the doorbell and the completion channel until something comes or the next
    /// deadline; returns the timeout it slept with, `None` when work came first.
    pub(super) fn sleep(&mut self) -> Option<Duration> {
        // First the idle upkeep a spinning shard does every MAINTAIN_EVERY idle turns:
        // receive slots waiting for a batch, credits to return, deferred frames. A shard that
        // sleeps after a few idle turns (Event, or contended) would otherwise leave them
        // until the next wake-up, and the client, out of credits or of posted receives,
        // waits for a timeout instead.
        let mut upkeep = self.drain_inbox() + self.start_bulk_ops();
        let swept = self.maintain(&mut upkeep);
        self.flush_sends();
        if swept {
            self.clear_touched();
        }
        if upkeep > 0 {
            return None;
        }
        self.doorbell.prepare_sleep();
        let _ = self.cq.req_notify(false);
        for cq in &self.more_cqs {
            let _ = cq.req_notify(false);
        }
        // Anything that arrived before the doorbell flag was visible is seen by this re-check.
        if !self.inbox.is_empty()
            || !self.peer_api.ops.is_empty()
            || !self.peer_api.grants.is_empty()
            || self.poll_cq() > 0
            || self.run_ready() > 0
        {
            self.flush_sends();
            self.doorbell.awake();
            return None;
        }
        self.async_events();
        let timeout = self.next_deadline().map_or(MAX_SLEEP, |d| d.min(MAX_SLEEP));
        wait_readable(&[self.doorbell.fd(), self.channel.fd()], timeout);
        let _ = self.channel.drain();
        self.doorbell.awake();
        Some(timeout)
    }

    /// The time to the earliest protocol deadline: of the connections touched since the last
    /// sweep, and the earliest the last pass of the sweep found among the others (waking
    /// early for a deadline that went away meanwhile is harmless).
    pub(super) fn next_deadline(&self) -> Option<Duration> {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.touched
            .iter()
            .filter_map(|&i| self.conns.get(usize::from(i))?.as_ref())
            .filter_map(|c| c.link.wire.poll_timeout())
            .chain(self.swept_deadline)
            .min()
            .map(|d| Duration::from_nanos(d.saturating_sub(now)))
    }

    /// Marks connection `idx` as having work this turn (see `touched`).
    #[inline]
    pub(super) fn touch(&mut self, idx: usize) {
        mark(&mut self.touched, &mut self.is_touched, idx);
    }

    /// After a full sweep: no connection is marked any more.
    fn clear_touched(&mut self) {
        for &i in &self.touched {
            if let Some(t) = self.is_touched.get_mut(i as usize) {
                *t = false;
            }
        }
        self.touched.clear();
    }

    /// Posts the frames the connections touched since the last sweep queued
    /// ([`crate::link::Link::flush_sends`]).
    pub(super) fn flush_sends(&mut self) {
        let mut failed = None;
        for &i in &self.touched {
            if let Some(Some(conn)) = self.conns.get_mut(i as usize)
                && conn.link.has_queued_sends()
                && let Err(e) = conn.link.flush_sends()
            {
                failed = Some((conn.link.key(), e));
                break;
            }
        }
        if let Some((key, e)) = failed {
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
        }
    }

    pub(super) fn poll_cq(&mut self) -> usize {
        // With more CQs, the first takes half a batch at most, so a busy first CQ cannot keep
        // the send completions of the others (and the send slots they free) waiting.
        let first = if self.more_cqs.is_empty() {
            super::POLL_BATCH
        } else {
            super::POLL_BATCH / 2
        };
        let mut n = match self.cq.poll(&mut self.wcs[..first]) {
            Ok(n) => n,
            Err(e) => {
                warn!("poll_cq failed: {e}");
                return 0;
            }
        };
        for cq in &mut self.more_cqs {
            if n == super::POLL_BATCH {
                break;
            }
            match cq.poll(&mut self.wcs[n..]) {
                Ok(k) => n += k,
                Err(e) => warn!("poll_cq failed: {e}"),
            }
        }
        // One clock read per batch and connection (at its first frame that needs the time),
        // not one per frame; and with more than one completion, start loading every received
        // frame before handling the first.
        for wc in &self.wcs[..n] {
            let (key, kind, aux) = split_wr_id(wc.wr_id);
            let idx = if key == POOL_KEY {
                if n > 1 && kind == Some(WrKind::Recv) {
                    self.pool.prefetch_recv(aux, wc.byte_len);
                }
                match self.qp_conn.get(&wc.qp_num) {
                    Some(&i) => usize::from(i),
                    None => continue,
                }
            } else {
                key.idx as usize
            };
            mark(&mut self.touched, &mut self.is_touched, idx);
            if let Some(Some(c)) = self.conns.get_mut(idx) {
                c.link.tick();
                if n > 1 {
                    c.link.prefetch(wc);
                }
            }
        }
        for i in 0..n {
            let wc = self.wcs[i];
            self.on_completion(&wc);
        }
        n
    }

    pub(super) fn on_completion(&mut self, wc: &Wc) {
        if wc.status != WcStatus::Success
            && let Some(t) = &self.stats
        {
            t.count_failed_completion(wc.status);
        }
        let (key, kind, aux) = split_wr_id(wc.wr_id);
        if key == POOL_KEY {
            if kind == Some(WrKind::Recv) {
                self.on_pool_recv(wc, aux);
            }
            return;
        }
        let idx = key.idx as usize;
        let live = matches!(self.conns.get(idx), Some(Some(c)) if c.link.key() == key);
        if !live {
            return; // a completion of a connection already closed
        }
        let result = match kind {
            // Connections receive through the shard's SRQ only (POOL_KEY, above).
            Some(WrKind::Recv) => Err(LinkError::Protocol(
                "receive completion outside the shard's receive pool".into(),
            )),
            Some(WrKind::Send) => match self.conns.get_mut(idx) {
                Some(Some(c)) => call::send_done(&mut c.link, wc, aux),
                _ => completion(wc),
            },
            Some(WrKind::Read) => self.on_read_done(idx, wc, aux),
            Some(WrKind::Write) => completion(wc).map(|()| {
                // Only a WRITE that succeeded gives its source back (a failed one fails the
                // connection, whose close parks it until the QPs are destroyed: a striped
                // WRITE may still be in flight on another QP).
                if let Some(Some(c)) = self.conns.get_mut(idx)
                    && let Some(call) = c.calls.get_mut(aux as usize)
                {
                    call.writing.pop_front();
                }
            }),
            Some(WrKind::Nop) => completion(wc),
            Some(WrKind::Bulk) => self.on_bulk_done(wc, aux as usize),
            Some(WrKind::Stripe) => match self.conns.get_mut(idx) {
                Some(Some(c)) => match c.link.on_stripe(wc, aux) {
                    Ok(Some(whole)) => {
                        self.on_completion(&whole);
                        Ok(())
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                },
                _ => Ok(()),
            },
            None => Err(LinkError::Protocol(
                "completion with an unknown work-request id".into(),
            )),
        };
        if let Err(e) = result {
            let e = match self.conns.get(idx) {
                Some(Some(c)) => c.link.explain(e),
                _ => e,
            };
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
        }
    }

    pub(super) fn run_ready(&mut self) -> usize {
        let mut n = 0;
        while let Some(task) = self.tasks.next_ready() {
            n += 1;
            let (idx, call) = self.task_owner[task.idx as usize];
            mark(&mut self.touched, &mut self.is_touched, idx as usize);
            let Some(Some(conn)) = self.conns.get_mut(idx as usize) else {
                self.tasks.cancel(task);
                continue;
            };
            let (trace, span) = match conn.slot(call) {
                Some(c) if c.trace.is_some() => (c.trace, c.span.clone()),
                _ => (None, tracing::Span::none()),
            };
            let _trace = crate::trace::enter(trace);
            let _span = span.enter();
            let mut reply = Reply {
                conn,
                call,
                api: &self.peer_api,
            };
            let done = match self.tasks.poll(task, &mut reply) {
                Polled::Pending => false,
                Polled::Done => true,
                Polled::Panicked(payload) => {
                    let path = reply.conn.slot(call).map_or("?", |c| c.path);
                    reply.fail(&panicked(path, payload.as_ref()));
                    true
                }
            };
            if done
                && let Some(c) = reply.conn.calls.get_mut(call.slot() as usize)
                && c.id == call
            {
                if c.task == Some(task) {
                    c.task = None;
                }
                retire(&self.live_calls, c);
            }
        }
        n
    }

    /// Reposts the pool's receive slots and settles their credits, returns credits, sends
    /// deferred frames, expires deadlines: for the connections touched since the last sweep,
    /// and, every `SWEEP_EVERY`, a slice of the others (reclaiming idle windows too). Adds
    /// the work done to `work`; returns whether it swept.
    pub(super) fn maintain(&mut self, work: &mut usize) -> bool {
        let now = Instant::now();
        let sweep = now.duration_since(self.swept_at) >= SWEEP_EVERY;
        if sweep {
            self.swept_at = now;
            self.sweep_slice(now);
        }
        *work += self.maintain_list(sweep);
        sweep
    }

    /// The sweep's next slice of the live connections: reclaims the windows of those idle
    /// for `RECLAIM_IDLE`, notes their deadlines, and marks them for this turn's
    /// maintenance. A pass ends when the slices wrapped around `live`.
    fn sweep_slice(&mut self, now: Instant) {
        let n = self.live.len();
        // Draining: every connection is told GoAway at once.
        let take = if self.stop.load(Ordering::Relaxed) {
            n
        } else {
            n.min(SWEEP_SLICE)
        };
        let mut failed = None;
        for j in 0..take {
            let idx = usize::from(self.live[(self.sweep_cursor + j) % n]);
            let Some(Some(conn)) = self.conns.get_mut(idx) else {
                continue;
            };
            if let Err(e) = Self::maybe_reclaim(conn, now) {
                failed = Some((conn.link.key(), e));
                break;
            }
            if let Some(t) = conn.link.wire.poll_timeout() {
                self.pass_deadline = Some(self.pass_deadline.map_or(t, |d| d.min(t)));
            }
            mark(&mut self.touched, &mut self.is_touched, idx);
        }
        self.sweep_cursor += take;
        if self.sweep_cursor >= n {
            self.sweep_cursor = 0;
            self.swept_deadline = self.pass_deadline.take();
        }
        if let Some((key, e)) = failed {
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
        }
    }

    /// Settles the receive slots that came back to the pool with the connections whose
    /// frames they held (the credit is owed back, or the window shrinks:
    /// [`super::grants::Grants::settle`]) and puts them on the stash of unposted slots
    /// ([`Shard::post_excess`] posts what is needed).
    fn repost_pool(&mut self) -> usize {
        let mut done = 0;
        while let Some(idx) = self.pool.take_repost() {
            done += 1;
            self.stash.push(idx);
            match self.grants.returned(idx) {
                Returned::Free => {}
                Returned::Conn(key) => {
                    let i = usize::from(key.idx);
                    match self.conns.get_mut(i) {
                        Some(Some(conn)) if conn.link.key() == key => {
                            if let Err(e) = self.grants.settle(&mut conn.link.wire) {
                                warn!(shard = self.id, "receive credit accounting: {e}");
                            }
                            mark(&mut self.touched, &mut self.is_touched, i);
                        }
                        _ => self.grants.orphan(),
                    }
                }
            }
        }
        self.post_excess();
        done
    }

    /// When the sweep visits a connection (at `now`) whose client sent nothing for
    /// `RECLAIM_IDLE` and that holds more than the floor of the pool: asks the client to give
    /// back what it does not use.
    fn maybe_reclaim(conn: &mut super::ServerConn<P>, now: Instant) -> Result<(), LinkError> {
        let since = *conn.idle_since.get_or_insert(now);
        let w = &conn.link.wire;
        if now.duration_since(since) >= RECLAIM_IDLE
            && w.peer_credits() + w.owed_credits() > FLOOR
            && !w.is_reclaiming()
        {
            conn.idle_since = Some(now);
            conn.link.control(Control::Reclaim(FLOOR))?;
        }
        Ok(())
    }

    /// `maintain` over every live connection (`full`) or those touched this turn.
    fn maintain_list(&mut self, sweep: bool) -> usize {
        let mut work = self.repost_pool();
        if sweep {
            self.grants.release_limbo(Instant::now());
            self.grants.publish(&self.gauge);
        }
        while let Some((key, call, n)) = self.peer_api.grants.pop_if_any() {
            mark(&mut self.touched, &mut self.is_touched, key.idx as usize);
            if let Some(Some(conn)) = self.conns.get_mut(key.idx as usize)
                && conn.link.key() == key
                && let Err(e) = conn.link.control(Control::WindowUpdate(call, n))
            {
                warn!(%call, "window update: {e}");
            }
        }
        let stopping = self.stop.load(Ordering::Acquire);
        let mut failed = None;
        let mut expired: [(usize, CallId); 8] = [(0, CallId(0)); 8];
        let mut n_expired = 0;
        // By index: the grants above may have touched more connections.
        for k in 0..self.touched.len() {
            let idx = usize::from(self.touched[k]);
            let Some(Some(conn)) = self.conns.get_mut(idx) else {
                continue;
            };
            if stopping && !conn.goaway_sent {
                // Draining: tell the client to start no new call here.
                conn.goaway_sent = true;
                if let Err(e) = conn.link.control(Control::GoAway) {
                    failed = Some((conn.link.key(), e));
                    break;
                }
            }
            conn.flush_deferred();
            if let Err(e) = conn.link.flush_control() {
                failed = Some((conn.link.key(), e));
                break;
            }
            if !conn.blocked.is_empty()
                && conn.link.wire.data_credits() > 0
                && conn.link.can_stage()
            {
                for call in std::mem::take(&mut conn.blocked) {
                    if let Some(c) = conn.slot(call)
                        && std::mem::take(&mut c.blocked)
                        && let Some(t) = c.task
                    {
                        self.tasks.wake(t);
                        work += 1;
                    }
                }
            }
            if let Err(e) = conn.link.maybe_credit_update() {
                failed = Some((conn.link.key(), e));
                break;
            }
            conn.link.tick();
            if let Some(now) = conn.link.expiry_due() {
                while n_expired < expired.len() {
                    let Some(call) = conn.link.wire.expire(now) else {
                        break;
                    };
                    expired[n_expired] = (idx, call);
                    n_expired += 1;
                }
            }
        }
        if let Some((key, e)) = failed {
            warn!("connection failed: {e}");
            self.close_failed(key, &e.status());
        }
        for &(idx, call) in &expired[..n_expired] {
            debug!(%call, "deadline exceeded on the server: handler dropped");
            self.drop_call(idx, call);
        }
        work + n_expired
    }
}

impl<P: Provider> Shard<P> {
    /// Reads the device's asynchronous events (ib: a non-blocking read of its event channel;
    /// soft has none) before the shard sleeps, off the busy path, and turns the fatal ones
    /// into connection failures that name the cause: a failed device or CQ closes every
    /// connection, a failed QP its own. A port that went down is logged: its connections fail
    /// with `RETRY_EXC_ERR` when their retries run out, and recover if it comes back first.
    pub(super) fn async_events(&mut self) {
        let mut events = Vec::new();
        let who = format_args!("shard {}", self.id);
        crate::link::device_events(
            || crate::verbs::Context::poll_async_event(&self.ctx),
            &who,
            |ev, why| {
                events.push((ev, why));
                true
            },
        );
        for (ev, why) in events {
            let hit: Vec<_> = match ev {
                AsyncEvent::DeviceFatal | AsyncEvent::CqError => {
                    self.conns.iter().flatten().map(|c| c.link.key()).collect()
                }
                AsyncEvent::QpFatal { qp_num } => self
                    .conns
                    .iter()
                    .flatten()
                    .filter(|c| c.link.owns_qp(qp_num))
                    .map(|c| c.link.key())
                    .collect(),
                _ => Vec::new(),
            };
            if ev.is_fatal() {
                warn!(
                    "shard {}: {} ({ev:?}): {} connection(s) fail",
                    self.id,
                    ev.cause(),
                    hit.len()
                );
            } else {
                info!("shard {}: {} ({ev:?})", self.id, ev.cause());
            }
            for key in hit {
                self.close_failed(key, &why);
            }
        }
    }
}

pub(super) fn pin_to_core(core: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(core);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        warn!("could not pin shard to core {core}: {e}");
    }
}

/// Adds `idx` to the connections touched this turn (once).
#[inline]
fn mark(touched: &mut Vec<u16>, is_touched: &mut Vec<bool>, idx: usize) {
    if idx >= is_touched.len() {
        is_touched.resize(idx + 1, false);
    }
    if !is_touched[idx] {
        is_touched[idx] = true;
        touched.push(idx as u16);
    }
}
