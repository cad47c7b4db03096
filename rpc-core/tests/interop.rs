//! gRPC's interop test cases (`doc/interop-test-descriptions.md` in grpc/grpc), client and
//! server in one process, against the provider `RPC_PROVIDER` names (soft when unset).
//!
//! Each case follows the gRPC description; where our API differs from gRPC's (a call is
//! cancelled by dropping it, trailers exist only with a non-OK status) the case says how it
//! adapts. Every wait is bounded by [`HANG`].
//!
//! With `RPC_TEST_REMOTE` the cases run against the interop server of another host (two VMs
//! in `softroce/ci.sh`, see `interop_service::remote`), except the three that read the
//! server's probes.

mod interop_service;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use interop_service::*;
use rpc_core::{CallKind, Code, Metadata, MethodDesc, Request, Status, Streaming};

/// gRPC's sizes for `client_streaming` and the requests of `ping_pong`.
const REQUEST_SIZES: [usize; 4] = [27182, 8, 1828, 45904];
/// gRPC's sizes for `server_streaming` and the responses of `ping_pong`.
const RESPONSE_SIZES: [usize; 4] = [31415, 9, 2653, 58979];

fn body_len(p: &Option<Payload>) -> usize {
    let body = p.as_ref().map_or(&[][..], |p| &p.body[..]);
    assert!(
        intact(body),
        "a {}-byte payload arrived corrupted",
        body.len()
    );
    body.len()
}

