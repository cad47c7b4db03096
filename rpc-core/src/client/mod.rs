//! The client: a cheap `Clone + Send + Sync` [`Channel`] over one connection per server shard,
//! with a completion poller, futures and blocking calls.
//!
//! CONTRACT ONLY for now: the runtime behind it lands with issue 3.

use futures_core::Stream;
use prost::Message;

use crate::method::MethodDesc;
use crate::streaming::Streaming;
use crate::{Request, Response, Status};

/// A connection to a server, usable from many tasks at once. Cloning is cheap.
#[derive(Clone, Debug)]
pub struct Channel {
    _private: (),
}

impl Channel {
    /// Connects to the server at `addr` (`host:port`) with the default provider.
    ///
    /// # Errors
    /// When the address does not resolve, TCP connect fails or the handshake is refused.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the attempt and frees what it set up.
    pub async fn connect(addr: impl AsRef<str>) -> Result<Channel, crate::Error> {
        let _ = addr.as_ref();
        todo!("client runtime: issue 3")
    }

    /// A unary call.
    ///
    /// # Errors
    /// The call's [`Status`].
    ///
    /// # Cancel safety
    /// Dropping the future cancels the call: the server is told, and buffers return to their
    /// pools only after the NIC is done with them.
    pub async fn unary<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let _ = (method, request);
        todo!("client runtime: issue 3")
    }

    /// A unary call that blocks the calling thread, which polls the completion queue itself:
    /// the lowest latency.
    ///
    /// # Errors
    /// The call's [`Status`].
    pub fn unary_blocking<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let _ = (method, request);
        todo!("client runtime: issue 3")
    }

    /// A server-streaming call.
    ///
    /// # Errors
    /// The call's [`Status`] if it fails before the stream starts.
    pub async fn server_streaming<Req, Resp>(
        &self,
        method: &'static MethodDesc,
        request: Request<Req>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        Req: Message,
        Resp: Message + Default + 'static,
    {
        let _ = (method, request);
        todo!("streaming runtime: issue 7")
    }

    /// A client-streaming call.
    ///
    /// # Errors
    /// The call's [`Status`].
    pub async fn client_streaming<S, Resp>(
        &self,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Resp>, Status>
    where
        S: Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        let _ = (method, request);
        todo!("streaming runtime: issue 7")
    }

    /// A bidirectional-streaming call.
    ///
    /// # Errors
    /// The call's [`Status`] if it fails before the stream starts.
    pub async fn streaming<S, Resp>(
        &self,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        S: Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default + 'static,
    {
        let _ = (method, request);
        todo!("streaming runtime: issue 7")
    }
}
