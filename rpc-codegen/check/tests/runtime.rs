//! Generated clients and servers through the real runtime (soft provider, loopback).
//!
//! Ignored on the `codegen` branch, whose runtime is the contract only (`todo!()` bodies); it
//! passes on a tree with the runtime of issue 3 (`cargo test -p rpc-codegen-check --test
//! runtime -- --ignored`). Unary calls only: streaming lands with issue 7.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::time::Duration;

use rpc_codegen_check::helloworld::{self, HelloReply, HelloRequest};
use rpc_codegen_check::test::everything::{self as ev, Type};
use rpc_core::server::Server;
use rpc_core::{Code, Request, Response, Status};

struct Greeter;

impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let name = &request.get_ref().name;
        if name.is_empty() {
            return Err(Status::invalid_argument("empty name"));
        }
        let user = request.metadata().get_str("x-user").unwrap_or("nobody");
        Ok(Response::new(HelloReply {
            message: format!("Hello {name}! ({user})"),
        }))
    }
}

struct Clock;

#[allow(deprecated)]
impl ev::clock_server::Clock for Clock {
    async fn now(&self, _: Request<()>) -> Result<Response<prost_types::Timestamp>, Status> {
        Ok(Response::new(prost_types::Timestamp {
            seconds: 1_800_000_000,
            nanos: 7,
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
        let mut t = r.into_inner();
        t.r#match += 1;
        Ok(Response::new(t))
    }

    async fn r#match(&self, r: Request<Type>) -> Result<Response<Type>, Status> {
        Ok(Response::new(r.into_inner()))
    }

    type AsyncStream = futures_stream::Empty<Type>;

    async fn r#async(&self, _: Request<Type>) -> Result<Response<Self::AsyncStream>, Status> {
        Err(Status::unimplemented("streaming"))
    }

    async fn r#loop(
        &self,
        _: Request<rpc_core::Streaming<Type>>,
    ) -> Result<Response<Type>, Status> {
        Err(Status::unimplemented("streaming"))
    }

    async fn self_(&self, r: Request<Type>) -> Result<Response<Type>, Status> {
        Ok(Response::new(r.into_inner()))
    }
}

mod futures_stream {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A stream that ends at once.
    pub struct Empty<T = super::Type>(std::marker::PhantomData<T>);

    impl<T> Default for Empty<T> {
        fn default() -> Self {
            Empty(std::marker::PhantomData)
        }
    }

    impl<T> futures_core::Stream for Empty<T> {
        type Item = Result<T, super::Status>;
        fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            Poll::Ready(None)
        }
    }
}

#[tokio::test]
async fn generated_stubs_call_through_the_runtime() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let server = Server::builder()
            .add_service(helloworld::greeter_server::GreeterServer::new(Greeter))
            .add_service(ev::clock_server::ClockServer::new(Clock))
            .add_service(ev::keywords_server::KeywordsServer::new(Keywords))
            .bind("127.0.0.1:0")
            .await
            .unwrap();
        let addr = server.local_addr().to_string();

        let greeter = helloworld::greeter_client::GreeterClient::connect(&addr)
            .await
            .unwrap();
        let mut request = Request::new(HelloRequest { name: "Ada".into() });
        request.metadata_mut().insert("x-user", "alice").unwrap();
        request.set_timeout(Duration::from_secs(5));
        let reply = greeter.say_hello(request).await.unwrap();
        assert_eq!(reply.get_ref().message, "Hello Ada! (alice)");

        let err = greeter
            .say_hello(HelloRequest::default())
            .await
            .unwrap_err();
        assert_eq!(
            (err.code(), err.message()),
            (Code::InvalidArgument, "empty name")
        );

        let blocking = helloworld::greeter_client::GreeterBlockingClient::from(greeter.clone());
        let reply = tokio::task::spawn_blocking(move || {
            blocking.say_hello(HelloRequest { name: "B".into() })
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(reply.get_ref().message, "Hello B! (nobody)");

        // One channel, several services; well-known types; keyword method names.
        let channel = greeter.as_ref().clone();
        let clock = ev::clock_client::ClockClient::new(channel.clone());
        assert_eq!(
            clock.now(()).await.unwrap().get_ref().seconds,
            1_800_000_000
        );
        clock.ping(()).await.unwrap();
        let kw = ev::keywords_client::KeywordsClient::new(channel);
        let t = kw
            .r#type(Type {
                r#match: 41,
                ..Type::default()
            })
            .await
            .unwrap();
        assert_eq!(t.get_ref().r#match, 42);
        let same = kw
            .self_(Type {
                self_: "me".into(),
                ..Type::default()
            })
            .await
            .unwrap();
        assert_eq!(same.get_ref().self_, "me");

        // A service the server does not have.
        let deep = rpc_codegen_check::test::nested::deep::deep_client::DeepClient::new(
            greeter.as_ref().clone(),
        );
        let err = deep
            .locate(rpc_codegen_check::test::common::Point::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented, "{err:?}");

        server.shutdown().await;
    })
    .await
    .expect("the runtime test took more than 60 s");
}

