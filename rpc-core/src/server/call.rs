//! How a request reaches its handler: [`IncomingCall`] (what generated `Service::call` gets),
//! the handler tasks kept in the shard's task slab, and [`CallCtx`], the shard's view of one
//! call that a task uses to answer.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use prost::Message;

use crate::buf::{
    CtxFamily, EncodeMsg, FutureTask, RecvSlot, SlabTask, SlotReader, Spawned, TaskId, TaskSlab,
};
use crate::server::notify::ShardNotify;
use crate::streaming::{Inbox, Streaming};
use crate::{Metadata, Request, Response, Status};

/// The shard's view of one call while one of its tasks runs. Object-safe: generated code and
/// handler tasks do not name the provider.
pub trait CallCtx {
    /// Sends the unary response: the call's terminal frame.
    fn respond(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata);

    /// Ends the call with `status` (not OK): the call's terminal frame.
    fn fail(&mut self, status: &Status);

    /// The connection the call arrived on, for one-sided bulk operations.
    fn peer(&self) -> Option<crate::server::Peer> {
        None
    }

    /// Server streams: whether a message can be sent now (window, credit and a send slot).
    /// When not, the call's task is woken once it can.
    fn stream_ready(&mut self) -> bool;

    /// Server streams: sends one message (the first one carries `metadata`).
    ///
    /// # Errors
    /// The status the call must end with (e.g. the message is too large), or `CANCELLED` when
    /// the call is gone.
    fn send_stream(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata) -> Result<(), Status>;

    /// Ends a streaming call with OK and `metadata`: its trailers, preceded by the response
    /// headers when no message carried them (one block, the headers first).
    fn finish_ok(&mut self, metadata: &Metadata);
}

/// The family of call contexts lent to tasks for one poll.
#[derive(Debug)]
pub struct CallFamily;

impl CtxFamily for CallFamily {
    type Ctx<'a> = dyn CallCtx + 'a;
}

/// The task slab of a shard.
pub(crate) type Tasks = TaskSlab<CallFamily, ShardNotify>;

/// A server-streaming or bidi handler: first its future, then the stream it returned.
struct ServerStream<Fut, S> {
    state: StreamState<Fut, S>,
}

enum StreamState<Fut, S> {
    Handler(Pin<Box<Fut>>),
    Stream {
        stream: Pin<Box<S>>,
        /// The response headers until the first message carries them.
        metadata: Option<Metadata>,
        trailers: Metadata,
    },
    Done,
}

impl<Fut, S, Resp> SlabTask<CallFamily> for ServerStream<Fut, S>
where
    Fut: Future<Output = Result<Response<S>, Status>> + Send,
    S: Stream<Item = Result<Resp, Status>> + Send,
    Resp: Message,
{
    fn poll<'a>(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        ctx: &'a mut (dyn CallCtx + 'a),
    ) -> Poll<()> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                StreamState::Handler(fut) => match fut.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(status)) => {
                        this.state = StreamState::Done;
                        ctx.fail(&status);
                        return Poll::Ready(());
                    }
                    Poll::Ready(Ok(resp)) => {
                        let (metadata, stream, trailers) = resp.into_all_parts();
                        this.state = StreamState::Stream {
                            stream: Box::pin(stream),
                            metadata: Some(metadata),
                            trailers,
                        };
                    }
                },
                StreamState::Stream {
                    stream,
                    metadata,
                    trailers,
                } => {
                    // Pull the next message only when it can go out: back-pressure reaches the
                    // handler's stream instead of piling up here.
                    if !ctx.stream_ready() {
                        return Poll::Pending;
                    }
                    match stream.as_mut().poll_next(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Some(Ok(msg))) => {
                            let md = metadata.take().unwrap_or_default();
                            if let Err(status) = ctx.send_stream(&msg, &md) {
                                this.state = StreamState::Done;
                                ctx.fail(&status);
                                return Poll::Ready(());
                            }
                        }
                        Poll::Ready(Some(Err(status))) => {
                            this.state = StreamState::Done;
                            ctx.fail(&status);
                            return Poll::Ready(());
                        }
                        Poll::Ready(None) => {
                            let trailers = std::mem::take(trailers);
                            // Headers no message carried go with the trailers.
                            let end = match metadata.take() {
                                Some(headers) if !headers.is_empty() => {
                                    Metadata::join(headers, trailers)
                                }
                                _ => Ok(trailers),
                            };
                            this.state = StreamState::Done;
                            match end {
                                Ok(md) => ctx.finish_ok(&md),
                                Err(e) => ctx.fail(&Status::internal(e.to_string())),
                            }
                            return Poll::Ready(());
                        }
                    }
                }
                StreamState::Done => return Poll::Ready(()),
            }
        }
    }
}

