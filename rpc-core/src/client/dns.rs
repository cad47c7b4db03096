//! DNS names in a balanced channel ([`Balancer::resolve`], and the names in
//! [`Channel::balance_list`]): a name becomes one replica per address it resolves to (a
//! Kubernetes headless service: one per ready pod), re-resolved in a background task.
//!
//! The task holds only a weak reference to the channel's replicas, so it ends soon after the
//! channel (every clone and every [`Balancer`]) is dropped; it sleeps between lookups. It looks
//! the name up every `every`, and sooner, at most once per [`MIN_GAP`], when a call found
//! every replica of the name unreachable. Addresses that appeared become replicas with the
//! name's options; replicas whose address is gone are removed as [`Balancer::remove`] does
//! (calls in flight there finish). A failed lookup keeps the last known set (logged once per
//! streak of failures). No call waits on DNS, except a call that finds the channel with no
//! replica while a name's first lookup is under way: it waits for that lookup, at most the
//! name's connect timeout.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::balance::{Balance, Replica};
#[cfg(doc)]
use super::{Balancer, Channel};
use super::{ChannelBuilder, server_addr};
use crate::Error;

/// How often a name is looked up again by default (as by [`Channel::balance_list`]).
pub(crate) const DEFAULT_REFRESH: Duration = Duration::from_secs(30);
/// The shortest time between two lookups of a name.
pub(crate) const MIN_GAP: Duration = Duration::from_secs(1);

/// The result of looking a name up.
pub(crate) type LookupFuture = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>;
/// How names are looked up (the system resolver; a fake in tests).
pub(crate) type Lookup = Arc<dyn Fn(String) -> LookupFuture + Send + Sync>;

/// The system resolver (`getaddrinfo` through `tokio::net::lookup_host`).
pub(crate) fn system_lookup() -> Lookup {
    Arc::new(|name: String| {
        Box::pin(async move { Ok(tokio::net::lookup_host(name).await?.collect()) })
    })
}

/// Whether the host of `host:port` is an IP literal (`10.0.0.7`, `[::1]`).
fn is_ip_literal(dial: &str) -> bool {
    let host = dial.rsplit_once(':').map_or(dial, |(h, _)| h);
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.parse::<IpAddr>().is_ok()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The names of a balanced channel. Read by calls only when no replica could take them.
#[derive(Default)]
pub(crate) struct Names {
    list: Mutex<Vec<Arc<Name>>>,
    /// Names whose first lookup has not finished.
    pending: AtomicUsize,
    /// The longest wait for a first lookup (the longest connect timeout of a pending name).
    first_wait_ns: AtomicU64,
    /// Woken when a first lookup finishes.
    first_done: Notify,
    /// Wakes the names' tasks: a call found replicas unreachable, a name was removed, the
    /// channel is gone.
    nudge: Arc<Notify>,
}

impl std::fmt::Debug for Names {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = lock(&self.list).iter().map(|n| n.name.clone()).collect();
        f.debug_list().entries(names).finish()
    }
}

/// A name being resolved.
struct Name {
    /// `host:port`.
    name: String,
    /// The last lookup's error, while lookups fail.
    error: Mutex<Option<String>>,
    /// Removed (or replaced): its task ends.
    removed: AtomicBool,
}

impl Names {
    /// Wakes the names' tasks (each looks again only if its replicas are all unreachable, and
    /// at most once per [`MIN_GAP`]). Cheap; no allocation.
    pub(crate) fn nudge(&self) {
        self.nudge.notify_waiters();
    }

    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.list).is_empty()
    }

    /// Whether some name's first lookup is under way.
    pub(crate) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) > 0
    }

    /// Waits until no first lookup is under way, `replicas_empty` says false, or the longest
    /// first-lookup wait has passed.
    pub(crate) async fn wait_first(&self, replicas_empty: impl Fn() -> bool) {
        let wait = Duration::from_nanos(self.first_wait_ns.load(Ordering::Relaxed))
            + Duration::from_millis(100);
        let deadline = Instant::now() + wait;
        loop {
            let done = self.first_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.pending() || !replicas_empty() {
                return;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return;
            }
        }
    }

    /// What the names say when the channel has no replica (lookups under way or failed).
    pub(crate) fn why_none(&self) -> Vec<String> {
        lock(&self.list)
            .iter()
            .map(|n| match &*lock(&n.error) {
                Some(e) => format!("{} did not resolve: {e}", n.name),
                None => format!("{} resolved to no address yet", n.name),
            })
            .collect()
    }

    /// Removes the name `dial` (its task ends); whether there was one.
    pub(crate) fn remove(&self, dial: &str) -> bool {
        let mut list = lock(&self.list);
        let before = list.len();
        list.retain(|n| {
            let keep = n.name != dial;
            if !keep {
                n.removed.store(true, Ordering::Release);
            }
            keep
        });
        let removed = list.len() != before;
        drop(list);
        if removed {
            self.nudge();
        }
        removed
    }
}

