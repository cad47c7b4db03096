//! `test/collide.proto`, `test/collide_rpc.proto` and `test/rdma_only/`: messages, services and
//! methods named like items of `std`, prost, tonic and rdma-rpc.

use super::*;

use rpc_codegen_check::rdma_only as bare;
use rpc_codegen_check::test::collide as m;
use rpc_codegen_check::test::collide::rpc;

pub struct Svc;

unary_service!(Svc => rpc::result_server::Result {
    fn ok(r: m::Ok) -> m::Result {
        let text = r.value.to_string();
        m::Result { option: Some(m::Option { value: Some(m::String { text }) }), error: None }
    }
    fn err(r: m::Error) -> m::Result { m::Result { option: None, error: Some(r) } }
    fn map(r: m::Option) -> m::Option {
        m::Option { value: r.value.map(|s| m::String { text: s.text.to_uppercase() }) }
    }
    fn unwrap(r: m::Box) -> m::Vec { r.items.unwrap_or_default() }
});
unary_service!(Svc => rpc::error_server::Error {
    fn source(r: m::Error) -> m::Error {
        m::Error { reason: format!("caused by {}", r.reason), detail: r.detail }
    }
    fn description(r: m::String) -> m::String { m::String { text: format!("<{}>", r.text) } }
    fn fmt(r: m::Debug) -> m::Debug { m::Debug { text: format!("{:?}", r.text) } }
});
unary_service!(Svc => rpc::server_server::Server {
    fn serve(r: m::Server) -> m::Server { m::Server { host: format!("{}:50051", r.host) } }
    fn add_service(r: m::Service) -> m::Service {
        m::Service { name: format!("{}Server", r.name) }
    }
    fn call(_r: m::IncomingCall) -> m::Dispatched { m::Dispatched {} }
    fn methods(r: m::MethodDesc) -> m::MethodDesc {
        m::MethodDesc { path: format!("/{}", r.path) }
    }
    fn name(r: m::Name) -> m::Name { m::Name { value: r.value.chars().rev().collect() } }
    fn unimplemented(r: m::CallKind) -> m::CallKind { m::CallKind { kind: r.kind + 1 } }
});

impl rpc::client_server::Client for Svc {
    async fn unary(&self, r: Request<m::Client>) -> Result<Response<m::Client>, Status> {
        Ok(Response::new(m::Client {
            id: format!("unary {}", r.into_inner().id),
        }))
    }
    type ServerStreamingStream = Iter<m::Client>;
    async fn server_streaming(
        &self,
        r: Request<m::Client>,
    ) -> Result<Response<Iter<m::Client>>, Status> {
        let id = r.into_inner().id;
        Ok(Response::new(Iter::new(
            (0..3)
                .map(|n| m::Client {
                    id: format!("{id}{n}"),
                })
                .collect(),
        )))
    }
    async fn pipeline(&self, r: Request<m::Client>) -> Result<Response<m::Client>, Status> {
        Ok(Response::new(m::Client {
            id: format!("pipeline {}", r.into_inner().id),
        }))
    }
    async fn unary_blocking(&self, r: Request<m::Client>) -> Result<Response<m::Client>, Status> {
        Ok(Response::new(m::Client {
            id: format!("blocking {}", r.into_inner().id),
        }))
    }
    async fn as_ref(&self, r: Request<m::Arc>) -> Result<Response<m::Arc>, Status> {
        Ok(Response::new(m::Arc {
            count: r.into_inner().count + 1,
        }))
    }
    async fn inner(
        &self,
        r: Request<m::TransportError>,
    ) -> Result<Response<m::TransportError>, Status> {
        Ok(Response::new(r.into_inner()))
    }
}

