//! The server: shards (one thread per core, each owning a CQ, its connections' QPs, slots and
//! in-flight calls), the acceptor (TCP handshake, then liveness), and the [`Service`] contract
//! generated servers implement.
//!
//! ```text
//! acceptor (tokio): accept ─> Hello ─> checks ─> shard inbox ─> shard creates QP ─> Welcome
//!                   then holds the TCP connection: EOF => shard drops the connection's calls
//! shard i (thread): poll CQ ─> frames ─> Service::call ─> handler runs inline or parks
//!                   ─> response encoded into a send slot ─> SEND
//! ```

mod call;
pub(crate) mod notify;
mod peer;
mod router;
mod shard;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};

pub use call::{CallCtx, CallFamily, Dispatched, IncomingCall, InterceptedService};
pub use peer::{BulkBuffer, BulkMem, Peer};

use crate::Code;
use crate::buf::Geometry;
use crate::connect::{self, Hello, Message, Refusal};
use crate::method::MethodDesc;
use crate::verbs::{Context, Provider, ProviderKind, ProviderVisitor};
use crate::{Error, TransportErrorKind};
use router::Router;
use shard::{ShardHandle, ShardMsg};

/// A service the server can dispatch to. Generated `*Server<T>` types implement it; users do not
/// need to.
pub trait Service: Send + Sync + 'static {
    /// Fully qualified service name (`package.Service`).
    fn name(&self) -> &'static str;

    /// The service's methods.
    fn methods(&self) -> &'static [MethodDesc];

    /// Starts the call of method `method` (an id from [`Service::methods`]): pick the handler
    /// and hand it to one of [`IncomingCall`]'s methods, or answer
    /// [`IncomingCall::unimplemented`].
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched;
}

/// How an idle shard waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ShardPolling {
    /// Spin on the CQ forever: lowest latency, one core per shard.
    Busy,
    /// Spin, then yield, then sleep on the completion channel (default).
    #[default]
    Adaptive,
    /// Sleep on the completion channel whenever the CQ is empty.
    Event,
}

/// Everything a shard needs to know, fixed when the server starts.
#[derive(Debug, Clone)]
pub(crate) struct ServerConfig {
    pub(crate) shards: u16,
    pub(crate) cores: Option<Vec<usize>>,
    pub(crate) poll_mode: ShardPolling,
    pub(crate) provider: ProviderKind,
    pub(crate) device: Option<String>,
    pub(crate) token: Option<Vec<u8>>,
    pub(crate) geometry: Geometry,
    pub(crate) max_conns_per_shard: u32,
    /// Connections one peer address may hold at once (None: no limit of its own).
    pub(crate) max_conns_per_peer: Option<u32>,
    pub(crate) tasks_per_shard: u32,
    pub(crate) max_message: u64,
    pub(crate) bulk_cache_bytes: usize,
    pub(crate) max_calls_per_conn: u32,
    pub(crate) shutdown_grace: Duration,
    /// QPs per connection at most (None: the provider's setting, `RPC_IB_QPS_PER_CONNECTION`).
    pub(crate) qps_per_connection: Option<u32>,
}

impl ServerConfig {
    /// The core shard `id` is pinned to, if pinning was asked for.
    pub(crate) fn core_of(&self, id: u16) -> Option<usize> {
        let cores = self.cores.as_ref()?;
        if cores.is_empty() {
            return None;
        }
        Some(cores[id as usize % cores.len()])
    }
}

/// An RPC server. Built with [`Server::builder`].
#[derive(Debug)]
pub struct Server {
    _private: (),
}

impl Server {
    /// A builder with defaults: one shard, adaptive polling, the provider named by
    /// `RPC_PROVIDER` (soft when unset).
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            services: Vec::new(),
            cfg: ServerConfig {
                shards: 1,
                cores: None,
                poll_mode: ShardPolling::Adaptive,
                provider: ProviderKind::from_env().unwrap_or(ProviderKind::Soft),
                device: None,
                token: None,
                geometry: Geometry::default(),
                max_conns_per_shard: 64,
                max_conns_per_peer: None,
                tasks_per_shard: 4096,
                max_message: 256 << 20,
                bulk_cache_bytes: 256 << 20,
                max_calls_per_conn: 1024,
                shutdown_grace: Duration::from_secs(10),
                qps_per_connection: None,
            },
            provider_error: ProviderKind::from_env().err().map(|e| e.to_string()),
        }
    }
}