/// Counts a name's first lookup as finished when dropped (on every way out of its task).
struct FirstLookup {
    balance: Weak<Balance>,
    done: bool,
}

impl FirstLookup {
    fn finish(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        if let Some(b) = self.balance.upgrade() {
            b.names.pending.fetch_sub(1, Ordering::AcqRel);
            b.names.first_done.notify_waiters();
        }
    }
}

impl Drop for FirstLookup {
    fn drop(&mut self) {
        self.finish();
    }
}

/// What the task of one name needs.
struct Resolver {
    balance: Weak<Balance>,
    name: Arc<Name>,
    nudge: Arc<Notify>,
    template: ChannelBuilder,
    every: Duration,
    min_gap: Duration,
    lookup: Lookup,
}

impl Balance {
    /// Resolves `builder`'s address (see [`Balancer::resolve`]) with `lookup`, every `every`
    /// and, when its replicas are all unreachable, at most once per `min_gap`. An IP literal
    /// is one replica, keyed by the address as given.
    pub(crate) fn resolve_with(
        self: &Arc<Self>,
        mut builder: ChannelBuilder,
        every: Duration,
        min_gap: Duration,
        lookup: Lookup,
    ) -> Result<(), Error> {
        let dial = server_addr(&builder.addr)?;
        if is_ip_literal(&dial) {
            let key = builder.addr.clone();
            self.insert(key, builder);
            return Ok(());
        }
        builder.addr.clone_from(&dial);
        let name = Arc::new(Name {
            name: dial.clone(),
            error: Mutex::new(None),
            removed: AtomicBool::new(false),
        });
        self.names.remove(&dial);
        lock(&self.names.list).push(Arc::clone(&name));
        self.names.pending.fetch_add(1, Ordering::AcqRel);
        let wait = u64::try_from(builder.connect_timeout.as_nanos()).unwrap_or(u64::MAX);
        self.names.first_wait_ns.fetch_max(wait, Ordering::Relaxed);
        let task = Resolver {
            balance: Arc::downgrade(self),
            name,
            nudge: Arc::clone(&self.names.nudge),
            template: builder,
            every: every.max(Duration::from_millis(1)),
            min_gap,
            lookup,
        };
        self.rt.spawn(task.run());
        Ok(())
    }

    /// Whether every replica of the name `prefix` (`host:port/`) is unreachable (or it has none).
    fn all_unreachable(&self, prefix: &str) -> bool {
        self.replicas
            .load()
            .iter()
            .filter(|r| r.key.starts_with(prefix))
            .all(|r| r.health.has_failed())
    }

