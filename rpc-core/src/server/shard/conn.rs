//! The shard's connections: opening its device objects (CQ, SRQ and its receive pool, send
//! slots), accepting a client (a QP on the SRQ, a window of the pool, the protocol state, the
//! call table) and closing a connection without releasing anything the NIC may still touch
//! before its QPs are destroyed.

use crate::queue::PopIfAny;
use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_queue::SegQueue;
use tracing::{info, warn};

use crate::Status;
use crate::buf::encode::MAX_PIECES;
use crate::buf::{BulkPool, Geometry, RecvPool, SlotArena};
use crate::call::{Calls, Record};
use crate::connect::{self, Hello, Message, Welcome};
use crate::doorbell::Doorbell;
use crate::link::{Lanes, Link, LinkKey, WrKind, lane_caps, wr_id};
use crate::server::ServerConfig;
use crate::server::call::Tasks;
use crate::server::notify::ShardNotify;
use crate::server::peer::PeerApi;
use crate::server::router::Router;
use crate::verbs::{
    Access, ConnectAttr, Context, Cq, Pd, Provider, Qp, QpCaps, RecvWr, Srq, SrqCaps, Wc,
};
use crate::wire::{self, CallId, Role};

use super::bulk::InflightOp;
use super::grants::{FLOOR, Grants};
use super::{Accepted, POLL_BATCH, ServerConn, Shard, ShardHandle, ShardMsg, retire};

/// Connections the shard's CQ is first sized for (it grows with more).
const FIRST_CQ_CONNS: u32 = 64;

/// Free receive slots kept posted beyond what the windows need (see `post_excess`).
const POSTED_SPARE: usize = 16;

/// The key in the work-request ids of the shard's SRQ receives: they belong to no connection
/// until a completion names the QP that consumed one.
pub(super) const POOL_KEY: LinkKey = LinkKey {
    idx: u16::MAX,
    generation: 0,
};