unary_service!(Svc => rpc::future_server::Future {
    fn poll(r: m::Future) -> m::Poll { m::Poll { ready: !r.poll.unwrap_or_default().ready } }
    fn r#await(r: m::Poll) -> m::Poll { m::Poll { ready: !r.ready } }
    fn output(r: m::Fn) -> m::Fn { m::Fn { body: format!("{{ {} }}", r.body) } }
});
unary_service!(Svc => rpc::codec_server::Codec {
    fn encode(r: m::Bytes) -> m::Bytes {
        m::Bytes { data: r.data.iter().map(|b| b ^ 0xff).collect() }
    }
    fn decode(r: m::Bytes) -> m::DecodeError {
        m::DecodeError { text: format!("{} bytes", r.data.len()) }
    }
    fn body(r: m::Body) -> m::Body {
        m::Body { chunk: [r.chunk.as_slice(), r.chunk.as_slice()].concat() }
    }
});
unary_service!(Svc => rpc::string_server::String {
    fn len(r: m::String) -> m::Sized { m::Sized { len: r.text.len() as u64 } }
});
unary_service!(Svc => rpc::vec_server::Vec {
    fn push(r: m::Vec) -> m::Vec {
        let mut v = r;
        v.strings.push(m::String { text: "pushed".into() });
        v
    }
});
unary_service!(Svc => rpc::bytes_server::Bytes {
    fn slice(r: m::Bytes) -> m::Bytes {
        m::Bytes { data: r.data.get(1..).unwrap_or_default().to_vec() }
    }
});
unary_service!(Svc => rpc::send_server::Send {
    fn send(r: m::Send) -> m::Sync { m::Sync { locked: !r.sync.unwrap_or_default().locked } }
});
unary_service!(Svc => rpc::debug_server::Debug {
    fn fmt(r: m::Debug) -> m::Debug { m::Debug { text: format!("Debug({})", r.text) } }
});

impl rpc::stream_server::Stream for Svc {
    type NextStream = Iter<m::Stream>;
    async fn next(&self, r: Request<m::Stream>) -> Result<Response<Iter<m::Stream>>, Status> {
        let items = r.into_inner().items;
        Ok(Response::new(Iter::new(
            items
                .into_iter()
                .map(|n| m::Stream {
                    items: vec![n; n as usize],
                })
                .collect(),
        )))
    }
}

unary_service!(Svc => rpc::infallible_server::Infallible {
    fn never(r: m::Infallible) -> m::Infallible { r }
});
unary_service!(Svc => rpc::unpin_server::Unpin {
    fn unpin(r: m::Unpin) -> m::Unpin { r }
});
unary_service!(Svc => rpc::sized_server::Sized {
    fn sized(r: m::Sized) -> m::Sized { m::Sized { len: r.len * 2 } }
});
unary_service!(Svc => rpc::fn_server::Fn {
    fn call(r: m::Fn) -> m::Fn { m::Fn { body: format!("call({})", r.body) } }
});
unary_service!(Svc => rpc::into_request_server::IntoRequest {
    fn into_request(r: m::IntoRequest) -> m::IntoRequest {
        m::IntoRequest { text: format!("{} into request", r.text) }
    }
});
unary_service!(Svc => rpc::service_server::Service {
    fn call(r: m::Service) -> m::Service { m::Service { name: format!("called {}", r.name) } }
});
unary_service!(Svc => rpc::ok_server::Ok {
    fn ok(r: m::Ok) -> m::Ok { m::Ok { value: r.value + 1 } }
});
unary_service!(Svc => rpc::some_server::Some {
    fn some(r: m::Some) -> m::Some { m::Some { value: r.value * 3 } }
});
unary_service!(Svc => rpc::sync_server::Sync {
    fn lock(r: m::Sync) -> m::Sync { m::Sync { locked: !r.locked } }
});

// The services tonic-build's code cannot compile (generated without `emit_tonic`).
unary_service!(Svc => bare::option_server::Option {
    fn some(r: m::Some) -> m::Some { m::Some { value: r.value + 10 } }
    fn none(r: m::None) -> m::None { r }
    fn clone(r: m::Clone) -> m::Clone {
        let value = r.from.unwrap_or_default().value + 1;
        m::Clone { from: Some(m::Default { value }) }
    }
    fn into(r: m::Into) -> m::From { m::From { size: r.size } }
    fn default(_r: m::Default) -> m::Default { m::Default { value: 42 } }
});
unary_service!(Svc => bare::box_server::Box {
    fn pin(r: m::Box) -> m::Box { r }
});
unary_service!(Svc => bare::arc_server::Arc {
    fn clone(r: m::Arc) -> m::Arc { m::Arc { count: r.count + 1 } }
});
unary_service!(Svc => bare::default_server::Default {
    fn default(r: m::Default) -> m::Default { m::Default { value: -r.value } }
});
unary_service!(Svc => bare::context_server::Context {
    fn waker(r: m::Context) -> m::Context {
        let mut c = r;
        c.values.insert("woken".into(), "yes".into());
        c
    }
});
unary_service!(Svc => bare::poll_server::Poll {
    fn ready(r: m::Poll) -> m::Poll { m::Poll { ready: !r.ready } }
});
unary_service!(Svc => bare::body_server::Body {
    fn chunk(r: m::Body) -> m::Body { m::Body { chunk: r.chunk.into_iter().rev().collect() } }
});
unary_service!(Svc => bare::std_error_server::StdError {
    fn source(r: m::Error) -> m::Error {
        m::Error { reason: r.reason.to_uppercase(), detail: None }
    }
});
unary_service!(Svc => bare::box_future_server::BoxFuture {
    fn poll(r: m::Future) -> m::Poll { r.poll.unwrap_or_default() }
});

