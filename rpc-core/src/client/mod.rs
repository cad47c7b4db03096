//! The client: a cheap `Clone + Send + Sync` [`Channel`] over a connection to a server shard,
//! with a completion poller, futures and blocking calls.

mod backoff;
mod balance;
mod core;
mod dns;
#[cfg(test)]
mod dns_tests;
mod region;
mod registered;
mod retry;
#[cfg(test)]
mod rogue_tests;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_core::Stream;
use prost::Message;
use tokio::net::TcpStream;
use tracing::{Instrument as _, debug, info, warn};

use crate::buf::sends::SendPool;
use crate::buf::{BulkPool, Geometry, SlotArena};
use crate::connect::keepalive::{self, KeepAlive};
use crate::connect::{self, Hello, Message as Handshake};
use crate::link::{Lanes, Link, lane_caps};
use crate::method::MethodDesc;
use crate::streaming::Streaming;
use crate::verbs::{
    Access, ConnectAttr, Context, Pd, Provider, ProviderKind, ProviderVisitor, Qp, QpCaps,
    any_provider, with_any,
};
use crate::wire::{self, Role};
use crate::{Error, Request, Response, Status, TransportErrorKind};
pub use balance::Balancer;
use core::{CLIENT_LINK, ClientCore, Cqs, Hub, Parts, Tables, epoch};
pub use region::{Lease, Region};
pub(crate) use registered::RegHandle;
pub use registered::{RegisteredBytes, RegisteredBytesMut};
use retry::Attempts;
pub use retry::{MAX_ATTEMPTS, RetryPolicy, TRANSPARENT_ATTEMPTS};

/// Who polls the connection's completion queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ClientPoller {
    /// The process's poller thread, shared by every such connection of the process (it
    /// spins briefly over them, then sleeps on their completion channels). A caller that
    /// waits drives its connection itself meanwhile, and the thread stands down for it: a
    /// blocking call until its answer, the process's only async call in flight for up to
    /// 200 µs inside its poll (no wake-up from another thread), except in a handler on a
    /// server shard's thread; see [`Channel::async_drives`].
    #[default]
    Thread,
    /// The calling threads: a blocking call polls the CQ itself (the lowest latency), and async
    /// calls are driven by a task on the caller's tokio runtime that polls while calls are in
    /// flight (yielding between turns) and sleeps when none is. No extra thread.
    Caller,
}

/// Options of a [`Channel`].
#[derive(Clone, Debug)]
pub struct ChannelBuilder {
    addr: String,
    provider: ProviderKind,
    provider_error: Option<String>,
    device: Option<String>,
    token: Vec<u8>,
    poller: ClientPoller,
    max_calls: u32,
    geometry: Geometry,
    max_message: u64,
    connect_timeout: Duration,
    keep_alive_interval: Option<Duration>,
    keep_alive_timeout: Duration,
    qps_per_connection: Option<u32>,
    retry: Option<RetryPolicy>,
    learn_response_sizes: bool,
    /// `None`: the default threshold, with the way of mid-sized requests learned.
    pending_request_min: Option<usize>,
}

impl ChannelBuilder {
    /// The provider (overrides `RPC_PROVIDER`).
    pub fn provider(mut self, provider: ProviderKind) -> Self {
        self.provider = provider;
        self.provider_error = None;
        self
    }

    /// The device to open.
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.device = Some(name.into());
        self
    }

    /// The shared secret the server requires.
    pub fn auth_token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.token = token.into();
        self
    }

    /// Who polls the completion queue (default [`ClientPoller::Thread`]).
    pub fn poller(mut self, mode: ClientPoller) -> Self {
        self.poller = mode;
        self
    }

    /// Calls in flight at once; more wait for a free one (default 64).
    pub fn max_concurrent_calls(mut self, n: u32) -> Self {
        self.max_calls = n.clamp(1, Geometry::MAX_SLOTS);
        self
    }

    /// Slot geometry (slot size = largest eager frame; ring depths).
    pub fn geometry(mut self, g: Geometry) -> Self {
        self.geometry = g;
        self
    }

    /// Largest message sent or accepted (default 256 MiB).
    pub fn max_message(mut self, bytes: u64) -> Self {
        self.max_message = bytes;
        self
    }

    /// RC queue pairs to offer per connection (1..=16; default: the provider's setting, on
    /// `ib` `RPC_IB_QPS_PER_CONNECTION`, else 1). The connection uses as many as the server
    /// also allows ([`ServerBuilder::qps_per_connection`](crate::ServerBuilder::qps_per_connection)):
    /// the first carries every frame, the others spans of large one-sided transfers (RDMA
    /// READ/WRITE of 256 KiB or more), like `NCCL_IB_QPS_PER_CONNECTION`.
    pub fn qps_per_connection(mut self, n: u32) -> Self {
        self.qps_per_connection = Some(n.clamp(1, crate::verbs::MAX_QPS_PER_CONNECTION));
        self
    }

    /// Whether a call without [`Request::set_response_size_hint`] lends a landing zone as large
    /// as its method's last large response (default true): large responses are then written
    /// into place (one RDMA WRITE) instead of fetched with an extra round trip (an RDMA READ),
    /// without the caller knowing their size. Each such call borrows a bulk buffer of that size
    /// while in flight; off, only hinted calls lend one.
    pub fn learn_response_sizes(mut self, on: bool) -> Self {
        self.learn_response_sizes = on;
        self
    }

    /// Requests at least this large (encoded) whose large `bytes` field lies in ordinary
    /// memory are sent before that field is copied into registered memory: the server READs
    /// the field a part at a time while the caller copies the next (never below 64 KiB;
    /// `usize::MAX` turns it off). Fields built with [`Channel::alloc_bytes`] are never
    /// copied and do not need it.
    ///
    /// Unset, requests of 8 MiB and more are sent so, and unary requests from 1 MiB up are
    /// sent pending or copied first, whichever has been faster on this connection: it times
    /// both ways (every 16th such call tries the way not chosen). On the development VM the
    /// overlap paid from 8 MiB on; from 1 to 4 MiB it paid on one host and cost on another
    /// (`benches/HISTORY.md`). Set, the threshold is fixed and nothing is measured.
    pub fn pending_request_min(mut self, bytes: usize) -> Self {
        self.pending_request_min = Some(bytes);
        self
    }

    /// How long connecting may take (default 5 s).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// How long the connection may be silent before the server is probed, and between
    /// answered probes (default 10 s; `None` turns probing off), as tonic's
    /// `Endpoint::http2_keep_alive_interval`. The probes are TCP keepalive on the bootstrap
    /// connection, the connection's liveness channel: the server's kernel answers them, so
    /// they cost neither process anything and run whether calls are in flight or not (there
    /// is no `keep_alive_while_idle` to set). A server that answers none for
    /// [`keep_alive_timeout`](Self::keep_alive_timeout) is gone (link down, host powered off
    /// or partitioned away): the connection closes and its calls end `UNAVAILABLE` with a
    /// message that starts `keepalive:`, even a call without a deadline whose request was
    /// delivered long before. Whole seconds (rounded up, at least 1).
    pub fn keep_alive_interval(mut self, interval: impl Into<Option<Duration>>) -> Self {
        self.keep_alive_interval = interval.into();
        self
    }

    /// How long probes may go unanswered before the connection is declared dead (default
    /// 20 s, as tonic's `Endpoint::keep_alive_timeout`). With the defaults a dead server is
    /// noticed within 31 s of its last answer (the interval, then probes for the timeout,
    /// in whole seconds; unacknowledged data on the bootstrap connection is bounded the same
    /// way, by `TCP_USER_TIMEOUT`). See [`keep_alive_interval`](Self::keep_alive_interval).
    pub fn keep_alive_timeout(mut self, timeout: Duration) -> Self {
        self.keep_alive_timeout = timeout;
        self
    }

    /// How the channel retries failed calls (default: none, only the transparent retry of
    /// calls that provably reached no handler; see [`RetryPolicy`]). A balanced channel takes
    /// its policy from [`Channel::with_retry_policy`]; its replicas' builders' is not used.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Connects.
    ///
    /// # Errors
    /// When the address does not resolve, TCP connect fails, the server refuses the handshake
    /// (the error says why) or the device cannot be opened.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the attempt and frees what it set up.
    pub async fn connect(mut self) -> Result<Channel, Error> {
        if let Some(e) = &self.provider_error {
            return Err(Error::new(TransportErrorKind::Config, e.clone()));
        }
        self.addr = server_addr(&self.addr)?;
        let conn = open(&self).await?;
        let retry = self.retry;
        Ok(Channel {
            target: Target::One(Arc::new(Shared::new(self, conn, true))),
            interceptor: None,
            retry,
            stats: None,
        })
    }
}

