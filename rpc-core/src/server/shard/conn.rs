//! The shard's connections: opening its device objects, accepting a client (QPs, slots, the
//! protocol state, the call table) and closing a connection without releasing anything the
//! NIC may still touch before its QPs are destroyed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_queue::SegQueue;
use tracing::info;

use crate::Status;
use crate::buf::encode::MAX_PIECES;
use crate::buf::{BulkPool, Geometry, SlotArena};
use crate::call::{Calls, Record};
use crate::connect::{Hello, Welcome};
use crate::link::{Lanes, Link, LinkKey, lane_caps};
use crate::server::ServerConfig;
use crate::server::call::Tasks;
use crate::server::notify::{Doorbell, ShardNotify};
use crate::server::peer::PeerApi;
use crate::server::router::Router;
use crate::verbs::{Access, ConnectAttr, Context, Cq, Pd, Provider, Qp, QpCaps, Wc};
use crate::wire::{self, CallId, Role};

use super::bulk::InflightOp;
use super::{POLL_BATCH, ServerConn, Shard, ShardHandle, ShardMsg, retire};

/// Connections the shard's CQ is first sized for (it grows with more).
const FIRST_CQ_CONNS: u32 = 64;

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
    // CQ room for the first connections of default size (at most `max_conns_per_shard`); the
    // CQ grows as more come (`create_qp`), so an idle shard does not hold a CQ sized for the
    // most it may ever serve. The soft and ib providers both refuse a QP whose CQ could
    // overrun.
    let default_client_calls = 64;
    let send_slots = cfg
        .geometry
        .send_slots
        .max(default_client_calls + cfg.geometry.recv_slots + 2);
    let per_conn = qp_caps(&cfg, ctx.caps(), send_slots, default_client_calls);
    let max_qps = match cfg.qps_per_connection {
        Some(n) => n,
        None => P::qps_per_connection()?,
    };
    let lanes = lane_caps(&per_conn, ctx.caps());
    let cqe = (per_conn.max_send_wr + per_conn.max_recv_wr)
        .saturating_add((max_qps - 1).saturating_mul(lanes.max_send_wr + lanes.max_recv_wr))
        .saturating_mul(cfg.max_conns_per_shard.min(FIRST_CQ_CONNS))
        .min(ctx.caps().max_cqe);
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
    let n = cfg.max_conns_per_shard as usize;
    let max_inline = per_conn.max_inline_data;
    info!(
        shard = id,
        "shard {id}/{nshards}: {} device {} (port {}, {:?}), CQ depth {cqe}",
        P::TAG,
        ctx.info().name,
        ctx.info().port,
        ctx.info().link_layer
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
        thread: std::sync::Mutex::new(None),
    };
    let shard = Shard {
        conns: Vec::new(),
        live: Vec::with_capacity(n),
        generations: vec![0; n],
        touched: Vec::new(),
        is_touched: Vec::new(),
        swept_at: Instant::now(),
        swept_deadline: None,
        task_owner: vec![(0, CallId(0)); cfg.tasks_per_shard as usize],
        tasks,
        cq,
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
    Ok((shard, handle))
}

/// Queue sizes of a connection with `send_slots` send slots whose client has `peer_calls`
/// calls: every send slot in flight, plus a READ (rendezvous request, stream message) and a
/// WRITE (landing zone, bulk handle) per call, plus control frames; within the device's limit.
pub(super) fn qp_caps(
    cfg: &ServerConfig,
    caps: &crate::verbs::Caps,
    send_slots: u32,
    peer_calls: u32,
) -> QpCaps {
    QpCaps {
        max_send_wr: send_slots
            .saturating_add(peer_calls.saturating_mul(2))
            .saturating_add(16)
            .min(caps.max_qp_wr),
        max_recv_wr: cfg.geometry.recv_slots,
        // Gathered requests (MAX_PIECES) and coalesced SENDs (BATCH_FRAMES).
        max_send_sge: (MAX_PIECES.max(crate::link::BATCH_FRAMES) as u32).min(caps.max_sge),
        max_recv_sge: 1,
        max_inline_data: caps.max_inline.min(256),
    }
}

