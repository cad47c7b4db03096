//! Calls on a shared host: busy threads (unpinned, more than there are cores) spin beside the
//! server and the client, so the shards, the poller thread and the callers that drive their
//! own connection are preempted and must notice it (`rpc_core::ShardPolling`, "On a shared
//! host"). Every call must complete, with its own payload, within a bound; nothing is asserted
//! about speed. Runs on `RPC_PROVIDER` (soft by default).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rpc_core::{ClientPoller, Request, Response, ShardPolling};

/// The longest a test's calls may take together, busy threads and all.
const LIMIT: Duration = Duration::from_secs(120);

/// Busy threads that spin until dropped (or [`LIMIT`] passes, whichever comes first).
struct Busy {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    /// One more busy thread than there are cores, at least two.
    fn start() -> Busy {
        let n = std::thread::available_parallelism().map_or(2, |n| n.get() + 1);
        let stop = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + LIMIT;
        let threads = (0..n.max(2))
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        for _ in 0..1000 {
                            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                        }
                    }
                })
            })
            .collect();
        Busy { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `n` blocking echoes of small and eager-sized payloads from each of `threads` threads on one
/// channel of `mode` (several threads on one `Caller` channel: one may sleep holding the
/// driver while the others submit).
async fn blocking_callers(srv: &TestServer, mode: ClientPoller, threads: u64, n: u64) {
    let ch = srv.channel(mode).await;
    let joined = blocking(LIMIT, "blocking callers beside busy threads", move || {
        let callers: Vec<_> = (0..threads)
            .map(|t| {
                let ch = ch.clone();
                std::thread::spawn(move || {
                    for i in 0..n {
                        let seq = t * 1_000_000 + i;
                        let len = if i % 16 == 0 { EAGER_MAX - 64 } else { 32 };
                        let mut req = Request::new(Blob {
                            seq,
                            data: pattern(len, seq),
                        });
                        req.set_timeout(CALL_LIMIT);
                        let r: Response<Blob> = ch
                            .unary_blocking(&lab_server::ECHO, req)
                            .unwrap_or_else(|e| panic!("blocking call {seq}: {e:?}"));
                        check_blob(r.get_ref(), seq, len, "blocking echo");
                    }
                })
            })
            .collect();
        callers
            .into_iter()
            .map(|t| t.join().is_ok())
            .collect::<Vec<_>>()
    })
    .await;
    assert!(joined.iter().all(|ok| *ok), "a blocking caller failed");
}

async fn async_calls(srv: &TestServer, mode: ClientPoller, n: u64) {
    let ch = srv.channel(mode).await;
    for seq in 0..n {
        let mut req = Request::new(Blob {
            seq,
            data: pattern(100, seq),
        });
        req.set_timeout(CALL_LIMIT);
        let r: Response<Blob> = within(CALL_LIMIT, "async echo", ch.unary(&lab_server::ECHO, req))
            .await
            .unwrap_or_else(|e| panic!("async call {seq}: {e:?}"));
        check_blob(r.get_ref(), seq, 100, "async echo");
    }
}

async fn pipelined(srv: &TestServer, mode: ClientPoller, n: u64, depth: usize) {
    let ch = srv.channel(mode).await;
    blocking(LIMIT, "pipeline beside busy threads", move || {
        pipeline_run(&ch, n, depth);
    })
    .await;
}

async fn every_kind_of_call(poll: ShardPolling) {
    let srv = TestServer::start_with(|b| b.shards(1).poll_mode(poll)).await;
    let _busy = Busy::start();
    let started = Instant::now();
    blocking_callers(&srv, ClientPoller::Caller, 1, 400).await;
    blocking_callers(&srv, ClientPoller::Caller, 3, 150).await;
    blocking_callers(&srv, ClientPoller::Thread, 2, 150).await;
    pipelined(&srv, ClientPoller::Caller, 300, 8).await;
    pipelined(&srv, ClientPoller::Thread, 200, 16).await;
    async_calls(&srv, ClientPoller::Thread, 200).await;
    async_calls(&srv, ClientPoller::Caller, 200).await;
    assert!(
        started.elapsed() < LIMIT,
        "calls beside busy threads: too slow to be bounded"
    );
    srv.settle("live calls back to 0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_complete_beside_busy_threads_busy_shard() {
    every_kind_of_call(ShardPolling::Busy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_complete_beside_busy_threads_adaptive_shard() {
    every_kind_of_call(ShardPolling::Adaptive).await;
}

/// The host gets quiet again: calls made after the busy threads stopped complete too (the
/// loops that backed off return to spinning; nothing stays asleep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_complete_after_the_busy_threads_stop() {
    let srv = TestServer::start_with(|b| b.shards(1).poll_mode(ShardPolling::Busy)).await;
    {
        let _busy = Busy::start();
        blocking_callers(&srv, ClientPoller::Caller, 2, 200).await;
    }
    blocking_callers(&srv, ClientPoller::Caller, 2, 200).await;
    pipelined(&srv, ClientPoller::Caller, 200, 8).await;
    srv.settle("live calls back to 0").await;
}
