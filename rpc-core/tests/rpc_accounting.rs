//! Counted, not guessed: heap allocations per call in steady state (a counting global
//! allocator over the whole process: the calling thread, the client's poller, the server's
//! shard), and the payload bytes the soft RNICs copy per call (`process_counters`).
//!
//! The tests of this binary run one at a time (they count process-wide). With
//! `RPC_ALLOC_TRACE=1` every counted allocation prints a backtrace (the first 20).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use rpc_core::verbs::ProviderKind;
use rpc_core::{Channel, ClientPoller, Request, Response};

// ----- the counting allocator ----------------------------------------------------------------

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);
static TRACED: AtomicU32 = AtomicU32::new(0);

/// Count only the threads that set `HERE` ([`counted_here`]).
static ONLY_HERE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while this thread prints a backtrace (whose own allocations are not counted).
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
    /// This thread's allocations count under [`counted_here`].
    static HERE: Cell<bool> = const { Cell::new(false) };
}

fn note(size: usize) {
    if !COUNTING.load(Ordering::Relaxed) {
        return;
    }
    // `try_with`: the thread-local may be gone while a thread exits.
    if IN_TRACE.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    if ONLY_HERE.load(Ordering::Relaxed) && !HERE.try_with(Cell::get).unwrap_or(false) {
        return;
    }
    // The test harness's own thread (it prints "has been running for over 60 seconds" on slow
    // machines) is not ours. Looking it up runs with `IN_TRACE` set so it cannot recurse.
    let _ = IN_TRACE.try_with(|t| t.set(true));
    let harness = std::thread::current().name() == Some("main");
    let _ = IN_TRACE.try_with(|t| t.set(false));
    if harness {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    LARGEST.fetch_max(size, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) && TRACED.fetch_add(1, Ordering::Relaxed) < 20 {
        let _ = IN_TRACE.try_with(|t| t.set(true));
        let bt = std::backtrace::Backtrace::force_capture();
        let thread = std::thread::current();
        eprintln!(
            "allocation of {size} bytes on thread {:?}:\n{bt}",
            thread.name()
        );
        let _ = IN_TRACE.try_with(|t| t.set(false));
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees are ours; the bookkeeping only touches atomics and a const-initialised
// thread-local `Cell` (neither allocates), except backtrace printing, which runs with the
// thread's `IN_TRACE` flag set so that its own allocations do not recurse into it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: same contract as ours (`layout` has a non-zero size, our caller's duty).
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (every allocation here does).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr`/`layout` came from `System`; `new_size` as our caller gave it.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Counts the allocations `f` makes (every thread of the process); returns them and the
/// largest one.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64, usize) {
    TRACE.store(
        std::env::var_os("RPC_ALLOC_TRACE").is_some(),
        Ordering::Relaxed,
    );
    TRACED.store(0, Ordering::Relaxed);
    ALLOCS.store(0, Ordering::Relaxed);
    LARGEST.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::SeqCst);
    let r = f();
    COUNTING.store(false, Ordering::SeqCst);
    (
        r,
        ALLOCS.load(Ordering::Relaxed),
        LARGEST.load(Ordering::Relaxed),
    )
}

/// As [`counted`], counting this thread's allocations only (a call's own path, while the
/// server in the same process does what it likes).
fn counted_here<T>(f: impl FnOnce() -> T) -> (T, u64, usize) {
    HERE.with(|h| h.set(true));
    ONLY_HERE.store(true, Ordering::SeqCst);
    let r = counted(f);
    ONLY_HERE.store(false, Ordering::SeqCst);
    HERE.with(|h| h.set(false));
    r
}

/// Aborts the process (failing the test run) if a test outlives its budget: some calls here
/// carry no deadline on purpose, and a bug must not hang CI.
///
/// Its thread has started and waits before `arm` returns, and waits without allocating: a
/// thread the scheduler starts late on a loaded host makes its first allocations (its start,
/// and the context of a first blocking `mpsc` receive: 48 B) whenever it first runs, which
/// was once inside a counting window (3 allocations, the largest 64 B).
struct Watchdog {
    disarmed: std::sync::Arc<AtomicBool>,
    thread: std::thread::Thread,
}

impl Watchdog {
    fn arm(what: &'static str, limit: Duration) -> Watchdog {
        let disarmed = std::sync::Arc::new(AtomicBool::new(false));
        let started = std::sync::Arc::new(std::sync::Barrier::new(2));
        let (d, s) = (
            std::sync::Arc::clone(&disarmed),
            std::sync::Arc::clone(&started),
        );
        let handle = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + limit;
            std::thread::park_timeout(Duration::ZERO);
            s.wait();
            while !d.load(Ordering::Acquire) {
                let now = std::time::Instant::now();
                if now >= deadline {
                    eprintln!("{what}: no result within {limit:?} (hang): aborting");
                    std::process::abort();
                }
                std::thread::park_timeout(deadline - now);
            }
        });
        started.wait();
        Watchdog {
            disarmed,
            thread: handle.thread().clone(),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.disarmed.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// The tests of this binary count process-wide: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A two-worker runtime whose workers have both run a task before it is returned: a worker
/// the scheduler starts late on a loaded host would make its first allocations whenever it
/// first runs, perhaps inside a counting window (see [`Watchdog`]).
fn runtime() -> tokio::runtime::Runtime {
    const WORKERS: usize = 2;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
        .unwrap();
    // Each task blocks its worker until the other task runs too, so they run on different
    // workers (the tests' watchdogs end a hang).
    let both = std::sync::Arc::new(std::sync::Barrier::new(WORKERS));
    rt.block_on(async {
        let tasks: Vec<_> = (0..WORKERS)
            .map(|_| {
                let b = std::sync::Arc::clone(&both);
                tokio::spawn(async move {
                    b.wait();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    rt
}

// ----- 11. zero allocations per small call ---------------------------------------------------

const WARMUP: u64 = 1_000;
/// Calls counted per variant (fewer in the Soft-RoCE VM, where the guest is emulated).
/// Call it once before counting starts: the first call reads the environment.
fn calls() -> u64 {
    if common::in_vm() { 1_000 } else { 5_000 }
}

fn scalars(i: u64) -> Scalars {
    Scalars {
        a: i,
        b: i as u32,
        c: i as f64 * 0.5,
        d: i.is_multiple_of(2),
        e: -(i as i64),
    }
}

fn check_ping(i: u64, r: &Response<Scalars>) {
    let s = r.get_ref();
    assert_eq!(s.a, i.wrapping_add(1), "call {i}");
    assert_eq!(s.e, i as i64, "call {i}");
}

fn ping_request(i: u64, deadline: bool) -> Request<Scalars> {
    let mut req = Request::new(scalars(i));
    if deadline {
        req.set_timeout(Duration::from_secs(30));
    }
    req
}

/// A server and a caller-polled channel to it.
fn server_and_caller_channel(rt: &tokio::runtime::Runtime) -> (TestServer, Channel) {
    rt.block_on(async {
        let srv = TestServer::start().await;
        let ch = srv.channel(ClientPoller::Caller).await;
        (srv, ch)
    })
}

/// Blocking pings `from..from + n` through `ch`, checking each response.
fn ping_blocking(ch: &Channel, from: u64, n: u64, deadline: bool) {
    for i in from..from + n {
        let r = ch
            .unary_blocking(&lab_server::PING, ping_request(i, deadline))
            .unwrap();
        check_ping(i, &r);
    }
}

/// `unary_blocking` (the caller polls) against a handler that is ready at once, with and
/// without a deadline, and through a client interceptor that reads the metadata: after
/// warm-up, no allocation anywhere in the process.
#[test]
fn zero_allocations_per_blocking_call() {
    let _g = serial();
    let _w = Watchdog::arm(
        "zero_allocations_per_blocking_call",
        Duration::from_secs(600),
    );
    let rt = runtime();
    let (srv, ch) = server_and_caller_channel(&rt);
    let n = calls();
    let intercepted = ch.with_interceptor(|req: Request<()>| {
        if req.metadata().get("x-deny").is_some() {
            return Err(rpc_core::Status::permission_denied("denied"));
        }
        Ok(req)
    });
    for (deadline, ch) in [(false, &ch), (true, &ch), (false, &intercepted)] {
        let run = |from: u64, n: u64| ping_blocking(ch, from, n, deadline);
        let how = if std::ptr::eq(ch, &intercepted) {
            "intercepted"
        } else {
            "plain"
        };
        run(0, WARMUP);
        let ((), allocs, largest) = counted(|| run(WARMUP, n));
        println!(
            "blocking calls (caller polls), deadline {deadline}, {how}: {allocs} allocations \
             in {} calls (largest {largest} B)",
            n
        );
        assert_eq!(
            allocs, 0,
            "blocking calls, deadline {deadline}, {how}: {allocs} heap allocations in {} calls \
             (RPC_ALLOC_TRACE=1 shows where)",
            n
        );
    }
    rt.block_on(srv.settle("live calls back to 0"));
}

/// A blocking caller whose answer takes a while sleeps (it spins a little, then waits on its
/// connection's descriptors): its thread allocates nothing for that either. (A caller-polled
/// connection makes its doorbell when a caller first sleeps; it once did in an `Arc`, one
/// allocation in the first call that slept, which the Soft-RoCE VM's runs caught now and then.)
#[test]
fn zero_allocations_in_a_blocking_call_that_sleeps() {
    let _g = serial();
    let _w = Watchdog::arm(
        "zero_allocations_in_a_blocking_call_that_sleeps",
        Duration::from_secs(600),
    );
    let rt = runtime();
    let (srv, ch) = server_and_caller_channel(&rt);
    let slow = |seq: u64| {
        let req = Request::new(SleepRequest {
            seq,
            ms: 20,
            ..SleepRequest::default()
        });
        let r = ch
            .unary_blocking::<_, Blob>(&lab_server::SLEEP, req)
            .unwrap();
        assert_eq!(r.get_ref().seq, seq);
    };
    // Warm up the call path with quick calls (which do not sleep on a quiet host), then
    // count slow ones on this thread with more busy threads than cores beside it: a caller
    // sleeps only once it sees it has no core to itself, and the first slow call that does
    // is the connection's first sleep.
    ping_blocking(&ch, 0, WARMUP, false);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let busy: Vec<_> = (0..=cores)
        .map(|_| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let ((), allocs, largest) = counted_here(|| (0..10).for_each(slow));
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
    assert_eq!(
        allocs, 0,
        "10 blocking calls that slept: {allocs} heap allocations on the caller's thread \
         (largest {largest} B; RPC_ALLOC_TRACE=1 shows where)"
    );
    rt.block_on(srv.settle("live calls back to 0"));
}

/// Pings `from..from + n` through `p`, `depth` in flight, checking each response.
fn pipelined_pings(p: &mut rpc_core::Pipeline<Scalars, Scalars>, from: u64, n: u64, depth: usize) {
    let (mut next, mut done) = (from, 0);
    while done < n {
        while next < from + n && p.in_flight() < depth {
            p.submit(next, ping_request(next, true)).unwrap();
            next += 1;
        }
        if let Some((tag, r)) = p.wait() {
            check_ping(tag, &r.unwrap());
            done += 1;
        }
    }
}

/// Pipelined calls (`Channel::pipeline`, 32 in flight from one thread), with the caller
/// driving the connection and with the poller thread: after warm-up, no allocation.
#[test]
fn zero_allocations_per_pipelined_call() {
    let _g = serial();
    let _w = Watchdog::arm(
        "zero_allocations_per_pipelined_call",
        Duration::from_secs(600),
    );
    let rt = runtime();
    let n = calls();
    // One server, both channels live throughout: tearing a channel or a server down (poller
    // thread, QPs, shard thread) runs in the background and would be counted in the next
    // mode's window (CI once counted one 32 B allocation there on a loaded machine).
    let srv = rt.block_on(TestServer::start());
    let channels: Vec<(ClientPoller, Channel)> = [ClientPoller::Caller, ClientPoller::Thread]
        .into_iter()
        .map(|mode| (mode, rt.block_on(srv.channel(mode))))
        .collect();
    for (mode, ch) in &channels {
        let mut p = ch.pipeline::<Scalars, Scalars>(&lab_server::PING).unwrap();
        let mut run = |from: u64, n: u64| pipelined_pings(&mut p, from, n, 32);
        run(0, WARMUP);
        let ((), allocs, largest) = counted(|| run(WARMUP, n));
        println!(
            "pipelined calls ({mode:?}): {allocs} allocations in {n} calls (largest {largest} B)"
        );
        assert_eq!(
            allocs, 0,
            "pipelined calls ({mode:?}): {allocs} heap allocations in {n} calls \
             (RPC_ALLOC_TRACE=1 shows where)"
        );
        drop(p);
        rt.block_on(srv.settle("live calls back to 0"));
    }
}

/// Async calls from a task, with the poller thread and with the caller polling.
#[test]
fn zero_allocations_per_async_call() {
    let _g = serial();
    let _w = Watchdog::arm("zero_allocations_per_async_call", Duration::from_secs(600));
    let rt = runtime();
    let srv = rt.block_on(TestServer::start());
    // Both channels live throughout: tearing one down (its poller thread, its QP on both
    // sides) runs in the background and would be counted.
    let channels: Vec<(ClientPoller, Channel)> = [ClientPoller::Thread, ClientPoller::Caller]
        .into_iter()
        .map(|mode| (mode, rt.block_on(srv.channel(mode))))
        .collect();
    let n = calls();
    for (mode, ch) in &channels {
        for deadline in [false, true] {
            let run = |from: u64, n: u64| {
                rt.block_on(async {
                    for i in from..from + n {
                        let r = ch
                            .unary(&lab_server::PING, ping_request(i, deadline))
                            .await
                            .unwrap();
                        check_ping(i, &r);
                    }
                })
            };
            run(0, WARMUP);
            let ((), allocs, largest) = counted(|| run(WARMUP, n));
            println!(
                "async calls ({mode:?} poller), deadline {deadline}: {allocs} allocations in \
                 {} calls (largest {largest} B)",
                n
            );
            assert_eq!(
                allocs, 0,
                "async calls ({mode:?} poller), deadline {deadline}: {allocs} heap \
                 allocations in {} calls (RPC_ALLOC_TRACE=1 shows where)",
                n
            );
        }
    }
    rt.block_on(srv.settle("live calls back to 0"));
}

// ----- 12. payload copies --------------------------------------------------------------------

/// Bytes of frame headers, descriptors and protocol frames (credit updates, bulk releases) a
/// call may add to its payload.
const PER_CALL_OVERHEAD: u64 = 512;

/// `k` async echoes of `request()`, each checked to come back with `n` data bytes.
fn echo_calls(
    rt: &tokio::runtime::Runtime,
    ch: &rpc_core::Channel,
    k: u64,
    n: usize,
    request: &dyn Fn() -> Request<Blob>,
) {
    rt.block_on(async {
        for _ in 0..k {
            let r: Response<Blob> = ch.unary(&lab_server::ECHO, request()).await.unwrap();
            assert_eq!(r.get_ref().data.len(), n);
        }
    });
}

/// A server and a channel (poller thread) for the tests that read the soft provider's byte
/// counters; `None` (the test is skipped, saying so) on another provider.
fn soft_counting_setup() -> Option<(tokio::runtime::Runtime, TestServer, rpc_core::Channel)> {
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        println!("skipped: byte counters exist on the soft provider only");
        return None;
    }
    let rt = runtime();
    let srv = rt.block_on(TestServer::start());
    let ch = rt.block_on(srv.channel(ClientPoller::Thread));
    Some((rt, srv, ch))
}

/// Echoes of N bytes whose request field lies in memory from `Channel::alloc_bytes`: the
/// client copies none of it (`zero_copy_request_bytes` grows by N per call), the soft RNICs
/// copy about 2N (the server's READ of the request and the response), and no heap
/// allocation as large as the payload happens. So the NIC's copies are the only ones of the
/// request (the response is zero-copy on the server with a landing zone, and decoded in
/// place on the client).
#[test]
fn registered_requests_are_copied_by_the_nic_only() {
    let _g = serial();
    let _w = Watchdog::arm(
        "registered_requests_are_copied_by_the_nic_only",
        Duration::from_secs(600),
    );
    let Some((rt, srv, ch)) = soft_counting_setup() else {
        return;
    };
    const K: u64 = 20;
    let mut failures = Vec::new();
    for (n, hint) in [
        (64 << 10, false),
        (64 << 10, true),
        (1 << 20, false),
        (1 << 20, true),
        (scaled(8 << 20), true),
    ] {
        let seq = n as u64;
        let region = rt.block_on(async {
            let mut b = ch.alloc_bytes(n).await.unwrap();
            b.copy_from_slice(&pattern(n, seq));
            b.freeze()
        });
        let request = || {
            let mut req = Request::new(Blob {
                seq,
                data: region.bytes(),
            });
            req.set_registered(&region);
            if hint {
                req.set_response_size_hint(n + 16);
            }
            req
        };
        let run = |k: u64| echo_calls(&rt, &ch, k, n, &request);
        run(3);
        let zc = ch.zero_copy_request_bytes();
        let before = settled_counters();
        let ((), allocs, largest) = counted(|| run(K));
        let after = settled_counters();
        let zero_copy = (ch.zero_copy_request_bytes() - zc) / K;
        let r: Response<Blob> = rt.block_on(ch.unary(&lab_server::ECHO, request())).unwrap();
        check_blob(r.get_ref(), seq, n, "registered echo");
        let copied = (after.bytes_copied - before.bytes_copied) / K;
        let two_n = 2 * n as u64;
        println!(
            "registered {n:>9} B, landing {hint:>5}: client copied {} B of the request, RNIC \
             copied {copied:>9} B per call = 2N + {:>4}, {:.1} allocations per call, largest \
             {largest} B",
            n as u64 - zero_copy,
            copied as i64 - two_n as i64,
            allocs as f64 / K as f64,
        );
        if zero_copy != n as u64 {
            failures.push(format!(
                "{n} B: {zero_copy} B per call sent without a copy, expected all {n}"
            ));
        }
        if copied < two_n || copied > two_n + PER_CALL_OVERHEAD {
            failures.push(format!(
                "{n} B: RNIC copied {copied} B per call, expected 2N = {two_n} plus at most \
                 {PER_CALL_OVERHEAD}"
            ));
        }
        if largest >= n {
            failures.push(format!(
                "{n} B: a heap allocation of {largest} B during the calls"
            ));
        }
    }
    rt.block_on(srv.settle("live calls back to 0"));
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Echoes whose request field of N bytes lies in ordinary memory, large enough to be sent
/// pending (`ChannelBuilder::pending_request_min`, 8 MiB by default): the request goes out
/// before the field is copied into registered memory, and the server READs it a part at a time
/// as the caller copies (about a sixteenth, at least 1 MiB, each announced by a BulkReady
/// frame; a driver that falls behind announces several at once). The channel counts the whole
/// request as overlapped, the soft RNICs still copy the payload once each way (about 2N), and
/// every byte arrives (the echo is checked). Below a threshold that was set nothing is
/// overlapped; with the default one, a request from 1 MiB up goes one way or the other
/// (whichever was faster), and its connection has tried both: its first such call copied
/// first, its second went pending.
#[test]
fn large_requests_in_ordinary_memory_are_read_while_copied() {
    let _g = serial();
    let _w = Watchdog::arm(
        "large_requests_in_ordinary_memory_are_read_while_copied",
        Duration::from_secs(600),
    );
    let Some((rt, srv, default)) = soft_counting_setup() else {
        return;
    };
    let with_min = |min: usize| {
        rt.block_on(async {
            srv.builder()
                .poller(ClientPoller::Thread)
                .pending_request_min(min)
                .connect()
                .await
                .unwrap()
        })
    };
    let early = with_min(512 << 10);
    let fixed = with_min(8 << 20);
    const K: u64 = 10;
    let mut failures = Vec::new();
    // Whether each call goes pending: always, never, or as the connection learned (None).
    for (ch, n, pending) in [
        (&early, (512 << 10) + 13, Some(true)),
        (&early, (3 << 20) + 7, Some(true)),
        (&fixed, (3 << 20) + 7, Some(false)),
        (&fixed, (8 << 20) + 13, Some(true)),
        (&default, (3 << 20) + 7, None),
        (&default, (8 << 20) + 13, Some(true)),
    ] {
        let seq = n as u64;
        let data = pattern(n, seq);
        let request = || {
            Request::new(Blob {
                seq,
                data: data.clone(),
            })
        };
        let first = ch.overlapped_request_bytes();
        echo_calls(&rt, ch, 3, n, &request);
        let before = settled_counters();
        let overlapped = ch.overlapped_request_bytes();
        echo_calls(&rt, ch, K, n, &request);
        let after = settled_counters();
        let overlapped = (ch.overlapped_request_bytes() - overlapped) / K;
        let r: Response<Blob> = rt.block_on(ch.unary(&lab_server::ECHO, request())).unwrap();
        check_blob(r.get_ref(), seq, n, "pending echo");
        // Learned: of the 3 + K + 1 calls, the first was copied and the second went pending.
        let total = ch.overlapped_request_bytes() - first;
        let calls = 3 + K + 1;
        if pending.is_none() && (total < n as u64 || total > (calls - 1) * (n as u64 + 16)) {
            failures.push(format!(
                "{n} B: {total} B of {calls} calls sent pending, expected one call at least \
                 and all but one at most"
            ));
        }
        let copied = (after.bytes_copied - before.bytes_copied) / K;
        let ops = (after.ops - before.ops) as f64 / K as f64;
        let two_n = 2 * n as u64;
        println!(
            "ordinary {n:>9} B: {overlapped} B overlapped, {ops:.1} work requests per call, \
             RNIC copied {copied} B = 2N + {}",
            copied as i64 - two_n as i64
        );
        // The whole encoded request (the field and a few bytes around it), or nothing.
        if pending == Some(false) && overlapped != 0 {
            failures.push(format!(
                "{n} B: {overlapped} B per call sent pending below the threshold"
            ));
        } else if pending == Some(true) && (overlapped < n as u64 || overlapped > n as u64 + 16) {
            failures.push(format!(
                "{n} B: {overlapped} B per call sent pending, expected the request's {n} + a few"
            ));
        }
        // At least the request, one READ and the response (a BulkReady made while the
        // request still waited in the send list joins its SEND).
        if pending == Some(true) && ops < 3.0 {
            failures.push(format!("{n} B: {ops:.1} work requests per call"));
        }
        if copied < two_n || copied > two_n + PER_CALL_OVERHEAD {
            failures.push(format!(
                "{n} B: RNIC copied {copied} B per call, expected 2N = {two_n} plus at most \
                 {PER_CALL_OVERHEAD}"
            ));
        }
    }
    rt.block_on(srv.settle("live calls back to 0"));
    assert!(failures.is_empty(), "{failures:#?}");
}

/// For echoes of N bytes (eager, rendezvous with the response READ, rendezvous with the
/// response written into a landing zone the caller asked for or the channel learned), the soft
/// RNICs of the process (client and server)
/// copy about 2N bytes per call: the request once and the response once, no other copy by
/// the NIC. And no heap allocation as large as the payload happens during a call: the
/// runtime stages no intermediate copy of it (encode into registered memory, zero-copy
/// decode).
#[test]
fn soft_rnic_copies_each_payload_once() {
    let _g = serial();
    let _w = Watchdog::arm(
        "soft_rnic_copies_each_payload_once",
        Duration::from_secs(600),
    );
    let Some((rt, srv, learning)) = soft_counting_setup() else {
        return;
    };
    // Responses READ every time: no zone unless asked for.
    let reading = rt
        .block_on(
            srv.builder()
                .poller(ClientPoller::Thread)
                .learn_response_sizes(false)
                .connect(),
        )
        .expect("connect");
    const K: u64 = 20;
    // Data lengths whose blob (sequence number = length) encodes to exactly the largest
    // eager message and one byte more.
    let encoding_to = |enc: usize| {
        (0..enc)
            .rev()
            .find(|&d| blob_len(d as u64, d) == enc)
            .expect("a length encoding to enc")
    };
    let (at_max, over_max) = (encoding_to(EAGER_MAX), encoding_to(EAGER_MAX + 1));
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
    enum Zone {
        /// No hint, learning off: the response is READ.
        Read,
        /// A size hint.
        Hinted,
        /// No hint: the channel lends what the method's last response needed.
        Learned,
    }
    let cases = [
        ("eager", 100usize, Zone::Read),
        ("eager", 4000, Zone::Read),
        ("eager max", at_max, Zone::Read),
        ("eager max + 1", over_max, Zone::Read),
        ("rendezvous, READ", EAGER_MAX + 100, Zone::Read),
        ("rendezvous, READ", 64 << 10, Zone::Read),
        ("rendezvous, READ", 1 << 20, Zone::Read),
        ("rendezvous, landing", 64 << 10, Zone::Hinted),
        ("rendezvous, landing", 1 << 20, Zone::Hinted),
        ("rendezvous, learned", 64 << 10, Zone::Learned),
        ("rendezvous, learned", 1 << 20, Zone::Learned),
        ("rendezvous, READ", scaled(8 << 20), Zone::Read),
        ("rendezvous, landing", scaled(8 << 20), Zone::Hinted),
        ("rendezvous, learned", scaled(8 << 20), Zone::Learned),
    ];
    let mut failures = Vec::new();
    let mut ops_of = std::collections::HashMap::new();
    for (label, n, zone) in cases {
        let hint = zone == Zone::Hinted;
        let ch = if zone == Zone::Learned {
            &learning
        } else {
            &reading
        };
        let seq = n as u64;
        let payload = pattern(n, seq);
        let request = || {
            let mut req = Request::new(Blob {
                seq,
                data: payload.clone(),
            });
            if hint {
                req.set_response_size_hint(n + 16);
            }
            req
        };
        let run = |k: u64| echo_calls(&rt, ch, k, n, &request);
        run(3);
        let before = settled_counters();
        let ((), _allocs, largest) = counted(|| run(K));
        let after = settled_counters();
        // Every byte still right after the counted calls.
        let r: Response<Blob> = rt.block_on(ch.unary(&lab_server::ECHO, request())).unwrap();
        check_blob(r.get_ref(), seq, n, label);
        let copied = (after.bytes_copied - before.bytes_copied) / K;
        let ops = (after.ops - before.ops) as f64 / K as f64;
        let two_n = 2 * n as u64;
        println!(
            "{label:>20} {n:>9} B: RNIC copied {copied:>9} B per call = 2N + {:>4} \
             (ratio {:.4}), {ops:.1} work requests per call, largest allocation {largest} B",
            copied as i64 - two_n as i64,
            copied as f64 / two_n as f64,
        );
        ops_of.insert((n, zone), ops);
        if copied < two_n || copied > two_n + PER_CALL_OVERHEAD {
            failures.push(format!(
                "{label} {n} B: {copied} B copied per call, expected 2N = {two_n} plus at \
                 most {PER_CALL_OVERHEAD}"
            ));
        }
        if n >= 4000 && largest >= n {
            failures.push(format!(
                "{label} {n} B: a heap allocation of {largest} B during the calls (a copy of \
                 the payload?)"
            ));
        }
    }
    // The threshold is where it should be: one encoded byte more turns both messages into
    // rendezvous transfers (READs and a release frame).
    if ops_of[&(at_max, Zone::Read)] >= ops_of[&(over_max, Zone::Read)] {
        failures.push(format!(
            "eager threshold: {} work requests at {EAGER_MAX} encoded bytes, {} at one more",
            ops_of[&(at_max, Zone::Read)],
            ops_of[&(over_max, Zone::Read)]
        ));
    }
    // The size hint really selects the landing-zone WRITE: no response READ, no release
    // frame; and a channel that learned the size does the same without the hint. Below
    // 512 KiB only: a larger request is sent pending, and how many BulkReady frames and READs
    // it takes depends on how the copy and the driver interleave.
    for n in [64 << 10] {
        let read = ops_of[&(n, Zone::Read)];
        for zone in [Zone::Hinted, Zone::Learned] {
            let landing = ops_of[&(n, zone)];
            if landing >= read {
                failures.push(format!(
                    "{n} B: {landing} work requests per call {zone:?}, {read} when READ"
                ));
            }
        }
    }
    rt.block_on(srv.settle("live calls back to 0"));
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Small pipelined calls (32 in flight, the caller driving the connection): the frames of a
/// poll-loop turn go to the QP as one list on both sides, coalesced into as few SENDs as fit,
/// so the soft RNIC executes fewer SENDs than frames and rings the peer's CQ fewer times than
/// it executes SENDs, and inline SENDs ask for a completion only every `SIGNAL_EVERY`-th
/// time.
#[test]
fn pipelined_calls_post_in_lists_and_signal_rarely() {
    let _g = serial();
    let _w = Watchdog::arm(
        "pipelined_calls_post_in_lists_and_signal_rarely",
        Duration::from_secs(600),
    );
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        println!("skipped: ring and completion counters exist on the soft provider only");
        return;
    }
    let rt = runtime();
    let srv = rt.block_on(TestServer::start());
    let ch = rt.block_on(srv.channel(ClientPoller::Caller));
    let mut p = ch.pipeline::<Scalars, Scalars>(&lab_server::PING).unwrap();
    let n = calls().max(2_000);
    pipelined_pings(&mut p, 0, WARMUP, 32);
    let before = settled_counters();
    pipelined_pings(&mut p, WARMUP, n, 32);
    let after = settled_counters();
    let ops = after.ops - before.ops;
    let rings = after.rings - before.rings;
    let cqes = after.send_cqes - before.send_cqes;
    println!(
        "{n} pipelined calls: {:.2} work requests, {:.2} rings, {:.3} send completions per call",
        ops as f64 / n as f64,
        rings as f64 / n as f64,
        cqes as f64 / n as f64,
    );
    // A request and a response per call, and a few credit updates, in fewer SENDs than
    // frames: the frames of a turn share SENDs (coalesced), so at most one per frame and,
    // with 32 in flight, far fewer.
    assert!(
        ops <= 2 * n + n / 4 && ops < n,
        "{ops} work requests for {n} calls (2 frames each)"
    );
    // Inline SENDs ask for one completion in SIGNAL_EVERY (16); a coalesced SEND beyond the
    // inline limit asks for its own (its send slots return with it). So at most one per
    // SEND, and work requests plus completions stay well below the 2 + 2/16 per call of one
    // inline SEND per frame.
    let one_per_frame = 2 * n + 2 * n / rpc_core::testing::SIGNAL_EVERY as u64;
    assert!(
        cqes <= ops + 4 && (ops + cqes) * 2 < one_per_frame,
        "{cqes} send completions for {ops} SENDs ({n} calls)"
    );
    // Lists: fewer rings than SENDs (one per list, and a busy pipeline makes lists).
    assert!(
        rings < ops,
        "{rings} rings for {ops} SENDs: nothing was posted as a list"
    );
    drop(p);
    rt.block_on(srv.settle("live calls back to 0"));
}

/// The process's soft RNIC counters once they stopped moving: an operation's bytes are added
/// by the RNIC thread that ran it, just after it published the peer's completion, so a caller
/// woken by that completion can read the counters a moment before the last add (under load,
/// one operation early or late).
fn settled_counters() -> rpc_core::verbs::soft::CounterSnapshot {
    let mut last = rpc_core::verbs::soft::process_counters();
    let mut still = 0;
    for _ in 0..400 {
        std::thread::sleep(Duration::from_millis(2));
        let now = rpc_core::verbs::soft::process_counters();
        if now.bytes_copied == last.bytes_copied && now.ops == last.ops {
            still += 1;
            if still == 3 {
                return now;
            }
        } else {
            still = 0;
        }
        last = now;
    }
    last
}