/// Opens the shard's device objects on the calling thread and returns the shard, ready to run.
pub(crate) fn open<P: Provider>(
    ctx: P::Context,
    id: u16,
    nshards: u16,
    cfg: Arc<ServerConfig>,
    router: Arc<Router>,
    epoch: Instant,
) -> Result<(Shard<P>, ShardHandle), crate::Error> {
    let pd = Arc::new(ctx.alloc_pd()?);
    let channel = ctx.create_comp_channel()?;
    let caps = ctx.caps();
    let cq_limit = caps.max_cqe.min(cfg.max_cq_entries);
    // The receive pool: as deep as asked, within the device's SRQ and seven eighths of the
    // largest CQ (its receives all complete on the first CQ; the rest of that CQ takes the
    // send queues of the first connections, and further ones get CQs of their own).
    let pool_max = cfg
        .pool_slots
        .min(caps.max_srq_wr)
        .min(cq_limit - cq_limit / 8)
        .min(
            cfg.max_conns_per_shard
                .saturating_mul(cfg.geometry.recv_slots)
                .max(FLOOR),
        );
    let pool = RecvPool::<P>::new(cfg.geometry.slot_size, pool_max)?;
    let srq = pd.create_srq(SrqCaps {
        max_wr: pool.max_slots(),
        max_sge: 1,
    })?;
    let sends = SlotArena::send_only(&pd, cfg.geometry.slot_size, cfg.geometry.send_slots)?;
    // CQ room for the SRQ and the send queues of the first connections of default size (at
    // most `max_conns_per_shard`); the CQ grows as more come (`create_qp`), so an idle shard
    // does not hold a CQ sized for the most it may ever serve, and past `cq_limit` the shard
    // adds CQs for the send completions of further connections. The soft and ib providers
    // both refuse a QP whose CQ could overrun.
    let per_conn = qp_caps(caps, Geometry::default().recv_slots, 64);
    let max_qps = match cfg.qps_per_connection {
        Some(n) => n,
        None => P::qps_per_connection()?,
    };
    let lanes = lane_caps(&per_conn, caps);
    let cqe = per_conn
        .max_send_wr
        .saturating_add((max_qps - 1).saturating_mul(lanes.max_send_wr + lanes.max_recv_wr))
        .saturating_mul(cfg.max_conns_per_shard.min(FIRST_CQ_CONNS))
        .saturating_add(pool.max_slots())
        .min(cq_limit);
    let cq = ctx.create_cq(cqe, Some(&channel))?;
    let doorbell = Doorbell::new()?;
    let tasks = Tasks::new(cfg.tasks_per_shard, ShardNotify(Arc::clone(&doorbell)));
    let inbox = Arc::new(SegQueue::new());
    let stop = Arc::new(AtomicBool::new(false));
    let linger = Arc::new(AtomicBool::new(false));
    let live_calls = Arc::new(AtomicUsize::new(0));
    let open_conns = Arc::new(AtomicUsize::new(0));
    let zero_copy_bytes = Arc::new(AtomicU64::new(0));
    let striped_bytes = Arc::new(AtomicU64::new(0));
    let bulk = BulkPool::new(Arc::clone(&pd), cfg.bulk_cache_bytes);
    let stats = cfg.stats.then(|| Arc::new(crate::stats::Table::new()));
    let peer_api = PeerApi::new(Arc::clone(&doorbell), Arc::clone(&bulk));
    let gauge = Arc::new(super::grants::Gauge::default());
    let n = cfg.max_conns_per_shard as usize;
    let max_inline = per_conn.max_inline_data;
    info!(
        shard = id,
        "shard {id}/{nshards}: {} device {} (port {}, {:?}), CQ depth {cqe}, receive pool of \
         up to {} slots on one SRQ, up to {} send slots",
        P::TAG,
        ctx.info().name,
        ctx.info().port,
        ctx.info().link_layer,
        pool.max_slots(),
        cfg.geometry.send_slots,
    );
    let handle = ShardHandle {
        inbox: Arc::clone(&inbox),
        doorbell: Arc::clone(&doorbell),
        stop: Arc::clone(&stop),
        linger: Arc::clone(&linger),
        live_calls: Arc::clone(&live_calls),
        open_conns: Arc::clone(&open_conns),
        zero_copy_bytes: Arc::clone(&zero_copy_bytes),
        striped_bytes: Arc::clone(&striped_bytes),
        stats: stats.clone(),
        pool: Arc::clone(&gauge),
        thread: std::sync::Mutex::new(None),
    };
    let mut shard = Shard {
        conns: Vec::new(),
        srq,
        pool,
        grants: Grants::new(),
        stash: Vec::new(),
        sends,
        qp_conn: super::QpMap::default(),
        gauge,
        live: Vec::with_capacity(n),
        generations: vec![0; n],
        touched: Vec::new(),
        is_touched: Vec::new(),
        swept_at: Instant::now(),
        sweep_cursor: 0,
        free_conns: Vec::new(),
        pass_deadline: None,
        swept_deadline: None,
        task_owner: vec![(0, CallId(0)); cfg.tasks_per_shard as usize],
        tasks,
        cq,
        more_cqs: Vec::new(),
        cq_limit,
        channel,
        bulk,
        pd,
        ctx,
        id,
        nshards,
        cfg,
        router,
        inbox,
        doorbell,
        stop,
        linger,
        live_calls,
        open_conns,
        zero_copy_bytes,
        striped_bytes,
        stats,
        max_qps,
        epoch,
        events_due: Instant::now(),
        max_inline,
        wcs: [Wc::default(); POLL_BATCH],
        peer_api,
        bulk_ops: slab::Slab::new(),
    };
    shard.grow_pool()?;
    Ok((shard, handle))
}

/// The send slots of the shard one connection may hold at once: a SEND in flight per receive
/// slot of its client, and a SEND per call whose completion is not polled yet (the client may
/// have taken the frame and given the credit back before the shard polls the send's
/// completion: with only the ring, a shard answering a full pipeline ran out of its share).
pub(super) fn slot_cap(peer_ring: u32, peer_calls: u32) -> u32 {
    peer_ring.saturating_add(peer_calls).max(4)
}

/// Send queue sizes of a connection whose client has a receive ring of `peer_ring` slots and
/// `peer_calls` calls: the SENDs of its share of the shard's send slots ([`slot_cap`]), plus a
/// READ (rendezvous request, stream message) and a WRITE (landing zone, bulk handle) per call,
/// plus the unsignaled inline SENDs and control frames; within the device's limit. Receives
/// come from the shard's SRQ.
pub(super) fn qp_caps(caps: &crate::verbs::Caps, peer_ring: u32, peer_calls: u32) -> QpCaps {
    QpCaps {
        max_send_wr: slot_cap(peer_ring, peer_calls)
            .saturating_add(peer_calls.saturating_mul(2))
            .saturating_add(crate::link::SIGNAL_EVERY + 16)
            .min(caps.max_qp_wr),
        max_recv_wr: 0,
        // Gathered requests (MAX_PIECES) and coalesced SENDs (BATCH_FRAMES).
        max_send_sge: (MAX_PIECES.max(crate::link::BATCH_FRAMES) as u32).min(caps.max_sge),
        max_recv_sge: 1,
        max_inline_data: caps.max_inline.min(256),
    }
}

