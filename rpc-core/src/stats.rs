//! Per-method call statistics, readable from code and exported through the `metrics` facade.
//!
//! Turned on with [`crate::ServerBuilder::stats`] and [`crate::Channel::with_stats`]; off,
//! nothing is recorded and a call pays one branch. On, a call pays a few relaxed atomic adds
//! into a table made when the server starts (one per shard, so shards never share a cache
//! line) or, on a client, when a method is first called (a fixed open-addressed table: no
//! allocation and no lock on the call path).
//!
//! Read with [`crate::RunningServer::stats`] / [`crate::Channel::stats`], which sum the tables
//! into a [`Snapshot`]; [`Snapshot::export`] hands the figures to whatever `metrics` recorder
//! the process installed (Prometheus and others), as counters, gauges and latency quantiles.
//!
//! What a method's figures mean: a server counts a call from its dispatch to a handler to its
//! terminal frame (the latency is the handler's plus the wait for a send credit), a client
//! from the call's start to its result. Calls refused before dispatch (unknown methods,
//! draining, bad metadata) are not counted under a method.

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::{Code, MethodDesc};

/// Codes 0..=16.
const CODES: usize = 17;
/// Latencies below this many nanoseconds have a bucket each.
const LINEAR: u64 = 16;
/// Sub-buckets per power of two above [`LINEAR`]: resolution 1/8 (12.5%).
const SUB_BITS: u32 = 3;
/// Powers of two from 2^4 ns to 2^43 ns (about 2.4 hours); longer calls go to the last bucket.
const BUCKETS: usize = LINEAR as usize + (44 - 4) * (1 << SUB_BITS);
/// Methods one table holds; calls to further methods are counted under none (logged once).
const TABLE: usize = 128;

