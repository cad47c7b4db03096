//! `#[service]` end to end without a runtime: the generated modules, the bridge from the simple
//! trait to the tonic-shaped one, and handlers called through it.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use rpc_core::codegen::{CallKind, Idempotency, Service};
use rpc_core::{Code, Request, Response, Status, Streaming};

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetRequest {
    #[prost(string, tag = "1")]
    pub key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct GetReply {
    #[prost(bytes = "vec", tag = "1")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PutRequest {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Change {
    #[prost(string, tag = "1")]
    pub key: String,
}

/// A key-value store.
#[rpc_derive::service(package = "kv")]
pub trait Kv {
    /// Reads a key.
    #[rpc(no_side_effects)]
    async fn get(&self, request: GetRequest) -> Result<GetReply, Status>;

    /// Stores many keys.
    async fn put_many(&self, request: Streaming<PutRequest>) -> Result<(), Status>;

    /// The changes stream.
    type Changes: Stream<Item = Result<Change, Status>>;

    /// Watches keys.
    async fn watch(&self, request: GetRequest) -> Result<Self::Changes, Status>;

    /// With a default body.
    #[rpc(idempotent)]
    async fn ping(&self, _request: ()) -> Result<(), Status> {
        Ok(())
    }
}

struct Once(Option<Change>);

impl Stream for Once {
    type Item = Result<Change, Status>;
    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.get_mut().0.take().map(Ok))
    }
}

struct Store;

impl Kv for Store {
    async fn get(&self, request: GetRequest) -> Result<GetReply, Status> {
        if request.key.is_empty() {
            return Err(Status::invalid_argument("empty key"));
        }
        Ok(GetReply {
            value: request.key.into_bytes(),
        })
    }

    async fn put_many(&self, mut request: Streaming<PutRequest>) -> Result<(), Status> {
        while let Some(_put) = request.message().await? {}
        Ok(())
    }

    type Changes = Once;

    async fn watch(&self, request: GetRequest) -> Result<Once, Status> {
        Ok(Once(Some(Change { key: request.key })))
    }
}

#[test]
fn the_generated_modules_describe_the_service() {
    let paths: Vec<(&str, CallKind)> = kv_server::KvServer::<Store>::METHODS
        .iter()
        .map(|m| (m.path, m.kind))
        .collect();
    assert_eq!(
        paths,
        [
            ("/kv.Kv/Get", CallKind::Unary),
            ("/kv.Kv/PutMany", CallKind::ClientStreaming),
            ("/kv.Kv/Watch", CallKind::ServerStreaming),
            ("/kv.Kv/Ping", CallKind::Unary),
        ]
    );
    assert_eq!(kv_server::GET.id, rpc_core::method::method_id("/kv.Kv/Get"));
    let levels: Vec<Idempotency> = kv_server::KvServer::<Store>::METHODS
        .iter()
        .map(|m| m.idempotency)
        .collect();
    assert_eq!(
        levels,
        [
            Idempotency::NoSideEffects,
            Idempotency::Unknown,
            Idempotency::Unknown,
            Idempotency::Idempotent,
        ]
    );
    let server = kv_server::KvServer::new(Store);
    assert_eq!(server.name(), "kv.Kv");
    assert_eq!(server.methods().len(), 4);
}

