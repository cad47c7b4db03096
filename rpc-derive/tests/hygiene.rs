//! What `#[service]` generates compiles under `#![no_implicit_prelude]`, next to items that
//! shadow the names it could have used unqualified.

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ping {
    #[prost(uint32, tag = "1")]
    pub n: u32,
}

#[no_implicit_prelude]
#[allow(dead_code)]
mod hygiene {
    // Shadows of prelude and runtime names.
    pub struct Result;
    pub struct Option;
    pub struct Request;
    pub struct Response;
    pub struct Future;
    pub struct Arc;
    pub struct Channel;
    pub struct Status;
    pub struct Pipeline;
    pub struct Message;
    pub struct Metadata;
    pub struct Stream;
    pub struct Service;
    pub struct MethodDesc;
    pub struct CallKind;
    pub trait Send {}
    pub trait Sync {}
    pub trait Clone {}

    /// A service defined without the prelude.
    #[::rpc_derive::service(package = "h")]
    pub trait Echo {
        /// Unary.
        async fn echo(
            &self,
            request: super::Ping,
        ) -> ::core::result::Result<super::Ping, ::rpc_core::Status>;

        /// Stream of pings.
        type Pings: ::futures_core::Stream<Item = ::core::result::Result<super::Ping, ::rpc_core::Status>>;

        /// Server streaming.
        async fn pings(
            &self,
            request: super::Ping,
        ) -> ::core::result::Result<Self::Pings, ::rpc_core::Status>;

        /// Client streaming.
        async fn sink(
            &self,
            request: ::rpc_core::Streaming<super::Ping>,
        ) -> ::core::result::Result<super::Ping, ::rpc_core::Status>;

        /// Default body.
        async fn nothing(&self, _request: ()) -> ::core::result::Result<(), ::rpc_core::Status> {
            ::core::result::Result::Ok(())
        }
    }
}

struct Impl;

struct NoPings;

impl futures_core::Stream for NoPings {
    type Item = Result<Ping, rpc_core::Status>;
    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::task::Poll::Ready(None)
    }
}

impl hygiene::Echo for Impl {
    async fn echo(&self, request: Ping) -> Result<Ping, rpc_core::Status> {
        Ok(Ping { n: request.n + 1 })
    }

    type Pings = NoPings;

    async fn pings(&self, _request: Ping) -> Result<NoPings, rpc_core::Status> {
        Ok(NoPings)
    }

    async fn sink(&self, _request: rpc_core::Streaming<Ping>) -> Result<Ping, rpc_core::Status> {
        Ok(Ping::default())
    }
}

#[tokio::test]
async fn hygienic_service_works() {
    use hygiene::echo_server::Echo as _;
    let reply = Impl
        .echo(rpc_core::Request::new(Ping { n: 1 }))
        .await
        .expect("echo");
    assert_eq!(reply.into_inner().n, 2);
    let server = hygiene::echo_server::EchoServer::new(Impl);
    assert_eq!(rpc_core::codegen::Service::name(&server), "h.Echo");
    assert_eq!(hygiene::echo_server::EchoServer::<Impl>::METHODS.len(), 4);
}
