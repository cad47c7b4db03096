//! The client core under stress (issue 13, item 7): async back-pressure that awaits instead of
//! sleeping the runtime's thread, calls alternating between two channels as fast as calls on
//! one, and the pipeline with a thread poller on a loaded machine. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rpc_core::{Channel, ClientPoller, Request, Status};

// ----- helpers -------------------------------------------------------------------------------

/// Busy threads that keep every core of a small machine loaded until dropped (bounded: they
/// stop after `limit` in any case).
struct Spinners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    fn start(n: usize, limit: Duration) -> Spinners {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let t = Instant::now();
                    while !stop.load(Ordering::Relaxed) && t.elapsed() < limit {
                        for _ in 0..1000 {
                            std::hint::spin_loop();
                        }
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn small_blob(seq: u64) -> Blob {
    Blob {
        seq,
        data: pattern(32, seq),
    }
}

async fn echo(ch: &Channel, seq: u64) {
    let mut req = Request::new(small_blob(seq));
    req.set_timeout(Duration::from_secs(30));
    let r: rpc_core::Response<Blob> = within(CALL_LIMIT, "echo", ch.unary(&lab_server::ECHO, req))
        .await
        .unwrap_or_else(|e| panic!("echo {seq}: {e:?}"));
    check_blob(r.get_ref(), seq, 32, "echo");
}

/// The tests of this binary take turns: one of them loads the machine on purpose, and the
/// others measure or time what they see.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fewest threads of other processes found runnable (`procs_running` of /proc/stat less
/// this process's running threads) in samples over `over`: busy threads beside this test are
/// runnable in every sample, passing ones are not. As many as the cores means they hold them.
fn runnable_elsewhere(over: Duration) -> u64 {
    let running_here = || {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return 0;
        };
        tasks
            .filter_map(|t| t.ok())
            .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
            .filter(|st| {
                st.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('R'))
            })
            .count() as u64
    };
    let start = Instant::now();
    let mut fewest = u64::MAX;
    while start.elapsed() < over {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let n = stat
            .lines()
            .find_map(|l| l.strip_prefix("procs_running "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        fewest = fewest.min(n.saturating_sub(running_here().max(1)));
        std::thread::sleep(Duration::from_millis(5));
    }
    if fewest == u64::MAX { 0 } else { fewest }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

// ----- 1. calls alternating between two channels ---------------------------------------------

/// One process, two servers, two channels with the default poller: async unary calls that
/// alternate between the channels take about as long as calls on one channel alone. Bound on
/// the ratio of the medians (the best of several rounds), not on time.
// Each test has a runtime of its own: the turn is held across awaits on purpose.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_channels_alternating_as_fast_as_one() {
    let _turn = serial();
    // Probed before this test's own spinning threads start (see the end).
    let busy = runnable_elsewhere(Duration::from_millis(200));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let a = TestServer::start().await;
    let b = TestServer::start().await;
    let cha = a.channel(ClientPoller::Thread).await;
    let chb = b.channel(ClientPoller::Thread).await;
    const N: usize = 300;
    const ROUNDS: usize = 5;
    let mut one = Duration::MAX;
    let mut two = Duration::MAX;
    let mut seq = 0u64;
    // Warm both up.
    for _ in 0..50 {
        echo(&cha, seq).await;
        echo(&chb, seq).await;
        seq += 1;
    }
    for _ in 0..ROUNDS {
        let mut lat = Vec::with_capacity(N);
        for _ in 0..N {
            let t = Instant::now();
            echo(&cha, seq).await;
            lat.push(t.elapsed());
            seq += 1;
        }
        one = one.min(median(&mut lat));
        lat.clear();
        for i in 0..N {
            let ch = if i % 2 == 0 { &cha } else { &chb };
            let t = Instant::now();
            echo(ch, seq).await;
            lat.push(t.elapsed());
            seq += 1;
        }
        two = two.min(median(&mut lat));
    }
    let ratio = two.as_secs_f64() / one.as_secs_f64();
    eprintln!(
        "p50 one channel {one:?}, alternating between two {two:?}: ratio {ratio:.2} \
         ({busy} threads runnable beside the test on {cores} cores)"
    );
    // Two servers' shards and two pollers spin: with busy threads holding the cores each call
    // on the other connection waits for a time slice of the scheduler, and that is what the
    // ratio would measure (polling that yields on shared hosts is another issue's work).
    // Judged only where the test has the machine's cores to itself.
    if busy >= cores {
        eprintln!("machine loaded ({busy} runnable threads elsewhere): ratio not judged");
        return;
    }
    assert!(
        ratio <= 5.0,
        "alternating between two channels: p50 {two:?} against {one:?} on one (x{ratio:.1})"
    );
    a.settle("a: live calls back to 0").await;
    b.settle("b: live calls back to 0").await;
}

// ----- 2. async back-pressure ----------------------------------------------------------------

/// Many async calls on a current-thread runtime over a connection with two send slots and
/// a server with four receive slots (two credits): most calls find every send slot taken
/// while the server's handlers sleep. They all complete, and a ticker task on the same
/// runtime keeps ticking meanwhile (a call that slept its thread would stop it).
fn back_pressure_case(mode: ClientPoller) {
    let _turn = serial();
    let g = rpc_core::Geometry {
        slot_size: 1024,
        send_slots: 2,
        recv_slots: 4,
    };
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let srv = server_rt.block_on(TestServer::start_with(|b| b.geometry(g)));
    let addr = srv.addr();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let ch = within(
            Duration::from_secs(20),
            "connect",
            Channel::builder(addr)
                .geometry(g)
                .poller(mode)
                .max_concurrent_calls(64)
                .connect(),
        )
        .await
        .unwrap();
        const CALLS: u64 = 48;
        const SLEEP_MS: u64 = 400;
        // A regression stops the ticker in every round; a scheduler that takes the runtime's
        // thread away (a machine loaded far past its cores) in one round rarely does in three.
        for round in 1..=3 {
            let ticks = Arc::new(AtomicU64::new(0));
            let max_gap = Arc::new(AtomicU64::new(0));
            let done = Arc::new(AtomicBool::new(false));
            let ticker = {
                let (ticks, max_gap, done) = (ticks.clone(), max_gap.clone(), done.clone());
                tokio::spawn(async move {
                    let mut last = Instant::now();
                    let start = last;
                    while !done.load(Ordering::Acquire) && start.elapsed() < CALL_LIMIT {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        let now = Instant::now();
                        let gap = now.duration_since(last).as_micros() as u64;
                        max_gap.fetch_max(gap, Ordering::AcqRel);
                        ticks.fetch_add(1, Ordering::AcqRel);
                        last = now;
                    }
                })
            };
            let t = Instant::now();
            let calls: Vec<_> = (0..CALLS)
                .map(|seq| {
                    let ch = ch.clone();
                    tokio::spawn(async move {
                        let mut req = Request::new(SleepRequest {
                            seq,
                            ms: SLEEP_MS,
                            reply_len: 16,
                            pad: bytes::Bytes::new(),
                        });
                        req.set_timeout(Duration::from_secs(50));
                        let r: rpc_core::Response<Blob> = ch
                            .unary(&lab_server::SLEEP, req)
                            .await
                            .unwrap_or_else(|e| panic!("{mode:?}: sleep call {seq}: {e:?}"));
                        check_blob(r.get_ref(), seq, 16, "sleep reply");
                    })
                })
                .collect();
            for c in calls {
                within(CALL_LIMIT, "back-pressured call", c).await.unwrap();
            }
            let took = t.elapsed();
            done.store(true, Ordering::Release);
            within(Duration::from_secs(5), "ticker", ticker)
                .await
                .unwrap();
            let gap = Duration::from_micros(max_gap.load(Ordering::Acquire));
            let n = ticks.load(Ordering::Acquire);
            eprintln!(
                "{mode:?}: {CALLS} calls in {took:?}; ticker: {n} ticks, longest gap {gap:?}"
            );
            let ok = gap < Duration::from_millis(SLEEP_MS / 4) && n >= 10;
            if ok || round == 3 {
                // The handlers sleep at a time: a call sleeping the runtime's only thread while
                // it waits for a send slot stops the ticker for a good part of that (measured
                // before the fix, with 150 ms handlers: 31-83 ms with the thread poller; after:
                // 3-11 ms quiet, up to 22 ms with two busy threads beside the test).
                assert!(
                    gap < Duration::from_millis(SLEEP_MS / 4),
                    "{mode:?}: the ticker stood still for {gap:?} while calls were back-pressured"
                );
                assert!(
                    n >= 10,
                    "{mode:?}: the ticker ticked only {n} times in {took:?}"
                );
                break;
            }
            eprintln!("{mode:?}: round {round} inconclusive (gap {gap:?}, {n} ticks): again");
        }
    });
    server_rt.block_on(srv.settle("live calls back to 0"));
}

