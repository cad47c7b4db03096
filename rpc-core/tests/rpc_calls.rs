//! The RPC runtime through its public API: echo across the eager threshold and up to 64 MiB,
//! concurrency, deadlines, cancellation, status codes and metadata, message limits, server
//! restarts and the connection handshake. Runs on `RPC_PROVIDER` (soft by default).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use prost::Message;
use rpc_core::{Channel, Code, PollerMode, Request, Response, Status};

/// Serializes the calls of 16 MiB and more across the tests of this binary (memory).
static BIG: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const BIG_CALL: usize = 16 << 20;

// ----- 1. echo across sizes ------------------------------------------------------------------

/// Payload sizes of the echo matrix: (label, blob). Around the threshold the sizes are of the
/// encoded message (the eager limit counts encoded bytes); the others are data bytes.
fn echo_cases() -> Vec<(String, Blob)> {
    let mut v = Vec::new();
    let mut seq = 1u64;
    let mut add = |label: String, b: Blob| {
        v.push((label, b));
    };
    for n in [0usize, 1, 100] {
        add(format!("{n} B"), Blob { seq, data: pattern(n, seq) });
        seq += 1;
    }
    for (label, enc) in [
        ("eager max - 1", EAGER_MAX - 1),
        ("eager max", EAGER_MAX),
        ("eager max + 1", EAGER_MAX + 1),
    ] {
        let b = blob_of_encoded_len(seq, enc);
        assert_eq!(b.encoded_len(), enc, "threshold blob of {enc} encoded bytes");
        add(format!("{label} ({enc} B encoded)"), b);
        seq += 1;
    }
    let mut big = vec![64 << 10, 1 << 20, 16 << 20, 64 << 20];
    big.iter_mut().for_each(|n| *n = scaled(*n));
    big.dedup();
    for n in big {
        add(format!("{} KiB", n >> 10), Blob { seq, data: pattern(n, seq) });
        seq += 1;
    }
    v
}

async fn echo_matrix(mode: PollerMode, api: Api) {
    let srv = TestServer::start().await;
    let ch = srv.channel(mode).await;
    for (label, blob) in echo_cases() {
        let n = blob.data.len();
        let enc = blob.encoded_len();
        let seq = blob.seq;
        let _big = if n >= BIG_CALL { Some(BIG.lock().await) } else { None };
        // Echo: the request and the response cross the threshold together; without a hint a
        // large response is READ by the client, with one it is WRITTEN into a landing zone.
        for hint in [None, Some(enc)] {
            let what = format!("{mode:?}/{api:?} echo {label}, hint {hint:?}");
            let mut req = Request::new(blob.clone());
            if let Some(h) = hint {
                req.set_response_size_hint(h);
            }
            let r: Response<Blob> = call(&ch, api, &lab_server::ECHO, req)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            check_blob(r.get_ref(), seq, n, &what);
        }
        // Small request, large response.
        for hint in [None, Some(enc)] {
            let what = format!("{mode:?}/{api:?} generate {label}, hint {hint:?}");
            let mut req = Request::new(GenRequest { seq, len: n as u64 });
            if let Some(h) = hint {
                req.set_response_size_hint(h);
            }
            let r: Response<Blob> = call(&ch, api, &lab_server::GENERATE, req)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            check_blob(r.get_ref(), seq, n, &what);
        }
        // Large request, small response: the server checks every byte it READ.
        let what = format!("{mode:?}/{api:?} sink {label}");
        let r: Response<Digest> = call(&ch, api, &lab_server::SINK, Request::new(blob))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        let d = r.into_inner();
        assert_eq!((d.seq, d.len), (seq, n as u64), "{what}");
        assert!(d.pattern_ok, "{what}: the server saw other bytes than were sent");
    }
    assert!(ch.is_connected());
    srv.settle("echo matrix: live calls back to 0").await;
    within(Duration::from_secs(20), "shutdown", srv.server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_sizes_thread_poller_async() {
    echo_matrix(PollerMode::Thread, Api::Async).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_sizes_thread_poller_blocking() {
    echo_matrix(PollerMode::Thread, Api::Blocking).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_sizes_caller_poller_async() {
    echo_matrix(PollerMode::Caller, Api::Async).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_sizes_caller_poller_blocking() {
    echo_matrix(PollerMode::Caller, Api::Blocking).await;
}

/// A landing zone smaller than the response falls back to a READ; a larger one is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landing_zone_too_small_or_too_large() {
    let srv = TestServer::start().await;
    let ch = srv.channel(PollerMode::Thread).await;
    let n = scaled(1 << 20);
    for (i, hint) in [n / 2, EAGER_MAX + 1, 2 * n, n + 64].into_iter().enumerate() {
        let seq = 100 + i as u64;
        let mut req = Request::new(GenRequest { seq, len: n as u64 });
        req.set_response_size_hint(hint);
        let r: Response<Blob> = call(&ch, Api::Async, &lab_server::GENERATE, req)
            .await
            .unwrap_or_else(|e| panic!("hint {hint}: {e:?}"));
        check_blob(r.get_ref(), seq, n, &format!("hint {hint}"));
    }
    // A hint on a small response changes nothing.
    let mut req = Request::new(GenRequest { seq: 7, len: 10 });
    req.set_response_size_hint(1 << 20);
    let r: Response<Blob> = call(&ch, Api::Async, &lab_server::GENERATE, req).await.unwrap();
    check_blob(r.get_ref(), 7, 10, "small response with a large hint");
    srv.settle("live calls back to 0").await;
}