/// Configures and starts a [`Server`].
pub struct ServerBuilder {
    services: Vec<Arc<dyn Service>>,
    cfg: ServerConfig,
    provider_error: Option<String>,
}

impl std::fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerBuilder")
            .field(
                "services",
                &self.services.iter().map(|s| s.name()).collect::<Vec<_>>(),
            )
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl ServerBuilder {
    /// Adds a service (generated `*Server<T>`).
    pub fn add_service(mut self, service: impl Service) -> Self {
        self.services.push(Arc::new(service));
        self
    }

    /// Number of shards (polling threads, one CQ each). Default 1.
    pub fn shards(mut self, n: usize) -> Self {
        self.cfg.shards = n.clamp(1, 256) as u16;
        self
    }

    /// Pins shard `i` to `cores[i % cores.len()]`.
    pub fn pin_cores(mut self, cores: Vec<usize>) -> Self {
        self.cfg.cores = Some(cores);
        self
    }

    /// How idle shards wait. Default [`ShardPolling::Adaptive`].
    pub fn poll_mode(mut self, mode: ShardPolling) -> Self {
        self.cfg.poll_mode = mode;
        self
    }

    /// The provider (overrides `RPC_PROVIDER`).
    pub fn provider(mut self, provider: ProviderKind) -> Self {
        self.cfg.provider = provider;
        self.provider_error = None;
        self
    }

    /// The device to open (default: the provider's first usable one).
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.cfg.device = Some(name.into());
        self
    }

    /// Requires clients to present this shared secret in the handshake (at most 64 bytes).
    pub fn auth_token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.cfg.token = Some(token.into());
        self
    }

    /// Slot geometry of each connection (slot size = largest eager frame, ring depths).
    pub fn geometry(mut self, geometry: Geometry) -> Self {
        self.cfg.geometry = geometry;
        self
    }

    /// Largest message accepted or sent (default 256 MiB).
    pub fn max_message(mut self, bytes: u64) -> Self {
        self.cfg.max_message = bytes;
        self
    }

    /// Connections each shard accepts (default 64).
    pub fn max_connections_per_shard(mut self, n: u32) -> Self {
        self.cfg.max_conns_per_shard = n.max(1);
        self
    }

    /// Connections one client address (IP) may hold at once (default: no limit of its own,
    /// only the shards'): a peer that opens connections until the limit gets a clear
    /// `RESOURCE_EXHAUSTED` refusal while the others keep being served.
    pub fn max_connections_per_peer(mut self, n: u32) -> Self {
        self.cfg.max_conns_per_peer = Some(n.max(1));
        self
    }

    /// Calls in flight per shard (handler task slots; default 4096).
    pub fn max_calls_per_shard(mut self, n: u32) -> Self {
        self.cfg.tasks_per_shard = n.max(1);
        self
    }

    /// How long [`RunningServer::shutdown`] lets calls in flight finish before dropping the
    /// handlers still running (default 10 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.cfg.shutdown_grace = grace;
        self
    }

    /// Most RC queue pairs per connection (1..=16; default: the provider's setting, on `ib`
    /// `RPC_IB_QPS_PER_CONNECTION`, else 1). A connection uses as many as both sides allow:
    /// the first carries every frame, the others carry spans of large one-sided transfers
    /// (RDMA READ/WRITE of 256 KiB or more), like `NCCL_IB_QPS_PER_CONNECTION`.
    pub fn qps_per_connection(mut self, n: u32) -> Self {
        self.cfg.qps_per_connection = Some(n.clamp(1, crate::verbs::MAX_QPS_PER_CONNECTION));
        self
    }

    fn check(&self) -> Result<(), Error> {
        if let Some(e) = &self.provider_error {
            return Err(Error::new(TransportErrorKind::Config, e.clone()));
        }
        if !self.cfg.geometry.is_valid() {
            return Err(Error::new(
                TransportErrorKind::Config,
                "slot geometry out of range",
            ));
        }
        if self
            .cfg
            .token
            .as_ref()
            .is_some_and(|t| t.len() > connect::MAX_TOKEN)
        {
            return Err(Error::new(
                TransportErrorKind::Config,
                "auth token longer than 64 bytes",
            ));
        }
        Ok(())
    }

    /// Binds the listener and starts the shards; returns a handle to the running server.
    /// Must be called inside a tokio runtime (the acceptor and handler timers run on it).
    ///
    /// # Errors
    /// When the address is invalid, the port is taken, or the device cannot be opened.
    ///
    /// # Cancel safety
    /// Dropping the future before it completes stops what it started.
    pub async fn bind(self, addr: impl AsRef<str>) -> Result<RunningServer, Error> {
        self.check()?;
        let router =
            Router::new(self.services).map_err(|e| Error::new(TransportErrorKind::Config, e))?;
        let listener = TcpListener::bind(addr.as_ref()).await.map_err(|e| {
            Error::with_source(
                TransportErrorKind::Connect,
                format!("bind {}", addr.as_ref()),
                e,
            )
        })?;
        let local = listener.local_addr()?;
        let cfg = Arc::new(self.cfg);
        let rt = tokio::runtime::Handle::current();
        let shards = cfg.provider.visit(StartShards {
            cfg: Arc::clone(&cfg),
            router: Arc::new(router),
            rt,
        })??;
        let shards = Arc::new(shards);
        info!(
            "rdma-rpc server on {local}: provider {}, {} shard(s), poll mode {:?}",
            cfg.provider, cfg.shards, cfg.poll_mode
        );
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let acceptor = tokio::spawn(accept_loop(
            listener,
            Arc::clone(&cfg),
            Arc::clone(&shards),
            stop_rx,
        ));
        Ok(RunningServer {
            local,
            shards,
            stop_tx,
            acceptor,
        })
    }

    /// Binds and serves until the process ends.
    ///
    /// # Errors
    /// As [`ServerBuilder::bind`].
    pub async fn serve(self, addr: impl AsRef<str>) -> Result<(), Error> {
        let server = self.bind(addr).await?;
        std::future::pending::<()>().await;
        drop(server);
        Ok(())
    }
}