/// The server side of a two-host run, until stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server side of a two-host run (softroce/vm.sh pair sets RPC_TEST_SERVE)"]
async fn serve_for_the_pair() {
    remote::serve(&[SLOT], |addr, _| async move { bind(&addr).await.0 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_unary() {
    let env = Env::start().await;
    let r = within("empty_call", env.client.empty_call(Empty {}))
        .await
        .expect("empty_call");
    assert_eq!(r.into_inner(), Empty {});
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_unary() {
    let env = Env::start().await;
    // gRPC's case: 271828 bytes out, 314159 back. Then 8 MiB both ways.
    for (out, back) in [(271_828usize, 314_159usize), (8 << 20, 8 << 20)] {
        let req = SimpleRequest {
            response_size: back as i32,
            payload: Some(payload(out)),
            response_status: None,
        };
        let r = within("large unary_call", env.client.unary_call(req))
            .await
            .unwrap_or_else(|e| panic!("unary_call {out} -> {back}: {e}"));
        assert_eq!(body_len(&r.into_inner().payload), back);
    }
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_streaming() {
    let env = Env::start().await;
    let requests = REQUEST_SIZES.map(|n| StreamingInputCallRequest {
        payload: Some(payload(n)),
    });
    let r = within(
        "streaming_input_call",
        env.client
            .streaming_input_call(futures_util::stream::iter(requests)),
    )
    .await
    .expect("streaming_input_call");
    assert_eq!(r.into_inner().aggregated_payload_size, 74922);
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_streaming() {
    let env = Env::start().await;
    // gRPC's case (an empty request), then with a request large enough for the rendezvous path
    // (the server READs it before its handler starts streaming).
    for request_size in [0usize, 271_828] {
        let req = StreamingOutputCallRequest {
            response_parameters: sizes(&RESPONSE_SIZES),
            payload: Some(payload(request_size)),
            response_status: None,
        };
        let mut s = within(
            "streaming_output_call",
            env.client.streaming_output_call(req),
        )
        .await
        .expect("streaming_output_call")
        .into_inner();
        for want in RESPONSE_SIZES {
            let m = within("response", s.message())
                .await
                .expect("response")
                .expect("a response, not the end");
            assert_eq!(body_len(&m.payload), want);
        }
        assert!(within("end", s.message()).await.expect("OK").is_none());
    }
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_pong() {
    let env = Env::start().await;
    let (tx, requests) = channel_stream(1);
    let mut s = within("full_duplex_call", env.client.full_duplex_call(requests))
        .await
        .expect("full_duplex_call")
        .into_inner();
    for (out, back) in REQUEST_SIZES.into_iter().zip(RESPONSE_SIZES) {
        tx.send(StreamingOutputCallRequest {
            response_parameters: sizes(&[back]),
            payload: Some(payload(out)),
            response_status: None,
        })
        .await
        .expect("the call still takes requests");
        // Each response arrives before the next request is sent: interleaved.
        let m = within("pong", s.message())
            .await
            .expect("pong")
            .expect("a response, not the end");
        assert_eq!(body_len(&m.payload), back);
    }
    drop(tx); // half-close
    assert!(within("end", s.message()).await.expect("OK").is_none());
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_stream() {
    let env = Env::start().await;
    let requests = futures_util::stream::empty::<StreamingOutputCallRequest>();
    let mut s = within("full_duplex_call", env.client.full_duplex_call(requests))
        .await
        .expect("full_duplex_call")
        .into_inner();
    assert!(within("end", s.message()).await.expect("OK").is_none());
    env.finish().await;
}

/// gRPC: start a client-streaming call, cancel it before sending anything, expect CANCELLED.
/// Here a call is cancelled by dropping its future (as in tonic): the server must drop the
/// handler, free the call, and the client must drop the request stream it was pumping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_after_begin() {
    // Reads the server's probes: always against a server in this process.
    let env = Env::start_local().await;
    let (tx, requests) = channel_stream::<StreamingInputCallRequest>(1);
    let client = env.client.clone();
    let call = tokio::spawn(async move { client.streaming_input_call(requests).await });
    env.probes
        .until("the handler started", |p| p.started() == 1)
        .await;
    call.abort();
    let aborted = within("the aborted call", call).await;
    assert!(
        aborted.as_ref().is_err_and(|e| e.is_cancelled()),
        "the call was cancelled, not finished: {aborted:?}"
    );
    env.probes
        .until("the server dropped the handler", |p| p.dropped() == 1)
        .await;
    within("the request stream is dropped", tx.closed()).await;
    // The connection is still good.
    within("empty_call", env.client.empty_call(Empty {}))
        .await
        .expect("empty_call after a cancel");
    assert_eq!(
        env.probes
            .finished
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    env.finish().await;
}

/// gRPC: a full-duplex call, cancelled after the first response. Here: the response stream is
/// dropped; the server must drop the handler (its response stream) and free the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_after_first_response() {
    // Reads the server's probes: always against a server in this process.
    let env = Env::start_local().await;
    let (tx, requests) = channel_stream(1);
    let mut s = within("full_duplex_call", env.client.full_duplex_call(requests))
        .await
        .expect("full_duplex_call")
        .into_inner();
    tx.send(StreamingOutputCallRequest {
        response_parameters: sizes(&[31415]),
        payload: Some(payload(27182)),
        response_status: None,
    })
    .await
    .expect("send the first request");
    let m = within("first response", s.message())
        .await
        .expect("first response")
        .expect("a response, not the end");
    assert_eq!(body_len(&m.payload), 31415);
    drop(s); // cancel
    env.probes
        .until("the server dropped the handler", |p| p.dropped() == 1)
        .await;
    within("the request stream is dropped", tx.closed()).await;
    within("empty_call", env.client.empty_call(Empty {}))
        .await
        .expect("empty_call after a cancel");
    env.finish().await;
}

/// gRPC: a full-duplex call with a 1 ms deadline fails with DEADLINE_EXCEEDED. Here the
/// deadline is 100 ms and the server sleeps 5 s before answering the first request: the client
/// gets DEADLINE_EXCEEDED long before, and the server drops the handler at its own copy of the
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_on_sleeping_server() {
    // Reads the server's probes: always against a server in this process.
    let env = Env::start_local().await;
    let (tx, requests) = channel_stream(1);
    let mut req = Request::new(requests);
    req.set_timeout(Duration::from_millis(100));
    let t0 = Instant::now();
    let mut s = within("full_duplex_call", env.client.full_duplex_call(req))
        .await
        .expect("full_duplex_call")
        .into_inner();
    tx.send(StreamingOutputCallRequest {
        response_parameters: vec![ResponseParameters {
            size: 31415,
            interval_us: 5_000_000,
        }],
        payload: Some(payload(27182)),
        response_status: None,
    })
    .await
    .expect("send the request");
    let e = within("the deadline", s.message())
        .await
        .expect_err("the call must fail");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "DEADLINE_EXCEEDED came after {:?}, the server's sleep",
        t0.elapsed()
    );
    env.probes
        .until("the server dropped the sleeping handler", |p| {
            p.dropped() == 1
        })
        .await;
    // The same for a unary call.
    let mut req = Request::new(SimpleRequest {
        response_size: 10,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(1));
    // A 1 ms deadline may pass before the server answers or after: both outcomes are gRPC's.
    match within("unary with 1 ms", env.client.unary_call(req)).await {
        Ok(r) => assert_eq!(body_len(&r.into_inner().payload), 10),
        Err(e) => assert_eq!(e.code(), Code::DeadlineExceeded, "{e}"),
    }
    env.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_code_and_message() {
    let env = Env::start().await;
    // gRPC's two messages: a plain one and `special_status_message`'s.
    for message in [
        "test status message",
        "\t\ntest with whitespace\r\nand Unicode BMP \u{263A} and non-BMP \u{1F608}\t\n",
    ] {
        let status = EchoStatus {
            code: 2,
            message: message.into(),
        };
        // Unary.
        let e = within(
            "unary_call",
            env.client.unary_call(SimpleRequest {
                response_status: Some(status.clone()),
                ..Default::default()
            }),
        )
        .await
        .expect_err("the server answers with the echoed status");
        assert_eq!((e.code(), e.message()), (Code::Unknown, message));

        // Full duplex: the status ends the response stream.
        let requests = futures_util::stream::iter([StreamingOutputCallRequest {
            response_status: Some(status),
            ..Default::default()
        }]);
        let mut s = within("full_duplex_call", env.client.full_duplex_call(requests))
            .await
            .expect("full_duplex_call")
            .into_inner();
        let e = within("status", s.message())
            .await
            .expect_err("the stream ends with the echoed status");
        assert_eq!((e.code(), e.message()), (Code::Unknown, message));
        assert!(
            within("after the status", s.message())
                .await
                .expect("ended")
                .is_none()
        );
    }
    env.finish().await;
}

/// gRPC: `TestService/UnimplementedCall` and `UnimplementedService/UnimplementedCall` answer
/// UNIMPLEMENTED. Here also for each streaming call kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unimplemented_method() {
    let env = Env::start().await;
    let other = unimplemented_service_client::UnimplementedServiceClient::new(env.channel.clone());
    let e = within("unimplemented_call", other.unimplemented_call(Empty {}))
        .await
        .expect_err("no such method");
    assert_eq!(e.code(), Code::Unimplemented, "{e}");

    static SERVER_STREAMING: MethodDesc =
        MethodDesc::new("/grpc.testing.TestService/Nope1", CallKind::ServerStreaming);
    static CLIENT_STREAMING: MethodDesc =
        MethodDesc::new("/grpc.testing.TestService/Nope2", CallKind::ClientStreaming);
    static BIDI: MethodDesc =
        MethodDesc::new("/grpc.testing.TestService/Nope3", CallKind::Streaming);

    // As tonic's: a stream refused before its first message fails the call itself.
    let e = within(
        "server streaming",
        env.channel
            .server_streaming::<_, Empty>(&SERVER_STREAMING, Request::new(Empty {})),
    )
    .await
    .expect_err("no such method");
    assert_eq!(e.code(), Code::Unimplemented, "{e}");
    assert!(e.message().contains("Nope1"), "{e}");

    let e = within(
        "client streaming",
        env.channel.client_streaming::<_, Empty>(
            &CLIENT_STREAMING,
            Request::new(futures_util::stream::iter([Empty {}, Empty {}])),
        ),
    )
    .await
    .expect_err("no such method");
    assert_eq!(e.code(), Code::Unimplemented, "{e}");

    let mut s: Streaming<Empty> = within(
        "bidi",
        env.channel
            .streaming(&BIDI, Request::new(futures_util::stream::iter([Empty {}]))),
    )
    .await
    .expect("the request is sent")
    .into_inner();
    let e = within("status", s.message())
        .await
        .expect_err("no such method");
    assert_eq!(e.code(), Code::Unimplemented, "{e}");
    env.finish().await;
}

fn echo_metadata() -> Metadata {
    let mut md = Metadata::new();
    md.insert(ECHO_INITIAL, "test_initial_metadata_value")
        .expect("valid metadata");
    md.insert(ECHO_TRAILING, vec![0xab, 0xab, 0xab])
        .expect("valid metadata");
    md
}

/// gRPC: request metadata is echoed as response metadata (initial) and as trailers. Here
/// trailers travel with a non-OK status only (`Status::metadata`, as tonic handlers can send
/// them): the OK cases check the initial metadata, the error cases the trailers too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_metadata() {
    let env = Env::start().await;
    let initial = |md: &Metadata| md.get_str(ECHO_INITIAL).map(str::to_owned);
    let trailing = |st: &Status| st.metadata().get(ECHO_TRAILING).map(<[u8]>::to_vec);
    let want_initial = Some("test_initial_metadata_value".to_owned());
    let want_trailing = Some(vec![0xab, 0xab, 0xab]);

    // Unary, OK: gRPC's sizes.
    let mut req = Request::new(SimpleRequest {
        response_size: 314_159,
        payload: Some(payload(271_828)),
        response_status: None,
    });
    *req.metadata_mut() = echo_metadata();
    let r = within("unary_call", env.client.unary_call(req))
        .await
        .expect("unary_call");
    assert_eq!(initial(r.metadata()), want_initial);
    assert_eq!(body_len(&r.into_inner().payload), 314_159);

    // Unary, failing: the trailers come with the status.
    let mut req = Request::new(SimpleRequest {
        response_status: Some(EchoStatus {
            code: Code::FailedPrecondition as i32,
            message: "with trailers".into(),
        }),
        ..Default::default()
    });
    *req.metadata_mut() = echo_metadata();
    let e = within("unary_call", env.client.unary_call(req))
        .await
        .expect_err("the echoed status");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(trailing(&e), want_trailing);

    // Full duplex, OK: the response metadata arrives with the first message.
    let mut req = Request::new(futures_util::stream::iter([StreamingOutputCallRequest {
        response_parameters: sizes(&[314_159]),
        payload: Some(payload(271_828)),
        response_status: None,
    }]));
    *req.metadata_mut() = echo_metadata();
    let mut s = within("full_duplex_call", env.client.full_duplex_call(req))
        .await
        .expect("full_duplex_call")
        .into_inner();
    let m = within("response", s.message())
        .await
        .expect("response")
        .expect("a response");
    assert_eq!(body_len(&m.payload), 314_159);
    assert_eq!(s.metadata().and_then(initial), want_initial);
    assert!(within("end", s.message()).await.expect("OK").is_none());

    // Full duplex, failing after one message: metadata first, trailers with the status.
    let mut req = Request::new(futures_util::stream::iter([StreamingOutputCallRequest {
        response_parameters: sizes(&[10]),
        payload: None,
        response_status: Some(EchoStatus {
            code: Code::Aborted as i32,
            message: "mid-stream".into(),
        }),
    }]));
    *req.metadata_mut() = echo_metadata();
    let mut s = within("full_duplex_call", env.client.full_duplex_call(req))
        .await
        .expect("full_duplex_call")
        .into_inner();
    let m = within("response", s.message())
        .await
        .expect("response")
        .expect("a response");
    assert_eq!(body_len(&m.payload), 10);
    assert_eq!(s.metadata().and_then(initial), want_initial);
    let e = within("status", s.message()).await.expect_err("the status");
    assert_eq!((e.code(), e.message()), (Code::Aborted, "mid-stream"));
    assert_eq!(trailing(&e), want_trailing);
    env.finish().await;
}

/// gRPC's `half_duplex` flavour of ping-pong: the server answers only after the client
/// half-closed; the client keeps receiving after it finished sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_duplex() {
    let env = Env::start().await;
    let requests: Vec<_> = REQUEST_SIZES
        .into_iter()
        .zip(RESPONSE_SIZES)
        .map(|(out, back)| StreamingOutputCallRequest {
            response_parameters: sizes(&[back]),
            payload: Some(payload(out)),
            response_status: None,
        })
        .collect();
    let s = within(
        "half_duplex_call",
        env.client
            .half_duplex_call(futures_util::stream::iter(requests)),
    )
    .await
    .expect("half_duplex_call")
    .into_inner();
    let got: Vec<usize> = within(
        "responses",
        s.map(|m| body_len(&m.expect("OK").payload)).collect(),
    )
    .await;
    assert_eq!(got, RESPONSE_SIZES);
    env.finish().await;
}
