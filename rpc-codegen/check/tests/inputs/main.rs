//! The generator's test inputs of issue 18, served and called end to end on the default
//! provider (loopback): well-known types, message shapes, proto2, runtime-named services, split
//! packages and HTTP annotations. Every handler transforms what it gets, and every test asserts
//! on what came back. Calls are bounded by timeouts; nothing spins.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prost::Message as _;
use prost_types::value::Kind;
use prost_types::{Any, ListValue, Struct, Value};
use rpc_codegen_check::test;
use rpc_core::server::Server;
use rpc_core::{Channel, Code, Request, Response, Status};

/// A stream of the items of a vector (what a streaming handler returns).
#[derive(Debug)]
pub struct Iter<T>(std::vec::IntoIter<T>);

impl<T> Iter<T> {
    fn new(items: Vec<T>) -> Self {
        Iter(items.into_iter())
    }
}

impl<T: Unpin> futures_core::Stream for Iter<T> {
    type Item = Result<T, Status>;
    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.get_mut().0.next().map(Ok))
    }
}

/// Every message of a response stream, in order.
async fn collect<T: prost::Message + Default>(
    response: Response<rpc_core::Streaming<T>>,
) -> Vec<T> {
    let mut stream = response.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        out.push(m);
    }
    out
}

/// Serves `server`, runs `calls` on a channel to it, shuts it down; all within 60 s.
async fn with_server<F, Fut>(server: rpc_core::server::ServerBuilder, calls: F)
where
    F: FnOnce(Channel) -> Fut,
    Fut: Future<Output = ()>,
{
    tokio::time::timeout(Duration::from_secs(60), async {
        let server = server.bind("127.0.0.1:0").await.unwrap();
        let channel = Channel::connect(server.local_addr().to_string())
            .await
            .unwrap();
        calls(channel).await;
        server.shutdown().await;
    })
    .await
    .expect("the calls took more than 60 s");
}

/// Implements a generated server trait whose methods are all unary, each by a closure-like
/// body over the request message.
macro_rules! unary_service {
    ($svc:ty => $($trait:ident)::+ {
        $( fn $name:ident($req:ident: $in:ty) -> $out:ty $body:block )*
    }) => {
        impl $($trait)::+ for $svc {
            $(
                async fn $name(
                    &self,
                    request: ::rpc_core::Request<$in>,
                ) -> ::core::result::Result<::rpc_core::Response<$out>, ::rpc_core::Status> {
                    let $req = request.into_inner();
                    ::core::result::Result::Ok(::rpc_core::Response::new($body))
                }
            )*
        }
    };
}

mod collide;
mod grpc;
mod http;
mod legacy;
mod shapes;
mod split;
mod wkt;