struct StartShards {
    cfg: Arc<ServerConfig>,
    router: Arc<Router>,
    rt: tokio::runtime::Handle,
}

impl ProviderVisitor for StartShards {
    type Output = Result<Vec<ShardHandle>, Error>;

    fn visit<P: Provider>(self) -> Self::Output {
        let epoch = Instant::now();
        // Rails: the devices (and ports) to spread shards over; shard i uses rail i % n.
        let mut rails: Vec<Option<P::Context>> = match &self.cfg.device {
            Some(d) => vec![Some(P::open(Some(d))?)],
            None => P::open_rails()?.into_iter().map(Some).collect(),
        };
        if rails.is_empty() {
            return Err(Error::new(
                TransportErrorKind::Verbs,
                format!("{}: no device to use", P::NAME),
            ));
        }
        let names: Vec<String> = rails
            .iter()
            .flatten()
            .map(|c| format!("{}:{}", c.info().name, c.info().port))
            .collect();
        let mut handles = Vec::new();
        for id in 0..self.cfg.shards {
            let r = id as usize % rails.len();
            let ctx = match rails[r].take() {
                Some(c) => c,
                None => P::open(Some(&names[r]))?,
            };
            info!(
                "shard {id}/{} bound to rail [{r}]{}",
                self.cfg.shards, names[r]
            );
            let (shard, mut handle) = shard::open::<P>(
                ctx,
                id,
                self.cfg.shards,
                Arc::clone(&self.cfg),
                Arc::clone(&self.router),
                epoch,
            )?;
            let rt = self.rt.clone();
            let thread = std::thread::Builder::new()
                .name(format!("rpc-shard-{id}"))
                .spawn(move || shard.run(rt))
                .map_err(|e| Error::with_source(TransportErrorKind::Io, "spawn shard thread", e))?;
            handle.thread = std::sync::Mutex::new(Some(thread));
            handles.push(handle);
        }
        Ok(handles)
    }
}

