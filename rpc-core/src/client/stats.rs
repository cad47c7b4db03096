//! A channel's call statistics ([`Channel::with_stats`]): what the caller saw of each method.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Channel, Shared, Target};
use crate::stats::{Cell, Snapshot, Table};
use crate::{MethodDesc, Status};

/// A call being counted: its method's cell and when it started.
pub(super) struct Started<'a> {
    cell: &'a Cell,
    at: Instant,
}

impl Started<'_> {
    /// Counts the call's end with the status of `r` (streams: the stream began, or did not).
    pub(super) fn end<T>(self, r: &Result<T, Status>) {
        let code = match r {
            Ok(_) => crate::Code::Ok,
            Err(st) => st.code(),
        };
        let ns = u64::try_from(self.at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.cell.finish(code, ns);
    }
}

/// Connections a single-server channel made and failed to make (read by [`Channel::stats`]).
#[derive(Debug, Default)]
pub(super) struct ConnCounts {
    pub(super) connects: std::sync::atomic::AtomicU64,
    pub(super) failed: std::sync::atomic::AtomicU64,
}

impl Channel {
    /// This channel (the same connection or replicas, the same interceptor) counting its
    /// calls per method: calls, statuses by code, in flight, latency, read with
    /// [`Channel::stats`]. Each `with_stats` starts a table of its own, shared by the clones
    /// of the channel it returns. Off (the default) a call pays one branch; on, an `Instant`
    /// read and a few relaxed atomic adds, no allocation. Unary and client-streaming calls
    /// are counted to their result; server-streaming and bidi calls until the stream began
    /// (its first message, its end, or its refusal); pipelines are not counted.
    #[must_use]
    pub fn with_stats(&self) -> Channel {
        Channel {
            stats: Some(Arc::new(Table::new())),
            ..self.clone()
        }
    }

    /// The figures counted since [`Channel::with_stats`] (empty methods without it), and the
    /// connection counters of the channel (of each replica of a balanced one).
    pub fn stats(&self) -> Snapshot {
        let mut s = Snapshot::new("client");
        if let Some(t) = &self.stats {
            t.add_to(&mut s);
        }
        let mut add = |sh: &Shared| {
            let connects = sh.counts.connects.load(Ordering::Relaxed);
            s.transport.connections += connects;
            s.transport.reconnects += connects.saturating_sub(1);
            s.transport.connection_failures += sh.counts.failed.load(Ordering::Relaxed);
        };
        match &self.target {
            Target::One(sh) => add(sh),
            Target::Many(b) => b.each_shared(&mut add),
        }
        s
    }

    /// Starts counting a call to `method`, if this channel counts.
    pub(super) fn stat_begin(&self, method: &'static MethodDesc) -> Option<Started<'_>> {
        let cell = self.stats.as_deref()?.cell(method)?;
        cell.start(0, false);
        Some(Started {
            cell,
            at: Instant::now(),
        })
    }
}

/// Ends the count of a call started with [`Channel::stat_begin`], if any.
pub(super) fn stat_end<T>(started: Option<Started<'_>>, r: &Result<T, Status>) {
    if let Some(s) = started {
        s.end(r);
    }
}
