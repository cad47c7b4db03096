//! A channel over several replicas of a service ([`Channel::balance_list`],
//! [`Channel::balance_channel`]): each call goes to the better of two replicas picked at
//! random (fewer calls in flight: power of two choices); a replica that cannot be reached is
//! ejected and tried again after an exponential back-off with jitter, and the call moves on to
//! another replica (it provably reached no handler). Replicas come and go while calls run
//! ([`Balancer::insert`], [`Balancer::remove`]). Each replica is an ordinary single-server
//! connection, made on first use and remade after a loss. A DNS name becomes one replica per
//! address it resolves to, re-resolved while the channel lives ([`Balancer::resolve`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};

use super::backoff::{Reconnect, now_ns, unit};
use super::dns::{self, Names};
use super::{Channel, ChannelBuilder, Conn, Shared, Target, open};
use crate::{Error, Status};

/// The replicas of a balanced channel.
pub(crate) struct Balance {
    pub(super) replicas: ArcSwap<Vec<Arc<Replica>>>,
    /// Where blocking callers connect replicas (the runtime the channel was made on), and
    /// where names are resolved.
    pub(super) rt: tokio::runtime::Handle,
    /// State of the picker's random numbers (xorshift).
    seed: AtomicU64,
    /// The DNS names resolved into replicas (off the call path).
    pub(super) names: Names,
}

impl Drop for Balance {
    fn drop(&mut self) {
        // The names' tasks end now rather than at their next lookup.
        self.names.nudge();
    }
}

impl std::fmt::Debug for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<String> = self.replicas.load().iter().map(|r| r.key.clone()).collect();
        f.debug_struct("Balance")
            .field("replicas", &keys)
            .field("names", &self.names)
            .finish()
    }
}

/// One replica: its options, its connection once made, its load and its health.
pub(crate) struct Replica {
    pub(super) key: String,
    /// An address of a DNS name (its ejection may make the name be looked up again).
    named: bool,
    builder: ChannelBuilder,
    shared: ArcSwapOption<Shared>,
    /// Connecting the first time (one attempt at a time).
    connecting: tokio::sync::Mutex<()>,
    in_flight: AtomicUsize,
    /// Ejected (not picked) until its reconnect back-off has passed.
    pub(super) health: Reconnect,
}

/// A call in flight on a replica (counted until dropped).
pub(crate) struct Load(Arc<Replica>);

