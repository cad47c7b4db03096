//! Retries that never run a handler twice by surprise: calls that provably reached no handler
//! (a draining replica's refusals, connect failures) move on, calls that may have run are
//! retried only for idempotent methods and retryable codes, the request's timeout bounds the
//! attempts, and a single-address channel backs off its reconnects. Server-side counters say
//! how often each handler ran. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// The lab harness (`common`) and the interop service (for a server-streaming method) each
// include the remote-host helpers, `common/remote.rs`.
#![allow(clippy::duplicate_mod)]

mod common;
mod interop_service;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{
    Blob, FailRequest, SleepRequest, TestServer, lab_server, pattern, wait_until, within,
};
use rpc_core::{
    Channel, ClientPoller, Code, Idempotency, MethodDesc, NOT_EXECUTED_KEY, Request, RetryPolicy,
    Status,
};

const LIMIT: Duration = Duration::from_secs(60);

/// The lab's methods as a client that knows they are idempotent sees them (idempotency is
/// the client's knowledge: the path and id are the same).
const ECHO_IDEM: MethodDesc = lab_server::ECHO.with_idempotency(Idempotency::Idempotent);
const SLEEP_IDEM: MethodDesc = lab_server::SLEEP.with_idempotency(Idempotency::Idempotent);
const FAIL_IDEM: MethodDesc = lab_server::FAIL.with_idempotency(Idempotency::NoSideEffects);

fn quick_policy() -> RetryPolicy {
    RetryPolicy::new()
        .max_attempts(3)
        .initial_backoff(Duration::from_millis(10))
        .max_backoff(Duration::from_millis(50))
        .jitter(0.0)
}

fn blob(seq: u64) -> Request<Blob> {
    Request::new(Blob {
        seq,
        data: pattern(16, seq),
    })
}

fn sleeper(seq: u64, ms: u64) -> Request<SleepRequest> {
    let mut req = Request::new(SleepRequest {
        seq,
        ms,
        reply_len: 32,
        pad: bytes::Bytes::new(),
    });
    req.set_timeout(Duration::from_secs(30));
    req
}

fn failing(code: Code) -> Request<FailRequest> {
    Request::new(FailRequest {
        code: code as u32,
        message: format!("{} on purpose", code.name()),
        trailer_key: String::new(),
        trailer_value: Vec::new(),
    })
}

fn calls(s: &TestServer) -> u64 {
    s.state.calls.load(Ordering::Acquire)
}

