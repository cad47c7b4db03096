//! How a request reaches its handler: [`IncomingCall`] (what generated `Service::call` gets),
//! the handler tasks kept in the shard's task slab, and [`CallCtx`], the shard's view of one
//! call that a task uses to answer.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prost::Message;

use crate::buf::{CtxFamily, EncodeMsg, FutureTask, RecvSlot, SlotReader, TaskId, TaskSlab};
use crate::server::notify::ShardNotify;
use crate::{Metadata, Request, Response, Status};

/// The shard's view of one call while one of its tasks runs. Object-safe: generated code and
/// handler tasks do not name the provider.
pub trait CallCtx {
    /// Sends the unary response: the call's terminal frame.
    fn respond(&mut self, msg: &dyn EncodeMsg, metadata: &Metadata);

    /// Ends the call with `status` (not OK): the call's terminal frame.
    fn fail(&mut self, status: &Status);
}

/// The family of call contexts lent to tasks for one poll.
#[derive(Debug)]
pub struct CallFamily;

impl CtxFamily for CallFamily {
    type Ctx<'a> = dyn CallCtx + 'a;
}

/// The task slab of a shard.
pub(crate) type Tasks = TaskSlab<CallFamily, ShardNotify>;

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

fn reply_unary<Resp: Message>(out: Result<Response<Resp>, Status>, ctx: &mut dyn CallCtx) {
    match out {
        Ok(resp) => ctx.respond(resp.get_ref(), resp.metadata()),
        Err(status) => ctx.fail(&status),
    }
}

/// The status of a call whose handler panicked.
fn panicked(path: &str, payload: &(dyn std::any::Any + Send)) -> Status {
    let why = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    Status::internal(format!("the handler of {path} panicked: {why}"))
}

/// A handler future whose panic ends its call with INTERNAL instead of unwinding through (and
/// killing) the shard that polls it. Never polled again after it panicked.
struct CatchPanic<Fut> {
    fut: Fut,
    path: &'static str,
}

impl<Resp, Fut> Future for CatchPanic<Fut>
where
    Fut: Future<Output = Result<Response<Resp>, Status>>,
{
    type Output = Fut::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: structural pinning of `fut`: it is never moved out of `self`.
        let this = unsafe { self.get_unchecked_mut() };
        let path = this.path;
        // SAFETY: `this.fut` is pinned because `self` is.
        let fut = unsafe { Pin::new_unchecked(&mut this.fut) };
        // Unwind safety: after a panic the future is only dropped, never polled again (the
        // task completes with the INTERNAL status).
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(p) => p,
            Err(payload) => Poll::Ready(Err(panicked(path, payload.as_ref()))),
        }
    }
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
        let IncomingCall {
            tasks,
            ctx,
            payload,
            metadata,
            timeout,
            spawned,
            path,
        } = self;
        let message = match payload.decode::<Req>() {
            Ok(m) => m,
            Err(status) => {
                ctx.fail(&status);
                return Dispatched(());
            }
        };
        let request = Request::from_parts(metadata, message, timeout);
        let fut = match std::panic::catch_unwind(AssertUnwindSafe(|| handler(request))) {
            Ok(fut) => fut,
            Err(payload) => {
                ctx.fail(&panicked(path, payload.as_ref()));
                return Dispatched(());
            }
        };
        let task = FutureTask::new(CatchPanic { fut, path }, reply_unary::<Resp>);
        match tasks.spawn(task, ctx) {
            Ok(id) => *spawned = id,
            Err(_task) => {
                // No free task slot: the shard sizes its slab to the credits it grants, so this
                // means a peer exceeded them.
                ctx.fail(&Status::resource_exhausted("server has no free call slot"));
            }
        }
        Dispatched(())
    }

    /// Runs a server-streaming handler.
    pub fn server_streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: futures_core::Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        let _ = handler;
        self.streaming_not_supported()
    }

    /// Runs a client-streaming handler.
    pub fn client_streaming<Req, Resp, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        F: FnOnce(Request<crate::Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
    {
        let _ = handler;
        self.streaming_not_supported()
    }

    /// Runs a bidirectional-streaming handler.
    pub fn streaming<Req, Resp, S, F, Fut>(self, handler: F) -> Dispatched
    where
        Req: Message + Default + Send + 'static,
        Resp: Message + Send + 'static,
        S: futures_core::Stream<Item = Result<Resp, Status>> + Send + 'static,
        F: FnOnce(Request<crate::Streaming<Req>>) -> Fut,
        Fut: Future<Output = Result<Response<S>, Status>> + Send + 'static,
    {
        let _ = handler;
        self.streaming_not_supported()
    }

    fn streaming_not_supported(self) -> Dispatched {
        let msg = format!(
            "{}: streaming calls are not supported by this runtime yet",
            self.path
        );
        self.ctx.fail(&Status::unimplemented(msg));
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
