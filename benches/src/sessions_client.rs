//! `rpc-bench sessions-client`: one client process of `rpc-bench sessions`. It holds its share
//! of the connections to one server and answers commands from the coordinator, one line each
//! on its standard input, with one JSON line on its standard output:
//!
//! ```text
//! OPEN <n> <limit ms> <give up>   open n more connections, one after another, timing each
//!                                 connect + first 32 B call -> OpenReply
//! LOAD <active> <ms>              the first `active` connections each make 32 B calls, one
//!                                 outstanding, for ms milliseconds -> LoadReply
//! QUIT                            (exits)
//! ```
//!
//! Connections are made the way a new user makes them: rdma-rpc's `Channel::builder` with its
//! defaults (the provider named), tonic's `Endpoint::connect`, each its own HTTP/2 connection
//! (a tonic `Channel` from `connect` owns one connection; nothing is shared between them).
//! Everything runs on one current-thread tokio runtime; rdma-rpc channels add what they add
//! (their poller threads), which the reply reports as this process's thread count.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use rpc_core::verbs::ProviderKind;
use serde::{Deserialize, Serialize};

use crate::measure;
use crate::proto::EchoRequest;

/// Payload of every call, bytes.
pub const CALL_SIZE: usize = 32;
/// How long one connect plus first call may take before it counts as failed.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);
/// How long one call of the load phase may take.
const CALL_LIMIT: Duration = Duration::from_secs(10);

/// The two systems measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionSystem {
    /// rdma-rpc.
    Rpc,
    /// tonic (gRPC over HTTP/2 on loopback TCP).
    Tonic,
}

impl SessionSystem {
    /// The name in tables and plots.
    pub fn name(self) -> &'static str {
        match self {
            SessionSystem::Rpc => "rdma-rpc",
            SessionSystem::Tonic => "tonic",
        }
    }
}

/// Arguments of `rpc-bench sessions-client`.
#[derive(Clone, Debug, clap::Args)]
pub struct SessionClientArgs {
    /// Which system's client.
    #[arg(long, value_enum)]
    pub system: SessionSystem,
    /// The server's data address.
    #[arg(long)]
    pub addr: SocketAddr,
    /// RDMA provider (rdma-rpc).
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// Exit after this many seconds whatever happens.
    #[arg(long, default_value_t = 600)]
    pub max_secs: u64,
    /// Exit when the parent process dies.
    #[arg(long)]
    pub die_with_parent: bool,
    /// rdma-rpc channels' poller (the builder's default: the process's poller thread).
    #[arg(long, value_enum, default_value = "thread")]
    pub poller: SessionPoller,
    /// Run on these cores only (comma-separated; default: wherever the scheduler puts it).
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<usize>,
}

/// Who drives an rdma-rpc channel's completions (`ClientPoller`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionPoller {
    /// The process's poller thread, shared by its channels (`ClientPoller::Thread`, the
    /// default).
    Thread,
    /// The calling task drives the connection (`ClientPoller::Caller`): no thread per channel.
    Caller,
}

impl SessionPoller {
    /// The name on the command line and in the table's heading.
    pub fn name(self) -> &'static str {
        match self {
            SessionPoller::Thread => "thread",
            SessionPoller::Caller => "caller",
        }
    }
}

/// A latency histogram as (nanoseconds, count) pairs of its non-empty buckets.
pub type Buckets = Vec<(u64, u64)>;

/// The answer to `OPEN`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OpenReply {
    /// Connections opened (connected and answered the first call).
    pub opened: u64,
    /// Attempts that failed.
    pub failed: u64,
    /// Connections not attempted: the time limit passed, or `give up` failures in a row.
    pub skipped: u64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Connect + first call of each opened connection.
    pub hist: Buckets,
    /// Connections this process holds now.
    pub held: u64,
    /// This process's resident memory (VmRSS), KiB, and thread count, after opening.
    pub rss_kib: u64,
    /// Threads of this process after opening.
    pub threads: u64,
    /// Descriptors this process holds after opening.
    pub fds: u64,
    /// Memory this process has pinned after opening, KiB (see `ProcStatus::pinned_kib`).
    pub pinned_kib: u64,
    /// This process's resident memory and descriptors before its first connection (its
    /// runtime built): what its connections cost is the difference.
    pub base_rss_kib: u64,
    /// See `base_rss_kib`.
    pub base_fds: u64,
    /// See `base_rss_kib`.
    pub base_pinned_kib: u64,
    /// Whether the figures above were read (a process out of descriptors cannot open
    /// `/proc` to read them).
    pub measured: bool,
}