/// The `host:port` to dial for what a user passed: `host:port`, or a URI as tonic users write
/// it (`http://host:port`, an optional trailing `/`). The server's address is its bootstrap
/// TCP port; there is no TLS, so `https://` is refused rather than silently sent in clear.
fn server_addr(addr: &str) -> Result<String, Error> {
    let bad = |why: &str| {
        Error::new(
            TransportErrorKind::InvalidAddress,
            format!(
                "server address {addr:?} {why}: write host:port or http://host:port \
                 (e.g. 127.0.0.1:50051, [::1]:50051, http://node7:50051)"
            ),
        )
    };
    let rest = match addr.split_once("://") {
        None => addr,
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => {
            return Err(bad("asks for TLS, which rdma-rpc does not provide"));
        }
        Some(_) => return Err(bad("has an unknown scheme")),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('?') || rest.contains('#') {
        return Err(bad("has a path, which a channel cannot use"));
    }
    let port = match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !host.ends_with(':') => port,
        _ => return Err(bad("has no port")),
    };
    if port.parse::<u16>().is_err() {
        return Err(bad("has no valid port"));
    }
    Ok(rest.to_owned())
}

/// Unary calls to one method kept in flight by one thread (see [`Channel::pipeline`]).
/// Each call carries a caller-chosen tag that comes back with its response. Dropping the
/// pipeline cancels the calls still in flight.
pub struct Pipeline<Req, Resp> {
    conn: Arc<Conn>,
    method: &'static MethodDesc,
    interceptor: Option<Arc<dyn crate::Interceptor>>,
    /// (tag, cell, generation) of the calls in flight, oldest first.
    in_flight: std::collections::VecDeque<(u64, u32, u32)>,
    /// Finished calls set aside by `submit` to free their cells, returned first by `poll`.
    ready: std::collections::VecDeque<(u64, Result<Response<Resp>, Status>)>,
    /// Calls submitted since the connection was last driven (not on the wire yet).
    unsent: usize,
    _types: std::marker::PhantomData<fn(Req) -> Resp>,
}

impl<Req, Resp> std::fmt::Debug for Pipeline<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("method", &self.method.path)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl<Req: Message, Resp: Message + Default> Pipeline<Req, Resp> {
    /// Starts a call tagged `tag`. Returns at once unless every call cell of the channel is in
    /// use ([`ChannelBuilder::max_concurrent_calls`]); then it drives the connection until one
    /// is free (setting finished calls of this pipeline aside for [`Pipeline::poll`]), or the
    /// request's timeout passes.
    ///
    /// # Errors
    /// The call could not be started: `UNAVAILABLE` (connection lost), `RESOURCE_EXHAUSTED`
    /// (message over the limit), `DEADLINE_EXCEEDED` (no cell within the timeout).
    pub fn submit(&mut self, tag: u64, mut request: Request<Req>) -> Result<(), Status> {
        crate::trace::carry(request.metadata_mut());
        if let Some(f) = &self.interceptor {
            crate::intercept::apply(&**f, &mut request)
                .map_err(|st| st.for_method(self.method.path))?;
        }
        let method = self.method;
        // Our own finished calls may hold every cell: set them aside (their responses stay
        // ours) until a cell is free; others' calls free theirs as they finish. The thread's
        // spinner (a copy in and out of a thread-local) only when there is none.
        if self.no_free_cell() {
            crate::poll_policy::with_thread_spinner(|spin| {
                while self.no_free_cell() {
                    spin.before_turn(std::time::Instant::now);
                    match self.poll_in_flight() {
                        Some(done) => {
                            spin.work();
                            self.ready.push_back(done);
                        }
                        None => with_any!(AnyCore, &self.conn.core, c => c.wait_turn(spin)),
                    }
                }
            });
        }
        let (idx, generation) =
            with_any!(AnyCore, &self.conn.core, c => c.start_unary(method, request))?;
        self.in_flight.push_back((tag, idx, generation));
        self.unsent += 1;
        Ok(())
    }

    /// Drives the connection once (unless a poller thread does) and returns a finished call
    /// and its tag, if any; `None` when nothing has finished yet (or nothing is in flight).
    pub fn poll(&mut self) -> Option<(u64, Result<Response<Resp>, Status>)> {
        if let Some(done) = self.ready.pop_front() {
            return Some(done);
        }
        self.poll_in_flight()
    }

    fn poll_in_flight(&mut self) -> Option<(u64, Result<Response<Resp>, Status>)> {
        if self.in_flight.is_empty() {
            return None;
        }
        // Calls that finished in the last turn first: their successors, submitted meanwhile,
        // then go out together in the next turn (one post). Not too many: at most half the
        // window per post keeps two bursts or more in flight, so both sides work at once.
        if self.unsent * 2 < self.in_flight.len()
            && let Some(done) = self.take_finished()
        {
            return Some(done);
        }
        let by_thread = with_any!(AnyCore, &self.conn.core, c => c.polled_by_thread());
        if !by_thread {
            with_any!(AnyCore, &self.conn.core, c => c.progress());
        }
        self.unsent = 0;
        self.take_finished()
    }

    /// Waits (spinning, then yielding the CPU, driving the connection) for the next call to
    /// finish; `None` when nothing is in flight. A call's own deadline bounds the wait. On a
    /// host where this thread has no core to itself it spins only briefly, then sleeps until
    /// a completion arrives (see [`ShardPolling`](crate::ShardPolling) for the detection).
    pub fn wait(&mut self) -> Option<(u64, Result<Response<Resp>, Status>)> {
        // The first turn needs no spinner (it would read no clock): a call already finished,
        // or found by that turn, is returned without copying the thread's spinner in and out.
        if let Some(r) = self.poll() {
            return Some(r);
        }
        crate::poll_policy::with_thread_spinner(|spin| {
            while !self.in_flight.is_empty() || !self.ready.is_empty() {
                with_any!(AnyCore, &self.conn.core, c => c.wait_turn(spin));
                spin.before_turn(std::time::Instant::now);
                if let Some(r) = self.poll() {
                    return Some(r);
                }
            }
            None
        })
    }

    /// Calls submitted whose responses were not collected yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.ready.len()
    }

    /// Whether every call cell is taken while calls of ours are in flight.
    fn no_free_cell(&self) -> bool {
        !self.in_flight.is_empty() && !with_any!(AnyCore, &self.conn.core, c => c.has_free_cell())
    }

    fn take_finished(&mut self) -> Option<(u64, Result<Response<Resp>, Status>)> {
        for i in 0..self.in_flight.len() {
            let (tag, idx, generation) = self.in_flight[i];
            let done =
                with_any!(AnyCore, &self.conn.core, c => c.try_finish::<Resp>(idx, generation));
            if let Some(r) = done {
                self.in_flight.remove(i);
                return Some((tag, r.map_err(|st| st.for_method(self.method.path))));
            }
        }
        None
    }
}