#[tokio::test]
async fn std_and_runtime_named_services_are_served_and_called() {
    let server = Server::builder()
        .add_service(rpc::result_server::ResultServer::new(Svc))
        .add_service(rpc::error_server::ErrorServer::new(Svc))
        .add_service(rpc::server_server::ServerServer::new(Svc))
        .add_service(rpc::client_server::ClientServer::new(Svc))
        .add_service(rpc::future_server::FutureServer::new(Svc))
        .add_service(rpc::codec_server::CodecServer::new(Svc))
        .add_service(rpc::string_server::StringServer::new(Svc))
        .add_service(rpc::vec_server::VecServer::new(Svc))
        .add_service(rpc::bytes_server::BytesServer::new(Svc))
        .add_service(rpc::send_server::SendServer::new(Svc))
        .add_service(rpc::debug_server::DebugServer::new(Svc))
        .add_service(rpc::stream_server::StreamServer::new(Svc))
        .add_service(rpc::infallible_server::InfallibleServer::new(Svc))
        .add_service(rpc::unpin_server::UnpinServer::new(Svc))
        .add_service(rpc::sized_server::SizedServer::new(Svc))
        .add_service(rpc::fn_server::FnServer::new(Svc))
        .add_service(rpc::into_request_server::IntoRequestServer::new(Svc))
        .add_service(rpc::service_server::ServiceServer::new(Svc))
        .add_service(rpc::ok_server::OkServer::new(Svc))
        .add_service(rpc::some_server::SomeServer::new(Svc))
        .add_service(rpc::sync_server::SyncServer::new(Svc))
        .add_service(bare::option_server::OptionServer::new(Svc))
        .add_service(bare::box_server::BoxServer::new(Svc))
        .add_service(bare::arc_server::ArcServer::new(Svc))
        .add_service(bare::default_server::DefaultServer::new(Svc))
        .add_service(bare::context_server::ContextServer::new(Svc))
        .add_service(bare::poll_server::PollServer::new(Svc))
        .add_service(bare::body_server::BodyServer::new(Svc))
        .add_service(bare::std_error_server::StdErrorServer::new(Svc))
        .add_service(bare::box_future_server::BoxFutureServer::new(Svc));
    with_server(server, |ch| async move {
        let result = rpc::result_client::ResultClient::new(ch.clone());
        let r = result.ok(m::Ok { value: 5 }).await.unwrap().into_inner();
        assert_eq!(r.option.unwrap().value.unwrap().text, "5");
        let r = result
            .err(m::Error {
                reason: "bad".into(),
                detail: Some(m::Bytes { data: vec![1] }),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.error.unwrap().detail.unwrap().data, [1]);
        let o = result
            .map(m::Option {
                value: Some(m::String { text: "up".into() }),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(o.value.unwrap().text, "UP");
        let v = result
            .unwrap(m::Box {
                items: Some(m::Vec {
                    strings: vec![m::String { text: "s".into() }],
                }),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(v.strings.len(), 1);

        let error = rpc::error_client::ErrorClient::new(ch.clone());
        let e = error
            .source(m::Error {
                reason: "io".into(),
                detail: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(e.reason, "caused by io");
        let d = error
            .description(m::String { text: "d".into() })
            .await
            .unwrap();
        assert_eq!(d.into_inner().text, "<d>");
        let f = error.fmt(m::Debug { text: "q".into() }).await.unwrap();
        assert_eq!(f.into_inner().text, "\"q\"");

        let server = rpc::server_client::ServerClient::new(ch.clone());
        let s = server.serve(m::Server { host: "h".into() }).await.unwrap();
        assert_eq!(s.into_inner().host, "h:50051");
        let s = server
            .add_service(m::Service { name: "Kv".into() })
            .await
            .unwrap();
        assert_eq!(s.into_inner().name, "KvServer");
        server.call(m::IncomingCall {}).await.unwrap();
        let s = server
            .methods(m::MethodDesc { path: "p".into() })
            .await
            .unwrap();
        assert_eq!(s.into_inner().path, "/p");
        let s = server
            .name(m::Name {
                value: "abc".into(),
            })
            .await
            .unwrap();
        assert_eq!(s.into_inner().value, "cba");
        let s = server.unimplemented(m::CallKind { kind: 1 }).await.unwrap();
        assert_eq!(s.into_inner().kind, 2);

        // Methods named like the runtime's call kinds and the client's own items.
        let client = rpc::client_client::ClientClient::new(ch.clone());
        let id = |s: &str| m::Client { id: s.into() };
        assert_eq!(
            client.unary(id("x")).await.unwrap().into_inner().id,
            "unary x"
        );
        let streamed = collect(client.server_streaming(id("s")).await.unwrap()).await;
        assert_eq!(
            streamed.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
            ["s0", "s1", "s2"]
        );
        assert_eq!(
            client.pipeline(id("p")).await.unwrap().into_inner().id,
            "pipeline p"
        );
        assert_eq!(
            client
                .unary_blocking(id("b"))
                .await
                .unwrap()
                .into_inner()
                .id,
            "blocking b"
        );
        // `as_ref` the method shadows `AsRef::as_ref` in method calls; the trait still works.
        assert_eq!(
            client
                .as_ref(m::Arc { count: 1 })
                .await
                .unwrap()
                .into_inner()
                .count,
            2
        );
        let _: &rpc_core::Channel = AsRef::as_ref(&client);
        let t = client
            .inner(m::TransportError { why: "w".into() })
            .await
            .unwrap();
        assert_eq!(t.into_inner().why, "w");
        // The blocking and pipeline clients of the same service.
        let blocking = rpc::client_client::ClientBlockingClient::from(client.clone());
        let pipelines = rpc::client_client::ClientPipelineClient::from(client.clone());
        let (b, p) = tokio::task::spawn_blocking(move || {
            let b = blocking.pipeline(id("bp")).unwrap().into_inner().id;
            let mut p = pipelines.unary_blocking().unwrap();
            p.submit(1, Request::new(id("pu"))).unwrap();
            let (tag, reply) = p.wait().unwrap();
            (b, (tag, reply.unwrap().into_inner().id))
        })
        .await
        .unwrap();
        assert_eq!(b, "pipeline bp");
        assert_eq!(p, (1, "blocking pu".to_owned()));

        let future = rpc::future_client::FutureClient::new(ch.clone());
        let p = future
            .poll(m::Future {
                poll: Some(m::Poll { ready: false }),
            })
            .await
            .unwrap();
        assert!(p.into_inner().ready);
        let p = future.r#await(m::Poll { ready: true }).await.unwrap();
        assert!(!p.into_inner().ready);
        let f = future.output(m::Fn { body: "x".into() }).await.unwrap();
        assert_eq!(f.into_inner().body, "{ x }");

        let codec = rpc::codec_client::CodecClient::new(ch.clone());
        let b = codec
            .encode(m::Bytes {
                data: vec![0, 0xf0],
            })
            .await
            .unwrap();
        assert_eq!(b.into_inner().data, [0xff, 0x0f]);
        let d = codec.decode(m::Bytes { data: vec![1, 2] }).await.unwrap();
        assert_eq!(d.into_inner().text, "2 bytes");
        let b = codec.body(m::Body { chunk: vec![7] }).await.unwrap();
        assert_eq!(b.into_inner().chunk, [7, 7]);

        let len = rpc::string_client::StringClient::new(ch.clone())
            .len(m::String {
                text: "four".into(),
            })
            .await
            .unwrap();
        assert_eq!(len.into_inner().len, 4);
        let v = rpc::vec_client::VecClient::new(ch.clone())
            .push(m::Vec::default())
            .await
            .unwrap();
        assert_eq!(v.into_inner().strings[0].text, "pushed");
        let b = rpc::bytes_client::BytesClient::new(ch.clone())
            .slice(m::Bytes {
                data: vec![1, 2, 3],
            })
            .await
            .unwrap();
        assert_eq!(b.into_inner().data, [2, 3]);
        let s = rpc::send_client::SendClient::new(ch.clone())
            .send(m::Send { sync: None })
            .await
            .unwrap();
        assert!(s.into_inner().locked);
        let d = rpc::debug_client::DebugClient::new(ch.clone())
            .fmt(m::Debug { text: "t".into() })
            .await
            .unwrap();
        assert_eq!(d.into_inner().text, "Debug(t)");
        let streamed = collect(
            rpc::stream_client::StreamClient::new(ch.clone())
                .next(m::Stream { items: vec![1, 2] })
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            streamed.into_iter().map(|s| s.items).collect::<Vec<_>>(),
            [vec![1], vec![2, 2]]
        );
        rpc::infallible_client::InfallibleClient::new(ch.clone())
            .never(m::Infallible {})
            .await
            .unwrap();
        rpc::unpin_client::UnpinClient::new(ch.clone())
            .unpin(m::Unpin {})
            .await
            .unwrap();
        let s = rpc::sized_client::SizedClient::new(ch.clone())
            .sized(m::Sized { len: 21 })
            .await
            .unwrap();
        assert_eq!(s.into_inner().len, 42);
        let f = rpc::fn_client::FnClient::new(ch.clone())
            .call(m::Fn { body: "b".into() })
            .await
            .unwrap();
        assert_eq!(f.into_inner().body, "call(b)");
        let i = rpc::into_request_client::IntoRequestClient::new(ch.clone())
            .into_request(m::IntoRequest { text: "t".into() })
            .await
            .unwrap();
        assert_eq!(i.into_inner().text, "t into request");
        let s = rpc::service_client::ServiceClient::new(ch.clone())
            .call(m::Service { name: "s".into() })
            .await
            .unwrap();
        assert_eq!(s.into_inner().name, "called s");
        let o = rpc::ok_client::OkClient::new(ch.clone())
            .ok(m::Ok { value: 1 })
            .await
            .unwrap();
        assert_eq!(o.into_inner().value, 2);
        let s = rpc::some_client::SomeClient::new(ch.clone())
            .some(m::Some { value: 2 })
            .await
            .unwrap();
        assert_eq!(s.into_inner().value, 6);
        let s = rpc::sync_client::SyncClient::new(ch.clone())
            .lock(m::Sync { locked: true })
            .await
            .unwrap();
        assert!(!s.into_inner().locked);

        // Generated without tonic.
        let option = bare::option_client::OptionClient::new(ch.clone());
        let s = option.some(m::Some { value: 1 }).await.unwrap();
        assert_eq!(s.into_inner().value, 11);
        option.none(m::None {}).await.unwrap();
        // The method `clone` shadows `Clone::clone` in method calls, as in tonic's clients.
        let c = option
            .clone(m::Clone {
                from: Some(m::Default { value: 1 }),
            })
            .await
            .unwrap();
        assert_eq!(c.into_inner().from.unwrap().value, 2);
        // A method `into` loses to `Into::into` (by value) in `client.into(..)`, as in tonic's
        // clients: call it by its path.
        let copy = Clone::clone(&option);
        let into = m::Into {
            size: Some(m::Sized { len: 3 }),
        };
        let f = bare::option_client::OptionClient::into(&copy, into)
            .await
            .unwrap();
        assert_eq!(f.into_inner().size.unwrap().len, 3);
        let d = option.default(m::Default { value: 0 }).await.unwrap();
        assert_eq!(d.into_inner().value, 42);
        let b = bare::box_client::BoxClient::new(ch.clone())
            .pin(m::Box { items: None })
            .await
            .unwrap();
        assert_eq!(b.into_inner().items, None);
        let a = bare::arc_client::ArcClient::new(ch.clone())
            .clone(m::Arc { count: 9 })
            .await
            .unwrap();
        assert_eq!(a.into_inner().count, 10);
        let d = bare::default_client::DefaultClient::new(ch.clone())
            .default(m::Default { value: 5 })
            .await
            .unwrap();
        assert_eq!(d.into_inner().value, -5);
        let c = bare::context_client::ContextClient::new(ch.clone())
            .waker(m::Context::default())
            .await
            .unwrap();
        assert_eq!(c.into_inner().values["woken"], "yes");
        let p = bare::poll_client::PollClient::new(ch.clone())
            .ready(m::Poll { ready: false })
            .await
            .unwrap();
        assert!(p.into_inner().ready);
        let b = bare::body_client::BodyClient::new(ch.clone())
            .chunk(m::Body { chunk: vec![1, 2] })
            .await
            .unwrap();
        assert_eq!(b.into_inner().chunk, [2, 1]);
        let e = bare::std_error_client::StdErrorClient::new(ch.clone())
            .source(m::Error {
                reason: "x".into(),
                detail: None,
            })
            .await
            .unwrap();
        assert_eq!(e.into_inner().reason, "X");
        let p = bare::box_future_client::BoxFutureClient::new(ch)
            .poll(m::Future {
                poll: Some(m::Poll { ready: true }),
            })
            .await
            .unwrap();
        assert!(p.into_inner().ready);
    })
    .await;
}