impl Load {
    /// The replica the call went to (a retry goes elsewhere if it can).
    pub(crate) fn replica(&self) -> Arc<Replica> {
        Arc::clone(&self.0)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Changes the replicas of a balanced channel while calls run (tower's `Change`).
#[derive(Clone, Debug)]
pub struct Balancer {
    balance: Arc<Balance>,
}

impl Balancer {
    /// Adds (or replaces) the replica `key`, connected on first use.
    pub fn insert(&self, key: impl Into<String>, builder: ChannelBuilder) {
        self.balance.insert(key.into(), builder);
    }

    /// Resolves the DNS name of `builder`'s address (`host:port` or `http://host:port`) into
    /// one replica per address, each with `builder`'s options and keyed `host:port/ip:port`
    /// (dialled by IP), and keeps resolving it while the channel lives: a Kubernetes
    /// headless service (one address per ready pod) then needs no more code.
    ///
    /// The name is looked up again every `every` (at least one second; [`Channel::balance_list`]
    /// uses 30 s), and sooner, at most once a second, when a call found every replica of the
    /// name unreachable. Addresses that appeared become replicas; replicas whose address is
    /// gone are removed as by [`Balancer::remove`] (calls in flight there finish). A failed
    /// lookup keeps the replicas of the last one that succeeded (and is logged once per streak
    /// of failures). Lookups run in a background task on the channel's runtime, which ends
    /// when the channel and its balancers are dropped; calls never wait for DNS, except one
    /// made while the channel has no replica at all and a name's first lookup is under way:
    /// it waits for that lookup, at most `builder`'s connect timeout, and fails `UNAVAILABLE`
    /// (not executed: [`Status::is_not_executed`]) naming the name and the lookup's error if
    /// no replica came of it.
    ///
    /// An IP literal (`10.0.0.7:50051`, `[::1]:50051`) is one replica keyed by the address
    /// as given, as [`Balancer::insert`] makes it. Resolving a name again replaces its
    /// earlier resolution; [`Balancer::remove`] of the name (`host:port`) stops it and
    /// removes its replicas. Removing one of its replicas by key lasts until the next lookup.
    ///
    /// # Errors
    /// When the address is not `host:port` or `http://host:port` (nothing is added).
    pub fn resolve(&self, builder: ChannelBuilder, every: Duration) -> Result<(), Error> {
        self.balance.resolve_with(
            builder,
            every.max(dns::MIN_GAP),
            dns::MIN_GAP,
            dns::system_lookup(),
        )
    }

    /// Removes the replica `key`: no new call goes there; calls in flight there finish.
    /// `key` may also be a name given to [`Balancer::resolve`] (as `host:port`): its
    /// resolution stops and its replicas are removed.
    pub fn remove(&self, key: &str) {
        if let Ok(dial) = super::server_addr(key)
            && self.balance.names.remove(&dial)
        {
            let prefix = format!("{dial}/");
            self.balance.replicas.rcu(|v| {
                v.iter()
                    .filter(|r| !r.key.starts_with(&prefix))
                    .cloned()
                    .collect::<Vec<_>>()
            });
        }
        self.balance.replicas.rcu(|v| {
            v.iter()
                .filter(|r| r.key != key)
                .cloned()
                .collect::<Vec<_>>()
        });
    }

    /// The replicas' keys.
    pub fn keys(&self) -> Vec<String> {
        self.balance
            .replicas
            .load()
            .iter()
            .map(|r| r.key.clone())
            .collect()
    }
}

impl Channel {
    /// A channel over the replicas `addrs` (`host:port` or `http://host:port` each, with the
    /// default options), as tonic's `Channel::balance_list`: see [`Channel::balance_channel`].
    /// An address whose host is a DNS name stands for every address the name resolves to, and
    /// is re-resolved every 30 s (and sooner when its replicas are all unreachable): see
    /// [`Balancer::resolve`]. Must be called inside a tokio runtime.
    pub fn balance_list<I, S>(addrs: I) -> Channel
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let (ch, balancer) = Channel::balance_channel();
        for addr in addrs {
            let addr = addr.into();
            let builder = Channel::builder(addr.clone());
            if balancer.resolve(builder, dns::DEFAULT_REFRESH).is_err() {
                // Not an address: the calls say why (as before names were resolved).
                balancer.insert(addr.clone(), Channel::builder(addr));
            }
        }
        ch
    }

    /// A balanced channel with no replica yet, and the [`Balancer`] that adds and removes
    /// them. Each call goes to the better of two replicas picked at random (fewer calls in
    /// flight); a replica that cannot be reached is ejected for an exponential back-off with
    /// jitter and the call tries another. Calls fail `UNAVAILABLE` only when no replica can be
    /// reached. Generated clients, blocking calls and pipelines (which stay on the replica
    /// they started on) work on it unchanged. Must be called inside a tokio runtime.
    pub fn balance_channel() -> (Channel, Balancer) {
        let balance = Arc::new(Balance {
            replicas: ArcSwap::from_pointee(Vec::new()),
            rt: tokio::runtime::Handle::current(),
            seed: AtomicU64::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id())),
            names: Names::default(),
        });
        let ch = Channel {
            target: Target::Many(Arc::clone(&balance)),
            interceptor: None,
            retry: None,
            stats: None,
        };
        (ch, Balancer { balance })
    }
}

impl Replica {
    fn new(key: String, builder: ChannelBuilder) -> Replica {
        Replica {
            key,
            named: false,
            builder,
            shared: ArcSwapOption::empty(),
            connecting: tokio::sync::Mutex::new(()),
            in_flight: AtomicUsize::new(0),
            health: Reconnect::new(),
        }
    }

    /// A replica for an address of a DNS name.
    pub(super) fn named(key: String, builder: ChannelBuilder) -> Replica {
        Replica {
            named: true,
            ..Replica::new(key, builder)
        }
    }

    fn is_down(&self, now: u64) -> bool {
        self.health.is_down(now)
    }

    fn shared(&self) -> Option<Arc<Shared>> {
        self.shared.load_full()
    }