async fn accept_loop(
    listener: TcpListener,
    cfg: Arc<ServerConfig>,
    shards: Arc<Vec<ShardHandle>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut next = 0usize;
    let peers = Arc::new(PeerCounts::default());
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let shard = next % shards.len();
        next = next.wrapping_add(1);
        let held = PeerSlot::take(&peers, peer.ip(), cfg.max_conns_per_peer);
        let cfg = Arc::clone(&cfg);
        let shards = Arc::clone(&shards);
        tokio::spawn(async move {
            match held {
                Ok(slot) => {
                    serve_connection(stream, peer, cfg, shards, shard).await;
                    drop(slot);
                }
                Err(limit) => {
                    let mut stream = stream;
                    let why = format!(
                        "too many connections from {} (this server allows {limit} per peer \
                         address)",
                        peer.ip()
                    );
                    refuse(&mut stream, peer, Code::ResourceExhausted, &why).await;
                }
            }
        });
    }
}

/// Connections held per peer address (for `max_connections_per_peer`).
#[derive(Default)]
struct PeerCounts(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, u32>>);

/// One connection of a peer address, counted until dropped.
struct PeerSlot {
    peers: Arc<PeerCounts>,
    ip: std::net::IpAddr,
}

impl PeerSlot {
    /// Counts a new connection from `ip`, or returns the limit it would exceed.
    fn take(
        peers: &Arc<PeerCounts>,
        ip: std::net::IpAddr,
        limit: Option<u32>,
    ) -> Result<PeerSlot, u32> {
        let mut m = peers.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if let Some(limit) = limit
            && *n >= limit
        {
            return Err(limit);
        }
        *n += 1;
        Ok(PeerSlot {
            peers: Arc::clone(peers),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.peers.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// One client's TCP side: the handshake, then liveness until either side closes (a shutdown
/// drains the connection first: the shard closes it once its calls finished).
async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    cfg: Arc<ServerConfig>,
    shards: Arc<Vec<ShardHandle>>,
    shard: usize,
) {
    let hello = match connect::recv(&mut stream).await {
        Ok(Message::Hello(h)) => h,
        Ok(_) => {
            refuse(&mut stream, peer, Code::InvalidArgument, "expected a Hello").await;
            return;
        }
        Err(e) => {
            refuse(&mut stream, peer, Code::InvalidArgument, &e.to_string()).await;
            return;
        }
    };
    if let Err((code, why)) = check_hello(&hello, &cfg) {
        refuse(&mut stream, peer, code, &why).await;
        return;
    }
    let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
    let (closed_tx, mut closed_rx) = tokio::sync::oneshot::channel();
    let handle = &shards[shard];
    handle.send(ShardMsg::Connect {
        hello,
        peer,
        reply: reply_tx,
        closed: closed_tx,
    });
    let (welcome, key) = match reply_rx.await {
        Ok(Ok(x)) => x,
        Ok(Err((code, why))) => {
            // The shard cannot take it (full, out of queue pairs or memory, a bad endpoint).
            refuse(&mut stream, peer, code, &why).await;
            return;
        }
        Err(_) => {
            refuse(&mut stream, peer, Code::Unavailable, "server shutting down").await;
            return;
        }
    };
    if let Err(e) = connect::send(&mut stream, &Message::Welcome(welcome)).await {
        warn!("handshake with {peer} failed: {e}");
        handle.send(ShardMsg::Disconnect(key));
        return;
    }
    // Liveness: the client never sends more on TCP; EOF or an error means it is gone.
    let mut byte = [0u8; 1];
    use tokio::io::AsyncReadExt;
    tokio::select! {
        _ = stream.read(&mut byte) => {
            handle.send(ShardMsg::Disconnect(key));
        }
        why = &mut closed_rx => {
            // Tells the client why (its QPs may only see flushes), within a second.
            if let Ok(reason) = why {
                let code = Code::Unavailable;
                let msg = Message::Refusal(Refusal { reason, code });
                let send = connect::send(&mut stream, &msg);
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), send).await;
            }
        }
    }
    // A shutdown does not end this task: the connection drains (its calls in flight finish
    // and their responses arrive), and the shard closes it, which tells the client why.
}

/// Whether a client's hello fits this server; else the status its attempt ends with.
fn check_hello(h: &Hello, cfg: &ServerConfig) -> Result<(), (Code, String)> {
    let expected = cfg.provider.wire_tag();
    if h.provider != expected || h.endpoint.provider != expected {
        return Err((
            Code::FailedPrecondition,
            format!(
                "provider mismatch: this server uses {}; set RPC_PROVIDER={} on the client",
                cfg.provider, cfg.provider
            ),
        ));
    }
    if let Some(token) = &cfg.token
        && !connect::token_matches(token, &h.token)
    {
        return Err((
            Code::Unauthenticated,
            "authentication failed: missing or wrong token".into(),
        ));
    }
    if h.max_calls > cfg.max_calls_per_conn {
        return Err((
            Code::FailedPrecondition,
            format!(
                "client call table of {} exceeds this server's limit of {}",
                h.max_calls, cfg.max_calls_per_conn
            ),
        ));
    }
    Ok(())
}

/// Refuses a connection: the client's attempt ends with `code` and `why`.
async fn refuse(stream: &mut TcpStream, peer: SocketAddr, code: Code, why: &str) {
    warn!("refused connection from {peer}: {why}");
    let _ = connect::send(
        stream,
        &Message::Refusal(Refusal {
            reason: why.to_owned(),
            code,
        }),
    )
    .await;
}

/// A running server.
#[derive(Debug)]
pub struct RunningServer {
    local: SocketAddr,
    shards: Arc<Vec<ShardHandle>>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    acceptor: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for ShardHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardHandle")
            .field("live_calls", &self.live_calls.load(Ordering::Relaxed))
            .finish()
    }
}