impl<P: Provider> Shard<P> {
    pub(super) fn drain_inbox(&mut self) -> usize {
        let mut n = 0;
        while let Some(msg) = self.inbox.pop() {
            n += 1;
            match msg {
                ShardMsg::Connect {
                    hello,
                    peer,
                    reply,
                    closed,
                } => {
                    let r = self.connect(hello, peer, closed);
                    let _ = reply.send(r);
                }
                ShardMsg::Disconnect(key) => {
                    self.close(key, &Status::unavailable("client disconnected"));
                }
            }
        }
        n
    }

    /// Creates a QP on the shard's CQ, growing the CQ (doubling, up to the device's
    /// `max_cqe`) when the QP's completions do not fit any more.
    fn create_qp(&mut self, caps: QpCaps) -> crate::verbs::Result<P::Qp> {
        match self.pd.create_qp(&self.cq, &self.cq, caps) {
            Err(e) if e.kind() == crate::verbs::ErrorKind::ExceedsCaps => {
                let cap = self.cq.capacity();
                let max = self.ctx.caps().max_cqe;
                let need = caps.max_send_wr.saturating_add(caps.max_recv_wr);
                let grown = cap.saturating_mul(2).max(cap.saturating_add(need)).min(max);
                if grown <= cap {
                    return Err(e);
                }
                self.cq.resize(grown)?;
                info!(
                    shard = self.id,
                    "shard {}: CQ grown from {cap} to {grown} entries ({} connections)",
                    self.id,
                    self.live.len()
                );
                self.pd.create_qp(&self.cq, &self.cq, caps)
            }
            r => r,
        }
    }

    pub(super) fn connect(
        &mut self,
        hello: Hello,
        peer: std::net::SocketAddr,
        closed: tokio::sync::oneshot::Sender<String>,
    ) -> Result<(Welcome, LinkKey), (crate::Code, String)> {
        let exhausted = |why: String| (crate::Code::ResourceExhausted, why);
        // The table grows as connections come (a high limit costs nothing while unused).
        let idx = match self.conns.iter().position(Option::is_none) {
            Some(i) => i,
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
        // Every call of the client's table may hold a staged terminal frame in a send slot while
        // it waits for a credit, besides the frames in flight (at most the client's receive
        // ring): with fewer send slots a terminal frame would find none and its call would
        // never be answered.
        let need = hello
            .max_calls
            .saturating_add(hello.geometry.recv_slots)
            .saturating_add(2)
            .min(Geometry::MAX_SLOTS);
        let geometry = Geometry {
            send_slots: cfg.geometry.send_slots.max(need),
            ..cfg.geometry
        };
        let caps = qp_caps(cfg, self.ctx.caps(), geometry.send_slots, hello.max_calls);
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
                .create_qp(lcaps)
                .map_err(|e| exhausted(format!("create data QP: {e}")))?;
            q.connect(ep, &attr)
                .map_err(|e| connect_failed("connect data QP", &e))?;
            lanes.push(q);
        }
        let data_endpoints: Vec<_> = lanes.iter().map(Qp::endpoint).collect();
        let arena = SlotArena::<P>::new(&self.pd, geometry)
            .map_err(|e| exhausted(format!("slots: {e}")))?;
        let wcfg = wire::Config {
            max_calls: hello.max_calls,
            peer_max_calls: hello.max_calls,
            initial_send_credits: hello.geometry.recv_slots,
            max_send_credits: hello.geometry.recv_slots,
            recv_depth: cfg.geometry.recv_slots,
            recv_max: cfg.geometry.recv_slots,
            reserved_credits: 2,
            credit_update_threshold: (cfg.geometry.recv_slots / 4).max(2),
            eager_limit: cfg.geometry.slot_size.min(hello.geometry.slot_size),
            // Clients do not know our limit: a request above it fails its call with
            // RESOURCE_EXHAUSTED (`start_read`), it does not close the connection.
            max_message: u64::MAX,
            stream_window: 16,
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
            arena,
            wire,
            Arc::clone(&self.bulk),
            key,
            self.max_inline,
            self.epoch,
        )
        .map_err(|e| exhausted(format!("post receives: {e}")))?;
        let mut link = link;
        link.set_lanes(Lanes::new(
            lanes,
            lcaps.max_send_wr,
            Some(Arc::clone(&self.striped_bytes)),
        ));
        let welcome = Welcome {
            endpoint: link.qp.endpoint(),
            geometry: cfg.geometry,
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
        self.live.retain(|&i| i as usize != idx);
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
        // The QPs are destroyed here, then the graveyard is freed.
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