fn started(s: &TestServer) -> u64 {
    s.state.started.load(Ordering::Acquire)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replicas_calls_move_on_and_every_handler_runs_once() {
    const TASKS: u64 = 6;
    const PER_TASK: u64 = 150;
    let a = TestServer::start().await;
    let b = TestServer::start().await;
    let ch = Channel::balance_list([a.addr(), b.addr()]);
    let stop_at = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for k in 0..TASKS {
        let ch = ch.clone();
        let stop_at = Arc::clone(&stop_at);
        tasks.push(tokio::spawn(async move {
            let mut failed = Vec::new();
            for i in 0..PER_TASK {
                let seq = k * PER_TASK + i;
                // The calls keep going while `a` drains: some reach it after its GoAway.
                match ch.unary::<_, Blob>(&lab_server::ECHO, blob(seq)).await {
                    Ok(r) => assert_eq!(r.get_ref().seq, seq),
                    Err(st) => failed.push((seq, st)),
                }
                if i == PER_TASK / 3 {
                    stop_at.fetch_add(1, Ordering::AcqRel);
                }
            }
            failed
        }));
    }
    wait_until(LIMIT, "a third of the calls done", || {
        stop_at.load(Ordering::Acquire) >= TASKS / 2
    })
    .await;
    let TestServer {
        server,
        state: a_state,
    } = a;
    within(LIMIT, "shutdown", server.shutdown()).await;
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(within(LIMIT, "callers", t).await.unwrap());
    }
    assert!(failed.is_empty(), "calls failed: {failed:?}");
    // Each call ran exactly once, on one replica or the other: never twice.
    for seq in 0..TASKS * PER_TASK {
        let ran = a_state.seen[seq as usize].load(Ordering::Acquire)
            + b.state.seen[seq as usize].load(Ordering::Acquire);
        assert_eq!(ran, 1, "call {seq} ran {ran} times");
    }
    assert!(calls(&b) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_are_retried_on_another_replica_and_after_the_back_off() {
    // A replica that refuses connections (nothing listens) beside a live one: no call fails.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let live = TestServer::start().await;
    let ch = Channel::balance_list([dead.clone(), live.addr()]);
    for seq in 0..40 {
        within(
            LIMIT,
            "echo",
            ch.unary::<_, Blob>(&lab_server::ECHO, blob(seq)),
        )
        .await
        .unwrap_or_else(|st| panic!("call {seq}: {st:?}"));
    }
    assert_eq!(calls(&live), 40);

    // A single-address channel whose server went away and comes back on the same port: a
    // call made during the outage waits (its policy allows) for the next connect attempt.
    let srv = TestServer::start().await;
    let addr = srv.addr();
    let ch = srv.channel(ClientPoller::Thread).await;
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
    wait_until(LIMIT, "the channel sees the loss", || !ch.is_connected()).await;
    let st = within(
        LIMIT,
        "call in the outage",
        ch.unary::<_, Blob>(&lab_server::ECHO, blob(1)),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.is_not_executed(), "a failed connect ran nothing: {st:?}");
    // Without a policy, a call in the back-off window fails at once, saying when the next
    // attempt is.
    let st = within(
        LIMIT,
        "call in the window",
        ch.unary::<_, Blob>(&lab_server::ECHO, blob(2)),
    )
    .await
    .unwrap_err();
    assert!(
        st.message().contains("next attempt") && st.is_not_executed(),
        "{st:?}"
    );
    let back = TestServer::bind_with(&addr, |b| b).await;
    let patient = ch.with_retry_policy(
        RetryPolicy::new()
            .max_attempts(5)
            .initial_backoff(Duration::from_millis(20)),
    );
    let mut req = blob(3);
    req.set_timeout(Duration::from_secs(30));
    let r = within(
        LIMIT,
        "call after the outage",
        patient.unary::<_, Blob>(&lab_server::ECHO, req),
    )
    .await
    .unwrap_or_else(|st| panic!("the retried call failed: {st:?}"));
    assert_eq!(r.get_ref().seq, 3);
    assert_eq!(calls(&back), 1);
}

/// Starts `req` on `ch` (a balanced channel over `servers`), waits until a `sleep` handler
/// runs on one of them, and shuts that one down with its short grace period: the request was
/// posted and ran, and its connection dies under it. Returns the call's result and the index
/// of the server that went away.
async fn lose_the_connection_under(
    ch: &Channel,
    method: &'static MethodDesc,
    req: Request<SleepRequest>,
    servers: &mut [Option<TestServer>],
) -> (Result<rpc_core::Response<Blob>, Status>, usize) {
    let call = {
        let ch = ch.clone();
        tokio::spawn(async move { ch.unary::<_, Blob>(method, req).await })
    };
    let states: Vec<_> = servers
        .iter()
        .map(|s| Arc::clone(&s.as_ref().unwrap().state))
        .collect();
    wait_until(LIMIT, "the handler started", || {
        states.iter().any(|s| s.started.load(Ordering::Acquire) > 0)
    })
    .await;
    let i = states
        .iter()
        .position(|s| s.started.load(Ordering::Acquire) > 0)
        .unwrap();
    let gone = servers[i].take().unwrap();
    within(LIMIT, "shutdown", gone.server.shutdown()).await;
    (within(LIMIT, "call", call).await.unwrap(), i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_lost_after_it_was_sent_is_retried_only_if_idempotent() {
    let grace = |b: rpc_core::ServerBuilder| b.shutdown_grace(Duration::from_millis(200));
    let policy = RetryPolicy::new()
        .max_attempts(3)
        .initial_backoff(Duration::from_millis(10));

    // Not idempotent: fails, and ran once (on the server that went away), never elsewhere.
    let mut servers = vec![
        Some(TestServer::start_with(grace).await),
        Some(TestServer::start_with(grace).await),
    ];
    let addrs: Vec<String> = servers.iter().map(|s| s.as_ref().unwrap().addr()).collect();
    let ch = Channel::balance_list(addrs).with_retry_policy(policy);
    let (r, gone) =
        lose_the_connection_under(&ch, &lab_server::SLEEP, sleeper(1, 5_000), &mut servers).await;
    let st = r.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(!st.is_not_executed(), "it was sent: {st:?}");
    let other = servers[1 - gone].as_ref().unwrap();
    assert_eq!(
        started(other),
        0,
        "a call that may have run is not sent again"
    );

    // Idempotent: the same loss, then the retry runs on the other replica and succeeds.
    let mut servers = vec![
        Some(TestServer::start_with(grace).await),
        Some(TestServer::start_with(grace).await),
    ];
    let addrs: Vec<String> = servers.iter().map(|s| s.as_ref().unwrap().addr()).collect();
    let ch = Channel::balance_list(addrs).with_retry_policy(policy);
    let (r, gone) =
        lose_the_connection_under(&ch, &SLEEP_IDEM, sleeper(2, 1_500), &mut servers).await;
    let resp = r.unwrap_or_else(|st| panic!("the idempotent call was not retried: {st:?}"));
    assert_eq!(resp.get_ref().seq, 2);
    let other = servers[1 - gone].as_ref().unwrap();
    assert_eq!(started(other), 1, "retried once, elsewhere");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_codes_and_attempts_are_respected() {
    let srv = TestServer::start().await;
    let ch = srv
        .channel(ClientPoller::Thread)
        .await
        .with_retry_policy(quick_policy())
        .with_stats();
    let mut ran = 0;
    let mut expect = |what: &str, runs: u64| {
        ran += runs;
        assert_eq!(calls(&srv), ran, "{what}");
    };

    // Idempotent and UNAVAILABLE: every attempt runs, then the last status.
    let st = ch
        .unary::<_, Blob>(&FAIL_IDEM, failing(Code::Unavailable))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(st.message().contains("on purpose"), "{st:?}");
    expect("three attempts", 3);
    // The channel's statistics count the call once and its two retries.
    let s = ch.stats();
    assert_eq!(s.transport.retries, 2, "{s}");
    let m = s.method(FAIL_IDEM.path).unwrap();
    assert_eq!((m.started, m.count(Code::Unavailable)), (1, 1), "{s}");
    // Not a retryable code: once.
    let st = ch
        .unary::<_, Blob>(&FAIL_IDEM, failing(Code::Internal))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Internal);
    expect("INTERNAL is not retried", 1);
    // Not idempotent: once.
    let st = ch
        .unary::<_, Blob>(&lab_server::FAIL, failing(Code::Unavailable))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    expect("a plain method is not retried", 1);
    // Other codes by choice.
    let aborted = ch.with_retry_policy(
        quick_policy()
            .max_attempts(2)
            .retryable_codes(&[Code::Aborted]),
    );
    let st = aborted
        .unary::<_, Blob>(&FAIL_IDEM, failing(Code::Aborted))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Aborted);
    expect("ABORTED retried by choice", 2);
    // No policy: nothing that may have run is retried.
    let plain = srv.channel(ClientPoller::Thread).await;
    let _ = plain
        .unary::<_, Blob>(&FAIL_IDEM, failing(Code::Unavailable))
        .await
        .unwrap_err();
    expect("no policy", 1);

    // A handler cannot forge the not-executed trailer (it ran): the server strips it.
    let mut forged = failing(Code::Unavailable);
    forged.get_mut().trailer_key = NOT_EXECUTED_KEY.into();
    forged.get_mut().trailer_value = b"1".to_vec();
    let st = ch
        .unary::<_, Blob>(&lab_server::FAIL, forged)
        .await
        .unwrap_err();
    assert!(!st.is_not_executed(), "{st:?}");
    assert!(st.metadata().get(NOT_EXECUTED_KEY).is_none(), "{st:?}");
    expect("a forged trailer is not a reason to retry", 1);

    // Blocking calls retry the same way.
    let bch = ch.clone();
    let st = common::blocking(LIMIT, "blocking", move || {
        bch.unary_blocking::<_, Blob>(&FAIL_IDEM, failing(Code::Unavailable))
            .unwrap_err()
    })
    .await;
    assert_eq!(st.code(), Code::Unavailable);
    expect("blocking: three attempts", 3);
    let r = common::blocking(LIMIT, "blocking echo", {
        let ch = ch.clone();
        move || ch.unary_blocking::<_, Blob>(&ECHO_IDEM, blob(7))
    })
    .await
    .unwrap();
    assert_eq!(r.get_ref().seq, 7);
    expect("a success is not retried", 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_bounds_the_attempts() {
    let srv = TestServer::start().await;
    let policy = RetryPolicy::new()
        .max_attempts(5)
        .initial_backoff(Duration::from_millis(700))
        .backoff_multiplier(1.0)
        .jitter(0.0);
    let ch = srv
        .channel(ClientPoller::Thread)
        .await
        .with_retry_policy(policy);
    let mut req = failing(Code::Unavailable);
    req.set_timeout(Duration::from_millis(1_200));
    let start = Instant::now();
    let st = within(LIMIT, "call", ch.unary::<_, Blob>(&FAIL_IDEM, req))
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert_eq!(
        st.code(),
        Code::Unavailable,
        "the last attempt's status: {st:?}"
    );
    // 0 ms: fails; 700 ms: fails; a third attempt would start at 1400 ms, past the deadline,
    // so it is not made (the call returns at once, not at the deadline).
    assert_eq!(calls(&srv), 2, "took {took:?}");
    assert!(took >= Duration::from_millis(700), "{took:?}");
    assert!(took < Duration::from_millis(1_200), "{took:?}");

    // A retried attempt gets only what is left of the timeout: the server sees less.
    let mut req = sleeper(1, 10_000);
    req.set_timeout(Duration::from_millis(400));
    let start = Instant::now();
    let st = within(LIMIT, "sleep", ch.unary::<_, Blob>(&SLEEP_IDEM, req))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::DeadlineExceeded, "{st:?}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(started(&srv), 1, "DEADLINE_EXCEEDED is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconnect_back_off_costs_one_connect_per_window_not_one_per_call() {
    const CALLS: u64 = 60;
    let srv = TestServer::start().await;
    let addr = srv.addr();
    let ch = srv.channel(ClientPoller::Thread).await;
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
    wait_until(LIMIT, "the channel sees the loss", || !ch.is_connected()).await;
    // A plain TCP listener on the server's port: it counts connect attempts and closes each
    // (the handshake fails).
    let listener = tokio::net::TcpListener::bind(&addr).await.unwrap();
    let accepts = Arc::new(AtomicU64::new(0));
    let counter = {
        let accepts = Arc::clone(&accepts);
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                accepts.fetch_add(1, Ordering::AcqRel);
                drop(s);
            }
        })
    };
    // A burst of calls from several tasks: they fail, and dial once, not once each.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..4 {
        let ch = ch.clone();
        tasks.push(tokio::spawn(async move {
            let mut fast = 0u64;
            for i in 0..CALLS / 4 {
                let st = ch
                    .unary::<_, Blob>(&lab_server::ECHO, blob(k * 100 + i))
                    .await
                    .unwrap_err();
                assert_eq!(st.code(), Code::Unavailable, "{st:?}");
                assert!(st.is_not_executed(), "{st:?}");
                if st.message().contains("next attempt") {
                    fast += 1;
                }
            }
            fast
        }));
    }
    let mut fast = 0;
    for t in tasks {
        fast += within(LIMIT, "burst", t).await.unwrap();
    }
    let took = start.elapsed();
    let dialled = accepts.load(Ordering::Acquire);
    // The first back-off is 200 ms (±20%): one attempt per window that passed.
    let windows = 1 + (took.as_millis() / 160) as u64;
    assert!(
        dialled >= 1 && dialled <= windows,
        "{CALLS} calls in {took:?} dialled {dialled} times"
    );
    assert_eq!(fast, CALLS, "every call names the next attempt");
    // After the window, the next call dials again (once).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = accepts.load(Ordering::Acquire);
    let _ = ch.unary::<_, Blob>(&lab_server::ECHO, blob(999)).await;
    wait_until(LIMIT, "the next attempt", || {
        accepts.load(Ordering::Acquire) > before
    })
    .await;
    counter.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stream_is_retried_only_before_its_first_message() {
    use interop_service::{EchoStatus, StreamingOutputCallRequest, StreamingOutputCallResponse};
    const OUT: MethodDesc = interop_service::test_service_server::STREAMING_OUTPUT_CALL;
    const OUT_IDEM: MethodDesc = OUT.with_idempotency(Idempotency::NoSideEffects);
    let (server, probes) = interop_service::bind("127.0.0.1:0").await;
    let ch = within(
        LIMIT,
        "connect",
        Channel::builder(server.local_addr().to_string()).connect(),
    )
    .await
    .unwrap()
    .with_retry_policy(quick_policy());
    let req = |messages: &[usize]| {
        Request::new(StreamingOutputCallRequest {
            response_parameters: interop_service::sizes(messages),
            payload: None,
            response_status: Some(EchoStatus {
                code: Code::Unavailable as i32,
                message: "down on purpose".into(),
            }),
        })
    };
    // UNAVAILABLE before any message: every attempt runs, then the last status.
    let st = within(
        LIMIT,
        "stream",
        ch.server_streaming::<_, StreamingOutputCallResponse>(&OUT_IDEM, req(&[])),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(probes.started(), 3);
    // Not declared idempotent: once.
    let st = within(
        LIMIT,
        "stream",
        ch.server_streaming::<_, StreamingOutputCallResponse>(&OUT, req(&[])),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(probes.started(), 4);
    // After a message the stream is the caller's: its error is not retried.
    let mut s = within(
        LIMIT,
        "stream",
        ch.server_streaming::<_, StreamingOutputCallResponse>(&OUT_IDEM, req(&[8])),
    )
    .await
    .unwrap()
    .into_inner();
    assert!(
        within(LIMIT, "message", s.message())
            .await
            .unwrap()
            .is_some()
    );
    let st = within(LIMIT, "end", s.message()).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(probes.started(), 5);
    within(LIMIT, "shutdown", server.shutdown()).await;
}