/// A received request payload, owned until decoded.
pub(crate) enum Payload {
    /// Eager: bytes `start..end` of a receive slot.
    Slot {
        slot: RecvSlot,
        start: usize,
        end: usize,
    },
    /// Rendezvous: the whole of a buffer the payload was READ into.
    Owned(Box<dyn AsRef<[u8]> + Send>),
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::Slot { slot, start, end } => {
                write!(f, "Payload::Slot({slot:?}, {start}..{end})")
            }
            Payload::Owned(b) => write!(f, "Payload::Owned({} bytes)", b.as_ref().as_ref().len()),
        }
    }
}

impl Payload {
    fn decode<M: Message + Default>(self) -> Result<M, Status> {
        let r = match self {
            Payload::Slot { slot, start, end } => M::decode(SlotReader::new(slot, start, end)),
            Payload::Owned(b) => {
                let n = b.as_ref().as_ref().len();
                M::decode(SlotReader::new(OwnedBytes(b), 0, n))
            }
        };
        r.map_err(|e| Status::internal(format!("failed to decode request: {e}")))
    }
}

struct OwnedBytes(Box<dyn AsRef<[u8]> + Send>);

impl AsRef<[u8]> for OwnedBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().as_ref()
    }
}

impl crate::buf::Lend for OwnedBytes {}

/// A call that arrived for a service, not yet handed to its handler. Generated `Service::call`
/// implementations pass it to one of its methods.
pub struct IncomingCall<'a> {
    pub(crate) tasks: &'a mut Tasks,
    pub(crate) ctx: &'a mut (dyn CallCtx + 'a),
    pub(crate) payload: Payload,
    pub(crate) metadata: Metadata,
    pub(crate) timeout: Option<Duration>,
    pub(crate) spawned: &'a mut Option<TaskId>,
    pub(crate) path: &'static str,
    /// The inbox of the client's stream (client-streaming and bidi calls).
    pub(crate) inbox: Option<Arc<Inbox>>,
}

impl std::fmt::Debug for IncomingCall<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingCall")
            .field("path", &self.path)
            .field("metadata", &self.metadata)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Proof that an [`IncomingCall`] was handled (returned by its methods).
#[derive(Debug)]
#[must_use]
pub struct Dispatched(());

/// Calls a handler (which builds its future); a panic fails the call with INTERNAL.
fn call_handler<R>(ctx: &mut dyn CallCtx, path: &str, f: impl FnOnce() -> R) -> Option<R> {
    // Unwind safety: on a panic nothing the closure touched is used again.
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(payload) => {
            ctx.fail(&panicked(path, payload.as_ref()));
            None
        }
    }
}

/// What an [`IncomingCall`] carries for its handler's request.
struct CallParts {
    payload: Payload,
    metadata: Metadata,
    timeout: Option<Duration>,
    inbox: Option<Arc<Inbox>>,
}

/// The request of a unary or server-streaming call: its metadata and the message decoded from
/// its payload (a message that does not decode fails the call).
fn message_request<Req: Message + Default>(
    ctx: &mut dyn CallCtx,
    parts: CallParts,
) -> Option<Request<Req>> {
    let message = match parts.payload.decode::<Req>() {
        Ok(m) => m,
        Err(status) => {
            ctx.fail(&status);
            return None;
        }
    };
    let mut request = Request::from_parts(parts.metadata, message, parts.timeout);
    request.set_peer(ctx.peer());
    Some(request)
}

/// The request of a client-streaming or bidi call: its metadata and the client's stream.
fn stream_request<Req>(ctx: &mut dyn CallCtx, parts: CallParts) -> Option<Request<Streaming<Req>>> {
    let Some(inbox) = parts.inbox else {
        ctx.fail(&Status::internal(
            "streaming call without the client's stream",
        ));
        return None;
    };
    let mut request =
        Request::from_parts(parts.metadata, Streaming::from_inbox(inbox), parts.timeout);
    request.set_peer(ctx.peer());
    Some(request)
}

fn spawn<'a, T: SlabTask<CallFamily> + 'static>(
    tasks: &mut Tasks,
    ctx: &'a mut (dyn CallCtx + 'a),
    spawned: &mut Option<TaskId>,
    path: &'static str,
    task: T,
) {
    match tasks.spawn(task, &mut *ctx) {
        Ok(Spawned::Parked(id)) => *spawned = Some(id),
        Ok(Spawned::Done) => {}
        Ok(Spawned::Panicked(payload)) => ctx.fail(&panicked(path, payload.as_ref())),
        Err(_task) => {
            // No free task slot: more calls in flight than the shard's `max_calls_per_shard`.
            ctx.fail(&Status::resource_exhausted("server has no free call slot"));
        }
    }
}