/// The bucket of a latency of `ns` nanoseconds.
fn bucket(ns: u64) -> usize {
    if ns < LINEAR {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros();
    let sub = ((ns >> (e - SUB_BITS)) & ((1 << SUB_BITS) - 1)) as usize;
    (LINEAR as usize + ((e - 4) as usize) * (1 << SUB_BITS) + sub).min(BUCKETS - 1)
}

/// The smallest latency in bucket `i`, in nanoseconds.
fn bucket_floor(i: usize) -> u64 {
    if i < LINEAR as usize {
        return i as u64;
    }
    let j = i - LINEAR as usize;
    let e = (j >> SUB_BITS) as u32 + 4;
    let sub = (j & ((1 << SUB_BITS) - 1)) as u64;
    (1u64 << e) + (sub << (e - SUB_BITS))
}

/// The live counters of one method.
pub(crate) struct Cell {
    id: AtomicU32,
    desc: AtomicPtr<MethodDesc>,
    started: AtomicU64,
    codes: [AtomicU64; CODES],
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    rendezvous_requests: AtomicU64,
    rendezvous_responses: AtomicU64,
    latency: [AtomicU64; BUCKETS],
}

impl Cell {
    fn new() -> Cell {
        Cell {
            id: AtomicU32::new(0),
            desc: AtomicPtr::new(std::ptr::null_mut()),
            started: AtomicU64::new(0),
            codes: std::array::from_fn(|_| AtomicU64::new(0)),
            request_bytes: AtomicU64::new(0),
            response_bytes: AtomicU64::new(0),
            rendezvous_requests: AtomicU64::new(0),
            rendezvous_responses: AtomicU64::new(0),
            latency: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// A call started with a request of `bytes` (sent by rendezvous or not).
    pub(crate) fn start(&self, bytes: usize, rendezvous: bool) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.request_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if rendezvous {
            self.rendezvous_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A call ended with `code` after `ns` nanoseconds.
    pub(crate) fn finish(&self, code: Code, ns: u64) {
        self.codes[code as usize].fetch_add(1, Ordering::Relaxed);
        self.latency[bucket(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// A response (or stream message) of `bytes` was sent or received.
    pub(crate) fn response(&self, bytes: usize, rendezvous: bool) {
        self.response_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if rendezvous {
            self.rendezvous_responses.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Counters of the connections under a table (a server shard's, a client channel's).
#[derive(Default)]
pub(crate) struct TransportCells {
    pub(crate) connections: AtomicU64,
    pub(crate) connection_failures: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) credit_stalls: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) flushed: AtomicU64,
    pub(crate) retry_exceeded: AtomicU64,
    pub(crate) failed_completions: AtomicU64,
}

/// One table of methods: an open-addressed array keyed by method id (ids are never 0).
pub(crate) struct Table {
    cells: Box<[Cell]>,
    pub(crate) transport: TransportCells,
    full: std::sync::atomic::AtomicBool,
}

impl Table {
    /// A work completion that did not succeed: flushed (its QP had failed), the NIC's
    /// transport or RNR retries exhausted, or another error.
    pub(crate) fn count_failed_completion(&self, status: crate::verbs::WcStatus) {
        use crate::verbs::WcStatus;
        let t = &self.transport;
        match status {
            WcStatus::WrFlushErr => &t.flushed,
            WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr => &t.retry_exceeded,
            _ => &t.failed_completions,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn new() -> Table {
        Table {
            cells: (0..TABLE).map(|_| Cell::new()).collect(),
            transport: TransportCells::default(),
            full: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The cell of `desc`, claimed on first use; `None` once the table is full.
    pub(crate) fn cell(&self, desc: &'static MethodDesc) -> Option<&Cell> {
        let mut i = (desc.id.wrapping_mul(0x9e37_79b9) >> 25) as usize % TABLE;
        for _ in 0..TABLE {
            let c = &self.cells[i];
            match c.id.load(Ordering::Acquire) {
                id if id == desc.id => return Some(c),
                0 => match c
                    .id
                    .compare_exchange(0, desc.id, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        c.desc
                            .store((desc as *const MethodDesc).cast_mut(), Ordering::Release);
                        return Some(c);
                    }
                    Err(id) if id == desc.id => return Some(c),
                    Err(_) => {}
                },
                _ => {}
            }
            i = (i + 1) % TABLE;
        }
        if !self.full.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "call statistics: more than {TABLE} methods; {} and later ones are not counted",
                desc.path
            );
        }
        None
    }

    /// Adds this table's figures to `into`.
    pub(crate) fn add_to(&self, into: &mut Snapshot) {
        for c in self.cells.iter() {
            let p = c.desc.load(Ordering::Acquire);
            if p.is_null() {
                continue;
            }
            // SAFETY: only `&'static MethodDesc`s are stored (`cell`).
            let desc: &'static MethodDesc = unsafe { &*p };
            let m = match into.methods.iter_mut().position(|m| m.path == desc.path) {
                Some(i) => &mut into.methods[i],
                None => {
                    into.methods.push(MethodStats::new(desc.path));
                    into.methods.last_mut().expect("just pushed")
                }
            };
            let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
            m.started += ld(&c.started);
            for (s, a) in m.codes.iter_mut().zip(&c.codes) {
                *s += ld(a);
            }
            m.request_bytes += ld(&c.request_bytes);
            m.response_bytes += ld(&c.response_bytes);
            m.rendezvous_requests += ld(&c.rendezvous_requests);
            m.rendezvous_responses += ld(&c.rendezvous_responses);
            for (s, a) in m.latency.buckets.iter_mut().zip(&c.latency) {
                *s += ld(a);
            }
        }
        let t = &self.transport;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        into.transport.connections += ld(&t.connections);
        into.transport.connection_failures += ld(&t.connection_failures);
        into.transport.reconnects += ld(&t.reconnects);
        into.transport.credit_stalls += ld(&t.credit_stalls);
        into.transport.retries += ld(&t.retries);
        into.transport.flushed += ld(&t.flushed);
        into.transport.retry_exceeded += ld(&t.retry_exceeded);
        into.transport.failed_completions += ld(&t.failed_completions);
        into.methods.sort_by(|a, b| a.path.cmp(b.path));
    }
}

/// The figures of a server or a channel at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// `"server"` or `"client"`: the `side` label of exported metrics.
    pub side: &'static str,
    /// Per method, sorted by path.
    pub methods: Vec<MethodStats>,
    /// Connection-level counters.
    pub transport: Transport,
}

/// Connection-level counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transport {
    /// Connections made (server: accepted; client: connected, the first one included).
    pub connections: u64,
    /// Connections that ended with an error (a failed completion, a protocol violation, the
    /// peer gone) rather than a close.
    pub connection_failures: u64,
    /// Client: connections remade after a loss.
    pub reconnects: u64,
    /// Terminal frames that waited for a send credit (the peer's receive ring was full).
    pub credit_stalls: u64,
    /// Client: attempts after the first of retried calls ([`crate::RetryPolicy`]).
    pub retries: u64,
    /// Server: work completions flushed because their QP had failed (`IBV_WC_WR_FLUSH_ERR`).
    pub flushed: u64,
    /// Server: work requests whose transport or RNR retries ran out (`IBV_WC_RETRY_EXC_ERR`,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer or the path was gone, or its receive queue stayed
    /// empty); the NIC's retries themselves are not visible through verbs.
    pub retry_exceeded: u64,
    /// Server: other failed work completions (protection, length, remote access errors).
    pub failed_completions: u64,
}

/// One method's figures.
#[derive(Clone, Debug)]
pub struct MethodStats {
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// Calls started.
    pub started: u64,
    codes: [u64; CODES],
    /// Request payload bytes (server only; the first message of unary and server-streaming
    /// calls, not client stream messages).
    pub request_bytes: u64,
    /// Response payload bytes (server only; every message of a server stream).
    pub response_bytes: u64,
    /// Requests whose payload the server RDMA-READ from the client (server only).
    pub rendezvous_requests: u64,
    /// Responses (or stream messages) sent one-sided: READ by the client or written into its
    /// landing zone (server only).
    pub rendezvous_responses: u64,
    /// Time from start to end of finished calls.
    pub latency: Latency,
}

impl MethodStats {
    fn new(path: &'static str) -> MethodStats {
        MethodStats {
            path,
            started: 0,
            codes: [0; CODES],
            request_bytes: 0,
            response_bytes: 0,
            rendezvous_requests: 0,
            rendezvous_responses: 0,
            latency: Latency {
                buckets: vec![0; BUCKETS],
            },
        }
    }

    /// Calls that ended with `code`.
    pub fn count(&self, code: Code) -> u64 {
        self.codes[code as usize]
    }

    /// Calls that ended, with any status.
    pub fn finished(&self) -> u64 {
        self.codes.iter().sum()
    }

    /// Calls started and not yet ended.
    pub fn in_flight(&self) -> u64 {
        self.started.saturating_sub(self.finished())
    }

    /// `(code, calls)` for every code some call ended with.
    pub fn statuses(&self) -> impl Iterator<Item = (Code, u64)> + '_ {
        self.codes
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(c, n)| (Code::from_u8(c as u8), *n))
    }
}

/// A latency histogram: buckets 12.5% wide (exact below 16 ns).
#[derive(Clone, Debug)]
pub struct Latency {
    buckets: Vec<u64>,
}

impl Latency {
    /// Calls measured.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The latency below which a fraction `q` (0..=1) of the calls lie (the lower end of its
    /// bucket); zero when no call was measured.
    pub fn quantile(&self, q: f64) -> Duration {
        let n = self.count();
        if n == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b;
            if seen >= rank {
                return Duration::from_nanos(bucket_floor(i));
            }
        }
        Duration::from_nanos(bucket_floor(BUCKETS - 1))
    }
}

impl Snapshot {
    pub(crate) fn new(side: &'static str) -> Snapshot {
        Snapshot {
            side,
            ..Snapshot::default()
        }
    }

    /// The figures of the method at `path`, if it was called.
    pub fn method(&self, path: &str) -> Option<&MethodStats> {
        self.methods.iter().find(|m| m.path == path)
    }

    /// Hands the figures to the process's `metrics` recorder (set absolute: call it as often
    /// as the exporter should see fresh values): `rpc_calls_started_total` and
    /// `rpc_calls_total{code}` counters, `rpc_calls_in_flight`, `rpc_request_bytes_total`,
    /// `rpc_response_bytes_total`, `rpc_rendezvous_total{direction}`, the latency as gauges
    /// `rpc_latency_seconds{quantile="0.5"|"0.9"|"0.99"|"0.999"}`, all labelled with `side`
    /// and `method`; and `rpc_connections_total`, `rpc_connection_failures_total`,
    /// `rpc_reconnects_total`, `rpc_credit_stalls_total`, `rpc_retries_total`,
    /// `rpc_flushed_completions_total`, `rpc_retry_exceeded_total`,
    /// `rpc_failed_completions_total` labelled with `side`.
    pub fn export(&self) {
        let side = self.side;
        for m in &self.methods {
            let l = [("side", side), ("method", m.path)];
            metrics::counter!("rpc_calls_started_total", &l).absolute(m.started);
            metrics::gauge!("rpc_calls_in_flight", &l).set(m.in_flight() as f64);
            metrics::counter!("rpc_request_bytes_total", &l).absolute(m.request_bytes);
            metrics::counter!("rpc_response_bytes_total", &l).absolute(m.response_bytes);
            for (dir, n) in [
                ("request", m.rendezvous_requests),
                ("response", m.rendezvous_responses),
            ] {
                metrics::counter!("rpc_rendezvous_total", "side" => side, "method" => m.path, "direction" => dir)
                    .absolute(n);
            }
            for (code, n) in m.statuses() {
                metrics::counter!("rpc_calls_total", "side" => side, "method" => m.path, "code" => code.name())
                    .absolute(n);
            }
            for (q, name) in [(0.5, "0.5"), (0.9, "0.9"), (0.99, "0.99"), (0.999, "0.999")] {
                metrics::gauge!("rpc_latency_seconds", "side" => side, "method" => m.path, "quantile" => name)
                    .set(m.latency.quantile(q).as_secs_f64());
            }
        }
        let t = &self.transport;
        for (name, v) in [
            ("rpc_connections_total", t.connections),
            ("rpc_connection_failures_total", t.connection_failures),
            ("rpc_reconnects_total", t.reconnects),
            ("rpc_credit_stalls_total", t.credit_stalls),
            ("rpc_retries_total", t.retries),
            ("rpc_flushed_completions_total", t.flushed),
            ("rpc_retry_exceeded_total", t.retry_exceeded),
            ("rpc_failed_completions_total", t.failed_completions),
        ] {
            metrics::counter!(name, "side" => side).absolute(v);
        }
    }
}

impl std::fmt::Display for Snapshot {
    /// A table: one line per method (calls, statuses, p50/p99, bytes), then the transport.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<40} {:>9} {:>6} {:>10} {:>10}  statuses",
            format!("{} method", self.side),
            "calls",
            "live",
            "p50",
            "p99"
        )?;
        for m in &self.methods {
            let statuses: Vec<String> = m
                .statuses()
                .map(|(c, n)| format!("{}={n}", c.name()))
                .collect();
            writeln!(
                f,
                "{:<40} {:>9} {:>6} {:>10.1?} {:>10.1?}  {}",
                m.path,
                m.finished(),
                m.in_flight(),
                m.latency.quantile(0.5),
                m.latency.quantile(0.99),
                statuses.join(" ")
            )?;
        }
        let t = &self.transport;
        write!(
            f,
            "connections {} (failed {}, reconnects {}), credit stalls {}, retries {}, \
             completions flushed {}, retries exceeded {}, other failed {}",
            t.connections,
            t.connection_failures,
            t.reconnects,
            t.credit_stalls,
            t.retries,
            t.flushed,
            t.retry_exceeded,
            t.failed_completions
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CallKind;

    #[test]
    fn buckets_are_ordered_and_cover_their_floor() {
        let mut last = 0;
        for i in 0..BUCKETS {
            let f = bucket_floor(i);
            assert!(i == 0 || f > last, "bucket {i}");
            assert_eq!(bucket(f), i, "floor of bucket {i} is {f}");
            last = f;
        }
        for ns in [0, 1, 15, 16, 17, 1000, 1_234_567, u64::MAX] {
            let b = bucket(ns);
            assert!(bucket_floor(b) <= ns, "{ns}");
            if b + 1 < BUCKETS {
                assert!(ns < bucket_floor(b + 1), "{ns}");
                // 12.5% resolution.
                assert!(ns - bucket_floor(b) <= bucket_floor(b) / 8 + 1, "{ns}");
            }
        }
    }

    #[test]
    fn quantiles_and_counts_add_up_over_tables() {
        static A: MethodDesc = MethodDesc::new("/t.S/A", CallKind::Unary);
        static B: MethodDesc = MethodDesc::new("/t.S/B", CallKind::Unary);
        let (t1, t2) = (Table::new(), Table::new());
        for i in 0..100u64 {
            let c = t1.cell(&A).unwrap();
            c.start(10, false);
            c.finish(Code::Ok, (i + 1) * 1000);
        }
        let c = t2.cell(&A).unwrap();
        c.start(5, true);
        c.finish(Code::Unavailable, 1_000_000);
        t2.cell(&B).unwrap().start(1, false);
        let mut s = Snapshot::new("server");
        t1.add_to(&mut s);
        t2.add_to(&mut s);
        let a = s.method("/t.S/A").unwrap();
        assert_eq!((a.started, a.finished(), a.in_flight()), (101, 101, 0));
        assert_eq!((a.count(Code::Ok), a.count(Code::Unavailable)), (100, 1));
        assert_eq!((a.request_bytes, a.rendezvous_requests), (1005, 1));
        let p50 = a.latency.quantile(0.5).as_nanos() as u64;
        assert!((44_000..=51_000).contains(&p50), "p50 {p50}");
        assert!(a.latency.quantile(1.0) >= Duration::from_micros(900));
        let b = s.method("/t.S/B").unwrap();
        assert_eq!((b.started, b.in_flight()), (1, 1));
        assert!(s.to_string().contains("/t.S/A"));
    }

    #[test]
    fn failed_completions_are_counted_by_kind() {
        use crate::verbs::WcStatus;
        let t = Table::new();
        for st in [
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr,
            WcStatus::RetryExcErr,
            WcStatus::RnrRetryExcErr,
            WcStatus::LocProtErr,
        ] {
            t.count_failed_completion(st);
        }
        let mut s = Snapshot::new("server");
        t.add_to(&mut s);
        let x = s.transport;
        assert_eq!(
            (x.flushed, x.retry_exceeded, x.failed_completions),
            (2, 2, 1)
        );
        assert!(s.to_string().contains("completions flushed 2"));
    }

    #[test]
    fn a_full_table_counts_nothing_more_and_keeps_what_it_has() {
        let t = Table::new();
        let descs: Vec<&'static MethodDesc> = (0..TABLE + 3)
            .map(|i| {
                let path: &'static str = Box::leak(format!("/t.S/M{i}").into_boxed_str());
                &*Box::leak(Box::new(MethodDesc::new(path, CallKind::Unary)))
            })
            .collect();
        let claimed = descs.iter().filter(|d| t.cell(d).is_some()).count();
        assert_eq!(claimed, TABLE);
        // Every claimed method finds its own cell again.
        for d in &descs[..TABLE] {
            let c = t.cell(d).unwrap();
            assert_eq!(c.id.load(Ordering::Relaxed), d.id);
        }
    }
}