    /// The replica's connection if it is up now (no connect, no wait).
    fn ready(&self) -> Option<Arc<Conn>> {
        let s = self.shared.load();
        let c = s.as_ref()?.conn.load_full();
        c.is_usable().then_some(c)
    }

    /// The replica's live connection: made on first use, remade after a loss.
    async fn conn(&self) -> Result<Arc<Conn>, Status> {
        if let Some(s) = self.shared() {
            return s.conn().await;
        }
        let _one = self.connecting.lock().await;
        if let Some(s) = self.shared() {
            return s.conn().await;
        }
        let mut builder = self.builder.clone();
        builder.addr =
            super::server_addr(&builder.addr).map_err(|e| Status::unavailable(e.to_string()))?;
        let conn = open(&builder)
            .await
            .map_err(|e| Status::unavailable(format!("{}: {e}", self.key)).not_executed())?;
        // The replica's own back-off (ejection) gates its reconnects: none in `Shared`.
        let shared = Arc::new(Shared::new(builder, conn, false));
        let c = shared.conn.load_full();
        self.shared.store(Some(shared));
        Ok(c)
    }

    /// Reached: the back-off starts over.
    fn healthy(&self) {
        self.health.succeeded();
    }

    /// Not reached: ejected for the next back-off (with `jitter` in -1..=1).
    /// Logged once per ejection (calls that fail within it add nothing).
    fn eject(&self, why: &Status, jitter: f64) {
        let was_down = self.health.is_down(now_ns());
        let wait = self.health.failed(why.message(), jitter);
        if !was_down {
            tracing::warn!(
                "replica {} ejected for {wait:?}: {}",
                self.key,
                why.message()
            );
        }
    }
}

impl Balance {
    /// Adds (or replaces) the replica `key`.
    pub(super) fn insert(&self, key: String, builder: ChannelBuilder) {
        let replica = Arc::new(Replica::new(key.clone(), builder));
        self.replicas.rcu(|v| {
            let mut v: Vec<Arc<Replica>> = v.iter().filter(|r| r.key != key).cloned().collect();
            v.push(Arc::clone(&replica));
            v
        });
    }