impl<Req, Resp> Drop for Pipeline<Req, Resp> {
    fn drop(&mut self) {
        for (_, idx, generation) in self.in_flight.drain(..) {
            with_any!(AnyCore, &self.conn.core, c => c.abandon(idx, generation));
        }
    }
}

any_provider! {
    /// A client connection of whichever provider was chosen.
    enum AnyCore wraps ClientCore
}

/// One live connection: its core, and what closes its TCP side and poller when dropped.
struct Conn {
    core: AnyCore,
    _tcp: tokio::sync::oneshot::Sender<()>,
    /// Bytes of one-sided transfers striped over the connection's QPs.
    striped: Arc<std::sync::atomic::AtomicU64>,
    /// QPs the connection uses.
    qps: u32,
}

impl Drop for Conn {
    fn drop(&mut self) {
        with_any!(AnyCore, &self.core, c => c.stop());
    }
}

impl Conn {
    fn is_dead(&self) -> bool {
        with_any!(AnyCore, &self.core, c => c.is_dead())
    }

    fn is_usable(&self) -> bool {
        with_any!(AnyCore, &self.core, c => c.is_usable())
    }
}

struct Shared {
    builder: ChannelBuilder,
    conn: ArcSwap<Conn>,
    reconnect: tokio::sync::Mutex<()>,
    /// The reconnect back-off (a single-address channel's; a balanced channel's replicas
    /// eject themselves instead): after a failed reconnect, calls fail at once until the next
    /// attempt is due, instead of each dialling.
    backoff: Option<backoff::Reconnect>,
    /// The runtime the channel was connected on: blocking calls reconnect through it.
    rt: tokio::runtime::Handle,
    /// Connections made and attempts that failed.
    counts: stats::ConnCounts,
}

impl Shared {
    fn new(builder: ChannelBuilder, conn: Conn, backs_off: bool) -> Shared {
        Shared {
            builder,
            conn: ArcSwap::new(Arc::new(conn)),
            reconnect: tokio::sync::Mutex::new(()),
            backoff: backs_off.then(backoff::Reconnect::new),
            rt: tokio::runtime::Handle::current(),
            counts: stats::ConnCounts {
                connects: 1.into(),
                failed: 0.into(),
            },
        }
    }

    /// When the reconnect is backing off: the status of a call that comes too early (the
    /// last error and when the next attempt is; not executed).
    fn backing_off(&self) -> Option<Status> {
        let b = self.backoff.as_ref()?;
        if !b.is_down(backoff::now_ns()) {
            return None;
        }
        let wait = b.wait_left()?;
        Some(
            Status::unavailable(format!(
                "connection to {} is down, the next attempt is in {wait:?}: {}",
                self.builder.addr,
                b.last_error()
            ))
            .not_executed(),
        )
    }

    /// How long until the next reconnect attempt, while backing off.
    fn connect_in(&self) -> Option<Duration> {
        self.backoff.as_ref()?.wait_left()
    }

    /// The live connection for a blocking call: when it was lost, reconnects through the
    /// runtime the channel was connected on (the calling thread waits; it is not a runtime
    /// thread, see [`Channel::unary_blocking`]).
    pub(crate) fn conn_blocking(self: &Arc<Self>) -> Result<Arc<Conn>, Status> {
        let c = self.conn.load_full();
        if c.is_usable() {
            return Ok(c);
        }
        if let Some(st) = self.backing_off() {
            return Err(st);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let shared = Arc::clone(self);
        // On a runtime that was shut down the task is dropped unrun, and so is `tx`.
        self.rt.spawn(async move {
            let _ = tx.send(shared.conn().await);
        });
        // The handshake after the TCP connect is bounded by the server; allow it some time.
        let limit = self.builder.connect_timeout + Duration::from_secs(10);
        match rx.recv_timeout(limit) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Status::unavailable(format!(
                "connection to {} lost; reconnecting took longer than {limit:?}",
                self.builder.addr
            ))
            .not_executed()),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(Status::unavailable(format!(
                    "connection to {} lost; cannot reconnect: the runtime the channel was \
                     connected on has shut down",
                    self.builder.addr
                ))
                .not_executed())
            }
        }
    }

    /// The live connection, reconnecting once if it was lost: one attempt at a time, and
    /// none while the reconnect backs off (the call fails at once, not executed).
    pub(crate) async fn conn(self: &Arc<Self>) -> Result<Arc<Conn>, Status> {
        let c = self.conn.load_full();
        if c.is_usable() {
            return Ok(c);
        }
        if let Some(st) = self.backing_off() {
            return Err(st);
        }
        let _g = self.reconnect.lock().await;
        let c = self.conn.load_full();
        if c.is_usable() {
            return Ok(c);
        }
        // Callers that queued behind a failed attempt fail with it, and dial no more.
        if let Some(st) = self.backing_off() {
            return Err(st);
        }
        match open(&self.builder).await {
            Ok(new) => {
                let new = Arc::new(new);
                self.conn.store(Arc::clone(&new));
                if let Some(b) = &self.backoff {
                    b.succeeded();
                }
                self.counts
                    .connects
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(new)
            }
            Err(e) => {
                self.counts
                    .failed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let why = format!(
                    "connection to {} lost and reconnecting failed: {e}",
                    self.builder.addr
                );
                let wait = self
                    .backoff
                    .as_ref()
                    .map(|b| b.failed(&why, backoff::random_unit()));
                Err(match wait {
                    Some(w) => Status::unavailable(format!("{why}; the next attempt is in {w:?}")),
                    None => Status::unavailable(why),
                }
                .not_executed())
            }
        }
    }
}

/// A connection to a server, usable from many tasks and threads at once. Cloning is cheap.
///
/// Calls up to [`ChannelBuilder::max_concurrent_calls`] run concurrently; more wait for a free
/// call slot. When the connection is lost, calls in flight fail with `UNAVAILABLE` and the next
/// call reconnects; when reconnecting fails, calls fail at once (`UNAVAILABLE`, naming the
/// last error and when the next attempt is) until the reconnect back-off has passed: an
/// exponential back-off with jitter from 200 ms up to 30 s, as gRPC's.
///
/// Failed calls are retried as [`RetryPolicy`] describes: those that provably reached no
/// handler transparently ([`Status::is_not_executed`]), those that may have run only with a
/// policy ([`Channel::with_retry_policy`]) and for methods declared idempotent.
#[derive(Clone)]
pub struct Channel {
    target: Target,
    /// Run on every call's request before it is sent ([`Channel::with_interceptor`]).
    interceptor: Option<Arc<dyn crate::Interceptor>>,
    /// How failed calls are retried ([`Channel::with_retry_policy`]).
    retry: Option<RetryPolicy>,
    /// Where calls are counted ([`Channel::with_stats`]).
    stats: Option<Arc<crate::stats::Table>>,
}

/// Where a channel's calls go: one server, or a set of replicas ([`Channel::balance_list`]).
#[derive(Clone)]
enum Target {
    One(Arc<Shared>),
    Many(Arc<balance::Balance>),
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.target {
            Target::One(s) => f
                .debug_struct("Channel")
                .field("addr", &s.builder.addr)
                .finish(),
            Target::Many(b) => f.debug_struct("Channel").field("balance", b).finish(),
        }
    }
}