    /// Makes the replicas of the name `prefix` those of `addrs`: new addresses added (with
    /// `template`'s options), gone ones removed; the others keep their connection and health.
    /// Returns the keys added and removed. Changes nothing once `name` is removed, checked
    /// in the same update as the change: a removal's own update (after it marks the name)
    /// either comes after this one and takes its replicas away, or makes this one start
    /// again and see the mark, so a removed name's replicas never come back.
    fn apply(
        &self,
        name: &Name,
        prefix: &str,
        template: &ChannelBuilder,
        mut addrs: Vec<SocketAddr>,
    ) -> (Vec<String>, Vec<String>) {
        addrs.sort_unstable();
        addrs.dedup();
        let fresh: Vec<Arc<Replica>> = addrs
            .iter()
            .map(|a| {
                let mut b = template.clone();
                b.addr = a.to_string();
                Arc::new(Replica::named(format!("{prefix}{a}"), b))
            })
            .collect();
        let old = self.replicas.rcu(|v| {
            if name.removed.load(Ordering::Acquire) {
                return v.to_vec();
            }
            let mut out: Vec<Arc<Replica>> = v
                .iter()
                .filter(|r| !r.key.starts_with(prefix) || fresh.iter().any(|f| f.key == r.key))
                .cloned()
                .collect();
            for f in &fresh {
                if !out.iter().any(|r| r.key == f.key) {
                    out.push(Arc::clone(f));
                }
            }
            out
        });
        let had = |k: &str| old.iter().any(|r| r.key == k);
        let added = fresh
            .iter()
            .filter(|f| !had(&f.key))
            .map(|f| f.key.clone())
            .collect();
        let removed = old
            .iter()
            .filter(|r| r.key.starts_with(prefix) && !fresh.iter().any(|f| f.key == r.key))
            .map(|r| r.key.clone())
            .collect();
        (added, removed)
    }
}

impl Resolver {
    async fn run(self) {
        let mut first = FirstLookup {
            balance: self.balance.clone(),
            done: false,
        };
        let prefix = format!("{}/", self.name.name);
        let mut failing = false;
        let mut last: Option<Instant> = None;
        let mut next = Instant::now();
        loop {
            // Sleep until the next lookup is due, or a nudge makes it due sooner.
            loop {
                let nudged = self.nudge.notified();
                tokio::pin!(nudged);
                nudged.as_mut().enable();
                if self.balance.strong_count() == 0 || self.name.removed.load(Ordering::Acquire) {
                    return;
                }
                if Instant::now() >= next {
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(next) => {}
                    () = &mut nudged => {
                        let Some(b) = self.balance.upgrade() else { return };
                        if b.all_unreachable(&prefix) {
                            let soonest = last.map_or_else(Instant::now, |l| l + self.min_gap);
                            next = next.min(soonest);
                        }
                    }
                }
            }
            let limit = self.template.connect_timeout;
            let got = tokio::time::timeout(limit, (self.lookup)(self.name.name.clone())).await;
            let Some(b) = self.balance.upgrade() else {
                return;
            };
            if self.name.removed.load(Ordering::Acquire) {
                return;
            }
            let why = match got {
                Ok(Ok(addrs)) if !addrs.is_empty() => {
                    let (added, removed) = b.apply(&self.name, &prefix, &self.template, addrs);
                    if self.name.removed.load(Ordering::Acquire) {
                        // Removed while this lookup was applied: the removal took away
                        // what it added (or it added nothing).
                        return;
                    }
                    if !added.is_empty() || !removed.is_empty() {
                        tracing::info!(
                            "{} re-resolved: added {added:?}, removed {removed:?}",
                            self.name.name
                        );
                    }
                    None
                }
                Ok(Ok(_)) => Some("no address".to_owned()),
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("lookup timed out after {limit:?}")),
            };
            match why {
                None => {
                    if failing {
                        tracing::info!("{} resolves again", self.name.name);
                    }
                    failing = false;
                    *lock(&self.name.error) = None;
                }
                Some(why) => {
                    if !failing {
                        tracing::warn!(
                            "{} did not resolve (keeping its {} replicas): {why}",
                            self.name.name,
                            b.replicas
                                .load()
                                .iter()
                                .filter(|r| r.key.starts_with(&prefix))
                                .count()
                        );
                    }
                    failing = true;
                    *lock(&self.name.error) = Some(why);
                }
            }
            drop(b);
            first.finish();
            let now = Instant::now();
            last = Some(now);
            next = now + self.every;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_ip_literal;

    #[test]
    fn ip_literals_are_told_from_names() {
        for ip in ["10.0.0.7:1", "[::1]:7", "[fe80::1]:50051", "127.0.0.1:0"] {
            assert!(is_ip_literal(ip), "{ip}");
        }
        for name in [
            "localhost:1",
            "svc.ns.svc.cluster.local:50051",
            "node7:2",
            "10.0.0:1",
        ] {
            assert!(!is_ip_literal(name), "{name}");
        }
    }
}
