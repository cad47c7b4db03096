//! Streaming calls: the caller side (starting a stream, the client stream's window and pump,
//! the inbox host of the server's stream) and the driver's queue of client stream messages.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use prost::Message;

use crate::buf::{BulkBuf, EncodeMsg, NoMsg};
use crate::call::{desc, lend_read};
use crate::client::{ClientPoller, RegHandle};
use crate::link::{CommitError, FrameError, LinkError};
use crate::method::MethodDesc;
use crate::streaming::{Inbox, InboxHost, STREAM_LOANS, Streaming};
use crate::verbs::Provider;
use crate::wire::MAX_HEADER_LEN;
use crate::{Metadata, Request, Response, Status};

use super::submit::{CellGuard, decode_outcome};
use super::{ClientCore, Driver, StreamSend};

impl<P: Provider> ClientCore<P> {
    /// Starts a streaming call: sends its Request (with `msg` for server streaming, metadata
    /// only otherwise) and returns its cell and, for server-streaming and bidi calls, the
    /// `Streaming` of the server's messages.
    pub(super) async fn start_stream<Resp: Message + Default>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        metadata: &Metadata,
        msg: &dyn EncodeMsg,
        timeout: Option<Duration>,
        registered: Option<RegHandle>,
    ) -> Result<(u32, u32, Option<Streaming<Resp>>), Status> {
        let (idx, generation) = self.acquire().await?;
        let mut guard = CellGuard::new(self, idx, generation, false);
        let slot = self.send_slot().await?;
        let mut sub = self.prepare(slot, method, metadata, msg, timeout, None, registered)?;
        let streaming = if method.kind.server_streams() {
            let inbox = Inbox::new(self.stream_window, self.stream_window_max);
            inbox.set_host(Box::new(CallHost {
                core: Arc::clone(self),
                idx,
                generation,
            }));
            sub.inbox = Some(Arc::clone(&inbox));
            Some(Streaming::from_inbox(inbox))
        } else {
            None
        };
        self.submit(idx, generation, sub)?;
        guard.submitted = true;
        std::mem::forget(guard);
        Ok((idx, generation, streaming))
    }

    /// Whether the call in cell `idx` is still the one of `generation` and not over.
    pub(super) fn call_live(&self, idx: u32, generation: u32) -> bool {
        let c = self.cells.get(idx);
        c.generation.load(Ordering::Acquire) == generation && !self.is_dead() && c.mb.is_running()
    }

    /// Queues one client stream message, waiting while the stream window is used up.
    ///
    /// The caller-side window mirrors the wire's: a message is staged into a send slot only
    /// when the window has room, so the driver can post it at once (credit permitting).
    pub(super) async fn send_item(
        &self,
        idx: u32,
        generation: u32,
        msg: &dyn EncodeMsg,
    ) -> Result<(), Status> {
        let cell = self.cells.get(idx);
        let len = msg.encoded_len();
        let large = MAX_HEADER_LEN + len > self.eager_limit;
        // Room in the window, and for a large message a loan below `STREAM_LOANS`.
        let may_go = || {
            cell.window.load(Ordering::Acquire) > 0
                && (!large || (cell.loans.load(Ordering::Acquire) as usize) < STREAM_LOANS)
        };
        std::future::poll_fn(|cx| {
            if !self.call_live(idx, generation) || may_go() {
                return Poll::Ready(());
            }
            cell.send_waker.register(cx.waker());
            if may_go() {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await;
        if !self.call_live(idx, generation) {
            return Err(self.dead_status_or_ended());
        }
        let md = Metadata::new();
        let slot = self.send_slot().await?;
        let (staged, bulk) = if !large {
            (self.stage(slot, &md, msg)?, None)
        } else {
            if len as u64 > self.max_message {
                return Err(Status::resource_exhausted(format!(
                    "stream message of {len} bytes exceeds the {} byte message limit",
                    self.max_message
                )));
            }
            let mut buf = self
                .bulk
                .get(len)
                .map_err(|e| Status::resource_exhausted(format!("bulk buffer: {e}")))?;
            if msg.encode_into(buf.as_mut_slice()).is_none() {
                return Err(Status::internal("stream message encoding failed"));
            }
            let staged = self.stage(slot, &md, &NoMsg)?;
            // Only this call's pump counts loans up; the driver counts them down.
            cell.loans.fetch_add(1, Ordering::AcqRel);
            (staged, Some(buf))
        };
        // Only this call's pump takes window (one message at a time); the driver only gives.
        let _ = cell
            .window
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| w.checked_sub(1));
        self.stream_sends.push(StreamSend {
            idx,
            generation,
            staged: Some(staged),
            bulk,
        });
        self.kick();
        Ok(())
    }

    pub(super) fn dead_status_or_ended(&self) -> Status {
        if self.is_dead() {
            self.dead_status()
        } else {
            Status::cancelled("the call ended before its stream was sent")
        }
    }

    /// Half-closes the client stream.
    pub(super) fn send_end(&self, idx: u32, generation: u32) {
        if self.call_live(idx, generation) {
            self.stream_sends.push(StreamSend {
                idx,
                generation,
                staged: None,
                bulk: None,
            });
            self.kick();
        }
    }

    /// Sends every message of `stream`, then the end of the stream. Stops (and drops the
    /// stream) as soon as the call is over: the server answered, the call was cancelled or
    /// expired, or the connection died; also while the stream has nothing to give, since
    /// the end of the call wakes the cell's `send_waker`.
    pub(super) async fn pump<S>(&self, idx: u32, generation: u32, stream: S)
    where
        S: futures_core::Stream + Send,
        S::Item: Message,
    {
        let cell = self.cells.get(idx);
        let mut stream = std::pin::pin!(stream);
        loop {
            let next = std::future::poll_fn(|cx| {
                if !self.call_live(idx, generation) {
                    return Poll::Ready(None);
                }
                cell.send_waker.register(cx.waker());
                if !self.call_live(idx, generation) {
                    return Poll::Ready(None);
                }
                match stream.as_mut().poll_next(cx) {
                    Poll::Ready(item) => Poll::Ready(Some(item)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match next {
                None => return,
                Some(None) => break,
                Some(Some(item)) => {
                    if self.send_item(idx, generation, &item).await.is_err() {
                        return;
                    }
                }
            }
        }
        self.send_end(idx, generation);
    }

    /// A server-streaming call.
    pub(crate) async fn server_streaming<Req, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: &mut Request<Req>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let registered = request.take_registered();
        let timeout = request.timeout();
        let (_, _, streaming) = self
            .start_stream::<Resp>(
                method,
                request.metadata(),
                request.get_ref(),
                timeout,
                registered,
            )
            .await?;
        let streaming = streaming.ok_or_else(|| Status::internal("no stream"))?;
        // Return with the response headers, as tonic does: they come with the first message
        // or the end (the request is complete, so waiting cannot deadlock the caller).
        streaming.started().await?;
        let metadata = streaming.metadata().cloned().unwrap_or_default();
        Ok(Response::from_parts(metadata, streaming))
    }

    /// A client-streaming call: sends the stream, then waits for the response.
    pub(crate) async fn client_streaming<S, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Resp>, Status>
    where
        S: futures_core::Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        let (metadata, stream, timeout) = request.into_parts();
        let (idx, generation, _) = self
            .start_stream::<Resp>(method, &metadata, &NoMsg, timeout, None)
            .await?;
        let guard = CellGuard::new(self, idx, generation, true);
        self.pump(idx, generation, stream).await;
        let outcome = self.outcome(idx).await;
        let mut guard = guard;
        guard.submitted = false;
        decode_outcome::<P, Resp>(outcome)
    }

    /// A bidirectional-streaming call: the request stream is sent by a task of its own while
    /// the caller reads the responses.
    pub(crate) async fn streaming<S, Resp>(
        self: &Arc<Self>,
        method: &'static MethodDesc,
        request: Request<S>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        S: futures_core::Stream + Send + 'static,
        S::Item: Message,
        Resp: Message + Default,
    {
        let (metadata, stream, timeout) = request.into_parts();
        let (idx, generation, streaming) = self
            .start_stream::<Resp>(method, &metadata, &NoMsg, timeout, None)
            .await?;
        let streaming = streaming.ok_or_else(|| Status::internal("no stream"))?;
        let core = Arc::clone(self);
        tokio::spawn(async move { core.pump(idx, generation, stream).await });
        Ok(Response::new(streaming))
    }
}

/// The host of a client-side inbox: owns the call's cell for as long as the stream lives.
pub(super) struct CallHost<P: Provider> {
    core: Arc<ClientCore<P>>,
    idx: u32,
    generation: u32,
}

impl<P: Provider> InboxHost for CallHost<P> {
    fn grant(&self, n: u32) {
        self.core.grants.push((self.idx, self.generation, n));
        self.core.kick();
    }

    fn abandon(&self) {
        let core = &self.core;
        let cell = core.cells.get(self.idx);
        if cell.generation.load(Ordering::Acquire) != self.generation {
            return;
        }
        match cell.mb.cancel() {
            crate::buf::CancelOutcome::ToDriver => {
                let _ = core.cancelled.push((self.idx, self.generation));
                core.kick();
            }
            crate::buf::CancelOutcome::Caller => core.release_cell(self.idx),
        }
        // A bidi call's pump waiting for the request stream learns the call is over.
        cell.send_waker.wake();
    }

    fn waiting(&self, _cx: &mut std::task::Context<'_>) {
        if self.core.mode == ClientPoller::Caller {
            // A chance to see our messages at once; the driver task keeps polling meanwhile.
            self.core.progress();
        }
    }
}

impl<P: Provider> Driver<P> {
    /// Drops a client stream message that will not be sent.
    pub(super) fn discard(&self, ss: StreamSend<P>) {
        if let Some(st) = ss.staged {
            self.link.arena.release_send(st.slot);
        }
    }

    /// Routes a client stream message to its call's queue (or holds it until the call's
    /// request is sent).
    pub(super) fn route_stream_send(
        &mut self,
        core: &ClientCore<P>,
        ss: StreamSend<P>,
    ) -> Result<(), LinkError> {
        let cell = core.cells.get(ss.idx);
        if cell.generation.load(Ordering::Acquire) != ss.generation || cell.mb.is_cancelled() {
            self.discard(ss);
            return Ok(());
        }
        match self.cell_slot[ss.idx as usize] {
            Some(slot) => {
                let slot = slot as usize;
                self.calls[slot].out.push_back(ss);
                self.flush_out(slot)
            }
            None => {
                // No wire slot yet: the request is still queued (in `pending`, or submitted and
                // not taken yet: the caller's submission and this message can race past one
                // `step`), or the call is over. A running mailbox means not started.
                if cell.mb.is_running() {
                    self.stream_pending.push_back(ss);
                } else {
                    self.discard(ss);
                }
                Ok(())
            }
        }
    }

    /// Sends the call's queued stream messages while window and credit last.
    pub(super) fn flush_out(&mut self, slot: usize) -> Result<(), LinkError> {
        let call = self.calls[slot].id;
        while let Some(mut ss) = self.calls[slot].out.pop_front() {
            let (idx, generation) = (ss.idx, ss.generation);
            // A large message is lent to the server (remote READ, this connection only) when it
            // goes out; its key is revoked by the server's BulkRelease.
            let lend_failed = match ss.bulk.as_mut() {
                Some(b) if !b.is_lent() => lend_read(b, &self.link.qp).is_err(),
                _ => false,
            };
            let r = match ss.staged {
                None => match self
                    .link
                    .send_frame(&Metadata::new(), &NoMsg, |w, _, _| w.end_of_stream(call))
                {
                    Ok(()) => Ok(()),
                    Err(FrameError::Busy) => Err(None),
                    Err(FrameError::Link(e)) => return Err(e),
                    Err(_) => Err(Some(())),
                },
                Some(st) if lend_failed => {
                    // No key for the server to READ the message with: the message fails.
                    self.link.discard(st);
                    Err(Some(()))
                }
                Some(st) => {
                    let desc_of = ss.bulk.as_ref().and_then(BulkBuf::lent).map(desc);
                    match self
                        .link
                        .commit(st, |w, pl, ml| w.stream_message(call, pl, ml, desc_of))
                    {
                        Ok(()) => {
                            if let Some(b) = ss.bulk {
                                self.calls[slot].stream_lent.lend(b);
                            }
                            Ok(())
                        }
                        Err(CommitError::NoCredit(st)) => {
                            self.calls[slot].out.push_front(StreamSend {
                                staged: Some(st),
                                ..ss
                            });
                            if !self.out_calls.contains(&slot) {
                                self.out_calls.push(slot);
                            }
                            return Ok(());
                        }
                        Err(CommitError::Refused(_)) => Err(Some(())),
                        Err(CommitError::Link(e)) => return Err(e),
                    }
                }
            };
            match r {
                Ok(()) => {}
                Err(None) => {
                    // No credit or slot for the EndOfStream: try again later.
                    self.calls[slot].out.push_front(StreamSend {
                        idx,
                        generation,
                        staged: None,
                        bulk: None,
                    });
                    if !self.out_calls.contains(&slot) {
                        self.out_calls.push(slot);
                    }
                    return Ok(());
                }
                Err(Some(())) => {
                    // The call ended: nothing more of its stream goes out.
                    let rest = std::mem::take(&mut self.calls[slot].out);
                    for ss in rest {
                        self.discard(ss);
                    }
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}
