//! First end-to-end check of the three streaming call kinds with a hand-written service.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::{CallKind, Channel, MethodDesc, Request, Response, Status, Streaming};

#[derive(Clone, PartialEq, prost::Message)]
struct Msg {
    #[prost(uint64, tag = "1")]
    n: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: Bytes,
}

static COUNT: MethodDesc = MethodDesc::new("/t.S/Count", CallKind::ServerStreaming);
static SUM: MethodDesc = MethodDesc::new("/t.S/Sum", CallKind::ClientStreaming);
static ECHO: MethodDesc = MethodDesc::new("/t.S/Echo", CallKind::Streaming);
static METHODS: [MethodDesc; 3] = [COUNT, SUM, ECHO];

struct Svc;

impl Service for Svc {
    fn name(&self) -> &'static str {
        "t.S"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == COUNT.id {
            call.server_streaming(|req: Request<Msg>| async move {
                let m = req.into_inner();
                let size = m.data.len();
                let items = (0..m.n).map(move |i| {
                    Ok(Msg {
                        n: i,
                        data: Bytes::from(vec![i as u8; size]),
                    })
                });
                Ok(Response::new(futures_util::stream::iter(items)))
            })
        } else if method == SUM.id {
            call.client_streaming(|req: Request<Streaming<Msg>>| async move {
                let mut s = req.into_inner();
                let (mut sum, mut bytes) = (0u64, 0u64);
                while let Some(m) = s.message().await? {
                    sum += m.n;
                    bytes += m.data.len() as u64;
                }
                Ok(Response::new(Msg {
                    n: sum,
                    data: Bytes::from(bytes.to_le_bytes().to_vec()),
                }))
            })
        } else if method == ECHO.id {
            call.streaming(|req: Request<Streaming<Msg>>| async move {
                let s = req.into_inner();
                Ok(Response::new(s.map(|r: Result<Msg, Status>| {
                    r.map(|m| Msg {
                        n: m.n * 2,
                        data: m.data,
                    })
                })))
            })
        } else {
            call.unimplemented()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_three_streaming_kinds() {
    let _ = tracing_subscriber::fmt().with_env_filter("info").try_init();
    let server = Server::builder()
        .add_service(Svc)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = Channel::connect(server.local_addr().to_string())
        .await
        .unwrap();
    let t = Duration::from_secs(20);

    for size in [10usize, 20_000] {
        // Server streaming: more messages than the window.
        let resp: Response<Streaming<Msg>> = tokio::time::timeout(
            t,
            ch.server_streaming(
                &COUNT,
                Request::new(Msg {
                    n: 100,
                    data: Bytes::from(vec![0; size]),
                }),
            ),
        )
        .await
        .unwrap()
        .unwrap();
        let mut s = resp.into_inner();
        let mut got = 0u64;
        while let Some(m) = tokio::time::timeout(t, s.message()).await.unwrap().unwrap() {
            assert_eq!(m.n, got);
            assert_eq!(m.data.len(), size);
            got += 1;
        }
        assert_eq!(got, 100, "size {size}");

        // Client streaming.
        let items: Vec<Msg> = (0..50)
            .map(|i| Msg {
                n: i,
                data: Bytes::from(vec![1; size]),
            })
            .collect();
        let r: Response<Msg> = tokio::time::timeout(
            t,
            ch.client_streaming(&SUM, Request::new(futures_util::stream::iter(items))),
        )
        .await
        .unwrap()
        .unwrap();
        let r = r.into_inner();
        assert_eq!(r.n, (0..50).sum::<u64>());
        assert_eq!(
            u64::from_le_bytes(r.data[..8].try_into().unwrap()),
            50 * size as u64
        );

        // Bidi.
        let items: Vec<Msg> = (0..40)
            .map(|i| Msg {
                n: i,
                data: Bytes::from(vec![2; size]),
            })
            .collect();
        let resp: Response<Streaming<Msg>> = tokio::time::timeout(
            t,
            ch.streaming(&ECHO, Request::new(futures_util::stream::iter(items))),
        )
        .await
        .unwrap()
        .unwrap();
        let mut s = resp.into_inner();
        let mut i = 0u64;
        while let Some(m) = tokio::time::timeout(t, s.message()).await.unwrap().unwrap() {
            assert_eq!(m.n, i * 2);
            i += 1;
        }
        assert_eq!(i, 40, "size {size}");
    }
    // Streams ended or dropped early give their call cells back: with 2 cells, 30 calls
    // would hang on a leak.
    let small = rpc_core::Channel::builder(server.local_addr().to_string())
        .max_concurrent_calls(2)
        .connect()
        .await
        .unwrap();
    for i in 0..30u64 {
        let req = Request::new(Msg {
            n: 20,
            data: Bytes::from(vec![0; 100]),
        });
        let mut s = tokio::time::timeout(t, small.server_streaming::<_, Msg>(&COUNT, req))
            .await
            .unwrap()
            .unwrap()
            .into_inner();
        if i % 3 == 0 {
            let _ = s.message().await.unwrap();
            drop(s); // cancelled mid-stream
        } else {
            let mut n = 0;
            while tokio::time::timeout(t, s.message())
                .await
                .unwrap()
                .unwrap()
                .is_some()
            {
                n += 1;
            }
            assert_eq!(n, 20);
        }
    }
    server.shutdown().await;
}

static BOOM_UNARY: MethodDesc = MethodDesc::new("/t.B/Unary", CallKind::Unary);
static BOOM_SERVER: MethodDesc = MethodDesc::new("/t.B/ServerStream", CallKind::ServerStreaming);
static BOOM_CLIENT: MethodDesc = MethodDesc::new("/t.B/ClientStream", CallKind::ClientStreaming);
static BOOM_BIDI: MethodDesc = MethodDesc::new("/t.B/Bidi", CallKind::Streaming);
static BOOM_METHODS: [MethodDesc; 4] = [BOOM_UNARY, BOOM_SERVER, BOOM_CLIENT, BOOM_BIDI];

/// A handler's future that panics when first polled.
async fn explode(what: &'static str) -> Result<Response<Msg>, Status> {
    panic!("{what} on purpose (test)")
}

/// Handlers that panic: the server-streaming and bidi ones while making their future, the
/// unary and client-streaming ones inside it.
struct Boom;

impl Service for Boom {
    fn name(&self) -> &'static str {
        "t.B"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &BOOM_METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        let none = || futures_util::stream::empty::<Result<Msg, Status>>();
        if method == BOOM_UNARY.id {
            call.unary(|_: Request<Msg>| explode("unary"))
        } else if method == BOOM_SERVER.id {
            call.server_streaming(move |_: Request<Msg>| {
                if method == BOOM_SERVER.id {
                    panic!("server streaming on purpose (test)");
                }
                async move { Ok(Response::new(none())) }
            })
        } else if method == BOOM_CLIENT.id {
            call.client_streaming(|_: Request<Streaming<Msg>>| explode("client streaming"))
        } else if method == BOOM_BIDI.id {
            call.streaming(move |_: Request<Streaming<Msg>>| {
                if method == BOOM_BIDI.id {
                    panic!("bidi on purpose (test)");
                }
                async move { Ok(Response::new(none())) }
            })
        } else {
            call.unimplemented()
        }
    }
}

/// The status a call that returns a stream ends with: the opening's, or the stream's first
/// item's (each within `t`).
async fn stream_error(
    t: Duration,
    opened: impl std::future::Future<Output = Result<Response<Streaming<Msg>>, Status>>,
) -> Status {
    match tokio::time::timeout(t, opened)
        .await
        .expect("the call opens in time")
    {
        Err(st) => st,
        Ok(r) => tokio::time::timeout(t, r.into_inner().message())
            .await
            .expect("the stream's first item comes in time")
            .expect_err("the stream of a panicking handler fails"),
    }
}

/// Whatever its kind, a call whose handler panics (making its future or in it) ends INTERNAL
/// "handler panicked", the panic's text stays on the server, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_fails_its_call_whatever_its_kind() {
    let server = Server::builder()
        .add_service(Svc)
        .add_service(Boom)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = Channel::connect(server.local_addr().to_string())
        .await
        .unwrap();
    let t = Duration::from_secs(20);
    let msg = || Msg {
        n: 3,
        data: Bytes::from_static(b"abc"),
    };
    let items = || {
        futures_util::stream::iter((0..4).map(|_| Msg {
            n: 3,
            data: Bytes::from_static(b"abc"),
        }))
    };
    let check = |what: &str, st: Status| {
        assert_eq!(st.code(), rpc_core::Code::Internal, "{what}: {st:?}");
        assert_eq!(st.message(), "handler panicked", "{what}: {st:?}");
    };
    for round in 0..2 {
        let st = tokio::time::timeout(t, ch.unary::<Msg, Msg>(&BOOM_UNARY, Request::new(msg())))
            .await
            .unwrap()
            .unwrap_err();
        check("unary", st);
        let opened = ch.server_streaming::<Msg, Msg>(&BOOM_SERVER, Request::new(msg()));
        check("server streaming", stream_error(t, opened).await);
        let st = tokio::time::timeout(
            t,
            ch.client_streaming::<_, Msg>(&BOOM_CLIENT, Request::new(items())),
        )
        .await
        .unwrap()
        .unwrap_err();
        check("client streaming", st);
        let opened = ch.streaming::<_, Msg>(&BOOM_BIDI, Request::new(items()));
        check("bidi", stream_error(t, opened).await);
        // The server still serves, this connection included.
        let resp: Response<Streaming<Msg>> = tokio::time::timeout(
            t,
            ch.server_streaming(
                &COUNT,
                Request::new(Msg {
                    n: 5,
                    data: Bytes::new(),
                }),
            ),
        )
        .await
        .unwrap()
        .unwrap();
        let mut s = resp.into_inner();
        let mut got = 0;
        while tokio::time::timeout(t, s.message())
            .await
            .unwrap()
            .unwrap()
            .is_some()
        {
            got += 1;
        }
        assert_eq!(got, 5, "round {round}");
    }
    server.shutdown().await;
}