/// `test/names.proto`: services, messages and methods named like runtime items or like other
/// methods' blocking and pipeline entry points, and a service named `Self`, served and called.
mod names {
    use rpc_codegen_check::test::names::{self as n, self__server, status_server};
    use rpc_core::{Request, Response, Status};

    pub struct Svc;

    impl status_server::Status for Svc {
        async fn run(&self, r: Request<n::Request>) -> Result<Response<n::Response>, Status> {
            Ok(Response::new(n::Response {
                request: Some(r.into_inner()),
            }))
        }
        async fn run_pipeline(
            &self,
            r: Request<n::Request>,
        ) -> Result<Response<n::Response>, Status> {
            let mut request = r.into_inner();
            request.text.push_str(" (pipeline)");
            Ok(Response::new(n::Response {
                request: Some(request),
            }))
        }
        async fn read(&self, r: Request<n::Streaming>) -> Result<Response<n::Streaming>, Status> {
            Ok(Response::new(n::Streaming {
                id: r.into_inner().id + 1,
            }))
        }
        async fn read_blocking(
            &self,
            r: Request<n::Streaming>,
        ) -> Result<Response<n::Streaming>, Status> {
            Ok(Response::new(n::Streaming {
                id: r.into_inner().id + 2,
            }))
        }
        async fn channel(&self, r: Request<n::Code>) -> Result<Response<n::Code>, Status> {
            Ok(Response::new(r.into_inner()))
        }
        async fn methods(&self, r: Request<n::Code>) -> Result<Response<n::Code>, Status> {
            Ok(Response::new(r.into_inner()))
        }
        type MetadataStream = super::futures_stream::Empty<n::Code>;
        async fn metadata(
            &self,
            _: Request<n::Code>,
        ) -> Result<Response<Self::MetadataStream>, Status> {
            Ok(Response::new(super::futures_stream::Empty::default()))
        }
    }

    impl self__server::Self_ for Svc {
        async fn self_(&self, r: Request<n::Code>) -> Result<Response<n::Code>, Status> {
            Ok(Response::new(n::Code {
                code: r.into_inner().code * 2,
            }))
        }
    }
}

#[tokio::test]
async fn runtime_named_services_are_served_and_called() {
    use rpc_codegen_check::test::names::{
        self as n, self__client, self__server, status_client, status_server,
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        let server = Server::builder()
            .add_service(status_server::StatusServer::new(names::Svc))
            .add_service(self__server::Self_Server::new(names::Svc))
            .bind("127.0.0.1:0")
            .await
            .unwrap();
        let addr = server.local_addr().to_string();
        let client = status_client::StatusClient::connect(&addr).await.unwrap();
        let text = |r: Response<n::Response>| r.into_inner().request.unwrap().text;
        let req = || n::Request { text: "hi".into() };
        assert_eq!(text(client.run(req()).await.unwrap()), "hi");
        assert_eq!(
            text(client.run_pipeline(req()).await.unwrap()),
            "hi (pipeline)"
        );
        let read = client.read(n::Streaming { id: 1 }).await.unwrap();
        assert_eq!(read.into_inner().id, 2);
        let code = client.channel(n::Code { code: 7 }).await.unwrap();
        assert_eq!(code.into_inner().code, 7);

        // The blocking and pipeline clients keep every method's own name.
        let blocking = status_client::StatusBlockingClient::from(client.clone());
        let pipelines = status_client::StatusPipelineClient::from(client.clone());
        let (blocking_id, pipelined) = tokio::task::spawn_blocking(move || {
            let id = blocking
                .read_blocking(n::Streaming { id: 1 })
                .unwrap()
                .into_inner()
                .id;
            let mut p = pipelines.run().unwrap();
            p.submit(9, Request::new(req())).unwrap();
            let (tag, reply) = p.wait().unwrap();
            (id, (tag, text(reply.unwrap())))
        })
        .await
        .unwrap();
        assert_eq!(blocking_id, 3);
        assert_eq!(pipelined, (9, "hi".to_owned()));

        let me = self__client::Self_Client::connect(&addr).await.unwrap();
        let doubled = me.self_(n::Code { code: 21 }).await.unwrap();
        assert_eq!(doubled.into_inner().code, 42);
        server.shutdown().await;
    })
    .await
    .expect("in time");
}