fn reply_unary<Resp: Message>(out: Result<Response<Resp>, Status>, ctx: &mut dyn CallCtx) {
    match out {
        Ok(resp) if resp.trailers().is_empty() => ctx.respond(resp.get_ref(), resp.metadata()),
        Ok(resp) => {
            let (headers, msg, trailers) = resp.into_all_parts();
            match Metadata::join(headers, trailers) {
                Ok(md) => ctx.respond(&msg, &md),
                Err(e) => ctx.fail(&Status::internal(e.to_string())),
            }
        }
        Err(status) => ctx.fail(&status),
    }
}

/// The status of a call whose handler panicked.
pub(crate) fn panicked(path: &str, payload: &(dyn std::any::Any + Send)) -> Status {
    let why = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    // The panic text may hold anything of the server's: it is logged here, never sent.
    tracing::error!("the handler of {path} panicked: {why}");
    Status::internal("handler panicked")
}

impl IncomingCall<'_> {
    /// Runs a unary handler: decodes the request from the receive buffer, calls `handler`, and
    /// encodes its response (or status) straight into a send slot. A handler whose future is
    /// ready at once runs to completion here; one that waits is parked in the shard's task slab
    /// and polled again when woken.
    pub fn unary<Req, Resp, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
    {
        self.run(message_request::<Req>, handler, |fut| {
            FutureTask::new(fut, reply_unary::<Resp>)
        })
    }

    /// Runs a server-streaming handler: decodes the request, awaits the handler, then sends
    /// each message of the stream it returned (flow-controlled by the client's window) and the
    /// final status.
    pub fn server_streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        self.run(message_request::<Req>, handler, |fut| ServerStream {
            state: StreamState::Handler(Box::pin(fut)),
        })
    }

    /// Runs a client-streaming handler: it gets the client's messages as a [`Streaming`] and
    /// answers once.
    pub fn client_streaming<Req, Resp, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
    {
        self.run(stream_request::<Req>, handler, |fut| {
            FutureTask::new(fut, reply_unary::<Resp>)
        })
    }

    /// Runs a bidirectional-streaming handler: the client's messages as a [`Streaming`], the
    /// handler's as the stream it returns.
    pub fn streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        self.run(stream_request::<Req>, handler, |fut| ServerStream {
            state: StreamState::Handler(Box::pin(fut)),
        })
    }

    /// What every kind of call does: `request` makes the handler's request of the call's
    /// parts (`None`: it failed the call already), `handler` makes its future (a panic fails
    /// the call), and `task` the shard task that drives that future and answers.
    fn run<R, Fut, T: SlabTask<CallFamily> + 'static>(
        self,
        request: impl FnOnce(&mut dyn CallCtx, CallParts) -> Option<R>,
        handler: impl FnOnce(R) -> Fut,
        task: impl FnOnce(Fut) -> T,
    ) -> Dispatched {
        let IncomingCall {
            tasks,
            ctx,
            payload,
            metadata,
            timeout,
            spawned,
            path,
            inbox,
        } = self;
        let parts = CallParts {
            payload,
            metadata,
            timeout,
            inbox,
        };
        let Some(request) = request(&mut *ctx, parts) else {
            return Dispatched(());
        };
        let Some(fut) = call_handler(&mut *ctx, path, || handler(request)) else {
            return Dispatched(());
        };
        spawn(tasks, ctx, spawned, path, task(fut));
        Dispatched(())
    }

    /// Answers `UNIMPLEMENTED` (unknown method).
    pub fn unimplemented(self) -> Dispatched {
        let msg = format!("method {} is not implemented by this server", self.path);
        self.ctx.fail(&Status::unimplemented(msg));
        Dispatched(())
    }

    /// The metadata that came with the call.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }
}

/// A service whose calls pass an [`Interceptor`](crate::Interceptor) before they reach
/// their handlers (tonic's `InterceptedService`): generated servers build one with
/// `with_interceptor`. A refused call ends with the interceptor's status and never reaches a
/// handler.
#[derive(Clone, Debug)]
pub struct InterceptedService<S, F> {
    inner: S,
    f: F,
}

impl<S, F> InterceptedService<S, F> {
    /// Serves `inner`, running `f` first on every call.
    pub fn new(inner: S, f: F) -> Self {
        InterceptedService { inner, f }
    }
}

impl<S: crate::server::Service, F: crate::Interceptor> crate::server::Service
    for InterceptedService<S, F>
{
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn methods(&self) -> &'static [crate::MethodDesc] {
        self.inner.methods()
    }

    fn call(&self, method: u32, mut call: IncomingCall<'_>) -> Dispatched {
        let metadata = std::mem::take(&mut call.metadata);
        match self.f.call(Request::from_parts(metadata, (), call.timeout)) {
            Ok(request) => {
                let (metadata, (), timeout) = request.into_parts();
                call.metadata = metadata;
                call.timeout = timeout;
                self.inner.call(method, call)
            }
            Err(status) => {
                call.ctx.fail(&status);
                Dispatched(())
            }
        }
    }
}