    /// A random number (xorshift64*): which replicas to compare, and jitter.
    fn random(&self) -> u64 {
        let mut x = self.seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn jitter(&self) -> f64 {
        unit(self.random())
    }

    /// The replica to try next among those not `tried` (a bit per replica; replicas past the
    /// 128th are never marked, the callers bound their attempts) and not ejected: the one with
    /// fewer calls in flight of two picked at random. Allocates nothing.
    fn choose(&self, replicas: &[Arc<Replica>], tried: u128) -> Option<usize> {
        // The clock is read only when some replica is ejected (not on the fast path).
        let now = std::cell::OnceCell::new();
        let up = |r: &Replica| !r.health.has_failed() || !r.is_down(*now.get_or_init(now_ns));
        let open = |i: usize| (i >= 128 || tried & (1 << i) == 0) && up(&replicas[i]);
        let n = (0..replicas.len()).filter(|&i| open(i)).count();
        let nth = |k: usize| (0..replicas.len()).filter(|&i| open(i)).nth(k);
        match n {
            0 => None,
            1 => nth(0),
            n => {
                let r = self.random();
                let ka = (r % n as u64) as usize;
                let mut kb = ((r >> 32) % (n as u64 - 1)) as usize;
                if kb >= ka {
                    kb += 1;
                }
                let (a, b) = (nth(ka)?, nth(kb)?);
                let load = |i: usize| replicas[i].in_flight.load(Ordering::Relaxed);
                Some(if load(b) < load(a) { b } else { a })
            }
        }
    }

    /// The connection of an up replica that needs no connect (the fast path of blocking
    /// calls: no hand-off to the runtime), and its load guard.
    fn pick_ready(&self, avoid: Option<&Arc<Replica>>) -> Option<(Arc<Conn>, Load)> {
        let replicas = self.replicas.load();
        let mut tried = Self::avoid_mask(&replicas, avoid);
        for _ in 0..replicas.len() {
            let i = self.choose(&replicas, tried)?;
            if i < 128 {
                tried |= 1 << i;
            }
            let r = &replicas[i];
            if let Some(conn) = r.ready() {
                r.in_flight.fetch_add(1, Ordering::Relaxed);
                return Some((conn, Load(Arc::clone(r))));
            }
        }
        None
    }

    /// Why no replica could take the call.
    fn none_left(&self, replicas: &[Arc<Replica>], errors: &[String]) -> Status {
        if replicas.is_empty() {
            if self.names.is_empty() {
                return Status::unavailable("the balanced channel has no replica");
            }
            return Status::unavailable(format!(
                "the balanced channel has no replica: {}",
                self.names.why_none().join("; ")
            ))
            .not_executed();
        }
        let mut why: Vec<String> = errors.to_vec();
        for r in replicas {
            if !r.health.has_failed() || errors.iter().any(|e| e.starts_with(&r.key)) {
                continue;
            }
            why.push(format!(
                "{}: ejected after: {}",
                r.key,
                r.health.last_error()
            ));
        }
        Status::unavailable(format!("no replica can be reached: {}", why.join("; "))).not_executed()
    }

    /// The bit of `avoid` among `replicas` (the replica a call's last attempt went to), when
    /// some other replica could take the call: a retry goes elsewhere if it can.
    fn avoid_mask(replicas: &[Arc<Replica>], avoid: Option<&Arc<Replica>>) -> u128 {
        let Some(a) = avoid else { return 0 };
        if replicas.len() < 2 {
            return 0;
        }
        match replicas.iter().position(|r| Arc::ptr_eq(r, a)) {
            Some(i) if i < 128 => 1 << i,
            _ => 0,
        }
    }

    /// A replica's connection for a call, and its load guard: not `avoid` (where the call's
    /// last attempt went) unless no other replica is left.
    pub(crate) async fn pick(
        &self,
        avoid: Option<&Arc<Replica>>,
    ) -> Result<(Arc<Conn>, Load), Status> {
        let mut replicas = self.replicas.load_full();
        if replicas.is_empty() && self.names.pending() {
            // The first lookup of a name is under way: wait for it (bounded).
            self.names
                .wait_first(|| self.replicas.load().is_empty())
                .await;
            replicas = self.replicas.load_full();
        }
        let avoided = Self::avoid_mask(&replicas, avoid);
        let mut tried = avoided;
        let mut errors = Vec::new();
        for _ in 0..=replicas.len() {
            let i = match self.choose(&replicas, tried) {
                Some(i) => i,
                // Only the avoided replica is left: it may take the call after all.
                None if tried & avoided != 0 => {
                    tried &= !avoided;
                    match self.choose(&replicas, tried) {
                        Some(i) => i,
                        None => break,
                    }
                }
                None => break,
            };
            if i < 128 {
                tried |= 1 << i;
            }
            let r = &replicas[i];
            match r.conn().await {
                Ok(conn) => {
                    r.healthy();
                    r.in_flight.fetch_add(1, Ordering::Relaxed);
                    return Ok((conn, Load(Arc::clone(r))));
                }
                Err(st) => {
                    r.eject(&st, self.jitter());
                    if r.named {
                        // Its name may have moved: looked up again if all its replicas fail.
                        self.names.nudge();
                    }
                    errors.push(format!("{}: {}", r.key, st.message()));
                }
            }
        }
        self.names.nudge();
        Err(self.none_left(&replicas, &errors))
    }

    /// As [`Balance::pick`], from a thread that may block (not a runtime thread).
    pub(crate) fn pick_blocking(
        self: &Arc<Self>,
        avoid: Option<Arc<Replica>>,
    ) -> Result<(Arc<Conn>, Load), Status> {
        if let Some(ready) = self.pick_ready(avoid.as_ref()) {
            return Ok(ready);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let me = Arc::clone(self);
        self.rt.spawn(async move {
            let _ = tx.send(me.pick(avoid.as_ref()).await);
        });
        rx.recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                Err(Status::unavailable(
                    "no replica reached within 60 s (or the channel's runtime has shut down)",
                )
                .not_executed())
            })
    }

    /// The first connected replica's current connection.
    pub(crate) fn each_shared(&self, f: &mut dyn FnMut(&Shared)) {
        for r in self.replicas.load().iter() {
            if let Some(s) = r.shared() {
                f(&s);
            }
        }
    }

    pub(crate) fn current(&self) -> Option<Arc<Conn>> {
        self.replicas
            .load()
            .iter()
            .find_map(|r| r.shared().map(|s| s.conn.load_full()))
    }
}
