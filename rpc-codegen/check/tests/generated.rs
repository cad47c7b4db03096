//! The generated code of every `.proto` in `proto/`: method descriptors, server traits that
//! users implement with `async fn`, servers as `rpc_core` services, client signatures.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::pin::Pin;
use std::task::{Context, Poll};

use rpc_codegen_check::test::common::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use rpc_codegen_check::test::everything::{self as ev, Type};
use rpc_codegen_check::{bench, bulk, helloworld, kv, test};
use rpc_core::codegen::{CallKind, MethodDesc, Service};
use rpc_core::{Request, Response, Status, Streaming};

/// A stream of the messages of a vector (what a handler might return).
struct Iter<T>(std::vec::IntoIter<T>);

impl<T: Unpin> futures_core::Stream for Iter<T> {
    type Item = Result<T, Status>;
    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.get_mut().0.next().map(Ok))
    }
}

fn check(methods: &[MethodDesc], expected: &[(&str, CallKind)]) {
    let got: Vec<(&str, CallKind)> = methods.iter().map(|m| (m.path, m.kind)).collect();
    assert_eq!(got, expected);
    for m in methods {
        assert_eq!(m.id, rpc_core::method::method_id(m.path), "{}", m.path);
        assert_eq!(m.id, rpc_codegen::method_id(m.path), "{}", m.path);
    }
}

#[test]
fn descriptors_carry_paths_kinds_and_stable_ids() {
    use CallKind::*;
    check(
        helloworld::greeter_server::GreeterServer::<()>::METHODS,
        &[("/helloworld.Greeter/SayHello", Unary)],
    );
    assert_eq!(
        helloworld::greeter_server::SAY_HELLO.id,
        rpc_core::method::method_id("/helloworld.Greeter/SayHello")
    );
    check(
        kv::kv_server::KvServer::<()>::METHODS,
        &[
            ("/kv.Kv/Put", Unary),
            ("/kv.Kv/Get", Unary),
            ("/kv.Kv/Delete", Unary),
            ("/kv.Kv/List", Unary),
        ],
    );
    check(
        bench::bench_server::BenchServer::<()>::METHODS,
        &[
            ("/bench.Bench/Echo", Unary),
            ("/bench.Bench/EchoStream", ServerStreaming),
            ("/bench.Bench/EchoBidi", Streaming),
        ],
    );
    check(
        bulk::bulk_server::BulkServer::<()>::METHODS,
        &[("/bulk.Bulk/Checksum", Unary), ("/bulk.Bulk/Fill", Unary)],
    );
    check(
        ev::route_guide_server::RouteGuideServer::<()>::METHODS,
        &[
            ("/test.everything.RouteGuide/GetFeature", Unary),
            ("/test.everything.RouteGuide/ListFeatures", ServerStreaming),
            ("/test.everything.RouteGuide/RecordRoute", ClientStreaming),
            ("/test.everything.RouteGuide/RouteChat", Streaming),
        ],
    );
    check(
        ev::clock_server::ClockServer::<()>::METHODS,
        &[
            ("/test.everything.Clock/Now", Unary),
            ("/test.everything.Clock/Ping", Unary),
            ("/test.everything.Clock/GetTime", Unary),
        ],
    );
    check(
        ev::keywords_server::KeywordsServer::<()>::METHODS,
        &[
            ("/test.everything.Keywords/type", Unary),
            ("/test.everything.Keywords/Match", Unary),
            ("/test.everything.Keywords/Async", ServerStreaming),
            ("/test.everything.Keywords/Loop", ClientStreaming),
            ("/test.everything.Keywords/Self", Unary),
        ],
    );
    check(
        test::nested::deep::deep_server::DeepServer::<()>::METHODS,
        &[("/test.nested.deep.Deep/Locate", Unary)],
    );
    check(ev::nothing_server::NothingServer::<()>::METHODS, &[]);
    check(
        rpc_codegen_check::bare_server::BareServer::<()>::METHODS,
        &[("/Bare/Poke", Unary)],
    );
}

// Users implement the generated traits with plain `async fn`s.

struct Greeter;

impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: Request<helloworld::HelloRequest>,
    ) -> Result<Response<helloworld::HelloReply>, Status> {
        Ok(Response::new(helloworld::HelloReply {
            message: format!("Hello {}!", request.get_ref().name),
        }))
    }
}

struct Guide;

impl ev::route_guide_server::RouteGuide for Guide {
    async fn get_feature(&self, request: Request<Point>) -> Result<Response<Feature>, Status> {
        Ok(Response::new(Feature {
            location: Some(request.into_inner()),
            ..Feature::default()
        }))
    }

