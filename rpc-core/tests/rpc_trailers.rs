//! Response headers and trailers on an OK end, on every call kind, as gRPC has them: the
//! handler sets `Response::trailers_mut`, the caller reads `Response::trailers` (unary,
//! client streaming) or `Streaming::trailers` (server streaming, bidi); a server stream's
//! headers are on the `Response` its call returns, also when the stream sends no message.
//! Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{init_logs, within};
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::{CallKind, Channel, Code, Metadata, MethodDesc, Request, Response, Streaming};

const LIMIT: Duration = Duration::from_secs(60);

static UNARY: MethodDesc = MethodDesc::new("/test.Trailers/Unary", CallKind::Unary);
static COUNT: MethodDesc = MethodDesc::new("/test.Trailers/Count", CallKind::ServerStreaming);
static SUM: MethodDesc = MethodDesc::new("/test.Trailers/Sum", CallKind::ClientStreaming);
static ECHO: MethodDesc = MethodDesc::new("/test.Trailers/Echo", CallKind::Streaming);
static REFUSE: MethodDesc = MethodDesc::new("/test.Trailers/Refuse", CallKind::ServerStreaming);
static METHODS: [MethodDesc; 5] = [UNARY, COUNT, SUM, ECHO, REFUSE];

#[derive(Clone, PartialEq, prost::Message)]
struct Msg {
    #[prost(uint64, tag = "1")]
    n: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: Bytes,
}

fn md(pairs: &[(&str, &str)]) -> Metadata {
    let mut m = Metadata::new();
    for (k, v) in pairs {
        m.insert(*k, *v).unwrap();
    }
    m
}

/// Headers `x-kind: <kind>` and trailers `x-count: <n>` plus `x-kind: end` (a trailer may
/// repeat a header's key).
fn respond<T>(message: T, kind: &str, n: u64) -> Response<T> {
    let mut resp = Response::from_parts(md(&[("x-kind", kind)]), message);
    *resp.trailers_mut() = md(&[("x-count", &n.to_string()), ("x-kind", "end")]);
    resp
}

struct TrailersSvc;

impl Service for TrailersSvc {
    fn name(&self) -> &'static str {
        "test.Trailers"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == UNARY.id {
            call.unary(|req: Request<Msg>| async move {
                let m = req.into_inner();
                let data = Bytes::from(vec![7u8; m.n as usize]);
                Ok(respond(Msg { n: m.n, data }, "unary", m.n))
            })
        } else if method == COUNT.id {
            call.server_streaming(|req: Request<Msg>| async move {
                let n = req.into_inner().n;
                let items = (0..n).map(|i| {
                    Ok(Msg {
                        n: i,
                        data: Bytes::new(),
                    })
                });
                Ok(respond(futures_util::stream::iter(items), "count", n))
            })
        } else if method == SUM.id {
            call.client_streaming(|req: Request<Streaming<Msg>>| async move {
                let mut s = req.into_inner();
                let mut sum = 0;
                while let Some(m) = s.message().await? {
                    sum += m.n;
                }
                // The client's stream carries no trailers.
                assert_eq!(s.trailers().await?, None);
                Ok(respond(
                    Msg {
                        n: sum,
                        data: Bytes::new(),
                    },
                    "sum",
                    sum,
                ))
            })
        } else if method == ECHO.id {
            call.streaming(|req: Request<Streaming<Msg>>| async move {
                let s = req.into_inner();
                Ok(respond(s, "echo", 0))
            })
        } else if method == REFUSE.id {
            call.server_streaming(|_req: Request<Msg>| async move {
                Err::<Response<futures_util::stream::Empty<Result<Msg, rpc_core::Status>>>, _>(
                    rpc_core::Status::permission_denied("not yours"),
                )
            })
        } else {
            call.unimplemented()
        }
    }
}

async fn setup() -> (rpc_core::RunningServer, Channel) {
    init_logs();
    let server = Server::builder()
        .add_service(TrailersSvc)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = within(
        LIMIT,
        "connect",
        Channel::connect(server.local_addr().to_string()),
    )
    .await
    .unwrap();
    (server, ch)
}

fn msg(n: u64) -> Msg {
    Msg {
        n,
        data: Bytes::new(),
    }
}