/// Writes `welcome` on `control` (the client's TCP socket) now, from the shard's thread: the
/// client goes on without waiting for the acceptor's task to be woken (on a busy host, a
/// scheduler slice) and write it. Returns what is left to send (see [`Accepted::unsent`]).
fn send_welcome(control: Option<OwnedFd>, welcome: Welcome) -> std::io::Result<Vec<u8>> {
    let mut bytes = connect::framed(&Message::Welcome(welcome));
    if let Some(fd) = control {
        let sent = connect::send_now(fd.as_fd(), &bytes)?;
        bytes.drain(..sent);
    }
    Ok(bytes)
}

impl<P: Provider> Shard<P> {
    pub(super) fn drain_inbox(&mut self) -> usize {
        let mut n = 0;
        while let Some(msg) = self.inbox.pop_if_any() {
            n += 1;
            match msg {
                ShardMsg::Connect {
                    hello,
                    peer,
                    control,
                    reply,
                    closed,
                } => {
                    let r = self
                        .connect(hello, peer, closed)
                        .map(|(welcome, key)| Accepted {
                            key,
                            unsent: send_welcome(control, welcome),
                        });
                    let _ = reply.send(r);
                }
                ShardMsg::Disconnect(key) => {
                    self.close(key, &Status::unavailable("client disconnected"));
                }
            }
        }
        n
    }

    /// Registers one more chunk of the receive pool and posts its slots to the SRQ.
    ///
    /// # Errors
    /// At the pool's limit, or when registering or posting fails.
    pub(super) fn grow_pool(&mut self) -> crate::verbs::Result<()> {
        let slots = self.pool.grow(&self.pd)?;
        let n = slots.len();
        // The new slots are free and go under the stash (the coldest end): posted when the
        // windows need them (`post_excess`).
        self.stash.reserve(n);
        self.stash.splice(0..0, slots);
        self.grants.grown(n as u32, n as u32);
        self.grants.publish(&self.gauge);
        info!(
            shard = self.id,
            "shard {}: receive pool grown to {} slots ({} MiB)",
            self.id,
            self.pool.slots(),
            (u64::from(self.pool.slots()) * u64::from(self.pool.slot_size())) >> 20
        );
        Ok(())
    }

    /// Posts slots from the top of the stash (the most recently used, likely still in cache)
    /// until at most the pool's free slots less `POSTED_SPARE` stay unposted: every credit a
    /// client holds or is owed then has a posted receive behind it (the stash holds free
    /// slots only), while the SRQ holds no more than the windows need, so the slots it
    /// cycles through stay few and warm. Called after anything that took free slots (a
    /// grant, an admission, a loan, returned slots) and before frames go out.
    pub(super) fn post_excess(&mut self) {
        let keep = (self.grants.free() as usize).saturating_sub(POSTED_SPARE);
        if self.stash.len() <= keep {
            return;
        }
        let from = keep;
        let total = self.stash.len() - from;
        let mut buf = [0u32; 64];
        let mut done = 0;
        while done < total {
            let n = (total - done).min(buf.len());
            buf[..n].copy_from_slice(&self.stash[from + done..from + done + n]);
            if let Err((k, e)) = self.post_slots(&buf[..n]) {
                // The SRQ refused (it holds every slot of the pool, so it cannot be full);
                // the slots of this batch not taken went back on the repost queue and come
                // back as free; the ones not tried stay on the stash.
                warn!(
                    shard = self.id,
                    "posting receive slots ({k} of {n} posted): {e}"
                );
                self.stash.drain(from..from + done + n);
                return;
            }
            done += n;
        }
        self.stash.truncate(from);
    }