/// The answer to `LOAD`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoadReply {
    /// Connections that made calls.
    pub active: u64,
    /// Calls that succeeded.
    pub calls: u64,
    /// Calls that failed.
    pub errors: u64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// How long the phase ran, ns.
    pub wall_ns: u64,
    /// Latency of the successful calls.
    pub hist: Buckets,
}

/// One open connection.
#[derive(Clone)]
enum Conn {
    Rpc(crate::proto::bench_client::BenchClient),
    Tonic(crate::proto::bench_tonic::bench_client::BenchClient<tonic::transport::Channel>),
}

/// Runs the client process until `QUIT` or the end of its input.
///
/// # Errors
/// When the runtime cannot be built or the coordinator's pipe breaks.
pub fn run(args: &SessionClientArgs) -> Result<()> {
    if args.die_with_parent && !crate::sys::die_with_parent() {
        bail!("parent process already gone");
    }
    crate::control::watchdog(Duration::from_secs(args.max_secs), "sessions-client");
    if !args.cores.is_empty() && !crate::sys::pin_current_thread(&args.cores) {
        eprintln!(
            "rpc-bench sessions-client: could not pin to {:?}",
            args.cores
        );
    }
    let provider: ProviderKind = args.provider.parse()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut conns: Vec<Conn> = Vec::new();
    let base = crate::sessions::ProcStatus::read(std::process::id());
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<u64> {
            words
                .get(i)
                .and_then(|w| w.parse().ok())
                .ok_or_else(|| anyhow!("bad command {line:?}"))
        };
        let reply = match words.first().copied() {
            Some("OPEN") => {
                let (n, limit, give_up) = (num(1)?, num(2)?, num(3)?);
                let mut r = rt.block_on(open(
                    args,
                    provider,
                    &mut conns,
                    n,
                    Duration::from_millis(limit),
                    give_up,
                ));
                match base {
                    Some(b) => {
                        (r.base_rss_kib, r.base_fds, r.base_pinned_kib) =
                            (b.vm_rss_kib, b.fds, b.pinned_kib);
                    }
                    None => r.measured = false,
                }
                serde_json::to_string(&r)?
            }
            Some("LOAD") => {
                let (active, ms) = (num(1)?, num(2)?);
                let active = usize::try_from(active)?.min(conns.len());
                let r = rt.block_on(load(&conns[..active], Duration::from_millis(ms)));
                serde_json::to_string(&r)?
            }
            Some("QUIT") => break,
            _ => bail!("unknown command {line:?}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    // The connections go with the process; nothing to wait for.
    std::process::exit(0)
}

async fn open(
    args: &SessionClientArgs,
    provider: ProviderKind,
    conns: &mut Vec<Conn>,
    n: u64,
    limit: Duration,
    give_up: u64,
) -> OpenReply {
    let start = Instant::now();
    let mut hist = measure::histogram();
    let mut r = OpenReply::default();
    let mut in_a_row = 0;
    for i in 0..n {
        if start.elapsed() >= limit || (give_up > 0 && in_a_row >= give_up) {
            r.skipped = n - i;
            break;
        }
        let t0 = Instant::now();
        let attempt = tokio::time::timeout(CONNECT_LIMIT, connect_and_call(args, provider)).await;
        let attempt = attempt.unwrap_or_else(|_| {
            Err(anyhow!(
                "connect + first call took longer than {CONNECT_LIMIT:?}"
            ))
        });
        match attempt {
            Ok(c) => {
                measure::record(&mut hist, t0.elapsed());
                conns.push(c);
                r.opened += 1;
                in_a_row = 0;
            }
            Err(e) => {
                r.failed += 1;
                in_a_row += 1;
                if r.first_error.is_none() {
                    r.first_error = Some(format!(
                        "attempt {} of a client process holding {}: {e:#}",
                        i + 1,
                        conns.len()
                    ));
                }
            }
        }
    }
    r.hist = buckets(&hist);
    r.held = conns.len() as u64;
    if let Some(s) = crate::sessions::ProcStatus::read(std::process::id()) {
        r.rss_kib = s.vm_rss_kib;
        r.fds = s.fds;
        r.pinned_kib = s.pinned_kib;
        r.measured = true;
        r.threads = s.threads;
    }
    r
}

async fn connect_and_call(args: &SessionClientArgs, provider: ProviderKind) -> Result<Conn> {
    let conn = match args.system {
        SessionSystem::Rpc => {
            let poller = match args.poller {
                SessionPoller::Thread => rpc_core::ClientPoller::Thread,
                SessionPoller::Caller => rpc_core::ClientPoller::Caller,
            };
            let ch = rpc_core::Channel::builder(args.addr.to_string())
                .provider(provider)
                .poller(poller)
                .connect_timeout(CONNECT_LIMIT)
                .connect()
                .await
                .context("rdma-rpc: connect")?;
            Conn::Rpc(crate::proto::bench_client::BenchClient::new(ch))
        }
        SessionSystem::Tonic => {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", args.addr))?
                .tcp_nodelay(true)
                .connect_timeout(CONNECT_LIMIT)
                .connect()
                .await
                .context("tonic: connect")?;
            Conn::Tonic(crate::proto::bench_tonic::bench_client::BenchClient::new(
                ch,
            ))
        }
    };
    call(&conn, client_payload()).await?;
    Ok(conn)
}

fn client_payload() -> Bytes {
    crate::client::payload(CALL_SIZE)
}

/// One 32 B echo on `conn`, checked.
async fn call(conn: &Conn, payload: Bytes) -> Result<()> {
    let req = EchoRequest {
        payload,
        reply_size: 0,
    };
    let got = match conn {
        Conn::Rpc(c) => {
            let mut r = rpc_core::Request::new(req);
            r.set_timeout(CALL_LIMIT);
            c.echo(r)
                .await
                .map_err(|s| anyhow!("rdma-rpc: first call: {s}"))?
                .get_ref()
                .payload
                .len()
        }
        Conn::Tonic(c) => {
            let mut r = tonic::Request::new(req);
            r.set_timeout(CALL_LIMIT);
            c.clone()
                .echo(r)
                .await
                .map_err(|s| anyhow!("tonic: first call: {s}"))?
                .get_ref()
                .payload
                .len()
        }
    };
    if got != CALL_SIZE {
        bail!("echo of {CALL_SIZE} bytes came back with {got}");
    }
    Ok(())
}

/// Each of `conns` makes calls in a loop, one outstanding, for `secs`; all on this thread.
async fn load(conns: &[Conn], secs: Duration) -> LoadReply {
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for c in conns {
        let c = c.clone();
        set.spawn(async move {
            let mut hist = measure::histogram();
            let (mut calls, mut errors, mut first) = (0u64, 0u64, None);
            let payload = client_payload();
            while start.elapsed() < secs {
                let t0 = Instant::now();
                match call(&c, payload.clone()).await {
                    Ok(()) => {
                        measure::record(&mut hist, t0.elapsed());
                        calls += 1;
                    }
                    Err(e) => {
                        errors += 1;
                        first.get_or_insert_with(|| format!("{e:#}"));
                        // A broken connection stays broken: do not spin on it.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (hist, calls, errors, first)
        });
    }
    let mut hist = measure::histogram();
    let mut r = LoadReply {
        active: conns.len() as u64,
        ..LoadReply::default()
    };
    while let Some(done) = set.join_next().await {
        match done {
            Ok((h, calls, errors, first)) => {
                let _ = hist.add(&h);
                r.calls += calls;
                r.errors += errors;
                if r.first_error.is_none() {
                    r.first_error = first;
                }
            }
            Err(e) => {
                r.errors += 1;
                r.first_error
                    .get_or_insert_with(|| format!("load task: {e}"));
            }
        }
    }
    r.wall_ns = start.elapsed().as_nanos() as u64;
    r.hist = buckets(&hist);
    r
}

/// The non-empty buckets of `h`.
pub fn buckets(h: &Histogram<u64>) -> Buckets {
    h.iter_recorded()
        .map(|v| (v.value_iterated_to(), v.count_at_value()))
        .collect()
}

/// A histogram from the buckets of one or more processes.
pub fn merge<'a>(parts: impl IntoIterator<Item = &'a Buckets>) -> Histogram<u64> {
    let mut h = measure::histogram();
    for part in parts {
        for &(v, n) in part {
            let _ = h.record_n(v.clamp(1, 600_000_000_000), n);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_merge_back_to_the_same_quantiles() {
        let mut a = measure::histogram();
        let mut b = measure::histogram();
        for i in 1..=1000u64 {
            a.record(i * 1000).unwrap();
            b.record(i * 3000).unwrap();
        }
        let m = merge([&buckets(&a), &buckets(&b)]);
        assert_eq!(m.len(), 2000);
        let mut both = a.clone();
        both.add(&b).unwrap();
        for q in [0.5, 0.99] {
            let (got, want) = (m.value_at_quantile(q), both.value_at_quantile(q));
            assert!(got.abs_diff(want) <= want / 500, "q {q}: {got} vs {want}");
        }
    }
}