#[test]
fn async_back_pressure_awaits_thread_poller() {
    back_pressure_case(ClientPoller::Thread);
}

#[test]
fn async_back_pressure_awaits_caller_poller() {
    back_pressure_case(ClientPoller::Caller);
}

// ----- 3. the pipeline with a thread poller under load ---------------------------------------

/// `rpc_calls::pipeline_thread_poller` with two busy threads in the process (a loaded
/// machine: the poller thread is preempted at any point, also between its last poll of the
/// CQ and the arming of the completion channel).
// Each test has a runtime of its own: the turn is held across awaits on purpose.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_thread_poller_under_load() {
    let _turn = serial();
    let srv = TestServer::start().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    let _load = Spinners::start(2, Duration::from_secs(200));
    // A hang detector, not a speed test: with more runnable threads than cores every hand-off
    // at depth 1 may wait a scheduler time slice (milliseconds), so the count stays modest.
    let n = if in_vm() { 100 } else { 400 };
    for depth in [1, 32, 100] {
        let ch = ch.clone();
        let t = Instant::now();
        blocking(CALL_LIMIT, "pipeline under load", move || {
            pipeline_run(&ch, n, depth)
        })
        .await;
        eprintln!("depth {depth}: {n} calls in {:?}", t.elapsed());
    }
    srv.settle("pipeline: live calls back to 0").await;
}