impl Channel {
    /// This channel (the same connection) with `f` run on every call's request metadata and
    /// timeout before the call is sent (tonic's `with_interceptor`): return the request to
    /// send it, or a status to fail the call without sending it. Replaces an interceptor set
    /// before. One indirect call per call, no allocation unless `f` allocates.
    #[must_use]
    pub fn with_interceptor(&self, f: impl crate::Interceptor) -> Channel {
        Channel {
            target: self.target.clone(),
            interceptor: Some(Arc::new(f)),
            retry: self.retry,
            stats: self.stats.clone(),
        }
    }

    /// This channel (the same connection or replicas) with failed calls retried by `policy`
    /// (see [`RetryPolicy`]); replaces the policy set before. Calls that provably reached no
    /// handler are retried transparently even without one.
    #[must_use]
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Channel {
        Channel {
            target: self.target.clone(),
            interceptor: self.interceptor.clone(),
            retry: Some(policy),
            stats: self.stats.clone(),
        }
    }

    /// The retry policy calls on this channel use, if any.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry.as_ref()
    }

    /// Runs the interceptor, if any, on `request`.
    fn intercept<T>(&self, method: &MethodDesc, request: &mut Request<T>) -> Result<(), Status> {
        crate::trace::carry(request.metadata_mut());
        match &self.interceptor {
            Some(f) => {
                crate::intercept::apply(&**f, request).map_err(|st| st.for_method(method.path))
            }
            None => Ok(()),
        }
    }

    /// Options for a connection to `addr`: `host:port` or `http://host:port` (as tonic's
    /// `Endpoint` takes it).
    pub fn builder(addr: impl Into<String>) -> ChannelBuilder {
        let provider = ProviderKind::from_env();
        ChannelBuilder {
            addr: addr.into(),
            provider: provider.clone().unwrap_or(ProviderKind::Soft),
            provider_error: provider.err().map(|e| e.to_string()),
            device: None,
            token: Vec::new(),
            poller: ClientPoller::Thread,
            max_calls: 64,
            geometry: Geometry::default(),
            max_message: 256 << 20,
            connect_timeout: Duration::from_secs(5),
            keep_alive_interval: Some(keepalive::DEFAULT_INTERVAL),
            keep_alive_timeout: keepalive::DEFAULT_TIMEOUT,
            qps_per_connection: None,
            retry: None,
            learn_response_sizes: true,
            pending_request_min: None,
        }
    }

    /// Connects to the server at `addr` (`host:port` or `http://host:port`) with the default
    /// options and the provider named by `RPC_PROVIDER` (soft when unset).
    ///
    /// # Errors
    /// When the address does not resolve, TCP connect fails or the handshake is refused.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the attempt and frees what it set up.
    pub async fn connect(addr: impl AsRef<str>) -> Result<Channel, Error> {
        Channel::builder(addr.as_ref()).connect().await
    }

    /// The connection a call uses now (for a balanced channel: the replica it picked, and
    /// the guard that counts the call in flight there).
    async fn conn_for_call(&self) -> Result<(Arc<Conn>, Option<balance::Load>), Status> {
        self.conn_avoiding(None).await
    }

    /// As [`Channel::conn_for_call`], for a retry: on a balanced channel not the replica
    /// `avoid` the last attempt went to, if another can take the call.
    async fn conn_avoiding(
        &self,
        avoid: Option<Arc<balance::Replica>>,
    ) -> Result<(Arc<Conn>, Option<balance::Load>), Status> {
        match &self.target {
            Target::One(s) => Ok((s.conn().await?, None)),
            Target::Many(b) => {
                let (conn, load) = b.pick(avoid.as_ref()).await?;
                Ok((conn, Some(load)))
            }
        }
    }

    /// As [`Channel::conn_avoiding`], for a blocking call.
    fn conn_for_call_blocking(
        &self,
        avoid: Option<Arc<balance::Replica>>,
    ) -> Result<(Arc<Conn>, Option<balance::Load>), Status> {
        match &self.target {
            Target::One(s) => Ok((s.conn_blocking()?, None)),
            Target::Many(b) => {
                let (conn, load) = b.pick_blocking(avoid)?;
                Ok((conn, Some(load)))
            }
        }
    }

    /// A connection for a call whose request cannot be sent twice (a client stream): getting
    /// it is retried (connect and handshake failures, the reconnect back-off) as the call's
    /// attempts allow; the request's timeout is set to what is left of it.
    async fn conn_retrying<T>(
        &self,
        method: &'static MethodDesc,
        request: &mut Request<T>,
    ) -> Result<(Arc<Conn>, Option<balance::Load>), Status> {
        let mut attempts = Attempts::new(self.retry.as_ref(), method, request.timeout());
        loop {
            match self.conn_for_call().await {
                Ok(c) => return Ok(c),
                Err(st) => match self.next_attempt(&mut attempts, &st, request) {
                    None => return Err(st.for_method(method.path)),
                    Some(wait) if !wait.is_zero() => tokio::time::sleep(wait).await,
                    Some(_) => {}
                },
            }
        }
    }

    /// How long until a single-address channel's next connect attempt, while its reconnect
    /// backs off (a balanced channel moves calls to other replicas instead).
    fn connect_in(&self) -> Option<Duration> {
        match &self.target {
            Target::One(s) => s.connect_in(),
            Target::Many(_) => None,
        }
    }

    /// After a failed attempt: the wait before the next one, or `None` to give up; sets the
    /// request's timeout to what is left of it.
    fn next_attempt<T>(
        &self,
        attempts: &mut Attempts<'_>,
        status: &Status,
        request: &mut Request<T>,
    ) -> Option<Duration> {
        let wait = attempts.retry(status, self.connect_in(), backoff::random_unit())?;
        if let Some(t) = &self.stats {
            t.transport
                .retries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(left) = attempts.timeout_left() {
            request.replace_timeout(Some(left));
        }
        tracing::debug!(
            "retrying after {wait:?} ({}): {}",
            if status.is_not_executed() {
                "not executed"
            } else {
                "idempotent"
            },
            status.message()
        );
        Some(wait)
    }

    /// The current connection, if the channel has one now (of a balanced channel: the first
    /// replica's that is connected).
    fn current(&self) -> Option<Arc<Conn>> {
        match &self.target {
            Target::One(s) => Some(s.conn.load_full()),
            Target::Many(b) => b.current(),
        }
    }

    /// Allocates `len` bytes of registered memory (zeroed) to lend to the server's handlers:
    /// the client side of explicit bulk handles. Fill it (a [`Region`] derefs to `[u8]`),
    /// [`Region::lend`] it with the right the handler needs, pass [`Lease::remote`]
    /// (`{addr, len, rkey}`) in a request, and the handler moves the bytes with one-sided RDMA
    /// READ or WRITE ([`crate::server::Peer`]); drop the lease when the call returns and the
    /// server's access ends. The region belongs to the current connection: after a reconnect,
    /// allocate it again.
    ///
    /// ```no_run
    /// # async fn f(channel: rpc_core::Channel) -> Result<(), rpc_core::Status> {
    /// use rpc_core::verbs::Access;
    /// let mut region = channel.alloc_region(1 << 20).await?;
    /// region.fill(7); // the bytes are ours: no key of them is out
    /// {
    ///     let lease = region.lend(Access::REMOTE_READ)?;
    ///     let handle = lease.remote(); // send it in a request; the handler READs the bytes
    ///     # let _ = handle;
    /// } // lease dropped: the key is revoked, the server can no longer read the region
    /// assert_eq!(region[0], 7);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` when the memory cannot be allocated or registered (RLIMIT_MEMLOCK
    /// on real RNICs); `UNAVAILABLE` when the connection is gone and cannot be re-established.
    pub async fn alloc_region(&self, len: usize) -> Result<Region, Status> {
        let (conn, _load) = self.conn_for_call().await?;
        let mem = with_any!(AnyCore, &conn.core, c => c.alloc_region(len))?;
        Ok(Region::new(mem, conn))
    }

    /// Allocates `len` bytes of registered memory for request payloads (from the connection's
    /// pool of bulk buffers): fill it, [`RegisteredBytesMut::freeze`] it, put
    /// [`RegisteredBytes::bytes`] (or a slice) into a message's `bytes` field and name the
    /// region with [`Request::set_registered`]. Such a request is not copied on the client:
    /// the server RDMA-READs the field from here (the NIC's copy is the only one). Allocate
    /// once and reuse it for many calls (a `Bytes` clone per call); it is eRPC's and UCX's
    /// message buffer. The memory belongs to the current connection: after a reconnect,
    /// requests that use it are copied as usual until it is allocated again.
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` when the memory cannot be allocated or registered, or `len` is
    /// above the largest bulk buffer (1 GiB); `UNAVAILABLE` when the connection is gone and
    /// cannot be re-established.
    pub async fn alloc_bytes(&self, len: usize) -> Result<RegisteredBytesMut, Status> {
        let (conn, _load) = self.conn_for_call().await?;
        with_any!(AnyCore, &conn.core, c => c.alloc_bytes(len))
    }

    /// The registered slots of the current connection: frames are encoded into send slots
    /// that every channel of the process on the same device (with the same slot size) takes
    /// from one pool, registered as they are first needed; they are received into the
    /// connection's own receive window, which starts at 8 slots and doubles while its calls
    /// in flight need more. Idle channels hold little. Default (all zero) when not connected.
    pub fn slots(&self) -> ChannelSlots {
        let Some(c) = self.current() else {
            return ChannelSlots::default();
        };
        with_any!(AnyCore, &c.core, c => c.slots())
    }

    /// Payload bytes of requests sent without a copy since the connection was made: the
    /// `bytes` fields that lay in memory from [`Channel::alloc_bytes`] (counted when posted).
    pub fn zero_copy_request_bytes(&self) -> u64 {
        let Some(c) = self.current() else { return 0 };
        with_any!(AnyCore, &c.core, c => c.counters.zero_copy_request_bytes.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Payload bytes of requests whose copy into registered memory overlapped the server's
    /// RDMA READ of them, since the connection was made: requests whose large `bytes` field
    /// lay in ordinary memory, sent before the field was copied and READ a part at a time as
    /// the copy went ([`ChannelBuilder::pending_request_min`]; counted when posted).
    pub fn overlapped_request_bytes(&self) -> u64 {
        let Some(c) = self.current() else { return 0 };
        with_any!(AnyCore, &c.core, c => c.counters.overlapped_request_bytes.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// How the current connection's async unary calls found their outcome, as
    /// `(driven, handed_over)`: `driven` calls were the process's only async call in flight
    /// and got their answer while their own task drove the connection (no wake-up from
    /// another thread); `handed_over` ones drove it for a while (tens of microseconds, less
    /// on a contended host), then left it to the poller thread and waited to be woken. Calls
    /// with company are in neither. `ClientPoller::Thread` connections only.
    pub fn async_drives(&self) -> (u64, u64) {
        let Some(c) = self.current() else {
            return (0, 0);
        };
        with_any!(AnyCore, &c.core, c => (
            c.counters.caller_driven.load(std::sync::atomic::Ordering::Relaxed),
            c.counters.handed_over.load(std::sync::atomic::Ordering::Relaxed),
        ))
    }

    /// Large responses of the current connection that the server wrote into a landing zone
    /// the call lent (a response size hint, or a size learned per method: see
    /// [`ChannelBuilder::learn_response_sizes`]); the other large responses were READ.
    pub fn written_responses(&self) -> u64 {
        let Some(c) = self.current() else { return 0 };
        with_any!(AnyCore, &c.core, c => c.counters.landing_responses.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Server stream messages of the current connection that arrived packed in one frame
    /// with the rest of their burst (a server sends the small messages its handler yields in
    /// one turn that way), and the frames they came in: `(messages, frames)`.
    pub fn packed_stream_messages(&self) -> (u64, u64) {
        let Some(c) = self.current() else {
            return (0, 0);
        };
        with_any!(AnyCore, &c.core, c => (
            c.counters.packed_messages.load(std::sync::atomic::Ordering::Relaxed),
            c.counters.packed_frames.load(std::sync::atomic::Ordering::Relaxed),
        ))
    }

    /// RC queue pairs the current connection uses (see
    /// [`ChannelBuilder::qps_per_connection`]).
    pub fn qps_per_connection(&self) -> u32 {
        self.current().map_or(0, |c| c.qps)
    }

    /// Bytes of the current connection's one-sided transfers (rendezvous responses this
    /// client READ) that were striped over several QPs.
    pub fn striped_bytes(&self) -> u64 {
        self.current()
            .map_or(0, |c| c.striped.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether the current connection is up (false after the server went away, until the next
    /// call reconnects).
    pub fn is_connected(&self) -> bool {
        self.current().is_some_and(|c| !c.is_dead())
    }

    /// A unary call, retried as [`RetryPolicy`] says (the request's timeout covers every
    /// attempt).
    ///
    /// # Errors
    /// The call's [`Status`] (of its last attempt): the server's, or `UNAVAILABLE` when the
    /// connection is lost or cannot be made, `DEADLINE_EXCEEDED` when the request's timeout
    /// passes, `RESOURCE_EXHAUSTED` for messages over the limit.
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told, and buffers return to their
    /// pools only after the NIC is done with them.
    pub async fn unary<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        self.intercept(method, &mut request)?;
        let started = self.stat_begin(method);
        let span = call_span(method);
        let r = async {
            // The request stays ours until the outcome is known: a retry sends it again by
            // reference (no clone, and nothing allocated when no retry happens).
            let mut attempts = Attempts::new(self.retry.as_ref(), method, request.timeout());
            let mut avoid = None;
            loop {
                let (status, load) = match self.conn_avoiding(avoid.take()).await {
                    Ok((conn, load)) => {
                        match with_any!(AnyCore, &conn.core, c => c.unary(method, &mut request).await) {
                            Ok(r) => return Ok(r),
                            Err(st) => (st, load),
                        }
                    }
                    Err(st) => (st, None),
                };
                let Some(wait) = self.next_attempt(&mut attempts, &status, &mut request) else {
                    return Err(status.for_method(method.path));
                };
                avoid = load.map(|l| l.replica());
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        .instrument(span)
        .await;
        stats::stat_end(started, &r);
        r
    }

    /// A unary call that blocks the calling thread, which polls the completion queue itself:
    /// the lowest latency. Must not be called from inside an async task.
    ///
    /// # Errors
    /// As [`Channel::unary`]; when the connection is lost the call fails with `UNAVAILABLE`
    /// and the next call, blocking or async, reconnects (a blocking one through the runtime
    /// the channel was connected on, waiting for it).
    pub fn unary_blocking<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        self.intercept(method, &mut request)?;
        let started = self.stat_begin(method);
        let r = call_span(method).in_scope(|| {
            // As `unary`: the request is sent again by reference if the call is retried.
            let mut attempts = Attempts::new(self.retry.as_ref(), method, request.timeout());
            let mut avoid = None;
            loop {
                let (status, load) = match self.conn_for_call_blocking(avoid.take()) {
                    Ok((conn, load)) => {
                        match with_any!(AnyCore, &conn.core, c => c.unary_blocking(method, &mut request))
                        {
                            Ok(r) => return Ok(r),
                            Err(st) => (st, load),
                        }
                    }
                    Err(st) => (st, None),
                };
                let Some(wait) = self.next_attempt(&mut attempts, &status, &mut request) else {
                    return Err(status.for_method(method.path));
                };
                avoid = load.map(|l| l.replica());
                if !wait.is_zero() {
                    std::thread::sleep(wait);
                }
            }
        });
        stats::stat_end(started, &r);
        r
    }

    /// A pipeline of unary calls to `method` from one thread: many calls in flight without
    /// async tasks, wakers or a runtime (like eRPC's request queue and event loop). Submit with
    /// [`Pipeline::submit`], collect responses with [`Pipeline::poll`] or [`Pipeline::wait`];
    /// with [`ClientPoller::Caller`] these calls also drive the connection, so one thread does
    /// everything. The fastest way to keep many small calls in flight from one thread.
    ///
    /// The pipeline keeps the connection it was made on: when that connection is lost its
    /// calls fail with `UNAVAILABLE`, and a new pipeline reconnects. Its calls are never
    /// retried ([`Status::is_not_executed`] tells which never left).
    ///
    /// # Errors
    /// `UNAVAILABLE` when there is no connection and reconnecting fails.
    pub fn pipeline<Req, Resp>(
        &self,
        method: &'static MethodDesc,
    ) -> Result<Pipeline<Req, Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let (conn, _load) = self.conn_for_call_blocking(None)?;
        let cap = with_any!(AnyCore, &conn.core, c => c.max_calls());
        Ok(Pipeline {
            unsent: 0,
            conn,
            method,
            interceptor: self.interceptor.clone(),
            in_flight: std::collections::VecDeque::with_capacity(cap),
            ready: std::collections::VecDeque::with_capacity(cap),
            _types: std::marker::PhantomData,
        })
    }

    /// A server-streaming call: returns once the request is sent; the server's messages (and
    /// its final status) arrive on the [`Streaming`]. Metadata the server sends with its first
    /// message is available from [`Streaming::metadata`].
    ///
    /// # Errors
    /// `UNAVAILABLE` when the connection is lost before the request is sent; errors after that
    /// (including the server's status) come from the stream.
    ///
    /// # Cancel safety
    /// Dropping the future before it completes cancels the call; dropping the `Streaming`
    /// cancels it too.
    pub async fn server_streaming<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<Req>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        Req: Message,
        Resp: Message + Default + 'static,
    {
        self.intercept(method, &mut request)?;
        let started = self.stat_begin(method);
        let span = call_span(method);
        let r = async {
            // As `unary`, until the call returns with its first message.
            let mut attempts = Attempts::new(self.retry.as_ref(), method, request.timeout());
            let mut avoid = None;
            loop {
                let (status, load) = match self.conn_avoiding(avoid.take()).await {
                    Ok((conn, load)) => {
                        let r = with_any!(AnyCore, &conn.core, c => c.server_streaming(method, &mut request).await);
                        match r {
                            Ok(r) => return Ok(r.map(|s| s.keep_alive(conn).for_method(method.path))),
                            Err(st) => (st, load),
                        }
                    }
                    Err(st) => (st, None),
                };
                let Some(wait) = self.next_attempt(&mut attempts, &status, &mut request) else {
                    return Err(status.for_method(method.path));
                };
                avoid = load.map(|l| l.replica());
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        .instrument(span)
        .await;
        stats::stat_end(started, &r);
        r
    }

    /// A client-streaming call: sends every message of the request stream (as the server's
    /// window allows), half-closes, and returns the server's response.
    ///
    /// # Errors
    /// The call's [`Status`].
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told.
    pub async fn client_streaming<S, Resp>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<S>,
    ) -> Result<Response<Resp>, Status>
    where
        S: Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        self.intercept(method, &mut request)?;
        let started = self.stat_begin(method);
        let span = call_span(method);
        let r = async {
            let (conn, _load) = self.conn_retrying(method, &mut request).await?;
            with_any!(AnyCore, &conn.core, c => c.client_streaming(method, request).await)
                .map_err(|st| st.for_method(method.path))
        }
        .instrument(span)
        .await;
        stats::stat_end(started, &r);
        r
    }

    /// A bidirectional-streaming call: the request stream is sent by a task of its own (as the
    /// server's window allows) while the caller reads the responses. Must be called inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the connection is lost before the request is sent; errors after that
    /// come from the stream.
    ///
    /// # Cancel safety
    /// Dropping the returned `Streaming` cancels the call.
    pub async fn streaming<S, Resp>(
        &self,
        method: &'static MethodDesc,
        mut request: Request<S>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        S: Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default + 'static,
    {
        self.intercept(method, &mut request)?;
        let started = self.stat_begin(method);
        let span = call_span(method);
        let r = async {
            let (conn, _load) = self.conn_retrying(method, &mut request).await?;
            let r = with_any!(AnyCore, &conn.core, c => c.streaming(method, request).await)
                .map_err(|st| st.for_method(method.path))?;
            Ok(r.map(|s| s.keep_alive(conn).for_method(method.path)))
        }
        .instrument(span)
        .await;
        stats::stat_end(started, &r);
        r
    }
}

/// The client's span of a call (DEBUG, target `rpc_core::call`, the server's is `rpc.server`):
/// entered while the call runs, disabled (and free) unless a subscriber wants it.
fn call_span(method: &MethodDesc) -> tracing::Span {
    tracing::debug_span!(target: "rpc_core::call", "rpc.client", method = method.path)
}

async fn open(b: &ChannelBuilder) -> Result<Conn, Error> {
    b.provider.visit(OpenConn { b: b.clone() })?.await
}

/// The TCP connection to the server, with the channel's options applied.
async fn connect_tcp(b: &ChannelBuilder) -> Result<TcpStream, Error> {
    let stream = tokio::time::timeout(b.connect_timeout, TcpStream::connect(&b.addr))
        .await
        .map_err(|_| {
            Error::new(
                TransportErrorKind::Connect,
                format!("connect to {}: timed out", b.addr),
            )
        })?
        .map_err(|e| {
            Error::with_source(
                TransportErrorKind::Connect,
                format!("connect to {}", b.addr),
                e,
            )
        })?;
    crate::fdtable::opened(&stream);
    let _ = stream.set_nodelay(true);
    let keep_alive = KeepAlive::from_options(b.keep_alive_interval, b.keep_alive_timeout);
    if let Some(k) = keep_alive
        && let Err(e) = k.apply(&stream)
    {
        warn!("{}: no keepalive on the connection: {e}", b.addr);
    }
    Ok(stream)
}

/// Polls `fut` once, so that it starts (a TCP connect sends its SYN), and gives back what
/// that poll returned: the caller does other work meanwhile and awaits `fut` after.
async fn start<F: std::future::Future + Unpin>(fut: &mut F) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx))).await
}

/// What [`Channel::slots`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelSlots {
    /// Send slots the process's pool has registered (for all of its channels on this
    /// device).
    pub registered: u64,
    /// Of those, send slots no channel holds now.
    pub free: u64,
    /// Send slots this connection holds now (frames being encoded, queued, or sent and not
    /// yet completed).
    pub send_held: u64,
    /// The most send slots this connection may hold at once (`Geometry::send_slots`).
    pub send_cap: u64,
    /// Receive slots in this connection's window now (posted, holding received frames, or
    /// parked while the window shrinks after a quiet spell).
    pub recv_window: u64,
    /// The most its receive window grows to (`Geometry::recv_slots`).
    pub recv_max: u64,
    /// Bytes per slot.
    pub slot_size: u32,
}

/// What the channels of a process share per device context (issue 14): one protection domain,
/// one bulk pool, whose buffers of large payloads stay registered and warm from one
/// channel's calls to another's, and the send slot pools.
///
/// Peers reach this memory only through windows ([`crate::buf::BulkBuf::lend`]) bound for one
/// loan: on soft to that connection's peer RNIC alone; on ib any QP of the PD may use a key
/// while its loan lasts, so a server that guessed the fresh key of a loan to another server
/// of this process could reach those bytes until the loan ends (NCCL and UCX share one PD per
/// NIC the same way).
struct DeviceShare<P: Provider> {
    pd: Arc<P::Pd>,
    bulk: Arc<BulkPool<P>>,
    /// The send slots of the process's channels, one pool per slot size.
    sends: std::sync::Mutex<Vec<Arc<SendPool<P>>>>,
    /// The CQ the process's thread-polled channels share, made with the first of them, and
    /// the process it belongs to (a child forked since makes its own, with its own poller).
    hub: std::sync::Mutex<Option<(u32, Arc<Hub<P>>)>>,
}

impl<P: Provider> DeviceShare<P> {
    /// Idle bulk buffers kept per process and device.
    const BULK_CACHED: usize = 256 << 20;

    fn new(ctx: &P::Context) -> crate::verbs::Result<DeviceShare<P>> {
        let pd = Arc::new(ctx.alloc_pd()?);
        let bulk = BulkPool::new(Arc::clone(&pd), Self::BULK_CACHED);
        Ok(DeviceShare {
            pd,
            bulk,
            sends: std::sync::Mutex::new(Vec::new()),
            hub: std::sync::Mutex::new(None),
        })
    }

    /// The CQ the process's `ClientPoller::Thread` channels share on this device; `None`
    /// (each makes its own) when it cannot be made.
    fn hub(&self, ctx: &P::Context) -> Option<Arc<Hub<P>>> {
        let pid = std::process::id();
        let mut hub = self.hub.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((owner, h)) = &*hub
            && *owner == pid
        {
            return Some(Arc::clone(h));
        }
        let made = core::Poller::get()
            .map_err(|e| e.to_string())
            .and_then(|p| Hub::new(ctx, p).map_err(|e| e.to_string()));
        match made {
            Ok(h) => {
                *hub = Some((pid, Arc::clone(&h)));
                Some(h)
            }
            Err(e) => {
                warn!("no shared CQ for this process's channels ({e}): each makes its own");
                None
            }
        }
    }

    /// The process's send slots of `slot_size` bytes on this device, registered as its
    /// channels first need them (see [`crate::buf::sends`]).
    fn send_pool(&self, slot_size: u32) -> crate::verbs::Result<Arc<SendPool<P>>> {
        let mut pools = self.sends.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pools.iter().find(|p| p.slot_size() == slot_size) {
            return Ok(Arc::clone(p));
        }
        let p = SendPool::growing(Arc::clone(&self.pd), slot_size, u32::MAX)?;
        pools.push(Arc::clone(&p));
        Ok(p)
    }
}

struct OpenConn {
    b: ChannelBuilder,
}

impl ProviderVisitor for OpenConn {
    type Output = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Conn, Error>> + Send>>;

    fn visit<P: Provider>(self) -> Self::Output {
        Box::pin(open_with::<P>(self.b))
    }
}

async fn open_with<P: Provider>(b: ChannelBuilder) -> Result<Conn, Error> {
    if !b.geometry.is_valid() || b.geometry.recv_slots < 4 {
        return Err(Error::new(
            TransportErrorKind::Config,
            format!(
                "slot geometry {:?} out of range: slots of 256 B to 1 MiB (a multiple of 64), \
                 1 to 16,384 send slots, and 4 to 16,384 receive slots (two credits are kept \
                 for control frames, two at least for calls)",
                b.geometry
            ),
        ));
    }
    // The TCP handshake (and a name lookup) runs while the verbs objects are made: they do
    // not depend on the server until the Hello.
    let mut connecting = Box::pin(connect_tcp(&b));
    let started = start(&mut connecting).await;
    // One context, PD, bulk pool and send slot pool per device and process: a new connection
    // costs its CQ, QPs and receive slots.
    let dev = crate::verbs::shared::SharedDevice::<P>::open(b.device.as_deref())?;
    let ctx = dev.ctx();
    let shared = dev.per_context(DeviceShare::<P>::new)?;
    let pd = Arc::clone(&shared.pd);
    let caps = QpCaps {
        // Every send slot in flight, a READ (rendezvous response, stream message) per call,
        // and control frames.
        max_send_wr: b
            .geometry
            .send_slots
            .saturating_add(b.max_calls.saturating_mul(2))
            .saturating_add(16)
            .min(ctx.caps().max_qp_wr),
        max_recv_wr: b.geometry.recv_slots,
        // Coalesced SENDs: one gather entry per frame.
        max_send_sge: (crate::link::BATCH_FRAMES as u32).min(ctx.caps().max_sge),
        max_recv_sge: 1,
        max_inline_data: ctx.caps().max_inline.min(256),
    };
    let qps = match b.qps_per_connection {
        Some(n) => n,
        None => P::qps_per_connection()?,
    };
    // Data QPs (several QPs per connection): chunks of striped transfers only, no receives.
    let lcaps = lane_caps(&caps, ctx.caps());
    let cqe = (caps.max_send_wr + caps.max_recv_wr)
        .saturating_add((qps - 1).saturating_mul(lcaps.max_send_wr + lcaps.max_recv_wr));
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let make = |cq: &P::Cq| -> crate::verbs::Result<(P::Qp, Vec<P::Qp>)> {
        let mut qp = pd.create_qp(cq, cq, caps)?;
        qp.modify_to_init(access)?;
        let mut lanes = Vec::with_capacity(qps as usize - 1);
        for _ in 1..qps {
            let mut q = pd.create_qp(cq, cq, lcaps)?;
            q.modify_to_init(access)?;
            lanes.push(q);
        }
        Ok((qp, lanes))
    };
    // A thread-polled channel's QPs go on the process's shared CQ when they fit there; a
    // caller-polled one (driven by its callers alone) has a CQ of its own.
    let joined = match (b.poller == ClientPoller::Thread)
        .then(|| shared.hub(ctx))
        .flatten()
    {
        Some(hub) => match hub.join(cqe, make) {
            Ok(j) => Some(j),
            Err(e) if e.kind() == crate::verbs::ErrorKind::ExceedsCaps => {
                debug!("{e}: the channel makes a CQ of its own");
                None
            }
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    let (cqs, channel, mut qp, mut lanes) = match joined {
        Some((seat, (qp, lanes))) => (Cqs::Shared(seat), None, qp, lanes),
        None => {
            let channel = ctx.create_comp_channel()?;
            let cq = ctx.create_cq(cqe, Some(&channel))?;
            let (qp, lanes) = make(&cq)?;
            (Cqs::Own(cq), Some(channel), qp, lanes)
        }
    };
    let link_key = match &cqs {
        Cqs::Shared(seat) => seat.key(),
        Cqs::Own(_) => CLIENT_LINK,
    };
    let mut stream = match started {
        std::task::Poll::Ready(r) => r?,
        std::task::Poll::Pending => connecting.await?,
    };
    // The receive window the server starts with; it grows with the calls in flight.
    // (A power of two, at least 4: a ring of fewer slots is refused by `with_sends`.)
    let window = 1
        << crate::buf::slots::RECV_WINDOW_START
            .min(b.geometry.recv_slots)
            .max(4)
            .ilog2();
    let hello = Hello {
        provider: P::KIND.wire_tag(),
        endpoint: qp.endpoint(),
        geometry: b.geometry,
        initial_credits: window,
        max_calls: b.max_calls,
        token: b.token.clone(),
        data_endpoints: lanes.iter().map(Qp::endpoint).collect(),
    };
    connect::send(&mut stream, &Handshake::Hello(hello)).await?;
    // Made while the server sets up its side (the Hello names neither).
    let arena = SlotArena::<P>::with_sends(
        &pd,
        b.geometry,
        shared.send_pool(b.geometry.slot_size)?,
        window,
    )?;
    let bulk = Arc::clone(&shared.bulk);
    let tables = Tables::new(b.max_calls);
    let welcome = match connect::recv(&mut stream).await? {
        Handshake::Welcome(w) => w,
        Handshake::Refusal(r) => {
            return Err(Error::new(
                TransportErrorKind::Handshake,
                format!("server {} refused the connection: {}", b.addr, r.reason),
            )
            .with_code(r.code));
        }
        Handshake::Hello(_) => {
            return Err(Error::new(
                TransportErrorKind::Handshake,
                "server answered with a Hello",
            ));
        }
    };
    let attr = ConnectAttr {
        access,
        ..ConnectAttr::default()
    };
    qp.modify_to_rtr(&welcome.endpoint, &attr)?;
    qp.modify_to_rts(&attr)?;
    if welcome.data_endpoints.len() > lanes.len() {
        return Err(Error::new(
            TransportErrorKind::Handshake,
            format!(
                "server {} answered with {} data QPs, {} were offered",
                b.addr,
                welcome.data_endpoints.len(),
                lanes.len()
            ),
        ));
    }
    // The server accepted the first ones; the rest are dropped unconnected.
    lanes.truncate(welcome.data_endpoints.len());
    for (q, ep) in lanes.iter_mut().zip(&welcome.data_endpoints) {
        q.modify_to_rtr(ep, &attr)?;
        q.modify_to_rts(&attr)?;
    }
    let wcfg = wire::Config {
        max_calls: b.max_calls,
        peer_max_calls: welcome.max_calls,
        initial_send_credits: welcome.initial_credits,
        max_send_credits: welcome.geometry.recv_slots,
        recv_depth: window,
        recv_max: b.geometry.recv_slots,
        reserved_credits: 2,
        credit_update_threshold: (b.geometry.recv_slots / 4).max(2),
        eager_limit: b.geometry.slot_size.min(welcome.geometry.slot_size),
        // The server does not know our limit: a response above it must fail its call with
        // RESOURCE_EXHAUSTED (checked per call by the driver), not be a protocol violation
        // that closes the connection.
        max_message: u64::MAX,
        stream_window: crate::streaming::STREAM_WINDOW,
        stream_window_max: crate::streaming::STREAM_WINDOW_MAX,
    };
    let eager_limit = wcfg.eager_limit as usize;
    let wire = wire::Conn::new(Role::Client, wcfg).map_err(|e| {
        Error::new(
            TransportErrorKind::Config,
            format!("protocol configuration: {e}"),
        )
    })?;
    let mut link = Link::new(
        qp,
        arena,
        wire,
        bulk,
        link_key,
        caps.max_inline_data,
        epoch(),
    )
    .map_err(|e| Error::new(TransportErrorKind::Verbs, e.to_string()))?;
    let striped = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let nqps = lanes.len() as u32 + 1;
    link.set_lanes(Lanes::new(
        lanes,
        lcaps.max_send_wr,
        Some(Arc::clone(&striped)),
    ));
    let describe = format!(
        "{} via {}/RC (device {}{}), shard {}/{}",
        b.addr,
        P::TAG,
        ctx.info().name,
        if link.lanes().is_empty() {
            String::new()
        } else {
            format!(", {} QPs per connection", link.lanes().len() + 1)
        },
        welcome.shard,
        welcome.shards
    );
    info!(
        "connected to {describe}: QP {:#x} <-> {:#x} in RTS",
        link.qp.qp_num(),
        welcome.endpoint.qp_num
    );
    let wcfg = *link.wire.config();
    let core = ClientCore::new(Parts {
        stream_window: wcfg.stream_window,
        stream_window_max: wcfg.stream_window_max,
        dev,
        pd,
        cqs,
        channel,
        link,
        tables,
        mode: b.poller,
        eager_limit,
        max_message: b.max_message,
        learn_sizes: b.learn_response_sizes,
        pending_min: b.pending_request_min,
        describe,
    })?;
    if b.poller == ClientPoller::Caller {
        core.spawn_drive_task();
    }
    if b.poller == ClientPoller::Thread {
        core.join_poller().map_err(|e| {
            Error::with_source(TransportErrorKind::Io, "join the client poller thread", e)
        })?;
    }
    let (close_tx, close_rx) = tokio::sync::oneshot::channel::<()>();
    let watch = Arc::clone(&core);
    let addr = b.addr.clone();
    let keep_alive = KeepAlive::from_options(b.keep_alive_interval, b.keep_alive_timeout);
    tokio::spawn(async move {
        let why_closed = |r: Result<Handshake, Error>| match r {
            Ok(Handshake::Refusal(r)) => format!("server closed the connection: {}", r.reason),
            Ok(_) => "server sent unexpected bytes on the control connection".to_string(),
            Err(e) if e.kind() == TransportErrorKind::Handshake => {
                "server sent unexpected bytes on the control connection".to_string()
            }
            Err(e) => keepalive::why_ended("server", keepalive::io_source(&e), keep_alive),
        };
        let closing = connect::recv_closing(&mut stream);
        tokio::pin!(closing);
        tokio::select! {
            r = &mut closing => {
                // The server says why it closes the connection (a remote access error, its
                // shutdown, ...), or just closes it, or keepalive found it gone.
                let why = why_closed(r);
                warn!("{addr}: {why}");
                watch.kill(Status::unavailable(format!("{addr}: {why}")));
            }
            lost = watch.link_lost() => {
                // The server stopped answering on the link; its reason, if it sent one,
                // names the cause better than the error completion that followed it.
                let status = match tokio::time::timeout(core::LOST_GRACE, &mut closing).await {
                    Ok(r @ Ok(Handshake::Refusal(_))) => {
                        let why = why_closed(r);
                        warn!("{addr}: {why}");
                        Status::unavailable(format!(
                            "{addr}: {why} (here the link failed: {})",
                            lost.message()
                        ))
                    }
                    _ => lost,
                };
                watch.kill(status);
            }
            _ = close_rx => {}
        }
    });
    Ok(Conn {
        core: AnyCore::from_arc(core),
        _tcp: close_tx,
        striped,
        qps: nqps,
    })
}

#[cfg(test)]
mod addr_tests {
    use super::server_addr;

    #[test]
    fn server_addresses_take_what_tonic_users_paste() {
        for (given, dial) in [
            ("127.0.0.1:50051", "127.0.0.1:50051"),
            ("http://127.0.0.1:50051", "127.0.0.1:50051"),
            ("HTTP://node7:50051/", "node7:50051"),
            ("[::1]:7", "[::1]:7"),
            ("http://[::1]:7", "[::1]:7"),
            ("localhost:1", "localhost:1"),
        ] {
            assert_eq!(server_addr(given).unwrap(), dial, "{given}");
        }
        for (given, why) in [
            ("https://h:1", "TLS"),
            ("grpc://h:1", "unknown scheme"),
            ("http://h:1/svc", "path"),
            ("h", "no port"),
            ("http://h", "no port"),
            (":1", "no port"),
            ("h:99999", "no valid port"),
            ("h:x", "no valid port"),
        ] {
            let e = server_addr(given).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("host:port"), "{given}: {e}");
        }
    }
}