impl RunningServer {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Client connections open, over all shards.
    pub fn connections(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.open_conns.load(Ordering::Acquire))
            .sum()
    }

    /// Calls accepted and not yet answered, over all shards.
    pub fn live_calls(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.live_calls.load(Ordering::Acquire))
            .sum()
    }

    /// Response payload bytes sent without a copy, over all shards: `bytes` fields (of 16 KiB
    /// or more) of a response that lie in the buffer its large request was READ into (an echo,
    /// or a slice of the request) go out from there through the landing-zone WRITE's gather
    /// list instead of being encoded into a new buffer.
    pub fn zero_copy_response_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.zero_copy_bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Bytes of one-sided transfers striped over several QPs of a connection, over all shards
    /// ([`ServerBuilder::qps_per_connection`]).
    pub fn striped_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.striped_bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Stops accepting, tells clients to start no new call here (GoAway), lets calls in flight
    /// finish for at most the grace period ([`ServerBuilder::shutdown_grace`]), then stops the
    /// shards and closes every connection. Requests that arrive meanwhile (sent before the
    /// client saw the GoAway) never reach a handler: they are refused `UNAVAILABLE` with the
    /// not-executed trailer ([`Status::is_not_executed`](crate::Status::is_not_executed)), and
    /// a shard lingers 100 ms (within the grace period) after its last call for those still on
    /// the way, so the client can send them elsewhere.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the shards stopping in the background.
    pub async fn shutdown(self) {
        let _ = self.stop_tx.send(true);
        self.acceptor.abort();
        for s in self.shards.iter() {
            s.linger.store(true, Ordering::Release);
            s.stop.store(true, Ordering::Release);
            s.doorbell.ring_always();
        }
        let shards = Arc::clone(&self.shards);
        let _ = tokio::task::spawn_blocking(move || {
            for s in shards.iter() {
                let t = s.thread.lock().ok().and_then(|mut t| t.take());
                if let Some(t) = t {
                    let _ = t.join();
                }
            }
        })
        .await;
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        let _ = self.stop_tx.send(true);
        self.acceptor.abort();
        for s in self.shards.iter() {
            s.stop.store(true, Ordering::Release);
            s.doorbell.ring_always();
        }
    }
}