#[tokio::test]
async fn the_simple_trait_serves_the_generated_one() {
    use kv_server::Kv as Generated;
    let reply = Generated::get(&Store, Request::new(GetRequest { key: "k".into() }))
        .await
        .unwrap();
    assert_eq!(reply.into_inner().value, b"k");
    let err = Generated::get(&Store, Request::new(GetRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let stream: Response<Once> =
        Generated::watch(&Store, Request::new(GetRequest { key: "w".into() }))
            .await
            .unwrap();
    let mut stream = stream.into_inner();
    let first = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await;
    assert_eq!(first.unwrap().unwrap().key, "w");
    assert!(Generated::ping(&Store, Request::new(())).await.is_ok());
}

/// Client signatures type-check (running them needs the runtime).
#[allow(dead_code)]
async fn client_calls(client: kv_client::KvClient) -> Result<(), Status> {
    let _: Response<GetReply> = client.get(GetRequest::default()).await?;
    let blocking = kv_client::KvBlockingClient::from(client.clone());
    let _: Response<GetReply> = blocking.get(GetRequest::default())?;
    let mut p = kv_client::KvPipelineClient::from(client.clone()).get()?;
    p.submit(1, Request::new(GetRequest::default()))?;
    let _: Option<(u64, Result<Response<GetReply>, Status>)> = p.wait();
    let _: Streaming<Change> = client.watch(GetRequest::default()).await?.into_inner();
    let _ = client.ping(()).await?;
    Ok(())
}

/// The runtime reached through a re-export (`crate = ".."`).
mod rt {
    pub use rpc_core::codegen;
}

/// A service without methods, with the runtime path overridden.
#[rpc_derive::service(crate = "crate::rt")]
pub trait Idle {}

struct Nobody;

impl Idle for Nobody {}

#[test]
fn crate_path_and_empty_services() {
    let server = idle_server::IdleServer::new(Nobody);
    assert_eq!(server.name(), "Idle");
    assert!(idle_server::IdleServer::<Nobody>::METHODS.is_empty());
}

/// A handler that needs metadata implements the generated (tonic-shaped) trait directly; the
/// bridge does not get in the way of a type that does not implement the simple trait.
struct WithMetadata;

impl kv_server::Kv for WithMetadata {
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetReply>, Status> {
        let user = request
            .metadata()
            .get_str("x-user")
            .unwrap_or("nobody")
            .to_owned();
        let mut reply = Response::new(GetReply {
            value: user.into_bytes(),
        });
        reply
            .metadata_mut()
            .insert("x-seen", "1")
            .expect("valid metadata");
        Ok(reply)
    }

    async fn put_many(&self, _: Request<Streaming<PutRequest>>) -> Result<Response<()>, Status> {
        Err(Status::unimplemented("put_many"))
    }

    type WatchStream = Once;

    async fn watch(&self, _: Request<GetRequest>) -> Result<Response<Once>, Status> {
        Ok(Response::new(Once(None)))
    }

    async fn ping(&self, _: Request<()>) -> Result<Response<()>, Status> {
        Ok(Response::new(()))
    }
}

#[tokio::test]
async fn the_generated_trait_can_be_implemented_directly() {
    use kv_server::Kv as Generated;
    let mut request = Request::new(GetRequest::default());
    request.metadata_mut().insert("x-user", "ada").unwrap();
    let reply = Generated::get(&WithMetadata, request).await.unwrap();
    assert_eq!(reply.metadata().get_str("x-seen"), Some("1"));
    assert_eq!(reply.into_inner().value, b"ada");
    let _server = kv_server::KvServer::new(WithMetadata);
}

/// Names tonic accepts that a glob import or suffixed entry points would take: a service named
/// like a runtime item, methods named like another method's blocking or pipeline entry point,
/// and like the runtime's types.
mod runtime_names {
    use super::GetRequest as Msg;

    // Default bodies: every method echoes its request.
    #[rpc_derive::service(package = "names")]
    pub trait Status {
        async fn run(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn run_pipeline(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn read(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn read_blocking(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn channel(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn methods(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
        async fn pipeline(&self, request: Msg) -> Result<Msg, rpc_core::Status> {
            Ok(request)
        }
    }
}

/// Every name keeps its meaning on each client type.
#[allow(dead_code)]
async fn runtime_named_calls(
    client: runtime_names::status_client::StatusClient,
) -> Result<(), Status> {
    use runtime_names::status_client::{StatusBlockingClient, StatusPipelineClient};
    let _: Response<GetRequest> = client.run_pipeline(GetRequest::default()).await?;
    let _: Response<GetRequest> = client.channel(GetRequest::default()).await?;
    let blocking = StatusBlockingClient::from(client.clone());
    let _: Response<GetRequest> = blocking.read_blocking(GetRequest::default())?;
    let _: Response<GetRequest> = blocking.read(GetRequest::default())?;
    let pipelines = StatusPipelineClient::from(client);
    let _: rpc_core::Pipeline<GetRequest, GetRequest> = pipelines.run()?;
    let _: rpc_core::Pipeline<GetRequest, GetRequest> = pipelines.pipeline()?;
    Ok(())
}

#[test]
fn runtime_named_services_and_methods_are_served() {
    struct Impl;
    impl runtime_names::Status for Impl {}
    let server = runtime_names::status_server::StatusServer::new(Impl);
    assert_eq!(server.name(), "names.Status");
    assert_eq!(server.methods().len(), 7);
    assert_eq!(
        runtime_names::status_server::METHODS.path,
        "/names.Status/Methods"
    );
}
