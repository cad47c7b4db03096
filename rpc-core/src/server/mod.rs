//! The server: shards (one thread per core, each owning a CQ, its connections' QPs, slots and
//! in-flight calls), the acceptor, and the [`Service`] contract generated servers implement.
//!
//! CONTRACT ONLY for now: the runtime behind it lands with issue 3.

use std::future::Future;
use std::marker::PhantomData;

use futures_core::Stream;
use prost::Message;

use crate::method::MethodDesc;
use crate::streaming::Streaming;
use crate::{Request, Response, Status};

/// A service the server can dispatch to. Generated `*Server<T>` types implement it; users do not
/// need to.
pub trait Service: Send + Sync + 'static {
    /// Fully qualified service name (`package.Service`).
    fn name(&self) -> &'static str;

    /// The service's methods.
    fn methods(&self) -> &'static [MethodDesc];

    /// Starts the call of method `method` (an id from [`Service::methods`]): pick the handler
    /// and hand it to one of [`IncomingCall`]'s methods, or answer
    /// [`IncomingCall::unimplemented`].
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched;
}

/// A call that arrived for a service, not yet handed to its handler.
#[derive(Debug)]
pub struct IncomingCall<'a> {
    _shard: PhantomData<&'a mut ()>,
}

/// Proof that an [`IncomingCall`] was handled (returned by its methods).
#[derive(Debug)]
#[must_use]
pub struct Dispatched(());

impl IncomingCall<'_> {
    /// Runs a unary handler: decodes the request, calls `handler`, encodes its response or
    /// status.
    pub fn unary<Req, Resp, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
    {
        let _ = handler;
        todo!("server runtime: issue 3")
    }

    /// Runs a server-streaming handler.
    pub fn server_streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        let _ = handler;
        todo!("streaming runtime: issue 7")
    }

    /// Runs a client-streaming handler.
    pub fn client_streaming<Req, Resp, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
    {
        let _ = handler;
        todo!("streaming runtime: issue 7")
    }

    /// Runs a bidirectional-streaming handler.
    pub fn streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        let _ = handler;
        todo!("streaming runtime: issue 7")
    }

    /// Answers `UNIMPLEMENTED` (unknown method).
    pub fn unimplemented(self) -> Dispatched {
        todo!("server runtime: issue 3")
    }
}

/// How an idle shard waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Spin on the CQ forever: lowest latency, one core per shard.
    Busy,
    /// Spin, then yield, then sleep on the completion channel (default).
    #[default]
    Adaptive,
    /// Sleep on the completion channel whenever the CQ is empty.
    Event,
}

/// An RPC server. Built with [`Server::builder`].
#[derive(Debug)]
pub struct Server {
    _private: (),
}

impl Server {
    /// A builder with defaults: one shard, adaptive polling, provider from `RPC_PROVIDER`.
    pub fn builder() -> ServerBuilder {
        ServerBuilder { _private: () }
    }
}

/// Configures and starts a [`Server`].
#[derive(Debug)]
pub struct ServerBuilder {
    _private: (),
}

impl ServerBuilder {
    /// Adds a service (generated `*Server<T>`).
    pub fn add_service(self, service: impl Service) -> Self {
        let _ = service;
        todo!("server runtime: issue 3")
    }

    /// Number of shards (polling threads, one CQ each).
    pub fn shards(self, n: usize) -> Self {
        let _ = n;
        todo!("server runtime: issue 3")
    }

    /// How idle shards wait.
    pub fn poll_mode(self, mode: PollMode) -> Self {
        let _ = mode;
        todo!("server runtime: issue 3")
    }

    /// Binds the listener and starts the shards; returns a handle to the running server.
    ///
    /// # Errors
    /// When the address is invalid, the port is taken, or the device cannot be opened.
    pub async fn bind(self, addr: impl AsRef<str>) -> Result<RunningServer, crate::Error> {
        let _ = addr.as_ref();
        todo!("server runtime: issue 3")
    }

    /// Binds and serves until the process ends.
    ///
    /// # Errors
    /// As [`ServerBuilder::bind`].
    pub async fn serve(self, addr: impl AsRef<str>) -> Result<(), crate::Error> {
        let _ = addr.as_ref();
        todo!("server runtime: issue 3")
    }
}

/// A running server.
#[derive(Debug)]
pub struct RunningServer {
    _private: (),
}

impl RunningServer {
    /// The address the listener is bound to.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        todo!("server runtime: issue 3")
    }

    /// Stops accepting, finishes in-flight calls, then stops the shards.
    pub async fn shutdown(self) {
        todo!("server runtime: issue 3")
    }
}