    type ListFeaturesStream = Iter<Feature>;

    async fn list_features(
        &self,
        request: Request<Rectangle>,
    ) -> Result<Response<Self::ListFeaturesStream>, Status> {
        let r = request.into_inner();
        let features = [r.lo, r.hi]
            .into_iter()
            .map(|p| Feature {
                location: p,
                ..Feature::default()
            })
            .collect::<Vec<_>>();
        Ok(Response::new(Iter(features.into_iter())))
    }

    async fn record_route(
        &self,
        request: Request<Streaming<Point>>,
    ) -> Result<Response<RouteSummary>, Status> {
        let mut points = request.into_inner();
        let mut summary = RouteSummary::default();
        while let Some(_point) = points.message().await? {
            summary.point_count += 1;
        }
        Ok(Response::new(summary))
    }

    type RouteChatStream = Iter<RouteNote>;

    async fn route_chat(
        &self,
        request: Request<Streaming<RouteNote>>,
    ) -> Result<Response<Self::RouteChatStream>, Status> {
        let mut notes = request.into_inner();
        let mut all = Vec::new();
        while let Some(note) = notes.message().await? {
            all.push(note);
        }
        Ok(Response::new(Iter(all.into_iter())))
    }
}

struct Clock;

#[allow(deprecated)]
impl ev::clock_server::Clock for Clock {
    async fn now(&self, _: Request<()>) -> Result<Response<prost_types::Timestamp>, Status> {
        Ok(Response::new(prost_types::Timestamp {
            seconds: 1,
            nanos: 2,
        }))
    }

    async fn ping(&self, _: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }

    async fn get_time(&self, r: Request<()>) -> Result<Response<prost_types::Timestamp>, Status> {
        self.now(r).await
    }
}

struct Keywords;

impl ev::keywords_server::Keywords for Keywords {
    async fn r#type(&self, r: Request<Type>) -> Result<Response<Type>, Status> {
        let t = r.into_inner();
        Ok(Response::new(Type {
            r#type: t.r#type,
            r#match: t.r#match + 1,
            r#async: !t.r#async,
            self_: t.self_,
        }))
    }

    async fn r#match(&self, r: Request<Type>) -> Result<Response<Type>, Status> {
        Ok(Response::new(r.into_inner()))
    }

    type AsyncStream = Iter<Type>;

    async fn r#async(&self, r: Request<Type>) -> Result<Response<Self::AsyncStream>, Status> {
        Ok(Response::new(Iter(vec![r.into_inner()].into_iter())))
    }

    async fn r#loop(&self, r: Request<Streaming<Type>>) -> Result<Response<Type>, Status> {
        let mut s = r.into_inner();
        let mut last = Type::default();
        while let Some(t) = s.message().await? {
            last = t;
        }
        Ok(Response::new(last))
    }

    async fn self_(&self, r: Request<Type>) -> Result<Response<Type>, Status> {
        Ok(Response::new(r.into_inner()))
    }
}

struct Deep;

impl test::nested::deep::deep_server::Deep for Deep {
    async fn locate(
        &self,
        r: Request<Point>,
    ) -> Result<Response<test::nested::deep::Located>, Status> {
        Ok(Response::new(test::nested::deep::Located {
            at: Some(r.into_inner()),
            inner: Some(test::nested::deep::located::Inner { depth: 3 }),
        }))
    }
}

fn service_of(s: &dyn Service, name: &str, n: usize) {
    assert_eq!(s.name(), name);
    assert_eq!(s.methods().len(), n);
}

#[test]
fn servers_are_runtime_services() {
    let greeter = helloworld::greeter_server::GreeterServer::new(Greeter);
    service_of(&greeter.clone(), "helloworld.Greeter", 1);
    assert!(format!("{greeter:?}").contains("GreeterServer"));
    service_of(
        &ev::route_guide_server::RouteGuideServer::new(Guide),
        "test.everything.RouteGuide",
        4,
    );
    service_of(
        &ev::clock_server::ClockServer::from_arc(std::sync::Arc::new(Clock)),
        "test.everything.Clock",
        3,
    );
    service_of(
        &ev::keywords_server::KeywordsServer::new(Keywords),
        "test.everything.Keywords",
        5,
    );
    service_of(
        &test::nested::deep::deep_server::DeepServer::new(Deep),
        "test.nested.deep.Deep",
        1,
    );
}