fn expect_trailers(t: &Metadata, n: u64) {
    assert_eq!(t.get_str("x-count"), Some(n.to_string().as_str()));
    assert_eq!(t.get_str("x-kind"), Some("end"));
    assert_eq!(t.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_trailers_arrive_apart_from_the_headers() {
    let (server, ch) = setup().await;
    // Small (eager), and large enough for the rendezvous path.
    for n in [3u64, 300 << 10] {
        let resp = within(
            LIMIT,
            "unary",
            ch.unary::<_, Msg>(&UNARY, Request::new(msg(n))),
        )
        .await
        .unwrap();
        assert_eq!(resp.metadata(), &md(&[("x-kind", "unary")]), "n = {n}");
        expect_trailers(resp.trailers(), n);
        assert_eq!(resp.get_ref().data.len() as u64, n);
    }
    // A blocking call sees them too.
    let ch2 = ch.clone();
    let resp = tokio::task::spawn_blocking(move || {
        ch2.unary_blocking::<_, Msg>(&UNARY, Request::new(msg(5)))
    })
    .await
    .unwrap()
    .unwrap();
    expect_trailers(resp.trailers(), 5);
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stream_headers_come_with_the_response_and_trailers_at_the_end() {
    let (server, ch) = setup().await;
    for n in [0u64, 1, 5] {
        let resp = within(
            LIMIT,
            "server_streaming",
            ch.server_streaming::<_, Msg>(&COUNT, Request::new(msg(n))),
        )
        .await
        .unwrap();
        // The headers are there before a message is taken, also when none will come.
        assert_eq!(resp.metadata(), &md(&[("x-kind", "count")]), "n = {n}");
        let mut s = resp.into_inner();
        assert_eq!(s.metadata(), Some(&md(&[("x-kind", "count")])));
        let mut got = 0;
        while let Some(m) = within(LIMIT, "message", s.message()).await.unwrap() {
            assert_eq!(m.n, got);
            got += 1;
        }
        assert_eq!(got, n);
        let t = within(LIMIT, "trailers", s.trailers()).await.unwrap();
        expect_trailers(&t.expect("trailers"), n);
        // Asked again, the same; the headers stay readable.
        expect_trailers(&s.trailers().await.unwrap().expect("trailers"), n);
        assert_eq!(s.metadata(), Some(&md(&[("x-kind", "count")])));
    }
    // `trailers` drains the messages not taken.
    let resp = within(
        LIMIT,
        "server_streaming",
        ch.server_streaming::<_, Msg>(&COUNT, Request::new(msg(4))),
    )
    .await
    .unwrap();
    let t = within(LIMIT, "trailers", resp.into_inner().trailers())
        .await
        .unwrap();
    expect_trailers(&t.expect("trailers"), 4);
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_refused_before_its_first_message_fails_the_call() {
    let (server, ch) = setup().await;
    // As tonic: a trailers-only response is the call's error, not an empty stream.
    let st = within(
        LIMIT,
        "server_streaming",
        ch.server_streaming::<_, Msg>(&REFUSE, Request::new(msg(0))),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    assert_eq!(st.message(), "not yours");
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_stream_and_bidi_trailers() {
    let (server, ch) = setup().await;
    let items: Vec<Msg> = (1..=4).map(msg).collect();
    let resp = within(
        LIMIT,
        "client_streaming",
        ch.client_streaming::<_, Msg>(&SUM, Request::new(futures_util::stream::iter(items))),
    )
    .await
    .unwrap();
    assert_eq!(resp.get_ref().n, 10);
    assert_eq!(resp.metadata(), &md(&[("x-kind", "sum")]));
    expect_trailers(resp.trailers(), 10);

    for n in [0u64, 3] {
        let items: Vec<Msg> = (0..n).map(msg).collect();
        let resp = within(
            LIMIT,
            "streaming",
            ch.streaming::<_, Msg>(&ECHO, Request::new(futures_util::stream::iter(items))),
        )
        .await
        .unwrap();
        let mut s = resp.into_inner();
        let mut got = 0;
        while within(LIMIT, "message", s.message())
            .await
            .unwrap()
            .is_some()
        {
            got += 1;
        }
        assert_eq!(got, n);
        assert_eq!(s.metadata(), Some(&md(&[("x-kind", "echo")])), "n = {n}");
        let t = within(LIMIT, "trailers", s.trailers()).await.unwrap();
        expect_trailers(&t.expect("trailers"), 0);
    }
    within(LIMIT, "shutdown", server.shutdown()).await;
}
