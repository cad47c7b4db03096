//! A peer process killed mid-call: the test binary re-executes itself as a child server or
//! client (`RPC_TEST_CHILD`), the test SIGKILLs it while calls are in flight, and the other
//! side must fail or free everything, within deadlines and without hanging.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::proc::{ChildProc, child_role, exit_with_parent, report};
use common::*;
use rpc_core::{Channel, ClientPoller, Code, Request, Response, Status};

const ENTRY: &str = "child_process_entry";
const ADDR_ENV: &str = "RPC_TEST_SERVER_ADDR";
/// Calls the child client keeps in flight in handlers that never finish on their own.
const CHILD_SLEEPERS: u64 = 4;

/// Not a test: the body of the child processes of the tests below (they run it with
/// `--ignored --exact`).
#[test]
#[ignore = "entry point of the child processes of this binary's tests"]
fn child_process_entry() {
    let Some(role) = child_role() else {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    };
    exit_with_parent(Duration::from_secs(180));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    match role.as_str() {
        "server" => rt.block_on(child_server()),
        "client" => rt.block_on(child_client()),
        other => panic!("unknown child role {other}"),
    }
}

/// Serves `lab.Lab` and reports its address, then the number of `sleep` handlers started
/// whenever it changes.
async fn child_server() {
    let srv = TestServer::start().await;
    report("addr", srv.addr());
    let mut last = u64::MAX;
    loop {
        let n = srv.state.started.load(Ordering::Acquire);
        if n != last {
            report("started", n);
            last = n;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Connects to the parent's server, keeps calls in flight there (handlers that wait, with
/// rendezvous requests and landing zones lent) and large echoes moving, until killed.
async fn child_client() {
    let addr = std::env::var(ADDR_ENV).expect("server address");
    let ch = Channel::builder(addr)
        .connect()
        .await
        .expect("child connects");
    for k in 0..CHILD_SLEEPERS {
        let ch = ch.clone();
        tokio::spawn(async move {
            let mut req = Request::new(SleepRequest {
                seq: k,
                ms: 120_000,
                reply_len: if k % 2 == 1 { 300_000 } else { 0 },
                pad: if k.is_multiple_of(2) {
                    pattern(300_000, k)
                } else {
                    Bytes::new()
                },
            });
            if k % 2 == 1 {
                req.set_response_size_hint(300_016);
            }
            let _ = ch.unary::<_, Blob>(&lab_server::SLEEP, req).await;
        });
    }
    for t in 0..2u64 {
        let ch = ch.clone();
        tokio::spawn(async move {
            for i in 0u64.. {
                let seq = 1_000 + i;
                let mut req = Request::new(Blob {
                    seq,
                    data: pattern(1 << 20, seq),
                });
                if (i + t).is_multiple_of(2) {
                    req.set_response_size_hint(1 << 20 | 64);
                }
                let _ = ch.unary::<_, Blob>(&lab_server::ECHO, req).await;
            }
        });
    }
    report("calling", CHILD_SLEEPERS);
    std::future::pending::<()>().await;
}

fn small(seq: u64) -> Request<Blob> {
    Request::new(Blob {
        seq,
        data: pattern(64, seq),
    })
}

// ----- 9. the server process dies ------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_process_killed_mid_call() {
    init_logs();
    let mut child = ChildProc::spawn(ENTRY, "server", &[]);
    let addr = child.expect("addr", Duration::from_secs(60));
    let ch = within(
        Duration::from_secs(20),
        "connect",
        Channel::builder(&addr).connect(),
    )
    .await
    .unwrap();
    let caller = within(
        Duration::from_secs(20),
        "connect",
        Channel::builder(&addr)
            .poller(ClientPoller::Caller)
            .connect(),
    )
    .await
    .unwrap();
    let r: Response<Blob> = call(&ch, Api::Async, &lab_server::ECHO, small(1))
        .await
        .unwrap();
    check_blob(r.get_ref(), 1, 64, "before the kill");

    // Calls in flight: waiting handlers (plain, rendezvous request, landing zone), on both
    // poller modes, async and blocking.
    let deadline = Duration::from_secs(20);
    let sleeper = move |k: u64| {
        let mut req = Request::new(SleepRequest {
            seq: k,
            ms: 60_000,
            reply_len: if k % 3 == 2 { 200_000 } else { 0 },
            pad: if k % 3 == 1 {
                pattern(200_000, k)
            } else {
                Bytes::new()
            },
        });
        if k % 3 == 2 {
            req.set_response_size_hint(200_016);
        }
        req.set_timeout(deadline);
        req
    };
    let mut inflight = Vec::new();
    for k in 0..6u64 {
        let ch = if k < 4 { ch.clone() } else { caller.clone() };
        inflight.push(tokio::spawn(async move {
            let r: Result<Response<Blob>, Status> = ch.unary(&lab_server::SLEEP, sleeper(k)).await;
            (format!("async call {k}"), r, Instant::now())
        }));
    }
    for k in 6..8u64 {
        let ch = if k == 6 { ch.clone() } else { caller.clone() };
        inflight.push(tokio::task::spawn_blocking(move || {
            let r: Result<Response<Blob>, Status> =
                ch.unary_blocking(&lab_server::SLEEP, sleeper(k));
            (format!("blocking call {k}"), r, Instant::now())
        }));
    }
    let start = Instant::now();
    while child.expect("started", Duration::from_secs(30)) != "8" {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "8 handlers started"
        );
    }
    child.kill();
    let killed = Instant::now();
    for t in inflight {
        let (what, r, at) = within(deadline + Duration::from_secs(10), "in-flight call", t)
            .await
            .unwrap();
        assert_code(&r, Code::Unavailable, &what);
        let after = at.saturating_duration_since(killed);
        assert!(
            after < deadline,
            "{what}: failed {after:?} after the kill, its deadline was {deadline:?}"
        );
    }
    wait_until(Duration::from_secs(10), "channels see the loss", || {
        !ch.is_connected() && !caller.is_connected()
    })
    .await;
    // Later calls fail cleanly (no server to reconnect to), and do not hang.
    for (label, c) in [("thread poller", &ch), ("caller poller", &caller)] {
        let t0 = Instant::now();
        let r: Result<Response<Blob>, Status> =
            call(c, Api::Async, &lab_server::ECHO, small(2)).await;
        assert_code(
            &r,
            Code::Unavailable,
            &format!("{label}: async call after the kill"),
        );
        let r: Result<Response<Blob>, Status> =
            call(c, Api::Blocking, &lab_server::ECHO, small(3)).await;
        assert_code(
            &r,
            Code::Unavailable,
            &format!("{label}: blocking call after the kill"),
        );
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{label}: took {:?}",
            t0.elapsed()
        );
    }
}