#[tokio::test]
async fn handlers_run_as_written() {
    use ev::keywords_server::Keywords as _;
    use helloworld::greeter_server::Greeter as _;
    let reply = Greeter
        .say_hello(Request::new(helloworld::HelloRequest { name: "x".into() }))
        .await
        .unwrap();
    assert_eq!(reply.get_ref().message, "Hello x!");
    let t = Keywords
        .r#type(Request::new(Type {
            r#match: 1,
            ..Type::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((t.r#match, t.r#async), (2, true));
}

#[test]
fn prost_knobs_pass_through() {
    // `bytes([".bench", ".kv"])` made those fields `Bytes`; `type_attribute` added `Ord`.
    let value: bytes::Bytes = kv::PutRequest::default().value;
    let payload: bytes::Bytes = bench::EchoRequest::default().payload;
    assert!(value.is_empty() && payload.is_empty());
    let lo = Point {
        latitude: 1,
        longitude: 0,
    };
    assert!(Point::default() < lo);
}

/// Client signatures, type-checked (the runtime is not needed to compile calls).
#[allow(dead_code, deprecated)]
async fn client_calls_type_check() -> Result<(), Box<dyn std::error::Error>> {
    let greeter = helloworld::greeter_client::GreeterClient::connect("127.0.0.1:1").await?;
    let _: Response<helloworld::HelloReply> = greeter
        .say_hello(helloworld::HelloRequest::default())
        .await?;
    let mut request = Request::new(helloworld::HelloRequest::default());
    request.set_timeout(std::time::Duration::from_millis(5));
    let blocking = helloworld::greeter_client::GreeterBlockingClient::from(greeter.clone());
    let _ = blocking.say_hello(request)?;
    let mut pipeline =
        helloworld::greeter_client::GreeterPipelineClient::from(greeter.clone()).say_hello()?;
    pipeline.submit(7, Request::new(helloworld::HelloRequest::default()))?;
    let channel = rpc_core::Channel::clone(greeter.as_ref());

    let guide = ev::route_guide_client::RouteGuideClient::new(channel.clone());
    let _: Feature = guide.get_feature(Point::default()).await?.into_inner();
    let mut features: Streaming<Feature> = guide
        .list_features(Rectangle::default())
        .await?
        .into_inner();
    while let Some(_f) = features.message().await? {}
    let points = Iter(vec![Point::default()].into_iter());
    // A stream of messages, not of results: map the test stream.
    let _: RouteSummary = guide
        .record_route(tokio_stream::StreamExt::map(points, |p| {
            p.unwrap_or_default()
        }))
        .await?
        .into_inner();
    let notes = tokio_stream::iter(vec![RouteNote::default()]);
    let _: Streaming<RouteNote> = guide.route_chat(Request::new(notes)).await?.into_inner();

    let clock = ev::clock_client::ClockClient::new(channel.clone());
    let _: prost_types::Timestamp = clock.now(()).await?.into_inner();
    let _: () = ev::clock_client::ClockBlockingClient::new(channel.clone())
        .ping(())?
        .into_inner();
    let _ = clock.get_time(()).await?;

    let kw = ev::keywords_client::KeywordsClient::new(channel.clone());
    let _ = kw.r#type(Type::default()).await?;
    let kw_blocking = ev::keywords_client::KeywordsBlockingClient::from(kw.clone());
    let _ = kw_blocking.r#type(Type::default())?;
    let _ = kw.r#match(Type::default()).await?;
    let _: Streaming<Type> = kw.r#async(Type::default()).await?.into_inner();
    let _ = kw.r#loop(tokio_stream::iter(vec![Type::default()])).await?;
    let _ = kw_blocking.self_(Type::default())?;

    let bare = rpc_codegen_check::bare_client::BareClient::new(channel);
    let _ = bare.poke(rpc_codegen_check::Poke { n: 1 }).await?;
    Ok(())
}

#[test]
fn descriptors_carry_idempotency_levels() {
    use rpc_core::Idempotency::*;
    let levels: Vec<(&str, rpc_core::Idempotency)> =
        test::idempotency::store_server::StoreServer::<()>::METHODS
            .iter()
            .map(|m| (m.method(), m.idempotency))
            .collect();
    assert_eq!(
        levels,
        [
            ("Get", NoSideEffects),
            ("Delete", Idempotent),
            ("Append", Unknown),
            ("Touch", Unknown),
            ("Watch", NoSideEffects),
        ]
    );
    assert_eq!(
        test::idempotency::store_server::GET.idempotency,
        NoSideEffects
    );
}