    /// Posts the pool's slots `idxs` (none posted, none guarded) to the SRQ, in batches.
    ///
    /// # Errors
    /// When `post_srq_recv` fails: how many of `idxs` (the first ones) were posted, and why
    /// the next was refused; the slots it did not take go back on the repost queue.
    pub(super) fn post_slots(
        &mut self,
        idxs: &[u32],
    ) -> Result<(), (usize, crate::verbs::VerbsError)> {
        const BATCH: usize = 16;
        for (k, chunk) in idxs.chunks(BATCH).enumerate() {
            let mut sges = [crate::verbs::Sge::default(); BATCH];
            let mut ids = [0u64; BATCH];
            for (i, &idx) in chunk.iter().enumerate() {
                // Slots of the pool are allocated (they came from it).
                sges[i] = self.pool.recv_sge(idx).unwrap_or_default();
                ids[i] = wr_id(POOL_KEY, WrKind::Recv, idx);
            }
            let wrs: [RecvWr<'_>; BATCH] = std::array::from_fn(|i| RecvWr {
                wr_id: ids[i],
                sg_list: std::slice::from_ref(&sges[i]),
            });
            // SAFETY: each SGE names a slot of the pool, whose memory the pool keeps (the
            // shard holds it, and its SRQ and QPs are destroyed before the shard's pool
            // reference drops); the slot is neither posted nor guarded: it is the NIC's from
            // now until its completion is polled.
            if let Err(e) = unsafe { self.srq.post_recv(&wrs[..chunk.len()]) } {
                let done = e.posted.min(chunk.len());
                let rest = idxs.get((k + 1) * BATCH..).unwrap_or_default();
                for &idx in chunk[done..].iter().chain(rest) {
                    self.pool.repost_later(idx);
                }
                return Err((k * BATCH + done, e.error));
            }
        }
        Ok(())
    }

    /// Creates a QP on the shard's SRQ; see [`Shard::create_qp_with`].
    fn create_qp(&mut self, caps: QpCaps) -> crate::verbs::Result<P::Qp> {
        self.create_qp_with(caps, true)
    }

    /// A data QP (one-sided transfers only): its own receive queue of none.
    fn create_lane(&mut self, caps: QpCaps) -> crate::verbs::Result<P::Qp> {
        self.create_qp_with(caps, false)
    }

    /// A QP whose send completions go to the first CQ (`cq` None) or to `more_cqs[i]`. The
    /// receives of a QP on the SRQ complete on the first CQ, which holds the SRQ's once.
    fn new_qp(&self, cq: Option<usize>, caps: QpCaps, on_srq: bool) -> crate::verbs::Result<P::Qp> {
        let send_cq = cq.map_or(&self.cq, |i| &self.more_cqs[i]);
        if on_srq {
            self.pd.create_qp_on_srq(send_cq, &self.cq, caps, &self.srq)
        } else {
            self.pd.create_qp(send_cq, send_cq, caps)
        }
    }

    /// Creates a QP on the first of the shard's CQs with room for its queues (the providers
    /// refuse a QP whose CQ could overrun, and say how much room a CQ has left). When none has
    /// room the newest grows, doubling, up to `cq_limit`; once it is at the limit the shard
    /// adds a CQ, on the same completion channel, which the poll loop polls too (see
    /// `poll_cq`). CQs are kept while the shard runs: room that closed connections gave back
    /// is taken first, so reconnecting clients add none.
    fn create_qp_with(&mut self, caps: QpCaps, on_srq: bool) -> crate::verbs::Result<P::Qp> {
        // An SRQ's receives are reserved on the first CQ once, with its first QP.
        let need = if on_srq {
            caps.max_send_wr
        } else {
            caps.max_send_wr.saturating_add(caps.max_recv_wr)
        };
        let cq = match self.cq_with_room(need) {
            Some(cq) => cq,
            None => self.make_cq_room(need)?,
        };
        match self.new_qp(cq, caps, on_srq) {
            // The first QP on the SRQ also reserves the SRQ's receives on the first CQ: when
            // its send queue does not fit beside them, its sends go to another CQ.
            Err(e)
                if on_srq && cq.is_none() && e.kind() == crate::verbs::ErrorKind::ExceedsCaps =>
            {
                let other = match self.more_cq_with_room(need) {
                    Some(i) => i,
                    None => self.add_cq(need)?,
                };
                self.new_qp(Some(other), caps, on_srq)
            }
            r => r,
        }
    }

    /// The first CQ (`Some(None)`: the first one; `Some(Some(i))`: `more_cqs[i]`) with room
    /// for `need` completions.
    fn cq_with_room(&self, need: u32) -> Option<Option<usize>> {
        if self.cq.room() >= need {
            return Some(None);
        }
        self.more_cq_with_room(need).map(Some)
    }

    /// The first of `more_cqs` with room for `need` completions.
    fn more_cq_with_room(&self, need: u32) -> Option<usize> {
        self.more_cqs.iter().position(|cq| cq.room() >= need)
    }

    /// Room for `need` completions: the newest CQ grown, or a new one.
    fn make_cq_room(&mut self, need: u32) -> crate::verbs::Result<Option<usize>> {
        let newest = self.more_cqs.len().checked_sub(1);
        let limit = self.cq_limit;
        let cq = newest.map_or(&mut self.cq, |i| &mut self.more_cqs[i]);
        let (cap, room) = (cq.capacity(), cq.room());
        let grown = cap
            .saturating_mul(2)
            .max(cap.saturating_add(need - room))
            .min(limit);
        if grown > cap && room + (grown - cap) >= need {
            cq.resize(grown)?;
            info!(
                shard = self.id,
                "shard {}: CQ {} grown from {cap} to {grown} entries ({} connections)",
                self.id,
                newest.map_or(0, |i| i + 1),
                self.live.len()
            );
            return Ok(newest);
        }
        self.add_cq(need).map(Some)
    }

    /// A new CQ for the send completions of QPs that need `need` each; returns its index in
    /// `more_cqs`.
    fn add_cq(&mut self, need: u32) -> crate::verbs::Result<usize> {
        let limit = self.cq_limit;
        let size = need.saturating_mul(FIRST_CQ_CONNS).min(limit);
        if size < need {
            return Err(crate::verbs::VerbsError::new(
                crate::verbs::Verb::CreateQp,
                crate::verbs::ErrorKind::ExceedsCaps,
                format!(
                    "a QP of this connection needs {need} completions, more than a CQ of the \
                     shard may hold ({limit}; ServerBuilder::max_cq_entries raises it up to \
                     the device's max_cqe)"
                ),
            ));
        }
        let cq = self.ctx.create_cq(size, Some(&self.channel))?;
        self.more_cqs.push(cq);
        info!(
            shard = self.id,
            "shard {}: CQ {} of {size} entries added ({} connections; each CQ holds at most \
             {limit} entries)",
            self.id,
            self.more_cqs.len(),
            self.live.len()
        );
        Ok(self.more_cqs.len() - 1)
    }

    pub(super) fn connect(
        &mut self,
        hello: Hello,
        peer: std::net::SocketAddr,
        closed: tokio::sync::oneshot::Sender<String>,
    ) -> Result<(Welcome, LinkKey), (crate::Code, String)> {
        let exhausted = |why: String| (crate::Code::ResourceExhausted, why);
        // The table grows as connections come (a high limit costs nothing while unused); the
        // entries closed connections left are reused first, without a scan of the table.
        let idx = match self.free_conns.pop() {
            Some(i) => usize::from(i),
            None if self.conns.len() < self.cfg.max_conns_per_shard as usize => {
                self.conns.push(None);
                self.conns.len() - 1
            }
            None => {
                return Err(exhausted(format!(
                    "server shard {} is full ({} connections)",
                    self.id, self.cfg.max_conns_per_shard
                )));
            }
        };
        let cfg = Arc::clone(&self.cfg);
        let cfg = &*cfg;
        // The connection's first window of the receive pool (the pool grows when it runs low).
        if self.grants.wants_growth()
            && let Err(e) = self.grow_pool()
            && e.kind() != crate::verbs::ErrorKind::ExceedsCaps
        {
            warn!(shard = self.id, "receive pool: {e}");
        }
        if !self.grants.admit(Instant::now())
            && (self.grow_pool().is_err() || !self.grants.admit(Instant::now()))
        {
            self.free_conns.push(idx as u16);
            return Err(exhausted(format!(
                "server shard {}'s receive pool is full ({} slots for {} connections; \
                 ServerBuilder::receive_pool_slots raises the limit)",
                self.id,
                self.pool.slots(),
                self.live.len()
            )));
        }
        // The new connection's credits have receives behind them before the Welcome.
        self.post_excess();
        let r = self.connect_admitted(idx, hello, peer, closed, cfg);
        if r.is_err() {
            self.grants.refused();
            self.free_conns.push(idx as u16);
        }
        r
    }

    fn connect_admitted(
        &mut self,
        idx: usize,
        hello: Hello,
        peer: std::net::SocketAddr,
        closed: tokio::sync::oneshot::Sender<String>,
        cfg: &ServerConfig,
    ) -> Result<(Welcome, LinkKey), (crate::Code, String)> {
        let exhausted = |why: String| (crate::Code::ResourceExhausted, why);
        let caps = qp_caps(self.ctx.caps(), hello.geometry.recv_slots, hello.max_calls);
        let mut qp = self
            .create_qp(caps)
            .map_err(|e| exhausted(format!("create QP: {e}")))?;
        let attr = ConnectAttr {
            access: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            ..ConnectAttr::default()
        };
        qp.connect(&hello.endpoint, &attr)
            .map_err(|e| connect_failed("connect QP", &e))?;
        // Data QPs: as many as both sides allow, connected to the client's first ones.
        let nlanes = (self.max_qps as usize - 1).min(hello.data_endpoints.len());
        let lcaps = lane_caps(&caps, self.ctx.caps());
        let mut lanes = Vec::with_capacity(nlanes);
        for ep in &hello.data_endpoints[..nlanes] {
            let mut q = self
                .create_lane(lcaps)
                .map_err(|e| exhausted(format!("create data QP: {e}")))?;
            q.connect(ep, &attr)
                .map_err(|e| connect_failed("connect data QP", &e))?;
            lanes.push(q);
        }
        let data_endpoints: Vec<_> = lanes.iter().map(Qp::endpoint).collect();
        let wcfg = wire::Config {
            max_calls: hello.max_calls,
            peer_max_calls: hello.max_calls,
            // The client's window starts small and grows by its grants (see `buf::slots`).
            initial_send_credits: hello.initial_credits,
            max_send_credits: hello.geometry.recv_slots,
            recv_depth: FLOOR,
            recv_max: cfg.geometry.recv_slots.max(FLOOR),
            reserved_credits: 2,
            credit_update_threshold: (cfg.geometry.recv_slots / 4).max(2),
            eager_limit: cfg.geometry.slot_size.min(hello.geometry.slot_size),
            // Clients do not know our limit: a request above it fails its call with
            // RESOURCE_EXHAUSTED (`start_read`), it does not close the connection.
            max_message: u64::MAX,
            stream_window: crate::streaming::STREAM_WINDOW,
            stream_window_max: crate::streaming::STREAM_WINDOW_MAX,
        };
        let wire =
            wire::Conn::new(Role::Server, wcfg).map_err(|e| exhausted(format!("protocol: {e}")))?;
        self.generations[idx] = self.generations[idx].wrapping_add(1);
        let key = LinkKey {
            idx: idx as u16,
            generation: self.generations[idx],
        };
        let link = Link::new(
            qp,
            Arc::clone(&self.sends),
            wire,
            Arc::clone(&self.bulk),
            key,
            self.max_inline,
            self.epoch,
        )
        .map_err(|e| exhausted(format!("post receives: {e}")))?;
        let mut link = link;
        // The QP's send queue holds what `qp_caps` sized it for: these SENDs (each holds a
        // slot until its completion is polled), its one-sided operations, and the inline
        // SENDs a signaled one has not freed yet.
        link.set_slot_cap(slot_cap(hello.geometry.recv_slots, hello.max_calls));
        link.set_lanes(Lanes::new(
            lanes,
            lcaps.max_send_wr,
            Some(Arc::clone(&self.striped_bytes)),
        ));
        let welcome = Welcome {
            endpoint: link.qp.endpoint(),
            geometry: cfg.geometry,
            initial_credits: FLOOR,
            max_calls: hello.max_calls,
            shard: self.id,
            shards: self.nshards,
            data_endpoints,
        };
        info!(
            "accepted {peer} via {}/RC on shard {}/{}: QP {:#x} <-> {:#x} in RTS{}",
            P::TAG,
            self.id,
            self.nshards,
            link.qp.qp_num(),
            hello.endpoint.qp_num,
            if link.lanes().is_empty() {
                String::new()
            } else {
                format!(", {} QPs per connection", link.lanes().len() + 1)
            }
        );
        let calls = Calls::lazy(hello.max_calls as usize);
        let link_gather = link.qp.caps().max_send_sge as usize >= MAX_PIECES;
        self.qp_conn.insert(link.qp.qp_num(), idx as u16);
        self.live.push(idx as u16);
        self.touch(idx);
        self.open_conns.store(self.live.len(), Ordering::Release);
        self.conns[idx] = Some(ServerConn {
            blocked: Vec::new(),
            link,
            goaway_sent: false,
            calls,
            deferred: VecDeque::new(),
            closed: Some(closed),
            peer,
            max_message: cfg.max_message,
            gather: link_gather,
            zero_copy_bytes: Arc::clone(&self.zero_copy_bytes),
            stats: self.stats.clone(),
            idle_since: None,
        });
        if let Some(t) = &self.stats {
            t.transport.connections.fetch_add(1, Ordering::Relaxed);
        }
        Ok((welcome, key))
    }

    /// Closes a connection that failed (counted in the statistics).
    pub(super) fn close_failed(&mut self, key: LinkKey, why: &Status) {
        if let Some(t) = &self.stats {
            t.transport
                .connection_failures
                .fetch_add(1, Ordering::Relaxed);
        }
        self.close(key, why);
    }

    /// Closes a connection: drops its handlers and QP; its TCP connection is closed by the
    /// acceptor when it sees the `closed` sender dropped.
    ///
    /// Nothing the NIC may still touch is released before the QPs are destroyed: the buffers
    /// of posted work requests (READ targets, WRITE sources, handlers' bulk operations) and
    /// those lent to the client go to the link's graveyard, which the link frees after its
    /// QPs (when `conn` drops); handlers whose bulk operations were in flight learn the
    /// outcome only then.
    pub(super) fn close(&mut self, key: LinkKey, why: &Status) {
        let idx = key.idx as usize;
        let Some(Some(conn)) = self.conns.get(idx) else {
            return;
        };
        if conn.link.key() != key {
            return;
        }
        let Some(mut conn) = self.conns[idx].take() else {
            return;
        };
        self.free_conns.push(idx as u16);
        self.live.retain(|&i| i as usize != idx);
        self.qp_conn.remove(&conn.link.qp.qp_num());
        self.open_conns.store(self.live.len(), Ordering::Release);
        conn.stat_end_all(crate::Code::Unavailable);
        for c in conn.calls.iter_mut() {
            if let Some(t) = c.task.take() {
                self.tasks.cancel(t);
            }
            retire(&self.live_calls, c);
            c.park(&mut conn.link);
        }
        let ops: Vec<usize> = self
            .bulk_ops
            .iter()
            .filter(|(_, op)| op.key == key)
            .map(|(i, _)| i)
            .collect();
        let mut answers = Vec::with_capacity(ops.len());
        for i in ops {
            let InflightOp { local, done, .. } = self.bulk_ops.remove(i);
            conn.link.park(local);
            answers.push(done);
        }
        info!(
            "connection from {} closed: {} ({} buffer(s) kept until its QPs are destroyed)",
            conn.peer,
            why.message(),
            conn.link.parked()
        );
        if let Some(tx) = conn.closed.take() {
            let _ = tx.send(why.message().to_owned());
        }
        // Terminal frames that waited for credit: their send slots (shared by the shard's
        // connections) were never posted.
        for d in conn.deferred.drain(..) {
            if let super::Deferred::Response {
                staged: super::Body::Slot(st),
                ..
            }
            | super::Deferred::Status {
                staged: super::Body::Slot(st),
                ..
            } = d
            {
                conn.link.discard(st);
            }
        }
        // The QPs are destroyed here, then the graveyard is freed and the SENDs that never
        // completed give their slots back; the window waits in limbo for frames the CQ may
        // still report.
        self.grants.closed(&conn.link.wire, Instant::now());
        drop(conn);
        for done in answers {
            let _ = done.send(Err(why.clone()));
        }
    }
}

/// Why connecting a client's QP failed, as the status its attempt ends with: an endpoint that
/// names no such peer or QP (forged, stale, another provider's) is the client's error.
fn connect_failed(what: &str, e: &crate::verbs::VerbsError) -> (crate::Code, String) {
    let code = match e.kind() {
        crate::verbs::ErrorKind::InvalidEndpoint | crate::verbs::ErrorKind::InvalidArgument => {
            crate::Code::InvalidArgument
        }
        _ => crate::Code::ResourceExhausted,
    };
    (code, format!("{what}: {e}"))
}