// ----- 10. a client process dies -------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_process_killed_mid_call() {
    let srv = TestServer::start().await;
    let other = srv.channel(ClientPoller::Thread).await;
    let mut child = ChildProc::spawn(ENTRY, "client", &[(ADDR_ENV, srv.addr())]);
    child.expect("calling", Duration::from_secs(60));
    let state = Arc::clone(&srv.state);
    wait_until(
        Duration::from_secs(30),
        "the child's handlers started",
        || state.started.load(Ordering::Acquire) == CHILD_SLEEPERS,
    )
    .await;
    // Let the child's large echoes run for a moment, with this process's client busy too.
    let echo = |seq: u64, n: usize| {
        let other = other.clone();
        async move {
            let mut req = Request::new(Blob {
                seq,
                data: pattern(n, seq),
            });
            if seq.is_multiple_of(2) {
                req.set_response_size_hint(n + 16);
            }
            let r: Response<Blob> = call(&other, Api::Async, &lab_server::ECHO, req)
                .await
                .unwrap_or_else(|e| panic!("the other client's call {seq}: {e:?}"));
            check_blob(r.get_ref(), seq, n, "the other client");
        }
    };
    for seq in 1..20u64 {
        echo(seq, 256 << 10).await;
    }
    assert!(
        state.calls.load(Ordering::Acquire) > CHILD_SLEEPERS + 19,
        "the child's echoes run"
    );
    child.kill();
    // The server drops the dead client's handlers and calls.
    wait_until(
        Duration::from_secs(20),
        "the dead client's handlers are dropped",
        || state.sleeping() == 0,
    )
    .await;
    assert_eq!(
        state.dropped.load(Ordering::Acquire),
        CHILD_SLEEPERS,
        "each waiting handler dropped once"
    );
    srv.settle("live calls back to 0 after the client died")
        .await;
    // The other client never noticed.
    assert!(other.is_connected());
    for seq in 20..40u64 {
        echo(seq, if seq.is_multiple_of(3) { 1 << 20 } else { 100 }).await;
    }
    // And the server takes new clients.
    let fresh = srv.channel(ClientPoller::Caller).await;
    let r: Response<Blob> = call(&fresh, Api::Blocking, &lab_server::ECHO, small(50))
        .await
        .unwrap();
    check_blob(r.get_ref(), 50, 64, "a new client");
    srv.settle("live calls back to 0").await;
}