// ----- 4. a lone async call drives its own connection ---------------------------------------

/// The process's only async call on a thread-polled channel drives the connection from its
/// own task: every such call either got its answer that way or, its answer slow, handed the
/// connection to the poller thread and was woken by it (`Channel::async_drives`). A slow call
/// completes after the hand-over, a call dropped while it drives leaves the connection usable,
/// and concurrent calls (company) leave the driving to the poller thread.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_async_call_drives_its_connection() {
    let _turn = serial();
    let srv = TestServer::start().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    echo(&ch, 0).await;
    let (d0, h0) = ch.async_drives();
    const N: u64 = 200;
    for seq in 1..=N {
        echo(&ch, seq).await;
    }
    let (d1, h1) = ch.async_drives();
    assert_eq!(
        (d1 - d0) + (h1 - h0),
        N,
        "every lone call is driven by its task or handed over: {d0}/{h0} -> {d1}/{h1}"
    );

    // A slow answer (20 ms): the call hands the connection over and the poller thread
    // completes it.
    let sleep = |seq: u64, ms: u64| {
        let mut req = Request::new(SleepRequest {
            seq,
            ms,
            reply_len: 16,
            pad: Default::default(),
        });
        req.set_timeout(Duration::from_secs(30));
        ch.unary::<_, Blob>(&lab_server::SLEEP, req)
    };
    let r = within(CALL_LIMIT, "slow call", sleep(1, 20))
        .await
        .expect("a slow lone call completes");
    check_blob(r.get_ref(), 1, 16, "slow call");
    let (d2, h2) = ch.async_drives();
    assert_eq!((d2, h2), (d1, h1 + 1), "the slow call was handed over");

    // Dropped while it drives (or waits): the connection stays usable.
    let dropped = tokio::time::timeout(Duration::from_millis(5), sleep(2, 50)).await;
    assert!(dropped.is_err(), "the 50 ms call outlived its 5 ms wait");
    echo(&ch, N + 1).await;

    // Two calls at once: the second is not alone, so neither counter moves for it.
    let (d3, h3) = ch.async_drives();
    let (a, b) = tokio::join!(sleep(3, 10), sleep(4, 10));
    check_blob(a.expect("call 3").get_ref(), 3, 16, "call 3");
    check_blob(b.expect("call 4").get_ref(), 4, 16, "call 4");
    let (d4, h4) = ch.async_drives();
    assert_eq!(
        (d4 - d3) + (h4 - h3),
        1,
        "only the first of two concurrent calls drives"
    );
    srv.settle("live calls back to 0").await;
}

// ----- 5. a handler's call does not busy-wait on the shard's thread -------------------------

/// Relays an echo to a backend channel (a frontend handler calling a backend).
#[rpc_derive::service(package = "relay")]
pub trait Relay {
    /// Echoes the request through the backend.
    async fn relay(&self, request: Blob) -> Result<Blob, Status>;
}

struct RelaySvc {
    backend: Channel,
}

impl Relay for RelaySvc {
    async fn relay(&self, request: Blob) -> Result<Blob, Status> {
        let r: rpc_core::Response<Blob> = self
            .backend
            .unary(&lab_server::ECHO, Request::new(request))
            .await?;
        Ok(r.into_inner())
    }
}

/// A handler runs on its server shard's thread: the backend call it awaits, although the
/// process's only async call in flight, leaves the driving to the poller thread (driving it
/// there would keep the shard's other connections waiting). Every relayed call completes.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_call_leaves_the_shard_thread_free() {
    let _turn = serial();
    let backend_srv = TestServer::start().await;
    let backend = backend_srv.channel(ClientPoller::Thread).await;
    let front = rpc_core::Server::builder()
        .add_service(relay_server::RelayServer::new(RelaySvc {
            backend: backend.clone(),
        }))
        .bind("127.0.0.1:0")
        .await
        .expect("frontend binds");
    let client = relay_client::RelayClient::connect(front.local_addr().to_string())
        .await
        .expect("connects to the frontend");
    // Blocking calls from the test: no async call of this process but the handler's is in
    // flight, so that one is alone.
    let blocking = relay_client::RelayBlockingClient::from(client);
    tokio::task::spawn_blocking(move || {
        for seq in 0..50u64 {
            let r = blocking
                .relay(small_blob(seq))
                .unwrap_or_else(|e| panic!("relay {seq}: {e:?}"));
            check_blob(&r.into_inner(), seq, 32, "relay");
        }
    })
    .await
    .expect("relayed calls");
    assert_eq!(
        backend.async_drives(),
        (0, 0),
        "the handler's backend calls were driven by the poller thread"
    );
    backend_srv.settle("backend: live calls back to 0").await;
}
